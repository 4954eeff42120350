r"""Lever 5 on the paged engine counted by the compiler (issue 55 item 3): the paged decode
step of a compressed row (an evicting method, schedule 'prefill': its fixed kv_budget +
recent_slots slots on whole pages, decision 0041) at context t, compiled from
SmolLM2-135M's shapes (from shapes only: no weights, nothing allocated, nothing timed)
by :func:`kvjax.analysis.costs.analyze_paged_decode_step`, against theory at the budget
(:func:`kvjax.analysis.theory.step_bytes`, the dense compressed step's), and the
uncompressed paged step over the same W slots as a control. Also the rows a pool of
``--pool_gib`` holds (:func:`kvjax.analysis.paging.capacity`): compressed rows of W
slots against uncompressed rows of t tokens.

    PYTHONPATH=. python scripts/paged_compressed_costs.py      # snapkv, 512, P 16, t 8192
    PYTHONPATH=. python scripts/paged_compressed_costs.py --method tova --kv_dtypes int8

Compiled bytes are XLA's loop-corrected figures plus the kernels' ('+kernels': the
native kernel's block-table pages); 'K/V read' is the compiled bytes attributed to the
cache's reads. Formulations: 'xla' (the gathered view) for every cache dtype, 'native'
(the kernel reading the pages in place) for float32 caches where it is built. Prints
markdown tables for docs/results/<machine>.md.
"""

from __future__ import annotations

import argparse

from kvjax import native, presets
from kvjax.analysis import costs, paging, theory
from kvjax.plan import Plan


def configs(method: str, budget: int, kv_dtypes, formulations) -> list:
    """(kv_dtype, formulation, compressed config) of SmolLM2-135M (float32 weights), the
    native kernel planned where asked and it runs (float32 caches, the kernel built)."""
    out = []
    for kv in kv_dtypes:
        for name in formulations:
            if name == "native" and (kv != "float32" or not native.load()):
                continue
            cfg = presets.smollm2_135m("float32", scan_layers=None).replace(
                kv_compression=method, kv_budget=budget,
                kv_dtype=None if kv == "float32" else kv, decode_attention=name,
                plan=Plan(native=("decode_attention",)) if name == "native" else None)
            out.append((kv, name, cfg))
    return out


def _kv_read(r: dict) -> float:
    a = r["attribution"]
    return a["bytes"]["kv_read"] + a["uncosted"]["kv_read"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--page_size", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--kv_dtypes", default="float32,int8")
    ap.add_argument("--formulations", default="xla,native")
    ap.add_argument("--pool_gib", type=float, default=1.0)
    a = ap.parse_args()
    t, p = a.context, a.page_size
    cases = configs(a.method, a.budget, a.kv_dtypes.split(","), a.formulations.split(","))
    print("| cache | runs | step | t | pages per row | compiled (+kernels) MB | "
          "theory MB | compiled / theory | K/V read compiled MB | K/V read theory MB |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for kv, name, cfg in cases:
        w = cfg.cache_window
        full = cfg.replace(kv_compression=None, kv_budget=None)
        for label, c, ctx in ((f"{a.method}, budget {a.budget} + ring "
                               f"{cfg.compression.recent_slots}", cfg, t),
                              ("uncompressed, same slots", full, w)):
            r = costs.analyze_paged_decode_step(c, ctx, p)
            print(f"| {kv} | `{name}` | {label} | {ctx:,} | {r['row_pages']} | "
                  f"{r['counted_bytes'] / 1e6:.2f} | {r['theory_bytes'] / 1e6:.2f} | "
                  f"{r['counted_over_theory']:.3f} | {_kv_read(r) / 1e6:.3f} | "
                  f"{r['theory']['kv_read'] / 1e6:.3f} |", flush=True)
    print(f"\n| cache | rows of {a.pool_gib:g} GiB on pages of {p}: compressed (W slots) | "
          f"uncompressed (t = {t:,}) | ratio | theory step MB compressed / uncompressed |")
    print("|---|---:|---:|---:|---:|")
    for kv, name, cfg in cases:
        if name != cases[0][1]:
            continue
        full = cfg.replace(kv_compression=None, kv_budget=None)
        pool = a.pool_gib * 2**30
        comp = paging.capacity(cfg, pool, [t], t, p).paged
        plain = paging.capacity(full, pool, [t], t, p).paged
        sb = theory.step_bytes(cfg, t).total / theory.step_bytes(full, t).total
        print(f"| {kv} | {comp:,} | {plain:,} | {comp / max(plain, 1):.2f} | "
              f"{theory.step_bytes(cfg, t).total / 1e6:.2f} / "
              f"{theory.step_bytes(full, t).total / 1e6:.2f} ({sb:.3f}) |")


if __name__ == "__main__":
    main()
