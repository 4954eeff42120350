"""Slot policies: which cache slot holds which token, and which keys a query sees.

A cache policy owns everything that depends on the cache *kind* (docs/DESIGN.md, "The
cache contract"): the slot count for a given ``max_seq_len``, the slot of an absolute
position, which tokens of a chunk survive the write, whether a chunk fits, how many
tokens a row holds, how long the generate loop's token buffer must be, and the attention
mask. No other module branches on ``window_size`` for cache mechanics; they ask
:func:`policy_for`.

* :class:`DenseSlots`: full attention; position p lives in slot p, S = max_seq_len.
* :class:`RingSlots`: a sliding window of W slots (lever 3 of the blog) with s attention
  sinks (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
  p < s lives in slot p, p >= s in slot s + (p - s) mod (W - s). A query at q sees the
  sinks and the last W - s positions (q - k < W - s); without sinks, the last W.
* :class:`DenseWindowSlots` (``window_cache='dense'``): the same window as a mask over
  dense slots (position p in slot p, S = max_seq_len): what a draft that reads the
  target's own cache in place attends to (:mod:`kvjax.inference.speculative`). Only a
  formulation that skips masked slots reads fewer than S of them
  (:data:`kvjax.models.decode_kernels.IN_PLACE`).

A paged policy (block tables) would be a third class with the same methods.

All array methods are traceable (jnp); ``check_room`` and ``buffer_len`` run on the host.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def written_tokens(prompt_tokens: int, max_new_tokens: int) -> int:
    """Tokens a generation writes into the cache: the prompt, then every new token but
    the last (each step writes the token before the one it samples; the last one sampled
    is never written). The one length rule of every decoding path (the main job, the
    ragged loop, the slot engine): a run fits when this many tokens fit."""
    return int(prompt_tokens) + max(int(max_new_tokens) - 1, 0)


class CacheOverflowError(ValueError):
    """A prefill or generation would write past the end of a dense cache."""


@dataclasses.dataclass(frozen=True)
class DenseSlots:
    """Full attention: one slot per position, S = max_seq_len."""

    kind = "dense"
    # Every slot a write names exists unless the row overflows, and an overflowing row's
    # logits are poisoned (``overflows``), so the scatter may assume in-bounds indices
    # (XLA then updates in place without reading the old slot).
    write_mode = "promise_in_bounds"

    def num_slots(self, max_seq_len: int) -> int:
        """S for a cache of ``max_seq_len`` tokens."""
        return max_seq_len

    def slot_of(self, position: jax.Array, num_slots: int) -> jax.Array:
        """Slot of absolute ``position`` (int32, any shape): the position itself."""
        del num_slots
        return position

    def write_slots(self, chunk_positions: jax.Array, num_slots: int) -> jax.Array:
        """[..., T] int32 slot of each chunk token; ``num_slots`` (out of range: the write
        drops it) past the end or for a padded token (position -1, see
        :func:`kvjax.models.model.forward`'s ``num_valid``). Never clamped: ``overflows``
        poisons such a step."""
        return jnp.where((chunk_positions >= 0) & (chunk_positions < num_slots),
                         chunk_positions, num_slots)

    def write(self, buf: jax.Array, new: jax.Array, chunk_positions: jax.Array, axis: int,
              layer=None, ragged: bool = False) -> jax.Array:
        """Writes ``new`` (see :func:`write_rows`) at each row's positions. Lockstep rows
        (``ragged`` False: every row at the same positions) take one in-place
        dynamic-update-slice at row 0's first position, whose cost is the update alone;
        ragged rows a per-row scatter."""
        if ragged:
            return write_rows(buf, new, self.write_slots(chunk_positions, buf.shape[axis]),
                              axis, layer, self.write_mode)
        start = [0] * buf.ndim
        start[buf.ndim + axis] = chunk_positions[0, 0]
        if layer is not None:
            start[0] = layer
            new = new[None]
        return jax.lax.dynamic_update_slice(buf, new.astype(buf.dtype), start)

    def overflows(self, length: jax.Array, new_tokens: int, num_slots: int) -> jax.Array:
        """[B] bool: the chunk would run past the last slot."""
        return length + new_tokens > num_slots

    def held(self, length: jax.Array, num_slots: int) -> jax.Array:
        """[B] int32 tokens a row's next query sees (``length`` cached + its own), at most
        ``num_slots``."""
        return jnp.minimum(length + 1, num_slots)

    def visible(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        """[B, T, S] bool from q_positions [B, T] and k_positions [S] or [B, S]: key slot
        filled (k >= 0) and causal (k <= q)."""
        q, k = _broadcast(q_positions, k_positions)
        return (k >= 0) & (k <= q)

    def check_room(self, lengths, new_tokens: int, num_slots: int, what: str) -> None:
        """Raises CacheOverflowError unless every row has room for ``new_tokens`` more.

        ``lengths``: tokens already cached per row (host ints or a [B] array).
        """
        lengths = np.atleast_1d(np.asarray(lengths))
        worst = int(lengths.argmax())
        length = int(lengths[worst])
        if length + new_tokens > num_slots:
            row = f" (row {worst})" if lengths.size > 1 else ""
            raise CacheOverflowError(
                f"{what}: {new_tokens} tokens after {length} cached ones{row} need "
                f"{length + new_tokens} slots but the cache holds max_seq_len={num_slots}; "
                f"allowed: at most {num_slots - length} more tokens (raise max_seq_len)")

    def buffer_len(self, num_slots: int, num_steps: int) -> int:
        """Token buffer of the generate loop: no more than ``num_slots`` steps fit."""
        del num_steps
        return num_slots


@dataclasses.dataclass(frozen=True)
class RingSlots:
    """A window of W = ``window_size`` slots, the first ``num_sink_tokens`` of them sinks."""

    window_size: int
    num_sink_tokens: int = 0
    # False for a compressed cache (kept slots + recent_slots): compress builds its W
    # slots whatever max_seq_len is; a window's ring is never larger than the run
    within_max_seq_len: bool = True
    kind = "ring"
    # Tokens a later token of the same chunk overwrites get slot S and must be dropped.
    write_mode = "drop"

    def num_slots(self, max_seq_len: int) -> int:
        """S = min(W, ``max_seq_len``): constant in t, and never more slots than a run of
        ``max_seq_len`` tokens can fill (a smaller ring is a dense cache that fills); W
        for a compressed cache (``within_max_seq_len`` False)."""
        return min(self.window_size, max_seq_len) if self.within_max_seq_len \
            else self.window_size

    def slot_of(self, position: jax.Array, num_slots: int) -> jax.Array:
        """p if p < s else s + (p - s) mod (S - s)."""
        s = self.num_sink_tokens
        return jnp.where(position < s, position, s + (position - s) % (num_slots - s))

    def write_slots(self, chunk_positions: jax.Array, num_slots: int) -> jax.Array:
        """[..., T] int32 ring slot of each chunk token, or ``num_slots`` (dropped) for a
        token that a later token of the same chunk overwrites: only the last S - s ring
        tokens of a chunk survive; sink tokens always do. ``chunk_positions`` are
        consecutive along the last axis, except padded tokens (position -1, after a
        row's real ones), which are never written: the last real token decides what
        survives."""
        slots = self.slot_of(chunk_positions, num_slots)
        ring = num_slots - self.num_sink_tokens
        last = jnp.max(chunk_positions, axis=-1, keepdims=True)
        keep = (chunk_positions >= 0) & ((chunk_positions < self.num_sink_tokens)
                                         | (chunk_positions > last - ring))
        return jnp.where(keep, slots, num_slots)

    def write(self, buf: jax.Array, new: jax.Array, chunk_positions: jax.Array, axis: int,
              layer=None, ragged: bool = False) -> jax.Array:
        """Writes ``new`` (see :func:`write_rows`) to each row's ring slots. Lockstep rows
        share row 0's slots (one scatter along the slot axis); ragged rows scatter each
        to its own. Dropped tokens (overwritten within the chunk) are never written."""
        slots = self.write_slots(chunk_positions, buf.shape[axis])
        if ragged:
            return write_rows(buf, new, slots, axis, layer, self.write_mode)
        return write_shared(buf, new, slots[0], axis, layer)

    def overflows(self, length: jax.Array, new_tokens: int, num_slots: int) -> jax.Array:
        """A ring of at least W slots never fills; one of S < W slots (``max_seq_len``
        below the window) holds every token, so it fills as a dense cache does."""
        if num_slots >= self.window_size:
            return jnp.zeros(jnp.shape(length), bool)
        return DenseSlots().overflows(length, new_tokens, num_slots)

    def held(self, length: jax.Array, num_slots: int) -> jax.Array:
        """[B] int32 tokens a row's next query sees: at most W (blog "Lever 3"), whatever
        slots the cache has beyond them (a ring's spare slots, a paged row's view)."""
        return jnp.minimum(length + 1, min(num_slots, self.window_size))

    def visible(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        """[B, T, S] bool: filled, causal and inside the window or a sink."""
        q, k = _broadcast(q_positions, k_positions)
        s = self.num_sink_tokens
        return (k >= 0) & (k <= q) & ((q - k < self.window_size - s) | (k < s))

    def check_room(self, lengths, new_tokens: int, num_slots: int, what: str) -> None:
        """A ring of at least W slots never fills: any length fits. One of S < W slots
        is checked as :meth:`DenseSlots.check_room`."""
        if num_slots < self.window_size:
            DenseSlots().check_room(lengths, new_tokens, num_slots, what)

    def buffer_len(self, num_slots: int, num_steps: int) -> int:
        """A ring never fills, so the generate loop's buffer must hold the steps: the next
        power of two >= ``num_steps`` (at least ``num_slots``), so few lengths compile."""
        return max(num_slots, 1 << max(0, int(num_steps) - 1).bit_length())


def write_shared(buf: jax.Array, new: jax.Array, slots: jax.Array, axis: int,
                 layer=None) -> jax.Array:
    """Scatters every row's chunk to the same slots (lockstep rows), dropping slot S.

    Args: ``buf`` and ``new`` as :func:`write_rows`; slots: [T] int32 slot per token.
    """
    new = new.astype(buf.dtype)
    buf_axis = buf.ndim + axis
    if layer is None:  # one advanced index: its axis stays in place
        return buf.at[(slice(None),) * buf_axis + (slots,)].set(new, mode="drop")
    # Two advanced indices (layer, slots) split by slices: numpy puts their axis first.
    index = (layer,) + (slice(None),) * (buf_axis - 1) + (slots,)
    return buf.at[index].set(jnp.moveaxis(new, new.ndim + axis, 0), mode="drop")


def write_rows(buf: jax.Array, new: jax.Array, slots: jax.Array, axis: int, layer=None,
               mode: str = "drop") -> jax.Array:
    """Scatters each row's chunk to its own slots.

    Args:
      buf: [B, ..., S, X] (``axis`` -2) or [B, ..., X, S] (``axis`` -1), with a leading L
        axis when ``layer`` (a [] int32 index) is given.
      new: laid out like one layer of ``buf`` with T in place of S.
      slots: [B, T] int32 slot per row and token (S: dropped with ``mode='drop'``).
    """
    b = new.shape[0]
    layer_ndim = buf.ndim - (layer is not None)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    index = [slice(None)] * layer_ndim
    index[0], index[layer_ndim + axis] = rows, slots
    if layer is not None:
        index = [layer] + index
    # The advanced indices (layer, rows, slots) broadcast to [B, T]; the update is
    # [B, T, rest...] whether a slice separates them (numpy puts them first) or not.
    value = jnp.moveaxis(new.astype(buf.dtype), new.ndim + axis, 1)
    return buf.at[tuple(index)].set(value, mode=mode)


@dataclasses.dataclass(frozen=True)
class DenseWindowSlots(DenseSlots):
    """A window of W with s sinks (as :class:`RingSlots` shows it) over dense slots:
    slots, writes and room as :class:`DenseSlots`, the mask and the tokens seen as the
    ring's."""

    window_size: int
    num_sink_tokens: int = 0
    kind = "dense_window"

    def held(self, length: jax.Array, num_slots: int) -> jax.Array:
        """[B] int32 tokens a row's next query sees: at most W (:meth:`RingSlots.held`)."""
        return self._ring().held(length, num_slots)

    def visible(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        """[B, T, S] bool: filled, causal and inside the window or a sink
        (:meth:`RingSlots.visible`)."""
        return self._ring().visible(q_positions, k_positions)

    def _ring(self) -> RingSlots:
        return RingSlots(self.window_size, self.num_sink_tokens)


def policy_for(cfg) -> DenseSlots | RingSlots | DenseWindowSlots:
    """The slot policy of a :class:`kvjax.config.ModelConfig` (window_size, sinks,
    window_cache; a compressed cache, ``kv_compression``: a ring whose first kv_budget
    slots, the kept ones, are pinned like sinks, :mod:`kvjax.cache.compress`; with
    per-layer budgets, ``cfg.layer_budgets``, the smallest layer's ring, whose
    ``positions`` the cache keeps: :func:`kvjax.cache.kv.layer_positions`)."""
    if cfg.kv_evicts:
        budgets = cfg.layer_budgets
        pinned = cfg.kv_budget if budgets is None else min(budgets)
        return RingSlots(pinned + cfg.compression.recent_slots, pinned,
                         within_max_seq_len=False)
    if cfg.window_size:
        if cfg.window_cache == "dense":
            return DenseWindowSlots(cfg.window_size, cfg.num_sink_tokens)
        return RingSlots(cfg.window_size, cfg.num_sink_tokens)
    return DenseSlots()


def _broadcast(q_positions: jax.Array, k_positions: jax.Array):
    q = q_positions[:, :, None]
    k = k_positions[None, None, :] if k_positions.ndim == 1 else k_positions[:, None, :]
    return q, k
