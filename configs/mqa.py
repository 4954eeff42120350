"""SmolLM2-135M with its 3 KV heads mean-pooled into 1: MQA.

    python -m experiments.decode --config=configs/mqa.py

The conversion of Ainslie et al. 2023 ("GQA", sec. 2.1) without uptraining: the outputs
change (the quality price of fewer KV heads), the KV cache is a third of gqa.py's:
15,360 bytes per token in float32.
"""

from configs import base
from kvjax import presets


def get_config():
    return base.run_dict(base.model_dict(**presets.variant(
        base.SMOLLM2, num_kv_heads=1, name="smollm2-135m")))
