r"""Compare attention variants on one text in one command: KV bytes, speed, perplexity.

    python -m experiments.compare --configs=gqa,mqa,window \
        --override=window:model.window_size=128,model.num_sink_tokens=4 \
        --eval.corpus=mytext.txt --eval.split=all --eval.num_tokens=0
    python -m experiments.compare --configs=gqa,w64=window,w128=window \
        --override=w64:model.window_size=64 --override=w128:model.window_size=128 \
        --override=all:model.num_sink_tokens=4 --eval.num_tokens=4096
    python -m experiments.compare --list_fields        # what --override and --eval.* can set

``--configs``: names of files in configs/ (or paths), each optionally ``LABEL=NAME`` (the
same file twice needs two labels). ``--override=LABEL:FIELD=VALUE,FIELD=VALUE`` sets
fields of one config (``all:`` of every one); FIELD is a ``--config.`` field without the
prefix (``model.window_size``, ``dtype``, ``max_new_tokens``). Every config, override,
eval setting and output path is checked before any weights load.

Per config, on the same windows of one corpus (the default Django docs, or your own file
or folder with ``--eval.corpus``): KV-cache bytes per token and per sequence at the eval
context (theory, and the cache the perplexity pass allocated), decode tokens/s (the
config's prompt, ``max_new_tokens`` greedy steps in one compiled loop, after a warm-up
run), the median decode-step time with a full cache at ``--step_context`` (default: the
eval context), perplexity and bits per byte (the decode path, :mod:`kvjax.training.
evaluate`). Writes ``OUT/compare.{txt,csv,json,png}`` (``--out_dir``) and, with
``--json_out``, the JSON there too. Each row is named by what it is (``GQA K=3
W=128+4 sinks fp32``), whatever file or override built it.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import math
import pathlib
import re
import statistics
import sys
import time
from typing import Any

from absl import app, flags

from experiments import cli

from kvjax.cache import compress as compress_lib
from kvjax import checkpoints, fields, naming
from kvjax import cache as cache_lib
from kvjax.analysis import costs, theory
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, RunConfig, run_config_from_dict
from kvjax.training import data, evaluate

_CONFIGS = flags.DEFINE_list(
    "configs", ["gqa", "mqa", "window"],
    "Configs to compare: names in configs/ (gqa, mha, mqa, window, ...) or paths, each "
    "optionally LABEL=NAME (e.g. w64=window).")
_OVERRIDE = flags.DEFINE_multi_string(
    "override", [],
    "LABEL:FIELD=VALUE[,FIELD=VALUE...]: set config fields of one config (LABEL 'all': of "
    "every config), e.g. window:model.window_size=128,model.num_sink_tokens=4. FIELD is a "
    "--config field without 'config.' (--list_fields lists them). Repeatable.")
_EVAL = cli.DEFINE_config_dict("eval", evaluate.eval_config_dict(), cli.EVAL_HELP,
                               lock_config=True)
_STEP_CONTEXT = flags.DEFINE_integer(
    "step_context", None, "Context t (tokens) of the timed decode step (default: "
    "--eval.context): the cache holds t - 1 tokens (a window: min(t - 1, W)).")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed decode steps per config (median).")
_OUT = flags.DEFINE_string("out_dir", "results/compare",
                           "Where compare.txt, compare.csv, compare.json and compare.png go.")
_JSON_OUT = flags.DEFINE_string("json_out", None, "Also write the JSON here.")

MB = 1e6  # decimal megabytes: every MB printed or plotted here is 10^6 bytes
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


class CompareError(ValueError):
    """A bad --configs / --override value (one line: the value and what is allowed)."""


# --------------------------------------------------------------------------- configs


def parse_configs(entries: list[str]) -> list[tuple[str, str]]:
    """['gqa', 'w64=window'] -> [('gqa', path of gqa.py), ('w64', path of window.py)].

    Raises:
      CompareError: an empty list, an unknown config (closest names given), a duplicate
        label.
    """
    if not entries:
        raise CompareError("--configs is empty; allowed: names in configs/ such as "
                           f"{','.join(cli.config_names())}")
    out, seen = [], set()
    for e in entries:
        label, eq, name = e.partition("=")
        if not eq:
            label, name = pathlib.Path(e).stem, e
        if not re.fullmatch(r"[\w.+-]+", label) or label == "all":
            raise CompareError(f"--configs: label {label!r}; allowed: letters, digits, "
                               "'_', '.', '+', '-' (and not 'all')")
        if label in seen:
            raise CompareError(f"--configs: {label!r} appears twice; give each its own "
                               f"label: {label}1={name},{label}2={name}")
        seen.add(label)
        try:
            out.append((label, cli.resolve_config_path(name)))
        except cli.UsageError as err:
            raise CompareError(f"--configs: {err}") from None
    return out


def load_config_file(path: str) -> Any:
    """``get_config()`` of a config file (an ``ml_collections.ConfigDict``)."""
    spec = importlib.util.spec_from_file_location(f"_kvjax_config_{pathlib.Path(path).stem}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


_ASSIGN = re.compile(r",(?=\s*[A-Za-z_][\w.]*\s*=)")


def parse_overrides(values: list[str], labels: list[str]) -> dict[str, list[tuple[str, str]]]:
    """['window:model.window_size=128,model.num_sink_tokens=4'] ->
    {'window': [('model.window_size', '128'), ('model.num_sink_tokens', '4')]}.

    A comma separates assignments only where a ``field=`` follows, so a value may hold
    commas (``all:prompt=Hello, world``).

    Raises:
      CompareError: no ``LABEL:``, an unknown label (closest given), no ``=``.
    """
    out: dict[str, list[tuple[str, str]]] = {}
    for v in values:
        label, colon, rest = v.partition(":")
        if not colon or "=" in label:
            raise CompareError(f"--override={v}: allowed: LABEL:FIELD=VALUE[,FIELD=VALUE] "
                               f"with LABEL one of {labels + ['all']}")
        if label not in labels and label != "all":
            near = fields.closest(label, labels + ["all"])
            raise CompareError(f"--override={v}: no config labelled {label!r}; allowed: "
                               f"{labels + ['all']}" + (f" (closest: {near[0]})" if near else ""))
        for item in _ASSIGN.split(rest):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise CompareError(f"--override={v}: {item!r} is not FIELD=VALUE")
            key = key.strip()
            key = key[len("config."):] if key.startswith("config.") else key
            out.setdefault(label, []).append((key, value))
    return out


def _convert(value: str, current: Any, type_: type, where: str) -> Any:
    if value.lower() in ("none", "null") and current is None:
        return None
    try:
        if type_ is bool:
            if value.lower() in ("true", "1", "yes"):
                return True
            if value.lower() in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if type_ is int:
            return int(value)
        if type_ is float:
            return float(value)
        return value
    except ValueError:
        raise CompareError(f"{where}={value!r}; allowed: a value of type "
                           f"{type_.__name__}") from None


def apply_overrides(cd: Any, assignments: list[tuple[str, str]], label: str) -> None:
    """Sets ``cd``'s fields in place, each checked: the path exists, the value converts
    to the field's type.

    Raises:
      CompareError: an unknown field (closest fields named) or a value of the wrong type.
    """
    paths = [f.path[len("config."):] for f in fields.config_fields("config", cd)]
    for key, value in assignments:
        if key not in paths:
            near = fields.closest(key, paths)
            raise CompareError(
                f"--override={label}:{key}: no such field"
                + (f"; did you mean {' or '.join(near)}?" if near else "")
                + " (python -m experiments.compare --list_fields lists them)")
        *parents, leaf = key.split(".")
        holder = cd
        for p in parents:
            holder = holder[p]
        holder[leaf] = _convert(value, holder[leaf], holder.get_type(leaf),
                                f"--override={label}:{key}")


@dataclasses.dataclass
class Variant:
    label: str
    path: str
    run: RunConfig

    @property
    def name(self) -> str:
        return naming.variant_name(self.run.model)


def build_variants(entries: list[str], overrides: list[str]) -> list[Variant]:
    """Every config loaded, overridden and validated (no weights touched).

    Raises:
      CompareError: a bad entry or override. ConfigError: an invalid value.
    """
    parsed = parse_configs(entries)
    by_label = parse_overrides(overrides, [label for label, _ in parsed])
    out = []
    for label, path in parsed:
        cd = load_config_file(path)
        apply_overrides(cd, by_label.get("all", []) + by_label.get(label, []), label)
        try:
            run = run_config_from_dict(cd)
        except ConfigError as e:
            raise ConfigError(f"{label}: {e}") from None
        out.append(Variant(label, path, run))
    return out


# --------------------------------------------------------------------------- measuring


def decode_speed(run: RunConfig, params, tokenizer) -> tuple[float, str]:
    """(decode tokens/s of ``run.max_new_tokens`` greedy steps after the prompt, the
    first 40 characters generated). The compiled loop is run once untimed (compile)."""
    from kvjax.inference import decode  # noqa: PLC0415

    cfg = run.model
    ids = tokenizer.encode(run.prompt)
    run.check_fits(len(ids))
    steps = run.max_new_tokens - 1
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    def once():
        cache = cache_lib.init_cache(cfg, 1, run.max_seq_len)
        logits, cache = decode.prefill(params, cfg, jnp.asarray([ids], jnp.int32), cache)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready((first, cache))
        start = time.perf_counter()
        buf, ran, _ = decode.generate(params, cfg, first, cache, steps)
        jax.block_until_ready(buf)
        return time.perf_counter() - start, int(ran), [int(first[0])] + [
            int(t) for t in buf[0, :int(ran)]]

    once()
    seconds, ran, out = once()
    return (ran / seconds if ran else float("nan")), tokenizer.decode(out)[:40]


def measure(v: Variant, evalset: evaluate.EvalSet, ecfg: evaluate.EvalConfig,
            tokenizer, step_context: int, repeats: int) -> dict:
    """One row: load ``v``'s weights, score the windows, time decoding and one step."""
    from kvjax.inference import runner  # noqa: PLC0415

    start = time.perf_counter()
    loaded = runner.load(v.run, progress=False)
    cfg = loaded.cfg
    res = evaluate.perplexity(loaded.params, cfg, evalset.windows, ecfg,
                              evalset.corpus.byte_lengths)
    tok_s, text = decode_speed(v.run, loaded.params, tokenizer)
    times = costs.measure_step_seconds(cfg, loaded.params,
                                       compress_lib.full_cache(cfg, 1, step_context), 1, repeats)
    return dict(
        label=v.label, variant=v.name, config=v.path, model=cfg.name,
        attention=cfg.attention, num_kv_heads=cfg.num_kv_heads, window=cfg.window_size,
        sinks=cfg.num_sink_tokens, dtype=cfg.dtype,
        kv_bytes_per_token=theory.kv_bytes_per_token(cfg),
        kv_cache_bytes_per_sequence_theory=theory.kv_cache_bytes(cfg, ecfg.context),
        kv_cache_bytes_per_sequence=res.cache_bytes_per_sequence,
        kv_cache_slots=res.cache_slots, eval_context=ecfg.context,
        decode_tokens_per_s=tok_s, decode_new_tokens=v.run.max_new_tokens,
        generated_text=text,
        step_ms=1e3 * statistics.median(times), step_context=step_context,
        step_bytes_theory=theory.step_bytes(cfg, step_context).total,
        ppl=res.ppl, bits_per_byte=res.bits_per_byte, tokens_scored=res.num_predicted,
        check_rel_diff=res.check_rel_diff, seconds=time.perf_counter() - start)


