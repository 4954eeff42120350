"""Formulations of the decode step's attention over the cache's old slots.

A decode step (T = 1) reads every cached key and value once per KV head while the G query
heads of its group use them: B·G rows against a [S, H] matrix, a product with few rows
whose speed on a CPU depends on how it is written (issue 18: XLA:CPU's dot kernels read
a GQA cache at a third of the machine's streaming bandwidth). Each formulation here
computes the same partial softmax statistics of the old slots (flash-decoding's split,
Dao et al. 2023; the online softmax of Milakov & Gimelshein 2018):

    m[b,k,g] = max_s score          over visible slots s (-1e30 if none),
    l[b,k,g] = sum_s exp(score - m),
    o[b,k,g] = sum_s exp(score - m) · v[b,k,s],   score = q[b,k,g] · k[b,k,s] / sqrt(H),

and :func:`merge_new` folds in the new token's own key and value, so every formulation
returns what :func:`kvjax.models.attention.attend_step` returns. The formulations
('xla', 'xla_cache_left', 'native', 'native_blocks', 'pallas') are registered, with what
each applies to,
in :mod:`kvjax.kernels` (the table in docs/DESIGN.md); ``ModelConfig.decode_attention``
selects one, 'auto' the pick of the config's plan. 'pallas' over a paged float cache
runs the body of JAX's Pallas GPU paged-attention kernel (after vLLM's PagedAttention,
Kwon et al. 2023) over kvjax's [N, K, P, H] pools (:func:`_pallas_paged`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import kernels, native
from kvjax import plan as plan_lib
from kvjax.cache import paged, quant
from kvjax.cache.policy import policy_for
from kvjax.ops import NEG_INF, dot_operand
from kvjax.ops import layout_spec as _spec

IN_PLACE = tuple(f.name for f in kernels.formulations("decode_attention") if f.in_place)
"""Formulations that read a paged float cache's pools in place (the block table handed
to the kernel, :func:`partial_attention`); the others read gathered dense views."""
SMALL_CHUNK = 16
"""A chunk of at most this many tokens over a dense cache (a speculative verify step of
k + 1 <= 16 tokens) runs the decode step's formulation (op 'decode_attention', its G·T
query rows per KV head reading the cache once); longer chunks (prompts) run the prompt's
('prefill_attention')."""


def cache_dims(k_cache, v_cache, k_layout: str, v_layout: str) -> tuple[int, ...]:
    """(B, K, S, H, V) of one layer's keys and values (arrays, tracers or shape structs)
    in their layouts."""
    b, k = k_cache.shape[:2]
    s = k_cache.shape[2] if k_layout == "BKSH" else k_cache.shape[3]
    h = k_cache.shape[3] if k_layout == "BKSH" else k_cache.shape[2]
    v = v_cache.shape[3] if v_layout == "BKSH" else v_cache.shape[2]
    return b, k, s, h, v


def read_dtype(cfg):
    """The element type decode attention reads the cache in (:func:`kvjax.cache.read`):
    the model dtype for a quantized cache (dequantized), else the cache's own."""
    return cfg.jnp_dtype if cfg.kv_quantized else cfg.cache_dtype


def shape_class(cfg, b: int, s: int, dtype, page_size: int = 0, queries: int = 1) -> str:
    """The decode-attention shape class (:func:`kvjax.plan.decode_attention_class`) of
    ``cfg``'s cache with B = ``b`` rows of ``s`` slots of element type ``dtype``, on
    pages of ``page_size`` slots (0: dense rows), read by ``queries`` positions per row
    (T > 1: a small chunk such as a speculative verify step, whose G·T query rows per
    KV head read the cache once, as a decode step's G rows do: the class of G·T
    groups)."""
    k_layout, v_layout = cfg.cache_layout("k"), cfg.cache_layout("v")
    return plan_lib.decode_attention_class(
        b, cfg.num_kv_heads, cfg.num_groups * int(queries), cfg.head_dim, cfg.head_dim, s,
        jnp.dtype(dtype).name,
        k_layout, v_layout, policy_for(cfg).kind == "dense", page_size)


