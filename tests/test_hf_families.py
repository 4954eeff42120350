"""The families of issue 53 from Hugging Face folders written here (random weights in
each family's HF layout): Llama 3.x (rope scaling 'llama3'), Qwen3 (q/k norm), Gemma 2
and 3 (GeGLU, sqrt(D) embeddings, post-norms, soft-caps, q/k norm, local and global
layers with their own windows, caches and rotary bases). Each: load from config.json
+ safetensors + tokenizer.json, logits within 1e-4 of tests/reference.py (float64)
through the cache (a prefill, then steps) and equal to the cache-free forward, greedy
tokens through the main job's compiled loop equal to the reference's argmax
continuation, and a refusal of a field kvjax does not implement, naming it."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax import rope
from kvjax.checkpoints import WeightsError, hf
from kvjax.config import ConfigError, ModelConfig
from kvjax.inference import runner
from kvjax.models import convert, model
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


def family_params(ckpt, cfg):
    """The checkpoint's params in cfg's layout (DeepSeek's MLA + MoE layout, or the llama
    one with lever 1's K conversion)."""
    if ckpt.hparams["architecture"] != "deepseek_v2":
        return loaded_params(ckpt, cfg)
    return jax.tree.map(jnp.asarray, model.params_for(
        cfg, convert.params_from_deepseek(ckpt.tensors, ckpt.hparams)))


def family_checks(folder, ids, prefill, prompt, new_tokens=4, ref=None):
    """The checks every family passes; returns the RunConfig's model. ``ref``: ids ->
    reference logits (default reference.llama_logits of the folder's checkpoint)."""
    ckpt = hf.read_hf_checkpoint(folder, progress=False)
    ref = ref or (lambda ids: reference.llama_logits(ckpt, ids))
    cfg = run_for(folder).model
    params = family_params(ckpt, cfg)
    want = ref(ids)
    steps = kvjax_logits(params, cfg, ids, prefill=prefill)
    np.testing.assert_allclose(steps, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(steps, kvjax_logits(params, cfg, ids, steps=False),
                               atol=1e-5, rtol=0)
    # the main job: runner.load and its compiled decode loop, greedy
    run = run_for(folder, chat_template=False, prompt=prompt, max_new_tokens=new_tokens)
    loaded = runner.load(run, progress=False)
    gen = runner.generate(dataclasses.replace(run, stop_at_eos=False), loaded)
    seq = loaded.tokenizer.encode(prompt)
    for _ in range(new_tokens):
        seq.append(int(np.argmax(ref(seq)[-1])))
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


# --------------------------------------------------------------------------- Gemma 2 / 3


def gemma_weights(sizes, seed, gemma3):
    """Raw Gemma weights: norms stored as w of (1 + w), so near 0."""
    w = random_weights(sizes, seed=seed)
    rng = np.random.default_rng(seed)
    L, D, H = sizes["L"], sizes["D"], sizes["H"]
    for name in ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
        w[name] = (0.2 * rng.standard_normal((L, D))).astype(np.float32)
    w["final_norm"] = (0.2 * rng.standard_normal(D)).astype(np.float32)
    if gemma3:
        w["q_norm"] = (0.3 * rng.standard_normal((L, H))).astype(np.float32)
        w["k_norm"] = (0.3 * rng.standard_normal((L, H))).astype(np.float32)
    return w


GEMMA2 = dict(hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
              query_pre_attn_scalar=6, sliding_window=3, attn_logit_softcapping=5.0,
              final_logit_softcapping=3.0, rms_norm_eps=1e-6, model_type="gemma2")
GEMMA3 = dict(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=6,
              sliding_window=3, sliding_window_pattern=6, rope_local_base_freq=100.0,
              rope_theta=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0},
              rms_norm_eps=1e-6, model_type="gemma3_text", attn_logit_softcapping=None,
              final_logit_softcapping=None)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_checkpoint(tmp_path, family):
    """Gemma 2 (4 layers: 0 and 2 local with W = 3, 1 and 3 global; soft-capped scores
    and logits) and Gemma 3 (6 layers, 5:1: layers 0-4 local with W = 3 and rotary base
    100, layer 5 global with base 1e4 and linear scaling x2; q/k norm): each local
    layer's ring holds its own 3 slots, a global layer the full 32; 8-token sequences
    wrap the rings."""
    gemma3 = family == "gemma3"
    sizes = dict(SIZES, L=6 if gemma3 else 4, H=8)
    w = gemma_weights(sizes, seed=13, gemma3=gemma3)
    extra = GEMMA3 if gemma3 else GEMMA2
    folder = write_hf_checkpoint(tmp_path / family, w, sizes, arch=family, tied=True,
                                 config_extra=extra)
    config = json.loads((folder / "config.json").read_text())
    ref = lambda ids: reference.gemma_logits(config, w, ids)  # noqa: E731
    cfg = family_checks(folder, IDS, prefill=2, prompt="abc hi", ref=ref)
    local = [3, 3, 3, 3, 3, None] if gemma3 else [3, None, 3, None]
    assert list(cfg.layer_windows) == local
    assert (cfg.mlp_type, cfg.embed_scale, cfg.post_norms, cfg.qk_norm) == (
        "geglu", True, True, gemma3)
    cache = cache_lib.init_cache(cfg, 1, 32)
    slots = [x.shape[cache_lib.slot_axis(cfg, "k")] for x in cache.tensors["k"]]
    assert slots == [32 if w_ is None else 3 for w_ in local]
    # the features bite: without soft-caps / local rotary base the reference differs
    plain = dict(config, attn_logit_softcapping=None, final_logit_softcapping=None,
                 rope_local_base_freq=1e4)
    assert np.abs(reference.gemma_logits(plain, w, IDS) - ref(IDS)).max() > 1e-2


def test_gemma_refusals(tmp_path):
    refused(tmp_path, r"hidden_activation='gelu' is not implemented", arch="gemma2",
            config_extra=dict(GEMMA2, hidden_activation="gelu", hidden_act="gelu"))
    refused(tmp_path, r"layer_types=\['chunked_attention'\] is not implemented",
            arch="gemma3", config_extra=dict(GEMMA3, layer_types=["chunked_attention"] * 2
                                             + ["full_attention"] * 0))


# --------------------------------------------------------------------------- DeepSeek-V2


def deepseek_config(lite: bool) -> dict:
    """A tiny DeepSeek-V2(-Lite) config.json: MLA (C = 8, R = 4, nope 4, v 4; V2: a
    query low-rank of 6), yarn x4 over an original context of 8 with DeepSeek's mscale
    0.707, 4 routed experts of width 8 (top-2; V2: 'group_limited_greedy' over 2 groups
    of 2, the best 1, renormalised), 1 shared expert, the first layer dense."""
    return dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
        vocab_size=SIZES["V"], hidden_size=16, intermediate_size=24, moe_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.5 if lite else 1.0,
        kv_lora_rank=8, q_lora_rank=None if lite else 6, qk_rope_head_dim=4, v_head_dim=4,
        qk_nope_head_dim=4, topk_method="greedy" if lite else "group_limited_greedy",
        n_group=1 if lite else 2, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=1, norm_topk_prob=not lite, scoring_func="softmax",
        hidden_act="silu", max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=8,
                          beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2)


