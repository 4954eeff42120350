"""Every decode-attention formulation equals the reference; the planner's cache is keyed
by machine and never trusts a corrupt or foreign file (issue 18)."""

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import kernels, native, planner, presets
from kvjax.cache import paged
from kvjax.config import ConfigError
from kvjax.models import attention, decode_kernels
from kvjax.models.attention import attend_step
from kvjax.plan import Plan, decode_attention_class


def _choice(cfg, k, v, mesh=False):
    """The formulation a traced decode step of ``cfg`` over caches shaped ``k``/``v``
    runs: for 'auto' the pick planner.resolve puts in the plan (planner._decode_pick,
    measured or read from the planner cache), else decode_kernels.choose with a plan
    holding the native kernel when it loads."""
    b, _, s, _, _ = decode_kernels.cache_dims(k, v, cfg.cache_layout("k"),
                                              cfg.cache_layout("v"))
    if cfg.decode_attention == "auto":
        return planner._decode_pick(cfg, b, s, mesh)
    plan = Plan(native=("decode_attention",) if native.load() else ())
    return decode_kernels.choose(cfg.replace(plan=plan), k, v)


LAYOUTS = [("BKSH", "BKSH"), ("BKHS", "BKSH"), ("BKSH", "BKHS"), ("BKHS", "BKHS")]
CPU_IMPLS = [i for i in ("xla_cache_left", "native")]
CLASS = "B1-K2-G4-H64-V64-S4096-float32-BKHS-BKSH"  # blog_model's GQA cache, B = 1


def problem(dtype, kl, vl, b=2, k=2, g=3, h=8, s=70, seed=0, prefix=False):
    """q [B,1,K,G,H], caches, mask [B,1,S] (random or a prefix), new entries, new_visible."""
    rng = np.random.default_rng(seed)
    sk = (b, k, s, h) if kl == "BKSH" else (b, k, h, s)
    sv = (b, k, s, h) if vl == "BKSH" else (b, k, h, s)
    nk = (b, k, 1, h) if kl == "BKSH" else (b, k, h, 1)
    nv = (b, k, 1, h) if vl == "BKSH" else (b, k, h, 1)
    arr = lambda shape: jnp.asarray(3 * rng.standard_normal(shape, dtype=np.float32), dtype)  # noqa: E731
    if prefix:
        n = rng.integers(1, s, size=b)
        mask = jnp.asarray(np.arange(s)[None, :] < n[:, None])[:, None]
    else:
        mask = np.asarray(rng.random((b, 1, s)) < 0.6)
        mask[-1] = False  # a row that sees no old slot (e.g. a ring just reset)
        mask = jnp.asarray(mask)
    return arr((b, 1, k, g, h)), arr(sk), arr(sv), mask, arr(nk), arr(nv)


def runs(impl, backend, dtype, kl, vl, slot_kind="ring", slots=4096):
    """Whether the registry says ``impl`` applies (the native kernel taken as loaded)."""
    site = kernels.Site("decode_attention", backend=backend, dtype=jnp.dtype(dtype).name,
                        k_layout=kl, v_layout=vl, slots=slots, slot_kind=slot_kind,
                        native=kernels.NATIVE)
    return kernels.get("decode_attention", impl).applies(site) is None


def tol(dtype):
    return dict(atol=2e-5, rtol=2e-5) if dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize("kg", [(4, 1), (2, 3), (1, 4)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_formulation_equals_reference(impl, layouts, kg, dtype):
    kl, vl = layouts
    if not runs(impl, "cpu", dtype, kl, vl):
        assert impl == "native" and (dtype != jnp.float32 or not native.load())
        return
    q, kc, vc, mask, kn, vn = problem(dtype, kl, vl, k=kg[0], g=kg[1])
    new_visible = jnp.array([True, False])  # second row: sees nothing at all
    for nv in (None, new_visible):
        ref = attend_step(q, kc, vc, mask, kn, vn, kl, vl, new_visible=nv, backend="cpu")
        out = attend_step(q, kc, vc, mask, kn, vn, kl, vl, new_visible=nv, impl=impl,
                          backend="cpu")
        assert out.shape == ref.shape == (2, 1, kg[0], kg[1], 8) and out.dtype == ref.dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                   **tol(dtype))
    assert float(jnp.max(jnp.abs(ref[1].astype(jnp.float32)))) == 0.0  # zeros: no key seen


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_native_long_rows_split_over_threads():
    """Enough slots for several chunks per (b, k): the in-kernel merge of chunks."""
    q, kc, vc, mask, kn, vn = problem(jnp.float32, "BKHS", "BKSH", b=1, k=1, g=4, h=64,
                                      s=5000, seed=3)
    mask = mask.at[0, 0, :].set(jnp.arange(5000) % 7 != 0)
    ref = attend_step(q, kc, vc, mask, kn, vn, "BKHS", "BKSH")
    out = attend_step(q, kc, vc, mask, kn, vn, "BKHS", "BKSH", impl="native")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def _native_matches_xla(q, kc, vc, vis, vl):
    """(o, m, l) of the native kernel equal XLA's over keys 'BKHS' and values ``vl``."""
    ref = decode_kernels.partial_attention("xla", q, kc, vc, vis, "BKHS", vl)
    out = decode_kernels.partial_attention("native", q, kc, vc, vis, "BKHS", vl)
    for name, r, o in zip("oml", ref, out):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                   err_msg=name)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("vl", ["BKSH", "BKHS"])
@pytest.mark.parametrize("kg,v", [((1, 1), 64), ((2, 4), 64), ((1, 8), 64), ((1, 9), 32)],
                         ids=["mha", "gqa", "mqa8", "mqa9-v32"])
def test_native_fast_path_spans_equal_xla(kg, v, vl):
    """The register-blocked path (keys [H, S], H = 64): several 4,096-slot spans, a span
    no query sees, a ragged last span (S not a multiple of the vector width), head groups
    larger than the registers hold (G = 8, 9), V = 32, and a run of visible slots
    (the values loop over contiguous rows): (o, m, l) equal XLA's."""
    k, g = kg
    s, h = 9000, 64
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((2, k, g, h)), jnp.float32)
    kc = jnp.asarray(3 * rng.standard_normal((2, k, h, s)), jnp.float32)
    vshape = (2, k, s, v) if vl == "BKSH" else (2, k, v, s)
    vc = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
    vis = rng.random((2, s)) < 0.7
    vis[0, 4096:8192] = False  # row 0: its whole second span is invisible
    vis[0, 1000:3000] = True  # and a run of 2,000 visible slots
    vis[1, :8990] = False  # row 1: only slots in the ragged end are visible
    vis = jnp.asarray(vis)
    _native_matches_xla(q, kc, vc, vis, vl)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("vl", ["BKSH", "BKHS"])
