"""Partition specs of every parameter and cache tensor on the ('data', 'model', 'seq') mesh.

Parameters (Megatron-style tensor parallelism over 'model'; replicated over 'data' and
'seq'):

* attention: q_proj [D, N, H] and o_proj [N, H, D] by query heads; k_proj / v_proj
  [D, K, H] by KV heads (replicated when ``mesh.kv_fallback='replicate'`` and the model
  axis does not divide K). Each device computes whole heads, so attention needs no
  communication; o_proj's contraction over N ends in one all-reduce per block.
* MLA: w_q / w_uq [., N, .], w_uk / w_uv [N, C, .], wo [N, V, D] by heads; the latent's
  down-projections (w_dq, w_dkv, w_kr) and norms replicated (the latent is shared by all
  heads, so MLA's cache has no head axis to split).
* MLP: gate/up [D, F] by F (columns), down [F, D] by F (rows): one all-reduce per block.
* embedding [V, D] (tied LM head) and lm_head [D, V]: by vocabulary. Why not replicated:
  the table is the largest single weight of a small model (SmolLM2: 28.3M of 134.5M
  parameters), and the LM head reads all of it every step, so replicating it would put
  V·D·b on every device's step bytes; split, each device reads V/model rows, the lookup
  ends in one all-reduce of [B, T, D] and the logits stay split until sampling reduces.
* norm scales: replicated.

Cache (from :func:`kvjax.cache.tensor_specs`, never from shapes alone): the batch axis ->
'data', the KV-head axis -> 'model' (when K splits), the slot axis -> 'seq'; MLA's
'c_kv' [B, S, C] / 'k_rope' [B, S, R] -> ('data', 'seq', None). Stacked caches get a
leading None (L). positions [B, S] -> ('data', 'seq'), length [B] -> ('data',).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kvjax import cache as cache_lib
from kvjax.config import MeshConfig, ModelConfig
from kvjax.parallel.mesh import kv_heads_sharded

# Parameter name (the module owning 'kernel'/'embedding') -> spec of its per-layer array.
_HEADS_MID = P(None, "model", None)   # [D, N, H]-like
_HEADS_FIRST = P("model", None, None)  # [N, H, D]-like


def _param_rule(name: str, ndim: int, cfg: ModelConfig, mcfg: MeshConfig) -> P:
    if name in ("q_proj", "w_q", "w_uq"):
        return _HEADS_MID
    if name in ("k_proj", "v_proj"):
        return _HEADS_MID if kv_heads_sharded(cfg, mcfg) else P(None, None, None)
    if name in ("o_proj", "w_uk", "w_uv", "wo"):
        return _HEADS_FIRST
    if name in ("gate", "up"):
        return P(None, "model")
    if name == "down":
        return P("model", None)
    if name == "embed":
        return P("model", None)
    if name == "lm_head":
        return P(None, "model")
    return P(*([None] * ndim))


def param_specs(cfg: ModelConfig, mcfg: MeshConfig, params):
    """A pytree like ``params`` (arrays or ShapeDtypeStructs) of PartitionSpecs.

    Stacked parameters (under 'layers', leading L axis) get a leading None. With a
    one-device mesh every spec is replicated.
    """
    def spec(path, leaf):
        keys = [getattr(p, "key", str(p)) for p in path]
        stacked = keys[0] == "layers"
        name = keys[-2] if keys[-1] in ("kernel", "embedding", "scale") else keys[-1]
        if keys[-1] == "scale":
            name = "norm"
        if keys[-1] == "bias":  # q/k/v biases [N, H] / [K, H]: the kernel's output axes
            base = P(*_param_rule(keys[-2], leaf.ndim - stacked + 1, cfg, mcfg)[1:])
        else:
            base = _param_rule(name, leaf.ndim - stacked, cfg, mcfg)
        if len(base) != leaf.ndim - stacked:
            base = P(*([None] * (leaf.ndim - stacked)))
        return P(None, *base) if stacked else base

    return jax.tree_util.tree_map_with_path(spec, params)


def cache_tensor_spec(cfg: ModelConfig, mcfg: MeshConfig, name: str) -> P:
    """Spec of one layer's cache tensor ``name`` (:func:`kvjax.cache.tensor_specs`)."""
    spec = cache_lib.tensor_specs(cfg, 1, 1)[name]
    axes = [None] * len(spec.shape)
    axes[0] = "data"
    axes[len(spec.shape) + spec.slot_axis] = "seq"
    if not cfg.is_mla and kv_heads_sharded(cfg, mcfg):
        axes[1] = "model"
    return P(*axes)


def cache_specs(cfg: ModelConfig, mcfg: MeshConfig, cache: cache_lib.KVCache):
    """A KVCache-shaped pytree of PartitionSpecs for ``cache`` (arrays or
    ShapeDtypeStructs; stacked or per-layer tensors; the static fields kept)."""
    tensors = {}
    for name, t in cache.tensors.items():
        s = cache_tensor_spec(cfg, mcfg, name)
        tensors[name] = P(None, *s) if cfg.scan_layers else tuple(s for _ in t)
    return cache.replace(tensors=tensors, positions=P("data", "seq"), length=P("data"))


def shardings(mesh, specs):
    """PartitionSpec pytree -> NamedSharding pytree on ``mesh``."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))


def shard(tree, mesh, specs):
    """``jax.device_put`` of ``tree`` with the NamedShardings of ``specs``."""
    return jax.device_put(tree, shardings(mesh, specs))
