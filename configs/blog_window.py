"""The blog's composed levers ("Composing the levers"): its running model (configs/blog.py:
D=512, h=8, d_k=d_v=64, L=12, GELU FFN) with GQA g=2 (2 KV heads) and a W=512 window.

    python -m experiments.decode --config=configs/blog_window.py --config.dtype=float16

Randomly initialised (the text is noise; the costs are the point). In the blog's fp16 the
KV cache is 12·2·128·2·512 = 3,145,728 bytes ("3 MB (fixed)") at any context: 1,000x
below vanilla MHA's 3 GB at t = 128,000 (4x from GQA times 250x from the window). The
default float32 doubles the bytes.
"""

from configs import base
from kvjax import presets


def get_config():
    model = base.model_dict(**presets.variant(
        presets.architecture(presets.blog_model, vocab_size=49152),
        num_kv_heads=2, window_size=512, name="blog"))
    return base.run_dict(model, weights="random", max_new_tokens=16,
                         prompt="The KV cache is the bottleneck of inference because")
