"""The weight plan of a decode step, arbitrated on the whole step (issue 58, item 4):
which classes the step times native, when it times at all, how the decision is cached
and read back, and that a timed step is the model's decode step under each plan."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.cache import compress as compress_lib
from kvjax.config import ModelConfig
from kvjax import native, planner
from kvjax.inference import decode
from kvjax.models import model
from kvjax.native import rows_matmul as rm
from kvjax.plan import weight_class
from tests.conftest import tiny_config

needs_native = pytest.mark.skipif(not rm.load(), reason="native kernel not built (no compiler)")

# every weight class of this model is measured (4·K·N >= 256 KiB), and it is small
BIG = dict(d_model=256, mlp_dim=1024, num_heads=4, num_kv_heads=2, head_dim=64,
           vocab_size=1024, num_layers=2, dtype="float32", weight_matmul="auto")


def _all_xla(monkeypatch):
    """Every class's own measurement keeps 'xla' (as the LM head's did on the AMD EPYC)."""
    monkeypatch.setattr(planner, "_weight_pick", lambda m, k, n, layout: "xla")


def _fake_step(monkeypatch, choice, seen):
    def measure(cfgs, b, s, **kw):
        seen.append((dict(cfgs), b, s))
        return {"choice": choice, "rule": f"fake: {choice}", "decided": True, "calls": 7,
                "ms": {"picks": 2.0, "flipped": 1.0 if choice == "flipped" else 3.0},
                "slots": s}
    monkeypatch.setattr(planner, "measure_step", measure)


@needs_native
def test_the_step_flips_the_measured_classes_left_to_xla_where_native_runs(
        planner_home, monkeypatch):
    """Only classes of the step's own rows, picked 'xla', measured and run by the
    kernel are flipped: not a class already native, not one below the measured size
    (k/v, [256, 128]: 128 KiB), not a prefill chunk's other row band."""
    monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(planner, "_weight_pick",
                        lambda m, k, n, layout: "native" if (k, n) == (1024, 256) else "xla")
    seen = []
    _fake_step(monkeypatch, "flipped", seen)
    planner.clear_memo()
    cfg = tiny_config(**BIG)
    plan = planner.resolve(cfg, max_seq_len=64, batch_sizes=(1,), rows=(16,)).plan
    (cfgs, _, _), = seen
    picks, flipped = (dict(cfgs[n].plan.weight_matmul) for n in planner.STEP_CHOICES)
    changed = {n for n in picks if picks[n] != flipped[n]}
    assert changed == {weight_class(1, *kn) for kn in
                       ((256, 1024, "kn"), (256, 256, "kn"), (256, 1024, "nk"),
                        (256, 512, "kn"), (256, 2048, "kn"))}  # gate/up, q, o, head, fused
    assert picks[weight_class(1, 256, 128, "kn")] == "xla"  # under 256 KiB: unmeasured
    assert picks[weight_class(1, 1024, 256, "kn")] == "native"  # down: already native
    assert any(n.startswith("M16-") for n in flipped)  # the chunk's band: left as picked
    assert dict(plan.weight_matmul) == flipped
    planner.clear_memo()


@needs_native
@pytest.mark.parametrize("choice", ["flipped", "picks"])
def test_resolve_takes_the_step_decision_and_caches_it(planner_home, monkeypatch, choice):
    """resolve() times one step under the picks and under them with the xla classes
    native, takes the winner's weight plan, writes the decision to the planner cache and
    reads it back later without timing; the report prints it."""
    monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    _all_xla(monkeypatch)
    seen = []
    _fake_step(monkeypatch, choice, seen)
    planner.clear_memo()
    cfg = tiny_config(**BIG)
    plan = planner.resolve(cfg, max_seq_len=64, batch_sizes=(1,)).plan
    (cfgs, b, s), = seen
    assert (b, s) == (1, 64) and set(cfgs) == set(planner.STEP_CHOICES)
    picks, flipped = (dict(cfgs[n].plan.weight_matmul) for n in planner.STEP_CHOICES)
    assert set(picks.values()) == {"xla"} and "native" in flipped.values()
    assert dict(plan.weight_matmul) == (flipped if choice == "flipped" else picks)
    assert any(line.startswith("  step-B1-") and f": {choice} by rule: fake" in line
               for line in planner.report_lines())
    key = planner.machine_key("cpu", planner.STEP_KERNELS)
    # the step runs both kernels' picks: its decisions are keyed on both sources
    assert key["kernel"] not in {planner.machine_key("cpu", k)["kernel"]
                                 for k in planner.STEP_KERNELS}
    path = planner.cache_path(key, "weight_step")
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["choice"] == choice and entry["slots"] == 64
    planner.clear_memo()  # from the file: no timing, at any context
    monkeypatch.setattr(planner, "measure_step", lambda *a, **k: pytest.fail("timed"))
    again = planner.resolve(cfg, max_seq_len=planner.STEP_MAX_SLOTS * 2, batch_sizes=(1,),
                            rows=(40,))  # a prefill's other row band: the same decision
    assert {n: c for n, c in again.plan.weight_matmul if n.startswith("M1-")} \
        == dict(plan.weight_matmul)
    planner.clear_memo()


