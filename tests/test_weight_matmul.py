"""Few-row weight products (issue 18): the native kernel equals a float64 product for
both weight layouts and any row count; a whole model decodes the same logits with
``model.weight_matmul`` 'xla' and 'native'; the planner's weight cache is keyed per
machine and kernel, and never trusts a corrupt or foreign file."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import kernels, planner, presets
from kvjax.config import ConfigError
from kvjax.models import model, weight_matmul
from kvjax.native import rows_matmul as rm
from kvjax import plan as plan_lib
from kvjax.plan import Plan, weight_class
from tests.conftest import tiny_config, tiny_mla_config

needs_native = pytest.mark.skipif(not rm.load(), reason="native kernel not built (no compiler)")
NATIVE = Plan(native=("rows_matmul",))  # a plan holding the loaded kernel, no picks


def _runs(impl, m, k, n, layout="kn"):
    """What a traced product of M rows x [K, N] runs for model.weight_matmul=impl: the
    plan planner.resolve would make for it (the kernel if it loads; for 'auto' the
    class's pick, measured or read from the planner cache), read by the registry's rule."""
    loaded = rm.load()
    picks = ()
    if impl == "auto" and loaded and 0 < m <= rm.MAX_ROWS:
        picks = ((weight_class(m, k, n, layout), planner._weight_pick(m, k, n, layout)),)
    plan = Plan(weight_matmul=picks, native=("rows_matmul",) if loaded else ())
    return _choose(impl, m, k, n, layout, plan)


def _choose(impl, m, k, n, layout, plan):
    """The formulation of one float32 product read from ``plan`` (None: no plan) by the
    registry's rule, as weight_matmul.einsum picks it."""
    where = weight_matmul.site(m, k, n, layout, "float32", plan)
    return kernels.select("weight_matmul", impl, where, plan.pick(where) if plan else None)


def _resolved(cfg, batch, rows):
    return planner.resolve(cfg, max_seq_len=16, batch_sizes=(batch,), rows=rows)


@needs_native
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 16])
@pytest.mark.parametrize("k,n", [(576, 192), (37, 70), (1, 200)])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_native_equals_float64_product(m, k, n, layout):
    """Row tiles of every size the kernel dispatches (1..6 and tails), column panels with
    a ragged last panel (200, 70), K not a multiple of the vector width (37, 1); against
    [N, K] with K = 576, up to 4 rows read each weight row once (RowDotsNK, 1..4 rows)."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    wl = w if layout == "kn" else np.ascontiguousarray(w.T)
    y = np.asarray(jax.jit(lambda a, b: rm.rows_matmul(a, b, layout))(x, wl))
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (m, n) and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.sqrt(k) * np.abs(ref).max(), rtol=0)


@needs_native
def test_native_splits_large_weights_over_threads(monkeypatch):
    """A weight above the threading threshold (K·N >= 64K) split into parts."""
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", "3")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 300), dtype=np.float32)
    w = rng.standard_normal((300, 1000), dtype=np.float32)
    for layout, wl in (("kn", w), ("nk", np.ascontiguousarray(w.T))):
        y = np.asarray(jax.jit(lambda a, b, lay=layout: rm.rows_matmul(a, b, lay))(x, wl))
        np.testing.assert_allclose(y, x.astype(np.float64) @ w, atol=1e-3, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("k,n", [(300, 1000), (200, 70), (64, 4096), (130, 4100),
                                 (1030, 2100), (576, 3072), (200, 2049)])
def test_one_row_walk_splits_k_over_threads(monkeypatch, threads, k, n):
    """One row against a [K, N] weight: K split into one contiguous range of >= 64 rows
    per thread, partial rows added by the caller (N with a tail under a vector: 70, 1000,
    2049, 2100; N = 4096 the widest walked; 4100 keeps the column panels; SmolLM2's fused
    gate/up 576 x 3072; K = 1030 in ranges of unequal rows)."""
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", threads)
    rng = np.random.default_rng(k + n)
    x = rng.standard_normal((1, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    y = np.asarray(jax.jit(lambda a, b: rm.rows_matmul(a, b, "kn"))(x, w))
    ref = x.astype(np.float64) @ w
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.sqrt(k) * np.abs(ref).max(), rtol=0)


@needs_native
@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("m,k,n", [(2, 300, 1000), (16, 576, 576), (7, 200, 70),
                                   (16, 1536, 192), (5, 63, 130), (3, 130, 4100),
                                   (3, 131, 70), (4, 576, 1536), (2, 67, 4096)])
def test_k_split_equals_float64_product(monkeypatch, threads, m, k, n):
    """split='k' ('native_ksplit'): several rows against a [K, N] weight, K split into
    contiguous ranges of >= 64 rows per thread (blocks of 64 rows, a ragged last block:
    300, 130, 1536 with 3 threads), partial rows added by the caller; row tiles 1..6,
    ragged column panels (1000, 70, 130, 4100); K < 64 (63) runs as one part. Up to 4
    rows with N <= 4096 walk the weight rows four a pass (WalkRowsKN): a part's rows not
    a multiple of four (131, 67, 300 over 3 threads), N with a tail under a vector (70,
    1000), rows padded apart (1536: 4K aliasing), the widest walked (4096)."""
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", threads)
    rng = np.random.default_rng(m * 7 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    y = np.asarray(jax.jit(lambda a, b: rm.rows_matmul(a, b, "kn", "k"))(x, w))
    ref = x.astype(np.float64) @ w
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.sqrt(k) * np.abs(ref).max(), rtol=0)


@needs_native
@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("m,k,n", [(2, 576, 1000), (16, 576, 4100), (17, 37, 70),
                                   (40, 130, 49), (5, 1, 30)])
def test_lanes_equal_float64_product(monkeypatch, threads, m, k, n):
    """lanes=True ('native_lanes'): several rows against an [N, K] weight in the vector
    lanes: one lane group with idle lanes (2, 5), a full one (16), a group and a tail
    (17, 40), tiles of whole weight rows and a tail of single rows (n % tile != 0), K
    not a multiple of anything (37, 1)."""
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", threads)
    rng = np.random.default_rng(m * 11 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    y = np.asarray(jax.jit(lambda a, b: rm.rows_matmul(a, b, "nk", lanes=True))(x, w))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.sqrt(k) * np.abs(ref).max(), rtol=0)


@needs_native
def test_other_native_formulations_reach_the_kernel():
    """model.weight_matmul='native_ksplit' compiles the kernel with split=1 for several
    rows against [K, N], 'native_lanes' with lanes=1 against [N, K] (the tied head);
    their logits equal the reference's; the config refuses them for bfloat16."""
    base = tiny_config()
    params = model.init_params(base, 0)
    out = {}
    for impl in ("xla", "native_ksplit", "native_lanes"):
        cfg = _resolved(base.replace(weight_matmul=impl), 3, (15,))
        cache = cache_lib.init_cache(cfg, 3, 16)
        toks = (jnp.arange(3 * 5, dtype=jnp.int32).reshape(3, 5) * 5) % cfg.vocab_size
        pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (3, 5))
        lg, cache = model.forward(params, cfg, toks, pos, cache)
        out[impl] = np.asarray(lg)
        hlo = jax.jit(lambda p, c, tk, ps, cfg=cfg: model.forward(p, cfg, tk, ps, c)).lower(
            params, cache, toks[:, :1], jnp.full((3, 1), 5, jnp.int32)).as_text()
        assert (rm.TARGET in hlo) == (impl != "xla")
        if impl == "native_ksplit":  # the [D, F] projections: several rows, K split
            assert "split = 1" in hlo and "lanes = 1" not in hlo
        if impl == "native_lanes":  # the tied [V, D] head: several rows in the lanes
            assert "lanes = 1" in hlo and "split = 1" not in hlo
    for impl in ("native_ksplit", "native_lanes"):
        np.testing.assert_allclose(out[impl], out["xla"], atol=2e-5, rtol=2e-5)
        with pytest.raises(ConfigError, match=f"weight_matmul='{impl}'.*dtype='bfloat16'"):
            presets.blog_model("bfloat16", weight_matmul=impl)
    with pytest.raises(ValueError, match="split='rows'"):
        rm.rows_matmul(jnp.ones((2, 8)), jnp.ones((8, 4)), "kn", "rows")
    with pytest.raises(ValueError, match="split='k' with w_layout='nk'"):
        rm.rows_matmul(jnp.ones((2, 8)), jnp.ones((4, 8)), "nk", "k")
    with pytest.raises(ValueError, match="lanes=True with w_layout='kn'"):
        rm.rows_matmul(jnp.ones((2, 8)), jnp.ones((8, 4)), "kn", lanes=True)


