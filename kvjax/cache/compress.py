"""Lever 5 on the cache: score a prefilled cache's slots and keep each KV head's best.

:func:`compress` turns the full cache a prompt was prefilled into (``prompt_config``:
the model without compression) into the compressed cache of ``cfg``
(``model.kv_compression``, :mod:`kvjax.compression`): per layer, the method scores every
slot (:class:`kvjax.compression.Observation`), each KV head keeps its ``kv_budget``
highest-scoring slots in position order (:func:`select`), and the kept keys and values
(codes and scales for a quantized cache: the stored representation, never re-encoded)
are gathered into slots 0 .. kv_budget - 1 of a cache of kv_budget + recent_slots slots
per row. Those kept slots are the pinned ones of that cache's ring
(:func:`kvjax.cache.policy.policy_for`): every later query sees them, and later tokens
go to the ring of ``recent_slots`` after them.

The kept slots of one row hold different positions per KV head and layer, so
``positions`` cannot name them: a kept slot j holds position j there when the prompt fit
in the budget (nothing was dropped), else the marker j (< kv_budget, i.e. a pinned slot:
visible to every later query, as each kept token is). The rotary embedding was applied
before caching, so a kept key keeps its true position; ``length`` stays the prompt's.

A method with per-layer budgets (``cfg.layer_budgets``, PyramidKV) keeps b_i slots in
layer i, whose tensors hold b_i + recent_slots slots each (never the largest budget
masked); ``positions`` are then the smallest layer's, the others' follow from them
(:func:`kvjax.cache.kv.budget_positions`).

Schedule 'every_n' (``model.compression.schedule``, N = ``every_n``; N = 1: every step)
compresses again during decoding (:func:`recompress`, under a ``lax.cond`` in
:func:`kvjax.inference.decode.decode_loop`: the main job, the ragged loop and the slot
engine's dense rows, whose free rows hold :func:`empty_schedule` and take a request's
state with its prefilled row, :func:`put_schedule_row`): once a row's ring holds N tokens, its
kept + ring slots are scored and each KV head keeps its top kv_budget again, in slots
0 .. kv_budget - 1, and the ring empties. What the method sees then is
``KVCache.schedule`` (:func:`init_schedule`): the decode queries since the last
compression (buffered by :func:`observe_step`), each kept slot's true position per KV
head (the markers hide them), and for H2O a float32 accumulator of the attention each
kept slot received so far, added to at each compression from the buffered queries:
those see exactly the slots the decode steps saw (none is evicted in between), so the
sum equals per-step accumulation without touching the attention kernels.

MLA keeps latent slots: in its absorbed form it is MQA over one "KV head" whose key is
[c_kv ; k_rope] and value c_kv, with N query heads [q_nope·W_UK^T ; q_rope]
(:func:`_keys_values`), so every method scores it unchanged, one slot set per layer, and
the kept c_kv and k_rope rows (codes and scales when quantized) are gathered: the cache
holds (C + R)·b bytes per kept slot, the latent cache's at the budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import compression
from kvjax.cache import kv as cache_lib
from kvjax.config import ModelConfig

__all__ = ["query_count", "observation_queries", "select", "compress", "prompt_config",
           "layer_budgets", "prompt_slots", "compress_prompt", "init_schedule",
           "empty_schedule", "SCHEDULE_BATCH_AXES", "put_schedule_row", "observe_step", "due_rows",
           "recompress", "decode_config"]


def prompt_config(cfg: ModelConfig) -> ModelConfig:
    """The config a compressed model's prompt is prefilled with: ``cfg`` without
    ``kv_compression`` (a full cache)."""
    return cfg.replace(kv_compression=None, kv_budget=None)


def decode_config(cfg: ModelConfig) -> ModelConfig:
    """The config that decodes a cache compressed once, after its prefill: ``cfg`` with
    ``kv_compression`` named by the first registered evicting method, when ``cfg`` evicts
    with schedule 'prefill' and one budget for every layer; else ``cfg`` itself.

    After that compression the method plays no part: a decode step appends to the ring
    and attends over the kept slots and the ring, whose sizes are kv_budget and
    recent_slots whatever the method. So every such method at one budget shares the
    decoding programs (``jax.jit`` keys them on the config): a sweep of M methods
    compiles its decode and answer programs once per budget, not M times
    (docs/decisions/0047-sweep-decodes-one-program-per-budget.md). The cache itself is
    the method's.
    """
    if not cfg.kv_evicts or cfg.kv_rescores or cfg.layer_budgets is not None:
        return cfg
    return cfg.replace(kv_compression=next(n for n in compression.names()
                                           if compression.evicts(n)))


def layer_budgets(cfg: ModelConfig) -> tuple:
    """(b_0, ..., b_{L-1}) slots each layer keeps: ``cfg.layer_budgets``, or kv_budget
    in every layer."""
    return cfg.layer_budgets or (cfg.kv_budget,) * cfg.num_layers


def prompt_slots(cfg: ModelConfig, prompt_len: int) -> int:
    """Slots of the full cache a ``prompt_len``-token prompt is prefilled into before
    compression: max(T, the largest layer budget), so every layer can select its budget."""
    return max(prompt_len, max(layer_budgets(cfg)))


def query_count(cfg: ModelConfig, prompt_len: int) -> int:
    """Q, the prompt queries ``cfg``'s method reads (0, 1, w or T)."""
    need = compression.get(cfg.kv_compression).queries
    return {"none": 0, "last": 1, "all": prompt_len,
            "window": min(cfg.compression.observation_window, prompt_len)}[need]


