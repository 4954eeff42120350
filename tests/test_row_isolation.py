"""A row's bad values stay in its row (issue 32, item 2): no data dependency crosses rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.config import SamplingConfig
from kvjax.inference import decode
from kvjax.inference import ragged as ragged_lib
from kvjax.inference import sampling as sampling_lib
from kvjax.models import model
from tests.conftest import tiny_config, tiny_mla_config

PROMPT = 6


@pytest.mark.parametrize("make,scan", [(tiny_config, False), (tiny_config, True),
                                       (tiny_mla_config, False)],
                         ids=["gqa-unrolled", "gqa-scanned", "mla"])
@pytest.mark.parametrize("bad_row", [0, 1])
def test_a_nan_row_leaves_its_batch_mate_untouched(make, scan, bad_row):
    cfg = make(scan_layers=scan)
    params = model.params_for(cfg, model.init_params(cfg, 0))
    tokens = jax.random.randint(jax.random.key(3), (2, PROMPT), 0, cfg.vocab_size,
                                jnp.int32)
    _, cache = decode.prefill(params, cfg, tokens, cache_lib.init_cache(cfg, 2, 16))
    # poison the bad row's cached entries: its next step reads NaN
    row = lambda r: (slice(None), r) if scan else (r,)  # stacked [L, B, ...] or [B, ...]
    bad = cache.replace(tensors=jax.tree.map(
        lambda t: t.at[row(bad_row)].set(jnp.nan), cache.tensors))
    good_row = 1 - bad_row
    nxt = tokens[:, -1:]
    pos = jnp.full((2, 1), PROMPT, jnp.int32)
    clean_logits, clean_cache = model.forward(params, cfg, nxt, pos, cache)
    logits, after = model.forward(params, cfg, nxt, pos, bad)
    assert np.isnan(np.asarray(logits[bad_row])).all()
    np.testing.assert_array_equal(np.asarray(logits[good_row]),
                                  np.asarray(clean_logits[good_row]))
    for name in after.tensors:
        got = jax.tree.leaves(after.tensors[name])
        want = jax.tree.leaves(clean_cache.tensors[name])
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            np.testing.assert_array_equal(g[row(good_row)], w[row(good_row)])


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7),
                                      SamplingConfig(temperature=0.7, top_k=2),
                                      SamplingConfig(temperature=0.7, top_p=0.9)],
                         ids=["greedy", "temperature", "top_k", "top_p"])
def test_nonfinite_logits_are_reported_not_sampled(sampling):
    """Issue 32, item 3: an all-NaN, all -inf, +inf or partly NaN row gives NONFINITE,
    never a token id; finite rows (with -inf entries) sample as before."""
    inf = np.inf
    logits = jnp.asarray([[np.nan] * 3, [-inf] * 3, [1.0, np.nan, 2.0], [0.0, inf, 1.0],
                          [0.0, -inf, 5.0], [3.0, 0.0, 1.0]], jnp.float32)
    got = np.asarray(sampling_lib.sample_logits(logits, jax.random.key(0), sampling))
    assert list(got[:4]) == [sampling_lib.NONFINITE] * 4
    assert got[4] in (0, 2) and got[5] in (0, 1, 2)
    if sampling.greedy:
        assert list(got[4:]) == [2, 0]


def _poisoned(cfg, ragged):
    params = model.params_for(cfg, model.init_params(cfg, 0))
    tokens = jax.random.randint(jax.random.key(3), (2, PROMPT), 0, cfg.vocab_size,
                                jnp.int32)
    cache = cache_lib.init_cache(cfg, 2, 32, ragged=ragged)
    if ragged:
        logits, cache = ragged_lib.prefill_ragged(params, cfg, np.asarray(tokens),
                                                  [PROMPT, PROMPT], cache)
    else:
        logits, cache = decode.prefill(params, cfg, tokens, cache)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    bad = jax.tree.map(jnp.copy, cache)  # the generate calls donate their caches
    bad = bad.replace(tensors=jax.tree.map(lambda t: t.at[0].set(jnp.nan), bad.tensors))
    return params, first, cache, bad


def test_generate_stops_a_nonfinite_row_and_the_others_go_on():
    cfg = tiny_config(scan_layers=False)
    params, first, clean, bad = _poisoned(cfg, ragged=False)
    want, _, _ = decode.generate(params, cfg, first, clean, 6, eos_ids=-1)
    got, _, _ = decode.generate(params, cfg, first, bad, 6, eos_ids=-1)
    got, want = np.asarray(got), np.asarray(want)
    assert got[0, 0] == sampling_lib.NONFINITE and (got[0, 1:] == -1).all()
    np.testing.assert_array_equal(got[1], want[1])


def test_ragged_generate_stops_a_nonfinite_row_and_the_others_go_on():
    cfg = tiny_config(scan_layers=False)
    params, first, clean, bad = _poisoned(cfg, ragged=True)
    want, want_n, _ = ragged_lib.generate_ragged(params, cfg, first, clean, [5, 5])
    got, got_n, _ = ragged_lib.generate_ragged(params, cfg, first, bad, [5, 5])
    assert got[0, 0] == sampling_lib.NONFINITE and got_n[0] == 1
    np.testing.assert_array_equal(got[1], want[1])
    assert got_n[1] == want_n[1] == 5
