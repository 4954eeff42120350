"""Accelerator figures for the roofline, and a bandwidth probe for the local device.

The blog ("The GPU Memory Hierarchy", "The Roofline Model") reasons with the NVIDIA A100:
312e12 FLOP/s fp16 tensor-core peak, ~2e12 B/s HBM, 40-80 GB HBM, ~20 MB on-chip SRAM,
ridge point 312e12 / 2e12 = 156 FLOP/byte. :data:`CHIPS` holds those figures and the
Hopper parts; :func:`measure_read_bandwidth` and :func:`local_chip` give the same
quantities for whatever device JAX runs on here (a shared CPU's bandwidth moves with
what else the host runs: docs/decisions/0028-bandwidth-probed-per-run.md).

Units: FLOP/s, bytes/s, bytes. Peaks are dense (no 2:4 sparsity), keyed by dtype name
('float16', 'bfloat16', 'float32').
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from kvjax import native
from kvjax.native import rows_matmul as rm


def dtype_name(dtype: Any) -> str:
    """Canonical name of a dtype given as a name or a dtype-like ('bfloat16', jnp.float16, ...)."""
    if isinstance(dtype, str):
        return np.dtype(jnp.dtype(dtype)).name
    return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator's roofline figures.

    Attributes:
      name: label, e.g. 'A100-80GB'.
      peak_flops_per_s: dtype name -> peak dense FLOP/s; a dtype missing here has an unknown
        peak (e.g. a CPU whose matmul rate was not measured).
      hbm_bytes_per_s: main-memory (HBM, or DRAM for a CPU) bandwidth in bytes/s.
      hbm_capacity_bytes: main-memory capacity in bytes.
      sram_bytes: on-chip SRAM (shared memory/L1 over all SMs) in bytes; None if unknown.
      source: where the figures come from (datasheet, or 'measured').
      read_kernel: for a measured device, the fastest kernel of its bandwidth probe (a
        :class:`ReadProbe` kernel name); None for published figures.
    """

    name: str
    peak_flops_per_s: Mapping[str, float]
    hbm_bytes_per_s: float
    hbm_capacity_bytes: float
    sram_bytes: float | None = None
    source: str = ""
    read_kernel: str | None = None

    def peak_flops(self, dtype: Any = "float16") -> float | None:
        """Peak FLOP/s for ``dtype``, or None when unknown."""
        return self.peak_flops_per_s.get(dtype_name(dtype))

    def ridge_point(self, dtype: Any = "float16") -> float | None:
        """Roofline ridge point in FLOP/byte: peak FLOP/s / bandwidth bytes/s.

        Blog, "The Roofline Model": A100 312e12 / 2e12 = 156 FLOP/byte. None when the
        peak for ``dtype`` is unknown.
        """
        peak = self.peak_flops(dtype)
        return None if peak is None else peak / self.hbm_bytes_per_s


def _half(peak: float, fp32: float) -> dict[str, float]:
    return {"float16": peak, "bfloat16": peak, "float32": fp32}


# A100: NVIDIA A100 Tensor Core GPU datasheet (2021): FP16/BF16 tensor core 312 TFLOPS dense
# (624 with sparsity), FP32 19.5 TFLOPS (non-tensor; TF32 tensor core 156 TFLOPS).
# Bandwidth: the datasheet lists 1,555 GB/s (40GB) and 1,935 GB/s (80GB PCIe) /
# 2,039 GB/s (80GB SXM); both entries here use the blog's round 2e12 B/s so that the
# blog's ridge point (156 FLOP/byte) and latencies are reproduced exactly.
# SRAM: the blog's ~20 MB (108 SMs x 192 KB combined L1/shared = 21.2 MB).
A100_40GB = Chip(
    name="A100-40GB",
    peak_flops_per_s=_half(312e12, 19.5e12),
    hbm_bytes_per_s=2e12,
    hbm_capacity_bytes=40e9,
    sram_bytes=20e6,
    source="NVIDIA A100 datasheet (peaks, capacity); blog's 2 TB/s and ~20 MB SRAM",
)
A100_80GB = dataclasses.replace(
    A100_40GB, name="A100-80GB", hbm_capacity_bytes=80e9,
)

