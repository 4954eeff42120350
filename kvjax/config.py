"""Typed, validated configuration.

Experiment files under ``configs/`` return an ``ml_collections.ConfigDict``; the entry
points turn it into the frozen dataclasses below with :func:`model_config_from_dict` and
:func:`run_config_from_dict`, which validate every field before any work starts.

Shape letters (DESIGN.md): B batch, T query length, S cache length, D d_model,
N query heads, K KV heads, G = N // K, H head_dim, F FFN width, L layers,
C kv_lora_rank, R qk_rope_head_dim, W window_size.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
ATTENTION_TYPES = ("mha", "gqa", "mqa", "mla")
MLP_TYPES = ("swiglu", "gelu")
WEIGHTS = ("smollm2", "random")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, value and what is allowed."""


KV_LAYOUTS = ("auto", "BKSH", "BKHS")
PREFILL_IMPLS = ("tiled", "dense")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"invalid config: {field}={value!r}; allowed: {allowed}")


def _positive(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        _fail(field, value, "a positive integer")


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name ('float32' -> 4, 'bfloat16' -> 2, ...)."""
    if dtype not in DTYPES:
        _fail("dtype", dtype, f"one of {sorted(DTYPES)}")
    return int(np.dtype(DTYPES[dtype]).itemsize)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only LM.

    Attributes:
      vocab_size: V, tokens in the vocabulary.
      num_layers: L.
      d_model: D, residual width.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads; must divide N (MHA: K = N, MQA: K = 1).
      head_dim: H, per-head width of queries, keys and values (MHA/GQA/MQA).
      mlp_dim: F, FFN hidden width.
      mlp_type: 'swiglu' (gate, up, down: 3·D·F params, llama) or 'gelu'
        (W1, W2: 2·D·F params, the blog's FFN).
      attention: 'mha' (K = N), 'mqa' (K = 1), 'gqa' (any K dividing N) or 'mla'.
      rope_theta: rotary base (SmolLM2: 1e5).
      norm_eps: RMSNorm epsilon.
      tie_embeddings: LM head shares the token embedding matrix.
      window_size: W, sliding-window length in tokens; None for full attention.
      num_sink_tokens: attention sinks kept besides the window (needs window_size).
      kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim, q_lora_rank:
        MLA sizes C, R, per-head no-rope key width, per-head value width and the
        optional query low-rank width (DeepSeek-V2, Liu et al. 2024, sec. 2.1).
      mla_absorb: MLA decode path, False = naive (rebuild K/V), True = absorbed.
      key_layout, value_layout: memory layout of one layer's cached keys / values (MHA,
        GQA, MQA): 'BKSH' (slot-major rows, [B, K, S, H]), 'BKHS' (slot axis last,
        [B, K, H, S]) or 'auto' (see :func:`default_kv_layout`: on CPU keys 'BKHS' and
        values 'BKHS' only when G = 1, else 'BKSH'; 'BKSH' on accelerators). The math
        and the bytes are the same; only XLA's dot kernels differ. MLA caches a latent
        and ignores them (they must stay 'auto').
      scan_layers: True runs the layer stack as one ``nn.scan`` over stacked parameters
        and a stacked cache (compile time independent of L); False unrolls it over
        per-layer arrays. On CPU the unrolled stack decodes faster: inside the scan XLA
        copies each layer's cache slice out of the stacked buffer before its dot
        (measured in README "Results").
      prefill_impl: attention of chunks of T > 1 tokens (the prompt): 'tiled' (an
        online softmax over blocks of queries and keys, :mod:`kvjax.models.flash`; no
        more than one [block_q, block_k] tile of scores per head exists, blocks above the
        causal diagonal or outside the window skipped) or 'dense' (all [T, S] scores
        materialised and masked). Same function; decode steps (T = 1) are unaffected.
      prefill_block_q, prefill_block_k: the tiled path's block sizes, in queries and in
        key slots.
      dtype: parameter, activation and KV-cache dtype name.
      name: free-form label used in reports.
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
    window_size: int | None = None
    num_sink_tokens: int = 0
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    mla_absorb: bool = True
    key_layout: str = "auto"
    value_layout: str = "auto"
    scan_layers: bool = True
    prefill_impl: str = "tiled"
    prefill_block_q: int = 256
    prefill_block_k: int = 256
    dtype: str = "float32"
    name: str = "model"

    def __post_init__(self):
        validate_model_config(self)

    replace = dataclasses.replace

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def num_groups(self) -> int:
        """G = N // K, query heads that share one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    def cache_layout(self, name: str) -> str:
        """'BKSH' or 'BKHS': the layout of cached tensor ``name`` ('k' or 'v'), with
        'auto' resolved by :func:`default_kv_layout` for the current JAX backend."""
        layout = {"k": self.key_layout, "v": self.value_layout}[name]
        return default_kv_layout(name, self.num_groups) if layout == "auto" else layout


def validate_model_config(c: ModelConfig) -> None:
    """Raises ConfigError naming the first invalid field of ``c``."""
    for f in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
              "head_dim", "mlp_dim"):
        _positive(f"model.{f}", getattr(c, f))
    if c.dtype not in DTYPES:
        _fail("model.dtype", c.dtype, f"one of {sorted(DTYPES)}")
    if c.attention not in ATTENTION_TYPES:
        _fail("model.attention", c.attention, f"one of {list(ATTENTION_TYPES)}")
    if c.mlp_type not in MLP_TYPES:
        _fail("model.mlp_type", c.mlp_type, f"one of {list(MLP_TYPES)}")
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
    if c.num_sink_tokens and c.window_size is None:
        _fail("model.num_sink_tokens", c.num_sink_tokens,
              "0 unless model.window_size is set (sinks are kept beside a window)")
    if c.window_size is not None and c.num_sink_tokens >= c.window_size:
        _fail("model.num_sink_tokens", c.num_sink_tokens,
              f"an integer below window_size={c.window_size}")
    for f in ("key_layout", "value_layout"):
        if getattr(c, f) not in KV_LAYOUTS:
            _fail(f"model.{f}", getattr(c, f), f"one of {list(KV_LAYOUTS)}")
        if c.attention == "mla" and getattr(c, f) != "auto":
            _fail(f"model.{f}", getattr(c, f),
                  "'auto' for attention='mla' (MLA caches a latent [B, S, C], no heads)")
    if c.prefill_impl not in PREFILL_IMPLS:
        _fail("model.prefill_impl", c.prefill_impl, f"one of {list(PREFILL_IMPLS)}")
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


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Token sampling. temperature 0 means greedy; top_k 0 and top_p 1 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            _fail("sampling.temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if isinstance(self.top_k, bool) or self.top_k < 0:
            _fail("sampling.top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            _fail("sampling.top_p", self.top_p, "a number in (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One decode run: model, weights, prompt and budget.

    Attributes:
      model: the architecture.
      weights: 'smollm2' (the real pretrained GGUF) or 'random' (initialised).
      weights_path: a local GGUF file to use instead of the downloaded one.
      cache_dir: where fetched weights are cached (None: $KVJAX_CACHE or ~/.cache/kvjax).
      prompt: the text to continue.
      max_new_tokens: decode budget in tokens.
      max_seq_len: S, KV-cache length in tokens (prompt + new tokens must fit).
      batch_size: B, copies of the prompt decoded together.
      sampling: SamplingConfig.
      stop_at_eos: end a row when it emits the end-of-sequence token.
      cost_context: context length t at which the cost report compiles the decode step
        (None: the prompt length).
      measure_repeats: repeats of the timed decode step for the measured column.
      prefill_chunk: None to prefill the prompt in one pass; N to feed it N tokens at a
        time (one compiled program for every full chunk, one for the remainder): less
        peak memory, more passes over the weights.
    """

    model: ModelConfig
    weights: str = "smollm2"
    weights_path: str | None = None
    cache_dir: str | None = None
    prompt: str = "The capital of France is"
    max_new_tokens: int = 32
    max_seq_len: int = 256
    batch_size: int = 1
    sampling: SamplingConfig = SamplingConfig()
    stop_at_eos: bool = True
    cost_context: int | None = None
    measure_repeats: int = 5
    prefill_chunk: int | None = None

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            _fail("weights", self.weights, f"one of {list(WEIGHTS)}")
        _positive("max_new_tokens", self.max_new_tokens)
        _positive("max_seq_len", self.max_seq_len)
        _positive("batch_size", self.batch_size)
        _positive("measure_repeats", self.measure_repeats)
        if self.cost_context is not None:
            _positive("cost_context", self.cost_context)
        if self.prefill_chunk is not None:
            _positive("prefill_chunk", self.prefill_chunk)
        if not isinstance(self.prompt, str) or not self.prompt:
            _fail("prompt", self.prompt, "a non-empty string")

    def check_fits(self, prompt_tokens: int) -> None:
        """Raises ConfigError unless prompt + max_new_tokens fit in max_seq_len.

        A windowed cache holds only W slots, so any length fits there.
        """
        if self.model.window_size is not None:
            return
        need = prompt_tokens + self.max_new_tokens
        if need > self.max_seq_len:
            _fail("max_seq_len", self.max_seq_len,
                  f"at least prompt tokens ({prompt_tokens}) + max_new_tokens "
                  f"({self.max_new_tokens}) = {need}")


def _plain(d: Any) -> dict:
    return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def default_scan_layers() -> bool:
    """scan_layers=None resolves here: unrolled on CPU, scanned on accelerators.

    On CPU, XLA copies each layer's slice of stacked parameters and caches out of the
    scan's buffers before its dots (2.7x the theory bytes for the blog model at t=4096,
    against 1.1x unrolled; see README "Results").
    """
    import jax  # noqa: PLC0415 (only needed at the boundary)
    return jax.default_backend() != "cpu"


def default_kv_layout(name: str, num_groups: int) -> str:
    """'auto' cache layouts resolve here (``name`` 'k' or 'v', G = num_groups).

    On CPU, XLA lowers the decode step's two products to Eigen matrix-vector kernels
    whose speed depends on which operand is contiguous. Measured on the 2-core CI CPU,
    float32, K·G = 8, S = 65,536, H = 64 (``python scripts/layout_bench.py``, GB/s of
    cache read over several runs): q·K^T with keys [H, S] 24-50 against 9-28 with [S, H],
    for every G; p·V with values [H, S] 31-45 against 8-10 with [S, H] for G = 1, but
    1.3-3 against 19-30 for G >= 2. So keys 'BKHS' always and values 'BKHS' only when
    G = 1. Other backends get the conventional 'BKSH' (not measured here).
    """
    import jax  # noqa: PLC0415 (only needed at the boundary)
    if jax.default_backend() != "cpu":
        return "BKSH"
    if name == "k" or num_groups == 1:
        return "BKHS"
    return "BKSH"


def model_config_from_dict(d: Mapping[str, Any]) -> ModelConfig:
    """Builds a validated ModelConfig from a mapping (e.g. ``config.model``).

    Raises:
      ConfigError: unknown keys or invalid values.
    """
    d = _plain(d)
    if d.get("scan_layers", False) is None:
        d["scan_layers"] = default_scan_layers()
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        _fail("model." + unknown[0], d[unknown[0]], f"fields among {sorted(fields)}")
    missing = sorted(f.name for f in dataclasses.fields(ModelConfig)
                     if f.default is dataclasses.MISSING and f.name not in d)
    if missing:
        _fail("model." + missing[0], None, "a value (required field)")
    return ModelConfig(**d)


def run_config_from_dict(d: Mapping[str, Any]) -> RunConfig:
    """Builds a validated RunConfig from an experiment ConfigDict.

    ``d.dtype``, when present, overrides ``d.model.dtype`` (so ``--config.dtype=bfloat16``
    works); ``d.sampling`` is a mapping of SamplingConfig fields.

    Raises:
      ConfigError: unknown keys or invalid values, naming the field.
    """
    d = _plain(d)
    model = dict(d.pop("model"))
    if d.get("dtype") is not None:
        model["dtype"] = d["dtype"]
    d.pop("dtype", None)
    sampling = SamplingConfig(**_plain(d.pop("sampling", {})))
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        _fail(unknown[0], d[unknown[0]], f"fields among {sorted(fields)}")
    return RunConfig(model=model_config_from_dict(model), sampling=sampling, **d)
