"""PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling", sec. 3): SnapKV's scores (:mod:`kvjax.compression.snapkv`)
with a budget per layer that falls arithmetically from the bottom layer to the top one
(attention scatters in the lower layers and funnels onto a few tokens in the upper ones),
the mean over the layers equal to ``kv_budget``, so the cache holds a uniform cache's
bytes. Each layer allocates its own budget + recent_slots slots
(:func:`kvjax.cache.kv.init_cache`); no layer is a masked full-size one.

The schedule is the reference code's (KVCache-Factory, ``pyramidkv/pyramidkv_utils.py``,
``PyramidKVCluster.update_kv``; kvpress's ``PyramidKVPress`` uses the same), with
C = kv_budget - w the slots beyond the observation window w and beta
``compression.pyramid_beta``:

    min_num = C // beta,   max_num = 2·C - min_num,
    layer i (of L) keeps w + max_num - i·(max_num - min_num) / (L - 1).

Two departures, both for static shapes and exact bytes: the reference floors the step
(max_num - min_num) // (L - 1), which makes its layers keep up to L·(L - 1)/2 slots more
than L·kv_budget in all; here the exact arithmetic sequence is rounded to integers by the
largest remainders (ties to the lower layer), so the budgets sum to L·kv_budget exactly
and still never rise with i. And the reference shrinks max_num to a short prompt's length
at run time; here the budgets depend on the config alone (a prompt shorter than a layer's
budget keeps every token there).
"""

from kvjax import compression
from kvjax.compression import snapkv


def layer_budgets(cfg: compression.CompressionConfig, budget: int, num_layers: int) -> tuple:
    """(b_0, ..., b_{L-1}) slots per layer, bottom first: the schedule above, summing to
    L·``budget``. One layer: (budget,)."""
    w, c = cfg.observation_window, budget - cfg.observation_window
    if num_layers == 1:
        return (budget,)
    lo = c // cfg.pyramid_beta
    hi = 2 * c - lo
    d = num_layers - 1
    exact = [hi * d - i * (hi - lo) for i in range(num_layers)]  # x_i·(L - 1)
    floors = [x // d for x in exact]
    extra = num_layers * c - sum(floors)  # 0 <= extra < L: the remainders' sum / (L - 1)
    order = sorted(range(num_layers), key=lambda i: (-(exact[i] % d), i))
    for i in order[:extra]:
        floors[i] += 1
    return tuple(w + x for x in floors)


compression.register(compression.Method(
    name="pyramidkv", score=snapkv.score, queries="window",
    reference="Cai et al. 2024, sec. 3 (KVCache-Factory's schedule)",
    protected=lambda cfg, budget: cfg.observation_window, layer_budgets=layer_budgets))
