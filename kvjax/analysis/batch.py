"""The blog's batch-size argument, swept: "Why Batch Size Cannot Save You".

With B sequences a decode step reads the weights once (phase 1: bytes constant, FLOPs ∝ B,
arithmetic intensity ∝ B) but every sequence's own KV cache (phase 3: bytes and FLOPs
both ∝ B·t, intensity ~1 FLOP/byte), and all caches must fit in memory at once (the
memory wall: ``theory.max_batch``). This module gives, per lever and (B, t):

* :func:`theory_point`: the two phases from the closed forms (weights phase: weight
  bytes, projection + MLP + LM-head FLOPs; KV phase: cache read + write bytes, attention
  FLOPs), their intensities and the roofline step time / tokens/s on each chip;
* :func:`xla_point`: the same split from XLA's compiled generate loop per token
  (:func:`kvjax.analysis.costs.analyze_loop`, loop-corrected and attributed);
* :func:`measure_point`: the loop's measured seconds per step here, tokens/s = B / step;
* :func:`measure_ragged_vs_lockstep`: the ragged loop's step time over the lockstep one;
* :func:`measure_wall`: caches allocated for real, one sequence at a time, under a byte
  budget, until the next one does not fit, beside ``theory.max_batch``;
* :func:`paged_wall_table`, :func:`measure_paged_wall`: the same wall for paged caches
  (:mod:`kvjax.cache.paged`) serving requests of varying length: per-slot reservation
  holds t tokens per request, pages hold P·ceil(l/P) (Kwon et al. 2023, sec. 4.2;
  :func:`kvjax.analysis.paging.capacity`), and a real pool under the budget admits
  requests through the engine's allocator until the next one does not fit.

Units: bytes, FLOP, seconds; a "sequence" is one row of the batch holding ``t`` tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import compress as compress_lib
from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.analysis import costs, hardware, paging, theory
from kvjax.cache import paged
from kvjax.config import ModelConfig
from kvjax.inference import decode, memory, ragged
from kvjax.config import SamplingConfig
from kvjax.models import model as model_lib

__all__ = ["SHAPES", "LEVERS", "lever_config", "batch_sizes", "theory_point", "xla_point",
           "measure_point", "measure_ragged_vs_lockstep", "WallResult", "measure_wall",
           "wall_table", "wall_lengths", "paged_wall_table", "PagedWallResult",
           "measure_paged_wall", "BLOG_FREE_BYTES"]

SHAPES = ("blog", "smollm2")
LEVERS = ("mha", "gqa", "mqa", "mla", "window")
# The blog's "~60 GB available for KV caches" on an 80 GB A100, read as MiB (its "MB"):
# 60,000 MiB / 96 MiB per sequence at 4K = 625 (theory.max_batch's docstring).
BLOG_FREE_BYTES = 60_000 * 2**20


def lever_config(shape: str, lever: str, dtype: str = "float32", **overrides) -> ModelConfig:
    """The model ``shape`` ('blog': D=512, L=12, h=8; 'smollm2': SmolLM2-135M) with one
    lever pulled (``presets.variant``): 'mha' (K = N), 'gqa' (blog g = 2 KV heads, the
    blog's 4x; SmolLM2 its published K = 3), 'mqa' (K = 1), 'mla' (absorbed, C = d_model,
    R = 64: the blog's d_c example), 'window' (MHA with W = 512, the blog's w). The layer
    stack is the backend's default (``scan_layers=None``) unless overridden.

    Raises:
      ValueError: an unknown shape or lever (naming the allowed ones).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}; allowed: one of {SHAPES}")
    if lever not in LEVERS:
        raise ValueError(f"lever={lever!r}; allowed: one of {LEVERS}")
    overrides.setdefault("scan_layers", None)  # the backend's default (unrolled on CPU)
    base = (presets.blog_model if shape == "blog" else presets.smollm2_135m)(dtype, **overrides)
    n = base.num_heads
    if lever == "mha":
        return presets.variant(base, num_kv_heads=n)
    if lever == "gqa":
        return presets.variant(base, num_kv_heads=2 if shape == "blog" else 3)
    if lever == "mqa":
        return presets.variant(base, num_kv_heads=1)
    if lever == "mla":
        return presets.variant(base, kv_lora_rank=base.d_model)
    return presets.variant(base, num_kv_heads=n, window_size=512)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... up to ``max_batch`` (included when not a power of two)."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch}; allowed: >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


