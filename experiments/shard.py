r"""Sweep meshes for the blog model and presets: per-device KV, collectives, XLA vs theory.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.shard
    python -m experiments.shard --context=32768 --out=/tmp/shard

Compiles one sharded decode step per (model, mesh) from shapes only (nothing allocated)
on the host's virtual CPU devices and writes ``shard.md`` (table + the capacity planner
for LLaMA-7B / Llama-2-70B at 128K on H100 / H200) and ``shard.png`` (per-device bytes
per mesh). The device count is set from --devices when JAX has not started yet.

Columns: collectives/step = payload bytes of the step's collectives from the compiled
HLO; HLO sent/axis = what one device sends per mesh axis (ring estimates,
kvjax.parallel.collectives); roofline ici/axis = jax.experimental.roofline's
inter-device bytes per axis (the fourth view: only collectives written in the jaxpr, the
'seq' combine; n/a with model > 1, see kvjax.parallel.costs._roofline_ici).
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from experiments import cli

_DEVICES = flags.DEFINE_integer("devices", 8, "virtual CPU devices (the meshes' size)")
_CONTEXT = flags.DEFINE_integer("context", 32768, "context t of the decode step (tokens)")
_MODELS = flags.DEFINE_list("models", ["blog", "llama-7b"], "presets to sweep")
_LAYERS = flags.DEFINE_integer("layers", 0, "layers compiled per model (0: all; fewer compile "
                               "faster and the table multiplies every figure by L / layers, "
                               "the LM head's too: rough)")
_OUT = flags.DEFINE_string("out", "/tmp/kvjax_shard", "output folder")

MESHES = [(8, 1, 1), (1, 8, 1), (2, 4, 1), (1, 4, 2), (1, 2, 4), (1, 1, 8)]


def check_flags(devices: int, context: int, layers: int, models: list) -> None:
    """Raises app.UsageError naming the bad flag, its value and what is allowed, before
    anything compiles."""
    need = max(d * m * s for d, m, s in MESHES)
    if devices < need:
        raise app.UsageError(f"--devices={devices}; allowed: at least {need} (the largest "
                             f"swept mesh, data*model*seq)")
    if context < 1:
        raise app.UsageError(f"--context={context}; allowed: a positive number of tokens")
    if layers < 0:
        raise app.UsageError(f"--layers={layers}; allowed: 0 (all layers) or a positive "
                             "number of layers")
    if not models:
        raise app.UsageError("--models=''; allowed: a comma-separated list of presets")
    from kvjax.analysis import sizing  # noqa: PLC0415 (no backend started)
    for name in models:
        try:
            sizing.model_config(name)
        except ValueError as e:
            raise app.UsageError(f"--models={','.join(models)}: {e}") from None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from kvjax.parallel import distributed  # noqa: PLC0415
    # the device count first: checking --models builds preset configs, which starts JAX
    distributed.set_local_devices(_DEVICES.value)
    check_flags(_DEVICES.value, _CONTEXT.value, _LAYERS.value, _MODELS.value)
    import jax  # noqa: PLC0415
    from kvjax.analysis import sizing  # noqa: PLC0415
    from kvjax.config import ConfigError, MeshConfig  # noqa: PLC0415
    from kvjax.parallel import capacity, costs  # noqa: PLC0415
    from kvjax.parallel.collectives import CacheGatherError  # noqa: PLC0415

    os.makedirs(_OUT.value, exist_ok=True)
    t = _CONTEXT.value
    rows = ["| model | mesh (data,model,seq) | KV/device MB | collectives/step KB | "
            "HLO sent/axis KB | roofline ici/axis KB | "
            "XLA bytes/device MB | theory bytes/device MB | XLA/theory | cache gathers |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    per_axis = lambda d, scale: ", ".join(f"{a} {v * scale / 1e3:,.1f}"
                                          for a, v in sorted(d.items())) or "0"
    plot = {}
    for name in _MODELS.value:
        full = sizing.model_config(name, dtype="float32")
        cfg = full.replace(num_layers=min(_LAYERS.value or full.num_layers, full.num_layers), scan_layers=False,
                           backend="cpu")
        scale = full.num_layers / cfg.num_layers
        for shape in MESHES:
            mc = MeshConfig(*shape, kv_fallback="replicate")
            try:
                c = costs.analyze_sharded_step(cfg, mc, t, batch=max(shape[0], 1))
            except ConfigError as e:
                rows.append(f"| {name} | {shape} | - | - | - | - | - | - | - | {e} |")
                continue
            except CacheGatherError as e:  # a defect: the table would be wrong
                print(f"error: {name} on mesh {shape}: {e}", file=sys.stderr)
                return 3
            # the embedding/LM head do not scale with L: scale layer terms only roughly
            rows.append(
                f"| {name} (L={full.num_layers}, B={shape[0]}) | {shape} | "
                f"{c.kv_bytes_dev * scale / 1e6:,.1f} | "
                f"{c.collective_bytes * scale / 1e3:,.1f} | {per_axis(c.per_axis, scale)} | "
                + (per_axis(c.roofline_per_axis, scale) if c.roofline_per_axis is not None
                   else "n/a (model > 1)") + " | "
                f"{c.xla_bytes * scale / 1e6:,.1f} | "
                f"{c.theory_bytes_dev * scale / 1e6:,.1f} | "
                f"{c.xla_bytes / c.theory_bytes_dev:.2f} | {len(c.cache_gathers)} |")
            plot.setdefault(name, []).append((str(shape), c.kv_bytes_dev * scale,
                                              c.xla_bytes * scale, c.theory_bytes_dev * scale))
            print(rows[-1], flush=True)
    plans = [capacity.plan(m, chip, "128K") for m in ("llama-7b", "llama2-70b")
             for chip in ("H100", "H200")]
    machine = f"{jax.devices()[0].platform} x{len(jax.devices())} virtual devices"
    text = (f"# Sharded decode step at t = {t} ({machine}; layers compiled: "
            f"{_LAYERS.value}, scaled to the full L; float32)\n\n" + "\n".join(rows)
            + "\n\n# Capacity planner (theory, float16, 90% of HBM usable)\n\n"
            + capacity.table(plans) + "\n")
    with open(os.path.join(_OUT.value, "shard.md"), "w") as f:
        f.write(text)
    print("\n" + capacity.table(plans))
    if not plot:
        print("no mesh fitted: no plot (the table says why)", file=sys.stderr)
        return 1
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        fig, axes = plt.subplots(1, len(plot), figsize=(6 * len(plot), 4), squeeze=False)
        for ax, (name, pts) in zip(axes[0], plot.items()):
            xs = range(len(pts))
            ax.bar([x - 0.2 for x in xs], [p[2] / 1e6 for p in pts], 0.4, label="XLA")
            ax.bar([x + 0.2 for x in xs], [p[3] / 1e6 for p in pts], 0.4, label="theory")
            ax.plot(list(xs), [p[1] / 1e6 for p in pts], "k.-", label="KV per device")
            ax.set_xticks(list(xs), [p[0] for p in pts], rotation=30)
            ax.set_ylabel("MB per device per step")
            ax.set_title(f"{name}, t = {t}")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(_OUT.value, "shard.png"), dpi=100)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
    print(f"wrote {_OUT.value}/shard.md")


if __name__ == "__main__":
    cli.run(main)
