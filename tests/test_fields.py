"""Field documentation, closest-name suggestions, variant names and compare's parsing (the
entry points themselves, --list_fields and one-line flag errors: tests/test_entry.py)."""

import pytest

from kvjax import fields, naming
from kvjax.analysis import hardware
from kvjax.config import ModelConfig
from kvjax.training import data, evaluate
from tests.conftest import import_entry_point


def test_attribute_docs_parse_groups_and_continuations():
    class C:
        """Doc.

        Attributes:
          a: first line
            continued.
          b, c: shared.
        Returns:
          nothing.
        """
    assert fields.attribute_docs(C) == {"a": "first line continued.", "b": "shared.",
                                        "c": "shared."}


@pytest.mark.parametrize("config", ["gqa", "window", "mla", "blog_window"])
def test_every_config_and_eval_field_is_documented(config):
    load_config_file = import_entry_point("compare").load_config_file
    resolve_config_path = import_entry_point("cli").resolve_config_path
    listed = (fields.config_fields("config", load_config_file(resolve_config_path(config)))
              + fields.config_fields("eval", evaluate.eval_config_dict()))
    undocumented = [f.path for f in listed if not f.description]
    assert not undocumented
    by = {f.path: f for f in listed}
    assert by["eval.split"].default == "heldout" and by["eval.split"].type_name == "str"
    assert by["config.model.window_size"].type_name.startswith("int")
    assert by["eval.corpus"].type_name == "str|None"


def test_closest_prefers_the_same_tail_then_spelling():
    paths = ["config.model.window_size", "config.model.vocab_size", "eval.corpus",
             "config.batch_size", "eval.num_tokens", "config.model.num_kv_heads",
             "config.model.num_heads"]
    assert fields.closest("config.eval.corpus", paths) == ["eval.corpus"]
    assert fields.closest("config.window_size", paths) == ["config.model.window_size"]
    assert fields.closest("config.model.window_sise", paths) == ["config.model.window_size"]
    assert fields.closest("eval.num_token", paths) == ["eval.num_tokens"]
    assert fields.closest("config.model.num_kv_head", paths)[0] == "config.model.num_kv_heads"
    assert fields.closest("zzz.qqq", paths) == []


def test_split_error_suggests_a_fraction_that_works(tmp_path):
    p = tmp_path / "mine.txt"
    p.write_text("\n\n".join(f"Paragraph {i}. " + "text " * 300 for i in range(12)))
    docs = data.load_documents(p)
    lo, hi = data.working_fractions(docs)
    bad = lo / 2  # below every document's hash: no held-out document
    with pytest.raises(ValueError) as e:
        data.split_documents(docs, bad)
    msg = str(e.value)
    assert f"of {len(docs)}" in msg and "--eval.split=all" in msg
    good = float(msg.split("--eval.heldout_fraction=")[1].split(",")[0])
    train, held = data.split_documents(docs, good)
    assert train and held
    train, scored = data.select_documents(docs, "all", bad)
    assert train == [] and sorted(d.name for d in scored) == sorted(d.name for d in docs)


def test_eval_windows_zero_means_every_full_window():
    import numpy as np
    stream = np.arange(1000, dtype=np.int32)
    assert data.eval_windows(stream, 64, 0).shape == (15, 64)
    with pytest.raises(ValueError, match="eval.context <= 1,000"):
        data.eval_windows(stream, 2048, 0)
    with pytest.raises(ValueError, match="eval.num_tokens <= 960 at this context, or 0"):
        data.eval_windows(stream, 64, 2000)


def test_variant_names_say_what_the_config_is():
    base = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=4, head_dim=8,
                mlp_dim=64, name="m")
    assert naming.variant_name(ModelConfig(num_kv_heads=2, **base)) == "m GQA K=2 fp32"
    assert naming.variant_name(ModelConfig(num_kv_heads=1, window_size=128, num_sink_tokens=4,
                                           dtype="bfloat16", **base)) \
        == "m MQA K=1 W=128+4 sinks bf16"
    assert naming.variant_name(ModelConfig(num_kv_heads=4, attention="mha", **base),
                               with_model=False, with_dtype=False) == "MHA K=4"


def test_chip_aliases_and_readable_device_name():
    assert hardware.chip("H100-80GB") is hardware.CHIPS["H100-SXM"]
    assert hardware.chip("h100 sxm5") is hardware.CHIPS["H100-SXM"]
    assert hardware.chip("A100") is hardware.CHIPS["A100-80GB"]
    assert hardware.chip("H200-141GB").hbm_capacity_bytes == 141e9
    with pytest.raises(ValueError, match="chip 'B300': unknown; allowed"):
        hardware.chip("B300")
    name = hardware.device_name()
    assert name.startswith("CPU: ") and "cores" in name and "id 0" not in name
    assert name.endswith(f"; {hardware.vector_isa()})" if hardware.vector_isa() else "cores)")


