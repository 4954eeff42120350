"""Per-device cost of one sharded decode step: theory, XLA, collectives, jaxpr roofline.

On a mesh every figure is per device:

* theory: weights / (devices that split each weight) + KV / (devices that split the
  cache) + collective bytes, where the first two are computed from the partition specs
  (:mod:`kvjax.parallel.specs`; replicated weights such as norms count whole) and the
  collective bytes are the payloads read from the compiled HLO
  (:mod:`kvjax.parallel.collectives`). The blog's form: weights / TP + KV / shards.
* XLA: ``cost_analysis()`` of the compiled SPMD program, which is per device and has no
  communication entry.
* collectives: kind, count, payload and link bytes per mesh axis.
* jaxpr roofline (``jax.experimental.roofline`` with the mesh): its ``ici_bytes`` per
  axis counts the collectives written by hand (the 'seq' combine); available on 'data' /
  'seq' meshes only (:func:`_roofline_ici` says why not with 'model').
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvjax.cache import compress as compress_lib
from kvjax import cache as cache_lib
from kvjax.analysis import hlo_cost
from kvjax.config import MeshConfig, ModelConfig
from kvjax.parallel import collectives as coll_lib
from kvjax.parallel import programs
from kvjax.inference import decode
from kvjax.parallel import specs as specs_lib
from kvjax.parallel.specs import cache_tensor_spec


def _shards(spec: P, mesh) -> int:
    n = 1
    for a in spec:
        for name in (a if isinstance(a, tuple) else (a,)):
            if name is not None:
                n *= mesh.shape[name]
    return n


def per_device_bytes(tree, specs, mesh) -> int:
    """Bytes one device holds of ``tree`` (arrays / ShapeDtypeStructs) laid out by
    ``specs`` (PartitionSpecs): each leaf's bytes over the devices that split it."""
    leaves = jax.tree.leaves(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return int(sum(x.size * jnp.dtype(x.dtype).itemsize // _shards(s, mesh)
                   for x, s in zip(leaves, spec_leaves)))


@dataclasses.dataclass(frozen=True)
class ShardedStepCost:
    """One decode step at ``context`` on a mesh, per device (bytes, FLOP).

    Attributes:
      mesh: (data, model, seq). context: t (cache slots S = t). batch: B.
      weight_bytes, kv_bytes: whole-model weights and cache (all devices together).
      weight_bytes_dev, kv_bytes_dev: what one device holds (= reads per step).
      collective_bytes: payload bytes of the step's collectives per device.
      collective_link_bytes: what one device sends (ring estimates).
      theory_bytes_dev: weight_bytes_dev + kv_bytes_dev + collective_bytes.
      xla_bytes, xla_flops: ``cost_analysis()`` of the SPMD program (per device).
      inventory: (kind, axes) -> count / bytes / link_bytes.
      per_axis: mesh axis -> link bytes per device.
      cache_gathers: names of all-gathers/all-to-alls that move a cache tensor (must be
        empty).
      roofline_ici_bytes: jax.experimental.roofline's inter-device bytes (None: failed,
        see roofline_error); roofline_per_axis: the same per mesh axis.
      compiled: the compiled SPMD step (params, token [B, 1] int32, cache) -> (logits,
        cache), arguments in the specs' shardings; for timing it.
    """

    cfg: ModelConfig
    mesh: tuple
    context: int
    batch: int
    weight_bytes: int
    kv_bytes: int
    weight_bytes_dev: int
    kv_bytes_dev: int
    collective_bytes: float
    collective_link_bytes: float
    xla_bytes: float
    xla_flops: float
    inventory: dict
    per_axis: dict
    cache_gathers: tuple
    roofline_ici_bytes: float | None = None
    roofline_error: str | None = None
    roofline_per_axis: dict | None = None
    compiled: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def theory_bytes_dev(self) -> float:
        return self.weight_bytes_dev + self.kv_bytes_dev + self.collective_bytes

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("cfg", "inventory", "compiled")}
        d["inventory"] = {f"{k}@{'+'.join(a) or '-'}": v for (k, a), v in self.inventory.items()}
        d["theory_bytes_dev"] = self.theory_bytes_dev
        d["model"] = self.cfg.name
        return d


