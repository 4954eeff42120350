"""What paging the KV cache buys: internal waste, the bytes a paged step reads, and how
many requests fit a memory budget under per-slot reservation, paging, and paging with a
shared prompt prefix.

Per-slot reservation (kvjax's dense slot engine, and the servers Kwon et al. 2023
measured, "Efficient Memory Management for Large Language Model Serving with
PagedAttention", sec. 2.3 and fig. 2) holds ``max_seq_len`` tokens per request whatever
it uses. A paged cache holds ceil(l / P)·P tokens for a request of l tokens with pages
of P tokens: the internal waste is P·ceil(l/P) - l, between 0 and P - 1 tokens per
sequence (sec. 4.2: "the waste is bounded within one block"). With a prefix of s tokens
shared by n requests, its floor(s / P) full pages are stored once (sec. 4.4, shared
prefix; page-granular, as vLLM's automatic prefix caching), saving (n - 1)·floor(s/P)·P
tokens.

A compressed row (lever 5, an evicting ``kv_compression``, schedule 'prefill') holds a
fixed W = kv_budget + recent_slots slots on W / P pages, taken on admission whatever its
length and never grown (decision 0041, :func:`kvjax.cache.paged.compressed_slots`): it
is sized by W, not by its length, and shares no prefix.

Units: tokens, bytes (per-token bytes from :func:`kvjax.analysis.theory.kv_bytes_per_token`,
every layer and cached tensor, quantization scales included).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from kvjax.analysis import theory
from kvjax.config import ModelConfig, check_paged_compression

__all__ = ["paged_tokens", "internal_waste", "shared_prefix_tokens", "row_slots",
           "row_tokens", "PagingCapacity", "capacity", "PagedStepBytes",
           "paged_step_bytes", "paged_step_read_bytes"]


def _check(page_size: int, lengths: Sequence[int]) -> list:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; allowed: an integer >= 1")
    lengths = [int(x) for x in lengths]
    bad = [x for x in lengths if x < 0]
    if bad:
        raise ValueError(f"a sequence length of {bad[0]} tokens; allowed: >= 0")
    return lengths


def paged_tokens(length: int, page_size: int) -> int:
    """Tokens a paged cache holds for a sequence of ``length`` tokens: P·ceil(length/P).

    Raises:
      ValueError: page_size below 1 or a negative length (named).
    """
    (length,) = _check(page_size, [length])
    return page_size * math.ceil(length / page_size)


def internal_waste(lengths: Sequence[int], page_size: int) -> int:
    """Unused slots of the sequences' last pages, summed: each is in [0, P - 1]
    (Kwon et al. 2023, sec. 4.2)."""
    lengths = _check(page_size, lengths)
    return sum(paged_tokens(x, page_size) - x for x in lengths)


def row_slots(cfg: ModelConfig, page_size: int) -> int:
    """W = kv_budget + recent_slots, the fixed slots of a compressed row on pages of
    ``page_size`` (an evicting ``cfg.kv_compression``), else 0 (rows grow by pages).

    Raises:
      ValueError: page_size below 1; kvjax.config.ConfigError (a ValueError) for a
        compression pages cannot hold (schedule 'every_n', per-layer budgets, W not
        whole pages: :func:`kvjax.config.check_paged_compression`), naming the value.
    """
    _check(page_size, [])
    if not cfg.kv_evicts:
        return 0
    check_paged_compression(cfg, page_size)
    return cfg.cache_window


def row_tokens(cfg: ModelConfig, length: int, page_size: int) -> int:
    """Tokens of pages one row of ``length`` tokens holds: :func:`paged_tokens`, or a
    compressed row's W whatever its length (:func:`row_slots`)."""
    (length,) = _check(page_size, [length])
    return row_slots(cfg, page_size) or paged_tokens(length, page_size)


