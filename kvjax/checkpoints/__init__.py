"""Pretrained weights: fetching the SmolLM2 GGUF, reading it into HF-layout arrays, its tokenizer.

    path = weights_path()                      # cached, sha256-verified .gguf
    ckpt = read_llama_gguf(path, np.float32)   # LlamaGGUF(hparams, tensors, path)
    tok = load_tokenizer(ckpt)                 # Tokenizer(encode, decode, ...)

All failures raise :class:`WeightsError` with a message that says what to do.
"""

from kvjax.checkpoints.fetch import WeightsError, weights_path
from kvjax.checkpoints.gguf_reader import LlamaGGUF, read_llama_gguf, read_llama_hparams
from kvjax.checkpoints.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_fields

__all__ = ["weights_path", "read_llama_gguf", "read_llama_hparams", "LlamaGGUF",
           "load_tokenizer", "tokenizer_from_fields", "Tokenizer", "WeightsError"]