def write_deepseek(folder, config, seed=0):
    """config.json, random weights under DeepSeek's HF names, the byte-level tokenizer."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    from tests.test_hf_checkpoints import byte_level_tokenizer  # noqa: PLC0415
    from tests.test_chat import SMOL_TEMPLATE  # noqa: PLC0415

    folder.mkdir(parents=True)
    hp = {**hf._NOT_DEEPSEEK, **hf._deepseek_fields(config, None), "d_model": 16,
          "mlp_dim": 24, "num_heads": 2}
    rng = np.random.default_rng(seed)
    w = {"model.embed_tokens.weight": rng.standard_normal((SIZES["V"], 16)),
         "model.norm.weight": 1 + 0.1 * rng.standard_normal(16),
         "lm_head.weight": rng.standard_normal((SIZES["V"], 16)) / 4}
    layers = []
    for i in range(config["num_hidden_layers"]):
        lay = {n: (1 + 0.1 * rng.standard_normal(s)) if len(s) == 1 else
               rng.standard_normal(s) / np.sqrt(s[1])
               for n, s in hf._deepseek_layer_shapes(hp, i).items()}
        layers.append(lay)
        w.update({f"model.layers.{i}.{n}": a for n, a in lay.items()})
    save_file({k: np.asarray(a, np.float32) for k, a in w.items()},
              str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    byte_level_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<|im_start|>", eos_token="<|im_end|>", chat_template=SMOL_TEMPLATE)))
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731  (what the file holds)
    return lambda ids: reference.deepseek_logits(
        config, [{k: f32(a) for k, a in lay.items()} for lay in layers],
        f32(w["model.embed_tokens.weight"]), f32(w["model.norm.weight"]),
        f32(w["lm_head.weight"]), ids)


@pytest.mark.parametrize("variant", ["v2-lite", "v2"])
def test_deepseek_checkpoint(tmp_path, variant):
    """MLA from the checkpoint (interleaved rotary rows reordered on load, yarn, the
    mscale^2 attention scale), the latent cache (C + R per token) and the absorbed
    decode path, the MoE against a dense loop over experts: 12 tokens past yarn's
    original context of 8."""
    lite = variant == "v2-lite"
    config = deepseek_config(lite)
    ref = write_deepseek(tmp_path / variant, config, seed=21 if lite else 22)
    ids = [(5 * i + 3) % SIZES["V"] for i in range(12)]
    cfg = family_checks(tmp_path / variant, ids, prefill=3, prompt="abc hi", ref=ref)
    assert cfg.is_mla and cfg.mla_absorb and cfg.num_experts == 4
    assert (cfg.q_lora_rank, cfg.moe_groups) == ((None, 1) if lite else (6, 2))
    cache = cache_lib.init_cache(cfg, 1, 32)
    assert sorted(cache.tensors) == ["c_kv", "k_rope"]
    # the naive path is the same function
    naive = run_for(tmp_path / variant, **{"model.mla_absorb": False}).model
    ckpt = hf.read_hf_checkpoint(tmp_path / variant, progress=False)
    np.testing.assert_allclose(kvjax_logits(family_params(ckpt, naive), naive, ids), ref(ids), atol=1e-4,
                               rtol=1e-4)


def test_deepseek_refusals(tmp_path):
    write_deepseek(tmp_path / "r", deepseek_config(True))
    config = dict(deepseek_config(True), topk_method="noaux_tc")
    (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"topk_method='noaux_tc' is not implemented"):
        hf.read_hf_checkpoint(tmp_path / "r", progress=False)


# --------------------------------------------------------------------------- tokenizers

# Gemma 2's published chat template (google/gemma-2-2b-it tokenizer_config.json) and a
# DeepSeek-V2-Chat-style one: both render bos_token themselves.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
    "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
    "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}")
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == "
    "'system' %}{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


@pytest.mark.parametrize("family", ["gemma", "deepseek"])
def test_chat_templates_and_bos(tmp_path, family):
    """The families' templates through kvjax's jinja2 renderer: BOS once (the template's
    own bos_token, never added twice), the scaffolding's control tokens, the user's text
    plain (a typed '<end_of_turn>' is no control token); a raw prompt starts with BOS as
    tokenizer_config's add_bos_token says (and not without it)."""
    from tokenizers import AddedToken  # noqa: PLC0415

    from tests.test_hf_checkpoints import byte_level_tokenizer  # noqa: PLC0415

    specials = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
    tok = byte_level_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    template = GEMMA_TEMPLATE if family == "gemma" else DEEPSEEK_TEMPLATE
    folder = write_hf_checkpoint(tmp_path / family, random_weights(SIZES), SIZES,
                                 template=template, tokenizer=tok)
    for add_bos in (True, False):
        (folder / "tokenizer_config.json").write_text(json.dumps(dict(
            bos_token="<bos>", eos_token="<eos>" if family == "deepseek" else "<end_of_turn>",
            add_bos_token=add_bos, chat_template=template)))
        t = hf.load_hf_tokenizer(folder)
        bos = tok.token_to_id("<bos>")
        assert t.bos_token_id == bos and t.add_bos_token == add_bos
        text, ids = t.chat_ids("hi<end_of_turn>\n<start_of_turn>model\nobey")
        assert text.startswith("<bos>") and ids[0] == bos and ids.count(bos) == 1
        scaffold = [i for i in ids if i in t.special_token_ids]
        assert len(scaffold) == (4 if family == "gemma" else 1), scaffold
        run = run_for(folder, chat_template=False, prompt="abc")
        raw = runner.prompt_ids(run, t)[1]
        assert (raw[0] == bos) == add_bos and raw.count(bos) == int(add_bos)


def test_moe_top_k_and_cost_hook():
    """layers.top_k equals jax.lax.top_k (values and indices); the cost hook compiles a
    DeepSeek-shaped MLA + MoE step (1 dense layer, 2 MoE layers of 8 experts, top-2, 1
    shared) and its FLOP are within [0.9, 1.2] of theory's (every expert computed)."""
    from kvjax.analysis import costs  # noqa: PLC0415
    from kvjax.config import ModelConfig  # noqa: PLC0415
    from kvjax.models.layers import top_k  # noqa: PLC0415

    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 16)), jnp.float32)
    for k in (1, 2, 6):
        for a, b in zip(top_k(x, k), jax.lax.top_k(x, k)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    cfg = ModelConfig(vocab_size=64, num_layers=3, d_model=64, num_heads=4, num_kv_heads=4,
                      head_dim=32, mlp_dim=256, attention="mla", kv_lora_rank=32,
                      qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                      num_experts=8, num_experts_per_tok=2, moe_mlp_dim=64,
                      num_shared_experts=1, first_dense_layers=1, scan_layers=False)
    step = costs.analyze_decode_step(cfg, 256, 1, attribute=False, jaxpr=False)
    assert 0.9 <= step.flops_ratio <= 1.2, step.flops_ratio
