"""Every hyper-parameter a GGUF states is taken from it or the run is refused, naming both
values, before any tensor is dequantised (tiny synthetic GGUF from test_checkpoints)."""

import dataclasses

import pytest

from kvjax.checkpoints import gguf_reader, load_tokenizer, read_llama_hparams
from kvjax.config import ConfigError, ModelConfig, RunConfig
from kvjax.inference import runner
from tests.test_checkpoints import TINY, write_tiny_gguf

# What write_tiny_gguf states: V=40, L=2, D=8, N=4, K=2, H=2, F=12, rope base 1e4,
# eps 1e-5, context 64, tied unless lm_head=True.
MODEL = dict(vocab_size=TINY["V"], num_layers=TINY["L"], d_model=TINY["D"],
             num_heads=TINY["N"], num_kv_heads=TINY["K"], head_dim=TINY["H"],
             mlp_dim=TINY["F"], rope_theta=1e4, norm_eps=1e-5, tie_embeddings=True,
             scan_layers=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(d / "tied.gguf")
    write_tiny_gguf(d / "untied.gguf", lm_head=True)
    return d


@pytest.fixture
def no_dequantise(monkeypatch):
    """Fails the test if any tensor is dequantised."""
    def boom(tensor, path):
        raise AssertionError(f"dequantised {tensor.name} before the config was checked")
    monkeypatch.setattr(gguf_reader, "_dequantize", boom)


def run_for(path, max_seq_len=32, prompt="Hello", **model):
    return RunConfig(model=ModelConfig(**dict(MODEL, **model)), weights_path=str(path),
                     max_seq_len=max_seq_len, max_new_tokens=4, prompt=prompt,
                     chat_template=False)


def test_metadata_alone(files):
    hp = read_llama_hparams(files / "tied.gguf")
    assert hp["rope_theta"] == 1e4 and hp["context_length"] == 64
    assert hp["tie_embeddings"] is True and hp["chat_template"].startswith("{{'<|im_start|>'")
    assert read_llama_hparams(files / "untied.gguf")["tie_embeddings"] is False


def test_matching_config_loads(files):
    loaded = runner.load(run_for(files / "tied.gguf"), progress=False)
    assert loaded.params["embed"]["embedding"].shape == (40, 8) and "lm_head" not in loaded.params
    loaded = runner.load(run_for(files / "untied.gguf", tie_embeddings=False), progress=False)
    assert loaded.params["lm_head"]["kernel"].shape == (8, 40)
    # KV heads may differ by conversion (duplicated or mean-pooled)
    runner.load(run_for(files / "tied.gguf", num_kv_heads=1), progress=False)
    runner.load(run_for(files / "tied.gguf", num_kv_heads=4, attention="mha"),
                progress=False)


@pytest.mark.parametrize("field,value,message", [
    ("rope_theta", 1e5, "model.rope_theta=100000.0 does not match the checkpoint's 10000.0 "
                        "(llama.rope.freq_base); allowed with these weights: 10000.0"),
    ("norm_eps", 1e-2, "model.norm_eps=0.01 does not match the checkpoint's 9.99999974"),
    ("tie_embeddings", False, "model.tie_embeddings=False does not match the checkpoint's "
                              "True"),
    ("vocab_size", 41, "model.vocab_size=41 does not match the checkpoint's 40"),
    ("num_layers", 3, "model.num_layers=3 does not match the checkpoint's 2 (llama.block_count)"),
    ("d_model", 16, "model.d_model=16 does not match the checkpoint's 8"),
    ("num_heads", 2, "model.num_heads=2 does not match the checkpoint's 4"),
    ("head_dim", 4, "model.head_dim=4 does not match the checkpoint's 2"),
    ("mlp_dim", 16, "model.mlp_dim=16 does not match the checkpoint's 12"),
])
def test_each_disagreement_is_refused_before_dequantising(files, no_dequantise, field, value,
                                                          message):
    kw = {field: value}
    if field == "num_heads":
        kw["num_kv_heads"] = 2
    with pytest.raises(ConfigError, match="invalid config: " + _escape(message)):
        runner.load(run_for(files / "tied.gguf", **kw), progress=False)


def test_untied_file_refuses_a_tied_config(files, no_dequantise):
    with pytest.raises(ConfigError, match=r"model.tie_embeddings=True does not match the "
                                          r"checkpoint's False"):
        runner.load(run_for(files / "untied.gguf"), progress=False)


def test_context_length(files, no_dequantise):
    with pytest.raises(ConfigError, match=r"max_seq_len=65 exceeds the checkpoint's "
                                          r"context_length=64"):
        runner.load(run_for(files / "tied.gguf", max_seq_len=65), progress=False)


def test_context_length_with_a_window(files):
    """A window may pass the trained positions; the loaded model says how many there
    are (experiments.speculative notes rows past them)."""
    loaded = runner.load(run_for(files / "tied.gguf", max_seq_len=65, window_size=8),
                         progress=False)
    assert loaded.context_length == 64


def test_float32_epsilon_is_the_same_value(files):
    """The file stores eps as float32 (9.99999975e-06): 1e-5 in the config matches."""
    assert read_llama_hparams(files / "tied.gguf")["norm_eps"] != 1e-5
    runner.load(run_for(files / "tied.gguf", norm_eps=1e-5), progress=False)


def _escape(s):
    import re  # noqa: PLC0415
    return re.escape(s)


def test_prompt_too_long_is_refused_before_dequantising(files, no_dequantise):
    """Issue 32 item 9: the main job's length rule (prompt + max_new_tokens - 1 tokens
    written) is applied with the checkpoint's tokenizer before any tensor is read; the
    same run one slot larger loads."""
    tok = load_tokenizer(files / "tied.gguf")
    run = run_for(files / "tied.gguf", prompt="ab ab")
    n = len(runner.prompt_ids(run, tok)[1])
    assert n > 1
    short = dataclasses.replace(run, max_seq_len=n + run.max_new_tokens - 2)
    with pytest.raises(ConfigError, match=rf"max_seq_len={n + run.max_new_tokens - 2}; "
                                          rf"allowed: at least prompt tokens \({n}\)"):
        runner.load(short, progress=False, check_prompt=True)


def test_prompt_that_fits_loads(files):
    run = run_for(files / "tied.gguf", prompt="ab ab")
    n = len(runner.prompt_ids(run, load_tokenizer(files / "tied.gguf"))[1])
    run = dataclasses.replace(run, max_seq_len=n + run.max_new_tokens - 1)
    assert runner.load(run, progress=False, check_prompt=True).tokenizer.vocab_size == 40
