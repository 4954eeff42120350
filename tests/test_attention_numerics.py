"""Attention numerics: float32 weights into the value product (against a float64
reference), and zeros for a query row that sees no key, in every attention path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models import attention, mla

S = 4096
C = 5.375  # exact in bf16; w0 - C·(1 - w0) ~ 6e-4 for the top weight w0 ~ 0.843
# |output - float64 reference| allowed: float32 accumulation of the 4,096-term value
# product errs by ~1e-5 here (XLA:CPU's dot); weights rounded to bf16 err by ~1e-3.
BOUND = 5e-5


def peaked_problem(dtype, h=4):
    """One query, S keys: key 0 scores 10, every other key 0 (top weight e^10 / (e^10 +
    S - 1) ~ 0.843). Values: column 0 is 1 at key 0 and -C elsewhere (the output nearly
    cancels, so an error in the weights shows), column 1 is all ones (the weights' sum).
    Returns q [1, 1, 1, 1, H], k [1, 1, S, H], v [1, 1, S, 2] and the float64 output."""
    q = np.zeros((1, 1, 1, 1, h))
    q[..., 0] = np.sqrt(h)  # score = q·k / sqrt(H) = k[..., 0], exact for H = 4
    k = np.zeros((1, 1, S, h))
    k[0, 0, 0, 0] = 10.0
    v = np.ones((1, 1, S, 2))
    v[0, 0, 1:, 0] = -C
    w = np.exp(np.where(np.arange(S) == 0, 10.0, 0.0))
    w /= w.sum()
    ref = w @ v[0, 0]
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), ref)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_prefill_weights_stay_float32(dtype):
    """bf16 cache: rounding the weights to bf16 before the product erred by ~1.7e-3 per
    weight (here |out0 - ref| ~ 1e-2); float32 weights leave only the output rounding."""
    q, k, v, ref = peaked_problem(dtype)
    out = attention.attend(q, k, v, jnp.ones((1, 1, S), bool))
    got = np.asarray(out.astype(jnp.float32), np.float64)[0, 0, 0, 0]
    assert abs(ref[0]) < 1e-3  # the near-cancellation the test relies on
    assert abs(got[0] - ref[0]) < BOUND, (got, ref)
    assert abs(got[1] - 1.0) < 1e-4


def test_decode_step_weights_bound():
    """The step path (weights rounded unnormalised, denominator from the rounded
    weights) on the same problem: the new token is key 0."""
    q, k, v, ref = peaked_problem(jnp.bfloat16)
    out = attention.attend_step(q, k[:, :, 1:], v[:, :, 1:], jnp.ones((1, 1, S - 1), bool),
                                k[:, :, :1], v[:, :, :1])
    got = np.asarray(out.astype(jnp.float32), np.float64)[0, 0, 0, 0]
    assert abs(got[0] - ref[0]) < BOUND and abs(got[1] - 1.0) < 1e-4, (got, ref)


def mla_peaked_problem(dtype):
    """The same problem for MLA (absorbed): scores from the rotary parts (R = 2), values
    from the latent c_kv [1, S, 2] itself (the absorbed output is p·c_kv)."""
    q, k, v, ref = peaked_problem(jnp.float32)
    q_rope = jnp.asarray([[[[1.0, 0.0]]]])  # [B, T, N, R]
    k_rope = jnp.asarray(np.asarray(k)[0, 0, :, :2], dtype)[None]  # [1, S, 2]: key 0: 10
    q_main = jnp.zeros((1, 1, 1, 2), dtype)
    c_kv = jnp.asarray(np.asarray(v)[0, 0], dtype)[None]  # [1, S, 2]
    return q_main, q_rope.astype(dtype), c_kv, k_rope, ref


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_mla_prefill_weights_stay_float32(dtype):
    q_main, q_rope, c_kv, k_rope, ref = mla_peaked_problem(dtype)
    out = mla.attend_mla(q_main, q_rope, c_kv, k_rope, jnp.ones((1, 1, S), bool),
                         None, None, True, 1.0)
    got = np.asarray(out, np.float64)[0, 0, 0]
    assert abs(got[0] - ref[0]) < BOUND and abs(got[1] - 1.0) < 1e-4, (got, ref)


def test_mla_step_weights_bound():
    q_main, q_rope, c_kv, k_rope, ref = mla_peaked_problem(jnp.bfloat16)
    out = mla.attend_mla_step(q_main, q_rope, c_kv[:, 1:], k_rope[:, 1:],
                              jnp.ones((1, 1, S - 1), bool), c_kv[:, :1], k_rope[:, :1],
                              None, None, True, 1.0)
    got = np.asarray(out, np.float64)[0, 0, 0]
    assert abs(got[0] - ref[0]) < BOUND and abs(got[1] - 1.0) < 1e-4, (got, ref)


# ----------------------------------------------------------------- rows that see no key


def random_gqa(dtype, b=2, t=3, s=6, k=2, g=2, h=4, seed=0):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((b, t, k, g, h)), dtype)
    kk = jnp.asarray(r.standard_normal((b, k, s, h)), dtype)
    vv = jnp.asarray(r.standard_normal((b, k, s, h)) + 3.0, dtype)  # mean far from 0
    return q, kk, vv


def reference_attend(q, k, v, mask):
    """float64 softmax attention; zeros for rows with no visible key."""
    q, k, v = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    s = np.einsum("btkgh,bksh->bkgts", q, k) / np.sqrt(q.shape[-1])
    m = np.asarray(mask)[:, None, None]
    s = np.where(m, s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    e = np.where(m, np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    d = e.sum(-1, keepdims=True)
    p = e / np.where(d > 0, d, 1.0)
    return np.einsum("bkgts,bksv->btkgv", p, v)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("layouts", [("BKSH", "BKSH"), ("BKHS", "BKHS")])
def test_attend_row_without_keys_is_zero(dtype, layouts):
    q, k, v = random_gqa(dtype)
    mask = np.tril(np.ones((3, 6), bool), k=3)[None].repeat(2, 0)
    mask[0, 1] = False  # row (b=0, t=1) sees nothing
    mask[1] = False     # every row of sequence 1 (a padded sequence)
    kl, vl = layouts
    kk = k if kl == "BKSH" else jnp.swapaxes(k, 2, 3)
    vv = v if vl == "BKSH" else jnp.swapaxes(v, 2, 3)
    out = np.asarray(attention.attend(q, kk, vv, jnp.asarray(mask), kl, vl)
                     .astype(jnp.float32))
    assert (out[0, 1] == 0).all() and (out[1] == 0).all()
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out, reference_attend(q, k, v, mask), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_step_row_without_keys_is_zero(dtype):
    q, k, v = random_gqa(dtype, t=1)
    mask = np.ones((2, 1, 5), bool)
    mask[1] = False
    new_visible = jnp.asarray([True, False])
    out = np.asarray(attention.attend_step(q, k[:, :, :5], v[:, :, :5], jnp.asarray(mask),
                                           k[:, :, 5:], v[:, :, 5:],
                                           new_visible=new_visible).astype(jnp.float32))
    assert (out[1] == 0).all()
    full = np.concatenate([mask, np.ones((2, 1, 1), bool)], axis=2)
    full[1] = False
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(out, reference_attend(q, k, v, full), atol=tol, rtol=tol)
    # default: the new token sees itself, so no row is empty even with no old key visible
    out = np.asarray(attention.attend_step(q, k[:, :, :5], v[:, :, :5], jnp.asarray(mask),
                                           k[:, :, 5:], v[:, :, 5:]).astype(jnp.float32))
    np.testing.assert_allclose(out[1], np.broadcast_to(
        np.asarray(v[1, :, 5].astype(jnp.float32))[None, :, None], out[1].shape), rtol=1e-2)


@pytest.mark.parametrize("absorb", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_row_without_keys_is_zero(absorb, dtype):
    r = np.random.default_rng(1)
    b, t, s, n, c, rr, nope, vd = 2, 2, 5, 3, 4, 2, 2, 3
    arr = lambda *shape: jnp.asarray(r.standard_normal(shape) + 1.0, dtype)  # noqa: E731
    q_main = arr(b, t, n, c if absorb else nope)
    q_rope, c_kv, k_rope = arr(b, t, n, rr), arr(b, s, c), arr(b, s, rr)
    w_uk, w_uv = arr(n, c, nope), arr(n, c, vd)
    mask = np.ones((b, t, s), bool)
    mask[0, 1] = False
    out = np.asarray(mla.attend_mla(q_main, q_rope, c_kv, k_rope, jnp.asarray(mask),
                                    w_uk, w_uv, absorb, 0.5))
    assert (out[0, 1] == 0).all() and np.abs(out[0, 0]).max() > 0.1
    step = np.asarray(mla.attend_mla_step(
        q_main[:, :1], q_rope[:, :1], c_kv[:, :4], k_rope[:, :4],
        jnp.asarray(np.zeros((b, 1, 4), bool)), c_kv[:, 4:], k_rope[:, 4:], w_uk, w_uv,
        absorb, 0.5, new_visible=jnp.asarray([False, True])))
    assert (step[0] == 0).all() and np.abs(step[1]).max() > 0.1
