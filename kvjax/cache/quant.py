"""Quantized KV-cache formats: codes plus float32 scale tensors (the blog's "bytes" factor
below 2).

A quantized cache stores each cached tensor (``'k'``, ``'v'``; MLA ``'c_kv'``,
``'k_rope'``) as codes and adds one scale tensor per name, ``name + '_scale'``, that
:func:`kvjax.cache.tensor_specs` lists beside it, so the scales are part of the cache
pytree: ``cache_bytes`` and the XLA attribution count them as KV bytes. Each cached row
(one token of one KV head: the H values of a key, or MLA's C latent / R rotary values) is
quantized on its own along its channel axis, symmetric around zero:

* ``int8``: absmax per row (per token per KV head), ``scale = max|x| / 127``, codes
  ``round(x / scale)`` in [-127, 127] (MaxText's int8 KV cache; KIVI, Liu et al. 2024,
  uses per-channel key scales, which a streaming write cannot keep fixed).
* ``float8_e4m3fn`` / ``float8_e5m2``: per row, ``scale = max|x| / fmax`` (448 / 57344),
  codes ``x / scale`` rounded to nearest-even by the cast (vLLM's fp8 KV cache, there with
  one scale per tensor).
* ``int4``: per-token groups of ``gcd(width, 32)`` values (32 for SmolLM2's H = 64),
  ``scale = max|x| / 7``, codes in [-7, 7] stored as ``code + 8`` two per byte (uint8: the
  even channel in the low nibble, the odd one in the high nibble); KIVI-style grouping
  along each token's channels (Liu et al. 2024 group keys per channel and values per
  token; both are per token here).

Scales are float32 (4 bytes per row or group), chosen for exactness of the round trip:
int8 on H = 64 stores 64 + 4 bytes per row, float32 256. A scale is never below
:data:`MIN_SCALE` = 2^-126, float32's smallest normal number: ``scale = max(max|x| / qmax,
MIN_SCALE)``, because XLA:CPU flushes subnormal float32 to zero, and a subnormal scale
became 0 there (an fp8 row with max|x| = 1e-37 dequantized to NaN, an int8 one to zeros).
Rows with max|x| below qmax · 2^-126 (1.5e-36 for int8) thus get fewer distinct codes, by
the bound below. An all-zero row gets scale 1 (codes 0, round trip exact).
Dequantization returns ``codes · scale`` in the model dtype; attention reads only that
(:func:`kvjax.cache.read`).

Error bounds of one round trip (float32 arithmetic; ``s`` the row's or group's scale as
just defined, clamp included), used by the tests: int8 and int4 ``|x - x̂| <= s / 2``; fp8
``|x - x̂| <= max(2^-m·|x|, s·2^(e_min - m - 1))`` with m mantissa bits (e4m3fn: 3, e5m2:
2) and e_min the smallest normal exponent (-6, -14). Every finite row round-trips finite.
On a backend that flushes subnormals (XLA:CPU), an input entry below 2^-126 in magnitude
is read as 0 before quantization: add 2^-126 to its bound.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import backend as backend_lib

SCALE_DTYPE = jnp.float32
SCALE_SUFFIX = "_scale"
INT4_GROUP = 32  # values per int4 scale group (at most; gcd with the row width)
MIN_SCALE = float(np.finfo(np.float32).tiny)
"""The smallest scale (2^-126, float32's smallest normal: XLA:CPU flushes smaller ones)."""


@dataclasses.dataclass(frozen=True)
class Format:
    """One quantized kv_dtype: storage type, code range and grouping.

    Attributes:
      name: the kv_dtype ('int8', 'int4', 'float8_e4m3fn', 'float8_e5m2').
      storage: dtype of the stored codes (int4: uint8, two codes per byte).
      kind: 'int' (rounded integer codes) or 'float' (fp8 codes).
      qmax: largest code magnitude (127, 7, or the fp8 type's finite max).
      bits: bits per value (8 or 4).
    """

    name: str
    storage: object
    kind: str
    qmax: float
    bits: int

    def group(self, width: int) -> int:
        """Values per scale along a row of ``width`` values."""
        return math.gcd(width, INT4_GROUP) if self.bits == 4 else width

    def code_width(self, width: int) -> int:
        """Stored code elements per row of ``width`` values."""
        return width * self.bits // 8

    def scale_width(self, width: int) -> int:
        """Scales per row of ``width`` values."""
        return width // self.group(width)

FORMATS = {
    "int8": Format("int8", jnp.int8, "int", 127.0, 8),
    "int4": Format("int4", jnp.uint8, "int", 7.0, 4),
    "float8_e4m3fn": Format("float8_e4m3fn", jnp.float8_e4m3fn, "float",
                            float(jnp.finfo(jnp.float8_e4m3fn).max), 8),
    "float8_e5m2": Format("float8_e5m2", jnp.float8_e5m2, "float",
                          float(jnp.finfo(jnp.float8_e5m2).max), 8),
}


def format_for(cfg) -> Format | None:
    """The quantized format of ``cfg.kv_dtype``, or None for a float cache."""
    return FORMATS.get(cfg.kv_dtype) if cfg.kv_dtype else None


def scale_name(name: str) -> str:
    """'k' -> 'k_scale': the scale tensor of cached tensor ``name``."""
    return name + SCALE_SUFFIX


def base_name(name: str) -> str:
    """'k_scale' -> 'k'; other names unchanged."""
    return name[:-len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name


@functools.lru_cache(maxsize=None)
def _converts_on(backend: str, dtype_name: str) -> bool:
    """Whether ``backend`` compiles and runs a float32 <-> ``dtype_name`` round trip."""
    try:
        dt = FORMATS[dtype_name].storage
        dev = jax.devices(backend)[0]
        # concrete even when first asked while tracing (encode runs at trace time)
        with jax.ensure_compile_time_eval():
            x = jax.device_put(np.array([1.5, -3.0], np.float32), dev)
            y = jax.jit(lambda a: a.astype(dt).astype(jnp.float32))(x)
            return bool(np.allclose(np.asarray(y), [1.5, -3.0]))
    except Exception:  # noqa: BLE001 (any failure means: not available here)
        return False


def check_supported(cfg) -> None:
    """Raises ValueError when ``cfg.kv_dtype`` is an fp8 type that the config's backend
    cannot convert (probed once per backend and type, when the backend is the process's;
    a config for another backend is only costed, not run, and is not probed)."""
    fmt = format_for(cfg)
    if fmt is None or fmt.kind != "float" or cfg.backend != backend_lib.current():
        return
    if not _converts_on(cfg.backend, fmt.name):
        ok = [n for n in FORMATS if FORMATS[n].kind == "int"]
        raise ValueError(
            f"kv_dtype={fmt.name!r} is not supported on backend {cfg.backend!r} (a float32 "
            f"<-> {fmt.name} convert failed there); allowed here: float32, bfloat16, "
            f"float16 or {ok}")


def _pack4(q: jax.Array) -> jax.Array:
    """[..., X] uint8 nibbles (0..15) -> [..., X/2] uint8, channel 2i low, 2i+1 high."""
    q = q.reshape(q.shape[:-1] + (q.shape[-1] // 2, 2))
    return q[..., 0] | (q[..., 1] << 4)


def _unpack4(p: jax.Array) -> jax.Array:
    """Inverse of :func:`_pack4`: [..., X/2] uint8 -> [..., X] uint8 nibbles."""
    q = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return q.reshape(p.shape[:-1] + (p.shape[-1] * 2,))


def quantize(x: jax.Array, fmt: Format, axis: int = -1):
    """Quantizes rows of ``x`` along its channel ``axis`` (-1 or -2).

    Args:
      x: float array, e.g. [B, K, T, H] keys (axis -1) or [B, K, H, T] (axis -2).
      fmt: the format (:data:`FORMATS`).
      axis: the channel axis (the H, C or R values of one token).
    Returns:
      (codes, scale): codes in ``fmt.storage`` with the channel axis X replaced by
      ``fmt.code_width(X)``; scale float32 with it replaced by ``fmt.scale_width(X)``,
      each ``max(max|x| / fmt.qmax, MIN_SCALE)`` over its row or group (1 for all zeros).
    Raises:
      ValueError: an int4 row of odd width.
    """
    width = x.shape[axis]
    if fmt.bits == 4 and width % 2:
        raise ValueError(f"int4 needs an even row width; got {width} along axis {axis}; "
                         "allowed: an even head_dim (or MLA widths)")
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    g = fmt.group(width)
    xg = xm.reshape(xm.shape[:-1] + (width // g, g))
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    # amax / qmax may be subnormal (flushed to 0 on XLA:CPU): the clamp keeps it normal.
    scale = jnp.where(amax > 0, jnp.maximum(amax / fmt.qmax, MIN_SCALE), 1.0)
    scale = scale.astype(SCALE_DTYPE)
    y = xg / scale
    if fmt.kind == "float":
        codes = jnp.clip(y, -fmt.qmax, fmt.qmax).astype(fmt.storage)
    else:
        codes = jnp.clip(jnp.round(y), -fmt.qmax, fmt.qmax)
        codes = (codes + 8).astype(jnp.uint8) if fmt.bits == 4 else codes.astype(fmt.storage)
    codes = codes.reshape(xm.shape)
    if fmt.bits == 4:
        codes = _pack4(codes)
    return jnp.moveaxis(codes, -1, axis), jnp.moveaxis(scale[..., 0], -1, axis)


def dequantize(codes: jax.Array, scale: jax.Array, fmt: Format, axis: int = -1,
               dtype=jnp.float32) -> jax.Array:
    """``codes · scale`` in ``dtype``: the inverse of :func:`quantize` up to its rounding.

    Args:
      codes: as :func:`quantize` returns them; scale: float32, likewise.
      axis: the channel axis (-1 or -2).
    Returns:
      the values, the channel axis of full width X again.
    """
    cm = jnp.moveaxis(codes, axis, -1)
    sm = jnp.moveaxis(scale, axis, -1)
    if fmt.bits == 4:
        cm = _unpack4(cm).astype(jnp.float32) - 8.0
    else:
        cm = cm.astype(jnp.float32)
    width = cm.shape[-1]
    ng = sm.shape[-1]
    if ng == 1:
        x = cm * sm
    else:
        x = (cm.reshape(cm.shape[:-1] + (ng, width // ng)) * sm[..., None]).reshape(cm.shape)
    return jnp.moveaxis(x.astype(dtype), -1, axis)