def observation_queries(queries: jax.Array, lengths: jax.Array, count: int):
    """Each row's last ``count`` real prompt queries of one layer.

    Args:
      queries: [B, T, K, G, H] the layer's rotated queries of a fresh prefill (token j
        at position j; right padding after a row's ``lengths[b]`` real tokens).
      lengths: [B] int32 real tokens per row.
      count: Q.
    Returns:
      ([B, Q, K, G, H], [B, Q] int32 positions, -1 where a row has fewer than Q tokens).
    """
    idx = lengths[:, None] - count + jnp.arange(count, dtype=jnp.int32)[None, :]
    q = jnp.take_along_axis(queries, jnp.maximum(idx, 0)[:, :, None, None, None], axis=1)
    return q, jnp.where(idx >= 0, idx, -1).astype(jnp.int32)


def select(scores: jax.Array, key_positions: jax.Array, budget: int) -> jax.Array:
    """[B, K, budget] int32 slots each KV head keeps, ascending: its ``budget`` highest
    ``scores`` [B, K, S] among filled slots (``key_positions`` [B, S], or [B, K, S] per
    head, >= 0); empty slots only where a row holds fewer tokens than the budget (then
    every filled one is kept). Ties go to the lower slot (``jax.lax.top_k``)."""
    filled = (key_positions >= 0) if key_positions.ndim == 3 \
        else (key_positions >= 0)[:, None, :]
    s = jnp.where(filled, scores.astype(jnp.float32), -jnp.inf)
    _, idx = jax.lax.top_k(s, budget)
    return jnp.sort(idx, axis=-1).astype(jnp.int32)


def _keys_values(pcfg: ModelConfig, layer: dict):
    """(keys [B, K, S, H], values [B, K, S, H'], scale) a method scores one layer of the
    prompt cache with (dequantized, slot axis -2).

    MHA/GQA/MQA: the cached 'k' and 'v', scale H^-1/2. MLA in its absorbed form is MQA
    over one latent "KV head" (DeepSeek-V2, Liu et al. 2024, sec. 2.1.2: W^UK absorbed
    into W^Q; sec. 2.1.3: the decoupled rotary key): key [c_kv ; k_rope] (H = C + R),
    value c_kv (H' = C), scale :attr:`~kvjax.config.ModelConfig.mla_scale`; its queries
    are the absorbed ones ``model.forward`` observes ([B, T, 1, N, C + R]), so K = 1,
    G = N.
    """
    if pcfg.is_mla:
        c = cache_lib.read(pcfg, layer, "c_kv")
        kr = cache_lib.read(pcfg, layer, "k_rope").astype(c.dtype)
        return jnp.concatenate([c, kr], axis=-1)[:, None], c[:, None], pcfg.mla_scale
    k, v = cache_lib.read(pcfg, layer, "k"), cache_lib.read(pcfg, layer, "v")
    if cache_lib.slot_axis(pcfg, "k") == -1:
        k = jnp.swapaxes(k, -1, -2)
    if cache_lib.slot_axis(pcfg, "v") == -1:
        v = jnp.swapaxes(v, -1, -2)
    return k, v, pcfg.head_dim ** -0.5


