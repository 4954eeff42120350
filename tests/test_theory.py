"""kvjax.theory / hardware / presets against the literal numbers of the blog
("The KV Bottleneck Explained"). Section names of the blog are quoted per test.

The blog writes "MB" for MiB: 72 MB = 75,497,472 B, 96 MB = 100,663,296 B, 3 GB at 128K =
3,145,728,000 B = 3,000 MiB, and "60 GB" free for caches behaves as 60,000 MiB.
"""

import math

import pytest

from kvjax import presets
from kvjax.analysis import hardware, theory
from kvjax.config import ModelConfig

A100 = hardware.CHIPS["A100-80GB"]
MiB = 2**20


@pytest.fixture
def blog():
    return presets.blog_model()


# ------------------------------------------------------------------ bytes per token


def test_blog_bytes_per_token(blog):
    # "Deriving the Per-Token KV Cache Formula": 24,576 bytes = 24 KB per token.
    assert theory.kv_bytes_per_token(blog) == 24_576
    assert theory.kv_bytes_per_token_blog(12, 512) == 24_576
    # per head per layer 256 B, per layer 2,048 B
    assert theory.kv_elements_per_token_per_layer(blog) * 2 // 8 == 256
    assert theory.kv_bytes_per_token(blog) // 12 == 2_048


def test_blog_head_layer_cache_and_short_context(blog):
    # "What fits where": 1 MB per head per layer at t=4,096; 12,582,912 B at t=512.
    assert theory.kv_cache_bytes(blog, 4096) // (8 * 12) == 1_048_576
    assert theory.kv_cache_bytes(blog, 512) == 12_582_912


def test_blog_kv_read_at_4096_and_128k(blog):
    # "Scaling to All Heads and All Layers": 100,663,296 B at 4,096; 3,145,728,000 at 128,000.
    assert theory.kv_cache_bytes(blog, 4096) == 100_663_296
    assert theory.kv_cache_bytes(blog, 128_000) == 3_145_728_000
    assert theory.kv_cache_bytes(blog, 4096) == 96 * MiB


def test_lever1_mqa_gqa(blog):
    # "Lever 1": MQA 3,072 B/token (8x), GQA g=2 6,144 B/token (4x).
    mqa = blog.replace(attention="mqa", num_kv_heads=1)
    gqa = blog.replace(attention="gqa", num_kv_heads=2)
    assert theory.kv_bytes_per_token(mqa) == 3_072
    assert theory.kv_bytes_per_token(gqa) == 6_144
    assert theory.kv_bytes_per_token(blog) // theory.kv_bytes_per_token(mqa) == 8
    assert theory.kv_bytes_per_token(blog) // theory.kv_bytes_per_token(gqa) == 4


def test_lever2_mla_latent(blog):
    # "Lever 2": d_c = 512 -> 1,024 B per token per layer vs MHA 2,048 (2x).
    assert theory.kv_bytes_per_token_latent_blog(1, 512) == 1_024
    assert theory.kv_bytes_per_token(blog) // 12 // 1_024 == 2
    # DeepSeek-V2 also caches the decoupled RoPE key (R=64): (512 + 64)·2 = 1,152 B/layer.
    mla = blog.replace(attention="mla", kv_lora_rank=512, qk_rope_head_dim=64,
                       qk_nope_head_dim=64, v_head_dim=64)
    assert theory.kv_bytes_per_token(mla) == 12 * (512 + 64) * 2
    assert theory.kv_bytes_per_token(mla) - theory.kv_bytes_per_token_latent_blog(12, 512) \
        == 12 * 64 * 2


def test_lever3_window(blog):
    # "Lever 3": w=512 -> 12,582,912 B, constant in t; 250x below 3 GB at 128,000.
    win = blog.replace(window_size=512)
    assert theory.kv_cache_bytes(win, 128_000) == 12_582_912
    assert theory.kv_cache_bytes(win, 1_000_000) == 12_582_912
    assert theory.kv_cache_bytes(blog, 128_000) / theory.kv_cache_bytes(win, 128_000) == 250
    # sinks sit inside the window budget
    assert theory.kv_cache_bytes(win.replace(num_sink_tokens=4), 128_000) == 12_582_912
    assert theory.kv_cache_bytes(win, 100) == theory.kv_cache_bytes(blog, 100)


