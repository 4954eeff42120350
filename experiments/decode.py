r"""Decode real text with a real model and print what a decode step costs.

    python -m experiments.decode --config=configs/gqa.py
    python -m experiments.decode --config=configs/gqa.py --config.prompt="What is the capital of France?"
    python -m experiments.decode --config=configs/gqa.py --config.chat_template=False   # raw completion
    python -m experiments.decode --config=configs/mqa.py --config.prompt="Once upon a time"
    python -m experiments.decode --config=configs/blog.py --config.dtype=float16 \
        --json_out=/tmp/blog.json
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
        python -m experiments.decode --config=configs/gqa.py --config.mesh.model=3

With a mesh (``--config.mesh.data/model/seq``; at most the device count, a smaller one
uses the first devices and says so) the parameters and the cache are laid out on it
(kvjax/parallel) and the report is per device: theory | XLA | measured for one sharded
step and the collectives by kind, bytes and mesh axis. ``--config.distributed.*`` joins
``jax.distributed`` first (several processes).

Prints the generated text, prefill and decode speed, the KV cache's bytes beside theory,
and the cost table (theory | XLA compiled, loop-corrected | measured) of one decode step.
"""

from __future__ import annotations

import sys

from absl import app, flags

from experiments import cli

from kvjax import cache as cache_lib
from kvjax import naming, planner
from kvjax.analysis import report as report_lib
from kvjax.analysis import costs, theory
from kvjax.analysis import speculative as spec_theory
from kvjax.inference import memory, runner, speculative
from kvjax.models import flash
from kvjax.checkpoints import WeightsError
from kvjax.config import (ConfigError, SpeculativeConfig, distributed_config,
                          run_config_from_dict)
from kvjax.parallel.collectives import CacheGatherError
from kvjax.parallel import distributed

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Experiment config file (get_config())."), lock_config=True)
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
# --help lists the config flags (defined through cli) with this module's own.
flags.adopt_module_key_flags(cli)


def _loop_timing_line(timing: dict) -> str:
    """How the loop's per-token time was measured. The fixed cost is estimated as
    t(n1) - n1 x per-token time, a difference of two noisy medians: when it comes out
    negative it is below the timing noise and no figure is printed for it (a negative
    cost is not a cost; the JSON keeps the raw estimate, ``call_overhead_s``)."""
    n1, n2 = timing["steps"]
    fixed = timing["call_overhead_s"]
    head = f"(measured inside the loop: {n2} minus {n1} steps, so the call's fixed cost"
    if fixed >= 0:
        return f"{head}, {fixed * 1e3:.1f} ms, cancels)"
    return (f"{head} cancels; it is too small to estimate here: below the timing noise "
            "of the two loop lengths)")


def report(result: runner.DecodeResult) -> str:
    """The human-readable report of one run: the generation, then each section of the
    cost report the run has (its figures not None): on one device the generate loop's
    figures first (the program that decodes), the single step second, then the prefill
    and the long context; on a mesh the sharded step per device and the collectives of
    the programs the run decoded with."""
    c = result.costs
    return "\n".join([*_generation_lines(result, c.step.cfg, c.step.batch),
                      *_mesh_lines(result), *_speculative_lines(result, c.step.cfg, c),
                      *_loop_lines(result)])


