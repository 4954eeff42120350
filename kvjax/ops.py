"""Pure array functions shared by the cache and the attention variants, in one home.

* :data:`NEG_INF`, the score of a masked key;
* :func:`lane_sum`, a decode step's sum over a short last axis in as few thunks as XLA:CPU
  allows (RMSNorm's mean square, the new token's own score);
* :func:`layout_spec`, the einsum letters of a cache tensor in its layout;
* online-softmax partial states (m, l, o) over disjoint key sets: :func:`softmax_stats`,
  :func:`merge`, :func:`finish` (Milakov & Gimelshein 2018, "Online normalizer
  calculation for softmax"; flash-decoding combines per-split states the same way);
* the sharded pieces, which take their mesh axes as arguments (from the plan,
  :class:`kvjax.plan.Plan`) and never look up an ambient mesh: :func:`combine_over`
  (the softmax combine across an axis that splits the slots) and :func:`per_device` (a
  function run on each device's own rows and heads).

Scores and statistics are float32; a query that sees no key gets zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvjax import backend as backend_lib

NEG_INF = -1e30
LAYOUTS = ("BKSH", "BKHS")


LANE_SUM = 32
"""Widest sum XLA:CPU keeps as one reduce: its tree-reduction rewrite turns a longer one
into a reduce-window and a reduce, two thunks that fuse with nothing."""

MAX_ADDS = 1 << 18
"""The most adds :func:`lane_sum` spends finishing its sums in every element (``like``'s
size times E / 32): a decode step's or a short chunk's, never a prompt's."""


