"""Fused projections for decoding (model.fuse_projections): q/k/v as one weight product
and gate/up as one, the same function, bytes and greedy tokens as the separate ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import planner
from kvjax.models import model, weight_matmul
from kvjax.native import rows_matmul as rm
from kvjax.plan import Plan
from scripts.thunk_count import entry_ops
from tests import reference
from tests.conftest import positions, tiny_config, tiny_mla_config

CONFIGS = {
    "gqa": lambda: tiny_config(tie_embeddings=False),
    "gqa_per_layer": lambda: tiny_config(tie_embeddings=False, scan_layers=False),
    "mha": lambda: tiny_config(tie_embeddings=False, num_kv_heads=4),
    "mqa": lambda: tiny_config(tie_embeddings=False, num_kv_heads=1),
    "window": lambda: tiny_config(tie_embeddings=False, window_size=6),
    "bias_qknorm_geglu": lambda: tiny_config(tie_embeddings=False, qkv_bias=True,
                                             qk_norm=True, mlp_type="geglu"),
    "mla": lambda: tiny_mla_config(tie_embeddings=False),
}


def _random_biases(params, seed=3):
    """Non-zero biases (init_params draws zeros for none: a bias of 0 hides a bad concat)."""
    gen = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(gen.standard_normal(a.shape) * 0.3, a.dtype)
        if getattr(p[-1], "key", "") == "bias" else a, params)


def _greedy(params, cfg, prompt, steps):
    """(tokens [steps], logits [T + steps - 1, V]) of a prefill and greedy decode steps."""
    fwd = jax.jit(lambda p, t, ps, c: model.forward(p, cfg, t, ps, c))
    cache = cache_lib.init_cache(cfg, 1, 32)
    lg, cache = fwd(params, prompt, positions(0, prompt.shape[1]), cache)
    out, logits = [], [lg[0]]
    for i in range(steps):
        tok = jnp.argmax(logits[-1][-1:], axis=-1).astype(jnp.int32)
        out.append(int(tok[0]))
        if i + 1 < steps:
            lg, cache = fwd(params, tok[None], positions(prompt.shape[1] + i, 1), cache)
            logits.append(lg[0])
    return out, np.asarray(jnp.concatenate(logits))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_params_decode_the_reference_greedy_tokens(name):
    """Prefill and greedy steps over the fused tree give the separate tree's tokens, and
    both the numpy reference's logits over the decoded sequence."""
    cfg = CONFIGS[name]()
    params = _random_biases(model.init_params(cfg, 1))
    fused = model.fuse_projections(cfg, model.params_for(cfg, params))
    attn = (fused["layers"] if cfg.scan_layers else fused["layers_0"])["attn"]
    assert ("qkv_proj" in attn) == (not cfg.is_mla)
    assert not {"q_proj", "k_proj", "v_proj"} & set(attn)
    mlp = (fused["layers"] if cfg.scan_layers else fused["layers_0"])["mlp"]
    assert ("gate_up" in mlp) == (cfg.mlp_type != "gelu") and "gate" not in mlp
    prompt = jnp.array([[5, 17, 3, 60, 2]], jnp.int32)
    want, want_logits = _greedy(model.params_for(cfg, params), cfg, prompt, 6)
    got, got_logits = _greedy(fused, cfg, prompt, 6)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    seq = np.concatenate([np.asarray(prompt[0]), want[:-1]])
    ref = reference.logits(model.stack_layers(params, cfg.num_layers), cfg, seq)
    np.testing.assert_allclose(got_logits, ref, atol=1e-4)


def test_fusing_keeps_the_bytes_and_shapes_and_is_idempotent():
    cfg = tiny_config(qkv_bias=True)
    params = model.init_params(cfg, 0)
    fused = model.fuse_projections(cfg, params)
    assert weight_matmul.weight_bytes(fused) == weight_matmul.weight_bytes(params)
    a = fused["layers"]["attn"]["qkv_proj"]
    assert a["kernel"].shape == (2, 32, 4 + 2 * 2, 8) and a["bias"].shape == (2, 8, 8)
    np.testing.assert_array_equal(a["kernel"][:, :, 4:6],
                                  params["layers"]["attn"]["k_proj"]["kernel"])
    assert fused["layers"]["mlp"]["gate_up"]["kernel"].shape == (2, 32, 96)
    again = model.fuse_projections(cfg, fused)
    assert jax.tree.structure(again) == jax.tree.structure(fused)
    shapes = model.decode_param_shapes(cfg)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), shapes) == jax.tree.map(
        lambda s: (s.shape, s.dtype), fused)
    assert jax.tree.leaves(params["layers"]["attn"]["q_proj"])  # the input is untouched


