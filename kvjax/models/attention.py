"""Multi-head attention with grouped KV heads (MHA / GQA / MQA) and an optional window.

One module covers the blog's lever 1: ``num_kv_heads`` K = N is MHA, K = 1 is MQA
(Shazeer 2019), anything dividing N is GQA (Ainslie et al. 2023). Query head n reads KV
head n // G with G = N // K (the heads of one group are adjacent). Lever 3, the window,
is the cache's slot policy (:mod:`kvjax.cache.policy`): it decides which slots exist and
which keys a query sees, so this module only applies the mask it is given.

Scores, softmax weights and (in :func:`attend`) the value product are float32 whatever the
parameter/cache dtype; a query that sees no key gets zeros.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import ops
from kvjax.cache import paged as paged_lib
from kvjax.cache.policy import policy_for
from kvjax.config import ModelConfig
from kvjax.models import decode_kernels, flash
from kvjax.models.layers import Einsum, RMSNorm, apply_rope
from kvjax.native import prefill as native_prefill
from kvjax.ops import NEG_INF, weight_dtype
from kvjax.ops import layout_spec as _spec
from kvjax.plan import SEQ

# A decode step over an int8 / fp8 cache (one scale per token per KV head) applies the
# scales outside the dots (:func:`attend_step` with k_scale/v_scale) so that XLA:CPU fuses
# the codes' convert into the dots; False: dequantize first (kvjax.cache.read), which
# XLA materialises as a float32 copy of the cache. Measured in scripts/kv_quant_bench.py.
SCALE_OUTSIDE_DOTS = True

# A chunk of at most this many tokens over a dense cache (a speculative verify step of
# k + 1 <= 16 tokens) runs :func:`attend_small_chunk`, the decode step's formulation;
# longer chunks (prompts) run the prompt path (``prefill_impl``).
SMALL_CHUNK = 16


def dot_operand(x: jax.Array, backend: str | None = None) -> jax.Array:
    """:func:`kvjax.ops.dot_operand` for ``backend`` (None: the process's, for library
    calls without a config)."""
    return ops.dot_operand(x, backend or backend_lib.current())


def softcap(x: jax.Array, cap: float) -> jax.Array:
    """Soft-capping cap·tanh(x / cap) (Gemma 2, Team 2024 sec. 2: attention scores and
    final logits): x's shape and dtype, values in (-cap, cap)."""
    return cap * jnp.tanh(x / cap)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           k_layout: str = "BKSH", v_layout: str = "BKSH",
           backend: str | None = None, sinks: tuple | None = None,
           logit_softcap: float | None = None) -> jax.Array:
    """Softmax attention of grouped queries over one layer's keys and values.

    Args:
      q: [B, T, K, G, H] queries (already rotated).
      k: [B, K, S, H] keys ('BKSH'), or [B, K, H, S] with ``k_layout='BKHS'``.
      v: [B, K, S, Hv] values ('BKSH'), or [B, K, Hv, S] with ``v_layout='BKHS'``.
      mask: [B, T, S] bool, True where the key is visible.
      k_layout, v_layout: 'BKSH' or 'BKHS' (see :func:`kvjax.backend.kv_layout`).
      backend: whose dot-operand rule applies (:func:`dot_operand`).
      sinks: (q_sink [B, T, K, G, H], is_sink [B, S] bool) or None: keys flagged as
        attention sinks are scored with ``q_sink`` (the queries rotated at their cache
        positions, StreamingLLM) instead of ``q``.
      logit_softcap: c, or None: the scaled scores s become c·tanh(s / c)
        (:func:`softcap`) before the mask.
    Returns:
      [B, T, K, G, Hv] in v's dtype. Scores, softmax weights and the value product are
      float32 (the weights are not rounded to v's dtype: in bf16 that erred by 1.7e-3 on
      a weight of 0.84); the unnormalised weights exp(s - max) are multiplied into the
      values and the [.., Hv] result divided by their sum. A query row that sees no key
      (all of its mask False, e.g. a padded row) gets zeros.
    Raises:
      ValueError: an unknown layout.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum(f"BTKGH,{_spec(k_layout)}->BKGTS", dot_operand(q, backend),
                        dot_operand(k, backend), preferred_element_type=jnp.float32) * scale
    if sinks is not None:
        q_sink, is_sink = sinks
        s_sink = jnp.einsum(f"BTKGH,{_spec(k_layout)}->BKGTS", dot_operand(q_sink, backend),
                            dot_operand(k, backend), preferred_element_type=jnp.float32)
        scores = jnp.where(is_sink[:, None, None, None, :], s_sink * scale, scores)
    if logit_softcap is not None:
        scores = softcap(scores, logit_softcap)
    visible = mask[:, None, None, :, :]
    scores = jnp.where(visible, scores, NEG_INF)
    m = jnp.max(scores, axis=-1, keepdims=True)
    # Masked keys weigh exactly 0, also in a row with no visible key (there m = NEG_INF).
    e = jnp.where(visible, jnp.exp(scores - m), 0.0)  # [B, K, G, T, S] float32
    denom = jnp.sum(e, axis=-1)  # [B, K, G, T]
    out = jnp.einsum(f"BKGTS,{_spec(v_layout, 'V')}->BTKGV", e, dot_operand(v, backend),
                     preferred_element_type=jnp.float32)
    denom = jnp.transpose(denom, (0, 3, 1, 2))[..., None]  # [B, T, K, G, 1]
    return (out / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)


def attend_step(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
                k_new: jax.Array, v_new: jax.Array, k_layout: str = "BKSH",
                v_layout: str = "BKSH", new_visible: jax.Array | None = None,
                sink_scores: jax.Array | None = None, impl: str = "xla",
                backend: str | None = None, k_scale: jax.Array | None = None,
                v_scale: jax.Array | None = None,
                block_table: jax.Array | None = None) -> jax.Array:
    """One decode step (T = 1): attention over the cache's old slots plus the new token.

    Same math as :func:`attend` over ``concat(k_cache, k_new)`` without materialising the
    concatenation (which would copy the whole cache every step): one softmax over the
    old scores and the new token's score. The cache is read before the new token is
    written, so the write can update the (donated) buffer in place.

    Args:
      q: [B, 1, K, G, H] the new token's queries.
      k_cache, v_cache: this layer's cache before the write, [B, K, S, H] / [B, K, S, Hv]
        ('BKSH') or [B, K, H, S] / [B, K, Hv, S] ('BKHS').
      mask: [B, 1, S] bool, visible old slots.
      k_new, v_new: the new token's key and value in the same layouts (S -> 1).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      new_visible: [B] bool, whether each row's query sees its own new key (None: all
        do). A row that sees no key at all gets zeros, as in :func:`attend`.
      sink_scores: [B, K, G, s] float32 scaled scores that replace those of slots 0..s-1
        (attention sinks scored at cache positions, :func:`sink_scores`), or None.
      impl: the formulation (sink_scores use 'xla') of the products over the old slots, one of
        :data:`kvjax.models.decode_kernels.IMPLS` ('xla': the einsums below; the others:
        :func:`kvjax.models.decode_kernels.partial_attention`, same result).
      backend: the config's backend (None: the process's).
      k_scale, v_scale: None, or the float32 scales of a cache quantized with one scale
        per token per KV head (int8, fp8: :mod:`kvjax.cache.quant`), [B, K, S] each;
        ``k_cache``/``v_cache`` are then the codes and the scales are applied outside
        the contractions over H: scores = (q · codes_k[s]) · k_scale[s] and
        out = sum_s (e_s · v_scale[s]) · codes_v[s], equal to attention over the
        dequantized values up to float32 rounding (the products are reassociated). Only
        a convert of the codes stays on the dot operands, which XLA:CPU fuses into the
        dots, so the 1-byte cache is streamed instead of copied to float32 first.
        Needs ``impl='xla'`` and no ``sink_scores``.
      block_table: [B, M] int32, or None: ``k_cache``/``v_cache`` are then one layer's
        page pools ([N, K, P, H] ...) and ``mask`` [B, 1, M·P] covers each row's logical
        slots (:func:`kvjax.models.decode_kernels.partial_attention`; 'native' reads the
        pages in place). Needs ``impl`` other than 'xla', no sink_scores and no scales.

      Masked old slots: their scores are selected away on every formulation; with
      scales, the masked weights x scales are selected and fp8 codes zeroed, and the
      'native' kernel skips masked slots, so a NaN or inf there contributes nothing
      (issue 32). The float 'xla' / 'xla_cache_left' value products do not zero masked
      values themselves (XLA:CPU would copy the value cache every step for it: +7.8%
      bytes on gqa, +19% on mha); :class:`Attention` zeroes them where a pass over the
      values exists anyway (a dequantized cache).
    Returns:
      [B, 1, K, G, Hv] in v_cache's dtype (float32 with scales); scores and softmax in
      float32. The
      unnormalised weights exp(s - max) enter the value product in
      :func:`weight_dtype` (float32 on CPU) and the denominator sums them as used.
    Raises:
      ValueError: an unknown layout or impl; a block table with impl 'xla', sink scores
        or scales.
    """
    scale = q.shape[-1] ** -0.5
    q1 = q[:, 0]  # [B, K, G, H]
    scaled = k_scale is not None
    if block_table is not None and (impl == "xla" or sink_scores is not None or scaled):
        raise ValueError(f"block_table needs impl other than 'xla' (got {impl!r}), no "
                         "sink_scores and no scales (those read the rows' dense views)")
    if scaled and (impl != "xla" or sink_scores is not None or v_scale is None):
        raise ValueError(f"k_scale/v_scale need impl='xla' (got {impl!r}), no sink_scores "
                         "and both scales")
    if scaled:
        return _attend_step_scaled(q1, k_cache, k_scale, v_cache, v_scale, mask, k_new,
                                   v_new, k_layout, v_layout, new_visible, scale)
    if impl != "xla" and sink_scores is None:
        return _attend_step_kernel(q1, k_cache, v_cache, mask, k_new, v_new, k_layout,
                                   v_layout, new_visible, impl, backend, scale, block_table)
    s_old = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", q1, k_cache,
                       preferred_element_type=jnp.float32) * scale
    if sink_scores is not None:  # the first slots are sinks scored with another query
        s_old = s_old.at[..., :sink_scores.shape[-1]].set(sink_scores)
    visible = mask[:, :, None, :]  # [B, 1, 1, S]
    s_old = jnp.where(visible, s_old, NEG_INF)
    s_new, v1 = _new_token_scores(q1, k_new, v_new, k_layout, v_layout, new_visible, scale)
    m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), s_new)  # [B, K, G, 1]
    # Unnormalised weights; the softmax denominator divides the [.., Hv] output instead
    # of the [.., S] weights (one pass less over the scores). Masked keys weigh 0 even
    # when no key is visible (m = NEG_INF there).
    wdt = weight_dtype(v_cache.dtype, backend or backend_lib.current())
    e_old = jnp.where(visible, jnp.exp(s_old - m), 0.0).astype(wdt)
    e_new = jnp.exp(s_new - m)
    if new_visible is not None:
        e_new = jnp.where(new_visible[:, None, None, None], e_new, 0.0)
    denom = jnp.sum(e_old.astype(jnp.float32), axis=-1, keepdims=True) + e_new
    v_op = dot_operand(v_cache, backend) if wdt == jnp.float32 else v_cache
    out = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", e_old, v_op,
                     preferred_element_type=jnp.float32)
    out = out + e_new * v1[:, :, None, :].astype(jnp.float32)
    out = out / jnp.where(denom > 0, denom, 1.0)  # [B, K, G, Hv]
    return out[:, None].astype(v_cache.dtype)


def _slot_axis(layout: str) -> int:
    """The slot axis of one layer's keys or values in ``layout`` (-2 'BKSH', -1 'BKHS')."""
    return -1 if layout == "BKHS" else -2


