"""The paged KV cache (kvjax/cache/paged.py) and the paged engine
(kvjax/inference/engine.py): a model run over page pools and block tables gives the
logits of the cache-free forward for every attention variant and cache kind, page size
and page layout (rows over many pages, pages shared by two rows, copy on write); the host
allocator keeps its invariants over thousands of random events; the paged engine's
greedy tokens equal the dense engine's, with preemption and shared prefixes; bad input
is refused by name. Tiny random float32 models, CPU."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import native
from kvjax.cache import paged
from kvjax.config import ConfigError, ModelConfig, SpeculativeConfig
from kvjax.inference import engine
from kvjax.models import model
from kvjax.plan import Plan
from tests.test_ragged import VARIANTS, params_of

L = 24  # tokens per test sequence
CHUNK = 8  # prefill chunk


@functools.partial(jax.jit, static_argnames="cfg")
def _feed(params, cache, tokens, num_valid, *, cfg):
    pos = cache.length[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    return model.forward(params, cfg, tokens, pos, cache, num_valid=num_valid)


@functools.partial(jax.jit, static_argnames="cfg")
def _reference(params, tokens, *, cfg):
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model.forward(params, cfg, tokens, pos)[0]


def _run(cfg, params, cache, seqs, start, stop, chunk):
    """Feeds rows' tokens [start[b], stop) in chunks of ``chunk`` (1: decode steps);
    returns {(row, position): logits}."""
    out = {}
    b = len(seqs)
    pos = np.array(start)
    while (pos < stop).any():
        n = np.minimum(stop - pos, chunk)
        toks = np.zeros((b, chunk), np.int32)
        for r in range(b):
            toks[r, :n[r]] = seqs[r][pos[r]:pos[r] + n[r]]
        logits, cache = _feed(params, cache, jnp.asarray(toks), jnp.asarray(n, jnp.int32),
                              cfg=cfg)
        logits = np.asarray(logits)
        for r in range(b):
            for j in range(n[r]):
                out[r, pos[r] + j] = logits[r, j]
        pos = pos + n
    return out, cache


def _check(cfg, params, seqs, got, atol=2e-4):
    ref = np.asarray(_reference(params, jnp.asarray(np.array(seqs), jnp.int32), cfg=cfg))
    assert got, "nothing compared"
    for (r, p), logits in got.items():
        assert np.isfinite(logits).all(), (r, p)
        np.testing.assert_allclose(logits, ref[r, p], atol=atol, rtol=1e-4,
                                   err_msg=f"row {r} position {p}")


def _seqs(seed, b=2, shared=0):
    rng = np.random.default_rng(seed)
    s = rng.integers(0, 97, (b, L))
    s[1:, :shared] = s[0, :shared]
    return [list(map(int, x)) for x in s]


def _table(alloc, rows, max_pages):
    bt = np.full((len(rows), max_pages), -1, np.int32)
    for i, r in enumerate(rows):
        pages = alloc.block_table(r)
        bt[i, :len(pages)] = pages
    return jnp.asarray(bt)


CASES = [  # (variant, overrides, page size, decode steps too)
    ("gqa", {}, 1, False),         # every token its own page: 24 pages per row
    ("mqa", {}, 16, False),        # one full page and one partly filled
    ("mha", {"scan_layers": False}, 5, False),  # 5 divides neither prompt nor chunk
    ("mla_absorbed", {}, 5, True),
    ("gqa", {"kv_dtype": "int8"}, 3, True),     # code and scale pools
    # the native kernel reading the pages in place (decode steps and chunks of <= 16)
    ("gqa", {"decode_attention": "native"}, 5, True),    # keys BKHS, values BKSH
    ("mha", {"decode_attention": "native"}, 1, True),    # values BKHS (G = 1), 1-slot pages
    ("mqa", {"decode_attention": "native"}, 16, True),
]


@pytest.mark.parametrize("name,over,page_size,decode", CASES)
def test_paged_forward_equals_cache_free(name, over, page_size, decode):
    """Three rows, prefilled in chunks of 8 (later chunks read earlier pages), then
    (``decode``) one token at a time, on pages taken from the pool in reverse order:
    every logit equals the cache-free forward's."""
    cfg = ModelConfig(**{**VARIANTS[name], **over})
    if cfg.decode_attention == "native":
        if not native.load():
            pytest.skip("the native library could not be built here")
        cfg = cfg.replace(plan=Plan(native=("decode_attention",)))
    params = model.params_for(cfg, params_of(name))
    seqs = _seqs(1, b=3)
    m = paged.pages_for(L, page_size)
    alloc = paged.PageAllocator(3 * m + 3, page_size)
    alloc.free.reverse()  # pages out of order, rows interleaved
    for r in range(3):
        alloc.admit(r, seqs[r], L)
    cache = paged.init_paged_cache(cfg, 3, 3 * m + 3, page_size, m)
    cache = cache.replace(block_table=_table(alloc, [0, 1, 2], m))
    mid = np.array([19, 17, 21]) if decode else np.array([L, L - 2, L - 5])
    got, cache = _run(cfg, params, cache, seqs, [0, 0, 0], mid, CHUNK)
    if decode:
        more, cache = _run(cfg, params, cache, seqs, mid, np.array([L, L - 2, L]), 1)
        got.update(more)
    _check(cfg, params, seqs, got)
    assert np.asarray(cache.length).tolist() == [L, L - 2, L if decode else L - 5]
    if cfg.decode_attention == "native":  # the step reads the pools, not gathered views
        hlo = _feed.lower(params, cache, jnp.zeros((3, 1), jnp.int32),
                          jnp.ones((3,), jnp.int32), cfg=cfg).as_text()
        assert native.PAGED_TARGET in hlo  # once per layer, or once in a scanned body


