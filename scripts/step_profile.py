"""Where a decode step's time goes, instruction group by group, beside the read probe.

    PYTHONPATH=. python scripts/step_profile.py --models=blog --variants=mha,gqa,mqa \
        --contexts=32768
    PYTHONPATH=. python scripts/step_profile.py --models=smollm2 --variants=gqa \
        --contexts=1024,8192 --repeats=9

For each model x variant x context of ``experiments.bench``'s points (its flags:
``--models``, ``--variants``, ``--contexts``, ``--dtype``, ``--decode_attention``,
``--weight_matmul``; ``--repeats`` steps are profiled), the compiled decode step runs
under JAX's profiler (:func:`kvjax.analysis.profile.profile_step`) and its instructions
are grouped: the decode-attention kernel, each weight product by module path, the LM
head's dot, the rest of XLA's ops. Printed per group: instructions a step, milliseconds
a step while traced (median over the steps), share of all thunks' time, the bytes its
operands hold and the GB/s they make in that share of the untraced step (the profiler
slows a step by a few percent to a quarter; dots and custom calls only), and that over
the median of ``--probe_reads`` reads of the read probe (:class:`kvjax.analysis.hardware.ReadProbe`,
the bench's roofline) timed just before the point. The head line gives the step's wall
time untraced and traced and the thunks' sum (the gap: the runtime between thunks).

CPU only. Every figure names the CPU; on a shared host read the shares of one run.
"""

from __future__ import annotations

import statistics
import sys

from absl import app, flags

from experiments import bench, cli
from kvjax.analysis import hardware, profile
from kvjax.config import ConfigError

_PROBE_READS = flags.DEFINE_integer("probe_reads", 7, "Read-probe reads per point.",
                                    lower_bound=1)


def main(argv):
    del argv
    if flags.FLAGS.repeats < 1:
        print(f"error: --repeats={flags.FLAGS.repeats}; allowed: an integer >= 1 (steps "
              "profiled)", file=sys.stderr)
        return cli.USAGE_EXIT
    for flag, allowed in (("models", bench.MODELS), ("variants", bench.VARIANTS),
                          ("contexts", int)):
        if err := bench.flag_error(flag, flags.FLAGS[flag].value, allowed):
            print(f"error: {err}", file=sys.stderr)
            return cli.USAGE_EXIT
    try:  # every point's config, before any probe or compile
        for model_name in flags.FLAGS.models:
            for variant in flags.FLAGS.variants:
                bench.variant_cfg(model_name, variant, flags.FLAGS.dtype, False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return cli.USAGE_EXIT
    chip = hardware.local_chip()
    probe = hardware.ReadProbe(chip.read_kernel) if chip.read_kernel else None
    print(f"device: {hardware.device_name()}")
    for model_name in flags.FLAGS.models:
        for variant in flags.FLAGS.variants:
            cfg = bench.variant_cfg(model_name, variant, flags.FLAGS.dtype, False)
            for context in [int(c) for c in flags.FLAGS.contexts]:
                roof = (statistics.median(probe.once() for _ in range(_PROBE_READS.value))
                        if probe else chip.hbm_bytes_per_s)
                p = profile.profile_step(cfg, context, steps=flags.FLAGS.repeats)
                print(f"\n{model_name} {variant} t={context:,d}: step {p.wall_seconds * 1e3:.2f} ms"
                      f" (traced {p.traced_wall_seconds * 1e3:.2f} ms; thunks "
                      f"{p.thunk_seconds * 1e3:.2f} ms); probe {roof / 1e9:.1f} GB/s")
                print(f"  {'group':44s} {'n':>4s} {'ms':>7s} {'share':>6s} {'MB':>8s} "
                      f"{'GB/s':>6s} {'probe':>6s}")
                for g in p.groups:
                    # the group's share of the thunks' time, of the untraced step
                    secs = g.seconds / p.thunk_seconds * p.wall_seconds
                    cells = (f"{g.read_bytes / 1e6:8.1f} {g.read_bytes / secs / 1e9:6.1f} "
                             f"{g.read_bytes / secs / roof:6.0%}" if g.read_bytes and secs > 0
                             else f"{'-':>8s} {'-':>6s} {'-':>6s}")
                    print(f"  {g.key[:44]:44s} {g.count:4d} {g.seconds * 1e3:7.3f} "
                          f"{g.seconds / p.thunk_seconds:6.1%} {cells}", flush=True)
                if p.missing:
                    print(f"  not run in every step: {', '.join(p.missing)}")


if __name__ == "__main__":
    app.run(main)
