r"""Lever 5's bytes three ways on SmolLM2's shapes (random weights: bytes and times do not
depend on the values): allocated against theory for every method and budget, the
compiled decode step against theory at the budget, the scoring overhead in the compiled
prefill, and the measured generate loop per token at t = 8K with a budget of 512, every method
after its prefill and every N = 1, 8, 64 steps (``--only timed``, ``--every_n``), against
the full cache's at t = 512 and at t = 8K, with the every-N scoring overhead beside
theory's (:func:`kvjax.analysis.theory.schedule_overhead`), and Quest's paged step
against the full paged read at t = 512, interleaved in the same rounds. PyramidKV's per-layer caches (``--only pyramid``): each
layer's slots, the allocated bytes against theory's at the budget and a uniform cache's,
and its compiled decode step against theory.

    PYTHONPATH=. python scripts/compression_figures.py                  # ~10 min, 2 cores
    PYTHONPATH=. python scripts/compression_figures.py --budgets 64,512 --prompt 1024
    PYTHONPATH=. python scripts/compression_figures.py --only pyramid --prompt 1024
    PYTHONPATH=. python scripts/compression_figures.py --only timed --rounds 3  # ~30 min
    PYTHONPATH=. python scripts/compression_figures.py --only timed --rounds 3 \
        --methods tova,h2o,pyramidkv,quest --every_n 1,8

Prints markdown tables for docs/results/<machine>.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import compression, planner, presets
from kvjax.analysis import costs, theory
from kvjax.cache import compress as compress_lib
from kvjax.cache import kv as cache_lib
from kvjax.cache import paged
from kvjax.config import ConfigError
from kvjax.inference import decode
from kvjax.models import model as model_lib


def smollm2(**fields):
    """SmolLM2-135M in float32 as the main job runs it: the planner's formulations
    ('auto', picked on this machine before tracing) and the backend's layer stack
    (unrolled on CPU, docs/decisions/0002-unrolled-layer-stack-on-cpu.md)."""
    return presets.smollm2_135m("float32", scan_layers=None).replace(
        decode_attention="auto", weight_matmul="auto", **fields)


def allocated_rows(budgets, prompt_len: int, seed: int = 0) -> list:
    """Each method x budget: a real prefill of ``prompt_len`` random tokens, compressed;
    its cache's bytes against theory's at the budget."""
    base = smollm2()
    params = model_lib.init_params(base, seed)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(3, base.vocab_size,
                                                              (1, prompt_len)), jnp.int32)
    rows = []
    for method in filter(compression.evicts, compression.names()):  # quest: pages
        for budget in budgets:
            cfg = base.replace(kv_compression=method, kv_budget=budget)
            cache = cache_lib.init_cache(cfg, 1, prompt_len)
            _, cache = decode.prefill(params, cfg, tokens, cache)
            got = cache_lib.cache_bytes(cache)
            want = theory.kv_cache_bytes(cfg, prompt_len)
            rows.append((method, budget, cache.num_slots, got, want))
    return rows


def step_rows(budgets, context: int) -> list:
    """The compiled decode step at ``context`` per budget (one program for every method:
    the step reads the kept slots and the ring, whatever scored them) and the full
    cache's, against theory."""
    rows = []
    for budget in budgets:
        cfg = smollm2(kv_compression="snapkv", kv_budget=budget)
        rows.append((f"budget {budget}",
                     costs.analyze_decode_step(cfg, context, jaxpr=False)))
    for t in (512, context):
        rows.append((f"full cache, t={t}",
                     costs.analyze_decode_step(smollm2(), t, jaxpr=False)))
    return rows