def test_levers_compose(blog):
    # "Composing the levers": GQA g=2 + w=512 -> 3,145,728 B fixed, 1,000x.
    both = blog.replace(attention="gqa", num_kv_heads=2, window_size=512)
    assert theory.kv_cache_bytes(both, 128_000) == 3_145_728
    assert theory.kv_cache_bytes(blog, 128_000) / theory.kv_cache_bytes(both, 128_000) == 1_000


# ------------------------------------------------------------------ 128K table


@pytest.mark.parametrize("factory, per_token, at_128k", [
    (presets.blog_model, 24_576, 3_145_728_000),
    (presets.gpt2_large, 184_320, 23_592_960_000),
    (presets.llama_7b, 524_288, 67_108_864_000),
    (presets.llama_65b, 2_621_440, 335_544_320_000),
    (presets.gpt3_175b, 4_718_592, 603_979_776_000),
])
def test_scaling_to_real_models(factory, per_token, at_128k):
    # "Scaling to real models" table: bytes/token and KV cache at 128,000 tokens.
    cfg = factory()
    assert theory.kv_bytes_per_token(cfg) == per_token
    assert theory.kv_bytes_per_token_blog(cfg.num_layers, cfg.d_model) == per_token
    assert theory.kv_cache_bytes(cfg, 128_000) == at_128k


# ------------------------------------------------------------------ weights


def test_blog_weight_bytes(blog):
    # "Category 1": 24·L·D² = 75,497,472 B ("72 MB" = 72 MiB); 6,291,456 B per layer.
    assert theory.weight_bytes_blog(12, 512) == 75_497_472
    assert theory.weight_bytes_blog(1, 512) == 6_291_456
    assert theory.weight_bytes_blog(12, 512) == 72 * MiB
    # per-shape count of the layer matrices (gelu, F = 4D) is exactly 12·D² per layer
    p = theory.param_counts(blog)
    assert p.layer_matrices * 2 == 75_497_472
    assert p.attention == 12 * 4 * 512**2 and p.mlp == 12 * 8 * 512**2
    # everything else: 2 norms per layer + final, tied V·D table
    assert p.norms == 2 * 512 * 12 + 512
    assert p.embedding == 32_000 * 512 and p.lm_head == 0
    assert theory.weight_bytes(blog) == 2 * p.total


def test_weight_bytes_per_step_tied_vs_untied(blog):
    tied = theory.weight_bytes_per_step(blog)
    untied = blog.replace(tie_embeddings=False)
    # the LM head matrix is read once either way; the untied embedding table is not read
    assert theory.weight_bytes_per_step(untied) == tied
    assert theory.weight_bytes(untied) == theory.weight_bytes(blog) + 2 * 32_000 * 512
    assert tied == 75_497_472 + 2 * (2 * 512 * 12 + 512) + 2 * 32_000 * 512


def test_published_parameter_counts():
    # sanity against the papers' headline sizes (exact shapes, no biases)
    assert theory.param_counts(presets.llama_7b()).total == pytest.approx(6.74e9, rel=0.01)
    assert theory.param_counts(presets.llama_65b()).total == pytest.approx(65.2e9, rel=0.01)
    assert theory.param_counts(presets.llama2_70b()).total == pytest.approx(69.0e9, rel=0.01)
    assert theory.param_counts(presets.gpt3_175b()).total == pytest.approx(175e9, rel=0.01)
    assert theory.param_counts(presets.smollm2_135m()).total == pytest.approx(134.5e6, rel=0.01)


# ------------------------------------------------------------------ crossover and ratio


def test_crossover(blog):
    # "The crossover": t* = 6·D = 3,072 for the blog model; LLaMA-7B 24,576; GPT-3 ~74K.
    assert theory.crossover_context_blog(512) == 3_072
    assert theory.crossover_context(blog, weights=theory.weight_bytes_blog(12, 512)) == 3_072
    assert 24_576 * 3_072 == theory.weight_bytes_blog(12, 512)
    assert theory.crossover_context_blog(4096) == 24_576
    assert theory.crossover_context_blog(12_288) == 73_728
    # with the exact per-step weights (norms + the V·D head read) the crossover moves later
    assert theory.crossover_context(blog) > 3_072
    # a 512-token window never reaches the weight bytes
    assert math.isinf(theory.crossover_context(blog.replace(window_size=512)))


