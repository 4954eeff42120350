r"""Sweep the cost hook: theory | jaxpr | compiled | measured, per variant, context, dtype.

    python -m experiments.costs                  # the default sweep (~5 min on a 2-core CPU)
    python -m experiments.costs --measure_dtypes=float32,bfloat16   # time bf16 steps too
    python -m experiments.costs --quick          # float32; t = 512, 3072, 16384
    python -m experiments.costs --variants=mha,mqa --contexts=4096,131072 \
        --dtypes=bfloat16 --measure_max_context=0 --out_dir=/tmp/costs

Variants of the blog's running model (D=512, N=8, H=64, L=12, GELU FFN, V=32,000):
mha (K=8), gqa (K=2), mqa (K=1), mla-naive / mla-absorbed (C=512, R=64, as
configs/mla.py; when kvjax.mla is present), window (MHA, W=512), gqa-window (K=2, W=512).

For each point the decode step is compiled from shapes (nothing allocated) and costed four
ways (kvjax.costs): the blog's closed forms; jax.experimental.roofline over the jaxpr
(dots only, loop-corrected); XLA's cost analysis of the compiled step (loop-corrected,
attributed to KV reads/writes, weights, copies, other); and, for contexts in
``--measure_contexts`` up to ``--measure_max_context`` and dtypes in ``--measure_dtypes``,
the median wall time of the step (random weights, a full cache) as achieved bytes/s.
Windowed variants compile one program (W slots) for every context >= W.

Writes to ``--out_dir`` (default results/costs/): costs.csv and costs.json (one row per
point; the JSON also holds the device, its measured bandwidth and the command), the
printed table as table.txt, and PNGs:
step_bytes_<dtype>.png (step bytes vs context: theory lines, compiled markers, the
crossover t*), roofline_<dtype>.png (arithmetic intensity vs attainable FLOP/s: A100,
H100, H200 and this machine), kv_to_weights.png (the KV-to-weights ratio t/(6·D)) and
attribution_<dtype>_t<context>.png (compiled bytes by part, beside theory's terms).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import sys
import time

from absl import app, flags
import jax
import numpy as np

from experiments import cli
from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.analysis import costs, hardware, report, roofline, theory
from kvjax.config import ModelConfig, default_scan_layers

ALL_VARIANTS = ("mha", "gqa", "mqa", "mla-naive", "mla-absorbed", "window", "gqa-window")
DEFAULT_CONTEXTS = (512, 1024, 2048, 3072, 4096, 16384, 32768, 131072)

_VARIANTS = flags.DEFINE_list("variants", list(ALL_VARIANTS),
                              f"Variants of the blog model: {', '.join(ALL_VARIANTS)}.")
_CONTEXTS = flags.DEFINE_list("contexts", [str(c) for c in DEFAULT_CONTEXTS],
                              "Context lengths t (tokens in the cache).")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "float32 | bfloat16 | float16.")
_MEASURE_CONTEXTS = flags.DEFINE_list("measure_contexts", ["512", "3072", "16384"],
                                      "Contexts whose step is also timed (if swept).")
_MEASURE_DTYPES = flags.DEFINE_list("measure_dtypes", ["float32"],
                                    "Dtypes whose steps are timed (others: compile only).")
_MEASURE_MAX = flags.DEFINE_integer(
    "measure_max_context", 16384, "Never time a step above this context (0: time none); "
    "larger ones are compiled and costed only.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps per measured point (median).")
_BUDGET = flags.DEFINE_float("measure_budget_s", 2.0,
                             "Stop timing a point once its timed steps add up to this.")
_TABLE_CONTEXTS = flags.DEFINE_list("table_contexts", ["512", "3072", "16384"],
                                    "Contexts printed in the stdout table.")
_PLOT_CONTEXT = flags.DEFINE_integer("plot_context", 16384,
                                     "Context of the attribution bar plot.")
_SCAN = flags.DEFINE_enum("scan_layers", "auto", ["auto", "true", "false"],
                          "Layer stack: auto = unrolled on CPU, scanned elsewhere.")
_OUT = flags.DEFINE_string("out_dir", "results/costs", "Where CSV, JSON and PNGs go.")
_QUICK = flags.DEFINE_bool("quick", False,
                           "Contexts 512/3072/16384, 3 repeats; float32 timed, bfloat16 "
                           "compiled only.")

_COLORS = {"mha": "C0", "gqa": "C1", "mqa": "C2", "mla-naive": "C3", "mla-absorbed": "C4",
           "window": "C5", "gqa-window": "C6"}
_PARTS = ("weights", "kv_read", "kv_write", "kv_copies", "weight_copies", "other")


def variant_config(variant: str, dtype: str, scan_layers: bool) -> ModelConfig:
    """The blog model with one attention variant (see the module docstring)."""
    base = presets.blog_model(dtype=dtype, scan_layers=scan_layers)
    mla = presets.blog_mla(dtype=dtype, scan_layers=scan_layers)
    fields = {
        "mha": lambda: base,
        "gqa": lambda: presets.variant(base, num_kv_heads=2),
        "mqa": lambda: presets.variant(base, num_kv_heads=1),
        "mla-naive": lambda: mla.replace(mla_absorb=False),
        "mla-absorbed": lambda: mla,
        "window": lambda: presets.variant(base, window_size=512),
        "gqa-window": lambda: presets.variant(base, num_kv_heads=2, window_size=512),
    }
    if variant not in fields:
        raise app.UsageError(f"--variants: {variant!r}; allowed: {', '.join(fields)}")
    return fields[variant]().replace(name=f"blog-{variant}")


@dataclasses.dataclass
class _Program:
    """One compiled step and its context-independent analysis (shared by window points)."""

    compiled: object
    step: costs.StepCost
    runnable: bool


def sweep(variants, contexts, dtypes, measure_contexts, repeats, scan_layers,
          measure_dtypes=("float32",), budget_s: float | None = 2.0,
          log=print) -> list[dict]:
    """Costs every (dtype, variant, context); returns one :func:`kvjax.costs.views` row
    per point, plus 'variant' and 'measured_times_s'. Points whose context is in
    ``measure_contexts`` and dtype in ``measure_dtypes`` are also timed."""
    rows = []
    for dtype in dtypes:
        for variant in variants:
            cfg = variant_config(variant, dtype, scan_layers)
            programs: dict[int, _Program] = {}
            for t in contexts:
                start = time.perf_counter()
                slots = cache_lib.num_slots(cfg, t)
                measure = t in measure_contexts and dtype in measure_dtypes
                prog = programs.get(slots)
                if prog is None or (measure and not prog.runnable):
                    options = None if measure else costs.analysis_compiler_options()
                    compiled = costs.compile_decode_step(cfg, 1, t, options)
                    step = costs.analyze_decode_step(cfg, t, compiled=compiled)
                    prog = programs[slots] = _Program(compiled, step, measure)
                else:  # same program (a window's W slots): only theory changes with t
                    fresh = costs.analyze_decode_step(cfg, t, compiled=prog.compiled,
                                                      attribute=False, jaxpr=False)
                    step = dataclasses.replace(fresh, attribution=prog.step.attribution,
                                               jaxpr=prog.step.jaxpr)
                times = []
                if measure:
                    times = costs.measure_decode_step(cfg, t, 1, repeats, prog.compiled,
                                                      budget_s=budget_s)
                seconds = statistics.median(times) if times else None
                row = costs.views(step, seconds)
                row.update(variant=variant, measured_times_s=times)
                rows.append(row)
                log(f"{dtype:8s} {variant:12s} t={t:>6}: XLA/theory bytes "
                    f"{row['bytes_ratio']:.2f}, FLOP {row['flops_ratio']:.2f}"
                    + (f", {seconds * 1e3:.2f} ms" if seconds else "")
                    + f"  [{time.perf_counter() - start:.1f} s]")
    return rows


# --------------------------------------------------------------------------- outputs


def table(rows: list[dict], contexts) -> str:
    """theory | jaxpr | compiled | measured, one line per (dtype, context, variant)."""
    out = []
    for r in rows:
        if r["context"] not in contexts:
            continue
        ms = r["measured_s"] * 1e3 if r["measured_s"] == r["measured_s"] else float("nan")
        mb = [f"{r[k] / 1e6:,.1f}" for k in ("theory_bytes", "jaxpr_bytes", "xla_bytes")]
        out.append((r["dtype"], r["context"], r["variant"], *mb, r["bytes_ratio"],
                    r["xla_kv_read"] / r["theory_kv_read"] if r["theory_kv_read"] else 1.0,
                    r["flops_ratio"], ms, r["theory_bytes_per_s"] / 1e9,
                    r["xla_bytes_per_s"] / 1e9))
    order = {d: i for i, d in enumerate(dict.fromkeys(r["dtype"] for r in rows))}
    out.sort(key=lambda x: (order[x[0]], x[1]))  # stable: variants keep the sweep's order
    return report.format_table(out, (
        "dtype", "t", "variant", "theory MB", "jaxpr MB", "XLA MB", "XLA/theory",
        "kv_read XLA/th", "FLOP XLA/th", "measured ms", "theory GB/s", "XLA GB/s"))


def notes(rows: list[dict], contexts, backend: str) -> list[str]:
    """One line per unusual ratio in the table's rows, saying where it comes from:
    bfloat16 / float16 steps on CPU (compiled bytes far above theory), and the absorbed
    MLA's kv_read (its latent read twice)."""
    shown = [r for r in rows if r["context"] in contexts]
    out = []
    half = [r for r in shown if r["dtype"] in ("bfloat16", "float16")
            and r["bytes_ratio"] > 1.5]
    if half and backend == "cpu":
        lo, hi = min(r["bytes_ratio"] for r in half), max(r["bytes_ratio"] for r in half)
        r = max(half, key=lambda x: x["bytes_ratio"])
        copies = sum(r.get(f"xla_{k}", 0.0) or 0.0 for k in ("weight_copies", "kv_copies"))
        out.append(
            f"note: {r['dtype']} rows, XLA/theory {lo:.1f}-{hi:.1f}x: XLA's CPU backend has "
            f"no {r['dtype']} dot, so the compiled step converts its operands to float32 "
            "inside the step and reads and writes those copies; theory counts the "
            f"{r['dtype']} bytes read once, as a GPU reads them (at {r['variant']} t = "
            f"{r['context']:,}: {copies / 1e6:,.1f} MB of copies and "
            f"{(r.get('xla_other') or 0.0) / 1e6:,.1f} MB of 'other' in the attribution). "
            "Time bf16 on a GPU (scripts/gpu_check.sh); on CPU compare float32 rows.")
    for r in shown:
        if r["variant"] == "mla-absorbed" and r["theory_kv_read"]:
            cfg = variant_config("mla-absorbed", r["dtype"], bool(r["scan_layers"]))
            c, rr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
            out.append(
                f"note: mla-absorbed kv_read XLA/theory "
                f"{r['xla_kv_read'] / r['theory_kv_read']:.2f}: the absorbed decode reads "
                "the latent c_kv twice a step (the scores against it, then the values "
                "from it: two products XLA does not fuse) and the rotary key once, theory "
                f"counts each once: (2·C + R) / (C + R) = {(2 * c + rr) / (c + rr):.2f} for "
                f"C = {c}, R = {rr}")
            break
    return out


