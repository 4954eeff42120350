"""Bytes of byte-level BPE tokens and UTF-8 character boundaries between them.

A byte-level BPE token (GPT-2, SmolLM2, Llama 3, Qwen2) stands for bytes, not characters:
one CJK character or emoji is often split over two or three tokens. Text cut at a token
boundary can therefore end (or start) inside a character, and decoding it then shows
U+FFFD. The helpers here let a decoder hold back an incomplete character at the end
(:func:`incomplete_tail`) and a corpus cutter start a prompt on a character
(:func:`starts_character`).
"""

from __future__ import annotations

import codecs
import functools

__all__ = ["byte_decoder", "token_bytes", "incomplete_tail", "starts_character"]


@functools.lru_cache(maxsize=1)
def byte_decoder() -> dict:
    """GPT-2's printable-character -> byte table of byte-level BPE vocabularies
    (Radford et al. 2019, ``bytes_to_unicode`` in openai/gpt-2 ``encoder.py``): bytes
    ``!``..``~``, ``¡``..``¬``, ``®``..``ÿ`` stand for themselves, the other 68 for
    U+0100 onwards in order."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(token: str | None, special: bool = False) -> bytes:
    """The bytes a byte-level BPE token string stands for.

    Args:
      token: the token's string in the vocabulary (None: no such token, b'').
      special: a control/added token, whose string is its text (UTF-8 encoded).
    Returns:
      bytes; a string with a character outside GPT-2's byte alphabet (an added token
      such as ``<|im_end|>`` is inside it; e.g. a user-defined CJK token is not) is taken
      as text, UTF-8 encoded.
    """
    if not token:
        return b""
    table = byte_decoder()
    if special or any(ch not in table for ch in token):
        return token.encode("utf-8")
    return bytes(table[ch] for ch in token)


def incomplete_tail(data: bytes) -> int:
    """Bytes at the end of ``data`` (0..3) that begin a UTF-8 character not yet complete:
    a lead byte and the continuation bytes that follow it, as many as still allow a valid
    character (Python's incremental UTF-8 decoder keeps exactly these back). Invalid
    bytes are not held (a decoder replaces them whatever follows)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    dec.decode(bytes(data[-4:]) if len(data) > 4 else bytes(data), final=False)
    return len(dec.getstate()[0])


def starts_character(data: bytes) -> bool:
    """Whether ``data`` starts on a character boundary of valid UTF-8 text: empty, or its
    first byte is not a continuation byte (0x80..0xBF)."""
    return not data or not 0x80 <= data[0] <= 0xBF