@pytest.mark.parametrize("impl,m,layout,runs", [
    ("native_ksplit", 4, "kn", "native_ksplit"), ("native_ksplit", 4, "nk", "native"),
    ("native_ksplit", 1, "kn", "native"), ("native_lanes", 4, "nk", "native_lanes"),
    ("native_lanes", 4, "kn", "native"), ("native_lanes", 1, "nk", "native"),
    ("native", 4, "kn", "native"), ("xla", 4, "nk", "xla")])
def test_a_formulation_is_reported_as_what_runs(impl, m, layout, runs):
    """A forced formulation that the kernel runs as plain 'native' for this class (the K
    split of one row or of an [N, K] weight, the lanes of a [K, N] weight) is reported,
    and run, as 'native'."""
    assert weight_matmul.applies(impl, m, layout) == runs
    if rm.load():
        assert _runs(impl, m, 576, 576, layout) == runs


@needs_native
def test_a_cached_choice_that_does_not_apply_runs_as_the_kernel_would(planner_home, monkeypatch):
    """A planner file (edited by hand) naming the lanes for a [K, N] class, or the K
    split for an [N, K] one, is read as 'native', never passed to the kernel as is."""
    key = planner.machine_key("cpu", "rows_matmul.cc")
    path = planner.cache_path(key, "weight_matmul")
    path.parent.mkdir(parents=True)
    entry = {"gbps": {"xla": 1.0}, "measured_at": "2026-01-01 00:00:00"}
    path.write_text(json.dumps({"machine": key, "entries": {
        "M4-K576-N576-kn-float32": dict(entry, choice="native_lanes"),
        "M4-K576-N576-nk-float32": dict(entry, choice="native_ksplit")}}))
    monkeypatch.setattr(planner, "measure_weight_matmul",
                        lambda *a, **k: pytest.fail("measured"))
    planner.clear_memo()
    assert _runs("auto", 4, 576, 576, "kn") == "native"
    assert _runs("auto", 4, 576, 576, "nk") == "native"
    assert _runs("auto", 4, 576, 576, "kn") == "native"  # from memory
    planner.clear_memo()


