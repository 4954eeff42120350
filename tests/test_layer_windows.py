"""Per-layer windows (``model.layer_windows``, issue 53 item 2; lever 3 per layer, as
Gemma 2 / 3 train it): each local layer holds its own ring of W_i slots and each global
layer the full context, so the cache's bytes are the per-layer sum of theory; the logits
through the cache equal the float64 reference; the slot engine gives the tokens of
decoding alone; the field takes a pattern from the command line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.analysis import costs, theory
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import decode, engine
from kvjax.models import model
from tests import reference

S = 32
# SmolLM2-shaped, shrunk: 6 layers, GQA (N = 4, K = 2), 5 of 6 layers windowed; the
# windows differ (3 and 5) so that each ring is seen keeping its own W.
TINY = dict(vocab_size=64, num_layers=6, d_model=16, num_heads=4, num_kv_heads=2,
            head_dim=8, mlp_dim=24, scan_layers=False, rope_theta=1e4)
WINDOWS = (3, 5, 3, 5, 3, None)
IDS = [5, 40, 17, 9, 3, 50, 21, 8, 33, 12, 7, 60]


def tiny(**kw) -> ModelConfig:
    return ModelConfig(**{**TINY, "layer_windows": WINDOWS, **kw})


def params(cfg, seed=0):
    p = model.init_params(cfg, seed)
    rng = np.random.default_rng(seed)  # norm scales away from 1, so they matter
    return {k: (v if not k.startswith("layers_") else
                {**v, "attn_norm": {"scale": v["attn_norm"]["scale"] + jnp.asarray(
                    0.3 * rng.standard_normal(v["attn_norm"]["scale"].shape), jnp.float32)}})
            for k, v in p.items()}


_forward = jax.jit(model.forward, static_argnums=1)


def cache_logits(p, cfg, ids, prefill):
    cache = cache_lib.init_cache(cfg, 1, S)
    tok = jnp.asarray([ids], jnp.int32)
    pos = jnp.arange(len(ids), dtype=jnp.int32)[None]
    logits, cache = _forward(p, cfg, tok[:, :prefill], pos[:, :prefill], cache)
    rows = [np.asarray(logits[0])]
    for t in range(prefill, len(ids)):
        logits, cache = _forward(p, cfg, tok[:, t:t + 1], pos[:, t:t + 1], cache)
        rows.append(np.asarray(logits[0]))
    return np.concatenate(rows), cache


@pytest.mark.parametrize("prefill", [2, 7])
def test_per_layer_rings_match_the_reference(prefill):
    """12 tokens (a prefill of 2 or 7, then steps) through rings of 3 and 5 slots and a
    global layer of 32: logits within 1e-4 of the float64 reference (each layer its own
    band), equal to the cache-free forward; every ring holds the last W_i positions of
    the sequence, in slot p mod W_i."""
    cfg = tiny()
    p = params(cfg)
    want = reference.logits(model.stack_layers(p, cfg.num_layers), cfg, IDS)
    got, cache = cache_logits(p, cfg, IDS, prefill)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    free, _ = _forward(p, cfg, jnp.asarray([IDS]), jnp.arange(len(IDS))[None])
    np.testing.assert_allclose(got, np.asarray(free[0]), atol=5e-5, rtol=1e-5)
    # windows matter: the all-global model is another function
    full = reference.logits(model.stack_layers(p, cfg.num_layers),
                            cfg.replace(layer_windows=None, scan_layers=True), IDS)
    assert np.abs(full - want).max() > 1e-2
    t = len(IDS)
    for i, w in enumerate(WINDOWS):
        held = np.asarray(cache_lib.layer_positions(cfg, cache, i))[0]
        k = np.asarray(cache.tensors["k"][i])
        assert k.shape[cache_lib.slot_axis(cfg, "k")] == (S if w is None else w)
        if w is None:
            assert held[:t].tolist() == list(range(t)) and (held[t:] == -1).all()
        else:
            assert sorted(held.tolist()) == list(range(t - w, t))
            assert all(held[j] % w == j for j in range(w))


def test_cache_bytes_equal_the_per_layer_theory():
    """The allocated cache (float32 and int8) equals theory's per-layer sum at
    max_seq_len; theory's bytes at t are sum_i min(t, W_i) layer-slices; a pattern
    string gives the same windows."""
    for kv in (None, "int8"):
        cfg = tiny(kv_dtype=kv)
        cache = cache_lib.init_cache(cfg, 2, S)
        assert cache_lib.cache_bytes(cache) == theory.kv_cache_bytes(cfg, S, batch=2)
        per_layer = theory.kv_bytes_per_token(cfg) // cfg.num_layers
        assert theory.kv_cache_bytes(cfg, 100) == per_layer * (3 + 5 + 3 + 5 + 3 + 100)
    assert tiny(layer_windows="3,5,3,5,3,global").layer_windows == WINDOWS
    assert tiny(layer_windows=(4, None)).layer_windows == (4, None) * 3
    assert theory.layer_tokens_held(tiny(), 4) == [3, 4, 3, 4, 3, 4]


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match=r"model.layer_windows='3,0,x'.*positive integer"):
        tiny(layer_windows="3,0,x")
    with pytest.raises(ConfigError, match=r"model.layer_windows=.*must divide num_layers=6"):
        tiny(layer_windows=(3, 3, None, 3))
    with pytest.raises(ConfigError, match=r"model.layer_windows=.*window_size is None"):
        tiny(window_size=4)
    with pytest.raises(ConfigError, match=r"model.layer_windows=.*scan_layers False"):
        tiny(scan_layers=True)
    assert tiny(scan_layers=None).scan_layers is False
    with pytest.raises(ValueError, match="spare_slots=2 with model.layer_windows"):
        cache_lib.init_cache(tiny(), 1, S, spare_slots=2)


def test_engine_and_generate_give_the_tokens_of_decoding_alone():
    """The main loop (prefill + generate, greedy) equals the reference's argmax
    continuation past every ring's wrap; the slot engine (ragged rows, padded prefills,
    rows inserted into free slots) gives each request the tokens of decoding it alone."""
    cfg = tiny()
    p = params(cfg, seed=1)
    prompts = [[5, 17, 3, 8, 41, 9, 60, 2], [7], [23, 45, 61, 8, 12]]
    budgets = [6, 9, 4]

    def alone(prompt, n):
        cache = cache_lib.init_cache(cfg, 1, S)
        logits, cache = decode.prefill(p, cfg, jnp.asarray([prompt], jnp.int32), cache)
        first = jnp.argmax(logits, -1).astype(jnp.int32)
        toks, _, _ = decode.generate(p, cfg, first, cache, n - 1)
        return [int(first[0])] + [int(t) for t in np.asarray(toks[0])]

    stacked = model.stack_layers(p, cfg.num_layers)
    seq = list(prompts[0])
    for _ in range(budgets[0]):
        seq.append(int(np.argmax(reference.logits(stacked, cfg, seq)[-1])))
    assert alone(prompts[0], budgets[0]) == seq[len(prompts[0]):]
    reqs = [engine.Request(i, tuple(pr), n) for i, (pr, n) in enumerate(zip(prompts, budgets))]
    done, _ = engine.Engine(p, cfg, num_slots=2, max_seq_len=S, steps_per_sync=3).run(reqs)
    for c, pr, n in zip(done, prompts, budgets):
        assert c.tokens == alone(pr, n), c.id


def test_cost_hook_compiled_bytes_follow_the_per_layer_theory():
    """The compiled decode step's cache: the hook's cache bytes equal theory's per-layer
    sum, and the step's XLA bytes are within [0.9, 1.3] of theory (weights + per-layer
    KV read + write) for a model whose KV read is most of the step (t = 2048, B = 4)."""
    cfg = ModelConfig(vocab_size=256, num_layers=6, d_model=64, num_heads=4,
                      num_kv_heads=4, head_dim=32, mlp_dim=128, scan_layers=False,
                      layer_windows=(64, 64, 64, 64, 64, None))
    step = costs.analyze_decode_step(cfg, 2048, batch=4, attribute=False, jaxpr=False)
    assert step.cache_bytes == theory.kv_cache_bytes(cfg, 2048, batch=4)
    assert step.theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(cfg, 2048, 4)
    assert 0.9 <= step.bytes_ratio <= 1.3, step.bytes_ratio
    assert step.as_dict(nested=False)["layer_windows"] == [64] * 5 + [None]


def test_perplexity_through_the_cache_equals_the_full_forward():
    """The evaluation path the ablation's 'layer windows' rows run (kvjax.training.
    evaluate): chunked cached NLL equals the full forward's, each layer in its band."""
    from kvjax.training import evaluate  # noqa: PLC0415

    cfg = tiny()
    p = params(cfg, seed=2)
    w = np.random.default_rng(2).integers(0, 64, (2, 12)).astype(np.int32)
    cached, c = evaluate.nll_cached(p, cfg, w, chunk=4)
    np.testing.assert_allclose(cached, evaluate.nll_full(p, cfg, w), atol=2e-5)
    assert [x.shape[cache_lib.slot_axis(cfg, "k")] for x in c.tensors["k"]] == \
        [3, 5, 3, 5, 3, 12]


def test_paged_cache_is_refused_by_name():
    """Paged rows hold one block table for every layer; per-layer rings are refused
    there, naming the field, before anything runs."""
    from kvjax.cache import paged  # noqa: PLC0415

    cfg = tiny()
    cache = paged.init_paged_cache(cfg.replace(layer_windows=None), 1, 4, 8, 4)
    with pytest.raises(ValueError, match=r"a paged cache with model.layer_windows="):
        model.forward(params(cfg), cfg, jnp.zeros((1, 1), jnp.int32),
                      jnp.zeros((1, 1), jnp.int32), cache)
