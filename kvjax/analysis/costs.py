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

from kvjax import cache as cache_lib
from kvjax.analysis import hlo_cost, roofline, theory
from kvjax.inference import decode
from kvjax.models import flash, model
from kvjax.config import ModelConfig, SamplingConfig


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

    @property
    def flops_ratio(self) -> float:
        """XLA (loop-corrected) FLOP / theory FLOP."""
        return self.xla.flops / self.theory_flops

    @property
    def bytes_ratio(self) -> float:
        """XLA (loop-corrected) bytes accessed / theory bytes."""
        return self.xla.bytes / self.theory_bytes

    def as_dict(self) -> dict:
        return {
            "name": self.name, "model": self.cfg.name, "attention": self.cfg.attention,
            "num_kv_heads": self.cfg.num_kv_heads, "window_size": self.cfg.window_size,
            "mla_absorb": self.cfg.mla_absorb if self.cfg.is_mla else None,
            "scan_layers": self.cfg.scan_layers,
            "kv_layout": None if self.cfg.is_mla else
            f"k {self.cfg.cache_layout('k')}, v {self.cfg.cache_layout('v')}",
            "dtype": self.cfg.dtype, "batch": self.batch, "context": self.context,
            "theory_flops": self.theory_flops, "theory_bytes": self.theory_bytes,
            "xla_flops": self.xla.flops, "xla_bytes": self.xla.bytes,
            "xla_raw_flops": self.xla.raw_flops, "xla_raw_bytes": self.xla.raw_bytes,
            "flops_ratio": self.flops_ratio, "bytes_ratio": self.bytes_ratio,
            "xla_complete": self.xla.complete,
            "xla_custom_calls": list(self.xla.custom_calls),
            "xla_uncosted_bytes": self.xla.uncosted_bytes, "memory": self.memory,
            "theory_parts": self.theory_parts, "cache_bytes": self.cache_bytes,
            "attribution": None if self.attribution is None else self.attribution.as_dict(),
            "jaxpr": None if self.jaxpr is None else self.jaxpr.as_dict(),
        }


def _token_spec(batch: int):
    return jax.ShapeDtypeStruct((batch, 1), jnp.int32)


def _specs(cfg: ModelConfig, batch: int, max_seq_len: int):
    return model.param_shapes(cfg), cache_lib.cache_spec(cfg, batch, max_seq_len)


def analysis_compiler_options() -> dict | None:
    """XLA options for programs compiled only to be analysed, never run.

    On CPU, ``xla_backend_optimization_level=0`` skips LLVM's optimisation of the machine
    code; the optimised HLO, and so every cost and memory figure read from it, is
    identical (checked in tests/test_costs_sweep.py), and compiling takes ~2.5x less
    time. Elsewhere: None (the backend's defaults).
    """
    return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None


def compile_decode_step(cfg: ModelConfig, batch: int, context: int,
                        compiler_options: dict | None = None):
    """Compiles one decode step against a cache of ``context`` slots, from shapes only."""
    params, cache = _specs(cfg, batch, context)
    return decode.decode_step.lower(params, _token_spec(batch), cache, cfg=cfg).compile(
        compiler_options=compiler_options)


def compile_prefill(cfg: ModelConfig, batch: int, prompt_len: int, max_seq_len: int,
                    compiler_options: dict | None = None, fresh: bool = True):
    """Compiles the prefill of ``prompt_len`` tokens into a cache of ``max_seq_len`` slots
    (``fresh``: an empty one, as ``decode.prefill`` compiles for it; False: a cache
    that may hold earlier tokens, e.g. a chunk of ``decode.prefill_chunked``)."""
    params, cache = _specs(cfg, batch, max_seq_len)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    return decode._prefill.lower(params, tokens, cache, cfg=cfg, fresh=fresh).compile(
        compiler_options=compiler_options)


