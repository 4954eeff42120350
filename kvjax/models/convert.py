"""Pretrained weights -> kvjax parameters, and conversions between attention variants.

* :func:`params_from_gguf`: SmolLM2 (llama) GGUF tensors in HF layout -> the stacked
  parameter pytree of :class:`kvjax.model.DecoderLM`.
* :func:`convert_kv_heads`: change the number of KV heads of trained weights. Duplicating
  each KV head across its group (K -> K·r) is exact: the model computes the same function
  with r times the KV cache (MHA from GQA). Mean-pooling r adjacent heads (K -> K/r) is the
  conversion of Ainslie et al. 2023 ("GQA", sec. 2.1, mean pooling of the head projection
  matrices); it changes the function, which is the quality price of fewer KV heads.
"""

from __future__ import annotations

import jax
import numpy as np

from kvjax.config import ModelConfig
from kvjax.models import layers
from kvjax.models import model as model_lib


# ModelConfig field -> the GGUF metadata key it must agree with (llama architecture).
CHECKPOINT_FIELDS = {
    "vocab_size": "llama.vocab_size (or the tokenizer's token count)",
    "num_layers": "llama.block_count",
    "d_model": "llama.embedding_length",
    "num_heads": "llama.attention.head_count",
    "head_dim": "llama.attention.key_length (or embedding_length / head_count)",
    "mlp_dim": "llama.feed_forward_length",
    "rope_theta": "llama.rope.freq_base",
    "norm_eps": "llama.attention.layer_norm_rms_epsilon",
    "tie_embeddings": "no output.weight tensor (the LM head is the embedding)",
    "num_kv_heads": "llama.attention.head_count_kv",
    "qkv_bias": "attn_q/k/v.bias tensors (general.architecture 'qwen2')",
}


def _same(field: str, ours, theirs) -> bool:
    if field in ("rope_theta", "norm_eps"):
        # GGUF stores float32: 1e-5 is read back as 9.99999975e-06.
        return bool(np.float32(ours) == np.float32(theirs))
    return ours == theirs


def check_compatible(cfg: ModelConfig, hparams: dict, keys: dict | None = None) -> None:
    """Raises ValueError naming the first field where cfg disagrees with the checkpoint.

    Every hyper-parameter the file states must match: vocabulary, layers, widths, query
    heads, head and FFN widths, rotary base and RMSNorm epsilon (compared at float32,
    the file's precision) and whether the LM head is tied. ``num_kv_heads`` may differ
    when it is a multiple or a divisor of the file's (see :func:`convert_kv_heads`).
    Call it with the metadata alone (``checkpoints.gguf_reader.read_llama_hparams`` or
    ``read_llama_gguf(check=...)``), before any tensor is dequantised.

    Args:
      cfg: the model config.
      hparams: ``LlamaGGUF.hparams`` (or a Hugging Face checkpoint's, which adds
        ``qkv_bias``).
      keys: field -> the checkpoint key it comes from, for the messages (default
        :data:`CHECKPOINT_FIELDS`, GGUF's; ``kvjax.checkpoints.hf.CONFIG_KEYS``).
    Raises:
      ValueError: "model.<field>=<config value> does not match the checkpoint's <value>
        (<checkpoint key>); allowed with these weights: <value>".
    """
    if keys is None:  # GGUF's keys, under the file's architecture ('llama.', 'qwen2.')
        arch = hparams.get("architecture", "llama")
        keys = {f: k.replace("llama.", f"{arch}.") for f, k in CHECKPOINT_FIELDS.items()}
    for f, key in keys.items():
        if f not in hparams or f == "num_kv_heads" or (
                f == "attention" and "mla" not in (cfg.attention, hparams[f])):
            continue  # mha / gqa / mqa: lever 1 on the same weights
        ours, theirs = getattr(cfg, f), hparams[f]
        if not _same(f, ours, theirs):
            raise ValueError(
                f"model.{f}={ours!r} does not match the checkpoint's {theirs!r} ({key}); "
                f"allowed with these weights: {theirs!r}")
    k, k_file = cfg.num_kv_heads, hparams["num_kv_heads"]
    if k % k_file and k_file % k:
        raise ValueError(
            f"model.num_kv_heads={k} cannot be made from the checkpoint's {k_file} KV heads "
            f"({keys['num_kv_heads']}); allowed: a multiple or a divisor of {k_file}")
    if cfg.mlp_type not in ("swiglu", "geglu") or (
            cfg.attention == "mla") != (hparams.get("attention") == "mla"):
        raise ValueError(
            f"model.mlp_type={cfg.mlp_type!r}, attention={cfg.attention!r}: the llama "
            "checkpoint needs mlp_type='swiglu' (Gemma: 'geglu') and attention in "
            "mha/gqa/mqa (DeepSeek-V2: 'mla')")