def test_measure_weight_matmul_refuses_unknown_or_empty_candidates():
    with pytest.raises(ValueError, match=r"candidates \['auto'\]"):
        planner.measure_weight_matmul(2, 256, 256, "kn", candidates=("xla", "auto"))
    with pytest.raises(ValueError, match="none applies"):
        planner.measure_weight_matmul(2, 256, 256, "kn", candidates=("native_lanes",))


@pytest.mark.parametrize("m,k,n,layout,match", [
    (2, 8, 8, "kn", "256 weight bytes"),    # would time 196,608 unrolled copies
    (2, 255, 256, "kn", "261,120 weight bytes"),  # one row short of the smallest class
    (0, 256, 256, "kn", "m=0"),
    (2, 256, 256, "mn", "layout='mn'"),
    (2, 256.0, 256, "kn", "allowed: integers"),
    (2, 256, float("nan"), "kn", "allowed: integers")])
def test_measure_weight_matmul_refuses_shapes_the_planner_never_measures(m, k, n, layout,
                                                                         match):
    """Refused before any weight is allocated: :func:`planner._weight_pick` keeps 'xla'
    below planner.MIN_MEASURED_BYTES, and a direct call there would unroll a product per
    256 bytes of the 48 MiB stream."""
    with pytest.raises(ValueError, match=match):
        planner.measure_weight_matmul(m, k, n, layout)


def test_measure_weight_matmul_sizes_are_python_ints():
    """numpy int32 sizes: 4·K·N computed on Python ints, so [32768, 32768] (4 GiB) is
    not taken for a 0-byte weight (int32 wrap-around) and refused as one."""
    import numpy as np
    with pytest.raises(ValueError, match="allowed: sizes >= 1") as e:
        planner.measure_weight_matmul(np.int32(0), np.int32(32768), np.int32(32768))
    assert "4,294,967,296 weight bytes" in str(e.value)


