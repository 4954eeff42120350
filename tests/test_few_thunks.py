"""A decode step's per-row sums in few XLA:CPU thunks (kvjax.ops.lane_sum): RMSNorm and
the new token's merge run as fewer fusions, with the same values and greedy tokens
(docs/decisions/0036-row-sums-in-parts.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import ops, planner
from kvjax.models import model
from kvjax.models.layers import RMSNorm
from kvjax import native
from scripts.thunk_count import entry_ops
from tests import reference
from tests.conftest import tiny_config
from tests.test_fused_projections import _greedy


@pytest.mark.parametrize("x_shape,like_shape", [
    ((1, 1, 576), (1, 1, 960)),  # few rows, parts of 32: a norm before a product
    ((1, 2, 3, 64), (1, 2, 3, 64)),  # a decode step's scores [B, K, G, H]
    ((40, 576), (40, 576)),  # 40 rows: over MAX_ADDS, the plain sum
    ((2, 48), (2, 48)),  # not a multiple of 32: the plain sum
])
def test_lane_sum_is_the_rows_sum_in_every_element(x_shape, like_shape):
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    like = jnp.zeros(like_shape, jnp.float32)
    got = np.asarray(jax.jit(ops.lane_sum)(jnp.asarray(x), like))
    want = np.sum(x.astype(np.float64), axis=-1, keepdims=True)
    assert got.shape == like_shape
    np.testing.assert_allclose(got, np.broadcast_to(want, like_shape), rtol=1e-5, atol=1e-5)


def test_lane_sum_keeps_nan_and_inf_rows_apart():
    """A row's inf or NaN reaches its own row only (the 0 * like term is 0 for finite
    elements of like)."""
    x = np.ones((1, 3, 64), np.float32)
    x[0, 1, 5] = np.inf
    got = np.asarray(ops.lane_sum(jnp.asarray(x), jnp.zeros((1, 3, 8))))
    np.testing.assert_array_equal(got[0, [0, 2]], 64.0)
    assert np.all(np.isinf(got[0, 1]))


def test_a_few_rows_norm_is_two_thunks():
    """x = a + h; RMSNorm(x) of one row of D = 576 (SmolLM2): the sum of squares' parts and
    the scaling, beside the add (XLA:CPU's plain mean took four: square, reduce-window,
    rsqrt, scaling)."""
    norm = RMSNorm(1e-5)
    params = {"params": {"scale": jnp.linspace(0.5, 1.5, 576)}}
    a = jax.random.normal(jax.random.key(0), (1, 1, 576))
    h = jax.random.normal(jax.random.key(1), (1, 1, 576))
    step = jax.jit(lambda p, a, h: (a + h, norm.apply(p, a + h)))
    ops_ = entry_ops(step.lower(params, a, h).compile().as_text())
    assert sum(ops_.values()) == 3, ops_
    x = np.asarray(a + h, np.float64)[0]
    want = reference.rms_norm(x, np.asarray(params["params"]["scale"]), 1e-5)
    np.testing.assert_allclose(np.asarray(step(params, a, h)[1])[0], want, rtol=2e-6,
                               atol=2e-6)


@pytest.mark.skipif(not native.load(), reason="native kernels not built")
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_native_steps_with_parted_sums_decode_the_reference_tokens(kv_heads):
    """D = 64 and H = 64 (two parts of 32 each), the native decode kernel and its merge
    of the new token: the XLA formulation's greedy tokens and logits, and the numpy
    reference's logits."""
    cfg = tiny_config(tie_embeddings=False, d_model=64, head_dim=64, num_kv_heads=kv_heads)
    params = model.init_params(cfg, 2)
    prompt = jnp.array([[5, 17, 3, 60, 2]], jnp.int32)
    want, want_logits = _greedy(params, cfg, prompt, 6)
    native = planner.resolve(cfg.replace(decode_attention="native"), max_seq_len=32)
    got, got_logits = _greedy(model.fuse_projections(native, params), native, prompt, 6)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    seq = np.concatenate([np.asarray(prompt[0]), want[:-1]])
    np.testing.assert_allclose(got_logits, reference.logits(params, cfg, seq), atol=1e-4)
