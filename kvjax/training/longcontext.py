"""Long-context tasks generated offline, their scoring, and one protocol that scores any
KV-cache lever on them.

**Tasks** (:data:`TASKS`). Each generator is seeded (a ``numpy.random.Generator``), needs
no download and writes its prompt as token ids of the checkpoint's own tokenizer,
concatenated piece by piece (never re-tokenized as a whole), so lengths are exact:

* ``passkey``: a 5-digit pass key in a repeated filler (Mohtashami and Jaggi 2023,
  "Landmark Attention", sec. 4.2's format).
* ``niah_single`` / ``niah_multikey`` / ``niah_multivalue`` / ``niah_multiquery``:
  RULER's needle-in-a-haystack tasks over the repeated "noise" haystack (Hsieh et al.
  2024, "RULER", sec. 3.1 and Table 2: S-NIAH; MK-NIAH, a queried needle among 3
  distractor needles; MV-NIAH, 4 values under one key; MQ-NIAH, 4 keys asked at once).
  Keys are adjective-noun words, values 7-digit numbers.
* ``vt``: RULER's variable tracking (sec. 3.2: one chain of 4 hops, ``VAR X = VAR Y``).
* ``cwe`` / ``fwe``: RULER's aggregation tasks (sec. 3.3): the 10 most common words of a
  numbered word list (common words repeated ``freq_cw`` times, the others ``freq_ucw``
  times; RULER uses 30 / 3, here scaled to the length, :func:`cwe_frequencies`), and the
  3 most frequent "coded" words of a text drawn from a Zipf distribution (alpha 2).
* ``kv_retrieval``: a JSON object of uuid pairs, the value of one key asked (Liu et al.
  2023, "Lost in the Middle", sec. 3).
* ``copy``: a span of 12 random words placed in the filler; the question gives its first
  3 words and asks for the rest.

Words come from the ``wonderwords`` package (the noun / adjective lists RULER's word
tasks use), never from a hub.

**Length and depth.** A sample of length L fits in L positions as RULER counts its
``max_seq_length`` (question and generated tokens included), so L = 8,192 stays inside
SmolLM2's trained context: its context is exactly ``L - RESERVE`` tokens (RESERVE =
:data:`QUESTION_ROOM` + :data:`ANSWER_ROOM` = 192) whatever the task, so one prefill
program per length serves every task (docs/decisions/0030-longeval-one-prefill-per-length.md);
the question (at most 128 tokens) and the answer (at most 64) follow it. Depth d in [0, 1]
places the answer-bearing needle after ``round(d * F)`` of the F filler tokens (its
first token's index is :attr:`Sample.needle_positions`); other needles go to depths
drawn at random. Filler pieces end at a sentence boundary, so every needle and the
question follow a whole sentence. ``cwe`` and ``fwe`` have no needle (depth unused);
``kv_retrieval`` puts the asked pair at the pair index nearest d.

**Scores** (RULER's ``scripts/eval/synthetic/constants.py``): every task here is scored
by :func:`string_match_all` (the share of references found, case-insensitive, in the
greedy answer); :func:`string_match_part` (any reference found) is RULER's metric for
its QA tasks. Beside it, :func:`answer_nll`: the mean negative log-likelihood (nats per
token) of the reference answer given the prompt, a graded signal where greedy answers
fail. :func:`wilson_interval` and :func:`mean_interval` give their confidence intervals.

**Protocol** (:func:`evaluate_sample`): prefill the context once into the config's cache
(``kvjax.inference.decode.prefill_program``), apply the lever (the config itself, a
window, a kv_dtype, converted weights; and an optional ``compress`` of the filled
cache for levers that act after the prefill), then ask each question on that same cache:
the question tokens in one padded chunk, greedy decoding by
``kvjax.inference.decode.generate``, and the answer's NLL by the same chunk with the
answer appended (teacher forcing). ``query_first`` also places the question before the
context (query-aware levers see it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import math
import time
import uuid
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.cache import compress as compress_lib
from kvjax.cache import paged as paged_lib
from kvjax.analysis import theory
from kvjax.config import ModelConfig
from kvjax.inference import decode
from kvjax.models import model as model_lib


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One task: its scoring (``'all'``: :func:`string_match_all`, ``'part'``:
    :func:`string_match_part`), its generation budget in tokens (RULER's
    ``tokens_to_generate``, shortened for a CPU), whether depth places its needle, and a
    one-line description."""

    name: str
    metric: str
    max_new_tokens: int
    uses_depth: bool
    description: str


TASKS = {t.name: t for t in (
    TaskSpec("passkey", "all", 8, True, "5-digit pass key in a repeated filler "
             "(Mohtashami and Jaggi 2023)"),
    TaskSpec("niah_single", "all", 16, True, "RULER S-NIAH: one word key, a 7-digit value"),
    TaskSpec("niah_multikey", "all", 16, True, "RULER MK-NIAH: the queried needle among 3 "
             "distractor needles"),
    TaskSpec("niah_multivalue", "all", 48, True, "RULER MV-NIAH: 4 values under one key, "
             "all asked"),
    TaskSpec("niah_multiquery", "all", 48, True, "RULER MQ-NIAH: 4 keys asked at once"),
    TaskSpec("vt", "all", 32, True, "RULER variable tracking: one chain of 4 hops"),
    TaskSpec("cwe", "all", 64, False, "RULER common-word extraction: the 10 most common "
             "words of a list"),
    TaskSpec("fwe", "all", 32, False, "RULER frequent-word extraction: the 3 most frequent "
             "coded words (Zipf, alpha 2)"),
    TaskSpec("kv_retrieval", "all", 48, True, "a JSON object of uuid pairs, one value asked "
             "(Liu et al. 2023)"),
    TaskSpec("copy", "all", 32, True, "a span of 12 random words, continued from its first 3"),
)}
"""The ``--tasks`` names, in this order."""

# Mohtashami and Jaggi's filler, which RULER's "noise" haystack repeats too.
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
         "back again.")
PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find "
                 "it and memorize it. I will quiz you about the important information there.")
COPY_INTRO = ("Remember the list of words hidden in the following text. I will ask you to "
              "repeat it.")
NEEDLES = 4
"""Needles of the multi-needle tasks (RULER's MK / MV / MQ defaults: 4)."""
VT_HOPS = 4
CWE_WORDS = 10
FWE_WORDS = 3
COPY_WORDS, COPY_GIVEN = 12, 3
QUESTION_ROOM = 128
"""Tokens kept after the context for the question and answer prefix."""
ANSWER_ROOM = 64
"""Tokens kept for the answer (every task's ``max_new_tokens`` fits)."""
RESERVE = QUESTION_ROOM + ANSWER_ROOM
"""A sample of length L has a context of exactly ``L - RESERVE`` tokens, whatever the
task: one prefill program per length serves every task and sample."""


class TaskError(ValueError):
    """A task, length or depth that cannot be generated (the message names it)."""


@dataclasses.dataclass
class Question:
    """One question on a context.

    Attributes:
      ids: the question and answer prefix as token ids (asked after the context).
      text: their text.
      references: the strings the greedy answer is scored against.
      answer: the reference answer whose NLL is scored (its first character a space).
      answer_ids: its token ids.
      plain: the question alone (no answer prefix), what query-first mode puts first.
    """

    ids: list
    text: str
    references: tuple
    answer: str
    answer_ids: list
    plain: str = ""