def write_files(rows: list[dict], meta: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    csv_path = os.path.join(out_dir, "costs.csv")
    keys = list(dict.fromkeys(k for r in rows for k in r if k != "measured_times_s"))
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    json_path = os.path.join(out_dir, "costs.json")
    with open(json_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=float)
    return [csv_path, json_path]


def _plt():
    import matplotlib  # noqa: PLC0415 (plots only)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    return plt



GB = 1e9  # every GB / MB on the plots is decimal: 10^9 / 10^6 bytes
_STYLE = {"mla-naive": (0, (5, 3))}  # dashed: its theory equals mla-absorbed's line


def _finish(fig, ax, path, handles=None) -> None:
    """Shared styling of the log-log plots: grid, legend outside the axes on the right,
    then save (PNG, 120 dpi) and close."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: PLC0415

    ax.title.set_fontsize(9)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_yscale() == "log":  # plain numbers (0.2, 0.5, 1, 2), not 2x10^-1
        lo, hi = ax.get_ylim()
        if hi / lo < 1e3:
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    if handles is None:
        handles = ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _variant_handles(variants) -> list:
    """One legend entry per variant (its colour), whatever the marks it has."""
    from matplotlib.lines import Line2D  # noqa: PLC0415
    return [Line2D([], [], color=_COLORS.get(v, "k"), ls=_STYLE.get(v, "-"), lw=2,
                   label=v + (" (theory = mla-absorbed)" if v == "mla-naive" else ""))
            for v in variants]


def _mark(marker: str, label: str, **kw):
    from matplotlib.lines import Line2D  # noqa: PLC0415
    return Line2D([], [], color=kw.pop("color", "k"), marker=marker, ls=kw.pop("ls", "none"),
                  label=label, **kw)


def plot_step_bytes(rows, dtype, scan_layers, path) -> None:
    """Step bytes (GB) vs context: theory lines, compiled (XLA) markers, t* marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ts = np.geomspace(256, 2 * max(r["context"] for r in rows), 200)
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["dtype"] == dtype))
    for variant in variants:
        cfg = variant_config(variant, dtype, scan_layers)
        c = _COLORS.get(variant, "k")
        ax.plot(ts, [theory.step_bytes(cfg, int(t)).total / GB for t in ts], color=c,
                lw=1.4, ls=_STYLE.get(variant, "-"), zorder=3 if variant in _STYLE else 2)
        pts = [r for r in rows if r["dtype"] == dtype and r["variant"] == variant]
        ax.plot([r["context"] for r in pts], [r["xla_bytes"] / GB for r in pts], "o",
                color=c, ms=5)
        t_star = theory.crossover_context(cfg)
        if math.isfinite(t_star):
            ax.plot([t_star], [theory.step_bytes(cfg, int(t_star)).total / GB], "x",
                    color=c, ms=9, mew=2)
    blog = variant_config("mha", dtype, scan_layers)
    wb = theory.weight_bytes_per_step(blog) / GB
    ax.axhline(wb, color="gray", ls=":", lw=1)
    t_blog = theory.crossover_context_blog(blog.d_model)
    ax.axvline(t_blog, color="gray", ls="--", lw=1)
    ax.text(t_blog * 1.05, 0.03, f"blog t* = 6·D = {t_blog:,}", color="gray", fontsize=8,
            transform=ax.get_xaxis_transform())
    ax.set(xscale="log", yscale="log", xlabel="context t (tokens)",
           ylabel="GB per decode step (GB = 10^9 bytes)",
           title=f"Blog model decode step, {dtype}, batch 1: bytes moved")
    handles = _variant_handles(variants) + [
        _mark(None, "theory (line)", ls="-"),
        _mark("o", "XLA compiled, loop-corrected"),
        _mark("x", "t*: KV read = weights", mew=2),
        _mark(None, f"weights per step ({wb:.2f} GB)", ls=":", color="gray"),
        _mark(None, "blog's t* = 6·D", ls="--", color="gray")]
    _finish(fig, ax, path, handles)


