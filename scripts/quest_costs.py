r"""Quest's read (lever 5 at read time, kvjax/compression/quest.py) counted by the
compiler: the paged decode step of SmolLM2-135M's shapes (float32, from shapes only: no
weights, nothing allocated) at context t with a budget of B tokens per KV head, against
the full paged read at t and at B, and against theory
(:func:`kvjax.analysis.theory.page_selection_step_bytes`: the budget's pages, every
page's key bounds and the step's writes). Quest's step runs the registry's rule
('pages_native' for decode_attention 'native': the native kernel over each KV head's
chosen pages in place; 'pages_xla' for 'xla': the gathered reference). Compiled bytes
are XLA's plus the kernels' ('+kernels': a paged kernel's block-table pages), split into
the weights, the K/V read and, for Quest, its scoring (the ops under
``attention.SCORING_SCOPE``: the bounds read, the page scores, the top-k) beside
theory's bounds read.

    PYTHONPATH=. python scripts/quest_costs.py                      # t = 4096, B = 512
    PYTHONPATH=. python scripts/quest_costs.py --context 8192 --budget 512 --page_size 16
    PYTHONPATH=. python scripts/quest_costs.py --measure 7 --skip_compiled  # step times

``--measure N``: N rounds, each step once per round (interleaved), medians; each step's
time over the full read's at t = B by the same formulation. Prints markdown tables for
docs/results/<machine>.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from kvjax import compression, planner, presets
from kvjax.analysis import costs
from kvjax.cache import paged
from kvjax.models import decode_kernels
from kvjax.models import model as model_lib


def _formulations(names: str) -> list:
    return [n for n in names.split(",") if n]


def configs(context: int, budget: int, page_size: int, formulations,
            dense_layers=(0,)) -> list:
    """(label, config, t) of the steps compared: the full paged read by each decode
    formulation at t = ``context`` and at t = ``budget``, and Quest by each (its read
    is the rule 'pages_native' for 'native', 'pages_xla' for 'xla') with each count of
    ``dense_layers`` (``compression.dense_layers``: first layers reading every page),
    each config resolved for its paged class (the native kernel loaded where asked)."""
    base = presets.smollm2_135m("float32", scan_layers=None)
    out = []
    for name in formulations:
        for t in (context, budget):
            out.append((f"full paged read ('{name}')", base.replace(decode_attention=name), t))
    for name in formulations:
        for d in dense_layers:
            q = base.replace(kv_compression="quest", kv_budget=budget, decode_attention=name,
                             compression=compression.CompressionConfig(dense_layers=d))
            out.append((f"quest, budget {budget}{f', {d} dense layers' if d else ''} "
                        f"('{name}')", q, context))
    return [(label, _plan(cfg, t, page_size), t) for label, cfg, t in out]


def _plan(cfg, t: int, page_size: int):
    pages = paged.pages_for(t, page_size)
    return planner.resolve(cfg, max_seq_len=pages * page_size, batch_sizes=(1,),
                           page_size=page_size)


def rows(context: int, budget: int, page_size: int, formulations,
         dense_layers=(0,)) -> list:
    """(label, t, formulation run, analyze_paged_decode_step's dict) per step."""
    out = []
    for label, cfg, t in configs(context, budget, page_size, formulations, dense_layers):
        site = decode_kernels.site(cfg, 1, 1, paged.pages_for(t, page_size) * page_size,
                                   True, page_size)
        out.append((label, t, cfg.formulation(site),
                    costs.analyze_paged_decode_step(cfg, t, page_size)))
    return out


def step_fn(cfg, params, context: int, page_size: int):
    """A function timing one paged decode step (one row holding ``context`` - 1 tokens;
    random weights and cache: the time does not depend on the values), compiled now,
    the cache donated: each call returns its seconds, to the result."""
    pages = paged.pages_for(context, page_size)
    state = {"cache": paged.init_paged_cache(cfg, 1, pages, page_size, pages).replace(
        block_table=jnp.arange(pages, dtype=jnp.int32)[None],
        length=jnp.full((1,), context - 1, jnp.int32))}
    step = jax.jit(lambda p, tok, c: model_lib.forward(p, cfg, tok, c.length[:, None], c),
                   donate_argnums=2)
    tok = jnp.ones((1, 1), jnp.int32)

    def run() -> float:
        t0 = time.perf_counter()
        logits, cache = step(params, tok, state["cache"])
        jax.block_until_ready(logits)
        sec = time.perf_counter() - t0
        state["cache"] = cache.replace(length=jnp.full((1,), context - 1, jnp.int32))
        return sec

    run()  # compiles
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--formulations", default="xla,native",
                    help="decode_attention values, comma separated (Quest's read: "
                         "'native' runs the rule 'pages_native', 'xla' 'pages_xla')")
    ap.add_argument("--dense_layers", default="0",
                    help="Quest's compression.dense_layers values, comma separated (its "
                         "paper: 2)")
    ap.add_argument("--measure", type=int, default=0,
                    help="rounds of each step's timing (0: compiled bytes only)")
    ap.add_argument("--skip_compiled", action="store_true",
                    help="only the measured steps (with --measure)")
    a = ap.parse_args()
    names = _formulations(a.formulations)
    dense = tuple(int(d) for d in a.dense_layers.split(",") if d)
    table = [] if a.skip_compiled else rows(a.context, a.budget, a.page_size, names, dense)
    if table:
        print("| step | t | runs | part | compiled (+kernels) MB | theory MB | "
              "compiled / theory |")
        print("|---|---:|---|---|---:|---:|---:|")
    for label, t, run, r in table:
        th, att = r["theory"], r["attribution"]
        kv = att["bytes"]["kv_read"] + att["uncosted"]["kv_read"]
        parts = [("total", r["counted_bytes"], r["theory_bytes"]),
                 ("weights", att["bytes"]["weights"] + att["uncosted"]["weights"],
                  th["weights"])]
        if "bounds_read" in th:  # the read and the scoring apart
            kv_kernel = att["uncosted"]["kv_read"]
            kv_xla = sum(v["read"] for n, v in att["kv_tensors"].items()
                         if n in ("k", "v", "k_scale", "v_scale"))
            parts += [("selected pages' K/V read", kv_kernel + kv_xla, th["kv_read"]),
                      ("scoring (bounds read, page scores, top-k)", r["scoring_bytes"],
                       th["bounds_read"])]
        else:
            parts.append(("K/V read", kv, th["kv_read"]))
        for part, got, want in parts:
            print(f"| {label} | {t} | `{run}` | {part} | {got / 1e6:.2f} | {want / 1e6:.2f} "
                  f"| {got / want:.3f} |")
    if a.measure:
        steps = configs(a.context, a.budget, a.page_size, names, dense)
        params = model_lib.init_params(steps[0][1].replace(plan=None), 0)
        fns = [(label, t, step_fn(cfg, params, t, a.page_size)) for label, cfg, t in steps]
        runs = [cfg.decode_attention for _, cfg, _ in steps]
        times = {i: [] for i in range(len(fns))}
        for _ in range(a.measure):  # rounds: every step once per round, interleaved
            for i, (_, _, fn) in enumerate(fns):
                times[i].append(fn())
        med = [statistics.median(times[i]) * 1e3 for i in range(len(fns))]
        full = {run: med[i] for i, ((label, t, _), run) in enumerate(zip(fns, runs))
                if label.startswith("full") and t == a.budget}
        print("\n| step (measured, one row) | t | median ms | x the full read at "
              f"t = {a.budget} (same formulation) |")
        print("|---|---:|---:|---:|")
        for (label, t, _), run, ms in zip(fns, runs, med):
            print(f"| {label} | {t} | {ms:.2f} | {ms / full[run]:.3f} |")

if __name__ == "__main__":
    main()
