"""The families of issue 53 from Hugging Face folders written here (random weights in
each family's HF layout): Llama 3.x (rope scaling 'llama3'), Qwen3 (q/k norm). Each: load from config.json
+ safetensors + tokenizer.json, logits within 1e-4 of tests/reference.py (float64)
through the cache (a prefill, then steps) and equal to the cache-free forward, greedy
tokens through the main job's compiled loop equal to the reference's argmax
continuation, and a refusal of a field kvjax does not implement, naming it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import rope
from kvjax.checkpoints import WeightsError, hf
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import runner
from kvjax.models.layers import apply_rope
from tests import reference
from tests.test_hf_checkpoints import (IDS, SIZES, kvjax_logits, loaded_params, random_weights,
                                       run_for, write_hf_checkpoint)

# Llama 3.1 8B's published rope_scaling (config.json), rope_theta 5e5, head_dim 128.
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
# A tiny one: H = 8 over theta 1e4 has wavelengths 6.3, 63, 628, 6283 tokens; with an
# original context of 16 (bands at 16 / 4 = 4 and 16 / 1 = 16 tokens) the first is
# interpolated, the others divided by the factor. Prompts of 24 tokens run past it.
TINY_LLAMA3 = dict(LLAMA31, factor=4.0, original_max_position_embeddings=16)
LONG_IDS = [(7 * i + 3) % SIZES["V"] for i in range(24)]


def family_checks(folder, ids, prefill, prompt, new_tokens=4):
    """The checks every family passes; returns the RunConfig's model."""
    ckpt = hf.read_hf_checkpoint(folder, progress=False)
    cfg = run_for(folder).model
    params = loaded_params(ckpt, cfg)
    want = reference.llama_logits(ckpt, ids)
    steps = kvjax_logits(params, cfg, ids, prefill=prefill)
    np.testing.assert_allclose(steps, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(steps, kvjax_logits(params, cfg, ids, steps=False),
                               atol=1e-5, rtol=0)
    # the main job: runner.load and its compiled decode loop, greedy
    run = run_for(folder, chat_template=False, prompt=prompt, max_new_tokens=new_tokens)
    loaded = runner.load(run, progress=False)
    gen = runner.decode_prompt(dataclasses.replace(run, stop_at_eos=False), loaded)
    seq = loaded.tokenizer.encode(prompt)
    for _ in range(new_tokens):
        seq.append(int(np.argmax(reference.llama_logits(ckpt, seq)[-1])))
    assert gen.generated_ids[:new_tokens] == seq[-new_tokens:]
    return cfg


def refused(tmp_path, match, **kw):
    folder = write_hf_checkpoint(tmp_path / "refused", random_weights(SIZES), SIZES, **kw)
    with pytest.raises(WeightsError, match=match) as e:
        hf.read_hf_checkpoint(folder, progress=False)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- Llama 3.x


def test_llama3_frequencies_are_metas_formula():
    """kvjax.rope against Meta's loop (tests/reference.py) for Llama 3.1 8B's numbers:
    all three bands present; the long wavelengths divided by 8, the short ones kept."""
    plain = 5e5 ** (-np.arange(0, 128, 2) / 128)
    got = rope.inverse_frequencies(128, 5e5, rope.rope_scaling_pairs(LLAMA31))
    want = reference.llama3_frequencies(plain, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    ratio = plain / got
    assert ratio[0] == 1 and ratio[-1] == 8 and ((ratio > 1) & (ratio < 8)).any()


def test_llama3_rotation_beyond_the_original_context():
    """apply_rope with the scaling equals the reference rotation at positions 0..511,
    up to 32x the original context of 16, and differs from plain rotary there."""
    x = np.random.default_rng(0).standard_normal((1, 512, 2, 8)).astype(np.float32)
    pos = np.arange(512)
    scaling = rope.rope_scaling_pairs(TINY_LLAMA3)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos[None]), 1e4, scaling))[0]
    want = reference.rotary(x[0].astype(np.float64), pos, 1e4, scaling)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
    plain = reference.rotary(x[0].astype(np.float64), pos, 1e4)
    assert np.abs(plain[16:] - want[16:]).max() > 0.1


