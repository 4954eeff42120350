"""A slot-based decode engine: requests prefilled on their own, inserted into free rows
of one batch cache while the other rows keep decoding.

The pattern of JetStream / MaxText's offline engine ("prefill, then insert into a slot";
github.com/AI-Hypercomputer/JetStream, ``engine_api.Engine.insert``): the batch cache
holds ``num_slots`` rows (a ragged cache, :mod:`kvjax.inference.ragged`); a request's
prompt is prefilled alone into a one-row cache (padded to a power-of-two bucket, so few
lengths compile), its first token is sampled, and the row is copied into a free slot
(:func:`insert_program`, one compile for any slot). :func:`decode_steps_program` then
advances every occupied slot by up to ``steps_per_sync`` tokens in one compiled loop;
empty slots are fed ``num_valid`` 0 (no write, no advance), so the same program serves
any occupancy. The loop returns early when a slot frees while requests wait, and the
host refills it.

A request's tokens do not depend on its batch-mates or its slot: each row attends only
to its own cache, and its sampling key is ``fold_in(request_key(seed, request id), j)``
for its j-th token (:func:`kvjax.inference.sampling.request_key`: all 64 bits of the id;
greedy decoding uses no key).

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
from kvjax.cache.policy import written_tokens
from kvjax.config import ModelConfig, SamplingConfig, SpeculativeConfig
from kvjax.inference import ragged
from kvjax.inference import speculative as spec_lib
from kvjax.inference import decode as decode_lib
from kvjax.inference.sampling import NONFINITE, check_request_id, request_key, request_keys

__all__ = ["Request", "Completion", "EngineStats", "Engine", "Ledger", "insert_program",
           "decode_steps_program", "prefill_bucket"]


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
    run, slot-steps occupied (sum over steps of occupied slots), live KV bytes summed
    over steps (occupied rows' held tokens x bytes per token), allocated KV bytes, slots."""

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


