"""Batched decode steps against two rooflines: does batching amortise the weights here?

Times one compiled decode step of a model (default SmolLM2-135M shapes, GQA, float32,
random weights, a full cache at ``--context``) at each of ``--batch_sizes`` for each
``--impls`` (``model.weight_matmul``: 'xla', 'native', 'native_ksplit', 'native_lanes',
'auto'), interleaved round by round (medians), and prints beside each measured step:

* the step over B = 1 and the tokens/s over B = 1 (same formulation);
* theory with bandwidth only (the blog's: weights read once, B·KV): the issue's 1.32x
  step ratio at B = 16;
* theory on the roofline of this CPU: max(bytes / read bandwidth, FLOP / fp32 peak)
  (Williams et al. 2009), with the bandwidth and the peak measured here first
  (:func:`kvjax.analysis.hardware.local_chip` with ``measure_flops``);
* theory with no overlap ("serial"): bytes / bandwidth + FLOP / peak, what a CPU whose
  cores add their arithmetic to their memory reads reaches at best
  (:func:`kvjax.analysis.theory.batched_steps`; ``scripts/overlap_check.py`` measures
  which model a machine follows);
* the step over its bytes' time at the probed bandwidth (1.0 = at the roofline).

  PYTHONPATH=. python scripts/weight_matmul_bench.py --batch_sizes=1,2,4,8,16

With ``--per_shape`` it times instead each weight product of the model alone (q/k/v and
gate/up unfused and fused, o, down and the LM head: :func:`kvjax.planner.weight_shapes`;
those under :data:`kvjax.planner.MIN_MEASURED_BYTES` skipped) at each
batch size M, every ``--impls`` formulation that applies (not 'auto'), as the planner
does (:func:`kvjax.planner.measure_weight_matmul`: a chain of copies reading 48 MiB a
call, the caches flushed before every call), and prints GB/s of weight read per
formulation and each one's GB/s over the probed read bandwidth
(docs/decisions/0046-one-row-walk-parts-and-prefetch.md):

  PYTHONPATH=. python scripts/weight_matmul_bench.py --per_shape --batch_sizes=1

Every figure names the CPU model and vector ISA; timings on a shared host are noisy:
read the ratios (one interleaved run), not the absolute times.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from kvjax.cache import compress as compress_lib
from kvjax import kernels, planner, presets
from kvjax.config import default_scan_layers
from kvjax.analysis import hardware, theory
from kvjax.inference import decode
from kvjax.models import model

_BATCH = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16"], "Batch sizes B.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Context t of the timed step (tokens).")
_IMPLS = flags.DEFINE_list("impls", ["xla", "native"], "model.weight_matmul values to time.")
_MODEL = flags.DEFINE_enum("model", "smollm2", ["smollm2", "blog"], "Model shapes.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved rounds (one step per point each).")
_DECODE_ATTENTION = flags.DEFINE_enum(
    "decode_attention", "auto", ["auto", "xla", "xla_cache_left", "native"],
    "model.decode_attention of every point ('auto', the configs' default, measures the "
    "formulations once per shape class): at B = 16 the cache is ~26% of the step's bytes.")
_PER_SHAPE = flags.DEFINE_bool("per_shape", False, "Time each weight product alone (GB/s).")
_SCAN = flags.DEFINE_enum("scan_layers", "default", ["default", "true", "false", "both"],
                          "Layer stack: the backend's default (CPU: unrolled), scanned, "
                          "unrolled, or both (interleaved: the scan's weight copies).")


def main(argv):
    del argv
    batches = [int(b) for b in _BATCH.value]
    if not batches or min(batches) < 1:
        raise app.UsageError(f"--batch_sizes={_BATCH.value}; allowed: integers >= 1")
    if not _IMPLS.value:
        raise app.UsageError(f"--impls is empty; allowed: {', '.join(kernels.names('weight_matmul'))}")
    for impl in _IMPLS.value:
        if impl not in kernels.names("weight_matmul"):
            raise app.UsageError(f"--impls contains {impl!r}; allowed: "
                                 f"{', '.join(kernels.names('weight_matmul'))}")
    if _PER_SHAPE.value and set(_IMPLS.value) == {"auto"}:
        raise app.UsageError("--per_shape with --impls=auto; allowed: formulations to time "
                             "alone (not 'auto'), e.g. --impls=xla,native")
    t = _CONTEXT.value
    make = presets.smollm2_135m if _MODEL.value == "smollm2" else presets.blog_model
    scans = {"default": [default_scan_layers()], "true": [True], "false": [False],
             "both": [False, True]}[_SCAN.value]
    base = make("float32", scan_layers=scans[0], decode_attention=_DECODE_ATTENTION.value)
    impls = [(s, i) for s in scans for i in _IMPLS.value]  # (scanned?, weight_matmul)
    label = {(s, i): (i if len(scans) == 1 else f"{i}/{'scan' if s else 'unroll'}")
             for s, i in impls}
    model_name, isa = planner._cpu()  # noqa: SLF001
    print(f"machine: {model_name} ({', '.join(isa)}; {len(jax.devices())} JAX device, "
          f"{planner.native.num_threads()} cores), jax {jax.__version__}")
    chip = hardware.local_chip(measure_flops=True)
    bw, peak = chip.hbm_bytes_per_s, chip.peak_flops("float32")
    print(f"probed read bandwidth {bw / 1e9:.1f} GB/s ({chip.read_kernel}); float32 peak "
          f"{peak / 1e9:.1f} GFLOP/s ({chip.source}); ridge {peak / bw:.1f} FLOP/byte")
    if _PER_SHAPE.value:
        return per_shape(base, batches, bw)
    params = {s: model.init_params(base.replace(scan_layers=s), 0) for s in scans}
    points = {}
    for scan, impl in impls:
        cfg = base.replace(weight_matmul=impl, scan_layers=scan)
        for b in batches:
            cache = compress_lib.full_cache(cfg, b, t)
            tok = jnp.zeros((b, 1), jnp.int32)
            fn = decode.decode_step.lower(params[scan], tok, cache, cfg=cfg).compile()
            for _ in range(2):  # warm-up
                lg, cache = fn(params[scan], tok, cache)
                lg.block_until_ready()
                cache = cache.replace(length=jnp.full((b,), t - 1, jnp.int32))
            points[(scan, impl), b] = {"fn": fn, "cache": cache, "tok": tok, "times": [],
                                       "params": params[scan]}
    for _ in range(_ROUNDS.value):
        for b in batches:
            for si in impls:
                p = points[si, b]
                start = time.perf_counter()
                lg, cache = p["fn"](p["params"], p["tok"], p["cache"])
                lg.block_until_ready()
                p["times"].append(time.perf_counter() - start)
                p["cache"] = cache.replace(length=jnp.full((b,), t - 1, jnp.int32))
    b0 = batches[0]
    th = theory.batched_steps(base, t, batches, bw, peak)
    stacks = " and ".join("scanned" if s else "unrolled" for s in scans)
    print(f"\n{base.name} float32, {stacks} layer stack, decode_attention="
          f"{_DECODE_ATTENTION.value!r}, t = {t}, step medians of {_ROUNDS.value} interleaved "
          f"rounds; ratios over B = {b0}")
    print(f"{'impl':>13} {'B':>3} {'step ms':>8} {'step x':>7} {'tok/s x':>8} "
          f"{'bw theory x':>11} {'roofline x':>10} {'serial x':>8} {'step/bytes@bw':>13} "
          f"{'step/serial':>11} {'GFLOP/s':>8}")
    for si in impls:
        s0 = statistics.median(points[si, b0]["times"])
        for b in batches:
            s = statistics.median(points[si, b]["times"])
            r = th[b]
            print(f"{label[si]:>13} {b:>3} {s * 1e3:8.2f} {s / s0:7.2f} {b / s / (b0 / s0):8.2f} "
                  f"{r['bandwidth_ratio']:11.2f} {r['roofline_ratio']:10.2f} "
                  f"{r['serial_ratio']:8.2f} {s / r['bandwidth_s']:13.2f} "
                  f"{s / r['serial_s']:11.2f} {r['flops'] / s / 1e9:8.1f}")
    med = {k: statistics.median(p["times"]) for k, p in points.items()}
    for si in impls[1:]:
        print(f"{label[si]} over {label[impls[0]]} (step time): " + ", ".join(
            f"B={b} {med[si, b] / med[impls[0], b]:.2f}" for b in batches))
    for line in planner.report_lines():
        print(line)


def per_shape(cfg, batches: list[int], bw: float) -> None:
    """Prints GB/s of weight read of each of ``cfg``'s float32 weight products alone, per
    M in ``batches`` and formulation of ``--impls`` (planner.measure_weight_matmul,
    cold, :data:`kvjax.planner.MAX_CALLS` calls at most), beside its share of ``bw``."""
    impls = [i for i in _IMPLS.value if i != "auto"]
    print(f"\n{cfg.name} float32, each weight product alone, GB/s of weight read "
          f"(median call; share of the probed {bw / 1e9:.1f} GB/s)")
    for m in batches:
        for k, n, layout in planner.weight_shapes(cfg):
            if 4 * k * n < planner.MIN_MEASURED_BYTES:
                continue
            r = planner.measure_weight_matmul(m, k, n, layout, candidates=impls)
            cells = ", ".join(f"{i} {g:.1f} ({g * 1e9 / bw:.0%})" for i, g in r["gbps"].items())
            print(f"  M={m} [{k}, {n}] {layout}: {cells}; {r['calls']} calls, "
                  f"planner's pick {r['choice']}", flush=True)


if __name__ == "__main__":
    app.run(main)
