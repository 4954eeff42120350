"""Prefill + generate: the compiled loop, sampling, EOS, length checks, the real model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.inference import decode, sampling
from kvjax.models import model
from kvjax.config import SamplingConfig
from tests.conftest import tiny_config


def tiny(**kw):
    return tiny_config(vocab_size=61, d_model=16, num_heads=2, num_kv_heads=1, mlp_dim=32,
                       **kw)


@pytest.fixture(scope="module")
def setup():
    cfg = tiny()
    return cfg, model.init_params(cfg, 0)


_fwd = jax.jit(model.forward, static_argnums=1)


def greedy_reference(params, cfg, prompt, n):
    """Greedy continuation by re-running the full cache-free forward each step."""
    ids = list(prompt)
    for _ in range(n):
        t = len(ids)
        logits, _ = _fwd(params, cfg, jnp.asarray([ids]),
                                  jnp.arange(t, dtype=jnp.int32)[None])
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


def run(params, cfg, prompt, n, max_seq_len=32, **kw):
    c = cache_lib.init_cache(cfg, 1, max_seq_len)
    logits, c = decode.prefill(params, cfg, jnp.asarray([prompt], jnp.int32), c)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    toks, steps, c = decode.generate(params, cfg, first, c, n - 1, **kw)
    return [int(first[0])] + [int(x) for x in toks[0, :steps]], steps, c


def test_generate_matches_recomputing_greedy_reference(setup):
    cfg, params = setup
    prompt = [3, 14, 15, 9, 2]
    got, steps, c = run(params, cfg, prompt, 8)
    assert steps == 7 and c.length.tolist() == [len(prompt) + 7]
    assert got == greedy_reference(params, cfg, prompt, 8)


def test_generate_loop_traces_once_for_1_4_16_steps(setup):
    cfg, params = setup
    traced = chex.assert_max_traces(decode.generate_program.__wrapped__, n=1)
    jitted = jax.jit(traced, static_argnames=("cfg", "sampling"), donate_argnames=("cache",))
    for n in (1, 4, 16):
        c = cache_lib.init_cache(cfg, 1, 32)
        _, c = decode.prefill(params, cfg, jnp.asarray([[1, 2, 3]], jnp.int32), c)
        buf, steps, _ = jitted(params, jnp.asarray([4], jnp.int32), c, jnp.int32(n),
                               jax.random.key(0), jnp.int32(-1), cfg=cfg,
                               sampling=SamplingConfig())
        assert int(steps) == n


def test_eos_stops_the_row(setup):
    cfg, params = setup
    prompt = [3, 14, 15, 9, 2]
    ref = greedy_reference(params, cfg, prompt, 8)
    eos = ref[3]
    got, steps, _ = run(params, cfg, prompt, 8, eos_ids=eos)
    assert got[: ref.index(eos) + 1] == ref[: ref.index(eos) + 1]
    assert steps == ref.index(eos)  # stopped right after emitting eos


def test_prompt_longer_than_cache_raises_before_running(setup):
    cfg, params = setup
    c = cache_lib.init_cache(cfg, 1, 4)
    with pytest.raises(cache_lib.CacheOverflowError, match="max_seq_len=4"):
        decode.prefill(params, cfg, jnp.zeros((1, 5), jnp.int32), c)


def test_decoding_past_the_cache_raises(setup):
    cfg, params = setup
    c = cache_lib.init_cache(cfg, 1, 8)
    _, c = decode.prefill(params, cfg, jnp.zeros((1, 5), jnp.int32), c)
    with pytest.raises(cache_lib.CacheOverflowError, match="at most 3 more tokens"):
        decode.generate(params, cfg, jnp.zeros((1,), jnp.int32), c, 4)
    toks, steps, c = decode.generate(params, cfg, jnp.zeros((1,), jnp.int32), c, 3)
    assert steps == 3 and c.length.tolist() == [8]


def test_sampling_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 400)
    def draws(s):
        return np.asarray([int(sampling.sample_logits(logits, k, s)[0]) for k in keys])
    assert set(draws(SamplingConfig(temperature=1.0, top_k=2))) == {0, 1}
    # top_p=0.7: 0.5 alone is below 0.7, 0.5+0.3 reaches it -> tokens {0, 1}.
    assert set(draws(SamplingConfig(temperature=1.0, top_p=0.7))) == {0, 1}
    assert set(draws(SamplingConfig(temperature=1.0, top_p=0.5))) == {0}
    counts = np.bincount(draws(SamplingConfig(temperature=1.0, seed=1)), minlength=4) / 400
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.07)
    assert int(sampling.sample_logits(logits, keys[0], SamplingConfig())[0]) == 0


def test_sampled_generation_is_reproducible(setup):
    cfg, params = setup
    s = SamplingConfig(temperature=0.8, top_k=10, top_p=0.9, seed=3)
    a, _, _ = run(params, cfg, [1, 2, 3], 6, sampling=s, rng=jax.random.key(3))
    b, _, _ = run(params, cfg, [1, 2, 3], 6, sampling=s, rng=jax.random.key(3))
    assert a == b


@pytest.mark.slow
def test_real_model_says_paris(smollm2):
    loaded, run_cfg = smollm2
    tok = loaded.tokenizer
    ids = tok.encode("The capital of France is")
    out, _, _ = run(loaded.params, loaded.cfg, ids, 3, max_seq_len=16)
    assert " Paris" in tok.decode(out)
