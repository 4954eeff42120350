"""The native CPU prompt attention (kvjax/native/prefill_attention.cc via jax.ffi): equal
to the float64 reference attention of tests/test_flash.py for MHA/GQA/MQA, both cache
layouts, windows with sinks and chunks longer than W, old (ring) slots, padded rows, T = 1
and T = max_seq_len; inside the model equal to the dense path, chunked = one-shot with the
same cache; the fallback to the XLA tiled path; bad input.

Shapes cross the kernel's 64-slot key blocks and 64-row query tiles (T = 70, 130, 200),
and H = 64 (its register-tiled value path) as well as H = 8 (the generic one).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.analysis import costs, theory
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import decode
from kvjax.models import flash
from kvjax.native import prefill as native_prefill
from tests.conftest import import_entry_point
from tests.test_flash import (CASES, logits_by_chunks, params_of, positions, random_qkv,
                              ref_attention, ref_mask)

ATOL = 2e-6
pytestmark = pytest.mark.skipif(not native_prefill.load(),
                                reason="the native library cannot be built here")
VARIANTS = {"mha": (4, 1), "gqa": (3, 3), "mqa": (1, 4)}  # (K, G)


def swap(layout):
    return (lambda x: jnp.swapaxes(x, -1, -2)) if layout == "BKHS" else (lambda x: x)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("t,h", [(1, 64), (70, 64), (200, 64), (130, 8)])
@pytest.mark.parametrize("k_layout,v_layout", [("BKHS", "BKSH"), ("BKSH", "BKHS")])
def test_chunk_equals_reference(variant, t, h, k_layout, v_layout):
    """T = 1, T not a multiple of the 64-slot block, several query tiles per head."""
    k, g = VARIANTS[variant]
    q, kk, vv, _, _ = random_qkv(2, t, k, g, h, seed=t + h)
    pos = positions(5, t, 2)
    got = native_prefill.attend_chunk(q, swap(k_layout)(kk), swap(v_layout)(vv), pos,
                                      k_layout=k_layout, v_layout=v_layout)
    want = ref_attention(q, kk, vv, ref_mask(pos, pos))
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window,sinks", [(40, 0), (40, 3), (100, 1), (7, 2)])
def test_window_with_sinks_chunk_longer_than_window(window, sinks):
    """T = 200 > W: whole key blocks fall outside the window and are skipped, except
    those that may hold a sink; sinks at chunk indices 0..s-1 (start 0) or none."""
    t = 200
    q, kk, vv, _, _ = random_qkv(1, t, 2, 2, 64, seed=window + sinks)
    for start in (0, 1, 70):
        pos = positions(start, t)
        got = native_prefill.attend_chunk(q, kk, vv, pos, window_size=window,
                                          num_sink_tokens=sinks)
        want = ref_attention(q, kk, vv, ref_mask(pos, pos, window, sinks))
        np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("layout", ["BKSH", "BKHS"])
@pytest.mark.parametrize("window,sinks", [(None, 0), (90, 0), (90, 3)])
def test_old_slots_unsorted_ring_empty_and_padded_rows(layout, window, sinks):
    """Old slots with shuffled positions (a wrapped ring) and empty slots (-1), per-row
    positions, S not a multiple of the block; row 1's last queries are padding
    (position -1): they get zeros, the others are unaffected."""
    b, t, s = 2, 75, 150
    q, kk, vv, ko, vo = random_qkv(b, t, 2, 2, 64, s_old=s, seed=3)
    start = 200
    rng = np.random.default_rng(0)
    rows = []
    for r in range(b):   # row r holds positions start-120+r .. start-1, the rest empty
        p = np.r_[np.arange(start - 120 + r, start), -np.ones(s - 120 + r)].astype(np.int32)
        rows.append(rng.permutation(p))
    old_pos = jnp.asarray(np.stack(rows))
    pos = np.array(positions(start, t, b))
    pos[1, 60:] = -1
    pos = jnp.asarray(pos)
    to = swap(layout)
    got = native_prefill.attend_chunk(q, to(kk), to(vv), pos, k_old=to(ko), v_old=to(vo),
                                      old_positions=old_pos, k_layout=layout,
                                      v_layout=layout, window_size=window,
                                      num_sink_tokens=sinks)
    mask = np.concatenate([ref_mask(pos, old_pos, window, sinks),
                           ref_mask(pos, pos, window, sinks)], axis=2)
    want = ref_attention(q, jnp.concatenate([ko, kk], 2), jnp.concatenate([vo, vv], 2),
                         mask)
    assert np.abs(want[1, 60:]).max() == 0 and np.abs(want[0]).max() > 0.1
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def test_fully_masked_blocks_give_no_nan():
    """A cache of only empty slots holding huge keys, and blocks whose min/max positions
    cannot rule them out (a stale key outside the window beside a future one), visited
    before any visible key: finite output equal to the reference."""
    t, s = 6, 130
    q, kk, vv, ko, vo = random_qkv(1, t, 1, 2, 64, s_old=s, seed=9)
    pos = positions(300, t)
    empty = jnp.full((s,), -1, jnp.int32)
    got = native_prefill.attend_chunk(q, kk, vv, pos, k_old=ko + 1e4, v_old=vo,
                                      old_positions=empty)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), ref_attention(q, kk, vv, ref_mask(pos, pos)),
                               atol=ATOL, rtol=0)
    old_pos = jnp.asarray(np.where(np.arange(s) % 2, 400 + np.arange(s), np.arange(s)),
                          jnp.int32)
    got = native_prefill.attend_chunk(q, kk, vv, pos, k_old=ko * 100, v_old=vo,
                                      old_positions=old_pos, window_size=3)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got),
                               ref_attention(q, kk, vv, ref_mask(pos, pos, window=3)),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["mha", "gqa", "mqa", "gqa-BKSH", "window-sinks"])
def test_model_native_equals_dense_and_writes_the_same_cache(name):
    """Whole prompt (T = max_seq_len = 16) in a fresh one-pass prefill, and a chunk of 5
    over the filled cache (old slots; the window wraps): native logits and cache = the
    dense path's."""
    scan = name == "gqa"
    native = planner.resolve(ModelConfig(**CASES[name], scan_layers=scan,
                                         prefill_impl="native"),
                             max_seq_len=16, batch_sizes=(2,), rows=(32, 22, 10))
    dense = native.replace(prefill_impl="dense")
    assert flash.prefill_path(native) == "native"
    params = params_of(name, scan)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 97)
    want, want_cache = logits_by_chunks(dense, params, tokens, [16], 16)
    for chunks, fresh in (([16], True), ([11, 5], False)):
        got, c = logits_by_chunks(native, params, tokens, chunks, 16, fresh_first=fresh)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
        for a, b in zip(jax.tree.leaves(c), jax.tree.leaves(want_cache)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["window-sinks"])