@dataclasses.dataclass
class Sample:
    """One generated prompt.

    Attributes:
      task, length, depth, index, seed: what it was generated from (``index``: the
        sample's number within its task x length x depth cell).
      context_ids: the tokens prefilled before the questions (BOS if the tokenizer adds
        one, the task's intro, the haystack; with ``query_first`` the question first).
      questions: the questions asked on it (every task here asks one).
      needle_positions: token index in ``context_ids`` of the first token of each
        answer-bearing needle, in document order ([] where the task has none).
      max_new_tokens: tokens generated per question.
    """

    task: str
    length: int
    depth: float
    index: int
    seed: int
    context_ids: list
    questions: list
    needle_positions: list
    max_new_tokens: int

    @property
    def prompt_len(self) -> int:
        """Context plus the longest question (at most ``length - ANSWER_ROOM``)."""
        return len(self.context_ids) + max(len(q.ids) for q in self.questions)


# ------------------------------------------------------------------------- word lists

@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple:
    """The ``wonderwords`` package's word list ``kind`` ('noun', 'adjective' or 'verb'),
    lowercase single words only (no hyphen, space or capital), profanities removed,
    sorted (so a seed gives the same words on any machine with the same version).

    Raises:
      ValueError: an unknown kind.
    """
    files = {"noun": "nounlist.txt", "adjective": "adjectivelist.txt", "verb": "verblist.txt"}
    if kind not in files:
        raise ValueError(f"word list {kind!r}; allowed: {sorted(files)}")
    assets = importlib.resources.files("wonderwords") / "assets"
    bad = set((assets / "profanitylist.txt").read_text().split("\n"))
    words = {w.strip() for w in (assets / files[kind]).read_text().split("\n")}
    return tuple(sorted(w for w in words if w.isalpha() and w.islower() and w not in bad))


def _distinct(rng: np.random.Generator, pool: Sequence[str], n: int) -> list:
    return [pool[i] for i in rng.choice(len(pool), size=n, replace=False)]


def _keys(rng: np.random.Generator, n: int) -> list:
    """n distinct adjective-noun keys (RULER's word keys)."""
    adj, noun = word_list("adjective"), word_list("noun")
    out = []
    while len(out) < n:
        k = f"{adj[rng.integers(len(adj))]}-{noun[rng.integers(len(noun))]}"
        if k not in out:
            out.append(k)
    return out


def _numbers(rng: np.random.Generator, n: int, digits: int) -> list:
    out = []
    while len(out) < n:
        v = str(int(rng.integers(10 ** (digits - 1), 10 ** digits)))
        if v not in out:
            out.append(v)
    return out


def _uuid(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


# ------------------------------------------------------------------------------ layout

class _Builder:
    """Token-level layout of one prompt: pieces tokenized one by one and concatenated."""

    def __init__(self, tok, length: int, budget: int, query_first: bool):
        self.tok, self.length, self.query_first = tok, length, query_first
        self.budget = RESERVE  # the question's room and the answer's
        self.bos = [tok.bos_token_id] if getattr(tok, "add_bos_token", False) else []

    def enc(self, text: str) -> list:
        return list(self.tok.encode(text))

    def question(self, text: str, answer_prefix: str, references, answer: str) -> Question:
        q = f"\n{text} {answer_prefix}"
        return Question(self.enc(q), q, tuple(references), answer, self.enc(answer), text)

    def preface(self, q: Question) -> list:
        """The question before the context (query-first mode), else nothing."""
        return self.enc(q.plain + "\n") if self.query_first else []

    def room(self, fixed: int, task: str, least: int = 1) -> int:
        """Tokens left for the haystack once ``fixed`` context tokens are placed."""
        n = self.length - self.budget - fixed
        if n < least:
            raise TaskError(
                f"length={self.length} is too short for task {task!r}: its prompt needs "
                f"{fixed + least} context tokens besides the {RESERVE} kept for the question "
                f"and answer; allowed: "
                f"length >= {fixed + least + self.budget}")
        return n


@functools.lru_cache(maxsize=8)
def _noise_unit(tok) -> tuple:
    return tuple(tok.encode(" " + NOISE))


def _filler(tok, n: int) -> list:
    """The last ``n`` tokens of the repeated noise: a piece ending at a sentence end."""
    unit = list(_noise_unit(tok))
    reps = n // len(unit) + 1
    return (unit * reps)[len(unit) * reps - n:] if n else []


def _haystack(tok, n_fill: int, needles: list) -> tuple:
    """(tokens, start index of each needle) of ``n_fill`` filler tokens with the needles
    [(depth, ids)] inserted after ``round(depth * n_fill)`` filler tokens each (document
    order; a tie keeps the given order)."""
    order = sorted(range(len(needles)), key=lambda i: (round(needles[i][0] * n_fill), i))
    out, starts, used = [], [0] * len(needles), 0
    for i in order:
        off = round(needles[i][0] * n_fill)
        out += _filler(tok, off - used)
        used = off
        starts[i] = len(out)
        out += needles[i][1]
    out += _filler(tok, n_fill - used)
    return out, starts


def _needle_task(b: _Builder, task: str, intro: str, needles: list, answer_at: list,
                 q: Question) -> tuple:
    """(context ids, needle positions of ``answer_at``) for needles [(depth, text)]."""
    pre = b.bos + b.preface(q) + b.enc(intro)
    ids = [(d, b.enc(" " + t)) for d, t in needles]
    fixed = len(pre) + sum(len(x) for _, x in ids)
    hay, starts = _haystack(b.tok, b.room(fixed, task), ids)
    return pre + hay, sorted(len(pre) + starts[i] for i in answer_at)


def _other_depths(rng: np.random.Generator, n: int) -> list:
    return [float(x) for x in rng.uniform(0.0, 1.0, n)]


# ------------------------------------------------------------------------- generators

def _passkey(b, rng, depth):
    key = str(int(rng.integers(10000, 100000)))
    q = b.question("What is the pass key?", "The pass key is", [key], " " + key)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    ctx, pos = _needle_task(b, "passkey", PASSKEY_INTRO, [(depth, needle)], [0], q)
    return ctx, [q], pos


NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure "
               "to memorize it. I will quiz you about the numbers afterwards.")


def _niah_needle(key, value):
    return f"One of the special magic numbers for {key} is: {value}."


def _niah_question(b, keys, values):
    if len(keys) == 1 and len(values) == 1:
        k = keys[0]
        return b.question(
            f"What is the special magic number for {k} mentioned in the provided text?",
            f"The special magic number for {k} mentioned in the provided text is",
            values, " " + values[0])
    ks = ", ".join(keys[:-1]) + f" and {keys[-1]}" if len(keys) > 1 else keys[0]
    return b.question(
        f"What are all the special magic numbers for {ks} mentioned in the provided text?",
        f"The special magic numbers for {ks} mentioned in the provided text are",
        values, " " + ", ".join(values))


def _niah_single(b, rng, depth):
    key, value = _keys(rng, 1)[0], _numbers(rng, 1, 7)[0]
    q = _niah_question(b, [key], [value])
    ctx, pos = _needle_task(b, "niah_single", NIAH_INTRO, [(depth, _niah_needle(key, value))],
                            [0], q)
    return ctx, [q], pos


