"""Speculative decoding: verify k drafted tokens in one forward of the target model.

A decode step reads every weight and every cached key and value to produce one token, at
~1 FLOP/byte (the blog's "The GPU sits idle 99.3% of the time"). Scoring k + 1 positions
in one forward reads the same bytes and does k + 1 times the arithmetic, so while the step
stays memory-bound it costs about one step and can emit up to k + 1 tokens (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling").

One round of :func:`speculative_program`'s ``lax.while_loop``, per row:

1. **Draft** k tokens d_1..d_k after the last emitted token ``last``:
   * 'ngram' (prompt lookup): the most recent earlier occurrence of the row's last n
     tokens (n from ``ngram_max`` down to ``ngram_min``) in the prompt and the text so
     far; the k tokens that followed it are the draft. No model, no cache.
   * 'self' / 'model': a draft model (the target's weights over a cheap cache: a window
     with sinks, a quantized copy or the first L' layers; or another config's model)
     decodes k tokens over its own cache, kept beside the target's.
2. **Verify**: the target runs the chunk [last, d_1..d_k] at positions L..L+k over its
   cache (the chunked-prefill write path, one forward), giving target logits for every
   draft position.
3. **Accept**: greedy, the longest prefix d_1..d_n equal to the target's argmax, then the
   target's own token at n (so every round emits n + 1 >= 1 tokens, exactly the plain
   greedy tokens). Sampled, the rejection rule of Leviathan et al. (sec. 2.3, Algorithm 1):
   d_j is kept with probability min(1, p(d_j) / q(d_j)); at the first rejection the token
   is drawn from norm(max(0, p - q)), after k acceptances from p, so the emitted tokens
   follow the target's distribution p exactly (q: the drafter's distribution, one-hot
   for the deterministic n-gram draft).
4. **Take back** the rejected positions: the target cache's length becomes L + n + 1 and
   the slots holding positions past it are marked empty (position -1), which is exact
   for every cache kind, because a cache's contents at a position are a function of the
   token there and the tokens before it: dense and ragged rows, quantized codes and
   scales, MLA latents, and rings. A ring keeps ``k`` spare slots beyond its window W
   (``init_cache(spare_slots=k)``): a chunk of k + 1 tokens then evicts only positions the
   window no longer shows, so a rejected draft never overwrote a live key. The draft
   model's cache is taken back the same way.

The chunk is cut where a row's budget ends (``num_valid``): a draft never runs past the
cache's end and is never clamped; the host-side :func:`generate` checks the cache's room
as plain decoding does (:func:`kvjax.cache.policy.written_tokens`: the same tokens are
written). A row stops at any of ``eos_ids`` inside an accepted draft (the tokens after it
are not emitted) or where the target's logits are not finite
(:data:`kvjax.inference.sampling.NONFINITE`). Rows accept different numbers of tokens:
the caches are ragged (``init_cache(..., ragged=True)``), each row at its own length.

Theory (expected tokens per step, the verify step's bytes and FLOPs, the predicted
speedup): :mod:`kvjax.analysis.speculative`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax.cache import KVCache, paged, policy_for
from kvjax.config import ConfigError, ModelConfig, SamplingConfig, SpeculativeConfig
from kvjax.inference.sampling import (NONFINITE, is_stop, nonfinite_rows, sample_logits,
                                      sampling_probs)
from kvjax.models import decode_kernels
from kvjax.models import model as model_lib
from kvjax.models import weight_matmul

__all__ = ["draft_config", "draft_params", "check_draft", "init_target_cache",
           "init_draft_cache", "draft_window", "draft_window_slots", "ngram_draft",
           "take_back", "accept_greedy", "accept_sampled",
           "speculative_program", "compile_program", "generate", "SpeculativeStats",
           "history", "slot_history", "put_slot_history", "self_draft", "draft_weight_bytes",
           "engine_rounds_program"]


# --------------------------------------------------------------------------- drafters


def draft_config(cfg: ModelConfig, spec: SpeculativeConfig) -> ModelConfig:
    """The 'self' drafter's model config: ``cfg`` over a cheaper cache (a window of
    ``draft_window_size`` with ``draft_sink_tokens`` sinks, ``draft_kv_dtype``) and/or the
    first ``draft_num_layers`` layers.

    Raises:
      ConfigError: drafter is not 'self', or draft_num_layers exceeds cfg's layers.
    """
    if spec.drafter != "self":
        raise ConfigError(f"speculative.drafter={spec.drafter!r}; draft_config builds the "
                          "'self' drafter only")
    fields: dict[str, Any] = {}
    if spec.draft_window_size:
        fields.update(window_size=spec.draft_window_size,
                      num_sink_tokens=spec.draft_sink_tokens)
    if spec.draft_kv_dtype:
        fields["kv_dtype"] = spec.draft_kv_dtype
    if spec.draft_num_layers:
        if spec.draft_num_layers > cfg.num_layers:
            raise ConfigError(
                f"speculative.draft_num_layers={spec.draft_num_layers}; allowed: 0 (all) "
                f"to the target's num_layers={cfg.num_layers}")
        fields["num_layers"] = spec.draft_num_layers
    return cfg.replace(**fields)


def draft_params(params, cfg: ModelConfig, draft_cfg: ModelConfig):
    """The target's parameters for a 'self' draft of ``draft_cfg.num_layers`` layers (the
    first ones; the same arrays, no copy when all layers are kept)."""
    n = draft_cfg.num_layers
    if n == cfg.num_layers:
        return params
    if "layers" in params:
        return {**params, "layers": jax.tree.map(lambda a: a[:n], params["layers"])}
    return {k: v for k, v in params.items()
            if not k.startswith("layers_") or int(k.split("_")[1]) < n}


def check_draft(cfg: ModelConfig, draft_cfg: ModelConfig | None,
                spec: SpeculativeConfig) -> None:
    """Refuses a drafter the config cannot build, before any work.

    Warns (UserWarning) where an int8 'self' draft (``draft_weight_dtype='int8'``) with a
    resolved plan would not run the native int8 kernel on CPU: XLA then multiplies by
    weights widened to float32 every step, slower than the float32 draft.

    Raises:
      ConfigError: a draft model with another vocabulary, a 'self'/'model' drafter
        without a draft config, or an 'ngram' drafter given one.
    """
    if spec.drafter in ("self", "model"):
        if draft_cfg is None:
            raise ConfigError(f"speculative.drafter={spec.drafter!r} needs a draft model "
                              "config; none was built")
        if draft_cfg.vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"draft model vocab_size={draft_cfg.vocab_size}; allowed: the target's "
                f"vocab_size={cfg.vocab_size} (the drafter must share the tokenizer)")
    elif draft_cfg is not None:
        raise ConfigError(f"speculative.drafter={spec.drafter!r} takes no draft model")
    if (spec.drafter == "self" and spec.draft_weight_dtype == "int8"
            and draft_cfg.plan is not None and draft_cfg.backend == "cpu"
            and not weight_matmul.int8_runs_native(draft_cfg.weight_matmul, draft_cfg.plan,
                                                   draft_cfg.dtype)):
        warnings.warn(
            f"speculative.draft_weight_dtype='int8' with model.weight_matmul="
            f"{draft_cfg.weight_matmul!r}, dtype={draft_cfg.dtype!r} and native kernels "
            f"{list(draft_cfg.plan.native)}: the draft multiplies by its int8 weights "
            "widened to float32 in XLA every step, slower than a float32 draft on CPU; the "
            "int8 kernel needs weight_matmul other than 'xla', dtype 'float32' and the "
            "native rows_matmul loaded", stacklevel=2)


def _spare(cfg: ModelConfig, k: int) -> int:
    """Spare slots a speculative cache keeps: k + 1 for a ring (a chunk of k + 1 then
    evicts nothing the window shows), 0 for a dense cache (its rows never hold more
    than plain decoding writes)."""
    return k + 1 if policy_for(cfg).kind == "ring" else 0


def init_target_cache(cfg: ModelConfig, batch_size: int, max_seq_len: int,
                      k: int) -> KVCache:
    """The target's cache for speculative decoding: ragged rows (each accepts its own
    number of tokens), a ring with k + 1 spare slots (:func:`_spare`)."""
    return cache_lib.init_cache(cfg, batch_size, max_seq_len, ragged=True,
                                spare_slots=_spare(cfg, k))


def init_draft_cache(draft_cfg: ModelConfig, batch_size: int, max_seq_len: int,
                     k: int) -> KVCache:
    """The draft model's cache: ragged; k + 1 slots beyond ``max_seq_len`` when dense
    (a round drafts k tokens past the target's accepted length), k + 1 spare in a ring."""
    dense = policy_for(draft_cfg).kind != "ring"
    return cache_lib.init_cache(draft_cfg, batch_size, max_seq_len + (k + 1) * dense,
                                ragged=True, spare_slots=_spare(draft_cfg, k))


def draft_window(cache: KVCache, cfg: ModelConfig, draft_cfg: ModelConfig,
                 k: int) -> KVCache:
    """The ring a draft with ``draft_kv_source='target'`` drafts over this round: each
    row's sinks and last positions of ``cache`` (the target's, config ``cfg``) copied by
    :func:`kvjax.cache.window_view` into the slots :func:`init_draft_cache` would give
    it (:func:`draft_window_slots`)."""
    return cache_lib.window_view(cache, cfg, draft_cfg, draft_window_slots(draft_cfg, k))


def draft_in_place(cfg: ModelConfig, draft_cfg: ModelConfig, spec: SpeculativeConfig,
                   batch_size: int, num_slots: int) -> ModelConfig | None:
    """The config of a draft with ``draft_kv_source='target'`` that reads the target's
    dense cache where it lies, or None where a round copies the window instead
    (:func:`draft_window`).

    In place, the draft attends to each row's sinks and last positions as a mask over
    the target's own slots (``window_cache='dense'``: the same keys the copy would
    hold, so the same drafts) and writes its k - 1 draft keys after the row's length,
    where the verify step then writes the target's own. That needs dense target rows
    (``batch_size`` x ``num_slots`` slots), every layer, the target's cache layouts
    and a decode formulation that reads only the visible slots
    (:data:`kvjax.models.decode_kernels.IN_PLACE`: 'native' on CPU); with any of them
    missing the copy reads and writes fewer bytes than a draft step over all slots.
    """
    if (not spec.copies_target_window or policy_for(cfg).kind != "dense" or cfg.is_mla
            or draft_cfg.num_layers != cfg.num_layers):
        return None
    icfg = draft_cfg.replace(window_cache="dense")
    if cache_lib.layouts(icfg) != cache_lib.layouts(cfg):
        return None
    specs = cache_lib.tensor_specs(icfg, batch_size, num_slots)
    k, v = (jax.ShapeDtypeStruct(specs[n].shape, specs[n].dtype) for n in ("k", "v"))
    return icfg if decode_kernels.choose(icfg, k, v) in decode_kernels.IN_PLACE else None


def draft_window_slots(draft_cfg: ModelConfig, k: int) -> int:
    """Slots per row of :func:`draft_window`'s ring: the window W plus k + 1 spare (what
    :func:`init_draft_cache` gives a ring), the count a round copies from the target."""
    return cache_lib.num_slots(draft_cfg, 1) + _spare(draft_cfg, k)


def ngram_draft(hist: jax.Array, hist_len: jax.Array, k: int, ngram_max: int,
                ngram_min: int) -> tuple[jax.Array, jax.Array]:
    """Prompt-lookup drafts (Saxena 2023, "Prompt Lookup Decoding"; vLLM's and
    tpu-inference's n-gram proposer): the k tokens that followed the most recent earlier
    occurrence of each row's last n tokens, for the largest n in [ngram_min, ngram_max]
    that occurs.

    Args:
      hist: [B, H] int32 tokens so far (prompt, then emitted), valid below ``hist_len``.
      hist_len: [B] int32.
      k, ngram_max, ngram_min: static ints.
    Returns:
      (drafts [B, k] int32, found [B] bool). Where nothing matches, or the continuation
      is shorter than k, the missing drafts are 0 (the verify step rejects what the
      target would not produce, so they cost FLOPs, never correctness).
    """
    b, h = hist.shape
    idx = jnp.arange(h, dtype=jnp.int32)
    drafts = jnp.zeros((b, k), jnp.int32)
    found = jnp.zeros((b,), bool)
    for n in range(ngram_max, ngram_min - 1, -1):
        tail = hist_len[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None, :]  # [B, n]
        suffix = jnp.take_along_axis(hist, jnp.clip(tail, 0, h - 1), axis=1)
        # a match at i: hist[i + j] == suffix[j] for j < n, with a continuation token
        # (i + n < hist_len), so the row's own suffix never matches itself
        match = (idx[None, :] + n < hist_len[:, None]) & (hist_len[:, None] >= n)
        for j in range(n):
            match &= jnp.roll(hist, -j, axis=1) == suffix[:, j:j + 1]
        start = jnp.max(jnp.where(match, idx[None, :], -1), axis=1) + n  # [B]
        ok = (start >= n) & ~found
        at = start[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :]
        cand = jnp.take_along_axis(hist, jnp.clip(at, 0, h - 1), axis=1)
        cand = jnp.where(at < hist_len[:, None], cand, 0)
        drafts = jnp.where(ok[:, None], cand, drafts)
        found |= ok
    return drafts, found


def _draft_with_model(dparams, dcfg: ModelConfig, dcache: KVCache, last, pending,
                      has_pending, active, k: int, sampling: SamplingConfig, key,
                      can_pend: bool = True):
    """k draft tokens from the draft model over its cache.

    The draft cache holds the row's tokens before ``last``, except, after a round whose
    k drafts were all accepted, the last draft (``pending``, ``has_pending``): the first
    forward feeds [pending, last] (2 tokens) or [last] (1), the next k - 1 one token each.
    ``can_pend`` (static) False: no row can have a pending draft (a window copied from
    the target's cache each round), so the first forward is a one-token step too.
    ``key``: one PRNG key for the batch, or [B] keys, one per row (a row's drafts then
    never depend on its batch-mates).
    Returns (drafts [B, k] int32, q [B, k, V] float32 or None when greedy, dcache).
    """
    if can_pend:
        pair = jnp.where(has_pending[:, None], jnp.stack([pending, last], 1),
                         jnp.stack([last, last], 1))
        n0 = jnp.where(active, 1 + has_pending.astype(jnp.int32), 0)
    else:
        pair, n0 = last[:, None], active.astype(jnp.int32)
    pos = dcache.length[:, None] + jnp.arange(pair.shape[1], dtype=jnp.int32)[None, :]
    logits, dcache = model_lib.forward(dparams, dcfg, pair, pos, dcache, num_valid=n0,
                                       last_only=True)
    one = active.astype(jnp.int32)

    per_row = key.ndim == 1

    def pick(logits, key):
        if sampling.greedy:
            return sample_logits(logits, key if not per_row else key[0], sampling), None
        q = sampling_probs(logits, sampling)
        if per_row:
            tok = jax.vmap(jax.random.categorical)(key, jnp.log(q))
        else:
            tok = jax.random.categorical(key, jnp.log(q), axis=-1)
        tok = jnp.where(nonfinite_rows(logits), 0, tok.astype(jnp.int32))
        return tok, q

    keys = (jnp.moveaxis(jax.vmap(lambda r: jax.random.split(r, k))(key), 0, 1) if per_row
            else jax.random.split(key, k))  # [k, B] or [k]
    d, q = pick(logits[:, 0], keys[0])
    d = jnp.maximum(d, 0)  # a draft is a proposal: a non-finite draft row proposes 0

    def step(carry, key):
        dcache, d = carry
        logits, dcache = model_lib.forward(dparams, dcfg, d[:, None],
                                           dcache.length[:, None], dcache, num_valid=one)
        nd, q = pick(logits[:, 0], key)
        nd = jnp.maximum(nd, 0)
        return (dcache, nd), (nd, q)

    # The k - 1 later steps: a loop whose trip count XLA cannot fold (none when no row
    # is active, whose drafts go unused). A loop of 0 or 1 trips would be inlined, and XLA
    # would then fuse the draft's cache writes into the verify step's reads of the same
    # buffer (a draft over the target's slots in place), copying the cache each round.
    drafts = jnp.zeros((d.shape[0], k), jnp.int32).at[:, 0].set(d)
    q_all = None if sampling.greedy else jnp.zeros(
        (d.shape[0], k) + q.shape[1:], q.dtype).at[:, 0].set(q)

    def body(i, carry):
        dcache, d, drafts, q_all = carry
        (dcache, d), (_, q) = step((dcache, d), keys[i])
        drafts = drafts.at[:, i].set(d)
        return dcache, d, drafts, None if q_all is None else q_all.at[:, i].set(q)

    dcache, _, drafts, q_all = jax.lax.fori_loop(
        1, jnp.where(jnp.any(active), k, 0), body, (dcache, d, drafts, q_all))
    return drafts, q_all, dcache


# --------------------------------------------------------------------------- accept


def _leading(ok: jax.Array) -> jax.Array:
    """[B] int32 number of leading True entries of ok [B, k]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)


def accept_greedy(drafts: jax.Array, logits: jax.Array, limit: jax.Array):
    """Greedy verification: the longest prefix of ``drafts`` equal to the target's
    argmax, then the target's token there.

    Args:
      drafts: [B, k] int32.
      logits: [B, k + 1, V] float32 target logits at [last, d_1..d_k].
      limit: [B] int32 >= 1, most tokens a row may emit this round (its budget, and the
        chunk's valid length).
    Returns:
      (emitted [B, k + 1] int32, valid below ``n + 1``; n [B] int32 drafts accepted).
      A non-finite logit row at position j emits :data:`NONFINITE` there.
    """
    b, t, v = logits.shape
    target = sample_logits(logits.reshape(b * t, v), jax.random.key(0),
                           SamplingConfig()).reshape(b, t)
    n = jnp.minimum(_leading(drafts == target[:, :-1]), limit - 1)
    return _emit(drafts, n, jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]), n


def accept_sampled(drafts: jax.Array, q: jax.Array | None, logits: jax.Array,
                   limit: jax.Array, key: jax.Array, sampling: SamplingConfig):
    """Exact speculative sampling (Leviathan et al. 2023, sec. 2.3 and Appendix A.1;
    Chen et al. 2023, Algorithm 2): draft d_j ~ q_j is kept when u_j < p_j(d_j) / q_j(d_j);
    at the first rejection j the emitted token is drawn from norm(max(0, p_j - q_j)); after
    all k are kept, from p_k. Where the row's limit cuts the round at j < k (it may emit j
    + 1 tokens), the token at j is still decided by draft j's test: the draft itself when
    kept, the residual when rejected (a fresh draw from p_j for a kept draft, the rule
    before issue 54, emitted d_j with probability p_j(d_j)^2 under a one-hot q). Every
    emitted token, whole round or cut, is distributed as p, the target's sampling
    distribution (:func:`kvjax.inference.sampling.sampling_probs`), given the tokens
    before it.

    Args:
      drafts: [B, k] int32. q: [B, k, V] float32 draft distributions, or None for a
        deterministic draft (q one-hot at the draft).
      logits: [B, k + 1, V] float32. limit: [B] int32 >= 1. key: a PRNG key, or [B]
        keys (row b draws with its own: its tokens never depend on its batch-mates).
      sampling: the target's (not greedy).
    Returns:
      (emitted [B, k + 1] int32, n [B] int32), as :func:`accept_greedy`.
    """
    b, t, v = logits.shape
    k = t - 1
    bad = nonfinite_rows(logits.reshape(b * t, v)).reshape(b, t)
    p = sampling_probs(jnp.where(bad[..., None], 0.0, logits).reshape(b * t, v),
                       sampling).reshape(b, t, v)
    pd = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=2)[..., 0]
    qd = 1.0 if q is None else jnp.take_along_axis(q, drafts[..., None], axis=2)[..., 0]
    if key.shape:  # one key per row
        ks = jax.vmap(jax.random.split)(key)  # [B, 2]
        ku, kr = ks[:, 0], ks[:, 1]
        u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(ku)
    else:
        ku, kr = jax.random.split(key)
        u = jax.random.uniform(ku, (b, k))
    ok = (u * qd < pd) & ~bad[:, :k]
    acc = _leading(ok)
    n = jnp.minimum(acc, limit - 1)
    rejected = (n == acc) & (acc < k)  # draft n was tested and rejected: the residual
    kept = n < acc  # the limit cuts the round after draft n was kept: emit it
    pn = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    dn = jnp.take_along_axis(drafts, jnp.minimum(n, k - 1)[:, None], axis=1)[:, 0]
    if q is None:
        qn = jax.nn.one_hot(dn, v, dtype=jnp.float32)
    else:
        qn = jnp.take_along_axis(q, jnp.minimum(n, k - 1)[:, None, None], axis=1)[:, 0]
    resid = jnp.maximum(pn - qn, 0.0)
    use = rejected[:, None] & (jnp.sum(resid, -1, keepdims=True) > 0)
    dist = jnp.where(use, resid, pn)
    if key.shape:
        last = jax.vmap(jax.random.categorical)(kr, jnp.log(dist)).astype(jnp.int32)
    else:
        last = jax.random.categorical(kr, jnp.log(dist), axis=-1).astype(jnp.int32)
    last = jnp.where(kept, dn, last)
    last = jnp.where(jnp.take_along_axis(bad, n[:, None], axis=1)[:, 0], NONFINITE, last)
    return _emit(drafts, n, last), n


def _emit(drafts, n, last):
    """[B, k + 1] int32: d_1..d_n, then ``last`` at n (entries past n: ``last``)."""
    b, k = drafts.shape
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return jnp.where(j < n[:, None], padded, last[:, None])


def take_back(cache, length: jax.Array):
    """The cache with each row cut to ``length`` [B]: later slots marked empty.

    A dense or ragged :class:`KVCache` marks them in its positions; a
    :class:`~kvjax.cache.paged.PagedKVCache` derives its positions from the lengths
    (slots at or past a row's length are empty), so its rollback is the lengths alone:
    the rejected drafts' keys stay in the row's pages, unseen, until later tokens
    overwrite them (pages are not a ring: no live key was overwritten)."""
    if isinstance(cache, paged.PagedKVCache):
        return cache.replace(length=length)
    return cache.replace(length=length,
                         positions=jnp.where(cache.positions >= length[:, None], -1,
                                             cache.positions))


# --------------------------------------------------------------------------- the loop


@functools.partial(jax.jit, static_argnames=("cfg", "draft_cfg", "spec", "sampling",
                                             "buf_len"),
                   donate_argnames=("cache", "draft_cache"))
def speculative_program(params, dparams, first_token, cache, draft_cache, hist, hist_len,
                        num_steps, rng, eos_ids, *, cfg, draft_cfg, spec, sampling,
                        buf_len):
    """Compile unit of :func:`generate` (no host checks).

    Args:
      params: the target's parameters. dparams: the draft model's (None for 'ngram').
      first_token: [B] int32, the token sampled from the prefill logits (not written).
      cache: the target's prefilled ragged cache (:func:`init_target_cache`; donated).
      draft_cache: the draft model's prefilled cache holding the same prompt (donated),
        or None.
      hist: [B, H] int32 the prompt (then the emitted tokens), valid below hist_len [B].
      num_steps: [] int32 tokens to emit after first_token per row.
      rng: PRNG key. eos_ids: [E] int32.
      cfg, draft_cfg, spec, sampling: static configs. buf_len: static output length.
    Returns:
      dict with 'tokens' [B, buf_len] int32 (after first_token; -1 past each row's
      count), 'count' [B] int32 emitted per row, 'rounds' [B] int32 verify steps per row,
      'accepted' [B] int32 drafts accepted, 'proposed' [B] int32 drafts verified,
      'steps' [] int32 loop iterations, 'cache', 'draft_cache'. Both caches' never-written
      slots are cleared once on entry (``model.clear_masked_slots``).
    """
    done0 = is_stop(first_token, eos_ids)
    h = hist.shape[1]
    hist = jnp.where(jnp.arange(h)[None, :] == hist_len[:, None], first_token[:, None], hist)
    b = first_token.shape[0]
    out = speculative_loop(params, dparams, cache, draft_cache, first_token, ~done0,
                           jnp.full((b,), num_steps, jnp.int32), hist, hist_len + 1,
                           rng, eos_ids, cfg=cfg, draft_cfg=draft_cfg, spec=spec,
                           sampling=sampling, buf_len=buf_len)
    return {n: out[n] for n in ("tokens", "count", "rounds", "accepted", "proposed",
                                "steps", "cache", "draft_cache")}


def speculative_loop(params, dparams, cache, draft_cache, last, active, remaining, hist,
                     hist_len, rng, eos_ids, *, cfg, draft_cfg, spec, sampling, buf_len,
                     max_rounds=None, stop_on_free=None, row_keys=None, index=None,
                     stats=False, pending=None, has_pending=None) -> dict:
    """The speculative loop of :func:`speculative_program` and of the slot engine
    (:func:`engine_rounds_program`): verify rounds of the active rows until each has
    stopped. Traced (call it inside jit); clears both caches' never-written slots on
    entry (``model.clear_masked_slots``).

    Args:
      params, dparams: the target's and the draft model's parameters (None: 'ngram').
      cache, draft_cache: the target's ragged cache and the draft's (None for 'ngram',
        and for a draft with ``spec.draft_kv_source='target'``, whose ring is copied
        from ``cache`` every round: :func:`kvjax.cache.window_view`).
      last: [B] int32 each row's last token (emitted, not yet written).
      active: [B] bool rows that decode. remaining: [B] int32 tokens each may emit.
      hist: [B, H] int32 each row's tokens so far (prompt, emitted, ``last``), valid
        below hist_len [B].
      rng: PRNG key (the draws of the draft model and of the acceptance without
        ``row_keys``).
      eos_ids: [E] int32.
      cfg, draft_cfg, spec, sampling: static configs. buf_len: static output length.
      max_rounds: (static) at most this many rounds (None: until every row stops).
      stop_on_free: [] bool or None: end after the round in which a row stops.
      row_keys: [B] keys or None: the acceptance of row b draws with
        fold_in(row_keys[b], index[b]) and its draft model with a key folded from that
        (its tokens never depend on its batch-mates).
      index: [B] int32 each row's tokens so far (the key index; default 0).
      stats: (static) count occupied row-rounds and the tokens they held.
      pending, has_pending: [B] int32 / bool, a draft model's state from an earlier call
        (the last draft of a round that accepted all k, not yet in its cache; default
        none): a caller that runs the loop a few rounds at a time (the slot engine)
        passes back what the last call returned.
    Returns:
      dict: 'tokens' [B, buf_len] int32 (emitted this call, in order; -1 after each
      row's count), 'count' [B] emitted, 'rounds', 'accepted', 'proposed' [B] int32,
      'steps' [] rounds run, 'cache', 'draft_cache', 'last', 'active', 'remaining',
      'hist', 'hist_len', 'occupied' [] and 'held' [] (0 without ``stats``), 'pending'
      and 'has_pending'.
    """
    b = last.shape[0]
    k = spec.k
    shared_window = spec.copies_target_window
    in_place_cfg = draft_in_place(cfg, draft_cfg, spec, b, cache.num_slots)
    cache = model_lib.clear_masked_slots(cfg, cache, k + 1)
    draft_cache = model_lib.clear_masked_slots(draft_cfg, draft_cache)
    h = hist.shape[1]
    num_slots = cache.num_slots
    buf = jnp.full((b, buf_len), -1, jnp.int32)
    zeros = jnp.zeros((b,), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    stop_on_free = jnp.zeros((), bool) if stop_on_free is None else stop_on_free
    state = dict(i=zero, buf=buf, cache=cache, dcache=draft_cache, last=last,
                 done=~active | (remaining <= 0), count=zeros, remaining=remaining,
                 index=zeros if index is None else index, freed=jnp.zeros((), bool),
                 occupied=zero, held=zero, rounds=zeros, accepted=zeros, proposed=zeros,
                 hist=hist, hist_len=hist_len,
                 pending=zeros if pending is None else pending,
                 has_pending=jnp.zeros((b,), bool) if has_pending is None else has_pending,
                 rng=rng)

    def cond(s):
        go = ~jnp.all(s["done"]) & ~(stop_on_free & s["freed"])
        return go if max_rounds is None else go & (s["i"] < max_rounds)

    def body(s):
        active = ~s["done"]
        rng, kd, ka = jax.random.split(s["rng"], 3)
        if row_keys is not None:  # per-row keys: a row's draws never depend on its batch
            ka = jax.vmap(jax.random.fold_in)(row_keys, s["index"])
            kd = jax.vmap(jax.random.fold_in)(ka, jnp.ones_like(s["index"]))  # drafts
        limit = jnp.minimum(k + 1, s["remaining"])  # tokens this round may emit
        nv = jnp.where(active, jnp.maximum(limit, 1), 0)
        dcache, q, cache = s["dcache"], None, s["cache"]
        if in_place_cfg:  # the draft over the target's own slots, writing after its length
            dcache = cache
        elif shared_window:  # the draft's ring rebuilt from the target's cache every round
            dcache = draft_window(cache, cfg, draft_cfg, k)
        if spec.drafter == "ngram":
            drafts, _ = ngram_draft(s["hist"], s["hist_len"], k, spec.ngram_max,
                                    spec.ngram_min)
        else:
            drafts, q, dcache = _draft_with_model(dparams, in_place_cfg or draft_cfg, dcache,
                                                  s["last"], s["pending"],
                                                  s["has_pending"], active, k, sampling,
                                                  kd, can_pend=not shared_window)
        length = cache.length
        if in_place_cfg:  # the draft's keys taken back: the verify step overwrites them
            cache = take_back(dcache, length)
        chunk = jnp.concatenate([s["last"][:, None], drafts], axis=1)
        pos = length[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        logits, cache = model_lib.forward(params, cfg, chunk, pos, cache, num_valid=nv)
        if sampling.greedy:
            emitted, n = accept_greedy(drafts, logits, nv)
        else:
            emitted, n = accept_sampled(drafts, q, logits, nv, ka, sampling)
        # a stop token inside the accepted tokens ends the row there
        j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        stop = is_stop(emitted, eos_ids) & (j <= n[:, None])
        first_stop = jnp.argmax(stop, axis=1).astype(jnp.int32)
        stopped = jnp.any(stop, axis=1)
        n_emit = jnp.where(stopped, first_stop + 1, n + 1)
        n_emit = jnp.where(active, n_emit, 0)
        # write the emitted tokens after each row's count, and into the history
        slots = jnp.where(j < n_emit[:, None], s["count"][:, None] + j, buf_len)
        rows = jnp.arange(b)[:, None]
        buf = s["buf"].at[rows, slots].set(emitted, mode="drop")
        hslots = jnp.where(j < n_emit[:, None], s["hist_len"][:, None] + j, h)
        hist = s["hist"].at[rows, hslots].set(emitted, mode="drop")
        count = s["count"] + n_emit
        new_len = length + n_emit  # [last, d_1..d_{n_emit - 1}] stay written
        cache = take_back(cache, jnp.where(active, new_len, length))
        last = jnp.where(active, jnp.take_along_axis(
            emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0], s["last"])
        pending, has_pending = s["pending"], s["has_pending"]
        if shared_window:
            dcache = None  # rebuilt next round from what the target kept
        elif dcache is not None:
            # the draft cache holds [pending?, last, d_1..d_{k-1}]: all k accepted (and
            # the row goes on), it lacks d_k, fed first next round; else cut it back
            full = active & (n_emit == k + 1)
            pending = jnp.where(full, drafts[:, -1], 0)
            has_pending = full
            dlen = jnp.where(full, new_len - 1, jnp.where(active, new_len,
                                                          dcache.length))
            dcache = take_back(dcache, dlen)
        remaining = s["remaining"] - n_emit
        finished = active & (stopped | (remaining <= 0))
        occ, held = s["occupied"], s["held"]
        if stats:  # occupied row-rounds, and the tokens those rows held
            occ = occ + jnp.sum(active.astype(jnp.int32))
            held = held + jnp.sum(jnp.where(active, policy_for(cfg).held(length, num_slots),
                                          0))
        return dict(i=s["i"] + 1, buf=buf, cache=cache, dcache=dcache, last=last,
                    done=s["done"] | finished, count=count, remaining=remaining,
                    index=s["index"] + n_emit, freed=s["freed"] | jnp.any(finished),
                    occupied=occ, held=held, rounds=s["rounds"] + active,
                    accepted=s["accepted"] + jnp.where(active, jnp.minimum(n, n_emit), 0),
                    proposed=s["proposed"] + jnp.where(active, nv - 1, 0),
                    hist=hist, hist_len=s["hist_len"] + n_emit, pending=pending,
                    has_pending=has_pending, rng=rng)

    s = jax.lax.while_loop(cond, body, state)
    return dict(tokens=s["buf"], count=s["count"], rounds=s["rounds"],
                accepted=s["accepted"], proposed=s["proposed"], steps=s["i"],
                cache=s["cache"], draft_cache=s["dcache"], last=s["last"],
                active=~s["done"], remaining=s["remaining"], hist=s["hist"],
                hist_len=s["hist_len"], occupied=s["occupied"], held=s["held"],
                pending=s["pending"], has_pending=s["has_pending"])


@functools.partial(jax.jit, static_argnames=("cfg", "draft_cfg", "spec", "sampling",
                                             "rounds"),
                   donate_argnames=("cache", "draft_cache", "hist"))
def engine_rounds_program(params, dparams, cache, draft_cache, last, active, remaining,
                          count, keys, eos_ids, hist, hist_len, stop_on_free, pending,
                          has_pending, rng, *, cfg, draft_cfg, spec, sampling, rounds):
    """The slot engines' speculative decoding: up to ``rounds`` verify rounds of every
    occupied slot (:func:`speculative_loop`), the engine's arguments and results as
    :func:`kvjax.inference.engine.decode_steps_program`'s, with each slot's history and,
    for a 'self' or 'model' drafter, the draft model's cache and state.

    Args:
      dparams, draft_cache: the draft model's parameters and its ragged batch cache
        (:func:`init_draft_cache`, each slot's row prefilled with its prompt; donated),
        or None ('ngram').
      cache: the engine's ragged batch cache (:func:`init_target_cache`; donated).
      last, active, remaining, count, keys, eos_ids, stop_on_free: as
        ``decode_steps_program`` (``count`` indexes each slot's sampling key).
      hist: [B, H] int32 each slot's tokens (prompt, generated), valid below hist_len
        [B] (donated).
      pending, has_pending: [B] the draft model's state the last call returned (zeros and
        False for a slot just filled; unused for 'ngram').
      rng: a PRNG key, unused by the draws (the draft model and the acceptance draw
        with each slot's own keys, ``keys`` folded with ``count``); kept so a caller may
        pass a new one per call.
    Returns:
      (tokens [B, rounds·(k + 1)] int32, each slot's emitted tokens in order, -1 after;
      rounds run [] int32; cache; last; active; remaining; count; occupied slot-rounds [];
      held tokens []; hist; hist_len; accepted [B]; proposed [B]; draft_cache; pending;
      has_pending; rounds each row ran [B] int32).
    """
    out = speculative_loop(params, dparams, cache, draft_cache, last, active, remaining,
                           hist, hist_len, rng, eos_ids, cfg=cfg, draft_cfg=draft_cfg, spec=spec, sampling=sampling,
                           buf_len=rounds * (spec.k + 1), max_rounds=rounds,
                           stop_on_free=stop_on_free, row_keys=keys, index=count,
                           stats=True, pending=pending, has_pending=has_pending)
    return (out["tokens"], out["steps"], out["cache"], out["last"], out["active"],
            out["remaining"], count + out["count"], out["occupied"], out["held"],
            out["hist"], out["hist_len"], out["accepted"], out["proposed"],
            out["draft_cache"], out["pending"], out["has_pending"], out["rounds"])


@dataclasses.dataclass
class SpeculativeStats:
    """What a speculative run did, per row (host ints).

    Attributes:
      rounds: verify steps per row. accepted: drafts accepted. proposed: drafts
        verified (k per round, fewer where a row's budget cut the round).
      emitted: tokens emitted after the first (prefill) token.
    """

    rounds: list
    accepted: list
    proposed: list
    emitted: list

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts over all rows (0 when none were proposed)."""
        return sum(self.accepted) / max(sum(self.proposed), 1)

    @property
    def tokens_per_step(self) -> float:
        """Emitted tokens per verify step over all rows."""
        return sum(self.emitted) / max(sum(self.rounds), 1)

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "accepted": self.accepted,
                "proposed": self.proposed, "emitted": self.emitted,
                "acceptance_rate": self.acceptance_rate,
                "tokens_per_step": self.tokens_per_step}


def slot_history(spec: SpeculativeConfig | None, num_slots: int, max_seq_len: int):
    """The slot engines' n-gram history, empty: ([B, H] int32 zeros, [B] int32 zeros) with
    H = max_seq_len + k + 2 (every token a request can hold, and a round's drafts);
    (None, None) without speculative decoding."""
    if spec is None:
        return None, None
    return (jnp.zeros((num_slots, max_seq_len + spec.k + 2), jnp.int32),
            jnp.zeros(num_slots, jnp.int32))


def put_slot_history(hist: jax.Array, hist_len: jax.Array, slot: int, tokens):
    """(hist, hist_len) with slot ``slot``'s history set to ``tokens`` (a request's
    prompt, generated tokens and the one sampled last), the rest of its row zero."""
    row = np.zeros(hist.shape[1], np.int32)
    row[:len(tokens)] = tokens
    return hist.at[slot].set(jnp.asarray(row)), hist_len.at[slot].set(len(tokens))


def self_draft(params, cfg: ModelConfig, spec: SpeculativeConfig):
    """(draft params in the draft's layout, draft config without a plan) of the 'self'
    drafter: :func:`draft_config` over the target's weights (:func:`draft_params`), in
    int8 with ``spec.draft_weight_dtype='int8'``
    (:func:`kvjax.models.weight_matmul.quantize_params_int8`, once, here)."""
    dcfg = draft_config(cfg.replace(plan=None), spec)
    dparams = model_lib.params_for(dcfg, draft_params(params, cfg, dcfg))
    if spec.draft_weight_dtype == "int8":
        dparams = weight_matmul.quantize_params_int8(dparams, stacked=dcfg.scan_layers)
    return dparams, dcfg


def draft_weight_bytes(draft_cfg: ModelConfig, spec: SpeculativeConfig) -> int | None:
    """Bytes of the 'self' draft's weights as :func:`self_draft` stores them, where they
    are not its config's dtype (``draft_weight_dtype='int8'``: int8 matrices, float32
    scales and norms), for the theory's draft step
    (:func:`kvjax.analysis.speculative.round_times`' ``draft_weights``); None otherwise.
    From the parameters' shapes: nothing is allocated. An untied model's embedding
    table is left out: a step gathers one of its rows per token, as
    :func:`kvjax.analysis.theory.weight_bytes_per_step` counts it (tied, the table is
    the LM head, read whole)."""
    if spec.drafter != "self" or spec.draft_weight_dtype != "int8":
        return None
    shapes = jax.eval_shape(
        lambda p: weight_matmul.quantize_params_int8(p, stacked=draft_cfg.scan_layers),
        model_lib.param_shapes(draft_cfg))
    if not draft_cfg.tie_embeddings:
        shapes = {n: v for n, v in shapes.items() if n != "embed"}
    return weight_matmul.weight_bytes(shapes)


def draft_costs(draft_cfg: ModelConfig | None, spec: SpeculativeConfig,
                k: int, in_place: bool = False) -> tuple[int, int | None]:
    """(copy_slots, draft_weights): what the theory's round
    (:func:`kvjax.analysis.speculative.round_times`) needs beside ``draft_cfg`` for the
    draft ``spec`` builds at k drafts a round: the slots per row a round copies from
    the target's window (:func:`draft_window_slots` where
    ``spec.copies_target_window``, else 0; 0 too with ``in_place``, a draft reading the
    target's slots where they lie, :func:`draft_in_place`) and
    :func:`draft_weight_bytes`. (0, None) without a draft config ('ngram')."""
    if draft_cfg is None:
        return 0, None
    copies = spec.copies_target_window and not in_place
    copy_slots = draft_window_slots(draft_cfg, k) if copies else 0
    return copy_slots, draft_weight_bytes(draft_cfg, spec)


def history(prompts, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram drafter's history buffer: [B, H] int32 prompts (right-padded with 0)
    and [B] lengths, H = longest prompt + :func:`buffer_len` (max_new_tokens) + 1."""
    lens = np.array([len(p) for p in prompts], np.int32)
    h = int(lens.max()) + buffer_len(max_new_tokens) + 1
    out = np.zeros((len(prompts), h), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, lens


def _program_args(params, cfg, spec, prompts, first_token, cache, num_steps, draft, rng,
                  sampling, eos_ids):
    """(positional arguments, static keyword arguments) of :func:`speculative_program`."""
    dparams, dcfg, dcache = (None, None, None) if draft is None else draft
    hist, hist_len = history(prompts, num_steps)
    rng = jax.random.key(0) if rng is None else rng
    args = (params, dparams, jnp.asarray(first_token, jnp.int32), cache, dcache,
            jnp.asarray(hist), jnp.asarray(hist_len), jnp.int32(num_steps), rng,
            jnp.asarray(np.asarray(eos_ids, np.int32).reshape(-1)))
    return args, dict(cfg=cfg, draft_cfg=dcfg, spec=spec, sampling=sampling,
                      buf_len=buffer_len(num_steps))


def buffer_len(num_steps: int) -> int:
    """The output buffer's static length: the power of two >= ``num_steps`` (at least 1),
    so few lengths compile."""
    return 1 << max(0, int(num_steps) - 1).bit_length()


def _check(cfg, spec, cache, num_steps, draft):
    if not spec.enabled:
        raise ConfigError("speculative.drafter='none'; allowed: 'ngram', 'self' or 'model' "
                          "for speculative decoding (plain decoding: decode.generate)")
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
            or num_steps < 0:
        raise ValueError(f"num_steps={num_steps}; allowed: an integer >= 0")
    if not cache.ragged:
        raise ValueError("a lockstep cache; allowed: init_target_cache(...) (ragged rows: "
                         "rows accept different numbers of drafts)")
    check_draft(cfg, None if draft is None else draft[1], spec)
    if draft is not None and (draft[2] is None) != spec.copies_target_window:
        raise ValueError(
            f"a draft cache of {None if draft[2] is None else draft[2].num_slots} slots "
            f"with speculative.draft_kv_source={spec.draft_kv_source!r}; allowed: None "
            "with 'target' (the draft copies the target's window each round), a cache "
            "from init_draft_cache with 'own'")
    if spec.copies_target_window and draft is not None and not isinstance(cache, KVCache):
        raise ValueError("speculative.draft_kv_source='target' over a paged cache; "
                         "allowed: a dense or ring cache (init_target_cache)")
    for name, c, kv in (("cache", cfg, cache),) + (
            () if draft is None or draft[2] is None else
            (("draft cache", draft[1], draft[2]),)):
        if policy_for(c).kind == "ring" and kv.num_slots - c.window_size < _spare(c, spec.k):
            raise ValueError(
                f"{name} holds {kv.num_slots} slots for window_size={c.window_size}; "
                f"allowed: at least {c.window_size + _spare(c, spec.k)} (k + 1 = "
                f"{spec.k + 1} spare, so a rejected draft evicts no key the window shows: "
                "init_target_cache / init_draft_cache)")
    cache_lib.policy_for(cfg).check_room(jax.device_get(cache.length), num_steps,
                                         cache.num_slots, "speculative generate")


def compile_program(params, cfg: ModelConfig, spec: SpeculativeConfig, prompts,
                    first_token, cache: KVCache, num_steps: int, *,
                    draft: tuple | None = None, rng: jax.Array | None = None,
                    sampling: SamplingConfig = SamplingConfig(), eos_ids=(-1,)):
    """The compiled :func:`speculative_program` for :func:`generate`'s arguments (ahead of
    time, so a timed call runs no compilation). Checks as :func:`generate`."""
    _check(cfg, spec, cache, num_steps, draft)
    args, static = _program_args(params, cfg, spec, prompts, first_token, cache, num_steps,
                                 draft, rng, sampling, eos_ids)
    return speculative_program.lower(*args, **static).compile()


def generate(params, cfg: ModelConfig, spec: SpeculativeConfig, prompts, first_token,
             cache: KVCache, num_steps: int, *, draft: tuple | None = None,
             rng: jax.Array | None = None, sampling: SamplingConfig = SamplingConfig(),
             eos_ids=(-1,), compiled=None):
    """Generates up to ``num_steps`` tokens after ``first_token`` by speculative decoding,
    in one compiled loop (drafting, verifying, accepting and taking back inside it).

    Args:
      params: the target's parameters. cfg: its config.
      spec: SpeculativeConfig (drafter, k, ...; drafter not 'none').
      prompts: B token lists, the prompts in ``cache`` (the n-gram history).
      first_token: [B] int32 sampled from the prefill logits.
      cache: the target's prefilled cache (:func:`init_target_cache`; donated).
      num_steps: tokens to emit after first_token per row (>= 0).
      draft: (draft_params, draft_cfg, draft_cache) for 'self'/'model': the draft cache
        prefilled with the same prompts (:func:`init_draft_cache`; donated), or None in
        its place with ``spec.draft_kv_source='target'`` (the draft's window copied from
        the target's cache each round); None for 'ngram'.
      rng: PRNG key (default key 0). sampling: the target's (static).
      eos_ids: end-of-generation ids (-1 entries never match).
      compiled: :func:`compile_program`'s result for these arguments (None: jit).
    Returns:
      (tokens: B lists of emitted ids, each ending at its stop token or its budget;
      SpeculativeStats; the target cache; the draft cache or None).
    Raises:
      ConfigError: drafter 'none', a draft missing or given wrongly, vocabularies differ.
      ValueError: num_steps not an integer >= 0, a cache that is not ragged, a ring
        cache (target's or draft's) with fewer than k + 1 slots beyond its window, or a
        draft cache given with ``draft_kv_source='target'`` (or missing with 'own').
      CacheOverflowError: the tokens would not fit in the cache (plain decoding's rule:
        the same tokens are written).
    """
    _check(cfg, spec, cache, num_steps, draft)
    args, static = _program_args(params, cfg, spec, prompts, first_token, cache, num_steps,
                                 draft, rng, sampling, eos_ids)
    out = compiled(*args) if compiled is not None else speculative_program(*args, **static)
    count = np.asarray(out["count"])
    toks = np.asarray(out["tokens"])
    stats = SpeculativeStats(rounds=np.asarray(out["rounds"]).tolist(),
                             accepted=np.asarray(out["accepted"]).tolist(),
                             proposed=np.asarray(out["proposed"]).tolist(),
                             emitted=count.tolist())
    return ([toks[i, :count[i]].tolist() for i in range(len(count))], stats, out["cache"],
            out["draft_cache"])
