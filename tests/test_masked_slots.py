"""Issue 32 item 1: a NaN or inf in a masked cache slot contributes exactly nothing.

A cache whose never-written slots (position -1) hold NaN or +inf, in every tensor (keys,
values, quantized codes and scales, MLA latents and rotary keys), must give the same
logits as the same cache holding zeros there: the native decode and prompt kernels (when
they load), int8 / fp8 / int4 caches, MLA and GQA chunks that read the cache (dense,
tiled, native) and a ring cache before it wraps. A masked score is selected away
already; the fault was the value product, where a weight of 0 times a NaN value is NaN.

The float decode step under the XLA formulations (GQA, MLA) and the small-chunk
formulation (a verify step) do not zero masked values themselves: a select there costs a
copy of the value cache every step (XLA:CPU does not fuse it into its dot;
docs/results/amd-epyc-avx512-2core.md). The programs that run them clear the never-written
slots once on entry (``model.clear_masked_slots``); those are tested through the programs,
the rest through ``model.forward`` directly. A paged cache zeroes its gathered view.

The reference is the same computation on the clean cache, so the logits must be equal
bit for bit (the masked slots are skipped or zeroed either way).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import native, planner
from kvjax.config import SamplingConfig
from kvjax.inference import decode, ragged
from kvjax.models import attention, model
from tests.conftest import tiny_config, tiny_mla_config, tiny_ring_config

MAX_LEN = 20  # S differs from every other dimension of the tiny caches
PROMPT = 5
LONG = (17, 18)  # chunks longer than attention.SMALL_CHUNK: the prompt paths
assert min(LONG) > attention.SMALL_CHUNK
LONG_LEN = 41

_forward = jax.jit(model.forward, static_argnames=("cfg",))


def _poison(cache: cache_lib.KVCache, value: float) -> cache_lib.KVCache:
    """``cache`` with ``value`` written into every never-written slot (position -1) of
    every tensor; integer codes (int8, int4) cannot hold it and keep theirs."""
    empty = np.asarray(cache.positions) < 0  # [B, S]

    def fill(x, batch_axis):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        x = np.asarray(x)
        s_axis = next(a for a in range(x.ndim - 1, batch_axis, -1)
                      if x.shape[a] == empty.shape[1])
        shape = [1] * x.ndim
        shape[batch_axis], shape[s_axis] = empty.shape
        bad = np.broadcast_to(empty.reshape(shape), x.shape)
        out = x.astype(np.float32)
        out[bad] = value
        return jnp.asarray(out.astype(x.dtype))

    def layer(x, batch_axis):
        return tuple(fill(t, 0) for t in x) if isinstance(x, tuple) else fill(x, batch_axis)

    return cache.replace(tensors={n: layer(x, 1) for n, x in cache.tensors.items()})


def _slot_axes_ok(cfg, cache):
    """The slot axis _poison finds is the cache's: S differs from every other dim here."""
    s = cache.num_slots
    for n, x in cache.tensors.items():
        x = x[0] if isinstance(x, tuple) else x
        assert list(x.shape).count(s) == 1, (n, x.shape)


def _run(cfg, params, cache, tokens, chunks):
    """Logits of ``tokens`` fed in ``chunks`` (lengths) after the cache's own tokens."""
    out, start = [], int(cache.length[0])
    b = tokens.shape[0]
    for n in chunks:
        pos = jnp.broadcast_to(jnp.arange(start, start + n, dtype=jnp.int32), (b, n))
        lg, cache = _forward(params, cfg, tokens[:, start - PROMPT:start - PROMPT + n], pos,
                             cache)
        out.append(np.asarray(lg))
        start += n
    return np.concatenate(out, axis=1)


def _check(cfg, chunks=(1, 1), batch=2, max_len=MAX_LEN, values=(np.nan, np.inf)):
    """Prefill PROMPT tokens, then feed ``chunks`` on the clean cache and on the same
    cache poisoned in its never-written slots: equal logits, all finite. ``cfg`` is
    narrowed to one layer (compile time)."""
    cfg = cfg.replace(num_layers=1)
    params = model.init_params(cfg, 0)
    toks = jax.random.randint(jax.random.key(3), (batch, PROMPT + sum(chunks)), 0,
                              cfg.vocab_size)
    cache = cache_lib.init_cache(cfg, batch, max_len)
    _slot_axes_ok(cfg, cache)
    pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (batch, PROMPT))
    _, cache = _forward(params, cfg, toks[:, :PROMPT], pos, cache)
    assert (np.asarray(cache.positions) < 0).any()  # there are never-written slots
    want = _run(cfg, params, cache, toks[:, PROMPT:], chunks)
    assert np.isfinite(want).all()
    for value in values:
        got = _run(cfg, params, _poison(cache, value), toks[:, PROMPT:], chunks)
        np.testing.assert_array_equal(got, want, err_msg=f"masked slots hold {value}")


needs_native = pytest.mark.skipif(not native.load(), reason="native kernel not built")


