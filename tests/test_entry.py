"""Smoke test of the real entry point with a shrunk config, and its JSON keys."""

import json
import subprocess
import sys

import pytest

REQUIRED = ["generated_text", "prompt_tokens", "new_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s", "kv_cache_bytes", "kv_cache_bytes_theory",
            "xla_flops_per_step", "xla_bytes_per_step", "theory_flops_per_step",
            "theory_bytes_per_step"]


def run_entry(tmp_path, *args):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.decode", *args, f"--json_out={out}"],
        capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.slow
def test_decode_entry_point_blog_shrunk(tmp_path):
    proc, out = run_entry(tmp_path, "--config=configs/blog.py", "--config.model.num_layers=2",
                          "--config.max_new_tokens=4", "--config.max_seq_len=64",
                          "--config.measure_repeats=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(k in result for k in REQUIRED)
    # 2 layers x 8 KV heads x (64+64) x 4 bytes x 64 slots.
    assert result["kv_cache_bytes"] == result["kv_cache_bytes_theory"] == 2 * 8 * 128 * 4 * 64
    assert result["new_tokens"] == 4
    assert "XLA/theory" in proc.stdout


@pytest.mark.slow
def test_decode_entry_point_real_model_paris(tmp_path):
    proc, out = run_entry(tmp_path, "--config=configs/gqa.py", "--config.max_new_tokens=3",
                          "--config.max_seq_len=32", "--config.measure_repeats=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert " Paris" in json.loads(out.read_text())["generated_text"]


def test_bad_override_fails_fast_with_the_field_named(tmp_path):
    proc, _ = run_entry(tmp_path, "--config=configs/gqa.py", "--config.model.num_kv_heads=4")
    assert proc.returncode == 2
    assert "model.num_kv_heads=4; allowed: a divisor of model.num_heads=9" in proc.stderr


def test_prompt_longer_than_cache_fails_before_compiling(tmp_path):
    proc, _ = run_entry(tmp_path, "--config=configs/blog.py", "--config.max_seq_len=8",
                        "--config.max_new_tokens=4")
    assert proc.returncode == 2
    assert "max_seq_len=8; allowed: at least prompt tokens" in proc.stderr


def test_bench_entry_point_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--models=blog", "--variants=mha,window",
         "--contexts=256,512", "--repeats=1", "--peers=", f"--out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    points = {(p["variant"], p["context"]): p for p in result["points"]}
    assert set(points) == {("mha", 256), ("mha", 512), ("window", 256), ("window", 512)}
    # Theory bytes: the window's step reads the same W=512 slots at either context.
    assert points[("window", 256)]["theory_bytes"] < points[("mha", 512)]["theory_bytes"]
    assert all(p["seconds"] > 0 for p in points.values())
    assert (tmp_path / "bench_step_time.png").stat().st_size > 0