def _phases(cfg: ModelConfig, t: int, batch: int) -> dict:
    sb = theory.step_bytes(cfg, t, batch)
    sf = theory.step_flops(cfg, t, batch)
    return {"weights_bytes": sb.weights, "weights_flops": sf.proj + sf.mlp + sf.lm_head,
            "kv_bytes": sb.kv_read + sb.kv_write, "kv_flops": sf.attn + sf.kv_rebuild}


def theory_point(cfg: ModelConfig, t: int, batch: int, chips=None) -> dict:
    """The blog's step split by phase at context ``t`` for ``batch`` sequences.

    Returns a flat dict: weights_bytes (constant in B), weights_flops (∝ B), kv_bytes
    (∝ B·t: cache read + the new token's write), kv_flops (∝ B·t), their intensities
    ``*_intensity`` (FLOP/byte), the step's total bytes / FLOPs / intensity, and per chip
    (default A100-80GB, H100-SXM, H200) its ridge point and roofline tokens/s =
    B / max(bytes / bandwidth, FLOPs / peak) at ``cfg.dtype``.
    """
    p = _phases(cfg, t, batch)
    total_b = p["weights_bytes"] + p["kv_bytes"]
    total_f = p["weights_flops"] + p["kv_flops"]
    row = {"batch": batch, "context": t, **p,
           "weights_intensity": p["weights_flops"] / p["weights_bytes"],
           "kv_intensity": p["kv_flops"] / p["kv_bytes"],
           "bytes": total_b, "flops": total_f, "intensity": total_f / total_b}
    chips = chips or [hardware.CHIPS[n] for n in ("A100-80GB", "H100-SXM", "H200")]
    for chip in chips:
        step = theory.step_time(total_b, total_f, chip, cfg.dtype)
        row[f"{chip.name}_ridge"] = chip.ridge_point(cfg.dtype)
        row[f"{chip.name}_tokens_per_s"] = batch / step
    return row


def xla_point(cfg: ModelConfig, t: int, batch: int) -> dict:
    """XLA's compiled generate loop per generated step (loop-corrected, from shapes: no
    allocation), split like :func:`theory_point`: weights phase = bytes of weight
    buffers (and their copies) and FLOPs of ops reading them; KV phase = cache reads,
    writes and copies and FLOPs of ops reading the cache. Also the totals and the
    ratios XLA / theory per phase."""
    step = costs.analyze_loop(cfg, t, batch)
    a = step.attribution
    wb = a.bytes["weights"] + a.bytes["weight_copies"]
    kb = a.bytes["kv_read"] + a.bytes["kv_write"] + a.bytes["kv_copies"]
    p = _phases(cfg, t, batch)
    return {"xla_weights_bytes": wb, "xla_weights_flops": a.flops["weights"],
            "xla_kv_bytes": kb, "xla_kv_flops": a.flops["kv"],
            "xla_other_bytes": a.bytes["other"], "xla_bytes": step.xla.bytes,
            "xla_flops": step.xla.flops,
            "xla_weights_intensity": a.flops["weights"] / wb if wb else float("nan"),
            "xla_kv_intensity": a.flops["kv"] / kb if kb else float("nan"),
            "xla_over_theory_weights_bytes": wb / p["weights_bytes"],
            "xla_over_theory_kv_bytes": kb / p["kv_bytes"],
            "xla_over_theory_weights_flops": a.flops["weights"] / p["weights_flops"],
            "xla_over_theory_kv_flops": a.flops["kv"] / p["kv_flops"]}