def test_native_window_over_a_dense_row_equals_xla(vl):
    """A window with sinks as a mask over long dense rows (window_cache='dense'): runs of
    visible slots thousands apart, in one span or two, cut into segments of their own
    (the keys between them are not read), and gaps of 63 and 64 masked slots (read
    through, resp. cut): (o, m, l) equal XLA's."""
    s, h, v = 9000, 64, 64
    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((3, 3, 3, h)), jnp.float32)
    kc = jnp.asarray(3 * rng.standard_normal((3, 3, h, s)), jnp.float32)
    vshape = (3, 3, s, v) if vl == "BKSH" else (3, 3, v, s)
    vc = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
    vis = np.zeros((3, s), bool)
    vis[0, :4] = vis[0, 8100:8133] = True  # sinks, then a window two spans on
    vis[1, :4] = vis[1, 1000:1301] = True  # both in the first span
    vis[2, 100:200] = vis[2, 263:300] = vis[2, 364:401] = True  # gaps of 63 and 64
    vis = jnp.asarray(vis)
    _native_matches_xla(q, kc, vc, vis, vl)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_native_any_thread_count_equals_xla(threads, monkeypatch):
    """The work items of a call split into parts over 1, 2, 3 and 5 threads (more pool
    tasks than CPUs: some start late, some find no part left, pool.h): rows of G = 3 and
    8 (ragged, masked at random, a window with sinks) give (o, m, l) equal to XLA's, every
    item done once."""
    monkeypatch.setenv("KVJAX_NATIVE_THREADS", str(threads))
    s, h, v = 9000, 64, 64
    rng = np.random.default_rng(17)
    for g in (3, 8):
        q = jnp.asarray(rng.standard_normal((2, 2, g, h)), jnp.float32)
        kc = jnp.asarray(3 * rng.standard_normal((2, 2, h, s)), jnp.float32)
        vc = jnp.asarray(rng.standard_normal((2, 2, s, v)), jnp.float32)
        vis = rng.random((2, s)) < 0.8
        vis[1] = False
        vis[1, :4] = vis[1, 7000:8100] = True  # sinks and a window
        _native_matches_xla(q, kc, vc, jnp.asarray(vis), "BKSH")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_native_chunks_cut_at_equal_shares_of_visible_slots():
    """Rows of one KV head are cut into chunks of equal visible slots, not equal slots: a
    window and sinks (the window's slots shared by the chunks), a row whose visible slots
    all lie in its last block (chunks with no slot at all), one with a single visible slot
    and one with none: (o, m, l) equal XLA's."""
    s, h, v = 9000, 64, 64
    rng = np.random.default_rng(13)
    q = jnp.asarray(rng.standard_normal((4, 1, 3, h)), jnp.float32)
    kc = jnp.asarray(3 * rng.standard_normal((4, 1, h, s)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((4, 1, s, v)), jnp.float32)
    vis = np.zeros((4, s), bool)
    vis[0, :4] = vis[0, s - 1024:] = True  # sinks and a window at the row's end
    vis[1, s - 10:] = True  # the last block only
    vis[2, 5000] = True
    for b in range(4):  # one (b, k) a call: 2 chunks or more for any thread count
        _native_matches_xla(q[b:b + 1], kc[b:b + 1], vc[b:b + 1], jnp.asarray(vis[b:b + 1]),
                            "BKSH")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("vl", ["BKSH", "BKHS"])
def test_native_scratch_buffers_carry_nothing_between_calls(vl):
    """The kernel's threads keep their scratch buffers (scores, mask, value rows) from
    call to call unzeroed. A call whose every score and value is NaN leaves them full of
    NaN and of rows into its own arrays; the next call, with gaps, windows and a ragged
    end, must still equal XLA's (every float it reads was written for it)."""
    s, h, v = 9000, 64, 64
    rng = np.random.default_rng(17)
    vshape = (1, 1, s, v) if vl == "BKSH" else (1, 1, v, s)
    q = jnp.asarray(rng.standard_normal((1, 1, 9, h)), jnp.float32)
    # (kept alive to the end: value rows left in the buffers still point at NaN)
    nan_k, nan_v = jnp.full((1, 1, h, s), jnp.nan), jnp.full(vshape, jnp.nan)
    kc = jnp.asarray(3 * rng.standard_normal((1, 1, h, s)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
    vis = np.zeros((1, s), bool)
    vis[0, :4] = vis[0, 700:790] = vis[0, 5000:6100] = vis[0, s - 5:] = True
    for _ in range(4):  # (which pool thread runs which chunk varies from call to call)
        out = decode_kernels.partial_attention("native", q, nan_k, nan_v,
                                               jnp.ones((1, s), bool), "BKHS", vl)
        assert np.isnan(np.asarray(out[0])).all()
        _native_matches_xla(q, kc, vc, jnp.asarray(vis), vl)
    del nan_k, nan_v


def _pages(rng, b, k, h, v, page_size, max_pages, kl, vl):
    """Pools of 2·b·max_pages pages (NaN in every page no row holds), a shuffled block
    table whose last entry of row 0 is missing (-1) and whose rows 0 and 1 share their
    first page (read-only sharing), and a visibility with a hole per row."""
    n = 2 * b * max_pages
    shape = lambda x: (n, k, page_size, x) if kl == "BKSH" else (n, k, x, page_size)  # noqa: E731
    kp = 3 * rng.standard_normal(shape(h)).astype(np.float32)
    vshape = (n, k, page_size, v) if vl == "BKSH" else (n, k, v, page_size)
    vp = rng.standard_normal(vshape).astype(np.float32)
    table = rng.permutation(n)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    table[0, -1] = -1
    table[1, 0] = table[0, 0]
    unused = np.setdiff1d(np.arange(n), table)
    kp[unused], vp[unused] = np.nan, np.inf
    vis = rng.random((b, max_pages * page_size)) < 0.8
    vis &= np.repeat(table, page_size, axis=1) >= 0  # no slot of a missing page is seen
    vis[0, :page_size + 3] = False
    return kp, vp, table, vis


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize("page_size,max_pages", [(1, 40), (5, 9), (16, 300), (48, 5)])
def test_native_reads_pages_in_place(page_size, max_pages, layouts):
    """The paged target of the native kernel (block table, pools read where they lie)
    gives the statistics of XLA over the gathered dense views, and of the dense native
    kernel over the same views: pages of 1 token, of a size that is no multiple of the
    vector width, many pages per row (spans and thread chunks across pages), a page
    shared by two rows, a missing page, NaN / inf in pages no row holds."""
    kl, vl = layouts
    rng = np.random.default_rng(page_size)
    b, k, g, h = 3, 2, 3, 64
    kp, vp, table, vis = _pages(rng, b, k, h, h, page_size, max_pages, kl, vl)
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), jnp.float32)
    args = (q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(vis), kl, vl)
    got = decode_kernels.partial_attention("native", *args, block_table=jnp.asarray(table))
    ref = decode_kernels.partial_attention("xla", *args, block_table=jnp.asarray(table))
    views = [paged.gather_view(jnp.asarray(x), jnp.asarray(table), -1 if lay == "BKHS" else -2)
             for x, lay in ((kp, kl), (vp, vl))]
    views = [jnp.where(jnp.isfinite(x), x, 0.0) for x in views]  # what no query sees
    dense = decode_kernels.partial_attention("native", q, *views, jnp.asarray(vis), kl, vl)
    for name, r, o, d in zip("oml", ref, got, dense):
        assert np.isfinite(np.asarray(o)).all(), name
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(o), np.asarray(d), atol=3e-5, rtol=3e-5,
                                   err_msg=name)


