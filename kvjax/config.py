"""Typed, validated configuration.

Experiment files under ``configs/`` return an ``ml_collections.ConfigDict``; the entry
points turn it into the frozen dataclasses below with :func:`model_config_from_dict` and
:func:`run_config_from_dict`, which validate every field before any work starts.

Shape letters (docs/DESIGN.md): B batch, T query length, S cache length, D d_model,
N query heads, K KV heads, G = N // K, H head_dim, F FFN width, L layers,
C kv_lora_rank, R qk_rope_head_dim, W window_size.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import compression, kernels, rope
from kvjax.checkpoints import hf
from kvjax.checkpoints.fetch import WeightsError
from kvjax.plan import REFERENCE, Plan

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
ATTENTION_TYPES = ("mha", "gqa", "mqa", "mla")
MLP_TYPES = ("swiglu", "gelu", "geglu")
WEIGHTS = ("smollm2", "random", "hf")
# Element types a KV cache can hold (kvjax.cache.encode converts into them). The
# quantized ones carry float32 scale tensors (kvjax.cache.quant: formats and scales).
KV_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "int8",
             "int4")
# Storage element type of each quantized kv_dtype's codes (int4: two codes per uint8).
KV_STORAGE = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2,
              "int8": jnp.int8, "int4": jnp.uint8}


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, value and what is allowed."""


