"""The serving engine: requests prefilled one at a time into the rows of one batch cache
while the other rows keep decoding; the rows are dense slots or pages.

The pattern of JetStream / MaxText's offline engine ("prefill, then insert into a slot";
github.com/AI-Hypercomputer/JetStream, ``engine_api.Engine.insert``). :class:`Engine`
runs the host loop (admission, decode blocks, emission, preemption) over a row store
chosen at one site (:func:`row_store`: ``page_size`` 0 or not), siblings behind one
small interface as jax-llm-examples' ``KVCache`` / ``PagedKVCache`` or llama.cpp's
``llama_memory_i``:

* :class:`DenseRows`: ``num_slots`` rows of ``max_seq_len`` slots each (a ragged cache,
  :mod:`kvjax.inference.ragged`), one reserved per request. A prompt is prefilled alone
  into a one-row cache (padded to a power-of-two bucket, so few lengths compile) and
  copied into a free row (:func:`insert_program`, one compile for any row).
* :class:`PagedRows`: one pool of ``num_pages`` pages of ``page_size`` tokens per layer
  and tensor (:mod:`kvjax.cache.paged`) under ``num_slots`` rows of block tables; a row
  takes pages as its request grows (vLLM, Kwon et al. 2023, sec. 4.3). **Admission**
  (first come, first served): the head of the queue starts when a row is free and the
  pages of its prompt and its first decoded token fit; with ``prefix_cache`` its
  prompt's full pages already cached are referenced, not prefilled. **Growth**: before
  each decode block every running row takes the pages of its next block (copy on write
  of a shared page first; a window's pages that slid out are freed). **Preemption**
  (recompute, vLLM's default): when the pool runs out the newest running request is
  stopped, its pages released (full pages stay cached with ``prefix_cache``) and it goes
  back to the head of the queue with its tokens kept; readmitted, its prompt and
  generated tokens are prefilled again and it goes on sampling from there.

:func:`decode_steps_program` then advances every running row by up to
``steps_per_sync`` tokens in one compiled loop (speculative decoding: verify rounds,
:func:`kvjax.inference.speculative.speculative_loop`; a rejected draft is taken back
by the row's length alone, on pages too); free rows are fed ``num_valid`` 0 (no write,
no advance), so the same program serves any occupancy. The loop returns early when a row
frees while requests wait (on pages: always, so its pages go back to the pool at once),
and the host refills it. Host bookkeeping (:class:`Ledger`,
:class:`kvjax.cache.paged.PageAllocator`) never traces.

A request's tokens do not depend on its batch-mates, its row or the row store: each row
attends only to its own cache, and its sampling key is ``fold_in(request_key(seed,
request id), j)`` for its j-th token (:func:`kvjax.inference.sampling.request_key`: all
64 bits of the id; greedy decoding uses no key).

Times are host wall-clock seconds from the start of :meth:`Engine.run`. A request arrives
at its ``arrival_s`` (0 for all: an offline batch; ``experiments.serve --arrival_rate``
draws Poisson arrivals) and is not admitted before. Time to first token runs from its
arrival to when its first token is on the host (queueing + prefill); each token carries
the time the host received it (:attr:`Completion.token_s`: the tokens of one decode
block of ``steps_per_sync`` steps arrive together), so times between tokens are
measured as a client sees them, not averaged.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.cache import compress as compress_lib
from kvjax.cache import paged
from kvjax.cache.policy import written_tokens
from kvjax.config import ConfigError, ModelConfig, SamplingConfig, SpeculativeConfig
from kvjax.inference import ragged
from kvjax.inference import speculative as spec_lib
from kvjax.inference import decode as decode_lib
from kvjax.inference.sampling import NONFINITE, check_request_id, request_key, request_keys
from kvjax.models import model as model_lib

__all__ = ["Request", "Completion", "EngineStats", "Engine", "Ledger", "DenseRows",
           "PagedRows", "row_store", "insert_program", "decode_steps_program",
           "paged_prefill_program", "copy_pages_program", "prefill_bucket"]


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: ``prompt`` token ids (non-empty), ``max_new_tokens`` >= 1 tokens to
    generate (the first one, sampled from the prefill, included); ``id`` names it in
    errors and seeds its sampling key; ``text`` is informative only; ``arrival_s``: when
    it arrives, in seconds after the run starts (>= 0; 0: at once); it is not admitted
    before."""

    id: int
    prompt: tuple
    max_new_tokens: int
    text: str | None = None
    arrival_s: float = 0.0