def _niah_multikey(b, rng, depth):
    keys, values = _keys(rng, NEEDLES), _numbers(rng, NEEDLES, 7)
    q = _niah_question(b, keys[:1], values[:1])
    needles = [(d, _niah_needle(k, v)) for d, k, v in
               zip([depth] + _other_depths(rng, NEEDLES - 1), keys, values)]
    ctx, pos = _needle_task(b, "niah_multikey", NIAH_INTRO, needles, [0], q)
    return ctx, [q], pos


def _niah_multivalue(b, rng, depth):
    key, values = _keys(rng, 1)[0], _numbers(rng, NEEDLES, 7)
    q = b.question(
        f"What are all the special magic numbers for {key} mentioned in the provided text?",
        f"The special magic numbers for {key} mentioned in the provided text are",
        values, " " + ", ".join(values))
    needles = [(d, _niah_needle(key, v)) for d, v in
               zip([depth] + _other_depths(rng, NEEDLES - 1), values)]
    ctx, pos = _needle_task(b, "niah_multivalue", NIAH_INTRO, needles,
                            list(range(NEEDLES)), q)
    return ctx, [q], pos


def _niah_multiquery(b, rng, depth):
    keys, values = _keys(rng, NEEDLES), _numbers(rng, NEEDLES, 7)
    q = _niah_question(b, keys, values)
    needles = [(d, _niah_needle(k, v)) for d, k, v in
               zip([depth] + _other_depths(rng, NEEDLES - 1), keys, values)]
    ctx, pos = _needle_task(b, "niah_multiquery", NIAH_INTRO, needles,
                            list(range(NEEDLES)), q)
    return ctx, [q], pos


def _vt(b, rng, depth):
    names = []
    while len(names) < VT_HOPS + 1:
        v = "".join(chr(ord("A") + int(i)) for i in rng.integers(0, 26, 5))
        if v not in names:
            names.append(v)
    value = _numbers(rng, 1, 5)[0]
    stmts = [f"VAR {names[0]} = {value}."] + [
        f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, VT_HOPS + 1)]
    # the chain in order from `depth` to the end, evenly spaced
    depths = [depth + (1.0 - depth) * i / (VT_HOPS + 1) for i in range(VT_HOPS + 1)]
    q = b.question(f"Find all variables that are assigned the value {value} in the text "
                   "above.", "Answer: According to the chain of variable assignments in the "
                   f"text above, {VT_HOPS + 1} variables are assigned the value {value}, "
                   "they are:", names, " " + " ".join(names))
    intro = "Memorize and track the chain of variable assignments hidden in the following text."
    ctx, pos = _needle_task(b, "vt", intro, list(zip(depths, stmts)), [0], q)
    return ctx, [q], pos


