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

import numpy as np

from kvjax.config import ModelConfig


def model_config_from_hparams(hparams: dict, **overrides) -> ModelConfig:
    """A ModelConfig for a llama GGUF's hyper-parameters (``LlamaGGUF.hparams``)."""
    fields = dict(
        vocab_size=hparams["vocab_size"], num_layers=hparams["num_layers"],
        d_model=hparams["d_model"], num_heads=hparams["num_heads"],
        num_kv_heads=hparams["num_kv_heads"], head_dim=hparams["head_dim"],
        mlp_dim=hparams["mlp_dim"], rope_theta=float(hparams["rope_theta"]),
        norm_eps=float(hparams["norm_eps"]), mlp_type="swiglu", attention="gqa")
    fields.update(overrides)
    return ModelConfig(**fields)


def check_compatible(cfg: ModelConfig, hparams: dict) -> None:
    """Raises ValueError naming the first field where cfg disagrees with the checkpoint.

    num_kv_heads may differ (see :func:`convert_kv_heads`); everything else must match.
    """
    for f in ("vocab_size", "num_layers", "d_model", "num_heads", "head_dim", "mlp_dim"):
        if getattr(cfg, f) != hparams[f]:
            raise ValueError(
                f"model.{f}={getattr(cfg, f)} does not match the checkpoint's {hparams[f]}; "
                f"allowed with these weights: {hparams[f]}")
    if cfg.mlp_type != "swiglu" or cfg.attention == "mla":
        raise ValueError(
            f"model.mlp_type={cfg.mlp_type!r}, attention={cfg.attention!r}: the llama "
            "checkpoint needs mlp_type='swiglu' and attention in mha/gqa/mqa")


def params_from_gguf(tensors: dict, num_heads: int, num_kv_heads: int, head_dim: int,
                     tied: bool = True) -> dict:
    """HF-layout llama tensors -> stacked DecoderLM params (numpy, dtype kept).

    Args:
      tensors: ``LlamaGGUF.tensors`` (embed [V, D], wq [L, N·H, D], wk/wv [L, K·H, D],
        wo [L, D, N·H], w_gate/w_up [L, F, D], w_down [L, D, F], norms).
      num_heads, num_kv_heads, head_dim: N, K, H of the checkpoint.
      tied: LM head shares the embedding (SmolLM2); else ``tensors['lm_head']`` [V, D].
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

    def convert(w):
        w = np.asarray(w)
        if num_kv_heads % k == 0:
            return np.repeat(w, num_kv_heads // k, axis=2)
        if k % num_kv_heads == 0:
            r = k // num_kv_heads
            l, d, _, h = w.shape
            pooled = w.astype(np.float32).reshape(l, d, num_kv_heads, r, h).mean(axis=3)
            return pooled.astype(w.dtype)
        raise ValueError(
            f"model.num_kv_heads={num_kv_heads} cannot be made from the checkpoint's {k} "
            f"KV heads; allowed: a multiple or a divisor of {k}")

    new_attn = dict(attn, k_proj={"kernel": convert(attn["k_proj"]["kernel"])},
                    v_proj={"kernel": convert(attn["v_proj"]["kernel"])})
    return dict(params, layers=dict(params["layers"], attn=new_attn))
