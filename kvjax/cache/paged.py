"""A paged KV cache: per-layer page pools, per-row block tables, and their host allocator.

The layout of vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for
Large Language Model Serving with PagedAttention", sec. 4.1-4.2): every cached tensor of
every layer (:func:`kvjax.cache.kv.tensor_specs`: keys and values, quantization scales,
MLA's latent and rotary key) is a **pool** of ``num_pages`` pages of ``page_size`` P
tokens each, laid out as a dense cache whose rows are pages (``tensor_specs(cfg,
num_pages, P)``: 'k' [N, K, P, H] or [N, K, H, P], 'c_kv' [N, P, C], 'k_scale' [N, K, P, 1]
...). Row b's logical token j lives in page ``block_table[b, j // P]`` at offset
``j % P``; a row holds at most ``max_pages`` M pages, so its logical capacity is M·P.

* **Write** (:func:`write`): a chunk's tokens scatter to (page, offset) of their
  absolute positions; padded tokens (position -1) and positions with no page are dropped.
* **Read** (:meth:`PagedKVCache.layer`): a layer's dense view [B, K, M·P, H] gathers a
  row's M pages (slot j = position j) and :attr:`PagedKVCache.positions` gives that
  view's positions (j below the row's length and on an allocated page, else -1), so the
  model's attention code and its masks (:mod:`kvjax.cache.policy`) run on the view
  unchanged. The gather reads M·P slots per row (the bytes of a dense row of M·P slots,
  plus the block table) and writes them again. The layer also carries its pools and the
  block table (:class:`PagedLayer`): the native decode kernel reads the pages where they
  lie (:func:`kvjax.models.decode_kernels.partial_attention` with ``block_table``), and
  the view nothing reads is dropped from the compiled program.
* **Per-layer windows** (``cfg.layer_windows``): a global layer's pool is paged as
  above; a local layer of window W_i keeps each row's ring of W_i (+ spare) slots as a
  dense cache keeps it (:func:`kvjax.cache.kv.init_cache`), [B, K, W_i, H], written by
  the ring policy and read with :func:`kvjax.cache.kv.ring_positions` of the row's
  length, so the allocated bytes are theory's per-layer sum
  (docs/decisions/0031-paged-layer-windows-rings.md).
* **Compressed rows** (an evicting ``cfg.kv_compression``, lever 5, schedule 'prefill'):
  each row holds a fixed W = kv_budget + recent_slots slots on W / P pages that never
  grow, the compressed cache's ring (:class:`kvjax.cache.policy.RingSlots` of W slots,
  the first kv_budget pinned): slot j lives in page ``block_table[b, j // P]``, a
  position p is written to slot ``slot_of(p)``, and :attr:`PagedKVCache.positions`
  derives the slots' positions from the row's length and the length it was
  compressed at (``ring_start``). The prompt is scored and compressed on a dense
  one-row cache, whose kept slots (different per KV head: a page holds every KV head's
  own kept slot j) are written into the row's pages (:func:`put_slots`), so a row holds
  its budget's bytes, never a full-size cache masked
  (docs/decisions/0041-paged-compressed-rows.md).
* **Host allocation** (:class:`PageAllocator`): a free list, reference counts, fork and
  copy on write of a shared page, and page-granular prefix hashing (each full page's key
  is a hash of its token ids chained with the previous page's key, as vLLM's automatic
  prefix caching) with least-recently-used eviction of cached pages no row references.

Nothing here measures or branches on the machine; the array functions are traceable.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import ops
from kvjax.cache import kv, quant
from kvjax.cache.policy import RingSlots
from kvjax.config import ModelConfig, check_paged_compression

__all__ = ["PagedKVCache", "PagedLayer", "PoolExhausted", "init_paged_cache", "pages_for",
           "write", "advance", "overflows", "copy_pages", "gather_view", "page_bytes",
           "ring_bytes", "row_cache", "put_row", "PageAllocator", "page_hashes", "BOUNDS",
           "check_selection", "bound_bytes", "write_bounds", "gather_heads",
           "compressed_slots", "put_slots"]


class PoolExhausted(RuntimeError):
    """The page pool has no free page and no cached page to evict."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens: ceil(num_tokens / page_size)."""
    return -(-int(num_tokens) // int(page_size))


def _check_page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; allowed: an integer >= 1 for a paged "
                         "cache (0 means dense rows, which need no page pool)")
    return int(page_size)


