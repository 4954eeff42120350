r"""Uptrain a converted SmolLM2 on the corpus's training split (Ainslie et al. 2023).

    python -m experiments.uptrain --config=configs/mqa.py --workdir=results/uptrain/mqa
    python -m experiments.uptrain --config=configs/mqa.py --train.steps=100 \
        --train.compute_dtype=bfloat16 --train.trainable=attention --workdir=/tmp/up
    python -m experiments.uptrain --config=configs/gqa.py --workdir=results/uptrain/gqa  # control

Converts the checkpoint as the config says (configs/mqa.py: the 3 KV heads mean-pooled
into 1), scores it on the held-out split, trains it with AdamW (warmup + cosine decay,
clipping) on random windows of the training split, scores it again and writes
``loss_curve.png``, ``history.json``, ``result.json`` and orbax checkpoints to
``--workdir``. Rerunning with the same workdir resumes from the latest checkpoint, with
the same batches and the same losses as an uninterrupted run.

Defaults: 50 steps of 4 x 128 tokens (8-17 s a step on a 2-core CPU in float32; the
same code runs on a GPU, where ``--config.model.scan_layers=True`` is the faster stack).
"""

from __future__ import annotations

import json
import pathlib
import sys

from absl import app, flags, logging

from experiments import cli

from kvjax import naming
from kvjax.inference import runner
from kvjax.training import data, evaluate
from kvjax.training import train as train_lib
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/mqa.py", cli.config_help("Model config file (get_config())."), lock_config=True)
_TRAIN = cli.DEFINE_config_dict("train", train_lib.train_config_dict(), cli.TRAIN_HELP,
                                lock_config=True)
_EVAL = cli.DEFINE_config_dict("eval", evaluate.eval_config_dict(), cli.EVAL_HELP,
                               lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "results/uptrain", "Checkpoints, history, plot.")
_EVALUATE = flags.DEFINE_bool("evaluate", True, "Score the held-out split before and after.")
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    try:
        run = run_config_from_dict(_CONFIG.value)
        tcfg = train_lib.train_config_from_dict(_TRAIN.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value)
        if ecfg.split != "heldout":
            raise ValueError(f"invalid config: eval.split={ecfg.split!r}; allowed: 'heldout' "
                             "(this entry point trains on the rest of the corpus)")
        loaded = runner.load(run)
        corpus = data.tokenized_corpus(loaded.tokenizer, _EVAL.value.corpus,
                                       _EVAL.value.heldout_fraction, run.cache_dir)
        windows = data.eval_windows(corpus.heldout, ecfg.context, ecfg.num_tokens) \
            if _EVALUATE.value else None
    except (ConfigError, WeightsError, data.CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = loaded.cfg
    workdir = pathlib.Path(_WORKDIR.value)
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"model {naming.variant_name(cfg)}; corpus {corpus.source}: "
          f"{corpus.train.size:,} training tokens in {len(corpus.train_docs)} documents")
    out = {"model": cfg.name, "variant": naming.variant_name(cfg), "train": vars(tcfg).copy()}
    if windows is not None:
        before = evaluate.perplexity(loaded.params, cfg, windows, ecfg, corpus.byte_lengths,
                                     separator_id=corpus.separator_id)
        print(f"before: perplexity {before.ppl:.3f}, bits/byte {before.bits_per_byte:.4f} "
              f"({before.num_predicted:,} held-out tokens, context {ecfg.context})")
        out["before"] = before.as_json()
    result = train_lib.train(loaded.params, cfg, tcfg, corpus.train, workdir=workdir)
    if result.resumed_from is not None:
        print(f"resumed from the checkpoint at step {result.resumed_from}")
    train_lib.plot_history({naming.variant_name(cfg): result.history},
                           workdir / "loss_curve.png",
                           title=f"uptraining {naming.variant_name(cfg)} on {corpus.source}")
    out.update(history=result.history, train_seconds=result.seconds)
    if windows is not None:
        after = evaluate.perplexity(train_lib.to_layout(result.params, cfg), cfg, windows,
                                    ecfg, corpus.byte_lengths,
                                    separator_id=corpus.separator_id)
        print(f"after {tcfg.steps} steps: perplexity {after.ppl:.3f}, bits/byte "
              f"{after.bits_per_byte:.4f}")
        out["after"] = after.as_json()
    (workdir / "result.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {workdir / 'loss_curve.png'}, {workdir / 'result.json'}, checkpoints in "
          f"{workdir / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    cli.run(main)
