"""Does a few-row weight product overlap its arithmetic with its memory reads here?

The roofline (Williams et al. 2009; the blog's arithmetic-intensity section) prices a
product at max(bytes / bandwidth, FLOP / compute rate): while the cores multiply, the
memory keeps streaming. Batching the rows of a decode step (the blog's batch-size
section) relies on it: 16 rows cost 16x the FMAs of one but the same weight bytes, so the
step should stay memory-bound. This script measures, for M rows x a [K, N] float32
weight stored [in, out], each ``--impls`` formulation of ``model.weight_matmul``:

  C  GB/s of weight when the weight stays in the cores' caches (a scan of ``--reps``
     products of one weight): the arithmetic alone, no DRAM;
  R  GB/s of a plain streaming read (:class:`kvjax.analysis.hardware.ReadProbe`,
     256 MiB): the memory alone;
  D  GB/s when every product reads its weight from memory (``--stream_mib`` of separate
     copies, one product each, unrolled and chained as a decode step reads its layers'
     weights: :func:`kvjax.planner.weight_chain`, the caches flushed before each call);

and prints D beside the two models: overlapped, min(C, R) (the roofline), and serial,
1 / (1/C + 1/R) (arithmetic and reads one after the other). Where D follows the serial
model, a batch pays for its FMAs on top of its reads and the step grows with B even
below the ridge point.

  PYTHONPATH=. python scripts/overlap_check.py --batch_sizes=1,4,16

On the 2-core Intel Xeon (AVX-512) of issue 18, D followed the serial model for M = 4
and 16 (and in a C harness of the kernels for the decode attention of G = 8 too). Every
figure names the CPU model and vector ISA; read the ratios of one run, not the absolute
numbers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from kvjax import kernels, planner
from kvjax.analysis import hardware
from kvjax.models import weight_matmul
from kvjax.native import rows_matmul
from kvjax.plan import Plan

NATIVE_PLAN = Plan(native=("rows_matmul",))  # used only once rows_matmul.load() said yes

MAX_COPIES = 1024  # unrolled products per call: compile time grows with them

_BATCH = flags.DEFINE_list("batch_sizes", ["1", "4", "16"],
                           f"Rows M (the batch), integers 1..{rows_matmul.MAX_ROWS}.")
_IMPLS = flags.DEFINE_list("impls", ["xla", "native", "native_ksplit"],
                           "model.weight_matmul formulations to time: xla, native, "
                           "native_ksplit ([K, N] weights, several rows); not 'auto'.")
_K = flags.DEFINE_integer("k", 576, "Weight rows K (in). Default: SmolLM2's d_model.")
_N = flags.DEFINE_integer("n", 576, "Weight columns N (out).")
_REPS = flags.DEFINE_integer("reps", 64, "Products per call of the in-cache scan.")
_STREAM = flags.DEFINE_integer("stream_mib", 256, "MiB of weight copies per call from "
                               f"memory (1..4096; at most {MAX_COPIES} copies).")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Timed calls per figure (median).")


def _seconds(fn, *args, rounds: int, flush=None) -> float:
    """Median seconds of ``rounds`` calls after 2 warm-ups (the planner's timing loop,
    no time budget); ``flush()`` untimed before each timed call when given."""
    return planner._time({"f": fn}, args, rounds, math.inf, flush)["f"]


def _check_flags() -> tuple[list[int], int]:
    """(the batch sizes, weight copies per from-memory call), or a UsageError naming the
    first bad flag, before any work."""
    try:
        ms = [int(b) for b in _BATCH.value]
    except ValueError:
        ms = []
    if not ms or any(not 1 <= m <= rows_matmul.MAX_ROWS for m in ms):
        raise app.UsageError(f"--batch_sizes={','.join(_BATCH.value)}; allowed: integers "
                             f"1..{rows_matmul.MAX_ROWS} (the kernel's rows)")
    bad = [i for i in _IMPLS.value if i not in kernels.names("weight_matmul") or i == "auto"]
    if bad or not _IMPLS.value:
        raise app.UsageError(f"--impls={','.join(_IMPLS.value)}; allowed: a non-empty subset "
                             f"of {[i for i in kernels.names('weight_matmul') if i != 'auto']}")
    for name, v, lo in (("k", _K.value, 1), ("n", _N.value, 1), ("reps", _REPS.value, 1),
                        ("stream_mib", _STREAM.value, 1), ("rounds", _ROUNDS.value, 1)):
        if v < lo:
            raise app.UsageError(f"--{name}={v}; allowed: an integer >= {lo}")
    if _STREAM.value > 4096:
        raise app.UsageError(f"--stream_mib={_STREAM.value}; allowed: 1..4096")
    copies = -(-_STREAM.value * 2**20 // (4 * _K.value * _N.value))
    if copies > MAX_COPIES:
        raise app.UsageError(
            f"--stream_mib={_STREAM.value} of [--k={_K.value}, --n={_N.value}] weights is "
            f"{copies} copies; allowed: at most {MAX_COPIES} (a larger weight or a smaller "
            "stream)")
    return ms, copies


def main(argv):
    del argv
    ms, copies = _check_flags()
    k, n = _K.value, _N.value
    key = planner.machine_key()
    print(f"machine: {key['cpu']} ({', '.join(key['isa'])}; {key['cores']} cores), "
          f"jax {key['jax']}")
    wbytes = 4 * k * n
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((k, n), dtype=np.float32) * 1e-3)
    ws = tuple(jnp.asarray(rng.standard_normal((k, n), dtype=np.float32) * 1e-3)
               for _ in range(copies))
    probe = hardware.ReadProbe("vecmat")
    flush = planner._flusher()
    print(f"[{k}, {n}] float32 weight ({wbytes / 2**20:.2f} MiB); in cache: {_REPS.value} "
          f"products of it per call; from memory: {copies} copies per call "
          f"({copies * wbytes / 2**20:.0f} MiB, the caches flushed before each call); "
          f"medians of {_ROUNDS.value}")
    print(f"{'impl':>14} {'M':>4} {'C cache':>8} {'R read':>7} {'D memory':>9} "
          f"{'min(C,R)':>9} {'serial':>7} {'D/serial':>9} {'D/min':>6}")
    for m in ms:
        x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
        for impl in _IMPLS.value:
            runs = weight_matmul.applies(impl, m, "kn")
            if runs != impl:
                print(f"{impl:>14} {m:>4}  runs as {runs} here: see its row")
                continue
            if impl != "xla" and not rows_matmul.load():
                print(f"{impl:>14} {m:>4}  the native kernel is unavailable (see the warning)")
                continue

            def prod(a, b, impl=impl):  # the kernel is loaded: a plan that says so
                return weight_matmul.einsum("MK,KN->MN", a, b, impl, NATIVE_PLAN)

            @jax.jit
            def in_cache(x, w):
                def body(acc, _):  # each product's input depends on the last one's output
                    return acc + prod(x + acc[:, :1], w), None
                return jax.lax.scan(body, jnp.zeros((m, n), jnp.float32), None,
                                    length=_REPS.value)[0]

            # unrolled and chained over separate arrays, as a step's layers hold them
            from_memory = jax.jit(lambda x, ws, prod=prod: planner.weight_chain(prod, x, ws))

            c = _REPS.value * wbytes / _seconds(in_cache, x, w, rounds=_ROUNDS.value) / 1e9
            read_before = probe.once()
            d = copies * wbytes / _seconds(from_memory, x, ws, rounds=_ROUNDS.value,
                                           flush=flush) / 1e9
            r = (read_before + probe.once()) / 2 / 1e9  # reads around the D rounds
            serial = 1 / (1 / c + 1 / r)
            print(f"{impl:>14} {m:>4} {c:>8.3g} {r:>7.3g} {d:>9.3g} {min(c, r):>9.3g} "
                  f"{serial:>7.3g} {d / serial:>9.3g} {d / min(c, r):>6.3g}", flush=True)
    print("GB/s of weight read. D/serial near 1 and D/min well below 1: the arithmetic and "
          "the reads add up instead of overlapping.")


if __name__ == "__main__":
    app.run(main)