@needs_native
@pytest.mark.parametrize("why", ["long context", "rows x slots", "small weights",
                                 "large weights", "window", "mesh"])
def test_resolve_keeps_the_picks_without_timing_a_step(planner_home, monkeypatch, why):
    """No step is timed (and the per-class picks stand) beyond STEP_MAX_SLOTS slots in
    all rows without a cached decision, for weights that do not stream from memory or
    that would not fit twice, for a window's ring and on a mesh."""
    if why != "small weights":
        monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    if why == "large weights":
        monkeypatch.setattr(planner, "STEP_MAX_WEIGHT_BYTES", 1)
    _all_xla(monkeypatch)
    monkeypatch.setattr(planner, "measure_step", lambda *a, **k: pytest.fail("timed"))
    planner.clear_memo()
    cfg = tiny_config(**BIG, **({"window_size": 32} if why == "window" else {}))
    length = {"long context": planner.STEP_MAX_SLOTS * 2,
              "rows x slots": planner.STEP_MAX_SLOTS}.get(why, 64)
    plan = planner.resolve(cfg, max_seq_len=length,
                           batch_sizes=(2,) if why == "rows x slots" else (1,),
                           mesh_axes={"data": 2} if why == "mesh" else None).plan
    assert set(dict(plan.weight_matmul).values()) <= {"xla"}
    planner.clear_memo()


@needs_native
def test_measure_step_times_the_decode_step_of_each_plan(monkeypatch):
    """The timed program is the decode loop's step: under both plans its logits equal
    decode.decode_step's on the same weights and full cache (fp32 tolerance), and each
    plan is timed at least three times, with a decision of the documented choices."""
    monkeypatch.setattr(planner, "EXTRA_BUDGET_S", 0.2)  # tiny steps tie: no extra rounds
    _all_xla(monkeypatch)  # no class measured: the picks all xla, the other plan native
    cfg = tiny_config(**BIG)
    picks = planner.resolve(cfg, max_seq_len=64, batch_sizes=(1,))
    flips = {n: "native" for n, _ in picks.plan.weight_matmul}
    native = picks.replace(plan=picks.plan.__class__(**{
        **picks.plan.__dict__, "weight_matmul": tuple(sorted(flips.items()))}))
    out = planner.measure_step(dict(zip(planner.STEP_CHOICES, (picks, native))), 1, 64,
                               rounds=3, budget_s=0.5)
    assert out["choice"] in planner.STEP_CHOICES and out["calls"] >= 3
    assert set(out["ms"]) == set(planner.STEP_CHOICES) and min(out["ms"].values()) > 0
    params = model.fuse_projections(picks, model.init_params(picks, 0))
    cache = compress_lib.full_cache(picks, 1, 64)  # the cache measure_step times over
    token = jnp.zeros((1, 1), jnp.int32)
    ref, _ = decode.decode_step(params, token, cache, cfg=picks)
    for c in (picks, native):
        got, _ = jax.jit(functools.partial(planner._decode_step, cfg=c))(
            params, token, compress_lib.full_cache(c, 1, 64))
        np.testing.assert_allclose(got[:, 0], ref, rtol=2e-5, atol=2e-5 * float(
            jnp.abs(ref).max()))


# ---------------------------- an attention pick kept against a faster median, on the step

needs_attention = pytest.mark.skipif(not native.load(),
                                     reason="native decode attention not built (no compiler)")
ATTENTION = dict(BIG, decode_attention="auto", weight_matmul="xla")
SLOTS = 512  # 1 x 2 x 512 x 2 x 64 float32 = 512 KiB of cache: a measured class


def _undecided_attention(monkeypatch, decided=False, fastest="native", seen=None,
                         p_value=None, choice="xla", seconds=None):
    """Every decode-attention class's own timing keeps ``choice``, undecided (or
    decided: a tie), with ``fastest`` the fastest median (else 'native' the fastest
    after 'xla': it runs without AVX-512; or ``seconds``), the rule's last test at
    ``p_value`` (None: no test); each class timed is appended to ``seen``."""
    def measure(*a, **k):
        if seen is not None:
            seen.append(a)
        secs = dict(seconds or {"xla": 1.0, "native": 0.98, "native_blocks": 0.99})
        if seconds is None:
            secs[fastest] = 0.5
        entry = {"choice": choice, "rule": "fake", "decided": decided, "calls": 63,
                 "gbps": {n: 1 / t for n, t in secs.items()}, "seconds": secs,
                 "slots": a[5]}
        if p_value is not None:
            entry["p_value"] = p_value
        return entry
    monkeypatch.setattr(planner, "measure", measure)


def _attention_pick(plan):
    (pick,) = (f for n, f in plan.decode_attention)
    return pick


@needs_attention
@pytest.mark.parametrize("choice, decided, fastest", [
    ("flipped", False, "native"), ("picks", False, "native"), ("flipped", True, "native"),
    ("flipped", False, "xla"), ("picks", True, "xla")])