def theory_prefill_flops(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> float:
    """FLOP of a causal prefill: sum over prompt positions p = 1..T of the step FLOP at
    context p (the step FLOP is affine in t, so the sum is closed-form). The LM head is
    counted for every position (kvjax's prefill computes all T logits)."""
    f1 = theory.step_flops(cfg, 1, batch).total
    f2 = theory.step_flops(cfg, 2, batch).total
    slope = f2 - f1
    t = prompt_len
    return t * (f1 - slope) + slope * t * (t + 1) / 2


def analyze_decode_step(cfg: ModelConfig, context: int, batch: int = 1, compiled=None,
                        attribute: bool = True, jaxpr: bool = True) -> StepCost:
    """Theory, jaxpr-level and loop-corrected XLA cost of one decode step at ``context``.

    Theory bytes are the blog's B_step(t) = weights read per step + KV read, plus the new
    token's KV write; FLOPs are :func:`kvjax.theory.step_flops`. ``attribute`` splits
    XLA's figures (:func:`kvjax.hlo_cost.attribute`); ``jaxpr`` adds
    :func:`kvjax.roofline.jaxpr_cost` of the same step. Nothing is allocated.
    """
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
    """Compiles the generate loop (:func:`kvjax.decode._generate`) over a cache of
    ``context`` slots, from shapes only; the step count is a run-time argument."""
    return decode._generate.lower(*_generate_args(cfg, batch, context), cfg=cfg,
                                  sampling=sampling).compile(
        compiler_options=compiler_options)


def analyze_generate(cfg: ModelConfig, context: int, num_steps: int, batch: int = 1,
                     compiled=None, attribute: bool = True, jaxpr: bool = True,
                     sampling: SamplingConfig = SamplingConfig()) -> StepCost:
    """Theory, jaxpr-level and loop-corrected XLA cost of ``num_steps`` generate steps.

    The loop's trip count is only known at run time: XLA's raw figure counts its body
    once, the corrected one ``num_steps`` times. A dense cache of ``context`` slots is
    read in full by every step, so theory is ``num_steps`` x the step at ``context``.
    ``compiled``, if given, must be the loop for ``sampling``.
    """
    compiled = compiled or compile_generate(
        cfg, batch, context, sampling, compiler_options=analysis_compiler_options())
    sb = theory.step_bytes(cfg, context, batch)
    sf = theory.step_flops(cfg, context, batch)
    _, cache = _specs(cfg, batch, context)
    ops = hlo_cost.op_costs(compiled, default_trip_count=num_steps) if attribute else None
    jc = None
    if jaxpr:
        jc = roofline.jaxpr_cost(
            functools.partial(decode._generate, cfg=cfg, sampling=sampling),
            *_generate_args(cfg, batch, context), while_trip_count=num_steps)
    return StepCost(
        name="generate", cfg=cfg, batch=batch, context=context,
        xla=hlo_cost.loop_aware_cost(compiled, default_trip_count=num_steps),
        memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(num_steps * sf.total), theory_bytes=float(num_steps * sb.total),
        theory_parts={"bytes": {k: num_steps * v for k, v in sb.as_dict().items()},
                      "flops": {k: num_steps * v for k, v in sf.as_dict().items()}},
        cache_bytes=cache_lib.cache_bytes(cache),
        attribution=None if ops is None else hlo_cost.attribute(ops), jaxpr=jc)


def prefill_theory_bytes(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> dict:
    """Theory bytes of a one-pass prefill into an empty cache, by part: 'weights' (all
    read once), 'kv_write' (the prompt's K/V), 'attn_io_standard' and 'attn_io_tiled'
    (:func:`kvjax.analysis.theory.attention_io_standard` / ``attention_io_tiled`` at the
    config's block sizes), 'attn_io' (the one of ``cfg.prefill_impl``) and 'total'
    (weights + kv_write + attn_io)."""
    t = prompt_len
    bq, bk = min(cfg.prefill_block_q, t), min(cfg.prefill_block_k, t)
    pairs = flash.num_chunk_pairs(t, bq, bk, cfg.window_size, cfg.num_sink_tokens)
    parts = {"weights": theory.weight_bytes(cfg),
             "kv_write": batch * t * theory.kv_bytes_per_token(cfg),
             "attn_io_standard": theory.attention_io_standard(cfg, t, batch),
             "attn_io_tiled": theory.attention_io_tiled(cfg, t, pairs, bk, batch)}
    parts["attn_io"] = parts["attn_io_tiled" if cfg.prefill_impl == "tiled"
                             else "attn_io_standard"]
    parts["total"] = parts["weights"] + parts["kv_write"] + parts["attn_io"]
    return parts


def analyze_prefill(cfg: ModelConfig, prompt_len: int, max_seq_len: int,
                    batch: int = 1, compiled=None) -> StepCost:
    """Theory and loop-corrected XLA cost of a one-pass prefill into an empty cache.

    Theory bytes (:func:`prefill_theory_bytes`): all weights once, the prompt's KV
    written, and the attention's own traffic for ``cfg.prefill_impl`` (standard
    Θ(T·d + T²) or tiled). Theory FLOP: causal attention, the LM head for the last
    position only (:func:`kvjax.analysis.theory.prefill_flops`), as ``decode.prefill``
    computes.
    """
    compiled = compiled or compile_prefill(cfg, batch, prompt_len, max_seq_len,
                                           analysis_compiler_options())
    tb = prefill_theory_bytes(cfg, prompt_len, batch)
    _, cache = _specs(cfg, batch, max_seq_len)
    return StepCost(
        name="prefill", cfg=cfg, batch=batch, context=prompt_len,
        xla=hlo_cost.loop_aware_cost(compiled), memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(theory.prefill_flops(cfg, prompt_len, batch)),
        theory_bytes=float(tb["total"]),
        theory_parts={"bytes": tb},
        cache_bytes=cache_lib.cache_bytes(cache))


def measure_step_seconds(cfg: ModelConfig, params, cache: cache_lib.KVCache, batch: int = 1,
                         repeats: int = 5, compiled=None, warmup: int = 1,
                         budget_s: float | None = None,
                         before_step: Callable[[], object] | None = None) -> list[float]:
    """Wall times (s) of up to ``repeats`` decode steps at the cache's current length.

    The cache is donated to each call and the returned one fed to the next, with its
    length reset, so every step sees the same context. ``warmup`` calls are not timed.
    With ``budget_s``, timing stops once the timed steps add up to it (at least one is
    timed) and a warm-up call that alone exceeds it ends the warm-up: a slow step (MLA's
    naive path at long context) is timed fewer times. ``before_step``, if given, is called
    (untimed) before every call, warm-ups included: e.g. a bandwidth probe to pair with
    each step. Returns the times; report their median.
    """
    compiled = compiled or decode.decode_step.lower(
        params, jnp.zeros((batch, 1), jnp.int32), cache, cfg=cfg).compile()
    token = jnp.zeros((batch, 1), jnp.int32)
    length = int(cache.length)
    times: list[float] = []
    warm = 0
    while len(times) < repeats:
        if before_step is not None:
            before_step()
        start = time.perf_counter()
        logits, cache = compiled(params, token, cache)
        logits.block_until_ready()
        elapsed = time.perf_counter() - start
        cache = cache.replace(length=jnp.int32(length))
        if warm < warmup:
            warm = warmup if (budget_s is not None and elapsed > budget_s) else warm + 1
            continue
        times.append(elapsed)
        if budget_s is not None and sum(times) >= budget_s:
            break
    return times


def full_cache(cfg: ModelConfig, batch: int, context: int) -> cache_lib.KVCache:
    """A zero cache of ``context`` slots (W for a window) that a step at context
    ``context`` sees full: length context - 1, every slot holding a past position."""
    cache = cache_lib.init_cache(cfg, batch, context)
    s = cache.num_slots
    held = jnp.arange(max(0, context - 1 - s), context - 1, dtype=jnp.int32)
    positions = cache.positions.at[cache_lib.slot_of(held, cfg, s)].set(held)
    return cache.replace(positions=positions, length=jnp.int32(context - 1))


def measure_decode_step(cfg: ModelConfig, context: int, batch: int = 1, repeats: int = 5,
                        compiled=None, budget_s: float | None = 2.0,
                        before_step: Callable[[], object] | None = None) -> list[float]:
    """Wall times (s) of up to ``repeats`` decode steps at ``context`` (random weights, a
    full cache: timing does not depend on the values), after two warm-up steps; see
    :func:`measure_step_seconds` for ``budget_s`` and ``before_step``. Allocates the cache
    and parameters."""
    params = model.init_params(cfg, 0)
    cache = full_cache(cfg, batch, context)
    return measure_step_seconds(cfg, params, cache, batch, repeats, compiled=compiled,
                                warmup=2, budget_s=budget_s, before_step=before_step)


def format_table(rows: list[tuple], headers: tuple) -> str:
    """Plain-text table with right-aligned numeric columns."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def _fmt(x) -> str:
    if isinstance(x, float):
        if x != x:
            return "nan"
        if abs(x) >= 1e3:
            return f"{x:,.0f}"
        return f"{x:.3g}"
    if isinstance(x, (int, np.integer)):
        return f"{x:,}"
    return str(x)


def cost_table(step: StepCost, measured_seconds: float | None = None) -> str:
    """Theory | jaxpr | XLA | ratio rows for FLOP and bytes (and measured time if given).

    The jaxpr column (when computed) counts dots only: their FLOP, and their operands'
    and outputs' bytes.
    """
    jf = step.jaxpr.flops if step.jaxpr else float("nan")
    jb = step.jaxpr.hbm_bytes if step.jaxpr else float("nan")
    rows = [
        ("FLOP", step.theory_flops, jf, step.xla.flops, step.xla.raw_flops,
         step.flops_ratio),
        ("bytes", step.theory_bytes, jb, step.xla.bytes, step.xla.raw_bytes,
         step.bytes_ratio),
    ]
    text = format_table(rows, ("per " + step.name, "theory", "jaxpr (dots)",
                               "XLA (loop-corrected)", "XLA raw", "XLA/theory"))
    if measured_seconds:
        text += (f"\nmeasured: {measured_seconds * 1e3:.3f} ms per {step.name} -> "
                 f"{step.theory_bytes / measured_seconds / 1e9:.2f} GB/s of theory bytes, "
                 f"{step.xla.bytes / measured_seconds / 1e9:.2f} GB/s of XLA bytes")
    if not step.xla.complete:
        text += ("\nwarning: XLA's figure is incomplete (custom calls "
                 f"{list(step.xla.custom_calls)}, >= {step.xla.uncosted_bytes:,.0f} bytes "
                 "uncosted, or loops of unknown trip count)")
    return text


def attribution_rows(step: StepCost) -> list[tuple[str, float, float]]:
    """(part, theory bytes, XLA bytes) for weights, kv_read, kv_write, kv_copies,
    weight_copies, other and the total; theory has no copies and no 'other'
    (activations, logits), so those rows are 0 there."""
    if step.attribution is None:
        raise ValueError("analyze the step with attribute=True")
    tb = step.theory_parts["bytes"]
    xb = step.attribution.bytes
    rows = [(part, float(tb.get(part, 0)), xb[part]) for part in
            ("weights", "kv_read", "kv_write", "kv_copies", "weight_copies", "other")]
    rows.append(("total", step.theory_bytes, step.attribution.total_bytes))
    return rows


def attribution_table(step: StepCost) -> str:
    """Compiled bytes of a step split by what they touch, each beside its theory term.

    Ops XLA cannot cost (custom calls: cuBLAS GEMMs on GPU) get a column of their own,
    their operand + output bytes (a lower bound), split into the same parts.
    """
    a = step.attribution
    rows = [(p, t, x, x / t if t else float("nan"), x / a.total_bytes)
            for p, t, x in attribution_rows(step)]
    headers = (f"bytes of {step.name} @ t={step.context}", "theory", "XLA", "XLA/theory",
               "share of XLA")
    if a.num_uncosted_ops:
        unc = [a.uncosted.get(p, 0.0) for p, *_ in rows[:-1]] + [a.uncosted_bytes]
        rows = [r + (u,) for r, u in zip(rows, unc)]
        headers += ("uncosted (>=)",)
    text = format_table(rows, headers)
    f = step.theory_parts["flops"]
    text += ("\nFLOP: XLA on the cache (attention) "
             f"{a.flops['kv']:,.0f} vs theory attn {f.get('attn', 0) + f.get('kv_rebuild', 0):,}; "
             f"on weights {a.flops['weights']:,.0f} vs theory proj+mlp+lm_head "
             f"{f.get('proj', 0) + f.get('mlp', 0) + f.get('lm_head', 0):,}; "
             f"other {a.flops['other']:,.0f}")
    if a.num_uncosted_ops:
        text += (f"\n{a.num_uncosted_ops} custom-call executions XLA cannot cost: "
                 f">= {a.uncosted_bytes:,.0f} bytes, FLOPs unknown, not in the XLA column")
    return text


def views(step: StepCost, seconds: float | None = None) -> dict:
    """The four views of one step as a flat dict (one table/CSV row).

    theory_*: the blog; jaxpr_*: jax.experimental.roofline, loop-corrected (dots only);
    xla_*: compiled, loop-corrected, with the attribution's parts (xla_kv_read, ...);
    measured_s and the achieved bandwidth of theory and XLA bytes (bytes/s).
    """
    c = step.cfg
    variant = c.attention + ("" if not c.is_mla else
                             "-absorbed" if c.mla_absorb else "-naive")
    row = {
        "model": c.name, "variant": variant, "num_kv_heads": c.num_kv_heads,
        "window": c.window_size, "dtype": c.dtype, "scan_layers": c.scan_layers,
        "context": step.context, "batch": step.batch,
        "theory_bytes": step.theory_bytes, "theory_flops": step.theory_flops,
        "theory_weights": step.theory_parts["bytes"]["weights"],
        "theory_kv_read": step.theory_parts["bytes"]["kv_read"],
        "theory_kv_write": step.theory_parts["bytes"]["kv_write"],
        "jaxpr_bytes": step.jaxpr.hbm_bytes if step.jaxpr else float("nan"),
        "jaxpr_flops": step.jaxpr.flops if step.jaxpr else float("nan"),
        "jaxpr_unfused_bytes": step.jaxpr.unfused_hbm_bytes if step.jaxpr else float("nan"),
        "xla_bytes": step.xla.bytes, "xla_flops": step.xla.flops,
        "xla_raw_bytes": step.xla.raw_bytes, "xla_raw_flops": step.xla.raw_flops,
        "xla_complete": step.xla.complete, "xla_uncosted_bytes": step.xla.uncosted_bytes,
        "bytes_ratio": step.bytes_ratio, "flops_ratio": step.flops_ratio,
        "alias_bytes": step.memory.get("alias_bytes"),
        "temp_bytes": step.memory.get("temp_bytes"), "cache_bytes": step.cache_bytes,
        "measured_s": float("nan") if seconds is None else seconds,
        "theory_bytes_per_s": float("nan") if not seconds else step.theory_bytes / seconds,
        "xla_bytes_per_s": float("nan") if not seconds else step.xla.bytes / seconds,
    }
    if step.attribution is not None:
        row.update({f"xla_{k}": v for k, v in step.attribution.bytes.items()})
    return row
