"""Quest (Tang et al. 2024, "Quest: Query-Aware Sparsity for Efficient Long-Context LLM
Inference", sec. 3-4): query-aware selection of the pages a decode step reads.

Unlike the other methods of this registry Quest evicts nothing: a paged cache keeps every
page, and each page keeps the per-channel minimum m and maximum M of its written keys
(:mod:`kvjax.cache.paged`, updated when a slot is written). At each decode step the
page's criticality for a query q is the upper bound of q·k over its keys (sec. 3.2,
Algorithm 1):

    U = sum_h max(q_h · m_h, q_h · M_h),

and each KV head reads only its ``kv_budget / page_size`` highest-ranked pages (plus the
step's own token). It saves reads, not memory.

GQA (Quest is MHA): a KV head's G query heads share one page set, ranked by the **max**
over the group of the per-query bound, max_g U_g. That is itself an upper bound of the
score any head of the group gives any key of the page, so a page that one head alone
would pick under Quest's rule competes with its full bound; kvpress's eviction methods
take the mean of the heads' scores (:mod:`kvjax.compression`), which would let G - 1
indifferent heads outvote the one that needs the page.
"""

import jax
import jax.numpy as jnp

from kvjax import compression


def page_score(q: jax.Array, k_min: jax.Array, k_max: jax.Array) -> jax.Array:
    """[B, K, M] float32: max over each group's G queries of sum_h max(q_h·m_h, q_h·M_h).

    Args:
      q: [B, K, G, H] the step's queries (rotated; any float dtype).
      k_min, k_max: [B, M, K, H] each row's logical pages' per-channel key bounds.
    """
    q = q.astype(jnp.float32)[:, None]  # [B, 1, K, G, H]
    lo = k_min.astype(jnp.float32)[:, :, :, None, :]  # [B, M, K, 1, H]
    hi = k_max.astype(jnp.float32)[:, :, :, None, :]
    bound = jnp.maximum(q * lo, q * hi).sum(-1)  # [B, M, K, G]
    return jnp.swapaxes(bound.max(-1), 1, 2)


compression.register(compression.Method(
    name="quest", score=None, queries="none",
    reference="Tang et al. 2024, sec. 3.2 (Algorithm 1)", page_score=page_score))