def test_shared_prefix_pages_and_copy_on_write():
    """Row 1 shares row 0's first two full pages (prefix cache) and prefills only its
    own tokens; row 2 forks row 0 at 13 tokens (a partly filled last page) and diverges:
    the shared page is copied before row 2 writes, and every row's logits equal its own
    cache-free forward. Row 0's pages are never written by the others."""
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    p = 4
    seqs = _seqs(2, b=3, shared=13)
    seqs[1][8] = (seqs[1][8] + 1) % 97  # row 1 shares exactly 8 tokens = 2 pages
    m = paged.pages_for(L, p)
    alloc = paged.PageAllocator(3 * m, p, prefix_cache=True)
    alloc.admit(0, seqs[0], 13)
    cache = paged.init_paged_cache(cfg, 3, 3 * m, p, m)
    cache = cache.replace(block_table=_table(alloc, [0], m).repeat(3, axis=0))
    # row 0 alone prefills 13 tokens (rows 1 and 2 fed nothing)
    got0, cache = _run(cfg, params, cache, [seqs[0], [0] * L, [0] * L], [0, 0, 0],
                       np.array([13, 0, 0]), CHUNK)
    alloc.append(0, seqs[0][:13])
    assert alloc.admit(1, seqs[1], L) == 8  # two cached pages found
    assert alloc.block_table(1)[:2] == alloc.block_table(0)[:2]
    alloc.fork(0, 2)
    copies = alloc.ensure(2, L)
    assert copies == [(alloc.block_table(0)[3], alloc.block_table(2)[3])]
    assert alloc.block_table(2)[:3] == alloc.block_table(0)[:3]
    alloc.ensure(0, L)
    alloc.check()
    before = {n: np.asarray(t[:, alloc.block_table(0)[:3]]) for n, t in cache.tensors.items()}
    cache = engine.copy_pages_program(cache, *(jnp.asarray(x) for x in zip(*copies)))
    cache = cache.replace(block_table=_table(alloc, [0, 1, 2], m),
                          length=jnp.asarray([13, 8, 13], jnp.int32))
    seqs[2][13:] = list(np.random.default_rng(5).integers(0, 97, L - 13))
    got, cache = _run(cfg, params, cache, seqs, [13, 8, 13], np.array([L, L, L]), CHUNK)
    _check(cfg, params, seqs, {**got0, **got})
    for n, t in cache.tensors.items():  # row 0's full pages, read by all, unchanged
        np.testing.assert_array_equal(np.asarray(t[:, alloc.block_table(0)[:3]]), before[n])


