r"""Speculative decoding on real text, measured against plain decoding and its theory.

    python -m experiments.speculative                      # t = 512, 4K; k = 1, 2, 4; B = 1
    python -m experiments.speculative --contexts=512,4096,16384 --ks=1,2,4,8 --batches=1,8
    python -m experiments.speculative --drafters=ngram --ks=4 --contexts=512 --quick
    python -m experiments.speculative --prompts=chat --contexts=512,4096  # questions

For each context t and batch B, B prompts of t tokens are cut from the held-out Django
documents (the evaluation corpus: real text, different documents per row; with
``--prompts=chat``, the chat template around an excerpt and a question about it) and decoded for
``--new_tokens`` tokens, greedily, by plain decoding (one compiled loop) and by each
drafter and k (one compiled speculative loop: draft, verify, accept, take back). Per point:

* acceptance rate (drafts accepted / verified; over the batch, and per row as
  ``acceptance_per_row``: rows read different documents), tokens per verify step, the emitted tokens
  (checked equal to plain decoding's: greedy speculative decoding is exact), and the
  distinct tokens of each row's plain continuation (``plain_distinct_tokens_per_row``;
  a note is printed where a row holds at most :data:`DEGENERATE_DISTINCT`: a repeated
  token, which any draft predicts); ``beyond_context_length`` where t + new_tokens
  passes the positions the checkpoint was trained for (a note too: past them the
  model's continuation is not real text);
* measured loop time per emitted token (the compiled loop; compilation excluded), and the
  speedup over plain decoding's loop;
* the parts, each compiled on its own and timed on the prefilled cache (each takes its
  positions back, so it can be repeated): a plain step, a verify step of k + 1 positions,
  a draft step; the speedup those parts predict, E·T_step / (T_verify + k·T_draft), with
  E the measured tokens per verify step. Each (drafter, k) times its five programs (both
  loops, the three steps) in turn, ``--repeats`` rounds after a warm-up, and takes
  medians: the ratios then compare programs timed in the same minutes;
* theory (``kvjax.analysis.speculative``): bytes of each step (and of the window copy of
  a draft over the target's keys), and the predicted speedup at the measured acceptance
  with every time from bytes at the plain step's achieved bandwidth (memory-bound, the
  blog's: ``speedup_theory``), so the row shows where measured and theory part. Beside
  it the same with the machine's float32 peak (measured once before the first point,
  ``kvjax.analysis.hardware.local_chip``): the roofline, reads and arithmetic
  overlapped (``speedup_theory_roofline``), and serial, one after the other
  (``speedup_theory_serial``, the bandwidth refitted so the plain step stays the
  measured one): the verify step's k + 1 times the FLOPs is where a machine whose ridge
  is a few FLOP/byte (a 2-core CPU) leaves the memory-bound theory.

Drafters: 'ngram' (prompt lookup, no model) and 'self' (the same weights over a window of
``--config.speculative.draft_window_size`` with ``draft_sink_tokens`` sinks: constant in
t; its own cache, prefilled by the windowed model, or with
``--config.speculative.draft_kv_source=target`` the target's own keys: read in place,
a mask over its dense rows, where the native decode attention runs (JSON key
``SelfDrafter.in_place``), else a copy of the target's window made every round; with
``--config.speculative.draft_weight_dtype=int8`` over an int8 copy of the weights, a
quarter of their bytes). Writes ``<out_dir>/speculative.json`` and a plot of measured against predicted
speedup (``speculative.png``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import cli
from kvjax import planner
from kvjax.analysis import hardware, report, theory
from kvjax.analysis import speculative as spec_theory
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, SamplingConfig, run_config_from_dict
from kvjax.inference import decode, ragged, runner
from kvjax.inference import speculative as S
from kvjax.models import model as model_lib
from kvjax.training import data

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Experiment config file (get_config())."),
    lock_config=True)
_CONTEXTS = flags.DEFINE_list("contexts", ["512", "4096"], "Contexts t (prompt tokens).")
_KS = flags.DEFINE_list("ks", ["1", "2", "4"], "Drafts per verify step.")
_BATCHES = flags.DEFINE_list("batches", ["1"], "Batch sizes B.")
_DRAFTERS = flags.DEFINE_list("drafters", ["ngram", "self"], "Drafters: ngram, self.")
_NEW = flags.DEFINE_integer("new_tokens", 64, "Tokens decoded per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs of each program (median).")
_CHUNK = flags.DEFINE_integer("prefill_chunk", 2048, "Prefill chunk (tokens).")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: 24 new tokens, 1 repeat.")
_PROMPTS = flags.DEFINE_enum(
    "prompts", "corpus", ["corpus", "chat"],
    "'corpus': t tokens of a held-out document (the model continues it); 'chat': the "
    "checkpoint's chat template around a held-out excerpt and a question about it "
    "(the model answers), t tokens in all.")
_OUT = flags.DEFINE_string("out_dir", "results/speculative", "Where the results go.")


def _ints(name, values, minimum=1):
    try:
        out = [int(v) for v in values]
    except ValueError:
        out = []
    if not out or min(out) < minimum:
        raise app.UsageError(f"--{name}={','.join(values)}; allowed: integers >= {minimum}")
    return out


QUESTIONS = (
    "Summarize what the documentation above explains.",
    "Which functions, settings or commands does the text above mention, and what does "
    "each one do?",
    "Explain the last part of the text above in your own words.",
    "What would a developer do, step by step, to apply what is described above?",
)


def chat_prompts(tokenizer, t: int, batch: int, stream=None) -> list:
    """``batch`` chat prompts of exactly ``t`` tokens: the checkpoint's chat template
    (its default system turn) around a user turn holding a held-out excerpt (different
    documents per row, as :func:`corpus_prompts`) and a question about it
    (:data:`QUESTIONS`, cycled). The excerpt is cut at the token level so every row has
    t tokens; the user's text is plain text (``Tokenizer.chat_ids``). ``stream``: the
    token ids to cut from (default: the held-out corpus).

    Raises:
      ValueError: no chat template, or t too short for the scaffolding and a question.
    """
    if not tokenizer.chat_template:
        raise ValueError("--prompts=chat: the checkpoint carries no chat template; "
                         "allowed: --prompts=corpus")
    mark = tokenizer.encode("\u00a7")  # the content's ids sit between the scaffolding's
    ids = tokenizer.chat_ids("\u00a7")[1]
    at = next(i for i in range(len(ids)) if ids[i:i + len(mark)] == mark)
    prefix, suffix = ids[:at], ids[at + len(mark):]
    if stream is None:
        stream = data.tokenized_corpus(tokenizer, train=False).heldout
    out = []
    for b in range(batch):
        question = tokenizer.encode("\n\nQuestion: " + QUESTIONS[b % len(QUESTIONS)])
        n = t - len(prefix) - len(suffix) - len(question)
        if n < 1 or len(stream) < n + 1:
            raise ValueError(f"--contexts value {t} with --prompts=chat; allowed: more "
                             f"than {len(prefix) + len(suffix) + len(question)} tokens and "
                             f"fewer than the held-out corpus's {len(stream)}")
        s = b * (len(stream) - n) // max(batch, 1)
        out.append(prefix + list(map(int, stream[s:s + n])) + question + suffix)
    return out


def corpus_prompts(tokenizer, t: int, batch: int) -> list:
    """``batch`` prompts of ``t`` tokens from the held-out corpus stream, one per stretch
    of the stream (row b starts at b·len/batch), so rows read different documents.

    Raises:
      ValueError: the held-out stream is shorter than one prompt.
    """
    stream = data.tokenized_corpus(tokenizer, train=False).heldout
    if len(stream) < t + 1:
        raise ValueError(f"--contexts value {t}: the held-out corpus holds {len(stream)} "
                         "tokens; allowed: fewer")
    starts = [b * (len(stream) - t) // max(batch, 1) for b in range(batch)]
    return [list(map(int, stream[s:s + t])) for s in starts]


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each of ``fns`` ({name: fn returning arrays}), timed in turn:
    one warm-up round, then ``repeats`` rounds calling each once. Timed in turn, not
    each program's repeats in a row: a shared machine's speed can move between minutes
    (docs/results/amd-epyc-avx512-2core.md), and a drift then falls on every program
    alike, so their ratios (speedup, verify / plain step) hold. A value of ``fns`` may be
    a pair (prepare, run): ``prepare()`` runs untimed (a copy of the prefilled cache that
    a loop donates) and only ``run(prepare())`` is timed."""
    out = {n: [] for n in fns}
    for r in range(repeats + 1):
        for n, fn in fns.items():
            prepare, run = fn if isinstance(fn, tuple) else (None, fn)
            args = () if prepare is None else (jax.block_until_ready(prepare()),)
            start = time.perf_counter()
            jax.block_until_ready(run(*args))
            if r:
                out[n].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in out.items()}


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


