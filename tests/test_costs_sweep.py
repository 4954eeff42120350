"""The cost hook done rigorously: uncosted ops flagged, bytes attributed, donation checked,
the jaxpr view loop-corrected, real architectures compiled at 128K. Every figure is compiled
from shapes on this machine's XLA (CPU) and compared with the blog's theory (kvjax.theory).
The sweep's entry point (experiments.costs) is tested in tests/test_entry.py."""

import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.analysis import costs, hlo_cost, roofline, theory
from kvjax.inference import decode
from kvjax.config import SamplingConfig

CPU = jax.default_backend() == "cpu"
needs_cpu = pytest.mark.skipif(not CPU, reason="states XLA:CPU's figures")


def blog(**overrides):
    return presets.blog_model(**{"dtype": "float32", "scan_layers": False, **overrides})


def blog_mla(**overrides):
    """configs/mla.py's shapes: C=512, R=64, 64 no-rope + 64 rope dims per head."""
    return blog(attention="mla", num_kv_heads=8, head_dim=128, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, **overrides)


# ------------------------------------------------------------------ uncosted ops


def _x():
    return jnp.ones((64, 64)) + 64 * jnp.eye(64)


def _callback(a):
    return jax.pure_callback(lambda v: np.asarray(v) + 1,
                             jax.ShapeDtypeStruct(a.shape, a.dtype), a)


def test_custom_calls_are_flagged_and_do_not_reduce_sums():
    """XLA reports a custom call (a host callback here; cuBLAS GEMMs on GPU) as -1 FLOP and
    -1 byte. The report removes the -1s, flags the program incomplete and gives the custom
    call's operand + output bytes as a lower bound of what XLA did not cost."""
    x = _x()
    plain = jax.jit(lambda a: (a @ a) * 2.0).lower(x).compile()
    called = jax.jit(lambda a: _callback(a @ a) * 2.0).lower(x).compile()
    p, c = hlo_cost.loop_aware_cost(plain), hlo_cost.loop_aware_cost(called)
    assert p.complete and not c.complete
    assert c.custom_calls == ("xla_ffi_python_cpu_callback",)
    assert hlo_cost.normalize_cost(called.cost_analysis())["flops"] == p.flops - 1  # XLA's -1
    assert c.flops == p.flops and c.bytes == p.bytes  # -1 removed, nothing else changed
    assert c.uncosted_bytes == 2 * 64 * 64 * 4  # f32[64,64] in and out
    a = hlo_cost.attribute(hlo_cost.op_costs(called))
    assert a.num_uncosted_ops == 1 and a.uncosted_bytes == c.uncosted_bytes
    assert a.total_flops == c.flops and a.total_bytes == c.bytes


def test_lapack_custom_call_in_a_loop_is_counted_per_iteration():
    x = _x()
    chol = jax.jit(lambda a: jnp.linalg.cholesky(a @ a)).lower(x).compile()
    r = hlo_cost.loop_aware_cost(chol)
    assert not r.complete and any("potrf" in t for t in r.custom_calls)

    def loop(a):
        return jax.lax.fori_loop(0, 5, lambda i, c: _callback(c @ a), a)

    r = hlo_cost.loop_aware_cost(jax.jit(loop).lower(x).compile())
    assert r.loops[0].trip_count == 5 and not r.complete
    assert r.uncosted_bytes == 5 * 2 * 64 * 64 * 4
    assert r.flops == pytest.approx(5 * 2 * 64**3, rel=1e-3)


# ------------------------------------------------------------------ attribution


@pytest.fixture(scope="module")
def mha_16k():
    return costs.analyze_decode_step(blog(), 16384)


@needs_cpu
def test_attribution_kv_read_is_theory_and_dominates_at_16k(mha_16k):
    """fp32, unrolled blog model, t = 16K: the compiled bytes split per op reproduce XLA's
    total, the KV-read part is the theory's KV term, and it dominates (t > t*)."""
    s = mha_16k
    a = s.attribution
    tb = s.theory_parts["bytes"]
    assert a.total_bytes == pytest.approx(s.xla.bytes, rel=1e-3)
    assert a.total_flops == pytest.approx(s.xla.flops, rel=1e-3)
    assert a.bytes["kv_read"] == pytest.approx(tb["kv_read"], rel=0.10)
    assert a.bytes["weights"] == pytest.approx(tb["weights"], rel=0.02)
    assert a.bytes["kv_write"] == pytest.approx(tb["kv_write"], rel=0.10)  # in place
    assert a.bytes["kv_copies"] == 0
    assert a.bytes["kv_read"] > 0.7 * a.total_bytes
    # No weight is copied: the o_proj kernel [N, H, D] used to be transposed into a copy
    # every step (2 x L x D² x 4 bytes) until the output projection contracted the merged
    # N·H axis (layers.Einsum merge_in).
    assert a.bytes["weight_copies"] == 0
    # FLOPs on the cache are the attention's dots (theory adds 4t of softmax per head).
    assert a.flops["kv"] == pytest.approx(s.theory_parts["flops"]["attn"], rel=0.02)
    # the jaxpr view (dots) matches theory within 2% too
    assert s.jaxpr.hbm_bytes == pytest.approx(s.theory_bytes, rel=0.02)
    assert s.jaxpr.flops == pytest.approx(s.theory_flops, rel=0.02)


