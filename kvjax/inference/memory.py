"""Will a run fit in memory? Checked before anything large is allocated.

A run holds its weights, its KV cache and the compiled programs' temporaries at once. This
module estimates those bytes, reads what the device has free, and refuses a run that does
not fit with :class:`MemoryCheckError` (a :class:`~kvjax.config.ConfigError`) naming the
bytes asked for, the bytes available and the largest ``max_seq_len`` / ``batch_size``
that would fit, instead of letting the kernel's out-of-memory killer end the process
with no message (exit 137).

Available memory: on an accelerator ``device.memory_stats()`` (``bytes_limit -
bytes_in_use``); on the CPU the host's ``MemAvailable`` (``/proc/meminfo``: free memory
plus reclaimable caches), else ``os.sysconf`` free pages. Memory already held (weights
loaded) is not available, so pass only what is still to be allocated.

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

MARGIN_FIXED_BYTES = 512 * 2**20
MARGIN_FRACTION = 0.10


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


def available_bytes(device=None) -> tuple[int | None, str]:
    """(bytes free on ``device`` (default: JAX's first device), where the figure comes
    from); (None, reason) when the device reports nothing."""
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
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable (/proc/meminfo)"
    except OSError:
        pass
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "host free pages (os.sysconf)")
    except (ValueError, OSError, AttributeError):
        return None, "the host reports no free memory"


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
    if cache_lib.policy_for(cfg).kind == "dense":  # a ring's size does not depend on max_seq_len
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
    from kvjax.analysis import theory  # noqa: PLC0415 (analysis is not needed otherwise)

    cfg = run.model
    weights = 0
    if not weights_loaded:
        weights = theory.weight_bytes(cfg) * (2 if run.weights == "smollm2" else 1)
    if prompt_tokens is None:
        prompt_tokens = len(run.prompt.encode("utf-8"))
    s = max(run.max_seq_len, run.cost_context or 0)
    check(cfg, run.batch_size, s, what="decode", weights_bytes=weights,
          prompt_tokens=min(prompt_tokens, run.max_seq_len))
