"""SmolLM2-135M (real weights, GQA: 9 query heads, 3 KV heads) with a W=512 sliding window
on every layer: lever 3 composed with lever 1.

    python -m experiments.decode --config=configs/window.py --config.max_seq_len=8192
    python -m experiments.decode --config=configs/window.py --config.model.window_size=64 \
        --config.model.num_sink_tokens=4 --config.max_new_tokens=96 \
        --config.prompt="$(cat long_prompt.txt)"

The KV cache is a ring buffer of W slots per layer (slot = position mod W, or with s sinks
the first s positions pinned and the rest in W - s ring slots); it holds
30·3·(64+64)·4·512 = 23,592,960 bytes in float32 at any context, so prompt + new tokens
may exceed W and max_seq_len only sets the context t at which the cost report costs the
step (the cache is W slots whatever it is; theory reads min(t, W) keys, and the compiled
step's XLA bytes are the same at t = 1K, 8K or 64K: 651,217,728 in float32 (jax 0.10.2,
CPU), against gqa.py's 680M, 1,090M and 4,366M). SmolLM2 was trained with full attention: a
window shorter than the text changes its outputs (the quality price of lever 3);
``--config.model.num_sink_tokens`` keeps the first tokens visible (Xiao et al. 2023).
"""

from configs import base
from kvjax import presets


def get_config():
    return base.run_dict(base.model_dict(**presets.variant(
        base.SMOLLM2, window_size=512, name="smollm2-135m")))