def measure_point(cfg: ModelConfig, params, t: int, batch: int, steps=(2, 6),
                  repeats: int = 2) -> dict:
    """Measured seconds per step of the compiled generate loop at context ``t`` for
    ``batch`` rows (:func:`kvjax.analysis.costs.measure_loop_seconds`: two loop lengths,
    fixed cost cancelled), tokens/s = B / step, achieved bytes/s of theory's bytes."""
    m = costs.measure_loop_seconds(cfg, params, t, batch, steps=steps, repeats=repeats)
    s = m["per_token_s"]
    sb = theory.step_bytes(cfg, t, batch).total
    return {"step_s": s, "tokens_per_s": batch / s if s > 0 else float("nan"),
            "achieved_bytes_per_s": sb / s if s > 0 else float("nan"),
            "loop_steps": m["steps"]}


def measure_ragged_vs_lockstep(cfg: ModelConfig, params, t: int, batch: int,
                               steps=(4, 12), repeats: int = 3) -> dict:
    """Seconds per step of the ragged loop (:func:`ragged.generate_ragged_program`, per-row
    scatter writes and ``num_valid``) and of the lockstep loop
    (:func:`decode.generate_program`, one in-place update), same B and t, every row full
    at t - n2 - 1 tokens; the two are run alternately, ``repeats`` rounds after one that
    compiles, each at n1 and n2 steps (fixed cost cancelled). Returns both and their
    ratio (ragged / lockstep)."""
    n1, n2 = steps
    base = compress_lib.full_cache(cfg, batch, t - n2)
    if cache_lib.num_slots(cfg, t) != base.num_slots:
        big = cache_lib.init_cache(cfg, batch, t)
        base = big.replace(positions=big.positions.at[:, :base.num_slots].set(base.positions),
                           length=base.length)
    pos0, len0 = np.asarray(base.positions), np.asarray(base.length)
    first = jnp.zeros((batch,), jnp.int32)
    keys = ragged.row_keys_for(None, batch)
    sampling = SamplingConfig()
    buf_len = cache_lib.policy_for(cfg).buffer_len(base.num_slots, n2)
    caches = {"lockstep": base, "ragged": jax.tree.map(jnp.copy, base).replace(ragged=True)}

    def call(kind, n):
        c = caches[kind]
        if kind == "lockstep":
            out = decode.generate_program(params, first, c, jnp.int32(n), jax.random.key(0),
                                          jnp.int32(-1), cfg=cfg, sampling=sampling)
        else:
            out = ragged.generate_ragged_program(
                params, first, c, jnp.full((batch,), n, jnp.int32), keys, jnp.int32(-1),
                cfg=cfg, sampling=sampling, buf_len=buf_len)
        jax.block_until_ready(out[0])
        caches[kind] = out[2].replace(positions=jnp.asarray(pos0), length=jnp.asarray(len0))

    times = {k: {n1: [], n2: []} for k in caches}
    for r in range(repeats + 1):
        for n in (n1, n2):
            for kind in caches:
                t0 = time.perf_counter()
                call(kind, n)
                if r:
                    times[kind][n].append(time.perf_counter() - t0)
    per = {k: (np.median(v[n2]) - np.median(v[n1])) / (n2 - n1) for k, v in times.items()}
    return {"batch": batch, "context": t, "lockstep_step_s": float(per["lockstep"]),
            "ragged_step_s": float(per["ragged"]),
            "ratio": float(per["ragged"] / per["lockstep"])}


@dataclasses.dataclass
class WallResult:
    """The memory wall at context ``t`` under a byte budget, measured and in theory.

    Attributes:
      measured: sequences whose caches were allocated before the next did not fit.
      theory: ``theory.max_batch(cfg, t, budget, reserve = weights)``.
      per_sequence_bytes: one sequence's KV cache (theory.kv_cache_bytes), bytes.
      allocated_bytes: bytes of every array allocated (weights + caches, bookkeeping
        included), summed over ``jax.live_arrays``-style leaf sizes, at the wall.
      rss_growth_bytes: the process's resident memory growth over the allocation (the
        OS's view; None where /proc is missing).
      budget_bytes, weights_bytes: as given / allocated.
      seconds: time spent allocating.
    """

    measured: int
    theory: int
    per_sequence_bytes: int
    allocated_bytes: int
    rss_growth_bytes: int | None
    budget_bytes: int
    weights_bytes: int
    seconds: float


