r"""Decode real text with a real model and print what a decode step costs.

    python -m experiments.decode --config=configs/gqa.py
    python -m experiments.decode --config=configs/mqa.py --config.prompt="Once upon a time"
    python -m experiments.decode --config=configs/blog.py --config.dtype=float16 \
        --json_out=/tmp/blog.json

Prints the generated text, prefill and decode speed, the KV cache's bytes beside theory,
and the cost table (theory | XLA compiled, loop-corrected | measured) of one decode step.
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import cli

from kvjax import cache as cache_lib
from kvjax import naming
from kvjax.analysis import costs, theory
from kvjax.inference import runner
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Experiment config file (get_config())."), lock_config=True)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


def report(result: runner.DecodeResult) -> str:
    """The human-readable report of one run."""
    s = result.step
    cfg = s.cfg
    per_token = theory.kv_bytes_per_token(cfg) * s.batch
    lines = [
        f"model: {naming.variant_name(cfg)}  attention={cfg.attention}  N={cfg.num_heads} "
        f"K={cfg.num_kv_heads}  L={cfg.num_layers}  D={cfg.d_model}  dtype={cfg.dtype}  "
        f"window={cfg.window_size}  scan_layers={cfg.scan_layers}" + (
            "" if cfg.is_mla else
            f"  cache layout: k {cfg.cache_layout('k')}, v {cfg.cache_layout('v')}"),
        "",
        f"prompt: {naming.shorten(result.prompt)}",
        f"generated: {result.generated_text!r}",
        "",
        f"prompt tokens {result.prompt_tokens}, new tokens {result.new_tokens}; "
        f"compile {result.compile_seconds:.2f} s",
        f"prefill {result.prefill_tokens_per_s:,.1f} tokens/s; time to first token "
        f"{result.time_to_first_token_s * 1e3:.1f} ms; decode "
        f"{result.decode_tokens_per_s:,.2f} tokens/s",
        f"KV cache: {result.kv_cache_bytes:,} bytes allocated for the batch of {s.batch} "
        f"({result.kv_cache_bytes // s.batch:,} per sequence; theory "
        f"{result.kv_cache_bytes_theory:,} = {per_token:,} B/token x "
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
        f"the prefill of {result.prompt_tokens} tokens (matrix-matrix; theory counts causal "
        "attention, kvjax attends over all cache slots, masked):",
        costs.cost_table(result.prefill_cost, result.prefill_seconds),
    ]
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        run = run_config_from_dict(_CONFIG.value)
        cli.check_output_file(_JSON_OUT.value, "json_out")
        loaded = runner.load(run)
        result = runner.run_decode(run, loaded)
    except (ConfigError, WeightsError, cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if _JSON_OUT.value:
        cli.write_json(_JSON_OUT.value, result.as_json())
        print(f"\nwrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