def test_llama3_checkpoint(tmp_path):
    """A Llama 3.x folder (rope_theta 1e4, rope_scaling 'llama3', untied head): 24-token
    sequences, past its original context of 16, match the reference."""
    w = random_weights(dict(SIZES, H=8), seed=11)
    folder = write_hf_checkpoint(tmp_path / "Llama-3-tiny", w, dict(SIZES, H=8), tied=False,
                                 config_extra=dict(rope_scaling=TINY_LLAMA3))
    cfg = family_checks(folder, LONG_IDS, prefill=5, prompt="abc hi " * 4)
    assert dict(cfg.rope_scaling) == TINY_LLAMA3
    # a rope_scaling that contradicts the checkpoint is refused, naming both
    other = dict(TINY_LLAMA3, factor=2.0)
    with pytest.raises(ConfigError, match=r"model.rope_scaling=.*does not match the "
                                          r"checkpoint's .*config.json rope_scaling"):
        run_for(folder, **{"model.rope_scaling": tuple(sorted(other.items()))})


def test_rope_scaling_refusals(tmp_path):
    refused(tmp_path, r"rope_scaling.rope_type='dynamic' is not implemented",
            config_extra={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    refused(tmp_path, r"rope_scaling.high_freq_factor=None; allowed: a positive number",
            config_extra={"rope_scaling": dict(TINY_LLAMA3, high_freq_factor=None)})
    with pytest.raises(ConfigError, match=r"model.rope_scaling=.*original_max_position"):
        ModelConfig(vocab_size=8, num_layers=1, d_model=8, num_heads=2, num_kv_heads=2,
                    head_dim=4, mlp_dim=8, rope_scaling={"rope_type": "llama3", "factor": 8})


# --------------------------------------------------------------------------- Qwen3


def test_qwen3_checkpoint(tmp_path):
    """A Qwen3 folder: per-head q/k RMSNorm scales [H] before the rotary embedding,
    head_dim 8 with D / N = 4 (N·H = 32 != D = 16), tied head, no biases; through
    lever 1 too (K = 2 -> 4 duplicated heads: the same function)."""
    sizes = dict(SIZES, H=8)
    w = random_weights(sizes, seed=12)
    rng = np.random.default_rng(12)
    w.update(q_norm=(1 + 0.3 * rng.standard_normal((sizes["L"], 8))).astype(np.float32),
             k_norm=(1 + 0.3 * rng.standard_normal((sizes["L"], 8))).astype(np.float32))
    folder = write_hf_checkpoint(tmp_path / "Qwen3-tiny", w, sizes, arch="qwen3", tied=True)
    cfg = family_checks(folder, IDS, prefill=3, prompt="abc hi")
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.head_dim * cfg.num_heads != cfg.d_model
    ckpt = hf.read_hf_checkpoint(folder, progress=False)
    mha = run_for(folder, **{"model.num_kv_heads": 4, "model.attention": "mha"}).model
    np.testing.assert_allclose(kvjax_logits(loaded_params(ckpt, mha), mha, IDS),
                               reference.llama_logits(ckpt, IDS), atol=1e-4, rtol=1e-4)
    # the norms matter: without them the reference is another function
    plain = dict(ckpt.tensors)
    del plain["q_norm"], plain["k_norm"]
    assert np.abs(reference.llama_logits(dataclasses.replace(ckpt, tensors=plain), IDS)
                  - reference.llama_logits(ckpt, IDS)).max() > 1e-2


def test_qwen3_refusals(tmp_path):
    refused(tmp_path, r"use_sliding_window=True is not implemented", arch="qwen3",
            config_extra={"use_sliding_window": True})
