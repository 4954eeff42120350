"""Every decode-attention formulation on this machine, interleaved, against a read probe.

For the blog model's per-layer shapes at t = 32K (MHA K = 8, GQA K = 2, MQA K = 1; H = 64)
and SmolLM2's (K = 9 / 3 / 1), times one layer's decode attention
(:func:`kvjax.models.attention.attend_step`) in each formulation that applies
(:mod:`kvjax.models.decode_kernels`; 'pallas' on GPU), in interleaved rounds, and prints
GB/s of cache read and the fraction of the roofline: on CPU the median of six 256 MiB
streaming reads timed just before and after the rounds, on a known GPU its published HBM bandwidth.
Also the GQA/MQA speedups over MHA (best formulation each) against theory's byte ratio.
Names the machine (CPU model, vector ISA, cores). ``--queries=1,2,5`` also times T
queries per head at once, the G·T rows per KV head of a speculative verify step of
k + 1 = T positions (``attention.attend_small_chunk``): the same bytes, T times the
FLOPs.

    python scripts/decode_attention_bench.py [--slots 32768] [--dtype float32] [--rounds 7]
    python scripts/decode_attention_bench.py --models=smollm2 --slots=16384 --queries=1,2,3,5,9
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax import planner
from kvjax.analysis import hardware
from kvjax.models import decode_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32768)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models", default="blog,smollm2")
    ap.add_argument("--queries", default="1",
                    help="queries per head T (comma-separated): G·T rows per KV head")
    a = ap.parse_args()
    try:
        queries = [int(x) for x in a.queries.split(",")]
    except ValueError:
        queries = []
    if not queries or min(queries) < 1:
        raise SystemExit(f"error: --queries={a.queries}; allowed: integers >= 1, "
                         "comma-separated")
    backend = "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else jax.default_backend()
    key = planner.machine_key(backend)
    chip = hardware.match_chip(getattr(jax.devices()[0], "device_kind", ""))
    print(f"machine: {key['cpu']} ({', '.join(key['isa'])}; {key['cores']} cores); "
          f"device {jax.devices()[0].device_kind}; jax {key['jax']}; "
          f"S={a.slots} {a.dtype}", flush=True)
    probe = hardware.ReadProbe("vecmat") if chip is None else None
    dtype = jnp.dtype(a.dtype)
    heads = {"blog": (8, (8, 2, 1)), "smollm2": (9, (9, 3, 1))}
    candidates = ["xla", "xla_cache_left", "native", "pallas"]
    for name in a.models.split(","):
        n, ks = heads[name]
        best = {}
        for k, t in ((k, t) for k in ks for t in queries):
            g = n // k
            lay = ("BKSH", "BKSH") if backend != "cpu" else ("BKHS", "BKHS" if g == 1 else "BKSH")
            roofs = [probe.once() for _ in range(3)] if probe is not None else []
            t0 = time.perf_counter()
            r = planner.measure(1, k, g * t, 64, 64, a.slots, dtype, *lay,
                                candidates=candidates, rounds=a.rounds, budget_s=4.0,
                                backend=backend)
            if probe is not None:  # reads just before and just after the rounds
                roofs += [probe.once() for _ in range(3)]
            roof = statistics.median(roofs) if roofs else chip.hbm_bytes_per_s
            cells = "  ".join(f"{impl} {gb:6.1f} GB/s ({gb * 1e9 / roof:4.0%})"
                              for impl, gb in r["gbps"].items())
            rows = f" T={t} ({g * t} rows)" if queries != [1] else ""
            print(f"{name} K={k} G={g}{rows} {lay[0]}/{lay[1]}: {cells}; roof "
                  f"{roof / 1e9:.1f} GB/s; pick {r['choice']} "
                  f"[{time.perf_counter() - t0:.1f} s]", flush=True)
            if t == queries[0]:
                best[k] = min(r["seconds"].values())
        mha = best[ks[0]]
        print(f"{name}: speedup over MHA (best formulation each; theory = K ratio): "
              + ", ".join(f"K={k} {mha / best[k]:.2f}x (theory {ks[0] / k:.0f}x)"
                          for k in ks[1:]), flush=True)
    _ = decode_kernels  # the formulations measured


if __name__ == "__main__":
    main()