def _flops_text(flops: float) -> str:
    return (f"{flops / 1e12:,.1f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:,.0f} GFLOP/s")


def plot_roofline(rows, dtype, local: hardware.Chip, path) -> None:
    """Arithmetic intensity vs attainable FLOP/s: chip rooflines (their ridge points
    marked and labelled, the blog's A100 fp16 ridge of 156 FLOP/byte always drawn),
    decode-step points."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    ai = np.geomspace(0.05, 2000, 300)
    chips = [hardware.CHIPS[n] for n in ("A100-80GB", "H100-SXM", "H200")] + [local]
    handles = []
    roofs = [(chip, dtype if chip.peak_flops(dtype) else "float32") for chip in chips]
    if dtype == "float32":  # the blog reasons in fp16: keep its A100 roof in view
        roofs.insert(1, (hardware.CHIPS["A100-80GB"], "float16"))
    chip_colors = ["k", "C7", "C8", "C9", "0.55"]  # apart from the variants' C0-C6
    for i, (chip, peak_dtype) in enumerate(roofs):
        y = [roofline.attainable_flops(a, chip, peak_dtype) for a in ai]
        ridge = chip.ridge_point(peak_dtype)
        peak = chip.peak_flops(peak_dtype)
        label = (f"{chip.name}: {chip.hbm_bytes_per_s / GB:,.0f} GB/s"
                 + (f", {_flops_text(peak)} {peak_dtype}; ridge {ridge:,.{0 if ridge >= 10 else 1}f}"
                    " FLOP/B" if ridge else " (peak not measured)"))
        ls = "--" if (chip.name == "A100-80GB" and peak_dtype == "float16"
                      and dtype == "float32") else "-"
        i = chip_colors[i % len(chip_colors)]
        line, = ax.plot(ai, y, color=i, lw=1.5, ls=ls, label=label)
        handles.append(line)
        if ridge:
            ax.plot([ridge], [peak], "|", color=i, ms=14, mew=2)
            if chip.name == "A100-80GB" and peak_dtype == "float16":
                ax.annotate(f"blog: A100 fp16 ridge\n= {ridge:.0f} FLOP/byte", (ridge, peak),
                            xytext=(8, -26), textcoords="offset points", ha="left",
                            fontsize=8, color=i)
    h200 = hardware.H200
    variants = []
    for r in rows:
        if r["dtype"] != dtype:
            continue
        variants.append(r["variant"])
        c = _COLORS.get(r["variant"], "k")
        a_th = r["theory_flops"] / r["theory_bytes"]
        ax.plot([a_th], [roofline.attainable_flops(a_th, h200, dtype)], "o", mfc="none",
                color=c, ms=5)
        if r["measured_s"] == r["measured_s"]:
            a_x = r["xla_flops"] / r["xla_bytes"]
            ax.plot([a_x], [r["xla_flops"] / r["measured_s"]], "o", color=c, ms=5)
    handles += _variant_handles(dict.fromkeys(variants)) + [
        _mark("o", "theory intensity, on H200's roof", mfc="none"),
        _mark("o", "XLA intensity at the FLOP/s measured here"),
        _mark("|", "ridge point (peak / bandwidth)", ms=10, mew=2)]
    ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)",
           ylabel="attainable FLOP/s",
           title=f"Roofline of a decode step ({dtype}, batch 1)")
    _finish(fig, ax, path, handles)


def plot_kv_to_weights(rows, dtype, scan_layers, path) -> None:
    """KV read / weight bytes per step vs context: the blog's t/(6·D), theory per variant
    (with this model's exact weights), and XLA's attributed kv_read / weights."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ts = np.geomspace(256, 2 * max(r["context"] for r in rows), 200)
    blog = variant_config("mha", dtype, scan_layers)
    ax.plot(ts, [theory.kv_to_weight_ratio(t, blog.d_model) for t in ts], "k--", lw=1.5)
    variants = list(dict.fromkeys(r["variant"] for r in rows if r["dtype"] == dtype))
    for variant in variants:
        cfg = variant_config(variant, dtype, scan_layers)
        c = _COLORS.get(variant, "k")
        ax.plot(ts, [theory.step_bytes(cfg, int(t)).kv_read / theory.weight_bytes_per_step(cfg)
                     for t in ts], color=c, lw=1.2, ls=_STYLE.get(variant, "-"),
                zorder=3 if variant in _STYLE else 2)
        pts = [r for r in rows if r["dtype"] == dtype and r["variant"] == variant]
        ax.plot([r["context"] for r in pts], [r["xla_kv_read"] / r["xla_weights"] for r in pts],
                "o", color=c, ms=5)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="context t (tokens)",
           ylabel="KV bytes read / weight bytes read, per step",
           title=f"KV-to-weights ratio per decode step ({dtype}, batch 1)")
    handles = _variant_handles(variants) + [
        _mark(None, "blog: t / (6·D) (24·L·D² weights)", ls="--"),
        _mark(None, "theory, this model's exact weights (+ V·D LM head)", ls="-"),
        _mark("o", "XLA: attributed kv_read / weights"),
        _mark(None, "ratio 1: KV read = weights", ls="-", color="gray")]
    _finish(fig, ax, path, handles)