@dataclasses.dataclass
class Completion:
    """A finished request: its generated ``tokens`` (EOS included when it stopped there),
    ``stop`` ('eos', 'budget', or 'nonfinite': its logits were not finite, and its last
    token is :data:`kvjax.inference.sampling.NONFINITE`), the slot it used (None:
    finished at its prefill), and seconds since the run started: ``first_token_s``,
    ``finish_s``, ``arrival_s`` (the request's) and ``token_s`` (one per token: when the
    host received it; the tokens of one sync of ``steps_per_sync`` steps arrive
    together, as a streaming client would see them); ``stop_token``: the
    end-of-generation id it stopped at (stop 'eos'), else None."""

    id: int
    prompt_len: int
    tokens: list
    stop: str
    slot: int | None
    first_token_s: float
    finish_s: float
    stop_token: int | None = None
    arrival_s: float = 0.0
    token_s: list = dataclasses.field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        """Time to first token (s) from the request's arrival (queueing included)."""
        return self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> list:
        """Times between consecutive tokens as the host received them (s; len(tokens) - 1
        entries, 0 between tokens of the same sync)."""
        return [b - a for a, b in zip(self.token_s, self.token_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (s); None with a single token."""
        n = len(self.tokens)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclasses.dataclass
class EngineStats:
    """Totals of one :meth:`Engine.run`: wall seconds, tokens generated, decode steps
    run, slot-steps occupied (sum over steps of running rows), live KV bytes summed over
    steps (running rows' held tokens x bytes per token), allocated KV bytes (on pages:
    the pool's, and with ``layer_windows`` the local layers' rings), rows
    (``num_slots``), prefills, decode seconds; speculative decoding's drafts accepted
    and proposed; the prompt tokens prefills looked up
    (``prompt_tokens``) and found cached (``prefix_hit_tokens``: prefill tokens saved),
    tokens prefilled (``prefill_tokens``, recomputation after preemption included), the
    most rows running at once (``max_running``).

    On pages (``page_size`` >= 1; 0: dense rows, and the page figures stay 0):
    ``preemptions``; referenced-page bytes summed over decode steps
    (``page_kv_byte_steps``: every page the allocator holds for running rows; a block
    ends at the step a row stops, which frees its pages); the bytes of the pages of the
    rows still running, step by step (``active_page_kv_byte_steps``: what the rows' own
    lengths and the block's look-ahead take, without the rows that stopped); the most
    pages one row held at a decode block (``max_row_pages``: constant in the row's
    length for a window, whose pages that slide out are freed)."""

    wall_s: float = 0.0
    tokens: int = 0
    steps: int = 0
    occupied_slot_steps: int = 0
    live_kv_byte_steps: float = 0.0
    allocated_kv_bytes: int = 0
    num_slots: int = 0
    prefills: int = 0
    decode_s: float = 0.0
    accepted: int = 0  # speculative decoding: drafts accepted and verified
    proposed: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    max_running: int = 0
    page_size: int = 0
    preemptions: int = 0
    page_kv_byte_steps: float = 0.0
    active_page_kv_byte_steps: float = 0.0
    max_row_pages: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (speculative decoding; 0 without)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def throughput(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def mean_occupancy(self) -> float:
        """Mean fraction of slots occupied per decode step, in [0, 1]."""
        return self.occupied_slot_steps / (self.steps * self.num_slots) if self.steps else 0.0

    @property
    def mean_live_kv_bytes(self) -> float:
        """Mean bytes of KV held by occupied rows per decode step."""
        return self.live_kv_byte_steps / self.steps if self.steps else 0.0

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


class Ledger:
    """The engine's host bookkeeping for one run: the clock (seconds since the run
    started), the requests waiting in arrival order, each request's tokens with the
    time each reached the host, and its :class:`Completion`.

    Args:
      requests: the run's requests (any order; kept in order of ``arrival_s``, stable).
      on_finish: called with each completion as it is made (a progress bar), or None.
    Raises:
      ValueError: a repeated request id, or an arrival time that is negative or not
        finite, naming it.
    """

    def __init__(self, requests: Sequence[Request],
                 on_finish: Callable[[Completion], None] | None = None):
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"request id {dup} appears more than once; allowed: unique ids")
        for r in requests:
            if not (np.isfinite(r.arrival_s) and r.arrival_s >= 0):
                raise ValueError(f"request {r.id}: arrival_s={r.arrival_s!r}; allowed: a "
                                 "finite number of seconds >= 0")
        self.order = [r.id for r in requests]
        self.queue = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
        self.on_finish = on_finish
        self.tokens: dict[int, list] = {}
        self.times: dict[int, list] = {}
        self.done: dict[int, Completion] = {}
        self.start = time.perf_counter()

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.start

    def next_arrived(self) -> Request | None:
        """The first waiting request if it has arrived (it stays queued), else None."""
        return self.queue[0] if self.queue and self.queue[0].arrival_s <= self.now() \
            else None

    def wait_for_arrival(self) -> None:
        """Sleeps until the first waiting request arrives (nothing else to do)."""
        if self.queue:
            time.sleep(max(0.0, self.queue[0].arrival_s - self.now()))

    def emit(self, req_id: int, tokens) -> None:
        """Records ``tokens`` of request ``req_id`` as received now."""
        t = self.now()
        self.tokens.setdefault(req_id, []).extend(tokens)
        self.times.setdefault(req_id, []).extend([t] * len(tokens))

    def finish(self, req: Request, stop: str, slot: int | None) -> Completion:
        """Completes ``req`` (its tokens so far) with ``stop`` on ``slot``."""
        toks, times = self.tokens.pop(req.id), self.times.pop(req.id)
        c = Completion(req.id, len(req.prompt), toks, stop, slot, times[0], self.now(),
                       stop_token=toks[-1] if stop == "eos" else None,
                       arrival_s=req.arrival_s, token_s=times)
        self.done[req.id] = c
        if self.on_finish is not None:
            self.on_finish(c)
        return c

    def completions(self) -> list:
        """The completions in the order the requests were given."""
        return [self.done[i] for i in self.order]


def _stop(last: int, eos_ids) -> str:
    """Why a request that ended on token ``last`` stopped: 'nonfinite' (its logits were
    not finite; the token is :data:`kvjax.inference.sampling.NONFINITE`), 'eos' (one of
    the end-of-generation ids ``eos_ids``) or 'budget'."""
    return "nonfinite" if last == NONFINITE else "eos" if last in eos_ids else "budget"


def prefill_bucket(n: int, minimum: int = 16) -> int:
    """Padded prefill length of an ``n``-token prompt: the next power of two >= n (at
    least ``minimum``), so prompts of any length compile O(log) prefills."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


@functools.partial(jax.jit, donate_argnames=("cache",))
def insert_program(cache, row, slot):
    """Copies a one-row cache ``row`` into row ``slot`` ([] int32, traced: one compile
    for every slot) of the batch ``cache`` (donated; updated in place), with its
    scoring state when the rows compress every N steps (``cache.schedule``,
    :func:`kvjax.cache.compress.put_schedule_row`)."""

    def put(dst, src, axis):
        start = [0] * dst.ndim
        start[axis] = slot
        return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), start)

    tensors = {}
    for name, t in cache.tensors.items():
        if isinstance(t, tuple):
            tensors[name] = tuple(put(d, s, 0) for d, s in zip(t, row.tensors[name]))
        else:  # stacked [L, B, ...]
            tensors[name] = put(t, row.tensors[name], 1)
    schedule = None if cache.schedule is None else compress_lib.put_schedule_row(
        cache.schedule, row.schedule, slot)
    return cache.replace(tensors=tensors, positions=put(cache.positions, row.positions, 0),
                         length=put(cache.length, row.length, 0), schedule=schedule)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "steps"),
                   donate_argnames=("cache",))
