"""Chooses the decode-attention formulation by measuring the machine at hand.

``ModelConfig.decode_attention='auto'`` resolves here, when a decode step is traced:
:func:`decode_attention` times every formulation that applies
(:mod:`kvjax.models.decode_kernels`: 'xla', 'xla_cache_left', 'native') on the step's
own shapes (one layer's :func:`kvjax.models.attention.attend_step`, interleaved rounds,
the median of each, every timed call from memory after an untimed flush of the caches,
:data:`FLUSH_BYTES`; about a second), picks the fastest and caches the choice on disk.

The cache is one JSON file per machine under ``$KVJAX_CACHE/planner`` (default
``~/.cache/kvjax/planner``; ``$KVJAX_PLANNER_CACHE`` moves it alone), never in git. Its
key (:func:`machine_key`): CPU model and vector ISA, usable cores, backend, jax and
jaxlib versions, the native kernel's source hash and the measuring method
(:data:`MEASURE_METHOD`); inside it, one entry per shape class (:func:`shape_class`: B,
K, G, H, V, the slot count rounded up to a power of two, cache dtype, layouts). Another
machine, a new jax or a new kernel looks for another file and re-measures; a file that does not
parse or whose recorded key differs from this machine's is ignored with a warning and
rewritten. Every choice made in this process is listed by :func:`report_lines`.

Shapes whose cache is small (one layer below :data:`MIN_MEASURED_BYTES`) take 'xla'
unmeasured: nothing to gain there that timing on a shared host could see. On GPU 'auto'
is 'pallas' where the kernel applies (dense 'BKSH' cache), else 'xla'; on TPU, and for a
config built for a backend other than the process's, 'xla'. Inside a program traced
under a device mesh of more than one device (``jax.set_mesh``, :mod:`kvjax.parallel`),
'xla': a native kernel is a custom call the SPMD partitioner cannot split, so XLA would
gather the sharded cache around it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import operator
import os
import pathlib
import statistics
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import native
from kvjax.models import decode_kernels

MIN_MEASURED_BYTES = 256 * 1024
CANDIDATES = ("xla", "xla_cache_left", "native")
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "asimd", "sve")
_lock = threading.RLock()
_memo: dict[str, dict] = {}


def _cpu() -> tuple[str, list[str]]:
    ident = native.machine_id()
    model, _, flags = ident.partition("|")
    have = set(flags.split())
    return model or "unknown", [f for f in ISA_FLAGS if f in have]


def machine_key(backend: str | None = None, kernel: str = "decode_attention.cc") -> dict:
    """What the planner's choices depend on: {'cpu', 'isa', 'cores', 'backend', 'jax',
    'jaxlib', 'kernel', 'measure'} ('kernel': hash of the native kernel's source,
    ``kernel`` under kvjax/native: 'decode_attention.cc' or 'rows_matmul.cc'; 'measure':
    :data:`MEASURE_METHOD`)."""
    import jaxlib  # noqa: PLC0415
    model, isa = _cpu()
    src = pathlib.Path(native.__file__).with_name(kernel).read_bytes() + native.headers().encode()
    return {"cpu": model, "isa": isa, "cores": native.num_threads(),
            "backend": backend or backend_lib.current(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "kernel": hashlib.sha256(src).hexdigest()[:12],
            "measure": MEASURE_METHOD}


PLANNER_CACHE_ENV = "KVJAX_PLANNER_CACHE"


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
    allowed = decode_kernels.IMPLS if allowed is None else allowed
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


def shape_class(b: int, k: int, g: int, h: int, v: int, s: int, dtype, k_layout: str,
                v_layout: str, prefix: bool) -> str:
    """The cache entry name of one decode attention: the slot count rounded up to a power
    of two, everything else exact."""
    s2 = 1 << max(0, int(s - 1).bit_length())
    return (f"B{b}-K{k}-G{g}-H{h}-V{v}-S{s2}-{jnp.dtype(dtype).name}-{k_layout}-{v_layout}"
            f"{'' if prefix else '-window'}")


FLUSH_BYTES = 256 * 2**20
"""Bytes read before every timed call of a measurement (:func:`_time`), so that no
operand is in the CPU's caches when the call starts, as in a decode step: between one
step's read of a layer's weights or cache and the next step's, the rest of the step
(~0.5 GB for SmolLM2 in float32) has evicted them. Measured warm, a one-layer cache or
a 48 MB weight stream is read partly from the last-level cache: on the 2-core Intel
Xeon (whose CPUID reports a 300 MB L3) a 64 MiB read ran at 37 GB/s, 256 and 640 MiB at
27, and the planner's warm GB/s (one row x [576, 576]: 33-38) were far above what the
step's products reach (~19). 256 MiB: :class:`kvjax.analysis.hardware.ReadProbe`'s read."""
MEASURE_METHOD = f"cold-{FLUSH_BYTES >> 20}MiB-chain"
"""How picks are measured (flushed caches, chained weight products): part of the cache
key (:func:`machine_key`), so picks measured another way are measured again."""


def _flusher():
    """A callable that reads :data:`FLUSH_BYTES` (evicting the caches); it holds that
    buffer until it is dropped, at the end of the measurement."""
    from kvjax.analysis import hardware  # noqa: PLC0415
    probe = hardware.ReadProbe("sum", FLUSH_BYTES)
    return probe.once


def _time(fns: dict, args: tuple, rounds: int, budget_s: float,
          flush=None) -> dict[str, float]:
    """Median seconds of each compiled fn, timed in interleaved rounds after 2 warm-ups;
    ``flush()`` (untimed) before every timed call when given."""
    for _ in range(2):
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
    return {n: statistics.median(t) for n, t in times.items()}


def _pick(secs: dict[str, float]) -> str:
    """The fastest of ``secs`` ({name: median s}), or 'xla' when it was timed and the
    fastest beats it by under 3% (within noise of the reference: keep the reference)."""
    best = min(secs, key=secs.get)
    if "xla" in secs and best != "xla" and secs[best] > 0.97 * secs["xla"]:
        best = "xla"
    return best


def measure(b: int, k: int, g: int, h: int, v: int, s: int, dtype, k_layout: str,
            v_layout: str, candidates=CANDIDATES, rounds: int = 7,
            budget_s: float = 2.0, backend: str = "cpu", cold: bool = True) -> dict:
    """Times each formulation in ``candidates`` that applies on one layer's decode
    attention of these shapes (random data, the whole cache visible), from memory: the
    caches are flushed before every timed call (:data:`FLUSH_BYTES`; ``cold=False``
    times the cache as it stays in them between calls).

    Returns {'choice': fastest name, 'gbps': {name: GB/s of cache read (B·K·S·(H+V)
    elements x their bytes / median seconds / 1e9)}, 'seconds': {name: median s},
    'slots': s}.

    Raises:
      ValueError: an unknown candidate (before any allocation), or none that applies
        here.
    """
    known = tuple(i for i in decode_kernels.IMPLS if i != "auto")
    if not candidates or any(c not in known for c in candidates):
        raise ValueError(f"candidates={tuple(candidates)!r}; allowed: a non-empty subset of "
                         f"{known}")
    from kvjax.models.attention import attend_step  # noqa: PLC0415
    rng = np.random.default_rng(0)
    shape_k = (b, k, s, h) if k_layout == "BKSH" else (b, k, h, s)
    shape_v = (b, k, s, v) if v_layout == "BKSH" else (b, k, v, s)
    new_k = (b, k, 1, h) if k_layout == "BKSH" else (b, k, h, 1)
    new_v = (b, k, 1, v) if v_layout == "BKSH" else (b, k, v, 1)
    with jax.ensure_compile_time_eval():
        args = tuple(jnp.asarray(rng.standard_normal(sh, dtype=np.float32), dtype)
                     for sh in ((b, 1, k, g, h), shape_k, shape_v))
        args = args + (jnp.ones((b, 1, s), bool),) + tuple(
            jnp.asarray(rng.standard_normal(sh, dtype=np.float32), dtype) for sh in (new_k, new_v))
        fns = {}
        for impl in candidates:
            if not decode_kernels.supports(impl, backend, dtype, k_layout, v_layout, True, h, s):
                continue
            fn = jax.jit(lambda *a, impl=impl: attend_step(
                *a, k_layout=k_layout, v_layout=v_layout, impl=impl, backend=backend))
            fns[impl] = fn.lower(*args).compile()
        if not fns:
            raise ValueError(f"candidates={tuple(candidates)!r}: none applies to this "
                             f"attention ({jnp.dtype(dtype).name} {k_layout}/{v_layout}, "
                             f"backend {backend}); allowed: 'xla' always applies")
        secs = _time(fns, args, rounds, budget_s, _flusher() if cold else None)
    nbytes = b * k * s * (h + v) * jnp.dtype(dtype).itemsize
    best = _pick(secs)
    return {"choice": best, "gbps": {n: round(nbytes / t / 1e9, 2) for n, t in secs.items()},
            "seconds": {n: t for n, t in secs.items()}, "slots": s}


def _cached_choice(memo: dict, name: str, key: dict, path, entries: dict, measure_fn,
                   allowed=None) -> str:
    """The choice for shape class ``name``: read from ``entries`` (the planner cache at
    ``path``), else measured by ``measure_fn()`` (a dict with 'choice') and written back
    with what the file holds by then (:func:`_save`; a write failure only warns).
    Remembered in ``memo`` for this process. ``allowed`` as in :func:`load_cache`."""
    fresh = name not in entries
    if fresh:
        print(f"kvjax planner: measuring the formulations of {name} on this machine "
              f"(once; cached in {path})", file=sys.stderr, flush=True)
        entries[name] = measure_fn()
        entries[name]["measured_at"] = time.strftime("%Y-%m-%d %H:%M:%S")
        try:  # other jobs on the cores skew a pick: kept beside it, printed with it
            entries[name]["load_average"] = round(os.getloadavg()[0], 2)
        except OSError:
            pass
        try:
            _save(path, key, entries, allowed)
        except OSError as e:
            warnings.warn(f"planner cache {path} not written: {e}", stacklevel=3)
    memo[name] = dict(entries[name], cache=str(path), fresh=fresh)
    return entries[name]["choice"]


def _when(e: dict) -> str:
    """'measured now' or 'cached <date>', and the load average then: a pick is one
    measurement, kept until the machine, jax or the kernel changes (noise-level picks,
    or picks made while other jobs held the cores, stay as they fell: delete the cache
    file to measure again)."""
    when = "measured now" if e.get("fresh") else f"cached {e.get('measured_at', '')}".strip()
    load = e.get("load_average")
    return when + (f", load average {load:.1f} on {native.num_threads()} cores"
                   if isinstance(load, (int, float)) else "")


def decode_attention(cfg, k_cache, v_cache) -> str:
    """The formulation for one layer's decode attention of ``cfg`` over caches shaped like
    ``k_cache``/``v_cache`` (arrays or tracers: only shapes and dtypes are read).

    ``cfg.decode_attention`` other than 'auto' is returned as is, after checking that it
    applies. 'auto': see the module docstring; on CPU measured once per shape class and
    machine, then read from the cache.

    Raises:
      ValueError: a formulation that cannot run this attention (e.g. 'native' with a
      bfloat16 cache or on GPU, 'pallas' on CPU or with a window), naming it.
    """
    k_layout, v_layout = cfg.cache_layout("k"), cfg.cache_layout("v")
    b, k = k_cache.shape[:2]
    s = k_cache.shape[2] if k_layout == "BKSH" else k_cache.shape[3]
    h = k_cache.shape[3] if k_layout == "BKSH" else k_cache.shape[2]
    v = v_cache.shape[3] if v_layout == "BKSH" else v_cache.shape[2]
    # a dense cache's visible slots are a prefix (what the Pallas kernel needs); a ring's not
    prefix = cache_lib.policy_for(cfg).kind == "dense"
    g, dtype = cfg.num_groups, k_cache.dtype
    if cfg.decode_attention != "auto":
        impl = cfg.decode_attention
        if not decode_kernels.supports(impl, cfg.backend, dtype, k_layout, v_layout, prefix, h, s):
            raise ValueError(
                f"model.decode_attention={impl!r} cannot run here (backend {cfg.backend}, "
                f"cache {jnp.dtype(dtype).name} {k_layout}/{v_layout}, {s} slots, "
                f"window {cfg.window_size}); allowed: 'auto', 'xla', 'xla_cache_left'"
                + (", 'native' (CPU, float32 cache)" if cfg.backend == "cpu" else "")
                + (", 'pallas' (GPU, dense BKSH cache)" if cfg.backend == "gpu" else ""))
        return impl
    if cfg.backend == "gpu":
        ok = decode_kernels.supports("pallas", "gpu", dtype, k_layout, v_layout, prefix, h, s)
        return "pallas" if ok else "xla"
    if cfg.backend != "cpu" or backend_lib.current() != "cpu":
        return "xla"
    if jax.sharding.get_abstract_mesh().size > 1:
        # on a device mesh the native kernel is a custom call XLA cannot partition (it
        # would gather the cache around it): the partitioned XLA einsums
        return "xla"
    if b * k * s * (h + v) * jnp.dtype(dtype).itemsize < MIN_MEASURED_BYTES:
        return "xla"
    name = shape_class(b, k, g, h, v, s, dtype, k_layout, v_layout, prefix)
    with _lock:
        if name in _memo:
            return _memo[name]["choice"]
        key = machine_key("cpu")
        path = cache_path(key)
        return _cached_choice(_memo, name, key, path, load_cache(path, key),
                              lambda: measure(b, k, g, h, v, s, dtype, k_layout, v_layout))


def report_lines() -> list[str]:
    """One line per decode-attention and weight-product choice made in this process: the
    shape class, the formulation, the measured GB/s of each candidate and whether it was
    measured now or read from the cache (with its date), and the machine."""
    model, isa = _cpu()
    lines = [f"decode-attention planner on {model} ({', '.join(isa)}; "
             f"{native.num_threads()} cores), jax {jax.__version__}:"] if _memo else []
    for name, e in sorted(_memo.items()):
        rates = ", ".join(f"{n} {r:.1f}" for n, r in e["gbps"].items())
        lines.append(f"  {name}: {e['choice']} (GB/s of cache read: {rates}; {_when(e)})")
    if _wmemo:
        lines.append(f"weight-product planner on {model} ({', '.join(isa)}; "
                     f"{native.num_threads()} cores), jax {jax.__version__}:")
    for impl in NATIVE_WEIGHT:
        configured = sorted(n for n, e in _wmemo.items()
                            if "gbps" not in e and e["choice"] == impl)
        if configured:
            lines.append(f"  {impl} as forced by model.weight_matmul (not measured) for "
                         f"{len(configured)} shape classes: {', '.join(configured[:4])}"
                         + (", ..." if len(configured) > 4 else ""))
    for name, e in sorted(_wmemo.items()):
        if "gbps" in e:
            rates = ", ".join(f"{n} {r:.1f}" for n, r in e["gbps"].items())
            lines.append(f"  {name}: {e['choice']} (GB/s of weight read: {rates}; "
                         f"{_when(e)})")
    return lines


def clear_memo() -> None:
    """Forgets this process's choices (the disk cache stays); for tests."""
    with _lock:
        _memo.clear()
        _wmemo.clear()


