"""Multi-head latent attention (kvjax.mla): both decode paths, the latent cache, decoupled
RoPE, config validation, and the compiled cost of a decode step against kvjax.theory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.analysis import costs, theory
from kvjax.models import model
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.models.mla import MLAttention
from tests import reference
from tests.conftest import positions, tiny_mla_config

small = tiny_mla_config


forward = jax.jit(model.forward, static_argnums=1)  # (params, cfg, tokens, positions, cache)


def layer_params(cfg, seed=0):
    """{'params': ...} of one MLAttention layer: layer 0 of the model's initialisation
    (model.init_params draws with numpy, no compilation)."""
    params = model.init_params(cfg.replace(scan_layers=True), seed)
    return {"params": jax.tree.map(lambda a: a[0], params["layers"]["attn"])}


# ------------------------------------------------------------------ absorbed == naive


@pytest.mark.parametrize("dtype,atol,q_lora_rank", [
    ("float32", 1e-5, None), ("bfloat16", 2e-2, None), ("float32", 1e-5, 12)])
def test_absorbed_equals_naive(dtype, atol, q_lora_rank):
    cfg = small(dtype=dtype, q_lora_rank=q_lora_rank)
    variables = layer_params(cfg)
    x = jax.random.normal(jax.random.key(1), (2, 9, cfg.d_model)).astype(cfg.jnp_dtype)
    pos = positions(0, 9, 2)
    outs = {}
    for absorb in (True, False):
        apply = jax.jit(MLAttention(cfg.replace(mla_absorb=absorb)).apply)
        full, new = apply(variables, x, pos, None, None)
        # one decode step over a cache holding the first 8 tokens (split softmax path)
        cached = {n: jnp.pad(a[:, :8], ((0, 0), (0, 4), (0, 0))) for n, a in new.items()}
        slot_pos = jnp.where(jnp.arange(12) < 8, jnp.arange(12), -1).astype(jnp.int32)
        step, _ = apply(variables, x[:, 8:], pos[:, 8:], cached, slot_pos)
        outs[absorb] = (np.asarray(full, np.float32), np.asarray(step, np.float32))
        assert new["c_kv"].shape == (2, 9, 16) and new["k_rope"].shape == (2, 9, 8)
        assert new["c_kv"].dtype == cfg.jnp_dtype and new["k_rope"].dtype == cfg.jnp_dtype
    assert np.abs(outs[True][0]).max() > 0.1  # not trivially zero
    np.testing.assert_allclose(outs[True][0], outs[False][0], atol=atol, rtol=0)
    np.testing.assert_allclose(outs[True][1], outs[False][1], atol=atol, rtol=0)
    # the step equals the last row of the cache-free forward
    for absorb in (True, False):
        np.testing.assert_allclose(outs[absorb][1], outs[absorb][0][:, 8:], atol=atol, rtol=0)


# ------------------------------------------------------------------ cache == full forward


def cached_logits(params, cfg, tokens, chunks, max_seq_len=16):
    """Logits from consecutive chunks of the given lengths (a prefill, then steps)."""
    b = tokens.shape[0]
    c = cache_lib.init_cache(cfg, b, max_seq_len)
    outs, start = [], 0
    for n in chunks:
        out, c = forward(params, cfg, tokens[:, start:start + n], positions(start, n, b), c)
        outs.append(out)
        start += n
    return jnp.concatenate(outs, axis=1), c


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_cached_decode_equals_full_forward(absorb, scan_layers):
    cfg = small(mla_absorb=absorb, scan_layers=scan_layers)
    params = model.params_for(cfg, model.init_params(small(), jax.random.key(3)))
    tokens = jax.random.randint(jax.random.key(4), (2, 11), 0, cfg.vocab_size)
    full, _ = forward(params, cfg, tokens, positions(0, 11, 2))
    # prefill 4, a chunk of 3 (T > 1 over a non-empty cache), then single steps
    got, c = cached_logits(params, cfg, tokens, [4, 3, 1, 1, 1, 1] if scan_layers else
                           [5, 1, 1, 1, 1, 1, 1])
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-4, rtol=0)
    assert c.length.tolist() == [11] * 2
    layer0 = c.layer(0) if scan_layers else {n: t[0] for n, t in c.tensors.items()}
    assert layer0["c_kv"].shape == (2, 16, 16) and layer0["k_rope"].shape == (2, 16, 8)


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("q_lora_rank, window, sinks", [(None, None, 0), (12, 5, 2)])
def test_forward_equals_the_numpy_reference(absorb, q_lora_rank, window, sinks):
    """Both decode paths against the naive float64 math of tests/reference.py (keys and
    values rebuilt from the latent), with and without a query low-rank, window and sinks."""
    cfg = small(mla_absorb=absorb, q_lora_rank=q_lora_rank, window_size=window,
                num_sink_tokens=sinks, scan_layers=True)
    params = model.init_params(cfg, jax.random.key(7))
    tokens = jax.random.randint(jax.random.key(8), (1, 13), 0, cfg.vocab_size)
    full, _ = forward(params, cfg, tokens, positions(0, 13))
    ref = reference.logits(params, cfg, np.asarray(tokens[0]))
    np.testing.assert_allclose(np.asarray(full[0]), ref, atol=1e-4, rtol=0)


def test_windowed_latent_cache_equals_windowed_forward():
    # Lever 3 on top of lever 2: a ring buffer of W=5 latent slots wraps twice.
    cfg = small(window_size=5, scan_layers=False)
    params = model.params_for(cfg, model.init_params(small(), jax.random.key(5)))
    tokens = jax.random.randint(jax.random.key(6), (1, 13), 0, cfg.vocab_size)
    full, _ = forward(params, cfg, tokens, positions(0, 13))
    got, c = cached_logits(params, cfg, tokens, [3] + [1] * 10)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full), atol=1e-4, rtol=0)
    assert c.num_slots == 5


# ------------------------------------------------------------------ cache size


def test_latent_cache_bytes_per_token():
    cfg = small(dtype="bfloat16")
    assert theory.kv_elements_per_token_per_layer(cfg) * cfg.dtype_bytes == 48  # (16+8)·2
    assert theory.kv_bytes_per_token(cfg) == 2 * 48
    for scan in (True, False):
        c = cache_lib.init_cache(cfg.replace(scan_layers=scan), batch_size=3, max_seq_len=10)
        assert cache_lib.cache_bytes(c) == 3 * 10 * 2 * 48
        layer = c.layer(0) if scan else {n: t[0] for n, t in c.tensors.items()}
        # [B, S, C] and [B, S, R]: the rotary key is shared by all heads (no head axis)
        assert layer["c_kv"].shape == (3, 10, 16)
        assert layer["k_rope"].shape == (3, 10, 8)
        assert layer["c_kv"].dtype == jnp.bfloat16


def test_configs_build_and_cache_sizes():
    from configs import blog, deepseek_v2_lite, mla
    m = run_config_from_dict(mla.get_config()).model
    assert m.is_mla and (m.kv_lora_rank, m.qk_rope_head_dim) == (512, 64)
    fp16 = m.replace(dtype="float16")
    mha = run_config_from_dict(blog.get_config()).model.replace(dtype="float16")
    assert theory.kv_bytes_per_token(fp16) == 12 * 576 * 2 == 13_824
    assert theory.kv_bytes_per_token(mha) / theory.kv_bytes_per_token(fp16) == \
        pytest.approx(2048 / 1152)  # 1.78x, not the blog's latent-only 2x
    d = run_config_from_dict(deepseek_v2_lite.get_config()).model
    assert (d.d_model, d.num_heads, d.kv_lora_rank, d.qk_rope_head_dim,
            d.qk_nope_head_dim, d.v_head_dim, d.q_lora_rank) == (2048, 16, 512, 64, 128, 128,
                                                                 None)


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_param_count_matches_theory(q_lora_rank):
    cfg = small(q_lora_rank=q_lora_rank)
    params = layer_params(cfg)["params"]
    assert sum(x.size for x in jax.tree.leaves(params)) == \
        theory.attention_params_per_layer(cfg)


# ------------------------------------------------------------------ decoupled RoPE


@pytest.mark.parametrize("absorb", [True, False])
def test_scores_depend_only_on_position_difference(absorb):
    cfg = small(mla_absorb=absorb)
    variables = layer_params(cfg, seed=7)
    xq = jax.random.normal(jax.random.key(8), (1, 1, cfg.d_model))
    xk = jax.random.normal(jax.random.key(9), (1, 1, cfg.d_model))

    scores = jax.jit(functools.partial(MLAttention(cfg).apply, method=MLAttention.scores))

    def score(pq, pk):
        return np.asarray(scores(variables, xq, jnp.full((1, 1), pq, jnp.int32), xk,
                                 jnp.full((1, 1), pk, jnp.int32)))[0, :, 0, 0]  # [N]

    np.testing.assert_allclose(score(5, 2), score(105, 102), atol=1e-4, rtol=0)
    assert np.abs(score(5, 2) - score(5, 3)).max() > 1e-3  # the difference does matter


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("field,value", [
    ("kv_lora_rank", 0), ("kv_lora_rank", -16), ("qk_rope_head_dim", 0),
    ("qk_rope_head_dim", -8), ("qk_rope_head_dim", 7), ("qk_nope_head_dim", None),
    ("v_head_dim", None), ("kv_lora_rank", None), ("qk_rope_head_dim", None)])
def test_bad_mla_config_raises(field, value):
    with pytest.raises(ConfigError, match=field):
        small(**{field: value})


# ------------------------------------------------------------------ compiled cost


def test_decode_step_cost_naive_vs_absorbed():
    """configs/mla.py (blog model with C=512, R=64; L=12, fp32) at t=4096.

    theory.step_bytes counts the latent cache read once, as a fused attention kernel would.
    XLA runs one op per contraction, so the absorbed path reads the latent twice (scores
    over C, then probs·c over the keys): measured XLA/theory = 1.32 here (517.2 MB against
    391.7 MB; 100.7 MB is the second latent read, ~20 MB the float32 scores [N, t] passing
    through ~14 fusions per layer). Against theory + that second read
    (theory.mla_unfused_extra_bytes) it is 1.05. The naive path also writes and reads back
    the rebuilt K/V (2·L·t·N·(nope+v)·4 = 402.7 MB) and copies transposed latents and
    values: 3.57x theory.
    """
    from configs import mla
    # XLA's own products: configs' 'auto' may pick native kernels XLA cannot cost
    cfg = run_config_from_dict(mla.get_config()).model.replace(
        dtype="float32", scan_layers=False, weight_matmul="xla", decode_attention="xla")
    t = 4096
    absorbed = costs.analyze_decode_step(cfg.replace(mla_absorb=True), t)
    naive = costs.analyze_decode_step(cfg.replace(mla_absorb=False), t)
    assert absorbed.xla.complete and naive.xla.complete

    rebuilt_kv = 2 * cfg.num_layers * t * cfg.num_heads * (
        cfg.qk_nope_head_dim + cfg.v_head_dim) * 4  # written + read back
    second_read = theory.mla_unfused_extra_bytes(cfg, t, absorbed=True)
    assert second_read == cfg.num_layers * t * cfg.kv_lora_rank * 4
    # naive moves the rebuilt K/V; the absorbed path does not
    assert naive.xla.bytes - naive.theory_bytes >= rebuilt_kv + second_read
    assert absorbed.xla.bytes - absorbed.theory_bytes - second_read < 0.1 * rebuilt_kv
    assert naive.xla.bytes > 2 * absorbed.xla.bytes
    # absorbed against theory: 1.32 (not within [0.9, 1.3], see the docstring); with the
    # unfused second latent read accounted for:
    ratio = absorbed.xla.bytes / (absorbed.theory_bytes + second_read)
    assert 0.9 <= ratio <= 1.1, ratio
    # FLOPs: theory.step_flops matches both paths (naive: +2·t·C·N·(nope+v) per layer)
    assert absorbed.flops_ratio == pytest.approx(1.0, abs=0.01)
    assert naive.flops_ratio == pytest.approx(1.0, abs=0.01)
    assert naive.theory_parts["flops"]["kv_rebuild"] == \
        2 * cfg.num_layers * t * cfg.kv_lora_rank * cfg.num_heads * (
            cfg.qk_nope_head_dim + cfg.v_head_dim)
