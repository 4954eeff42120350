"""The native CPU prompt attention (``prefill_attention.cc``) behind ``jax.ffi``.

A fused FlashAttention-2 forward (Dao 2023, Algorithm 1) for a chunk of T prompt tokens
over (old cache slots ++ the chunk): per tile of queries (the G query heads of each token
of one KV head), key/value blocks of 64 slots are streamed with an online softmax whose
scores stay in registers/L1; blocks no query of the tile can see (above the causal
diagonal, outside the window unless they hold a sink, empty) are skipped; XLA's intra-op thread pool over
(batch row, KV head, query tile). float32 (other float inputs are widened first).

Built on first use exactly as the decode kernel (:mod:`kvjax.native`: ``g++ -O3
-march=native -fopenmp``, into ``<cache_root>/native/<hash of source, compiler, flags,
CPU>/``); :func:`load` returns False with one warning when it cannot be built, and the
model then uses the XLA tiled path (:mod:`kvjax.models.flash`). ``KVJAX_NATIVE=0`` skips
it; ``KVJAX_NATIVE_THREADS`` sets its threads.

XLA's cost analysis sees a custom call as an opaque op: :func:`custom_call_costs` gives
what the analysis of a compiled program containing one should add (the kernel's operand
and result bytes, its causal FLOP), see ``kvjax.analysis.costs.analyze_prefill``.
"""

from __future__ import annotations

import pathlib
import threading

import numpy as np

from kvjax import native as _native
from kvjax import backend as backend_lib
from kvjax.ops import check_window
from kvjax.native import num_threads

TARGET = "kvjax_prefill_attention"
SOURCE = pathlib.Path(__file__).with_name("prefill_attention.cc")
BLOCK_K = 64   # key slots per block (prefill_attention.cc's kBlock)
TILE_ROWS = 64  # query rows (tokens x G) per work item (kTileRows)
_lock = threading.Lock()
_state: dict = {}


def library_path() -> pathlib.Path | None:
    """Where the built library lives (built if missing; raises RuntimeError naming the
    compiler's command and its errors when the build fails), or None without a
    compiler."""
    return _native.build_library(SOURCE, "kvjax_prefill_attention")


