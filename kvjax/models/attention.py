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

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import compression, kernels, ops
from kvjax.cache import paged as paged_lib
from kvjax.config import ModelConfig
from kvjax.models import decode_kernels, flash
from kvjax.models.decode_kernels import SMALL_CHUNK  # noqa: F401 (re-exported)
from kvjax.models.layers import Einsum, RMSNorm, applied, apply_rope
from kvjax.native import prefill as native_prefill
from kvjax.ops import NEG_INF, weight_dtype
from kvjax.ops import layout_spec as _spec
from kvjax.plan import SEQ


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
        :func:`kvjax.kernels.names` ('xla': the einsums below; the others:
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
    dims = decode_kernels.cache_dims(k_cache, v_cache, k_layout, v_layout)
    # codes with scales are attended as float32 (the scales applied around the dots)
    dtype = "float32" if k_scale is not None else jnp.dtype(k_cache.dtype).name
    where = kernels.Site("decode_attention", backend=backend or backend_lib.current(),
                         dtype=dtype, k_layout=k_layout,
                         v_layout=v_layout, head_dim=q.shape[-1], groups=q.shape[3],
                         slots=dims[2],
                         quantized=k_scale is not None,
                         sinks_at_cache=sink_scores is not None, native=kernels.NATIVE)
    return kernels.run("decode_attention", kernels.select("decode_attention", impl, where),
                       q[:, 0], k_cache, v_cache, mask, k_new, v_new, k_layout, v_layout,
                       new_visible, sink_scores, backend, k_scale, v_scale, block_table,
                       q.shape[-1] ** -0.5, entry="step")


def _no_scales_nor_table(name, k_scale, block_table, tables_ok: bool = False) -> None:
    """Raises ValueError where a step formulation is handed what it cannot read: scales
    (only 'xla' reads 1-byte codes with their scales, as 'xla_scaled'), or a block table
    (only a formulation that reads a paged cache's dense views or its pools does)."""
    if k_scale is not None or (block_table is not None and not tables_ok):
        raise ValueError(f"decode_attention={name!r}: k_scale/v_scale need impl='xla' and "
                         "no sink_scores; block_table needs impl other than 'xla', no "
                         "sink_scores and no scales (those read the rows' dense views)")


def step_xla(name, q1, k_cache, v_cache, mask, k_new, v_new, k_layout, v_layout,
             new_visible, sink_scores, backend, k_scale, v_scale, block_table, scale):
    """:func:`attend_step` by 'xla' (and with sink scores, by any formulation): the
    einsums below, the queries as the left operand."""
    _no_scales_nor_table(name, k_scale, block_table)
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


def step_scaled(name, q1, k_codes, v_codes, mask, k_new, v_new, k_layout, v_layout,
                new_visible, sink_scores, backend, k_scale, v_scale, block_table, scale):
    """:func:`attend_step` by 'xla_scaled': over 1-byte codes with per-slot scales
    ([B, K, S] float32 each), applied outside the contractions."""
    if v_scale is None or block_table is not None:
        raise ValueError("k_scale/v_scale need impl='xla' (got 'xla_scaled' without both "
                         "scales, or with a block_table), no sink_scores and both scales")
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


def step_kernel(name, q1, k_cache, v_cache, mask, k_new, v_new, k_layout, v_layout,
                new_visible, sink_scores, backend, k_scale, v_scale, block_table, scale):
    """:func:`attend_step` through formulation ``name``'s kernel over the old slots
    (:func:`kvjax.models.decode_kernels.partial_attention`) and the new token merged."""
    _no_scales_nor_table(name, k_scale, block_table, tables_ok=True)
    o, m, l = decode_kernels.partial_attention(
        name, q1, k_cache, v_cache, mask[:, 0], k_layout, v_layout,
        backend=backend or backend_lib.current(), block_table=block_table)
    k1 = k_new[:, :, 0] if k_layout == "BKSH" else k_new[..., 0]  # [B, K, H]
    v1 = v_new[:, :, 0] if v_layout == "BKSH" else v_new[..., 0]  # [B, K, Hv]
    # each query's score of its own key, formed in every element of the output so that
    # the merge below is one fusion (kvjax.ops.lane_sum;
    # docs/decisions/0036-row-sums-in-parts.md)
    s_new = ops.lane_sum(q1.astype(jnp.float32) * k1[:, :, None].astype(jnp.float32),
                         o) * scale  # [B, K, G, V]
    out = decode_kernels.merge_new(o, m, l, s_new, v1, new_visible)
    return out[:, None].astype(v_cache.dtype)


def query_scale(c: ModelConfig) -> float:
    """The factor queries are multiplied by so that attention's H^-1/2 becomes
    ``query_pre_attn_scalar``^-1/2 (Gemma 2 / 3); 1.0 without it."""
    if c.query_pre_attn_scalar is None:
        return 1.0
    return (c.head_dim / c.query_pre_attn_scalar) ** 0.5


def _page_size(cached) -> int:
    """P of a paged layer (:class:`kvjax.cache.paged.PagedLayer`), 0 for a dense one."""
    return cached.page_size if isinstance(cached, paged_lib.PagedLayer) else 0


def _in_place(cfg: ModelConfig, cached, f: kernels.Formulation,
              sink_s) -> tuple[dict, jax.Array | None]:
    """({'k': pool, 'v': pool}, block table) when the decode formulation reads this
    layer's paged cache where its pages lie (formulation ``f`` reads in place,
    :attr:`kvjax.kernels.Formulation.in_place`, on a float cache, no sink scores:
    :class:`kvjax.cache.paged.PagedLayer`), else ({}, None): the dense views are read."""
    if (isinstance(cached, paged_lib.PagedLayer) and f.in_place
            and not cfg.kv_quantized and sink_s is None):
        return {n: cached.pools[n] for n in ("k", "v")}, cached.block_table
    return {}, None


SCORING_SCOPE = "kv_page_scoring"
"""The name scope of a read-time page selection's scoring (the bounds read, the page
scores, the top-k): the cost report's scoring row (``scripts/quest_costs.py``)."""


def select_pages(cfg: ModelConfig, q1: jax.Array, cached: paged_lib.PagedLayer,
                 positions: jax.Array) -> jax.Array:
    """The logical pages each KV head of a decode step reads under a read-time page
    selection (Quest, Tang et al. 2024 sec. 3.2, :mod:`kvjax.compression.quest`).

    Every row's pages are ranked by the method's ``page_score`` of the step's queries
    against each page's key bounds; the first ``compression.first_pages`` pages and the
    page of the row's latest cached token (the one being filled) are always read; pages
    holding no token never are (unless a row holds fewer pages than the budget: then the
    surplus picks are empty and masked).

    Args:
      cfg: a config with ``kv_selects_pages``.
      q1: [B, K, G, H] the step's queries.
      cached: one layer of a :class:`kvjax.cache.paged.PagedKVCache` with ``bounds``.
      positions: [B, M·P] int32 positions of the rows' logical slots (-1: empty).
    Returns:
      [B, K, C] int32 logical page indices, ascending, C = kv_budget // P.
    """
    table, p = cached.block_table, cached.page_size
    b, m = table.shape
    phys = jnp.maximum(table, 0)
    method = compression.get(cfg.kv_compression)
    score = method.page_score(q1, cached.bounds["k_min"][phys],
                              cached.bounds["k_max"][phys])  # [B, K, M]
    filled = jnp.any(positions.reshape(b, m, p) >= 0, axis=-1)  # [B, M]
    last = jnp.max(positions, axis=-1) // p  # [B]
    logical = jnp.arange(m, dtype=jnp.int32)[None, :]
    forced = (logical < cfg.compression.first_pages) | (logical == last[:, None])
    score = jnp.where(forced[:, None, :], jnp.inf, score.astype(jnp.float32))
    score = jnp.where(filled[:, None, :], score, -jnp.inf)
    _, idx = jax.lax.top_k(score, cfg.kv_budget // p)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def page_tables(cached: paged_lib.PagedLayer, idx: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The pages each (row, KV head) reads, from the logical ones :func:`select_pages`
    picks.

    Args:
      cached: one paged layer; positions: [B, M·P] int32 positions of its rows' logical
        slots (-1: empty).
      idx: [B, K, C] int32 logical pages (:func:`select_pages`).
    Returns:
      (tables [B, K, C] int32 pool pages, -1 where the row holds none; seen [B, K, C·P]
      bool, the chosen slots that hold a token).
    """
    b, kh, c = idx.shape
    p, m = cached.page_size, cached.block_table.shape[1]
    tables = jnp.take_along_axis(
        jnp.broadcast_to(cached.block_table[:, None, :], (b, kh, m)), idx, axis=2)
    pos = jnp.take_along_axis(jnp.broadcast_to(positions.reshape(b, 1, m, p), (b, kh, m, p)),
                              idx[..., None], axis=2).reshape(b, kh, c * p)
    return tables.astype(jnp.int32), pos >= 0


def attend_pages(cfg: ModelConfig, q: jax.Array, cached: paged_lib.PagedLayer,
                 tables: jax.Array, seen: jax.Array, k_new: jax.Array, v_new: jax.Array,
                 new_visible: jax.Array) -> jax.Array:
    """A decode step over each KV head's own pages (Quest's read), by the XLA
    formulation 'pages_xla' (the reference): the pages of each (row, KV head) are
    gathered from the pools (:func:`kvjax.cache.paged.gather_heads`), then
    :func:`attend_step` 'xla' runs over them with the rows and KV heads folded into one
    batch axis, so each head keeps its own slots and mask.

    Args:
      q: [B, 1, K, G, H] the step's queries.
      cached: one paged layer (its pools; quantized codes are dequantized after the
        gather).
      tables, seen: [B, K, C] pool pages and [B, K, C·P] their visible slots
        (:func:`page_tables`).
      k_new, v_new: the step's own entries as the cache will hold them, dequantized
        ([B, K, 1, H] 'BKSH', or [B, K, H, 1] 'BKHS').
      new_visible: [B] bool, whether each row's query sees its own key.
    Returns:
      [B, 1, K, G, Hv] in v_new's dtype, the attention over C·P slots per KV head and
      the new token; with C = M every page is read and it is the full paged step's
      attention.
    """
    b, _, kh, g, h = q.shape
    cp = seen.shape[-1]
    picked = {n: paged_lib.gather_heads(pool, tables, cache_lib.slot_axis(cfg, n))
              for n, pool in cached.pools.items()}
    k_layout, v_layout = cfg.cache_layout("k"), cfg.cache_layout("v")
    fold = lambda x: x.reshape((b * kh, 1) + x.shape[2:])
    k_sel = cache_lib.read(cfg, picked, "k")
    v_sel = ops.zero_unseen(fold(cache_lib.read(cfg, picked, "v")), seen.reshape(b * kh, cp),
                            cache_lib.slot_axis(cfg, "v"))  # a reused page's stale value
    out = attend_step(jnp.swapaxes(q, 1, 2).reshape(b * kh, 1, 1, g, h),
                      fold(k_sel), v_sel, seen.reshape(b * kh, 1, cp),
                      fold(k_new), fold(v_new), k_layout, v_layout,
                      new_visible=jnp.repeat(new_visible, kh), impl="xla",
                      backend=cfg.backend)  # [B·K, 1, 1, G, Hv]
    return jnp.swapaxes(out.reshape(b, kh, 1, g, -1), 1, 2)


def step_pages_xla(name, cfg, q, cached, tables, seen, k_new, v_new, new_visible):
    """'pages_xla': :func:`attend_pages`."""
    return attend_pages(cfg, q, cached, tables, seen, k_new, v_new, new_visible)


def step_pages_native(name, cfg, q, cached, tables, seen, k_new, v_new, new_visible):
    """'pages_native': :func:`step_kernel` with the native paged kernel over each (row,
    KV head)'s own pages, read where they lie (per-head ``tables``), and the new token
    merged; the values of :func:`attend_pages` up to float32 summation order. Float32
    pools only (the kernel refuses others)."""
    return step_kernel("native", q[:, 0], cached.pools["k"], cached.pools["v"],
                       seen[:, None], k_new, v_new, cfg.cache_layout("k"),
                       cfg.cache_layout("v"), new_visible, None, cfg.backend, None, None,
                       tables, q.shape[-1] ** -0.5)


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
      impl: the decode formulation (:func:`kvjax.kernels.names`).
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


class Call(NamedTuple):
    """One layer's chunk as every attention formulation reads it (:func:`kernels.run`
    hands it to the formulation's function with its name).

    Attributes:
      cfg: the config.
      q: [B, T, K, G, H] the rotated (and scaled) queries.
      q_sink: the queries rotated at cache positions for the sinks (same shape), or None.
      new: the chunk's entries in the cache's representation (:func:`kvjax.cache.encode`).
      positions: [B, T] int32 positions of the chunk (-1: padding).
      cached: this layer's cache before the chunk, or None (a fresh prompt).
      cached_positions: [B, S] int32 slot positions before the chunk, or None.
    """

    cfg: ModelConfig
    q: jax.Array
    q_sink: jax.Array | None
    new: dict
    positions: jax.Array
    cached: dict | None
    cached_positions: jax.Array | None

    def layouts(self) -> tuple[str, str]:
        return self.cfg.cache_layout("k"), self.cfg.cache_layout("v")

    def current(self) -> tuple[jax.Array, jax.Array]:
        """The chunk's keys and values as the cache will hold them (read back)."""
        return cache_lib.read(self.cfg, self.new, "k"), cache_lib.read(self.cfg, self.new, "v")

    def old(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(k_old, v_old, mask_old [B, T, S]): the cache's slots read before the write
        (reading first keeps the in-place update copy-free, and in a ring buffer the
        chunk's writes may evict keys that its earlier queries still see)."""
        c = self.cfg
        return (cache_lib.read(c, self.cached, "k"), cache_lib.read(c, self.cached, "v"),
                cache_lib.attention_mask(self.positions, self.cached_positions, c))

    def chunk_mask(self) -> jax.Array:
        """[B, T, T] bool: the chunk keys each query sees."""
        return cache_lib.attention_mask(self.positions, self.positions, self.cfg)

    def seen(self, v_old: jax.Array, mask_old: jax.Array) -> jax.Array:
        """``v_old`` with the slots no query sees zeroed: they then contribute exactly
        nothing whatever they hold (a NaN or inf in a never-written slot, issue 32; a
        weight of 0 times NaN is NaN). The prompt paths and a step over a dequantized
        cache do it (the select fuses into a pass over the values that exists anyway);
        a float decode step under XLA does not (a copy of the value cache per step,
        docs/results): its programs clear never-written slots once on entry
        (``model.clear_masked_slots``), and formulations that skip masked slots
        (:attr:`kvjax.kernels.Formulation.skips_masked`) need neither. The keys need
        nothing: every path selects the scores."""
        return ops.zero_unseen(v_old, jnp.any(mask_old, axis=1),
                               cache_lib.slot_axis(self.cfg, "v"))

    def run_step(self, name: str) -> jax.Array:
        """Decode-step formulations (op 'decode_attention': 'xla', 'xla_cache_left',
        'native', 'native_blocks', 'pallas'): one position (:func:`attend_step`) or a small chunk over a
        dense cache (:func:`attend_small_chunk`, the T queries as extra group rows, so the
        cache is read once as in a plain step). Returns [B, T, K, G, H]."""
        c, q, positions, cached = self.cfg, self.q, self.positions, self.cached
        k_layout, v_layout = self.layouts()
        k_cur, v_cur = self.current()
        k_old, v_old, mask_old = self.old()
        f = kernels.get("decode_attention", name)
        v_step = self.seen(v_old, mask_old) if c.kv_quantized and not f.skips_masked else v_old
        if q.shape[1] == 1:
            sink_s = sink_scores(c, self.q_sink, k_old, k_layout)
            pools, table = _in_place(c, cached, f, sink_s)
            return attend_step(q, pools.get("k", k_old), pools.get("v", v_step), mask_old,
                               k_cur, v_cur, k_layout, v_layout,
                               new_visible=positions[:, 0] >= 0, sink_scores=sink_s,
                               impl=name, backend=c.backend, block_table=table)
        pools, table = _in_place(c, cached, f, None)
        return _zero_padded(positions, attend_small_chunk(
            q, pools.get("k", k_old), pools.get("v", v_step), jnp.any(mask_old, axis=1),
            k_cur, v_cur, self.chunk_mask(), k_layout, v_layout, impl=name, backend=c.backend,
            block_table=table))


    def run_pages(self, name: str) -> jax.Array:
        """Read-time page selection (lever 5, Quest; 'pages_native', 'pages_xla'): a
        decode step over a paged layer with key bounds reads only the pages
        :func:`select_pages` picks for each KV head (the scoring under the name scope
        :data:`SCORING_SCOPE`, so the cost report attributes it), by the formulation's
        step (:func:`step_pages_native`, :func:`step_pages_xla`). Returns
        [B, 1, K, G, Hv]."""
        c, cached, positions = self.cfg, self.cached, self.cached_positions
        k_cur, v_cur = self.current()
        with jax.named_scope(SCORING_SCOPE):
            idx = select_pages(c, self.q[:, 0], cached, positions)  # [B, K, C]
            tables, seen = page_tables(cached, idx, positions)
        return kernels.run("decode_attention", name, c, self.q, cached, tables, seen, k_cur,
                           v_cur, self.positions[:, 0] >= 0, entry="step")


    def run_scaled(self, name: str) -> jax.Array:
        """'xla_scaled': a decode step over 1-byte codes with per-slot scales, the scales
        applied outside the dots (:func:`attend_step` with k_scale/v_scale) so that XLA:CPU
        fuses the codes' convert into the dots; dequantizing first (:func:`kvjax.cache.read`)
        materialises a float32 copy of the cache (scripts/kv_quant_bench.py)."""
        c, cached = self.cfg, self.cached
        k_cur, v_cur = self.current()
        _, _, mask_old = self.old()
        k_scale, v_scale = cache_lib.row_scales(c, cached)
        return attend_step(self.q, cached["k"], cached["v"], mask_old, k_cur, v_cur,
                           *self.layouts(), new_visible=self.positions[:, 0] >= 0,
                           k_scale=k_scale, v_scale=v_scale).astype(c.jnp_dtype)


    def run_seq(self, name: str) -> jax.Array:
        """'seq': a chunk over a cache split over the mesh's 'seq' axis
        (:func:`attend_cached_seq`)."""
        k_cur, v_cur = self.current()
        k_old, v_old, mask_old = self.old()
        return attend_cached_seq(self.cfg.execution, self.q, k_old,
                                 self.seen(v_old, mask_old), mask_old, k_cur, v_cur,
                                 self.chunk_mask(), *self.layouts(), self.cfg.backend)


    def run_dense(self, name: str) -> jax.Array:
        """'dense': :func:`attend` over (the cache's old slots ++ the chunk), with sinks at
        cache positions and soft-capped scores (Gemma 2) where the config has them."""
        c = self.cfg
        k, v = self.current()
        mask, key_positions = self.chunk_mask(), self.positions
        if self.cached is not None:
            k_old, v_old, mask_old = self.old()
            k = jnp.concatenate([k_old, k], axis=cache_lib.slot_axis(c, "k"))
            v = jnp.concatenate([self.seen(v_old, mask_old), v], axis=cache_lib.slot_axis(c, "v"))
            mask = jnp.concatenate([mask_old, mask], axis=2)
            key_positions = jnp.concatenate([self.cached_positions, self.positions], axis=1)
        return attend(self.q, k, v, mask, *self.layouts(), backend=c.backend,
                      sinks=_sinks(c, self.q_sink, key_positions),
                      logit_softcap=c.attn_logit_softcap)


    def run_tiled(self, name: str) -> jax.Array:
        """'tiled': :func:`kvjax.models.flash.attend_chunk` (online softmax over key
        blocks), over the cache's old slots too when there is one."""
        c = self.cfg
        k_cur, v_cur = self.current()
        k_layout, v_layout = self.layouts()
        kw = dict(_chunk_window(c), block_q=c.prefill_block_q, block_k=c.prefill_block_k,
                  backend=c.backend, k_layout=k_layout, v_layout=v_layout)
        if self.cached is not None:
            k_old, v_old, mask_old = self.old()
            kw.update(k_old=k_old, v_old=self.seen(v_old, mask_old),
                      old_positions=self.cached_positions)
        return _zero_padded(self.positions, flash.attend_chunk(self.q, k_cur, v_cur,
                                                               self.positions, **kw))


    def run_native_prefill(self, name: str) -> jax.Array:
        """'native': the native prompt-attention kernel (:func:`_native_chunk`), which skips
        masked old slots itself."""
        c = self.cfg
        k_cur, v_cur = self.current()
        k_layout, v_layout = self.layouts()
        kw = dict(_chunk_window(c), k_layout=k_layout, v_layout=v_layout)
        if self.cached is not None:
            k_old, v_old, _ = self.old()
            kw.update(k_old=k_old, v_old=v_old, old_positions=self.cached_positions)
        return _native_chunk(c.execution, self.q, k_cur, v_cur, self.positions, **kw)


    def run_cudnn(self, name: str) -> jax.Array:
        """'cudnn': cuDNN's fused attention of a prompt into an empty cache
        (:func:`kvjax.models.flash.attend_chunk_sdpa`)."""
        k_cur, v_cur = self.current()
        k_layout, v_layout = self.layouts()
        return flash.attend_chunk_sdpa(self.q, k_cur, v_cur, self.positions, k_layout=k_layout,
                                       v_layout=v_layout, window_size=self.cfg.window_size)


def _chunk_window(c: ModelConfig) -> dict:
    """The window and sinks of a chunk's mask, the slot policy's
    (:func:`kvjax.cache.attention_mask`): a compressed cache's kv_budget + recent_slots
    with its kept slots pinned as sinks (a verify chunk of speculative decoding), else
    ``window_size`` and ``num_sink_tokens``."""
    if c.kv_evicts:
        return dict(window_size=c.cache_window,
                    num_sink_tokens=cache_lib.policy_for(c).num_sink_tokens)
    return dict(window_size=c.window_size, num_sink_tokens=c.num_sink_tokens)


def site(c: ModelConfig, cached, t: int) -> kernels.Site:
    """The :class:`kvjax.kernels.Site` of one layer's chunk of ``t`` tokens over
    ``cached`` (None: a fresh prompt), from static shapes
    (:func:`kvjax.models.decode_kernels.site`)."""
    if cached is None:
        return decode_kernels.site(c, 1, t, 0, cached=False)
    k_old = cache_lib.read(c, cached, "k")
    b, _, s, _, _ = decode_kernels.cache_dims(k_old, k_old, c.cache_layout("k"),
                                              c.cache_layout("k"))
    return decode_kernels.site(c, b, t, s, True, _page_size(cached))


class Attention(nn.Module):
    """Grouped-query attention layer with a functional KV cache.

    Parameters: q_proj [D, N, H], k_proj [D, K, H], v_proj [D, K, H], o_proj [N, H, D]
    ('kernel'), and with ``cfg.qkv_bias`` (Qwen2) a 'bias' of q_proj [N, H], k_proj and
    v_proj [K, H], added before the rotary embedding; with ``cfg.qk_norm`` (Qwen3)
    q_norm and k_norm 'scale' [H], an RMSNorm of each head (:func:`norm_heads`) before
    the rotary embedding. Parameters prepared for decoding
    (:func:`kvjax.models.model.fuse_projections`) hold instead one qkv_proj [D, N + 2K, H]
    (q_proj's heads, then k_proj's, then v_proj's; its bias [N + 2K, H]): one weight
    product for the three, the same function.
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, cached: dict | None,
                 cached_positions: jax.Array | None):
        """Attention for one layer; the caller writes the returned chunk into the cache.

        Args:
          x: [B, T, D] inputs (or their deferred norm,
            :class:`kvjax.models.weight_matmul.Normed`).
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
        if self.has_variable("params", "qkv_proj"):  # fused for decoding: one product,
            # into which a deferred norm folds (kvjax.models.weight_matmul.Normed)
            qkv = Einsum((c.d_model, n + 2 * k, h), "BTD,DNH->BTNH", dt, name="qkv_proj",
                         **proj)(x)
            q, kk, vv = qkv[:, :, :n], qkv[:, :, n:n + k], qkv[:, :, n + k:]
        else:
            x = applied(x)
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

        new = cache_lib.encode(c, {"k": cache_lib.to_layout(kk, c, "k"),
                                   "v": cache_lib.to_layout(vv, c, "v")})
        call = Call(c, q, q_sink, new, positions, cached, cached_positions)
        where = site(c, cached, t)
        out = kernels.run(where.op, c.formulation(where), call)  # Call's method
        out = Einsum((n, h, c.d_model), "BTF,FD->BTD", dt, merge_in=2, name="o_proj",
                     impl=c.weight_matmul, plan=c.plan)(
            out.astype(dt).reshape(b, t, n, h))
        return out, new
