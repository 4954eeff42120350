"""Sequence-sharded attention over a cache split along 'seq' (flash-decoding across devices).

When the context mesh (``jax.set_mesh``) has a 'seq' axis of size > 1, the cache's slot
axis S is split over it. Each device scores its own S / seq slots and keeps the partial
softmax statistics of its slots, per query: m (max score), l (sum of exp(s - m)) and
o (sum of exp(s - m)·v, unnormalised). They are combined across 'seq' by

    M = pmax(m);  l' = psum(l·exp(m - M));  o' = psum(o·exp(m - M))

(two all-reduces of [B, T, N, 1] and one of [B, T, N, Hv] per layer: the cache itself
never moves), then merged with the chunk's own keys (replicated over 'seq') the same way
and normalised, out = o / l. The combine is written with ``jax.shard_map`` manual over
'seq' only; 'data' and 'model' stay automatic (GSPMD). Without such a mesh the callers
use their single-device paths unchanged.

Scores, statistics and the value product are float32, as in ``attention.attend``; a
query that sees no key gets zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

SEQ = "seq"
NEG_INF = -1e30


def axis_size(name: str) -> int:
    """Size of the context mesh's axis ``name`` (``jax.set_mesh``; 1 when no mesh is set
    or it has no such axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[name])


def seq_shards() -> int:
    """Size of the context mesh's 'seq' axis (1 when no mesh is set or it has none)."""
    return axis_size(SEQ)


def _stats(scores: jax.Array, visible: jax.Array):
    """(m, e, l): max [.., 1], masked exp(s - m) [.., S], sum [.., 1] of float32 scores."""
    s = jnp.where(visible, scores, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - m), 0.0)
    return m, e, jnp.sum(e, axis=-1, keepdims=True)


def merge(a: tuple, b: tuple) -> tuple:
    """Merges two partial softmax states (m, l, o) over disjoint key sets."""
    (ma, la, oa), (mb, lb, ob) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, oa * ca + ob * cb


def finish(state: tuple) -> jax.Array:
    """o / l, zeros where no key was visible (l = 0)."""
    _, l, o = state
    return o / jnp.where(l > 0, l, 1.0)


def over_seq(local_stats, sharded: tuple, replicated: tuple) -> tuple:
    """Partial softmax state over the slots of every 'seq' shard, combined across 'seq'.

    Args:
      local_stats: fn(*sharded_local, *replicated) -> (m, l, o), the state of one
        shard's slots (m, l broadcastable against o).
      sharded: ((array, slot_axis), ...) arrays split along their slot axis over 'seq'.
      replicated: arrays every shard sees whole.
    Returns:
      (m, l, o), replicated over 'seq'.
    """
    def spec(x, axis):
        axes = [None] * x.ndim
        axes[axis % x.ndim] = SEQ
        return P(*axes)

    in_specs = tuple(spec(x, a) for x, a in sharded) + tuple(P() for _ in replicated)

    def body(*args):
        m, l, o = local_stats(*args)
        mg = jax.lax.pmax(m, SEQ)
        c = jnp.exp(m - mg)
        return mg, jax.lax.psum(l * c, SEQ), jax.lax.psum(o * c, SEQ)

    args = [x for x, _ in sharded] + list(replicated)
    if SEQ in jax.sharding.get_abstract_mesh().manual_axes:
        # already inside a shard_map manual over 'seq' (e.g. jax.experimental.roofline's
        # per-device trace): the arrays are this device's shards
        return body(*args)
    fn = jax.shard_map(body, in_specs=in_specs, out_specs=(P(), P(), P()),
                       axis_names=frozenset({SEQ}))
    return fn(*args)


