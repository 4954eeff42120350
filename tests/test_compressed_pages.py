"""Lever 5 on paged rows (issue 55 item 2): an evicting method's row is its kv_budget +
recent_slots slots on a fixed number of pages (kvjax.cache.paged, the engine's
PagedRows). Its tokens equal the dense slot engine's, its allocated bytes theory's at
the budget, a method keeping every slot the uncompressed paged engine's; what pages
cannot hold is refused by name; the decode step's formulation is the registry's for a
ring over pages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvjax import compression, kernels, native
from kvjax.analysis import theory
from kvjax.cache import kv as cache_lib
from kvjax.cache import paged
from kvjax.config import ConfigError, RunConfig, SpeculativeConfig
from kvjax.inference import engine
from kvjax.models import decode_kernels
from kvjax.models import model as model_lib
from kvjax.plan import Plan
from tests.conftest import tiny_config, tiny_mla_config

KNOBS = compression.CompressionConfig(observation_window=8, recent_slots=16,
                                      num_sink_tokens=4, pooling_kernel=3)
P = 8  # tokens per page: budget 24 + ring 16 = 40 slots, 5 pages per row
LENGTHS = (50, 33, 61, 12, 40)  # ragged prompts, two shorter than the budget
NEW = (30, 8, 25, 12, 9)  # 30 and 25 new tokens wrap the ring of 16


def cfg_for(method="snapkv", budget=24, mla=False, **overrides):
    make = tiny_mla_config if mla else tiny_config
    overrides.setdefault("compression", KNOBS)
    return make(tie_embeddings=False, kv_compression=method, kv_budget=budget, **overrides)


def requests(seed=0, lengths=LENGTHS, new=NEW):
    r = np.random.default_rng(seed)
    return [engine.Request(i, tuple(int(x) for x in r.integers(3, 97, n)), m)
            for i, (n, m) in enumerate(zip(lengths, new))]


def serve(params, cfg, reqs, rows=2, **pages):
    eng = engine.Engine(params, cfg, num_slots=rows, max_seq_len=128, steps_per_sync=3,
                        **pages)
    done, stats = eng.run(reqs)
    return [list(c.tokens) for c in done], stats, eng


@pytest.mark.parametrize("method, over", [
    ("snapkv", {}), ("tova", {}), ("h2o", {}), ("key_norm", {}), ("streaming_llm", {}),
    ("pyramidkv", {"compression": dataclasses.replace(KNOBS, uniform_layers=True)}),
    ("snapkv", {"kv_dtype": "int8"}), ("h2o", {"mla": True}),
    ("tova", {"scan_layers": False}),
])
def test_paged_rows_give_the_dense_rows_tokens(method, over):
    """Five requests of ragged prompts (two below the budget, two whose answers wrap the
    ring) through two rows of a 10-page pool: pages are reused by later requests and
    every request's tokens equal the dense slot engine's (each compressed at its own
    prefill, kept slots per KV head)."""
    cfg = cfg_for(method, **over)
    params = model_lib.init_params(cfg, 0)
    reqs = requests()
    want, _, _ = serve(params, cfg, reqs)
    got, stats, eng = serve(params, cfg, reqs, page_size=P, num_pages=10)
    assert got == want
    assert stats.preemptions == 0 and stats.max_row_pages == 40 // P
    assert eng.rows.cache.num_slots == 40  # the row's view: its budget and ring


@pytest.mark.parametrize("over", [{}, {"kv_dtype": "int8"}, {"mla": True}])
def test_allocated_bytes_equal_theory_at_the_budget(over):
    """Four rows of budget 24 + ring 16 on pages of 8: the pool the engine allocates is
    theory's bytes of four sequences at any t past the budget and the dense compressed
    cache's (cache_spec), and below the uncompressed paged engine's pool of the same
    rows."""
    cfg = cfg_for(**over)
    params = model_lib.init_params(cfg, 0)
    rows, w = 4, 24 + KNOBS.recent_slots
    eng = engine.Engine(params, cfg, num_slots=rows, max_seq_len=128, page_size=P,
                        num_pages=rows * w // P)
    for t in (w, 1000):
        assert eng.rows.allocated_bytes == theory.kv_cache_bytes(cfg, t, batch=rows)
    assert eng.rows.allocated_bytes == cache_lib.cache_bytes(
        cache_lib.cache_spec(cfg, rows, 128)) == cache_lib.cache_bytes(eng.rows.cache)
    full = cfg.replace(kv_compression=None, kv_budget=None)
    plain = engine.Engine(params, full, num_slots=rows, max_seq_len=128, page_size=P,
                          num_pages=rows * 128 // P)
    assert plain.rows.allocated_bytes == theory.kv_cache_bytes(full, 128, batch=rows)
    assert plain.rows.allocated_bytes * w == eng.rows.allocated_bytes * 128


def test_a_method_keeping_every_slot_gives_the_uncompressed_paged_tokens():
    """A budget no prompt exceeds and a ring no answer wraps (64 + 16 slots, at most 70
    tokens written): every token is kept, so the compressed rows give the uncompressed
    paged engine's tokens."""
    cfg = cfg_for("snapkv", budget=64)
    params = model_lib.init_params(cfg, 0)
    reqs = requests(1)
    got, _, _ = serve(params, cfg, reqs, page_size=P, num_pages=20)
    full = cfg.replace(kv_compression=None, kv_budget=None)
    want, _, _ = serve(params, full, reqs, page_size=P, num_pages=32)
    assert got == want


