"""The thunks of the compiled decode step: what XLA:CPU runs one after another per step.

    PYTHONPATH=. python scripts/thunk_count.py --configs=gqa --context=1024
    PYTHONPATH=. python scripts/thunk_count.py --configs=gqa,mha,mla --weight_matmul=xla

Definition (reproducible from the compiled HLO text): the instructions of the compiled
decode step's ENTRY computation (``kvjax.analysis.costs.compile_decode_step``, batch 1,
a cache of ``--context`` slots) except those that run no code (parameter, constant,
get-tuple-element, tuple, bitcast). On CPU the layer stack is unrolled, so each layer's
fusions, custom calls (the native kernels), copies and stray ops are entry instructions;
XLA:CPU emits one thunk for each (a fusion's body runs inside its thunk). Printed: the
total, the total over L (the step's fixed cost a layer: the embedding, final norm and LM
head's few thunks are spread over the layers), and the count by opcode.

``--weight_matmul`` / ``--decode_attention`` pin the formulations ('auto': this machine's
planner picks, read from or written to the planner's cache). ``--time_repeats=N`` also
times two forms of the step, one call of each per round, in turns first (N rounds
after two warm-up rounds: a shared machine's load falls on both alike), random weights and a full cache,
and prints each one's median and the ratio: with ``--compare=fused`` the projections
apart and fused (:func:`kvjax.models.model.fuse_projections`); with ``--compare=sums``
(both fused) the per-row sums as plain reduces and in parts of 32 finished in each
element (:func:`kvjax.ops.lane_sum`, ``kvjax.ops.MAX_ADDS`` set to 0 while the plain
form is traced; its thunk count is printed too, JSON key 'plain'); with
``--compare=norms`` (both fused) the RMSNorms before the weight products applied by XLA
and folded into the native kernel (``kvjax.models.weight_matmul.FOLD_NORMS`` False while
the first is traced; its count under 'plain' too).

    PYTHONPATH=. python scripts/thunk_count.py --configs=gqa --compare=sums \
        --weight_matmul=native --decode_attention=native --time_repeats=41
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import compress as compress_lib
from kvjax import kernels, ops
from kvjax.analysis import costs, profile
from kvjax.config import run_config_from_dict
from kvjax.inference import decode
from kvjax.models import model, weight_matmul


def entry_ops(hlo_text: str) -> collections.Counter:
    """{opcode: count} of the ENTRY computation of a compiled module's HLO text, without
    the instructions that run no code (:func:`kvjax.analysis.profile.entry_instructions`)."""
    return collections.Counter(i.opcode for i in profile.entry_instructions(hlo_text).values())


COMPARES = {"fused": (("apart", False, None), ("fused", True, None)),
            "sums": (("plain", True, 0), ("parted", True, None)),
            "norms": (("xla_norms", True, "xla"), ("folded", True, None))}
"""{--compare value: its two forms (label, projections fused, kvjax.ops.MAX_ADDS while
tracing, or 'xla' for kvjax.models.weight_matmul.FOLD_NORMS False: None keeps the
defaults)}."""


@contextlib.contextmanager
def max_adds(value: int | str | None):
    """``kvjax.ops.MAX_ADDS`` set to ``value`` (None: left as it is; 'xla':
    ``kvjax.models.weight_matmul.FOLD_NORMS`` set False instead) while programs are
    traced inside; JAX's trace caches are dropped on entry and exit so that a program
    traced under one value is never reused under the other."""
    old, fold = ops.MAX_ADDS, weight_matmul.FOLD_NORMS
    jax.clear_caches()
    if value == "xla":
        weight_matmul.FOLD_NORMS = False
    elif value is not None:
        ops.MAX_ADDS = value
    try:
        yield
    finally:
        ops.MAX_ADDS, weight_matmul.FOLD_NORMS = old, fold
        jax.clear_caches()


def count(name: str, context: int, weight_matmul: str, decode_attention: str) -> dict:
    """{'total', 'per_layer', 'layers', 'ops'} of configs/<name>.py's decode step."""
    run = run_config_from_dict(importlib.import_module(f"configs.{name}").get_config())
    cfg = run.model.replace(weight_matmul=weight_matmul, decode_attention=decode_attention)
    compiled = costs.compile_decode_step(cfg, 1, context)
    ops_ = entry_ops(compiled.as_text())
    total = sum(ops_.values())
    return {"total": total, "layers": cfg.num_layers,
            "per_layer": round(total / cfg.num_layers, 2), "ops": dict(ops_.most_common())}


