"""The long-context grid shared by ``experiments.longeval`` and ``experiments.ablate``:
the trained context of a run, the grid's checks, the resumable per-sample loop over
:func:`kvjax.training.longcontext.evaluate_sample` and the summary of its records.

One implementation of the protocol's bookkeeping, so that a lever's numbers in an
ablation row are longeval's numbers for the same config and samples (issue 56 item 5).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from kvjax import naming
from kvjax.training import longcontext as lc

SMOLLM2_TRAINED_CONTEXT = 8192
"""SmolLM2-135M-Instruct's trained positions (its GGUF's llama.context_length, HF
config.json max_position_embeddings); checked against the loaded checkpoint."""


def trained_context(run) -> int | None:
    """The positions the run's weights were trained for, read without loading them:
    SmolLM2's 8,192; a Hugging Face folder's config.json max_position_embeddings; None
    for random weights."""
    if run.weights == "smollm2":
        return SMOLLM2_TRAINED_CONTEXT
    if run.weights == "hf":
        p = pathlib.Path(run.weights_path) / "config.json"
        try:
            return int(json.loads(p.read_text()).get("max_position_embeddings") or 0) or None
        except (OSError, ValueError):
            return None
    return None


def parse_grid(tasks, lengths, depths, samples) -> tuple:
    """(tasks, lengths as ints, depths as floats, samples) from the flags' strings.

    Raises:
      lc.TaskError: a value that is not a task, an integer length or a number depth, or
        any value :func:`lc.check_task_args` refuses.
    """
    try:
        lengths = [int(x) for x in lengths]
    except ValueError:
        raise lc.TaskError(f"--lengths={','.join(lengths)}; allowed: positive integers "
                           "(tokens)") from None
    try:
        depths = [float(x) for x in depths]
    except ValueError:
        raise lc.TaskError(f"--depths={','.join(depths)}; allowed: numbers in [0, 1]") from None
    lc.check_task_args(tasks, lengths, depths, samples)
    return list(tasks), sorted(set(lengths)), sorted(set(depths)), samples


def check_lengths(lengths, max_seq_len: int | None, context: int | None, beyond: bool) -> None:
    """Raises lc.TaskError for a length past ``max_seq_len`` (None: no cap) or past the
    trained ``context`` (None: unknown) without ``beyond``."""
    for n in lengths:
        if max_seq_len is not None and n > max_seq_len:
            raise lc.TaskError(f"length {n} exceeds --config.max_seq_len={max_seq_len}; "
                               f"allowed: lengths <= {max_seq_len}")
        if context is not None and n > context and not beyond:
            raise lc.TaskError(
                f"length {n} exceeds the checkpoint's trained context of {context} "
                f"positions; allowed: lengths <= {context}, or --allow_beyond_context "
                "(cells marked beyond_context)")


def run_key(cfg) -> str:
    """What the resume log keys a config by: its variant, cache dtype, rope positions."""
    return (f"{naming.variant_name(cfg)} kv={cfg.kv_dtype or cfg.dtype} "
            f"rope={cfg.rope_positions}")


def sample_key(key: str, task: str, length: int, depth: float, index: int, seed: int,
               query_first: bool) -> str:
    return json.dumps([key, task, length, depth, index, seed, query_first])


def read_log(path: pathlib.Path) -> dict:
    """{sample key: record} of a samples.jsonl (a torn last line is dropped)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            out[r["key"]] = r
    return out