@pytest.mark.parametrize("over, match", [
    ({"compression": dataclasses.replace(KNOBS, schedule="every_n", every_n=2)},
     r"model.compression.schedule='every_n'; allowed: 'prefill' with page_size=8"),
    ({"method": "pyramidkv", "compression": dataclasses.replace(KNOBS, pyramid_beta=4)},
     r"model.kv_compression='pyramidkv'; allowed: a method with one budget in every "
     r"layer .*uniform_layers=True \(per-layer budgets \(36, 12\)"),
    ({"budget": 20}, r"model.kv_budget=20; allowed: .*multiple of page_size=8 "
                     r"\(got 20 \+ 16 = 36"),
])
def test_what_pages_cannot_hold_is_refused_by_name(over, match):
    """Every-N re-scoring, per-layer budgets and a row that is not whole pages are
    refused before any work, naming the value, by the engine and by RunConfig."""
    over = dict(over)
    cfg = cfg_for(over.pop("method", "snapkv"), budget=over.pop("budget", 24),
                  scan_layers=False, **over)
    params = model_lib.init_params(cfg, 0)
    with pytest.raises(ConfigError, match=match):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=128, page_size=P, num_pages=32)
    with pytest.raises(ConfigError, match=match):
        RunConfig(model=cfg, weights="random", max_seq_len=128, page_size=P)
    with pytest.raises(ConfigError, match=match):
        paged.init_paged_cache(cfg, 2, 32, P, 5)


def test_engine_level_refusals_name_the_value():
    cfg = cfg_for()
    params = model_lib.init_params(cfg, 0)
    with pytest.raises(ConfigError, match="prefix_cache=True with model.kv_compression="
                                          "'snapkv'; allowed: prefix_cache=False"):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=128, page_size=P, num_pages=32,
                      prefix_cache=True)
    with pytest.raises(ConfigError, match="model.kv_compression='snapkv' with speculative "
                                          "decoding; allowed: the engine without"):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=128, page_size=P, num_pages=32,
                      speculative=SpeculativeConfig(drafter="ngram", k=2))
    with pytest.raises(ValueError, match=r"num_pages=4 .*too few for one compressed row "
                                         r"of 40 slots; allowed: num_pages >= 5"):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=128, page_size=P, num_pages=4)
    with pytest.raises(ValueError, match="max_pages=16 with model.kv_compression='snapkv'"
                                         "; allowed: 5"):
        paged.init_paged_cache(cfg, 2, 32, P, 16)
    RunConfig(model=cfg, weights="random", max_seq_len=128, page_size=P)  # accepted
    # drafter 'none' (what experiments.serve passes) is plain decoding, not refused
    engine.Engine(params, cfg, num_slots=2, max_seq_len=128, page_size=P, num_pages=32,
                  speculative=SpeculativeConfig())


NATIVE_PLAN = Plan(native=("decode_attention",))


def test_the_registry_reads_a_compressed_paged_row_as_a_ring():
    """The decode site of a compressed paged row is a ring over pages (its visible slots
    are no prefix, no page selection): Pallas's prefix kernel is refused there, so the
    GPU planner takes 'xla'; on the CPU the native kernel (masked slots skipped, pages
    in place) runs where asked or planned, else the reference."""
    cfg = cfg_for()
    site = decode_kernels.site(cfg, 2, 1, 40, True, P)
    assert (site.op, site.slot_kind, site.paged, site.selects_pages) == \
        ("decode_attention", "ring", True, False)
    from kvjax import planner
    gpu = dict(backend="gpu", head_dim=16, key_layout="BKSH", value_layout="BKSH")
    pallas = kernels.get("decode_attention", "pallas")
    assert pallas.applies(decode_kernels.site(cfg.replace(**gpu), 2, 1, 64, True, P)) == \
        "visible slots a prefix (a ring cache)"
    assert planner._decode_pick(cfg.replace(**gpu), 2, 64, False, P) == "xla"
    full = cfg.replace(kv_compression=None, kv_budget=None, **gpu)  # the control
    assert planner._decode_pick(full, 2, 64, False, P) == "pallas"
    planned = cfg.replace(decode_attention="native", plan=NATIVE_PLAN)
    assert planned.formulation(decode_kernels.site(planned, 2, 1, 40, True, P)) == "native"
    assert cfg.replace(decode_attention="auto").formulation(site) == "xla"
    assert kernels.forced("decode_attention", "auto", site) is None


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_the_native_kernel_reads_compressed_pages_in_place():
    """The native kernel over the pools (the ring's masked slots skipped) gives the dense
    reference's tokens."""
    ref = cfg_for("tova", decode_attention="xla")
    params = model_lib.init_params(ref, 0)
    reqs = requests(2)
    want, _, _ = serve(params, ref, reqs)
    cfg = cfg_for("tova", decode_attention="native", plan=NATIVE_PLAN)
    got, _, _ = serve(params, cfg, reqs, page_size=P, num_pages=10)
    assert got == want
