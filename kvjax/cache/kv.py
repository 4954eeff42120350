"""Functional KV caches: plain pytrees passed into the model and returned updated.

Two layouts share one bookkeeping scheme:

* MHA/GQA/MQA (optionally windowed): per-head keys and values, head-major: each of
  keys and values is ``[L, B, K, S, H]`` ('BKSH') or ``[L, B, K, H, S]`` ('BKHS', slot
  axis last), chosen by ``cfg.key_layout`` / ``cfg.value_layout`` (DESIGN.md: a
  [B, S, K, H] layout made XLA materialise transposes, 3.08x the blog's bytes against
  1.08x; :func:`kvjax.config.default_kv_layout` says which head-major layout is faster).
* MLA: one compressed latent and one shared rotary key per token, ``[L, B, S, C]`` and
  ``[L, B, S, R]``, with no head axis.

One :class:`KVCache` class holds either; it records the absolute position held by every slot (``positions``, -1 when empty) and
the number of tokens seen (``length``). Masks are computed from ``positions`` alone, so a
ring buffer that wraps can never expose a stale or future key. All rows of a batch advance
in lockstep (same prompt length).

Slots: a dense cache writes position p to slot p. A windowed cache with W slots and s
attention sinks writes p < s to slot p and p >= s to slot s + (p - s) mod (W - s).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from kvjax.config import ModelConfig

__all__ = ["KVCache", "slot_axis", "to_layout", "layouts", "check_layouts", "layer_shapes",
           "num_slots", "init_cache", "cache_spec", "cache_bytes", "total_bytes", "write",
           "ring_slots", "next_positions", "slot_of", "attention_mask"]


@flax.struct.dataclass
class KVCache:
    """Functional KV cache: per-layer tensors plus slot bookkeeping.

    Attributes:
      tensors: name -> cached tensor with the slot axis second to last or last
        (:func:`slot_axis`). MHA/GQA/MQA: {'k': [L, B, K, S, H] or [L, B, K, H, S],
        'v': likewise} per ``cfg.cache_layout``; MLA: {'c_kv': [L, B, S, C],
        'k_rope': [L, B, S, R]} (DeepSeek-V2 sec. 2.1: no head axis). With
        ``scan_layers=False`` each value is instead a tuple of L per-layer arrays
        ([B, K, S, H] ...), so no layer is ever sliced out of a stacked buffer.
      positions: [S] int32, absolute position held in each slot, -1 where empty.
      length: [] int32, tokens written so far (the next absolute position).
      layouts: static (not a pytree leaf): ((name, 'BKSH' | 'BKHS'), ...) as built by
        :func:`init_cache`, so ``model.forward`` can refuse a cache built for another
        layout (when S == H the shapes alone cannot tell); None = not recorded.
    """

    tensors: dict
    positions: jax.Array
    length: jax.Array
    layouts: tuple | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def num_slots(self) -> int:
        return self.positions.shape[0]

    def layer(self, i) -> dict:
        """name -> this layer's tensor ([B, K, S, H] ...); ``i`` may be traced if stacked."""
        return {n: t[i] for n, t in self.tensors.items()}


def slot_axis(cfg: ModelConfig, name: str) -> int:
    """-1 if cached tensor ``name`` keeps its slot axis last ('BKHS'), else -2."""
    if not cfg.is_mla and cfg.cache_layout(name) == "BKHS":
        return -1
    return -2


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


def layer_shapes(cfg: ModelConfig, batch_size: int, num_slots_: int) -> dict:
    """name -> per-layer cached tensor shape (slot axis at :func:`slot_axis`)."""
    if cfg.is_mla:
        return {"c_kv": (batch_size, num_slots_, cfg.kv_lora_rank),
                "k_rope": (batch_size, num_slots_, cfg.qk_rope_head_dim)}
    shapes = {}
    for name in ("k", "v"):
        shape = [batch_size, cfg.num_kv_heads, num_slots_, cfg.head_dim]
        if slot_axis(cfg, name) == -1:
            shape[2], shape[3] = shape[3], shape[2]
        shapes[name] = tuple(shape)
    return shapes


def num_slots(cfg: ModelConfig, max_seq_len: int) -> int:
    """S: slots per layer. Windowed caches hold W slots whatever max_seq_len is."""
    return cfg.window_size if cfg.window_size is not None else max_seq_len


def init_cache(cfg: ModelConfig, batch_size: int, max_seq_len: int) -> KVCache:
    """An empty cache for ``batch_size`` sequences of up to ``max_seq_len`` tokens.

    Tensors are zero-filled in ``cfg.dtype`` (see :class:`KVCache` for shapes), positions
    -1 and length 0. S = window_size when set, else max_seq_len.

    Raises:
      ValueError: non-positive batch_size or max_seq_len.
    """
    if batch_size <= 0 or max_seq_len <= 0:
        raise ValueError(
            f"batch_size={batch_size} and max_seq_len={max_seq_len} must be positive")
    s = num_slots(cfg, max_seq_len)
    dt = cfg.jnp_dtype
    tensors = {}
    for name, shape in layer_shapes(cfg, batch_size, s).items():
        if cfg.scan_layers:
            tensors[name] = jnp.zeros((cfg.num_layers,) + shape, dt)
        else:
            tensors[name] = tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers))
    return KVCache(tensors=tensors, positions=jnp.full((s,), -1, jnp.int32),
                   length=jnp.zeros((), jnp.int32), layouts=layouts(cfg))


