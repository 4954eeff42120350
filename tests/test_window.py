"""Sliding-window attention (blog "Lever 3"): the W-slot ring-buffer cache, attention
sinks (Xiao et al. 2023), their masks, memory, cost and configs.

The decode path is checked against the independent float64 numpy model of
tests/reference.py (an explicit banded causal mask from absolute positions), and against
hand-computable uniform attention. Tiny random models, float32, CPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.analysis import costs, theory
from kvjax.inference import decode
from kvjax.models import model
from kvjax.models.attention import Attention
from kvjax.config import ConfigError, ModelConfig, run_config_from_dict
from tests import reference
from tests.conftest import tiny_ring_config

W = 6  # window of the tiny models: small, so a few steps wrap the ring


def tiny(window=W, sinks=0, scan=True, **kw) -> ModelConfig:
    """conftest's tiny ring model (GQA, untied head, float32) with W=6 slots by default."""
    return tiny_ring_config(window, sinks, scan_layers=scan, name="tiny", **kw)


@functools.lru_cache(maxsize=None)
def _stacked_params(seed: int = 0):
    # Same weights for every window / sink / scan variant (they only change the cache).
    return model.init_params(tiny(window=None), jax.random.key(seed))


def params_for(cfg: ModelConfig, seed: int = 0):
    return model.params_for(cfg, _stacked_params(seed))


@functools.partial(jax.jit, static_argnames=("cfg",))
def run_chunk(params, tokens, cache, *, cfg):
    """All T logits of a chunk continuing the cache (no donation: tests reuse caches)."""
    b, t = tokens.shape
    pos = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return model.forward(params, cfg, tokens, pos, cache)


def ref_logits(cfg: ModelConfig, tokens) -> np.ndarray:
    """[T, V] logits of one sequence from the independent numpy reference."""
    return reference.logits(_stacked_params(), cfg, tokens)


def expected_positions(cfg: ModelConfig, length: int) -> np.ndarray:
    """[W] slot -> absolute position after ``length`` tokens (-1 empty), from first
    principles: the sinks 0..s-1 pin slots 0..s-1, every later position p sits in slot
    s + (p - s) mod (W - s), and the ring keeps the last W - s of them."""
    w, s = cfg.window_size, cfg.num_sink_tokens
    out = np.full(w, -1)
    for p in range(length):
        if p < s:
            out[p] = p
        elif p >= length - (w - s):
            out[s + (p - s) % (w - s)] = p
    return out


# ------------------------------------------------------------------ ring buffer vs dense


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("sinks", [0, 2], ids=["nosink", "sink2"])
@pytest.mark.parametrize("prompt_len", [W - 1, W, 2 * W + 3])
def test_ring_decode_matches_banded_reference(prompt_len, sinks, scan):
    """Prefill ``prompt_len`` tokens (below, at and above W), then single steps through
    t = W-1, W, W+1, ..., 2W+3 and beyond (the ring wraps three times): every logit equals
    the float64 model with an explicit band mask, and the slots hold the right positions."""
    cfg = tiny(sinks=sinks, scan=scan)
    params = params_for(cfg)
    total = 3 * W + 4
    tokens = np.random.default_rng(prompt_len).integers(0, cfg.vocab_size, (2, total))
    ref = np.stack([ref_logits(cfg, row) for row in tokens])  # [B, total, V]

    cache = cache_lib.init_cache(cfg, 2, max_seq_len=total)  # min(W, max_seq_len) slots
    assert cache.num_slots == W
    logits, cache = run_chunk(params, jnp.asarray(tokens[:, :prompt_len]), cache, cfg=cfg)
    np.testing.assert_allclose(logits, ref[:, :prompt_len], atol=1e-5)
    np.testing.assert_array_equal(cache.positions, [expected_positions(cfg, prompt_len)] * 2)
    for t in range(prompt_len, total):
        logits, cache = run_chunk(params, jnp.asarray(tokens[:, t:t + 1]), cache, cfg=cfg)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], atol=1e-5, err_msg=f"t={t}")
        np.testing.assert_array_equal(cache.positions, [expected_positions(cfg, t + 1)] * 2)
        assert cache.length.tolist() == [t + 1] * 2


