"""The blog's table for any model, chip and context, in one call.

    >>> from kvjax.analysis import sizing
    >>> print(sizing.blog_table("llama2-70b", chip="H100-80GB", context="128K"))

Every figure comes from :mod:`kvjax.analysis.theory` (the blog's closed forms generalised
to GQA/MQA/MLA/windows) and :mod:`kvjax.analysis.hardware` (published chip figures).
Units: bytes (GB = 10^9 bytes), seconds, FLOP. Contexts are tokens; a 'K' suffix means
1,024 tokens ('128K' = 131,072, as model cards use it), 'M' 1,048,576; write 128000 for
the blog's round 128,000.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from kvjax import presets
from kvjax.analysis import hardware, theory
from kvjax.config import ModelConfig

GB = 1e9  # decimal gigabytes, like the chips' datasheets


def parse_context(context: int | str) -> int:
    """Tokens in a context given as 4096, '4096', '128K' (x 1,024) or '1M' (x 1,048,576).

    Raises:
      ValueError: anything else, or a context below 1.
    """
    if isinstance(context, bool):
        raise ValueError(f"context={context!r}; allowed: tokens as an int, or '128K' / '1M'")
    if isinstance(context, (int, float)) and float(context).is_integer():
        t = int(context)
    else:
        m = re.fullmatch(r"\s*([\d_,]+)\s*([kKmM]?)\s*", str(context))
        if not m:
            raise ValueError(f"context={context!r}; allowed: tokens as an int (131072), or "
                             "'128K' (K = 1,024 tokens) / '1M' (M = 1,048,576)")
        t = int(m.group(1).replace(",", "").replace("_", "")) * {
            "": 1, "k": 1024, "m": 1024 ** 2}[m.group(2).lower()]
    if t < 1:
        raise ValueError(f"context={context!r}; allowed: at least 1 token")
    return t


def model_config(preset: str | ModelConfig, dtype: str = "float16",
                 **overrides: Any) -> ModelConfig:
    """A preset by name (:data:`kvjax.presets.PRESETS`) or a ModelConfig as is.

    Raises:
      ValueError: an unknown preset name (the closest names given).
    """
    if isinstance(preset, ModelConfig):
        return preset.replace(**overrides) if overrides else preset
    key = preset.lower().replace("_", "-")
    aliases = {k.replace("-", ""): k for k in presets.PRESETS}
    name = key if key in presets.PRESETS else aliases.get(key.replace("-", ""))
    if name is None:
        import difflib  # noqa: PLC0415
        near = difflib.get_close_matches(key, list(presets.PRESETS), n=3, cutoff=0.4)
        raise ValueError(f"preset {preset!r}: unknown; allowed: {sorted(presets.PRESETS)}"
                         + (f" (closest: {', '.join(near)})" if near else ""))
    return presets.PRESETS[name](dtype=dtype, **overrides)


@dataclasses.dataclass(frozen=True)
class BlogTable:
    """One model on one chip at one context, batch 1 unless ``batch`` says otherwise.

    Bytes are per decode step or per sequence as named; times in seconds.
    ``devices_needed``: chips whose memory holds the weights plus one sequence's cache
    at ``context`` (weights and caches sharded evenly; activations not counted).
    ``str()`` prints the table."""

    cfg: ModelConfig
    chip: hardware.Chip
    context: int
    batch: int
    kv_bytes_per_token: int
    kv_cache_bytes_per_sequence: int
    weight_bytes: int
    step_bytes: int
    step_flops: int
    arithmetic_intensity: float
    ridge_point: float | None
    memory_seconds: float
    compute_seconds: float | None
    step_seconds: float
    crossover_context: float
    max_batch: int
    devices_needed: int

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens/s of the whole batch at the roofline step time."""
        return self.batch / self.step_seconds

    def rows(self) -> list[tuple[str, str]]:
        """(quantity, value with unit) pairs, the blog's order."""
        c, gb = self.cfg, GB
        rows = [
            ("model", f"{c.name}: L={c.num_layers}, D={c.d_model}, N={c.num_heads}, "
                      f"K={c.num_kv_heads}, {c.dtype}"
                      + (f", W={c.window_size}" if c.window_size else "")),
            ("chip", f"{self.chip.name}: {self.chip.hbm_capacity_bytes / gb:.0f} GB at "
                     f"{self.chip.hbm_bytes_per_s / 1e12:.2f} TB/s"),
            ("context t", f"{self.context:,} tokens"),
            ("KV cache per token", f"{self.kv_bytes_per_token:,} B"),
            ("KV cache per sequence at t", f"{self.kv_cache_bytes_per_sequence / gb:,.2f} GB"),
            ("weights", f"{self.weight_bytes / gb:,.2f} GB"),
            ("KV / weights at t", f"{self.kv_cache_bytes_per_sequence / self.weight_bytes:.2f}"),
            ("crossover t* (KV read = weights)", "never (window)"
             if math.isinf(self.crossover_context) else f"{self.crossover_context:,.0f} tokens"),
            (f"bytes per decode step (batch {self.batch})", f"{self.step_bytes / gb:,.2f} GB"),
            (f"FLOP per decode step (batch {self.batch})", f"{self.step_flops / 1e9:,.1f} GFLOP"),
            ("arithmetic intensity", f"{self.arithmetic_intensity:.2f} FLOP/B (ridge "
             + (f"{self.ridge_point:.0f})" if self.ridge_point else "unknown)")),
            ("step time (roofline)", f"{self.step_seconds * 1e3:,.2f} ms (memory "
             f"{self.memory_seconds * 1e3:,.2f} ms, compute "
             + (f"{self.compute_seconds * 1e3:,.3f} ms)" if self.compute_seconds is not None
                else "unknown)")),
            ("decode tokens/s (roofline)", f"{self.tokens_per_s:,.1f}"),
            ("max batch at t (weights resident)", self._batch_text()),
        ]
        return rows

    def fits_with(self) -> list[str]:
        """When not one sequence fits beside the weights: what would (more devices
        sharing weights and caches, or 8-/4-bit weights on one), with the batch each
        allows at this context."""
        kv, w, cap = self.kv_cache_bytes_per_sequence, self.weight_bytes, \
            self.chip.hbm_capacity_bytes
        n = self.devices_needed
        out = [f"{n} x {self.chip.name} ({_seqs(math.floor((n * cap - w) / kv))})"]
        per = self.cfg.dtype_bytes
        for name, b in (("int8", 1), ("int4", 0.5)):
            wq = w / per * b
            if b < per and wq + kv <= cap:
                out.append(f"{name} weights ({wq / GB:,.0f} GB) on one "
                           f"({_seqs(math.floor((cap - wq) / kv))})")
                break
        return out

    def _batch_text(self) -> str:
        if self.max_batch > 0:
            return _seqs(self.max_batch)
        w, cap = self.weight_bytes / GB, self.chip.hbm_capacity_bytes / GB
        why = (f"the weights ({w:,.0f} GB) exceed the {cap:.0f} GB"
               if self.weight_bytes >= self.chip.hbm_capacity_bytes else
               f"one sequence's cache ({self.kv_cache_bytes_per_sequence / GB:,.1f} GB) "
               f"exceeds the {cap - w:,.1f} GB beside the weights")
        return f"0: {why}; fits: " + ", or ".join(self.fits_with())

    def __str__(self) -> str:
        rows = self.rows()
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def _seqs(n: int) -> str:
    return f"{n:,} sequence" + ("" if n == 1 else "s")


