"""Lever 5 at read time: Quest's query-aware page selection on the paged cache
(kvjax/compression/quest.py, kvjax/cache/paged.py's key bounds, the registered
decode-attention rules 'pages_native' and 'pages_xla' of kvjax/kernels.py):
a budget covering every page equals the full paged read; the page choice equals a numpy
reference of the bounds and the top-k per KV head (GQA); the bounds equal the min / max
of the written keys after prefill, decode steps and page reuse; a row's tokens do not
depend on its batch-mates; bad budgets are refused by name. Tiny random models, CPU."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import compression, kernels, naming, native, planner, presets
from kvjax.analysis import costs, hlo_cost, theory
from kvjax.cache import kv as cache_lib
from kvjax.cache import paged
from kvjax.config import ConfigError, RunConfig, SpeculativeConfig
from kvjax.inference import engine, runner
from kvjax.models import attention, decode_kernels
from kvjax.models import model as model_lib
from kvjax.plan import Plan
from tests.conftest import tiny_config
from tests.test_paged import _feed

P, M = 4, 8  # tokens per page, block-table entries per row (32 slots a row)


def quest(budget, **kw):
    return tiny_config(tie_embeddings=False, kv_compression="quest", kv_budget=budget, **kw)


def fresh_cache(cfg, rows=2, tables=None):
    cache = paged.init_paged_cache(cfg, rows, rows * M + 4, P, M)
    if tables is None:
        tables = np.arange(rows * M).reshape(rows, M)
    return cache.replace(block_table=jnp.asarray(tables, jnp.int32))


def prompts(rows, t, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 90, (rows, t)), jnp.int32)


def greedy(cfg, params, cache, toks, lengths, steps):
    """Prefills right-padded ``toks`` then decodes ``steps`` greedy tokens per row:
    (tokens [B, steps], logits [steps, B, V], cache)."""
    b = toks.shape[0]
    lg, cache = _feed(params, cache, toks, jnp.asarray(lengths, jnp.int32), cfg=cfg)
    nxt = jnp.argmax(lg[jnp.arange(b), jnp.asarray(lengths) - 1], -1).astype(jnp.int32)
    out, logits = [], []
    for _ in range(steps):
        out.append(np.asarray(nxt))
        lg, cache = _feed(params, cache, nxt[:, None], jnp.ones((b,), jnp.int32), cfg=cfg)
        logits.append(np.asarray(lg[:, 0]))
        nxt = jnp.argmax(lg[:, 0], -1).astype(jnp.int32)
    if not steps:
        return None, None, cache
    return np.stack(out, 1), np.stack(logits), cache


def np_keys(cfg, cache, layer):
    """[B, K, M·P, H] float keys of one layer's dense views."""
    k = np.asarray(cache_lib.read(cfg, cache.layer(layer), "k"), np.float32)
    return np.swapaxes(k, -1, -2) if cache_lib.slot_axis(cfg, "k") == -1 else k


