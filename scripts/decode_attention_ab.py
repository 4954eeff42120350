"""The native decode attention of an older commit against the working tree's, interleaved.

Builds ``kvjax/native/decode_attention.cc`` (with the headers it includes) as it stood at
``--baseline`` into a library of its own (:func:`kvjax.native.build_library`, cached per
source), registers it under a target name of its own, and times one layer's partial
decode attention (:func:`kvjax.models.decode_kernels.partial_attention`, 'native') of the
blog model's and SmolLM2's shapes at S slots with either library, in alternating rounds,
each round paired with a streaming read of 256 MiB (:class:`kvjax.analysis.hardware.ReadProbe`).
Caches are rotated over copies of at least 96 MiB and twice the last-level cache in
all, so every call reads from memory. Prints, per shape, the median GB/s of cache read
of each kernel, its share of the median read, the ratio of the medians (new over old)
and the median of the rounds' paired ratios (old's time over new's, adjacent calls),
with the load average. ``--blocks`` times the 'native_blocks' call of both kernels
instead (grouped shapes only; the baseline's source must bind the ``blocks``
attribute). ``--layers=L`` times, for either kernel, one program of L calls in turn over
L distinct caches, the same L every round (each layer's query depends on the last one's
output), as a decode step runs them: its dispatch paid once. Pick L so the L caches
together are at least twice the last-level cache (a line says where they are not; the
Intel Xeon model 207 lists 260 MiB: 33 layers of a K = 1 cache at S = 32K are 528 MiB).

    PYTHONPATH=. python scripts/decode_attention_ab.py --baseline 8b4947c --slots 32768
    PYTHONPATH=. python scripts/decode_attention_ab.py --baseline 8f224a8 --blocks --layers 33
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import native
from kvjax.analysis import hardware
from kvjax.models import decode_kernels

_HEADERS = ("decode_attention.cc", "pool.h", "fast_math.h")
# query heads N and the KV heads K of each variant (MHA, GQA, MQA) of the models timed
HEADS = {"blog": (8, (8, 2, 1)), "smollm2": (9, (9, 3, 1))}


def parse_flags(doc: str, rounds: int, baseline: bool) -> argparse.Namespace:
    """--slots, --rounds (default ``rounds``), --models and, with ``baseline``,
    --baseline, --blocks and --layers.

    Raises:
      SystemExit: a bad value, named with what is allowed, before any work.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if baseline:
        ap.add_argument("--baseline", default="8b4947c", help="commit of the old kernel")
    ap.add_argument("--slots", type=int, default=32768)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--models", default="blog,smollm2")
    if baseline:
        ap.add_argument("--blocks", action="store_true",
                        help="time the 'native_blocks' call (grouped shapes) of both kernels")
        ap.add_argument("--layers", type=int, default=0,
                        help="time one program of this many calls over distinct caches")
    a = ap.parse_args()
    a.models = a.models.split(",")
    for flag, ok, allowed in (
            ("--slots", a.slots >= 16, "an integer >= 16"),
            ("--rounds", a.rounds >= 1, "an integer >= 1"),
            ("--layers", getattr(a, "layers", 0) >= 0, "an integer >= 0 (0: one call)"),
            ("--models", bool(a.models) and set(a.models) <= set(HEADS),
             f"a comma-separated subset of {', '.join(HEADS)}")):
        if not ok:
            value = ",".join(a.models) if flag == "--models" else getattr(a, flag[2:])
            raise SystemExit(f"error: {flag}={value}; allowed: {allowed}")
    return a


