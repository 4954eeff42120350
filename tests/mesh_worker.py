"""Run in a subprocess by tests/test_parallel.py: sharded decode on 8 virtual CPU devices.

``python tests/mesh_worker.py VARIANT`` prints one JSON object (``variants V1 V2 ...``: one
object of them by name, run in one process; a failed one holds its traceback): for each mesh, the max
|sharded - single-device| of the prefill and decode-step logits, the cache bytes per
device, the collective inventory and any cache all-gathers. XLA_FLAGS is set here,
before JAX starts (the pytest process keeps its single device).
"""

import json
import os
import sys

# LLVM at -O0: what this worker asserts is read before LLVM runs (the partitioned HLO's
# collectives and shardings) or compared with a one-device reference compiled alike, and
# the machine code's speed is never measured here; -O0 takes a third off its ~90 programs'
# compile time (docs/decisions/0048-mesh-worker-llvm-o0.md)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8"
                           + " --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kvjax import planner  # noqa: E402
from kvjax import cache as cache_lib  # noqa: E402
from kvjax.config import MeshConfig, ModelConfig, SamplingConfig  # noqa: E402
from kvjax.inference import decode  # noqa: E402
from kvjax.models import model as model_lib  # noqa: E402
from kvjax.parallel import collectives, programs  # noqa: E402

MESHES = [(8, 1, 1), (2, 4, 1), (1, 2, 4), (1, 1, 8)]
BASE = dict(vocab_size=256, num_layers=2, d_model=64, num_heads=8, head_dim=16,
            mlp_dim=128, scan_layers=False)
VARIANTS = {
    "mha": dict(attention="mha", num_kv_heads=8),
    "gqa": dict(attention="gqa", num_kv_heads=4),
    "mqa": dict(attention="mqa", num_kv_heads=1),
    "mla": dict(attention="mla", num_kv_heads=8, kv_lora_rank=32, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16),
    "window": dict(attention="gqa", num_kv_heads=4, window_size=16),
    "scan": dict(attention="gqa", num_kv_heads=4, scan_layers=True),
    # quantized caches: codes + float32 'name_scale' tensors, sharded alike
    "gqa_int8": dict(attention="gqa", num_kv_heads=4, kv_dtype="int8"),
    "gqa_int4": dict(attention="gqa", num_kv_heads=4, kv_dtype="int4"),
    "mla_fp8": dict(attention="mla", num_kv_heads=8, kv_lora_rank=32, qk_rope_head_dim=8,
                    qk_nope_head_dim=16, v_head_dim=16, kv_dtype="float8_e4m3fn"),
}
# `python tests/mesh_worker.py cases`: quantized and ragged caches in one process
CASES = {"gqa_int8": [(2, 4, 1), (1, 1, 8)], "gqa_int4": [(1, 2, 4)], "mla_fp8": [(1, 2, 4)],
         "scan": [(1, 2, 4)]}  # scan: the layer scan (stacked cache, dynamic layer index)
RAGGED_MESHES = [(8, 1, 1), (1, 2, 4)]
B, S, T, STEPS = 8, 32, 5, 3


