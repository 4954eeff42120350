"""H2O, heavy hitters (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models", sec. 4, Algorithm 1): the attention each
slot received, accumulated over every prompt query, plus the most recent tokens
(``recent_fraction`` of the budget; the paper's half). Once after the prefill
(kvpress's observed-attention press), or the paper's online eviction with schedule
'every_n' (:data:`kvjax.compression.SCHEDULES`; ``every_n`` 1: Algorithm 1's per-step
eviction), where a slot's score is the attention it received from every query since it
was written: the prompt's and each decode step's (``Observation.accumulated``)."""

from kvjax import compression


def _recent(cfg, budget: int) -> int:
    return int(round(cfg.recent_fraction * budget))


def score(obs: compression.Observation):
    """[B, K, S] accumulated attention, averaged over each group; the recent slots kept."""
    acc = compression.window_attention(obs).mean(axis=2)
    if obs.accumulated is not None:
        acc = acc + obs.accumulated
    return compression.protect_recent(obs, acc, _recent(obs.config, obs.budget))


compression.register(compression.Method(
    name="h2o", score=score, queries="all", reference="Zhang et al. 2023, sec. 4",
    protected=_recent))