def site(cfg, b: int, t: int, s: int, cached: bool = True, page_size: int = 0,
         plan=None, dtype=None) -> kernels.Site:
    """The :class:`kvjax.kernels.Site` of one layer's attention of ``cfg``: a chunk of
    ``t`` tokens per row over B = ``b`` rows whose cache holds ``s`` slots (a paged
    cache's row views: ``page_size`` > 0), ``cached`` False for a prompt into an empty
    cache (or none). Its op is 'decode_attention' for T = 1 and for a small chunk over
    dense slots (T <= :data:`SMALL_CHUNK`), else 'prefill_attention'. ``plan``: the
    one whose native kernels and mesh count (default ``cfg.execution``); ``dtype``: the
    element type the cache is read in (default :func:`read_dtype`). Shapes only."""
    planned = plan is not None or cfg.plan is not None
    plan = cfg.execution if plan is None else plan
    if cfg.is_mla:  # a latent cache: MLA's one decode step, its prompt formulations
        step = cached and t == 1
        return kernels.Site(
            "decode_attention" if step else "prefill_attention",
            key="" if step else ("chunk" if cached else "prompt"), backend=cfg.backend,
            dtype=jnp.dtype(cfg.jnp_dtype).name, queries=int(t), slots=int(s),
            seq_shards=plan.seq_shards, devices=plan.num_devices, cached=bool(cached),
            mla=True, native=plan.native, planned=planned)
    kind = policy_for(cfg).kind
    decode = cached and (t == 1 or (t <= SMALL_CHUNK and kind == "dense"))
    dtype = (read_dtype(cfg) if dtype is None else dtype) if decode else cfg.jnp_dtype
    return kernels.Site(
        "decode_attention" if decode else "prefill_attention",
        key=shape_class(cfg, b, s, dtype, page_size, t) if decode else (
            "chunk" if cached else "prompt"),
        base_key=shape_class(cfg, b, s, dtype, page_size) if decode and t > 1 else "",
        backend=cfg.backend, dtype=jnp.dtype(dtype).name,
        k_layout=cfg.cache_layout("k"), v_layout=cfg.cache_layout("v"),
        head_dim=cfg.head_dim, groups=cfg.num_groups * int(t), slots=int(s),
        queries=int(t), slot_kind=kind,
        paged=page_size > 0, quantized=scaled_codes(cfg),
        sinks=cfg.num_sink_tokens > 0,
        sinks_at_cache=cfg.rope_positions == "cache" and cfg.num_sink_tokens > 0,
        softcap=cfg.attn_logit_softcap is not None, seq_shards=plan.seq_shards,
        devices=plan.num_devices,
        heads_split=cfg.num_kv_heads % plan.axis_size(plan_lib.MODEL) == 0,
        cached=bool(cached), mla=cfg.is_mla,
        selects_pages=decode and page_size > 0 and cfg.kv_selects_pages,
        native=plan.native, planned=planned)


def scaled_codes(cfg) -> bool:
    """Whether ``cfg``'s cache holds 1-byte codes with one scale per token per KV head
    (int8, fp8; :func:`kvjax.cache.row_scales` is not None for it)."""
    fmt = quant.format_for(cfg) if cfg.kv_quantized else None
    return fmt is not None and fmt.bits == 8 and not cfg.is_mla


def choose(cfg, k_cache, v_cache, page_size: int = 0, queries: int = 1) -> str:
    """The formulation of one layer's decode attention of ``cfg`` over caches shaped like
    ``k_cache``/``v_cache`` (only shapes are read; a paged cache's dense views,
    ``page_size`` > 0) read by ``queries`` positions per row: the config's pick for its
    :func:`site` (:meth:`kvjax.config.ModelConfig.formulation`, the registry's rule).

    Raises:
      ValueError: a formulation that cannot run this attention (the registry's reason).
    """
    b, _, s, _, _ = cache_dims(k_cache, v_cache, cfg.cache_layout("k"),
                               cfg.cache_layout("v"))
    return cfg.formulation(site(cfg, b, queries, s, True, page_size, dtype=k_cache.dtype))


