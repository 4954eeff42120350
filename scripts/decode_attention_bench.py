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

Each call above is its own program, so its time includes JAX's dispatch (about 0.2 ms on
the 2-core EPYC; docs/results/amd-epyc-avx512-2core.md, "Session 29, quiet"), which a decode
step pays once for all its layers. ``--layers=L`` (default 8; 0: off) also times, per
shape, one program that runs L layers' decode attention in turn over L distinct caches
(together larger than the CPU's caches, so each is read from memory, as in a step;
a line says where they are not twice the last-level cache), for
'xla', 'native' and 'native_blocks': its GB/s and share of the same probe are the kernel as a step runs it.

    python scripts/decode_attention_bench.py [--slots 32768] [--dtype float32] [--rounds 7]
    python scripts/decode_attention_bench.py --models=smollm2 --slots=16384 --queries=1,2,3,5,9
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import planner
from kvjax.analysis import hardware
from kvjax.models import decode_kernels
from kvjax.models.attention import attend_step


def in_program(layers: int, k: int, g: int, slots: int, dtype, lay: tuple, backend: str,
               rounds: int, impls: list[str]) -> dict[str, float]:
    """Median seconds of one program that runs ``layers`` layers' decode attention (B =
    1, H = Hv = 64, ``slots`` visible slots) over as many distinct caches, per
    formulation of ``impls`` (those :func:`kvjax.planner.measure` found to apply), in
    interleaved rounds."""
    rng = np.random.default_rng(1)
    h = 64
    def arr(shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32), dtype)
    shape = {"BKSH": (1, k, slots, h), "BKHS": (1, k, h, slots)}
    new = {"BKSH": (1, k, 1, h), "BKHS": (1, k, h, 1)}
    q = arr((1, 1, k, g, h))
    caches = [(arr(shape[lay[0]]), arr(shape[lay[1]])) for _ in range(layers)]
    nk, nv, mask = arr(new[lay[0]]), arr(new[lay[1]]), jnp.ones((1, 1, slots), bool)
    fns = {}
    for impl in impls:
        def run(q, caches, impl=impl):
            out = q
            for kc, vc in caches:  # each layer's query depends on the last one's output
                o = attend_step(out, kc, vc, mask, nk, nv, k_layout=lay[0],
                                v_layout=lay[1], impl=impl, backend=backend)
                out = q + 1e-3 * o.reshape(q.shape)
            return out
        fns[impl] = jax.jit(run).lower(q, caches).compile()
    times = planner._time_all(fns, (q, caches), rounds, budget_s=20.0)
    return {n: statistics.median(t) for n, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32768)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--models", default="blog,smollm2")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers of one in-program timing per shape (0: none)")
    ap.add_argument("--queries", default="1",
                    help="queries per head T (comma-separated): G·T rows per KV head")
    a = ap.parse_args()
    try:
        queries = [int(x) for x in a.queries.split(",")]
    except ValueError:
        queries = []
    if a.layers < 0:
        raise SystemExit(f"error: --layers={a.layers}; allowed: an integer >= 0")
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
    candidates = list(planner.CANDIDATES) + ["pallas"]
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
            if t == queries[0] and a.layers:
                secs = in_program(a.layers, k, g, a.slots, dtype, lay, backend, a.rounds,
                                  [i for i in ("xla", "native", "native_blocks")
                                   if i in r["gbps"]])
                nbytes = a.layers * k * a.slots * 128 * dtype.itemsize
                cells = "  ".join(f"{impl} {nbytes / sec / 1e9:6.1f} GB/s "
                                  f"({nbytes / sec / roof:4.0%})"
                                  for impl, sec in secs.items())
                # the CPU's caches matter on a CPU run only (no probe on a GPU)
                warm = (hardware.cache_reads_note(nbytes, "--layers") if probe is not None
                        else "")
                print(f"{name} K={k} G={g} in one program of {a.layers} layers: {cells}{warm}",
                      flush=True)
            if t == queries[0]:
                best[k] = min(r["seconds"].values())
        mha = best[ks[0]]
        print(f"{name}: speedup over MHA (best formulation each; theory = K ratio): "
              + ", ".join(f"K={k} {mha / best[k]:.2f}x (theory {ks[0] / k:.0f}x)"
                          for k in ks[1:]), flush=True)
    _ = decode_kernels  # the formulations measured


if __name__ == "__main__":
    main()
