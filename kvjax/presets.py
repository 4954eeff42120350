"""ModelConfig factories for the blog's running model and published architectures.

Every factory takes ``dtype`` (default 'float16', the blog's "fp16 throughout") and
``**overrides`` (any ModelConfig field), so e.g. ``blog_model(num_kv_heads=2,
attention='gqa', window_size=512)`` builds the blog's composed levers.

kvjax's decoder is llama-style (RMSNorm, rotary, no biases); presets of models that
differ (GPT-2/GPT-3: LayerNorm, learned positions, biases) keep the published sizes,
so KV bytes and the weight matrices match, while the norm/bias/position parameter
counts of :func:`kvjax.theory.weight_bytes` follow kvjax's decoder, not the original.

MLA presets: ModelConfig still requires ``num_kv_heads`` and ``head_dim``; they are set
to num_kv_heads = N (every head has its own K/V once rebuilt from the latent) and
head_dim = qk_nope + qk_rope (the query/key width per head, 192 in DeepSeek-V2). The
theory functions read the MLA fields (C, R, nope, v) for MLA configs, not these two.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from kvjax.checkpoints import fetch
from kvjax.config import MODEL_FIELD_KINDS, ModelConfig


def _make(defaults: dict[str, Any], dtype: str, overrides: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**defaults, "dtype": dtype, **overrides})


def blog_model(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """The blog's running model: D=512, h=8, d_k=d_v=64, L=12, fp16, FFN 4·D with two
    matrices (W1, W2 -> 'gelu'), tied embeddings.

    V=32,000 is our choice: the blog never states a vocabulary (it only enters the
    embedding/LM head, which the blog's 24·L·D² weight count leaves out).
    """
    return _make(dict(
        name="blog", vocab_size=32000, num_layers=12, d_model=512, num_heads=8,
        num_kv_heads=8, head_dim=64, mlp_dim=2048, mlp_type="gelu", attention="mha",
        tie_embeddings=True,
    ), dtype, overrides)


def smollm2_135m(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """SmolLM2-135M(-Instruct), HF ``HuggingFaceTB/SmolLM2-135M-Instruct`` config.json:
    hidden 576, 30 layers, 9 heads, 3 KV heads, head_dim 64, intermediate 1536 (SiLU-gated),
    vocab 49,152, rope_theta 1e5, rms_norm_eps 1e-5, tie_word_embeddings true.
    (Published weights are bfloat16; same 2 bytes as the default float16.)
    """
    return _make(dict(name="smollm2-135m", **fetch.SMOLLM2_ARCHITECTURE), dtype, overrides)


def gpt2_large(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """GPT-2 Large (Radford et al. 2019; HF ``gpt2-large`` config): n_embd 1280, n_layer 36,
    n_head 20 (head 64), n_inner 4·1280 = 5120, GELU, vocab 50,257, tied wte/lm_head,
    layer_norm_epsilon 1e-5. (Original: learned positions and LayerNorm, see module doc.)
    """
    return _make(dict(
        name="gpt2-large", vocab_size=50257, num_layers=36, d_model=1280, num_heads=20,
        num_kv_heads=20, head_dim=64, mlp_dim=5120, mlp_type="gelu", attention="mha",
        norm_eps=1e-5, tie_embeddings=True,
    ), dtype, overrides)


def llama_7b(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """LLaMA-7B (Touvron et al. 2023, Table 2; Meta params.json): dim 4096, 32 layers,
    32 heads (head 128), FFN 11,008 (SwiGLU, 2/3·4D rounded to 256), vocab 32,000,
    norm_eps 1e-6, RoPE base 1e4, untied output.
    """
    return _make(dict(
        name="llama-7b", vocab_size=32000, num_layers=32, d_model=4096, num_heads=32,
        num_kv_heads=32, head_dim=128, mlp_dim=11008, mlp_type="swiglu", attention="mha",
        rope_theta=1e4, norm_eps=1e-6, tie_embeddings=False,
    ), dtype, overrides)


def llama_65b(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """LLaMA-65B (Touvron et al. 2023, Table 2; Meta params.json): dim 8192, 80 layers,
    64 heads (head 128), FFN 22,016, vocab 32,000, norm_eps 1e-5, RoPE 1e4, untied.
    """
    return _make(dict(
        name="llama-65b", vocab_size=32000, num_layers=80, d_model=8192, num_heads=64,
        num_kv_heads=64, head_dim=128, mlp_dim=22016, mlp_type="swiglu", attention="mha",
        rope_theta=1e4, norm_eps=1e-5, tie_embeddings=False,
    ), dtype, overrides)


def llama2_70b(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """Llama-2-70B (Touvron et al. 2023b; HF ``meta-llama/Llama-2-70b-hf`` config):
    hidden 8192, 80 layers, 64 heads, 8 KV heads (GQA, head 128), intermediate 28,672,
    vocab 32,000, rms_norm_eps 1e-5, rope_theta 1e4, untied.
    """
    return _make(dict(
        name="llama2-70b", vocab_size=32000, num_layers=80, d_model=8192, num_heads=64,
        num_kv_heads=8, head_dim=128, mlp_dim=28672, mlp_type="swiglu", attention="gqa",
        rope_theta=1e4, norm_eps=1e-5, tie_embeddings=False,
    ), dtype, overrides)


def mistral_7b(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """Mistral-7B v0.1 (Jiang et al. 2023, Table 1; HF ``mistralai/Mistral-7B-v0.1``):
    dim 4096, 32 layers, 32 heads, 8 KV heads (head 128), hidden 14,336, vocab 32,000,
    sliding window 4096, rope_theta 1e4, rms_norm_eps 1e-5, untied.
    """
    return _make(dict(
        name="mistral-7b", vocab_size=32000, num_layers=32, d_model=4096, num_heads=32,
        num_kv_heads=8, head_dim=128, mlp_dim=14336, mlp_type="swiglu", attention="gqa",
        rope_theta=1e4, norm_eps=1e-5, tie_embeddings=False, window_size=4096,
    ), dtype, overrides)


def deepseek_v2(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """DeepSeek-V2 attention sizes (Liu et al. 2024, sec. 2.1 & 3.1.2; HF
    ``deepseek-ai/DeepSeek-V2`` config): hidden 5120, 60 layers, 128 heads, kv_lora_rank
    C=512, qk_rope_head_dim R=64, qk_nope_head_dim 128, v_head_dim 128, q_lora_rank 1536,
    vocab 102,400, rms_norm_eps 1e-6, rope_theta 1e4, untied.

    MoE simplification: every layer gets a dense SwiGLU of width 12,288, the
    ``intermediate_size`` of its first (dense) layer. That also equals the active expert
    width of the MoE layers, (2 shared + 6 routed) x 1,536 = 12,288, so per-token MLP
    FLOP and batch-1 MLP weight reads are right (router D·160 ignored); total parameter
    bytes are not (the real model holds 160 routed experts per layer, 236B parameters).
    """
    return _make(dict(
        name="deepseek-v2", vocab_size=102400, num_layers=60, d_model=5120, num_heads=128,
        num_kv_heads=128, head_dim=192, mlp_dim=12288, mlp_type="swiglu", attention="mla",
        rope_theta=1e4, norm_eps=1e-6, tie_embeddings=False, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=1536,
    ), dtype, overrides)


def deepseek_v2_lite_attention(num_layers: int = 2, dtype: str = "float16",
                               **overrides: Any) -> ModelConfig:
    """A few layers with DeepSeek-V2-Lite's attention (HF ``deepseek-ai/DeepSeek-V2-Lite``
    config): hidden 2048, 16 heads, C=512, R=64, nope 128, v 128, no q-LoRA, vocab 102,400,
    rms_norm_eps 1e-6. The full model has 27 layers; ``num_layers`` defaults to 2 for a small
    test model. Dense SwiGLU 10,944 (the first layer's ``intermediate_size``; MoE ignored).
    """
    return _make(dict(
        name="deepseek-v2-lite-attn", vocab_size=102400, num_layers=num_layers,
        d_model=2048, num_heads=16, num_kv_heads=16, head_dim=192, mlp_dim=10944,
        mlp_type="swiglu", attention="mla", rope_theta=1e4, norm_eps=1e-6,
        tie_embeddings=False, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, q_lora_rank=None,
    ), dtype, overrides)


def gpt3_175b(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """GPT-3 175B (Brown et al. 2020, Table 2.1): d_model 12,288, 96 layers, 96 heads,
    d_head 128, d_ff = 4·d_model = 49,152, GPT-2 BPE vocab 50,257, tied (as GPT-2).
    (GPT-3 alternates dense and locally banded sparse attention; modelled as dense here.)
    """
    return _make(dict(
        name="gpt3-175b", vocab_size=50257, num_layers=96, d_model=12288, num_heads=96,
        num_kv_heads=96, head_dim=128, mlp_dim=49152, mlp_type="gelu", attention="mha",
        norm_eps=1e-5, tie_embeddings=True,
    ), dtype, overrides)


PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "blog": blog_model,
    "smollm2-135m": smollm2_135m,
    "gpt2-large": gpt2_large,
    "llama-7b": llama_7b,
    "llama-65b": llama_65b,
    "llama2-70b": llama2_70b,
    "mistral-7b": mistral_7b,
    "deepseek-v2": deepseek_v2,
    "deepseek-v2-lite-attn": deepseek_v2_lite_attention,
    "gpt3-175b": gpt3_175b,
}


# --------------------------------------------------------------------------- variants

# Fields that say how a model runs rather than what it is: left out of architecture().
_RUN_FIELDS = MODEL_FIELD_KINDS["execution"] + ("dtype", "kv_dtype")


def architecture(preset: ModelConfig | Callable[..., ModelConfig], **overrides: Any) -> dict:
    """The architecture fields of a preset (a factory above, or a ModelConfig) as a plain
    dict, for ``configs/*.py`` (``base.model_dict(**presets.architecture(...))``): how it
    runs (dtype, kv_dtype, backend, layer stack, layouts, MLA decode path) is left to the
    experiment config. ``overrides`` replace fields."""
    cfg = preset if isinstance(preset, ModelConfig) else preset()
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ModelConfig)
              if f.name not in _RUN_FIELDS}
    fields = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
              for k, v in fields.items()}  # model.compression: a mapping
    fields.update(overrides)
    return fields


def variant(base: ModelConfig | dict, *, num_kv_heads: int | None = None,
            window_size: int | None = None, num_sink_tokens: int | None = None,
            kv_lora_rank: int | None = None, qk_rope_head_dim: int = 64,
            kv_dtype: str | None = None, name: str | None = None) -> ModelConfig | dict:
    """``base`` with the blog's levers pulled: the one way kvjax makes a variant.

    Args:
      base: a ModelConfig, or a dict of its fields (returns the same kind).
      num_kv_heads: lever 1, K KV heads; ``attention`` follows ('mha' for K = N, 'mqa'
        for K = 1, else 'gqa'). (Converting pretrained weights: kvjax.models.convert.)
      window_size, num_sink_tokens: lever 3, a ring of W slots with s sinks.
      kv_lora_rank: lever 2, MLA with a latent of C = kv_lora_rank and a shared rotary key
        of R = ``qk_rope_head_dim`` dims; per head nope = v = base head_dim (the blog's
        MLA shape from its MHA model: configs/mla.py).
      kv_dtype: the cache's element type (the blog's "bytes" factor).
      name: the variant's name (default: base name + what changed, e.g. 'blog-gqa2-window512').
    Raises:
      ConfigError: an invalid combination (from ModelConfig's validation).
    """
    f = dataclasses.asdict(base) if isinstance(base, ModelConfig) else dict(base)
    f.pop("plan", None)  # a variant is another program: its plan is resolved anew
    suffix = []
    if num_kv_heads is not None:
        n = f["num_heads"]
        f["num_kv_heads"] = num_kv_heads
        f["attention"] = "mha" if num_kv_heads == n else "mqa" if num_kv_heads == 1 else "gqa"
        suffix.append(f["attention"] + (str(num_kv_heads) if f["attention"] == "gqa" else ""))
    if kv_lora_rank is not None:
        h = f["head_dim"]
        f.update(attention="mla", num_kv_heads=f["num_heads"], head_dim=h + qk_rope_head_dim,
                 kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                 qk_nope_head_dim=h, v_head_dim=h)
        suffix.append(f"mla{kv_lora_rank}")
    if window_size is not None:
        f["window_size"] = window_size
        suffix.append(f"window{window_size}")
    if num_sink_tokens is not None:
        f["num_sink_tokens"] = num_sink_tokens
        if num_sink_tokens:
            suffix.append(f"{num_sink_tokens}sinks")
    if kv_dtype is not None:
        f["kv_dtype"] = kv_dtype
        suffix.append(f"kv-{kv_dtype}")
    f["name"] = name or "-".join([f.get("name") or "model"] + suffix)
    return ModelConfig(**f) if isinstance(base, ModelConfig) else f


def blog_mla(dtype: str = "float16", **overrides: Any) -> ModelConfig:
    """The blog's running model with MLA (lever 2): C = kv_lora_rank = 512 (the blog's
    d_c = d_model example) plus DeepSeek-V2's decoupled rotary key of R = 64 dims; per
    head 64 no-rope + 64 rope query/key dims and 64 value dims (configs/mla.py)."""
    return variant(blog_model(dtype, **overrides), kv_lora_rank=512, name="blog-mla")

