"""Names that say what a model config really is, whatever file or flag built it.

A config file's ``model.name`` is the base model (``smollm2-135m``, ``blog``); the
attention variant, the window and the dtype are read off the fields, so
``configs/window.py --config.model.window_size=128`` is reported as W=128, not 512.
"""

from __future__ import annotations

from kvjax.config import ModelConfig

DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def attention_label(cfg: ModelConfig) -> str:
    """'MHA K=9', 'GQA K=3', 'MQA K=1' (by K, whatever ``attention`` says), or
    'MLA C=512 R=64' (+ ' naive' for the non-absorbed decode)."""
    if cfg.is_mla:
        return (f"MLA C={cfg.kv_lora_rank} R={cfg.qk_rope_head_dim}"
                + ("" if cfg.mla_absorb else " naive"))
    k = cfg.num_kv_heads
    kind = "MHA" if k == cfg.num_heads else "MQA" if k == 1 else "GQA"
    return f"{kind} K={k}"


def window_label(cfg: ModelConfig) -> str:
    """'' for full attention, else 'W=128' or 'W=128+4 sinks'; with ``layer_windows``
    the layers of each window, e.g. 'W=512 x25 + global x5'."""
    if cfg.layer_windows is not None:
        counts: dict = {}
        for w in cfg.layer_windows:
            counts[w] = counts.get(w, 0) + 1
        return " + ".join(f"{'global' if w is None else f'W={w}'} x{n}"
                          for w, n in counts.items())
    if not cfg.window_size:
        return ""
    sinks = f"+{cfg.num_sink_tokens} sinks" if cfg.num_sink_tokens else ""
    return f"W={cfg.window_size}{sinks}"


def compression_label(cfg: ModelConfig) -> str:
    """'' without lever 5, else e.g. 'snapkv 512+192' (the method, its budget and the
    ring of recent slots after it), 'tova 512+192 every 1' with schedule 'every_n',
    'quest 512 read dense 2' with ``compression.dense_layers`` 2."""
    if cfg.kv_compression is None:
        return ""
    if cfg.kv_selects_pages:  # Quest: tokens read per KV head, every page kept
        dense = cfg.compression.dense_layers
        return f"{cfg.kv_compression} {cfg.kv_budget} read" + (f" dense {dense}" if dense
                                                               else "")
    every = f" every {cfg.compression.every_n}" \
        if cfg.compression.schedule == "every_n" else ""
    return f"{cfg.kv_compression} {cfg.kv_budget}+{cfg.compression.recent_slots}{every}"


def variant_name(cfg: ModelConfig, with_model: bool = True, with_dtype: bool = True) -> str:
    """E.g. 'smollm2-135m GQA K=3 W=128+4 sinks fp32', 'smollm2-135m GQA K=3 snapkv
    512+192 fp32'."""
    parts = [cfg.name] if with_model else []
    parts += [attention_label(cfg), window_label(cfg), compression_label(cfg)]
    if with_dtype:
        parts.append(DTYPE_SHORT.get(cfg.dtype, cfg.dtype))
    return " ".join(p for p in parts if p)


PROMPT_CHARS = 160  # longer prompts are shown by their two ends on screen (JSON: whole)


def shorten(text: str, limit: int = PROMPT_CHARS) -> str:
    """``repr(text)``, or for a longer text its first and last ``limit // 2`` characters
    around a note of how many were left out."""
    if len(text) <= limit:
        return repr(text)
    half = limit // 2
    return (f"{text[:half]!r} ... [{len(text) - 2 * half:,} characters omitted; "
            f"{len(text):,} in all] ... {text[-half:]!r}")
