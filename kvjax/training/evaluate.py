"""Perplexity and bits per byte of any model config, measured through the decode path.

:func:`perplexity` runs each batch of evaluation windows the way decoding does: an empty
KV cache (dense, ring buffer or latent, whatever the config asks for) is filled chunk by
chunk with ``model.forward(params, cfg, chunk, positions, cache)``, and every chunk's
logits score its next tokens. The cache-free full forward (``cache=None``) computes the
same function in one pass; ``check_full`` scores the first batch that way too and reports
the relative difference of the two perplexities (below 1e-4 in float32).

Perplexity = exp(mean negative log-likelihood per scored token, nats). Bits per byte =
total NLL / ln 2 / UTF-8 bytes of the scored tokens (tokenizer-independent).

What is scored: every prediction whose target is text. The document separator
(``<|endoftext|>``, ``separator_id``) is not text: predicting it is not scored (neither its
nats nor a token nor bytes), and special tokens count 0 bytes
(:func:`kvjax.training.data.token_byte_lengths`). The token after a separator, the first
of the next document, is scored, with everything before it in the window as context.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax.models import model as model_lib
from kvjax.training import data
from kvjax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What to score and how (the ``--eval.*`` flags).

    Attributes:
      corpus: unset: the Django 4.2.16 docs (from PyPI); else a text file (cut at blank
        lines into ~4,000-character documents) or a folder (one document per file).
        A file is named FILE#k per piece; a folder's files (.txt/.rst/.md/.text or no
        suffix, UTF-8) by their relative paths.
      split: 'heldout': score documents whose name hash < heldout_fraction; 'all': score
        every document (your own text). With 'heldout' the rest is uptraining data; the
        hash is sha256(name) / 2**64, so the split does not depend on the other documents.
      heldout_fraction: share of the hash range held out when split='heldout'. For a
        fraction that empties a side, the error names one that works.
      context: T, tokens per evaluation window (each window predicts T - 1 tokens).
      num_tokens: tokens to score: the first num_tokens // T windows of T tokens (at
        least one); 0 scores every full window of the split.
      batch_size: B, windows per batch (rows of one cache).
      chunk: tokens per prefill chunk written to the cache (must divide context).
      check_full: also score the first batch with the cache-free forward.
    """

    context: int = 512
    num_tokens: int = 16384
    batch_size: int = 4
    chunk: int = 128
    check_full: bool = True
    corpus: str | None = None
    split: str = "heldout"
    heldout_fraction: float = 0.1

    def __post_init__(self):
        for f in ("context", "num_tokens", "batch_size", "chunk"):
            v = getattr(self, f)
            least = 0 if f == "num_tokens" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"invalid config: eval.{f}={v!r}; allowed: a positive "
                                 "integer" + (" or 0 (every full window)"
                                              if f == "num_tokens" else ""))
        if self.context < 2:
            raise ValueError(f"invalid config: eval.context={self.context}; allowed: >= 2")
        if self.context % self.chunk:
            raise ValueError(f"invalid config: eval.chunk={self.chunk}; allowed: a divisor "
                             f"of eval.context={self.context}")
        if self.split not in ("heldout", "all"):
            raise ValueError(f"invalid config: eval.split={self.split!r}; allowed: "
                             "'heldout' or 'all'")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"invalid config: eval.heldout_fraction={self.heldout_fraction};"
                             " allowed: a number in (0, 1)")
        if self.corpus is not None and self.corpus != "django-docs":
            p = pathlib.Path(self.corpus).expanduser()
            if not p.exists():
                raise ValueError(
                    f"invalid config: eval.corpus={self.corpus!r}: no such file or folder "
                    f"(from {pathlib.Path.cwd()}); allowed: a text file, a folder of text "
                    "files, or unset for the default corpus (Django docs)")


