"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before
Generation", sec. 4.2, Listing 1): the attention of the prompt's last w queries (the
observation window) over each slot, summed over the window, average-pooled along the
slots (``pooling_kernel``) so a kept token keeps its neighbours, and averaged over each
GQA group's G query heads; the window itself is always kept."""

from kvjax import compression


def score(obs: compression.Observation):
    """[B, K, S] pooled window attention, the observation window kept."""
    votes = compression.pool(compression.window_attention(obs), obs.config.pooling_kernel)
    return compression.protect_recent(obs, votes.mean(axis=2),
                                      obs.config.observation_window)


compression.register(compression.Method(
    name="snapkv", score=score, queries="window", reference="Li et al. 2024, sec. 4.2",
    protected=lambda cfg, budget: cfg.observation_window))
