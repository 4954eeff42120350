"""The measurement scripts under scripts/: bad flags refused before any work, and a
shrunk run whose printed table is consistent with itself."""

import os
import re
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
    ("--batch_sizes=257", "--batch_sizes=257; allowed: integers 1..256"),
    ("--k=8", "is 14564 copies; allowed: at most 1024"),  # 256 MiB of [8, 576] weights
])
def test_overlap_check_refuses_bad_flags(flag, message):
    proc = _script("overlap_check.py", flag)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "machine:" not in proc.stdout  # refused before any work


def test_overlap_check_table_follows_its_models():
    """Shrunk: [64, 128] weights, M = 1 and 3. Every row's min(C, R) and serial columns
    are the two models of its own C and R, and the ratios are D over them (to the
    printed 3 significant digits); a formulation that runs as another is not timed
    twice but named as such."""
    proc = _script("overlap_check.py", "--batch_sizes=1,3", "--impls=xla,native_ksplit,native",
                   "--k=64", "--n=128", "--reps=4", "--stream_mib=1", "--rounds=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("machine: ")
    lines = [ln.split() for ln in proc.stdout.splitlines()]
    rows = [r for r in lines if len(r) == 9 and r[0] in ("xla", "native", "native_ksplit")
            and r[2] != "runs"]
    assert [(r[0], r[1]) for r in rows] == [("xla", "1"), ("native", "1"), ("xla", "3"),
                                            ("native_ksplit", "3"), ("native", "3")]
    assert ["native_ksplit", "1", "runs", "as", "native"] in [r[:5] for r in lines]
    for r in rows:
        c, rd, d, lo, serial, d_serial, d_lo = map(float, r[2:])
        assert min(c, rd) == pytest.approx(lo, rel=0.006)
        assert 1 / (1 / c + 1 / rd) == pytest.approx(serial, rel=0.012)
        assert d / serial == pytest.approx(d_serial, rel=0.02)
        assert d / lo == pytest.approx(d_lo, rel=0.02)
        assert c > 0 and rd > 0 and d > 0


@pytest.mark.parametrize("flag, message", [
    ("--impls=pallas", "--impls=pallas; allowed: a subset of"),
    ("--contexts=1", "--contexts=1; allowed: comma-separated integers >= 2"),
    ("--page_size=0", "--page_size=0; allowed: an integer >= 1"),
])
def test_paged_step_bench_refuses_bad_flags(flag, message):
    proc = _script("paged_step_bench.py", flag)
    assert proc.returncode != 0 and message in proc.stderr
    assert "machine:" not in proc.stdout  # refused before any work


def test_paged_step_bench_rows_are_consistent():
    """Shrunk (2 layers, t = 100, pages of 16 that do not divide it): one row per
    formulation, each ratio the printed paged over dense time, and the paged program's
    compiled bytes above the dense one's (the gather of the pages into a view)."""
    proc = _script("paged_step_bench.py", "--contexts=100", "--layers=2", "--impls=xla",
                   "--repeats=1", "--rounds=1")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines()
            if line.startswith("| 100 ")]
    assert len(rows) == 1
    _, impl, dense, pag, ratio, dense_mb, paged_mb, dense_th, paged_th, split, gbps = (
        c.strip() for c in rows[0])
    pages, tables_kb, view = (float(x.replace(",", "")) for x in split.split(" / "))
    assert view == pytest.approx(2 * pages, rel=0.01)  # the gathered view, written and read
    assert tables_kb == pytest.approx(4 * 7 * 2 / 1e3, abs=0.006)  # 7 pages, 2 layers
    assert float(paged_th.replace(",", "")) > float(dense_th.replace(",", "")) + view - 0.1
    assert impl == "xla (xla)"
    assert abs(float(pag) / float(dense) - float(ratio)) <= 0.011 + 0.06 * float(ratio)
    assert float(paged_mb.replace(",", "")) > float(dense_mb.replace(",", ""))


