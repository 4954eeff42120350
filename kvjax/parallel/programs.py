"""The decode compile units on a mesh: ``kvjax.inference.decode``'s prefill, generate loop
and single step, jitted with NamedShardings for parameters, cache and tokens.

The cache goes in and comes out with the same sharding (``out_shardings`` pins it), so the
donated buffers are updated in place on every device and the cache is never gathered.
Each call and each ``lower`` runs under ``jax.set_mesh(mesh)``; the mesh's axes reach the
attention layers through the config's plan (:func:`kvjax.planner.resolve` with the mesh's
axes): a 'seq' axis splits the cache's slots, and 'data' / 'model' split a native
kernel's call per device.
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
class MeshedModel:
    """A model laid out on a mesh: the mesh, the specs, and the sharded compile units.

    Attributes:
      cfg: the model. mcfg: the mesh sizes. mesh: the jax Mesh.
      batch_size: B. max_seq_len: the cache length the units are built for.
      param_specs: PartitionSpec pytree of the parameters.
      cache_specs: KVCache of PartitionSpecs.
      ragged: the cache keeps per-row lengths (``init_cache(..., ragged=True)``: rows of
        different lengths, :mod:`kvjax.inference.ragged`).
      note: a one-line note when the mesh uses fewer devices than there are (None when
        it uses them all; :func:`kvjax.parallel.mesh.mesh_devices`).
    """

    cfg: ModelConfig
    mcfg: MeshConfig
    mesh: jax.sharding.Mesh
    batch_size: int
    max_seq_len: int
    param_specs: object
    cache_specs: object
    note: str | None = None
    ragged: bool = False

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def shard_params(self, params):
        """Parameters placed with their NamedShardings."""
        return specs_lib.shard(params, self.mesh, self.param_specs)

    def init_cache(self):
        """An empty cache created directly in its shardings (never whole on one device)."""
        fn = jax.jit(functools.partial(cache_lib.init_cache, self.cfg, self.batch_size,
                                       self.max_seq_len, ragged=self.ragged),
                     out_shardings=specs_lib.shardings(self.mesh, self.cache_specs))
        return fn()

    def cache_shapes(self):
        """The cache as ShapeDtypeStructs carrying their shardings (for lowering)."""
        spec = _cache_spec(self.cfg, self.batch_size, self.max_seq_len, self.ragged)
        shard = specs_lib.shardings(self.mesh, self.cache_specs)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            spec, shard)

    def param_shapes(self, params=None):
        """Parameters as ShapeDtypeStructs carrying their shardings."""
        params = model_lib.param_shapes(self.cfg) if params is None else params
        shard = specs_lib.shardings(self.mesh, self.param_specs)
        return jax.tree.map(lambda s, h: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=h),
                            params, shard)

    @functools.cached_property
    def _c(self):
        return specs_lib.shardings(self.mesh, self.cache_specs)

    @functools.cached_property
    def _p(self):
        return specs_lib.shardings(self.mesh, self.param_specs)

    def prefill(self, fresh: bool = False):
        """(params, tokens [B, T] int32, cache) -> (logits [B, V] float32, cache).
        ``fresh``: the cache is empty (``decode.prefill_program``'s flag)."""
        fn = jax.jit(functools.partial(decode.prefill_program.__wrapped__, cfg=self.cfg,
                                       fresh=fresh),
                     in_shardings=(self._p, self.sharding(P("data")), self._c),
                     out_shardings=(self.sharding(P("data")), self._c), donate_argnums=2)
        return _OnMesh(fn, self.mesh)

    def decode_step(self):
        """(params, token [B, 1] int32, cache) -> (logits [B, V] float32, cache)."""
        fn = jax.jit(functools.partial(decode.decode_step.__wrapped__, cfg=self.cfg),
                     in_shardings=(self._p, self.sharding(P("data")), self._c),
                     out_shardings=(self.sharding(P("data")), self._c), donate_argnums=2)
        return _OnMesh(fn, self.mesh)

    def generate(self, sampling: SamplingConfig = SamplingConfig(), buf_len=None):
        """(params, first_token [B], cache, num_steps [], rng, eos_id []) ->
        (tokens [B, buf_len] int32, steps [] int32, cache): the one while_loop."""
        fn = jax.jit(functools.partial(decode.generate_program.__wrapped__, cfg=self.cfg,
                                       sampling=sampling, buf_len=buf_len),
                     in_shardings=(self._p, self.sharding(P("data")), self._c, None, None,
                                   None),
                     out_shardings=(self.sharding(P("data")), None, self._c),
                     donate_argnums=2)
        return _OnMesh(fn, self.mesh)


    def prefill_ragged(self):
        """(params, tokens [B, T] int32 right-padded, lengths [B] int32, ragged cache) ->
        (logits [B, V] float32 at each row's last real token, cache)
        (``kvjax.inference.ragged.prefill_ragged_program``; no host checks)."""
        d = self.sharding(P("data"))
        fn = jax.jit(functools.partial(ragged.prefill_ragged_program.__wrapped__,
                                       cfg=self.cfg),
                     in_shardings=(self._p, d, d, self._c), out_shardings=(d, self._c),
                     donate_argnums=3)
        return _OnMesh(fn, self.mesh)

    def generate_ragged(self, sampling: SamplingConfig = SamplingConfig(), buf_len=None):
        """(params, first_token [B], ragged cache, budgets [B], row_keys [B], eos_id []) ->
        (tokens [B, buf_len] int32, counts [B] int32, cache)
        (``kvjax.inference.ragged.generate_ragged_program``)."""
        d = self.sharding(P("data"))
        fn = jax.jit(functools.partial(ragged.generate_ragged_program.__wrapped__,
                                       cfg=self.cfg, sampling=sampling,
                                       buf_len=buf_len or self.max_seq_len),
                     in_shardings=(self._p, d, self._c, d, d, None),
                     out_shardings=(d, d, self._c), donate_argnums=2)
        return _OnMesh(fn, self.mesh)


def _cache_spec(cfg, batch_size, max_seq_len, ragged):
    return jax.eval_shape(lambda: cache_lib.init_cache(cfg, batch_size, max_seq_len,
                                                       ragged=ragged))


def build(cfg: ModelConfig, mcfg: MeshConfig, batch_size: int, max_seq_len: int,
          devices=None, params=None, ragged: bool = False) -> MeshedModel:
    """Checks ``cfg`` against the mesh and builds the mesh, the specs and the units;
    ``cfg``'s plan is resolved for the mesh (:func:`kvjax.planner.resolve`).
    ``ragged``: the cache keeps per-row lengths (:mod:`kvjax.inference.ragged`).

    Raises:
      ConfigError: a mesh larger than the device count
        (:func:`kvjax.parallel.mesh.mesh_devices`), an axis that does not divide what it
        splits (:func:`kvjax.parallel.mesh.check`); before anything is compiled.
    """
    mesh_lib.check(cfg, mcfg, batch_size, cache_lib.num_slots(cfg, max_seq_len))
    devices, note = mesh_lib.mesh_devices(mcfg, devices)
    mesh = mesh_lib.make_mesh(mcfg, devices)
    cfg = planner.resolve(cfg, max_seq_len=max_seq_len, batch_sizes=(batch_size,),
                          mesh_axes=dict(mesh.shape))
    params = model_lib.param_shapes(cfg) if params is None else params
    cache = _cache_spec(cfg, batch_size, max_seq_len, ragged)
    return MeshedModel(cfg, mcfg, mesh, batch_size, max_seq_len,
                       specs_lib.param_specs(cfg, mcfg, params),
                       specs_lib.cache_specs(cfg, mcfg, cache), note, ragged)
