"""Reading a Hugging Face checkpoint folder (Llama 2/3.x, Mistral, Qwen2, Qwen3) into
HF-layout arrays.

The folder is what ``transformers``' ``save_pretrained`` writes: ``config.json``, the
weights as ``model.safetensors`` or as shards listed in ``model.safetensors.index.json``
(float32, float16 or bfloat16), ``tokenizer.json`` and ``tokenizer_config.json`` (its
special tokens and Jinja ``chat_template``; or a ``chat_template.jinja`` beside it).

    hp = read_hf_hparams(folder)              # config.json alone: no tensor read
    ckpt = read_hf_checkpoint(folder)         # LlamaGGUF-shaped: hparams, tensors, path
    tok = load_hf_tokenizer(folder)           # kvjax.checkpoints.Tokenizer

The arrays are in the same orientation and under the same names as
:func:`kvjax.checkpoints.gguf_reader.read_llama_gguf`'s (``[out, in]``, Q/K rows in
HF's half-split rotary order, which is what HF stores: no permutation to undo), plus the
Qwen2 biases ``bq`` [L, N·H], ``bk``/``bv`` [L, K·H] and Qwen3's per-head norm scales
``q_norm``/``k_norm`` [L, H] (its head_dim may differ from D / N). Llama 3.x's rope scaling
('llama3') becomes ``hparams['rope_scaling']`` (:mod:`kvjax.rope`). Everything kvjax does
not implement (another architecture, another rope scaling, output/MLP biases, per-layer
windows, quantized weights) is refused from ``config.json`` before any tensor is read; a
missing shard or a tensor of the wrong shape or dtype from the safetensors headers, also
before any tensor is read. Every failure is a one-line :class:`~kvjax.checkpoints.fetch.WeightsError`.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Callable

import numpy as np
import tqdm
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from kvjax.checkpoints.fetch import SMOLLM2_ARCHITECTURE, WeightsError
from kvjax.checkpoints.gguf_reader import LlamaGGUF
from kvjax.checkpoints.tokenizer import Tokenizer
from kvjax.rope import ROPE_SCALINGS, rope_scaling_pairs

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                           "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                           "DeepseekV2ForCausalLM": "deepseek_v2"}
GEMMA = ("gemma2", "gemma3")
# ModelConfig fields a Gemma checkpoint states (:func:`_gemma_fields`), with their values
# in every other family.
_NOT_GEMMA = dict(mlp_type="swiglu", embed_scale=False, post_norms=False,
                  query_pre_attn_scalar=None, attn_logit_softcap=None,
                  final_logit_softcap=None, rope_local_theta=None, layer_windows=None)
GEMMA_FIELDS = tuple(_NOT_GEMMA)
# ModelConfig fields a DeepSeek-V2 checkpoint states (:func:`_deepseek_fields`), with
# their values in every other family.
_NOT_DEEPSEEK = dict(attention="gqa", kv_lora_rank=None, qk_rope_head_dim=None,
                     qk_nope_head_dim=None, v_head_dim=None, q_lora_rank=None,
                     num_experts=0, num_experts_per_tok=0, moe_mlp_dim=0,
                     num_shared_experts=0, first_dense_layers=0, routed_scaling_factor=1.0,
                     norm_topk_prob=False, moe_groups=1, moe_topk_groups=1)
DEEPSEEK_FIELDS = tuple(_NOT_DEEPSEEK)
# Gemma's MLP activation (GELU's tanh approximation): config.json's names for it.
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
# rope_scaling / rope_parameters kinds kvjax implements (plain rotary, Su et al. 2021,
# and the scalings of kvjax.rope).
ROPE_TYPES = (None, "default", *ROPE_SCALINGS)
DTYPES = ("F32", "F16", "BF16")  # safetensors element types read

# ModelConfig field -> the config.json key it comes from (the messages of
# kvjax.models.convert.check_compatible name it).
CONFIG_KEYS = {
    "vocab_size": "config.json vocab_size",
    "num_layers": "config.json num_hidden_layers",
    "d_model": "config.json hidden_size",
    "num_heads": "config.json num_attention_heads",
    "head_dim": "config.json head_dim (or hidden_size / num_attention_heads)",
    "mlp_dim": "config.json intermediate_size",
    "rope_theta": "config.json rope_theta",
    "norm_eps": "config.json rms_norm_eps",
    "tie_embeddings": "config.json tie_word_embeddings",
    "qkv_bias": "the architecture: Qwen2 has q/k/v biases",
    "qk_norm": "the architecture: Qwen3 normalises each query and key head",
    "rope_scaling": "config.json rope_scaling",
    "mlp_type": "config.json hidden_activation (Gemma: GeGLU)",
    "embed_scale": "the architecture: Gemma scales its embeddings by sqrt(hidden_size)",
    "post_norms": "the architecture: Gemma 2 / 3 normalise attention and MLP outputs",
    "query_pre_attn_scalar": "config.json query_pre_attn_scalar",
    "attn_logit_softcap": "config.json attn_logit_softcapping",
    "final_logit_softcap": "config.json final_logit_softcapping",
    "rope_local_theta": "config.json rope_local_base_freq",
    "attention": "config.json architectures (DeepSeek-V2: 'mla')",
    "kv_lora_rank": "config.json kv_lora_rank",
    "qk_rope_head_dim": "config.json qk_rope_head_dim",
    "qk_nope_head_dim": "config.json qk_nope_head_dim",
    "v_head_dim": "config.json v_head_dim",
    "q_lora_rank": "config.json q_lora_rank",
    "num_experts": "config.json n_routed_experts",
    "num_experts_per_tok": "config.json num_experts_per_tok",
    "moe_mlp_dim": "config.json moe_intermediate_size",
    "num_shared_experts": "config.json n_shared_experts",
    "first_dense_layers": "config.json first_k_dense_replace",
    "routed_scaling_factor": "config.json routed_scaling_factor",
    "norm_topk_prob": "config.json norm_topk_prob",
    "moe_groups": "config.json n_group (topk_method 'group_limited_greedy')",
    "moe_topk_groups": "config.json topk_group",
    "num_kv_heads": "config.json num_key_value_heads",
}

# HF tensor name (per layer, after "model.layers.{i}.") -> kvjax's (gguf_reader's) name.
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down",
}
_BIAS_TENSORS = {"self_attn.q_proj.bias": "bq", "self_attn.k_proj.bias": "bk",
                 "self_attn.v_proj.bias": "bv"}
_QK_NORM_TENSORS = {"self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm"}
# Gemma 2 / 3: post_attention_layernorm normalises the attention output (not the MLP
# input, as in llama), pre_/post_feedforward_layernorm the MLP's input and output.
_GEMMA_NORMS = {"input_layernorm.weight": "attn_norm",
                "post_attention_layernorm.weight": "post_attn_norm",
                "pre_feedforward_layernorm.weight": "mlp_norm",
                "post_feedforward_layernorm.weight": "post_mlp_norm"}
_GLOBAL_TENSORS = {"model.embed_tokens.weight": "embed", "model.norm.weight": "final_norm"}


def layer_tensors(hp: dict) -> dict[str, str]:
    """HF tensor name per layer (after "model.layers.{i}.") -> kvjax's name, for the
    family of ``hp`` (:func:`read_hf_hparams`)."""
    out = dict(_LAYER_TENSORS)
    if hp.get("architecture") in GEMMA:
        del out["post_attention_layernorm.weight"]
        out.update(_GEMMA_NORMS)
    if hp.get("qkv_bias"):
        out.update(_BIAS_TENSORS)
    if hp.get("qk_norm"):
        out.update(_QK_NORM_TENSORS)
    return out
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer older checkpoints saved


def _folder(path: str | os.PathLike | None) -> pathlib.Path:
    if path is None:
        raise WeightsError("weights='hf' needs weights_path=DIR, a Hugging Face checkpoint "
                           "folder (config.json, *.safetensors, tokenizer.json)")
    p = pathlib.Path(path)
    if not p.is_dir():
        raise WeightsError(f"Hugging Face checkpoint {p} is not a folder; allowed: a folder "
                           "holding config.json, *.safetensors and tokenizer.json")
    if not (p / "config.json").is_file():
        raise WeightsError(f"Hugging Face checkpoint folder {p} has no config.json")
    return p


def _json(path: pathlib.Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path} is not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict):
        raise WeightsError(f"{path} holds a {type(out).__name__}; allowed: a JSON object")
    return out


def _first_id(x: Any) -> int | None:
    if isinstance(x, (list, tuple)):
        return int(x[0]) if x else None
    return None if x is None else int(x)


def read_hf_hparams(path: str | os.PathLike) -> dict:
    """The hyper-parameters of a Hugging Face checkpoint, from ``config.json`` (and the
    chat template of ``tokenizer_config.json``) alone; no tensor is read.

    Returns:
      the keys of ``LlamaGGUF.hparams`` (``vocab_size`` ... ``norm_eps``,
      ``context_length`` = max_position_embeddings, ``bos_token_id``/``eos_token_id``
      from config.json or None, ``tie_embeddings``) plus ``qkv_bias`` (Qwen2),
      ``qk_norm`` (Qwen3), ``rope_scaling`` (:func:`kvjax.rope.rope_scaling_pairs` of
      config.json's, or None), ``window_size`` (Mistral's ``sliding_window``, or None),
      ``architecture`` ('llama', 'mistral', 'qwen2' or 'qwen3'), ``name`` (the folder's name) and
      ``chat_template`` (str or None).

    Raises:
      WeightsError: no folder or no config.json; an architecture other than
        LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; a field
        kvjax does not implement (a rope scaling other than the default and 'llama3',
        output or MLP biases, an activation other than SiLU, per-layer sliding windows,
        partial rotary, quantized weights), each naming the field and its value.
    """
    folder = _folder(path)
    c = _json(folder / "config.json")
    where = f"{folder / 'config.json'}"
    archs = c.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(f"{where}: architectures={archs!r}; kvjax reads one of "
                           f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = SUPPORTED_ARCHITECTURES[archs[0]]

    def refuse(key: str, value: Any, allowed: str) -> None:
        raise WeightsError(f"{where}: {key}={value!r} is not implemented by kvjax; "
                           f"allowed: {allowed}")

    rope = c.get("rope_scaling") or c.get("rope_parameters") or None
    rope_key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
    if rope is not None and not isinstance(rope, dict):
        refuse(rope_key, rope, "null or an object with a rope_type")
    try:
        rope_scaling = rope_scaling_pairs(rope)
    except ValueError as e:  # names the key; kinds not implemented say so
        kind = rope.get("rope_type", rope.get("type"))
        if kind not in ROPE_TYPES:
            refuse(f"{rope_key}.rope_type", kind,
                   f"null, 'default' or {', '.join(map(repr, ROPE_SCALINGS))} (dynamic, "
                   "yarn and longrope scaling are not implemented)")
        raise WeightsError(f"{where}: {str(e).replace('rope_scaling', rope_key)}") from None
    if rope_scaling is not None and dict(rope_scaling)["rope_type"] == "yarn" \
            and arch != "deepseek_v2":
        refuse(f"{rope_key}.rope_type", "yarn", "null, 'default', 'llama3' or 'linear' "
               "(yarn is implemented as DeepSeek-V2 writes it, for DeepseekV2ForCausalLM)")
    deepseek = _deepseek_fields(c, refuse) if arch == "deepseek_v2" else {}
    for key, ok in (("attention_bias", False), ("mlp_bias", False)):
        if arch != "qwen2" and c.get(key, ok) != ok:
            refuse(key, c[key], f"{ok} (kvjax's llama blocks have no output/MLP biases)")
    if arch in GEMMA:
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GEMMA_ACTIVATIONS:
            refuse("hidden_activation", act, "'gelu_pytorch_tanh' (GeGLU MLP)")
    elif c.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", c["hidden_act"], "'silu' (SwiGLU MLP)")
    if c.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", c["partial_rotary_factor"], "1.0 (full rotary)")
    if c.get("quantization_config"):
        refuse("quantization_config", c["quantization_config"].get("quant_method", "?"),
               "none (float32, float16 or bfloat16 safetensors)")
    if arch in ("qwen2", "qwen3") and c.get("use_sliding_window"):
        refuse("use_sliding_window", True,
               "false (Qwen2's / Qwen3's window applies to some layers only; kvjax's window, "
               "model.window_size, applies to every layer)")
    types = set(c.get("layer_types") or [])
    if len(types) > 1 and arch not in GEMMA:
        refuse("layer_types", sorted(types), "one attention kind on every layer")
    window = c.get("sliding_window") if arch in ("mistral", *GEMMA) else None
    if window is not None and (not isinstance(window, int) or window <= 0):
        refuse("sliding_window", window, "null or a positive integer")
    gemma = _gemma_fields(c, arch, window, refuse) if arch in GEMMA else {}

    try:
        d_model = int(c["hidden_size"])
        num_heads = int(c["num_attention_heads"])
        hp = dict(
            vocab_size=int(c["vocab_size"]),
            num_layers=int(c["num_hidden_layers"]),
            d_model=d_model,
            num_heads=num_heads,
            num_kv_heads=int(c.get("num_key_value_heads") or num_heads),
            head_dim=int(c.get("head_dim") or d_model // num_heads),
            mlp_dim=int(c["intermediate_size"]),
            rope_theta=float((rope or {}).get("rope_theta", c.get("rope_theta", 10000.0))),
            norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            context_length=int(c.get("max_position_embeddings") or 0) or None,
            bos_token_id=_first_id(c.get("bos_token_id")),
            eos_token_id=_first_id(c.get("eos_token_id")),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            rope_scaling=rope_scaling,
            window_size=None if arch in GEMMA else window,
            architecture=arch,
            name=folder.resolve().name,
        )
    except KeyError as e:
        raise WeightsError(f"{where} lacks {e.args[0]!r} (a {archs[0]} config needs it)") \
            from None
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{where}: a size field is not a number ({e})") from None
    hp.update(_NOT_GEMMA, **gemma)
    hp.update(_NOT_DEEPSEEK, **deepseek)
    if arch == "gemma3":
        hp["qk_norm"] = True
    if hp["num_heads"] % hp["num_kv_heads"]:
        raise WeightsError(f"{where}: num_attention_heads={hp['num_heads']} do not group "
                           f"into num_key_value_heads={hp['num_kv_heads']}")
    hp["chat_template"] = read_chat_template(folder)
    return hp


def _deepseek_fields(c: dict, refuse) -> dict:
    """The ModelConfig fields of a DeepSeek-V2 / V2-Lite config.json: MLA's sizes
    (num_kv_heads = N, head_dim = nope + R: kvjax.presets' convention) and the MoE's
    (routed and shared experts, top-k routing 'greedy' or 'group_limited_greedy' over
    softmax scores, the first first_k_dense_replace layers dense, an MoE MLP on every
    later layer)."""
    if c.get("scoring_func", "softmax") != "softmax":
        refuse("scoring_func", c["scoring_func"], "'softmax'")
    method = c.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        refuse("topk_method", method, "'greedy' or 'group_limited_greedy'")
    if c.get("moe_layer_freq", 1) != 1:
        refuse("moe_layer_freq", c["moe_layer_freq"], "1 (an MoE MLP on every layer "
               "after first_k_dense_replace)")
    n = int(c["num_attention_heads"])
    nope, r = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"])
    experts = int(c.get("n_routed_experts") or 0)
    grouped = method == "group_limited_greedy"
    out = dict(attention="mla", num_kv_heads=n, head_dim=nope + r,
               kv_lora_rank=int(c["kv_lora_rank"]), qk_rope_head_dim=r,
               qk_nope_head_dim=nope, v_head_dim=int(c["v_head_dim"]),
               q_lora_rank=None if c.get("q_lora_rank") is None else int(c["q_lora_rank"]))
    if experts:
        out.update(num_experts=experts, num_experts_per_tok=int(c["num_experts_per_tok"]),
                   moe_mlp_dim=int(c["moe_intermediate_size"]),
                   num_shared_experts=int(c.get("n_shared_experts") or 0),
                   first_dense_layers=int(c.get("first_k_dense_replace") or 0),
                   routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
                   norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                   moe_groups=int(c.get("n_group") or 1) if grouped else 1,
                   moe_topk_groups=int(c.get("topk_group") or 1) if grouped else 1)
    return out


def _gemma_fields(c: dict, arch: str, window: int | None, refuse) -> dict:
    """The ModelConfig fields of a Gemma 2 / 3 config.json beside the llama ones:
    GeGLU, embeddings times sqrt(D), post-norms, query_pre_attn_scalar, the soft-caps
    (Gemma 2), the local layers' rotary base (Gemma 3's rope_local_base_freq) and the
    per-layer windows: ``layer_types`` when stated, else transformers' defaults (Gemma 2:
    even layers sliding; Gemma 3: every layer but each sliding_window_pattern-th)."""
    n = int(c["num_hidden_layers"])
    kinds = c.get("layer_types")
    if kinds is None:
        every = 2 if arch == "gemma2" else int(c.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % every else "full_attention"
                 for i in range(n)]
    bad = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if bad or len(kinds) != n:
        refuse("layer_types", bad or len(kinds),
               f"{n} entries of 'sliding_attention' / 'full_attention'")
    if "sliding_attention" in kinds and window is None:
        refuse("sliding_window", None, "a positive integer (the sliding layers' window)")
    layer_windows = tuple(window if k == "sliding_attention" else None for k in kinds)

    def cap(key: str) -> float | None:
        v = c.get(key)
        return None if v is None else float(v)

    return dict(
        mlp_type="geglu", embed_scale=True, post_norms=True,
        query_pre_attn_scalar=cap("query_pre_attn_scalar"),
        attn_logit_softcap=cap("attn_logit_softcapping"),
        final_logit_softcap=cap("final_logit_softcapping"),
        rope_local_theta=cap("rope_local_base_freq") if arch == "gemma3" else None,
        layer_windows=None if all(w is None for w in layer_windows) else layer_windows,
        tie_embeddings=bool(c.get("tie_word_embeddings", True)))


def read_chat_template(path: str | os.PathLike) -> str | None:
    """The chat template of a checkpoint folder: ``chat_template.jinja`` if present, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates,
    of which 'default' is used), else None."""
    folder = pathlib.Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not (folder / "tokenizer_config.json").is_file():
        return None
    t = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
    return t if isinstance(t, str) and t else None


def model_fields(hparams: dict) -> dict:
    """The ``ModelConfig`` fields a checkpoint states (:func:`read_hf_hparams`):
    vocab_size, num_layers, d_model, num_heads, num_kv_heads, head_dim, mlp_dim,
    rope_theta, norm_eps, tie_embeddings, qkv_bias, qk_norm, rope_scaling, window_size,
    name and Gemma's :data:`GEMMA_FIELDS`."""
    keys = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
            "mlp_dim", "rope_theta", "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm",
            "rope_scaling", "window_size", "name", *GEMMA_FIELDS, *DEEPSEEK_FIELDS)
    return {k: hparams[k] for k in keys}


