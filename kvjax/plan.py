"""The execution plan: every machine-dependent choice of a program, resolved before tracing.

A :class:`Plan` is frozen, hashable plain data. It is built once, eagerly, by the caller
(:func:`kvjax.planner.resolve`, which measures what it lacks on this machine) and rides
on the config (``ModelConfig.plan``), so it is part of every jit key: a different pick
retraces. The models and the cache only read it while tracing; they never measure,
print, write files or look up the ambient mesh or the process's backend.

A config without a plan (``plan=None``, e.g. a library call or a test) runs the
reference choices: 'auto' formulations are 'xla', the native CPU kernels are not used,
and no mesh axis is split.

Shape classes (the keys of the formulation tables):

* decode attention: :func:`decode_attention_class` (B, K, G, H, V, the slot count
  rounded up to a power of two, cache dtype, layouts, dense or ring);
* weight products: :func:`weight_class` (M rows rounded up to a power of two, K x N
  weight, its layout).
"""

from __future__ import annotations

import dataclasses

SEQ = "seq"  # the mesh axis that splits a cache's slots (flash-decoding across devices)
DATA = "data"  # the mesh axis that splits batch rows
MODEL = "model"  # the mesh axis that splits KV heads and weight columns
# the native CPU kernels a plan may hold (kvjax.native: decode_attention.cc,
# prefill_attention.cc, rows_matmul.cc; decode_attention_blocks: decode_attention.cc
# built with its block sweep, kvjax.native.block_sweep)
NATIVE_KERNELS = ("decode_attention", "decode_attention_blocks", "prefill_attention",
                  "rows_matmul")


def decode_attention_class(b: int, k: int, g: int, h: int, v: int, s: int, dtype: str,
                           k_layout: str, v_layout: str, prefix: bool = True,
                           page_size: int = 0) -> str:
    """Name of a decode-attention shape class, e.g.
    'B1-K3-G3-H64-V64-S4096-float32-BKHS-BKSH': the slot count rounded up to a power of
    two, everything else exact; '-window' appended when the visible slots are not a
    prefix (a window's ring buffer), '-paged{P}' when the cache is a page pool of
    ``page_size`` P slots per page (:mod:`kvjax.cache.paged`; 0: dense rows) and S the
    slots of a row's view. ``dtype``: the cache's element type name."""
    s2 = 1 << max(0, int(s - 1).bit_length())
    return (f"B{b}-K{k}-G{g}-H{h}-V{v}-S{s2}-{dtype}-{k_layout}-{v_layout}"
            f"{'' if prefix else '-window'}{f'-paged{int(page_size)}' if page_size else ''}")


def row_band(m: int) -> int:
    """The rows a weight-product class is measured at: M rounded up to a power of two
    (1, 2, 4, ..., 256), so that prompts of 33 to 64 tokens share one pick instead of
    measuring each length (docs/decisions/0037-weight-classes-by-row-band.md)."""
    return 1 << max(0, int(m) - 1).bit_length()


def weight_class(m: int, k: int, n: int, layout: str) -> str:
    """Name of a float32 weight-product shape class, e.g. 'M1-K576-N1536-kn-float32': M
    rows of x (rounded up to a power of two, :func:`row_band`) against a K x N weight
    stored [K, N] ('kn') or [N, K] ('nk')."""
    return f"M{row_band(m)}-K{k}-N{n}-{layout}-float32"


@dataclasses.dataclass(frozen=True)
class Plan:
    """Resolved execution choices (hashable; see the module docstring).

    Attributes:
      decode_attention: ((shape class, formulation), ...) for ``decode_attention='auto'``
        (:func:`decode_attention_class`; formulations of
        :mod:`kvjax.models.decode_kernels`).
      weight_matmul: ((shape class, formulation), ...) for ``weight_matmul='auto'``
        (:func:`weight_class`; 'xla', 'native', 'native_ksplit', 'native_lanes').
      prefill_attention: (('prompt' | 'chunk', formulation), ...): the prompt's
        attention into an empty cache and as a chunk over a cache.
      native: the native CPU kernels (:mod:`kvjax.native`) built and loaded for this
        process, among :data:`NATIVE_KERNELS`; formulations that need one that is not
        here run as the reference ('xla', or the tiled prefill).
      mesh_axes: ((axis name, size), ...) of the device mesh the program runs under,
        axes of size > 1 only; () on one device.
      manual_axes: axes that are already manual where the program is traced (inside a
        ``shard_map`` over them, as a per-device cost trace is): their arrays are the
        device's shards.
    """

    decode_attention: tuple[tuple[str, str], ...] = ()
    weight_matmul: tuple[tuple[str, str], ...] = ()
    prefill_attention: tuple[tuple[str, str], ...] = ()
    native: tuple[str, ...] = ()
    mesh_axes: tuple[tuple[str, int], ...] = ()
    manual_axes: tuple[str, ...] = ()

    def axis_size(self, name: str) -> int:
        """Size of mesh axis ``name`` (1 when the program runs on one device or the
        mesh has no such axis)."""
        return dict(self.mesh_axes).get(name, 1)

    @property
    def seq_shards(self) -> int:
        """How many devices split a cache's slot axis (the 'seq' axis; 1: not split)."""
        return self.axis_size(SEQ)

    @property
    def num_devices(self) -> int:
        """Devices of the mesh (1 on one device)."""
        n = 1
        for _, size in self.mesh_axes:
            n *= size
        return n

    @property
    def seq_manual(self) -> bool:
        """The slot-splitting axis is already manual where the program is traced."""
        return SEQ in self.manual_axes

    def per_device_axes(self) -> tuple[str | None, str | None]:
        """(data axis, model axis) a per-device kernel call is split over
        (:func:`kvjax.ops.per_device`): those of size > 1 that are not already manual,
        else None."""
        live = lambda a: a if self.axis_size(a) > 1 and a not in self.manual_axes else None
        return live(DATA), live(MODEL)

    def pick(self, site) -> str | None:
        """The measured pick for ``site``'s class (a :class:`kvjax.kernels.Site`: its
        ``key``, else its ``base_key``), or None where the plan has none (the registry's
        rule then runs its default, :func:`kvjax.kernels.select`)."""
        table = dict({"decode_attention": self.decode_attention,
                      "weight_matmul": self.weight_matmul,
                      "prefill_attention": self.prefill_attention}.get(site.op, ()))
        return table.get(site.key) or table.get(site.base_key)

    def on_mesh(self, axes: dict, manual=()) -> Plan:
        """This plan for a program run under a mesh of ``axes`` {name: size} (axes of
        size 1 dropped), with ``manual`` axes already manual."""
        live = tuple((str(a), int(n)) for a, n in axes.items() if int(n) > 1)
        return dataclasses.replace(self, mesh_axes=live, manual_axes=tuple(sorted(manual)))

    def lines(self) -> list[str]:
        """The plan in a report: one line per resolved choice."""
        out = [f"plan: native kernels {', '.join(sorted(self.native)) or 'none'}; mesh "
               + (", ".join(f"{a}={n}" for a, n in self.mesh_axes) or "one device")]
        for name, impl in self.decode_attention:
            out.append(f"  decode attention {name}: {impl}")
        for name, impl in self.weight_matmul:
            out.append(f"  weight product {name}: {impl}")
        for name, impl in self.prefill_attention:
            out.append(f"  prompt attention ({name}): {impl}")
        return out


REFERENCE = Plan()
