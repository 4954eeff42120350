r"""Serve real requests through the slot engine and report latency and throughput.

    python -m experiments.serve --config=configs/gqa.py
    python -m experiments.serve --config=configs/gqa.py --num_requests=64 --slots=16
    python -m experiments.serve --config=configs/gqa.py --requests_file=reqs.jsonl \
        --json_out=/tmp/serve.json
    python -m experiments.serve --config=configs/gqa.py --compare_plain   # engine vs loop
    python -m experiments.serve --quick                                     # smoke test

Requests are prompts cut from the held-out split of the evaluation corpus (the Django
docs, kvjax/training/data.py) at seeded random offsets, with prompt lengths drawn from a
log-normal (median ``--prompt_median`` tokens, clipped to [``--prompt_min``,
``--prompt_max``]) and budgets uniform in [``--new_min``, ``--new_max``]; or read from a
JSONL file, one ``{"prompt": "...", "max_new_tokens": N}`` per line (a malformed line is
reported by its number and skipped; the other requests still run). Prompts are raw text
(no chat template): the model continues the documentation.

Printed: throughput (generated tokens/s over the run's wall time), time to first token
and time per output token (p50/p90/p99; every request arrives at 0, so TTFT includes
queueing), mean slot occupancy, and KV bytes live (held by occupied rows, mean over
decode steps) vs allocated. ``--compare_plain``: the engine at full occupancy (``slots``
requests, one budget, no EOS) against the plain batched loop
(kvjax.inference.ragged.generate_ragged) on the same prompts, decode tokens/s ratio.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np
from absl import app, flags

from experiments import cli
from kvjax.checkpoints import WeightsError
from kvjax.config import ConfigError, run_config_from_dict
from kvjax.inference import engine as engine_lib
from kvjax.inference import memory, runner

_CONFIG = cli.DEFINE_config_file(
    "config", "configs/gqa.py", cli.config_help("Experiment config file (get_config())."),
    lock_config=True)
_NUM_REQUESTS = flags.DEFINE_integer("num_requests", 32, "Requests drawn from the corpus.")
_SLOTS = flags.DEFINE_integer("slots", 8, "Rows of the engine's batch cache.")
_REQUESTS_FILE = flags.DEFINE_string(
    "requests_file", None, 'JSONL requests: {"prompt": str, "max_new_tokens": int} a line.')
_JSON_OUT = flags.DEFINE_string("json_out", None, "Write the results as JSON here.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the request distribution.")
_PROMPT_MEDIAN = flags.DEFINE_integer("prompt_median", 48, "Median prompt length (tokens).")
_PROMPT_MIN = flags.DEFINE_integer("prompt_min", 4, "Shortest prompt (tokens).")
_PROMPT_MAX = flags.DEFINE_integer("prompt_max", 160, "Longest prompt (tokens).")
_NEW_MIN = flags.DEFINE_integer("new_min", 8, "Smallest budget (tokens).")
_NEW_MAX = flags.DEFINE_integer("new_max", 64, "Largest budget (tokens).")
_STEPS_PER_SYNC = flags.DEFINE_integer("steps_per_sync", 8,
                                       "Decode steps per compiled call between host visits.")
_COMPARE = flags.DEFINE_bool("compare_plain", False,
                             "Also time the engine at full occupancy vs the plain loop.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke test: 6 requests, 3 slots, short budgets.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


@dataclasses.dataclass
class Skipped:
    """A request that could not run: where it came from and why."""

    where: str
    reason: str


def corpus_requests(tokenizer, num: int, seed: int, prompt_median: int, prompt_min: int,
                    prompt_max: int, new_min: int, new_max: int, stream=None):
    """``num`` requests cut from the held-out corpus stream (seeded; see module doc).

    Raises:
      ValueError: a bound out of order or non-positive (named).
    """
    if num < 1:
        raise ValueError(f"num_requests={num}; allowed: >= 1")
    if not 1 <= prompt_min <= prompt_max:
        raise ValueError(f"prompt_min={prompt_min}, prompt_max={prompt_max}; allowed: "
                         "1 <= prompt_min <= prompt_max")
    if not 1 <= new_min <= new_max:
        raise ValueError(f"new_min={new_min}, new_max={new_max}; allowed: "
                         "1 <= new_min <= new_max")
    if stream is None:
        from kvjax.training import data
        stream = data.tokenized_corpus(tokenizer, train=False).heldout
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(np.exp(rng.normal(np.log(prompt_median), 0.6, num))),
                   prompt_min, prompt_max).astype(int)
    budgets = rng.integers(new_min, new_max + 1, num)
    starts = rng.integers(0, len(stream) - prompt_max, num)
    out = []
    for i, (n, m, s) in enumerate(zip(lens, budgets, starts)):
        ids = tuple(int(t) for t in stream[s: s + n])
        out.append(engine_lib.Request(i, ids, int(m), tokenizer.decode(list(ids))))
    return out


def file_requests(path: str, tokenizer):
    """(requests, skipped) from a JSONL file; a line that is not a JSON object with a
    non-empty string ``prompt`` and an integer ``max_new_tokens`` >= 1 is skipped and
    named by its line number. Blank lines are ignored. Request ids are line numbers."""
    reqs, skipped = [], []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                skipped.append(Skipped(where, f"not JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                skipped.append(Skipped(where, 'allowed: {"prompt": str, "max_new_tokens": '
                                              'int}; "prompt" missing or not a string'))
                continue
            m = obj.get("max_new_tokens")
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                skipped.append(Skipped(where, f"max_new_tokens={m!r}; allowed: an integer "
                                              ">= 1"))
                continue
            ids = tuple(tokenizer.encode(obj["prompt"]))
            if not ids:
                skipped.append(Skipped(where, "empty prompt; allowed: at least one token"))
                continue
            reqs.append(engine_lib.Request(lineno, ids, m, obj["prompt"]))
    return reqs, skipped


def screen(eng: engine_lib.Engine, reqs):
    """(runnable requests, skipped): each request checked by the engine (a prompt longer
    than the cache is named, the others still run)."""
    ok, skipped = [], []
    for r in reqs:
        try:
            eng.check(r)
            ok.append(r)
        except ValueError as e:
            skipped.append(Skipped(f"request {r.id}", str(e)))
    return ok, skipped


def percentiles(xs) -> dict:
    """{'p50', 'p90', 'p99'} of a list of seconds (nan when empty)."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return {k: float("nan") for k in ("p50", "p90", "p99")}
    return {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)}