def _smoke() -> None:
    """One call: a chunk of T = 1 token (B = K = G = 1, H = 8) over an empty cache (one
    dummy slot at position -1) attends only to itself, so its output is its value."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    f32 = jnp.float32
    v = np.arange(8, dtype=np.float32).reshape(1, 1, 1, 8) - 3.5
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((1, 1, 1, 1, 8), f32),
                           vmap_method="sequential")(
        jnp.ones((1, 1, 1, 1, 8), f32), jnp.ones((1, 1, 1, 8), f32), jnp.asarray(v),
        jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1, 1, 8), f32),
        jnp.zeros((1, 1, 1, 8), f32), jnp.full((1, 1), -1, jnp.int32),
        k_bksh=np.int64(1), v_bksh=np.int64(1), scale=np.float32(8 ** -0.5),
        window=np.int64(0), sinks=np.int64(0), has_old=np.int64(0), threads=np.int64(1))
    _native.check_close("prefill attention's smoke call", out[0, 0, 0, 0], v[0, 0, 0])


def load() -> bool:
    """Builds (once per machine), loads and registers :data:`TARGET` on CPU, and runs one
    small call of it. True when it is available; False, with one warning naming the
    cause, when there is no compiler, the build, load or smoke call failed, or
    ``KVJAX_NATIVE=0``."""
    return _native.register(_state, _lock, library_path, TARGET, "KvjaxPrefillAttention",
                            "kvjax native prefill attention", "using the XLA tiled path",
                            smoke=_smoke)


def attend_chunk(q, k, v, positions, *, k_old=None, v_old=None, old_positions=None,
                 k_layout: str = "BKSH", v_layout: str = "BKSH",
                 window_size: int | None = None, num_sink_tokens: int = 0):
    """Grouped-query attention (MHA/GQA/MQA) of a chunk over (old slots ++ itself) in one
    fused custom call; the same function as ``kvjax.models.flash.attend_chunk``.

    Args:
      q: [B, T, K, G, H] rotated queries (any float dtype; computed in float32).
      k: [B, K, T, H] the chunk's keys ('BKSH'), or [B, K, H, T] with k_layout 'BKHS'.
      v: [B, K, T, Hv] the chunk's values, or [B, K, Hv, T] with v_layout 'BKHS'.
      positions: [B, T] int32 absolute positions of the chunk (-1: a padded row, whose
        output is 0). Any order is accepted (blocks are skipped by their min/max).
      k_old, v_old: the layer's cache before the chunk, S slots in the same layouts;
        None (with old_positions None) for an empty cache.
      old_positions: [S] or [B, S] int32 slot positions (-1: empty).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      window_size, num_sink_tokens: W and s of a sliding window with sinks (None, 0:
        full causal attention); visibility is ``kvjax.cache.attention_mask``'s rule.
    Returns:
      [B, T, K, G, Hv] in v's dtype (float32 softmax and accumulation; 1/sqrt(H) scale).
    Raises:
      ValueError: a bad layout, window or sink count, rank, or old tensors given partly.
      RuntimeError: the library could not be built or loaded (:func:`load`), or the
        backend is not CPU.
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    if (k_old is None) != (v_old is None) or (k_old is None) != (old_positions is None):
        raise ValueError("k_old, v_old and old_positions: give all three or none (got "
                         f"{[x is not None for x in (k_old, v_old, old_positions)]})")
    for name, lay in (("k_layout", k_layout), ("v_layout", v_layout)):
        if lay not in ("BKSH", "BKHS"):
            raise ValueError(f"{name}={lay!r}; allowed: ('BKSH', 'BKHS')")
    check_window(window_size, num_sink_tokens)
    if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q {q.shape}, k {k.shape}, v {v.shape}; allowed: q [B, T, K, G, "
                         "H], k and v rank 4")
    if backend_lib.current() != "cpu":
        raise RuntimeError(f"prefill_impl='native' on backend {backend_lib.current()!r}; "
                           "allowed: 'cpu' (use 'tiled' elsewhere)")
    if not load():
        raise RuntimeError("prefill_impl='native': the native library could not be built "
                           "or loaded (see the warning above); use 'tiled'")
    b, t, kh, g, h = q.shape
    hv = v.shape[-1] if v_layout == "BKSH" else v.shape[-2]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    if k_old is None:   # one empty dummy slot (position -1); the kernel skips it
        shape_k = (b, kh, 1, h) if k_layout == "BKSH" else (b, kh, h, 1)
        shape_v = (b, kh, 1, hv) if v_layout == "BKSH" else (b, kh, hv, 1)
        k_old, v_old = jnp.zeros(shape_k, jnp.float32), jnp.zeros(shape_v, jnp.float32)
        old_positions, has_old = jnp.full((b, 1), -1, jnp.int32), 0
    else:
        has_old = 1
        if old_positions.ndim == 1:
            old_positions = jnp.broadcast_to(old_positions, (b, old_positions.shape[0]))
    out_type = jax.ShapeDtypeStruct((b, t, kh, g, hv), jnp.float32)
    out = jax.ffi.ffi_call(TARGET, out_type, vmap_method="sequential")(
        f32(q), f32(k), f32(v), positions.astype(jnp.int32), f32(k_old), f32(v_old),
        old_positions.astype(jnp.int32),
        k_bksh=np.int64(k_layout == "BKSH"), v_bksh=np.int64(v_layout == "BKSH"),
        scale=np.float32(h ** -0.5), window=np.int64(window_size or 0),
        sinks=np.int64(num_sink_tokens), has_old=np.int64(has_old),
        threads=np.int64(num_threads()))
    return out.astype(v.dtype)