@pytest.mark.parametrize("layouts", [("BKSH", "BKSH"), ("BKHS", "BKHS")], ids=["BKSH", "BKHS"])
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_ring_decode_in_each_cache_layout(layouts, scan):
    """The ring-buffer scatter writes along the slot axis wherever it is: a prefill past
    W then steps around the wrap, sinks on, equal the banded reference in both layouts."""
    cfg = tiny(sinks=2, scan=scan, key_layout=layouts[0], value_layout=layouts[1])
    params = params_for(cfg)
    total, prompt_len = 2 * W + 5, W + 2
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, total))
    ref = np.stack([ref_logits(cfg, row) for row in tokens])
    cache = cache_lib.init_cache(cfg, 2, max_seq_len=W)  # W slots; a ring never fills
    logits, cache = run_chunk(params, jnp.asarray(tokens[:, :prompt_len]), cache, cfg=cfg)
    np.testing.assert_allclose(logits, ref[:, :prompt_len], atol=1e-5)
    for t in range(prompt_len, total):
        logits, cache = run_chunk(params, jnp.asarray(tokens[:, t:t + 1]), cache, cfg=cfg)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], atol=1e-5, err_msg=f"t={t}")


@pytest.mark.parametrize("sinks", [0, 2, W - 1])
def test_cache_free_windowed_forward_matches_reference(sinks):
    """The cache-free forward of a windowed config applies the same band (s = W-1 leaves
    a ring of one slot: each query sees the sinks and itself)."""
    cfg = tiny(sinks=sinks)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, 3 * W)
    logits, _ = model.forward(params_for(cfg), cfg, jnp.asarray(tokens)[None],
                              jnp.arange(3 * W, dtype=jnp.int32)[None])
    np.testing.assert_allclose(logits[0], ref_logits(cfg, tokens), atol=1e-5)
    # and the window does change the function once t > W
    dense = ref_logits(tiny(window=None), tokens)
    assert np.abs(dense[W:] - ref_logits(cfg, tokens)[W:]).max() > 1e-3


def test_ring_of_one_slot_with_sinks_decodes_like_reference():
    """s = W - 1 sinks: the ring has a single slot, overwritten by every step."""
    cfg = tiny(sinks=W - 1)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 2 * W + 2))
    ref = np.stack([ref_logits(cfg, row) for row in tokens])
    cache = cache_lib.init_cache(cfg, 2, W)
    logits, cache = run_chunk(params_for(cfg), jnp.asarray(tokens[:, :W]), cache, cfg=cfg)
    np.testing.assert_allclose(logits, ref[:, :W], atol=1e-5)
    for t in range(W, 2 * W + 2):
        logits, cache = run_chunk(params_for(cfg), jnp.asarray(tokens[:, t:t + 1]), cache,
                                  cfg=cfg)
        np.testing.assert_allclose(logits[:, 0], ref[:, t], atol=1e-5)
    np.testing.assert_array_equal(cache.positions, [[0, 1, 2, 3, 4, 2 * W + 1]] * 2)


