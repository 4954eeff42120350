"""Token sampling: greedy, temperature, top-k and nucleus (top-p), by sorted position.

The rule (one definition, shared by :func:`sample_logits` and :func:`sampling_probs`):

1. temperature 0 is greedy: the argmax (the lowest index among equal maxima); so is a
   temperature below ``kvjax.config.MIN_SAMPLING_TEMPERATURE`` (2^-126, float32's
   smallest normal number: the limit T -> 0; ``SamplingConfig.greedy`` is the one test).
2. Otherwise each row's logits, in float32, less the row's (finite) maximum, are divided
   by the temperature and sorted in descending order, ties broken by index (the lower
   index ranks first). The shift leaves the softmax unchanged and keeps every scaled
   logit <= 0: a tiny temperature sends the others to -inf (probability 0), never the
   maximum to inf or NaN, so every temperature behaves as its limit.
3. top-k keeps the first ``min(top_k, V)`` sorted positions: a ``top_k`` at or above the
   vocabulary V keeps every token (clamped, as Hugging Face's ``TopKLogitsWarper`` does;
   the vocabulary is a property of the model, not of the config).
4. top-p keeps the smallest prefix of the sorted, renormalised distribution whose mass
   reaches ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text
   Degeneration", sec. 3.1): position i is kept iff the mass *before* it is below top_p.
   Masses are float32 sums, so a prefix mass within :data:`MASS_TOLERANCE` of top_p counts
   as reaching it: for [0.5, 0.3, 0.1, 0.1] and top_p = 0.8 the mass before the first 0.1
   sums to 0.79999995 in float32 and the nucleus is still {0.5, 0.3}. The first position
   is always kept.
5. A token is drawn from the kept positions with probabilities proportional to their
   softmax (``jax.random.categorical`` over the sorted, filtered logits).

Filters act on sorted *positions*, never on logit values, so tied tokens on either side
of a cut-off are split by index, not all kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import SamplingConfig

MASS_TOLERANCE = 1e-6
"""Absolute slack on the nucleus' prefix mass (about 8 float32 ulps at 1.0)."""


def _scaled(logits: jax.Array, temperature: float) -> jax.Array:
    """[B, V] float32: (logits - row max) / temperature (rule 2): <= 0, 0 at the maximum.

    A row whose maximum is not finite (all -inf) is not shifted.
    """
    x = logits.astype(jnp.float32)
    m = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return (x - jnp.where(jnp.isfinite(m), m, 0.0)) / temperature