@dataclasses.dataclass
class PerplexityResult:
    """Scores of one model on a set of windows.

    nll_nats: total negative log-likelihood (nats). num_predicted: tokens scored (text
    targets; separators excluded). num_bytes: their UTF-8 bytes (0 if unknown). ppl,
    bits_per_byte: the headline numbers. num_separators: separator targets left unscored.
    full_ppl, check_rel_diff: the first batch's perplexity by the full forward and
    |cached - full| / full on that batch (None unless checked). cache_bytes: bytes of the
    cache tensors of one batch of ``batch_size`` rows (``cache.cache_bytes``; per row:
    :attr:`cache_bytes_per_sequence`), cache_slots: S, its slots per row.
    seconds: wall time of the cached pass (compile included).
    """

    nll_nats: float
    num_predicted: int
    num_bytes: int
    ppl: float
    bits_per_byte: float
    full_ppl: float | None
    check_rel_diff: float | None
    cache_bytes: int
    cache_slots: int
    batch_size: int
    seconds: float
    num_separators: int = 0

    @property
    def cache_bytes_per_sequence(self) -> int:
        """Bytes of one row's cache: ``cache_bytes`` / ``batch_size``."""
        return self.cache_bytes // self.batch_size

    def as_json(self) -> dict:
        """The fields, with the cache's bytes named per batch and per sequence."""
        out = dataclasses.asdict(self)
        out["kv_cache_bytes_per_batch"] = out.pop("cache_bytes")
        out["kv_cache_bytes_per_sequence"] = self.cache_bytes_per_sequence
        out["kv_cache_slots"] = out.pop("cache_slots")
        return out