def blog_table(preset: str | ModelConfig, chip: str | hardware.Chip = "A100-80GB",
               context: int | str = 4096, dtype: str = "float16", batch: int = 1,
               **overrides: Any) -> BlogTable:
    """The blog's figures for ``preset`` (a :data:`kvjax.presets.PRESETS` name or a
    ModelConfig) on ``chip`` (a :data:`~kvjax.analysis.hardware.CHIPS` name or alias
    such as 'H100-80GB', or a Chip) at ``context`` tokens ('128K' = 131,072).

    ``overrides`` are ModelConfig fields (``window_size=4096``, ``num_kv_heads=1``).

    Raises:
      ValueError: an unknown preset or chip, a bad context or batch.
    """
    cfg = model_config(preset, dtype, **overrides)
    c = hardware.chip(chip) if isinstance(chip, str) else chip
    t = parse_context(context)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch={batch!r}; allowed: a positive integer")
    weights = theory.weight_bytes(cfg)
    sb = theory.step_bytes(cfg, t, batch).total
    sf = theory.step_flops(cfg, t, batch).total
    mem = theory.memory_time(sb, c)
    comp = theory.compute_time(sf, c, cfg.dtype)
    return BlogTable(
        cfg=cfg, chip=c, context=t, batch=batch,
        kv_bytes_per_token=theory.kv_bytes_per_token(cfg),
        kv_cache_bytes_per_sequence=theory.kv_cache_bytes(cfg, t),
        weight_bytes=weights, step_bytes=sb, step_flops=sf,
        arithmetic_intensity=theory.arithmetic_intensity(sf, sb),
        ridge_point=c.ridge_point(cfg.dtype), memory_seconds=mem, compute_seconds=comp,
        step_seconds=theory.step_time(sb, sf, c, cfg.dtype),
        crossover_context=theory.crossover_context(cfg),
        max_batch=theory.max_batch(cfg, t, c.hbm_capacity_bytes, reserve_bytes=weights),
        devices_needed=math.ceil((weights + theory.kv_cache_bytes(cfg, t))
                                 / c.hbm_capacity_bytes))
