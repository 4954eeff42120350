"""StreamingLLM through the score interface (Xiao et al. 2023, "Efficient Streaming
Language Models with Attention Sinks", sec. 3.2): keep the first ``num_sink_tokens``
positions and the most recent ones. The score of a slot is its position, the sinks'
:data:`~kvjax.compression.KEEP`; what it keeps equals what a ring of the same slots
with those sinks holds (``tests/test_compression.py``)."""

import jax.numpy as jnp

from kvjax import compression


def score(obs: compression.Observation):
    """[B, K, S]: the slot's position (newer is kept), sinks always."""
    pos = jnp.broadcast_to(compression.head_positions(obs).astype(jnp.float32),
                           obs.keys.shape[:3])
    return compression.protect_sinks(obs, pos, obs.config.num_sink_tokens)


compression.register(compression.Method(
    name="streaming_llm", score=score, queries="none",
    reference="Xiao et al. 2023, sec. 3.2",
    protected=lambda cfg, budget: cfg.num_sink_tokens))
