r"""Long-context accuracy and answer NLL of a model config: passkey, RULER's needles,
variable tracking, word extraction, key-value retrieval and copying, generated offline
(``kvjax.training.longcontext``).

    python -m experiments.longeval --config=configs/gqa.py     # the default run (<= 30 min, 2 cores)
    python -m experiments.longeval --config=configs/gqa.py --tasks=passkey,niah_single \
        --lengths=1024,2048,4096,8192 --depths=0,0.25,0.5,0.75,1 --samples=4
    python -m experiments.longeval --config=configs/gqa.py --config.model.window_size=512 \
        --config.model.num_sink_tokens=4 --tasks=niah_single --lengths=4096 --ppl \
        --eval.context=4096 --eval.num_tokens=8192 --out_dir=results/longeval/w512
    python -m experiments.longeval --config=configs/gqa.py --config.model.kv_dtype=int8
    python -m experiments.longeval --config=configs/gqa.py --config.model.kv_compression=snapkv \
        --config.model.kv_budget=512 --tasks=niah_single --lengths=4096 --protocol=question
    python -m experiments.longeval --config=configs/gqa.py --tasks=passkey,niah_single \
        --lengths=4096 --sweep=none,streaming_llm,snapkv --sweep_budgets=256,512 \
        --sweep_protocols=context,question --ppl --out_dir=results/longeval/sweep
    python -m experiments.longeval --compare=results/longeval/full/longeval.json,results/longeval/w512/longeval.json
    python -m experiments.longeval --full_grid             # 1K-8K x depths 0-1 by 0.1 x 10 samples

Every sample of length L has a context of exactly L - 192 tokens (the question, up to
128 tokens, and the answer, up to 64, fit in L: RULER counts its lengths so), prefilled
once into the config's KV cache; the lever is the config (``--config.model.window_size``, ``num_sink_tokens``,
``kv_dtype``, ``num_kv_heads``, ...); the question is then asked on that cache (with
``--query_first`` it also comes before the context). Two scores per sample: RULER's
string match of the greedy answer (accuracy, Wilson 95% interval) and the reference
answer's negative log-likelihood in nats per token (t interval).

Perplexity (``--ppl``) of a lever that acts on the cache (``--sweep``,
``--config.model.kv_compression``, or any config with ``--ppl_tokens`` given): for
``--ppl_texts`` texts of the longest length L (the --eval corpus's first windows of L
tokens), the first L - M tokens are prefilled into the config's cache (and compressed by
its method and budget, ``kvjax.cache.compress.compress_prompt``), then the last M =
``--ppl_tokens`` (default 256) are teacher-forced on that cache, its recent ring
included (``lc.tail_nll``); a sweep scores every point on one prefill per text
(``lc.sweep_tail_nll``, log ppl.jsonl) and each run gets a ``ppl`` entry. Otherwise
``--ppl`` scores experiments.ppl's windows on the uncompressed cache.

Writes to ``--out_dir`` (default results/longeval/): samples.jsonl (one line per sample,
the resume log: a rerun skips the samples already there for the same config), longeval.json
(per task and per task x length x depth: accuracy, answer NLL, KV bytes in theory and
allocated, prefill and decode seconds; top-level ``mean_accuracy``), longeval.csv (the
cells), heatmap_<task>.png (length x depth accuracy) and, with ``--compare``,
pareto.png (accuracy against KV bytes per sequence beside perplexity against KV bytes).
``--json_out=FILE`` writes longeval.json's content there too.

Lengths past ``--config.max_seq_len`` (when given) or past the checkpoint's trained
context (SmolLM2: 8,192 positions) are refused unless ``--allow_beyond_context``; such
cells are marked ``beyond_context``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
from absl import flags

from experiments import cli

from kvjax import checkpoints
from kvjax.analysis import theory
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.inference import runner
from kvjax.training import data, evaluate
from kvjax.training import longcontext as lc
from kvjax.training.longgrid import (
    check_lengths, parse_grid, parse_shard, protocol_key, run_key, run_samples, run_sweep,
    run_sweep_ppl, sample_scores, summarize, summarize_ppl, tail_ppl, trained_context)

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Model config file (get_config())."),
    lock_config=True)
_EVAL = cli.DEFINE_config_dict("eval", evaluate.eval_config_dict(), cli.EVAL_HELP,
                               lock_config=True)
DEFAULT_TASKS = list(lc.TASKS)
DEFAULT_LENGTHS = ["1024", "2048"]
DEFAULT_DEPTHS = ["0.1", "0.5", "0.9"]
DEFAULT_SAMPLES = 2
FULL_LENGTHS = [1024, 2048, 4096, 8192]
FULL_DEPTHS = [round(0.1 * i, 1) for i in range(11)]
FULL_SAMPLES = 10
_TASKS = flags.DEFINE_list("tasks", DEFAULT_TASKS, f"Tasks, any of: {', '.join(lc.TASKS)}.")
_LENGTHS = flags.DEFINE_list("lengths", DEFAULT_LENGTHS,
                             "Sequence lengths L in tokens (prompt + generation budget).")
_DEPTHS = flags.DEFINE_list("depths", DEFAULT_DEPTHS,
                            "Needle depths in [0, 1] (share of the filler before it).")
_SAMPLES = flags.DEFINE_integer("samples", DEFAULT_SAMPLES,
                                "Samples per task x length x depth.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the generated samples.")
_FULL = flags.DEFINE_bool(
    "full_grid", False, f"Lengths {FULL_LENGTHS}, depths 0-1 by 0.1, {FULL_SAMPLES} samples "
    "each (hours on a CPU); replaces --lengths/--depths/--samples.")
_PROTOCOL = flags.DEFINE_enum(
    "protocol", "context", list(lc.PROTOCOLS),
    "When a compressed cache (--config.model.kv_compression) sees the question: 'context' "
    "(compress the context once, then ask) or 'question' (prefill the context and the "
    "question, compress, answer).")
_QUERY_FIRST = flags.DEFINE_bool("query_first", False,
                                 "Also put the question before the context (query-aware).")
_BEYOND = flags.DEFINE_bool(
    "allow_beyond_context", False,
    "Allow lengths past the checkpoint's trained context (cells marked beyond_context).")
_PPL = flags.DEFINE_bool(
    "ppl", False, "Also score perplexity, for the KV-bytes plot: with --ppl_tokens, --sweep "
    "or --config.model.kv_compression, of each text's last --ppl_tokens tokens on the cache "
    "its first L - M were prefilled (and compressed) into (texts of the longest --lengths "
    "L from the --eval corpus); otherwise with the --eval settings (experiments.ppl's "
    "windows).")
_PPL_TOKENS = flags.DEFINE_integer(
    "ppl_tokens", None, f"M, the scored last tokens of each perplexity text (default "
    f"{lc.PPL_TOKENS} where the tail measure applies); given, the tail measure is used for "
    "any config (a window, kv_dtype, KV heads: the levers on one perplexity axis).")
_PPL_TEXTS = flags.DEFINE_integer(
    "ppl_texts", 4, "Texts of L tokens (the --eval corpus's first windows) the tail "
    "perplexity scores.")
_OUT = flags.DEFINE_string("out_dir", "results/longeval", "Output folder.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the result JSON here.")
_COMPARE = flags.DEFINE_list(
    "compare", [], "longeval.json files of several runs: draw pareto.png (accuracy and "
    "perplexity against KV bytes per sequence) into --out_dir and exit.")
_COMPARE_PPL = flags.DEFINE_list(
    "compare_ppl", [], "experiments.ppl --json_out files, one per --compare file in the "
    "same order ('-': none), for runs made without --ppl.")
_SWEEP = flags.DEFINE_list(
    "sweep", [], "Lever-5 methods to score on one prefill per sample (with --sweep_budgets; "
    "'none': the full cache): every method x budget as its own run, as "
    "--config.model.kv_compression=M --config.model.kv_budget=N would score it. Writes "
    "sweep.json (one longeval.json entry per point and protocol) for --compare.")
_SWEEP_BUDGETS = flags.DEFINE_list("sweep_budgets", [], "kv_budget values of --sweep.")
_SWEEP_PROTOCOLS = flags.DEFINE_list(
    "sweep_protocols", [], f"Protocols of --sweep, any of {list(lc.PROTOCOLS)} (default: "
    "--protocol); 'question' prefills each question with the context once for every point.")
_SHARD = flags.DEFINE_string(
    "shard", None, "K/N: with --sweep, score only every N-th sample still to do from the "
    "K-th, into samples.shard-K-of-N.jsonl (N processes share a sweep; a run without "
    "--shard then summarizes every shard's log).")
_SUMMARIZE_ONLY = flags.DEFINE_bool(
    "summarize_only", False, "With --sweep: score nothing; write sweep.json from the "
    "samples the logs (every shard's) already hold.")
flags.adopt_module_key_flags(cli)

CELL_FIELDS = ["task", "length", "depth", "samples", "accuracy", "accuracy_low",
               "accuracy_high", "answer_nll", "answer_nll_low", "answer_nll_high",
               "kv_bytes_theory", "kv_bytes_allocated", "prefill_seconds", "decode_seconds",
               "beyond_context"]


def _given(name: str) -> bool:
    """Whether ``--name=...`` is on the command line."""
    return any(a.lstrip("-").split("=")[0] == name for a in sys.argv[1:])


def write_csv(path: pathlib.Path, cells: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CELL_FIELDS)
        w.writeheader()
        for c in cells:
            w.writerow(c)


def plot_heatmaps(cells: list, out_dir: pathlib.Path, title: str) -> list:
    """One length x depth accuracy heat map per task (the needle-in-a-haystack picture);
    returns the paths written."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    paths = []
    for t in sorted({c["task"] for c in cells}, key=list(lc.TASKS).index):
        cs = [c for c in cells if c["task"] == t]
        lengths = sorted({c["length"] for c in cs})
        depths = sorted({c["depth"] for c in cs})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cs:
            grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
        fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.45 * len(depths)))
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("length (tokens)")
        ax.set_ylabel("needle depth")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
        ax.set_title(f"{t}: {title}", fontsize=8)
        fig.colorbar(im, ax=ax, label="accuracy")
        fig.tight_layout()
        p = out_dir / f"heatmap_{t}.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def common_cells(results: list) -> set:
    """(task, length, depth) cells scored in every one of ``results``."""
    sets = [{(c["task"], c["length"], c["depth"]) for c in r["cells"]} for r in results]
    return set.intersection(*sets) if sets else set()