def _loop_lines(result: runner.DecodeResult) -> list:
    """The generate loop, the single step, the prefill and the long context (one device;
    empty on a mesh, whose report has none of them)."""
    c, g = result.costs, result.generation
    loop, s = c.loop, c.step
    if loop is None:
        return []
    cfg = s.cfg
    policy = cache_lib.policy_for(cfg)
    lines = [
        "",
        "the generate loop, "
        + ("per generated token" if s.batch == 1 else
           f"per step (one token for each of the B = {s.batch} rows)")
        + f", at context {s.context} (cache of "
        f"{cache_lib.num_slots(cfg, s.context)} slots"
        + ("" if policy.kind != "ring" else
           f": a ring of W={cfg.window_size}, {cfg.num_sink_tokens} sinks, reading "
           f"{theory.tokens_held(cfg, s.context)} keys") + "):",
        report_lib.cost_table(loop, c.loop_seconds_per_token),
        _loop_timing_line(c.loop_timing),
        _loop_memory(loop),
        "",
        "where the loop's compiled bytes per " + ("token" if s.batch == 1 else "step") + " go:",
        report_lib.attribution_table(loop),
        "",
        "one decode step compiled on its own and called from Python (second view):",
        report_lib.cost_table(s, c.step_seconds_median),
        _why_they_differ(c),
        "",
        f"the prefill of {g.prompt_tokens} tokens, attention {cfg.prefill_impl!r} "
        f"(runs {flash.prefill_path(cfg)!r}) "
        "(matrix-matrix; theory: causal attention FLOP, the LM head for the last token; "
        "bytes = weights + KV written + attention IO):",
        report_lib.cost_table(c.prefill, g.prefill_seconds),
        prefill_theory_line(c.prefill),
    ]
    if g.prefill_chunk_temp_bytes:
        lines.append("prefill in chunks of --config.prefill_chunk tokens: temp bytes per "
                     "chunk program " + ", ".join(
                         f"{x:,}" for x in g.prefill_chunk_temp_bytes)
                     + f" (one pass: {c.prefill.memory.get('temp_bytes'):,})")
    return lines + ["", *long_context_lines(c)]


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f} MB"


def _ms(x: float) -> str:
    return "not measured" if x != x else f"{x * 1e3:.1f} ms"


def long_context_lines(c) -> list:
    """The blog's claim on this run's model: a step at the run's context beside a step at
    a long context (theory | compiled | measured), the KV share of the step's bytes at
    both, where t* lies, and the config's lever against its baseline there."""
    s, lc = c.step, c.long_context
    t_star = theory.crossover_context(s.cfg)
    share = runner.kv_share(s.theory_parts["bytes"])
    held = "compressed" if s.cfg.kv_compression else "window's"
    star = (f"never: the {held} cache stays below the weights" if t_star == float("inf")
            else f"t* = {t_star:,.0f} tokens")
    head = (f"the bottleneck (blog 'The crossover'): the KV cache is {share:.1%} of a "
            f"step's bytes at the run's context t = {s.context:,} (compiled: "
            f"{runner.compiled_kv_share(s):.1%}); it outweighs the weights from {star} "
            "(weight bytes / KV bytes per token)")
    if lc is None:
        return [head, f"  (no long context: the run's context is --config.cost_context; "
                      "set it to another t for a second one)"]
    this = lc.this
    lines = [
        head,
        f"a decode step at the long context t = {lc.context:,} ({lc.source}"
        + ("" if lc.source.startswith("--") else "; --config.cost_context=N for another")
        + f"): theory {_mb(this.theory_bytes)}, compiled "
        f"(XLA + kernels) {_mb(this.counted_bytes)} "
        f"({this.counted_bytes / this.theory_bytes:.2f}x theory), "
        + ("not measured" if this.seconds != this.seconds else
           f"measured {_ms(this.seconds)} per step (one call from Python, full cache)")
        + f" against {_ms(c.step_seconds_median)} at t = {s.context:,}; KV share of the step's bytes "
        f"{this.kv_share:.1%} (compiled {this.compiled_kv_share:.1%}); t = {lc.context:,} "
        + ("is past t*" if lc.context > t_star else "is below t*"),
    ]
    if this.not_measured:
        lines.append(f"  not measured at t = {lc.context:,}: {this.not_measured}")
    if lc.baseline is None:
        lines.append("lever: none measured (" + (
            "MLA, lever 2, has no MHA of the same weights to compare with"
            if s.cfg.is_mla else "this is MHA, the baseline the levers are measured "
            "against: configs/gqa.py and configs/mqa.py show lever 1") + ")")
        return lines
    b = lc.baseline
    lines.append(
        f"{lc.lever} ({lc.baseline_name}) at t = {lc.context:,}: theory "
        f"{_mb(b.theory_bytes)} against {_mb(this.theory_bytes)} "
        f"({b.theory_bytes / this.theory_bytes:.2f}x), compiled {_mb(b.counted_bytes)} "
        f"against {_mb(this.counted_bytes)} ({b.counted_bytes / this.counted_bytes:.2f}x), "
        f"measured {_ms(b.seconds)} against {_ms(this.seconds)} per step "
        f"(the baseline's time over the lever's: {b.seconds / this.seconds:.2f}x)")
    return lines


