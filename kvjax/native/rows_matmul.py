"""The native few-row weight product (``rows_matmul.cc``) behind ``jax.ffi``.

:func:`load` builds ``rows_matmul.cc`` with the same compiler, flags and cache directory
as the decode-attention kernel (:mod:`kvjax.native`: ``g++ -O3 -march=native``, under
``$KVJAX_CACHE/native/<hash>``), loads it and registers the XLA FFI target
:data:`TARGET` on CPU. Without a compiler, or if the build fails, it warns once and
returns False; :func:`rows_matmul` callers then use ``jnp.dot`` (the pure-XLA path).
``KVJAX_NATIVE=0`` skips it, as for the other native kernel.
"""

from __future__ import annotations

import functools
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import native

TARGET = "kvjax_rows_matmul"
TARGET_INT8 = "kvjax_rows_matmul_int8"  # the same library: int8 weights, float32 rows
TARGET_NORM = "kvjax_rows_matmul_norm"  # the same library: RMSNorm(x) times the weight
SOURCE = pathlib.Path(__file__).with_name("rows_matmul.cc")
MAX_ROWS = 256  # rows above which XLA's GEMM is used (the kernel targets decode's few rows)
_lock = threading.Lock()
_state: dict = {}


def library_path() -> pathlib.Path | None:
    """The built library (built if missing), or None without a compiler."""
    return native.build_library(SOURCE, "kvjax_rows_matmul")


def _smoke() -> None:
    """One product of each layout, [2, 8] x [8, 16] in float32 and [2, 32] x [32, 16] in
    int8, against numpy."""
    x = np.arange(16, dtype=np.float32).reshape(2, 8) / 16
    w = np.arange(128, dtype=np.float32).reshape(8, 16) / 128 - 0.5
    native.check_close("rows_matmul's smoke call (kn)",
                       _call(jnp.asarray(x), jnp.asarray(w), "kn", "columns", False), x @ w)
    native.check_close("rows_matmul's smoke call (nk)",
                       _call(jnp.asarray(x), jnp.asarray(w.T.copy()), "nk", "columns", False),
                       x @ w)
    # int8: K = 32, so the [N, K] form's vector loop runs (VW <= 16); the sums are exact
    x8 = np.arange(64, dtype=np.float32).reshape(2, 32) / 64
    q = (np.arange(512).reshape(32, 16) % 255 - 127).astype(np.int8)
    want8 = x8.astype(np.float64) @ q.astype(np.float64)
    native.check_close("rows_matmul's int8 smoke call (kn)",
                       _call_int8(jnp.asarray(x8), jnp.asarray(q), "kn"), want8, tol=1e-4)
    native.check_close("rows_matmul's int8 smoke call (nk)",
                       _call_int8(jnp.asarray(x8), jnp.asarray(q.T.copy()), "nk"), want8,
                       tol=1e-4)
    g = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * g
    native.check_close("rows_matmul's normed smoke call (kn)",
                       _call(jnp.asarray(x), jnp.asarray(w), "kn", "columns", False,
                             (jnp.asarray(g), 1e-5)), xn @ w)


def load() -> bool:
    """Builds (once per machine), loads and registers :data:`TARGET`, and runs one small
    product of each layout (:func:`kvjax.native.register`'s smoke call). True when
    available; False with one warning naming the cause otherwise."""
    return native.register(_state, _lock, library_path, TARGET, "KvjaxRowsMatmul",
                           "kvjax rows_matmul", "weight products use XLA", smoke=_smoke,
                           more=((TARGET_INT8, "KvjaxRowsMatmulInt8"),
                                 (TARGET_NORM, "KvjaxRowsMatmulNorm")))


SPLITS = ("columns", "k")


