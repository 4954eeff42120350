"""Attention sinks at cache positions (StreamingLLM, Xiao et al. 2023, sec. 3.2) against
absolute positions (issue: sinks past the model's training length)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import decode
from kvjax.models import model
from tests.conftest import tiny_ring_config

W, S = 6, 2  # window slots, of which sinks


def tiny(layers=1, rope_positions="cache", window=W, sinks=S) -> ModelConfig:
    return tiny_ring_config(window, sinks, vocab_size=53, num_layers=layers,
                            rope_positions=rope_positions, scan_layers=False, rope_theta=100.0)


def stream_logits(cfg, params, tokens, chunk):
    """Last-token logits after feeding ``tokens`` through a ring cache, ``chunk`` tokens
    at a time (the last one as a single decode step)."""
    cache = cache_lib.init_cache(cfg, 1, W)  # W slots: a ring never fills
    toks = jnp.asarray([tokens], jnp.int32)
    n = len(tokens)
    for start in range(0, n - 1, chunk):
        _, cache = decode.prefill(params, cfg, toks[:, start:min(start + chunk, n - 1)], cache)
    logits, _ = decode.decode_step(params, toks[:, n - 1:], cache, cfg=cfg)
    return np.asarray(logits[0])


@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_one_layer_equals_full_attention_on_the_compressed_stream(chunk):
    """With one layer, the last token of a long stream sees exactly the s sinks and the
    W - s newest tokens; with cache positions its logits equal a full-attention forward
    over that compressed sequence at positions 0..W-1 (the definition of StreamingLLM's
    positions). Absolute positions differ (the sinks sit 40+ positions away)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 53, 47).tolist()
    cfg = tiny()
    params = model.init_params(cfg, 1)
    got = stream_logits(cfg, params, tokens, chunk)
    compressed = tokens[:S] + tokens[-(W - S):]
    dense = tiny(window=None, sinks=0, rope_positions="absolute")
    ref, _ = model.forward(params, dense, jnp.asarray([compressed]),
                           jnp.arange(W, dtype=jnp.int32)[None])
    np.testing.assert_allclose(got, ref[0, -1], atol=2e-5, rtol=0)
    absolute = stream_logits(tiny(rope_positions="absolute"), params, tokens, chunk)
    assert np.abs(absolute - ref[0, -1]).max() > 1e-3


def test_cache_positions_make_the_stream_offset_invariant():
    """Two layers, the same sinks and the same final text after fillers of 20, 300 and
    3,000 tokens: with cache positions the text's last logits agree at every offset once
    the ring holds only text; with absolute positions they drift with the offset."""
    rng = np.random.default_rng(1)
    sinks, text = rng.integers(0, 53, S).tolist(), rng.integers(0, 53, 3 * W).tolist()
    params = model.init_params(tiny(layers=2), 2)
    out = {}
    for mode in ("cache", "absolute"):
        cfg = tiny(layers=2, rope_positions=mode)
        out[mode] = [stream_logits(cfg, params, sinks + rng.integers(0, 53, n).tolist() + text,
                                   chunk=64) for n in (20, 300, 3000)]
    for other in out["cache"][1:]:
        np.testing.assert_allclose(other, out["cache"][0], atol=5e-4, rtol=0)
    assert max(np.abs(o - out["absolute"][0]).max() for o in out["absolute"][1:]) > 1e-2


def test_rope_positions_validation():
    with pytest.raises(ConfigError, match="model.rope_positions='streaming'"):
        tiny(rope_positions="streaming")
    with pytest.raises(ConfigError, match="num_sink_tokens > 0"):
        tiny(rope_positions="cache", sinks=0)
    assert tiny(rope_positions="absolute", sinks=0).rope_positions == "absolute"