# --------------------------------------------------------------------------- output

COLUMNS = [  # (header, key, format)
    ("config", "label", "{}"),
    ("what it is", "variant", "{}"),
    ("KV B/token", "kv_bytes_per_token", "{:,}"),
    ("KV MB/seq @ctx", "kv_cache_bytes_per_sequence", "mb"),
    ("decode tok/s", "decode_tokens_per_s", "{:.1f}"),
    ("step ms @t", "step_ms", "{:.1f}"),
    ("perplexity", "ppl", "num"),
    ("bits/byte", "bits_per_byte", "{:.4f}"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    v = row[key]
    if fmt == "mb":
        return f"{v / MB:,.2f}"
    if fmt == "num":
        return f"{v:.3f}" if abs(v) < 1e5 else f"{v:.3e}"
    return fmt.format(v)


def table(rows: list[dict]) -> str:
    """The comparison as a plain-text table (MB = 10^6 bytes)."""
    head = [h for h, _, _ in COLUMNS]
    body = [[_cell(r, k, f) for _, k, f in COLUMNS] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
    path.write_text(buf.getvalue())


def plot(rows: list[dict], settings: dict, path: pathlib.Path) -> None:
    """Two panels against KV-cache MB per sequence (x): perplexity, and decode-step ms at
    the step context. Every point carries its config's label."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    x = [r["kv_cache_bytes_per_sequence"] / MB for r in rows]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    panels = [("ppl", f"perplexity (context {settings['eval_context']}, lower is better)"),
              ("step_ms", f"decode step, ms (context {settings['step_context']}, median)")]
    for ax, (key, ylabel) in zip(axes, panels):
        y = [r[key] for r in rows]
        for i, (xi, yi, r) in enumerate(zip(x, y, rows)):
            ax.scatter([xi], [yi], s=60, color=colors[i % len(colors)], zorder=3,
                       label=f"{r['label']}: {r['variant']}")
            ax.annotate(r["label"], (xi, yi), textcoords="offset points", xytext=(6, 6),
                        fontsize=9)
        ax.set_xlabel(f"KV cache per sequence at context {settings['eval_context']} "
                      "(MB = $10^6$ bytes)")
        ax.set_ylabel(ylabel)
        finite = [v for v in y if v and math.isfinite(v)]
        if key == "ppl" and finite and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.set_xlim(left=0, right=max(x) * 1.25 if max(x) > 0 else 1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(rows)),
               fontsize=9, frameon=False)
    fig.suptitle(f"{settings['corpus']} ({settings['split']}, {settings['tokens_scored']:,} "
                 f"tokens scored) on {settings['device']}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        # Everything that needs no weights first: configs, overrides, eval, outputs, corpus.
        variants = build_variants(_CONFIGS.value, _OVERRIDE.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value)
        step_context = _STEP_CONTEXT.value or ecfg.context
        if step_context < 2:
            raise CompareError(f"--step_context={step_context}; allowed: >= 2")
        if _REPEATS.value < 1:
            raise CompareError(f"--repeats={_REPEATS.value}; allowed: >= 1")
        cli.check_output_dir(_OUT.value, "out_dir")
        cli.check_output_file(_JSON_OUT.value, "json_out")
        cache_dirs = {v.run.cache_dir for v in variants}
        cache_dir = next(iter(cache_dirs))
        docs = evaluate.eval_documents(ecfg, cache_dir)
        first = variants[0].run
        tokenizer = checkpoints.load_tokenizer(
            first.weights_path or checkpoints.weights_path(first.cache_dir))
        evalset = evaluate.prepare_eval(ecfg, tokenizer, cache_dir, docs)
        for v in variants:
            v.run.check_fits(len(tokenizer.encode(v.run.prompt)))
    except (CompareError, ConfigError, WeightsError, data.CorpusError, ValueError,
            cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax  # noqa: PLC0415
    from kvjax.analysis import hardware  # noqa: PLC0415

    corpus = evalset.corpus
    settings = dict(
        corpus=corpus.source, split=ecfg.split, documents=len(corpus.heldout_docs),
        tokens_scored=int(evalset.windows.shape[0] * (ecfg.context - 1)),
        eval_context=ecfg.context, step_context=step_context, repeats=_REPEATS.value,
        device=hardware.device_name(jax.devices()[0]), mb="10^6 bytes")
    print(f"corpus: {corpus.source}, {evalset.split_name}: {len(corpus.heldout_docs)} "
          f"documents, {corpus.heldout.size:,} tokens; scoring {evalset.windows.shape[0]} "
          f"windows of {ecfg.context} tokens; device {settings['device']}")
    rows = []
    for v in variants:
        print(f"[{len(rows) + 1}/{len(variants)}] {v.label}: {v.name} ...", flush=True)
        try:
            row = measure(v, evalset, ecfg, tokenizer, step_context, _REPEATS.value)
        except (ConfigError, WeightsError) as e:
            print(f"error: {v.label}: {e}", file=sys.stderr)
            return 2
        print(f"    perplexity {_cell(row, 'ppl', 'num')}, {row['decode_tokens_per_s']:.1f} tokens/s, "
              f"step {row['step_ms']:.1f} ms; continues the prompt with "
              f"{row['generated_text']!r} ({row['seconds']:.0f} s)", flush=True)
        rows.append(row)
    text = (table(rows) + f"\n\nKV MB/seq: the cache of one sequence at context "
            f"{ecfg.context} (MB = 10^6 bytes); decode tok/s: {variants[0].run.max_new_tokens}"
            f" greedy tokens after each config's prompt; step ms: median of "
            f"{_REPEATS.value} decode steps with a full cache at t = {step_context}.")
    print()
    print(text)
    out = pathlib.Path(_OUT.value)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.txt").write_text(text + "\n")
    write_csv(rows, out / "compare.csv")
    result = dict(settings=settings, rows=rows)
    cli.write_json(str(out / "compare.json"), result)
    plot(rows, settings, out / "compare.png")
    if _JSON_OUT.value:
        cli.write_json(_JSON_OUT.value, result)
    print(f"\nwrote {out}/compare.txt, compare.csv, compare.json, compare.png"
          + (f" and {_JSON_OUT.value}" if _JSON_OUT.value else ""))
    return 0


def override_fields() -> list[tuple[str, list]]:
    """--list_fields: the fields --override can set, with configs/gqa.py's values."""
    cd = load_config_file(cli.resolve_config_path("gqa"))
    return [("--override fields (LABEL:FIELD=VALUE, LABEL a --configs label or 'all'; "
             "values of configs/gqa.py):",
             [dataclasses.replace(f, path="LABEL:" + f.path[len("config."):])
              for f in fields.config_fields("config", cd)])]


if __name__ == "__main__":
    cli.run(main, extra_fields=override_fields)