def summarize(records: list, tasks, lengths, depths, context: int | None) -> dict:
    """The result JSON of sample records: per task, per cell, per length, and the means.
    ``accuracy`` is the mean RULER score (Wilson 95% interval over the samples, the
    scores summed as successes); ``answer_nll`` the mean of the samples' nats per token
    (t interval)."""
    def stats(rs):
        s = [r["score"] for r in rs]
        nll = [r["answer_nll"] for r in rs]
        lo, hi = lc.wilson_interval(float(sum(s)), len(s))
        m, nlo, nhi = lc.mean_interval(nll)
        return dict(samples=len(rs), accuracy=float(np.mean(s)), accuracy_ci=[lo, hi],
                    answer_nll=m, answer_nll_ci=[nlo, nhi])

    per_task, cells, per_length = {}, [], {}
    for t in tasks:
        rs = [r for r in records if r["task"] == t]
        if rs:
            per_task[t] = stats(rs)
        for n in lengths:
            for d in depths:
                c = [r for r in rs if r["length"] == n and r["depth"] == d]
                if not c:
                    continue
                st = stats(c)
                cells.append(dict(
                    task=t, length=n, depth=d, samples=st["samples"],
                    accuracy=st["accuracy"], accuracy_low=st["accuracy_ci"][0],
                    accuracy_high=st["accuracy_ci"][1], answer_nll=st["answer_nll"],
                    answer_nll_low=st["answer_nll_ci"][0],
                    answer_nll_high=st["answer_nll_ci"][1],
                    kv_bytes_theory=c[0]["kv_bytes_theory"],
                    kv_bytes_allocated=c[0]["kv_bytes_allocated"],
                    prefill_seconds=float(np.median([r["prefill_seconds"] for r in c])),
                    decode_seconds=float(np.median([r["decode_seconds"] for r in c])),
                    beyond_context=bool(context and n > context)))
    for n in lengths:
        rs = [r for r in records if r["length"] == n]
        if rs:
            per_length[str(n)] = dict(
                samples=len(rs), accuracy=float(np.mean([r["score"] for r in rs])),
                kv_bytes_theory=rs[0]["kv_bytes_theory"],
                kv_bytes_allocated=rs[0]["kv_bytes_allocated"],
                seconds_per_sample=float(np.median(
                    [r["prefill_seconds"] + r["decode_seconds"] for r in rs])),
                beyond_context=bool(context and n > context))
    accs = [v["accuracy"] for v in per_task.values()]
    nlls = [v["answer_nll"] for v in per_task.values()]
    scores = [r["score"] for r in records]
    return dict(mean_accuracy=float(np.mean(accs)) if accs else None,
                mean_accuracy_ci=list(lc.wilson_interval(float(sum(scores)), len(scores)))
                if scores else None,
                mean_answer_nll=float(np.mean(nlls)) if nlls else None,
                tasks=per_task, cells=cells, lengths=per_length)


def run_samples(params, cfg, tokenizer, tasks, lengths, depths, samples: int, seed: int,
                query_first: bool, log_path: pathlib.Path, key: str,
                progress: bool = True, protocol: str = "context",
                page_size: int = 0) -> list:
    """Scores every task x length x depth x sample not yet in ``log_path`` (a JSONL resume
    log, appended one line per sample as it finishes) and returns the records of the
    whole grid, in grid order. ``key``: the config's :func:`run_key`. ``page_size``: a
    read-time page selection's (Quest's) tokens per page (``lc.evaluate_sample``)."""
    from tqdm import tqdm  # noqa: PLC0415

    done = read_log(log_path)
    skey = lambda t, n, d, i: sample_key(key, t, n, d, i, seed, query_first)
    grid = [(n, t, d, i) for n in lengths for t in tasks for d in depths
            for i in range(samples)]
    todo = [g for g in grid if skey(g[1], g[0], g[2], g[3]) not in done]
    print(f"model: {key}; {len(grid)} samples, {len(grid) - len(todo)} already in {log_path}")
    eos = tokenizer.eos_token_ids
    resolved = {}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log, tqdm(total=len(todo), unit="sample", dynamic_ncols=True,
                                         disable=not progress) as bar:
        for n, t, d, i in todo:
            if n not in resolved:
                resolved = {n: lc.resolve_config(cfg, n)}
            smp = lc.generate_sample(t, tokenizer, n, d, seed, i, query_first)
            res = lc.evaluate_sample(params, resolved[n], smp, tokenizer, eos,
                                     protocol=protocol, page_size=page_size)
            q = res.questions[0]
            rec = dict(key=skey(t, n, d, i), variant=key, task=t, length=n, depth=d, index=i,
                       seed=seed, query_first=query_first, score=res.score,
                       answer_nll=res.answer_nll, prediction=q.prediction,
                       references=list(smp.questions[0].references),
                       prompt_tokens=smp.prompt_len, needle_positions=smp.needle_positions,
                       kv_bytes_theory=res.kv_bytes_theory,
                       kv_bytes_allocated=res.kv_bytes_allocated,
                       cache_slots=res.cache_slots, prefill_seconds=res.prefill_seconds,
                       decode_seconds=res.decode_seconds)
            if res.kv_bytes_read is not None:
                rec["kv_bytes_read"] = res.kv_bytes_read
            log.write(json.dumps(rec) + "\n")
            log.flush()
            done[rec["key"]] = rec
            bar.set_postfix_str(f"{t} L={n} d={d:g} score={res.score:.2f}")
            bar.update()
    return [done[skey(t, n, d, i)] for n, t, d, i in grid]