def partial_attention(impl: str, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                      visible: jax.Array, k_layout: str, v_layout: str,
                      backend: str = "cpu", interpret: bool = False,
                      block_table: jax.Array | None = None):
    """Softmax statistics of the old slots, by formulation ``impl``.

    Args:
      impl: a decode-attention formulation of :mod:`kvjax.kernels`.
      q: [B, K, G, H] queries (any float dtype).
      k_cache: [B, K, S, H] ('BKSH') or [B, K, H, S] ('BKHS'); with ``block_table``, a
        page pool [N, K, P, H] or [N, K, H, P] (:mod:`kvjax.cache.paged`).
      v_cache: [B, K, S, V] ('BKSH') or [B, K, V, S] ('BKHS'); or a pool likewise.
      visible: [B, S] bool, the old slots each row's query sees ('pallas': must be a
        prefix of each row; only the count is used); with a block table S = M·P, the
        row's logical slots (slot j on page ``block_table[b, j // P]``, offset j % P).
      k_layout, v_layout: 'BKSH' or 'BKHS'.
      backend: the config's backend (2-byte operands are widened on CPU).
      interpret: 'pallas' only: run the kernel in Pallas interpret mode (CPU tests).
      block_table: [B, M] int32 pages of each row (-1: none; its slots must be
        invisible), or None for a dense cache. The formulations of :data:`IN_PLACE` read
        the pages where they lie ('native': the paged target of ``decode_attention.cc``;
        'pallas': :func:`_pallas_paged`, pools 'BKSH', visible slots a prefix); the
        others gather the rows' dense views first
        (:func:`kvjax.cache.paged.gather_view`, zeroed where invisible). Or [B, K, M]:
        each (row, KV head) its own pages (a read-time page selection, Quest), with
        ``visible`` [B, K, M·P]; 'xla' and 'xla_cache_left' gather them
        (:func:`kvjax.cache.paged.gather_heads`), 'native' reads them in place
        (:func:`_native`), 'pallas' refuses them.
    Returns:
      (o [B, K, G, V] float32, m [B, K, G] float32, l [B, K, G] float32), see the module
      docstring; m = -1e30 (native, XLA) or about -3.4e38 (Pallas) and l = 0 where no slot
      is visible.
    Raises:
      ValueError: an unknown impl or layout; 'pallas' with layouts other than 'BKSH' or a
      slot count it cannot split; 'native' with a non-float32 cache.
    """
    kernels.get("decode_attention", impl)  # refuses an unknown or unselectable name
    return kernels.run("decode_attention", impl, q, k_cache, v_cache, visible, k_layout,
                       v_layout, q.shape[-1] ** -0.5, backend, interpret, block_table,
                       entry="partial")


def _views(k_cache, v_cache, visible, k_layout, v_layout, block_table):
    """The rows' dense views of a paged cache (:func:`kvjax.cache.paged.gather_view`, or
    :func:`kvjax.cache.paged.gather_heads` for per-head tables [B, K, M]; zeroed where
    invisible); the caches as they are without a block table."""
    if block_table is None:
        return k_cache, v_cache
    gather = paged.gather_heads if block_table.ndim == 3 else paged.gather_view
    return tuple(gather(x, block_table, -1 if lay == "BKHS" else -2, visible)
                 for x, lay in ((k_cache, k_layout), (v_cache, v_layout)))


def _per_head(visible: jax.Array) -> jax.Array:
    """``visible`` as [B, K or 1, S]: per (row, KV head) visibility, or a row's for all
    its heads."""
    return visible if visible.ndim == 3 else visible[:, None]


def partial_xla(name, q, k_cache, v_cache, visible, k_layout, v_layout, scale, backend,
                interpret, block_table):
    """'xla': einsums with the queries as the left operand (over the dense views)."""
    k_cache, v_cache = _views(k_cache, v_cache, visible, k_layout, v_layout, block_table)
    qd, kd, vd = (dot_operand(x, backend) for x in (q, k_cache, v_cache))
    s = jnp.einsum(f"BKGH,{_spec(k_layout)}->BKGS", qd, kd,
                   preferred_element_type=jnp.float32) * scale
    vis = _per_head(visible)[:, :, None, :]
    s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, axis=-1)
    e = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
    o = jnp.einsum(f"BKGS,{_spec(v_layout, 'V')}->BKGV", e.astype(vd.dtype), vd,
                   preferred_element_type=jnp.float32)
    return o, m, jnp.sum(e, axis=-1)


