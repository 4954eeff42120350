"""XLA's compiled FLOP and bytes of the decode step, the generate loop (per token) and the
prefill, for configs in configs/, with the reference ('xla') formulations pinned.

Deterministic on one jax/jaxlib: compare two commits' JSON files to check that a change
left the compiled programs alone (XLA cannot cost the native kernels, so they are pinned
off).

    PYTHONPATH=. python scripts/compiled_figures.py --out=/tmp/figures.json \
        --configs=gqa,mha,mqa,window,mla

Context 1,024, batch 1, a 64-token prompt into a 1,024-slot cache.
"""

from __future__ import annotations

import argparse
import importlib
import json

import jax

from kvjax.analysis import costs
from kvjax.config import run_config_from_dict

CONTEXT, PROMPT = 1024, 64


def figures(name: str) -> dict:
    """{'step', 'loop', 'prefill'}: [XLA FLOP, XLA bytes] of configs/<name>.py."""
    run = run_config_from_dict(importlib.import_module(f"configs.{name}").get_config())
    cfg = run.model.replace(decode_attention="xla", weight_matmul="xla")
    step = costs.analyze_decode_step(cfg, CONTEXT, 1, attribute=False, jaxpr=False)
    loop = costs.analyze_loop(cfg, CONTEXT, 1, attribute=False)
    prefill = costs.analyze_prefill(cfg, PROMPT, CONTEXT, 1)
    return {k: [c.xla.flops, c.xla.bytes] for k, c in
            (("step", step), ("loop", loop), ("prefill", prefill))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gqa,mha,mqa,window,mla,blog_window,"
                    "deepseek_v2_lite")
    ap.add_argument("--out", default=None, help="JSON file to write (default: none)")
    a = ap.parse_args()
    out = {}
    for name in a.configs.split(","):
        out[name] = figures(name)
        print(name, out[name], flush=True)
        jax.clear_caches()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