def _token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """[B, T] float32 -log p(target) from logits [B, T, V]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _chunk_nll(params, tokens, targets, cache, *, cfg):
    b, t = tokens.shape
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, cache = model_lib.forward(params, cfg, tokens, positions, cache)
    return _token_nll(logits, targets), cache


@functools.partial(jax.jit, static_argnames=("cfg",))
def _full_nll(params, tokens, *, cfg):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits, _ = model_lib.forward(params, cfg, tokens[:, :-1], positions[:, :-1])
    return _token_nll(logits, tokens[:, 1:])


def nll_cached(params, cfg: ModelConfig, windows: np.ndarray, chunk: int):
    """Per-token NLL through the KV cache, prefilled chunk by chunk.

    Args:
      params: parameters in cfg's layout.
      windows: [B, T] int32 token windows; T divisible by ``chunk``.
      chunk: tokens per ``model.forward`` call.
    Returns:
      (nll [B, T - 1] float32 numpy: -log p(windows[:, i + 1] | windows[:, :i + 1]),
       the final cache).
    """
    b, t = windows.shape
    cache = cache_lib.init_cache(cfg, b, t)
    # The last token has no target: its logits are scored against a dummy and dropped.
    targets = np.concatenate([windows[:, 1:], np.zeros((b, 1), windows.dtype)], axis=1)
    outs = []
    for s in range(0, t, chunk):
        nll, cache = _chunk_nll(params, jnp.asarray(windows[:, s:s + chunk]),
                                jnp.asarray(targets[:, s:s + chunk]), cache, cfg=cfg)
        outs.append(np.asarray(nll))
    return np.concatenate(outs, axis=1)[:, :-1], cache


def nll_full(params, cfg: ModelConfig, windows: np.ndarray) -> np.ndarray:
    """[B, T - 1] float32 per-token NLL from one cache-free causal forward."""
    return np.asarray(_full_nll(params, jnp.asarray(windows), cfg=cfg))


def perplexity(params, cfg: ModelConfig, windows: np.ndarray, ecfg: EvalConfig,
               byte_lengths: np.ndarray | None = None, progress=None,
               separator_id: int | None = None) -> PerplexityResult:
    """Perplexity and bits per byte of ``windows`` [M, T] through the decode path.

    Windows are evaluated B = ecfg.batch_size at a time (a last, smaller batch is run
    at its own size). ``progress``, if given, is called with the number of windows done.
    ``byte_lengths`` [V]: UTF-8 bytes per token id (``data.token_byte_lengths``).
    ``separator_id``: the document separator; predictions of it are not scored (see the
    module docstring). None scores every target.

    Raises:
      ValueError: T is not divisible by ecfg.chunk; a config with ``kv_compression``
        (lever 5 compresses a prompt once after its prefill; chunked windows have no
        prompt: ``experiments.longeval`` scores it, with the answer's NLL).
    """
    if cfg.kv_compression is not None:
        raise ValueError(
            f"perplexity with model.kv_compression={cfg.kv_compression!r}; allowed: None "
            "(a compressed cache is scored by experiments.longeval: accuracy and the "
            "answer's NLL after the prompt is compressed, and with --ppl --ppl_tokens=M "
            "the perplexity of a text's last M tokens on the compressed cache of the rest)")
    m, t = windows.shape
    if t % ecfg.chunk:
        raise ValueError(f"windows of {t} tokens; allowed: a multiple of chunk={ecfg.chunk}")
    start = time.perf_counter()
    total, count, nbytes, seps = 0.0, 0, 0, 0
    full_ppl = rel = None
    cache_bytes = slots = 0
    for i in range(0, m, ecfg.batch_size):
        w = windows[i:i + ecfg.batch_size]
        nll, cache = nll_cached(params, cfg, w, ecfg.chunk)
        targets = w[:, 1:]
        scored = (np.ones(targets.shape, bool) if separator_id is None
                  else targets != separator_id)
        total += float(nll.astype(np.float64)[scored].sum())
        count += int(scored.sum())
        seps += int((~scored).sum())
        if byte_lengths is not None:
            nbytes += int(byte_lengths[targets[scored]].sum())
        if i == 0:
            cache_bytes, slots = cache_lib.cache_bytes(cache), cache.num_slots
            if ecfg.check_full:
                full = nll_full(params, cfg, w)
                cached_ppl = math.exp(float(nll.astype(np.float64).mean()))
                full_ppl = math.exp(float(full.astype(np.float64).mean()))
                rel = abs(cached_ppl - full_ppl) / full_ppl
        del cache
        if progress is not None:
            progress(min(i + ecfg.batch_size, m))
    seconds = time.perf_counter() - start
    if count == 0:
        raise ValueError("no token was scored: every target is the separator")
    mean = total / count
    return PerplexityResult(
        nll_nats=total, num_predicted=count, num_bytes=nbytes, ppl=math.exp(mean),
        bits_per_byte=(total / math.log(2) / nbytes) if nbytes else float("nan"),
        full_ppl=full_ppl, check_rel_diff=rel, cache_bytes=cache_bytes, cache_slots=slots,
        batch_size=min(ecfg.batch_size, m), seconds=seconds, num_separators=seps)


@dataclasses.dataclass
class EvalSet:
    """The scored side of a corpus, tokenized, and its windows [M, T] int32."""

    corpus: "data.TokenizedCorpus"
    windows: np.ndarray

    @property
    def split_name(self) -> str:
        return "every document" if not self.corpus.train_docs else "the held-out split"


def eval_documents(ecfg: EvalConfig, cache_dir: str | None = None) -> list:
    """The corpus's documents, with the split checked (no tokenizer needed).

    Raises:
      data.CorpusError: the corpus cannot be fetched or read.
      ValueError: a split that leaves a side empty (the message names a fraction that
        works, or ``--eval.split=all``).
    """
    docs = data.load_documents(ecfg.corpus, cache_dir)
    data.select_documents(docs, ecfg.split, ecfg.heldout_fraction)
    return docs


def prepare_eval(ecfg: EvalConfig, tokenizer, cache_dir: str | None = None,
                 docs: list | None = None) -> EvalSet:
    """Loads (unless ``docs`` from :func:`eval_documents` are given) and splits
    ``ecfg.corpus``, tokenizes the scored side and cuts its windows: everything but the
    weights, so an entry point fails here before loading them.

    Raises:
      data.CorpusError: the corpus cannot be fetched or read.
      ValueError: an empty split, or too few tokens for the windows (the message gives
        values that work).
    """
    if docs is None:
        docs = eval_documents(ecfg, cache_dir)
    corpus = data.tokenized_corpus(tokenizer, ecfg.corpus, ecfg.heldout_fraction, cache_dir,
                                   train=False, split=ecfg.split, docs=docs)
    what = ("the corpus" if ecfg.split == "all" else "the held-out split") + (
        f" of {ecfg.corpus}" if ecfg.corpus else "")
    return EvalSet(corpus, data.eval_windows(corpus.heldout, ecfg.context, ecfg.num_tokens,
                                             what=what))


def eval_config_dict():
    """``--eval.*`` flags: the EvalConfig fields (corpus a str placeholder)."""
    from ml_collections import config_dict  # noqa: PLC0415

    c = config_dict.ConfigDict(dataclasses.asdict(EvalConfig()))
    c.corpus = config_dict.placeholder(str)
    return c


def eval_config_from_dict(d) -> EvalConfig:
    """EvalConfig from an ``--eval`` ConfigDict.

    Raises:
      ValueError: an unknown field or an invalid value (the message names it).
    """
    d = d.to_dict() if hasattr(d, "to_dict") else dict(d)
    fields = {f.name for f in dataclasses.fields(EvalConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"invalid config: eval.{unknown[0]}; allowed: fields among "
                         f"{sorted(fields)}")
    return EvalConfig(**d)