@pytest.mark.parametrize("sinks", [0, 2])
def test_generate_loop_wraps_the_ring_many_times(sinks):
    """decode.generate (one compiled while loop) for 5W steps after a prompt longer than W:
    every greedy token is the reference model's argmax of the sequence so far, and all
    5W tokens come back (the token buffer is not the W-slot cache)."""
    cfg = tiny(sinks=sinks, scan=False)
    params = params_for(cfg, 0)
    prompt = np.random.default_rng(11).integers(0, cfg.vocab_size, (1, W + 3))
    cache = cache_lib.init_cache(cfg, 1, max_seq_len=W)
    logits, cache = decode.prefill(params, cfg, jnp.asarray(prompt, jnp.int32), cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    steps = 5 * W
    out, ran, cache = decode.generate(params, cfg, first, cache, steps)
    assert out.shape == (1, steps) and ran == steps
    seq = np.concatenate([prompt[0], np.asarray(first), np.asarray(out[0])])
    assert cache.length.tolist() == [len(seq) - 1]  # the last token is sampled, not yet fed
    greedy = ref_logits(cfg, seq).argmax(-1)
    np.testing.assert_array_equal(greedy[len(prompt[0]) - 1:-1], seq[len(prompt[0]):])
    assert len(set(seq[len(prompt[0]):].tolist())) > 1  # not a degenerate repeat


# ------------------------------------------------------------------ uniform attention by hand


def _uniform_attention(window, sinks, n_pos=30):
    """A one-layer Attention whose scores are all equal (zero query weights) and whose
    value of the token at absolute position p is the one-hot e_p: its output at query q is
    the mean of e_k over the keys k it sees."""
    cfg = ModelConfig(vocab_size=8, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                      head_dim=32, mlp_dim=8, window_size=window, num_sink_tokens=sinks,
                      dtype="float32")
    assert n_pos <= cfg.d_model
    attn = Attention(cfg)
    x0 = jnp.zeros((1, 1, cfg.d_model))
    p = attn.init(jax.random.key(1), x0, jnp.zeros((1, 1), jnp.int32), None, None)["params"]
    eye = jnp.eye(32)
    p = dict(p)
    p["q_proj"] = {"kernel": jnp.zeros_like(p["q_proj"]["kernel"])}
    p["v_proj"] = {"kernel": eye.reshape(32, 1, 32)}
    p["o_proj"] = {"kernel": jnp.stack([eye, jnp.zeros_like(eye)])}  # head 0 only
    return cfg, attn, {"params": p}


def _visible(q, window, sinks):
    return [k for k in range(q + 1) if q - k < window - sinks or k < sinks]


@pytest.mark.parametrize("sinks", [0, 2])
def test_uniform_attention_is_the_mean_over_the_window(sinks):
    """Through the ring buffer, chunks below, at and above W plus single steps: out[q] is
    the mean of e_k over the last W positions (with sinks: the s sinks and the last
    W - s), to float32 rounding."""
    window, n_pos = 6, 30
    cfg, attn, variables = _uniform_attention(window, sinks, n_pos)
    cached = {n: jnp.zeros(shape) for n, shape in cache_lib.layer_shapes(cfg, 1, window).items()}
    cache = cache_lib.KVCache(tensors=cached, positions=jnp.full((1, window), -1, jnp.int32),
                              length=jnp.zeros((1,), jnp.int32))

    @jax.jit
    def attend_chunk(cache, pos):
        x = jax.nn.one_hot(pos, 32)[None]
        out, new = attn.apply(variables, x, pos[None], cache.tensors, cache.positions)
        return out, cache.replace(
            tensors={n: cache_lib.write(cache.tensors[n], new[n], pos, cfg,
                                        axis=cache_lib.slot_axis(cfg, n))
                     for n in new},
            positions=cache_lib.next_positions(cache, pos, cfg),
            length=cache.length + pos.shape[0])

    start = 0
    for size in [4, 1, 1, 1, window, 1, 1, 2 * window + 1, 1, 1]:
        out, cache = attend_chunk(cache, jnp.arange(start, start + size, dtype=jnp.int32))
        for i, q in enumerate(range(start, start + size)):
            want = np.zeros(32)
            vis = _visible(q, window, sinks)
            want[vis] = 1 / len(vis)
            np.testing.assert_allclose(out[0, i], want, atol=1e-6, err_msg=f"q={q}")
        start += size
    assert start <= n_pos
    # literal: after 30 tokens the last query (29) saw exactly these positions
    last = [24, 25, 26, 27, 28, 29] if sinks == 0 else [0, 1, 26, 27, 28, 29]
    assert start == 30 and _visible(29, window, sinks) == last
    # and the ring holds the sinks plus the last W - s positions, each in its slot
    held = np.asarray(cache.positions[0])
    assert sorted(held.tolist()) == last
    v = np.asarray(cache.tensors["v"][0, 0])  # [W, H]: the value of slot i is e_{held[i]}
    np.testing.assert_array_equal(v, np.eye(32)[held])


# ------------------------------------------------------------------ chunk == steps


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("sinks", [0, 2])
@pytest.mark.parametrize("prefix", [W - 2, 2 * W + 1])
def test_three_tokens_as_one_chunk_or_three_steps(prefix, sinks, scan):
    """The same 3 tokens fed as one chunk or as 3 single steps (across the wrap): same
    logits and same cache, slot for slot."""
    cfg = tiny(sinks=sinks, scan=scan)
    params = params_for(cfg)
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, prefix + 3)))
    _, cache0 = run_chunk(params, tokens[:, :prefix], cache_lib.init_cache(cfg, 2, W), cfg=cfg)
    chunk_logits, chunk_cache = run_chunk(params, tokens[:, prefix:], cache0, cfg=cfg)
    step_cache, step_logits = cache0, []
    for t in range(prefix, prefix + 3):
        lg, step_cache = run_chunk(params, tokens[:, t:t + 1], step_cache, cfg=cfg)
        step_logits.append(lg[:, 0])
    # equal up to float32 rounding: the chunk runs one softmax over (ring ++ chunk), a
    # step the two-part softmax of attend_step
    np.testing.assert_allclose(chunk_logits, jnp.stack(step_logits, 1), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(chunk_cache.positions, step_cache.positions)
    assert chunk_cache.length.tolist() == step_cache.length.tolist() == [prefix + 3] * 2
    for a, b in zip(jax.tree.leaves(chunk_cache.tensors), jax.tree.leaves(step_cache.tensors)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    # layer 0's keys depend on the token and position only: bit-identical
    np.testing.assert_array_equal(chunk_cache.tensors["k"][0], step_cache.tensors["k"][0])


def test_prompt_longer_than_window_leaves_its_last_w_tokens():
    """A one-chunk prefill of 2W+3 tokens leaves the same ring as feeding them one by one,
    and its layer-0 keys/values are the dense cache's at the prompt's last W positions."""
    cfg, dense = tiny(scan=False), tiny(window=None, scan=False)
    params = params_for(cfg)
    n = 2 * W + 3
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, cfg.vocab_size, (2, n)))
    _, ring = run_chunk(params, tokens, cache_lib.init_cache(cfg, 2, W), cfg=cfg)
    _, full = run_chunk(params, tokens, cache_lib.init_cache(dense, 2, n), cfg=dense)
    held = np.asarray(ring.positions[0])
    np.testing.assert_array_equal(ring.positions[1], held)
    assert sorted(held.tolist()) == list(range(n - W, n))
    np.testing.assert_array_equal(held % W, np.arange(W))
    for name in ("k", "v"):
        axis = cache_lib.slot_axis(cfg, name)
        np.testing.assert_allclose(ring.tensors[name][0],
                                   np.take(np.asarray(full.tensors[name][0]), held, axis=axis),
                                   atol=1e-6, rtol=0)
    steps = cache_lib.init_cache(cfg, 2, W)
    for t in range(n):
        _, steps = run_chunk(params, tokens[:, t:t + 1], steps, cfg=cfg)
    np.testing.assert_array_equal(steps.positions, ring.positions)
    for a, b in zip(jax.tree.leaves(ring.tensors), jax.tree.leaves(steps.tensors)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


# ------------------------------------------------------------------ W >= max_seq_len, memory


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_window_at_least_max_seq_len_is_full_attention(scan):
    """W = max_seq_len: identical logits and cache to the dense model (the ring never
    wraps, slot p = p); W > max_seq_len: equal up to float32 rounding."""
    seq = 12
    dense = tiny(window=None, scan=scan)
    params = params_for(dense)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 97, (2, seq)))

    def run(cfg):
        cache, out = cache_lib.init_cache(cfg, 2, seq), []
        for t in range(seq):
            lg, cache = run_chunk(params, tokens[:, t:t + 1], cache, cfg=cfg)
            out.append(lg)
        return jnp.concatenate(out, 1), cache

    ref, ref_cache = run(dense)
    same, same_cache = run(tiny(window=seq, scan=scan))
    np.testing.assert_array_equal(same, ref)
    np.testing.assert_array_equal(same_cache.positions, ref_cache.positions)
    for a, b in zip(jax.tree.leaves(same_cache.tensors), jax.tree.leaves(ref_cache.tensors)):
        np.testing.assert_array_equal(a, b)
    if not scan:
        wider, _ = run(tiny(window=seq + 5, scan=scan))
        np.testing.assert_allclose(wider, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sinks", [0, 3])
def test_windowed_cache_memory_is_theory_and_constant(sinks):
    cfg = tiny(sinks=sinks)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    for max_seq_len in (1, W - 1, W, 100, 10**6):  # min(W, max_seq_len) slots (issue 57)
        spec = cache_lib.cache_spec(cfg, 3, max_seq_len)
        held = min(W, max_seq_len)
        assert cache_lib.cache_bytes(spec) == 3 * held * per_token
        assert cache_lib.cache_bytes(spec) == theory.kv_cache_bytes(cfg, max_seq_len, 3)
        assert spec.positions.shape == (3, held)
    assert theory.kv_cache_bytes(cfg, 10**6, 3) == theory.kv_cache_bytes(cfg, W, 3)
    allocated = cache_lib.init_cache(tiny(sinks=sinks, scan=False), 3, 10**6)
    assert cache_lib.cache_bytes(allocated) == 3 * W * per_token
    dense = tiny(window=None)
    assert cache_lib.cache_bytes(cache_lib.cache_spec(dense, 3, 100)) == 100 * 3 * per_token


def test_window_configs_memory():
    """configs/window.py: 30·3·128·4·512 B at max_seq_len >= W, 30·3·128·4·256 B at the
    default 256 (a ring never holds more slots than the run); configs/blog_window.py in
    fp16: the blog's 3,145,728 B ("3 MB (fixed)"), 1,000x below MHA at t = 128,000."""
    from configs import blog_window, gqa, window

    def run_cfg(mod, **over):
        d = mod.get_config()
        d.update(over)
        return run_config_from_dict(d)

    win = run_cfg(window).model
    assert (win.window_size, win.num_kv_heads, win.num_sink_tokens) == (512, 3, 0)
    assert win.replace(window_size=None, name="x") == run_cfg(gqa).model.replace(name="x")
    for msl in (512, 8192, 131_072):
        spec = cache_lib.cache_spec(win, 1, msl)
        assert cache_lib.cache_bytes(spec) == 30 * 3 * 128 * 4 * 512 == 23_592_960
    spec = cache_lib.cache_spec(win, 1, 256)
    assert cache_lib.cache_bytes(spec) == 30 * 3 * 128 * 4 * 256 == theory.kv_cache_bytes(win, 256)
    blog = run_cfg(blog_window, dtype="float16").model
    assert (blog.num_kv_heads, blog.attention, blog.window_size) == (2, "gqa", 512)
    assert cache_lib.cache_bytes(cache_lib.cache_spec(blog, 1, 128_000)) == 3_145_728
    mha = blog.replace(num_kv_heads=8, attention="mha", window_size=None)
    assert theory.kv_cache_bytes(mha, 128_000) == 1000 * 3_145_728
    # overrides from the command line validate like any field
    assert run_cfg(window, model=dict(window.get_config().model, window_size=64,
                                      num_sink_tokens=4)).model.num_sink_tokens == 4


# ------------------------------------------------------------------ cost hook


def test_decode_step_cost_is_flat_in_context():
    """XLA bytes/FLOPs of a windowed step are the same at t = 1K and 64K (it compiles W
    slots whatever t >= W); at t = 16 < W its ring holds 16 slots, fewer bytes (issue 57:
    min(W, max_seq_len)); theory uses min(t, W). The dense step grows with t."""
    cfg = tiny(window=64, scan=False)
    steps = {t: costs.analyze_decode_step(cfg, t) for t in (16, 1024, 65536)}
    assert steps[1024].xla.bytes == steps[65536].xla.bytes > steps[16].xla.bytes
    assert steps[16].cache_bytes == theory.kv_cache_bytes(cfg, 16)
    assert steps[1024].xla.flops == steps[65536].xla.flops
    assert steps[1024].theory_bytes == steps[65536].theory_bytes
    assert steps[65536].theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(cfg, 64)
    assert steps[16].theory_parts["bytes"]["kv_read"] == theory.kv_cache_bytes(cfg, 16)
    assert steps[65536].cache_bytes == theory.kv_cache_bytes(cfg, 65536)
    # XLA reads at least the whole ring (and not much more than theory at t >= W)
    kv = theory.kv_cache_bytes(cfg, 64)
    assert steps[1024].xla.bytes >= kv
    assert steps[1024].bytes_ratio < 3
    dense = [costs.analyze_decode_step(tiny(window=None, scan=False), t).xla.bytes
             for t in (64, 1024)]
    assert dense[1] - dense[0] >= kv * (1024 - 64) / 64


# ------------------------------------------------------------------ masks, literally


def test_mask_literal_without_sinks():
    cfg = tiny(window=3)
    got = cache_lib.attention_mask(jnp.arange(6)[None], jnp.arange(6), cfg)[0]
    want = [[1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1]]
    np.testing.assert_array_equal(got, np.array(want, bool))
    np.testing.assert_array_equal(want, reference.band_mask(np.arange(6), np.arange(6), 3))


def test_mask_literal_with_sinks():
    cfg = tiny(window=4, sinks=2)
    got = cache_lib.attention_mask(jnp.arange(7)[None], jnp.arange(7), cfg)[0]
    want = [[1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 1, 0],
            [1, 1, 0, 0, 0, 1, 1]]
    np.testing.assert_array_equal(got, np.array(want, bool))
    np.testing.assert_array_equal(want, reference.band_mask(np.arange(7), np.arange(7), 4, 2))


def test_mask_over_a_wrapped_ring_uses_stored_positions():
    """A ring of 4 slots after 6 tokens holds [4, 5, 2, 3]; a stale or empty (-1) slot or a
    future position is never visible, whatever its slot index."""
    cfg = tiny(window=4)
    ring = jnp.array([4, 5, 2, 3], jnp.int32)
    got = cache_lib.attention_mask(jnp.array([[6, 7]]), ring, cfg)[0]
    np.testing.assert_array_equal(got, [[1, 1, 0, 1], [1, 1, 0, 0]])
    got = cache_lib.attention_mask(jnp.array([[3]]), jnp.array([-1, 4, 2, 3]), cfg)[0]
    np.testing.assert_array_equal(got, [[0, 0, 1, 1]])  # 4 is in the future of 3
    sink = tiny(window=4, sinks=1)  # slot 0 pins position 0; ring of 3: 1 + (p-1) mod 3
    assert cache_lib.slot_of(jnp.arange(8), sink, 4).tolist() == [0, 1, 2, 3, 1, 2, 3, 1]
    got = cache_lib.attention_mask(jnp.array([[8]]), jnp.array([0, 7, 5, 6]), sink)[0]
    np.testing.assert_array_equal(got, [[1, 1, 0, 1]])
    # batch rows may carry their own slot positions ([B, S])
    got = cache_lib.attention_mask(jnp.array([[6], [3]]), jnp.array([[4, 5, 2, 3],
                                                                     [0, 1, 2, 3]]), cfg)
    np.testing.assert_array_equal(got[:, 0], [[1, 1, 0, 1], [1, 1, 1, 1]])


def test_ring_slots_drop_overwritten_chunk_tokens():
    """A chunk longer than the ring writes only its last W - s ring tokens (and any sinks);
    the others get the out-of-range slot S, which a scatter in 'drop' mode ignores."""
    cfg = tiny(window=4, sinks=1)
    slots = cache_lib.ring_slots(jnp.arange(9), cfg, 4)
    assert slots.tolist() == [0, 4, 4, 4, 4, 4, 3, 1, 2]  # positions 0 and 6, 7, 8 kept
    buf = jnp.zeros((1, 1, 4, 1))
    new = jnp.arange(9, dtype=jnp.float32).reshape(1, 1, 9, 1)
    out = cache_lib.write(buf, new, jnp.arange(9), cfg)
    assert out[0, 0, :, 0].tolist() == [0, 7, 8, 6]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("fields, match", [
    (dict(window_size=0), "model.window_size=0"),
    (dict(window_size=-4), "model.window_size=-4"),
    (dict(window_size=4, num_sink_tokens=4), "model.num_sink_tokens=4.*below window_size=4"),
    (dict(window_size=4, num_sink_tokens=9), "model.num_sink_tokens=9"),
    (dict(window_size=None, num_sink_tokens=2), "model.num_sink_tokens=2.*window_size"),
    (dict(window_size=4, num_sink_tokens=-1), "model.num_sink_tokens=-1"),
])
def test_bad_window_config(fields, match):
    base = dict(vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                head_dim=8, mlp_dim=48)
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**base, **fields)


