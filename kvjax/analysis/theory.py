"""Closed-form cost model of one autoregressive decode step.

Implements the blog "The KV Bottleneck Explained: Why Inference Is Memory-Bound"
(docs/DESIGN.md summarises its formulas), generalised from its running MHA model to
GQA/MQA (K KV heads), MLA (latent cache, DeepSeek-V2 sec. 2.1) and sliding windows.

Notation (docs/DESIGN.md; blog symbols in brackets): L layers, D d_model [d_model], N query
heads [h], K KV heads [g in "Lever 1"], H head_dim [d_k = d_v], F FFN width, V vocab,
C MLA latent width [d_c], R decoupled-RoPE key width, W window [w], t context length,
B batch, b bytes per element (2 in the blog's fp16).

Context convention, used by every function here: ``t`` is the cache length *after* the
step's own key/value was written, so attention at context ``t`` reads ``t`` keys and
``t`` values (the new token's included). The blog's Phase 3 writes this as ``t+1`` keys
when generating token ``t+1``; its boxed "Fundamental Equation" writes ``t``. Both are
this module's ``t``.

Units: bytes (B), FLOP (multiply-add = 2 FLOP, the blog's convention), seconds.
Functions taking a :class:`~kvjax.config.ModelConfig` use ``cfg.dtype_bytes`` for b (and
``cfg.kv_dtype_bytes``, the cache's element type, for KV bytes) unless ``element_bytes``
is given.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

from kvjax import compression
from kvjax.config import ModelConfig
from kvjax.analysis.hardware import Chip
from kvjax.cache import quant


def _b(cfg: ModelConfig, element_bytes: int | None) -> int:
    return cfg.dtype_bytes if element_bytes is None else element_bytes


def _kv_b(cfg: ModelConfig, element_bytes: int | None) -> int:
    """Bytes per cached element: ``cfg.kv_dtype``'s (default the model dtype's)."""
    return cfg.kv_dtype_bytes if element_bytes is None else element_bytes


# --------------------------------------------------------------------------- KV cache


def kv_elements_per_token_per_layer(cfg: ModelConfig) -> int:
    """Cached elements per token per layer.

    MHA/GQA/MQA: K·(d_k + d_v) = 2·K·H (blog "Deriving the Per-Token KV Cache Formula",
    with h -> K as in "Lever 1"). MLA: C + R, the latent c_t^KV plus the shared
    decoupled RoPE key k_t^R (DeepSeek-V2 sec. 2.1.3: (d_c + d_h^R)·l elements per token).
    """
    if cfg.is_mla:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.num_kv_heads * cfg.head_dim


def kv_rows_per_token_per_layer(cfg: ModelConfig) -> list:
    """Widths of the rows one token caches per layer, each quantized on its own:
    MHA/GQA/MQA 2·K rows of H (a key and a value per KV head), MLA [C, R]."""
    if cfg.is_mla:
        return [cfg.kv_lora_rank, cfg.qk_rope_head_dim]
    return [cfg.head_dim] * (2 * cfg.num_kv_heads)


def kv_scale_bytes_per_token(cfg: ModelConfig) -> int:
    """Bytes of the quantization scales per token over all layers (0 for a float cache).

    One float32 scale (4 B) per row and group (:mod:`kvjax.cache.quant`): int8 / fp8 one
    per row (per token per KV head), int4 one per gcd(width, 32) values. SmolLM2-135M
    (L=30, K=3, H=64), int8: 30·2·3·4 = 720 B; int4: 30·2·3·2·4 = 1,440 B.
    """
    fmt = quant.format_for(cfg) if cfg.kv_quantized else None
    if fmt is None:
        return 0
    groups = 0
    for w in kv_rows_per_token_per_layer(cfg):
        groups += w // (math.gcd(w, quant.INT4_GROUP) if fmt.bits == 4 else w)
    return cfg.num_layers * groups * 4


def kv_bytes_per_token(cfg: ModelConfig, element_bytes: int | None = None) -> int:
    """KV-cache bytes per token over all layers: L·K·(d_k+d_v)·b, or L·(C+R)·b for MLA,
    plus the scale bytes of a quantized kv_dtype (:func:`kv_scale_bytes_per_token`;
    int8 on GQA: L·2·K·(H + 4), int4 with 32-value groups: L·2·K·(H/2 + 4·H/32)).
    ``element_bytes`` overrides b and drops the scales.

    Blog model (L=12, K=N=8, H=64, fp16): 12·8·128·2 = 24,576 B ("24 KB per token").
    """
    if element_bytes is None and cfg.kv_quantized:
        codes = cfg.num_layers * kv_elements_per_token_per_layer(cfg) * quant.format_for(
            cfg).bits // 8
        return codes + kv_scale_bytes_per_token(cfg)
    return int(cfg.num_layers * kv_elements_per_token_per_layer(cfg)
               * _kv_b(cfg, element_bytes))


def kv_tensor_bytes_per_token(cfg: ModelConfig) -> dict:
    """Cache tensor name -> its bytes per token over all layers; the values sum to
    :func:`kv_bytes_per_token`.

    MHA/GQA/MQA: 'k' and 'v' L·K·H·b each; MLA: 'c_kv' L·C·b and 'k_rope' L·R·b. A
    quantized kv_dtype (:mod:`kvjax.cache.quant`) stores codes under these names
    (int4: half a byte per value) and adds 'name_scale': L·(rows per token)·(scales per
    row)·4 B, e.g. SmolLM2-135M int8 'k' 30·3·64 = 5,760 B, 'k_scale' 30·3·4 = 360 B.
    """
    widths = ({"c_kv": [cfg.kv_lora_rank], "k_rope": [cfg.qk_rope_head_dim]} if cfg.is_mla
              else {n: [cfg.head_dim] * cfg.num_kv_heads for n in ("k", "v")})
    fmt = quant.format_for(cfg) if cfg.kv_quantized else None
    out = {}
    for name, ws in widths.items():
        if fmt is None:
            out[name] = int(cfg.num_layers * sum(ws) * _kv_b(cfg, None))
            continue
        out[name] = cfg.num_layers * sum(w * fmt.bits // 8 for w in ws)
        out[quant.scale_name(name)] = cfg.num_layers * sum(
            fmt.scale_width(w) * np.dtype(quant.SCALE_DTYPE).itemsize for w in ws)
    return out


def kv_bytes_per_token_blog(num_layers: int, d_model: int, element_bytes: int = 2) -> int:
    """Blog's boxed simplification 4·L·D bytes/token (fp16, h·d_k = D, d_k = d_v).

    General form: 2·L·D·b ("Simplification using h·d_k = d_model").
    """
    return 2 * num_layers * d_model * element_bytes


def kv_bytes_per_token_latent_blog(num_layers: int, latent_dim: int,
                                   element_bytes: int = 2) -> int:
    """Blog "Lever 2": a latent cache of d_c elements per layer costs L·d_c·b bytes/token.

    The blog omits MLA's decoupled RoPE key (R elements per layer); see
    :func:`kv_bytes_per_token` for the DeepSeek-V2 count L·(C+R)·b.
    """
    return num_layers * latent_dim * element_bytes


def tokens_held(cfg: ModelConfig, t: int) -> int:
    """Tokens in the cache at context ``t``: min(t, W) with a window, else t.

    Attention sinks live inside the window budget (first s + last W-s tokens), so they do
    not change the count (blog "Lever 3": cache bytes are constant in t once t >= W). A
    compressed cache (lever 5, ``kv_compression``) holds W = kv_budget + recent_slots
    (``ModelConfig.cache_window``): the kept slots and the ring after them.
    """
    if t < 0:
        raise ValueError(f"t={t}; allowed: an integer >= 0")
    return t if cfg.cache_window is None else min(t, cfg.cache_window)


def layer_tokens_held(cfg: ModelConfig, t: int) -> list:
    """[min(t, W_i)] per layer: tokens each layer's cache holds at context ``t``, with
    ``cfg.layer_windows`` (a local layer its window W_i, a global one t) or per-layer
    compression budgets (``cfg.layer_budgets``: W_i = b_i + recent_slots); else L times
    :func:`tokens_held`."""
    return [tokens_held(cfg.layer_config(i), t) for i in range(cfg.num_layers)]


def kv_cache_bytes(cfg: ModelConfig, t: int, batch: int = 1,
                   element_bytes: int | None = None) -> int:
    """Bytes of the KV caches of ``batch`` sequences at context ``t``.

    B·kv_bytes_per_token·min(t, W). Blog: 24,576·4,096 = 100,663,296 B ("96 MB");
    at 128,000 tokens 3,145,728,000 B ("3 GB"). With ``cfg.layer_windows`` the sum over
    layers B·(kv_bytes_per_token / L)·sum_i min(t, W_i) (Gemma 3, Team 2025 sec. 2.2:
    local layers of W = 1024 hold a constant cache, global ones grow with t); the same
    sum with per-layer compression budgets (PyramidKV: W_i = b_i + recent_slots).
    """
    per_layer = kv_bytes_per_token(cfg, element_bytes) // cfg.num_layers
    return batch * per_layer * sum(layer_tokens_held(cfg, t))


def kv_bytes_per_context_token(cfg: ModelConfig, t: int,
                               element_bytes: int | None = None) -> float:
    """KV bytes per token of context at ``t``: kv_cache_bytes(t) / t. Equal to
    :func:`kv_bytes_per_token` for full attention; falls as 1/t once the windows
    fill (a window, or the local layers of ``layer_windows``)."""
    if t <= 0:
        raise ValueError(f"t={t}; allowed: an integer >= 1")
    return kv_cache_bytes(cfg, t, 1, element_bytes) / t


def schedule_overhead(cfg: ModelConfig, batch: int = 1) -> dict:
    """Lever 5's decode-time scoring overhead under ``model.compression.schedule``
    'every_n' (:func:`kvjax.cache.compress.recompress`); zeros for 'prefill' or no
    compression (the prefill's one scoring is :func:`kvjax.analysis.costs.compression_overhead`).

    With S = kv_budget + recent_slots, N = every_n, Q the buffered queries the method
    reads (0, 1, min(w, N) or N) and e the model dtype's bytes:

    * state (``KVCache.schedule``, held beside the cache, not in its bytes): N queries
      L·B·N·N_heads·H·e, their positions and count 4·B·(N + 1), each kept slot's
      position per KV head 4·L·B·K·kv_budget, and for a method reading every query
      (H2O) the accumulated attention 4·L·B·K·kv_budget (float32; accumulated at each
      compression from the buffered queries, which see exactly the slots the decode
      steps saw: no slot is evicted between two compressions);
    * per compression: reads of every held slot of every layer (the cache's bytes at S)
      and the state; the move of the kv_budget kept slots (read and written); FLOPs of
      the Q queries' attention over S slots (4·Q·N_heads·S·H for the scores and the
      weighted sum, ~5·Q·N_heads·S for the softmax) and the top-k (~S·log2 S per KV
      head), per layer and row;
    * per decode step: the compression's bytes and FLOPs divided by N.

    Returns:
      dict: 'every_n' (0: none), 'state_bytes', 'read_bytes', 'move_bytes', 'flops',
      'bytes_per_step', 'flops_per_step'.
    """
    c = cfg.compression
    if cfg.kv_compression is None or c.schedule != "every_n":
        return dict(every_n=0, state_bytes=0, read_bytes=0, move_bytes=0, flops=0,
                    bytes_per_step=0.0, flops_per_step=0.0)
    need = compression.get(cfg.kv_compression).queries
    n, l, kh, h, budget = c.every_n, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, \
        cfg.kv_budget
    s = budget + c.recent_slots
    state = (l * batch * n * cfg.num_heads * h * cfg.dtype_bytes + 4 * batch * (n + 1)
             + 4 * l * batch * kh * budget * (2 if need == "all" else 1))
    cache = kv_cache_bytes(cfg, s, batch)
    q = {"none": 0, "last": 1, "all": n, "window": min(c.observation_window, n)}[need]
    read = cache + state
    move = 2 * cache * budget // s
    flops = l * batch * (4 * q * cfg.num_heads * s * h + 5 * q * cfg.num_heads * s
                         + kh * s * max(1, math.ceil(math.log2(s))))
    return dict(every_n=n, state_bytes=state, read_bytes=read, move_bytes=move,
                flops=flops, bytes_per_step=(read + move) / n, flops_per_step=flops / n)


# --------------------------------------------------------------------------- weights


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    """Parameter counts (elements) by part.

    attention: every attention weight of all layers (MLA: its projections and latent norms).
    mlp: FFN weights of all layers. norms: 2 RMSNorm scales per layer (4 with Gemma's
    post-norms) + the final one.
    embedding: V·D token table. lm_head: V·D if untied, else 0 (it is the embedding).
    """

    attention: int
    mlp: int
    norms: int
    embedding: int
    lm_head: int

    @property
    def layer_matrices(self) -> int:
        """Attention + MLP matrices: the blog's 12·D² per layer ("Category 1")."""
        return self.attention + self.mlp

    @property
    def total(self) -> int:
        return self.attention + self.mlp + self.norms + self.embedding + self.lm_head


def attention_params_per_layer(cfg: ModelConfig) -> int:
    """Attention parameters of one layer.

    MHA/GQA/MQA: W_Q D·N·H + W_K, W_V D·K·H each + W_O N·H·D, plus with ``qkv_bias``
    (Qwen2) the biases N·H + 2·K·H and with ``qk_norm`` (Qwen3) the two per-head norm
    scales 2·H.
    MLA (DeepSeek-V2 sec. 2.1): W_DKV D·C, W_KR D·R, W_UK C·N·nope, W_UV C·N·v,
    W_Q D·N·(nope+R) (or W_DQ D·q_lora + W_UQ/W_QR q_lora·N·(nope+R) plus the q-latent
    norm q_lora), W_O N·v·D, and the kv-latent RMSNorm C.
    """
    d, n = cfg.d_model, cfg.num_heads
    if not cfg.is_mla:
        h, k = cfg.head_dim, cfg.num_kv_heads
        bias = (n * h + 2 * k * h) if cfg.qkv_bias else 0
        norms = 2 * h if cfg.qk_norm else 0
        return d * n * h + 2 * d * k * h + n * h * d + bias + norms
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    qk = n * (nope + r)
    if cfg.q_lora_rank is None:
        q = d * qk
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank * qk + cfg.q_lora_rank
    return q + d * c + d * r + c * n * nope + c * n * v + n * v * d + c


def mlp_params_per_layer(cfg: ModelConfig) -> int:
    """FFN parameters of one layer: SwiGLU / GeGLU 3·D·F (gate, up, down), GELU 2·D·F
    (W1, W2); a mixture of experts (``num_experts`` E) D·E (router) + E·3·D·Fe + the
    shared experts' 3·D·(n_shared·Fe)."""
    if cfg.num_experts:
        shared = cfg.num_shared_experts * cfg.moe_mlp_dim
        return cfg.d_model * (cfg.num_experts + 3 * cfg.num_experts * cfg.moe_mlp_dim
                              + 3 * shared)
    return (2 if cfg.mlp_type == "gelu" else 3) * cfg.d_model * cfg.mlp_dim


def param_counts(cfg: ModelConfig) -> ParamCounts:
    """Exact parameter counts from the shapes of kvjax's decoder (RMSNorm; biases only
    on q/k/v with ``qkv_bias``)."""
    d, v, l = cfg.d_model, cfg.vocab_size, cfg.num_layers
    return ParamCounts(
        attention=l * attention_params_per_layer(cfg),
        mlp=sum(mlp_params_per_layer(cfg.layer_config(i)) for i in range(l)),
        norms=(4 if cfg.post_norms else 2) * d * l + d,
        embedding=v * d,
        lm_head=0 if cfg.tie_embeddings else v * d,
    )


def weight_bytes(cfg: ModelConfig, element_bytes: int | None = None) -> int:
    """Bytes of all parameters (what must sit in memory), from exact shapes."""
    return param_counts(cfg).total * _b(cfg, element_bytes)


def weight_bytes_per_step(cfg: ModelConfig, element_bytes: int | None = None) -> int:
    """Weight bytes read from memory by one decode step.

    Every layer matrix and norm, plus the V·D output matrix once: the LM head reads it
    whole, while the embedding lookup gathers one D-row per token (D·b bytes, ignored
    here). Tied: the shared V·D matrix counted once; untied: the LM head's V·D.
    The blog's "Category 1" counts only the layer matrices (:func:`weight_bytes_blog`).
    """
    p = param_counts(cfg)
    return (p.layer_matrices + p.norms + cfg.vocab_size * cfg.d_model) * _b(cfg, element_bytes)


def weight_bytes_blog(num_layers: int, d_model: int, element_bytes: int = 2) -> int:
    """Blog "Category 1": 12·D² parameters per layer (4D² attention + 8D² FFN with F=4D),
    i.e. 24·L·D² bytes in fp16. Blog model: 24·12·512² = 75,497,472 B ("72 MB" = 72 MiB).
    """
    return 12 * num_layers * d_model**2 * element_bytes


# --------------------------------------------------------------------------- bytes per step


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Memory traffic of one decode step, bytes.

    weights: weight bytes read (fixed in t). kv_read: B·(cache bytes at context t).
    kv_write: B·kv_bytes_per_token, the new token's K/V (blog "Phase 2", 2 KB per layer
    for the blog model; the blog drops it from the boxed equation).
    """

    weights: int
    kv_read: int
    kv_write: int

    @property
    def read(self) -> int:
        """weights + kv_read: the blog's boxed B_step(t)."""
        return self.weights + self.kv_read

    @property
    def total(self) -> int:
        """All traffic: weights + kv_read + kv_write."""
        return self.weights + self.kv_read + self.kv_write

    def as_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv_read": self.kv_read, "kv_write": self.kv_write,
                "read": self.read, "total": self.total}


