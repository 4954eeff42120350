"""Quantized KV caches (kvjax.cache.quant): formats against a numpy reference with each
format's error bound, attention over the quantized cache against float32 attention over
the dequantized values, dtypes that stay quantized, bytes = theory, and bad input."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import config as config_lib
from kvjax.analysis import theory
from kvjax.cache import quant
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import decode
from kvjax.models import model

QUANTIZED = ("int8", "float8_e4m3fn", "float8_e5m2", "int4")


def tiny(**kw) -> ModelConfig:
    fields = dict(vocab_size=61, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                  head_dim=8, mlp_dim=48, tie_embeddings=False, scan_layers=False,
                  name="tiny")
    fields.update(kw)
    return ModelConfig(**fields)


def tiny_mla(**kw) -> ModelConfig:
    return tiny(**{**dict(d_model=64, num_heads=4, num_kv_heads=4, head_dim=24,
                          mlp_dim=96, attention="mla", kv_lora_rank=16, qk_rope_head_dim=8,
                          qk_nope_head_dim=16, v_head_dim=16), **kw})


# ------------------------------------------------------------------ numpy reference


def np_quantize(x: np.ndarray, name: str):
    """Independent numpy reference along the last axis: (dequantized values, scales)."""
    x = x.astype(np.float32)
    width = x.shape[-1]
    g = int(np.gcd(width, 32)) if name == "int4" else width
    xg = x.reshape(x.shape[:-1] + (width // g, g))
    qmax = {"int8": 127.0, "int4": 7.0,
            "float8_e4m3fn": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
            "float8_e5m2": float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}[name]
    amax = np.abs(xg).max(-1, keepdims=True)
    s = np.where(amax > 0, np.maximum(amax / np.float32(qmax), np.finfo(np.float32).tiny),
                 1).astype(np.float32)
    y = xg / s
    if name.startswith("float8"):
        q = np.clip(y, -qmax, qmax).astype(getattr(ml_dtypes, name)).astype(np.float32)
    else:
        q = np.clip(np.round(y), -qmax, qmax)
    return (q * s).reshape(x.shape), s[..., 0]


def error_bound(x: np.ndarray, s: np.ndarray, name: str) -> np.ndarray:
    """Per-element bound of one round trip (module docstring of kvjax.cache.quant)."""
    width = x.shape[-1]
    g = width // s.shape[-1]
    s_full = np.repeat(s, g, axis=-1)
    if name in ("int8", "int4"):
        bound = s_full / 2
    else:
        m, e_min = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}[name]
        bound = np.maximum(2.0 ** -m * np.abs(x), s_full * 2.0 ** (e_min - m - 1))
    return bound * (1 + 1e-6) + 1e-30


@pytest.mark.parametrize("name", QUANTIZED)
def test_round_trip_matches_numpy_within_the_formats_bound(name):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 64)).astype(np.float32) * \
        rng.uniform(0.01, 30, (2, 3, 5, 1)).astype(np.float32)
    x[0, 0, 0] = 0.0  # an all-zero row: scale 1, codes 0, exact
    fmt = quant.FORMATS[name]
    codes, scale = quant.quantize(jnp.asarray(x), fmt, axis=-1)
    assert codes.dtype == fmt.storage and scale.dtype == jnp.float32
    assert codes.shape == (2, 3, 5, 32 if name == "int4" else 64)
    assert scale.shape == (2, 3, 5, 2 if name == "int4" else 1)
    got = np.asarray(quant.dequantize(codes, scale, fmt, axis=-1))
    ref, s_ref = np_quantize(x, name)
    np.testing.assert_allclose(np.asarray(scale), s_ref, rtol=3e-7)  # XLA: x·(1/q)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=0)
    assert np.all(np.abs(got - x) <= error_bound(x, s_ref, name))
    assert np.all(got[0, 0, 0] == 0)
    assert not np.array_equal(got, x)  # really rounded
    # the channel axis may be -2 (the 'BKHS' layout): the same values, transposed
    c2, s2 = quant.quantize(jnp.swapaxes(jnp.asarray(x), -1, -2), fmt, axis=-2)
    back = quant.dequantize(c2, s2, fmt, axis=-2)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(back), -1, -2), got)


TINY32 = float(np.finfo(np.float32).tiny)  # 2^-126


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("layout", ["BKSH", "BKHS"])
def test_tiny_zero_and_normal_rows_round_trip_finite_within_the_bound(name, layout):
    """Rows whose max|x| / qmax is subnormal float32 used to get scale 0 on XLA:CPU: fp8
    rows at 1e-37 / 5e-36 came back NaN and int8 rows at 1e-37 as zeros. Every row now
    round-trips finite, within its format's bound with s = max(max|x| / qmax, 2^-126) and
    no absolute slack; entries that are themselves subnormal may read as 0 (+ 2^-126)."""
    rng = np.random.default_rng(1)
    amaxes = [1e-37, 5e-36, 2e-38, 1.5e-36, 1e-33, 1e-30, 0.0, 1e-3, 1.0, 30.0, 1e37]
    x = rng.uniform(-1, 1, (len(amaxes), 64)).astype(np.float32)
    x[:, 7] = 1.0  # the row's max is exactly its amax
    x = (x * np.asarray(amaxes, np.float32)[:, None]).astype(np.float32)
    subnormal = (x != 0) & (np.abs(x) < TINY32)
    assert subnormal.any() and (np.abs(x[:2]) >= TINY32).sum() > 100
    cfg = tiny(kv_dtype=name, key_layout=layout, value_layout=layout)
    fmt = quant.FORMATS[name]
    # through the cache's one way in and out: 'k' [B, K, T, H] or [B, K, H, T]
    k = jnp.asarray(x.reshape(1, 1, len(amaxes), 64))
    if layout == "BKHS":
        k = jnp.swapaxes(k, -1, -2)
    enc = cache_lib.encode(cfg, {"k": k})
    got = np.asarray(cache_lib.read(cfg, enc, "k"), np.float32)
    if layout == "BKHS":
        got = np.swapaxes(got, -1, -2)
    got = got.reshape(x.shape)
    assert np.isfinite(got).all(), got[~np.isfinite(got).all(-1)]
    assert np.all(got[amaxes.index(0.0)] == 0)
    g = fmt.group(64)
    amax = np.abs(x.reshape(len(amaxes), 64 // g, g)).max(-1)
    s = np.where(amax > 0, np.maximum(amax / np.float32(fmt.qmax), TINY32), 1.0)
    scale = np.asarray(enc["k_scale"])
    scale = (np.swapaxes(scale, -1, -2) if layout == "BKHS" else scale).reshape(s.shape)
    np.testing.assert_allclose(scale, s, rtol=3e-7)
    assert (scale >= TINY32).all()
    s_full = np.repeat(s, g, axis=-1)
    if fmt.kind == "int":
        bound = s_full / 2
    else:
        m, e_min = {"float8_e4m3fn": (3, -6), "float8_e5m2": (2, -14)}[name]
        bound = np.maximum(2.0 ** -m * np.abs(x), s_full * 2.0 ** (e_min - m - 1))
    bound = bound * (1 + 1e-6) + np.where(subnormal, TINY32, 0.0)
    err = np.abs(got.astype(np.float64) - x)
    assert np.all(err <= bound), (amaxes, (err / bound).max(-1))
    # the tiny rows keep their largest entries: not flushed to zeros
    for i in (0, 1):
        assert got[i, 7] == pytest.approx(amaxes[i], rel=0.07), (amaxes[i], got[i, 7])


def test_int4_packs_two_codes_per_byte_low_nibble_first():
    x = jnp.asarray([[7.0, -7.0, 0.0, 1.0, 3.0, -2.0, 4.0, 5.0]])  # one group, scale 1
    codes, scale = quant.quantize(x, quant.FORMATS["int4"])
    assert scale.tolist() == [[1.0]] and codes.dtype == jnp.uint8
    # code + 8: (15, 1) -> 0x1F, (8, 9) -> 0x98, (11, 6) -> 0x6B, (12, 13) -> 0xDC
    assert codes.tolist() == [[0x1F, 0x98, 0x6B, 0xDC]]
    np.testing.assert_array_equal(quant.dequantize(codes, scale, quant.FORMATS["int4"]), x)


# ------------------------------------------------------------------ through the model


def _fake_quant_encode(qcfg, real_encode):
    """encode for a float32 config that stores quantize -> dequantize of ``qcfg``: a float32
    cache holding exactly the dequantized values."""
    def encode(cfg, new):
        if cfg.kv_quantized:
            return real_encode(cfg, new)
        enc = real_encode(qcfg, new)
        return {n: cache_lib.read(qcfg, enc, n) for n in new}
    return encode


_forward = jax.jit(model.forward, static_argnums=1)  # (params, cfg, tokens, positions, cache)


def _decode(cfg, raw, tokens, steps, max_len=24):
    """(prefill logits, greedy tokens, [steps] logits of single-token steps, cache)."""
    params = model.params_for(cfg, raw)
    logits, cache = decode.prefill(params, cfg, tokens, cache_lib.init_cache(cfg, 1, max_len))
    last, toks, step_logits = jnp.argmax(logits, -1), [], []
    for _ in range(steps):  # the T = 1 path (attend_step), greedy
        out, cache = _forward(params, cfg, last[:, None], cache.length[:, None], cache)
        last = jnp.argmax(out[:, -1], -1)
        toks.append(last)
        step_logits.append(out)
    return logits, jnp.stack(toks), jnp.stack(step_logits), cache


@pytest.mark.parametrize("name,extra", [
    ("int8", {}),
    ("int8", dict(key_layout="BKHS", value_layout="BKHS", scan_layers=True)),
    ("float8_e4m3fn", {}),
    ("int4", dict(key_layout="BKHS")),
    ("int8", dict(window_size=6, num_sink_tokens=2)),  # a ring that wraps, with sinks
    ("int4", dict(window_size=5)),
    ("int8", "mla"), ("float8_e5m2", "mla_naive"),
])
def test_attention_over_quantized_cache_equals_float32_over_dequantized(
        name, extra, monkeypatch):
    if extra in ("mla", "mla_naive"):
        ref = tiny_mla(mla_absorb=extra == "mla")
    else:
        ref = tiny(**extra)
    # a name of its own: jit caches compile per config, and this one's encode is patched
    ref = ref.replace(name=f"fake-quant-{name}")
    qcfg = ref.replace(kv_dtype=name, name="tiny")
    raw = model.init_params(ref.replace(scan_layers=False), 0)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2]], jnp.int32)
    q_logits, q_toks, q_steps, q_cache = _decode(qcfg, raw, tokens, 8)
    monkeypatch.setattr(cache_lib, "encode", _fake_quant_encode(qcfg, cache_lib.encode))
    f_logits, f_toks, f_steps, f_cache = _decode(ref, raw, tokens, 8)
    np.testing.assert_allclose(q_logits, f_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(q_steps, f_steps, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(q_toks, f_toks)
    # the float32 cache holds exactly the quantized cache's values
    for n in f_cache.tensors:
        deq = [cache_lib.read(qcfg, {m: t[i] for m, t in q_cache.tensors.items()}, n)
               for i in range(ref.num_layers)]
        want = [f_cache.tensors[n][i] for i in range(ref.num_layers)]
        np.testing.assert_allclose(np.stack(deq), np.stack(want), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", QUANTIZED)
def test_cache_stays_quantized_after_prefill_and_100_steps_and_bytes_equal_theory(name):
    cfg = tiny(kv_dtype=name)
    assert cfg.kv_quantized
    raw = model.init_params(tiny(), 0)
    params = model.params_for(cfg, raw)
    logits, cache = decode.prefill(params, cfg, jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32),
                                   cache_lib.init_cache(cfg, 1, 120))
    _, _, cache = decode.generate(params, cfg, jnp.argmax(logits, -1), cache, 100)
    storage = config_lib.KV_STORAGE[name]
    for n, t in cache.tensors.items():
        want = jnp.float32 if n.endswith("_scale") else storage
        assert all(x.dtype == want for x in jax.tree.leaves(t)), (n, want)
    assert set(cache.tensors) == {"k", "k_scale", "v", "v_scale"}
    assert np.isfinite(np.asarray(logits)).all() and int(cache.length[0]) == 105
    assert cache_lib.cache_bytes(cache) == theory.kv_bytes_per_token(cfg) * 120
    per_row = {"int4": 8 // 2 + 4}.get(name, 8 + 4)  # H=8: codes + one float32 scale
    assert theory.kv_bytes_per_token(cfg) == 2 * 2 * 2 * per_row


@pytest.mark.parametrize("name", QUANTIZED)
def test_mla_and_smollm2_bytes_per_token_equal_theory(name):
    mla = tiny_mla(kv_dtype=name)
    cache = cache_lib.cache_spec(mla, 2, 10)
    assert cache_lib.cache_bytes(cache) == theory.kv_bytes_per_token(mla) * 2 * 10
    assert set(cache.tensors) == {"c_kv", "c_kv_scale", "k_rope", "k_rope_scale"}
    # SmolLM2-135M: L=30, K=3, H=64 -> 30·2·3 rows per token
    smol = ModelConfig(vocab_size=49152, num_layers=30, d_model=576, num_heads=9,
                       num_kv_heads=3, head_dim=64, mlp_dim=1536, kv_dtype=name)
    want = {"int4": 30 * 6 * (32 + 2 * 4)}.get(name, 30 * 6 * (64 + 4))
    assert theory.kv_bytes_per_token(smol) == want  # int8 12,240 B vs float32 46,080 B
    spec = cache_lib.cache_spec(smol, 1, 7)
    assert cache_lib.cache_bytes(spec) == want * 7
    assert theory.kv_scale_bytes_per_token(smol) == {"int4": 1440}.get(name, 720)


# ------------------------------------------------------------------ bad input


def test_bad_kv_dtypes_name_the_value_and_what_is_allowed(monkeypatch):
    with pytest.raises(ConfigError, match=r"model.kv_dtype='int2'.*'int8', 'int4'"):
        tiny(kv_dtype="int2")
    with pytest.raises(ConfigError, match=r"kv_dtype='int4' with model.head_dim=7; "
                                          r"allowed: an even head_dim"):
        tiny(kv_dtype="int4", head_dim=7)
    with pytest.raises(ConfigError, match="model.qk_rope_head_dim=5"):
        tiny_mla(kv_dtype="int4", qk_rope_head_dim=5)
    # fp8 on a backend that cannot convert it: refused when the cache is built
    monkeypatch.setattr(quant, "_converts_on", lambda backend, name: False)
    cfg = tiny(kv_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"kv_dtype='float8_e4m3fn' is not supported on "
                                         r"backend 'cpu'.*allowed here"):
        cache_lib.init_cache(cfg, 1, 8)
    cache_lib.init_cache(tiny(kv_dtype="int8"), 1, 8)  # integer formats need no probe


# ------------------------------------------------------------------ the cost report


@pytest.mark.parametrize("name,scan", [("int8", True), ("int4", False)])
def test_attribution_names_the_scale_bytes_and_they_equal_theory(name, scan):
    """The XLA attribution of a decode step over a full cache splits KV bytes by cache
    tensor: the scale tensors are rows of their own ('k_scale', 'v_scale'), and their read
    and write bytes equal theory's (B·t·scale bytes per token; B·scale bytes per token)."""
    from kvjax.analysis import costs, report  # noqa: PLC0415

    cfg = tiny(kv_dtype=name, scan_layers=scan)
    batch, t = 2, 64
    step = costs.analyze_decode_step(cfg, t, batch=batch, jaxpr=False)
    kv = step.attribution.kv_tensors
    assert set(kv) == {"k", "v", "k_scale", "v_scale"}
    per_token = theory.kv_tensor_bytes_per_token(cfg)
    # int8: L·K·1·4 = 16 B per token per scale tensor; int4 (H=8: one group): the same
    assert per_token["k_scale"] == per_token["v_scale"] == 2 * 2 * 4
    for n in ("k_scale", "v_scale"):
        assert kv[n]["write"] == batch * per_token[n]
    assert kv["v_scale"]["read"] == batch * t * per_token["v_scale"]
    if name == "int4":  # dequantized before the dots: each scale read once
        assert kv["k_scale"]["read"] == batch * t * per_token["k_scale"]
    else:  # scales outside the dots: XLA fuses scores · k_scale into the max and exp passes
        assert kv["k_scale"]["read"] in (batch * t * per_token["k_scale"],
                                         2 * batch * t * per_token["k_scale"])
    # the per-tensor rows add up to the kv_read / kv_write parts
    assert sum(v["read"] for v in kv.values()) == step.attribution.bytes["kv_read"]
    assert sum(v["write"] for v in kv.values()) == step.attribution.bytes["kv_write"]
    text = report.attribution_table(step)
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.strip().startswith(("k_scale", "v_scale"))}
    assert set(rows) == {"k_scale", "v_scale"}
    assert rows["v_scale"][1] == rows["v_scale"][2] == f"{batch * t * per_token['v_scale']:,}"


