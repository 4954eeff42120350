"""kvjax.parallel: meshes, partition specs, sharded decode, collectives, bad input.

Multi-device checks run tests/mesh_worker.py in a subprocess with 8 virtual CPU devices
(``--xla_force_host_platform_device_count=8`` must be set before JAX starts; this pytest
process keeps its single device).
"""

import json
import os
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from kvjax.config import (ConfigError, DistributedConfig, MeshConfig, ModelConfig,
                          run_config_from_dict)
from kvjax.models import model as model_lib
from kvjax.parallel import collectives, costs, mesh as mesh_lib, specs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(vocab_size=256, num_layers=2, d_model=64, num_heads=8, head_dim=16,
            mlp_dim=128, scan_layers=False)


def _worker(*args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "mesh_worker.py"),
                        *args], capture_output=True, text=True, env=env, timeout=900)
    line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, p.stderr[-3000:]
    return json.loads(line[0][7:])


# no "mha" case: K = N runs gqa's code (kvjax/models/attention.py: one einsum, G = N / K;
# kvjax/parallel/mesh.py: K = 8 and K = 4 both divide every 'model' axis here, so both
# split the cache over it), which the gqa case runs on the same four meshes
VARIANTS = ["gqa", "mqa", "mla", "window"]


@pytest.fixture(scope="module")
def sharded_runs():
    """Each variant's meshes, all run in one subprocess (one JAX start-up for the five)."""
    return _worker("variants", *VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_decode_equals_single_device(variant, sharded_runs):
    r = sharded_runs[variant]
    assert "traceback" not in r, r.get("traceback")
    tol = 2e-6 * r["logit_scale"] + 1e-5  # float32; logits up to ~50 here
    for mesh in ["(8, 1, 1)", "(2, 4, 1)", "(1, 2, 4)", "(1, 1, 8)"]:
        m = r[mesh]
        assert max(m["errors"]) < tol, (mesh, m["errors"])
        shape = eval(mesh)  # noqa: S307 (our own literal)
        kv_split = variant in ("mha", "gqa", "window") and shape[1] > 1
        shards = shape[0] * shape[2] * (shape[1] if kv_split else 1)
        assert m["cache_per_device"] * shards == m["cache_total"], (mesh, m)
        assert m["cache_gathers"] == [], (mesh, m["cache_gathers"])
        # the prefill writes its chunk into the sharded cache without gathering it (a
        # global write made GSPMD all-gather every cache tensor on a 'seq' mesh)
        want = {"fresh": [], "chunk": []} if shape[2] > 1 else {"chunk": []}
        assert m["prefill_gathers"] == want, (mesh, m["prefill_gathers"])
        kinds = {c["kind"] for c in m["collectives"]}
        assert kinds <= {"all-reduce", "all-gather"}, kinds
        # The only all-gather is of the [B, V/model] logits over 'model'.
        for c in m["collectives"]:
            if c["kind"] == "all-gather":
                assert c["axes"] == ["model"] and c["bytes"] == 8 // shape[0] * 256 * 4
        model_ar = [c for c in m["collectives"] if c["axes"] == ["model"]
                    and c["kind"] == "all-reduce" and "dot_general" in c["op"]]
        # one all-reduce per attention block (o_proj / wo) and one per MLP (down) per layer
        assert len(model_ar) == (2 * 2 if shape[1] > 1 else 0), (mesh, model_ar)
        seq = [c for c in m["collectives"] if "seq" in c["axes"]]
        if shape[2] > 1:
            # per layer: one pmax (m) and one all-reduce of (l, o): softmax statistics only,
            # at most B·N·(Hv + 1)·4 bytes, never a cache shard
            assert len(seq) == 2 * 2, (mesh, seq)
            hv = 32 if variant == "mla" else 16
            assert all(c["bytes"] <= 8 * 8 * (hv + 1) * 4 for c in seq), seq
        else:
            assert not seq


def test_quantized_and_ragged_caches_on_meshes():
    """One subprocess: int8 / int4 GQA and fp8 MLA caches (codes + float32 scales, both
    sharded like the cache), the layer scan (stacked cache) and a ragged batch (per-row
    positions [B, S] and lengths [B]) give the single-device logits and tokens on data /
    model / seq meshes, and no program (prefill, step, loop) gathers the cache."""
    r = _worker("cases")
    cases = {k: [tuple(m) for m in v] for k, v in r["meshes"].items()}
    assert {"gqa_int8", "gqa_int4", "mla_fp8", "scan", "ragged"} <= set(cases)
    for variant in ("gqa_int8", "gqa_int4", "mla_fp8", "scan"):
        meshes = cases[variant]
        tol = 2e-6 * r[variant]["logit_scale"] + 1e-5
        for shape in meshes:
            m = r[variant][str(shape)]
            assert max(m["errors"]) < tol, (variant, shape, m["errors"])
            kv_split = variant != "mla_fp8" and shape[1] > 1
            shards = shape[0] * shape[2] * (shape[1] if kv_split else 1)
            assert m["cache_per_device"] * shards == m["cache_total"], (variant, shape, m)
            assert m["cache_gathers"] == [], (variant, shape, m["cache_gathers"])
            want = {"fresh": [], "chunk": []} if shape[2] > 1 else {"chunk": []}
            assert m["prefill_gathers"] == want, (variant, shape, m)
    g = r["ragged"]
    assert len(set(g["ref_length"])) > 1  # rows really are at different lengths
    assert (8, 1, 1) in cases["ragged"]  # the data mesh
    for shape in cases["ragged"]:
        m = g[str(shape)]
        assert m["prefill_error"] < 2e-6 * g["logit_scale"] + 1e-5, (shape, m["prefill_error"])
        assert m["tokens"] == g["ref_tokens"] and m["length"] == g["ref_length"], shape
        assert m["length_spec"] == "P('data',)" and m["positions_spec"] == "P('data', 'seq')"
        assert m["cache_gathers"] == [], (shape, m["cache_gathers"])
    # the fourth view: jax.experimental.roofline's 'seq' traffic (the hand-written
    # softmax-statistics combine) within 10% of the HLO all-reduces' ring link bytes
    for shape in ("(1, 1, 8)", "(2, 1, 4)"):
        v = r["roofline"][shape]
        assert v["error"] is None, v
        assert abs(v["roofline"]["seq"] / v["hlo"]["seq"] - 1) < 0.1, (shape, v)
    v = r["roofline"]["(2, 4, 1)"]
    assert v["roofline"] is None and "mesh.model > 1" in v["error"] and v["hlo"]["model"] > 0
    # the step reads each device's KV shard once and copies none of it (the 'seq' score
    # einsum with a T axis made XLA transpose every 'BKHS' key shard: kv_copies = 2x)
    for shape, v in r["roofline"].items():
        assert v["kv_copies"] == 0 and v["kv_read"] == v["kv_dev"], (shape, v)
    # prefill_impl='native' on model / seq meshes: the kernel runs on each device's rows
    # and KV heads (q/k/v were all-gathered around the custom call): one-device logits,
    # and the only all-gather left is the logits' [B / data, V] over 'model'
    n = r["native"]
    for shape in () if "skipped" in n else ("(2, 4, 1)", "(1, 2, 4)"):
        for kind in ("fresh", "chunk"):
            v = n[shape][kind]
            assert v["error"] < 2e-6 * n["logit_scale"] + 1e-5, (shape, kind, v)
            assert v["all_gathers"] == [["model"]], (shape, kind, v)
        assert n[shape]["fresh"]["custom_call"]  # the kernel really ran


def test_param_specs_megatron():
    cfg = ModelConfig(**TINY, attention="gqa", num_kv_heads=4)
    ps = specs.param_specs(cfg, MeshConfig(1, 4, 1), model_lib.param_shapes(cfg))
    attn = ps["layers_0"]["attn"]
    assert attn["q_proj"]["kernel"] == P(None, "model", None)
    assert attn["k_proj"]["kernel"] == P(None, "model", None)
    assert attn["o_proj"]["kernel"] == P("model", None, None)
    assert ps["layers_0"]["mlp"]["up"]["kernel"] == P(None, "model")
    assert ps["layers_0"]["mlp"]["down"]["kernel"] == P("model", None)
    assert ps["embed"]["embedding"] == P("model", None)
    assert ps["final_norm"]["scale"] == P(None)
    # K = 4 < model = 8 with replication: KV projections whole on every model shard
    ps8 = specs.param_specs(cfg, MeshConfig(1, 8, 1, kv_fallback="replicate"),
                            model_lib.param_shapes(cfg))
    assert ps8["layers_0"]["attn"]["k_proj"]["kernel"] == P(None, None, None)


def test_cache_specs_follow_tensor_specs():
    cfg = ModelConfig(**TINY, attention="gqa", num_kv_heads=4, key_layout="BKHS",
                      value_layout="BKSH")
    mc = MeshConfig(2, 2, 2)
    assert specs.cache_tensor_spec(cfg, mc, "k") == P("data", "model", None, "seq")
    assert specs.cache_tensor_spec(cfg, mc, "v") == P("data", "model", "seq", None)
    mla = ModelConfig(**{**TINY, "num_kv_heads": 8}, attention="mla", kv_lora_rank=32,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    assert specs.cache_tensor_spec(mla, mc, "c_kv") == P("data", "seq", None)
    scan = cfg.replace(scan_layers=True)
    from kvjax import cache as cache_lib
    cs = specs.cache_specs(scan, mc, cache_lib.cache_spec(scan, 2, 8))
    assert cs.tensors["k"] == P(None, "data", "model", None, "seq")
    assert cs.positions == P("data", "seq") and cs.length == P("data")


def test_bad_input_raises_before_compile():
    cfg = ModelConfig(**TINY, attention="mqa", num_kv_heads=1)
    with pytest.raises(ConfigError, match="device count, 1"):
        mesh_lib.make_mesh(MeshConfig(2, 1, 1))
    with pytest.raises(ConfigError, match="mesh.model=2.*num_kv_heads=1.*kv_fallback"):
        mesh_lib.check(cfg, MeshConfig(1, 2, 1))
    mesh_lib.check(cfg, MeshConfig(1, 2, 1, kv_fallback="replicate"))
    with pytest.raises(ConfigError, match="mesh.model=3.*num_heads=8"):
        mesh_lib.check(cfg, MeshConfig(1, 3, 1))
    with pytest.raises(ConfigError, match="model.weight_matmul='native'.*not a mesh.*allowed here: \\['auto', 'xla'\\]"):
        mesh_lib.check(cfg.replace(weight_matmul="native"), MeshConfig(2, 1, 1))
    mesh_lib.check(cfg.replace(weight_matmul="auto"), MeshConfig(2, 1, 1))
    for impl in ("native_ksplit", "native_lanes"):
        with pytest.raises(ConfigError, match=f"model.weight_matmul='{impl}'.*not a mesh"):
            mesh_lib.check(cfg.replace(weight_matmul=impl), MeshConfig(1, 2, 1))
    mesh_lib.check(cfg.replace(weight_matmul="native"), MeshConfig(1, 1, 1))  # no mesh
    with pytest.raises(ConfigError, match="model.decode_attention='native'.*not a mesh"):
        mesh_lib.check(cfg.replace(decode_attention="native"), MeshConfig(1, 1, 2))
    mesh_lib.check(cfg.replace(decode_attention="auto"), MeshConfig(1, 1, 2))
    # the native prompt kernel runs per device on whole KV heads: K = 1 on model = 2 no
    with pytest.raises(ConfigError, match="model.prefill_impl='native'.*'model' axis dividing the KV heads"):
        mesh_lib.check(cfg.replace(prefill_impl="native"),
                       MeshConfig(1, 2, 1, kv_fallback="replicate"))
    mesh_lib.check(cfg.replace(prefill_impl="auto"), MeshConfig(1, 2, 1, kv_fallback="replicate"))
    with pytest.raises(ConfigError, match="batch_size=3.*mesh.data=2"):
        mesh_lib.check(cfg, MeshConfig(2, 1, 1), batch_size=3)
    with pytest.raises(ConfigError, match="mesh.seq=3.*S=32"):
        mesh_lib.check(cfg, MeshConfig(1, 1, 3), num_slots=32)
    with pytest.raises(ConfigError, match="distributed.process_id=2"):
        DistributedConfig(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2)
    with pytest.raises(ConfigError, match="mesh.kv_fallback"):
        MeshConfig(kv_fallback="gather")


def test_mesh_smaller_than_the_devices_uses_the_first_and_says_so():
    """The rule (kvjax.parallel.mesh.mesh_devices): larger than the device count is an
    error, smaller uses the first prod(axes) devices with a note, except with several
    processes (then equal)."""
    import types
    dev = lambda i, proc=0: types.SimpleNamespace(id=i, process_index=proc, platform="cpu")
    eight = [dev(i) for i in range(8)]
    used, note = mesh_lib.mesh_devices(MeshConfig(1, 3, 1), eight)
    assert [d.id for d in used] == [0, 1, 2]
    assert "(1, 3, 1) uses 3 of the 8 cpu devices" in note
    assert mesh_lib.mesh_devices(MeshConfig(2, 2, 2), eight) == (eight, None)
    with pytest.raises(ConfigError, match=r"1\*3\*3 = 9; allowed: at most the device count, 8"):
        mesh_lib.mesh_devices(MeshConfig(1, 3, 3), eight)
    two_procs = [dev(i, i // 4) for i in range(8)]
    with pytest.raises(ConfigError, match="= 3; allowed: the device count, 8.*several processes"):
        mesh_lib.mesh_devices(MeshConfig(1, 3, 1), two_procs)


def test_mesh_from_command_line_config():
    from configs import gqa
    c = gqa.get_config()
    c.mesh.model = 3
    c.mesh.data = 2
    run = run_config_from_dict(c)
    assert run.mesh == MeshConfig(2, 3, 1) and run.mesh.size == 6
    c.mesh.modle = 1
    with pytest.raises(ConfigError, match="mesh.modle"):
        run_config_from_dict(c)


def test_replica_group_formats():
    import numpy as np

    class M:  # a (data, model, seq) = (2, 2, 2) mesh's shape and names
        devices = np.zeros((2, 2, 2))
        axis_names = ("data", "model", "seq")

    g = collectives.replica_groups("replica_groups={{0,1},{2,3},{4,5},{6,7}}", 8)
    assert collectives.mesh_axes(g, M) == ("seq",)
    g = collectives.replica_groups("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", 8)
    assert collectives.mesh_axes(g, M) == ("model",)
    g = collectives.replica_groups(
        "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0'}, x", 8)
    assert collectives.mesh_axes(g, M) == ("data",)


def test_two_processes_on_loopback_match_single_process():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    script = os.path.join(ROOT, "tests", "multiprocess_worker.py")
    procs = [subprocess.Popen([sys.executable, script, str(port), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    get = lambda text, tag: json.loads(next(
        l for l in text.splitlines() if l.startswith(tag + " "))[len(tag) + 1:])
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    ref = get(outs[0][0], "REF")
    assert get(outs[0][0], "TOKENS") == ref
    assert get(outs[1][0], "TOKENS") == ref


def test_a_cache_gather_fails_loudly():
    """A program that all-gathers a cache shard raises CacheGatherError naming the
    program and the shapes (the seq-sharded prefill once did, 61 times, quietly); the
    logits gather over 'model' does not."""
    import numpy as np

    class M:  # a (data, model, seq) = (1, 2, 4) mesh's shape and names
        devices = np.zeros((1, 2, 4))
        axis_names = ("data", "model", "seq")

    cfg = ModelConfig(**TINY, attention="gqa", num_kv_heads=4)
    mc = MeshConfig(1, 2, 4)
    shapes = costs.cache_shapes(cfg, mc, 8, 32)
    assert (8, 4, 32, 16) in shapes and (8, 2, 8, 16) in shapes  # global, per device
    hlo = ("  %param.1 = f32[8,2,8,16]{3,2,1,0} parameter(1)\n"
           "  %ag = f32[8,2,32,16]{3,2,1,0} all-gather(f32[8,2,8,16]{3,2,1,0} %param.1), "
           "channel_id=1, replica_groups=[2,4]<=[8], dimensions={2}\n"
           "  %param.2 = f32[8,128]{1,0} parameter(2)\n"
           "  %ag.1 = f32[8,256]{1,0} all-gather(f32[8,128]{1,0} %param.2), channel_id=2, "
           "replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}\n")
    colls = collectives.collectives(hlo, M)
    assert [c.axes for c in colls] == [("seq",), ("model",)]
    collectives.check_cache_stays({"generate": colls[1:]}, shapes)  # logits only: fine
    with pytest.raises(collectives.CacheGatherError,
                       match=r"prefill: 1 x all-gather .*over seq.*\[8, 2, 8, 16\]"):
        collectives.check_cache_stays({"generate": colls[1:], "prefill": colls}, shapes)
