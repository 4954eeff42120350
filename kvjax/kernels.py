"""Every formulation kvjax can run, registered once: the kernel registry.

A *formulation* is one way to compute one operation of the model: the decode step's
attention over the cache (``model.decode_attention``), a product of a few activation rows
with a weight (``model.weight_matmul``) and the prompt's attention (``model.prefill_impl``).
Each is registered here with what it applies to, where it is implemented and how the cost
report counts its FLOP and bytes, and the names here are the only list: the config's
validation (:mod:`kvjax.config`), the formulation modules
(:data:`kvjax.models.decode_kernels.IMPLS`, :data:`kvjax.models.weight_matmul.IMPLS`), the
planner's candidates, the benchmarks' flags and the table in docs/DESIGN.md
(:func:`markdown_table`, checked by a test) all read them.

``'auto'`` is not a formulation: it asks the config's plan (:mod:`kvjax.plan`, built by
:func:`kvjax.planner.resolve` before tracing) for the one measured fastest here.

Counting (:mod:`kvjax.analysis.hlo_cost`):

* ``'xla'``: XLA ops, counted by XLA's own cost analysis.
* ``'custom call'``: an XLA FFI custom call (``target``), which XLA costs as -1; the cost
  hook removes that, adds its operand and output bytes (what it moves at least) and its
  FLOP from the target's formula (``hlo_cost.kernel_flops``) where one exists, and the
  report shows them as "+kernels" beside XLA's figure.
* ``'pallas'``: a Pallas kernel (Triton on GPU): a custom call on GPU, XLA ops in
  interpret mode.

This module imports nothing from kvjax, so every layer may read it.
"""

from __future__ import annotations

import dataclasses

OPS = ("decode_attention", "weight_matmul", "prefill_attention")
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Formulation:
    """One registered formulation.

    Attributes:
      op: one of :data:`OPS`.
      name: the value of the config field that selects it.
      backends: where it runs ('cpu', 'gpu'; XLA formulations run everywhere).
      applies: what it applies to, in one line (dtypes, layouts, cache kinds, sizes).
      implementation: the function that computes it.
      counted: how the cost report counts it: 'xla', 'custom call' or 'pallas' (module
        docstring).
      target: the custom-call target name, or None.
      paged_target: the target of its variant over a paged cache (page pools and a block
        table, :mod:`kvjax.cache.paged`), or None.
    """

    op: str
    name: str
    backends: tuple
    applies: str
    implementation: str
    counted: str = "xla"
    target: str | None = None
    paged_target: str | None = None


REGISTRY = (
    Formulation("decode_attention", "xla", ("cpu", "gpu"),
                "every cache: einsums with the queries as the left operand (the reference)",
                "kvjax.models.attention.attend_step"),
    Formulation("decode_attention", "xla_cache_left", ("cpu", "gpu"),
                "every cache: einsums with the cache as the left operand",
                "kvjax.models.decode_kernels.partial_attention"),
    Formulation("decode_attention", "native", ("cpu",),
                "float32 caches, either layout: one pass over each block of 64 slots for "
                "all G heads of a group, masked slots skipped (visible runs 64 or more "
                "masked slots apart are read alone: a window over dense rows reads the "
                "window); paged caches read in place",
                "kvjax/native/decode_attention.cc", "custom call",
                "kvjax_decode_attention", "kvjax_paged_decode_attention"),
    Formulation("decode_attention", "pallas", ("gpu",),
                "dense 'BKSH' caches (visible slots a prefix), head_dim a power of two "
                ">= 16; paged float caches read in place (the paged-attention kernel's "
                "body over kvjax's pools)",
                "jax.experimental.pallas.ops.gpu.decode_attention, .paged_attention",
                "pallas"),
    Formulation("weight_matmul", "xla", ("cpu", "gpu"), "every product: jnp.einsum",
                "kvjax.models.weight_matmul.einsum"),
    Formulation("weight_matmul", "native", ("cpu",),
                "float32, M <= 256 rows: each weight streamed once for all rows, split "
                "by output columns", "kvjax/native/rows_matmul.cc", "custom call",
                "kvjax_rows_matmul"),
    Formulation("weight_matmul", "native_ksplit", ("cpu",),
                "as 'native'; several rows against a [K, N] weight split by its K rows",
                "kvjax/native/rows_matmul.cc", "custom call", "kvjax_rows_matmul"),
    Formulation("weight_matmul", "native_lanes", ("cpu",),
                "as 'native'; several rows against an [N, K] weight (the tied LM head) "
                "in the vector lanes", "kvjax/native/rows_matmul.cc", "custom call",
                "kvjax_rows_matmul"),
    Formulation("prefill_attention", "tiled", ("cpu", "gpu"),
                "every variant: online softmax over key blocks, causal tiles skipped",
                "kvjax.models.flash.attend_chunk"),
    Formulation("prefill_attention", "dense", ("cpu", "gpu"),
                "every variant: the full [T, S] scores (and sinks at cache positions)",
                "kvjax.models.attention.attend"),
    Formulation("prefill_attention", "native", ("cpu",),
                "MHA/GQA/MQA, float32: blocked causal attention per row and KV head",
                "kvjax/native/prefill_attention.cc", "custom call",
                "kvjax_prefill_attention"),
    Formulation("prefill_attention", "cudnn", ("gpu",),
                "MHA/GQA/MQA into an empty cache (later chunks run 'tiled'), no sinks",
                "kvjax.models.flash.attend_chunk_sdpa", "custom call"),
)


def formulations(op: str) -> tuple:
    """The :class:`Formulation` s of ``op``, in registration order.

    Raises:
      ValueError: an op not in :data:`OPS`.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}; allowed: one of {list(OPS)}")
    return tuple(f for f in REGISTRY if f.op == op)


def names(op: str, auto: bool = True) -> tuple:
    """The names of ``op``'s formulations, with :data:`AUTO` first when ``auto``."""
    return ((AUTO,) if auto else ()) + tuple(f.name for f in formulations(op))


def get(op: str, name: str) -> Formulation:
    """The formulation ``name`` of ``op``.

    Raises:
      ValueError: an unknown name, naming the allowed ones.
    """
    for f in formulations(op):
        if f.name == name:
            return f
    raise ValueError(f"{op}={name!r}; allowed: one of {list(names(op, auto=False))}")


def custom_call_targets() -> tuple:
    """The custom-call targets of kvjax's own kernels (sorted, unique)."""
    return tuple(sorted({t for f in REGISTRY for t in (f.target, f.paged_target) if t}))


def markdown_table() -> str:
    """The registry as the markdown table docs/DESIGN.md holds."""
    rows = ["| op | formulation | backends | applies to | counted | implementation |",
            "|---|---|---|---|---|---|"]
    for f in REGISTRY:
        targets = ", ".join(f"`{t}`" for t in (f.target, f.paged_target) if t)
        counted = f.counted + (f" ({targets})" if targets else "")
        rows.append(f"| {f.op} | `{f.name}` | {', '.join(f.backends)} | {f.applies} | "
                    f"{counted} | `{f.implementation}` |")
    return "\n".join(rows)