def attend_cached(q, k_old, v_old, mask_old, k_new, v_new, mask_new, k_layout: str,
                  v_layout: str, backend: str | None = None) -> jax.Array:
    """GQA attention of a chunk over (sequence-sharded old slots ++ its own entries).

    Args:
      q: [B, T, K, G, H] rotated queries (T = 1 in decode, the prompt in prefill).
      k_old, v_old: one layer's cache before the write, slot axis split over 'seq'
        ([B, K, S, H] 'BKSH' or [B, K, H, S] 'BKHS').
      mask_old: [B, T, S] bool, visible old slots (split over 'seq' like S).
      k_new, v_new: the chunk's entries [B, K, T, H] in the same layouts.
      mask_new: [B, T, T] bool, visible chunk keys.
    Returns:
      [B, T, K, G, Hv] in v_old's dtype, equal to ``attention.attend`` over the
      concatenation (float32 statistics; up to summation order).
    """
    from kvjax.models.attention import _spec, dot_operand  # noqa: PLC0415 (cycle)

    scale = q.shape[-1] ** -0.5

    def local(k, v, mask, q):
        qo, ko, vo = (dot_operand(x, backend) for x in (q, k, v))
        if q.shape[1] == 1:
            # decode (T = 1): the single-device step's products (attention.attend_step)
            # without the T axis. With it ('BTKGH,BKHS->BKGTS'), XLA on CPU transposed
            # each 'BKHS' key shard into a copy before the dot: the shard read, written
            # and read again (a seq-sharded step read 1.3-1.8x theory per device).
            s = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", qo[:, 0], ko,
                           preferred_element_type=jnp.float32)[:, :, :, None, :] * scale
        else:
            s = jnp.einsum(f"BTKGH,{_spec(k_layout)}->BKGTS", qo, ko,
                           preferred_element_type=jnp.float32) * scale
        m, e, l = _stats(s, mask[:, None, None, :, :])
        if q.shape[1] == 1:
            o = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", e[:, :, :, 0], vo,
                           preferred_element_type=jnp.float32)[:, None]
        else:
            o = jnp.einsum(f"BKGTS,{_spec(v_layout, 'V')}->BTKGV", e, vo,
                           preferred_element_type=jnp.float32)
        to_o = lambda x: jnp.transpose(x, (0, 3, 1, 2, 4))  # [B,K,G,T,1] -> [B,T,K,G,1]
        return to_o(m), to_o(l), o

    ax = lambda layout: -1 if layout == "BKHS" else -2
    old = over_seq(local, ((k_old, ax(k_layout)), (v_old, ax(v_layout)), (mask_old, -1)),
                   (q,))
    new = local(k_new, v_new, mask_new, q)
    return finish(merge(old, new)).astype(v_old.dtype)


def attend_mla_cached(q_main, q_rope, c_old, kr_old, mask_old, c_new, kr_new, mask_new,
                      w_uk, w_uv, absorb: bool, scale: float) -> jax.Array:
    """MLA attention of a chunk over (sequence-sharded latent slots ++ its own latents).

    Args: as ``mla.attend_mla`` with the cache split: c_old [B, S, C] and kr_old [B, S, R]
      split over 'seq' along S, mask_old [B, T, S]; c_new [B, T, C], kr_new [B, T, R],
      mask_new [B, T, T].
    Returns:
      float32 [B, T, N, C] (absorbed) or [B, T, N, V] (naive), as ``mla.attend_mla``.
    """
    from kvjax.models.mla import _mix, _scores  # noqa: PLC0415 (cycle)

    def local(c, kr, mask, q_main, q_rope, w_uk, w_uv):
        s = _scores(q_main, q_rope, c, kr, w_uk, absorb) * scale  # [B, N, T, S]
        m, e, l = _stats(s, mask[:, None])
        o = _mix(e, c, w_uv, absorb)  # [B, T, N, X]
        to_o = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, T, 1] -> [B, T, N, 1]
        return to_o(m), to_o(l), o

    rep = (q_main, q_rope, w_uk, w_uv)
    old = over_seq(local, ((c_old, -2), (kr_old, -2), (mask_old, -1)), rep)
    new = local(c_new, kr_new, mask_new, *rep)
    return finish(merge(old, new))


