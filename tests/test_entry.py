"""Every entry point (``python -m experiments.*``) run as a subprocess, with shrunk configs:
decode (its JSON keys, fast failures, the memory check), bench, costs, ppl's flags,
compare, ablate and uptrain. Tests marked ``slow`` need the SmolLM2 weights or tokenizer."""

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from configs import blog
from kvjax import fields
from kvjax.config import run_config_from_dict
from kvjax.inference import memory
from kvjax.training import evaluate
from tests.conftest import import_entry_point

REQUIRED = ["generated_text", "prompt_tokens", "new_tokens", "prefill_tokens_per_s",
            "decode_tokens_per_s", "kv_cache_bytes_per_batch", "kv_cache_bytes_per_sequence",
            "kv_cache_bytes_theory_per_batch",
            "xla_flops_per_step", "xla_bytes_per_step", "theory_flops_per_step",
            "theory_bytes_per_step"]


def run_entry(tmp_path, *args, env=None):
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.decode", *args, f"--json_out={out}"],
        capture_output=True, text=True, timeout=600, env=env)
    return proc, out


# README lines of experiments.decode that the tests below run (the main job as written,
# on the real weights; the others with their own shrunk flags), so that
# tests/test_readme_commands.py does not run them a second time, shrunk.
README_MAIN = "python -m experiments.decode --config=configs/gqa.py"
README_BLOG = "python -m experiments.decode --config=configs/blog.py"
README_MESH = "python -m experiments.decode --config=configs/gqa.py --config.mesh.model=3"
README_LINES_RUN_HERE = (README_MAIN, README_BLOG, README_MESH)


def readme_line(line: str) -> tuple[dict, list[str]]:
    """(environment, arguments after ``python -m experiments.decode``) of the README
    line ``line`` (tests/test_readme_commands.py reads the README); fails if the README
    lacks it."""
    from tests.test_readme_commands import readme_commands  # noqa: PLC0415
    found = [(env, argv) for env, argv in readme_commands() if " ".join(argv) == line]
    assert found, f"README.md has no line {line!r}"
    env, argv = found[0]
    return {**os.environ, **env}, argv[3:]


