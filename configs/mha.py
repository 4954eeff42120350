"""SmolLM2-135M with each KV head duplicated across its group: MHA, 9 KV heads.

    python -m experiments.decode --config=configs/mha.py

Expected: exactly the tokens of gqa.py (duplication computes the same function) with three
times the KV bytes: 138,240 bytes per token in float32.
"""

from configs import base
from kvjax import presets


def get_config():
    return base.run_dict(base.model_dict(**presets.variant(
        base.SMOLLM2, num_kv_heads=9, name="smollm2-135m")))
