"""Ragged batches: prompts of different lengths in one compiled prefill and one loop.

Padding scheme: **right padding with per-row counts** (as gemma's sampler keeps per-row
lengths). Row b's prompt fills tokens 0..n_b-1 of a [B, T] chunk at positions
``cache.length[b] + j``, the rest is padding. ``model.forward(..., num_valid=n)`` gives a
padded token position -1, so it sees no key (its attention output is zeros), no query
sees it and the slot policy never writes it (a ring keeps its entries); ``length[b]``
advances by n_b. Each row then continues its own cache at its own position
(``init_cache(..., ragged=True)``: per-row scatter writes), so a row's positions, rotary
angles and masks are exactly those of the prompt run alone.

Why not left padding: with per-row positions, left padding puts a row's padding *before*
its prompt in the cache, so the pads occupy slots (a ring would spend window slots on
them) and each row's slots no longer equal its positions; the per-row bookkeeping of the
cache (``positions[b]`` continue ``length[b]``) already expresses right padding with no
new state.

Generation (:func:`generate_ragged`) runs every row inside one ``lax.while_loop``, each
with its own budget and EOS. A row that has stopped is fed with ``num_valid`` 0: the
model writes nothing for it (the scatter drops its slot) and its length stays, so a
finished row costs no further cache writes; its outputs are -1.

Sampling keys follow the request, never the row (``row_keys``): token j of a row is
drawn with ``fold_in(row_key, j)`` (j = 0 is the token sampled from the prefill logits),
and a row's key is its request's, ``request_key(rng, request id)``
(:func:`row_keys_for`; the slot engine's rule, :mod:`kvjax.inference.engine`), so a
row's tokens never depend on which other rows share the batch or where it sits in it.
A sampled :func:`generate_ragged` is told each row's request (``request_ids`` or
``row_keys``); a key per row index was the default before issue 54.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, policy_for
from kvjax.config import ModelConfig, SamplingConfig
from kvjax.inference.sampling import is_stop, request_keys, sample_logits
from kvjax.inference import decode as decode_lib
from kvjax.models import model as model_lib

__all__ = ["pad_prompts", "check_ragged_cache", "prefill_ragged_program", "prefill_ragged",
           "generate_ragged_program", "generate_ragged", "row_keys_for", "sample_rows",
           "first_tokens"]


def pad_prompts(prompts: Sequence[Sequence[int]], length: int | None = None,
                pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into one chunk.

    Args:
      prompts: B token-id lists, each non-empty.
      length: T (default the longest prompt); must be >= the longest.
      pad_id: id placed in the padding (never seen by the model).
    Returns:
      (tokens [B, T] int32, lengths [B] int32).
    Raises:
      ValueError: no prompts, an empty prompt (named by its row) or ``length`` too short.
    """
    if not len(prompts):
        raise ValueError("prompts=[]; allowed: at least one non-empty prompt")
    lengths = np.array([len(p) for p in prompts], np.int32)
    empty = np.nonzero(lengths == 0)[0]
    if empty.size:
        raise ValueError(f"prompt of row {int(empty[0])} is empty; allowed: at least one "
                         "token per prompt")
    t = int(lengths.max()) if length is None else int(length)
    if t < lengths.max():
        raise ValueError(f"length={t} is shorter than the longest prompt "
                         f"({int(lengths.max())} tokens, row {int(lengths.argmax())}); "
                         "allowed: length >= the longest prompt")
    tokens = np.full((len(prompts), t), pad_id, np.int32)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = np.asarray(p, np.int32)
    return tokens, lengths


def check_ragged_cache(cache: KVCache, what: str) -> None:
    """Raises ValueError unless ``cache`` keeps per-row lengths (``ragged``)."""
    if not cache.ragged:
        raise ValueError(f"{what}: a lockstep cache (ragged=False) cannot hold rows of "
                         "different lengths; allowed: init_cache(cfg, B, S, ragged=True)")


def _room(cfg: ModelConfig, cache_lengths, new_tokens, num_slots: int, what: str) -> None:
    policy = policy_for(cfg)
    for b, (have, new) in enumerate(zip(np.atleast_1d(cache_lengths), new_tokens)):
        policy.check_room(int(have), int(new), num_slots, f"{what} (row {b})")


def row_keys_for(rng: jax.Array | None, requests) -> jax.Array:
    """[B] PRNG keys: row b's is its request's,
    :func:`kvjax.inference.sampling.request_key` (rng, request id), the slot engine's
    keys for the same seed (``rng = jax.random.key(seed)``; default key 0).

    Args:
      rng: the base key, or None (key 0).
      requests: the B rows' request ids (integers in [0, 2**64); a row keeps its tokens
        wherever it sits in the batch), or an int B: requests 0..B-1, i.e. row b is
        request b (for programs that ignore the keys, e.g. greedy timings).
    Raises:
      ValueError: an id outside [0, 2**64), named.
    """
    rng = jax.random.key(0) if rng is None else rng
    ids = range(int(requests)) if isinstance(requests, (int, np.integer)) else requests
    return request_keys(rng, list(ids))


