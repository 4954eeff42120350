"""Adding a formulation is one registry entry plus its function (issue 52): a toy decode
formulation runs through the plan, the model and the cost report."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import tiny_config
from kvjax import cache as cache_lib
from kvjax import kernels, planner
from kvjax.analysis import costs
from kvjax.inference import decode
from kvjax.models import attention, decode_kernels, model

CALLS: list[str] = []


def toy_step(name, *args):
    """The toy's step: the reference einsums, counted (so a test sees it ran)."""
    CALLS.append(name)
    return attention.step_xla(name, *args)


TOY = kernels.Formulation(
    "decode_attention", "toy", ("cpu",), "tests only: the reference einsums, counted",
    "tests/test_registry.py", fn=".run_step", step=f"{__name__}:toy_step",
    applies=lambda s: None if s.queries == 1 else "one position per row")


@pytest.fixture
def toy():
    kernels.register(TOY)
    CALLS.clear()
    try:
        yield TOY
    finally:
        kernels.unregister("decode_attention", "toy")


def _tokens(cfg, params, steps=4):
    cache = cache_lib.init_cache(cfg, 1, 16)
    prompt = jnp.asarray([[5, 9, 2, 7]], jnp.int32)
    logits, cache = decode.prefill(params, cfg, prompt, cache)
    out = []
    tok = jnp.argmax(logits, axis=-1)  # [B]
    for _ in range(steps):
        out.append(int(tok[0]))
        logits, cache = decode.decode_step(params, tok[:, None], cache, cfg=cfg)
        tok = jnp.argmax(logits, axis=-1)
    return out, np.asarray(logits)


def test_a_toy_formulation_runs_through_plan_model_and_cost_report(toy):
    assert "toy" in kernels.names("decode_attention")
    cfg = tiny_config(tie_embeddings=False, decode_attention="toy")  # the config accepts it
    resolved = planner.resolve(cfg.replace(decode_attention="auto"), max_seq_len=16)
    site = decode_kernels.site(resolved, 1, 1, 16)
    # the plan holds the pick of the class, the model reads it
    picked = resolved.replace(plan=dataclasses.replace(
        resolved.plan, decode_attention=((site.key, "toy"),)))
    assert resolved.formulation(site) == "xla" and picked.formulation(site) == "toy"
    assert any("toy" in line for line in picked.plan.lines())
    params = model.init_params(cfg, 0)
    want, want_logits = _tokens(cfg.replace(decode_attention="xla"), params)
    jax.clear_caches()
    CALLS.clear()
    got, got_logits = _tokens(picked, params)
    assert CALLS and set(CALLS) == {"toy"}  # traced through the toy's own function
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-6, rtol=0)
    # the cost report counts the same program as the reference's
    toy_cost = costs.analyze_decode_step(picked, 16, attribute=False, jaxpr=False)
    ref_cost = costs.analyze_decode_step(
        resolved.replace(decode_attention="xla"), 16, attribute=False, jaxpr=False)
    assert (toy_cost.xla.flops, toy_cost.xla.bytes) == (ref_cost.xla.flops, ref_cost.xla.bytes)


def test_a_toy_that_does_not_apply_is_refused_naming_why(toy):
    cfg = tiny_config(decode_attention="toy")
    site = dataclasses.replace(decode_kernels.site(cfg, 1, 3, 16), op="decode_attention")
    with pytest.raises(ValueError, match="decode_attention='toy' cannot run here.*one "
                                         "position per row"):
        cfg.formulation(site)


def test_register_refuses_a_second_entry_of_a_name(toy):
    with pytest.raises(ValueError, match="decode_attention='toy'"):
        kernels.register(TOY)


def test_a_small_chunk_over_a_quantized_cache_does_not_run_the_one_position_step():
    """'xla_scaled' is forced for one position over 1-byte codes; a small chunk (T > 1)
    whose class the plan did not measure reads its base class's pick, which was that
    forced step: it must run 'xla' instead (it crashed on the [B, T, 1, S] mask), and
    give the dequantized reference's logits."""
    cfg = tiny_config(kv_dtype="int8", num_layers=1, decode_attention="auto")
    planned = planner.resolve(cfg, max_seq_len=64)  # no queries: T = 16 not measured
    assert planned.formulation(decode_kernels.site(planned, 1, 1, 64)) == "xla_scaled"
    assert planned.formulation(decode_kernels.site(planned, 1, 16, 64)) == "xla"
    params = model.params_for(cfg, model.init_params(cfg.replace(scan_layers=True), 0))
    rng = np.random.default_rng(0)
    ctx = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 40)), jnp.int32)
    chunk = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, 16)), jnp.int32)
    outs = []
    for c in (planned, cfg.replace(decode_attention="xla")):
        cache = cache_lib.init_cache(c, 1, 64)
        _, cache = decode.prefill(params, c, ctx, cache)
        pos = cache.length[:, None] + jnp.arange(16, dtype=jnp.int32)[None]
        outs.append(np.asarray(model.forward(params, c, chunk, pos, cache)[0]))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)