def _np_partial(q, kp, vp, tables, vis, kl, vl):
    """numpy (o, m, l) of each (row, KV head) over its own pages (per-head tables)."""
    b, k, g, h = q.shape
    o = np.zeros((b, k, g, vp.shape[-1] if vl == "BKSH" else vp.shape[-2]), np.float64)
    m, l = np.full((b, k, g), -1e30), np.zeros((b, k, g))
    for r in range(b):
        for kh in range(k):
            keys, vals, seen = [], [], []
            for c, pg in enumerate(tables[r, kh]):
                page_k = kp[max(pg, 0), kh] if kl == "BKSH" else kp[max(pg, 0), kh].T
                page_v = vp[max(pg, 0), kh] if vl == "BKSH" else vp[max(pg, 0), kh].T
                keys.append(page_k), vals.append(page_v)
                p = page_k.shape[0]
                seen.append(vis[r, kh, c * p:(c + 1) * p] & (pg >= 0))
            keys, vals, seen = np.concatenate(keys), np.concatenate(vals), np.concatenate(seen)
            if not seen.any():
                continue
            s = (q[r, kh].astype(np.float64) @ keys[seen].T) / np.sqrt(h)  # [G, n]
            m[r, kh] = s.max(-1)
            e = np.exp(s - m[r, kh][:, None])
            l[r, kh], o[r, kh] = e.sum(-1), e @ vals[seen]
    return o, m, l


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("layouts", LAYOUTS)
@pytest.mark.parametrize("k,g", [(2, 3), (4, 1)])  # GQA, MHA
def test_native_reads_per_head_tables_in_place(k, g, layouts):
    """Per-(row, KV head) block tables (a read-time page selection, Quest): the native
    kernel reads each head's own pages where they lie and equals the XLA gathered read
    and a numpy reference: ragged rows (a page half written), a page two rows share,
    -1 entries, NaN / inf in pages no entry names and in unwritten slots, a head that
    sees nothing."""
    kl, vl = layouts
    rng = np.random.default_rng(k)
    b, h, p, c = 3, 64, 5, 3
    used = b * k * c
    n = used + 4  # pages used.. never named
    kshape = (n, k, p, h) if kl == "BKSH" else (n, k, h, p)
    vshape = (n, k, p, h) if vl == "BKSH" else (n, k, h, p)
    kp = 3 * rng.standard_normal(kshape).astype(np.float32)
    vp = rng.standard_normal(vshape).astype(np.float32)
    tables = rng.permutation(used).reshape(b, k, c).astype(np.int32)
    tables[1, 0, 0] = tables[0, 0, 1]  # a page two rows share
    tables[2, -1, -1] = -1  # a missing page
    vis = np.repeat(tables >= 0, p, axis=2)  # [B, K, C·P]
    vis[0, :, -2:] = False  # a ragged row: its last page half written
    vis[1, -1] = False  # a head that sees nothing
    kp[used:], vp[used:] = np.nan, np.inf
    last = tables[0, :, -1]  # the unwritten slots of the ragged page hold NaN
    if kl == "BKSH":
        kp[last, :, -2:] = np.nan
    else:
        kp[last, :, :, -2:] = np.nan
    q = rng.standard_normal((b, k, g, h)).astype(np.float32)
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(vis), kl, vl)
    got = decode_kernels.partial_attention("native", *args, block_table=jnp.asarray(tables))
    ref = decode_kernels.partial_attention("xla", *args, block_table=jnp.asarray(tables))
    want = _np_partial(q, kp, vp, tables, vis, kl, vl)
    for name, o, r, w in zip("oml", got, ref, want):
        assert np.isfinite(np.asarray(o)).all(), name
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                   err_msg=name)
        np.testing.assert_allclose(np.asarray(o), w, atol=3e-4, rtol=3e-4, err_msg=name)
    assert float(np.asarray(got[2])[1, -1].max()) == 0.0  # the blind head: l = 0


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_native_paged_refuses_a_page_outside_the_pool():
    rng = np.random.default_rng(0)
    kp, vp, table, vis = _pages(rng, 2, 1, 16, 16, 4, 3, "BKHS", "BKSH")
    table[1, 1] = kp.shape[0]  # one past the pool
    q = jnp.zeros((2, 1, 2, 16), jnp.float32)
    with pytest.raises(Exception, match=r"block-table entry outside \[-1, num_pages\)"):
        jax.block_until_ready(decode_kernels.partial_attention(
            "native", q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(vis), "BKHS",
            "BKSH", block_table=jnp.asarray(table)))


_AVX2 = {}


def _avx2_targets():
    """The dense and paged targets of decode_attention.cc built with ``-mno-avx512f`` (its
    AVX2 loops; cached per machine and source like the default build), registered under
    names of their own; None where they cannot be built (no compiler, no AVX2)."""
    if "avx2" not in native.machine_id().split("|")[-1].split():
        return None
    names = ("kvjax_decode_attention_avx2", "kvjax_paged_decode_attention_avx2")
    ok = native.register(
        _AVX2, threading.Lock(),
        lambda: native.build_library(native._SOURCE, "kvjax_decode_attention_avx2",
                                     flags=("-mno-avx512f",)),
        names[0], "KvjaxDecodeAttention", "the AVX2 build", "skipping its tests",
        more=((names[1], "KvjaxPagedDecodeAttention"),))
    return names if ok else None


def _grouped_problem(g, kl, vl, seed):
    """Dense caches (B = 3, K = 2, H = 64, S = 1,000: not a multiple of any vector width)
    whose rows are ragged (random slots masked; a prefix of 777 slots; sinks, a window and
    gaps of 63 and 64 masked slots), and pools of 16-slot pages with a block table
    (shuffled, a missing page, a page shared by two rows, NaN / inf in pages no row
    holds; NaN keys on row 1's masked slots). V = 32 for G = 9 (two vectors a value row),
    else 64."""
    rng = np.random.default_rng(seed)
    b, k, h, s = 3, 2, 64, 1000
    v = 32 if g == 9 else 64
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), jnp.float32)
    kc = 3 * rng.standard_normal((b, k, s, h) if kl == "BKSH" else (b, k, h, s))
    # NaN keys on row 1's masked slots, some inside the vector that ends its prefix: the
    # maxima found with the scores (docs/decisions/0035-grouped-decode-streams.md) must
    # drop them by a select
    if kl == "BKSH":
        kc[1, :, 777:] = np.nan
    else:
        kc[1, ..., 777:] = np.nan
    vc = rng.standard_normal((b, k, s, v) if vl == "BKSH" else (b, k, v, s))
    vis = np.zeros((b, s), bool)
    vis[0] = rng.random(s) < 0.6
    vis[1, :777] = True
    vis[2, :4] = vis[2, 100:200] = vis[2, 263:300] = vis[2, 364:401] = vis[2, 900:] = True
    dense = (q, jnp.asarray(kc, jnp.float32), jnp.asarray(vc, jnp.float32), jnp.asarray(vis))
    kp, vp, table, pvis = _pages(rng, b, k, h, v, 16, 20, kl, vl)
    paged = (q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(pvis))
    return dense, paged, jnp.asarray(table)


def _grouped_matches_xla(g, layouts, impl="native"):
    kl, vl = layouts
    dense, paged, table = _grouped_problem(g, kl, vl, seed=g)
    for args, bt in ((dense, None), (paged, table)):
        ref = decode_kernels.partial_attention("xla", *args, kl, vl, block_table=bt)
        got = decode_kernels.partial_attention(impl, *args, kl, vl, block_table=bt)
        for name, r, o in zip("oml", ref, got):
            assert np.isfinite(np.asarray(o)).all(), name
            np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                       err_msg=f"{name} {'paged' if bt is not None else 'dense'}")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("layouts", LAYOUTS, ids=lambda x: "/".join(x))
@pytest.mark.parametrize("g", [1, 2, 3, 4, 8, 9])
def test_native_grouped_equals_xla(g, layouts):
    """The grouped kernel (G query heads a KV head; G = 2-9 on AVX-512 take the
    register-blocked scores, docs/decisions/0033-grouped-decode-blocking.md) against XLA,
    every layout: ragged rows, windows with sinks, masked slots and paged rows; (o, m, l)
    equal XLA's."""
    _grouped_matches_xla(g, layouts)


