"""Smoke test of the real entry point with a shrunk config, and its JSON keys."""

import json
import subprocess
import sys

import numpy as np
import pytest

REQUIRED = ["generated_text", "prompt_tokens", "new_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s", "kv_cache_bytes_per_batch", "kv_cache_bytes_per_sequence",
            "kv_cache_bytes_theory_per_batch",
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
                          "--config.measure_repeats=2", "--config.model.key_layout=BKSH",
                          "--config.model.value_layout=BKHS")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cache layout: k BKSH, v BKHS" in proc.stdout
    result = json.loads(out.read_text())
    assert all(k in result for k in REQUIRED)
    # 2 layers x 8 KV heads x (64+64) x 4 bytes x 64 slots.
    assert result["kv_cache_bytes_per_batch"] == result["kv_cache_bytes_theory_per_batch"] \
        == result["kv_cache_bytes_per_sequence"] == 2 * 8 * 128 * 4 * 64
    assert result["new_tokens"] == 4
    assert "XLA/theory" in proc.stdout


@pytest.mark.slow
def test_decode_entry_point_real_model_paris(tmp_path):
    """Raw completion (the chat template off) of "The capital of France is"."""
    proc, out = run_entry(tmp_path, "--config=configs/gqa.py", "--config.max_new_tokens=3",
                          "--config.max_seq_len=32", "--config.measure_repeats=2",
                          "--config.chat_template=False",
                          "--config.prompt=The capital of France is")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["generated_text"].startswith(" Paris.") and not result["chat_template"]


@pytest.mark.slow
def test_decode_entry_point_chat_model_answers(tmp_path):
    """The issue's command: SmolLM2-Instruct through its own chat template (on by default)."""
    proc, out = run_entry(tmp_path, "--config=configs/gqa.py",
                          "--config.prompt=What is the capital of France?",
                          "--config.measure_repeats=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["chat_template"] and "Paris" in result["generated_text"]
    assert result["prompt"].endswith("What is the capital of France?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert result["new_tokens"] > 0 and "warning" not in proc.stderr


def test_bad_override_fails_fast_with_the_field_named(tmp_path):
    proc, _ = run_entry(tmp_path, "--config=configs/gqa.py", "--config.model.num_kv_heads=4")
    assert proc.returncode == 2
    assert "model.num_kv_heads=4; allowed: a divisor of model.num_heads=9" in proc.stderr


def test_bad_cache_layout_override_fails_fast(tmp_path):
    proc, _ = run_entry(tmp_path, "--config=configs/gqa.py", "--config.model.key_layout=BSKH")
    assert proc.returncode == 2
    assert "model.key_layout='BSKH'; allowed: one of ['auto', 'BKSH', 'BKHS']" in proc.stderr


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
    # On CPU every step is paired with a probe read: a fraction and its bandwidth per point.
    assert all(0 < p["fraction_of_roofline"] and p["roofline_bytes_per_s"] > 1e8
               for p in points.values())
    flat = result["summary"]["blog/window/scan=False/t512_over_t256"]
    assert 0.5 < flat["interleaved"] < 2  # the same W=512 slots: equal within noise
    assert (tmp_path / "bench_step_time.png").stat().st_size > 0
    assert result["device"].startswith("CPU: ") and "(id 0)" not in result["device"]


def test_bench_crossover_fit_is_robust_to_one_outlier():
    from experiments.bench import fit_crossover
    t = [1024, 4096, 16384, 32768, 65536]
    a, b = 0.012, 3e-6  # weights 12 ms, KV 3 us/token: t* = 4,000
    clean = [a + b * x for x in t]
    assert fit_crossover(t, clean) == pytest.approx(4000, rel=1e-9)
    noisy = list(clean)
    noisy[-1] *= 2.5  # one slow point (a shared CPU): least squares gives a negative t*
    assert np.polyfit(t, noisy, 1)[1] < 0
    assert fit_crossover(t, noisy) == pytest.approx(4000, rel=0.05)
    assert fit_crossover([1, 2], [2.0, 1.0]) == float("inf")  # slope <= 0: no crossover
    with pytest.raises(ValueError, match="contexts=\\[5, 5\\]"):
        fit_crossover([5, 5], [1.0, 2.0])


@pytest.mark.slow
def test_decode_entry_point_chunked_prefill_same_text(tmp_path):
    """--config.prefill_chunk feeds the prompt 4 tokens at a time: same continuation as
    the one-pass prefill, and the report gives each chunk program's temp bytes."""
    args = ["--config=configs/gqa.py", "--config.max_new_tokens=3",
            "--config.max_seq_len=32", "--config.measure_repeats=1"]
    one, out_one = run_entry(tmp_path, *args)
    assert one.returncode == 0, one.stderr[-3000:]
    (tmp_path / "chunked").mkdir()
    chunked, out_chunked = run_entry(tmp_path / "chunked", *args, "--config.prefill_chunk=4")
    assert chunked.returncode == 0, chunked.stderr[-3000:]
    assert "prefill in chunks of --config.prefill_chunk tokens" in chunked.stdout
    a, b = json.loads(out_one.read_text()), json.loads(out_chunked.read_text())
    assert b["generated_ids"] == a["generated_ids"]
    assert " Paris" in b["generated_text"]
    assert len(b["prefill_chunk_temp_bytes"]) == 2   # chunks of 4 and the remainder
