"""The slot engine (kvjax/inference/engine.py): requests inserted into free slots while
others decode give exactly the tokens of each request run alone; one compiled decode
loop serves every occupancy; bad requests are refused by name before any work."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.cache.policy import CacheOverflowError
from kvjax.config import ModelConfig
from kvjax.inference import decode, engine
from tests.test_ragged import VARIANTS, params_of

S = 32
PROMPTS = [[5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14], [7], [23, 45, 61, 8, 12],
           [90, 1, 2, 3], [11, 22, 33, 44, 55, 66, 77, 88, 1, 2, 3, 4, 5, 6, 7, 8, 9]]
BUDGETS = [6, 11, 2, 1, 8]


def alone(cfg, params, prompt, max_new, eos_id=-1):
    cache = cache_lib.init_cache(cfg, 1, S)
    logits, cache = decode.prefill(params, cfg, jnp.asarray([prompt], jnp.int32), cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    toks, _, _ = decode.generate(params, cfg, first, cache, max_new - 1, eos_ids=eos_id)
    out = [int(first[0])] + [int(t) for t in np.asarray(toks[0])]
    if eos_id in out:
        out = out[:out.index(eos_id) + 1]
    return out


def requests():
    return [engine.Request(i, tuple(p), n) for i, (p, n) in enumerate(zip(PROMPTS, BUDGETS))]


@pytest.mark.parametrize("name", ["gqa", "window_sinks", "mla_absorbed"])
def test_engine_tokens_equal_alone(name):
    cfg = ModelConfig(**VARIANTS[name])
    params = params_of(name)
    before = engine.decode_steps_program._cache_size()
    eng = engine.Engine(params, cfg, num_slots=2, max_seq_len=S, steps_per_sync=3)
    done, stats = eng.run(requests())
    # One compiled decode loop for every occupancy (0..2 slots filled over the run).
    assert engine.decode_steps_program._cache_size() - before == 1
    for c, p, n in zip(done, PROMPTS, BUDGETS):
        assert c.tokens == alone(cfg, params, p, n), (name, c.id)
        assert c.stop == "budget" and len(c.tokens) == n
    assert stats.tokens == sum(BUDGETS)
    assert 0 < stats.mean_occupancy <= 1
    assert stats.prefills == len(PROMPTS)
    # The same request alone in the engine: same tokens as amid the others.
    solo, _ = engine.Engine(params, cfg, num_slots=2, max_seq_len=S).run([requests()[4]])
    assert solo[0].tokens == done[4].tokens


def test_engine_eos_frees_slot():
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    ref = alone(cfg, params, PROMPTS[1], 11)
    eos = ref[3]
    done, _ = engine.Engine(params, cfg, 2, S, eos_ids=eos, steps_per_sync=4).run(requests())
    assert done[1].tokens == ref[:ref.index(eos) + 1] and done[1].stop == "eos"
    for c, p, n in zip(done, PROMPTS, BUDGETS):
        assert c.tokens == alone(cfg, params, p, n, eos_id=eos)


def test_engine_bad_requests():
    cfg = ModelConfig(**VARIANTS["gqa"])
    eng = engine.Engine(params_of("gqa"), cfg, 2, S)
    with pytest.raises(ValueError, match="request 7: empty prompt"):
        eng.run([engine.Request(7, (), 3)])
    with pytest.raises(CacheOverflowError, match="request 3"):
        eng.run([engine.Request(1, (1, 2), 2), engine.Request(3, (1,) * 30, 5)])
    with pytest.raises(ValueError, match="request 2: max_new_tokens=0"):
        eng.run([engine.Request(2, (1,), 0)])
    with pytest.raises(ValueError, match="num_slots=0"):
        engine.Engine(params_of("gqa"), cfg, 0, S)


@pytest.mark.parametrize("name", ["gqa", "window_sinks", "mla_absorbed"])
def test_speculative_engine_tokens_equal_alone(name):
    """The slot engine with n-gram drafts (issue 30): greedy tokens of every request
    equal plain decoding alone (dense, a ring with sinks and its k + 1 spare slots, MLA),
    drafts are proposed and counted, and a request's tokens do not depend on its
    batch-mates."""
    from kvjax.config import SpeculativeConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS[name])
    params = params_of(name)
    spec = SpeculativeConfig(drafter="ngram", k=3, ngram_max=2, ngram_min=1)
    reqs = requests() + [engine.Request(9, (4, 5, 6, 4, 5, 6, 4, 5, 6, 4, 5), 9)]
    eng = engine.Engine(params, cfg, num_slots=2, max_seq_len=S, steps_per_sync=2,
                        speculative=spec)
    done, stats = eng.run(reqs)
    for c, r in zip(done, reqs):
        assert c.tokens == alone(cfg, params, list(r.prompt), r.max_new_tokens), (name, c.id)
        assert c.stop == "budget"
    assert stats.tokens == sum(r.max_new_tokens for r in reqs)
    assert stats.proposed > 0 and 0 <= stats.accepted <= stats.proposed
    solo, _ = engine.Engine(params, cfg, num_slots=2, max_seq_len=S,
                            speculative=spec).run([reqs[4]])
    assert solo[0].tokens == done[4].tokens


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_speculative_engine_sampled_tokens_do_not_depend_on_batch_mates(drafter):
    """Sampled (temperature 1): a request's tokens are the same beside two batch-mates,
    in blocks of 2 rounds, as alone in blocks of 8: the acceptance and a draft model's
    draws use the request's own keys, folded with its token count, never a key of the
    engine's call."""
    from kvjax.config import SamplingConfig, SpeculativeConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    spec = SpeculativeConfig(drafter="ngram", k=2, ngram_max=2, ngram_min=1) \
        if drafter == "ngram" else SpeculativeConfig(
            drafter="self", k=2, draft_window_size=4, draft_sink_tokens=1,
            draft_kv_dtype="int8", draft_num_layers=1)
    hot = SamplingConfig(temperature=1.0)
    eng = engine.Engine(params, cfg, num_slots=3, max_seq_len=S, sampling=hot,
                        speculative=spec, steps_per_sync=2)
    done, _ = eng.run(requests())
    solo, _ = engine.Engine(params, cfg, num_slots=3, max_seq_len=S, sampling=hot,
                            speculative=spec).run([requests()[0]])
    assert solo[0].tokens == done[0].tokens and len(done[0].tokens) == BUDGETS[0]