def partial_cache_left(name, q, k_cache, v_cache, visible, k_layout, v_layout, scale,
                       backend, interpret, block_table):
    """'xla_cache_left': einsums with the cache as the left operand (over the dense
    views)."""
    k_cache, v_cache = _views(k_cache, v_cache, visible, k_layout, v_layout, block_table)
    qd, kd, vd = (dot_operand(x, backend) for x in (q, k_cache, v_cache))
    s = jnp.einsum(f"{_spec(k_layout)},BKGH->BKSG", kd, qd,
                   preferred_element_type=jnp.float32) * scale
    vis = _per_head(visible)[:, :, :, None]
    s = jnp.where(vis, s, NEG_INF)
    m = jnp.max(s, axis=2)  # [B, K, G]
    e = jnp.where(vis, jnp.exp(s - m[:, :, None, :]), 0.0)  # [B, K, S, G]
    o = jnp.einsum(f"{_spec(v_layout, 'V')},BKSG->BKGV", vd, e.astype(vd.dtype),
                   preferred_element_type=jnp.float32)
    return o, m, jnp.sum(e, axis=2)


def partial_native(name, q, k_cache, v_cache, visible, k_layout, v_layout, scale, backend,
                   interpret, block_table):
    """'native': the custom call (its paged target with a block table)."""
    return _native(q, k_cache, v_cache, visible, k_layout, v_layout, scale, block_table)


def partial_native_blocks(name, q, k_cache, v_cache, visible, k_layout, v_layout, scale,
                          backend, interpret, block_table):
    """'native_blocks': the custom call, each fully visible dense run of a grouped row
    swept block by block (``blocks=1``)."""
    return _native(q, k_cache, v_cache, visible, k_layout, v_layout, scale, block_table,
                   blocks=True)


def partial_pallas(name, q, k_cache, v_cache, visible, k_layout, v_layout, scale, backend,
                   interpret, block_table):
    """'pallas': JAX's Pallas decode kernel, or its paged kernel's body over the pools."""
    if block_table is not None and block_table.ndim == 3:
        raise ValueError("decode_attention='pallas': a block table per (row, KV head) "
                         f"{block_table.shape}; allowed: [B, M] (one per row)")
    if block_table is not None:
        return _pallas_paged(q, k_cache, v_cache, visible, k_layout, v_layout, scale,
                             interpret, block_table)
    return _pallas(q, k_cache, v_cache, visible, k_layout, v_layout, scale, interpret)


def _native(q, k_cache, v_cache, visible, k_layout, v_layout, scale, block_table=None,
            blocks: bool | None = False):
    """The native kernel's custom call (:func:`partial_attention`'s 'native'; with
    ``blocks``, 'native_blocks': on AVX-512, G = 2 to 9 and values 'BKSH', each fully
    visible dense run is swept block by block, flash-decoding's per-block update, Dao et
    al. 2023; other shapes run as 'native'). ``blocks=None`` leaves the attribute out: a
    kernel built from a source before it (``scripts/decode_attention_ab.py``'s baseline).

    A per-head table ([B, K, C], ``visible`` [B, K, C·P]: each KV head its own pages) is
    read by the paged target as a per-row table of B·K rows of one KV head each over the
    pools viewed as [N·K, 1, P, X] (a reshape of the contiguous [N, K, P, X], no copy):
    entry c of (b, k) names page tables[b, k, c]·K + k. So the kernel reads each head's
    chosen pages where they lie, and nothing else of the pools.
    """
    if block_table is not None and block_table.ndim == 3:
        b, k, g, h = q.shape
        heads = jnp.arange(k, dtype=jnp.int32)[None, :, None]
        rows = jnp.where(block_table >= 0, block_table * k + heads, -1).reshape(b * k, -1)
        pools = [x.reshape((x.shape[0] * k, 1) + x.shape[2:]) for x in (k_cache, v_cache)]
        o, m, l = _native(q.reshape(b * k, 1, g, h), *pools, visible.reshape(b * k, -1),
                          k_layout, v_layout, scale, rows, blocks)
        return o.reshape(b, k, g, -1), m.reshape(b, k, g), l.reshape(b, k, g)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != jnp.float32:
            raise ValueError(f"decode_attention='native': {name} dtype {x.dtype}; "
                             "allowed: float32 (use 'xla' for other cache dtypes)")
    _spec(k_layout), _spec(v_layout)
    if not native.load():
        raise RuntimeError("decode_attention='native': the native library could not be "
                           "built or loaded (see the warning); use 'xla'")
    b, k, g, _ = q.shape
    width = v_cache.shape[3] if v_layout == "BKSH" else v_cache.shape[2]
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((b, k, g, width), f32), jax.ShapeDtypeStruct((b, k, g), f32),
           jax.ShapeDtypeStruct((b, k, g), f32))
    attrs = dict(k_bksh=np.int64(k_layout == "BKSH"), v_bksh=np.int64(v_layout == "BKSH"),
                 scale=np.float32(scale), threads=np.int64(native.num_threads()))
    if blocks is not None:
        attrs["blocks"] = np.int64(blocks)
    args = (q.astype(f32), k_cache, v_cache, visible.astype(jnp.bool_))
    if block_table is None:
        return jax.ffi.ffi_call(native.TARGET, out, vmap_method="sequential")(*args, **attrs)
    return jax.ffi.ffi_call(native.PAGED_TARGET, out, vmap_method="sequential")(
        *args, block_table.astype(jnp.int32), **attrs)