# Fields a checkpoint states whose config value may differ from it: levers applied to the
# checkpoint's weights (kvjax.models.convert) rather than facts about them.
_LEVERS = ("num_kv_heads", "window_size", "layer_windows", "name", "attention")


def checkpoint_model(model: dict, weights_path: str | os.PathLike | None) -> dict:
    """The ``config.model`` fields of a run on a Hugging Face checkpoint
    (``weights='hf'``): its architecture from the checkpoint's ``config.json``
    (:func:`model_fields`), the experiment's levers from ``model``.

    The experiment configs of ``configs/`` are written for SmolLM2
    (:data:`kvjax.checkpoints.fetch.SMOLLM2_ARCHITECTURE`): a field that holds SmolLM2's
    value, or is unset (0 or None), takes the checkpoint's, so ``configs/gqa.py`` runs
    any checkpoint as published. A field set to another value is the experiment's:
    ``num_kv_heads`` (lever 1, converted on load; ``attention='mha'`` / ``'mqa'`` mean
    K = N / K = 1 of the checkpoint) and ``window_size`` (lever 3) are kept, so
    ``configs/mqa.py`` and ``configs/window.py`` apply to the checkpoint; an
    architecture field (sizes, rotary base, norm epsilon, tied head, q/k/v biases) must
    equal the checkpoint's. (So SmolLM2's own value of a lever, e.g. num_kv_heads=3, reads
    as "as published".)

    Args:
      model: the run's ``config.model`` fields (a plain dict).
      weights_path: the checkpoint folder.
    Returns:
      a new dict of ModelConfig fields.
    Raises:
      WeightsError: as :func:`read_hf_hparams`, or an architecture field that contradicts
        the checkpoint, naming both values.
    """
    hparams = read_hf_hparams(weights_path)
    stated = model_fields(hparams)
    published = dict(SMOLLM2_ARCHITECTURE, name="smollm2-135m", qkv_bias=False,
                     qk_norm=False, rope_scaling=None, window_size=None, **_NOT_GEMMA,
                     **{k: v for k, v in _NOT_DEEPSEEK.items() if k != "attention"})
    out = dict(model)

    def same(a: Any, b: Any) -> bool:
        if isinstance(b, float) and not isinstance(a, bool):
            return isinstance(a, (int, float)) and float(a) == b
        return a == b

    for f, theirs in stated.items():
        ours = model.get(f)
        if ours is None or (ours == 0 and not isinstance(ours, bool)) or \
                same(ours, published[f]) or (f == "name" and ours == "model"):
            out[f] = theirs
        elif f not in _LEVERS and not same(ours, theirs):
            raise WeightsError(
                f"model.{f}={ours!r} does not match the checkpoint's {theirs!r} "
                f"({CONFIG_KEYS[f]}); allowed with these weights: {theirs!r}")
    if model.get("attention") == "mha":
        out["num_kv_heads"] = stated["num_heads"]
    elif model.get("attention") == "mqa":
        out["num_kv_heads"] = 1
    return out


