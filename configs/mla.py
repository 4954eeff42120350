"""The blog's running model with multi-head latent attention (lever 2, DeepSeek-V2 MLA).

    python -m experiments.decode --config=configs/mla.py
    python -m experiments.decode --config=configs/mla.py --config.model.mla_absorb=False

D=512, h=8 heads, L=12, FFN 4·D (GELU) as in configs/blog.py, with the KV cache replaced by
a latent of C = kv_lora_rank = 512 (the blog's d_c = d_model example) plus the decoupled
rotary key of R = 64 dims that DeepSeek-V2 caches beside it (shared by all heads). Per
head: 64 no-rope + 64 rope query/key dims (softmax scale 1/sqrt(128)), 64 value dims.

KV bytes per token per layer: (C + R)·b = 576·2 = 1,152 B in fp16 against the blog's MHA
8·(64+64)·2 = 2,048 B, a 2048/1152 = 1.78x reduction; the blog's "2x" counts the latent
alone (512·2 = 1,024 B) and leaves out the rotary key. Over 12 layers: 13,824 B/token in
fp16 (``--config.dtype=float16``), 27,648 B in the default float32.

``mla_absorb`` picks the decode path: True folds W_UK into the query and W_UV after the
attention (only the latent cache is read); False rebuilds per-head K and V from the cached
latents every step (N·(nope + v) = 1,024 extra elements per token per layer built, written
and read back). Same function either way.

Randomly initialised (the text is noise; the costs are the point), with SmolLM2's
tokenizer, hence V = 49,152. ``model.num_kv_heads``/``head_dim`` are the per-head view
(N heads of nope + R dims) that ModelConfig requires; the MLA fields define the cache.
"""

from configs import base
from kvjax import presets


def get_config():
    model = base.model_dict(**presets.architecture(presets.blog_mla(vocab_size=49152)))
    return base.run_dict(model, weights="random", max_new_tokens=16,
                         prompt="The KV cache is the bottleneck of inference because")