def analyze_sharded_step(cfg: ModelConfig, mcfg: MeshConfig, context: int, batch: int = 1,
                         devices=None, roofline: bool = True) -> ShardedStepCost:
    """Compiles one sharded decode step against a ``context``-slot cache (shapes only,
    nothing allocated) and returns its per-device costs.

    Raises:
      ConfigError: the mesh does not fit the devices or the model
        (:func:`kvjax.parallel.programs.build`), before compiling.
      CacheGatherError: the compiled step all-gathers or all-to-alls a cache tensor
        (:func:`kvjax.parallel.collectives.check_cache_stays`).
    """
    mm = programs.build(cfg, mcfg, batch, context, devices=devices)
    params, cache = mm.param_shapes(), mm.cache_shapes()
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=mm.sharding(P("data")))
    compiled = mm.decode_step().lower(params, token, cache).compile()
    xla = hlo_cost.loop_aware_cost(compiled)
    colls = coll_lib.collectives(compiled, mm.mesh)
    shapes = cache_shapes(cfg, mcfg, batch, cache_lib.num_slots(cfg, context))
    bad = coll_lib.cache_collectives(colls, shapes)
    coll_lib.check_cache_stays({"decode step": colls}, shapes)
    ici, ici_axes, err = None, None, None
    if roofline:
        ici_axes, err = _roofline_ici(mm, params, token, cache)
        ici = None if ici_axes is None else sum(ici_axes.values())
    return ShardedStepCost(
        cfg=cfg, mesh=mcfg.shape, context=context, batch=batch,
        weight_bytes=cache_lib.total_bytes(params),
        kv_bytes=cache_lib.total_bytes(cache.tensors),
        weight_bytes_dev=per_device_bytes(params, mm.param_specs, mm.mesh),
        kv_bytes_dev=per_device_bytes(cache.tensors, mm.cache_specs.tensors, mm.mesh),
        collective_bytes=sum(c.bytes for c in colls),
        collective_link_bytes=sum(c.link_bytes for c in colls),
        xla_bytes=xla.bytes, xla_flops=xla.flops, inventory=coll_lib.inventory(colls),
        per_axis=coll_lib.bytes_per_axis(colls), cache_gathers=tuple(c.name for c in bad),
        roofline_ici_bytes=ici, roofline_per_axis=ici_axes, roofline_error=err,
        compiled=compiled)


def measure_sharded_step(cfg: ModelConfig, mcfg: MeshConfig, params, context: int,
                         batch: int = 1, repeats: int = 5, compiled=None,
                         devices=None) -> list[float]:
    """Wall times (s) of ``repeats`` sharded decode steps at ``context``, after one
    warm-up: ``params`` (host or single-device arrays) placed by their specs, a full
    cache (``kvjax.cache.compress.full_cache``) created directly in its shardings, the
    cache donated to each call and its length reset, so every step sees the same
    context. ``compiled``: :attr:`ShardedStepCost.compiled` (else compiled here).
    Report the median.

    Raises:
      ConfigError: the mesh does not fit the devices or the model, before compiling.
    """
    import time  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    mm = programs.build(cfg, mcfg, batch, context, devices=devices)
    cshard = specs_lib.shardings(mm.mesh, mm.cache_specs)
    cache = jax.jit(functools.partial(compress_lib.full_cache, cfg, batch, context),
                    out_shardings=cshard)()
    params = mm.shard_params(params)
    token = jax.device_put(np.zeros((batch, 1), np.int32), mm.sharding(P("data")))
    length = np.asarray(cache.length)
    if compiled is None:
        compiled = mm.decode_step().lower(params, token, cache).compile()
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        logits, cache = compiled(params, token, cache)
        logits.block_until_ready()
        if i:
            times.append(time.perf_counter() - start)
        cache = cache.replace(length=jax.device_put(length, cshard.length))
    return times


def cache_shapes(cfg: ModelConfig, mcfg: MeshConfig, batch: int, num_slots: int) -> list:
    """Global and per-device shapes of one layer's cache tensors on ``mcfg``'s mesh (what
    :func:`kvjax.parallel.collectives.cache_collectives` looks for)."""
    sizes = dict(zip(("data", "model", "seq"), mcfg.shape))
    shapes = []
    for name, spec in cache_lib.tensor_specs(cfg, batch, num_slots).items():
        local = list(spec.shape)
        for i, a in enumerate(specs_axes(cfg, mcfg, name)):
            if a is not None:
                local[i] //= sizes[a]
        shapes += [tuple(spec.shape), tuple(local)]
    return shapes


def specs_axes(cfg, mcfg, name) -> tuple:
    return tuple(cache_tensor_spec(cfg, mcfg, name))


