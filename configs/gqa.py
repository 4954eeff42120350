"""SmolLM2-135M-Instruct as published: GQA with 9 query heads sharing 3 KV heads.

    python -m experiments.decode --config=configs/gqa.py

Expected: with the checkpoint's chat template (the default), the answer to "What is the
capital of France?" is "The capital of France is Paris."; raw completion
(``--config.chat_template=False --config.prompt="The capital of France is"``) continues
with " Paris.". The KV cache holds 30·3·(64+64)·4 = 46,080 bytes per token in float32 (a
third of mha.py's).
"""

from configs import base


def get_config():
    return base.run_dict(base.model_dict(**base.SMOLLM2))
