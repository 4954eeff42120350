"""Lever 5, fewer tokens by score (kvjax.compression, kvjax.cache.compress): the methods
against numpy references, StreamingLLM against the ring cache, keep-all against the full
cache, allocated bytes against theory, row independence, refusals, and a toy method
added through the registry alone."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import compression
from kvjax.analysis import costs, theory
from kvjax.cache import compress as compress_lib
from kvjax.cache import kv as cache_lib
from kvjax.config import ConfigError, RunConfig
from kvjax.inference import decode, ragged
from kvjax.models import model as model_lib
from tests.conftest import tiny_config

KNOBS = compression.CompressionConfig(observation_window=8, recent_slots=16,
                                      num_sink_tokens=4, pooling_kernel=3, pyramid_beta=4)
"""pyramid_beta=4: PyramidKV's two tiny layers at budget 24 keep 36 and 12 slots."""


def cfg_for(method, budget=24, **overrides):
    if compression.get(method).layer_budgets is not None:  # each layer its own slots
        overrides.setdefault("scan_layers", False)
    overrides.setdefault("compression", KNOBS)
    return tiny_config(tie_embeddings=False, kv_compression=method, kv_budget=budget,
                       **overrides)


def prompt(b=1, t=60, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, 97, (b, t)), jnp.int32)


def decode_tokens(params, cfg, tokens, steps=8, max_seq_len=128):
    cache = cache_lib.init_cache(cfg, tokens.shape[0], max_seq_len)
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    out, _, _ = decode.generate(params, cfg, first, cache, steps)
    return np.concatenate([np.asarray(first)[:, None], np.asarray(out)], axis=1)


# ------------------------------------------------------------------ numpy references