def write(policy, buf: jax.Array, new: jax.Array, chunk_positions: jax.Array, axis: int,
          layer=None, ragged: bool = False) -> jax.Array:
    """A chunk written into a cache tensor whose slot axis is split over 'seq', by the
    devices that own the slots: no cache shard moves.

    Each 'seq' shard holds slots [i·S/n, (i+1)·S/n) of the S slots. Inside a
    ``jax.shard_map`` manual over 'seq' (so 'data' and 'model' stay automatic), device i
    takes the chunk's global slots from ``policy.write_slots`` (a ring's or a dense
    cache's; S where the write drops a token), keeps those in its own range as local
    indices and scatters them into its shard with ``mode='drop'``; the others go to the
    out-of-range index S/n and are dropped. A global write (``dynamic_update_slice`` or
    scatter on the whole [.., S, ..] array) made GSPMD all-gather every cache tensor of a
    seq-sharded prefill (a ``[B, K, S, H]`` gather per layer and tensor).

    Args:
      policy: the slot policy (:func:`kvjax.cache.policy.policy_for`).
      buf: one layer's tensor [B, ..., S, X] (``axis`` -2) or [B, ..., X, S] (``axis``
        -1), with a leading L axis when ``layer`` is given; any dtype (codes, float32
        scales, int32 positions).
      new: the chunk, laid out like one layer of ``buf`` with T in place of S
        (replicated over 'seq').
      chunk_positions: [B, T] int32 absolute positions (-1: padded, never written).
      axis: the slot axis, -2 or -1.
      layer: [] int32 layer index into a stacked ``buf``, or None.
      ragged: rows at their own positions (a per-row scatter); False: every row writes at
        row 0's slots.
    Returns:
      ``buf`` updated, with its sharding; equal to ``policy.write`` on one device.
    """
    from kvjax.cache import policy as policy_lib  # noqa: PLC0415 (cycle)

    slot_axis = buf.ndim + axis
    mesh = jax.sharding.get_abstract_mesh()
    manual = SEQ in mesh.manual_axes  # e.g. jax.experimental.roofline's per-device trace
    num_slots = buf.shape[slot_axis] * (mesh.shape[SEQ] if manual else 1)  # global S

    def body(buf, new, chunk_positions, *layer):
        layer = layer[0] if layer else None
        local_s = buf.shape[slot_axis]
        first = jax.lax.axis_index(SEQ) * local_s
        slots = policy.write_slots(chunk_positions, num_slots) - first
        slots = jnp.where((slots >= 0) & (slots < local_s), slots, local_s)
        if ragged:
            return policy_lib.write_rows(buf, new, slots, axis, layer, "drop")
        return policy_lib.write_shared(buf, new, slots[0], axis, layer)

    args = (buf, new, chunk_positions) + (() if layer is None else (layer,))
    if manual:  # already inside a shard_map manual over 'seq': ``buf`` is the shard
        return body(*args)
    axes = [None] * buf.ndim
    axes[slot_axis] = SEQ
    fn = jax.shard_map(body, in_specs=(P(*axes),) + (P(),) * (len(args) - 1),
                       out_specs=P(*axes), axis_names=frozenset({SEQ}))
    return fn(*args)


def per_device(fn, *args, head_axes: tuple, out_head_axis: int):
    """``fn(*args)`` run on each device's own batch rows and KV heads, inside a
    ``jax.shard_map`` manual over the context mesh's 'data' and 'model' axes (those of
    size > 1; 'seq' stays automatic).

    For a function XLA cannot partition (a custom call such as the native prompt-attention
    kernel, which is independent per batch row and KV head): left to GSPMD, it
    all-gathers its operands to every device first (q/k/v whole on every device, 91
    all-gathers and 4.5 MB per SmolLM2 prefill on a 3-way 'model' mesh).

    Args:
      fn: the function; its output has the first arg's rank, its batch axis is 0 and
        its KV-head axis is ``out_head_axis``.
      args: arrays with the batch axis 0, or None (passed through).
      head_axes: per arg, the KV-head axis or None (no head axis: split by batch only).
      out_head_axis: the KV-head axis of ``fn``'s output.
    Returns:
      ``fn(*args)`` with the output split as the inputs were. Without a mesh (or with
      'data' and 'model' of size 1), ``fn(*args)`` as is.

    The caller guarantees 'model' divides the KV heads (:func:`kvjax.parallel.mesh.check`
    refuses the native prefill when it does not).
    """
    mesh = jax.sharding.get_abstract_mesh()
    manual = [a for a in ("data", "model") if not mesh.empty and a in mesh.axis_names
              and mesh.shape[a] > 1 and a not in mesh.manual_axes]
    if not manual:
        return fn(*args)
    d = "data" if "data" in manual else None
    m = "model" if "model" in manual else None

    def spec(x, head):
        axes = [None] * x.ndim
        axes[0] = d
        if head is not None:
            axes[head] = m
        return P(*axes)

    live = [i for i, x in enumerate(args) if x is not None]
    in_specs = tuple(spec(args[i], head_axes[i]) for i in live)
    out_axes = [None] * args[0].ndim
    out_axes[0], out_axes[out_head_axis] = d, m

    def body(*xs):
        full = list(args)
        for i, x in zip(live, xs):
            full[i] = x
        return fn(*full)

    return jax.shard_map(body, in_specs=in_specs, out_specs=P(*out_axes),
                         axis_names=frozenset(manual))(*(args[i] for i in live))