def test_planner_cache_is_written_when_the_lock_cannot_be_taken(tmp_path, monkeypatch):
    """A file system without flock (or another user's .lock file): the pick is still
    written, without the lock, as before locking."""
    import errno
    import fcntl

    def no_locks(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "planner" / "c.json"
    key = {"k": 1}
    assert planner._cached_choice({}, "x", key, path, {},
                                  lambda: {"choice": "xla"}) == "xla"
    assert planner.load_cache(path, key)["x"]["choice"] == "xla"


def test_bad_thread_count_is_named(monkeypatch):
    from kvjax import native
    for value in ("abc", "0", "-2"):
        monkeypatch.setenv("KVJAX_NATIVE_THREADS", value)
        with pytest.raises(ValueError, match=f"KVJAX_NATIVE_THREADS='{value}'"):
            native.num_threads()
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", "3")
    assert native.num_threads() == 3


@needs_native
@pytest.mark.parametrize("eqn,wshape", [("BTD,DF->BTF", (40, 24)), ("BTD,VD->BTV", (24, 40))])
def test_native_product_is_differentiable(eqn, wshape):
    """A training step through 'native' products (uptrain with configs' 'auto' and few
    rows picked the kernel, then failed: an FFI call has no gradient): the kernel's
    forward, XLA's backward, equal to the all-XLA gradients."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 3, 40), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal(wshape, dtype=np.float32))
    hlo = jax.jit(lambda a, b: weight_matmul.einsum(eqn, a, b, "native", NATIVE)).lower(
        x, w).as_text()
    assert rm.TARGET in hlo  # the kernel really runs the forward

    def loss(a, b, impl):
        return jnp.sum(jnp.sin(weight_matmul.einsum(eqn, a, b, impl, NATIVE)))
    got = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, w, "native")
    want = jax.grad(loss, argnums=(0, 1))(x, w, "xla")
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, atol=1e-4, rtol=1e-4)


def test_bad_input_is_named():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="w_layout='kk'"):
        rm.rows_matmul(x, x.T, "kk")
    with pytest.raises(ValueError, match="bfloat16"):
        rm.rows_matmul(x.astype(jnp.bfloat16), x.T)
    with pytest.raises(ValueError, match="do not share K"):
        rm.rows_matmul(x, jnp.ones((7, 3), jnp.float32))
    with pytest.raises(ValueError, match="weight_matmul='fast'"):
        weight_matmul.einsum("BTD,DF->BTF", x[None], x.T, "fast")
    with pytest.raises(ConfigError, match="weight_matmul.*'fast'"):
        presets.blog_model("float32", weight_matmul="fast")


@pytest.mark.parametrize("eqn,xs,ws,want", [
    ("BTD,DNH->BTNH", 3, 3, (2, 1, "kn")),
    ("BTF,FD->BTD", 3, 2, (2, 1, "kn")),
    ("BTNV,NVD->BTD", 4, 3, (2, 2, "kn")),
    ("BTD,VD->BTV", 3, 2, (2, 1, "nk")),
    ("BTD,DB->BTB", 3, 2, None),  # a row letter in the weight
    ("BTD,TD->BD", 3, 2, None),
    ("BKGH,BKSH->BKGS", 4, 4, None),  # attention, not a weight product
])
def test_split_eqn(eqn, xs, ws, want):
    assert weight_matmul.split_eqn(eqn, xs, ws) == want


@needs_native
@pytest.mark.parametrize("make,batch", [
    (lambda: tiny_config(), 3), (lambda: tiny_mla_config(tie_embeddings=False), 2)],
    ids=["gqa-tied-b3", "mla-untied-b2"])
def test_model_decodes_the_same_with_native_weight_products(make, batch):
    """Prefill (M = B·T rows) and decode steps (M = B) through the native kernel give
    the reference's logits, and the kernel is in the compiled step."""
    base = make()
    params = model.init_params(base, 0)
    logits = {}
    for impl in ("xla", "native"):
        cfg = _resolved(base.replace(weight_matmul=impl), batch, (batch * 5,))
        cache = cache_lib.init_cache(cfg, batch, 16)
        toks = (jnp.arange(batch * 7, dtype=jnp.int32).reshape(batch, 7) * 7) % cfg.vocab_size
        pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (batch, 5))
        lg, cache = model.forward(params, cfg, toks[:, :5], pos, cache)
        out = [lg]
        for t in range(5, 7):
            lg, cache = model.forward(params, cfg, toks[:, t:t + 1],
                                      jnp.full((batch, 1), t, jnp.int32), cache)
            out.append(lg)
        logits[impl] = np.asarray(jnp.concatenate(out, axis=1))
        hlo = jax.jit(lambda p, c, tk, ps, cfg=cfg: model.forward(p, cfg, tk, ps, c)).lower(
            params, cache, toks[:, :1], jnp.full((batch, 1), 7, jnp.int32)).as_text()
        assert (rm.TARGET in hlo) == (impl == "native")
    np.testing.assert_allclose(logits["native"], logits["xla"], atol=2e-5, rtol=2e-5)


