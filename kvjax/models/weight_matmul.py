"""Products of activations with weight matrices, by formulation (``model.weight_matmul``).

A decode step multiplies M = B·T rows (T = 1: the batch) by every weight matrix once.
With few rows the product should cost the weight's bytes over the memory bandwidth,
whatever M (the weight is read once for all rows), until M is large enough for the
FLOPs to dominate: step time = max(bytes / bandwidth, FLOPs / peak), the roofline of
Williams et al. 2009 (:func:`kvjax.analysis.theory.step_time`). XLA:CPU's dot kernels
re-read the weight as M grows (docs/results/: SmolLM2's weight dots at B = 16 against
B = 1). The formulations ('xla', the reference ``jnp.einsum``; 'native',
'native_ksplit' and 'native_lanes', the register-blocked kernel of
:mod:`kvjax.native.rows_matmul` streaming each weight once for all M rows, split by
output columns, by the weight's K rows, or with an [N, K] weight in the vector lanes;
docs/decisions/0018-weight-splits-per-machine.md) are registered in :mod:`kvjax.kernels`
(the table in docs/DESIGN.md); ``ModelConfig.weight_matmul`` selects one, 'auto' the
pick of the config's plan for the product's class (:func:`kvjax.plan.weight_class`).
Nothing is measured or built while a program is traced.

An input may be a :class:`Normed` row (RMSNorm not yet applied): where the product runs
on the native kernel in float32 the kernel applies the norm itself (one custom call
instead of the norm's two fusions and the product:
docs/decisions/0042-rmsnorm-in-the-rows-kernel.md); elsewhere the norm is applied first
by XLA, as :class:`kvjax.models.layers.RMSNorm` does.

Int8 weights (:class:`Int8Weight`: a self draft's copy of the target's weights,
``speculative.draft_weight_dtype='int8'``) run on the native kernel's int8 variant where
the plan has it loaded (a quarter of float32's bytes), elsewhere XLA multiplies by the
widened weight: XLA:CPU widens a [K, N] int8 weight into a float32 copy before its dot,
so there is no choice to measure.

:func:`einsum` takes the equation of a projection written as ``<rows><contracted>,
<contracted><out>-><rows><out>`` (weights stored [in, out]: every :class:`Einsum`
kernel) or ``<rows><contracted>,<out><contracted>-><rows><out>`` (stored [out, in]: the
tied LM head, the embedding [V, D]); anything else, and every case the native kernel
does not take, is ``jnp.einsum``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax import kernels, ops
from kvjax import plan as plan_lib
from kvjax.native import rows_matmul as rm

# the native kernel's formulations: the registry's custom calls of that target
NATIVE = tuple(f.name for f in kernels.formulations("weight_matmul")
               if f.target == "kvjax_rows_matmul")


FOLD_NORMS = True
"""Whether :func:`einsum` folds a :class:`Normed` input into the native kernel (False:
XLA applies it first, as before; scripts/thunk_count.py's ``--compare=norms`` sets it
while tracing the other form). Read while a program is traced."""


@struct.dataclass
class Normed:
    """Rows whose RMSNorm (Zhang & Sennrich 2019) is not yet applied: x / sqrt(mean(x^2)
    + eps) · scale over the last axis, computed in float32, in ``dtype``
    (:class:`kvjax.models.layers.RMSNorm` with ``defer=True``). :func:`einsum` folds it
    into the native kernel where that runs; :meth:`apply` computes it with XLA.

    Attributes:
      x: [..., D] the rows before the norm.
      scale: [D] the norm's learned scale.
      eps: the norm's epsilon.
      dtype: the normed rows' dtype (the model's).
    """

    x: jax.Array
    scale: jax.Array
    eps: float = struct.field(pytree_node=False)
    dtype: jnp.dtype = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.x.shape

    @property
    def ndim(self) -> int:
        return self.x.ndim

    def apply(self) -> jax.Array:
        """The normed rows, [..., D] of ``dtype``, by XLA."""
        x32 = self.x.astype(jnp.float32)
        # 1 / sqrt(mean(x^2) + eps), summed so that a decode step's norm is two thunks
        # (kvjax.ops.lane_sum; docs/decisions/0036-row-sums-in-parts.md)
        y = x32 * jax.lax.rsqrt(ops.lane_sum(x32 * x32, x32) / self.x.shape[-1] + self.eps)
        scale = jnp.expand_dims(self.scale.astype(jnp.float32), range(y.ndim - 1))
        return (y * scale).astype(self.dtype)


def split_eqn(eqn: str, x_ndim: int, w_ndim: int) -> tuple[int, int, str] | None:
    """(rows axes, contracted axes, 'kn' or 'nk') if ``eqn`` is a rows-by-weight product
    this module can run as one [M, K] x [K, N] (or [N, K]) matrix product, else None.

    E.g. 'BTD,DNH->BTNH' -> (2, 1, 'kn'); 'BTD,VD->BTV' -> (2, 1, 'nk')."""
    try:
        ins, out = eqn.replace(" ", "").split("->")
        lhs, rhs = ins.split(",")
    except ValueError:
        return None
    if (len(lhs) != x_ndim or len(rhs) != w_ndim or len(set(lhs)) != len(lhs)
            or len(set(rhs)) != len(rhs)):
        return None
    c = "".join(ch for ch in lhs if ch in rhs)
    rows = lhs[: len(lhs) - len(c)]
    if not c or lhs != rows + c or any(ch in rhs for ch in rows):
        return None
    if rhs.startswith(c) and out == rows + rhs[len(c):]:
        return len(rows), len(c), "kn"
    if rhs.endswith(c) and out == rows + rhs[: len(rhs) - len(c)]:
        return len(rows), len(c), "nk"
    return None


def site(m: int, k: int, n: int, layout: str, dtype: str,
         plan: plan_lib.Plan | None) -> kernels.Site:
    """The :class:`kvjax.kernels.Site` of a product of M rows with a K x N weight
    (``layout`` 'kn' or 'nk'; ``dtype``: 'float32' for float32 rows and weight, 'int8'
    for float32 rows and an :class:`Int8Weight`, else the rows' dtype) under ``plan``
    (None: no kernel loaded)."""
    return kernels.Site("weight_matmul", key=plan_lib.weight_class(m, k, n, layout),
                        dtype=dtype, rows=int(m), layout=layout,
                        devices=plan.num_devices if plan else 1,
                        native=plan.native if plan else (), planned=plan is not None)


def applies(formulation: str, m: int, layout: str) -> str:
    """The formulation that really runs for ``formulation`` on M rows and ``layout`` with
    the kernel loaded: 'native_ksplit' is 'native' unless M > 1 and 'kn'; 'native_lanes'
    is 'native' unless M > 1 and 'nk' (the kernel runs those cases alike); others are
    themselves (the registry's fallbacks, :func:`kvjax.kernels.select`)."""
    return kernels.select("weight_matmul", formulation,
                          site(m, 1, 1, layout, "float32",
                               plan_lib.Plan(native=("rows_matmul",))))


def einsum(eqn: str, x: jax.Array, w: jax.Array, impl: str = "xla",
           plan: plan_lib.Plan | None = None) -> jax.Array:
    """``jnp.einsum(eqn, x, w)`` by formulation ``impl`` (see the module docstring).

    Args:
      eqn: a projection's equation, e.g. 'BTD,DF->BTF' (w [D, F]) or 'BTD,VD->BTV'.
      x: [rows..., contracted...] activations, or :class:`Normed` ones.
      w: the weight, [contracted..., out...] or [out..., contracted...], or an
        :class:`Int8Weight` of that shape (see the module docstring).
      impl: a value of ``model.weight_matmul`` (:mod:`kvjax.kernels`).
      plan: the config's plan (its picks and loaded kernels), or None.
    Returns:
      The einsum's result in ``x``'s dtype promoted with ``w``'s (as ``jnp.einsum``);
      in ``x``'s dtype for an :class:`Int8Weight`.
    Raises:
      ValueError: an unknown impl; an :class:`Int8Weight` whose scale varies along a
        contracted axis.
    """
    if impl not in kernels.names("weight_matmul"):
        raise ValueError(f"weight_matmul={impl!r}; allowed: one of "
                         f"{list(kernels.names('weight_matmul'))}")
    int8 = isinstance(w, Int8Weight)
    normed = x if isinstance(x, Normed) else None
    x = x.x if normed is not None else x
    split = split_eqn(eqn, x.ndim, w.ndim)
    if normed is not None and (split is None or split[1] != 1 or int8
                               or normed.dtype != jnp.float32):
        normed, x = None, normed.apply()  # the kernel folds one float32 norm axis only
    if split is None:  # not a rows-by-weight product: XLA's einsum
        return jnp.einsum(eqn, x, w.dequantize(x.dtype) if int8 else w)
    nr, nc, layout = split
    if int8 and any(d != 1 for d in (w.scale.shape[:nc] if layout == "kn"
                                     else w.scale.shape[w.ndim - nc:])):
        raise ValueError(f"einsum {eqn!r}: the int8 weight's scale {list(w.scale.shape)} "
                         "varies along a contracted axis; allowed: a scale per output channel")
    m, k = math.prod(x.shape[:nr]), math.prod(x.shape[nr:])
    n = math.prod(w.shape[nc:] if layout == "kn" else w.shape[: w.ndim - nc])
    floats = x.dtype == jnp.float32 and (int8 or w.dtype == jnp.float32)
    dtype = ("int8" if int8 else "float32") if floats else jnp.dtype(x.dtype).name
    where = site(m, k, n, layout, dtype, plan)
    name = kernels.select("weight_matmul", impl, where, plan.pick(where) if plan else None)
    if normed is not None:
        if FOLD_NORMS and name in NATIVE and dtype == "float32":
            return kernels.run("weight_matmul", name, eqn, x, w, split,
                               norm=(normed.scale.astype(jnp.float32), normed.eps))
        x = normed.apply()
    return kernels.run("weight_matmul", name, eqn, x, w, split)


def run_xla(name: str, eqn: str, x: jax.Array, w, split) -> jax.Array:
    """'xla': ``jnp.einsum`` (an :class:`Int8Weight` widened to x's dtype, then the
    output channels' scale)."""
    if isinstance(w, Int8Weight):
        return _int8_scaled(jnp.einsum(eqn, x, w.q.astype(x.dtype)), w, split, x.dtype)
    return jnp.einsum(eqn, x, w)


def _rows(x: jax.Array, w, parts, **kw) -> jax.Array:
    """The native row-product kernel on ``x`` [rows..., contracted...] and ``w`` (its
    int8 variant for an :class:`Int8Weight`), reshaped back; ``parts``: (rows axes,
    contracted axes, layout) of :func:`split_eqn`; ``kw``: :func:`rows_matmul`'s split,
    lanes and norm."""
    nr, nc, layout = parts
    rows_shape = x.shape[:nr]
    out_shape = w.shape[nc:] if layout == "kn" else w.shape[: w.ndim - nc]
    m, k, n = math.prod(rows_shape), math.prod(x.shape[nr:]), math.prod(out_shape)
    shape = (k, n) if layout == "kn" else (n, k)
    if isinstance(w, Int8Weight):
        y = rm.rows_matmul_int8(x.reshape(m, k), w.q.reshape(shape), layout)
        return _int8_scaled(y.reshape(rows_shape + out_shape), w, parts, x.dtype)
    return rm.rows_matmul(x.reshape(m, k), w.reshape(shape), layout,
                          **kw).reshape(rows_shape + out_shape)


def run_native(name: str, eqn: str, x: jax.Array, w, split,
               norm=None) -> jax.Array:
    """'native': the row-product kernel split by output columns."""
    return _rows(x, w, split, norm=norm)


def run_native_ksplit(name: str, eqn: str, x: jax.Array, w, split,
                      norm=None) -> jax.Array:
    """'native_ksplit': the row-product kernel split by the weight's K rows."""
    return _rows(x, w, split, split="k", norm=norm)


def run_native_lanes(name: str, eqn: str, x: jax.Array, w, split,
                     norm=None) -> jax.Array:
    """'native_lanes': the row-product kernel with an [N, K] weight in the vector lanes."""
    return _rows(x, w, split, lanes=True, norm=norm)


# --------------------------------------------------------------------------- int8 weights


@struct.dataclass
class Int8Weight:
    """A weight stored as int8 with float32 scales: w ~ q · scale
    (symmetric absmax quantization, the per-channel scheme of LLM.int8()'s vector-wise
    quantization without its outlier split: Dettmers et al. 2022, eq. 1-3).

    It stands where a float32 weight stands in the parameter tree (Flax compares its
    first leaf, ``q``, with the parameter's shape).

    Attributes:
      q: int8, the weight's shape.
      scale: float32, the weight's rank, size 1 on every axis the absmax reduced (the
        product's input axes: :func:`quantize_params_int8` keeps every output axis, so
        one scale per output channel, e.g. [1, N, H] for q/k/v [D, N, H]; [V, 1] for
        the [V, D] embedding; a stacked kernel's layer axis is kept too). Any axis kept
        must be an output axis of the product (:func:`einsum` raises otherwise).
    """

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def ndim(self) -> int:
        return self.q.ndim

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """q · scale in ``dtype``."""
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)

    def reshape(self, shape: tuple[int, ...]) -> "Int8Weight":
        """The kernel reshaped to ``shape`` by merging leading axes (``Einsum.merge_in``);
        the scale's last axis must be its only one above 1.

        Raises:
          ValueError: the scale varies along another axis than the last."""
        if any(d != 1 for d in self.scale.shape[:-1]):
            raise ValueError(f"Int8Weight.reshape: scale {list(self.scale.shape)} varies "
                             "along more than the last axis; allowed: a per-last-axis scale")
        return Int8Weight(self.q.reshape(shape),
                          self.scale.reshape((1,) * (len(shape) - 1) + self.scale.shape[-1:]))


def quantize_int8(w: jax.Array, keep: tuple[int, ...]) -> Int8Weight:
    """Symmetric int8 quantization of ``w`` with one scale per index of the axes ``keep``
    (absmax over the others / 127; an all-zero slice gets scale 1).

    Args:
      w: a float weight of any rank.
      keep: the axes the scale varies along (negative allowed).
    Returns:
      :class:`Int8Weight` with ``q`` int8 of ``w``'s shape and ``scale`` float32.
    Raises:
      ValueError: an axis of ``keep`` outside ``w``'s rank.
    """
    w = jnp.asarray(w, jnp.float32)
    if any(not -w.ndim <= a < w.ndim for a in keep):
        raise ValueError(f"quantize_int8: keep={keep} for a weight of rank {w.ndim}; "
                         f"allowed: axes in [-{w.ndim}, {w.ndim})")
    kept = {a % w.ndim for a in keep}
    reduce = tuple(a for a in range(w.ndim) if a not in kept)
    amax = jnp.max(jnp.abs(w), axis=reduce, keepdims=True)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(q, scale)


MERGED_INPUT_KERNELS = ("o_proj", "wo")
"""Kernels stored [N, H, D] whose first two axes are the product's input (attention's
output projections, ``Einsum.merge_in``); every other kernel's input is its first axis."""


def quantize_params_int8(params, stacked: bool = False):
    """``params`` with every matrix a self draft reads as :class:`Int8Weight`: each
    'kernel' (one scale per output channel: per index of every axis after the first of
    a stored-[in, out...] kernel, e.g. per (head, head-dim) of q/k/v [D, N, H]; per
    index of the last axis of :data:`MERGED_INPUT_KERNELS`) and the 'embedding' ([V, D]:
    one per vocabulary row, for the tied LM head and the lookup).
    Norm scales and biases stay as they are.

    Args:
      params: a parameter tree (:func:`kvjax.models.model.init_params` or a converted
        checkpoint).
      stacked: the tree holds stacked layers (``scan_layers``: a leading layer axis under
        'layers', kept by the scale).
    Returns:
      A tree of the same structure, weights in int8 (about a quarter of the bytes).
    """
    def one(path, leaf):
        keys = [getattr(p, "key", str(p)) for p in path]
        if keys[-1] == "embedding":
            return quantize_int8(leaf, (0,))
        if keys[-1] == "kernel" and np.ndim(leaf) >= 2:
            lead = 1 if stacked and keys[0] == "layers" else 0  # a stacked layer axis
            if len(keys) >= 2 and keys[-2] in MERGED_INPUT_KERNELS:
                out = (np.ndim(leaf) - 1,)  # [N, H, D]: the last axis alone is output
            else:  # [in, out...]: every axis after the input's
                out = tuple(range(lead + 1, np.ndim(leaf)))
            return quantize_int8(leaf, tuple(range(lead)) + out)
        return leaf
    return jax.tree_util.tree_map_with_path(one, params)


def weight_bytes(params) -> int:
    """Bytes of a parameter tree's arrays (int8 weights and their scales as stored)."""
    return int(sum(np.dtype(a.dtype).itemsize * math.prod(a.shape)
                   for a in jax.tree.leaves(params)))


def take(table, tokens: jax.Array, dtype) -> jax.Array:
    """The embedding lookup ``table[tokens]`` in ``dtype`` for a float table or an
    :class:`Int8Weight` (its rows widened and scaled): [..., D]."""
    if isinstance(table, Int8Weight):
        return (jnp.take(table.q, tokens, axis=0).astype(jnp.float32)
                * jnp.take(table.scale, tokens, axis=0)).astype(dtype)
    return jnp.take(table, tokens, axis=0).astype(dtype)


def int8_runs_native(impl: str, plan: plan_lib.Plan | None, dtype) -> bool:
    """Whether :func:`einsum` runs an :class:`Int8Weight` on the native int8 kernel for
    formulation ``impl``, ``plan`` and activation dtype ``dtype`` (for M from 1 to
    :data:`kvjax.native.rows_matmul.MAX_ROWS`); else XLA over the widened weight."""
    dt = "int8" if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype).name
    return kernels.get("weight_matmul", kernels.select(
        "weight_matmul", impl, site(1, 1, 1, "kn", dt, plan)), internal=True).counted \
        == "custom call"


def _int8_scaled(y: jax.Array, w: Int8Weight, split, dtype) -> jax.Array:
    """``y`` (x times the int8 codes) times the output channels' scale, in ``dtype``."""
    nr, nc, layout = split
    s_shape = w.scale.shape[nc:] if layout == "kn" else w.scale.shape[: w.ndim - nc]
    return (y * w.scale.reshape((1,) * nr + s_shape).astype(y.dtype)).astype(dtype)