def summarize(done, stats: engine_lib.EngineStats) -> dict:
    return {
        "requests": len(done), "tokens": stats.tokens, "wall_s": stats.wall_s,
        "throughput_tokens_per_s": stats.throughput,
        "ttft_s": percentiles([c.ttft_s for c in done]),
        "tpot_s": percentiles([c.tpot_s for c in done]),
        "mean_slot_occupancy": stats.mean_occupancy, "slots": stats.num_slots,
        "decode_steps": stats.steps, "decode_s": stats.decode_s,
        "kv_bytes_live_mean": stats.mean_live_kv_bytes,
        "kv_bytes_allocated": stats.allocated_kv_bytes,
        "stops": {s: sum(c.stop == s for c in done) for s in ("eos", "budget")},
    }


def compare_plain(loaded, run, reqs, slots: int, budget: int, steps_per_sync: int,
                  repeats: int = 3) -> dict:
    """Decode tokens/s of the engine at full occupancy over the plain batched loop
    (:func:`kvjax.inference.ragged.generate_ragged`), same prompts, B = ``slots``, every
    request ``budget`` tokens, no EOS. The two are timed alternately ``repeats`` times
    after a round that compiles; medians and their ratio. Engine decode time includes its
    host visits every ``steps_per_sync`` steps; prefills are excluded from both."""
    import jax.numpy as jnp

    from kvjax import cache as cache_lib
    from kvjax.inference import ragged

    cfg, params = loaded.cfg, loaded.params
    batch = [dataclasses.replace(r, id=i, max_new_tokens=budget)
             for i, r in enumerate(reqs[:slots])]
    eng = engine_lib.Engine(params, cfg, slots, run.max_seq_len, eos_id=-1,
                            steps_per_sync=steps_per_sync)
    keys = ragged.row_keys_for(None, len(batch))
    engine_tps, plain_tps = [], []
    for _ in range(repeats + 1):  # interleaved; the first round compiles
        _, st = eng.run(batch)
        engine_tps.append(st.occupied_slot_steps / st.decode_s)
        tokens, lengths = ragged.pad_prompts([r.prompt for r in batch])
        cache = cache_lib.init_cache(cfg, len(batch), run.max_seq_len, ragged=True)
        logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        first.block_until_ready()
        t0 = time.perf_counter()
        _, counts, cache = ragged.generate_ragged(params, cfg, first, cache,
                                                  [budget - 1] * len(batch), row_keys=keys)
        plain_tps.append(float(counts.sum()) / (time.perf_counter() - t0))
    e, p = float(np.median(engine_tps[1:])), float(np.median(plain_tps[1:]))
    return {"batch": len(batch), "budget": budget, "repeats": repeats,
            "engine_decode_tokens_per_s": e, "plain_decode_tokens_per_s": p,
            "ratio": e / p, "engine_occupancy": st.mean_occupancy,
            "steps_per_sync": steps_per_sync}


