"""TOVA, token omission via attention (Oren et al. 2024, "Transformers are Multi-State
RNNs", sec. 4): the attention of the current (here: the prompt's last) query, averaged
over all the layer's heads, so every KV head keeps the same tokens. Once after the prefill,
or the paper's per-step eviction with schedule 'every_n' and ``every_n`` 1 (the newest
decode query's attention; :data:`kvjax.compression.SCHEDULES`)."""

import jax.numpy as jnp

from kvjax import compression


def score(obs: compression.Observation):
    """[B, K, S]: the last query's attention, mean over the layer's N heads."""
    att = compression.window_attention(obs)  # [B, K, G, S], one query
    mean = att.mean(axis=(1, 2), keepdims=False)[:, None, :]
    return jnp.broadcast_to(mean, att.shape[:2] + att.shape[3:])


compression.register(compression.Method(
    name="tova", score=score, queries="last", reference="Oren et al. 2024, sec. 4"))