@flax.struct.dataclass
class PagedKVCache:
    """Page pools of every cached tensor plus per-row block tables and lengths.

    The same interface as :class:`kvjax.cache.kv.KVCache` where ``model.forward`` reads
    it (``layer``, ``positions``, ``length``, ``num_slots``, ``layouts``, ``ragged``):
    the layer's tensors and positions come back as the rows' dense views.

    Attributes:
      tensors: name -> pool, [L, N, ...] (stacked, ``cfg.scan_layers``) or a tuple of L
        [N, ...] arrays; ``...`` is one layer's per-token shape with P in the slot axis
        (:func:`kvjax.cache.kv.tensor_specs` with B = N pages and S = P); a ring layer's
        entry (``rings``) is its rows' ring [B, ..., S_i, X] instead.
      block_table: [B, M] int32 page of each row's logical page, -1 where none.
      length: [B] int32 tokens written per row.
      page_size: static P, tokens per page.
      axes: static ((name, slot axis -2 | -1), ...) of the pools.
      layouts: static, as :attr:`KVCache.layouts`.
      ragged: static, always True (rows keep their own lengths).
      rings: static, () or per layer the slots S_i of its rows' ring (a local layer of
        ``cfg.layer_windows``), 0 for a paged layer.
      bounds: {} or, for a read-time page selection (Quest, ``cfg.kv_selects_pages``),
        {'k_min': pools, 'k_max': pools}: each page's per-channel minimum and maximum
        of its written keys (dequantized), [L, N, K, H] or a tuple of L [N, K, H] in the
        model dtype, kept by :func:`write_bounds`.
      row_ring: static, () or (W, s) for compressed rows: each row's M·P = W slots are
        a ring whose first s (kv_budget) are pinned (:func:`compressed_slots`).
      ring_start: None, or with ``row_ring`` [B] int32 the length each row was
        compressed at: its ring holds positions >= max(ring_start, s) only.
    """

    tensors: dict
    block_table: jax.Array
    length: jax.Array
    page_size: int = flax.struct.field(pytree_node=False, default=16)
    axes: tuple = flax.struct.field(pytree_node=False, default=())
    layouts: tuple | None = flax.struct.field(pytree_node=False, default=None)
    ragged: bool = flax.struct.field(pytree_node=False, default=True)
    rings: tuple = flax.struct.field(pytree_node=False, default=())
    pool_pages: int = flax.struct.field(pytree_node=False, default=0)
    bounds: dict = flax.struct.field(default_factory=dict)
    row_ring: tuple = flax.struct.field(pytree_node=False, default=())
    ring_start: jax.Array | None = None

    @property
    def schedule(self) -> None:
        """None: paged rows hold no decode-time compression state
        (:attr:`kvjax.cache.kv.KVCache.schedule`), so the decode loop reads one attribute
        of either cache."""
        return None

    def is_ring(self, i: int) -> bool:
        """Whether layer ``i`` (a static int) keeps its rows' rings, not pages."""
        return bool(self.rings) and self.rings[i] > 0

    @property
    def max_pages(self) -> int:
        """M, block-table entries per row."""
        return self.block_table.shape[-1]

    @property
    def num_slots(self) -> int:
        """M·P, slots of a row's dense view."""
        return self.max_pages * self.page_size

    @property
    def num_pages(self) -> int:
        """N, pages in each pool."""
        if self.pool_pages:
            return self.pool_pages
        t = next(iter(self.tensors.values()))
        return t[0].shape[0]  # layer 0's pool (a tuple's first, a stack's first slice)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    @property
    def positions(self) -> jax.Array:
        """[B, M·P] int32 positions of each row's dense view: slot j holds position j when
        j < length and its page is allocated, else -1 (empty). A compressed row
        (``row_ring`` (W, s)): a pinned slot j < s holds j while j < length (the kept
        slots' markers, :mod:`kvjax.cache.compress`, or position j written after a
        short prompt), a ring slot s + r the newest p < length with p - s = r mod
        (W - s) and p >= max(ring_start, s), else -1 (the dense compressed cache's
        positions, from two lengths)."""
        j = jnp.arange(self.num_slots, dtype=jnp.int32)[None, :]
        page = jnp.repeat(self.block_table, self.page_size, axis=1)  # [B, M*P]
        length = self.length[:, None]
        if not self.row_ring:
            return jnp.where((j < length) & (page >= 0), j, -1)
        w, s = self.row_ring
        last = length - 1
        p = last - jnp.mod(last - j, w - s)  # newest p <= last with p = j mod (W - s)
        ring = (j >= s) & (j < w) & (p >= jnp.maximum(self.ring_start[:, None], s))
        pos = jnp.where((j < s) & (j < length), j, jnp.where(ring, p, -1))
        return jnp.where(page >= 0, pos, -1).astype(jnp.int32)

    def layer(self, i) -> "PagedLayer":
        """name -> layer ``i``'s dense view of every row ([B, K, M·P, H] ...);
        ``i`` may be traced if stacked. Float views are zero at the slots
        :attr:`positions` marks -1 (a page reused from a finished request, page 0 read
        for a missing one), so a masked slot contributes nothing whatever the pool
        holds there (issue 32); the select fuses into the gather's copy. The mapping also
        carries the layer's pools and the block table (:class:`PagedLayer`): a kernel
        that reads pages in place uses those, and the gather of a view nothing reads is
        dropped from the compiled program. A ring layer (:meth:`is_ring`) gives its rows'
        rings, the values zero where :func:`kvjax.cache.kv.ring_positions` marks -1 (a
        row reused from a finished request; every path selects the keys' scores)."""
        axes = dict(self.axes)
        if self.is_ring(i):
            seen = kv.ring_positions(self.length, self.rings[i]) >= 0
            return {n: ops.zero_unseen(t[i], seen, axes[n]) if n == "v" else t[i]
                    for n, t in self.tensors.items()}
        seen = self.positions >= 0  # [B, M·P]
        views = {n: gather_view(t[i], self.block_table, axes[n], seen)
                 for n, t in self.tensors.items()}
        return PagedLayer(views, pools={n: t[i] for n, t in self.tensors.items()},
                          block_table=self.block_table, page_size=self.page_size,
                          bounds={n: t[i] for n, t in self.bounds.items()})


class PagedLayer(dict):
    """One layer of a :class:`PagedKVCache` as the model reads it: name -> the rows'
    dense views (a dict, as a dense cache's layer), plus

    Attributes:
      pools: name -> this layer's pool, [N, ..., P, X] or [N, ..., X, P].
      block_table: [B, M] int32 (-1: no page).
      page_size: P.
      bounds: {} or {'k_min', 'k_max'}: this layer's pages' key bounds [N, K, H]
        (:attr:`PagedKVCache.bounds`).
    """

    def __init__(self, views: dict, pools: dict, block_table: jax.Array, page_size: int,
                 bounds: dict | None = None):
        super().__init__(views)
        self.pools, self.block_table, self.page_size = pools, block_table, page_size
        self.bounds = bounds or {}