def step_bytes(cfg: ModelConfig, t: int, batch: int = 1, weights: int | None = None,
               element_bytes: int | None = None) -> StepBytes:
    """Bytes moved by one decode step at context ``t`` for ``batch`` sequences.

    Blog "The Fundamental Equation of Inference Throughput":
    B_step(t) = weight bytes (read once, shared by the batch) + B·KV bytes(t).
    ``weights`` overrides the weight term (e.g. ``weight_bytes_blog(L, D)`` to reproduce
    the blog); by default :func:`weight_bytes_per_step`. MLA counts the latent cache read
    only (no materialised K/V, which would be naive-path activations).
    """
    w = weight_bytes_per_step(cfg, element_bytes) if weights is None else weights
    return StepBytes(
        weights=int(w),
        kv_read=kv_cache_bytes(cfg, t, batch, element_bytes)
        + sink_rescore_bytes(cfg, batch, element_bytes),
        kv_write=batch * kv_bytes_per_token(cfg, element_bytes),
    )


def page_selection_step_bytes(cfg: ModelConfig, t: int, page_size: int, batch: int = 1,
                              weights: int | None = None) -> dict:
    """Bytes of one decode step at context ``t`` under a read-time page selection (lever
    5 at read time, Quest: Tang et al. 2024 sec. 3.2, ``cfg.kv_selects_pages``) over a
    paged cache of ``page_size`` P tokens per page.

    Each KV head of each selecting layer reads C = kv_budget / P pages, at most the
    ceil(t / P) pages the row holds: min(kv_budget, P·ceil(t / P)) tokens' keys and
    values; each of the first d = ``compression.dense_layers`` layers reads all t
    tokens (the ordinary paged read, :func:`kv_cache_bytes`; Quest's paper: d = 2). So
    kv_read = (d·t + (L - d)·min(kv_budget, P·ceil(t / P)))·(:func:`kv_bytes_per_token`
    / L). The selecting layers read every held page's key bounds, ceil(t / P)·(L - d)·
    2·K·H elements in the model dtype, and write the step's token's page bounds once,
    (L - d)·2·K·H elements (plus its token's K/V in every layer).

    Returns:
      {'weights', 'kv_read' (the selected pages), 'bounds_read', 'kv_write' (the token's
      K/V), 'bounds_write', 'total'} in bytes, for ``batch`` rows.
    Raises:
      ValueError: a config without a read-time page selection, or page_size below 1.
    """
    if not cfg.kv_selects_pages:
        raise ValueError(f"page_selection_step_bytes with model.kv_compression="
                         f"{cfg.kv_compression!r}; allowed: a read-time page selection "
                         "(quest)")
    if page_size < 1:
        raise ValueError(f"page_size={page_size}; allowed: an integer >= 1")
    pages = -(-int(t) // page_size)
    read = min(cfg.kv_budget, pages * page_size)
    plain = cfg.replace(kv_compression=None, kv_budget=None, compression=dataclasses.replace(
        cfg.compression, dense_layers=0))
    dense, num_layers = cfg.compression.dense_layers, cfg.num_layers
    per_layer = kv_bytes_per_token(plain) // num_layers  # exact: each term has a factor L
    bound = 2 * (num_layers - dense) * cfg.num_kv_heads * cfg.head_dim * cfg.dtype_bytes
    out = {"weights": int(weight_bytes_per_step(cfg) if weights is None else weights),
           "kv_read": batch * (dense * tokens_held(plain, t)
                               + (num_layers - dense) * read) * per_layer,
           "bounds_read": batch * pages * bound,
           "kv_write": batch * kv_bytes_per_token(plain),
           "bounds_write": batch * bound}
    out["total"] = sum(out.values())
    return out


def _cache_sinks(cfg: ModelConfig) -> int:
    """Sinks scored a second time per layer (``rope_positions='cache'``), else 0."""
    return cfg.num_sink_tokens if cfg.rope_positions == "cache" else 0


def sink_rescore_bytes(cfg: ModelConfig, batch: int = 1,
                       element_bytes: int | None = None) -> int:
    """Extra KV bytes a decode step reads when sinks sit at cache positions
    (``rope_positions='cache'``, StreamingLLM sec. 3.2): the s sink keys are scored again
    with the query rotated at its cache position: B·L·s·K·H·b (keys only; 0 with
    absolute positions). FLOPs: + 2·N·s·H per layer (in :func:`step_flops`' attn)."""
    if _cache_sinks(cfg) == 0 or cfg.is_mla:
        return 0
    return (batch * cfg.num_layers * cfg.num_sink_tokens * cfg.num_kv_heads * cfg.head_dim
            * _kv_b(cfg, element_bytes))


def mla_unfused_extra_bytes(cfg: ModelConfig, t: int, batch: int = 1,
                            absorbed: bool | None = None,
                            element_bytes: int | None = None) -> int:
    """Bytes an MLA decode step built from one op per contraction (XLA, no fused attention
    kernel) must move beyond :func:`step_bytes`, which reads the latent cache once.

    absorbed (``True``): the latent is contracted twice, over C for the scores and over the
    t' keys for ``probs·c``, so it is read twice: + B·L·t'·C·b.
    naive (``False``): both up-projections read the latent (+ B·L·t'·C·b), and the rebuilt
    K [t', N, nope] and V [t', N, v] are written and read back: + 2·B·L·t'·N·(nope+v)·b.
    Lower bounds: scores, masks and layout copies are not counted. t' = min(t, W); 0 for
    non-MLA configs. ``absorbed`` defaults to ``cfg.mla_absorb``.
    """
    if not cfg.is_mla:
        return 0
    absorbed = cfg.mla_absorb if absorbed is None else absorbed
    b = _b(cfg, element_bytes)
    rows = batch * cfg.num_layers * tokens_held(cfg, t)
    extra = rows * cfg.kv_lora_rank * _kv_b(cfg, element_bytes)
    if not absorbed:
        extra += 2 * rows * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * b
    return extra


# --------------------------------------------------------------------------- FLOPs per step


@dataclasses.dataclass(frozen=True)
class StepFlops:
    """FLOP of one decode step (all layers, all sequences), by part.

    proj: Q/K/V/O projections (MLA: also the absorbed up-projections, per token).
    kv_rebuild: MLA naive path only: re-projecting the t cached latents to K/V.
    attn: scores + softmax + weighted values over the keys attended (blog "Phase 3").
    mlp: FFN. lm_head: 2·D·V logits.
    """

    proj: int
    kv_rebuild: int
    attn: int
    mlp: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.proj + self.kv_rebuild + self.attn + self.mlp + self.lm_head

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


def attention_flops_per_head(score_dim: int, value_dim: int, keys: int) -> int:
    """One query head over ``keys`` keys (blog "Phase 3"): 2·d_k·t (3a scores)
    + 4·t (3b scale + softmax) + 2·d_v·t (3c values). d_k = d_v = 64: 260·t.
    """
    return 2 * score_dim * keys + 4 * keys + 2 * value_dim * keys


def step_flops(cfg: ModelConfig, t: int, batch: int = 1,
               absorbed: bool | None = None) -> StepFlops:
    """FLOP of one decode step at context ``t`` (``t`` keys read, own key included).

    Per layer per token, MHA/GQA/MQA:
      proj 2·D·(N·H + 2·K·H) + 2·N·H·D (blog "Phase 1" is the first term for N=K);
      attn N·(2·H·t' + 4·t' + 2·H·t') with t' = min(t, W) keys (blog: 260(t+1) per head).
    MLA (DeepSeek-V2 sec. 2.1), q path 2·D·N·(nope+R) (or through q_lora), latent
    down-projections 2·D·(C+R), output 2·N·v·D, and
      naive (``absorbed=False``): rebuild K/V from all t' latents, 2·t'·C·N·(nope+v)
        (``kv_rebuild``); attention per head over nope+R score dims and v value dims;
      absorbed (``True``): W_UK folded into the query (2·N·nope·C) and W_UV applied after
        attention (2·N·C·v), both per token in ``proj``; attention per head over C+R score
        dims and C value dims.
    ``absorbed`` defaults to ``cfg.mla_absorb``.
    MLP: SwiGLU / GeGLU 6·D·F, GELU 4·D·F, MoE :func:`_mlp_flops`. LM head 2·D·V once
    per token. Everything scales with B.
    """
    d, n, l = cfg.d_model, cfg.num_heads, cfg.num_layers
    keys = tokens_held(cfg, t)
    rebuild = 0
    if not cfg.is_mla:
        h, k = cfg.head_dim, cfg.num_kv_heads
        proj = 2 * d * (n * h + 2 * k * h) + 2 * n * h * d
        attn = n * attention_flops_per_head(h, h, keys) + 2 * n * h * _cache_sinks(cfg)
        if cfg.per_layer_slots:  # each layer over its own keys: the mean
            attn = sum(n * attention_flops_per_head(h, h, x)
                       for x in layer_tokens_held(cfg, t)) / l
    else:
        absorbed = cfg.mla_absorb if absorbed is None else absorbed
        c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        qk = n * (nope + r)
        q = 2 * d * qk if cfg.q_lora_rank is None else 2 * cfg.q_lora_rank * (d + qk)
        proj = q + 2 * d * (c + r) + 2 * n * v * d
        if absorbed:
            proj += 2 * n * c * (nope + v)
            attn = n * attention_flops_per_head(c + r, c, keys)
        else:
            rebuild = 2 * keys * c * n * (nope + v)
            attn = n * attention_flops_per_head(nope + r, v, keys)
    mlp = sum(_mlp_flops(cfg.layer_config(i)) for i in range(l)) / l
    return StepFlops(
        proj=batch * l * proj,
        kv_rebuild=batch * l * rebuild,
        attn=int(round(batch * l * attn)),
        mlp=int(round(batch * l * mlp)),
        lm_head=batch * 2 * d * cfg.vocab_size,
    )


def _mlp_flops(cfg: ModelConfig) -> int:
    """One layer's MLP FLOP per token: SwiGLU / GeGLU 6·D·F, GELU 4·D·F; a mixture of
    experts as kvjax computes it (:class:`kvjax.models.layers.MoE`: every expert, then
    weighted) 2·D·E (router) + E·6·D·Fe + 6·D·(n_shared·Fe)."""
    d = cfg.d_model
    if cfg.num_experts:
        e, fe = cfg.num_experts, cfg.moe_mlp_dim
        return 2 * d * e + 6 * d * fe * (e + cfg.num_shared_experts)
    return (4 if cfg.mlp_type == "gelu" else 6) * d * cfg.mlp_dim


# --------------------------------------------------------------------------- prefill


def _attention_dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(score dims, value dims, query heads, key/value heads) of the prompt attention:
    MHA/GQA/MQA (H, H, N, K); absorbed MLA (C + R, C, N, 1: the latent is the one shared
    key and value); naive MLA (nope + R, v, N, N: rebuilt per-head keys and values)."""
    n = cfg.num_heads
    if not cfg.is_mla:
        return cfg.head_dim, cfg.head_dim, n, cfg.num_kv_heads
    c, r = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if cfg.mla_absorb:
        return c + r, c, n, 1
    return cfg.qk_nope_head_dim + r, cfg.v_head_dim, n, n


def prefill_flops(cfg: ModelConfig, t: int, batch: int = 1, lm_head_positions: int = 1,
                  element_bytes: int | None = None) -> int:
    """FLOP of a causal prefill of ``t`` tokens: the decode-step FLOP summed over the
    prompt positions p = 1..t (position p attends to min(p, W) keys, blog "Phase 3";
    step FLOP is affine in p below W), with the LM head counted for
    ``lm_head_positions`` positions (kvjax's prefill computes the last one only).
    ``element_bytes`` is unused (FLOP do not depend on it); kept for a uniform call."""
    del element_bytes
    if t <= 0:
        raise ValueError(f"t={t}; allowed: an integer >= 1")
    if not 0 <= lm_head_positions <= t:
        raise ValueError(f"lm_head_positions={lm_head_positions}; allowed: 0..t={t}")
    if cfg.layer_windows is not None:  # each layer at its own window: the layer mean
        parts = [prefill_flops(cfg.layer_config(i), t, batch, lm_head_positions)
                 for i in range(cfg.num_layers)]
        return int(round(sum(parts) / cfg.num_layers))
    w = t if cfg.window_size is None else min(t, cfg.window_size)
    f1 = step_flops(cfg, 1, batch)
    slope = step_flops(cfg, 2, batch).total - f1.total
    no_head = f1.total - f1.lm_head
    # positions 1..w: affine in p; positions w+1..t: the step at w keys
    total = w * (no_head - slope) + slope * w * (w + 1) // 2
    total += (t - w) * (step_flops(cfg, w, batch).total - f1.lm_head)
    return int(total + lm_head_positions * f1.lm_head)


def prefill_attention_flops(cfg: ModelConfig, t: int, batch: int = 1) -> int:
    """FLOP of a causal prefill's attention alone (scores, softmax, values; no
    projections), all layers: position p = 1..t attends to min(p, W) keys, each query head
    :func:`attention_flops_per_head`. What a fused kernel XLA cannot cost (a custom call,
    ``prefill_impl='native'``) computes, by this theory."""
    if t <= 0:
        raise ValueError(f"t={t}; allowed: an integer >= 1")
    sd, vd, n, _ = _attention_dims(cfg)
    if cfg.layer_windows is not None:  # each layer at its own window
        return sum(prefill_attention_flops(cfg.layer_config(i), t, batch)
                   for i in range(cfg.num_layers)) // cfg.num_layers
    w = t if cfg.window_size is None else min(t, cfg.window_size)
    keys = w * (w + 1) // 2 + (t - w) * w
    return batch * cfg.num_layers * n * attention_flops_per_head(sd, vd, keys)


def attention_io_standard(cfg: ModelConfig, t: int, batch: int = 1,
                          element_bytes: int | None = None, score_bytes: int = 4) -> int:
    """Memory traffic (bytes) of standard attention over a ``t``-token prompt, all layers:
    FlashAttention (Dao et al. 2022) Algorithm 0, per layer and query head: read Q, K
    (2·t·d), write S = QK^T (t²), read S and write P = softmax(S) (2·t²), read P and V
    (t² + t·d), write O (t·d): 4·t·d + 4·t² elements, Θ(t·d + t²) (the blog's FlashAttention
    section). Scores in ``score_bytes`` (kvjax computes them in float32), the rest in b."""
    sd, vd, n, _ = _attention_dims(cfg)
    b = _b(cfg, element_bytes)
    per_head = (2 * t * sd + 2 * t * vd) * b + 4 * t * t * score_bytes
    return batch * cfg.num_layers * n * per_head


def attention_io_tiled(cfg: ModelConfig, t: int, num_pairs: int, block_k: int,
                       batch: int = 1, element_bytes: int | None = None) -> int:
    """Memory traffic (bytes) of tiled attention over a ``t``-token prompt, all layers,
    when no tile of scores leaves fast memory (FlashAttention, Dao et al. 2022,
    Algorithm 1, with the query loop outside as in its FlashAttention-2 form): per layer
    every query block is read and its output written once, t·N·(d_k + d_v) elements, and
    each of the ``num_pairs`` (query block, key block) tiles computed reads its key and
    value block once per KV head, num_pairs·block_k·K·(d_k + d_v). With block sizes ~
    M/d for a fast memory of M elements and causal skipping (num_pairs ~ (t/block)²/2),
    this is Θ(t²·d²/M) (Theorem 2). ``num_pairs``: ``flash.num_chunk_pairs``."""
    sd, vd, n, kv = _attention_dims(cfg)
    b = _b(cfg, element_bytes)
    per_layer = t * n * (sd + vd) + num_pairs * block_k * kv * (sd + vd)
    return batch * cfg.num_layers * per_layer * b


def prefill_activation_bytes(cfg: ModelConfig, t: int, batch: int = 1,
                             element_bytes: int | None = None) -> int | None:
    """Activation traffic (bytes) of a ``t``-token prefill through an UNFUSED layer stack,
    all layers, outside the attention's own IO (:func:`attention_io_tiled` counts Q, K, V
    and O): every matrix product reads its input rows and writes its output rows once,
    every elementwise op reads its operands and writes its result once. Per token and
    layer, in elements (D = d_model, N·H query width, K·H key width, F = mlp_dim):
    RMSNorm 2D; q, k, v projections 3D read + N·H + 2·K·H written; RoPE 2·(N·H + K·H);
    output projection N·H + D; residual 3D; RMSNorm 2D; SwiGLU MLP gate and up D + F each,
    silu·mul 3F, down F + D (a GELU MLP: up D + F, activation 2F, down F + D); residual
    3D. Plus the embedding rows written, t·D. What a stack that fuses nothing into its
    matrix products (XLA:CPU's dots, up to the elementwise ops it merges) moves beyond
    the 'weights + KV' theory: Θ(t·d), and at t in the thousands more than the weights.
    None for MLA (its projections differ; not modelled)."""
    if cfg.is_mla:
        return None
    d, f, nh, kh = cfg.d_model, cfg.mlp_dim, cfg.num_heads * cfg.head_dim, \
        cfg.num_kv_heads * cfg.head_dim
    mlp = (d + f + 2 * f + f + d) if cfg.mlp_type == "gelu" else (2 * (d + f) + 3 * f + f + d)
    per_layer = (2 * d + 3 * d + nh + 2 * kh + 2 * (nh + kh) + nh + d + 3 * d + 2 * d + mlp
                 + 3 * d)
    return batch * t * (cfg.num_layers * per_layer + d) * _b(cfg, element_bytes)


# --------------------------------------------------------------------------- roofline


def arithmetic_intensity(flops: float, num_bytes: float) -> float:
    """FLOP per byte moved (blog "The Roofline Model"); matrix-vector in fp16: ~1.0."""
    return flops / num_bytes


def memory_time(num_bytes: float, chip: Chip) -> float:
    """Seconds to move ``num_bytes`` at the chip's HBM bandwidth: bytes / (bytes/s)."""
    return num_bytes / chip.hbm_bytes_per_s


def compute_time(flops: float, chip: Chip, dtype: Any = "float16") -> float | None:
    """Seconds for ``flops`` at the chip's peak for ``dtype``; None if the peak is unknown."""
    peak = chip.peak_flops(dtype)
    return None if peak is None else flops / peak


def step_time(num_bytes: float, flops: float, chip: Chip, dtype: Any = "float16") -> float:
    """Roofline step time, seconds: max(bytes / bandwidth, FLOP / peak).

    Blog "Why Memory Bandwidth Is the Right Metric": T_step = max(T_compute, T_memory).
    With an unknown peak (an unmeasured CPU) only the memory term is used.
    """
    mem = memory_time(num_bytes, chip)
    comp = compute_time(flops, chip, dtype)
    return mem if comp is None else max(mem, comp)


def batched_steps(cfg: ModelConfig, t: int, batches, bytes_per_s: float,
                  flops_per_s: float | None = None) -> dict[int, dict]:
    """Predicted decode steps at context ``t`` for each batch size in ``batches``, by two
    theories, and their ratios to the first batch size.

    * bandwidth only (the blog's "batching amortises the weights"): step = bytes /
      ``bytes_per_s`` with bytes = weights (read once) + B·KV (:func:`step_bytes`);
    * the roofline (Williams et al. 2009): step = max(bytes / ``bytes_per_s``, FLOP /
      ``flops_per_s``) with FLOP = :func:`step_flops` (2 per weight per row, plus
      attention): the weight products become compute-bound near B = peak / (bandwidth
      · 0.5 FLOP/byte), on the 2-core CPUs 8-16 rows
      (docs/decisions/0027-serial-roofline.md);
    * serial (no overlap): step = bytes / ``bytes_per_s`` + FLOP / ``flops_per_s``, the
      arithmetic and the reads one after the other, the roofline's upper bound. It is
      what a core whose FMAs and memory stream add up instead of overlapping reaches at
      best; ``scripts/overlap_check.py`` measures which of the two a machine follows
      (the 2-core Intel Xeon of the README: serial within 0-7% per product).

    Returns {B: {'bytes', 'flops', 'bandwidth_s', 'roofline_s', 'serial_s',
    'bandwidth_ratio', 'roofline_ratio', 'serial_ratio', 'bandwidth_tokens_ratio',
    'roofline_tokens_ratio', 'serial_tokens_ratio'}} (bytes, FLOP, seconds; ratios of
    step time and of tokens/s = B / step to the first B). Without ``flops_per_s`` the
    roofline and the serial model equal the bandwidth theory.

    Raises:
      ValueError: an empty ``batches``, a batch size that is not an integer >= 1, a
        non-positive rate or an infinite bandwidth.
    """
    batches = list(batches)
    if not batches or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1
                          for b in batches):
        raise ValueError(f"batches={batches}; allowed: a non-empty list of integers >= 1")
    if not (0 < bytes_per_s < math.inf) or (flops_per_s is not None and not flops_per_s > 0):
        raise ValueError(f"bytes_per_s={bytes_per_s}, flops_per_s={flops_per_s}; "
                         "allowed: positive rates, the bandwidth finite (flops_per_s may "
                         "be None or inf: no compute term)")
    out = {}
    for b in batches:
        nbytes, flops = step_bytes(cfg, t, b).total, step_flops(cfg, t, b).total
        mem = nbytes / bytes_per_s
        comp = 0.0 if flops_per_s is None else flops / flops_per_s
        out[b] = {"bytes": nbytes, "flops": flops, "bandwidth_s": mem,
                  "roofline_s": max(mem, comp), "serial_s": mem + comp}
    first = out[batches[0]]
    for b, row in out.items():
        for name in ("bandwidth", "roofline", "serial"):
            row[f"{name}_ratio"] = row[f"{name}_s"] / first[f"{name}_s"]
            row[f"{name}_tokens_ratio"] = b / batches[0] / row[f"{name}_ratio"]
    return out