def _weight_files(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> the .safetensors file holding it (headers only)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightsError(f"{index} has no weight_map")
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise WeightsError(f"{index} names shard(s) missing from {folder}: "
                               f"{', '.join(missing)}")
        return {name: folder / f for name, f in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"Hugging Face checkpoint folder {folder} has no .safetensors "
                           "file (model.safetensors, or shards with "
                           "model.safetensors.index.json)")
    if len(files) > 1:
        raise WeightsError(f"{folder} has {len(files)} .safetensors files but no "
                           "model.safetensors.index.json saying which tensor is where")
    return {name: files[0] for name in _open(files[0]).keys()}


def _open(path: pathlib.Path):
    try:
        return safe_open(str(path), framework="numpy")
    except Exception as e:  # safetensors raises SafetensorError on a bad header
        raise WeightsError(f"{path} is not a readable safetensors file "
                           f"({type(e).__name__}: {e})") from None


def _deepseek_layer_shapes(hp: dict, i: int) -> dict[str, tuple]:
    """DeepSeek-V2 layer ``i``'s HF tensor names (after "model.layers.{i}.") and
    shapes: MLA (q_proj, or q_a_proj / q_a_layernorm / q_b_proj with q_lora_rank;
    kv_a_proj_with_mqa [C + R, D], kv_a_layernorm, kv_b_proj [N·(nope + v), C], o_proj)
    and a dense MLP below first_dense_layers, else the router mlp.gate [E, D], E experts
    and the shared experts' SwiGLU."""
    D, N, F = hp["d_model"], hp["num_heads"], hp["mlp_dim"]
    C, R, P, V = (hp[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                  "v_head_dim"))
    Q = hp["q_lora_rank"]
    out = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
           "self_attn.kv_a_proj_with_mqa.weight": (C + R, D),
           "self_attn.kv_a_layernorm.weight": (C,),
           "self_attn.kv_b_proj.weight": (N * (P + V), C),
           "self_attn.o_proj.weight": (D, N * V)}
    if Q is None:
        out["self_attn.q_proj.weight"] = (N * (P + R), D)
    else:
        out.update({"self_attn.q_a_proj.weight": (Q, D), "self_attn.q_a_layernorm.weight": (Q,),
                    "self_attn.q_b_proj.weight": (N * (P + R), Q)})
    swiglu = lambda pre, f: {f"{pre}.gate_proj.weight": (f, D),  # noqa: E731
                             f"{pre}.up_proj.weight": (f, D),
                             f"{pre}.down_proj.weight": (D, f)}
    if not hp["num_experts"] or i < hp["first_dense_layers"]:
        out.update(swiglu("mlp", F))
        return out
    E, Fe = hp["num_experts"], hp["moe_mlp_dim"]
    out["mlp.gate.weight"] = (E, D)
    for j in range(E):
        out.update(swiglu(f"mlp.experts.{j}", Fe))
    if hp["num_shared_experts"]:
        out.update(swiglu("mlp.shared_experts", hp["num_shared_experts"] * Fe))
    return out