def step_program(params, tokens, cache, *, cfg):
    """A forward of the chunk ``tokens`` [B, T] at each row's length, then its positions
    taken back: the cost of one plain (T = 1), verify (T = k + 1) or draft step, with
    the cache returned unchanged so it can run again."""
    length = cache.length
    pos = length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = model_lib.forward(params, cfg, tokens, pos, cache,
                                      num_valid=jnp.full(length.shape, tokens.shape[1]))
    return logits[:, -1], S.take_back(cache, length)


_step = jax.jit(step_program, static_argnames=("cfg",), donate_argnames=("cache",))


def step_runner(params, cfg, state: dict, t_tokens: int):
    """A call of :func:`step_program` with a chunk of ``t_tokens`` tokens over
    ``state['cache']`` (donated and put back: the step takes its positions back, so
    steps of any T can share one cache)."""
    tokens = jnp.ones((state["cache"].batch_size, t_tokens), jnp.int32)

    def run():
        out, state["cache"] = _step(params, tokens, state["cache"], cfg=cfg)
        return out

    return run


DEGENERATE_DISTINCT = 2
"""A plain continuation with at most this many distinct tokens is degenerate text (e.g.
SmolLM2-135M's 64 newlines after a 16K chat prompt): every draft is accepted there."""


def past_context_length(context_length: int | None, t: int, new_tokens: int) -> bool:
    """Whether t + new_tokens positions pass the checkpoint's trained ``context_length``
    (None: unknown, False); prints a note where they do. The main job refuses such a
    dense cache (``runner.check_checkpoint``); this experiment times it, but past the
    trained positions the model's text is not real text (SmolLM2-135M, trained for
    8,192, continues the first 16,384 held-out tokens with newlines only), so such
    rows' acceptance and speedup do not measure drafting on real text: JSON key
    ``beyond_context_length``."""
    past = bool(context_length) and t + new_tokens > context_length
    if past:
        print(f"note: t={t} + {new_tokens} new tokens pass the checkpoint's "
              f"context_length={context_length} (positions past it were never trained): "
              "the continuation is not real text, so acceptance and speedup there do not "
              "measure drafting on real text", flush=True)
    return past


