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

from kvjax import kernels
from kvjax.config import MESH_AXES, ConfigError, MeshConfig, ModelConfig


def mesh_devices(mcfg: MeshConfig, devices=None) -> tuple[list, str | None]:
    """The devices a mesh of ``mcfg``'s size runs on, and a one-line note when that is
    not all of them.

    Rule: a mesh larger than the device count is an error; one of the same size uses
    every device; a smaller one uses the first ``data*model*seq`` devices in
    ``jax.devices()`` order (e.g. ``--config.mesh.model=3`` on 8 virtual CPU devices)
    and returns a note saying so, except with several processes (``jax.distributed``),
    where a subset could leave a process without devices, so the size must equal the
    device count.

    Args:
      mcfg: the mesh sizes.
      devices: the devices available (None: ``jax.devices()``).
    Returns:
      (the devices to use, a note or None).
    Raises:
      ConfigError: the mesh is larger than the device count, or smaller with several
        processes.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    multi = len({d.process_index for d in devices}) > 1
    if mcfg.size > n or (multi and mcfg.size != n):
        allowed = (f"the device count, {n}" if multi else
                   f"at most the device count, {n} (a smaller mesh uses the first "
                   f"data*model*seq devices)")
        raise ConfigError(
            f"invalid config: mesh data*model*seq = {mcfg.data}*{mcfg.model}*{mcfg.seq} = "
            f"{mcfg.size}; allowed: {allowed} ({devices[0].platform}"
            + ("; with several processes every device is in the mesh" if multi else
               f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={mcfg.size}"
               " before JAX starts") + ")")
    if mcfg.size == n:
        return devices, None
    return devices[:mcfg.size], (
        f"note: mesh (data, model, seq) = {mcfg.shape} uses {mcfg.size} of the {n} "
        f"{devices[0].platform} devices (the first {mcfg.size}); the other {n - mcfg.size} "
        "stay idle")


def make_mesh(mcfg: MeshConfig, devices=None) -> Mesh:
    """A ``jax.sharding.Mesh`` of shape (data, model, seq) over ``devices``.

    Args:
      mcfg: the mesh sizes.
      devices: the devices available (None: ``jax.devices()``, every process's devices
        when ``jax.distributed`` is initialised). The mesh takes all of them, or the
        first ``mcfg.size`` when it is smaller (:func:`mesh_devices`).
    Returns:
      A Mesh with axis names ('data', 'model', 'seq'); devices in ``jax.devices()`` order
      (process-major), so with several processes the leading axes span processes.
    Raises:
      ConfigError: the mesh is larger than the device count (or smaller with several
        processes), before anything is compiled.
    """
    devices, _ = mesh_devices(mcfg, devices)
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
    (``rope_positions='cache'``) are not sequence-sharded; every formulation the config
    names applies on the mesh (the registry's refusals, :func:`kvjax.kernels.select`:
    the native kernels are single-device custom calls XLA cannot partition; the native
    prompt kernel runs per device on whole KV heads, :func:`kvjax.ops.per_device`).
    """
    def fail(field, value, allowed):
        raise ConfigError(f"invalid config: {field}={value!r}; allowed: {allowed}")

    m = mcfg.model
    devices = mcfg.size
    for op in kernels.OPS:
        # the registry's refusals on this mesh: the native kernels are single-device
        # custom calls ('auto' resolves to 'xla' under a mesh, kvjax.planner.resolve);
        # the native prompt kernel runs per device on whole KV heads
        site = kernels.static_site(op, cfg.backend, cfg.kv_dtype or cfg.dtype
                                   if op == "decode_attention" else cfg.dtype, devices,
                                   cfg.is_mla or cfg.num_kv_heads % mcfg.model == 0)
        try:
            kernels.select(op, getattr(cfg, kernels.FIELD[op]), site, strict=True)
        except ValueError as e:
            raise ConfigError(f"invalid config: {e}") from None
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
