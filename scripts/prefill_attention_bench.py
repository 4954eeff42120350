"""The prompt attention alone: the native fused kernel against the XLA tiled path.

One layer's causal attention of a T-token chunk (SmolLM2 shapes by default: K = 3 KV
heads, G = 3 query heads each, H = 64, keys 'BKHS' and values 'BKSH' as on CPU), float32,
both compiled once, then ``--repeats`` rounds running each in turn (interleaved, so
machine noise hits both); prints medians, GFLOP/s of the causal FLOP
(``theory.attention_flops_per_head`` over T(T+1)/2 keys per head) and the ratio.
``KVJAX_NATIVE_THREADS`` sets the kernel's threads.
Usage: python scripts/prefill_attention_bench.py [--tokens 1571] [--repeats 5]
"""

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.analysis import theory
from kvjax.models import flash
from kvjax.native import prefill as native_prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1571, help="T, prompt tokens")
    ap.add_argument("--kv_heads", type=int, default=3, help="K")
    ap.add_argument("--groups", type=int, default=3, help="G, query heads per KV head")
    ap.add_argument("--head_dim", type=int, default=64, help="H")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not native_prefill.load():
        raise SystemExit("the native library could not be built (see the warning)")
    t, k, g, h = a.tokens, a.kv_heads, a.groups, a.head_dim
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (1, t, k, g, h))
    keys = jax.random.normal(ks[1], (1, k, h, t))
    values = jax.random.normal(ks[2], (1, k, t, h))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    lay = dict(k_layout="BKHS", v_layout="BKSH")
    fns = {"native": jax.jit(lambda *x: native_prefill.attend_chunk(*x, **lay)),
           "tiled": jax.jit(lambda *x: flash.attend_chunk(*x, **lay))}
    args = (q, keys, values, pos)
    np.testing.assert_allclose(np.asarray(fns["native"](*args)),
                               np.asarray(fns["tiled"](*args)), atol=1e-5)
    times = {n: [] for n in fns}
    for _ in range(a.repeats):
        for n, f in fns.items():
            start = time.perf_counter()
            f(*args).block_until_ready()
            times[n].append(time.perf_counter() - start)
    flops = k * g * theory.attention_flops_per_head(h, h, t * (t + 1) // 2)
    threads = os.environ.get("KVJAX_NATIVE_THREADS") or native_prefill.num_threads()
    print(f"T={t} K={k} G={g} H={h} float32, native threads {threads}, "
          f"median of {a.repeats} (interleaved):")
    med = {n: float(np.median(v)) for n, v in times.items()}
    for n, m in med.items():
        print(f"  {n:7s} {m * 1e3:8.1f} ms  {flops / m / 1e9:6.1f} GFLOP/s (causal theory)")
    print(f"  tiled / native: {med['tiled'] / med['native']:.2f}x")


if __name__ == "__main__":
    main()
