"""Lever 5, fewer tokens by score: the registry of KV-compression methods.

A method is one file in this folder that calls :func:`register` with a :class:`Method`:
its name (the value of ``model.kv_compression``), a ``score`` function that gives every
held slot of one layer a score (higher: keep), and which queries it needs. Nothing else
names a method: the config's validation, the cache policy, theory, the cost report and
the long-context harness read :func:`names` and :func:`get`, so a new file is a new
method (``tests/test_compression.py`` adds a toy one).

The protocol (kvpress's, Jegou et al. 2024; SnapKV, Li et al. 2024, sec. 4): the prompt
is prefilled into a full cache, every layer's slots are scored, and each KV head keeps
its own ``kv_budget`` highest-scoring slots (:func:`select`) in a cache of
``kv_budget + recent_slots`` slots (a method with per-layer budgets, PyramidKV: layer i
its own b_i, with mean kv_budget); tokens written afterwards (a question, the answer)
go to a ring of ``recent_slots`` after the kept ones
(:class:`kvjax.cache.policy.RingSlots` with the kept slots as its pinned ones). Per-head
selection stores K different slot sets of one size, so the cache holds its budget and
never masks a full-size one (kvpress's per-head budgets do).

Scores are combined over a GQA group by their mean over its G query heads (kvpress's
``scores.view(B, K, G, S).mean(2)``); a method that scores per layer (TOVA) averages over
every head. MLA is absorbed MQA, one latent KV head (K = 1, G = N; keys [c_kv ; k_rope],
:mod:`kvjax.cache.compress`): its N heads' scores are averaged and each layer keeps one
set of latent slots. This module imports nothing from kvjax but :mod:`jax`, so every layer may
read it; the methods' files only :mod:`jax.numpy` and this module.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Callable

import jax
import jax.numpy as jnp

QUERIES = ("none", "last", "window", "all")
"""What a method's score reads besides the keys and values: no query, the prompt's last
query, the last ``observation_window`` queries, or every prompt query."""

SCHEDULES = ("prefill", "every_n")
"""When a method compresses: 'prefill', once after the prompt's prefill; 'every_n',
after the prefill and again whenever ``every_n`` tokens were written into the recent
ring since the last compression (``every_n`` 1: every step; H2O's and TOVA's online
eviction, Zhang et al. 2023 Algorithm 1, Oren et al. 2024 sec. 4):
:func:`kvjax.cache.compress.recompress`."""

KEEP = 1e30
"""A score that is always kept (a protected slot: sinks, the observation window)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """What a method sees of one layer after the prefill (float32, keys post-RoPE).

    Attributes:
      keys, values: [B, K, S, H] the prompt's cached keys and values (dequantized).
      queries: [B, Q, K, G, H] the last Q prompt queries (post-RoPE; Q = 1, w or T by
        the method's ``queries``), or None for ``queries='none'``. At a decode-time
        compression (schedule 'every_n') the last decode queries since the previous
        one (at most ``every_n``; 'last': the newest, 'window': up to w of them).
      query_positions: [B, Q] int32 absolute positions of those queries (-1: none).
      key_positions: [B, S] int32 absolute position of each slot (-1: empty); at a
        decode-time compression [B, K, S], per KV head (its kept slots differ): read
        them through :func:`head_positions`.
      scale: the attention score scale (H^-1/2, or the checkpoint's).
      budget: the slots each KV head of this layer keeps.
      config: the :class:`CompressionConfig` knobs.
      accumulated: [B, K, S] float32 attention (mean over each GQA group) the slots
        received from earlier queries not in ``queries`` (the prompt's and previous
        decode steps', schedule 'every_n', for ``queries='all'``: H2O's accumulated
        attention), or None (nothing before ``queries``).
    """

    keys: jax.Array
    values: jax.Array
    queries: jax.Array | None
    query_positions: jax.Array | None
    key_positions: jax.Array
    scale: float
    budget: int
    config: "CompressionConfig"
    accumulated: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """The knobs of the KV-compression methods (``model.compression``); every method
    reads the ones it needs.

    Attributes:
      observation_window: w, the last prompt queries whose attention scores the slots
        (SnapKV, Li et al. 2024 sec. 4.2; their experiments use 32, kvpress 64); those
        w tokens are always kept, so a budget must exceed it.
      pooling_kernel: width of the average pooling of SnapKV's scores along the slots
        (their reference: 5); 1: none.
      num_sink_tokens: the first slots always kept (StreamingLLM, Xiao et al. 2023: 4).
      recent_slots: R, a ring of slots after the kept ones for the tokens written after
        the compression (the question, the answer); when it fills, its oldest token goes.
        Default 192: the long-context harness's question and answer room
        (:data:`kvjax.training.longcontext.RESERVE`), so no question token is evicted.
      recent_fraction: H2O's share of the budget kept for the most recent tokens (Zhang et
        al. 2023, sec. 5: half heavy hitters, half recent).
      schedule: when to compress, one of :data:`SCHEDULES`.
      every_n: N, with schedule 'every_n': compress again after every N tokens written
        into the recent ring (1: every decode step); 1 <= N <= recent_slots, so no ring
        token is overwritten before it is scored.
      pyramid_beta: PyramidKV's beta (Cai et al. 2024; KVCache-Factory's ``beta``,
        default 20): the top layer keeps w + (kv_budget - w) // beta slots, the bottom
        one w + 2·(kv_budget - w) - (kv_budget - w) // beta; an integer >= 1 (1: every
        layer kv_budget).
      uniform_layers: True: every layer keeps kv_budget even under a method with
        per-layer budgets (:attr:`Method.layer_budgets`; PyramidKV then is SnapKV). The
        config of one layer (``ModelConfig.layer_config``) sets it: that layer's
        kv_budget is its own budget.
      first_pages: a page-selecting method's (Quest's) first pages of each row always
        read, within its budget (attention sinks; Quest itself: 0).
      dense_layers: a page-selecting method's (Quest's) first layers that read every
        page (the ordinary paged read) instead of selecting; an integer in [0, L] (L:
        every layer reads the full cache). Quest's paper keeps 2 (Tang et al. 2024,
        sec. 4.1's setting: the first two layers, whose attention is not sparse, read
        every token); kvjax's default 0 selects in every layer, as its figures before
        this knob did (docs/decisions/0044-quest-dense-layers-default-0.md). With
        0 < dense_layers the layers are unrolled (their reads differ).
    """

    observation_window: int = 32
    pooling_kernel: int = 5
    num_sink_tokens: int = 4
    recent_slots: int = 192
    recent_fraction: float = 0.5
    schedule: str = "prefill"
    every_n: int = 1
    pyramid_beta: int = 20
    uniform_layers: bool = False
    first_pages: int = 0
    dense_layers: int = 0