def _speculative_lines(result: runner.DecodeResult, cfg, c) -> list:
    """The speculative section: acceptance, tokens per verify step, time and bytes per
    emitted token, beside the theory at the measured acceptance rate
    (:mod:`kvjax.analysis.speculative`). Empty for plain decoding."""
    g = result.generation
    sp = g.speculative
    if not sp:
        return []
    k, a = sp["k"], sp["acceptance_rate"]
    t = g.prompt_tokens + g.new_tokens // 2  # the run's mean context
    bw = c.step.theory_bytes / c.step_seconds_median  # the plain step's achieved B/s
    dcfg, copy_slots, dweights = None, 0, None
    if sp["drafter"] == "self":  # the draft as the run built it
        spec = SpeculativeConfig(**sp["config"])
        dcfg = speculative.draft_config(cfg.replace(plan=None), spec)
        copy_slots, dweights = speculative.drafter_for(spec, dcfg).costs(
            in_place=sp["draft_in_place"])
    r = spec_theory.round_times(cfg, t, k, bw, draft_cfg=dcfg, batch=c.step.batch,
                                copy_slots=copy_slots, draft_weights=dweights)
    plain_s = c.loop_seconds_per_token
    spec_s = sp["seconds_per_emitted_token"]
    return [
        "",
        f"speculative decoding (drafter {sp['drafter']!r}"
        + (f", draft model {sp['draft_model']}" if sp["draft_model"] else "")
        + f", k = {k}): {sum(sp['rounds'])} verify steps, {sum(sp['accepted'])} of "
        f"{sum(sp['proposed'])} drafts accepted (a = {a:.2f}), "
        f"{sp['tokens_per_step']:.2f} tokens per verify step (theory E(a, k) = "
        f"{spec_theory.expected_tokens(a, k):.2f} if drafts were accepted independently)",
        f"  time per emitted token {spec_s * 1e3:.2f} ms (the whole compiled loop: drafting, "
        f"verifying, taking back) against the plain loop's {plain_s * 1e3:.2f} ms at "
        f"context {c.loop.context}: {plain_s / spec_s:.2f}x",
        f"  theory at the run's mean context t = {t}, at the plain step's achieved "
        f"{bw / 1e9:.1f} GB/s: a verify step moves {r.verify_bytes:,} bytes (weights and "
        f"KV once, k + 1 positions written) against a plain step's {r.plain_bytes:,}"
        + (f", a draft step {r.draft_bytes:,}" if r.draft_bytes else "")
        + (f", the round's window copy {r.copy_bytes:,}" if r.copy_bytes else "")
        + f"; {r.bytes_per_emitted_token(a):,.0f} bytes per emitted token; predicted "
        f"speedup {spec_theory.expected_tokens(a, k) * r.plain_s / r.round_s:.2f}x "
        "(memory-bound roofline: the verify step's k + 1 times the FLOPs are assumed "
        "hidden under its bytes)",
    ]