@pytest.mark.parametrize("drafter", ["self", "self_target", "model"])
def test_speculative_engine_with_a_draft_model_keeps_the_plain_tokens(drafter):
    """The slot engine with a draft model kept per slot (issue 30): 'self' (the same
    weights over a window of 4 with a sink, int8 keys and values, one layer), the same
    window copied from each slot's target row every round ('self_target': no draft cache,
    no draft prefill) and 'model' (here the target's own weights and config, so every
    draft is the target's greedy token: rounds that accept all k leave the last draft
    pending in the draft's cache across the engine's calls): every request's greedy
    tokens equal plain decoding alone, with slots refilled mid-run; drafts proposed and
    accepted."""
    from kvjax.config import SpeculativeConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")
    spec = {"self": SpeculativeConfig(drafter="self", k=3, draft_window_size=4,
                                      draft_sink_tokens=1, draft_kv_dtype="int8",
                                      draft_num_layers=1),
            "self_target": SpeculativeConfig(drafter="self", k=3, draft_window_size=4,
                                             draft_sink_tokens=1, draft_kv_source="target"),
            "model": SpeculativeConfig(drafter="model", k=2,
                                       draft_config="configs/mqa.py")}[drafter]
    draft = None
    if drafter == "model":
        draft = (params, cfg)
    reqs = requests()
    eng = engine.Engine(params, cfg, num_slots=2, max_seq_len=S, steps_per_sync=2,
                        speculative=spec, draft=draft)
    done, stats = eng.run(reqs)
    for c, r in zip(done, reqs):
        assert c.tokens == alone(cfg, params, list(r.prompt), r.max_new_tokens), c.id
    assert stats.proposed > 0 and 0 < stats.accepted <= stats.proposed
    assert (eng.draft_cache is None) == (drafter == "self_target")
    if drafter == "model":  # the target drafting for itself: only budgets cut a round
        assert stats.accepted == stats.proposed, (stats.accepted, stats.proposed)


def test_speculative_engine_refuses_drafts_it_cannot_build():
    from kvjax.config import ConfigError, SpeculativeConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS["gqa"])
    model = SpeculativeConfig(drafter="model", k=2, draft_config="configs/mqa.py")
    with pytest.raises(ConfigError, match=r"speculative.drafter='model' needs a draft"):
        engine.Engine(params_of("gqa"), cfg, 2, S, speculative=model)
    other = ModelConfig(**{**VARIANTS["mqa"], "vocab_size": 50})
    with pytest.raises(ConfigError, match=r"draft model vocab_size=50"):
        engine.Engine(params_of("gqa"), cfg, 2, S, speculative=model, draft=({}, other))
    with pytest.raises(ValueError, match=r"draft= without speculative="):
        engine.Engine(params_of("gqa"), cfg, 2, S, draft=({}, other))


