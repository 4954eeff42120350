"""Resolves a config's execution plan before tracing, measuring the machine at hand.

:func:`resolve` is called once, eagerly, by whoever builds a program (the runner, the
benchmarks, the engine): it loads the native CPU kernels the config may use and, for
every 'auto' formulation, picks one per shape class of the programs to come
(decode attention per cache class, :func:`kvjax.models.decode_kernels.shape_class`;
weight products per (M, K, N, layout) class, :func:`kvjax.plan.weight_class`), and
returns the config with its :class:`kvjax.plan.Plan`. Nothing here runs while a program
is traced: the models only read the plan.

A pick times every formulation that applies on the class's own shapes, from memory
(:data:`FLUSH_BYTES`), and keeps the fastest where the rule of :func:`_decide` says it
beats 'xla' beyond the noise (docs/decisions/0007-planner-times-cold.md,
0008-planner-weight-chain.md, 0009-planner-noise-rule.md). Picks are cached on disk per
machine (:func:`machine_key`, :func:`cache_dir`; docs/GUIDE.md, "The planner's
cache") and listed by :func:`report_lines`. Classes below :data:`MIN_MEASURED_BYTES`
take 'xla' unmeasured; on GPU decode attention is 'pallas' where it applies; on TPU,
for another backend than the process's and on a mesh of several devices, 'xla'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import operator
import os
import pathlib
import statistics
import sys
import threading
import time
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import kernels, native
from kvjax.analysis import hardware, theory
from kvjax.config import ModelConfig
from kvjax.cache import compress as compress_lib
from kvjax.cache import paged
from kvjax.models import decode_kernels
from kvjax.models import model as model_lib
from kvjax.models import weight_matmul as wm
from kvjax.models.attention import SMALL_CHUNK, attend_step
from kvjax.native import prefill as native_prefill
from kvjax.native import rows_matmul as rm
from kvjax.plan import Plan, row_band, weight_class

MIN_MEASURED_BYTES = 256 * 1024
CANDIDATES = tuple(f.name for f in kernels.formulations("decode_attention") if f.measured)
"""The decode-attention formulations the planner times (the registry's measured ones)."""
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")
_lock = threading.RLock()
_memo: dict[str, dict] = {}


def _cpu() -> tuple[str, list[str]]:
    ident = native.machine_id()
    model, _, flags = ident.partition("|")
    have = set(flags.split())
    return model or "unknown", [f for f in ISA_FLAGS if f in have]


def machine_key(backend: str | None = None,
                kernel: str | tuple[str, ...] = "decode_attention.cc") -> dict:
    """What the planner's choices depend on: {'cpu', 'isa', 'cores', 'backend', 'jax',
    'jaxlib', 'kernel', 'measure'} ('kernel': hash of the native kernel's source,
    ``kernel`` under kvjax/native: 'decode_attention.cc' or 'rows_matmul.cc', or a tuple
    of them, every source hashed (:data:`STEP_KERNELS`); 'measure':
    :data:`MEASURE_METHOD`)."""
    import jaxlib  # noqa: PLC0415
    model, isa = _cpu()
    here = pathlib.Path(native.__file__)
    names = (kernel,) if isinstance(kernel, str) else kernel
    src = b"".join(here.with_name(n).read_bytes() for n in names) + native.headers().encode()
    return {"cpu": model, "isa": isa, "cores": native.num_threads(),
            "backend": backend or backend_lib.current(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "kernel": hashlib.sha256(src).hexdigest()[:12],
            "measure": MEASURE_METHOD if measures_cold() else WARM_METHOD}


PLANNER_CACHE_ENV = "KVJAX_PLANNER_CACHE"
PLANNER_MEASURE_ENV = "KVJAX_PLANNER_MEASURE"
"""How :func:`resolve` measures the picks it lacks: 'cold' (unset: the caches flushed
before every timed call, :data:`FLUSH_BYTES`) or 'warm' (no flush). The test suite sets
'warm' for its session (tests/conftest.py): its picks are thrown away with the session,
and the flush was most of a pick's time there (docs/decisions/0040-test-picks-warm.md).
Warm picks are cached apart from cold ones (:data:`WARM_METHOD` in the key)."""


def measures_cold() -> bool:
    """Whether :func:`resolve` measures cold (``$KVJAX_PLANNER_MEASURE`` unset or 'cold')
    or warm ('warm').

    Raises:
      ValueError: another value, naming it and the allowed ones.
    """
    how = os.environ.get(PLANNER_MEASURE_ENV, "cold")
    if how not in ("cold", "warm"):
        raise ValueError(f"${PLANNER_MEASURE_ENV}={how!r}; allowed: 'cold' (the default) "
                         "or 'warm'")
    return how == "cold"


def cache_dir() -> pathlib.Path:
    """Where the planner's cache files live: ``$KVJAX_PLANNER_CACHE`` if set (the test
    suite points it at a temporary folder, so picks measured while its workers load the
    cores never reach the user's cache), else ``planner/`` under
    :func:`kvjax.native.cache_root`."""
    own = os.environ.get(PLANNER_CACHE_ENV)
    return pathlib.Path(own) if own else native.cache_root() / "planner"


def cache_path(key: dict | None = None, kind: str = "decode_attention") -> pathlib.Path:
    """The planner cache file for ``key`` (default: this machine's) and ``kind``
    ('decode_attention' or 'weight_matmul'), under :func:`cache_dir`."""
    key = key or machine_key()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / f"{kind}-{digest}.json"


def load_cache(path: pathlib.Path, key: dict, allowed=None) -> dict:
    """The entries of the planner cache at ``path`` if it belongs to ``key``; {} (with a
    warning naming the file and why) if it is corrupt or foreign; {} if absent.
    ``allowed``: the valid choices (default: the decode-attention formulations)."""
    allowed = kernels.names("decode_attention", auto=False) if allowed is None else allowed
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("not a planner cache (no 'entries' mapping)")
        if data.get("machine") != key:
            raise ValueError(f"recorded for {data.get('machine')!r}, this is {key!r}")
        entries = data["entries"]
        for name, e in entries.items():
            if not isinstance(e, dict) or e.get("choice") not in allowed:
                raise ValueError(f"entry {name!r} has no valid 'choice'")
        return entries
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError;
        # RecursionError: a file of deeply nested brackets
        warnings.warn(f"ignoring planner cache {path}: {e}; re-measuring", stacklevel=3)
        return {}


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """Holds an exclusive lock on ``path``'s ``.lock`` file (POSIX ``flock``) while the
    block runs; without one where ``fcntl`` is missing or the lock cannot be taken (a
    file system without flock, a ``.lock`` file of another user's): the write is then
    as before locking, atomic but last-writer-wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = None
    try:
        import fcntl  # noqa: PLC0415 (POSIX only)
        f = open(path.with_suffix(".lock"), "a")  # noqa: SIM115 (closed below)
        fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):
        if f is not None:
            f.close()
            f = None
    try:
        yield
    finally:
        if f is not None:
            f.close()  # closing the file releases its flock


def _save(path: pathlib.Path, key: dict, entries: dict, allowed=None) -> None:
    """Writes ``entries`` to the planner cache at ``path`` (atomically: a temporary file
    renamed over it), first adding to ``entries`` those the file gained since it was read
    (another process measuring other classes at the same time), under a lock, so that
    two processes filling one cache keep both their picks. ``allowed`` as in
    :func:`load_cache`; an unreadable file adds nothing (it was warned about when read)."""
    with _locked(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            on_disk = load_cache(path, key, allowed)
        for name, e in on_disk.items():
            entries.setdefault(name, e)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"machine": key, "entries": entries}, indent=1,
                                  sort_keys=True))
        os.replace(tmp, path)


FLUSH_BYTES = 256 * 2**20
"""Bytes read before every timed call of a measurement (:func:`_time`), so that no
operand is in the CPU's caches when the call starts, as in a decode step: between one
step's read of a layer's weights or cache and the next step's, the rest of the step
(~0.5 GB for SmolLM2 in float32) has evicted them. Measured warm, a one-layer cache or
a 48 MB weight stream is read partly from the last-level cache, far faster than a step
reads it (docs/decisions/0007-planner-times-cold.md). 256 MiB:
:class:`kvjax.analysis.hardware.ReadProbe`'s read."""
MEASURE_METHOD = f"cold-{FLUSH_BYTES >> 20}MiB-chain-iqr-mannwhitney"
"""How picks are measured and decided (flushed caches, chained weight products, the
rule of :func:`_decide`): part of the cache key (:func:`machine_key`), so picks
measured or decided another way are measured again."""
WARM_METHOD = "warm-chain-iqr-mannwhitney"
""":data:`MEASURE_METHOD` without the flush (``$KVJAX_PLANNER_MEASURE=warm``)."""


def _native_kernels() -> tuple:
    """:data:`kvjax.kernels.NATIVE` as :func:`measure` may run them here: without the
    block sweep where this machine's kernel has none (:func:`kvjax.native.block_sweep`)."""
    return tuple(n for n in kernels.NATIVE
                 if n != "decode_attention_blocks" or native.block_sweep())


def _flusher():
    """A callable that reads :data:`FLUSH_BYTES` (evicting the caches); it holds that
    buffer until it is dropped, at the end of the measurement."""
    probe = hardware.ReadProbe("sum", FLUSH_BYTES)
    return probe.once


def _time_all(fns: dict, args: tuple, rounds: int, budget_s: float,
              flush=None, warmups: int = 2) -> dict[str, list[float]]:
    """Seconds of each timed call of each compiled fn, in interleaved rounds after
    ``warmups`` untimed ones; ``flush()`` (untimed) before every timed call when given.
    At least 3 rounds, then rounds until ``rounds`` or ``budget_s`` seconds."""
    for _ in range(warmups):
        for f in fns.values():
            jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {n: [] for n in fns}
    start = time.perf_counter()
    for r in range(rounds):
        for n, f in fns.items():
            if flush is not None:
                flush()
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[n].append(time.perf_counter() - t0)
        if r >= 2 and time.perf_counter() - start > budget_s:
            break
    return times


def _time(fns: dict, args: tuple, rounds: int, budget_s: float,
          flush=None) -> dict[str, float]:
    """Median seconds of each compiled fn (:func:`_time_all`)."""
    return {n: statistics.median(t) for n, t in _time_all(fns, args, rounds, budget_s,
                                                          flush).items()}


MIN_GAIN = 0.03
"""The least relative gain over 'xla' a pick must show, whatever its calls' spread."""
ALPHA = 0.002
"""One-sided level of :func:`_decide`'s rank test at each look. :func:`_measure` looks
after every batch of rounds, at most :data:`MAX_CALLS` / rounds times (9 at the default
7 rounds), so a formulation no faster than xla is picked by chance in under 2% of
measurements (tests/test_planner_noise.py counts it)."""
TIE_CALLS = 21
"""Calls per candidate before medians within :data:`MIN_GAIN` count as a tie."""
MAX_CALLS = 63
"""Timed calls per candidate after which an undecided pick stops measuring (and keeps
'xla'); :data:`EXTRA_BUDGET_S` bounds the added rounds' time as well."""
EXTRA_BUDGET_S = 6.0


class Decision(NamedTuple):
    """What :func:`_decide` concluded from the timed calls: the formulation, the rule
    that chose it (one line, printed and cached), whether the calls decided it (False:
    still inside the noise, 'xla' kept for now), and the rank test's p-value (None where
    no test ran)."""
    choice: str
    rule: str
    decided: bool
    p_value: float | None = None


def mann_whitney_p(faster: list[float], slower: list[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test (Mann and Whitney 1947) that the
    calls of ``faster`` take less time than those of ``slower`` (seconds; any lengths >=
    1): the chance of a rank sum this low were both drawn from one distribution, by the
    normal approximation with the tie correction and a continuity correction of 1/2.
    Returns 1.0 where every call ties."""
    n1, n2 = len(faster), len(slower)
    both = np.asarray(list(faster) + list(slower), float)
    order = np.argsort(both, kind="stable")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    ranks = (sums / counts)[inverse]  # tied calls share their mean rank
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - float((counts ** 3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (u - n1 * n2 / 2 + 0.5) / math.sqrt(var)
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def _decide(calls: dict[str, list[float]], ref: str = "xla",
            variants: dict[str, str] | None = None) -> Decision:
    """The formulation of ``calls`` ({name: its timed calls' seconds}) a pick keeps, and
    the rule that kept it. ``alt``, the fastest other than ``ref`` (the reference: 'xla',
    the reference of every op, :data:`kvjax.kernels.REFERENCE`) by median, against
    ``ref``, in this order:

    1. no ``ref`` timed: the fastest median;
    2. the one-sided Mann-Whitney test (:func:`mann_whitney_p`) that the calls of the
       lower median are faster, at level :data:`ALPHA`: when it passes, the faster,
       unless it is ``alt`` and beats ref's median by less than :data:`MIN_GAIN`;
    3. medians within :data:`MIN_GAIN` of each other after :data:`TIE_CALLS` calls
       each: ``ref`` (nothing to gain);
    4. else undecided: ``ref`` for now, and :func:`_measure` times more rounds
       (docs/decisions/0009-planner-noise-rule.md).

    ``variants`` ({name: the formulation it is a variant of}): a pick that is a variant
    of another timed formulation ('native_blocks' of 'native') must then win against
    that one by the same rules, with it as the reference; where it does not, that one
    must win against ``ref`` by them in turn, else ``ref`` is kept
    (docs/decisions/0052-grouped-decode-blocks-per-machine.md). Every rule's line is
    kept; it is decided when each rule that ran is.
    """
    first = _decide_against(calls, ref)
    variant = first.choice
    base = (variants or {}).get(variant)
    if base is None or base not in calls:
        return first
    won, rule, decided, p = _decide_against({base: calls[base], variant: calls[variant]},
                                            base)
    rules = f"{first.rule}; then {rule}"
    if won != base or ref not in calls:
        return Decision(won, rules, first.decided and decided, p)
    third = _decide_against({ref: calls[ref], base: calls[base]}, ref)
    return Decision(third.choice, f"{rules}; then {third.rule}",
                    first.decided and decided and third.decided, third.p_value)


def _decide_against(calls: dict[str, list[float]], ref: str) -> Decision:
    """:func:`_decide`'s rules 1-4 against ``ref``."""
    secs = {n: statistics.median(t) for n, t in calls.items()}
    n_calls = min(len(t) for t in calls.values())
    if ref not in secs or len(secs) == 1:
        best = min(secs, key=secs.get)
        return Decision(best, f"fastest median over {n_calls} calls each", True)
    alt = min((n for n in secs if n != ref), key=secs.get)
    gain = 1 - secs[alt] / secs[ref]
    fast, slow = (alt, ref) if gain > 0 else (ref, alt)
    what = f"{alt} {gain:+.0%} in median against {ref}"
    p = mann_whitney_p(calls[fast], calls[slow])
    test = f"Mann-Whitney p = {p:.2g} {'<' if p < ALPHA else '>='} {ALPHA}, {n_calls} calls"
    if p < ALPHA:
        if fast == alt and gain < MIN_GAIN:
            return Decision(ref, f"{what} ({test}), under the {MIN_GAIN:.0%} a pick "
                                   f"must gain: {ref} kept", True, p)
        return Decision(fast, f"{what} ({test}): {fast}", True, p)
    if abs(gain) < MIN_GAIN and n_calls >= TIE_CALLS:
        return Decision(ref, f"{what} ({test}), within {MIN_GAIN:.0%}: {ref} kept",
                        True, p)
    return Decision(ref, f"{what}, undecided ({test}): {ref} kept", False, p)


def _measure(fns: dict, args: tuple, rounds: int, budget_s: float,
             flush=None, ref: str = "xla",
             variants: dict[str, str] | None = None) -> tuple[dict[str, list[float]], Decision]:
    """The timed calls of ``fns`` (:func:`_time_all`) and their :func:`_decide` against
    ``ref`` (and ``variants``); while undecided, more rounds of ``rounds`` are added until
    it decides, :data:`MAX_CALLS` calls per candidate or :data:`EXTRA_BUDGET_S` seconds."""
    calls = _time_all(fns, args, rounds, budget_s, flush)
    decision = _decide(calls, ref, variants)
    start = time.perf_counter()
    while (not decision.decided and min(map(len, calls.values())) < MAX_CALLS
           and time.perf_counter() - start < EXTRA_BUDGET_S):
        more = _time_all(fns, args, rounds, budget_s, flush, warmups=0)
        for n, t in more.items():
            calls[n].extend(t)
        decision = _decide(calls, ref, variants)
    return calls, decision


def _decided(entry: dict, calls: dict[str, list[float]], decision: Decision) -> dict:
    """``entry`` with the decision's choice, rule, calls per candidate and p-value."""
    entry.update(choice=decision.choice, rule=decision.rule, decided=decision.decided,
                 calls=min(map(len, calls.values())))
    if decision.p_value is not None:
        # three significant digits: rounded to places, a win at p = 0.00196 would read
        # as ALPHA (a level test to _attention_flip)
        entry["p_value"] = float(f"{decision.p_value:.3g}")
    return entry


def measure(b: int, k: int, g: int, h: int, v: int, s: int, dtype, k_layout: str,
            v_layout: str, candidates=CANDIDATES, rounds: int = 7,
            budget_s: float = 2.0, backend: str = "cpu", cold: bool = True,
            page_size: int = 0) -> dict:
    """Times each formulation in ``candidates`` that applies on one layer's decode
    attention of these shapes (random data, the whole cache visible), from memory: the
    caches are flushed before every timed call (:data:`FLUSH_BYTES`; ``cold=False``
    times the cache as it stays in them between calls).

    With ``page_size`` P > 0 the cache is a page pool (:mod:`kvjax.cache.paged`) of
    B·ceil(s / P) pages in a shuffled order, and each formulation reads it as the model
    does: 'native' in place (the block table handed to the kernel; 'pallas' too, on GPU),
    the others over the
    rows' gathered views (:func:`kvjax.cache.paged.gather_view`, zeroed where unseen).

    Returns {'choice': the pick, 'rule', 'decided', 'calls', 'p_value' (the decision of
    :func:`_decide`), 'gbps': {name: GB/s of cache read (B·K·S·(H+V) elements x their
    bytes / median seconds / 1e9)}, 'seconds': {name: median s}, 'slots': s}.

    Raises:
      ValueError: an unknown candidate (before any allocation), or none that applies
        here.
    """
    known = kernels.names("decode_attention", auto=False)
    if not candidates or any(c not in known for c in candidates):
        raise ValueError(f"candidates={tuple(candidates)!r}; allowed: a non-empty subset of "
                         f"{known}")
    rng = np.random.default_rng(0)
    if page_size:
        m = paged.pages_for(s, page_size)
        n_pool, s_row, s = b * m, page_size, m * page_size
    else:
        n_pool, s_row = b, s
    shape_k = (n_pool, k, s_row, h) if k_layout == "BKSH" else (n_pool, k, h, s_row)
    shape_v = (n_pool, k, s_row, v) if v_layout == "BKSH" else (n_pool, k, v, s_row)
    new_k = (b, k, 1, h) if k_layout == "BKSH" else (b, k, h, 1)
    new_v = (b, k, 1, v) if v_layout == "BKSH" else (b, k, v, 1)
    with jax.ensure_compile_time_eval():
        args = tuple(jnp.asarray(rng.standard_normal(sh, dtype=np.float32), dtype)
                     for sh in ((b, 1, k, g, h), shape_k, shape_v))
        args = args + (jnp.ones((b, 1, s), bool),) + tuple(
            jnp.asarray(rng.standard_normal(sh, dtype=np.float32), dtype) for sh in (new_k, new_v))
        fns = {}
        if page_size:
            table = jnp.asarray(rng.permutation(n_pool).reshape(b, m).astype(np.int32))
            args = args + (table,)
        site = kernels.Site("decode_attention", backend=backend,
                            dtype=jnp.dtype(dtype).name, k_layout=k_layout,
                            v_layout=v_layout, head_dim=h, groups=g, slots=s,
                            paged=page_size > 0, native=_native_kernels())
        for impl in candidates:
            f = kernels.get("decode_attention", impl)
            if f.applies(site) is not None or (f.needs_plan and not native.load()):
                continue
            if not page_size:
                fn = jax.jit(lambda *a, impl=impl: attend_step(
                    *a, k_layout=k_layout, v_layout=v_layout, impl=impl, backend=backend))
            else:
                fn = jax.jit(functools.partial(_paged_step, k_layout=k_layout,
                                               v_layout=v_layout, impl=impl, backend=backend))
            fns[impl] = fn.lower(*args).compile()
        if not fns:
            raise ValueError(f"candidates={tuple(candidates)!r}: none applies to this "
                             f"attention ({jnp.dtype(dtype).name} {k_layout}/{v_layout}, "
                             f"backend {backend}); allowed: 'xla' always applies")
        # a variant (its fallback timed too: 'native_blocks' of 'native') must beat it
        variants = {n: f.fallback for n in fns
                    if (f := kernels.get("decode_attention", n)).fallback in fns}
        calls, decision = _measure(fns, args, rounds, budget_s,
                                   _flusher() if cold else None, variants=variants)
    secs = {n: statistics.median(t) for n, t in calls.items()}
    nbytes = b * k * s * (h + v) * jnp.dtype(dtype).itemsize
    return _decided({"gbps": {n: round(nbytes / t / 1e9, 2) for n, t in secs.items()},
                     "seconds": {n: t for n, t in secs.items()}, "slots": s},
                    calls, decision)


def _paged_step(q, k_pool, v_pool, mask, k_new, v_new, table, *, k_layout, v_layout, impl,
                backend):
    """One layer's decode attention over page pools as the model runs it
    (:mod:`kvjax.models.attention`): the formulations of
    :data:`kvjax.models.decode_kernels.IN_PLACE` read the pages in place, the others the
    rows' gathered views, zeroed where unseen (:meth:`kvjax.cache.paged.PagedKVCache.layer`)."""
    if kernels.get("decode_attention", impl).in_place:
        return attend_step(q, k_pool, v_pool, mask, k_new, v_new, k_layout, v_layout,
                           impl=impl, backend=backend, block_table=table)
    views = (paged.gather_view(pool, table, -1 if lay == "BKHS" else -2, mask[:, 0])
             for pool, lay in ((k_pool, k_layout), (v_pool, v_layout)))
    return attend_step(q, *views, mask, k_new, v_new, k_layout, v_layout, impl=impl,
                       backend=backend)


def _cached_choice(memo: dict, name: str, key: dict, path, entries: dict, measure_fn,
                   allowed=None) -> str:
    """The choice for shape class ``name``: read from ``entries`` (the planner cache at
    ``path``), else measured by ``measure_fn()`` (a dict with 'choice') and written back
    with what the file holds by then (:func:`_save`; a write failure only warns).
    Remembered in ``memo`` for this process. ``allowed`` as in :func:`load_cache`.

    A cached pick measured under load (:func:`under_load` of the other work recorded
    with it, :func:`_recorded_load`) is measured again once the machine is quiet; until
    then every report says so (:func:`_when`)."""
    stale = name in entries and under_load(_recorded_load(entries[name]))
    load = _others_load_now() if stale or name not in entries else None  # when needed
    fresh = name not in entries or (stale and not under_load(load))
    if fresh:
        print(f"kvjax planner: measuring the formulations of {name} on this machine "
              f"(once; cached in {path})", file=sys.stderr, flush=True)
        entries[name] = measure_fn()
        entries[name]["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        if load is not None:  # other jobs on the cores skew a pick: kept beside it
            entries[name]["others_load"] = round(load, 2)
        try:
            _save(path, key, entries, allowed)
        except OSError as e:
            warnings.warn(f"planner cache {path} not written: {e}", stacklevel=3)
    memo[name] = dict(entries[name], cache=str(path), fresh=fresh)
    return entries[name]["choice"]


BUSY_LOAD_PER_CORE = 0.5
"""A pick counts as measured under load when the other work on the machine
(:func:`_others_load`), read just before it was measured, held more than this many
cores per usable core."""
LOAD_WINDOW_S = 0.2
"""The window :func:`_others_load` reads the CPUs' busy time over."""


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy clock ticks of all CPUs since boot: /proc/stat's user, nice, system, irq,
    softirq and steal; this process's: /proc/self/stat's utime + stime, all its
    threads), or None where /proc cannot be read."""
    try:
        cpu = pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()
        mine = pathlib.Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        user, nice, system, _, _, irq, softirq, steal = (int(x) for x in cpu[1:9])
        return user + nice + system + irq + softirq + steal, int(mine[11]) + int(mine[12])
    except (OSError, ValueError, IndexError):
        return None


LOAD_REUSE_S = 5.0
"""A reading of :func:`_others_load` serves the picks measured within this many seconds
after it (one 0.2 s window per resolve, not per class)."""
_last_load: list = [None, -math.inf]  # [reading, perf_counter when read]


def _others_load_now() -> float | None:
    """:func:`_others_load`, read again only when the last reading is older than
    :data:`LOAD_REUSE_S`."""
    if time.perf_counter() - _last_load[1] > LOAD_REUSE_S:
        _last_load[:] = [_others_load(), time.perf_counter()]
    return _last_load[0]


def _others_load(window_s: float = LOAD_WINDOW_S) -> float | None:
    """Cores' worth of work other than this process's over the last ``window_s`` seconds
    (slept here): the CPUs' busy time (steal included: on a virtual machine, other
    guests holding its host's cores) minus this process's own, over the wall time
    (:func:`_cpu_ticks`). The 1-minute load average, used before, counted this
    process's own compiles: on 2 cores a first run's every pick read as measured under
    load and was measured again by the next run
    (docs/results/intel-xeon-avx512-2core.md, "Session 32"). Where /proc is missing
    (not Linux), the 1-minute load average; None if neither can be read."""
    start, t0 = _cpu_ticks(), time.perf_counter()
    if start is None:
        try:
            return os.getloadavg()[0]
        except OSError:
            return None
    time.sleep(window_s)
    end, seconds = _cpu_ticks(), time.perf_counter() - t0
    if end is None:
        return None
    others = (end[0] - start[0]) - (end[1] - start[1])
    return max(0.0, others / os.sysconf("SC_CLK_TCK") / seconds)


def _recorded_load(e: dict):
    """The other work recorded with a cached pick: 'others_load' (cores,
    :func:`_others_load`), or in a file written before it the 1-minute load average
    ('load_average'); None if neither."""
    return e.get("others_load", e.get("load_average"))


def under_load(load) -> bool:
    """Whether recorded other work (cores; None: unknown) means other jobs held the
    cores."""
    return isinstance(load, (int, float)) and load > BUSY_LOAD_PER_CORE * native.num_threads()


def _when(e: dict) -> str:
    """'measured now' or 'cached <date>', the other work then, and whether that was
    under load: a pick is kept until the machine, jax or the kernel changes, except one
    measured under load, which is measured again on a quiet machine (delete the cache
    file to measure everything again)."""
    when = "measured now" if e.get("fresh") else f"cached {e.get('measured_at', '')}".strip()
    load = _recorded_load(e)
    what = "other work" if "others_load" in e else "load average"
    return when + (f", {what} {load:.1f} on {native.num_threads()} cores"
                   if isinstance(load, (int, float)) else "") + (
        " (measured under load: measured again when the machine is quiet)"
        if under_load(load) else "")


def _why(e: dict) -> str:
    """' by rule: ...' for a measured pick (:func:`_decide`'s rule), '' for one taken
    unmeasured."""
    return f" by rule: {e['rule']}" if e.get("rule") else ""


def _decode_pick(cfg: ModelConfig, b: int, s: int, mesh: bool, page_size: int = 0,
                 queries: int = 1) -> str:
    """The 'auto' decode-attention formulation of ``cfg``'s cache class with ``b`` rows
    of ``s`` slots, on pages of ``page_size`` (0: dense rows; see the module docstring),
    read by ``queries`` positions per row (G·T query rows per KV head); measured once
    per class and machine."""
    k_layout, v_layout = cfg.cache_layout("k"), cfg.cache_layout("v")
    k, g, h = cfg.num_kv_heads, cfg.num_groups * int(queries), cfg.head_dim
    dtype = decode_kernels.read_dtype(cfg)
    if cfg.backend == "gpu":
        site = decode_kernels.site(cfg, b, queries, s, True, page_size, Plan())
        return "pallas" if kernels.get("decode_attention", "pallas").applies(site) is None \
            else "xla"
    if cfg.backend != "cpu" or backend_lib.current() != "cpu" or mesh:
        return "xla"
    if b * k * s * 2 * h * jnp.dtype(dtype).itemsize < MIN_MEASURED_BYTES:
        return "xla"
    name = decode_kernels.shape_class(cfg, b, s, dtype, page_size, queries)  # the plan's key
    with _lock:
        if name in _memo:
            return _memo[name]["choice"]
        key = machine_key("cpu")
        path = cache_path(key)
        return _cached_choice(_memo, name, key, path, load_cache(path, key),
                              lambda: measure(b, k, g, h, h, s, dtype, k_layout, v_layout,
                                              page_size=page_size, cold=measures_cold()))


def weight_shapes(cfg: ModelConfig, fused: bool = True) -> list[tuple[int, int, str]]:
    """(K, N, layout) of every weight product a forward of ``cfg`` runs through
    :func:`kvjax.models.weight_matmul.einsum` (projections, MLP, LM head), deduplicated:
    the classes :func:`resolve` picks a formulation for. With fused projections
    (:func:`kvjax.models.model.fuse_projections`) also their classes [D, (N + 2K)·H] and
    [D, 2F] unless ``fused`` is False (a mesh, where they stay apart); the separate
    ones stay (parameters not prepared for decoding)."""
    d, f = cfg.d_model, cfg.mlp_dim
    out = [(d, f, "kn"), (f, d, "kn")]
    if cfg.is_mla:
        n, r = cfg.num_heads, cfg.qk_rope_head_dim
        nope, v, c = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            out += [(d, cfg.q_lora_rank, "kn"), (cfg.q_lora_rank, n * (nope + r), "kn")]
        else:
            out.append((d, n * (nope + r), "kn"))
        out += [(d, c, "kn"), (d, r, "kn"), (n * v, d, "kn")]
    else:
        n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out += [(d, n * h, "kn"), (d, k * h, "kn"), (n * h, d, "kn")]
        if fused:  # q/k/v as one [D, (N + 2K)·H] weight
            out.append((d, (n + 2 * k) * h, "kn"))
    if fused and cfg.mlp_type in ("swiglu", "geglu"):
        out.append((d, 2 * f, "kn"))  # gate/up as one [D, 2F] weight
    out.append((d, cfg.vocab_size, "nk" if cfg.tie_embeddings else "kn"))
    return sorted(set(out))


def _weight_pick(m: int, k: int, n: int, layout: str) -> str:
    """The 'auto' formulation of one float32 product class (M rows, K x N weight):
    'xla' below :data:`MIN_MEASURED_BYTES`, else the fastest measured among
    :data:`WEIGHT_CANDIDATES` (the K split only for M > 1 and 'kn', the lanes only for
    M > 1 and 'nk'), once per machine (cached like decode attention, keyed with the hash
    of rows_matmul.cc)."""
    if 4 * int(k) * int(n) < MIN_MEASURED_BYTES:  # Python ints: no int32 overflow
        return "xla"
    name = weight_class(m, k, n, layout)
    with _lock:
        if name in _wmemo and "gbps" in _wmemo[name]:
            return wm.applies(_wmemo[name]["choice"], m, layout)
        key = machine_key("cpu", "rows_matmul.cc")
        path = cache_path(key, "weight_matmul")
        # a cached choice that does not apply to this class (an edited file) runs as
        # the kernel would run it
        return wm.applies(_cached_choice(_wmemo, name, key, path,
                                         load_cache(path, key, WEIGHT_CANDIDATES),
                                         lambda: measure_weight_matmul(
                                             row_band(m), k, n, layout, cold=measures_cold()),
                                         WEIGHT_CANDIDATES),
                          m, layout)


STEP_CHOICES = ("picks", "flipped")
"""The two weight plans :func:`_step_flips_win` times a decode step under: the
per-class picks, and the same with every measured class they left to 'xla' flipped to
the native kernel (:func:`resolve`)."""
STEP_MAX_SLOTS = 4096
"""A step is timed over at most this many slots in all its rows (B x the first decode
length's slots, a dense cache): at longer context the cache's reads dilute what the
weights' plan decides, and two caches of that size are allocated."""
STEP_MIN_WEIGHT_BYTES = FLUSH_BYTES
"""Steps whose weights stream from memory (more bytes than the flush that evicts the
caches) are timed whole; smaller models keep the per-class picks."""
STEP_MAX_WEIGHT_BYTES = 2 * 2**30
"""Nor is a step whose weights exceed this timed: the timing holds a second set of
random weights (and their fused copies) beside the caller's, before any memory check."""


def _architecture(cfg: ModelConfig) -> list:
    """Every config field but its plan and name, as sorted (field, value) pairs: what a
    step's decision is keyed on besides the picks."""
    return sorted((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
                  if f.name not in ("plan", "name"))


def _band_picks(picks, b: int) -> list:
    """The (weight class, formulation) pairs of ``picks`` in the row band of ``b`` rows
    (:func:`kvjax.plan.row_band`), sorted: the weight picks a step of ``b`` rows runs."""
    band = f"M{row_band(b)}-"
    return sorted((n, c) for n, c in picks if n.startswith(band))


def _step_name(cfg: ModelConfig, weights: dict, b: int, attention=()) -> str:
    """The cache name of a step arbitration: the rows and a hash of the architecture
    (every config field but its plan and name), of the per-class picks of the step's
    own row band (a re-measured pick times the step again; other bands, a prefill's or
    another batch size's, do not) and of the ``attention`` the step runs where a step
    check changed it (:func:`_attention_flip_wins`; () otherwise, as before that
    check). Not the context: the weights' plan is decided once, on a step at the first
    context it is resolved for."""
    what = repr((_architecture(cfg), _band_picks(weights.items(), b))
                + ((tuple(sorted(attention)),) if attention else ()))
    return f"step-B{b}-{hashlib.sha256(what.encode()).hexdigest()[:12]}"


def measure_step(cfgs: dict[str, ModelConfig], b: int, s: int, rounds: int = 7,
                 budget_s: float = 2.0) -> dict:
    """Times one decode step of each config in ``cfgs`` ({'picks': ..., 'flipped': ...},
    the same architecture under two plans) in interleaved rounds: random weights
    (timing does not depend on their values) shared by both, ``b`` rows over a dense
    cache of ``s`` slots full to its last one, each step's cache donated and the
    returned one kept (its length reset), as a decode loop runs. No flush: a step reads
    its weights from memory anyway (:data:`STEP_MIN_WEIGHT_BYTES`).

    Returns {'choice' (of :data:`STEP_CHOICES`), 'rule', 'decided', 'calls', 'p_value'
    (:func:`_decide` against 'picks'), 'ms': {name: median milliseconds a step},
    'slots': s}.
    """
    first = next(iter(cfgs.values()))
    params = model_lib.fuse_projections(first, model_lib.init_params(first, 0))
    token = jnp.zeros((b, 1), jnp.int32)
    fns = {}
    for name, c in cfgs.items():
        cache = compress_lib.full_cache(c, b, s)
        step = jax.jit(functools.partial(_decode_step, cfg=c), donate_argnums=2).lower(
            params, token, cache).compile()
        state = {"cache": cache}

        def run(step=step, state=state):
            logits, out = step(params, token, state["cache"])
            state["cache"] = out.replace(length=jnp.full((b,), s - 1, jnp.int32))
            return logits
        fns[name] = run
    calls, decision = _measure(fns, (), rounds, budget_s, ref=STEP_CHOICES[0])
    return _decided({"ms": {n: round(statistics.median(t) * 1e3, 3)
                            for n, t in calls.items()}, "slots": s}, calls, decision)


def _decode_step(params, token, cache, *, cfg):
    """One decode step as the decode loop runs it (token [B, 1] int32 at position
    cache.length -> (logits [B, 1, V], cache))."""
    return model_lib.forward(params, cfg, token, cache.length[:, None], cache)


def _step_timeable(cfg: ModelConfig) -> bool:
    """Whether a decode step of ``cfg`` is timed whole to check its picks: weights
    between :data:`STEP_MIN_WEIGHT_BYTES` and :data:`STEP_MAX_WEIGHT_BYTES`, and a dense
    cache (no window, no compression)."""
    return not (cfg.window_size or cfg.layer_windows or cfg.kv_compression) and (
        STEP_MIN_WEIGHT_BYTES <= theory.weight_bytes(cfg) <= STEP_MAX_WEIGHT_BYTES)


STEP_KERNELS = ("decode_attention.cc", "rows_matmul.cc")
"""The sources a whole step's decision is keyed on: a step runs the picks of both."""


def _flipped_step_wins(name: str, kind: str, cfgs: dict, b: int, s: int) -> bool:
    """Whether the step of ``cfgs['flipped']`` beat that of ``cfgs['picks']``
    (:data:`STEP_CHOICES`): decision ``name`` read from the planner cache of ``kind``
    (keyed with the hash of both kernels' sources, :data:`STEP_KERNELS`: a change of
    either may change which step is faster), else timed by :func:`measure_step`
    (``b`` rows over ``s`` slots) and cached; without a cached decision, a step of more
    than :data:`STEP_MAX_SLOTS` slots in all rows is not timed (False)."""
    with _lock:
        if name not in _smemo:
            key = machine_key("cpu", STEP_KERNELS)
            path = cache_path(key, kind)
            entries = load_cache(path, key, STEP_CHOICES)
            if name not in entries and b * s > STEP_MAX_SLOTS:
                return False
            _cached_choice(_smemo, name, key, path, entries,
                           lambda: measure_step(cfgs, b, s), STEP_CHOICES)
        return _smemo[name]["choice"] == STEP_CHOICES[1]


def _step_flips_win(cfg: ModelConfig, plan: Plan, weights: dict, flips: dict, b: int,
                    s: int, attention=()) -> bool:
    """Whether a decode step of ``b`` rows runs faster with ``weights`` (the per-class
    picks) updated by ``flips`` (classes they left to 'xla', native) than with the
    picks. The classes are measured apart; inside a step the native calls' neighbours
    (the attention kernel's calls, the norms folded into the native products) change
    what is faster (docs/decisions/0051-step-weight-plans-timed-whole.md). Decided once
    per architecture, rows and picks (:func:`_step_name`) by :func:`measure_step` on a
    step over the ``s`` slots of this resolve (with ``plan``'s attention), by
    :func:`_decide`'s rule against the picks, and cached like the classes
    (:func:`_flipped_step_wins`; ``attention``: the attention picks a step check
    flipped, in the name). False (no step timed) where :func:`_step_timeable` is not.
    The flips are of the step's row band (:func:`kvjax.plan.row_band`): a prefill chunk
    of as many rows shares them."""
    if not _step_timeable(cfg):
        return False
    cfgs = {c: cfg.replace(plan=dataclasses.replace(plan, weight_matmul=tuple(
        sorted(w.items())))) for c, w in zip(STEP_CHOICES, (weights, {**weights, **flips}))}
    return _flipped_step_wins(_step_name(cfg, weights, b, attention), "weight_step", cfgs,
                              b, s)


def _attention_flip(cfg: ModelConfig, plan: Plan, decode: dict, b: int, s: int) -> dict:
    """{site key: formulation} for the decode step's own attention class (``b`` rows,
    ``s`` dense slots, one position) where the class's own timing did not settle what
    runs (``decode``, the picks after the registry's rules): of the candidates that run
    this site, another had a faster median than the pick (:func:`_decide` kept the pick:
    undecided, within the least gain, or a variant that did not beat its base), or the
    pick had the fastest but the rule's last test was level (p >= :data:`ALPHA`:
    undecided or a tie). Then the fastest of those others. {} otherwise: the pick the
    fastest that runs here and its test won (p < ALPHA) or none ran (no 'p_value': an
    entry of an older cache, or no reference timed), or nothing else runs here."""
    c = cfg.layer_config(0) if cfg.compression.dense_layers else cfg
    e = _memo.get(decode_kernels.shape_class(c, b, s, decode_kernels.read_dtype(c), 0, 1))
    site = decode_kernels.site(c, b, 1, s, True, 0, plan)
    runs = decode.get(site.key)
    if not e or runs is None or not (e.get("seconds") or e.get("gbps")):
        return {}
    speed = ({n: -t for n, t in e["seconds"].items()} if e.get("seconds") else e["gbps"])
    others = {n: v for n, v in speed.items()
              if n != runs and c.formulation(site, plan, n) == n}
    if not others:
        return {}
    best = max(others, key=lambda n: (others[n], n))
    level = e.get("p_value") is not None and e["p_value"] >= ALPHA
    faster = others[best] > speed.get(runs, -math.inf)  # the pick wins ties
    return {site.key: best} if faster or level else {}


def _attention_flip_wins(cfg: ModelConfig, plan: Plan, decode: dict, flip: dict, b: int,
                         s: int) -> bool:
    """Whether a decode step of ``b`` rows over ``s`` slots runs faster with its
    attention class flipped (:func:`_attention_flip`) than with the pick ``decode``
    holds. A class of a short cache timed alone, one call from a flushed cache, can
    come out level (undecided or within the least gain) where the step, its calls
    between the layers' weight products, tells the formulations apart
    (docs/decisions/0054-attention-pick-checked-on-the-step.md). Decided once
    per architecture, rows, slots, the class's pick and flip and the weights' picks of
    the step's row band (``plan`` holds the weights' per-class picks), and cached
    (:func:`_flipped_step_wins`), where :func:`_step_timeable`."""
    if not _step_timeable(cfg):
        return False
    what = repr((_architecture(cfg), sorted((k, decode[k]) for k in flip),
                 sorted(flip.items()), _band_picks(plan.weight_matmul, b)))
    name = f"attention-step-B{b}-S{s}-{hashlib.sha256(what.encode()).hexdigest()[:12]}"
    cfgs = {c: cfg.replace(plan=dataclasses.replace(plan, decode_attention=tuple(
        sorted(d.items())))) for c, d in zip(STEP_CHOICES, (decode, {**decode, **flip}))}
    return _flipped_step_wins(name, "attention_step", cfgs, b, s)


_smemo: dict[str, dict] = {}


def resolve(cfg: ModelConfig, *, max_seq_len: int, batch_sizes=(1,), rows=(),
            extra_seq_lens=(), mesh_axes: dict | None = None,
            manual_axes=(), page_size: int = 0, queries=()) -> ModelConfig:
    """``cfg`` with its execution plan (``plan``), resolved now, before any trace.

    Loads the native kernels ``cfg`` may use (CPU configs in a CPU process: the decode
    attention for decode_attention 'native'/'auto', the prompt attention for
    prefill_impl 'native'/'auto', the row products for a float32 weight_matmul other
    than 'xla'), and picks every 'auto' formulation for the shape classes of the
    programs to come (:func:`_decode_pick`, :func:`_weight_pick`; measured once per class
    and machine, then read from the planner cache).

    Args:
      cfg: the config (any plan it has is replaced).
      max_seq_len: the cache's length; decode attention is picked for its slot count.
      batch_sizes: the cache's batch sizes B of the decode steps (decode rows M = B); ()
        for programs without one (a prefill alone).
      rows: further M = B·T row counts of weight products (prefill chunks).
      queries: positions T > 1 of the small chunks the decode programs run over the
        cache (a speculative verify step: k + 1): their B·T rows are weight-product
        rows too (for every B of ``batch_sizes``), and decode attention is also picked
        for their G·T query rows per KV head (:func:`decode_kernels.shape_class`),
        which a one-position call does not measure (for attention, 1 and values above
        ``kvjax.models.attention.SMALL_CHUNK`` add nothing).
      extra_seq_lens: further cache lengths the programs use (e.g. a cost context).
      mesh_axes: {axis name: size} of the mesh the programs run under (None: one
        device); on more than one device every 'auto' pick is 'xla'.
      manual_axes: axes already manual where the programs are traced (a per-device
        cost trace).
      page_size: P > 0: the decode steps read a paged cache (:mod:`kvjax.cache.paged`)
        whose rows' views hold ``max_seq_len`` (and ``extra_seq_lens``) slots, a
        multiple of P; decode attention is picked for those paged classes instead of
        dense rows (the paged engine's prefill runs on dense rows and resolves its own).
    Returns:
      ``cfg.replace(plan=...)``: equal configs give equal plans (a jit key), and a
      different pick retraces.
    Raises:
      ValueError: ``max_seq_len`` or a batch size below 1, naming it.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
            or page_size < 0:
        raise ValueError(f"page_size={page_size!r}; allowed: an integer >= 0 (0: dense "
                         "rows)")
    lengths = sorted({int(max_seq_len), *(int(x) for x in extra_seq_lens)})
    if lengths[0] < 1 or any(int(b) < 1 for b in batch_sizes):
        raise ValueError(f"max_seq_len={max_seq_len!r}, extra_seq_lens="
                         f"{tuple(extra_seq_lens)!r}, batch_sizes={tuple(batch_sizes)!r}; "
                         "allowed: integers >= 1")
    plan = Plan().on_mesh(mesh_axes or {}, manual_axes)
    mesh = plan.num_devices > 1
    loaded = set()
    if cfg.backend == "cpu" and backend_lib.current() == "cpu":
        if (not cfg.is_mla and cfg.decode_attention in ("native", "native_blocks", "auto")
                and jnp.dtype(cfg.cache_dtype) == jnp.float32 and native.load()):
            loaded.add("decode_attention")
            if native.block_sweep():
                loaded.add("decode_attention_blocks")
        if (not cfg.is_mla and cfg.prefill_impl in ("native", "auto")
                and native_prefill.load()):
            loaded.add("prefill_attention")
        if cfg.weight_matmul != "xla" and cfg.dtype == "float32" and rm.load():
            loaded.add("rows_matmul")
    plan = dataclasses.replace(plan, native=tuple(sorted(loaded)))
    decode = {}
    if cfg.decode_attention == "auto" and not cfg.is_mla:
        widths = sorted({1} | {int(t) for t in queries if 1 < int(t) <= SMALL_CHUNK})
        for b, s in sorted({(int(b), n if page_size else cache_lib.num_slots(cfg, n))
                            for b in batch_sizes for n in lengths}):
            for t in widths:
                # the class's measured pick, then the registry's rule over it (a kernel
                # not loaded, the dense-window rule, 1-byte codes, sinks): what runs
                # (a page selection's dense layers, compression.dense_layers, share the
                # class: its pick is theirs, and the selecting layers' rule holds anyway)
                c = cfg.layer_config(0) if cfg.compression.dense_layers else cfg
                site = decode_kernels.site(c, b, t, s, True, page_size, plan)
                rule = kernels.forced(site.op, c.decode_attention, site)
                decode[site.key] = c.formulation(site, plan, rule or _decode_pick(
                    c, b, s, mesh, page_size, t))
    # the prompt's attention, into an empty cache and as a chunk over a cache
    prompt = {site.key: cfg.formulation(site, plan) for site in (
        decode_kernels.site(cfg, 1, SMALL_CHUNK + 1, 0, cached, plan=plan)
        for cached in (False, True))}
    weights = {}
    weights_auto = cfg.weight_matmul == "auto" and "rows_matmul" in loaded and not mesh
    if weights_auto:
        chunks = {int(b) * int(t) for b in batch_sizes for t in queries}
        for m in sorted({int(x) for x in tuple(batch_sizes) + tuple(rows)} | chunks):
            if not 0 < m <= rm.MAX_ROWS:
                continue
            for k, n, layout in weight_shapes(cfg):
                weights[weight_class(m, k, n, layout)] = _weight_pick(m, k, n, layout)
    s = cache_lib.num_slots(cfg, lengths[0])  # the slots a step is timed over
    flipped = {}  # attention classes a step check moved off their picks
    if (cfg.decode_attention == "auto" and "decode_attention" in loaded and decode
            and not page_size and not mesh):
        # an attention pick kept against a faster median or on a level test, arbitrated
        # on the whole step
        for b in sorted({int(b) for b in batch_sizes}):
            flip = _attention_flip(cfg, plan, decode, b, s)
            if flip and _attention_flip_wins(cfg, dataclasses.replace(
                    plan, weight_matmul=tuple(sorted(weights.items())),
                    prefill_attention=tuple(sorted(prompt.items()))), decode, flip, b, s):
                decode.update(flip)
                flipped.update(flip)
    if weights_auto and batch_sizes:
        # a decode step's weight picks, arbitrated on the whole step (its own rows'
        # classes; the step's attention as resolved above)
        step_plan = dataclasses.replace(plan, decode_attention=tuple(sorted(
            decode.items())), prefill_attention=tuple(sorted(prompt.items())))
        for b in sorted({int(b) for b in batch_sizes}):
            # the step's measured classes left to 'xla' that the kernel runs
            flips = {weight_class(b, k, n, lay): "native"
                     for k, n, lay in weight_shapes(cfg)
                     if weights.get(weight_class(b, k, n, lay)) == "xla"
                     and 4 * k * n >= MIN_MEASURED_BYTES
                     and wm.applies("native", b, lay) == "native"}
            if flips and b <= rm.MAX_ROWS and not page_size and _step_flips_win(
                    cfg, step_plan, weights, flips, b, s, tuple(flipped.items())):
                weights.update(flips)
    plan = dataclasses.replace(plan, decode_attention=tuple(sorted(decode.items())),
                               weight_matmul=tuple(sorted(weights.items())),
                               prefill_attention=tuple(sorted(prompt.items())))
    return cfg.replace(plan=plan)


def report_lines() -> list[str]:
    """One line per decode-attention and weight-product choice made in this process: the
    shape class, the formulation, the rule that decided it (:func:`_decide`), the
    measured GB/s of each candidate and whether it was measured now or read from the
    cache (with its date), and the machine; then one per decode step timed whole (its
    weight plan, :func:`_step_flips_win`; an attention pick against the class's fastest
    median, :func:`_attention_flip_wins`) with its steps' milliseconds."""
    model, isa = _cpu()
    lines = [f"decode-attention planner on {model} ({', '.join(isa)}; "
             f"{native.num_threads()} cores), jax {jax.__version__}:"] if _memo else []
    for name, e in sorted(_memo.items()):
        rates = ", ".join(f"{n} {r:.1f}" for n, r in e["gbps"].items())
        lines.append(f"  {name}: {e['choice']}{_why(e)} (GB/s of cache read: {rates}; "
                     f"{_when(e)})")
    if _wmemo:
        lines.append(f"weight-product planner on {model} ({', '.join(isa)}; "
                     f"{native.num_threads()} cores), jax {jax.__version__}:")
    for name, e in sorted(_wmemo.items()):
        if "gbps" in e:
            rates = ", ".join(f"{n} {r:.1f}" for n, r in e["gbps"].items())
            lines.append(f"  {name}: {e['choice']}{_why(e)} (GB/s of weight read: "
                         f"{rates}; {_when(e)})")
    if _smemo:
        lines.append("decode steps timed whole (the per-class picks, or 'flipped': "
                     "step-*: every weight class they left to xla native; attention-step-*: "
                     "the attention class's fastest median, or its fastest other where "
                     "its own test was level):")
    for name, e in sorted(_smemo.items()):  # a hand-edited file may lack ms or slots
        ms = ", ".join(f"{n} {t:.2f}" for n, t in e.get("ms", {}).items())
        lines.append(f"  {name}: {e['choice']}{_why(e)} (ms a step over "
                     f"{e.get('slots', '?')} slots: {ms}; {_when(e)})")
    return lines


def clear_memo() -> None:
    """Forgets this process's choices (the disk cache stays); for tests."""
    with _lock:
        _memo.clear()
        _wmemo.clear()
        _smemo.clear()


# ------------------------------------------------------------------ weight products

NATIVE_WEIGHT = wm.NATIVE  # the kernel's formulations
WEIGHT_CANDIDATES = ("xla",) + NATIVE_WEIGHT
WEIGHT_STREAM_BYTES = 48 * 2**20  # weights timed per call: above a 32 MB L3
_wmemo: dict[str, dict] = {}




def _weight_native_ok(m: int) -> bool:
    """Whether the row-product kernel can run M rows here (CPU process, M <=
    :data:`kvjax.native.rows_matmul.MAX_ROWS`, library built and loaded)."""
    return backend_lib.current() == "cpu" and 0 < m <= rm.MAX_ROWS and rm.load()


def _check_weight_layout(layout: str) -> None:
    """Raises ValueError naming ``layout`` unless it is 'kn' ([K, N]) or 'nk' ([N, K])."""
    if layout not in ("kn", "nk"):
        raise ValueError(f"layout={layout!r}; allowed: 'kn' or 'nk'")


def measure_weight_matmul(m: int, k: int, n: int, layout: str = "kn",
                          candidates=WEIGHT_CANDIDATES, rounds: int = 7,
                          budget_s: float = 1.0, cold: bool = True) -> dict:
    """Times each formulation of an [M, K] x weight product, float32, on enough separate
    weights of that shape (one product each, unrolled) to read
    :data:`WEIGHT_STREAM_BYTES` from memory per call, as a decode step reads its layers'
    weights; the caches are flushed before every timed call (:data:`FLUSH_BYTES`;
    ``cold=False``: not). Each product's input depends on the previous one's output, as
    in a step: XLA runs independent dots concurrently, which flattered 'xla'
    (docs/decisions/0008-planner-weight-chain.md).

    Returns {'choice', 'rule', 'decided', 'calls', 'p_value' (as :func:`measure`),
    'gbps': {name: GB/s of weight read}, 'gflops':
    {name: GFLOP/s (2·M·K·N per copy)}, 'seconds': {name: median s per call}, 'copies'}.
    Candidates that run as another (:func:`applies`) or cannot run are skipped.

    Raises:
      ValueError: a candidate not in :data:`WEIGHT_CANDIDATES`, or none left to time;
        a layout other than 'kn' / 'nk', a size < 1, or a weight below
        :data:`MIN_MEASURED_BYTES` (the planner never measures those: :func:`weight_matmul`
        keeps 'xla'; timed, they would take tens of thousands of unrolled copies).
    """
    bad = [c for c in candidates if c not in WEIGHT_CANDIDATES]
    if bad:
        raise ValueError(f"candidates {bad}; allowed: {list(WEIGHT_CANDIDATES)}")
    try:  # Python ints: numpy int32 sizes would overflow 4·K·N
        m, k, n = (operator.index(v) for v in (m, k, n))
    except TypeError:
        raise ValueError(f"m={m!r}, k={k!r}, n={n!r}; allowed: integers") from None
    _check_weight_layout(layout)
    if min(m, k, n) < 1 or 4 * k * n < MIN_MEASURED_BYTES:
        raise ValueError(f"m={m}, k={k}, n={n}: {4 * k * n:,} weight bytes; allowed: sizes "
                         f">= 1 and a weight of >= {MIN_MEASURED_BYTES:,} bytes (4·K·N)")
    copies = max(1, -(-WEIGHT_STREAM_BYTES // (4 * k * n)))
    rng = np.random.default_rng(0)
    wshape = (k, n) if layout == "kn" else (n, k)
    with jax.ensure_compile_time_eval():
        # separate arrays, not slices of one stacked array: a custom call's operand sliced
        # out of a stack is copied first (XLA's dot fuses the slice), which would charge
        # the native kernel a copy of every weight; a decode step's weights are separate
        # / sqrt(K): outputs of x's size, no overflow. One draw, each copy scaled apart
        # (its own buffer, read from memory like the others): a draw per copy took most
        # of a warm pick's time (docs/decisions/0040-test-picks-warm.md)
        base = rng.standard_normal(wshape, dtype=np.float32) / np.float32(np.sqrt(k))
        w = tuple(jnp.asarray(base * np.float32(1 + i / copies)) for i in range(copies))
        x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
        prods = {"xla": (lambda a, b: a @ b) if layout == "kn" else (lambda a, b: a @ b.T),
                 "native": lambda a, b: rm.rows_matmul(a, b, layout),
                 "native_ksplit": lambda a, b: rm.rows_matmul(a, b, layout, "k"),
                 "native_lanes": lambda a, b: rm.rows_matmul(a, b, layout, lanes=True)}
        fns = {}
        for name in candidates:
            if kernels.get("weight_matmul", name).needs_plan and not _weight_native_ok(m):
                continue
            if wm.applies(name, m, layout) != name:
                continue  # the kernel runs it as 'native' does: nothing to choose

            run = functools.partial(weight_chain, prods[name])
            fns[name] = jax.jit(run).lower(x, w).compile()
        if not fns:
            raise ValueError(f"candidates={tuple(candidates)!r}: none applies to M={m}, "
                             f"layout={layout!r}; allowed: {WEIGHT_CANDIDATES}")
        calls, decision = _measure(fns, (x, w), rounds, budget_s,
                                   _flusher() if cold else None)
    secs = {n_: statistics.median(t) for n_, t in calls.items()}
    nbytes = 4 * k * n * copies
    return _decided(
        {"gbps": {n_: round(nbytes / t / 1e9, 2) for n_, t in secs.items()},
         "gflops": {n_: round(2 * m * nbytes / 4 / t / 1e9, 2) for n_, t in secs.items()},
         "seconds": dict(secs), "copies": copies}, calls, decision)


def weight_chain(prod, x: jax.Array, ws, coupling: float = 1e-6) -> jax.Array:
    """The program :func:`measure_weight_matmul` times: one ``prod(x_i, w)`` per weight
    of ``ws`` (unrolled, as a decode step holds its layers' weights), each input
    x_i = x + coupling · y[:, :1] depending on the running sum y of the outputs before
    it, as a step's products form a chain (XLA runs independent dots concurrently). The
    small default coupling keeps y finite over hundreds of products while the
    dependency stays in the program.

    Args:
      prod: (x [M, K], w) -> [M, N], e.g. ``lambda a, b: a @ b`` for w [K, N].
      x: [M, K].
      ws: a non-empty sequence of weights, each what ``prod`` takes.
    Returns:
      y [M, N], x's dtype.
    Raises:
      ValueError: ``ws`` is empty.
    """
    if not ws:
        raise ValueError("ws=(); allowed: at least one weight")
    acc = prod(x, ws[0])
    for wi in ws[1:]:
        acc = acc + prod(x + coupling * acc[:, :1], wi)
    return acc