def _generation_lines(result: runner.DecodeResult, cfg, batch: int) -> list:
    """The model, the prompt, the text and the speeds of a run (on a mesh, the note of
    the devices it uses first)."""
    g, per_token = result.generation, theory.kv_bytes_per_token(cfg) * batch
    on_mesh = result.costs.per_device and planner.report_lines()
    return [
        *([g.mesh_note] if g.mesh_note else []),
        f"model: {naming.variant_name(cfg)}  attention={cfg.attention}  N={cfg.num_heads} "
        f"K={cfg.num_kv_heads}  L={cfg.num_layers}  D={cfg.d_model}  dtype={cfg.dtype}  "
        f"kv_dtype={cfg.kv_dtype or cfg.dtype}  window={cfg.window_size}  "
        f"scan_layers={cfg.scan_layers}  backend={cfg.backend}" + (
            "" if cfg.is_mla else
            f"  cache layout: k {cfg.cache_layout('k')}, v {cfg.cache_layout('v')}"),
        f"formulations: decode_attention={cfg.decode_attention!r}  "
        f"weight_matmul={cfg.weight_matmul!r}",
        # 'auto' resolves to 'xla' inside the sharded programs (a custom call XLA cannot
        # partition); picks listed below were made for programs traced off the mesh
        *(["  (on this mesh the sharded programs use 'xla' for both; planner picks below "
           "are those of single-device programs)"] if on_mesh else []),
        *(cfg.plan.lines() if cfg.plan is not None else
          ["plan: none (the reference formulations)"]),
        *planner.report_lines(),
        "",
        f"prompt: {naming.shorten(g.prompt)}"
        + ("  (the checkpoint's chat template; --config.chat_template=False for raw "
           "completion)" if g.chat_template else ""),
        f"generated: {g.generated_text!r}",
        "stopped: " + ({"eos": f"end of generation at {g.stop_token_text!r} (id "
                                f"{g.stop_token})",
                        "nonfinite": f"non-finite logits at new token {g.nonfinite_at}"
                        }.get(g.stop_reason, "the token budget (max_new_tokens)")),
        *(f"warning: {w}" for w in g.warnings),
        "",
        f"prompt tokens {g.prompt_tokens}, new tokens {g.new_tokens}; "
        f"compile {g.compile_seconds:.2f} s",
        f"prefill {g.prefill_tokens_per_s:,.1f} tokens/s; time to first token "
        f"{g.time_to_first_token_s * 1e3:.1f} ms; decode "
        f"{g.decode_tokens_per_s:,.2f} tokens/s end to end (the wall time of one "
        f"call of the compiled loop, {g.loop_steps} steps x B={batch}, its fixed cost "
        "included; the loop's own time per token, fixed cost cancelled, is below)",
        f"KV cache: {g.kv_cache_bytes:,} bytes allocated for the batch of {batch} "
        f"({g.kv_cache_bytes // batch:,} per sequence; theory "
        f"{g.kv_cache_bytes_theory:,} = {per_token:,} B/token x "
        f"{g.kv_cache_bytes_theory // per_token:,} slots)",
        "KV cache tensors as allocated: " + ", ".join(
            f"{n} {dt} {nb:,} B" for n, (dt, nb) in g.kv_cache_tensors.items()),
    ]


def _mesh_lines(result: runner.DecodeResult) -> list:
    """On a mesh: the cache per device, the per-device cost of one sharded decode step
    (theory | XLA per device | measured) with its collectives, and the collectives of
    the prefill and generate programs the run used; empty on one device."""
    from kvjax.parallel import costs as pcosts  # noqa: PLC0415
    c, g = result.costs, result.generation
    st = c.step
    if not c.per_device:
        return []
    lines = [
        f"KV cache per device: {g.kv_cache_bytes_per_device:,} bytes of "
        f"{g.kv_cache_bytes:,} (1/{g.kv_cache_bytes / max(g.kv_cache_bytes_per_device, 1):.0f})",
        "",
        pcosts.format_report(st),
        f"  measured per device: {c.step_seconds_median * 1e3:.2f} ms per step (median of "
        f"the sharded step on a full cache); theory bytes / time = "
        f"{st.theory_bytes_dev / c.step_seconds_median / 1e9:.2f} GB/s per device",
        "",
        "the programs the run decoded with (collectives kind @ mesh axes: count, payload):",
    ]
    for name, prog in c.programs.items():
        inv = ", ".join(f"{k} x{v['count']} {v['bytes'] / 1e3:,.1f} KB"
                        for k, v in sorted(prog["inventory"].items())) or "none"
        lines.append(f"  {name}: {inv}; cache tensors all-gathered / all-to-all'd: "
                     f"{prog['cache_gathers'] or 'none'}")
    return lines


def _loop_memory(loop) -> str:
    m = loop.memory
    return ("loop program memory (memory_analysis, bytes): "
            + ", ".join(f"{k.replace('_bytes', '')} {m[k]:,.0f}" for k in
                        ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")
                        if m.get(k) is not None))