def rows_matmul(x: jax.Array, w: jax.Array, w_layout: str = "kn",
                split: str = "columns", lanes: bool = False,
                norm: tuple[jax.Array, float] | None = None) -> jax.Array:
    """``x @ w`` (``w_layout='kn'``, w [K, N]) or ``x @ w.T`` (``'nk'``, w [N, K]) by the
    native kernel: the weight streamed once for all M rows.

    Args:
      x: [M, K] float32 (M rows, e.g. the batch of a decode step).
      w: [K, N] or [N, K] float32.
      w_layout: 'kn' or 'nk'.
      split: how several rows are split over the threads: 'columns' (contiguous ranges
        of output columns; 'nk' always splits its output rows) or 'k' (w 'kn' only:
        contiguous ranges of the weight's K rows, partial rows added at the end, as one
        row against a 'kn' weight always is). Which is faster depends on the machine
        (:mod:`kvjax.models.weight_matmul`); the result is the same up to float
        rounding.
      lanes: w 'nk' only (one row runs as without): the rows of x in the vector
        lanes, each weight element broadcast once (no sums across lanes), instead of
        register tiles of dot products; which is faster depends on the machine.
      norm: (g [K] float32, eps): each row of x is first RMS-normalised inside the
        kernel, x / sqrt(mean(x^2) + eps) · g (Zhang & Sennrich 2019; the function of
        :class:`kvjax.models.layers.RMSNorm`), so the norm costs no XLA fusions of its
        own (target :data:`TARGET_NORM`); None: x as it is.
    Returns:
      [M, N] float32 (sums in a different order from XLA's: equal to ~1e-6 relative).
    Raises:
      ValueError: a non-float32 operand, ranks other than 2, mismatched K, a bad
        w_layout or split, split='k' / lanes=True with the other layout, or a norm
        scale that is not a float32 [K] vector, naming the value.
      RuntimeError: the library could not be built or loaded (see the warning).
    """
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"w_layout={w_layout!r}; allowed: 'kn' (w [K, N]) or 'nk' (w [N, K])")
    if split not in SPLITS:
        raise ValueError(f"split={split!r}; allowed: one of {list(SPLITS)}")
    if split == "k" and w_layout != "kn":
        raise ValueError("split='k' with w_layout='nk'; allowed: split='k' for a 'kn' "
                         "weight ('nk' splits its output rows)")
    if lanes and w_layout != "nk":
        raise ValueError("lanes=True with w_layout='kn'; allowed: lanes=True for an 'nk' "
                         "weight")
    _check_operands("rows_matmul", x, ("w", w, jnp.float32), w_layout,
                    "; use model.weight_matmul='xla'")
    if norm is None:
        return _product(x, w, w_layout, split, bool(lanes))
    g, eps = norm
    if g.shape != (x.shape[1],) or g.dtype != jnp.float32:
        raise ValueError(f"rows_matmul: norm scale is {g.dtype}{list(g.shape)}; allowed: "
                         f"float32[{x.shape[1]}] (x's K)")
    return _normed_product(x, g, w, w_layout, split, bool(lanes), float(eps))


def rows_matmul_int8(x: jax.Array, q: jax.Array, w_layout: str = "kn") -> jax.Array:
    """``x @ q`` (``w_layout='kn'``, q [K, N]) or ``x @ q.T`` (``'nk'``, q [N, K]) for an
    int8 weight, widened to float32 in registers: the weight's bytes are a quarter of
    float32's. The product is unscaled (the caller applies the per-column scale:
    :class:`kvjax.models.weight_matmul.Int8Weight`). Forward only (no gradient).

    Args:
      x: [M, K] float32.
      q: [K, N] or [N, K] int8.
      w_layout: 'kn' or 'nk'.
    Returns:
      [M, N] float32, equal to ``x @ q.astype(float32)`` up to float rounding.
    Raises:
      ValueError: x not a float32 matrix, q not an int8 one, mismatched K or a bad
        w_layout, naming the value.
      RuntimeError: the library could not be built or loaded (see the warning).
    """
    if w_layout not in ("kn", "nk"):
        raise ValueError(f"w_layout={w_layout!r}; allowed: 'kn' (q [K, N]) or 'nk' (q [N, K])")
    _check_operands("rows_matmul_int8", x, ("q", q, jnp.int8), w_layout)
    return _call_int8(x, q, w_layout)