def crossover_context(cfg: ModelConfig, weights: int | None = None,
                      element_bytes: int | None = None) -> float:
    """t* (tokens) where KV bytes read per step equal the weight bytes per step.

    t* = weight bytes / kv_bytes_per_token (blog "The crossover"); ``weights`` overrides
    :func:`weight_bytes_per_step`. With a window whose full cache stays below the weights,
    the KV read never catches up: ``math.inf``.
    """
    w = weight_bytes_per_step(cfg, element_bytes) if weights is None else weights
    t_star = w / kv_bytes_per_token(cfg, element_bytes)
    if cfg.cache_window is not None and cfg.cache_window < t_star:
        return math.inf
    if cfg.per_layer_slots:  # the smallest t where the per-layer sum reaches w
        lo, hi = 1, 1
        caps = [c.cache_window for c in map(cfg.layer_config, range(cfg.num_layers))]
        while kv_cache_bytes(cfg, hi, 1, element_bytes) < w:
            if None not in caps and hi > max(caps):
                return math.inf
            lo, hi = hi, hi * 2
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if kv_cache_bytes(cfg, mid, 1, element_bytes) < w \
                else (lo, mid)
        return float(lo)
    return t_star


def crossover_context_blog(d_model: int) -> int:
    """Blog's t* = 6·D tokens (24·L·D² weights = 4·L·D·t KV). D=512: 3,072."""
    return 6 * d_model


