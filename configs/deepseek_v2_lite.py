"""DeepSeek-V2-Lite-shaped attention in a 2-layer model, for MLA cost analysis and speed.

    python -m experiments.decode --config=configs/deepseek_v2_lite.py
    python -m experiments.decode --config=configs/deepseek_v2_lite.py \
        --config.model.mla_absorb=False --config.cost_context=32768

Attention as HF ``deepseek-ai/DeepSeek-V2-Lite`` (config.json): hidden 2048, 16 heads,
kv_lora_rank C = 512, qk_rope_head_dim R = 64, qk_nope_head_dim 128, v_head_dim 128, no
query LoRA, rope_theta 1e4, rms_norm_eps 1e-6, untied LM head. Not the real model: 2 of
its 27 layers, a dense SwiGLU of 10,944 (its first layer's ``intermediate_size``; the MoE
layers are not modelled), SmolLM2's tokenizer (V = 49,152 instead of 102,400) and random
weights (``presets.deepseek_v2_lite_attention`` has the published vocabulary).

KV cache: (512 + 64)·b bytes per token per layer (1,152 B in bf16/fp16, 2,304 B in the
default float32), against 16·(192 + 128)·b for the same heads as MHA with these head
dims (a 8.9x reduction). ``num_kv_heads``/``head_dim`` = 16 / 192 are the per-head view
ModelConfig requires. The cost report compiles the step at ``cost_context`` = 4,096.
"""

from configs import base
from kvjax import presets


def get_config():
    model = base.model_dict(**presets.architecture(
        presets.deepseek_v2_lite_attention(vocab_size=49152)))
    return base.run_dict(model, weights="random", max_new_tokens=16, cost_context=4096,
                         prompt="The KV cache is the bottleneck of inference because")
