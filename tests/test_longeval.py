"""Long-context tasks (kvjax.training.longcontext) and experiments.longeval: exact
lengths, needle depths, scoring, the answer NLL against a direct forward, the protocol
end to end on a tiny random model, and the refusals."""

import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvjax.checkpoints.tokenizer import Tokenizer
from kvjax.compression import CompressionConfig
from kvjax.analysis import theory
from kvjax.models import model
from kvjax.training import longcontext as lc
from kvjax.training import longgrid
from tests.conftest import import_entry_point, tiny_config

CORPUS = [lc.NOISE] * 4 + ["0123456789 VAR = JSON key value", lc.PASSKEY_INTRO, lc.NIAH_INTRO,
                           " ".join(lc.word_list("noun")), " ".join(lc.word_list("adjective")),
                           "What are all the special magic numbers for mentioned in the "
                           "provided text? The special magic numbers for are"] * 2


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE trained here (every text encodes), SmolLM2's special ids 0-2."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=3000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return Tokenizer(hf, 1, 2, special_token_ids=(0, 1, 2), eos_token_ids=(0, 2))


@pytest.fixture(scope="module")
def tiny(tok):
    cfg = tiny_config(vocab_size=tok.vocab_size, tie_embeddings=False, num_layers=1)
    params = model.params_for(cfg, model.init_params(cfg.replace(scan_layers=True), 0))
    return params, cfg


def find(seq, sub):
    """Start indices of ``sub`` in ``seq``."""
    n = len(sub)
    return [i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub]


LENGTH = {"cwe": 1400, "fwe": 1400, "kv_retrieval": 1400, "niah_multiquery": 1000,
          "niah_multivalue": 1000}


@pytest.mark.parametrize("task", list(lc.TASKS))
@pytest.mark.parametrize("query_first", [False, True])
def test_exact_length_and_seeded(tok, task, query_first):
    n = LENGTH.get(task, 900)
    a = lc.generate_sample(task, tok, n, 0.3, seed=5, query_first=query_first)
    assert len(a.context_ids) == n - lc.RESERVE  # whatever the task: one prefill program
    assert len(a.questions[0].ids) <= lc.QUESTION_ROOM
    assert len(a.questions[0].answer_ids) <= a.max_new_tokens
    b = lc.generate_sample(task, tok, n, 0.3, seed=5, query_first=query_first)
    c = lc.generate_sample(task, tok, n, 0.3, seed=6, query_first=query_first)
    assert a.context_ids == b.context_ids and a.questions[0].ids == b.questions[0].ids
    assert a.context_ids != c.context_ids
    if query_first:  # the question comes first too
        assert tok.decode(a.context_ids).startswith(a.questions[0].plain)
    refs = a.questions[0].references
    text = tok.decode(a.context_ids)
    assert refs and all(r in text for r in refs)  # every answer is in the context


@pytest.mark.parametrize("task,needle", [
    ("passkey", "The pass key is {0}. Remember it. {0} is the pass key."),
    ("niah_single", None), ("copy", None)])
@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_needle_at_the_requested_depth(tok, task, needle, depth):
    s = lc.generate_sample(task, tok, 900, depth, seed=1)
    q = s.questions[0]
    intro = {"passkey": lc.PASSKEY_INTRO, "niah_single": lc.NIAH_INTRO,
             "copy": lc.COPY_INTRO}[task]
    if task == "niah_single":
        key = q.plain.split(" for ")[1].split(" mentioned")[0]
        needle = f"One of the special magic numbers for {key} is: {q.references[0]}."
    elif task == "copy":
        needle = "Here is a list of words to copy: " + " ".join(
            q.text.split(": ")[1].split(" ") + list(q.references)) + "."
    else:
        needle = needle.format(q.references[0])
    ids = tok.encode(" " + needle)
    assert find(s.context_ids, ids) == s.needle_positions  # exactly once, where it says
    pre = len(tok.encode(intro))
    filler = len(s.context_ids) - pre - len(ids)
    assert s.needle_positions[0] - pre == round(depth * filler)
    # the answer's text is in the context exactly once (passkey: its needle says it twice)
    text = tok.decode(s.context_ids)
    assert text.count(q.references[0]) == (2 if task == "passkey" else 1)


