"""The kernel registry (kvjax.kernels) is the one list of formulations: the config, the
formulation modules, the planner's cache check and docs/DESIGN.md read it."""

import pathlib

import pytest

from kvjax import kernels
from kvjax.models import weight_matmul

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_list_is_the_registry():
    assert kernels.names("decode_attention") == ("auto", "xla", "xla_cache_left", "native",
                                                 "native_blocks", "pallas")
    assert kernels.names("weight_matmul") == ("auto", "xla", "native", "native_ksplit",
                                              "native_lanes")
    assert set(weight_matmul.NATIVE) == {"native", "native_ksplit", "native_lanes"}
    assert kernels.names("prefill_attention") == ("auto", "tiled", "dense", "native", "cudnn")


def test_names_are_unique_and_auto_is_not_registered():
    for op in kernels.OPS:
        got = kernels.names(op, auto=False)
        assert len(got) == len(set(got)) and kernels.AUTO not in got


def test_custom_calls_name_their_targets():
    """Every kernel the cost hook must count (a custom call) names its target where
    kvjax defines one, and those are the targets kvjax's native modules register."""
    from kvjax import native  # noqa: PLC0415
    from kvjax.native import prefill, rows_matmul  # noqa: PLC0415
    assert set(kernels.custom_call_targets()) == {native.TARGET, native.PAGED_TARGET,
                                                  prefill.TARGET, rows_matmul.TARGET}
    for f in kernels.REGISTRY:
        assert f.counted in ("xla", "custom call", "pallas")
        assert (f.target is not None) <= (f.counted == "custom call")


def test_unknown_names_are_refused_naming_the_allowed():
    with pytest.raises(ValueError, match=r"decode_attention='nope'; allowed: one of "
                                         r"\['xla', 'xla_cache_left', 'native', "
                                         r"'native_blocks', 'pallas'\]"):
        kernels.get("decode_attention", "nope")
    with pytest.raises(ValueError, match=r"op='matmul'; allowed"):
        kernels.names("matmul")


def test_design_doc_holds_the_registry_table():
    assert kernels.markdown_table() in (ROOT / "docs" / "DESIGN.md").read_text()