def main(variant: str, meshes=MESHES) -> dict:
    cfg = ModelConfig(**{**BASE, **VARIANTS[variant]}, name=variant)
    params = model_lib.params_for(cfg, model_lib.init_params(cfg, 0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size, jnp.int32)
    # single device reference: prefill, then STEPS greedy decode steps
    ref, cache = decode.prefill_program(params, tokens, cache_lib.init_cache(cfg, B, S),
                                        cfg=cfg)
    refs, nxt = [ref], []
    tok = jnp.argmax(ref, -1).astype(jnp.int32)[:, None]
    for _ in range(STEPS):
        nxt.append(tok)
        lg, cache = decode.decode_step(params, tok, cache, cfg=cfg)
        refs.append(lg)
        tok = jnp.argmax(lg, -1).astype(jnp.int32)[:, None]
    out = {"logit_scale": float(jnp.max(jnp.abs(ref)))}
    for shape in meshes:
        mm = programs.build(cfg, MeshConfig(*shape, kv_fallback="replicate"), B, S)
        p, c = mm.shard_params(params), mm.init_cache()
        # compiled once: run, and its collectives read (a later chunk's prefill, attending
        # over the sharded cache)
        prefill = mm.prefill().lower(p, tokens, c).compile()
        prefill_colls = {"chunk": collectives.collectives(prefill, mm.mesh)}
        if shape[2] > 1:  # and into an empty cache (as the entry points do), on 'seq'
            prefill_colls["fresh"] = collectives.collectives(
                mm.prefill(True).lower(p, tokens, c).compile(), mm.mesh)
        lg, c = prefill(p, tokens, c)
        errs = [float(jnp.max(jnp.abs(lg - refs[0])))]
        step = mm.decode_step()
        for i in range(STEPS):
            lg, c = step(p, nxt[i], c)
            errs.append(float(jnp.max(jnp.abs(lg - refs[i + 1]))))
        k0 = jax.tree.leaves(c.tensors)[0]
        total = cache_lib.cache_bytes(c)
        per_dev = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(c.tensors))
        colls = collectives.collectives(step.lower(p, nxt[0], c).compile(), mm.mesh)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(c.tensors)]
        shapes += [tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(c.tensors)]
        prefill_gathers = {k: [x.name for x in collectives.cache_collectives(v, shapes)]
                           for k, v in prefill_colls.items()}
        out[str(shape)] = {
            "prefill_gathers": prefill_gathers,
            "errors": errs, "cache_total": total, "cache_per_device": per_dev,
            "spec": str(k0.sharding.spec),
            "cache_in_place": all(np.all(np.asarray(x.sharding.spec == y.sharding.spec))
                                  for x, y in zip(jax.tree.leaves(c.tensors),
                                                  jax.tree.leaves(c.tensors))),
            "collectives": [dict(kind=x.kind, axes=list(x.axes), bytes=x.bytes,
                                 op=x.op_name.split("/")[-2:]) for x in colls],
            "cache_gathers": [x.name for x in collectives.cache_collectives(colls, shapes)],
        }
    return out


def roofline() -> dict:
    """jax.experimental.roofline's ici bytes per axis beside the HLO collectives' link
    bytes per axis (kvjax.parallel.costs), per mesh."""
    from kvjax.analysis import hlo_cost  # noqa: PLC0415
    from kvjax.parallel import costs  # noqa: PLC0415
    cfg = ModelConfig(**{**BASE, **VARIANTS["gqa"]}, key_layout="BKHS", value_layout="BKSH",
                      name="roofline")
    out = {}
    for shape in [(1, 1, 8), (2, 1, 4), (2, 4, 1)]:
        c = costs.analyze_sharded_step(cfg, MeshConfig(*shape), S, batch=shape[0])
        parts = hlo_cost.attribute(hlo_cost.op_costs(c.compiled)).bytes
        out[str(shape)] = {"roofline": c.roofline_per_axis, "hlo": c.per_axis,
                           "error": c.roofline_error, "kv_copies": parts["kv_copies"],
                           "kv_read": parts["kv_read"], "kv_dev": c.kv_bytes_dev}
    return out