def test_distractors_and_kv_depth(tok):
    s = lc.generate_sample("niah_multikey", tok, 1000, 0.5, seed=2)
    text = tok.decode(s.context_ids)
    assert text.count("One of the special magic numbers for") == lc.NEEDLES
    assert text.count(s.questions[0].references[0]) == 1
    for depth in (0.0, 0.5, 1.0):
        s = lc.generate_sample("kv_retrieval", tok, 1400, depth, seed=3)
        key = s.questions[0].plain.split('"')[1]
        text = tok.decode(s.context_ids)
        assert text.count(key) == 1 and text.count(s.questions[0].references[0]) == 1
        body = tok.decode(s.context_ids[:s.needle_positions[0]])
        n = text.count('": "')
        assert abs(body.count('": "') - depth * (n - 1)) <= 0.5  # the pair nearest depth


def test_aggregation_references_are_the_most_frequent(tok):
    s = lc.generate_sample("cwe", tok, 1400, 0.5, seed=4)
    words = [line.split(". ", 1)[1] for line in tok.decode(s.context_ids).split("\n")
             if ". " in line and line.split(". ")[0].isdigit()]
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=lambda w: -counts[w])[:lc.CWE_WORDS]
    assert set(top) == set(s.questions[0].references)
    assert min(counts[w] for w in top) > max(
        (c for w, c in counts.items() if w not in top), default=0)
    s = lc.generate_sample("fwe", tok, 1400, 0.5, seed=4)
    body = tok.decode(s.context_ids).split("coded words.")[1].split()
    counts = {w: body.count(w) for w in set(body)}
    top = sorted(counts, key=lambda w: -counts[w])
    assert list(s.questions[0].references) == top[:lc.FWE_WORDS]


def test_scoring_hand_made_cases():
    assert lc.string_match_all("The pass key is 12345.", ["12345"]) == 1.0
    assert lc.string_match_all("1234", ["12345"]) == 0.0
    assert lc.string_match_all("ALPHA, gamma", ["alpha", "beta", "Gamma", "delta"]) == 0.5
    assert lc.string_match_part("ALPHA, gamma", ["beta", "gamma"]) == 1.0
    assert lc.string_match_part("none", ["beta", "gamma"]) == 0.0
    with pytest.raises(ValueError, match="no reference"):
        lc.string_match_all("x", [])


def test_wilson_and_t_intervals():
    # Wilson (1927) at 95%: 5 of 10 -> [0.2366, 0.7634]; 0 of 10 -> [0, 0.2775]
    lo, hi = lc.wilson_interval(5, 10)
    assert (round(lo, 4), round(hi, 4)) == (0.2366, 0.7634)
    lo, hi = lc.wilson_interval(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    m, lo, hi = lc.mean_interval([1.0, 2.0, 3.0])  # t(0.975, 2) = 4.3027, sd 1
    assert m == 2.0 and hi - m == pytest.approx(4.302653 / math.sqrt(3), rel=1e-5)
    with pytest.raises(ValueError, match="n=0"):
        lc.wilson_interval(0, 0)
    for n in range(1, 40):  # the estimate stays inside its interval at 0 and 1
        assert lc.wilson_interval(0, n)[0] == 0.0 and lc.wilson_interval(n, n)[1] == 1.0


def test_refusals_name_the_value(tok):
    with pytest.raises(lc.TaskError, match="unknown task 'needle'"):
        lc.check_task_args(["needle"], [1024], [0.5], 1)
    with pytest.raises(lc.TaskError, match="samples=0"):
        lc.check_task_args(["passkey"], [1024], [0.5], 0)
    with pytest.raises(lc.TaskError, match="depth 1.5"):
        lc.check_task_args(["passkey"], [1024], [1.5], 1)
    with pytest.raises(lc.TaskError, match="length=50 is too short for task 'passkey'"):
        lc.generate_sample("passkey", tok, 50, 0.5)
    with pytest.raises(lc.TaskError, match="length 9000 exceeds the checkpoint's trained"):
        longgrid.check_lengths([1024, 9000], None, 8192, beyond=False)
    longgrid.check_lengths([9000], None, 8192, beyond=True)
    with pytest.raises(lc.TaskError, match="length 2048 exceeds --config.max_seq_len=1024"):
        longgrid.check_lengths([2048], 1024, 8192, beyond=True)
    with pytest.raises(lc.TaskError, match="--depths=a"):
        longgrid.parse_grid(["passkey"], ["1024"], ["a"], 1)


@pytest.mark.parametrize("args,message", [
    (["--tasks=passkey,needle"], "unknown task 'needle'"),
    (["--samples=0"], "samples=0"),
    (["--depths=0.5,-0.1"], "depth -0.1"),
    (["--lengths=9000"], "length 9000 exceeds the checkpoint's trained context"),
    (["--lengths=2048", "--config.max_seq_len=1024"], "exceeds --config.max_seq_len=1024"),
    (["--config.model.kv_compression=quest", "--config.model.kv_budget=512"],
     "page_size=0"),
    (["--config.model.kv_compression=quest", "--config.model.kv_budget=520",
      "--config.page_size=16"], "model.kv_budget=520"),
    (["--sweep=snapkv"], "--sweep with a method and no --sweep_budgets"),
    (["--sweep=snapkv,bogus", "--sweep_budgets=512"], "kv_compression='bogus'"),
    (["--sweep=snapkv", "--sweep_budgets=16"], "model.kv_budget=16"),
    (["--sweep=none", "--sweep_protocols=later"], "--sweep_protocols=later"),
    (["--sweep=none", "--ppl", "--ppl_tokens=0"], "--ppl_tokens=0; allowed: an integer M "
     "with 1 <= M < L=2048"),
    (["--lengths=1024", "--ppl", "--ppl_tokens=1024"], "--ppl_tokens=1024; allowed"),
    (["--config.model.kv_compression=snapkv", "--config.model.kv_budget=512", "--ppl",
      "--lengths=1024", "--ppl_tokens=4096"], "--ppl_tokens=4096; allowed"),
    (["--ppl_tokens=64"], "--ppl_tokens or --ppl_texts without --ppl"),
    (["--sweep=none", "--ppl", "--ppl_texts=0"], "--ppl_texts=0; allowed"),
])
def test_entry_point_refuses_before_any_work(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "experiments.longeval",
                           "--config=configs/gqa.py", f"--out_dir={tmp_path}/out", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was written


def _direct_answer(params, cfg, s):
    """Greedy first token and answer NLL by one cache-free forward of the whole text."""
    q = s.questions[0]
    ids = s.context_ids + q.ids + q.answer_ids
    t = len(ids)
    logits, _ = model.forward(params, cfg, jnp.asarray([ids], jnp.int32),
                              jnp.arange(t, dtype=jnp.int32)[None])
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), -1), np.float64)
    start = len(s.context_ids) + len(q.ids)
    nll = -np.mean([lp[start - 1 + i, a] for i, a in enumerate(q.answer_ids)])
    return int(np.argmax(lp[start - 1])), nll


