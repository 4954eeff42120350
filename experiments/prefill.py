r"""The prefill sweep: prompt length T against time, tokens/s, compiled bytes and FLOPs
beside theory, and peak scratch memory, for the native, the tiled and the dense prompt
attention.

    python -m experiments.prefill                                  # T = 128 ... 8K
    python -m experiments.prefill --contexts=1571 --max_seq_len=2048 --repeats=3
    python -m experiments.prefill --contexts=1024,4096,8192 --time=false   # compiled only
    python -m experiments.prefill --peers=llamacpp                 # + llama.cpp prompt speed

SmolLM2-135M shapes (``configs/gqa.py``: GQA N = 9, K = 3), float32, random weights
(timing does not depend on the values), batch 1, a cache of ``--max_seq_len`` slots
(default: T). Per point: XLA's compiled FLOP and bytes of ``decode.prefill``'s program
(an empty cache, loop-corrected; compiled with the analysis options, so deterministic),
theory (``costs.analyze_prefill``: causal FLOP with the LM head for the last token;
bytes = weights + KV written + the implementation's attention IO, standard Θ(T·d + T²)
or tiled), XLA's temp bytes (``memory_analysis``: the program's peak scratch), and the
median of ``--repeats`` timed prefills (after one warm-up; the implementations of one T
run in turn, interleaved) as time to first token and prompt tokens/s. The native path's
attention is a custom call XLA cannot cost: its columns add the kernel's operand + result
bytes and its causal FLOP by theory (``costs.prefill_with_kernel``; 'XLA(+kernel)'). ``--dense_max`` caps the T at which the dense path is timed (its
[N, T, S] scores: 2.4 GB a layer at 8K). llama.cpp (optional, ``pip install
llama-cpp-python``) runs the float32 copy of the SmolLM2 GGUF, 2 threads, f32 KV.
Writes ``<out_dir>/prefill.json``.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from configs import gqa
from experiments import cli, peers
from kvjax import cache as cache_lib
from kvjax import checkpoints
from kvjax.analysis import costs, report
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.inference import decode
from kvjax.models import flash, model

_CONTEXTS = flags.DEFINE_list("contexts", ["128", "512", "1024", "2048", "4096", "8192"],
                              "Prompt lengths T (tokens).")
_IMPLS = flags.DEFINE_list("impls", ["native", "tiled", "dense"],
                           "Prompt attention paths (model.prefill_impl values).")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", None, "Cache slots (default: T).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed prefills per point (median).")
_TIME = flags.DEFINE_bool("time", True, "Time the prefills (else compiled figures only).")
_DENSE_MAX = flags.DEFINE_integer("dense_max", 4096, "Largest T the dense path is timed at.")
_PEERS = flags.DEFINE_list("peers", [], "llamacpp: llama.cpp's prompt speed (optional).")
_OUT = flags.DEFINE_string("out_dir", "results/prefill", "Where prefill.json goes.")


def point(cfg, t: int, max_seq_len: int) -> dict:
    """Compiled figures of one T (theory, XLA, and XLA with the custom call counted),
    with ``cfg``'s plan (resolved here when it has none)."""
    cfg = costs.planned(cfg, 1, max_seq_len, (t,))
    step = costs.analyze_prefill(cfg, t, max_seq_len)
    parts = step.theory_parts["bytes"]
    flops_k, bytes_k = costs.prefill_with_kernel(step)
    return {"impl": cfg.prefill_impl, "path": flash.prefill_path(cfg), "T": t,
            "max_seq_len": max_seq_len, "theory_flops": step.theory_flops,
            "xla_flops": step.xla.flops, "flops_ratio": step.flops_ratio,
            "theory_bytes": step.theory_bytes, "xla_bytes": step.xla.bytes,
            "bytes_ratio": step.bytes_ratio,
            "bytes_ratio_weights_kv": step.xla.bytes / (parts["weights"] + parts["kv_write"]),
            "bytes_ratio_with_activations": costs.prefill_bytes_over_activations(step),
            "custom_call": step.theory_parts.get("custom_call"),
            "xla_kernel_flops": flops_k, "flops_ratio_kernel": flops_k / step.theory_flops,
            "xla_kernel_bytes": bytes_k, "bytes_ratio_kernel": bytes_k / step.theory_bytes,
            "theory_parts": parts, "temp_bytes": step.memory.get("temp_bytes"),
            "xla_complete": step.xla.complete}


