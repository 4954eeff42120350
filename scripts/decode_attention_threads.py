"""Which threads run the native decode attention's parts, and when: a traced build.

Builds ``kvjax/native/decode_attention.cc`` with ``-DKVJAX_TRACE_PARTS`` (the kernel then
records, for each part of each call, whether the caller or a task of XLA's intra-op pool
ran it, and when it began and ended; :func:`kvjax.native.build_library`, cached per
source), registers it under a target of its own, and times one layer's partial decode
attention (:func:`kvjax.models.decode_kernels.partial_attention`, 'native') of the blog
model's and SmolLM2's shapes at S slots, each call paired with a streaming read of 256 MiB
(:class:`kvjax.analysis.hardware.ReadProbe`) just before it. Caches are rotated over
copies of at least 96 MiB and twice the last-level cache in all (decode_attention_ab.py),
so every call reads from memory. Prints, per shape:
the calls in which a pool task ran a part (the others ran every part on the caller), how
late the pool's part began after the parts were scheduled (median over the calls it ran
in), the median time from scheduling to the last part's end and its GB/s of cache read,
the median whole call and its share of the median read, and the load average.

    PYTHONPATH=. python scripts/decode_attention_threads.py --slots 32768 --rounds 15
"""

import ctypes
import os
import statistics
import threading
import time

import jax
import numpy as np
from decode_attention_ab import compiled, parse_flags, shapes  # scripts/, run as a script

from kvjax import native
from kvjax.analysis import hardware

TARGET = "kvjax_decode_attention_traced"


def traced_library() -> ctypes.CDLL:
    """Builds and registers the traced kernel under :data:`TARGET`; returns the library.

    Raises:
      SystemExit: the build failed or the library could not be loaded.
    """
    path = native.build_library(native._SOURCE, TARGET,  # noqa: SLF001 (its own source)
                                flags=("-DKVJAX_TRACE_PARTS",))
    ok = path is not None and native.register(
        {}, threading.Lock(), lambda: path, TARGET, "KvjaxDecodeAttention",
        "the traced kernel", "exiting")
    if not ok:
        raise SystemExit("error: the traced kernel could not be built or loaded")
    lib = ctypes.CDLL(str(path))
    lib.KvjaxTraceTake.restype = ctypes.c_int64
    lib.KvjaxTraceTake.argtypes = (ctypes.POINTER(ctypes.c_double), ctypes.c_int64)
    return lib


def take(lib: ctypes.CDLL) -> np.ndarray:
    """The records since the last take: [n, 5] (part, parts, pooled, start s, end s)."""
    out = np.zeros((4096, 5))
    n = lib.KvjaxTraceTake(out.ctypes.data_as(ctypes.POINTER(ctypes.c_double)), 4096)
    return out[:n]


def main() -> None:
    a = parse_flags(__doc__, 15, baseline=False)
    if not native.load():
        raise SystemExit("error: the native kernel could not be built")
    lib = traced_library()
    probe = hardware.ReadProbe("vecmat")
    rng = np.random.default_rng(0)
    print(f"S={a.slots}; threads {native.num_threads()}; load average {os.getloadavg()}",
          flush=True)
    for name, k, g, (q, caches, vis, vl, nbytes) in shapes(a.models, a.slots, rng):
        copies = len(caches)
        fn = compiled(TARGET, vl, q, caches, vis)
        take(lib)
        walls, reads, spans, late, pooled = [], [], [], [], 0
        for r in range(a.rounds):
            reads.append(probe.once())
            kc, vc = caches[r % copies]
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, kc, vc, vis))
            walls.append(time.perf_counter() - t0)
            rows = take(lib)
            spans.append(rows[:, 4].max())
            if rows[:, 2].any():
                pooled += 1
                late.append(rows[rows[:, 2] == 1, 3].min())
        roof = statistics.median(reads)
        wall, span = statistics.median(walls), statistics.median(spans)
        lates = f"{statistics.median(late) * 1e3:.2f} ms" if late else "-"
        print(f"{name} K={k} G={g}: {int(rows[0, 1])} parts; a pool task ran a part in "
              f"{pooled}/{a.rounds} calls, starting {lates} after scheduling; parts "
              f"done {span * 1e3:.2f} ms ({nbytes / span / 1e9:.1f} GB/s); call "
              f"{wall * 1e3:.2f} ms ({nbytes / wall / roof:.0%} of the read's "
              f"{roof / 1e9:.1f} GB/s); load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