def decode_steps_program(params, cache, last, active, remaining, count, keys, eos_ids,
                         stop_on_free, *, cfg, sampling, steps):
    """Up to ``steps`` decode steps of every occupied slot, in one ``lax.while_loop``.

    Args:
      cache: the ragged batch cache [num_slots rows] (donated).
      last: [B] int32 each slot's last token; active: [B] bool occupied; remaining: [B]
        int32 tokens still allowed; count: [B] int32 tokens generated so far (the index
        of the next token's sampling key); keys: [B] per-slot keys; eos_ids: [E] int32
        end-of-generation ids (-1 never matches);
        stop_on_free: [] bool, end the loop once a slot frees (requests are waiting).
    Returns:
      dict (:func:`kvjax.inference.decode.decode_loop`'s): 'tokens' [B, steps] int32, -1
      where a slot produced none; 'steps' run [] int32; 'cache', 'last', 'active',
      'remaining', 'count'; 'occupied' slot-steps [] int32; 'held' tokens of occupied
      rows summed over steps [] int32.
    """
    def sample(logits, count, carry):
        return ragged.sample_rows(logits, keys, count, sampling), carry

    return decode_lib.decode_loop(params, cfg, cache, last, active, remaining, count,
                                  eos_ids, sample, steps=steps, stop_on_free=stop_on_free,
                                  stats=True)


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_pages_program(cache, src, dst):
    """:func:`kvjax.cache.paged.copy_pages` compiled, the pools donated."""
    return paged.copy_pages(cache, src, dst)


@functools.partial(jax.jit, static_argnames=("cfg", "sampling", "fresh"),
                   donate_argnames=("cache",))