def cwe_frequencies(words_room: int) -> tuple:
    """(freq_cw, freq_ucw) for a list of about ``words_room`` entries: RULER's 30 / 3
    where 10 common words x 30 leave room for as many uncommon entries, scaled down in
    proportion below that (at least 2 / 1)."""
    freq_cw = int(min(30, max(2, words_room // (2 * CWE_WORDS))))
    return freq_cw, max(1, freq_cw // 10)


def _fit_lines(b, task, pre, words_of_line, make_lines, q):
    """Drops entries (``make_lines(n)`` -> the first n entries' line texts) until the
    prompt fits, then pads with newline tokens to the exact length."""
    room = b.room(len(pre), task)
    n = len(words_of_line)
    while True:
        ids = [t for line in make_lines(n) for t in b.enc(line)]
        if len(ids) <= room:
            break
        n -= max(1, (len(ids) - room) // 8)
    pad = b.enc("\n")[-1:] * (room - len(ids))
    return pre + ids + pad, n


def _cwe(b, rng, depth):
    intro = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.")
    nouns = word_list("noun")
    room = b.length - b.budget
    per_line = 4  # "\n12. word": about 4 tokens
    freq_cw, freq_ucw = cwe_frequencies(room // per_line)
    n_unc = max(0, (room // per_line - CWE_WORDS * freq_cw) // freq_ucw) + 8
    words = _distinct(rng, nouns, CWE_WORDS + n_unc)
    common, uncommon = words[:CWE_WORDS], words[CWE_WORDS:]
    q = b.question(f"Question: What are the {CWE_WORDS} most common words in the above list?",
                   f"Answer: The top {CWE_WORDS} words that appear most often in the list "
                   "are:", common, "")
    pre = b.bos + b.preface(q) + b.enc(intro)
    common_lines = [w for w in common for _ in range(freq_cw)]
    order_seed = int(rng.integers(2 ** 31))

    def entries(n_uncommon_words):  # the list with the first n uncommon words, shuffled
        items = common_lines + [w for w in uncommon[:n_uncommon_words] for _ in range(freq_ucw)]
        order = np.random.default_rng(order_seed).permutation(len(items))
        return [items[i] for i in order]

    lines = lambda n: [f"\n{i + 1}. {w}" for i, w in enumerate(entries(n))]
    ctx, n = _fit_lines(b, "cwe", pre, uncommon, lines, q)
    first = {}
    for w in entries(n):
        first.setdefault(w, len(first))
    common_sorted = sorted(common, key=first.get)  # the answer in order of appearance
    q.answer = " " + ", ".join(common_sorted)
    q.answer_ids = b.enc(q.answer)
    return ctx, [q], []


def _coded_words(rng, n):
    out = []
    while len(out) < n:
        w = "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, 4))
        if w not in out:
            out.append(w)
    return out


def _fwe(b, rng, depth):
    intro = ("Read the following coded text and track the frequency of each coded word. "
             f"Find the {FWE_WORDS} most frequently appeared coded words.")
    vocab = _coded_words(rng, 200)
    ranks = np.arange(1, len(vocab) + 1, dtype=np.float64)
    p = ranks ** -2.0
    p /= p.sum()
    room = b.length - b.budget
    draws = [vocab[i] for i in rng.choice(len(vocab), size=room, p=p)]
    q = b.question(f"Question: What are the {FWE_WORDS} most frequently appeared words in "
                   "the above coded text?", "Answer: According to the coded text above, the "
                   f"{FWE_WORDS} most frequently appeared words are:", [], "")
    pre = b.bos + b.preface(q) + b.enc(intro)
    ctx, n = _fit_lines(b, "fwe", pre, draws, lambda n: [" " + w for w in draws[:n]], q)
    counts = {}
    for w in draws[:n]:
        counts[w] = counts.get(w, 0) + 1
    top = sorted(counts, key=lambda w: -counts[w])
    if len(top) <= FWE_WORDS or counts[top[FWE_WORDS - 1]] == counts[top[FWE_WORDS]]:
        raise TaskError(f"fwe: length={b.length} leaves too few words for a strict top "
                        f"{FWE_WORDS}; allowed: a longer length")
    refs = top[:FWE_WORDS]
    q.references, q.answer = tuple(refs), " " + ", ".join(refs)
    q.answer_ids = b.enc(q.answer)
    return ctx, [q], []


def _kv_retrieval(b, rng, depth):
    intro = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"
    room = b.length - b.budget
    pairs = [(_uuid(rng), _uuid(rng)) for _ in range(max(2, room // 40 + 4))]
    # placeholder question for the lengths; the asked key is fixed once the count is known
    probe = b.question(f'Key: "{pairs[0][0]}"', "Corresponding value:", [pairs[0][1]],
                       f' "{pairs[0][1]}"')
    pre = b.bos + b.preface(probe) + b.enc(intro)
    fixed = len(pre) + len(b.enc("}"))
    space = b.room(fixed + 8, "kv_retrieval", least=60)  # 8: a longer asked key
    piece = lambda i, k, v: (", " if i else "") + f'"{k}": "{v}"'
    ids_of = [b.enc(piece(i, k, v)) for i, (k, v) in enumerate(pairs)]
    n = 0
    while n < len(ids_of) and sum(len(x) for x in ids_of[:n + 1]) <= space:
        n += 1
    asked = min(n - 1, round(depth * (n - 1)))
    key, value = pairs[asked]
    q = b.question(f'Key: "{key}"', "Corresponding value:", [value], f' "{value}"')
    pre = b.bos + b.preface(q) + b.enc(intro)
    body = [t for x in ids_of[:n] for t in x] + b.enc("}")
    n_pad = b.length - b.budget - len(pre) - len(body)
    if n_pad < 0:  # the asked key tokenized longer than the probe's
        raise TaskError(f"kv_retrieval: length={b.length} leaves no room for the question; "
                        "allowed: a longer length")
    pad = b.enc("\n")[-1:] * n_pad
    pos = len(pre) + sum(len(x) for x in ids_of[:asked])
    return pre + body + pad, [q], [pos]


def _copy(b, rng, depth):
    words = _distinct(rng, word_list("noun"), COPY_WORDS)
    q = b.question("Repeat the list of words to copy.",
                   "The list of words to copy is: " + " ".join(words[:COPY_GIVEN]),
                   words[COPY_GIVEN:], " " + " ".join(words[COPY_GIVEN:]))
    needle = "Here is a list of words to copy: " + " ".join(words) + "."
    ctx, pos = _needle_task(b, "copy", COPY_INTRO, [(depth, needle)], [0], q)
    return ctx, [q], pos


_GENERATORS = {"passkey": _passkey, "niah_single": _niah_single,
               "niah_multikey": _niah_multikey, "niah_multivalue": _niah_multivalue,
               "niah_multiquery": _niah_multiquery, "vt": _vt, "cwe": _cwe, "fwe": _fwe,
               "kv_retrieval": _kv_retrieval, "copy": _copy}


def sample_seed(seed: int, task: str, length: int, depth: float, index: int) -> int:
    """The generator seed of one sample: a hash of (seed, task, length, depth, index), so a
    sample does not depend on which others are generated (a resumed run regenerates it)."""
    import hashlib  # noqa: PLC0415

    h = hashlib.sha256(f"{seed}|{task}|{length}|{depth!r}|{index}".encode()).digest()
    return int.from_bytes(h[:8], "little")


def check_task_args(tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
                    samples: int) -> None:
    """Raises TaskError naming the first bad value: an unknown task, a length that is not
    a positive integer, a depth outside [0, 1], or samples < 1."""
    for t in tasks:
        if t not in TASKS:
            raise TaskError(f"unknown task {t!r}; allowed: {', '.join(TASKS)}")
    if not tasks:
        raise TaskError(f"no task given; allowed: any of {', '.join(TASKS)}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n <= 0:
            raise TaskError(f"length {n!r}; allowed: a positive integer (tokens)")
    for d in depths:
        if not (isinstance(d, (int, float)) and 0.0 <= float(d) <= 1.0):
            raise TaskError(f"depth {d!r}; allowed: a number in [0, 1]")
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise TaskError(f"samples={samples!r}; allowed: an integer >= 1")


def generate_sample(task: str, tokenizer, length: int, depth: float = 0.5, seed: int = 0,
                    index: int = 0, query_first: bool = False) -> Sample:
    """One sample of ``task`` (see the module docstring for the layouts).

    Args:
      task: a name of :data:`TASKS`.
      tokenizer: the checkpoint's tokenizer (``encode``, ``bos_token_id``,
        ``add_bos_token``).
      length: L, the positions the sample may use; its context is exactly
        ``L - RESERVE`` tokens.
      depth: where the answer-bearing needle goes, in [0, 1] of the filler.
      seed, index: the run's seed and the sample's number (:func:`sample_seed`).
      query_first: also put the question before the context.
    Returns:
      a :class:`Sample`.
    Raises:
      TaskError: an unknown task, a depth outside [0, 1], or a length too short for the
        task (the message names the least that works).
    """
    check_task_args([task], [length], [depth], 1)
    spec = TASKS[task]
    s = sample_seed(seed, task, length, depth, index)
    b = _Builder(tokenizer, length, spec.max_new_tokens, query_first)
    ctx, questions, pos = _GENERATORS[task](b, np.random.default_rng(s), float(depth))
    for q in questions:
        if len(q.answer_ids) > spec.max_new_tokens or len(q.ids) > QUESTION_ROOM:
            raise TaskError(f"{task}: a question of {len(q.ids)} tokens (room: "
                            f"{QUESTION_ROOM}) or an answer of {len(q.answer_ids)} (budget: "
                            f"{spec.max_new_tokens}); this tokenizer splits them too finely")
    if len(ctx) != length - RESERVE:  # a layout bug, never the user's
        raise AssertionError(f"{task}: a context of {len(ctx)} tokens, not {length - RESERVE}")
    return Sample(task, length, float(depth), index, seed, ctx, questions, pos,
                  spec.max_new_tokens)


# ---------------------------------------------------------------------------- scoring

def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_all`` for one sample: the share of ``references`` found in
    ``prediction``, case-insensitive (Hsieh et al. 2024; RULER's
    ``scripts/eval/synthetic/constants.py``). In [0, 1]."""
    if not references:
        raise ValueError("no reference to match")
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER's ``string_match_part`` for one sample: 1.0 if any of ``references`` is found
    in ``prediction`` (case-insensitive), else 0.0."""
    if not references:
        raise ValueError("no reference to match")
    p = prediction.lower()
    return float(any(r.lower() in p for r in references))


METRICS = {"all": string_match_all, "part": string_match_part}


def wilson_interval(successes: float, n: int, z: float = 1.959963984540054) -> tuple:
    """The Wilson score interval (Wilson 1927) of a proportion ``successes / n`` at the
    two-sided level of ``z`` (default 95%): (low, high) in [0, 1]. Fractional successes
    (a sum of partial string-match scores) are used as they are.

    Raises:
      ValueError: n < 1 or successes outside [0, n].
    """
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"successes={successes}, n={n}; allowed: n >= 1, 0 <= successes <= n")
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    # At p = 0 (p = 1) the bound is exactly 0 (1); rounding can leave 3e-17 (1 - 1e-16),
    # which puts the point estimate outside its own interval.
    low = 0.0 if successes == 0 else max(0.0, mid - half)
    high = 1.0 if successes == n else min(1.0, mid + half)
    return low, high


def mean_interval(values: Sequence[float], level: float = 0.95) -> tuple:
    """(mean, low, high): Student's t interval of the mean of ``values`` (nan bounds for
    fewer than 2 values)."""
    from scipy import stats  # noqa: PLC0415

    v = np.asarray(values, np.float64)
    m = float(v.mean())
    if v.size < 2:
        return m, float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + level / 2, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
    return m, m - half, m + half


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test of ``wins`` against ``losses`` discordant pairs (ties
    dropped): the exact McNemar test of two scorings of the same samples (McNemar 1947;
    the binomial form, Fagerland et al. 2013, "The McNemar test for binary matched-pairs
    data", eq. 2): p = min(1, 2 · P[X <= min(wins, losses)]), X ~ Binomial(wins + losses,
    1/2); 1.0 with no discordant pair.

    Raises:
      ValueError: a negative count.
    """
    if wins < 0 or losses < 0:
        raise ValueError(f"wins={wins}, losses={losses}; allowed: counts >= 0")
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return min(1.0, 2.0 * tail)


def paired_test(scores: dict, reference: dict) -> dict:
    """A run's per-sample scores against a reference run's on the samples both scored
    ({sample id: score in [0, 1]}): ``samples`` shared, ``wins`` (the run scored above the
    reference), ``losses`` (below), ``p`` by :func:`sign_test` (for 0/1 scores, exact
    McNemar); ``difference``: the mean score difference over the shared samples."""
    shared = sorted(set(scores) & set(reference))
    d = [scores[s] - reference[s] for s in shared]
    wins, losses = sum(x > 0 for x in d), sum(x < 0 for x in d)
    return dict(samples=len(shared), wins=wins, losses=losses, p=sign_test(wins, losses),
                difference=float(np.mean(d)) if d else float("nan"))


# ---------------------------------------------------------------------------- protocol

@dataclasses.dataclass
class QuestionResult:
    """One question's outcome: the greedy answer text and ids, its score in [0, 1], the
    reference answer's NLL (nats per token and total) and its token count."""

    prediction: str
    generated_ids: list
    score: float
    answer_nll: float
    answer_nll_total: float
    answer_tokens: int


@dataclasses.dataclass
class SampleResult:
    """A sample's score (mean over its questions), answer NLL (nats/token, mean over its
    questions), the cache's bytes after the prefill (allocated, one sequence) and in
    theory at the sample's length, and the prefill / questions wall times (s; protocol
    'question' prefills per question: all its time is in ``prefill_seconds``).
    ``kv_bytes_read``: under a read-time page selection (Quest), theory's KV and bound
    bytes one decode step reads at the sample's length
    (``theory.page_selection_step_bytes``), else None."""

    score: float
    answer_nll: float
    questions: list
    kv_bytes_allocated: int
    kv_bytes_theory: int
    cache_slots: int
    prefill_seconds: float
    decode_seconds: float
    kv_bytes_read: int | None = None


def _bucket(n: int) -> int:
    """Padded chunk length for n tokens: a power of two >= max(n, 16) (few compiles)."""
    return max(16, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg",))
def _chunk_logits(params, tokens, num_valid, cache, *, cfg):
    """tokens [1, T] int32 right-padded, ``num_valid`` [1] int32 real ones, appended to
    ``cache`` (not donated: the context's cache stays for the next question) ->
    (logits [1, T, V] float32, the extended cache)."""
    positions = cache.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    return model_lib.forward(params, cfg, tokens, positions, cache, num_valid=num_valid)


def _run_chunk(params, cfg, ids: list, cache):
    t = _bucket(len(ids))
    tokens = np.zeros((1, t), np.int32)
    tokens[0, :len(ids)] = ids
    return _chunk_logits(params, jnp.asarray(tokens), jnp.asarray([len(ids)], jnp.int32),
                         cache, cfg=cfg)


def resolve_config(cfg: ModelConfig, length: int, prompt_lens: Sequence[int] = ()) -> ModelConfig:
    """``cfg`` with its execution plan resolved for a cache of ``length`` slots, one row
    (``kvjax.planner.resolve``): call once per length, before :func:`evaluate_sample`."""
    rows = tuple(sorted(set(prompt_lens))) + (16, 32, 64, 128)
    return planner.resolve(cfg, max_seq_len=length, batch_sizes=(1,), rows=rows)


def prefill_context(params, cfg: ModelConfig, context_ids: Sequence[int], num_slots: int):
    """The context in the config's cache: (logits [1, V] of its last token, cache of
    ``num_slots`` positions, one row) by ``decode.prefill_program`` (one pass, fresh)."""
    cache = cache_lib.init_cache(cfg, 1, num_slots, ragged=True)  # padded question chunks
    tokens = jnp.asarray([list(context_ids)], jnp.int32)
    decode.check_room(cfg, cache, tokens.shape[1], "prefill")
    return decode.prefill_program(params, tokens, cache, cfg=cfg, fresh=True)


def ask(params, cfg: ModelConfig, cache, question: Question, max_new_tokens: int,
        tokenizer, eos_ids: Sequence[int] = (), metric: str = "all") -> QuestionResult:
    """One question on a filled ``cache`` (left as it is): greedy answer and answer NLL.

    The question's tokens go in one right-padded chunk (``model.forward`` with
    ``num_valid``), its last logits give the first answer token, and
    ``decode.generate`` greedily continues for ``max_new_tokens - 1`` steps (stopping at
    ``eos_ids``). The NLL chunk is the question with the reference answer appended, on
    the same context cache: -log p(answer_ids[i] | context, question, answer_ids[:i]),
    averaged over the answer's tokens (nats per token).
    """
    q = list(question.ids)
    logits, qcache = _run_chunk(params, cfg, q, cache)
    first = jnp.argmax(logits[:, len(q) - 1], axis=-1).astype(jnp.int32)
    out, ran, _ = decode.generate(params, cfg, first, qcache, max_new_tokens - 1,
                                  eos_ids=tuple(eos_ids))
    gen = [int(first[0])] + [int(t) for t in np.asarray(out[0, :ran])]
    a = list(question.answer_ids)
    nll_logits, _ = _run_chunk(params, cfg, q + a, cache)
    lp = jax.nn.log_softmax(nll_logits[0, len(q) - 1:len(q) + len(a) - 1], axis=-1)
    token_nll = -np.asarray(jnp.take_along_axis(lp, jnp.asarray(a)[:, None], axis=-1)[:, 0],
                            np.float64)
    return _scored(tokenizer, gen, eos_ids, question, metric, token_nll)


PROTOCOLS = ("context", "question")
"""When a lever that acts on a filled cache (``model.kv_compression``) sees the question:
'context': the context alone is prefilled and compressed once, then every question is
asked on it (query-agnostic: kvpress's default); 'question': each question is prefilled
after the context and compressed with it, then answered (SnapKV's setting, Li et al.
2024 sec. 5: the observation window holds the question)."""


def ask_with_context(params, cfg: ModelConfig, context_ids: Sequence[int],
                     question: Question, num_slots: int, max_new_tokens: int, tokenizer,
                     eos_ids: Sequence[int] = (), metric: str = "all") -> tuple:
    """One question prefilled after the context in one pass (protocol 'question': the
    prefill's lever, e.g. a compression, sees it): greedy answer and answer NLL, as
    :func:`ask` scores them. The reference answer's tokens after the first are scored
    by one chunk on the prefilled cache (not donated) before the greedy loop.

    Returns:
      (QuestionResult, bytes of the cache the prefill allocated, its slots).
    """
    logits, cache = prefill_context(params, cfg, list(context_ids) + list(question.ids),
                                    num_slots)
    return answer_prefilled(params, cfg, logits, cache, question, max_new_tokens,
                            tokenizer, eos_ids, metric)


def answer_prefilled(params, cfg: ModelConfig, logits, cache, question: Question,
                     max_new_tokens: int, tokenizer, eos_ids: Sequence[int] = (),
                     metric: str = "all") -> tuple:
    """Protocol 'question' after its prefill: ``logits`` [1, V] float32 of the question's
    last token and the (compressed) ``cache`` holding the context and the question ->
    (QuestionResult, the cache's allocated bytes, its slots); see
    :func:`ask_with_context`."""
    nll = continuation_nll(params, cfg, logits, cache, question.answer_ids)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    allocated, slots = cache_lib.cache_bytes(cache), cache.num_slots
    out, ran, _ = decode.generate(params, cfg, first, cache, max_new_tokens - 1,
                                  eos_ids=tuple(eos_ids))
    return _scored(tokenizer, [int(first[0])] + [int(t) for t in np.asarray(out[0, :ran])],
                   eos_ids, question, metric, nll), allocated, slots


def continuation_nll(params, cfg: ModelConfig, logits, cache, ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced NLL of ``ids`` (M >= 1 tokens) continuing a prefilled ``cache``:
    ``logits`` [1, V] float32 of the prompt's last token score ids[0]; ids[:-1] go in one
    right-padded chunk on the cache (not donated; :func:`ask`'s chunk), whose logits score
    ids[1:]. On a compressed or windowed cache the chunk's queries see what decoding
    would (the kept slots, the ring's last recent_slots tokens: the slot policy's mask).
    Returns [M] float64 nats, -log p(ids[i] | prompt, ids[:i])."""
    a = list(ids)
    lp0 = jax.nn.log_softmax(logits[0], axis=-1)
    nll = [-float(lp0[a[0]])]
    if len(a) > 1:
        rest, _ = _run_chunk(params, cfg, a[:-1], cache)
        lp = jax.nn.log_softmax(rest[0, :len(a) - 1], axis=-1)
        nll += list(-np.asarray(jnp.take_along_axis(lp, jnp.asarray(a[1:])[:, None],
                                                    axis=-1)[:, 0], np.float64))
    return np.asarray(nll, np.float64)


def _scored(tokenizer, gen: list, eos_ids, question: Question, metric: str,
            token_nll: np.ndarray) -> QuestionResult:
    """The greedy tokens cut at the first end-of-generation id, decoded and scored."""
    eos = set(int(e) for e in eos_ids)
    gen = gen[:next((i for i, t in enumerate(gen) if t in eos or t < 0), len(gen))]
    text = tokenizer.decode(gen)
    return QuestionResult(text, gen, METRICS[metric](text, question.references),
                          float(token_nll.mean()), float(token_nll.sum()),
                          len(question.answer_ids))


def evaluate_sample(params, cfg: ModelConfig, sample: Sample, tokenizer,
                    eos_ids: Sequence[int] = (),
                    compress: Callable | None = None,
                    protocol: str = "context", page_size: int = 0) -> SampleResult:
    """The protocol: prefill ``sample``'s context once into ``cfg``'s cache, apply the
    lever, ask each question on it (:func:`ask`).

    The lever is ``cfg`` itself (window, sinks, kv_dtype, KV heads, MLA: the cache the
    prefill fills) and, for levers that act on a filled cache, ``compress(cache) ->
    cache`` (query-agnostic: it runs before any question is seen). The cache has
    ``sample.length`` positions (a window: its W slots).

    Args:
      params: parameters in cfg's layout; cfg: resolved (:func:`resolve_config`).
      sample: from :func:`generate_sample`.
      tokenizer: decodes the greedy answer.
      eos_ids: end-of-generation ids (``Tokenizer.eos_token_ids``).
      compress: optional cache transform applied after the prefill (protocol
        'context').
      protocol: one of :data:`PROTOCOLS`.
      page_size: P, tokens per page for a read-time page selection
        (``cfg.kv_selects_pages``, Quest: :func:`_evaluate_paged`); 0 otherwise.
    Raises:
      ValueError: an unknown protocol, or ``compress`` with protocol 'question'; a page
        selection with page_size 0 or a budget the paged cache refuses.
      kvjax.cache.policy.CacheOverflowError: the sample does not fit ``sample.length``
        positions (a layout bug).
    """
    if protocol not in PROTOCOLS or (protocol == "question" and compress is not None):
        raise ValueError(f"protocol={protocol!r}{' with compress' if compress else ''}; "
                         f"allowed: one of {list(PROTOCOLS)} ('question' takes the lever "
                         "from cfg alone)")
    metric = TASKS[sample.task].metric
    if cfg.kv_selects_pages:
        return _evaluate_paged(params, cfg, sample, tokenizer, eos_ids, page_size, metric)
    if protocol == "question":
        start = time.perf_counter()
        asked = [ask_with_context(params, cfg, sample.context_ids, q, sample.length,
                                  sample.max_new_tokens, tokenizer, eos_ids, metric)
                 for q in sample.questions]
        results = [r for r, _, _ in asked]
        return SampleResult(
            score=float(np.mean([r.score for r in results])),
            answer_nll=float(np.mean([r.answer_nll for r in results])), questions=results,
            kv_bytes_allocated=asked[0][1],
            kv_bytes_theory=theory.kv_cache_bytes(cfg, sample.length),
            cache_slots=asked[0][2], prefill_seconds=time.perf_counter() - start,
            decode_seconds=0.0)
    start = time.perf_counter()
    logits, cache = prefill_context(params, cfg, sample.context_ids, sample.length)
    if compress is not None:
        cache = compress(cache)
    jax.block_until_ready(cache.length)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    results = [ask(params, cfg, cache, q, sample.max_new_tokens, tokenizer, eos_ids, metric)
               for q in sample.questions]
    decode_s = time.perf_counter() - start
    return SampleResult(
        score=float(np.mean([r.score for r in results])),
        answer_nll=float(np.mean([r.answer_nll for r in results])), questions=results,
        kv_bytes_allocated=cache_lib.cache_bytes(cache),
        kv_bytes_theory=theory.kv_cache_bytes(cfg, sample.length),
        cache_slots=cache.num_slots, prefill_seconds=prefill_s, decode_seconds=decode_s)


# ------------------------------------------------------------------- one prefill, many levers


@functools.partial(jax.jit, static_argnames=("cfg", "slots"))
def _observed_prefill(params, tokens, num_valid, *, cfg, slots):
    """tokens [1, T] int32, right-padded after ``num_valid`` [1] int32 real ones,
    prefilled fresh into a dense cache of ``slots`` >= T slots of ``cfg`` (no
    compression) -> (logits [1, V] float32 of the last real token, the cache, L
    per-layer rotated queries [1, T, K, G, H]): ``decode.prefill_compressed``'s first
    half. A fixed T per length (the question's room padded) compiles one program."""
    full = cache_lib.init_cache(cfg, 1, slots, ragged=True)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, full, queries = model_lib.forward(params, cfg, tokens, positions, full,
                                              num_valid=num_valid, fresh=True,
                                              last_only=True, observe=True)
    return logits[:, -1], full, queries


@functools.partial(jax.jit, static_argnames=("cfg", "prompt_len"))
def _compress_observed(full, queries, *, cfg, prompt_len):
    """The prompt's full cache and queries compressed under ``cfg``'s method and budget:
    ``decode.prefill_compressed``'s second half (the same observation queries)."""
    return compress_lib.compress_prompt(cfg, full, queries, prompt_len)


@functools.partial(jax.jit, static_argnames=("cfg", "slots"))
def _grow(full, *, cfg, slots):
    """A dense cache of T slots (positions 0 .. T-1 filled) as the same cache of ``slots``
    >= T slots: zero tensors and position -1 appended (what a fresh prefill into a
    cache of ``slots`` slots leaves)."""
    extra = slots - full.num_slots

    def pad(x, name):
        widths = [(0, 0)] * x.ndim
        widths[x.ndim + cache_lib.slot_axis(cfg, name)] = (0, extra)
        return jnp.pad(x, widths)

    tensors = {n: pad(t, n) if cfg.scan_layers else tuple(pad(x, n) for x in t)
               for n, t in full.tensors.items()}
    positions = jnp.pad(full.positions, ((0, 0), (0, extra)), constant_values=-1)
    return full.replace(tensors=tensors, positions=positions)


def _cut_prompt(point: ModelConfig, prompt_len: int) -> tuple:
    """What a point shares its prefill by: (the prompt's config, its cache slots)."""
    if point.kv_evicts:
        return compress_lib.prompt_config(point), compress_lib.prompt_slots(point, prompt_len)
    return point, prompt_len


def _check_sweep_points(points: Sequence[ModelConfig]) -> None:
    """Raises ValueError for a point a shared prefill cannot serve (a window, a read-time
    page selection)."""
    for p in points:
        if p.window_size is not None or p.kv_selects_pages:
            raise ValueError(
                f"a sweep point with window_size={p.window_size}, kv_compression="
                f"{p.kv_compression!r}; allowed: a dense cache with or without an evicting "
                "method (a window is streaming_llm at the same budget)")


def _point_cache(point: ModelConfig, full, queries, prompt_len: int, length: int):
    """A point's cache from the shared prefill's dense ``full`` cache and ``queries``:
    compressed by its method and budget, or (no eviction) grown to ``length`` slots."""
    if point.kv_evicts:
        cache = _compress_observed(full, queries, cfg=point, prompt_len=prompt_len)
    else:
        cache = _grow(full, cfg=point, slots=length)
    jax.block_until_ready(cache.length)
    return cache


def evaluate_sweep(params, points: Sequence[ModelConfig], sample: Sample, tokenizer,
                   eos_ids: Sequence[int] = (),
                   protocols: Sequence[str] = ("question",)) -> dict:
    """Many levers that act on a filled cache, one prefill: every point of ``points``
    scored on ``sample`` under each protocol, as :func:`evaluate_sample` scores it alone.

    The prefill of the context (protocol 'context') or of the context and each question
    (protocol 'question') runs once into a dense cache, keeping every layer's queries
    (``model.forward``'s ``observe``); each point then compresses that cache with the
    observation queries its method reads (``kvjax.cache.compress.compress``, the same
    calls as ``decode.prefill_compressed``: H2O's attention accumulated over every prompt
    query and SnapKV's observation window are both functions of the stored queries, so no
    method needs a prefill of its own) and answers. A point without compression (a full
    cache, or a kv_dtype: any config whose prefill is its own) gets the dense cache grown
    to ``sample.length`` slots. Points whose prompt config (``prompt_config``: the model
    without compression, its plan and kv_dtype) differs get their own prefill.

    Args:
      points: resolved configs (:func:`resolve_config`), one per lever; a window
        (``window_size``) or a read-time page selection is refused.
      protocols: a subset of :data:`PROTOCOLS`.
    Returns:
      {(protocol, index into points): SampleResult}; ``prefill_seconds`` of each is the
      shared prefill's time plus the point's compression, ``decode_seconds`` its answers.
    Raises:
      ValueError: an unknown protocol, a windowed point or a page-selecting one.
    """
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or not protocols:
        raise ValueError(f"protocols={list(protocols)}; allowed: one or more of "
                         f"{list(PROTOCOLS)}")
    _check_sweep_points(points)
    metric = TASKS[sample.task].metric
    out = {}
    for protocol in protocols:
        prompts = ([list(sample.context_ids)] if protocol == "context" else
                   [list(sample.context_ids) + list(q.ids) for q in sample.questions])
        per_point = {i: ([], 0.0, 0.0, 0, 0) for i in range(len(points))}
        for qi, ids in enumerate(prompts):
            # the question protocol's prompts padded to the context plus the question's
            # room: one prefill and one compression program per length and point
            # (docs/decisions/0039-longeval-sweep-one-prefill.md)
            width = len(ids) if protocol == "context" else \
                len(sample.context_ids) + QUESTION_ROOM
            groups: dict = {}
            for i, p in enumerate(points):
                groups.setdefault(_cut_prompt(p, width), []).append(i)
            tokens = jnp.asarray([ids + [0] * (width - len(ids))], jnp.int32)
            valid = jnp.asarray([len(ids)], jnp.int32)
            for (pcfg, slots), members in groups.items():
                start = time.perf_counter()
                logits, full, queries = _observed_prefill(params, tokens, valid, cfg=pcfg,
                                                          slots=slots)
                jax.block_until_ready(full.length)
                shared = time.perf_counter() - start
                for i in members:
                    p = points[i]
                    start = time.perf_counter()
                    cache = _point_cache(p, full, queries, width, sample.length)
                    prep = shared + time.perf_counter() - start
                    start = time.perf_counter()
                    dcfg = compress_lib.decode_config(p)  # one program per budget
                    if protocol == "question":
                        res, allocated, slots_ = answer_prefilled(
                            params, dcfg, logits, cache, sample.questions[qi],
                            sample.max_new_tokens, tokenizer, eos_ids, metric)
                        got = [res]
                    else:
                        got = [ask(params, dcfg, cache, q, sample.max_new_tokens, tokenizer,
                                   eos_ids, metric) for q in sample.questions]
                        allocated, slots_ = cache_lib.cache_bytes(cache), cache.num_slots
                    results, pre, dec, _, _ = per_point[i]
                    per_point[i] = (results + got, pre + prep,
                                    dec + time.perf_counter() - start, allocated, slots_)
        for i, (results, pre, dec, allocated, slots_) in per_point.items():
            out[(protocol, i)] = SampleResult(
                score=float(np.mean([r.score for r in results])),
                answer_nll=float(np.mean([r.answer_nll for r in results])),
                questions=results, kv_bytes_allocated=allocated,
                kv_bytes_theory=theory.kv_cache_bytes(points[i], sample.length),
                cache_slots=slots_, prefill_seconds=pre, decode_seconds=dec)
    return out


# ------------------------------------------- perplexity on a compressed (or any) cache


PPL_TOKENS = 256
"""M, the scored last tokens of a tail-perplexity text (:func:`tail_nll`) by default:
past the compressed cache's recent ring (192 slots), so its last tokens are scored as a
decode step would read the cache."""


def check_tail(length: int, tail) -> None:
    """Raises ValueError unless ``tail`` is an integer M with 1 <= M < ``length`` (named)."""
    if isinstance(tail, bool) or not isinstance(tail, (int, np.integer)) \
            or not 1 <= tail < length:
        raise ValueError(f"ppl_tokens={tail!r}; allowed: an integer M with 1 <= M < "
                         f"L={length} (a text's first L - M tokens are prefilled into the "
                         "cache, its last M scored)")


@dataclasses.dataclass
class TailResult:
    """A text's last M tokens scored on the cache its first L - M were prefilled (and
    compressed) into: ``nll`` [M] float64 nats per token, the cache's allocated bytes
    (one sequence) and theory's at L, its slots, and the wall time (s; a sweep's
    includes the shared prefill)."""

    nll: np.ndarray
    kv_bytes_allocated: int
    kv_bytes_theory: int
    cache_slots: int
    seconds: float


def tail_nll(params, cfg: ModelConfig, ids: Sequence[int], tail: int) -> TailResult:
    """Perplexity's measure under a lever that acts on the cache: ``ids`` (a text of L
    tokens), its first L - M prefilled into ``cfg``'s cache of L positions by the
    prefill every run uses (:func:`prefill_context`: a window's ring, a kv_dtype, or
    prefill-and-compress with ``kv_compression``, ``decode.prefill_compressed``), then its
    last M = ``tail`` tokens teacher-forced on that cache (:func:`continuation_nll`; the
    kept slots and the cache's recent ring, as decoding reads them): compress once,
    then continue (issue 55 item 4). A cache that keeps every slot, with M within its
    ring, scores as the full cache; scored tokens past recent_slots see only the ring's
    last recent_slots tokens besides the kept ones, as decoding would.

    Args:
      cfg: resolved (:func:`resolve_config`) for L.
    Raises:
      ValueError: M outside [1, L) (:func:`check_tail`).
    """
    check_tail(len(ids), tail)
    start = time.perf_counter()
    logits, cache = prefill_context(params, cfg, list(ids[:-tail]), len(ids))
    nll = continuation_nll(params, cfg, logits, cache, list(ids[-tail:]))
    return TailResult(nll, cache_lib.cache_bytes(cache), theory.kv_cache_bytes(cfg, len(ids)),
                      cache.num_slots, time.perf_counter() - start)


def sweep_tail_nll(params, points: Sequence[ModelConfig], ids: Sequence[int],
                   tail: int) -> dict:
    """:func:`tail_nll` of every point on one prefill of the text's first L - M tokens
    (:func:`evaluate_sweep`'s: a dense cache and every layer's queries, each point's
    method compressing it with the observation queries it reads, a full cache grown to
    L slots).

    Returns:
      {index into points: TailResult}; ``seconds`` is the shared prefill's plus the
      point's compression and scoring.
    Raises:
      ValueError: M outside [1, L), a windowed or page-selecting point.
    """
    check_tail(len(ids), tail)
    _check_sweep_points(points)
    prefix, rest = list(ids[:-tail]), list(ids[-tail:])
    width = len(prefix)
    groups: dict = {}
    for i, p in enumerate(points):
        groups.setdefault(_cut_prompt(p, width), []).append(i)
    tokens = jnp.asarray([prefix], jnp.int32)
    valid = jnp.asarray([width], jnp.int32)
    out = {}
    for (pcfg, slots), members in groups.items():
        start = time.perf_counter()
        logits, full, queries = _observed_prefill(params, tokens, valid, cfg=pcfg, slots=slots)
        jax.block_until_ready(full.length)
        shared = time.perf_counter() - start
        for i in members:
            p = points[i]
            start = time.perf_counter()
            cache = _point_cache(p, full, queries, width, len(ids))
            nll = continuation_nll(params, compress_lib.decode_config(p), logits, cache,
                                   rest)
            out[i] = TailResult(nll, cache_lib.cache_bytes(cache),
                                theory.kv_cache_bytes(p, len(ids)), cache.num_slots,
                                shared + time.perf_counter() - start)
    return out


# ------------------------------------------------------ lever 5 at read time: paged rows


@functools.partial(jax.jit, static_argnames=("cfg",))
def _step_logits(params, token, cache, *, cfg):
    """One decode step: token [1, 1] int32 at the cache's length -> (logits [1, V]
    float32, the cache). On a paged cache with key bounds this is the step Quest
    selects pages in (``attention.attend_pages``: T = 1)."""
    logits, cache = model_lib.forward(params, cfg, token, cache.length[:, None], cache)
    return logits[:, 0], cache


def init_rows(cfg: ModelConfig, length: int, page_size: int):
    """One row of a paged cache (``kvjax.cache.paged``) for ``length`` tokens: its
    ceil(length / page_size) pages in order in the block table, and for a read-time page
    selection their key bounds.

    Raises:
      ValueError: page_size below 1, or a budget the selection refuses (named).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} with model.kv_compression="
                         f"{cfg.kv_compression!r}; allowed: an integer >= 1 (tokens per "
                         "page: --config.page_size)")
    pages = paged_lib.pages_for(length, page_size)
    cache = paged_lib.init_paged_cache(cfg, 1, pages, page_size, pages)
    return cache.replace(block_table=jnp.arange(pages, dtype=jnp.int32)[None, :])


def _evaluate_paged(params, cfg: ModelConfig, sample: Sample, tokenizer, eos_ids,
                    page_size: int, metric: str) -> SampleResult:
    """The protocol on paged rows for a read-time page selection (Quest): the context is
    prefilled into one row of ``sample.length`` tokens' pages (every page kept, each
    with its key bounds); each question goes in one chunk (a chunk reads every page, as
    Quest's own prefill does); then every decode step (T = 1) reads only the
    kv_budget / page_size pages per KV head the method ranks first: the greedy answer,
    and the reference answer's NLL with its tokens after the first teacher-forced one
    step at a time (each scored on the pages its own query selects). Nothing is
    evicted, so protocols 'context' and 'question' are the same run."""
    start = time.perf_counter()
    cache = init_rows(cfg, sample.length, page_size)
    _, cache = _run_chunk(params, cfg, list(sample.context_ids), cache)
    jax.block_until_ready(cache.length)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    eos = set(int(e) for e in eos_ids)
    results = []
    for question in sample.questions:
        q, a = list(question.ids), list(question.answer_ids)
        logits, qcache = _run_chunk(params, cfg, q, cache)
        last, c, nll = logits[:, len(q) - 1], qcache, []
        for i, tok_id in enumerate(a):
            nll.append(-float(jax.nn.log_softmax(last[0], axis=-1)[tok_id]))
            if i + 1 < len(a):
                last, c = _step_logits(params, jnp.asarray([[tok_id]], jnp.int32), c,
                                       cfg=cfg)
        gen, c, last = [], qcache, logits[:, len(q) - 1]
        while True:
            gen.append(int(jnp.argmax(last[0])))
            if gen[-1] in eos or len(gen) == sample.max_new_tokens:
                break
            last, c = _step_logits(params, jnp.asarray([[gen[-1]]], jnp.int32), c, cfg=cfg)
        results.append(_scored(tokenizer, gen, eos_ids, question, metric,
                               np.asarray(nll, np.float64)))
    decode_s = time.perf_counter() - start
    step = theory.page_selection_step_bytes(cfg, sample.length, page_size)
    return SampleResult(
        score=float(np.mean([r.score for r in results])),
        answer_nll=float(np.mean([r.answer_nll for r in results])), questions=results,
        kv_bytes_allocated=cache_lib.total_bytes((cache.tensors, cache.bounds)),
        kv_bytes_theory=cache.pool_pages * paged_lib.page_bytes(cfg, page_size),
        cache_slots=cache.num_slots, prefill_seconds=prefill_s, decode_seconds=decode_s,
        kv_bytes_read=step["kv_read"] + step["bounds_read"])
