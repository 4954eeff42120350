"""Loop-aware, attributed XLA cost analysis of compiled programs.

XLA's ``cost_analysis()`` counts the body of a while loop once (a 12-layer ``lax.scan``
reported 1/12 of the unrolled FLOPs; docs/decisions/0001-loop-aware-hlo-costs.md). This
module corrects that soundly with XLA's own cost model (``HloCostAnalysis``, via
``hlo_module_cost_analysis``), two ways that must agree:

* :func:`loop_aware_cost` splits the optimised HLO module into its while-loop bodies,
  costs each body as a module of its own and multiplies by the trip count the compiled
  loop carries (``known_trip_count`` in its backend_config), or by a count the caller
  supplies for loops whose count is only known at run time (the decode loop). Nested
  loops (the scanned layer stack inside the decode loop) are corrected recursively:

      C(comp) = raw(comp) + sum over loops w directly in comp of
                n_w * (C(body_w) + C(cond_w)) - (raw(body_w) + raw(cond_w))

  where raw() is XLA's figure (each nested body once) and n_w the trip count.

* :func:`op_costs` costs every top-level instruction of the entry computation and of the
  loop bodies on its own (a one-instruction module with its operands as parameters), so
  XLA reports the bytes it charges to each operand and to the output, and traces each
  operand back to the program's arguments through bitcasts, tuples and loop-carried
  state. :func:`attribute` then splits bytes and FLOPs into KV-cache reads and writes,
  weight reads, materialised copies/converts of the cache or weights, and the rest.
  The per-op sum reproduces :func:`loop_aware_cost` (``HloCostAnalysis`` is additive).

Ops XLA cannot cost: a custom call (cuBLAS/cuDNN GEMMs on GPU, LAPACK on CPU, host
callbacks, Pallas kernels without a cost estimate) is reported by ``HloCostAnalysis`` as
-1 FLOP and -1 byte, which would silently *reduce* a sum. Both functions remove those -1s,
count the custom calls' operand + output bytes separately as a lower bound
(``uncosted_bytes``) and mark the report ``complete=False``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

import jax
from jax._src.lib import _jax  # hlo_module_cost_analysis: XLA's HloCostAnalysis
from jaxlib import _hlo

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")
_CALLEE = re.compile(r"(?:calls|to_apply|body|condition|branch_computations|"
                     r"called_computations|"
                     r"true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_WHILE = re.compile(r"=\s*.*\bwhile\(.*condition=%?([\w.\-]+),\s*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CUSTOM_CALL = re.compile(r"\bcustom-call\(.*custom_call_target=\"([^\"]+)\"")
_STACK_FRAME = re.compile(r",?\s*stack_frame_id=\d+")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*")
_ARRAY = re.compile(r"\b(pred|token|[sufc]\d+|bf16|f8\w*|f4\w*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_CONTROL_DEPS = re.compile(r",\s*control-predecessors=\{[^}]*\}")

# Bytes per element of HLO primitive types (sub-byte types rounded as XLA packs them).
_ELEMENT_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
                  "f8e4m3fn": 1, "f8e5m2": 1, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                  "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}


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

    alias: output bytes that reuse a (donated) argument buffer; temp: scratch the program
    allocates. Returns {} when the backend gives none.
    """
    ma = compiled.memory_analysis()
    if ma is None:
        return {}
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes", "generated_code_size_in_bytes")
    return {k.replace("_size_in_bytes", "_bytes"): int(getattr(ma, k, 0)) for k in keys}


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(element type, dimensions) of each array in an HLO type string."""
    return [(dtype, tuple(int(d) for d in filter(None, dims.split(","))))
            for dtype, dims in _ARRAY.findall(type_text)]


def shape_bytes(type_text: str) -> float:
    """Bytes of an HLO type string, e.g. 'f32[8,64]{1,0}' -> 2048; tuples are summed."""
    total = 0.0
    for dtype, dims in _arrays(type_text):
        if dtype not in _ELEMENT_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {type_text!r}")
        total += math.prod(dims) * _ELEMENT_BYTES[dtype]
    return total


def shape_dims(type_text: str) -> list[tuple[int, ...]]:
    """The dimensions of each array in an HLO type string: 'f32[8,64]{1,0}' ->
    [(8, 64)]; a tuple '(f32[2]{0}, pred[])' -> [(2,), ()]."""
    return [dims for _, dims in _arrays(type_text)]


# --------------------------------------------------------------------------- HLO text


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction parsed from the module text.

    type: its result type ('f32[1,8]{1,0}' or a tuple '(...)'); operands: names of the
    operand instructions in order; attrs: the text after the operand list.
    """

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    operand_text: str
    attrs: str
    line: str
    is_root: bool

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1).replace("\\'", "'") if m else ""

    @property
    def parameter_number(self) -> int | None:
        if self.opcode != "parameter":
            return None
        return int(self.line.split("parameter(", 1)[1].split(")", 1)[0])


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def parse_instruction(line: str) -> Instruction | None:
    """Parses '  [ROOT] %name = TYPE opcode(operands), attrs'; None for other lines."""
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if line[pos] == "(":
        end = _balanced(line, pos)
    else:
        end = line.index(" ", pos)
    type_text = line[pos:end]
    rest = line[end:].lstrip()
    paren = rest.index("(")
    opcode = rest[:paren].strip()
    close = _balanced(rest, paren)
    operand_text = rest[paren + 1:close - 1]
    operands = () if opcode in ("parameter", "constant") else tuple(
        re.findall(r"%([\w.\-]+)", operand_text))
    return Instruction(name=m.group(2), type=type_text, opcode=opcode, operands=operands,
                       operand_text=operand_text, attrs=rest[close:], line=line,
                       is_root=bool(m.group(1)))


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its lines, header first}, the ENTRY computation's name) of a
    module's HLO text ('' when it has none)."""
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


