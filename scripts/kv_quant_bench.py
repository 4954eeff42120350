"""Decode step time per kv_dtype against the roofline's predicted speedup, in one run.

    python scripts/kv_quant_bench.py --models smollm2,blog --contexts 4096,32768,65536 \
        --kv_dtypes float32,int8,int8:dequant,float8_e4m3fn,int4

Models (float32 weights, random: speed only): ``smollm2`` (SmolLM2-135M shapes: GQA K=3,
H=64, L=30) and ``blog`` (the blog's model: MHA K=8, H=64, L=12). Batch 1, one jitted
single-token step (``model.forward``, cache donated) at a cache of t slots holding t - 1
tokens. All (kv_dtype) variants of one model and context are timed interleaved (round
robin, ``--reps`` rounds); the median is reported with the ratio to the first kv_dtype
(float32) and the theory's ratio of step bytes (weights + KV read + KV write, scales
included: ``theory.step_bytes``), i.e. the speedup a bandwidth-bound step would get.

``int8:dequant`` / ``float8_e4m3fn:dequant``: the same cache with the scales applied
before the dots (the registry without its 'xla_scaled' rule, ``kvjax.kernels``: the codes
are dequantized, then attended by 'xla'), the formulation the default replaced; the plain
names use the default ('xla_scaled': scales outside the dots, only a convert of the codes
stays on the dot operands). Per variant the compiled step is searched for materialised float32 tensors of
one layer's full K or V cache shape (``f32 copies of the cache``: 0 means XLA streamed
the 1-byte cache into the dots).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax.config import ConfigError
from kvjax import cache as cache_lib
from kvjax import kernels, presets
from kvjax.analysis import hlo_cost, theory
from kvjax.models import model

MODELS = {"smollm2": presets.smollm2_135m, "blog": presets.blog_model}


def f32_cache_copies(hlo: str, cfg, t: int) -> int:
    """Materialised float32 arrays of one layer's K or V cache shape ([K, t, H] or
    [K, H, t], with or without leading unit axes) in compiled HLO text: instructions
    of the computations that are not fused into another (a convert inside a fusion whose
    root is a dot is streamed, not materialised; parameters are not copies)."""
    k, h = cfg.num_kv_heads, cfg.head_dim
    pat = re.compile(rf"=\s*f32\[(1,)*{k},({t},{h}|{h},{t})\]\S*\s+(?!parameter)")
    comps, _ = hlo_cost.split_computations(hlo)
    fused = set()
    for lines in comps.values():
        for line in lines:
            if " fusion(" in line:
                fused.update(re.findall(r"calls=%?([\w.\-]+)", line))
    return sum(len(pat.findall(line)) for name, lines in comps.items() if name not in fused
               for line in lines[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2",
                    help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--kv_dtypes", default="float32,int8,int8:dequant",
                    help="comma-separated kv_dtypes; 'NAME:dequant' dequantizes before the dots")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts={args.contexts}; allowed: comma-separated positive integers")
    if min(contexts) < 2:
        ap.error(f"--contexts={args.contexts}; allowed: integers >= 2 (cache slots)")
    names = args.kv_dtypes.split(",")
    for m in args.models.split(","):
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; allowed: {sorted(MODELS)}")
    probe = MODELS[args.models.split(",")[0]](dtype="float32", scan_layers=False)
    for n in names:  # every name checked before anything compiles
        kd, sep, how = n.partition(":")
        if sep and how != "dequant":
            ap.error(f"--kv_dtypes: {n!r}; allowed: a kv_dtype, optionally with ':dequant'")
        try:
            probe.replace(kv_dtype=kd)
        except ConfigError as e:
            ap.error(f"--kv_dtypes: {e}")
    fwd = jax.jit(model.forward, static_argnums=1, donate_argnums=4)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}")
    for mname in args.models.split(","):
        base = MODELS[mname](dtype="float32", scan_layers=False)
        raw = model.init_params(base, 0)
        for t in contexts:
            run_context(fwd, base, raw, mname, t, names, args.reps)


def run_context(fwd, base, raw, mname, t, names, reps):
    steps, caches, cfgs, copies = {}, {}, {}, {}
    for n in names:
        kd, _, how = n.partition(":")
        cfg = base.replace(kv_dtype=kd, name=f"{mname}-{n}")
        cfgs[n] = cfg
        params = model.params_for(cfg, raw)
        cache = cache_lib.init_cache(cfg, 1, t)
        cache = cache.replace(positions=jnp.where(jnp.arange(t) < t - 1, jnp.arange(t),
                                                  -1)[None].astype(jnp.int32),
                              length=jnp.full((1,), t - 1, jnp.int32))
        tok = jnp.zeros((1, 1), jnp.int32)
        pos = jnp.full((1, 1), t - 1, jnp.int32)
        saved = kernels.REGISTRY
        if how == "dequant":  # without the 'xla_scaled' rule: dequantize, then attend
            kernels.unregister("decode_attention", "xla_scaled")
        try:
            hlo = fwd.lower(params, cfg, tok, pos, cache).compile().as_text()
            copies[n] = f32_cache_copies(hlo, cfg, t) if cfg.kv_quantized else None
            steps[n] = (params, tok, pos)
            out, caches[n] = fwd(params, cfg, tok, pos, cache)  # trace, compile, warm
            out.block_until_ready()
        finally:
            kernels.REGISTRY = saved
    times = {n: [] for n in names}
    for _ in range(reps):
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
    print(f"\n{mname}, t = {t:,}  (median of {reps}, interleaved; ratios to {names[0]})")
    print("| kv_dtype | KV B/token | step bytes (theory) | step ms | speedup measured "
          "| speedup roofline | f32 copies of the cache |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in names:
        med = statistics.median(times[n])
        sb = theory.step_bytes(cfgs[n], t).total
        c = "n/a" if copies[n] is None else copies[n]
        print(f"| {n} | {theory.kv_bytes_per_token(cfgs[n]):,} | {sb:,} | {med*1e3:.2f} "
              f"| {ref/med:.2f}x | {ref_bytes/sb:.2f}x | {c} |", flush=True)
    del caches


if __name__ == "__main__":
    main()