def test_allocator_invariants_random_events():
    """3,000 random events (admit with shared prefixes, grow, write, fork, finish,
    preempt, roll back) on a 48-page pool: after each, refcounts equal the rows'
    references, every page is free, cached or referenced exactly once (no leak), and a
    page shared by rows holds the same tokens for each."""
    rng = np.random.default_rng(0)
    p = 4
    alloc = paged.PageAllocator(48, p, prefix_cache=True)
    prefixes = [list(rng.integers(0, 50, 12)) for _ in range(3)]
    next_id, exhausted, hits = 0, 0, 0
    for _ in range(3000):
        live = list(alloc.rows)
        ev = rng.choice(["admit", "grow", "finish", "preempt", "fork", "trim"],
                        p=[.3, .35, .12, .08, .08, .07])
        try:
            if ev == "admit" or not live:
                toks = prefixes[rng.integers(3)][:rng.integers(1, 13)] + \
                    list(rng.integers(0, 50, rng.integers(1, 10)))
                hit = alloc.admit(next_id, toks, len(toks) + rng.integers(0, 5))
                hits += hit
                assert hit % p == 0 and hit < len(toks)
                alloc.append(next_id, toks[hit:])
                next_id += 1
            elif ev == "grow":
                r = live[rng.integers(len(live))]
                n = int(rng.integers(1, 7))
                alloc.ensure(r, alloc.length(r) + n)
                pages = alloc.block_table(r)[alloc.length(r) // p:]
                assert (alloc.refcount[pages] == 1).all()  # the pages written: its own
                alloc.append(r, rng.integers(0, 50, n))
            elif ev in ("finish", "preempt"):
                alloc.release(live[rng.integers(len(live))])
            elif ev == "fork":
                alloc.fork(live[rng.integers(len(live))], next_id)
                next_id += 1
            else:
                r = live[rng.integers(len(live))]
                alloc.trim(r, int(rng.integers(0, alloc.length(r) + 1)))
        except paged.PoolExhausted:
            exhausted += 1
        alloc.check()
    for r in list(alloc.rows):
        alloc.release(r)
    alloc.check()
    assert alloc.num_referenced == 0 and alloc.num_available == 48
    assert exhausted > 0 and hits > 0  # the pool did run out, the prefix cache did hit


def test_allocator_evicts_least_recently_used():
    """Cached pages nobody references are evicted oldest first, and only when the free
    list is empty."""
    alloc = paged.PageAllocator(4, 2, prefix_cache=True)
    for r, toks in enumerate([[1, 2, 3], [4, 5, 6]]):
        alloc.admit(r, toks, 3)
        alloc.append(r, toks)
    a, b = alloc.block_table(0)[0], alloc.block_table(1)[0]
    alloc.release(0)
    alloc.release(1)
    assert alloc.match([1, 2, 9]) == [a] and alloc.match([4, 5, 9]) == [b]
    alloc.admit(2, [7, 8, 9, 10, 11], 5)  # 3 pages: 2 free ones, then evicts a (older)
    assert alloc.match([1, 2, 9]) == [] and alloc.match([4, 5, 9]) == [b]
    alloc.check()


def test_paged_engine_equals_dense_engine():
    """Greedy tokens of the paged engine equal the dense engine's, request for request:
    with a pool too small for all rows (preemption and recompute), and with the prefix
    cache (requests sharing an 8-token system turn prefill it once)."""
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    rng = np.random.default_rng(3)
    system = list(rng.integers(0, 97, 8))
    reqs = [engine.Request(i, tuple(int(t) for t in system + list(
        rng.integers(0, 97, rng.integers(1, 6)))), int(rng.integers(6, 16)))
        for i in range(6)]
    dense, dstats = engine.Engine(params, cfg, num_slots=3, max_seq_len=32,
                                  steps_per_sync=4).run(reqs)
    # a pool that holds every row runs the dense engine's schedule: the same steps and
    # the same live tokens, counted step by step as rows grow inside a block
    ample = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=4,
                          num_pages=24, steps_per_sync=4)
    got, stats = ample.run(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    assert stats.preemptions == 0 and stats.steps == dstats.steps
    assert stats.live_kv_byte_steps == dstats.live_kv_byte_steps > 0
    assert stats.occupied_slot_steps == dstats.occupied_slot_steps
    # the pages of running rows hold their live tokens, at most a page and the block's
    # look-ahead more; every referenced page counts the stopped rows' too
    assert stats.live_kv_byte_steps <= stats.active_page_kv_byte_steps \
        <= stats.page_kv_byte_steps
    # pages of one token, one step a block: the running rows' pages are their tokens
    exact = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=1,
                          num_pages=96, steps_per_sync=1)
    got, stats = exact.run(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    assert stats.active_page_kv_byte_steps == stats.live_kv_byte_steps > 0
    tight = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=4,
                          num_pages=9, steps_per_sync=4)
    got, stats = tight.run(reqs)
    assert stats.preemptions > 0
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    shared = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=4,
                           num_pages=9, steps_per_sync=4, prefix_cache=True)
    got, stats = shared.run(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    # later requests find the system turn's 2 full pages cached
    assert stats.prefix_hit_tokens >= 8 * 2 and stats.prefix_hit_tokens % 4 == 0
    assert stats.prefill_tokens == stats.prompt_tokens - stats.prefix_hit_tokens
    assert stats.max_running <= 3
    shared.rows.alloc.check()
    assert shared.rows.alloc.num_referenced == 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_warmup_compiles_every_prefill_the_run_needs(prefix_cache):
    """A request is prefilled from a cached page (prefix hits: fewer tokens than its
    prompt, another bucket) or again with its generated tokens (preemption without the
    prefix cache: more tokens): the warm-up compiles those buckets too, so the timed run
    compiles no prefill."""
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    rng = np.random.default_rng(7)
    system = list(rng.integers(0, 97, 16))  # 4 pages: prompts of 36-44 tokens (bucket
    reqs = [engine.Request(i, tuple(int(t) for t in system + list(  # 64) leave 20-28
        rng.integers(0, 97, rng.integers(20, 29)))), int(rng.integers(8, 17)))
        for i in range(6)]  # (bucket 32) after a hit; a preempted row is re-prefilled whole
    eng = engine.Engine(params, cfg, num_slots=3, max_seq_len=64, page_size=4,
                        num_pages=40 if prefix_cache else 24, steps_per_sync=4,
                        prefix_cache=prefix_cache)
    eng.warmup(reqs)
    compiled = engine.paged_prefill_program._cache_size()
    _, stats = eng.run(reqs, warmup=False)
    if prefix_cache:
        assert stats.prefix_hit_tokens > 0
    else:
        assert stats.preemptions > 0
    assert engine.paged_prefill_program._cache_size() == compiled


@pytest.mark.parametrize("name", ["gqa", "window_sinks"])
def test_speculative_rounds_on_pages_keep_the_plain_tokens(name):
    """N-gram speculative rounds in the paged engine (k = 3; rejected drafts taken back by
    the rows' lengths) emit the dense engine's plain greedy tokens, request for request,
    with a pool too small for all rows (preemption, recompute) and, for a window with
    sinks, its slid-out pages freed between blocks; drafts were proposed and accepted."""
    cfg = ModelConfig(**VARIANTS[name])
    params = params_of(name)
    rng = np.random.default_rng(5)
    reqs = []
    for i in range(5):  # prompts that repeat themselves: the n-gram drafter has matches
        motif = list(rng.integers(0, 97, 3))
        reqs.append(engine.Request(i, tuple(int(t) for t in motif * 3), int(rng.integers(8, 16))))
    dense, _ = engine.Engine(params, cfg, num_slots=3, max_seq_len=32,
                             steps_per_sync=4).run(reqs)
    spec = SpeculativeConfig(drafter="ngram", k=3, ngram_max=2, ngram_min=1)
    eng = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=4,
                        num_pages=10, steps_per_sync=2, speculative=spec)
    got, stats = eng.run(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    assert stats.proposed > 0 and stats.accepted > 0, (stats.proposed, stats.accepted)
    assert stats.preemptions > 0
    eng.rows.alloc.check()


@pytest.mark.parametrize("drafter", ["self", "model"])
def test_draft_models_on_pages_keep_the_plain_tokens(drafter):
    """The paged engine with a draft model whose dense cache rows sit beside the block-
    table rows: 'self' (the same weights over a window of 4 with a sink, int8 keys and
    values, one layer) and 'model' (the target's own weights and config: every draft is
    its greedy token, so only budgets cut a round and the last draft stays pending
    across blocks). With a pool too small for all rows, a preempted request's draft row
    is prefilled again on readmission; every request's greedy tokens equal the dense
    engine's plain ones; a wrong-vocabulary draft and draft= alone are refused."""
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    rng = np.random.default_rng(6)
    reqs = [engine.Request(i, tuple(int(t) for t in rng.integers(0, 97, rng.integers(3, 9))),
                           int(rng.integers(8, 16))) for i in range(5)]
    dense, _ = engine.Engine(params, cfg, num_slots=3, max_seq_len=32,
                             steps_per_sync=4).run(reqs)
    spec = SpeculativeConfig(drafter="self", k=3, draft_window_size=4, draft_sink_tokens=1,
                             draft_kv_dtype="int8", draft_num_layers=1) \
        if drafter == "self" else SpeculativeConfig(drafter="model", k=2,
                                                     draft_config="configs/mqa.py")
    draft = (params, cfg) if drafter == "model" else None
    eng = engine.Engine(params, cfg, num_slots=3, max_seq_len=32, page_size=4,
                        num_pages=10, steps_per_sync=2, speculative=spec,
                        draft=draft)
    assert eng.draft_cache_bytes > 0
    got, stats = eng.run(reqs)
    assert [c.tokens for c in got] == [c.tokens for c in dense]
    assert stats.preemptions > 0
    assert stats.proposed > 0 and 0 < stats.accepted <= stats.proposed
    if drafter == "model":
        assert stats.accepted == stats.proposed, (stats.accepted, stats.proposed)
    eng.rows.alloc.check()
    other = ModelConfig(**{**VARIANTS["mqa"], "vocab_size": 50})
    with pytest.raises(ConfigError, match=r"draft model vocab_size=50"):
        engine.Engine(params, cfg, 3, 32, page_size=4, num_pages=10,
                      speculative=spec if drafter == "model" else dataclasses.replace(
                          spec, drafter="model", draft_config="configs/mqa.py"),
                      draft=({}, other))
    with pytest.raises(ValueError, match=r"draft= without speculative="):
        engine.Engine(params, cfg, 3, 32, page_size=4, num_pages=10, draft=({}, other))


def test_bad_input_refused_by_name():
    cfg = ModelConfig(**VARIANTS["gqa"])
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"page_size={bad}"):
            paged.init_paged_cache(cfg, 1, 4, bad, 2)
        with pytest.raises(ValueError, match=f"page_size={bad}"):
            paged.PageAllocator(4, bad)
        with pytest.raises(ValueError, match=f"page_size={bad}"):
            engine.Engine({}, cfg, 2, 32, page_size=bad, num_pages=8)
    with pytest.raises(ValueError, match="num_pages=3 .* max_seq_len=32"):
        engine.Engine({}, cfg, 2, 32, page_size=4, num_pages=3)
    eng = engine.Engine({}, cfg, 2, 32, page_size=4, num_pages=8)
    with pytest.raises(ValueError, match="request 7 .* max_seq_len=32"):
        eng.check(engine.Request(7, (1,) * 30, 5))
    eng.rows.max_seq_len = 64  # a row longer than the pool: the pool names itself
    with pytest.raises(ValueError, match="request 8 .* num_pages=8"):
        eng.check(engine.Request(8, (1,) * 40, 1))
    with pytest.raises(paged.PoolExhausted):
        alloc = paged.PageAllocator(2, 4)
        alloc.admit(0, [1] * 9, 9)
    from kvjax.config import run_config_from_dict  # noqa: PLC0415
    from configs import gqa  # noqa: PLC0415
    d = gqa.get_config()
    d.page_size = -2
    with pytest.raises(ConfigError, match="page_size=-2"):
        run_config_from_dict(d)