def np_window_attention(q, k, qpos, kpos, scale):
    """[B, K, G, S]: softmax over visible slots, summed over the queries (SnapKV's votes)."""
    s = np.einsum("bqkgh,bksh->bkgqs", q, k) * scale
    seen = (kpos[:, None, :] >= 0) & (kpos[:, None, :] <= qpos[:, :, None]) \
        & (qpos[:, :, None] >= 0)
    s = np.where(seen[:, None, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p = p / p.sum(-1, keepdims=True)
    return np.where(seen[:, None, None], p, 0).sum(3)


def np_snapkv(q, k, qpos, kpos, scale, w, kernel):
    votes = np_window_attention(q, k, qpos, kpos, scale)
    pad = kernel // 2
    padded = np.pad(votes, [(0, 0)] * 3 + [(pad, pad)])
    pooled = np.stack([padded[..., i:i + votes.shape[-1]] for i in range(kernel)]).mean(0)
    score = pooled.mean(2)
    last = kpos.max(-1, keepdims=True)
    recent = (kpos > last - w) & (kpos >= 0)
    return np.where(recent[:, None], compression.KEEP, score)


def np_select(scores, kpos, budget):
    s = np.where(kpos[:, None, :] >= 0, scores, -np.inf)
    idx = np.argsort(-s, axis=-1, kind="stable")[..., :budget]
    return np.sort(idx, axis=-1)


def observation(b=2, t=40, k=2, g=2, h=8, nq=8, seed=0, pad_row=None):
    r = np.random.default_rng(seed)
    keys = r.standard_normal((b, k, t, h)).astype(np.float32)
    q = r.standard_normal((b, nq, k, g, h)).astype(np.float32)
    kpos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    lengths = np.full(b, t)
    if pad_row is not None:  # a shorter row: its last slots empty
        lengths[pad_row] = t - 11
        kpos[pad_row, lengths[pad_row]:] = -1
    qpos = lengths[:, None] - nq + np.arange(nq)[None, :]
    return keys, q, qpos.astype(np.int32), kpos


def obs_of(keys, q, qpos, kpos, budget=16, knobs=KNOBS):
    return compression.Observation(
        keys=jnp.asarray(keys), values=jnp.asarray(keys), queries=jnp.asarray(q),
        query_positions=jnp.asarray(qpos), key_positions=jnp.asarray(kpos),
        scale=keys.shape[-1] ** -0.5, budget=budget, config=knobs)


def test_registry_names_every_method():
    assert set(compression.names()) >= {"snapkv", "h2o", "tova", "key_norm",
                                        "streaming_llm"}
    with pytest.raises(ValueError, match="kv_compression='nope'.*snapkv"):
        compression.get("nope")


@pytest.mark.parametrize("pad_row", [None, 1])
def test_snapkv_score_matches_numpy(pad_row):
    keys, q, qpos, kpos = observation(pad_row=pad_row)
    got = compression.get("snapkv").score(obs_of(keys, q, qpos, kpos))
    want = np_snapkv(q, keys, qpos, kpos, keys.shape[-1] ** -0.5, KNOBS.observation_window,
                     KNOBS.pooling_kernel)
    filled = np.broadcast_to(kpos[:, None] >= 0, want.shape)
    np.testing.assert_allclose(np.asarray(got)[filled], want[filled], rtol=1e-5, atol=1e-6)


def test_h2o_accumulates_every_query_in_blocks():
    """H2O's votes over T queries, computed in blocks with a padded tail, equal the full
    T x S attention's column sums."""
    keys, q, qpos, kpos = observation(t=70, nq=70)
    got = compression.window_attention(obs_of(keys, q, qpos, kpos), block=32)
    want = np_window_attention(q, keys, qpos, kpos, keys.shape[-1] ** -0.5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # every query's weights sum to 1: the votes total the number of queries
    np.testing.assert_allclose(np.asarray(got).sum(-1), 70.0, rtol=1e-5)


def test_key_norm_and_tova_scores():
    keys, q, qpos, kpos = observation(nq=1)
    kn = compression.get("key_norm").score(obs_of(keys, q, qpos, kpos))
    np.testing.assert_allclose(np.asarray(kn), -np.linalg.norm(keys, axis=-1), rtol=1e-6)
    tv = np.asarray(compression.get("tova").score(obs_of(keys, q, qpos, kpos)))
    want = np_window_attention(q, keys, qpos, kpos, keys.shape[-1] ** -0.5).mean((1, 2))
    for head in range(tv.shape[1]):  # one score per layer: every KV head keeps the same
        np.testing.assert_allclose(tv[:, head], want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("pad_row", [None, 0])
def test_per_head_top_k_matches_numpy(pad_row):
    r = np.random.default_rng(3)
    scores = r.standard_normal((2, 3, 40)).astype(np.float32)
    kpos = np.tile(np.arange(40, dtype=np.int32), (2, 1))
    if pad_row is not None:
        kpos[pad_row, 30:] = -1
    got = np.asarray(compress_lib.select(jnp.asarray(scores), jnp.asarray(kpos), 12))
    np.testing.assert_array_equal(got, np_select(scores, kpos, 12))
    assert not (got[0] == got[0, :1]).all()  # the heads keep different slots


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_compress_gathers_each_heads_slots(kv_dtype):
    """The compressed cache's slot j of head h holds the full cache's entry (codes and
    scales as stored) at the j-th slot that head keeps, per key_norm's numpy scores."""
    cfg = cfg_for("key_norm", budget=12, kv_dtype=kv_dtype, num_layers=1)
    params = model_lib.init_params(cfg, 0)
    tokens = prompt(2, 30)
    full = cache_lib.init_cache(compress_lib.prompt_config(cfg), 2, 30)
    _, full = decode.prefill(params, compress_lib.prompt_config(cfg), tokens, full)
    out = compress_lib.compress(cfg, full, None)
    pcfg = compress_lib.prompt_config(cfg)
    k = np.asarray(cache_lib.read(pcfg, full.layer(0), "k"))
    if cache_lib.slot_axis(pcfg, "k") == -1:
        k = np.swapaxes(k, -1, -2)
    idx = np_select(-np.linalg.norm(k, axis=-1), np.asarray(full.positions), 12)
    for name in full.tensors:
        axis = cache_lib.slot_axis(pcfg, name)
        src = np.moveaxis(np.asarray(full.layer(0)[name]), axis, 2)
        dst = np.moveaxis(np.asarray(out.layer(0)[name]), axis, 2)
        want = np.take_along_axis(src, idx[..., None], axis=2)
        np.testing.assert_array_equal(dst[:, :, :12], want)
    assert out.num_slots == 12 + KNOBS.recent_slots
    np.testing.assert_array_equal(np.asarray(out.length), [30, 30])


@pytest.mark.parametrize("method", ["snapkv", "h2o", "tova", "key_norm", "streaming_llm",
                                    "pyramidkv"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_allocated_bytes_equal_theory(method, kv_dtype):
    cfg = cfg_for(method, kv_dtype=kv_dtype)
    params = model_lib.init_params(cfg, 0)
    cache = cache_lib.init_cache(cfg, 2, 128)
    _, cache = decode.prefill(params, cfg, prompt(2, 60), cache)
    budgets = compress_lib.layer_budgets(cfg)
    assert cache.num_slots == min(budgets) + KNOBS.recent_slots
    for name in cache.tensors:  # each layer allocates its own budget and ring, no more
        axis = cache_lib.slot_axis(cfg, name)
        assert [cache.layer(i)[name].shape[axis] for i in range(cfg.num_layers)] == \
            [b + KNOBS.recent_slots for b in budgets]
    for t in (60, 1000):  # the cache holds its budget and ring at any context
        assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, t, 2)
    assert theory.kv_cache_bytes(cfg, 10, 1) == theory.kv_cache_bytes(
        cfg.replace(kv_compression=None, kv_budget=None), 10, 1)
    # the mean budget is kv_budget: the bytes of a uniform cache of the same budget
    assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(
        cfg_for("snapkv", kv_dtype=kv_dtype), 1000, 2)


def test_keep_everything_equals_the_full_cache():
    base = tiny_config(tie_embeddings=False)
    params = model_lib.init_params(base, 0)
    tokens = prompt(1, 20, seed=1)
    want = decode_tokens(params, base, tokens, steps=12)
    for method in filter(compression.evicts, compression.names()):  # quest: test_quest
        budget = 20  # per-layer budgets: the smallest mean whose every layer keeps 20
        while min(compress_lib.layer_budgets(cfg_for(method, budget))) < 20:
            budget += 4
        cfg = cfg_for(method, budget)
        got = decode_tokens(model_lib.params_for(cfg, params), cfg, tokens, steps=12)
        np.testing.assert_array_equal(got, want, err_msg=method)


def test_methods_at_one_budget_share_their_decode_config():
    """decode_config (decision 0047): after a prefill-only compression every evicting
    method at one budget decodes under one config (the sweep compiles its decode programs
    once per budget); a config whose decoding depends on its method (every_n re-scoring,
    per-layer budgets) or that does not evict keeps its own. That the shared config decodes
    each method's cache as its own config does: tests/test_longeval.py's sweep tests
    (tokens and NLL of every point equal the config run alone)."""
    shared = {compress_lib.decode_config(cfg_for(m, 24))
              for m in ("snapkv", "tova", "h2o", "key_norm", "streaming_llm")}
    assert len(shared) == 1
    (one,) = shared
    assert (one.kv_budget, one.compression, one.kv_evicts, one.kv_rescores) == \
        (24, KNOBS, True, False)
    assert compress_lib.decode_config(cfg_for("snapkv", 32)).kv_budget == 32
    for cfg in (cfg_for("pyramidkv", 24),
                cfg_for("h2o", 24, compression=dataclasses.replace(
                    KNOBS, schedule="every_n", every_n=4)),
                tiny_config(), cfg_for("quest", 16)):
        assert compress_lib.decode_config(cfg) is cfg


def test_streaming_llm_equals_the_ring_cache():
    """One layer (its keys depend on the tokens alone): StreamingLLM through the interface
    with a budget of N and s sinks keeps what a ring of W = N + 1 slots with s sinks
    holds after the prompt, so the next step's logits agree; and the kept keys are the
    sinks and the last N - s positions, in order."""
    cfg = cfg_for("streaming_llm", budget=12, num_layers=1)
    ring = tiny_config(tie_embeddings=False, num_layers=1, window_size=13, num_sink_tokens=4)
    params = model_lib.init_params(cfg, 0)
    tokens, nxt = prompt(2, 40), jnp.asarray([[5], [7]], jnp.int32)
    out = {}
    for name, c in (("compressed", cfg), ("ring", ring)):
        cache = cache_lib.init_cache(c, 2, 64)
        _, cache = decode.prefill(params, c, tokens, cache)
        if name == "compressed":  # before the step, which donates the cache
            kept = np.asarray(cache_lib.read(c, cache.layer(0), "k"))
        out[name] = np.asarray(decode.decode_step(params, nxt, cache, cfg=c)[0])
    np.testing.assert_allclose(out["compressed"], out["ring"], rtol=1e-5, atol=1e-5)
    pcfg = compress_lib.prompt_config(cfg)
    full = cache_lib.init_cache(pcfg, 2, 40)
    _, full = decode.prefill(params, pcfg, tokens, full)
    k = np.asarray(cache_lib.read(pcfg, full.layer(0), "k"))
    keep = list(range(4)) + list(range(32, 40))
    s_axis = cache_lib.slot_axis(pcfg, "k")
    np.testing.assert_array_equal(np.take(kept, range(12), axis=s_axis),
                                  np.take(k, keep, axis=s_axis))


@pytest.mark.parametrize("method, mla", [("snapkv", False), ("pyramidkv", False),
                                         ("snapkv", True)])
def test_rows_compress_independently(method, mla):
    """A row's tokens do not depend on its batch-mates: lockstep rows, and ragged rows
    of different lengths (each scored on its own tokens, its own window); MLA's latent
    rows too."""
    cfg = (mla_cfg if mla else cfg_for)(method, budget=16)
    params = model_lib.init_params(cfg, 0)
    tokens = prompt(2, 50, seed=4)
    both = decode_tokens(params, cfg, tokens)
    for b in range(2):
        np.testing.assert_array_equal(both[b], decode_tokens(params, cfg, tokens[b:b + 1])[0])
    lengths = np.array([50, 37])
    cache = cache_lib.init_cache(cfg, 2, 128, ragged=True)
    logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
    for b in range(2):
        alone = cache_lib.init_cache(cfg, 1, 128, ragged=True)
        want, alone = decode.prefill(params, cfg, tokens[b:b + 1, :lengths[b]], alone)
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(want[0]), rtol=1e-5,
                                   atol=1e-5)
        for i in range(cfg.num_layers):  # every layer (PyramidKV: each its own slots)
            for name in cache.tensors:
                np.testing.assert_allclose(np.asarray(cache.layer(i)[name][b]),
                                           np.asarray(alone.layer(i)[name][0]), rtol=1e-5,
                                           atol=1e-6, err_msg=f"row {b} layer {i} {name}")
            np.testing.assert_array_equal(
                np.asarray(cache_lib.layer_positions(cfg, cache, i)[b]),
                np.asarray(cache_lib.layer_positions(cfg, alone, i)[0]))


def test_scanned_layers_compress_as_unrolled():
    cfg = cfg_for("h2o")
    params = model_lib.init_params(cfg.replace(scan_layers=True), 0)
    tokens = prompt(1, 45, seed=2)
    scanned = decode_tokens(params, cfg.replace(scan_layers=True), tokens)
    unrolled = decode_tokens(model_lib.params_for(cfg.replace(scan_layers=False), params),
                             cfg.replace(scan_layers=False), tokens)
    np.testing.assert_array_equal(scanned, unrolled)


@pytest.mark.parametrize("fields, match", [
    (dict(kv_compression="snapkv", kv_budget=0), "kv_budget=0"),
    (dict(kv_compression="snapkv", kv_budget=None), "kv_budget=None"),
    (dict(kv_compression="nope", kv_budget=8), "kv_compression='nope'"),
    (dict(kv_compression=None, kv_budget=8), "kv_budget=8"),
    (dict(kv_compression="streaming_llm", kv_budget=4), "kv_budget=4.*4 slots"),
    (dict(kv_compression="snapkv", kv_budget=32), "kv_budget=32.*32 slots"),
    (dict(kv_compression="snapkv", kv_budget=100, window_size=32), "window_size=32"),
    (dict(kv_compression="snapkv", kv_budget=100,
          compression=compression.CompressionConfig(schedule="step")), "schedule='step'"),
    (dict(kv_compression="snapkv", kv_budget=100,
          compression=compression.CompressionConfig(pooling_kernel=4)), "pooling_kernel=4"),
])
def test_bad_fields_are_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**fields)


# ------------------------------------------------------------------ MLA: latent slots


def mla_cfg(method="snapkv", budget=16, **overrides):
    """Tiny MLA (C = 16, R = 8, N = 4) compressed by ``method``."""
    from tests.conftest import tiny_mla_config
    if compression.get(method).layer_budgets is not None:
        overrides.setdefault("scan_layers", False)
    return tiny_mla_config(tie_embeddings=False, kv_compression=method, kv_budget=budget,
                           compression=KNOBS, **overrides)


def greedy_logits(params, cfg, tokens, steps):
    """[steps, V] logits of ``steps`` greedy decode steps after the prompt, and the
    sequence (prompt + the tokens fed)."""
    cache = cache_lib.init_cache(cfg, 1, 128)
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    return greedy_steps(params, cfg, tokens, logits, cache, steps)


def greedy_steps(params, cfg, tokens, logits, cache, steps):
    """:func:`greedy_logits` from the prompt's ``logits`` [1, V] and its ``cache``."""
    seq, out = list(np.asarray(tokens[0])), []
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(steps):
        seq.append(int(token[0]))
        step, cache = decode.decode_step(params, token[:, None], cache, cfg=cfg)
        out.append(np.asarray(step).reshape(-1))
        token = jnp.argmax(step.reshape(1, -1), -1).astype(jnp.int32)
    return np.stack(out), seq


def np_mla_head_scores(params, cfg, tokens):
    """[N, T, T] layer 0's scaled scores by the naive math (tests/reference.py's
    mla_attention): per-head keys [c·W_UK[n] ; k_rope], float64."""
    from tests import reference
    p = jax.tree.map(lambda a: np.asarray(a, np.float64),
                     model_lib.stack_layers(params, cfg.num_layers))
    lay, a = p["layers"], p["layers"]["attn"]
    pos = np.arange(tokens.shape[1])
    y = reference.rms_norm(p["embed"]["embedding"][np.asarray(tokens[0])],
                           lay["attn_norm"]["scale"][0], cfg.norm_eps)
    nope = cfg.qk_nope_head_dim
    q = np.einsum("td,dnh->tnh", y, a["w_q"]["kernel"][0])
    q = np.concatenate([q[..., :nope], reference.rotary(q[..., nope:], pos, cfg.rope_theta)],
                       -1)
    c = reference.rms_norm(y @ a["w_dkv"]["kernel"][0], a["kv_norm"]["scale"][0],
                           cfg.norm_eps)
    k_rope = reference.rotary((y @ a["w_kr"]["kernel"][0])[:, None], pos, cfg.rope_theta)
    k_nope = np.einsum("tc,ncp->tnp", c, a["w_uk"]["kernel"][0])
    k = np.concatenate([k_nope, np.repeat(k_rope, cfg.num_heads, axis=1)], -1)
    return np.einsum("qnh,snh->nqs", q, k) / np.sqrt(nope + cfg.qk_rope_head_dim)


@pytest.mark.parametrize("absorb", [True, False])
def test_mla_keeps_latent_slots_snapkv_selects(absorb):
    """One MLA layer, SnapKV at a budget of 16 of a 40-token prompt: the kept c_kv and
    k_rope rows are the full cache's at numpy's SnapKV slots, scored with the per-head
    attention of the naive math (mean over the N heads: one latent "KV head"); and 20
    decode steps (the ring of 16 wraps) equal the numpy reference model attending to
    the kept prompt tokens and the ring's last 16 positions, on both MLA paths."""
    from tests import reference
    cfg = mla_cfg(num_layers=1, mla_absorb=absorb)
    params = model_lib.init_params(cfg, 2)
    t, b, w, r = 40, 16, KNOBS.observation_window, KNOBS.recent_slots
    tokens = prompt(1, t, seed=6)
    s = np_mla_head_scores(params, cfg, tokens)[:, t - w:]  # [N, w, T]
    s = np.where(np.tril(np.ones((t, t), bool))[t - w:], s, -np.inf)
    votes = np.exp(s - s.max(-1, keepdims=True))
    votes = (votes / votes.sum(-1, keepdims=True)).sum(1)  # [N, T]
    pooled = np.stack([np.pad(votes, [(0, 0), (1, 1)])[:, i:i + t] for i in range(3)]).mean(0)
    score = np.where(np.arange(t) >= t - w, compression.KEEP, pooled.mean(0))
    want = np_select(score[None, None], np.arange(t)[None], b)[0, 0]
    pcfg = compress_lib.prompt_config(cfg)
    full = cache_lib.init_cache(pcfg, 1, t)
    _, full = decode.prefill(params, pcfg, tokens, full)
    cache = cache_lib.init_cache(cfg, 1, 128)
    _, cache = decode.prefill(params, cfg, tokens, cache)
    for name in ("c_kv", "k_rope"):
        np.testing.assert_array_equal(np.asarray(cache.layer(0)[name])[0, :b],
                                      np.asarray(full.layer(0)[name])[0, want])
        assert cache.layer(0)[name].shape[1] == b + r
    out, seq = greedy_logits(params, cfg, tokens, 20)
    n = len(seq)
    q_, k_ = np.arange(n)[:, None], np.arange(n)[None, :]
    mask = (k_ <= q_) & np.where(q_ < t, True, np.isin(k_, want) | ((k_ >= t) & (q_ - k_ < r)))
    ref = reference.logits(model_lib.stack_layers(params, 1), cfg, seq, [mask])
    np.testing.assert_allclose(out, ref[t:], rtol=2e-4, atol=2e-4)


def test_mla_keep_everything_equals_the_latent_cache():
    """Every method at a budget holding the whole 20-token prompt gives the uncompressed
    MLA cache's decode logits (6 steps into the ring; both paths decode a compressed
    cache in test_mla_keeps_latent_slots_snapkv_selects)."""
    base = mla_cfg().replace(kv_compression=None, kv_budget=None)
    params = model_lib.init_params(base, 0)
    tokens = prompt(1, 20, seed=1)
    want, _ = greedy_logits(params, base, tokens, 6)
    for method in filter(compression.evicts, compression.names()):  # quest: paged only
        budget = 20
        while min(compress_lib.layer_budgets(mla_cfg(method, budget))) < 20:
            budget += 4
        cfg = mla_cfg(method, budget)
        got, _ = greedy_logits(model_lib.params_for(cfg, params), cfg, tokens, 6)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=method)


@pytest.mark.parametrize("method", ["snapkv", "pyramidkv"])
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_mla_allocated_bytes_equal_theory(method, kv_dtype):
    """The compressed MLA cache allocates (b_i + R)·(C + R)·b per layer and row (codes
    and scales when quantized): theory's latent bytes at the budget, at any context."""
    cfg = mla_cfg(method, budget=24, kv_dtype=kv_dtype)
    params = model_lib.init_params(cfg, 0)
    cache = cache_lib.init_cache(cfg, 2, 128)
    _, cache = decode.prefill(params, cfg, prompt(2, 60), cache)
    assert set(cache.tensors) == ({"c_kv", "k_rope"} if kv_dtype is None else
                                  {"c_kv", "k_rope", "c_kv_scale", "k_rope_scale"})
    budgets = compress_lib.layer_budgets(cfg)
    for name in cache.tensors:
        assert [cache.layer(i)[name].shape[1] for i in range(cfg.num_layers)] == \
            [b + KNOBS.recent_slots for b in budgets]
    for t in (60, 1000):
        assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, t, 2)
    per_slot = {None: (16 + 8) * 4, "int8": 16 + 8 + 2 * 4}[kv_dtype]  # (C + R)·b
    assert cache_lib.cache_bytes(cache) == 2 * per_slot * (2 * 24 + 2 * KNOBS.recent_slots)


@pytest.mark.parametrize("run, match", [
    (dict(max_seq_len=64), "kv_budget=100.*max_seq_len=64"),
    (dict(page_size=16), r"kv_budget=100; allowed: .*multiple of page_size=16 \(got 100 \+ "
                         r"192 = 292"),
    (dict(prefill_chunk=32), "prefill_chunk=32"),
])
def test_run_level_refusals(run, match):
    model = tiny_config(kv_compression="snapkv", kv_budget=100)
    with pytest.raises(ConfigError, match=match):
        RunConfig(model=model, weights="random", **run)


def test_speculative_every_n_is_refused():
    """The main job speculates on a cache compressed after its prefill (tested in
    tests/test_speculative.py), not on one re-scored every N steps."""
    from kvjax.config import SpeculativeConfig
    model = tiny_config(kv_compression="snapkv", kv_budget=100, compression=every(2))
    with pytest.raises(ConfigError, match="speculative.drafter='ngram'.*schedule='every_n'"):
        RunConfig(model=model, weights="random", speculative=SpeculativeConfig(
            drafter="ngram", k=2))


def test_a_toy_method_is_one_registration(monkeypatch):
    """A new method is one ``register`` call (what a new file in kvjax/compression does):
    the config accepts it, the prefill applies it, theory and the compiled decode step
    count its cache, with no other edit."""
    def newest_first(obs):  # keeps the most recent slots: the window without sinks
        return jnp.broadcast_to(obs.key_positions[:, None, :].astype(jnp.float32),
                                obs.keys.shape[:3])

    toy = compression.Method(name="toy_recent", score=newest_first, queries="none",
                             reference="this test")
    monkeypatch.setitem(compression._METHODS, "toy_recent", toy)
    cfg = cfg_for("toy_recent", budget=10, num_layers=1)
    params = model_lib.init_params(cfg, 0)
    cache = cache_lib.init_cache(cfg, 1, 64)
    _, cache = decode.prefill(params, cfg, prompt(1, 30), cache)
    assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, 30)
    step = costs.analyze_decode_step(cfg, 30, jaxpr=False)
    assert step.cache_bytes == cache_lib.cache_bytes(cache)
    assert step.theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(cfg, 30)
    assert step.xla.bytes >= step.cache_bytes  # the compiled step reads the whole cache
    row = step.as_dict(nested=False)
    assert row["kv_compression"] == "toy_recent" and row["kv_budget"] == 10


