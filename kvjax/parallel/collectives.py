"""Collectives of a compiled SPMD program: kind, bytes and mesh axis, from the HLO text.

XLA's ``cost_analysis()`` is per device and has no communication entry; the collectives
are read here from ``compiled.as_text()``: every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute with its result type (per-device payload bytes), its
operand types and its replica groups, mapped back to the mesh axes they span
('data', 'model', 'seq'). Replica-group formats read: explicit ``{{0,1},{2,3}}``, iota
``[G,N]<=[dims]T(perm)`` and ``mesh['axis_0'=a,...] {'axis_i',...}``.

Link bytes (what one device sends over its links, ring algorithms; n = group size,
X = payload): all-reduce 2(n-1)/n·X, all-gather (n-1)/n·X (X the gathered result),
reduce-scatter (n-1)/n·X (X the operand), all-to-all (n-1)/n·X, collective-permute X.
A collective inside a while body is counted once (decode_step has no loop on CPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter, defaultdict

import numpy as np

from kvjax.analysis.hlo_cost import parse_instruction, shape_bytes

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DIMS = re.compile(r"\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    kind: one of :data:`KINDS`. bytes: per-device payload (result type), bytes.
    link_bytes: bytes one device sends (ring estimate, module doc). axes: the mesh axes
    its groups span (sorted, e.g. ('model',)); () if unknown. group_size: devices per
    group. result_shapes / operand_shapes: dims of the result and operand arrays.
    op_name: the JAX op it came from (metadata).
    """

    name: str
    kind: str
    bytes: float
    link_bytes: float
    axes: tuple
    group_size: int
    result_shapes: tuple
    operand_shapes: tuple
    op_name: str


def _shapes(type_text: str) -> tuple:
    return tuple(tuple(int(d) for d in filter(None, m.split(",")))
                 for m in _DIMS.findall(re.sub(r"\{[^}]*\}", "", type_text)))