def _copy(cache):
    return jax.tree.map(jnp.copy, cache)


def _check_programs(cfg, chunks=(1, 3), batch=2, max_len=MAX_LEN, steps=4):
    """The float decode step under XLA does not zero masked values itself (a copy of
    the value cache per step); the programs that run it clear the never-written slots
    once on entry (model.clear_masked_slots). Through those programs, a cache poisoned
    in its never-written slots gives the clean cache's logits and tokens: chunks of
    ``chunks`` tokens through ``decode.prefill_program`` (1: the decode step; 3: the
    small-chunk formulation), then ``steps`` greedy tokens through
    ``decode.generate_program`` and ``ragged.generate_ragged_program``, each given a
    cache poisoned again."""
    cfg = cfg.replace(num_layers=1)
    params = model.init_params(cfg, 0)
    toks = jax.random.randint(jax.random.key(3), (batch, PROMPT + sum(chunks)), 0,
                              cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (batch, PROMPT))
    eos = decode.eos_array(())
    sampling = SamplingConfig()

    def run(ragged_cache, value):
        cache = cache_lib.init_cache(cfg, batch, max_len, ragged=ragged_cache)
        _, cache = _forward(params, cfg, toks[:, :PROMPT], pos, cache)
        poison = (lambda c: c) if value is None else (lambda c: _poison(c, value))
        logits, start = [], PROMPT
        for n in chunks:
            lg, cache = decode.prefill_program(params, toks[:, start:start + n],
                                               poison(cache), cfg=cfg)
            logits.append(np.asarray(lg))
            start += n
        first = jnp.argmax(lg, -1).astype(jnp.int32)
        if ragged_cache:
            buf, _, _ = ragged.generate_ragged_program(
                params, first, poison(cache), jnp.full((batch,), steps, jnp.int32),
                ragged.row_keys_for(None, batch), eos, cfg=cfg, sampling=sampling,
                buf_len=steps)
        else:
            buf, _, _ = decode.generate_program(
                params, first, poison(cache), jnp.int32(steps), jax.random.key(0), eos,
                cfg=cfg, sampling=sampling, buf_len=steps)
        return np.stack(logits), np.asarray(buf)

    for ragged_cache in (False, True):
        want_logits, want_tokens = run(ragged_cache, None)
        assert np.isfinite(want_logits).all() and (want_tokens >= 0).all()
        for value in (np.nan, np.inf):
            got_logits, got_tokens = run(ragged_cache, value)
            np.testing.assert_array_equal(got_logits, want_logits,
                                          err_msg=f"masked slots hold {value}")
            np.testing.assert_array_equal(got_tokens, want_tokens)


@pytest.mark.parametrize("impl,layout", [("xla", "BKSH"), ("xla_cache_left", "BKHS")])
def test_xla_decode_step_programs(impl, layout):
    cfg = tiny_config(decode_attention=impl, key_layout=layout, value_layout=layout)
    _check_programs(cfg)


def test_mla_float_decode_step_programs():
    _check_programs(tiny_mla_config())


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_clear_only_where_the_step_needs_it(kv_dtype):
    """clear_masked_slots zeroes exactly the never-written slots of a float XLA cache
    (every other value kept), and is the identity where the step ignores masked
    values itself (a quantized cache; the native kernel) or for a prompt-length chunk."""
    cfg = tiny_config(num_layers=1, decode_attention="xla", kv_dtype=kv_dtype)
    cache = cache_lib.init_cache(cfg, 2, MAX_LEN)
    cache = cache.replace(positions=cache.positions.at[0, :3].set(jnp.arange(3)),
                          length=jnp.array([3, 0], jnp.int32))
    cache = _poison(cache.replace(tensors={n: jax.tree.map(lambda x: x + 1, t)
                                           for n, t in cache.tensors.items()}), np.nan)
    if kv_dtype is not None:
        assert model.step_ignores_masked_values(cfg, cache)
        assert model.clear_masked_slots(cfg, cache) is cache
        return
    assert not model.step_ignores_masked_values(cfg, cache)
    assert model.clear_masked_slots(cfg, cache, chunk=17) is cache  # the prompt paths
    v = np.asarray(model.clear_masked_slots(cfg, cache).tensors["v"][0])  # [B, K, S, H]
    np.testing.assert_array_equal(v[0, :, :3], 1.0)  # written slots kept
    np.testing.assert_array_equal(v[0, :, 3:], 0.0)
    np.testing.assert_array_equal(v[1], 0.0)
    if native.load():
        ncfg = planner.resolve(cfg.replace(decode_attention="native"), max_seq_len=MAX_LEN,
                               batch_sizes=(2,))
        assert model.clear_masked_slots(ncfg, cache) is cache