@pytest.mark.parametrize("flag", ["--queries=0", "--queries=a", "--queries="])
def test_decode_attention_bench_refuses_bad_queries(flag):
    proc = _script("decode_attention_bench.py", flag)
    assert proc.returncode != 0
    assert f"error: {flag}; allowed: integers >= 1" in proc.stderr
    assert "machine:" not in proc.stdout  # refused before any work


def test_decode_attention_bench_refuses_negative_layers():
    proc = _script("decode_attention_bench.py", "--layers=-1")
    assert proc.returncode != 0
    assert "error: --layers=-1; allowed: an integer >= 0" in proc.stderr
    assert "machine:" not in proc.stdout  # refused before any work


def test_decode_attention_bench_times_layers_in_one_program():
    """--layers=L prints, per shape, each formulation's GB/s over L layers' caches run in
    one program beside the per-call figure, each with its share of the run's read probe.
    Which is faster is the benchmark's figure, not asserted here (the test session even
    compiles at -O0, decision 0048)."""
    proc = _script("decode_attention_bench.py", "--models=blog", "--slots=512",
                   "--rounds=3", "--layers=2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    per_call = re.findall(r"^blog K=(\d) G=\d BK\w+/BK\w+: xla +([\d.]+) GB/s", proc.stdout,
                          re.M)
    in_prog = re.findall(r"^blog K=(\d) G=(\d) in one program of 2 layers: xla +([\d.]+) GB/s "
                         r"\( *(\d+)%\)", proc.stdout, re.M)
    assert [k for k, *_ in in_prog] == [k for k, _ in per_call] == ["8", "2", "1"]
    assert [int(k) * int(g) for k, g, *_ in in_prog] == [8, 8, 8]  # the blog's N = 8
    for (_, one), (*_, prog, share) in zip(per_call, in_prog):
        assert float(one) > 0 and float(prog) > 0 and int(share) >= 0
    # 2 layers of 512 slots (0.5-4 MiB): a line whose caches are under twice this CPU's
    # last-level cache says so, naming both sizes
    from kvjax.analysis import hardware
    llc = hardware.last_level_cache_bytes()
    lines = re.findall(r"^(blog K=(\d) G=\d in one program of 2 layers: .*)$", proc.stdout,
                       re.M)
    assert len(lines) == 3
    for line, k in lines:
        nbytes = 2 * int(k) * 512 * 128 * 4
        note = re.search(r" \(caches (\d+) MiB in all, under twice this CPU's (\d+) MiB "
                         r"last-level cache: partly cache reads; raise --layers\)$", line)
        assert (note is not None) == (nbytes < 2 * llc), line
        if note:
            assert note.groups() == (f"{nbytes / 2**20:.0f}", f"{llc / 2**20:.0f}")


@pytest.mark.parametrize("flag, message", [
    ("--slots=8", "--slots=8; allowed: an integer >= 16"),
    ("--rounds=0", "--rounds=0; allowed: an integer >= 1"),
    ("--models=gpt2", "--models=gpt2; allowed: a comma-separated subset of blog, smollm2"),
    ("--models=", "--models=; allowed: a comma-separated subset"),
])
@pytest.mark.parametrize("script", ["decode_attention_ab.py", "decode_attention_threads.py"])
def test_decode_attention_ab_refuses_bad_flags(script, flag, message):
    proc = _script(script, flag)
    assert proc.returncode != 0
    assert f"error: {message}" in proc.stderr
    assert not proc.stdout  # refused before any work


def test_decode_attention_ab_refuses_negative_layers():
    proc = _script("decode_attention_ab.py", "--layers=-1")
    assert proc.returncode != 0
    assert "error: --layers=-1; allowed: an integer >= 0 (0: one call)" in proc.stderr
    assert not proc.stdout  # refused before any work


@pytest.mark.skipif(subprocess.run(["git", "-C", ROOT, "cat-file", "-e", "6fb952d^{commit}"],
                                    capture_output=True).returncode != 0,
                    reason="a clone without the commit 6fb952d")
