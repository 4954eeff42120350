"""Will a run fit in memory? Checked before anything large is allocated.

A run holds its weights, its KV cache and the compiled programs' temporaries at once. This
module estimates those bytes, reads what the device has free, and refuses a run that does
not fit with :class:`MemoryCheckError` (a :class:`~kvjax.config.ConfigError`) naming the
bytes asked for, the bytes available and the largest ``max_seq_len`` / ``batch_size``
that would fit, instead of letting the kernel's out-of-memory killer end the process
with no message (exit 137).

Available memory: on an accelerator ``device.memory_stats()`` (``bytes_limit -
bytes_in_use``); on the CPU the smaller of the host's ``MemAvailable`` (``/proc/meminfo``:
free memory plus reclaimable caches; else ``os.sysconf`` free pages) and the room left
under the process's cgroup memory limits (:func:`cgroup_available`: a container's limit,
which the kernel enforces with its out-of-memory killer whatever the host has free).
Memory already held (weights loaded) is not available, so pass only what is still to be
allocated.

Temporaries: when a compiled program is at hand, its ``memory_analysis()`` temp bytes;
otherwise :func:`temp_bytes_estimate` (the prefill's float32 attention scores and
weights, its logits and activations). A margin of 512 MiB + 10% covers the runtime.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from kvjax import cache as cache_lib
from kvjax.config import ConfigError, ModelConfig
from kvjax.analysis import theory

MARGIN_FIXED_BYTES = 512 * 2**20
MARGIN_FRACTION = 0.10

ROOT = "/"
"""The folder ``proc/`` and ``sys/fs/cgroup/`` are read under (a test points it at a fake
tree; :func:`available_bytes` and :func:`cgroup_available` also take ``root=``)."""

CGROUP_V1_NO_LIMIT = 2**60
"""A cgroup v1 ``memory.limit_in_bytes`` at or above this means no limit (unlimited reads
2^63 - 4096, rounded down to pages)."""


class MemoryCheckError(ConfigError):
    """A run would need more memory than the device has available."""


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes a run will hold (all in bytes).

    Attributes:
      weights: parameters still to be allocated (0 when already loaded).
      cache: the KV cache (``cache_lib.total_bytes`` of ``cache_spec``: tensors and
        bookkeeping).
      temporaries: the largest compiled temporaries (measured or estimated).
      margin: runtime slack, MARGIN_FIXED_BYTES + MARGIN_FRACTION of the rest.
    """

    weights: int
    cache: int
    temporaries: int
    margin: int

    @property
    def total(self) -> int:
        return self.weights + self.cache + self.temporaries + self.margin