def shared_prefix_tokens(prefix_len: int, page_size: int) -> int:
    """Tokens of a shared prefix stored once in a page-granular prefix cache: its full
    pages only, P·floor(prefix_len / P) (the partly filled page is each request's own)."""
    (prefix_len,) = _check(page_size, [prefix_len])
    return page_size * (prefix_len // page_size)


@dataclasses.dataclass(frozen=True)
class PagingCapacity:
    """Requests held at once in ``memory_bytes`` of KV cache, for sequences whose mean
    held tokens are those of ``lengths``.

    Attributes:
      bytes_per_token: KV bytes per token (all layers and tensors).
      budget_tokens: floor(memory_bytes / bytes_per_token).
      reserved: per-slot reservation, floor(budget_tokens / max_seq_len) (a compressed
        dense row holds W = kv_budget + recent_slots: floor(budget_tokens / W)).
      paged: floor(budget_tokens / mean paged tokens per request) (a compressed row's
        W whatever its length: floor(budget_tokens / W)).
      shared: with the prefix's full pages stored once: floor((budget_tokens - shared
        tokens) / mean of each request's own paged tokens) (compressed rows: ``paged``).
      waste_fraction: internal waste over paged tokens (mean over ``lengths``; a
        compressed row's slots no token fills, W - min(l, W)).
      reserved_live_fraction: mean length / max_seq_len, the live share of a reserved row
        (compressed: mean min(l, W) / W).
      row_slots: W, the fixed slots of a compressed row (:func:`row_slots`); 0 for rows
        that grow by pages.
    """

    bytes_per_token: float
    budget_tokens: int
    reserved: int
    paged: int
    shared: int
    waste_fraction: float
    reserved_live_fraction: float
    row_slots: int = 0


def capacity(cfg: ModelConfig, memory_bytes: float, lengths: Sequence[int],
             max_seq_len: int, page_size: int, prefix_len: int = 0) -> PagingCapacity:
    """Requests at once at a KV memory budget: reservation vs paging vs shared prefixes.

    Args:
      cfg: the model (bytes per token, :func:`kvjax.analysis.theory.kv_bytes_per_token`).
      memory_bytes: the KV cache's budget in bytes.
      lengths: tokens each request holds (a measured distribution: prompt + generated).
      max_seq_len: the row a per-slot reservation holds per request.
      page_size: P tokens per page.
      prefix_len: tokens every request's prompt starts with (a system turn).

    With compression (an evicting ``cfg.kv_compression``) every row is W = kv_budget +
    recent_slots slots on W / P pages whatever its length, as the paged engine admits it
    (:class:`kvjax.inference.engine.PagedRows`), and a dense row is W slots too.

    Raises:
      ValueError: page_size below 1, no lengths, a length above max_seq_len, a prefix
        longer than the shortest length, or a prefix with compression (its rows share no
        pages) (each named); kvjax.config.ConfigError for a compression pages cannot
        hold (:func:`row_slots`).
    """
    lengths = _check(page_size, lengths)
    if not lengths:
        raise ValueError("lengths=[]; allowed: the tokens of at least one request")
    if max(lengths) > max_seq_len:
        raise ValueError(f"a request of {max(lengths)} tokens; allowed: at most "
                         f"max_seq_len={max_seq_len}")
    if not 0 <= prefix_len <= min(lengths):
        raise ValueError(f"prefix_len={prefix_len}; allowed: 0..{min(lengths)} (the "
                         "shortest request)")
    w = row_slots(cfg, page_size)
    if w and prefix_len:
        raise ValueError(f"prefix_len={prefix_len} with model.kv_compression="
                         f"{cfg.kv_compression!r}; allowed: 0 (a compressed row's pages "
                         "hold its kept slots, shared with no other row)")
    per_token = theory.kv_bytes_per_token(cfg)
    budget = int(memory_bytes // per_token)
    if w:
        held = sum(min(x, w) for x in lengths) / len(lengths)
        return PagingCapacity(
            bytes_per_token=per_token, budget_tokens=budget, reserved=budget // w,
            paged=budget // w, shared=budget // w, waste_fraction=(w - held) / w,
            reserved_live_fraction=held / w, row_slots=w)
    mean_paged = sum(paged_tokens(x, page_size) for x in lengths) / len(lengths)
    shared = shared_prefix_tokens(prefix_len, page_size)
    own = mean_paged - shared
    return PagingCapacity(
        bytes_per_token=per_token, budget_tokens=budget, reserved=budget // max_seq_len,
        paged=int(budget // mean_paged),
        shared=int(max(budget - shared, 0) // own) if own > 0 else 0,
        waste_fraction=internal_waste(lengths, page_size) / (mean_paged * len(lengths)),
        reserved_live_fraction=sum(lengths) / len(lengths) / max_seq_len)


@dataclasses.dataclass(frozen=True)
class PagedStepBytes:
    """Bytes one decode step over paged rows moves (every layer), by what they are.

    Attributes:
      weights: the weights read once (:func:`kvjax.analysis.theory.weight_bytes_per_step`).
      pages: the rows' pages read: P·ceil(l/P) tokens per row in place (a compressed
        row's W, :func:`row_tokens`); every one of a row's M block-table entries for the
        gather (M·P tokens: missing pages read page 0, masked).
      tables: the block tables read, 4·M bytes per row and layer.
      view: the gather only: its dense view written and read again by attention,
        2·M·P tokens per row.
      kv_write: the new token's cache entries, one token per row.
    """

    weights: int
    pages: int
    tables: int
    view: int
    kv_write: int

    @property
    def kv_read(self) -> int:
        """pages + tables + view: what the attention side reads."""
        return self.pages + self.tables + self.view

    @property
    def total(self) -> int:
        return self.weights + self.kv_read + self.kv_write


def paged_step_bytes(cfg: ModelConfig, lengths: Sequence[int], page_size: int,
                     max_pages: int, formulation: str = "gather") -> PagedStepBytes:
    """:class:`PagedStepBytes` of one decode step over rows holding ``lengths`` tokens.

    'in_place': a kernel that reads the pages where they lie (vLLM's PagedAttention,
    Kwon et al. 2023, sec. 4.1; kvjax's native one). 'gather': the XLA formulation of
    :mod:`kvjax.cache.paged` (every row's M pages gathered into a dense view, which
    attention reads). The dense step's counterpart: :func:`kvjax.analysis.theory.step_bytes`
    (blog, "The Fundamental Equation of Inference Throughput"). A compressed row holds
    its W / P pages whatever its length (:func:`row_tokens`): past the budget its bytes
    are the dense compressed step's, :func:`kvjax.analysis.theory.step_bytes`.

    Raises:
      ValueError: an unknown formulation, page_size below 1, a negative length, or with
        compression max_pages other than W / P (named); kvjax.config.ConfigError for a
        compression pages cannot hold (:func:`row_slots`).
    """
    lengths = _check(page_size, lengths)
    if formulation not in ("in_place", "gather"):
        raise ValueError(f"formulation={formulation!r}; allowed: 'in_place' or 'gather'")
    w = row_slots(cfg, page_size)
    if w and max_pages * page_size != w:
        raise ValueError(f"max_pages={max_pages} with model.kv_compression="
                         f"{cfg.kv_compression!r}; allowed: {w // page_size} (a compressed "
                         f"row's kv_budget + recent_slots = {w} slots in pages of "
                         f"{page_size})")
    per_token = theory.kv_bytes_per_token(cfg)
    rows = len(lengths)
    if formulation == "in_place":
        pages = sum(row_tokens(cfg, x, page_size) for x in lengths) * per_token
        view = 0
    else:
        pages = max_pages * page_size * rows * per_token
        view = 2 * pages
    return PagedStepBytes(weights=theory.weight_bytes_per_step(cfg), pages=int(pages),
                          tables=4 * max_pages * rows * cfg.num_layers, view=int(view),
                          kv_write=rows * per_token)


def paged_step_read_bytes(cfg: ModelConfig, lengths: Sequence[int], page_size: int,
                          max_pages: int, formulation: str = "gather") -> int:
    """KV bytes one decode step reads over a batch of paged rows (every layer): the
    ``kv_read`` of :func:`paged_step_bytes`.

    'in_place' (a kernel that reads the pages where they lie, as vLLM's): each row's
    pages, P·ceil(l/P) tokens, plus its block table (4·max_pages bytes per layer).
    'gather' (the XLA formulation of :mod:`kvjax.cache.paged`): every row's max_pages
    pages are gathered into a dense view (read once, written once) and attention reads
    the view again: 3·max_pages·P tokens per row, plus the block table.

    Raises:
      ValueError: an unknown formulation, page_size below 1 or a negative length.
    """
    return paged_step_bytes(cfg, lengths, page_size, max_pages, formulation).kv_read
