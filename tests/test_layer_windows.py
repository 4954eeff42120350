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
from kvjax import naming
from kvjax.analysis import costs, theory
from kvjax.cache import paged
from kvjax.config import ConfigError, ModelConfig, SpeculativeConfig
from kvjax.inference import decode, engine, ragged
from kvjax.inference import speculative as spec_lib
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
    # reports name the pattern: the layers of each window
    assert naming.variant_name(tiny(name="m")) == "m GQA K=2 W=3 x3 + W=5 x2 + global x1 fp32"


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


# ------------------------------------------------------------------ paged rows


def _paged_logits(p, cfg, rows, prefill, page_size=4, pages=(7, 2, 5, 0, 9, 3, 1, 8)):
    """Each row of ``rows`` (token lists of different lengths) prefilled (its first
    ``prefill[b]`` tokens, right-padded) then stepped one token at a time, rows ragged,
    through a paged cache whose block tables hold scattered pages; the logits of every
    position of each row."""
    n = max(map(len, rows))
    m = -(-S // page_size)
    cache = paged.init_paged_cache(cfg, len(rows), 2 * m, page_size, m)
    table = np.full((len(rows), m), -1, np.int32)
    order = list(pages) + [q for q in range(2 * m) if q not in pages]
    for b, r in enumerate(rows):
        need = -(-len(r) // page_size)
        table[b, :need] = order[b * m:b * m + need]
    cache = cache.replace(block_table=jnp.asarray(table))
    toks, lens = ragged.pad_prompts([r[:k] for r, k in zip(rows, prefill)])
    pos = jnp.arange(toks.shape[1], dtype=jnp.int32)[None].repeat(len(rows), 0)
    logits, cache = _forward_paged(p, cfg, jnp.asarray(toks), pos, cache, jnp.asarray(lens))
    out = [[np.asarray(logits[b, :k])] for b, k in enumerate(prefill)]
    for t in range(min(prefill), n):
        live = np.asarray([k <= t < len(r) for r, k in zip(rows, prefill)])
        tok = np.asarray([[r[t] if ok else 0] for r, ok in zip(rows, live)], np.int32)
        pos = cache.length[:, None]
        logits, cache = _forward_paged(p, cfg, jnp.asarray(tok), pos, cache,
                                       jnp.asarray(live, jnp.int32))
        for b in np.nonzero(live)[0]:
            out[b].append(np.asarray(logits[b]))
    return [np.concatenate(o) for o in out], cache


_forward_paged = jax.jit(lambda p, cfg, tok, pos, cache, nv: model.forward(
    p, cfg, tok, pos, cache, num_valid=nv), static_argnums=1)


def test_paged_rows_give_the_dense_logits():
    """Ragged rows (12 and 7 tokens, prefills of 5 and 2, then steps) on scattered pages
    of 4 tokens: every position's logits equal the dense per-layer rings' run of that
    row alone; the local layers hold each row's ring of W_i slots, the global layer the
    pool; the allocated bytes are theory's per-layer sum at the view's M·P slots."""
    cfg = tiny()
    p = params(cfg)
    rows = [IDS, [9, 31, 4, 22, 50, 6, 13]]
    got, cache = _paged_logits(p, cfg, rows, prefill=[5, 2])
    for r, g in zip(rows, got):
        want, _ = cache_logits(p, cfg, r, 1)
        np.testing.assert_allclose(g, want, atol=2e-5, rtol=1e-5)
    assert cache.rings == (3, 5, 3, 5, 3, 0)
    ax = cache_lib.slot_axis(cfg, "k")
    assert [x.shape[ax] if w else x.shape[0] for x, w in zip(cache.tensors["k"], WINDOWS)] \
        == [3, 5, 3, 5, 3, 16]  # rings of W_i slots per row; 2·M = 16 pages in the pool
    # num_pages = B·M pages of P: the pools and rings hold theory's per-layer bytes of
    # B rows of M·P tokens
    for kv in (None, "int8"):
        c = tiny(kv_dtype=kv)
        one = paged.init_paged_cache(c, 3, 3 * 8, 4, 8)
        assert cache_lib.cache_bytes(one) == theory.kv_cache_bytes(c, 32, batch=3)
        assert paged.page_bytes(c, 4) * 24 + paged.ring_bytes(c, 3) == \
            theory.kv_cache_bytes(c, 32, batch=3)


def test_paged_engine_gives_the_tokens_of_decoding_alone_and_theory_bytes():
    """The engine over paged rows (2 rows, 5 requests of ragged lengths, a pool of 6
    pages of 4 tokens, fewer than the 19 the requests take in all, so the pages and
    the rings of finished rows are reused and a row is preempted): every request gets
    the tokens of decoding it alone through the dense per-layer rings; the allocated
    bytes are the pool's pages of the global layer plus each local layer's rings,
    theory's per-layer sum for num_slots rows of num_pages / num_slots pages."""
    cfg = tiny()
    p = params(cfg, seed=1)
    prompts = [[5, 17, 3, 8, 41, 9, 60, 2], [7], [23, 45, 61, 8, 12], [3, 3, 9],
               [44, 1, 30, 12, 19, 2, 50]]
    budgets = [9, 11, 6, 12, 4]
    reqs = [engine.Request(i, tuple(pr), n) for i, (pr, n) in enumerate(zip(prompts, budgets))]
    eng = engine.Engine(p, cfg, num_slots=2, max_seq_len=24, steps_per_sync=3, page_size=4,
                        num_pages=6)
    done, stats = eng.run(reqs)
    for c, pr, n in zip(done, prompts, budgets):
        assert c.tokens == _alone(p, cfg, pr, n), c.id
    assert sum(paged.pages_for(len(pr) + n - 1, 4) for pr, n in zip(prompts, budgets)) > 6
    assert stats.preemptions >= 1 and stats.prefills > len(reqs)
    assert stats.allocated_kv_bytes == cache_lib.cache_bytes(eng.rows.cache) == \
        6 * paged.page_bytes(cfg, 4) + paged.ring_bytes(cfg, 2)
    # a pool of num_slots x M pages: theory's per-layer sum of 2 rows of M·P = 24 tokens
    full = engine.Engine(p, cfg, num_slots=2, max_seq_len=24, page_size=4, num_pages=12)
    assert full.rows.allocated_bytes == theory.kv_cache_bytes(cfg, 24, batch=2)
    with pytest.raises(ConfigError, match=r"prefix_cache=True with model.layer_windows="
                                          r".*allowed: prefix_cache=False"):
        engine.Engine(p, cfg, num_slots=2, max_seq_len=24, page_size=4, num_pages=12,
                      prefix_cache=True)


def _alone(p, cfg, prompt, n):
    cache = cache_lib.init_cache(cfg, 1, S)
    logits, cache = decode.prefill(p, cfg, jnp.asarray([prompt], jnp.int32), cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    toks, _, _ = decode.generate(p, cfg, first, cache, n - 1)
    return [int(first[0])] + [int(t) for t in np.asarray(toks[0])]


def test_paged_cache_of_another_config_is_refused_by_name():
    """A paged cache built without the per-layer rings (or with others) is refused,
    naming the field, before anything runs."""
    cfg = tiny()
    for other in (cfg.replace(layer_windows=None), cfg.replace(layer_windows=(3, None))):
        cache = paged.init_paged_cache(other, 1, 4, 8, 4)
        with pytest.raises(ValueError, match=r"per-layer rings .* with model.layer_windows="):
            model.forward(params(cfg), cfg, jnp.zeros((1, 1), jnp.int32),
                          jnp.zeros((1, 1), jnp.int32), cache)


# ------------------------------------------------------------------ speculative decoding


SPECS = {"ngram": SpeculativeConfig(drafter="ngram", k=3, ngram_max=2),
         "self_layers": SpeculativeConfig(drafter="self", k=2, draft_num_layers=3,
                                          draft_window_size=0),
         "self_window": SpeculativeConfig(drafter="self", k=4, draft_window_size=4,
                                          draft_sink_tokens=1)}


@pytest.mark.parametrize("name", list(SPECS))
def test_speculative_greedy_tokens_equal_plain_greedy(name):
    """Greedy speculative decoding of two ragged rows, 18 tokens each, past every ring's
    wrap: the tokens of plain greedy decoding, with drafts rejected on the way (each
    local layer's ring keeps k + 1 spare slots, so a rejected draft's write evicted no
    key its window shows, and the rollback is the row's length alone); the drafters:
    n-gram, the first 3 layers (their own windows), a window of 4 with a sink."""
    cfg = tiny()
    p = params(cfg, seed=3)
    spec = SPECS[name]
    prompts = [[5, 17, 3, 5, 17, 3, 5, 17], [23, 45, 61]]
    n = 18
    plain = [_alone(p, cfg, pr, n + 1) for pr in prompts]
    cache = spec_lib.init_target_cache(cfg, 2, S + 8, spec.k)
    assert [x.shape[cache_lib.slot_axis(cfg, "k")] for x in cache.tensors["k"]] == \
        [w + spec.k + 1 if w else S + 8 for w in WINDOWS]
    toks, lens = ragged.pad_prompts(prompts)
    logits, cache = ragged.prefill_ragged(p, cfg, toks, lens, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    draft = None
    if spec.drafter == "self":
        dparams, dcfg = spec_lib.self_draft(p, cfg, spec)
        dcache = spec_lib.init_draft_cache(dcfg, 2, S + 8, spec.k)
        _, dcache = ragged.prefill_ragged(dparams, dcfg, toks, lens, dcache)
        draft = (dparams, dcfg, dcache)
    out, stats, _, _ = spec_lib.generate(p, cfg, spec, prompts, first, cache, n, draft=draft)
    assert [[int(first[b])] + out[b] for b in range(2)] == plain
    assert sum(stats.accepted) < sum(stats.proposed)  # some drafts were taken back
    assert sum(stats.accepted) > 0


def test_speculative_refusals_name_the_value():
    """A target cache whose rings keep no spare slots, and a draft that copies the
    target's window, are refused by name before any work."""
    cfg = tiny()
    p = params(cfg)
    spec = SPECS["ngram"]
    cache = cache_lib.init_cache(cfg, 1, S, ragged=True)
    with pytest.raises(ValueError, match=r"cache's layer 0 holds 3 slots for its window 3 "
                                         r"\(model.layer_windows\); allowed: at least 7"):
        spec_lib.generate(p, cfg, spec, [[1, 2]], jnp.asarray([3], jnp.int32),
                          cache.replace(length=jnp.asarray([2], jnp.int32)), 4)
    target = SpeculativeConfig(drafter="self", k=2, draft_window_size=4,
                               draft_sink_tokens=1, draft_kv_source="target")
    with pytest.raises(ConfigError, match=r"draft_kv_source='target' with model.layer_windows"
                                          r"=.*allowed: draft_kv_source='own'"):
        engine.Engine(p, cfg, num_slots=1, max_seq_len=S, speculative=target)


def test_paged_engine_speculative_gives_the_tokens_of_decoding_alone():
    """Speculative rounds (n-gram, k = 3) in the engine over paged rows: each request
    gets the tokens of plain greedy decoding; the local layers' rings keep k + 1 spare
    slots, counted in the allocated bytes."""
    cfg = tiny()
    p = params(cfg, seed=4)
    prompts = [[5, 17, 3, 5, 17, 3, 5], [7, 2], [23, 45, 61, 23, 45]]
    budgets = [12, 9, 10]
    spec = SPECS["ngram"]
    reqs = [engine.Request(i, tuple(pr), n) for i, (pr, n) in enumerate(zip(prompts, budgets))]
    eng = engine.Engine(p, cfg, num_slots=2, max_seq_len=24, steps_per_sync=2, page_size=4,
                        num_pages=12, speculative=spec)
    done, stats = eng.run(reqs)
    for c, pr, n in zip(done, prompts, budgets):
        assert c.tokens == _alone(p, cfg, pr, n), c.id
    assert 0 < stats.accepted < stats.proposed
    assert stats.allocated_kv_bytes == cache_lib.cache_bytes(eng.rows.cache) == \
        paged.page_bytes(cfg, 4) * 12 + paged.ring_bytes(cfg, 2, spare_slots=4)