def paged_prefill_program(params, cache, row, block_table, start, tokens, num_valid, key,
                          count, *, cfg, sampling, fresh):
    """One row's prompt (or the part not cached) written into its pages.

    Args:
      cache: the :class:`~kvjax.cache.paged.PagedKVCache` of every row (donated); the
        prefill runs on a one-row cache over its pools (:func:`kvjax.cache.paged.row_cache`:
        a local layer of ``layer_windows`` on row ``row``'s ring, [] int32).
      block_table: [1, M] int32 the row's pages; start: [1] int32 tokens already held
        (cached prefix).
      tokens: [1, T] int32 right-padded; num_valid: [1] int32 real tokens.
      key: the request's key; count: [] int32 index of the token to sample.
      fresh: (static) the row holds no token yet (no page is read).
    Returns:
      (token [1] int32 sampled from the last real token's logits, the cache of every
      row: its block tables and lengths as given).
    """
    one = paged.row_cache(cache, row, block_table, start)
    pos = start[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    logits, one = model_lib.forward(params, cfg, tokens, pos, one, num_valid=num_valid,
                                    fresh=fresh, last_only=True)
    return (ragged.sample_rows(logits[:, 0], key[None], count[None], sampling),
            paged.put_row(cache, one, row))


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
def paged_compressed_prefill_program(params, cache, block_table, tokens, num_valid, key,
                                     count, *, cfg, sampling):
    """One row's prompt prefilled into a dense full cache, scored and compressed
    (:func:`kvjax.inference.decode.prefill_compressed`, as a dense row's), and its W =
    kv_budget + recent_slots slots written into the row's pages
    (:func:`kvjax.cache.paged.put_slots`).

    Args:
      cache: the :class:`~kvjax.cache.paged.PagedKVCache` of compressed rows (donated).
      block_table: [1, W / P] int32 the row's pages.
      tokens: [1, T] int32 right-padded; num_valid: [1] int32 real tokens.
      key: the request's key; count: [] int32 index of the token to sample.
    Returns:
      (token [1] int32 sampled from the last real token's logits, the cache of every
      row: its block tables, lengths and ring starts as given).
    """
    logits, one = decode_lib.prefill_compressed(params, tokens, cfg, True, num_valid,
                                                num_slots=cache.num_slots)
    return (ragged.sample_rows(logits, key[None], count[None], sampling),
            paged.put_slots(cache, one, block_table))


class DenseRows:
    """``num_rows`` rows of ``max_seq_len`` cache slots, one reserved per request.

    The row-store interface :class:`Engine` runs on (:class:`PagedRows` is the other):
    ``cache`` (the target's rows, B = ``num_rows``), ``view_len`` (cache slots a row's
    attention sees: the plan's ``max_seq_len``), ``page_size`` (0: no pages),
    ``bytes_per_token`` and ``allocated_bytes`` (bytes), and

    * ``allocate(cfg, spec)``: the empty cache of the planned ``cfg``;
    * ``check(req)``: raises ValueError when the request can never fit a row;
    * ``reset()``: every row free, before a run;
    * ``admit(row, tokens, need)``: room for ``need`` tokens whose first are ``tokens``;
      returns how many of ``tokens`` are cached already, or None: no room now;
    * ``prefill(params, cfg, sampling, row, tokens, start, count, key)``: writes
      ``tokens[start:]`` into the row, returns the token sampled after them (key index
      ``count``);
    * ``grow(row, tokens, final)``: room for ``tokens`` more (at most ``final`` in all);
      False: none left (the engine preempts);
    * ``bind(running)``, ``account(stats, running, steps, ran)``: the cache pointed at
      the running rows before a decode block; the block's figures after it;
    * ``append(row, tokens)``: records the tokens a block wrote; ``release(row)``;
    * ``stop_on_free(waiting)``: whether a block returns when a row frees;
    * ``warmup(requests, prefill)``: compiles every prefill ``requests`` can need
      (``prefill(row, tokens, start)``); returns the buckets compiled.
    """

    page_size = 0

    def __init__(self, num_rows: int, max_seq_len: int):
        self.num_rows, self.max_seq_len = num_rows, max_seq_len
        self.view_len = max_seq_len

    def allocate(self, cfg: ModelConfig, spec: SpeculativeConfig | None) -> None:
        self.cfg, self.spec = cfg, spec
        self.cache = self._empty(self.num_rows)
        self.allocated_bytes = cache_lib.cache_bytes(self.cache)
        self.bytes_per_token = self.allocated_bytes / (self.num_rows * self.cache.num_slots)

    def _empty(self, rows: int):
        """An empty ragged cache of ``rows`` rows (a speculative ring keeps k + 1 spare
        slots: :func:`kvjax.inference.speculative.init_target_cache`)."""
        if self.spec is not None:
            return spec_lib.init_target_cache(self.cfg, rows, self.max_seq_len, self.spec.k)
        cache = cache_lib.init_cache(self.cfg, rows, self.max_seq_len, ragged=True)
        if self.cfg.kv_rescores:
            # each row's scoring state, put in place with its prefilled row
            cache = cache.replace(schedule=compress_lib.empty_schedule(self.cfg, rows))
        return cache

    def check(self, req: Request) -> None:
        """Raises CacheOverflowError (a ValueError) when prompt + budget do not fit a row
        (the cache's slot policy decides: a ring never fills)."""
        cache_lib.policy_for(self.cfg).check_room(
            0, written_tokens(len(req.prompt), req.max_new_tokens), self.cache.num_slots,
            f"request {req.id} ({len(req.prompt)} prompt tokens + "
            f"{req.max_new_tokens} new)")

    def prefill(self, params, cfg, sampling, row, tokens, start, count, key) -> int:
        """The prompt prefilled alone into a one-row cache and copied into ``row``
        (``start`` and ``count`` are 0: dense rows cache no prefix and never preempt)."""
        toks, lengths = ragged.pad_prompts([list(tokens)], length=prefill_bucket(len(tokens)))
        logits, one = ragged.prefill_ragged_program(
            params, jnp.asarray(toks), jnp.asarray(lengths), self._empty(1), cfg=cfg)
        self.cache = insert_program(self.cache, one, jnp.int32(row))
        return int(ragged.first_tokens(logits, key[None], sampling)[0])

    def warmup(self, requests: Sequence[Request], prefill) -> list:
        buckets = sorted({prefill_bucket(len(r.prompt)) for r in requests})
        for b in buckets:
            prefill(0, [0] * b, 0)
        return buckets

    def admit(self, row, tokens, need) -> int:
        return 0

    def grow(self, row, tokens, final) -> bool:
        return True

    def stop_on_free(self, waiting: bool) -> bool:
        return waiting

    def reset(self) -> None: ...
    def bind(self, running) -> None: ...
    def account(self, stats, running, steps, ran) -> None: ...
    def append(self, row, tokens) -> None: ...
    def release(self, row) -> None: ...


class PagedRows:
    """``num_rows`` rows of block tables over one pool of ``num_pages`` pages of
    ``page_size`` tokens (the interface of :class:`DenseRows`): a row takes pages as it
    grows, shares the cached full pages of common prompt prefixes with ``prefix_cache``,
    and frees the pages that slide out of a window. Raises ValueError for a non-positive
    ``num_pages`` or a pool smaller than one request of ``max_seq_len`` tokens (so the
    oldest request can always finish).

    ``row_slots`` W > 0: compressed rows (an evicting ``model.kv_compression``): a row
    takes its W / P pages on admission and never more (a ring of W slots,
    :func:`kvjax.cache.paged.put_slots`), so it never grows nor is preempted, caches no
    prefix, and the pool need hold one row, not one request of max_seq_len tokens; the
    rows' lengths and compression lengths are kept here (the allocator holds pages
    only)."""

    def __init__(self, num_rows: int, max_seq_len: int, page_size: int, num_pages: int,
                 prefix_cache: bool = False, row_slots: int = 0):
        if int(num_pages) < 1:
            raise ValueError(f"num_pages={num_pages}; allowed: an integer >= 1")
        self.num_rows, self.max_seq_len = num_rows, max_seq_len
        self.page_size, self.num_pages = int(page_size), int(num_pages)
        self.row_slots = int(row_slots)
        if self.row_slots % self.page_size:
            raise ValueError(f"row_slots={row_slots}; allowed: a multiple of page_size="
                             f"{page_size} (a compressed row is whole pages)")
        self.max_pages = (self.row_slots // self.page_size if self.row_slots
                          else paged.pages_for(max_seq_len, self.page_size))
        if self.num_pages < self.max_pages:
            one = (f"one compressed row of {self.row_slots} slots" if self.row_slots
                   else f"one request of max_seq_len={max_seq_len}")
            raise ValueError(
                f"num_pages={num_pages} pages of {page_size} tokens hold "
                f"{self.num_pages * self.page_size} tokens, too few for {one}; allowed: "
                f"num_pages >= {self.max_pages}")
        self.view_len = self.max_pages * self.page_size
        self.prefix_cache = bool(prefix_cache)
        self.reset()

    def allocate(self, cfg: ModelConfig, spec: SpeculativeConfig | None) -> None:
        """The pools, and with ``layer_windows`` each local layer's rows' rings (k + 1
        spare slots when speculative: :func:`kvjax.inference.speculative.spare_slots`):
        ``allocated_bytes`` is their sum; the page figures count the pools' pages."""
        self.cfg = cfg
        spare = 0 if spec is None else spec_lib.spare_slots(cfg, spec.k)
        self.cache = paged.init_paged_cache(cfg, self.num_rows, self.num_pages,
                                            self.page_size, self.max_pages, spare)
        self.page_bytes = paged.page_bytes(cfg, self.page_size)
        self.bytes_per_token = self.page_bytes / self.page_size
        self.allocated_bytes = (self.num_pages * self.page_bytes
                                + paged.ring_bytes(cfg, self.num_rows, spare))

    def reset(self, prefix_cache: bool | None = None) -> None:
        self.alloc = paged.PageAllocator(
            self.num_pages, self.page_size,
            self.prefix_cache if prefix_cache is None else prefix_cache)
        self._held: dict = {}  # compressed rows: row -> [length, length compressed at]

    def check(self, req: Request) -> None:
        """Raises ValueError when the request writes more tokens than a row or the pool
        holds (a compressed row's ring never fills: any request fits, as on dense
        rows)."""
        if self.row_slots:
            return
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

    def _table(self, row) -> np.ndarray:
        bt = np.full(self.max_pages, -1, np.int32)
        pages = self.alloc.block_table(row)
        bt[:len(pages)] = pages
        return bt

    def admit(self, row, tokens, need) -> int | None:
        try:
            if self.row_slots:  # its W / P pages, kept to the end
                self.alloc.admit(row, [], self.row_slots)
                self._held[row] = [0, 0]
                return 0
            return self.alloc.admit(row, tokens, need)
        except paged.PoolExhausted:
            return None

    def prefill(self, params, cfg, sampling, row, tokens, start, count, key) -> int:
        """``tokens[start:]`` written into ``row``'s pages (the first ``start`` are
        cached) by a one-row view of the pools; a compressed row's whole prompt
        compressed into its pages (``start`` 0: it caches no prefix and is never
        preempted)."""
        if self.row_slots:
            toks = np.zeros((1, prefill_bucket(len(tokens))), np.int32)
            toks[0, :len(tokens)] = tokens
            first, self.cache = paged_compressed_prefill_program(
                params, self.cache, jnp.asarray(self._table(row)[None]), jnp.asarray(toks),
                jnp.asarray([len(tokens)], jnp.int32), key, jnp.int32(count), cfg=cfg,
                sampling=sampling)
            self._held[row] = [len(tokens), len(tokens)]
            return int(first[0])
        n = len(tokens) - start
        toks = np.zeros((1, prefill_bucket(n)), np.int32)
        toks[0, :n] = tokens[start:]
        # a row's rings (layer_windows) live in its row of the batch; warmup's rows are
        # names, its prefills go to row 0 (every row is prefilled afresh when admitted)
        first, self.cache = paged_prefill_program(
            params, self.cache, jnp.int32(row if isinstance(row, (int, np.integer)) else 0),
            jnp.asarray(self._table(row)[None]), jnp.full((1,), start, jnp.int32),
            jnp.asarray(toks), jnp.asarray([n], jnp.int32), key, jnp.int32(count), cfg=cfg,
            sampling=sampling, fresh=start == 0)
        self.alloc.append(row, tokens[start:])
        return int(first[0])

    def warmup(self, requests: Sequence[Request], prefill) -> list:
        """A request's prefill can be of any bucket up to its whole length: a prefix hit
        leaves fewer tokens, a preempted request is prefilled again with its generated
        tokens, so every bucket up to the longest request's is compiled, fresh and (with
        ``prefix_cache``) after a cached page. Compressed rows: each prompt's bucket
        (:meth:`DenseRows.warmup`)."""
        if self.row_slots:
            buckets = sorted({prefill_bucket(len(r.prompt)) for r in requests})
            for b in buckets:
                self.admit("warmup", [], b)
                prefill("warmup", [0] * b, 0)
                self.release("warmup")
            return buckets
        most = max(written_tokens(len(r.prompt), r.max_new_tokens) for r in requests)
        top = prefill_bucket(min(most, self.view_len))
        buckets = [prefill_bucket(1)]  # prefill_bucket's powers of two, up to top
        while buckets[-1] < top:
            buckets.append(2 * buckets[-1])
        self.reset(prefix_cache=False)  # no prefix hits
        p = self.page_size
        for b in buckets:
            n = min(b, self.view_len)  # the longest prefill of bucket b that fits a row
            self.alloc.admit("warmup", [0] * n, n)
            prefill("warmup", [0] * n, 0)
            self.alloc.release("warmup")
            n = min(b, self.view_len - p)
            if self.prefix_cache and n >= 1 and prefill_bucket(n) == b:  # after a hit
                self.alloc.admit("warmup", [0] * (n + p), n + p)
                self.alloc.append("warmup", [0] * p)
                prefill("warmup", [0] * (n + p), p)
                self.alloc.release("warmup")
        return buckets

    def grow(self, row, tokens, final) -> bool:
        """Frees the pages no query of the block sees (a window), then takes the pages of
        the next ``tokens`` (copy on write of a shared page first). A compressed row
        holds its pages already."""
        if self.row_slots:
            return True
        if self.cfg.window_size:
            self.alloc.drop_before(row, self.alloc.length(row) - self.cfg.window_size + 1,
                                   self.cfg.num_sink_tokens)
        try:
            copies = self.alloc.ensure(row, min(self.alloc.length(row) + tokens, final))
        except paged.PoolExhausted:
            return False
        if copies:
            src, dst = (jnp.asarray(x, jnp.int32) for x in zip(*copies))
            self.cache = copy_pages_program(self.cache, src, dst)
        return True

    def stop_on_free(self, waiting: bool) -> bool:
        return True  # a stopped row's pages go back to the pool at once

    def bind(self, running) -> None:
        self._bound = np.full((self.num_rows, self.max_pages), -1, np.int32)
        lengths = np.zeros(self.num_rows, np.int32)
        starts = np.zeros(self.num_rows, np.int32)
        for row in running:
            self._bound[row] = self._table(row)
            lengths[row], starts[row] = (self._held[row] if self.row_slots
                                         else (self.alloc.length(row), 0))
        self._referenced = self.alloc.num_referenced
        self.cache = self.cache.replace(block_table=jnp.asarray(self._bound),
                                        length=jnp.asarray(lengths))
        if self.row_slots:
            self.cache = self.cache.replace(ring_start=jnp.asarray(starts))

    def account(self, stats: EngineStats, running, steps: int, ran) -> None:
        """The block's page figures; ``ran``: [B] int, steps (verify rounds) each row ran."""
        bt = self._bound
        stats.max_row_pages = max([stats.max_row_pages] +
                                  [int((bt[s] >= 0).sum()) for s in running])
        stats.page_kv_byte_steps += steps * self._referenced * self.page_bytes
        stats.active_page_kv_byte_steps += self.page_bytes * sum(
            len(set().union(*(bt[s][bt[s] >= 0] for s in running if ran[s] > i)))
            for i in range(steps))

    def append(self, row, tokens) -> None:
        if self.row_slots:
            self._held[row][0] += len(tokens)
            return
        self.alloc.append(row, tokens)

    def release(self, row) -> None:
        self.alloc.release(row)
        self._held.pop(row, None)


def row_store(num_rows: int, max_seq_len: int, page_size: int = 0, num_pages: int = 0,
              prefix_cache: bool = False, row_slots: int = 0):
    """The one site choosing the rows: :class:`DenseRows` for ``page_size`` 0, else
    :class:`PagedRows` of ``num_pages`` pages of ``page_size`` tokens (compressed rows
    of ``row_slots`` slots each when > 0).

    Raises:
      ValueError: a negative ``page_size``, or pages (``num_pages``, ``prefix_cache``)
        asked for with page_size 0; a bad pool (:class:`PagedRows`).
    """
    if isinstance(page_size, bool) or int(page_size) < 0:
        raise ValueError(f"page_size={page_size}; allowed: 0 (dense rows) or an integer "
                         ">= 1 (tokens per page)")
    if int(page_size):
        return PagedRows(num_rows, max_seq_len, page_size, num_pages, prefix_cache,
                         row_slots)
    if num_pages or prefix_cache:
        raise ValueError(f"num_pages={num_pages}, prefix_cache={prefix_cache} with "
                         "page_size=0; allowed: a pool and a prefix cache with page_size "
                         ">= 1 (dense rows have neither)")
    return DenseRows(num_rows, max_seq_len)


@dataclasses.dataclass
class _Running:
    req: Request
    order: int          # admission counter: the largest is the newest
    final: int          # tokens the request writes in all (written_tokens)


class Engine:
    """Serves requests through ``num_slots`` rows of one batch cache: dense rows, or rows
    of block tables over a page pool (``page_size`` >= 1; :func:`row_store`).

    Args:
      params: parameters in cfg's layout.
      cfg: the model.
      num_slots: rows, the most requests running at once (>= 1).
      max_seq_len: cache length per row in tokens (prompt + max_new_tokens must fit a
        dense cache; a window holds W); on pages the longest request (prompt +
        max_new_tokens - 1), a block table having ceil(max_seq_len / page_size) entries.
      sampling: SamplingConfig (greedy by default).
      eos_ids: the end-of-generation ids (``Tokenizer.eos_token_ids``; one int is one
        id; empty or -1: stop at budgets only).
      steps_per_sync: decode steps (speculative: verify rounds) per compiled call
        between host visits (>= 1).
      seed: base of the per-request sampling keys.
      speculative: a SpeculativeConfig: every call runs verify rounds of k + 1 tokens
        (:func:`kvjax.inference.speculative.speculative_loop`), a row accepting its
        own number (on pages a row takes the pages of up to steps_per_sync x (k + 1)
        tokens a block); greedy tokens equal plain decoding's, sampled ones follow the
        same distribution (the acceptance with per-request keys). Drafts: 'ngram'
        (prompt lookup over each row's own tokens), 'self' (the same weights over the
        config's cheap cache) or 'model' (``draft``), whose dense cache is kept per row
        beside the target's (a window draft's ring of W + k + 1 slots, a 'model'
        draft's max_seq_len + k + 1), prefilled with a request's tokens on admission
        (again after a preemption), outside the page budget (``draft_cache_bytes``).
        None or drafter 'none': plain steps.
      draft: (draft params, draft config) for drafter 'model'
        (:func:`kvjax.inference.runner.draft_model`); 'self' builds its own
        (:func:`kvjax.inference.speculative.draft_config`) when None.
      page_size: tokens per page; 0: dense rows.
      num_pages: pages in the pool (per layer and tensor), with page_size >= 1; at least
        one request of ``max_seq_len`` tokens must fit, so the oldest request can
        always finish. With ``cfg.layer_windows`` only the global layers are paged; a
        local layer keeps each row's ring of W_i (+ k + 1 speculative) slots
        (docs/decisions/0031-paged-layer-windows-rings.md). With an evicting
        ``cfg.kv_compression`` each row holds kv_budget + recent_slots slots of whole
        pages, fixed (:class:`PagedRows` ``row_slots``; schedule 'prefill', one budget
        in every layer: :func:`kvjax.config.check_paged_compression`), and the pool
        need hold one such row.
      prefix_cache: reuse cached full pages of common prompt prefixes (pages only; not
        with ``cfg.layer_windows``, whose rings are a row's own).
    Raises:
      ValueError: a non-positive num_slots, max_seq_len or steps_per_sync, a bad
        page_size or pool (:func:`row_store`), or draft= without speculative= (each
        named with its value).
      ConfigError: a drafter the config cannot build
        (:meth:`kvjax.inference.speculative.Drafter.check`: 'model' without ``draft``, a
        draft with another vocabulary), or a draft that copies the target's window
        (``draft_kv_source='target'``) on pages, ``prefix_cache`` with
        ``cfg.layer_windows`` or an evicting ``cfg.kv_compression``, an evicting method
        with speculation, or one the pages cannot hold
        (:func:`kvjax.config.check_paged_compression`), before any work.
    """

    def __init__(self, params, cfg: ModelConfig, num_slots: int, max_seq_len: int,
                 sampling: SamplingConfig = SamplingConfig(),
                 eos_ids: int | Sequence[int] = (),
                 steps_per_sync: int = 8, seed: int = 0,
                 speculative: SpeculativeConfig | None = None, draft: tuple | None = None,
                 page_size: int = 0, num_pages: int = 0, prefix_cache: bool = False):
        for name, v in (("num_slots", num_slots), ("max_seq_len", max_seq_len),
                        ("steps_per_sync", steps_per_sync)):
            if int(v) < 1:
                raise ValueError(f"{name}={v}; allowed: an integer >= 1")
        if speculative is not None and not speculative.enabled:  # drafter 'none'
            speculative = None
        if cfg.kv_selects_pages and (not page_size or speculative is not None):
            raise ConfigError(
                f"model.kv_compression={cfg.kv_compression!r} with "
                f"{'page_size=0' if not page_size else 'speculative decoding'}; allowed: "
                "page_size >= 1 without speculation (it selects the pages of a paged "
                "cache to read)")
        if page_size and cfg.kv_selects_pages:
            paged.check_selection(cfg, page_size, paged.pages_for(max_seq_len, page_size))
        if cfg.kv_evicts and speculative is not None:
            raise ConfigError(
                f"model.kv_compression={cfg.kv_compression!r} with speculative decoding; "
                "allowed: the engine without speculation (speculative=None; the main job "
                "speculates on a compressed cache)")
        row_slots = 0
        if cfg.kv_evicts and page_size:
            row_slots = paged.compressed_slots(cfg, page_size)
            if prefix_cache:
                raise ConfigError(
                    f"prefix_cache=True with model.kv_compression={cfg.kv_compression!r};"
                    " allowed: prefix_cache=False (a compressed row's pages hold its kept "
                    "slots, not a prompt prefix another request can share)")
        self.num_slots, self.max_seq_len = int(num_slots), int(max_seq_len)
        self.rows = row_store(self.num_slots, self.max_seq_len, page_size, num_pages,
                              prefix_cache, row_slots)
        if page_size and prefix_cache and cfg.layer_windows is not None:
            raise ConfigError(
                f"prefix_cache=True with model.layer_windows={cfg.layer_windows}; allowed: "
                "prefix_cache=False (a local layer's ring is its row's own, not pages a "
                "prompt prefix can share)")
        if speculative is not None and speculative.drafter == "self" and draft is None:
            draft = spec_lib.self_draft(params, cfg, speculative)
        if speculative is not None:
            spec_lib.drafter_for(speculative, None if draft is None else draft[1]).check(cfg)
            if speculative.copies_target_window and self.rows.page_size:
                raise ConfigError(
                    "speculative.draft_kv_source='target' with page_size="
                    f"{page_size}; allowed: 'own' on pages (the window copy reads dense "
                    "or ring rows only), or 'target' with page_size=0")
        elif draft is not None:
            raise ValueError("draft= without speculative=; allowed: a draft with a "
                             "SpeculativeConfig whose drafter is 'self' or 'model'")
        self.spec = speculative
        # the plans, resolved here on the host (never while tracing): the decode loop's
        # for num_slots rows (and its verify chunks), each prefill bucket's when first
        # used (_prefill_cfg)
        if cfg.plan is None:
            verify = () if self.spec is None else (self.spec.k + 1,)
            cfg = planner.resolve(cfg, max_seq_len=self.rows.view_len,
                                  batch_sizes=(self.num_slots,),
                                  page_size=self.rows.page_size, queries=verify)
        self.params, self.cfg = model_lib.fuse_projections(cfg, params), cfg  # once, here
        self.rows.allocate(cfg, self.spec)
        self._prefill_cfgs: dict[tuple, ModelConfig] = {}
        self.dparams = self.dcfg = self.draft_cache = None
        if draft is not None:  # the draft's plan: its steps over num_slots rows
            self.dparams, dcfg = draft
            self.dcfg = dcfg if dcfg.plan is not None else planner.resolve(
                dcfg, max_seq_len=self.max_seq_len + self.spec.k + 1,
                batch_sizes=(self.num_slots,), rows=(2 * self.num_slots,))
            self.dparams = model_lib.fuse_projections(self.dcfg, self.dparams)
        self.drafter = None if self.spec is None else spec_lib.drafter_for(self.spec,
                                                                               self.dcfg)
        if self.drafter is not None:  # None where the draft reads the target's rows
            self.draft_cache = self.drafter.init_cache(self.num_slots, self.max_seq_len)
        self.draft_cache_bytes = (0 if self.draft_cache is None
                                  else cache_lib.cache_bytes(self.draft_cache))
        self._pending = jnp.zeros(self.num_slots, jnp.int32)  # a draft model's next input
        self._has_pending = jnp.zeros(self.num_slots, bool)
        self._calls = 0
        self.sampling = sampling
        self.eos_ids = tuple(int(i) for i in np.atleast_1d(eos_ids) if int(i) >= 0)
        self._eos = decode_lib.eos_array(self.eos_ids)
        self.steps_per_sync, self.seed = int(steps_per_sync), int(seed)

    # ------------------------------------------------------------------ checks

    def check(self, req: Request) -> None:
        """Raises ValueError (naming the request) for an id outside [0, 2**64), an empty prompt, a budget < 1, or a
        request that does not fit a row (:meth:`DenseRows.check`, :meth:`PagedRows.check`)."""
        check_request_id(req.id)  # every id it accepts has its own key (issue 54)
        if not len(req.prompt):
            raise ValueError(f"request {req.id}: empty prompt; allowed: at least one token")
        if int(req.max_new_tokens) < 1:
            raise ValueError(f"request {req.id}: max_new_tokens={req.max_new_tokens}; "
                             "allowed: an integer >= 1")
        self.rows.check(req)

    # ------------------------------------------------------------------ units

    def _decode(self, last, active, remaining, count, keys, stop_on_free, hist, hist_len):
        """One compiled call of plain steps or speculative rounds: the loop's dict,
        'tokens' [B, n'] (each row's in order, -1 after), 'steps' (or rounds) run, 'last',
        'active', 'remaining', 'count' (each row's next key index), 'occupied', 'held',
        and for rounds 'hist', 'hist_len', 'accepted' [B], 'proposed' [B] and 'rounds'
        each row ran [B]; the rows' cache (and the draft's) updated in place."""
        if self.spec is None:
            out = decode_steps_program(
                self.params, self.rows.cache, last, active, remaining, count, keys,
                self._eos, stop_on_free, cfg=self.cfg, sampling=self.sampling,
                steps=self.steps_per_sync)
        else:
            self._calls += 1
            rng = jax.random.fold_in(jax.random.key(self.seed), self._calls)
            out = spec_lib.speculative_loop(
                self.params, self.dparams, self.rows.cache, self.draft_cache, last, active,
                remaining, hist, hist_len, rng, self._eos, row_keys=keys, index=count,
                stop_on_free=stop_on_free, pending=self._pending,
                has_pending=self._has_pending, cfg=self.cfg, drafter=self.drafter,
                sampling=self.sampling, max_rounds=self.steps_per_sync, stats=True,
                buf_len=self.steps_per_sync * (self.spec.k + 1))
            self.draft_cache, self._pending, self._has_pending = (
                out["draft_cache"], out["pending"], out["has_pending"])
            out["count"] = out["index"]
        self.rows.cache = out["cache"]
        return out

    def _key(self, req_id: int) -> jax.Array:
        return request_key(jax.random.key(self.seed), req_id)

    def _prefill(self, row, tokens: Sequence[int], start: int, count: int, req_id: int):
        """Writes ``tokens[start:]`` into ``row`` (the first ``start`` are cached) and
        returns the token sampled after them (key index ``count``)."""
        return self.rows.prefill(self.params, self._prefill_cfg(
            prefill_bucket(len(tokens) - start)), self.sampling, row, tokens, start, count,
            self._key(req_id))

    def _draft_prefill(self, row: int, tokens: Sequence[int]) -> None:
        """The draft model's row ``row``: ``tokens`` prefilled into a fresh one-row cache
        and put in place, with no pending draft input."""
        bucket = prefill_bucket(len(tokens))
        toks, lengths = ragged.pad_prompts([list(tokens)], length=bucket)
        drow = self.drafter.init_cache(1, self.max_seq_len)
        _, drow = ragged.prefill_ragged_program(
            self.dparams, jnp.asarray(toks), jnp.asarray(lengths), drow,
            cfg=self._prefill_cfg(bucket, True))
        self.draft_cache = insert_program(self.draft_cache, drow, jnp.int32(row))
        self._pending = self._pending.at[row].set(0)
        self._has_pending = self._has_pending.at[row].set(False)

    def _prefill_cfg(self, bucket: int, draft: bool = False) -> ModelConfig:
        """The config of a one-row prefill of ``bucket`` tokens (the draft model's with
        ``draft``), with its plan (resolved once per bucket, on the host)."""
        if (bucket, draft) not in self._prefill_cfgs:
            cfg, slots = (self.dcfg, self.max_seq_len) if draft else (self.cfg,
                                                                       self.rows.view_len)
            self._prefill_cfgs[bucket, draft] = planner.resolve(  # no decode step: no B
                cfg.replace(plan=None), max_seq_len=slots, batch_sizes=(), rows=(bucket,))
        return self._prefill_cfgs[bucket, draft]

    def warmup(self, requests: Sequence[Request]) -> float:
        """Compiles (by running once) every prefill ``requests`` can need
        (:meth:`DenseRows.warmup`, :meth:`PagedRows.warmup`; the draft model's too) and
        the decode loop, so :meth:`run` times serving, not XLA. Leaves every row free.
        Returns the seconds spent."""
        t0 = time.perf_counter()
        if not requests:
            return 0.0
        for b in self.rows.warmup(requests, lambda row, toks, start: self._prefill(
                row, toks, start, 0, 0)):
            if self.draft_cache is not None:  # a draft row is prefilled with all tokens
                self._draft_prefill(0, [0] * min(b, self.max_seq_len))
        zeros = jnp.zeros(self.num_slots, jnp.int32)
        hist, hist_len = spec_lib.slot_history(self.spec, self.num_slots, self.max_seq_len)
        self._decode(zeros, jnp.zeros(self.num_slots, bool), zeros, zeros,
                     request_keys(jax.random.key(self.seed), [0] * self.num_slots),
                     jnp.asarray(False), hist, hist_len)
        jax.block_until_ready(self.rows.cache)
        self.rows.reset()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ the loop

    def run(self, requests: Sequence[Request],
            on_finish: Callable[[Completion], None] | None = None, warmup: bool = True):
        """Serves ``requests`` (each admitted from its ``arrival_s`` on, first come first
        served) and returns (completions in request order, :class:`EngineStats`).

        Every request is checked (:meth:`check`) before any work; then, with ``warmup``,
        the programs are compiled (:meth:`warmup`) before the clock starts. ``on_finish``
        is called as each request completes (a progress bar).

        Raises:
          ValueError: a repeated request id, a bad arrival time (:class:`Ledger`), or a
            request the engine cannot serve (:meth:`check`), before any work.
        """
        book = Ledger(requests, on_finish)
        for r in requests:
            self.check(r)
        if warmup:
            self.warmup(requests)
        store, nr = self.rows, self.num_slots
        store.reset()
        rows: list = [None] * nr            # _Running or None
        gen = book.tokens                   # a preempted request keeps its tokens here
        last = np.zeros(nr, np.int32)
        active = np.zeros(nr, bool)
        remaining = np.zeros(nr, np.int32)
        count = np.zeros(nr, np.int32)
        keys = request_keys(jax.random.key(self.seed), [0] * nr)
        # speculative: each row's tokens, for the n-gram drafts
        hist, hist_len = spec_lib.slot_history(self.spec, nr, self.max_seq_len)
        per_block = self.steps_per_sync * (1 if self.spec is None else self.spec.k + 1)
        stats = EngineStats(allocated_kv_bytes=store.allocated_bytes, num_slots=nr,
                            page_size=store.page_size)
        queue = book.queue
        order = 0
        book.start = time.perf_counter()

        while queue or active.any():
            # admit, first come first served, while a row is free and the request fits
            for slot in range(nr):
                if rows[slot] is not None or book.next_arrived() is None:
                    continue
                req = queue[0]
                have = gen.get(req.id, [])
                tokens = list(req.prompt) + have  # a preempted request: its tokens kept
                final = written_tokens(len(req.prompt), req.max_new_tokens)
                hit = store.admit(slot, tokens, min(len(tokens) + 1, final))
                if hit is None:
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
                    store.release(slot)
                    book.finish(req, _stop(nxt, self.eos_ids), slot if have else None)
                    continue
                if self.draft_cache is not None:
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
            # every running row takes room for its next block, oldest first; when none is
            # left the newest running request is preempted (dense rows always have room)
            for slot in sorted(np.nonzero(active)[0], key=lambda s: rows[s].order):
                r = rows[slot]  # (None: preempted meanwhile)
                while r is not None and r is rows[slot] and \
                        not store.grow(slot, per_block, r.final):
                    victim = max(np.nonzero(active)[0], key=lambda s: rows[s].order)
                    store.release(victim)
                    queue.appendleft(rows[victim].req)
                    rows[victim], active[victim] = None, False
                    stats.preemptions += 1
            running = np.nonzero(active)[0]
            store.bind(running)
            t0 = time.perf_counter()
            out = self._decode(jnp.asarray(last), jnp.asarray(active),
                               jnp.asarray(remaining), jnp.asarray(count), keys,
                               jnp.asarray(store.stop_on_free(bool(queue))), hist, hist_len)
            buf, rounds = np.asarray(out["tokens"]), out.get("rounds")
            hist, hist_len = out.get("hist", hist), out.get("hist_len", hist_len)
            if rounds is not None:
                stats.accepted += int(np.sum(out["accepted"]))
                stats.proposed += int(np.sum(out["proposed"]))
            stats.decode_s += time.perf_counter() - t0
            n = int(out["steps"])
            stats.steps += n
            # rows running and the tokens their queries saw, step by step (a row grows
            # inside a block and may stop before it ends; its room was taken before)
            stats.occupied_slot_steps += int(out["occupied"])
            stats.max_running = max(stats.max_running, len(running))
            stats.live_kv_byte_steps += int(out["held"]) * store.bytes_per_token
            emitted = (buf >= 0) | (buf == NONFINITE)  # [rows, tokens] in order
            # steps (verify rounds) each row ran: a plain step emits one token
            store.account(stats, running, n, emitted.sum(axis=1) if rounds is None
                          else np.asarray(rounds))
            new_active = np.asarray(out["active"])
            for slot in running:
                r = rows[slot]
                made = [int(t) for t in buf[slot][emitted[slot]]]  # its tokens in order
                store.append(slot, ([int(last[slot])] + made)[:len(made)])  # the inputs
                book.emit(r.req.id, made)
                if not new_active[slot]:
                    store.release(slot)
                    book.finish(r.req, _stop(gen[r.req.id][-1], self.eos_ids), int(slot))
                    rows[slot] = None
            last, active = np.array(out["last"]), new_active.copy()
            remaining, count = np.array(out["remaining"]), np.array(out["count"])
        stats.wall_s = book.now()
        stats.tokens = sum(len(c.tokens) for c in book.done.values())
        return book.completions(), stats