def _blocks_equal_xla(q, kc, vc, vis):
    """'native_blocks' on keys 'BKHS', values 'BKSH' equals XLA's (o, m, l); returns its
    statistics and 'native''s (the phases) on the same problem."""
    ref = decode_kernels.partial_attention("xla", q, kc, vc, vis, "BKHS", "BKSH")
    got = decode_kernels.partial_attention("native_blocks", q, kc, vc, vis, "BKHS", "BKSH")
    for name, r, o in zip("oml", ref, got):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                   err_msg=name)
    return got, decode_kernels.partial_attention("native", q, kc, vc, vis, "BKHS", "BKSH")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("v", [64, 32, 16])
@pytest.mark.parametrize("g", range(1, 10))
def test_native_blocks_equals_xla(g, v):
    """'native_blocks' (each fully visible dense run of a grouped row swept block by
    block, docs/decisions/0052-grouped-decode-blocks-per-machine.md) against XLA: rows of
    several spans fully visible, a run starting inside a span (at slot 128), a ragged end
    (S = 9,000), a row with masked slots and one that sees nothing; V = 64, 32 and 16 (4,
    2 and 1 vectors a value row; G = 7 and 9 split the values' heads unevenly). On AVX-512
    for G = 2-9 its sums differ from 'native''s in the last bits (another summation
    order): the sweep ran. Then a page pool of 512-slot pages whose one fully visible page
    of a row is a span's only run (the paged target sweeps it), and the ragged, windowed
    and paged problems of test_native_grouped_equals_xla."""
    b, k, h, s = 4, 2, 64, 9000
    rng = np.random.default_rng(11 + g)
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), jnp.float32)
    kc = jnp.asarray(3 * rng.standard_normal((b, k, h, s)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, k, s, v)), jnp.float32)
    vis = np.zeros((b, s), bool)
    vis[0] = True
    vis[1, 128:6144] = True
    vis[2] = rng.random(s) < 0.7
    got, phased = _blocks_equal_xla(q, kc, vc, jnp.asarray(vis))
    assert float(got[2][3].max()) == 0.0 and float(got[0][3].max()) == 0.0  # sees nothing
    swept = native.block_sweep() and 2 <= g <= 9
    assert (not np.array_equal(np.asarray(got[0][:2]), np.asarray(phased[0][:2]))) == swept
    # pools of 4 pages of P = 512; row 0 sees all of its page 2 only, row 1 its first 300
    # slots (a run that is not whole vectors: phases)
    p, n = 512, 4
    kp = jnp.asarray(rng.standard_normal((n, k, h, p)), jnp.float32)
    vp = jnp.asarray(rng.standard_normal((n, k, p, v)), jnp.float32)
    table = jnp.asarray([[3, 1, 2, 0], [0, 2, 1, 3]], jnp.int32)
    pvis = np.zeros((2, n * p), bool)
    pvis[0, 2 * p:3 * p] = True
    pvis[1, :300] = True
    args = (q[:2], kp, vp, jnp.asarray(pvis))
    ref = decode_kernels.partial_attention("xla", *args, "BKHS", "BKSH", block_table=table)
    got = decode_kernels.partial_attention("native_blocks", *args, "BKHS", "BKSH",
                                           block_table=table)
    for name, r, o in zip("oml", ref, got):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), atol=3e-5, rtol=3e-5,
                                   err_msg=f"{name} paged")
    _grouped_matches_xla(g, ("BKHS", "BKSH"), "native_blocks")


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("h", [16, 48, 96])
@pytest.mark.parametrize("g", [2, 4, 9])
def test_native_blocks_key_passes_equal_xla(g, h):
    """The sweep walks the key rows in passes of about 32 (SweepRows,
    docs/decisions/0053-sweep-passes-of-32-rows.md): H = 16 (one pass shorter than 32),
    48 (two balanced passes of 24, SweepRows) and 96 (three of 32) equal XLA on fully
    visible rows of 4,200 slots, and on AVX-512 differ from the phases in the last bits:
    the sweep ran."""
    b, k, v, s = 2, 1, 32, 4200
    rng = np.random.default_rng(5 * g + h)
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), jnp.float32)
    kc = jnp.asarray(3 * rng.standard_normal((b, k, h, s)), jnp.float32)
    vc = jnp.asarray(rng.standard_normal((b, k, s, v)), jnp.float32)
    got, phased = _blocks_equal_xla(q, kc, vc, jnp.ones((b, s), bool))
    assert (not np.array_equal(np.asarray(got[0]), np.asarray(phased[0]))) == \
        native.block_sweep()


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
@pytest.mark.parametrize("layouts", [("BKHS", "BKSH"), ("BKHS", "BKHS")],
                         ids=lambda x: "/".join(x))
@pytest.mark.parametrize("g", [1, 2, 3, 4, 8, 9])
def test_native_avx2_build_equals_xla(g, layouts, monkeypatch):
    """The same kernel built for AVX2 (``-mno-avx512f``: 8-float vectors, 16 registers,
    the fast path's other blockings) on the same problems equals XLA."""
    names = _avx2_targets()
    if names is None:
        pytest.skip("no AVX2 build (no compiler or no AVX2)")
    monkeypatch.setattr(native, "TARGET", names[0])
    monkeypatch.setattr(native, "PAGED_TARGET", names[1])
    _grouped_matches_xla(g, layouts)


def test_native_with_no_slot_sees_nothing():
    """A cache of 0 slots (a dense row of S = 0, a block table of 0 columns, pages of 0
    slots): no slot visible, m = -1e30, l = 0, o = 0 (once a division by zero)."""
    if not native.load():
        pytest.skip("the native library could not be built here")
    q = jnp.ones((2, 2, 3, 16), jnp.float32)
    cases = [(jnp.ones((2, 2, 16, 0)), jnp.zeros((2, 0), bool), None),
             (jnp.ones((8, 2, 16, 4)), jnp.zeros((2, 0), bool), jnp.zeros((2, 0), jnp.int32)),
             (jnp.ones((8, 2, 16, 0)), jnp.zeros((2, 0), bool), jnp.zeros((2, 3), jnp.int32))]
    for cache, vis, table in cases:
        o, m, l = decode_kernels.partial_attention("native", q, cache, cache, vis, "BKHS",
                                                   "BKHS", block_table=table)
        assert o.shape == (2, 2, 3, 16) and not np.asarray(o).any()
        assert (np.asarray(m) == -1e30).all() and not np.asarray(l).any()


@pytest.mark.parametrize("g,dtype", [(1, jnp.float32), (2, jnp.float32), (3, jnp.float32),
                                     (4, jnp.float32), (8, jnp.float32), (9, jnp.float32),
                                     (3, jnp.bfloat16), (9, jnp.bfloat16)],
                         ids=["1-f32", "2-f32", "3-f32", "4-f32", "8-f32", "9-f32", "3-bf16",
                              "9-bf16"])
def test_pallas_gpu_kernel_in_interpret_mode(g, dtype):
    """JAX's Pallas GPU decode-attention kernel, run by the Pallas interpreter on CPU,
    equals the XLA statistics (prefix masks: a dense cache's per-row lengths) for G = 1-9
    query heads a KV head: the G rows of a group are one block of its program (block_h =
    16), which loads each K/V block once for all of them."""
    q, kc, vc, mask, _, _ = problem(dtype, "BKSH", "BKSH", g=g, h=16, s=64, prefix=True)
    q1 = q[:, 0]
    ref = decode_kernels.partial_attention("xla", q1, kc, vc, mask[:, 0], "BKSH", "BKSH")
    out = decode_kernels.partial_attention("pallas", q1, kc, vc, mask[:, 0], "BKSH", "BKSH",
                                           interpret=True)
    for name, r, o in zip("oml", ref, out):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), **tol(dtype), err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("page_size,max_pages,g", [(1, 40, 3), (5, 9, 4), (16, 20, 20)])
