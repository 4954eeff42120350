"""Decode-step peers for the benchmark: the same shapes and dtype, other implementations.

* :func:`flax_decode_step_seconds`: Flax's own decode cache
  (``flax.linen.MultiHeadDotProductAttention(decode=True)``, a mutable 'cache' collection,
  layout [B, S, N, H]) in a model of the same shapes (pre-norm blocks, GELU MLP, tied LM
  head), jitted with the cache donated.
* :func:`torch_decode_step_seconds`: PyTorch ``scaled_dot_product_attention`` over a
  preallocated static cache [B, K, S, H] (``enable_gqa`` for K < N), same shapes, under
  ``torch.inference_mode``; needs ``pip install torch==2.13.0`` (optional).
* :func:`llamacpp_stepper`: llama.cpp on the same SmolLM2 GGUF (4-bit weights, f16
  cache; or its float32 copy, :func:`dense_gguf`, with a float32 cache); needs ``pip
  install llama-cpp-python`` (optional, compiles).

The first two return the per-step wall times (s) of ``repeats`` steps at a cache filled
to ``context`` - 1 tokens; the third a function that times one such step each call (so
a benchmark can interleave it with kvjax's). Peers are benchmark extras, not library
dependencies.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kvjax.config import ModelConfig


class _FlaxBlock(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        h = nn.RMSNorm(dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=c.num_heads, qkv_features=c.num_heads * c.head_dim, decode=True,
            dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(h, h)
        x = x + h
        h = nn.RMSNorm(dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(x)
        act = nn.gelu if c.mlp_type == "gelu" else nn.silu
        h = nn.Dense(c.d_model, dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(
            act(nn.Dense(c.mlp_dim, dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(h)))
        return x + h


class _FlaxLM(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)
        x = embed(tokens)
        for _ in range(c.num_layers):
            x = _FlaxBlock(c)(x)
        return embed.attend(nn.RMSNorm(dtype=c.jnp_dtype, param_dtype=c.jnp_dtype)(x))


def flax_decode_step_seconds(cfg: ModelConfig, context: int, repeats: int = 5,
                             batch: int = 1) -> list[float]:
    """Per-step seconds of Flax's decode=True attention (MHA only: Flax has no KV groups).

    The cache collection is initialised for ``context`` slots and its index set to
    ``context - 1`` before each timed step (the step then attends over all slots).
    """
    model = _FlaxLM(cfg)
    tokens = jnp.zeros((batch, context), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), variables["params"])
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables["cache"])

    @jax.jit
    def step(params, cache, token):
        logits, mutated = model.apply({"params": params, "cache": cache}, token,
                                      mutable=["cache"])
        return logits, mutated["cache"]

    step = jax.jit(step.__wrapped__, donate_argnums=1)
    token = jnp.zeros((batch, 1), jnp.int32)

    def reset(cache):
        return jax.tree_util.tree_map_with_path(
            lambda p, x: jnp.full_like(x, context - 1) if "cache_index" in str(p[-1]) else x,
            cache)

    times = []
    for i in range(repeats + 1):
        cache = reset(cache)
        jax.block_until_ready(cache)
        start = time.perf_counter()
        logits, cache = step(params, cache, token)
        logits.block_until_ready()
        if i:
            times.append(time.perf_counter() - start)
    return times


def torch_decode_step_seconds(cfg: ModelConfig, context: int, repeats: int = 5,
                              batch: int = 1, threads: int | None = None) -> list[float]:
    """Per-step seconds of a PyTorch decoder with a static [B, K, S, H] cache and SDPA.

    Raises:
      ImportError: torch is not installed (``pip install torch==2.13.0``).
    """
    import torch  # noqa: PLC0415 (optional peer)
    import torch.nn.functional as F  # noqa: PLC0415, N812

    if threads:
        torch.set_num_threads(threads)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}[cfg.dtype]
    d, n, k, h, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * shape[0] ** -0.5).to(dt)

    layers = [dict(wq=w(d, n * h), wk=w(d, k * h), wv=w(d, k * h), wo=w(n * h, d),
                   w1=w(d, f), w2=w(f, d), gate=w(d, f) if cfg.mlp_type == "swiglu" else None,
                   kc=torch.zeros(batch, k, context, h, dtype=dt),
                   vc=torch.zeros(batch, k, context, h, dtype=dt))
              for _ in range(cfg.num_layers)]
    embed = w(cfg.vocab_size, d)
    mask = torch.ones(1, 1, 1, context, dtype=torch.bool)

    def rms(x):
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def step(token, pos):
        x = embed[token]  # [B, 1, D]
        for lay in layers:
            y = rms(x)
            q = (y @ lay["wq"]).view(batch, 1, n, h).transpose(1, 2)
            kk = (y @ lay["wk"]).view(batch, 1, k, h).transpose(1, 2)
            vv = (y @ lay["wv"]).view(batch, 1, k, h).transpose(1, 2)
            lay["kc"][:, :, pos] = kk[:, :, 0]
            lay["vc"][:, :, pos] = vv[:, :, 0]
            o = F.scaled_dot_product_attention(q, lay["kc"], lay["vc"], attn_mask=mask,
                                               enable_gqa=k != n)
            x = x + o.transpose(1, 2).reshape(batch, 1, n * h) @ lay["wo"]
            y = rms(x)
            hid = (F.silu(y @ lay["gate"]) * (y @ lay["w1"]) if lay["gate"] is not None
                   else F.gelu(y @ lay["w1"]))
            x = x + hid @ lay["w2"]
        return rms(x) @ embed.T

    token = torch.zeros(batch, 1, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            start = time.perf_counter()
            step(token, context - 1)
            if i:
                times.append(time.perf_counter() - start)
    return times


def llamacpp_stepper(gguf_path: str, context: int, threads: int = 2,
                     kv_type: str = "f16") -> Callable[[], float]:
    """A function that times one llama.cpp (``llama-cpp-python``) decode step on a
    SmolLM2 GGUF at ``context`` tokens and returns its wall seconds.

    On the published file its weights stay 4-bit (Q4_1, Q8_0 embeddings); on the file
    from :func:`dense_gguf` they are float32 like kvjax's. ``kv_type`` is llama.cpp's KV
    cache type ('f16', its default, or 'f32'). Bytes per step differ between the files:
    compare tokens/s and, separately, the fraction of the bandwidth roofline
    (:func:`llamacpp_step_bytes`). The prompt of ``context - 1`` tokens is evaluated here
    (not timed); each call evaluates one token after it and then rewinds to the prompt
    (``Llama.eval`` drops the slots past ``n_tokens`` first), so every call times the
    same step, ``threads`` threads.

    Raises:
      ImportError: llama-cpp-python is not installed (``pip install llama-cpp-python``
        compiles llama.cpp; ~5 min on 2 cores).
      ValueError: kv_type not 'f16' or 'f32'.
    """
    import llama_cpp  # noqa: PLC0415 (optional peer)

    types = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
    if kv_type not in types:
        raise ValueError(f"kv_type={kv_type!r}; allowed: one of {list(types)}")
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=context + 1, n_threads=threads,
                          verbose=False, type_k=types[kv_type], type_v=types[kv_type])
    llm.eval([1] * (context - 1))

    def step() -> float:
        start = time.perf_counter()
        llm.eval([1])
        seconds = time.perf_counter() - start
        llm.n_tokens = context - 1
        return seconds
    return step


def dense_gguf(gguf_path: str, out_path: str | None = None) -> str:
    """A float32 copy of a GGUF (every tensor dequantized with ``gguf.quants``, metadata
    copied as in gguf-py's ``gguf_new_metadata``), so llama.cpp runs at kvjax's dtype.

    Written once next to ``gguf_path`` (``<stem>.F32.gguf``, ~4x the Q4 file) and reused.
    Returns the path.
    """
    import gguf  # noqa: PLC0415

    out_path = out_path or os.path.splitext(gguf_path)[0] + ".F32.gguf"
    if os.path.exists(out_path):
        return out_path
    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = out_path + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch=arch)
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) \
                or field.name.startswith("GGUF."):
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)  # replaces the copied Q4_1 file type
    for t in reader.tensors:
        writer.add_tensor(t.name, np.ascontiguousarray(
            gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def llamacpp_step_bytes(gguf_path: str, cfg: ModelConfig, context: int,
                        kv_bytes: int = 2) -> int:
    """Bytes one llama.cpp decode step reads: the GGUF's tensor bytes (all weights, as
    stored) + its KV cache at ``context`` tokens (L·K·2·H·``kv_bytes`` per token)."""
    import gguf  # noqa: PLC0415

    weights = sum(int(t.n_bytes) for t in gguf.GGUFReader(gguf_path).tensors)
    return weights + context * cfg.num_layers * cfg.num_kv_heads * 2 * cfg.head_dim * kv_bytes


def median(xs) -> float:
    return float(np.median(xs))


def llamacpp_prompt_seconds(gguf_path: str, prompt_len: int, repeats: int = 3,
                            threads: int = 2, kv_type: str = "f32") -> list[float]:
    """Seconds llama.cpp (``llama-cpp-python``) takes to evaluate a ``prompt_len``-token
    prompt into an empty cache (its prompt processing; logits of the last token only),
    ``repeats`` times after one warm-up, with ``threads`` threads. Use the float32 copy
    (:func:`dense_gguf`) and kv_type 'f32' for kvjax's dtype.

    Raises:
      ImportError: llama-cpp-python is not installed.
      ValueError: kv_type not 'f16' or 'f32'.
    """
    import llama_cpp  # noqa: PLC0415 (optional peer)

    types = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}
    if kv_type not in types:
        raise ValueError(f"kv_type={kv_type!r}; allowed: one of {list(types)}")
    llm = llama_cpp.Llama(model_path=gguf_path, n_ctx=prompt_len + 1, n_batch=prompt_len,
                          n_threads=threads, n_threads_batch=threads, verbose=False,
                          type_k=types[kv_type], type_v=types[kv_type])
    tokens = [1 + i % 1000 for i in range(prompt_len)]
    times = []
    for i in range(repeats + 1):
        llm.reset()
        start = time.perf_counter()
        llm.eval(tokens)
        if i:
            times.append(time.perf_counter() - start)
    return times