def _new_token_scores(q1, k_new, v_new, k_layout, v_layout, new_visible, scale):
    """The decode step's own token: its scaled score [B, K, G, 1] float32 against
    ``q1`` [B, K, G, H] (NEG_INF where ``new_visible`` [B] is False) and its value
    [B, K, Hv], from ``k_new``/``v_new`` ([B, K, 1, H] in BKSH, [B, K, H, 1] in BKHS)."""
    k1 = k_new[:, :, 0] if k_layout == "BKSH" else k_new[..., 0]  # [B, K, H]
    v1 = v_new[:, :, 0] if v_layout == "BKSH" else v_new[..., 0]  # [B, K, Hv]
    s_new = jnp.einsum("BKGH,BKH->BKG", q1, k1,
                       preferred_element_type=jnp.float32)[..., None] * scale
    if new_visible is not None:
        s_new = jnp.where(new_visible[:, None, None, None], s_new, NEG_INF)
    return s_new, v1


def _attend_step_scaled(q1, k_codes, k_scale, v_codes, v_scale, mask, k_new, v_new,
                        k_layout, v_layout, new_visible, scale):
    """:func:`attend_step` over 1-byte codes with per-slot scales ([B, K, S] float32)."""
    s_old = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", q1.astype(jnp.float32),
                       k_codes.astype(jnp.float32), preferred_element_type=jnp.float32)
    s_old = s_old * (k_scale[:, :, None, :] * scale)
    visible = mask[:, :, None, :]  # [B, 1, 1, S]
    s_old = jnp.where(visible, s_old, NEG_INF)
    s_new, v1 = _new_token_scores(q1, k_new, v_new, k_layout, v_layout, new_visible, scale)
    m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), s_new)  # [B, K, G, 1]
    e_old = jnp.where(visible, jnp.exp(s_old - m), 0.0)  # [B, K, G, S] float32
    e_new = jnp.exp(s_new - m)
    if new_visible is not None:
        e_new = jnp.where(new_visible[:, None, None, None], e_new, 0.0)
    denom = jnp.sum(e_old, axis=-1, keepdims=True) + e_new
    # A masked slot contributes nothing whatever its scale or code holds (issue 32): the
    # weight-times-scale is selected ([B, K, G, S], fused with the exp), and fp8 codes
    # (which can encode NaN / inf) are zeroed inside their convert to float32; int8
    # codes are always finite.
    w_old = jnp.where(visible, e_old * v_scale[:, :, None, :], 0.0)
    v_codes = ops.zero_unseen(v_codes, mask[:, 0], _slot_axis(v_layout))
    out = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", w_old,
                     v_codes.astype(jnp.float32), preferred_element_type=jnp.float32)
    out = out + e_new * v1[:, :, None, :].astype(jnp.float32)
    out = out / jnp.where(denom > 0, denom, 1.0)  # [B, K, G, Hv]
    return out[:, None]