def test_bfloat16_and_many_rows_take_xla(monkeypatch):
    """The kernel is float32 and few-row only: other products fall back, unmeasured."""
    monkeypatch.setattr(planner, "measure_weight_matmul",
                        lambda *a, **k: pytest.fail("measured"))
    x = jnp.ones((1, 2, 8), jnp.bfloat16)
    hlo = jax.jit(lambda a, b: weight_matmul.einsum("BTD,DF->BTF", a, b, "native")).lower(
        x, jnp.ones((8, 4), jnp.bfloat16)).as_text()
    assert rm.TARGET not in hlo
    assert _runs("native", rm.MAX_ROWS + 1, 64, 64) == "xla"
    assert _runs("auto", 1, 8, 8) == "xla"  # below MIN_MEASURED_BYTES
    with pytest.raises(ValueError, match="without a plan"):  # the kernel needs a plan
        _choose("native", 2, 64, 64, "kn", None)


def _fake(calls):
    def measure(m, k, n, layout="kn", **_):
        calls.append((m, k, n, layout))
        return {"choice": "native", "gbps": {"xla": 10.0, "native": 20.0},
                "gflops": {"xla": 1.0, "native": 2.0}, "seconds": {"xla": 2.0, "native": 1.0},
                "copies": 3}
    return measure


@needs_native
def test_row_counts_of_one_band_share_one_measured_pick(planner_home, monkeypatch):
    """Prompts of 33 to 64 rows share the class measured at 64 rows (plan.row_band);
    65 rows is the next band, and 1 and 2 rows are bands of their own."""
    assert [plan_lib.row_band(m) for m in (1, 2, 3, 4, 5, 33, 64, 65, 256)] == \
        [1, 2, 4, 4, 8, 64, 64, 128, 256]
    calls = []
    monkeypatch.setattr(planner, "measure_weight_matmul", _fake(calls))
    planner.clear_memo()
    for m in (33, 40, 64, 65):
        assert _runs("auto", m, 576, 1536, "kn") == "native"
    assert calls == [(64, 576, 1536, "kn"), (128, 576, 1536, "kn")]
    assert weight_class(40, 576, 1536, "kn") == "M64-K576-N1536-kn-float32"
    planner.clear_memo()


