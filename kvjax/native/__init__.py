"""Native CPU kernels behind ``jax.ffi``, built on first use with the system C++ compiler.

:func:`load` compiles ``decode_attention.cc`` (``g++ -O3 -march=native -fopenmp``)
into the kvjax cache directory (``$KVJAX_CACHE`` or ``~/.cache/kvjax``, under
``native/<build key>``: :func:`build_key`, a hash of the source, the shared headers, the
compiler, flags, CPU, the jaxlib version and its XLA FFI headers), loads it, registers its
XLA FFI handler and runs one small real call of the kernel (a smoke call, checked against
its known answer). Without a compiler, or if the build, the load or the smoke call fails,
it warns once and returns False, and kvjax uses its pure-XLA formulations
(``kvjax/models/decode_kernels.py``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

TARGET = "kvjax_decode_attention"
PAGED_TARGET = "kvjax_paged_decode_attention"  # the same loops over a page pool, in place
_SOURCE = pathlib.Path(__file__).with_name("decode_attention.cc")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-w")
_lock = threading.Lock()
_state: dict = {}


def cache_root() -> pathlib.Path:
    """``$KVJAX_CACHE`` or ``~/.cache/kvjax`` (the weights' cache directory)."""
    return pathlib.Path(os.environ.get("KVJAX_CACHE") or pathlib.Path.home() / ".cache" / "kvjax")


def machine_id() -> str:
    """CPU model name and its flags from /proc/cpuinfo ('' where unreadable)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                  if ln.startswith("flags")), "")
    return f"{model}|{flags}"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def headers() -> str:
    """The text of the shared headers (``*.h``) beside the kernels: part of every build key."""
    return "\n".join(p.read_text() for p in sorted(_SOURCE.parent.glob("*.h")))


def ffi_headers() -> str:
    """The text of the XLA FFI headers the kernels compile against (every ``*.h`` under
    ``jax.ffi.include_dir()``, sorted by path): part of every build key, since a library
    built against another jaxlib's FFI may load and then fail at its first call."""
    import jax.ffi  # noqa: PLC0415
    root = pathlib.Path(jax.ffi.include_dir())
    return "\n".join(f"{p.relative_to(root)}\n{p.read_text(errors='replace')}"
                      for p in sorted(root.rglob("*.h")))


def build_key(source: pathlib.Path, cxx: str, compiler_version: str,
              flags: tuple[str, ...] = ()) -> str:
    """16 hex digits naming one build of ``source``: the sha256 of its text, the shared
    headers (:func:`headers`), the compiler ``cxx`` and its ``--version`` text, the flags
    (``_FLAGS`` and the extra ``flags``), the CPU (:func:`machine_id`),
    ``jaxlib.__version__`` and the XLA FFI headers (:func:`ffi_headers`). A change in any
    of them builds a new library."""
    import jaxlib  # noqa: PLC0415
    return hashlib.sha256("\n".join(
        [source.read_text(), headers(), cxx, compiler_version, " ".join(_FLAGS + flags),
         machine_id(), f"jaxlib {jaxlib.__version__}", ffi_headers()]).encode()
    ).hexdigest()[:16]


def _build(out: pathlib.Path, cxx: str, source: pathlib.Path = _SOURCE,
           flags: tuple[str, ...] = ()) -> None:
    import jax.ffi  # noqa: PLC0415
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = pathlib.Path(tmp) / out.name
        cmd = [cxx, *_FLAGS, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o",
               str(tmp_so)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file


def build_library(source: pathlib.Path, name: str,
                  flags: tuple[str, ...] = ()) -> pathlib.Path | None:
    """The shared library ``lib<name>.so`` built from ``source`` (built if missing, under
    ``<cache_root>/native/<build_key(...)>/``), or None without a compiler. ``flags``:
    compiler flags after ``_FLAGS`` (e.g. ``("-mno-avx512f",)``: the AVX2 loops on an
    AVX-512 machine, for their tests). Raises RuntimeError naming the compiler's command
    and its errors when the build fails."""
    cxx = _compiler()
    if cxx is None:
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    out = cache_root() / "native" / build_key(source, cxx, version, flags) / f"lib{name}.so"
    if not out.exists():
        print(f"kvjax: building {source.name} with {os.path.basename(cxx)} (once per "
              f"machine and source; into {out.parent})", file=sys.stderr, flush=True)
        _build(out, cxx, source, flags)
    return out


def library_path() -> pathlib.Path | None:
    """Where the decode-attention library lives (built if missing), or None without a
    compiler."""
    return build_library(_SOURCE, "kvjax_decode_attention")


def register(state: dict, lock: threading.Lock, build, target: str, symbol: str,
             what: str, fallback: str, smoke=None, more=()) -> bool:
    """Builds (``build()``: a library path, or None without a compiler), loads and
    registers the FFI target ``target`` (the library's handler ``symbol``; ``more``: further
    (target, symbol) pairs of the same library) on CPU, then
    runs ``smoke()`` (one small real call of the kernel on the CPU device that raises
    unless the answer is right; None: none), once per process (the answer is kept in
    ``state['ok']``). Returns True when it is available; False, with one warning naming
    ``what`` and the cause and saying ``fallback``, when there is no compiler, the build,
    load or smoke call failed (e.g. a library built for another jaxlib), or
    ``KVJAX_NATIVE=0``. Never raises (a crash inside the library cannot be caught)."""
    with lock:
        if "ok" in state:
            return state["ok"]
        ok = False
        if os.environ.get("KVJAX_NATIVE", "1") != "0":
            try:
                path = build()
                if path is None:
                    warnings.warn(f"{what}: no C++ compiler (g++/c++ or $CXX); {fallback}",
                                  stacklevel=3)
                else:
                    import jax  # noqa: PLC0415
                    lib = ctypes.cdll.LoadLibrary(str(path))
                    for t, sym in ((target, symbol), *more):
                        jax.ffi.register_ffi_target(
                            t, jax.ffi.pycapsule(getattr(lib, sym)), platform="cpu")
                    state["lib"] = lib
                    if smoke is not None:
                        try:
                            _run_smoke(smoke)
                        except Exception as e:  # noqa: BLE001
                            raise RuntimeError(f"its smoke call failed: {e}") from e
                    ok = True
            except Exception as e:  # noqa: BLE001 (any failure -> the XLA fallback)
                warnings.warn(f"{what} unavailable ({e}); {fallback}", stacklevel=3)
        state["ok"] = ok
        return ok


def _run_smoke(smoke) -> None:
    """Runs ``smoke()`` concretely on the CPU device, also when called while tracing."""
    import jax  # noqa: PLC0415
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):
        smoke()


def check_close(what: str, got, want, tol: float = 1e-5) -> None:
    """Raises RuntimeError naming ``what`` unless ``got`` is finite and equals ``want``
    (arrays of the same shape) to ``tol`` relative + absolute: a smoke call's check."""
    import numpy as np  # noqa: PLC0415
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape or not np.isfinite(got).all() or not np.allclose(
            got, want, rtol=tol, atol=tol):
        raise RuntimeError(f"{what} gave {got.ravel()[:8].tolist()} (shape "
                           f"{list(got.shape)}); expected {want.ravel()[:8].tolist()}")


def _smoke() -> None:
    """One decode-attention call (B = K = G = 1, H = 8, two visible slots, q = 0): scores
    0, so m = 0, l = 2 and o = the sum of the two value rows."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    f32 = jnp.float32
    v = np.arange(16, dtype=np.float32).reshape(1, 1, 2, 8)
    out = (jax.ShapeDtypeStruct((1, 1, 1, 8), f32), jax.ShapeDtypeStruct((1, 1, 1), f32),
           jax.ShapeDtypeStruct((1, 1, 1), f32))
    o, m, l = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        jnp.zeros((1, 1, 1, 8), f32), jnp.ones((1, 1, 2, 8), f32), jnp.asarray(v),
        jnp.ones((1, 2), jnp.bool_), k_bksh=np.int64(1), v_bksh=np.int64(1),
        scale=np.float32(8 ** -0.5), threads=np.int64(1), blocks=np.int64(0))
    check_close("decode attention's smoke call (m, l)", [float(m[0, 0, 0]),
                                                        float(l[0, 0, 0])], [0.0, 2.0])
    check_close("decode attention's smoke call (o)", o[0, 0, 0], v[0, 0].sum(0))


def load() -> bool:
    """Builds (once per machine), loads and registers the FFI targets :data:`TARGET` and
    :data:`PAGED_TARGET` on CPU, and runs one small call of the first. Returns True when it is available; False (with
    one warning naming the cause) when there is no compiler or the build, load or smoke
    call failed. Set ``KVJAX_NATIVE=0`` to skip it."""
    return register(_state, _lock, library_path, TARGET, "KvjaxDecodeAttention",
                    "kvjax native kernels", "using the XLA formulations", smoke=_smoke,
                    more=((PAGED_TARGET, "KvjaxPagedDecodeAttention"),))


def block_sweep() -> bool:
    """Whether the kernel built here sweeps a grouped row block by block when asked
    ('native_blocks'): built with ``-march=native`` on a CPU with AVX-512 (its 32 vector
    registers hold a block's scores and a group's value accumulators at once)."""
    return "avx512f" in machine_id().split("|", 1)[-1].split()


def num_threads() -> int:
    """Threads the kernel uses: ``$KVJAX_NATIVE_THREADS``, else the CPUs this process
    may run on.

    Raises:
      ValueError: ``$KVJAX_NATIVE_THREADS`` is not a positive integer, naming it.
    """
    value = os.environ.get("KVJAX_NATIVE_THREADS")
    if value:
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"KVJAX_NATIVE_THREADS={value!r}; allowed: a positive integer "
                             "(threads of the native kernels), or unset for every CPU")
        return threads
    return usable_cores()


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where the
    platform has none, at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
