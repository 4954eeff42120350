"""Native CPU kernels behind ``jax.ffi``, built on first use with the system C++ compiler.

:func:`load` compiles ``decode_attention.cc`` (``g++ -O3 -march=native -fopenmp``)
into the kvjax cache directory (``$KVJAX_CACHE`` or ``~/.cache/kvjax``, under
``native/<hash of source, compiler, flags and CPU>``), loads it and registers its XLA FFI
handler. Without a compiler, or if the build fails, it warns once and returns None, and
kvjax uses its pure-XLA formulations (``kvjax/models/decode_kernels.py``).
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


def _build(out: pathlib.Path, cxx: str, source: pathlib.Path = _SOURCE) -> None:
    import jax.ffi  # noqa: PLC0415
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = pathlib.Path(tmp) / out.name
        cmd = [cxx, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(tmp_so)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp_so, out)  # atomic: concurrent builders never see half a file


def build_library(source: pathlib.Path, name: str) -> pathlib.Path | None:
    """The shared library ``lib<name>.so`` built from ``source`` (built if missing, under
    ``<cache_root>/native/<hash of source, shared headers, compiler and its version,
    flags, CPU>/``), or None without a compiler. Raises RuntimeError naming the compiler's
    command and its errors when the build fails."""
    cxx = _compiler()
    if cxx is None:
        return None
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\n".join(
        [source.read_text(), headers(), cxx, version, " ".join(_FLAGS), machine_id()]).encode()
    ).hexdigest()[:16]
    out = cache_root() / "native" / key / f"lib{name}.so"
    if not out.exists():
        print(f"kvjax: building {source.name} with {os.path.basename(cxx)} (once per "
              f"machine and source; into {out.parent})", file=sys.stderr, flush=True)
        _build(out, cxx, source)
    return out


def library_path() -> pathlib.Path | None:
    """Where the decode-attention library lives (built if missing), or None without a
    compiler."""
    return build_library(_SOURCE, "kvjax_decode_attention")


def register(state: dict, lock: threading.Lock, build, target: str, symbol: str,
             what: str, fallback: str) -> bool:
    """Builds (``build()``: a library path, or None without a compiler), loads and
    registers the FFI target ``target`` (the library's handler ``symbol``) on CPU, once
    per process (the answer is kept in ``state['ok']``). Returns True when it is
    available; False, with one warning naming ``what`` and the cause and saying
    ``fallback``, when there is no compiler, the build or load failed, or
    ``KVJAX_NATIVE=0``. Never raises."""
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
                    jax.ffi.register_ffi_target(
                        target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                    state["lib"] = lib
                    ok = True
            except Exception as e:  # noqa: BLE001 (any failure -> the XLA fallback)
                warnings.warn(f"{what} unavailable ({e}); {fallback}", stacklevel=3)
        state["ok"] = ok
        return ok


def load() -> bool:
    """Builds (once per machine), loads and registers the FFI target :data:`TARGET` on
    CPU. Returns True when it is available; False (with one warning naming the cause)
    when there is no compiler or the build or load failed. Set ``KVJAX_NATIVE=0`` to
    skip it."""
    return register(_state, _lock, library_path, TARGET, "KvjaxDecodeAttention",
                    "kvjax native kernels", "using the XLA formulations")


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