def sample_id(rec: dict) -> str:
    """A record's sample, whatever its config: [task, length, depth, index, seed,
    query_first] as JSON (the same sample under every lever)."""
    return json.dumps([rec["task"], rec["length"], rec["depth"], rec["index"], rec["seed"],
                       rec["query_first"]])


def sample_scores(records: list) -> dict:
    """{:func:`sample_id`: score} of ``records``: what a paired test matches runs by."""
    return {sample_id(r): r["score"] for r in records}


def protocol_key(key: str, protocol: str) -> str:
    """The resume log's key of a config's :func:`run_key` under ``protocol``."""
    return key + ("" if protocol == "context" else f" protocol={protocol}")


def shard_log(log_path: pathlib.Path, shard: tuple | None) -> pathlib.Path:
    """The log a shard (k, n) of a sweep appends to: ``samples.shard-k-of-n.jsonl`` beside
    ``log_path``; ``log_path`` itself without a shard."""
    if shard is None:
        return log_path
    return log_path.with_name(f"{log_path.stem}.shard-{shard[0]}-of-{shard[1]}"
                              f"{log_path.suffix}")


def read_logs(log_path: pathlib.Path) -> dict:
    """:func:`read_log` of ``log_path`` and of every shard's log beside it
    (:func:`shard_log`): what a sweep run in several processes has done."""
    out = {}
    for p in [log_path] + sorted(log_path.parent.glob(f"{log_path.stem}.shard-*"
                                                      f"{log_path.suffix}")):
        out.update(read_log(p))
    return out


def parse_shard(text: str | None) -> tuple | None:
    """'k/n' -> (k, n), None for None or ''.

    Raises:
      ValueError: not two integers with 0 <= k < n (named).
    """
    if not text:
        return None
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k < n:
        raise ValueError(f"--shard={text}; allowed: K/N with integers 0 <= K < N (this "
                         "process scores every N-th sample still to do, from the K-th)")
    return k, n


def shard_todo(todo: list, shard: tuple | None, score: bool) -> list:
    """What this process scores of ``todo``: every n-th item from the k-th under a shard
    (k, n), all of it without one, none when not scoring (``--summarize_only``)."""
    if not score:
        return []
    return todo if shard is None else todo[shard[0]::shard[1]]