def test_answer_nll_and_greedy_match_a_direct_forward(tok, tiny):
    params, cfg = tiny
    s = lc.generate_sample("niah_single", tok, 600, 0.5, seed=0)
    r = lc.evaluate_sample(params, cfg, s, tok, tok.eos_token_ids)
    first, nll = _direct_answer(params, cfg, s)
    assert r.answer_nll == pytest.approx(nll, abs=1e-4)
    gen = r.questions[0].generated_ids
    assert gen[0] == first or (not gen and first in tok.eos_token_ids)
    assert r.questions[0].answer_tokens == len(s.questions[0].answer_ids)
    assert r.kv_bytes_allocated == r.kv_bytes_theory  # a dense cache of `length` slots
    assert r.cache_slots == 600


def test_a_window_that_keeps_every_token_scores_as_the_full_cache(tok, tiny):
    params, cfg = tiny
    s = lc.generate_sample("passkey", tok, 600, 0.2, seed=3)
    full = lc.evaluate_sample(params, cfg, s, tok, tok.eos_token_ids)
    win = lc.evaluate_sample(params, cfg.replace(window_size=600, num_sink_tokens=4), s, tok,
                             tok.eos_token_ids)
    assert win.questions[0].generated_ids == full.questions[0].generated_ids
    assert win.answer_nll == pytest.approx(full.answer_nll, abs=1e-5)
    assert win.score == full.score
    small = lc.evaluate_sample(params, cfg.replace(window_size=64), s, tok, tok.eos_token_ids)
    assert small.answer_nll != pytest.approx(full.answer_nll, abs=1e-3)  # it does evict
    assert small.kv_bytes_allocated * 600 == full.kv_bytes_allocated * 64