@pytest.mark.parametrize("flags,want", [
    ("fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16",
     "AVX-512 (F, BW, VL, VNNI, BF16), AVX2, FMA"),
    ("fpu sse4_2 avx avx2 fma f16c", "AVX2, FMA"),  # the AVX2-only EPYC
    ("fpu sse4_2 avx", "AVX"),
])
def test_vector_isa_names_the_widest_first(tmp_path, flags, want):
    """Every CPU figure names the vector ISA (issue 18): read from cpuinfo's flags."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: {flags}\n")
    assert hardware.vector_isa(str(info)) == want
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert hardware.vector_isa(str(arm)) == "NEON, SVE"
    assert hardware.vector_isa(str(tmp_path / "missing")) == ""


def test_last_level_cache_reads_the_highest_level(tmp_path):
    """The highest-level data or unified cache of sysfs' index* folders (an instruction
    cache never; sizes with K, M or no suffix); 0 where no folder can be read."""
    def index(i, level, kind, size):
        d = tmp_path / f"index{i}"
        d.mkdir()
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (d / name).write_text(f"{text}\n")
    index(0, 1, "Data", "48K")
    index(1, 1, "Instruction", "32K")
    index(2, 2, "Unified", "2048K")
    assert hardware.last_level_cache_bytes(str(tmp_path)) == 2 * 2**20  # no L3: the L2
    index(3, 3, "Unified", "266240K")
    assert hardware.last_level_cache_bytes(str(tmp_path)) == 272629760  # model 207's L3
    (tmp_path / "index3" / "size").write_text("32M\n")
    assert hardware.last_level_cache_bytes(str(tmp_path)) == 32 * 2**20
    index(4, 4, "Instruction", "1G")  # an instruction cache is never the answer
    assert hardware.last_level_cache_bytes(str(tmp_path)) == 32 * 2**20
    assert hardware.last_level_cache_bytes(str(tmp_path / "missing")) == 0


def test_cache_reads_note_names_both_sizes(monkeypatch):
    """A working set under twice the last-level cache gets a note naming its size, the
    cache's and the flag that raises it; one of twice or more, none."""
    monkeypatch.setattr(hardware, "last_level_cache_bytes", lambda: 260 * 2**20)
    assert hardware.cache_reads_note(256 * 2**20, "--layers") == (
        " (caches 256 MiB in all, under twice this CPU's 260 MiB last-level cache: partly "
        "cache reads; raise --layers)")
    assert hardware.cache_reads_note(520 * 2**20, "--layers") == ""
    monkeypatch.setattr(hardware, "last_level_cache_bytes", lambda: 0)  # unknown: no note
    assert hardware.cache_reads_note(1, "--layers") == ""


def test_compare_parses_labels_and_overrides():
    compare = import_entry_point("compare")
    runs = compare.build_variants(
        ["gqa", "w64=window", "w128=window"],
        ["w64:model.window_size=64,model.num_sink_tokens=4", "all:max_new_tokens=8,prompt=Hi, there",
         "w128:config.model.window_size=128"])
    assert [v.label for v in runs] == ["gqa", "w64", "w128"]
    assert [v.run.model.window_size for v in runs] == [None, 64, 128]
    assert runs[1].name == "smollm2-135m GQA K=3 W=64+4 sinks fp32"
    assert runs[0].run.prompt == "Hi, there" and runs[2].run.max_new_tokens == 8
    with pytest.raises(compare.CompareError, match="did you mean model.window_size"):
        compare.build_variants(["window"], ["window:model.window_sise=3"])
    with pytest.raises(compare.CompareError, match="no config labelled 'windw'.*closest: window"):
        compare.build_variants(["window"], ["windw:model.window_size=3"])
    with pytest.raises(compare.CompareError, match="appears twice"):
        compare.build_variants(["gqa", "gqa"], [])
    with pytest.raises(compare.CompareError, match="window_size='x'; allowed: a value of type int"):
        compare.build_variants(["window"], ["window:model.window_size=x"])


def test_blog_table_in_one_call_llama2_70b_on_h100_at_128k():
    from kvjax.analysis import sizing
    assert sizing.parse_context("128K") == 131_072 and sizing.parse_context(128_000) == 128_000
    with pytest.raises(ValueError, match="K = 1,024 tokens"):
        sizing.parse_context("128 thousand")
    t = sizing.blog_table("Llama2-70B", chip="H100-80GB", context="128K")
    # 80 layers x 8 KV heads x (128 + 128) x 2 bytes = 327,680 B per token.
    assert t.kv_bytes_per_token == 327_680
    assert t.kv_cache_bytes_per_sequence == 327_680 * 131_072
    assert t.max_batch == 0 and t.weight_bytes > 80e9
    text = str(t)
    assert "0: the weights (138 GB) exceed the 80 GB" in text
    # 138 GB of weights + 43 GB of cache need 3 x 80 GB; int4 weights (34 GB) fit one.
    assert t.devices_needed == 3 and "int4 weights (34 GB) on one (1 sequence)" in text
    assert sizing.blog_table("blog", "A100", 4096).max_batch == 793
    with pytest.raises(ValueError, match="preset 'llama3-70b': unknown.*closest: llama2-70b"):
        sizing.blog_table("llama3-70b", "H100")


def test_long_prompts_are_shortened_on_screen():
    from kvjax.naming import shorten
    assert shorten("short") == "'short'"
    long = "a" * 3000 + "END"
    s = shorten(long)
    assert len(s) < 250 and "3,003 in all" in s and s.endswith("'aEND'") is False
    assert "END" in s and "2,843 characters omitted" in s
