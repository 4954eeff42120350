"""The slot engine on a paged KV cache: requests admitted when their pages fit, preempted
when the pool runs out, and (optionally) sharing the cached pages of common prompt
prefixes.

:class:`kvjax.inference.engine.Engine` reserves a row of ``max_seq_len`` slots per
request. :class:`PagedEngine` holds one pool of ``num_pages`` pages of ``page_size``
tokens per layer and tensor (:mod:`kvjax.cache.paged`) and up to ``max_rows`` rows of
block tables; a row takes pages as its request grows (vLLM, Kwon et al. 2023, sec. 4.3):

* **Admission** (first come, first served): the request at the head of the queue starts
  when a row is free and the pages of its prompt and its first decoded token fit; with ``prefix_cache`` its prompt's full pages already
  cached are referenced, not prefilled (the prefill starts after them).
* **Growth**: before each decode block every running row takes the pages of its next
  ``steps_per_sync`` tokens (copy on write of a shared page first); with speculative
  decoding (``speculative``: n-gram drafts, or a draft model whose own dense cache rows
  sit beside the block-table rows) the block is ``steps_per_sync`` verify rounds
  and a row takes the pages of up to ``steps_per_sync`` x (k + 1) tokens. A rejected
  draft is taken back by the row's length alone
  (:func:`kvjax.inference.speculative.take_back`): its key stays unseen in the row's
  page until a later token overwrites it.
* **Preemption** (recompute, vLLM's default): when the pool runs out the newest running
  request is stopped, its pages released (their full pages stay cached with
  ``prefix_cache``) and it goes back to the head of the queue with its tokens kept; when
  readmitted its prompt and generated tokens are prefilled again and it goes on
  sampling from there (its sampling keys continue: token j uses fold_in(request key, j)).

The prefill is one row at a time into the shared pools (padded to a power-of-two bucket
of the tokens not cached); the decode loop (the slot engine's
:func:`kvjax.inference.engine.decode_steps_program`, on pages) runs every
row for up to ``steps_per_sync`` steps and returns early when a row finishes, so its
pages go back to the pool at once (pages a finished row held to the block's end would
be allocated bytes nothing reads). Host-side bookkeeping
(:class:`kvjax.cache.paged.PageAllocator`) never traces.

Times are as :mod:`kvjax.inference.engine` (every request arrives at 0).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.cache import paged
from kvjax.cache.policy import written_tokens
from kvjax.config import ConfigError, ModelConfig, SamplingConfig, SpeculativeConfig
from kvjax.inference import ragged
from kvjax.inference import speculative as spec_lib
from kvjax.inference.engine import (Completion, EngineStats, Ledger, Request,
                                    decode_steps_program, insert_program, prefill_bucket)
from kvjax.inference.sampling import NONFINITE, check_request_id, request_key, request_keys
from kvjax.models import model as model_lib

__all__ = ["PagedEngine", "PagedStats", "paged_prefill_program",
           "copy_pages_program"]


@dataclasses.dataclass
class PagedStats(EngineStats):
    """:class:`EngineStats` of a paged run, plus: ``preemptions``; prompt tokens looked up
    and found in the prefix cache (``prompt_tokens``, ``prefix_hit_tokens``: prefill
    tokens saved); tokens prefilled (``prefill_tokens``, recomputation after preemption
    included); referenced-page bytes summed over decode steps
    (``page_kv_byte_steps``: every page the allocator holds for running rows; a block
    ends at the step a row stops, which frees its pages); the bytes of the pages of the
    rows still running, step by step (``active_page_kv_byte_steps``: what the
    rows' own lengths and the block's look-ahead take, without the rows that stopped);
    the most rows running at once (``max_running``; rows running summed over steps are
    ``occupied_slot_steps``); the most
    pages one row held (``max_row_pages``: constant in the row's length for a window,
    whose pages that slide out are freed); the pool's bytes (``allocated_kv_bytes``) and
    page size."""

    preemptions: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    page_kv_byte_steps: float = 0.0
    active_page_kv_byte_steps: float = 0.0
    max_running: int = 0
    page_size: int = 0
    max_row_pages: int = 0  # the most pages one running row held at a decode block

    @property
    def prefix_hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from cached pages."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_page_kv_bytes(self) -> float:
        """Mean bytes of the pages rows reference, per decode step."""
        return self.page_kv_byte_steps / self.steps if self.steps else 0.0

    @property
    def mean_active_page_kv_bytes(self) -> float:
        """Mean bytes of the pages of the rows still running, per decode step."""
        return self.active_page_kv_byte_steps / self.steps if self.steps else 0.0

    @property
    def mean_running(self) -> float:
        """Mean rows running per decode step."""
        return self.occupied_slot_steps / self.steps if self.steps else 0.0


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_pages_program(cache, src, dst):
    """:func:`kvjax.cache.paged.copy_pages` compiled, the pools donated."""
    return paged.copy_pages(cache, src, dst)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "fresh"),
                   donate_argnames=("cache",))
def paged_prefill_program(params, cache, tokens, num_valid, key, count, *, cfg, sampling,
                          fresh):
    """One row's prompt (or the part not cached) written into its pages.

    Args:
      cache: a one-row :class:`~kvjax.cache.paged.PagedKVCache` over the shared pools
        (donated), length = tokens already held (cached prefix).
      tokens: [1, T] int32 right-padded; num_valid: [1] int32 real tokens.
      key: the request's key; count: [] int32 index of the token to sample.
      fresh: (static) the row holds no token yet (no page is read).
    Returns:
      (token [1] int32 sampled from the last real token's logits, cache).
    """
    pos = cache.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, cache = model_lib.forward(params, cfg, tokens, pos, cache, num_valid=num_valid,
                                      fresh=fresh, last_only=True)
    return ragged.sample_rows(logits[:, 0], key[None], count[None], sampling), cache


@dataclasses.dataclass
class _Running:
    req: Request
    order: int          # admission counter: the largest is the newest
    final: int          # tokens the request writes in all (written_tokens)


class PagedEngine:
    """Serves requests through ``max_rows`` rows of block tables over one page pool.

    Args:
      params: parameters in cfg's layout.
      cfg: the model.
      max_rows: rows of block tables, the most requests running at once (>= 1).
      max_seq_len: the longest request in tokens (prompt + max_new_tokens - 1); a row's
        block table has ceil(max_seq_len / page_size) entries.
      page_size: tokens per page (>= 1).
      num_pages: pages in the pool (per layer and tensor); at least one request of
        ``max_seq_len`` tokens must fit, so the oldest request can always finish.
      sampling, eos_ids, steps_per_sync, seed: as :class:`kvjax.inference.engine.Engine`
        (``eos_ids``: one id or several; empty or -1: stop at budgets only).
      prefix_cache: reuse cached full pages of common prompt prefixes.
      speculative: as :class:`kvjax.inference.engine.Engine`'s: a SpeculativeConfig,
        each block ``steps_per_sync`` verify rounds
        (:func:`kvjax.inference.speculative.engine_rounds_program`) over the pages. With
        drafter 'self' or 'model' the draft model's cache is dense, one row per block-
        table row (a window draft's ring of W + k + 1 slots is constant in the request's
        length; a 'model' draft's rows hold max_seq_len + k + 1), prefilled with a
        request's whole token list on admission (again after a preemption); it is not
        part of the page budget (``draft_cache_bytes``).
      draft: as :class:`kvjax.inference.engine.Engine`'s ((params, config) of drafter
        'model'; 'self' builds its own when None).
    Raises:
      ValueError: page_size below 1, a non-positive max_rows, max_seq_len, num_pages or
        steps_per_sync, a pool smaller than one request of max_seq_len tokens, or
        draft= without speculative= (each named with its value).
      ConfigError: a drafter the config cannot build
        (:func:`kvjax.inference.speculative.check_draft`), or a draft that copies the
        target's window (``draft_kv_source='target'``: rows on pages), before any work.
    """

    def __init__(self, params, cfg: ModelConfig, max_rows: int, max_seq_len: int,
                 page_size: int, num_pages: int, sampling: SamplingConfig = SamplingConfig(),
                 eos_ids: int | Iterable[int] = (), steps_per_sync: int = 8, seed: int = 0,
                 prefix_cache: bool = False, speculative: SpeculativeConfig | None = None,
                 draft: tuple | None = None):
        if isinstance(page_size, bool) or int(page_size) < 1:
            raise ValueError(f"page_size={page_size}; allowed: an integer >= 1 for the "
                             "paged engine (page_size 0 is the dense Engine)")
        for name, v in (("max_rows", max_rows), ("max_seq_len", max_seq_len),
                        ("num_pages", num_pages), ("steps_per_sync", steps_per_sync)):
            if int(v) < 1:
                raise ValueError(f"{name}={v}; allowed: an integer >= 1")
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        self.max_rows, self.max_seq_len = int(max_rows), int(max_seq_len)
        self.max_pages = paged.pages_for(self.max_seq_len, self.page_size)
        if self.num_pages < self.max_pages:
            raise ValueError(
                f"num_pages={num_pages} pages of {page_size} tokens hold "
                f"{self.num_pages * self.page_size} tokens, too few for one request of "
                f"max_seq_len={max_seq_len}; allowed: num_pages >= {self.max_pages}")
        self.view_len = self.max_pages * self.page_size
        if speculative is not None and not speculative.enabled:
            speculative = None
        if speculative is not None and speculative.drafter == "self" and draft is None:
            draft = spec_lib.self_draft(params, cfg, speculative)
        if speculative is not None:
            spec_lib.check_draft(cfg, None if draft is None else draft[1], speculative)
            if speculative.copies_target_window:
                raise ConfigError(
                    "speculative.draft_kv_source='target' with page_size="
                    f"{page_size}; allowed: 'own' on pages (the window copy reads dense "
                    "or ring rows only), or 'target' with page_size=0")
        elif draft is not None:
            raise ValueError("draft= without speculative=; allowed: a draft with a "
                             "SpeculativeConfig whose drafter is 'self' or 'model'")
        self.spec = speculative
        if cfg.plan is None:  # resolved on the host, for the step's paged classes
            verify = () if self.spec is None else (self.spec.k + 1,)
            cfg = planner.resolve(cfg, max_seq_len=self.view_len,
                                  batch_sizes=(self.max_rows,),
                                  page_size=self.page_size, queries=verify)
        self.params, self.cfg = params, cfg
        self._prefill_cfgs: dict[tuple, ModelConfig] = {}
        self.dparams = self.dcfg = self.draft_cache = None
        if draft is not None:  # the draft's plan and its dense rows, one per table row
            self.dparams, dcfg = draft
            k = self.spec.k
            self.dcfg = dcfg if dcfg.plan is not None else planner.resolve(
                dcfg, max_seq_len=self.max_seq_len + k + 1, batch_sizes=(self.max_rows,),
                rows=(2 * self.max_rows,))
            self.draft_cache = spec_lib.init_draft_cache(self.dcfg, self.max_rows,
                                                         self.max_seq_len, k)
        self.draft_cache_bytes = (0 if self.draft_cache is None
                                  else cache_lib.cache_bytes(self.draft_cache))
        self._pending = jnp.zeros(self.max_rows, jnp.int32)  # a draft model's next input
        self._has_pending = jnp.zeros(self.max_rows, bool)
        self._calls = 0
        ids = [eos_ids] if isinstance(eos_ids, (int, np.integer)) else list(eos_ids)
        self.eos_ids = frozenset(int(i) for i in ids if int(i) >= 0)
        self.sampling = sampling
        self.steps_per_sync, self.seed = int(steps_per_sync), int(seed)
        self.prefix_cache = bool(prefix_cache)
        self.cache = paged.init_paged_cache(cfg, self.max_rows, self.num_pages,
                                            self.page_size, self.max_pages)
        self.page_bytes = paged.page_bytes(cfg, self.page_size)
        self.bytes_per_token = self.page_bytes / self.page_size
        self.alloc = paged.PageAllocator(self.num_pages, self.page_size, self.prefix_cache)

    # ------------------------------------------------------------------ checks

    def check(self, req: Request) -> None:
        """Raises ValueError (naming the request) for an id < 0, an empty prompt, a budget
        < 1, or a request that writes more tokens than a row or the pool holds."""
        check_request_id(req.id)  # every id it accepts has its own key (issue 54)
        if not len(req.prompt):
            raise ValueError(f"request {req.id}: empty prompt; allowed: at least one token")
        if int(req.max_new_tokens) < 1:
            raise ValueError(f"request {req.id}: max_new_tokens={req.max_new_tokens}; "
                             "allowed: an integer >= 1")
        need = written_tokens(len(req.prompt), req.max_new_tokens)
        pages = paged.pages_for(need, self.page_size)
        if need > self.max_seq_len:
            raise ValueError(
                f"request {req.id} ({len(req.prompt)} prompt tokens + {req.max_new_tokens} "
                f"new) writes {need} tokens, more than max_seq_len={self.max_seq_len}; "
                f"allowed: at most {self.max_seq_len} (raise max_seq_len)")
        if pages > self.num_pages:
            raise ValueError(
                f"request {req.id} ({len(req.prompt)} prompt tokens + {req.max_new_tokens} "
                f"new) writes {need} tokens = {pages} pages of {self.page_size}, more than "
                f"the pool's num_pages={self.num_pages}; allowed: at most "
                f"{self.num_pages * self.page_size} tokens")

    # ------------------------------------------------------------------ units

    def _key(self, req_id: int) -> jax.Array:
        return request_key(jax.random.key(self.seed), req_id)

    def _prefill_cfg(self, bucket: int, draft: bool = False) -> ModelConfig:
        """The plan of a one-row prefill of ``bucket`` tokens (the draft model's with
        ``draft``), resolved once per bucket on the host."""
        if (bucket, draft) not in self._prefill_cfgs:
            cfg, slots = (self.dcfg, self.max_seq_len) if draft else (self.cfg, self.view_len)
            self._prefill_cfgs[bucket, draft] = planner.resolve(
                cfg.replace(plan=None), max_seq_len=slots, batch_sizes=(), rows=(bucket,))
        return self._prefill_cfgs[bucket, draft]

    def _row_table(self, row) -> np.ndarray:
        bt = np.full(self.max_pages, -1, np.int32)
        pages = self.alloc.block_table(row)
        bt[:len(pages)] = pages
        return bt

    def _prefill(self, row, tokens: Sequence[int], start: int, count: int, req_id: int):
        """Writes ``tokens[start:]`` into ``row``'s pages (the first ``start`` are cached)
        and returns the token sampled after them (key index ``count``)."""
        n = len(tokens) - start
        bucket = prefill_bucket(n)
        toks = np.zeros((1, bucket), np.int32)
        toks[0, :n] = tokens[start:]
        one = self.cache.replace(block_table=jnp.asarray(self._row_table(row)[None]),
                                 length=jnp.full((1,), start, jnp.int32))
        first, one = paged_prefill_program(
            self.params, one, jnp.asarray(toks), jnp.asarray([n], jnp.int32),
            self._key(req_id), jnp.int32(count), cfg=self._prefill_cfg(bucket),
            sampling=self.sampling, fresh=start == 0)
        self.cache = self.cache.replace(tensors=one.tensors)
        self.alloc.append(row, tokens[start:])
        return int(first[0])

    def _draft_prefill(self, row: int, tokens: Sequence[int]) -> None:
        """The draft model's row ``row``: ``tokens`` prefilled into a fresh one-row cache
        and put in place, with no pending draft input (as the slot engine's)."""
        bucket = prefill_bucket(len(tokens))
        toks, lengths = ragged.pad_prompts([list(tokens)], length=bucket)
        drow = spec_lib.init_draft_cache(self.dcfg, 1, self.max_seq_len, self.spec.k)
        _, drow = ragged.prefill_ragged_program(
            self.dparams, jnp.asarray(toks), jnp.asarray(lengths), drow,
            cfg=self._prefill_cfg(bucket, True))
        self.draft_cache = insert_program(self.draft_cache, drow, jnp.int32(row))
        self._pending = self._pending.at[row].set(0)
        self._has_pending = self._has_pending.at[row].set(False)

    def _copy(self, copies) -> None:
        if copies:
            src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies))
            self.cache = copy_pages_program(self.cache, src, dst)

    def warmup(self, requests: Sequence[Request]) -> float:
        """Compiles every prefill bucket ``requests`` can need (fresh, and with
        ``prefix_cache`` after a cached page) and the decode loop; leaves the pool empty.
        A request's prefill can be of any bucket up to its whole length: a prefix hit
        leaves fewer tokens, a preempted request is prefilled again with its generated
        tokens, so every bucket up to the longest request's is compiled. Returns the
        seconds spent."""
        t0 = time.perf_counter()
        if not requests:
            return 0.0
        most = max(written_tokens(len(r.prompt), r.max_new_tokens) for r in requests)
        top = prefill_bucket(min(most, self.view_len))
        buckets = [prefill_bucket(1)]  # prefill_bucket's powers of two, up to the longest request's
        while buckets[-1] < top:
            buckets.append(2 * buckets[-1])
        self.alloc = paged.PageAllocator(self.num_pages, self.page_size)  # no prefix hits
        p = self.page_size
        for b in buckets:
            n = min(b, self.view_len)  # the longest prefill of bucket b that fits a row
            self.alloc.admit("warmup", [0] * n, n)
            self._prefill("warmup", [0] * n, 0, 0, 0)
            self.alloc.release("warmup")
            n = min(b, self.view_len - p)
            if self.prefix_cache and n >= 1 and prefill_bucket(n) == b:  # after a hit
                self.alloc.admit("warmup", [0] * (n + p), n + p)
                self.alloc.append("warmup", [0] * p)
                self._prefill("warmup", [0] * (n + p), p, 0, 0)
                self.alloc.release("warmup")
            if self.dcfg is not None:  # a draft row is prefilled with the whole tokens
                self._draft_prefill(0, [0] * min(b, self.max_seq_len))
        b = self.max_rows
        zeros = jnp.zeros(b, jnp.int32)
        hist, hist_len = spec_lib.slot_history(self.spec, self.max_rows, self.max_seq_len)
        out = self._decode(zeros, jnp.zeros(b, bool), zeros, zeros,
                           request_keys(jax.random.key(self.seed), [0] * b),
                           jnp.asarray(False), hist, hist_len)
        self.cache = out[2]
        jax.block_until_ready(self.cache)
        self.alloc = paged.PageAllocator(self.num_pages, self.page_size, self.prefix_cache)
        return time.perf_counter() - t0

    def _decode(self, last, active, remaining, count, keys, stop_on_free, hist, hist_len):
        """One compiled block over the pages: plain steps or verify rounds, as
        :meth:`kvjax.inference.engine.Engine._decode` (the same 13 results)."""
        if self.spec is None:
            out = decode_steps_program(
                self.params, self.cache, last, active, remaining, count, keys,
                self._eos_array(), stop_on_free, cfg=self.cfg, sampling=self.sampling,
                steps=self.steps_per_sync)
            return out + (hist, hist_len, None, None)
        self._calls += 1
        rng = jax.random.fold_in(jax.random.key(self.seed), self._calls)
        out = spec_lib.engine_rounds_program(
            self.params, self.dparams, self.cache, self.draft_cache, last, active,
            remaining, count, keys, self._eos_array(), hist, hist_len, stop_on_free,
            self._pending, self._has_pending, rng, cfg=self.cfg, draft_cfg=self.dcfg,
            spec=self.spec, sampling=self.sampling, rounds=self.steps_per_sync)
        self.draft_cache, self._pending, self._has_pending, self._rounds = out[13:]
        return out[:13]

    def _eos_array(self) -> jax.Array:
        return jnp.asarray(sorted(self.eos_ids) or [-1], jnp.int32)

    def _stop(self, last: int) -> str:
        return "nonfinite" if last == NONFINITE else "eos" if last in self.eos_ids \
            else "budget"

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Sequence[Request],
            on_finish: Callable[[Completion], None] | None = None, warmup: bool = True):
        """Serves ``requests`` (each admitted from its ``arrival_s`` on, first come first
        served); returns (completions in request order, :class:`PagedStats`). Every
        request is checked (:meth:`check`) before any work.

        Raises:
          ValueError: a repeated request id, a bad arrival time
            (:class:`kvjax.inference.engine.Ledger`), or a request the pool cannot
            serve (:meth:`check`), before any work.
        """
        book = Ledger(requests, on_finish)
        for r in requests:
            self.check(r)
        if warmup:
            self.warmup(requests)
        self.alloc = paged.PageAllocator(self.num_pages, self.page_size, self.prefix_cache)
        alloc, nr, steps = self.alloc, self.max_rows, self.steps_per_sync
        rows: list = [None] * nr            # _Running or None
        gen = book.tokens                   # a preempted request keeps its tokens here
        last = np.zeros(nr, np.int32)
        active = np.zeros(nr, bool)
        remaining = np.zeros(nr, np.int32)
        count = np.zeros(nr, np.int32)
        keys = request_keys(jax.random.key(self.seed), [0] * nr)
        hist, hist_len = spec_lib.slot_history(self.spec, self.max_rows, self.max_seq_len)
        per_block = steps * (1 if self.spec is None else self.spec.k + 1)  # tokens at most
        stats = PagedStats(allocated_kv_bytes=self.num_pages * self.page_bytes,
                           num_slots=nr, page_size=self.page_size)
        queue = book.queue
        order = 0
        book.start = time.perf_counter()

        def preempt(slot):
            alloc.release(slot)
            queue.appendleft(rows[slot].req)
            rows[slot], active[slot] = None, False
            stats.preemptions += 1

        while queue or active.any():
            # admit, first come first served, while a row is free and the pages fit
            for slot in range(nr):
                if rows[slot] is not None or book.next_arrived() is None:
                    continue
                req = queue[0]
                have = gen.get(req.id, [])
                tokens = list(req.prompt) + have  # a preempted request: its tokens kept
                final = written_tokens(len(req.prompt), req.max_new_tokens)
                try:
                    hit = alloc.admit(slot, tokens, min(len(tokens) + 1, final))
                except paged.PoolExhausted:
                    break
                queue.popleft()
                stats.prompt_tokens += len(tokens)
                stats.prefix_hit_tokens += hit
                stats.prefill_tokens += len(tokens) - hit
                nxt = self._prefill(slot, tokens, hit, len(have), req.id)
                stats.prefills += 1
                book.emit(req.id, [nxt])
                if nxt in self.eos_ids or nxt == NONFINITE or \
                        len(gen[req.id]) >= req.max_new_tokens:
                    alloc.release(slot)
                    book.finish(req, self._stop(nxt), None if not have else slot)
                    continue
                if self.dcfg is not None:
                    self._draft_prefill(slot, tokens)
                rows[slot] = _Running(req, order, final)
                order += 1
                last[slot], active[slot] = nxt, True
                count[slot] = len(gen[req.id])
                remaining[slot] = req.max_new_tokens - count[slot]
                keys = keys.at[slot].set(self._key(req.id))
                if hist is not None:
                    hist, hist_len = spec_lib.put_slot_history(hist, hist_len, slot,
                                                               tokens + [nxt])
            if not active.any():
                book.wait_for_arrival()
                continue
            # every running row takes the pages of its next block, oldest first; when the
            # pool runs out the newest running request is preempted
            for slot in sorted(np.nonzero(active)[0], key=lambda s: rows[s].order):
                r = rows[slot]
                if r is not None and self.cfg.window_size:  # (None: preempted meanwhile)
                    # pages no query of the block sees are freed
                    alloc.drop_before(slot, alloc.length(slot) - self.cfg.window_size + 1,
                                      self.cfg.num_sink_tokens)
                while r is not None and r is rows[slot]:  # None: preempted meanwhile
                    try:
                        need = min(alloc.length(slot) + per_block, r.final)
                        self._copy(alloc.ensure(slot, need))
                        break
                    except paged.PoolExhausted:
                        victim = max(np.nonzero(active)[0], key=lambda s: rows[s].order)
                        preempt(victim)
            running = np.nonzero(active)[0]
            bt = np.full((nr, self.max_pages), -1, np.int32)
            lengths = np.zeros(nr, np.int32)
            for slot in running:
                bt[slot] = self._row_table(slot)
                lengths[slot] = alloc.length(slot)
                stats.max_row_pages = max(stats.max_row_pages, int((bt[slot] >= 0).sum()))
            self.cache = self.cache.replace(block_table=jnp.asarray(bt),
                                            length=jnp.asarray(lengths))
            ref_pages = alloc.num_referenced
            t0 = time.perf_counter()
            out = self._decode(jnp.asarray(last), jnp.asarray(active),
                               jnp.asarray(remaining), jnp.asarray(count), keys,
                               jnp.asarray(True), hist, hist_len)
            (buf, n, self.cache, last_d, active_d, rem_d, count_d, occ, held, hist,
             hist_len, acc, prop) = out
            buf = np.asarray(buf)
            if acc is not None:
                stats.accepted += int(np.sum(acc))
                stats.proposed += int(np.sum(prop))
            stats.decode_s += time.perf_counter() - t0
            n = int(n)
            stats.steps += n
            # rows running and the tokens their queries saw, step by step (a row grows
            # inside a block and may stop before it ends; its pages were taken before)
            stats.occupied_slot_steps += int(occ)
            stats.max_running = max(stats.max_running, len(running))
            stats.live_kv_byte_steps += int(held) * self.bytes_per_token
            stats.page_kv_byte_steps += n * ref_pages * self.page_bytes
            emitted = (buf >= 0) | (buf == NONFINITE)  # [rows, tokens] in order
            # steps (verify rounds) each row ran: a plain step emits one token
            ran = emitted.sum(axis=1) if self.spec is None else np.asarray(self._rounds)
            stats.active_page_kv_byte_steps += self.page_bytes * sum(
                len(set().union(*(bt[s][bt[s] >= 0] for s in running if ran[s] > i)))
                for i in range(n))
            new_active = np.asarray(active_d)
            for slot in running:
                r = rows[slot]
                made = [int(t) for t in buf[slot][emitted[slot]]]  # its tokens in order
                alloc.append(slot, ([int(last[slot])] + made)[:len(made)])  # the inputs
                book.emit(r.req.id, made)
                if not new_active[slot]:
                    alloc.release(slot)
                    book.finish(r.req, self._stop(gen[r.req.id][-1]), int(slot))
                    rows[slot] = None
            last, active = np.array(last_d), new_active.copy()
            remaining, count = np.array(rem_d), np.array(count_d)
        stats.wall_s = book.now()
        stats.tokens = sum(len(c.tokens) for c in book.done.values())
        return book.completions(), stats
