"""The docs name only paths that exist, and the README stays a front door.

Scans README.md and every docs/**/*.md for repository paths (anything starting with
``kvjax/``, ``experiments/``, ``configs/``, ``scripts/``, ``tests/`` or ``docs/``, in
backticks or plain text) and fails listing each one that does not exist:

* trailing punctuation, a ``:line`` or ``:name`` suffix and a ``::test`` suffix are cut;
* a path ending in ``/`` must be a directory;
* a glob (``docs/results/*.md``) must match at least one path; a ``<placeholder>``
  segment (``configs/<c>.py``) counts as ``*``.

A path preceded by ``/``, ``~``, ``.`` or a word character is not a repository path
(``~/.cache/kvjax/native/``, ``../shared/...``, ``/tmp/...``) and is not matched.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PREFIXES = ("kvjax", "experiments", "configs", "scripts", "tests", "docs")
MAX_README_LINES = 200

# Paths the docs name that only exist once a command has run (outputs created at run
# time). Keep this list short and explicit; everything else must exist in the tree.
RUNTIME_OUTPUTS: frozenset[str] = frozenset()

_PATH = re.compile(
    r"(?<![\w/.~$-])"                          # not inside another path or word
    r"((?:" + "|".join(PREFIXES) + r")/"       # a repository prefix
    r"[A-Za-z0-9_.*?<>/:-]*)")                 # path characters, ':' suffixes included
_TRAILING = ".,;:)]'\"`!?"


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def paths_in(text: str) -> list[str]:
    """The repository paths named in ``text``, normalised, in order, without repeats."""
    found: list[str] = []
    for match in _PATH.finditer(text):
        path = match.group(1)
        path = path.split("::", 1)[0]          # tests/test_x.py::test_y
        path = path.split(":", 1)[0]           # kvjax/x.py:123, experiments/peers.py:dense_gguf
        path = path.rstrip(_TRAILING)
        if path.endswith("**") and not path.endswith("/**"):
            path = path[:-2].rstrip(_TRAILING)  # **bold kvjax/x.py**
        if path and path not in found:
            found.append(path)
    return found


def exists(path: str, root: Path = ROOT) -> bool:
    """Whether ``path`` names something in the repository (see the module docstring)."""
    pattern = re.sub(r"<[^<>/]*>", "*", path)
    if any(c in pattern for c in "*?["):
        return bool(glob.glob(os.path.join(str(root), pattern), recursive=True))
    full = root / pattern
    return full.is_dir() if pattern.endswith("/") else full.exists()


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """The paths named in ``text`` that do not exist under ``root``."""
    return [p for p in paths_in(text) if p not in RUNTIME_OUTPUTS and not exists(p, root)]


def test_docs_name_only_existing_paths():
    problems = []
    for doc in doc_files():
        for path in missing_paths(doc.read_text(encoding="utf-8")):
            problems.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not problems, "paths named in the docs that do not exist:\n" + "\n".join(problems)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}); move "
        "measurements to docs/results/ and design notes to docs/DESIGN.md")


MAX_HEADLINE_ROWS = 8
MAX_DESIGN_LINES = 300


def test_design_is_short():
    lines = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_DESIGN_LINES, (
        f"docs/DESIGN.md has {len(lines)} lines (at most {MAX_DESIGN_LINES}: the stable "
        "design; history goes in docs/decisions/, figures in docs/results/)")


def headline_rows(text: str) -> list[str]:
    """The table rows of the README's "## Headline figures" section (header excluded)."""
    section = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = [l for l in section.splitlines() if l.startswith("|")]
    return rows[2:]  # the header and its |---| line


def test_readme_keeps_at_most_eight_headline_rows():
    rows = headline_rows((ROOT / "README.md").read_text(encoding="utf-8"))
    assert 0 < len(rows) <= MAX_HEADLINE_ROWS, (
        f"README's headline table has {len(rows)} rows (1 to {MAX_HEADLINE_ROWS}: one "
        "per claim, its latest figure; the rest go in docs/results/)")


def test_headline_rows_counts_a_table():
    text = ("## Headline figures\n\nprose\n\n| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n"
            "\n## Next\n| x | y |\n")
    assert headline_rows(text) == ["| 1 | 2 |", "| 3 | 4 |"]


def test_scanner_flags_what_is_missing():
    text = (
        "See `kvjax/analysis/theory.py`, kvjax/no_such_module.py, and\n"
        "`tests/test_docs.py::test_readme_is_short`, `experiments/peers.py:12`,\n"
        "configs/<c>.py, docs/results/*.md, docs/results/*.nothing, scripts/ and\n"
        "kvjax/analysis.py/ (a file named as a folder), ~/.cache/kvjax/native/ and\n"
        "/tmp/kvjax/x.json (not repository paths), (experiments/bogus_entry.py), and\n"
        "**kvjax/config.py**.")
    assert paths_in(text) == [
        "kvjax/analysis/theory.py", "kvjax/no_such_module.py", "tests/test_docs.py",
        "experiments/peers.py", "configs/<c>.py", "docs/results/*.md",
        "docs/results/*.nothing", "scripts/", "kvjax/analysis.py/",
        "experiments/bogus_entry.py", "kvjax/config.py"]
    assert missing_paths(text) == [
        "kvjax/no_such_module.py", "docs/results/*.nothing", "kvjax/analysis.py/",
        "experiments/bogus_entry.py"]


def test_a_file_is_not_a_directory(tmp_path):
    (tmp_path / "kvjax").mkdir()
    (tmp_path / "kvjax" / "mod.py").write_text("")
    assert missing_paths("kvjax/mod.py kvjax/ kvjax/mod.py/", tmp_path) == ["kvjax/mod.py/"]
