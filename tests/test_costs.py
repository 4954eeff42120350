"""The cost hook: loop correction, XLA vs theory, memory/donation, dict/list/None forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import compress as compress_lib
from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.analysis import costs, hlo_cost, theory
from kvjax.inference import decode
from kvjax.models import model
from kvjax.config import ModelConfig, SamplingConfig


def test_normalize_cost_accepts_dict_list_none():
    assert hlo_cost.normalize_cost({"flops": 2.0}) == {"flops": 2.0}
    assert hlo_cost.normalize_cost([{"flops": 3.0}]) == {"flops": 3.0}
    assert hlo_cost.normalize_cost(None) == {}


def test_loop_correction_on_a_plain_scan_matches_unrolled():
    w = jnp.ones((8, 64, 64))
    x = jnp.ones((4, 64))

    def scanned(x, w):
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]

    def unrolled(x, w):
        for i in range(8):
            x = jnp.tanh(x @ w[i])
        return x

    s = hlo_cost.loop_aware_cost(jax.jit(scanned).lower(x, w).compile())
    u = hlo_cost.loop_aware_cost(jax.jit(unrolled).lower(x, w).compile())
    assert s.loops[0].trip_count == 8 and s.loops[0].trip_count_source == "xla"
    assert s.raw_flops == pytest.approx(u.flops / 8, rel=0.01)  # XLA counts the body once
    assert s.flops == pytest.approx(u.flops, rel=0.01) == 2 * 4 * 64 * 64 * 8


def test_scanned_layer_stack_corrected_flops_match_unrolled_within_2_percent():
    cfg = presets.blog_model(dtype="float32", vocab_size=1024)
    scan = costs.analyze_decode_step(cfg.replace(scan_layers=True), 1024)
    unrolled = costs.analyze_decode_step(cfg.replace(scan_layers=False), 1024)
    assert scan.xla.flops == pytest.approx(unrolled.xla.flops, rel=0.02)
    assert scan.xla.raw_flops < unrolled.xla.flops / 5  # the raw figure counts 1 of 12
    assert any(l.trip_count == 12 for l in scan.xla.loops)


def test_unrolled_decode_step_fp32_matches_theory_at_4096():
    # Head-major cache, fp32, CPU: FLOPs within 5% and bytes within [0.9, 1.3].
    for k in (8, 2, 1):
        cfg = presets.blog_model(dtype="float32", num_kv_heads=k,
                                 attention={8: "mha", 2: "gqa", 1: "mqa"}[k],
                                 scan_layers=False)
        step = costs.analyze_decode_step(cfg, 4096)
        assert step.flops_ratio == pytest.approx(1.0, abs=0.05), k
        assert 0.9 <= step.bytes_ratio <= 1.3, (k, step.bytes_ratio)
        assert step.xla.complete


def test_generate_loop_corrected_flops_scale_with_steps_and_raw_does_not():
    cfg = presets.blog_model(dtype="float32", vocab_size=512, num_layers=2, scan_layers=False)
    params, cache = model.param_shapes(cfg), cache_lib.cache_spec(cfg, 1, 256)
    compiled = decode.generate_program.lower(
        params, jax.ShapeDtypeStruct((1,), jnp.int32), cache, jnp.int32(0),
        jax.random.key(0), jnp.int32(0), cfg=cfg, sampling=SamplingConfig()).compile()
    reports = {n: hlo_cost.loop_aware_cost(compiled, default_trip_count=n) for n in (1, 4, 16)}
    f = {n: r.flops for n, r in reports.items()}
    assert f[16] - f[4] == pytest.approx(4 * (f[4] - f[1]), rel=1e-6)
    assert f[4] > 3 * f[1]
    # Guard: XLA's raw figure counts the loop body once whatever the step count.
    assert reports[1].raw_flops == reports[16].raw_flops
    assert not hlo_cost.loop_aware_cost(compiled).complete  # unknown count flagged


def test_donated_cache_is_aliased():
    cfg = presets.blog_model(dtype="float32", vocab_size=512, num_layers=2, scan_layers=False)
    step = costs.analyze_decode_step(cfg, 2048)
    assert step.memory["alias_bytes"] >= step.cache_bytes
    assert step.memory["temp_bytes"] < step.cache_bytes


def test_cost_hook_compiles_a_128k_context_without_allocating():
    cfg = presets.llama_7b(num_layers=1, scan_layers=False)
    step = costs.analyze_decode_step(cfg, 128_000)
    # 1 layer of LLaMA-7B in fp16: 524,288 / 32 B/token x 128K = 2 GB of KV, never allocated.
    assert step.cache_bytes == 16_384 * 128_000
    assert step.theory_parts["bytes"]["kv_read"] == 16_384 * 128_000
    if jax.default_backend() == "cpu":
        # On CPU, XLA computes fp16 dots via float32 copies of the operands: each 2-byte
        # cache element is read (2 B), converted and written as f32 (4 B), read again (4 B):
        # 10 B moved per 2 B of cache, 5x the blog's bytes.
        assert 4.5 < step.bytes_ratio < 5.5
    f32 = costs.analyze_decode_step(cfg.replace(dtype="float32"), 128_000)
    assert 0.9 < f32.bytes_ratio < 1.3


def test_measure_step_seconds_runs_the_compiled_step():
    cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=2,
                      head_dim=8, mlp_dim=32, attention="mha")
    params = model.init_params(cfg, 0)
    c = cache_lib.init_cache(cfg, 1, 32).replace(length=jnp.full((1,), 10, jnp.int32))
    times = costs.measure_step_seconds(cfg, params, c, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_theory_prefill_flops_is_the_sum_of_step_flops():
    cfg = presets.blog_model()
    direct = sum(theory.step_flops(cfg, t).total for t in range(1, 50))
    assert theory.prefill_flops(cfg, 49, lm_head_positions=49) == pytest.approx(direct)


# ------------------------------------------------------------------ the loop that decodes


def _smol(dtype, layers=2):
    from kvjax import presets
    return presets.smollm2_135m(dtype=dtype, num_layers=layers, scan_layers=False)


def test_loop_per_token_bytes_equal_the_single_step_in_float32():
    """float32: the generate loop per token and the single step cost the same compiled
    bytes (within 2%), and the loop's work outside its body is tiny: nothing, or, where
    the step's formulation does not ignore masked values itself, the one clearing pass
    over the cache on entry (model.clear_masked_slots: the cache read and written)."""
    cfg = _smol("float32")
    loop = costs.analyze_loop(cfg, 256)
    step = costs.analyze_decode_step(cfg, 256, attribute=False, jaxpr=False)
    assert abs(step.xla.bytes / loop.xla.bytes - 1) < 0.02
    assert abs(loop.bytes_ratio - 1) < 0.03
    cache = compress_lib.full_cache(loop.cfg, 1, 256)
    clear = 0 if model.step_ignores_masked_values(loop.cfg, cache) else 2 * loop.cache_bytes
    assert abs(loop.once_per_call["bytes"] - clear) < 1e-3 * loop.xla.bytes + 0.01 * clear
    assert "bytes_widened" not in loop.theory_parts


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU widens bf16 dots")
def test_bf16_loop_hoists_a_float32_copy_of_the_weights():
    """bf16 on CPU: the loop converts the weights to float32 once, before the loop (it is
    loop-invariant): its temp memory holds a float32 copy of them, the conversion shows
    once per call (not per token), and per token it reads ~2x the blog's bytes against the
    single step's ~5x."""
    cfg = _smol("bfloat16")
    loop = costs.analyze_loop(cfg, 256)
    step = costs.analyze_decode_step(cfg, 256, attribute=False, jaxpr=False)
    f32_weights = theory.weight_bytes(cfg) * 2
    assert loop.memory["temp_bytes"] >= f32_weights
    assert loop.once_per_call["parts"]["weight_copies"] >= 0.5 * f32_weights
    assert 1.7 < loop.bytes_ratio < 2.6 and step.bytes_ratio > 4
    widened = loop.theory_parts["bytes_widened"]
    assert abs(loop.xla.bytes / widened["total"] - 1) < 0.1


def test_measure_loop_seconds_differences_two_loop_lengths():
    cfg = _smol("float32", layers=1)
    params = model.init_params(cfg, 0)
    got = costs.measure_loop_seconds(cfg, params, 64, steps=(2, 6), repeats=2)
    assert got["steps"] == (2, 6) and len(got["seconds"][6]) == 2
    assert np.isfinite(got["per_token_s"])
    assert got["call_overhead_s"] == pytest.approx(
        np.median(got["seconds"][2]) - 2 * got["per_token_s"])
