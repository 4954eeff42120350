"""The paged decode step against the dense one, per decode-attention formulation.

For each context t and each ``--impls`` formulation, one decode step of the model is
compiled twice: over a dense cache of t slots (``kvjax.cache.compress.full_cache``) and
over a paged cache holding the same t tokens in pages of ``--page_size`` taken from the
pool in shuffled order (``kvjax.cache.paged``; 'native' and, on GPU, 'pallas' read the
pages in place, the other formulations the gather of each row's pages into its dense
view). Each step has
its own plan (``planner.resolve``; the paged one with ``page_size``: its own shape
classes), so 'auto' is the planner's pick for each, printed as dense/paged. The two are
timed alternately, ``--repeats`` steps each per round over ``--rounds`` rounds, and the
script prints the medians and their ratio (paged / dense: the overhead of paging), the
compiled bytes of each (XLA's count plus the native kernels' operand bytes, the cost
hook's "+kernels"), and the theory's bytes (``kvjax.analysis.theory.step_bytes`` for the
dense step; ``kvjax.analysis.paging.paged_step_bytes`` for the paged one: in place for
'native' and 'pallas', else the gather; split into pages, block tables and the gathered
view) with the paged step's achieved theory bytes per second.

The model is the main job's (``configs/gqa.py``: SmolLM2-135M, GQA, float32, this
backend's cache layouts). Weights are random (the timing does not depend on their values). Usage:

    PYTHONPATH=. python scripts/paged_step_bench.py --contexts=4096,32768
    PYTHONPATH=. python scripts/paged_step_bench.py --contexts=256 --layers=2 --repeats=2
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from configs import gqa
from kvjax.cache import compress as compress_lib
from kvjax.config import run_config_from_dict
from kvjax import planner
from kvjax.analysis import hardware, hlo_cost, paging, theory
from kvjax.cache import paged
from kvjax.inference import decode
from kvjax.kernels import names
from kvjax.models import decode_kernels, model as model_lib


def _ints(text: str, flag: str, low: int = 1) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < low:
        raise SystemExit(f"error: --{flag}={text}; allowed: comma-separated integers "
                         f">= {low}")
    return out


def paged_full_cache(cfg, context: int, page_size: int, seed: int = 0):
    """A paged cache of one row holding ``context - 1`` tokens (a step at context t sees
    it full) on pages of ``page_size`` in a shuffled order, plus 1 spare page. With a
    window W the pages that slid out of it are gone (entries -1, as the paged engine's
    ``PageAllocator.drop_before``: every position below t - W, the sinks' pages kept)."""
    m = paged.pages_for(context, page_size)
    cache = paged.init_paged_cache(cfg, 1, m + 1, page_size, m)
    order = np.random.default_rng(seed).permutation(m + 1)[:m].astype(np.int32)
    if cfg.window_size:
        first = (context - cfg.window_size) // page_size  # the first page still seen
        keep = paged.pages_for(cfg.num_sink_tokens, page_size)
        order[keep:max(first, keep)] = -1
    return cache.replace(block_table=jnp.asarray(order[None]),
                         length=jnp.full((1,), context - 1, jnp.int32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,32768", help="contexts t (tokens)")
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--impls", default="auto,xla,native",
                    help=f"decode-attention formulations, of {names('decode_attention')}")
    ap.add_argument("--layers", type=int, default=0, help="layers (0: SmolLM2's 30)")
    ap.add_argument("--window_size", type=int, default=0,
                    help="a sliding window W (0: none): the dense cache is a ring of W "
                         "slots, the paged row keeps the pages W covers")
    ap.add_argument("--sinks", type=int, default=0, help="attention sinks beside W")
    ap.add_argument("--repeats", type=int, default=5, help="steps per round and cache")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    contexts = _ints(a.contexts, "contexts", 2)
    impls = a.impls.split(",")
    allowed = [n for n in names("decode_attention")
               if n != "pallas" or jax.default_backend() == "gpu"]  # Pallas: GPU only
    if not impls or any(i not in allowed for i in impls):
        raise SystemExit(f"error: --impls={a.impls}; allowed: a subset of {allowed}")
    for flag, v in (("page_size", a.page_size), ("repeats", a.repeats),
                    ("rounds", a.rounds)):
        if v < 1:
            raise SystemExit(f"error: --{flag}={v}; allowed: an integer >= 1")
    for flag, v in (("layers", a.layers), ("window_size", a.window_size),
                    ("sinks", a.sinks)):
        if v < 0:
            raise SystemExit(f"error: --{flag}={v}; allowed: 0 or an integer >= 1")
    if a.sinks and not a.window_size:
        raise SystemExit(f"error: --sinks={a.sinks} without --window_size; allowed: "
                         "sinks beside a window")
    arch = run_config_from_dict(gqa.get_config()).model  # the main job's model
    if a.layers:
        arch = arch.replace(num_layers=a.layers)
    if a.window_size:
        arch = arch.replace(window_size=a.window_size, num_sink_tokens=a.sinks)
    params = model_lib.params_for(arch, model_lib.init_params(arch, 0))
    window = f", window {a.window_size} + {a.sinks} sinks" if a.window_size else ""
    print(f"machine: {hardware.device_name()}; {arch.name}, {arch.num_layers} layers{window}, "
          f"float32, B = 1, page_size {a.page_size}; median of {a.rounds} x {a.repeats} "
          "steps per cache, timed alternately")
    print("| t | formulation (picked) | dense ms | paged ms | paged / dense | dense XLA MB "
          "| paged XLA MB | dense theory MB | paged theory MB | paged: pages MB / tables kB / "
          "view MB | paged theory GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for t in contexts:
        for impl in impls:
            base = arch.replace(decode_attention=impl)
            cfgs = {"dense": planner.resolve(base, max_seq_len=t),  # each its own classes
                    "paged": planner.resolve(
                        base, max_seq_len=paged.pages_for(t, a.page_size) * a.page_size,
                        page_size=a.page_size)}
            token = jnp.zeros((1, 1), jnp.int32)
            caches = {"dense": compress_lib.full_cache(cfgs["dense"], 1, t),
                      "paged": paged_full_cache(cfgs["paged"], t, a.page_size)}
            compiled, xla_mb, times = {}, {}, {k: [] for k in caches}
            for k, c in caches.items():
                compiled[k] = decode.decode_step.lower(params, token, c, cfg=cfgs[k]).compile()
                rep = hlo_cost.loop_aware_cost(compiled[k])  # XLA's, + the kernels' operands
                xla_mb[k] = (rep.bytes + rep.uncosted_bytes) / 1e6
            picked = "/".join("+".join(sorted({i for _, i in cfgs[k].plan.decode_attention}))
                              for k in caches) if impl == "auto" else impl
            for _ in range(a.rounds):
                for k in caches:  # the cache donated to each step, its length reset
                    length = np.asarray(caches[k].length)
                    for i in range(a.repeats + 1):
                        start = time.perf_counter()
                        logits, caches[k] = compiled[k](params, token, caches[k])
                        logits.block_until_ready()
                        if i:  # the first of each round warms the caches up
                            times[k].append(time.perf_counter() - start)
                        caches[k] = caches[k].replace(length=jnp.asarray(length))
            d, p = (float(np.median(times[k])) * 1e3 for k in ("dense", "paged"))
            dense_th = theory.step_bytes(arch, t).total
            picks = {i for _, i in cfgs["paged"].plan.decode_attention} \
                if impl == "auto" else {impl}
            in_place = picks <= set(decode_kernels.IN_PLACE)
            th = paging.paged_step_bytes(arch, [theory.tokens_held(arch, t)], a.page_size,
                                         paged.pages_for(t, a.page_size),
                                         "in_place" if in_place else "gather")
            print(f"| {t:,} | {impl} ({picked}) | {d:.1f} | {p:.1f} | {p / d:.2f} | "
                  f"{xla_mb['dense']:,.1f} | {xla_mb['paged']:,.1f} | {dense_th / 1e6:,.1f} | "
                  f"{th.total / 1e6:,.1f} | {th.pages / 1e6:,.3f} / {th.tables / 1e3:.2f} / "
                  f"{th.view / 1e6:,.3f} | {th.total / p / 1e6:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
