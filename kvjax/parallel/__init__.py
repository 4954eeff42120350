"""The KV cache on a device mesh (``jax.sharding`` under ``jit``, ``shard_map`` for the
sequence axis, ``jax.distributed`` for several processes). docs/DESIGN.md, "Meshes"."""
