"""XLA's compiled FLOP and bytes of the decode step, the generate loop (per token) and the
prefill, for configs in configs/, with the reference ('xla') formulations pinned.

Deterministic on one jax/jaxlib: compare two commits' JSON files to check that a change
left the compiled programs alone (XLA cannot cost the native kernels, so they are pinned
off).

    PYTHONPATH=. python scripts/compiled_figures.py --out=/tmp/figures.json \
        --configs=gqa,mha,mqa,window,mla
    PYTHONPATH=. python scripts/compiled_figures.py --picks --context=2048 --prompt=256

Context 1,024, batch 1, a 64-token prompt into a 1,024-slot cache (``--context``,
``--prompt``). ``--picks``: the configs' own formulations ('auto': this machine's planner
picks, kernels counted as the cost hook counts them) instead of 'xla'. The loop's
figures are per generated token, and ``loop_once`` what it spends once per call
(:func:`kvjax.analysis.costs.analyze_loop`).
"""

from __future__ import annotations

import argparse
import importlib
import json

import jax

from kvjax.analysis import costs
from kvjax.config import run_config_from_dict

CONTEXT, PROMPT = 1024, 64


def figures(name: str, context: int = CONTEXT, prompt: int = PROMPT,
            picks: bool = False) -> dict:
    """{'step', 'loop', 'loop_once', 'prefill'}: [XLA FLOP, XLA bytes] of
    configs/<name>.py ('xla' formulations pinned unless ``picks``)."""
    run = run_config_from_dict(importlib.import_module(f"configs.{name}").get_config())
    cfg = run.model if picks else run.model.replace(decode_attention="xla",
                                                    weight_matmul="xla")
    step = costs.analyze_decode_step(cfg, context, 1, attribute=False, jaxpr=False)
    loop = costs.analyze_loop(cfg, context, 1, attribute=False)
    prefill = costs.analyze_prefill(cfg, prompt, context, 1)
    out = {k: [c.xla.flops, c.xla.bytes] for k, c in
           (("step", step), ("loop", loop), ("prefill", prefill))}
    out["loop_once"] = [loop.once_per_call["flops"], loop.once_per_call["bytes"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="gqa,mha,mqa,window,mla,blog_window,"
                    "deepseek_v2_lite")
    ap.add_argument("--out", default=None, help="JSON file to write (default: none)")
    ap.add_argument("--context", type=int, default=CONTEXT, help="cache slots")
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prefill tokens")
    ap.add_argument("--picks", action="store_true",
                    help="the configs' own formulations instead of 'xla'")
    a = ap.parse_args()
    out = {}
    for name in a.configs.split(","):
        out[name] = figures(name, a.context, a.prompt, a.picks)
        print(name, out[name], flush=True)
        jax.clear_caches()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
