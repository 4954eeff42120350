"""The execution plan: resolved before tracing, read (never measured) while tracing."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

from kvjax import native, planner
from kvjax import cache as cache_lib
from kvjax.analysis import costs
from kvjax.config import SamplingConfig
from kvjax.inference import decode
from kvjax.models import decode_kernels
from kvjax.models import model as model_lib
from kvjax.native import prefill as native_prefill
from kvjax.native import rows_matmul as rm
from kvjax.plan import REFERENCE, Plan
from tests.conftest import tiny_config

B, S, T = 2, 64, 8


def _programs(cfg):
    """(decode step, generate loop, prefill) lowered from shapes: nothing runs."""
    params = model_lib.param_shapes(cfg)
    cache = cache_lib.cache_spec(cfg, B, S)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    step = decode.decode_step.lower(params, jax.ShapeDtypeStruct((B, 1), jnp.int32), cache,
                                    cfg=cfg)
    loop = decode.generate_program.lower(
        params, jax.ShapeDtypeStruct((B,), jnp.int32), cache, scalar, jax.random.key(0),
        scalar, cfg=cfg, sampling=SamplingConfig(), buf_len=S)
    prefill = decode.prefill_program.lower(params, jax.ShapeDtypeStruct((B, T), jnp.int32),
                                           cache, cfg=cfg, fresh=True)
    return step, loop, prefill


def _native_cfg():
    if not (native.load() and native_prefill.load() and rm.load()):
        pytest.skip("the native kernels did not build here")
    return tiny_config(decode_attention="native", weight_matmul="native",
                       prefill_impl="native")


def test_tracing_with_a_resolved_plan_measures_nothing_and_writes_nothing(
        tmp_path, monkeypatch):
    cfg = planner.resolve(_native_cfg().replace(weight_matmul="auto"), max_seq_len=S,
                          batch_sizes=(B,), rows=(B * T,))
    assert set(cfg.plan.native) == {"decode_attention", "prefill_attention", "rows_matmul"} | (
        {"decode_attention_blocks"} if native.block_sweep() else set())
    empty = tmp_path / "planner"
    empty.mkdir()
    monkeypatch.setenv(planner.PLANNER_CACHE_ENV, str(empty))
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))

    def refuse(*a, **k):
        raise AssertionError("measured or built while tracing")

    # the kernels' load() is a read of the state resolve left (loaded once per process);
    # building, a smoke call, measuring or writing a planner file would refuse
    for mod, names in ((planner, ("resolve", "measure", "measure_weight_matmul",
                                  "_decode_pick", "_weight_pick", "_save")),
                       (native, ("build_library", "_build", "_run_smoke"))):
        for name in names:
            monkeypatch.setattr(mod, name, refuse)
    texts = [p.as_text() for p in _programs(cfg)]
    assert all("custom_call" in t or "custom-call" in t for t in texts)
    assert list(tmp_path.rglob("*")) == [empty]


def test_a_different_pick_is_another_program():
    cfg = planner.resolve(_native_cfg(), max_seq_len=S, batch_sizes=(B,), rows=(B * T,))
    plain = cfg.replace(plan=dataclasses.replace(cfg.plan, native=()),
                        decode_attention="xla", weight_matmul="xla", prefill_impl="tiled")
    assert hash(cfg) != hash(plain) and cfg != plain
    step_native, _, _ = _programs(cfg)
    step_xla, _, _ = _programs(plain)
    assert "kvjax_decode_attention" in step_native.as_text()
    assert "kvjax_decode_attention" not in step_xla.as_text()


def test_a_config_without_a_plan_runs_the_reference():
    cfg = tiny_config(decode_attention="auto", weight_matmul="auto")
    assert cfg.plan is None and cfg.execution == REFERENCE
    for p in _programs(cfg):
        assert "kvjax_" not in p.as_text()
    with pytest.raises(ValueError, match="planner.resolve"):
        _programs(tiny_config(decode_attention="native"))


def test_auto_picks_are_per_shape_class_and_printed(planner_home):
    big = dict(num_kv_heads=2, head_dim=64, num_heads=4)
    cfg = planner.resolve(tiny_config(decode_attention="auto", **big), max_seq_len=1024,
                          batch_sizes=(1, 4))
    names = [n for n, _ in cfg.plan.decode_attention]
    assert len(names) == 2 and names[0].startswith("B1-K2-G2-H64") and "S1024" in names[0]
    assert all(impl in ("xla", "xla_cache_left", "native", "native_blocks") for _, impl in
               cfg.plan.decode_attention)
    lines = cfg.plan.lines()
    # the header, two decode classes, the prompt's attention fresh and over a cache
    assert lines[0].startswith("plan: native kernels") and len(lines) == 5
    assert cfg.plan.prefill_attention == (("chunk", "tiled"), ("prompt", "tiled"))


def test_paged_classes_are_measured_on_pages_and_read_by_the_paged_step(planner_home):
    """A paged decode step has its own shape classes ('-paged{P}'), measured over page
    pools (native in place, the others over gathered views); the paged model step picks
    from them, and a dense step of the same config does not find them."""
    big = dict(num_kv_heads=2, head_dim=64, num_heads=4)
    cfg = planner.resolve(tiny_config(decode_attention="auto", **big), max_seq_len=1024,
                          batch_sizes=(1,), page_size=16)
    names = [n for n, _ in cfg.plan.decode_attention]
    assert names == ["B1-K2-G2-H64-V64-S1024-float32-BKHS-BKSH-paged16"], names
    entry = planner._memo[names[0]]
    assert set(entry["gbps"]) >= {"xla"} and all(g > 0 for g in entry["gbps"].values())
    if native.load():
        assert "native" in entry["gbps"]
    pick = cfg.plan.decode_attention[0][1]
    k = jnp.zeros((1, 2, 64, 1024), jnp.float32)
    v = jnp.zeros((1, 2, 1024, 64), jnp.float32)
    assert decode_kernels.choose(cfg, k, v, page_size=16) == pick
    assert decode_kernels.choose(cfg, k, v) == "xla"  # no dense class in this plan
    for bad in (-1, 2.5, True, "4", None):
        with pytest.raises(ValueError, match=f"page_size={bad!r}; allowed: an integer"):
            planner.resolve(cfg, max_seq_len=64, page_size=bad)


def test_gpu_config_on_a_cpu_gets_the_gpu_plan_and_no_cpu_kernel():
    gpu = tiny_config(backend="gpu", decode_attention="auto", weight_matmul="auto",
                      prefill_impl="auto", head_dim=64, num_heads=4, num_kv_heads=2)
    assert gpu.cache_layout("k") == gpu.cache_layout("v") == "BKSH" and gpu.scan_layers
    plan = planner.resolve(gpu, max_seq_len=1024, batch_sizes=(B,)).plan
    assert plan.native == () and plan.weight_matmul == ()
    assert [impl for _, impl in plan.decode_attention] == ["pallas"]
    ring = planner.resolve(gpu.replace(window_size=32), max_seq_len=S, batch_sizes=(B,))
    assert [impl for _, impl in ring.plan.decode_attention] == ["xla"]
    text = costs.compile_decode_step(ring, B, S).as_text()
    assert "kvjax_" not in text


def test_mesh_plan_picks_xla_and_names_its_axes():
    cfg = planner.resolve(tiny_config(decode_attention="auto", weight_matmul="auto",
                                      head_dim=64, num_heads=4, num_kv_heads=2),
                          max_seq_len=4096, batch_sizes=(1,),
                          mesh_axes={"data": 1, "model": 1, "seq": 2})
    plan = cfg.plan
    assert plan.mesh_axes == (("seq", 2),) and plan.seq_shards == 2
    assert plan.weight_matmul == ()
    # what runs: the split cache's states combined across 'seq', never a kernel
    assert all(impl == "seq" for _, impl in plan.decode_attention)
    assert plan.per_device_axes() == (None, None)
    manual = plan.on_mesh({"data": 2, "seq": 2}, manual=("seq",))
    assert manual.seq_manual and manual.per_device_axes() == ("data", None)


def test_resolve_refuses_bad_sizes():
    with pytest.raises(ValueError, match="max_seq_len=0"):
        planner.resolve(tiny_config(), max_seq_len=0)
    with pytest.raises(ValueError, match="batch_sizes"):
        planner.resolve(tiny_config(), max_seq_len=8, batch_sizes=(0,))


def test_plan_is_not_a_config_file_field():
    from kvjax.config import ConfigError, model_config_from_dict
    d = {f: getattr(tiny_config(), f) for f in
         ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim",
          "mlp_dim")}
    with pytest.raises(ConfigError, match="model.plan"):
        model_config_from_dict({**d, "plan": Plan()})
    assert os.environ.get(planner.PLANNER_CACHE_ENV)  # the session's folder (conftest)
