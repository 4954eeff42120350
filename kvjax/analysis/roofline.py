"""Jaxpr-level cost (``jax.experimental.roofline``), loop-corrected, and roofline helpers.

``jax.experimental.roofline.roofline(f)(*args)`` walks f's jaxpr and sums per-primitive
rules: ``flops`` and ``hbm_bytes`` count dot_general/conv only (each dot reads both
operands and writes its output once: the blog's matrix-vector accounting, before XLA
fuses, converts or copies anything); ``unfused_flops``/``unfused_hbm_bytes`` count every
primitive as if nothing were fused (an upper bound). Like XLA's cost analysis it counts a
``scan`` body once, and a ``while`` loop not at all. :func:`jaxpr_cost` corrects both:

    C(j) = R(j) + sum over scans s in j of (n_s - 1)·R(body_s) + n_s·(C(body_s) - R(body_s))
                + sum over while loops w in j of n_w·(C(body_w) + C(cond_w))

with R() the library's figure and n the trip count (a scan's ``length``; a while loop's
count must be given, e.g. the number of decode steps).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
from jax.experimental import roofline as jax_roofline
from jax.extend import core as jex_core

from kvjax.analysis.hardware import Chip

_FIELDS = ("flops", "hbm_bytes", "unfused_flops", "unfused_hbm_bytes")


@dataclasses.dataclass(frozen=True)
class JaxprCost:
    """Jaxpr-level cost of a function (loop-corrected).

    Attributes:
      flops: FLOP of dot_general/conv primitives (2 per multiply-add).
      hbm_bytes: bytes of those dots' operands and outputs, each dot on its own.
      unfused_flops, unfused_hbm_bytes: every primitive counted, nothing fused.
      raw: the same four figures as ``jax.experimental.roofline`` reports them.
      loops: (primitive, trip count) of every loop corrected, outermost first.
      complete: False if a while loop's trip count was unknown (counted once).
    """

    flops: float
    hbm_bytes: float
    unfused_flops: float
    unfused_hbm_bytes: float
    raw: dict
    loops: tuple[tuple[str, int | None], ...]
    complete: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _vec(result) -> tuple[float, ...]:
    return tuple(float(getattr(result, f)) for f in _FIELDS)


def _add(a, b, scale: float = 1.0):
    return tuple(x + scale * y for x, y in zip(a, b))


def _zeros():
    return (0.0,) * len(_FIELDS)


def _closed_roofline(closed) -> tuple[float, ...]:
    """The library's figure for a ClosedJaxpr (scan bodies once, while loops zero)."""
    specs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    # jaxpr_as_fun flattens the arguments: the rebuilt jaxpr is the same one.
    _, result = jax_roofline.roofline(jex_core.jaxpr_as_fun(closed))(*specs)
    return _vec(result)


def _as_closed(j):
    if isinstance(j, jex_core.ClosedJaxpr):
        return j
    return jex_core.ClosedJaxpr(j, [])


def _correction(jaxpr, while_trip_count: int | None, loops: list, state: dict):
    """What the library misses in ``jaxpr`` (and in the calls inside it)."""
    total = _zeros()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "scan":
            body = _as_closed(eqn.params["jaxpr"])
            n = int(eqn.params["length"])
            loops.append(("scan", n))
            r = _closed_roofline(body)
            inner = _correction(body.jaxpr, while_trip_count, loops, state)
            # library: R(body) once (its inner loops uncorrected); wanted: n·C(body)
            total = _add(total, _add(r, inner), scale=n)
            total = _add(total, r, scale=-1.0)
        elif name == "while":
            n = while_trip_count
            if n is None:
                state["complete"] = False
                n = 1
            loops.append(("while", while_trip_count))
            for key in ("body_jaxpr", "cond_jaxpr"):
                sub = _as_closed(eqn.params[key])
                r = _closed_roofline(sub)
                inner = _correction(sub.jaxpr, while_trip_count, loops, state)
                total = _add(total, _add(r, inner), scale=n)  # library counted 0
        else:
            for sub in jex_core.jaxprs_in_params(eqn.params):
                total = _add(total, _correction(sub, while_trip_count, loops, state))
    return total


def jaxpr_cost(fn: Callable, *args: Any, while_trip_count: int | None = None) -> JaxprCost:
    """Loop-corrected ``jax.experimental.roofline`` cost of ``fn(*args)``.

    Args:
      fn: the function (jitted or not; static arguments bound, e.g. with partial).
      args: arrays or ``jax.ShapeDtypeStruct``s (nothing is allocated).
      while_trip_count: iterations of every ``while`` loop (scans carry their length).
    Returns:
      JaxprCost; ``raw`` holds the library's uncorrected figures.
    """
    # The library logs a warning for every primitive without a rule; costs are unaffected.
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        closed = jax.make_jaxpr(fn)(*args)  # traced once; the library re-walks the jaxpr
        raw = _closed_roofline(closed)
        loops: list = []
        state = {"complete": True}
        corr = _correction(closed.jaxpr, while_trip_count, loops, state)
    finally:
        logger.setLevel(level)
    total = _add(raw, corr)
    return JaxprCost(*total, raw=dict(zip(_FIELDS, raw)), loops=tuple(loops),
                     complete=state["complete"])


# --------------------------------------------------------------------------- roofline


def attainable_flops(intensity: float, chip: Chip, dtype: Any = "float16") -> float:
    """Roofline bound, FLOP/s: min(peak, intensity x bandwidth) (Williams et al. 2009;
    the ridge point is ``chip.ridge_point(dtype)``). An unknown peak leaves only the
    bandwidth slope."""
    peak = chip.peak_flops(dtype)
    slope = intensity * chip.hbm_bytes_per_s
    return slope if peak is None else min(peak, slope)