def _sorted_filtered(logits: jax.Array, sampling: SamplingConfig):
    """(filtered sorted logits [B, V'] float32 (-inf where dropped), token ids [B, V'] int32).

    V' = min(top_k, V) with top-k, else V; only called when sampling is not greedy.
    """
    x = _scaled(logits, sampling.temperature)
    v = x.shape[-1]
    k = min(sampling.top_k, v) if sampling.top_k else v
    if k < v:
        # lax.top_k ranks equal values by index (lower first), like a stable sort.
        xs, order = jax.lax.top_k(x, k)
    else:
        order = jnp.argsort(-x, axis=-1, stable=True)
        xs = jnp.take_along_axis(x, order, axis=-1)
    if sampling.top_p < 1.0:
        p = jax.nn.softmax(xs, axis=-1)
        # Mass of the positions ahead of each one (an exclusive prefix sum).
        cum = jnp.cumsum(p, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
        keep = before < sampling.top_p - MASS_TOLERANCE
        keep = keep.at[..., 0].set(True)
        xs = jnp.where(keep, xs, -jnp.inf)
    return xs, order.astype(jnp.int32)


NONFINITE = -2
"""The token id every loop emits for a row whose logits are not finite (and stops that
row there, with stop reason 'nonfinite'): never a plausible token id."""


def nonfinite_rows(logits: jax.Array) -> jax.Array:
    """[B] bool: rows of ``logits`` [B, V] with a NaN or +inf, or with every entry -inf
    (no token to sample): exactly the rows whose maximum is not finite (``max``
    propagates NaN), one reduction."""
    return ~jnp.isfinite(jnp.max(logits, axis=-1))


def sample_logits(logits: jax.Array, rng: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """Picks the next token of each row by the module's rule; :data:`NONFINITE` for a row
    whose logits are not finite (:func:`nonfinite_rows`), never a token id made up from
    NaNs.

    Args:
      logits: [B, V] float (any float dtype; computed in float32).
      rng: a PRNG key (unused when greedy).
      sampling: temperature 0 (or below 2^-126) = greedy argmax; else
        softmax(logits / temperature), computed as rule 2 of the module docstring, with
        the top_k (0: off; clamped to V) and top_p (1: off) filters of the module
        docstring. Static under jit: a new config compiles a new program.
    Returns:
      [B] int32 token ids (or :data:`NONFINITE`).
    """
    return jnp.where(nonfinite_rows(logits), NONFINITE, _sample(logits, rng, sampling))


def _sample(logits, rng, sampling):
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampling.top_k and sampling.top_p >= 1.0:
        x = _scaled(logits, sampling.temperature)
        return jax.random.categorical(rng, x, axis=-1).astype(jnp.int32)
    xs, order = _sorted_filtered(logits, sampling)
    pos = jax.random.categorical(rng, xs, axis=-1)
    return jnp.take_along_axis(order, pos[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sampling_probs(logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """The distribution :func:`sample_logits` draws from: [B, V] float32, rows sum to 1.

    Greedy gives a one-hot row at the argmax. For tests and analysis.
    """
    b, v = logits.shape
    if sampling.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    xs, order = _sorted_filtered(logits, sampling)
    p = jax.nn.softmax(xs, axis=-1)
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, v), jnp.float32).at[rows, order].add(p)


def is_stop(tokens: jax.Array, eos_ids: jax.Array) -> jax.Array:
    """Whether each token ends its row: one of the checkpoint's end-of-generation ids or
    :data:`NONFINITE`.

    Args:
      tokens: int32, any shape.
      eos_ids: [E] int32 end-of-generation ids (E >= 0; an entry -1 never matches, so a
        run that ignores EOS passes ``[-1]`` or an empty array).
    Returns:
      bool, the shape of ``tokens``.
    """
    tokens = jnp.asarray(tokens)
    eos_ids = jnp.asarray(eos_ids, jnp.int32).reshape((1,) * tokens.ndim + (-1,))
    hit = jnp.any((tokens[..., None] == eos_ids) & (eos_ids >= 0), axis=-1) if eos_ids.size \
        else jnp.zeros(tokens.shape, bool)
    return hit | (tokens == NONFINITE)


MAX_REQUEST_ID = 2**64 - 1
"""The largest request id a sampling key is derived from (ids are unsigned 64-bit)."""


def check_request_id(req_id) -> int:
    """``req_id`` as a Python int, if it is an integer (Python or numpy, not bool) in
    [0, 2**64).

    Raises:
      ValueError: anything else, naming the value and the allowed range.
    """
    if isinstance(req_id, (bool, np.bool_)) or not isinstance(req_id, (int, np.integer)) \
            or not 0 <= int(req_id) <= MAX_REQUEST_ID:
        raise ValueError(f"request id={req_id!r}; allowed: an integer in [0, 2**64) (it "
                         "seeds the request's sampling key)")
    return int(req_id)


def request_key(base: jax.Array, req_id) -> jax.Array:
    """The sampling key of request ``req_id`` (an integer in [0, 2**64),
    :func:`check_request_id`): ``fold_in(base, id)`` below 2**32, else
    ``fold_in(fold_in(base, id mod 2**32), id // 2**32)``, so every id has its own key
    (``fold_in`` takes 32 bits: 2**32 + 7 would otherwise share 7's, or overflow) and
    the keys of ids below 2**32 are those kvjax always used. Host-side (the id is a
    Python or numpy integer, not traced).

    Raises:
      ValueError: as :func:`check_request_id`.
    """
    i = check_request_id(req_id)
    key = jax.random.fold_in(base, i & 0xFFFFFFFF)
    return key if i >> 32 == 0 else jax.random.fold_in(key, i >> 32)


def request_keys(base: jax.Array, req_ids) -> jax.Array:
    """[B] keys, :func:`request_key` of each id in ``req_ids`` (a sequence of B ints),
    derived in two vectorised folds (not B calls).

    Raises:
      ValueError: as :func:`check_request_id`.
    """
    ids = [check_request_id(i) for i in req_ids]
    lo = jnp.asarray(np.array([i & 0xFFFFFFFF for i in ids], np.uint32).reshape(-1))
    hi = np.array([i >> 32 for i in ids], np.uint32).reshape(-1)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(lo)
    if not hi.any():
        return keys
    data = jax.random.key_data(keys)
    two = jax.random.key_data(jax.vmap(jax.random.fold_in)(keys, jnp.asarray(hi)))
    big = jnp.asarray(hi != 0).reshape((-1,) + (1,) * (data.ndim - 1))
    return jax.random.wrap_key_data(jnp.where(big, two, data),
                                    impl=jax.random.key_impl(base))
