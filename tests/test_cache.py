"""The cache contract (docs/DESIGN.md): slot policies, per-row bookkeeping, the cache's own
element type (kv_dtype), backend choices made once, and variants built from presets."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import backend as backend_lib
from kvjax import cache as cache_lib
from kvjax import presets
from kvjax.cache import policy as policy_lib
from kvjax.config import ConfigError, ModelConfig, run_config_from_dict
from kvjax.inference import decode
from kvjax.models import model
from tests.conftest import tiny_config


def tiny(**kw) -> ModelConfig:
    return tiny_config(**{**dict(vocab_size=61, tie_embeddings=False, scan_layers=False,
                                 name="tiny"), **kw})


# ------------------------------------------------------------------ slot policies


def test_policy_for_picks_the_cache_kind():
    assert isinstance(cache_lib.policy_for(tiny()), policy_lib.DenseSlots)
    ring = cache_lib.policy_for(tiny(window_size=6, num_sink_tokens=2))
    assert ring == policy_lib.RingSlots(6, 2)
    assert ring.num_slots(10**6) == 6 and policy_lib.DenseSlots().num_slots(100) == 100


def test_dense_policy_drops_writes_past_the_end_and_names_the_row():
    dense = policy_lib.DenseSlots()
    assert dense.write_slots(jnp.array([[2, 3, 4]]), 4).tolist() == [[2, 3, 4]]
    assert dense.overflows(jnp.array([1, 3]), 2, 4).tolist() == [False, True]
    with pytest.raises(policy_lib.CacheOverflowError, match=r"\(row 1\).*at most 1 more"):
        dense.check_room([1, 3], 2, 4, "prefill")
    dense.check_room([1, 2], 2, 4, "prefill")  # fits


def test_ring_policy_slots_masks_and_buffer():
    ring = policy_lib.RingSlots(4, 1)
    # sinks keep slot p; the rest cycle through slots 1..3
    assert ring.slot_of(jnp.arange(8), 4).tolist() == [0, 1, 2, 3, 1, 2, 3, 1]
    # per-row chunks: only the last W - s ring tokens of each row survive
    got = ring.write_slots(jnp.array([[0, 1, 2, 3, 4, 5], [4, 5, 6, 7, 8, 9]]), 4)
    assert got.tolist() == [[0, 4, 4, 3, 1, 2], [4, 4, 4, 1, 2, 3]]
    assert not ring.overflows(jnp.array([10**6]), 5, 4).any()
    assert ring.buffer_len(4, 100) == 128 and policy_lib.DenseSlots().buffer_len(4, 100) == 4
    vis = ring.visible(jnp.array([[5]]), jnp.array([[0, 5, 2, 4]]))
    assert vis[0, 0].tolist() == [True, True, False, True]  # sink, self, too old, recent


# ------------------------------------------------------------------ per-row bookkeeping


def _prefill_one(params, cfg, tokens, max_seq_len):
    cache = cache_lib.init_cache(cfg, 1, max_seq_len, ragged=True)
    return decode.prefill(params, cfg, jnp.asarray([tokens], jnp.int32), cache)


@pytest.mark.parametrize("window", [None, 5], ids=["dense", "ring"])
def test_rows_of_different_lengths_decode_as_if_alone(window):
    """Two rows with their own lengths (3 and 7 tokens) in one batch: one decode step gives
    each row the logits it gets alone (per-row positions, masks and write offsets)."""
    cfg = tiny(window_size=window)
    params = model.params_for(cfg, model.init_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (3, 7)]
    alone, caches = [], []
    for p in prompts:
        _, c = _prefill_one(params, cfg, p, 12)
        caches.append(c)
        logits, _ = decode.decode_step(params, jnp.asarray([[p[-1]]], jnp.int32),
                                       jax.tree.map(jnp.copy, c), cfg=cfg)
        alone.append(np.asarray(logits[0]))
    # stack the two single-row caches into one batch of 2 (axis 0 is B for every leaf
    # of an unrolled cache: tensors [B, K, ., .], positions [B, S], length [B])
    both = cache_lib.KVCache(
        tensors={n: tuple(jnp.concatenate([a, b]) for a, b in zip(caches[0].tensors[n],
                                                                   caches[1].tensors[n]))
                 for n in caches[0].tensors},
        positions=jnp.concatenate([caches[0].positions, caches[1].positions]),
        length=jnp.concatenate([caches[0].length, caches[1].length]),
        layouts=caches[0].layouts, ragged=True)
    assert both.length.tolist() == [3, 7]
    tokens = jnp.asarray([[prompts[0][-1]], [prompts[1][-1]]], jnp.int32)
    logits, after = decode.decode_step(params, tokens, both, cfg=cfg)
    np.testing.assert_allclose(logits[0], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits[1], alone[1], atol=1e-5, rtol=0)
    assert after.length.tolist() == [4, 8]
    held = np.asarray(after.positions)
    assert 3 in held[0] and 7 in held[1] and 7 not in held[0]


def test_lockstep_cache_refuses_rows_at_different_positions():
    """A lockstep cache (the default) writes every row at row 0's positions: rows given
    different positions are refused, naming the row; a ragged cache takes them."""
    cfg = tiny()
    params = model.params_for(cfg, model.init_params(cfg, 0))
    cache = cache_lib.init_cache(cfg, 2, 8).replace(length=jnp.array([0, 2], jnp.int32))
    pos = jnp.array([[0, 1], [2, 3]], jnp.int32)
    with pytest.raises(ValueError, match=r"row 1 .*differ from row 0.*ragged=True"):
        model.forward(params, cfg, jnp.zeros((2, 2), jnp.int32), pos, cache)
    ragged = cache_lib.init_cache(cfg, 2, 8, ragged=True).replace(
        length=jnp.array([0, 2], jnp.int32))
    _, out = model.forward(params, cfg, jnp.zeros((2, 2), jnp.int32), pos, ragged)
    assert out.length.tolist() == [2, 4]
    assert out.positions[1, 2:4].tolist() == [2, 3] and out.positions[0, :2].tolist() == [0, 1]


def test_forward_refuses_positions_that_do_not_continue_a_row():
    """A batch of 2 whose second row is given positions its cache does not hold: a clear
    error naming the row, before anything runs."""
    cfg = tiny()
    params = model.params_for(cfg, model.init_params(cfg, 0))
    cache = cache_lib.init_cache(cfg, 2, 8)
    tokens = jnp.zeros((2, 3), jnp.int32)
    good = jnp.array([[0, 1, 2], [0, 1, 2]], jnp.int32)
    _, cache = model.forward(params, cfg, tokens, good, cache)
    with pytest.raises(ValueError, match=r"row 1 .* holds 3 tokens"):
        model.forward(params, cfg, tokens, jnp.array([[3, 4, 5], [5, 6, 7]]), cache)


# ------------------------------------------------------------------ kv_dtype


def test_kv_dtype_is_the_cache_element_type_after_prefill_and_steps():
    cfg = tiny(kv_dtype="bfloat16")
    assert cfg.dtype == "float32" and cfg.cache_dtype == jnp.bfloat16
    params = model.params_for(cfg, model.init_params(cfg, 0))
    ref_cfg = tiny()
    cache = cache_lib.init_cache(cfg, 1, 16)
    assert all(t.dtype == jnp.bfloat16 for t in jax.tree.leaves(cache.tensors))
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    toks, _, cache = decode.generate(params, cfg, jnp.argmax(logits, -1), cache, 6)
    assert all(t.dtype == jnp.bfloat16 for t in jax.tree.leaves(cache.tensors))
    assert cache_lib.cache_bytes(cache) == cache_lib.cache_bytes(
        cache_lib.init_cache(ref_cfg, 1, 16)) // 2
    # the float32 model with a bf16 cache stays close to the all-float32 one
    ref_logits, _ = decode.prefill(params, ref_cfg, tokens, cache_lib.init_cache(ref_cfg, 1, 16))
    np.testing.assert_allclose(logits, ref_logits, atol=0.05)
    assert not np.allclose(logits, ref_logits, atol=1e-7)  # the cache really is rounded


def test_no_float_is_ever_cast_into_an_integer_cache():
    with pytest.raises(ConfigError, match="model.kv_dtype='int16'"):
        tiny(kv_dtype="int16")
    # encode, the one way into a cache, refuses a non-float representation outright
    int8_cache = types.SimpleNamespace(cache_dtype=jnp.int8)
    with pytest.raises(TypeError, match="int8 has no float representation"):
        cache_lib.encode(int8_cache, {"k": jnp.ones((1, 2, 1, 8))})


def test_tensor_specs_come_from_the_config():
    specs = cache_lib.tensor_specs(tiny(key_layout="BKHS", kv_dtype="float16"), 3, 10)
    assert specs["k"].shape == (3, 2, 8, 10) and specs["k"].slot_axis == -1
    assert specs["v"].shape == (3, 2, 10, 8) and specs["v"].dtype == jnp.float16
    mla = presets.blog_mla(num_layers=1, dtype="float32")
    specs = cache_lib.tensor_specs(mla, 2, 5)
    assert {n: s.shape for n, s in specs.items()} == {"c_kv": (2, 5, 512), "k_rope": (2, 5, 64)}


# ------------------------------------------------------------------ backend and presets


def test_backend_choices_are_the_configs_not_the_machines():
    gpu = tiny(backend="gpu", num_kv_heads=4, scan_layers=None)
    assert gpu.cache_layout("k") == gpu.cache_layout("v") == "BKSH" and gpu.scan_layers
    cpu = tiny(backend="cpu", num_kv_heads=4, scan_layers=None)
    assert (cpu.cache_layout("k"), cpu.cache_layout("v")) == ("BKHS", "BKHS")
    assert not cpu.scan_layers
    assert tiny().backend == backend_lib.current()
    with pytest.raises(ConfigError, match="model.backend='npu'"):
        tiny(backend="npu")


def test_backend_from_the_command_line():
    from configs import gqa
    c = gqa.get_config()
    c.backend = "gpu"
    run = run_config_from_dict(c)
    assert run.model.backend == "gpu" and run.model.scan_layers
    assert run.model.cache_layout("k") == "BKSH"


def test_variant_pulls_each_lever_and_configs_build_from_presets():
    from configs import blog_window, mha, mqa
    base = presets.smollm2_135m(dtype="float32")
    v = presets.variant(base, num_kv_heads=1, window_size=128, num_sink_tokens=4)
    assert (v.attention, v.num_kv_heads, v.window_size, v.num_sink_tokens) == ("mqa", 1, 128, 4)
    assert v.name == "smollm2-135m-mqa-window128-4sinks"
    assert presets.variant(base, num_kv_heads=9).attention == "mha"
    mla = presets.variant(presets.blog_model(), kv_lora_rank=256)
    assert (mla.attention, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.head_dim) == (
        "mla", 256, 64, 128)
    assert presets.variant(base, kv_dtype="bfloat16").kv_dtype == "bfloat16"
    assert mha.get_config().model.num_kv_heads == 9
    assert mqa.get_config().model.attention == "mqa"
    bw = blog_window.get_config().model
    assert (bw.num_kv_heads, bw.window_size, bw.d_model) == (2, 512, 512)


def _slot_values(cfg, cache, row, slot):
    """Every layer's cached values of one row's slot, as float32 arrays."""
    out = []
    for name, t in sorted(cache.tensors.items()):
        for layer in (t if isinstance(t, tuple) else list(t)):
            x = np.asarray(layer[row]).astype(np.float32)
            out.append(np.take(x, slot, axis=cache_lib.slot_axis(cfg, name)))
    return out


@pytest.mark.parametrize("source,view", [
    (dict(), dict(window_size=8, num_sink_tokens=2)),                 # dense -> ring
    (dict(kv_dtype="int8"), dict(window_size=6, num_sink_tokens=1)),  # scales too
    (dict(window_size=12, num_sink_tokens=3),                         # ring -> ring
     dict(window_size=8, num_sink_tokens=3)),
    (dict(scan_layers=False), dict(window_size=5, num_sink_tokens=0, num_layers=1)),
    (dict(key_layout="BKSH"), dict(window_size=7, num_sink_tokens=2, key_layout="BKHS")),
    ("mla", dict(window_size=6, num_sink_tokens=2)),
    (dict(), dict(window_size=40, num_sink_tokens=2)),  # wider than the 30-slot rows
])
def test_window_view_holds_each_rows_sinks_and_last_positions(source, view):
    """cache.window_view: each view slot j holds the newest position p < length with the
    ring's slot_of(p) == j (p = j for a sink) that the source cache still holds, with the
    source's values there; nothing else is visible. Ragged rows, full rows and rows
    whose ring's second slab would pass the row's end; an empty cache shows nothing."""
    from tests.conftest import tiny_mla_config  # noqa: PLC0415
    cfg = tiny_mla_config() if source == "mla" else tiny_config(**source)
    vcfg = cfg.replace(**view)
    params = model.init_params(cfg, 0)
    lengths = [23, 4, 1, 9, 30, 28]  # the last two end within a ring of the row's end
    cache = cache_lib.init_cache(cfg, 6, 30, ragged=True)
    toks = np.zeros((6, 30), np.int32)
    for b, n in enumerate(lengths):
        toks[b, :n] = np.arange(1, n + 1) * (b + 3) % 97
    from kvjax.inference import ragged  # noqa: PLC0415
    _, cache = ragged.prefill_ragged(params, cfg, toks, np.asarray(lengths, np.int32), cache)
    slots = vcfg.window_size + 3
    empty = cache_lib.window_view(cache_lib.init_cache(cfg, 2, 30), cfg, vcfg, slots)
    assert np.all(np.asarray(empty.positions) == -1)
    got = cache_lib.window_view(cache, cfg, vcfg, slots)
    assert got.num_slots == slots and got.ragged
    assert got.layouts == cache_lib.layouts(vcfg)
    np.testing.assert_array_equal(np.asarray(got.length), lengths)
    ring_pol = cache_lib.policy_for(vcfg)
    s, ring = vcfg.num_sink_tokens, slots - vcfg.num_sink_tokens
    src_pos = np.asarray(cache.positions)
    for b, n in enumerate(lengths):
        held = set(int(p) for p in src_pos[b] if p >= 0)
        want = {p for p in range(n) if p in held and (p < s or p >= max(s, n - ring))}
        pos = np.asarray(got.positions[b])
        assert set(int(p) for p in pos if p >= 0) == want, b
        for j, p in enumerate(pos):
            if p < 0:
                continue
            assert int(ring_pol.slot_of(jnp.int32(p), slots)) == j
            src = int(np.nonzero(src_pos[b] == p)[0][0])
            mine = _slot_values(vcfg, got, b, j)  # the first L' layers' of each tensor
            theirs = [v for name, t in sorted(cache.tensors.items()) for i, v in enumerate(
                _slot_values(cfg, cache_lib.KVCache({name: t}, cache.positions, cache.length),
                             b, src)) if i < vcfg.num_layers]
            assert len(mine) == len(theirs)
            for x, y in zip(mine, theirs):
                np.testing.assert_array_equal(x, y)


def test_window_view_refuses_what_it_cannot_copy():
    cfg = tiny_config()
    cache = cache_lib.init_cache(cfg, 1, 16, ragged=True)
    with pytest.raises(ValueError, match="window_size=None"):
        cache_lib.window_view(cache, cfg, cfg, 8)
    with pytest.raises(ValueError, match="kv_dtype='int8'"):
        cache_lib.window_view(cache, cfg, cfg.replace(window_size=4, kv_dtype="int8"), 8)
    with pytest.raises(ValueError, match="num_layers=3"):
        cache_lib.window_view(cache, cfg, cfg.replace(window_size=4, num_layers=3), 8)
    with pytest.raises(ValueError, match="num_slots_=2; allowed: more than the 2 sinks"):
        cache_lib.window_view(cache, cfg, cfg.replace(window_size=4, num_sink_tokens=2), 2)