@dataclasses.dataclass(frozen=True)
class Method:
    """One registered compression method.

    Attributes:
      name: the value of ``model.kv_compression`` that selects it.
      score: (:class:`Observation`) -> [B, K, S] float32 scores of one layer's slots,
        higher kept; :data:`KEEP` for a slot always kept. Empty slots need nothing
        (:func:`select` never keeps them over a filled one). None for a read-time
        method (``page_score``).
      queries: one of :data:`QUERIES`.
      reference: the paper and section that define the score.
      protected: (config, kv_budget) -> slots of the budget the score always keeps
        (sinks, observation window); the budget must exceed them.
      layer_budgets: (config, kv_budget, L) -> L ints, the slots each layer's KV heads
        keep (layer 0 first), summing to L·kv_budget so that the cache holds a uniform
        cache's bytes; None: every layer kv_budget. Each layer's cache then holds its own
        budget + recent_slots slots (:func:`kvjax.cache.kv.init_cache`), and every
        budget must exceed ``protected`` (``model.kv_budget`` is refused otherwise).
      page_score: a read-time method's (Quest's) page ranking, or None (the method
        evicts once, by ``score``): (q [B, K, G, H] the step's queries, k_min, k_max
        [B, M, K, H] each row's pages' per-channel key bounds) -> [B, K, M] float32, higher
        read first (:func:`kvjax.models.attention.select_pages`).
    """

    name: str
    score: Callable[[Observation], jax.Array]
    queries: str
    reference: str
    protected: Callable[[CompressionConfig, int], int] = lambda cfg, budget: 0
    layer_budgets: Callable[[CompressionConfig, int, int], tuple] | None = None
    page_score: Callable[[jax.Array, jax.Array, jax.Array], jax.Array] | None = None

    @property
    def selects_pages(self) -> bool:
        """True for a read-time method (Quest): it keeps every page of a paged cache and
        reads each step only the pages :attr:`page_score` ranks first, per KV head; it
        evicts nothing (``score`` is None)."""
        return self.page_score is not None


_METHODS: dict[str, Method] = {}
_LOADED = False