def distinct_tokens(tokens) -> list[int]:
    """Distinct token ids of each row of ``tokens`` [B, N] (int)."""
    return [len(set(map(int, row))) for row in np.asarray(tokens)]


def point(loaded, run, prompts, drafters, ks, new_tokens, repeats, chunk,
          flops_per_s: float | None = None) -> list:
    """Every (drafter, k) at one (t, B): rows of measured and predicted figures.
    ``flops_per_s``: the machine's float32 peak (FLOP/s; None: unknown), for the
    roofline and serial theories beside the memory-bound one."""
    cfg0, params = loaded.cfg, loaded.params
    b, t = len(prompts), len(prompts[0])
    max_len = t + new_tokens + 1
    rows_needed = tuple(sorted({b * min(chunk, t), b * (t % chunk or chunk), b, 2 * b}))
    cfg = planner.resolve(cfg0, max_seq_len=max_len, batch_sizes=(b,), rows=rows_needed,
                          queries=tuple(k + 1 for k in ks))
    tokens = jnp.asarray(prompts, jnp.int32)
    sampling = SamplingConfig()

    k_max, prefills = max(ks), {}

    def prefilled(who, c, p):
        """The prompts prefilled into ``c``'s speculative cache (room for k_max drafts:
        enough for every k), once per model: the target's is also plain decoding's, and
        every k reuses both. Keyed by ``who``, not by ``p``: a 'self' draft keeping every
        layer shares the target's very arrays, and its cache is another kind. Callers
        copy it before donating it."""
        if who not in prefills:
            init = S.init_target_cache if who == "target" else S.init_draft_cache
            cache = init(c, b, max_len, k_max)
            logits, cache = decode.prefill_chunked(p, c, tokens, cache, chunk)
            prefills[who] = jnp.argmax(logits, -1).astype(jnp.int32), cache
        return prefills[who]

    first, base = prefilled("target", cfg, params)
    steps = new_tokens - 1
    prog = ragged.generate_ragged_program.lower(
        params, first, _copy(base), jnp.full((b,), steps, jnp.int32),
        ragged.row_keys_for(None, b), jnp.asarray([-1], jnp.int32), cfg=cfg,
        sampling=sampling, buf_len=steps).compile()
    state = {}

    def plain_loop(cache):  # (a copy of the prefilled cache: the program donates it)
        buf, count, cache = prog(params, first, cache, jnp.full((b,), steps, jnp.int32),
                                 ragged.row_keys_for(None, b), jnp.asarray([-1], jnp.int32))
        state["plain"] = np.asarray(buf)
        return buf

    plain_loop(_copy(base))  # its tokens (each row's timing below runs it again, in turn)
    distinct = distinct_tokens(state["plain"][:, :steps])
    few = [i for i, n in enumerate(distinct) if n <= DEGENERATE_DISTINCT]
    if few and steps >= 8:
        print(f"note: t={t}: the plain continuation of row(s) {few} holds at most "
              f"{DEGENERATE_DISTINCT} distinct tokens ({distinct}): any draft accepts a "
              "repeated token, so those rows' acceptance and speedup do not measure "
              "drafting on real text", flush=True)
    out = []
    for drafter in drafters:
        for k in ks:
            spec = dataclasses.replace(run.speculative, drafter=drafter, k=k)
            dcfg = dparams = None
            if drafter == "self":  # one draft config for every k: its cache is shared
                dparams, dcfg = S.self_draft(params, cfg0, spec)
                dcfg = planner.resolve(dcfg, max_seq_len=max_len + k_max + 1,
                                       batch_sizes=(b,), rows=rows_needed)
            f1, tcache = prefilled("target", cfg, params)
            shared = spec.copies_target_window
            dcache = None if dcfg is None or shared else prefilled("self", dcfg, dparams)[1]
            draft = None if dcfg is None else (dparams, dcfg, dcache)
            compiled = S.compile_program(params, cfg, spec, prompts, f1, tcache, steps,
                                         draft=draft, sampling=sampling)
            res = {}

            def spec_caches():  # copies of the prefilled caches, made untimed
                return _copy(tcache), None if dcfg is None or shared else _copy(dcache)

            def spec_loop(caches):
                tc, dc = caches
                d = None if dcfg is None else (dparams, dcfg, dc)
                res["out"] = S.generate(params, cfg, spec, prompts, f1, tc, steps,
                                        draft=d, sampling=sampling, compiled=compiled)[:2]
                # (the caches it returns are dropped: at B = 8, t = 16K each is 6 GB)
                return f1

            # every program of the row timed in turn (_interleaved): the loops, and the
            # parts over one copy of the prefilled cache (each step takes its positions
            # back); the draft step over its own cache or the window a round copies
            steps_state = {"cache": _copy(tcache)}
            # (the loops donate their caches: each call's copy is made untimed)
            fns = {"plain": (lambda: _copy(base), plain_loop),
                   "spec": (spec_caches, spec_loop),
                   "step": step_runner(params, cfg, steps_state, 1),
                   "verify": step_runner(params, cfg, steps_state, k + 1)}
            dwin = None
            method = S.drafter_for(spec, dcfg)
            icfg = method.in_place(cfg, b, tcache.num_slots)
            if icfg is not None:  # the draft step over the target's slots, in place
                dwin = _copy(tcache)
                fns["draft"] = step_runner(dparams, icfg, {"cache": dwin}, 1)
            elif dcfg is not None:
                # (copied: the window may hold the target cache's own length array)
                dwin = _copy(S.draft_window(tcache, cfg, dcfg, k) if shared else dcache)
                fns["draft"] = step_runner(dparams, dcfg, {"cache": dwin}, 1)
            sec = _interleaved(fns, repeats)
            del steps_state, fns
            plain_s, spec_s = sec["plain"], sec["spec"]
            plain_step_s, verify_s = sec["step"], sec["verify"]
            draft_s = sec.get("draft", 0.0)
            got, stats = res["out"][0], res["out"][1]
            equal = all(list(map(int, state["plain"][i, :steps])) == got[i]
                        for i in range(b))
            e = stats.tokens_per_step
            copy_slots, dweights = method.costs(in_place=icfg is not None)
            r, roof, serial = theories(cfg, t, k, b, plain_step_s, flops_per_s, dcfg,
                                       copy_slots, dweights)
            a_eff = spec_theory.acceptance_from_tokens_per_step(min(max(e, 1.0), k + 1), k)
            e_th = spec_theory.expected_tokens(a_eff, k)
            missing = None  # no peak (or no serial fit): null in the JSON, '-' in the table
            out.append({
                "t": t, "batch": b, "drafter": drafter, "k": k,
                "draft_window_size": dcfg.window_size if dcfg is not None else None,
                "draft_cache_slots": dwin.num_slots if dwin is not None else None,
                "draft_kv_source": spec.draft_kv_source if dcfg is not None else None,
                "draft_in_place": icfg is not None,
                "draft_weight_dtype": spec.draft_weight_dtype if dcfg is not None else None,
                "equal_to_plain": equal, "plain_distinct_tokens_per_row": distinct,
                "acceptance_rate": stats.acceptance_rate,
                "acceptance_per_row": [a / max(p, 1) for a, p in zip(stats.accepted,
                                                                     stats.proposed)],
                "tokens_per_step": e, "rounds": sum(stats.rounds),
                "plain_loop_s": plain_s, "spec_loop_s": spec_s,
                "speedup_measured": plain_s / spec_s,
                "plain_step_s": plain_step_s, "verify_step_s": verify_s,
                "draft_step_s": draft_s,
                "speedup_from_parts": e * plain_step_s / (verify_s + k * draft_s),
                "speedup_theory": e_th * r.plain_s / r.round_s,
                "speedup_theory_roofline": e_th * roof.plain_s / roof.round_s if roof else missing,
                "speedup_theory_serial": e_th * serial.plain_s / serial.round_s
                if serial else missing,
                "achieved_bytes_per_s": r.plain_bytes / plain_step_s,
                "flops_per_s": flops_per_s,
                "theory_plain_bytes": r.plain_bytes, "theory_verify_bytes": r.verify_bytes,
                "theory_draft_bytes": r.draft_bytes, "theory_copy_bytes": r.copy_bytes,
                "theory_bytes_per_emitted_token": r.bytes_per_emitted_token(a_eff),
                "verify_over_plain_measured": verify_s / plain_step_s,
                "verify_over_plain_theory": r.verify_s / r.plain_s,
                "verify_over_plain_roofline": roof.verify_s / roof.plain_s if roof else missing,
                "verify_over_plain_serial": serial.verify_s / serial.plain_s
                if serial else missing,
                "draft_over_plain_measured": draft_s / plain_step_s,
                "draft_over_plain_theory": r.draft_s / r.plain_s,
                "draft_over_plain_serial": serial.draft_s / serial.plain_s
                if serial else missing,
            })
            print(table(out[-1:]), flush=True)
    return out