def gather_view(pool: jax.Array, block_table: jax.Array, axis: int,
                seen: jax.Array | None = None) -> jax.Array:
    """The rows' dense views of one layer's pool (the XLA formulation of paged reads).

    Args:
      pool: [N, ..., P, X] (``axis`` -2) or [N, ..., X, P] (``axis`` -1).
      block_table: [B, M] int32 pages (-1: none; its slots read page 0 and are masked
        by :attr:`PagedKVCache.positions`).
      axis: the slot axis of ``pool``.
      seen: [B, M·P] bool or None: a float view is zero where not seen
        (:func:`kvjax.ops.zero_unseen`; the select fuses into the gather's copy), so a
        masked slot contributes nothing whatever its page holds (issue 32).
    Returns:
      [B, ..., M·P, X] (or [B, ..., X, M·P]): page m of row b at slots m·P .. m·P+P-1.
    """
    g = pool[jnp.maximum(block_table, 0)]  # [B, M, ...rest]
    a = pool.ndim - 1 + axis  # slot axis inside rest
    g = jnp.moveaxis(g, 1, 1 + a)  # [B, ..., M, P, ...]
    shape = g.shape[:1 + a] + (g.shape[1 + a] * g.shape[2 + a],) + g.shape[3 + a:]
    view = g.reshape(shape)
    return view if seen is None else ops.zero_unseen(view, seen, axis)


def gather_heads(pool: jax.Array, tables: jax.Array, axis: int,
                 seen: jax.Array | None = None) -> jax.Array:
    """Each (row, KV head)'s own pages of one layer's pool, as a dense view (the XLA
    formulation of a per-head page read: Quest's chosen pages, ``pages_xla``).

    Args:
      pool: [N, K, P, X] (``axis`` -2) or [N, K, X, P] (``axis`` -1).
      tables: [B, K, C] int32 pages of each row and KV head (-1: none; reads page 0,
        zeroed or masked by ``seen``).
      axis: the slot axis of ``pool``.
      seen: [B, K, C·P] bool or None: a float view is zero where not seen, so a slot no
        query sees contributes nothing whatever its page holds (issue 32).
    Returns:
      [B, K, C·P, X] (or [B, K, X, C·P]): table entry c of (b, k) at slots c·P .. c·P+P-1.
    """
    b, k, c = tables.shape
    heads = jnp.arange(k, dtype=jnp.int32)[None, :, None]
    x = pool[jnp.maximum(tables, 0), heads]  # [B, K, C, P, X] or [B, K, C, X, P]
    if axis == -1:
        x = jnp.swapaxes(x, 2, 3)  # [B, K, X, C, P]
        view = x.reshape(b, k, x.shape[2], -1)
    else:
        view = x.reshape(b, k, -1, x.shape[-1])
    if seen is None or jnp.issubdtype(view.dtype, jnp.integer):  # codes: always finite
        return view
    return jnp.where(jnp.expand_dims(seen, -1 if axis == -2 else -2), view,
                     jnp.zeros((), view.dtype))


def init_paged_cache(cfg: ModelConfig, batch_size: int, num_pages: int, page_size: int,
                     max_pages: int, spare_slots: int = 0) -> PagedKVCache:
    """An empty paged cache: zero pools of ``num_pages`` pages of ``page_size`` tokens per
    layer and tensor, ``batch_size`` rows of ``max_pages`` block-table entries (all -1),
    lengths 0. With ``cfg.layer_windows`` a local layer of window W_i holds its rows'
    rings of W_i + ``spare_slots`` slots instead of a pool (:attr:`PagedKVCache.rings`;
    a speculative ring keeps k + 1 spare, :func:`kvjax.cache.kv.init_cache`).

    Raises:
      ValueError: ``page_size`` below 1 (named), a non-positive batch_size, num_pages
        or max_pages, or a negative spare_slots (named).
    """
    page_size = _check_page_size(page_size)
    for name, v in (("batch_size", batch_size), ("num_pages", num_pages),
                    ("max_pages", max_pages)):
        if int(v) < 1:
            raise ValueError(f"{name}={v}; allowed: an integer >= 1")
    if int(spare_slots) < 0:
        raise ValueError(f"spare_slots={spare_slots}; allowed: an integer >= 0")
    quant.check_supported(cfg)
    tensors = {}
    specs = kv.tensor_specs(cfg, num_pages, page_size)
    rings = ()
    if cfg.layer_windows is not None:  # unrolled; a local layer its rows' ring
        rings = tuple(0 if w is None else w + spare_slots for w in cfg.layer_windows)
        per_layer = [kv.tensor_specs(cfg, batch_size, s) if s else specs for s in rings]
        tensors = {name: tuple(jnp.zeros(sp[name].shape, sp[name].dtype) for sp in per_layer)
                   for name in specs}
    for name, spec in (specs.items() if not rings else ()):
        if cfg.scan_layers:
            tensors[name] = jnp.zeros((cfg.num_layers,) + spec.shape, spec.dtype)
        else:
            tensors[name] = tuple(jnp.zeros(spec.shape, spec.dtype)
                                  for _ in range(cfg.num_layers))
    bounds = {}
    row_ring, ring_start = (), None
    if cfg.kv_evicts:  # a compressed row: W slots of whole pages, a ring
        w = compressed_slots(cfg, page_size)
        if max_pages * page_size != w:
            raise ValueError(
                f"max_pages={max_pages} with model.kv_compression={cfg.kv_compression!r}; "
                f"allowed: {w // page_size} (a compressed row's kv_budget + recent_slots "
                f"= {w} slots in pages of {page_size})")
        row_ring = (w, cfg.kv_budget)
        ring_start = jnp.zeros((batch_size,), jnp.int32)
    if cfg.kv_selects_pages:  # Quest: every page's key bounds
        check_selection(cfg, page_size, max_pages)
        shape = (num_pages, cfg.num_kv_heads, cfg.head_dim)
        bounds = {n: jnp.zeros((cfg.num_layers,) + shape, cfg.jnp_dtype) if cfg.scan_layers
                  else tuple(jnp.zeros(shape, cfg.jnp_dtype) for _ in range(cfg.num_layers))
                  for n in BOUNDS}
    return PagedKVCache(tensors=tensors,
                        block_table=jnp.full((batch_size, max_pages), -1, jnp.int32),
                        length=jnp.zeros((batch_size,), jnp.int32), page_size=page_size,
                        axes=tuple((n, s.slot_axis) for n, s in specs.items()),
                        layouts=kv.layouts(cfg), ragged=True, rings=rings,
                        pool_pages=int(num_pages), bounds=bounds, row_ring=row_ring,
                        ring_start=ring_start)


