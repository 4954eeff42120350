r"""Quest's read (lever 5 at read time, kvjax/compression/quest.py) counted by the
compiler: the paged decode step of SmolLM2-135M's shapes (float32, from shapes only: no
weights, nothing allocated) at context t with a budget of B tokens per KV head, against
the full paged read at t and at B, and against theory
(:func:`kvjax.analysis.theory.page_selection_step_bytes`: the budget's pages, every
page's key bounds and the step's writes).

    PYTHONPATH=. python scripts/quest_costs.py                      # t = 4096, B = 512
    PYTHONPATH=. python scripts/quest_costs.py --context 8192 --budget 512 --page_size 16
    PYTHONPATH=. python scripts/quest_costs.py --measure 7     # + the steps' median times

Prints a markdown table for docs/results/<machine>.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax import presets
from kvjax.analysis import costs
from kvjax.cache import paged
from kvjax.models import model as model_lib


def rows(context: int, budget: int, page_size: int, formulations) -> list:
    base = presets.smollm2_135m("float32", scan_layers=None)
    out = []
    for name in formulations:  # the full paged read, per decode formulation
        for t in (context, budget):
            cfg = base.replace(decode_attention=name)
            r = costs.analyze_paged_decode_step(cfg, t, page_size)
            out.append((f"full paged read ('{name}')", t, r))
    q = base.replace(kv_compression="quest", kv_budget=budget)
    out.append((f"quest, budget {budget}", context, costs.analyze_paged_decode_step(
        q, context, page_size)))
    return out


def measure(cfg, params, context: int, page_size: int, repeats: int) -> float:
    """Median seconds of one paged decode step (one row holding ``context`` - 1 tokens;
    random weights and cache: the time does not depend on the values), compiled once,
    the cache donated, each call timed to its result."""
    pages = paged.pages_for(context, page_size)
    cache = paged.init_paged_cache(cfg, 1, pages, page_size, pages)
    cache = cache.replace(block_table=jnp.arange(pages, dtype=jnp.int32)[None],
                          length=jnp.full((1,), context - 1, jnp.int32))
    step = jax.jit(lambda p, tok, c: model_lib.forward(p, cfg, tok, c.length[:, None], c),
                   donate_argnums=2)
    tok = jnp.ones((1, 1), jnp.int32)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        logits, cache = step(params, tok, cache)
        jax.block_until_ready(logits)
        cache = cache.replace(length=jnp.full((1,), context - 1, jnp.int32))
        if i:  # the first call compiles
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--formulations", default="xla,native",
                    help="decode_attention formulations of the full read, comma separated")
    ap.add_argument("--measure", type=int, default=0,
                    help="repeats of each step's timing (0: compiled bytes only)")
    ap.add_argument("--skip_compiled", action="store_true",
                    help="only the measured steps (with --measure)")
    a = ap.parse_args()
    table = [] if a.skip_compiled else rows(a.context, a.budget, a.page_size,
                                            a.formulations.split(","))
    if table:
        print("| step | t | compiled MB | theory MB | compiled / theory | compiled KV read MB "
          "| theory KV read MB | theory bounds MB |")
        print("|---|---|---|---|---|---|---|---|")
    for label, t, r in table:
        th = r["theory"]
        kv = r["attribution"]["bytes"]["kv_read"]
        print(f"| {label} | {t} | {r['xla_bytes'] / 1e6:.2f} | {r['theory_bytes'] / 1e6:.2f} "
              f"| {r['xla_over_theory']:.3f} | {kv / 1e6:.2f} | {th['kv_read'] / 1e6:.2f} "
              f"| {th.get('bounds_read', 0) / 1e6:.3f} |")
    if a.measure:
        base = presets.smollm2_135m("float32", scan_layers=None)
        params = model_lib.init_params(base, 0)
        print("\n| step (measured, one row) | t | median ms | x full at t |")
        print("|---|---|---|---|")
        full = None
        for label, cfg, t in [("full paged read ('xla')", base, a.context),
                              ("full paged read ('xla')", base, a.budget),
                              (f"quest, budget {a.budget}",
                               base.replace(kv_compression="quest", kv_budget=a.budget),
                               a.context)]:
            sec = measure(cfg, params, t, a.page_size, a.measure)
            full = full or sec
            print(f"| {label} | {t} | {sec * 1e3:.2f} | {sec / full:.3f} |")


if __name__ == "__main__":
    main()
