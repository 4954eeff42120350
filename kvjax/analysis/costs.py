"""The cost hook: a decode step's cost four ways, side by side.

1. theory: the blog's closed forms (:mod:`kvjax.theory`);
2. jaxpr: ``jax.experimental.roofline`` over the step's jaxpr, loop-corrected
   (:mod:`kvjax.roofline`): each dot's operands and output once, before XLA fuses,
   converts or copies anything;
3. compiled: XLA's ``cost_analysis()`` of the jitted step, loop-corrected
   (:mod:`kvjax.hlo_cost`), attributed to KV-cache reads/writes, weight reads, copies
   and the rest, plus ``memory_analysis()``;
4. measured: median wall time of the compiled step on the local device, as achieved
   bytes/s.

Everything but (4) compiles from ``jax.ShapeDtypeStruct``s, so a 128K-token cache or a
65B-shaped layer can be analysed on a laptop without allocating it.

The step analysed at context ``t`` uses a dense cache of S = t slots (W for a window): the
step reads every slot, masked or not, plus the new token's key/value, which is the
theory's t (+1 key, ignored).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import kernels
from kvjax import planner
from kvjax.cache import compress as compress_lib
from kvjax.cache import paged
from kvjax.analysis import hlo_cost, paging, roofline, theory
from kvjax.inference import decode, memory
from kvjax.config import ModelConfig, SamplingConfig
from kvjax.models import flash, model
from kvjax.models.attention import SCORING_SCOPE
from kvjax.native import prefill as native_prefill


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One compiled program next to theory.

    Attributes:
      name: 'decode_step', 'generate' or 'prefill'.
      cfg, batch, context: what was compiled (context = tokens in the cache).
      xla: loop-corrected XLA figures (raw ones inside).
      memory: memory_analysis() bytes (argument/output/alias/temp/code).
      theory_flops, theory_bytes: the blog's FLOP and bytes for the same work.
      theory_parts: named theory terms (bytes: weights, kv_read, kv_write; FLOPs: ...).
      cache_bytes: bytes of the cache pytree's per-token tensors.
      attribution: XLA's bytes/FLOPs split into KV reads/writes, weights, copies, other
        (None if not requested).
      jaxpr: the loop-corrected jaxpr-level cost (None if not requested).
      once_per_call: for a per-token view of the generate loop (:func:`analyze_loop`):
        the FLOP and bytes the program spends once per call, outside the loop body
        (e.g. weights widened to float32 before the loop), with their attribution
        parts; not included in the per-token figures. None otherwise.
    """

    name: str
    cfg: ModelConfig
    batch: int
    context: int
    xla: hlo_cost.CostReport
    memory: dict
    theory_flops: float
    theory_bytes: float
    theory_parts: dict
    cache_bytes: int
    attribution: hlo_cost.Attribution | None = None
    jaxpr: roofline.JaxprCost | None = None
    once_per_call: dict | None = None

    @property
    def flops_ratio(self) -> float:
        """XLA (loop-corrected) FLOP / theory FLOP."""
        return self.xla.flops / self.theory_flops

    @property
    def bytes_ratio(self) -> float:
        """XLA (loop-corrected) bytes accessed / theory bytes."""
        return self.xla.bytes / self.theory_bytes

    def as_dict(self, seconds: float | None = None, nested: bool = True) -> dict:
        """The one serialisation of a program's cost (JSON files, CSV rows, reports).

        Flat keys: what was compiled (model, variant, attention, num_kv_heads, window /
        window_size, layer_windows (a window or None per layer), num_sink_tokens, mla_absorb, scan_layers, kv_layout, dtype, kv_dtype,
        backend, batch, context, name); theory_* (bytes, FLOP and the byte terms
        weights / kv_read / kv_write); jaxpr_* (dots only, loop-corrected); xla_* (loop-
        corrected and raw, plus the attribution's byte parts ``xla_<part>``); ratios;
        memory figures (alias_bytes, temp_bytes); cache_bytes; measured_s and achieved
        bytes/s of theory and XLA bytes when ``seconds`` (per program run) is given.
        ``nested`` adds the structured parts: memory, theory_parts, attribution, jaxpr.
        """
        c = self.cfg
        variant = c.attention + ("" if not c.is_mla else
                                 "-absorbed" if c.mla_absorb else "-naive")
        nan = float("nan")
        tb = self.theory_parts.get("bytes", {})
        row = {
            "name": self.name, "model": c.name, "variant": variant,
            "attention": c.attention, "num_kv_heads": c.num_kv_heads,
            "window": c.window_size, "window_size": c.window_size,
            "layer_windows": None if c.layer_windows is None else list(c.layer_windows),
            "num_sink_tokens": c.num_sink_tokens,
            "kv_compression": c.kv_compression, "kv_budget": c.kv_budget,
            "mla_absorb": c.mla_absorb if c.is_mla else None,
            "scan_layers": c.scan_layers,
            "kv_layout": None if c.is_mla else
            f"k {c.cache_layout('k')}, v {c.cache_layout('v')}",
            "dtype": c.dtype, "kv_dtype": c.kv_dtype or c.dtype, "backend": c.backend,
            "batch": self.batch, "context": self.context,
            "theory_bytes": self.theory_bytes, "theory_flops": self.theory_flops,
            "theory_weights": tb.get("weights"), "theory_kv_read": tb.get("kv_read"),
            "theory_kv_write": tb.get("kv_write"),
            "jaxpr_bytes": self.jaxpr.hbm_bytes if self.jaxpr else nan,
            "jaxpr_flops": self.jaxpr.flops if self.jaxpr else nan,
            "jaxpr_unfused_bytes": self.jaxpr.unfused_hbm_bytes if self.jaxpr else nan,
            "xla_bytes": self.xla.bytes, "xla_flops": self.xla.flops,
            "xla_raw_bytes": self.xla.raw_bytes, "xla_raw_flops": self.xla.raw_flops,
            "xla_complete": self.xla.complete, "xla_uncosted_bytes": self.xla.uncosted_bytes,
            "bytes_ratio": self.bytes_ratio, "flops_ratio": self.flops_ratio,
            "alias_bytes": self.memory.get("alias_bytes"),
            "temp_bytes": self.memory.get("temp_bytes"), "cache_bytes": self.cache_bytes,
            "measured_s": nan if seconds is None else seconds,
            "theory_bytes_per_s": nan if not seconds else self.theory_bytes / seconds,
            "xla_bytes_per_s": nan if not seconds else self.xla.bytes / seconds,
        }
        if self.attribution is not None:
            row.update({f"xla_{k}": v for k, v in self.attribution.bytes.items()})
        if self.once_per_call is not None:
            row["once_per_call_bytes"] = self.once_per_call["bytes"]
            row["once_per_call_flops"] = self.once_per_call["flops"]
        if nested:
            row.update({
                "xla_custom_calls": list(self.xla.custom_calls), "memory": self.memory,
                "theory_parts": self.theory_parts,
                "attribution": None if self.attribution is None else self.attribution.as_dict(),
                "jaxpr": None if self.jaxpr is None else self.jaxpr.as_dict()})
        return row


