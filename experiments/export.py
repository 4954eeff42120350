r"""Write the loaded model as a Hugging Face checkpoint folder (your own model, offline).

    python -m experiments.export --config=configs/gqa.py --out=/tmp/smollm2-hf
    python -m experiments.export --config=configs/mqa.py --out=/tmp/smollm2-mqa-hf   # K = 1
    python -m experiments.decode --config=configs/gqa.py --config.weights=hf \
        --config.weights_path=/tmp/smollm2-hf          # reads it back: the same tokens

Loads the weights exactly as the main job does (``--config.weights`` smollm2 | hf |
random, converted to ``--config.model.num_kv_heads``, in ``--config.dtype``), then writes
config.json (LlamaForCausalLM, or Qwen2ForCausalLM with q/k/v biases), model.safetensors,
tokenizer.json, tokenizer_config.json (bos / eos, the chat template) and
generation_config.json to ``--out`` (:func:`kvjax.checkpoints.hf.write_hf_checkpoint`).
The window, sinks and cache dtype are run-time choices of the cache, not weights: they
are not written. MLA configs are refused (no Llama-family tensor layout).
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import cli

from kvjax.checkpoints import WeightsError, hf
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.inference import runner
from kvjax.models import convert

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Model config file (get_config())."),
    lock_config=True)
_OUT = flags.DEFINE_string("out", None, "The checkpoint folder to write (created).")
flags.adopt_module_key_flags(cli)


def export(run, out: str) -> str:
    """Loads ``run``'s model (:func:`kvjax.inference.runner.load`) and writes it to the
    folder ``out``; returns the folder.

    Raises:
      ConfigError: an MLA config, or ``run`` disagrees with its checkpoint.
      WeightsError: the weights cannot be read.
    """
    if run.model.is_mla:
        raise ConfigError("invalid config: model.attention='mla' cannot be written as a "
                          "Hugging Face Llama/Qwen2 folder; allowed: mha, gqa, mqa")
    loaded = runner.load(run)
    tensors = convert.hf_tensors_from_params(loaded.params, loaded.cfg)
    folder = hf.write_hf_checkpoint(out, tensors,
                                    convert.hf_hparams(loaded.cfg, loaded.context_length),
                                    loaded.tokenizer)
    return str(folder)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        if not _OUT.value:
            raise cli.UsageError("--out=DIR is required (the checkpoint folder to write)")
        cli.check_output_dir(_OUT.value, "out")
        run = run_config_from_dict(_CONFIG.value)
        folder = export(run, _OUT.value)
    except (ConfigError, WeightsError, cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {folder}: config.json, model.safetensors, tokenizer.json, "
          "tokenizer_config.json, generation_config.json\nread it back with: python -m "
          f"experiments.decode --config.weights=hf --config.weights_path={folder}")
    return 0


if __name__ == "__main__":
    cli.run(main)
