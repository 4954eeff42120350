r"""KV bytes of per-layer windows (``model.layer_windows``): Gemma 3's 5:1 local/global
pattern against the same model with every layer global, by theory and by the cost hook.

    python scripts/layer_windows_bytes.py --t=32768 --batch=1

Gemma 3 1B's published text config (HF ``google/gemma-3-1b-it``): hidden 1152, 26
layers, 4 heads, 1 KV head, head_dim 256, intermediate 6912 (GeGLU), vocab 262,144,
sliding_window 512, every 6th layer global (layers 5, 11, 17, 23: 4 of 26), q/k norm,
tied. For each model the script prints theory's KV bytes per token of context at t
(kv_cache_bytes(t) / t; the per-layer sum), the cache bytes, and the decode step's
compiled bytes (XLA's cost analysis of ``decode.decode_step`` against a cache of t
slots, compiled from shapes only: nothing allocated) over theory's step bytes
(weights + per-layer KV read + write). ``--dtype=float32`` by default: on CPU a
bfloat16 step widens its weights to float32 (XLA bytes then exceed theory by the
widening, not the cache).
"""

from __future__ import annotations

import argparse
import sys

from kvjax.analysis import costs, theory
from kvjax.config import ModelConfig


def gemma3_1b(dtype: str, global_only: bool = False) -> ModelConfig:
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    return ModelConfig(
        name="gemma3-1b" + (" all-global" if global_only else " 5:1"), vocab_size=262144,
        num_layers=26, d_model=1152, num_heads=4, num_kv_heads=1, head_dim=256,
        mlp_dim=6912, mlp_type="geglu", rope_theta=1e6, norm_eps=1e-6, tie_embeddings=True,
        qk_norm=True, embed_scale=True, post_norms=True, query_pre_attn_scalar=256.0,
        rope_local_theta=1e4, layer_windows=None if global_only else windows,
        scan_layers=False, dtype=dtype)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--t", type=int, default=32768, help="context, tokens")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--no_compile", action="store_true", help="theory only")
    a = ap.parse_args(argv)
    for name, v in (("--t", a.t), ("--batch", a.batch)):
        if v < 1:
            sys.exit(f"{name}={v}; allowed: an integer >= 1")
    rows = []
    for cfg in (gemma3_1b(a.dtype), gemma3_1b(a.dtype, global_only=True)):
        row = dict(model=cfg.name, kv_per_context_token=theory.kv_bytes_per_context_token(
            cfg, a.t), cache=theory.kv_cache_bytes(cfg, a.t, a.batch))
        if not a.no_compile:
            step = costs.analyze_decode_step(cfg, a.t, a.batch, attribute=False, jaxpr=False)
            row.update(hook_cache=step.cache_bytes, xla=step.xla.bytes,
                       theory_step=step.theory_bytes, ratio=step.bytes_ratio)
        rows.append(row)
    print(f"t={a.t} batch={a.batch} dtype={a.dtype}")
    for r in rows:
        line = (f"{r['model']:24s} KV B/context token {r['kv_per_context_token']:10,.1f}  "
                f"cache {r['cache']:15,d} B")
        if "xla" in r:
            line += (f"  hook cache {r['hook_cache']:15,d} B  step XLA {r['xla']:17,.0f} B"
                     f"  theory {r['theory_step']:17,.0f} B  XLA/theory {r['ratio']:.3f}")
        print(line)
    print(f"all-global / 5:1 KV bytes: {rows[1]['cache'] / rows[0]['cache']:.2f}x")


if __name__ == "__main__":
    main()
