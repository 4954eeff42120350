"""Building blocks: RMSNorm, rotary embedding, MLPs, a named einsum projection."""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import rope
from kvjax.models import weight_matmul
from kvjax.plan import Plan


class Einsum(nn.Module):
    """A projection ``y = einsum(eqn, x, kernel)`` with a named 'kernel' parameter.

    Attributes:
      shape: kernel shape, e.g. (D, N, H).
      eqn: einsum equation with the input first, e.g. 'BTD,DNH->BTNH'.
      dtype: parameter and output dtype.
      impl: the product's formulation, ``model.weight_matmul`` ('xla', 'native',
        'native_ksplit', 'native_lanes' or 'auto'; :mod:`kvjax.models.weight_matmul`).
      plan: the config's plan (``ModelConfig.plan``: the picks for 'auto' and whether
        the native kernel is loaded), or None (the reference).
      use_bias: add a 'bias' parameter over the kernel's output axes (those not
        contracted, e.g. [N, H] for 'BTD,DNH->BTNH'): Qwen2's query/key/value biases.
    """

    shape: Sequence[int]
    eqn: str
    dtype: jnp.dtype = jnp.float32
    merge_in: int = 0
    impl: str = "xla"
    plan: Plan | None = None
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``merge_in`` = m > 0: the eqn is written for the kernel's first m axes merged
        into one and x's last m axes merged into one (a free reshape). XLA:CPU otherwise
        transposed the [N, H, D] output kernel every step (2·N·H·D bytes per layer)."""
        fan_in = 1
        lhs, rhs = self.eqn.split("->")[0].split(",")
        shape = tuple(self.shape)
        if self.merge_in:
            m = self.merge_in
            shape = (int(np.prod(shape[:m])),) + shape[m:]
        for letter, size in zip(rhs, shape):
            if letter in lhs:
                fan_in *= size
        kernel = self.param(
            "kernel", nn.initializers.normal(stddev=fan_in ** -0.5), tuple(self.shape),
            self.dtype)
        if isinstance(x, weight_matmul.Normed) and (
                self.merge_in or x.dtype != jnp.dtype(self.dtype)):
            x = x.apply()
        if self.merge_in:  # (an Int8Weight too: kvjax.models.weight_matmul)
            kernel = kernel.reshape(shape)
            x = x.reshape(x.shape[: x.ndim - self.merge_in] + (shape[0],))
        if not isinstance(x, weight_matmul.Normed):  # (a Normed one is in self.dtype)
            x = x.astype(self.dtype)
        y = weight_matmul.einsum(self.eqn, x, kernel, self.impl, self.plan)
        if self.use_bias:
            out_shape = tuple(n for letter, n in zip(rhs, shape) if letter not in lhs)
            bias = self.param("bias", nn.initializers.zeros, out_shape, self.dtype)
            y = y + bias.reshape((1,) * (y.ndim - bias.ndim) + bias.shape)
        return y


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale, computed in float32.

    Input and output: [..., D] of ``dtype`` (or the deferred form, ``defer=True``).
    """

    eps: float = 1e-5
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, defer: bool = False):
        """``defer``: return a :class:`kvjax.models.weight_matmul.Normed` (the norm not yet
        applied) for a consumer whose weight product can fold it into the native kernel
        (:func:`kvjax.models.weight_matmul.einsum`); any other consumer calls its
        ``apply()``."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        normed = weight_matmul.Normed(x, scale, self.eps, jnp.dtype(self.dtype))
        return normed if defer else normed.apply()


def applied(x):
    """``x`` with a deferred norm applied (:class:`kvjax.models.weight_matmul.Normed`);
    an array as it is."""
    return x.apply() if isinstance(x, weight_matmul.Normed) else x


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: tuple | None = None) -> jax.Array:
    """Rotary position embedding (Su et al. 2021), half-split ('rotate_half') convention.

    Pairs dimension i with i + H/2 (the HF llama layout; llama.cpp's GGUF rows are
    un-permuted to it on load).

    Args:
      x: [B, T, ..., H] queries or keys (any dtype; H even).
      positions: [B, T] int32 absolute positions.
      theta: rotary base (SmolLM2: 1e5).
      scaling: ``ModelConfig.rope_scaling`` (a checkpoint's scaled frequencies,
        :func:`kvjax.rope.inverse_frequencies`), or None for plain rotary.
    Returns:
      [B, T, ..., H], same dtype as x.
    """
    h = x.shape[-1]
    if scaling is None:
        inv_freq = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    else:  # config constants: computed in float64 once, at trace time
        inv_freq = jnp.asarray(rope.inverse_frequencies(h, theta, scaling), jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq[None, None]  # [B, T, H/2]
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    amplitude = rope.rotary_amplitude(scaling)  # YaRN's mscale ratio; 1 otherwise
    if amplitude != 1.0:
        cos, sin = cos * amplitude, sin * amplitude
    # [x1, x2] -> [x1·cos - x2·sin, x2·cos + x1·sin] as x·[cos, cos] + [x2, x1]·[-sin, sin]
    # over a [.., 2, H/2] view: the halves swapped by a reverse, not re-joined by a
    # concatenate, so XLA:CPU fuses the rotation into each consumer (a decode step's
    # score and cache write) instead of running it as a thunk of its own
    # (docs/decisions/0042-rmsnorm-in-the-rows-kernel.md)
    x32 = x.astype(jnp.float32).reshape(x.shape[:-1] + (2, h // 2))
    cos2 = jnp.stack([cos, cos], axis=-2)
    sin2 = jnp.stack([-sin, sin], axis=-2)
    out = x32 * cos2 + jnp.flip(x32, axis=-2) * sin2
    return out.reshape(x.shape).astype(x.dtype)


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, indices) [..., k] of the k largest entries of x [..., E], largest first,
    the lower index first among equals: k rounds of argmax (k is a handful). Not
    ``jax.lax.top_k``: on CPU it lowers to a TopK custom call whose comparator XLA's
    cost analysis of a re-parsed module cannot find (kvjax.analysis.hlo_cost)."""
    vals, idxs = [], []
    for _ in range(k):
        i = jnp.argmax(x, axis=-1)
        vals.append(jnp.take_along_axis(x, i[..., None], axis=-1)[..., 0])
        idxs.append(i)
        x = jnp.where(jax.nn.one_hot(i, x.shape[-1], dtype=bool), -jnp.inf, x)
    return jnp.stack(vals, axis=-1), jnp.stack(idxs, axis=-1)


