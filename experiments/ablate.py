r"""Perplexity against KV-cache bytes for every lever, on a real model and a real corpus.

    python -m experiments.ablate                       # the default, CPU-sized run
    python -m experiments.ablate --eval.num_tokens=4096 --train.steps=10 --mla_ranks=64 \
        --out_dir=/tmp/ablate_quick                    # a quicker look
    python -m experiments.ablate --resume              # continue an interrupted run

SmolLM2-135M (GQA, 9 query heads / 3 KV heads, float32) is converted into every variant
of the blog's three levers and scored on the held-out split of the Django docs
(``kvjax.data``) through the decode path (``kvjax.evaluate``):

* KV heads: K = 9 (duplicated, exact), 3 (original), 1 (mean-pooled, Ainslie et al. 2023);
* sliding windows W in ``--windows`` with 0 and ``--sinks`` attention sinks (a config
  change: the ring-buffer cache); per-layer windows ``--layer_windows`` (local rings and
  global layers, ``model.layer_windows``; default Gemma 3's 5:1 with W = 128);
* MLA by low-rank factorisation (``convert.gqa_to_mla``) with a latent rank sweep;
* uptraining (``kvjax.train``) of the K = 1 model on the training split, and of the
  original K = 3 model with the same budget as a control (training on the corpus alone
  lowers perplexity by adapting to its domain; recovery is the difference);
* lever 4, a quantized KV cache (``kvjax.cache.quant``): each of ``--kv_dtypes`` as the
  cache element type of the original GQA model and of the best-scoring window-with-sinks
  row, and each of ``--mla_kv_dtypes`` on the best-scoring MLA conversion (rows named
  e.g. "GQA K=3 (original) int8", lever 'quantized', column ``ppl_vs_float32`` against
  the same variant with a float32 cache). Their KV bytes include the float32 scales.

* lever 5, fewer tokens by score (``kvjax.compression``): each method of
  ``--kv_compression`` at each budget of ``--kv_budgets`` on the original GQA model (lever
  'compression'; long-context columns only: perplexity over chunked windows is not
  defined for a cache compressed after its prompt).

Every row also gets its long-context accuracy (RULER's string match, Wilson 95% interval)
and answer NLL (nats per token) on ``--longctx_tasks`` x ``--longctx_lengths`` x
``--longctx_depths`` x ``--longctx_samples``, through longeval's protocol and per-sample
loop (``kvjax.training.longgrid.run_samples`` over
``kvjax.training.longcontext.evaluate_sample``: prefill the context, apply the lever,
ask), so a row's numbers are ``experiments.longeval``'s for the same config and samples;
and its KV bytes per sequence at the longest of those lengths (``longctx_kv_bytes``,
theory; ``longctx_kv_bytes_allocated``, the prefilled cache). The checkpoint's trained
context (SmolLM2: 8,192 positions) is printed and stored (``trained_context``); lengths
past it are refused unless ``--allow_beyond_context``, and such rows are marked
``beyond_trained_context``. ``--longctx_tasks=`` (empty) turns the columns off.

Defaults (stated in README "Ablations"): context 512, 16,352 scored tokens (32 windows),
windows {64, 128, 256, 512, 1024} x sinks {0, 4}, MLA ranks {64, 128, 320}, uptraining
50 steps of 4 x 128 tokens, kv_dtypes {bfloat16, float16, float8_e4m3fn, float8_e5m2,
int8, int4} (MLA: {int8, float8_e4m3fn}), every compression method at budget 256;
long-context columns on passkey and niah_single at L = 1,024, depth 0.5, one sample each
(two samples a row: about 10 s a row on 2 cores). A window with W >= context never masks a key, so it computes
the full-attention function: its perplexity is the GQA row's (marked ``same_as``), its
cache bytes are measured on an allocated cache.

Writes to ``--out_dir`` (default results/ablate/): ablate.csv, ablate.json (rows and run
settings), pareto.png (perplexity vs KV bytes per sequence at the context, Pareto front
drawn; beside it, long-context accuracy vs KV bytes per sequence at the eval length),
longctx_samples.jsonl (the long-context samples, one line each: the resume log),
uptrain_loss.png, and orbax checkpoints of the uptraining runs under uptrain/.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from experiments import cli

from kvjax import cache as cache_lib
from kvjax import compression as compression_lib
from kvjax.analysis import theory
from kvjax.inference import runner
from kvjax.models import convert, model
from kvjax.training import data, evaluate, longgrid
from kvjax.training import longcontext as lc
from kvjax.training import train as train_lib
from kvjax.checkpoints import WeightsError
from kvjax.config import KV_DTYPES, ConfigError, run_config_from_dict

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("The base model (GQA SmolLM2)."), lock_config=True)
_EVAL = cli.DEFINE_config_dict("eval", evaluate.eval_config_dict(), cli.EVAL_HELP,
                               lock_config=True)
_TRAIN = cli.DEFINE_config_dict("train", train_lib.train_config_dict(), cli.TRAIN_HELP,
                                lock_config=True)
_OUT = flags.DEFINE_string("out_dir", "results/ablate", "Output folder.")
_KV = flags.DEFINE_list("kv_heads", ["9", "3", "1"], "KV-head variants.")
_WINDOWS = flags.DEFINE_list("windows", ["64", "128", "256", "512", "1024"], "Windows W.")
_SINKS = flags.DEFINE_integer("sinks", 4, "Attention sinks of the '+sinks' window rows.")
_LAYER_WINDOWS = flags.DEFINE_multi_string(
    "layer_windows", ["128,128,128,128,128,global"],
    "Per-layer window patterns (model.layer_windows, repeated over the layers; Gemma 3's "
    "5:1 by default), one row each; repeat the flag for more.")
_MLA = flags.DEFINE_list("mla_ranks", ["64", "128", "320"], "MLA latent ranks C.")
_UPTRAIN = flags.DEFINE_list("uptrain_kv_heads", ["1", "3"],
                             "KV-head variants to uptrain (3 = the control).")
_KV_DTYPES = flags.DEFINE_list(
    "kv_dtypes", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8", "int4"],
    "Cache element types (model.kv_dtype) scored on the original GQA model and on the "
    "best window-with-sinks row; empty: none.")
_MLA_KV_DTYPES = flags.DEFINE_list(
    "mla_kv_dtypes", ["int8", "float8_e4m3fn"],
    "Cache element types scored on the best MLA conversion; empty: none.")
_COMPRESSION = flags.DEFINE_list(
    "kv_compression", list(filter(compression_lib.evicts, compression_lib.names())),
    "Lever 5 methods (model.kv_compression) scored on the original GQA model at each "
    f"--kv_budgets value (long-context columns only), any of: "
    f"{', '.join(filter(compression_lib.evicts, compression_lib.names()))}; empty: none "
    "(quest selects pages of a paged cache, which the long-context harness does not run).")
_BUDGETS = flags.DEFINE_list("kv_budgets", ["256"],
                             "Budgets (model.kv_budget: prompt slots kept per KV head).")
_LC_TASKS = flags.DEFINE_list(
    "longctx_tasks", ["passkey", "niah_single"],
    f"Long-context tasks scored on every row, any of: {', '.join(lc.TASKS)}; empty: no "
    "long-context columns.")
_LC_LENGTHS = flags.DEFINE_list("longctx_lengths", ["1024"],
                                "Long-context sequence lengths L in tokens.")
_LC_DEPTHS = flags.DEFINE_list("longctx_depths", ["0.5"], "Needle depths in [0, 1].")
_LC_SAMPLES = flags.DEFINE_integer("longctx_samples", 1,
                                   "Samples per task x length x depth.")
_LC_SEED = flags.DEFINE_integer("longctx_seed", 0, "Seed of the long-context samples.")
_LC_PROTOCOL = flags.DEFINE_enum(
    "longctx_protocol", "context", list(lc.PROTOCOLS),
    "When a compressed cache sees the question (experiments.longeval's --protocol).")
_BEYOND = flags.DEFINE_bool(
    "allow_beyond_context", False,
    "Allow --longctx_lengths past the checkpoint's trained context (rows marked "
    "beyond_trained_context).")
_CALIB = flags.DEFINE_integer("calib_tokens", 1024, "Training tokens for MLA calibration.")
_RESUME = flags.DEFINE_bool("resume", False, "Reuse rows already in out_dir/ablate.json.")
_PLOT_ONLY = flags.DEFINE_bool("plot_only", False,
                               "Only redraw pareto.png and print the table from ablate.json.")

FIELDS = ["name", "lever", "kv_heads", "window", "layer_windows", "sinks", "mla_rank",
          "kv_dtype",
          "uptrain_steps", "kv_bytes_per_token", "kv_scale_bytes_per_token", "tokens_held", "kv_bytes_theory", "kv_bytes_measured",
          "cache_slots", "ppl", "bits_per_byte", "ppl_vs_gqa", "tokens_scored",
          "ppl_vs_float32", "check_rel_diff", "same_as", "seconds", "kv_compression",
          "kv_budget", "longctx_length", "longctx_kv_bytes", "longctx_kv_bytes_allocated",
          "longctx_accuracy", "longctx_accuracy_low", "longctx_accuracy_high",
          "longctx_answer_nll", "longctx_samples", "beyond_trained_context",
          "longctx_seconds"]
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


def kv_label(k: int, n: int) -> str:
    return "MHA" if k == n else ("MQA" if k == 1 else "GQA")


def check_kv_dtypes(names: list, flag: str) -> list:
    """``names`` if each is a cache element type (``config.KV_DTYPES``); else ValueError
    naming the flag, the bad value and what is allowed."""
    for n in names:
        if n not in KV_DTYPES:
            raise ValueError(f"--{flag}: unknown kv_dtype {n!r}; allowed: {list(KV_DTYPES)}")
    return list(names)


@dataclasses.dataclass(frozen=True)
class LongGrid:
    """The long-context grid every row is scored on (``--longctx_*``), with the
    checkpoint's trained context (positions; None: unknown) and whether lengths past it
    were allowed."""

    tasks: tuple
    lengths: tuple
    depths: tuple
    samples: int
    seed: int = 0
    protocol: str = "context"
    trained_context: int | None = None
    allow_beyond_context: bool = False

    @property
    def length(self) -> int:
        """The length the KV bytes are stated at: the longest."""
        return max(self.lengths)


def longctx_grid(tasks, lengths, depths, samples: int, seed: int, protocol: str,
                 context: int | None, beyond: bool) -> LongGrid | None:
    """The checked grid from the flags' values (strings or numbers); None for no tasks.

    Raises:
      lc.TaskError: an unknown task, a bad length or depth, zero samples, or a length past
        the trained ``context`` without ``beyond`` (``longgrid.check_lengths``).
    """
    if not tasks:
        return None
    tasks, lengths, depths, samples = longgrid.parse_grid(
        list(tasks), [str(n) for n in lengths], [str(d) for d in depths], samples)
    try:
        longgrid.check_lengths(lengths, None, context, beyond)
    except lc.TaskError as e:
        raise lc.TaskError(str(e).replace("--allow_beyond_context (cells marked "
                                          "beyond_context)", "--allow_beyond_context (rows "
                                          "marked beyond_trained_context)")) from None
    return LongGrid(tuple(tasks), tuple(lengths), tuple(depths), samples, seed, protocol,
                    context, beyond)


def longctx_columns(params, cfg, tokenizer, grid: LongGrid, log_path: pathlib.Path,
                    key: str, progress: bool = True) -> dict:
    """A row's long-context columns: ``experiments.longeval``'s per-sample loop
    (``longgrid.run_samples``, resumable from ``log_path``) and summary
    (``longgrid.summarize``) of ``cfg`` on ``grid``.

    Args:
      params: parameters in cfg's layout (unresolved cfg: each length resolves its plan).
      key: the row's key in the log (its name and ``longgrid.run_key``).
    Returns:
      longctx_accuracy (mean over tasks of the mean RULER score) with longctx_accuracy_ci
      (Wilson 95% over every sample; the tasks have equal samples, so it brackets the
      mean), longctx_answer_nll (nats per token, mean over tasks), longctx_kv_bytes (theory,
      bytes per sequence at ``grid.length``) and longctx_kv_bytes_allocated (the prefilled
      cache), longctx_length, longctx_samples, longctx_tasks (per task: accuracy, its
      interval, answer NLL), beyond_trained_context, longctx_seconds (the samples' summed
      prefill and question time).
    """
    records = longgrid.run_samples(params, cfg, tokenizer, grid.tasks, grid.lengths,
                                   grid.depths, grid.samples, grid.seed, False, log_path,
                                   key, progress=progress, protocol=grid.protocol)
    s = longgrid.summarize(records, grid.tasks, grid.lengths, grid.depths,
                           grid.trained_context)
    at = s["lengths"][str(grid.length)]
    return dict(
        longctx_accuracy=s["mean_accuracy"], longctx_accuracy_ci=s["mean_accuracy_ci"],
        longctx_answer_nll=s["mean_answer_nll"], longctx_kv_bytes=at["kv_bytes_theory"],
        longctx_kv_bytes_allocated=at["kv_bytes_allocated"], longctx_length=grid.length,
        longctx_samples=len(records),
        longctx_tasks={t: dict(accuracy=v["accuracy"], accuracy_ci=v["accuracy_ci"],
                               answer_nll=v["answer_nll"]) for t, v in s["tasks"].items()},
        beyond_trained_context=bool(grid.trained_context
                                    and grid.length > grid.trained_context),
        longctx_seconds=round(sum(r["prefill_seconds"] + r["decode_seconds"]
                                  for r in records), 1))


def row_for(name, lever, cfg, ctx, res=None, **extra) -> dict:
    """A result row: the theory columns from cfg, the measured ones from ``res``."""
    row = dict(
        name=name, lever=lever, kv_heads=None if cfg.is_mla else cfg.num_kv_heads,
        window=cfg.window_size, sinks=cfg.num_sink_tokens,
        layer_windows=None if cfg.layer_windows is None else ",".join(
            "global" if w is None else str(w) for w in cfg.layer_windows),
        mla_rank=cfg.kv_lora_rank, kv_dtype=cfg.kv_dtype or cfg.dtype, uptrain_steps=0,
        kv_bytes_per_token=theory.kv_bytes_per_token(cfg),
        kv_scale_bytes_per_token=theory.kv_scale_bytes_per_token(cfg),
        tokens_held=theory.tokens_held(cfg, ctx),
        kv_bytes_theory=theory.kv_cache_bytes(cfg, ctx), same_as=None)
    if res is not None:
        row.update(kv_bytes_measured=res.cache_bytes // res.batch_size,
                   cache_slots=res.cache_slots, ppl=res.ppl, bits_per_byte=res.bits_per_byte,
                   tokens_scored=res.num_predicted, check_rel_diff=res.check_rel_diff,
                   seconds=round(res.seconds, 1))
    row.update(extra)
    return row


def pareto_front(rows: list) -> list:
    """Names of rows no other row beats on both KV bytes (theory) and perplexity (rows that
    merely repeat another's function, ``same_as``, are left out)."""
    rows = [r for r in rows if r.get("ppl") is not None and not r.get("same_as")]
    front = []
    for r in rows:
        if not any(o["kv_bytes_theory"] <= r["kv_bytes_theory"] and o["ppl"] <= r["ppl"]
                   and (o["kv_bytes_theory"], o["ppl"]) != (r["kv_bytes_theory"], r["ppl"])
                   for o in rows):
            front.append(r["name"])
    return front


STYLE = {"kv heads": ("o", "C0"), "window": ("s", "C1"), "window+sinks": ("^", "C2"),
         "mla": ("D", "C3"), "uptrained": ("*", "C4"), "quantized": ("P", "C5"),
         "layer windows": ("X", "C6"), "compression": ("v", "C7")}


def plot_pareto(rows: list, path: pathlib.Path, ctx: int, title: str) -> None:
    """Perplexity against KV bytes per sequence at ``ctx`` (the rows with a perplexity)
    and, beside it where any row has them, long-context accuracy (Wilson 95% bars)
    against KV bytes per sequence at the long-context length."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    style = STYLE
    acc_rows = [r for r in rows if r.get("longctx_accuracy") is not None]
    rows = [r for r in rows if r.get("ppl") is not None]
    if acc_rows:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(17, 6))
    else:
        fig, ax = plt.subplots(figsize=(9, 6))
    for lever, (marker, color) in style.items():
        rs = [r for r in rows if r["lever"] == lever]
        if rs:
            ax.scatter([r["kv_bytes_theory"] / 2**20 for r in rs], [r["ppl"] for r in rs],
                       marker=marker, color=color, s=120 if marker == "*" else 50,
                       label=lever, zorder=3)
    texts = [ax.text(r["kv_bytes_theory"] / 2**20, r["ppl"], r["name"], fontsize=7)
             for r in rows if not r.get("same_as")]  # windows >= context: the full point
    by_name = {r["name"]: r for r in rows}
    for r in rows:  # uptraining arrows: before -> after
        src = by_name.get(r.get("uptrained_from"))
        if src is not None:
            ax.annotate("", (r["kv_bytes_theory"] / 2**20, r["ppl"]),
                        (src["kv_bytes_theory"] / 2**20, src["ppl"]),
                        arrowprops=dict(arrowstyle="->", color="C4", alpha=0.6))
    front = sorted((by_name[n] for n in pareto_front(rows)), key=lambda r: r["kv_bytes_theory"])
    ax.step([r["kv_bytes_theory"] / 2**20 for r in front], [r["ppl"] for r in front],
            where="post", color="k", alpha=0.4, lw=1, label="Pareto front")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel(f"KV cache per sequence at context {ctx} (MiB: KV bytes per token incl. "
                  "quantization scales x tokens held; theory = measured except W > context)")
    ax.set_ylabel("perplexity on held-out Django docs")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    handles = ax.get_legend_handles_labels()[0]
    if any(r.get("uptrained_from") for r in rows):
        from matplotlib.lines import Line2D  # noqa: PLC0415
        handles.append(Line2D([], [], color="C4", alpha=0.6, marker=">", ms=5,
                              label="uptraining: before -> after"))
    if acc_rows:
        plot_accuracy(ax2, acc_rows)
        seen = {h.get_label() for h in handles}  # levers with no perplexity (lever 5)
        handles += [h for h in ax2.get_legend_handles_labels()[0] if h.get_label() not in seen]
    (ax2 if acc_rows else ax).legend(handles=handles, fontsize=8, loc="upper left",
                                     bbox_to_anchor=(1.01, 1.0), frameon=False)
    # points of equal KV bytes and close perplexity (a window and its sinks variant, a
    # quantized cache) stacked their names on each other: adjustText moves the labels
    # apart, with a thin line back to their point where moved
    from adjustText import adjust_text  # noqa: PLC0415
    adjust_text(texts, ax=ax, arrowprops=dict(arrowstyle="-", color="0.5", lw=0.5))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_accuracy(ax, rows: list) -> None:
    """Long-context accuracy (Wilson 95% bars) against ``longctx_kv_bytes`` on ``ax``,
    one point per row, marked by lever as in :func:`plot_pareto`."""
    from adjustText import adjust_text  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    for lever, (marker, color) in STYLE.items():
        rs = [r for r in rows if r["lever"] == lever]
        if rs:
            acc = np.array([r["longctx_accuracy"] for r in rs])
            ci = np.array([r["longctx_accuracy_ci"] for r in rs])
            ax.errorbar([r["longctx_kv_bytes"] / 2**20 for r in rs], acc,
                        yerr=[acc - ci[:, 0], ci[:, 1] - acc], fmt=marker, color=color,
                        ms=11 if marker == "*" else 7, capsize=3, alpha=0.85, zorder=3,
                        label=lever)
    texts = [ax.text(r["longctx_kv_bytes"] / 2**20, r["longctx_accuracy"],
                     r["name"] + (" (beyond)" if r.get("beyond_trained_context") else ""),
                     fontsize=7) for r in rows]
    lengths = sorted({r["longctx_length"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel(f"KV cache per sequence at L = {', '.join(f'{n:,}' for n in lengths)} "
                  "(MiB, theory)")
    ax.set_ylabel(f"long-context accuracy over {rows[0]['longctx_samples']} samples "
                  "(Wilson 95%)")
    tasks = ", ".join(rows[0].get("longctx_tasks") or {})
    ax.set_title(f"long-context accuracy ({tasks})")
    ax.grid(alpha=0.3, which="both")
    adjust_text(texts, ax=ax, arrowprops=dict(arrowstyle="-", color="0.5", lw=0.5))


def write_outputs(out: pathlib.Path, rows: list, settings: dict) -> None:
    base = next((r for r in rows if r["name"].startswith("GQA K=3") and r["lever"] == "kv heads"),
                None)
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if base is not None and r.get("ppl") is not None:
            r["ppl_vs_gqa"] = r["ppl"] / base["ppl"]
        src = by_name.get(r.get("quantized_from"))
        if src is not None and r.get("ppl") is not None:
            r["ppl_vs_float32"] = r["ppl"] / src["ppl"]
    with open(out / "ablate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            lo, hi = r.get("longctx_accuracy_ci") or (None, None)
            w.writerow(dict(r, longctx_accuracy_low=lo, longctx_accuracy_high=hi))
    with open(out / "ablate.json", "w") as f:
        json.dump({"settings": settings, "rows": rows, "uptrain_gap": uptrain_summary(rows),
                   "pareto_front": pareto_front([r for r in rows if r.get("ppl")])}, f, indent=2)


def markdown_table(rows: list) -> str:
    """The rows as a markdown table; the long-context columns (accuracy with its Wilson
    95% interval, answer NLL, KV bytes per sequence at the eval length L) where any row
    has them. A row without perplexity (a compressed cache) shows '-' there."""
    longctx = any(r.get("longctx_accuracy") is not None for r in rows)
    lines = ["| variant | KV B/token (scales) | tokens held | KV bytes/seq (theory) | measured | "
             "ppl | bits/byte | ppl / GQA | ppl / float32 cache |"
             + (" L | KV bytes/seq at L | long-context accuracy [95% CI] | answer NLL |"
                if longctx else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|:---:|---:|"
                                                              if longctx else "")]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        note = f" (= {r['same_as']})" if r.get("same_as") else ""
        scales = r.get("kv_scale_bytes_per_token") or 0
        vs32 = f"{r['ppl_vs_float32']:.4f}" if r.get("ppl_vs_float32") else ""
        line = (
            f"| {r['name']} | {r['kv_bytes_per_token']:,}"
            f"{f' ({scales:,})' if scales else ''} | {r['tokens_held']} | "
            f"{r['kv_bytes_theory']:,} | {fmt(r.get('kv_bytes_measured'), ',')} | "
            f"{fmt(r.get('ppl'), '.4f')}{note} | {fmt(r.get('bits_per_byte'), '.4f')} | "
            f"{fmt(r.get('ppl_vs_gqa'), '.3f')} | {vs32} |")
        if longctx:
            if r.get("longctx_accuracy") is None:
                line += " | | | |"
            else:
                lo, hi = r["longctx_accuracy_ci"]
                mark = " (beyond trained context)" if r.get("beyond_trained_context") else ""
                line += (f" {r['longctx_length']:,}{mark} | {r['longctx_kv_bytes']:,} | "
                         f"{r['longctx_accuracy']:.3f} [{lo:.2f}, {hi:.2f}] | "
                         f"{r['longctx_answer_nll']:.3f} |")
        lines.append(line)
    return "\n".join(lines)


def uptrain_summary(rows: list) -> dict | None:
    """The K=1 vs K=3 loss gap (nats/token) before and after equal uptraining, or None."""
    def find(k, lever):
        return next((r for r in rows if r.get("kv_heads") == k and r["lever"] == lever), None)
    a, b, ua, ub = find(1, "kv heads"), find(3, "kv heads"), find(1, "uptrained"), \
        find(3, "uptrained")
    if not (a and b and ua and ub):
        return None
    before = math.log(a["ppl"]) - math.log(b["ppl"])
    after = math.log(ua["ppl"]) - math.log(ub["ppl"])
    return {"gap_before": before, "gap_after": after, "recovered": 1 - after / before}


def finish(out: pathlib.Path, rows: list, settings: dict, histories: dict) -> None:
    """Writes the CSV/JSON and the Pareto plot, prints the table."""
    write_outputs(out, rows, settings)
    plot_pareto(rows, out / "pareto.png", settings["context"],
                f"SmolLM2-135M: perplexity vs KV cache, context {settings['context']}, "
                f"{settings['tokens_scored']:,} held-out tokens")
    print()
    print(markdown_table(rows))
    print(f"\nPareto front: {', '.join(pareto_front(rows))}")
    gap = uptrain_summary(rows)
    if gap:
        print(f"one-KV-head gap in nats/token (K=1 minus K=3): {gap['gap_before']:.3f} "
              f"converted, {gap['gap_after']:.3f} after uptraining both the same way: "
              f"{100 * gap['recovered']:.1f}% of the gap recovered")
    print(f"wrote {out / 'ablate.csv'}, {out / 'ablate.json'}, {out / 'pareto.png'}"
          + (f", {out / 'uptrain_loss.png'}" if histories else ""))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
    out = pathlib.Path(_OUT.value)
    if _PLOT_ONLY.value:
        saved = json.loads((out / "ablate.json").read_text())
        finish(out, saved["rows"], saved["settings"], {})
        return 0
    try:
        run = run_config_from_dict(_CONFIG.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value)
        tcfg = train_lib.train_config_from_dict(_TRAIN.value)
        if ecfg.split != "heldout":
            raise ValueError(f"invalid config: eval.split={ecfg.split!r}; allowed: 'heldout' "
                             "(this entry point trains on the rest of the corpus)")
        kv_heads = [int(k) for k in _KV.value]
        windows = [int(w) for w in _WINDOWS.value]
        layer_cfgs = [run.model.replace(layer_windows=p, window_size=None, scan_layers=False,
                                        name=f"layers {p}") for p in _LAYER_WINDOWS.value]
        ranks = [int(c) for c in _MLA.value]
        uptrain = [int(k) for k in _UPTRAIN.value]
        kv_dtypes = check_kv_dtypes(_KV_DTYPES.value, "kv_dtypes")
        mla_kv_dtypes = check_kv_dtypes(_MLA_KV_DTYPES.value, "mla_kv_dtypes")
        context = longgrid.trained_context(run)
        grid = longctx_grid(_LC_TASKS.value, _LC_LENGTHS.value, _LC_DEPTHS.value,
                            _LC_SAMPLES.value, _LC_SEED.value, _LC_PROTOCOL.value, context,
                            _BEYOND.value)
        try:
            budgets = [int(b) for b in _BUDGETS.value]
        except ValueError:
            raise ValueError(f"--kv_budgets={','.join(_BUDGETS.value)}; allowed: positive "
                             "integers (slots)") from None
        comp_cfgs = [run.model.replace(kv_compression=m, kv_budget=b,
                                       name=f"{m} budget={b}")
                     for m in _COMPRESSION.value for b in budgets]  # validated here
        if comp_cfgs and grid is None and not flags.FLAGS["kv_compression"].present:
            comp_cfgs = []  # the default methods need the long-context grid: left out
        if comp_cfgs and grid is None:
            raise ValueError(f"--kv_compression={','.join(_COMPRESSION.value)} with "
                             "--longctx_tasks empty; allowed: --kv_compression= (empty), or "
                             "long-context tasks (a compressed cache has no perplexity over "
                             "chunked windows; its rows are scored on the long-context grid)")
        loaded = runner.load(run)
        if grid is not None:  # every task fits every length: fails here, not mid-run
            if loaded.context_length and context and loaded.context_length != context:
                raise ValueError(f"the checkpoint states a context of "
                                 f"{loaded.context_length}, not {context}")
            for t in grid.tasks:
                for n in grid.lengths:
                    lc.generate_sample(t, loaded.tokenizer, n, grid.depths[0], grid.seed, 0)
        corpus = data.tokenized_corpus(loaded.tokenizer, _EVAL.value.corpus,
                                       _EVAL.value.heldout_fraction, run.cache_dir,
                                       train=bool(uptrain or ranks))
        eval_w = data.eval_windows(corpus.heldout, ecfg.context, ecfg.num_tokens)
    except (ConfigError, WeightsError, data.CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    ctx = ecfg.context
    base_cfg = loaded.cfg
    base = jax.tree.map(np.asarray, model.stack_layers(loaded.params, base_cfg.num_layers))
    n = base_cfg.num_heads
    settings = dict(model=base_cfg.name, dtype=base_cfg.dtype, corpus=corpus.source,
                    heldout_docs=len(corpus.heldout_docs), heldout_tokens=int(corpus.heldout.size),
                    context=ctx, windows_scored=int(eval_w.shape[0]),
                    tokens_scored=int(eval_w.shape[0] * (ctx - 1)), eval=vars(ecfg).copy(),
                    train=vars(tcfg).copy(), backend=jax.default_backend(),
                    trained_context=context,
                    longctx=None if grid is None else dataclasses.asdict(grid))
    print(f"corpus {corpus.source}: {len(corpus.train_docs)} training / "
          f"{len(corpus.heldout_docs)} held-out documents; scoring "
          f"{settings['tokens_scored']:,} tokens in {eval_w.shape[0]} windows of {ctx}")
    print(f"trained context of the checkpoint: "
          f"{f'{context:,} positions' if context else 'unknown (random weights)'}")
    log_path = out / "longctx_samples.jsonl"
    if grid is not None:
        print(f"long-context columns: {', '.join(grid.tasks)} at L = "
              f"{', '.join(f'{n:,}' for n in grid.lengths)}, depths "
              f"{', '.join(f'{d:g}' for d in grid.depths)}, {grid.samples} sample(s) each"
              + (" (past the trained context: rows marked beyond_trained_context)"
                 if context and grid.length > context else ""))
        if not _RESUME.value and log_path.exists():
            log_path.unlink()  # samples of another run's weights (MLA calibration, ...)

    done = {}
    if _RESUME.value and (out / "ablate.json").is_file():
        done = {r["name"]: r for r in json.loads((out / "ablate.json").read_text())["rows"]}
    rows = []

    def params_in(cfg, stacked):
        return jax.tree.map(lambda x: jnp.asarray(x, cfg.jnp_dtype),
                            model.params_for(cfg, stacked))

    sources = {}  # row name -> (cfg, stacked_fn): what a quantized row re-scores

    def add_longctx(row, cfg, params):
        """The row's long-context columns (the samples already in the log are reused)."""
        if grid is None:
            return row
        key = f"{row['name']} | {longgrid.run_key(cfg)}" + (
            "" if grid.protocol == "context" else f" protocol={grid.protocol}")
        row.update(longctx_columns(params, cfg, loaded.tokenizer, grid, log_path, key))
        lo, hi = row["longctx_accuracy_ci"]
        print(f"{row['name']}: long-context accuracy {row['longctx_accuracy']:.3f} "
              f"[{lo:.2f}, {hi:.2f}]  answer NLL {row['longctx_answer_nll']:.3f}  KV "
              f"{row['longctx_kv_bytes']:,} B/seq at L={grid.length:,}"
              + ("  (beyond the trained context)" if row["beyond_trained_context"] else ""),
              flush=True)
        return row

    def score(name, lever, cfg, stacked_fn, ppl=True, **extra):
        """Scores a row (perplexity unless ``ppl`` is False, long-context columns) or
        reuses it from ``done``."""
        sources[name] = (cfg, stacked_fn)
        if name in done:
            row = dict(done[name])
            print(f"{name}: reused from {out / 'ablate.json'}")
            if grid is not None:
                add_longctx(row, cfg, params_in(cfg, stacked_fn()))
            rows.append(row)
            write_outputs(out, rows, settings)
            return row
        params = params_in(cfg, stacked_fn())
        if ppl:
            res = evaluate.perplexity(params, cfg, eval_w, ecfg, corpus.byte_lengths,
                                      separator_id=corpus.separator_id)
            row = row_for(name, lever, cfg, ctx, res, **extra)
            print(f"{name}: ppl {res.ppl:.3f}  bits/byte {res.bits_per_byte:.4f}  KV "
                  f"{row['kv_bytes_measured']:,} B/seq  check "
                  f"{'-' if res.check_rel_diff is None else f'{res.check_rel_diff:.1e}'}  "
                  f"({res.seconds:.0f} s)", flush=True)
        else:
            row = row_for(name, lever, cfg, ctx, **extra)
        add_longctx(row, cfg, params)
        rows.append(row)
        write_outputs(out, rows, settings)
        return row

    def kv_cfg(k):
        return base_cfg.replace(num_kv_heads=k, attention="gqa" if 1 < k < n else
                                ("mha" if k == n else "mqa"),
                                name=f"{kv_label(k, n)} K={k}")

    # Lever 1: KV heads.
    for k in kv_heads:
        how = {3: "original"}.get(k, "duplicated" if k > 3 else "mean-pooled")
        score(f"{kv_label(k, n)} K={k} ({how})", "kv heads", kv_cfg(k),
              lambda k=k: convert.convert_kv_heads(base, k))
    gqa_row = next((r for r in rows if r["kv_heads"] == base_cfg.num_kv_heads), None)

    # Lever 3: windows (a config change; the same weights).
    for sinks in (0, _SINKS.value):
        for w in windows:
            cfg = base_cfg.replace(window_size=w, num_sink_tokens=sinks,
                                   name=f"W={w}" + (f"+{sinks} sinks" if sinks else ""))
            lever = "window+sinks" if sinks else "window"
            if w >= ctx and gqa_row is not None:
                # Never masks a key at this context: the full-attention function.
                c = cache_lib.init_cache(cfg, 1, ctx)
                row = row_for(cfg.name, lever, cfg, ctx, kv_bytes_measured=cache_lib.cache_bytes(c),
                              cache_slots=c.num_slots, ppl=gqa_row["ppl"],
                              bits_per_byte=gqa_row["bits_per_byte"],
                              tokens_scored=gqa_row["tokens_scored"], check_rel_diff=None,
                              same_as=gqa_row["name"], seconds=0)
                add_longctx(row, cfg, params_in(cfg, base))  # the window may evict there
                rows.append(row)
                write_outputs(out, rows, settings)
                print(f"{cfg.name}: W >= context {ctx}: same function as {gqa_row['name']}")
                continue
            score(cfg.name, lever, cfg, lambda: base)

    # Lever 3 per layer: local rings and global layers (model.layer_windows).
    for lw in layer_cfgs:  # validated before the load; on the loaded config here
        cfg = base_cfg.replace(layer_windows=lw.layer_windows, window_size=None,
                               num_sink_tokens=0, scan_layers=False, name=lw.name)
        score(cfg.name, "layer windows", cfg, lambda: base)

    # Lever 2: MLA by low-rank factorisation, calibrated on training text.
    if ranks:
        calib = data.batch_at(corpus.train, 0, max(1, _CALIB.value // 256), 255, seed=1234)
        x = convert.attention_inputs(loaded.params, base_cfg, calib)
        for c in ranks:
            mcfg, mparams = convert.gqa_to_mla(base, base_cfg, c, x)
            mcfg = mcfg.replace(name=f"MLA C={c}")
            score(mcfg.name, "mla", mcfg, lambda mparams=mparams: mparams)

    # Lever 5: fewer tokens by score, on the original GQA model (long-context columns
    # only: the compression runs after a prompt's prefill, which perplexity never ends).
    for cc in comp_cfgs:  # validated before the load; on the loaded config here
        cfg = base_cfg.replace(kv_compression=cc.kv_compression, kv_budget=cc.kv_budget,
                               compression=cc.compression, name=cc.name)
        score(cfg.name, "compression", cfg, lambda: base, ppl=False,
              kv_compression=cc.kv_compression, kv_budget=cc.kv_budget)

    # Lever 4: the cache's element type on the original GQA model, the best window with
    # sinks and the best MLA conversion (the same weights; only the cache changes).
    def best(lever):
        rs = [r for r in rows if r["lever"] == lever and r.get("ppl") is not None
              and not r.get("same_as") and r["name"] in sources]
        return min(rs, key=lambda r: r["ppl"]) if rs else None

    for src, names in ((gqa_row, kv_dtypes), (best("window+sinks"), kv_dtypes),
                       (best("mla"), mla_kv_dtypes)):
        if src is None:
            continue
        cfg, stacked_fn = sources[src["name"]]
        for kd in names:
            if kd == (cfg.kv_dtype or cfg.dtype):
                continue  # the source row itself
            qcfg = cfg.replace(kv_dtype=kd, name=f"{src['name']} {kd}")
            score(qcfg.name, "quantized", qcfg, stacked_fn, quantized_from=src["name"])

    # Uptraining: the converted K = 1 model, and the original K = 3 as a control.
    histories = {}
    for k in uptrain:
        cfg = kv_cfg(k)
        name = f"{kv_label(k, n)} K={k} + uptrain {tcfg.steps} steps"
        src = next((r["name"] for r in rows if r["kv_heads"] == k and r["lever"] == "kv heads"),
                   None)
        workdir = out / "uptrain" / f"k{k}"
        if name in done:
            rows.append(done[name])
            hist = workdir / "history.json"
            if hist.is_file():
                histories[name] = json.loads(hist.read_text())
            continue
        print(f"uptraining {cfg.name}: {tcfg.steps} steps of {tcfg.batch_size}x{tcfg.seq_len} "
              f"tokens, checkpoints in {workdir}", flush=True)
        start = params_in(cfg, convert.convert_kv_heads(base, k))
        result = train_lib.train(start, cfg, tcfg, corpus.train, workdir=workdir)
        histories[name] = result.history
        trained = train_lib.to_layout(result.params, cfg)
        score(name, "uptrained", cfg, lambda trained=trained: trained,
              uptrain_steps=tcfg.steps, uptrained_from=src,
              train_loss_first=result.history[0]["loss"] if result.history else None,
              train_loss_last=result.history[-1]["loss"] if result.history else None,
              train_seconds=round(result.seconds, 1))
        del start, trained, result
    if histories:
        train_lib.plot_history(histories, out / "uptrain_loss.png",
                               title=f"uptraining on {corpus.source} (train split)")

    finish(out, rows, settings, histories)
    return 0


if __name__ == "__main__":
    cli.run(main)
