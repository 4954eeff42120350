"""SmolLM2-135M (real weights, GQA: 9 query heads, 3 KV heads) with a W=512 sliding window
on every layer: lever 3 composed with lever 1.

    python -m experiments.decode --config=configs/window.py
    python -m experiments.decode --config=configs/window.py --config.model.window_size=64 \
        --config.model.num_sink_tokens=4 --config.prompt="$(cat long_prompt.txt)"

The KV cache is a ring buffer of W slots per layer (slot = position mod W, or with s sinks
the first s positions pinned and the rest in W - s ring slots); it holds
30·3·(64+64)·4·512 = 23,592,960 bytes in float32 at any context, so prompt + new tokens
may exceed W and max_seq_len only sets the context at which the cost report compiles the
step (the cache is W slots whatever it is). SmolLM2 was trained with full attention: a
window shorter than the text changes its outputs (the quality price of lever 3);
``--config.model.num_sink_tokens`` keeps the first tokens visible (Xiao et al. 2023).
"""

from configs import base


def get_config():
    return base.run_dict(base.model_dict(**dict(
        base.SMOLLM2, name="smollm2-135m-window512", window_size=512)))