@pytest.mark.parametrize("protocol", lc.PROTOCOLS)
def test_a_compressed_cache_through_the_harness(tok, tiny, protocol):
    """Lever 5 in the harness: a budget that keeps every token scores as the full cache
    (both protocols), a small one allocates its theory and changes the answer's NLL."""
    params, cfg = tiny
    knobs = CompressionConfig(observation_window=16)
    s = lc.generate_sample("passkey", tok, 600, 0.5, seed=3)
    full = lc.evaluate_sample(params, cfg, s, tok, tok.eos_token_ids)
    keep = lc.evaluate_sample(params, cfg.replace(kv_compression="snapkv", kv_budget=600,
                                                  compression=knobs), s, tok,
                              tok.eos_token_ids, protocol=protocol)
    assert keep.questions[0].generated_ids == full.questions[0].generated_ids
    assert keep.answer_nll == pytest.approx(full.answer_nll, abs=1e-4)
    small_cfg = cfg.replace(kv_compression="snapkv", kv_budget=64, compression=knobs)
    small = lc.evaluate_sample(params, small_cfg, s, tok, tok.eos_token_ids,
                               protocol=protocol)
    assert small.kv_bytes_allocated == small.kv_bytes_theory == \
        theory.kv_cache_bytes(small_cfg, 600)
    assert small.cache_slots == 64 + knobs.recent_slots
    assert small.answer_nll != pytest.approx(full.answer_nll, abs=1e-3)  # it does evict


def test_several_questions_on_one_prefill_equal_separate_runs(tok, tiny):
    params, cfg = tiny
    a = lc.generate_sample("passkey", tok, 600, 0.5, seed=7)
    b = lc.generate_sample("passkey", tok, 600, 0.5, seed=8)
    both = lc.Sample(**{**a.__dict__, "questions": [a.questions[0], b.questions[0]]})
    r = lc.evaluate_sample(params, cfg, both, tok, tok.eos_token_ids)
    sb = lc.Sample(**{**a.__dict__, "questions": [b.questions[0]]})
    rb = lc.evaluate_sample(params, cfg, sb, tok, tok.eos_token_ids)
    assert r.questions[1].answer_nll == pytest.approx(rb.answer_nll, abs=1e-6)
    assert r.questions[1].generated_ids == rb.questions[0].generated_ids


def test_tiny_model_end_to_end_and_resume(tok, tiny, tmp_path, capsys):
    params, cfg = tiny
    le = import_entry_point("longeval")
    log = tmp_path / "samples.jsonl"
    args = (params, cfg, tok, ["passkey", "copy"], [600], [0.0, 1.0], 2, 0, False, log, "k")
    recs = longgrid.run_samples(*args, progress=False)
    assert len(recs) == 8 and len(log.read_text().splitlines()) == 8
    again = longgrid.run_samples(*args, progress=False)  # resumed: nothing recomputed
    assert len(log.read_text().splitlines()) == 8 and again == recs
    out = longgrid.summarize(recs, ["passkey", "copy"], [600], [0.0, 1.0], context=None)
    for t in ("passkey", "copy"):
        v = out["tasks"][t]
        assert v["samples"] == 4 and 0.0 <= v["accuracy"] <= 1.0
        assert v["answer_nll"] == pytest.approx(
            np.mean([r["answer_nll"] for r in recs if r["task"] == t]))
        assert v["accuracy_ci"][0] <= v["accuracy"] <= v["accuracy_ci"][1]
    assert out["mean_accuracy"] == pytest.approx(
        np.mean([out["tasks"][t]["accuracy"] for t in ("passkey", "copy")]))
    assert len(out["cells"]) == 4 and out["cells"][0]["kv_bytes_allocated"] > 0
    le.write_csv(tmp_path / "c.csv", out["cells"])
    assert len((tmp_path / "c.csv").read_text().splitlines()) == 5
    assert [p.name for p in le.plot_heatmaps(out["cells"], tmp_path, "tiny")] == [
        "heatmap_passkey.png", "heatmap_copy.png"]
    json.dumps(out)  # JSON-ready
    cells = le.common_cells([out, dict(out, cells=out["cells"][:1])])
    assert cells == {("passkey", 600, 0.0)}
    acc, lo, hi, n = le.shared_accuracy(out, cells)
    assert n == 2 and acc == pytest.approx(np.mean(
        [r["score"] for r in recs if r["task"] == "passkey" and r["depth"] == 0.0]))


# ------------------------------------------------ experiments.ablate's long-context columns

GRID = (["passkey", "copy"], [600], [0.5], 1)


def _columns(ablate, params, cfg, tok, path, key, context=None, beyond=False):
    grid = ablate.longctx_grid(*GRID, 0, "context", context, beyond)
    return ablate.longctx_columns(params, cfg, tok, grid, path, key, progress=False)