def pyramid_rows(budgets, prompt_len: int, seed: int = 0) -> list:
    """PyramidKV per budget: a real prefill of ``prompt_len`` random tokens, compressed;
    (budget, layer budgets, allocated bytes, theory's at a context every layer's cache
    fills, a uniform (SnapKV) cache's allocated bytes at the same budget)."""
    base = smollm2()
    params = model_lib.init_params(base, seed)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(3, base.vocab_size,
                                                              (1, prompt_len)), jnp.int32)
    rows = []
    for budget in budgets:
        got = {}
        for method in ("pyramidkv", "snapkv"):
            cfg = base.replace(kv_compression=method, kv_budget=budget)
            cache = cache_lib.init_cache(cfg, 1, prompt_len)
            _, cache = decode.prefill(params, cfg, tokens, cache)
            got[method] = (cfg, cache_lib.cache_bytes(cache))
        cfg, alloc = got["pyramidkv"]
        full = max(compress_lib.layer_budgets(cfg)) + cfg.compression.recent_slots
        rows.append((budget, compress_lib.layer_budgets(cfg), alloc,
                     theory.kv_cache_bytes(cfg, full), got["snapkv"][1]))
    return rows


def pyramid_step_rows(budgets, context: int) -> list:
    """PyramidKV's compiled decode step at ``context`` per budget (its own program: each
    layer reads its own slots), beside SnapKV's at the same budget."""
    return [(f"{m} {b}", costs.analyze_decode_step(
        smollm2(kv_compression=m, kv_budget=b), context, jaxpr=False))
        for b in budgets for m in ("pyramidkv", "snapkv")]


def overhead_rows(prompt_len: int, budget: int) -> list:
    return [(m, costs.compression_overhead(smollm2(kv_compression=m, kv_budget=budget),
                                           prompt_len))
            for m in filter(compression.evicts, compression.names())]


EVERY_N = (1, 8, 64)
"""The every-N schedules ``--only timed`` runs by default (``--every_n``), beside after
the prefill."""


def timed_cases(context: int, budget: int, methods, every_n=EVERY_N) -> dict:
    """name -> (config, context) of the timed loops: the full cache at t = 512 and at
    ``context``, and each method x schedule at ``context``: after the prefill, and every
    N steps for each N of ``every_n`` (the methods that can re-score during decoding:
    not PyramidKV's per-layer budgets). A page-selecting method (Quest) is no loop of
    a dense cache: :func:`paged_cases`."""
    cases = {"full t=512": (smollm2(), 512), f"full t={context}": (smollm2(), context)}
    methods = [m for m in methods if compression.evicts(m)]
    uniform = [m for m in methods if compression.get(m).layer_budgets is None]
    if uniform:  # after its prefill a method's step is the same program for all of them
        cases[_case("uniform", "prefill")] = (
            smollm2(kv_compression=uniform[0], kv_budget=budget), context)
    for m in methods:
        for n in ("prefill",) + tuple(every_n):
            if (n == "prefill") == (m in uniform):
                continue
            knobs = {} if n == "prefill" else dict(compression=compression.CompressionConfig(
                schedule="every_n", every_n=n))
            cases[_case(m, n)] = (smollm2(kv_compression=m, kv_budget=budget, **knobs),
                                  context)
    return cases


def paged_cases(context: int, budget: int, methods) -> dict:
    """name -> (config, context) of the timed paged decode steps: each page-selecting
    method of ``methods`` (Quest: every page kept, ``budget`` tokens read per KV head)
    at ``context``, and the full paged read at t = 512, its reference by the same
    measurement; {} when ``methods`` names none."""
    chosen = [m for m in methods if compression.selects_pages(m)]
    if not chosen:
        return {}
    cases = {"full paged t=512": (smollm2(), 512)}
    for m in chosen:
        cases[f"{m}, paged step"] = (smollm2(kv_compression=m, kv_budget=budget), context)
    return cases


def _case(method: str, n) -> str:
    """A timed case's name; 'uniform': every method with one budget in every layer."""
    if method == "uniform":
        return "every uniform-budget method, after prefill (one program)"
    return f"{method}, " + ("after prefill" if n == "prefill" else f"every {n}")