KV_LAYOUTS = ("auto", "BKSH", "BKHS")
ROPE_POSITIONS = ("absolute", "cache")
WINDOW_CACHES = ("ring", "dense")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"invalid config: {field}={value!r}; allowed: {allowed}")


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        _fail(field, value, "a positive integer")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ('float32' -> 4, 'bfloat16' -> 2, ...)."""
    if dtype not in DTYPES:
        _fail("dtype", dtype, f"one of {sorted(DTYPES)}")
    return int(np.dtype(DTYPES[dtype]).itemsize)


# The kinds of ModelConfig's fields (issue 28): what a checkpoint states (its
# hyper-parameters), what an experiment changes about the cache (the blog's levers,
# which change the bytes or the math), and how this machine runs it (formulations,
# layouts, blocks: same tokens). :meth:`ModelConfig.fields_of` reads one kind;
# ``--list_fields`` prints them as three groups.
MODEL_FIELD_KINDS = {
    "architecture": ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "mlp_type", "attention", "rope_theta",
                     "norm_eps", "tie_embeddings", "qkv_bias", "qk_norm", "rope_scaling",
                     "embed_scale", "post_norms", "query_pre_attn_scalar",
                     "attn_logit_softcap", "final_logit_softcap", "rope_local_theta",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "q_lora_rank", "num_experts", "num_experts_per_tok", "moe_mlp_dim",
                     "num_shared_experts", "first_dense_layers", "routed_scaling_factor",
                     "norm_topk_prob", "moe_groups", "moe_topk_groups"),
    "lever": ("window_size", "layer_windows", "num_sink_tokens", "rope_positions",
              "window_cache", "dtype", "kv_dtype", "kv_compression", "kv_budget",
              "compression"),
    "execution": ("mla_absorb", "key_layout", "value_layout", "scan_layers",
                  "prefill_impl", "prefill_block_q", "prefill_block_k", "backend",
                  "decode_attention", "weight_matmul", "plan"),
    "label": ("name",),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only LM, the cache levers applied to it, and how this
    machine runs it: the three kinds of :data:`MODEL_FIELD_KINDS` (the architecture is
    what a checkpoint states and :func:`kvjax.models.convert.check_compatible` compares;
    ``num_kv_heads`` may differ by conversion, lever 1).

    Attributes:
      vocab_size: V, tokens in the vocabulary.
      num_layers: L, decoder layers.
      d_model: D, residual width.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; must divide N (MHA: K = N, MQA: K = 1).
      head_dim: H, per-head width of queries, keys and values (MHA/GQA/MQA).
      mlp_dim: F, FFN hidden width.
      mlp_type: 'swiglu' (gate, up, down: 3·D·F params, llama), 'geglu' (the same
        with GELU's tanh approximation in place of SiLU, Shazeer 2020; Gemma) or 'gelu'
        (W1, W2: 2·D·F params, the blog's FFN).
      attention: 'mha' (K = N), 'mqa' (K = 1), 'gqa' (any K dividing N) or 'mla'.
      rope_theta: rotary base (SmolLM2: 1e5).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: LM head shares the token embedding matrix.
      qkv_bias: the query, key and value projections carry biases (Qwen2; MHA/GQA/MQA
        only), added before the rotary embedding.
      qk_norm: queries and keys go through an RMSNorm over each head's H values (one
        scale [H] each, shared by the heads) before the rotary embedding (Qwen3;
        MHA/GQA/MQA only).
      embed_scale: the token embeddings are multiplied by sqrt(D) (rounded to the model
        dtype) before the first layer (Gemma).
      post_norms: each block also normalises its attention and MLP outputs before they
        join the residual ('post_attn_norm', 'post_mlp_norm'; Gemma 2 and 3).
      query_pre_attn_scalar: attention scores are scaled by query_pre_attn_scalar^-1/2
        instead of H^-1/2 (Gemma 2 and 3); None: H.
      attn_logit_softcap: c, attention scores s become c·tanh(s / c) before the mask and
        softmax (Gemma 2, Team 2024 sec. 2); None: none. Runs the dense prompt
        attention and the XLA decode step.
      final_logit_softcap: the same for the LM head's logits (Gemma 2); None: none.
      rope_local_theta: the rotary base of windowed layers (``layer_windows``), without
        ``rope_scaling`` (Gemma 3's rope_local_base_freq); None: rope_theta and
        rope_scaling on every layer.
      rope_scaling: the checkpoint's scaled rotary frequencies as sorted (key, value)
        pairs (a dict is accepted and converted; :func:`kvjax.rope.rope_scaling_pairs`):
        ``rope_type`` 'llama3' (Llama 3.1+; factor, low_freq_factor, high_freq_factor,
        original_max_position_embeddings) or 'linear' (factor: positions divided by it,
        Gemma 3's global layers); None: plain rotary.
      window_size: W, sliding-window length in tokens; None for full attention.
      layer_windows: a window per layer (lever 3 applied per layer, Gemma 2 / 3): a
        tuple of L entries, each W_i (a local layer: a ring of W_i slots) or None (a
        global layer: the full context), or a pattern repeated over the layers, as a
        tuple or a string such as '512,512,512,512,512,global' (Gemma 3's 5:1). The
        cache's bytes are the sum over layers. Needs window_size None, no sinks and the
        unrolled layer stack (scan_layers False; None resolves to it). None: every
        layer has ``window_size``.
      num_sink_tokens: attention sinks kept besides the window (needs window_size).
      rope_positions: how sinks are placed for rotary embeddings: 'absolute' (each token
        at its own position, as Mistral-style models trained with a window expect; past
        the training length the query-to-sink distance is out of distribution) or
        'cache' (StreamingLLM, Xiao et al. 2023, sec. 3.2: positions within the cache,
        so the query-to-sink distance stays below W). Ring keys are at the same
        distance either way. 'cache' needs sinks; not implemented for MLA.
      window_cache: where a window's keys live: 'ring' (W slots, constant in t: lever 3)
        or 'dense' (max_seq_len slots, position p in slot p, the window a mask over them:
        the cache a draft reads in place from its target's, kvjax.inference.speculative;
        only a formulation that skips masked slots, 'native', reads just the window).
      kv_compression: lever 5, fewer tokens by score: a method of
        :mod:`kvjax.compression` ('snapkv', 'h2o', 'tova', 'key_norm', 'streaming_llm',
        'pyramidkv', ...) that scores the prompt's slots after its prefill, after which each KV head
        keeps its kv_budget best (:mod:`kvjax.cache.compress`); None: no compression.
        Any attention without a window (MLA keeps latent slots: one slot set per layer).
      kv_budget: slots each KV head of each layer keeps of the prompt (with
        kv_compression; the cache then holds kv_budget + compression.recent_slots); a
        method with per-layer budgets (PyramidKV, :attr:`layer_budgets`): their mean.
      compression: the methods' own knobs (:class:`kvjax.compression.CompressionConfig`:
        observation_window, pooling_kernel, num_sink_tokens, recent_slots,
        recent_fraction, schedule, every_n, pyramid_beta, uniform_layers).
      kv_lora_rank: C, MLA's latent width: the cache holds C + R values per token and
        layer (DeepSeek-V2, Liu et al. 2024, sec. 2.1).
      qk_rope_head_dim: R, MLA's decoupled rotary key width (shared by all heads).
      qk_nope_head_dim: MLA's per-head query/key width without rotary.
      v_head_dim: MLA's per-head value width.
      q_lora_rank: MLA's optional query low-rank width; None projects queries directly.
      num_experts: E, routed experts of a mixture-of-experts MLP (DeepSeek-V2, sec. 2.2;
        :class:`kvjax.models.layers.MoE`); 0: a dense MLP of mlp_dim on every layer.
      num_experts_per_tok: k, experts each token is routed to.
      moe_mlp_dim: Fe, each expert's SwiGLU width.
      num_shared_experts: experts every token passes through (one SwiGLU of
        num_shared_experts·Fe).
      first_dense_layers: the first layers keep a dense MLP of mlp_dim (DeepSeek's
        first_k_dense_replace); needs scan_layers False when 0 < it < L.
      routed_scaling_factor: the routed experts' weights are multiplied by it (unless
        norm_topk_prob).
      norm_topk_prob: the k routing weights are renormalised to sum 1.
      moe_groups, moe_topk_groups: 'group_limited_greedy' routing: experts in
        moe_groups groups, a token routed within its moe_topk_groups best groups (by their
        best score); 1, 1: plain top-k.
      mla_absorb: MLA decode path, False = naive (rebuild K/V), True = absorbed.
      key_layout, value_layout: memory layout of one layer's cached keys / values (MHA,
        GQA, MQA): 'BKSH' (slot-major rows, [B, K, S, H]), 'BKHS' (slot axis last,
        [B, K, H, S]) or 'auto' (see :func:`default_kv_layout`: on CPU keys 'BKHS' and
        values 'BKHS' only when G = 1, else 'BKSH'; 'BKSH' on accelerators), for the
        config's ``backend``. The math and the bytes are the same; only XLA's dot kernels
        differ. MLA caches a latent and ignores them (they must stay 'auto').
      scan_layers: True runs the layer stack as one ``nn.scan`` over stacked parameters
        and a stacked cache (compile time independent of L); False unrolls it over
        per-layer arrays. On CPU the unrolled stack decodes faster: inside the scan XLA
        copies each layer's cache slice out of the stacked buffer before its dot
        (docs/decisions/0002-unrolled-layer-stack-on-cpu.md). None: the backend's default
        (:func:`kvjax.backend.scan_layers`), resolved when the config is built.
      prefill_impl: attention of chunks of T > 1 tokens (the prompt): a name of the
        kernel registry (:mod:`kvjax.kernels`, its table in docs/DESIGN.md): 'tiled'
        (online softmax over blocks, :mod:`kvjax.models.flash`), 'dense' (all [T, S]
        scores), 'native' (CPU: one fused custom call, :mod:`kvjax.native.prefill`),
        'cudnn' (GPU, a chunk into an empty cache) or 'auto' ('native' where the plan
        loaded it, else 'tiled'). Where one does not apply (MLA, sinks, soft-capping) the
        registry's fallback runs. Decode steps (T = 1) are unaffected.
      prefill_block_q, prefill_block_k: the tiled path's block sizes, in queries and in
        key slots.
      dtype: parameter and activation dtype name.
      kv_dtype: the KV cache's element type, one of :data:`KV_DTYPES`; None (default):
        ``dtype``. The cache's bytes per element (the blog's "bytes" factor) follow it.
        'int8', 'float8_e4m3fn', 'float8_e5m2' and 'int4' are quantized formats with
        float32 scale tensors (:mod:`kvjax.cache.quant`); int4 needs even head_dim (MLA:
        even kv_lora_rank and qk_rope_head_dim), two codes per byte.
      backend: 'cpu', 'gpu' or 'tpu': the backend whose choices (layouts, layer stack,
        dot operands; :mod:`kvjax.backend`) this config makes. None (default): the
        process's JAX backend, resolved once when the config is built.
      decode_attention: the formulation of a decode step's attention over the cache
        (MHA/GQA/MQA): a name of the kernel registry ('xla', 'xla_cache_left',
        'native', 'native_blocks', 'pallas'), or 'auto': the fastest measured on this machine for the
        step's shape class, picked before tracing by :func:`kvjax.planner.resolve` into
        ``plan`` (cached per machine;
        docs/decisions/0006-decode-attention-measured-per-machine.md). Same result for
        all. Default 'xla' here (a pure-XLA program XLA can cost); ``configs/base.py``
        and ``experiments.bench`` default to 'auto'.
      weight_matmul: the formulation of the products of a decode step's few rows (M =
        B·T <= 256) with float32 weight matrices: a name of the kernel registry ('xla',
        'native', 'native_ksplit', 'native_lanes';
        docs/decisions/0018-weight-splits-per-machine.md) or 'auto', picked per (M, K,
        N, layout) class like decode_attention ('xla' inside a multi-device mesh).
        Products with more rows, other dtypes or other backends use 'xla'.
      name: free-form label used in reports.
      plan: the resolved execution plan (:class:`kvjax.plan.Plan`: the picks of every
        'auto' formulation, the native kernels loaded, the mesh axes), made before
        tracing by :func:`kvjax.planner.resolve`; None: the reference choices ('auto'
        runs as 'xla', no native kernel, one device). Not a config-file field.
    """

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    mlp_type: str = "swiglu"
    attention: str = "gqa"
    rope_theta: float = 1e5
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple | None = None
    embed_scale: bool = False
    post_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    rope_local_theta: float | None = None
    window_size: int | None = None
    layer_windows: tuple | str | None = None
    num_sink_tokens: int = 0
    rope_positions: str = "absolute"
    window_cache: str = "ring"
    kv_compression: str | None = None
    kv_budget: int | None = None
    compression: compression.CompressionConfig = compression.CompressionConfig()
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_mlp_dim: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    moe_groups: int = 1
    moe_topk_groups: int = 1
    mla_absorb: bool = True
    key_layout: str = "auto"
    value_layout: str = "auto"
    scan_layers: bool | None = True
    prefill_impl: str = "tiled"
    prefill_block_q: int = 256
    prefill_block_k: int = 256
    dtype: str = "float32"
    kv_dtype: str | None = None
    backend: str | None = None
    decode_attention: str = "xla"
    weight_matmul: str = "xla"
    name: str = "model"
    plan: Plan | None = None

    def __post_init__(self):
        # Backend choices are resolved here, once (kvjax.backend), never at trace time.
        if self.backend is None:
            object.__setattr__(self, "backend", backend_lib.current())
        if self.backend not in backend_lib.BACKENDS:
            _fail("model.backend", self.backend, f"one of {list(backend_lib.BACKENDS)}")
        if isinstance(self.compression, Mapping):  # a config dict's sub-dict
            object.__setattr__(self, "compression", _sub_config(
                compression.CompressionConfig, "model.compression", self.compression))
        if self.layer_windows is not None:  # a pattern -> L entries (W or None)
            object.__setattr__(self, "layer_windows",
                               _layer_windows(self.layer_windows, self.num_layers))
            if self.scan_layers is None:  # layers of different slot counts: unrolled
                object.__setattr__(self, "scan_layers", False)
        if self.scan_layers is None and self.kv_compression in compression.names() \
                and compression.get(self.kv_compression).layer_budgets is not None \
                and self.compression.uniform_layers is not True:  # per-layer budgets
            object.__setattr__(self, "scan_layers", False)
        dense = getattr(self.compression, "dense_layers", 0)
        if self.scan_layers is None and _is_int(dense) and dense > 0 \
                and self.kv_selects_pages:
            object.__setattr__(self, "scan_layers", False)  # dense and selecting layers
        if self.scan_layers is None and self.num_experts and \
                0 < self.first_dense_layers < self.num_layers:  # dense and MoE layers
            object.__setattr__(self, "scan_layers", False)
        if self.scan_layers is None:
            object.__setattr__(self, "scan_layers", backend_lib.scan_layers(self.backend))
        if self.rope_scaling is not None:  # a dict (config.json's) -> hashable pairs
            try:
                object.__setattr__(self, "rope_scaling",
                                   rope.rope_scaling_pairs(self.rope_scaling))
            except (TypeError, ValueError) as e:
                _fail("model.rope_scaling", self.rope_scaling, str(e))
        validate_model_config(self)

    replace = dataclasses.replace

    def layer_config(self, i: int) -> "ModelConfig":
        """The config layer ``i`` runs with: a dense MLP (num_experts 0) below
        ``first_dense_layers``; no compression below a page selection's
        ``compression.dense_layers`` (the ordinary paged read); without ``layer_windows``
        the config itself; with them, one window (``window_size`` = W_i or None) and that
        layer's rotary base (``rope_local_theta`` without scaling on a local layer when
        set)."""
        if self.num_experts and i < self.first_dense_layers:  # a dense MLP here
            return self.replace(num_experts=0, first_dense_layers=0).layer_config(i)
        if self.kv_selects_pages and i < self.compression.dense_layers:  # reads every page
            return self.replace(kv_compression=None, kv_budget=None,
                                compression=dataclasses.replace(self.compression,
                                                                dense_layers=0))
        budgets = self.layer_budgets
        if budgets is not None:  # lever 5 per layer: this layer's budget, kept uniform
            return self.replace(kv_budget=budgets[i], compression=dataclasses.replace(
                self.compression, uniform_layers=True))
        if self.layer_windows is None:
            return self
        w = self.layer_windows[i]
        local = w is not None and self.rope_local_theta is not None
        return self.replace(
            layer_windows=None, window_size=w,
            rope_theta=self.rope_local_theta if local else self.rope_theta,
            rope_scaling=None if local else self.rope_scaling)

    @property
    def layer_budgets(self) -> tuple | None:
        """(b_0, ..., b_{L-1}) slots each layer keeps under a compression method with
        per-layer budgets (:attr:`kvjax.compression.Method.layer_budgets`, PyramidKV),
        mean ``kv_budget``; None: every layer keeps kv_budget (no such method, no
        compression, ``compression.uniform_layers``, or a name not registered)."""
        if self.kv_compression is None or self.compression.uniform_layers \
                or not isinstance(self.kv_budget, int) \
                or self.kv_compression not in compression.names():
            return None
        method = compression.get(self.kv_compression)
        if method.layer_budgets is None or \
                self.kv_budget <= method.protected(self.compression, self.kv_budget):
            return None
        return tuple(int(b) for b in method.layer_budgets(self.compression, self.kv_budget,
                                                          self.num_layers))

    @property
    def per_layer_slots(self) -> bool:
        """True when each layer's cache has its own slot count: ``layer_windows`` (a
        window per layer) or per-layer compression budgets (:attr:`layer_budgets`). The
        layers are then unrolled and the cache's tensors per layer."""
        return self.layer_windows is not None or self.layer_budgets is not None

    def fields_of(self, kind: str) -> dict:
        """{field: value} of the fields of one kind of :data:`MODEL_FIELD_KINDS`
        ('architecture', 'lever', 'execution', 'label').

        Raises:
          ValueError: another kind, naming the allowed ones.
        """
        if kind not in MODEL_FIELD_KINDS:
            raise ValueError(f"kind={kind!r}; allowed: one of {list(MODEL_FIELD_KINDS)}")
        return {f: getattr(self, f) for f in MODEL_FIELD_KINDS[kind]}

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        """Bytes per parameter/activation element."""
        return dtype_bytes(self.dtype)

    @property
    def cache_dtype(self):
        """The KV cache's storage element type (``kv_dtype``, default ``dtype``; a
        quantized format's code type, :data:`KV_STORAGE`: int4 -> uint8)."""
        name = self.kv_dtype or self.dtype
        return KV_STORAGE[name] if name in KV_STORAGE else DTYPES[name]

    @property
    def kv_quantized(self) -> bool:
        """True when the cache holds quantized codes plus scale tensors."""
        return (self.kv_dtype or self.dtype) in KV_STORAGE

    @property
    def kv_dtype_bytes(self) -> int | float:
        """Bytes per cached element, without scales (int4: 0.5; the scale bytes are
        :func:`kvjax.analysis.theory.kv_bytes_per_token`'s business)."""
        if self.kv_dtype == "int4":
            return 0.5
        return int(np.dtype(self.cache_dtype).itemsize)

    @property
    def cache_window(self) -> int | None:
        """Tokens the cache's ring holds (W), whatever the context: ``window_size``, or
        with ``kv_compression`` kv_budget + compression.recent_slots; None: it grows with
        the context."""
        if self.kv_evicts:
            return self.kv_budget + self.compression.recent_slots
        return self.window_size

    @property
    def kv_evicts(self) -> bool:
        """True when ``kv_compression`` names a method that evicts slots after the prefill
        (the cache holds kv_budget + recent_slots); False without compression and for a
        read-time page selection (Quest: every page kept, :attr:`kv_selects_pages`)."""
        return self.kv_compression in compression.names() and \
            compression.evicts(self.kv_compression)

    @property
    def kv_rescores(self) -> bool:
        """True when an evicting ``kv_compression`` scores its slots again during
        decoding (``compression.schedule`` 'every_n'): its cache carries a scoring state
        (``KVCache.schedule``, :func:`kvjax.cache.compress.init_schedule`)."""
        return self.kv_evicts and self.compression.schedule == "every_n"

    @property
    def kv_selects_pages(self) -> bool:
        """True when ``kv_compression`` is a read-time page selection (Quest,
        :mod:`kvjax.compression.quest`): a paged cache keeps every page and its key
        bounds, and each decode step reads kv_budget / page_size pages per KV head."""
        return self.kv_compression in compression.names() and \
            compression.selects_pages(self.kv_compression)

    @property
    def num_groups(self) -> int:
        """G = N // K, query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def mla_scale(self) -> float:
        """MLA's softmax scale: 1/sqrt(nope + R) (DeepSeek-V2, Liu et al. 2024, sec. 2.1.3),
        times DeepSeek's YaRN factor mscale^2 with a yarn ``rope_scaling``
        (:func:`kvjax.rope.softmax_factor`)."""
        return ((self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
                * rope.softmax_factor(self.rope_scaling))

    @property
    def execution(self) -> Plan:
        """The execution plan traced code reads: ``plan``, or the reference plan
        (:data:`kvjax.plan.REFERENCE`) when none was resolved."""
        return self.plan if self.plan is not None else REFERENCE

    def formulation(self, site: kernels.Site, plan: Plan | None = None,
                    pick: str | None = None) -> str:
        """The formulation that runs ``site`` (:class:`kvjax.kernels.Site`) for this
        config: its field for the op (``decode_attention``, ``prefill_impl``,
        ``weight_matmul``) and the pick of ``plan`` (default: its own), or ``pick``, by
        the registry's rule (:func:`kvjax.kernels.select`). Raises its ValueError."""
        plan = self.execution if plan is None else plan
        return kernels.select(site.op, getattr(self, kernels.FIELD[site.op]), site,
                              pick or plan.pick(site))

    def cache_layout(self, name: str) -> str:
        """'BKSH' or 'BKHS': the layout of cached tensor ``name`` ('k' or 'v'), with
        'auto' resolved by :func:`kvjax.backend.kv_layout` for the config's backend."""
        layout = {"k": self.key_layout, "v": self.value_layout}[name]
        if layout == "auto":
            return backend_lib.kv_layout(self.backend, name, self.num_groups)
        return layout


