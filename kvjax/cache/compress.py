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
           "layer_budgets", "prompt_slots"]


def prompt_config(cfg: ModelConfig) -> ModelConfig:
    """The config a compressed model's prompt is prefilled with: ``cfg`` without
    ``kv_compression`` (a full cache)."""
    return cfg.replace(kv_compression=None, kv_budget=None)


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
    ``scores`` [B, K, S] among filled slots (``key_positions`` [B, S] >= 0); empty slots
    only where a row holds fewer tokens than the budget (then every filled one is kept).
    Ties go to the lower slot (``jax.lax.top_k``)."""
    filled = (key_positions >= 0)[:, None, :]
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


def compress(cfg: ModelConfig, full: cache_lib.KVCache, queries: tuple | None
             ) -> cache_lib.KVCache:
    """The compressed cache of ``cfg`` from the full cache a prompt was prefilled into.

    Args:
      cfg: a config with ``kv_compression`` (MHA/GQA/MQA or MLA, unrolled or stacked
        layers).
      full: the prompt's cache under :func:`prompt_config` (``length`` = each row's
        prompt tokens, position p in slot p), S >= kv_budget.
      queries: per layer ([B, Q, K, G, H], [B, Q] positions) from
        :func:`observation_queries` (MLA: [B, Q, 1, N, C + R] absorbed queries), or None
        for a method reading no query.
    Returns:
      A cache of ``cfg`` with kv_budget + recent_slots slots per row (layer i: b_i +
      recent_slots with per-layer budgets): the kept slots first, the ring after them
      empty; ``length`` and ``ragged`` as ``full``'s.
    Raises:
      ValueError: ``full`` has fewer slots than the largest budget.
    """
    method = compression.get(cfg.kv_compression)
    budgets = layer_budgets(cfg)
    if full.num_slots < max(budgets):
        raise ValueError(f"a prompt cache of {full.num_slots} slots for a budget of "
                         f"{max(budgets)}; allowed: at least {max(budgets)} slots")
    pcfg = prompt_config(cfg)
    names = list(full.tensors)
    kept = {n: [] for n in names}
    for i, budget in enumerate(budgets):
        layer = full.layer(i)
        k, v, scale = _keys_values(pcfg, layer)
        q, qpos = queries[i] if queries is not None else (None, None)
        obs = compression.Observation(
            keys=k, values=v, queries=q, query_positions=qpos,
            key_positions=full.positions, scale=scale, budget=budget,
            config=cfg.compression)
        idx = select(method.score(obs), full.positions, budget)
        for n in names:
            kept[n].append(_gather(layer[n], idx, cache_lib.slot_axis(pcfg, n)))
    ring = cfg.compression.recent_slots
    tensors = {}
    for n in names:
        layers = [_pad_slots(x, ring, cache_lib.slot_axis(pcfg, n)) for x in kept[n]]
        tensors[n] = jnp.stack(layers) if cfg.scan_layers else tuple(layers)
    low = min(budgets)  # the positions of the smallest layer (all of them when uniform)
    held = jnp.minimum(full.length, low)[:, None]  # [B, 1]
    slots = jnp.arange(low + ring, dtype=jnp.int32)[None, :]
    positions = jnp.where(slots < held, slots, -1)
    return cache_lib.KVCache(tensors=tensors, positions=positions, length=full.length,
                             layouts=cache_lib.layouts(cfg), ragged=full.ragged)


def _pad_slots(x: jax.Array, n: int, axis: int) -> jax.Array:
    """One layer's tensor with ``n`` empty (zero) slots appended along its slot axis."""
    widths = [(0, 0)] * x.ndim
    widths[x.ndim + axis] = (0, n)
    return jnp.pad(x, widths)