def compressed_slots(cfg: ModelConfig, page_size: int) -> int:
    """W = kv_budget + recent_slots, the slots of a compressed row on pages of
    ``page_size`` (W / P pages, fixed). Raises ConfigError (a ValueError) naming the
    value unless ``cfg``'s compression runs on pages
    (:func:`kvjax.config.check_paged_compression`)."""
    check_paged_compression(cfg, page_size)
    return cfg.kv_budget + cfg.compression.recent_slots


def put_slots(cache: PagedKVCache, one: kv.KVCache, block_table: jax.Array) -> PagedKVCache:
    """``cache`` with the W slots of a dense one-row cache ``one`` (a compressed prompt's,
    :func:`kvjax.cache.compress.compress`: codes and scales as stored) written into the
    row's pages: slot j to page ``block_table[0, j // P]``, offset j % P (every slot,
    so a reused page keeps nothing of its last row). Traceable.

    Args:
      one: a :class:`kvjax.cache.kv.KVCache` of one row and M·P slots, ``cache``'s tensors.
      block_table: [1, M] int32 the row's pages.
    """
    plain = cache.replace(block_table=block_table, row_ring=())  # slot j = logical j
    pos = jnp.arange(one.num_slots, dtype=jnp.int32)[None, :]
    axes, tensors = dict(cache.axes), {}
    for n, t in cache.tensors.items():
        src = one.tensors[n]
        if isinstance(t, tuple):
            tensors[n] = tuple(write(plain, x, y, pos, axes[n]) for x, y in zip(t, src))
            continue
        for i in range(t.shape[0]):  # stacked [L, N, ...]
            t = write(plain, t, src[i], pos, axes[n], jnp.int32(i))
        tensors[n] = t
    return cache.replace(tensors=tensors)


BOUNDS = ("k_min", "k_max")
"""The per-page key bounds a read-time page selection keeps (:attr:`PagedKVCache.bounds`)."""


def check_selection(cfg: ModelConfig, page_size: int, max_pages: int) -> None:
    """Raises ValueError naming ``model.kv_budget`` unless a read-time page selection
    (Quest) can run on rows of ``max_pages`` pages of ``page_size`` tokens: the budget a
    positive multiple of the page size, at most a row's M·P tokens, more pages than
    ``compression.first_pages``; and MHA/GQA/MQA without windows (checked by the
    config)."""
    b = cfg.kv_budget
    why = f"with model.kv_compression={cfg.kv_compression!r}"
    if b % page_size:
        raise ValueError(f"model.kv_budget={b}; allowed: a multiple of page_size="
                         f"{page_size} {why} (tokens read per KV head: whole pages)")
    if b > max_pages * page_size:
        raise ValueError(f"model.kv_budget={b}; allowed: at most {max_pages * page_size} "
                         f"{why} (a row's {max_pages} pages of {page_size})")
    if cfg.compression.first_pages >= b // page_size:
        raise ValueError(f"model.compression.first_pages={cfg.compression.first_pages}; "
                         f"allowed: fewer than the budget's {b // page_size} pages {why}")


def bound_bytes(cfg: ModelConfig) -> int:
    """Bytes of one page's key bounds over every layer (Quest: 2·K·H elements per layer,
    model dtype); 0 without a read-time page selection."""
    if not cfg.kv_selects_pages:
        return 0
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes


def _paged_layers(cfg: ModelConfig) -> int:
    """Layers whose cache is paged: all, or the global ones of ``cfg.layer_windows``."""
    return (cfg.num_layers if cfg.layer_windows is None
            else sum(w is None for w in cfg.layer_windows))


def page_bytes(cfg: ModelConfig, page_size: int) -> int:
    """Bytes of one page over every paged layer (all, or the global layers of
    ``cfg.layer_windows``) and cached tensor (codes and scales)."""
    per_layer = sum(s.nbytes for s in kv.tensor_specs(cfg, 1, page_size).values())
    return _paged_layers(cfg) * per_layer + bound_bytes(cfg)