def theories(cfg, t: int, k: int, b: int, plain_step_s: float,
             flops_per_s: float | None, dcfg, copy_slots: int,
             draft_weights: int | None = None):
    """The round's times by three theories (:func:`kvjax.analysis.speculative.round_times`),
    each from the measured plain step: memory-bound (the blog's: bytes at the plain
    step's achieved bandwidth), the roofline (the same bandwidth, FLOPs at
    ``flops_per_s``, overlapped: its plain step is the measured one while that step is
    memory-bound at this peak) and serial (FLOPs at ``flops_per_s`` added to the
    reads, the bandwidth refitted so the plain step is still the measured one). The
    last two are None without a peak, or (serial) where the plain step's FLOPs alone
    take longer than it did. ``draft_weights``: the draft's weight bytes where they are
    not its config's dtype (an int8 draft's)."""
    nbytes = theory.step_bytes(cfg, t, b).total
    bw = nbytes / plain_step_s
    kw = dict(draft_cfg=dcfg, batch=b, copy_slots=copy_slots, draft_weights=draft_weights)
    r = spec_theory.round_times(cfg, t, k, bw, **kw)
    if not flops_per_s:
        return r, None, None
    roof = spec_theory.round_times(cfg, t, k, bw, flops_per_s, **kw)
    mem_s = plain_step_s - theory.step_flops(cfg, t + 1, b).total / flops_per_s
    serial = None if mem_s <= 0 else spec_theory.round_times(
        cfg, t, k, nbytes / mem_s, flops_per_s, overlap=False, **kw)
    return r, roof, serial