def params_from_gguf(tensors: dict, num_heads: int, num_kv_heads: int, head_dim: int,
                     tied: bool = True) -> dict:
    """HF-layout llama tensors -> stacked DecoderLM params (numpy, dtype kept).

    Args:
      tensors: ``LlamaGGUF.tensors`` (embed [V, D], wq [L, N·H, D], wk/wv [L, K·H, D],
        wo [L, D, N·H], w_gate/w_up [L, F, D], w_down [L, D, F], norms).
      num_heads, num_kv_heads, head_dim: N, K, H of the checkpoint.
      tied: LM head shares the embedding (SmolLM2); else ``tensors['lm_head']`` [V, D].
        Optional ``bq`` [L, N·H], ``bk``/``bv`` [L, K·H]: q/k/v biases (Qwen2), which
        become the projections' 'bias' [L, N, H] / [L, K, H]; ``q_norm``/``k_norm``
        [L, H]: the per-head norm scales (Qwen3, Gemma 3), 'q_norm'/'k_norm' 'scale';
        ``post_attn_norm``/``post_mlp_norm`` [L, D]: Gemma's post-norms.
    Returns:
      The parameter pytree with a leading L axis under 'layers'.
    """
    def heads(w, n):  # [L, n·H, D] -> [L, D, n, H]
        l, _, d = w.shape
        return np.ascontiguousarray(np.swapaxes(w, 1, 2).reshape(l, d, n, head_dim))

    wo = tensors["wo"]  # [L, D, N·H] -> [L, N, H, D]
    l, d, _ = wo.shape
    layers = {
        "attn_norm": {"scale": tensors["attn_norm"]},
        "mlp_norm": {"scale": tensors["mlp_norm"]},
        "attn": {
            "q_proj": {"kernel": heads(tensors["wq"], num_heads)},
            "k_proj": {"kernel": heads(tensors["wk"], num_kv_heads)},
            "v_proj": {"kernel": heads(tensors["wv"], num_kv_heads)},
            "o_proj": {"kernel": np.ascontiguousarray(
                np.swapaxes(wo, 1, 2).reshape(l, num_heads, head_dim, d))},
        },
        "mlp": {
            "gate": {"kernel": np.ascontiguousarray(np.swapaxes(tensors["w_gate"], 1, 2))},
            "up": {"kernel": np.ascontiguousarray(np.swapaxes(tensors["w_up"], 1, 2))},
            "down": {"kernel": np.ascontiguousarray(np.swapaxes(tensors["w_down"], 1, 2))},
        },
    }
    for name, proj, n in (("bq", "q_proj", num_heads), ("bk", "k_proj", num_kv_heads),
                          ("bv", "v_proj", num_kv_heads)):
        if name in tensors:
            b = tensors[name]
            layers["attn"][proj]["bias"] = np.ascontiguousarray(
                b.reshape(b.shape[0], n, head_dim))
    for name in ("q_norm", "k_norm"):
        if name in tensors:
            layers["attn"][name] = {"scale": tensors[name]}
    for name in ("post_attn_norm", "post_mlp_norm"):
        if name in tensors:
            layers[name] = {"scale": tensors[name]}
    params = {"embed": {"embedding": tensors["embed"]},
              "final_norm": {"scale": tensors["final_norm"]}, "layers": layers}
    if not tied:
        params["lm_head"] = {"kernel": np.ascontiguousarray(tensors["lm_head"].T)}
    return params


