"""Loop-aware XLA cost analysis of compiled programs.

XLA's ``cost_analysis()`` counts the body of a while loop once (DESIGN.md: a 12-layer
``lax.scan`` reported 1/12 of the unrolled FLOPs). This module corrects that soundly with
XLA's own cost model: it splits the optimised HLO module into its while-loop bodies, costs
each body as a module of its own (``hlo_module_cost_analysis``), and multiplies by the
trip count the compiled loop carries (``known_trip_count`` in its backend_config), or by
a count the caller supplies for loops whose count is only known at run time (the decode
loop). Nested loops (the scanned layer stack inside the decode loop) are corrected
recursively:

    C(comp) = raw(comp) + sum over loops w directly in comp of
              n_w * (C(body_w) + C(cond_w)) - (raw(body_w) + raw(cond_w))

where raw() is XLA's figure (each nested body once) and n_w the trip count.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

import jax
from jax._src.lib import _jax  # hlo_module_cost_analysis: XLA's HloCostAnalysis
from jaxlib import _hlo

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_WHILE = re.compile(r"=\s*.*\bwhile\(.*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM_CALL = re.compile(r"\bcustom-call\(.*custom_call_target=\"([^\"]+)\"")


def normalize_cost(cost: Any) -> dict:
    """``Compiled.cost_analysis()`` as a dict across JAX versions.

    Newer JAX returns a dict, older ones a one-element list of dicts; some backends return
    None. Returns {} for None.
    """
    if cost is None:
        return {}
    if isinstance(cost, (list, tuple)):
        return dict(cost[0]) if cost else {}
    return dict(cost)


def memory_stats(compiled) -> dict:
    """``memory_analysis()`` as a dict of bytes: argument, output, alias, temp, code.

    Returns {} when the backend gives none.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {k.replace("_size_in_bytes", "_bytes"): int(getattr(ma, k, 0)) for k in keys}


@dataclasses.dataclass(frozen=True)
class LoopCost:
    """One while loop: its trip count and the corrected cost of one iteration."""

    body: str
    trip_count: int | None
    trip_count_source: str  # 'xla' (known_trip_count), 'given', or 'unknown'
    iteration_flops: float
    iteration_bytes: float


@dataclasses.dataclass(frozen=True)
class CostReport:
    """XLA's figures for a compiled program, raw and loop-corrected.

    Attributes:
      raw_flops, raw_bytes: ``cost_analysis()`` as XLA reports it (loop bodies once).
      flops, bytes: loop-corrected totals (FLOP, bytes accessed).
      loops: every while loop found, outermost first.
      complete: False when a loop's trip count is unknown (counted once) or the module has
        custom calls whose cost XLA cannot see (e.g. cuBLAS/cuDNN GEMMs on GPU).
      custom_calls: targets of the custom calls found.
    """

    raw_flops: float
    raw_bytes: float
    flops: float
    bytes: float
    loops: tuple[LoopCost, ...]
    complete: bool
    custom_calls: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    comps: dict[str, list[str]] = {}
    entry = ""
    current = None
    for line in hlo_text.splitlines():
        if current is None:
            m = _COMP_HEADER.match(line.strip())
            if m:
                current = m.group(2)
                comps[current] = [line]
                if m.group(1):
                    entry = current
        else:
            comps[current].append(line)
            if line.strip() == "}":
                current = None
    return comps, entry


def _callees(lines: list[str]) -> set[str]:
    out = set()
    for line in lines[1:]:
        for m in _CALLEE.finditer(line):
            out.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(","))
    return out


def _closure(name: str, comps: dict[str, list[str]]) -> list[str]:
    seen, stack = [], [name]
    while stack:
        n = stack.pop()
        if n in seen or n not in comps:
            continue
        seen.append(n)
        stack.extend(_callees(comps[n]))
    return seen


_STACK_FRAME = re.compile(r",?\s*stack_frame_id=\d+")


def _module_text(name: str, comps: dict[str, list[str]]) -> str:
    parts = ["HloModule sub_" + re.sub(r"[^\w]", "_", name)]
    for n in reversed(_closure(name, comps)):
        lines = list(comps[n])
        header = lines[0].strip()
        if header.startswith("ENTRY"):
            header = header[len("ENTRY"):].strip()
        if n == name:
            header = "ENTRY " + header
        parts.append("\n".join([header] + lines[1:]))
    return _STACK_FRAME.sub("", "\n\n".join(parts))


def _raw_cost(module_text: str) -> tuple[float, float]:
    module = _hlo.hlo_module_from_text(module_text)
    client = jax.devices("cpu")[0].client
    cost = _jax.hlo_module_cost_analysis(client, module)
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def loop_aware_cost(compiled, trip_counts: Mapping[str, int] | None = None,
                    default_trip_count: int | None = None) -> CostReport:
    """Loop-corrected XLA cost of a compiled program.

    Args:
      compiled: a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``).
      trip_counts: body computation name -> trip count, for loops XLA cannot count.
      default_trip_count: trip count for every loop without a known one (e.g. the number
        of decode steps of the generate loop); None leaves them counted once and marks
        the report incomplete.
    Returns:
      CostReport with raw and corrected FLOP and bytes.
    """
    trip_counts = dict(trip_counts or {})
    text = compiled.as_text()
    comps, entry = _split_computations(text)
    raw = normalize_cost(compiled.cost_analysis())
    loops: list[LoopCost] = []
    complete = True
    cache: dict[str, tuple[float, float]] = {}

    def corrected(name: str) -> tuple[float, float]:
        nonlocal complete
        if name in cache:
            return cache[name]
        flops, nbytes = _raw_cost(_module_text(name, comps))
        for line in comps[name][1:]:
            m = _WHILE.search(line)
            if not m:
                continue
            cond, body = m.group(1), m.group(2)
            t = _TRIP.search(line)
            if t:
                n, source = int(t.group(1)), "xla"
            elif body in trip_counts:
                n, source = trip_counts[body], "given"
            elif default_trip_count is not None:
                n, source = default_trip_count, "given"
            else:
                n, source = 1, "unknown"
                complete = False
            bf, bb = corrected(body)
            cf, cb = corrected(cond)
            rbf, rbb = _raw_cost(_module_text(body, comps))
            rcf, rcb = _raw_cost(_module_text(cond, comps))
            flops += n * (bf + cf) - (rbf + rcf)
            nbytes += n * (bb + cb) - (rbb + rcb)
            loops.append(LoopCost(body, n if source != "unknown" else None, source,
                                  bf + cf, bb + cb))
        cache[name] = (flops, nbytes)
        return cache[name]

    flops, nbytes = corrected(entry)
    custom = tuple(sorted({m.group(1) for m in _CUSTOM_CALL.finditer(text)}))
    if custom:
        complete = False
    return CostReport(raw_flops=float(raw.get("flops", -1.0)),
                      raw_bytes=float(raw.get("bytes accessed", -1.0)),
                      flops=flops, bytes=nbytes, loops=tuple(reversed(loops)),
                      complete=complete, custom_calls=custom)


def to_json(report: CostReport) -> str:
    return json.dumps(report.as_dict(), indent=2)