def time_forms(name: str, context: int, weight_matmul: str, decode_attention: str,
               repeats: int, compare: str = "fused") -> dict:
    """{'<a>_ms', '<b>_ms', 'speedup'}: median step times (ms) of configs/<name>.py's
    decode step in the two forms of ``compare`` (:data:`COMPARES`, e.g. 'apart_ms' and
    'fused_ms'), timed in turns; 'speedup' is the median of the rounds' a / b."""
    run = run_config_from_dict(importlib.import_module(f"configs.{name}").get_config())
    cfg = costs.planned(run.model.replace(weight_matmul=weight_matmul,
                                          decode_attention=decode_attention), 1, context)
    token = jnp.zeros((1, 1), jnp.int32)
    runs = []
    for _, fused, adds in COMPARES[compare]:
        params = model.init_params(cfg, 0)
        params = model.fuse_projections(cfg, params) if fused else params
        cache = compress_lib.full_cache(cfg, 1, context)
        with max_adds(adds):
            step = decode.decode_step.lower(params, token, cache, cfg=cfg).compile()
        runs.append([step, params, cache, np.asarray(cache.length), []])
    for rnd in range(repeats + 2):
        for r in runs if rnd % 2 else runs[::-1]:  # each form first in half the rounds
            step, params, cache, length, times = r
            start = time.perf_counter()
            logits, cache = step(params, token, cache)
            logits.block_until_ready()
            if rnd >= 2:
                times.append(time.perf_counter() - start)
            r[2] = cache.replace(length=jnp.asarray(length))
    (a, *_), (b, *_) = COMPARES[compare]
    ratios = [x / y for x, y in zip(runs[0][4], runs[1][4])]
    return {f"{a}_ms": 1e3 * statistics.median(runs[0][4]),
            f"{b}_ms": 1e3 * statistics.median(runs[1][4]),
            "speedup": statistics.median(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gqa", help="names of configs/*.py, comma-separated")
    ap.add_argument("--context", type=int, default=1024, help="cache slots")
    ap.add_argument("--weight_matmul", default="auto",
                    help="model.weight_matmul for the step ('auto': the planner's picks)")
    ap.add_argument("--decode_attention", default="auto",
                    help="model.decode_attention for the step ('auto': the planner's picks)")
    ap.add_argument("--time_repeats", type=int, default=0,
                    help="also time the step apart and fused, this many rounds (0: not)")
    ap.add_argument("--compare", default="fused",
                    help=f"the two forms --time_repeats times: one of {list(COMPARES)}")
    ap.add_argument("--out", default=None, help="JSON file to write (default: none)")
    a = ap.parse_args()
    names = a.configs.split(",")
    known = sorted(p.stem for p in pathlib.Path(__file__).parent.parent.joinpath(
        "configs").glob("*.py") if p.stem not in ("__init__", "base"))
    if not all(n in known for n in names):
        ap.error(f"--configs={a.configs}; allowed: names among {known}")
    if a.time_repeats < 0:
        ap.error(f"--time_repeats={a.time_repeats}; allowed: an integer >= 0")
    if a.compare not in COMPARES:
        ap.error(f"--compare={a.compare}; allowed: one of {list(COMPARES)}")
    if a.context < 1:
        ap.error(f"--context={a.context}; allowed: an integer >= 1")
    for op in ("weight_matmul", "decode_attention"):
        allowed = kernels.names(op)
        if getattr(a, op) not in allowed:
            ap.error(f"--{op}={getattr(a, op)}; allowed: one of {list(allowed)}")
    out = {}
    for name in names:
        out[name] = count(name, a.context, a.weight_matmul, a.decode_attention)
        r = out[name]
        print(f"{name}: {r['total']} thunks, {r['per_layer']} a layer ({r['layers']} "
              f"layers); {r['ops']}", flush=True)
        if a.compare in ("sums", "norms"):
            with max_adds(COMPARES[a.compare][0][2]):
                r["plain"] = count(name, a.context, a.weight_matmul, a.decode_attention)
            print(f"{name} with {COMPARES[a.compare][0][0]}: {r['plain']['total']} "
                  f"thunks, {r['plain']['per_layer']} a layer; {r['plain']['ops']}",
                  flush=True)
        if a.time_repeats:
            r.update(time_forms(name, a.context, a.weight_matmul, a.decode_attention,
                                a.time_repeats, a.compare))
            (x, *_), (y, *_) = COMPARES[a.compare]
            print(f"{name}: step {r[x + '_ms']:.2f} ms {x}, {r[y + '_ms']:.2f} ms {y} "
                  f"(median of {a.time_repeats}); {x} / {y} {r['speedup']:.3f} "
                  "(median of the rounds' ratios)", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
