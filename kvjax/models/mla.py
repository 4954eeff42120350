"""Multi-head latent attention (MLA, DeepSeek-V2: Liu et al. 2024, sec. 2.1): the blog's lever 2.

Per token and layer the cache holds one latent ``c_kv = RMSNorm(x·W_DKV)`` of C =
kv_lora_rank elements and one rotary key ``k_rope = RoPE(x·W_KR)`` of R = qk_rope_head_dim
elements shared by every head: (C + R)·b bytes, with no head axis (cache.layer_shapes).

Per head n the keys and values are rebuilt from the latent by up-projections,
``k_n = [c·W_UK[n] ; k_rope]`` (nope + R dims, nope = qk_nope_head_dim) and
``v_n = c·W_UV[n]`` (V = v_head_dim dims). Queries come from ``x·W_Q`` (or the low-rank
path ``RMSNorm(x·W_DQ)·W_UQ`` when q_lora_rank is set), split per head into a no-rope part
(nope dims) and a rotary part (R dims, half-split RoPE). Softmax scale 1/sqrt(nope + R).

Two mathematically equal ways to attend (``cfg.mla_absorb``):

* naive (False): rebuild K = c·W_UK [B, N, S, nope] and V = c·W_UV [B, N, S, V] from every
  cached latent at every step, then attend as MHA. The rebuilt K/V are activations of
  N·(nope + V) elements per token per layer (written and read back each step: the compiled
  bytes grow with them; see ``kvjax.theory.mla_unfused_extra_bytes``).
* absorbed (True): fold W_UK into the query, ``q_lat = q_nope·W_UK^T`` [B, T, N, C], score
  the latents directly (``q_lat·c + q_rope·k_rope``), mix the latents with the
  probabilities (``o_lat = p·c`` [B, T, N, C]) and apply W_UV afterwards. Per step only
  the latent cache is read (twice: once per contraction); nothing of size S·N is built
  except the scores.

Both paths are used for every chunk length (prefill too), so ``mla_absorb`` changes the
arithmetic, never the function. Scores and softmax run in float32 whatever the dtype; a
query that sees no key gets zeros.

Parameters (under the layer's 'attn', named after the paper's matrices; each a 'kernel'
except the norms' 'scale'): w_q [D, N, nope+R] (or w_dq [D, Q], q_norm [Q],
w_uq [Q, N, nope+R] with q_lora_rank Q), w_dkv [D, C], kv_norm [C] (DeepSeek's
kv_a_layernorm), w_kr [D, R], w_uk [N, C, nope], w_uv [N, C, V], wo [N, V, D].

W_UK and W_UV are stored head-major, [N, C, ·], not [C, N, ·]: the absorbed path contracts
them per head (a dot batched over N), and XLA:CPU wants the batch axis major; with
[C, N, ·] it copied a transposed W_UK and W_UV every step
(docs/decisions/0005-mla-head-major-up-projections.md).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import kernels, ops
from kvjax.config import ModelConfig
from kvjax.models import decode_kernels, flash, weight_matmul
from kvjax.models.layers import Einsum, RMSNorm, apply_rope
from kvjax.ops import NEG_INF, weight_dtype
from kvjax.plan import SEQ




class Kernel(nn.Module):
    """A bare weight ``kernel`` of ``shape`` (normal, stddev fan_in^-1/2), for weights used in
    more than one contraction (W_UK, W_UV); an int8 one (a draft's,
    :class:`kvjax.models.weight_matmul.Int8Weight`) is widened here."""

    shape: Sequence[int]
    fan_in: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.normal(stddev=self.fan_in ** -0.5),
                            tuple(self.shape), self.dtype)
        if isinstance(kernel, weight_matmul.Int8Weight):
            return kernel.dequantize(self.dtype)
        return kernel


def _scores(q_main: jax.Array, q_rope: jax.Array, c_kv: jax.Array, k_rope: jax.Array,
            w_uk: jax.Array, absorb: bool) -> jax.Array:
    """Unscaled float32 scores [B, N, T, S] of T queries against S cached tokens.

    Args:
      q_main: absorbed: [B, T, N, C] latent queries; naive: [B, T, N, nope] queries.
      q_rope: [B, T, N, R] rotated query parts.
      c_kv: [B, S, C] latents. k_rope: [B, S, R] rotated shared keys.
      w_uk: [N, C, nope] key up-projection (naive path only).
    """
    if absorb:
        s = jnp.einsum("BTNC,BSC->BNTS", q_main, c_kv, preferred_element_type=jnp.float32)
    else:
        k = jnp.einsum("BSC,NCP->BNSP", c_kv, w_uk)  # rebuilt keys, [B, N, S, nope]
        s = jnp.einsum("BTNP,BNSP->BNTS", q_main, k, preferred_element_type=jnp.float32)
    return s + jnp.einsum("BTNR,BSR->BNTS", q_rope, k_rope,
                          preferred_element_type=jnp.float32)


def _mix(probs: jax.Array, c_kv: jax.Array, w_uv: jax.Array, absorb: bool) -> jax.Array:
    """Probability-weighted values, float32: absorbed [B, T, N, C] latents; naive
    [B, T, N, V] values (rebuilding V = c·W_UV [B, N, S, V] first).

    Args:
      probs: [B, N, T, S] weights, float32 (prefill: the latents are widened for the
        product) or the cache dtype (decode step).
      c_kv: [B, S, C]. w_uv: [N, C, V] (naive path only).
    """
    if absorb:
        # Latent first: with (probs, c_kv) XLA:CPU copies a transposed c_kv
        # (docs/decisions/0005-mla-head-major-up-projections.md).
        return jnp.einsum("BSC,BNTS->BTNC", c_kv, probs, preferred_element_type=jnp.float32)
    v = jnp.einsum("BSC,NCV->BNSV", c_kv, w_uv)  # rebuilt values
    return jnp.einsum("BNTS,BNSV->BTNV", probs, v, preferred_element_type=jnp.float32)


def _normalise(out: jax.Array, denom: jax.Array) -> jax.Array:
    """out [B, T, N, ·] / denom [B, N, T, 1]; rows whose denominator is 0 (no visible
    key: every weight 0) stay 0."""
    denom = jnp.swapaxes(denom, 1, 2)  # [B, T, N, 1]
    return out / jnp.where(denom > 0, denom, 1.0)


def attend_mla(q_main, q_rope, c_kv, k_rope, mask, w_uk, w_uv, absorb: bool,
               scale: float) -> jax.Array:
    """Softmax attention over S latent tokens (full softmax; prefill and chunks).

    The softmax weights stay float32 into the latent (or value) product, as in
    ``attention.attend``; a query row that sees no key gets zeros.

    Args:
      q_main, q_rope: see :func:`_scores`. c_kv [B, S, C], k_rope [B, S, R].
      mask: [B, T, S] bool, True where visible.
      w_uk [N, C, nope], w_uv [N, C, V]: up-projections.
    Returns:
      float32 [B, T, N, C] (absorbed: still to be multiplied by W_UV) or [B, T, N, V].
    """
    s = _scores(q_main, q_rope, c_kv, k_rope, w_uk, absorb) * scale
    visible = mask[:, None]  # [B, 1, T, S]
    s = jnp.where(visible, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(visible, jnp.exp(s - m), 0.0)  # [B, N, T, S] float32
    return _normalise(_mix(e, c_kv, w_uv, absorb), jnp.sum(e, axis=-1, keepdims=True))


def attend_mla_step(q_main, q_rope, c_old, kr_old, mask_old, c_new, kr_new, w_uk, w_uv,
                    absorb: bool, scale: float, new_visible=None,
                    backend: str | None = None) -> jax.Array:
    """One decode step (T = 1) over the cache's old slots plus the new token.

    Same math as :func:`attend_mla` over ``concat(old, new)`` without copying the cache:
    one softmax split into the old scores and the new token's own score (as
    ``attention.attend_step``). The cache is read before the new token is written. The
    unnormalised weights exp(s - max) enter the product in :func:`kvjax.ops.weight_dtype`
    of ``backend`` (the config's; None: the process's; float32 on CPU) and the
    denominator sums them as used.

    Args:
      c_old [B, S, C], kr_old [B, S, R]: this layer's cache before the write.
      mask_old: [B, 1, S] bool, visible old slots.
      c_new [B, 1, C], kr_new [B, 1, R]: the new token's latent and rotary key.
      new_visible: [B] bool, whether each row sees its own new token (None: all do); a
        row that sees no key gets zeros.
    Returns:
      float32 [B, 1, N, C] (absorbed) or [B, 1, N, V] (naive).
    """
    s_old = _scores(q_main, q_rope, c_old, kr_old, w_uk, absorb) * scale  # [B, N, 1, S]
    visible = mask_old[:, None]
    s_old = jnp.where(visible, s_old, NEG_INF)
    s_new = _scores(q_main, q_rope, c_new, kr_new, w_uk, absorb) * scale  # [B, N, 1, 1]
    if new_visible is not None:
        s_new = jnp.where(new_visible[:, None, None, None], s_new, NEG_INF)
    m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), s_new)
    wdt = weight_dtype(c_old.dtype, backend or backend_lib.current())
    p_old = jnp.where(visible, jnp.exp(s_old - m), 0.0).astype(wdt)
    p_new = jnp.exp(s_new - m)
    if new_visible is not None:
        p_new = jnp.where(new_visible[:, None, None, None], p_new, 0.0)
    p_new = p_new.astype(wdt)
    denom = (jnp.sum(p_old.astype(jnp.float32), axis=-1, keepdims=True)
             + p_new.astype(jnp.float32))
    return _normalise(_mix(p_old, c_old, w_uv, absorb) + _mix(p_new, c_new, w_uv, absorb),
                      denom)



def attend_mla_cached_seq(plan, q_main, q_rope, c_old, kr_old, mask_old, c_new, kr_new,
                          mask_new, w_uk, w_uv, absorb: bool, scale: float) -> jax.Array:
    """MLA attention of a chunk over (latent slots split over the plan's 'seq' axis ++
    its own latents): each device's partial softmax state, combined across 'seq'
    (:func:`kvjax.ops.combine_over`), merged with the chunk's.

    Args: as :func:`attend_mla` with the cache split: c_old [B, S, C] and kr_old
      [B, S, R] split over 'seq' along S, mask_old [B, T, S]; c_new [B, T, C], kr_new
      [B, T, R], mask_new [B, T, T]; ``plan`` the config's plan.
    Returns:
      float32 [B, T, N, C] (absorbed) or [B, T, N, V] (naive), as :func:`attend_mla`.
    """
    def local(c, kr, mask, q_main, q_rope, w_uk, w_uv):
        s = _scores(q_main, q_rope, c, kr, w_uk, absorb) * scale  # [B, N, T, S]
        m, e, l = ops.softmax_stats(s, mask[:, None])
        o = _mix(e, c, w_uv, absorb)  # [B, T, N, X]
        to_o = lambda x: jnp.swapaxes(x, 1, 2)  # [B, N, T, 1] -> [B, T, N, 1]
        return to_o(m), to_o(l), o

    rep = (q_main, q_rope, w_uk, w_uv)
    old = ops.combine_over(SEQ, plan.seq_manual, local,
                           ((c_old, -2), (kr_old, -2), (mask_old, -1)), rep)
    new = local(c_new, kr_new, mask_new, *rep)
    return ops.finish(ops.merge(old, new))


class MLACall(NamedTuple):
    """One layer's chunk as MLA's attention formulations read it (the methods
    :func:`kvjax.kernels.run` calls: 'tiled', 'dense', 'seq' and the one decode step).

    Attributes:
      cfg: the config.
      q_main: [B, T, N, nope] queries (absorbed: [B, T, N, C]); q_rope: [B, T, N, R].
      new: the chunk's latents in the cache's representation.
      positions: [B, T] int32 (-1: padding).
      cached: this layer's latent cache before the chunk, or None (a fresh prompt).
      cached_positions: [B, S] int32, or None.
      w_uk, w_uv: [N, C, nope] and [N, C, V] up-projections.
      scale: the scores' scale (:attr:`MLAttention.scale`).
    """

    cfg: ModelConfig
    q_main: jax.Array
    q_rope: jax.Array
    new: dict
    positions: jax.Array
    cached: dict | None
    cached_positions: jax.Array | None
    w_uk: jax.Array
    w_uv: jax.Array
    scale: float

    def current(self):
        """The chunk's (c_kv [B, T, C], k_rope [B, T, R]) as the cache will hold them."""
        c = self.cfg
        return cache_lib.read(c, self.new, "c_kv"), cache_lib.read(c, self.new, "k_rope")

    def old(self):
        """(c_old, kr_old, mask_old, c_seen): the cache read before the write (see
        ``attention.Attention``); c_seen zeroes the latents of old slots no query sees
        (issue 32): they contribute nothing whatever they hold, on the chunk paths and
        in a decode step over a dequantized cache; not in a float decode step (a copy of
        the latent cache per step under XLA:CPU,
        docs/decisions/0024-clear-masked-slots-once.md). Every path selects the scores."""
        c = self.cfg
        c_old = cache_lib.read(c, self.cached, "c_kv")
        mask_old = cache_lib.attention_mask(self.positions, self.cached_positions, c)
        return (c_old, cache_lib.read(c, self.cached, "k_rope"), mask_old,
                lambda: ops.zero_unseen(c_old, jnp.any(mask_old, axis=1), -2))

    def _ups(self):
        return self.w_uk, self.w_uv, self.cfg.mla_absorb, self.scale

    def run_tiled(self, name: str) -> jax.Array:
        """'tiled': :func:`kvjax.models.flash.attend_mla_chunk`."""
        c = self.cfg
        c_kv, k_rope = self.current()
        kw = dict(w_uk=self.w_uk, w_uv=self.w_uv, absorb=c.mla_absorb, scale=self.scale,
                  window_size=c.window_size, num_sink_tokens=c.num_sink_tokens,
                  block_q=c.prefill_block_q, block_k=c.prefill_block_k, backend=c.backend)
        if self.cached is not None:
            c_old, kr_old, _, c_seen = self.old()
            kw.update(c_old=c_seen(), kr_old=kr_old, old_positions=self.cached_positions)
        return flash.attend_mla_chunk(self.q_main, self.q_rope, c_kv, k_rope, self.positions,
                                      **kw)

    def run_dense(self, name: str) -> jax.Array:
        """'dense': :func:`attend_mla` over (the cache's old slots ++ the chunk)."""
        c_kv, k_rope = self.current()
        mask = cache_lib.attention_mask(self.positions, self.positions, self.cfg)
        if self.cached is not None:
            _, kr_old, mask_old, c_seen = self.old()
            c_kv = jnp.concatenate([c_seen(), c_kv], axis=1)
            k_rope = jnp.concatenate([kr_old, k_rope], axis=1)
            mask = jnp.concatenate([mask_old, mask], axis=2)
        return attend_mla(self.q_main, self.q_rope, c_kv, k_rope, mask, *self._ups())

    def run_seq(self, name: str) -> jax.Array:
        """'seq': :func:`attend_mla_cached_seq` (the cache split over the 'seq' axis)."""
        c_kv, k_rope = self.current()
        _, kr_old, mask_old, c_seen = self.old()
        return attend_mla_cached_seq(
            self.cfg.execution, self.q_main, self.q_rope, c_seen(), kr_old, mask_old, c_kv,
            k_rope, cache_lib.attention_mask(self.positions, self.positions, self.cfg),
            *self._ups())

    def run_step(self, name: str) -> jax.Array:
        """MLA's decode step (:func:`attend_mla_step`), whatever decode formulation was
        asked (the registry forces 'xla' for MLA)."""
        c_kv, k_rope = self.current()
        c_old, kr_old, mask_old, c_seen = self.old()
        return attend_mla_step(self.q_main, self.q_rope,
                               c_seen() if self.cfg.kv_quantized else c_old, kr_old,
                               mask_old, c_kv, k_rope, *self._ups(),
                               new_visible=self.positions[:, 0] >= 0,
                               backend=self.cfg.backend)


