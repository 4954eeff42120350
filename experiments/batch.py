r"""The blog's batch-size wall, swept: B = 1, 2, 4, ... up to the memory wall.

    python -m experiments.batch                          # the default sweep (minutes here)
    python -m experiments.batch --quick                  # smoke test
    python -m experiments.batch --memory_budget_gb=2 --levers=gqa,mqa --json_out=/tmp/b.json
    python -m experiments.batch --plot_dir=/tmp/batch_plots

For the blog's model and SmolLM2-135M, each lever (MHA, GQA, MQA, MLA absorbed, window
W=512; kvjax.analysis.batch.lever_config) and t in ``--contexts``:

1. theory by phase on the blog's chips (float16, the blog's setting): weights (bytes
   constant, FLOPs ∝ B) and KV (both ∝ B), intensities beside the ridge points, roofline
   tokens/s;
2. XLA's compiled generate loop per step (loop-corrected, attributed to weights / KV) at
   ``--xla_batches``, against theory per phase (``--xla_shapes``, float32 as measured);
3. measured here (float32; CPUs widen 16-bit dots): seconds per step of the compiled
   loop, tokens/s = B / step, achieved bytes/s and the local roofline's prediction, for
   B doubling until the next batch would not fit ``--memory_budget_gb``
   (``--measure_shapes``, ``--measure_contexts``);
4. the two headline ratios (blog GQA, tokens/s at B = 64 over B = 1, at 1K and 32K;
   at 32K the largest B that fits the budget is used and named) against theory's ratio;
5. the ragged loop's step time over the lockstep loop's (same B, t);
6. the wall: ``theory.max_batch`` per lever and chip (units: sequences; the weights and a
   stated reserve subtracted), the blog's 625 = 60,000 MiB / 96 MiB, and on this machine
   caches allocated for real under ``--memory_budget_gb`` until the next sequence does not
   fit, against theory for the same budget;
7. the wall for paged caches (``--page_size`` P): requests of lengths spread evenly
   over 1..t, held at once under per-slot reservation (a row of t each), on pages
   (P·ceil(l/P) tokens each; a window's rows free the pages that slide out) and on pages
   with every request at t, per chip; and on this machine a page pool allocated for real
   under the same budget, requests admitted through the paged engine's allocator until
   the next does not fit, against the theory for the pool's bytes.

A budget larger than the memory available, or too small for the weights and one
sequence, is refused before anything is allocated, naming the budget and the bytes.
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax
from absl import app, flags

from experiments import cli
from kvjax.analysis import batch as batch_lib
from kvjax.analysis import hardware, theory
from kvjax.analysis.report import format_table
from kvjax.config import ConfigError
from kvjax.inference import memory
from kvjax.models import model as model_lib

_SHAPES = flags.DEFINE_list("shapes", list(batch_lib.SHAPES), "Model shapes for theory.")
_LEVERS = flags.DEFINE_list("levers", list(batch_lib.LEVERS), "Levers.")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "8192", "32768"], "Contexts t (tokens).")
_MAX_BATCH = flags.DEFINE_integer("max_batch", 64, "Largest B of the sweep.")
_BUDGET = flags.DEFINE_float("memory_budget_gb", 4.0,
                             "GiB this run may allocate for weights + caches (measured "
                             "points and the measured wall).")
_XLA = flags.DEFINE_bool("xla", True, "Compile the loop and split XLA's figures by phase.")
_XLA_SHAPES = flags.DEFINE_list("xla_shapes", ["blog"], "Shapes compiled for XLA's view.")
_XLA_BATCHES = flags.DEFINE_list("xla_batches", ["1", "64"], "B compiled for XLA's view.")
_XLA_CONTEXTS = flags.DEFINE_list("xla_contexts", ["1024", "32768"], "t for XLA's view.")
_MEASURE_SHAPES = flags.DEFINE_list("measure_shapes", ["blog"], "Shapes timed here.")
_MEASURE_LEVERS = flags.DEFINE_list("measure_levers", list(batch_lib.LEVERS), "Levers timed.")
_MEASURE_CONTEXTS = flags.DEFINE_list("measure_contexts", ["1024", "32768"], "t timed here.")
_RAGGED_BATCH = flags.DEFINE_integer("ragged_batch", 8, "B of the ragged vs lockstep check.")
_WALL_CONTEXT = flags.DEFINE_integer("wall_context", 32768, "t of the measured wall.")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page of the paged wall (7.).")
_RESERVE = flags.DEFINE_float("reserve_fraction", 0.25,
                              "Stated reserve of each chip's HBM in the theory wall.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write every row as JSON here.")
_PLOT_DIR = flags.DEFINE_string("plot_dir", None, "Write the three plots (PNG) here.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: tiny sweep, seconds to minutes.")


def _ints(xs) -> list[int]:
    try:
        out = [int(x) for x in xs]
    except ValueError:
        raise ConfigError(f"{xs!r}: allowed: a comma-separated list of integers") from None
    if any(x < 1 for x in out):
        raise ConfigError(f"{xs!r}: allowed: integers >= 1")
    return out


def _fits(cfg, b, t, budget) -> bool:
    need = memory.plan(cfg, b, t, weights_bytes=theory.weight_bytes(cfg), prompt_tokens=1)
    return need.total - need.margin <= budget


def sweep(opts: dict, log=print) -> dict:
    """Runs sections 1-6 (module doc) for ``opts`` and returns every row as JSON-able
    data; ``log`` prints progress and the tables."""
    out: dict = {"machine": None, "theory": [], "xla": [], "measured": [], "ratios": {},
                 "ragged_vs_lockstep": None, "wall_theory": [], "wall_measured": [],
                 "wall_paged_theory": [], "wall_paged_measured": [], "options": opts}
    budget = int(opts["memory_budget_gb"] * 2**30)
    batches = batch_lib.batch_sizes(opts["max_batch"])
    chips = [hardware.CHIPS[n] for n in ("A100-80GB", "H100-SXM", "H200")]

    # 1. theory on the chips, float16.
    rows = []
    for shape in opts["shapes"]:
        for lever in opts["levers"]:
            cfg = batch_lib.lever_config(shape, lever, "float16")
            for t in opts["contexts"]:
                for b in batches:
                    r = {"shape": shape, "lever": lever,
                         **batch_lib.theory_point(cfg, t, b, chips)}
                    rows.append(r)
    out["theory"] = rows
    log("1. theory by phase, float16 (bytes, FLOP; intensity FLOP/byte; ridge A100 "
        f"{chips[0].ridge_point('float16'):.0f}, H100 {chips[1].ridge_point('float16'):.0f}, "
        f"H200 {chips[2].ridge_point('float16'):.0f}); roofline tokens/s = B / step time")
    log(format_table(
        [(r["shape"], r["lever"], r["context"], r["batch"], r["weights_bytes"],
          r["weights_intensity"], r["kv_bytes"], r["kv_intensity"], r["intensity"],
          r["A100-80GB_tokens_per_s"], r["H200_tokens_per_s"]) for r in rows],
        ("shape", "lever", "t", "B", "W bytes", "W AI", "KV bytes", "KV AI", "AI",
         "A100 tok/s", "H200 tok/s")))

    # 2. XLA per phase (float32: the program measured here).
    if opts["xla"]:
        xrows = []
        for shape in opts["xla_shapes"]:
            for lever in opts["levers"]:
                cfg = batch_lib.lever_config(shape, lever, "float32")
                for t in opts["xla_contexts"]:
                    for b in opts["xla_batches"]:
                        t0 = time.perf_counter()
                        r = {"shape": shape, "lever": lever, "batch": b, "context": t,
                             **batch_lib.theory_point(cfg, t, b, chips=[]),
                             **batch_lib.xla_point(cfg, t, b)}
                        r["compile_s"] = time.perf_counter() - t0
                        xrows.append(r)
        out["xla"] = xrows
        log("\n2. XLA's loop per step vs theory by phase (float32); ratio = XLA / theory")
        log(format_table(
            [(r["shape"], r["lever"], r["context"], r["batch"],
              r["xla_over_theory_weights_bytes"], r["xla_over_theory_kv_bytes"],
              r["xla_over_theory_weights_flops"], r["xla_over_theory_kv_flops"],
              r["xla_weights_intensity"], r["xla_kv_intensity"]) for r in xrows],
            ("shape", "lever", "t", "B", "W bytes", "KV bytes", "W FLOP", "KV FLOP",
             "XLA W AI", "XLA KV AI")))

    # 3. measured here, float32, up to the wall of the budget.
    local = hardware.local_chip(measure_flops=True)
    out["machine"] = {"name": local.name, "bytes_per_s": local.hbm_bytes_per_s,
                      "float32_flops_per_s": local.peak_flops_per_s.get("float32"),
                      "cores": jax.local_device_count() and _cores()}
    log(f"\n3. measured on {local.name} ({_cores()} cores; read {local.hbm_bytes_per_s / 1e9:.1f}"
        f" GB/s, float32 matmul {local.peak_flops_per_s.get('float32', float('nan')) / 1e9:.0f}"
        f" GFLOP/s), float32, budget {opts['memory_budget_gb']} GiB")
    mrows = []
    for shape in opts["measure_shapes"]:
        for lever in opts["measure_levers"]:
            cfg = batch_lib.lever_config(shape, lever, "float32")
            params = model_lib.init_params(cfg, 0)
            for t in opts["measure_contexts"]:
                for b in batches:
                    if not _fits(cfg, b, t, budget):
                        log(f"  {shape} {lever} t={t}: B={b} does not fit "
                            f"{opts['memory_budget_gb']} GiB: the wall")
                        break
                    th = batch_lib.theory_point(cfg, t, b, chips=[])
                    m = batch_lib.measure_point(cfg, params, t, b, steps=opts["steps"],
                                                repeats=opts["repeats"])
                    pred = b / theory.step_time(th["bytes"], th["flops"], local, "float32")
                    r = {"shape": shape, "lever": lever, **th, **m,
                         "roofline_tokens_per_s": pred}
                    mrows.append(r)
                    log(f"  {shape} {lever} t={t} B={b}: {m['step_s'] * 1e3:.2f} ms/step, "
                        f"{m['tokens_per_s']:,.1f} tok/s (roofline {pred:,.1f}), "
                        f"{m['achieved_bytes_per_s'] / 1e9:.1f} GB/s")
            del params
    out["measured"] = mrows

    # 4. headline ratios.
    def ratio(shape, lever, t):
        pts = {r["batch"]: r for r in mrows if (r["shape"], r["lever"], r["context"]) ==
               (shape, lever, t)}
        if 1 not in pts or len(pts) < 2:
            return None
        top = 64 if 64 in pts else max(pts)
        cfg32 = batch_lib.lever_config(shape, lever, "float32")
        cfg16 = batch_lib.lever_config(shape, lever, "float16")
        th = lambda cfg, b, chip, dt: b / theory.step_time(
            theory.step_bytes(cfg, t, b).total, theory.step_flops(cfg, t, b).total, chip, dt)
        return {"shape": shape, "lever": lever, "context": t, "batch": top,
                "measured": pts[top]["tokens_per_s"] / pts[1]["tokens_per_s"],
                "theory_here": th(cfg32, top, local, "float32") / th(cfg32, 1, local, "float32"),
                "theory_A100_fp16": th(cfg16, top, chips[0], "float16")
                / th(cfg16, 1, chips[0], "float16"),
                "theory_A100_fp16_B64": th(cfg16, 64, chips[0], "float16")
                / th(cfg16, 1, chips[0], "float16")}

    log("\n4. tokens/s at B over B = 1 (blog GQA): measured vs theory")
    for t in opts["measure_contexts"]:
        r = ratio("blog", "gqa", t) if "blog" in opts["measure_shapes"] else None
        if r:
            out["ratios"][f"blog_gqa_t{t}"] = r
            log(f"  t={t}: B={r['batch']}: measured {r['measured']:.2f}x, theory here "
                f"{r['theory_here']:.2f}x (float32 roofline of this CPU), theory A100 fp16 "
                f"{r['theory_A100_fp16']:.2f}x (at B=64: {r['theory_A100_fp16_B64']:.2f}x)")

    # 5. ragged vs lockstep.
    if "blog" in opts["measure_shapes"] and opts["ragged_batch"]:
        cfg = batch_lib.lever_config("blog", "gqa", "float32")
        t = opts["measure_contexts"][0]
        if _fits(cfg, opts["ragged_batch"], t, budget // 2):
            params = model_lib.init_params(cfg, 0)
            rv = batch_lib.measure_ragged_vs_lockstep(cfg, params, t, opts["ragged_batch"],
                                                      repeats=opts["repeats"] + 1)
            out["ragged_vs_lockstep"] = rv
            log(f"\n5. ragged vs lockstep loop, blog GQA t={t} B={rv['batch']}: "
                f"{rv['ragged_step_s'] * 1e3:.2f} vs {rv['lockstep_step_s'] * 1e3:.2f} ms/step,"
                f" ratio {rv['ratio']:.3f}")
            del params

    # 6. the wall.
    log(f"\n6. the wall: theory.max_batch (sequences) per chip, float16, HBM less the "
        f"weights less a stated reserve of {opts['reserve_fraction']:.0%}; blog check: "
        f"60,000 MiB / 96 MiB = "
        f"{theory.max_batch(batch_lib.lever_config('blog', 'mha', 'float16'), 4096, batch_lib.BLOG_FREE_BYTES)}"
        " sequences at 4K")
    for shape in opts["shapes"]:
        for t in sorted({4096, *opts["contexts"]}):
            rows = batch_lib.wall_table(shape, t, chips, opts["reserve_fraction"])
            out["wall_theory"] += rows
            log(format_table([(r["shape"], r["lever"], t, r["kv_bytes_per_sequence"],
                               r["factor_over_mha"], *(r[c.name] for c in chips))
                              for r in rows],
                             ("shape", "lever", "t", "KV B/seq", "x MHA",
                              *(c.name for c in chips))))
    log(f"measured here: caches of t={opts['wall_context']} allocated one sequence at a "
        f"time under {opts['memory_budget_gb']} GiB (float32), vs theory.max_batch with the "
        "weights reserved")
    for lever in opts["levers"]:
        cfg = batch_lib.lever_config("blog", lever, "float32")
        w = batch_lib.measure_wall(cfg, opts["wall_context"], budget)
        r = {"shape": "blog", "lever": lever, "context": opts["wall_context"],
             **w.__dict__}
        out["wall_measured"].append(r)
        log(f"  blog {lever}: measured {w.measured}, theory {w.theory} "
            f"({w.per_sequence_bytes:,} B/seq; allocated {w.allocated_bytes:,} B of "
            f"{w.budget_bytes:,}; RSS grew {w.rss_growth_bytes or 0:,} B)")

    # 7. the wall on pages.
    p = opts["page_size"]
    log(f"\n7. the wall on pages of {p} tokens: requests of 1..t tokens (evenly spread) "
        "held at once, per-slot reservation (a row of t each) vs pages vs pages with "
        "every request at t; float16, the chips' free bytes as in 6.")
    for shape in opts["shapes"]:
        for t in sorted({4096, *opts["contexts"]}):
            rows = batch_lib.paged_wall_table(shape, t, p, chips, opts["reserve_fraction"])
            out["wall_paged_theory"] += rows
            log(format_table([(r["shape"], r["lever"], t, f"{r['mean_paged_tokens']:,.0f}",
                               *(f"{r[c.name + '_reserved']} / {r[c.name + '_paged']} / "
                                 f"{r[c.name + '_paged_full']}" for c in chips))
                              for r in rows],
                             ("shape", "lever", "t", "paged tokens/req",
                              *(f"{c.name} reserved / paged / paged at t" for c in chips))))
    log(f"measured here: one pool of pages of {p} under {opts['memory_budget_gb']} GiB "
        f"(float32, weights allocated first), requests of 1..{opts['wall_context']} tokens "
        "admitted until the next does not fit")
    for lever in opts["levers"]:
        cfg = batch_lib.lever_config("blog", lever, "float32")
        w = batch_lib.measure_paged_wall(cfg, opts["wall_context"], budget, p)
        r = {"shape": "blog", "lever": lever, "context": opts["wall_context"],
             **w.__dict__}
        out["wall_paged_measured"].append(r)
        log(f"  blog {lever}: measured {w.measured}, theory {w.theory} on pages; "
            f"{w.reserved} as rows of t ({w.num_pages:,} pages, {w.pool_bytes:,} B)")
    return out


def _cores() -> int:
    import os
    return os.cpu_count() or 0


def plots(out: dict, plot_dir: str) -> list[str]:
    """tokens/s vs B per lever (measured, with the roofline), intensity vs B per phase
    (theory, with the chips' ridge points), max batch per lever per chip."""
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plot_dir, exist_ok=True)
    paths = []
    ctxs = sorted({r["context"] for r in out["measured"]})
    if ctxs:
        fig, axes = plt.subplots(1, len(ctxs), figsize=(6 * len(ctxs), 4.5), squeeze=False)
        for ax, t in zip(axes[0], ctxs):
            for lever in sorted({r["lever"] for r in out["measured"]}):
                pts = [r for r in out["measured"] if r["context"] == t and r["lever"] == lever]
                bs = [r["batch"] for r in pts]
                line, = ax.plot(bs, [r["tokens_per_s"] for r in pts], "o-", label=lever)
                ax.plot(bs, [r["roofline_tokens_per_s"] for r in pts], "--",
                        color=line.get_color(), alpha=0.6)
            ax.set(xscale="log", yscale="log", xlabel="B", ylabel="tokens/s",
                   title=f"blog, t={t}: measured (solid), roofline (dashed)")
            ax.legend()
        p = os.path.join(plot_dir, "tokens_per_s_vs_batch.png")
        fig.tight_layout()
        fig.savefig(p)
        paths.append(p)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    t0 = out["theory"][0]["context"] if out["theory"] else None
    for lever in sorted({r["lever"] for r in out["theory"]}):
        pts = [r for r in out["theory"] if r["lever"] == lever and r["context"] == t0
               and r["shape"] == "blog"]
        if not pts:
            continue
        bs = [r["batch"] for r in pts]
        ax.plot(bs, [r["weights_intensity"] for r in pts], "o-", label=f"{lever} weights")
        ax.plot(bs, [r["kv_intensity"] for r in pts], "x--", label=f"{lever} KV")
    for chip in ("A100-80GB", "H100-SXM", "H200"):
        ax.axhline(hardware.CHIPS[chip].ridge_point("float16"), color="grey", lw=0.8)
        ax.text(1, hardware.CHIPS[chip].ridge_point("float16"), chip, fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="B", ylabel="FLOP/byte",
           title=f"blog, t={t0}: arithmetic intensity per phase (fp16)")
    ax.legend(fontsize=7)
    p = os.path.join(plot_dir, "intensity_vs_batch.png")
    fig.tight_layout()
    fig.savefig(p)
    paths.append(p)
    rows = [r for r in out["wall_theory"] if r["shape"] == "blog" and r["context"] == 4096]
    if rows:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        chips = ("A100-80GB", "H100-SXM", "H200")
        w = 0.8 / len(chips)
        for i, chip in enumerate(chips):
            ax.bar([j + i * w for j in range(len(rows))], [r[chip] for r in rows], w,
                   label=chip)
        ax.set_xticks([j + w for j in range(len(rows))], [r["lever"] for r in rows])
        ax.set(yscale="log", ylabel="max batch (sequences)",
               title="blog, t=4096, fp16: theory.max_batch per lever per chip")
        ax.legend()
        p = os.path.join(plot_dir, "max_batch_per_lever.png")
        fig.tight_layout()
        fig.savefig(p)
        paths.append(p)
    plt.close("all")
    return paths


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        for name, vals, allowed in (("shapes", _SHAPES.value, batch_lib.SHAPES),
                                    ("levers", _LEVERS.value, batch_lib.LEVERS),
                                    ("measure_levers", _MEASURE_LEVERS.value, batch_lib.LEVERS),
                                    ("measure_shapes", _MEASURE_SHAPES.value, batch_lib.SHAPES),
                                    ("xla_shapes", _XLA_SHAPES.value, batch_lib.SHAPES)):
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ConfigError(f"--{name}={','.join(vals)}: {bad[0]!r} unknown; allowed: "
                                  f"{', '.join(allowed)}")
        if _PAGE_SIZE.value < 1:
            raise ConfigError(f"--page_size={_PAGE_SIZE.value}; allowed: an integer >= 1")
        if not _BUDGET.value > 0:
            raise ConfigError(f"--memory_budget_gb={_BUDGET.value}; allowed: a number > 0")
        opts = {"shapes": _SHAPES.value, "levers": _LEVERS.value,
                "contexts": _ints(_CONTEXTS.value), "max_batch": _MAX_BATCH.value,
                "memory_budget_gb": _BUDGET.value, "xla": _XLA.value,
                "xla_shapes": _XLA_SHAPES.value, "xla_batches": _ints(_XLA_BATCHES.value),
                "xla_contexts": _ints(_XLA_CONTEXTS.value),
                "measure_shapes": _MEASURE_SHAPES.value,
                "measure_levers": _MEASURE_LEVERS.value,
                "measure_contexts": _ints(_MEASURE_CONTEXTS.value),
                "ragged_batch": _RAGGED_BATCH.value, "wall_context": _WALL_CONTEXT.value,
                "reserve_fraction": _RESERVE.value, "page_size": _PAGE_SIZE.value,
                "steps": (2, 6), "repeats": 2}
        if _QUICK.value:
            opts.update(shapes=["blog"], levers=["gqa", "mqa"], contexts=[1024],
                        max_batch=4, xla_batches=[1, 4], xla_contexts=[1024],
                        measure_levers=["gqa"], measure_contexts=[256], ragged_batch=2,
                        wall_context=4096, memory_budget_gb=min(_BUDGET.value, 1.0),
                        repeats=1)
        # Refuse a budget this machine cannot give before any work.
        avail, source = memory.available_bytes()
        want = int(opts["memory_budget_gb"] * 2**30)
        if avail is not None and want > avail:
            raise memory.MemoryCheckError(
                f"--memory_budget_gb={opts['memory_budget_gb']} asks for {want:,} bytes but "
                f"only {avail:,} bytes are available ({source}); allowed: a budget <= "
                f"{avail / 2**30:.2f}")
        out = sweep(opts)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if _PLOT_DIR.value:
        for p in plots(out, _PLOT_DIR.value):
            print(f"wrote {p}")
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(out, f, indent=1, default=lambda x: x if not isinstance(x, float)
                      or math.isfinite(x) else None)
        print(f"wrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