def expected_shapes(hp: dict) -> dict[str, tuple]:
    """HF tensor name -> the shape the hyper-parameters imply (HF ``[out, in]``)."""
    V, L, D, N, K, H, F = (hp[k] for k in (
        "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
        "mlp_dim"))
    if hp.get("architecture") == "deepseek_v2":
        out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
        if not hp["tie_embeddings"]:
            out["lm_head.weight"] = (V, D)
        for i in range(L):
            out.update({f"model.layers.{i}.{n}": s
                        for n, s in _deepseek_layer_shapes(hp, i).items()})
        return out
    shapes = {"self_attn.q_proj.weight": (N * H, D), "self_attn.k_proj.weight": (K * H, D),
              "self_attn.v_proj.weight": (K * H, D), "self_attn.o_proj.weight": (D, N * H),
              "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D),
              "mlp.down_proj.weight": (D, F), "self_attn.q_norm.weight": (H,),
              "self_attn.k_norm.weight": (H,), "self_attn.q_proj.bias": (N * H,),
              "self_attn.k_proj.bias": (K * H,), "self_attn.v_proj.bias": (K * H,)}
    layer = {n: shapes.get(n, (D,)) for n in layer_tensors(hp)}  # the rest: norms [D]
    out = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not hp["tie_embeddings"]:
        out["lm_head.weight"] = (V, D)
    for i in range(L):
        out.update({f"model.layers.{i}.{n}": s for n, s in layer.items()})
    return out