def lane_sum(x: jax.Array, like: jax.Array) -> jax.Array:
    """sum(x, axis=-1) in float32, broadcast to ``like``'s shape, in few XLA:CPU thunks.

    A decode step's per-row sums (RMSNorm's mean square over D, the new token's score over
    H) are thunks that each run a few hundred FLOP: XLA:CPU splits a sum over more than
    :data:`LANE_SUM` elements into a reduce-window and a reduce, and hoists any function
    of the [..., 1] total (an rsqrt, an exp) above its broadcast into a thunk of its own.
    For a last axis that is a multiple of :data:`LANE_SUM` longer than it, where the
    finish costs at most :data:`MAX_ADDS` adds, ``x`` is summed in parts of 32 (one fusion with
    ``x``'s producer) and the parts' total is formed in every element of ``like`` (adding
    ``0 * like``, which changes no finite value, makes it depend on the element), so that
    whatever follows fuses with ``like``'s consumer: RMSNorm two thunks instead of four
    (docs/decisions/0036-row-sums-in-parts.md). The per-element total costs E / 32 adds
    an element; above :data:`MAX_ADDS` (a prompt's many rows) it is the plain sum.

    Args:
      x: [..., E] (any float dtype; summed in float32).
      like: [..., F] with leading axes ``x``'s leading axes broadcast to (e.g. the
        normalised activations, or an attention output [B, K, G, V] for scores [B, K, G, H]).
    Returns:
      [..., F] float32: each row's sum, the same in every element of the row.
    """
    x = x.astype(jnp.float32)
    e = x.shape[-1]
    if e <= LANE_SUM or e % LANE_SUM or like.size * (e // LANE_SUM) > MAX_ADDS:
        return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), like.shape)
    parts = jnp.sum(x.reshape(x.shape[:-1] + (e // LANE_SUM, LANE_SUM)), axis=-1)
    total = parts[..., :1] + 0.0 * like.astype(jnp.float32)
    for i in range(1, e // LANE_SUM):
        total = total + parts[..., i:i + 1]
    return total


def dot_operand(x: jax.Array, backend: str) -> jax.Array:
    """``x`` as a dot operand with a float32 result: 2-byte floats are widened to float32
    first (exact) where :func:`kvjax.backend.widen_dot_operands` says so for the
    config's ``backend`` (CPU)."""
    if x.dtype in (jnp.bfloat16, jnp.float16) and backend_lib.widen_dot_operands(backend):
        return x.astype(jnp.float32)
    return x


def weight_dtype(value_dtype, backend: str) -> jnp.dtype:
    """dtype of the softmax weights in a decode step's value product on ``backend``.

    float32 when the values are float32 or the backend widens them anyway (2-byte floats
    on CPU, :func:`dot_operand`): exact weights at no extra traffic. Elsewhere the cache
    dtype: a float32 weight operand would make XLA widen the whole cached operand for
    the dot, every step. Rounding the unnormalised weights (the largest exactly 1) with a
    denominator summed from the rounded weights keeps their sum at 1; each weight's
    ratio to the largest errs by up to 2^-9 in bf16.
    """
    if (jnp.dtype(value_dtype) in (jnp.bfloat16, jnp.float16)
            and not backend_lib.widen_dot_operands(backend)):
        return jnp.dtype(value_dtype)
    return jnp.dtype(jnp.float32)


def layout_spec(layout: str, width: str = "H") -> str:
    """einsum letters of one layer's keys/values in ``layout`` ('BKSH' -> 'BKSH',
    'BKHS' -> 'BKHS'; ``width`` replaces H, e.g. 'V' for values).

    Raises:
      ValueError: a layout other than 'BKSH' or 'BKHS'.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; allowed: 'BKSH' or 'BKHS'")
    return "BKS" + width if layout == "BKSH" else "BK" + width + "S"


def check_window(window_size, num_sink_tokens) -> None:
    """Raises ValueError unless ``window_size`` is None or a positive integer and
    ``num_sink_tokens`` is 0 without a window, else in [0, window_size)."""
    if window_size is not None and (isinstance(window_size, bool) or window_size <= 0):
        raise ValueError(f"window_size={window_size!r}; allowed: None or a positive integer")
    if num_sink_tokens < 0 or (num_sink_tokens and window_size is None) or (
            window_size is not None and num_sink_tokens >= window_size):
        raise ValueError(f"num_sink_tokens={num_sink_tokens!r}; allowed: 0 without a "
                         "window, else an integer in [0, window_size)")


def softmax_stats(scores: jax.Array, visible: jax.Array):
    """(m, e, l) of float32 ``scores`` [..., S] under ``visible`` (bool, broadcastable):
    m the max visible score [..., 1] (NEG_INF when none), e = exp(s - m) with masked
    keys exactly 0 [..., S], l = sum(e) [..., 1]."""
    s = jnp.where(visible, scores, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - m), 0.0)
    return m, e, jnp.sum(e, axis=-1, keepdims=True)


def zero_unseen(x: jax.Array, seen: jax.Array, slot_axis: int) -> jax.Array:
    """``x`` with the slots no query sees set to 0, so that they contribute exactly
    nothing to a value product whatever they hold (issue 32: a softmax weight of 0 times
    a NaN or inf value is NaN).

    Args:
      x: one layer's cached values (or MLA latents) with the batch axis 0 and the slot
        axis ``slot_axis``, e.g. [B, K, S, V], [B, K, V, S] or [B, S, C].
      seen: [B, S] bool, True where some query of the row sees the slot.
      slot_axis: the slot axis of ``x`` (negative counts from the end).
    Returns:
      ``x``'s shape and dtype. An integer ``x`` (int8 / int4 codes, always finite) is
      returned as is.

    One elementwise pass over ``x``: XLA:CPU does not fuse a select into the dot that
    reads it (jax 0.10.2; docs/decisions/0024-clear-masked-slots-once.md), so this costs
    a copy of ``x`` where no other pass (a dtype convert) exists to fuse into.
    """
    if jnp.issubdtype(x.dtype, jnp.integer):
        return x
    axis = slot_axis % x.ndim
    shape = [1] * x.ndim
    shape[0], shape[axis] = seen.shape
    return jnp.where(seen.reshape(shape), x, jnp.zeros((), x.dtype))


def merge(a: tuple, b: tuple) -> tuple:
    """Merges two partial softmax states (m, l, o) over disjoint key sets:
    m = max(m_a, m_b), l = l_a·e^(m_a - m) + l_b·e^(m_b - m), o likewise."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, oa * ca + ob * cb


def finish(state: tuple) -> jax.Array:
    """o / l of a partial state (m, l, o), zeros where no key was visible (l = 0)."""
    _, l, o = state
    return o / jnp.where(l > 0, l, 1.0)


def _axis_spec(x: jax.Array, axis: int, name: str) -> P:
    axes = [None] * x.ndim
    axes[axis % x.ndim] = name
    return P(*axes)


def combine_over(axis_name: str, manual: bool, local_stats, sharded: tuple,
                 replicated: tuple) -> tuple:
    """Partial softmax state over the slots of every shard of ``axis_name``, combined:
    M = pmax(m), l' = psum(l·e^(m - M)), o' = psum(o·e^(m - M)) (two all-reduces of
    the statistics and one of o per call; the slots never move).

    Args:
      axis_name: the mesh axis that splits the slots (:data:`kvjax.plan.SEQ`).
      manual: the axis is already manual (inside a ``shard_map`` over it): the arrays
        are this device's shards and the body runs as is.
      local_stats: fn(*sharded_local, *replicated) -> (m, l, o) of one shard's slots.
      sharded: ((array, slot_axis), ...) arrays split along their slot axis.
      replicated: arrays every shard sees whole.
    Returns:
      (m, l, o), replicated over ``axis_name``.
    """
    def body(*args):
        m, l, o = local_stats(*args)
        mg = jax.lax.pmax(m, axis_name)
        c = jnp.exp(m - mg)
        return mg, jax.lax.psum(l * c, axis_name), jax.lax.psum(o * c, axis_name)

    args = [x for x, _ in sharded] + list(replicated)
    if manual:
        return body(*args)
    in_specs = (tuple(_axis_spec(x, a, axis_name) for x, a in sharded)
                + tuple(P() for _ in replicated))
    return jax.shard_map(body, in_specs=in_specs, out_specs=(P(), P(), P()),
                         axis_names=frozenset({axis_name}))(*args)


def per_device(fn, *args, head_axes: tuple, out_head_axis: int,
               data_axis: str | None, model_axis: str | None):
    """``fn(*args)`` run on each device's own batch rows and KV heads, inside a
    ``jax.shard_map`` manual over ``data_axis`` (rows) and ``model_axis`` (KV heads);
    other axes stay automatic.

    For a function XLA cannot partition (a custom call such as the native prompt-attention
    kernel, independent per batch row and KV head): left to GSPMD, its operands would be
    all-gathered to every device first.

    Args:
      fn: the function; its output has the first arg's rank, batch axis 0 and KV-head
        axis ``out_head_axis``.
      args: arrays with the batch axis 0, or None (passed through).
      head_axes: per arg, the KV-head axis or None (split by batch only).
      out_head_axis: the KV-head axis of ``fn``'s output.
      data_axis, model_axis: the mesh axes to split over, or None (not split; both None:
        ``fn(*args)`` as is). The caller guarantees ``model_axis`` divides the KV heads.
    """
    if data_axis is None and model_axis is None:
        return fn(*args)

    def spec(x, head):
        axes = [None] * x.ndim
        axes[0] = data_axis
        if head is not None:
            axes[head] = model_axis
        return P(*axes)

    live = [i for i, x in enumerate(args) if x is not None]
    in_specs = tuple(spec(args[i], head_axes[i]) for i in live)
    out_axes = [None] * args[0].ndim
    out_axes[0], out_axes[out_head_axis] = data_axis, model_axis

    def body(*xs):
        full = list(args)
        for i, x in zip(live, xs):
            full[i] = x
        return fn(*full)

    names = frozenset(a for a in (data_axis, model_axis) if a is not None)
    return jax.shard_map(body, in_specs=in_specs, out_specs=P(*out_axes),
                         axis_names=names)(*(args[i] for i in live))
