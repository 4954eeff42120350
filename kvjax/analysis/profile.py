"""Where a decode step's time goes: the compiled step's thunks, timed by JAX's profiler.

The cost hook (:mod:`kvjax.analysis.costs`) counts a step's bytes three ways and times the
step whole. This module splits the measured time: it runs the compiled step under
``jax.profiler.trace`` and reads, from the trace, how long each instruction of the
step's ENTRY computation ran (XLA:CPU runs each such instruction as one thunk, its
fusions' bodies inside; the layer stack is unrolled on CPU, docs/decisions/
0002-unrolled-layer-stack-on-cpu.md). Each instruction is matched by name to the
compiled HLO text, which gives its opcode, custom-call target (the native kernels), the
module path it came from (``layers_3/mlp/up``) and its operands' bytes.

The operands' bytes are what an instruction reads when it reads every operand whole:
true of a dot and of the native kernels (the decode-attention kernel reads the whole
cache of its layer, masked slots included, as theory's step does), not of an in-place
cache write (a dynamic-update-slice fusion names the whole cache as an operand and
writes one slot). So GB/s is reported for dots and custom calls only.

CPU only: on a GPU the trace's kernel names are not the HLO's instruction names.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import statistics
import tempfile

import jax

from kvjax.analysis import costs, hlo_cost
from kvjax.cache import compress as compress_lib
from kvjax.config import ModelConfig
from kvjax.models import model

FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast"})
"""Entry instructions that run no code (no thunk of their own; scripts/thunk_count.py)."""

READ_WHOLE = frozenset({"dot", "custom-call", "convolution"})
"""Opcodes whose operands' bytes are what they read (module docstring)."""