def replica_groups(attrs: str, num_devices: int) -> list[list[int]]:
    """The replica groups of a collective's attribute text, as lists of partition ids."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = [int(v) for v in re.findall(r"'?\w+'?=(\d+)", m.group(1))]
        names = re.findall(r"'?(\w+)'?=\d+", m.group(1))
        over = [names.index(n) for n in re.findall(r"'?(\w+)'?", m.group(2))]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        rest = [a for a in range(len(sizes)) if a not in over]
        ids = np.transpose(ids, rest + over).reshape(-1, int(np.prod([sizes[a] for a in over]
                                                                     or [1])))
        return ids.tolist()
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        g, n = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = np.transpose(ids, [int(p) for p in m.group(4).split(",")])
        return ids.reshape(g, n).tolist()
    m = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", attrs)
    if m:
        return [[int(x) for x in grp.split(",") if x.strip()]
                for grp in re.findall(r"\{([\d, ]*)\}", m.group(1))]
    m = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", attrs)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(0))]
    return [list(range(num_devices))]


def mesh_axes(groups: list[list[int]], mesh) -> tuple:
    """Mesh axes whose coordinate varies within a group (partition id = flat index)."""
    shape = tuple(mesh.devices.shape)
    coords = np.stack(np.unravel_index(np.arange(int(np.prod(shape))), shape), axis=1)
    axes = set()
    for grp in groups:
        c = coords[grp]
        axes |= {mesh.axis_names[a] for a in range(len(shape)) if len(set(c[:, a])) > 1}
    return tuple(sorted(axes))


def _link_bytes(kind: str, payload: float, operand: float, n: int) -> float:
    if n <= 1:
        return 0.0
    f = (n - 1) / n
    return {"all-reduce": 2 * f * payload, "all-gather": f * payload,
            "reduce-scatter": f * operand, "all-to-all": f * payload,
            "collective-permute": payload}[kind]


def collectives(compiled_or_text, mesh) -> list[Collective]:
    """Every collective of a compiled program (or its HLO text) on ``mesh``."""
    text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
    parsed = [p for p in map(parse_instruction, text.splitlines()) if p is not None]
    types = {p.name: p.type for p in parsed}
    n_dev = int(np.prod(mesh.devices.shape))
    out = []
    for p in parsed:
        kind = next((k for k in KINDS if p.opcode in (k, k + "-start")), None)
        if kind is None:
            continue
        groups = replica_groups(p.attrs, n_dev)
        ops = [types.get(o, "") for o in p.operands]
        payload = shape_bytes(p.type if not p.opcode.endswith("-start") else ops and
                              " ".join(ops) or p.type)
        operand = sum(shape_bytes(t) for t in ops)
        n = len(groups[0]) if groups else 1
        if kind == "collective-permute":
            n = 2
        out.append(Collective(
            name=p.name, kind=kind, bytes=payload, link_bytes=_link_bytes(kind, payload,
                                                                          operand, n),
            axes=mesh_axes(groups, mesh) if kind != "collective-permute" else
            mesh_axes([list(g) for g in groups], mesh),
            group_size=n, result_shapes=_shapes(p.type),
            operand_shapes=tuple(itertools.chain.from_iterable(_shapes(t) for t in ops)),
            op_name=p.op_name))
    return out


def inventory(colls: list[Collective]) -> dict:
    """(kind, axes) -> {'count', 'bytes', 'link_bytes'} summed over the program."""
    inv = defaultdict(lambda: {"count": 0, "bytes": 0.0, "link_bytes": 0.0})
    for c in colls:
        e = inv[(c.kind, c.axes)]
        e["count"] += 1
        e["bytes"] += c.bytes
        e["link_bytes"] += c.link_bytes
    return dict(inv)


def bytes_per_axis(colls: list[Collective]) -> dict:
    """mesh axis (or 'a+b' for groups spanning several) -> link bytes per device."""
    out = Counter()
    for c in colls:
        out["+".join(c.axes) or "-"] += c.link_bytes
    return dict(out)


def cache_collectives(colls: list[Collective], shapes: list[tuple]) -> list[Collective]:
    """The all-gathers and all-to-alls that move a cache tensor: an operand or result
    whose dims equal one of ``shapes`` (a cache tensor's global or per-device shape)."""
    shapes = {tuple(s) for s in shapes}
    return [c for c in colls if c.kind in ("all-gather", "all-to-all")
            and (shapes & set(c.operand_shapes) or shapes & set(c.result_shapes))]


class CacheGatherError(RuntimeError):
    """A compiled program on a mesh all-gathers or all-to-alls a cache tensor: the cache
    was to stay sharded (docs/DESIGN.md, "Meshes"), so the per-device figures are wrong."""


def check_cache_stays(programs: dict, shapes: list[tuple]) -> None:
    """Raises :class:`CacheGatherError` when any program moves a cache tensor.

    Args:
      programs: program name (e.g. 'prefill', 'generate', 'step') -> its collectives
        (:func:`collectives`).
      shapes: the cache tensors' global and per-device shapes (:func:`cache_collectives`).
    Raises:
      CacheGatherError: naming each offending program, the count, kind, payload bytes
        and the first offending instruction's operand and result shapes.
    """
    bad = []
    for name, colls in programs.items():
        found = cache_collectives(colls, shapes)
        if found:
            kinds = sorted({c.kind for c in found})
            c = found[0]
            bad.append(f"{name}: {len(found)} x {'/'.join(kinds)} of cache tensors, "
                       f"{sum(x.bytes for x in found) / 1e3:,.1f} KB per device (e.g. "
                       f"{c.name} over {'+'.join(c.axes) or '?'}: operand "
                       f"{', '.join(str(list(x)) for x in c.operand_shapes)} -> result "
                       f"{', '.join(str(list(x)) for x in c.result_shapes)})")
    if bad:
        raise CacheGatherError(
            "the cache was gathered on the mesh (it must stay sharded: each device reads "
            "and writes only its own slots / heads): " + "; ".join(bad))
