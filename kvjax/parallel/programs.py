"""One program builder for one device and a mesh: :func:`build` places a model and returns
its compile units (``kvjax.inference.decode``'s prefill, generate loop and single step,
``kvjax.inference.ragged``'s ragged pair), each declared once (``decode.compile_unit``)
and jitted here by :func:`kvjax.inference.decode.place`.

On one device (a trivial :class:`kvjax.config.MeshConfig`) the placement is trivial: no
mesh, no shardings, the units as the library runs them. On a mesh, parameters, tokens and
cache carry NamedShardings; the cache goes in and comes out with the same sharding
(``out_shardings`` pins it), so the donated buffers are updated in place on every device
and the cache is never gathered. Each call and each ``lower`` then runs under
``jax.set_mesh(mesh)``; the mesh's axes reach the attention layers through the config's
plan (:func:`kvjax.planner.resolve` with the mesh's axes): a 'seq' axis splits the cache's
slots, and 'data' / 'model' split a native kernel's call per device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.config import MeshConfig, ModelConfig, SamplingConfig
from kvjax.inference import decode
from kvjax.models import model as model_lib
from kvjax.parallel import mesh as mesh_lib
from kvjax.parallel import specs as specs_lib
from kvjax.inference import ragged


class _OnMesh:
    """A jitted function whose traces and calls run under ``jax.set_mesh(mesh)``."""

    def __init__(self, fn, mesh):
        self._fn, self._mesh = fn, mesh

    def __call__(self, *args):
        with jax.set_mesh(self._mesh):
            return self._fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self._mesh):
            return self._fn.lower(*args)


@dataclasses.dataclass(frozen=True)
class Placement:
    """A model placed on one device or on a mesh: the mesh, the specs, and the compile
    units (jitted with shardings on a mesh, without on one device).

    Attributes:
      cfg: the model, with its plan (:func:`kvjax.planner.resolve`). mcfg: the mesh sizes.
      mesh: the jax Mesh; None on one device (a trivial ``mcfg``).
      batch_size: B. max_seq_len: the cache length the units are built for.
      param_specs: PartitionSpec pytree of the parameters (None on one device).
      cache_specs: KVCache of PartitionSpecs (None on one device).
      ragged: the cache keeps per-row lengths (``init_cache(..., ragged=True)``: rows of
        different lengths, :mod:`kvjax.inference.ragged`).
      note: a one-line note when the mesh uses fewer devices than there are (None when
        it uses them all; :func:`kvjax.parallel.mesh.mesh_devices`).
    """

    cfg: ModelConfig
    mcfg: MeshConfig
    mesh: jax.sharding.Mesh | None
    batch_size: int
    max_seq_len: int
    param_specs: object
    cache_specs: object
    note: str | None = None
    ragged: bool = False

    @property
    def trivial(self) -> bool:
        """One device: no mesh, no shardings."""
        return self.mesh is None

    def sharding(self, spec: P) -> NamedSharding | None:
        """``spec`` on the mesh (None on one device: the default placement)."""
        return None if self.trivial else NamedSharding(self.mesh, spec)

    def shard_params(self, params):
        """Parameters placed with their NamedShardings; on one device, prepared for
        decoding (:func:`kvjax.models.model.fuse_projections`, once, here)."""
        if self.trivial:
            return model_lib.fuse_projections(self.cfg, params)
        return specs_lib.shard(params, self.mesh, self.param_specs)

    def place_rows(self, x):
        """An array split by batch row (tokens, lengths) placed on the mesh's 'data' axis
        (unchanged on one device)."""
        return x if self.trivial else jax.device_put(x, self.sharding(P("data")))

    def init_cache(self):
        """An empty cache, on a mesh created directly in its shardings (never whole on
        one device)."""
        make = functools.partial(cache_lib.init_cache, self.cfg, self.batch_size,
                                 self.max_seq_len, ragged=self.ragged)
        if self.trivial:
            return make()
        return jax.jit(make, out_shardings=specs_lib.shardings(self.mesh,
                                                               self.cache_specs))()

    def cache_shapes(self):
        """The cache as ShapeDtypeStructs carrying their shardings (for lowering)."""
        spec = _cache_spec(self.cfg, self.batch_size, self.max_seq_len, self.ragged)
        if self.trivial:
            return spec
        shard = specs_lib.shardings(self.mesh, self.cache_specs)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            spec, shard)

    def param_shapes(self, params=None):
        """Parameters as ShapeDtypeStructs carrying their shardings (on one device, as
        :meth:`shard_params` prepares them)."""
        params = model_lib.param_shapes(self.cfg) if params is None else params
        if self.trivial:
            return model_lib.fuse_projections(self.cfg, jax.tree.map(
                lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), params))
        shard = specs_lib.shardings(self.mesh, self.param_specs)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            params, shard)

    @functools.cached_property
    def _c(self):
        return specs_lib.shardings(self.mesh, self.cache_specs)

    @functools.cached_property
    def _p(self):
        return specs_lib.shardings(self.mesh, self.param_specs)

    @functools.cached_property
    def shardings(self) -> dict | None:
        """{role: sharding} of the units' arguments (``decode.Roles``); None on one
        device."""
        if self.trivial:
            return None
        return {"params": self._p, "rows": self.sharding(P("data")), "cache": self._c}

    def unit(self, unit, **static):
        """``unit`` (a ``decode.compile_unit``) placed here with its static arguments
        (``cfg`` is this placement's)."""
        fn = decode.place(unit, self.shardings, cfg=self.cfg, **static)
        return fn if self.trivial else _OnMesh(fn, self.mesh)

    def prefill(self, fresh: bool = False):
        """(params, tokens [B, T] int32, cache) -> (logits [B, V] float32, cache).
        ``fresh``: the cache is empty (``decode.prefill_program``'s flag)."""
        return self.unit(decode.prefill_program, fresh=fresh)

    def decode_step(self):
        """(params, token [B, 1] int32, cache) -> (logits [B, V] float32, cache)."""
        return self.unit(decode.decode_step)

    def generate(self, sampling: SamplingConfig = SamplingConfig(), buf_len=None):
        """(params, first_token [B], cache, num_steps [], rng, eos_id []) ->
        (tokens [B, buf_len] int32, steps [] int32, cache): the one while_loop."""
        return self.unit(decode.generate_program, sampling=sampling, buf_len=buf_len)

    def prefill_ragged(self):
        """(params, tokens [B, T] int32 right-padded, lengths [B] int32, ragged cache) ->
        (logits [B, V] float32 at each row's last real token, cache)
        (``kvjax.inference.ragged.prefill_ragged_program``; no host checks)."""
        return self.unit(ragged.prefill_ragged_program)

    def generate_ragged(self, sampling: SamplingConfig = SamplingConfig(), buf_len=None):
        """(params, first_token [B], ragged cache, budgets [B], row_keys [B], eos_id []) ->
        (tokens [B, buf_len] int32, counts [B] int32, cache)
        (``kvjax.inference.ragged.generate_ragged_program``)."""
        return self.unit(ragged.generate_ragged_program, sampling=sampling,
                         buf_len=buf_len or self.max_seq_len)


def _cache_spec(cfg, batch_size, max_seq_len, ragged):
    return jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch_size, max_seq_len,
                                                       ragged=ragged))