def test_ablate_longctx_columns_equal_longeval(tok, tiny, tmp_path):
    """A row's long-context columns are longeval's numbers for the same config and
    samples, and the direct protocol's (evaluate_sample per sample, averaged by hand)."""
    params, cfg = tiny
    ablate = import_entry_point("ablate")
    cols = _columns(ablate, params, cfg, tok, tmp_path / "a.jsonl", "row")
    recs = longgrid.run_samples(params, cfg, tok, *GRID, 0, False, tmp_path / "b.jsonl",
                                "k", progress=False)
    out = longgrid.summarize(recs, *GRID[:3], context=None)
    assert cols["longctx_accuracy"] == out["mean_accuracy"]
    assert cols["longctx_accuracy_ci"] == out["mean_accuracy_ci"]
    assert cols["longctx_answer_nll"] == pytest.approx(out["mean_answer_nll"], abs=1e-9)
    assert cols["longctx_samples"] == 2 and cols["longctx_length"] == 600
    by_task = {t: [lc.evaluate_sample(params, lc.resolve_config(cfg, 600),
                                      lc.generate_sample(t, tok, 600, d, 0, 0), tok,
                                      tok.eos_token_ids) for d in GRID[2]]
               for t in ("passkey", "copy")}
    assert cols["longctx_accuracy"] == pytest.approx(
        np.mean([np.mean([r.score for r in rs]) for rs in by_task.values()]))
    assert cols["longctx_answer_nll"] == pytest.approx(
        np.mean([np.mean([r.answer_nll for r in rs]) for rs in by_task.values()]), abs=1e-5)
    for t, rs in by_task.items():
        assert cols["longctx_tasks"][t]["accuracy"] == np.mean([r.score for r in rs])
    k = sum(r.score for rs in by_task.values() for r in rs)
    assert cols["longctx_accuracy_ci"] == pytest.approx(list(lc.wilson_interval(k, 2)))
    assert cols["longctx_kv_bytes"] == theory.kv_cache_bytes(cfg, 600) == \
        cols["longctx_kv_bytes_allocated"]
    assert cols["beyond_trained_context"] is False


def test_ablate_refuses_a_length_past_the_trained_context_and_marks_it(tok, tiny, tmp_path):
    params, cfg = tiny
    ablate = import_entry_point("ablate")
    with pytest.raises(lc.TaskError, match="length 600 exceeds the checkpoint's trained "
                       "context of 512 positions.*rows marked beyond_trained_context"):
        ablate.longctx_grid(*GRID, 0, "context", 512, False)
    cols = _columns(ablate, params, cfg, tok, tmp_path / "a.jsonl", "row", 512, True)
    assert cols["beyond_trained_context"] is True
    inside = _columns(ablate, params, cfg, tok, tmp_path / "a.jsonl", "row", 600, False)
    assert inside["beyond_trained_context"] is False
    row = dict(ablate.row_for("tiny", "kv heads", cfg, 16), ppl=2.0, bits_per_byte=1.0,
               kv_bytes_measured=1, **cols)
    assert "600 (beyond trained context)" in ablate.markdown_table([row])


def test_ablate_a_window_that_keeps_every_token_scores_as_the_full_cache(tok, tiny,
                                                                          tmp_path):
    params, cfg = tiny
    ablate = import_entry_point("ablate")
    full = _columns(ablate, params, cfg, tok, tmp_path / "l.jsonl", "full")
    for w, sinks in ((600, 0), (1024, 4)):
        win = _columns(ablate, params, cfg.replace(window_size=w, num_sink_tokens=sinks),
                       tok, tmp_path / "l.jsonl", f"W={w}")
        assert win["longctx_accuracy"] == full["longctx_accuracy"]
        for t, v in full["longctx_tasks"].items():
            assert win["longctx_tasks"][t]["accuracy"] == v["accuracy"]
            assert win["longctx_tasks"][t]["answer_nll"] == pytest.approx(v["answer_nll"],
                                                                          abs=1e-5)
        assert win["longctx_answer_nll"] == pytest.approx(full["longctx_answer_nll"],
                                                          abs=1e-5)
    small = _columns(ablate, params, cfg.replace(window_size=64), tok,
                     tmp_path / "l.jsonl", "W=64")
    assert small["longctx_answer_nll"] != pytest.approx(full["longctx_answer_nll"],
                                                         abs=1e-3)  # it does evict
    assert small["longctx_kv_bytes"] * 600 == full["longctx_kv_bytes"] * 64