@pytest.mark.parametrize("mla", [False, True])
def test_scoring_overhead_is_counted(mla):
    """SnapKV's overhead in the compiled prefill covers at least its window's scores:
    2·H FLOP per (query head, window query, slot) and layer (MLA: H = C + R)."""
    cfg = (mla_cfg if mla else cfg_for)("snapkv", budget=24)
    t, w = 64, KNOBS.observation_window
    over = costs.compression_overhead(cfg, t)
    h = cfg.kv_lora_rank + cfg.qk_rope_head_dim if mla else cfg.head_dim
    floor = cfg.num_layers * cfg.num_heads * w * t * 2 * h
    assert over["flops"] >= floor
    assert over["prefill_flops"] > over["flops"]


@pytest.mark.parametrize("mla", [False, True])
def test_the_dense_engine_serves_compressed_rows(mla):
    """Each request's row is compressed at its own prefill (a one-row ragged prefill)
    and decoded beside the others: its tokens equal its decoding alone (on pages:
    tests/test_compressed_pages.py)."""
    from kvjax.inference import engine
    cfg = (mla_cfg if mla else cfg_for)("snapkv", budget=20)
    params = model_lib.init_params(cfg, 0)
    r = np.random.default_rng(0)
    prompts = [tuple(int(x) for x in r.integers(3, 97, n)) for n in (50, 33, 61)]
    eng = engine.Engine(params, cfg, num_slots=2, max_seq_len=128)
    done, _ = eng.run([engine.Request(i, p, 8) for i, p in enumerate(prompts)])
    for c, p in zip(done, prompts):
        want = decode_tokens(params, cfg, jnp.asarray([p], jnp.int32), steps=7)[0]
        np.testing.assert_array_equal(np.asarray(c.tokens), want)


