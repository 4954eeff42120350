"""Ragged batches (kvjax/inference/ragged.py): prompts of different lengths prefilled and
decoded together give, row for row, exactly the greedy tokens of each prompt run alone
through the lockstep path (decode.prefill + decode.generate, batch 1), for every
attention variant and cache kind. Tiny random float32 models, CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.cache.policy import CacheOverflowError
from kvjax.config import ModelConfig
from kvjax.inference import decode, ragged
from kvjax.models import model

BASE = dict(vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
            head_dim=8, mlp_dim=48, mlp_type="swiglu", attention="gqa",
            tie_embeddings=False, dtype="float32", name="tiny")
MLA = dict(BASE, d_model=64, num_heads=4, num_kv_heads=4, head_dim=24, attention="mla",
           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)

VARIANTS = {
    "mha": dict(BASE, num_kv_heads=4, attention="mha"),
    "gqa": dict(BASE),
    "mqa": dict(BASE, num_kv_heads=1, attention="mqa"),
    "gqa_bksh_scan": dict(BASE, key_layout="BKSH", value_layout="BKSH", scan_layers=True),
    "gqa_bkhs_unrolled": dict(BASE, key_layout="BKHS", value_layout="BKHS",
                              scan_layers=False),
    "window": dict(BASE, window_size=6),
    "window_sinks": dict(BASE, window_size=6, num_sink_tokens=2),
    "window_sinks_scan": dict(BASE, window_size=6, num_sink_tokens=2, scan_layers=True),
    "mla_absorbed": dict(MLA),
    "mla_naive": dict(MLA, mla_absorb=False),
    "mla_scan": dict(MLA, scan_layers=True),
}
S = 24  # cache slots of the dense variants
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14], [7], [23, 45, 61, 8, 12]]
BUDGETS = [6, 9, 4]


@functools.lru_cache(maxsize=None)
def params_of(name: str):
    cfg = ModelConfig(**VARIANTS[name])
    return model.params_for(cfg, model.init_params(cfg, 1))


def alone(cfg, params, prompt, steps, eos_id=-1):
    """Reference: the prompt alone through the lockstep path."""
    cache = cache_lib.init_cache(cfg, 1, S)
    logits, cache = decode.prefill(params, cfg, jnp.asarray([prompt], jnp.int32), cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    toks, _, _ = decode.generate(params, cfg, first, cache, steps, eos_ids=eos_id)
    return np.asarray(logits[0]), int(first[0]), np.asarray(toks[0])


def run_ragged(cfg, params, prompts, budgets, eos_id=-1, pad_to=None):
    tokens, lengths = ragged.pad_prompts(prompts, length=pad_to)
    cache = cache_lib.init_cache(cfg, len(prompts), S, ragged=True)
    logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    toks, counts, cache = ragged.generate_ragged(params, cfg, first, cache, budgets,
                                                 eos_ids=eos_id)
    return np.asarray(logits), np.asarray(first), toks, counts, cache


# not "mha" (K = N = 4): the model runs gqa's einsums for it (G = 1; no branch on G),
# which the gqa cases check here, and test_model checks K = N against the reference
@pytest.mark.parametrize("name", sorted(set(VARIANTS) - {"mha"}))
def test_ragged_equals_alone(name):
    cfg = ModelConfig(**VARIANTS[name])
    params = params_of(name)
    logits, first, toks, counts, cache = run_ragged(cfg, params, PROMPTS, BUDGETS)
    for b, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS)):
        ref_logits, ref_first, ref_toks = alone(cfg, params, prompt, budget)
        np.testing.assert_allclose(logits[b], ref_logits, rtol=2e-5, atol=2e-5)
        assert first[b] == ref_first, (name, b)
        assert counts[b] == budget
        np.testing.assert_array_equal(toks[b, :budget], ref_toks, err_msg=f"{name} row {b}")
        assert (toks[b, budget:] == -1).all()
    # Each row's length is its own: prompt + generated tokens.
    np.testing.assert_array_equal(np.asarray(cache.length),
                                  [len(p) + n for p, n in zip(PROMPTS, BUDGETS)])


def test_ring_wraps_in_prefill_and_padding_never_evicts():
    """W = 6: the 11-token prompt wraps the ring inside the prefill; the padded tail of
    the 1- and 5-token rows is never written (their slots past the prompt stay empty)."""
    cfg = ModelConfig(**VARIANTS["window_sinks"])
    tokens, lengths = ragged.pad_prompts(PROMPTS, length=14)
    cache = cache_lib.init_cache(cfg, 3, S, ragged=True)
    _, cache = ragged.prefill_ragged(params_of("window_sinks"), cfg, tokens, lengths, cache)
    pos = np.asarray(cache.positions)
    # sinks 0, 1 and the last 4 positions of the 11-token prompt (7..10) in ring slots.
    assert sorted(pos[0].tolist()) == [0, 1, 7, 8, 9, 10]
    assert pos[1].tolist() == [0, -1, -1, -1, -1, -1]
    assert sorted(pos[2].tolist()) == [-1, 0, 1, 2, 3, 4]
    np.testing.assert_array_equal(np.asarray(cache.length), [11, 1, 5])


def test_rows_of_length_one_and_full_cache():
    """A 1-token row and a row whose prompt fills the dense cache (budget 0)."""
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    full = [int(x) for x in np.arange(S) * 7 % 97]
    logits, first, toks, counts, cache = run_ragged(cfg, params, [[3], full], [5, 0])
    ref_logits, ref_first, ref_toks = alone(cfg, params, [3], 5)
    np.testing.assert_array_equal(toks[0], ref_toks)
    assert counts.tolist() == [5, 0]
    ref_full, _, _ = alone(cfg, params, full, 0)
    np.testing.assert_allclose(logits[1], ref_full, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache.length), [6, S])


def test_eos_per_row_and_finished_rows_not_written():
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    _, _, ref = alone(cfg, params, PROMPTS[0], 6)
    eos = int(ref[2])  # row 0 emits it as its third generated token
    _, _, toks, counts, cache = run_ragged(cfg, params, PROMPTS, [8, 8, 8], eos_id=eos)
    assert counts[0] == 3 and toks[0, 2] == eos and (toks[0, 3:] == -1).all()
    for b in (1, 2):
        _, _, want = alone(cfg, params, PROMPTS[b], 8, eos_id=eos)
        stop = next((i + 1 for i, t in enumerate(want) if t == eos), 8)
        assert counts[b] == stop
        np.testing.assert_array_equal(toks[b, :stop], want[:stop])
    # Row 0 stopped after 3 tokens: its cache holds prompt + 3, nothing more.
    assert int(cache.length[0]) == len(PROMPTS[0]) + 3
    assert int(np.asarray(cache.positions[0]).max()) == len(PROMPTS[0]) + 2


def test_padded_query_rows_output_zeros():
    """A padded token sees no key: its attention output is exactly zero (no NaN, no mean
    of masked values), in the prefill (T > 1) and the decode step (T = 1)."""
    from kvjax.models.attention import Attention
    cfg = ModelConfig(**VARIANTS["gqa"])
    attn = Attention(cfg)
    x = jax.random.normal(jax.random.key(0), (2, 3, cfg.d_model))
    cache = cache_lib.init_cache(cfg, 2, 8, ragged=True)
    pos = jnp.asarray([[0, 1, 2], [0, -1, -1]], jnp.int32)
    p = attn.init(jax.random.key(1), x, pos, cache.layer(0), cache.positions)
    # o_proj of zeros is zeros: compare with the projection's bias-free output.
    out, _ = attn.apply(p, x, pos, cache.layer(0), cache.positions)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out[1, 1:]), 0.0)
    assert np.abs(np.asarray(out[1, 0])).max() > 0
    out1, _ = attn.apply(p, x[:, :1], jnp.asarray([[0], [-1]], jnp.int32), cache.layer(0),
                         cache.positions)
    np.testing.assert_array_equal(np.asarray(out1[1]), 0.0)


def test_bad_input():
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    with pytest.raises(ValueError, match="row 1 is empty"):
        ragged.pad_prompts([[1, 2], []])
    tokens, lengths = ragged.pad_prompts([[1, 2], [3] * (S + 1)])
    with pytest.raises(CacheOverflowError, match=r"row 1"):
        ragged.prefill_ragged(params, cfg, tokens, lengths,
                              cache_lib.init_cache(cfg, 2, S, ragged=True))
    with pytest.raises(ValueError, match="lockstep"):
        ragged.prefill_ragged(params, cfg, tokens[:, :2], [2, 2],
                              cache_lib.init_cache(cfg, 2, S))
    tokens, lengths = ragged.pad_prompts([[1, 2], [3] * 10])
    _, cache = ragged.prefill_ragged(params, cfg, tokens, lengths,
                                     cache_lib.init_cache(cfg, 2, S, ragged=True))
    with pytest.raises(CacheOverflowError, match=r"row 1"):
        ragged.generate_ragged(params, cfg, jnp.zeros(2, jnp.int32), cache, [1, S - 9])
    with pytest.raises(ValueError, match=r"budgets\[0\]=-1"):
        ragged.generate_ragged(params, cfg, jnp.zeros(2, jnp.int32), cache, [-1, 1])


def test_sampled_rows_follow_their_request_not_their_place_in_the_batch():
    """Issue 54 item 4: at temperature 0.8 a prompt's tokens (its first, from the
    prefill, and the loop's) are the same in row 0 and in row 1, its key following its
    request id (``row_keys_for``, the engine's rule); two requests of one prompt draw
    differently; a sampled call that names no request is refused."""
    from kvjax.config import SamplingConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    hot = SamplingConfig(temperature=0.8)
    rng = jax.random.key(5)
    a, c = PROMPTS[0], PROMPTS[2]

    def run(prompts, ids):
        tokens, lengths = ragged.pad_prompts(prompts)
        cache = cache_lib.init_cache(cfg, len(prompts), S, ragged=True)
        logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
        first = ragged.first_tokens(logits, ragged.row_keys_for(rng, ids), hot)
        toks, _, _ = ragged.generate_ragged(params, cfg, first, cache, [8] * len(prompts),
                                            rng=rng, sampling=hot, request_ids=ids)
        return [[int(f)] + list(map(int, t)) for f, t in zip(np.asarray(first), toks)]

    ac = run([a, c], [10, 2**40 + 3])
    ca = run([c, a], [2**40 + 3, 10])
    assert ac == ca[::-1]
    twice = run([a, a], [10, 11])
    assert twice[0] == ac[0] and twice[1] != twice[0]  # one key per request
    cache = cache_lib.init_cache(cfg, 2, S, ragged=True)
    with pytest.raises(ValueError, match="temperature=0.8 with neither request_ids nor "
                                         "row_keys"):
        ragged.generate_ragged(params, cfg, jnp.zeros(2, jnp.int32), cache, [1, 1],
                               sampling=hot)
    with pytest.raises(ValueError, match="1 request_ids for a cache of 2 rows"):
        ragged.generate_ragged(params, cfg, jnp.zeros(2, jnp.int32), cache, [1, 1],
                               sampling=hot, request_ids=[3])