@pytest.mark.parametrize("args, message", [
    (["--longctx_lengths=9000"], "length 9000 exceeds the checkpoint's trained context of "
     "8192 positions"),
    (["--longctx_tasks=passkey,needle"], "unknown task 'needle'"),
    (["--longctx_samples=0"], "samples=0"),
    (["--kv_compression=snap"], "model.kv_compression='snap'"),
    (["--kv_budgets=big"], "--kv_budgets=big; allowed: positive integers"),
    (["--longctx_tasks=", "--kv_compression=snapkv"], "--kv_compression=snapkv with "
     "--longctx_tasks empty"),
])
def test_ablate_refuses_bad_longctx_flags_before_any_work(tmp_path, args, message):
    proc = subprocess.run([sys.executable, "-m", "experiments.ablate",
                           f"--out_dir={tmp_path}/out", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was written


@pytest.mark.parametrize("protocol", lc.PROTOCOLS)
def test_a_sweep_on_one_prefill_equals_each_single_config_run(tok, tiny, protocol):
    """evaluate_sweep: one prefill, every method x budget (and the full cache) scored as
    evaluate_sample scores each config alone on the same sample."""
    params, cfg = tiny
    cfg = cfg.replace(scan_layers=False)  # PyramidKV's layers keep their own budgets
    params = model.params_for(cfg, params)
    knobs = CompressionConfig(observation_window=16, recent_slots=48)
    s = lc.generate_sample("passkey", tok, 600, 0.5, seed=3)
    # a query-free method, every prompt query (H2O), a window's and per-layer budgets
    points = [cfg] + [cfg.replace(kv_compression=m, kv_budget=b, compression=knobs)
                      for m, b in (("streaming_llm", 32), ("h2o", 96), ("pyramidkv", 64))]
    swept = lc.evaluate_sweep(params, points, s, tok, tok.eos_token_ids, (protocol,))
    assert sorted(swept) == [(protocol, i) for i in range(len(points))]
    nlls = set()
    for i, p in enumerate(points):
        alone = lc.evaluate_sample(params, p, s, tok, tok.eos_token_ids, protocol=protocol)
        got = swept[(protocol, i)]
        assert got.questions[0].generated_ids == alone.questions[0].generated_ids, i
        assert got.answer_nll == pytest.approx(alone.answer_nll, abs=1e-5), i
        assert got.score == alone.score
        assert (got.kv_bytes_allocated, got.kv_bytes_theory, got.cache_slots) == \
            (alone.kv_bytes_allocated, alone.kv_bytes_theory, alone.cache_slots)
        nlls.add(round(got.answer_nll, 4))
    assert len(nlls) == len(points)  # the points do differ


def test_a_sweep_refuses_a_window_and_an_unknown_protocol(tok, tiny):
    params, cfg = tiny
    s = lc.generate_sample("passkey", tok, 600, 0.5, seed=3)
    with pytest.raises(ValueError, match="window_size=64"):
        lc.evaluate_sweep(params, [cfg.replace(window_size=64)], s, tok)
    with pytest.raises(ValueError, match="protocols=\\['later'\\]"):
        lc.evaluate_sweep(params, [cfg], s, tok, protocols=("later",))


def test_sign_test_is_exact_mcnemar():
    # 10 against 2 discordant pairs: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12
    assert lc.sign_test(10, 2) == pytest.approx(2 * (1 + 12 + 66) / 4096, rel=1e-12)
    assert lc.sign_test(2, 10) == lc.sign_test(10, 2)
    assert lc.sign_test(3, 3) == 1.0 and lc.sign_test(0, 0) == 1.0
    assert lc.sign_test(0, 6) == pytest.approx(2 / 64)
    from scipy import stats
    for w, l in ((7, 1), (15, 4), (0, 9)):
        assert lc.sign_test(w, l) == pytest.approx(stats.binomtest(w, w + l).pvalue, rel=1e-9)
    with pytest.raises(ValueError, match="wins=-1"):
        lc.sign_test(-1, 2)


def test_paired_test_pairs_samples_by_id():
    ref = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "only_ref": 1.0}
    run = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "only_run": 0.0}
    t = lc.paired_test(run, ref)
    assert (t["samples"], t["wins"], t["losses"]) == (4, 2, 1)
    assert t["p"] == pytest.approx(lc.sign_test(2, 1))
    assert t["difference"] == pytest.approx(0.25)