@needs_native
def test_planner_measures_weights_once_then_reads_its_cache(planner_home, monkeypatch):
    calls = []
    monkeypatch.setattr(planner, "measure_weight_matmul", _fake(calls))
    planner.clear_memo()
    assert _runs("auto", 4, 576, 1536, "kn") == "native"
    assert any("native (GB/s" in ln and "measured now" in ln for ln in planner.report_lines())
    planner.clear_memo()
    assert _runs("auto", 4, 576, 1536, "kn") == "native"  # from disk
    assert any("; cached 20" in ln for ln in planner.report_lines())  # with its date
    assert calls == [(4, 576, 1536, "kn")]
    key = planner.machine_key("cpu", "rows_matmul.cc")
    path = planner.cache_path(key, "weight_matmul")
    data = json.loads(path.read_text())
    assert data["machine"] == key and "M4-K576-N1536-kn-float32" in data["entries"]
    assert key["kernel"] != planner.machine_key("cpu")["kernel"]  # its own source hash
    assert path != planner.cache_path(planner.machine_key("cpu"))
    assert any("M4-K576-N1536-kn-float32: native (GB/s" in ln for ln in planner.report_lines())
    assert _runs("auto", 8, 576, 1536, "kn") == "native"  # new class
    assert len(calls) == 2
    # resolve puts the picks of every weight class of a config in its plan: the cached
    # ones read (not measured again), the new [1536, 576] and fused gate/up [576, 3072]
    # ones measured, the small ones (below MIN_MEASURED_BYTES) 'xla' unmeasured; the
    # traced product reads the plan
    cfg = planner.resolve(tiny_config(weight_matmul="auto", d_model=576, mlp_dim=1536),
                          max_seq_len=16, batch_sizes=(4,))
    picks = dict(cfg.plan.weight_matmul)
    assert "rows_matmul" in cfg.plan.native
    assert picks["M4-K576-N1536-kn-float32"] == picks["M4-K1536-N576-kn-float32"] == "native"
    assert {c for c, impl in picks.items() if impl == "xla"} == {
        weight_class(4, k, n, lay) for k, n, lay in planner.weight_shapes(cfg)
        if 4 * k * n < planner.MIN_MEASURED_BYTES}
    assert calls[2:] == [(4, 576, 3072, "kn"), (4, 1536, 576, "kn")]  # fused gate/up too
    assert _choose("auto", 4, 576, 1536, "kn", cfg.plan) == "native"
    assert _choose("auto", 4, 576, 1536, "kn", None) == "xla"  # no plan
    # a plan for a multi-device mesh: the partitioned XLA dot, never the kernel XLA
    # cannot partition (configs/ default to 'auto', and mesh.check lets 'auto' through)
    meshed = planner.resolve(tiny_config(weight_matmul="auto", d_model=576, mlp_dim=1536),
                             max_seq_len=16, batch_sizes=(4,), mesh_axes={"model": 2})
    assert meshed.plan.weight_matmul == () and meshed.plan.mesh_axes == (("model", 2),)
    assert _choose("auto", 4, 576, 1536, "kn", meshed.plan) == "xla"
    assert len(calls) == 4
    planner.clear_memo()


@needs_native
@pytest.mark.parametrize("content", ["{not json", json.dumps({"machine": {"cpu": "other"},
                                                               "entries": {}}),
                                     "FOREIGN_CHOICE"])
def test_corrupt_or_foreign_weight_cache_is_ignored(planner_home, monkeypatch, content):
    key = planner.machine_key("cpu", "rows_matmul.cc")
    path = planner.cache_path(key, "weight_matmul")
    path.parent.mkdir(parents=True)
    if content == "FOREIGN_CHOICE":  # this machine's key, but a choice no formulation has
        content = json.dumps({"machine": key, "entries": {
            "M2-K576-N576-kn-float32": {"choice": "xla_cache_left"}}})
    path.write_text(content)
    calls = []
    monkeypatch.setattr(planner, "measure_weight_matmul", _fake(calls))
    planner.clear_memo()
    with pytest.warns(UserWarning, match="ignoring planner cache"):
        assert _runs("auto", 2, 576, 576) == "native"
    assert len(calls) == 1
    assert json.loads(path.read_text())["machine"] == key  # rewritten for this machine
    planner.clear_memo()


@needs_native
@pytest.mark.parametrize("m,layout,want", [(2, "nk", {"xla", "native", "native_lanes"}),
                                           (1, "kn", {"xla", "native"}),
                                           (1, "nk", {"xla", "native"}),
                                           (2, "kn", {"xla", "native", "native_ksplit"})])
def test_measure_weight_matmul_times_each_on_a_streamed_weight(m, layout, want):
    """The K split and the lanes are candidates only where they differ from 'native':
    several rows against a [K, N] or an [N, K] weight."""
    r = planner.measure_weight_matmul(m, 256, 256, layout, rounds=3, budget_s=0.2)
    assert set(r["gbps"]) == want and r["choice"] in want
    assert r["copies"] * 256 * 256 * 4 >= planner.WEIGHT_STREAM_BYTES
    assert all(v > 0 for v in r["gbps"].values())