def test_a_mesh_keeps_the_projections_apart():
    """'model' splits q_proj and k_proj/v_proj by their own heads: on a mesh's plan the
    tree is returned as it is, and the planner measures no fused class."""
    cfg = tiny_config(plan=Plan(mesh_axes=(("model", 2),)))
    assert not model.fuses_projections(cfg)
    params = model.init_params(cfg, 0)
    assert model.fuse_projections(cfg, params) is params
    assert model.fuses_projections(tiny_config()) and model.fuses_projections(
        tiny_config(plan=Plan()))
    d, f, n, k, h = 32, 48, 4, 2, 8
    fused = {(d, (n + 2 * k) * h, "kn"), (d, 2 * f, "kn")}
    assert fused <= set(planner.weight_shapes(tiny_config()))
    assert not fused & set(planner.weight_shapes(tiny_config(), fused=False))


@pytest.mark.parametrize("impl", ["xla", "native"])
def test_int8_weights_fuse_codes_and_scales(impl):
    """A self draft's int8 tree fused (codes and per-channel scales concatenated) gives
    the separate int8 tree's logits, by XLA and by the native int8 kernel."""
    if impl == "native" and not rm.load():
        pytest.skip("native kernels not built")
    cfg = tiny_config(tie_embeddings=False)
    q = weight_matmul.quantize_params_int8(model.init_params(cfg, 0), stacked=True)
    fused = model.fuse_projections(cfg, q)
    w = fused["layers"]["attn"]["qkv_proj"]["kernel"]
    assert isinstance(w, weight_matmul.Int8Weight) and w.scale.shape == (2, 1, 8, 8)
    if impl == "native":
        cfg = planner.resolve(cfg.replace(weight_matmul="native"), max_seq_len=16)
    toks = jnp.array([[3, 1, 4, 1, 5]], jnp.int32)
    want, _ = model.forward(q, cfg, toks[:, :1], positions(0, 1))
    got, _ = model.forward(fused, cfg, toks[:, :1], positions(0, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not rm.load(), reason="native kernels not built")
def test_the_compiled_step_runs_three_products_fewer_a_layer():
    """With the native weight kernel a layer's q/k/v take one custom call instead of three
    and gate/up one instead of two; the compiled FLOP stay but for the two norms a layer
    that the fused products apply inside the kernel (counted 4·D each there,
    kvjax.analysis.hlo_cost.kernel_flops, and no longer by XLA), and the bytes nearly."""
    from kvjax.analysis import costs

    cfg = tiny_config(weight_matmul="native", scan_layers=False)
    ops = {}
    figures = {}
    for fused in (False, True):
        c = planner.resolve(cfg, max_seq_len=16)
        params = model.init_params(c, 0)
        params = model.fuse_projections(c, params) if fused else params
        cache = cache_lib.init_cache(c, 1, 16)
        step = jax.jit(lambda p, t, x, c=c: model.forward(p, c, t, positions(0, 1), x))
        compiled = step.lower(params, jnp.zeros((1, 1), jnp.int32), cache).compile()
        ops[fused] = entry_ops(compiled.as_text())
        cost = costs.hlo_cost.loop_aware_cost(compiled)
        figures[fused] = (cost.flops, cost.bytes, cost.uncosted_flops)
        assert rm.TARGET in compiled.as_text()
    assert ops[False]["custom-call"] - ops[True]["custom-call"] == 3 * cfg.num_layers
    folded = 2 * cfg.num_layers * 4 * cfg.d_model  # the norms' FLOP inside the kernel
    assert figures[True][2] == figures[False][2] + folded
    assert figures[False][0] - figures[True][0] >= folded  # XLA no longer runs them
    # the fusions that read a slice of the fused output are counted reading all of it:
    # a few (N + 2K)·H·4 bytes a layer, 5% of this tiny step (0.1% of SmolLM2's)
    np.testing.assert_allclose(figures[True][1], figures[False][1], rtol=0.06)