def sink_query_positions(cfg: ModelConfig, positions: jax.Array) -> jax.Array | None:
    """[B, T] int32 positions at which queries are rotated to score the attention sinks,
    or None when sinks use absolute positions (``cfg.rope_positions`` 'absolute', or no
    sinks). With 'cache' (StreamingLLM, Xiao et al. 2023, sec. 3.2: positions within the
    cache), a query at q sits at cache position min(q, W - 1) of a contiguous stream
    (s sinks, then the ring's W - s newest tokens, itself last) and sink k at k, so the
    query-to-sink distance stays below W; ring keys keep their distance q - k, which is
    the same in both modes, so only the sinks' scores change."""
    if cfg.rope_positions != "cache" or not cfg.num_sink_tokens:
        return None
    return jnp.minimum(positions, cfg.window_size - 1)


def sink_scores(cfg: ModelConfig, q_sink: jax.Array | None, k_old: jax.Array,
                k_layout: str) -> jax.Array | None:
    """[B, K, G, s] float32 scaled scores of the decode step's sink slots (slots 0..s-1 of
    a ring, :class:`kvjax.cache.policy.RingSlots`) against ``q_sink`` [B, 1, K, G, H], or
    None. Extra cost per layer and step: s keys read again and 2·N·s·H FLOP."""
    if q_sink is None:
        return None
    s = cfg.num_sink_tokens
    sinks = k_old[:, :, :s] if k_layout == "BKSH" else k_old[..., :s]
    return jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", q_sink[:, 0], sinks,
                      preferred_element_type=jnp.float32) * q_sink.shape[-1] ** -0.5