def read_hf_checkpoint(path: str | os.PathLike, dtype: Any = np.float32,
                       progress: bool = True,
                       check: Callable[[dict], None] | None = None) -> LlamaGGUF:
    """Reads a Hugging Face Llama / Mistral / Qwen2 / Qwen3 checkpoint folder.

    Every tensor is read with ``safetensors`` (float32, float16 or bfloat16) and cast to
    ``dtype``. HF stores Q/K rows in half-split rotary order, kvjax's
    (:func:`kvjax.models.layers.apply_rope`), so nothing is permuted.

    Args:
      path: the folder.
      dtype: numpy dtype of the returned arrays (``np.float32``, ``ml_dtypes.bfloat16``).
      progress: show a tqdm bar over layers.
      check: called with :func:`read_hf_hparams`'s dict before any tensor is read; what
        it raises propagates (a config that disagrees with the checkpoint).

    Returns:
      a :class:`~kvjax.checkpoints.gguf_reader.LlamaGGUF` (hparams as
      :func:`read_hf_hparams`; tensors under gguf_reader's names and shapes, plus
      ``lm_head`` [V, D] when untied and ``bq``/``bk``/``bv`` for Qwen2,
      ``q_norm``/``k_norm`` for Qwen3 and Gemma 3, ``post_attn_norm``/``post_mlp_norm``
      [L, D] for Gemma 2 / 3, whose norm scales are returned as the (1 + w) its RMSNorm
      multiplies by; DeepSeek-V2: ``layers``, a list of per-layer dicts under the HF
      names after "model.layers.{i}." (:func:`kvjax.models.convert.params_from_deepseek`);
      path the folder).

    Raises:
      WeightsError: as :func:`read_hf_hparams`; a shard named by the index is missing; a
        tensor is missing, unexpected, of the wrong shape (naming it and both shapes) or
        of a dtype other than F32/F16/BF16, all from the headers before any tensor is
        read.
    """
    folder = _folder(path)
    hp = read_hf_hparams(folder)
    if check is not None:
        check(hp)
    dtype = np.dtype(dtype)
    files = _weight_files(folder)
    want = expected_shapes(hp)
    missing = [n for n in want if n not in files]
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing)} in all)"
                                          if len(missing) > 6 else "")
        raise WeightsError(f"Hugging Face checkpoint {folder} lacks tensors: {shown}")
    skip = {"lm_head.weight"} if hp["tie_embeddings"] else set()
    extra = sorted(n for n in files if n not in want and n not in skip
                   and not n.endswith(_IGNORED_SUFFIXES))
    if extra:
        shown = ", ".join(extra[:6]) + (f", ... ({len(extra)} in all)" if len(extra) > 6 else "")
        raise WeightsError(f"Hugging Face checkpoint {folder} has tensors kvjax does not "
                           f"use: {shown}")
    handles = {f: _open(f) for f in sorted(set(files[n] for n in want))}
    for name, shape in want.items():  # headers only: shapes and dtypes before any data
        sl = handles[files[name]].get_slice(name)
        got, kind = tuple(sl.get_shape()), sl.get_dtype()
        if got != shape:
            raise WeightsError(f"tensor {name} of {files[name]} has shape {got}; the "
                               f"config.json sizes imply {shape}")
        if kind not in DTYPES:
            raise WeightsError(f"tensor {name} of {files[name]} is {kind}; allowed: "
                               f"{', '.join(DTYPES)}")

    def get(name: str) -> np.ndarray:
        return handles[files[name]].get_tensor(name).astype(dtype)

    tensors = {ours: get(name) for name, ours in _GLOBAL_TENSORS.items()}
    if not hp["tie_embeddings"]:
        tensors["lm_head"] = get("lm_head.weight")
    L = hp["num_layers"]
    if hp["architecture"] == "deepseek_v2":  # layers differ (dense / MoE): a list
        tensors["layers"] = [
            {n: get(f"model.layers.{i}.{n}") for n in _deepseek_layer_shapes(hp, i)}
            for i in tqdm.trange(L, desc=f"reading {folder.name}", unit="layer",
                                 disable=not progress)]
        return LlamaGGUF(hparams=hp, tensors=tensors, path=folder)
    per_layer = layer_tensors(hp)
    stacked: dict[str, np.ndarray] = {}
    for i in tqdm.trange(L, desc=f"reading {folder.name}", unit="layer", disable=not progress):
        for hname, ours in per_layer.items():
            a = get(f"model.layers.{i}.{hname}")
            if ours not in stacked:
                stacked[ours] = np.empty((L, *a.shape), dtype)
            stacked[ours][i] = a
    tensors.update(stacked)
    if hp["architecture"] in GEMMA:  # Gemma's RMSNorm multiplies by (1 + w)
        for name in ("final_norm", *_GEMMA_NORMS.values(), *_QK_NORM_TENSORS.values()):
            if name in tensors:
                tensors[name] = (1 + tensors[name].astype(np.float32)).astype(dtype)
    return LlamaGGUF(hparams=hp, tensors=tensors, path=folder)


