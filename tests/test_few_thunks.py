"""A decode step's per-row sums in few XLA:CPU thunks (kvjax.ops.lane_sum): RMSNorm and
the new token's merge run as fewer fusions, with the same values and greedy tokens
(docs/decisions/0036-row-sums-in-parts.md)."""

import re

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


@pytest.mark.skipif(not native.load(), reason="native kernels not built")
@pytest.mark.parametrize("m,k,n,layout,split,lanes", [
    (1, 576, 960, "kn", "columns", False),  # a decode step's q/k/v (the K-split walk)
    (3, 64, 200, "kn", "columns", False),  # column panels
    (3, 96, 200, "kn", "k", False),  # several rows split by K
    (2, 40, 33, "nk", "columns", False),  # K not a multiple of the vector width
    (5, 64, 50, "nk", "columns", True),  # rows in the lanes
])
def test_the_rows_kernel_applies_the_norm(m, k, n, layout, split, lanes):
    """rows_matmul(x, w, norm=(g, eps)) is RMSNorm(x) times w (the numpy reference's
    norm), for every split and layout the kernel has."""
    from kvjax.native import rows_matmul as rm  # noqa: PLC0415

    gen = np.random.default_rng(m * k)
    x = (gen.standard_normal((m, k)) * 3).astype(np.float32)
    g = gen.uniform(0.5, 1.5, k).astype(np.float32)
    w = gen.standard_normal((k, n) if layout == "kn" else (n, k)).astype(np.float32)
    got = rm.rows_matmul(jnp.asarray(x), jnp.asarray(w), layout, split, lanes,
                         norm=(jnp.asarray(g), 1e-5))
    xn = reference.rms_norm(x.astype(np.float64), g.astype(np.float64), 1e-5)
    want = xn @ (w if layout == "kn" else w.T).astype(np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match=rf"norm scale is float32\[{k + 1}\]; allowed: "
                                         rf"float32\[{k}\]"):
        rm.rows_matmul(jnp.asarray(x), jnp.asarray(w), layout, norm=(jnp.ones(k + 1), 1e-5))


@pytest.mark.skipif(not native.load(), reason="native kernels not built")
def test_the_normed_product_has_the_norms_gradient():
    """The normed kernel's backward is the gradient of RMSNorm(x) @ w (XLA's)."""
    from kvjax.native import rows_matmul as rm  # noqa: PLC0415

    gen = np.random.default_rng(7)
    x, g, w = (jnp.asarray(gen.standard_normal(s), jnp.float32)
               for s in ((2, 64), (64,), (64, 24)))
    loss = lambda f: lambda x, g, w: jnp.sum(jnp.sin(f(x, g, w)))  # noqa: E731
    got = jax.grad(loss(lambda x, g, w: rm.rows_matmul(x, w, norm=(g, 1e-5))),
                   argnums=(0, 1, 2))(x, g, w)
    want = jax.grad(loss(lambda x, g, w: x * jax.lax.rsqrt(
        jnp.mean(x * x, -1, keepdims=True) + 1e-5) * g[None] @ w), argnums=(0, 1, 2))(x, g, w)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not native.load(), reason="native kernels not built")
@pytest.mark.parametrize("tie", [False, True])
def test_native_products_take_their_norms(tie):
    """With native weight products and fused projections, the norms before q/k/v,
    gate/up and the LM head run inside the kernel (2·L + 1 normed custom calls, no norm
    fusions left: 4 thunks fewer a layer), with the XLA formulation's greedy tokens and
    the numpy reference's logits
    (docs/decisions/0042-rmsnorm-in-the-rows-kernel.md)."""
    from kvjax.analysis import costs  # noqa: PLC0415
    from kvjax.native import rows_matmul as rm  # noqa: PLC0415

    cfg = tiny_config(tie_embeddings=tie, d_model=64, scan_layers=False)
    params = model.init_params(cfg, 2)
    prompt = jnp.array([[5, 17, 3, 60, 2]], jnp.int32)
    want, want_logits = _greedy(params, cfg, prompt, 6)
    nat = planner.resolve(cfg.replace(weight_matmul="native", decode_attention="native"),
                          max_seq_len=32)
    got, got_logits = _greedy(model.fuse_projections(nat, params), nat, prompt, 6)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    seq = np.concatenate([np.asarray(prompt[0]), want[:-1]])
    np.testing.assert_allclose(got_logits, reference.logits(
        model.stack_layers(params, cfg.num_layers), cfg, seq), atol=1e-4)
    text = costs.compile_decode_step(nat, 1, 32).as_text()
    assert text.count(f'custom_call_target="{rm.TARGET_NORM}"') == 2 * cfg.num_layers + 1
    entry = text[text.index("\nENTRY"):].splitlines()  # no fusion runs a norm's ops
    assert not [line for line in entry if "fusion(" in line
                and re.search(r"/(attn|mlp|final)_norm/", line)]
