"""The checkpoint's chat template: rendering, the config switch, and the warning for a
generation that stops with no new token."""

import dataclasses

import pytest

from kvjax.checkpoints import read_llama_hparams
from kvjax.checkpoints.tokenizer import (DEFAULT_SYSTEM_PROMPT, Tokenizer,
                                         chatml_default_system, is_chatml)
from kvjax.config import ConfigError, ModelConfig, RunConfig
from kvjax.inference import runner
from tests.test_checkpoints import write_tiny_gguf

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")  # SmolLM2-135M-Instruct's GGUF, verbatim


class FakeTok:
    """Only what rendering needs: the template string, and bytes as token ids."""

    template_tokens = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    add_bos_token = False
    bos_token_id = 1

    def __init__(self, template):
        self.chat_template = template

    def encode(self, text, special=False):
        return list(text.encode("utf-8"))

    chat_prompt = Tokenizer.chat_prompt
    chat_ids = Tokenizer.chat_ids
    chat_messages = Tokenizer.chat_messages
    _template = Tokenizer._template


def tiny_run(**kw):
    cfg = ModelConfig(vocab_size=40, num_layers=1, d_model=8, num_heads=2, num_kv_heads=1,
                      head_dim=4, mlp_dim=8)
    return RunConfig(model=cfg, **kw)


def test_chatml_rendering_matches_the_template():
    assert is_chatml(SMOL_TEMPLATE) and chatml_default_system(SMOL_TEMPLATE) == DEFAULT_SYSTEM_PROMPT
    tok = FakeTok(SMOL_TEMPLATE)
    assert tok.chat_prompt("What is the capital of France?") == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert tok.chat_prompt("Hi", "Be brief.") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n")


@pytest.mark.parametrize("system", [None, "Be brief.", ""])
def test_chatml_rendering_equals_jinja(system):
    """Against the template rendered by Jinja (as Hugging Face does), where installed."""
    sandbox = pytest.importorskip("jinja2.sandbox")
    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    msgs = ([] if system is None else [dict(role="system", content=system)]) + [
        dict(role="user", content="Two\nlines")]
    ref = env.from_string(SMOL_TEMPLATE).render(messages=msgs, add_generation_prompt=True)
    assert FakeTok(SMOL_TEMPLATE).chat_prompt("Two\nlines", system) == ref


def test_switch_and_errors(tmp_path):
    smol = FakeTok(SMOL_TEMPLATE)
    other = FakeTok("{{ raise_exception('Conversation roles must alternate') }}")
    raw = "The capital of France is"
    # None (default): on for pretrained weights with a template, off for random weights
    assert runner.uses_chat_template(tiny_run(prompt=raw), smol)
    assert not runner.uses_chat_template(tiny_run(prompt=raw, weights="random"), smol)
    assert not runner.uses_chat_template(tiny_run(prompt=raw), FakeTok(None))
    assert runner.render_prompt(tiny_run(prompt=raw, chat_template=False), smol) == raw
    assert runner.render_prompt(tiny_run(prompt=raw, system_prompt="S"), smol).startswith(
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nThe capital")
    f = tmp_path / "system.txt"
    f.write_text("From a file.")
    assert "system\nFrom a file.<|im_end|>" in runner.render_prompt(
        tiny_run(prompt=raw, system_prompt_file=str(f)), smol)
    with pytest.raises(ConfigError, match="chat_template=True: the chat template fails on "
                                          "these messages: TemplateError: Conversation "
                                          "roles must alternate"):
        runner.render_prompt(tiny_run(prompt=raw, chat_template=True), other)
    with pytest.raises(ConfigError, match="chat_template=True: the checkpoint carries no "
                                          "chat template"):
        runner.render_prompt(tiny_run(prompt=raw, chat_template=True), FakeTok(None))
    with pytest.raises(ConfigError, match="chat_template=False; allowed: True or None when a "
                                          "system prompt is given"):
        tiny_run(chat_template=False, system_prompt="S")
    with pytest.raises(ConfigError, match="system_prompt_file='/nonexistent'"):
        tiny_run(system_prompt_file="/nonexistent")


def test_checkpoint_whose_template_fails_refuses_chat_template_true(tmp_path):
    """The tiny GGUF's template reads an undefined ``message``: chat_template=True is
    refused from the metadata (a trial rendering in jinja2), before loading."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    model = ModelConfig(vocab_size=40, num_layers=2, d_model=8, num_heads=4, num_kv_heads=2,
                        head_dim=2, mlp_dim=12, rope_theta=1e4)
    hp = read_llama_hparams(path)
    runner.check_checkpoint(RunConfig(model=model, max_seq_len=32), hp)  # auto: fine
    with pytest.raises(ConfigError, match="chat_template=True but the chat template fails "
                                          "on these messages: UndefinedError: 'message' is "
                                          "undefined"):
        runner.check_checkpoint(RunConfig(model=model, max_seq_len=32, chat_template=True), hp)


@pytest.mark.slow
def test_zero_new_tokens_warns(smollm2):
    """Raw text to the chat model: its first greedy token is <|im_end|> (0 new tokens)."""
    loaded, run = smollm2
    raw = dataclasses.replace(run, prompt="What is the capital of France?",
                              chat_template=False, max_new_tokens=4, max_seq_len=32)
    with pytest.warns(RuntimeWarning, match="stopped with 0 new tokens: the first token "
                                            r"sampled was end-of-sequence \('<\|im_end\|>', "
                                            r"id 2\); a chat model given raw text"):
        result = runner.decode_prompt(raw, loaded)  # the generation (no cost report)
    assert result.new_tokens == 0 and result.warnings
