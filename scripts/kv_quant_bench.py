"""Decode step time per kv_dtype against the roofline's predicted speedup, in one run.

    python scripts/kv_quant_bench.py --contexts 4096,32768 --kv_dtypes float32,int8

SmolLM2-135M shapes (GQA K=3, H=64, L=30; float32 weights, random: speed only), batch 1,
one jitted single-token step (``model.forward``, cache donated) at a cache of t slots
holding t - 1 tokens. The kv_dtypes are timed interleaved (round robin, ``--reps`` rounds)
and the median reported with the ratio to float32 and the theory's ratio of step bytes
(weights + KV read + KV write, scales included: ``theory.step_bytes``). It also reports
whether XLA fused the dequantisation into the attention dots: the compiled step is
searched for a materialised float32 (or model-dtype) tensor of the cache's full shape.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.analysis import theory
from kvjax.models import model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--kv_dtypes", default="float32,int8")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    names = args.kv_dtypes.split(",")
    base = presets.smollm2_135m(dtype="float32", scan_layers=False)
    raw = model.init_params(base, 0)
    fwd = jax.jit(model.forward, static_argnums=1, donate_argnums=4)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for t in contexts:
        steps, caches, cfgs, fused = {}, {}, {}, {}
        for n in names:
            cfg = base.replace(kv_dtype=n, name=f"smollm2-{n}")
            cfgs[n] = cfg
            params = model.params_for(cfg, raw)
            cache = cache_lib.init_cache(cfg, 1, t)
            cache = cache.replace(positions=jnp.where(jnp.arange(t) < t - 1,
                                                      jnp.arange(t), -1)[None].astype(jnp.int32),
                                  length=jnp.full((1,), t - 1, jnp.int32))
            tok = jnp.zeros((1, 1), jnp.int32)
            pos = jnp.full((1, 1), t - 1, jnp.int32)
            hlo = fwd.lower(params, cfg, tok, pos, cache).compile().as_text()
            # a materialised full-cache float tensor: f32[1,3,t,64] / f32[1,3,64,t]
            pat = rf"f32\[1,3,({t},64|64,{t})\]"
            fused[n] = "n/a" if not cfg.kv_quantized else (
                "no (f32 copy of the cache)" if re.search(r"=\s*" + pat, hlo) else "yes")
            steps[n] = (params, tok, pos)
            caches[n] = cache
            out, caches[n] = fwd(params, cfg, tok, pos, caches[n])  # compile + warm
            out.block_until_ready()
        times = {n: [] for n in names}
        for _ in range(args.reps):
            for n in names:
                params, tok, pos = steps[n]
                t0 = time.perf_counter()
                out, new = fwd(params, cfgs[n], tok, pos, caches[n])
                out.block_until_ready()
                times[n].append(time.perf_counter() - t0)
                # rewind: the step wrote slot t-1; keep holding t - 1 tokens
                caches[n] = new.replace(positions=new.positions.at[:, t - 1].set(-1),
                                        length=new.length - 1)
        ref = statistics.median(times[names[0]])
        ref_bytes = theory.step_bytes(cfgs[names[0]], t).total
        print(f"\nt = {t:,}  (median of {args.reps}, interleaved)")
        print("| kv_dtype | KV B/token | step bytes (theory) | step ms | speedup measured "
              "| speedup roofline | dequant fused into the dots |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for n in names:
            med = statistics.median(times[n])
            sb = theory.step_bytes(cfgs[n], t).total
            print(f"| {n} | {theory.kv_bytes_per_token(cfgs[n]):,} | {sb:,} | {med*1e3:.2f} "
                  f"| {ref/med:.2f}x | {ref_bytes/sb:.2f}x | {fused[n]} |")


if __name__ == "__main__":
    main()
