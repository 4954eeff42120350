"""Llama-family GGUF files beyond SmolLM2 (issue 31, item 2): quantized tensors of every
kind gguf dequantises, the pre-tokenizer ``tokenizer.ggml.pre`` names, every
end-of-generation id, rope settings; refused before any tensor is read otherwise.

The files are written here with gguf's writer: random weights (K-quant blocks as random
bytes with small scales, since gguf-py quantises only the simple types), and a byte-level
BPE trained with ``tokenizers`` on a small corpus, written both into a GGUF and into a
``tokenizer.json`` whose pre-tokenizer is the one the model family's own file states.
"""

from __future__ import annotations

import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers, trainers

from kvjax.checkpoints import WeightsError, gguf_reader, load_tokenizer, read_llama_hparams
from kvjax.checkpoints.gguf_reader import undo_llama_cpp_permute
from kvjax.checkpoints.tokenizer import tokenizer_from_fields
from kvjax.config import ModelConfig, RunConfig
from kvjax.inference import runner
from kvjax.models import model
from tests import reference

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------------
# tokenizer.json pre-tokenizers, as the families' own files state them

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                 r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTES = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
          "use_regex": False}


def _split(regex):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
         "invert": False}, _BYTES]}


# GGUF tokenizer.ggml.pre -> (normalizer, pre_tokenizer, ignore_merges, special tokens)
DIALECTS = {
    "smollm": (None, {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": True}]}, False, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
    "llama-bpe": (None, _split(_LLAMA3_REGEX), True,
                  ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "qwen2": ({"type": "NFC"}, _split(_QWEN2_REGEX), False,
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
}

CORPUS = [
    "The year 2024 had 12345 visitors; 1999 and 2000 were quieter. 31415926535 digits.",
    "I'm sure you're right, they'll say we've done it, it's HE'LL and She'S and I'D.",
    "Привет, мир! Как дела? Москва и Санкт-Петербург.",
    "日本語のテキストです。東京は日本の首都です。中文文本，北京是中国的首都。",
    "العربية لغة جميلة. हिन्दी भाषा। 한국어 문장입니다.",
    "Emoji: 🙂👍🏽 👨‍👩‍👧 🎉🎉 ✓ — café naïve résumé.",
    "def f(x):\n    return x ** 2  # square\n\n\tindented\ttabs   and   runs\r\n",
] * 6

HARD = [
    "12345 67 8901234 3.14159 1,000,000",
    "I'm you're they'LL we'Ve it's DON'T can't",
    "Привет мир 日本語のテキスト 中文 العربية हिन्दी 한국어",
    "🙂👍🏽 👨‍👩‍👧🎉 ✓",
    "a  b   c\n\n\t\t  d \r\n e    \n   ",
    "  leading and trailing  ",
    "café cafe\u0301 ﬁ Å",  # a decomposed accent: Qwen2's NFC composes it
    "x=f(3.14159)**2  # 2024\n\tdef g():",
]


def trained_tokenizer_json(pre: str) -> str:
    """A tokenizer.json of the dialect ``pre``: its normalizer and pre-tokenizer as the
    family's file states them, a byte-level BPE trained on CORPUS, its special tokens."""
    normalizer, pre_tok, ignore_merges, specials = DIALECTS[pre]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": normalizer, "pre_tokenizer": pre_tok, "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                        "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": ignore_merges, "vocab": {}, "merges": []}}
    hf = HFTokenizer.from_str(json.dumps(spec))
    hf.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out = json.loads(hf.to_str())
    out["model"]["ignore_merges"] = ignore_merges
    return json.dumps(out)


def _tokenizer_metadata(wr, tokens, merges, types, pre, bos, eos, extra=()):
    wr.add_tokenizer_model("gpt2")
    if pre is not None:
        wr.add_tokenizer_pre(pre)
    wr.add_token_list(tokens)
    wr.add_token_types(types)
    wr.add_token_merges(merges)
    wr.add_bos_token_id(bos)
    wr.add_eos_token_id(eos)
    for name, value in extra:
        getattr(wr, name)(value)


def write_tokenizer_gguf(path, tokenizer_json: str, pre: str):
    """A GGUF holding only the tokenizer of ``tokenizer_json`` (no tensors)."""
    spec = json.loads(tokenizer_json)
    vocab = spec["model"]["vocab"]
    for t in spec["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if i in specials else 1 for i in range(len(tokens))]
    wr = gguf.GGUFWriter(str(path), "llama")
    _tokenizer_metadata(wr, tokens, merges, types, pre, bos=min(specials), eos=min(specials) + 1)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


@pytest.fixture(scope="module", params=sorted(DIALECTS))
def dialect(request, tmp_path_factory):
    pre = request.param
    text = trained_tokenizer_json(pre)
    path = tmp_path_factory.mktemp("tok") / f"{pre}.gguf"
    write_tokenizer_gguf(path, text, pre)
    return pre, HFTokenizer.from_str(text), load_tokenizer(path), path


def test_each_pre_tokenizer_matches_hf_tokenizers(dialect):
    pre, hf, tok, _ = dialect
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for s in HARD:
        want = hf.encode(s, add_special_tokens=False).ids
        assert tok.encode(s) == want, (pre, s)
        assert tok.decode(want) == hf.decode(want, skip_special_tokens=False), (pre, s)


def test_the_dialect_decides_the_split(dialect, tmp_path):
    """The same vocabulary under SmolLM2's pre-tokenizer (all kvjax built before) splits
    some hard string otherwise: the tests above would fail on it."""
    pre, hf, tok, path = dialect
    if pre == "smollm":
        pytest.skip("SmolLM2's own dialect")
    fields = gguf_reader.read_tokenizer_fields(path)
    from kvjax.checkpoints.tokenizer import tokenizer_from_fields
    as_smollm = tokenizer_from_fields(dict(fields, **{"tokenizer.ggml.pre": "smollm"}))
    assert any(as_smollm.encode(s) != tok.encode(s) for s in HARD), pre


def test_fields_of_a_cached_gguf_are_kept_and_follow_the_file(tmp_path, monkeypatch):
    """A GGUF inside $KVJAX_CACHE has its tokenizer fields read once, then from their JSON
    copy (gguf not opened again); rewriting the file reads it again; a file outside the
    cache keeps nothing."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "cache" / "m.gguf"
    path.parent.mkdir()
    write_tokenizer_gguf(path, trained_tokenizer_json("smollm"), "smollm")
    first = gguf_reader.read_tokenizer_fields(path)
    kept = list((tmp_path / "cache" / gguf_reader.FIELDS_CACHE_SUBDIR).glob("m-*.json"))
    assert len(kept) == 1
    opened = []
    monkeypatch.setattr(gguf_reader, "_open_reader",
                        lambda p, _open=gguf_reader._open_reader: opened.append(p) or _open(p))
    assert gguf_reader.read_tokenizer_fields(path) == first and not opened
    assert load_tokenizer(path).encode(HARD[0]) == \
        tokenizer_from_fields(first, path).encode(HARD[0]) and not opened
    write_tokenizer_gguf(path, trained_tokenizer_json("llama-bpe"), "llama-bpe")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    again = gguf_reader.read_tokenizer_fields(path)
    assert opened == [path] and again["tokenizer.ggml.pre"] == "llama-bpe"
    outside = tmp_path / "elsewhere.gguf"
    write_tokenizer_gguf(outside, trained_tokenizer_json("smollm"), "smollm")
    gguf_reader.read_tokenizer_fields(outside)
    assert len(list(kept[0].parent.iterdir())) == 2


def test_unknown_pre_tokenizer_refused(tmp_path):
    path = tmp_path / "gpt2pre.gguf"
    write_tokenizer_gguf(path, trained_tokenizer_json("smollm"), "deepseek-llm")
    with pytest.raises(WeightsError, match=r"tokenizer\.ggml\.pre='deepseek-llm'.*allowed: "
                                           r"'smollm', 'llama-bpe'.*'qwen2'"):
        load_tokenizer(path)
    path = tmp_path / "nopre.gguf"
    write_tokenizer_gguf(path, trained_tokenizer_json("smollm"), None)
    with pytest.raises(WeightsError, match=r"lacks tokenizer\.ggml\.pre"):
        load_tokenizer(path)


# ---------------------------------------------------------------------------
# Small models in each tensor type

V, L, D, N, K, H, F = 40, 2, 256, 4, 2, 64, 256  # K-quants need rows of 256
TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"] + \
    [chr(ord("a") + i) for i in range(26)] + ["ab", "Ġ"] + [f"x{i}" for i in range(8)]
LLAMA3_EOG = (1, 2, 3)
MODEL = dict(vocab_size=V, num_layers=L, d_model=D, num_heads=N, num_kv_heads=K,
             head_dim=H, mlp_dim=F, rope_theta=5e5, norm_eps=1e-5, scan_layers=False)
_F16_FIELDS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of each block's f16 scales
_BLOCK = {Q.Q4_K: 144, Q.Q6_K: 210}


def _kquant_bytes(rng, rows, cols, qtype, scale):
    """Random blocks of a K-quant: random bytes, the f16 super-block scales set to
    ``scale`` (and Q6_K's int8 sub-block scales kept small)."""
    blocks = rng.integers(0, 256, (rows, cols // 256, _BLOCK[qtype]), dtype=np.uint8)
    if qtype == Q.Q6_K:
        blocks[..., 192:208] = rng.integers(-4, 5, (rows, cols // 256, 16)).astype(
            np.int8).view(np.uint8)
    for off in _F16_FIELDS[qtype]:
        blocks[..., off:off + 2] = np.full((rows, cols // 256, 1), scale,
                                           np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_model_gguf(path, qtype, seed=0, lm_head=True, pre="llama-bpe", extra_kv=(),
                     extra_tensors=(), replace=None, ffn=F, arch="llama"):
    """A llama GGUF with every 2-D weight in ``qtype`` (norms F32, as the converters
    write them); Q/K rows llama.cpp-permuted; ``replace``: {name: array} written as
    given instead; ``ffn``: the feed-forward width the metadata states; ``arch`` 'qwen2':
    q/k/v biases (F32), Q/K rows in HF order (llama.cpp's Qwen2 converter does not permute
    them). Returns the weights in HF orientation as gguf dequantises them ({name: [out,
    in]} float32)."""
    rng = np.random.default_rng(seed)
    replace = replace or {}
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(L)
    wr.add_context_length(128)
    wr.add_embedding_length(D)
    wr.add_feed_forward_length(ffn)
    wr.add_head_count(N)
    wr.add_head_count_kv(K)
    wr.add_rope_freq_base(5e5)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(V)
    for name, value in extra_kv:
        getattr(wr, name)(value)
    _tokenizer_metadata(wr, TOKENS, ["a b"], [3, 3, 3, 3] + [1] * (V - 4), pre, bos=0,
                        eos=1, extra=[("add_eot_token_id", 3), ("add_eom_token_id", 2)])
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if lm_head:
        shapes["output.weight"] = (V, D)
    for i in range(L):
        shapes.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.ffn_norm.weight": (D,),
                       f"blk.{i}.attn_q.weight": (N * H, D), f"blk.{i}.attn_k.weight": (K * H, D),
                       f"blk.{i}.attn_v.weight": (K * H, D),
                       f"blk.{i}.attn_output.weight": (D, N * H),
                       f"blk.{i}.ffn_gate.weight": (F, D), f"blk.{i}.ffn_up.weight": (F, D),
                       f"blk.{i}.ffn_down.weight": (D, F)})
        if arch == "qwen2":
            shapes.update({f"blk.{i}.attn_q.bias": (N * H,), f"blk.{i}.attn_k.bias": (K * H,),
                           f"blk.{i}.attn_v.bias": (K * H,)})
    hf = {}
    for name, shape in shapes.items():
        if name in replace:
            wr.add_tensor(name, replace[name])
            continue
        if len(shape) == 1:  # norms: F32 around 1; biases around 0
            w = ((0 if name.endswith(".bias") else 1)
                 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            wr.add_tensor(name, w)
            stored = w
        elif qtype in _BLOCK:
            raw = _kquant_bytes(rng, *shape, qtype, 2e-3 if qtype == Q.Q6_K else 1e-4)
            wr.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        else:
            w = (0.06 * rng.standard_normal(shape)).astype(np.float32)
            if qtype == Q.F32:
                raw = w
            elif qtype == Q.F16:
                raw = w.astype(np.float16)
            else:
                raw = gguf.quants.quantize(w, qtype)
            if qtype in (Q.F32, Q.F16):
                wr.add_tensor(name, raw)
            else:
                wr.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            stored = gguf.quants.dequantize(raw, qtype)
        stored = np.asarray(stored, np.float32).reshape(shape)
        if arch == "llama" and name.endswith("attn_q.weight"):
            stored = undo_llama_cpp_permute(stored, N)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            stored = undo_llama_cpp_permute(stored, K)
        hf[name] = stored
    for name, arr in extra_tensors:
        wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return hf


def reference_checkpoint(hf, lm_head=True):
    """The weights as ``reference.llama_logits`` takes them (stacked, HF orientation)."""
    layer = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q": "wq",
             "attn_k": "wk", "attn_v": "wv", "attn_output": "wo", "ffn_gate": "w_gate",
             "ffn_up": "w_up", "ffn_down": "w_down"}
    t = {ours: np.stack([hf[f"blk.{i}.{g}.weight"] for i in range(L)])
         for g, ours in layer.items()}
    t.update(embed=hf["token_embd.weight"], final_norm=hf["output_norm.weight"])
    for g, ours in (("attn_q", "bq"), ("attn_k", "bk"), ("attn_v", "bv")):
        if f"blk.0.{g}.bias" in hf:
            t[ours] = np.stack([hf[f"blk.{i}.{g}.bias"] for i in range(L)])
    if lm_head:
        t["lm_head"] = hf["output.weight"]
    hp = dict(num_heads=N, num_kv_heads=K, head_dim=H, d_model=D, num_layers=L,
              rope_theta=5e5, norm_eps=1e-5)
    return gguf_reader.LlamaGGUF(hparams=hp, tensors=t, path=None)


_fwd = jax.jit(model.forward, static_argnums=1)
IDS = [0, 4, 9, 17, 30, 5, 33, 12, 3, 21, 7]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16],
                         ids=lambda q: q.name)
def test_quantized_gguf_logits_equal_the_float64_reference(tmp_path, qtype):
    path = tmp_path / f"{qtype.name}.gguf"
    hf = write_model_gguf(path, qtype)
    cfg = ModelConfig(**MODEL, tie_embeddings=False)
    loaded = runner.load(RunConfig(model=cfg, weights_path=str(path), max_seq_len=32,
                                   max_new_tokens=4), progress=False)
    pos = jnp.arange(len(IDS), dtype=jnp.int32)[None]
    got, _ = _fwd(loaded.params, cfg, jnp.asarray([IDS], jnp.int32), pos)
    want = reference.llama_logits(reference_checkpoint(hf), IDS)
    assert np.abs(want).max() > 0.5  # the weights say something
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-4, atol=1e-4)
    tok = loaded.tokenizer
    assert tok.eos_token_ids == LLAMA3_EOG  # <|end_of_text|>, <|eom_id|>, <|eot_id|>


def test_qwen2_gguf_with_biases_equals_the_reference(tmp_path):
    """general.architecture 'qwen2': q/k/v biases, Q/K rows as stored, its own tokenizer
    dialect; refused with a config that lacks the biases, naming both values."""
    path = tmp_path / "qwen2.gguf"
    hf = write_model_gguf(path, Q.Q8_0, arch="qwen2", pre="qwen2")
    hp = read_llama_hparams(path)
    assert hp["qkv_bias"] is True and hp["architecture"] == "qwen2"
    assert hp["pre_tokenizer"] == "qwen2"
    cfg = ModelConfig(**MODEL, tie_embeddings=False, qkv_bias=True)
    run = RunConfig(model=cfg, weights_path=str(path), max_seq_len=32, max_new_tokens=4)
    loaded = runner.load(run, progress=False)
    pos = jnp.arange(len(IDS), dtype=jnp.int32)[None]
    got, _ = _fwd(loaded.params, cfg, jnp.asarray([IDS], jnp.int32), pos)
    want = reference.llama_logits(reference_checkpoint(hf), IDS)
    np.testing.assert_allclose(np.asarray(got[0], np.float64), want, rtol=1e-4, atol=1e-4)
    without = reference.llama_logits(reference_checkpoint(
        {k: v for k, v in hf.items() if not k.endswith(".bias")}), IDS)
    assert np.abs(without - want).max() > 1e-2  # the biases matter
    from kvjax.config import ConfigError
    with pytest.raises(ConfigError, match=r"model\.qkv_bias=False does not match the "
                                          r"checkpoint's True"):
        runner.load(RunConfig(model=ModelConfig(**MODEL, tie_embeddings=False),
                              weights_path=str(path), max_seq_len=32), progress=False)


def test_hparams_of_a_llama3_file(tmp_path):
    path = tmp_path / "q8.gguf"
    write_model_gguf(path, Q.Q8_0, lm_head=False)
    hp = read_llama_hparams(path)
    assert hp["rope_theta"] == 5e5 and hp["context_length"] == 128
    assert hp["pre_tokenizer"] == "llama3" and hp["eos_token_ids"] == LLAMA3_EOG
    assert hp["tie_embeddings"] is True


@pytest.fixture
def no_tensor_read(monkeypatch):
    def boom(tensor, path):
        raise AssertionError(f"read tensor {tensor.name} before refusing the file")
    monkeypatch.setattr(gguf_reader, "_dequantize", boom)


def test_unknown_pre_tokenizer_refused_before_any_tensor_is_read(tmp_path, no_tensor_read):
    path = tmp_path / "tekken.gguf"
    write_model_gguf(path, Q.Q8_0, pre="tekken")
    with pytest.raises(WeightsError, match=r"tokenizer\.ggml\.pre='tekken'.*allowed: "
                                           r"'smollm', 'llama-bpe'"):
        gguf_reader.read_llama_gguf(path, progress=False)


@pytest.mark.parametrize("kv,tensors,message", [
    ([("add_rope_scaling_type", gguf.RopeScalingType.YARN), ("add_rope_scaling_factor", 4.0)],
     [], r"rope scaling 'yarn' .*factor 4\.0.*allowed: no rope scaling"),
    ([], [("rope_freqs.weight", np.ones(H // 2, np.float32))],
     r"rope_freqs\.weight .*Llama 3\.1's rope_type 'llama3'"),
    ([], [("blk.0.attn_q.bias", np.zeros(N * H, np.float32))], r"blk\.0\.attn_q\.bias"),
], ids=["yarn", "rope_freqs", "bias"])
def test_refused_before_any_tensor_is_read(tmp_path, no_tensor_read, kv, tensors, message):
    path = tmp_path / "bad.gguf"
    write_model_gguf(path, Q.Q8_0, extra_kv=kv, extra_tensors=tensors)
    with pytest.raises(WeightsError, match=message):
        gguf_reader.read_llama_gguf(path, progress=False)


def test_an_undequantisable_tensor_type_is_named(tmp_path, no_tensor_read):
    # gguf writes an int8 array as type I8, which gguf.quants cannot dequantise
    path = tmp_path / "i8.gguf"
    i8 = np.random.default_rng(0).integers(-8, 8, (F, D)).astype(np.int8)
    write_model_gguf(path, Q.Q8_0, replace={"blk.1.ffn_up.weight": i8})
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_up\.weight .* is I8, which gguf .*"
                                           r"cannot dequantise; allowed: .*Q4_K"):
        gguf_reader.read_llama_gguf(path, progress=False)


def test_a_wrong_shape_is_named_before_reading(tmp_path, no_tensor_read):
    path = tmp_path / "shape.gguf"
    write_model_gguf(path, Q.F32, ffn=512)
    with pytest.raises(WeightsError, match=r"blk\.0\.ffn_down\.weight .* has shape "
                                           r"\(256, 256\).*imply \(256, 512\)"):
        gguf_reader.read_llama_gguf(path, progress=False)
