"""Capacity planner: the fewest devices that hold one request, and the max batch per mesh.

Theory only (:mod:`kvjax.analysis.theory`, published chip memories in
:mod:`kvjax.analysis.hardware`). A mesh of n devices splits the weights n ways
(tensor parallelism over heads / FFN / vocabulary, plus the sequence axis, which
leaves weights whole: here weights are counted split over ``model`` = n when the model
axis can take n, else replicated over the rest) and the KV cache n ways (KV heads over
'model' up to K, then slots over 'seq': any n splits the cache). Per device:

    weights / TP + B · KV(t) / n  <=  memory · usable

``usable`` (default 0.9) leaves room for activations and the runtime. Units: bytes,
tokens; device counts are powers of two (meshes as built in practice).
"""

from __future__ import annotations

import dataclasses

from kvjax.analysis import hardware, sizing, theory
from kvjax.config import ModelConfig

POW2 = tuple(2 ** i for i in range(11))  # 1 .. 1024 devices


def tp_degree(cfg: ModelConfig, n: int) -> int:
    """The largest tensor-parallel degree <= n that divides the query heads N and the FFN
    width F (the rest of the n devices split only the cache, over 'seq' and 'data')."""
    return max(d for d in range(1, n + 1)
               if n % d == 0 and cfg.num_heads % d == 0 and cfg.mlp_dim % d == 0)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One (model, chip, context) line of the planner.

    Attributes:
      model, chip: names. context: t, tokens. weight_bytes, kv_bytes: whole weights and
      one request's cache at t. devices: fewest devices (power of two) that hold one
      request (None: more than 1024). tp: tensor-parallel degree at that count.
      per_device_bytes: weights / tp + KV / devices at that count.
      max_batch: {devices: requests at context t that fit on a mesh of that many}.
    """

    model: str
    chip: str
    context: int
    weight_bytes: int
    kv_bytes: int
    devices: int | None
    tp: int | None
    per_device_bytes: float | None
    max_batch: dict


def per_device(cfg: ModelConfig, t: int, n: int, batch: int = 1) -> float:
    """Bytes per device of weights (split over :func:`tp_degree`) and ``batch`` caches at
    context t (split over all n devices)."""
    return (theory.weight_bytes(cfg) / tp_degree(cfg, n)
            + batch * theory.kv_cache_bytes(cfg, t, 1) / n)


def max_batch(cfg: ModelConfig, t: int, n: int, memory_bytes: float,
              usable: float = 0.9) -> int:
    """Requests at context t whose caches fit on n devices of ``memory_bytes`` each."""
    free = n * (memory_bytes * usable - theory.weight_bytes(cfg) / tp_degree(cfg, n))
    kv = theory.kv_cache_bytes(cfg, t, 1)
    return max(0, int(free // kv)) if free > 0 else 0


def plan(preset: str | ModelConfig, chip: str, context, dtype: str = "float16",
         usable: float = 0.9, meshes=(1, 2, 4, 8, 16)) -> Plan:
    """The :class:`Plan` of a preset (:data:`kvjax.presets.PRESETS`) on a chip
    (:func:`kvjax.analysis.hardware.chip`, aliases allowed) at a context ('128K' = 131072).

    Raises:
      ValueError: unknown preset, chip or context.
    """
    cfg = sizing.model_config(preset, dtype=dtype)
    c = hardware.chip(chip)
    t = sizing.parse_context(context)
    mem = c.hbm_capacity_bytes * usable
    devices = next((n for n in POW2 if per_device(cfg, t, n) <= mem), None)
    return Plan(
        model=cfg.name, chip=c.name, context=t, weight_bytes=theory.weight_bytes(cfg),
        kv_bytes=theory.kv_cache_bytes(cfg, t, 1), devices=devices,
        tp=None if devices is None else tp_degree(cfg, devices),
        per_device_bytes=None if devices is None else per_device(cfg, t, devices),
        max_batch={n: max_batch(cfg, t, n, c.hbm_capacity_bytes, usable) for n in meshes})


def table(plans: list[Plan]) -> str:
    """A markdown table of plans (GB = 1e9 bytes)."""
    ns = sorted(plans[0].max_batch)
    head = ("| model | chip | t | weights GB | KV/request GB | devices for 1 request | "
            + " | ".join(f"max B @{n}" for n in ns) + " |")
    rows = [head, "|" + "---|" * (6 + len(ns))]
    for p in plans:
        rows.append(f"| {p.model} | {p.chip} | {p.context:,} | {p.weight_bytes / 1e9:.1f} | "
                    f"{p.kv_bytes / 1e9:.1f} | {p.devices} (TP {p.tp}) | "
                    + " | ".join(str(p.max_batch[n]) for n in ns) + " |")
    return "\n".join(rows)