def _pallas(q, k_cache, v_cache, visible, k_layout, v_layout, scale, interpret):
    # imported where used: Pallas' GPU module loads Triton lowering rules
    from jax.experimental.pallas.ops.gpu import decode_attention as pda  # noqa: PLC0415
    if k_layout != "BKSH" or v_layout != "BKSH":
        raise ValueError(f"decode_attention='pallas': layouts {k_layout!r}/{v_layout!r}; "
                         "allowed: 'BKSH' for both")
    b, k, g, h = q.shape
    s = k_cache.shape[2]
    split = kernels._pallas_splits(s)  # noqa: SLF001 (the registry owns the rule)
    if split is None:
        raise ValueError(f"decode_attention='pallas': {s} slots; allowed: a count the "
                         "kernel splits into chunks that are multiples of 16")
    splits, block_k = split
    lengths = jnp.sum(visible, axis=-1).astype(jnp.int32)  # visible = a prefix [0, n)
    kernel = lambda qq, kk, vv, n: pda.decode_attn_unbatched(  # noqa: E731
        qq, kk, vv, None, n, sm_scale=scale, block_h=16, block_k=block_k,
        k_splits=splits, num_warps=None, num_stages=2, grid=None, interpret=interpret,
        debug=False, return_residuals=True, normalize_output=False)
    per_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))
    o, (l, m) = jax.vmap(per_head, in_axes=(0, 0, 0, 0))(
        q.astype(k_cache.dtype), k_cache, v_cache, lengths)
    return o.astype(jnp.float32), m, l


