r"""Serve real requests through the slot engine and report latency and throughput.

    python -m experiments.serve --config=configs/gqa.py
    python -m experiments.serve --config=configs/gqa.py --num_requests=64 --slots=16
    python -m experiments.serve --config=configs/gqa.py --requests_file=reqs.jsonl \
        --json_out=/tmp/serve.json
    python -m experiments.serve --config=configs/gqa.py --compare_plain   # engine vs loop
    python -m experiments.serve --quick                                     # smoke test
    python -m experiments.serve --config=configs/gqa.py --config.speculative.drafter=ngram \
        --config.speculative.k=4                                            # n-gram drafts

Requests are prompts cut from the held-out split of the evaluation corpus (the Django
docs, kvjax/training/data.py) at seeded random offsets, moved onto character boundaries
(:func:`character_cut`: no prompt starts or ends inside a CJK character or an emoji),
with prompt lengths drawn from a
log-normal (median ``--prompt_median`` tokens, clipped to [``--prompt_min``,
``--prompt_max``]) and budgets uniform in [``--new_min``, ``--new_max``]; or read from a
JSONL file, one ``{"prompt": "...", "max_new_tokens": N}`` per line (a malformed line is
reported by its number and skipped; the other requests still run). Prompts are raw text
(no chat template): the model continues the documentation.

With ``--config.page_size=N`` the engine's rows are pages
(:class:`kvjax.inference.engine.PagedRows`): a pool of ``--slots`` x max_seq_len tokens
(the dense rows' bytes) in pages of N tokens, up to ``--max_rows`` requests at once, the
newest preempted when the pool runs out; ``--prefix_cache`` shares the cached pages of
common prompt prefixes. With an evicting ``--config.model.kv_compression`` each row holds
kv_budget + recent_slots slots of whole pages, and the pool ``--slots`` such rows (the
report prints the row's slots and pages and the rows the pool holds, keys
``compressed_row_slots``, ``compressed_row_pages``, ``compressed_pool_rows``).
``--config.chat_template=True`` makes each request's text the
user's turn of the checkpoint's chat template (every prompt then starts with the same
system turn).

``--arrival_rate=R``: requests arrive as a Poisson process of R per second (seeded by
``--seed``) instead of all at once, and are not admitted before they arrive.

Printed: throughput (generated tokens/s over the run's wall time), time to first token
(from each request's arrival, so it includes queueing), time per output token and the
time between tokens as the host received them (p50/p90/p99), mean slot occupancy, and KV bytes live (held by occupied rows, mean over
decode steps) vs allocated. ``--compare_plain``: the engine at full occupancy (``slots``
requests, one budget, no EOS) against the plain batched loop
(kvjax.inference.ragged.generate_ragged) on the same prompts, decode tokens/s ratio.

``--config.speculative.drafter=ngram --config.speculative.k=N``: the engine runs verify
rounds of N + 1 tokens with prompt-lookup drafts from each request's own tokens (greedy:
the same tokens); ``drafter=self`` (the same weights over the config's cheap draft
cache) and ``drafter=model`` (``--config.speculative.draft_config=configs/...``) keep
the draft model's cache per slot. The summary adds the acceptance rate and tokens per
slot-round, and "decode steps" counts rounds. With ``--config.page_size=N`` the rounds
run on pages (rejected drafts taken back by the rows' lengths; a draft model's cache stays
dense, one row per block-table row, outside the page budget).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import numpy as np
from absl import app, flags

from experiments import cli
from kvjax import cache as cache_lib
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
_PREFIX_CACHE = flags.DEFINE_bool(
    "prefix_cache", False, "With --config.page_size=N: requests reuse the cached pages of "
    "common prompt prefixes (reports the hit rate and the prefill tokens saved).")
_ARRIVAL_RATE = flags.DEFINE_float(
    "arrival_rate", 0.0, "Requests per second arriving as a Poisson process (exponential "
    "gaps drawn with --seed); 0: every request arrives at once (an offline batch).")
_MAX_ROWS = flags.DEFINE_integer(
    "max_rows", 0, "With --config.page_size=N: block-table rows, the most requests running "
    "at once (0: 4 x --slots). The page pool holds --slots x max_seq_len tokens, the "
    "memory the dense engine reserves.")


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
        s, e = character_cut(stream, int(s), int(n), prompt_min,
                             getattr(tokenizer, "character_starts", None))
        ids = tuple(int(t) for t in stream[s:e])
        out.append(engine_lib.Request(i, ids, int(m), tokenizer.decode(list(ids))))
    return out


def character_cut(stream, start: int, n: int, minimum: int = 1, starts=None):
    """(start, end) of an ``n``-token cut of ``stream`` at ``start``, moved onto character
    boundaries: a byte-level BPE token can hold part of a character (a CJK character or
    an emoji is often two or three tokens), and a prompt cut inside one decodes to
    U+FFFD. The start moves forward to the first token that begins a character, the end
    back to one (or, if that leaves fewer than ``minimum`` tokens, forward).

    Args:
      stream: token ids of valid UTF-8 text.
      starts: [V] bool, whether each token begins a character
        (``Tokenizer.character_starts``); None: every token does.
    """
    if starts is None:
        return start, min(start + n, len(stream))
    ok = lambda j: j >= len(stream) or bool(starts[int(stream[j])])  # noqa: E731
    while not ok(start):
        start += 1
    end = min(start + n, len(stream))
    back = end
    while back > start and not ok(back):
        back -= 1
    if back - start >= minimum:
        return start, back
    while not ok(end):
        end += 1
    return start, end


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


def pool_pages(run, slots: int) -> int:
    """Pages of the engine's pool on pages: the dense rows' bytes, ``slots`` rows of the
    cache's slots (max_seq_len, or a window's ring of W), in pages of page_size; at
    least the pages of one request of max_seq_len tokens (a window's prompt is
    prefilled whole before its old pages are freed), or of one compressed row
    (``model.kv_compression``: kv_budget + recent_slots slots, its prompt compressed on
    a dense cache first)."""
    from kvjax.cache import paged  # noqa: PLC0415

    row = cache_lib.num_slots(run.model, run.max_seq_len)
    one = row if run.model.kv_evicts else run.max_seq_len
    return max(slots * row // run.page_size, paged.pages_for(one, run.page_size))


def compressed_pool(cfg, allocated_bytes: int, page_size: int, max_seq_len: int) -> dict:
    """The pool figures of compressed rows on pages (an evicting ``model.kv_compression``:
    each row its fixed W = kv_budget + recent_slots slots on W / P pages, whatever its
    length): {'compressed_row_slots': W, 'compressed_row_pages': W / P,
    'compressed_pool_rows': the rows the pool's ``allocated_bytes`` hold,
    :func:`kvjax.analysis.paging.capacity`}; {} for rows that grow by pages."""
    from kvjax.analysis import paging  # noqa: PLC0415

    if not (page_size and cfg.kv_evicts):
        return {}
    cap = paging.capacity(cfg, allocated_bytes, [max_seq_len], max_seq_len, page_size)
    return {"compressed_row_slots": cap.row_slots,
            "compressed_row_pages": cap.row_slots // page_size,
            "compressed_pool_rows": cap.paged}


def check_arrival_rate(rate: float) -> None:
    """Raises ValueError naming ``rate`` unless it is a finite number >= 0."""
    if not (np.isfinite(rate) and rate >= 0):
        raise ValueError(f"--arrival_rate={rate!r}; allowed: requests per second >= 0 "
                         "(0: all at once)")


def poisson_arrivals(reqs, rate: float, seed: int):
    """``reqs`` with Poisson arrival times at ``rate`` requests/s: the gaps between
    arrivals are exponential with mean 1 / rate, drawn from ``seed``, the first request
    at its gap after 0. ``rate`` 0 leaves every arrival at 0.

    Raises:
      ValueError: a negative or non-finite rate (:func:`check_arrival_rate`).
    """
    check_arrival_rate(rate)
    if rate == 0:
        return list(reqs)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(reqs))
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(reqs, np.cumsum(gaps))]


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
        # times between tokens as the host received them, every gap of every request
        "itl_s": percentiles([g for c in done for g in c.itl_s]),
        "mean_slot_occupancy": stats.mean_occupancy, "slots": stats.num_slots,
        "decode_steps": stats.steps, "decode_s": stats.decode_s,
        **({"speculative": {"accepted": stats.accepted, "proposed": stats.proposed,
                            "acceptance_rate": stats.acceptance_rate,
                            # tokens after each request's first per occupied slot-round
                            "tokens_per_round": (stats.tokens - stats.prefills)
                            / max(stats.occupied_slot_steps, 1)}}
           if stats.proposed else {}),
        "kv_bytes_live_mean": stats.mean_live_kv_bytes,
        "kv_bytes_allocated": stats.allocated_kv_bytes,
        **paged_summary(stats),
        "stops": {s: sum(c.stop == s for c in done) for s in ("eos", "budget", "nonfinite")},
        # which end-of-generation id ended the 'eos' stops: id -> count
        "stop_tokens": {str(t): sum(c.stop_token == t for c in done)
                        for t in sorted({c.stop_token for c in done} - {None})},
    }


def paged_summary(stats) -> dict:
    """The figures of a run on pages (:class:`kvjax.inference.engine.EngineStats`):
    pages referenced (mean bytes; ``kv_bytes_active_pages_mean``: those of the rows still
    running, without a stopped row's pages kept to the end of its block), rows running
    (mean, most), preemptions, prefix-cache
    hit rate and prefill tokens saved; {} for the dense engine."""
    if not stats.page_size:
        return {}
    return {"page_size": stats.page_size, "kv_bytes_pages_mean": stats.mean_page_kv_bytes,
            "kv_bytes_active_pages_mean": stats.mean_active_page_kv_bytes,
            "running_mean": stats.mean_running, "running_max": stats.max_running,
            "row_pages_max": stats.max_row_pages,
            "preemptions": stats.preemptions, "prompt_tokens": stats.prompt_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens,
            "prefix_hit_rate": stats.prefix_hit_rate,
            "prefill_tokens": stats.prefill_tokens}


def chat_requests(reqs, tok, system: str | None):
    """Each request's text as the user's turn of the checkpoint's chat template (with the
    system turn ``system``; None: the template's default), so every prompt starts with the
    same system turn (``Tokenizer.chat_ids``)."""
    return [dataclasses.replace(r, prompt=tuple(tok.chat_ids(r.text, system)[1]))
            for r in reqs]


def completion_json(c: engine_lib.Completion, tok) -> dict:
    """One completion for the JSON: why it stopped (``stop``; ``stop_token`` and its text
    for 'eos'), and its ``text``: the generated tokens before the stop token, with
    ``held_back_bytes`` bytes at the end that begin a character not yet complete held
    back (a budget cut inside an emoji or CJK character shows no U+FFFD)."""
    body = [t for t in c.tokens if t >= 0]
    if c.stop == "eos":
        body = body[:-1]
    text, held = tok.decode_complete(body)
    return {"id": c.id, "prompt_tokens": c.prompt_len, "new_tokens": len(c.tokens),
            "stop": c.stop, "stop_token": c.stop_token,
            "stop_token_text": None if c.stop_token is None else tok.id_to_token(c.stop_token),
            "ttft_s": c.ttft_s, "tpot_s": c.tpot_s, "arrival_s": c.arrival_s,
            "token_s": c.token_s, "text": text, "held_back_bytes": held}


def compare_plain(loaded, run, reqs, slots: int, budget: int, steps_per_sync: int,
                  repeats: int = 3) -> dict:
    """Decode tokens/s of the engine at full occupancy over the plain batched loop
    (:func:`kvjax.inference.ragged.generate_ragged`), same prompts, B = ``slots``, every
    request ``budget`` tokens, no EOS. The two are timed alternately ``repeats`` times
    after a round that compiles; medians and their ratio. Engine decode time includes its
    host visits every ``steps_per_sync`` steps; prefills are excluded from both."""
    import jax.numpy as jnp

    from kvjax.inference import ragged

    cfg, params = loaded.cfg, loaded.params
    batch = [dataclasses.replace(r, id=i, max_new_tokens=budget)
             for i, r in enumerate(reqs[:slots])]
    eng = engine_lib.Engine(params, cfg, slots, run.max_seq_len,
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
        f"{summary['wall_s']:.2f} s of serving (the engine's run, its programs compiled "
        f"before its clock starts): {summary['throughput_tokens_per_s']:,.1f} tokens/s "
        f"({summary['slots']} slots, mean occupancy {summary['mean_slot_occupancy']:.2f}, "
        f"{summary['decode_steps']} decode steps)",
        f"time to first token:   {ms(summary['ttft_s'])}",
        f"time per output token: {ms(summary['tpot_s'])}",
        f"KV bytes: live {summary['kv_bytes_live_mean']:,.0f} (mean over decode steps) of "
        f"{summary['kv_bytes_allocated']:,} allocated "
        f"({summary['kv_bytes_live_mean'] / summary['kv_bytes_allocated']:.1%})",
        f"stops: {summary['stops']}",
    ]
    if "itl_s" in summary:  # (a summary from before the per-token times has none)
        lines.insert(4, f"time between tokens:   {ms(summary['itl_s'])} (as the host "
                        "received them; the tokens of one sync of --steps_per_sync steps "
                        "arrive together)")
    if "command_wall_s" in summary:
        lines.insert(1, (
            f"whole command: {summary['command_wall_s']:.2f} s wall = setup "
            f"{summary['setup_s']:.2f} s (config, weights loaded or downloaded and "
            f"converted, the planner's measurements, the requests) + compiling the engine's "
            f"programs {summary['warmup_s']:.2f} s + serving {summary['wall_s']:.2f} s"
            + (" + the comparison with the plain loop" if "compare_plain" in summary else "")))
    if "page_size" in summary:
        lines += [
            f"paged (page_size {summary['page_size']}): pages referenced "
            f"{summary['kv_bytes_pages_mean']:,.0f} bytes mean (live/referenced "
            f"{summary['kv_bytes_live_mean'] / max(summary['kv_bytes_pages_mean'], 1):.1%}; "
            f"of the rows still running {summary['kv_bytes_active_pages_mean']:,.0f}, live/"
            f"those {summary['kv_bytes_live_mean'] / max(summary['kv_bytes_active_pages_mean'], 1):.1%}); "
            f"requests running {summary['running_mean']:.2f} mean, "
            f"{summary['running_max']} most; {summary['preemptions']} preemptions; at most "
            f"{summary['row_pages_max']} pages held by one row",
            f"prefix cache: {summary['prefix_hit_tokens']:,} of {summary['prompt_tokens']:,} "
            f"prompt tokens found cached (hit rate {summary['prefix_hit_rate']:.1%}), "
            f"{summary['prefill_tokens']:,} prefilled"]
    if "compressed_pool_rows" in summary:
        lines.append(
            f"compressed rows: {summary['compressed_row_slots']} slots (kv_budget + "
            f"recent_slots) = {summary['compressed_row_pages']} pages each, whatever the "
            f"length; the pool holds {summary['compressed_pool_rows']} such rows")
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
    t_start = time.perf_counter()  # the whole command's wall time counts from here
    num, slots, new_max = _NUM_REQUESTS.value, _SLOTS.value, _NEW_MAX.value
    if _QUICK.value:
        num, slots, new_max = 6, 3, 24
    try:
        run = run_config_from_dict(_CONFIG.value)
        check_arrival_rate(_ARRIVAL_RATE.value)  # before the weights load
        if not run.ignore_memory_check:
            memory.check(run.model, slots, run.max_seq_len, what=f"serve with {slots} slots")
        loaded = runner.load(run, progress=_PROGRESS.value)
        tok = loaded.tokenizer
        eos = tok.eos_token_ids if run.stop_at_eos else ()
        draft = None  # 'self' / 'model': the draft model, its cache kept per row
        if run.speculative.drafter in ("self", "model"):
            draft = runner.draft_model(run, loaded, progress=_PROGRESS.value)
        if _PREFIX_CACHE.value and not run.page_size:
            raise ValueError("--prefix_cache with --config.page_size=0; allowed: "
                             "--config.page_size=N >= 1 (the prefix cache shares pages)")
        # on pages: a pool of the dense rows' bytes, more rows over it
        eng = engine_lib.Engine(
            loaded.params, loaded.cfg, (_MAX_ROWS.value or 4 * slots) if run.page_size
            else slots, run.max_seq_len, sampling=run.sampling, eos_ids=eos,
            steps_per_sync=_STEPS_PER_SYNC.value, seed=run.sampling.seed,
            speculative=run.speculative, draft=draft, page_size=run.page_size,
            num_pages=pool_pages(run, slots) if run.page_size else 0,
            prefix_cache=_PREFIX_CACHE.value)
        if _REQUESTS_FILE.value:
            reqs, skipped = file_requests(_REQUESTS_FILE.value, tok)
        else:
            reqs, skipped = corpus_requests(
                tok, num, _SEED.value, _PROMPT_MEDIAN.value, _PROMPT_MIN.value,
                min(_PROMPT_MAX.value, run.max_seq_len - new_max), _NEW_MIN.value,
                new_max), []
        if run.chat_template:  # the text as the user's turn: one system turn for all
            system = run.system_prompt
            if run.system_prompt_file is not None:
                with open(run.system_prompt_file, encoding="utf-8") as f:
                    system = f.read()
            reqs = chat_requests(reqs, tok, system)
        reqs, more = screen(eng, reqs)
        skipped += more
        reqs = poisson_arrivals(reqs, _ARRIVAL_RATE.value, _SEED.value)
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
    t_run = time.perf_counter()
    done, stats = eng.run(reqs, on_finish=(lambda c: bar.update(1)) if bar else None)
    t_ran = time.perf_counter()
    if bar:
        bar.close()
    summary = summarize(done, stats)
    summary["arrival_rate"] = _ARRIVAL_RATE.value
    summary.update(compressed_pool(loaded.cfg, stats.allocated_kv_bytes, run.page_size,
                                   run.max_seq_len))
    if _COMPARE.value:
        summary["compare_plain"] = compare_plain(loaded, run, reqs, slots,
                                                 new_max, _STEPS_PER_SYNC.value)
    # the whole command beside the serving window (wall_s): setup (config, weights
    # loaded or downloaded, the planner's measurements, the requests), the engine's
    # compiles before its clock starts, and the comparison when asked for
    summary.update(setup_s=t_run - t_start, warmup_s=max(t_ran - t_run - stats.wall_s, 0.0),
                   command_wall_s=time.perf_counter() - t_start)
    print(report(summary, skipped))
    if _JSON_OUT.value:
        summary["skipped"] = [dataclasses.asdict(s) for s in skipped]
        summary["completions"] = [completion_json(c, tok) for c in done]
        with open(_JSON_OUT.value, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {_JSON_OUT.value}")
    return 0


if __name__ == "__main__":
    cli.run(main)
