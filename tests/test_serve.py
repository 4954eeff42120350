"""experiments/serve.py's request sources: a JSONL file with malformed lines (each named
by its line; the others still run) and requests too long for the cache (named)."""

import json

import numpy as np

import pytest

from tests.conftest import import_entry_point

serve = import_entry_point("serve")
from kvjax.config import ModelConfig
from kvjax.inference import engine
from tests.test_ragged import VARIANTS, params_of


class CharTokenizer:
    """One id per character (id = ord % 97): enough to exercise the parsing."""

    def encode(self, text):
        return [ord(c) % 97 for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_requests_file_malformed_lines_named(tmp_path):
    path = tmp_path / "reqs.jsonl"
    lines = [json.dumps({"prompt": "hello", "max_new_tokens": 3}),
             "{not json",
             json.dumps({"prompt": "", "max_new_tokens": 2}),
             "",
             json.dumps({"prompt": "abc", "max_new_tokens": 0}),
             json.dumps({"text": "abc", "max_new_tokens": 2}),
             json.dumps({"prompt": "x" * 40, "max_new_tokens": 4}),
             json.dumps({"prompt": "bye", "max_new_tokens": 2})]
    path.write_text("\n".join(lines) + "\n")
    reqs, skipped = serve.file_requests(str(path), CharTokenizer())
    assert [r.id for r in reqs] == [1, 7, 8]
    assert [s.where for s in skipped] == [f"{path}:{n}" for n in (2, 3, 5, 6)]
    assert "not JSON" in skipped[0].reason and "empty prompt" in skipped[1].reason
    assert "max_new_tokens=0" in skipped[2].reason and '"prompt"' in skipped[3].reason
    # Line 7's 40-token prompt does not fit a 32-slot cache: named, the others run.
    cfg = ModelConfig(**VARIANTS["gqa"])
    eng = engine.Engine(params_of("gqa"), cfg, num_slots=2, max_seq_len=32)
    ok, more = serve.screen(eng, reqs)
    assert [r.id for r in ok] == [1, 8]
    assert more[0].where == "request 7" and "request 7 (40 prompt tokens" in more[0].reason
    done, stats = eng.run(ok)
    assert [len(c.tokens) for c in done] == [3, 2] and stats.tokens == 5


def test_percentiles_and_bounds():
    assert serve.percentiles([1.0, 2.0, 3.0])["p50"] == 2.0
    with pytest.raises(ValueError, match="new_min=5, new_max=2"):
        serve.corpus_requests(CharTokenizer(), 2, 0, 8, 4, 16, 5, 2, stream=list(range(99)))
    reqs = serve.corpus_requests(CharTokenizer(), 5, 0, 8, 4, 16, 2, 6,
                                 stream=list(range(1000)))
    assert len(reqs) == 5 and all(4 <= len(r.prompt) <= 16 for r in reqs)
    assert all(2 <= r.max_new_tokens <= 6 for r in reqs)
    # Seeded: the same draw twice.
    again = serve.corpus_requests(CharTokenizer(), 5, 0, 8, 4, 16, 2, 6,
                                  stream=list(range(1000)))
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_poisson_arrivals_are_seeded_with_the_asked_rate():
    reqs = [engine.Request(i, (1,), 2) for i in range(4000)]
    a = [r.arrival_s for r in serve.poisson_arrivals(reqs, 20.0, seed=5)]
    assert a == [r.arrival_s for r in serve.poisson_arrivals(reqs, 20.0, seed=5)]
    gaps = np.diff([0.0] + a)
    assert (gaps > 0).all()
    # exponential gaps of mean 1/rate: mean and coefficient of variation 1, within
    # 5 standard errors of 4,000 draws
    assert abs(gaps.mean() * 20.0 - 1) < 5 / np.sqrt(4000)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1
    assert all(r.arrival_s == 0 for r in serve.poisson_arrivals(reqs[:3], 0.0, seed=5))
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="--arrival_rate="):
            serve.poisson_arrivals(reqs, bad, seed=0)