def test_the_speculative_loop_refuses_every_n_by_name():
    from kvjax.config import SpeculativeConfig
    from kvjax.inference import speculative
    cfg = cfg_for("h2o", budget=20, compression=every(2))
    cache = speculative.init_target_cache(cfg, 1, 64, 2)
    with pytest.raises(ConfigError, match="kv_compression='h2o'.*schedule='every_n'"):
        speculative.generate(None, cfg, SpeculativeConfig(drafter="ngram", k=2), [[1, 2]],
                             jnp.asarray([3], jnp.int32), cache, 4)


@pytest.mark.parametrize("method", ["snapkv", "h2o"])
def test_greedy_speculation_on_a_compressed_cache_equals_plain(method):
    """Compressed after its prefill, the cache is a fixed kept set (pinned slots) and a
    ring, which the prefill into init_target_cache gives k + 1 spare slots: greedy
    speculative decoding (drafts accepted and rejected, the ring wrapped twice) emits
    plain greedy decoding's tokens, and its cache ends holding what plain decoding's
    shows."""
    from kvjax.config import SpeculativeConfig
    from kvjax.inference import speculative
    cfg = cfg_for(method, budget=20)
    spec = SpeculativeConfig(drafter="ngram", k=3, ngram_max=2)
    params = model_lib.init_params(cfg, 0)
    tokens = jnp.asarray(np.tile(prompt(1, 9, seed=2), (1, 5)))  # repeats: drafts hit
    want = decode_tokens(params, cfg, tokens, steps=40)[0]
    cache = speculative.init_target_cache(cfg, 1, 128, spec.k)
    assert cache.num_slots == 20 + KNOBS.recent_slots + spec.k + 1
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    assert int(first[0]) == want[0]
    got, stats, cache, _ = speculative.generate(params, cfg, spec, [tokens[0].tolist()],
                                                first, cache, 40)
    np.testing.assert_array_equal(got[0], want[1:])
    assert 0 < stats.accepted[0] < stats.proposed[0]
    assert cache.num_slots == 20 + KNOBS.recent_slots + spec.k + 1
    # what the next query sees: the kept slots and the last recent_slots - 1 positions
    pos = np.asarray(cache.positions)[0]
    seen = np.asarray(cache_lib.policy_for(cfg).visible(
        cache.length[:, None], cache.positions))[0, 0]
    ring = np.sort(pos[seen & (np.arange(pos.size) >= 20)])
    np.testing.assert_array_equal(ring, np.arange(85 - KNOBS.recent_slots + 1, 85))