def _callee_names(text: str) -> set[str]:
    out = set()
    for m in _CALLEE.finditer(text):
        out.update(n.strip().lstrip("%") for n in m.group(1).strip("{}").split(","))
    return out


def _callees(lines: list[str]) -> set[str]:
    out = set()
    for line in lines[1:]:
        out |= _callee_names(line)
    return out


def _closure(names, comps: dict[str, list[str]]) -> list[str]:
    seen, stack = [], list(names)
    while stack:
        n = stack.pop()
        if n in seen or n not in comps:
            continue
        seen.append(n)
        stack.extend(_callees(comps[n]))
    return seen


def _computation_text(n: str, comps: dict[str, list[str]], entry: bool) -> str:
    lines = list(comps[n])
    header = lines[0].strip()
    if header.startswith("ENTRY"):
        header = header[len("ENTRY"):].strip()
    if entry:
        header = "ENTRY " + header
    return "\n".join([header] + lines[1:])


def _module_text(name: str, comps: dict[str, list[str]]) -> str:
    parts = ["HloModule sub_" + re.sub(r"[^\w]", "_", name)]
    for n in reversed(_closure([name], comps)):
        parts.append(_computation_text(n, comps, entry=(n == name)))
    return _STACK_FRAME.sub("", "\n\n".join(parts))


def _xla_cost(module_text: str) -> dict:
    module = _hlo.hlo_module_from_text(module_text)
    client = jax.devices("cpu")[0].client
    return dict(_jax.hlo_module_cost_analysis(client, module))


def _custom_calls(lines: list[str]) -> list[Instruction]:
    out = []
    for line in lines:
        if "custom-call(" in line:
            ins = parse_instruction(line)
            if ins is not None and ins.opcode == "custom-call":
                out.append(ins)
    return out


def kernel_flops(target: str, operand_types: list[str], result_type: str) -> float | None:
    """FLOP of one execution of a kvjax native kernel, from its operand and result shapes
    (XLA costs a custom call as -1); None for a target without a formula here (e.g.
    ``kvjax_prefill_attention``, whose causal count depends on positions:
    :func:`kvjax.analysis.theory.prefill_attention_flops`).

    * ``kvjax_rows_matmul``: x [M, K] times a weight into [M, N]: 2·M·K·N.
    * ``kvjax_rows_matmul_norm``: the same after an RMSNorm of x's rows (x², its sum,
      the scaling by 1/rms and by g): 2·M·K·N + 4·M·K.
    * ``kvjax_decode_attention``: q [B, K, G, H] against S slots (``visible`` [B, S]) into
      o [B, K, G, V]: 2·B·K·G·S·(H + V) (the two products; the softmax's exp and sums
      are not counted, as XLA's dot FLOPs do not count them).
    * ``kvjax_paged_decode_attention``: the same over a row's M·P logical slots
      (``visible`` [B, M·P]); its bytes are :func:`kernel_operand_bytes`'.
    """
    try:
        if target in ("kvjax_rows_matmul", "kvjax_rows_matmul_norm"):
            (x,), (y, *_) = shape_dims(operand_types[0]), shape_dims(result_type)
            norm = 4.0 * math.prod(x) if target == "kvjax_rows_matmul_norm" else 0.0
            return 2.0 * math.prod(x) * y[-1] + norm
        if target in ("kvjax_decode_attention", "kvjax_paged_decode_attention"):
            (q,), (vis,) = shape_dims(operand_types[0]), shape_dims(operand_types[3])
            o = shape_dims(result_type)[0]
            return 2.0 * vis[-1] * (math.prod(q) + math.prod(o))
    except (IndexError, ValueError):
        return None
    return None