def _zero_padded(positions: jax.Array, out: jax.Array) -> jax.Array:
    """Zeros for padded query rows (position -1, right-padded ragged chunks), whose
    output the tiled path does not mask (it skips masks inside full tiles)."""
    return jnp.where((positions >= 0)[:, :, None, None, None], out, 0).astype(out.dtype)


def _sinks(cfg: ModelConfig, q_sink, key_positions: jax.Array):
    """(q_sink, is_sink [B, S]) for :func:`attend`, or None."""
    if q_sink is None:
        return None
    return q_sink, (key_positions >= 0) & (key_positions < cfg.num_sink_tokens)


def _attend_step_kernel(q1, k_cache, v_cache, mask, k_new, v_new, k_layout, v_layout,
                        new_visible, impl, backend, scale, block_table=None):
    """:func:`attend_step` through a formulation of :mod:`kvjax.models.decode_kernels`."""
    o, m, l = decode_kernels.partial_attention(
        impl, q1, k_cache, v_cache, mask[:, 0], k_layout, v_layout,
        backend=backend or backend_lib.current(), block_table=block_table)
    k1 = k_new[:, :, 0] if k_layout == "BKSH" else k_new[..., 0]  # [B, K, H]
    v1 = v_new[:, :, 0] if v_layout == "BKSH" else v_new[..., 0]  # [B, K, Hv]
    s_new = jnp.einsum("BKGH,BKH->BKG", q1, k1, preferred_element_type=jnp.float32) * scale
    out = decode_kernels.merge_new(o, m, l, s_new, v1, new_visible)
    return out[:, None].astype(v_cache.dtype)


def _attend_softcapped(c: ModelConfig, q, k_cur, v_cur, positions, cached,
                       cached_positions):
    """Attention with soft-capped scores (``c.attn_logit_softcap``, Gemma 2): the dense
    formulation (:func:`attend`) over (the layer's cached slots ++ the chunk), for
    prompts and decode steps alike; slots no query sees contribute nothing (their
    values zeroed). q [B, T, K, G, H]; returns [B, T, K, G, H]."""
    k_layout, v_layout = c.cache_layout("k"), c.cache_layout("v")
    mask = cache_lib.attention_mask(positions, positions, c)
    k, v = k_cur, v_cur
    if cached is not None:
        k_old, v_old = cache_lib.read(c, cached, "k"), cache_lib.read(c, cached, "v")
        mask_old = cache_lib.attention_mask(positions, cached_positions, c)
        v_old = ops.zero_unseen(v_old, jnp.any(mask_old, axis=1), cache_lib.slot_axis(c, "v"))
        k = jnp.concatenate([k_old, k_cur], axis=cache_lib.slot_axis(c, "k"))
        v = jnp.concatenate([v_old, v_cur], axis=cache_lib.slot_axis(c, "v"))
        mask = jnp.concatenate([mask_old, mask], axis=2)
    return attend(q, k, v, mask, k_layout, v_layout, backend=c.backend,
                  logit_softcap=c.attn_logit_softcap)