def report(summary: dict, skipped) -> str:
    ms = lambda d: "  ".join(f"{k} {v * 1e3:,.1f} ms" for k, v in d.items())
    lines = [
        f"{summary['requests']} requests, {summary['tokens']:,} tokens generated in "
        f"{summary['wall_s']:.2f} s: {summary['throughput_tokens_per_s']:,.1f} tokens/s "
        f"({summary['slots']} slots, mean occupancy {summary['mean_slot_occupancy']:.2f}, "
        f"{summary['decode_steps']} decode steps)",
        f"time to first token:   {ms(summary['ttft_s'])}",
        f"time per output token: {ms(summary['tpot_s'])}",
        f"KV bytes: live {summary['kv_bytes_live_mean']:,.0f} (mean over decode steps) of "
        f"{summary['kv_bytes_allocated']:,} allocated "
        f"({summary['kv_bytes_live_mean'] / summary['kv_bytes_allocated']:.1%})",
        f"stops: {summary['stops']}",
    ]
    for s in skipped:
        lines.append(f"skipped {s.where}: {s.reason}")
    if "compare_plain" in summary:
        c = summary["compare_plain"]
        lines.append(
            f"engine at full occupancy vs plain batched loop (B={c['batch']}, "
            f"{c['budget']} tokens each): {c['engine_decode_tokens_per_s']:,.1f} vs "
            f"{c['plain_decode_tokens_per_s']:,.1f} decode tokens/s, ratio {c['ratio']:.3f}")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    num, slots, new_max = _NUM_REQUESTS.value, _SLOTS.value, _NEW_MAX.value
    if _QUICK.value:
        num, slots, new_max = 6, 3, 24
    try:
        run = run_config_from_dict(_CONFIG.value)
        if not run.ignore_memory_check:
            memory.check(run.model, slots, run.max_seq_len, what=f"serve with {slots} slots")
        loaded = runner.load(run, progress=_PROGRESS.value)
        tok = loaded.tokenizer
        eos = tok.eos_token_id if run.stop_at_eos else -1
        eng = engine_lib.Engine(loaded.params, loaded.cfg, slots, run.max_seq_len,
                                sampling=run.sampling, eos_id=eos,
                                steps_per_sync=_STEPS_PER_SYNC.value, seed=run.sampling.seed)
        if _REQUESTS_FILE.value:
            reqs, skipped = file_requests(_REQUESTS_FILE.value, tok)
        else:
            reqs, skipped = corpus_requests(
                tok, num, _SEED.value, _PROMPT_MEDIAN.value, _PROMPT_MIN.value,
                min(_PROMPT_MAX.value, run.max_seq_len - new_max), _NEW_MIN.value,
                new_max), []
        reqs, more = screen(eng, reqs)
        skipped += more
    except (ConfigError, WeightsError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in skipped:
        print(f"error: skipped {s.where}: {s.reason}", file=sys.stderr)
    if not reqs:
        print("error: no request left to run", file=sys.stderr)
        return 2
    bar = None
    if _PROGRESS.value:
        from tqdm import tqdm
        bar = tqdm(total=len(reqs), unit="req", file=sys.stderr)
    done, stats = eng.run(reqs, on_finish=(lambda c: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    summary = summarize(done, stats)
    if _COMPARE.value:
        summary["compare_plain"] = compare_plain(loaded, run, reqs, slots,
                                                 new_max, _STEPS_PER_SYNC.value)
    print(report(summary, skipped))
    if _JSON_OUT.value:
        summary["skipped"] = [dataclasses.asdict(s) for s in skipped]
        summary["completions"] = [
            {"id": c.id, "prompt_tokens": c.prompt_len, "new_tokens": len(c.tokens),
             "stop": c.stop, "ttft_s": c.ttft_s, "tpot_s": c.tpot_s,
             "text": tok.decode(c.tokens)} for c in done]
        with open(_JSON_OUT.value, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