def test_paged_view_is_zero_where_no_row_wrote():
    """A paged cache's gathered view: pages reused from finished requests (here NaN
    everywhere) and page 0 read for a missing page show 0 at every slot the row has not
    written, their own values elsewhere."""
    from kvjax.cache import paged  # noqa: PLC0415
    cfg = tiny_config(num_layers=1)
    cache = paged.init_paged_cache(cfg, batch_size=2, num_pages=4, page_size=4,
                                   max_pages=3)
    cache = cache.replace(
        tensors={n: tuple(jnp.full_like(x, np.nan) for x in t)
                 for n, t in cache.tensors.items()},
        block_table=jnp.array([[2, 0, -1], [1, -1, -1]], jnp.int32),
        length=jnp.array([6, 0], jnp.int32))
    view = cache.layer(0)
    seen = np.asarray(cache.positions) >= 0  # row 0: slots 0..5
    assert seen.sum() == 6
    for name, x in view.items():
        x = np.moveaxis(np.asarray(x), dict(cache.axes)[name], -1)  # [B, K, H, M·P]
        assert np.isnan(x[0][..., seen[0]]).all()
        np.testing.assert_array_equal(x[0][..., ~seen[0]], 0.0)
        np.testing.assert_array_equal(x[1], 0.0)


@needs_native
@pytest.mark.parametrize("k_layout,v_layout", [("BKSH", "BKSH"), ("BKHS", "BKSH"),
                                              ("BKHS", "BKHS")])
def test_native_decode_kernel(k_layout, v_layout):
    """Keys 'BKSH': the kernel's generic loops; keys 'BKHS' (head_dim 16, a multiple of
    the vector width): its vector path, values in either layout."""
    cfg = tiny_config(decode_attention="native", head_dim=16, key_layout=k_layout,
                      value_layout=v_layout)
    cfg = planner.resolve(cfg, max_seq_len=MAX_LEN, batch_sizes=(2,))
    assert "decode_attention" in cfg.plan.native
    _check(cfg)


@pytest.mark.parametrize("kv_dtype,chunks", [("int8", (1, 3)), ("float8_e4m3fn", (1, 1)),
                                             ("int4", (1, 1))])
def test_quantized_cache_codes_and_scales(kv_dtype, chunks):
    """NaN / inf scales (and fp8 codes, which can hold them): the 1-byte step with its
    scales outside the dots, int4's dequantize-first step, and a chunk."""
    _check(tiny_config(kv_dtype=kv_dtype, decode_attention="xla"), chunks=chunks)


@pytest.mark.parametrize("absorb,prefill_impl", [(True, "tiled"), (False, "dense")])
def test_mla_latents_in_chunks(absorb, prefill_impl):
    _check(tiny_mla_config(mla_absorb=absorb, prefill_impl=prefill_impl), chunks=(3, 2))


def test_mla_dequantized_latents_in_a_decode_step():
    _check(tiny_mla_config(kv_dtype="int8"), chunks=(1, 1))


@pytest.mark.parametrize("prefill_impl", ["tiled", "dense"])
def test_chunk_reading_the_cache(prefill_impl):
    """Prompt-length chunks (longer than attention.SMALL_CHUNK) zero masked values on
    the prompt paths themselves, whatever program runs them."""
    _check(tiny_config(prefill_impl=prefill_impl), chunks=LONG, max_len=LONG_LEN)


def test_small_chunk_reading_the_cache_natively():
    """A small chunk (a verify step) by the native decode kernel skips masked slots."""
    if not native.load():
        pytest.skip("native kernel not built")
    cfg = planner.resolve(tiny_config(decode_attention="native", head_dim=16),
                          max_seq_len=MAX_LEN, batch_sizes=(2,))
    _check(cfg, chunks=(3, 4))


@needs_native
def test_native_prompt_kernel_chunk_reading_the_cache():
    cfg = planner.resolve(tiny_config(prefill_impl="native"), max_seq_len=LONG_LEN,
                          batch_sizes=(2,), rows=tuple(2 * n for n in LONG))
    _check(cfg, chunks=LONG, max_len=LONG_LEN)


def test_ring_cache_before_it_wraps():
    """A ring of 12 slots (2 sinks) holding 5 tokens: 7 never-written slots, then chunks
    while some stay empty."""
    _check(tiny_ring_config(12, 2), chunks=(2, 3), max_len=32)


@needs_native
def test_ring_cache_native_decode_steps():
    cfg = planner.resolve(tiny_ring_config(12, 2, decode_attention="native", head_dim=16),
                          max_seq_len=32, batch_sizes=(2,))
    assert "decode_attention" in cfg.plan.native
    _check(cfg, chunks=(1, 1), max_len=32)


def test_zero_unseen_keeps_seen_slots_and_integer_codes():
    from kvjax import ops
    x = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) + 1
    seen = jnp.array([[True, False, True], [False, False, True]])
    got = np.asarray(ops.zero_unseen(x, seen, -2))
    np.testing.assert_array_equal(got, np.where(np.asarray(seen)[..., None], x, 0))
    codes = jnp.ones((2, 3, 4), jnp.int8)
    assert ops.zero_unseen(codes, seen, -2) is codes