def run_sweep(params, points, tokenizer, tasks, lengths, depths, samples: int, seed: int,
              query_first: bool, log_path: pathlib.Path, protocols,
              progress: bool = True, shard: tuple | None = None,
              score: bool = True) -> dict:
    """:func:`run_samples` for many levers on one prefill per sample
    (:func:`lc.evaluate_sweep`): every sample of the grid not yet in ``log_path`` under
    every point x protocol is scored once and each (point, protocol) appended as its own
    record, keyed as a single-config run of that point would key it
    (:func:`protocol_key` of :func:`run_key`), so a sweep's log and single runs' logs
    resume each other. Samples go index first (every task and depth of index 0, then
    index 1, ...), so a sweep cut short holds a balanced grid.

    Args:
      points: unresolved configs, one per lever (each is resolved per length).
      protocols: a subset of ``lc.PROTOCOLS``.
      shard: (k, n): score only the samples to do at positions k, k + n, ... of the
        grid's remaining ones, appending to :func:`shard_log` (n processes share the
        work; every log beside ``log_path`` counts as done).
      score: False: score nothing, return what the logs hold (a sweep cut short).
    Returns:
      {(protocol, point index): records of the samples done, in grid order}.
    """
    from tqdm import tqdm  # noqa: PLC0415

    done = read_logs(log_path)
    keys = {(pr, i): protocol_key(run_key(p), pr) for pr in protocols
            for i, p in enumerate(points)}
    grid = [(n, t, d, i) for n in lengths for i in range(samples) for t in tasks
            for d in depths]
    skey = lambda k, g: sample_key(k, g[1], g[0], g[2], g[3], seed, query_first)
    todo = [g for g in grid if any(skey(k, g) not in done for k in keys.values())]
    print(f"sweep: {len(points)} levers x {len(protocols)} protocols; {len(grid)} samples, "
          f"{len(grid) - len(todo)} already in {log_path} and its shards' logs")
    todo = shard_todo(todo, shard, score)
    eos = tokenizer.eos_token_ids
    resolved = {}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(shard_log(log_path, shard), "a") as log, \
            tqdm(total=len(todo), unit="sample", dynamic_ncols=True,
                 disable=not progress) as bar:
        for g in todo:
            n, t, d, i = g
            if n not in resolved:
                resolved = {n: [lc.resolve_config(p, n) for p in points]}
            smp = lc.generate_sample(t, tokenizer, n, d, seed, i, query_first)
            res = lc.evaluate_sweep(params, resolved[n], smp, tokenizer, eos, protocols)
            for (pr, j), r in res.items():
                k = skey(keys[(pr, j)], g)
                if k in done:
                    continue
                q = r.questions[0]
                rec = dict(key=k, variant=keys[(pr, j)], task=t, length=n, depth=d,
                           index=i, seed=seed, query_first=query_first, score=r.score,
                           answer_nll=r.answer_nll, prediction=q.prediction,
                           references=list(smp.questions[0].references),
                           prompt_tokens=smp.prompt_len,
                           needle_positions=smp.needle_positions,
                           kv_bytes_theory=r.kv_bytes_theory,
                           kv_bytes_allocated=r.kv_bytes_allocated,
                           cache_slots=r.cache_slots, prefill_seconds=r.prefill_seconds,
                           decode_seconds=r.decode_seconds, shared_prefill=True)
                log.write(json.dumps(rec) + "\n")
                done[k] = rec
            log.flush()
            bar.set_postfix_str(f"{t} L={n} d={d:g} i={i}")
            bar.update()
    return {kk: [done[skey(k, g)] for g in grid if skey(k, g) in done]
            for kk, k in keys.items()}


# ------------------------------------------------ perplexity of each lever on its cache


def ppl_key(key: str, length: int, tail: int, index: int, source: str) -> str:
    """The perplexity log's key of a config's :func:`run_key` on text ``index`` of L =
    ``length`` tokens from ``source`` (the corpus and split), its last ``tail`` scored."""
    return json.dumps([key, "ppl", length, tail, index, source])


def tail_record(key: str, variant: str, res, length: int, tail: int, index: int) -> dict:
    """One text's line of the perplexity log from an ``lc.TailResult``."""
    return dict(key=key, variant=variant, length=length, tail=tail, index=index,
                nll_total=float(res.nll.sum()), tokens=int(res.nll.size),
                kv_bytes_theory=res.kv_bytes_theory,
                kv_bytes_allocated=res.kv_bytes_allocated, cache_slots=res.cache_slots,
                seconds=res.seconds)