@pytest.mark.slow
def test_decode_entry_point_blog_shrunk(tmp_path):
    """The README's configs/blog.py line, shrunk, with the cache layouts forced."""
    env, argv = readme_line(README_BLOG)
    proc, out = run_entry(tmp_path, *argv, "--config.model.num_layers=2",
                          "--config.max_new_tokens=4", "--config.max_seq_len=64",
                          "--config.measure_repeats=2", "--config.model.key_layout=BKSH",
                          "--config.model.value_layout=BKHS", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cache layout: k BKSH, v BKHS" in proc.stdout
    result = json.loads(out.read_text())
    assert all(k in result for k in REQUIRED)
    # 2 layers x 8 KV heads x (64+64) x 4 bytes x 64 slots.
    assert result["kv_cache_bytes_per_batch"] == result["kv_cache_bytes_theory_per_batch"] \
        == result["kv_cache_bytes_per_sequence"] == 2 * 8 * 128 * 4 * 64
    assert result["new_tokens"] == 4
    assert "XLA/theory" in proc.stdout
    # the counted figure puts the native kernels back beside XLA's own (issue 32, item 13)
    for what in ("token", "step"):
        assert result[f"counted_bytes_per_{what}"] >= result[f"xla_bytes_per_{what}"] > 0
        assert result[f"counted_flops_per_{what}"] >= result[f"xla_flops_per_{what}"] > 0
    if not result["kernel_custom_calls"]:
        assert result["counted_bytes_per_token"] == result["xla_bytes_per_token"]
    assert "plan" in result["model"]  # the resolved plan is saved with the run


PARIS_ARGS = ["--config=configs/gqa.py", "--config.max_new_tokens=3",
              "--config.max_seq_len=32", "--config.measure_repeats=1",
              "--config.chat_template=False", "--config.prompt=The capital of France is",
              "--config.cost_context=64"]


@pytest.fixture(scope="module")
def paris_run(tmp_path_factory):
    """(process, JSON result) of the main job on SmolLM2, raw completion of "The capital
    of France is": run once, read by the tests below (each entry run costs ~45 s)."""
    tmp = tmp_path_factory.mktemp("paris")
    proc, out = run_entry(tmp, *PARIS_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow
def test_decode_entry_point_real_model_paris(paris_run):
    """Raw completion (the chat template off) of "The capital of France is"."""
    _, result = paris_run
    assert result["generated_text"].startswith(" Paris.") and not result["chat_template"]
    # --config.cost_context sets the long context; the run's own stays max_seq_len
    assert result["cost_context"] == 32 and result["long_context"]["context"] == 64
    assert result["long_context"]["source"] == "--config.cost_context"
    assert result["long_context"]["kv_share_of_step_bytes"] > result["kv_share_of_step_bytes"]


@pytest.mark.slow
def test_decode_entry_point_chat_model_answers(tmp_path):
    """The issue's command, the README's first decode line as written (one timed
    repeat): SmolLM2-Instruct through its own chat template (on by default), the default
    prompt "What is the capital of France?"."""
    env, argv = readme_line(README_MAIN)
    proc, out = run_entry(tmp_path, *argv, "--config.measure_repeats=1", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["chat_template"] and "Paris" in result["generated_text"]
    assert result["prompt"].endswith("What is the capital of France?<|im_end|>\n"
                                     "<|im_start|>assistant\n")
    assert result["new_tokens"] > 0 and "warning" not in proc.stderr
    # the blog's claim by default (issue 57): the KV share of a step's bytes at the run's
    # context and at the checkpoint's trained context, GQA against MHA there
    lc = result["long_context"]
    assert lc["context"] == 8192 and lc["source"] == "the checkpoint's trained context"
    assert result["kv_share_of_step_bytes"] < 0.05 < 0.4 < lc["kv_share_of_step_bytes"] < 0.5
    assert lc["lever"]["theory_bytes_ratio"] == pytest.approx(
        lc["lever"]["baseline_theory_bytes_per_step"] / lc["theory_bytes_per_step"])
    assert lc["step_seconds_median"] > 0 and lc["counted_bytes_per_step"] > 0
    assert "the bottleneck (blog 'The crossover')" in proc.stdout


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
         "--contexts=256,512", "--repeats=1", "--peers=", "--peer_contexts=",  # no peer
         f"--out_dir={tmp_path}"],
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
    # The ratio itself is a timing (the benchmark prints it; no timed assertion here): the
    # summary must carry a finite, positive interleaved ratio for the window's flatness.
    assert math.isfinite(flat["interleaved"]) and flat["interleaved"] > 0
    assert (tmp_path / "bench_step_time.png").stat().st_size > 0
    assert result["device"].startswith("CPU: ") and "(id 0)" not in result["device"]


@pytest.mark.parametrize("decode_attention,weight_matmul", [
    ("native", "native_lanes"), ("xla_cache_left", "native_ksplit"), ("xla", "native")])
def test_bench_times_every_forced_formulation(decode_attention, weight_matmul):
    """Every value --decode_attention and --weight_matmul offer on CPU runs through a
    timed point and the interleaved speedup over MHA, which compiled its steps without a
    plan and so refused a forced 'native' before (a 2-layer blog model, t = 256)."""
    from kvjax import presets
    bench = import_entry_point("bench")
    base = presets.blog_model("float32", vocab_size=512).replace(
        num_layers=2, decode_attention=decode_attention, weight_matmul=weight_matmul)
    mha, gqa = (presets.variant(base, num_kv_heads=k, name=f"blog-{k}") for k in (8, 2))
    seconds, _, _ = bench.time_point(gqa, 256, 1)
    ratio = bench.interleaved_ratio((mha, 256), (gqa, 256), 1)
    assert seconds > 0 and math.isfinite(ratio) and ratio > 0


def test_interleaved_rounds_rotate_the_order_and_drop_the_warmup():
    """Each round calls every arm once, starting one arm later than the round before
    (each arm first equally often); the warm-up rounds' seconds are dropped, and the
    probe hook runs before each timed round only; no arm or no round is refused."""
    bench = import_entry_point("bench")
    calls, probes = [], []
    arms = {n: (lambda n=n: calls.append(n) or float(len(calls))) for n in "abc"}
    out = bench.interleaved_rounds(arms, 6, warmup=2, before_round=lambda: probes.append(1))
    rounds = [calls[i:i + 3] for i in range(0, len(calls), 3)]
    assert len(rounds) == 8 and all(sorted(r) == list("abc") for r in rounds)
    assert [r[0] for r in rounds] == list("abcabcab")
    assert len(probes) == 6 and all(len(v) == 6 for v in out.values())
    assert (out["c"][0], out["a"][0]) == (7.0, 8.0)  # round 3, the first timed: c, a, b
    for bad in (({}, 3), (arms, 0)):
        with pytest.raises(ValueError, match="allowed: at least one arm, rounds >= 1"):
            bench.interleaved_rounds(*bad)


def test_interleaved_rounds_time_blocks_of_back_to_back_calls():
    """With block and settle, each arm runs its settle untimed calls and then its block of
    timed calls before the next arm starts (every timed call follows a call of its own
    arm), and the round's seconds are the block's median; bad sizes are refused."""
    bench = import_entry_point("bench")
    calls = []
    arms = {n: (lambda n=n: calls.append(n) or float(len(calls))) for n in "ab"}
    out = bench.interleaved_rounds(arms, 2, warmup=1, block=3, settle=1)
    # rounds of 8 calls: a a a a b b b b, then b first, then a first
    assert "".join(calls) == "aaaabbbb" + "bbbbaaaa" + "aaaabbbb"
    # the first timed round: b's timed calls are calls 10-12, a's 14-16; then a's 18-20
    assert out == {"b": [11.0, 23.0], "a": [15.0, 19.0]}
    for bad in (dict(block=0), dict(settle=-1)):
        with pytest.raises(ValueError, match="block >= 1, settle >= 0"):
            bench.interleaved_rounds(arms, 2, **bad)


def test_llamacpp_rows_time_kvjax_and_the_peer_in_the_same_rounds(monkeypatch):
    """The llama.cpp rows time kvjax's step and both llama.cpp files round by round (fake
    steps here: llama.cpp is optional), each in blocks of back-to-back steps after an
    untimed one: medians, the median of the rounds' kvjax over llama.cpp f32 ratios and
    the rounds kvjax won come from the same rounds, the untimed steps count nowhere, and
    the fractions use the probe read before each round."""
    from kvjax import checkpoints
    bench = import_entry_point("bench")
    # per round: one untimed step (99 ms), then a block of two timed ones
    block = lambda ms: [99, ms, ms]  # noqa: E731
    seq = {"kvjax": iter(sum(map(block, [10, 10, 30, 10, 10, 30]), [])),
           "f32": iter(block(20) * 6), "q4": iter(block(5) * 6)}
    fake = lambda name: (lambda: next(seq[name]) / 1e3)  # noqa: E731
    monkeypatch.setattr(checkpoints, "weights_path", lambda progress: "/x/model.Q4.gguf")
    monkeypatch.setattr(bench.peers, "dense_gguf", lambda path: "/x/model.F32.gguf")
    monkeypatch.setattr(bench.peers, "llamacpp_stepper",
                        lambda path, t, kv_type="f16": fake("f32" if "F32" in path else "q4"))
    monkeypatch.setattr(bench.peers, "llamacpp_step_bytes", lambda path, cfg, t, kv_bytes=2: 1e9)
    monkeypatch.setattr(bench, "step_runner", lambda cfg, t: fake("kvjax"))

    class Probe:
        def once(self):
            return 25e9
    rows = bench.llamacpp_rows([1024, 16384], "float32", False, 5, Probe(), None, block=2,
                               settle=1)
    assert len(rows) == 1  # contexts above 8,192 are left out
    row = rows[0]
    # round 0 is the warm-up: kvjax 10, 30, 10, 10, 30 ms against llama.cpp f32's 20 ms
    assert row["kvjax_ms"] == pytest.approx(10) and row["llamacpp_f32_ms"] == pytest.approx(20)
    assert row["kvjax_over_llamacpp_f32"] == pytest.approx(2.0)
    assert (row["rounds"], row["rounds_kvjax_faster_f32"]) == (5, 3)
    assert (row["block"], row["settle"]) == (2, 1)
    assert row["roofline_bytes_per_s"] == 25e9
    assert row["llamacpp_f32_fraction_of_roofline"] == pytest.approx(1e9 / 0.02 / 25e9)


def test_bench_refuses_a_formulation_this_backend_lacks_before_any_work(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--models=blog", "--variants=gqa",
         "--contexts=256", "--peers=", f"--out_dir={tmp_path}", "--decode_attention=pallas"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    # the registry's refusal: the value, why it cannot run here, and what can
    assert "model.decode_attention='pallas' cannot run here (backend 'cpu'" in proc.stderr
    assert ("allowed here: ['auto', 'xla', 'xla_cache_left', 'native', 'native_blocks']"
            in proc.stderr)
    assert "Traceback" not in proc.stderr and "device:" not in proc.stdout


@pytest.mark.parametrize("flag, message", [
    ("--models=llama", "--models=llama; allowed: a non-empty subset of blog,smollm2"),
    ("--models=", "--models=; allowed: a non-empty subset"),
    ("--variants=mla", "--variants=mla; allowed: a non-empty subset of mha,gqa,mqa,window"),
    ("--contexts=1k", "--contexts=1k; allowed: integers >= 1"),
    ("--contexts=\u00b2", "--contexts=\u00b2; allowed: integers >= 1"),  # isdigit(), not int()
    ("--peer_contexts=0", "--peer_contexts=0; allowed: integers >= 1"),
    ("--peers=vllm", "--peers=vllm; allowed: a subset of flax,torch,llamacpp"),
    ("--repeats=0", "--repeats=0; allowed: an integer >= 1"),
])
def test_bench_refuses_bad_flags_before_any_work(flag, message, tmp_path):
    """A model name outside blog/smollm2 ran as SmolLM2 before, and a bad variant or
    context ended in a traceback."""
    proc = subprocess.run([sys.executable, "-m", "experiments.bench", flag,
                           f"--out_dir={tmp_path}"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"error: {message}" in proc.stderr
    assert "Traceback" not in proc.stderr and "device:" not in proc.stdout


def test_bench_variant_cfg_refuses_other_models_and_variants():
    from kvjax.config import ConfigError
    bench = import_entry_point("bench")
    with pytest.raises(ConfigError, match="model='gpt2'; allowed: blog, smollm2"):
        bench.variant_cfg("gpt2", "gqa", "float32", False)
    with pytest.raises(ConfigError, match="variant='mla'; allowed: mha, gqa, mqa, window"):
        bench.variant_cfg("blog", "mla", "float32", False)
    assert bench.variant_cfg("smollm2", "gqa", "float32", False).num_kv_heads == 3


def test_bench_crossover_fit_is_robust_to_one_outlier():
    fit_crossover = import_entry_point("bench").fit_crossover
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
def test_decode_entry_point_chunked_prefill_same_text(tmp_path, paris_run):
    """--config.prefill_chunk feeds the prompt 4 tokens at a time: same continuation as
    the one-pass prefill (the Paris run), and the report gives each chunk program's temp
    bytes."""
    _, a = paris_run
    chunked, out_chunked = run_entry(tmp_path, *PARIS_ARGS, "--config.prefill_chunk=4")
    assert chunked.returncode == 0, chunked.stderr[-3000:]
    assert "prefill in chunks of --config.prefill_chunk tokens" in chunked.stdout
    assert "prefill in chunks" not in paris_run[0].stdout
    b = json.loads(out_chunked.read_text())
    assert b["generated_ids"] == a["generated_ids"]
    assert " Paris" in b["generated_text"]
    assert len(b["prefill_chunk_temp_bytes"]) == 2   # chunks of 4 and the remainder


@pytest.mark.slow
def test_decode_entry_point_on_a_mesh_same_tokens(tmp_path, paris_run):
    """The README's mesh line (its XLA_FLAGS too), shrunk to the Paris run's flags:
    SmolLM2 on a (1, 3, 1) mesh of 8 virtual CPU devices (N=9, K=3 split by 3) decodes
    the tokens of the one-device run (the Paris run) and prints the per-device cost
    report with the collectives, and no cache tensor is gathered."""
    env, argv = readme_line(README_MESH)
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert argv[0] == PARIS_ARGS[0]
    proc, out = run_entry(tmp_path, *argv, *PARIS_ARGS[1:], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "note: mesh (data, model, seq) = (1, 3, 1) uses 3 of the 8 cpu devices" in proc.stdout
    assert "mesh (data, model, seq) = (1, 3, 1)" in proc.stdout
    assert "all-reduce @ model" in proc.stdout
    result = json.loads(out.read_text())
    assert result["kv_cache_bytes_per_device"] * 3 == result["kv_cache_bytes"]
    assert result["mesh"]["cache_gathers"] == []
    assert all(p["cache_gathers"] == [] for p in result["programs"].values())
    # 30 layers x (o_proj + down) all-reduces over 'model' in the step (+1: embedding)
    assert result["mesh"]["inventory"]["all-reduce@model"]["count"] >= 60
    # one JSON shape on a mesh and on one device: the figures a run lacks are None
    assert set(result) == set(paris_run[1])
    assert result["loop"] is None and result["prefill_xla_flops"] is None
    assert paris_run[1]["mesh"] is None and paris_run[1]["programs"] is None
    assert result["batch_size"] == paris_run[1]["batch_size"] == 1
    # the one-device run of the same config
    assert result["generated_ids"] == paris_run[1]["generated_ids"]
    assert len(result["generated_ids"]) == 3


def test_decode_entry_point_refuses_a_mesh_larger_than_the_devices():
    """9 devices asked of 8: refused before any weight is loaded (fast, no tokenizer)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run([sys.executable, "-m", "experiments.decode", *TINY_FLAGS,
                           "--config.mesh.model=3", "--config.mesh.seq=3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "mesh data*model*seq = 1*3*3 = 9; allowed: at most the device count, 8" \
        in proc.stderr


# ------------------------------------------------------------------ the memory check


def decode_entry(*args):
    return subprocess.run([sys.executable, "-m", "experiments.decode", *args],
                          capture_output=True, text=True, timeout=300)


def test_entry_point_refuses_before_allocating():
    """13 TB of cache (B = 4,096, S = 65,536): exit 2 with the message, on any machine."""
    proc = decode_entry("--config=configs/blog.py", "--config.batch_size=4096",
                        "--config.max_seq_len=65536")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: memory check (decode): this run needs ~" in proc.stderr
    assert re.search(r"what fits: .*batch_size <= \d+ at max_seq_len=65,536", proc.stderr)


def test_the_issue_command_is_refused_where_it_cannot_fit():
    """The issue's command: a 51.5 GB float32 cache (used to be killed, exit 137)."""
    c = blog.get_config()
    c.batch_size, c.max_seq_len = 16, 65536
    run = run_config_from_dict(c)
    # KV 51,539,607,552 B + per-row bookkeeping (positions 4·B·S, lengths 4·B)
    assert memory.plan(run.model, 16, 65536).cache == 51_539_607_552 + 4 * 16 * 65536 + 4 * 16
    need = memory.plan(run.model, 16, 65536, weights_bytes=10**9).total
    if memory.available_bytes()[0] > need:
        pytest.skip("this machine has room for the 51.5 GB cache")
    proc = decode_entry("--config=configs/blog.py", "--config.batch_size=16",
                        "--config.max_seq_len=65536")
    assert proc.returncode == 2 and "memory check (decode)" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------ experiments.costs


def test_cost_sweep_entry_point_shrunk(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.costs", "--variants=mqa,gqa-window",
         "--contexts=512,1024", "--dtypes=float32", "--measure_contexts=512", "--repeats=2",
         "--table_contexts=512", "--plot_context=512", f"--out_dir={tmp_path}"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "costs.json").read_text())["rows"]
    assert [(r["variant"], r["context"]) for r in rows] == [
        ("mqa", 512), ("mqa", 1024), ("gqa-window", 512), ("gqa-window", 1024)]
    assert rows[0]["measured_s"] > 0 and np.isnan(rows[1]["measured_s"])
    win = rows[2:]  # one program (W = 512 slots) for both contexts
    assert win[0]["xla_bytes"] == win[1]["xla_bytes"]
    for r in rows:
        assert 0.9 <= r["bytes_ratio"] <= 1.3
        assert r["xla_kv_read"] == pytest.approx(r["theory_kv_read"], rel=0.01)
    table = (tmp_path / "table.txt").read_text()
    assert "gqa-window" in table and "1,024" not in table
    for name in ("costs.csv", "attribution_float32_t512.png", "kv_to_weights.png",
                 "roofline_float32.png", "step_bytes_float32.png"):
        assert (tmp_path / name).stat().st_size > 1000, name


# ------------------------------------------------------------------ flags, fields, compare


def entry(*args, module="experiments.ppl", timeout=120):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("arg, expected", [
    ("--config.model.window_sise=128",
     "unknown field --config.model.window_sise; did you mean --config.model.window_size?"),
    ("--config.eval.corpus=x.txt",
     "unknown field --config.eval.corpus; did you mean --eval.corpus?"),
    ("--eval.num_token=3", "unknown field --eval.num_token; did you mean --eval.num_tokens?"),
    ("--config=gqq", "config 'gqq': no such file; shipped configs: blog, blog_window,"),
    ("--eval.split=some", "eval.split='some'; allowed: 'heldout' or 'all'"),
    ("--eval.corpus=/nonexistent/t.txt", "eval.corpus='/nonexistent/t.txt': no such file"),
])
def test_bad_flags_fail_in_one_line_without_traceback(arg, expected):
    proc = entry("--config=configs/gqa.py", arg)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert first.startswith("error: ") and expected in first, proc.stderr


def test_list_fields_prints_every_field_with_type_default_and_description():
    proc = entry("--config=mla", "--list_fields")
    assert proc.returncode == 0, proc.stderr
    lines = {ln.split()[0]: ln for ln in proc.stdout.splitlines() if ln.startswith("  --")}
    assert "int  " in lines["--config.model.kv_lora_rank"]
    assert "512" in lines["--config.model.kv_lora_rank"]  # configs/mla.py's value
    assert "'heldout'" in lines["--eval.split"] and "'all'" in lines["--eval.split"]
    assert len([ln for ln in lines if "." in ln]) == len(
        fields.config_fields("eval", evaluate.eval_config_dict())) + len(
        [ln for ln in lines if ln.startswith("--config.")])
    # then the entry point's own flags
    assert lines["--json_out"].split()[1:3] == ["str", "None"]


@pytest.mark.slow
def test_compare_entry_point_on_your_own_text(tmp_path):
    """Two shrunk random-weight configs on a made-up file (needs the SmolLM2 tokenizer)."""
    text = tmp_path / "mine.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: the cache grows with the context. " * 8
                                for i in range(30)))
    out = tmp_path / "out"
    proc = entry("--configs=mha=blog,win=blog_window",
                 "--override=all:model.num_layers=1,max_new_tokens=4,max_seq_len=64",
                 "--override=win:model.window_size=16,model.num_sink_tokens=4",
                 f"--eval.corpus={text}", "--eval.split=all", "--eval.context=32",
                 "--eval.chunk=16", "--eval.num_tokens=128", "--repeats=2",
                 f"--out_dir={out}", f"--json_out={tmp_path / 'c.json'}",
                 module="experiments.compare", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "c.json").read_text())
    rows = {r["label"]: r for r in result["rows"]}
    assert rows["win"]["variant"] == "blog GQA K=2 W=16+4 sinks fp32"
    # 1 layer x K x (64 + 64) x 4 bytes per token; the window holds 16 slots of 32.
    assert rows["mha"]["kv_bytes_per_token"] == 8 * 128 * 4
    assert rows["mha"]["kv_cache_bytes_per_sequence"] == 8 * 128 * 4 * 32
    assert rows["win"]["kv_cache_bytes_per_sequence"] == 2 * 128 * 4 * 16
    assert all(r["tokens_scored"] == 4 * 31 and r["ppl"] > 1 and r["step_ms"] > 0
               for r in rows.values())
    assert result["settings"]["split"] == "all"
    for f in ("compare.txt", "compare.csv", "compare.png"):
        assert (out / f).stat().st_size > 0
    assert "W=16+4 sinks" in (out / "compare.txt").read_text()


# ------------------------------------------------------------------ ablate and uptrain


TINY_FLAGS = ["--config=configs/gqa.py", "--config.weights=random",
              "--config.model.num_layers=1", "--config.model.d_model=48",
              "--config.model.num_heads=6", "--config.model.head_dim=8",
              "--config.model.mlp_dim=32"]


def tiny_corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = ["cache", "key", "value", "token", "head", "layer", "the", "a", "reads", "of"]
    for i in range(30):
        (folder / f"d{i}.txt").write_text(" ".join(rng.choice(words, 300)))
    return folder


def test_pareto_plot_labels_do_not_overlap(tmp_path, monkeypatch):
    """Points of equal KV bytes and close perplexity (a window, its sinks variant, a
    quantized cache) used to stack their names: no two labels' boxes may intersect."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    ablate = import_entry_point("ablate")
    pts = [("kv heads", 5.6, 20.1), ("kv heads", 1.9, 21.0), ("kv heads", 0.63, 30.5),
           ("window", 2.8, 20.3), ("window", 1.4, 20.6), ("window+sinks", 1.4, 20.5),
           ("quantized", 1.45, 20.4), ("quantized", 2.9, 20.15), ("mla", 1.0, 25.0)]
    rows = [{"name": f"{lever} {i}", "lever": lever, "kv_bytes_theory": mib * 2**20,
             "ppl": ppl} for i, (lever, mib, ppl) in enumerate(pts)]
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to inspect it
    ablate.plot_pareto(rows, tmp_path / "p.png", 1024, "labels")
    fig = kept[0]
    fig.canvas.draw()
    boxes = [t.get_window_extent() for t in fig.axes[0].texts if t.get_text()]
    assert len(boxes) == len(rows)
    clashes = [(i, j) for i in range(len(boxes)) for j in range(i)
               if boxes[i].overlaps(boxes[j])]
    assert not clashes, [(rows[i]["name"], rows[j]["name"]) for i, j in clashes]
    plt.close(fig)


@pytest.mark.slow
def test_ablate_entry_point_writes_table_and_plots(tmp_path):
    """The real entry point on a shrunk random model and a made-up corpus (needs the
    SmolLM2 tokenizer, hence slow)."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "experiments.ablate", *TINY_FLAGS,
           f"--eval.corpus={tiny_corpus(tmp_path)}", "--eval.heldout_fraction=0.3",
           "--eval.context=16", "--eval.chunk=8", "--eval.num_tokens=64",
           "--kv_heads=6,3,1", "--windows=8,16", "--sinks=2", "--mla_ranks=8",
           "--uptrain_kv_heads=1", "--train.steps=2", "--train.warmup_steps=1",
           "--train.seq_len=16", "--calib_tokens=256", "--kv_dtypes=int8",
           "--mla_kv_dtypes=float8_e4m3fn", "--layer_windows=8", "--kv_compression=snapkv",
           "--kv_budgets=64", "--longctx_tasks=passkey", "--longctx_lengths=512",
           f"--out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "ablate.json").read_text())["rows"]
    names = [r["name"] for r in rows]
    # quantized rows: the GQA model, the best window with sinks (W=16 >= context is
    # the full-attention function, not scored), the best MLA conversion
    assert names == ["MHA K=6 (duplicated)", "GQA K=3 (original)", "MQA K=1 (mean-pooled)",
                     "W=8", "W=16", "W=8+2 sinks", "W=16+2 sinks", "layers 8", "MLA C=8",
                     "snapkv budget=64", "GQA K=3 (original) int8", "W=8+2 sinks int8", "MLA C=8 float8_e4m3fn",
                     "MQA K=1 + uptrain 2 steps"]
    by = {r["name"]: r for r in rows}
    assert by["MHA K=6 (duplicated)"]["ppl"] == pytest.approx(by["GQA K=3 (original)"]["ppl"],
                                                               rel=1e-5)
    assert by["W=16"]["same_as"] == "GQA K=3 (original)"
    for r in rows:  # every row has the long-context columns; lever 5 no perplexity
        assert r["longctx_length"] == 512 and r["longctx_samples"] == 1
        lo, hi = r["longctx_accuracy_ci"]
        assert lo <= r["longctx_accuracy"] <= hi
        assert r["beyond_trained_context"] is False  # random weights: no trained context
        if r["lever"] == "compression":
            assert r.get("ppl") is None and r["kv_budget"] == 64
            continue
        assert r["kv_bytes_measured"] == r["kv_bytes_theory"] or r["window"] == 16
        quantized = r["lever"] == "quantized"
        assert r["check_rel_diff"] is None or r["check_rel_diff"] < (0.05 if quantized
                                                                     else 1e-4)
        if quantized:  # scales counted: int8 on H=8 rows is (8 + 4) / (8 * 4) of float32
            src = by[r["quantized_from"]]
            assert r["ppl_vs_float32"] == pytest.approx(r["ppl"] / src["ppl"])
            assert 0.9 < r["ppl_vs_float32"] < 1.1
            if r["kv_dtype"] == "int8" and r["kv_heads"]:
                assert r["kv_bytes_per_token"] * 32 == src["kv_bytes_per_token"] * 12
    assert (out / "pareto.png").stat().st_size > 0 and (out / "uptrain_loss.png").is_file()
    assert "Pareto front" in proc.stdout and "long-context accuracy [95% CI]" in proc.stdout


@pytest.mark.slow
def test_uptrain_entry_point_trains_and_scores(tmp_path):
    """experiments.uptrain on a shrunk random model (needs the SmolLM2 tokenizer)."""
    corpus = tiny_corpus(tmp_path)
    cmd = [sys.executable, "-m", "experiments.uptrain", *TINY_FLAGS,
           "--config.model.num_kv_heads=1", "--config.model.attention=mqa",
           f"--eval.corpus={corpus}", "--eval.heldout_fraction=0.3", "--eval.context=16",
           "--eval.chunk=8", "--eval.num_tokens=32", "--train.steps=3",
           "--train.warmup_steps=1", "--train.seq_len=16", "--train.checkpoint_every=1",
           f"--workdir={tmp_path / 'w'}"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "after 3 steps: perplexity" in first.stdout
    assert (tmp_path / "w" / "loss_curve.png").is_file()
    assert (tmp_path / "w" / "checkpoints" / "3").is_dir()  # resuming: see the test above


@pytest.mark.parametrize("module, args, message", [
    ("prefill", ["--contexts=4096", "--max_seq_len=128"],
     "--max_seq_len=128; allowed: at least the largest --contexts value, 4096"),
    ("prefill", ["--contexts=0"], "--contexts=0; allowed: positive integers"),
    ("prefill", ["--impls=bogus"], "--impls: invalid config: model.prefill_impl='bogus'"),
    ("shard", ["--layers=-1"], "--layers=-1; allowed: 0 (all layers) or a positive number"),
    ("shard", ["--models=blog,foo"], "--models=blog,foo: preset 'foo': unknown; allowed: ["),
    ("shard", ["--devices=0"], "--devices=0; allowed: at least 8"),
])
def test_sweeps_refuse_bad_flags_before_compiling(module, args, message):
    """experiments.prefill and experiments.shard: a bad flag ends the run before any
    compile, with the flag, its value and what is allowed, and no traceback."""
    proc = subprocess.run([sys.executable, "-m", f"experiments.{module}", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_decode_report_never_prints_a_negative_fixed_cost():
    """The loop's fixed cost is t(n1) - n1 x per-token, two noisy medians apart: a
    negative estimate (a tester's int4 run printed -32.7 ms) is reported as noise, with no
    figure (issue 32 item 17: a negative cost is not printed as one)."""
    line = import_entry_point("decode")._loop_timing_line
    assert "fixed cost, 1.4 ms, cancels" in line({"steps": (4, 20), "call_overhead_s": 0.0014})
    neg = line({"steps": (4, 20), "call_overhead_s": -0.0327})
    assert "below the timing noise" in neg and "32.7" not in neg and "-" not in neg


@pytest.mark.slow
def test_decode_first_screen_says_what_each_figure_includes(paris_run):
    """Issue 32 item 17 on the main job's screen: no negative time is printed, each of the
    two decode speeds says what it includes, and each cost table's first row is the
    counted figure (with native kernels: the '(+kernels)' rows, XLA's own rows named
    'XLA ops only')."""
    out = paris_run[0].stdout
    assert not re.search(r"-\d[\d.,]* ms\b", out), out
    decode_line = next(ln for ln in out.splitlines() if ln.startswith("prefill ")
                       and " tokens/s end to end " in ln)
    assert "fixed cost included" in decode_line
    loop_line = next(ln for ln in out.splitlines()
                     if ln.startswith("measured: ") and "per generated token" in ln)
    assert "tokens/s (timed inside the compiled loop: the call's fixed cost cancels)" \
        in loop_line
    step_line = next(ln for ln in out.splitlines()
                     if ln.startswith("measured: ") and "per decode_step" in ln)
    assert "dispatch and return included" in step_line
    lines = out.splitlines()
    tables = 0
    for i, ln in enumerate(lines):
        if ln.startswith("-----") and lines[i - 1].lstrip().startswith("per "):
            rows = [r.strip() for r in lines[i + 1:i + 5]
                    if r.strip().startswith(("FLOP", "bytes"))]
            names = [re.split(r"\s{2,}", r)[0] for r in rows]
            if any("(+kernels)" in n for n in names):
                assert "(+kernels)" in names[0], names
                assert all("(+kernels)" in n or "(XLA ops only)" in n for n in names), names
            else:
                assert names[:2] == ["FLOP", "bytes"], names
            tables += 1
    assert tables == 3  # the loop, the single step, the prefill