def test_quest_on_paged_rows_through_the_harness(tok, tiny):
    """Quest in the harness (paged rows, --config.page_size): a budget of every page
    answers as the dense full cache; a budget of 2 pages reads its theory's bytes and
    changes the answer's NLL."""
    params, cfg = tiny
    s = lc.generate_sample("passkey", tok, 600, 0.5, seed=3)
    full = lc.evaluate_sample(params, cfg, s, tok, tok.eos_token_ids)
    every = cfg.replace(kv_compression="quest", kv_budget=608)
    keep = lc.evaluate_sample(params, every, s, tok, tok.eos_token_ids, page_size=16)
    assert keep.questions[0].generated_ids == full.questions[0].generated_ids
    assert keep.answer_nll == pytest.approx(full.answer_nll, abs=1e-4)
    assert keep.kv_bytes_allocated == keep.kv_bytes_theory
    small_cfg = cfg.replace(kv_compression="quest", kv_budget=32)
    small = lc.evaluate_sample(params, small_cfg, s, tok, tok.eos_token_ids, page_size=16)
    assert small.kv_bytes_allocated == keep.kv_bytes_allocated  # Quest evicts nothing
    assert small.kv_bytes_read == theory.page_selection_step_bytes(small_cfg, 600, 16)[
        "kv_read"] + theory.page_selection_step_bytes(small_cfg, 600, 16)["bounds_read"]
    assert small.answer_nll != pytest.approx(full.answer_nll, abs=1e-3)  # it skips pages
    with pytest.raises(ValueError, match="page_size=0"):
        lc.evaluate_sample(params, small_cfg, s, tok, tok.eos_token_ids)


def test_shards_split_the_todo_list_and_their_logs_are_read_together(tmp_path):
    assert longgrid.parse_shard("1/3") == (1, 3) and longgrid.parse_shard(None) is None
    for bad in ("3/3", "-1/2", "a/b", "1"):
        with pytest.raises(ValueError, match=f"--shard={bad}"):
            longgrid.parse_shard(bad)
    log = tmp_path / "samples.jsonl"
    assert longgrid.shard_log(log, None) == log
    one = longgrid.shard_log(log, (1, 2))
    assert one.name == "samples.shard-1-of-2.jsonl"
    log.write_text(json.dumps({"key": "a", "score": 0}) + "\n")
    one.write_text(json.dumps({"key": "b", "score": 1}) + "\n{torn")
    (tmp_path / "other.jsonl").write_text(json.dumps({"key": "c"}) + "\n")
    assert sorted(longgrid.read_logs(log)) == ["a", "b"]


def test_compare_reads_a_sweep_and_tests_each_method_against_streaming_llm(tmp_path, capsys):
    le = import_entry_point("longeval")

    def run(method, budget, scores):
        recs = [dict(task="passkey", length=600, depth=0.5, index=i, seed=0,
                     query_first=False, score=float(s), answer_nll=0.5 + i / 10,
                     kv_bytes_theory=1000 * (budget or 600), kv_bytes_allocated=1,
                     prefill_seconds=1.0, decode_seconds=1.0) for i, s in enumerate(scores)]
        out = longgrid.summarize(recs, ["passkey"], [600], [0.5], None)
        return dict(out, variant=f"tiny {method} {budget}", protocol="question",
                    kv_compression=method, kv_budget=budget,
                    sample_scores=longgrid.sample_scores(recs))

    window = [1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    snap = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]  # 8 wins, 0 losses against the window
    runs = [run(None, None, [1] * 12), run("streaming_llm", 64, window),
            run("snapkv", 64, snap), run("snapkv", 128, snap)]
    for r, ppl in zip(runs, (5.0, 9.5, 7.25, 6.0)):  # a tail perplexity per point
        r["ppl"] = dict(ppl=ppl, ppl_ci=[ppl - 1, ppl + 1], context=600, tail=64,
                        kv_bytes_theory=1000 * (r["kv_budget"] or 600), texts=2)
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(dict(runs=runs)))
    assert le.compare([str(path)], [], tmp_path / "out") == 0
    lines = capsys.readouterr().out.splitlines()
    snap64 = next(x for x in lines if x.startswith("tiny snapkv 64"))
    assert f"8+/0- p={lc.sign_test(8, 0):.3g}" in snap64
    assert "perplexity 7.2500" in snap64
    assert "p=" not in next(x for x in lines if x.startswith("tiny snapkv 128"))  # no ref
    assert "p=" not in next(x for x in lines if x.startswith("tiny None"))
    assert (tmp_path / "out" / "pareto.png").stat().st_size > 0


# --------------------------------------------- perplexity of a text's tail on each cache


def _text(tok, length=600):
    """A text of ``length`` tokens (a haystack: filler and a needle)."""
    return lc.generate_sample("passkey", tok, length + lc.RESERVE, 0.5, seed=5).context_ids[:length]