def problem(rng: np.random.Generator, k: int, g: int, slots: int, copies: int = 0):
    """One layer's decode attention at the CPU layouts (keys 'BKHS'; values 'BKSH' for
    G > 1, else 'BKHS'; decode_attention_bench), B = 1, H = V = 64, every slot visible:
    (q [1, K, G, H], [(keys, values)] ``copies`` copies (0: enough for 96 MiB and twice
    the last-level cache in all), visible [1, S], the values' layout, bytes of cache read
    per call), all float32."""
    h = 64
    vl = "BKHS" if g == 1 else "BKSH"
    nbytes = 2 * k * slots * h * 4
    total = max(96 * 2**20, 2 * hardware.last_level_cache_bytes())
    copies = copies or -(-total // nbytes)
    q = jnp.asarray(rng.standard_normal((1, k, g, h)), jnp.float32)
    caches = [(jnp.asarray(rng.standard_normal((1, k, h, slots)), jnp.float32),
               jnp.asarray(rng.standard_normal((1, k, slots, h) if vl == "BKSH"
                                               else (1, k, h, slots)), jnp.float32))
              for _ in range(copies)]
    return q, caches, jnp.ones((1, slots), bool), vl, nbytes


def shapes(models: list[str], slots: int, rng: np.random.Generator, copies: int = 0,
           grouped: bool = False):
    """(model, K, G, :func:`problem`) for each variant of each model (``grouped``: those
    with G > 1), in turn."""
    for name in models:
        n, ks = HEADS[name]
        for k in ks:
            if n // k > 1 or not grouped:
                yield name, k, n // k, problem(rng, k, n // k, slots, copies)


def _jit_on(target: str, f, *args):
    """``f`` jitted with the kernel registered as ``target`` (native.TARGET is read when
    the call is traced), called once on ``args``."""
    old, native.TARGET = native.TARGET, target
    fn = jax.jit(f)
    jax.block_until_ready(fn(*args))
    native.TARGET = old
    return fn


def compiled(target: str, vl: str, q, caches, vis, blocks: bool | None = False):
    """The 'native' call of the kernel registered as ``target``, jitted and called once;
    ``blocks=None`` for a kernel built before its ``blocks`` attribute."""
    return _jit_on(target, lambda q, kc, vc, v: decode_kernels._native(
        q, kc, vc, v, "BKHS", vl, q.shape[-1] ** -0.5, blocks=blocks), q, *caches[0], vis)


def compiled_layers(target: str, vl: str, q, caches, vis, blocks: bool | None = False):
    """As :func:`compiled`, one program of a call per cache of ``caches`` in turn (the
    next call's query depends on the last one's output); called as fn(q, caches, vis)."""
    def run(q, caches, vis):
        out = q
        for kc, vc in caches:
            o, _, _ = decode_kernels._native(out, kc, vc, vis, "BKHS", vl,
                                             q.shape[-1] ** -0.5, blocks=blocks)
            out = q + 1e-3 * o
        return out
    return _jit_on(target, run, q, caches, vis)


def baseline_source(rev: str, blocks: bool = False) -> tuple[pathlib.Path, bool]:
    """``rev``'s decode_attention.cc and the headers it includes, written to a new
    folder; returns it and whether that source binds the ``blocks`` attribute.

    Raises:
      SystemExit: ``rev`` is not a commit holding the source, or ``blocks`` and its
        source binds no ``blocks`` attribute (before anything is built).
    """
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvjax-ab-"))
    for name in _HEADERS:
        r = subprocess.run(["git", "show", f"{rev}:kvjax/native/{name}"], capture_output=True,
                           text=True)
        if r.returncode:
            raise SystemExit(f"error: --baseline={rev}: no kvjax/native/{name} there "
                             f"({r.stderr.strip()})")
        (tmp / name).write_text(r.stdout)
    binds = 'Attr<int64_t>("blocks")' in (tmp / _HEADERS[0]).read_text()
    if blocks and not binds:
        raise SystemExit(f"error: --blocks with --baseline={rev}, whose kernel binds no "
                         "'blocks' attribute; allowed: a commit from 3e7df1b on")
    return tmp, binds


def baseline_target(rev: str, tmp: pathlib.Path, binds: bool,
                    blocks: bool = False) -> tuple[str, bool | None]:
    """Registers the dense target of ``rev``'s source in ``tmp`` (:func:`baseline_source`);
    returns its name and the ``blocks`` attribute to call it with (None: its source binds
    none; ``blocks``: True, the block sweep).

    Raises:
      SystemExit: the build failed.
    """
    target = f"kvjax_decode_attention_{rev}"
    ok = native.register({}, threading.Lock(),
                         lambda: native.build_library(tmp / _HEADERS[0], target), target,
                         "KvjaxDecodeAttention", f"the kernel of {rev}", "exiting")
    if not ok:
        raise SystemExit(f"error: the kernel of {rev} could not be built or loaded")
    return target, (blocks if binds else None)


def main() -> None:
    a = parse_flags(__doc__, 9, baseline=True)
    tmp, binds = baseline_source(a.baseline, a.blocks)
    if not native.load():
        raise SystemExit("error: the working tree's native kernel could not be built")
    targets = {"old": baseline_target(a.baseline, tmp, binds, a.blocks),
               "new": (native.TARGET, a.blocks)}
    probe = hardware.ReadProbe("vecmat")
    rng = np.random.default_rng(0)
    print(f"baseline {a.baseline}; S={a.slots}; {'native_blocks' if a.blocks else 'native'}; "
          f"load average {os.getloadavg()}", flush=True)
    # 'native_blocks' sweeps grouped heads only; --layers: as many caches as layers
    for name, k, g, (q, caches, vis, vl, nbytes) in shapes(a.models, a.slots, rng, a.layers,
                                                            grouped=a.blocks):
        copies = len(caches)
        if a.layers:  # every call reads all the caches
            nbytes *= a.layers
            build, args = compiled_layers, lambda r, tag: (q, caches, vis)
        else:  # each call one copy, rotated
            build = compiled
            args = lambda r, tag: (q, *caches[(2 * r + (tag == "new")) % copies], vis)
        fns = {tag: build(target, vl, q, caches, vis, blocks)
               for tag, (target, blocks) in targets.items()}
        secs = {tag: [] for tag in fns}
        reads = []
        for r in range(a.rounds):
            for tag in (("old", "new") if r % 2 == 0 else ("new", "old")):
                reads.append(probe.once())
                call = args(r, tag)
                t0 = time.perf_counter()
                jax.block_until_ready(fns[tag](*call))
                secs[tag].append(time.perf_counter() - t0)
        roof = statistics.median(reads)
        gbps = {tag: nbytes / statistics.median(s) / 1e9 for tag, s in secs.items()}
        print(f"{name} K={k} G={g} BKHS/{vl}"
              + (f", {a.layers} layers in one program" if a.layers else "") + ": " + "  ".join(
            f"{tag} {gb:5.1f} GB/s ({gb * 1e9 / roof:4.0%})" for tag, gb in gbps.items())
            + f"; new/old {gbps['new'] / gbps['old']:.2f}x (paired: "
            f"{statistics.median(o / n for o, n in zip(secs['old'], secs['new'])):.3f}x, new "
            f"faster in {sum(o > n for o, n in zip(secs['old'], secs['new']))}/{a.rounds}); "
            f"read {roof / 1e9:.1f} GB/s; "
            f"load {os.getloadavg()[0]:.1f}"
            + (hardware.cache_reads_note(nbytes, "--layers") if a.layers else ""), flush=True)


if __name__ == "__main__":
    main()