# ------------------------------------------------------------------ PyramidKV


def reference_schedule(budget, w, beta, num_layers):
    """KVCache-Factory's PyramidKVCluster budgets (``pyramidkv_utils.py``): the floored
    step, max_num - i·steps + w per layer."""
    c = budget - w
    lo = c // beta
    hi = 2 * c - lo
    steps = (hi - lo) // (num_layers - 1)
    return [w + hi - i * steps for i in range(num_layers)]


@pytest.mark.parametrize("budget, beta, layers", [(512, 20, 30), (128, 20, 30),
                                                   (256, 5, 7), (24, 4, 2)])
def test_pyramid_budgets_follow_the_reference_schedule(budget, beta, layers):
    """The bottom and top layers keep the reference's w + max_num and w + min_num; the
    budgets never rise, sum to L x kv_budget exactly, and stay within one slot of the
    exact arithmetic sequence (the reference's floored step drifts up to L - 1 above)."""
    from kvjax.compression import pyramidkv
    knobs = dataclasses.replace(compression.CompressionConfig(), pyramid_beta=beta,
                                observation_window=8 if budget == 24 else 32)
    got = pyramidkv.layer_budgets(knobs, budget, layers)
    ref = reference_schedule(budget, knobs.observation_window, beta, layers)
    assert got[0] == ref[0] and len(got) == layers
    c = budget - knobs.observation_window
    assert got[-1] == knobs.observation_window + c // beta
    assert sum(got) == layers * budget
    assert all(a >= b for a, b in zip(got, got[1:]))
    exact = [ref[0] - i * (ref[0] - got[-1]) / (layers - 1) for i in range(layers)]
    assert max(abs(g - e) for g, e in zip(got, exact)) < 1
    assert sum(ref) >= sum(got)  # the floored step keeps more in all, never fewer
    assert pyramidkv.layer_budgets(knobs, budget, 1) == (budget,)


def test_pyramidkv_config_has_per_layer_budgets():
    cfg = cfg_for("pyramidkv")
    assert cfg.layer_budgets == (36, 12) and cfg.per_layer_slots
    assert [cfg.layer_config(i).kv_budget for i in range(2)] == [36, 12]
    assert cfg.layer_config(0).layer_budgets is None  # one layer's config is uniform
    flat = cfg.replace(compression=dataclasses.replace(KNOBS, uniform_layers=True))
    assert flat.layer_budgets is None and not flat.per_layer_slots
    assert cfg_for("snapkv").layer_budgets is None


def kept_positions(full_k, kept_k):
    """[K, b] the prompt position of each kept key (its exact copy in the full cache)."""
    d = ((kept_k[:, :, None, :] - full_k[:, None, :, :]) ** 2).sum(-1)  # [K, b, S]
    assert np.all(d.min(-1) < 1e-10)
    return d.argmin(-1)