def kv_to_weight_ratio(t: float, d_model: int) -> float:
    """Blog "The KV Cache vs. Model Weight Ratio": KV bytes / weight bytes = t / (6·D)."""
    return t / (6 * d_model)


def max_batch(cfg: ModelConfig, t: int, memory_bytes: float, reserve_bytes: float = 0,
              element_bytes: int | None = None) -> int:
    """Sequences whose KV caches at context ``t`` fit in ``memory_bytes - reserve_bytes``.

    Units: ``memory_bytes`` and ``reserve_bytes`` in bytes (B), the result a count of
    sequences. Blog "The memory capacity wall": "~60 GB" of an 80 GB A100 left for
    caches, "60,000 / 96 ~ 625" requests at 4K context and "60,000 / 3,000 ~ 20" at 128K.
    The blog's "MB" are MiB (96 MB = 100,663,296 B), so its quotients hold for
    60,000 MiB = 62,914,560,000 B: ``max_batch(blog, 4096, 60_000 * 2**20) == 625`` and
    ``== 20`` at t = 128,000; 60 GB read as 60e9 B gives 596 and 19. Pass the memory free
    for caches, or the whole memory with weights etc. in ``reserve_bytes``.

    Returns 0 when not one sequence fits (e.g. the weights alone exceed the memory);
    :func:`batch_fit` says why and what would fit.

    Raises:
      ValueError: t = 0 (an empty cache fits any batch) or a negative t.
    """
    return batch_fit(cfg, t, memory_bytes, reserve_bytes, element_bytes).batch


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """How many sequences fit, and why not more (:func:`batch_fit`).

    Attributes:
      batch: sequences whose caches fit (what :func:`max_batch` returns).
      per_sequence_bytes: one sequence's KV cache at the context asked, bytes.
      free_bytes: memory_bytes - reserve_bytes (negative when the reserve exceeds it).
      max_context: the longest context one sequence could hold in ``free_bytes``
        (tokens; None when any context fits, i.e. a windowed cache that fits; 0 when
        nothing is free).
      devices_needed: devices of ``memory_bytes`` each that hold the reserve and one
        sequence when both are split evenly across them (1 when one sequence fits).
      weight_options: {bytes per parameter: sequences that would fit} for weights stored
        at 4, 2, 1 and 0.5 bytes (float32, 16-bit, int8, int4), taking the reserve as the
        model's weights at ``cfg.dtype`` plus the rest; empty unless the reserve covers
        them (reserve_bytes >= :func:`weight_bytes`).
      reason: one sentence: the count, or why it is 0 and what would fit.
    """

    batch: int
    per_sequence_bytes: int
    free_bytes: float
    max_context: int | None
    devices_needed: int
    weight_options: dict
    reason: str