@needs_cpu
def test_scanned_stack_copies_each_layers_cache_and_weight_slice():
    """Inside a scan XLA:CPU slices each layer out of the stacked cache and weights into a
    copy before its dots: the copies are written and read back, 2x the KV and layer
    weight bytes, which is why CPU configs unroll the stack."""
    s = costs.analyze_decode_step(blog(scan_layers=True, vocab_size=1024), 4096)
    a = s.attribution
    assert a.total_bytes == pytest.approx(s.xla.bytes, rel=1e-3)  # loop bodies x 12
    assert a.bytes["kv_read"] == pytest.approx(s.theory_parts["bytes"]["kv_read"], rel=0.01)
    assert a.bytes["kv_copies"] == pytest.approx(2 * a.bytes["kv_read"], rel=0.01)
    layer_matrices = theory.param_counts(s.cfg).layer_matrices * 4
    assert a.bytes["weight_copies"] == pytest.approx(2 * layer_matrices, rel=0.01)


@needs_cpu
def test_bf16_and_fp16_on_cpu_explained():
    """Blog model, t = 16K. On CPU, XLA computes 2-byte dots in float32:

    * each cache element is read once (2 B: kv_read = theory), converted and written as an
      f32 copy (4 B) and read back by the dot (4 B): kv_copies = 4x theory's KV bytes;
    * every weight matrix likewise: weight_copies = 4x the matrices' bytes;
    * the cache update: in fp16 in place (kv_write = theory), but in bf16 XLA rewrites the
      dynamic-update-slice as convert(DUS(convert(cache))) over the whole cache, read and
      written (2 + 2 B per element): kv_write = 2x theory's KV bytes.

    Total: fp16 ~5.1x theory (KV 1 + 4), bf16 ~6.8x (KV 1 + 4 + 2).
    """
    t = 16384
    for dtype, update, lo, hi in (("float16", 0.0, 4.9, 5.4), ("bfloat16", 2.0, 6.5, 7.0)):
        s = costs.analyze_decode_step(blog(dtype=dtype), t, jaxpr=False)
        a, tb = s.attribution, s.theory_parts["bytes"]
        kv = tb["kv_read"]
        assert a.bytes["kv_read"] == pytest.approx(kv, rel=0.01), dtype
        assert a.bytes["kv_copies"] == pytest.approx(4 * kv, rel=0.01), dtype
        assert a.bytes["kv_write"] == pytest.approx(update * kv + tb["kv_write"], rel=0.01)
        matrices = (theory.param_counts(s.cfg).layer_matrices
                    + s.cfg.vocab_size * s.cfg.d_model) * 2
        assert a.bytes["weight_copies"] == pytest.approx(4 * matrices, rel=0.01), dtype
        assert lo < s.bytes_ratio < hi, (dtype, s.bytes_ratio)


# ------------------------------------------------------------------ more variants at 4096


@needs_cpu
def test_window_512_matches_theory_with_min_t_w_at_4096():
    s = costs.analyze_decode_step(blog(window_size=512), 4096, jaxpr=False)
    assert s.theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(s.cfg, 512)
    assert 0.9 <= s.bytes_ratio <= 1.3, s.bytes_ratio
    assert s.flops_ratio == pytest.approx(1.0, abs=0.05)
    assert s.attribution.bytes["kv_read"] == pytest.approx(
        s.theory_parts["bytes"]["kv_read"], rel=0.01)
    assert s.xla.complete


@needs_cpu
def test_mla_absorbed_matches_theory_plus_its_second_latent_read_at_4096():
    """XLA runs one op per contraction, so the absorbed path reads the latent twice
    (scores over C, then probs·c): kv_read = (2C + R)/(C + R) x theory's. Against
    theory + that read (theory.mla_unfused_extra_bytes) the step is within [0.9, 1.3]."""
    s = costs.analyze_decode_step(blog_mla(mla_absorb=True), 4096, jaxpr=False)
    tb = s.theory_parts["bytes"]
    extra = theory.mla_unfused_extra_bytes(s.cfg, 4096)
    assert 0.9 <= s.xla.bytes / (s.theory_bytes + extra) <= 1.3
    assert s.attribution.bytes["kv_read"] == pytest.approx(
        tb["kv_read"] * (2 * 512 + 64) / (512 + 64), rel=0.02)
    assert s.flops_ratio == pytest.approx(1.0, abs=0.05)
    assert s.xla.complete