def test_theory_waste_and_capacity():
    """Internal waste stays within P - 1 tokens per sequence; the capacity at a budget
    follows the page counts: reservation holds budget // max_seq_len requests, paging
    budget // mean(P·ceil(l/P)), a shared prefix's full pages are stored once; the
    per-token bytes equal a real paged cache's page bytes / P."""
    from kvjax.analysis import paging, theory  # noqa: PLC0415
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 200, 500).tolist()
    for p in (1, 16, 7):
        waste = paging.internal_waste(lengths, p)
        assert 0 <= waste <= (p - 1) * len(lengths)
        assert all(0 <= paging.paged_tokens(x, p) - x < p for x in lengths)
    assert paging.internal_waste(lengths, 1) == 0
    cfg = ModelConfig(**{**VARIANTS["gqa"], "kv_dtype": "int8"})
    per_token = theory.kv_bytes_per_token(cfg)
    assert paged.page_bytes(cfg, 16) == 16 * per_token  # codes and scales, every layer
    lens = [40, 50, 70, 90]  # paged at P = 16: 48, 64, 80, 96 tokens, mean 72
    cap = paging.capacity(cfg, 1000 * per_token, lens, max_seq_len=256, page_size=16,
                          prefix_len=33)  # 2 full pages of the prefix shared
    assert (cap.budget_tokens, cap.reserved, cap.paged) == (1000, 1000 // 256, 1000 // 72)
    assert cap.shared == (1000 - 32) // (72 - 32)
    assert cap.waste_fraction == pytest.approx((8 + 14 + 10 + 6) / (4 * 72))
    assert paging.paged_step_read_bytes(cfg, lens, 16, 16, "in_place") == \
        288 * per_token + 4 * 16 * 4 * cfg.num_layers  # each layer reads the tables
    gather = paging.paged_step_bytes(cfg, lens, 16, 16, "gather")
    assert (gather.pages, gather.view) == (4 * 256 * per_token, 2 * 4 * 256 * per_token)
    assert gather.kv_write == 4 * per_token
    assert gather.total == theory.weight_bytes_per_step(cfg) + gather.kv_read + gather.kv_write
    with pytest.raises(ValueError, match="page_size=0"):
        paging.capacity(cfg, 1e6, lens, 256, 0)
    with pytest.raises(ValueError, match="prefix_len=41"):
        paging.capacity(cfg, 1e6, lens, 256, 16, prefix_len=41)


def test_serve_reports_paged_figures():
    """experiments.serve's summary of a paged run carries the pages referenced, rows
    running, preemptions and prefix-cache figures, and its report prints them; a dense
    run's summary has none of them."""
    from tests.conftest import import_entry_point  # noqa: PLC0415
    serve = import_entry_point("serve")
    st = engine.EngineStats(wall_s=2.0, tokens=10, steps=4, occupied_slot_steps=8,
                            live_kv_byte_steps=400.0, allocated_kv_bytes=1000,
                            num_slots=4, preemptions=1, prompt_tokens=40,
                            prefix_hit_tokens=16, prefill_tokens=24,
                            page_kv_byte_steps=480.0, active_page_kv_byte_steps=440.0,
                            max_running=3, page_size=4)
    s = serve.paged_summary(st)
    assert (s["kv_bytes_pages_mean"], s["kv_bytes_active_pages_mean"], s["running_mean"],
            s["prefix_hit_rate"]) == (120.0, 110.0, 2.0, 0.4)
    assert serve.paged_summary(engine.EngineStats()) == {}
    done = [engine.Completion(0, 5, [1, 2], "budget", 0, 0.1, 0.5)]
    text = serve.report(serve.summarize(done, st), [])
    assert "1 preemptions" in text and "hit rate 40.0%" in text and "24 prefilled" in text
    assert "live/referenced 83.3%" in text and "live/those 90.9%" in text


def test_window_pages_that_slide_out_are_freed():
    """A window with sinks on pages: pages no later query sees are freed (sink pages
    kept), the allocator's invariants hold, the greedy tokens equal the dense engine's,
    and a row holds a bounded number of pages however long it runs."""
    alloc = paged.PageAllocator(12, 4)
    alloc.admit(0, list(range(20)), 20)
    alloc.append(0, list(range(20)))  # written: drop_before frees written positions only
    # window 6, 2 sinks, next query at 20: positions 15.. are seen; pages 1..2 (4..11)
    # hold only older keys, page 0 holds the sinks, page 3 (12..15) holds 15
    assert alloc.drop_before(0, 20 - 6 + 1, keep_first=2) == 2
    assert alloc.block_table(0)[:4] == [alloc.block_table(0)[0], paged.DROPPED,
                                        paged.DROPPED, alloc.block_table(0)[3]]
    assert alloc.num_referenced == 3
    alloc.check()
    alloc.fork(0, 1)
    alloc.trim(1, 13)
    alloc.check()
    alloc.release(0)
    alloc.release(1)
    alloc.check()
    assert alloc.num_referenced == 0 and alloc.num_available == 12

    cfg = ModelConfig(**VARIANTS["window_sinks"])  # W = 6, 2 sinks
    params = params_of("window_sinks")

    def paged_equals_dense(reqs, max_rows, num_pages):
        dense, dstats = engine.Engine(params, cfg, num_slots=2, max_seq_len=40,
                                      steps_per_sync=3).run(reqs)
        eng = engine.Engine(params, cfg, num_slots=max_rows, max_seq_len=40,
                            page_size=2, num_pages=num_pages, steps_per_sync=3)
        got, stats = eng.run(reqs)
        assert [c.tokens for c in got] == [c.tokens for c in dense]
        if max_rows == 2 and not stats.preemptions:  # the dense schedule: a window's
            # live tokens are W at most, however many view slots a paged row has
            assert stats.live_kv_byte_steps == dstats.live_kv_byte_steps > 0
        return eng, stats

    eng, stats = paged_equals_dense(
        [engine.Request(i, tuple(range(3 + i, 14 + 2 * i)), 18) for i in range(3)], 2, 24)
    # the sink page + the pages of the window and one block ahead (W - 1 + 3 = 8
    # positions: at most 5 pages of 2) , against up to 20 pages of 2 for 36 tokens
    assert stats.max_row_pages <= 1 + 5
    eng.rows.alloc.check()
    assert eng.rows.alloc.num_referenced == 0
    # three rows of 16-token prompts on 20 pages of 2: preemption amid freed pages
    tight, stats = paged_equals_dense(
        [engine.Request(i, tuple(range(3 + i, 19 + i)), 18) for i in range(4)], 3, 20)
    assert stats.preemptions > 0
    tight.rows.alloc.check()


def _allocator_state(alloc):
    """Everything an allocator call may change, as plain values (a failed call must
    leave it equal)."""
    return (alloc.refcount.tolist(), list(alloc.free), list(alloc.lru.items()),
            dict(alloc.key_of), dict(alloc.page_of),
            {r: (list(x.pages), list(x.tokens), list(x.hashes)) for r, x in alloc.rows.items()},
            alloc.hit_tokens, alloc.query_tokens)


class _PagesModel:
    """The device side of a :class:`paged.PageAllocator`: what each page physically
    holds. It writes a row's tokens only through the row's block table, after asserting
    the page is the row's alone and no key names it, applies the copies ``ensure``
    returns, and checks that every page a row holds shows that row's tokens and every
    keyed page still holds the tokens it was keyed with."""

    def __init__(self, alloc):
        self.alloc, self.p = alloc, alloc.page_size
        self.pages = [[None] * self.p for _ in range(alloc.num_pages)]
        self.keyed: dict = {}  # page -> tokens when it got its key

    def write(self, row, start, tokens):
        a = self.alloc
        table = a.block_table(row)
        for j, t in enumerate(tokens):
            page = table[(start + j) // self.p]
            assert page != paged.DROPPED, f"row {row} writes into a page it dropped"
            assert a.refcount[page] == 1, f"row {row} writes into shared page {page}"
            assert page not in a.key_of, f"row {row} writes into keyed page {page}"
            self.pages[page][(start + j) % self.p] = int(t)

    def copy(self, pairs):
        for src, dst in pairs:
            self.pages[dst] = list(self.pages[src])

    def verify(self):
        a = self.alloc
        for page, key in a.key_of.items():
            if page not in self.keyed or self.keyed[page][0] != key:
                self.keyed[page] = (key, list(self.pages[page]))
            assert self.pages[page] == self.keyed[page][1], \
                f"keyed page {page} was written after it got its key"
        for rid, r in a.rows.items():
            for i, page in enumerate(r.pages):
                toks = r.tokens[i * self.p:(i + 1) * self.p]
                if page != paged.DROPPED:
                    assert self.pages[page][:len(toks)] == toks, \
                        f"row {rid}'s page {i} (pool page {page}) holds other tokens"


@pytest.mark.parametrize("seed", range(4))
def test_allocator_fuzz_keeps_its_invariants_against_a_model_of_the_pages(seed):
    """Issue 54 item 3: 1,500 random admit / append (ensure, write) / fork / trim /
    drop_before / release events, and calls that must fail (an exhausted pool, a trim
    below dropped pages or past the length, a drop past the length), on a 14-page pool
    with a prefix cache, against a model of what each page holds: after every event
    ``check()`` passes, every row reads its own tokens, no page is written while
    another row or a key refers to it, a prefix hit's pages hold the prompt's tokens,
    and a failed call changes nothing. Before the fix: a trim into a shared keyed page
    kept its key (a later prompt hit another request's tokens), a copy on write that
    then ran out of pages kept the new page without a copy, and after drop_before and
    a trim below it ensure wrote into page -1."""
    rng = np.random.default_rng(seed)
    p = 2
    alloc = paged.PageAllocator(14, p, prefix_cache=True)
    model = _PagesModel(alloc)
    prefixes = [list(rng.integers(0, 6, 8)) for _ in range(2)]
    next_id = 0
    seen = collections.Counter()
    for _ in range(1500):
        live = list(alloc.rows)
        ev = "admit" if not live else rng.choice(
            ["admit", "append", "fork", "trim", "drop", "release", "bad"],
            p=[.2, .3, .12, .15, .08, .1, .05])
        r = live[rng.integers(len(live))] if live else None
        before = _allocator_state(alloc)
        try:
            if ev == "admit":
                toks = prefixes[rng.integers(2)][:rng.integers(1, 9)] + \
                    list(rng.integers(0, 6, rng.integers(0, 4)))
                toks = toks or [1]
                hit = alloc.admit(next_id, toks, len(toks) + int(rng.integers(0, 3)))
                for i, page in enumerate(alloc.block_table(next_id)[:hit // p]):
                    assert model.pages[page] == toks[i * p:(i + 1) * p], \
                        f"a prefix hit on page {page}, which holds other tokens"
                seen["hit"] += hit > 0
                model.write(next_id, hit, toks[hit:])
                alloc.append(next_id, toks[hit:])
                next_id += 1
            elif ev == "append":
                n = alloc.length(r)
                new = list(rng.integers(0, 6, rng.integers(1, 4)))
                model.copy(alloc.ensure(r, n + len(new)))
                model.write(r, n, new)
                alloc.append(r, new)
            elif ev == "fork":
                alloc.fork(r, next_id)
                next_id += 1
            elif ev == "trim":
                table = alloc.block_table(r)
                low = max([(i + 1) * p for i, g in enumerate(table) if g == paged.DROPPED],
                          default=0)
                alloc.trim(r, int(rng.integers(low, alloc.length(r) + 1)))
                seen["trim"] += 1
            elif ev == "drop":
                seen["drop"] += alloc.drop_before(r, int(rng.integers(0, alloc.length(r) + 1)),
                                                  keep_first=int(rng.integers(0, 3)))
            elif ev == "release":
                alloc.release(r)
            else:  # calls that must be refused, changing nothing
                table = alloc.block_table(r)
                dropped = [i for i, g in enumerate(table) if g == paged.DROPPED]
                bad = [lambda: alloc.trim(r, alloc.length(r) + 1),
                       lambda: alloc.trim(r, -1),
                       lambda: alloc.drop_before(r, alloc.length(r) + 1)]
                if dropped:
                    bad.append(lambda: alloc.trim(r, dropped[-1] * p))
                with pytest.raises(ValueError):
                    bad[rng.integers(len(bad))]()
                seen["refused"] += 1
                assert _allocator_state(alloc) == before
        except paged.PoolExhausted:
            assert _allocator_state(alloc) == before, f"a failed {ev} changed the pool"
            seen["exhausted"] += 1
        alloc.check()
        model.verify()
    for r in list(alloc.rows):
        alloc.release(r)
    alloc.check()
    assert alloc.num_referenced == 0 and alloc.num_available == 14
    assert min(seen[k] for k in ("hit", "trim", "drop", "refused", "exhausted")) > 0, seen


def test_allocator_faults_of_issue_54():
    """The three cases of issue 54 item 3, step by step (the fuzz above finds them)."""
    # (a) a trim into a shared keyed page unkeys it: after the other holder leaves, a
    # prompt with the old tokens misses instead of hitting the overwritten page
    alloc = paged.PageAllocator(8, 2, prefix_cache=True)
    alloc.admit(0, [1, 2, 3, 4], 4)
    alloc.append(0, [1, 2, 3, 4])
    alloc.fork(0, 1)
    alloc.trim(1, 3)
    alloc.release(0)
    alloc.check()
    alloc.ensure(1, 4)
    alloc.append(1, [9])
    alloc.check()
    assert alloc.match([1, 2, 3, 4, 5]) == alloc.block_table(1)[:1]  # page 0 only
    # (b) a copy on write that runs out of pages takes nothing
    alloc = paged.PageAllocator(3, 2)
    alloc.admit(0, [1, 2, 3], 4)
    alloc.append(0, [1, 2, 3])
    alloc.fork(0, 1)
    alloc.admit(2, [7], 2)
    table = alloc.block_table(1)
    with pytest.raises(paged.PoolExhausted, match="needs 1 copies and 0 new pages"):
        alloc.ensure(1, 4)
    assert alloc.block_table(1) == table and alloc.num_available == 0
    alloc.release(2)
    assert alloc.ensure(1, 4) == [(table[1], alloc.block_table(1)[1])]  # the copy, now
    alloc.check()
    # (c) no trim below dropped pages (ensure would write into page -1)
    alloc = paged.PageAllocator(6, 2)
    alloc.admit(0, list(range(6)), 6)
    alloc.append(0, list(range(6)))
    assert alloc.drop_before(0, 5) == 2
    with pytest.raises(ValueError, match=r"num_tokens=3\); allowed: an integer in \[4, 6\]"):
        alloc.trim(0, 3)
    with pytest.raises(ValueError, match=r"position=7\); allowed: at most the row.s length 6"):
        alloc.drop_before(0, 7)
    alloc.trim(0, 4)
    alloc.ensure(0, 6)
    alloc.append(0, [4, 5])
    alloc.check()