def cache_spec(cfg: ModelConfig, batch_size: int, max_seq_len: int) -> KVCache:
    """The cache as ``jax.ShapeDtypeStruct``s: compile against it without allocating."""
    return jax.eval_shape(lambda: init_cache(cfg, batch_size, max_seq_len))


def cache_bytes(cache: KVCache) -> int:
    """Bytes of the cached per-token tensors, summed over the pytree (the blog's KV bytes).

    The bookkeeping arrays (``positions``, ``length``: 4·S + 4 bytes) are excluded; use
    :func:`total_bytes` for everything.
    """
    return total_bytes(cache.tensors)


def total_bytes(tree) -> int:
    """Bytes of every array leaf of a pytree (arrays or ShapeDtypeStructs)."""
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def write(buf: jax.Array, new: jax.Array, chunk_positions: jax.Array, length: jax.Array,
          cfg: ModelConfig, layer=None, axis: int = -2) -> jax.Array:
    """Writes a chunk of T tokens into a cached tensor, in place.

    Args:
      buf: [..., S, X] (``axis`` -2) or [..., X, S] (``axis`` -1): one layer's tensor, or
        the same with a leading L axis when ``layer`` is given.
      new: the chunk, laid out like one layer of ``buf`` with T in place of S.
      chunk_positions: [T] int32 consecutive absolute positions of the chunk.
      length: [] int32 tokens in the cache before the chunk (dense write offset).
      cfg: window_size / num_sink_tokens select the ring-buffer layout.
      layer: [] int32 layer index into a stacked ``buf`` (None: ``buf`` is one layer).
      axis: the slot axis, -2 or -1 (:func:`slot_axis`).
    Returns:
      The updated buffer. Dense: a dynamic-update-slice at ``length`` (callers check it
      fits; see ``model.forward``). Ring: a scatter to each token's slot that drops tokens
      a later token of the same chunk overwrites; out-of-range slots are dropped, never
      clamped.
    Raises:
      ValueError: ``axis`` not -2 or -1.
    """
    if axis not in (-2, -1):
        raise ValueError(f"axis={axis}; allowed: -2 or -1")
    new = new.astype(buf.dtype)
    buf_axis = buf.ndim + axis
    if cfg.window_size is None:
        start = [0] * buf.ndim
        start[buf_axis] = length
        if layer is not None:
            start[0] = layer
            new = new[None]
        return jax.lax.dynamic_update_slice(buf, new, start)
    slots = ring_slots(chunk_positions, cfg, buf.shape[buf_axis])
    if layer is None:  # one advanced index: its axis stays in place
        return buf.at[(slice(None),) * buf_axis + (slots,)].set(new, mode="drop")
    # Two advanced indices (layer, slots) split by slices: numpy puts their axis first.
    index = (layer,) + (slice(None),) * (buf_axis - 1) + (slots,)
    return buf.at[index].set(jnp.moveaxis(new, new.ndim + axis, 0), mode="drop")


def ring_slots(chunk_positions: jax.Array, cfg: ModelConfig, num_slots_: int) -> jax.Array:
    """[T] int32 ring slot of each chunk token, or ``num_slots_`` (dropped) for a token that
    a later token of the same chunk overwrites (only the last W - s ring tokens survive;
    sink tokens always do)."""
    slots = slot_of(chunk_positions, cfg, num_slots_)
    ring = num_slots_ - cfg.num_sink_tokens
    keep = ((chunk_positions < cfg.num_sink_tokens)
            | (chunk_positions > chunk_positions[-1] - ring))
    return jnp.where(keep, slots, num_slots_)


def next_positions(cache: KVCache, chunk_positions: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[S] int32 slot positions after writing a chunk at ``chunk_positions`` [T]."""
    if cfg.window_size is None:
        return jax.lax.dynamic_update_slice(cache.positions, chunk_positions, (cache.length,))
    slots = ring_slots(chunk_positions, cfg, cache.num_slots)
    return cache.positions.at[slots].set(chunk_positions, mode="drop")


def slot_of(position: jax.Array, cfg: ModelConfig, num_slots_: int) -> jax.Array:
    """Slot index for absolute ``position`` (int32 array of any shape).

    Dense: p. Windowed with W slots and s sinks: p if p < s else s + (p - s) mod (W - s).
    """
    if cfg.window_size is None:
        return position
    s = cfg.num_sink_tokens
    ring = num_slots_ - s
    return jnp.where(position < s, position, s + (position - s) % ring)


def attention_mask(q_positions: jax.Array, k_positions: jax.Array,
                   cfg: ModelConfig) -> jax.Array:
    """Which keys each query may attend to, from absolute positions only.

    Args:
      q_positions: [B, T] int32 query positions.
      k_positions: [S] or [B, S] int32 key positions (-1: empty slot).
      cfg: supplies window_size W and num_sink_tokens s.
    Returns:
      [B, T, S] bool: key is filled, causal (k <= q) and, with a window, inside the last
      W - s positions or one of the s sinks (Xiao et al. 2023). Without sinks the window
      is the last W positions (q - k < W).
    """
    q = q_positions[:, :, None]
    k = k_positions[None, None, :] if k_positions.ndim == 1 else k_positions[:, None, :]
    mask = (k >= 0) & (k <= q)
    if cfg.window_size is not None:
        s = cfg.num_sink_tokens
        mask &= (q - k < cfg.window_size - s) | (k < s)
    return mask