def ring_bytes(cfg: ModelConfig, batch_size: int, spare_slots: int = 0) -> int:
    """Bytes of the rows' rings of the local layers of ``cfg.layer_windows``:
    B·sum_i (W_i + spare)·(one slot's bytes of a layer), 0 without them."""
    if cfg.layer_windows is None:
        return 0
    slot = sum(s.nbytes for s in kv.tensor_specs(cfg, batch_size, 1).values())
    return slot * sum(w + spare_slots for w in cfg.layer_windows if w is not None)


def row_cache(cache: PagedKVCache, row, block_table: jax.Array,
              length: jax.Array) -> PagedKVCache:
    """A one-row cache over ``cache``'s pools: ``block_table`` [1, M], ``length`` [1],
    and each ring layer's row ``row`` ([] int32, may be traced) of its rings."""
    if not cache.rings:
        return cache.replace(block_table=block_table, length=length)
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0)
    tensors = {n: tuple(take(x) if cache.is_ring(i) else x for i, x in enumerate(t))
               for n, t in cache.tensors.items()}
    return cache.replace(tensors=tensors, block_table=block_table, length=length)


def put_row(cache: PagedKVCache, one: PagedKVCache, row) -> PagedKVCache:
    """``cache`` with the pools of ``one`` (a :func:`row_cache` after a write) and its
    rings put back in row ``row``; ``cache``'s block tables and lengths kept."""
    if not cache.rings:
        return cache.replace(tensors=one.tensors, bounds=one.bounds)
    put = lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), row, 0)
    tensors = {n: tuple(put(x, r) if cache.is_ring(i) else r
                        for i, (x, r) in enumerate(zip(t, one.tensors[n])))
               for n, t in cache.tensors.items()}
    return cache.replace(tensors=tensors)