def _why_they_differ(c) -> str:
    """One line on why the loop's and the single step's figures differ, when they do."""
    loop, s = c.loop, c.step
    reasons = []
    # with the kernels' operand and result bytes (custom calls XLA does not cost)
    byte_ratio = ((s.xla.bytes + s.xla.uncosted_bytes)
                  / (loop.xla.bytes + loop.xla.uncosted_bytes))
    if abs(byte_ratio - 1) > 0.02:
        widened = "bytes_widened" in loop.theory_parts  # costs.analyze_loop decides it
        reasons.append(
            f"the single step's compiled bytes are {byte_ratio:.2f}x the loop's per token: "
            f"the loop does {loop.once_per_call['bytes']:,.0f} bytes of loop-invariant work "
            "once per call" + (" (the weights widened to float32 before the loop)"
                               if widened else "") + " that the single step repeats "
            "every call")
    time_ratio = c.step_seconds_median / c.loop_seconds_per_token
    if abs(time_ratio - 1) > 0.10:
        reasons.append(f"the single step takes {time_ratio:.2f}x the loop's time per token "
                       "(its own compiled program, dispatched from Python every step)")
    return ("loop vs single step: " + "; ".join(reasons)) if reasons else \
        "loop vs single step: same bytes (within 2%) and time (within 10%)"


def prefill_theory_line(step) -> str:
    """The prefill's theory bytes by part, and XLA's temp (peak scratch) bytes."""
    p = step.theory_parts["bytes"]
    return (f"theory bytes: weights {p['weights']:,} + KV written {p['kv_write']:,} + "
            f"attention IO {p['attn_io']:,} (standard Θ(T·d + T²): "
            f"{p['attn_io_standard']:,}; tiled: {p['attn_io_tiled']:,}); XLA temp bytes "
            f"{step.memory.get('temp_bytes', float('nan')):,}" + _custom_call_line(step)
            + ("" if not p.get("activations_unfused") else
               f"\nnot in theory: activations of an unfused layer stack (every product's "
               f"input and output rows once, theory.prefill_activation_bytes) "
               f"{p['activations_unfused']:,}; XLA(+kernel) / (weights + KV written + that) "
               f"= {costs.prefill_bytes_over_activations(step):.2f}"))


def _custom_call_line(step) -> str:
    """For a prefill with custom calls (the native prompt attention, the native weight
    products: XLA's cost analysis cannot see them): the figures with the kernels counted,
    each part labelled by where it comes from."""
    cc = step.theory_parts.get("custom_call")
    if not cc:
        return ""
    flops, nbytes = costs.prefill_with_kernel(step)
    parts = []
    if cc.get("flops_kernels"):
        parts.append(f"the weight products' {cc['flops_kernels']:,.0f} from their shapes")
    if cc.get("flops_attention_theory"):
        parts.append(f"the prompt attention's causal {cc['flops_attention_theory']:,.0f} "
                     "by theory")
    return (f"\ncustom calls {', '.join(cc['targets'])} (not costed by XLA): + their operand "
            f"and result bytes {cc['operand_result_bytes']:,.0f} and FLOP "
            f"({' + '.join(parts) or 'none known'}) -> FLOP {flops:,.0f} "
            f"({flops / step.theory_flops:.2f}x theory), bytes {nbytes:,.0f} "
            f"({nbytes / step.theory_bytes:.2f}x theory)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        # jax.distributed (and the CPU device count) before anything starts a backend
        distributed.initialize(distributed_config(_CONFIG.value))
        run = run_config_from_dict(_CONFIG.value)
        memory.check_run(run, weights_loaded=False)
        runner.check_mesh(run)
        cli.check_output_file(_JSON_OUT.value, "json_out")
        loaded = runner.load(run, check_prompt=True)  # refuses before the weights load
        result = runner.run_decode(run, loaded)
    except (ConfigError, WeightsError, cli.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CacheGatherError as e:  # the mesh programs moved the cache: a defect, loudly
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(report(result))
    for w in result.generation.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if _JSON_OUT.value:
        cli.write_json(_JSON_OUT.value, result.as_json())
        print(f"\nwrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
