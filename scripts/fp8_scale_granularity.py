"""fp8 KV-cache scales: one per token per KV head (kvjax's) vs one per tensor, by
perplexity on the ablation's held-out split.

    PYTHONPATH=. python scripts/fp8_scale_granularity.py --num_tokens 4096

SmolLM2-135M (configs/gqa.py, float32 weights), the Django held-out split cut exactly as
``experiments.ablate`` cuts it (``data.tokenized_corpus`` + ``data.eval_windows``, context
512), scored through the decode path with ``kv_dtype`` = ``--fp8`` in two ways:

* ``per-token``: kvjax's format (:mod:`kvjax.cache.quant`): scale = max|row| / 448 per
  token per KV head, 4 B of float32 scale per 64-value row.
* ``per-tensor``: one fixed scale for the whole cache, 1.0 (vLLM's fp8 KV cache without
  calibration: ``k_scale = v_scale = 1.0``); a streaming cache cannot recompute a
  tensor-wide absmax after earlier tokens were written. Stored like the per-token format
  (the scale tensors then hold 1.0 and would not need to be stored: 11,520 instead of
  12,240 KV bytes per token).

Also prints the float32-cache perplexity of the same windows (the reference).
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

from configs import gqa
from kvjax.cache import quant
from kvjax.config import run_config_from_dict
from kvjax.inference import runner
from kvjax.training import data, evaluate


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num_tokens", type=int, default=4096)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--fp8", default="float8_e4m3fn", choices=["float8_e4m3fn", "float8_e5m2"])
    args = ap.parse_args()
    run = run_config_from_dict(gqa.get_config())
    edict = evaluate.eval_config_dict()
    edict.context, edict.num_tokens = args.context, args.num_tokens
    ecfg = evaluate.eval_config_from_dict(edict)
    loaded = runner.load(run, progress=False)
    corpus = data.tokenized_corpus(loaded.tokenizer, edict.corpus, edict.heldout_fraction,
                                   run.cache_dir, train=False)
    windows = data.eval_windows(corpus.heldout, ecfg.context, ecfg.num_tokens)

    real_quantize = quant.quantize

    def unit_scale_quantize(x, fmt, axis=-1):
        """fp8 with one fixed scale of 1.0 (per tensor); other formats unchanged."""
        if fmt.kind != "float":
            return real_quantize(x, fmt, axis)
        _, scale = real_quantize(x, fmt, axis)
        y = jnp.clip(x.astype(jnp.float32), -fmt.qmax, fmt.qmax).astype(fmt.storage)
        return y, jnp.ones_like(scale)

    results = {}
    for label, kd, patch in (("float32 cache", "float32", False),
                             ("per-token", args.fp8, False), ("per-tensor (1.0)", args.fp8, True)):
        cfg = loaded.cfg.replace(kv_dtype=kd, name=f"gqa-{kd}-{label}")
        quant.quantize = unit_scale_quantize if patch else real_quantize
        try:
            res = evaluate.perplexity(loaded.params, cfg, windows, ecfg, corpus.byte_lengths,
                                      separator_id=corpus.separator_id)
        finally:
            quant.quantize = real_quantize
        results[label] = res
        print(f"{label}: ppl {res.ppl:.4f}  bits/byte {res.bits_per_byte:.4f}  "
              f"({res.num_predicted:,} tokens, {res.seconds:.0f} s)", flush=True)
    ref = results["float32 cache"].ppl
    print(f"\n| {args.fp8} scales | KV B/token | ppl | ppl / float32 cache |")
    print("|---|---:|---:|---:|")
    for label, b in (("float32 cache", 46080), ("per-token", 12240),
                     ("per-tensor (1.0)", 11520)):
        print(f"| {label} | {b:,} | {results[label].ppl:.4f} | {results[label].ppl / ref:.4f} |")


if __name__ == "__main__":
    main()