def _loop_cache(cfg, context: int, steps: int):
    """A cache a loop of up to ``steps`` steps ends at ``context`` in: full at context -
    steps (:func:`kvjax.cache.compress.full_cache`), in ``context`` slots (a dense cache
    read in full, masked; a compressed one holds its budget + ring whatever t is)."""
    cache = compress_lib.full_cache(cfg, 1, context - steps)
    if cache_lib.num_slots(cfg, context) != cache.num_slots:
        big = cache_lib.init_cache(cfg, 1, context)
        cache = big.replace(positions=big.positions.at[:, :cache.num_slots].set(
            cache.positions), length=cache.length)
    return cache


def _shared_params(cfg, shared: dict, fuse: bool):
    """Random parameters of ``cfg`` (fused projections with ``fuse``), one copy per set
    of shapes and dtypes in ``shared``: the times do not depend on the values, and a copy
    per case would hold SmolLM2's 0.5 GB of weights once per timed case."""
    make = lambda: model_lib.init_params(cfg, 0)
    if fuse:
        make = lambda: model_lib.fuse_projections(cfg, model_lib.init_params(cfg, 0))
    key = (fuse, str(jax.eval_shape(make)))
    if key not in shared:
        shared[key] = make()
    return shared[key]


def _loop_runner(cfg, context: int, steps=(0, 64), shared=None):
    """Compiles ``cfg``'s generate loop over a cache of ``context`` slots now; returns a
    function timing it once: seconds per generated token, (t(n2) - t(n1)) / (n2 - n1)
    from the same cache (reset before each call), so a call's fixed cost cancels.
    ``shared``: parameters already made (:func:`_shared_params`)."""
    n1, n2 = steps
    cfg = costs.planned(cfg, 1, context)
    params = _shared_params(cfg, {} if shared is None else shared, fuse=True)
    host = jax.tree.map(np.asarray, _loop_cache(cfg, context, n2))
    fn = costs.compile_generate(cfg, 1, context)

    def run() -> float:
        secs = []
        for n in (n1, n2):
            cache = jax.tree.map(jnp.asarray, host)
            start = time.perf_counter()
            buf, _, cache = fn(params, jnp.zeros((1,), jnp.int32), cache, jnp.int32(n),
                               jax.random.key(0), jnp.int32(-1))
            buf.block_until_ready()
            secs.append(time.perf_counter() - start)
        return (secs[1] - secs[0]) / (n2 - n1)
    return run


def _paged_runner(cfg, context: int, page_size: int, steps: int = 8, shared=None):
    """Compiles one paged decode step (:func:`kvjax.analysis.costs.compile_paged_decode_step`:
    one row holding ``context`` - 1 tokens on ceil(context / P) pages, random weights, a
    zero pool: the time does not depend on the values) now; returns a function timing
    it once: the mean seconds of ``steps`` steps, the cache donated to each and its
    length reset, so every step sees the same context. ``shared``: as
    :func:`_loop_runner`'s."""
    pages = paged.pages_for(context, page_size)
    cfg = planner.resolve(cfg, max_seq_len=pages * page_size, batch_sizes=(1,),
                          page_size=page_size)
    fn = costs.compile_paged_decode_step(cfg, context, page_size)
    params = _shared_params(cfg, {} if shared is None else shared, fuse=False)
    length = lambda: jnp.full((1,), context - 1, jnp.int32)  # a new one: donated
    state = {"cache": paged.init_paged_cache(cfg, 1, pages, page_size, pages).replace(
        block_table=jnp.arange(pages, dtype=jnp.int32)[None], length=length())}
    token = jnp.zeros((1, 1), jnp.int32)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            logits, cache = fn(params, token, state["cache"])
            state["cache"] = cache.replace(length=length())
        logits.block_until_ready()
        return (time.perf_counter() - start) / steps
    return run