def _pages_offsets(cache: PagedKVCache, positions: jax.Array):
    """(page [B, T], offset [B, T]) int32 of each chunk token; page N (dropped by the
    scatter) for a padded token, one past the view or one on no page. A compressed
    row's token goes to its ring slot (``row_ring``; one a later token of the chunk
    overwrites is dropped)."""
    p, n = cache.page_size, cache.num_pages
    if cache.row_ring:
        w, s = cache.row_ring
        positions = jnp.where(positions >= 0, RingSlots(w, s).write_slots(positions, w), -1)
    ok = (positions >= 0) & (positions < cache.num_slots)
    logical = jnp.where(ok, positions // p, 0)
    page = jnp.take_along_axis(cache.block_table, logical, axis=1)
    page = jnp.where(ok & (page >= 0), page, n)
    return page, jnp.where(ok, positions % p, 0)


def write(cache: PagedKVCache, buf: jax.Array, new: jax.Array, positions: jax.Array,
          axis: int, layer=None) -> jax.Array:
    """Scatters a chunk into one pool: token t of row b to (page, offset) of its position.

    Args:
      cache: its block table and page size map positions to pages.
      buf: the pool, [N, ..., P, X] (``axis`` -2) / [N, ..., X, P] (``axis`` -1), or the
        same with a leading L axis when ``layer`` ([] int32) is given.
      new: [B, ..., T, X] (or [B, ..., X, T]) in the cache's representation
        (:func:`kvjax.cache.kv.encode`).
      positions: [B, T] int32 absolute positions (-1: padding, not written).
      axis: the slot axis (-2 or -1).
    Returns:
      The updated pool. Tokens on no page are dropped; :func:`overflows` poisons such a
      row's logits. Two rows never write one (page, offset): the host allocator gives a
      row's written pages to it alone (copy on write).
    """
    page, offset = _pages_offsets(cache, positions)
    lead = 0 if layer is None else 1
    rest = buf.ndim - lead - 1  # per-page dims
    a = rest + axis
    index = [slice(None)] * buf.ndim
    index[lead], index[lead + 1 + a] = page, offset
    if layer is not None:
        index[0] = layer
    # advanced indices broadcast to [B, T]; separated by slices they go first, adjacent
    # they stay in place at the front: the update is [B, T, rest without the slot axis]
    value = jnp.moveaxis(new.astype(buf.dtype), new.ndim + axis, 1)
    return buf.at[tuple(index)].set(value, mode="drop")


def write_bounds(cache: PagedKVCache, bounds: dict, k_new: jax.Array,
                 positions: jax.Array, layer=None) -> dict:
    """One layer's page key bounds after a chunk's keys are written
    (:attr:`PagedKVCache.bounds`; Quest, Tang et al. 2024 sec. 3.2: per page and channel
    the min and max of its keys). A page whose offset 0 the chunk writes starts afresh
    (a reused page forgets its old keys), the others take min / max with the chunk's keys,
    so a bound is always that of the keys written to the page so far.

    Args:
      cache: its block table and page size map positions to pages.
      bounds: {'k_min', 'k_max'}: one layer's [N, K, H], or stacked [L, N, K, H] with
        ``layer`` ([] int32) given.
      k_new: [B, K, T, H] the chunk's keys as the cache holds them (dequantized).
      positions: [B, T] int32 (-1: padding, not written).
    Returns:
      {'k_min', 'k_max'} updated, shaped as ``bounds``.
    """
    page, offset = _pages_offsets(cache, positions)  # [B, T]; N: dropped
    fresh = jnp.where(offset == 0, page, cache.num_pages)  # pages this chunk starts
    new = jnp.swapaxes(k_new, 1, 2)  # [B, T, K, H]
    out = {}
    for name, fill in (("k_min", jnp.inf), ("k_max", -jnp.inf)):
        x = bounds[name]
        lead = () if layer is None else (layer,)
        vals = new.astype(x.dtype)
        # a decode step: one read-modify-write per row (a set then a min scatter made
        # XLA copy the pool twice: docs/decisions/0038-quest-pages-native-rule.md)
        if positions.shape[1] == 1:
            old = x[lead + (jnp.minimum(page, cache.num_pages - 1),)]  # [B, 1, K, H]
            old = jnp.where((offset == 0)[..., None, None], fill, old)
            upd = jnp.minimum(old, vals) if name == "k_min" else jnp.maximum(old, vals)
            out[name] = x.at[lead + (page,)].set(upd, mode="drop")
            continue
        x = x.at[lead + (fresh,)].set(jnp.full(vals.shape, fill, x.dtype), mode="drop")
        at = x.at[lead + (page,)]
        out[name] = at.min(vals, mode="drop") if name == "k_min" else at.max(vals, mode="drop")
    return out


def overflows(cache: PagedKVCache, positions: jax.Array) -> jax.Array:
    """[B] bool: a real token of the row (position >= 0) falls past the view or on a
    block-table entry with no page (its write would be lost)."""
    page, _ = _pages_offsets(cache, positions)
    return jnp.any((positions >= 0) & (page >= cache.num_pages), axis=1)


def advance(cache: PagedKVCache, positions: jax.Array, num_new=None) -> PagedKVCache:
    """Lengths after a chunk: + T, or + ``num_new`` [B] real tokens per row."""
    t = positions.shape[-1] if num_new is None else num_new
    return cache.replace(length=cache.length + t)


def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copies pages ``src`` [n] int32 to ``dst`` [n] in every pool and layer (copy on
    write of shared pages; traceable)."""
    out = {}
    for n, t in cache.tensors.items():
        if isinstance(t, tuple):  # (a ring layer's rings are a row's own: kept)
            out[n] = tuple(x if cache.is_ring(i) else x.at[dst].set(x[src])
                           for i, x in enumerate(t))
        else:
            out[n] = t.at[:, dst].set(t[:, src])
    bounds = {n: (tuple(x.at[dst].set(x[src]) for x in t) if isinstance(t, tuple)
                  else t.at[:, dst].set(t[:, src])) for n, t in cache.bounds.items()}
    return cache.replace(tensors=out, bounds=bounds)


# ---------------------------------------------------------------------- host allocator


DROPPED = -1  # a row's logical page freed because no query sees it (slid out of a window)


def page_hashes(tokens: Sequence[int], page_size: int, prev: bytes = b"",
                start_page: int = 0) -> list:
    """Chained keys of the full pages of ``tokens`` from page ``start_page`` on: page i's
    key is blake2b(key of page i-1 ++ its P token ids), ``prev`` the key before
    ``start_page`` (b'' at the start). Equal keys mean equal token prefixes (up to a
    128-bit collision)."""
    out = []
    toks = np.asarray(tokens, np.int64)
    for i in range(start_page, len(toks) // page_size):
        h = hashlib.blake2b(prev + toks[i * page_size:(i + 1) * page_size].tobytes(),
                            digest_size=16).digest()
        out.append(h)
        prev = h
    return out


@dataclasses.dataclass
class _Row:
    pages: list = dataclasses.field(default_factory=list)    # DROPPED: freed (a window)
    tokens: list = dataclasses.field(default_factory=list)   # ids held (written) so far
    hashes: list = dataclasses.field(default_factory=list)   # keys of its full pages


class PageAllocator:
    """Host-side pages of one pool: free list, reference counts, rows' block tables,
    fork, copy on write and (optionally) a prefix cache of full pages.

    A page is in exactly one state: **free** (refcount 0, no key), **referenced**
    (refcount = the rows holding it) or **cached** (refcount 0 with a key: its tokens stay
    findable until the pool needs the page; least recently used evicted first).

    Args:
      num_pages: N pages in the pool (>= 1).
      page_size: P tokens per page (>= 1).
      prefix_cache: index full pages by their chained key (:func:`page_hashes`) so a
        prompt that starts with cached pages reuses them.
    Raises:
      ValueError: ``page_size`` or ``num_pages`` below 1 (named).
    """

    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False):
        self.page_size = _check_page_size(page_size)
        if int(num_pages) < 1:
            raise ValueError(f"num_pages={num_pages}; allowed: an integer >= 1")
        self.num_pages, self.prefix_cache = int(num_pages), bool(prefix_cache)
        self.refcount = np.zeros(self.num_pages, np.int32)
        self.free = collections.deque(range(self.num_pages))
        self.lru: collections.OrderedDict = collections.OrderedDict()  # cached page -> key
        self.key_of: dict = {}    # page -> key (referenced or cached)
        self.page_of: dict = {}   # key -> page
        self.rows: dict = {}      # row id -> _Row
        self.hit_tokens = 0       # prompt tokens found in the prefix cache, summed
        self.query_tokens = 0     # prompt tokens looked up, summed

    # ---------------------------------------------------------------- pages

    @property
    def num_available(self) -> int:
        """Pages an allocation may take: free plus cached (evictable)."""
        return len(self.free) + len(self.lru)

    @property
    def num_referenced(self) -> int:
        """Pages held by at least one row."""
        return int((self.refcount > 0).sum())

    def _take(self) -> int:
        if self.free:
            return self.free.popleft()
        if self.lru:  # evict the least recently used cached page
            page, key = self.lru.popitem(last=False)
            del self.key_of[page], self.page_of[key]
            return page
        raise PoolExhausted(f"all {self.num_pages} pages are referenced by live rows")

    def _ref(self, page: int) -> None:
        if self.refcount[page] == 0:
            self.lru.pop(page, None)
        self.refcount[page] += 1

    def _unref(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            if page in self.key_of:
                self.lru[page] = self.key_of[page]  # most recently used end
            else:
                self.free.append(page)

    # ---------------------------------------------------------------- rows

    def block_table(self, row) -> list:
        """The pages of ``row`` in logical order (-1: :data:`DROPPED`)."""
        return list(self.rows[row].pages)

    def length(self, row) -> int:
        return len(self.rows[row].tokens)

    def match(self, tokens: Sequence[int]) -> list:
        """Cached pages holding a prefix of ``tokens``: full pages only, and never the
        page of the last token (its logits must be computed). [] without a prefix cache."""
        if not self.prefix_cache:
            return []
        usable = (len(tokens) - 1) // self.page_size
        pages = []
        for key in page_hashes(list(tokens)[:usable * self.page_size], self.page_size):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def admit(self, row, tokens: Sequence[int], reserve: int) -> int:
        """A new row for a request whose prompt is ``tokens``: references its cached
        prefix pages, then takes pages until ``reserve`` tokens fit. All or nothing.

        Returns:
          Tokens found cached (a multiple of P; the prefill starts after them).
        Raises:
          ValueError: ``row`` is live already.
          PoolExhausted: the pages do not fit (nothing is taken).
        """
        if row in self.rows:
            raise ValueError(f"row {row!r} is already live; allowed: a new row id")
        hit = self.match(tokens)
        need = pages_for(reserve, self.page_size) - len(hit)
        # cached hit pages leave the evictable set when referenced: count them out
        evictable_hits = sum(1 for p in hit if self.refcount[p] == 0)
        if need > self.num_available - evictable_hits:
            raise PoolExhausted(f"row {row!r} needs {need} new pages, "
                                f"{self.num_available - evictable_hits} available")
        r = _Row()
        for p in hit:
            self._ref(p)
            r.pages.append(p)
        for _ in range(max(need, 0)):
            p = self._take()
            self._ref(p)
            r.pages.append(p)
        n_hit = len(hit) * self.page_size
        r.tokens = list(tokens[:n_hit])
        r.hashes = [self.key_of[p] for p in hit]
        self.rows[row] = r
        self.query_tokens += len(tokens)
        self.hit_tokens += n_hit
        return n_hit

    def ensure(self, row, num_tokens: int) -> list:
        """Takes pages until ``row`` has room for ``num_tokens`` tokens, and copies on
        write every shared page that the row's next writes land in (its pages from the
        one holding token ``length(row)`` on), so afterwards each of them is the row's
        alone. All or nothing.

        Returns:
          [(src, dst), ...] pages to copy on the device before writing (:func:`copy_pages`).
        Raises:
          PoolExhausted: not enough pages for the copies and the growth together (nothing
            is taken, the row keeps its pages).
        """
        r = self.rows[row]
        first = len(r.tokens) // self.page_size  # the page the next token lands in
        # pages trim/drop_before leave holding a written position only: never DROPPED here
        shared = [i for i in range(first, len(r.pages)) if self.refcount[r.pages[i]] > 1]
        grow = max(0, pages_for(num_tokens, self.page_size) - len(r.pages))
        if len(shared) + grow > self.num_available:
            raise PoolExhausted(f"row {row!r} needs {len(shared)} copies and {grow} new "
                                f"pages, {self.num_available} available")
        copies = []
        for i in shared:
            src, dst = r.pages[i], self._take()
            self._ref(dst)
            self._unref(src)
            r.pages[i] = dst
            if i * self.page_size < len(r.tokens):  # holds tokens: copy them
                copies.append((src, dst))
        for _ in range(grow):
            p = self._take()
            self._ref(p)
            r.pages.append(p)
        return copies

    def append(self, row, tokens: Iterable[int]) -> None:
        """Records tokens the device wrote for ``row``; with a prefix cache, full pages
        get their keys (a page whose key another page holds already stays unkeyed).

        Raises:
          ValueError: the tokens overrun the row's pages, or land in a page another row
            holds or a key names (``ensure()`` first); nothing is recorded.
        """
        r = self.rows[row]
        tokens = [int(t) for t in tokens]
        n, p = len(r.tokens), self.page_size
        if n + len(tokens) > len(r.pages) * p:
            raise ValueError(f"row {row!r} holds {n + len(tokens)} tokens on {len(r.pages)} "
                             f"pages of {p}; allowed: ensure() first")
        for i in range(n // p, pages_for(n + len(tokens), p)):
            page = r.pages[i]
            if page == DROPPED or self.refcount[page] > 1 or page in self.key_of:
                raise ValueError(
                    f"row {row!r} writes into page {page} (logical page {i}), which "
                    f"{'was dropped' if page == DROPPED else 'another holder or a key refers to'}"
                    "; allowed: pages of its own (ensure() first)")
        r.tokens.extend(tokens)
        if not self.prefix_cache:
            return
        prev = r.hashes[-1] if r.hashes else b""
        for key in page_hashes(r.tokens, self.page_size, prev, len(r.hashes)):
            page = r.pages[len(r.hashes)]
            r.hashes.append(key)
            if key not in self.page_of and page not in self.key_of:
                self.page_of[key], self.key_of[page] = page, key

    def fork(self, src, dst) -> None:
        """Row ``dst`` shares every page of ``src`` (reference counts + 1); the first
        write of either into a shared page copies it (:meth:`ensure`)."""
        if dst in self.rows:
            raise ValueError(f"row {dst!r} is already live; allowed: a new row id")
        s = self.rows[src]
        for p in s.pages:
            if p != DROPPED:
                self._ref(p)
        self.rows[dst] = _Row(list(s.pages), list(s.tokens), list(s.hashes))

    def release(self, row) -> None:
        """Frees ``row``: its pages' references drop, last page first (so a cached tail
        is evicted before the prefix other requests share)."""
        r = self.rows.pop(row)
        for p in reversed(r.pages):
            if p != DROPPED:
                self._unref(p)

    def drop_before(self, row, position: int, keep_first: int = 0) -> int:
        """Frees the pages of ``row`` that hold only positions below ``position`` (keys
        no later query sees: a window W's query at q sees positions > q - W), except a
        page holding one of the first ``keep_first`` positions (attention sinks). Their
        block-table entries become -1 (:data:`DROPPED`; masked by
        :attr:`PagedKVCache.positions`); the row's tokens stay recorded (a preempted row
        is prefilled again from them). With a window the row then holds a constant
        number of pages however long it runs. Returns the pages freed.

        Raises:
          ValueError: ``position`` past the row's length (a page it has not written yet
            would be freed); nothing is freed.
        """
        r, p = self.rows[row], self.page_size
        if int(position) > len(r.tokens):
            raise ValueError(f"drop_before(row {row!r}, position={position}); allowed: at "
                             f"most the row's length {len(r.tokens)} (written positions)")
        freed = 0
        for i in range(min(len(r.pages), max(int(position), 0) // p)):
            if r.pages[i] != DROPPED and i * p >= keep_first:
                self._unref(r.pages[i])
                r.pages[i] = DROPPED
                freed += 1
        return freed

    def trim(self, row, num_tokens: int) -> None:
        """Keeps the first ``num_tokens`` tokens of ``row`` (rollback of rejected
        positions): pages past them are released; the page the next write lands in, if
        it was full and keyed, loses its key (the key would no longer name what the row
        writes there; another row sharing it keeps the page, unkeyed, and the row's next
        :meth:`ensure` copies it).

        Raises:
          ValueError: ``num_tokens`` outside [d, length], d the first position after the
            row's dropped pages (:meth:`drop_before`: their keys are gone, and a token
            written there would go to a page the row no longer holds); nothing changes.
        """
        r, p = self.rows[row], self.page_size
        dropped = [i for i, pg in enumerate(r.pages) if pg == DROPPED]
        low = (dropped[-1] + 1) * p if dropped else 0
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
                or not low <= num_tokens <= len(r.tokens):
            raise ValueError(f"trim(row {row!r}, num_tokens={num_tokens!r}); allowed: an "
                             f"integer in [{low}, {len(r.tokens)}] (the row's length, and "
                             "no lower than its dropped pages)")
        r.tokens = r.tokens[:num_tokens]
        keep = pages_for(num_tokens, p)
        while len(r.pages) > keep:
            self._unref(r.pages.pop())
        r.hashes = r.hashes[:num_tokens // p]
        cut = num_tokens // p  # the page the next write lands in
        if cut < len(r.pages) and r.pages[cut] in self.key_of:  # no longer full here
            del self.page_of[self.key_of.pop(r.pages[cut])]

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        """Raises AssertionError unless the invariants hold: every page is free, cached or
        referenced, exactly once; refcounts equal the rows' references; no row holds a
        page twice; a page shared by rows holds the same tokens for each (read-only
        sharing); keys map both ways; a row's dropped pages hold written positions only;
        with a prefix cache each row's page keys are the chain of its tokens
        (:func:`page_hashes`), and a keyed page a row holds is full in that row under
        the same key (a key never names a page a holder may write: :meth:`ensure` copies
        a shared page before a write, :meth:`trim` unkeys the page it cuts into)."""
        counts = np.zeros(self.num_pages, np.int32)
        content: dict = {}
        for rid, r in self.rows.items():
            held = [p for p in r.pages if p != DROPPED]
            assert len(set(held)) == len(held), f"row {rid} holds a page twice"
            assert len(r.tokens) <= len(r.pages) * self.page_size, f"row {rid} overflows"
            if self.prefix_cache:
                assert r.hashes == page_hashes(r.tokens, self.page_size), \
                    f"row {rid}'s page keys are not its tokens' chain"
            for i, p in enumerate(r.pages):
                if p == DROPPED:
                    assert (i + 1) * self.page_size <= len(r.tokens), \
                        f"row {rid} dropped its page {i}, which it has not written"
                    continue
                counts[p] += 1
                toks = tuple(r.tokens[i * self.page_size:(i + 1) * self.page_size])
                if p in content:
                    other = content[p]
                    n = min(len(other), len(toks))
                    assert other[:n] == toks[:n], f"page {p} shared with different tokens"
                content[p] = toks
                if p in self.key_of:
                    assert len(toks) == self.page_size and i < len(r.hashes) and \
                        r.hashes[i] == self.key_of[p], \
                        f"page {p} keeps a key that does not name row {rid}'s tokens"
        assert (counts == self.refcount).all(), "refcounts differ from the rows' references"
        free, cached = set(self.free), set(self.lru)
        assert len(free) == len(self.free), "a page is free twice"
        referenced = set(np.nonzero(counts)[0].tolist())
        assert not (free & cached) and not (free & referenced) and not (cached & referenced)
        assert free | cached | referenced == set(range(self.num_pages)), "pages leaked"
        assert all(self.key_of[p] == k for p, k in self.lru.items())
        assert all(self.page_of[k] == p for p, k in self.key_of.items())
        assert len(self.page_of) == len(self.key_of), "keys do not map both ways"
        assert not (free & set(self.key_of)), "a free page keeps a key"