def test_tail_perplexity_of_every_point_on_one_prefill_equals_each_config_alone(tok, tiny):
    """sweep_tail_nll: the full cache's tail NLL equals a cache-free forward of the whole
    text; a budget that keeps every slot (M within the ring) equals the full cache; each
    swept point equals tail_nll of that config alone (its own prefill-and-compress)."""
    params, cfg = tiny
    cfg = cfg.replace(scan_layers=False)
    params = model.params_for(cfg, params)
    knobs = CompressionConfig(observation_window=16, recent_slots=48)
    ids, tail = _text(tok), 40
    points = [cfg] + [cfg.replace(kv_compression=m, kv_budget=b, compression=knobs)
                      for m, b in (("snapkv", 600), ("streaming_llm", 32), ("h2o", 96),
                                   ("pyramidkv", 64))]
    points = [lc.resolve_config(p, len(ids)) for p in points]
    swept = lc.sweep_tail_nll(params, points, ids, tail)
    logits, _ = model.forward(params, cfg, jnp.asarray([ids], jnp.int32),
                              jnp.arange(len(ids), dtype=jnp.int32)[None])
    lp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), -1), np.float64)
    direct = np.array([-lp[i - 1, ids[i]] for i in range(len(ids) - tail, len(ids))])
    np.testing.assert_allclose(swept[0].nll, direct, atol=2e-4)
    np.testing.assert_allclose(swept[1].nll, swept[0].nll, atol=1e-5)  # keeps every slot
    means = set()
    for i, p in enumerate(points):
        alone = lc.tail_nll(params, p, ids, tail)
        np.testing.assert_allclose(swept[i].nll, alone.nll, atol=1e-5, err_msg=str(i))
        assert (swept[i].kv_bytes_allocated, swept[i].kv_bytes_theory, swept[i].cache_slots) \
            == (alone.kv_bytes_allocated, alone.kv_bytes_theory, alone.cache_slots)
        if i != 1:  # kv_budget + recent_slots > L: theory counts L slots
            assert alone.kv_bytes_allocated == alone.kv_bytes_theory == \
                theory.kv_cache_bytes(p, len(ids))
        means.add(round(float(swept[i].nll.mean()), 4))
    assert len(means) == len(points) - 1  # every evicting point differs (snapkv 600 keeps all)


def test_tail_perplexity_refuses_a_bad_tail_naming_it(tok, tiny):
    params, cfg = tiny
    ids = _text(tok, 100)
    for bad in (0, -3, 100, 150, True, 2.5):
        with pytest.raises(ValueError, match=f"ppl_tokens={bad!r}; allowed: an integer M "
                                             "with 1 <= M < L=100"):
            lc.tail_nll(params, cfg, ids, bad)
        with pytest.raises(ValueError, match=f"ppl_tokens={bad!r}"):
            lc.sweep_tail_nll(params, [cfg], ids, bad)


def test_sweep_perplexity_log_resumes_and_summarizes(tok, tiny, tmp_path):
    params, cfg = tiny
    knobs = CompressionConfig(observation_window=16, recent_slots=48)
    points = [cfg, cfg.replace(kv_compression="snapkv", kv_budget=64, compression=knobs)]
    texts = np.asarray([_text(tok, 300), _text(tok, 600)[300:]], np.int32)
    log = tmp_path / "ppl.jsonl"
    first = longgrid.run_sweep_ppl(params, points, texts, 32, log, "src", progress=False,
                                   shard=(0, 2))
    assert [len(first[i]) for i in (0, 1)] == [1, 1]  # shard 0 of 2: text 0
    both = longgrid.run_sweep_ppl(params, points, texts, 32, log, "src", progress=False)
    lines = len(log.read_text().splitlines()) + len(
        longgrid.shard_log(log, (0, 2)).read_text().splitlines())
    assert lines == 4 and [len(both[i]) for i in (0, 1)] == [2, 2]
    again = longgrid.run_sweep_ppl(params, points, texts, 32, log, "src", progress=False)
    assert again == both and len(log.read_text().splitlines()) == 2  # nothing rescored
    for i, p in enumerate(points):
        alone = longgrid.tail_ppl(params, p, texts, 32)
        got = longgrid.summarize_ppl(both[i])
        assert got["ppl"] == pytest.approx(alone["ppl"], rel=1e-5)
        per_text = [lc.tail_nll(params, lc.resolve_config(p, 300), list(t), 32).nll
                    for t in texts]
        assert got["ppl"] == pytest.approx(np.exp(np.concatenate(per_text).mean()), rel=1e-5)
        assert (got["texts"], got["tokens"], got["context"], got["tail"]) == (2, 64, 300, 32)
        assert got["ppl_ci"][0] <= got["ppl"] <= got["ppl_ci"][1] or got["nll_ci"][0] <= \
            got["nll"] <= got["nll_ci"][1]
        assert got["kv_bytes_theory"] == theory.kv_cache_bytes(p, 300)
    assert longgrid.summarize_ppl([]) is None