def query_scale(c: ModelConfig) -> float:
    """The factor queries are multiplied by so that attention's H^-1/2 becomes
    ``query_pre_attn_scalar``^-1/2 (Gemma 2 / 3); 1.0 without it."""
    if c.query_pre_attn_scalar is None:
        return 1.0
    return (c.head_dim / c.query_pre_attn_scalar) ** 0.5


def _page_size(cached) -> int:
    """P of a paged layer (:class:`kvjax.cache.paged.PagedLayer`), 0 for a dense one."""
    return cached.page_size if isinstance(cached, paged_lib.PagedLayer) else 0


def _in_place(cfg: ModelConfig, cached, impl: str, sink_s) -> tuple[dict, jax.Array | None]:
    """({'k': pool, 'v': pool}, block table) when the decode formulation reads this
    layer's paged cache where its pages lie (one of
    :data:`kvjax.models.decode_kernels.IN_PLACE` on a float cache, no sink scores:
    :class:`kvjax.cache.paged.PagedLayer`), else ({}, None): the dense views are read."""
    if (isinstance(cached, paged_lib.PagedLayer) and impl in decode_kernels.IN_PLACE
            and not cfg.kv_quantized and sink_s is None):
        return {n: cached.pools[n] for n in ("k", "v")}, cached.block_table
    return {}, None


def _native_chunk(plan, q, k, v, positions, k_old=None, v_old=None, old_positions=None,
                  **kw):
    """``native_prefill.attend_chunk`` on each device's own rows and KV heads when the
    plan's mesh splits them (:func:`kvjax.ops.per_device`): the custom call is per row
    and KV head, and GSPMD would gather q/k/v whole to every device around it."""
    def fn(q, k, v, positions, k_old, v_old, old_positions):
        return native_prefill.attend_chunk(q, k, v, positions, k_old=k_old, v_old=v_old,
                                           old_positions=old_positions, **kw)
    data_axis, model_axis = plan.per_device_axes()
    return ops.per_device(fn, q, k, v, positions, k_old, v_old, old_positions,
                          head_axes=(2, 1, 1, None, 1, 1, None), out_head_axis=2,
                          data_axis=data_axis, model_axis=model_axis)


def attend_small_chunk(q: jax.Array, k_old: jax.Array, v_old: jax.Array,
                       visible_old: jax.Array, k_new: jax.Array, v_new: jax.Array,
                       mask_new: jax.Array, k_layout: str = "BKSH", v_layout: str = "BKSH",
                       impl: str = "xla", backend: str | None = None,
                       block_table: jax.Array | None = None) -> jax.Array:
    """Attention of a short chunk over (the cache's old slots ++ its own entries) by a
    decode-step formulation: the T queries of a KV head's group become T·G query rows of
    :func:`kvjax.models.decode_kernels.partial_attention`, so every old key and value is
    read once for all of them, as in a plain step. This is the verify step of
    speculative decoding (Leviathan et al. 2023, sec. 3: k + 1 positions scored in one
    pass over the weights and the cache); the prompt path (tiled, 256-key blocks) read
    the cache at a fraction of the decode step's rate for such chunks (docs/results).

    Args:
      q: [B, T, K, G, H] rotated queries.
      k_old, v_old: one layer's cache before the write ([B, K, S, H] 'BKSH' or
        [B, K, H, S] 'BKHS').
      visible_old: [B, S] bool, the old slots every query of the row sees: the same
        set for all T queries, as in a dense cache (no window) where every old slot
        precedes the chunk. Padded query rows get what the row's others get (the caller
        zeroes them).
      k_new, v_new: the chunk's entries [B, K, T, H] in the same layouts.
      mask_new: [B, T, T] bool, the chunk keys each query sees (causal).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      impl: the decode formulation (:data:`kvjax.models.decode_kernels.IMPLS`).
      backend: the config's backend (None: the process's).
      block_table: [B, M] int32, or None: ``k_old``/``v_old`` are then page pools and
        ``visible_old`` covers each row's M·P logical slots (as :func:`attend_step`).
    Returns:
      [B, T, K, G, Hv] in the chunk's value dtype, equal to :func:`attend` over the concatenation
      (float32 statistics, up to summation order).
    Raises:
      ValueError: an unknown layout or impl (:func:`partial_attention`).
    """
    b, t, kh, g, h = q.shape
    backend = backend or backend_lib.current()
    rows = jnp.transpose(q, (0, 2, 1, 3, 4)).reshape(b, kh, t * g, h)  # [B, K, T·G, H]
    o, m, l = decode_kernels.partial_attention(impl, rows, k_old, v_old, visible_old,
                                               k_layout, v_layout, backend=backend,
                                               block_table=block_table)
    to_t = lambda x: jnp.transpose(x.reshape(b, kh, t, g, -1), (0, 2, 1, 3, 4))
    old = (to_t(m[..., None]), to_t(l[..., None]), to_t(o))  # [B, T, K, G, .]
    new = _chunk_stats(k_new, v_new, mask_new, q, k_layout, v_layout, backend)
    return ops.finish(ops.merge(old, new)).astype(v_new.dtype)


