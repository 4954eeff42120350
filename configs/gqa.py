"""SmolLM2-135M-Instruct as published: GQA with 9 query heads sharing 3 KV heads.

    python -m experiments.decode --config=configs/gqa.py

Expected: greedy decoding continues "The capital of France is" with " Paris."; the KV
cache holds 30·3·(64+64)·4 = 46,080 bytes per token in float32 (a third of mha.py's).
"""

from configs import base


def get_config():
    return base.run_dict(base.model_dict(**base.SMOLLM2))