def test_kv_to_weight_ratio(blog):
    # "The KV Cache vs. Model Weight Ratio": 4,096 / 3,072 = 1.33; LLaMA-65B at 128K: 2.60.
    assert round(theory.kv_to_weight_ratio(4096, 512), 2) == 1.33
    assert round(theory.kv_to_weight_ratio(128_000, 8192), 2) == 2.60
    assert theory.kv_cache_bytes(blog, 4096) / theory.weight_bytes_blog(12, 512) \
        == pytest.approx(theory.kv_to_weight_ratio(4096, 512))


# ------------------------------------------------------------------ hardware and step time


def test_a100_ridge_point():
    # "The Roofline Model": 312e12 / 2e12 = 156 FLOP/byte.
    assert A100.ridge_point("float16") == 156
    assert hardware.CHIPS["A100-40GB"].ridge_point("bfloat16") == 156
    assert A100.sram_bytes == 20e6
    assert hardware.CHIPS["H100-SXM"].ridge_point("bfloat16") == pytest.approx(989 / 3.35)
    assert hardware.CHIPS["H200"].hbm_capacity_bytes == 141e9


def test_step_time_4096(blog):
    # "Deriving per-step latency": the blog's 86.3 µs plugs 72e6 B for the weights;
    # the exact 24·L·D² = 75,497,472 B gives 88.1 µs.
    kv = theory.kv_cache_bytes(blog, 4096)
    assert round(theory.step_time(72e6 + kv, 0, A100) * 1e6, 1) == 86.3
    sb = theory.step_bytes(blog, 4096, weights=theory.weight_bytes_blog(12, 512))
    assert sb.read == 176_160_768
    assert round(theory.step_time(sb.read, 0, A100) * 1e6, 1) == 88.1


def test_step_time_128k(blog):
    # "Deriving per-step latency": 1.61 ms at t = 128,000 (either weight figure).
    sb = theory.step_bytes(blog, 128_000, weights=theory.weight_bytes_blog(12, 512))
    flops = theory.step_flops(blog, 128_000).total
    assert round(theory.step_time(sb.read, flops, A100, "float16") * 1e3, 2) == 1.61
    assert round(theory.step_time(72e6 + sb.kv_read, 0, A100) * 1e3, 2) == 1.61


def test_kv_only_step_time(blog):
    # "Scaling to All Heads and All Layers": 96 MB / 2 TB/s = 48 µs (blog uses 96e6 B);
    # 1.5 ms at 128K (3e9 B). Exact bytes give 50.3 µs and 1.57 ms.
    assert round(theory.memory_time(96e6, A100) * 1e6) == 48
    assert round(theory.memory_time(theory.kv_cache_bytes(blog, 4096), A100) * 1e6, 1) == 50.3
    assert round(theory.memory_time(theory.kv_cache_bytes(blog, 128_000), A100) * 1e3, 2) \
        == 1.57


def test_step_bytes_parts(blog):
    sb = theory.step_bytes(blog, 4096, batch=3)
    assert sb.kv_read == 3 * 100_663_296
    assert sb.kv_write == 3 * 24_576  # "Phase 2": 2,048 B per layer per sequence
    assert sb.kv_write // 3 // 12 == 2_048
    assert sb.weights == theory.weight_bytes_per_step(blog)
    assert sb.total == sb.weights + sb.kv_read + sb.kv_write


# ------------------------------------------------------------------ FLOPs


def test_phase3_flops(blog):
    # "Compute time vs. memory time": 12 x 8 x 260 x 4,096 = 102,236,160 FLOP.
    f = theory.step_flops(blog, 4096)
    assert theory.attention_flops_per_head(64, 64, 1) == 260
    assert f.attn == 102_236_160
    # compute 0.33 µs (blog truncates to 0.32) vs memory; ratio ~150 (blog), 153.6 exact
    t_c = theory.compute_time(f.attn, A100, "float16")
    assert t_c * 1e6 == pytest.approx(0.32, abs=0.01)
    ratio = theory.memory_time(theory.kv_cache_bytes(blog, 4096), A100) / t_c
    assert ratio == pytest.approx(150, rel=0.03)