def _chunk_stats(k, v, mask, q, k_layout, v_layout, backend):
    """Partial softmax state (m [B, T, K, G, 1], l likewise, o [B, T, K, G, Hv]) of the
    queries q [B, T, K, G, H] over keys k / values v (one layer, in their layouts) under
    mask [B, T, S]."""
    scale = q.shape[-1] ** -0.5
    qo, ko, vo = (dot_operand(x, backend) for x in (q, k, v))
    if q.shape[1] == 1:
        # decode (T = 1): the single-device step's products without the T axis. With
        # it ('BTKGH,BKHS->BKGTS'), XLA on CPU transposed each 'BKHS' key shard into
        # a copy before the dot (a seq-sharded step read 1.3-1.8x theory per device).
        sc = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", qo[:, 0], ko,
                        preferred_element_type=jnp.float32)[:, :, :, None, :] * scale
    else:
        sc = jnp.einsum(f"BTKGH,{_spec(k_layout)}->BKGTS", qo, ko,
                        preferred_element_type=jnp.float32) * scale
    m, e, l = ops.softmax_stats(sc, mask[:, None, None, :, :])
    if q.shape[1] == 1:
        o = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", e[:, :, :, 0], vo,
                       preferred_element_type=jnp.float32)[:, None]
    else:
        o = jnp.einsum(f"BKGTS,{_spec(v_layout, 'V')}->BTKGV", e, vo,
                       preferred_element_type=jnp.float32)
    to_o = lambda x: jnp.transpose(x, (0, 3, 1, 2, 4))  # [B,K,G,T,1] -> [B,T,K,G,1]
    return to_o(m), to_o(l), o


def attend_cached_seq(plan, q, k_old, v_old, mask_old, k_new, v_new, mask_new,
                      k_layout: str, v_layout: str, backend: str) -> jax.Array:
    """GQA attention of a chunk over (old slots split over the plan's 'seq' axis ++ its
    own entries): flash-decoding across devices.

    Each device scores its own S / n slots and keeps the partial softmax state (m, l, o)
    of its slots; the states are combined across 'seq' (:func:`kvjax.ops.combine_over`:
    the cache itself never moves), merged with the chunk's own keys (replicated) and
    normalised.

    Args:
      plan: the config's plan (its 'seq' axis splits the slots).
      q: [B, T, K, G, H] rotated queries (T = 1 in decode, the prompt in prefill).
      k_old, v_old: one layer's cache before the write ([B, K, S, H] 'BKSH' or
        [B, K, H, S] 'BKHS').
      mask_old: [B, T, S] bool, visible old slots.
      k_new, v_new: the chunk's entries [B, K, T, H] in the same layouts.
      mask_new: [B, T, T] bool, visible chunk keys.
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      backend: the config's backend (dot operands, :func:`dot_operand`).
    Returns:
      [B, T, K, G, Hv] in v_old's dtype, equal to :func:`attend` over the concatenation
      (float32 statistics; up to summation order).
    """
    def local(k, v, mask, q):
        return _chunk_stats(k, v, mask, q, k_layout, v_layout, backend)

    ax = lambda layout: -1 if layout == "BKHS" else -2
    old = ops.combine_over(SEQ, plan.seq_manual, local,
                           ((k_old, ax(k_layout)), (v_old, ax(v_layout)), (mask_old, -1)),
                           (q,))
    new = local(k_new, v_new, mask_new, q)
    return ops.finish(ops.merge(old, new)).astype(v_new.dtype)


