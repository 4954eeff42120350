"""Issue 55 item 3 on the paged engine: the analyses of a paged step and of a pool model a
compressed row (an evicting method, schedule 'prefill') as its fixed W = kv_budget +
recent_slots slots on W / P pages (decision 0041): the cost hook compiles the paged step
over those pages against theory at the budget, and the capacity of a pool counts a row's
W / P pages whatever its length, as the engine admits it."""

from __future__ import annotations

import dataclasses

import pytest

from kvjax import compression, native, presets
from kvjax.analysis import batch, costs, paging, theory
from kvjax.config import ConfigError
from kvjax.inference import engine
from kvjax.models import model as model_lib
from kvjax.plan import Plan
from tests.test_compressed_pages import cfg_for

P = 16
BUDGET = 128  # + the default ring of 192: W = 320 slots, 20 pages of 16


def smol(method, kv_dtype=None, **overrides):
    """SmolLM2-135M's shapes shrunk to 2 layers and a 4,096-token vocabulary."""
    return presets.smollm2_135m("float32", scan_layers=None).replace(
        num_layers=2, vocab_size=4096, kv_compression=method, kv_budget=BUDGET,
        kv_dtype=kv_dtype, weight_matmul="xla", **{"decode_attention": "xla", **overrides})


@pytest.mark.parametrize("method, kv_dtype, native_kernel", [
    ("snapkv", None, False), ("snapkv", "int8", False), ("tova", None, False),
    ("key_norm", "int8", False),
    pytest.param("h2o", None, True, marks=pytest.mark.skipif(
        not native.load(), reason="native kernel not built (no compiler)")),
])
def test_compiled_paged_compressed_step_matches_theory_at_the_budget(method, kv_dtype,
                                                                    native_kernel):
    """The paged step over a compressed row's 20 pages at t = 512 and t = 8,192: theory is
    the dense compressed step's (step_bytes at the budget, the same at both contexts),
    the compiled bytes (XLA + kernels) are within [0.9, 1.3] of it, they do not grow
    with the context (the full read at 8,192 would read 25.6x the K/V), and the gathered
    formulation's compiled K/V read is theory's kv_read exactly."""
    over = {"decode_attention": "native", "plan": Plan(native=("decode_attention",))} \
        if native_kernel else {}
    cfg = smol(method, kv_dtype, **over)
    w = BUDGET + cfg.compression.recent_slots
    short, long = (costs.analyze_paged_decode_step(cfg, t, P) for t in (512, 8192))
    want = theory.step_bytes(cfg, w)
    full = theory.step_bytes(cfg.replace(kv_compression=None, kv_budget=None), 8192)
    assert full.kv_read > 25 * want.kv_read  # what reading every token would add
    for r in (short, long):
        assert (r["row_pages"], r["theory_bytes"]) == (w // P, want.total)
        assert 0.9 <= r["counted_over_theory"] <= 1.3, r["counted_over_theory"]
        if not native_kernel:
            assert r["attribution"]["bytes"]["kv_read"] == r["theory"]["kv_read"]
    assert long["counted_bytes"] == short["counted_bytes"]
    assert long["xla_flops"] == short["xla_flops"]


def test_a_compression_pages_cannot_hold_is_refused_by_the_cost_hook():
    """Every-N re-scoring runs on dense rows only: the paged step is refused naming it."""
    cfg = smol("snapkv", compression=compression.CompressionConfig(schedule="every_n",
                                                                  every_n=4))
    with pytest.raises(ConfigError, match="model.compression.schedule='every_n'"):
        costs.analyze_paged_decode_step(cfg, 1024, P)


def tiny(method="snapkv", **overrides):
    """tests/test_compressed_pages.py's setup: budget 24 + ring 16 = 40 slots, 5 pages
    of 8."""
    return cfg_for(method, 24, **overrides)


def admitted(cfg, num_pages, lengths, page_size=8):
    """Requests of ``lengths`` admitted through the engine's real page store
    (:class:`engine.PagedRows`, as ``Engine`` builds it) until the next does not fit;
    (count, the pool's allocated bytes)."""
    eng = engine.Engine(model_lib.init_params(cfg, 0), cfg, num_slots=64, max_seq_len=128,
                        page_size=page_size, num_pages=num_pages)
    n = 0
    while eng.rows.admit(n, [3] * lengths[n % len(lengths)],
                         lengths[n % len(lengths)]) is not None:
        n += 1
    return n, eng.rows.allocated_bytes


@pytest.mark.parametrize("over", [{}, {"kv_dtype": "int8"}])
def test_capacity_counts_a_compressed_rows_fixed_pages(over):
    """A pool of 65 pages of 8: the engine admits 13 compressed rows (5 pages each,
    whatever the length: short and long requests alike) and 5 uncompressed rows of 100
    tokens (13 pages each); paging.capacity for the pool's bytes says the same, and the
    ratio of the two capacities is the rows' pages', 104 / 40."""
    cfg = tiny(**over)
    full = cfg.replace(kv_compression=None, kv_budget=None)
    n, pool = admitted(cfg, 65, [100, 7, 60])
    m, pool_full = admitted(full, 65, [100])
    assert (n, m) == (13, 5) and pool == pool_full
    cap = paging.capacity(cfg, pool, [100, 7, 60], max_seq_len=128, page_size=8)
    cap_full = paging.capacity(full, pool, [100], max_seq_len=128, page_size=8)
    assert (cap.paged, cap_full.paged) == (n, m)
    assert cap.paged * 40 == cap_full.paged * 104 == cap.budget_tokens
    assert (cap.row_slots, cap_full.row_slots) == (40, 0)
    assert cap.reserved == cap.shared == cap.paged  # a dense compressed row is W too
    assert cap.waste_fraction == pytest.approx((40 - 7) / (3 * 40))
    assert cap.reserved_live_fraction == pytest.approx((40 + 7 + 40) / (3 * 40))
    with pytest.raises(ValueError, match="prefix_len=4 with model.kv_compression='snapkv'"):
        paging.capacity(cfg, pool, [100], 128, 8, prefix_len=4)
    with pytest.raises(ConfigError, match=r"model.kv_budget=24; allowed: .*page_size=16"):
        paging.capacity(cfg, pool, [100], 128, 16)


def test_the_measured_paged_wall_of_compressed_rows_is_its_capacity():
    """batch.measure_paged_wall admits compressed rows of W / P pages: exactly
    paging.capacity's count for the pool, and the count of dense compressed rows of the
    same bytes (theory.max_batch: paging buys no more rows of a fixed size)."""
    cfg = tiny()
    wall = batch.measure_paged_wall(cfg, 128, 2**21, 8, lengths=[5, 90, 128])
    per_row = 40 * theory.kv_bytes_per_token(cfg)
    assert wall.measured == wall.theory == wall.pool_bytes // per_row == wall.reserved
    assert wall.measured > 0


def test_paged_step_bytes_of_compressed_rows_are_theorys_at_the_budget():
    """In place, each compressed row reads its W slots whatever its length: past the
    budget theory's kv_read; the gather reads the W / P pages three times; a block table
    of other than W / P pages is refused, naming max_pages."""
    cfg = tiny(kv_dtype="int8")
    lens = [7, 300, 1000]
    got = paging.paged_step_bytes(cfg, lens, 8, 5, "in_place")
    assert got.pages == 3 * theory.kv_cache_bytes(cfg, 1000)
    assert got.pages + got.kv_write == theory.step_bytes(cfg, 1000, 3).kv_read + \
        theory.step_bytes(cfg, 1000, 3).kv_write
    gather = paging.paged_step_bytes(cfg, lens, 8, 5, "gather")
    assert gather.view == 2 * gather.pages == 2 * got.pages
    with pytest.raises(ValueError, match=r"max_pages=16 .*allowed: 5"):
        paging.paged_step_bytes(cfg, lens, 8, 16)
    plain = dataclasses.replace(cfg, kv_compression=None, kv_budget=None)
    assert paging.paged_step_bytes(plain, lens, 8, 125, "in_place").pages == \
        sum(paging.paged_tokens(x, 8) for x in lens) * theory.kv_bytes_per_token(plain)


def test_serve_reports_the_rows_a_compressed_pool_holds():
    """experiments.serve on compressed pages adds the row's W slots and W / P pages and
    the rows the pool holds (paging.capacity): the engine's own admission count; its
    report prints them; uncompressed or dense rows add nothing."""
    from tests.conftest import import_entry_point  # noqa: PLC0415
    serve = import_entry_point("serve")
    cfg = tiny()
    n, pool = admitted(cfg, 65, [100, 7])
    got = serve.compressed_pool(cfg, pool, 8, 128)
    assert got == {"compressed_row_slots": 40, "compressed_row_pages": 5,
                   "compressed_pool_rows": n}
    full = cfg.replace(kv_compression=None, kv_budget=None)
    assert serve.compressed_pool(full, pool, 8, 128) == serve.compressed_pool(
        cfg, pool, 0, 128) == {}
    st = engine.EngineStats(wall_s=1.0, tokens=4, steps=2, occupied_slot_steps=2,
                            live_kv_byte_steps=10.0, allocated_kv_bytes=pool, num_slots=2,
                            page_kv_byte_steps=20.0, active_page_kv_byte_steps=20.0,
                            max_running=1, page_size=8)
    done = [engine.Completion(0, 5, [1, 2], "budget", 0, 0.1, 0.5)]
    text = serve.report({**serve.summarize(done, st), **got}, [])
    assert "compressed rows: 40 slots (kv_budget + recent_slots) = 5 pages each" in text
    assert "the pool holds 13 such rows" in text
