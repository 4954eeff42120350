"""An independent numpy reference of the decoder LM, written from the formulas (no Flax, no
kvjax attention code): RMSNorm, half-split rotary, grouped-query causal attention with an
optional band (window + sinks), SwiGLU/GELU MLP, tied or untied LM head.

It reads the stacked parameter pytree of ``kvjax.model`` (``scan_layers=True`` layout).
"""

import math

import numpy as np


def rms_norm(x, scale, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rotary(x, positions, theta):
    """x [T, n, H]; pairs i and i + H/2."""
    h = x.shape[-1]
    inv = theta ** (-np.arange(0, h, 2) / h)
    ang = positions[:, None, None] * inv  # [T, 1, H/2]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def band_mask(t, window=None, sinks=0):
    """[T, T] bool: causal, and with a window the last W - s keys plus s sinks."""
    q = np.arange(t)[:, None]
    k = np.arange(t)[None, :]
    mask = k <= q
    if window is not None:
        mask &= (q - k < window - sinks) | (k < sinks)
    return mask


def logits(params, cfg, tokens):
    """Reference logits [T, V] (float64) for one sequence of token ids [T]."""
    p = _np(params)
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    x = p["embed"]["embedding"][np.asarray(tokens)]
    lay = p["layers"]
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    g = n // k
    mask = band_mask(t, cfg.window_size, cfg.num_sink_tokens)
    for i in range(cfg.num_layers):
        y = rms_norm(x, lay["attn_norm"]["scale"][i], cfg.norm_eps)
        a = lay["attn"]
        q = rotary(np.einsum("td,dnh->tnh", y, a["q_proj"]["kernel"][i]), pos, cfg.rope_theta)
        kk = rotary(np.einsum("td,dkh->tkh", y, a["k_proj"]["kernel"][i]), pos, cfg.rope_theta)
        vv = np.einsum("td,dkh->tkh", y, a["v_proj"]["kernel"][i])
        out = np.zeros((t, n, h))
        for head in range(n):
            kv = head // g  # query head n reads KV head n // G
            s = q[:, head] @ kk[:, kv].T / math.sqrt(h)
            s = np.where(mask, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, head] = w @ vv[:, kv]
        x = x + np.einsum("tnh,nhd->td", out, a["o_proj"]["kernel"][i])
        y = rms_norm(x, lay["mlp_norm"]["scale"][i], cfg.norm_eps)
        m = lay["mlp"]
        up = y @ m["up"]["kernel"][i]
        if cfg.mlp_type == "swiglu":
            gate = y @ m["gate"]["kernel"][i]
            hidden = gate / (1 + np.exp(-gate)) * up
        else:
            hidden = 0.5 * up * (1 + np.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)))
        x = x + hidden @ m["down"]["kernel"][i]
    x = rms_norm(x, p["final_norm"]["scale"], cfg.norm_eps)
    if cfg.tie_embeddings:
        return x @ p["embed"]["embedding"].T
    return x @ p["lm_head"]["kernel"]


def _np(tree):
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)
