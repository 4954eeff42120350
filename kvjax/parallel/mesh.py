"""The device mesh of a run: building it and checking a model against it before compiling.

Axes (``kvjax.config.MeshConfig``): ``data`` splits the batch B, ``model`` splits heads,
FFN width and vocabulary (Megatron tensor parallelism), ``seq`` splits the cache's slot
axis S (one long request's cache spans devices). Every check here raises
:class:`kvjax.config.ConfigError` naming the field, before anything is compiled.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from kvjax.config import MESH_AXES, ConfigError, MeshConfig, ModelConfig


def make_mesh(mcfg: MeshConfig, devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` of shape (data, model, seq) over ``devices``.

    Args:
      mcfg: the mesh sizes.
      devices: the devices to use (None: ``jax.devices()``, every process's devices when
        ``jax.distributed`` is initialised). Their count must equal the mesh size.
    Returns:
      A Mesh with axis names ('data', 'model', 'seq'); devices in ``jax.devices()`` order
      (process-major), so with several processes the leading axes span processes.
    Raises:
      ConfigError: the mesh size differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    if mcfg.size != len(devices):
        raise ConfigError(
            f"invalid config: mesh data*model*seq = {mcfg.data}*{mcfg.model}*{mcfg.seq} = "
            f"{mcfg.size}; allowed: the device count, {len(devices)} "
            f"({devices[0].platform}; on CPU set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={mcfg.size} before JAX starts)")
    return Mesh(np.asarray(devices, dtype=object).reshape(mcfg.shape), MESH_AXES)


def kv_heads_sharded(cfg: ModelConfig, mcfg: MeshConfig) -> bool:
    """True when the KV heads (k_proj/v_proj and the 'k'/'v' cache) split over 'model':
    K divisible by ``mcfg.model`` (MLA has no KV head axis: False)."""
    return not cfg.is_mla and mcfg.model > 1 and cfg.num_kv_heads % mcfg.model == 0


def check(cfg: ModelConfig, mcfg: MeshConfig, batch_size: int | None = None,
          num_slots: int | None = None) -> None:
    """Raises ConfigError unless ``cfg`` (and the batch / cache slots, when given) can be
    laid out on ``mcfg``'s mesh.

    Rules: ``data`` divides B; ``model`` divides the query heads N, the FFN width F and
    the vocabulary V; ``model`` divides the KV heads K unless ``mesh.kv_fallback`` is
    'replicate'; ``seq`` divides the cache slots S; sinks at cache positions
    (``rope_positions='cache'``) are not sequence-sharded.
    """
    def fail(field, value, allowed):
        raise ConfigError(f"invalid config: {field}={value!r}; allowed: {allowed}")

    m = mcfg.model
    if batch_size is not None and batch_size % mcfg.data:
        fail("batch_size", batch_size, f"a multiple of mesh.data={mcfg.data}")
    if m > 1:
        if cfg.num_heads % m:
            fail("mesh.model", m, f"a divisor of model.num_heads={cfg.num_heads}")
        if cfg.mlp_dim % m:
            fail("mesh.model", m, f"a divisor of model.mlp_dim={cfg.mlp_dim}")
        if cfg.vocab_size % m:
            fail("mesh.model", m, f"a divisor of model.vocab_size={cfg.vocab_size}")
        if not cfg.is_mla and cfg.num_kv_heads % m and mcfg.kv_fallback == "none":
            fail("mesh.model", m,
                 f"a divisor of model.num_kv_heads={cfg.num_kv_heads}, or set "
                 "mesh.kv_fallback='replicate' (every model shard keeps all KV heads and "
                 "their cache), or split the cache over mesh.seq instead")
    if mcfg.seq > 1:
        if num_slots is not None and num_slots % mcfg.seq:
            fail("mesh.seq", mcfg.seq, f"a divisor of the cache slots S={num_slots}")
        if cfg.rope_positions == "cache":
            fail("mesh.seq", mcfg.seq,
                 "1 with model.rope_positions='cache' (sink rescoring is not sequence-sharded)")