def _pallas_paged(q, k_pool, v_pool, visible, k_layout, v_layout, scale, interpret,
                  block_table):
    """The Pallas GPU paged-attention kernel's body over kvjax's pools, returning the
    softmax statistics :func:`merge_new` folds the new token into.

    ``jax.experimental.pallas.ops.gpu.paged_attention`` wants pools [K, N, P, H] and
    returns the normalised output only; kvjax's pools are [N, K, P, H] and the decode
    step merges the new token after reading the old slots (the write comes after, so
    the update stays in place). So the library's kernel (``paged_attention_kernel``) is
    called here with block specs that select one KV head of the [N, K, P, H] pools (no
    transposed copy), and its per-split (o, l, m) are merged without normalising.

    The block table is padded with page 0 to a whole number of kernel blocks and its -1
    entries read page 0: the kernel masks every slot at or past the row's length
    (``visible`` must be a prefix of each row, as in a dense cache without a window).

    Args:
      q: [B, K, G, H]; k_pool, v_pool: [N, K, P, H] and [N, K, P, V] (V = H);
      visible: [B, M·P] bool; block_table: [B, M] int32. Returns (o, m, l) as
      :func:`partial_attention`.
    Raises:
      ValueError: layouts other than 'BKSH' or V != H.
    """
    # imported where used: Pallas' GPU module loads Triton lowering rules
    from jax.experimental import pallas as pl  # noqa: PLC0415
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415
    from jax.experimental.pallas.ops.gpu import paged_attention as ppa  # noqa: PLC0415
    if k_layout != "BKSH" or v_layout != "BKSH" or k_pool.shape != v_pool.shape:
        raise ValueError(f"decode_attention='pallas' over pages: layouts {k_layout!r}/"
                         f"{v_layout!r}, pools {k_pool.shape}/{v_pool.shape}; allowed: "
                         "'BKSH' for both, keys and values of one shape")
    b, k, g, h = q.shape
    n_pages, _, page, _ = k_pool.shape
    block_h = 16
    g_pad = -(-g // block_h) * block_h
    per_block = max(1, -(-16 // page))  # a block of >= 16 slots for the kernel's dots
    m_pages = block_table.shape[1]
    splits = max(1, min(16, m_pages // per_block))
    pad = -m_pages % (splits * per_block)
    table = jnp.pad(jnp.maximum(block_table, 0), ((0, 0), (0, pad)))
    table = table.reshape(b, splits, -1).astype(jnp.int32)
    lengths = jnp.sum(visible, axis=-1).astype(jnp.int32)[:, None]  # a prefix [0, n)
    qs = jnp.pad((q * scale).astype(k_pool.dtype), ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    kernel = functools.partial(ppa.paged_attention_kernel, num_heads=g,
                               pages_per_compute_block=per_block,
                               mask_value=ppa.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None)
    pool_spec = pl.BlockSpec((n_pages, None, page, h), lambda kh, i, j: (0, kh, 0, 0))
    call = pl.pallas_call(
        kernel, grid=(k, g_pad // block_h, splits),
        in_specs=[pl.BlockSpec((None, block_h, h), lambda kh, i, j: (kh, i, 0)), pool_spec,
                  None, pool_spec, None,
                  pl.BlockSpec((None, table.shape[2]), lambda kh, i, j: (j, 0)),
                  pl.BlockSpec((1,), lambda kh, i, j: (0,))],
        out_specs=[pl.BlockSpec((None, None, block_h, h), lambda kh, i, j: (j, kh, i, 0)),
                   pl.BlockSpec((None, None, block_h), lambda kh, i, j: (j, kh, i)),
                   pl.BlockSpec((None, None, block_h), lambda kh, i, j: (j, kh, i))],
        out_shape=[jax.ShapeDtypeStruct((splits, k, g_pad, h), k_pool.dtype),
                   jax.ShapeDtypeStruct((splits, k, g_pad), jnp.float32),
                   jax.ShapeDtypeStruct((splits, k, g_pad), jnp.float32)],
        interpret=interpret, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name=f"kvjax_paged_attention_p{page}")
    row = lambda qq, kk, vv, tt, nn: call(qq, kk, None, vv, None, tt, nn)  # noqa: E731
    o, l, m = jax.vmap(row, in_axes=(0, None, None, 0, 0))(qs, k_pool, v_pool, table, lengths)
    o, l, m = o[..., :g, :].astype(jnp.float32), l[..., :g], m[..., :g]  # [B, splits, K, G(, H)]
    m_all = jnp.max(m, axis=1)
    w = jnp.where(l > 0, jnp.exp(m - m_all[:, None]), 0.0)
    return (jnp.sum(o * w[..., None], axis=1), m_all, jnp.sum(l * w, axis=1))


def merge_new(o: jax.Array, m: jax.Array, l: jax.Array, s_new: jax.Array,
              v_new: jax.Array, new_visible: jax.Array | None = None) -> jax.Array:
    """Folds the new token into the old slots' statistics and normalises.

    Args:
      o, m, l: from :func:`partial_attention` ([B, K, G, V], [B, K, G], [B, K, G]).
      s_new: [B, K, G] float32, each query's scaled score of its own new key, or that
        score in every element of the output, [B, K, G, V] (:func:`kvjax.ops.lane_sum`:
        then every step below is elementwise on [B, K, G, V] and XLA:CPU runs the merge
        as one fusion).
      v_new: [B, K, V] the new token's value.
      new_visible: [B] bool, whether each row's query sees its new key (None: all do).
    Returns:
      [B, K, G, V] float32: softmax attention over (old slots ++ new token); zeros for a
      row that sees no key.
    """
    if s_new.ndim == m.ndim:
        s_new = s_new[..., None]
    m, l = m[..., None], l[..., None]  # [B, K, G, 1]
    if new_visible is not None:
        s_new = jnp.where(new_visible[:, None, None, None], s_new, NEG_INF)
    mm = jnp.maximum(m, s_new)
    a = jnp.where(l > 0, jnp.exp(m - mm), 0.0)
    e_new = jnp.exp(s_new - mm)
    if new_visible is not None:
        e_new = jnp.where(new_visible[:, None, None, None], e_new, 0.0)
    denom = a * l + e_new
    out = a * o + e_new * v_new[:, :, None, :].astype(jnp.float32)
    return out / jnp.where(denom > 0, denom, 1.0)