def sample_rows(logits: jax.Array, keys: jax.Array, index: jax.Array,
                sampling: SamplingConfig) -> jax.Array:
    """[B] int32: row b's token sampled from logits [B, V] with key
    fold_in(keys[b], index[b]) (greedy: the argmax, keys unused)."""
    if sampling.greedy:
        return sample_logits(logits, keys, sampling)

    def one(row, key, i):
        return sample_logits(row[None], jax.random.fold_in(key, i), sampling)[0]

    return jax.vmap(one)(logits, keys, index)


def first_tokens(logits: jax.Array, row_keys: jax.Array,
                 sampling: SamplingConfig = SamplingConfig()) -> jax.Array:
    """[B] int32 token 0 of each row, from the prefill's last logits [B, V]."""
    return sample_rows(logits, row_keys, jnp.zeros(logits.shape[:1], jnp.int32), sampling)


def _positions(cache: KVCache, t: int) -> jax.Array:
    return cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


@decode_lib.compile_unit(static=("cfg",), args=("params", "rows", "rows", "cache"),
                         outs=("rows", "cache"))
def prefill_ragged_program(params, tokens, lengths, cache, *, cfg):
    """Compile unit of :func:`prefill_ragged` (no host checks): tokens [B, T] int32
    right-padded, lengths [B] int32 -> (logits [B, V] float32 at each row's last real
    token, cache). A short chunk runs the decode step's formulation: the cache's
    never-written slots are cleared first (``model.clear_masked_slots``). With
    ``cfg.kv_compression`` each row is prefilled into a full cache and compressed on its
    own tokens (:func:`kvjax.inference.decode.prefill_compressed`; the cache must be
    empty)."""
    if cfg.kv_evicts:
        return decode_lib.prefill_compressed(params, tokens, cfg, True, lengths,
                                             num_slots=cache.num_slots)
    cache = model_lib.clear_masked_slots(cfg, cache, tokens.shape[1])
    logits, cache = model_lib.forward(params, cfg, tokens, _positions(cache, tokens.shape[1]),
                                      cache, num_valid=lengths)
    last = jnp.clip(lengths - 1, 0, tokens.shape[1] - 1)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], cache


def prefill_ragged(params, cfg: ModelConfig, tokens, lengths, cache: KVCache):
    """Prefills right-padded prompts of different lengths in one pass.

    Args:
      params: parameters in cfg's layout.
      tokens: [B, T] int32 (:func:`pad_prompts`).
      lengths: [B] int32 real tokens per row, 1..T.
      cache: a ragged cache (``init_cache(..., ragged=True)``), donated; rows may already
        hold tokens (each row continues its own).
    Returns:
      (logits [B, V] float32 of each row's last prompt token, updated cache).
    Raises:
      ValueError: a lockstep cache, shapes that disagree, or a length outside 1..T
        (named by its row); a compressed model's cache that already holds tokens.
      CacheOverflowError: a row's prompt does not fit its cache (named by its row).
    """
    check_ragged_cache(cache, "prefill_ragged")
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths)
    if tokens.ndim != 2 or lengths.shape != (tokens.shape[0],) or \
            tokens.shape[0] != cache.batch_size:
        raise ValueError(f"tokens of shape {tokens.shape}, lengths of shape {lengths.shape} "
                         f"for a cache of {cache.batch_size} rows; allowed: [B, T] and [B] "
                         f"with B = {cache.batch_size}")
    bad = np.nonzero((lengths < 1) | (lengths > tokens.shape[1]))[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"lengths[{b}]={int(lengths[b])}; allowed: 1..{tokens.shape[1]} "
                         "(an empty prompt cannot be prefilled)")
    _room(cfg, jax.device_get(cache.length), lengths, cache.num_slots, "prefill")
    if cfg.kv_evicts and not decode_lib.is_empty(cache):
        raise ValueError(f"prefill_ragged with model.kv_compression={cfg.kv_compression!r} "
                         "on a cache that holds tokens; allowed: an empty cache (the prompt "
                         "is compressed after one prefill pass)")
    return prefill_ragged_program(params, jnp.asarray(tokens, jnp.int32),
                                  jnp.asarray(lengths, jnp.int32), cache, cfg=cfg)


@decode_lib.compile_unit(static=("cfg", "sampling", "buf_len"),
                         args=("params", "rows", "cache", "rows", "rows", None),
                         outs=("rows", "rows", "cache"))
