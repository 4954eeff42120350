r"""Perplexity and bits per byte of a model config on the held-out split of a real corpus.

    python -m experiments.ppl --config=configs/gqa.py
    python -m experiments.ppl --config=configs/mqa.py --eval.context=512 --eval.num_tokens=16384
    python -m experiments.ppl --config=configs/gqa.py --config.model.window_size=128 \
        --config.model.num_sink_tokens=4 --json_out=/tmp/ppl.json
    python -m experiments.ppl --config=configs/gqa.py --eval.corpus=README.md --eval.context=128 \
        --eval.chunk=32 --eval.num_tokens=500

Scores the windows through the decode path (the config's KV cache, prefilled
``eval.chunk`` tokens at a time) and checks the first batch against the cache-free full
forward. Expected for configs/gqa.py (SmolLM2-135M, float32, Django docs, context 512,
16,352 scored tokens): perplexity 12.755, 0.926 bits per byte (README "Ablations").
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax.analysis import theory
from kvjax.inference import memory, runner
from kvjax.training import data, evaluate
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gqa.py", "Model config file (get_config()).", lock_config=True)
_EVAL = config_flags.DEFINE_config_dict("eval", evaluate.eval_config_dict(), lock_config=True)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the result as JSON here.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        run = run_config_from_dict(_CONFIG.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value)
        if not run.ignore_memory_check:  # the eval cache: B windows of `context` slots
            memory.check(run.model, ecfg.batch_size, ecfg.context, what="perplexity",
                         weights_bytes=2 * theory.weight_bytes(run.model),
                         prompt_tokens=ecfg.chunk)
        loaded = runner.load(run)
        corpus = data.tokenized_corpus(loaded.tokenizer, _EVAL.value.corpus,
                                       _EVAL.value.heldout_fraction, run.cache_dir,
                                       train=False)
        windows = data.eval_windows(corpus.heldout, ecfg.context, ecfg.num_tokens)
    except (ConfigError, WeightsError, data.CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = loaded.cfg
    res = evaluate.perplexity(loaded.params, cfg, windows, ecfg, corpus.byte_lengths,
                              separator_id=corpus.separator_id)
    print(f"model: {cfg.name}  attention={cfg.attention}  K={cfg.num_kv_heads}  "
          f"window={cfg.window_size}  sinks={cfg.num_sink_tokens}  dtype={cfg.dtype}")
    print(f"corpus: {corpus.source}, held-out split: {len(corpus.heldout_docs)} documents, "
          f"{corpus.heldout.size:,} tokens; scored {res.num_predicted:,} tokens "
          f"({res.num_bytes:,} bytes) in {windows.shape[0]} windows of {ecfg.context}")
    print(f"perplexity {res.ppl:.4f}   bits/byte {res.bits_per_byte:.4f}   "
          f"({res.seconds:.1f} s)")
    if res.check_rel_diff is not None:
        print(f"first batch: cached {'=' if res.check_rel_diff < 1e-4 else '!='} full "
              f"forward perplexity {res.full_ppl:.4f} (relative difference "
              f"{res.check_rel_diff:.2e})")
    print(f"KV cache: {res.cache_bytes // res.batch_size:,} bytes per sequence in "
          f"{res.cache_slots} slots (theory {theory.kv_bytes_per_token(cfg):,} B/token x "
          f"{theory.tokens_held(cfg, ecfg.context)} tokens held = "
          f"{theory.kv_cache_bytes(cfg, ecfg.context):,})")
    if _JSON_OUT.value:
        out = dict(res.as_json(), model=cfg.name, context=ecfg.context,
                   corpus=corpus.source, kv_bytes_per_token=theory.kv_bytes_per_token(cfg))
        with open(_JSON_OUT.value, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    app.run(main)
