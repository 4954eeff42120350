r"""The prefill sweep: prompt length T against time, tokens/s, compiled bytes and FLOPs
beside theory, and peak scratch memory, for the tiled and the dense prompt attention.

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
median of ``--repeats`` timed prefills (after one warm-up) as time to first token and
prompt tokens/s. ``--dense_max`` caps the T at which the dense path is timed (its
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
from experiments import peers
from kvjax import cache as cache_lib
from kvjax import checkpoints
from kvjax.analysis import costs
from kvjax.config import run_config_from_dict
from kvjax.inference import decode
from kvjax.models import model

_CONTEXTS = flags.DEFINE_list("contexts", ["128", "512", "1024", "2048", "4096", "8192"],
                              "Prompt lengths T (tokens).")
_IMPLS = flags.DEFINE_list("impls", ["tiled", "dense"], "Prompt attention paths.")
_MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", None, "Cache slots (default: T).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed prefills per point (median).")
_TIME = flags.DEFINE_bool("time", True, "Time the prefills (else compiled figures only).")
_DENSE_MAX = flags.DEFINE_integer("dense_max", 4096, "Largest T the dense path is timed at.")
_PEERS = flags.DEFINE_list("peers", [], "llamacpp: llama.cpp's prompt speed (optional).")
_OUT = flags.DEFINE_string("out_dir", "results/prefill", "Where prefill.json goes.")


def point(cfg, t: int, max_seq_len: int, repeats: int, timed: bool) -> dict:
    """Compiled figures and (if ``timed``) the median prefill time of one T."""
    step = costs.analyze_prefill(cfg, t, max_seq_len)
    parts = step.theory_parts["bytes"]
    row = {"impl": cfg.prefill_impl, "T": t, "max_seq_len": max_seq_len,
           "theory_flops": step.theory_flops, "xla_flops": step.xla.flops,
           "flops_ratio": step.flops_ratio, "theory_bytes": step.theory_bytes,
           "xla_bytes": step.xla.bytes, "bytes_ratio": step.bytes_ratio,
           "bytes_ratio_weights_kv": step.xla.bytes / (parts["weights"] + parts["kv_write"]),
           "theory_parts": parts, "temp_bytes": step.memory.get("temp_bytes"),
           "xla_complete": step.xla.complete}
    if not timed:
        return row
    params = model.init_params(cfg, 0)
    tokens = jnp.ones((1, t), jnp.int32)
    cache = cache_lib.init_cache(cfg, 1, max_seq_len)
    prog = decode._prefill.lower(params, tokens, cache, cfg=cfg, fresh=True).compile()
    times = []
    for i in range(repeats + 1):
        cache = cache_lib.init_cache(cfg, 1, max_seq_len)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        logits, cache = prog(params, tokens, cache)
        logits.block_until_ready()
        if i:
            times.append(time.perf_counter() - start)
    sec = statistics.median(times)
    row.update(seconds=sec, seconds_all=times, tokens_per_s=t / sec)
    return row


def table(rows) -> str:
    out = [(r["impl"], r["T"], r.get("seconds", float("nan")),
            r.get("tokens_per_s", float("nan")), r["xla_flops"], r["flops_ratio"],
            r["xla_bytes"], r["bytes_ratio"], r["bytes_ratio_weights_kv"],
            r["temp_bytes"]) for r in rows]
    return costs.format_table(out, ("impl", "T", "s (median)", "tokens/s", "XLA FLOP",
                                    "/theory", "XLA bytes", "/theory", "/(weights+KV)",
                                    "temp bytes"))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    base = run_config_from_dict(gqa.get_config()).model
    rows = []
    for t in (int(x) for x in _CONTEXTS.value):
        for impl in _IMPLS.value:
            cfg = base.replace(prefill_impl=impl)
            timed = _TIME.value and (impl != "dense" or t <= _DENSE_MAX.value)
            rows.append(point(cfg, t, _MAX_SEQ_LEN.value or t, _REPEATS.value, timed))
            print(table(rows[-1:]), flush=True)
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
            print(f"llama.cpp float32 GGUF, 2 threads, T={t}: {sec:.3f} s, "
                  f"{t / sec:,.1f} tokens/s", flush=True)
    print(table([r for r in rows if "xla_flops" in r]))
    os.makedirs(_OUT.value, exist_ok=True)
    path = os.path.join(_OUT.value, "prefill.json")
    with open(path, "w") as f:
        json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    app.run(main)