def test_chunked_prefill_equals_one_shot(name):
    cfg = planner.resolve(ModelConfig(**CASES[name], scan_layers=False,
                                      prefill_impl="native"), max_seq_len=20)
    assert flash.prefill_path(cfg) == "native"
    params = params_of(name, False)
    tokens = jax.random.randint(jax.random.key(2), (1, 15), 0, 97)
    one_logits, one = decode.prefill(params, cfg, tokens, cache_lib.init_cache(cfg, 1, 20))
    got_logits, got = decode.prefill_chunked(params, cfg, tokens,
                                             cache_lib.init_cache(cfg, 1, 20), 4)
    tiled_logits, _ = decode.prefill(params, cfg.replace(prefill_impl="tiled"), tokens,
                                     cache_lib.init_cache(cfg, 1, 20))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(one_logits), atol=1e-5,
                               rtol=0)
    np.testing.assert_allclose(np.asarray(one_logits), np.asarray(tiled_logits), atol=1e-5,
                               rtol=0)
    np.testing.assert_array_equal(np.asarray(got.positions), np.asarray(one.positions))
    for a, b in zip(jax.tree.leaves(got.tensors), jax.tree.leaves(one.tensors)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)


def test_paths_mla_auto_and_the_fallback_warns_once(monkeypatch):
    """MLA and sinks at cache positions have no native path; 'auto' picks native where
    it builds; a failed build gives one warning (when the plan is resolved) and the
    tiled path, same logits; 'native' without a plan is refused, naming resolve."""
    mla = ModelConfig(**CASES["mla-absorbed"], prefill_impl="native")
    assert flash.prefill_path(mla) == "tiled"
    gqa = ModelConfig(**CASES["gqa"], scan_layers=False, prefill_impl="native")
    sinks = gqa.replace(window_size=8, num_sink_tokens=2, rope_positions="cache")
    assert flash.prefill_path(sinks) == "dense"
    assert flash.prefill_path(planner.resolve(gqa.replace(prefill_impl="auto"),
                                              max_seq_len=12)) == "native"
    assert flash.prefill_path(gqa.replace(prefill_impl="auto")) == "tiled"  # no plan
    with pytest.raises(ValueError, match="planner.resolve"):
        flash.prefill_path(gqa)
    params = params_of("gqa", False)
    tokens = jax.random.randint(jax.random.key(3), (1, 9), 0, 97)
    want, _ = decode.prefill(params, gqa.replace(prefill_impl="tiled"), tokens,
                             cache_lib.init_cache(gqa, 1, 12))

    def broken():
        raise RuntimeError("g++ failed: test")

    monkeypatch.setattr(native_prefill, "_state", {})
    monkeypatch.setattr(native_prefill, "library_path", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = planner.resolve(gqa.replace(name="fallback"), max_seq_len=12)
        assert planner.resolve(gqa, max_seq_len=12).plan.native == ()
        assert flash.prefill_path(fallback) == "tiled"
        got, _ = decode.prefill(params, fallback, tokens, cache_lib.init_cache(gqa, 1, 12))
    msgs = [str(w.message) for w in caught if "native prefill" in str(w.message)]
    assert len(msgs) == 1 and "g++ failed: test" in msgs[0], msgs
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_bad_input_and_config_raise_naming_the_value():
    q, kk, vv, _, _ = random_qkv(1, 4, 1, 2, 8)
    pos = positions(0, 4)
    with pytest.raises(ValueError, match="k_layout='BSKH'"):
        native_prefill.attend_chunk(q, kk, vv, pos, k_layout="BSKH")
    with pytest.raises(ValueError, match="num_sink_tokens=2"):
        native_prefill.attend_chunk(q, kk, vv, pos, num_sink_tokens=2)
    with pytest.raises(ValueError, match="window_size=0"):
        native_prefill.attend_chunk(q, kk, vv, pos, window_size=0)
    with pytest.raises(ValueError, match="give all three or none"):
        native_prefill.attend_chunk(q, kk, vv, pos, k_old=kk)
    with pytest.raises(ConfigError, match="prefill_impl.*'native'.*backend 'gpu'"):
        ModelConfig(**CASES["gqa"], prefill_impl="native", backend="gpu")
    with pytest.raises(ConfigError, match=r"'flash'; allowed: one of \['auto', 'tiled', "
                                          r"'dense', 'native', 'cudnn'\]"):
        ModelConfig(**CASES["gqa"], prefill_impl="flash")


@pytest.mark.parametrize("window", [None, 6])
def test_attention_flops_theory_is_the_sum_of_step_attention(window):
    """theory.prefill_attention_flops = the decode steps' attention FLOP summed over the
    prompt's positions (position p reads min(p, W) keys)."""
    cfg = ModelConfig(**CASES["gqa"], window_size=window)
    t = 20
    want = sum(theory.step_flops(cfg, p).attn for p in range(1, t + 1))
    assert theory.prefill_attention_flops(cfg, t) == want > 0


def test_prefill_cost_counts_the_custom_call():
    """XLA cannot cost the kernel: the analysis marks it incomplete and records the
    custom call's operand + result bytes (from its shapes, every layer) and its causal
    FLOP by theory; prefill_with_kernel adds them to XLA's figures."""
    t, s, b = 12, 16, 1
    cfg = planner.resolve(ModelConfig(**CASES["gqa"], scan_layers=False,
                                      prefill_impl="native"),
                          max_seq_len=s, batch_sizes=(b,), rows=(b * t,))
    assert flash.prefill_path(cfg) == "native"
    step = costs.analyze_prefill(cfg, t, s, b)
    cc = step.theory_parts["custom_call"]
    assert cc["targets"] == [native_prefill.TARGET] and not step.xla.complete
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    per_layer = 4 * (b * t * n * h * 2          # q in, o out
                     + 2 * b * k * t * h        # the chunk's keys and values
                     + b * t                    # q positions
                     + 2 * b * k * 1 * h + b)   # the empty cache's dummy slot
    assert cc["operand_result_bytes"] == cfg.num_layers * per_layer
    assert cc["flops_theory"] == theory.prefill_attention_flops(cfg, t, b)
    flops, nbytes = costs.prefill_with_kernel(step)
    assert flops == step.xla.flops + cc["flops_theory"]
    assert nbytes == step.xla.bytes + cc["operand_result_bytes"]
    parts = step.theory_parts["bytes"]
    assert parts["attn_io"] == parts["attn_io_native"] < parts["attn_io_standard"]
    tiled = costs.analyze_prefill(cfg.replace(prefill_impl="tiled"), t, s, b)
    assert "custom_call" not in tiled.theory_parts and tiled.xla.complete
    assert costs.prefill_with_kernel(tiled) == (tiled.xla.flops, tiled.xla.bytes)


# ------------------------------------------------- prefill_impl='cudnn' (GPU), on CPU


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("layouts", [("BKSH", "BKSH"), ("BKHS", "BKSH")])
def test_sdpa_path_with_xla_equals_reference(window, layouts):
    """The cudnn path's code with implementation='xla': the reference attention for GQA,
    a window, and a right-padded row (zeros)."""
    k_layout, v_layout = layouts
    t = 13
    q, kk, vv, _, _ = random_qkv(2, t, 2, 3, 8, seed=4)
    pos = np.array(positions(0, t, 2))
    pos[1, 9:] = -1
    pos = jnp.asarray(pos)
    got = flash.attend_chunk_sdpa(q, swap(k_layout)(kk), swap(v_layout)(vv), pos,
                                  k_layout=k_layout, v_layout=v_layout, window_size=window,
                                  implementation="xla")
    want = ref_attention(q, kk, vv, ref_mask(pos, pos, window))
    assert np.abs(want[0]).max() > 0.1 and np.abs(want[1, 9:]).max() == 0
    np.testing.assert_allclose(np.asarray(got), want, atol=ATOL, rtol=0)


def test_cudnn_on_cpu_raises_naming_the_backend():
    q, kk, vv, _, _ = random_qkv(1, 4, 1, 2, 8)
    with pytest.raises(ValueError, match="implementation='cudnn'.*backend 'cpu'.*'gpu'"):
        flash.attend_chunk_sdpa(q, kk, vv, positions(0, 4))
    with pytest.raises(ValueError, match="implementation='pallas'"):
        flash.attend_chunk_sdpa(q, kk, vv, positions(0, 4), implementation="pallas")
    with pytest.raises(ConfigError, match="prefill_impl.*'cudnn'.*backend 'cpu'"):
        ModelConfig(**CASES["gqa"], prefill_impl="cudnn", backend="cpu")
    with pytest.raises(ConfigError, match="dtype 'float32'"):
        ModelConfig(**CASES["gqa"], prefill_impl="cudnn", backend="gpu")
    gpu = ModelConfig(**{**CASES["gqa"], "dtype": "bfloat16"}, prefill_impl="cudnn",
                      backend="gpu")
    assert flash.prefill_path(gpu) == "cudnn"
    assert flash.prefill_path(gpu.replace(window_size=6, num_sink_tokens=2)) == "tiled"


def test_prefill_sweep_rows_and_interleaved_timing():
    """experiments.prefill's functions on a tiny model: the native row adds the custom
    call to XLA's figures, the tiled row has none; one timed round per path."""
    prefill = import_entry_point("prefill")
    native = planner.resolve(ModelConfig(**CASES["gqa"], scan_layers=False,
                                         prefill_impl="native"),
                             max_seq_len=24, batch_sizes=(1,), rows=(20,))
    tiled = native.replace(prefill_impl="tiled")
    rn, rt = prefill.point(native, 20, 24), prefill.point(tiled, 20, 24)
    cc = rn["custom_call"]
    assert rn["path"] == "native" and rt["path"] == "tiled" and rt["custom_call"] is None
    assert rn["xla_kernel_flops"] == rn["xla_flops"] + cc["flops_theory"] > rn["xla_flops"]
    assert rn["xla_kernel_bytes"] == rn["xla_bytes"] + cc["operand_result_bytes"]
    assert rt["xla_kernel_bytes"] == rt["xla_bytes"]
    assert rn["flops_ratio_kernel"] == pytest.approx(rn["xla_kernel_flops"] /
                                                     rn["theory_flops"])
    times = prefill.time_interleaved([native, tiled], 20, 24, repeats=1)
    assert sorted(times) == ["native", "tiled"]
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    assert "native" in prefill.table([rn, rt])
