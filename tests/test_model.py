"""The decoder LM and its functional cache against an independent numpy reference."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.models import convert, model
from kvjax.models.attention import attend, attend_step
from tests import reference
from tests.conftest import positions, tiny_config

VARIANTS = {"mha": (4, "mha"), "gqa": (2, "gqa"), "mqa": (1, "mqa")}


def tiny(num_kv_heads=2, attention="gqa", scan_layers=True, **kw):
    return tiny_config(num_layers=3, num_kv_heads=num_kv_heads, attention=attention,
                       scan_layers=scan_layers, **kw)


fwd = jax.jit(model.forward, static_argnums=1)


def cached_logits(params, cfg, tokens, prefill_len, max_seq_len=24):
    """Logits [B, T, V] from a prefill of ``prefill_len`` tokens then single steps."""
    b, t = tokens.shape
    c = cache_lib.init_cache(cfg, b, max_seq_len)
    out, c = fwd(params, cfg, tokens[:, :prefill_len],
                           positions(0, prefill_len, b), c)
    outs = [out]
    for i in range(prefill_len, t):
        out, c = fwd(params, cfg, tokens[:, i:i + 1], positions(i, 1, b), c)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), c


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("scan_layers", [True, False])
def test_cached_decode_equals_full_forward_and_reference(variant, scan_layers):
    k, attention = VARIANTS[variant]
    cfg = tiny(k, attention, scan_layers)
    params = model.init_params(tiny(k, attention), jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (2, 13), 0, cfg.vocab_size)
    ref = reference.logits(params, cfg, np.asarray(tokens[0]))
    params = model.params_for(cfg, params)
    full, _ = fwd(params, cfg, tokens, positions(0, 13, 2))
    np.testing.assert_allclose(full[0], ref, atol=1e-4)
    for prefill_len in (1, 4, 12):
        got, c = cached_logits(params, cfg, tokens, prefill_len)
        np.testing.assert_allclose(got, full, atol=1e-4)
        assert c.length.tolist() == [13, 13]


def test_grouping_order_query_head_reads_kv_head_n_div_g():
    # 4 query heads, 2 KV heads: KV head 0's values are 0, KV head 1's are 1.
    b, t, s, h = 1, 1, 5, 4
    q = jax.random.normal(jax.random.key(0), (b, t, 2, 2, h))
    k = jax.random.normal(jax.random.key(1), (b, 2, s, h))
    v = jnp.stack([jnp.zeros((b, s, h)), jnp.ones((b, s, h))], axis=1)
    mask = jnp.ones((b, t, s), bool)
    out = attend(q, k, v, mask).reshape(b, t, 4, h)
    np.testing.assert_array_equal(out[0, 0, :2], 0.0)
    np.testing.assert_allclose(out[0, 0, 2:], 1.0, rtol=1e-6)
    # The decode-step path groups the same way.
    out1 = attend_step(q, k[:, :, :-1], v[:, :, :-1], mask[:, :, :-1], k[:, :, -1:],
                       v[:, :, -1:]).reshape(b, t, 4, h)
    np.testing.assert_allclose(out1, out, atol=1e-6)


def test_attend_step_equals_attend_over_concatenation():
    q = jax.random.normal(jax.random.key(0), (2, 1, 3, 2, 8))
    k = jax.random.normal(jax.random.key(1), (2, 3, 10, 8))
    v = jax.random.normal(jax.random.key(2), (2, 3, 10, 8))
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 10)).at[:, :, -1].set(True)
    full = attend(q, k, v, mask)
    step = attend_step(q, k[:, :, :-1], v[:, :, :-1], mask[:, :, :-1], k[:, :, -1:],
                       v[:, :, -1:])
    np.testing.assert_allclose(step, full, atol=1e-6)


def test_kv_head_duplication_is_exact_and_mean_pooling_is_not():
    cfg = tiny(2, "gqa")
    params = model.init_params(cfg, jax.random.key(3))
    tokens = jax.random.randint(jax.random.key(4), (1, 9), 0, cfg.vocab_size)
    base, _ = fwd(params, cfg, tokens, positions(0, 9))
    mha = convert.convert_kv_heads(params, 4)
    assert mha["layers"]["attn"]["k_proj"]["kernel"].shape[2] == 4
    dup, _ = fwd(mha, cfg.replace(num_kv_heads=4, attention="mha"), tokens,
                           positions(0, 9))
    np.testing.assert_allclose(dup, base, atol=1e-5)
    mqa = convert.convert_kv_heads(params, 1)
    pooled = mqa["layers"]["attn"]["k_proj"]["kernel"]
    np.testing.assert_allclose(
        pooled[..., 0, :], np.asarray(params["layers"]["attn"]["k_proj"]["kernel"]).mean(2),
        rtol=1e-6)
    out, _ = fwd(mqa, cfg.replace(num_kv_heads=1, attention="mqa"), tokens,
                           positions(0, 9))
    assert np.abs(np.asarray(out - base)).max() > 1e-3


def test_position_p_logits_and_earlier_token_sensitivity():
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (1, 10), 0, cfg.vocab_size)
    full, _ = fwd(params, cfg, tokens, positions(0, 10))
    p = 7
    c = cache_lib.init_cache(cfg, 1, 16)
    _, c = fwd(params, cfg, tokens[:, :p], positions(0, p), c)
    step, _ = fwd(params, cfg, tokens[:, p:p + 1], positions(p, 1), c)
    np.testing.assert_allclose(step[:, 0], full[:, p], atol=1e-4)
    # Changing token 2 changes the decode step at position 7.
    changed = tokens.at[0, 2].set((tokens[0, 2] + 1) % cfg.vocab_size)
    c = cache_lib.init_cache(cfg, 1, 16)
    _, c = fwd(params, cfg, changed[:, :p], positions(0, p), c)
    step2, _ = fwd(params, cfg, changed[:, p:p + 1], positions(p, 1), c)
    assert np.abs(np.asarray(step2 - step)).max() > 1e-4


@pytest.mark.parametrize("scan_layers", [True, False])
def test_bf16_cache_stays_bf16_and_bytes_equal_theory(scan_layers):
    from kvjax.analysis import theory
    cfg = tiny(2, "gqa", scan_layers, dtype="bfloat16")
    params = model.init_params(cfg, jax.random.key(7))
    tokens = jax.random.randint(jax.random.key(8), (1, 6), 0, cfg.vocab_size)
    _, c = cached_logits(params, cfg, tokens, 3, max_seq_len=16)
    leaves = jax.tree.leaves(c.tensors)
    assert leaves and all(x.dtype == jnp.bfloat16 for x in leaves)
    # L·K·(H+H)·2 bytes per token x 16 slots = 3·2·16·2·16.
    assert cache_lib.cache_bytes(c) == theory.kv_cache_bytes(cfg, 16) == 3 * 2 * 16 * 2 * 16


def test_cache_is_head_major_with_int32_positions():
    cfg = tiny(2, "gqa", key_layout="BKSH", value_layout="BKSH")
    c = cache_lib.init_cache(cfg, 3, 11)
    assert c.tensors["k"].shape == (3, 3, 2, 11, 8)  # [L, B, K, S, H]
    assert c.positions.dtype == jnp.int32 and c.length.dtype == jnp.int32
    assert (np.asarray(c.positions) == -1).all()
    unrolled = cache_lib.init_cache(cfg.replace(scan_layers=False), 3, 11)
    assert len(unrolled.tensors["v"]) == 3 and unrolled.tensors["v"][0].shape == (3, 2, 11, 8)
    slot_last = cache_lib.init_cache(cfg.replace(key_layout="BKHS"), 3, 11)
    assert slot_last.tensors["k"].shape == (3, 3, 2, 8, 11)  # [L, B, K, H, S]
    assert slot_last.tensors["v"].shape == (3, 3, 2, 11, 8)


def test_auto_layout_on_cpu_is_keys_slot_last_values_slot_last_only_for_mha():
    assert jax.default_backend() == "cpu"
    for k, attention, v_layout in ((4, "mha", "BKHS"), (2, "gqa", "BKSH"), (1, "mqa", "BKSH")):
        cfg = tiny(k, attention)
        assert (cfg.cache_layout("k"), cfg.cache_layout("v")) == ("BKHS", v_layout)
        assert cache_lib.slot_axis(cfg, "v") == (-1 if v_layout == "BKHS" else -2)
    assert tiny(4, "mha", key_layout="BKSH").cache_layout("k") == "BKSH"


def test_a_cache_built_for_another_layout_is_refused():
    # S == H = 8: the shapes match, only the recorded layouts can tell.
    built = tiny(2, "gqa", key_layout="BKSH", value_layout="BKSH")
    run = built.replace(key_layout="BKHS")
    params = model.init_params(run, jax.random.key(3))
    c = cache_lib.init_cache(built, 1, 8)
    assert c.layouts == (("k", "BKSH"), ("v", "BKSH"))
    with pytest.raises(ValueError, match=r"cache layouts=\{'k': 'BKSH', 'v': 'BKSH'\} do not "
                                         r"match the model config's \{'k': 'BKHS'"):
        model.forward(params, run, jnp.zeros((1, 2), jnp.int32), positions(0, 2), c)
    # and jit keeps the record: it is static, part of the cache's tree structure
    with pytest.raises(ValueError, match="do not match"):
        fwd(params, run, jnp.zeros((1, 2), jnp.int32), positions(0, 2), c)


@pytest.mark.parametrize("attention, k", [("gqa", 2), ("mha", 4)])
def test_bf16_prefill_with_batch_two_runs_on_cpu(attention, k):
    """XLA:CPU rejects some batched bf16 x bf16 -> f32 dots (B=2, K=2 prefill);
    attention.dot_operand widens them. The bf16 logits follow the float32 model's."""
    cfg32 = tiny(k, attention)
    cfg = cfg32.replace(dtype="bfloat16")
    params32 = model.init_params(cfg32, jax.random.key(4))
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
    tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)
    got, c = cached_logits(params, cfg, tokens, 5, max_seq_len=8)
    want, _ = cached_logits(params32, cfg32, tokens, 5, max_seq_len=8)
    assert got.dtype == jnp.float32 and np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, want, atol=0.05 * float(jnp.abs(want).max()))