# ------------------------------------------------------------------ memory, donation


def test_donated_cache_is_aliased_in_the_step_and_the_generate_loop():
    """The donated cache (tensors, positions, length) is updated in place: memory_analysis
    aliases exactly its bytes to the output, and temporaries stay below it."""
    cfg = blog(num_layers=2, vocab_size=512)
    spec = cache_lib.cache_spec(cfg, 1, 2048)
    total = cache_lib.total_bytes(spec)
    step = costs.analyze_decode_step(cfg, 2048, attribute=False, jaxpr=False)
    loop = costs.analyze_loop(cfg, 2048, attribute=False, num_steps=8)
    for s in (step, loop):
        assert s.memory["alias_bytes"] == total, s.name
        assert s.memory["temp_bytes"] < s.cache_bytes, s.name
        assert s.memory["argument_bytes"] >= total


def test_analysis_compile_options_change_no_figure():
    """Programs compiled only to be costed use the backend's -O0 (faster to compile): the
    optimised HLO, costs and memory figures are identical to the default compile's."""
    cfg = blog(num_layers=2, vocab_size=512)
    default = costs.compile_decode_step(cfg, 1, 1024)
    fast = costs.compile_decode_step(cfg, 1, 1024, costs.analysis_compiler_options())
    assert fast.as_text() == default.as_text()
    assert hlo_cost.memory_stats(fast) == hlo_cost.memory_stats(default)


# ------------------------------------------------------------------ the jaxpr view


def test_jaxpr_view_corrects_scans_and_while_loops():
    cfg = blog(vocab_size=1024)
    params, cache = costs._specs(cfg.replace(scan_layers=True), 1, 4096)
    scanned = roofline.jaxpr_cost(
        lambda p, t, c: decode.decode_step(p, t, c, cfg=cfg.replace(scan_layers=True)),
        params, costs._token_spec(1), cache)
    params, cache = costs._specs(cfg, 1, 4096)
    unrolled = roofline.jaxpr_cost(lambda p, t, c: decode.decode_step(p, t, c, cfg=cfg),
                                   params, costs._token_spec(1), cache)
    assert scanned.loops == (("scan", 12),) and unrolled.loops == ()
    assert scanned.flops == pytest.approx(unrolled.flops, rel=1e-6)
    assert scanned.hbm_bytes == pytest.approx(unrolled.hbm_bytes, rel=1e-6)
    assert scanned.raw["flops"] < unrolled.flops / 4  # the library counts 1 body of 12
    # while loops: the library counts 0 iterations, the corrected view n
    small = blog(num_layers=1, vocab_size=256)
    args = costs._generate_args(small, 1, 64)
    gen = lambda n: roofline.jaxpr_cost(  # noqa: E731
        lambda *a: decode.generate_program(*a, cfg=small, sampling=SamplingConfig()),
        *args, while_trip_count=n)
    g1, g4, g16 = gen(1), gen(4), gen(16)
    assert g1.raw["flops"] == 0
    assert g16.flops == pytest.approx(16 * g1.flops) and g4.flops == pytest.approx(4 * g1.flops)


# ------------------------------------------------------------------ real architectures


def _preset_names():
    return list(presets.PRESETS)


@pytest.mark.parametrize("name", _preset_names())
def test_preset_layer_compiles_at_128k_from_shapes(name):
    """One layer of each published architecture (fp16, as published) at 128K context,
    compiled from shapes: the cache (up to 6 GB for GPT-3) is never allocated, and the
    compiled KV read and weight read are theory's."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cfg = presets.PRESETS[name](num_layers=1, scan_layers=False)
    t = 131072
    s = costs.analyze_decode_step(cfg, t, jaxpr=False)
    tb = s.theory_parts["bytes"]
    assert s.cache_bytes == theory.kv_cache_bytes(cfg, cache_lib.num_slots(cfg, t))
    assert tb["kv_read"] == theory.kv_cache_bytes(cfg, t)
    assert s.attribution.bytes["kv_read"] == pytest.approx(tb["kv_read"], rel=0.01)
    assert s.attribution.bytes["weights"] == pytest.approx(tb["weights"], rel=0.01)
    assert s.flops_ratio == pytest.approx(1.0, abs=0.6)  # CPU counts the f16->f32 converts
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
    assert grown < max(s.cache_bytes // 2, 2**30), grown