# ------------------------------------------------------------------ weight products

NATIVE_WEIGHT = ("native", "native_ksplit", "native_lanes")  # the kernel's formulations
WEIGHT_CANDIDATES = ("xla",) + NATIVE_WEIGHT
WEIGHT_STREAM_BYTES = 48 * 2**20  # weights timed per call: above a 32 MB L3
_wmemo: dict[str, dict] = {}


def weight_class(m: int, k: int, n: int, layout: str) -> str:
    """The cache entry name of one weight product: M rows (exact), K, N, layout."""
    return f"M{m}-K{k}-N{n}-{layout}-float32"


def _weight_native_ok(m: int) -> bool:
    from kvjax.native import rows_matmul as rm  # noqa: PLC0415
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
    in a step: XLA runs independent dots concurrently, which flattered 'xla' (2-core
    Intel Xeon, M = 1, [576, 576]: 17-21 GB/s independent, 12.5-12.9 chained; 'native'
    20-22 either way).

    Returns {'choice': fastest name, 'gbps': {name: GB/s of weight read}, 'gflops':
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
    from kvjax.native import rows_matmul as rm  # noqa: PLC0415
    copies = max(1, -(-WEIGHT_STREAM_BYTES // (4 * k * n)))
    rng = np.random.default_rng(0)
    wshape = (k, n) if layout == "kn" else (n, k)
    with jax.ensure_compile_time_eval():
        # separate arrays, not slices of one stacked array: a custom call's operand sliced
        # out of a stack is copied first (XLA's dot fuses the slice), which would charge
        # the native kernel a copy of every weight; a decode step's weights are separate
        w = tuple(jnp.asarray(rng.standard_normal(wshape, dtype=np.float32) / np.sqrt(k))
                  for _ in range(copies))  # / sqrt(K): outputs of x's size, no overflow
        x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
        prods = {"xla": (lambda a, b: a @ b) if layout == "kn" else (lambda a, b: a @ b.T),
                 "native": lambda a, b: rm.rows_matmul(a, b, layout),
                 "native_ksplit": lambda a, b: rm.rows_matmul(a, b, layout, "k"),
                 "native_lanes": lambda a, b: rm.rows_matmul(a, b, layout, lanes=True)}
        fns = {}
        for name in candidates:
            if name != "xla" and not _weight_native_ok(m):
                continue
            if applies(name, m, layout) != name:
                continue  # the kernel runs it as 'native' does: nothing to choose

            run = functools.partial(weight_chain, prods[name])
            fns[name] = jax.jit(run).lower(x, w).compile()
        if not fns:
            raise ValueError(f"candidates={tuple(candidates)!r}: none applies to M={m}, "
                             f"layout={layout!r}; allowed: {WEIGHT_CANDIDATES}")
        secs = _time(fns, (x, w), rounds, budget_s, _flusher() if cold else None)
    nbytes = 4 * k * n * copies
    best = _pick(secs)
    return {"choice": best, "gbps": {n_: round(nbytes / t / 1e9, 2) for n_, t in secs.items()},
            "gflops": {n_: round(2 * m * nbytes / 4 / t / 1e9, 2) for n_, t in secs.items()},
            "seconds": dict(secs), "copies": copies}


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


def applies(formulation: str, m: int, layout: str) -> str:
    """The formulation that really runs for ``formulation`` on M rows and ``layout``:
    'native_ksplit' is 'native' unless M > 1 and 'kn'; 'native_lanes' is 'native' unless
    M > 1 and 'nk' (the kernel runs those cases alike); others are themselves."""
    if formulation == "native_ksplit" and (layout != "kn" or m == 1):
        return "native"
    if formulation == "native_lanes" and (layout != "nk" or m == 1):
        return "native"
    return formulation


def weight_matmul(impl: str, m: int, k: int, n: int, layout: str = "kn") -> str:
    """The formulation ('xla' or a 'native*' one) of one float32 product of M rows
    with a weight of K x N (``layout`` 'kn': stored [K, N]; 'nk': [N, K]) for
    ``model.weight_matmul=impl``.

    'xla' -> 'xla'. 'native', 'native_ksplit', 'native_lanes' -> the one that runs
    (:func:`applies`) where the kernel runs (CPU process, M <= MAX_ROWS, library
    built), else 'xla'. 'auto' ->
    'xla' where the kernel cannot run, the weight is below :data:`MIN_MEASURED_BYTES` or
    the product is traced under a multi-device mesh
    (``jax.sharding.get_abstract_mesh()``); otherwise the fastest measured for this
    class among :data:`WEIGHT_CANDIDATES` (:func:`measure_weight_matmul`; the K split
    only for M > 1 and 'kn', the lanes only for M > 1 and 'nk'), once per machine
    (cached on disk like
    :func:`decode_attention`, keyed with the hash of rows_matmul.cc).

    Raises:
      ValueError: an unknown impl or layout, naming it.
    """
    from kvjax.models import weight_matmul as wm  # noqa: PLC0415
    wm.check_impl(impl)
    _check_weight_layout(layout)
    if impl == "xla" or not _weight_native_ok(m):
        return "xla"
    name = weight_class(m, k, n, layout)
    if impl in NATIVE_WEIGHT:
        impl = applies(impl, m, layout)
        with _lock:
            _wmemo.setdefault(name, {"choice": impl})
        return impl
    if 4 * int(k) * int(n) < MIN_MEASURED_BYTES:  # Python ints: no int32 overflow
        return "xla"
    if jax.sharding.get_abstract_mesh().size > 1:
        # traced under a device mesh: a custom call XLA cannot partition would gather
        # the sharded weights around it; the partitioned XLA dot
        return "xla"
    with _lock:
        if name in _wmemo and "gbps" in _wmemo[name]:
            return applies(_wmemo[name]["choice"], m, layout)
        key = machine_key("cpu", "rows_matmul.cc")
        path = cache_path(key, "weight_matmul")
        # a cached choice that does not apply to this class (an edited file) runs as
        # the kernel would run it
        return applies(_cached_choice(_wmemo, name, key, path,
                                      load_cache(path, key, WEIGHT_CANDIDATES),
                                      lambda: measure_weight_matmul(m, k, n, layout),
                                      WEIGHT_CANDIDATES),
                       m, layout)
