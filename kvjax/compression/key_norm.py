"""Key norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression", sec. 3): keys of small L2 norm draw high attention, so a slot's score
is minus its key's norm, per KV head. Needs no query."""

import jax.numpy as jnp

from kvjax import compression


def score(obs: compression.Observation):
    """[B, K, S]: -||k||_2 of each slot's key."""
    return -jnp.linalg.norm(obs.keys.astype(jnp.float32), axis=-1)


compression.register(compression.Method(
    name="key_norm", score=score, queries="none", reference="Devoto et al. 2024, sec. 3"))
