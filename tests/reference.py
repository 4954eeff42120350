"""The one independent numpy reference of the decoder LM: float64, written from the
formulas, no Flax and no kvjax model code (nothing from ``kvjax.models``).

RMSNorm, half-split rotary, causal attention over plain ``[T, K, H]`` arrays (MHA/GQA/MQA:
query head n reads KV head n // G; optional q/k/v biases, Qwen2) with an optional band (window + sinks) computed from
absolute positions, MLA by the naive math (keys and values rebuilt from the latent),
SwiGLU/GELU MLP, tied or untied LM head.

Cache layouts never change the math, so the reference has none: the tests convert kvjax's
parameters (:func:`logits`, the stacked ``scan_layers=True`` pytree) or a GGUF checkpoint
(:func:`llama_logits`, HF orientation) into plain per-layer arrays.
"""

import math
import types

import numpy as np


def rms_norm(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def llama3_frequencies(freqs, factor, low_freq_factor, high_freq_factor,
                       original_max_position_embeddings):
    """Llama 3.1's scaled rotary frequencies, as Meta's reference ``apply_scaling``
    (meta-llama/llama-models, ``llama/model.py``) writes them: one frequency at a time."""
    old = original_max_position_embeddings
    low_wavelen, high_wavelen = old / low_freq_factor, old / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def frequencies(h, theta, scaling=None):
    """[H/2] inverse frequencies theta^(-2i/H), scaled as ``scaling`` (a dict or pairs
    with rope_type 'llama3') says."""
    inv = theta ** (-np.arange(0, h, 2) / h)
    s = dict(scaling or ())
    if s.get("rope_type") == "llama3":
        inv = llama3_frequencies(inv, s["factor"], s["low_freq_factor"],
                                 s["high_freq_factor"], s["original_max_position_embeddings"])
    return inv


def rotary(x, positions, theta, scaling=None):
    """x [T, n, H] rotated at ``positions`` [T]; pairs i and i + H/2."""
    h = x.shape[-1]
    inv = frequencies(h, theta, scaling)
    ang = np.asarray(positions, np.float64)[:, None, None] * inv  # [T, 1, H/2]
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang),
                           x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def band_mask(q_pos, k_pos, window=None, sinks=0):
    """[Tq, Tk] bool visibility from absolute positions: causal, and with a window the
    last W - s positions (the query's own included) or one of the s sinks (positions
    0..s-1)."""
    q = np.asarray(q_pos)[:, None]
    k = np.asarray(k_pos)[None, :]
    mask = k <= q
    if window is not None:
        mask &= (q - k < window - sinks) | (k < sinks)
    return mask