def register(method: Method) -> Method:
    """Adds ``method`` (a method file calls this when imported).

    Raises:
      ValueError: a name registered twice, or ``queries`` not in :data:`QUERIES`.
    """
    if method.name in _METHODS:
        raise ValueError(f"kv_compression method {method.name!r} registered twice")
    if method.queries not in QUERIES:
        raise ValueError(f"method {method.name!r}: queries={method.queries!r}; allowed: "
                         f"one of {list(QUERIES)}")
    _METHODS[method.name] = method
    return method


def _load() -> None:
    """Imports every module of this package once (each registers its method)."""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")


def names() -> tuple:
    """Every registered method's name, sorted."""
    _load()
    return tuple(sorted(_METHODS))


def evicts(name: str | None) -> bool:
    """Whether ``model.kv_compression=name`` evicts slots after the prefill (every method
    but a read-time page selection, :attr:`Method.selects_pages`); False for None."""
    return name is not None and not get(name).selects_pages


def selects_pages(name: str | None) -> bool:
    """Whether ``model.kv_compression=name`` is a read-time page selection (Quest)."""
    return name is not None and get(name).selects_pages


def get(name: str) -> Method:
    """The method registered as ``name``.

    Raises:
      ValueError: an unknown name, listing the registered ones.
    """
    _load()
    if name not in _METHODS:
        raise ValueError(f"model.kv_compression={name!r}; allowed: None or one of "
                         f"{list(names())}")
    return _METHODS[name]


# ----------------------------------------------------------------- shared score parts


def head_positions(obs: Observation) -> jax.Array:
    """[B, 1, S] or [B, K, S] int32: ``obs.key_positions`` with a KV-head axis."""
    kp = obs.key_positions
    return kp[:, None, :] if kp.ndim == 2 else kp


def window_attention(obs: Observation, block: int = 512) -> jax.Array:
    """[B, K, G, S] float32: the softmax attention of the observation queries over the
    slots, causal (a query sees slots at positions <= its own), summed over the queries.
    Queries go ``block`` at a time, so H2O's T x S weights are never all held."""
    q = obs.queries.astype(jnp.float32)
    k = obs.keys.astype(jnp.float32)
    kp = head_positions(obs)  # [B, 1 | K, S]
    nq = q.shape[1]
    pad = (-nq) % block if nq > block else 0
    qp = obs.query_positions
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        qp = jnp.pad(qp, ((0, 0), (0, pad)), constant_values=-1)
    step = min(block, q.shape[1])

    def one(carry, xs):
        qb, pb = xs  # [B, Qb, K, G, H], [B, Qb]
        s = jnp.einsum("bqkgh,bksh->bkgqs", qb, k) * obs.scale
        qb_pos = pb[:, None, :, None]  # [B, 1, Qb, 1]
        seen = (kp[:, :, None, :] >= 0) & (kp[:, :, None, :] <= qb_pos) \
            & (qb_pos >= 0)  # [B, 1 | K, Qb, S]
        s = jnp.where(seen[:, :, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(seen[:, :, None], p, 0.0)
        return carry + p.sum(axis=3), None

    b, _, kh, g, _ = q.shape
    blocks = (q.reshape(b, -1, step, kh, g, q.shape[-1]).swapaxes(0, 1),
              qp.reshape(b, -1, step).swapaxes(0, 1))
    init = jnp.zeros((b, kh, g, k.shape[2]), jnp.float32)
    out, _ = jax.lax.scan(one, init, blocks)
    return out


def pool(scores: jax.Array, kernel: int) -> jax.Array:
    """Average pooling of [..., S] scores along S with an odd ``kernel``, 'same' size
    (zero padded: kvpress's ``F.avg_pool1d(..., padding=kernel // 2)``)."""
    if kernel <= 1:
        return scores
    dims = (1,) * (scores.ndim - 1) + (kernel,)
    total = jax.lax.reduce_window(scores, 0.0, jax.lax.add, dims, (1,) * scores.ndim,
                                  "SAME")
    return total / kernel


def protect_recent(obs: Observation, scores: jax.Array, n: int) -> jax.Array:
    """[B, K, S] ``scores`` with each row's last ``n`` positions set to :data:`KEEP`."""
    kp = head_positions(obs)
    last = jnp.max(kp, axis=(-2, -1), keepdims=True)  # [B, 1, 1]
    return jnp.where((kp > last - n) & (kp >= 0), KEEP, scores)


def protect_sinks(obs: Observation, scores: jax.Array, n: int) -> jax.Array:
    """[B, K, S] ``scores`` with positions below ``n`` set to :data:`KEEP`."""
    kp = head_positions(obs)
    return jnp.where((kp >= 0) & (kp < n), KEEP, scores)