def test_decode_attention_ab_refuses_blocks_on_a_kernel_without_them():
    """6fb952d's kernel binds no ``blocks`` attribute: --blocks is refused before it is
    built, naming the commit and what is allowed."""
    proc = _script("decode_attention_ab.py", "--baseline=6fb952d", "--blocks")
    assert proc.returncode != 0
    assert ("error: --blocks with --baseline=6fb952d, whose kernel binds no 'blocks' "
            "attribute; allowed: a commit from 3e7df1b on") in proc.stderr
    assert "new/old" not in proc.stdout


@pytest.mark.parametrize("flag, message", [
    ("--budgets=0", "--budgets=0: invalid config: model.kv_budget=0"),
    ("--budgets=a", "--budgets=a:"),
    ("--budgets=32", "model.kv_budget=32; allowed: more than the 32 slots"),
    ("--only=steps", "--only=steps; allowed"),
    ("--rounds=0", "--rounds=0; allowed: an integer >= 1"),
    ("--only=pyramid --budgets=40", "model.kv_budget=40; allowed: a budget whose per-layer"),
    ("--methods=nope", "--methods=nope: ['nope']; allowed: a comma-separated subset of"),
    ("--every_n=3", "--every_n=3: every_n=3; allowed: a divisor of the 64 timed steps"),
    ("--every_n=0", "--every_n=0: invalid config: model.compression.every_n=0"),
    ("--page_size=0", "--page_size=0; allowed: an integer >= 1"),
])
def test_compression_figures_refuses_bad_flags(flag, message):
    proc = _script("compression_figures.py", *flag.split())
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "device:" not in proc.stdout  # refused before any work


@pytest.mark.parametrize("flag, message", [
    ("--configs=nope", "--configs=nope; allowed: names among"),
    ("--context=0", "--context=0; allowed: an integer >= 1"),
    ("--weight_matmul=fast", "--weight_matmul=fast; allowed: one of ['auto', 'xla'"),
    ("--decode_attention=fast", "--decode_attention=fast; allowed: one of ['auto'"),
    ("--compare=both", "--compare=both; allowed: one of ['fused', 'sums', 'norms']"),
])
def test_thunk_count_refuses_bad_flags(flag, message):
    proc = _script("thunk_count.py", flag)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_thunk_count_reads_the_entry_computation():
    """Counted: the ENTRY's instructions that run code, by opcode; not the free ones, not
    the instructions of fused computations."""
    from scripts.thunk_count import entry_ops

    hlo = """HloModule m
%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}
ENTRY %main (a: f32[4]) -> (f32[4], f32[4]) {
  %a = f32[4]{0} parameter(0)
  %c = f32[] constant(1)
  %f = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation
  %k = f32[4]{0} custom-call(%f), custom_call_target="kvjax_rows_matmul"
  %b = f32[2,2]{1,0} bitcast(%k)
  %y = f32[4]{0} copy(%k)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%y, %f)
}
"""
    assert dict(entry_ops(hlo)) == {"fusion": 1, "custom-call": 1, "copy": 1}


@pytest.mark.parametrize("flag, message", [
    ("--contexts=0", "--contexts=0; allowed: integers >= 1"),
    ("--repeats=0", "--repeats=0; allowed: an integer >= 1"),
    ("--models=llama", "--models=llama; allowed: a non-empty subset of blog,smollm2"),
    ("--variants=mla", "--variants=mla; allowed: a non-empty subset of mha,gqa,mqa,window"),
    ("--dtype=int3", "int3"),
])
def test_step_profile_refuses_bad_flags(flag, message):
    proc = _script("step_profile.py", flag)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr


def test_step_profile_prints_the_attention_and_products():
    """The blog model's step at a short context, XLA's products: a line per group, the
    tied LM head's dot reading its 49,152 x 512 float32 table (100.7 MB) and the row."""
    proc = _script("step_profile.py", "--models=blog", "--variants=gqa", "--contexts=64",
                   "--repeats=1", "--probe_reads=1", "--weight_matmul=xla",
                   "--decode_attention=xla")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "blog gqa t=64: step " in proc.stdout
    head = next(ln for ln in proc.stdout.splitlines() if "dot embed/embedding" in ln)
    assert head.split()[2] == "1" and "   100.7 " in head
    assert "dot layers_*/mlp/up" in proc.stdout
