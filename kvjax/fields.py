"""Every settable field of the experiment configs: type, default, one-line description.

The descriptions have one source of truth, the ``Attributes:`` sections of the typed
dataclasses the ConfigDicts are converted into (:class:`kvjax.config.RunConfig`,
:class:`~kvjax.config.ModelConfig`, :class:`~kvjax.config.SamplingConfig`,
:class:`kvjax.training.evaluate.EvalConfig`, :class:`kvjax.training.train.TrainConfig`);
the types and defaults come from the ConfigDict itself (so ``--config=configs/mla.py``
lists MLA's values). ``python -m experiments.<entry> --list_fields`` prints them, and
:func:`unknown_field_message` turns a misspelt or misplaced override into one line that
names the closest valid fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
from typing import Any, Iterable, Mapping
from kvjax import compression
from kvjax import config as config_lib
from kvjax.training import evaluate
from kvjax.training import train


@dataclasses.dataclass(frozen=True)
class Field:
    """One settable field: ``path`` as typed on the command line without the dashes
    (``config.model.window_size``), its type name, default and one-line description."""

    path: str
    type_name: str
    default: Any
    description: str


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> description, parsed from ``cls``'s Google-style ``Attributes:``
    docstring section. A line ``a, b: text`` documents both ``a`` and ``b``; indented
    lines continue the description above them."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.strip() == "Attributes:")
    except StopIteration:
        return {}
    out: dict[str, str] = {}
    names: list[str] = []
    indent = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:
            break
        m = re.match(r"([A-Za-z_][\w, ]*):\s*(.*)", line.strip()) if width == indent else None
        if m:
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
        else:
            for n in names:
                out[n] = f"{out[n]} {line.strip()}".strip()
    return out


def one_line(text: str, limit: int = 150) -> str:
    """The first sentence of ``text``, at most ``limit`` characters."""
    text = " ".join(text.split())
    m = re.search(r"(?<=[a-z0-9)'\"]\.)\s+(?=[A-Z(`'])", text)
    first = text[:m.start()] if m and m.start() > 20 else text
    return first if len(first) <= limit else first[:limit - 1].rstrip() + "…"


def _docs_for_flag(flag_name: str) -> dict[str, str]:
    """Dotted field path (below the flag) -> description, for a known config flag."""
    # Imported here: kvjax.config is light, the training modules import jax/optax.

    if flag_name == "config":
        docs = {k: v for k, v in attribute_docs(config_lib.RunConfig).items()
                if k not in ("model", "sampling", "mesh", "distributed", "speculative")}
        docs.update({f"model.{k}": v for k, v in attribute_docs(config_lib.ModelConfig).items()})
        docs.update({f"model.compression.{k}": v for k, v in
                     attribute_docs(compression.CompressionConfig).items()})
        docs.update({f"sampling.{k}": v
                     for k, v in attribute_docs(config_lib.SamplingConfig).items()})
        docs.update({f"mesh.{k}": v for k, v in attribute_docs(config_lib.MeshConfig).items()})
        docs.update({f"speculative.{k}": v
                     for k, v in attribute_docs(config_lib.SpeculativeConfig).items()})
        docs.update({f"distributed.{k}": v
                     for k, v in attribute_docs(config_lib.DistributedConfig).items()})
        if "model.dtype" in docs:
            docs.setdefault("dtype", docs["model.dtype"] + " (sets model.dtype)")
        return docs
    if flag_name == "eval":
        return attribute_docs(evaluate.EvalConfig)
    if flag_name == "train":
        return attribute_docs(train.TrainConfig)
    return {}


def _leaves(cd: Mapping[str, Any], prefix: str) -> Iterable[tuple[str, Any, Any]]:
    """(dotted path, ConfigDict holding it, key) of every non-dict field, sorted."""
    for key in sorted(cd.keys()):
        value = cd[key]
        path = f"{prefix}.{key}"
        if hasattr(value, "keys") and hasattr(value, "get_type"):
            yield from _leaves(value, path)
        else:
            yield path, cd, key


def _type_name(cd: Any, key: str) -> str:
    try:
        t = cd.get_type(key)
    except (AttributeError, KeyError, TypeError):
        t = type(cd[key])
    name = getattr(t, "__name__", str(t))
    return "str|None" if cd[key] is None and name == "str" else (
        f"{name}|None" if cd[key] is None else name)


def config_fields(flag_name: str, cd: Mapping[str, Any]) -> list[Field]:
    """Every leaf field of the ConfigDict ``cd`` behind ``--flag_name``, documented.

    A field missing from the dataclass docstrings gets the description ''
    (``tests/test_fields.py`` checks that none is)."""
    docs = _docs_for_flag(flag_name)
    out = []
    for path, holder, key in _leaves(cd, flag_name):
        rel = path[len(flag_name) + 1:]
        out.append(Field(path, _type_name(holder, key), holder[key],
                         one_line(docs.get(rel, ""))))
    return out


def format_fields(groups: list[tuple[str, list[Field]]]) -> str:
    """Plain-text tables, one per (header, fields) group: ``path  type  default
    description``, one field a line (paths as given: ``--eval.context``)."""
    rows = [(f.path, f.type_name, _show(f.default), f.description)
            for _, fs in groups for f in fs]
    if not rows:
        return ""
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    w2 = min(max(len(r[2]) for r in rows), 24)
    lines: list[str] = []
    for header, fs in groups:
        lines += ([""] if lines else []) + [header]
        for f in fs:
            lines.append(f"  {f.path:<{w0}}  {f.type_name:<{w1}}  {_show(f.default):<{w2}}  "
                         f"{f.description}")
    return "\n".join(lines)


def _show(value: Any) -> str:
    s = repr(value)
    return s if len(s) <= 24 else s[:21] + "..."


def closest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """The candidates nearest to the dotted path ``name``: those ending with the same
    last components first (``config.eval.corpus`` -> ``eval.corpus``,
    ``config.window_size`` -> ``config.model.window_size``), then difflib's closest by
    whole path and by last component."""
    candidates = list(candidates)
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        tail = ".".join(parts[-k:])
        same = [c for c in candidates if (c == tail or c.endswith("." + tail)) and c != name]
        if same:
            return same[:n]

    def score(c: str) -> float:
        whole = difflib.SequenceMatcher(None, name, c).ratio()
        last = difflib.SequenceMatcher(None, parts[-1], c.rsplit(".", 1)[-1]).ratio()
        return max(whole, last)

    scored = sorted(((score(c), c) for c in candidates), reverse=True)
    if not scored or scored[0][0] < 0.6:
        return []
    best = scored[0][0]
    return [c for s, c in scored if s >= max(0.6, best - 0.08)][:n]


def unknown_field_message(name: str, candidates: Iterable[str], list_hint: str = "") -> str:
    """One line: ``--name`` is not a field, the closest valid ones, where to see them all."""
    near = closest(name, candidates)
    hint = (f"; did you mean {' or '.join('--' + c for c in near)}?" if near
            else "; no field is close")
    return f"unknown field --{name}{hint}{list_hint}"