def plot_attribution(rows, dtype, context, path) -> bool:
    """Where the compiled bytes go at one context: per variant, one bar per part (log
    scale, MB = 10^6 bytes: the weights dwarf KV writes by 10^3), theory's weights /
    kv_read / kv_write as black ticks on the matching bars."""
    pts = [r for r in rows if r["dtype"] == dtype and r["context"] == context]
    if not pts:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 5))
    x = np.arange(len(pts))
    width = 0.8 / len(_PARTS)
    theory_drawn = False
    for i, part in enumerate(_PARTS):
        vals = np.array([r[f"xla_{part}"] for r in pts], dtype=float) / 1e6
        off = x - 0.4 + (i + 0.5) * width
        ax.bar(off, np.where(vals > 0, vals, np.nan), width, color=f"C{i}",
               label=f"XLA {part.replace('_', ' ')}")
        if part in ("weights", "kv_read", "kv_write"):
            th = np.array([r[f"theory_{part}"] for r in pts], dtype=float) / 1e6
            ax.plot(off, np.where(th > 0, th, np.nan), "_", color="k", ms=12, mew=2,
                    label=None if theory_drawn else "theory (weights, KV read, KV write)")
            theory_drawn = True
    ax.set_xticks(x, [r["variant"] for r in pts], fontsize=8)
    ax.set_yscale("log")
    ax.set(ylabel="MB per decode step (MB = 10^6 bytes, log scale)",
           title=f"Where the compiled bytes go at t = {context:,} ({dtype}, batch 1); "
                 "parts with 0 bytes have no bar")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    _finish(fig, ax, path)
    return True


