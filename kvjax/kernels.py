"""Every formulation kvjax can run, registered once: the kernel registry.

A *formulation* is one way to compute one operation of the model: the decode step's
attention over the cache (``model.decode_attention``), a product of a few activation rows
with a weight (``model.weight_matmul``) and the prompt's attention (``model.prefill_impl``).
Each is registered here with what it applies to, where it is implemented and how the cost
report counts its FLOP and bytes, and the names here are the only list: the config's
validation (:mod:`kvjax.config`), the formulation modules, the planner's candidates, the benchmarks' flags and the table in docs/DESIGN.md
(:func:`markdown_table`, checked by a test) all read them.

``'auto'`` is not a formulation: it asks the config's plan (:mod:`kvjax.plan`, built by
:func:`kvjax.planner.resolve` before tracing) for the one measured fastest here.

Counting (:mod:`kvjax.analysis.hlo_cost`):

* ``'xla'``: XLA ops, counted by XLA's own cost analysis.
* ``'custom call'``: an XLA FFI custom call (``target``), which XLA costs as -1; the cost
  hook removes that, adds its operand and output bytes (what it moves at least) and its
  FLOP from the target's formula (``hlo_cost.kernel_flops``) where one exists, and the
  report shows them as "+kernels" beside XLA's figure.
* ``'pallas'``: a Pallas kernel (Triton on GPU): a custom call on GPU, XLA ops in
  interpret mode.

This module imports nothing from kvjax, so every layer may read it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

OPS = ("decode_attention", "weight_matmul", "prefill_attention")
AUTO = "auto"
DEFAULT = {"decode_attention": "xla", "weight_matmul": "xla", "prefill_attention": "native"}
"""What 'auto' runs where the plan holds no pick for the class: the reference
formulations, and for the prompt the native kernel where it applies (loaded in the plan),
else its fallback 'tiled'."""
REFERENCE = {"decode_attention": "xla", "weight_matmul": "xla", "prefill_attention": "tiled"}
"""The reference formulation of each op (what a config without a plan runs)."""
NATIVE = ("decode_attention", "decode_attention_blocks", "prefill_attention", "rows_matmul")
"""The native CPU kernels a plan may hold (:data:`kvjax.plan.NATIVE_KERNELS`)."""


@dataclasses.dataclass(frozen=True)
class Site:
    """One shape class of one op: everything a formulation's ``applies`` reads.

    Built from shapes and the config before tracing, or while tracing from static shapes
    (:func:`kvjax.models.attention.site`, :func:`kvjax.models.weight_matmul.site`); it
    holds no arrays, so the planner and the validation build the same ones.

    Attributes:
      op: one of :data:`OPS`.
      key: the plan's name of the class (:func:`kvjax.plan.decode_attention_class`,
        :func:`kvjax.plan.weight_class`; '' for the prompt's attention).
      base_key: the class whose pick a small chunk's class (T > 1) falls back to where
        the plan measured none: the one-position class ('' otherwise).
      backend: 'cpu', 'gpu' or 'tpu'.
      dtype: element type name the formulation reads (a cache's read dtype, the model's
        for a prompt, the weight's for a product).
      k_layout, v_layout: 'BKSH' or 'BKHS' (attention).
      head_dim: H; groups: G·T query rows per KV head (0: not known); slots: S of the
        cache (0: none); queries: T positions per row;
      rows: M rows of a weight product (-1: not known yet, a config's static site);
      layout: 'kn' or 'nk' of its weight.
      slot_kind: the cache policy's kind ('dense', 'ring', 'dense_window').
      paged: the cache is a page pool read through a block table.
      quantized: the cache holds 1-byte codes with per-slot scales.
      sinks: the cache keeps attention sinks (``num_sink_tokens`` > 0).
      sinks_at_cache: attention sinks scored at cache positions (``rope_positions``).
      softcap: the scores are soft-capped (``attn_logit_softcap``).
      seq_shards: devices splitting the cache's slots (the mesh's 'seq' axis).
      devices: devices of the mesh the program runs on (1: one device).
      heads_split: the mesh's 'model' axis divides the KV heads.
      cached: the chunk attends over a cache's old slots too (False: a fresh prompt).
      mla: multi-head latent attention.
      selects_pages: a paged decode site of a config that chooses the pages each KV
        head reads (Quest, ``ModelConfig.kv_selects_pages``).
      native: the native kernels loaded in the plan (:data:`kvjax.plan.NATIVE_KERNELS`).
      planned: the config has a resolved plan (False: a library call without one).
    """

    op: str
    key: str = ""
    base_key: str = ""
    backend: str = "cpu"
    dtype: str = "float32"
    k_layout: str = "BKSH"
    v_layout: str = "BKSH"
    head_dim: int = 64
    groups: int = 0
    slots: int = 0
    queries: int = 1
    rows: int = 1
    layout: str = "kn"
    slot_kind: str = "dense"
    paged: bool = False
    quantized: bool = False
    sinks: bool = False
    sinks_at_cache: bool = False
    softcap: bool = False
    seq_shards: int = 1
    devices: int = 1
    heads_split: bool = True
    cached: bool = True
    mla: bool = False
    selects_pages: bool = False
    native: tuple = ()
    planned: bool = True


def _always(site: Site) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Formulation:
    """One registered formulation.

    Attributes:
      op: one of :data:`OPS`.
      name: the value of the config field that selects it.
      backends: where it runs ('cpu', 'gpu'; XLA formulations run everywhere).
      scope: what it applies to, in one line (dtypes, layouts, cache kinds, sizes).
      implementation: where it is implemented (for the docs).
      counted: how the cost report counts it: 'xla', 'custom call' or 'pallas' (module
        docstring).
      target: the custom-call target name, or None.
      paged_target: the target of its variant over a paged cache (page pools and a block
        table, :mod:`kvjax.cache.paged`), or None.
      fn: 'module:function' that computes it, called by :func:`run`; or '.method', a
        method of the call object :func:`run` is handed first (attention: one
        :class:`kvjax.models.attention.Call` per model variant, e.g. MLA's own).
      step, partial: decode attention only: 'module:function' of its one-position step
        (:func:`kvjax.models.attention.attend_step`) and of its kernel over the old
        slots (the partial softmax statistics,
        :func:`kvjax.models.decode_kernels.partial_attention`), ``run(..., entry=)``.
      applies: Site -> None where it runs, else the reason it does not (one phrase).
      fallback: the formulation that runs where this one does not apply; None: a
        request for it there is refused (ValueError naming the reason).
      forced_by: Site -> bool, or None: where True, this formulation runs whatever was
        requested among ``stands_in`` (a rule of the model, not a speed pick: soft-capped
        scores, sinks at cache positions, a cache split over devices).
      stands_in: the names it replaces where ``forced_by`` holds ('*': every one).
      selectable: a value of the config field (False: only ``forced_by`` picks it).
      in_place: reads a paged float cache's pools where they lie (the others read the
        rows' gathered views).
      skips_masked: contributes nothing from masked slots whatever they hold (so the
        programs need not clear never-written slots first, ``model.clear_masked_slots``).
      measured: the planner times it for 'auto' (:func:`candidates`).
      needs_plan: a kernel the planner builds and loads: asked for by name on a config
        without a plan, it is refused (naming :func:`kvjax.planner.resolve`) instead of
        falling back.
    """

    op: str
    name: str
    backends: tuple
    scope: str
    implementation: str
    counted: str = "xla"
    target: str | None = None
    paged_target: str | None = None
    fn: str = ""
    step: str = ""
    partial: str = ""
    applies: Callable[[Site], str | None] = _always
    fallback: str | None = None
    forced_by: Callable[[Site], bool] | None = None
    stands_in: tuple = ()
    selectable: bool = True
    in_place: bool = False
    skips_masked: bool = False
    measured: bool = False
    needs_plan: bool = False


def _first(*checks) -> str | None:
    """The first reason of ``checks`` ((condition, reason), ...) whose condition holds."""
    return next((why for bad, why in checks if bad), None)


def _native_decode(s: Site) -> str | None:
    return _first((s.backend != "cpu", f"a CPU kernel (backend {s.backend!r})"),
                  (s.dtype != "float32", f"reads float32 caches (got {s.dtype})"),
                  (s.devices > 1, "one device, not a mesh (XLA cannot partition the "
                                  "custom call: it would gather the sharded cache)"),
                  ("decode_attention" not in s.native,
                   "the config's plan holds no native decode-attention kernel (resolve "
                   "the config with kvjax.planner.resolve, which builds and loads it)"))


def _native_blocks(s: Site) -> str | None:
    return _native_decode(s) or _first(
        ("decode_attention_blocks" not in s.native,
         "this machine's kernel has no block sweep (AVX-512 only)"),
        (s.groups and not 2 <= s.groups <= 9, f"G = 2 to 9 query heads per KV head (got "
                                               f"{s.groups}; 'native' reads the others)"),
        (s.v_layout != "BKSH", f"values 'BKSH' (got {s.v_layout!r})"),
        (s.head_dim % 16, f"H a multiple of 16 (got {s.head_dim})"),
        (s.paged, "dense rows, not page pools"),
        (s.slot_kind != "dense", f"a dense cache (got {s.slot_kind!r})"))


def _pallas_decode(s: Site) -> str | None:
    h = s.head_dim
    return _first((s.backend != "gpu", f"a GPU kernel (backend {s.backend!r})"),
                  (s.k_layout != "BKSH" or s.v_layout != "BKSH",
                   f"layouts 'BKSH' only (got {s.k_layout}/{s.v_layout})"),
                  (s.slot_kind != "dense", f"visible slots a prefix (a {s.slot_kind} cache)"),
                  (h < 16 or h & (h - 1), f"head_dim a power of two >= 16 (got {h})"),
                  (_pallas_splits(s.slots) is None,
                   f"a slot count it splits into chunks of 16 (got {s.slots})"))


def _pallas_splits(slots: int) -> tuple[int, int] | None:
    """(k_splits, block_k) for the Pallas decode kernel at ``slots``: S = splits · chunk
    with chunk a multiple of block_k >= 16; None if S has no such split."""
    for splits in (16, 8, 4, 2, 1):
        if slots % splits:
            continue
        chunk = slots // splits
        for block_k in (128, 64, 32, 16):
            if chunk >= block_k and chunk % block_k == 0:
                return splits, block_k
    return None


def _rows_kernel(s: Site) -> str | None:
    return _first((s.backend != "cpu", f"a CPU kernel (backend {s.backend!r})"),
                  (s.dtype not in ("float32", "int8"),
                   f"multiplies float32 (or int8) weights (got {s.dtype})"),
                  (s.devices > 1, "one device, not a mesh (XLA cannot partition the "
                                  "custom call: it would gather every weight each step)"),
                  ("rows_matmul" not in s.native,
                   "the config's plan holds no loaded row-product kernel"),
                  (s.rows >= 0 and not 0 < s.rows <= ROWS_MAX,
                   f"M <= {ROWS_MAX} rows (got {s.rows})"))


ROWS_MAX = 256
"""The row-product kernel's most rows (:data:`kvjax.native.rows_matmul.MAX_ROWS`)."""

_ATTN = "kvjax.models.attention"
_MLA = "kvjax.models.mla"
_WM = "kvjax.models.weight_matmul"
_DK = "kvjax.models.decode_kernels"

def _selects(s: Site) -> bool:
    """A one-position step over a paged cache whose config selects the pages to read."""
    return s.selects_pages and s.queries == 1


REGISTRY = (
    # lever 5 at read time (Quest): a rule of the config, never timed; first, so that
    # no other rule (1-byte codes) stands in for the page choice
    # (docs/decisions/0038-quest-pages-native-rule.md)
    Formulation("decode_attention", "pages_native", ("cpu",),
                "a page-selecting config's step over float32 pools (Quest): each KV "
                "head's chosen pages read in place, one block table per (row, KV head)",
                "kvjax/native/decode_attention.cc", "custom call",
                paged_target="kvjax_paged_decode_attention", fn=".run_pages",
                step=f"{_ATTN}:step_pages_native",
                applies=lambda s: _native_decode(s) or _first(
                    (s.quantized, "float32 pools (1-byte codes read as 'pages_xla')")),
                forced_by=_selects, stands_in=(AUTO, "native"), selectable=False,
                in_place=True, skips_masked=True),
    Formulation("decode_attention", "pages_xla", ("cpu", "gpu"),
                "a page-selecting config's step (Quest), the reference: each KV head's "
                "chosen pages gathered, then 'xla' over them",
                "kvjax.models.attention.attend_pages", fn=".run_pages",
                step=f"{_ATTN}:step_pages_xla", forced_by=_selects, stands_in=("*",),
                selectable=False, skips_masked=True),
    Formulation("decode_attention", "seq", ("cpu", "gpu"),
                "a cache split over the mesh's 'seq' axis: each device's partial softmax "
                "state, combined across devices (flash-decoding)",
                "kvjax.models.attention.attend_cached_seq", fn=".run_seq",
                forced_by=lambda s: s.seq_shards > 1 and not s.softcap, stands_in=("*",),
                selectable=False),
    Formulation("decode_attention", "dense", ("cpu", "gpu"),
                "soft-capped scores (Gemma 2): the full scores over (old slots ++ new)",
                "kvjax.models.attention.attend", fn=".run_dense",
                forced_by=lambda s: s.softcap, stands_in=("*",), selectable=False),
    Formulation("decode_attention", "xla_scaled", ("cpu", "gpu"),
                "1-byte caches (int8, fp8) read as 'xla': the per-slot scales applied "
                "outside the dots, so XLA fuses the codes' convert into them",
                "kvjax.models.attention.attend_step (k_scale, v_scale)",
                fn=".run_scaled", step=f"{_ATTN}:step_scaled",
                forced_by=lambda s: s.quantized and not s.sinks_at_cache and s.queries == 1,
                stands_in=("xla",), selectable=False, skips_masked=True),
    Formulation("decode_attention", "xla", ("cpu", "gpu"),
                "every cache: einsums with the queries as the left operand (the "
                "reference; sinks at cache positions and MLA's latent step run it "
                "whatever was asked)",
                "kvjax.models.attention.attend_step", fn=".run_step",
                step=f"{_ATTN}:step_xla", partial=f"{_DK}:partial_xla",
                forced_by=lambda s: s.sinks_at_cache or s.mla, stands_in=("*",),
                measured=True),
    Formulation("decode_attention", "xla_cache_left", ("cpu", "gpu"),
                "every cache: einsums with the cache as the left operand",
                "kvjax.models.decode_kernels.partial_attention", fn=".run_step",
                step=f"{_ATTN}:step_kernel", partial=f"{_DK}:partial_cache_left",
                measured=True),
    Formulation("decode_attention", "native", ("cpu",),
                "float32 caches, either layout: one pass over each block of 64 slots for "
                "all G heads of a group, masked slots skipped (visible runs 64 or more "
                "masked slots apart are read alone: a window over dense rows reads the "
                "window); paged caches read in place",
                "kvjax/native/decode_attention.cc", "custom call",
                "kvjax_decode_attention", "kvjax_paged_decode_attention",
                fn=".run_step", step=f"{_ATTN}:step_kernel",
                partial=f"{_DK}:partial_native", applies=_native_decode, in_place=True,
                skips_masked=True, measured=True, needs_plan=True,
                # the dense-window rule: only a formulation that skips masked slots
                # reads W of a dense window's S slots, whatever was measured for S
                forced_by=lambda s: s.slot_kind == "dense_window", stands_in=(AUTO,)),
    Formulation("decode_attention", "native_blocks", ("cpu",),
                "'native' with each fully visible run of a grouped row (G = 2 to 9, "
                "values 'BKSH', H a multiple of 16, dense, AVX-512; keys 'BKHS', else as "
                "'native') swept block by block: a block's scores, "
                "then at once its softmax and values (flash-decoding's update); timed "
                "against 'native' per machine",
                "kvjax/native/decode_attention.cc", "custom call",
                "kvjax_decode_attention", "kvjax_paged_decode_attention",
                fn=".run_step", step=f"{_ATTN}:step_kernel",
                partial=f"{_DK}:partial_native_blocks", applies=_native_blocks,
                fallback="native", in_place=True, skips_masked=True, measured=True,
                needs_plan=True),
    Formulation("decode_attention", "pallas", ("gpu",),
                "dense 'BKSH' caches (visible slots a prefix), head_dim a power of two "
                ">= 16; paged float caches read in place (the paged-attention kernel's "
                "body over kvjax's pools)",
                "jax.experimental.pallas.ops.gpu.decode_attention, .paged_attention",
                "pallas", fn=".run_step", step=f"{_ATTN}:step_kernel",
                partial=f"{_DK}:partial_pallas", applies=_pallas_decode, in_place=True,
                skips_masked=True),
    Formulation("weight_matmul", "xla", ("cpu", "gpu"), "every product: jnp.einsum",
                "kvjax.models.weight_matmul.einsum", fn=f"{_WM}:run_xla", measured=True),
    Formulation("weight_matmul", "native", ("cpu",),
                "float32, M <= 256 rows: each weight streamed once for all rows, split "
                "by output columns", "kvjax/native/rows_matmul.cc", "custom call",
                "kvjax_rows_matmul", fn=f"{_WM}:run_native", applies=_rows_kernel,
                fallback="xla", measured=True, needs_plan=True,
                # int8 weights (a self draft's): the kernel's int8 variant reads a quarter
                # of the bytes, whatever was measured for float32 (nothing to measure)
                forced_by=lambda s: s.dtype == "int8",
                stands_in=(AUTO, "native_ksplit", "native_lanes")),
    Formulation("weight_matmul", "native_ksplit", ("cpu",),
                "as 'native'; several rows against a [K, N] weight split by its K rows",
                "kvjax/native/rows_matmul.cc", "custom call", "kvjax_rows_matmul",
                fn=f"{_WM}:run_native_ksplit", needs_plan=True,
                applies=lambda s: _rows_kernel(s) or _first(
                    (s.dtype != "float32", "float32 weights"),
                    (s.rows >= 0 and (s.rows == 1 or s.layout != "kn"),
                     "several rows against a [K, N] weight")),
                fallback="native", measured=True),
    Formulation("weight_matmul", "native_lanes", ("cpu",),
                "as 'native'; several rows against an [N, K] weight (the tied LM head) "
                "in the vector lanes", "kvjax/native/rows_matmul.cc", "custom call",
                "kvjax_rows_matmul", fn=f"{_WM}:run_native_lanes", needs_plan=True,
                applies=lambda s: _rows_kernel(s) or _first(
                    (s.dtype != "float32", "float32 weights"),
                    (s.rows >= 0 and (s.rows == 1 or s.layout != "nk"),
                     "several rows against an [N, K] weight")),
                fallback="native", measured=True),
    Formulation("prefill_attention", "seq", ("cpu", "gpu"),
                "a chunk over a cache split over the mesh's 'seq' axis (flash-decoding "
                "across devices)", "kvjax.models.attention.attend_cached_seq",
                fn=".run_seq",
                forced_by=lambda s: s.seq_shards > 1 and s.cached and not s.softcap,
                stands_in=("*",), selectable=False),
    Formulation("prefill_attention", "tiled", ("cpu", "gpu"),
                "every variant: online softmax over key blocks, causal tiles skipped",
                "kvjax.models.flash.attend_chunk", fn=".run_tiled"),
    Formulation("prefill_attention", "dense", ("cpu", "gpu"),
                "every variant: the full [T, S] scores (and sinks at cache positions; "
                "soft-capped scores run it whatever was asked)",
                "kvjax.models.attention.attend", fn=".run_dense",
                forced_by=lambda s: s.softcap or s.sinks_at_cache, stands_in=("*",)),
    Formulation("prefill_attention", "native", ("cpu",),
                "MHA/GQA/MQA, float32: blocked causal attention per row and KV head",
                "kvjax/native/prefill_attention.cc", "custom call",
                "kvjax_prefill_attention", fn=".run_native_prefill", needs_plan=True,
                applies=lambda s: _first(
                    (s.backend != "cpu", f"a CPU kernel (backend {s.backend!r})"),
                    (s.mla, "MHA/GQA/MQA only (no MLA kernel)"),
                    (not s.heads_split, "the mesh's 'model' axis dividing the KV heads "
                                        "(the kernel runs on each device's whole KV heads)"),
                    ("prefill_attention" not in s.native,
                     "the config's plan holds no native prompt-attention kernel (resolve "
                     "the config with kvjax.planner.resolve, which builds and loads it)")),
                fallback="tiled"),
    Formulation("prefill_attention", "cudnn", ("gpu",),
                "MHA/GQA/MQA into an empty cache (later chunks run 'tiled'), no sinks",
                "kvjax.models.flash.attend_chunk_sdpa", "custom call",
                fn=".run_cudnn",
                applies=lambda s: _first((s.backend != "gpu" or s.dtype not in (
                                             "bfloat16", "float16"),
                                          f"backend 'gpu' and dtype bfloat16 or float16 "
                                          f"(got backend {s.backend!r}, dtype {s.dtype!r})"),
                                         (s.mla, "MHA/GQA/MQA only"),
                                         (s.cached, "a chunk into an empty cache"),
                                         (s.sinks, "no attention sinks")),
                fallback="tiled"),
)


def static_site(op: str, backend: str, dtype: str, devices: int = 1,
                heads_split: bool = True) -> Site:
    """The site of what a config (and its mesh) fix before any shape is known: backend,
    dtype, devices; everything else at its most permissive (every native kernel taken
    as loaded). Validation refuses a formulation that does not apply even here
    (:func:`select` with ``strict``)."""
    return Site(op, backend=backend, dtype=dtype, slots=4096, rows=-1, devices=devices,
                heads_split=heads_split, cached=False,
                native=NATIVE)


def register(f: Formulation) -> None:
    """Adds formulation ``f`` to :data:`REGISTRY` (a new formulation is one entry plus its
    function, ``f.fn``).

    Raises:
      ValueError: an op not in :data:`OPS`, or a name ``f.op`` already has.
    """
    global REGISTRY
    if f.op not in OPS or f.name in names(f.op, auto=True, internal=True):
        raise ValueError(f"register: {f.op}={f.name!r}; allowed: an op of {list(OPS)} and "
                         "a name it does not have yet")
    REGISTRY = REGISTRY + (f,)


def unregister(op: str, name: str) -> None:
    """Removes formulation ``name`` of ``op`` from :data:`REGISTRY` (tests' toy ones)."""
    global REGISTRY
    get(op, name, internal=True)
    REGISTRY = tuple(f for f in REGISTRY if (f.op, f.name) != (op, name))


def formulations(op: str) -> tuple:
    """The :class:`Formulation` s of ``op``, in registration order.

    Raises:
      ValueError: an op not in :data:`OPS`.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r}; allowed: one of {list(OPS)}")
    return tuple(f for f in REGISTRY if f.op == op)


def names(op: str, auto: bool = True, internal: bool = False) -> tuple:
    """The names of ``op``'s selectable formulations (the config field's values), with
    :data:`AUTO` first when ``auto``; ``internal``: the others too."""
    return ((AUTO,) if auto else ()) + tuple(f.name for f in formulations(op)
                                             if f.selectable or internal)


def get(op: str, name: str, internal: bool = False) -> Formulation:
    """The formulation ``name`` of ``op`` (``internal``: also one no config selects).

    Raises:
      ValueError: an unknown name, naming the allowed ones.
    """
    for f in formulations(op):
        if f.name == name and (f.selectable or internal):
            return f
    raise ValueError(f"{op}={name!r}; allowed: one of {list(names(op, auto=False))}")


def candidates(op: str, site: Site) -> tuple:
    """The formulations the planner times for ``op`` at ``site``: the measured ones that
    apply there (:attr:`Formulation.measured`), in registration order."""
    return tuple(f.name for f in formulations(op) if f.measured and f.applies(site) is None)


def forced(op: str, requested: str, site: Site) -> str | None:
    """The formulation a rule runs at ``site`` whatever the plan's pick (one forced
    there for '*' or for ``requested`` itself, that applies), or None: then the pick
    counts, and :func:`kvjax.planner.resolve` times the candidates; where a rule holds
    it times nothing (a read-time page selection, a dense window, soft-capped scores)."""
    for g in formulations(op):
        if (g.forced_by is not None and g.forced_by(site) and g.applies(site) is None
                and {"*", requested} & set(g.stands_in)):
            return g.name
    return None


def select(op: str, requested: str, site: Site, pick: str | None = None,
           strict: bool = False) -> str:
    """The formulation that runs ``op`` at ``site`` for the config's ``requested`` value:
    the one rule of every choice (the planner's picks, the models' calls and the config's
    and mesh's validation all come here), after recurrentgemma's ``resolve_scan_type``.

    1. A formulation forced at the site (:attr:`Formulation.forced_by`) for what was
       asked (its ``stands_in``) runs, in registration order.
    2. Else :data:`AUTO` asks for ``pick`` (the plan's, measured by
       :func:`kvjax.planner.resolve`) or :data:`DEFAULT`; any other name for itself.
    3. A formulation that does not apply (:attr:`Formulation.applies`) hands over to its
       ``fallback`` (for :data:`AUTO`, to :data:`REFERENCE` where it has none); one
       asked for by name without a fallback is refused.

    ``strict`` (the validation, on a site of the config's static facts: backend, dtype,
    mesh): no forced formulation and no fallback: a requested one that does not apply
    is refused; :data:`AUTO` is returned as is.

    Raises:
      ValueError: an unknown name; a requested formulation that does not apply and has
        no fallback (or any, ``strict``), naming why and the formulations that apply.
    """
    if requested not in names(op):
        raise ValueError(f"model.{FIELD[op]}={requested!r}; allowed: one of "
                         f"{list(names(op))}")
    match requested:
        case "auto" if strict:
            return AUTO
        case "auto":
            f = get(op, pick or DEFAULT[op], internal=True)
            if not f.selectable and not (f.forced_by is not None and f.forced_by(site)):
                # a pick forced at another site: a one-position step's, read by a small
                # chunk through its base class (xla_scaled runs one query only)
                f = get(op, DEFAULT[op], internal=True)
        case _:
            f = get(op, requested)
    for g in () if strict else formulations(op):
        if (g.forced_by is not None and g.forced_by(site) and g.applies(site) is None
                and {"*", f.name, requested} & set(g.stands_in)):
            return g.name
    while (why := f.applies(site)) is not None:
        if (f.needs_plan and not site.planned and f.name == requested
                and f.applies(dataclasses.replace(site, native=NATIVE)) is None):
            raise ValueError(f"model.{FIELD[op]}={f.name!r} on a config without a plan: "
                             "resolve it with kvjax.planner.resolve (which builds and loads "
                             f"the kernel), or use {REFERENCE[op]!r}")
        if (f.fallback is None and requested != AUTO) or strict:
            ok = [g.name for g in formulations(op) if g.selectable and g.applies(site) is None]
            raise ValueError(f"model.{FIELD[op]}={f.name!r} cannot run here (backend "
                             f"{site.backend!r}, dtype={site.dtype!r}): {why}; allowed "
                             f"here: {[AUTO] + ok}")
        f = get(op, f.fallback or REFERENCE[op], internal=True)
    return f.name


FIELD = {"decode_attention": "decode_attention", "weight_matmul": "weight_matmul",
          "prefill_attention": "prefill_impl"}
"""The config field that selects each op's formulation."""


def run(op: str, name: str, *args, entry: str = "fn", **kwargs):
    """Computes ``op`` by formulation ``name`` (resolved by :func:`select`): calls its
    ``fn`` (or its ``entry``: 'step', 'partial') with ``name``, ``args`` and ``kwargs``
    (one function may serve several formulations), and returns what it returns. The function's
    module is imported on first use (a model-layer module: the registry itself imports
    nothing from kvjax)."""
    f = get(op, name, internal=True)
    where = getattr(f, entry)
    if where.startswith("."):  # a method of the op's call object (args[0])
        return getattr(args[0], where[1:])(f.name, *args[1:], **kwargs)
    module, _, attr = where.partition(":")
    return getattr(importlib.import_module(module), attr)(f.name, *args, **kwargs)


def custom_call_targets() -> tuple:
    """The custom-call targets of kvjax's own kernels (sorted, unique)."""
    return tuple(sorted({t for f in REGISTRY for t in (f.target, f.paged_target) if t}))


def markdown_table() -> str:
    """The registry as the markdown table docs/DESIGN.md holds."""
    rows = ["| op | formulation | backends | applies to | counted | implementation |",
            "|---|---|---|---|---|---|"]
    for f in REGISTRY:
        targets = ", ".join(f"`{t}`" for t in (f.target, f.paged_target) if t)
        counted = f.counted + (f" ({targets})" if targets else "")
        name = f"`{f.name}`" + ("" if f.selectable else " (rule)")
        rows.append(f"| {f.op} | {name} | {', '.join(f.backends)} | {f.scope} | "
                    f"{counted} | `{f.implementation}` |")
    return "\n".join(rows)
