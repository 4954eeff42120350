"""Several processes (``jax.distributed``): one host or many, CPU collectives through
JAX's own CPU collectives implementation (gloo).

Call :func:`initialize` before anything touches a JAX backend: it sets the per-process CPU
device count (``DistributedConfig.local_devices``), selects the CPU collectives and joins
the coordinator. After it, ``jax.devices()`` lists every process's devices and
:func:`kvjax.parallel.mesh.make_mesh` builds a mesh spanning them (process-major).
"""

from __future__ import annotations

import os

import numpy as np

from kvjax.config import DistributedConfig


def set_local_devices(n: int | None) -> None:
    """Asks XLA for ``n`` host (CPU) devices; only effective before JAX initialises."""
    if n is None:
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])


def initialize(dcfg: DistributedConfig) -> None:
    """Joins ``jax.distributed`` when ``dcfg.num_processes > 1`` (else only sets the
    local device count). The config was validated when built (a process id out of range
    raised ConfigError then, before any compile).

    Raises:
      RuntimeError: from ``jax.distributed.initialize`` (coordinator unreachable, ...).
    """
    set_local_devices(dcfg.local_devices)
    if not dcfg.enabled:
        return
    import jax  # noqa: PLC0415 (after XLA_FLAGS)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=dcfg.coordinator_address,
                               num_processes=dcfg.num_processes,
                               process_id=dcfg.process_id)


def global_array(x, sharding):
    """A global jax.Array with ``sharding`` from a host array every process holds whole
    (each process fills its own shards)."""
    import jax  # noqa: PLC0415
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
    """A (possibly multi-process) jax.Array gathered whole on every process."""
    import jax  # noqa: PLC0415
    from jax.experimental import multihost_utils  # noqa: PLC0415
    if jax.process_count() == 1:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
