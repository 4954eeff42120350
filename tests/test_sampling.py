"""Sampling: the exact distribution of each filter against a float64 numpy reference,
boundaries and ties, draws with fixed keys, and every SamplingConfig field's domain."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.config import ConfigError, ModelConfig, SamplingConfig
from kvjax.inference import decode, sampling
from kvjax.models import model


def reference_probs(probs, temperature=1.0, top_k=0, top_p=1.0):
    """The documented rule in float64: sort descending (ties by index), keep the first
    min(top_k, V), then the smallest prefix whose mass reaches top_p; renormalise."""
    logits = np.log(np.asarray(probs, np.float64)) / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    kept = order[:min(top_k, len(p))] if top_k else order
    q = p[kept] / p[kept].sum()
    before = np.concatenate([[0.0], np.cumsum(q)[:-1]])
    kept = [i for i, m in zip(kept, before) if m < top_p - 1e-12]
    out = np.zeros(len(p))
    out[kept] = p[kept] / p[kept].sum()
    return out


CASES = [
    # the boundaries: 0.5 + 0.3 reaches 0.8 (0.79999995 in float32)
    ([0.3, 0.1, 0.1, 0.5], dict(top_p=0.8), [0.375, 0, 0, 0.625]),
    # ties at the cut-off: the lower index ranks first, one of the 0.2s is kept
    ([0.4, 0.2, 0.2, 0.2], dict(top_p=0.5), [2 / 3, 1 / 3, 0, 0]),
    ([0.2, 0.2, 0.2, 0.4], dict(top_k=2), [1 / 3, 0, 0, 2 / 3]),
    ([0.25, 0.25, 0.25, 0.25], dict(top_k=3, top_p=0.7), [1 / 3, 1 / 3, 1 / 3, 0]),
    ([0.25, 0.25, 0.25, 0.25], dict(top_p=0.5), [0.5, 0.5, 0, 0]),
    # just above a prefix mass: the next token is needed
    ([0.5, 0.3, 0.2], dict(top_p=0.8001), [0.5, 0.3, 0.2]),
    ([0.5, 0.3, 0.2], dict(top_p=0.5), [1, 0, 0]),
    ([0.5, 0.3, 0.2], dict(top_p=1e-9), [1, 0, 0]),
    # top_k at or above V keeps everything (clamped)
    ([0.1, 0.2, 0.3, 0.05, 0.05, 0.1, 0.1, 0.1], dict(top_k=13),
     [0.1, 0.2, 0.3, 0.05, 0.05, 0.1, 0.1, 0.1]),
    ([0.1, 0.2, 0.3, 0.05, 0.05, 0.1, 0.1, 0.1], dict(top_k=8),
     [0.1, 0.2, 0.3, 0.05, 0.05, 0.1, 0.1, 0.1]),
]


@pytest.mark.parametrize("probs,kw,expected", CASES)
def test_exact_distribution_at_boundaries_and_ties(probs, kw, expected):
    s = SamplingConfig(temperature=1.0, **kw)
    np.testing.assert_allclose(reference_probs(probs, **kw), expected, atol=1e-12)
    got = sampling.sampling_probs(jnp.log(jnp.asarray([probs], jnp.float32)), s)
    np.testing.assert_allclose(np.asarray(got[0]), expected, atol=2e-6)


@pytest.mark.parametrize("probs,kw,expected", CASES[:4] + CASES[8:9])
def test_draws_follow_the_distribution(probs, kw, expected):
    """n rows of the same logits drawn with one fixed key: tokens outside the nucleus are
    never drawn and each frequency is within 4.5 standard errors of its probability."""
    n = 20_000
    s = SamplingConfig(temperature=1.0, **kw)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs, jnp.float32)), (n, len(probs)))
    toks = np.asarray(jax.jit(sampling.sample_logits, static_argnums=2)(
        logits, jax.random.key(7), s))
    freq = np.bincount(toks, minlength=len(probs)) / n
    expected = np.asarray(expected)
    assert (freq[expected == 0] == 0).all(), freq
    se = np.sqrt(expected * (1 - expected) / n)
    assert (np.abs(freq - expected) <= 4.5 * se + 1e-12).all(), (freq, expected)


def test_random_logits_against_reference():
    rng = np.random.default_rng(0)
    for trial in range(30):
        v = int(rng.integers(2, 40))
        # a few exact ties in every row
        p = rng.choice([0.5, 1.0, 2.0, 3.0], size=v) * rng.choice([1.0, 1.0, 0.5], size=v)
        p /= p.sum()
        kw = dict(temperature=float(rng.choice([0.5, 1.0, 1.7])),
                  top_k=int(rng.choice([0, 1, 3, v, v + 5])),
                  top_p=float(rng.choice([1.0, 0.9, 0.5, 0.3])))
        got = sampling.sampling_probs(jnp.log(jnp.asarray([p], jnp.float32)),
                                      SamplingConfig(**kw))
        np.testing.assert_allclose(np.asarray(got[0]), reference_probs(p, **kw), atol=1e-5,
                                   err_msg=f"trial {trial}: {kw}")


def test_greedy_is_argmax_lowest_index_and_temperature_only_is_softmax():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0]])
    assert int(sampling.sample_logits(logits, jax.random.key(0), SamplingConfig())[0]) == 1
    np.testing.assert_array_equal(sampling.sampling_probs(logits, SamplingConfig()),
                                  [[0, 1, 0, 0]])
    got = sampling.sampling_probs(logits, SamplingConfig(temperature=2.0))
    np.testing.assert_allclose(got[0], reference_probs(np.exp([1.0, 3.0, 3.0, 0.0]),
                                                       temperature=2.0), atol=1e-6)


def test_top_k_above_vocabulary_compiles_in_the_decode_loop():
    """V = 8, top_k = 13: clamped to V (used to fail inside lax.top_k while compiling)."""
    cfg = ModelConfig(vocab_size=8, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                      head_dim=8, mlp_dim=16, scan_layers=False)
    params = model.init_params(cfg, 0)
    from kvjax import cache as cache_lib  # noqa: PLC0415
    cache = cache_lib.init_cache(cfg, 1, 8)
    logits, cache = decode.prefill(params, cfg, jnp.asarray([[1, 2]], jnp.int32), cache)
    s = SamplingConfig(temperature=1.0, top_k=13)
    first = sampling.sample_logits(logits, jax.random.key(0), s)
    toks, steps, _ = decode.generate(params, cfg, first, cache, 4, jax.random.key(1), s)
    assert steps == 4 and toks.shape == (1, 4) and bool(((toks >= 0) & (toks < 8)).all())


@pytest.mark.parametrize("field,value,pattern", [
    ("temperature", -0.1, r"sampling.temperature=-0.1; allowed: a finite number >= 0"),
    ("temperature", math.inf, r"sampling.temperature=inf"),
    ("temperature", math.nan, r"sampling.temperature=nan"),
    ("temperature", "hot", r"sampling.temperature='hot'"),
    ("top_k", -1, r"sampling.top_k=-1; allowed: an integer >= 0"),
    ("top_k", 2.5, r"sampling.top_k=2.5"),
    ("top_k", True, r"sampling.top_k=True"),
    ("top_p", 0.0, r"sampling.top_p=0.0; allowed: a number in \(0, 1\]"),
    ("top_p", 1.5, r"sampling.top_p=1.5"),
    ("top_p", math.nan, r"sampling.top_p=nan"),
    ("seed", 1.5, r"sampling.seed=1.5; allowed: an integer"),
    ("seed", None, r"sampling.seed=None"),
])
def test_every_field_is_checked(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        SamplingConfig(**{field: value})


TINY_TEMPERATURES = [1e-45, 1e-40, 1e-38, 2.0 ** -126, 1e-37, 5e-36, 1e-30]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
@pytest.mark.parametrize("kw", [{}, dict(top_k=3), dict(top_p=0.9)])
def test_tiny_temperatures_behave_as_greedy(temperature, kw):
    """T -> 0 is the argmax: subnormal T (flushed to 0 by XLA:CPU) used to give token 0
    at every step; a normal but tiny T sent several logits / T to inf, and the draw took
    the first inf, not the largest logit."""
    logits = jnp.asarray([[-3.0, 80.0, 100.0, 99.0, -jnp.inf],
                          [5.0, 7.0, 2.0, 1.0, 6.5],
                          [-200.0, -150.0, -100.0, -120.0, -101.0]], jnp.bfloat16)
    s = SamplingConfig(temperature=temperature, **kw)
    draw = jax.jit(sampling.sample_logits, static_argnums=2)
    for seed in range(8):
        np.testing.assert_array_equal(draw(logits, jax.random.key(seed), s), [2, 1, 2])
    np.testing.assert_array_equal(sampling.sampling_probs(logits, s),
                                  np.eye(5, dtype=np.float32)[[2, 1, 2]])


def test_temperatures_below_the_float32_normal_range_are_greedy():
    from kvjax.config import MIN_SAMPLING_TEMPERATURE  # noqa: PLC0415
    assert MIN_SAMPLING_TEMPERATURE == float(jnp.finfo(jnp.float32).tiny)
    assert SamplingConfig(temperature=0.0).greedy
    assert SamplingConfig(temperature=1e-40).greedy
    assert SamplingConfig(temperature=MIN_SAMPLING_TEMPERATURE / 2).greedy
    assert not SamplingConfig(temperature=MIN_SAMPLING_TEMPERATURE).greedy
    assert not SamplingConfig(temperature=1e-30).greedy


def test_huge_temperature_is_uniform_and_shift_keeps_the_softmax():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 0.0]])
    got = sampling.sampling_probs(logits, SamplingConfig(temperature=1e38))
    np.testing.assert_allclose(got[0], [0.25] * 4, atol=1e-7)
    got = sampling.sampling_probs(logits + 1e4, SamplingConfig(temperature=0.5))
    np.testing.assert_allclose(got[0], reference_probs(np.exp([1.0, 3.0, 3.0, 0.0]),
                                                       temperature=0.5), atol=1e-6)


@pytest.mark.parametrize("temperature", [1e-40, 1e-37])
def test_tiny_temperature_decodes_the_greedy_tokens(temperature):
    """The generate loop with a tiny temperature gives the greedy tokens (used to be
    token 0 at every step for T = 1e-40)."""
    cfg = ModelConfig(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                      head_dim=8, mlp_dim=16, scan_layers=False)
    params = model.init_params(cfg, 0)
    from kvjax import cache as cache_lib  # noqa: PLC0415
    out = []
    for s in (SamplingConfig(), SamplingConfig(temperature=temperature)):
        cache = cache_lib.init_cache(cfg, 1, 16)
        logits, cache = decode.prefill(params, cfg, jnp.asarray([[1, 2, 3]], jnp.int32),
                                       cache)
        first = sampling.sample_logits(logits, jax.random.key(0), s)
        toks, _, _ = decode.generate(params, cfg, first, cache, 8, jax.random.key(1), s)
        out.append(np.asarray(toks))
    assert (out[0] != 0).any(), out[0]
    np.testing.assert_array_equal(out[1], out[0])