def test_tensor_bytes_per_token_sum_to_kv_bytes_per_token():
    for kd in (None,) + config_lib.KV_DTYPES:
        for cfg in (tiny(kv_dtype=kd), tiny_mla(kv_dtype=kd)):
            per = theory.kv_tensor_bytes_per_token(cfg)
            assert sum(per.values()) == theory.kv_bytes_per_token(cfg), (kd, per)
            # and equal the allocated cache's tensors, name by name
            cache = cache_lib.init_cache(cfg, 1, 4)
            for n, x in cache.tensors.items():
                leaves = x if isinstance(x, tuple) else (x,)
                assert sum(a.nbytes for a in leaves) == 4 * per[n], (kd, n)


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("k_layout,v_layout", [("BKSH", "BKSH"), ("BKHS", "BKSH")])
def test_scales_outside_the_dots_equal_attention_over_dequantized_values(
        name, k_layout, v_layout):
    """attend_step over codes with per-slot scales applied outside the H contraction
    equals attend_step over the dequantized cache up to float32 rounding (1e-6)."""
    from kvjax.models import attention  # noqa: PLC0415

    fmt = quant.FORMATS[name]
    rng = np.random.default_rng(0)
    b, k, g, h, s = 2, 2, 3, 16, 40
    q = jnp.asarray(rng.standard_normal((b, 1, k, g, h)), jnp.float32)
    kf = jnp.asarray(3 * rng.standard_normal((b, k, s, h)), jnp.float32)
    vf = jnp.asarray(rng.standard_normal((b, k, s, h)), jnp.float32)
    if k_layout == "BKHS":
        kf = jnp.swapaxes(kf, -1, -2)
    k_axis = -2 if k_layout == "BKHS" else -1
    kq, ks = quant.quantize(kf, fmt, k_axis)
    vq, vs = quant.quantize(vf, fmt, -1)
    k_deq = quant.dequantize(kq, ks, fmt, k_axis)
    v_deq = quant.dequantize(vq, vs, fmt, -1)
    mask = jnp.asarray(rng.random((b, 1, s)) < 0.7)
    k_new = jnp.asarray(rng.standard_normal(
        (b, k, h, 1) if k_layout == "BKHS" else (b, k, 1, h)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((b, k, 1, h)), jnp.float32)
    want = attention.attend_step(q, k_deq, v_deq, mask, k_new, v_new, k_layout, v_layout)
    got = attention.attend_step(q, kq, vq, mask, k_new, v_new, k_layout, v_layout,
                                k_scale=jnp.squeeze(ks, k_axis), v_scale=vs[..., 0])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="impl='xla'"):
        attention.attend_step(q, kq, vq, mask, k_new, v_new, k_layout, v_layout,
                              impl="native", k_scale=ks, v_scale=vs)