def test_pallas_paged_kernel_reads_pages_in_place(page_size, max_pages, g, dtype):
    """JAX's Pallas GPU paged-attention kernel body over kvjax's [N, K, P, H] pools (Pallas
    interpret mode on CPU) gives XLA's statistics over the gathered views: pages of 1
    token (the kernel's 16-slot blocks span 16 pages), a page size that divides neither
    16 nor the rows, more query rows than one 16-row block (G = 20, a verify chunk's
    G·T), a page shared by two rows, -1 entries past a row's length, a row that sees
    nothing, and finite garbage in every slot past each row's length."""
    rng = np.random.default_rng(page_size)
    b, k, h = 4, 2, 16
    n = b * max_pages + 2
    kp = jnp.asarray(3 * rng.standard_normal((n, k, page_size, h)), dtype)
    vp = jnp.asarray(rng.standard_normal((n, k, page_size, h)), dtype)
    table = rng.permutation(n)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    lengths = np.array([max_pages * page_size, 2 * page_size + 1, 0, 7])
    table[1, 0] = table[0, 0]  # shared read-only
    for row, length in enumerate(lengths):
        table[row, paged.pages_for(int(length), page_size) + (row == 3):] = -1
    vis = jnp.asarray(np.arange(max_pages * page_size)[None] < lengths[:, None])
    q = jnp.asarray(rng.standard_normal((b, k, g, h)), dtype)
    args = (q, kp, vp, vis, "BKSH", "BKSH")
    ref = decode_kernels.partial_attention("xla", *args, block_table=jnp.asarray(table))
    out = decode_kernels.partial_attention("pallas", *args, block_table=jnp.asarray(table),
                                           interpret=True)
    seen = lengths[:, None, None] > 0
    for name, r, o in zip("oml", ref, out):
        r, o = np.asarray(r), np.asarray(o)
        if name == "m":  # -1e30 (XLA) or about -3.4e38 (Pallas) where nothing is seen
            assert (o[lengths == 0] < -1e30).all()
            r, o = np.where(seen, r, 0), np.where(seen, o, 0)
        np.testing.assert_allclose(o, r, **tol(dtype), err_msg=name)


def test_pallas_paged_refuses_slot_major_pools():
    q, kc, vc, mask, _, _ = problem(jnp.float32, "BKHS", "BKSH", h=16, s=64, prefix=True)
    with pytest.raises(ValueError, match="over pages.*'BKSH' for both"):
        decode_kernels.partial_attention("pallas", q[:, 0], kc, vc, mask[:, 0], "BKHS",
                                         "BKSH", interpret=True,
                                         block_table=jnp.zeros((2, 1), jnp.int32))


def test_pallas_refuses_slot_major_values_and_cpu():
    q, kc, vc, mask, _, _ = problem(jnp.float32, "BKSH", "BKHS", h=16, s=64, prefix=True)
    with pytest.raises(ValueError, match="'BKSH' for both"):
        decode_kernels.partial_attention("pallas", q[:, 0], kc, vc, mask[:, 0], "BKSH",
                                         "BKHS", interpret=True)
    assert not runs("pallas", "cpu", jnp.float32, "BKSH", "BKSH", "dense")
    assert runs("pallas", "gpu", jnp.float32, "BKSH", "BKSH", "dense")
    assert not runs("pallas", "gpu", jnp.float32, "BKSH", "BKSH", "ring")


@pytest.mark.parametrize("impl", ["xla_cache_left", "native"])
def test_model_decode_with_window_matches_reference(impl):
    """A whole model (GQA + a ring window of 8 slots, wrapped) decodes the same logits
    with each formulation."""
    from kvjax.models import model
    from kvjax import cache as cache_lib
    base = presets.variant(presets.blog_model("float32", vocab_size=64, num_layers=2,
                                              d_model=32, num_heads=4, num_kv_heads=4, head_dim=8,
                                              mlp_dim=64),
                           num_kv_heads=2, window_size=8)
    if impl == "native" and not native.load():
        pytest.skip("native kernel not built")
    logits = {}
    for name in ("xla", impl):
        cfg = planner.resolve(base.replace(decode_attention=name), max_seq_len=32,
                              batch_sizes=(1,))
        assert ("decode_attention" in cfg.plan.native) == (name == "native")
        params = model.init_params(cfg, 0)
        cache = cache_lib.init_cache(cfg, 1, 32)
        toks = jnp.arange(12, dtype=jnp.int32)[None] % 64
        out = []
        for t in range(12):  # 12 single-token steps: the 8-slot ring wraps
            lg, cache = model.forward(params, cfg, toks[:, t:t + 1],
                                      jnp.full((1, 1), t, jnp.int32), cache)
            out.append(lg)
        logits[name] = np.asarray(jnp.concatenate(out, axis=1))
    np.testing.assert_allclose(logits[impl], logits["xla"], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_forced_native_needs_a_resolved_plan_then_decodes_as_xla():
    """decode_attention='native' on a config without a plan is refused while the step is
    traced, naming planner.resolve (the kernel is only loaded there); resolved, the plan
    holds the kernel, the compiled step calls it, and its logits equal 'xla's; so for
    'native_blocks' (the same kernel)."""
    from kvjax import cache as cache_lib
    from kvjax.models import model
    from tests.conftest import tiny_config
    base = tiny_config(decode_attention="native")
    params = model.init_params(base, 0)
    toks = (jnp.arange(2 * 8, dtype=jnp.int32).reshape(2, 8) * 5) % base.vocab_size
    k = jax.ShapeDtypeStruct((2, base.num_kv_heads, 16, base.head_dim), jnp.float32)
    with pytest.raises(ValueError, match=r"decode_attention='native'.*planner\.resolve"):
        decode_kernels.choose(base, k, k)
    with pytest.raises(ValueError, match=r"decode_attention='native'.*planner\.resolve"):
        model.forward(params, base, toks[:, :1], jnp.zeros((2, 1), jnp.int32),
                      cache_lib.init_cache(base, 2, 16))
    logits = {}
    for name in ("xla", "native", "native_blocks"):
        cfg = planner.resolve(base.replace(decode_attention=name), max_seq_len=16,
                              batch_sizes=(2,), rows=(2 * 5,))
        assert ("decode_attention" in cfg.plan.native) == (name != "xla")
        cache = cache_lib.init_cache(cfg, 2, 16)
        lg, cache = model.forward(params, cfg, toks[:, :5],
                                  jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5)),
                                  cache)
        out = [lg]
        for t in range(5, 8):  # decode steps: the formulation under test
            lg, cache = model.forward(params, cfg, toks[:, t:t + 1],
                                      jnp.full((2, 1), t, jnp.int32), cache)
            out.append(lg)
        logits[name] = np.asarray(jnp.concatenate(out, axis=1))
        hlo = jax.jit(lambda p, c, tk, ps, cfg=cfg: model.forward(p, cfg, tk, ps, c)).lower(
            params, cache, toks[:, :1], jnp.full((2, 1), 8, jnp.int32)).as_text()
        assert (native.TARGET in hlo) == (name != "xla")
    for name in ("native", "native_blocks"):
        np.testing.assert_allclose(logits[name], logits["xla"], atol=1e-4, rtol=1e-4)


def test_config_names_the_bad_formulation():
    with pytest.raises(ConfigError, match="decode_attention.*'fast'"):
        presets.blog_model("float32", decode_attention="fast")
    # a kernel for another backend is refused when the config is built, not after the
    # weights load (a tester's int8 run on CPU with 'pallas' failed late, misnamed)
    with pytest.raises(ConfigError, match="decode_attention='pallas'.*backend 'cpu'"):
        presets.blog_model("float32", decode_attention="pallas", backend="cpu",
                           kv_dtype="int8")
    with pytest.raises(ConfigError, match="decode_attention='native'.*backend 'gpu'"):
        presets.blog_model("float32", decode_attention="native", backend="gpu")