class Ledger:
    """The host bookkeeping both engines share for one run: the clock (seconds since the
    run started), the requests waiting in arrival order, each request's tokens with the
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
    for every slot) of the batch ``cache`` (donated; updated in place)."""

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
    return cache.replace(tensors=tensors, positions=put(cache.positions, row.positions, 0),
                         length=put(cache.length, row.length, 0))


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
      (tokens [B, steps] int32, -1 where a slot produced none; steps run [] int32;
      cache; last; active; remaining; count; occupied slot-steps [] int32; held tokens
      of occupied rows summed over steps [] int32).
    """
    def sample(logits, count, carry):
        return ragged.sample_rows(logits, keys, count, sampling), carry

    out = decode_lib.decode_loop(params, cfg, cache, last, active, remaining, count,
                                 eos_ids, sample, steps=steps, stop_on_free=stop_on_free,
                                 stats=True)
    return (out["tokens"], out["steps"], out["cache"], out["last"], out["active"],
            out["remaining"], out["count"], out["occupied"], out["held"])


class Engine:
    """Serves requests through ``num_slots`` rows of one ragged cache.

    Args:
      params: parameters in cfg's layout.
      cfg: the model.
      num_slots: rows of the batch cache (>= 1).
      max_seq_len: cache length per row in tokens (prompt + max_new_tokens must fit a
        dense cache; a window holds W).
      sampling: SamplingConfig (greedy by default).
      eos_ids: the end-of-generation ids (``Tokenizer.eos_token_ids``; one int is one
        id; empty: stop at budgets only).
      steps_per_sync: decode steps (speculative: verify rounds) per compiled call
        between host visits (>= 1).
      seed: base of the per-request sampling keys.
      speculative: a SpeculativeConfig: every call runs verify rounds of k + 1 tokens
        (:func:`kvjax.inference.speculative.engine_rounds_program`), a slot accepting its
        own number; greedy tokens equal plain decoding's, sampled ones follow the same
        distribution (the acceptance with per-request keys). Drafts: 'ngram' (prompt
        lookup over each slot's own tokens), 'self' (the same weights over the config's
        cheap cache) or 'model' (``draft``), whose cache is kept per slot beside the
        target's, prefilled with each admitted prompt. None or drafter 'none': plain
        steps.
      draft: (draft params, draft config) for drafter 'model'
        (:func:`kvjax.inference.runner.draft_model`); 'self' builds its own
        (:func:`kvjax.inference.speculative.draft_config`) when None.
    Raises:
      ValueError: a non-positive num_slots, max_seq_len or steps_per_sync.
      ConfigError: a drafter the config cannot build (:func:`check_draft`: 'model'
        without ``draft``, a draft with another vocabulary), before any work.
    """

    def __init__(self, params, cfg: ModelConfig, num_slots: int, max_seq_len: int,
                 sampling: SamplingConfig = SamplingConfig(),
                 eos_ids: int | Sequence[int] = (),
                 steps_per_sync: int = 8, seed: int = 0,
                 speculative: SpeculativeConfig | None = None, draft: tuple | None = None):
        for name, v in (("num_slots", num_slots), ("max_seq_len", max_seq_len),
                        ("steps_per_sync", steps_per_sync)):
            if int(v) < 1:
                raise ValueError(f"{name}={v}; allowed: an integer >= 1")
        if speculative is not None and not speculative.enabled:
            speculative = None
        if speculative is not None and speculative.drafter == "self" and draft is None:
            draft = spec_lib.self_draft(params, cfg, speculative)
        if speculative is not None:
            spec_lib.check_draft(cfg, None if draft is None else draft[1], speculative)
        elif draft is not None:
            raise ValueError("draft= without speculative=; allowed: a draft with a "
                             "SpeculativeConfig whose drafter is 'self' or 'model'")
        self.spec = speculative
        self.num_slots, self.max_seq_len = int(num_slots), int(max_seq_len)
        # the plans, resolved here on the host (never while tracing): the decode loop's
        # for num_slots rows (and its verify chunks), each prefill bucket's when first
        # used (_prefill_cfg)
        if cfg.plan is None:
            verify = () if self.spec is None else (self.spec.k + 1,)
            cfg = planner.resolve(cfg, max_seq_len=self.max_seq_len,
                                  batch_sizes=(self.num_slots,), queries=verify)
        self.params, self.cfg = params, cfg
        self._prefill_cfgs: dict[tuple, ModelConfig] = {}
        self.dparams = self.dcfg = self.draft_cache = None
        if draft is not None:  # the draft's plan: its steps over num_slots rows
            self.dparams, dcfg = draft
            k = self.spec.k
            self.dcfg = dcfg if dcfg.plan is not None else planner.resolve(
                dcfg, max_seq_len=self.max_seq_len + k + 1, batch_sizes=(self.num_slots,),
                rows=(2 * self.num_slots,))
            if not self.spec.copies_target_window:  # else copied from self.cache
                self.draft_cache = spec_lib.init_draft_cache(self.dcfg, self.num_slots,
                                                             self.max_seq_len, k)
        self._pending = jnp.zeros(self.num_slots, jnp.int32)
        self._has_pending = jnp.zeros(self.num_slots, bool)
        self._calls = 0
        self.sampling = sampling
        self.eos_ids = tuple(int(i) for i in np.atleast_1d(eos_ids) if int(i) >= 0)
        self._eos = decode_lib.eos_array(self.eos_ids)
        self.steps_per_sync, self.seed = int(steps_per_sync), int(seed)
        self.cache = self._empty_cache(self.num_slots)
        self.num_cache_slots = self.cache.num_slots
        self.bytes_per_token = cache_lib.cache_bytes(self.cache) / (
            self.num_slots * self.num_cache_slots)

    # ------------------------------------------------------------------ checks

    def check(self, req: Request) -> None:
        """Raises ValueError (naming the request) for an id < 0, an empty prompt, a budget < 1, or a
        prompt + budget that does not fit a dense cache (CacheOverflowError)."""
        check_request_id(req.id)  # every id it accepts has its own key (issue 54)
        if not len(req.prompt):
            raise ValueError(f"request {req.id}: empty prompt; allowed: at least one token")
        if int(req.max_new_tokens) < 1:
            raise ValueError(f"request {req.id}: max_new_tokens={req.max_new_tokens}; "
                             "allowed: an integer >= 1")
        cache_lib.policy_for(self.cfg).check_room(
            0, written_tokens(len(req.prompt), req.max_new_tokens),
            self.num_cache_slots,
            f"request {req.id} ({len(req.prompt)} prompt tokens + "
            f"{req.max_new_tokens} new)")

    # ------------------------------------------------------------------ units

    def _empty_cache(self, rows: int):
        """An empty ragged cache of ``rows`` rows (a speculative ring keeps k + 1 spare
        slots: :func:`kvjax.inference.speculative.init_target_cache`)."""
        if self.spec is not None:
            return spec_lib.init_target_cache(self.cfg, rows, self.max_seq_len, self.spec.k)
        return cache_lib.init_cache(self.cfg, rows, self.max_seq_len, ragged=True)

    def _decode(self, last, active, remaining, count, keys, stop_on_free, hist, hist_len):
        """One compiled call of plain steps or speculative rounds: (tokens [B, n'] (each
        slot's in order, -1 after), steps or rounds run, cache, last, active, remaining,
        count, occupied, held, hist, hist_len, accepted [B] or None, proposed)."""
        if self.spec is None:
            out = decode_steps_program(
                self.params, self.cache, last, active, remaining, count, keys, self._eos,
                stop_on_free, cfg=self.cfg, sampling=self.sampling,
                steps=self.steps_per_sync)
            return out + (hist, hist_len, None, None)
        self._calls += 1
        rng = jax.random.fold_in(jax.random.key(self.seed), self._calls)
        out = spec_lib.engine_rounds_program(
            self.params, self.dparams, self.cache, self.draft_cache, last, active,
            remaining, count, keys, self._eos, hist, hist_len, stop_on_free, self._pending,
            self._has_pending, rng, cfg=self.cfg, draft_cfg=self.dcfg, spec=self.spec,
            sampling=self.sampling, rounds=self.steps_per_sync)
        self.draft_cache, self._pending, self._has_pending = out[13:16]
        return out[:13]

    def _key(self, req_id: int) -> jax.Array:
        return request_key(jax.random.key(self.seed), req_id)

    def prefill(self, req: Request):
        """(first token id, one-row ragged cache holding the prompt, and the draft
        model's one-row cache holding it, or None)."""
        n = len(req.prompt)
        bucket = prefill_bucket(n)
        tokens, lengths = ragged.pad_prompts([req.prompt], length=bucket)
        tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
        row = self._empty_cache(1)
        logits, row = ragged.prefill_ragged_program(
            self.params, tokens, lengths, row, cfg=self._prefill_cfg(bucket))
        first = ragged.first_tokens(logits, self._key(req.id)[None], self.sampling)
        drow = None
        if self.draft_cache is not None:
            drow = spec_lib.init_draft_cache(self.dcfg, 1, self.max_seq_len, self.spec.k)
            _, drow = ragged.prefill_ragged_program(
                self.dparams, tokens, lengths, drow, cfg=self._prefill_cfg(bucket, True))
        return int(first[0]), row, drow

    def _prefill_cfg(self, bucket: int, draft: bool = False) -> ModelConfig:
        """The config of a one-row prefill of ``bucket`` tokens (the draft model's with
        ``draft``), with its plan (resolved once per bucket, on the host)."""
        if (bucket, draft) not in self._prefill_cfgs:
            cfg = self.dcfg if draft else self.cfg
            self._prefill_cfgs[bucket, draft] = planner.resolve(  # no decode step: no B
                cfg.replace(plan=None), max_seq_len=self.max_seq_len,
                batch_sizes=(), rows=(bucket,))
        return self._prefill_cfgs[bucket, draft]

    def warmup(self, requests: Sequence[Request]) -> float:
        """Compiles (by running once) the prefill of every length bucket ``requests``
        need, the insert and the decode loop, so :meth:`run` times serving, not XLA.
        Leaves every slot free. Returns the seconds spent."""
        t0 = time.perf_counter()
        for bucket in sorted({prefill_bucket(len(r.prompt)) for r in requests}):
            _, row, drow = self.prefill(Request(0, (0,) * bucket, 1))
        if requests:
            self.cache = insert_program(self.cache, row, jnp.int32(0))
            if drow is not None:
                self.draft_cache = insert_program(self.draft_cache, drow, jnp.int32(0))
            zeros = jnp.zeros(self.num_slots, jnp.int32)
            keys = request_keys(jax.random.key(self.seed), [0] * self.num_slots)
            hist, hist_len = spec_lib.slot_history(self.spec, self.num_slots,
                                                   self.max_seq_len)
            out = self._decode(zeros, jnp.zeros(self.num_slots, bool), zeros, zeros, keys,
                               jnp.asarray(False), hist, hist_len)
            self.cache = out[2]
            jax.block_until_ready(self.cache)
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
        ns = self.num_slots
        slot_req: list = [None] * ns
        last = np.zeros(ns, np.int32)
        active = np.zeros(ns, bool)
        remaining = np.zeros(ns, np.int32)
        count = np.zeros(ns, np.int32)
        keys = request_keys(jax.random.key(self.seed), [0] * ns)
        # speculative: each slot's tokens, for the n-gram drafts
        hist, hist_len = spec_lib.slot_history(self.spec, ns, self.max_seq_len)
        stats = EngineStats(allocated_kv_bytes=cache_lib.cache_bytes(self.cache),
                            num_slots=ns)
        queue = book.queue
        book.start = time.perf_counter()

        while queue or active.any():
            for slot in range(ns):
                if active[slot] or book.next_arrived() is None:
                    continue
                req = queue.popleft()
                first, row, drow = self.prefill(req)
                stats.prefills += 1
                book.emit(req.id, [first])
                if first in self.eos_ids or first == NONFINITE or req.max_new_tokens == 1:
                    book.finish(req, _stop(first, self.eos_ids), None)
                    continue
                self.cache = insert_program(self.cache, row, jnp.int32(slot))
                if drow is not None:  # the draft's row, and no pending draft token
                    self.draft_cache = insert_program(self.draft_cache, drow,
                                                      jnp.int32(slot))
                    self._pending = self._pending.at[slot].set(0)
                    self._has_pending = self._has_pending.at[slot].set(False)
                slot_req[slot] = req
                last[slot], active[slot] = first, True
                remaining[slot], count[slot] = req.max_new_tokens - 1, 1
                keys = keys.at[slot].set(self._key(req.id))
                if hist is not None:
                    hist, hist_len = spec_lib.put_slot_history(
                        hist, hist_len, slot, list(req.prompt) + [first])
            if not active.any():
                book.wait_for_arrival()
                continue
            t0 = time.perf_counter()
            out = self._decode(jnp.asarray(last), jnp.asarray(active),
                               jnp.asarray(remaining), jnp.asarray(count), keys,
                               jnp.asarray(bool(queue)), hist, hist_len)
            (buf, n, self.cache, last_d, active_d, rem_d, count_d, occ, held, hist,
             hist_len, acc, prop) = out
            buf = np.asarray(buf)
            if acc is not None:
                stats.accepted += int(np.sum(acc))
                stats.proposed += int(np.sum(prop))
            stats.decode_s += time.perf_counter() - t0
            n = int(n)
            stats.steps += n
            stats.occupied_slot_steps += int(occ)
            stats.live_kv_byte_steps += int(held) * self.bytes_per_token
            new_active = np.asarray(active_d)
            for slot in np.nonzero(active)[0]:
                req = slot_req[slot]
                toks = buf[slot]  # its tokens in order, -1 after
                book.emit(req.id, [int(t) for t in toks[(toks >= 0) | (toks == NONFINITE)]])
                if not new_active[slot]:
                    book.finish(req, _stop(book.tokens[req.id][-1], self.eos_ids),
                                int(slot))
                    slot_req[slot] = None
            last, active = np.array(last_d), new_active.copy()
            remaining, count = np.array(rem_d), np.array(count_d)
        stats.wall_s = book.now()
        stats.tokens = sum(len(c.tokens) for c in book.done.values())
        return book.completions(), stats
