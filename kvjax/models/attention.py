"""Multi-head attention with grouped KV heads (MHA / GQA / MQA) and an optional window.

One module covers the blog's lever 1: ``num_kv_heads`` K = N is MHA, K = 1 is MQA
(Shazeer 2019), anything dividing N is GQA (Ainslie et al. 2023). Query head n reads KV
head n // G with G = N // K (the heads of one group are adjacent). ``window_size`` is
lever 3 (a ring-buffer cache of W slots, optional attention sinks).

Scores and softmax are computed in float32 whatever the parameter/cache dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kvjax import cache as cache_lib
from kvjax.config import ModelConfig
from kvjax.models import flash
from kvjax.models.layers import Einsum, apply_rope

NEG_INF = -1e30


def _spec(layout: str, width: str = "H") -> str:
    """einsum letters of one layer's keys/values in ``layout`` ('BKSH' or 'BKHS')."""
    if layout not in ("BKSH", "BKHS"):
        raise ValueError(f"layout={layout!r}; allowed: 'BKSH' or 'BKHS'")
    return "BKS" + width if layout == "BKSH" else "BK" + width + "S"


def dot_operand(x: jax.Array) -> jax.Array:
    """``x`` as a dot operand with a float32 result: on CPU, 2-byte floats are widened to
    float32 first (exact). XLA:CPU rejects some batched bf16 x bf16 -> f32 dots
    ("Unsupported element type for DotThunk::Execute", jaxlib 0.10.2, e.g. a prefill
    with B = 2, K = 2) and widens the operands itself for the others, so the bytes and
    the result are those XLA:CPU would produce anyway. Other backends: unchanged."""
    if x.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu":
        return x.astype(jnp.float32)
    return x


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
           k_layout: str = "BKSH", v_layout: str = "BKSH") -> jax.Array:
    """Softmax attention of grouped queries over one layer's keys and values.

    Args:
      q: [B, T, K, G, H] queries (already rotated).
      k: [B, K, S, H] keys ('BKSH'), or [B, K, H, S] with ``k_layout='BKHS'``.
      v: [B, K, S, Hv] values ('BKSH'), or [B, K, Hv, S] with ``v_layout='BKHS'``.
      mask: [B, T, S] bool, True where the key is visible.
      k_layout, v_layout: 'BKSH' or 'BKHS' (see ``kvjax.config.default_kv_layout``).
    Returns:
      [B, T, K, G, Hv] in v's dtype. Scores and softmax run in float32; the probabilities
      are cast to v's dtype for the value product, which accumulates in float32.
    Raises:
      ValueError: an unknown layout.
    """
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum(f"BTKGH,{_spec(k_layout)}->BKGTS", dot_operand(q), dot_operand(k),
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(f"BKGTS,{_spec(v_layout, 'V')}->BTKGV",
                     dot_operand(probs.astype(v.dtype)), dot_operand(v),
                     preferred_element_type=jnp.float32)
    return out.astype(v.dtype)


def attend_step(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, mask: jax.Array,
                k_new: jax.Array, v_new: jax.Array, k_layout: str = "BKSH",
                v_layout: str = "BKSH") -> jax.Array:
    """One decode step (T = 1): attention over the cache's old slots plus the new token.

    Same math as :func:`attend` over ``concat(k_cache, k_new)`` without materialising the
    concatenation (which would copy the whole cache every step): one softmax over the
    old scores and the new token's score. The cache is read before the new token is
    written, so the write can update the (donated) buffer in place.

    Args:
      q: [B, 1, K, G, H] the new token's queries.
      k_cache, v_cache: this layer's cache before the write, [B, K, S, H] / [B, K, S, Hv]
        ('BKSH') or [B, K, H, S] / [B, K, Hv, S] ('BKHS').
      mask: [B, 1, S] bool, visible old slots.
      k_new, v_new: the new token's key and value in the same layouts (S -> 1).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
    Returns:
      [B, 1, K, G, Hv] in v_cache's dtype; scores and softmax in float32.
    Raises:
      ValueError: an unknown layout.
    """
    scale = q.shape[-1] ** -0.5
    q1 = q[:, 0]  # [B, K, G, H]
    s_old = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", q1, k_cache,
                       preferred_element_type=jnp.float32) * scale
    s_old = jnp.where(mask[:, :, None, :], s_old, NEG_INF)
    k1 = k_new[:, :, 0] if k_layout == "BKSH" else k_new[..., 0]  # [B, K, H]
    v1 = v_new[:, :, 0] if v_layout == "BKSH" else v_new[..., 0]  # [B, K, Hv]
    s_new = jnp.einsum("BKGH,BKH->BKG", q1, k1,
                       preferred_element_type=jnp.float32)[..., None] * scale
    m = jnp.maximum(jnp.max(s_old, axis=-1, keepdims=True), s_new)  # [B, K, G, 1]
    # Unnormalised weights; the softmax denominator divides the [.., Hv] output instead
    # of the [.., S] weights (one pass less over the scores).
    e_old = jnp.exp(s_old - m).astype(v_cache.dtype)
    e_new = jnp.exp(s_new - m)
    denom = jnp.sum(e_old.astype(jnp.float32), axis=-1, keepdims=True) + e_new
    out = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", e_old, v_cache,
                     preferred_element_type=jnp.float32)
    out = out + e_new * v1[:, :, None, :].astype(jnp.float32)
    out = out / denom  # [B, K, G, Hv]
    return out[:, None].astype(v_cache.dtype)