def _rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:
        return None


def _check_budget(cfg: ModelConfig, budget_bytes: int, available: int | None) -> int:
    """The weights' bytes of ``cfg``, after refusing (MemoryCheckError) a budget above the
    memory available here (``available``, or :func:`memory.available_bytes`)."""
    weights = cache_lib.total_bytes(model_lib.param_shapes(cfg))
    if available is None:
        available, source = memory.available_bytes()
    else:
        source = "given"
    if available is not None and budget_bytes > available:
        raise memory.MemoryCheckError(
            f"--memory_budget_gb asks for {budget_bytes:,} bytes ({budget_bytes / 2**30:.3f} "
            f"GiB); only {available:,} bytes are available ({source}); allowed: a budget "
            "<= the memory available")
    return weights


def measure_wall(cfg: ModelConfig, t: int, budget_bytes: int, limit: int = 100_000,
                 available: int | None = None) -> WallResult:
    """Allocates, for real, the weights and then one cache of ``t`` tokens per sequence
    (``init_cache(cfg, 1, t)``, zero-filled so the pages are touched) while the total of
    what is allocated plus the next sequence stays within ``budget_bytes``; frees it all.

    Raises:
      kvjax.inference.memory.MemoryCheckError: the budget exceeds the memory available
        here, or cannot hold the weights and one sequence; the message names the budget
        and the bytes asked for. Checked before anything is allocated.
    """

    per_seq_spec = cache_lib.total_bytes(cache_lib.cache_spec(cfg, 1, t))
    weights = _check_budget(cfg, budget_bytes, available)
    if weights + per_seq_spec > budget_bytes:
        raise memory.MemoryCheckError(
            f"a budget of {budget_bytes:,} bytes ({budget_bytes / 2**30:.2f} GiB) cannot hold "
            f"the weights ({weights:,} bytes) and one sequence at context {t} "
            f"({per_seq_spec:,} bytes): {weights + per_seq_spec:,} bytes asked for; allowed: "
            f"--memory_budget_gb >= {(weights + per_seq_spec) / 2**30:.3f}")
    start, rss0 = time.perf_counter(), _rss()
    params = model_lib.init_params(cfg, 0)
    jax.block_until_ready(params)
    held = cache_lib.total_bytes(params)
    caches = []
    while len(caches) < limit and held + per_seq_spec <= budget_bytes:
        c = cache_lib.init_cache(cfg, 1, t)
        jax.block_until_ready(c)
        caches.append(c)
        held += cache_lib.total_bytes(c)
    rss1 = _rss()
    n = len(caches)
    del caches, params
    gc.collect()
    return WallResult(
        measured=n, theory=theory.max_batch(cfg, t, budget_bytes, reserve_bytes=weights),
        per_sequence_bytes=theory.kv_cache_bytes(cfg, t), allocated_bytes=held,
        rss_growth_bytes=None if rss0 is None or rss1 is None else rss1 - rss0,
        budget_bytes=int(budget_bytes), weights_bytes=weights,
        seconds=time.perf_counter() - start)