def kernel_operand_bytes(target: str, operand_types: list[str]) -> tuple[float, ...]:
    """Bytes a custom call reads of each operand: the operand's size, except for
    ``kvjax_paged_decode_attention``, whose page pools (operands 1 and 2, [N, K', P, X]
    with K' = K, or 1 for per-(row, KV head) tables over pools viewed [N·K, 1, P, X])
    are read only at the pages of its block table (operand 4, [R, M]): R·M pages of
    K'·P·X elements each, however many pages the pool holds (an entry of -1 reads
    nothing but is counted: an upper bound). A pool the size of the rows' pages counts
    whole, as before; a read-time page selection (Quest) counts its chosen pages."""
    sizes = tuple(shape_bytes(t) for t in operand_types)
    if not target.startswith("kvjax_paged_decode_attention") or len(operand_types) != 5:
        return sizes
    entries = math.prod(shape_dims(operand_types[4])[0])
    out = list(sizes)
    for i in (1, 2):
        pages = shape_dims(operand_types[i])[0][0]
        out[i] = entries * sizes[i] / pages if pages else 0.0
    return tuple(out)


def _raw_cost(name: str, comps: dict[str, list[str]]) -> tuple[float, float, float, float]:
    """XLA's (FLOP, bytes) of a computation and its callees (nested loop bodies once),
    with each custom call's -1/-1 removed, the custom calls' operand + output bytes
    (lower bound of what they move; XLA does not cost them) and their FLOP where
    :func:`kernel_flops` has a formula."""
    cost = _xla_cost(_module_text(name, comps))
    flops, nbytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    uncosted = uncosted_flops = 0.0
    # Custom calls of this computation and of non-loop callees are inside this module.
    for n in _closure([name], comps):
        types = _instruction_types(comps[n])
        for cc in _custom_calls(comps[n][1:]):
            flops += 1.0  # HloCostAnalysis::HandleCustomCall sets flops = -1
            nbytes += 1.0  # ... and bytes accessed = -1
            ops = [types[o] for o in cc.operands if o in types]
            target = _CUSTOM_CALL.search(cc.line)
            uncosted += shape_bytes(cc.type) + sum(kernel_operand_bytes(
                target.group(1) if target else "", ops))
            kf = kernel_flops(target.group(1), ops, cc.type) if target else None
            uncosted_flops += kf or 0.0
    return flops, nbytes, uncosted, uncosted_flops