class Attention(nn.Module):
    """Grouped-query attention layer with a functional KV cache.

    Parameters: q_proj [D, N, H], k_proj [D, K, H], v_proj [D, K, H], o_proj [N, H, D].
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, cached: dict | None,
                 cached_positions: jax.Array | None):
        """Attention for one layer; the caller writes the returned chunk into the cache.

        Args:
          x: [B, T, D] inputs.
          positions: [B, T] int32 absolute positions of the T tokens.
          cached: this layer's cache before the chunk, {'k': [B, K, S, H], 'v': ...} in
            the layouts of ``cfg.cache_layout`` (S and H swapped for 'BKHS'), or None for
            a cache-free causal forward over the T tokens.
          cached_positions: [S] int32 slot positions before the chunk (-1: empty).
        Returns:
          (out [B, T, D], {'k': [B, K, T, H], 'v': [B, K, T, H]} in the cache dtype and
          the cache layouts: T and H swapped for 'BKHS').
        """
        c = self.cfg
        dt = c.jnp_dtype
        b, t, _ = x.shape
        n, k, h, g = c.num_heads, c.num_kv_heads, c.head_dim, c.num_groups
        q = Einsum((c.d_model, n, h), "BTD,DNH->BTNH", dt, name="q_proj")(x)
        kk = Einsum((c.d_model, k, h), "BTD,DKH->BTKH", dt, name="k_proj")(x)
        vv = Einsum((c.d_model, k, h), "BTD,DKH->BTKH", dt, name="v_proj")(x)
        q = apply_rope(q, positions, c.rope_theta).reshape(b, t, k, g, h)
        kk = jnp.swapaxes(apply_rope(kk, positions, c.rope_theta), 1, 2)  # [B, K, T, H]
        vv = jnp.swapaxes(vv, 1, 2)

        k_layout, v_layout = c.cache_layout("k"), c.cache_layout("v")
        tiled = dict(window_size=c.window_size, num_sink_tokens=c.num_sink_tokens,
                     block_q=c.prefill_block_q, block_k=c.prefill_block_k)
        if cached is None:
            if c.prefill_impl == "tiled":
                kk, vv = cache_lib.to_layout(kk, c, "k"), cache_lib.to_layout(vv, c, "v")
                out = flash.attend_chunk(q, kk, vv, positions, k_layout=k_layout,
                                         v_layout=v_layout, **tiled)
            else:
                out = attend(q, kk, vv, cache_lib.attention_mask(positions, positions, c))
                kk, vv = cache_lib.to_layout(kk, c, "k"), cache_lib.to_layout(vv, c, "v")
        else:
            # Attend over (old slots ++ this chunk); the caller writes afterwards. Reading
            # before writing keeps the in-place update copy-free, and in a ring buffer the
            # chunk's writes may evict keys that its earlier queries still see.
            k_old, v_old = cached["k"], cached["v"]
            kk = cache_lib.to_layout(kk.astype(k_old.dtype), c, "k")
            vv = cache_lib.to_layout(vv.astype(v_old.dtype), c, "v")
            mask_old = cache_lib.attention_mask(positions, cached_positions, c)
            if t == 1:
                out = attend_step(q, k_old, v_old, mask_old, kk, vv, k_layout, v_layout)
            elif c.prefill_impl == "tiled":
                out = flash.attend_chunk(q, kk, vv, positions, k_old=k_old, v_old=v_old,
                                         old_positions=cached_positions,
                                         k_layout=k_layout, v_layout=v_layout, **tiled)
            else:
                mask_new = cache_lib.attention_mask(positions, positions, c)
                out = attend(q,
                             jnp.concatenate([k_old, kk], axis=cache_lib.slot_axis(c, "k")),
                             jnp.concatenate([v_old, vv], axis=cache_lib.slot_axis(c, "v")),
                             jnp.concatenate([mask_old, mask_new], axis=2),
                             k_layout, v_layout)

        out = Einsum((n, h, c.d_model), "BTF,FD->BTD", dt, merge_in=2, name="o_proj")(
            out.reshape(b, t, n, h))
        return out, {"k": kk, "v": vv}