LAYOUTS = [("BKSH", "BKSH"), ("BKHS", "BKSH"), ("BKSH", "BKHS"), ("BKHS", "BKHS")]


@pytest.mark.parametrize("layouts", LAYOUTS, ids=["/".join(x) for x in LAYOUTS])
@pytest.mark.parametrize("variant, scan_layers", [("mha", True), ("gqa", False)])
def test_every_cache_layout_decodes_like_the_reference(layouts, variant, scan_layers):
    """Prefill + single steps in each key/value layout equal the numpy reference, and the
    cache holds the same keys/values (transposed) as the 'BKSH' one."""
    k, attention = VARIANTS[variant]
    base = tiny(k, attention, scan_layers, key_layout="BKSH", value_layout="BKSH")
    cfg = base.replace(key_layout=layouts[0], value_layout=layouts[1])
    params = model.init_params(tiny(k, attention), jax.random.key(11))
    tokens = jax.random.randint(jax.random.key(12), (2, 9), 0, cfg.vocab_size)
    ref = np.stack([reference.logits(params, cfg, np.asarray(row)) for row in tokens])
    params = model.params_for(cfg, params)
    got, c = cached_logits(params, cfg, tokens, 4, max_seq_len=12)
    np.testing.assert_allclose(got, ref, atol=1e-4)
    _, c_ref = cached_logits(params, base, tokens, 4, max_seq_len=12)
    for name, layout in zip("kv", layouts):
        want = c_ref.layer(1)[name] if scan_layers else c_ref.tensors[name][1]
        have = c.layer(1)[name] if scan_layers else c.tensors[name][1]
        if layout == "BKHS":
            have = jnp.swapaxes(have, -1, -2)
        np.testing.assert_allclose(have, want, atol=1e-6, err_msg=name)