def _layer_windows(value: Any, num_layers: Any) -> tuple:
    """``ModelConfig.layer_windows`` as L entries (a positive int W, or None: global):
    from a tuple/list of entries or a comma-separated string ('global', 'none' or 0 for
    a global layer), a pattern shorter than L repeated over the layers."""
    items = value.strip("()[] ").split(",") if isinstance(value, str) else value
    allowed = ("a tuple of per-layer windows (a positive integer, or None / 0 / 'global' "
               "for a global layer), or a comma-separated string of them, of num_layers "
               "entries or a pattern repeated over them")
    try:
        items = list(items)
    except TypeError:
        _fail("model.layer_windows", value, allowed)
    out = []
    for x in items:
        x = x.strip().lower() if isinstance(x, str) else x
        if x is None or x in ("global", "none", "") or (_is_int(x) and x == 0):
            out.append(None)
        elif isinstance(x, str) and x.isdigit() and int(x) > 0:
            out.append(int(x))
        elif _is_int(x) and x > 0:
            out.append(int(x))
        else:
            _fail("model.layer_windows", value, allowed)
    if not out or not _is_int(num_layers) or num_layers % len(out):
        _fail("model.layer_windows", value, f"{allowed}; a pattern's length must divide "
              f"num_layers={num_layers}")
    return tuple(out * (num_layers // len(out)))


def validate_model_config(c: ModelConfig) -> None:
    """Raises ConfigError naming the first invalid field of ``c``."""
    for f in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
              "head_dim", "mlp_dim"):
        _positive(f"model.{f}", getattr(c, f))
    if c.dtype not in DTYPES:
        _fail("model.dtype", c.dtype, f"one of {sorted(DTYPES)}")
    if c.kv_dtype is not None and c.kv_dtype not in KV_DTYPES:
        _fail("model.kv_dtype", c.kv_dtype, f"None (= model.dtype) or one of {list(KV_DTYPES)}")
    if c.kv_dtype == "int4":  # two codes per byte along each cached row
        widths = ({"kv_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim}
                  if c.attention == "mla" else {"head_dim": c.head_dim})
        for f, w in widths.items():
            if _is_int(w) and w % 2:
                raise ConfigError(
                    f"invalid config: model.kv_dtype='int4' with model.{f}={w}; allowed: "
                    f"an even {f} (int4 packs two values per byte), or another kv_dtype "
                    f"of {list(KV_DTYPES)}")
    if not isinstance(c.scan_layers, bool):
        _fail("model.scan_layers", c.scan_layers, "True, False or None (backend default)")
    if c.attention not in ATTENTION_TYPES:
        _fail("model.attention", c.attention, f"one of {list(ATTENTION_TYPES)}")
    if c.mlp_type not in MLP_TYPES:
        _fail("model.mlp_type", c.mlp_type, f"one of {list(MLP_TYPES)}")
    if not isinstance(c.qkv_bias, bool) or (c.qkv_bias and c.attention == "mla"):
        _fail("model.qkv_bias", c.qkv_bias,
              "True or False, and False for attention='mla' (MLA has no q/k/v biases)")
    if not isinstance(c.qk_norm, bool) or (c.qk_norm and c.attention == "mla"):
        _fail("model.qk_norm", c.qk_norm,
              "True or False, and False for attention='mla' (MLA normalises its latents)")
    if c.num_heads % c.num_kv_heads:
        _fail("model.num_kv_heads", c.num_kv_heads,
              f"a divisor of model.num_heads={c.num_heads}")
    if c.attention == "mha" and c.num_kv_heads != c.num_heads:
        _fail("model.num_kv_heads", c.num_kv_heads,
              f"equal to num_heads={c.num_heads} for attention='mha' (use 'gqa' otherwise)")
    if c.attention == "mqa" and c.num_kv_heads != 1:
        _fail("model.num_kv_heads", c.num_kv_heads, "1 for attention='mqa'")
    if not c.rope_theta > 0:
        _fail("model.rope_theta", c.rope_theta, "a positive number")
    if not c.norm_eps > 0:
        _fail("model.norm_eps", c.norm_eps, "a positive number")
    if c.head_dim % 2:
        _fail("model.head_dim", c.head_dim, "an even integer (rotary pairs)")
    if c.window_size is not None:
        _positive("model.window_size", c.window_size)
    if isinstance(c.num_sink_tokens, bool) or c.num_sink_tokens < 0:
        _fail("model.num_sink_tokens", c.num_sink_tokens, "an integer >= 0")
    if c.layer_windows is not None and (c.window_size is not None or c.num_sink_tokens
                                         or c.is_mla or c.scan_layers
                                         or c.window_cache != "ring"):
        _fail("model.layer_windows", c.layer_windows,
              "None unless window_size is None, num_sink_tokens 0, window_cache 'ring', "
              "attention not 'mla' and scan_layers False (each layer its own window: set "
              "one or the other)")
    if c.num_experts:
        for f in ("num_experts_per_tok", "moe_mlp_dim", "moe_groups", "moe_topk_groups"):
            _positive(f"model.{f}", getattr(c, f))
        if c.num_experts_per_tok > c.num_experts:
            _fail("model.num_experts_per_tok", c.num_experts_per_tok,
                  f"at most num_experts={c.num_experts}")
        if c.num_experts % c.moe_groups or c.moe_topk_groups > c.moe_groups or \
                c.num_experts_per_tok > c.num_experts // c.moe_groups * c.moe_topk_groups:
            _fail("model.moe_groups", (c.moe_groups, c.moe_topk_groups),
                  f"groups dividing num_experts={c.num_experts}, topk_groups <= groups, "
                  "and k experts within the chosen groups")
        if c.mlp_type != "swiglu":
            _fail("model.mlp_type", c.mlp_type, "'swiglu' with num_experts (SwiGLU experts)")
        if isinstance(c.num_shared_experts, bool) or c.num_shared_experts < 0 or \
                isinstance(c.first_dense_layers, bool) or not \
                0 <= c.first_dense_layers <= c.num_layers:
            _fail("model.first_dense_layers", (c.num_shared_experts, c.first_dense_layers),
                  "num_shared_experts >= 0 and first_dense_layers in 0..num_layers")
        if c.scan_layers and 0 < c.first_dense_layers < c.num_layers:
            _fail("model.scan_layers", c.scan_layers,
                  "False (or None) with first_dense_layers between 0 and num_layers: dense "
                  "and MoE layers hold different parameters")
        if not (_is_real(c.routed_scaling_factor) and c.routed_scaling_factor > 0):
            _fail("model.routed_scaling_factor", c.routed_scaling_factor, "a positive number")
    elif not _is_int(c.num_experts) or c.num_experts < 0:
        _fail("model.num_experts", c.num_experts, "an integer >= 0 (0: a dense MLP)")
    for f in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
              "rope_local_theta"):
        v = getattr(c, f)
        if v is not None and not (_is_real(v) and v > 0):
            _fail(f"model.{f}", v, "None or a positive number")
    for f in ("embed_scale", "post_norms"):
        if not isinstance(getattr(c, f), bool):
            _fail(f"model.{f}", getattr(c, f), "True or False")
    if c.attn_logit_softcap is not None and c.is_mla:
        _fail("model.attn_logit_softcap", c.attn_logit_softcap,
              "None for attention='mla'")
    if c.num_sink_tokens and not c.window_size:
        _fail("model.num_sink_tokens", c.num_sink_tokens,
              "0 unless model.window_size is set (sinks are kept beside a window)")
    if c.window_size is not None and c.num_sink_tokens >= c.window_size:
        _fail("model.num_sink_tokens", c.num_sink_tokens,
              f"an integer below window_size={c.window_size}")
    if c.window_cache not in WINDOW_CACHES or (c.window_cache == "dense"
                                               and not c.window_size):
        _fail("model.window_cache", c.window_cache,
              f"one of {list(WINDOW_CACHES)}, 'dense' only with model.window_size")
    _check_compression(c)
    if c.rope_positions not in ROPE_POSITIONS:
        _fail("model.rope_positions", c.rope_positions, f"one of {list(ROPE_POSITIONS)}")
    if c.rope_positions == "cache" and (not c.num_sink_tokens or c.attention == "mla"):
        _fail("model.rope_positions", c.rope_positions,
              "'absolute' unless model.num_sink_tokens > 0 and attention is not 'mla' "
              "(cache positions only move the sinks; MLA does not implement them)")
    for f in ("key_layout", "value_layout"):
        if getattr(c, f) not in KV_LAYOUTS:
            _fail(f"model.{f}", getattr(c, f), f"one of {list(KV_LAYOUTS)}")
        layout = getattr(c, f)
        if c.attention == "mla" and layout != "auto":
            _fail(f"model.{f}", getattr(c, f),
                  "'auto' for attention='mla' (MLA caches a latent [B, S, C], no heads)")
    cache_dtype = c.kv_dtype or c.dtype
    for op, dtype in (("decode_attention", cache_dtype), ("weight_matmul", c.dtype),
                      ("prefill_attention", c.dtype)):
        # the registry's refusals: a formulation that cannot run on this backend / dtype
        # is refused here, before the weights load (kvjax.kernels.select, strict)
        field = kernels.FIELD[op]
        try:
            kernels.select(op, getattr(c, field), kernels.static_site(op, c.backend, dtype),
                           strict=True)
        except ValueError as e:
            raise ConfigError(f"invalid config: {e}") from None
    _positive("model.prefill_block_q", c.prefill_block_q)
    _positive("model.prefill_block_k", c.prefill_block_k)
    if c.attention == "mla":
        for f in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
            v = getattr(c, f)
            if v is None:
                _fail(f"model.{f}", v, "a positive integer (required for attention='mla')")
            _positive(f"model.{f}", v)
        if c.qk_rope_head_dim % 2:
            _fail("model.qk_rope_head_dim", c.qk_rope_head_dim, "an even integer")
        if c.q_lora_rank is not None:
            _positive("model.q_lora_rank", c.q_lora_rank)


def _check_compression(c: ModelConfig) -> None:
    """Lever 5's fields (kv_compression, kv_budget, compression)."""
    k = c.compression
    if not isinstance(k, compression.CompressionConfig):
        _fail("model.compression", k, "a mapping of kvjax.compression.CompressionConfig "
              "fields")
    d = k.dense_layers
    if not _is_int(d) or not 0 <= d <= c.num_layers:
        _fail("model.compression.dense_layers", d,
              f"an integer in [0, num_layers={c.num_layers}] (the first layers that read "
              "every page; num_layers: all of them)")
    if d and not (c.kv_compression in compression.names()
                  and compression.selects_pages(c.kv_compression)):
        selecting = [n for n in compression.names() if compression.selects_pages(n)]
        _fail("model.compression.dense_layers", d,
              f"0 with model.kv_compression={c.kv_compression!r} (only a read-time page "
              f"selection, one of {selecting}, has layers that read every page)")
    if d and c.scan_layers:
        _fail("model.scan_layers", c.scan_layers,
              f"False or None with model.compression.dense_layers={d} (dense and "
              "selecting layers read differently: the layers are unrolled)")
    if c.kv_compression is None:
        if c.kv_budget is not None:
            _fail("model.kv_budget", c.kv_budget, "None unless model.kv_compression is set")
        return
    if c.kv_compression not in compression.names():
        _fail("model.kv_compression", c.kv_compression,
              f"None or one of {list(compression.names())}")
    if not _is_int(c.kv_budget) or c.kv_budget < 1:
        _fail("model.kv_budget", c.kv_budget,
              f"a positive integer with model.kv_compression={c.kv_compression!r}")
    for f in ("observation_window", "recent_slots"):
        if not _is_int(getattr(k, f)) or getattr(k, f) < 1:
            _fail(f"model.compression.{f}", getattr(k, f), "an integer >= 1")
    if not _is_int(k.pooling_kernel) or k.pooling_kernel < 1 or k.pooling_kernel % 2 == 0:
        _fail("model.compression.pooling_kernel", k.pooling_kernel,
              "an odd integer >= 1 (1: no pooling)")
    if not _is_int(k.num_sink_tokens) or k.num_sink_tokens < 0:
        _fail("model.compression.num_sink_tokens", k.num_sink_tokens, "an integer >= 0")
    if not _is_real(k.recent_fraction) or not 0 <= k.recent_fraction < 1:
        _fail("model.compression.recent_fraction", k.recent_fraction, "a number in [0, 1)")
    if k.schedule not in compression.SCHEDULES:
        _fail("model.compression.schedule", k.schedule,
              f"one of {list(compression.SCHEDULES)}")
    if not _is_int(k.every_n) or not 1 <= k.every_n <= k.recent_slots:
        _fail("model.compression.every_n", k.every_n,
              f"an integer in [1, model.compression.recent_slots={k.recent_slots}] (a "
              "ring token is scored before a later one overwrites it)")
    if not _is_int(k.pyramid_beta) or k.pyramid_beta < 1:
        _fail("model.compression.pyramid_beta", k.pyramid_beta, "an integer >= 1")
    if not isinstance(k.uniform_layers, bool):
        _fail("model.compression.uniform_layers", k.uniform_layers, "True or False")
    if not _is_int(k.first_pages) or k.first_pages < 0:
        _fail("model.compression.first_pages", k.first_pages, "an integer >= 0")
    method = compression.get(c.kv_compression)
    protected = method.protected(k, c.kv_budget)
    if c.kv_budget <= protected:
        _fail("model.kv_budget", c.kv_budget,
              f"more than the {protected} slots {c.kv_compression!r} always keeps (its "
              "sinks or observation window in model.compression)")
    budgets = c.layer_budgets
    if budgets is not None:
        if len(budgets) != c.num_layers or sum(budgets) != c.num_layers * c.kv_budget:
            _fail("model.kv_compression", c.kv_compression,
                  f"a method whose layer_budgets give {c.num_layers} budgets summing to "
                  f"num_layers x kv_budget = {c.num_layers * c.kv_budget} (got {budgets})")
        low = min(range(len(budgets)), key=lambda i: (budgets[i], i))
        if budgets[low] <= protected:
            _fail("model.kv_budget", c.kv_budget,
                  f"a budget whose per-layer schedule keeps more than the {protected} "
                  f"slots {c.kv_compression!r} always keeps in every layer (layer {low} "
                  f"would keep {budgets[low]}; model.compression.pyramid_beta="
                  f"{k.pyramid_beta} shapes PyramidKV's): a larger kv_budget, or a "
                  "flatter schedule")
        if k.schedule != "prefill":
            _fail("model.compression.schedule", k.schedule,
                  f"'prefill' with model.kv_compression={c.kv_compression!r}'s per-layer "
                  "budgets (a decode-time compression keeps one budget in every layer; "
                  "model.compression.uniform_layers=True)")
        if c.scan_layers:
            _fail("model.scan_layers", c.scan_layers,
                  f"False or None with model.kv_compression={c.kv_compression!r} (each "
                  "layer its own budget: the layers are unrolled)")
    for f, ok in (("window_size", c.window_size is None),
                  ("layer_windows", c.layer_windows is None),
                  ("num_sink_tokens", c.num_sink_tokens == 0)):
        if not ok:
            _fail(f"model.{f}", getattr(c, f),
                  f"unset with model.kv_compression={c.kv_compression!r} (a compressed "
                  "cache is a full cache's kept slots; windows are not combined with it)")
    if c.is_mla and k.schedule != "prefill":
        _fail("model.compression.schedule", k.schedule,
              f"'prefill' with attention='mla' and model.kv_compression="
              f"{c.kv_compression!r} (the decode step does not buffer MLA's absorbed "
              "queries for a re-scoring)")
    if c.kv_selects_pages and c.is_mla:
        _fail("model.attention", c.attention,
              f"not 'mla' with model.kv_compression={c.kv_compression!r} (its page bounds "
              "are per KV head of a paged MHA/GQA/MQA cache)")
    if c.kv_selects_pages and k.schedule != "prefill":
        _fail("model.compression.schedule", k.schedule,
              f"'prefill' with model.kv_compression={c.kv_compression!r} (it keeps every "
              "page and chooses which to read at each step: nothing to re-score)")
    if c.kv_selects_pages and c.attn_logit_softcap is not None:
        _fail("model.attn_logit_softcap", c.attn_logit_softcap,
              f"None with model.kv_compression={c.kv_compression!r} (its page read runs "
              "the 'xla' step, which has no soft-capped scores)")


MIN_SAMPLING_TEMPERATURE = 2.0 ** -126
"""The smallest temperature that samples (float32's smallest normal number, ~1.18e-38):
below it a temperature is greedy, the limit T -> 0 (float32 cannot hold it as a normal
number; XLA:CPU flushes subnormals to 0)."""


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Token sampling (the rule: ``kvjax.inference.sampling``).

    Attributes:
      temperature: finite number >= 0; 0 means greedy (argmax; the filters are unused).
        Every accepted value behaves as its limit: a temperature below
        :data:`MIN_SAMPLING_TEMPERATURE` (2^-126 ~ 1.18e-38, float32's smallest normal
        number, which XLA:CPU would flush to 0 and divide by) is greedy too, and above it
        the sampler scales logits relative to their row maximum, so a tiny temperature
        that overflows logits / temperature gives the argmax, never a NaN or token 0.
      top_k: integer >= 0; keep the k most likely tokens (0 = off). A top_k at or above
        the vocabulary size keeps every token (clamped to V where the logits are known).
      top_p: number in (0, 1]; keep the smallest sorted prefix whose probability reaches
        top_p (1 = off).
      seed: integer seed of the sampling PRNG key.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not _is_real(self.temperature) or not 0 <= self.temperature < float("inf"):
            _fail("sampling.temperature", self.temperature,
                  "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail("sampling.top_k", self.top_k,
                  "an integer >= 0 (0 = off; values >= the vocabulary keep every token)")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            _fail("sampling.top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if not _is_int(self.seed):
            _fail("sampling.seed", self.seed, "an integer")

    @property
    def greedy(self) -> bool:
        """True when sampling is the argmax: temperature 0 or below
        :data:`MIN_SAMPLING_TEMPERATURE` (T -> 0, the limit of the softmax)."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE


DRAFTERS = ("none", "ngram", "self", "model")
DRAFT_KV_SOURCES = ("own", "target")
DRAFT_WEIGHT_DTYPES = (None, "int8")  # SpeculativeConfig.draft_weight_dtype


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``kvjax.inference.speculative``): the target scores the last
    token and k drafted ones in one forward and keeps the longest prefix it would have
    produced itself (Leviathan et al. 2023; exact rejection sampling at temperature > 0).

    Attributes:
      drafter: 'none' (plain decoding), 'ngram' (prompt lookup: the last n tokens matched
        earlier in the prompt and the text so far), 'self' (the same weights over a cheap
        cache kept beside the full one: a window with sinks, a quantized copy, or the
        first layers) or 'model' (a separate draft model from ``draft_config``, same
        tokenizer).
      k: tokens drafted per verify step (>= 1).
      ngram_max: the longest n-gram the 'ngram' drafter matches (it tries the longest
        first).
      ngram_min: the shortest n-gram it matches; 1 <= ngram_min <= ngram_max.
      draft_window_size: 'self': the draft cache's window W (0: no window).
      draft_sink_tokens: 'self': attention sinks kept beside the draft window.
      draft_kv_dtype: 'self': the draft cache's element type (None: the target's), e.g.
        'int8' or 'int4'.
      draft_num_layers: 'self': the draft runs the first L' layers only (0: all).
      draft_weight_dtype: 'self': None (the target's weights as they are) or 'int8' (a
        copy of them in int8 with a float32 scale per output channel
        (:class:`kvjax.models.weight_matmul.Int8Weight`), made once before
        the loop: the draft step reads about a quarter of float32's weight bytes;
        :func:`kvjax.models.weight_matmul.quantize_params_int8`). Verification is by the
        target, so the emitted tokens do not change; the acceptance may.
      draft_kv_source: 'self': where the draft's window comes from. 'own': a cache the
        draft prefills and keeps itself (its window's keys computed by the windowed
        model); 'target': each round copies the sinks and the window's positions of the
        target's cache (the keys the full model computed: MagicDec, Chen et al. 2024),
        so the draft has no prefill and no cache of its own. 'target' needs a window and
        the target's kv_dtype.
      draft_config: 'model': a config file of ``configs/`` (e.g. 'configs/mqa.py') whose
        model drafts; its weights come from the same checkpoint converted as that config
        says.
    """

    drafter: str = "none"
    k: int = 4
    ngram_max: int = 3
    ngram_min: int = 1
    draft_window_size: int = 256
    draft_sink_tokens: int = 4
    draft_kv_dtype: str | None = None
    draft_num_layers: int = 0
    draft_weight_dtype: str | None = None
    draft_kv_source: str = "own"
    draft_config: str | None = None

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            _fail("speculative.drafter", self.drafter, f"one of {list(DRAFTERS)}")
        if not _is_int(self.k) or self.k < 1:
            _fail("speculative.k", self.k, "an integer >= 1 (tokens drafted per step)")
        for name in ("ngram_max", "ngram_min"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                _fail(f"speculative.{name}", getattr(self, name), "an integer >= 1")
        if self.ngram_min > self.ngram_max:
            _fail("speculative.ngram_min", self.ngram_min,
                  f"at most ngram_max={self.ngram_max}")
        for name in ("draft_window_size", "draft_sink_tokens", "draft_num_layers"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                _fail(f"speculative.{name}", getattr(self, name), "an integer >= 0")
        if self.draft_window_size and self.draft_sink_tokens >= self.draft_window_size:
            _fail("speculative.draft_sink_tokens", self.draft_sink_tokens,
                  f"fewer than draft_window_size={self.draft_window_size}")
        if self.draft_kv_dtype is not None and self.draft_kv_dtype not in KV_DTYPES:
            _fail("speculative.draft_kv_dtype", self.draft_kv_dtype,
                  f"None or one of {list(KV_DTYPES)}")
        if self.draft_weight_dtype not in DRAFT_WEIGHT_DTYPES:
            _fail("speculative.draft_weight_dtype", self.draft_weight_dtype,
                  f"one of {list(DRAFT_WEIGHT_DTYPES)}")
        if self.drafter == "self" and not (self.draft_window_size or self.draft_kv_dtype
                                           or self.draft_num_layers
                                           or self.draft_weight_dtype):
            _fail("speculative.draft_window_size", self.draft_window_size,
                  "a window > 0, a draft_kv_dtype, draft_num_layers > 0 or a "
                  "draft_weight_dtype with drafter='self' (a draft as costly as the target "
                  "buys nothing)")
        if self.draft_kv_source not in DRAFT_KV_SOURCES:
            _fail("speculative.draft_kv_source", self.draft_kv_source,
                  f"one of {list(DRAFT_KV_SOURCES)}")
        if self.draft_kv_source == "target" and self.drafter == "self" and (
                not self.draft_window_size or self.draft_kv_dtype):
            _fail("speculative.draft_kv_source", self.draft_kv_source,
                  "'own' unless the draft has a window (draft_window_size > 0) and the "
                  "target's element type (draft_kv_dtype=None): the draft copies the "
                  f"target's window as it is (draft_window_size={self.draft_window_size}, "
                  f"draft_kv_dtype={self.draft_kv_dtype!r})")
        if self.draft_kv_source == "target" and self.drafter == "model":
            _fail("speculative.draft_kv_source", self.draft_kv_source,
                  "'own' with drafter='model' (another model cannot read the target's keys)")
        if self.drafter == "model" and not self.draft_config:
            _fail("speculative.draft_config", self.draft_config,
                  "a config file such as 'configs/mqa.py' with drafter='model'")

    @property
    def enabled(self) -> bool:
        """Whether decoding is speculative (a drafter other than 'none')."""
        return self.drafter != "none"

    @property
    def copies_target_window(self) -> bool:
        """Whether the draft keeps no cache of its own: a 'self' draft with
        ``draft_kv_source='target'``, whose window is copied from the target's cache
        every round (``kvjax.cache.window_view``). False for 'ngram' (no cache at all),
        which accepts and ignores the setting."""
        return self.drafter == "self" and self.draft_kv_source == "target"


MESH_AXES = ("data", "model", "seq")

MAX_POSITIONS = 2 ** 24
"""The longest cache a run accepts (``max_seq_len``, ``cost_context``): every integer
position below 2^24 is exact in float32, where the rotary angles are computed
(:func:`kvjax.models.layers.apply_rope`); past it positions round (at 2^24 a model's
loss on the same text rose by 0.263 nats) and nothing would say so. Below it the angles
still lose precision with the position's magnitude (about +0.0025 nats at 1e7)."""
KV_FALLBACKS = ("none", "replicate")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """A device mesh for one run (``kvjax.parallel``): sizes of its three named axes.

    Attributes:
      data: devices that split the batch B (each holds B / data rows of the cache).
      model: tensor parallelism (Megatron): query heads N, KV heads K, FFN width F and
        the vocabulary V are split over it.
      seq: devices that split the cache's slot axis S (one long request's cache spans
        them; decode attention combines partial softmax statistics across them).
      kv_fallback: what to do when ``model`` does not divide the KV heads K (GQA with
        K < model, MQA): 'none' (an error before any compile) or 'replicate' (every
        model shard holds all K KV heads and their cache; query heads stay split).
    The mesh holds data * model * seq devices: at most the device count (a smaller mesh
    uses the first ones, :func:`kvjax.parallel.mesh.mesh_devices`; with several processes
    exactly the device count).
    """

    data: int = 1
    model: int = 1
    seq: int = 1
    kv_fallback: str = "none"

    def __post_init__(self):
        for f in MESH_AXES:
            _positive(f"mesh.{f}", getattr(self, f))
        if self.kv_fallback not in KV_FALLBACKS:
            _fail("mesh.kv_fallback", self.kv_fallback, f"one of {list(KV_FALLBACKS)}")

    @property
    def shape(self) -> tuple:
        """(data, model, seq)."""
        return (self.data, self.model, self.seq)

    @property
    def size(self) -> int:
        """Devices in the mesh."""
        return self.data * self.model * self.seq

    @property
    def trivial(self) -> bool:
        """One device: the single-device path, no shardings."""
        return self.size == 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """``jax.distributed`` settings for a run over several processes (None: one process).

    Attributes:
      coordinator_address: 'host:port' of process 0's coordinator, or None (one process).
      num_processes: processes taking part (>= 1).
      process_id: this process's index, 0 <= process_id < num_processes.
      local_devices: CPU devices per process (sets
        ``--xla_force_host_platform_device_count`` before JAX starts); None: as is.
    """

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    local_devices: int | None = None

    def __post_init__(self):
        _positive("distributed.num_processes", self.num_processes)
        if not _is_int(self.process_id) or not 0 <= self.process_id < self.num_processes:
            _fail("distributed.process_id", self.process_id,
                  f"an integer in [0, {self.num_processes}) (distributed.num_processes="
                  f"{self.num_processes})")
        if self.num_processes > 1 and not self.coordinator_address:
            _fail("distributed.coordinator_address", self.coordinator_address,
                  "'host:port' when distributed.num_processes > 1")
        if self.local_devices is not None:
            _positive("distributed.local_devices", self.local_devices)

    @property
    def enabled(self) -> bool:
        return self.num_processes > 1


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One decode run: model, weights, prompt and budget.

    Attributes:
      model: the architecture.
      weights: 'smollm2' (the real pretrained GGUF), 'random' (initialised) or 'hf' (a
        Hugging Face checkpoint folder, ``weights_path``: Llama, Mistral or Qwen2; the
        model's architecture comes from its config.json, :func:`kvjax.checkpoints.hf.
        checkpoint_model`).
      weights_path: a local GGUF file to use instead of the downloaded one; with
        weights='hf', the checkpoint folder (config.json, *.safetensors, tokenizer.json).
      cache_dir: where fetched weights are cached (None: $KVJAX_CACHE or ~/.cache/kvjax).
      prompt: the text to continue.
      max_new_tokens: decode budget in tokens.
      max_seq_len: S, KV-cache length in tokens (prompt + new tokens must fit).
      batch_size: B, copies of the prompt decoded together.
      sampling: SamplingConfig.
      stop_at_eos: end a row when it emits an end-of-generation token (any of the
        checkpoint's, ``Tokenizer.eos_token_ids``; SmolLM2: ``<|endoftext|>``, ``<|im_end|>``).
      cost_context: the cost report's long context t: the decode step compiled, counted
        and timed there beside the run's own context (None: the checkpoint's trained
        context, 8,192 for random weights; max_seq_len: no second context). On a mesh:
        the context of the sharded step (None: max_seq_len).
      measure_repeats: repeats of the timed decode step for the measured column.
      chat_template: apply the checkpoint's own chat template to the prompt (the prompt
        becomes the user's turn and generation starts in the assistant's turn): True
        (an error if the checkpoint has none), False (raw completion of the prompt
        text) or None (the default: apply it when the weights are a pretrained
        checkpoint that carries a template, as SmolLM2-Instruct does; never for
        'random' weights).
      system_prompt: the system turn with the chat template (None: the template's own
        default, if any).
      system_prompt_file: read the system turn from this file instead.
      backend: (experiment configs only) overrides ``model.backend``: 'cpu', 'gpu' or
        'tpu', whose choices (layouts, layer stack, dot operands) the model config makes;
        None: this process's JAX backend.
      dtype: (experiment configs only) overrides ``model.dtype``.
      ignore_memory_check: skip the check that weights + cache + temporaries fit the
        memory available (``kvjax.inference.memory``), for those who know better.
      prefill_chunk: None to prefill the prompt in one pass; N to feed it N tokens at a
        time (one compiled program for every full chunk, one for the remainder): less
        peak memory, more passes over the weights.
      page_size: 0 (the default): the slot engine reserves a dense row of max_seq_len
        slots per request; N >= 1: its KV cache is a pool of pages of N tokens with a
        block table per row (``kvjax.inference.engine.PagedRows``, ``kvjax.cache.paged``);
        an evicting ``model.kv_compression`` row holds kv_budget + recent_slots slots
        of whole pages (:func:`check_paged_compression`).
      mesh: MeshConfig, the device mesh (default one device).
      distributed: DistributedConfig, ``jax.distributed`` settings (default one process).
      speculative: SpeculativeConfig (default plain decoding).
    """

    model: ModelConfig
    weights: str = "smollm2"
    weights_path: str | None = None
    cache_dir: str | None = None
    prompt: str = "What is the capital of France?"
    max_new_tokens: int = 32
    max_seq_len: int = 256
    batch_size: int = 1
    sampling: SamplingConfig = SamplingConfig()
    stop_at_eos: bool = True
    cost_context: int | None = None
    measure_repeats: int = 5
    chat_template: bool | None = None
    system_prompt: str | None = None
    system_prompt_file: str | None = None
    ignore_memory_check: bool = False
    prefill_chunk: int | None = None
    page_size: int = 0
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            _fail("weights", self.weights, f"one of {list(WEIGHTS)}")
        if self.weights == "hf" and not self.weights_path:
            _fail("weights_path", self.weights_path,
                  "a Hugging Face checkpoint folder with weights='hf'")
        _positive("max_new_tokens", self.max_new_tokens)
        _positive("max_seq_len", self.max_seq_len)
        _positive("batch_size", self.batch_size)
        _positive("measure_repeats", self.measure_repeats)
        if self.cost_context is not None:
            _positive("cost_context", self.cost_context)
        for name in ("max_seq_len", "cost_context"):
            n = getattr(self, name)
            if n is not None and n > MAX_POSITIONS:
                _fail(name, n, f"at most {MAX_POSITIONS:,} (2^24: positions past it are not "
                      "exact in float32, and the rotary angles lose their precision)")
        if self.prefill_chunk is not None:
            _positive("prefill_chunk", self.prefill_chunk)
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) \
                or self.page_size < 0:
            _fail("page_size", self.page_size,
                  "0 (dense rows) or an integer >= 1 (tokens per page of a paged cache)")
        if not isinstance(self.prompt, str) or not self.prompt:
            _fail("prompt", self.prompt, "a non-empty string")
        if self.chat_template not in (None, True, False):
            _fail("chat_template", self.chat_template, "True, False or None (auto)")
        if self.system_prompt is not None and self.system_prompt_file is not None:
            _fail("system_prompt_file", self.system_prompt_file,
                  "None when system_prompt is set (one source for the system turn)")
        if self.chat_template is False and (self.system_prompt is not None
                                            or self.system_prompt_file is not None):
            _fail("chat_template", False,
                  "True or None when a system prompt is given (it needs the template)")
        if self.system_prompt_file is not None and not os.path.isfile(self.system_prompt_file):
            _fail("system_prompt_file", self.system_prompt_file, "a readable text file")
        if self.model.kv_compression is not None:
            self._check_compression()

    def _check_compression(self) -> None:
        """What lever 5 (``model.kv_compression``) does not combine with, refused by name
        before any work."""
        m = self.model
        if m.kv_selects_pages:
            self._check_page_selection()
            return
        if m.kv_budget > self.max_seq_len:
            _fail("model.kv_budget", m.kv_budget,
                  f"at most max_seq_len={self.max_seq_len} (a budget the context cannot fill)")
        if m.layer_budgets is not None and max(m.layer_budgets) > self.max_seq_len:
            _fail("model.kv_budget", m.kv_budget,
                  f"a budget whose largest layer budget ({max(m.layer_budgets)}, layer 0) "
                  f"is at most max_seq_len={self.max_seq_len} (a budget the context cannot "
                  "fill), or a smaller model.compression.pyramid_beta")
        why = f"with model.kv_compression={m.kv_compression!r}"
        if self.page_size:
            check_paged_compression(m, self.page_size)
        if self.prefill_chunk is not None:
            _fail("prefill_chunk", self.prefill_chunk,
                  f"None {why} (the prompt is scored and compressed after one prefill pass)")
        if self.speculative.enabled and m.compression.schedule != "prefill":
            _fail("speculative.drafter", self.speculative.drafter,
                  f"'none' {why} and model.compression.schedule="
                  f"{m.compression.schedule!r} (a decode-time re-scoring is not rolled "
                  "back; schedule 'prefill' leaves a kept set and a ring, rolled back as a "
                  "window's)")
        if self.speculative.drafter == "self":
            _fail("speculative.drafter", self.speculative.drafter,
                  f"'ngram' or 'model' {why} (a 'self' draft's cheap cache is not derived "
                  "from a compressed one)")
        if self.mesh.size > 1:
            _fail("mesh", self.mesh, f"one device {why} (not implemented on a mesh)")

    def _check_page_selection(self) -> None:
        """What a read-time page selection (Quest) needs: a paged cache whose pages the
        budget counts (kv_budget a multiple of page_size, at most max_seq_len rounded up
        to pages, more pages than ``compression.first_pages``), one device, no
        speculation; refused by name before any work."""
        m = self.model
        why = f"with model.kv_compression={m.kv_compression!r}"
        if not self.page_size:
            _fail("page_size", self.page_size, f"an integer >= 1 {why} (it selects pages of "
                  "a paged cache; dense rows have none)")
        if m.kv_budget % self.page_size:
            _fail("model.kv_budget", m.kv_budget, f"a multiple of page_size={self.page_size} "
                  f"{why} (tokens read per KV head: whole pages)")
        capacity = -(-self.max_seq_len // self.page_size) * self.page_size
        if m.kv_budget > capacity:
            _fail("model.kv_budget", m.kv_budget, f"at most {capacity} {why} (a row's "
                  f"pages at max_seq_len={self.max_seq_len})")
        if m.compression.first_pages >= m.kv_budget // self.page_size:
            _fail("model.compression.first_pages", m.compression.first_pages,
                  f"fewer than the budget's {m.kv_budget // self.page_size} pages {why}")
        if self.speculative.enabled:
            _fail("speculative.drafter", self.speculative.drafter,
                  f"'none' {why} (a rolled-back page keeps the bounds of its rejected keys)")
        if self.mesh.size > 1:
            _fail("mesh", self.mesh, f"one device {why} (not implemented on a mesh)")

    def check_fits(self, prompt_tokens: int) -> None:
        """Raises ConfigError unless the tokens the run writes fit in the cache: the
        prompt and max_new_tokens - 1 (:func:`kvjax.cache.policy.written_tokens`, the
        rule every decoding path uses). The cache's slot policy decides (a windowed ring
        never fills, so any length fits).
        """
        # imported here: cache/ imports this module (the slot policy lives there)
        from kvjax.cache import policy  # noqa: PLC0415
        need = policy.written_tokens(prompt_tokens, self.max_new_tokens)
        try:
            policy.policy_for(self.model).check_room(0, need, self.max_seq_len, "decode")
        except policy.CacheOverflowError:
            _fail("max_seq_len", self.max_seq_len,
                  f"at least prompt tokens ({prompt_tokens}) + max_new_tokens "
                  f"({self.max_new_tokens}) - 1 = {need} (the last new token is never "
                  "written)")


def check_paged_compression(m: ModelConfig, page_size: int) -> None:
    """Raises ConfigError, naming the value and what is allowed, unless an evicting
    ``m.kv_compression`` runs on paged rows of ``page_size`` tokens: schedule 'prefill',
    one budget in every layer, and kv_budget + recent_slots whole pages (a compressed
    row holds that fixed number of pages: :func:`kvjax.cache.paged.init_paged_cache`).
    Every-N re-scoring and PyramidKV's per-layer budgets run on dense rows
    (``page_size=0``)."""
    why = f"with page_size={page_size} and model.kv_compression={m.kv_compression!r}"
    if m.compression.schedule != "prefill":
        _fail("model.compression.schedule", m.compression.schedule,
              f"'prefill' {why} (a paged row is compressed once, after its prefill; "
              "'every_n' re-scores dense rows only: page_size=0)")
    if m.layer_budgets is not None:
        _fail("model.kv_compression", m.kv_compression,
              f"a method with one budget in every layer {why}, or "
              "model.compression.uniform_layers=True (per-layer budgets "
              f"{m.layer_budgets} run on dense rows only: page_size=0)")
    slots = m.kv_budget + m.compression.recent_slots
    if slots % page_size:
        _fail("model.kv_budget", m.kv_budget,
              f"a budget with kv_budget + model.compression.recent_slots a multiple of "
              f"page_size={page_size} (got {m.kv_budget} + {m.compression.recent_slots} "
              f"= {slots}: a compressed row is whole pages)")


def _plain(d: Any) -> dict:
    return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def default_scan_layers() -> bool:
    """The layer-stack default of the process's backend (:func:`kvjax.backend.scan_layers`)."""
    return backend_lib.scan_layers(backend_lib.current())


def default_kv_layout(name: str, num_groups: int) -> str:
    """The 'auto' layout of cached tensor ``name`` on the process's backend
    (:func:`kvjax.backend.kv_layout`, which cites the measurements)."""
    return backend_lib.kv_layout(backend_lib.current(), name, num_groups)


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Builds a validated ModelConfig from a mapping (e.g. ``config.model``).

    Raises:
      ConfigError: unknown keys or invalid values.
    """
    d = _known(ModelConfig, "model.", d, exclude={"plan"})
    missing = sorted(f.name for f in dataclasses.fields(ModelConfig)
                     if f.default is dataclasses.MISSING and f.name not in d)
    if missing:
        _fail("model." + missing[0], None, "a value (required field)")
    return ModelConfig(**d)


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Builds a validated RunConfig from an experiment ConfigDict.

    ``d.dtype`` and ``d.backend``, when set, override ``d.model``'s (so
    ``--config.dtype=bfloat16`` and ``--config.backend=gpu`` work); ``d.sampling`` is a mapping of SamplingConfig fields.

    Raises:
      ConfigError: unknown keys or invalid values, naming the field.
    """
    d = _plain(d)
    model = dict(d.pop("model"))
    for key in ("dtype", "backend"):  # run-level overrides of the model's fields
        if d.get(key) is not None:
            model[key] = d[key]
        d.pop(key, None)
    if d.get("weights") == "hf":  # the architecture is the checkpoint's config.json
        try:
            model = hf.checkpoint_model(model, d.get("weights_path"))
        except WeightsError as e:
            raise ConfigError(f"invalid config: weights_path={d.get('weights_path')!r}: "
                              f"{e}") from None
    sampling = SamplingConfig(**_plain(d.pop("sampling", {})))
    mesh = _sub_config(MeshConfig, "mesh", d.pop("mesh", {}))
    distributed = _sub_config(DistributedConfig, "distributed", d.pop("distributed", {}))
    speculative = _sub_config(SpeculativeConfig, "speculative", d.pop("speculative", {}))
    _known(RunConfig, "", d)
    return RunConfig(model=model_config_from_dict(model), sampling=sampling, mesh=mesh,
                     distributed=distributed, speculative=speculative, **d)


def distributed_config(d: Mapping[str, Any]) -> DistributedConfig:
    """The ``distributed`` part of a run's config dict, validated on its own (no JAX
    backend touched), so an entry point can join ``jax.distributed`` before building the
    rest (:func:`run_config_from_dict` resolves the backend).

    Raises:
      ConfigError: unknown keys or invalid values (e.g. a process id out of range).
    """
    return _sub_config(DistributedConfig, "distributed", _plain(d).get("distributed", {}))


def _sub_config(cls, prefix: str, d: Mapping[str, Any]):
    """``cls(**d)``, refusing unknown keys with a message naming ``prefix.key``."""
    return cls(**_known(cls, prefix + ".", d))


def _known(cls, prefix: str, d: Mapping[str, Any], exclude=frozenset()) -> dict:
    """``d`` as a dict; raises ConfigError naming ``prefix`` + the first key that is not
    a field of dataclass ``cls`` (or is in ``exclude``), and the fields allowed."""
    d = _plain(d)
    fields = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = sorted(set(d) - fields)
    if unknown:
        _fail(prefix + unknown[0], d[unknown[0]], f"fields among {sorted(fields)}")
    return d
