"""Reading a llama-architecture GGUF file (SmolLM2, Llama 3, llama-architecture models with
a Qwen2 tokenizer, ...) into HF-layout numpy arrays.

GGUF stores each 2-D weight with ggml shape ``[in, out]``, which the ``gguf``
package exposes as numpy data of shape ``(out, in)``: after
``gguf.quants.dequantize`` a weight is already in HF ``nn.Linear.weight``
layout ``[out, in]``. The one thing to undo is llama.cpp's HF->GGUF converter
permuting the rows of the Q and K projections (see :func:`llama_cpp_permute`),
done so that ggml's interleaved-pair rotary reproduces HF's half-split
(``rotate_half``) rotary. The arrays returned here have that permutation
undone, so they are meant for HF-style half-split rotary.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import warnings
from typing import Any, Callable

import gguf
import numpy as np
import tqdm

from kvjax.checkpoints.fetch import WeightsError, cache_dir_path

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
"""``general.architecture`` values read: 'llama' (Q/K rows stored llama.cpp-permuted for
ggml's interleaved rotary, undone here) and 'qwen2' (q/k/v biases; Q/K rows in HF order:
llama.cpp runs Qwen2 with the half-split "NEOX" rotary and its converter does not
permute them)."""

DEQUANTIZABLE = frozenset({gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16}
                          | set(getattr(gguf.quants, "_type_traits", {})))
"""Tensor types ``gguf.quants.dequantize`` reads: F32, F16 and every type gguf-py has a
(de)quantiser for (BF16, Q8_0, Q4_0/Q4_1, Q5_0/Q5_1, the K-quants Q2_K..Q6_K, the IQ
types, ...)."""

# GGUF tensor name (per layer, after "blk.{i}.") -> our name.
_LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "mlp_norm",
    "attn_q.weight": "wq",
    "attn_k.weight": "wk",
    "attn_v.weight": "wv",
    "attn_output.weight": "wo",
    "ffn_gate.weight": "w_gate",
    "ffn_up.weight": "w_up",
    "ffn_down.weight": "w_down",
}
# qwen2 only: q/k/v biases
_BIAS_TENSORS = {"attn_q.bias": "bq", "attn_k.bias": "bk", "attn_v.bias": "bv"}
_GLOBAL_TENSORS = {"token_embd.weight": "embed", "output_norm.weight": "final_norm"}
_OPTIONAL_GLOBAL_TENSORS = {"output.weight": "lm_head"}
_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.fim_pad_token_id",
    "tokenizer.ggml.fim_rep_token_id",
    "tokenizer.ggml.fim_sep_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
)

PRE_TOKENIZERS = {
    "smollm": "smollm",
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "qwen2": "qwen2",
}
"""``tokenizer.ggml.pre`` value -> the pre-tokenizer dialect kvjax builds for it
(:func:`kvjax.checkpoints.tokenizer.tokenizer_from_fields`), as llama.cpp's
``llama_vocab::impl::load`` maps the names (``src/llama-vocab.cpp``): 'smollm' (SmolLM2:
single digits, then GPT-2's regex), the names of ``LLAMA_VOCAB_PRE_TYPE_LLAMA3``
(Llama 3's regex, digits in runs of 1-3) and 'qwen2' (Llama 3's regex with single
digits). Any other value is refused: its regex would differ and tokenize silently wrong
(llama.cpp #6920)."""

# Token texts llama.cpp treats as end of generation whatever the metadata says
# (``special_eog_ids`` in src/llama-vocab.cpp), and those of its fill-in-the-middle
# pad / repo / file-separator tokens, which it also stops at.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>")
_FIM_EOG = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<PAD>"),
            "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>"),
            "fim_sep": ("<|file_sep|>",)}