def test_explicit_formulation_that_cannot_run_raises():
    # a config whose cache the kernel cannot read is refused when it is built (a tester's
    # bfloat16 run failed after the weights loaded, with a traceback)
    for kw in ({"dtype": "bfloat16"}, {"dtype": "float32", "kv_dtype": "int8"}):
        with pytest.raises(ConfigError, match="decode_attention='native'.*cache"):
            presets.blog_model(decode_attention="native", backend="cpu", **kw)
    with pytest.raises(ConfigError, match="weight_matmul='native'.*dtype='bfloat16'"):
        presets.blog_model("bfloat16", weight_matmul="native")
    presets.blog_model("bfloat16", weight_matmul="auto", decode_attention="auto")
    # the planner still refuses arrays the kernel cannot read (library calls)
    cfg = presets.blog_model("float32", decode_attention="native", backend="cpu")
    k = jax.ShapeDtypeStruct((1, 8, 64, 4096), jnp.bfloat16)
    with pytest.raises(ValueError, match="decode_attention='native' cannot run"):
        _choice(cfg, k, k)


def _fake_measure(calls):
    def measure(b, k, g, h, v, s, dtype, kl, vl, **_):
        calls.append((b, k, g, s))
        return {"choice": "xla_cache_left", "gbps": {"xla": 1.0, "xla_cache_left": 2.0},
                "seconds": {"xla": 2.0, "xla_cache_left": 1.0}, "slots": s}
    return measure


def test_planner_measures_once_then_reads_its_cache(planner_home, monkeypatch):
    calls = []
    monkeypatch.setattr(planner, "measure", _fake_measure(calls))
    planner.clear_memo()
    cfg = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="cpu",
                             decode_attention="auto")
    k = jax.ShapeDtypeStruct((1, 2, 64, 4096), jnp.float32)  # BKHS keys, 2 MiB
    v = jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.float32)
    assert cfg.cache_layout("k") == "BKHS"
    assert decode_kernels.choose(cfg, k, v) == "xla"  # no plan: the reference,
    assert calls == []  # and nothing is measured while a step is traced
    resolved = planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,))
    assert resolved.plan.decode_attention == ((CLASS, "xla_cache_left"),)
    assert decode_kernels.choose(resolved, k, v) == "xla_cache_left"  # what the step runs
    assert calls == [(1, 2, 4, 4096)]
    planner.clear_memo()
    again = planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,))
    assert again.plan == resolved.plan
    assert _choice(cfg, k, v) == "xla_cache_left"
    assert calls == [(1, 2, 4, 4096)]  # measured once; the later answers came from disk
    path = planner.cache_path()
    data = json.loads(path.read_text())
    assert data["machine"] == planner.machine_key("cpu")
    assert list(data["entries"]) == [CLASS]
    assert any("xla_cache_left" in ln for ln in planner.report_lines())
    planner.clear_memo()


def test_verify_chunks_get_their_own_class(planner_home, monkeypatch):
    """queries=(T,): decode attention is also measured for the G·T query rows of a chunk
    of T positions (a verify step of k + 1), and a chunk of T takes that pick; a chunk
    whose width was not resolved takes the one-position class's; T = 1 and T above
    SMALL_CHUNK add no class. The chunk's B·T rows get weight-product picks."""
    calls = []

    def measure(b, k, g, h, v, s, dtype, kl, vl, **_):
        calls.append((b, k, g, s))
        pick = "xla_cache_left" if g > 4 else "xla"  # the wide chunk's pick differs
        return {"choice": pick, "gbps": {"xla": 1.0, "xla_cache_left": 1.0},
                "seconds": {"xla": 1.0, "xla_cache_left": 1.0}, "slots": s}

    monkeypatch.setattr(planner, "measure", measure)
    planner.clear_memo()
    cfg = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="cpu",
                             decode_attention="auto")
    k = jax.ShapeDtypeStruct((1, 2, 64, 4096), jnp.float32)
    v = jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.float32)
    resolved = planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,),
                               queries=(1, 3, attention.SMALL_CHUNK + 1))
    wide = CLASS.replace("-G4-", "-G12-")
    assert dict(resolved.plan.decode_attention) == {CLASS: "xla", wide: "xla_cache_left"}
    assert sorted(calls) == [(1, 2, 4, 4096), (1, 2, 12, 4096)]
    assert decode_kernels.choose(resolved, k, v) == "xla"
    assert decode_kernels.choose(resolved, k, v, queries=3) == "xla_cache_left"
    assert decode_kernels.choose(resolved, k, v, queries=2) == "xla"  # not resolved
    # the chunks' B·T rows are weight-product rows too, without listing them in rows
    weight_rows = set()
    monkeypatch.setattr(planner.rm, "load", lambda: True)
    monkeypatch.setattr(planner, "_weight_pick",
                        lambda m, *_: weight_rows.add(m) or "xla")
    planner.resolve(cfg.replace(weight_matmul="auto"), max_seq_len=4096,
                    batch_sizes=(1, 2), queries=(3,))
    assert weight_rows == {1, 2, 3, 6}
    planner.clear_memo()


def test_planner_cache_dir_follows_its_own_variable(tmp_path, monkeypatch):
    """$KVJAX_PLANNER_CACHE moves the planner's files alone (the suite sets it, so its
    picks never reach the user's cache); unset, they live under $KVJAX_CACHE/planner."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv(planner.PLANNER_CACHE_ENV, str(tmp_path / "mine"))
    assert planner.cache_path().parent == tmp_path / "mine"
    monkeypatch.delenv(planner.PLANNER_CACHE_ENV)
    assert planner.cache_path().parent == tmp_path / "root" / "planner"
    assert planner.cache_path(kind="weight_matmul").name.startswith("weight_matmul-")


def test_planner_key_separates_machines(monkeypatch):
    key = planner.machine_key("cpu")
    assert {"cpu", "isa", "cores", "backend", "jax", "jaxlib", "kernel", "measure"} <= set(key)
    for field, other in (("cpu", "Other CPU"), ("isa", ["avx2"]), ("jax", "0.0.1"),
                         ("backend", "gpu"), ("measure", "warm")):
        assert planner.cache_path(dict(key, **{field: other})) != planner.cache_path(key)
    assert decode_attention_class(1, 2, 4, 64, 64, 3000, "float32", "BKHS", "BKSH") == \
        decode_attention_class(1, 2, 4, 64, 64, 4096, "float32", "BKHS", "BKSH")


@pytest.mark.parametrize("cold", [True, False])
def test_planner_flushes_the_caches_before_every_timed_call(monkeypatch, cold):
    """Measured cold (planner.FLUSH_BYTES read untimed before each timed call), as a decode
    step reads each layer's cache and weights; ``cold=False`` never flushes."""
    events = []

    def flusher():
        def flush():
            events.append("flush")
        return flush
    monkeypatch.setattr(planner, "_flusher", flusher)
    real_time = planner._time_all

    def spy(fns, args, rounds, budget_s, flush=None, warmups=2):
        wrapped = {}
        for n, f in fns.items():
            def call(*a, f=f, n=n):
                events.append(n)
                return f(*a)
            wrapped[n] = call
        return real_time(wrapped, args, rounds, budget_s, flush, warmups)
    monkeypatch.setattr(planner, "_time_all", spy)
    monkeypatch.setattr(planner, "MAX_CALLS", 3)  # one batch of rounds, decided or not
    planner.measure(1, 2, 4, 64, 64, 512, jnp.float32, "BKHS", "BKSH", rounds=3,
                    budget_s=0.0, cold=cold, candidates=("xla", "xla_cache_left", "native"))
    timed = events[events.index("flush"):] if cold else events[6:]  # after 2 warm-ups
    assert len([e for e in timed if e != "flush"]) == 9  # 3 rounds x 3 formulations
    if cold:
        assert timed == [x for n in timed if n != "flush" for x in ("flush", n)]
    else:
        assert "flush" not in events
    events.clear()
    # [1024, 4096] float32 (16 MiB): 3 copies make the 48 MiB stream
    planner.measure_weight_matmul(2, 1024, 4096, rounds=3, budget_s=0.0, cold=cold)
    assert events.count("flush") == (3 * len([e for e in set(events) if e != "flush"])
                                     if cold else 0)