def shared_accuracy(result: dict, cells: set) -> tuple:
    """(accuracy, Wilson low, high, samples) of ``result`` over ``cells`` only."""
    cs = [c for c in result["cells"] if (c["task"], c["length"], c["depth"]) in cells]
    n = sum(c["samples"] for c in cs)
    k = sum(c["accuracy"] * c["samples"] for c in cs)
    lo, hi = lc.wilson_interval(k, n)
    return k / n, lo, hi, n


def plot_pareto(results: list, path: pathlib.Path) -> None:
    """Accuracy against KV bytes per sequence (left) beside perplexity against KV bytes
    (right), one point per run (``results``: longeval.json contents, each with an
    optional ``ppl`` entry). Accuracy is over the cells every run scored
    (:func:`common_cells`), its bytes the theory at their longest length; perplexity's
    bytes are at its own context."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    cells = common_cells(results)
    longest = max(n for _, n, _ in cells)
    label = lambda r: r["variant"].split(" ", 1)[-1].replace(" rope=absolute", "")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    # one colour and line per method and protocol (a sweep's budgets joined), a label
    # per point otherwise
    series: dict = {}
    for r in results:
        series.setdefault((r.get("kv_compression"), r.get("protocol")), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = set()  # methods whose perplexity is drawn
    for k, (key, rs) in enumerate(series.items()):
        pts = sorted((r["lengths"][str(longest)]["kv_bytes_theory"], shared_accuracy(r, cells))
                     for r in rs)
        c = colors[k % len(colors)]
        if len(pts) > 1:
            a.plot([x for x, _ in pts], [v[0] for _, v in pts], "-", color=c, alpha=0.6,
                   label=f"{key[0] or 'full'} ({key[1]})")
        for r in rs:
            x = r["lengths"][str(longest)]["kv_bytes_theory"]
            acc, lo, hi, _ = shared_accuracy(r, cells)
            a.errorbar([x], [acc], yerr=[[acc - lo], [hi - acc]], fmt="o", capsize=3,
                       color=c)
            if len(pts) == 1:
                a.annotate(label(r), (x, acc), fontsize=7, xytext=(4, 4),
                           textcoords="offset points")
        # perplexity does not depend on the protocol (its text has no question): one
        # line per method, from its first protocol's runs
        pp = sorted(((r["ppl"]["kv_bytes_theory"], r["ppl"]) for r in rs if r.get("ppl")),
                    key=lambda t: t[0])
        if pp and key[0] not in drawn:
            drawn.add(key[0])
            ys = [q["ppl"] for _, q in pp]
            err = [[y - q.get("ppl_ci", [y, y])[0] for y, (_, q) in zip(ys, pp)],
                   [q.get("ppl_ci", [y, y])[1] - y for y, (_, q) in zip(ys, pp)]]
            err = np.nan_to_num(np.asarray(err, np.float64))
            b.errorbar([x for x, _ in pp], ys, yerr=err, fmt="o-" if len(pp) > 1 else "o",
                       capsize=3, color=c, alpha=0.8, label=key[0] or "full")
            if len(rs) == 1:
                b.annotate(label(rs[0]), (pp[0][0], ys[0]), fontsize=7, xytext=(4, 4),
                           textcoords="offset points")
    if any(len(rs) > 1 for rs in series.values()):
        a.legend(fontsize=6, loc="lower right")
        if b.get_legend_handles_labels()[0]:
            b.legend(fontsize=6, loc="upper right")
    for ax in (a, b):
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo / 1.5, hi * 4)  # room for the labels right of the points
    a.set_xlabel(f"KV bytes per sequence at L={longest:,} (theory)")
    a.set_ylabel("long-context accuracy")
    a.set_ylim(-0.05, 1.05)
    b.set_xlabel("KV bytes per sequence at the perplexity context (theory)")
    b.set_ylabel("perplexity")
    a.set_title(f"accuracy on {len(cells)} shared cells (Wilson 95%)", fontsize=9)
    tails = {(r["ppl"]["context"], r["ppl"].get("tail")) for r in results if r.get("ppl")}
    b.set_title("perplexity" + "".join(
        f"; last {m} of {n:,} tokens on the cache of the first {n - m:,}"
        for n, m in sorted(tails) if m), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def compare(paths: list, ppl_paths: list, out_dir: pathlib.Path) -> int:
    """--compare: reads the runs (and, from ``ppl_paths``, experiments.ppl JSON files in
    the same order, for runs made without --ppl), prints and plots them."""
    results = []
    try:
        if ppl_paths and len(ppl_paths) != len(paths):
            raise ValueError(f"--compare_ppl has {len(ppl_paths)} files; allowed: one per "
                             f"--compare file ({len(paths)}), or none")
        for i, p in enumerate(paths):
            r = json.loads(pathlib.Path(p).read_text())
            if ppl_paths and ppl_paths[i] not in ("", "-"):
                q = json.loads(pathlib.Path(ppl_paths[i]).read_text())
                r["ppl"] = dict(q, kv_bytes_theory=q["kv_bytes_per_token"] * min(
                    q["context"], q.get("kv_cache_slots") or q["context"]))
            results.extend(r["runs"] if "runs" in r else [r])  # a --sweep's sweep.json
        cells = common_cells(results)
        if not cells:
            raise ValueError("the runs share no task x length x depth cell")
    except (OSError, ValueError, KeyError) as e:
        print(f"error: --compare: {e}", file=sys.stderr)
        return cli.USAGE_EXIT
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_pareto(results, out_dir / "pareto.png")
    for r in results:
        acc, lo, hi, n = shared_accuracy(r, cells)
        ppl = (r.get("ppl") or {}).get("ppl", float("nan"))
        ref = paired_reference(r, results)
        paired = ""
        if ref is not None:
            t = lc.paired_test(r["sample_scores"], ref["sample_scores"])
            paired = (f"; vs {PAIRED_REFERENCE} on {t['samples']} paired samples "
                      f"{t['wins']}+/{t['losses']}- p={t['p']:.3g}")
        print(f"{r['variant']:<50} accuracy {acc:.3f} [{lo:.2f}, {hi:.2f}] over {n} samples "
              f"of {len(cells)} shared cells; answer NLL {r.get('mean_answer_nll', 0):.3f}; "
              f"perplexity {ppl:.4f}{paired}")
    print(f"wrote {out_dir / 'pareto.png'}")
    return 0


PAIRED_REFERENCE = "streaming_llm"
"""The method every other compressed run is tested against, on the same samples, at the
same budget and protocol (equal KV bytes): StreamingLLM, the blog's window with sinks."""


