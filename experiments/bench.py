r"""Decode measured against the memory-bandwidth roofline, and against peers.

    python -m experiments.bench                      # blog model + SmolLM2 shapes, CPU
    python -m experiments.bench --quick              # fewer contexts, fewer repeats
    python -m experiments.bench --models=blog --variants=mha,gqa,mqa --contexts=32768 \
        --peers=flax,torch --dtype=float32
    python -m experiments.bench --gpu_check          # the prepared GPU check (bf16, H200)

For each model x variant x context: the median decode-step time (one warm-up, then
``--repeats`` steps, ``block_until_ready``); theory bytes per step (the blog's B_step at a
full cache of ``context`` slots); achieved bytes/s = theory bytes / time, and its fraction
of the roofline: on CPU, paired per step (each timed step follows one timed 256 MiB read
by the fastest probe kernel, and the fraction is the median of the per-step ratios,
since a shared host's bandwidth drifts between ~20 and ~55 GB/s within seconds); on a
known GPU, the published HBM bandwidth. Then: GQA and MQA speedups over MHA against
theory's byte ratio (also timed interleaved at t = 32K: the two variants' steps back to
back, so host drift cancels in each ratio); the window's flatness in context (step time
at the longest context over the shortest, also interleaved); the
measured crossover context (a robust Theil-Sen fit of time = a + b·t, t* = a/b) against
theory; peers at the same shapes (llama.cpp timed in the same rounds as kvjax's step,
``--repeats`` rounds of ``--peer_block`` back-to-back steps each after
``--peer_settle`` untimed ones: the median of the rounds' tokens/s ratios and the rounds
kvjax won). Prints tables, writes JSON and a PNG plot.

SmolLM2 is benchmarked with its shapes and random weights (timing does not depend on the
values, and random weights skip the 4 s GGUF read).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable

from absl import flags
import numpy as np

from experiments import cli, peers
from kvjax.cache import compress as compress_lib
from kvjax import kernels, presets
from kvjax.analysis import costs, hardware, theory
from kvjax.models import model
from kvjax.config import ConfigError, ModelConfig, default_scan_layers

_MODELS = flags.DEFINE_list("models", ["blog", "smollm2"], "blog and/or smollm2.")
_VARIANTS = flags.DEFINE_list("variants", ["mha", "gqa", "mqa", "window"],
                              "mha, gqa (blog: K=2; SmolLM2: K=3), mqa, window (W=512 on gqa).")
_CONTEXTS = flags.DEFINE_list("contexts", ["1024", "4096", "16384", "32768", "65536"],
                              "Cache lengths (tokens).")
_DTYPE = flags.DEFINE_string("dtype", "float32", "float32 | bfloat16 | float16.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed steps per point (median reported); "
                                "rounds of the interleaved ratios and of llama.cpp.")
_PEERS = flags.DEFINE_list("peers", ["flax", "torch"],
                           "Peers to time: flax, torch (blog MHA shapes), llamacpp (SmolLM2 "
                           "GGUF vs kvjax SmolLM2 GQA, contexts <= 8192).")
_PEER_CONTEXTS = flags.DEFINE_list("peer_contexts", ["4096", "32768"], "Peer contexts.")
_PEER_BLOCK = flags.DEFINE_integer(
    "peer_block", 3, "llama.cpp rows: timed steps of each runtime per round, back to back "
    "(their median is the round's time).", lower_bound=1)
_PEER_SETTLE = flags.DEFINE_integer(
    "peer_settle", 1, "llama.cpp rows: untimed steps of each runtime before its timed ones "
    "in every round (0: each timed step may follow the other runtime's).", lower_bound=0)
_SCAN = flags.DEFINE_enum("scan_layers", "auto", ["auto", "true", "false", "both"],
                          "Layer stack mode; 'both' times each.")
_OUT = flags.DEFINE_string("out_dir", "results/bench", "Where JSON and PNG go.")
_QUICK = flags.DEFINE_bool("quick", False, "Contexts 1K/16K/32K, 3 repeats, blog only.")
_GPU_CHECK = flags.DEFINE_bool(
    "gpu_check", False, "The prepared GPU check: bf16, blog model MHA/GQA/MQA and SmolLM2 "
    "GQA at 4K/32K/128K, both layer-stack modes, no peers.")
_MAX_CACHE_BYTES = flags.DEFINE_float("max_cache_gb", 8.0, "Skip points whose cache exceeds this.")
_DECODE_ATTENTION = flags.DEFINE_enum(
    "decode_attention", "auto", list(kernels.names("decode_attention")),
    "model.decode_attention of every point: 'auto' (default) measures the formulations on "
    "this machine once per shape class (kvjax.planner) and keeps the fastest; the picks "
    "and their GB/s are printed at the end.")
_WEIGHT_MATMUL = flags.DEFINE_enum(
    "weight_matmul", "auto", list(kernels.names("weight_matmul")),
    "model.weight_matmul of every point: 'auto' (default, like configs/) measures XLA's dot "
    "and the native few-row kernel once per product class and keeps the faster.")


MODELS = ("blog", "smollm2")
VARIANTS = ("mha", "gqa", "mqa", "window")
PEERS = ("flax", "torch", "llamacpp")


def variant_cfg(model_name: str, variant: str, dtype: str, scan_layers: bool) -> ModelConfig:
    """The config for one benchmark point: ``model_name`` in :data:`MODELS`, ``variant``
    in :data:`VARIANTS`.

    Raises:
      ConfigError: another model or variant (naming it and the allowed ones), or a config
        the dtype or the forced formulations make invalid.
    """
    for what, given, allowed in (("model", model_name, MODELS), ("variant", variant, VARIANTS)):
        if given not in allowed:
            raise ConfigError(f"{what}={given!r}; allowed: {', '.join(allowed)}")
    base = (presets.blog_model(dtype=dtype, vocab_size=49152) if model_name == "blog"
            else presets.smollm2_135m(dtype=dtype)).replace(scan_layers=scan_layers)
    if flags.FLAGS.is_parsed():  # the flag (tests may call this without parsing)
        base = base.replace(decode_attention=_DECODE_ATTENTION.value,
                            weight_matmul=_WEIGHT_MATMUL.value)
    k = {"mha": base.num_heads, "gqa": 2 if model_name == "blog" else 3, "mqa": 1,
         "window": 2 if model_name == "blog" else 3}[variant]
    return presets.variant(base, num_kv_heads=k,
                           window_size=512 if variant == "window" else None,
                           name=f"{model_name}-{variant}")


def time_point(cfg: ModelConfig, context: int, repeats: int,
               probe: hardware.ReadProbe | None = None) -> tuple[float, float | None, float | None]:
    """One decode step with a full cache of ``context`` slots, timed ``repeats`` times.

    Returns (median seconds, median probed read bandwidth in bytes/s, median over repeats
    of achieved/probed bandwidth). With a ``probe``, every step follows one timed read of
    the probe's buffer, so each step's achieved bandwidth (theory bytes / seconds) is
    divided by the bandwidth the host gave a moment before; without one, the last two
    are None.
    """
    roofs: list[float] = []
    before = (lambda: roofs.append(probe.once())) if probe is not None else None
    times = costs.measure_decode_step(cfg, context, 1, repeats, budget_s=None,
                                      before_step=before)
    if probe is None:
        return statistics.median(times), None, None
    roofs = roofs[-len(times):]  # drop the warm-ups' probes
    step_bytes = theory.step_bytes(cfg, context).total
    fraction = statistics.median(step_bytes / t / r for t, r in zip(times, roofs))
    return statistics.median(times), statistics.median(roofs), fraction


def step_runner(cfg: ModelConfig, context: int) -> Callable[[], float]:
    """A function that runs one decode step of ``cfg`` over a full cache of ``context``
    slots and returns its wall seconds (:func:`kvjax.analysis.costs.step_timer`: random
    weights, compiled here once, every call the same step), the plan resolved for that
    context first (:func:`kvjax.analysis.costs.planned`), so a forced formulation runs as
    in :func:`time_point`."""
    cfg = costs.planned(cfg, 1, context)
    return costs.step_timer(cfg, model.init_params(cfg, 0),
                            compress_lib.full_cache(cfg, 1, context))


def interleaved_rounds(arms: dict[str, Callable[[], float]], rounds: int, warmup: int = 1,
                       before_round: Callable[[], object] | None = None, block: int = 1,
                       settle: int = 0) -> dict[str, list[float]]:
    """Seconds of each arm (a function that times one step and returns its seconds) in
    ``rounds`` rounds after ``warmup`` untimed ones: each round runs every arm's block in
    turn, the order rotated by one from round to round (each arm first in every
    len(arms)-th round), so a shared host's drift falls on all arms alike; a block is
    ``settle`` untimed calls, then ``block`` timed ones, whose median is the arm's
    seconds for the round. With ``settle`` >= 1 every timed call follows a call of its
    own arm, as a decode step follows a step: what the previous arm left behind (another
    runtime's threads still polling for work) falls on the untimed call
    (docs/decisions/0050-peer-rounds-time-back-to-back-steps.md). ``before_round()``
    runs before each timed round (e.g. a bandwidth probe).
    Returns {arm: [seconds of round 1, ..., round ``rounds``]}.

    Raises:
      ValueError: no arms, ``rounds`` or ``block`` < 1, or ``warmup`` or ``settle`` < 0.
    """
    if not arms or rounds < 1 or warmup < 0 or block < 1 or settle < 0:
        raise ValueError(f"arms={list(arms)}, rounds={rounds}, warmup={warmup}, "
                         f"block={block}, settle={settle}; allowed: at least one arm, "
                         "rounds >= 1, warmup >= 0, block >= 1, settle >= 0")
    names = list(arms)
    out: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + rounds):
        if i >= warmup and before_round is not None:
            before_round()
        k = i % len(names)
        for n in names[k:] + names[:k]:
            for _ in range(settle):
                arms[n]()
            seconds = statistics.median([arms[n]() for _ in range(block)])
            if i >= warmup:
                out[n].append(seconds)
    return out


def interleaved_ratio(a: tuple[ModelConfig, int], b: tuple[ModelConfig, int],
                      repeats: int) -> float:
    """Median over ``repeats`` rounds of step time of ``a`` / step time of ``b`` (each a
    config and a context; :func:`step_runner`), timed in turns
    (:func:`interleaved_rounds`, two warm-up rounds), so drift of the shared host cancels
    in each ratio."""
    times = interleaved_rounds({"a": step_runner(*a), "b": step_runner(*b)}, repeats,
                               warmup=2)
    return statistics.median(x / y for x, y in zip(times["a"], times["b"]))


def llamacpp_rows(contexts, dtype, scan, repeats, probe, chip, block: int = 3,
                  settle: int = 1) -> list[dict]:
    """kvjax SmolLM2 GQA vs llama.cpp on the same model: tokens/s and roofline fractions.

    llama.cpp runs twice: on the published GGUF (4-bit weights, its default f16 KV cache)
    and on a float32 copy with a float32 KV cache (:func:`peers.dense_gguf`): the same
    shapes and dtype as kvjax's float32 run. The three steps are timed in ``repeats``
    interleaved rounds after one warm-up round (:func:`interleaved_rounds`; one probe
    read before each round), so one run compares them under the same load; in each
    round each runs ``settle`` untimed steps, then ``block`` timed ones back to back, as
    in decoding (a step timed right after the other runtime's pays for its threads
    still polling: docs/decisions/0050-peer-rounds-time-back-to-back-steps.md). Besides
    the medians, each row gives the median over rounds of kvjax's tokens/s over
    llama.cpp f32's ('kvjax_over_llamacpp_f32') and the rounds where kvjax was faster
    (timed apart, the ratio moved more between windows than any kernel change:
    docs/decisions/0049), with 'block' and 'settle'.
    """
    from kvjax import checkpoints  # noqa: PLC0415

    q4_path = str(checkpoints.weights_path(progress=False))
    cfg = variant_cfg("smollm2", "gqa", dtype, scan)
    rows = []
    for t in (c for c in contexts if c <= 8192):
        try:
            f32_path = peers.dense_gguf(q4_path)
            arms = {"llamacpp_q4": peers.llamacpp_stepper(q4_path, t),
                    "llamacpp_f32": peers.llamacpp_stepper(f32_path, t, kv_type="f32")}
        except ImportError as e:
            print(f"peer llamacpp skipped: {e}")
            return rows
        arms["kvjax"] = step_runner(cfg, t)
        roofs: list[float] = []
        times = interleaved_rounds(arms, repeats, before_round=(
            (lambda: roofs.append(probe.once())) if probe else None), block=block,
            settle=settle)
        roof = statistics.median(roofs) if roofs else chip.hbm_bytes_per_s
        ours, f32, q4 = (peers.median(times[n])
                         for n in ("kvjax", "llamacpp_f32", "llamacpp_q4"))
        wins = [b / a for a, b in zip(times["kvjax"], times["llamacpp_f32"])]
        row = dict(context=t, model="smollm2-gqa", kvjax_ms=ours * 1e3,
                   llamacpp_f32_ms=f32 * 1e3, llamacpp_q4_ms=q4 * 1e3,
                   kvjax_tokens_per_s=1 / ours, llamacpp_f32_tokens_per_s=1 / f32,
                   llamacpp_q4_tokens_per_s=1 / q4,
                   kvjax_over_llamacpp_f32=statistics.median(wins),
                   rounds=repeats, rounds_kvjax_faster_f32=sum(w > 1 for w in wins),
                   block=block, settle=settle,
                   roofline_bytes_per_s=roof,
                   kvjax_fraction_of_roofline=theory.step_bytes(cfg, t).total / ours / roof,
                   llamacpp_f32_fraction_of_roofline=(
                       peers.llamacpp_step_bytes(f32_path, cfg, t, kv_bytes=4) / f32 / roof),
                   llamacpp_q4_fraction_of_roofline=(
                       peers.llamacpp_step_bytes(q4_path, cfg, t) / q4 / roof))
        rows.append(row)
        print(f"peers (SmolLM2 GQA, t={t}; llama.cpp f32 = float32 weights + KV like kvjax, "
              "q4 = the published 4-bit GGUF with f16 KV; "
              f"{repeats} interleaved rounds of {settle} untimed + {block} timed steps "
              "each): " + ", ".join(
                  f"{k}={v:.3g}" for k, v in row.items() if isinstance(v, float))
              + f"; kvjax faster than llama.cpp f32 in {row['rounds_kvjax_faster_f32']} "
              f"of {repeats} rounds", flush=True)
    return rows


def fit_crossover(contexts, seconds) -> float:
    """t* = a / b from a Theil-Sen fit seconds = a + b·t (weights time = KV time).

    The slope is the median of the pairwise slopes and the intercept the median of
    seconds - b·t, so one noisy point cannot flip the sign (least squares did, here).
    Returns inf when the slope is not positive.
    """
    t, y = np.asarray(contexts, float), np.asarray(seconds, float)
    slopes = [(y[j] - y[i]) / (t[j] - t[i]) for i in range(len(t)) for j in range(i + 1, len(t))
              if t[j] != t[i]]
    if not slopes:
        raise ValueError(f"contexts={list(contexts)}; allowed: at least two distinct values")
    b = float(np.median(slopes))
    a = float(np.median(y - b * t))
    return a / b if b > 0 else float("inf")


def flag_error(flag: str, given: list[str], allowed) -> str | None:
    """The usage error of a list flag: ``allowed`` a tuple of names (a non-empty subset
    of them), or ``int`` (integers >= 1); None when ``given`` is one."""
    if allowed is int:
        if given and all(c.isascii() and c.isdigit() and int(c) >= 1 for c in given):
            return None
        return f"--{flag}={','.join(given)}; allowed: integers >= 1"
    if given and not set(given) - set(allowed):
        return None
    return f"--{flag}={','.join(given)}; allowed: a non-empty subset of {','.join(allowed)}"


def main(argv):
    del argv
    models, variants = _MODELS.value, _VARIANTS.value
    contexts, repeats, peer_names = _CONTEXTS.value, _REPEATS.value, _PEERS.value
    dtype = _DTYPE.value
    if _QUICK.value:
        models, contexts, repeats = ["blog"], ["1024", "16384", "32768"], 3
    if _GPU_CHECK.value:
        models, variants, dtype = ["blog", "smollm2"], ["mha", "gqa", "mqa"], "bfloat16"
        contexts, repeats, peer_names = ["4096", "32768", "131072"], 5, []
    # the values that will run, before any work: what --quick or --gpu_check replaces is
    # not checked, nor --peer_contexts without a peer
    checks = [("models", models, MODELS), ("variants", variants, VARIANTS),
              ("contexts", contexts, int)]
    if peer_names:
        checks.append(("peer_contexts", _PEER_CONTEXTS.value, int))
    for flag, given, allowed in checks:
        if err := flag_error(flag, given, allowed):
            print(f"error: {err}", file=sys.stderr)
            return cli.USAGE_EXIT
    if set(peer_names) - set(PEERS):  # empty: no peer
        print(f"error: --peers={','.join(peer_names)}; allowed: a subset of "
              f"{','.join(PEERS)} (empty: none)", file=sys.stderr)
        return cli.USAGE_EXIT
    if repeats < 1:
        print(f"error: --repeats={repeats}; allowed: an integer >= 1", file=sys.stderr)
        return cli.USAGE_EXIT
    contexts = [int(c) for c in contexts]
    scan_modes = [False, True] if _GPU_CHECK.value else {
        "auto": [default_scan_layers()], "true": [True], "false": [False],
        "both": [False, True]}[_SCAN.value]

    try:  # every point's config, checked before any probe, measurement or compile
        for model_name in models:
            for variant in {*variants, "mha"}:
                variant_cfg(model_name, variant, dtype, scan_modes[0])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return cli.USAGE_EXIT
    chip = hardware.local_chip()
    start_roof = chip.hbm_bytes_per_s
    # A measured device: pair every step with a read by its probe's fastest kernel.
    probe = hardware.ReadProbe(chip.read_kernel) if chip.read_kernel else None
    print(f"device: {hardware.device_name()}  roofline: {chip.name} {start_roof / 1e9:.1f} GB/s "
          f"({chip.source}" + (f"; a '{probe.kernel}' read timed before every step)"
                               if probe else ")"))
    points = []
    for model_name in models:
        for scan in scan_modes:
            for variant in variants:
                cfg = variant_cfg(model_name, variant, dtype, scan)
                for t in contexts:
                    kv = theory.kv_cache_bytes(cfg, t)
                    if kv > _MAX_CACHE_BYTES.value * 1e9:
                        continue
                    sec, roof, fraction = time_point(cfg, t, repeats, probe)
                    sb = theory.step_bytes(cfg, t)
                    achieved = sb.total / sec
                    if probe is None:
                        roof, fraction = chip.hbm_bytes_per_s, achieved / chip.hbm_bytes_per_s
                    points.append(dict(model=model_name, variant=variant, scan_layers=scan,
                                       dtype=dtype, context=t, seconds=sec, theory_bytes=sb.total,
                                       kv_bytes=sb.kv_read, weight_bytes=sb.weights,
                                       achieved_bytes_per_s=achieved,
                                       roofline_bytes_per_s=roof,
                                       fraction_of_roofline=fraction,
                                       roofline_seconds=sb.total / roof))
                    print(f"{model_name:8s} {variant:7s} scan={scan!s:5s} t={t:>7,d}  "
                          f"{sec * 1e3:9.2f} ms  {achieved / 1e9:6.2f} GB/s  "
                          f"{fraction:5.1%} of roofline ({roof / 1e9:.1f} GB/s)",
                          flush=True)

    # Ratios timed interleaved (steps back to back): host drift cancels in each pair.
    window_ratios, speedups = {}, {}
    t_speed = 32768 if 32768 in contexts else max(contexts)
    for model_name in models:
        for scan in scan_modes:
            if "window" in variants and len(contexts) >= 2:
                cfg = variant_cfg(model_name, "window", dtype, scan)
                r = interleaved_ratio((cfg, max(contexts)), (cfg, min(contexts)), repeats)
                window_ratios[(model_name, scan)] = r
                print(f"{model_name:8s} window  scan={scan!s:5s} step time t={max(contexts):,d}"
                      f" / t={min(contexts):,d}, interleaved: {r:.3f}", flush=True)
            mha = variant_cfg(model_name, "mha", dtype, scan)
            for v in (v for v in ("gqa", "mqa") if v in variants and "mha" in variants):
                cfg = variant_cfg(model_name, v, dtype, scan)
                if theory.kv_cache_bytes(mha, t_speed) > _MAX_CACHE_BYTES.value * 1e9:
                    continue
                r = interleaved_ratio((mha, t_speed), (cfg, t_speed), repeats)
                th = theory.step_bytes(mha, t_speed).total / theory.step_bytes(cfg, t_speed).total
                speedups[(model_name, v, scan, t_speed)] = r
                print(f"{model_name:8s} {v:7s} scan={scan!s:5s} speedup over MHA at "
                      f"t={t_speed:,d}, interleaved: {r:.2f}x (theory {th:.2f}x)", flush=True)
    summary = summarize(points, contexts, window_ratios, speedups)
    peer_rows = []
    blog_peers = [p for p in peer_names if p in ("flax", "torch")]
    if "blog" in models and blog_peers:
        for t in [int(c) for c in _PEER_CONTEXTS.value]:
            cfg = variant_cfg("blog", "mha", dtype, scan_modes[0])
            ours = time_point(cfg, t, repeats)[0]
            row = dict(context=t, kvjax_ms=ours * 1e3)
            for name in blog_peers:
                fn = {"flax": peers.flax_decode_step_seconds,
                      "torch": peers.torch_decode_step_seconds}[name]
                try:
                    row[f"{name}_ms"] = peers.median(fn(cfg, t, repeats)) * 1e3
                except ImportError as e:
                    row[f"{name}_ms"] = None
                    print(f"peer {name} skipped: {e}")
            peer_rows.append(row)
            print(f"peers (blog MHA, same shapes/dtype, t={t}): " + ", ".join(
                f"{k}={v:.2f}" for k, v in row.items() if isinstance(v, float)), flush=True)
    if "llamacpp" in peer_names:
        peer_rows += llamacpp_rows([int(c) for c in _PEER_CONTEXTS.value], dtype,
                                   scan_modes[0], repeats, probe, chip,
                                   _PEER_BLOCK.value, _PEER_SETTLE.value)

    os.makedirs(_OUT.value, exist_ok=True)
    out = dict(device=hardware.device_name(), roofline_bytes_per_s=start_roof,
               roofline_probe_kernel=probe.kernel if probe else None, roofline=chip.name,
               dtype=dtype, points=points, summary=summary, peers=peer_rows)
    path = os.path.join(_OUT.value, "bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    # the summary (bench.json's 'summary'), one readable line per entry
    def fmt(v) -> str:
        if not isinstance(v, (int, float)):
            return str(v)
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"

    print("summary:")
    for key, val in summary.items():
        items = val.items() if isinstance(val, dict) else [("", val)]
        print(f"  {key}: " + ", ".join(f"{k} {fmt(v)}".strip() for k, v in items))
    from kvjax import planner  # noqa: PLC0415 (issue 18: which formulation, measured GB/s)
    for line in planner.report_lines() or [
            f"decode attention: no measured choice (machine {planner.machine_key()['cpu']}, "
            f"ISA {', '.join(planner.machine_key()['isa'])})"]:
        print(line)
    plot(points, os.path.join(_OUT.value, "bench_step_time.png"), out["device"],
         bandwidth=statistics.median(p["roofline_bytes_per_s"] for p in points)
         if points else None)
    print(f"wrote {path} and {os.path.join(_OUT.value, 'bench_step_time.png')}")


def summarize(points, contexts, window_ratios=None, speedups=None) -> dict:
    """Speedups vs theory, window flatness, crossover fits, worst dense roofline fraction."""
    out, window_ratios, speedups = {}, window_ratios or {}, speedups or {}
    by = {(p["model"], p["variant"], p["scan_layers"], p["context"]): p for p in points}
    for (m, v, s, t), p in by.items():
        if v in ("gqa", "mqa") and (m, "mha", s, t) in by:
            mha = by[(m, "mha", s, t)]
            out[f"{m}/{v}/scan={s}/t={t}/speedup_vs_mha"] = dict(
                measured=mha["seconds"] / p["seconds"],
                interleaved=speedups.get((m, v, s, t)),
                theory=mha["theory_bytes"] / p["theory_bytes"])
    for (m, v, s, t), p in by.items():
        if v == "window" and t == max(contexts) and (m, v, s, min(contexts)) in by:
            out[f"{m}/window/scan={s}/t{t}_over_t{min(contexts)}"] = dict(
                separate_points=p["seconds"] / by[(m, v, s, min(contexts))]["seconds"],
                interleaved=window_ratios.get((m, s)))
    for m in {p["model"] for p in points}:
        for s in {p["scan_layers"] for p in points}:
            pts = [p for p in points if p["model"] == m and p["variant"] == "mha"
                   and p["scan_layers"] == s]
            if len(pts) >= 2:
                cfg = variant_cfg(m, "mha", "float32", s)
                # theory: KV read = weights read per step, counting the LM head (V·D)
                # that the blog's 24·L·D² leaves out; blog_6D: the blog's t* = 6·D.
                out[f"{m}/mha/scan={s}/crossover"] = dict(
                    measured=fit_crossover([p["context"] for p in pts],
                                           [p["seconds"] for p in pts]),
                    theory=theory.crossover_context(cfg), blog_6D=6 * cfg.d_model)
            dense = [p for p in points if p["model"] == m and p["scan_layers"] == s
                     and p["variant"] != "window" and p["context"] >= 16384]
            if dense:
                out[f"{m}/scan={s}/min_fraction_of_roofline_t>=16K"] = min(
                    p["fraction_of_roofline"] for p in dense)
    return out


def plot(points, path, device: str = "", bandwidth: float | None = None):
    """Step time vs context per model (log-log): measured markers and lines per variant,
    and each variant's roofline (theory bytes / one bandwidth for the whole run: by
    default the median of the points' probe reads; the per-point probes stay in the
    JSON and the table). The legend sits below the panels."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: PLC0415

    if not points:
        return
    if bandwidth is None:
        bandwidth = statistics.median(p["roofline_bytes_per_s"] for p in points)
    models = sorted({p["model"] for p in points})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False,
                             constrained_layout=True)
    handles = {}
    for ax, m in zip(axes[0], models):
        for i, (v, s) in enumerate(sorted({(p["variant"], p["scan_layers"]) for p in points
                                           if p["model"] == m})):
            pts = sorted((p for p in points if p["model"] == m and p["variant"] == v
                          and p["scan_layers"] == s), key=lambda p: p["context"])
            x = [p["context"] for p in pts]
            name = v + (" (scan)" if s else "")
            line, = ax.plot(x, [p["seconds"] * 1e3 for p in pts], "o-", color=f"C{i}",
                            label=f"{name}: measured")
            roof, = ax.plot(x, [p["theory_bytes"] / bandwidth * 1e3 for p in pts], "--",
                            color=f"C{i}", alpha=0.7, label=f"{name}: roofline")
            handles.setdefault(line.get_label(), line)
            handles.setdefault(roof.get_label(), roof)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(
            lambda v, _: f"{v / 1024:g}K" if v >= 1024 else f"{v:g}"))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xlabel("context t (tokens in the cache)")
        ax.set_ylabel("decode step time (ms, median)")
        ax.set_title(f"{m}: step time vs context", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="outside lower center",
               ncol=4, fontsize=8, frameon=False)
    fig.suptitle(f"{device or 'this device'}, {points[0].get('dtype', '')}\nroofline = "
                 f"theory bytes / {bandwidth / 1e9:.1f} GB/s (median of the run's probe "
                 "reads; GB = 10^9 B)", fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    cli.run(main)
