r"""Attention sinks at absolute vs cache positions on a long stream (SmolLM2, real text).

    python scripts/sink_positions.py --window=64 --sinks=4 --offsets=2000,4000,8000

The same 256 tokens of the Django docs (the held-out split) are scored after a contiguous
filler of n tokens: the corpus's first s tokens (the sinks) and then the n - s tokens
that precede position ``--filler_end`` (so the tail just before the text is the same at
every offset), with a ring of W slots and s sinks. A token's hidden state depends on at
most L·(W - s) tokens back through the ring (1,800 for SmolLM2 with W = 64, s = 4), so
for n - s above that the text sees the same tokens at every offset; only the query-to-
sink distance differs: with absolute positions it grows with n (past SmolLM2's 8,192
training positions for large n); with cache positions (StreamingLLM, Xiao et al. 2023,
sec. 3.2) it stays below W, and the NLL is the same at every offset. Prints the mean NLL (nats/token) of the
text's last 256 - W tokens per mode and offset, and a no-sink window for reference.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.inference import runner
from kvjax.config import RunConfig
from kvjax.models import model
from kvjax.training import data


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _chunk(params, tokens, cache, *, cfg):
    pos = cache.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = model.forward(params, cfg, tokens, pos, cache)
    return jax.nn.log_softmax(logits, axis=-1), cache


def stream_nll(params, cfg, stream: np.ndarray, score_from: int, chunk: int = 256) -> float:
    """Mean NLL of stream[score_from + 1:] given everything before, through a ring cache."""
    cache = cache_lib.init_cache(cfg, 1, cfg.window_size)
    nll, count = 0.0, 0
    for start in range(0, len(stream) - 1, chunk):
        end = min(start + chunk, len(stream) - 1)
        logp, cache = _chunk(params, jnp.asarray(stream[None, start:end]), cache, cfg=cfg)
        targets = stream[start + 1:end + 1]
        lp = np.asarray(logp[0, np.arange(end - start), targets])
        keep = np.arange(start + 1, end + 1) > score_from
        nll -= float(lp[keep].sum())
        count += int(keep.sum())
    return nll / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--offsets", default="2000,4000,8000")
    ap.add_argument("--filler_end", type=int, default=8000)
    ap.add_argument("--text_tokens", type=int, default=256)
    args = ap.parse_args()
    base = presets.smollm2_135m("float32", scan_layers=False)
    loaded = runner.load(RunConfig(model=base, chat_template=False), progress=False)
    corpus = data.tokenized_corpus(loaded.tokenizer, train=False)
    tokens = np.asarray(corpus.heldout, np.int32)  # held-out documents, joined
    offsets = [int(o) for o in args.offsets.split(",")]
    n_text, w, s = args.text_tokens, args.window, args.sinks
    text = tokens[-n_text:]
    rows = []
    for mode, sinks in (("absolute", s), ("cache", s), ("absolute", 0)):
        cfg = presets.variant(base, window_size=w, num_sink_tokens=sinks).replace(
            rope_positions=mode if sinks else "absolute")
        params = model.params_for(cfg, loaded.params)
        for n in offsets:
            end = args.filler_end
            stream = np.concatenate([tokens[:s], tokens[end - (n - s):end], text])
            start = time.perf_counter()
            # score the text once the ring holds only text (its last n_text - W tokens)
            nll = stream_nll(params, cfg, stream, score_from=n + w)
            rows.append((mode if sinks else "no sinks", n, nll, time.perf_counter() - start))
            print(f"{rows[-1][0]:>9}  offset {n:>6,}  NLL {nll:.4f}  ({rows[-1][3]:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
