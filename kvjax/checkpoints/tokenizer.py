"""The SmolLM2 tokenizer, rebuilt from a GGUF file's vocabulary and merges.

GGUF carries a GPT-2-style byte-level BPE (``tokenizer.ggml.model == 'gpt2'``):
the tokens (byte-level unicode strings), the merges (``"a b"`` strings, by
priority) and a type per token (3 = CONTROL, i.e. special). From these an HF
``tokenizers.Tokenizer`` is built the way SmolLM2's ``tokenizer.json`` is:
no normaliser, pre-tokeniser ``Sequence([Digits(individual_digits=True),
ByteLevel(add_prefix_space=False, use_regex=True)])``, ByteLevel decoder, no
BOS/EOS added by ``encode``, control tokens registered as special tokens.
"""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any, Sequence

import gguf
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from kvjax.checkpoints.fetch import WeightsError
from kvjax.checkpoints.gguf_reader import (
    LlamaGGUF,
    _tokenizer_fields,
    read_tokenizer_fields,
    resolve_special_token_ids,
)

TOKEN_TYPE_CONTROL = int(gguf.TokenType.CONTROL)  # 3
TOKEN_TYPE_USER_DEFINED = int(gguf.TokenType.USER_DEFINED)  # 4

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_CHATML_TURN = "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'"
_CHATML_DEFAULT_SYSTEM = re.compile(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.S)


def chatml_default_system(template: str) -> str | None:
    """The system prompt a ChatML template inserts when no system message is given
    (SmolLM2: :data:`DEFAULT_SYSTEM_PROMPT`), or None if it inserts none."""
    m = _CHATML_DEFAULT_SYSTEM.search(template)
    return m.group(1) if m else None


def is_chatml(template: str | None) -> bool:
    """Whether a GGUF chat template is ChatML (turns ``<|im_start|>{role}\\n{content}
    <|im_end|>\\n``, reply opened by ``<|im_start|>assistant\\n``), the family
    :meth:`Tokenizer.chat_prompt` renders."""
    return bool(template) and _CHATML_TURN in template.replace('"', "'") and \
        "'<|im_start|>assistant\n'" in template


class Tokenizer:
    """A thin wrapper over an HF ``tokenizers.Tokenizer`` built from GGUF metadata.

    Attributes:
      hf: the underlying ``tokenizers.Tokenizer``.
      bos_token_id, eos_token_id: ints (SmolLM2: 1 ``<|im_start|>``, 2 ``<|im_end|>``).
      vocab_size: number of ids (SmolLM2: 49152).
      special_token_ids: frozenset of the control-token ids.
      chat_template: the GGUF's Jinja chat template string (informational).
    """

    def __init__(self, hf: HFTokenizer, bos_token_id: int, eos_token_id: int,
                 special_token_ids: Sequence[int] = (), chat_template: str | None = None):
        self.hf = hf
        self.bos_token_id = int(bos_token_id)
        self.eos_token_id = int(eos_token_id)
        self.special_token_ids = frozenset(int(i) for i in special_token_ids)
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including special tokens)."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS/EOS added; ``<|im_start|>`` etc. map to one id each)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (any int sequence or 1-D integer array).

        Special tokens are kept unless ``skip_special_tokens``, so
        ``decode(encode(s)) == s``.
        """
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

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

    def chat_prompt(self, user_message: str, system_message: str | None = None) -> str:
        """The prompt the checkpoint's own chat template (``tokenizer.chat_template``)
        renders for one user turn, with the generation prompt (the assistant's turn
        opened), as Hugging Face's ``apply_chat_template(..., add_generation_prompt=True)``.

        Args:
          user_message: the user's turn.
          system_message: a system turn; None uses the template's default (ChatML
            templates that insert one when the conversation has no system turn, as
            SmolLM2's does), or none.
        Returns:
          the prompt text (special tokens as text; ``encode`` maps each to one id).
        Raises:
          ValueError: the checkpoint has no chat template, or one that is not ChatML
            (the only family rendered here; tested against Jinja rendering).
        """
        t = self.chat_template
        if not t:
            raise ValueError("the checkpoint carries no chat template (tokenizer.chat_template)")
        if not is_chatml(t):
            raise ValueError("the checkpoint's chat template is not ChatML; only ChatML "
                             f"templates are rendered (template starts {t[:80]!r})")
        if system_message is None:
            system_message = chatml_default_system(t)
        turns = [] if system_message is None else [("system", system_message)]
        turns.append(("user", user_message))
        return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + \
            "<|im_start|>assistant\n"

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_id={self.eos_token_id})")


def tokenizer_from_fields(fields: dict, source: Any = "GGUF") -> Tokenizer:
    """Builds a :class:`Tokenizer` from GGUF ``tokenizer.*`` metadata (see :func:`load_tokenizer`).

    Raises:
      WeightsError: the metadata is not a GPT-2 byte-level BPE or lacks tokens/merges.
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

    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    hf.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(token_types) if int(t) == TOKEN_TYPE_CONTROL]
    user = [i for i, t in enumerate(token_types) if int(t) == TOKEN_TYPE_USER_DEFINED]
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    if user:
        hf.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    if hf.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise WeightsError(f"{source}: tokenizer has {hf.get_vocab_size(True)} ids, expected {len(tokens)}")
    bos, eos = resolve_special_token_ids(fields)
    return Tokenizer(hf, bos, eos, special, fields.get("tokenizer.chat_template"))


def load_tokenizer(path_or_reader: str | os.PathLike | gguf.GGUFReader | LlamaGGUF) -> Tokenizer:
    """The SmolLM2 (GPT-2 byte-level BPE) tokenizer stored in a GGUF file.

    Args:
      path_or_reader: a ``.gguf`` path, an open ``gguf.GGUFReader``, or a
        :class:`LlamaGGUF` from ``read_llama_gguf`` (reuses its metadata; no
        re-read). Reading a path costs ~2 s (gguf parses the vocabulary).

    Returns:
      Tokenizer; ``encode`` adds no BOS, digits split one per token, control
      tokens (``<|im_start|>``, ``<|im_end|>``, ...) encode to single ids;
      ``eos_token_id`` is ``<|im_end|>`` for ChatML models (see
      ``resolve_special_token_ids``).

    Raises:
      WeightsError: the file is missing, unreadable, truncated or corrupt, or
        holds no GPT-2 BPE tokenizer.
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