def run_sweep_ppl(params, points, texts: np.ndarray, tail: int, log_path: pathlib.Path,
                  source: str, progress: bool = True, shard: tuple | None = None,
                  score: bool = True) -> dict:
    """The tail perplexity (``lc.sweep_tail_nll``) of every point on one prefill per text,
    resumable as :func:`run_sweep` is: each text not yet in ``log_path`` (a JSONL, every
    shard's log beside it read too) for every point is scored once and each point's
    result appended as its own record (:func:`tail_record`, keyed by :func:`ppl_key`).

    Args:
      points: unresolved configs (each is resolved for L).
      texts: [N, L] int32, the corpus's first N windows of L tokens.
      tail: M, the scored last tokens of each text.
      source: names the corpus and split in the keys.
      shard, score: as :func:`run_sweep`'s.
    Returns:
      {point index: records of the texts done, in text order}.
    """
    from tqdm import tqdm  # noqa: PLC0415

    n, length = texts.shape
    lc.check_tail(length, tail)
    done = read_logs(log_path)
    keys = [run_key(p) for p in points]
    pkey = lambda k, j: ppl_key(k, length, tail, j, source)
    todo = [j for j in range(n) if any(pkey(k, j) not in done for k in keys)]
    print(f"perplexity: {len(points)} levers, last {tail} of {length} tokens; {n} texts, "
          f"{n - len(todo)} already in {log_path} and its shards' logs")
    todo = shard_todo(todo, shard, score)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    resolved = [lc.resolve_config(p, length) for p in points] if todo else []
    with open(shard_log(log_path, shard), "a") as log, \
            tqdm(total=len(todo), unit="text", dynamic_ncols=True,
                 disable=not progress) as bar:
        for j in todo:
            res = lc.sweep_tail_nll(params, resolved, [int(x) for x in texts[j]], tail)
            for i, r in res.items():
                k = pkey(keys[i], j)
                if k not in done:
                    done[k] = tail_record(k, keys[i], r, length, tail, j)
                    log.write(json.dumps(done[k]) + "\n")
            log.flush()
            bar.update()
    return {i: [done[pkey(k, j)] for j in range(n) if pkey(k, j) in done]
            for i, k in enumerate(keys)}


def summarize_ppl(records: list) -> dict | None:
    """The ``ppl`` entry of a result from its texts' records (:func:`tail_record`):
    perplexity exp(sum NLL / sum tokens) over every scored token, the mean NLL in nats
    per token with a t interval over the texts (each text's mean) and that interval
    exponentiated, the texts, tokens, L (``context``), M (``tail``) and KV bytes
    (theory's at L, allocated); None without records."""
    if not records:
        return None
    total = sum(r["nll_total"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    m, lo, hi = lc.mean_interval([r["nll_total"] / r["tokens"] for r in records])
    return dict(ppl=float(np.exp(total / tokens)), nll=total / tokens,
                nll_ci=[lo, hi], ppl_ci=[float(np.exp(lo)), float(np.exp(hi))],
                texts=len(records), tokens=tokens, context=records[0]["length"],
                tail=records[0]["tail"], measure="tail",
                kv_bytes_theory=records[0]["kv_bytes_theory"],
                kv_bytes_allocated=records[0]["kv_bytes_allocated"],
                seconds=float(np.median([r["seconds"] for r in records])))


def tail_ppl(params, cfg, texts: np.ndarray, tail: int) -> dict:
    """:func:`summarize_ppl` of one config alone on every text (``lc.tail_nll``: its own
    prefill, the path a single-config run takes); ``texts`` [N, L] int32."""
    n, length = texts.shape
    lc.check_tail(length, tail)
    rcfg = lc.resolve_config(cfg, length)
    key = run_key(cfg)
    return summarize_ppl([
        tail_record(key, key, lc.tail_nll(params, rcfg, [int(x) for x in texts[j]], tail),
                    length, tail, j) for j in range(n)])