@pytest.mark.parametrize("paged", [False, True])
def test_large_and_numpy_request_ids_run_each_with_its_own_key(paged):
    """Issue 54 item 5: every id check() accepts runs with its own sampling key (fold_in
    keeps 32 bits: 2**32 + 7 crashed in run() as a Python int and shared 7's key as
    np.int64); an id outside [0, 2**64) is refused by check() before any work."""
    from kvjax.config import SamplingConfig  # noqa: PLC0415
    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")

    def make():
        hot = SamplingConfig(temperature=1.0)
        if paged:
            return engine.Engine(params, cfg, num_slots=2, max_seq_len=S, page_size=4,
                                 num_pages=32, sampling=hot)
        return engine.Engine(params, cfg, num_slots=2, max_seq_len=S, sampling=hot)

    prompt, n = tuple(PROMPTS[0]), 12
    ids = [7, 2**32 + 7, 2**63 - 1, 2**64 - 1, 2**32]
    eng = make()
    for i in ids + [np.int64(2**32 + 7), np.uint64(2**64 - 1)]:
        eng.check(engine.Request(i, prompt, n))
    done, _ = eng.run([engine.Request(i, prompt, n) for i in ids])
    toks = {c.id: tuple(c.tokens) for c in done}
    assert len(set(toks.values())) == len(ids)  # 12 tokens at T = 1: one key each
    again, _ = make().run([engine.Request(np.int64(2**32 + 7), prompt, n),
                           engine.Request(np.uint64(2**64 - 1), prompt, n)])
    assert tuple(again[0].tokens) == toks[2**32 + 7]  # the same id, the same key
    assert tuple(again[1].tokens) == toks[2**64 - 1]
    for bad in (2**64, -1, True, 1.0):
        with pytest.raises(ValueError, match=r"request id=.*; allowed: an integer in "
                                             r"\[0, 2\*\*64\)"):
            eng.check(engine.Request(bad, prompt, n))


@pytest.mark.parametrize("paged", [False, True])
def test_arrivals_gate_admission_and_keep_the_tokens(paged):
    """Requests with arrival times (given out of order) are not admitted before they
    arrive, keep the tokens of an all-at-once run, and carry one host timestamp per
    token: non-decreasing, from their first token to their finish."""

    cfg = ModelConfig(**VARIANTS["gqa"])
    params = params_of("gqa")

    def make():
        if paged:
            return engine.Engine(params, cfg, num_slots=2, max_seq_len=S, page_size=4,
                                 num_pages=16, steps_per_sync=2)
        return engine.Engine(params, cfg, num_slots=2, max_seq_len=S, steps_per_sync=2)

    at_once, _ = make().run(requests())
    arrivals = [0.3, 0.0, 0.6, 0.1, 0.45]
    reqs = [dataclasses.replace(r, arrival_s=a) for r, a in zip(requests(), arrivals)]
    done, stats = make().run(reqs)
    assert [c.id for c in done] == [r.id for r in reqs]  # the order given
    assert [c.tokens for c in done] == [c.tokens for c in at_once]
    for c, a in zip(done, arrivals):
        assert c.arrival_s == a and c.first_token_s >= a  # never admitted early
        assert c.ttft_s == pytest.approx(c.first_token_s - a)
        assert len(c.token_s) == len(c.tokens) and c.token_s[0] == c.first_token_s
        assert all(x <= y for x, y in zip(c.token_s, c.token_s[1:]))
        assert c.token_s[-1] <= c.finish_s
        assert len(c.itl_s) == len(c.tokens) - 1 and min(c.itl_s, default=0) >= 0
    assert stats.wall_s >= max(arrivals)


def test_bad_arrival_times_refused_by_name():
    cfg = ModelConfig(**VARIANTS["gqa"])
    eng = engine.Engine(params_of("gqa"), cfg, 2, S)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"request 4: arrival_s="):
            eng.run([engine.Request(1, (1, 2), 2),
                     engine.Request(4, (1,), 2, arrival_s=bad)])