def time_interleaved(cfgs, t: int, max_seq_len: int, repeats: int) -> dict:
    """{prefill_impl: [seconds]}: one warm-up each, then ``repeats`` rounds that run
    every config's compiled prefill once in turn (so machine noise hits all alike)."""
    cfgs = [costs.planned(c, 1, max_seq_len, (t,)) for c in cfgs]
    params = model.init_params(cfgs[0], 0)
    tokens = jnp.ones((1, t), jnp.int32)
    progs = {c.prefill_impl: (c, decode.prefill_program.lower(
        params, tokens, cache_lib.init_cache(c, 1, max_seq_len), cfg=c,
        fresh=True).compile()) for c in cfgs}
    times = {impl: [] for impl in progs}
    for i in range(repeats + 1):
        for impl, (c, prog) in progs.items():
            cache = cache_lib.init_cache(c, 1, max_seq_len)
            jax.block_until_ready(cache)
            start = time.perf_counter()
            logits, cache = prog(params, tokens, cache)
            logits.block_until_ready()
            if i:
                times[impl].append(time.perf_counter() - start)
    return times


def table(rows) -> str:
    out = [(r["impl"], r["T"], r.get("seconds", float("nan")),
            r.get("tokens_per_s", float("nan")), r["xla_kernel_flops"],
            r["flops_ratio_kernel"], r["xla_kernel_bytes"], r["bytes_ratio_kernel"],
            r["bytes_ratio_weights_kv"], r["bytes_ratio_with_activations"],
            r["temp_bytes"]) for r in rows]
    return report.format_table(out, ("impl", "T", "s (median)", "tokens/s", "XLA(+kernel) FLOP",
                                    "/theory", "XLA(+kernel) bytes", "/theory",
                                    "XLA/(weights+KV)", "/(w+KV+act.)", "temp bytes"))


def checked_args(base, contexts: list, max_seq_len: int | None, impls: list):
    """The prompt lengths (ints) and one model config per prefill implementation, or
    app.UsageError naming the bad flag value and what is allowed, before any compile:
    lengths must be positive integers, ``--max_seq_len`` (when given) at least the
    largest of them, and every ``--impls`` value a valid ``model.prefill_impl``."""
    try:
        ts = [int(x) for x in contexts]
    except ValueError:
        raise app.UsageError(f"--contexts={','.join(contexts)}; allowed: positive "
                             "integers (prompt tokens)") from None
    if not ts or min(ts) < 1:
        raise app.UsageError(f"--contexts={','.join(contexts)}; allowed: positive "
                             "integers (prompt tokens)")
    if max_seq_len is not None and max_seq_len < max(ts):
        raise app.UsageError(f"--max_seq_len={max_seq_len}; allowed: at least the largest "
                             f"--contexts value, {max(ts)} (the prompt must fit the cache)")
    try:
        cfgs = [base.replace(prefill_impl=impl) for impl in impls]
    except ConfigError as e:
        raise app.UsageError(f"--impls: {e}") from None
    return ts, cfgs


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    base = run_config_from_dict(gqa.get_config()).model
    contexts, impl_cfgs = checked_args(base, _CONTEXTS.value, _MAX_SEQ_LEN.value, _IMPLS.value)
    rows = []
    for t in contexts:
        msl = _MAX_SEQ_LEN.value or t
        cfgs = impl_cfgs
        new = [point(cfg, t, msl) for cfg in cfgs]
        timed = [c for c in cfgs if _TIME.value and (c.prefill_impl != "dense"
                                                     or t <= _DENSE_MAX.value)]
        times = time_interleaved(timed, t, msl, _REPEATS.value) if timed else {}
        for row in new:
            if row["impl"] in times:
                sec = statistics.median(times[row["impl"]])
                row.update(seconds=sec, seconds_all=times[row["impl"]], tokens_per_s=t / sec)
        rows += new
        print(table(new), flush=True)
    if "llamacpp" in _PEERS.value:
        path = peers.dense_gguf(checkpoints.weights_path(None, progress=False))
        for t in (int(x) for x in _CONTEXTS.value):
            try:
                sec = statistics.median(peers.llamacpp_prompt_seconds(path, t, _REPEATS.value))
            except ImportError:
                print("llama.cpp: not installed (pip install llama-cpp-python)")
                break
            rows.append({"impl": "llama.cpp f32", "T": t, "seconds": sec,
                         "tokens_per_s": t / sec})
            ours = [r for r in rows if r.get("T") == t and "tokens_per_s" in r
                    and "xla_flops" in r]
            best = max(ours, key=lambda r: r["tokens_per_s"], default=None)
            vs = (f"; kvjax {best['impl']} {best['tokens_per_s']:,.1f} tokens/s = "
                  f"{best['tokens_per_s'] * sec / t:.2f}x llama.cpp's" if best else "")
            print(f"llama.cpp float32 GGUF, 2 threads, T={t}: {sec:.3f} s, "
                  f"{t / sec:,.1f} tokens/s{vs}", flush=True)
    if len(contexts) > 1:  # one table per context was printed as it finished
        print("all contexts:")
        print(table([r for r in rows if "xla_flops" in r]))
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "prefill.json")
    with open(path, "w") as f:
        json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    cli.run(main)
