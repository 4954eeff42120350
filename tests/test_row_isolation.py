"""A row's bad values stay in its row (issue 32, item 2): no data dependency crosses rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.inference import decode
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