def ragged(meshes=RAGGED_MESHES) -> dict:
    """Ragged batch (rows of different prompt lengths, per-row cache lengths): prefill
    logits and greedy tokens on each mesh vs one device."""
    from kvjax.inference import ragged as ragged_lib  # noqa: PLC0415
    cfg = ModelConfig(**{**BASE, **VARIANTS["gqa"]}, name="ragged")
    params = model_lib.params_for(cfg, model_lib.init_params(cfg, 0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in (5, 2, 7, 1, 3, 6, 4, 2)]
    tokens, lengths = ragged_lib.pad_prompts(prompts)
    budgets = np.array([3, 6, 1, 5, 4, 2, 6, 3], np.int32)
    keys = ragged_lib.row_keys_for(None, B)
    ref, cache = ragged_lib.prefill_ragged_program(
        params, jnp.asarray(tokens), jnp.asarray(lengths),
        cache_lib.init_cache(cfg, B, S, ragged=True), cfg=cfg)
    first = jnp.argmax(ref, -1).astype(jnp.int32)
    buf, counts, cache = ragged_lib.generate_ragged_program(
        params, first, cache, jnp.asarray(budgets), keys, jnp.int32(-1), cfg=cfg,
        sampling=SamplingConfig(), buf_len=S)
    out = {"logit_scale": float(jnp.max(jnp.abs(ref))), "ref_tokens": np.asarray(buf).tolist(),
           "ref_length": np.asarray(cache.length).tolist()}
    for shape in meshes:
        mm = programs.build(cfg, MeshConfig(*shape), B, S, ragged=True)
        p = mm.shard_params(params)
        lg, c = mm.prefill_ragged()(p, jnp.asarray(tokens), jnp.asarray(lengths),
                                    mm.init_cache())
        f = jnp.argmax(lg, -1).astype(jnp.int32)
        gen = mm.generate_ragged(SamplingConfig(), S)
        b, n, c = gen(p, f, c, jnp.asarray(budgets), keys, jnp.int32(-1))
        colls = collectives.collectives(gen.lower(p, f, c, jnp.asarray(budgets), keys,
                                                  jnp.int32(-1)).compile(), mm.mesh)
        colls += collectives.collectives(mm.prefill_ragged().lower(
            p, jnp.asarray(tokens), jnp.asarray(lengths), c).compile(), mm.mesh)
        shapes = [tuple(x.shape) for x in jax.tree.leaves(c.tensors)]
        shapes += [tuple(x.addressable_shards[0].data.shape) for x in jax.tree.leaves(c.tensors)]
        out[str(shape)] = {
            "prefill_error": float(jnp.max(jnp.abs(lg - ref))),
            "tokens": np.asarray(b).tolist(), "counts": np.asarray(n).tolist(),
            "length": np.asarray(c.length).tolist(),
            "length_spec": str(c.length.sharding.spec),
            "positions_spec": str(c.positions.sharding.spec),
            "cache_gathers": [x.name for x in collectives.cache_collectives(colls, shapes)]}
    return out


def native(meshes=((2, 4, 1), (1, 2, 4))) -> dict:
    """prefill_impl='native' (a custom call) on meshes: prefill logits into an empty cache
    ('fresh') and over it ('chunk') vs one device, and the prefill's all-gathers."""
    from kvjax.native import prefill as native_prefill  # noqa: PLC0415
    if not native_prefill.load():
        return {"skipped": "the native prefill kernel did not build"}
    cfg = planner.resolve(
        ModelConfig(**{**BASE, **VARIANTS["gqa"]}, prefill_impl="native", name="native"),
        max_seq_len=S, batch_sizes=(B,), rows=(B * T,))
    params = model_lib.params_for(cfg, model_lib.init_params(cfg, 0))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size, jnp.int32)
    ref, cache = decode.prefill_program(params, tokens, cache_lib.init_cache(cfg, B, S),
                                        cfg=cfg, fresh=True)
    ref2, _ = decode.prefill_program(params, tokens, cache, cfg=cfg)
    out = {"logit_scale": float(jnp.max(jnp.abs(ref)))}
    for shape in meshes:
        mm = programs.build(cfg, MeshConfig(*shape), B, S)
        p, c = mm.shard_params(params), mm.init_cache()
        out[str(shape)] = {}
        for fresh, want in ((True, ref), (False, ref2)):
            compiled = mm.prefill(fresh).lower(p, tokens, c).compile()
            lg, c = compiled(p, tokens, c)
            out[str(shape)]["fresh" if fresh else "chunk"] = {
                "error": float(jnp.max(jnp.abs(lg - want))),
                "custom_call": "custom-call" in compiled.as_text(),
                "all_gathers": [list(x.axes) for x in collectives.collectives(compiled, mm.mesh)
                                if x.kind == "all-gather"]}
    return out


if __name__ == "__main__":
    if sys.argv[1] == "cases":
        res = {name: main(name, meshes) for name, meshes in CASES.items()}
        res["ragged"] = ragged()
        res["meshes"] = {**CASES, "ragged": RAGGED_MESHES}
        res["roofline"] = roofline()
        res["native"] = native()
        print("RESULT " + json.dumps(res))
    elif sys.argv[1] == "variants":  # several variants' runs in one process
        res = {}
        for name in sys.argv[2:]:
            try:
                res[name] = main(name)
            except Exception:  # noqa: BLE001 (reported in the variant's own test)
                import traceback  # noqa: PLC0415
                res[name] = {"traceback": traceback.format_exc()}
        print("RESULT " + json.dumps(res))
    elif sys.argv[1] == "roofline":
        print("RESULT " + json.dumps(roofline()))
    else:
        meshes = [tuple(json.loads(m)) for m in sys.argv[2:]] or MESHES
        print("RESULT " + json.dumps(main(sys.argv[1], meshes)))