def test_the_planner_times_a_chain_of_dependent_products():
    """planner.weight_chain: y_1 = x w_1, y_i = y_{i-1} + (x + c y_{i-1}[:, :1]) w_i
    (float64 reference, c = 1 to make the dependency visible): each product waits for
    the one before, as in a decode step; summing independent products x w_i gives
    another answer. With the default c and weights scaled as the planner scales them
    (1/sqrt(K)), 192 products (the most it times) stay finite and of x's size."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    ws = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(4)]
    chain = jax.jit(lambda x, ws, c: planner.weight_chain(lambda a, b: a @ b, x, ws, c))
    got = np.asarray(chain(jnp.asarray(x), tuple(jnp.asarray(w) for w in ws), 1.0))
    y = x.astype(np.float64) @ ws[0]
    for w in ws[1:]:
        y = y + (x + y[:, :1]) @ w.astype(np.float64)
    np.testing.assert_allclose(got, y, rtol=1e-5, atol=1e-5)
    independent = sum(x.astype(np.float64) @ w for w in ws)
    assert np.abs(got - independent).max() > 1e-2
    many = tuple(jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32)
                 for _ in range(192))
    y = np.asarray(jax.jit(lambda x, ws: planner.weight_chain(lambda a, b: a @ b, x, ws))(
        jnp.asarray(x), many))
    assert np.isfinite(y).all() and np.abs(y).max() < 100
    with pytest.raises(ValueError, match=r"ws=\(\); allowed: at least one weight"):
        planner.weight_chain(lambda a, b: a @ b, x, ())


def test_measure_refuses_unknown_or_empty_candidates():
    """Before any allocation (the flush buffer, the cache), naming the allowed set."""
    for bad in ((), ("bogus",), ("xla", "auto")):
        with pytest.raises(ValueError, match=r"allowed: a non-empty subset of \('xla'"):
            planner.measure(1, 2, 4, 64, 64, 512, jnp.float32, "BKHS", "BKSH",
                            candidates=bad)
    with pytest.raises(ValueError, match="none applies"):  # 'pallas' is GPU-only
        planner.measure(1, 2, 4, 64, 64, 512, jnp.float32, "BKHS", "BKSH",
                        candidates=("pallas",))


# ----------------------------------------------------------------------- int8 weights


@needs_native
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("k,n", [(576, 192), (37, 70), (1, 200), (1030, 300)])
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_native_int8_equals_float64_product(m, k, n, layout):
    """The int8 kernel against float64: K not a multiple of 4 rows (37, 1030) nor of the
    vector width, N with a ragged tail (70, 300), and (1030, 300) above the threading
    threshold (split into parts)."""
    rng = np.random.default_rng(m * 1000 + k + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    q = rng.integers(-127, 128, (k, n)).astype(np.int8)
    ql = q if layout == "kn" else np.ascontiguousarray(q.T)
    y = np.asarray(jax.jit(lambda a, b: rm.rows_matmul_int8(a, b, layout))(x, ql))
    ref = x.astype(np.float64) @ q.astype(np.float64)
    assert y.shape == (m, n) and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, atol=2e-5 * np.sqrt(k) * np.abs(ref).max(), rtol=0)


def test_rows_matmul_int8_refuses_bad_operands():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="q is float32"):
        rm.rows_matmul_int8(x, jnp.ones((8, 4), jnp.float32))
    with pytest.raises(ValueError, match="do not share K"):
        rm.rows_matmul_int8(x, jnp.ones((9, 4), jnp.int8))
    with pytest.raises(ValueError, match="w_layout='kk'"):
        rm.rows_matmul_int8(x, jnp.ones((8, 4), jnp.int8), "kk")


def test_quantize_int8_error_is_half_a_step_per_output_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 3, 5)).astype(np.float32) * np.arange(1, 6)  # [D, N, H]
    qw = weight_matmul.quantize_int8(jnp.asarray(w), (-1,))
    assert qw.q.dtype == jnp.int8 and qw.scale.shape == (1, 1, 5)
    scale = np.abs(w).max(axis=(0, 1)) / 127
    np.testing.assert_allclose(np.asarray(qw.scale).ravel(), scale, rtol=1e-6)
    err = np.abs(np.asarray(qw.dequantize()) - w)
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    # each output channel's absmax maps to 127
    assert (np.abs(np.asarray(qw.q)).max(axis=(0, 1)) == 127).all()
    zero = weight_matmul.quantize_int8(jnp.zeros((4, 2)), (-1,))
    assert (np.asarray(zero.scale) == 1).all() and (np.asarray(zero.q) == 0).all()
    with pytest.raises(ValueError, match="keep=\\(3,\\)"):
        weight_matmul.quantize_int8(jnp.asarray(w), (3,))


@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(scan_layers=False),
                                 tiny_mla_config()], ids=["stacked", "per_layer", "mla"])
def test_int8_params_run_as_their_dequantized_copy(cfg):
    """A model over quantize_params_int8's tree gives the logits of the same model over
    the widened float32 weights, by XLA and by the native kernel (one-token decode), and
    the tree holds about a quarter of the bytes."""
    params = model.params_for(cfg, model.init_params(cfg, 0))
    q = weight_matmul.quantize_params_int8(params, stacked=cfg.scan_layers)
    is_q = lambda a: isinstance(a, weight_matmul.Int8Weight)  # noqa: E731
    assert any(is_q(a) for a in jax.tree.leaves(q, is_leaf=is_q))
    widened = jax.tree.map(lambda a: a.dequantize() if is_q(a) else a, q, is_leaf=is_q)
    toks = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    pos = jnp.arange(5, dtype=jnp.int32)[None]
    want, _ = model.forward(widened, cfg, toks, pos)
    got, _ = model.forward(q, cfg, toks, pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
    if rm.load():
        ncfg = _resolved(cfg.replace(weight_matmul="native"), 1, 1)
        step = jax.jit(lambda p, t, s: model.forward(p, ncfg, t, s)[0])
        assert rm.TARGET_INT8 in step.lower(q, toks[:, :1], pos[:, :1]).as_text()
        one = step(q, toks[:, :1], pos[:, :1])
        np.testing.assert_allclose(np.asarray(one), np.asarray(want[:, :1]), atol=2e-5,
                                   rtol=1e-5)
    full = weight_matmul.weight_bytes(params)
    assert 0.25 * full < weight_matmul.weight_bytes(q) < 0.4 * full


@pytest.mark.parametrize("cfg", [tiny_config(), tiny_config(scan_layers=False),
                                 tiny_mla_config()], ids=["stacked", "per_layer", "mla"])
def test_int8_params_scale_every_output_channel(cfg):
    """quantize_params_int8 gives each output channel its own scale: q/k/v [D, N, H] one
    per (head, head-dim), [N, H, D] output projections one per D, the embedding one per
    row; each channel's absmax is 127 (a scale shared by several channels leaves the
    smaller ones below it)."""
    params = model.params_for(cfg, model.init_params(cfg, 0))
    q = weight_matmul.quantize_params_int8(params, stacked=cfg.scan_layers)
    is_q = lambda a: isinstance(a, weight_matmul.Int8Weight)  # noqa: E731
    seen = set()
    for path, w in jax.tree_util.tree_flatten_with_path(q, is_leaf=is_q)[0]:
        if not is_q(w):
            continue
        keys = [getattr(p, "key", str(p)) for p in path]
        lead = int(cfg.scan_layers and keys[0] == "layers")
        name = keys[-2] if keys[-1] == "kernel" else keys[-1]
        seen.add(name)
        if keys[-1] == "embedding":
            inputs = (w.ndim - 1,)
        elif name in weight_matmul.MERGED_INPUT_KERNELS:
            inputs = tuple(range(lead, w.ndim - 1))
        else:
            inputs = (lead,)
        want = tuple(1 if i in inputs else n for i, n in enumerate(w.shape))
        assert w.scale.shape == want, (keys, w.scale.shape, want)
        absmax = np.abs(np.asarray(w.q)).max(axis=inputs)
        assert (absmax == 127).all(), keys
    assert {"embedding"} < seen
    if cfg.attention != "mla":
        assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= seen