def test_phase1_and_intensity(blog):
    # "Phase 1": Q/K/V projections 1,572,864 FLOP and 1,572,864 B per layer -> 1.0 FLOP/B.
    f = theory.step_flops(blog.replace(num_layers=1), 1)
    qkv = f.proj - 2 * 512 * 512  # drop W_O
    assert qkv == 1_572_864
    assert theory.arithmetic_intensity(qkv, 3 * 512 * 512 * 2) == 1.0
    # "Total for Phase 3": 260(t+1) / 256(t+1) ~ 1.0
    assert theory.arithmetic_intensity(260 * 4096, 256 * 4096) == pytest.approx(1.0, abs=0.02)


def test_flops_parts_and_batch(blog):
    f1 = theory.step_flops(blog, 4096)
    f4 = theory.step_flops(blog, 4096, batch=4)
    assert f4.total == 4 * f1.total
    assert f1.mlp == 12 * 4 * 512 * 2048 and f1.lm_head == 2 * 512 * 32_000
    assert f1.as_dict()["total"] == f1.total
    # a window caps the keys attended
    assert theory.step_flops(blog.replace(window_size=512), 4096).attn \
        == theory.step_flops(blog, 512).attn


def test_mla_decode_paths():
    cfg = presets.deepseek_v2_lite_attention(num_layers=1)
    t = 1000
    naive = theory.step_flops(cfg, t, absorbed=False)
    absorbed = theory.step_flops(cfg, t, absorbed=True)
    n, c, r, nope, v = 16, 512, 64, 128, 128
    assert naive.kv_rebuild == 2 * t * c * n * (nope + v)
    assert absorbed.kv_rebuild == 0
    assert absorbed.proj - naive.proj == 2 * n * c * (nope + v)
    assert naive.attn == n * (2 * (nope + r) * t + 4 * t + 2 * v * t)
    assert absorbed.attn == n * (2 * (c + r) * t + 4 * t + 2 * c * t)
    assert theory.kv_bytes_per_token(cfg) == (512 + 64) * 2


def test_mla_params_deepseek_v2():
    cfg = presets.deepseek_v2()
    d, n, c, r, q = 5120, 128, 512, 64, 1536
    per_layer = (d * q + q + q * n * (128 + r) + d * c + d * r + c * n * 128 * 2
                 + n * 128 * d + c)
    assert theory.attention_params_per_layer(cfg) == per_layer
    assert theory.kv_bytes_per_token(cfg) == 60 * 576 * 2


# ------------------------------------------------------------------ capacity wall


def test_max_batch(blog):
    # "The memory capacity wall": 60,000 / 96 ~ 625 at 4K, 60,000 / 3,000 ~ 20 at 128K.
    # The blog's MB are MiB: 60,000 MiB holds exactly 625 and 20 caches.
    assert theory.max_batch(blog, 4096, 60_000 * MiB) == 625
    assert theory.max_batch(blog, 128_000, 60_000 * MiB) == 20
    # in decimal bytes (60e9) the counts are 596 and 19
    assert theory.max_batch(blog, 4096, 60e9) == 596
    assert theory.max_batch(blog, 128_000, 60e9) == 19
    # 156 requests at 4K: 14,976 MB ~ 15 GB
    assert 156 * theory.kv_cache_bytes(blog, 4096) == 14_976 * MiB
    assert theory.max_batch(blog, 4096, 80e9, reserve_bytes=80e9) == 0


def test_max_batch_docstring_states_units_and_both_readings():
    doc = theory.max_batch.__doc__
    assert "MiB" in doc and "bytes" in doc
    assert "60_000 * 2**20) == 625" in doc and "596" in doc


def test_batch_fit_explains_a_zero(blog):
    fit = theory.batch_fit(blog, 4096, 60_000 * MiB)
    assert (fit.batch, fit.per_sequence_bytes, fit.devices_needed) == (625, 96 * MiB, 1)
    assert fit.reason.startswith("625 sequences of 100,663,296 B (context 4096)")
    # weights alone (here a reserve of 80e9 B) exceed the memory
    fit = theory.batch_fit(blog, 4096, 80e9, reserve_bytes=80e9 + 1)
    assert fit.batch == 0 and fit.max_context == 0 and fit.devices_needed == 2
    assert "leaves nothing of 80,000,000,000 B" in fit.reason and "2 devices" in fit.reason
    # some memory free, less than one sequence: the longest context that fits
    fit = theory.batch_fit(blog, 4096, 50 * MiB)
    assert fit.batch == 0 and fit.max_context == 50 * MiB // theory.kv_bytes_per_token(blog)
    assert fit.max_context == 2133 and "at most 2,133 tokens fit" in fit.reason