def _token_text(x: Any) -> str | None:
    if isinstance(x, dict):
        return x.get("content")
    return x if isinstance(x, str) else None


def load_hf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint folder: ``tokenizer.json`` through HF
    ``tokenizers``, its added special tokens as control tokens, bos/eos from
    ``tokenizer_config.json`` (``bos_token``/``eos_token``) or else config.json's ids
    (every end-of-generation id: that eos and the ``eos_token_id`` of config.json and
    generation_config.json),
    the chat template of :func:`read_chat_template`, and whether a raw prompt starts
    with BOS (``add_bos_token``, or the tokenizer's own post-processor adding it).

    Raises:
      WeightsError: no tokenizer.json, or it does not load; no eos token found.
    """
    folder = _folder(path)
    file = folder / "tokenizer.json"
    if not file.is_file():
        raise WeightsError(f"Hugging Face checkpoint folder {folder} has no tokenizer.json "
                           "(kvjax reads fast tokenizers only)")
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises Exception subclasses on bad JSON
        raise WeightsError(f"{file} does not load in HF tokenizers ({e})") from None
    tcfg = _json(folder / "tokenizer_config.json") if (
        folder / "tokenizer_config.json").is_file() else {}
    conf = _json(folder / "config.json")
    special = sorted(i for i, t in hf.get_added_tokens_decoder().items() if t.special)

    def token_id(name: str) -> int | None:
        text = _token_text(tcfg.get(name))
        if text is not None and hf.token_to_id(text) is not None:
            return int(hf.token_to_id(text))
        return _first_id(conf.get(f"{name}_id"))

    bos, eos = token_id("bos_token"), token_id("eos_token")
    if eos is None:
        raise WeightsError(f"{folder}: no eos token (tokenizer_config.json eos_token or "
                           "config.json eos_token_id)")
    bos = eos if bos is None else bos
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    tokens = {n: _token_text(tcfg.get(n)) for n in names}
    tokens["bos_token"] = tokens["bos_token"] or hf.id_to_token(bos)
    tokens["eos_token"] = tokens["eos_token"] or hf.id_to_token(eos)
    add_bos = tcfg.get("add_bos_token")
    if add_bos is None:  # the tokenizer's post-processor may add it (Llama 3)
        add_bos = hf.encode("a", add_special_tokens=True).ids[:1] == [bos] != \
            hf.encode("a", add_special_tokens=False).ids[:1]
    ends = {eos}  # every end-of-generation id: config.json's and generation_config.json's
    gen = _json(folder / "generation_config.json") if (
        folder / "generation_config.json").is_file() else {}
    for x in (conf.get("eos_token_id"), gen.get("eos_token_id")):
        ends.update(int(i) for i in (x if isinstance(x, list) else [] if x is None else [x]))
    return Tokenizer(hf, bos, eos, special, read_chat_template(folder),
                     template_tokens=tokens, eos_token_ids=sorted(ends),
                     add_bos_token=bool(add_bos))


def write_hf_checkpoint(folder: str | os.PathLike, tensors: dict, hparams: dict,
                        tokenizer: Tokenizer) -> pathlib.Path:
    """Writes a Hugging Face checkpoint folder that :func:`read_hf_checkpoint` and
    :func:`load_hf_tokenizer` (and transformers' ``LlamaForCausalLM`` /
    ``Qwen2ForCausalLM``) read back: config.json, model.safetensors (the tensors' own
    dtype: F32, F16 or BF16), tokenizer.json, tokenizer_config.json (bos/eos text,
    ``add_bos_token``, the chat template) and generation_config.json (every
    end-of-generation id).

    Args:
      folder: created if missing; files of these names in it are replaced.
      tensors: HF-orientation arrays under kvjax's names
        (:func:`kvjax.models.convert.hf_tensors_from_params`).
      hparams: :func:`read_hf_hparams`' keys (vocab_size, num_layers, d_model,
        num_heads, num_kv_heads, head_dim, mlp_dim, rope_theta, norm_eps,
        tie_embeddings, qkv_bias, context_length).
      tokenizer: the model's :class:`Tokenizer` (its HF ``tokenizers`` object is saved).
    Returns:
      the folder.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415 (writing only)

    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    hp = hparams
    arch = "qwen2" if hp["qkv_bias"] else "llama"
    dtype = np.dtype(tensors["embed"].dtype).name
    config = dict(
        architectures=["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        model_type=arch, vocab_size=hp["vocab_size"], num_hidden_layers=hp["num_layers"],
        hidden_size=hp["d_model"], num_attention_heads=hp["num_heads"],
        num_key_value_heads=hp["num_kv_heads"], head_dim=hp["head_dim"],
        intermediate_size=hp["mlp_dim"], rope_theta=hp["rope_theta"],
        rms_norm_eps=hp["norm_eps"], tie_word_embeddings=hp["tie_embeddings"],
        max_position_embeddings=hp["context_length"], hidden_act="silu",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        rope_scaling=None, attention_bias=bool(hp["qkv_bias"]), mlp_bias=False,
        torch_dtype={"float32": "float32", "float16": "float16"}.get(dtype, "bfloat16"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    names = {v: k for k, v in {**_LAYER_TENSORS, **_BIAS_TENSORS}.items()}
    flat = {hf: tensors[ours] for hf, ours in _GLOBAL_TENSORS.items()}
    if not hp["tie_embeddings"]:
        flat["lm_head.weight"] = tensors["lm_head"]
    for ours, a in tensors.items():
        if ours in names:
            for i in range(a.shape[0]):
                flat[f"model.layers.{i}.{names[ours]}"] = a[i]
    save_file({k: np.ascontiguousarray(v) for k, v in flat.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.hf.save(str(out / "tokenizer.json"))
    text = tokenizer.hf.id_to_token
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=text(tokenizer.bos_token_id), eos_token=text(tokenizer.eos_token_id),
        add_bos_token=tokenizer.add_bos_token, chat_template=tokenizer.chat_template,
        tokenizer_class="PreTrainedTokenizerFast"), indent=2))
    (out / "generation_config.json").write_text(json.dumps(dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=list(tokenizer.eos_token_ids)),
        indent=2))
    return out
