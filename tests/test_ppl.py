"""Perplexity through the decode path, and the conversions it ablates."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.models import convert, model
from kvjax.training import data, evaluate
from kvjax.config import ModelConfig
from tests.conftest import tiny_config

V = 97
ECFG = evaluate.EvalConfig(context=16, num_tokens=48, batch_size=2, chunk=4)


def tiny(num_kv_heads=3, attention="gqa", **kw):
    return tiny_config(vocab_size=V, num_layers=1, d_model=24, num_heads=6,
                       num_kv_heads=num_kv_heads, mlp_dim=32, attention=attention,
                       scan_layers=False, **kw)


def windows(seed=0, m=3, t=16):
    return np.random.default_rng(seed).integers(0, V, (m, t)).astype(np.int32)


def small_params(cfg, seed=0):
    """Random params with a 0.1-scaled embedding: logits of order 1 (ppl in the tens)."""
    p = model.init_params(cfg.replace(scan_layers=True), seed)
    p["embed"]["embedding"] = p["embed"]["embedding"] * 0.1
    return p


def test_uniform_logits_give_perplexity_equal_to_vocab_size():
    cfg = tiny()
    params = model.params_for(cfg, model.init_params(cfg.replace(scan_layers=True), 0))
    params["embed"]["embedding"] = jnp.zeros_like(params["embed"]["embedding"])  # logits 0
    res = evaluate.perplexity(params, cfg, windows(), ECFG, np.full((V,), 2))
    assert res.ppl == pytest.approx(V, rel=1e-6)
    assert res.bits_per_byte == pytest.approx(math.log2(V) / 2, rel=1e-6)
    assert res.num_predicted == 3 * 15 and res.num_bytes == 2 * 3 * 15


@pytest.mark.parametrize("variant", ["gqa", "mqa", "window+sinks", "mla"])
def test_cached_perplexity_equals_full_forward(variant):
    cfg = {"gqa": tiny(), "mqa": tiny(1, "mqa"),
           "window+sinks": tiny(window_size=6, num_sink_tokens=2),
           "mla": tiny(6, "mla", kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=4,
                       v_head_dim=8)}[variant]
    params = model.params_for(cfg, small_params(cfg, 1))
    w = windows(1)
    cached, c = evaluate.nll_cached(params, cfg, w, chunk=4)
    full = evaluate.nll_full(params, cfg, w)
    ppl_c, ppl_f = math.exp(cached.mean()), math.exp(full.mean())
    assert abs(ppl_c - ppl_f) / ppl_f < 1e-4
    np.testing.assert_allclose(cached, full, atol=2e-5)
    assert c.num_slots == (6 if variant == "window+sinks" else 16)
    res = evaluate.perplexity(params, cfg, w, ECFG)
    assert res.check_rel_diff < 1e-4 and res.ppl == pytest.approx(ppl_c, rel=1e-6)


def test_mean_pooling_to_one_kv_head_thirds_the_cache():
    gqa = tiny()
    params = small_params(gqa)
    mqa = tiny(1, "mqa")
    pooled = convert.convert_kv_heads(params, 1)
    assert pooled["layers"]["attn"]["k_proj"]["kernel"].shape == (1, 24, 1, 8)
    res_g = evaluate.perplexity(model.params_for(gqa, params), gqa, windows(), ECFG)
    res_m = evaluate.perplexity(model.params_for(mqa, pooled), mqa, windows(), ECFG)
    c = cache_lib.init_cache(mqa, 2, 16)
    assert c.tensors["k"][0].shape == (2, 1, 8, 16)  # [B, K=1, H, S]: 'auto' keys on CPU
    assert res_m.cache_bytes * 3 == res_g.cache_bytes
    assert res_m.cache_bytes == cache_lib.cache_bytes(c)
    assert res_m.ppl != pytest.approx(res_g.ppl, rel=1e-3)  # mean-pooling changes the model


def test_duplicating_kv_heads_is_exact():
    gqa, mha = tiny(), tiny(6, "mha")
    params = small_params(gqa)
    dup = convert.convert_kv_heads(params, 6)
    a = evaluate.nll_full(model.params_for(gqa, params), gqa, windows())
    b = evaluate.nll_full(model.params_for(mha, dup), mha, windows())
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_mla_conversion_is_exact_at_full_rank_for_one_kv_head():
    """K = 1: RoRoPE keeps the whole key rotary, the latent holds the values (rank H)."""
    cfg = tiny(1, "mqa")
    params = small_params(cfg, 2)
    x = convert.attention_inputs(params, cfg, windows(3))
    mcfg, mparams = convert.gqa_to_mla(params, cfg, cfg.head_dim, x)
    assert (mcfg.kv_lora_rank, mcfg.qk_rope_head_dim) == (8, 8)
    mparams = jax.tree.map(jnp.asarray, model.params_for(mcfg, mparams))
    a = evaluate.nll_full(params, cfg.replace(scan_layers=True), windows())
    b, _ = evaluate.nll_cached(mparams, mcfg, windows(), chunk=4)
    np.testing.assert_allclose(a, b, atol=1e-4)
    # A lower rank is an approximation, but still a working model.
    lcfg, lparams = convert.gqa_to_mla(params, cfg, 4, x)
    low = evaluate.nll_full(jax.tree.map(jnp.asarray, model.params_for(lcfg, lparams)),
                            lcfg, windows())
    assert np.isfinite(low).all() and not np.allclose(low, a, atol=1e-3)


@pytest.mark.slow
def test_mha_conversion_leaves_real_perplexity_unchanged(smollm2):
    loaded, _ = smollm2
    text = ("The KV cache holds the keys and values of every token seen so far. Each "
            "decoding step reads all of it, so its size bounds the batch and the speed.")
    ids = np.asarray(loaded.tokenizer.encode(text)[:32], np.int32)[None]
    ecfg = evaluate.EvalConfig(context=32, num_tokens=32, batch_size=1, chunk=16)
    gqa = loaded.cfg
    res_g = evaluate.perplexity(loaded.params, gqa, ids, ecfg)
    mha = gqa.replace(num_kv_heads=9, attention="mha")
    stacked = model.stack_layers(loaded.params, gqa.num_layers)
    params = model.params_for(mha, convert.convert_kv_heads(stacked, 9))
    res_m = evaluate.perplexity(jax.tree.map(jnp.asarray, params), mha, ids, ecfg)
    assert res_m.ppl == pytest.approx(res_g.ppl, rel=1e-5)
    assert res_m.cache_bytes == 3 * res_g.cache_bytes
    assert res_g.check_rel_diff < 1e-4 and res_g.ppl < 1000  # uniform: 49,152


def test_eval_config_validates():
    with pytest.raises(ValueError, match="eval.chunk=5"):
        evaluate.EvalConfig(context=16, chunk=5)
    with pytest.raises(ValueError, match="eval.context=1"):
        evaluate.EvalConfig(context=1, chunk=1)
    assert data.eval_windows(np.arange(64, dtype=np.int32), 16, 48).shape == (3, 16)


def test_separator_is_not_text_two_documents(tmp_path):
    """Two documents joined by <|endoftext|> (id 0): "cab ba" (6 bytes) and "abc 12"
    (6 bytes). The window is the whole stream; its first token 'c' (1 byte) is context
    only, so 12 - 1 = 11 bytes of text are scored, in 5 - 1 + 4 = 8 text tokens; the two
    separator predictions are not scored (they used to add 2 x 13 bytes and 2 tokens)."""
    from tests.test_checkpoints import write_tiny_gguf  # noqa: PLC0415
    from kvjax.checkpoints import load_tokenizer  # noqa: PLC0415

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tok = load_tokenizer(path)
    docs = [data.Document("one.txt", "cab ba"), data.Document("two.txt", "abc 12")]
    stream = data.token_stream(docs, tok)
    assert [tok.decode([i]) for i in stream] == [
        "c", "ab", " ", "b", "a", "<|endoftext|>", "abc", " ", "1", "2", "<|endoftext|>"]
    lengths = data.token_byte_lengths(tok)
    assert lengths[0] == 0 and lengths[stream].sum() == 12
    v = tok.vocab_size
    cfg = ModelConfig(vocab_size=v, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1,
                      head_dim=4, mlp_dim=8, scan_layers=False)
    params = model.params_for(cfg, model.init_params(cfg.replace(scan_layers=True), 0))
    params["embed"]["embedding"] = jnp.zeros_like(params["embed"]["embedding"])  # uniform
    n = stream.size  # 11
    ecfg = evaluate.EvalConfig(context=n, num_tokens=n, batch_size=1, chunk=n,
                               check_full=False)
    res = evaluate.perplexity(params, cfg, stream[None], ecfg, lengths,
                              separator_id=data.separator_id(tok))
    assert (res.num_predicted, res.num_bytes, res.num_separators) == (8, 11, 2)
    assert res.nll_nats == pytest.approx(8 * math.log(v), rel=1e-6)
    assert res.bits_per_byte == pytest.approx(8 * math.log2(v) / 11, rel=1e-6)