def test_llama7b_cache_exceeds_a100():
    # "LLaMA-7B at 128K context, each cache is 64 GB - it does not even fit": with 14 GB
    # of fp16 weights on an 80 GB A100, zero 128K caches fit.
    cfg = presets.llama_7b()
    assert theory.max_batch(cfg, 128_000, A100.hbm_capacity_bytes,
                            reserve_bytes=theory.weight_bytes(cfg)) == 0
    fit = theory.batch_fit(cfg, 128_000, A100.hbm_capacity_bytes,
                           reserve_bytes=theory.weight_bytes(cfg))
    # 64 GiB of cache + 13.5 GB of fp16 weights > 80 GB; int8 weights leave room for one,
    # and two A100s with weights and cache split evenly hold one too.
    assert fit.per_sequence_bytes == 128_000 * 32 * 2 * 4096 * 2
    assert fit.weight_options[2] == 0 and fit.weight_options[1] == 1
    assert fit.devices_needed == 2
    assert "2 devices" in fit.reason and "int8" in fit.reason, fit.reason


# ------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_build(name):
    cfg = presets.PRESETS[name]()
    assert isinstance(cfg, ModelConfig)
    assert theory.kv_bytes_per_token(cfg) > 0
    assert theory.step_flops(cfg, 128).total > 0


def test_preset_fields():
    s = presets.smollm2_135m()
    assert (s.vocab_size, s.num_layers, s.d_model, s.num_heads, s.num_kv_heads,
            s.head_dim, s.mlp_dim, s.rope_theta, s.tie_embeddings) == \
        (49152, 30, 576, 9, 3, 64, 1536, 1e5, True)
    assert presets.mistral_7b().window_size == 4096
    assert presets.llama2_70b().num_groups == 8
    assert presets.blog_model(dtype="float32").dtype_bytes == 4
    assert theory.kv_bytes_per_token(presets.blog_model(dtype="float32")) == 2 * 24_576


# ------------------------------------------------------------------ local device


def test_measure_read_bandwidth_small():
    probe = hardware.measure_read_bandwidth(num_bytes=8 * MiB, repeats=3)
    assert probe.num_bytes == 8 * MiB
    assert len(probe.samples) == 3
    assert probe.bytes_per_s > 1e8  # any real memory streams faster than 100 MB/s
    assert probe.device
    assert set(probe.kernels) == set(hardware.READ_KERNELS)
    assert probe.bytes_per_s == max(probe.kernels.values())  # the roofline: fastest read
    assert min(probe.samples) <= probe.bytes_per_s <= max(probe.samples)
    one = hardware.measure_read_bandwidth(num_bytes=MiB, repeats=1, kernels=("row_sum",))
    assert list(one.kernels) == ["row_sum"] and one.num_bytes == MiB
    with pytest.raises(ValueError, match="read kernel 'memcpy'; allowed"):
        hardware.measure_read_bandwidth(num_bytes=MiB, repeats=1, kernels=("memcpy",))
    with pytest.raises(ValueError, match="repeats=0"):
        hardware.measure_read_bandwidth(repeats=0)
    with pytest.raises(ValueError, match="num_bytes=100; allowed: at least 256"):
        hardware.ReadProbe("sum", num_bytes=100)


def test_local_chip_on_cpu_is_measured_and_names_its_fastest_read_kernel():
    chip = hardware.local_chip()
    assert chip.source.startswith("measured") and chip.hbm_bytes_per_s > 1e8
    assert chip.read_kernel in hardware.READ_KERNELS
    probe = hardware.ReadProbe(chip.read_kernel, num_bytes=MiB)
    assert probe.num_bytes == MiB and probe.once() > 1e8
    assert hardware.H200.read_kernel is None  # published figures: nothing to probe


