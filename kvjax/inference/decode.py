"""Prefill and generation: one compiled prefill, one compiled decode loop, cache donated.

* :func:`prefill` runs the whole prompt in one pass (matrix-matrix: compute-bound);
  :func:`prefill_chunked` feeds it a fixed number of tokens at a time.
* :func:`generate` runs the new tokens inside one ``lax.while_loop`` (matrix-vector:
  memory-bound, the blog's regime). The step count is a traced argument and the token
  buffer's length comes from the cache's slot policy (:func:`token_buffer_len`), so one
  compilation serves any number of steps that fits the buffer.

The compile units, public so the cost hook and the runner lower and compile exactly what
decoding runs (``unit.lower(...).compile()``), without host checks:

* :func:`prefill_program` (params, tokens, cache) -> (last logits, cache);
* :func:`generate_program` (params, first_token, cache, num_steps, rng, eos_ids);
* :func:`decode_step` (params, token, cache) -> (logits, cache): one step.

Each row's positions come from its own ``cache.length`` (per-row bookkeeping). Lengths
are checked on the host before anything runs: a prompt longer than the cache or a budget
past its end raises :class:`kvjax.cache.policy.CacheOverflowError`, never a silent clamp.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import KVCache, policy_for
from kvjax.cache import compress as compress_lib
from kvjax.cache import kv as cache_lib
from kvjax.config import ModelConfig, SamplingConfig
from kvjax.models import model as model_lib
from kvjax.inference.sampling import is_stop, sample_logits

__all__ = ["check_room", "prefill", "generate", "eos_array",
           "prefill_program", "generate_program", "decode_step", "decode_loop",
           "token_buffer_len", "compile_unit", "place"]

ROLES = ("params", "rows", "cache")


@dataclasses.dataclass(frozen=True)
class Roles:
    """What each array argument and output of a compile unit is, for a placement to map
    to shardings: 'params' (the parameter tree), 'rows' (split by batch row: tokens,
    lengths, budgets, keys), 'cache' (the KV cache, donated), None (left to the compiler:
    step counts, keys, eos ids).

    Attributes:
      args: one role per positional argument. outs: one role per output.
    """

    args: tuple
    outs: tuple

    def __post_init__(self):
        bad = [r for r in self.args + self.outs if r is not None and r not in ROLES]
        if bad or "cache" not in self.args:
            raise ValueError(f"roles {self.args} -> {self.outs}; allowed: {ROLES} or None, "
                             "with the cache among the arguments (it is donated)")


def compile_unit(*, static: tuple, args: tuple, outs: tuple):
    """Declares a compile unit once: ``body``'s keyword-only ``static`` arguments, the cache
    donated, and the :class:`Roles` of its arguments and outputs. Returns ``body`` jitted
    (static arguments named at each call: the library's unit) carrying ``.roles``, from
    which :func:`place` builds the same unit for one device or a mesh."""
    roles = Roles(tuple(args), tuple(outs))

    def wrap(body: Callable):
        unit = jax.jit(body, static_argnames=static, donate_argnames=("cache",))
        unit.roles = roles
        return unit
    return wrap


def place(unit, shardings: dict | None = None, **static):
    """``unit`` (a :func:`compile_unit`) jitted with its ``static`` arguments bound and the
    cache donated: positional arguments only, so ``.lower(*args)`` and calls read alike
    on one device and on a mesh.

    Args:
      unit: a compile unit of this package (``decode.prefill_program``, ...).
      shardings: {role: sharding} for a mesh (:class:`Roles`; a role it lacks, and None,
        are left to the compiler); None: one device, no shardings.
      **static: the unit's static arguments (``cfg``, ``sampling``, ...).
    """
    roles = unit.roles
    fn = functools.partial(unit.__wrapped__, **static)
    donate = (roles.args.index("cache"),)
    if shardings is None:
        return jax.jit(fn, donate_argnums=donate)
    pick = lambda rs: tuple(None if r is None else shardings.get(r) for r in rs)
    return jax.jit(fn, in_shardings=pick(roles.args), out_shardings=pick(roles.outs),
                   donate_argnums=donate)


def eos_array(eos_ids: int | Sequence[int] = (), size: int | None = None) -> jax.Array:
    """[E] int32 of end-of-generation ids for the loops' ``eos_ids`` argument.

    Args:
      eos_ids: an id or a sequence of ids (``Tokenizer.eos_token_ids``); -1 never matches.
      size: pad with -1 to this many entries (the same E, so the same compiled loop, for
        a run that ignores EOS: ``eos_array((), len(tok.eos_token_ids))``).
    Raises:
      ValueError: more ids than ``size``.
    """
    ids = [int(eos_ids)] if np.ndim(eos_ids) == 0 else [int(i) for i in eos_ids]
    if size is not None:
        if len(ids) > size:
            raise ValueError(f"{len(ids)} eos ids {ids}; allowed: at most size={size}")
        ids = ids + [-1] * (size - len(ids))
    return jnp.asarray(ids or [-1], jnp.int32)


def check_room(cfg: ModelConfig, cache: KVCache, new_tokens: int, what: str) -> None:
    """Raises CacheOverflowError unless ``new_tokens`` more tokens fit in every row of
    ``cache`` (the slot policy decides: a ring never fills). Reads ``cache.length``
    from the device."""
    policy_for(cfg).check_room(jax.device_get(cache.length), new_tokens, cache.num_slots,
                               what)


def _positions(cache: KVCache, t: int) -> jax.Array:
    """[B, T] int32: each row continues its own cache."""
    return cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


@compile_unit(static=("cfg", "fresh"), args=("params", "rows", "cache"),
              outs=("rows", "cache"))
def prefill_program(params, tokens, cache, *, cfg, fresh=False):
    """Compile unit of :func:`prefill` (no host checks): tokens [B, T] int32 ->
    (logits [B, V] float32 of the last token, cache). ``fresh``: the cache is empty
    (see ``model.forward``: attention reads none of its slots). A short chunk runs the
    decode step's formulation, so the cache's never-written slots are cleared first
    (``model.clear_masked_slots``). With ``cfg.kv_compression`` a fresh prompt is
    prefilled into a full cache and compressed (:func:`prefill_compressed`); a later
    chunk goes to the compressed cache's ring."""
    if fresh and cfg.kv_evicts:
        return prefill_compressed(params, tokens, cfg, cache.ragged,
                                  num_slots=cache.num_slots)
    if not fresh:
        cache = model_lib.clear_masked_slots(cfg, cache, tokens.shape[1])
    logits, cache = model_lib.forward(params, cfg, tokens,
                                      _positions(cache, tokens.shape[1]), cache,
                                      fresh=fresh, last_only=True)
    return logits[:, -1], cache


def prefill_compressed(params, tokens: jax.Array, cfg: ModelConfig, ragged: bool = False,
                       num_valid: jax.Array | None = None, num_slots: int | None = None):
    """Lever 5 (traced): the prompt ``tokens`` [B, T] int32 prefilled into a full cache
    of max(T, the largest layer budget) slots under :func:`kvjax.cache.compress.prompt_config`, whose
    slots ``cfg.kv_compression`` scores with the queries it reads (``model.forward``'s
    ``observe``) and compresses (:func:`kvjax.cache.compress.compress`).

    Args:
      num_valid: [B] int32 real tokens of right-padded rows (None: all T); needs
        ``ragged``. Each row is scored and compressed on its own tokens.
      num_slots: slots per row of the cache the caller gave (its ``positions``: the
        smallest layer's), whose ring after the kept slots the compressed cache takes
        (a speculative target's k + 1 spare included); None: kv_budget + recent_slots.
    Returns:
      (logits [B, V] float32 of each row's last real token, the compressed cache of
      kv_budget + recent_slots slots (or ``num_slots``), or per layer b_i +
      recent_slots).
    """
    pcfg = compress_lib.prompt_config(cfg)
    b, t = tokens.shape
    full = cache_lib.init_cache(pcfg, b, compress_lib.prompt_slots(cfg, t), ragged=ragged)
    logits, full, queries = model_lib.forward(
        params, pcfg, tokens, _positions(full, t), full, num_valid=num_valid, fresh=True,
        last_only=True, observe=True)
    ring = None if num_slots is None else \
        num_slots - min(compress_lib.layer_budgets(cfg))
    return logits[:, -1], compress_lib.compress_prompt(cfg, full, queries, t, ring)


def prefill(params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache):
    """Runs the prompt through the model in one pass, filling the cache.

    Args:
      params: parameters in cfg's layout.
      tokens: [B, T] int32 prompt ids (all rows the same length).
      cache: the cache to fill (donated: do not reuse the argument).
    Returns:
      (logits [B, V] float32 of the last prompt token, updated cache).
    Raises:
      CacheOverflowError: the prompt does not fit in the cache.
    """
    check_room(cfg, cache, tokens.shape[1], "prefill")
    return prefill_program(params, tokens, cache, cfg=cfg, fresh=is_empty(cache))


def is_empty(cache: KVCache) -> bool:
    """True when no token was written to ``cache`` yet (reads its length on the host)."""
    return not bool(jnp.any(cache.length))


def chunk_lengths(prompt_len: int, chunk: int) -> list[int]:
    """Lengths of the chunks :func:`prefill_chunked` feeds: ``chunk`` repeated, then the
    remainder (if any). Raises ValueError unless both are positive integers."""
    for name, v in (("prompt_len", prompt_len), ("chunk", chunk)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r}; allowed: a positive integer")
    return [chunk] * (prompt_len // chunk) + ([prompt_len % chunk] if prompt_len % chunk
                                              else [])


def prefill_chunked(params, cfg: ModelConfig, tokens: jax.Array, cache: KVCache,
                    chunk: int):
    """:func:`prefill` ``chunk`` tokens at a time: each chunk attends to the cache's
    slots so far and to itself, then is written.

    Every full chunk runs the same compiled program (``prefill_program`` at T = chunk, whatever
    the prompt length and the chunk's place); a last partial chunk of T mod chunk tokens
    runs a second one. Peak memory is that of a chunk-long prefill; the weights are read
    once per chunk. Same logits and cache as :func:`prefill` (to float32 rounding).

    Args:
      params, cfg, tokens [B, T] int32, cache (donated): as :func:`prefill`.
      chunk: tokens per chunk (> 0; >= T is one chunk).
    Returns:
      (logits [B, V] float32 of the last prompt token, updated cache).
    Raises:
      ValueError: chunk not a positive integer.
      CacheOverflowError: the prompt does not fit in the cache.
    """
    lengths = chunk_lengths(tokens.shape[1], chunk)
    check_room(cfg, cache, tokens.shape[1], "prefill")
    start, logits = 0, None
    for n in lengths:
        logits, cache = prefill_program(params, tokens[:, start:start + n], cache, cfg=cfg)
        start += n
    return logits, cache


@compile_unit(static=("cfg",), args=("params", "rows", "cache"), outs=("rows", "cache"))
def decode_step(params, token, cache, *, cfg):
    """One decode step: token [B, 1] int32 at position cache.length -> (logits [B, V], cache).

    No host-side length check (it is the unit the cost hook compiles); use
    :func:`generate` for checked decoding.
    """
    logits, cache = model_lib.forward(params, cfg, token, _positions(cache, 1), cache)
    return logits[:, 0], cache


def token_buffer_len(cfg: ModelConfig, num_slots: int, num_steps: int) -> int:
    """Length of :func:`generate`'s token buffer (static: a new length compiles a new loop),
    from the slot policy: dense, the cache's ``num_slots`` (no more steps fit); a ring,
    which never fills, the next power of two >= ``num_steps`` (at least ``num_slots``),
    so few lengths ever compile."""
    return policy_for(cfg).buffer_len(num_slots, num_steps)


@compile_unit(static=("cfg", "sampling", "buf_len"),
              args=("params", "rows", "cache", None, None, None),
              outs=("rows", None, "cache"))
def generate_program(params, first_token, cache, num_steps, rng, eos_ids, *, cfg, sampling,
                     buf_len=None):
    """Compile unit of :func:`generate` (no host checks): first_token [B] int32, cache,
    num_steps [] int32, rng key, eos_ids [E] int32 (every end-of-generation id; -1 entries
    never match; a scalar is one id) -> (tokens [B, buf_len] int32, -1 after a row's
    stop token; steps run [] int32; cache). ``buf_len``: token buffer length (None: the
    cache's slots); steps past it never run. One compilation serves any ids of the same
    count E. The cache's never-written slots are cleared once on entry
    (``model.clear_masked_slots``), not per step."""
    batch = first_token.shape[0]
    buf_len = cache.num_slots if buf_len is None else buf_len
    cache = model_lib.clear_masked_slots(cfg, cache)

    def sample(logits, count, rng):
        rng, key = jax.random.split(rng)
        return sample_logits(logits, key, sampling), rng

    active = ~is_stop(first_token, eos_ids) & (num_steps > 0)
    out = decode_loop(params, cfg, cache, first_token, active,
                      jnp.full((batch,), num_steps, jnp.int32), jnp.zeros((batch,), jnp.int32),
                      eos_ids, sample, rng, steps=buf_len, lockstep=True)
    return out["tokens"], out["steps"], out["cache"]


def decode_loop(params, cfg: ModelConfig, cache: KVCache, last, active, remaining, count,
                eos_ids, sample, carry=None, *, steps: int, lockstep: bool = False,
                stop_on_free=None, stats: bool = False) -> dict:
    """The one decode loop: up to ``steps`` decode steps of the active rows in one
    ``lax.while_loop``; the lockstep generate loop, the ragged one
    (``ragged.generate_ragged_program``) and the slot engine's
    (``engine.decode_steps_program``) are this loop with their own arguments. Traced
    (call it inside jit); the caller clears the cache's never-written slots
    (``model.clear_masked_slots``).

    Args:
      params, cfg: the model.
      cache: the cache the rows continue (ragged, or lockstep with ``lockstep``).
      last: [B] int32 each row's last token (fed first).
      active: [B] bool rows that decode; a row stops at a stop token (kept), where its
        logits are not finite (``sampling.NONFINITE``, a stop token) or when
        ``remaining`` reaches 0.
      remaining: [B] int32 tokens each row may still emit.
      count: [B] int32 tokens each row emitted so far (the ``count`` handed to
        ``sample``: the index of a row's next sampling key).
      eos_ids: [E] int32 end-of-generation ids (-1 never matches).
      sample: fn(logits [B, V] float32, count [B] int32, carry) -> (tokens [B] int32,
        carry): the sampler (a shared key split per step, or per-row keys).
      carry: the sampler's state (e.g. a PRNG key), or None.
      steps: (static) the token buffer's length; no more steps run.
      lockstep: (static) every row is fed every step (a lockstep cache writes all rows
        in place; rows that stopped emit -1); else stopped rows are fed with
        ``num_valid`` 0 (nothing written, length kept).
      stop_on_free: [] bool or None: end the loop once any row stops (the engine, with
        requests waiting).
      stats: (static) count occupied row-steps and the tokens they held.
    Returns:
      dict: 'tokens' [B, steps] int32 (-1 where a row emitted none), 'steps' [] int32
      run, 'cache', 'last', 'active', 'remaining', 'count', 'occupied' [] int32 (active
      row-steps; 0 without ``stats``), 'held' [] int32 (tokens the active rows held,
      summed over steps; 0 without ``stats``).
    """
    b = last.shape[0]
    slots = cache.num_slots
    zero = jnp.zeros((), jnp.int32)
    stop_on_free = jnp.zeros((), bool) if stop_on_free is None else stop_on_free

    def cond(s):
        return (s["i"] < steps) & jnp.any(s["active"]) & ~(stop_on_free & s["freed"])

    def body(s):
        active, cache = s["active"], s["cache"]
        occ, held = s["occupied"], s["held"]
        if stats:
            occ = occ + jnp.sum(active.astype(jnp.int32))
            held = held + jnp.sum(jnp.where(
                active, policy_for(cfg).held(cache.length, slots), 0))
        logits, cache = _step(params, cfg, s["last"], cache,
                              None if lockstep else active.astype(jnp.int32))
        nxt, carry = sample(logits[:, 0], s["count"], s["carry"])
        nxt = jnp.where(active, nxt, -1)
        buf = jax.lax.dynamic_update_slice(s["tokens"], nxt[:, None], (0, s["i"]))
        step = active.astype(jnp.int32)
        remaining = s["remaining"] - step
        finished = active & (is_stop(nxt, eos_ids) | (remaining <= 0))
        return dict(i=s["i"] + 1, tokens=buf, cache=cache,
                    last=jnp.where(active, nxt, s["last"]), active=active & ~finished,
                    remaining=remaining, count=s["count"] + step,
                    freed=s["freed"] | jnp.any(finished), occupied=occ, held=held,
                    carry=carry)

    state = dict(i=zero, tokens=jnp.full((b, steps), -1, jnp.int32), cache=cache,
                 last=last, active=active & (remaining > 0), remaining=remaining,
                 count=count, freed=jnp.zeros((), bool), occupied=zero, held=zero,
                 carry=carry)
    s = jax.lax.while_loop(cond, body, state)
    return dict(tokens=s["tokens"], steps=s["i"], cache=s["cache"], last=s["last"],
                active=s["active"], remaining=s["remaining"], count=s["count"],
                occupied=s["occupied"], held=s["held"])


def _step(params, cfg: ModelConfig, last: jax.Array, cache: KVCache, num_valid):
    """One decode step of the loop: ``last`` [B] int32 -> (logits [B, 1, V], cache).
    With schedule 'every_n' (``cache.schedule``) the step's queries are buffered and
    the rows whose ring holds ``every_n`` new tokens are compressed again, under a
    ``lax.cond`` that runs the scoring only when some row is due
    (:func:`kvjax.cache.compress.recompress`)."""
    positions = _positions(cache, 1)
    if cache.schedule is None:  # no decode-time compression (paged rows: never)
        return model_lib.forward(params, cfg, last[:, None], positions, cache,
                                 num_valid=num_valid)
    logits, cache, queries = model_lib.forward(params, cfg, last[:, None], positions,
                                               cache, num_valid=num_valid, observe=True)
    written = jnp.ones_like(last, bool) if num_valid is None else num_valid > 0
    cache = compress_lib.observe_step(cache, queries, positions[:, 0], written)
    due = compress_lib.due_rows(cfg, cache)
    cache = jax.lax.cond(jnp.any(due), lambda c: compress_lib.recompress(cfg, c, due),
                         lambda c: c, cache)
    return logits, cache


def generate(params, cfg: ModelConfig, first_token: jax.Array, cache: KVCache,
             num_steps: int, rng: jax.Array | None = None,
             sampling: SamplingConfig = SamplingConfig(),
             eos_ids: int | Sequence[int] = ()):
    """Generates up to ``num_steps`` tokens after ``first_token`` in one compiled loop.

    Each step feeds the previous token, appends its key/value to the cache and samples the
    next one. A row stops at any of ``eos_ids`` (that token is kept, later entries are
    -1), or where its logits are not finite (that entry is
    :data:`kvjax.inference.sampling.NONFINITE`, later ones -1); the loop ends when
    every row has stopped or after ``num_steps`` steps. One compilation serves any
    ``num_steps`` up to the cache length (windowed caches: any number of steps, which may
    wrap the ring many times; one compilation per power-of-two bucket of ``num_steps``).

    Args:
      params: parameters in cfg's layout.
      first_token: [B] int32, the token sampled from the prefill logits.
      cache: the prefilled cache (donated).
      num_steps: tokens to generate after first_token (>= 0).
      rng: PRNG key for sampling (default key 0).
      sampling: SamplingConfig (static: a new one compiles a new loop).
      eos_ids: the end-of-generation ids (``Tokenizer.eos_token_ids``; one int is one
        id; empty or -1: never stop early).
    Returns:
      (tokens [B, num_steps] int32, steps actually run (int), updated cache).
    Raises:
      CacheOverflowError: the steps would write past the cache's end.
      ValueError: negative num_steps.
    """
    if num_steps < 0:
        raise ValueError(f"num_steps={num_steps}; allowed: an integer >= 0")
    check_room(cfg, cache, num_steps, "generate")
    rng = jax.random.key(0) if rng is None else rng
    buf, steps, cache = generate_program(params, first_token.astype(jnp.int32), cache,
                                  jnp.int32(num_steps), rng, eos_array(eos_ids),
                                  cfg=cfg, sampling=sampling,
                                  buf_len=token_buffer_len(cfg, cache.num_slots, num_steps))
    return buf[:, :num_steps], int(steps), cache

