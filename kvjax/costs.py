"""The cost hook: a decode step's cost three ways, side by side.

1. theory: the blog's closed forms (:mod:`kvjax.theory`);
2. compiled: XLA's ``cost_analysis()`` of the jitted step, loop-corrected
   (:mod:`kvjax.hlo_cost`), plus ``memory_analysis()``;
3. measured: median wall time of the compiled step on the local device, as achieved
   bytes/s.

Everything compiles from ``jax.ShapeDtypeStruct``s, so a 128K-token cache or a 65B-shaped
layer can be analysed on a laptop without allocating it.

The step analysed at context ``t`` uses a dense cache of S = t slots (W for a window): the
step reads every slot, masked or not, plus the new token's key/value, which is the
theory's t (+1 key, ignored).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import decode, hlo_cost, model, theory
from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One compiled program next to theory.

    Attributes:
      name: 'decode_step' or 'prefill'.
      cfg, batch, context: what was compiled (context = tokens in the cache).
      xla: loop-corrected XLA figures (raw ones inside).
      memory: memory_analysis() bytes (argument/output/alias/temp/code).
      theory_flops, theory_bytes: the blog's FLOP and bytes for the same work.
      theory_parts: named theory terms (bytes: weights, kv_read, kv_write; FLOPs: ...).
      cache_bytes: bytes of the cache pytree's per-token tensors.
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
            "dtype": self.cfg.dtype, "batch": self.batch, "context": self.context,
            "theory_flops": self.theory_flops, "theory_bytes": self.theory_bytes,
            "xla_flops": self.xla.flops, "xla_bytes": self.xla.bytes,
            "xla_raw_flops": self.xla.raw_flops, "xla_raw_bytes": self.xla.raw_bytes,
            "flops_ratio": self.flops_ratio, "bytes_ratio": self.bytes_ratio,
            "xla_complete": self.xla.complete, "memory": self.memory,
            "theory_parts": self.theory_parts, "cache_bytes": self.cache_bytes,
        }


def _specs(cfg: ModelConfig, batch: int, max_seq_len: int):
    return model.param_shapes(cfg), cache_lib.cache_spec(cfg, batch, max_seq_len)


def compile_decode_step(cfg: ModelConfig, batch: int, context: int):
    """Compiles one decode step against a cache of ``context`` slots, from shapes only."""
    params, cache = _specs(cfg, batch, context)
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    return decode.decode_step.lower(params, token, cache, cfg=cfg).compile()


def compile_prefill(cfg: ModelConfig, batch: int, prompt_len: int, max_seq_len: int):
    """Compiles the prefill of ``prompt_len`` tokens into a cache of ``max_seq_len`` slots."""
    params, cache = _specs(cfg, batch, max_seq_len)
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    return decode._prefill.lower(params, tokens, cache, cfg=cfg).compile()


def theory_prefill_flops(cfg: ModelConfig, prompt_len: int, batch: int = 1) -> float:
    """FLOP of a causal prefill: sum over prompt positions p = 1..T of the step FLOP at
    context p (the step FLOP is affine in t, so the sum is closed-form). The LM head is
    counted for every position (kvjax's prefill computes all T logits)."""
    f1 = theory.step_flops(cfg, 1, batch).total
    f2 = theory.step_flops(cfg, 2, batch).total
    slope = f2 - f1
    t = prompt_len
    return t * (f1 - slope) + slope * t * (t + 1) / 2


def analyze_decode_step(cfg: ModelConfig, context: int, batch: int = 1,
                        compiled=None) -> StepCost:
    """Theory and loop-corrected XLA cost of one decode step at ``context`` tokens.

    Theory bytes are the blog's B_step(t) = weights read per step + KV read, plus the new
    token's KV write; FLOPs are :func:`kvjax.theory.step_flops`.
    """
    compiled = compiled or compile_decode_step(cfg, batch, context)
    sb = theory.step_bytes(cfg, context, batch)
    sf = theory.step_flops(cfg, context, batch)
    _, cache = _specs(cfg, batch, context)
    return StepCost(
        name="decode_step", cfg=cfg, batch=batch, context=context,
        xla=hlo_cost.loop_aware_cost(compiled), memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(sf.total), theory_bytes=float(sb.total),
        theory_parts={"bytes": sb.as_dict(), "flops": sf.as_dict()},
        cache_bytes=cache_lib.cache_bytes(cache))


def analyze_prefill(cfg: ModelConfig, prompt_len: int, max_seq_len: int,
                    batch: int = 1, compiled=None) -> StepCost:
    """Theory and loop-corrected XLA cost of the prefill. Theory bytes: all weights once,
    plus the prompt's KV written."""
    compiled = compiled or compile_prefill(cfg, batch, prompt_len, max_seq_len)
    kv_write = batch * prompt_len * theory.kv_bytes_per_token(cfg)
    w = theory.weight_bytes(cfg)
    _, cache = _specs(cfg, batch, max_seq_len)
    return StepCost(
        name="prefill", cfg=cfg, batch=batch, context=prompt_len,
        xla=hlo_cost.loop_aware_cost(compiled), memory=hlo_cost.memory_stats(compiled),
        theory_flops=float(theory_prefill_flops(cfg, prompt_len, batch)),
        theory_bytes=float(w + kv_write),
        theory_parts={"bytes": {"weights": w, "kv_write": kv_write}},
        cache_bytes=cache_lib.cache_bytes(cache))


def measure_step_seconds(cfg: ModelConfig, params, cache: cache_lib.KVCache, batch: int = 1,
                         repeats: int = 5, compiled=None) -> list[float]:
    """Wall times (s) of ``repeats`` decode steps at the cache's current length.

    The cache is donated to each call and the returned one fed to the next, with its
    length reset, so every step sees the same context. One warm-up call is not timed.
    Returns the list of times; report its median.
    """
    compiled = compiled or decode.decode_step.lower(
        params, jnp.zeros((batch, 1), jnp.int32), cache, cfg=cfg).compile()
    token = jnp.zeros((batch, 1), jnp.int32)
    length = int(cache.length)
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        logits, cache = compiled(params, token, cache)
        logits.block_until_ready()
        if i:
            times.append(time.perf_counter() - start)
        cache = cache.replace(length=jnp.int32(length))
    return times


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
        if abs(x) >= 1e4:
            return f"{x:,.0f}"
        return f"{x:.3g}"
    if isinstance(x, (int, np.integer)):
        return f"{x:,}"
    return str(x)


def cost_table(step: StepCost, measured_seconds: float | None = None) -> str:
    """Theory | XLA | ratio rows for FLOP and bytes (and measured time if given)."""
    rows = [
        ("FLOP", step.theory_flops, step.xla.flops, step.xla.raw_flops, step.flops_ratio),
        ("bytes", step.theory_bytes, step.xla.bytes, step.xla.raw_bytes, step.bytes_ratio),
    ]
    text = format_table(rows, ("per " + step.name, "theory", "XLA (loop-corrected)",
                               "XLA raw", "XLA/theory"))
    if measured_seconds:
        text += (f"\nmeasured: {measured_seconds * 1e3:.3f} ms per {step.name} -> "
                 f"{step.theory_bytes / measured_seconds / 1e9:.2f} GB/s of theory bytes, "
                 f"{step.xla.bytes / measured_seconds / 1e9:.2f} GB/s of XLA bytes")
    if not step.xla.complete:
        text += ("\nwarning: XLA's figure is incomplete (custom calls "
                 f"{list(step.xla.custom_calls)} or loops of unknown trip count)")
    return text
