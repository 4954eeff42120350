"""Speculative decoding: verify k drafted tokens in one forward of the target model.

A decode step reads every weight and every cached key and value to produce one token, at
~1 FLOP/byte (the blog's "The GPU sits idle 99.3% of the time"). Scoring k + 1 positions
in one forward reads the same bytes and does k + 1 times the arithmetic, so while the step
stays memory-bound it costs about one step and can emit up to k + 1 tokens (Leviathan et
al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling").

One round of :func:`speculative_loop`'s ``lax.while_loop``, per row:

1. **Draft** k tokens d_1..d_k after the last emitted token ``last`` by the run's
   :class:`Drafter`, which owns its cache, draft, take-back and costs (the loop is one
   for all): :class:`NgramDrafter` (prompt lookup: no model, no cache),
   :class:`SelfDrafter` (the target's weights over a cheap cache: a window with sinks, a
   quantized copy or the first L' layers), :class:`ModelDrafter` (another config's model).
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

__all__ = ["Drafter", "NgramDrafter", "ModelDrafter", "SelfDrafter", "DRAFTERS",
           "drafter_for", "draft_config", "draft_params", "self_draft", "spare_slots",
           "init_target_cache",
           "init_draft_cache", "draft_window", "draft_window_slots", "ngram_draft",
           "take_back", "accept_greedy", "accept_sampled", "speculative_loop",
           "compile_program", "generate",
           "SpeculativeStats", "history", "slot_history", "put_slot_history"]


# --------------------------------------------------------------------------- caches


def spare_slots(cfg: ModelConfig, k: int) -> int:
    """Spare slots a speculative cache keeps: k + 1 for a ring (a chunk of k + 1 then
    evicts nothing the window shows) and for the local layers' rings of
    ``cfg.layer_windows`` (:func:`kvjax.cache.init_cache` gives them to the rings only),
    0 for a dense cache (its rows never hold more than plain decoding writes)."""
    rings = policy_for(cfg).kind == "ring" or any(
        w is not None for w in (cfg.layer_windows or ()))
    return k + 1 if rings else 0


def init_target_cache(cfg: ModelConfig, batch_size: int, max_seq_len: int,
                      k: int) -> KVCache:
    """The target's cache for speculative decoding: ragged rows (each accepts its own
    number of tokens), a ring with k + 1 spare slots (:func:`spare_slots`)."""
    return cache_lib.init_cache(cfg, batch_size, max_seq_len, ragged=True,
                                spare_slots=spare_slots(cfg, k))


def init_draft_cache(draft_cfg: ModelConfig, batch_size: int, max_seq_len: int,
                     k: int) -> KVCache:
    """The draft model's cache: ragged; k + 1 slots beyond ``max_seq_len`` when dense
    (a round drafts k tokens past the target's accepted length), k + 1 spare in a ring."""
    dense = policy_for(draft_cfg).kind != "ring"
    return cache_lib.init_cache(draft_cfg, batch_size, max_seq_len + (k + 1) * dense,
                                ragged=True, spare_slots=spare_slots(draft_cfg, k))


def draft_window(cache: KVCache, cfg: ModelConfig, draft_cfg: ModelConfig,
                 k: int) -> KVCache:
    """The ring a draft with ``draft_kv_source='target'`` drafts over this round: each
    row's sinks and last positions of ``cache`` (the target's, config ``cfg``) copied by
    :func:`kvjax.cache.window_view` into the slots :func:`init_draft_cache` would give
    it (:func:`draft_window_slots`)."""
    return cache_lib.window_view(cache, cfg, draft_cfg, draft_window_slots(draft_cfg, k))


def draft_window_slots(draft_cfg: ModelConfig, k: int) -> int:
    """Slots per row of :func:`draft_window`'s ring: the window W plus k + 1 spare (what
    :func:`init_draft_cache` gives a ring), the count a round copies from the target."""
    return draft_cfg.window_size + spare_slots(draft_cfg, k)


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
    if spec.draft_window_size:  # one window over every layer (none of layer_windows)
        fields.update(window_size=spec.draft_window_size,
                      num_sink_tokens=spec.draft_sink_tokens, layer_windows=None)
    if spec.draft_kv_dtype:
        fields["kv_dtype"] = spec.draft_kv_dtype
    if spec.draft_num_layers:
        if spec.draft_num_layers > cfg.num_layers:
            raise ConfigError(
                f"speculative.draft_num_layers={spec.draft_num_layers}; allowed: 0 (all) "
                f"to the target's num_layers={cfg.num_layers}")
        fields["num_layers"] = spec.draft_num_layers
        if cfg.layer_windows is not None and not spec.draft_window_size:  # the first L'
            fields["layer_windows"] = cfg.layer_windows[:spec.draft_num_layers]
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


@dataclasses.dataclass(frozen=True)
class Drafter:
    """What a verify round asks of the method that proposes its k tokens, the speculative
    counterpart of gemma's ``SamplingMethod``: one immutable object per method, static in
    the jit key, whose traced methods the one loop (:func:`speculative_loop`) calls in the
    same order whatever the method. The loop owns the target's cache, the verify forward
    and the acceptance; a drafter owns its cache, its draft, its take-back and its costs.
    This base is the protocol with its defaults (no model, no cache); build one with
    :func:`drafter_for`.

    Attributes:
      spec: the SpeculativeConfig (k, the n-gram range, the draft's cache source).
      cfg: the draft model's config (static); None for a drafter without a model.
      target, in_place_cfg: set by :meth:`bind`: the target's config, and the config of
        a draft over the target's slots in place (:meth:`SelfDrafter.in_place`) or None.
    """

    spec: SpeculativeConfig
    cfg: ModelConfig | None = None
    target: ModelConfig | None = None
    in_place_cfg: ModelConfig | None = None

    keeps_cache = False  # a cache of its own beside the target's (init_draft_cache)

    def init_cache(self, batch_size: int, max_seq_len: int):
        """The drafter's own empty cache (:func:`init_draft_cache`), None without one."""
        return (init_draft_cache(self.cfg, batch_size, max_seq_len, self.spec.k)
                if self.keeps_cache else None)

    def check(self, cfg: ModelConfig) -> None:
        """Refuses, before any work, a drafter the target (config ``cfg``) cannot use.

        Raises:
          ConfigError: a draft model given to a drafter that takes none, a drafter that
            needs one without it, or a draft model with another vocabulary.
        """
        if self.cfg is not None:
            raise ConfigError(f"speculative.drafter={self.spec.drafter!r} takes no draft "
                              "model")

    def in_place(self, cfg: ModelConfig, batch_size: int,
                 num_slots: int) -> ModelConfig | None:
        """The config of a draft that reads the target's cache where it lies, or None."""
        return None

    def bind(self, cfg: ModelConfig, batch_size: int, num_slots: int) -> "Drafter":
        """The drafter for rounds over a target (config ``cfg``) cache of ``batch_size``
        rows of ``num_slots`` slots (static; called while tracing)."""
        return dataclasses.replace(self, target=cfg,
                                   in_place_cfg=self.in_place(cfg, batch_size, num_slots))

    def round_cache(self, cache, dcache):
        """The cache this round drafts over: the drafter's own ``dcache`` (None without
        one), or a view of the target's ``cache``."""
        return dcache

    def draft(self, dparams, dcache, s: dict, active, sampling: SamplingConfig, key):
        """(drafts [B, k] int32, q [B, k, V] float32 or None for a deterministic draft,
        dcache) after the loop state ``s`` ('last', 'pending', 'has_pending', 'hist',
        'hist_len'); ``key``: one PRNG key, or [B] keys."""
        raise NotImplementedError

    def verify_cache(self, cache, dcache):
        """The target's cache for the verify forward, after the draft wrote ``dcache``."""
        return cache

    def take_back(self, dcache, drafts, active, n_emit, new_len, pending, has_pending):
        """(dcache, pending, has_pending) after a round that emitted ``n_emit`` [B] tokens
        per row (the target's rows now hold ``new_len`` [B]): rejected drafts taken back."""
        return dcache, pending, has_pending

    def costs(self, in_place: bool = False) -> tuple[int, int | None]:
        """(copy_slots, draft_weights) of the theory's round
        (:func:`kvjax.analysis.speculative.round_times`) beside ``cfg``: the slots per row
        a round copies from the target's window (0 ``in_place``), and the draft weights'
        bytes where they are not ``cfg``'s dtype (None otherwise)."""
        return 0, None


class NgramDrafter(Drafter):
    """'ngram' (prompt lookup, :func:`ngram_draft`): drafts from each row's history; no
    model, no cache, nothing to take back, deterministic (q one-hot)."""

    def draft(self, dparams, dcache, s, active, sampling, key):
        spec = self.spec
        drafts, _ = ngram_draft(s["hist"], s["hist_len"], spec.k, spec.ngram_max,
                                spec.ngram_min)
        return drafts, None, dcache


class ModelDrafter(Drafter):
    """'model' (and the base of 'self'): a draft model decodes k tokens over its own
    ragged cache (:meth:`draft`); after a round its cache is cut back to what
    the target kept, but for a round that accepted all k, whose last draft is fed first
    next round (``pending``)."""

    keeps_cache = True

    def check(self, cfg):
        if self.cfg is None:
            raise ConfigError(f"speculative.drafter={self.spec.drafter!r} needs a draft "
                              "model config; none was built")
        if self.cfg.vocab_size != cfg.vocab_size:
            raise ConfigError(
                f"draft model vocab_size={self.cfg.vocab_size}; allowed: the target's "
                f"vocab_size={cfg.vocab_size} (the drafter must share the tokenizer)")

    def draft(self, dparams, dcache, s, active, sampling, key):
        """k tokens from the draft model over ``dcache``, which holds the row's tokens
        before ``last``, except, after a round whose k drafts were all accepted, the last
        draft (``pending``): the first forward feeds [pending, last] (2 tokens) or [last]
        (1), the next k - 1 one token each. Without a cache of its own (a window copied or
        read each round) no row has a pending draft. With [B] keys a row's drafts never
        depend on its batch-mates."""
        k, dcfg, last, b = self.spec.k, self.in_place_cfg or self.cfg, s["last"], active.size
        if self.keeps_cache:
            pend = s["has_pending"]
            pair = jnp.where(pend[:, None], jnp.stack([s["pending"], last], 1),
                             jnp.stack([last, last], 1))
            n0 = jnp.where(active, 1 + pend.astype(jnp.int32), 0)
        else:
            pair, n0 = last[:, None], active.astype(jnp.int32)
        pos = dcache.length[:, None] + jnp.arange(pair.shape[1], dtype=jnp.int32)[None, :]
        logits, dcache = model_lib.forward(dparams, dcfg, pair, pos, dcache, num_valid=n0,
                                           last_only=True)
        per_row = key.ndim == 1

        def pick(logits, key):  # a draft is a proposal: a non-finite row proposes 0
            if sampling.greedy:
                tok = sample_logits(logits, key if not per_row else key[0], sampling)
                return jnp.maximum(tok, 0), None
            q = sampling_probs(logits, sampling)
            if per_row:
                tok = jax.vmap(jax.random.categorical)(key, jnp.log(q))
            else:
                tok = jax.random.categorical(key, jnp.log(q), axis=-1)
            return jnp.where(nonfinite_rows(logits), 0, tok.astype(jnp.int32)), q

        keys = (jnp.moveaxis(jax.vmap(lambda r: jax.random.split(r, k))(key), 0, 1)
                if per_row else jax.random.split(key, k))  # [k, B] or [k]
        d, q = pick(logits[:, 0], keys[0])
        drafts = jnp.zeros((b, k), jnp.int32).at[:, 0].set(d)
        q_all = None if q is None else jnp.zeros((b, k) + q.shape[1:],
                                                 q.dtype).at[:, 0].set(q)
        one = active.astype(jnp.int32)

        def body(i, carry):
            dcache, d, drafts, q_all = carry
            logits, dcache = model_lib.forward(dparams, dcfg, d[:, None],
                                               dcache.length[:, None], dcache, num_valid=one)
            d, q = pick(logits[:, 0], keys[i])
            return (dcache, d, drafts.at[:, i].set(d),
                    None if q_all is None else q_all.at[:, i].set(q))

        # The k - 1 later steps: a loop whose trip count XLA cannot fold (none when no
        # row is active, whose drafts go unused). A loop of 0 or 1 trips would be inlined,
        # and XLA would then fuse the draft's cache writes into the verify step's reads of
        # the same buffer (a draft over the target's slots in place), copying the cache
        # each round.
        dcache, _, drafts, q_all = jax.lax.fori_loop(
            1, jnp.where(jnp.any(active), k, 0), body, (dcache, d, drafts, q_all))
        return drafts, q_all, dcache

    def take_back(self, dcache, drafts, active, n_emit, new_len, pending, has_pending):
        # the draft cache holds [pending?, last, d_1..d_{k-1}]: all k accepted (and the
        # row goes on), it lacks d_k, fed first next round; else cut it back
        full = active & (n_emit == self.spec.k + 1)
        dlen = jnp.where(full, new_len - 1, jnp.where(active, new_len, dcache.length))
        return take_back(dcache, dlen), jnp.where(full, drafts[:, -1], 0), full


class SelfDrafter(ModelDrafter):
    """'self': the target's weights (:func:`self_draft`: the first L' layers, int8 with
    ``draft_weight_dtype='int8'``) over a cheap cache (:func:`draft_config`). With
    ``draft_kv_source='own'`` it keeps that cache; with 'target' none: each round drafts
    over the target's window, copied (:func:`draft_window`) or read in place
    (:meth:`in_place`), and drops it after."""

    @property
    def keeps_cache(self) -> bool:
        return not self.spec.copies_target_window

    def check(self, cfg):
        """Also warns (UserWarning) where an int8 draft with a resolved plan would not run
        the native int8 kernel on CPU: XLA then multiplies by weights widened to float32
        every step, slower than the float32 draft.

        Raises:
          ConfigError: also ``draft_kv_source='target'`` over a target with
            ``layer_windows`` (its local layers' rings hold other slots than the window
            copy reads).
        """
        super().check(cfg)
        if self.spec.copies_target_window and cfg.layer_windows is not None:
            raise ConfigError(
                f"speculative.draft_kv_source='target' with model.layer_windows="
                f"{cfg.layer_windows}; allowed: draft_kv_source='own' (the draft keeps its "
                "own cache; copying the target's window reads a cache of one slot "
                "policy for every layer)")
        d = self.cfg
        if (self.spec.draft_weight_dtype == "int8" and d.plan is not None
                and d.backend == "cpu"
                and not weight_matmul.int8_runs_native(d.weight_matmul, d.plan, d.dtype)):
            warnings.warn(
                f"speculative.draft_weight_dtype='int8' with model.weight_matmul="
                f"{d.weight_matmul!r}, dtype={d.dtype!r} and native kernels "
                f"{list(d.plan.native)}: the draft multiplies by its int8 weights widened "
                "to float32 in XLA every step, slower than a float32 draft on CPU; the "
                "int8 kernel needs weight_matmul other than 'xla', dtype 'float32' and "
                "the native rows_matmul loaded", stacklevel=3)

    def in_place(self, cfg, batch_size, num_slots):
        """With ``draft_kv_source='target'``: the config of a draft that reads the
        target's (config ``cfg``) dense cache where it lies, or None where a round copies
        the window instead (:func:`draft_window`).

        In place, the draft attends to each row's sinks and last positions as a mask over
        the target's own slots (``window_cache='dense'``: the same keys the copy would
        hold, so the same drafts) and writes its k - 1 draft keys after the row's length,
        where the verify step then writes the target's own. That needs dense target rows
        (``batch_size`` x ``num_slots`` slots), every layer, the target's cache layouts
        and a decode formulation that reads only the visible slots
        (:data:`kvjax.models.decode_kernels.IN_PLACE`: 'native' on CPU); with any of them
        missing the copy reads and writes fewer bytes than a draft step over all slots.
        """
        if (self.keeps_cache or policy_for(cfg).kind != "dense" or cfg.is_mla
                or self.cfg.num_layers != cfg.num_layers):
            return None
        icfg = self.cfg.replace(window_cache="dense")
        if cache_lib.layouts(icfg) != cache_lib.layouts(cfg):
            return None
        specs = cache_lib.tensor_specs(icfg, batch_size, num_slots)
        k, v = (jax.ShapeDtypeStruct(specs[n].shape, specs[n].dtype) for n in ("k", "v"))
        return icfg if decode_kernels.choose(icfg, k, v) in decode_kernels.IN_PLACE else None

    def round_cache(self, cache, dcache):
        if self.in_place_cfg:  # over the target's own slots, writing after its length
            return cache
        if not self.keeps_cache:  # the ring rebuilt from the target's cache every round
            return draft_window(cache, self.target, self.cfg, self.spec.k)
        return dcache

    def verify_cache(self, cache, dcache):
        # in place, the draft's keys are taken back: the verify step overwrites them
        return take_back(dcache, cache.length) if self.in_place_cfg else cache

    def take_back(self, dcache, drafts, active, n_emit, new_len, pending, has_pending):
        if not self.keeps_cache:  # rebuilt next round from what the target kept
            return None, pending, has_pending
        return super().take_back(dcache, drafts, active, n_emit, new_len, pending,
                                 has_pending)

    def weight_bytes(self) -> int | None:
        """Bytes of the draft's weights as :func:`self_draft` stores them, where they are
        not its config's dtype (``draft_weight_dtype='int8'``: int8 matrices, float32
        scales and norms); None otherwise. From the parameters' shapes (nothing is
        allocated). An untied model's embedding table is left out: a step gathers one of
        its rows per token, as :func:`kvjax.analysis.theory.weight_bytes_per_step` counts
        it (tied, the table is the LM head, read whole)."""
        if self.spec.draft_weight_dtype != "int8":
            return None
        d = self.cfg
        shapes = jax.eval_shape(
            lambda p: weight_matmul.quantize_params_int8(p, stacked=d.scan_layers),
            model_lib.param_shapes(d))
        if not d.tie_embeddings:
            shapes = {n: v for n, v in shapes.items() if n != "embed"}
        return weight_matmul.weight_bytes(shapes)

    def costs(self, in_place=False):
        copies = self.spec.copies_target_window and not in_place
        return (draft_window_slots(self.cfg, self.spec.k) if copies else 0,
                self.weight_bytes())


DRAFTERS = {"ngram": NgramDrafter, "self": SelfDrafter, "model": ModelDrafter}
"""speculative.drafter -> its :class:`Drafter` class."""


def drafter_for(spec: SpeculativeConfig, draft_cfg: ModelConfig | None = None) -> Drafter:
    """The :class:`Drafter` of ``spec.drafter`` with the draft model's config
    ``draft_cfg`` (None for 'ngram'; :meth:`Drafter.check` refuses a wrong one).

    Raises:
      ConfigError: drafter 'none' (plain decoding).
    """
    if not spec.enabled:
        raise ConfigError("speculative.drafter='none'; allowed: 'ngram', 'self' or 'model' "
                          "for speculative decoding (plain decoding: decode.generate)")
    return DRAFTERS[spec.drafter](spec, draft_cfg)



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


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "sampling", "buf_len",
                                             "max_rounds", "stats"),
                   donate_argnames=("cache", "draft_cache", "hist"))