def test_batched_steps_bandwidth_and_roofline():
    """Issue 18's theory: SmolLM2 float32 at t = 256, B = 16 over B = 1 is 1.32x by
    bandwidth alone (weights read once); with a float32 peak the step is the roofline's
    max(bytes / BW, FLOP / peak), compute-bound at B = 16 for 100 GFLOP/s and 25 GB/s;
    the serial model is their sum."""
    from kvjax.analysis import theory as th
    cfg = presets.smollm2_135m("float32")
    r = th.batched_steps(cfg, 256, [1, 16], 25e9, 100e9)
    b1, b16 = r[1], r[16]
    assert b16["bandwidth_ratio"] == pytest.approx(1.32, abs=0.005)
    assert b16["bandwidth_tokens_ratio"] == pytest.approx(16 / b16["bandwidth_ratio"])
    assert b1["bytes"] == th.step_bytes(cfg, 256, 1).total
    assert b16["flops"] == th.step_flops(cfg, 256, 16).total
    # B = 1 is memory-bound, B = 16 compute-bound here: the ratio follows the FLOPs
    assert b1["roofline_s"] == pytest.approx(b1["bytes"] / 25e9)
    assert b16["roofline_s"] == pytest.approx(b16["flops"] / 100e9)
    assert b16["roofline_ratio"] == pytest.approx(
        (b16["flops"] / 100e9) / (b1["bytes"] / 25e9))
    assert b16["roofline_ratio"] > 2.0
    # serial: reads and arithmetic one after the other, never below the roofline
    for row in (b1, b16):
        assert row["serial_s"] == pytest.approx(row["bytes"] / 25e9 + row["flops"] / 100e9)
        assert row["serial_s"] > row["roofline_s"]
    assert b16["serial_ratio"] == pytest.approx(b16["serial_s"] / b1["serial_s"])
    assert b16["serial_tokens_ratio"] == pytest.approx(16 / b16["serial_ratio"])
    # no peak: the roofline and the serial model are the bandwidth theory
    nopeak = th.batched_steps(cfg, 256, [1, 16], 25e9)[16]
    assert nopeak["roofline_ratio"] == pytest.approx(b16["bandwidth_ratio"])
    assert nopeak["serial_ratio"] == pytest.approx(b16["bandwidth_ratio"])
    with pytest.raises(ValueError, match="batches=\\[0\\]"):
        th.batched_steps(cfg, 256, [0], 25e9)
    for bad in ([1.5, 3], [float("nan")], [True]):
        with pytest.raises(ValueError, match="allowed: a non-empty list of integers"):
            th.batched_steps(cfg, 256, bad, 25e9)
    for bw, peak in ((float("inf"), None), (float("nan"), None), (25e9, 0.0)):
        with pytest.raises(ValueError, match="allowed: positive rates"):
            th.batched_steps(cfg, 256, [1, 16], bw, peak)
    # an infinite peak: no compute term, every model is the bandwidth theory
    assert th.batched_steps(cfg, 256, [1, 16], 25e9, float("inf"))[16]["serial_ratio"] == \
        pytest.approx(b16["bandwidth_ratio"])


def test_prefill_activation_bytes_counts_an_unfused_layer():
    """SmolLM2 (D = 576, N·H = 576, K·H = 192, F = 1536, SwiGLU, L = 30), float32: per
    token and layer 2D + (3D + N·H + 2·K·H) + 2(N·H + K·H) + (N·H + D) + 3D + 2D
    + (2(D + F) + 3F + F + D) + 3D = 22,080 elements, plus the embedding row (D)."""
    from kvjax import presets
    cfg = presets.smollm2_135m("float32")
    per_token = 30 * 22_080 + 576
    assert theory.prefill_activation_bytes(cfg, 1571) == 1571 * per_token * 4
    assert theory.prefill_activation_bytes(cfg, 10, batch=3) == 3 * 10 * per_token * 4
    assert theory.prefill_activation_bytes(cfg.replace(dtype="bfloat16"), 10) == 10 * per_token * 2
    mla = presets.variant(presets.blog_model("float32"), kv_lora_rank=64)
    assert theory.prefill_activation_bytes(mla, 10) is None


def test_prefill_bytes_over_activations_uses_the_kernel_bytes_and_the_count():
    from kvjax.analysis import costs
    from tests.conftest import tiny_config, tiny_mla_config
    step = costs.analyze_prefill(tiny_config(), 16, 32)
    p = step.theory_parts["bytes"]
    assert p["activations_unfused"] == theory.prefill_activation_bytes(tiny_config(), 16)
    want = costs.prefill_with_kernel(step)[1] / (
        p["weights"] + p["kv_write"] + p["activations_unfused"])
    assert costs.prefill_bytes_over_activations(step) == pytest.approx(want)
    assert math.isnan(costs.prefill_bytes_over_activations(
        costs.analyze_prefill(tiny_mla_config(), 16, 32)))