_LAYER = re.compile(r"layers_\d+")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled ENTRY computation.

    name: its HLO name (the thunk's name in a trace); opcode; target: the custom-call
    target ('' otherwise); path: for a dot or custom call that reads a weight (a step
    parameter under ``params``, through bitcasts), the largest such weight's path
    (``layers_0/mlp/up/kernel``; the tied LM head ``embed/embedding``); else the module
    path of its ``op_name`` metadata below the jitted function and the model
    (``layers_0/attn``); else the first step parameter it reads; else '';
    operand_bytes / output_bytes: bytes of its operands (an operand named twice counted
    once) and of its result (every array of a tuple).
    """
    name: str
    opcode: str
    target: str
    path: str
    operand_bytes: int
    output_bytes: int


def _param_path(name: str) -> str:
    """A step parameter's pytree path from its HLO name
    (``params__layers_0____attn____o_proj____kernel__.1`` -> ``layers_0/attn/o_proj/kernel``)."""
    return re.sub(r"_{2,}", "/", re.sub(r"\.\d+$", "", name).removeprefix("params")).strip("/_")


def entry_instructions(hlo_text: str) -> dict[str, Instruction]:
    """The instructions of the ENTRY computation of a compiled module's text
    (``compiled.as_text()``; parsed by :mod:`kvjax.analysis.hlo_cost`), by name, in
    program order; parameters, constants, tuples and bitcasts (:data:`FREE`) are left
    out, as they run no code.

    Raises:
      ValueError: the text holds no ENTRY computation, or an element type
        :func:`kvjax.analysis.hlo_cost.shape_bytes` does not know.
    """
    comps, entry = hlo_cost.split_computations(hlo_text)
    if not entry:
        raise ValueError("the HLO text holds no ENTRY computation; allowed: the text of "
                         "a compiled module (compiled.as_text())")
    sizes: dict[str, float] = {}
    origin: dict[str, str] = {}  # the step parameter an array is (through bitcasts)
    out: dict[str, Instruction] = {}
    for line in comps[entry][1:]:
        ins = hlo_cost.parse_instruction(line)
        if ins is None:
            continue
        sizes[ins.name] = hlo_cost.shape_bytes(ins.type)
        if ins.opcode == "parameter":
            origin[ins.name] = ins.name
        elif ins.opcode == "bitcast" and ins.operands and ins.operands[0] in origin:
            origin[ins.name] = origin[ins.operands[0]]
        if ins.opcode in FREE:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        path = "/".join(p for p in ins.op_name.split("/")[1:-1]  # jit(...)/…/primitive
                        if p != "DecoderLM")
        read = [origin[o] for o in ins.operands if o in origin]
        weights = [o for o in read if o.startswith("params")]
        if weights and ins.opcode in READ_WHOLE:  # a weight product: the weight it reads
            path = _param_path(max(weights, key=sizes.get))
        elif not path and read:  # no metadata: the first step parameter it reads
            path = _param_path(read[0])
        out[ins.name] = Instruction(
            name=ins.name, opcode=ins.opcode, target=target.group(1) if target else "",
            path=path, operand_bytes=int(sum(sizes.get(o, 0)
                                             for o in dict.fromkeys(ins.operands))),
            output_bytes=int(sizes[ins.name]))
    return out


def module_name(hlo_text: str) -> str:
    """The name of a module's HLO text (``HloModule jit_decode_step, ...``); '' if none."""
    m = re.match(r"\s*HloModule\s+([\w.\-]+)", hlo_text)
    return m.group(1) if m else ""


def thunk_seconds(events: list[dict], names, module: str = "") -> dict[str, list[float]]:
    """Seconds of each run of the named thunks in a Chrome/Perfetto trace's events
    (complete events, ``ph`` 'X', ``dur`` in microseconds), on every thread but the
    Python one (a thunk runs on the runtime's threads; a Python-side span of the same
    name is not the thunk) and, with ``module``, of that program only (an event's
    ``hlo_module`` argument: the small programs a step's caller runs between steps have
    thunks named ``copy`` too). Returns {name: [seconds of each run, in trace order]} for
    the names that ran."""
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    names = set(names)
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        if (e["name"] in names and threads.get((e.get("pid"), e.get("tid"))) != "python"
                and (not module or e.get("args", {}).get("hlo_module", module) == module)):
            out[e["name"]].append(e["dur"] / 1e6)
    return dict(out)


@dataclasses.dataclass(frozen=True)
class Group:
    """The instructions of one kind in a step: ``key`` names them (the custom-call
    target or opcode, then the module path with layer numbers as ``layers_*``);
    ``count``: instructions per step; ``seconds``: their summed time per step (the
    median over the profiled steps); ``read_bytes``: their operands' bytes per step
    where they read them whole (:data:`READ_WHOLE`), else None."""
    key: str
    count: int
    seconds: float
    read_bytes: int | None


@dataclasses.dataclass(frozen=True)
class StepProfile:
    """A profiled decode step: ``groups`` (largest time first); ``steps``: steps
    profiled; ``wall_seconds``: the median step time, untimed by the profiler (timed
    before it started); ``traced_wall_seconds``: the median while traced;
    ``thunk_seconds``: the median over steps of all thunks' summed time;
    ``missing``: instructions of the step the trace holds fewer runs of than steps
    (none, normally: every ENTRY instruction runs once a step)."""
    groups: tuple[Group, ...]
    steps: int
    wall_seconds: float
    traced_wall_seconds: float
    thunk_seconds: float
    missing: tuple[str, ...]


def group_key(ins: Instruction) -> str:
    """The group an instruction is reported in: its custom-call target, or 'dot' for a
    dot, then its module path (layer numbers as ``layers_*``); every other opcode
    (fusions, copies, ...) in one group per top-level path part
    (:class:`Instruction`'s path)."""
    path = _LAYER.sub("layers_*", ins.path)
    if ins.opcode in READ_WHOLE:
        return f"{ins.target or ins.opcode} {path}".strip()
    top = "/".join(path.split("/")[:2]) if path.startswith("layers_*") else path.split("/")[0]
    return f"XLA ops {top}".strip()


def summarize(instructions: dict[str, Instruction], runs: dict[str, list[float]],
              steps: int) -> tuple[tuple[Group, ...], float, tuple[str, ...]]:
    """Groups (:func:`group_key`) of ``instructions`` with the seconds of their runs
    (:func:`thunk_seconds`; run i of an instruction belongs to step i // runs-per-step),
    the median over steps of all thunks' time, and the instructions that ran fewer
    than ``steps`` times.

    Raises:
      ValueError: steps < 1, or an instruction ran a number of times that is not a
        multiple of steps (the trace holds more than the profiled steps).
    """
    if steps < 1:
        raise ValueError(f"steps={steps}; allowed: an integer >= 1")
    by_group: dict[str, list] = {}
    missing = []
    for name, ins in instructions.items():
        times = runs.get(name, [])
        if len(times) < steps:
            missing.append(name)
            continue
        if len(times) % steps:
            raise ValueError(f"instruction {name} ran {len(times)} times in {steps} steps; "
                             "allowed: a multiple of the steps (trace only the profiled steps)")
        each = len(times) // steps
        secs = [sum(times[i * each:(i + 1) * each]) for i in range(steps)]
        g = by_group.setdefault(group_key(ins), [0, [0.0] * steps, 0])
        g[0] += each
        g[1] = [a + b for a, b in zip(g[1], secs)]
        g[2] = g[2] + ins.operand_bytes * each if ins.opcode in READ_WHOLE else None
    groups = tuple(sorted((Group(key=k, count=c, seconds=statistics.median(s), read_bytes=b)
                           for k, (c, s, b) in by_group.items()), key=lambda g: -g.seconds))
    totals = [sum(s[i] for _, s, _ in by_group.values()) for i in range(steps)]
    return groups, statistics.median(totals) if totals else 0.0, tuple(missing)


def trace_events(log_dir: str) -> list[dict]:
    """The events of the Perfetto trace that ``jax.profiler.trace(log_dir,
    create_perfetto_trace=True)`` wrote.

    Raises:
      FileNotFoundError: no trace under ``log_dir``.
    """
    found = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(sorted(found)[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def profile_step(cfg: ModelConfig, context: int, steps: int = 7, warmup: int = 2,
                 batch: int = 1) -> StepProfile:
    """Profiles ``steps`` decode steps of ``cfg`` (random weights) over a full cache of
    ``context`` slots (:func:`kvjax.cache.compress.full_cache`), the plan resolved for
    that context (:func:`kvjax.analysis.costs.planned`), after ``warmup`` untraced ones
    (also timed untraced: :attr:`StepProfile.wall_seconds`).

    Raises:
      ValueError: steps < 1, warmup < 0, or a device other than a CPU (module docstring).
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps={steps}, warmup={warmup}; allowed: steps >= 1, warmup >= 0")
    platform = jax.devices()[0].platform
    if platform != "cpu":
        raise ValueError(f"device platform {platform!r}; allowed: 'cpu' (a GPU trace's "
                         "kernel names are not the HLO's instruction names)")
    cfg = costs.planned(cfg, batch, context)
    params = model.init_params(cfg, 0)
    cache = compress_lib.full_cache(cfg, batch, context)
    compiled = costs.compile_decode_step(cfg, batch, context)
    run = costs.step_timer(cfg, params, cache, batch, compiled=compiled)
    untraced = [run() for _ in range(warmup + steps)][warmup:]
    text = compiled.as_text()
    instructions = entry_instructions(text)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            traced = [run() for _ in range(steps)]
        events = trace_events(d)
    groups, thunks, missing = summarize(
        instructions, thunk_seconds(events, instructions, module_name(text)), steps)
    return StepProfile(groups=groups, steps=steps,
                       wall_seconds=statistics.median(untraced),
                       traced_wall_seconds=statistics.median(traced),
                       thunk_seconds=thunks, missing=missing)
