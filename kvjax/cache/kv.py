"""Functional KV caches: plain pytrees passed into the model and returned updated.

The contract (docs/DESIGN.md, "The cache contract"):

* A cache is a set of **named tensors** whose names, per-layer shapes, dtypes and layouts
  come from the config alone (:func:`tensor_specs`): MHA/GQA/MQA (optionally windowed)
  cache per-head keys and values, head-major, ``'k'``/``'v'`` each ``[L, B, K, S, H]``
  ('BKSH') or ``[L, B, K, H, S]`` ('BKHS', slot axis last), by ``cfg.cache_layout``; MLA
  caches one latent and one shared rotary key per token, ``'c_kv' [L, B, S, C]`` and
  ``'k_rope' [L, B, S, R]``. A later representation (a quantized cache with scale
  tensors) adds names here without touching the model.
* Values enter the cache only through :func:`encode` (float -> the cache's
  representation; a float can never be truncated into an integer cache) and leave it
  through :func:`read`.
* **Per-row bookkeeping**: ``positions [B, S]`` (the absolute position held by each slot
  of each row, -1 when empty) and ``length [B]`` (tokens written per row), so every row
  may have its own length. Masks come from ``positions`` alone, so a ring buffer that
  wraps can never expose a stale or future key.
* Which slot holds which position is the **slot policy's** business
  (:mod:`kvjax.cache.policy`: dense, or a ring of W slots with sinks).
* **Per-layer windows** (``cfg.layer_windows``, Gemma 2 / 3, lever 3 per layer): a local
  layer holds its own ring of W_i slots, a global layer the full context, so the
  per-layer tensors differ in S (the unrolled stack) and the cache's bytes are the sum
  over layers. ``positions`` are then the full-context slots' (the model's policy is
  dense); a ring layer's slot positions follow from ``length`` alone
  (:func:`layer_positions`), since each row writes positions 0, 1, ... in order.
* **Per-layer compression budgets** (``cfg.layer_budgets``, PyramidKV, lever 5 per
  layer): layer i holds its own b_i kept slots and a ring of R = recent_slots after them
  (b_i + R slots), so the bytes are the sum over layers. ``positions`` are those of the
  smallest-budget layer; every other layer's follow from them and ``length``
  (:func:`layer_positions`).
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvjax import ops
from kvjax.cache import quant
from kvjax.cache.policy import (CacheOverflowError, DenseSlots, RingSlots, policy_for,
                                write_rows, write_shared)
from kvjax.config import ModelConfig
from kvjax.plan import SEQ

__all__ = ["KVCache", "TensorSpec", "tensor_specs", "slot_axis", "to_layout", "layouts",
           "check_layouts", "layer_shapes", "num_slots", "layer_num_slots",
           "layer_positions", "ring_positions", "init_cache", "cache_spec",
           "cache_bytes", "total_bytes", "encode", "read", "row_scales", "channel_axis",
           "write", "write_seq_sharded", "chunk_slots", "clear_unseen", "window_view",
           "advance", "ring_slots", "next_positions", "slot_of", "attention_mask",
           "policy_for", "DenseSlots", "RingSlots", "CacheOverflowError"]


@flax.struct.dataclass
class KVCache:
    """Functional KV cache: per-layer named tensors plus per-row slot bookkeeping.

    Attributes:
      tensors: name -> cached tensor (:func:`tensor_specs`), stacked with a leading L
        axis when ``cfg.scan_layers``; otherwise a tuple of L per-layer arrays, so no
        layer is ever sliced out of a stacked buffer.
      positions: [B, S] int32, absolute position held in each slot of each row, -1
        where empty.
      length: [B] int32, tokens written so far per row (the row's next position).
      layouts: static (not a pytree leaf): ((name, 'BKSH' | 'BKHS'), ...) as built by
        :func:`init_cache`, so ``model.forward`` can refuse a cache built for another
        layout (when S == H the shapes alone cannot tell); None = not recorded.
      ragged: static. False (lockstep): every row holds the same positions, and a chunk
        is written to all rows with one in-place update at row 0's positions. True: rows
        may have their own lengths; each row's chunk is scattered to its own slots.
        ``model.forward`` checks on the host that a lockstep cache is fed equal rows.
      schedule: None, or with ``model.compression.schedule='every_n'`` the scoring
        state a decode-time compression reads (:func:`kvjax.cache.compress.init_schedule`:
        the buffered decode queries, each kept slot's position per KV head, H2O's
        accumulated attention); never part of :func:`cache_bytes`.
    """

    tensors: dict
    positions: jax.Array
    length: jax.Array
    layouts: tuple | None = flax.struct.field(pytree_node=False, default=None)
    ragged: bool = flax.struct.field(pytree_node=False, default=False)
    schedule: dict | None = None

    @property
    def bounds(self) -> dict:
        """{}: dense rows keep no page key bounds
        (:attr:`kvjax.cache.paged.PagedKVCache.bounds`), so the model reads one
        attribute of either cache."""
        return {}

    @property
    def num_slots(self) -> int:
        """S, slots per row and layer."""
        return self.positions.shape[-1]

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    def layer(self, i) -> dict:
        """name -> this layer's tensor ([B, K, S, H] ...); ``i`` may be traced if stacked."""
        return {n: t[i] for n, t in self.tensors.items()}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One named cache tensor of one layer: shape (with B and S), dtype and slot axis."""

    name: str
    shape: tuple
    dtype: jnp.dtype
    slot_axis: int  # -2 or -1 in the per-layer shape

    @property
    def nbytes(self) -> int:
        size = 1
        for d in self.shape:
            size *= d
        return size * jnp.dtype(self.dtype).itemsize


def slot_axis(cfg: ModelConfig, name: str) -> int:
    """-1 if cached tensor ``name`` keeps its slot axis last ('BKHS'), else -2. A scale
    tensor ('k_scale') has the slot axis of the tensor it scales."""
    name = quant.base_name(name)
    if not cfg.is_mla and cfg.cache_layout(name) == "BKHS":
        return -1
    return -2


def tensor_specs(cfg: ModelConfig, batch_size: int, num_slots_: int) -> dict:
    """name -> :class:`TensorSpec` of one layer's cached tensors, from the config alone.

    MHA/GQA/MQA: 'k' and 'v', [B, K, S, H] ('BKSH') or [B, K, H, S] ('BKHS'); MLA:
    'c_kv' [B, S, C] and 'k_rope' [B, S, R] (DeepSeek-V2, Liu et al. 2024, sec. 2.1: no
    head axis). dtype: ``cfg.cache_dtype`` (``model.kv_dtype``, default the model dtype).
    A quantized kv_dtype (:mod:`kvjax.cache.quant`) stores codes under these names (int4:
    the channel axis halved, uint8) plus float32 'name_scale' tensors with the channel
    axis replaced by the scales per row (1; int4: width / group), same slot axis.
    """
    if cfg.kv_quantized:
        return _quantized_specs(cfg, tensor_specs(cfg.replace(kv_dtype="float32"),
                                                  batch_size, num_slots_))
    dt = cfg.cache_dtype
    if cfg.is_mla:
        return {"c_kv": TensorSpec("c_kv", (batch_size, num_slots_, cfg.kv_lora_rank), dt, -2),
                "k_rope": TensorSpec("k_rope", (batch_size, num_slots_, cfg.qk_rope_head_dim),
                                     dt, -2)}
    specs = {}
    for name in ("k", "v"):
        shape = [batch_size, cfg.num_kv_heads, num_slots_, cfg.head_dim]
        axis = slot_axis(cfg, name)
        if axis == -1:
            shape[2], shape[3] = shape[3], shape[2]
        specs[name] = TensorSpec(name, tuple(shape), dt, axis)
    return specs


def channel_axis(cfg: ModelConfig, name: str) -> int:
    """The axis of cached tensor ``name`` holding one token's values (H, C or R): -1,
    or -2 when the slot axis is last ('BKHS'). Quantized formats group along it."""
    return -2 if slot_axis(cfg, name) == -1 else -1


def _quantized_specs(cfg: ModelConfig, specs: dict) -> dict:
    """Float specs -> codes and float32 scales (:mod:`kvjax.cache.quant`): the channel
    axis X becomes ``code_width(X)`` for the codes, ``scale_width(X)`` for 'name_scale'."""
    fmt = quant.format_for(cfg)
    out = {}
    for name, spec in specs.items():
        axis = channel_axis(cfg, name)
        shape, width = list(spec.shape), spec.shape[axis]
        shape[axis] = fmt.code_width(width)
        out[name] = TensorSpec(name, tuple(shape), fmt.storage, spec.slot_axis)
        shape[axis] = fmt.scale_width(width)
        sn = quant.scale_name(name)
        out[sn] = TensorSpec(sn, tuple(shape), quant.SCALE_DTYPE, spec.slot_axis)
    return out


def layer_shapes(cfg: ModelConfig, batch_size: int, num_slots_: int) -> dict:
    """name -> per-layer cached tensor shape (slot axis at :func:`slot_axis`)."""
    return {n: s.shape for n, s in tensor_specs(cfg, batch_size, num_slots_).items()}


def to_layout(x: jax.Array, cfg: ModelConfig, name: str) -> jax.Array:
    """[B, K, T, H] keys/values -> the layout cache tensor ``name`` is stored in."""
    return jnp.swapaxes(x, -1, -2) if slot_axis(cfg, name) == -1 else x


def layouts(cfg: ModelConfig) -> tuple:
    """((name, 'BKSH' | 'BKHS'), ...) of the per-head cached tensors; () for MLA."""
    return () if cfg.is_mla else tuple((n, cfg.cache_layout(n)) for n in ("k", "v"))


def check_layouts(cache: KVCache, cfg: ModelConfig) -> None:
    """Raises ValueError if ``cache`` records layouts other than ``cfg``'s."""
    if cache.layouts is not None and cache.layouts != layouts(cfg):
        raise ValueError(
            f"cache layouts={dict(cache.layouts)} do not match the model config's "
            f"{dict(layouts(cfg))} (key_layout={cfg.key_layout!r}, "
            f"value_layout={cfg.value_layout!r}); allowed: a cache from "
            "init_cache(cfg, ...) with the same config")


def num_slots(cfg: ModelConfig, max_seq_len: int) -> int:
    """S: slots per layer (the slot policy's: W for a window, else max_seq_len)."""
    return policy_for(cfg).num_slots(max_seq_len)


def layer_num_slots(cfg: ModelConfig, max_seq_len: int, spare_slots: int = 0) -> list:
    """[S_i] slots of each layer: :func:`num_slots` of ``cfg.layer_config(i)`` (a local
    layer's ring, plus ``spare_slots``; a global layer's max_seq_len; a compressed
    layer's budget + ring); all equal without ``layer_windows`` or per-layer budgets."""
    return [num_slots(ci, max_seq_len) + (spare_slots if ci.window_size else 0)
            for ci in map(cfg.layer_config, range(cfg.num_layers))]


def layer_positions(cfg: ModelConfig, cache, i: int) -> jax.Array:
    """[B, S_i] int32 absolute position held by each slot of layer ``i`` (-1: empty):
    ``cache.positions``, or for a local layer of ``cfg.layer_windows`` (a ring of S_i
    slots, no sinks; a dense or a paged cache's) :func:`ring_positions` of
    ``cache.length`` (rows write positions 0, 1, ... in order); or for a layer of
    per-layer compression budgets :func:`budget_positions`."""
    if cfg.layer_budgets is not None:
        return budget_positions(cfg, cache, i)
    ci = cfg.layer_config(i)
    if cfg.layer_windows is None or ci.window_size is None:
        return cache.positions
    name, t = next(iter(cache.tensors.items()))
    return ring_positions(cache.length, t[i].shape[slot_axis(ci, name)])


def ring_positions(length: jax.Array, num_slots_: int) -> jax.Array:
    """[B, S] int32 positions a ring of S = ``num_slots_`` slots holds after each row
    wrote positions 0 .. length - 1 in order (slot j: the newest p < length with
    p mod S = j, -1 where none), from ``length`` [B] alone."""
    s = int(num_slots_)
    last = length[:, None] - 1  # [B, 1]
    p = last - jnp.mod(last - jnp.arange(s, dtype=jnp.int32)[None, :], s)
    return jnp.where(p >= 0, p, -1).astype(jnp.int32)


def budget_positions(cfg: ModelConfig, cache: KVCache, i: int) -> jax.Array:
    """[B, b_i + R] int32 positions held by layer ``i`` of a compressed cache with
    per-layer budgets (``cfg.layer_budgets`` b_0..b_{L-1}, R = recent_slots), from
    ``cache.positions`` (the smallest budget b_r's layer, :func:`policy_for`) and
    ``cache.length``.

    Every layer is a ring of b_i pinned slots and R ring slots
    (:class:`kvjax.cache.policy.RingSlots`); a row compressed at T0 tokens then wrote
    T0, T0 + 1, ... in order. Pinned slot j < b_i holds j (a kept token's marker,
    :mod:`kvjax.cache.compress`, or position j itself) once j < length. Layer i's ring
    holds the positions p in [max(b_i, T0), length) not yet overwritten: ring slot
    b_i + m the newest such p with (p - b_i) mod R = m. T0 is not stored, but with
    E = max(b_r, T0) the oldest position the smallest layer's ring holds (length when
    it holds none; the row's last R positions when it is full) max(b_i, T0) = max(b_i, E),
    since b_i >= b_r; and a full ring of that layer means every layer's ring is full.
    """
    budgets = cfg.layer_budgets
    b, low, r = budgets[i], min(budgets), cfg.compression.recent_slots
    if b == low:
        return cache.positions
    length = cache.length[:, None]  # [B, 1]
    ring = cache.positions[:, low:]  # [B, R] the smallest layer's ring
    oldest = jnp.min(jnp.where(ring >= 0, ring, length), axis=1, keepdims=True)
    start = jnp.maximum(oldest, b)
    j = jnp.arange(b + r, dtype=jnp.int32)[None, :]
    last = length - 1
    p = last - jnp.mod(last - j, r)  # the newest p <= last with p = j (mod R)
    held = jnp.where(j < b, jnp.where(j < length, j, -1), jnp.where(p >= start, p, -1))
    return held.astype(jnp.int32)


def init_cache(cfg: ModelConfig, batch_size: int, max_seq_len: int,
               ragged: bool = False, spare_slots: int = 0) -> KVCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens.

    Tensors are zero-filled per :func:`tensor_specs`, positions [B, S] -1 and length [B]
    0. S = window_size when set, else max_seq_len, plus ``spare_slots``; with
    ``cfg.layer_windows`` each layer has its own S_i (:func:`layer_num_slots`: a local
    layer's ring W_i + ``spare_slots``, a global layer max_seq_len) and ``positions``
    the full context's max_seq_len slots; with per-layer compression budgets
    (``cfg.layer_budgets``) each layer b_i + recent_slots and ``positions`` the smallest
    layer's (:func:`budget_positions`). ``ragged``: rows
    may take different lengths (:class:`KVCache`). ``spare_slots``: slots beyond a
    ring's W; a speculative ring keeps k + 1 of them so that writing a chunk of k + 1
    tokens evicts no key the window still shows (``kvjax.inference.speculative``); the
    mask is the window's either way.

    Raises:
      ValueError: non-positive batch_size or max_seq_len, negative spare_slots; a
        read-time page selection (``kv_compression='quest'``), which needs pages
        (:func:`kvjax.cache.paged.init_paged_cache`).
    """
    if cfg.kv_selects_pages:
        raise ValueError(f"a dense cache with model.kv_compression={cfg.kv_compression!r}; "
                         "allowed: a paged cache (page_size >= 1: it selects the pages to "
                         "read), or another method")
    if batch_size <= 0 or max_seq_len <= 0:
        raise ValueError(
            f"batch_size={batch_size} and max_seq_len={max_seq_len} must be positive")
    if spare_slots < 0:
        raise ValueError(f"spare_slots={spare_slots}; allowed: an integer >= 0")
    quant.check_supported(cfg)
    s = num_slots(cfg, max_seq_len) + spare_slots
    tensors = {}
    if cfg.per_layer_slots:  # unrolled: each layer its own slots
        if cfg.layer_windows is not None:
            s = max_seq_len  # positions: the full context's (a global layer's slots)
        elif spare_slots:
            raise ValueError(f"spare_slots={spare_slots} with per-layer compression "
                             "budgets; allowed: 0 (a compressed cache keeps no spare slots)")
        per_layer = [tensor_specs(cfg, batch_size, si)
                     for si in layer_num_slots(cfg, max_seq_len, spare_slots)]
        tensors = {name: tuple(jnp.zeros(sp[name].shape, sp[name].dtype) for sp in per_layer)
                   for name in per_layer[0]}
    for name, spec in (tensor_specs(cfg, batch_size, s).items()
                       if not cfg.per_layer_slots else ()):
        if cfg.scan_layers:
            tensors[name] = jnp.zeros((cfg.num_layers,) + spec.shape, spec.dtype)
        else:
            tensors[name] = tuple(jnp.zeros(spec.shape, spec.dtype)
                                  for _ in range(cfg.num_layers))
    return KVCache(tensors=tensors, positions=jnp.full((batch_size, s), -1, jnp.int32),
                   length=jnp.zeros((batch_size,), jnp.int32), layouts=layouts(cfg),
                   ragged=ragged)


def clear_unseen(cfg: ModelConfig, cache: KVCache) -> KVCache:
    """``cache`` with every float tensor zero at the slots no row has written (position
    -1): one elementwise pass over the cache, in place when the cache is donated.

    Attention gives a masked slot a softmax weight of exactly 0, but 0 times a NaN or
    inf value is NaN (issue 32: a cache built from, or donated by, a buffer that held
    one). The programs that run decode steps over a caller's cache apply this once on
    entry (:func:`kvjax.models.model.clear_masked_slots`), so that a decode step need
    not select its values every step; every slot written afterwards holds a value the
    model computed. Integer codes (int8, int4) are always finite and kept.

    Args:
      cfg: the config the cache was built for (its slot axes).
      cache: a :class:`KVCache` (stacked or per-layer tensors).
    Returns:
      The same structure, dtypes and shapes.
    """
    seen = cache.positions >= 0  # [B, S]

    def clear(x, name, seen=seen):  # one layer's tensor, batch axis 0 (ops.zero_unseen)
        return ops.zero_unseen(x, seen, slot_axis(cfg, name))

    if cfg.per_layer_slots:  # each layer's own slots
        return cache.replace(tensors={
            n: tuple(clear(x, n, layer_positions(cfg, cache, i) >= 0)
                     for i, x in enumerate(t)) for n, t in cache.tensors.items()})
    tensors = {n: tuple(clear(x, n) for x in t) if isinstance(t, tuple)
               else jax.vmap(lambda x, n=n: clear(x, n))(t)  # stacked: [L, B, ...]
               for n, t in cache.tensors.items()}
    return cache.replace(tensors=tensors)


def window_view(cache: KVCache, cfg: ModelConfig, view_cfg: ModelConfig,
                num_slots_: int) -> KVCache:
    """A ring cache for ``view_cfg`` (a window W with s sinks, the first L' <= L layers of
    ``cfg``, the same element types) holding what ``cache`` holds of each row's sinks and
    last ``num_slots_ - s`` positions: a copy of the keys and values the full model
    computed, which a window draft then attends to and writes after (MagicDec, Chen et
    al. 2024, and TriForce, Sun et al. 2024: the draft's StreamingLLM window over the
    target's own KV). Reads B x num_slots_ slots per layer, never the rest of the cache:
    a slice of each row rotated into ring order
    (docs/decisions/0022-window-view-slice-and-rotate.md).

    Args:
      cache: a ragged or lockstep :class:`KVCache` of ``cfg`` (dense rows or a ring).
      cfg: its config. view_cfg: the view's (``window_size`` > 0; its layouts may differ).
      num_slots_: S_v, the view's slots (W plus the spare slots its writes need).
    Returns:
      A ragged :class:`KVCache` of S_v slots per row and ``view_cfg.num_layers`` layers;
      ``length`` is ``cache.length``; a slot whose position ``cache`` does not hold (not
      written yet, or evicted from a ring) has position -1 and never shows.
    Raises:
      ValueError: ``view_cfg`` without a window, with more layers than ``cfg`` or with
        another kv_dtype; num_slots_ not above its sinks.
    """
    pol = policy_for(view_cfg)
    if pol.kind != "ring" or view_cfg.num_layers > cfg.num_layers \
            or view_cfg.kv_dtype != cfg.kv_dtype or view_cfg.is_mla != cfg.is_mla:
        raise ValueError(
            f"window_view of a cache for window_size={view_cfg.window_size}, num_layers="
            f"{view_cfg.num_layers}, kv_dtype={view_cfg.kv_dtype!r}; allowed: a window > 0 "
            f"over at most the cache's {cfg.num_layers} layers, its kv_dtype="
            f"{cfg.kv_dtype!r} and attention kind")
    sinks = pol.num_sink_tokens
    if num_slots_ <= sinks:
        raise ValueError(f"num_slots_={num_slots_}; allowed: more than the {sinks} sinks")
    ring = num_slots_ - sinks
    last = cache.length[:, None] - 1  # [B, 1] the newest position written
    j = jnp.arange(num_slots_, dtype=jnp.int32)[None, :]
    # the newest position p <= last with slot_of(p) == j (p = j for a sink slot)
    p = jnp.where(j < sinks, j, last - jnp.mod(last - j, ring))
    p = jnp.where((p >= 0) & (p <= last) & ((j < sinks) | (p >= sinks)), p, -1)
    src = jnp.clip(policy_for(cfg).slot_of(jnp.maximum(p, 0), cache.num_slots),
                   0, cache.num_slots - 1)
    held = jnp.take_along_axis(cache.positions, src, axis=1)
    p = jnp.where((p >= 0) & (held == p), p, -1)
    n = view_cfg.num_layers
    # Dense rows hold position p at slot p, so a row's last `ring` positions are one
    # contiguous slab: slice it (a dynamic slice per row) and rotate it into ring order
    # (slot s + m holds the slab's position congruent to s + m mod ring), instead of a
    # gather of single slots. A ring source (or one too short) takes the gather.
    slab = policy_for(cfg).kind != "ring" and cache.num_slots >= ring
    start = jnp.clip(cache.length - ring, 0, cache.num_slots - ring)  # [B]
    shift = jnp.mod(start - sinks, ring)

    def rows(x, ax, batch_axis):  # [L?, B, ...] -> the sinks, then the rotated slab
        def one(xr, st, sh):
            lin = jax.lax.dynamic_slice_in_dim(xr, st, ring, axis=ax)
            return jnp.roll(lin, sh, axis=ax)
        out = jax.vmap(one, in_axes=(batch_axis, 0, 0), out_axes=batch_axis)(
            x, start, shift)
        return jnp.concatenate([jax.lax.slice_in_dim(x, 0, sinks, axis=ax), out], axis=ax)

    def gather(x, name, stacked):  # x [L?, B, ...] with the slot axis of cfg's layout
        ax = slot_axis(cfg, name)
        if slab:
            out = rows(x, ax, int(stacked))
        else:
            shape = [1] * x.ndim
            shape[int(stacked)] = src.shape[0]
            shape[ax] = num_slots_
            out = jnp.take_along_axis(x, src.reshape(shape), axis=ax)
        return out if slot_axis(view_cfg, name) == ax else jnp.swapaxes(out, -1, -2)

    tensors = {name: tuple(gather(x, name, False) for x in t[:n]) if isinstance(t, tuple)
               else gather(t[:n], name, True) for name, t in cache.tensors.items()}
    return KVCache(tensors=tensors, positions=p, length=cache.length,
                   layouts=layouts(view_cfg), ragged=True)


def cache_spec(cfg: ModelConfig, batch_size: int, max_seq_len: int) -> KVCache:
    """The cache as ``jax.ShapeDtypeStruct``s: compile against it without allocating."""
    return jax.eval_shape(lambda: init_cache(cfg, batch_size, max_seq_len))


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the cached per-token tensors, summed over the pytree (the blog's KV bytes).

    The bookkeeping arrays (``positions``, ``length``: 4·B·(S + 1) bytes) are excluded;
    use :func:`total_bytes` for everything.
    """
    return total_bytes(cache.tensors)


def total_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree (arrays or ShapeDtypeStructs)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def encode(cfg: ModelConfig, new: dict) -> dict:
    """The cache's representation of a chunk's new entries (the one way into a cache).

    Args:
      new: name -> float tensor laid out like one layer's cached tensor with T in place
        of S (e.g. 'k': [B, K, T, H] for 'BKSH').
    Returns:
      name -> tensor in ``cfg.cache_dtype``; a quantized kv_dtype gives codes under each
      name plus float32 'name_scale' tensors (:func:`kvjax.cache.quant.quantize`, along
      :func:`channel_axis`). Attention must use :func:`read` of this result for the
      chunk's own keys, so the chunk sees what later steps will read.
    Raises:
      TypeError: the cache dtype is not a float type and no quantized format converts
        into it (a plain cast would truncate).
      ValueError: an fp8 kv_dtype the backend cannot convert.
    """
    fmt = quant.format_for(cfg) if getattr(cfg, "kv_quantized", False) else None
    if fmt is not None:
        quant.check_supported(cfg)
        out = {}
        for n, x in new.items():
            out[n], out[quant.scale_name(n)] = quant.quantize(x, fmt, channel_axis(cfg, n))
        return out
    dt = jnp.dtype(cfg.cache_dtype)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"cache dtype {dt.name} has no float representation here; allowed: a floating "
            "kv_dtype (casting floats into an integer cache would truncate them)")
    return {n: x.astype(dt) for n, x in new.items()}


def read(cfg: ModelConfig, tensors: dict, name: str) -> jax.Array:
    """Tensor ``name`` of one layer's cache (or of :func:`encode`'s output) as attention
    consumes it: for float caches the stored tensor itself; for a quantized one the codes
    times their scales (:func:`kvjax.cache.quant.dequantize`) in the model dtype, in the
    stored layout."""
    if not cfg.kv_quantized:
        return tensors[name]
    return quant.dequantize(tensors[name], tensors[quant.scale_name(name)],
                            quant.format_for(cfg), channel_axis(cfg, name), cfg.jnp_dtype)


def row_scales(cfg: ModelConfig, tensors: dict):
    """(k_scale, v_scale) as [B, K, S] float32 when one layer's cache (MHA/GQA/MQA)
    stores 1-byte codes with one scale per token per KV head (int8, fp8), so attention
    can apply the scales outside its dots (:func:`kvjax.models.attention.attend_step`);
    else None (float caches, int4's groups, MLA)."""
    fmt = quant.format_for(cfg) if cfg.kv_quantized else None
    if fmt is None or fmt.bits != 8 or cfg.is_mla:
        return None
    out = []
    for n in ("k", "v"):
        sc = tensors[quant.scale_name(n)]  # width 1 along the channel axis
        out.append(jnp.squeeze(sc, axis=channel_axis(cfg, n)))
    return tuple(out)


def chunk_slots(cache: KVCache, chunk_positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[B, T] int32 slot of each chunk token per row (``num_slots``: dropped)."""
    return policy_for(cfg).write_slots(chunk_positions, cache.num_slots)


def write(buf: jax.Array, new: jax.Array, chunk_positions: jax.Array, cfg: ModelConfig,
          layer=None, axis: int = -2, ragged: bool = False) -> jax.Array:
    """Writes a chunk of T tokens per row into a cached tensor, in place.

    Args:
      buf: [B, ..., S, X] (``axis`` -2) or [B, ..., X, S] (``axis`` -1): one layer's
        tensor, or the same with a leading L axis when ``layer`` is given.
      new: the chunk, laid out like one layer of ``buf`` with T in place of S, already in
        the cache's representation (:func:`encode`).
      chunk_positions: [B, T] (or [T], the same for every row) int32 consecutive absolute
        positions of each row's chunk.
      cfg: its slot policy maps positions to slots and writes.
      layer: [] int32 layer index into a stacked ``buf`` (None: ``buf`` is one layer).
      axis: the slot axis, -2 or -1 (:func:`slot_axis`).
      ragged: rows may sit at different positions (:attr:`KVCache.ragged`); False: every
        row writes at row 0's positions (one in-place update for the batch).
    Returns:
      The updated buffer (:meth:`kvjax.cache.policy.DenseSlots.write`,
      :meth:`kvjax.cache.policy.RingSlots.write`): a ring drops tokens a later token of
      the same chunk overwrites; a dense cache writes in place and never clamps silently,
      because a row that would write past its end has its logits poisoned with NaN (and
      the host-side entry points raise before running). Under a mesh whose 'seq' axis
      splits the slots, each device writes the slots it owns
      (:func:`write_seq_sharded`); the cache is never gathered.
    Raises:
      ValueError: ``axis`` not -2 or -1.
    """
    if axis not in (-2, -1):
        raise ValueError(f"axis={axis}; allowed: -2 or -1")
    if chunk_positions.ndim == 1:
        chunk_positions = jnp.broadcast_to(chunk_positions,
                                           (new.shape[0],) + chunk_positions.shape)
    return _write(cfg, buf, new, chunk_positions, axis, layer, ragged)


def _write(cfg, buf, new, chunk_positions, axis, layer=None, ragged=False):
    """``policy.write``, or where the plan's 'seq' axis splits the slot axis, the write
    by the devices owning the slots (:func:`write_seq_sharded`)."""
    policy, plan = policy_for(cfg), cfg.execution
    if plan.seq_shards > 1:
        return write_seq_sharded(policy, buf, new, chunk_positions, axis, layer, ragged,
                                 plan.seq_shards, plan.seq_manual)
    return policy.write(buf, new, chunk_positions, axis, layer, ragged)


def write_seq_sharded(policy, buf: jax.Array, new: jax.Array, chunk_positions: jax.Array,
                      axis: int, layer, ragged: bool, num_shards: int,
                      manual: bool) -> jax.Array:
    """A chunk written into a cache tensor whose slot axis is split over the 'seq' mesh
    axis (:data:`kvjax.plan.SEQ`), by the devices that own the slots: no cache shard
    moves.

    Each 'seq' shard holds slots [i·S/n, (i+1)·S/n) of the S slots. Inside a
    ``jax.shard_map`` manual over 'seq' (so 'data' and 'model' stay automatic), device i
    takes the chunk's global slots from ``policy.write_slots`` (S where the write drops a
    token), keeps those in its own range as local indices and scatters them into its
    shard with ``mode='drop'``; the others go to the out-of-range index S/n and are
    dropped. A global write (``dynamic_update_slice`` or scatter on the whole
    [.., S, ..] array) made GSPMD all-gather every cache tensor of a seq-sharded prefill
    (docs/decisions/0025-seq-sharded-cache.md).

    Args:
      policy: the slot policy (:func:`kvjax.cache.policy.policy_for`).
      buf, new, chunk_positions, axis, layer, ragged: as :func:`write` (``new``
        replicated over 'seq'); any dtype (codes, float32 scales, int32 positions).
      num_shards: the size n of the 'seq' axis.
      manual: 'seq' is already manual (a per-device trace): ``buf`` is this device's
        shard.
    Returns:
      ``buf`` updated, with its sharding; equal to ``policy.write`` on one device.
    """
    slot_axis = buf.ndim + axis
    num_slots = buf.shape[slot_axis] * (num_shards if manual else 1)  # global S

    def body(buf, new, chunk_positions, *layer):
        layer = layer[0] if layer else None
        local_s = buf.shape[slot_axis]
        first = jax.lax.axis_index(SEQ) * local_s
        slots = policy.write_slots(chunk_positions, num_slots) - first
        slots = jnp.where((slots >= 0) & (slots < local_s), slots, local_s)
        if ragged:
            return write_rows(buf, new, slots, axis, layer, "drop")
        return write_shared(buf, new, slots[0], axis, layer)

    args = (buf, new, chunk_positions) + (() if layer is None else (layer,))
    if manual:
        return body(*args)
    axes = [None] * buf.ndim
    axes[slot_axis] = SEQ
    fn = jax.shard_map(body, in_specs=(P(*axes),) + (P(),) * (len(args) - 1),
                       out_specs=P(*axes), axis_names=frozenset({SEQ}))
    return fn(*args)


def advance(cache: KVCache, chunk_positions: jax.Array, cfg: ModelConfig,
            num_new: jax.Array | int | None = None) -> KVCache:
    """The bookkeeping after writing a chunk: slot positions [B, S] and lengths [B].

    ``chunk_positions``: [B, T] positions written. ``num_new``: tokens per row that count
    toward ``length`` (default T).
    """
    positions = next_positions(cache, chunk_positions, cfg)
    t = chunk_positions.shape[-1] if num_new is None else num_new
    return cache.replace(positions=positions, length=cache.length + t)


def next_positions(cache: KVCache, chunk_positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[B, S] int32 slot positions after writing a chunk at ``chunk_positions`` [B, T]
    (or [T] for every row)."""
    b = cache.positions.shape[0]
    if chunk_positions.ndim == 1:
        chunk_positions = jnp.broadcast_to(chunk_positions, (b,) + chunk_positions.shape)
    return _write(cfg, cache.positions, chunk_positions, chunk_positions, -1,
                  ragged=cache.ragged)


def ring_slots(chunk_positions: jax.Array, cfg: ModelConfig, num_slots_: int) -> jax.Array:
    """[..., T] int32 slot of each chunk token, ``num_slots_`` where the write drops it
    (:meth:`kvjax.cache.policy.RingSlots.write_slots`)."""
    return policy_for(cfg).write_slots(chunk_positions, num_slots_)


def slot_of(position: jax.Array, cfg: ModelConfig, num_slots_: int) -> jax.Array:
    """Slot index for absolute ``position`` (int32 array of any shape).

    Dense: p. Windowed with W slots and s sinks: p if p < s else s + (p - s) mod (W - s).
    """
    return policy_for(cfg).slot_of(position, num_slots_)


def attention_mask(q_positions: jax.Array, k_positions: jax.Array,
                   cfg: ModelConfig) -> jax.Array:
    """Which keys each query may attend to, from absolute positions only.

    Args:
      q_positions: [B, T] int32 query positions.
      k_positions: [S] or [B, S] int32 key positions (-1: empty slot).
      cfg: its slot policy (window W and s sinks) decides.
    Returns:
      [B, T, S] bool: key is filled, causal (k <= q) and, with a window, inside the last
      W - s positions or one of the s sinks (Xiao et al. 2023). Without sinks the window
      is the last W positions (q - k < W).
    """
    return policy_for(cfg).visible(q_positions, k_positions)
