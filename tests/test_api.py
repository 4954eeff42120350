"""kvjax.api (a notebook's front door) and experiments.export (a checkpoint folder written
and read back), on a tiny Hugging Face checkpoint: no download."""

import dataclasses

import numpy as np
import pytest

import kvjax.api as kv
from kvjax.checkpoints import hf
from kvjax.config import ConfigError
from kvjax.inference import runner
from kvjax.models import convert
from tests.conftest import import_entry_point
from tests.test_hf_checkpoints import (SIZES, random_weights, reference, run_for,
                                       write_hf_checkpoint)

FAST = dict(max_seq_len=32, ignore_memory_check=True, measure_repeats=1,
            model=dict(decode_attention="xla", weight_matmul="xla"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("hf") / "m",
                               random_weights(SIZES, seed=5), SIZES, tied=False)


def test_load_decode_and_costs_as_data(folder):
    model = kv.load("gqa", weights="hf", weights_path=str(folder), progress=False, **FAST)
    assert "K=2" in repr(model) and model.run.max_seq_len == 32
    result = model.decode("abc hi", chat_template=False, max_new_tokens=4, stop_at_eos=False,
                          cost_context=64)
    # the same tokens as the reference model's greedy continuation
    ids = model.loaded.tokenizer.encode("abc hi")
    ckpt = hf.read_hf_checkpoint(folder, progress=False)
    for _ in range(4):
        ids.append(int(np.argmax(reference.llama_logits(ckpt, ids)[-1])))
    assert result.generation.generated_ids[:4] == ids[-4:]
    assert result.text == result.generation.generated_text
    rows = result.costs.rows
    assert [(r["program"], r["context"]) for r in rows][:3] == [
        ("generate loop", 32), ("decode step", 32), ("decode step", 64)]
    assert rows[3]["program"] == result.costs.report.long_context.baseline_name  # MHA
    for r in rows[:4]:
        # a per-token time is the difference of two loop lengths' times: on a tiny model
        # the noise of a shared host can make it negative, so only its presence is held
        assert r["theory_bytes"] > 0 and r["compiled_bytes"] > 0
        assert np.isfinite(r["measured_s"])
        assert r["compiled_over_theory"] == pytest.approx(r["compiled_bytes"] / r["theory_bytes"])
    share = result.costs.kv_share
    assert set(share) == {32, 64} and share[64] > share[32]
    assert result.costs["prefill"]["measured_s"] is None
    text = repr(result)
    assert text.startswith(f"Result(text={result.text!r}")
    assert "compiled/theory" in text and "decode step" in text
    quick = model.decode("abc", chat_template=False, max_new_tokens=2, costs=False)
    assert quick.costs is None and repr(quick).startswith("Result(text=")


def test_bad_fields_fail_with_their_name(folder):
    with pytest.raises(ConfigError, match="max_seq_lenn"):
        kv.load("gqa", weights="hf", weights_path=str(folder), max_seq_lenn=3)
    with pytest.raises(ConfigError, match="no config file"):
        kv.config("nope")
    model = kv.load("gqa", weights="hf", weights_path=str(folder), progress=False, **FAST)
    with pytest.raises(ConfigError, match="fixed once loaded"):
        model.decode("x", model=dict(num_kv_heads=1))


def test_a_generation_says_where_its_costs_are(folder):
    run = run_for(folder, chat_template=False, prompt="abc", max_new_tokens=2)
    gen = runner.generate(run, runner.load(run, progress=False))
    with pytest.raises(AttributeError, match="cost_report"):
        gen.costs  # noqa: B018


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_export_writes_a_folder_that_reads_back_to_the_same_tokens(folder, tmp_path,
                                                                   kv_heads):
    """experiments.export of the loaded model (K = 2 as published, K = 1 mean-pooled):
    the written folder loads to the same parameters and decodes the same tokens."""
    export = import_entry_point("export").export
    fields = {"model.num_kv_heads": kv_heads, "model.attention": "gqa" if kv_heads > 1
              else "mqa", "chat_template": False, "prompt": "abc hi", "max_new_tokens": 5,
              "stop_at_eos": False}
    run = run_for(folder, **fields)
    out = export(run, str(tmp_path / "out"))
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).is_file()
    back = run_for(out, **fields)
    a, b = runner.load(run, progress=False), runner.load(back, progress=False)
    assert back.model.num_kv_heads == kv_heads
    ta = convert.hf_tensors_from_params(a.params, a.cfg)
    tb = convert.hf_tensors_from_params(b.params, b.cfg)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        np.testing.assert_array_equal(ta[k], tb[k])
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    assert b.tokenizer.eos_token_ids == a.tokenizer.eos_token_ids
    ga, gb = runner.generate(run, a), runner.generate(back, b)
    assert ga.generated_ids == gb.generated_ids and len(ga.generated_ids) == 5


@pytest.mark.parametrize("kv_heads, warned", [(1, True), (2, False), (4, False)])
def test_mean_pooled_heads_warn_with_the_cost_and_the_uptrain_command(folder, kv_heads,
                                                                      warned):
    """Mean-pooling KV heads without uptraining breaks a pretrained model (SmolLM2 at
    K = 1: perplexity 24,944): the run says so in its warnings, with the commands that
    measure and recover it; the published K and duplicated heads (exact) do not warn."""
    attention = {1: "mqa", 2: "gqa", 4: "mha"}[kv_heads]
    run = run_for(folder, **{"model.num_kv_heads": kv_heads, "model.attention": attention,
                             "chat_template": False, "prompt": "abc", "max_new_tokens": 2})
    loaded = runner.load(run, progress=False)
    assert bool(loaded.notes) == warned
    if warned:
        assert "perplexity 24,944" in loaded.notes[0]
        assert "python -m experiments.uptrain --config=configs/mqa.py" in loaded.notes[0]
        assert runner.generate(run, loaded).warnings[0] == loaded.notes[0]