def test_the_planner_measures_warm_where_the_environment_says(planner_home, monkeypatch):
    """$KVJAX_PLANNER_MEASURE: unset or 'cold', resolve's picks are measured with the
    flush, 'warm' without (the test session's); warm picks are kept in files of their own
    (so a cold pick is never read as a warm one, nor the reverse), and another value is
    refused, named, before anything is measured."""
    colds = []

    def measure(*a, cold=True, **k):
        colds.append(("attention", cold))
        return _fake_measure([])(*a, **k)

    def measure_weights(m, k, n, layout="kn", cold=True, **_):
        colds.append(("weights", cold))
        return {"choice": "xla", "gbps": {"xla": 1.0}, "seconds": {"xla": 1.0}}
    monkeypatch.setattr(planner, "measure", measure)
    monkeypatch.setattr(planner, "measure_weight_matmul", measure_weights)
    cfg = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="cpu",
                             decode_attention="auto")
    paths = []
    for how in (None, "warm", "cold"):
        if how is None:
            monkeypatch.delenv(planner.PLANNER_MEASURE_ENV, raising=False)
        else:
            monkeypatch.setenv(planner.PLANNER_MEASURE_ENV, how)
        planner.clear_memo()
        assert planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,)).plan \
            .decode_attention == ((CLASS, "xla_cache_left"),)
        planner._weight_pick(4, 576, 1536, "kn")
        paths.append(planner.cache_path())
    # unset: cold, measured; warm: measured again, without the flush; cold: read back
    assert colds == [("attention", True), ("weights", True),
                     ("attention", False), ("weights", False)]
    assert paths[0] == paths[2] != paths[1]
    assert json.loads(paths[1].read_text())["machine"]["measure"] == planner.WARM_METHOD
    assert json.loads(paths[0].read_text())["machine"]["measure"] == planner.MEASURE_METHOD
    monkeypatch.setenv(planner.PLANNER_MEASURE_ENV, "tepid")
    planner.clear_memo()
    with pytest.raises(ValueError, match=r"KVJAX_PLANNER_MEASURE='tepid'; allowed: 'cold'"):
        planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,))
    assert len(colds) == 4
    planner.clear_memo()


def test_the_flush_is_a_read_of_flush_bytes():
    """The real flusher is a read probe of planner.FLUSH_BYTES, and it runs."""
    flush = planner._flusher()
    assert flush.__self__.num_bytes == planner.FLUSH_BYTES
    assert flush() > 0  # bytes/s of the (untimed by the planner) read
    del flush


@pytest.mark.parametrize("content", ["{not json", json.dumps({"entries": 3}),
                                     "FOREIGN", json.dumps({"machine": {}, "entries": {
                                         "x": {"choice": "rm -rf"}}})])
def test_corrupt_or_foreign_planner_cache_is_ignored(planner_home, monkeypatch, content):
    key = planner.machine_key("cpu")
    path = planner.cache_path(key)
    path.parent.mkdir(parents=True)
    if content == "FOREIGN":  # a file recorded on another machine, copied here
        entry = {"choice": "native", "gbps": {}, "seconds": {}, "slots": 4096}
        content = json.dumps({"machine": dict(key, cpu="Some other CPU"),
                              "entries": {"B1-K2-G4-H64-V64-S4096-float32-BKHS-BKSH": entry}})
    path.write_text(content)
    with pytest.warns(UserWarning, match="ignoring planner cache"):
        assert planner.load_cache(path, key) == {}
    calls = []
    monkeypatch.setattr(planner, "measure", _fake_measure(calls))
    planner.clear_memo()
    cfg = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="cpu",
                             decode_attention="auto")
    k = jax.ShapeDtypeStruct((1, 2, 64, 4096), jnp.float32)
    v = jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.float32)
    with pytest.warns(UserWarning, match="ignoring planner cache"):
        cfg = planner.resolve(cfg, max_seq_len=4096, batch_sizes=(1,))
    assert cfg.plan.decode_attention == ((CLASS, "xla_cache_left"),)
    assert decode_kernels.choose(cfg, k, v) == "xla_cache_left"
    assert len(calls) == 1  # re-measured, and the file rewritten as this machine's
    assert json.loads(path.read_text())["machine"] == key
    planner.clear_memo()


def test_two_writers_of_one_planner_cache_keep_both_picks(planner_home, monkeypatch):
    """A class measured while another process added its own to the same file: the write
    keeps the other's entry (read again under the lock before writing), where a plain
    rewrite of what this process read at the start would have dropped it."""
    key = planner.machine_key("cpu")
    path = planner.cache_path(key)
    entries = planner.load_cache(path, key)  # this process reads: nothing yet
    other = {"choice": "native", "gbps": {}, "seconds": {}, "slots": 4096}

    def measure_while_another_writes():  # the other process saves while we measure
        planner._save(path, key, {"B9-other": dict(other)})
        return {"choice": "xla", "gbps": {}, "seconds": {}, "slots": 4096}

    memo = {}
    assert planner._cached_choice(memo, "B1-mine", key, path, entries,
                                  measure_while_another_writes) == "xla"
    on_disk = planner.load_cache(path, key)
    assert set(on_disk) == {"B9-other", "B1-mine"}
    assert on_disk["B9-other"]["choice"] == "native" and on_disk["B1-mine"]["choice"] == "xla"
    assert "B9-other" in entries  # and this process now knows it too
    # a class both measured: the writer's own (newer) pick wins, the rest is kept
    planner._save(path, key, {"B1-mine": dict(other)})
    on_disk = planner.load_cache(path, key)
    assert on_disk["B1-mine"]["choice"] == "native" and set(on_disk) == {"B9-other", "B1-mine"}