def generate_ragged_program(params, first_token, cache, budgets, row_keys, eos_ids, *, cfg,
                            sampling, buf_len):
    """Compile unit of :func:`generate_ragged` (no host checks).

    first_token [B] int32, ragged cache, budgets [B] int32 (tokens to generate after
    first_token), row_keys [B] keys, eos_ids [E] int32 (every end-of-generation id; -1
    never matches; a scalar is one id) -> (tokens [B, buf_len] int32, -1 after a row's
    last token; counts [B] int32 tokens generated per row; cache). The cache's
    never-written slots are cleared once on entry (``model.clear_masked_slots``).
    """
    batch = first_token.shape[0]
    cache = model_lib.clear_masked_slots(cfg, cache)

    def sample(logits, count, carry):  # token j of a row with fold_in(row_key, j)
        return sample_rows(logits, row_keys, count, sampling), carry

    # count: 1, the first token (key 0) came from the prefill
    out = decode_lib.decode_loop(params, cfg, cache, first_token,
                                 ~is_stop(first_token, eos_ids), budgets,
                                 jnp.ones((batch,), jnp.int32), eos_ids, sample,
                                 steps=buf_len)
    return out["tokens"], out["count"] - 1, out["cache"]


def generate_ragged(params, cfg: ModelConfig, first_token, cache: KVCache, budgets,
                    rng: jax.Array | None = None,
                    sampling: SamplingConfig = SamplingConfig(),
                    eos_ids: int | Sequence[int] = (), row_keys: jax.Array | None = None,
                    request_ids: Sequence[int] | None = None):
    """Generates up to ``budgets[b]`` tokens after ``first_token[b]`` per row, in one loop.

    Each row continues its own cache at its own position and stops at any of ``eos_ids``
    (that token is kept), where its logits are not finite (the entry is
    :data:`kvjax.inference.sampling.NONFINITE`) or at its budget; stopped rows are neither written nor advanced. The loop
    ends when every row has stopped.

    Args:
      params: parameters in cfg's layout.
      first_token: [B] int32 (e.g. :func:`first_tokens` of the prefill logits).
      cache: the prefilled ragged cache (donated).
      budgets: [B] ints >= 0.
      rng: base key of the rows' keys (:func:`row_keys_for` of ``request_ids``;
        default key 0).
      sampling: SamplingConfig (static).
      eos_ids: the end-of-generation ids (``Tokenizer.eos_token_ids``; one int is one id;
        empty or -1: never stop early).
      row_keys: [B] per-row keys, each its request's (overrides ``rng`` and
        ``request_ids``; the keys ``first_token`` was sampled with, :func:`first_tokens`).
      request_ids: B ints, each row's request id: row b's key is
        ``row_keys_for(rng, request_ids)[b]``, so its tokens follow its request wherever
        it sits. A sampled call needs ``row_keys`` or ``request_ids``; greedy ignores
        keys.
    Returns:
      (tokens [B, max budget] int32 numpy, -1 after each row's last token; counts [B]
      numpy ints; cache).
    Raises:
      ValueError: a lockstep cache, a negative budget or shapes that disagree (the row is
        named); sampling with neither ``row_keys`` nor ``request_ids``, or
        ``request_ids`` not one id in [0, 2**64) per row.
      CacheOverflowError: a row's budget runs past its dense cache (named by its row).
    """
    check_ragged_cache(cache, "generate_ragged")
    if row_keys is None:
        if request_ids is None and not sampling.greedy:
            raise ValueError(
                f"sampling at temperature={sampling.temperature} with neither request_ids "
                "nor row_keys; allowed: request_ids=[one id per row] (a row's key follows "
                "its request, not its place in the batch) or row_keys")
        if request_ids is not None and len(request_ids) != cache.batch_size:
            raise ValueError(f"{len(request_ids)} request_ids for a cache of "
                             f"{cache.batch_size} rows; allowed: one id per row")
        row_keys = row_keys_for(rng, cache.batch_size if request_ids is None
                                else request_ids)
    budgets = np.asarray(budgets).reshape(-1)
    if budgets.shape != (cache.batch_size,):
        raise ValueError(f"budgets of shape {budgets.shape} for a cache of "
                         f"{cache.batch_size} rows; allowed: one budget per row")
    bad = np.nonzero(budgets < 0)[0]
    if bad.size:
        raise ValueError(f"budgets[{int(bad[0])}]={int(budgets[bad[0]])}; allowed: >= 0")
    _room(cfg, jax.device_get(cache.length), budgets, cache.num_slots, "generate")
    most = int(budgets.max()) if budgets.size else 0
    buf, count, cache = generate_ragged_program(
        params, jnp.asarray(first_token, jnp.int32), cache, jnp.asarray(budgets, jnp.int32),
        row_keys, decode_lib.eos_array(eos_ids), cfg=cfg, sampling=sampling,
        buf_len=max(1, policy_for(cfg).buffer_len(cache.num_slots, most)))
    return np.asarray(buf)[:, :most], np.asarray(count), cache
