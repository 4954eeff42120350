"""Every choice that depends on the backend (CPU, GPU, TPU), in one place.

A :class:`kvjax.config.ModelConfig` records the backend it is built for (``backend``,
default: the JAX backend of the process, resolved once when the config is built), and
every backend-dependent decision reads that field through the functions here, never
``jax.default_backend()`` at trace time. So a config built with ``backend='gpu'`` on a
laptop compiles and costs the program a GPU run would use (its layouts and layer stack),
and the CPU's choices never leak into it.

The choices rest on measurements, each recorded in docs/decisions/ (with its evidence in
docs/results/); re-measure on yours (``python scripts/layout_bench.py`` for the layouts):

* :func:`scan_layers`: scanned layer stack or unrolled;
* :func:`kv_layout`: the memory layout of cached keys and values;
* :func:`widen_dot_operands`: 2-byte float dot operands widened to float32;
* :func:`analysis_compiler_options`: XLA options for programs compiled only to be costed.
"""

from __future__ import annotations

BACKENDS = ("cpu", "gpu", "tpu")


def current() -> str:
    """The process's JAX backend as one of :data:`BACKENDS` ('cuda'/'rocm' -> 'gpu')."""
    import jax  # noqa: PLC0415 (keeps this module importable without initialising JAX)
    name = jax.default_backend()
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def check(backend: str) -> str:
    """Returns ``backend`` or raises ValueError naming it and the allowed values."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; allowed: one of {list(BACKENDS)}")
    return backend


def scan_layers(backend: str) -> bool:
    """Default layer stack: unrolled on CPU, one ``scan`` on accelerators.

    On CPU, XLA copies each layer's slice of stacked parameters and caches out of the
    scan's buffers before its dots (several times the theory bytes against about 1x
    unrolled; docs/decisions/0002-unrolled-layer-stack-on-cpu.md). On accelerators the
    scan keeps compile time independent of L.
    """
    return check(backend) != "cpu"


def kv_layout(backend: str, name: str, num_groups: int) -> str:
    """'auto' cache layouts resolve here (``name`` 'k' or 'v', G = num_groups).

    On CPU, XLA lowers the decode step's two products to Eigen/YNNPACK kernels whose
    speed depends on which operand is contiguous (``python scripts/layout_bench.py``;
    docs/decisions/0003-cpu-cache-layouts.md): q·K^T read keys [H, S] faster than
    [S, H] for every G, and p·V read values [H, S] faster for G = 1 but far slower for
    G >= 2. So keys
    'BKHS' always and values 'BKHS' only when G = 1. Other backends get the
    conventional 'BKSH' (not measured here).
    """
    if check(backend) != "cpu":
        return "BKSH"
    if name == "k" or num_groups == 1:
        return "BKHS"
    return "BKSH"


def widen_dot_operands(backend: str) -> bool:
    """Whether 2-byte float dot operands are widened to float32 before the dot.

    XLA:CPU rejects some batched bf16 x bf16 -> f32 dots ("Unsupported element type for
    DotThunk::Execute", jaxlib 0.10.2, e.g. a prefill with B = 2, K = 2) and widens the
    operands itself for the others, so widening first changes neither bytes nor results
    there. Accelerators multiply 2-byte floats natively.
    """
    return check(backend) == "cpu"


def analysis_compiler_options(backend: str) -> dict | None:
    """XLA options for programs compiled only to be analysed, never run.

    On CPU, ``xla_backend_optimization_level=0`` skips LLVM's optimisation of the machine
    code; the optimised HLO, and so every cost and memory figure read from it, is
    identical (checked in tests/test_costs_sweep.py), and compiling takes less time
    (docs/decisions/0026-analysis-compiles-unoptimised.md). Elsewhere: None (the
    backend's defaults).
    """
    return {"xla_backend_optimization_level": 0} if check(backend) == "cpu" else None