def wall_table(shape: str, t: int, chips=None, reserve_fraction: float = 0.25,
               dtype: str = "float16") -> list[dict]:
    """``theory.max_batch`` per lever and chip at context ``t`` (counts of sequences).

    Memory for caches = the chip's HBM capacity (bytes) - the model's weights at
    ``dtype`` - a stated reserve of ``reserve_fraction`` of the capacity (activations,
    runtime; 0.25 leaves 60e9 B of an 80e9 B A100 before the weights, the blog's "~60
    GB"). The blog's own quotient, 60,000 MiB / 96 MiB = 625 at 4K, is
    ``theory.max_batch(cfg, 4096, BLOG_FREE_BYTES)``. Also each lever's factor over MHA
    (KV bytes per sequence).

    Raises:
      ValueError: reserve_fraction outside [0, 1).
    """
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction}; allowed: a number in [0, 1)")
    chips = chips or [hardware.CHIPS[n] for n in ("A100-80GB", "H100-SXM", "H200")]
    rows = []
    for lever in LEVERS:
        cfg = lever_config(shape, lever, dtype)
        w = theory.weight_bytes(cfg)
        row = {"shape": shape, "lever": lever, "context": t, "dtype": dtype,
               "kv_bytes_per_sequence": theory.kv_cache_bytes(cfg, t), "weights_bytes": w}
        for chip in chips:
            cap = chip.hbm_capacity_bytes
            reserve = reserve_fraction * cap + w
            row[f"{chip.name}_free_bytes"] = cap - reserve
            row[chip.name] = theory.max_batch(cfg, t, cap, reserve_bytes=reserve)
        rows.append(row)
    mha = rows[0]
    for row in rows:
        row["factor_over_mha"] = mha["kv_bytes_per_sequence"] / row["kv_bytes_per_sequence"]
    return rows


def wall_lengths(t: int, n: int = 256) -> list[int]:
    """Request lengths for the paged wall: ``n`` evenly spaced over 1..t (tokens held at
    the end of each request; their mean is about t / 2). A stated distribution, not a
    measured one: ``experiments.serve`` measures its own requests' lengths."""
    if t < 1 or n < 1:
        raise ValueError(f"t={t}, n={n}; allowed: integers >= 1")
    return sorted({max(1, round(1 + i * (t - 1) / max(n - 1, 1))) for i in range(n)})


def _held(cfg: ModelConfig, lengths, page_size: int) -> list[int]:
    """Tokens a paged row holds for requests of ``lengths``: a window's row frees the
    pages that slide out, so it holds its W (+ sinks) at most; a compressed row holds
    its fixed W = kv_budget + recent_slots whatever its length
    (:func:`kvjax.analysis.paging.row_slots`)."""
    w = paging.row_slots(cfg, page_size)
    return [w or theory.tokens_held(cfg, x) for x in lengths]


def paged_wall_table(shape: str, t: int, page_size: int, chips=None,
                     reserve_fraction: float = 0.25, dtype: str = "float16",
                     lengths=None) -> list[dict]:
    """The wall of :func:`wall_table` (same free bytes per chip) for requests of up to
    ``t`` tokens whose lengths are ``lengths`` (default :func:`wall_lengths`), in counts
    of requests held at once: 'reserved' (a row of t per request, as the dense slot
    engine: ``theory.max_batch``), 'paged' (P·ceil(l/P) tokens each, the mean over
    ``lengths``) and 'paged_full' (every request at t: paging alone buys at most P - 1
    tokens per request). Raises ValueError for page_size < 1 or a bad reserve_fraction.
    """
    chips = chips or [hardware.CHIPS[n] for n in ("A100-80GB", "H100-SXM", "H200")]
    walls = {r["lever"]: r for r in wall_table(shape, t, chips, reserve_fraction, dtype)}
    lengths = wall_lengths(t) if lengths is None else list(lengths)
    rows = []
    for lever in LEVERS:
        cfg = lever_config(shape, lever, dtype)
        held, full = _held(cfg, lengths, page_size), _held(cfg, [t], page_size)
        row = {"shape": shape, "lever": lever, "context": t, "dtype": dtype,
               "page_size": page_size, "mean_length": sum(lengths) / len(lengths),
               "mean_paged_tokens": sum(paging.paged_tokens(x, page_size) for x in held)
               / len(held)}
        for chip in chips:  # wall_table's free bytes (HBM less reserve and weights)
            free = walls[lever][f"{chip.name}_free_bytes"]
            row[f"{chip.name}_reserved"] = walls[lever][chip.name]
            if free <= 0:
                row[f"{chip.name}_paged"] = row[f"{chip.name}_paged_full"] = 0
                continue
            row[f"{chip.name}_paged"] = paging.capacity(cfg, free, held, t, page_size).paged
            row[f"{chip.name}_paged_full"] = paging.capacity(cfg, free, full, t,
                                                             page_size).paged
        rows.append(row)
    return rows


