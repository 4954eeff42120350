"""Which head-major cache layout makes XLA's decode products fastest on this backend.

Times the two products of one decode step, q·K^T ([B, K, G, H] x keys) and p·V
([B, K, G, S] x values), with the cache stored 'BKSH' ([B, K, S, H]) or 'BKHS'
([B, K, H, S]), for G = 1, 2, 4, 8 query heads per KV head at a fixed K·G = 8, and prints
GB/s of cache read (median of repeats). kvjax.config.default_kv_layout encodes the result
for CPU. Usage: python scripts/layout_bench.py [--slots 65536] [--repeats 11]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_seconds(f, *args, repeats: int) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=65536, help="S, cache slots")
    ap.add_argument("--head_dim", type=int, default=64, help="H")
    ap.add_argument("--repeats", type=int, default=11)
    a = ap.parse_args()
    s, h, rng = a.slots, a.head_dim, np.random.default_rng(0)
    print(f"backend={jax.default_backend()} S={s} H={h} float32; GB/s of cache read")
    products = {
        ("qk", "BKSH"): "BKGH,BKSH->BKGS", ("qk", "BKHS"): "BKGH,BKHS->BKGS",
        ("pv", "BKSH"): "BKGS,BKSH->BKGH", ("pv", "BKHS"): "BKGS,BKHS->BKGH",
    }
    for g in (1, 2, 4, 8):
        k = 8 // g
        cache = {lay: jnp.asarray(rng.standard_normal(
            (1, k, s, h) if lay == "BKSH" else (1, k, h, s), dtype=np.float32))
            for lay in ("BKSH", "BKHS")}
        q = jnp.asarray(rng.standard_normal((1, k, g, h), dtype=np.float32))
        p = jnp.asarray(rng.random((1, k, g, s), dtype=np.float32))
        cells = []
        for (prod, lay), spec in products.items():
            f = jax.jit(lambda x, c, spec=spec: jnp.einsum(spec, x, c))
            sec = median_seconds(f, q if prod == "qk" else p, cache[lay], repeats=a.repeats)
            cells.append(f"{prod} {lay} {cache[lay].nbytes / sec / 1e9:5.1f}")
        print(f"G={g} K={k}:  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