def write_plots(rows, dtypes, scan_layers, local, plot_context, out_dir) -> list[str]:
    paths = []
    for dtype in dtypes:
        p = os.path.join(out_dir, f"step_bytes_{dtype}.png")
        plot_step_bytes(rows, dtype, scan_layers, p)
        paths.append(p)
        p = os.path.join(out_dir, f"roofline_{dtype}.png")
        plot_roofline(rows, dtype, local, p)
        paths.append(p)
        p = os.path.join(out_dir, f"attribution_{dtype}_t{plot_context}.png")
        if plot_attribution(rows, dtype, plot_context, p):
            paths.append(p)
    p = os.path.join(out_dir, "kv_to_weights.png")
    plot_kv_to_weights(rows, dtypes[0], scan_layers, p)
    paths.append(p)
    return paths


def local_chip() -> hardware.Chip:
    """This machine's roofline: a known GPU's datasheet, else the measured bandwidth and
    float32 matmul rate (CPU)."""
    return hardware.local_chip(measure_flops=True)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    variants, dtypes = list(_VARIANTS.value), list(_DTYPES.value)
    contexts = [int(c) for c in _CONTEXTS.value]
    measure = {int(c) for c in _MEASURE_CONTEXTS.value if int(c) <= _MEASURE_MAX.value}
    repeats = _REPEATS.value
    if _QUICK.value:  # bf16 compiled only (measure_dtypes): its roofline uses the fp16 peaks
        dtypes, contexts, repeats = ["float32", "bfloat16"], [512, 3072, 16384], 3
    scan_layers = {"auto": default_scan_layers(), "true": True, "false": False}[_SCAN.value]
    for v in variants:
        variant_config(v, dtypes[0], scan_layers)  # fail fast on a bad name
    start = time.perf_counter()
    rows = sweep(variants, contexts, dtypes, measure, repeats, scan_layers,
                 measure_dtypes=_MEASURE_DTYPES.value, budget_s=_BUDGET.value)
    local = local_chip()
    meta = {
        "command": " ".join(["python -m experiments.costs"] + sys.argv[1:]),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "device": hardware.device_name(), "local_chip": dataclasses.asdict(local),
        "scan_layers": scan_layers, "variants": variants, "contexts": contexts,
        "dtypes": dtypes, "measured_contexts": sorted(measure),
        "measured_dtypes": list(_MEASURE_DTYPES.value), "repeats": repeats,
        "seconds": time.perf_counter() - start,
    }
    shown = {int(c) for c in _TABLE_CONTEXTS.value}
    text = "\n".join([table(rows, shown), *notes(rows, shown, jax.default_backend())])
    print()
    print(text)
    paths = write_files(rows, meta, _OUT.value)
    paths.append(os.path.join(_OUT.value, "table.txt"))
    with open(paths[-1], "w") as f:
        f.write(f"$ {meta['command']}\n\n{text}\n")
    paths += write_plots(rows, dtypes, scan_layers, local, _PLOT_CONTEXT.value, _OUT.value)
    print(f"\nlocal roofline: {local.name}, {local.hbm_bytes_per_s / 1e9:.1f} GB/s "
          f"({local.source}); sweep took {meta['seconds']:.0f} s")
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    cli.run(main)