class MoE(nn.Module):
    """Mixture-of-experts SwiGLU MLP with shared experts (DeepSeekMoE, Dai et al. 2024;
    DeepSeek-V2, Liu et al. 2024, sec. 2.2, eq. 20-23): out = shared(x) +
    sum over the top-k routed experts of g_e(x)·expert_e(x), with router scores
    s = softmax(x·W_router) [E], the top k of them (``groups`` > 1: only among the
    experts of the ``topk_groups`` groups with the highest best score, DeepSeek's
    'group_limited_greedy'), renormalised to sum 1 with ``norm_topk`` else times
    ``routed_scale``.

    Parameters: router [D, E]; experts_gate, experts_up [E, D, Fe], experts_down
    [E, Fe, D]; with ``shared_dim`` > 0 a SwiGLU 'shared' MLP of width shared_dim.
    Every expert is computed and weighted by its routing weight (0 when not selected):
    the same function as running only the chosen ones, at E/k times their FLOP.
    Input/output [B, T, D].
    """

    d_model: int
    expert_dim: int
    num_experts: int
    top_k: int
    shared_dim: int = 0
    routed_scale: float = 1.0
    norm_topk: bool = False
    groups: int = 1
    topk_groups: int = 1
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, f, e, dt = self.d_model, self.expert_dim, self.num_experts, self.dtype
        scores = jax.nn.softmax(Einsum((d, e), "BTD,DE->BTE", dt, name="router")(x)
                                .astype(jnp.float32), axis=-1)  # [B, T, E]
        pick = scores
        if self.groups > 1:  # keep the experts of the topk_groups best groups
            best = jnp.max(scores.reshape(scores.shape[:-1] + (self.groups, -1)), axis=-1)
            _, top_groups = top_k(best, self.topk_groups)
            keep = jnp.sum(jax.nn.one_hot(top_groups, self.groups), axis=-2) > 0
            keep = jnp.repeat(keep, e // self.groups, axis=-1)
            pick = jnp.where(keep, scores, 0.0)
        weight, idx = top_k(pick, self.top_k)  # [B, T, k]
        if self.norm_topk and self.top_k > 1:
            weight = weight / (jnp.sum(weight, axis=-1, keepdims=True) + 1e-20)
        else:
            weight = weight * self.routed_scale
        gates = jnp.sum(jax.nn.one_hot(idx, e) * weight[..., None], axis=-2)  # [B, T, E]
        init = nn.initializers.normal(stddev=d ** -0.5)
        w_gate = self.param("experts_gate", init, (e, d, f), dt)
        w_up = self.param("experts_up", init, (e, d, f), dt)
        w_down = self.param("experts_down", nn.initializers.normal(stddev=f ** -0.5),
                            (e, f, d), dt)
        h = jax.nn.silu(jnp.einsum("BTD,EDF->BTEF", x, w_gate)) * jnp.einsum(
            "BTD,EDF->BTEF", x, w_up)
        out = jnp.einsum("BTEF,EFD->BTED", h, w_down)
        y = jnp.einsum("BTE,BTED->BTD", gates.astype(out.dtype), out)
        if self.shared_dim:
            y = y + MLP(d, self.shared_dim, "swiglu", dt, name="shared")(x)
        return y.astype(x.dtype)


class MLP(nn.Module):
    """Feed-forward block.

    'swiglu': down(silu(gate(x)) * up(x)) (Shazeer 2020; llama/SmolLM2), 3·D·F params.
    'geglu':  down(gelu_tanh(gate(x)) * up(x)) (Shazeer 2020; Gemma), 3·D·F params.
    'gelu':   down(gelu(up(x))), 2·D·F params (the blog's W1, W2).
    Parameters prepared for decoding (:func:`kvjax.models.model.fuse_projections`) hold
    one gate_up [D, 2F] (gate's columns, then up's) instead of gate and up: one product.
    Input/output [B, T, D]; the input may be a deferred norm
    (:class:`kvjax.models.weight_matmul.Normed`), folded into gate_up's product.
    """

    d_model: int
    mlp_dim: int
    mlp_type: str = "swiglu"
    dtype: jnp.dtype = jnp.float32
    weight_matmul: str = "xla"
    plan: Plan | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, f, wm, pl = self.d_model, self.mlp_dim, self.weight_matmul, self.plan
        gated = self.mlp_type in ("swiglu", "geglu")
        fused = gated and self.has_variable("params", "gate_up")
        x = x if fused else applied(x)  # a deferred norm folds into one product only
        if fused:  # prepared for decoding
            both = Einsum((d, 2 * f), "BTD,DF->BTF", self.dtype, name="gate_up", impl=wm,
                          plan=pl)(x)
            gate, up = both[..., :f], both[..., f:]
        else:
            up = Einsum((d, f), "BTD,DF->BTF", self.dtype, name="up", impl=wm, plan=pl)(x)
            gate = Einsum((d, f), "BTD,DF->BTF", self.dtype, name="gate", impl=wm,
                          plan=pl)(x) if gated else None
        if gated:
            act = jax.nn.silu if self.mlp_type == "swiglu" else functools.partial(
                jax.nn.gelu, approximate=True)
            hidden = act(gate) * up
        else:
            hidden = jax.nn.gelu(up)
        return Einsum((f, d), "BTF,FD->BTD", self.dtype, name="down", impl=wm,
                      plan=pl)(hidden)