# H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: BF16/FP16 tensor core 1,979 TFLOPS
# with sparsity = 989 TFLOPS dense; FP32 67 TFLOPS; HBM3 80 GB at 3.35 TB/s.
# SRAM: 132 SMs x 256 KB combined L1/shared (NVIDIA Hopper architecture whitepaper).
H100_SXM = Chip(
    name="H100-SXM",
    peak_flops_per_s=_half(989e12, 67e12),
    hbm_bytes_per_s=3.35e12,
    hbm_capacity_bytes=80e9,
    sram_bytes=132 * 256 * 1024,
    source="NVIDIA H100 datasheet (SXM5); Hopper whitepaper for SRAM",
)

# H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: same GH100 compute as H100 SXM
# (BF16/FP16 989 TFLOPS dense, FP32 67 TFLOPS), HBM3e 141 GB at 4.8 TB/s.
H200 = Chip(
    name="H200",
    peak_flops_per_s=_half(989e12, 67e12),
    hbm_bytes_per_s=4.8e12,
    hbm_capacity_bytes=141e9,
    sram_bytes=132 * 256 * 1024,
    source="NVIDIA H200 datasheet (SXM); Hopper whitepaper for SRAM",
)

CHIPS: dict[str, Chip] = {c.name: c for c in (A100_40GB, A100_80GB, H100_SXM, H200)}

# Other spellings of the same parts (matched case-insensitively, ignoring spaces, '-' and
# '_'): the memory size, the form factor, the marketing name.
CHIP_ALIASES: dict[str, str] = {
    "A100": "A100-80GB", "A100-80G": "A100-80GB", "A100-SXM": "A100-80GB",
    "A100-SXM4-80GB": "A100-80GB", "A100-40G": "A100-40GB", "A100-SXM4-40GB": "A100-40GB",
    "H100": "H100-SXM", "H100-80GB": "H100-SXM", "H100-80G": "H100-SXM",
    "H100-SXM5": "H100-SXM", "H100-SXM-80GB": "H100-SXM",
    "H200-141GB": "H200", "H200-SXM": "H200", "H200-141G": "H200",
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def chip(name: str) -> Chip:
    """The :data:`CHIPS` entry for ``name`` or one of its :data:`CHIP_ALIASES`
    ('H100', 'H100-80GB', 'h100 sxm5', 'A100', 'H200-141GB', ...).

    Raises:
      ValueError: an unknown name; the message lists the chips and the closest aliases.
        (The H100 PCIe, 2.0 TB/s, is a different part and is not in the table.)
    """
    table = {_key(n): c for n, c in CHIPS.items()}
    table.update({_key(a): CHIPS[n] for a, n in CHIP_ALIASES.items()})
    found = table.get(_key(name))
    if found is not None:
        return found
    import difflib  # noqa: PLC0415
    names = list(CHIPS) + list(CHIP_ALIASES)
    near = difflib.get_close_matches(name.upper(), names, n=3, cutoff=0.5)
    raise ValueError(f"chip {name!r}: unknown; allowed: {sorted(CHIPS)} or an alias such as "
                     f"{', '.join(near or ['H100-80GB', 'A100', 'H200-141GB'])}")


def cpu_model() -> str | None:
    """The host CPU's model name from /proc/cpuinfo ('AMD EPYC 7R13 Processor'), or
    None where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split()) or None
    except OSError:
        return None
    return None


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of the host CPU's highest-level data or unified cache, from Linux's sysfs
    (``root``/index*/level, type and size, e.g. '266240K'); 0 where none can be read. A
    working set meant to come from memory must be well past it (the Intel Xeon model 207
    lists 260 MiB of L3, the AMD EPYC 32 MiB). Not ``os.sysconf``: Python's table of
    names lacks the C library's cache sizes."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}

    def read(index: str, name: str) -> str:
        with open(os.path.join(index, name), encoding="utf-8") as f:
            return f.read().strip()
    best = (0, 0)  # (level, bytes)
    for index in sorted(glob.glob(os.path.join(root, "index*"))):
        try:
            if read(index, "type") == "Instruction":
                continue
            size = read(index, "size")
            nbytes = (int(size[:-1]) * units[size[-1].upper()] if size[-1:].isalpha()
                      else int(size))
            best = max(best, (int(read(index, "level")), nbytes))
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return best[1]


def cache_reads_note(nbytes: int, flag: str) -> str:
    """'' where ``nbytes`` of a working set meant to come from memory are at least twice
    :func:`last_level_cache_bytes`, else a note for a figure's line naming both sizes and
    the ``flag`` that raises it (' (caches 256 MiB in all, under twice this CPU's 260 MiB
    last-level cache: partly cache reads; raise --layers)')."""
    llc = last_level_cache_bytes()
    if nbytes >= 2 * llc:
        return ""
    return (f" (caches {nbytes / 2**20:.0f} MiB in all, under twice this CPU's "
            f"{llc / 2**20:.0f} MiB last-level cache: partly cache reads; raise {flag})")


def vector_isa(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host CPU's vector instruction sets that the kernels and XLA:CPU use, widest
    first, from the flags line of ``cpuinfo``: e.g. 'AVX-512 (F, BW, VL, VNNI, BF16),
    AVX2, FMA', 'AVX2, FMA', 'NEON' (aarch64 'asimd'), or '' where it cannot be read."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            flags = next((set(ln.split(":", 1)[1].split()) for ln in f
                          if ln.lower().startswith(("flags", "features"))), set())
    except OSError:
        return ""
    parts = []
    ext = [x for x in ("f", "bw", "vl", "vnni", "bf16")
           if f"avx512{x}" in flags or f"avx512_{x}" in flags]
    if "avx512f" in flags:
        parts.append(f"AVX-512 ({', '.join(e.upper() for e in ext)})")
    parts += [name for flag, name in (("avx2", "AVX2"), ("fma", "FMA"), ("asimd", "NEON"),
                                      ("sve", "SVE")) if flag in flags]
    if not parts and "avx" in flags:
        parts.append("AVX")
    return ", ".join(parts)