def test_an_attention_pick_kept_against_a_faster_median_is_timed_in_the_step(
        planner_home, monkeypatch, choice, decided, fastest):
    """The class's pick 'xla' was kept (undecided, or decided: within the least gain)
    while native had the fastest median, or with the fastest median itself but a level
    test (p = 0.85): resolve() times the step under the pick and native, takes the
    winner, caches the decision and reads it back without timing; the report prints
    it. (SmolLM2 at t = 1,024, session 36: 'native_blocks -6% in median against xla,
    undecided (p = 0.85)'; in session 35 that step ran 1.14-1.26x faster on the
    kernel.)"""
    monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    _undecided_attention(monkeypatch, decided=decided, fastest=fastest,
                         p_value=0.85 if fastest == "xla" else None)
    seen = []
    _fake_step(monkeypatch, choice, seen)
    planner.clear_memo()
    cfg = tiny_config(**ATTENTION)
    plan = planner.resolve(cfg, max_seq_len=SLOTS, batch_sizes=(1,)).plan
    (cfgs, b, s), = seen
    assert (b, s) == (1, SLOTS)
    assert _attention_pick(cfgs["picks"].plan) == "xla"
    assert _attention_pick(cfgs["flipped"].plan) == "native"
    assert _attention_pick(plan) == ("native" if choice == "flipped" else "xla")
    assert any(line.startswith("  attention-step-B1-S512-") and f": {choice} by rule: fake"
               in line for line in planner.report_lines())
    path = planner.cache_path(planner.machine_key("cpu", planner.STEP_KERNELS), "attention_step")
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["choice"] == choice
    planner.clear_memo()
    monkeypatch.setattr(planner, "measure_step", lambda *a, **k: pytest.fail("timed"))
    again = planner.resolve(cfg, max_seq_len=SLOTS, batch_sizes=(1,)).plan
    assert _attention_pick(again) == _attention_pick(plan)
    planner.clear_memo()


@needs_attention
@pytest.mark.parametrize("why", ["fastest kept", "fastest won its test", "small weights",
                                 "window", "paged", "forced", "rows x slots"])
def test_an_attention_pick_stands_without_a_step(planner_home, monkeypatch, why):
    """No step is timed for a class whose pick is its fastest median (without a test,
    or p < ALPHA), weights that do not stream from memory, a window's ring, a paged
    cache, a forced formulation, or more than STEP_MAX_SLOTS slots in all rows."""
    if why != "small weights":
        monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    measured = []
    _undecided_attention(monkeypatch, fastest="xla" if why.startswith("fastest") else "native",
                         seen=measured,
                         p_value=planner.ALPHA / 2 if why == "fastest won its test" else None)
    monkeypatch.setattr(planner, "measure_step", lambda *a, **k: pytest.fail("timed"))
    planner.clear_memo()
    if why == "paged":  # the dense class in memory, kept against native: not a paged step's
        planner._decode_pick(tiny_config(**ATTENTION), 1, SLOTS, False)
    cfg = tiny_config(**dict(ATTENTION, **{"window": {"window_size": SLOTS},
                                          "forced": {"decode_attention": "xla"}}.get(why, {})))
    length = {"rows x slots": planner.STEP_MAX_SLOTS, "window": 2 * SLOTS}.get(why, SLOTS)
    plan = planner.resolve(cfg, max_seq_len=length,
                           batch_sizes=(2,) if why == "rows x slots" else (1,),
                           page_size=64 if why == "paged" else 0).plan
    assert set(dict(plan.decode_attention).values()) <= {"xla"}
    assert bool(measured) == (why != "forced")  # the class was timed alone (or forced)
    assert not any("attention-step" in ln for ln in planner.report_lines())
    planner.clear_memo()


@needs_attention
@pytest.mark.parametrize("p_value, timed", [(planner.ALPHA / 2, False), (planner.ALPHA, True)])
def test_a_pick_that_won_is_not_checked_against_a_slower_candidate(
        planner_home, monkeypatch, p_value, timed):
    """The fastest median is a candidate that cannot run the site ('native_blocks' here
    falls back to 'native'); the pick 'native' beat the only other that runs, 'xla': a
    won test (p < ALPHA) stands without a step, a level one (p = ALPHA) is checked
    against 'xla'."""
    monkeypatch.setattr(planner, "STEP_MIN_WEIGHT_BYTES", 0)
    _undecided_attention(monkeypatch, choice="native", p_value=p_value,
                         seconds={"xla": 1.0, "native": 0.6, "native_blocks": 0.5})
    formulation = ModelConfig.formulation
    monkeypatch.setattr(ModelConfig, "formulation", lambda self, site, plan=None, pick=None:
                        "native" if pick == "native_blocks"
                        else formulation(self, site, plan, pick))
    seen = []
    _fake_step(monkeypatch, "picks", seen)
    planner.clear_memo()
    plan = planner.resolve(tiny_config(**ATTENTION), max_seq_len=SLOTS, batch_sizes=(1,)).plan
    assert _attention_pick(plan) == "native"
    assert [_attention_pick(c[0]["flipped"].plan) for c in seen] == (["xla"] if timed else [])
    planner.clear_memo()