def planned(cfg: ModelConfig, batch: int, context: int, rows=()) -> ModelConfig:
    """``cfg`` as is when it has a plan, else with the plan of a program of ``batch`` rows
    over a cache of ``context`` slots (:func:`kvjax.planner.resolve`, here on the host,
    before the program is traced; ``rows``: its other weight-product row counts)."""
    if cfg.plan is not None:
        return cfg
    return planner.resolve(cfg, max_seq_len=context, batch_sizes=(batch,), rows=rows)


def _token_spec(batch: int):
    return jax.ShapeDtypeStruct((batch, 1), jnp.int32)


def _specs(cfg: ModelConfig, batch: int, max_seq_len: int):
    """(parameters as the decode programs take them, fused projections included:
    :func:`kvjax.models.model.decode_param_shapes`; the cache, with its scoring state
    when ``cfg`` compresses every N steps, so a loop compiled from it re-scores), as
    ShapeDtypeStructs."""
    cache = cache_lib.cache_spec(cfg, batch, max_seq_len)
    if cfg.kv_rescores:
        cache = cache.replace(schedule=jax.eval_shape(
            lambda: compress_lib.empty_schedule(cfg, batch)))
    return model.decode_param_shapes(cfg), cache


def analysis_compiler_options() -> dict | None:
    """XLA options for programs compiled here only to be analysed, never run
    (:func:`kvjax.backend.analysis_compiler_options` for the process's compiler)."""
    return backend_lib.analysis_compiler_options(backend_lib.current())


def compile_decode_step(cfg: ModelConfig, batch: int, context: int,
                        compiler_options: dict | None = None):
    """Compiles one decode step against a cache of ``context`` slots, from shapes only."""
    cfg = planned(cfg, batch, context)
    params, cache = _specs(cfg, batch, context)
    return decode.decode_step.lower(params, _token_spec(batch), cache, cfg=cfg).compile(
        compiler_options=compiler_options)