def device_name(device: Any = None) -> str:
    """A readable name of a JAX device for tables and plot titles: 'NVIDIA H200' for an
    accelerator (its device_kind), 'CPU: AMD EPYC (2 cores; AVX-512 (F, BW, VL, VNNI,
    BF16), AVX2, FMA)' for the host CPU (the model name of /proc/cpuinfo, the cores this
    process may use and :func:`vector_isa`)."""
    device = jax.devices()[0] if device is None else device
    if device.platform != "cpu":
        return getattr(device, "device_kind", device.platform)
    cores = native.usable_cores()
    isa = vector_isa()
    return f"CPU: {cpu_model() or 'unknown model'} ({cores} cores{'; ' + isa if isa else ''})"


@dataclasses.dataclass(frozen=True)
class BandwidthProbe:
    """Result of :func:`measure_read_bandwidth`.

    Attributes:
      bytes_per_s: the fastest kernel's median read bandwidth, bytes/s.
      samples: that kernel's every repeat, bytes/s, in run order.
      num_bytes: bytes read per repeat.
      device: description of the JAX device measured.
      kernels: kernel name -> its median bandwidth, bytes/s.
    """

    bytes_per_s: float
    samples: tuple[float, ...]
    num_bytes: int
    device: str
    kernels: Mapping[str, float] = dataclasses.field(default_factory=dict)


def _describe(device: Any) -> str:
    return device_name(device)


def _median_seconds(fn, arg, repeats: int) -> list[float]:
    fn(arg).block_until_ready()  # compile
    fn(arg).block_until_ready()  # warm caches / allocator
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg).block_until_ready()
        out.append(time.perf_counter() - t0)
    return out


READ_KERNELS = ("sum", "row_sum", "vecmat")


