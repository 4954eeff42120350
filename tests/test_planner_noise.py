"""The planner takes no pick inside its own noise, and re-measures picks made under load
(issue 32, item 16)."""

import pytest

from kvjax import native, planner


def test_spread_is_the_interquartile_range_over_the_median():
    assert planner.spread([1.0, 1.0]) == 0.0
    assert planner.spread([1.0] * 9) == 0.0
    assert planner.spread([0.8, 0.9, 1.0, 1.1, 1.2]) == pytest.approx(0.3, rel=0.2)


def test_a_pick_inside_the_noise_keeps_the_reference():
    secs = {"xla": 1.0, "native": 0.9}
    assert planner._pick(secs) == "native"                          # 10% > 3%
    assert planner._pick(secs, {"xla": 0.02, "native": 0.05}) == "native"
    assert planner._pick(secs, {"xla": 0.15, "native": 0.01}) == "xla"  # 10% < 15%
    assert planner._pick({"xla": 1.0, "native": 0.98}) == "xla"     # under MIN_GAIN
    assert planner._pick({"xla": 0.9, "native": 1.0}, {"native": 0.5}) == "xla"
    assert planner._pick({"native": 1.0, "xla_cache_left": 0.5}) == "xla_cache_left"


@pytest.mark.parametrize("then,now,measured", [(9.0, 0.1, True), (9.0, 9.0, False),
                                               (0.1, 0.1, False), (None, 0.1, False)])
def test_a_pick_made_under_load_is_measured_again_when_quiet(tmp_path, monkeypatch, then,
                                                            now, measured):
    monkeypatch.setattr(planner, "_load_average", lambda: now)
    entry = {"choice": "native", "gbps": {"native": 1.0}}
    if then is not None:
        entry["load_average"] = then
    entries = {"cls": entry}
    calls = []

    def measure():
        calls.append(1)
        return {"choice": "xla", "gbps": {"xla": 2.0}}

    key = planner.machine_key("cpu")
    got = planner._cached_choice({}, "cls", key, tmp_path / "p.json", entries, measure)
    assert bool(calls) == measured
    assert got == ("xla" if measured else "native")
    if measured:
        assert entries["cls"]["load_average"] == now


def test_reports_say_when_a_pick_was_measured_under_load():
    busy = 2.0 * native.num_threads()
    assert "measured under load" in planner._when({"load_average": busy})
    assert "under load" not in planner._when({"load_average": 0.0})
