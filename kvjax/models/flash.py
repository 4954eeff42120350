"""Tiled prompt attention: an online softmax over blocks of queries and keys, so no more
than one tile of scores ever exists (FlashAttention, Dao et al. 2022, Algorithm 1; the
online softmax of Milakov & Gimelshein 2018).

Dense attention over a chunk of T prompt tokens materialises [T, S] scores per head
(the blog's FlashAttention section: Θ(T·d + T²) memory traffic). Here the T queries are
cut into blocks of ``block_q`` rows and the keys into blocks of ``block_k`` slots; one
``lax.scan`` visits the (query block, key block) pairs that can hold a visible key and
keeps, per query row, a running maximum m, a running sum l and an unnormalised output
acc (all float32):

    m' = max(m, rowmax(s));  p = exp(s - m');  l' = e^(m - m')·l + rowsum(p);
    acc' = e^(m - m')·acc + p·V;   out = acc / l   (after the last pair).

Two sources of keys are attended, in this order:

* ``old``: slots already in the cache (chunked prefill, or any T > 1 chunk after
  earlier tokens). Their positions are read from the cache, one per slot (a ring buffer
  is unsorted), so blocks are skipped at run time: a pair whose key block holds no key
  any query of the block may see (by the block's min/max positions) runs an empty
  branch of a ``lax.cond``. XLA's cost analysis counts a conditional at its costlier
  branch, so compiled figures of programs with an old part are an upper bound.
* the chunk itself: positions consecutive in every row (``model.forward`` requires it),
  so causal and window skipping is static: pairs above the diagonal, and pairs entirely
  outside the window (unless the key block may hold a sink), are never built.

Inside a tile, visibility comes from absolute positions exactly as
:func:`kvjax.cache.attention_mask`: key filled (k >= 0), causal (k <= q), and with a window
W and s sinks (q - k < W - s) | (k < s). Masked scores contribute exactly 0 (also in a
tile where every key is masked: no NaN). T and S need not be multiples of the blocks: the
last block's start is clamped back inside the array (no padding copy) and the rows/slots
it shares with the previous block are masked out of it.

On CPU this is plain XLA: the two dots of a tile and the elementwise update are separate
fused loops, so the tiles of scores still pass through memory (XLA:CPU does not fuse a
dot with its consumers); their size is O(block_q·block_k), independent of T.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import ops
from kvjax.models import decode_kernels
from kvjax.ops import LAYOUTS, NEG_INF, check_window
DEFAULT_BLOCK_Q = 256
DEFAULT_BLOCK_K = 256
_BIG = np.iinfo(np.int32).max


class KVSource(NamedTuple):
    """Keys and values of one source of slots, for :func:`tiled_attention`.

    Attributes:
      keys: score parts, each [B, Ki, S, Hi] ('BKSH') or [B, Ki, Hi, S] ('BKHS') with
        Ki = Kv (one key head per value head) or Ki = 1 (one key shared by all heads).
      key_layouts: the layout of each key part, 'BKSH' or 'BKHS'.
      values: [B, Kv, S, Hv] ('BKSH') or [B, Kv, Hv, S] ('BKHS').
      value_layout: 'BKSH' or 'BKHS'.
      positions: [B, S] int32 absolute position of every slot, -1 where empty.
    """

    keys: tuple
    key_layouts: tuple
    values: jax.Array
    value_layout: str
    positions: jax.Array

    @property
    def num_slots(self) -> int:
        return self.positions.shape[1]


def _slot_axis(x: jax.Array, layout: str) -> int:
    return x.ndim - 2 if layout == "BKSH" else x.ndim - 1


def _slots(x: jax.Array, layout: str, start, size: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, _slot_axis(x, layout))


def _score_part(q: jax.Array, k: jax.Array, layout: str, backend: str) -> jax.Array:
    """[B, Kv, Gv, Tq, Hi] x one key tile -> float32 scores [B, Kv, Gv, Tq, Sk]."""
    spec = "SH" if layout == "BKSH" else "HS"
    if k.shape[1] == q.shape[1]:
        eqn = f"BKGTH,BK{spec}->BKGTS"
    else:  # one key head shared by every query head
        eqn, k = f"BKGTH,B{spec}->BKGTS", k[:, 0]
    return jnp.einsum(eqn, ops.dot_operand(q, backend), ops.dot_operand(k, backend),
                      preferred_element_type=jnp.float32)


def _visible(q_pos, k_pos, window_size, num_sink_tokens):
    """[B, Tq], [B, Sk] int32 -> [B, Tq, Sk] bool (kvjax.cache.attention_mask's rule)."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    mask = (k >= 0) & (k <= q)
    if window_size is not None:
        mask &= (q - k < window_size - num_sink_tokens) | (k < num_sink_tokens)
    return mask


def _chunk_pairs(t: int, bq: int, bk: int, window_size, num_sink_tokens):
    """(query block, key block) pairs of a chunk against itself that can hold a visible
    key, given consecutive positions: on or below the diagonal and, with a window, not
    entirely older than W - s positions unless the key block may hold a sink (chunk
    index <= absolute position, so a block starting at index >= s holds none).

    Returns ([P, 2] int32 pairs every key of which every query sees, [P', 2] int32 the
    others, which need a mask). A block clamped back inside the chunk (the last one when
    T is not a multiple of the block) always needs one.
    """
    full, partial = [], []
    for i in range(-(-t // bq)):
        q_lo, q_hi = i * bq, min(t, (i + 1) * bq) - 1
        for j in range(-(-t // bk)):
            k_lo, k_hi = j * bk, min(t, (j + 1) * bk) - 1
            if k_lo > q_hi:
                continue
            if (window_size is not None and q_lo - k_hi >= window_size - num_sink_tokens
                    and k_lo >= num_sink_tokens):
                continue
            clamped = (i + 1) * bq > t or (j + 1) * bk > t
            inside = window_size is None or q_hi - k_lo < window_size - num_sink_tokens
            (full if k_hi <= q_lo and inside and not clamped else partial).append((i, j))
    as_array = lambda x: np.asarray(x, np.int32).reshape(-1, 2)  # noqa: E731
    return as_array(full), as_array(partial)


def _block_bounds(pos: jax.Array, block: int):
    """Per block of ``block`` slots of [B, S] positions: (min over filled slots or
    int32 max, max over filled slots or -1), each [B, ceil(S / block)]."""
    b, s = pos.shape
    n = -(-s // block)
    padded = jnp.pad(pos, ((0, 0), (0, n * block - s)), constant_values=-1)
    padded = padded.reshape(b, n, block)
    lo = jnp.min(jnp.where(padded >= 0, padded, _BIG), axis=-1)
    return lo, jnp.max(padded, axis=-1)


def _old_pairs(q_pos, old_pos, bq: int, bk: int, window_size, num_sink_tokens):
    """All (query block, old key block) pairs, [P, 2] int32, and [P] bool: may the pair
    hold a visible key (conservative, from per-block min/max positions, any row)."""
    t, s = q_pos.shape[1], old_pos.shape[1]
    nq, nk = -(-t // bq), -(-s // bk)
    q_lo, _ = _block_bounds(q_pos, bq)          # q positions are all >= 0
    _, q_hi = _block_bounds(q_pos, bq)
    k_lo, k_hi = _block_bounds(old_pos, bk)
    ql, qh = q_lo[:, :, None], q_hi[:, :, None]   # [B, nq, 1]
    kl, kh = k_lo[:, None, :], k_hi[:, None, :]   # [B, 1, nk]
    ok = (kh >= 0) & (kl <= qh)
    if window_size is not None:
        ok &= (ql - kh < window_size - num_sink_tokens) | (kl < num_sink_tokens)
    pairs = np.stack(np.meshgrid(np.arange(nq), np.arange(nk), indexing="ij"), -1)
    return pairs.reshape(-1, 2).astype(np.int32), jnp.any(ok, axis=0).reshape(-1)


def _validate(queries, q_positions, chunk: KVSource, old: KVSource | None, window_size,
              num_sink_tokens, block_q, block_k) -> None:
    for name, v in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name}={v!r}; allowed: a positive integer")
    check_window(window_size, num_sink_tokens)
    if not queries:
        raise ValueError("queries=(); allowed: one or more [B, Kv, Gv, T, H] parts")
    b, kv, gv, t = queries[0].shape[:4]
    if q_positions.shape != (b, t):
        raise ValueError(f"q_positions shape {q_positions.shape}; allowed: {(b, t)} "
                         "([B, T] of the queries)")
    for src_name, src in (("chunk", chunk), ("old", old)):
        if src is None:
            continue
        if len(src.keys) != len(queries) or len(src.key_layouts) != len(queries):
            raise ValueError(f"{src_name}: {len(src.keys)} key parts for "
                             f"{len(queries)} query parts; allowed: one per query part")
        s = src.num_slots
        if src.positions.shape[0] != b:
            raise ValueError(f"{src_name}.positions shape {src.positions.shape}; "
                             f"allowed: [B={b}, S]")
        for i, (q, k, lay) in enumerate(zip(queries, src.keys, src.key_layouts)):
            if lay not in LAYOUTS:
                raise ValueError(f"{src_name}.key_layouts[{i}]={lay!r}; allowed: {LAYOUTS}")
            want_k = (b, k.shape[1], s, q.shape[-1]) if lay == "BKSH" else \
                (b, k.shape[1], q.shape[-1], s)
            if q.shape[:4] != (b, kv, gv, t) or k.shape != want_k or \
                    k.shape[1] not in (1, kv):
                raise ValueError(
                    f"{src_name}: query part {i} shape {q.shape} and key part shape "
                    f"{k.shape} ({lay}); allowed: [B, Kv, Gv, T, H] with keys {want_k} "
                    f"and Ki in (1, Kv={kv})")
        if src.value_layout not in LAYOUTS:
            raise ValueError(f"{src_name}.value_layout={src.value_layout!r}; "
                             f"allowed: {LAYOUTS}")
        v = src.values
        if v.shape[:2] != (b, kv) or v.shape[_slot_axis(v, src.value_layout)] != s:
            raise ValueError(f"{src_name}.values shape {v.shape} ({src.value_layout}); "
                             f"allowed: [B={b}, Kv={kv}, S={s}, Hv] or its 'BKHS' form")


def tiled_attention(queries: Sequence[jax.Array], q_positions: jax.Array, chunk: KVSource,
                    old: KVSource | None = None, *, scale: float,
                    window_size: int | None = None, num_sink_tokens: int = 0,
                    block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    probs_dtype=None, backend: str | None = None) -> jax.Array:
    """Softmax attention of a chunk of queries over (old slots ++ the chunk), tiled.

    Args:
      queries: score parts, each [B, Kv, Gv, T, Hi]; the score of a query head against a
        key is ``scale`` x the sum over parts of q_i·k_i (MLA: latent and rotary parts).
        Query head (kv, g) reads value head kv.
      q_positions: [B, T] int32 absolute positions, consecutive in every row (the
        chunk's causal/window block skipping is static and relies on it).
      chunk: the chunk's own keys and values (S = T, positions = ``q_positions``).
      old: the cache's slots before the chunk, or None (an empty cache).
      scale: score scale (1/sqrt(head dim) for standard attention).
      window_size, num_sink_tokens: W and s of a sliding window with sinks; None, 0 for
        full causal attention.
      block_q, block_k: tile sizes in queries and in key slots (clipped to T and S).
      probs_dtype: the probabilities are cast to it before the value product (default:
        the values' dtype, as the dense ``attention.attend``); the product accumulates in
        float32.
      backend: the config's backend, whose dot-operand rule applies
        (:func:`kvjax.ops.dot_operand`); None: the process's (library calls).
    Returns:
      float32 [B, Kv, Gv, T, Hv]. Never NaN, also for tiles whose every score is
      masked (with valid positions every query sees at least itself).
    Raises:
      ValueError: a bad block size, window/sink, layout or shape (before any work).
    """
    queries = tuple(queries)
    backend = backend or backend_lib.current()
    _validate(queries, q_positions, chunk, old, window_size, num_sink_tokens, block_q,
              block_k)
    b, kv, gv, t = queries[0].shape[:4]
    hv = chunk.values.shape[-1 if chunk.value_layout == "BKSH" else -2]
    probs_dtype = chunk.values.dtype if probs_dtype is None else probs_dtype
    bq = min(block_q, t)
    q_positions = q_positions.astype(jnp.int32)
    # Scale the queries once (T·H elements) rather than every tile of scores (one pass
    # less over each tile); exact when the scale is a power of two (H = 64: 1/8).
    queries = tuple((q.astype(jnp.float32) * scale).astype(q.dtype) for q in queries)
    state = (jnp.full((b, kv, gv, t), NEG_INF, jnp.float32),
             jnp.zeros((b, kv, gv, t), jnp.float32),
             jnp.zeros((b, kv, gv, t, hv), jnp.float32))

    def make_body(src: KVSource, bk: int, masked: bool, conditional: bool):
        s = src.num_slots

        def tile(state, i, j):
            m, l, acc = state
            q0 = jnp.minimum(i * bq, t - bq)   # clamped starts: no padding copies
            k0 = jnp.minimum(j * bk, s - bk)
            qt = [jax.lax.dynamic_slice_in_dim(q, q0, bq, 3) for q in queries]
            sc = sum(_score_part(q, _slots(k, lay, k0, bk), lay, backend)
                     for q, k, lay in zip(qt, src.keys, src.key_layouts))
            if masked:
                qp = jax.lax.dynamic_slice_in_dim(q_positions, q0, bq, 1)
                kp = jax.lax.dynamic_slice_in_dim(src.positions, k0, bk, 1)
                mask = _visible(qp, kp, window_size, num_sink_tokens)
                # rows / slots the clamped block shares with the previous one: not its own
                mask &= ((q0 + jnp.arange(bq) >= i * bq)[:, None]
                         & (k0 + jnp.arange(bk) >= j * bk)[None, :])[None]
                sc = jnp.where(mask[:, None, None], sc, NEG_INF)   # [B, 1, 1, bq, bk]
            m_old = jax.lax.dynamic_slice_in_dim(m, q0, bq, 3)
            m_new = jnp.maximum(m_old, jnp.max(sc, axis=-1))
            # A masked score gives exp(NEG_INF - m') = 0 once the row has seen a visible
            # key (m' > NEG_INF). Before that (m' = NEG_INF) it gives 1; the first visible
            # key then scales those terms by exp(NEG_INF - m') = 0, and a row that never
            # sees one is zeroed at the end. No second select pass over the tile.
            p = jnp.exp(sc - m_new[..., None])
            alpha = jnp.exp(m_old - m_new)
            l_t = alpha * jax.lax.dynamic_slice_in_dim(l, q0, bq, 3) + jnp.sum(p, -1)
            spec = "SV" if src.value_layout == "BKSH" else "VS"
            pv = jnp.einsum(f"BKGTS,BK{spec}->BKGTV",
                            ops.dot_operand(p.astype(probs_dtype), backend),
                            ops.dot_operand(_slots(src.values, src.value_layout, k0, bk),
                                            backend),
                            preferred_element_type=jnp.float32)
            acc_t = alpha[..., None] * jax.lax.dynamic_slice_in_dim(acc, q0, bq, 3) + pv
            return (jax.lax.dynamic_update_slice_in_dim(m, m_new, q0, 3),
                    jax.lax.dynamic_update_slice_in_dim(l, l_t, q0, 3),
                    jax.lax.dynamic_update_slice_in_dim(acc, acc_t, q0, 3))

        def body(state, xs):
            if conditional:
                (i, j), go = xs
                return jax.lax.cond(go, lambda st: tile(st, i, j), lambda st: st,
                                    state), None
            i, j = xs
            return tile(state, i, j), None

        return body

    def run(state, src, bk, pairs, masked, go=None):
        if len(pairs) == 0:
            return state
        xs = (jnp.asarray(pairs[:, 0]), jnp.asarray(pairs[:, 1]))
        body = make_body(src, bk, masked, go is not None)
        return jax.lax.scan(body, state, xs if go is None else (xs, go))[0]

    if old is not None:
        old = old._replace(positions=old.positions.astype(jnp.int32))
        bk = min(block_k, old.num_slots)
        pairs, go = _old_pairs(q_positions, old.positions, bq, bk, window_size,
                               num_sink_tokens)
        state = run(state, old, bk, pairs, True, go)
    bk = min(block_k, t)
    full, partial = _chunk_pairs(t, bq, bk, window_size, num_sink_tokens)
    chunk = chunk._replace(positions=q_positions)
    state = run(state, chunk, bk, full, False)
    state = run(state, chunk, bk, partial, True)
    m, l, acc = state
    seen = m > NEG_INF                      # the row has seen at least one visible key
    return jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)


def num_chunk_pairs(t: int, block_q: int = DEFAULT_BLOCK_Q, block_k: int = DEFAULT_BLOCK_K,
                    window_size: int | None = None, num_sink_tokens: int = 0) -> int:
    """Tiles a chunk of ``t`` tokens computes against itself (causal/window skipping):
    for the theory of the tiled prefill (:mod:`kvjax.analysis.costs`)."""
    full, partial = _chunk_pairs(t, min(block_q, t), min(block_k, t), window_size,
                                 num_sink_tokens)
    return len(full) + len(partial)


def attend_chunk(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                 k_old: jax.Array | None = None, v_old: jax.Array | None = None,
                 old_positions: jax.Array | None = None, k_layout: str = "BKSH",
                 v_layout: str = "BKSH", window_size: int | None = None,
                 num_sink_tokens: int = 0, block_q: int = DEFAULT_BLOCK_Q,
                 block_k: int = DEFAULT_BLOCK_K, backend: str | None = None) -> jax.Array:
    """Grouped-query attention (MHA/GQA/MQA) of a chunk over (old slots ++ itself), tiled;
    the same function as ``attention.attend`` over the concatenation with
    ``cache.attention_mask``, without materialising the [T, S + T] scores.

    Args:
      q: [B, T, K, G, H] rotated queries.
      k: [B, K, T, H] the chunk's keys ('BKSH'), or [B, K, H, T] with k_layout 'BKHS'.
      v: [B, K, T, Hv] the chunk's values, or [B, K, Hv, T] with v_layout 'BKHS'.
      positions: [B, T] int32 consecutive absolute positions of the chunk.
      k_old, v_old: the layer's cache before the chunk, in the same layouts with S slots
        in place of T; None (with old_positions None) for an empty cache.
      old_positions: [S] or [B, S] int32 slot positions (-1: empty).
      k_layout, v_layout: 'BKSH' or 'BKHS', for the chunk and the cache alike.
      window_size, num_sink_tokens: W and s (None, 0: full causal attention).
      block_q, block_k: tile sizes (queries, key slots).
    Returns:
      [B, T, K, G, Hv] in v's dtype; scores, softmax and accumulation in float32.
    Raises:
      ValueError: a bad layout, block size, window, shape, or old tensors given partly.
    """
    if (k_old is None) != (v_old is None) or (k_old is None) != (old_positions is None):
        raise ValueError("k_old, v_old and old_positions: give all three or none (got "
                         f"{[x is not None for x in (k_old, v_old, old_positions)]})")
    for name, lay in (("k_layout", k_layout), ("v_layout", v_layout)):
        if lay not in LAYOUTS:
            raise ValueError(f"{name}={lay!r}; allowed: {LAYOUTS}")
    if q.ndim != 5:
        raise ValueError(f"q shape {q.shape}; allowed: [B, T, K, G, H]")
    b = q.shape[0]
    chunk = KVSource((k,), (k_layout,), v, v_layout, positions)
    old = None
    if k_old is not None:
        pos = old_positions if old_positions.ndim == 2 else jnp.broadcast_to(
            old_positions, (b, old_positions.shape[0]))
        old = KVSource((k_old,), (k_layout,), v_old, v_layout, pos)
    out = tiled_attention((jnp.moveaxis(q, 1, 3),), positions, chunk, old,
                          scale=q.shape[-1] ** -0.5, window_size=window_size,
                          num_sink_tokens=num_sink_tokens, block_q=block_q,
                          block_k=block_k, backend=backend)
    return jnp.moveaxis(out, 3, 1).astype(v.dtype)


def attend_mla_chunk(q_main: jax.Array, q_rope: jax.Array, c_kv: jax.Array,
                     k_rope: jax.Array, positions: jax.Array, *, w_uk: jax.Array,
                     w_uv: jax.Array, absorb: bool, scale: float,
                     c_old: jax.Array | None = None, kr_old: jax.Array | None = None,
                     old_positions: jax.Array | None = None,
                     window_size: int | None = None, num_sink_tokens: int = 0,
                     block_q: int = DEFAULT_BLOCK_Q,
                     block_k: int = DEFAULT_BLOCK_K, backend: str | None = None) -> jax.Array:
    """Multi-head latent attention (DeepSeek-V2) of a chunk over (old slots ++ itself),
    tiled; the same function as ``mla.attend_mla`` over the concatenation.

    Absorbed: the latent c is the single, shared key and value head (Kv = 1, Gv = N);
    scores are q_lat·c + q_rope·k_rope. Naive: per-head keys c·W_UK and values c·W_UV are
    rebuilt for every slot first (as the dense naive path does), the rotary key shared.

    Args:
      q_main: absorbed [B, T, N, C] latent queries; naive [B, T, N, nope].
      q_rope: [B, T, N, R] rotated query parts.
      c_kv, k_rope: [B, T, C], [B, T, R] the chunk's latents and rotary keys.
      positions: [B, T] int32 consecutive absolute positions of the chunk.
      w_uk [N, C, nope], w_uv [N, C, V]: up-projections (naive path only).
      absorb: which path. scale: score scale, 1/sqrt(nope + R).
      c_old [B, S, C], kr_old [B, S, R], old_positions [S] or [B, S]: the cache before the
        chunk, or all None.
      window_size, num_sink_tokens, block_q, block_k: as :func:`attend_chunk`.
    Returns:
      float32 [B, T, N, C] (absorbed: W_UV still to apply) or [B, T, N, V] (naive).
    Raises:
      ValueError: old tensors given partly, or as :func:`tiled_attention`.
    """
    if (c_old is None) != (kr_old is None) or (c_old is None) != (old_positions is None):
        raise ValueError("c_old, kr_old and old_positions: give all three or none (got "
                         f"{[x is not None for x in (c_old, kr_old, old_positions)]})")
    b = q_main.shape[0]

    def source(c, kr, pos):
        pos = pos if pos.ndim == 2 else jnp.broadcast_to(pos, (b, pos.shape[0]))
        if absorb:
            lat = c[:, None]                                         # [B, 1, S, C]
            return KVSource((lat, kr[:, None]), ("BKSH", "BKSH"), lat, "BKSH", pos)
        k = jnp.einsum("BSC,NCP->BNSP", c, w_uk)                     # rebuilt keys
        v = jnp.einsum("BSC,NCV->BNSV", c, w_uv)                     # rebuilt values
        return KVSource((k, kr[:, None]), ("BKSH", "BKSH"), v, "BKSH", pos)

    if absorb:   # [B, T, N, X] -> [B, 1, N, T, X]: one shared KV head, G = N
        queries = (jnp.moveaxis(q_main, 1, 2)[:, None], jnp.moveaxis(q_rope, 1, 2)[:, None])
    else:        # [B, T, N, X] -> [B, N, 1, T, X]: N KV heads, G = 1
        queries = (jnp.moveaxis(q_main, 1, 2)[:, :, None],
                   jnp.moveaxis(q_rope, 1, 2)[:, :, None])
    old = None if c_old is None else source(c_old, kr_old, old_positions)
    out = tiled_attention(queries, positions, source(c_kv, k_rope, positions), old,
                          scale=scale, window_size=window_size,
                          num_sink_tokens=num_sink_tokens, block_q=block_q,
                          block_k=block_k, probs_dtype=c_kv.dtype, backend=backend)
    out = out[:, 0] if absorb else out[:, :, 0]                      # [B, N, T, X]
    return jnp.moveaxis(out, 1, 2)


def prefill_path(cfg) -> str:
    """The prompt-attention formulation a config runs into an empty cache ('tiled',
    'dense', 'native', 'cudnn'): :meth:`kvjax.config.ModelConfig.formulation` at its
    prompt site (:func:`kvjax.models.decode_kernels.site`, the registry's rule)."""
    return cfg.formulation(decode_kernels.site(cfg, 1, decode_kernels.SMALL_CHUNK + 1, 0,
                                               cached=False))


SDPA_IMPLEMENTATIONS = ("cudnn", "xla")


def attend_chunk_sdpa(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *,
                      k_layout: str = "BKSH", v_layout: str = "BKSH",
                      window_size: int | None = None,
                      implementation: str = "cudnn") -> jax.Array:
    """Causal attention of a chunk over itself (an empty cache) through
    ``jax.nn.dot_product_attention``: with ``implementation='cudnn'`` cuDNN's fused flash
    attention on GPU (causal blocks skipped, ``local_window_size`` for a window), with
    'xla' JAX's reference formulation of the same call (for checking it on CPU).

    Args:
      q: [B, T, K, G, H] rotated queries.
      k, v: [B, K, T, H] ('BKSH') or [B, K, H, T] ('BKHS') the chunk's keys and values.
      positions: [B, T] int32, consecutive in each row from the row's first position,
        right padding -1 (its rows get 0; the valid length goes to cuDNN as
        ``query_seq_lengths``/``key_value_seq_lengths``).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      window_size: W (no sinks; None: full causal): a query sees the W - 1 keys before it.
      implementation: 'cudnn' (GPU, bfloat16/float16 inputs, as cuDNN requires) or 'xla'.
    Returns:
      [B, T, K, G, H] in v's dtype.
    Raises:
      ValueError: an implementation not in :data:`SDPA_IMPLEMENTATIONS`, 'cudnn' on a
        backend other than 'gpu' (naming it), a bad layout or window.
    """
    if implementation not in SDPA_IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}; allowed: "
                         f"{SDPA_IMPLEMENTATIONS}")
    backend = backend_lib.current()
    if implementation == "cudnn" and backend != "gpu":
        raise ValueError(f"implementation='cudnn' (prefill_impl='cudnn') on backend "
                         f"{backend!r}; allowed: the 'gpu' backend (cuDNN), else "
                         "prefill_impl 'tiled', 'dense', 'native' (CPU) or 'auto'")
    for name, lay in (("k_layout", k_layout), ("v_layout", v_layout)):
        if lay not in LAYOUTS:
            raise ValueError(f"{name}={lay!r}; allowed: {LAYOUTS}")
    if window_size is not None and (isinstance(window_size, bool) or window_size <= 0):
        raise ValueError(f"window_size={window_size!r}; allowed: None or a positive integer")
    b, t, kh, g, h = q.shape
    to_btkh = lambda x, lay: jnp.swapaxes(x, 1, 2) if lay == "BKSH" else \
        jnp.transpose(x, (0, 3, 1, 2))  # noqa: E731
    lengths = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, kh * g, h), to_btkh(k, k_layout), to_btkh(v, v_layout),
        is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=None if window_size is None else (window_size - 1, 0),
        implementation=implementation)
    out = out.reshape(b, t, kh, g, -1)
    return jnp.where((positions >= 0)[:, :, None, None, None], out, 0).astype(v.dtype)