def convert_kv_heads(params: dict, num_kv_heads: int) -> dict:
    """Returns stacked params whose k_proj/v_proj have ``num_kv_heads`` heads.

    Args:
      params: stacked DecoderLM params with k_proj/v_proj kernels [L, D, K, H].
      num_kv_heads: target K'. K' = K·r duplicates each head r times (adjacent, so query
        head n still reads a copy of its original head n // G); K' = K/r averages r
        adjacent heads (Ainslie et al. 2023, sec. 2.1).
    Returns:
      A new params dict (other entries shared).
    Raises:
      ValueError: K' neither a multiple nor a divisor of K.
    """
    attn = params["layers"]["attn"]
    k = attn["k_proj"]["kernel"].shape[2]
    if num_kv_heads == k:
        return params

    def convert(w, axis=2):  # kernels [L, D, K, H] (axis 2), biases [L, K, H] (axis 1)
        w = np.asarray(w)
        if num_kv_heads % k == 0:
            return np.repeat(w, num_kv_heads // k, axis=axis)
        if k % num_kv_heads == 0:
            r = k // num_kv_heads
            shape = w.shape[:axis] + (num_kv_heads, r) + w.shape[axis + 1:]
            pooled = w.astype(np.float32).reshape(shape).mean(axis=axis + 1)
            return pooled.astype(w.dtype)
        raise ValueError(
            f"model.num_kv_heads={num_kv_heads} cannot be made from the checkpoint's {k} "
            f"KV heads; allowed: a multiple or a divisor of {k}")

    def proj(p):
        return {n: convert(w, 2 if n == "kernel" else 1) for n, w in p.items()}

    new_attn = dict(attn, k_proj=proj(attn["k_proj"]), v_proj=proj(attn["v_proj"]))
    return dict(params, layers=dict(params["layers"], attn=new_attn))


# --------------------------------------------------------------------------- GQA -> MLA


def attention_inputs(params, cfg: ModelConfig, tokens) -> np.ndarray:
    """[L, M, D] float32: every layer's attention input (its attn_norm output) for the
    M = B·T tokens of ``tokens`` [B, T], from a cache-free forward. Calibration data for
    :func:`gqa_to_mla`; ``params`` in cfg's layout."""
    import flax.linen as nn  # noqa: PLC0415 (model code only needed here)
    import jax.numpy as jnp  # noqa: PLC0415


    b, t = tokens.shape
    # Unrolled: nn.scan would not carry the captured intermediates out of its body.
    cfg = cfg.replace(scan_layers=False)
    params = model_lib.params_for(cfg, params)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, state = model_lib.DecoderLM(cfg).apply(
        {"params": params}, jnp.asarray(tokens), positions, None,
        capture_intermediates=lambda mdl, _: isinstance(mdl, nn.Module)
        and mdl.name == "attn_norm")
    inter = state["intermediates"]
    # a norm deferred into the q/k/v product (decision 0042) is captured unapplied
    return np.stack([np.asarray(layers.applied(inter[f"layers_{i}"]["attn_norm"]["__call__"][0]),
                                np.float32).reshape(b * t, cfg.d_model)
                     for i in range(cfg.num_layers)])


def mla_config(cfg: ModelConfig, kv_lora_rank: int) -> ModelConfig:
    """The MLA config :func:`gqa_to_mla` produces from a GQA ``cfg``.

    Rotary key: one shared k_rope of R = H dims (the principal rotary component across KV
    heads); no-rope key width (K - 1)·H (the other components; 2 zero-query dims when
    K = 1, since the config needs a positive width); value width H; latent C.
    """
    nope = (cfg.num_kv_heads - 1) * cfg.head_dim or 2
    return cfg.replace(
        attention="mla", num_kv_heads=cfg.num_heads, head_dim=nope + cfg.head_dim,
        kv_lora_rank=kv_lora_rank, qk_rope_head_dim=cfg.head_dim,
        qk_nope_head_dim=nope, v_head_dim=cfg.head_dim, q_lora_rank=None,
        name=f"{cfg.name}-mla{kv_lora_rank}")


def _top_eigvecs(cov: np.ndarray, k: int) -> np.ndarray:
    """Columns: the ``k`` leading eigenvectors of a symmetric matrix (descending)."""
    w, v = np.linalg.eigh(cov)
    return v[:, np.argsort(w)[::-1][:k]]


def gqa_to_mla(params: dict, cfg: ModelConfig, kv_lora_rank: int,
               layer_inputs: np.ndarray | None = None, linear_margin: float = 1e-6):
    """Converts stacked GQA params into MLA params with a latent of C = kv_lora_rank.

    The recipe follows TransMLA (Meng et al. 2025) in three steps, per layer:

    1. RoRoPE. RoPE rotates dims (f, f + H/2) of every KV head by the same angle, so an
       orthogonal K x K mixing U_f of the KV heads, applied per frequency f, commutes with
       it; applying U_f to keys and (group-expanded) queries leaves every score unchanged.
       U_f = the principal axes of the keys' energy across heads at frequency f
       (calibration activations ``layer_inputs`` if given, else the weights alone).
    2. The first mixed head keeps RoPE and becomes MLA's shared rotary key k_rope
       (R = H, the same frequencies). The other K - 1 mixed heads lose their rotation
       (partial RoPE, as in MHA2MLA, Ji et al. 2025): they become the no-rope key part.
       This is the one approximation at full rank; it vanishes for K = 1.
    3. The no-rope keys [(K-1)·H] and the values [K·H] share one latent: PCA of their
       activations (keys rescaled to the values' energy first, TransMLA's balancing)
       gives W_DKV [D, C] and the up-projections W_UK, W_UV; C >= (2K - 1)·H is lossless.

    DeepSeek's MLA normalises the latent (``kv_norm``), which no linear factorisation
    reproduces. The latent is therefore put in that RMSNorm's linear regime: W_DKV is
    scaled by a tiny alpha with |x·W_DKV·alpha|^2 / C <= linear_margin · eps for every
    possible input (bounded through the attn_norm scale and the largest singular value),
    and kv_norm's scale undoes it (sqrt(eps) / alpha): the norm is then a constant factor,
    exact to linear_margin / 2 relative. (It needs float32 or bfloat16's exponent range;
    float16 would underflow.) Queries are scaled by sqrt((nope + R) / H) so MLA's softmax
    scale 1/sqrt(nope + R) equals the original 1/sqrt(H).

    Args:
      params: stacked DecoderLM params of the GQA model (numpy or jax arrays).
      cfg: its config (attention mha/gqa/mqa).
      kv_lora_rank: C, the latent width.
      layer_inputs: [L, M, D] attention inputs (:func:`attention_inputs`) or None.
      linear_margin: delta above.
    Returns:
      (MLA config from :func:`mla_config`, stacked MLA params as float32 numpy).
    Raises:
      ValueError: cfg is MLA already, or kv_lora_rank not in [1, D].
    """
    if cfg.is_mla:
        raise ValueError("gqa_to_mla: the config is MLA already")
    if not 1 <= kv_lora_rank <= cfg.d_model:
        raise ValueError(f"kv_lora_rank={kv_lora_rank}; allowed: 1..d_model={cfg.d_model}")
    mcfg = mla_config(cfg, kv_lora_rank)
    n, k, h, g, d = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_groups,
                     cfg.d_model)
    nope, c = mcfg.qk_nope_head_dim, kv_lora_rank
    q_scale = np.sqrt((nope + h) / h)
    attn = params["layers"]["attn"]
    wq_all, wk_all, wv_all = (np.asarray(attn[p]["kernel"], np.float32)
                              for p in ("q_proj", "k_proj", "v_proj"))
    norm_all = np.asarray(params["layers"]["attn_norm"]["scale"], np.float32)
    out = {name: [] for name in ("w_q", "w_kr", "w_dkv", "kv_norm", "w_uk", "w_uv")}
    for li in range(cfg.num_layers):
        wq, wk, wv = wq_all[li], wk_all[li], wv_all[li]  # [D,N,H], [D,K,H], [D,K,H]
        if layer_inputs is None:
            sigma = np.eye(d, dtype=np.float64)
        else:
            x = np.asarray(layer_inputs[li], np.float64)
            sigma = x.T @ x / x.shape[0]
        # 1. RoRoPE: per-frequency mixing of the KV heads.
        wk_mix = np.zeros_like(wk)
        wq_mix = np.zeros((d, n, k, h), np.float32)  # query n's component on mixed head m
        for f in range(h // 2):
            dims = [f, f + h // 2]
            gram = sum(wk[:, :, j].T.astype(np.float64) @ sigma @ wk[:, :, j] for j in dims)
            u = _top_eigvecs(gram, k).T  # rows: mixed heads, [K, K] orthogonal
            for j in dims:
                wk_mix[:, :, j] = wk[:, :, j] @ u.T
                for m in range(k):
                    coef = u[m, np.arange(n) // g]  # [N]
                    wq_mix[:, :, m, j] = wq[:, :, j] * coef[None, :]
        # 2. Shared rotary key and per-head queries.
        w_kr = wk_mix[:, 0, :]
        q_rope = wq_mix[:, :, 0, :]
        if k > 1:
            q_nope = wq_mix[:, :, 1:, :].reshape(d, n, nope)
            k_nope = wk_mix[:, 1:, :].reshape(d, nope)
        else:
            q_nope = np.zeros((d, n, nope), np.float32)
            k_nope = np.zeros((d, nope), np.float32)
        out["w_q"].append(np.concatenate([q_nope, q_rope], axis=-1) * q_scale)
        out["w_kr"].append(w_kr)
        # 3. Joint latent of no-rope keys and values (PCA on balanced activations).
        v_flat = wv.reshape(d, k * h)
        e_v = np.trace(v_flat.T @ sigma @ v_flat)
        e_k = np.trace(k_nope.T @ sigma @ k_nope)
        beta = np.sqrt(e_v / e_k) if e_k > 0 else 1.0
        y = np.concatenate([k_nope * beta, v_flat], axis=1).astype(np.float64)  # [D, P]
        basis = _top_eigvecs(y.T @ sigma @ y, min(c, y.shape[1]))  # [P, C']
        if basis.shape[1] < c:  # latent wider than the keys and values: pad with zeros
            basis = np.pad(basis, ((0, 0), (0, c - basis.shape[1])))
        down = y @ basis  # [D, C]
        up = basis.T  # [C, P]
        w_uk = up[:, :nope] / beta  # [C, nope], the same for every head
        w_uv = up[:, nope:].reshape(c, k, h)
        out["w_uk"].append(np.broadcast_to(w_uk, (n, c, nope)))
        out["w_uv"].append(np.stack([w_uv[:, i // g] for i in range(n)]))
        # The latent RMSNorm's linear regime.
        smax = np.linalg.norm(down, 2)
        bound = d * float(np.max(norm_all[li] ** 2)) * smax ** 2 / c
        alpha = np.sqrt(linear_margin * cfg.norm_eps / bound) if bound > 0 else 1.0
        out["w_dkv"].append(down * alpha)
        out["kv_norm"].append(np.full((c,), np.sqrt(cfg.norm_eps) / alpha))

    stack = {name: np.stack(v).astype(np.float32) for name, v in out.items()}
    new_attn = {
        "w_q": {"kernel": stack["w_q"]}, "w_kr": {"kernel": stack["w_kr"]},
        "w_dkv": {"kernel": stack["w_dkv"]}, "kv_norm": {"scale": stack["kv_norm"]},
        "w_uk": {"kernel": stack["w_uk"]}, "w_uv": {"kernel": stack["w_uv"]},
        "wo": {"kernel": np.asarray(attn["o_proj"]["kernel"], np.float32)},
    }
    layers = dict(params["layers"], attn=new_attn)
    return mcfg, dict(params, layers=layers)


def params_from_deepseek(tensors: dict, hparams: dict) -> dict:
    """A DeepSeek-V2 / V2-Lite checkpoint (:func:`kvjax.checkpoints.hf.read_hf_checkpoint`:
    embed, final_norm, lm_head and ``layers``, per-layer dicts under HF's names) -> the
    per-layer ('layers_i') DecoderLM params of an MLA model (:mod:`kvjax.models.mla`)
    with dense or MoE MLPs (:class:`kvjax.models.layers.MoE`).

    DeepSeek rotates interleaved pairs (2i, 2i + 1) of q_pe and k_pe (its
    ``apply_rotary_pos_emb`` regroups them before rotate_half); kvjax rotates i with
    i + R/2. The R rotary rows of q_proj / q_b_proj (per head) and of
    kv_a_proj_with_mqa are reordered [0, 2, ..., R-2, 1, 3, ..., R-1] on load, which
    gives the same scores (queries and keys reordered alike).

    Returns numpy arrays in the checkpoint's dtype.
    """
    n, c, r = hparams["num_heads"], hparams["kv_lora_rank"], hparams["qk_rope_head_dim"]
    p, v = hparams["qk_nope_head_dim"], hparams["v_head_dim"]
    perm = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)])
    rows = np.concatenate([np.arange(p), p + perm])  # one head's query rows, reordered
    t = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))  # noqa: E731 [out,in]->[in,out]

    def q_heads(w):  # [N·(P + R), in] -> [in, N, P + R], rotary rows reordered
        w = w.reshape(n, p + r, -1)[:, rows]
        return np.ascontiguousarray(np.transpose(w, (2, 0, 1)))

    def swiglu(lay, pre):
        return {"gate": {"kernel": t(lay[f"{pre}.gate_proj.weight"])},
                "up": {"kernel": t(lay[f"{pre}.up_proj.weight"])},
                "down": {"kernel": t(lay[f"{pre}.down_proj.weight"])}}

    out = {"embed": {"embedding": tensors["embed"]},
           "final_norm": {"scale": tensors["final_norm"]}}
    if "lm_head" in tensors:
        out["lm_head"] = {"kernel": t(tensors["lm_head"])}
    for i, lay in enumerate(tensors["layers"]):
        kv_a = lay["self_attn.kv_a_proj_with_mqa.weight"]  # [C + R, D]
        kv_b = lay["self_attn.kv_b_proj.weight"].reshape(n, p + v, c)
        attn = {"w_dkv": {"kernel": t(kv_a[:c])},
                "kv_norm": {"scale": lay["self_attn.kv_a_layernorm.weight"]},
                "w_kr": {"kernel": t(kv_a[c:][perm])},
                "w_uk": {"kernel": t(kv_b[:, :p])}, "w_uv": {"kernel": t(kv_b[:, p:])},
                "wo": {"kernel": np.ascontiguousarray(
                    t(lay["self_attn.o_proj.weight"]).reshape(n, v, -1))}}
        if "self_attn.q_proj.weight" in lay:
            attn["w_q"] = {"kernel": q_heads(lay["self_attn.q_proj.weight"])}
        else:
            attn.update(w_dq={"kernel": t(lay["self_attn.q_a_proj.weight"])},
                        q_norm={"scale": lay["self_attn.q_a_layernorm.weight"]},
                        w_uq={"kernel": q_heads(lay["self_attn.q_b_proj.weight"])})
        if "mlp.gate.weight" in lay:
            e = lay["mlp.gate.weight"].shape[0]
            experts = [swiglu(lay, f"mlp.experts.{j}") for j in range(e)]
            mlp = {"router": {"kernel": t(lay["mlp.gate.weight"])},
                   **{f"experts_{k}": np.stack([x[k]["kernel"] for x in experts])
                      for k in ("gate", "up", "down")}}
            if "mlp.shared_experts.gate_proj.weight" in lay:
                mlp["shared"] = swiglu(lay, "mlp.shared_experts")
        else:
            mlp = swiglu(lay, "mlp")
        out[f"layers_{i}"] = {"attn_norm": {"scale": lay["input_layernorm.weight"]},
                              "mlp_norm": {"scale": lay["post_attention_layernorm.weight"]},
                              "attn": attn, "mlp": mlp}
    return out


HF_EXPORT_DEFAULTS = {"mlp_type": "swiglu", "qk_norm": False, "rope_scaling": None,
                      "embed_scale": False, "post_norms": False,
                      "query_pre_attn_scalar": None, "attn_logit_softcap": None,
                      "final_logit_softcap": None, "rope_local_theta": None,
                      "layer_windows": None, "num_experts": 0}
"""Fields of the other families (Llama 3 rope scaling, Qwen3, Gemma, MoE) with the value
a Llama/Qwen2 folder implies: :func:`hf_tensors_from_params` refuses any other."""


def hf_tensors_from_params(params: dict, cfg: ModelConfig) -> dict:
    """The inverse of :func:`params_from_gguf`: DecoderLM params (either layer layout,
    :func:`kvjax.models.model.params_for`) -> HF-orientation numpy tensors under
    kvjax's (gguf_reader's) names: embed [V, D], wq [L, N·H, D], wk/wv [L, K·H, D],
    wo [L, D, N·H], w_gate/w_up [L, F, D], w_down [L, D, F], attn_norm/mlp_norm [L, D],
    final_norm [D], lm_head [V, D] when untied, bq [L, N·H] / bk, bv [L, K·H] with
    ``cfg.qkv_bias``. The arrays keep the params' dtype.

    Raises:
      ValueError: ``cfg`` is MLA (no Llama-family tensor layout), or sets a field of
        another family (:data:`HF_EXPORT_DEFAULTS`) that this layout does not write.
    """
    if cfg.is_mla:
        raise ValueError("attention='mla' has no Llama/Qwen2 tensor layout; allowed: "
                         "mha, gqa, mqa (any num_kv_heads)")
    for field, default in HF_EXPORT_DEFAULTS.items():
        if getattr(cfg, field) != default:
            raise ValueError(f"model.{field}={getattr(cfg, field)!r}: the exported "
                             f"Llama/Qwen2 folder cannot state it; allowed: {default!r}")
    layers = params.get("layers")
    if layers is None:  # per-layer params: stack them
        per = [params[f"layers_{i}"] for i in range(cfg.num_layers)]
        layers = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *per)
    a = jax.tree.map(np.asarray, layers)
    att, mlp = a["attn"], a["mlp"]
    l, d = att["q_proj"]["kernel"].shape[:2]

    def rows(kernel):  # [L, D, n, H] -> [L, n·H, D]
        return np.ascontiguousarray(np.swapaxes(kernel.reshape(l, d, -1), 1, 2))

    out = {"embed": np.asarray(params["embed"]["embedding"]),
           "final_norm": np.asarray(params["final_norm"]["scale"]),
           "attn_norm": a["attn_norm"]["scale"], "mlp_norm": a["mlp_norm"]["scale"],
           "wq": rows(att["q_proj"]["kernel"]), "wk": rows(att["k_proj"]["kernel"]),
           "wv": rows(att["v_proj"]["kernel"]),
           # [L, N, H, D] -> [L, D, N·H]
           "wo": np.ascontiguousarray(np.swapaxes(att["o_proj"]["kernel"].reshape(l, -1, d),
                                                  1, 2)),
           "w_gate": np.ascontiguousarray(np.swapaxes(mlp["gate"]["kernel"], 1, 2)),
           "w_up": np.ascontiguousarray(np.swapaxes(mlp["up"]["kernel"], 1, 2)),
           "w_down": np.ascontiguousarray(np.swapaxes(mlp["down"]["kernel"], 1, 2))}
    for name, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
        if "bias" in att[proj]:
            out[name] = np.ascontiguousarray(att[proj]["bias"].reshape(l, -1))
    if "lm_head" in params:
        out["lm_head"] = np.ascontiguousarray(np.asarray(params["lm_head"]["kernel"]).T)
    return out


def hf_hparams(cfg: ModelConfig, context_length: int | None) -> dict:
    """The hyper-parameters :func:`kvjax.checkpoints.hf.write_hf_checkpoint` writes for
    ``cfg`` (:func:`kvjax.checkpoints.hf.read_hf_hparams`' keys). ``context_length``:
    the positions the weights were trained for (max_position_embeddings); None (random
    weights, which were trained for nothing): 8,192, SmolLM2's."""
    return dict(vocab_size=cfg.vocab_size, num_layers=cfg.num_layers, d_model=cfg.d_model,
                num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim, mlp_dim=cfg.mlp_dim, rope_theta=cfg.rope_theta,
                norm_eps=cfg.norm_eps, tie_embeddings=cfg.tie_embeddings,
                qkv_bias=cfg.qkv_bias, context_length=context_length or 8192)