def keys_bksh(cfg, layer):
    k = np.asarray(cache_lib.read(cfg, layer, "k"))
    return np.swapaxes(k, -1, -2) if cache_lib.slot_axis(cfg, "k") == -1 else k


@pytest.mark.parametrize("prompt_len", [60, 20])
def test_pyramidkv_decode_equals_the_masked_reference(prompt_len):
    """Decode logits of a PyramidKV cache (layers of 36 and 12 kept slots, a ring of 16
    after each) equal the numpy reference model over the whole sequence, each layer and
    KV head attending to exactly: its kept prompt tokens (SnapKV's top b_i, numpy's
    scores and selection), the tokens written into its pinned slots (positions T0..b_i-1
    when the prompt was shorter than b_i) and its ring's last R positions. 24 steps: the
    rings wrap. A 20-token prompt fills layer 0's 36 slots but not layer 1's 12, so
    each layer's ring holds other positions."""
    from tests import reference
    cfg = cfg_for("pyramidkv")
    params = model_lib.init_params(cfg, 1)
    tokens = prompt(1, prompt_len, seed=5)
    w, r, steps = KNOBS.observation_window, KNOBS.recent_slots, 24
    budgets = compress_lib.layer_budgets(cfg)
    # numpy's SnapKV selection per layer, from the full prefill's keys and queries
    pcfg = compress_lib.prompt_config(cfg)
    full = cache_lib.init_cache(pcfg, 1, compress_lib.prompt_slots(cfg, prompt_len))
    _, full, queries = model_lib.forward(
        params, pcfg, tokens, jnp.arange(prompt_len, dtype=jnp.int32)[None], full,
        fresh=True, last_only=True, observe=True)
    cache = cache_lib.init_cache(cfg, 1, 128)
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    kpos = np.asarray(full.positions)
    kept = []
    for i, b in enumerate(budgets):
        k = keys_bksh(pcfg, full.layer(i))
        q = np.asarray(queries[i])[:, prompt_len - w:]
        scores = np_snapkv(q, k, np.arange(prompt_len - w, prompt_len)[None], kpos,
                           cfg.head_dim ** -0.5, w, KNOBS.pooling_kernel)
        want = np_select(scores, kpos, b)[0]  # [K, b] slots = positions
        got = kept_positions(k[0], keys_bksh(cfg, cache.layer(i))[0, :, :b])
        held = want < prompt_len
        np.testing.assert_array_equal(got[held], want[held], err_msg=f"layer {i}")
        kept.append([set(row[row < prompt_len].tolist()) for row in want])
    out, seq = greedy_steps(params, cfg, tokens, logits, cache, steps)
    n = len(seq)
    q_, k_ = np.arange(n)[:, None], np.arange(n)[None, :]
    masks = []
    for i, b in enumerate(budgets):
        mask = np.zeros((cfg.num_kv_heads, n, n), bool)
        for h in range(cfg.num_kv_heads):
            in_kept = np.isin(np.arange(n), sorted(kept[i][h]))[None, :]
            later = (k_ >= prompt_len) & ((k_ < b) | (q_ - k_ < r))
            mask[h] = (k_ <= q_) & np.where(q_ < prompt_len, True, in_kept | later)
        masks.append(mask)
    want = reference.logits(model_lib.stack_layers(params, cfg.num_layers), cfg, seq, masks)
    np.testing.assert_allclose(np.stack(out), want[prompt_len:], rtol=2e-4, atol=2e-4)
    # and the masks differ from a uniform budget's: the test sees each layer's own
    assert len(kept[0][0]) != len(kept[1][0]) or prompt_len <= min(budgets)


@pytest.mark.parametrize("fields, match", [
    (dict(budget=11), r"kv_budget=11.*layer 1 would keep 8"),
    (dict(compression=dataclasses.replace(KNOBS, pyramid_beta=0)), "pyramid_beta=0"),
    (dict(compression=dataclasses.replace(KNOBS, uniform_layers=1)), "uniform_layers=1"),
    (dict(scan_layers=True), "scan_layers=True"),
])
def test_pyramidkv_bad_fields_are_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for("pyramidkv", **fields)


def test_pyramidkv_layer_budget_above_max_seq_len_is_refused():
    model = cfg_for("pyramidkv", budget=24)  # layer 0 keeps 36
    with pytest.raises(ConfigError, match=r"kv_budget=24.*\(36, layer 0\).*max_seq_len=30"):
        RunConfig(model=model, weights="random", max_seq_len=30)


def test_a_toy_per_layer_method_is_one_registration(monkeypatch):
    """Per-layer budgets are one hook of ``Method``: a toy method keeping 6 and 14 slots
    in the two layers allocates exactly those (+ the ring) and theory's bytes, and its
    compiled decode step reads that cache, with no other edit."""
    def newest_first(obs):
        return jnp.broadcast_to(obs.key_positions[:, None, :].astype(jnp.float32),
                                obs.keys.shape[:3])

    toy = compression.Method(name="toy_layers", score=newest_first, queries="none",
                             reference="this test",
                             layer_budgets=lambda cfg, budget, n: (budget - 4, budget + 4))
    monkeypatch.setitem(compression._METHODS, "toy_layers", toy)
    cfg = cfg_for("toy_layers", budget=10, scan_layers=False)
    assert cfg.layer_budgets == (6, 14)
    params = model_lib.init_params(cfg, 0)
    cache = cache_lib.init_cache(cfg, 1, 64)
    _, cache = decode.prefill(params, cfg, prompt(1, 30), cache)
    axis = cache_lib.slot_axis(cfg, "k")
    assert [x.shape[axis] for x in cache.tensors["k"]] == [6 + 16, 14 + 16]
    assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, 30)
    step = costs.analyze_decode_step(cfg, 30, jaxpr=False)
    assert step.cache_bytes == cache_lib.cache_bytes(cache)
    assert step.theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(cfg, 30)
    assert 0.9 <= step.xla.bytes / step.theory_bytes <= 1.3
    bad = compression.Method(name="toy_bad", score=newest_first, queries="none",
                             reference="this test",
                             layer_budgets=lambda cfg, budget, n: (budget, budget + 1))
    monkeypatch.setitem(compression._METHODS, "toy_bad", bad)
    with pytest.raises(ConfigError, match="summing to num_layers x kv_budget = 20"):
        cfg_for("toy_bad", budget=10, scan_layers=False)


def test_pyramidkv_with_uniform_layers_is_snapkv():
    """``compression.uniform_layers=True`` gives every layer kv_budget: PyramidKV's
    tokens then equal SnapKV's (same scores), stacked layers allowed."""
    flat = dataclasses.replace(KNOBS, uniform_layers=True)
    cfg = cfg_for("pyramidkv", compression=flat, scan_layers=True)
    assert cfg.layer_budgets is None
    params = model_lib.init_params(cfg, 0)
    tokens = prompt(1, 45, seed=3)
    np.testing.assert_array_equal(decode_tokens(params, cfg, tokens),
                                  decode_tokens(params, cfg_for("snapkv"), tokens))