def timed(context: int, budget: int, rounds: int, methods, every_n=EVERY_N,
          page_size: int = 16) -> dict:
    """Seconds per generated token of each case's compiled generate loop
    (:func:`timed_cases`, :func:`_loop_runner`) and per paged decode step
    (:func:`paged_cases`, :func:`_paged_runner`), interleaved: each round times every
    case once, after a first warm-up round. The loops' caches start full
    (:func:`kvjax.cache.compress.full_cache`: a compressed one's kept slots and a full
    ring of recent_slots >= 64 tokens, so an every-N cache compresses at its first
    step, then every N), and they run 0 and 64 steps: every every-N case (N dividing
    64) runs 64 / N compressions in the difference, so its time per token is the
    amortised one. Returns (name -> [per-round seconds per token], the cases)."""
    cases = timed_cases(context, budget, methods, every_n)
    pages = paged_cases(context, budget, methods)
    run, shared = {}, {}  # compile everything before any timing
    for name, (c, t) in pages.items():
        run[name] = _paged_runner(c, t, page_size, shared=shared)
    for name, (c, t) in cases.items():
        run[name] = _loop_runner(c, t, shared=shared)
    out = {k: [] for k in run}
    for i in range(rounds + 1):  # the first round warms up
        per = {name: fn() for name, fn in run.items()}
        print(f"round {i}{' (warm-up)' if not i else ''}, ms: " + ", ".join(
            f"{k} {v * 1e3:.2f}" for k, v in per.items()), flush=True)
        if i:
            for k, v in per.items():
                out[k].append(v)
    return out, {**cases, **pages}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="64,256,512,1024,4096")
    ap.add_argument("--prompt", type=int, default=1024,
                    help="prompt tokens of the allocated-bytes check")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(compression.names()),
                    help="the methods --only timed runs (every-N: all but per-layer "
                         "budgets; a page-selecting method: its paged step)")
    ap.add_argument("--every_n", default=",".join(map(str, EVERY_N)),
                    help="the every-N schedules --only timed runs, each N dividing 64")
    ap.add_argument("--page_size", type=int, default=16,
                    help="tokens per page of a page-selecting method's timed step")
    ap.add_argument("--only", default="allocated,step,overhead,timed",
                    help="which tables to print")
    a = ap.parse_args()
    only = a.only.split(",")
    tables = ("allocated", "step", "overhead", "timed", "pyramid")
    if not only or any(o not in tables for o in only):
        ap.error(f"--only={a.only}; allowed: a comma-separated subset of {list(tables)}")
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
        for b in budgets:  # each budget a valid config before any work (names the value)
            smollm2(kv_compression="snapkv", kv_budget=b)
            if "pyramid" in only:  # its schedule must leave every layer above the window
                smollm2(kv_compression="pyramidkv", kv_budget=b)
    except (ValueError, ConfigError) as e:
        ap.error(f"--budgets={a.budgets}: {e}")
    bad = [m for m in a.methods.split(",") if m not in compression.names()]
    if bad:
        ap.error(f"--methods={a.methods}: {bad}; allowed: a comma-separated subset of "
                 f"{list(compression.names())}")
    try:
        every_n = tuple(int(n) for n in a.every_n.split(",") if n)
        for n in every_n:  # a valid knob (names the value), and whole schedules in 64
            smollm2(kv_compression="tova", kv_budget=512, compression=(
                compression.CompressionConfig(schedule="every_n", every_n=n)))
            if 64 % n:
                raise ValueError(f"every_n={n}; allowed: a divisor of the 64 timed steps")
    except (ValueError, ConfigError) as e:
        ap.error(f"--every_n={a.every_n}: {e}")
    a.every_n = every_n
    for name in ("prompt", "context", "rounds", "page_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}; allowed: an integer >= 1")
    print(f"device: {jax.devices()[0].device_kind}")

    if "allocated" in only:
        print("\n| method | budget | slots | allocated B | theory B at the prompt | equal |"
              "\n|---|---|---|---|---|---|")
        for m, b, s, got, want in allocated_rows([b for b in budgets if b <= a.prompt],
                                                 a.prompt):
            print(f"| {m} | {b} | {s} | {got:,} | {want:,} | {got == want} |")

    if "step" in only:
        _print_steps(budgets, a.context)
    if "pyramid" in only:
        _print_pyramid(budgets, a.prompt, a.context)
    if "overhead" in only:
        _print_overhead(a.context)
    if "timed" in only:
        _print_timed(a)


