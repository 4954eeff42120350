"""Writes tests/fast.txt, the fast test subset (``python -m pytest -q -m fast``), from the
per-test times of a full run (issue 57, item 7).

  python -m pytest -q --junitxml=/tmp/suite.xml          # the whole suite, once
  PYTHONPATH=. python scripts/fast_subset.py --junit=/tmp/suite.xml

Every test file that has a test which is not marked ``slow`` gets its ``--per_file`` (3)
fastest passing tests, plus :data:`ALSO` (``tests/conftest.py`` marks the listed node
ids ``fast``), so the subset executes every kvjax module but the one only an entry point
runs, at a small fraction of the suite's time. It
prints the subset's summed test time (one worker; a file's imports and compiles are
counted in its first test) against the whole run's. ``--coverage=FILE``: a
``coverage json`` report of a run of the subset (``coverage run -m pytest -m fast -n 0``,
then ``coverage json -o FILE``); the script then lists every ``kvjax/`` module the subset
never executes, and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fast.txt"
# Quick tests of the kvjax modules that no file's quickest tests execute (found with
# --coverage): the subset takes them too. kvjax/parallel/capacity.py is run only by
# experiments.shard (its README line runs shrunk, a slow test), so --coverage names it.
ALSO = ("tests/test_fields.py::test_blog_table_in_one_call_llama2_70b_on_h100_at_128k",)


def read_junit(path: str) -> list[tuple[str, float, bool]]:
    """(node id, seconds, passed) of every test case of a pytest junit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "")  # tests.test_cache or tests.test_x.TestClass
        parts = module.split(".")
        file_parts = [p for p in parts if not p[:1].isupper()]
        cls = [p for p in parts if p[:1].isupper()]
        node = "/".join(file_parts) + ".py::" + "::".join(cls + [case.get("name", "")])
        failed = any(child.tag in ("failure", "error", "skipped") for child in case)
        out.append((node, float(case.get("time", 0.0)), not failed))
    return out


def choose(cases: list[tuple[str, float, bool]], slow: set[str], per_file: int) -> list[str]:
    """Each file's ``per_file`` fastest passing tests that are not slow."""
    by_file = collections.defaultdict(list)
    for node, seconds, passed in cases:
        if passed and node not in slow:
            by_file[node.split("::")[0]].append((seconds, node))
    chosen = {n for f in by_file for _, n in sorted(by_file[f])[:per_file]}
    return sorted(chosen | set(ALSO))


def slow_ids() -> set[str]:
    """Node ids pytest collects under ``-m slow`` (a collection only, no test runs)."""
    import subprocess  # noqa: PLC0415
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow",
                           "-n", "0", "-p", "no:cacheprovider"], capture_output=True,
                          text=True, cwd=ROOT, check=True)
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def uncovered(report: str) -> list[str]:
    """kvjax/ modules with no executed line in a ``coverage json`` report."""
    files = json.loads(pathlib.Path(report).read_text())["files"]
    every = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvjax").rglob("*.py"))
    summary = {m: files.get(m, {}).get("summary", {}) for m in every}
    return [m for m in every if summary[m].get("covered_lines", 0) == 0
            and summary[m].get("num_statements", 1) > 0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", help="junit XML of a full pytest run")
    ap.add_argument("--per_file", type=int, default=3)
    ap.add_argument("--coverage", help="coverage json of a run of the subset")
    args = ap.parse_args()
    if args.per_file < 1:
        ap.error(f"--per_file={args.per_file}; allowed: an integer >= 1")
    if args.junit:
        cases = read_junit(args.junit)
        chosen = choose(cases, slow_ids(), args.per_file)
        OUT.write_text("".join(n + "\n" for n in chosen))
        times = {n: s for n, s, _ in cases}
        total, subset = sum(times.values()), sum(times[n] for n in chosen)
        print(f"{OUT.relative_to(ROOT)}: {len(chosen)} of {len(cases)} tests, "
              f"{len({n.split('::')[0] for n in chosen})} files; summed test time "
              f"{subset:.0f} s of {total:.0f} s ({subset / total:.1%})")
    if args.coverage:
        missing = uncovered(args.coverage)
        print("kvjax modules the subset never executes: " + (", ".join(missing) or "none"))
        return 1 if missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
