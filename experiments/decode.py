r"""Decode real text with a real model and print what a decode step costs.

    python -m experiments.decode --config=configs/gqa.py
    python -m experiments.decode --config=configs/mqa.py --config.prompt="Once upon a time"
    python -m experiments.decode --config=configs/blog.py --config.dtype=float16 \
        --json_out=/tmp/blog.json

Prints the generated text, prefill and decode speed, the KV cache's bytes beside theory,
and the cost table (theory | XLA compiled, loop-corrected | measured) of one decode step.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from kvjax import cache as cache_lib
from kvjax.analysis import costs, theory
from kvjax.inference import runner
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict

_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/gqa.py", "Experiment config file (get_config()).", lock_config=True)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")


def report(result: runner.DecodeResult) -> str:
    """The human-readable report of one run."""
    s = result.step
    cfg = s.cfg
    per_token = theory.kv_bytes_per_token(cfg) * s.batch
    lines = [
        f"model: {cfg.name}  attention={cfg.attention}  N={cfg.num_heads} "
        f"K={cfg.num_kv_heads}  L={cfg.num_layers}  D={cfg.d_model}  dtype={cfg.dtype}  "
        f"window={cfg.window_size}  scan_layers={cfg.scan_layers}" + (
            "" if cfg.is_mla else
            f"  cache layout: k {cfg.cache_layout('k')}, v {cfg.cache_layout('v')}"),
        "",
        f"prompt: {result.prompt!r}",
        f"generated: {result.generated_text!r}",
        "",
        f"prompt tokens {result.prompt_tokens}, new tokens {result.new_tokens}; "
        f"compile {result.compile_seconds:.2f} s",
        f"prefill {result.prefill_tokens_per_s:,.1f} tokens/s; time to first token "
        f"{result.time_to_first_token_s * 1e3:.1f} ms; decode "
        f"{result.decode_tokens_per_s:,.2f} tokens/s",
        f"KV cache: {result.kv_cache_bytes:,} bytes allocated "
        f"(theory {result.kv_cache_bytes_theory:,} = {per_token:,} B/token x "
        f"{result.kv_cache_bytes_theory // per_token:,} slots)",
        "",
        f"one decode step at context {s.context} (cache of "
        f"{cache_lib.num_slots(cfg, s.context)} slots"
        + ("" if cfg.window_size is None else
           f": a ring of W={cfg.window_size}, {cfg.num_sink_tokens} sinks, reading "
           f"{theory.tokens_held(cfg, s.context)} keys") + "):",
        costs.cost_table(s, result.step_seconds_median),
        "",
        "where the step's compiled bytes go:",
        costs.attribution_table(s),
        "",
        f"the prefill of {result.prompt_tokens} tokens, attention {cfg.prefill_impl!r} "
        "(matrix-matrix; theory: causal attention FLOP, the LM head for the last token; "
        "bytes = weights + KV written + attention IO):",
        costs.cost_table(result.prefill_cost, result.prefill_seconds),
        prefill_theory_line(result.prefill_cost),
    ]
    if result.prefill_chunk_temp_bytes:
        lines.append("prefill in chunks of --config.prefill_chunk tokens: temp bytes per "
                     "chunk program " + ", ".join(
                         f"{x:,}" for x in result.prefill_chunk_temp_bytes)
                     + f" (one pass: {result.prefill_cost.memory.get('temp_bytes'):,})")
    return "\n".join(lines)


def prefill_theory_line(step) -> str:
    """The prefill's theory bytes by part, and XLA's temp (peak scratch) bytes."""
    p = step.theory_parts["bytes"]
    return (f"theory bytes: weights {p['weights']:,} + KV written {p['kv_write']:,} + "
            f"attention IO {p['attn_io']:,} (standard Θ(T·d + T²): "
            f"{p['attn_io_standard']:,}; tiled: {p['attn_io_tiled']:,}); XLA temp bytes "
            f"{step.memory.get('temp_bytes', float('nan')):,}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        run = run_config_from_dict(_CONFIG.value)
        loaded = runner.load(run)
        result = runner.run_decode(run, loaded)
    except (ConfigError, WeightsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if _JSON_OUT.value:
        with open(_JSON_OUT.value, "w") as f:
            json.dump(result.as_json(), f, indent=2)
        print(f"\nwrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    app.run(main)