def _gather(x: jax.Array, idx: jax.Array, axis: int) -> jax.Array:
    """One layer's cached tensor [B, K, S, X] (``axis`` -2) or [B, K, X, S] (-1) at the
    per-head slots ``idx`` [B, K, budget]; an MLA tensor [B, S, X] (no head axis) at the
    one latent head's slots ``idx`` [B, 1, budget]."""
    if x.ndim == 3:
        return jnp.take_along_axis(x, idx[:, 0, :, None], axis=1)
    if axis == -2:
        return jnp.take_along_axis(x, idx[..., None], axis=2)
    return jnp.take_along_axis(x, idx[:, :, None, :], axis=3)


def compress(cfg: ModelConfig, full: cache_lib.KVCache, queries: tuple | None,
             ring: int | None = None) -> cache_lib.KVCache:
    """The compressed cache of ``cfg`` from the full cache a prompt was prefilled into.

    Args:
      cfg: a config with ``kv_compression`` (MHA/GQA/MQA or MLA, unrolled or stacked
        layers).
      full: the prompt's cache under :func:`prompt_config` (``length`` = each row's
        prompt tokens, position p in slot p), S >= kv_budget.
      queries: per layer ([B, Q, K, G, H], [B, Q] positions) from
        :func:`observation_queries` (MLA: [B, Q, 1, N, C + R] absorbed queries), or None
        for a method reading no query.
      ring: slots after the kept ones (None: recent_slots; a speculative target keeps
        k + 1 spare, :func:`kvjax.inference.speculative.init_target_cache`).
    Returns:
      A cache of ``cfg`` with kv_budget + ``ring`` slots per row (layer i: b_i + ring
      with per-layer budgets): the kept slots first, the ring after them empty;
      ``length`` and ``ragged`` as ``full``'s.
    Raises:
      ValueError: ``full`` has fewer slots than the largest budget, or ``ring`` is
        below recent_slots.
    """
    method = compression.get(cfg.kv_compression)
    budgets = layer_budgets(cfg)
    if full.num_slots < max(budgets):
        raise ValueError(f"a prompt cache of {full.num_slots} slots for a budget of "
                         f"{max(budgets)}; allowed: at least {max(budgets)} slots")
    recent = cfg.compression.recent_slots
    ring = recent if ring is None else ring
    if ring < recent:
        raise ValueError(f"ring={ring} slots after the kept ones; allowed: at least "
                         f"model.compression.recent_slots={recent}")
    pcfg = prompt_config(cfg)
    names = list(full.tensors)
    kept = {n: [] for n in names}
    kept_pos, acc = [], []
    for i, budget in enumerate(budgets):
        layer = full.layer(i)
        q, qpos = queries[i] if queries is not None else (None, None)
        idx, pos, a = _score_layer(cfg, method, layer, full.positions, q, qpos, None, budget)
        kept_pos.append(pos)
        acc.append(a)
        for n in names:
            kept[n].append(_gather(layer[n], idx, cache_lib.slot_axis(pcfg, n)))
    tensors = {}
    for n in names:
        layers = [_pad_slots(x, ring, cache_lib.slot_axis(pcfg, n)) for x in kept[n]]
        tensors[n] = jnp.stack(layers) if cfg.scan_layers else tuple(layers)
    low = min(budgets)  # the positions of the smallest layer (all of them when uniform)
    held = jnp.minimum(full.length, low)[:, None]  # [B, 1]
    slots = jnp.arange(low + ring, dtype=jnp.int32)[None, :]
    positions = jnp.where(slots < held, slots, -1)
    schedule = None
    if cfg.kv_rescores:
        schedule = init_schedule(cfg, full.batch_size, jnp.stack(kept_pos),
                                 None if acc[0] is None else jnp.stack(acc))
    return cache_lib.KVCache(tensors=tensors, positions=positions, length=full.length,
                             layouts=cache_lib.layouts(cfg), ragged=full.ragged,
                             schedule=schedule)