def speculative_loop(params, dparams, cache, draft_cache, last, active, remaining, hist,
                     hist_len, rng, eos_ids, *, cfg, drafter, sampling, buf_len,
                     max_rounds=None, stop_on_free=None, row_keys=None, index=None,
                     stats=False, pending=None, has_pending=None) -> dict:
    """The speculative loop, one compiled program for :func:`generate` (a batch of
    prompts, every row until it stops) and for the slot engine
    (:class:`kvjax.inference.engine.Engine`: ``max_rounds`` rounds a call, per-row keys,
    stats): verify rounds of the active rows until each has stopped. Clears both caches'
    never-written slots on entry (``model.clear_masked_slots``). The caches and ``hist``
    are donated.

    Args:
      params, dparams: the target's and the draft model's parameters (None: 'ngram').
      cache, draft_cache: the target's ragged cache and the drafter's own (None where
        it keeps none: :attr:`Drafter.keeps_cache`).
      last: [B] int32 each row's last token (emitted, not yet written).
      active: [B] bool rows that decode. remaining: [B] int32 tokens each may emit.
      hist: [B, H] int32 each row's tokens so far (prompt, emitted, ``last``), valid
        below hist_len [B].
      rng: PRNG key (the draws of the draft model and of the acceptance without
        ``row_keys``).
      eos_ids: [E] int32.
      cfg, sampling: static configs. drafter: the static :class:`Drafter`, which
        drafts, and takes back its own cache, the same way in every round.
      buf_len: static output length.
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
      'index' [B] (``index`` plus the tokens emitted), 'hist', 'hist_len', 'occupied' []
      and 'held' [] (0 without ``stats``), 'pending' and 'has_pending' (and the loop's
      own 'done', 'freed' and 'rng').
    """
    b = last.shape[0]
    k = drafter.spec.k
    drafter = drafter.bind(cfg, b, cache.num_slots)
    cache = model_lib.clear_masked_slots(cfg, cache, k + 1)
    draft_cache = model_lib.clear_masked_slots(drafter.cfg, draft_cache)
    zeros = jnp.zeros((b,), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    stop_on_free = jnp.zeros((), bool) if stop_on_free is None else stop_on_free
    state = dict(steps=zero, tokens=jnp.full((b, buf_len), -1, jnp.int32), cache=cache,
                 draft_cache=draft_cache, last=last, done=~active | (remaining <= 0),
                 count=zeros, remaining=remaining, index=zeros if index is None else index,
                 freed=jnp.zeros((), bool), occupied=zero, held=zero, rounds=zeros,
                 accepted=zeros, proposed=zeros, hist=hist, hist_len=hist_len,
                 pending=zeros if pending is None else pending,
                 has_pending=jnp.zeros((b,), bool) if has_pending is None else has_pending,
                 rng=rng)

    def cond(s):
        go = ~jnp.all(s["done"]) & ~(stop_on_free & s["freed"])
        return go if max_rounds is None else go & (s["steps"] < max_rounds)

    def body(s):
        active = ~s["done"]
        rng, kd, ka = jax.random.split(s["rng"], 3)
        if row_keys is not None:  # per-row keys: a row's draws never depend on its batch
            ka = jax.vmap(jax.random.fold_in)(row_keys, s["index"])
            kd = jax.vmap(jax.random.fold_in)(ka, jnp.ones_like(s["index"]))  # drafts
        limit = jnp.minimum(k + 1, s["remaining"])  # tokens this round may emit
        nv = jnp.where(active, jnp.maximum(limit, 1), 0)
        cache = s["cache"]
        dcache = drafter.round_cache(cache, s["draft_cache"])
        drafts, q, dcache = drafter.draft(dparams, dcache, s, active, sampling, kd)
        length = cache.length
        cache = drafter.verify_cache(cache, dcache)
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
        buf = s["tokens"].at[rows, slots].set(emitted, mode="drop")
        hslots = jnp.where(j < n_emit[:, None], s["hist_len"][:, None] + j,
                           s["hist"].shape[1])
        hist = s["hist"].at[rows, hslots].set(emitted, mode="drop")
        count = s["count"] + n_emit
        new_len = length + n_emit  # [last, d_1..d_{n_emit - 1}] stay written
        cache = take_back(cache, jnp.where(active, new_len, length))
        last = jnp.where(active, jnp.take_along_axis(
            emitted, jnp.maximum(n_emit - 1, 0)[:, None], axis=1)[:, 0], s["last"])
        dcache, pending, has_pending = drafter.take_back(
            dcache, drafts, active, n_emit, new_len, s["pending"], s["has_pending"])
        remaining = s["remaining"] - n_emit
        finished = active & (stopped | (remaining <= 0))
        occ, held = s["occupied"], s["held"]
        if stats:  # occupied row-rounds, and the tokens those rows held
            occ = occ + jnp.sum(active.astype(jnp.int32))
            held = held + jnp.sum(jnp.where(
                active, policy_for(cfg).held(length, cache.num_slots), 0))
        return dict(steps=s["steps"] + 1, tokens=buf, cache=cache, draft_cache=dcache,
                    last=last,
                    done=s["done"] | finished, count=count, remaining=remaining,
                    index=s["index"] + n_emit, freed=s["freed"] | jnp.any(finished),
                    occupied=occ, held=held, rounds=s["rounds"] + active,
                    accepted=s["accepted"] + jnp.where(active, jnp.minimum(n, n_emit), 0),
                    proposed=s["proposed"] + jnp.where(active, nv - 1, 0),
                    hist=hist, hist_len=s["hist_len"] + n_emit, pending=pending,
                    has_pending=has_pending, rng=rng)

    s = jax.lax.while_loop(cond, body, state)
    return {**s, "active": ~s["done"]}


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
        return {**dataclasses.asdict(self), "acceptance_rate": self.acceptance_rate,
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


def history(prompts, max_new_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """The n-gram drafter's history buffer: [B, H] int32 prompts (right-padded with 0)
    and [B] lengths, H = longest prompt + :func:`buffer_len` (max_new_tokens) + 1."""
    lens = np.array([len(p) for p in prompts], np.int32)
    h = int(lens.max()) + buffer_len(max_new_tokens) + 1
    out = np.zeros((len(prompts), h), np.int32)
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    return out, lens


def buffer_len(num_steps: int) -> int:
    """The output buffer's static length: the power of two >= ``num_steps`` (at least 1),
    so few lengths compile."""
    return 1 << max(0, int(num_steps) - 1).bit_length()


def _program_args(params, cfg, spec, prompts, first_token, cache, num_steps, draft, rng,
                  sampling, eos_ids):
    """(positional arguments, static keyword arguments) of :func:`speculative_loop` for
    :func:`generate` (``first_token`` emitted, in the history; a row whose first token
    is a stop token inactive), after its checks."""
    dparams, dcfg, dcache = (None, None, None) if draft is None else draft
    if cfg.kv_compression is not None and (not cfg.kv_evicts
                                           or cfg.compression.schedule != "prefill"):
        raise ConfigError(
            f"speculative decoding with model.kv_compression={cfg.kv_compression!r} and "
            f"model.compression.schedule={cfg.compression.schedule!r}; allowed: None, or "
            "an evicting method with schedule 'prefill' (its cache is then a fixed kept "
            "set and a ring, rolled back as a window's; a decode-time re-scoring or a "
            "page selection is not rolled back)")
    drafter = drafter_for(spec, dcfg)
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) \
            or num_steps < 0:
        raise ValueError(f"num_steps={num_steps}; allowed: an integer >= 0")
    if not cache.ragged:
        raise ValueError("a lockstep cache; allowed: init_target_cache(...) (ragged rows: "
                         "rows accept different numbers of drafts)")
    drafter.check(cfg)
    if draft is not None and (dcache is None) == drafter.keeps_cache:
        raise ValueError(
            f"a draft cache of {None if dcache is None else dcache.num_slots} slots "
            f"with speculative.draft_kv_source={spec.draft_kv_source!r}; allowed: None "
            "with 'target' (the draft copies the target's window each round), a cache "
            "from init_draft_cache with 'own'")
    if spec.copies_target_window and draft is not None and not isinstance(cache, KVCache):
        raise ValueError("speculative.draft_kv_source='target' over a paged cache; "
                         "allowed: a dense or ring cache (init_target_cache)")
    for name, c, kv in (("cache", cfg, cache),) + (
            () if dcache is None else (("draft cache", dcfg, dcache),)):
        for i, w in enumerate(c.layer_windows or ()):  # each local layer's ring
            held = kv.tensors["k"][i].shape[cache_lib.slot_axis(c, "k")]
            if w is not None and 0 <= held - w < spare_slots(c, spec.k):
                raise ValueError(
                    f"{name}'s layer {i} holds {held} slots for its window {w} "
                    f"(model.layer_windows); allowed: at least {w + spare_slots(c, spec.k)} "
                    f"(k + 1 = {spec.k + 1} spare, so a rejected draft evicts no key the "
                    "window shows: init_target_cache / init_draft_cache)")
        # a ring of fewer than W slots (max_seq_len < W) never wraps: it fills as a
        # dense cache (check_room), so a rollback evicts nothing
        if policy_for(c).kind == "ring" and \
                0 <= kv.num_slots - c.cache_window < spare_slots(c, spec.k):
            raise ValueError(
                f"{name} holds {kv.num_slots} slots for "
                + (f"window_size={c.window_size}" if c.window_size else
                   f"kv_budget + recent_slots={c.cache_window}") + "; "
                f"allowed: at least {c.cache_window + spare_slots(c, spec.k)} (k + 1 = "
                f"{spec.k + 1} spare, so a rejected draft evicts no key the window shows: "
                "init_target_cache / init_draft_cache)")
    cache_lib.policy_for(cfg).check_room(jax.device_get(cache.length), num_steps,
                                         cache.num_slots, "speculative generate")
    first = np.asarray(first_token, np.int32)
    hist, hist_len = history(prompts, num_steps)
    hist[np.arange(len(first)), hist_len] = first  # the n-gram drafts look it up too
    eos = jnp.asarray(np.asarray(eos_ids, np.int32).reshape(-1))
    args = (params, dparams, cache, dcache, jnp.asarray(first), ~is_stop(first, eos),
            jnp.full(len(first), num_steps, jnp.int32), jnp.asarray(hist),
            jnp.asarray(hist_len + 1), jax.random.key(0) if rng is None else rng, eos)
    return args, dict(cfg=cfg, drafter=drafter, sampling=sampling,
                      buf_len=buffer_len(num_steps))


def compile_program(params, cfg: ModelConfig, spec: SpeculativeConfig, prompts,
                    first_token, cache: KVCache, num_steps: int, *,
                    draft: tuple | None = None, rng: jax.Array | None = None,
                    sampling: SamplingConfig = SamplingConfig(), eos_ids=(-1,)):
    """The compiled :func:`speculative_loop` for :func:`generate`'s arguments (ahead of
    time, so a timed call runs no compilation). Checks as :func:`generate`."""
    args, static = _program_args(params, cfg, spec, prompts, first_token, cache, num_steps,
                                 draft, rng, sampling, eos_ids)
    return speculative_loop.lower(*args, **static).compile()


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
      ConfigError: drafter 'none', a draft missing or given wrongly, vocabularies differ,
        a target with ``kv_compression`` other than an evicting method compressed
        after its prefill (schedule 'prefill': its kept slots and ring roll back as a
        window's; the prefill into :func:`init_target_cache` gives its ring the k + 1
        spare slots).
      ValueError: num_steps not an integer >= 0, a cache that is not ragged, a ring
        cache (target's or draft's, or a local layer's ring of ``layer_windows``) with
        fewer than k + 1 slots beyond its window, or a
        draft cache given with ``draft_kv_source='target'`` (or missing with 'own').
      CacheOverflowError: the tokens would not fit in the cache (plain decoding's rule:
        the same tokens are written).
    """
    args, static = _program_args(params, cfg, spec, prompts, first_token, cache, num_steps,
                                 draft, rng, sampling, eos_ids)
    out = compiled(*args) if compiled is not None else speculative_loop(*args, **static)
    toks, count = np.asarray(out["tokens"]), np.asarray(out["count"])
    stats = SpeculativeStats(*(np.asarray(out[n]).tolist()
                               for n in ("rounds", "accepted", "proposed", "count")))
    return ([toks[i, :count[i]].tolist() for i in range(len(count))], stats, out["cache"],
            out["draft_cache"])