def batch_fit(cfg: ModelConfig, t: int, memory_bytes: float, reserve_bytes: float = 0,
              element_bytes: int | None = None) -> BatchFit:
    """:func:`max_batch` with its reasons (same arguments, bytes): a :class:`BatchFit`.

    Raises:
      ValueError: t = 0 (an empty cache fits any batch) or a negative t.
    """
    per_seq = kv_cache_bytes(cfg, t, 1, element_bytes)
    if per_seq == 0:
        raise ValueError("an empty cache (t=0) fits any batch; pass t >= 1")
    free = memory_bytes - reserve_bytes
    batch = max(0, math.floor(free / per_seq))
    per_token = kv_bytes_per_token(cfg, element_bytes)
    if batch >= 1 and (cfg.cache_window is not None or (
            cfg.layer_windows is not None and None not in cfg.layer_windows)):
        max_context = None
    else:
        max_context = max(0, math.floor(free / per_token))
    devices = max(1, math.ceil((reserve_bytes + per_seq) / memory_bytes))
    options = {}
    weights = weight_bytes(cfg)
    if reserve_bytes >= weights:
        params = param_counts(cfg).total
        for b in (4, 2, 1, 0.5):
            options[b] = max(0, math.floor(
                (memory_bytes - (reserve_bytes - weights) - params * b) / per_seq))
    if batch >= 1:
        reason = (f"{batch} sequences of {per_seq:,} B (context {t}) fit in "
                  f"{free:,.0f} B free ({memory_bytes:,.0f} B - {reserve_bytes:,.0f} B "
                  "reserved)")
    else:
        if free <= 0:
            head = (f"the reserve ({reserve_bytes:,.0f} B, e.g. the weights) leaves "
                    f"nothing of {memory_bytes:,.0f} B for caches")
        else:
            head = (f"one sequence's cache at context {t} needs {per_seq:,} B but only "
                    f"{free:,.0f} B are free; at most {max_context:,} tokens fit")
        fixes = [f"{devices} devices of {memory_bytes:,.0f} B with weights and cache "
                 "split evenly hold one sequence"]
        fitting = [b for b in (2, 1, 0.5) if options.get(b, 0) >= 1]
        if fitting:
            names = {2: "16-bit", 1: "int8", 0.5: "int4"}
            fixes.append(f"weights at {fitting[0]} B per parameter ({names[fitting[0]]}) "
                         f"leave room for {options[fitting[0]]} sequence(s)")
        reason = head + "; " + "; ".join(fixes)
    return BatchFit(batch=batch, per_sequence_bytes=per_seq, free_bytes=free,
                    max_context=max_context, devices_needed=devices,
                    weight_options=options, reason=reason)