def attend(q, k, v, mask, scale=None):
    """Softmax attention of q [T, N, H] over k [S, K, H], v [S, K, Hv] under mask [T, S];
    query head n reads KV head n // G (G = N / K). Returns [T, N, Hv]."""
    n, kh = q.shape[1], k.shape[1]
    g = n // kh
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = np.zeros((q.shape[0], n, v.shape[-1]))
    for head in range(n):
        kv = head // g
        s = np.where(mask, q[:, head] @ k[:, kv].T * scale, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    return out


def mlp(y, lay, mlp_type="swiglu"):
    up = y @ lay["up"]
    if mlp_type == "swiglu":
        gate = y @ lay["gate"]
        hidden = gate / (1 + np.exp(-gate)) * up
    else:
        hidden = 0.5 * up * (1 + np.tanh(math.sqrt(2 / math.pi) * (up + 0.044715 * up**3)))
    return hidden @ lay["down"]


def gqa_attention(y, lay, cfg, pos, mask):
    """One MHA/GQA/MQA layer's attention: lay has q [D, N, H], k, v [D, K, H], o [N, H, D]
    and optionally the biases q_bias [N, H], k_bias, v_bias [K, H] (Qwen2), added to the
    projections before the rotary embedding, and the per-head norm scales q_norm, k_norm
    [H] (Qwen3), applied after them."""
    def proj(x):
        out = np.einsum("td,dnh->tnh", y, lay[x])
        return out + lay[f"{x}_bias"] if f"{x}_bias" in lay else out

    scaling = getattr(cfg, "rope_scaling", None)
    q, k = proj("q"), proj("k")
    if "q_norm" in lay:  # Qwen3: an RMSNorm over each head's H values, before rotary
        q, k = rms_norm(q, lay["q_norm"], cfg.norm_eps), rms_norm(k, lay["k_norm"], cfg.norm_eps)
    q = rotary(q, pos, cfg.rope_theta, scaling)
    k = rotary(k, pos, cfg.rope_theta, scaling)
    v = proj("v")
    return np.einsum("tnh,nhd->td", attend(q, k, v, mask), lay["o"])


def mla_attention(y, lay, cfg, pos, mask):
    """One MLA layer by the naive math: per-head keys [c·W_UK[n] ; k_rope] and values
    c·W_UV[n] rebuilt from the latent c = RMSNorm(y·W_DKV), scale 1/sqrt(nope + R)."""
    nope = cfg.qk_nope_head_dim
    if "w_q" in lay:
        q = np.einsum("td,dnh->tnh", y, lay["w_q"])
    else:
        q = np.einsum("tq,qnh->tnh", rms_norm(y @ lay["w_dq"], lay["q_norm"], cfg.norm_eps),
                      lay["w_uq"])
    q = np.concatenate([q[..., :nope], rotary(q[..., nope:], pos, cfg.rope_theta)], -1)
    c = rms_norm(y @ lay["w_dkv"], lay["kv_norm"], cfg.norm_eps)  # [T, C]
    k_rope = rotary((y @ lay["w_kr"])[:, None, :], pos, cfg.rope_theta)  # [T, 1, R]
    k_nope = np.einsum("tc,ncp->tnp", c, lay["w_uk"])
    n = k_nope.shape[1]
    k = np.concatenate([k_nope, np.repeat(k_rope, n, axis=1)], -1)
    v = np.einsum("tc,ncv->tnv", c, lay["w_uv"])
    out = attend(q, k, v, mask, scale=1 / math.sqrt(nope + cfg.qk_rope_head_dim))
    return np.einsum("tnv,nvd->td", out, lay["wo"])


def decoder_logits(cfg, embed, layers, final_norm, head, tokens):
    """Logits [T, V] (float64) of one sequence ``tokens`` [T] at positions 0..T-1.

    Args:
      cfg: anything with num_layers, rope_theta, norm_eps, window_size, num_sink_tokens,
        mlp_type, attention (and MLA's qk_nope_head_dim, qk_rope_head_dim).
      embed [V, D]; head [D, V]; final_norm [D].
      layers: iterable of per-layer dicts: attn_norm, mlp_norm, attn (see
        :func:`gqa_attention` / :func:`mla_attention`), mlp {gate, up, down} as [in, out].
    """
    t = len(tokens)
    pos = np.arange(t)
    mask = band_mask(pos, pos, cfg.window_size, cfg.num_sink_tokens)
    attention = mla_attention if cfg.attention == "mla" else gqa_attention
    x = np.asarray(embed[np.asarray(tokens)], np.float64)
    for lay in layers:
        x = x + attention(rms_norm(x, lay["attn_norm"], cfg.norm_eps), lay["attn"], cfg,
                          pos, mask)
        x = x + mlp(rms_norm(x, lay["mlp_norm"], cfg.norm_eps), lay["mlp"], cfg.mlp_type)
    return rms_norm(x, final_norm, cfg.norm_eps) @ head


# ------------------------------------------------------------------ adapters


def logits(params, cfg, tokens):
    """Reference logits [T, V] (float64) of kvjax's stacked parameter pytree
    (``scan_layers=True`` layout) for one sequence of token ids [T]."""
    p = _np(params)
    lay = p["layers"]

    def kernels(tree, i):
        return {name: (w["kernel"] if "kernel" in w else w["scale"])[i]
                for name, w in tree.items()}

    def layer(i):
        if cfg.attention == "mla":
            attn = kernels(lay["attn"], i)
        else:
            a = lay["attn"]
            attn = {x: a[f"{x}_proj"]["kernel"][i] for x in "qkvo"}
            attn.update({f"{x}_bias": a[f"{x}_proj"]["bias"][i] for x in "qkv"
                         if "bias" in a[f"{x}_proj"]})
            attn.update({n: a[n]["scale"][i] for n in ("q_norm", "k_norm") if n in a})
        return {"attn_norm": lay["attn_norm"]["scale"][i],
                "mlp_norm": lay["mlp_norm"]["scale"][i],
                "attn": attn, "mlp": kernels(lay["mlp"], i)}

    embed = p["embed"]["embedding"]
    head = embed.T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return decoder_logits(cfg, embed, (layer(i) for i in range(cfg.num_layers)),
                          p["final_norm"]["scale"], head, tokens)


def llama_logits(ckpt, ids):
    """Reference logits [T, V] (float64) of a full causal forward of a llama-family
    checkpoint (``kvjax.checkpoints.LlamaGGUF`` from a GGUF or a Hugging Face folder: HF
    orientation, Q/K rows in half-split order; optional q/k/v biases ``bq``/``bk``/``bv``,
    an untied ``lm_head``, a sliding window ``hparams['window_size']`` and a rope scaling
    ``hparams['rope_scaling']``)."""
    hp, t = ckpt.hparams, ckpt.tensors
    n, k, h, d = hp["num_heads"], hp["num_kv_heads"], hp["head_dim"], hp["d_model"]
    cfg = types.SimpleNamespace(rope_theta=hp["rope_theta"], norm_eps=hp["norm_eps"],
                                rope_scaling=hp.get("rope_scaling"),
                                window_size=hp.get("window_size"), num_sink_tokens=0,
                                mlp_type="swiglu", attention="gqa")

    def layer(i):  # rows [out, in] -> [in, out], lazily: one layer's weights at a time
        attn = {"q": t["wq"][i].T.reshape(d, n, h), "k": t["wk"][i].T.reshape(d, k, h),
                "v": t["wv"][i].T.reshape(d, k, h), "o": t["wo"][i].T.reshape(n, h, d)}
        for x, heads in (("q", n), ("k", k), ("v", k)):
            if f"b{x}" in t:
                attn[f"{x}_bias"] = t[f"b{x}"][i].reshape(heads, h)
        if "q_norm" in t:
            attn.update(q_norm=t["q_norm"][i], k_norm=t["k_norm"][i])
        return {"attn_norm": t["attn_norm"][i], "mlp_norm": t["mlp_norm"][i], "attn": attn,
                "mlp": {"gate": t["w_gate"][i].T, "up": t["w_up"][i].T, "down": t["w_down"][i].T}}

    return decoder_logits(cfg, t["embed"], (layer(i) for i in range(hp["num_layers"])),
                          t["final_norm"], t.get("lm_head", t["embed"]).T, ids)


def _np(tree):
    if isinstance(tree, dict):
        return {k: _np(v) for k, v in tree.items()}
    return np.asarray(tree, dtype=np.float64)