@dataclasses.dataclass(frozen=True, eq=False)
class LlamaGGUF:
    """A llama GGUF checkpoint, dequantised, in HF orientation.

    Attributes:
      hparams: ``vocab_size`` V, ``num_layers`` L, ``d_model`` D, ``num_heads``
        N, ``num_kv_heads`` K, ``head_dim`` H, ``mlp_dim`` F (ints);
        ``rope_theta``, ``norm_eps`` (floats); ``context_length``,
        ``bos_token_id``, ``eos_token_id`` (ints; see
        :func:`resolve_special_token_ids` for how eos is chosen);
        ``eos_token_ids`` (tuple of every end-of-generation id,
        :func:`end_of_generation_ids`); ``pre_tokenizer`` (the dialect
        ``tokenizer.ggml.pre`` names, :data:`PRE_TOKENIZERS`);
        ``tie_embeddings`` (bool: no separate ``output.weight``); ``qkv_bias`` (bool:
        q/k/v biases, the 'qwen2' architecture); ``architecture`` (str).
      tensors: name -> numpy array of the requested dtype:
        ``embed`` [V, D], ``final_norm`` [D], and stacked over layers
        ``attn_norm`` [L, D], ``mlp_norm`` [L, D], ``wq`` [L, N*H, D],
        ``wk`` [L, K*H, D], ``wv`` [L, K*H, D], ``wo`` [L, D, N*H],
        ``w_gate`` [L, F, D], ``w_up`` [L, F, D], ``w_down`` [L, D, F]
        (``[out, in]``, i.e. ``y = x @ w.T``), plus ``lm_head`` [V, D] only when
        the file has an untied ``output.weight``, and with ``qkv_bias`` the biases
        ``bq`` [L, N*H], ``bk``, ``bv`` [L, K*H]. Q/K rows are in HF order
        (half-split rotary), the llama.cpp permutation undone.
      path: the file read.
      tokenizer_fields: the GGUF's ``tokenizer.*`` metadata (tokens, merges,
        token types, chat template, ...), so :func:`load_tokenizer` need not
        re-read the file.
    """

    hparams: dict
    tensors: dict
    path: pathlib.Path
    tokenizer_fields: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF->GGUF row permutation of a Q or K weight (reference/test use).

    Within each head, rows ``[x_0..x_{H/2-1}, y_0..y_{H/2-1}]`` (HF half-split
    rotary pairs ``(x_j, y_j)``) become interleaved ``[x_0, y_0, x_1, y_1, ...]``.

    Args:
      w: [n_head*H, ...] array (rows = output features).
      n_head: heads in ``w`` (N for Q, K for K).

    Returns:
      array of the same shape and dtype.
    """
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def undo_llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`llama_cpp_permute`: GGUF Q/K rows back to HF (half-split) order.

    Args:
      w: [n_head*H, ...] array as stored in the GGUF (after dequantisation).
      n_head: heads in ``w`` (N for Q, K for K).

    Returns:
      array of the same shape and dtype (a copy).

    Raises:
      ValueError: ``w.shape[0]`` is not a multiple of ``2 * n_head``.
    """
    if w.shape[0] % (2 * n_head):
        raise ValueError(f"{w.shape[0]} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_reader(path: pathlib.Path) -> gguf.GGUFReader:
    if not path.exists():
        raise WeightsError(
            f"GGUF file {path} does not exist; kvjax.checkpoints.weights_path() fetches "
            "SmolLM2-135M-Instruct.Q4_1.gguf into the cache and returns its path"
        )
    if not path.is_file():
        raise WeightsError(f"GGUF path {path} is not a regular file")
    try:
        return gguf.GGUFReader(path, "r")
    except (PermissionError, IsADirectoryError) as e:
        raise WeightsError(f"GGUF file {path} is unreadable: {e}") from e
    except Exception as e:  # gguf raises ValueError/IndexError/... on truncated or corrupt files
        size = path.stat().st_size if path.exists() else 0
        raise WeightsError(
            f"GGUF file {path} ({size:,} bytes) is truncated or corrupt "
            f"({type(e).__name__}: {e}). Delete it so that weights_path() fetches it again."
        ) from e


def _field(reader: gguf.GGUFReader, key: str, default: Any = ..., path: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise WeightsError(f"GGUF file {path or reader.data.filename} lacks metadata key {key!r}")
        return default
    return field.contents()


def _tokenizer_fields(reader: gguf.GGUFReader) -> dict:
    return {k: _field(reader, k, None) for k in _TOKENIZER_KEYS if k in reader.fields}


def resolve_special_token_ids(tokenizer_fields: dict) -> tuple[int, int]:
    """(bos, eos) token ids from GGUF tokenizer metadata.

    bos is ``tokenizer.ggml.bos_token_id``. eos is the id of ``<|im_end|>`` when
    the chat template is ChatML (uses ``<|im_end|>``) and the vocabulary has that
    token, otherwise ``tokenizer.ggml.eos_token_id``: SmolLM2's GGUF records eos
    = 1 (``<|im_start|>``), whereas the HF model ends a turn with
    ``<|im_end|>`` = 2.

    Raises:
      WeightsError: no bos/eos id can be determined.
    """
    tokens = tokenizer_fields.get("tokenizer.ggml.tokens") or []
    template = tokenizer_fields.get("tokenizer.chat_template") or ""
    bos = tokenizer_fields.get("tokenizer.ggml.bos_token_id")
    eos = tokenizer_fields.get("tokenizer.ggml.eos_token_id")
    if "<|im_end|>" in template and "<|im_end|>" in tokens:
        eos = list(tokens).index("<|im_end|>")
    if bos is None or eos is None:
        raise WeightsError(f"GGUF tokenizer metadata lacks bos/eos ids (bos={bos}, eos={eos})")
    return int(bos), int(eos)


def pre_tokenizer_dialect(tokenizer_fields: dict, source: Any = "GGUF") -> str:
    """The pre-tokenizer dialect ('smollm', 'llama3' or 'qwen2') that the GGUF's
    ``tokenizer.ggml.pre`` names (see :data:`PRE_TOKENIZERS`).

    Raises:
      WeightsError: the value is missing or not one of :data:`PRE_TOKENIZERS` (naming it
        and the values allowed).
    """
    pre = tokenizer_fields.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        what = "lacks tokenizer.ggml.pre" if pre is None else f"has tokenizer.ggml.pre={pre!r}"
        raise WeightsError(
            f"{source} {what}, a pre-tokenizer kvjax does not implement (its text would be "
            f"split wrongly); allowed: {', '.join(map(repr, PRE_TOKENIZERS))}")
    return PRE_TOKENIZERS[pre]


def end_of_generation_ids(tokenizer_fields: dict) -> tuple[int, ...]:
    """Every id that ends a generation, sorted, as llama.cpp's ``llama_vocab::is_eog``
    decides (``special_eog_ids``, src/llama-vocab.cpp): the ``eos`` (as
    :func:`resolve_special_token_ids` resolves it), ``eot`` and ``eom`` ids the metadata
    states; every token whose text is one of ``<|eot_id|>``, ``<|im_end|>``, ``<|end|>``,
    ``<end_of_turn>``, ``<|endoftext|>``, ``<|eom_id|>``, ``<EOT>``; and the
    fill-in-the-middle pad, repo and file-separator tokens (metadata ``fim_*_token_id``,
    else found by text, e.g. ``<|fim_pad|>``, ``<|repo_name|>``, ``<|file_sep|>``).
    SmolLM2: (0, 2), ``<|endoftext|>`` and ``<|im_end|>``; Llama 3.1: ``<|end_of_text|>``,
    ``<|eom_id|>``, ``<|eot_id|>``.

    Ids outside the vocabulary are ignored (llama.cpp warns and drops them too).

    Raises:
      WeightsError: as :func:`resolve_special_token_ids`.
    """
    tokens = list(tokenizer_fields.get("tokenizer.ggml.tokens") or [])
    ids = {resolve_special_token_ids(tokenizer_fields)[1]}
    for key in ("eos", "eot", "eom"):
        i = tokenizer_fields.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None:
            ids.add(int(i))
    ids.update(i for i, t in enumerate(tokens) if t in _EOG_TEXTS)
    for key, texts in _FIM_EOG.items():
        i = tokenizer_fields.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            i = next((j for j, t in enumerate(tokens) if t in texts), None)
        if i is not None:
            ids.add(int(i))
    n = len(tokens) or max(ids) + 1
    return tuple(sorted(i for i in ids if 0 <= i < n))


def _dequantize(tensor: Any, path: pathlib.Path) -> np.ndarray:
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except Exception as e:
        raise WeightsError(
            f"cannot dequantise tensor {tensor.name} ({tensor.tensor_type.name}) of {path}: "
            f"{type(e).__name__}: {e}"
        ) from e


def _check_shape(name: str, arr: Any, expected: tuple[int, ...], path: pathlib.Path) -> None:
    shape = tuple(arr.shape) if hasattr(arr, "shape") else tuple(arr)
    if shape != tuple(expected):
        raise WeightsError(
            f"GGUF tensor {name} of {path} has shape {shape} (numpy, [out, in]); "
            f"the hyperparameters imply {tuple(expected)}"
        )


def _read_hparams(reader: gguf.GGUFReader, path: pathlib.Path):
    """(hparams, tokenizer fields, tensors by name) from a GGUF's metadata; no tensor data
    is read. Raises WeightsError as :func:`read_llama_gguf` does for metadata."""
    arch = _field(reader, "general.architecture", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise WeightsError(
            f"GGUF file {path} has general.architecture={arch!r}; "
            f"this reader supports only {', '.join(map(repr, SUPPORTED_ARCHITECTURES))}"
        )

    def key(name: str, default: Any = ...) -> Any:
        return _field(reader, f"{arch}.{name}", default, path)

    tok_fields = _tokenizer_fields(reader)
    pre = pre_tokenizer_dialect(tok_fields, f"GGUF file {path}")
    bos, eos = resolve_special_token_ids(tok_fields)
    rope_scaling = key("rope.scaling.type", None)
    factor = key("rope.scaling.factor", None)
    kind = rope_scaling or ("linear" if factor not in (None, 1.0) else None)
    if kind not in (None, "none") and factor != 1.0:
        raise WeightsError(
            f"GGUF file {path} uses rope scaling {kind!r} ({arch}.rope.scaling.type, "
            f"factor {factor}), which kvjax does not implement; allowed: no rope scaling "
            "(type 'none' or absent, or a factor of 1)")
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise WeightsError(
            f"GGUF file {path} has a rope_freqs.weight tensor (per-frequency rope scaling, "
            "Llama 3.1's rope_type 'llama3'), which kvjax does not implement; allowed: "
            "no rope scaling")
    num_layers = int(key("block_count"))
    d_model = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = int(key("attention.head_count_kv", num_heads))
    head_dim = int(key("attention.key_length", d_model // num_heads))
    if int(key("attention.value_length", head_dim)) != head_dim:
        raise WeightsError(f"GGUF file {path}: key_length != value_length is not supported")
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise WeightsError(f"GGUF file {path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    if num_heads % num_kv_heads:
        raise WeightsError(f"GGUF file {path}: {num_heads} query heads do not group into {num_kv_heads} KV heads")

    by_name = {t.name: t for t in reader.tensors}
    vocab_default = len(tok_fields.get("tokenizer.ggml.tokens") or [])
    if not vocab_default and "token_embd.weight" in by_name:
        vocab_default = int(by_name["token_embd.weight"].shape[-1])
    hp = dict(
        vocab_size=int(key("vocab_size", vocab_default)),
        num_layers=num_layers,
        d_model=d_model,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        mlp_dim=int(key("feed_forward_length")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        context_length=int(key("context_length")),
        bos_token_id=bos,
        eos_token_id=eos,
        eos_token_ids=end_of_generation_ids(tok_fields),
        pre_tokenizer=pre,
        tie_embeddings="output.weight" not in by_name,
        qkv_bias=arch == "qwen2",
        architecture=arch,
    )
    return hp, tok_fields, by_name


def read_llama_hparams(path: str | os.PathLike) -> dict:
    """The hyper-parameters :func:`read_llama_gguf` would return, from the file's metadata
    alone (no tensor is dequantised; ~2 s for SmolLM2, parsing the vocabulary).

    Returns:
      the ``LlamaGGUF.hparams`` dict plus ``chat_template`` (str or None).

    Raises:
      WeightsError: as :func:`read_llama_gguf` for the metadata.
    """
    path = pathlib.Path(path)
    hp, tok_fields, _ = _read_hparams(_open_reader(path), path)
    return dict(hp, chat_template=tok_fields.get("tokenizer.chat_template"))


def read_llama_gguf(
    path: str | os.PathLike, dtype: Any = np.float32, progress: bool = True,
    check: Callable[[dict], None] | None = None,
    check_tokenizer: Callable[[dict], None] | None = None,
) -> LlamaGGUF:
    """Reads and dequantises a llama-architecture GGUF file.

    Every tensor is dequantised to float32 with ``gguf.quants.dequantize`` and
    then cast to ``dtype``. The rows of Q and K are un-permuted
    (:func:`undo_llama_cpp_permute`, with N heads for Q and K heads for K) so
    the weights work with HF half-split (``rotate_half``) rotary. Takes ~3 s
    for SmolLM2-135M (2 s of which is gguf parsing the 49k-token vocabulary).

    Args:
      path: the ``.gguf`` file.
      dtype: numpy dtype of the returned arrays, e.g. ``np.float32`` or
        ``ml_dtypes.bfloat16`` / ``jnp.bfloat16``.
      progress: show a tqdm progress bar over layers.
      check: called with the hyper-parameters (as :func:`read_llama_hparams` returns
        them) after the metadata is read and before any tensor is dequantised; what it
        raises propagates (e.g. a config that disagrees with the file).
      check_tokenizer: called after ``check``, also before any tensor is dequantised,
        with the file's ``tokenizer.*`` metadata (what ``LlamaGGUF.tokenizer_fields``
        holds; e.g. to count a prompt's tokens); what it raises propagates.

    Returns:
      LlamaGGUF with ``hparams``, ``tensors`` (shapes in its docstring; e.g. for
      SmolLM2-135M L=30, D=576, N=9, K=3, H=64, F=1536, V=49152) and ``path``.

    Raises:
      WeightsError: the file is missing or unreadable; truncated or corrupt
        (the message names it and suggests deleting it to re-fetch);
        ``general.architecture`` is not one of :data:`SUPPORTED_ARCHITECTURES`; ``tokenizer.ggml.pre`` is missing
        or not one of :data:`PRE_TOKENIZERS`; metadata keys or tensors are missing,
        unexpected (e.g. biases, MoE experts), of a type gguf cannot dequantise
        (:data:`DEQUANTIZABLE`) or of the wrong shape; rope scaling is present (a
        ``rope.scaling.type`` with a factor other than 1, or a ``rope_freqs.weight``).
        All of these are raised from the metadata, before any tensor is read.
    """
    path = pathlib.Path(path)
    dtype = np.dtype(dtype)
    reader = _open_reader(path)
    hp, tok_fields, by_name = _read_hparams(reader, path)
    if check is not None:
        check(dict(hp, chat_template=tok_fields.get("tokenizer.chat_template")))
    if check_tokenizer is not None:
        check_tokenizer(tok_fields)

    V, L, D, N, K, H, F = (hp[k] for k in (
        "vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"))
    layer_shapes = {
        "attn_norm": (D,), "mlp_norm": (D,),
        "wq": (N * H, D), "wk": (K * H, D), "wv": (K * H, D), "wo": (D, N * H),
        "w_gate": (F, D), "w_up": (F, D), "w_down": (D, F),
    }
    per_layer = dict(_LAYER_TENSORS)
    if hp["qkv_bias"]:
        layer_shapes.update(bq=(N * H,), bk=(K * H,), bv=(K * H,))
        per_layer.update(_BIAS_TENSORS)
    permuted = hp["architecture"] == "llama"
    global_shapes = {"embed": (V, D), "final_norm": (D,), "lm_head": (V, D)}

    expected = set(_GLOBAL_TENSORS) | {f"blk.{i}.{n}" for i in range(L) for n in per_layer}
    missing = sorted(expected - set(by_name), key=_natural_key)
    if missing:
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise WeightsError(f"GGUF file {path} lacks tensors: {shown}")
    unexpected = sorted(set(by_name) - expected - set(_OPTIONAL_GLOBAL_TENSORS), key=_natural_key)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f", ... ({len(unexpected)} in all)" if len(unexpected) > 8 else "")
        raise WeightsError(
            f"GGUF file {path} has tensors this reader does not handle in a "
            f"{hp['architecture']!r} file: {shown}")
    # types and shapes from the metadata, before any tensor is read
    shapes = {**{g: global_shapes[n] for g, n in {**_GLOBAL_TENSORS, **_OPTIONAL_GLOBAL_TENSORS}.items()},
              **{f"blk.{i}.{g}": layer_shapes[n] for i in range(L) for g, n in per_layer.items()}}
    for gname in sorted(by_name, key=_natural_key):
        t = by_name[gname]
        if t.tensor_type not in DEQUANTIZABLE:
            raise WeightsError(
                f"GGUF tensor {gname} of {path} is {t.tensor_type.name}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantise; allowed: "
                f"{', '.join(sorted(q.name for q in DEQUANTIZABLE))}")
        _check_shape(gname, tuple(int(d) for d in reversed(t.shape)), shapes[gname], path)

    tensors: dict[str, np.ndarray] = {}
    for gname, name in {**_GLOBAL_TENSORS, **_OPTIONAL_GLOBAL_TENSORS}.items():
        if gname in by_name:
            arr = _dequantize(by_name[gname], path)
            _check_shape(gname, arr, global_shapes[name], path)
            tensors[name] = arr.astype(dtype)

    stacked = {name: np.empty((L, *shape), dtype) for name, shape in layer_shapes.items()}
    for i in tqdm.trange(L, desc=f"dequantising {path.name}", unit="layer", disable=not progress):
        for gname, name in per_layer.items():
            full = f"blk.{i}.{gname}"
            arr = _dequantize(by_name[full], path)
            _check_shape(full, arr, layer_shapes[name], path)
            if permuted and name == "wq":
                arr = undo_llama_cpp_permute(arr, N)
            elif permuted and name == "wk":
                arr = undo_llama_cpp_permute(arr, K)
            stacked[name][i] = arr  # casts to dtype
    tensors.update(stacked)
    return LlamaGGUF(hparams=hp, tensors=tensors, path=path, tokenizer_fields=tok_fields)


FIELDS_CACHE_SUBDIR = "tokenizer-fields"
"""The folder under the weights cache (:func:`kvjax.checkpoints.fetch.cache_dir_path`)
where :func:`read_tokenizer_fields` keeps the fields of the GGUF files in that cache."""


def _fields_cache_path(path: pathlib.Path) -> pathlib.Path | None:
    """Where the tokenizer fields of ``path`` are kept: for a file inside the weights
    cache, a JSON file named after its path, size and modification time (a rewritten
    file gets a new name); None for any other file, or one that cannot be stat'ed."""
    cache = cache_dir_path()
    try:
        resolved = path.resolve()
        if not resolved.is_relative_to(cache.resolve()):
            return None
        st = resolved.stat()
    except OSError:
        return None
    stamp = hashlib.sha256(f"{resolved}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache / FIELDS_CACHE_SUBDIR / f"{resolved.stem}-{stamp[:16]}.json"


def read_tokenizer_fields(path: str | os.PathLike) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file (tokens, token types, merges, ...).

    gguf parses every field of the file to give them (~5 s for SmolLM2's 49,152 tokens
    on a 2-core CPU, in every process that loads the tokenizer); for a file inside the
    weights cache (the fetched checkpoint) the fields are kept as JSON under
    ``$KVJAX_CACHE/tokenizer-fields`` and read from there next time (~0.05 s), keyed by
    the file's path, size and modification time (docs/decisions/0032-tokenizer-fields-cache.md).

    Raises:
      WeightsError: the file is missing, unreadable, truncated or corrupt.
    """
    path = pathlib.Path(path)
    kept = _fields_cache_path(path)
    if kept is not None and kept.is_file():
        try:
            return json.loads(kept.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # a torn or unreadable copy: read the GGUF again
            pass
    fields = _tokenizer_fields(_open_reader(path))
    if kept is not None:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(fields), encoding="utf-8")
            os.replace(tmp, kept)  # whole or absent for a concurrent reader
        except (OSError, TypeError, ValueError) as e:
            warnings.warn(f"tokenizer fields of {path} not kept in {kept}: {e}", stacklevel=2)
    return fields


def _natural_key(name: str) -> list:
    return [int(p) if p.isdigit() else p for p in name.replace(".", " . ").split()]