def compress_prompt(cfg: ModelConfig, full: cache_lib.KVCache, queries: tuple,
                    prompt_len: int, ring: int | None = None) -> cache_lib.KVCache:
    """:func:`compress` of a prompt's full cache with the observation queries its method
    reads (:func:`query_count` of a ``prompt_len``-token prompt, :func:`observation_queries`
    of each layer's rotated prompt queries ``queries``, L of [B, T, K, G, H]): the second
    half of ``kvjax.inference.decode.prefill_compressed``, shared by the long-context
    sweep that prefills once for many methods (traced)."""
    count = query_count(cfg, prompt_len)
    seen = None if count == 0 else tuple(
        observation_queries(q, full.length, count) for q in queries)
    return compress(cfg, full, seen, ring)


def _score_layer(cfg: ModelConfig, method, layer: dict, key_positions, queries,
                 query_positions, accumulated, budget: int):
    """One layer's selection: (idx [B, K, budget] int32 kept slots, their positions
    [B, K, budget] int32 per head, and for a method reading every query (H2O) the
    attention they accumulated, [B, K, budget] float32, else None)."""
    k, v, scale = _keys_values(prompt_config(cfg), layer)
    obs = compression.Observation(
        keys=k, values=v, queries=queries, query_positions=query_positions,
        key_positions=key_positions, scale=scale, budget=budget,
        config=cfg.compression, accumulated=accumulated)
    idx = select(method.score(obs), key_positions, budget)
    kp = jnp.broadcast_to(compression.head_positions(obs), idx.shape[:2]
                          + key_positions.shape[-1:])
    pos = jnp.take_along_axis(kp, idx, axis=-1)
    acc = None
    if method.queries == "all":  # the attention each kept slot accumulated so far
        total = compression.window_attention(obs).mean(axis=2)
        if accumulated is not None:
            total = total + accumulated
        acc = jnp.where(pos >= 0, jnp.take_along_axis(total, idx, axis=-1), 0.0)
    return idx, pos, acc


# --------------------------------------------- schedule 'every_n': decode-time compression


def init_schedule(cfg: ModelConfig, batch: int, kept_positions: jax.Array,
                  accumulated: jax.Array | None) -> dict:
    """The scoring state of schedule 'every_n' (``KVCache.schedule``), right after a
    compression.

    Args:
      kept_positions: [L, B, K, kv_budget] int32 absolute position of each kept slot per
        KV head (-1: empty).
      accumulated: [L, B, K, kv_budget] float32 attention each kept slot received so far
        (mean over its GQA group), for a method reading every query (H2O), else None.
    Returns:
      dict: 'queries' [L, B, N, K, G, H] (model dtype) the decode queries since the last
      compression, N = ``every_n``; 'query_positions' [B, N] int32 (-1: none); 'count'
      [B] int32 queries buffered; 'kept_positions'; 'accumulated' (absent for other
      methods). Its bytes are :func:`kvjax.analysis.theory.schedule_overhead`'s
      'state_bytes'.
    """
    n = cfg.compression.every_n
    g = cfg.num_heads // cfg.num_kv_heads
    state = dict(
        queries=jnp.zeros((cfg.num_layers, batch, n, cfg.num_kv_heads, g, cfg.head_dim),
                          cfg.jnp_dtype),
        query_positions=jnp.full((batch, n), -1, jnp.int32),
        count=jnp.zeros((batch,), jnp.int32), kept_positions=kept_positions)
    if accumulated is not None:
        state["accumulated"] = accumulated
    return state


SCHEDULE_BATCH_AXES = {"queries": 1, "query_positions": 0, "count": 0,
                       "kept_positions": 1, "accumulated": 1}
"""The batch-row axis of each array of the scoring state (:func:`init_schedule`)."""