def paired_reference(run: dict, results: list) -> dict | None:
    """The run of :data:`PAIRED_REFERENCE` at ``run``'s budget and protocol (the same KV
    bytes) among ``results``, if there is one and both carry per-sample scores; None for
    an uncompressed run or the reference itself."""
    if run.get("kv_compression") in (None, PAIRED_REFERENCE) or "sample_scores" not in run:
        return None
    for r in results:
        if (r.get("kv_compression") == PAIRED_REFERENCE and "sample_scores" in r
                and r.get("kv_budget") == run.get("kv_budget")
                and r.get("protocol") == run.get("protocol")):
            return r
    return None


def main(argv):
    if len(argv) > 1:
        raise cli.UsageError(f"unexpected arguments: {argv[1:]}")
    out_dir = pathlib.Path(_OUT.value)
    if _COMPARE.value:
        return compare(_COMPARE.value, _COMPARE_PPL.value, out_dir)
    wall = time.perf_counter()
    try:
        # every check that needs no weights first: config, grid, lengths, output paths,
        # one sample of each task at each length (a length too short fails here)
        if _FULL.value:
            grid = (_TASKS.value, [str(n) for n in FULL_LENGTHS],
                    [str(d) for d in FULL_DEPTHS], FULL_SAMPLES)
        else:
            grid = (_TASKS.value, _LENGTHS.value, _DEPTHS.value, _SAMPLES.value)
        tasks, lengths, depths, samples = parse_grid(*grid)
        given = _CONFIG.value.to_dict()
        if not _given("config.max_seq_len"):  # each length builds its own cache
            given["max_seq_len"] = max(lengths)
        run = run_config_from_dict(given)
        context = trained_context(run)
        check_lengths(lengths, run.max_seq_len if _given("config.max_seq_len") else None,
                      context, _BEYOND.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value) if _PPL.value else None
        points, protocols = sweep_points(run.model)
        shard = parse_shard(_SHARD.value)
        if (shard is not None or _SUMMARIZE_ONLY.value) and not points:
            raise cli.UsageError("--shard or --summarize_only without --sweep; allowed: "
                                 "with --sweep")
        tail = ppl_tail(ecfg, bool(points), run.model.kv_compression, max(lengths))
        cli.check_output_dir(str(out_dir), "out_dir")
        cli.check_output_file(_JSON_OUT.value, "json_out")
        path = run.weights_path or checkpoints.weights_path(run.cache_dir)
        tokenizer = (checkpoints.load_tokenizer(path) if run.weights != "hf"
                     else runner.hf.load_hf_tokenizer(path))
        for t in tasks:
            for n in lengths:
                lc.generate_sample(t, tokenizer, n, depths[0], _SEED.value, 0, _QUERY_FIRST.value)
        evalset = texts = None
        if tail is not None:  # texts of the harness's length L: its first windows
            texts = evaluate.prepare_eval(dataclasses.replace(
                ecfg, context=max(lengths), chunk=max(lengths),
                num_tokens=_PPL_TEXTS.value * max(lengths)), tokenizer, run.cache_dir).windows
        elif ecfg is not None:
            evalset = evaluate.prepare_eval(ecfg, tokenizer, run.cache_dir)
        # the weights need no cache of max_seq_len here: each length builds its own
        loaded = runner.load(dataclasses.replace(run, max_seq_len=min(lengths)))
    except (ConfigError, WeightsError, data.CorpusError, ValueError, cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return cli.USAGE_EXIT
    if loaded.context_length and context and loaded.context_length != context:
        print(f"error: the checkpoint states a context of {loaded.context_length}, not "
              f"{context}", file=sys.stderr)
        return cli.USAGE_EXIT
    if points:
        points, _ = sweep_points(loaded.cfg)
        return evaluate_sweep_grid(loaded, points, protocols, tokenizer, tasks, lengths,
                                   depths, samples, context, out_dir, wall, shard,
                                   texts, tail, ppl_source(ecfg))
    return evaluate_grid(run, loaded, tokenizer, tasks, lengths, depths, samples, context,
                         out_dir, ecfg, evalset, wall, texts, tail)


def ppl_tail(ecfg, sweep: bool, kv_compression, length: int) -> int | None:
    """M of the tail perplexity (``lc.tail_nll``), or None for experiments.ppl's windows
    measure or no --ppl: the tail measure with --ppl_tokens given, with --sweep or with
    a compressed config (whose prompt's cache is compressed after the prefill, so
    windows prefilled chunk by chunk would score the uncompressed model).

    Raises:
      cli.UsageError: --ppl_tokens or --ppl_texts without --ppl; --ppl_texts below 1;
        M outside [1, ``length``) (named).
    """
    given = _given("ppl_tokens")
    if ecfg is None:
        if given or _given("ppl_texts"):
            raise cli.UsageError("--ppl_tokens or --ppl_texts without --ppl; allowed: "
                                 "with --ppl")
        return None
    if not (given or sweep or kv_compression is not None):
        return None
    if _PPL_TEXTS.value < 1:
        raise cli.UsageError(f"--ppl_texts={_PPL_TEXTS.value}; allowed: an integer >= 1")
    tail = _PPL_TOKENS.value if _PPL_TOKENS.value is not None else lc.PPL_TOKENS
    try:
        lc.check_tail(length, tail)
    except ValueError as e:
        raise cli.UsageError(f"--{e} (the longest --lengths)") from None
    return tail


def ppl_source(ecfg) -> str:
    """The corpus and split the tail perplexity's texts come from, for its log keys."""
    if ecfg is None:
        return ""
    return json.dumps([ecfg.corpus or "django-docs", ecfg.split, ecfg.heldout_fraction])


def sweep_points(model) -> tuple:
    """(configs, protocols) of --sweep x --sweep_budgets on ``model`` ((), () without
    --sweep): one config per method and budget ('none': ``model`` uncompressed, once),
    unrolled layers for all when a method keeps per-layer budgets (PyramidKV), so that
    every point shares one prefill.

    Raises:
      cli.UsageError: --sweep_budgets without --sweep or the reverse, a budget that is
        not an integer, an unknown protocol, a windowed or compressed --config.
      ConfigError: a method or budget the config refuses (named by it).
    """
    from kvjax import compression  # noqa: PLC0415

    if not _SWEEP.value:
        if _SWEEP_BUDGETS.value or _SWEEP_PROTOCOLS.value:
            raise cli.UsageError("--sweep_budgets or --sweep_protocols without --sweep; "
                                 "allowed: with --sweep=METHOD,...")
        return (), ()
    try:
        budgets = [int(b) for b in _SWEEP_BUDGETS.value]
    except ValueError:
        raise cli.UsageError(f"--sweep_budgets={','.join(_SWEEP_BUDGETS.value)}; allowed: "
                             "integers (slots)") from None
    methods = [None if m == "none" else m for m in _SWEEP.value]
    if any(m is not None for m in methods) and not budgets:
        raise cli.UsageError("--sweep with a method and no --sweep_budgets; allowed: "
                             "--sweep_budgets=N,...")
    protocols = _SWEEP_PROTOCOLS.value or [_PROTOCOL.value]
    bad = [p for p in protocols if p not in lc.PROTOCOLS]
    if bad:
        raise cli.UsageError(f"--sweep_protocols={','.join(protocols)}; allowed: any of "
                             f"{list(lc.PROTOCOLS)}")
    if model.kv_compression is not None or model.window_size is not None:
        raise cli.UsageError(
            f"--sweep with --config.model.kv_compression={model.kv_compression} "
            f"window_size={model.window_size}; allowed: neither (the sweep sets the method; "
            "a window of equal bytes is streaming_llm)")
    for m in methods:
        if m is not None:
            compression.get(m)  # an unknown name: ValueError naming the registered ones
    unrolled = any(m is not None and compression.get(m).layer_budgets for m in methods)
    base = model.replace(scan_layers=False) if unrolled else model
    out = []
    for m in dict.fromkeys(methods):
        for b in (budgets if m is not None else [None]):
            out.append(base.replace(kv_compression=m, kv_budget=b))
    return out, protocols


def evaluate_sweep_grid(loaded, points, protocols, tokenizer, tasks, lengths, depths,
                        samples, context, out_dir, wall, shard=None, texts=None,
                        tail=None, source="") -> int:
    """--sweep: every point x protocol on one prefill per sample; sweep.json holds one
    longeval.json entry per (point, protocol) (``runs``), with per-sample scores, and
    with --ppl each point's tail perplexity (``ppl``, the same under both protocols:
    the text has no question), its texts scored first (ppl.jsonl, one prefill per
    text)."""
    from kvjax.models import model as model_lib  # noqa: PLC0415

    params = model_lib.params_for(points[0], loaded.params)
    print(f"trained context: {context or 'unknown'}")
    ppl = {}
    if tail is not None:
        ppl = run_sweep_ppl(params, points, texts, tail, out_dir / "ppl.jsonl", source,
                            shard=shard, score=not _SUMMARIZE_ONLY.value)
    recs = run_sweep(params, points, tokenizer, tasks, lengths, depths, samples, _SEED.value,
                     _QUERY_FIRST.value, out_dir / "samples.jsonl", protocols,
                     shard=shard, score=not _SUMMARIZE_ONLY.value)
    if shard is not None:
        print(f"shard {shard[0]}/{shard[1]} done; a run without --shard summarizes")
        return 0
    runs = []
    for (pr, i), rs in recs.items():
        if not rs:
            continue
        cfg = points[i]
        out = summarize(rs, tasks, lengths, depths, context)
        out.update(model=cfg.name, variant=protocol_key(run_key(cfg), pr),
                   trained_context=context, query_first=_QUERY_FIRST.value,
                   seed=_SEED.value, depths=depths, protocol=pr,
                   kv_compression=cfg.kv_compression, kv_budget=cfg.kv_budget,
                   kv_bytes_per_token=theory.kv_bytes_per_token(cfg),
                   sample_scores=sample_scores(rs))
        tail_ppl_i = summarize_ppl(ppl.get(i, []))
        if tail_ppl_i:
            out["ppl"] = tail_ppl_i
        runs.append(out)
        print(f"{out['variant']:<70} accuracy {out['mean_accuracy']:.3f} "
              f"[{out['mean_accuracy_ci'][0]:.2f}, {out['mean_accuracy_ci'][1]:.2f}] answer "
              f"NLL {out['mean_answer_nll']:.3f}" + (
                  f" perplexity {out['ppl']['ppl']:.3f} ({out['ppl']['texts']} texts)"
                  if "ppl" in out else ""))
    result = dict(runs=runs, wall_seconds=time.perf_counter() - wall)
    cli.write_json(str(out_dir / "sweep.json"), result)
    if _JSON_OUT.value:
        cli.write_json(_JSON_OUT.value, result)
    print(f"wall time {result['wall_seconds']:.0f} s; wrote {out_dir}/sweep.json")
    return 0


def evaluate_grid(run, loaded, tokenizer, tasks, lengths, depths, samples, context,
                  out_dir, ecfg, evalset, wall, texts=None, tail=None) -> int:
    cfg, params = loaded.cfg, loaded.params
    key = run_key(cfg) + ("" if _PROTOCOL.value == "context" else
                          f" protocol={_PROTOCOL.value}")
    print(f"trained context: {context or 'unknown'}")
    records = run_samples(params, cfg, tokenizer, tasks, lengths, depths, samples,
                          _SEED.value, _QUERY_FIRST.value, out_dir / "samples.jsonl", key,
                          protocol=_PROTOCOL.value,
                          page_size=run.page_size if cfg.kv_selects_pages else 0)
    out = summarize(records, tasks, lengths, depths, context)
    out.update(model=cfg.name, variant=key, trained_context=context,
               query_first=_QUERY_FIRST.value, seed=_SEED.value, depths=depths,
               protocol=_PROTOCOL.value, kv_compression=cfg.kv_compression,
               kv_budget=cfg.kv_budget,
               kv_bytes_per_token=theory.kv_bytes_per_token(cfg),
               sample_scores=sample_scores(records),
               wall_seconds=time.perf_counter() - wall,
               metric={t: f"string_match_{lc.TASKS[t].metric}" for t in tasks})
    if tail is not None:
        out["ppl"] = tail_ppl(params, cfg, texts, tail)
    elif ecfg is not None:
        res = evaluate.perplexity(params, cfg, evalset.windows, ecfg,
                                  evalset.corpus.byte_lengths,
                                  separator_id=evalset.corpus.separator_id)
        out["ppl"] = dict(res.as_json(), context=ecfg.context,
                          kv_bytes_theory=theory.kv_cache_bytes(cfg, ecfg.context))
    print(f"{'task':<16}{'accuracy':>10}  {'95% CI':<15}{'answer NLL':>11}  samples")
    for t, v in out["tasks"].items():
        print(f"{t:<16}{v['accuracy']:>10.3f}  [{v['accuracy_ci'][0]:.2f}, "
              f"{v['accuracy_ci'][1]:.2f}]   {v['answer_nll']:>9.3f}  {v['samples']}")
    print(f"mean accuracy {out['mean_accuracy']:.3f}, mean answer NLL "
          f"{out['mean_answer_nll']:.3f} nats/token")
    for n, v in out["lengths"].items():
        print(f"L={int(n):,}: accuracy {v['accuracy']:.3f}, KV {v['kv_bytes_theory']:,} B "
              f"theory / {v['kv_bytes_allocated']:,} B allocated, "
              f"{v['seconds_per_sample']:.2f} s per sample (median)")
    if "ppl" in out:
        print(f"perplexity {out['ppl']['ppl']:.4f} at context {out['ppl']['context']}"
              + (f", its last {tail} tokens on the cache of the first "
                 f"{out['ppl']['context'] - tail} ({out['ppl']['texts']} texts)"
                 if tail is not None else ""))
    print(f"wall time {out['wall_seconds']:.0f} s")
    cli.write_json(str(out_dir / "longeval.json"), out)
    if _JSON_OUT.value:
        cli.write_json(_JSON_OUT.value, out)
    write_csv(out_dir / "longeval.csv", out["cells"])
    plot_heatmaps(out["cells"], out_dir, key)
    print(f"wrote {out_dir}/longeval.json, longeval.csv, heatmap_*.png"
          + (f", {_JSON_OUT.value}" if _JSON_OUT.value else ""))
    return 0


if __name__ == "__main__":
    cli.run(main)