def compile_prefill(cfg: ModelConfig, batch: int, prompt_len: int, max_seq_len: int,
                    compiler_options: dict | None = None, fresh: bool = True):
    """Compiles the prefill of ``prompt_len`` tokens into a cache of ``max_seq_len`` slots
    (``fresh``: an empty one, as ``decode.prefill`` compiles for it; False: a cache
    that may hold earlier tokens, e.g. a chunk of ``decode.prefill_chunked``)."""
    cfg = planned(cfg, batch, max_seq_len, (batch * prompt_len,))
    params, cache = _specs(cfg, batch, max_seq_len)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    return decode.prefill_program.lower(params, tokens, cache, cfg=cfg, fresh=fresh).compile(
        compiler_options=compiler_options)


def compression_overhead(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> dict:
    """Lever 5's scoring overhead, counted by the compiler: the compiled prefill of a
    ``prompt_len``-token prompt with ``cfg.kv_compression`` (prefill, scores, top-k,
    gather) minus the same prefill into a full cache without it
    (:func:`kvjax.cache.compress.prompt_config`). Once per prompt, not per step.

    Returns:
      {'flops', 'bytes'}: the difference (loop-corrected XLA figures), and
      'prefill_flops', 'prefill_bytes' of the compressed prefill itself.
    Raises:
      ValueError: ``cfg`` without kv_compression.
    """
    if cfg.kv_compression is None:
        raise ValueError("compression_overhead of a config without model.kv_compression")
    opts = analysis_compiler_options()
    plain = compress_lib.prompt_config(cfg)
    both = [hlo_cost.loop_aware_cost(compile_prefill(c, batch, prompt_len, n, opts))
            for c, n in ((cfg, compress_lib.prompt_slots(cfg, prompt_len)),
                         (plain, prompt_len))]
    return {"flops": both[0].flops - both[1].flops, "bytes": both[0].bytes - both[1].bytes,
            "prefill_flops": both[0].flops, "prefill_bytes": both[0].bytes}


def compile_paged_decode_step(cfg: ModelConfig, context: int, page_size: int,
                              batch: int = 1, compiler_options: dict | None = None):
    """Compiles one decode step of ``batch`` rows over a paged cache
    (:mod:`kvjax.cache.paged`) whose rows hold ``context`` tokens on ceil(context / P)
    pages each (a pool of exactly those pages), the cache donated, from shapes only.
    Compressed rows (an evicting ``cfg.kv_compression``, schedule 'prefill'): each row
    holds its fixed W / P pages (W = kv_budget + recent_slots,
    :func:`kvjax.analysis.paging.row_tokens`; decision 0041) whatever ``context``.

    Raises:
      kvjax.config.ConfigError: a compression the paged engine refuses (schedule
        'every_n', per-layer budgets, W not whole pages), naming the value.
    """
    pages = paging.row_tokens(cfg, context, page_size) // page_size
    if cfg.plan is None:  # the plan of the paged class (a rule's formulation untimed)
        cfg = planner.resolve(cfg, max_seq_len=pages * page_size, batch_sizes=(batch,),
                              page_size=page_size)
    cache = jax.eval_shape(lambda: paged.init_paged_cache(cfg, batch, batch * pages,
                                                          page_size, pages))

    def step(params, tokens, cache):
        pos = jnp.minimum(cache.length, context - 1)[:, None]
        return model.forward(params, cfg, tokens, pos, cache)

    return jax.jit(step, donate_argnums=2).lower(
        model.param_shapes(cfg), _token_spec(batch), cache).compile(
        compiler_options=compiler_options)


def analyze_paged_decode_step(cfg: ModelConfig, context: int, page_size: int,
                              batch: int = 1) -> dict:
    """Loop-corrected compiled bytes and FLOPs of one paged decode step at ``context``
    (:func:`compile_paged_decode_step`) beside theory: with a read-time page selection
    (Quest, ``cfg.kv_selects_pages``) :func:`kvjax.analysis.theory.page_selection_step_bytes`
    (the budget's pages plus every page's key bounds), else :func:`theory.step_bytes`
    (every token; compressed rows, an evicting ``cfg.kv_compression``: min(t, W) tokens,
    W = kv_budget + recent_slots, the dense compressed step's theory, while the step
    reads the row's fixed W / P pages whatever ``context``).

    Returns:
      {'context', 'page_size', 'batch', 'kv_compression', 'kv_budget', 'row_pages'
      (pages of one row: ceil(context / P), or a compressed row's W / P), 'xla_bytes',
      'xla_flops', 'theory': {...bytes}, 'theory_bytes', 'xla_over_theory',
      'kernel_bytes', 'counted_bytes', 'counted_over_theory', 'scoring_bytes',
      'attribution'}: 'kernel_bytes' are the custom calls' (a native kernel reading
      pages in place: the pages of its block tables,
      :func:`kvjax.analysis.hlo_cost.kernel_operand_bytes`), 'counted_bytes' XLA's plus
      them (the report's '+kernels'); 'scoring_bytes' the compiled bytes of a page
      selection's scoring (the ops under
      :data:`kvjax.models.attention.SCORING_SCOPE`: the bounds read, the page scores,
      the top-k; 0 without one); 'attribution' splits the compiled bytes
      (:func:`kvjax.analysis.hlo_cost.attribute`).
    """
    compiled = compile_paged_decode_step(cfg, context, page_size, batch,
                                         analysis_compiler_options())
    row_pages = paging.row_tokens(cfg, context, page_size) // page_size
    xla = hlo_cost.loop_aware_cost(compiled)
    ops = hlo_cost.op_costs(compiled)
    att = hlo_cost.attribute(ops).as_dict()
    scoring = sum(op.count * op.bytes for op in ops if SCORING_SCOPE in op.op_name)
    if cfg.kv_selects_pages:
        th = theory.page_selection_step_bytes(cfg, context, page_size, batch)
    else:
        th = theory.step_bytes(cfg, context, batch).as_dict()
    return {"context": context, "page_size": page_size, "batch": batch,
            "kv_compression": cfg.kv_compression, "kv_budget": cfg.kv_budget,
            "row_pages": row_pages, "xla_bytes": float(xla.bytes),
            "xla_flops": float(xla.flops), "theory": th,
            "theory_bytes": float(th["total"]), "xla_over_theory": xla.bytes / th["total"],
            "kernel_bytes": float(xla.uncosted_bytes),
            "counted_bytes": float(xla.bytes + xla.uncosted_bytes),
            "counted_over_theory": (xla.bytes + xla.uncosted_bytes) / th["total"],
            "scoring_bytes": float(scoring), "attribution": att}


def analyze_decode_step(cfg: ModelConfig, context: int, batch: int = 1, compiled=None,
                        attribute: bool = True, jaxpr: bool = True) -> StepCost:
    """Theory, jaxpr-level and loop-corrected XLA cost of one decode step at ``context``.

    Theory bytes are the blog's B_step(t) = weights read per step + KV read, plus the new
    token's KV write; FLOPs are :func:`kvjax.theory.step_flops`. ``attribute`` splits
    XLA's figures (:func:`kvjax.hlo_cost.attribute`); ``jaxpr`` adds
    :func:`kvjax.roofline.jaxpr_cost` of the same step. Nothing is allocated.
    """
    cfg = planned(cfg, batch, context)
    compiled = compiled or compile_decode_step(cfg, batch, context,
                                               analysis_compiler_options())
    sb = theory.step_bytes(cfg, context, batch)
    sf = theory.step_flops(cfg, context, batch)
    params, cache = _specs(cfg, batch, context)
    jc = None
    if jaxpr:
        jc = roofline.jaxpr_cost(functools.partial(decode.decode_step, cfg=cfg), params,
                                 _token_spec(batch), cache)
    return StepCost(
        name="decode_step", cfg=cfg, batch=batch, context=context,
        xla=hlo_cost.loop_aware_cost(compiled), memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(sf.total), theory_bytes=float(sb.total),
        theory_parts={"bytes": sb.as_dict(), "flops": sf.as_dict()},
        cache_bytes=cache_lib.cache_bytes(cache),
        attribution=hlo_cost.attribute(hlo_cost.op_costs(compiled)) if attribute else None,
        jaxpr=jc)


def _generate_args(cfg: ModelConfig, batch: int, context: int):
    params, cache = _specs(cfg, batch, context)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return (params, jax.ShapeDtypeStruct((batch,), jnp.int32), cache, scalar,
            jax.random.key(0), scalar)


def compile_generate(cfg: ModelConfig, batch: int, context: int,
                     sampling: SamplingConfig = SamplingConfig(),
                     compiler_options: dict | None = None):
    """Compiles the generate loop (:func:`kvjax.inference.decode.generate_program`) over a cache of
    ``context`` slots, from shapes only; the step count is a run-time argument."""
    cfg = planned(cfg, batch, context)
    return decode.generate_program.lower(*_generate_args(cfg, batch, context), cfg=cfg,
                                  sampling=sampling).compile(
        compiler_options=compiler_options)


def analyze_loop(cfg: ModelConfig, context: int, batch: int = 1, compiled=None,
                 attribute: bool = True, sampling: SamplingConfig = SamplingConfig(),
                 num_steps: int = 16) -> StepCost:
    """The generate loop's cost **per generated token**, and what it spends once per call.

    XLA's figures for the loop are affine in its trip count n: C(n) = once + n·per_token
    (the body runs n times; the rest of the program, such as weights widened to float32
    before the loop because the conversion is loop-invariant, runs once). Both terms
    come from two loop-corrected analyses of the same compiled program, at n and 2n:
    per_token = (C(2n) - C(n)) / n, once = C(n) - n·per_token; the attribution is split
    the same way, part by part. Theory is one decode step at ``context``
    (:func:`kvjax.analysis.theory.step_bytes`). ``compiled``, if given, must be
    :func:`compile_generate`'s program for ``sampling``; the memory figures
    (``memory_analysis``: argument, output, alias, temp bytes) are the loop program's,
    so a hoisted weight copy shows in its temp bytes.
    """
    cfg = planned(cfg, batch, context)
    compiled = compiled or compile_generate(
        cfg, batch, context, sampling, compiler_options=analysis_compiler_options())
    n = num_steps
    a = hlo_cost.loop_aware_cost(compiled, default_trip_count=n)
    b = hlo_cost.loop_aware_cost(compiled, default_trip_count=2 * n)
    tok_f, tok_b = (b.flops - a.flops) / n, (b.bytes - a.bytes) / n
    xla = dataclasses.replace(a, flops=tok_f, bytes=tok_b,
                              uncosted_bytes=(b.uncosted_bytes - a.uncosted_bytes) / n,
                              uncosted_flops=(b.uncosted_flops - a.uncosted_flops) / n)
    once = {"flops": a.flops - n * tok_f, "bytes": a.bytes - n * tok_b, "parts": {}}
    attribution = None
    if attribute:
        att_a = hlo_cost.attribute(hlo_cost.op_costs(compiled, default_trip_count=n))
        att_b = hlo_cost.attribute(hlo_cost.op_costs(compiled, default_trip_count=2 * n))
        per = {k: (att_b.bytes[k] - att_a.bytes[k]) / n for k in att_a.bytes}
        once["parts"] = {k: att_a.bytes[k] - n * per[k] for k in per}
        attribution = dataclasses.replace(
            att_a, bytes=per,
            flops={k: (att_b.flops[k] - att_a.flops[k]) / n for k in att_a.flops},
            total_bytes=(att_b.total_bytes - att_a.total_bytes) / n,
            total_flops=(att_b.total_flops - att_a.total_flops) / n,
            uncosted_bytes=(att_b.uncosted_bytes - att_a.uncosted_bytes) / n,
            uncosted={k: (att_b.uncosted[k] - att_a.uncosted[k]) / n for k in att_a.uncosted},
            kv_tensors={name: {k: (att_b.kv_tensors[name][k] - rw[k]) / n for k in rw}
                        for name, rw in att_a.kv_tensors.items() if name in att_b.kv_tensors})
    sb = theory.step_bytes(cfg, context, batch)
    sf = theory.step_flops(cfg, context, batch)
    parts = {"bytes": sb.as_dict(), "flops": sf.as_dict()}
    if cfg.dtype_bytes < 4 and backend_lib.widen_dot_operands(cfg.backend):
        # The loop reads float32 copies of the weights, converted once before the loop
        # (loop-invariant): the blog's bytes with 4-byte weights.
        widened = dict(sb.as_dict(), weights=sb.weights * 4 // cfg.dtype_bytes)
        widened["read"] = sb.read + widened["weights"] - sb.weights
        widened["total"] = sb.total + widened["weights"] - sb.weights
        parts["bytes_widened"] = widened
    _, cache = _specs(cfg, batch, context)
    return StepCost(
        # one step of the loop generates one token per row: with B > 1 rows its figures
        # are for B tokens, and the tables say so
        name="generated token" if batch == 1 else f"loop step ({batch} tokens)",
        cfg=cfg, batch=batch, context=context, xla=xla,
        memory=hlo_cost.memory_stats(compiled), theory_flops=float(sf.total),
        theory_bytes=float(sb.total), theory_parts=parts,
        cache_bytes=cache_lib.cache_bytes(cache), attribution=attribution,
        once_per_call=once)


def measure_loop_seconds(cfg: ModelConfig, params, context: int, batch: int = 1,
                         compiled=None, sampling: SamplingConfig = SamplingConfig(),
                         steps: tuple[int, int] = (4, 20), repeats: int = 3) -> dict:
    """Seconds per generated token of the compiled generate loop itself, at ``context``.

    The loop runs n1 and n2 steps (interleaved, ``repeats`` times each) over a cache of
    ``context`` slots holding context - n2 - 1 tokens, so every step reads the same slots
    (a dense cache is read in full, masked; a ring holds W); no row stops (no EOS). The
    fixed cost of a call (entering the loop, hoisted conversions, the Python dispatch)
    cancels in per_token_s = (median t(n2) - median t(n1)) / (n2 - n1).

    Returns:
      {'per_token_s', 'steps': (n1, n2), 'seconds': {n1: [...], n2: [...]},
      'call_overhead_s': median t(n1) - n1·per_token_s}; per_token_s is nan when the
      context leaves no room for 2 steps.
    """
    cfg = planned(cfg, batch, context)
    params = model.fuse_projections(cfg, params)  # once, as the compiled loop takes them
    n2 = min(steps[1], context - 1)
    n1 = min(steps[0], n2 // 2)
    if n2 - n1 < 1:
        return {"per_token_s": float("nan"), "steps": (n1, n2), "seconds": {},
                "call_overhead_s": float("nan")}
    cache = compress_lib.full_cache(cfg, batch, context - n2)
    if cache_lib.num_slots(cfg, context) != cache.num_slots:
        # dense: a cache of ``context`` slots holding the same tokens
        big = cache_lib.init_cache(cfg, batch, context)
        pos = big.positions.at[:, :cache.num_slots].set(cache.positions)
        cache = big.replace(positions=pos, length=cache.length)
    pos0, len0 = np.asarray(cache.positions), np.asarray(cache.length)
    sched0 = jax.tree.map(np.asarray, cache.schedule)
    compiled = compiled or compile_generate(cfg, batch, context, sampling)
    first = jnp.zeros((batch,), jnp.int32)
    rng = jax.random.key(0)
    seconds: dict[int, list[float]] = {n1: [], n2: []}
    for i in range(repeats + 1):
        for n in (n1, n2):
            start = time.perf_counter()
            buf, _, cache = compiled(params, first, cache, jnp.int32(n), rng, jnp.int32(-1))
            buf.block_until_ready()
            elapsed = time.perf_counter() - start
            cache = cache.replace(positions=jnp.asarray(pos0), length=jnp.asarray(len0),
                                  schedule=jax.tree.map(jnp.asarray, sched0))
            if i:  # the first round warms up
                seconds[n].append(elapsed)
    t1, t2 = np.median(seconds[n1]), np.median(seconds[n2])
    per = float((t2 - t1) / (n2 - n1))
    return {"per_token_s": per, "steps": (n1, n2), "seconds": seconds,
            "call_overhead_s": float(t1 - n1 * per)}


def prefill_theory_bytes(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> dict:
    """Theory bytes of a one-pass prefill into an empty cache, by part: 'weights' (all
    read once), 'kv_write' (the prompt's K/V), 'attn_io_standard', 'attn_io_tiled' and
    'attn_io_native' (:func:`kvjax.analysis.theory.attention_io_standard` /
    ``attention_io_tiled`` at the config's block sizes, resp. the native kernel's 64-slot
    blocks and 64 // G-token query tiles), 'attn_io' (the one of the path the config runs,
    :func:`kvjax.models.flash.prefill_path`), 'total' (weights + kv_write + attn_io) and,
    outside the total, 'activations_unfused' (:func:`kvjax.analysis.theory.
    prefill_activation_bytes`, None for MLA)."""
    t = prompt_len
    bq, bk = min(cfg.prefill_block_q, t), min(cfg.prefill_block_k, t)
    pairs = flash.num_chunk_pairs(t, bq, bk, cfg.window_size, cfg.num_sink_tokens)
    parts = {"weights": theory.weight_bytes(cfg),
             "kv_write": batch * t * theory.kv_bytes_per_token(cfg),
             "attn_io_standard": theory.attention_io_standard(cfg, t, batch),
             "attn_io_tiled": theory.attention_io_tiled(cfg, t, pairs, bk, batch)}
    # the native kernel's tiles: 64 key slots, 64 // G queries (its rows are G heads each)
    nbk = min(native_prefill.BLOCK_K, t)
    nbq = min(max(1, native_prefill.TILE_ROWS // max(1, cfg.num_groups)), t)
    npairs = flash.num_chunk_pairs(t, nbq, nbk, cfg.window_size, cfg.num_sink_tokens)
    parts["attn_io_native"] = theory.attention_io_tiled(cfg, t, npairs, nbk, batch)
    parts["attn_io"] = parts[{"tiled": "attn_io_tiled", "native": "attn_io_native",
                              "dense": "attn_io_standard",
                              "cudnn": "attn_io_tiled"}[flash.prefill_path(cfg)]]
    parts["total"] = parts["weights"] + parts["kv_write"] + parts["attn_io"]
    # not in the total: the activation traffic of a layer stack that fuses nothing into
    # its matrix products (an estimate of what XLA:CPU moves), shown beside it; None for MLA
    parts["activations_unfused"] = theory.prefill_activation_bytes(cfg, prompt_len, batch)
    return parts


def analyze_prefill(cfg: ModelConfig, prompt_len: int, max_seq_len: int,
                    batch: int = 1, compiled=None) -> StepCost:
    """Theory and loop-corrected XLA cost of a one-pass prefill into an empty cache.

    Theory bytes (:func:`prefill_theory_bytes`): all weights once, the prompt's KV
    written, and the attention's own traffic for ``cfg.prefill_impl`` (standard
    Θ(T·d + T²) or tiled). Theory FLOP: causal attention, the LM head for the last
    position only (:func:`kvjax.analysis.theory.prefill_flops`), as ``decode.prefill``
    computes.

    A custom call (the native prompt attention) is opaque to XLA's cost analysis (-1 FLOP
    and bytes, removed; ``xla.complete`` False): ``theory_parts['custom_call']`` then
    holds its targets, its operand + result bytes (``xla.uncosted_bytes``) and its FLOP:
    the native prompt attention's by theory
    (:func:`kvjax.analysis.theory.prefill_attention_flops`), the native weight products'
    from their shapes (:func:`kvjax.analysis.hlo_cost.kernel_flops`), to add to XLA's
    figures: see :func:`prefill_with_kernel`.
    """
    cfg = planned(cfg, batch, max_seq_len, (batch * prompt_len,))
    compiled = compiled or compile_prefill(cfg, batch, prompt_len, max_seq_len,
                                           analysis_compiler_options())
    tb = prefill_theory_bytes(cfg, prompt_len, batch)
    _, cache = _specs(cfg, batch, max_seq_len)
    xla = hlo_cost.loop_aware_cost(compiled)
    parts = {"bytes": tb}
    if xla.custom_calls:
        # XLA reports a custom call as -1 FLOP / -1 byte (removed by loop_aware_cost):
        # its operand + result bytes (XLA's shapes, loop-corrected) and, for the native
        # prompt attention, its causal FLOP from theory stand in, labelled as such.
        native = kernels.get("prefill_attention", flash.prefill_path(cfg),
                             internal=True).target is not None  # the native kernel
        attn = float(theory.prefill_attention_flops(cfg, prompt_len, batch)) if native else 0.0
        parts["custom_call"] = {
            "targets": list(xla.custom_calls),
            "operand_result_bytes": xla.uncosted_bytes,
            # the native prompt attention's causal FLOP (theory) + the other kernels'
            # FLOP from their shapes (hlo_cost.kernel_flops: the weight products)
            "flops_attention_theory": attn,
            "flops_kernels": xla.uncosted_flops,
            "flops_theory": attn + xla.uncosted_flops}
    return StepCost(
        name="prefill", cfg=cfg, batch=batch, context=prompt_len,
        xla=xla, memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(theory.prefill_flops(cfg, prompt_len, batch)),
        theory_bytes=float(tb["total"]),
        theory_parts=parts,
        cache_bytes=cache_lib.cache_bytes(cache))


def prefill_with_kernel(step: StepCost) -> tuple[float, float]:
    """(FLOP, bytes) of a prefill program with its custom call counted: XLA's
    loop-corrected figures plus ``theory_parts['custom_call']`` (the kernel's FLOP by
    theory, its operand + result bytes as XLA's shapes give them). XLA's own figures when
    the program has no custom call."""
    cc = step.theory_parts.get("custom_call")
    if not cc:
        return step.xla.flops, step.xla.bytes
    return (step.xla.flops + cc["flops_theory"],
            step.xla.bytes + cc["operand_result_bytes"])


def prefill_bytes_over_activations(step: StepCost) -> float:
    """XLA(+kernel) bytes of a prefill (:func:`prefill_with_kernel`) over weights + KV
    written + the unfused activation count (``theory_parts['bytes']
    ['activations_unfused']``, :func:`kvjax.analysis.theory.prefill_activation_bytes`);
    nan where that count is not modelled (MLA)."""
    p = step.theory_parts["bytes"]
    act = p.get("activations_unfused")
    if not act:
        return float("nan")
    return prefill_with_kernel(step)[1] / (p["weights"] + p["kv_write"] + act)


def step_timer(cfg: ModelConfig, params, cache: cache_lib.KVCache, batch: int = 1,
               compiled=None) -> Callable[[], float]:
    """A function that runs one decode step at the cache's current length and returns
    its wall seconds. The plan is resolved for the cache's slots (:func:`planned`), the
    projections fused once and the step compiled once (unless ``compiled`` is given); the
    cache is donated to each call and the returned one kept for the next, with its length
    reset, so every call sees the same context."""
    cfg = planned(cfg, batch, cache.num_slots)
    params = model.fuse_projections(cfg, params)  # once, as the compiled step takes them
    token = jnp.zeros((batch, 1), jnp.int32)
    compiled = compiled or decode.decode_step.lower(params, token, cache, cfg=cfg).compile()
    length = np.asarray(cache.length)
    state = {"cache": cache}

    def run() -> float:
        start = time.perf_counter()
        logits, out = compiled(params, token, state["cache"])
        logits.block_until_ready()
        elapsed = time.perf_counter() - start
        state["cache"] = out.replace(length=jnp.asarray(length))
        return elapsed
    return run


def measure_step_seconds(cfg: ModelConfig, params, cache: cache_lib.KVCache, batch: int = 1,
                         repeats: int = 5, compiled=None, warmup: int = 1,
                         budget_s: float | None = None,
                         before_step: Callable[[], object] | None = None) -> list[float]:
    """Wall times (s) of up to ``repeats`` decode steps at the cache's current length
    (:func:`step_timer`: every step sees the same context). ``warmup`` calls are not timed.
    With ``budget_s``, timing stops once the timed steps add up to it (at least one is
    timed) and a warm-up call that alone exceeds it ends the warm-up: a slow step (MLA's
    naive path at long context) is timed fewer times. ``before_step``, if given, is called
    (untimed) before every call, warm-ups included: e.g. a bandwidth probe to pair with
    each step. Returns the times; report their median.
    """
    step = step_timer(cfg, params, cache, batch, compiled)
    times: list[float] = []
    warm = 0
    while len(times) < repeats:
        if before_step is not None:
            before_step()
        elapsed = step()
        if warm < warmup:
            warm = warmup if (budget_s is not None and elapsed > budget_s) else warm + 1
            continue
        times.append(elapsed)
        if budget_s is not None and sum(times) >= budget_s:
            break
    return times


def measure_decode_step(cfg: ModelConfig, context: int, batch: int = 1, repeats: int = 5,
                        compiled=None, budget_s: float | None = 2.0,
                        before_step: Callable[[], object] | None = None) -> list[float]:
    """Wall times (s) of up to ``repeats`` decode steps at ``context`` (random weights, a
    full cache: timing does not depend on the values), after two warm-up steps; see
    :func:`measure_step_seconds` for ``budget_s`` and ``before_step``. Allocates the cache
    and parameters, after checking that they fit the memory available.

    Raises:
      kvjax.inference.memory.MemoryCheckError: they do not fit.
    """
    cfg = planned(cfg, batch, context)
    temps = None if compiled is None else hlo_cost.memory_stats(compiled).get("temp_bytes")
    memory.check(cfg, batch, context, what=f"decode step at context {context}",
                 weights_bytes=theory.weight_bytes(cfg), temp_bytes=temps)
    params = model.init_params(cfg, 0)
    cache = compress_lib.full_cache(cfg, batch, context)
    return measure_step_seconds(cfg, params, cache, batch, repeats, compiled=compiled,
                                warmup=2, budget_s=budget_s, before_step=before_step)


def views(step: StepCost, seconds: float | None = None) -> dict:
    """The four views of one step as a flat dict (one table/CSV row):
    ``step.as_dict(seconds, nested=False)``."""
    return step.as_dict(seconds, nested=False)