def norm_heads(c: ModelConfig, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Queries [B, T, N, H] and keys [B, T, K, H] through their per-head RMSNorms
    (parameters 'q_norm', 'k_norm': one scale [H] each) when ``c.qk_norm`` (Qwen3,
    ``Qwen3Attention``: after the projections, before the rotary embedding); else as
    they are. Called inside :class:`Attention`'s compact scope."""
    if not c.qk_norm:
        return q, k
    dt = c.jnp_dtype
    return (RMSNorm(c.norm_eps, dt, name="q_norm")(q),
            RMSNorm(c.norm_eps, dt, name="k_norm")(k))


class Attention(nn.Module):
    """Grouped-query attention layer with a functional KV cache.

    Parameters: q_proj [D, N, H], k_proj [D, K, H], v_proj [D, K, H], o_proj [N, H, D]
    ('kernel'), and with ``cfg.qkv_bias`` (Qwen2) a 'bias' of q_proj [N, H], k_proj and
    v_proj [K, H], added before the rotary embedding; with ``cfg.qk_norm`` (Qwen3)
    q_norm and k_norm 'scale' [H], an RMSNorm of each head (:func:`norm_heads`) before
    the rotary embedding.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, cached: dict | None,
                 cached_positions: jax.Array | None):
        """Attention for one layer; the caller writes the returned chunk into the cache.

        Args:
          x: [B, T, D] inputs.
          positions: [B, T] int32 absolute positions of the T tokens.
          cached: this layer's cache before the chunk, {'k': [B, K, S, H], 'v': ...} in
            the layouts of ``cfg.cache_layout`` (S and H swapped for 'BKHS'), or None for
            a cache-free causal forward over the T tokens.
          cached_positions: [B, S] int32 slot positions of each row before the chunk
            (-1: empty).
        Returns:
          (out [B, T, D], the chunk's entries in the cache's representation
          (:func:`kvjax.cache.encode`): {'k': [B, K, T, H], 'v': [B, K, T, H]} in the
          cache layouts, T and H swapped for 'BKHS').
        """
        c = self.cfg
        dt = c.jnp_dtype
        b, t, _ = x.shape
        n, k, h, g = c.num_heads, c.num_kv_heads, c.head_dim, c.num_groups
        proj = dict(impl=c.weight_matmul, plan=c.plan, use_bias=c.qkv_bias)
        q = Einsum((c.d_model, n, h), "BTD,DNH->BTNH", dt, name="q_proj", **proj)(x)
        kk = Einsum((c.d_model, k, h), "BTD,DKH->BTKH", dt, name="k_proj", **proj)(x)
        vv = Einsum((c.d_model, k, h), "BTD,DKH->BTKH", dt, name="v_proj", **proj)(x)
        q, kk = norm_heads(c, q, kk)
        # Sinks at cache positions (StreamingLLM): sink keys are scored with the queries
        # rotated at their cache positions instead of their absolute ones.
        sink_q = sink_query_positions(c, positions)
        rot = dict(theta=c.rope_theta, scaling=c.rope_scaling)
        q_sink = None if sink_q is None else apply_rope(q, sink_q, **rot).reshape(
            b, t, k, g, h)
        q = apply_rope(q, positions, **rot).reshape(b, t, k, g, h)
        if c.query_pre_attn_scalar is not None:  # the scale query_pre_attn_scalar^-1/2
            q = q * jnp.asarray(query_scale(c), q.dtype)
            q_sink = None if q_sink is None else q_sink * jnp.asarray(query_scale(c), q.dtype)
        # Kept only when the caller asks (model.forward's observe): lever 5's methods
        # score the prompt's slots with these queries (kvjax.cache.compress).
        self.sow("intermediates", "queries", q)
        kk = jnp.swapaxes(apply_rope(kk, positions, **rot), 1, 2)  # [B, K, T, H]
        vv = jnp.swapaxes(vv, 1, 2)

        k_layout, v_layout = c.cache_layout("k"), c.cache_layout("v")
        new = cache_lib.encode(c, {"k": cache_lib.to_layout(kk, c, "k"),
                                   "v": cache_lib.to_layout(vv, c, "v")})
        tiled = dict(window_size=c.window_size, num_sink_tokens=c.num_sink_tokens,
                     block_q=c.prefill_block_q, block_k=c.prefill_block_k, backend=c.backend)
        # The tiled path scores every key with one query; sinks at cache positions need
        # a second one for the sink keys, which the dense path does.
        plan = c.execution
        path = flash.prefill_path(c, q_sink is not None)
        use_tiled = path in ("tiled", "cudnn")   # cudnn: chunks after the first run tiled
        native = dict(window_size=c.window_size, num_sink_tokens=c.num_sink_tokens,
                      k_layout=k_layout, v_layout=v_layout)
        # The chunk attends to its own entries as the cache will hold them.
        k_cur, v_cur = cache_lib.read(c, new, "k"), cache_lib.read(c, new, "v")
        if c.attn_logit_softcap is not None:  # Gemma 2: the dense formulation
            out = _attend_softcapped(c, q, k_cur, v_cur, positions, cached, cached_positions)
        elif cached is None:  # no cache, or an empty one (a fresh prefill)
            if path == "cudnn":
                out = flash.attend_chunk_sdpa(q, k_cur, v_cur, positions, k_layout=k_layout,
                                              v_layout=v_layout, window_size=c.window_size)
            elif path == "native":
                out = _native_chunk(plan, q, k_cur, v_cur, positions, **native)
            elif use_tiled:
                out = _zero_padded(positions, flash.attend_chunk(
                    q, k_cur, v_cur, positions, k_layout=k_layout, v_layout=v_layout,
                    **tiled))
            else:
                out = attend(q, k_cur, v_cur,
                             cache_lib.attention_mask(positions, positions, c),
                             k_layout, v_layout, backend=c.backend,
                             sinks=_sinks(c, q_sink, positions))
        else:
            # Attend over (old slots ++ this chunk); the caller writes afterwards. Reading
            # before writing keeps the in-place update copy-free, and in a ring buffer the
            # chunk's writes may evict keys that its earlier queries still see.
            k_old, v_old = cache_lib.read(c, cached, "k"), cache_lib.read(c, cached, "v")
            mask_old = cache_lib.attention_mask(positions, cached_positions, c)
            # Old slots no query sees contribute exactly nothing whatever they hold (a
            # NaN or inf in a never-written slot, issue 32): their values are zeroed
            # before the value product (a weight of 0 times NaN is NaN) on the prompt
            # paths and, in a decode step or a small chunk, where the values are
            # dequantized anyway (the select fuses into that pass); the native kernels
            # skip them. Not in a float decode step or small chunk under XLA: a select
            # there costs a copy of the value cache per step (docs/results); the
            # programs running those clear the never-written slots once on entry
            # (model.clear_masked_slots). The keys need nothing: every path selects
            # the scores.
            v_seen = lambda: ops.zero_unseen(v_old, jnp.any(mask_old, axis=1),
                                             cache_lib.slot_axis(c, "v"))
            if plan.seq_shards > 1:  # cache split over the mesh's 'seq' axis
                out = attend_cached_seq(
                    plan, q, k_old, v_seen(), mask_old, k_cur, v_cur,
                    cache_lib.attention_mask(positions, positions, c), k_layout, v_layout,
                    c.backend)
            elif t == 1:
                impl = decode_kernels.choose(c, k_old, v_old, _page_size(cached))
                sink_s = sink_scores(c, q_sink, k_old, k_layout)
                scales = cache_lib.row_scales(c, cached)
                if (SCALE_OUTSIDE_DOTS and scales is not None and impl == "xla"
                        and sink_s is None):
                    # 1-byte codes with a scale per slot: the scales leave the dots
                    out = attend_step(q, cached["k"], cached["v"], mask_old, k_cur, v_cur,
                                      k_layout, v_layout, new_visible=positions[:, 0] >= 0,
                                      k_scale=scales[0], v_scale=scales[1]).astype(dt)
                else:
                    v_step = v_seen() if c.kv_quantized and impl != "native" else v_old
                    pools, table = _in_place(c, cached, impl, sink_s)
                    out = attend_step(q, pools.get("k", k_old), pools.get("v", v_step),
                                      mask_old, k_cur, v_cur, k_layout, v_layout,
                                      new_visible=positions[:, 0] >= 0, sink_scores=sink_s,
                                      impl=impl, backend=c.backend, block_table=table)
            elif t <= SMALL_CHUNK and policy_for(c).kind == "dense":
                # A few queries over the cache (a speculative verify step, a short chunk):
                # the decode step's formulation with the T queries as extra group rows,
                # so the cache is read once as in a plain step (docs/DESIGN.md).
                # Masked values as in a decode step (model.clear_masked_slots).
                impl = decode_kernels.choose(c, k_old, v_old, _page_size(cached), queries=t)
                v_step = v_seen() if c.kv_quantized and impl != "native" else v_old
                pools, table = _in_place(c, cached, impl, None)
                out = _zero_padded(positions, attend_small_chunk(
                    q, pools.get("k", k_old), pools.get("v", v_step),
                    jnp.any(mask_old, axis=1), k_cur, v_cur,
                    cache_lib.attention_mask(positions, positions, c), k_layout,
                    v_layout, impl=impl, backend=c.backend, block_table=table))
            elif path == "native":
                out = _native_chunk(plan, q, k_cur, v_cur, positions, k_old=k_old,
                                    v_old=v_old, old_positions=cached_positions, **native)
            elif use_tiled:
                out = _zero_padded(positions, flash.attend_chunk(
                    q, k_cur, v_cur, positions, k_old=k_old, v_old=v_seen(),
                    old_positions=cached_positions, k_layout=k_layout, v_layout=v_layout,
                    **tiled))
            else:
                mask_new = cache_lib.attention_mask(positions, positions, c)
                out = attend(q,
                             jnp.concatenate([k_old, k_cur], axis=cache_lib.slot_axis(c, "k")),
                             jnp.concatenate([v_seen(), v_cur],
                                             axis=cache_lib.slot_axis(c, "v")),
                             jnp.concatenate([mask_old, mask_new], axis=2),
                             k_layout, v_layout, backend=c.backend,
                             sinks=_sinks(c, q_sink, jnp.concatenate(
                                 [cached_positions, positions], axis=1)))

        out = Einsum((n, h, c.d_model), "BTF,FD->BTD", dt, merge_in=2, name="o_proj",
                     impl=c.weight_matmul, plan=c.plan)(
            out.astype(dt).reshape(b, t, n, h))
        return out, new