def _print_pyramid(budgets, prompt, context):
    print("\n| pyramidkv budget | layer budgets (0 / 15 / 29) | allocated B | theory B at "
          "the budget | equal | uniform (snapkv) allocated B |\n|---|---|---|---|---|---|")
    for b, per, got, want, flat in pyramid_rows([b for b in budgets if b <= prompt], prompt):
        print(f"| {b} | {per[0]} / {per[len(per) // 2]} / {per[-1]} | {got:,} | {want:,} | "
              f"{got == want} | {flat:,} |")
    _print_steps(budgets, context, pyramid_step_rows)


def _print_steps(budgets, context, rows=None):
    rows = rows or step_rows
    print(f"\n| decode step at t={context} | theory B | compiled B (+kernels) | "
          "compiled/theory | KV read theory | KV read compiled | KV compiled/theory |"
          "\n|---|---|---|---|---|---|---|")
    for name, s in rows(budgets, context):
        tb, xb = s.theory_bytes, s.xla.bytes + s.xla.uncosted_bytes
        kv, kvx = s.theory_parts["bytes"]["kv_read"], s.attribution.bytes["kv_read"]
        print(f"| {name} | {tb:,.0f} | {xb:,.0f} | {xb / tb:.3f} | {kv:,} | {kvx:,.0f} | "
              f"{kvx / kv:.3f} |")


def _print_overhead(context):
    print(f"\n| method | scoring overhead FLOP | overhead bytes | prefill FLOP "
          f"(t={context}, budget 512) | overhead share |\n|---|---|---|---|---|")
    for m, o in overhead_rows(context, 512):
        print(f"| {m} | {o['flops']:,.0f} | {o['bytes']:,.0f} | {o['prefill_flops']:,.0f} | "
              f"{o['flops'] / o['prefill_flops']:.3f} |")


def _print_timed(a):
    load0 = os.getloadavg()
    per, cases = timed(a.context, 512, a.rounds, a.methods.split(","), a.every_n,
                       a.page_size)
    load1 = os.getloadavg()
    base = per["full t=512"]
    ratio = {k: statistics.median(x / b for x, b in zip(v, base)) for k, v in per.items()}
    med = {k: statistics.median(v) for k, v in per.items()}
    print(f"\nload average (1, 5, 15 min) before {load0}, after {load1}")
    print(f"\n| generated token, budget 512 (median of {a.rounds} interleaved rounds) | "
          "ms | vs full t=512 (median of per-round ratios) |\n|---|---|---|")
    for k in per:
        print(f"| {k} | {med[k] * 1e3:.2f} | {ratio[k]:.3f} |")
    if "full paged t=512" in per:  # a paged step against the paged full read, same way
        ref = per["full paged t=512"]
        print(f"\n| paged decode step (P = {a.page_size}) | ms | vs full paged t=512 "
              "(median of per-round ratios) |\n|---|---|---|")
        for k, (c, _) in cases.items():
            if k in ("full paged t=512",) or c.kv_selects_pages:
                r = statistics.median(x / b for x, b in zip(per[k], ref))
                print(f"| {k} | {med[k] * 1e3:.2f} | {r:.3f} |")
    # the scoring overhead of every N: against the same method after prefill
    print(f"\n| scoring overhead per step, t={a.context} | measured ms (every N - after "
          "prefill) | theory B/step | theory ms at the after-prefill step's B/s | "
          "measured / theory |\n|---|---|---|---|---|")
    for k, (c, t) in cases.items():
        if c.kv_compression is None or c.compression.schedule != "every_n":
            continue
        pre = _case("uniform", "prefill")
        diff = statistics.median(x - y for x, y in zip(per[k], per[pre]))
        over = theory.schedule_overhead(c)
        bw = theory.step_bytes(cases[pre][0], t).total / med[pre]  # achieved B/s
        want = over["bytes_per_step"] / bw
        print(f"| {k} | {diff * 1e3:.3f} | {over['bytes_per_step']:,.0f} | "
              f"{want * 1e3:.3f} | {diff / want:.2f} |")


if __name__ == "__main__":
    main()