def test_bad_window_override_from_config_file():
    from configs import window
    d = window.get_config()
    d.model.window_size = 0
    with pytest.raises(ConfigError, match="model.window_size=0"):
        run_config_from_dict(d)
    d = window.get_config()
    d.model.num_sink_tokens = 512
    with pytest.raises(ConfigError, match="model.num_sink_tokens=512"):
        run_config_from_dict(d)


# ------------------------------------------------------------------ real model (slow)

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg, a goldsmith from the German city of Mainz, combined several existing "
    "technologies into a single practical system. He used movable metal type, cast from "
    "an alloy of lead, tin and antimony, together with an oil-based ink and a wooden "
    "press adapted from those used to make wine. The result was a machine that could "
    "produce pages far faster than any scribe. Within a few decades, printing shops had "
    "spread to more than two hundred cities across Europe, and millions of books were in "
    "circulation. Scholars could now share ideas quickly, and the cost of books fell so "
    "sharply that ordinary people began to read. Historians often say that the printing "
    "press changed the world because")


@pytest.mark.slow
def test_smollm2_window_generates_past_the_window(smollm2, sinks=4):
    """configs/window.py on the real weights with W=64 and 4 sinks and a ~150-token
    prompt: the decoded text is the greedy continuation of the windowed model itself (the
    cache-free banded forward over prompt + output picks every generated token) and reads
    as English. One real-weights run: the ring without sinks takes the same path, and
    its mechanics against the reference are tested on the tiny models above."""
    from configs import window
    from kvjax.inference import runner

    loaded, _ = smollm2
    d = window.get_config()
    d.model.window_size = 64
    d.model.num_sink_tokens = sinks
    d.prompt = LONG_PROMPT
    d.chat_template = False  # raw continuation of the text
    d.max_new_tokens = 3 * 64 + 8  # the ring wraps three more times while generating
    d.stop_at_eos = False
    run = run_config_from_dict(d)
    cfg = run.model
    ids = loaded.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 2 * cfg.window_size
    params = model.params_for(cfg, loaded.params)
    # the generation alone: the cost report is tested on tiny windowed models
    result = runner.generate(run, runner.LoadedModel(cfg, params, loaded.tokenizer))
    assert result.new_tokens == run.max_new_tokens
    assert result.kv_cache_bytes == result.kv_cache_bytes_theory == 30 * 3 * 128 * 4 * 64
    seq = ids + result.generated_ids
    logits, _ = model.forward(params, cfg, jnp.asarray(seq)[None],
                              jnp.arange(len(seq), dtype=jnp.int32)[None])
    greedy = np.asarray(jnp.argmax(logits[0], -1))
    np.testing.assert_array_equal(greedy[len(ids) - 1:-1], result.generated_ids)
    text = result.generated_text
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)
    assert len(set(text.split())) > 10
