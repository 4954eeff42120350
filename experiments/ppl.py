r"""Perplexity and bits per byte of a model config on real text: the held-out split of a
corpus, or all of your own file or folder.

    python -m experiments.ppl --config=configs/gqa.py
    python -m experiments.ppl --config=configs/mqa.py --eval.context=512 --eval.num_tokens=16384
    python -m experiments.ppl --config=configs/gqa.py --config.model.window_size=128 \
        --config.model.num_sink_tokens=4 --json_out=/tmp/ppl.json
    python -m experiments.ppl --config=configs/gqa.py --eval.corpus=mytext.txt --eval.split=all \
        --eval.num_tokens=0            # every full 512-token window of your own file
    python -m experiments.ppl --list_fields       # every --config / --eval field explained

``--eval.split=heldout`` (default) scores the documents whose name hashes below
``--eval.heldout_fraction`` (a single file is cut at blank lines into ~4,000-character
documents first); ``--eval.split=all`` scores every document.

Scores the windows through the decode path (the config's KV cache, prefilled
``eval.chunk`` tokens at a time) and checks the first batch against the cache-free full
forward. Expected for configs/gqa.py (SmolLM2-135M, float32, Django docs, context 512,
16,352 scored tokens): perplexity 12.755, 0.926 bits per byte (README "Ablations").
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import cli

from kvjax import checkpoints, naming
from kvjax.analysis import theory
from kvjax.inference import memory, runner
from kvjax.training import data, evaluate
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Model config file (get_config())."), lock_config=True)
_EVAL = cli.DEFINE_config_dict("eval", evaluate.eval_config_dict(), cli.EVAL_HELP,
                               lock_config=True)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the result as JSON here.")
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        # Every check that needs no weights comes first (config, eval settings, output
        # path, corpus, split, windows); only then the ~15 s of loading the weights.
        run = run_config_from_dict(_CONFIG.value)
        ecfg = evaluate.eval_config_from_dict(_EVAL.value)
        if not run.ignore_memory_check:  # the eval cache: B windows of `context` slots
            memory.check(run.model, ecfg.batch_size, ecfg.context, what="perplexity",
                         weights_bytes=2 * theory.weight_bytes(run.model),
                         prompt_tokens=ecfg.chunk)
        cli.check_output_file(_JSON_OUT.value, "json_out")
        docs = evaluate.eval_documents(ecfg, run.cache_dir)
        tokenizer = checkpoints.load_tokenizer(
            run.weights_path or checkpoints.weights_path(run.cache_dir))
        evalset = evaluate.prepare_eval(ecfg, tokenizer, run.cache_dir, docs)
        loaded = runner.load(run)
    except (ConfigError, WeightsError, data.CorpusError, ValueError, cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg, corpus, windows = loaded.cfg, evalset.corpus, evalset.windows
    res = evaluate.perplexity(loaded.params, cfg, windows, ecfg, corpus.byte_lengths,
                              separator_id=corpus.separator_id)
    print(f"model: {naming.variant_name(cfg)}  (attention={cfg.attention}, "
          f"K={cfg.num_kv_heads}, window={cfg.window_size}, sinks={cfg.num_sink_tokens})")
    print(f"corpus: {corpus.source}, {evalset.split_name}: {len(corpus.heldout_docs)} "
          f"documents, {corpus.heldout.size:,} tokens; scored {res.num_predicted:,} tokens "
          f"({res.num_bytes:,} bytes) in {windows.shape[0]} windows of {ecfg.context}")
    print(f"perplexity {res.ppl:.4f}   bits/byte {res.bits_per_byte:.4f}   "
          f"({res.seconds:.1f} s)")
    if res.check_rel_diff is not None:
        print(f"first batch: cached {'=' if res.check_rel_diff < 1e-4 else '!='} full "
              f"forward perplexity {res.full_ppl:.4f} (relative difference "
              f"{res.check_rel_diff:.2e})")
    print(f"KV cache: {res.cache_bytes_per_sequence:,} bytes per sequence in "
          f"{res.cache_slots} slots (theory {theory.kv_bytes_per_token(cfg):,} B/token x "
          f"{theory.tokens_held(cfg, ecfg.context)} tokens held = "
          f"{theory.kv_cache_bytes(cfg, ecfg.context):,}); {res.cache_bytes:,} bytes per "
          f"batch of {res.batch_size}")
    if _JSON_OUT.value:
        out = dict(res.as_json(), model=cfg.name, variant=naming.variant_name(cfg),
                   context=ecfg.context, corpus=corpus.source, split=ecfg.split,
                   kv_bytes_per_token=theory.kv_bytes_per_token(cfg))
        cli.write_json(_JSON_OUT.value, out)
        print(f"wrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
