"""Issue 32, items 7 and 8: every end-of-generation id of the checkpoint stops decoding (the
lockstep loop, the ragged loop, the engine, the runner and serve, which name the id), and
text cut at a token boundary never shows U+FFFD for a character the next token would
finish (generations hold the bytes back and say so; serve's corpus prompts are cut on
character boundaries).

The model here is built to a script: every layer's output projection is zero, so the
logits depend on the last token alone, and the untied head maps token A -> B -> C -> A
(and every other token -> A), where A, B, C are the three single-byte tokens of '日'
(E6 97 A5) in a byte-level BPE trained by ``tests.test_gguf_families``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax import cache as cache_lib
from kvjax.checkpoints import load_tokenizer, utf8
from kvjax.checkpoints.tokenizer import Tokenizer
from kvjax.config import ModelConfig, RunConfig
from kvjax.inference import decode, engine, ragged, runner
from kvjax.models import model
from tests.conftest import import_entry_point
from tests.test_gguf_families import trained_tokenizer_json, write_tokenizer_gguf

serve = import_entry_point("serve")

S = 32
NI = "日".encode()  # E6 97 A5


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "smollm.gguf"
    write_tokenizer_gguf(path, trained_tokenizer_json("smollm"), "smollm")
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def cycle(tok):
    """(cfg, params, (A, B, C)): greedy decoding after any token but A, B emits A, B, C,
    A, B, C, ..."""
    table = utf8.byte_decoder()
    inverse = {b: c for c, b in table.items()}
    a, b, c = (tok.hf.token_to_id(inverse[x]) for x in NI)
    assert [tok.token_bytes(i) for i in (a, b, c)] == [NI[:1], NI[1:2], NI[2:]]
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=1, d_model=8, num_heads=2,
                      num_kv_heads=1, head_dim=4, mlp_dim=8, tie_embeddings=False)
    p = model.init_params(cfg, jax.random.key(0))
    p = jax.tree.map(np.array, p)
    p["layers"]["attn"]["o_proj"]["kernel"][...] = 0
    p["layers"]["mlp"]["down"]["kernel"][...] = 0
    emb = np.zeros((cfg.vocab_size, cfg.d_model), np.float32)
    emb[:, 0] = 1  # every other token: state 0 -> A
    emb[a] = np.eye(cfg.d_model)[1]
    emb[b] = np.eye(cfg.d_model)[2]
    emb[c] = np.eye(cfg.d_model)[0]
    head = np.zeros((cfg.d_model, cfg.vocab_size), np.float32)
    head[0, a] = head[1, b] = head[2, c] = 1
    p["embed"]["embedding"] = emb
    p["lm_head"] = {"kernel": head}
    p["final_norm"]["scale"][...] = 1
    params = jax.tree.map(jnp.asarray, model.params_for(cfg, p))
    return cfg, params, (a, b, c)


def first_and_cache(cfg, params, prompts):
    tokens, lengths = ragged.pad_prompts(prompts)
    cache = cache_lib.init_cache(cfg, len(prompts), S, ragged=True)
    logits, cache = ragged.prefill_ragged(params, cfg, tokens, lengths, cache)
    return jnp.argmax(logits, -1).astype(jnp.int32), cache


# ---------------------------------------------------------------------------
# item 8: every end-of-generation id stops


def test_the_scripted_model_cycles(cycle, tok):
    cfg, params, (a, b, c) = cycle
    first, cache = first_and_cache(cfg, params, [tok.encode("x"), [a]])
    toks, _, _ = ragged.generate_ragged(params, cfg, first, cache, [5, 5], eos_ids=(-1, -1))
    assert [int(first[0])] + toks[0].tolist() == [a, b, c, a, b, c]
    assert [int(first[1])] + toks[1].tolist() == [b, c, a, b, c, a]


def test_lockstep_loop_stops_at_each_id(cycle, tok):
    """Two rows, one stopping at B and one at C, in one call with eos_ids (B, C); one
    compiled loop serves any ids of the same count."""
    cfg, params, (a, b, c) = cycle
    tokens = jnp.asarray([[0, a], [0, b]], jnp.int32)  # rows continue with B, C
    cache = cache_lib.init_cache(cfg, 2, S)
    logits, cache = decode.prefill(params, cfg, tokens, cache)
    first = jnp.argmax(logits, -1).astype(jnp.int32)
    assert first.tolist() == [b, c]
    toks, steps, _ = decode.generate(params, cfg, first, cache, 6, eos_ids=(c, a))
    # row 1 stopped at its first token (C); row 0 emits C and stops: one step
    assert steps == 1 and toks[:, :1].tolist() == [[c], [-1]]
    compiled = decode.generate_program._cache_size()
    cache = cache_lib.init_cache(cfg, 2, S)
    _, cache = decode.prefill(params, cfg, tokens, cache)
    toks, steps, _ = decode.generate(params, cfg, first, cache, 6, eos_ids=(a, b))
    assert steps == 1 and toks[:, :1].tolist() == [[-1], [a]]
    assert decode.generate_program._cache_size() == compiled  # the same program


def test_ragged_loop_stops_at_each_id(cycle, tok):
    cfg, params, (a, b, c) = cycle
    first, cache = first_and_cache(cfg, params, [tok.encode("x"), [a]])  # A then B first
    toks, counts, _ = ragged.generate_ragged(params, cfg, first, cache, [5, 5],
                                             eos_ids=(c, -1))
    assert counts.tolist() == [2, 1]
    assert toks[0, :3].tolist() == [b, c, -1] and toks[1, :2].tolist() == [c, -1]


def test_engine_stops_at_each_id_and_names_it(cycle, tok):
    cfg, params, (a, b, c) = cycle
    reqs = [engine.Request(0, tuple(tok.encode("x")), 8), engine.Request(1, (a,), 8),
            engine.Request(2, (b,), 8), engine.Request(3, (c,), 1)]
    done, _ = engine.Engine(params, cfg, 2, S, eos_ids=(b, c), steps_per_sync=2).run(reqs)
    # request 0: A, B (stops at B in the loop); 1: B, 2: C at once (their prefills);
    # 3: A, its budget of one token
    assert [x.tokens for x in done] == [[a, b], [b], [c], [a]]
    assert [x.stop for x in done] == ["eos"] * 3 + ["budget"]
    assert [x.stop_token for x in done] == [b, b, c, None]


def with_eos(tok, ids):
    return Tokenizer(tok.hf, tok.bos_token_id, tok.eos_token_id, tok.special_token_ids,
                     tok.chat_template, eos_token_ids=ids)


def test_runner_stops_at_any_id_and_says_which(cycle, tok):
    cfg, params, (a, b, c) = cycle
    run = RunConfig(model=cfg, prompt="x", max_new_tokens=8, max_seq_len=S,
                    chat_template=False, ignore_memory_check=True)
    gen = runner.generate(run, runner.LoadedModel(cfg, params, with_eos(tok, (c, b))))
    assert gen.stop_reason == "eos" and gen.stop_token == b and gen.generated_ids == [a]
    assert gen.stop_token_text == tok.id_to_token(b)
    gen = runner.generate(dataclasses.replace(run, stop_at_eos=False),
                               runner.LoadedModel(cfg, params, with_eos(tok, (c, b))))
    assert gen.stop_reason == "budget" and gen.stop_token is None
    assert gen.generated_ids == [a, b, c] * 2 + [a, b]


def test_serve_json_names_the_stop(cycle, tok):
    cfg, params, (a, b, c) = cycle
    done = [engine.Completion(0, 1, [a, b, c, a, b, c], "eos", 0, 0.1, 0.2, stop_token=c),
            engine.Completion(1, 1, [a, b, c, a], "budget", 1, 0.1, 0.2)]
    j = [serve.completion_json(x, tok) for x in done]
    assert (j[0]["stop"], j[0]["stop_token"], j[0]["text"], j[0]["held_back_bytes"]) == \
        ("eos", c, "日", 2)  # the stop token C is named, not part of the text
    assert (j[1]["stop"], j[1]["stop_token"], j[1]["text"], j[1]["held_back_bytes"]) == \
        ("budget", None, "日", 1)
    stats = engine.EngineStats(num_slots=2)
    s = serve.summarize(done, stats)
    assert s["stops"] == {"eos": 1, "budget": 1, "nonfinite": 0}
    assert s["stop_tokens"] == {str(c): 1}


# ---------------------------------------------------------------------------
# item 7: no U+FFFD at a token boundary


def test_decode_complete_holds_back_an_unfinished_character(tok):
    text = "日本語のテキスト 🙂👍🏽 👨‍👩‍👧 Привет"
    ids = tok.encode(text)
    broken = 0
    for n in range(1, len(ids) + 1):
        got, held = tok.decode_complete(ids[:n])
        data = b"".join(tok.token_bytes(i) for i in ids[:n])
        assert "\ufffd" not in got, n
        assert got.encode() + data[len(data) - held:] == data, n
        broken += "\ufffd" in tok.decode(ids[:n])
    assert broken  # plain decoding shows U+FFFD at some of these cuts
    assert tok.decode_complete(ids) == (text, 0)


def test_runner_holds_back_and_says_so(cycle, tok):
    cfg, params, _ = cycle
    run = RunConfig(model=cfg, prompt="x", max_new_tokens=4, max_seq_len=S,
                    chat_template=False, stop_at_eos=False, ignore_memory_check=True)
    gen = runner.generate(run, runner.LoadedModel(cfg, params, tok))
    assert gen.new_tokens == 4 and gen.generated_text == "日"  # A B C A: E6 held back
    assert gen.held_back_bytes == 1 and any("held back" in w for w in gen.warnings)
    assert tok.decode(gen.generated_ids) == "日\ufffd"  # what it printed before


def test_serve_corpus_prompts_start_and_end_on_characters(tok):
    text = "東京は日本の首都です。北京是中国的首都。🙂👍🏽 Москва 한국어 문장입니다. " * 20
    stream = np.asarray(tok.encode(text), np.int32)
    assert not tok.character_starts.all()
    reqs = serve.corpus_requests(tok, 40, 0, 8, 4, 24, 2, 4, stream=stream)
    assert len(reqs) == 40
    for r in reqs:
        assert "\ufffd" not in tok.decode(list(r.prompt)), r
        assert 4 <= len(r.prompt) <= 24
    # cut as before (at any token), some of these prompts start or end inside a character
    rng = np.random.default_rng(0)
    raw = [tok.decode(stream[s:s + 8].tolist())
           for s in rng.integers(0, len(stream) - 24, 40)]
    assert any("\ufffd" in p for p in raw)