def np_bounds(cfg, cache, layer):
    """{(row, logical page): (min [K, H], max [K, H])} of the keys each row wrote."""
    k, length = np_keys(cfg, cache, layer), np.asarray(cache.length)
    out = {}
    for b in range(k.shape[0]):
        for m in range(-(-int(length[b]) // P)):
            keys = k[b, :, m * P:min((m + 1) * P, int(length[b]))]
            out[b, m] = keys.min(1), keys.max(1)
    return out


def check_bounds(cfg, cache):
    table = np.asarray(cache.block_table)
    for i in range(cfg.num_layers):
        got = {n: np.asarray(t[i], np.float32) for n, t in cache.bounds.items()}
        for (b, m), (lo, hi) in np_bounds(cfg, cache, i).items():
            np.testing.assert_array_equal(got["k_min"][table[b, m]], lo, err_msg=(i, b, m))
            np.testing.assert_array_equal(got["k_max"][table[b, m]], hi, err_msg=(i, b, m))


@pytest.mark.parametrize("overrides", [{}, {"scan_layers": False, "num_kv_heads": 4},
                                       {"kv_dtype": "int8"}])
def test_a_budget_of_every_page_is_the_full_paged_read(overrides):
    base = tiny_config(tie_embeddings=False, **overrides)
    params = model_lib.init_params(base, 0)
    toks = prompts(2, 13)
    want_t, want_l, _ = greedy(base, params, fresh_cache(base), toks, [13, 9], 12)
    cfg = quest(M * P, **overrides)
    got_t, got_l, _ = greedy(cfg, params, fresh_cache(cfg), toks, [13, 9], 12)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-5)


def test_a_small_budget_reads_less_and_changes_the_logits():
    """The selection is real: at 2 of 7 pages the logits move (a budget that reads
    everything would not)."""
    base = tiny_config(tie_embeddings=False)
    params = model_lib.init_params(base, 0)
    toks = prompts(2, 26)
    _, want, _ = greedy(base, params, fresh_cache(base), toks, [26, 26], 2)
    cfg = quest(2 * P)
    _, got, _ = greedy(cfg, params, fresh_cache(cfg), toks, [26, 26], 2)
    assert np.abs(got - want).max() > 1e-3


@pytest.mark.parametrize("first_pages", [0, 1])
def test_page_choice_equals_numpy_bounds_and_top_k(first_pages):
    """GQA (K = 2, G = 2): each KV head's pages are the top C of max_g sum_h
    max(q_h m_h, q_h M_h) over the row's written pages, the first pages and the page of
    the latest token forced, computed in numpy from the written keys."""
    cfg = quest(3 * P, compression=compression.CompressionConfig(first_pages=first_pages))
    params = model_lib.init_params(cfg, 0)
    cache = fresh_cache(cfg, tables=[[5, 3, 1, 7, 0, 2, 4, 6], [8, 9, 10, 11, 12, 13, 14, 15]])
    lengths = [27, 18]
    _, cache = _feed(params, cache, prompts(2, 27), jnp.asarray(lengths, jnp.int32), cfg=cfg)
    q = np.random.default_rng(1).standard_normal((2, 2, 2, 8)).astype(np.float32)
    layer = cache.layer(1)
    got = np.asarray(attention.select_pages(cfg, jnp.asarray(q), layer, cache.positions))
    bounds = np_bounds(cfg, cache, 1)
    for b in range(2):
        pages = -(-lengths[b] // P)
        for k in range(2):
            score = np.array([max((np.maximum(q[b, k, g] * bounds[b, m][0][k],
                                              q[b, k, g] * bounds[b, m][1][k])).sum()
                                  for g in range(2)) for m in range(pages)])
            score[:first_pages] = np.inf
            score[(lengths[b] - 1) // P] = np.inf
            want = np.sort(np.argsort(-score, kind="stable")[:3])
            np.testing.assert_array_equal(got[b, k], want, err_msg=(b, k))
    # the two KV heads of a row choose differently somewhere: per-head selection
    assert (got[:, 0] != got[:, 1]).any()


def test_bounds_are_the_written_keys_min_and_max():
    """After a ragged prefill, after decode steps (pages filled one token at a time and
    new pages started), and after a page is reused by a shorter prompt (its old keys
    forgotten)."""
    for cfg in (quest(2 * P), quest(2 * P, scan_layers=False, kv_dtype="int8")):
        params = model_lib.init_params(cfg, 0)
        cache = fresh_cache(cfg)
        _, _, cache = greedy(cfg, params, cache, prompts(2, 10), [10, 7], 0)
        check_bounds(cfg, cache)
        _, _, cache = greedy(cfg, params, cache, prompts(2, 1, 3), [1, 1], 6)
        check_bounds(cfg, cache)
        # reuse: row 1 takes row 0's pages (full of other keys) for a 6-token prompt
        cache = cache.replace(block_table=jnp.asarray(np.asarray(cache.block_table)[::-1]),
                              length=jnp.zeros((2,), jnp.int32))
        _, _, cache = greedy(cfg, params, cache, prompts(2, 6, 5), [6, 3], 1)
        check_bounds(cfg, cache)


def test_a_rows_tokens_do_not_depend_on_its_batch_mates():
    cfg = quest(2 * P)
    params = model_lib.init_params(cfg, 0)
    toks = prompts(2, 22, seed=4)
    alone, _, _ = greedy(cfg, params, fresh_cache(cfg, 1), toks[:1], [22], 10)
    other = toks.at[1].set(prompts(1, 22, seed=9)[0])
    for mate, n in ((toks, 22), (other, 11)):
        both, _, _ = greedy(cfg, params, fresh_cache(cfg), mate, [22, n], 10)
        np.testing.assert_array_equal(both[0], alone[0])


@pytest.mark.parametrize("budget,page_size,run,match", [
    (0, 4, {}, "model.kv_budget=0"),
    (6, 4, {}, "model.kv_budget=6; allowed: a multiple of page_size=4"),
    (68, 4, {}, "model.kv_budget=68; allowed: at most 64"),
    (8, 0, {}, "page_size=0; allowed: an integer >= 1"),
    (8, 4, {"speculative": SpeculativeConfig(drafter="ngram")}, "speculative.drafter"),
])
def test_bad_budgets_are_refused_by_name(budget, page_size, run, match):
    with pytest.raises(ConfigError, match=match):
        RunConfig(model=quest(budget), weights="random", max_seq_len=64,
                  page_size=page_size, **run)


def test_the_engine_and_the_cache_refuse_what_cannot_run():
    cfg = quest(8)
    params = model_lib.init_params(cfg, 0)
    with pytest.raises(ConfigError, match="page_size=0"):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=32)
    with pytest.raises(ValueError, match="model.kv_budget=8; allowed: a multiple of "
                                         "page_size=3"):
        paged.init_paged_cache(cfg, 1, 16, 3, 11)
    with pytest.raises(ValueError, match="model.compression.first_pages=2"):
        paged.init_paged_cache(cfg.replace(compression=compression.CompressionConfig(
            first_pages=2)), 1, 16, 4, 8)
    with pytest.raises(ConfigError, match="model.kv_compression='quest'.*"):
        tiny_config(kv_compression="quest", kv_budget=8, window_size=16)
    from tests.conftest import tiny_mla_config  # noqa: PLC0415
    with pytest.raises(ConfigError, match="model.attention='mla'"):
        tiny_mla_config(kv_compression="quest", kv_budget=8)
    with pytest.raises(ConfigError, match="model.compression.schedule='every_n'"):
        cfg.replace(compression=compression.CompressionConfig(schedule="every_n"))
    with pytest.raises(ValueError, match="a dense cache with model.kv_compression='quest'"):
        cache_lib.init_cache(cfg, 1, 32)
    run = RunConfig(model=cfg, weights="random", max_seq_len=32, page_size=4)
    with pytest.raises(ConfigError, match="kv_compression='quest' in the main job"):
        runner.load(run, check_prompt=True)  # before the tokenizer or weights


@pytest.mark.slow
def test_the_paged_engine_runs_quest():
    """Through the engine (one-row prefills into the pools, a tight pool that preempts,
    the prefix cache sharing pages and their bounds, copy on write): a budget of every
    page gives the plain paged engine's tokens; a budget of 2 pages its own rows' tokens
    whatever the batch (each request alone)."""
    base = tiny_config(tie_embeddings=False)
    params = model_lib.init_params(base, 0)
    rng = np.random.default_rng(3)
    system = list(rng.integers(3, 97, 8))
    reqs = [engine.Request(i, tuple(int(t) for t in system + list(
        rng.integers(3, 97, rng.integers(1, 6)))), int(rng.integers(6, 16)))
        for i in range(5)]
    kw = dict(num_slots=3, max_seq_len=32, page_size=4, steps_per_sync=4)
    want, _ = engine.Engine(params, base, num_pages=24, **kw).run(reqs)
    for pages, prefix in ((24, False), (9, True)):
        got, _ = engine.Engine(params, quest(32), num_pages=pages, prefix_cache=prefix,
                               **kw).run(reqs)
        assert [c.tokens for c in got] == [c.tokens for c in want], (pages, prefix)
    small, _ = engine.Engine(params, quest(8), num_pages=9, prefix_cache=True,
                             **kw).run(reqs)
    for r, c in zip(reqs[:2], small[:2]):
        alone, _ = engine.Engine(params, quest(8), num_pages=8, **kw).run([r])
        assert alone[0].tokens == c.tokens


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_allocated_and_theory_bytes_count_the_bounds(kv_dtype):
    """Quest keeps every page (theory's full cache at the pool's tokens) plus 2·K·H
    model-dtype elements per page and layer; a step reads the budget's tokens and every
    held page's bounds, and at a budget covering the context it reads the full cache."""
    cfg = quest(2 * P, kv_dtype=kv_dtype)
    plain = cfg.replace(kv_compression=None, kv_budget=None)
    cache = paged.init_paged_cache(cfg, 2, 10, P, M)
    bound = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    assert cache_lib.total_bytes(cache.bounds) == 10 * bound
    assert cache_lib.total_bytes(cache.tensors) + cache_lib.total_bytes(cache.bounds) \
        == 10 * paged.page_bytes(cfg, P) == theory.kv_cache_bytes(plain, 10 * P) + 10 * bound
    got = theory.page_selection_step_bytes(cfg, 30, P, batch=2)
    assert got["kv_read"] == 2 * theory.kv_cache_bytes(plain, 2 * P)  # 2 pages of 8
    assert got["bounds_read"] == 2 * 8 * bound  # ceil(30 / 4) pages held
    wide = theory.page_selection_step_bytes(quest(M * P, kv_dtype=kv_dtype), 32, P)
    assert wide["kv_read"] == theory.step_bytes(plain, 32).kv_read
    with pytest.raises(ValueError, match="kv_compression=None"):
        theory.page_selection_step_bytes(plain, 30, P)


def test_the_paged_step_is_costed_beside_its_theory():
    """costs.analyze_paged_decode_step compiles the paged step from shapes: Quest's
    against page_selection_step_bytes, the full read's against step_bytes; the compiled
    step reads at least the weights theory counts."""
    cfg = quest(2 * P)
    for c, want in ((cfg, theory.page_selection_step_bytes(cfg, 32, P)["total"]),
                    (tiny_config(tie_embeddings=False),
                     theory.step_bytes(tiny_config(tie_embeddings=False), 32).total)):
        r = costs.analyze_paged_decode_step(c, 32, P)
        assert r["theory_bytes"] == want
        assert r["xla_bytes"] >= r["theory"]["weights"]
        assert r["attribution"]["bytes"]["weights"] == pytest.approx(r["theory"]["weights"],
                                                                       rel=0.01)


NATIVE_PLAN = Plan(native=("decode_attention",))


def test_the_page_read_is_a_rule_of_the_registry(monkeypatch):
    """A paged one-position site of a page-selecting config runs 'pages_native' where the
    native kernel is loaded and the pools are float32, else the reference 'pages_xla',
    whatever was asked; a small chunk (T > 1) and a plain paged config are not forced;
    the planner stores the rule without timing anything."""
    site = lambda c, t=1: decode_kernels.site(c, 2, t, M * P, True, P)  # noqa: E731
    for cfg, want in ((quest(8, decode_attention="auto", plan=NATIVE_PLAN), "pages_native"),
                      (quest(8, decode_attention="native", plan=NATIVE_PLAN), "pages_native"),
                      (quest(8, decode_attention="xla", plan=NATIVE_PLAN), "pages_xla"),
                      (quest(8, decode_attention="auto"), "pages_xla"),  # no kernel loaded
                      (quest(8, decode_attention="auto", kv_dtype="int8", plan=NATIVE_PLAN),
                       "pages_xla")):
        assert cfg.formulation(site(cfg)) == want, cfg
        assert kernels.forced("decode_attention", cfg.decode_attention, site(cfg)) == want
    cfg = quest(8, decode_attention="xla")
    assert cfg.formulation(site(cfg, 4)) == "xla"  # a chunk reads every page
    plain = tiny_config(decode_attention="xla")
    assert plain.formulation(site(plain)) == "xla"
    assert kernels.forced("decode_attention", "xla", site(plain)) is None

    def timed(*a, **k):
        raise AssertionError("a rule's class was timed")

    monkeypatch.setattr(planner, "_decode_pick", timed)
    got = planner.resolve(quest(8, decode_attention="auto"), max_seq_len=M * P,
                          batch_sizes=(2,), page_size=P)
    assert dict(got.plan.decode_attention) == {site(got).key: got.formulation(site(got))}
    assert got.formulation(site(got)) == ("pages_native" if native.load() else "pages_xla")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("overrides", [{}, {"scan_layers": False, "num_kv_heads": 4}])
def test_pages_native_equals_the_gathered_reference(overrides):
    """Through the model (ragged prefill, decode steps, GQA and MHA): the native kernel
    over per-(row, KV head) tables gives the reference 'pages_xla' tokens, and a budget
    of every page the full paged read's."""
    params = model_lib.init_params(quest(2 * P, **overrides), 0)
    toks = prompts(2, 26, seed=2)
    ref = quest(2 * P, decode_attention="xla", **overrides)
    want_t, want_l, _ = greedy(ref, params, fresh_cache(ref), toks, [26, 17], 8)
    cfg = quest(2 * P, decode_attention="native", plan=NATIVE_PLAN, **overrides)
    assert cfg.formulation(decode_kernels.site(cfg, 2, 1, M * P, True, P)) == "pages_native"
    got_t, got_l, _ = greedy(cfg, params, fresh_cache(cfg), toks, [26, 17], 8)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-5)
    base = tiny_config(tie_embeddings=False, **overrides)
    full_t, _, _ = greedy(base, params, fresh_cache(base), toks, [26, 17], 8)
    every = quest(M * P, decode_attention="native", plan=NATIVE_PLAN, **overrides)
    np.testing.assert_array_equal(
        greedy(every, params, fresh_cache(every), toks, [26, 17], 8)[0], full_t)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("dense_layers", [0, 1])
def test_compiled_bytes_match_theory_at_the_budget(dense_layers):
    """SmolLM2's shapes shrunk to 2 layers, t = 1,024, a budget of 128, pages of 16,
    ``dense_layers`` of them reading every page: the native kernel's pool reads (the
    cost hook's kernel_operand_bytes: its tables' pages) are theory's kv_read exactly
    (the dense layers' t tokens, the others' budget), the compiled step (XLA + kernels)
    is within [0.9, 1.3] of theory with the scoring attributed on its own, and the
    scoring reads at least theory's bounds."""
    cfg = presets.smollm2_135m("float32", scan_layers=None).replace(
        num_layers=2, vocab_size=4096, kv_compression="quest", kv_budget=128,
        decode_attention="native", weight_matmul="xla", plan=NATIVE_PLAN,
        compression=compression.CompressionConfig(dense_layers=dense_layers))
    r = costs.analyze_paged_decode_step(cfg, 1024, 16)
    th = r["theory"]
    compiled = costs.compile_paged_decode_step(cfg, 1024, 16)
    calls = [op for op in hlo_cost.op_costs(compiled)  # the kernel's (not top-k's)
             if op.opcode == "custom-call" and op.op_name.endswith("/ffi_call")]
    assert len(calls) == cfg.num_layers
    assert sum(op.count * (op.operand_bytes[1] + op.operand_bytes[2]) for op in calls) \
        == th["kv_read"]
    assert 0.9 <= r["counted_over_theory"] <= 1.3, r["counted_over_theory"]
    assert th["bounds_read"] <= r["scoring_bytes"] <= 4 * th["bounds_read"]
    # the reference gathers: XLA charges each gather of chosen pages the whole pool
    ref = costs.analyze_paged_decode_step(cfg.replace(decode_attention="xla"), 1024, 16)
    assert ref["xla_bytes"] > r["counted_bytes"]


def dense(d, budget=2 * P, **kw):
    """Quest over 3 unrolled layers, the first ``d`` reading every page."""
    return quest(budget, num_layers=3, compression=compression.CompressionConfig(
        dense_layers=d), **{"scan_layers": None, **kw})


def test_dense_layers_read_every_page_and_the_others_select():
    """compression.dense_layers (Quest's paper: 2): at L it is the uncompressed paged
    decode (tokens and logits); at 0 today's Quest, scanned or unrolled; in between the
    logits differ from both (each kind of layer is there), and only the selecting layers
    write page bounds."""
    base = tiny_config(tie_embeddings=False, num_layers=3, scan_layers=False)
    params = model_lib.init_params(base, 0)
    toks, lengths = prompts(2, 22, seed=3), [22, 19]  # + 8 steps <= M·P slots
    want_t, want_l, _ = greedy(base, params, fresh_cache(base), toks, lengths, 8)
    every = dense(3)
    assert every.scan_layers is False
    got_t, got_l, _ = greedy(every, params, fresh_cache(every), toks, lengths, 8)
    np.testing.assert_array_equal(got_t, want_t)
    np.testing.assert_allclose(got_l, want_l, rtol=0, atol=1e-6)
    none = dense(0, scan_layers=False)
    quest_t, quest_l, _ = greedy(none, params, fresh_cache(none), toks, lengths, 8)
    scanned = quest(2 * P, num_layers=3)  # today's Quest (scan_layers=True)
    s_params = model_lib.stack_layers(params, 3)
    s_t, s_l, _ = greedy(scanned, s_params, fresh_cache(scanned), toks, lengths, 8)
    np.testing.assert_array_equal(quest_t, s_t)
    np.testing.assert_allclose(quest_l, s_l, rtol=0, atol=1e-5)
    one = dense(1)
    assert [one.layer_config(i).kv_selects_pages for i in range(3)] == [False, True, True]
    mix_t, mix_l, cache = greedy(one, params, fresh_cache(one), toks, lengths, 8)
    assert np.abs(mix_l - want_l).max() > 1e-3 and np.abs(mix_l - quest_l).max() > 1e-3
    untouched = paged.init_paged_cache(one, 2, 2 * M + 4, P, M).bounds
    for n in cache.bounds:
        np.testing.assert_array_equal(cache.bounds[n][0], untouched[n][0])
        assert not np.array_equal(cache.bounds[n][1], untouched[n][1])


@pytest.mark.parametrize("value,match", [
    (-1, "model.compression.dense_layers=-1; allowed: an integer in \\[0, num_layers=3\\]"),
    (4, "model.compression.dense_layers=4; allowed: an integer in \\[0, num_layers=3\\]"),
    (True, "model.compression.dense_layers=True; allowed: an integer"),
    (1.0, "model.compression.dense_layers=1.0; allowed: an integer"),
])
def test_bad_dense_layers_are_refused_by_name(value, match):
    with pytest.raises(ConfigError, match=match):
        dense(value)


def test_dense_layers_need_a_page_selection_and_unrolled_layers():
    with pytest.raises(ConfigError, match="model.compression.dense_layers=1; allowed: 0 "
                                          "with model.kv_compression='snapkv'"):
        tiny_config(num_layers=3, kv_compression="snapkv", kv_budget=40,
                    compression=compression.CompressionConfig(dense_layers=1))
    with pytest.raises(ConfigError, match="model.compression.dense_layers=1; allowed: 0 "
                                          "with model.kv_compression=None"):
        tiny_config(compression=compression.CompressionConfig(dense_layers=1))
    with pytest.raises(ConfigError, match="model.scan_layers=True; allowed: False or None "
                                          "with model.compression.dense_layers=2"):
        dense(2, scan_layers=True)
    assert dense(0, scan_layers=True).scan_layers is True  # 0: scanned, as before
    # a run's log keys its samples by the variant: dense layers are another variant
    assert naming.compression_label(dense(2)) == "quest 8 read dense 2"
    assert naming.compression_label(dense(0)) == "quest 8 read"


def test_theory_reads_the_dense_layers_in_full():
    """A step's kv_read is d layers' full read of t tokens plus L - d layers' budget;
    the bounds are read and written by the L - d selecting layers only; at d = L it is
    the uncompressed step's read."""
    plain = tiny_config(num_layers=3)
    per_layer = theory.kv_bytes_per_token(plain) // 3
    bound = 2 * plain.num_kv_heads * plain.head_dim * 4  # one layer's, float32
    for d in range(4):
        got = theory.page_selection_step_bytes(dense(d), 30, P, batch=2)
        assert got["kv_read"] == 2 * (d * 30 + (3 - d) * 2 * P) * per_layer
        assert got["kv_read"] == 2 * (theory.kv_cache_bytes(plain, 30) * d
                                      + theory.kv_cache_bytes(plain, 2 * P) * (3 - d)) // 3
        assert got["bounds_read"] == 2 * 8 * (3 - d) * bound
        assert got["bounds_write"] == 2 * (3 - d) * bound
    assert theory.page_selection_step_bytes(dense(3), 30, P)["kv_read"] \
        == theory.step_bytes(plain, 30).kv_read


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_the_planner_picks_the_dense_layers_read(monkeypatch):
    """With dense layers the class's plan entry is the full paged read's measured pick
    (the dense layers run it); the selecting layers still run the rule over it."""
    calls = []

    def pick(cfg, *a, **k):
        calls.append(cfg.kv_selects_pages)
        return "native"

    monkeypatch.setattr(planner, "_decode_pick", pick)
    got = planner.resolve(dense(1, decode_attention="auto"), max_seq_len=M * P,
                          batch_sizes=(2,), page_size=P)
    site = lambda c: decode_kernels.site(c, 2, 1, M * P, True, P)  # noqa: E731
    assert calls == [False]
    assert dict(got.plan.decode_attention) == {site(got).key: "native"}
    assert got.layer_config(0).formulation(site(got.layer_config(0))) == "native"
    assert got.layer_config(1).formulation(site(got.layer_config(1))) == "pages_native"