def _instruction_types(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines[1:]:
        ins = parse_instruction(line)
        if ins is not None:
            out[ins.name] = ins.type
    return out


# --------------------------------------------------------------------------- loop-aware


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
      raw_flops, raw_bytes: ``cost_analysis()`` as XLA reports it (loop bodies once, each
        custom call as -1).
      flops, bytes: loop-corrected totals of the ops XLA can cost (FLOP, bytes accessed),
        custom calls' -1s removed.
      loops: every while loop found, outermost first.
      complete: False when a loop's trip count is unknown (counted once) or the module has
        custom calls whose cost XLA cannot see (e.g. cuBLAS/cuDNN GEMMs on GPU).
      custom_calls: targets of the custom calls found.
      uncosted_bytes: operand + output bytes of those custom calls (loop-corrected), a
        lower bound of their traffic, not included in ``bytes``.
      uncosted_flops: FLOP of the custom calls :func:`kernel_flops` has a formula for
        (loop-corrected), not included in ``flops``.
    """

    raw_flops: float
    raw_bytes: float
    flops: float
    bytes: float
    loops: tuple[LoopCost, ...]
    complete: bool
    custom_calls: tuple[str, ...] = ()
    uncosted_bytes: float = 0.0
    uncosted_flops: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _trip_count(line: str, body: str, trip_counts: Mapping[str, int],
                default_trip_count: int | None) -> tuple[int, str]:
    t = _TRIP.search(line)
    if t:
        return int(t.group(1)), "xla"
    if body in trip_counts:
        return int(trip_counts[body]), "given"
    if default_trip_count is not None:
        return int(default_trip_count), "given"
    return 1, "unknown"


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
    comps, entry = split_computations(text)
    raw = normalize_cost(compiled.cost_analysis())
    loops: list[LoopCost] = []
    complete = True
    cache: dict[str, tuple[float, float, float, float]] = {}

    def corrected(name: str) -> tuple[float, float, float, float]:
        nonlocal complete
        if name in cache:
            return cache[name]
        flops, nbytes, unc, uncf = _raw_cost(name, comps)
        for line in comps[name][1:]:
            m = _WHILE.search(line)
            if not m:
                continue
            cond, body = m.group(1), m.group(2)
            n, source = _trip_count(line, body, trip_counts, default_trip_count)
            complete &= source != "unknown"
            bf, bb, bu, buf = corrected(body)
            cf, cb, cu, cuf = corrected(cond)
            rbf, rbb, rbu, rbuf = _raw_cost(body, comps)
            rcf, rcb, rcu, rcuf = _raw_cost(cond, comps)
            flops += n * (bf + cf) - (rbf + rcf)
            nbytes += n * (bb + cb) - (rbb + rcb)
            unc += n * (bu + cu) - (rbu + rcu)
            uncf += n * (buf + cuf) - (rbuf + rcuf)
            loops.append(LoopCost(body, n if source != "unknown" else None, source,
                                  bf + cf, bb + cb))
        cache[name] = (flops, nbytes, unc, uncf)
        return cache[name]

    flops, nbytes, uncosted, uncosted_flops = corrected(entry)
    custom = tuple(sorted({m.group(1) for m in _CUSTOM_CALL.finditer(text)}))
    if custom:
        complete = False
    return CostReport(raw_flops=float(raw.get("flops", -1.0)),
                      raw_bytes=float(raw.get("bytes accessed", -1.0)),
                      flops=flops, bytes=nbytes, loops=tuple(reversed(loops)),
                      complete=complete, custom_calls=custom, uncosted_bytes=uncosted,
                      uncosted_flops=uncosted_flops)


# --------------------------------------------------------------------------- per op

# Value classes: where an operand's bytes come from.
KV = "kv"                  # a KV-cache argument buffer, as passed in
KV_NEW = "kv_new"          # the cache after this program's update of it (the result)
WEIGHTS = "weights"        # a parameter (weights) argument buffer
KV_COPY = "kv_copy"        # a materialised copy / transpose / convert of the cache
# select(seen, cache, 0): the cache with its never-written slots cleared
# (model.clear_masked_slots). Read where it is made, it counts as before ('other'); carried
# into a while loop (the generate loops clear once on entry) it is the cache again (KV).
KV_CLEARED = "kv_cleared"
WEIGHTS_COPY = "weights_copy"  # ... of the weights
OTHER = "other"            # activations, logits, token ids, bookkeeping

_DERIVED = {KV: KV_COPY, KV_NEW: KV_COPY, KV_COPY: KV_COPY, WEIGHTS: WEIGHTS_COPY,
            WEIGHTS_COPY: WEIGHTS_COPY}
# Ops that only move or re-type data: a fusion of nothing else is a copy of its input.
_MOVE_OPS = {"parameter", "bitcast", "copy", "transpose", "convert", "reshape",
             "broadcast", "slice", "dynamic-slice", "concatenate", "pad", "constant",
             "reverse", "bitcast-convert", "iota", "copy-start", "copy-done", "tuple",
             "get-tuple-element"}
_VIEW_OPS = {"bitcast"}
_UPDATE_OPS = {"dynamic-update-slice", "scatter"}
_FREE_OPS = {"parameter", "while", "call"}


class Tagged(str):
    """A value class (equal to and hashing as the plain class string, e.g. KV) that also
    names the cache tensor it comes from (``tensor``: 'k', 'v', 'k_scale', ...), so the
    attribution can split KV bytes by cache tensor."""

    tensor: str

    def __new__(cls, value: str, tensor: str):
        obj = super().__new__(cls, value)
        obj.tensor = tensor
        return obj


_CACHE_TENSOR = re.compile(r"cache\.tensors\[\\?['\"]([^'\"\\]+)\\?['\"]\]")


def tensor_of(value) -> str | None:
    """The cache tensor name a value class carries (:class:`Tagged`), else None."""
    return getattr(value, "tensor", None)


def default_classify(arg_path: str) -> str:
    """Class of an entry parameter from its argument path (JAX puts the pytree path of
    each argument in the parameter's op_name: "cache.tensors['k'][0]", "params[...]").

    'cache.tensors...' -> KV (a :class:`Tagged` KV naming the cache tensor, e.g.
    'k_scale', when the path names one); 'params...' -> WEIGHTS; anything else (token
    ids, the cache's positions and length, RNG state) -> OTHER.
    """
    if arg_path.startswith("cache.tensors"):
        m = _CACHE_TENSOR.match(arg_path)
        return Tagged(KV, m.group(1)) if m else KV
    if arg_path.startswith("params"):
        return WEIGHTS
    return OTHER


@dataclasses.dataclass(frozen=True)
class OpCost:
    """XLA's cost of one top-level instruction, per execution.

    Attributes:
      computation, name, opcode: where it is; op_name: its metadata (JAX name stack).
      count: executions per program run (product of enclosing loop trip counts).
      flops, bytes: XLA's figures for one execution (0 when not ``costed``).
      operand_bytes: bytes XLA charges to each operand (slices read only the slice;
        an in-place dynamic-update-slice charges the update only).
      output_bytes: bytes XLA charges to the output.
      operand_classes, output_class: value classes (KV, WEIGHTS, KV_COPY, ...).
      costed: False for custom calls, which XLA reports as -1 (and for an instruction
        XLA would not parse on its own); their operand and output sizes are then given
        as a lower bound. reason: why not costed ('' when costed).
    """

    computation: str
    name: str
    opcode: str
    op_name: str
    count: int
    flops: float
    bytes: float
    operand_bytes: tuple[float, ...]
    output_bytes: float
    operand_classes: tuple[str, ...]
    output_class: str
    costed: bool = True
    reason: str = ""


def _class_of(value, index: int | None = None) -> str:
    """A value's class; tuple-shaped values carry a tuple of classes."""
    if isinstance(value, tuple):
        if index is not None and index < len(value):
            return _class_of(value[index])
        return _dominant(list(value))
    return value


def _dominant(classes: list) -> str:
    flat = [_class_of(c) for c in classes]
    for c in (KV_NEW, KV, KV_COPY, WEIGHTS, WEIGHTS_COPY):
        if c in flat:
            return c
    return OTHER


def _fused_kind(fused: list[Instruction], operand_classes: list) -> Any:
    """Output class of a fusion from its fused computation: an update of a KV buffer is
    KV_NEW; a data-movement-only fusion yields a copy of its input's class."""
    by_name = {i.name: i for i in fused}
    root = next((i for i in fused if i.is_root), fused[-1])

    # On the update path, converts and copies count as views: XLA:CPU turns a bf16
    # dynamic-update-slice into convert(DUS(convert(cache), update)), a full read and
    # write of the cache that is still the cache's update (charged to kv_write).
    through = _VIEW_OPS | {"convert", "copy"}

    def source_param(ins: Instruction) -> int | None:
        while ins.opcode in through and ins.operands:
            ins = by_name[ins.operands[0]]
        return ins.parameter_number

    def constant(ins: Instruction) -> bool:
        while ins.opcode in through | {"broadcast"} and ins.operands:
            ins = by_name[ins.operands[0]]
        return ins.opcode == "constant"

    def kind_of(ins: Instruction):
        while ins.opcode in through and ins.operands:
            ins = by_name[ins.operands[0]]
        if ins.opcode == "select" and len(ins.operands) == 3 and constant(
                by_name[ins.operands[2]]):
            # select(seen, cache, 0): the cache with its never-written slots cleared
            p = source_param(by_name[ins.operands[1]])
            if p is not None and _class_of(operand_classes[p]) in (KV, KV_NEW):
                name = tensor_of(_class_of(operand_classes[p]))
                return Tagged(KV_CLEARED, name) if name else KV_CLEARED
        if ins.opcode in _UPDATE_OPS:
            p = source_param(by_name[ins.operands[0]])
            if p is not None and _class_of(operand_classes[p]) in (KV, KV_NEW):
                return _kv_new(operand_classes[p])
        return None

    if root.opcode == "tuple":
        elems = [kind_of(by_name[o]) for o in root.operands]
        if any(e is not None for e in elems):
            return tuple(e or OTHER for e in elems)
    else:
        k = kind_of(root)
        if k is not None:
            return k
    if all(i.opcode in _MOVE_OPS for i in fused):
        return _DERIVED.get(_dominant(operand_classes), OTHER)
    return OTHER


def op_costs(compiled, trip_counts: Mapping[str, int] | None = None,
             default_trip_count: int | None = None,
             classify: Callable[[str], str] = default_classify) -> list[OpCost]:
    """XLA's cost of every top-level instruction of the program, loop-aware.

    Each instruction of the entry computation and of every while body/condition (and
    ``call`` target) reachable from it is costed as a one-instruction module, so the
    figures are ``HloCostAnalysis``'s own, per operand. Loop bodies are visited with
    ``count`` multiplied by their trip count (see :func:`loop_aware_cost` for
    ``trip_counts`` and ``default_trip_count``; unknown counts count once).

    Args:
      compiled: a ``jax.stages.Compiled`` or the optimised HLO text.
      classify: entry-parameter argument path (its op_name) -> value class.
    Returns:
      One OpCost per executed instruction (parameters and loops themselves excluded).
    """
    trip_counts = dict(trip_counts or {})
    text = compiled if isinstance(compiled, str) else compiled.as_text()
    comps, entry = split_computations(text)
    parsed = {n: [i for i in map(parse_instruction, lines[1:]) if i is not None]
              for n, lines in comps.items()}
    comp_text = {n: _computation_text(n, comps, entry=False) for n in comps}
    out: list[OpCost] = []

    def visit(comp: str, param_classes: list, count: int) -> Any:
        types: dict[str, str] = {}
        cls: dict[str, Any] = {}
        root_class: Any = OTHER
        for ins in parsed[comp]:
            types[ins.name] = ins.type
            ops_cls = [cls.get(o, OTHER) for o in ins.operands]
            if ins.opcode == "parameter":
                p = ins.parameter_number
                if comp == entry:
                    c = classify(ins.op_name)
                else:
                    c = param_classes[p] if p < len(param_classes) else OTHER
            elif ins.opcode == "get-tuple-element":
                idx = int(re.search(r"index=(\d+)", ins.attrs).group(1))
                v = ops_cls[0]
                c = v[idx] if isinstance(v, tuple) and idx < len(v) else _class_of(v)
            elif ins.opcode == "tuple":
                c = tuple(ops_cls)
            elif ins.opcode in _VIEW_OPS:
                c = ops_cls[0]
            elif ins.opcode == "while":
                m = _WHILE.search(ins.line)
                cond, body = m.group(1), m.group(2)
                n, _ = _trip_count(ins.line, body, trip_counts, default_trip_count)
                init = _uncleared(ops_cls[0] if ops_cls else OTHER)
                visit(body, [init], count * n)
                visit(cond, [init], count * n)  # as loop_aware_cost: n x (body + cond)
                c = init
            elif ins.opcode == "call":
                callee = ins.attrs.split("to_apply=", 1)[1].split(",")[0].strip().lstrip("%")
                c = visit(callee, ops_cls, count)
            else:
                c = _output_class(ins, ops_cls, parsed)
            cls[ins.name] = c
            if ins.is_root:
                root_class = c
            if ins.opcode not in _FREE_OPS:
                out.append(_cost_one(comp, ins, types, ops_cls, c, count, comps,
                                     comp_text))
        return root_class

    visit(entry, [], 1)
    return out


def _uncleared(c):
    """``c`` with every KV_CLEARED (a cleared cache carried into a loop) read as KV."""
    if isinstance(c, tuple):
        return tuple(_uncleared(x) for x in c)
    if _class_of(c) == KV_CLEARED:
        name = tensor_of(c)
        return Tagged(KV, name) if name else KV
    return c


def _kv_new(source) -> str:
    """KV_NEW, tagged with the cache tensor of ``source`` (the updated buffer's class)."""
    name = tensor_of(_class_of(source))
    return Tagged(KV_NEW, name) if name else KV_NEW


def _output_class(ins: Instruction, ops_cls: list, parsed) -> Any:
    if ins.opcode in _UPDATE_OPS:
        return _kv_new(ops_cls[0]) if ops_cls and _class_of(ops_cls[0]) in (KV, KV_NEW) \
            else OTHER
    if ins.opcode == "fusion":
        callee = ins.attrs.split("calls=", 1)[1].split(",")[0].strip().lstrip("%")
        return _fused_kind(parsed[callee], ops_cls)
    if ins.opcode in _MOVE_OPS:
        return _DERIVED.get(_dominant(ops_cls), OTHER)
    return OTHER


def _cost_one(comp: str, ins: Instruction, types: dict[str, str], ops_cls: list,
              out_cls: Any, count: int, comps, comp_text) -> OpCost:
    distinct = list(dict.fromkeys(ins.operands))
    pname = {o: f"p{i}" for i, o in enumerate(distinct)}
    params = [f"  %{pname[o]} = {types[o]} parameter({i})" for i, o in enumerate(distinct)]
    header_params = ", ".join(f"{pname[o]}: {types[o]}" for o in distinct)
    attrs = _CONTROL_DEPS.sub("", ins.attrs)
    operand_list = ", ".join("%" + pname[o] for o in ins.operands)
    if ins.opcode == "constant":
        operand_list = ins.operand_text
    body = (f"  ROOT %{ins.name} = {ins.type} {ins.opcode}({operand_list}){attrs}")
    callees = _closure(_callee_names(attrs), comps)
    parts = ["HloModule op"] + [comp_text[n] for n in reversed(callees)]
    parts.append("\n".join([f"ENTRY %op_entry ({header_params}) -> {ins.type} {{"]
                           + params + [body, "}"]))
    op_cls = tuple(_class_of(c) for c in ops_cls)
    # A tuple's output is a table of pointers to its operands' buffers, not their data.
    out_c = OTHER if ins.opcode == "tuple" else _class_of(out_cls)
    reason = "custom call" if ins.opcode == "custom-call" else ""
    if not reason:
        try:
            cost = _xla_cost(_STACK_FRAME.sub("", "\n\n".join(parts)))
        except Exception as e:  # noqa: BLE001 (XLA's parser raises assorted errors)
            reason = f"not costable alone: {type(e).__name__}"
    if reason:
        # XLA cannot see inside: report the operand and output sizes (a kernel's own
        # reads where known, kernel_operand_bytes), uncosted.
        target = _CUSTOM_CALL.search(ins.line)
        ob = kernel_operand_bytes(target.group(1) if target else "",
                                  [types[o] for o in ins.operands])
        return OpCost(comp, ins.name, ins.opcode, ins.op_name, count, 0.0, 0.0, ob,
                      shape_bytes(ins.type), op_cls, out_c, costed=False, reason=reason)
    ob = tuple(float(cost.get(f"bytes accessed{distinct.index(o)}{{}}", 0.0))
               for o in ins.operands)
    # A repeated operand is one parameter: charge its bytes once.
    seen = set()
    ob = tuple(0.0 if (o in seen or seen.add(o)) else b for o, b in zip(ins.operands, ob))
    return OpCost(comp, ins.name, ins.opcode, ins.op_name, count,
                  float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                  ob, float(cost.get("bytes accessedout{}", 0.0)), op_cls, out_c)


# --------------------------------------------------------------------------- attribution

BYTE_PARTS = ("kv_read", "kv_write", "weights", "kv_copies", "weight_copies", "other")
FLOP_PARTS = ("kv", "weights", "other")


@dataclasses.dataclass(frozen=True)
class Attribution:
    """Compiled bytes and FLOPs of a program split by what they touch (loop-corrected).

    bytes: kv_read (cache buffers read); kv_write (updates of the cache buffers: the new
      entries when updated in place, the whole cache when XLA rewrites it, as for bf16
      on CPU); weights (parameter buffers read); kv_copies / weight_copies (materialised
      copies, transposes or dtype converts of the cache / weights: written and read
      back); other (activations, logits, bookkeeping).
    flops: kv (ops reading the cache or its copies: attention), weights (ops reading
      weights: projections, MLP, LM head), other.
    total_bytes, total_flops: sums of the costed ops (equal :func:`loop_aware_cost`).
    uncosted_bytes, num_uncosted_ops: operand + output bytes and executions of the ops
      XLA cannot cost (custom calls), not included in the parts; ``uncosted`` splits
      those bytes into the same parts.
    top: the largest ops by bytes x count: name, opcode, op_name, bytes, FLOP, parts.
    kv_tensors: cache tensor name ('k', 'v', 'k_scale', 'v_scale'; MLA 'c_kv', 'k_rope',
      ...) -> {'read': bytes, 'write': bytes}: kv_read and kv_write split by the cache
      tensor each byte touches (costed ops; the names come from the argument paths, so a
      quantized cache's scale tensors are KV bytes of their own rows). Their sums equal
      ``bytes['kv_read']`` and ``bytes['kv_write']`` when every cache argument is named.
    """

    bytes: dict
    flops: dict
    total_bytes: float
    total_flops: float
    uncosted_bytes: float
    num_uncosted_ops: int
    top: tuple
    uncosted: dict = dataclasses.field(default_factory=dict)
    kv_tensors: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Reading the updated cache back (XLA copying it into the output buffer) is a copy.
_READ_PART = {KV: "kv_read", KV_NEW: "kv_copies", WEIGHTS: "weights", KV_COPY: "kv_copies",
              WEIGHTS_COPY: "weight_copies", OTHER: "other", KV_CLEARED: "other"}
_WRITE_PART = {KV_NEW: "kv_write", KV_COPY: "kv_copies", WEIGHTS_COPY: "weight_copies"}


def _split_bytes(op: OpCost, total: float) -> dict:
    split = dict.fromkeys(BYTE_PARTS, 0.0)
    for c, nb in zip(op.operand_classes, op.operand_bytes):
        update = c in (KV, KV_NEW) and op.output_class == KV_NEW
        split["kv_write" if update else _READ_PART[c]] += nb
    split[_WRITE_PART.get(op.output_class, "other")] += op.output_bytes
    split["other"] += total - sum(op.operand_bytes) - op.output_bytes
    return split


def _tensor_split(op: OpCost) -> dict:
    """Cache tensor name -> {'read', 'write'} bytes of one execution of ``op``, split as
    :func:`_split_bytes` splits kv_read and kv_write."""
    out: dict = {}

    def add(name, key, nb):
        if name and nb:
            d = out.setdefault(name, {"read": 0.0, "write": 0.0})
            d[key] += nb

    for c, nb in zip(op.operand_classes, op.operand_bytes):
        update = c in (KV, KV_NEW) and op.output_class == KV_NEW
        if update:
            add(tensor_of(c), "write", nb)
        elif c == KV:
            add(tensor_of(c), "read", nb)
    if op.output_class == KV_NEW:
        add(tensor_of(op.output_class), "write", op.output_bytes)
    return out


def attribute(ops: list[OpCost], top: int = 12) -> Attribution:
    """Splits per-op costs (:func:`op_costs`) into the :class:`Attribution` parts.

    Operand bytes go to the part of the operand's class (the cache operand of an update
    counts as a write; reading the updated cache back, as when XLA copies it into the
    output buffer, as a copy); output bytes go to kv_write for cache updates, to
    kv_copies / weight_copies for copies, else to other. Whatever XLA charges an op
    beyond its operands and output (rare) goes to other. Uncosted ops (custom calls:
    cuBLAS GEMMs on GPU) are split the same way from their operand and output sizes
    into ``uncosted``, apart from the costed parts.
    """
    b = dict.fromkeys(BYTE_PARTS, 0.0)
    ub = dict.fromkeys(BYTE_PARTS, 0.0)
    f = dict.fromkeys(FLOP_PARTS, 0.0)
    total_b = total_f = 0.0
    n_uncosted = 0
    rows = []
    kv_t: dict = {}
    for op in ops:
        if not op.costed:
            n_uncosted += op.count
            lower_bound = sum(op.operand_bytes) + op.output_bytes
            for k, v in _split_bytes(op, lower_bound).items():
                ub[k] += op.count * v
            continue
        split = _split_bytes(op, op.bytes)
        for k, v in split.items():
            b[k] += op.count * v
        for name, rw in _tensor_split(op).items():
            d = kv_t.setdefault(name, {"read": 0.0, "write": 0.0})
            for k, v in rw.items():
                d[k] += op.count * v
        cls = set(op.operand_classes)
        fpart = "kv" if cls & {KV, KV_NEW, KV_COPY} else "weights" if cls & {
            WEIGHTS, WEIGHTS_COPY} else "other"
        f[fpart] += op.count * op.flops
        total_b += op.count * op.bytes
        total_f += op.count * op.flops
        rows.append((op.count * op.bytes, op, split))
    rows.sort(key=lambda r: -r[0])
    top_rows = tuple(
        {"name": op.name, "opcode": op.opcode, "op_name": op.op_name, "count": op.count,
         "bytes": nb, "flops": op.count * op.flops,
         "parts": {k: op.count * v for k, v in split.items() if v}}
        for nb, op, split in rows[:top])
    return Attribution(bytes=b, flops=f, total_bytes=total_b, total_flops=total_f,
                       uncosted_bytes=sum(ub.values()), num_uncosted_ops=n_uncosted,
                       top=top_rows, uncosted=ub, kv_tensors=kv_t)