def _check_operands(fn: str, x: jax.Array, weight: tuple, w_layout: str,
                    hint: str = "") -> None:
    """Raises ValueError unless x is a float32 matrix and the weight (name, array, dtype)
    a matrix of that dtype sharing x's K in ``w_layout``; RuntimeError (ending in
    ``hint``) if the library could not be built or loaded."""
    name, w, dtype = weight
    for n, a, dt in (("x", x, jnp.float32), (name, w, dtype)):
        if a.ndim != 2 or a.dtype != dt:
            raise ValueError(f"{fn}: {n} is {a.dtype}{list(a.shape)}; "
                             f"allowed: a {jnp.dtype(dt).name} matrix")
    k = w.shape[0] if w_layout == "kn" else w.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"{fn}: x {list(x.shape)} and {name} {list(w.shape)} "
                         f"({w_layout}) do not share K")
    if not load():
        raise RuntimeError(f"{fn}: the native library could not be built or loaded "
                           f"(see the warning){hint}")


def _call_int8(x: jax.Array, q: jax.Array, w_layout: str) -> jax.Array:
    n = q.shape[1] if w_layout == "kn" else q.shape[0]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(TARGET_INT8, out, vmap_method="sequential")(
        x, q, q_nk=np.int64(w_layout == "nk"), threads=np.int64(native.num_threads()))


def _call(x: jax.Array, w: jax.Array, w_layout: str, split: str, lanes: bool,
          norm: tuple | None = None) -> jax.Array:
    n = w.shape[1] if w_layout == "kn" else w.shape[0]
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    attrs = dict(w_nk=np.int64(w_layout == "nk"), threads=np.int64(native.num_threads()),
                 split=np.int64(split == "k"), lanes=np.int64(lanes))
    if norm is None:
        return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x, w, **attrs)
    g, eps = norm
    return jax.ffi.ffi_call(TARGET_NORM, out, vmap_method="sequential")(
        x, g, w, eps=np.float32(eps), **attrs)


# Differentiable: the kernel computes the forward product; the backward products (a
# training step's, e.g. experiments.uptrain with configs' weight_matmul='auto' and few
# rows) are XLA's: dx = g w^T, dw = x^T g (kn) or g^T x (nk).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _product(x, w, w_layout, split, lanes):
    return _call(x, w, w_layout, split, lanes)


def _product_fwd(x, w, w_layout, split, lanes):
    return _call(x, w, w_layout, split, lanes), (x, w)


def _product_bwd(w_layout, split, lanes, res, g):
    del split, lanes
    x, w = res
    if w_layout == "kn":
        return g @ w.T, x.T @ g
    return g @ w, g.T @ x


_product.defvjp(_product_fwd, _product_bwd)


def _rms_norm(x, g, eps):
    """XLA's RMSNorm of the rows of x (the normed kernel's function, for its gradient)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g[None]


# The normed product's backward is XLA's, through the norm and the product.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _normed_product(x, g, w, w_layout, split, lanes, eps):
    return _call(x, w, w_layout, split, lanes, (g, eps))


def _normed_fwd(x, g, w, w_layout, split, lanes, eps):
    return _call(x, w, w_layout, split, lanes, (g, eps)), (x, g, w)


def _normed_bwd(w_layout, split, lanes, eps, res, gy):
    x, g, w = res
    _, vjp = jax.vjp(lambda x, g, w: _rms_norm(x, g, eps) @ (w if w_layout == "kn" else w.T),
                     x, g, w)
    return vjp(gy)


_normed_product.defvjp(_normed_fwd, _normed_bwd)
