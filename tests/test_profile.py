"""The step profile (kvjax.analysis.profile): HLO parsing, trace reading, grouping, and a
profiled tiny step whose dots' bytes are the weights it holds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.analysis import hlo_cost, profile
from tests.conftest import tiny_config

HLO = """HloModule m
%fused_computation (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %e = f32[4]{0} exponential(%p)
}
ENTRY %main (w: f32[8,16], x: f32[1,8]) -> (f32[1,16], f32[1,16]) {
  %w = f32[8,16]{1,0} parameter(0)
  %x = f32[1,8]{1,0} parameter(1)
  %c = f32[] constant(1)
  %d = f32[1,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %k = (f32[1,16]{1,0}, s32[2]{0}) custom-call(%d, %w), custom_call_target="kvjax_rows_matmul", \
metadata={op_name="jit(decode_step)/DecoderLM/layers_3/mlp/up/ffi_call" stack_frame_id=1}
  %g = f32[1,16]{1,0} get-tuple-element(%k), index=0
  %f = f32[1,16]{1,0} fusion(%g), kind=kLoop, calls=%fused_computation, \
metadata={op_name="jit(decode_step)/DecoderLM/layers_0/attn/add"}
  ROOT %t = (f32[1,16]{1,0}, f32[1,16]{1,0}) tuple(%f, %d)
}
"""


def test_shape_bytes_counts_arrays_and_tuples():
    """The profile's operand bytes come from hlo_cost.shape_bytes, fp8 types included."""
    assert hlo_cost.shape_bytes("f32[1,512]{1,0}") == 2048
    assert hlo_cost.shape_bytes("(f32[1,2,4,64]{3,2,1,0}, bf16[1,2,4]{2,1,0})") == 2048 + 16
    assert hlo_cost.shape_bytes("pred[1,32768]{1,0}") == 32768
    assert hlo_cost.shape_bytes("f32[]") == 4
    assert hlo_cost.shape_bytes("(f8e4m3fn[2,8]{1,0}, f8e5m2[4]{0})") == 16 + 4
    with pytest.raises(ValueError, match="element type 'u7'"):
        hlo_cost.shape_bytes("u7[3]")


def test_entry_instructions_name_targets_paths_and_operand_bytes():
    ins = profile.entry_instructions(HLO)
    assert list(ins) == ["d", "k", "f"]  # no parameter, constant, gte, tuple; not fused ones
    assert ins["d"].opcode == "dot" and ins["d"].target == ""
    assert ins["d"].operand_bytes == 8 * 4 + 8 * 16 * 4 and ins["d"].output_bytes == 64
    assert ins["d"].path == "x"  # no metadata: the first parameter it reads
    assert ins["k"].target == "kvjax_rows_matmul" and ins["k"].path == "layers_3/mlp/up"
    assert ins["k"].operand_bytes == 64 + 512 and ins["k"].output_bytes == 64 + 8
    assert profile.group_key(ins["k"]) == "kvjax_rows_matmul layers_*/mlp/up"
    assert profile.group_key(ins["f"]) == "XLA ops layers_*/attn"
    with pytest.raises(ValueError, match="no ENTRY computation"):
        profile.entry_instructions("HloModule m\n")


def test_entry_instructions_of_a_compiled_dot():
    w, x = jnp.ones((64, 32), jnp.float32), jnp.ones((1, 64), jnp.float32)
    text = jax.jit(lambda w, x: jnp.tanh(x @ w)).lower(w, x).compile().as_text()
    ins = profile.entry_instructions(text)
    dots = [i for i in ins.values() if i.opcode == "dot"]
    fused = [i for i in ins.values() if i.opcode == "fusion"]
    # XLA:CPU keeps the dot apart or fuses it with the tanh; either reads w and x whole.
    read = (dots or fused)[0]
    assert read.operand_bytes == (64 * 32 + 64) * 4


def _events(runs, python_too=True):
    ev = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2,
           "args": {"name": "tf_XLAPjRtCpuClient/1"}}]
    ts = 0
    for name, us in runs:
        ev.append({"ph": "X", "name": name, "pid": 1, "tid": 2, "ts": ts, "dur": us})
        if python_too:
            ev.append({"ph": "X", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": 1e6})
        ts += us + 1
    return ev


def test_thunk_seconds_reads_runtime_threads_only():
    runs = profile.thunk_seconds(_events([("d", 10), ("k", 30), ("d", 20), ("z", 5)]),
                                 ["d", "k"])
    assert runs == {"d": [10e-6, 20e-6], "k": [30e-6]}


def test_thunk_seconds_keeps_the_named_module_only():
    """A small program run between steps may name a thunk as the step does ('copy')."""
    ev = _events([("copy", 10), ("copy", 20)], python_too=False)
    ev[2]["args"], ev[3]["args"] = {"hlo_module": "jit_stage"}, {"hlo_module": "jit_step"}
    assert profile.thunk_seconds(ev, ["copy"], "jit_step") == {"copy": [20e-6]}
    assert profile.thunk_seconds(ev, ["copy"]) == {"copy": [10e-6, 20e-6]}
    assert profile.module_name(HLO) == "m"
    assert profile.module_name("HloModule jit_decode_step, is_scheduled=true") \
        == "jit_decode_step"


def test_summarize_groups_by_step_and_flags_missing():
    ins = profile.entry_instructions(HLO)
    # two steps: d runs once a step, k once, f never
    runs = profile.thunk_seconds(_events([("d", 100), ("k", 300), ("d", 200), ("k", 500)]),
                                 ins)
    groups, total, missing = profile.summarize(ins, runs, steps=2)
    by = {g.key: g for g in groups}
    assert set(by) == {"dot x", "kvjax_rows_matmul layers_*/mlp/up"}
    assert by["kvjax_rows_matmul layers_*/mlp/up"].seconds == pytest.approx(400e-6)
    assert by["dot x"].seconds == pytest.approx(150e-6)
    assert by["dot x"].read_bytes == ins["d"].operand_bytes and by["dot x"].count == 1
    assert total == pytest.approx(np.median([400e-6, 700e-6]))
    assert missing == ("f",)
    assert groups[0].key.startswith("kvjax_rows_matmul")  # largest first
    with pytest.raises(ValueError, match="ran 3 times in 2 steps"):
        profile.summarize(ins, {"d": [1, 2, 3]}, steps=2)
    with pytest.raises(ValueError, match="steps=0"):
        profile.summarize(ins, runs, steps=0)


def test_profile_step_of_a_tiny_model_counts_its_weights():
    """XLA's formulations: every weight product a dot that reads its weight whole, so
    the dot groups' bytes are the model's weights (plus the activation rows they read),
    each instruction runs once a step, and the thunks fit inside the traced step."""
    cfg = tiny_config(decode_attention="xla", weight_matmul="xla", scan_layers=False)
    p = profile.profile_step(cfg, context=64, steps=2, warmup=1)
    assert p.missing == ()
    assert 0 < p.thunk_seconds <= p.traced_wall_seconds
    assert p.wall_seconds > 0
    dots = [g for g in p.groups if g.key.startswith("dot")]
    d, f, v, n, k, h = (cfg.d_model, cfg.mlp_dim, cfg.vocab_size, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim)
    head = next(g for g in dots if "embed" in g.key)
    assert head.count == 1 and head.read_bytes == (v * d + d) * 4  # tied head, one row
    weights = cfg.num_layers * (d * (n + 2 * k) * h + n * h * d + 3 * d * f) + v * d
    dot_bytes = sum(g.read_bytes for g in dots)
    assert weights * 4 <= dot_bytes <= weights * 4 * 1.2
    assert all(g.read_bytes is None for g in p.groups if g.key.startswith("XLA ops"))


def test_profile_step_refuses_bad_counts():
    with pytest.raises(ValueError, match="steps=0"):
        profile.profile_step(tiny_config(), context=64, steps=0)


def test_a_weight_product_is_named_by_the_weight_it_reads_through_bitcasts():
    hlo = """HloModule m
ENTRY %main (params__layers_2____mlp____up____kernel__.1: f32[8,16], x.1: f32[1,8]) \
-> f32[1,16] {
  %params__layers_2____mlp____up____kernel__.1 = f32[8,16]{1,0} parameter(0)
  %x.1 = f32[1,8]{1,0} parameter(1)
  %b = f32[16,8]{0,1} bitcast(%params__layers_2____mlp____up____kernel__.1)
  ROOT %k = f32[1,16]{1,0} custom-call(%x.1, %b, %b), custom_call_target="kvjax_rows_matmul", \
metadata={op_name="jit(decode_step)/DecoderLM/final_norm/mul"}
}
"""
    k = profile.entry_instructions(hlo)["k"]
    assert k.path == "layers_2/mlp/up/kernel" and k.operand_bytes == 32 + 512
    assert profile.group_key(k) == "kvjax_rows_matmul layers_*/mlp/up/kernel"
