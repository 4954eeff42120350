"""The main job's long context (issue 57): the step where the cache dominates, the KV share
of a step's bytes, t*, and each config's lever against its baseline, on tiny models."""

import math

import jax
import pytest

from kvjax.analysis import theory
from kvjax.config import RunConfig
from kvjax.inference import runner
from kvjax.models import model
from tests.conftest import tiny_config, tiny_mla_config


def test_kv_share_is_the_blogs_kv_over_step_bytes():
    cfg = tiny_config()
    for t in (16, 4096):
        sb = theory.step_bytes(cfg, t)
        assert runner.kv_share(sb.as_dict()) == pytest.approx(
            (sb.kv_read + sb.kv_write) / sb.total)
    # at t* the KV read equals the weights: a share of one half (plus the write)
    t_star = theory.crossover_context(cfg)
    assert runner.kv_share(theory.step_bytes(cfg, round(t_star)).as_dict()) == \
        pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize("overrides, lever, changed", [
    (dict(), "lever 1, GQA", dict(num_kv_heads=4, attention="mha")),
    (dict(num_kv_heads=1, attention="mqa"), "lever 1, MQA",
     dict(num_kv_heads=4, attention="mha")),
    (dict(window_size=8), "lever 3", dict(window_size=None)),
    (dict(kv_dtype="int8"), "lever 4", dict(kv_dtype=None)),
    (dict(num_kv_heads=4), None, None),
])
def test_each_config_names_its_lever_and_baseline(overrides, lever, changed):
    cfg = tiny_config(**overrides)
    got = runner.lever_baseline(cfg)
    if lever is None:
        assert got is None
        return
    assert got[0].startswith(lever)
    assert got[1] == cfg.replace(**changed)
    assert theory.kv_bytes_per_token(got[1]) > theory.kv_bytes_per_token(cfg) \
        or got[1].window_size is None


def test_mla_has_no_mha_baseline():
    assert runner.lever_baseline(tiny_mla_config()) is None


def test_long_context_comes_from_the_flag_then_the_checkpoint():
    cfg = tiny_config()
    loaded = runner.LoadedModel(cfg, None, None, context_length=2048)
    assert runner.long_context(RunConfig(model=cfg, cost_context=512), loaded) == \
        (512, "--config.cost_context")
    assert runner.long_context(RunConfig(model=cfg), loaded)[0] == 2048
    loaded.context_length = None
    assert runner.long_context(RunConfig(model=cfg), loaded)[0] == \
        runner.DEFAULT_LONG_CONTEXT


def test_long_context_cost_measures_the_config_and_its_baseline():
    """GQA (K = 2) at t = 512 beside MHA (K = 4): theory, compiled and measured for both;
    the baseline's KV bytes are twice GQA's, so are its theory KV read bytes."""
    cfg = tiny_config(tie_embeddings=False)
    params = model.init_params(cfg, 0)
    run = RunConfig(model=cfg, max_seq_len=32, cost_context=512, measure_repeats=2)
    lc = runner.long_context_cost(run, runner.LoadedModel(cfg, params, None), cfg)
    assert lc.context == 512 and lc.source == "--config.cost_context"
    assert lc.baseline_name is not None and lc.lever.startswith("lever 1, GQA")
    this, base = lc.this, lc.baseline
    assert base.step.theory_parts["bytes"]["kv_read"] == \
        2 * this.step.theory_parts["bytes"]["kv_read"]
    for s in (this, base):
        assert s.seconds > 0 and s.not_measured is None
        assert s.counted_bytes > 0 and s.step.context == 512
        assert 0 < s.kv_share < 1 and 0 < s.compiled_kv_share < 1
    assert base.kv_share > this.kv_share
    assert lc.crossover_context == pytest.approx(theory.crossover_context(cfg))
    d = lc.as_dict()
    for key in ("context", "theory_bytes_per_step", "counted_bytes_per_step",
                "step_seconds_median", "kv_share_of_step_bytes"):
        assert d[key] == pytest.approx(this.as_dict()[key])
    assert d["lever"]["theory_bytes_ratio"] == pytest.approx(
        base.theory_bytes / this.theory_bytes)
    # the run's own context as the long one: no second context
    same = RunConfig(model=cfg, max_seq_len=32, cost_context=32)
    assert runner.long_context_cost(same, runner.LoadedModel(cfg, params, None), cfg) is None