def _read_kernel(name: str, n: int):
    """(jitted fn, its argument shape): each reads an n-element array once."""
    if name == "sum":  # one scalar out
        return jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), (n,)
    if name == "row_sum":  # [n/64, 64] -> [n/64]: a row reduction
        return jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), (n // 64, 64)
    if name == "vecmat":  # [64] x [64, n/64]: a vector-matrix product (decode's q·K^T)
        return jax.jit(lambda a: jnp.ones((64,), a.dtype) @ a), (64, n // 64)
    raise ValueError(f"read kernel {name!r}; allowed: one of {list(READ_KERNELS)}")


def measure_read_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 7,
                           dtype: Any = jnp.float32,
                           kernels: tuple[str, ...] = READ_KERNELS) -> BandwidthProbe:
    """Sustained main-memory read bandwidth of the default device, bytes/s.

    Each kernel is a jitted streaming read of one ``num_bytes`` array that writes almost
    nothing: ``jnp.sum`` (a scalar), a row sum ([n/64, 64] -> [n/64]) and a vector-matrix
    product ([64] x [64, n/64], the shape of decode's q·K^T). XLA:CPU lowers these to
    different loops, which reach different bandwidths (each varying run to run on a shared
    host; docs/decisions/0028-bandwidth-probed-per-run.md), so the roofline is the fastest
    kernel's median: the best sustained read JAX achieved here. The array must be much
    larger than the caches (the 256 MiB default is). Two warm-up runs precede ``repeats``
    timed ones per kernel.

    Raises:
      ValueError: repeats < 1, num_bytes too small for the kernels, or an unknown kernel.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats}; allowed: an integer >= 1")
    if not kernels:
        raise ValueError(f"kernels={kernels!r}; allowed: a non-empty subset of {READ_KERNELS}")
    medians, all_samples = {}, {}
    for name in kernels:
        probe = ReadProbe(name, num_bytes, dtype)  # compiled and run once
        probe.once()  # second warm-up: caches / allocator
        all_samples[name] = tuple(probe.once() for _ in range(repeats))
        medians[name] = float(statistics.median(all_samples[name]))
        del probe  # frees its buffer before the next kernel's
    best = max(medians, key=medians.get)
    return BandwidthProbe(bytes_per_s=medians[best], samples=all_samples[best],
                          num_bytes=ReadProbe.bytes_read(num_bytes, dtype),
                          device=_describe(jax.devices()[0]), kernels=medians)


class ReadProbe:
    """One streaming-read kernel kept compiled with its buffer, for probes interleaved with
    other work: on a shared host the bandwidth drifts within seconds, so a benchmark
    pairs every timed step with a read timed just before it (``experiments/bench.py``).

    Args:
      kernel: one of :data:`READ_KERNELS` (see :func:`measure_read_bandwidth`).
      num_bytes: bytes read per call (keep it well above the last-level cache).
    Raises:
      ValueError: an unknown kernel or num_bytes too small.
    """

    def __init__(self, kernel: str = "vecmat", num_bytes: int = 256 * 2**20,
                 dtype: Any = jnp.float32):
        self.kernel, self.num_bytes = kernel, self.bytes_read(num_bytes, dtype)
        self._fn, shape = _read_kernel(kernel, self.num_bytes // jnp.dtype(dtype).itemsize)
        self._x = jax.device_put(jnp.ones(shape, dtype), jax.devices()[0])
        self._fn(self._x).block_until_ready()  # compile and warm

    @staticmethod
    def bytes_read(num_bytes: int, dtype: Any = jnp.float32) -> int:
        """``num_bytes`` rounded down to whole rows of 64 elements (what a probe reads).

        Raises:
          ValueError: fewer than 64 elements.
        """
        itemsize = jnp.dtype(dtype).itemsize
        n = (num_bytes // itemsize) // 64 * 64
        if n < 64:
            raise ValueError(f"num_bytes={num_bytes}; allowed: at least {64 * itemsize}")
        return n * itemsize

    def once(self) -> float:
        """Bytes/s of one timed read of the buffer."""
        start = time.perf_counter()
        self._fn(self._x).block_until_ready()
        return self.num_bytes / (time.perf_counter() - start)


def measure_matmul_flops(n: int = 1024, repeats: int = 5, dtype: Any = jnp.float32) -> float:
    """Median achieved FLOP/s of a jitted n x n x n matmul (2·n³ FLOP) on the default device."""
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    seconds = _median_seconds(mm, a, repeats)
    return float(2 * n**3 / statistics.median(seconds))


def measure_fma_flops(repeats: int = 5) -> float | None:
    """Median FLOP/s of the native few-row kernel (:mod:`kvjax.native.rows_matmul`) on a
    weight that stays in the cores' L2 caches: 48 rows x [512, 512] float32 (1 MiB,
    split over the cores), 32 products per call (2·48·512·512 FLOP each), so memory
    is out of the picture: the fused multiply-add rate this CPU sustains in a register
    tiled loop (48 rows in tiles of 6), the compute ceiling of the roofline (Williams
    et al. 2009) for the products of a decode step. On a shared host either this or
    XLA's 1024^3 matmul (:func:`measure_matmul_flops`) may read faster, depending on the
    load from other jobs (docs/decisions/0027-serial-roofline.md): :func:`local_chip`
    takes the faster.

    Returns None where the native kernel is unavailable (no compiler, not a CPU)."""
    if jax.devices()[0].platform != "cpu" or not rm.load():
        return None
    m, k, n, reps = 48, 512, 512, 32
    x = jnp.ones((m, k), jnp.float32)
    w = jnp.full((k, n), 1e-3, jnp.float32)

    @jax.jit
    def run(x):
        def body(acc, _):
            return acc + rm.rows_matmul(x + acc[:, :1], w), None
        return jax.lax.scan(body, jnp.zeros((m, n), jnp.float32), None, length=reps)[0]
    seconds = _median_seconds(run, x, repeats)
    return float(2 * m * k * n * reps / statistics.median(seconds))


def match_chip(device_kind: str) -> Chip | None:
    """The :data:`CHIPS` entry for a JAX ``device_kind`` string (e.g. 'NVIDIA H200'), or None."""
    kind = device_kind.upper()
    if "H200" in kind:
        return H200
    if "H100" in kind and "PCIE" not in kind:
        return H100_SXM
    if "A100" in kind:
        return A100_40GB if "40GB" in kind.replace(" ", "").replace("-", "") else A100_80GB
    return None


def _host_memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return float("nan")


def local_chip(measure_flops: bool = False) -> Chip:
    """A :class:`Chip` for JAX's default device.

    A GPU found in :data:`CHIPS` returns its published figures (docs/DESIGN.md: GPUs are compared
    with the published roofline). Anything else (the CPU here) gets the bandwidth measured
    by :func:`measure_read_bandwidth`; its float32 peak is measured when
    ``measure_flops`` is set (the faster of :func:`measure_matmul_flops` and
    :func:`measure_fma_flops`), else left unknown.
    """
    device = jax.devices()[0]
    known = match_chip(getattr(device, "device_kind", "")) if device.platform == "gpu" else None
    if known is not None:
        return known
    probe = measure_read_bandwidth()
    peaks, how = {}, ""
    if measure_flops:  # the faster of XLA's matmul and the native FMA loop
        xla_rate, fma_rate = measure_matmul_flops(), measure_fma_flops()
        peaks = {"float32": max(xla_rate, fma_rate or 0.0)}
        how = (", float32 peak: native FMA loop" if (fma_rate or 0.0) > xla_rate
               else ", float32 peak: XLA matmul")
    capacity = None
    try:
        stats = device.memory_stats() or {}
        capacity = stats.get("bytes_limit")
    except Exception:  # memory_stats is unimplemented on some backends (CPU)
        capacity = None
    return Chip(
        name=probe.device,
        peak_flops_per_s=peaks,
        hbm_bytes_per_s=probe.bytes_per_s,
        hbm_capacity_bytes=float(capacity) if capacity else _host_memory_bytes(),
        sram_bytes=None,
        source=("measured (fastest of sum / row sum / vector-matrix reads" + how + ")"),
        read_kernel=max(probe.kernels, key=probe.kernels.get),
    )
