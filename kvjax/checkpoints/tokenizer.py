"""The checkpoint's tokenizer, rebuilt from a GGUF file's vocabulary and merges.

GGUF carries a GPT-2-style byte-level BPE (``tokenizer.ggml.model == 'gpt2'``):
the tokens (byte-level unicode strings), the merges (``"a b"`` strings, by
priority) and a type per token (3 = CONTROL, i.e. special). From these an HF
``tokenizers.Tokenizer`` is built the way the model's own ``tokenizer.json`` is, in the
dialect ``tokenizer.ggml.pre`` names: SmolLM2's ('smollm': no normaliser, pre-tokeniser
``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)])``), Llama 3's ('llama-bpe': its split regex, then
``ByteLevel(use_regex=False)``; BPE ``ignore_merges``) or Qwen2's ('qwen2': NFC, the same
regex with single digits); ByteLevel decoder, no BOS/EOS added by ``encode``, control
tokens (and every end-of-generation token) registered as special tokens.

Text is text: :meth:`Tokenizer.encode` tokenizes a string as plain text (a literal
``<|im_end|>`` typed by a user is bytes, not the control token); only the chat template's
own scaffolding yields control ids (:meth:`Tokenizer.chat_ids`; the rest of a chat
prompt's ids are the checkpoint tokenizer's encoding of the whole rendered text, as
Hugging Face's ``apply_chat_template(tokenize=True)``). The checkpoint's chat
template is rendered with ``jinja2`` in its sandbox, as Hugging Face's
``apply_chat_template`` renders it (:func:`render_chat_template`).
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import re
from typing import Any, Sequence

import gguf
import jinja2
import numpy as np
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers

from kvjax.checkpoints import utf8
from kvjax.checkpoints.fetch import WeightsError
from kvjax.checkpoints.gguf_reader import (
    LlamaGGUF,
    _tokenizer_fields,
    end_of_generation_ids,
    pre_tokenizer_dialect,
    read_tokenizer_fields,
    resolve_special_token_ids,
)

TOKEN_TYPE_CONTROL = int(gguf.TokenType.CONTROL)  # 3
TOKEN_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)  # 4

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled in jinja2's ``ImmutableSandboxedEnvironment`` with the
    settings of Hugging Face's ``apply_chat_template`` (transformers
    ``utils/chat_template_utils.py``): ``trim_blocks``, ``lstrip_blocks``, the
    ``loopcontrols`` extension, ``raise_exception(msg)``, ``strftime_now(fmt)`` and a
    ``tojson`` filter that keeps non-ASCII text.

    Raises:
      ValueError: the template is not valid Jinja (the message names the line).
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}: "
                         f"{e.message})") from None


def render_chat_template(template: str, messages: Sequence[dict],
                         add_generation_prompt: bool = True, **special_tokens: Any) -> str:
    """The text ``template`` renders for ``messages`` (dicts with 'role' and 'content'),
    as Hugging Face's ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``: the template sees ``messages``,
    ``add_generation_prompt`` and the checkpoint's special tokens (``bos_token``,
    ``eos_token``, ... as strings).

    Raises:
      ValueError: the template is not valid Jinja, or fails on these messages (e.g. its
        own ``raise_exception``), naming why.
    """
    try:
        return compile_chat_template(template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt,
            **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template fails on these messages: "
                         f"{type(e).__name__}: {e}") from None


_SLOT = "\ue000kvjax-message-{}\ue001"  # private-use code points: never in a template


def chat_segments(template: str, messages: Sequence[dict], add_generation_prompt: bool = True,
                  **special_tokens: Any) -> list[tuple[str, bool]]:
    """The rendered conversation cut into (text, is_content) pieces: the template's own
    scaffolding (is_content False: its text may name control tokens) and each message's
    content (True: the user's text, to be tokenized as plain text).

    The template is rendered once with each content replaced by a placeholder, which
    locates the contents, and once with the messages themselves; the pieces must join
    to that rendering (a template that strips each content, as Llama 3's ``| trim``,
    is recognised).

    Raises:
      ValueError: the template fails on the messages, drops or repeats a content, or
        changes one in a way other than stripping its ends (the message says so).
    """
    msgs = [dict(m) for m in messages]
    full = render_chat_template(template, msgs, add_generation_prompt, **special_tokens)
    slots = [dict(m, content=_SLOT.format(i)) for i, m in enumerate(msgs)]
    marked = render_chat_template(template, slots, add_generation_prompt, **special_tokens)
    pattern = re.compile("\ue000kvjax-message-(\\d+)\ue001")
    found = [int(m.group(1)) for m in pattern.finditer(marked)]
    if sorted(found) != list(range(len(msgs))):
        raise ValueError(f"the chat template renders message contents {found} of "
                         f"{len(msgs)}; kvjax needs each message's content once, to "
                         "tokenize it as plain text")
    scaffold = pattern.split(marked)[0::2]
    for strip in (False, True):
        contents = [str(msgs[i]["content"]) for i in found]
        if strip:
            contents = [c.strip() for c in contents]
        pieces = [(scaffold[0], False)]
        for c, text in zip(contents, scaffold[1:]):
            pieces += [(c, True), (text, False)]
        if "".join(p for p, _ in pieces) == full:
            return [p for p in pieces if p[0]]
    raise ValueError("the chat template changes message contents (beyond stripping "
                     "their ends); kvjax cannot tell the user's text from the template's")


class Tokenizer:
    """A thin wrapper over an HF ``tokenizers.Tokenizer`` built from GGUF metadata.

    Attributes:
      hf: the underlying ``tokenizers.Tokenizer``.
      bos_token_id, eos_token_id: ints (SmolLM2: 1 ``<|im_start|>``, 2 ``<|im_end|>``).
      vocab_size: number of ids (SmolLM2: 49152).
      special_token_ids: frozenset of the control-token ids.
      chat_template: the checkpoint's Jinja chat template string (GGUF
        ``tokenizer.chat_template``, HF ``tokenizer_config.json``), or None.
      template_tokens: the special tokens the template sees, name -> text
        (``bos_token``, ``eos_token``, ...; default: those of bos/eos ids).
      eos_token_ids: tuple of every end-of-generation id, sorted (default
        ``(eos_token_id,)``; from a GGUF, :func:`kvjax.checkpoints.gguf_reader.
        end_of_generation_ids`; SmolLM2: (0, 2), ``<|endoftext|>`` and ``<|im_end|>``):
        decoding stops at any of them.
      add_bos_token: a raw prompt (no chat template) starts with BOS, as the
        checkpoint's tokenizer does (HF ``add_bos_token``; False for SmolLM2).
    """

    def __init__(self, hf: HFTokenizer, bos_token_id: int, eos_token_id: int,
                 special_token_ids: Sequence[int] = (), chat_template: str | None = None,
                 template_tokens: dict | None = None,
                 eos_token_ids: Sequence[int] | None = None, add_bos_token: bool = False):
        self.hf = hf
        self.add_bos_token = bool(add_bos_token)
        self.bos_token_id = int(bos_token_id)
        self.eos_token_id = int(eos_token_id)
        self.eos_token_ids = tuple(sorted({int(i) for i in (
            (self.eos_token_id,) if eos_token_ids is None else eos_token_ids)}))
        self.special_token_ids = frozenset(int(i) for i in special_token_ids)
        self.chat_template = chat_template
        if template_tokens is None:
            template_tokens = {"bos_token": hf.id_to_token(self.bos_token_id),
                               "eos_token": hf.id_to_token(self.eos_token_id)}
        self.template_tokens = {k: v for k, v in template_tokens.items() if v is not None}
        # the same tokenizer with its special tokens' text read as plain text
        self._plain = HFTokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True
        self._special_added = frozenset(
            int(i) for i, t in hf.get_added_tokens_decoder().items() if t.special)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = False) -> list[int]:
        """Token ids of ``text``, no BOS/EOS added.

        Args:
          text: the string.
          special: False (default): plain text, as user text, prompts and corpora must be
            read: a literal ``<|im_end|>`` is its characters' tokens, never the control
            token. True: the text of each special token maps to its one id (for a chat
            template's own scaffolding; :meth:`chat_ids`).
        """
        hf = self.hf if special else self._plain
        return hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (plain text), in one call of the HF tokenizer."""
        return [e.ids for e in self._plain.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (any int sequence or 1-D integer array).

        Special tokens are kept unless ``skip_special_tokens``, so
        ``decode(encode(s)) == s``.
        """
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` stands for (a special token: its text, UTF-8)."""
        i = int(token_id)
        return utf8.token_bytes(self.hf.id_to_token(i), i in self.special_token_ids)

    def decode_complete(self, ids: Sequence[int], skip_special_tokens: bool = False
                        ) -> tuple[str, int]:
        """(text, held_back_bytes): :meth:`decode` of ``ids`` without the bytes at the end
        that begin a character not yet complete (a generation cut by its budget inside
        an emoji or a CJK character), so the text never ends in U+FFFD for a character
        the next token would finish. ``held_back_bytes`` counts them (0..3; 0: the text
        is ``decode(ids)``)."""
        ids = [int(i) for i in ids]
        kept = [i for i in ids if not (skip_special_tokens and i in self.special_token_ids)]
        data = b"".join(self.token_bytes(i) for i in kept[-4:])
        held = utf8.incomplete_tail(data)
        if not held:
            return self.decode(ids, skip_special_tokens), 0
        data = b"".join(self.token_bytes(i) for i in kept)
        return data[:-held].decode("utf-8", errors="replace"), held

    @functools.cached_property
    def character_starts(self) -> np.ndarray:
        """[V] bool: whether token i's bytes start on a character (their first byte is
        not a UTF-8 continuation byte; special tokens and empty tokens do). In a token
        stream of valid UTF-8 text, a cut before token i is on a character boundary
        exactly when ``character_starts[i]``."""
        return np.array([utf8.starts_character(self.token_bytes(i))
                         for i in range(self.vocab_size)], bool)

    def id_to_token(self, token_id: int) -> str | None:
        """The (byte-level) token string of an id."""
        return self.hf.id_to_token(int(token_id))

    def apply_chat_template(self, user_message: str, system_message: str = DEFAULT_SYSTEM_PROMPT) -> str:
        """SmolLM2's ChatML prompt for one user turn, ending where the assistant's reply begins.

        Returns:
          ``"<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{msg}<|im_end|>\\n"
          "<|im_start|>assistant\\n"``.
        """
        return (
            f"<|im_start|>system\n{system_message}<|im_end|>\n"
            f"<|im_start|>user\n{user_message}<|im_end|>\n"
            "<|im_start|>assistant\n"
        )

    def chat_messages(self, user_message: str, system_message: str | None = None) -> list:
        """The conversation of one user turn: ``[{'role': 'system', ...}]`` when
        ``system_message`` is not None, then ``{'role': 'user', 'content': user_message}``
        (None: the template's own default system turn, if it inserts one)."""
        turns = [] if system_message is None else [dict(role="system", content=system_message)]
        return turns + [dict(role="user", content=user_message)]

    def _template(self) -> str:
        if not self.chat_template:
            raise ValueError("the checkpoint carries no chat template (GGUF "
                             "tokenizer.chat_template / tokenizer_config.json chat_template)")
        return self.chat_template

    def chat_prompt(self, user_message: str, system_message: str | None = None) -> str:
        """The prompt the checkpoint's own chat template renders for one user turn, with
        the generation prompt (the assistant's turn opened), as Hugging Face's
        ``apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``
        (:func:`render_chat_template`, jinja2's sandbox).

        Args:
          user_message: the user's turn.
          system_message: a system turn; None: none given (the template inserts its own
            default, as SmolLM2's does, or none).
        Returns:
          the prompt text. Tokenize it with :meth:`chat_ids`, not :meth:`encode`: only
          the template's scaffolding may yield control tokens.
        Raises:
          ValueError: the checkpoint has no chat template, or it fails to render.
        """
        return render_chat_template(self._template(),
                                    self.chat_messages(user_message, system_message),
                                    True, **self.template_tokens)

    def chat_ids(self, user_message: str, system_message: str | None = None
                 ) -> tuple[str, list[int]]:
        """(:meth:`chat_prompt`'s text, its token ids): the checkpoint tokenizer's
        encoding of the rendered prompt (:meth:`encode_chat`), except that text a user
        types (``<|im_end|>``) is never a control token: only the template's scaffolding
        yields control ids (:func:`chat_segments` locates the contents).

        Raises:
          ValueError: as :meth:`chat_prompt`, or a template whose contents cannot be
            located (:func:`chat_segments`).
        """
        pieces = chat_segments(self._template(),
                               self.chat_messages(user_message, system_message), True,
                               **self.template_tokens)
        return "".join(p for p, _ in pieces), self.encode_chat(pieces)

    def encode_chat(self, pieces: Sequence[tuple[str, bool]]) -> list[int]:
        """Token ids of a rendered conversation cut into (text, is_content) pieces
        (:func:`chat_segments`): the checkpoint tokenizer's own encoding of the whole
        text (Hugging Face's ``apply_chat_template(tokenize=True)``: one ``encode``, so a
        Metaspace ``prepend_scheme='first'`` or ``Prepend`` normalizer adds its word
        boundary where the checkpoint does, not at every piece), unless a special token
        would come from a content's text: then the text between the scaffolding's special
        tokens is encoded with special tokens read as plain text, each stretch as the
        tokenizer encodes text that follows a special token (a non-special sentinel
        token before it, dropped), so user text never yields a control id.
        """
        text = "".join(t for t, _ in pieces)
        spans, at = [], 0
        for t, is_content in pieces:
            if is_content:
                spans.append((at, at + len(t)))
            at += len(t)
        enc = self.hf.encode(text, add_special_tokens=False)

        def in_content(a: int, b: int) -> bool:
            return any(a < e and s < b for s, e in spans)

        marks = [(i, o) for i, o in zip(enc.ids, enc.offsets) if i in self._special_added]
        if not any(in_content(*o) for _, o in marks):
            return list(enc.ids)
        ids: list[int] = []
        at = 0
        for i, (a, b) in [m for m in marks if not in_content(*m[1])] + [(None, (len(text),) * 2)]:
            if a > at:  # the text between two of the scaffolding's special tokens
                ids += self._encode_after(text[at:a], first=at == 0)
            if i is not None:
                ids.append(i)
            at = b
        return ids

    _SENTINEL = "\ue000kvjax-sentinel\ue001"  # private-use code points: never in a prompt

    @functools.cached_property
    def _after_special(self) -> tuple[HFTokenizer, int]:
        """(the plain-text tokenizer with a non-special sentinel token added, its id)."""
        hf = HFTokenizer.from_str(self._plain.to_str())
        hf.encode_special_tokens = True
        hf.add_tokens([AddedToken(self._SENTINEL, special=False, normalized=False)])
        return hf, hf.token_to_id(self._SENTINEL)

    def _encode_after(self, text: str, first: bool) -> list[int]:
        """Plain-text ids of ``text`` as the tokenizer encodes a stretch at the start of
        the input (``first``) or after a special token."""
        if first:
            return self._plain.encode(text, add_special_tokens=False).ids
        hf, sentinel = self._after_special
        return [i for i in hf.encode(self._SENTINEL + text, add_special_tokens=False).ids
                if i != sentinel]

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id})")


