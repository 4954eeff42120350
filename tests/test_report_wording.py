"""Issue 32 item 17: what the first screen says. The first row of each cost table is the
counted, comparable figure; an XLA figure that leaves the native kernels out says so (and
a kv_read of 0 is explained); each speed says what its time includes; serve's summary
gives the whole command's wall time beside the serving window. (The main job's own
screen: tests/test_entry.py::test_decode_first_screen_says_what_each_figure_includes.)"""

import re

import pytest

from kvjax import native, planner
from kvjax.analysis import costs, report
from tests.conftest import import_entry_point, tiny_config


def _row_names(table: str) -> list:
    lines = table.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("---")) + 1
    return [re.split(r"\s{2,}", ln.strip())[0] for ln in lines[start:]
            if ln.strip().startswith(("FLOP", "bytes"))]


@pytest.mark.skipif(not native.load(), reason="native kernel not built (no compiler)")
def test_counted_rows_first_and_a_kernel_read_explained():
    cfg = planner.resolve(tiny_config(decode_attention="native", key_layout="BKHS",
                                      value_layout="BKSH"), max_seq_len=64, batch_sizes=(1,))
    step = costs.analyze_decode_step(cfg, 64, attribute=True, jaxpr=False)
    table = report.cost_table(step, measured_seconds=0.002)
    names = _row_names(table)
    assert names[0] in ("FLOP (+kernels)", "bytes (+kernels)"), names
    assert "bytes (XLA ops only)" in names and "bytes" not in names and "FLOP" not in names
    measured = next(ln for ln in table.splitlines() if ln.startswith("measured:"))
    assert "= 500.0 tokens/s" in measured and "dispatch and return included" in measured
    plus = step.xla.bytes + step.xla.uncosted_bytes
    assert f"{plus / 0.002 / 1e9:.2f} GB/s of counted bytes (XLA + kernels)" in measured

    text = report.attribution_table(step)
    header = text.splitlines()[0]
    assert re.split(r"\s{2,}", header.strip())[1:4] == [
        "theory", "counted (XLA + kernels)", "counted/theory"]
    a = step.attribution
    assert a.num_uncosted_ops and a.uncosted_bytes > 0
    for part in ("weights", "kv_read", "kv_write", "kv_copies", "weight_copies", "other"):
        cells = re.split(r"\s{2,}", next(ln for ln in text.splitlines()
                                          if ln.strip().startswith(part + " ")).strip())
        # counted = XLA's own + the kernels' operand and result bytes, then XLA's own
        assert cells[2] == report._fmt(a.bytes[part] + a.uncosted.get(part, 0.0)), cells
        assert cells[4] == report._fmt(a.bytes[part]), cells
    unread = [n for n, r in a.kv_tensors.items() if not r["read"]]
    assert ("read by a native kernel, which XLA's cost analysis leaves out" in text) \
        == bool(unread)


def test_reference_program_keeps_plain_rows():
    cfg = tiny_config(decode_attention="xla")
    step = costs.analyze_decode_step(cfg, 32, attribute=True, jaxpr=False)
    assert _row_names(report.cost_table(step))[:2] == ["FLOP", "bytes"]
    assert "counted" not in report.attribution_table(step).splitlines()[0]


def test_serve_summary_gives_the_whole_command_beside_the_serving_window():
    serve = import_entry_point("serve")
    summary = {"requests": 40, "tokens": 313, "wall_s": 23.95,
               "throughput_tokens_per_s": 313 / 23.95, "slots": 4,
               "mean_slot_occupancy": 0.9, "decode_steps": 90,
               "ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.05},
               "kv_bytes_live_mean": 10.0, "kv_bytes_allocated": 100, "stops": {},
               "setup_s": 250.5, "warmup_s": 33.6, "command_wall_s": 308.1}
    text = serve.report(summary, [])
    first, second = text.splitlines()[:2]
    assert "313 tokens generated in 23.95 s of serving" in first
    assert "compiled before its clock starts" in first
    assert second.startswith("whole command: 308.10 s wall = setup 250.50 s")
    assert "compiling the engine's programs 33.60 s + serving 23.95 s" in second
    # without the new keys (a summary from before them) the report still reads
    del summary["command_wall_s"]
    assert "whole command" not in serve.report(summary, [])


def test_costs_explains_its_unusual_ratios_where_they_appear():
    """experiments.costs prints, under its table, why bf16 rows on CPU read far more than
    theory and why mla-absorbed's kv_read is (2C + R) / (C + R) of theory (issue 57)."""
    notes = import_entry_point("costs").notes
    row = dict(context=512, dtype="bfloat16", variant="gqa", bytes_ratio=9.0,
               xla_weight_copies=3e6, xla_kv_copies=1e6, xla_other=2e6, theory_kv_read=1.0,
               xla_kv_read=1.0, scan_layers=False)
    mla = dict(row, dtype="float32", variant="mla-absorbed", bytes_ratio=1.1,
               theory_kv_read=576.0, xla_kv_read=1088.0)
    got = notes([row, mla], {512}, "cpu")
    assert len(got) == 2
    assert "XLA/theory 9.0-9.0x" in got[0] and "4.0 MB of copies" in got[0]
    assert "kv_read XLA/theory 1.89" in got[1] and "= 1.89 for C = 512, R = 64" in got[1]
    assert notes([row, mla], {1024}, "cpu") == []  # not in the table: no note
    assert len(notes([row], {512}, "gpu")) == 0