def _read_int(path: str) -> int | None:
    """The integer in file ``path``; None when absent, unreadable, 'max' or not a number."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:  # 'max' (cgroup v2: no limit) or anything else
        return None


def _with_ancestors(base: str, rel: str) -> list[str]:
    """``base/rel`` and each folder above it up to ``base`` itself (deepest first)."""
    parts = [p for p in rel.strip("/").split("/") if p and p != ".."]
    return [os.path.join(base, *parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_available(root: str | None = None) -> tuple[int, str] | None:
    """Room left under the process's cgroup memory limits, in bytes, and where it comes from.

    Reads ``root/proc/self/cgroup`` for the process's cgroups and, for cgroup v2
    (``sys/fs/cgroup``, or ``sys/fs/cgroup/unified`` on a hybrid host) ``memory.max -
    memory.current`` ('max': no limit), for cgroup v1 (``sys/fs/cgroup/memory``)
    ``memory.limit_in_bytes - memory.usage_in_bytes`` (a limit >=
    :data:`CGROUP_V1_NO_LIMIT`: none), in the process's cgroup folder and every folder
    above it (a parent's limit binds its children; inside a container the mount's top
    folder is the container's own cgroup).

    Args:
      root: the folder holding ``proc/`` and ``sys/`` (default :data:`ROOT`).
    Returns:
      (the smallest limit - usage, at least 0; 'cgroup v2 memory.max - memory.current
      (FOLDER)' or the v1 equivalent), or None when no limit applies or none is readable.
    """
    root = ROOT if root is None else root
    rel = {"v1": "/", "v2": "/"}
    try:
        with open(os.path.join(root, "proc/self/cgroup")) as f:
            for line in f:
                fields = line.rstrip("\n").split(":", 2)
                if len(fields) != 3:
                    continue
                if fields[0] == "0" and fields[1] == "":
                    rel["v2"] = fields[2]
                elif "memory" in fields[1].split(","):
                    rel["v1"] = fields[2]
    except OSError:
        pass
    cg = os.path.join(root, "sys/fs/cgroup")
    kinds = [("v2", base, "memory.max", "memory.current", None)
             for base in (cg, os.path.join(cg, "unified"))]
    kinds.append(("v1", os.path.join(cg, "memory"), "memory.limit_in_bytes",
                  "memory.usage_in_bytes", CGROUP_V1_NO_LIMIT))
    best = None
    for version, base, limit_file, usage_file, no_limit in kinds:
        for folder in dict.fromkeys(_with_ancestors(base, rel[version])):
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is None or (no_limit is not None and limit >= no_limit):
                continue
            usage = _read_int(os.path.join(folder, usage_file)) or 0
            room = max(0, limit - usage)
            if best is None or room < best[0]:
                best = (room, f"cgroup {version} {limit_file} - {usage_file} ({folder})")
    return best


def _host_available(root: str) -> tuple[int | None, str]:
    """(the host's MemAvailable or free pages in bytes, its source); (None, reason)."""
    try:
        with open(os.path.join(root, "proc/meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable (/proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "host free pages (os.sysconf)")
    except (ValueError, OSError, AttributeError):
        return None, "the host reports no free memory"


def available_bytes(device=None, *, root: str | None = None) -> tuple[int | None, str]:
    """(bytes free on ``device`` (default: JAX's first device), where the figure comes
    from); (None, reason) when the device reports nothing.

    On the CPU: the smaller of the host's MemAvailable and :func:`cgroup_available`
    (``root``: the folder holding ``proc/`` and ``sys/``, default :data:`ROOT`).
    """
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # noqa: BLE001 (unimplemented on some backends)
            stats = {}
        if "bytes_limit" in stats:
            return (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
                    f"{device.platform} memory_stats (bytes_limit - bytes_in_use)")
        return None, f"{device.platform} reports no memory_stats"
    root = ROOT if root is None else root
    host, source = _host_available(root)
    limited = cgroup_available(root)
    if limited is not None and (host is None or limited[0] < host):
        return limited[0], (limited[1] + (f", below the {source}" if host is not None
                                          else ""))
    return host, source


def temp_bytes_estimate(cfg: ModelConfig, batch_size: int, max_seq_len: int,
                        prompt_tokens: int) -> int:
    """Largest temporaries of a prefill of ``prompt_tokens`` T into a cache of S =
    ``max_seq_len`` slots (W for a window), bytes: one layer's float32 scores and weights
    [B, N, T, S + T] (x2), the float32 logits [B, T, V], and activations [B, T, F] x 4."""
    b, t = batch_size, max(1, prompt_tokens)
    s = cache_lib.num_slots(cfg, max_seq_len)
    scores = 2 * b * cfg.num_heads * t * (s + t) * 4
    logits = b * t * cfg.vocab_size * 4
    acts = 4 * b * t * max(cfg.mlp_dim, cfg.d_model) * 4
    return scores + logits + acts


def plan(cfg: ModelConfig, batch_size: int, max_seq_len: int, weights_bytes: int = 0,
         temp_bytes: int | None = None, prompt_tokens: int = 1) -> MemoryPlan:
    """The bytes a run with this cache will hold (see :class:`MemoryPlan`).

    ``temp_bytes``: measured temporaries (``compiled.memory_analysis().temp_size_in_bytes``);
    None estimates them (:func:`temp_bytes_estimate` at ``prompt_tokens``).
    """
    cache = cache_lib.total_bytes(cache_lib.cache_spec(cfg, batch_size, max_seq_len))
    temps = (temp_bytes_estimate(cfg, batch_size, max_seq_len, prompt_tokens)
             if temp_bytes is None else int(temp_bytes))
    rest = weights_bytes + cache + temps
    return MemoryPlan(weights=int(weights_bytes), cache=cache, temporaries=temps,
                      margin=MARGIN_FIXED_BYTES + int(MARGIN_FRACTION * rest))


def _largest(fits, hi: int) -> int:
    """Largest n in [1, hi] with fits(n) (fits is monotone), 0 if none."""
    if not fits(1):
        return 0
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def check(cfg: ModelConfig, batch_size: int, max_seq_len: int, *, what: str,
          weights_bytes: int = 0, temp_bytes: int | None = None, prompt_tokens: int = 1,
          available: int | None = None, source: str | None = None) -> MemoryPlan:
    """Raises MemoryCheckError unless the run's :func:`plan` fits the memory available.

    Args:
      cfg, batch_size, max_seq_len: the cache to allocate (B, S).
      what: the run, for the message (e.g. 'decode').
      weights_bytes, temp_bytes, prompt_tokens: see :func:`plan`.
      available: bytes free (None: :func:`available_bytes`); source: where it came from.
    Returns:
      the plan (also when the device reports no memory figure: then nothing is checked).
    Raises:
      MemoryCheckError: the plan exceeds the memory available; the message names both
        byte counts, the largest max_seq_len at this batch_size and the largest
        batch_size at this max_seq_len that fit, and the override
        ``--config.ignore_memory_check=True``.
    """
    need = plan(cfg, batch_size, max_seq_len, weights_bytes, temp_bytes, prompt_tokens)
    if available is None:
        available, source = available_bytes()
    if available is None or need.total <= available:
        return need

    def total(b, s):
        return plan(cfg, b, s, weights_bytes, temp_bytes, prompt_tokens).total

    fits = []
    if cache_lib.policy_for(cfg).kind != "ring":  # a ring's size does not depend on max_seq_len
        s = _largest(lambda n: total(batch_size, n) <= available, max_seq_len)
        fits.append(f"max_seq_len <= {s:,} at batch_size={batch_size}" if s else
                    f"no max_seq_len at batch_size={batch_size}")
    b = _largest(lambda n: total(n, max_seq_len) <= available, batch_size)
    fits.append(f"batch_size <= {b:,} at max_seq_len={max_seq_len:,}" if b else
                f"no batch_size at max_seq_len={max_seq_len:,}")
    raise MemoryCheckError(
        f"memory check ({what}): this run needs ~{need.total:,} bytes (weights "
        f"{need.weights:,} + KV cache {need.cache:,} for batch_size={batch_size} x "
        f"max_seq_len={max_seq_len:,} in {cfg.dtype} + temporaries {need.temporaries:,} "
        f"+ margin {need.margin:,}) but {available:,} bytes are available ({source}); "
        f"what fits: {'; '.join(fits)}. Override with --config.ignore_memory_check=True.")


def check_run(run, *, weights_loaded: bool, prompt_tokens: int | None = None) -> None:
    """:func:`check` for a decode run (``kvjax.config.RunConfig``) unless
    ``run.ignore_memory_check``.

    Checks the larger of the run's two caches (they are not held at once): the decode
    cache of ``max_seq_len`` slots and the cost hook's of ``cost_context``. Weights still
    to load count twice for 'smollm2' (the dequantised host copy and the device arrays).
    ``prompt_tokens`` None bounds the prompt by its UTF-8 bytes (byte-level BPE).

    Raises:
      MemoryCheckError: see :func:`check`.
    """
    if run.ignore_memory_check:
        return

    cfg = run.model
    weights = 0
    if not weights_loaded:
        weights = theory.weight_bytes(cfg) * (2 if run.weights == "smollm2" else 1)
    if prompt_tokens is None:
        prompt_tokens = len(run.prompt.encode("utf-8"))
    s = max(run.max_seq_len, run.cost_context or 0)
    check(cfg, run.batch_size, s, what="decode", weights_bytes=weights,
          prompt_tokens=min(prompt_tokens, run.max_seq_len))