# The split regexes of the pre-tokenizers, as the models' own tokenizer.json states them
# (Hugging Face ``Split(Regex(...), behavior='isolated')`` before ``ByteLevel(use_regex=
# False)``); llama.cpp's src/llama-vocab.cpp spells the same splits without ``(?i:)``.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])


_DIALECTS = {
    # (normalizer, pre-tokenizer, BPE ignore_merges) of each model's tokenizer.json
    # SmolLM2: single digits, then GPT-2's regex inside ByteLevel
    "smollm": lambda: (None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False),
    # Llama 3: its regex (digits in runs of 1-3); a word in the vocabulary is one token
    "llama3": lambda: (None, _split_then_bytes(LLAMA3_SPLIT), True),
    # Qwen2: NFC, then Llama 3's regex with single digits (transformers' Qwen2Converter)
    "qwen2": lambda: (normalizers.NFC(), _split_then_bytes(QWEN2_SPLIT), False),
}


def tokenizer_from_fields(fields: dict, source: Any = "GGUF") -> Tokenizer:
    """Builds a :class:`Tokenizer` from GGUF ``tokenizer.*`` metadata (see :func:`load_tokenizer`).

    Raises:
      WeightsError: the metadata is not a GPT-2 byte-level BPE or lacks tokens/merges,
        or ``tokenizer.ggml.pre`` is missing or unknown
        (:func:`kvjax.checkpoints.gguf_reader.pre_tokenizer_dialect`).
    """
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    merges = fields.get("tokenizer.ggml.merges")
    if model != "gpt2" or not tokens or not merges:
        raise WeightsError(
            f"{source}: expected a GPT-2 byte-level BPE tokenizer (tokenizer.ggml.model='gpt2' with "
            f"tokens and merges), found model={model!r}, {len(tokens or [])} tokens, {len(merges or [])} merges"
        )
    token_types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise WeightsError(f"{source}: malformed BPE merge {m!r}")
        pairs.append((a, b))

    dialect = pre_tokenizer_dialect(fields, source)
    normalizer, pre, ignore_merges = _DIALECTS[dialect]()
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
                                ignore_merges=ignore_merges))
    if normalizer is not None:
        hf.normalizer = normalizer
    hf.pre_tokenizer = pre
    hf.decoder = decoders.ByteLevel()
    eog = end_of_generation_ids(fields)
    # an end-of-generation token is a control token even where the file types it NORMAL
    # (llama.cpp overrides its type the same way)
    special = sorted({i for i, t in enumerate(token_types) if int(t) == TOKEN_TYPE_CONTROL}
                     | set(eog))
    user = [i for i, t in enumerate(token_types) if int(t) == TOKEN_TYPE_USER_DEFINED]
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    if user:
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    if hf.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise WeightsError(f"{source}: tokenizer has {hf.get_vocab_size(True)} ids, expected {len(tokens)}")
    bos, eos = resolve_special_token_ids(fields)
    return Tokenizer(hf, bos, eos, special, fields.get("tokenizer.chat_template"),
                     eos_token_ids=eog)