def test_small_caches_and_other_backends_skip_measuring(monkeypatch):
    monkeypatch.setattr(planner, "measure", lambda *a, **k: pytest.fail("measured"))
    cfg = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="cpu",
                             decode_attention="auto")
    tiny = jax.ShapeDtypeStruct((1, 2, 64, 16), jnp.float32)
    assert _choice(cfg, tiny, tiny.update(shape=(1, 2, 16, 64))) == "xla"
    small = planner.resolve(cfg, max_seq_len=16, batch_sizes=(1,))
    assert small.plan.decode_attention == (("B1-K2-G4-H64-V64-S16-float32-BKHS-BKSH",
                                            "xla"),)
    gpu = presets.blog_model("float32", num_kv_heads=2, attention="gqa", backend="gpu",
                             decode_attention="auto")
    big = jax.ShapeDtypeStruct((1, 2, 4096, 64), jnp.float32)
    assert _choice(gpu, big, big) == "pallas"
    gpu_plan = planner.resolve(gpu, max_seq_len=4096, batch_sizes=(1,))
    assert gpu_plan.plan.native == ()  # no CPU kernel for a GPU config
    assert decode_kernels.choose(gpu_plan, big, big) == "pallas"
    assert _choice(gpu.replace(window_size=512), big, big) == "xla"
    # under a multi-device mesh: the partitioned einsums, never the unsplittable kernel
    big_k = jax.ShapeDtypeStruct((1, 2, 64, 4096), jnp.float32)
    assert _choice(cfg, big_k, big, mesh=True) == "xla"
    # (unmeasured: on one device this 4096-slot class would be measured, and fail)
    # the plan holds what runs there: 'seq', the split cache's partial softmax states
    # combined across devices (the registry's rule), never the kernel
    meshed = planner.resolve(cfg, max_seq_len=4096, mesh_axes={"seq": 2})
    assert meshed.plan.decode_attention == ((CLASS, "seq"),)
    assert meshed.plan.mesh_axes == (("seq", 2),)
    assert decode_kernels.choose(meshed, big_k, big) == "seq"
    model_split = planner.resolve(cfg, max_seq_len=4096, mesh_axes={"model": 2})
    assert model_split.plan.decode_attention == ((CLASS, "xla"),)


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_cost_table_counts_the_kernels_buffers():
    """With decode_attention='native' XLA cannot cost the attention (a custom call): the
    step's table adds a 'bytes (+kernels)' row = XLA's bytes + the custom calls' operand
    and result bytes, which covers the cache the kernel reads."""
    from kvjax.analysis import costs, report
    from tests.conftest import tiny_config
    cfg = planner.resolve(tiny_config(decode_attention="native", key_layout="BKHS",
                                      value_layout="BKSH"), max_seq_len=64, batch_sizes=(1,))
    assert "decode_attention" in cfg.plan.native
    step = costs.analyze_decode_step(cfg, 64, attribute=False, jaxpr=False)
    assert step.xla.custom_calls and step.xla.uncosted_bytes >= step.cache_bytes
    row = next(ln for ln in report.cost_table(step).splitlines() if "bytes (+kernels)" in ln)
    plus = step.xla.bytes + step.xla.uncosted_bytes
    assert f"{plus:,.0f}" in row
    plain = costs.analyze_decode_step(cfg.replace(decode_attention="xla"), 64,
                                      attribute=False, jaxpr=False)
    assert "(+kernels)" not in report.cost_table(plain)
    assert plus >= 0.9 * plain.xla.bytes  # the kernel's reads put back what XLA left out


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_kernel_flops_put_back_what_xla_leaves_out():
    """XLA costs a custom call as -1 FLOP: hlo_cost.kernel_flops gives the native kernels'
    FLOP from their shapes (2·M·K·N per weight product, 2·B·K·G·S·(H+V) per decode
    attention), so XLA's FLOP + the kernels' equals the all-XLA program's dot FLOP (the
    exp/max/sum of XLA's softmax aside: XLA counts them, the formula does not) and the
    table gets a 'FLOP (+kernels)' row."""
    from kvjax.analysis import costs, hlo_cost, report
    from kvjax.native import rows_matmul
    from tests.conftest import tiny_config
    assert hlo_cost.kernel_flops("kvjax_rows_matmul", ["f32[3,40]{1,0}", "f32[40,7]{1,0}"],
                                 "f32[3,7]{1,0}") == 2 * 3 * 40 * 7
    assert hlo_cost.kernel_flops(
        "kvjax_decode_attention",
        ["f32[2,3,4,16]{3,2,1,0}", "f32[2,3,16,50]", "f32[2,3,50,8]", "pred[2,50]{1,0}"],
        "(f32[2,3,4,8]{3,2,1,0}, f32[2,3,4]{2,1,0}, f32[2,3,4]{2,1,0})") == \
        2 * 50 * (2 * 3 * 4 * 16 + 2 * 3 * 4 * 8)
    assert hlo_cost.kernel_flops("kvjax_prefill_attention", [], "f32[1]") is None
    cfg = tiny_config(decode_attention="native", key_layout="BKHS", value_layout="BKSH")
    if rows_matmul.load():
        cfg = cfg.replace(weight_matmul="native")
    cfg = planner.resolve(cfg, max_seq_len=64, batch_sizes=(1,))
    assert "decode_attention" in cfg.plan.native
    assert ("rows_matmul" in cfg.plan.native) == (cfg.weight_matmul == "native")
    step = costs.analyze_decode_step(cfg, 64, attribute=False, jaxpr=False)
    plain = costs.analyze_decode_step(cfg.replace(decode_attention="xla", weight_matmul="xla"),
                                      64, attribute=False, jaxpr=False)
    assert step.xla.uncosted_flops > 0.5 * plain.xla.flops
    plus = step.xla.flops + step.xla.uncosted_flops
    # theory counts the products' FLOP: the kernels' formula matches it; the all-XLA
    # program also counts its softmax's elementwise FLOP (a few % at these tiny shapes)
    np.testing.assert_allclose(plus, step.theory_flops, rtol=0.03)
    assert step.theory_flops < plain.xla.flops < 1.15 * plus
    row = next(ln for ln in report.cost_table(step).splitlines() if "FLOP (+kernels)" in ln)
    assert f"{plus:,.0f}" in row


@pytest.mark.parametrize("impl", ["xla", "xla_cache_left", "native"])
@pytest.mark.parametrize("layouts", [("BKSH", "BKSH"), ("BKHS", "BKSH"), ("BKHS", "BKHS")])
def test_small_chunk_equals_attention_over_the_concatenation(impl, layouts):
    """The verify-step formulation (T queries folded into the group rows of a decode
    formulation, then merged with the chunk's own causal keys) against :func:`attend`
    over (old slots ++ chunk), for a dense cache holding a prefix of each row: rows of
    different lengths, one with no old slot, a padded query row (position -1) whose
    output the caller zeroes."""
    if impl == "native" and not native.load():
        pytest.skip("native kernel not built (no compiler)")
    kl, vl = layouts
    b, kh, g, h, s, t = 3, 2, 3, 16, 70, 4
    rng = np.random.default_rng(0)
    arr = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    q, k_new, v_new = arr(b, t, kh, g, h), arr(b, kh, t, h), arr(b, kh, t, h)
    k_old, v_old = arr(b, kh, s, h), arr(b, kh, s, h)
    lengths = np.array([37, 0, 70])
    visible = jnp.asarray(np.arange(s)[None] < lengths[:, None])  # [B, S]
    causal = jnp.asarray(np.tril(np.ones((t, t), bool)))
    valid = np.ones((b, t), bool)
    valid[0, -1] = False  # a padded query row
    mask_new = causal[None] & jnp.asarray(valid)[:, :, None] & jnp.asarray(valid)[:, None]
    to = lambda x, layout: x if layout == "BKSH" else jnp.swapaxes(x, -1, -2)
    got = attention.attend_small_chunk(q, to(k_old, kl), to(v_old, vl), visible,
                                       to(k_new, kl), to(v_new, vl), mask_new, kl, vl,
                                       impl=impl, backend="cpu")
    mask_old = jnp.broadcast_to(visible[:, None], (b, t, s)) & jnp.asarray(valid)[:, :, None]
    want = attention.attend(q, jnp.concatenate([k_old, k_new], 2),
                            jnp.concatenate([v_old, v_new], 2),
                            jnp.concatenate([mask_old, mask_new], 2))
    ok = jnp.asarray(valid)[:, :, None, None, None]
    np.testing.assert_allclose(np.where(ok, got, 0), np.where(ok, want, 0), atol=2e-5,
                               rtol=2e-5)
