"""Batched decode steps against two rooflines: does batching amortise the weights here?

Times one compiled decode step of a model (default SmolLM2-135M shapes, GQA, float32,
random weights, a full cache at ``--context``) at each of ``--batch_sizes`` for each
``--impls`` (``model.weight_matmul``: 'xla', 'native', 'auto'), interleaved round by
round (medians), and prints beside each measured step:

* the step over B = 1 and the tokens/s over B = 1 (same formulation);
* theory with bandwidth only (the blog's: weights read once, B·KV): the issue's 1.32x
  step ratio at B = 16;
* theory on the roofline of this CPU: max(bytes / read bandwidth, FLOP / fp32 peak)
  (Williams et al. 2009), with the bandwidth and the peak measured here first
  (:func:`kvjax.analysis.hardware.local_chip` with ``measure_flops``);
* the step over its bytes' time at the probed bandwidth (1.0 = at the roofline).

  PYTHONPATH=. python scripts/weight_matmul_bench.py --batch_sizes=1,2,4,8,16

Every figure names the CPU model and vector ISA; timings on a shared host are noisy:
read the ratios (one interleaved run), not the absolute times.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from kvjax import planner, presets
from kvjax.analysis import costs, hardware, theory
from kvjax.inference import decode
from kvjax.models import model

_BATCH = flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8", "16"], "Batch sizes B.")
_CONTEXT = flags.DEFINE_integer("context", 256, "Context t of the timed step (tokens).")
_IMPLS = flags.DEFINE_list("impls", ["xla", "native"], "model.weight_matmul values to time.")
_MODEL = flags.DEFINE_enum("model", "smollm2", ["smollm2", "blog"], "Model shapes.")
_ROUNDS = flags.DEFINE_integer("rounds", 9, "Interleaved rounds (one step per point each).")
_SCAN = flags.DEFINE_enum("scan_layers", "default", ["default", "true", "false"],
                          "Layer stack: the backend's default, scanned or unrolled.")


def main(argv):
    del argv
    batches = [int(b) for b in _BATCH.value]
    if not batches or min(batches) < 1:
        raise app.UsageError(f"--batch_sizes={_BATCH.value}; allowed: integers >= 1")
    for impl in _IMPLS.value:
        if impl not in ("xla", "native", "auto"):
            raise app.UsageError(f"--impls contains {impl!r}; allowed: xla, native, auto")
    t = _CONTEXT.value
    make = presets.smollm2_135m if _MODEL.value == "smollm2" else presets.blog_model
    extra = {} if _SCAN.value == "default" else {"scan_layers": _SCAN.value == "true"}
    base = make("float32", **extra)
    model_name, isa = planner._cpu()  # noqa: SLF001
    print(f"machine: {model_name} ({', '.join(isa)}; {len(jax.devices())} JAX device, "
          f"{planner.native.num_threads()} cores), jax {jax.__version__}")
    chip = hardware.local_chip(measure_flops=True)
    bw, peak = chip.hbm_bytes_per_s, chip.peak_flops("float32")
    bw_only = hardware.Chip("bandwidth only", {}, bw, chip.hbm_capacity_bytes)
    print(f"probed read bandwidth {bw / 1e9:.1f} GB/s ({chip.read_kernel}); fp32 matmul "
          f"peak {peak / 1e9:.1f} GFLOP/s (jitted 1024^3 matmul); ridge "
          f"{peak / bw:.1f} FLOP/byte")
    params = model.init_params(base, 0)
    points = {}
    for impl in _IMPLS.value:
        cfg = base.replace(weight_matmul=impl)
        for b in batches:
            cache = costs.full_cache(cfg, b, t)
            tok = jnp.zeros((b, 1), jnp.int32)
            fn = decode.decode_step.lower(params, tok, cache, cfg=cfg).compile()
            for _ in range(2):  # warm-up
                lg, cache = fn(params, tok, cache)
                lg.block_until_ready()
                cache = cache.replace(length=jnp.full((b,), t - 1, jnp.int32))
            points[impl, b] = {"fn": fn, "cache": cache, "tok": tok, "times": []}
    for _ in range(_ROUNDS.value):
        for b in batches:
            for impl in _IMPLS.value:
                p = points[impl, b]
                start = time.perf_counter()
                lg, cache = p["fn"](params, p["tok"], p["cache"])
                lg.block_until_ready()
                p["times"].append(time.perf_counter() - start)
                p["cache"] = cache.replace(length=jnp.full((b,), t - 1, jnp.int32))
    b0 = batches[0]
    step_theory = {}
    for b in batches:
        nbytes = theory.step_bytes(base, t, b).total
        flops = theory.step_flops(base, t, b).total
        step_theory[b] = (theory.step_time(nbytes, flops, bw_only, "float32"),
                          theory.step_time(nbytes, flops, chip, "float32"), nbytes, flops)
    print(f"\n{base.name} float32, t = {t}, step medians of {_ROUNDS.value} interleaved "
          f"rounds; ratios over B = {b0}")
    print(f"{'impl':>7} {'B':>3} {'step ms':>8} {'step x':>7} {'tok/s x':>8} "
          f"{'bw theory x':>11} {'roofline x':>10} {'step/bytes@bw':>13} {'GFLOP/s':>8}")
    for impl in _IMPLS.value:
        s0 = statistics.median(points[impl, b0]["times"])
        for b in batches:
            s = statistics.median(points[impl, b]["times"])
            tb, tr, nbytes, flops = step_theory[b]
            print(f"{impl:>7} {b:>3} {s * 1e3:8.2f} {s / s0:7.2f} {b / s / (b0 / s0):8.2f} "
                  f"{tb / step_theory[b0][0]:11.2f} {tr / step_theory[b0][1]:10.2f} "
                  f"{s / (nbytes / bw):13.2f} {flops / s / 1e9:8.1f}")
    if len(_IMPLS.value) > 1:
        first = _IMPLS.value[0]
        for impl in _IMPLS.value[1:]:
            print(f"{impl} over {first} (step time): " + ", ".join(
                f"B={b} {statistics.median(points[impl, b]['times']) / statistics.median(points[first, b]['times']):.2f}"
                for b in batches))
    for line in planner.report_lines():
        print(line)


if __name__ == "__main__":
    app.run(main)