COLUMNS = (("t", "t"), ("batch", "B"), ("drafter", "drafter"), ("k", "k"),
           ("equal_to_plain", "= plain"), ("acceptance_rate", "accept"),
           ("tokens_per_step", "tok/step"), ("speedup_measured", "speedup"),
           ("speedup_from_parts", "from parts"), ("speedup_theory", "theory"),
           ("speedup_theory_serial", "serial"),
           ("verify_over_plain_measured", "verify/step"),
           ("verify_over_plain_theory", "theory"), ("verify_over_plain_serial", "serial"),
           ("draft_over_plain_measured", "draft/step"), ("draft_over_plain_theory", "theory"))


def table(rows) -> str:
    return report.format_table([tuple("-" if r[c] is None else r[c] for c, _ in COLUMNS)
                                for r in rows],
                               tuple(h for _, h in COLUMNS))


def plot(rows, path: str) -> None:
    """Measured against predicted speedup, one point per row, the diagonal drawn."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(5.5, 4.5))
    for drafter, marker in (("ngram", "o"), ("self", "s")):
        pts = [r for r in rows if r["drafter"] == drafter]
        if pts:
            sc = ax.scatter([r["speedup_theory"] for r in pts],
                            [r["speedup_measured"] for r in pts],
                            c=[np.log2(r["t"]) for r in pts], marker=marker, label=drafter,
                            cmap="viridis")
    hi = max([1.5] + [max(r["speedup_theory"], r["speedup_measured"]) for r in rows]) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.8)
    ax.axhline(1, color="grey", lw=0.5)
    ax.set_xlabel("predicted speedup (memory-bound roofline, measured acceptance)")
    ax.set_ylabel("measured speedup over plain decoding")
    ax.legend()
    if rows:
        fig.colorbar(sc, ax=ax, label="log2 context t")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    contexts, ks = _ints("contexts", _CONTEXTS.value), _ints("ks", _KS.value)
    batches = _ints("batches", _BATCHES.value)
    bad = [d for d in _DRAFTERS.value if d not in ("ngram", "self")]
    if bad or not _DRAFTERS.value:
        raise app.UsageError(f"--drafters={','.join(_DRAFTERS.value)}; allowed: ngram, self")
    new_tokens, repeats = _NEW.value, _REPEATS.value
    if _QUICK.value:
        new_tokens, repeats = 24, 1
    if new_tokens < 2 or repeats < 1:
        raise app.UsageError(f"--new_tokens={new_tokens} and --repeats={repeats}; allowed: "
                             ">= 2 and >= 1")
    try:
        d = _CONFIG.value
        run = run_config_from_dict(d)
        spec = dataclasses.replace(run.speculative, drafter="self")  # validates the draft
        loaded = runner.load(run, progress=False)
        chip = hardware.local_chip(measure_flops=True)  # once, before any point
        flops_per_s = chip.peak_flops("float32")
        print(f"machine: {hardware.device_name()}; float32 peak "
              f"{(flops_per_s or float('nan')) / 1e9:.0f} GFLOP/s ({chip.source})", flush=True)
        rows = []
        for t in contexts:
            past = past_context_length(loaded.context_length, t, new_tokens)  # once per t
            for b in batches:
                make = chat_prompts if _PROMPTS.value == "chat" else corpus_prompts
                prompts = make(loaded.tokenizer, t, b)
                got = point(loaded, dataclasses.replace(run, speculative=spec), prompts,
                            _DRAFTERS.value, ks, new_tokens, repeats, _CHUNK.value,
                            flops_per_s)
                rows += [dict(r, prompts=_PROMPTS.value, beyond_context_length=past)
                         for r in got]
    except (ConfigError, WeightsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("all points:")
    print(table(rows))
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "speculative.json")
    with open(path, "w") as f:
        json.dump({"machine": hardware.device_name(), "flops_per_s": flops_per_s,
                   "prompts": _PROMPTS.value,
                   "new_tokens": new_tokens,
                   "repeats": repeats, "rows": rows}, f, indent=2)
    plot(rows, os.path.join(_OUT.value, "speculative.png"))
    print(f"wrote {path} and speculative.png")
    return 0


if __name__ == "__main__":
    cli.run(main)
