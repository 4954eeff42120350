r"""Lever 5 on MLA (latent slots) on DeepSeek-V2-Lite's attention shapes
(``configs/deepseek_v2_lite.py``: 2 layers, random weights; bytes do not depend on the
values): the allocated cache of a real prefill compressed to each budget against theory's
latent bytes at the budget and the uncompressed latent cache's, and the compiled decode
step's KV reads against theory at the budget (absorbed MLA under XLA reads c_kv twice,
once per contraction: :func:`kvjax.analysis.theory.mla_unfused_extra_bytes`).

    PYTHONPATH=. python scripts/mla_compression_bytes.py          # ~10 min, 2 cores
    PYTHONPATH=. python scripts/mla_compression_bytes.py --budgets 64 --kv_dtypes float32

Prints markdown tables for docs/results/<machine>.md.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import presets
from kvjax.analysis import costs, theory
from kvjax.cache import kv as cache_lib
from kvjax.config import ConfigError
from kvjax.inference import decode
from kvjax.models import model as model_lib


def v2_lite(kv_dtype: str, **fields):
    """DeepSeek-V2-Lite's attention, 2 layers, float32, SmolLM2's vocabulary, as
    configs/deepseek_v2_lite.py runs it (absorbed MLA, the planner's formulations)."""
    return presets.deepseek_v2_lite_attention(vocab_size=49152, dtype="float32").replace(
        kv_dtype=kv_dtype, decode_attention="auto", weight_matmul="auto", scan_layers=None,
        **fields)


def allocated_rows(methods, budgets, kv_dtypes, prompt_len: int, seed: int = 0) -> list:
    """(method, kv_dtype, budget, slots, allocated B, theory B, the uncompressed latent
    cache's theory B at the prompt) per case: a real prefill of ``prompt_len`` random
    tokens, compressed; theory at a context every layer's cache fills (PyramidKV's
    bottom layer may hold more slots than the prompt has tokens)."""
    params = model_lib.init_params(v2_lite("float32"), seed)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(3, 49152, (1, prompt_len)),
                         jnp.int32)
    rows = []
    for kv_dtype in kv_dtypes:
        for method in methods:
            for budget in budgets:
                cfg = v2_lite(kv_dtype, kv_compression=method, kv_budget=budget)
                cache = cache_lib.init_cache(cfg, 1, prompt_len)
                _, cache = decode.prefill(model_lib.params_for(cfg, params), cfg, tokens,
                                          cache)
                fills = max(prompt_len, *cache_lib.layer_num_slots(cfg, prompt_len))
                rows.append((method, kv_dtype, budget, cache.num_slots,
                             cache_lib.cache_bytes(cache), theory.kv_cache_bytes(cfg, fills),
                             theory.kv_cache_bytes(v2_lite(kv_dtype), prompt_len)))
    return rows


def step_rows(budgets, kv_dtypes, context: int) -> list:
    """(name, StepCost, theory's absorbed second c_kv read) of the compiled decode step
    at ``context``: SnapKV per budget, and the uncompressed latent cache."""
    rows = []
    for kv_dtype in kv_dtypes:
        cfgs = [(f"snapkv {b}, {kv_dtype}", v2_lite(kv_dtype, kv_compression="snapkv",
                                                    kv_budget=b)) for b in budgets]
        cfgs.append((f"uncompressed, {kv_dtype}", v2_lite(kv_dtype)))
        for name, cfg in cfgs:
            rows.append((name, costs.analyze_decode_step(cfg, context, jaxpr=False),
                         theory.mla_unfused_extra_bytes(cfg, context)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--kv_dtypes", default="float32,int8")
    ap.add_argument("--methods", default="snapkv,pyramidkv")
    ap.add_argument("--prompt", type=int, default=512,
                    help="prompt tokens of the allocated-bytes check")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--only", default="allocated,step", help="which tables to print")
    a = ap.parse_args()
    only = a.only.split(",")
    if any(o not in ("allocated", "step") for o in only):
        ap.error(f"--only={a.only}; allowed: a comma-separated subset of "
                 "['allocated', 'step']")
    for name in ("prompt", "context"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}={getattr(a, name)}; allowed: an integer >= 1")
    try:
        budgets = [int(b) for b in a.budgets.split(",")]
        kv_dtypes, methods = a.kv_dtypes.split(","), a.methods.split(",")
        for b in budgets:  # each case a valid config before any work (names the value)
            for kd in kv_dtypes:
                for m in methods:
                    v2_lite(kd, kv_compression=m, kv_budget=b)
    except (ValueError, ConfigError) as e:
        ap.error(f"--budgets={a.budgets} --kv_dtypes={a.kv_dtypes} --methods={a.methods}: "
                 f"{e}")
    print(f"device: {jax.devices()[0].device_kind}")
    if "allocated" in only:
        _print_allocated(a, methods, budgets, kv_dtypes)
    if "step" in only:
        _print_steps(a, budgets, kv_dtypes)


def _print_allocated(a, methods, budgets, kv_dtypes):
    print(f"\n| method | kv_dtype | budget | slots (smallest layer) | allocated B | theory B "
          f"at the budget | equal | uncompressed latent B (prompt {a.prompt}) | ratio |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for m, kd, b, s, got, want, full in allocated_rows(
            methods, [b for b in budgets if b <= a.prompt], kv_dtypes, a.prompt):
        print(f"| {m} | {kd} | {b} | {s} | {got:,} | {want:,} | {got == want} | {full:,} | "
              f"{full / got:.2f}x |")


def _print_steps(a, budgets, kv_dtypes):
    print(f"\n| decode step at t={a.context} | theory B | compiled B (+kernels) | "
          "compiled/theory | KV read theory | KV read compiled | KV compiled/theory | "
          "KV compiled/(theory + absorbed 2nd c_kv read) |\n|---|---|---|---|---|---|---|---|")
    for name, s, extra in step_rows(budgets, kv_dtypes, a.context):
        tb, xb = s.theory_bytes, s.xla.bytes + s.xla.uncosted_bytes
        kv, kvx = s.theory_parts["bytes"]["kv_read"], s.attribution.bytes["kv_read"]
        print(f"| {name} | {tb:,.0f} | {xb:,.0f} | {xb / tb:.3f} | {kv:,} | {kvx:,.0f} | "
              f"{kvx / kv:.3f} | {kvx / (kv + extra):.3f} |")


if __name__ == "__main__":
    main()