@dataclasses.dataclass
class PagedWallResult:
    """The paged memory wall measured: a pool allocated for real, requests admitted.

    Attributes:
      measured: requests admitted (:class:`kvjax.cache.paged.PageAllocator`, cycling
        through the lengths) before the next did not fit the pool.
      theory: :func:`kvjax.analysis.paging.capacity`'s ``paged`` for the pool's bytes.
      reserved: requests of t tokens the same bytes hold as dense rows
        (``theory.max_batch``).
      num_pages: pages of the pool (per layer and tensor); page_size: P.
      pool_bytes: the pool's bytes allocated; budget_bytes, weights_bytes: as given.
      seconds: time spent.
    """

    measured: int
    theory: int
    reserved: int
    num_pages: int
    page_size: int
    pool_bytes: int
    budget_bytes: int
    weights_bytes: int
    seconds: float


def measure_paged_wall(cfg: ModelConfig, t: int, budget_bytes: int, page_size: int,
                       lengths=None, available: int | None = None) -> PagedWallResult:
    """Allocates, for real, the weights and one page pool of the bytes left under
    ``budget_bytes`` (zero-filled, so its memory is touched), then admits requests of
    ``lengths`` (default :func:`wall_lengths` of ``t``; a window's rows hold their
    window, a compressed row its fixed kv_budget + recent_slots) one after another
    through the paged engine's allocator until the next does not fit; frees it all.

    Raises:
      kvjax.inference.memory.MemoryCheckError: the budget exceeds the memory available
        here, or cannot hold the weights and one request of t tokens (named), before
        anything is allocated.
      ValueError: page_size below 1; a compression pages cannot hold
        (:func:`kvjax.analysis.paging.row_slots`); ``cfg.layer_windows`` (its local layers keep
        per-row rings beside the pool: docs/decisions/0031-paged-layer-windows-rings.md).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; allowed: an integer >= 1")
    if cfg.layer_windows is not None:
        raise ValueError(f"model.layer_windows={cfg.layer_windows} for the paged wall; "
                         "allowed: None (a local layer's rings are per row, not pool pages)")
    lengths = wall_lengths(t) if lengths is None else list(lengths)
    per_page = paged.page_bytes(cfg, page_size)
    weights = _check_budget(cfg, budget_bytes, available)
    held = _held(cfg, lengths, page_size)
    one = paged.pages_for(_held(cfg, [t], page_size)[0], page_size) * per_page
    if weights + one > budget_bytes:
        raise memory.MemoryCheckError(
            f"a budget of {budget_bytes:,} bytes cannot hold the weights ({weights:,} "
            f"bytes) and one request of t={t} tokens on pages of {page_size} ({one:,} "
            f"bytes); allowed: --memory_budget_gb >= {(weights + one) / 2**30:.3f}")
    start = time.perf_counter()
    params = model_lib.init_params(cfg, 0)
    num_pages = int((budget_bytes - cache_lib.total_bytes(params)) // per_page)
    max_pages = paged.pages_for(max(held), page_size)
    pool = paged.init_paged_cache(cfg, 1, num_pages, page_size, max_pages)
    jax.block_until_ready(pool)
    pool_bytes = num_pages * per_page
    alloc = paged.PageAllocator(num_pages, page_size)
    order = np.random.default_rng(0).permutation(len(held))  # lengths in a seeded order
    n = 0
    try:
        while n < 10_000_000:
            x = held[order[n % len(held)]]
            alloc.admit(n, [0] * x, x)
            n += 1
    except paged.PoolExhausted:
        pass
    alloc.check()
    del pool, params
    gc.collect()
    return PagedWallResult(
        measured=n, theory=paging.capacity(cfg, pool_bytes, held, max(held), page_size).paged,
        reserved=theory.max_batch(cfg, t, pool_bytes), num_pages=num_pages,
        page_size=page_size, pool_bytes=pool_bytes, budget_bytes=int(budget_bytes),
        weights_bytes=weights, seconds=time.perf_counter() - start)