class MLAttention(nn.Module):
    """Multi-head latent attention with a latent KV cache; same contract as
    ``kvjax.attention.Attention``."""

    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        wm = c.weight_matmul
        dt = c.jnp_dtype
        d, n = c.d_model, c.num_heads
        cl, r = c.kv_lora_rank, c.qk_rope_head_dim
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        if c.q_lora_rank is None:
            self.w_q = Einsum((d, n, nope + r), "BTD,DNH->BTNH", dt, impl=wm, plan=c.plan)
        else:
            q = c.q_lora_rank
            self.w_dq = Einsum((d, q), "BTD,DQ->BTQ", dt, impl=wm, plan=c.plan)
            self.q_norm = RMSNorm(c.norm_eps, dt)
            self.w_uq = Einsum((q, n, nope + r), "BTQ,QNH->BTNH", dt, impl=wm, plan=c.plan)
        self.w_dkv = Einsum((d, cl), "BTD,DC->BTC", dt, impl=wm, plan=c.plan)
        self.kv_norm = RMSNorm(c.norm_eps, dt)
        self.w_kr = Einsum((d, r), "BTD,DR->BTR", dt, impl=wm, plan=c.plan)
        self.w_uk = Kernel((n, cl, nope), cl, dt)
        self.w_uv = Kernel((n, cl, v), cl, dt)
        self.wo = Einsum((n, v, d), "BTNV,NVD->BTD", dt, impl=wm, plan=c.plan)

    @property
    def scale(self) -> float:
        """:attr:`kvjax.config.ModelConfig.mla_scale`."""
        return self.cfg.mla_scale

    def queries(self, x: jax.Array, positions: jax.Array):
        """(q_nope [B, T, N, nope], rotated q_rope [B, T, N, R]) in cfg.dtype."""
        c = self.cfg
        if c.q_lora_rank is None:
            q = self.w_q(x)
        else:
            q = self.w_uq(self.q_norm(self.w_dq(x)))
        nope = c.qk_nope_head_dim
        return q[..., :nope], apply_rope(q[..., nope:], positions, c.rope_theta,
                                         c.rope_scaling)

    def latents(self, x: jax.Array, positions: jax.Array):
        """What the cache stores for x: (c_kv [B, T, C], k_rope [B, T, R]) in cfg.dtype."""
        c_kv = self.kv_norm(self.w_dkv(x))
        k_rope = apply_rope(self.w_kr(x), positions, self.cfg.rope_theta,
                            self.cfg.rope_scaling)
        return c_kv, k_rope

    def scores(self, x_q: jax.Array, q_positions: jax.Array, x_k: jax.Array,
               k_positions: jax.Array) -> jax.Array:
        """Scaled float32 scores [B, N, Tq, Tk] of queries from x_q against keys from x_k
        (no mask), by the path ``cfg.mla_absorb`` selects. For tests and analysis."""
        q_nope, q_rope = self.queries(x_q, q_positions)
        c_kv, k_rope = self.latents(x_k, k_positions)
        q_main = self._query_main(q_nope)
        return _scores(q_main, q_rope, c_kv, k_rope, self.w_uk(), self.cfg.mla_absorb) \
            * self.scale

    def _query_main(self, q_nope: jax.Array) -> jax.Array:
        if not self.cfg.mla_absorb:
            return q_nope
        return self._absorb(q_nope, self.w_uk())

    @staticmethod
    def _absorb(q_nope: jax.Array, w_uk: jax.Array) -> jax.Array:
        """W_UK absorbed into the query: [B, T, N, nope] x [N, C, nope] -> [B, T, N, C]."""
        return jnp.einsum("BTNP,NCP->BTNC", q_nope, w_uk)

    def __call__(self, x: jax.Array, positions: jax.Array, cached: dict | None,
                 cached_positions: jax.Array | None):
        """Attention for one layer; the caller writes the returned chunk into the cache.

        Args:
          x: [B, T, D] inputs.
          positions: [B, T] int32 absolute positions of the T tokens.
          cached: this layer's cache before the chunk, {'c_kv': [B, S, C],
            'k_rope': [B, S, R]}, or None for a cache-free causal forward over the T tokens.
          cached_positions: [B, S] int32 slot positions of each row before the chunk
            (-1: empty).
        Returns:
          (out [B, T, D], {'c_kv': [B, T, C], 'k_rope': [B, T, R]} in the cache's
          representation (:func:`kvjax.cache.encode`)). When 'intermediates' is mutable
          (``model.forward``'s ``observe``) it also sows 'queries' [B, T, 1, N, C + R]:
          the absorbed queries [q_nope·W_UK^T ; q_rope] of either path, MLA as MQA over
          one latent "KV head" whose key is [c_kv ; k_rope] (lever 5's view,
          :mod:`kvjax.cache.compress`).
        """
        c = self.cfg
        absorb = c.mla_absorb
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x, positions)
        c_kv, k_rope = self.latents(x, positions)
        q_main = self._query_main(q_nope)
        w_uk, w_uv = self.w_uk(), self.w_uv()
        if self.is_mutable_collection("intermediates"):
            # Kept only when the caller asks (model.forward's observe): lever 5's methods
            # score the latent slots with the absorbed queries (kvjax.cache.compress).
            q_lat = q_main if absorb else self._absorb(q_nope, w_uk)
            self.sow("intermediates", "queries",
                     jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1)[:, :, None])
        new = cache_lib.encode(c, {"c_kv": c_kv, "k_rope": k_rope})

        call = MLACall(c, q_main, q_rope, new, positions, cached, cached_positions, w_uk,
                       w_uv, self.scale)
        where = decode_kernels.site(c, b, t, 0, cached is not None)
        out = kernels.run(where.op, c.formulation(where), call)  # MLACall's method
        # padded query rows (position -1) output zeros, on every path
        out = jnp.where((positions >= 0)[:, :, None, None], out, 0).astype(c.jnp_dtype)
        if absorb:  # latent output [B, T, N, C] -> per-head values [B, T, N, V]
            out = jnp.einsum("BTNC,NCV->BTNV", out, w_uv)
        return self.wo(out), new