# ------------------------------------------------- schedule 'every_n': decode-time eviction


def every(n, **knobs):
    return dataclasses.replace(KNOBS, schedule="every_n", every_n=n, **knobs)


def test_every_step_streaming_llm_equals_a_ring_of_budget_plus_one():
    """One layer: StreamingLLM compressed after every step with a budget of N keeps the
    sinks and the last N - s tokens, so each decode query sees what a ring of W = N + 1
    slots with s sinks shows; fed the same tokens, every step's logits agree (recompress
    gathers, re-marks and empties the ring exactly)."""
    cfg = cfg_for("streaming_llm", budget=12, num_layers=1, compression=every(1))
    ring = tiny_config(tie_embeddings=False, num_layers=1, window_size=13, num_sink_tokens=4)
    params = model_lib.init_params(cfg, 0)
    tokens, feed = prompt(2, 40), prompt(2, 10, seed=3)
    out = {}
    for name, c in (("every", cfg), ("ring", ring)):
        cache = cache_lib.init_cache(c, 2, 64)
        _, cache = decode.prefill(params, c, tokens, cache)
        rows = []
        for j in range(feed.shape[1]):
            logits, cache = jax.jit(decode._step, static_argnums=1)(
                params, c, feed[:, j], cache, None)
            rows.append(np.asarray(logits[:, 0]))
        out[name] = np.stack(rows)
    np.testing.assert_allclose(out["every"], out["ring"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["h2o", "tova"])
def test_keep_everything_every_step_equals_the_full_cache(method):
    base = tiny_config(tie_embeddings=False)
    params = model_lib.init_params(base, 0)
    tokens = prompt(1, 20, seed=1)
    want = decode_tokens(params, base, tokens, steps=12)
    cfg = cfg_for(method, budget=40, compression=every(1))
    np.testing.assert_array_equal(decode_tokens(params, cfg, tokens, steps=12), want)


def np_recompress_positions(cfg, cache, method):
    """Each row's and head's kept positions after the decode-time compression of
    ``cache`` (its ring holds every_n tokens), from numpy: the per-head true positions,
    the buffered queries, H2O's accumulator, the method's score and np_select."""
    st = jax.tree.map(np.asarray, cache.schedule)
    budget, s = cfg.kv_budget, cache.num_slots
    pos = np.asarray(cache.positions)
    out = []
    for i in range(cfg.num_layers):
        k = np.asarray(cache_lib.read(cfg, cache.layer(i), "k"), np.float32)
        if cache_lib.slot_axis(cfg, "k") == -1:
            k = np.swapaxes(k, -1, -2)
        held = np.pad(st["kept_positions"][i], ((0, 0), (0, 0), (0, s - budget)),
                      constant_values=-1)
        kp = np.where(held >= 0, held, pos[:, None, :])  # [B, K, S]
        cnt = st["count"]
        if method == "tova":
            sel = cnt - 1
            q = st["queries"][i][np.arange(len(cnt)), sel][:, None].astype(np.float32)
            qp = st["query_positions"][np.arange(len(cnt)), sel][:, None]
        else:
            q, qp = st["queries"][i].astype(np.float32), st["query_positions"]
        att = np.stack([np_window_attention(q[:, :, kh:kh + 1], k[:, kh:kh + 1], qp,
                                            kp[:, kh], cfg.head_dim ** -0.5)[:, 0]
                        for kh in range(k.shape[1])], axis=1)  # [B, K, G, S]
        if method == "tova":
            score = np.broadcast_to(att.mean(axis=(1, 2))[:, None], kp.shape)
        else:
            acc = np.pad(st["accumulated"][i], ((0, 0), (0, 0), (0, s - budget)))
            score = att.mean(axis=2) + acc
            last = kp.max(axis=(1, 2), keepdims=True)
            n = int(round(cfg.compression.recent_fraction * budget))
            score = np.where((kp > last - n) & (kp >= 0), compression.KEEP, score)
        s_ = np.where(kp >= 0, score, -np.inf)
        idx = np.sort(np.argsort(-s_, axis=-1, kind="stable")[..., :budget], axis=-1)
        out.append(np.take_along_axis(kp, idx, axis=-1))
    return np.stack(out)


@pytest.mark.parametrize("method", ["h2o", "tova"])
def test_decode_time_selection_matches_numpy(method):
    """Ragged rows of different lengths: after N decode steps the compression keeps, per
    row, layer and KV head, the positions a numpy top-k of the same scores keeps (ties
    aside: the scores are random-model floats), and each row keeps the positions it
    keeps when decoded alone."""
    n = 4
    cfg = cfg_for(method, budget=24, compression=every(n))
    params = model_lib.init_params(cfg, 0)
    tokens, lengths = prompt(2, 50, seed=4), np.array([50, 37])
    cache = cache_lib.init_cache(cfg, 2, 128, ragged=True)
    logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
    feed = prompt(2, n, seed=5)
    step = jax.jit(decode._step, static_argnums=1)
    nv = jnp.ones((2,), jnp.int32)
    for j in range(n - 1):
        _, cache = step(params, cfg, feed[:, j], cache, nv)

    @jax.jit
    def write_and_buffer(params, token, cache):  # the N-th step of decode._step, unscored
        _, out, queries = model_lib.forward(params, cfg, token, cache.length[:, None],
                                            cache, num_valid=nv, observe=True)
        return compress_lib.observe_step(out, queries, cache.length, jnp.ones((2,), bool))

    last = write_and_buffer(params, feed[:, n - 1:], cache)
    due = compress_lib.due_rows(cfg, last)
    assert np.asarray(due).all()
    want = np_recompress_positions(cfg, last, method)
    got = jax.jit(compress_lib.recompress, static_argnums=0)(cfg, last, due)
    np.testing.assert_array_equal(np.asarray(got.schedule["kept_positions"]), want)
    assert np.asarray(got.positions)[:, cfg.kv_budget:].max() == -1  # the ring emptied
    # row independence: the padded row alone, the same steps, keeps the same positions
    alone = cache_lib.init_cache(cfg, 1, 128, ragged=True)
    _, alone = decode.prefill(params, cfg, tokens[1:, :lengths[1]], alone)
    for j in range(n):
        _, alone = step(params, cfg, feed[1:, j], alone, nv[:1])
    np.testing.assert_array_equal(np.asarray(alone.schedule["kept_positions"])[:, 0],
                                  want[:, 1])


@pytest.mark.parametrize("method, kv_dtype", [("h2o", None), ("tova", "int8")])
def test_every_n_cache_holds_its_budget(method, kv_dtype):
    """After decoding many rings' worth of steps the cache still allocates theory's bytes
    at the budget, and its scoring state exactly theory's state bytes."""
    cfg = cfg_for(method, kv_dtype=kv_dtype, compression=every(3))
    params = model_lib.init_params(cfg, 0)
    cache = cache_lib.init_cache(cfg, 2, 128)
    logits, cache = decode.prefill(params, cfg, prompt(2, 60), cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    _, steps, cache = decode.generate(params, cfg, first, cache, 40)
    assert steps == 40 and cache.num_slots == cfg.kv_budget + KNOBS.recent_slots
    assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, 100, 2)
    over = theory.schedule_overhead(cfg, 2)
    assert cache_lib.total_bytes(cache.schedule) == over["state_bytes"]
    assert over["bytes_per_step"] == pytest.approx(
        (over["read_bytes"] + over["move_bytes"]) / 3)
    assert theory.schedule_overhead(cfg_for(method), 2)["flops"] == 0
    # 2 rows x 100 tokens: every ring slot written after the last compression is real
    ring = np.asarray(cache.positions)[:, cfg.kv_budget:]
    assert ((ring >= 0).sum(1) < 3).all() and ring.max() == 99


@pytest.mark.parametrize("fields, match", [
    (dict(compression=every(0)), "every_n=0"),
    (dict(compression=every(17)), "every_n=17"),
    (dict(compression=every(2.5)), "every_n=2.5"),
    (dict(kv_compression="pyramidkv", scan_layers=False, compression=every(2)),
     "schedule='every_n'"),
])
def test_bad_every_n_is_refused_by_name(fields, match):
    fields = {**dict(kv_compression="h2o", kv_budget=24), **fields}
    with pytest.raises(ConfigError, match=match):
        tiny_config(**fields)


def test_every_n_is_refused_with_mla_by_name():
    with pytest.raises(ConfigError, match="schedule='every_n'.*attention='mla'"):
        from tests.conftest import tiny_mla_config  # noqa: PLC0415
        tiny_mla_config(kv_compression="h2o", kv_budget=24, compression=every(2))


def test_every_n_ragged_loop_rows_match_alone():
    """The ragged loop, rows of different lengths stopping at different steps (a stopped
    row writes and buffers nothing): each row's tokens equal its tokens decoded alone."""
    cfg = cfg_for("h2o", compression=every(2))
    params = model_lib.init_params(cfg, 0)
    tokens, lengths, budgets = prompt(2, 50, seed=4), np.array([50, 37]), [5, 9]
    cache = cache_lib.init_cache(cfg, 2, 128, ragged=True)
    logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
    both = np.asarray(ragged.generate_ragged(
        params, cfg, jnp.argmax(logits, -1).astype(jnp.int32), cache, budgets)[0])
    for b in range(2):
        alone = cache_lib.init_cache(cfg, 1, 128, ragged=True)
        lg, alone = decode.prefill(params, cfg, tokens[b:b + 1, :lengths[b]], alone)
        out, _, _ = decode.generate(params, cfg, jnp.argmax(lg, -1).astype(jnp.int32),
                                    alone, budgets[b])
        np.testing.assert_array_equal(both[b, :budgets[b]], np.asarray(out)[0])


@pytest.mark.parametrize("method, n", [("h2o", 2), ("tova", 1)])
def test_the_engine_compresses_every_n_rows_as_alone(method, n):
    """The slot engine's dense rows, each compressed every N steps: requests of
    different prompt lengths and budgets join rows at different steps (two rows, three
    requests, three steps per sync, so a row's compressions fall inside and across
    blocks); each request's tokens equal its decoding alone with the same schedule."""
    from kvjax.inference import engine
    cfg = cfg_for(method, budget=20, compression=every(n))
    params = model_lib.init_params(cfg, 0)
    r = np.random.default_rng(1)
    prompts = [tuple(int(x) for x in r.integers(3, 97, t)) for t in (50, 29, 61)]
    budgets = [13, 6, 11]
    eng = engine.Engine(params, cfg, num_slots=2, max_seq_len=128, steps_per_sync=3)
    done, _ = eng.run([engine.Request(i, p, m)
                       for i, (p, m) in enumerate(zip(prompts, budgets))])
    assert [c.slot for c in done] == [0, 1, 1]  # the third joins the second's row
    for c, p, m in zip(done, prompts, budgets):
        want = decode_tokens(params, cfg, jnp.asarray([p], jnp.int32), steps=m - 1)[0]
        np.testing.assert_array_equal(np.asarray(c.tokens), want)


@pytest.mark.parametrize("run, match", [
    (dict(page_size=16, num_pages=32), "model.compression.schedule='every_n'; allowed: "
                                       "'prefill' with page_size=16"),
    (dict(speculative="ngram"), "kv_compression='tova' with speculative decoding"),
])
def test_the_engine_refuses_every_n_on_pages_or_speculative_by_name(run, match):
    """What the engine still cannot run with a compressed cache, every-N included: pages
    (a paged row is compressed once, after its prefill) and speculative decoding."""
    from kvjax.config import SpeculativeConfig
    from kvjax.inference import engine
    cfg = cfg_for("tova", compression=every(2))
    params = model_lib.init_params(cfg, 0)
    if "speculative" in run:
        run = dict(speculative=SpeculativeConfig(drafter="ngram", k=2))
    with pytest.raises(ConfigError, match=match):
        engine.Engine(params, cfg, num_slots=2, max_seq_len=128, **run)


def test_the_cost_hooks_loop_compresses_every_n_from_a_full_cache():
    """compress_lib.full_cache of a compressed config holds its kept slots (markers) and a full
    ring, with a scoring state under 'every_n'; the generate loop the cost hook compiles
    (from shapes) re-scores: from a full ring, every 3 steps compress at steps 1 and 4,
    so 5 steps leave 1 token in the ring (without re-scoring it would stay full)."""
    from kvjax.analysis import costs
    cfg = cfg_for("h2o", budget=24, compression=every(3))
    cache = compress_lib.full_cache(cfg, 1, 100)
    pos = np.asarray(cache.positions)[0]
    np.testing.assert_array_equal(pos[:24], np.arange(24))
    np.testing.assert_array_equal(np.sort(pos[24:]), np.arange(99 - KNOBS.recent_slots, 99))
    assert cache.schedule is not None and int(cache.length[0]) == 99
    assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, 100)
    loop = costs.compile_generate(cfg, 1, 100)
    params = model_lib.fuse_projections(cfg, model_lib.init_params(cfg, 0))
    _, steps, out = loop(params, jnp.zeros((1,), jnp.int32), cache, jnp.int32(5),
                         jax.random.key(0), jnp.int32(-1))
    ring = np.asarray(out.positions)[0, 24:]
    assert int(steps) == 5 and (ring >= 0).sum() == 1 and ring.max() == 103
