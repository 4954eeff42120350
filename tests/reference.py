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
    with rope_type 'llama3' or 'linear') says."""
    inv = theta ** (-np.arange(0, h, 2) / h)
    s = dict(scaling or ())
    if s.get("rope_type") == "llama3":
        inv = llama3_frequencies(inv, s["factor"], s["low_freq_factor"],
                                 s["high_freq_factor"], s["original_max_position_embeddings"])
    elif s.get("rope_type") == "linear":  # position interpolation: positions / factor
        inv = inv / s["factor"]
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


def attend(q, k, v, mask, scale=None, softcap=None):
    """Softmax attention of q [T, N, H] over k [S, K, H], v [S, K, Hv] under mask [T, S]
    (or [K, T, S]: one per KV head); query head n reads KV head n // G (G = N / K);
    scores scaled by ``scale`` (default H^-1/2), then soft-capped to
    softcap·tanh(s / softcap) if given. Returns [T, N, Hv]."""
    n, kh = q.shape[1], k.shape[1]
    g = n // kh
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = np.zeros((q.shape[0], n, v.shape[-1]))
    for head in range(n):
        kv = head // g
        s = q[:, head] @ k[:, kv].T * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        s = np.where(mask[kv] if mask.ndim == 3 else mask, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[:, head] = (w / w.sum(-1, keepdims=True)) @ v[:, kv]
    return out


def mlp(y, lay, mlp_type="swiglu"):
    up = y @ lay["up"]
    if mlp_type == "swiglu":
        gate = y @ lay["gate"]
        hidden = gate / (1 + np.exp(-gate)) * up
    elif mlp_type == "geglu":  # GELU's tanh approximation on the gate (Gemma)
        gate = y @ lay["gate"]
        hidden = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi)
                                           * (gate + 0.044715 * gate**3))) * up
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
    qpas = getattr(cfg, "query_pre_attn_scalar", None)
    out = attend(q, k, v, mask, scale=None if qpas is None else qpas ** -0.5,
                 softcap=getattr(cfg, "attn_logit_softcap", None))
    return np.einsum("tnh,nhd->td", out, lay["o"])


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


def decoder_logits(cfg, embed, layers, final_norm, head, tokens, masks=None):
    """Logits [T, V] (float64) of one sequence ``tokens`` [T] at positions 0..T-1.

    Args:
      cfg: anything with num_layers, rope_theta, norm_eps, window_size, num_sink_tokens,
        mlp_type, attention (and MLA's qk_nope_head_dim, qk_rope_head_dim); optionally
        rope_scaling, layer_windows (a window or None per layer), rope_local_theta (the
        base of windowed layers, unscaled), embed_scale (x·sqrt(D)),
        query_pre_attn_scalar, attn_logit_softcap, final_logit_softcap.
      embed [V, D]; head [D, V]; final_norm [D].
      layers: iterable of per-layer dicts: attn_norm, mlp_norm, attn (see
        :func:`gqa_attention` / :func:`mla_attention`), mlp {gate, up, down} as [in, out],
        and optionally post_attn_norm / post_mlp_norm (Gemma 2 / 3), applied to the
        attention and MLP outputs before the residual sums.
      masks: per layer a [T, T] (or per KV head [K, T, T]) bool mask replacing the
        causal band (None: :func:`band_mask`).
    """
    t = len(tokens)
    pos = np.arange(t)
    windows = getattr(cfg, "layer_windows", None) or [cfg.window_size] * cfg.num_layers
    attention = mla_attention if cfg.attention == "mla" else gqa_attention
    x = np.asarray(embed[np.asarray(tokens)], np.float64)
    if getattr(cfg, "embed_scale", False):
        x = x * math.sqrt(x.shape[-1])
    eps = cfg.norm_eps
    for i, lay in enumerate(layers):
        w = windows[i]
        local = w is not None and getattr(cfg, "rope_local_theta", None) is not None
        lc = types.SimpleNamespace(**{k: getattr(cfg, k, None) for k in (
            "norm_eps", "query_pre_attn_scalar", "attn_logit_softcap", "qk_nope_head_dim",
            "qk_rope_head_dim")})
        lc.rope_theta = cfg.rope_local_theta if local else cfg.rope_theta
        lc.rope_scaling = None if local else getattr(cfg, "rope_scaling", None)
        mask = band_mask(pos, pos, w, cfg.num_sink_tokens) if masks is None else masks[i]
        a = attention(rms_norm(x, lay["attn_norm"], eps), lay["attn"], lc, pos, mask)
        if "post_attn_norm" in lay:
            a = rms_norm(a, lay["post_attn_norm"], eps)
        x = x + a
        m = mlp(rms_norm(x, lay["mlp_norm"], eps), lay["mlp"], cfg.mlp_type)
        if "post_mlp_norm" in lay:
            m = rms_norm(m, lay["post_mlp_norm"], eps)
        x = x + m
    out = rms_norm(x, final_norm, eps) @ head
    cap = getattr(cfg, "final_logit_softcap", None)
    return out if cap is None else cap * np.tanh(out / cap)


# ------------------------------------------------------------------ adapters


def logits(params, cfg, tokens, masks=None):
    """Reference logits [T, V] (float64) of kvjax's stacked parameter pytree
    (``scan_layers=True`` layout) for one sequence of token ids [T]; ``masks`` as
    :func:`decoder_logits`."""
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
        out = {"attn_norm": lay["attn_norm"]["scale"][i],
               "mlp_norm": lay["mlp_norm"]["scale"][i],
               "attn": attn, "mlp": kernels(lay["mlp"], i)}
        out.update({n: lay[n]["scale"][i] for n in ("post_attn_norm", "post_mlp_norm")
                    if n in lay})
        return out

    embed = p["embed"]["embedding"]
    head = embed.T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return decoder_logits(cfg, embed, (layer(i) for i in range(cfg.num_layers)),
                          p["final_norm"]["scale"], head, tokens, masks)


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
                                mlp_type="swiglu", attention="gqa",
                                num_layers=hp["num_layers"])

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


def gemma_logits(config, w, ids):
    """Reference logits [T, V] (float64) of a Gemma 2 / 3 checkpoint read straight from
    its config.json dict ``config`` and its raw weights ``w`` (HF orientation under
    kvjax's names: embed, final_norm, per layer attn_norm = input_layernorm,
    post_attn_norm = post_attention_layernorm, mlp_norm = pre_feedforward_layernorm,
    post_mlp_norm = post_feedforward_layernorm, wq ... w_down, and Gemma 3's q_norm /
    k_norm), as transformers' Gemma2/Gemma3 modelling code computes them: every RMSNorm
    multiplies by (1 + w); embeddings times sqrt(D); GeGLU; scores scaled by
    query_pre_attn_scalar^-1/2 and soft-capped (Gemma 2); sliding layers (Gemma 2: even
    layers; Gemma 3: all but every sliding_window_pattern-th, or ``layer_types``) see
    the last sliding_window positions and, in Gemma 3, rotate with rope_local_base_freq
    unscaled; final logits soft-capped (Gemma 2)."""
    gemma3 = config["architectures"][0].startswith("Gemma3")
    n_layers = config["num_hidden_layers"]
    kinds = config.get("layer_types")
    if kinds is None:
        every = config.get("sliding_window_pattern", 6) if gemma3 else 2
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(n_layers)]
    windows = [config["sliding_window"] if k == "sliding_attention" else None for k in kinds]
    scaling = config.get("rope_scaling")
    cfg = types.SimpleNamespace(
        num_layers=n_layers, rope_theta=config["rope_theta"], norm_eps=config["rms_norm_eps"],
        rope_scaling=None if not scaling else scaling, window_size=None, num_sink_tokens=0,
        layer_windows=windows, mlp_type="geglu", attention="gqa", embed_scale=True,
        rope_local_theta=config.get("rope_local_base_freq") if gemma3 else None,
        query_pre_attn_scalar=config["query_pre_attn_scalar"],
        attn_logit_softcap=config.get("attn_logit_softcapping"),
        final_logit_softcap=config.get("final_logit_softcapping"))
    n, k, h, d = (config[x] for x in ("num_attention_heads", "num_key_value_heads",
                                       "head_dim", "hidden_size"))

    def layer(i):
        attn = {"q": w["wq"][i].T.reshape(d, n, h), "k": w["wk"][i].T.reshape(d, k, h),
                "v": w["wv"][i].T.reshape(d, k, h), "o": w["wo"][i].T.reshape(n, h, d)}
        if gemma3:
            attn.update(q_norm=1 + w["q_norm"][i], k_norm=1 + w["k_norm"][i])
        out = {name: 1 + w[name][i] for name in ("attn_norm", "post_attn_norm", "mlp_norm",
                                                 "post_mlp_norm")}
        out.update(attn=attn, mlp={"gate": w["w_gate"][i].T, "up": w["w_up"][i].T,
                                   "down": w["w_down"][i].T})
        return out

    embed = np.asarray(w["embed"], np.float64)
    return decoder_logits(cfg, embed, (layer(i) for i in range(n_layers)),
                          1 + np.asarray(w["final_norm"], np.float64), embed.T, ids)


def yarn_frequencies(dim, base, factor, original, beta_fast=32, beta_slow=1):
    """DeepSeek-V2's YaRN inverse frequencies [dim/2] (``DeepseekV2YarnRotaryEmbedding``,
    Peng et al. 2023 sec. 3.2): dims between the corrections of beta_fast and beta_slow
    rotations over ``original`` positions ramp from kept to divided by ``factor``."""
    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    extra = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    inter = extra / factor
    mask = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return inter * (1 - mask) + extra * mask


def yarn_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rotary_interleaved(x, positions, inv, amplitude=1.0):
    """x [T, n, R] rotated with pairs (2i, 2i + 1) at frequency inv[i] (DeepSeek's layout:
    its apply_rotary_pos_emb regroups them before rotate_half), cos/sin times
    ``amplitude``."""
    ang = np.asarray(positions, np.float64)[:, None, None] * inv  # [T, 1, R/2]
    c, s = np.cos(ang) * amplitude, np.sin(ang) * amplitude
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out


def moe(y, lay, config):
    """DeepSeek's MoE MLP by a dense loop over experts: softmax router scores, top-k
    (group-limited with topk_method 'group_limited_greedy'), weights renormalised
    (norm_topk_prob) or times routed_scaling_factor, plus the shared experts."""
    def swiglu(x, pre):
        g = x @ lay[f"{pre}.gate_proj.weight"].T
        return (g / (1 + np.exp(-g)) * (x @ lay[f"{pre}.up_proj.weight"].T)) \
            @ lay[f"{pre}.down_proj.weight"].T

    logits = y @ lay["mlp.gate.weight"].T  # [T, E]
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    k, e = config["num_experts_per_tok"], scores.shape[-1]
    out = np.zeros_like(y)
    for t in range(y.shape[0]):
        s = scores[t].copy()
        if config.get("topk_method") == "group_limited_greedy":
            g = config["n_group"]
            best = s.reshape(g, -1).max(-1)
            keep = np.zeros(g, bool)
            keep[np.argsort(-best)[:config["topk_group"]]] = True
            s = np.where(np.repeat(keep, e // g), s, 0.0)
        top = np.argsort(-s)[:k]
        w = s[top]
        if k > 1 and config.get("norm_topk_prob"):
            w = w / (w.sum() + 1e-20)
        else:
            w = w * config.get("routed_scaling_factor", 1.0)
        for j, wj in zip(top, w):
            out[t] += wj * swiglu(y[t:t + 1], f"mlp.experts.{j}")[0]
    if config.get("n_shared_experts"):
        out += swiglu(y, "mlp.shared_experts")
    return out


def deepseek_logits(config, layers, embed, final_norm, lm_head, ids):
    """Reference logits [T, V] (float64) of a DeepSeek-V2 checkpoint from its config.json
    dict and raw HF tensors (``layers``: per-layer dicts under the names after
    "model.layers.{i}."), as DeepSeek's modelling code computes them: MLA by the naive
    math (q from q_proj or q_a_proj -> q_a_layernorm -> q_b_proj; [c ; k_pe] from
    kv_a_proj_with_mqa, c normalised by kv_a_layernorm, k_nope and v from kv_b_proj),
    interleaved rotary with yarn frequencies and amplitude, softmax scale
    (nope + R)^-1/2 · mscale(factor, mscale_all_dim)^2, dense MLPs on the first
    first_k_dense_replace layers and :func:`moe` after."""
    n, eps = config["num_attention_heads"], config["rms_norm_eps"]
    p, r, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    c = config["kv_lora_rank"]
    scaling = config.get("rope_scaling") or {}
    inv = config["rope_theta"] ** (-np.arange(0, r, 2) / r)
    scale, amplitude = (p + r) ** -0.5, 1.0
    if scaling.get("type", scaling.get("rope_type")) == "yarn":
        f = scaling["factor"]
        inv = yarn_frequencies(r, config["rope_theta"], f,
                               scaling["original_max_position_embeddings"],
                               scaling.get("beta_fast", 32), scaling.get("beta_slow", 1))
        amplitude = yarn_mscale(f, scaling.get("mscale", 1)) / yarn_mscale(
            f, scaling.get("mscale_all_dim", 0))
        if scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(f, scaling["mscale_all_dim"]) ** 2
    pos = np.arange(len(ids))
    mask = band_mask(pos, pos)
    x = np.asarray(embed, np.float64)[np.asarray(ids)]
    for i, lay in enumerate(layers):
        lay = {k: np.asarray(a, np.float64) for k, a in lay.items()}
        y = rms_norm(x, lay["input_layernorm.weight"], eps)
        if "self_attn.q_proj.weight" in lay:
            q = y @ lay["self_attn.q_proj.weight"].T
        else:
            q = rms_norm(y @ lay["self_attn.q_a_proj.weight"].T,
                         lay["self_attn.q_a_layernorm.weight"], eps) \
                @ lay["self_attn.q_b_proj.weight"].T
        q = q.reshape(len(ids), n, p + r)
        q = np.concatenate([q[..., :p], rotary_interleaved(q[..., p:], pos, inv, amplitude)],
                           -1)
        ckv = y @ lay["self_attn.kv_a_proj_with_mqa.weight"].T
        latent = rms_norm(ckv[:, :c], lay["self_attn.kv_a_layernorm.weight"], eps)
        k_pe = rotary_interleaved(ckv[:, None, c:], pos, inv, amplitude)  # [T, 1, R]
        kv = (latent @ lay["self_attn.kv_b_proj.weight"].T).reshape(len(ids), n, p + v)
        k = np.concatenate([kv[..., :p], np.repeat(k_pe, n, axis=1)], -1)
        out = attend(q, k, kv[..., p:], mask, scale=scale)
        x = x + out.reshape(len(ids), n * v) @ lay["self_attn.o_proj.weight"].T
        y = rms_norm(x, lay["post_attention_layernorm.weight"], eps)
        if "mlp.gate.weight" in lay:
            x = x + moe(y, lay, config)
        else:
            g = y @ lay["mlp.gate_proj.weight"].T
            x = x + (g / (1 + np.exp(-g)) * (y @ lay["mlp.up_proj.weight"].T)) \
                @ lay["mlp.down_proj.weight"].T
    return rms_norm(x, final_norm, eps) @ np.asarray(lm_head, np.float64).T
