"""The measurement scripts under scripts/: bad flags refused before any work, and a
shrunk run whose printed table is consistent with itself."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script(name, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", name), *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("flag, message", [
    ("--batch_sizes=0", "--batch_sizes=0; allowed: integers 1..256"),
    ("--batch_sizes=a", "--batch_sizes=a; allowed: integers 1..256"),
    ("--impls=auto", "--impls=auto; allowed: a non-empty subset"),
    ("--stream_mib=0", "--stream_mib=0; allowed: an integer >= 1"),
])
def test_overlap_check_refuses_bad_flags(flag, message):
    proc = _script("overlap_check.py", flag)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "machine:" not in proc.stdout  # refused before any work


def test_overlap_check_table_follows_its_models():
    """Shrunk: [64, 128] weights, M = 1 and 3, 'xla' and 'native'. Every row's min(C, R)
    and serial columns are the two models of its own C and R, and the ratios are D over
    them (to the printed rounding)."""
    proc = _script("overlap_check.py", "--batch_sizes=1,3", "--impls=xla,native",
                   "--k=64", "--n=128", "--reps=4", "--stream_mib=1", "--rounds=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("machine: ")
    rows = [ln.split() for ln in proc.stdout.splitlines()
            if ln.split() and ln.split()[0] in ("xla", "native")]
    assert [(r[0], r[1]) for r in rows] == [("xla", "1"), ("native", "1"), ("xla", "3"),
                                            ("native", "3")]
    for r in rows:
        c, rd, d, lo, serial, d_serial, d_lo = map(float, r[2:])
        assert min(c, rd) == pytest.approx(lo, abs=0.051)
        assert 1 / (1 / c + 1 / rd) == pytest.approx(serial, abs=0.06)
        assert d / serial == pytest.approx(d_serial, rel=0.02, abs=0.006)
        assert d / lo == pytest.approx(d_lo, rel=0.02, abs=0.006)
        assert c > 0 and rd > 0 and d > 0