def empty_schedule(cfg: ModelConfig, batch: int) -> dict:
    """:func:`init_schedule` for ``batch`` rows that hold no token yet (a slot engine's
    free rows, :class:`kvjax.inference.engine.DenseRows`): no kept slot (positions -1),
    nothing buffered, H2O's accumulator zero. A row's state is put in place with its
    prefilled row (:func:`put_schedule_row`)."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, cfg.kv_budget)
    acc = jnp.zeros(shape, jnp.float32) \
        if compression.get(cfg.kv_compression).queries == "all" else None
    return init_schedule(cfg, batch, jnp.full(shape, -1, jnp.int32), acc)


def put_schedule_row(state: dict, row: dict, slot: jax.Array) -> dict:
    """``state`` (B rows) with row ``slot`` ([] int32, traced) replaced by the one-row
    state ``row`` (a one-row prefill's, :func:`compress`), each array along its
    :data:`SCHEDULE_BATCH_AXES` axis.

    Raises:
      ValueError: the two states hold different arrays (e.g. one with H2O's
        accumulator, one without).
    """
    if set(state) != set(row):
        raise ValueError(f"a scoring state of {sorted(row)} put into one of "
                         f"{sorted(state)}; allowed: the same config's")
    out = {}
    for name, dst in state.items():
        start = [0] * dst.ndim
        start[SCHEDULE_BATCH_AXES[name]] = slot
        out[name] = jax.lax.dynamic_update_slice(dst, row[name].astype(dst.dtype), start)
    return out


def observe_step(cache: cache_lib.KVCache, queries: tuple, positions: jax.Array,
                 written: jax.Array) -> cache_lib.KVCache:
    """Buffers one decode step's queries (traced).

    Args:
      cache: a cache with ``schedule``.
      queries: L per-layer [B, 1, K, G, H] rotated queries (``model.forward``'s observe).
      positions: [B] int32 their positions.
      written: [B] bool rows that wrote a token this step (a stopped ragged row did not).
    """
    st = cache.schedule
    n = st["query_positions"].shape[1]
    at = (jnp.arange(n, dtype=jnp.int32)[None, :] == st["count"][:, None]) \
        & written[:, None]  # [B, N]
    q = jnp.stack([x[:, 0] for x in queries])[:, :, None]  # [L, B, 1, K, G, H]
    new = dict(st, queries=jnp.where(at[None, :, :, None, None, None],
                                     q.astype(st["queries"].dtype), st["queries"]),
               query_positions=jnp.where(at, positions[:, None], st["query_positions"]),
               count=st["count"] + written.astype(jnp.int32))
    return cache.replace(schedule=new)


def due_rows(cfg: ModelConfig, cache: cache_lib.KVCache) -> jax.Array:
    """[B] bool rows whose recent ring holds ``every_n`` tokens since the last
    compression (its slots after the kv_budget kept ones)."""
    ring = cache.positions[:, cfg.kv_budget:]
    return jnp.sum(ring >= 0, axis=1) >= cfg.compression.every_n


def recompress(cfg: ModelConfig, cache: cache_lib.KVCache, due: jax.Array
               ) -> cache_lib.KVCache:
    """Schedule 'every_n' (traced): the rows ``due`` [B] bool re-score every held slot
    (kv_budget kept + the ring's) with the buffered decode queries and keep each KV
    head's top kv_budget again (:func:`select`, as after the prefill), in slots
    0 .. kv_budget - 1; their ring is emptied, their buffer cleared. Other rows are
    untouched, so a row's tokens never depend on its batch-mates. The cache keeps its
    kv_budget + recent_slots slots (the same arrays). Unrolled over the layers inside
    the loop's ``lax.cond``, neither scanned nor a program of its own
    (docs/decisions/0043-every-n-rescoring-stays-in-the-loop.md)."""
    method = compression.get(cfg.kv_compression)
    st = cache.schedule
    budget, names = cfg.kv_budget, list(cache.tensors)
    s = cache.num_slots
    slots = jnp.arange(s, dtype=jnp.int32)
    queries, qpos = _buffered(cfg, st)
    kept = {n: [] for n in names}
    kept_pos, acc = [], []
    for i in range(cfg.num_layers):
        layer = cache.layer(i)
        # per-head true positions: the kept slots' from the state, the ring's (and a
        # pinned slot written after the compression, position j in slot j) the cache's
        held = jnp.pad(st["kept_positions"][i], ((0, 0), (0, 0), (0, s - budget)),
                       constant_values=-1)
        kp = jnp.where(held >= 0, held, cache.positions[:, None, :])  # [B, K, S]
        prior = None
        if "accumulated" in st:
            prior = jnp.pad(st["accumulated"][i], ((0, 0), (0, 0), (0, s - budget)))
        q = None if queries is None else queries[i]
        idx, pos, a = _score_layer(cfg, method, layer, kp, q, qpos, prior, budget)
        kept_pos.append(jnp.where(due[:, None, None], pos, st["kept_positions"][i]))
        if a is not None:
            acc.append(jnp.where(due[:, None, None], a, st["accumulated"][i]))
        for n in names:
            ax = cache_lib.slot_axis(cfg, n)
            new = _pad_slots(_gather(layer[n], idx, ax), s - budget, ax)
            kept[n].append(jnp.where(due.reshape((-1,) + (1,) * (new.ndim - 1)), new,
                                     layer[n]))
    tensors = {n: jnp.stack(kept[n]) if cfg.scan_layers else tuple(kept[n]) for n in names}
    markers = jnp.where(slots < budget, slots, -1)[None, :]
    positions = jnp.where(due[:, None], markers, cache.positions)
    new = dict(st, kept_positions=jnp.stack(kept_pos),
               query_positions=jnp.where(due[:, None], -1, st["query_positions"]),
               count=jnp.where(due, 0, st["count"]))
    if acc:
        new["accumulated"] = jnp.stack(acc)
    return cache.replace(tensors=tensors, positions=positions, schedule=new)


def _buffered(cfg: ModelConfig, st: dict):
    """(queries [L, B, Q, K, G, H] or None, positions [B, Q]) a decode-time compression
    hands the method: none, the newest, the last min(w, N), or all N buffered
    (:func:`query_count` of the N buffer slots)."""
    c = query_count(cfg, st["query_positions"].shape[1])
    if c == 0:
        return None, None
    idx = st["count"][:, None] - c + jnp.arange(c, dtype=jnp.int32)[None, :]  # [B, Q]
    safe = jnp.maximum(idx, 0)
    q = jnp.take_along_axis(st["queries"], safe[None, :, :, None, None, None], axis=2)
    pos = jnp.take_along_axis(st["query_positions"], safe, axis=1)
    return q, jnp.where(idx >= 0, pos, -1)


def _pad_slots(x: jax.Array, n: int, axis: int) -> jax.Array:
    """One layer's tensor with ``n`` empty (zero) slots appended along its slot axis."""
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + axis] = (0, n)
    return jnp.pad(x, widths)


def full_cache(cfg: ModelConfig, batch: int, context: int) -> cache_lib.KVCache:
    """A zero cache of ``context`` slots (W for a window) that a step at context
    ``context`` sees full: length context - 1, every slot holding a past position. A
    compressed cache (``kv_compression``, context above its slots): its kv_budget kept
    slots (markers 0 .. kv_budget - 1, this module) and its ring
    holding the last recent_slots positions, with an empty scoring state
    (:func:`empty_schedule`) under schedule 'every_n'."""
    cache = cache_lib.init_cache(cfg, batch, context)
    s = cache.num_slots
    pinned = cache_lib.policy_for(cfg).num_sink_tokens if cfg.kv_evicts else 0
    held = jnp.arange(max(pinned, context - 1 - (s - pinned)), context - 1,
                      dtype=jnp.int32)
    positions = cache.positions.at[:, :pinned].set(
        jnp.arange(min(pinned, context - 1), dtype=jnp.int32)) if pinned else cache.positions
    positions = positions.at[:, cache_lib.slot_of(held, cfg, s)].set(held)
    if cfg.kv_rescores:
        cache = cache.replace(schedule=empty_schedule(cfg, batch))
    return cache.replace(positions=positions,
                         length=jnp.full((batch,), context - 1, jnp.int32))