def build(cfg: ModelConfig, mcfg: MeshConfig, batch_size: int, max_seq_len: int,
          devices=None, params=None, ragged: bool = False, rows=(),
          extra_seq_lens=()) -> Placement:
    """Places ``cfg`` on one device (a trivial ``mcfg``) or on the mesh of ``mcfg``: checks
    the mesh, builds it and the specs, and resolves ``cfg``'s plan for the programs
    (:func:`kvjax.planner.resolve`: decode rows ``batch_size``, weight-product ``rows``,
    caches of ``max_seq_len`` and ``extra_seq_lens``, the mesh's axes).
    ``ragged``: the cache keeps per-row lengths (:mod:`kvjax.inference.ragged`).

    Raises:
      ConfigError: a mesh larger than the device count
        (:func:`kvjax.parallel.mesh.mesh_devices`), an axis that does not divide what it
        splits (:func:`kvjax.parallel.mesh.check`); before anything is compiled.
    """
    resolve = functools.partial(planner.resolve, max_seq_len=max_seq_len,
                                batch_sizes=(batch_size,), rows=tuple(rows),
                                extra_seq_lens=tuple(extra_seq_lens))
    if mcfg.trivial:
        return Placement(resolve(cfg), mcfg, None, batch_size, max_seq_len, None, None,
                         None, ragged)
    mesh_lib.check(cfg, mcfg, batch_size, cache_lib.num_slots(cfg, max_seq_len))
    devices, note = mesh_lib.mesh_devices(mcfg, devices)
    mesh = mesh_lib.make_mesh(mcfg, devices)
    cfg = resolve(cfg, mesh_axes=dict(mesh.shape))
    params = model_lib.param_shapes(cfg) if params is None else params
    cache = _cache_spec(cfg, batch_size, max_seq_len, ragged)
    return Placement(cfg, mcfg, mesh, batch_size, max_seq_len,
                     specs_lib.param_specs(cfg, mcfg, params),
                     specs_lib.cache_specs(cfg, mcfg, cache), note, ragged)