def test_overflowing_write_poisons_logits_instead_of_clamping():
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(9))
    c = cache_lib.init_cache(cfg, 1, 4)
    tokens = jnp.zeros((1, 4), jnp.int32)
    out, c = fwd(params, cfg, tokens, positions(0, 4), c)
    assert np.isfinite(np.asarray(out)).all()
    out, _ = fwd(params, cfg, tokens[:, :1], positions(4, 1), c)
    assert np.isnan(np.asarray(out)).all()


def test_stack_unstack_round_trip():
    cfg = tiny()
    params = model.init_params(cfg, jax.random.key(10))
    un = model.unstack_layers(params, 3)
    assert "layers_2" in un and "layers" not in un
    chex.assert_trees_all_equal(model.stack_layers(un, 3), params)


@pytest.mark.slow
def test_real_gqa_to_mha_conversion_leaves_logits_unchanged(smollm2):
    loaded, _ = smollm2
    cfg = loaded.cfg
    ids = jnp.asarray([loaded.tokenizer.encode("The capital of France is")], jnp.int32)
    base, _ = fwd(loaded.params, cfg, ids, positions(0, ids.shape[1]))
    stacked = model.stack_layers(loaded.params, cfg.num_layers)
    mha_cfg = cfg.replace(num_kv_heads=9, attention="mha", scan_layers=True)
    mha, _ = fwd(convert.convert_kv_heads(stacked, 9), mha_cfg, ids,
                           positions(0, ids.shape[1]))
    np.testing.assert_allclose(mha, base, atol=2e-4)
