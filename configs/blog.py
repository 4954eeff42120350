"""The blog's running model: D=512, h=8 heads, d_k=d_v=64, L=12, FFN 4·D (GELU), MHA.

    python -m experiments.decode --config=configs/blog.py

Randomly initialised (the text is noise; the costs are the point). It uses SmolLM2's
tokenizer, hence V=49,152 (the blog never fixes a vocabulary). In the blog's fp16,
``--config.dtype=float16`` gives its 24,576 bytes of KV per token; the default float32
doubles that to 49,152.
"""

from configs import base
from kvjax import presets


def get_config():
    model = base.model_dict(**presets.architecture(presets.blog_model, vocab_size=49152))
    return base.run_dict(model, weights="random", max_new_tokens=16,
                         prompt="The KV cache is the bottleneck of inference because")
