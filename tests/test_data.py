"""Corpus loading, the held-out split, token windows and batches."""

import subprocess

import numpy as np
import pytest

from kvjax.training import data


@pytest.fixture
def folder(tmp_path):
    for i in range(40):
        sub = tmp_path / ("a" if i % 2 else "b")
        sub.mkdir(exist_ok=True)
        (sub / f"doc{i}.txt").write_text(f"Document {i}. " + "word " * (i + 5))
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n")  # not text: skipped
    return tmp_path


def test_folder_loader_reads_text_files_by_relative_path(folder):
    docs = data.load_documents(folder)
    assert len(docs) == 40
    assert [d.name for d in docs] == sorted(d.name for d in docs)
    assert docs[0].name == "a/doc1.txt" and docs[0].text.startswith("Document 1.")


def test_split_is_deterministic_disjoint_and_stable(folder):
    docs = data.load_documents(folder)
    train, held = data.split_documents(docs, 0.25)
    train2, held2 = data.split_documents(list(reversed(docs)), 0.25)
    assert [d.name for d in held] == [d.name for d in held2]
    assert [d.name for d in train] == [d.name for d in train2]
    names_t, names_h = {d.name for d in train}, {d.name for d in held}
    assert not names_t & names_h
    assert names_t | names_h == {d.name for d in docs}
    assert 0 < len(held) < len(docs)
    # A document's side depends on its name alone: dropping others moves nothing.
    _, held3 = data.split_documents(docs[::2], 0.25)
    assert {d.name for d in held3} == names_h & {d.name for d in docs[::2]}


def test_single_file_is_cut_into_paragraph_documents(tmp_path):
    p = tmp_path / "book.txt"
    p.write_text("\n\n".join(f"Paragraph {i}. " + "text " * 200 for i in range(20)))
    docs = data.load_documents(p)
    assert len(docs) > 3 and docs[0].name == "book.txt#0"
    assert "\n\n".join(d.text for d in docs) == p.read_text()


def test_missing_source_and_bad_fraction_raise(tmp_path, folder):
    with pytest.raises(data.CorpusError, match="no such file or folder"):
        data.load_documents(tmp_path / "nope")
    with pytest.raises(ValueError, match="heldout_fraction"):
        data.split_documents(data.load_documents(folder), 1.5)


def test_eval_windows_and_batches():
    stream = np.arange(1000, dtype=np.int32)
    w = data.eval_windows(stream, 100, 450)
    assert w.shape == (4, 100) and w[1, 0] == 100
    with pytest.raises(ValueError, match="the held-out split has 1,000"):
        data.eval_windows(stream, 100, 2000)
    b1 = data.batch_at(stream, 7, 3, 16, seed=1)
    assert b1.shape == (3, 17)
    np.testing.assert_array_equal(b1, data.batch_at(stream, 7, 3, 16, seed=1))
    assert not np.array_equal(b1, data.batch_at(stream, 8, 3, 16, seed=1))
    np.testing.assert_array_equal(np.diff(b1, axis=1), 1)  # contiguous windows


def test_unreachable_index_gives_manual_instructions(tmp_path, monkeypatch):
    def fail(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")
    monkeypatch.setattr(data.subprocess, "run", fail)
    with pytest.raises(data.CorpusError) as e:
        data.corpus_path(tmp_path)
    msg = str(e.value)
    assert "pip download --no-deps --no-binary=:all: Django==4.2.16" in msg
    assert data.SDIST_SHA256 in msg and "No matching distribution" in msg


@pytest.mark.slow
def test_default_corpus_is_fetched_verified_and_split(smollm2):
    """Needs PyPI (or the cached archive) and the real tokenizer."""
    path = data.corpus_path()
    assert data.sha256_file(path) == data.SDIST_SHA256
    docs = data.load_documents()
    assert len(docs) == 586
    assert all(d.name.endswith(".txt") for d in docs)
    train, held = data.split_documents(docs, 0.1)
    assert (len(train), len(held)) == (526, 60)
    tok = smollm2[0].tokenizer
    ids = data.token_stream(held[:3], tok)
    assert (ids == data.separator_id(tok)).sum() == 3 and data.separator_id(tok) == 0
    lengths = data.token_byte_lengths(tok)
    text = "".join(d.text for d in held[:3]).encode("utf-8")
    assert lengths[ids].sum() == len(text)  # the separators are not text: 0 bytes