def _roofline_ici(mm, params, token, cache):
    """(ici bytes per mesh axis, None) from ``jax.experimental.roofline`` over the mesh,
    or (None, why not).

    roofline traces the step inside ``shard_map(mesh, in_specs, out_specs)``: the body
    sees one device's shards and only collectives written in it count. kvjax's model is
    written in the global view and GSPMD partitions it when compiling, so:

    * 'model' > 1: refused here. The body would get the 'model'-split parameters (e.g.
      the embedding [V/model, D]), which Flax refuses (``ScopeParamShapeError``: the
      module declares [V, D]); and the all-reduces GSPMD inserts for 'model' are made
      after the jaxpr, so the jaxpr has no 'model' collective to count anyway.
    * 'data' / 'seq' meshes: parameters are replicated, so Flax sees their full shapes;
      the 'seq' combine (:func:`kvjax.ops.combine_over`) runs its body directly when the
      plan says 'seq' is already manual, so its pmax / psums are counted per axis.
    """
    from jax.experimental import roofline as jroof  # noqa: PLC0415
    from jax._src.lax import parallel as lax_parallel  # noqa: PLC0415
    # the seq-sharded cache write (kvjax.cache.write_seq_sharded) asks for its shard's index: a
    # scalar, no traffic; without a rule roofline logs ~10 lines per layer about it
    jroof.register_standard_roofline(lax_parallel.axis_index_p)
    if mm.mcfg.model > 1:
        return None, ("n/a with mesh.model > 1: jax.experimental.roofline traces the "
                      "per-device shard_map body; Flax refuses the 'model'-split "
                      "parameters there (ScopeParamShapeError) and GSPMD's 'model' "
                      "all-reduces are not in the jaxpr")
    # axes of size 1 dropped from the specs: shard_map would otherwise take e.g. the
    # embedding's P('model', None) as varying over a 1-device 'model' axis and refuse
    # the replicated outputs (check_vma)
    live = lambda tree: jax.tree.map(
        lambda s: P(*[a if a is None or mm.mesh.shape[a] > 1 else None for a in s]), tree,
        is_leaf=lambda x: isinstance(x, P))
    try:
        plan = mm.cfg.execution
        manual = [a for a, _ in plan.mesh_axes]  # the shard_map body: every live axis
        cfg = mm.cfg.replace(plan=plan.on_mesh(dict(plan.mesh_axes), manual))
        fn = functools.partial(decode.decode_step.__wrapped__, cfg=cfg)
        with jax.set_mesh(mm.mesh):
            _, res = jroof.roofline(fn, mm.mesh, in_specs=live((mm.param_specs, P("data"),
                                                                mm.cache_specs)),
                                    out_specs=live((P("data"), mm.cache_specs)))(
                params, token, cache)
        return {k: float(v) for k, v in res.ici_bytes.items()}, None
    except Exception as e:  # noqa: BLE001 (a view, not the measurement)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def format_report(c: ShardedStepCost) -> str:
    """A per-device cost table for one sharded step."""
    mb = lambda x: f"{x / 1e6:,.3f} MB" if x is not None else "-"
    lines = [
        f"per-device decode step: {c.cfg.name}, mesh (data, model, seq) = {c.mesh}, "
        f"t = {c.context}, B = {c.batch}",
        f"  weights  {mb(c.weight_bytes)} total, {mb(c.weight_bytes_dev)} per device",
        f"  KV cache {mb(c.kv_bytes)} total, {mb(c.kv_bytes_dev)} per device "
        f"(1/{c.kv_bytes / max(c.kv_bytes_dev, 1):.0f})",
        f"  collectives {mb(c.collective_bytes)} payload, {mb(c.collective_link_bytes)} "
        "sent per device (ring)",
        f"  theory per device (weights + KV + collectives): {mb(c.theory_bytes_dev)}",
        f"  XLA per device (cost_analysis bytes accessed):  {mb(c.xla_bytes)} "
        f"({c.xla_bytes / max(c.theory_bytes_dev, 1):.2f}x theory), "
        f"{c.xla_flops / 1e6:,.2f} MFLOP",
        "  jax.experimental.roofline ici bytes per axis (hand-written collectives only): "
        + (", ".join(f"{a} {mb(v)}" for a, v in sorted(c.roofline_per_axis.items()))
           if c.roofline_per_axis is not None else str(c.roofline_error)),
        "  HLO collectives sent per axis (ring): " + (", ".join(
            f"{a} {mb(v)}" for a, v in sorted(c.per_axis.items())) or "none"),
        "  collective inventory (kind @ axes: count, payload, sent):"]
    for (kind, axes), v in sorted(c.inventory.items()):
        lines.append(f"    {kind:>16} @ {'+'.join(axes) or '-':<10} x{v['count']:<3} "
                     f"{mb(v['bytes'])}  {mb(v['link_bytes'])}")
    lines.append(f"  cache tensors all-gathered / all-to-all'd: {list(c.cache_gathers) or 'none'}")
    return "\n".join(lines)