def load_tokenizer(path_or_reader: str | os.PathLike | gguf.GGUFReader | LlamaGGUF) -> Tokenizer:
    """The (GPT-2 byte-level BPE) tokenizer stored in a GGUF file, in the pre-tokenizer
    dialect its ``tokenizer.ggml.pre`` names.

    Args:
      path_or_reader: a ``.gguf`` path, an open ``gguf.GGUFReader``, or a
        :class:`LlamaGGUF` from ``read_llama_gguf`` (reuses its metadata; no
        re-read). Reading a path costs ~2 s (gguf parses the vocabulary).

    Returns:
      Tokenizer; ``encode`` adds no BOS, digits split one per token, control
      tokens (``<|im_start|>``, ``<|im_end|>``, ...) encode to single ids with
      ``special=True`` only (plain text by default);
      ``eos_token_id`` is ``<|im_end|>`` for ChatML models (see
      ``resolve_special_token_ids``); ``eos_token_ids`` every end-of-generation id.

    Raises:
      WeightsError: the file is missing, unreadable, truncated or corrupt, or
        holds no GPT-2 BPE tokenizer, or names a pre-tokenizer kvjax does not build
        (naming it and the allowed ones).
    """
    if isinstance(path_or_reader, LlamaGGUF):
        fields = path_or_reader.tokenizer_fields or read_tokenizer_fields(path_or_reader.path)
        source = path_or_reader.path
    elif isinstance(path_or_reader, gguf.GGUFReader):
        fields = _tokenizer_fields(path_or_reader)
        source = getattr(path_or_reader.data, "filename", "GGUF")
    else:
        source = pathlib.Path(path_or_reader)
        fields = read_tokenizer_fields(source)
    return tokenizer_from_fields(fields, source)
