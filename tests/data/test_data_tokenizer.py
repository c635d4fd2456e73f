"""Byte-level BPE tokenizer: exact vocab size, lossless round trip, on-disk cache."""

import os

import pytest

from v41jax.data import tokenizer as tokenizer_module
from v41jax.data.corpus import load_documents
from v41jax.data.tokenizer import (
    EOS_TOKEN,
    Tokenizer,
    load_or_train_tokenizer,
    train_tokenizer,
)

VOCAB = 512


@pytest.fixture(scope="module")
def texts():
    return [d.text for d in load_documents([])[:6]]


@pytest.fixture(scope="module")
def tok(texts):
    return train_tokenizer(texts, VOCAB)


def test_vocab_and_special_token(tok):
    assert tok.vocab_size == VOCAB
    assert tok.eos_id == 0 and tok.id_to_token(0) == EOS_TOKEN
    assert tok.id_to_token(VOCAB - 1)
    with pytest.raises(ValueError, match=rf"token id {VOCAB} out of range"):
        tok.id_to_token(VOCAB)
    with pytest.raises(ValueError, match=r"out of range"):
        tok.decode([VOCAB])


@pytest.mark.parametrize(
    "text",
    [
        "Fellow-Citizens of the Senate and House of Representatives:",
        "  leading and trailing spaces  ",
        "tabs\tand\r\nCRLF\n\n\nnewlines",
        "Ünïcödé, 中文, Ελληνικά, עִבְרִית, emoji 😀👩‍👩‍👧 and 🇺🇸",
        "combining e\u0301 vs \u00e9, ligature \ufb01, NBSP\u00a0here",
        "a literal <|endoftext|> stays text",
        "",
    ],
)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids)
    assert tok.decode(ids) == text


def test_literal_special_token_is_not_eos(tok):
    assert tok.eos_id not in tok.encode("x <|endoftext|> y")


def test_encode_batch_matches_encode(tok, texts):
    samples = [t[:500] for t in texts[:3]]
    assert tok.encode_batch(samples) == [tok.encode(t) for t in samples]
    assert len(tok.encode(texts[0])) < len(texts[0]) / 2  # it really compresses English


def test_save_load(tok, tmp_path):
    path = str(tmp_path / "tok.json")
    tok.save(path)
    loaded = Tokenizer.load(path)
    assert loaded.content_hash == tok.content_hash and loaded.vocab_size == VOCAB
    text = "Literal <|endoftext|> survives a reload"
    assert loaded.encode(text) == tok.encode(text) and loaded.decode(tok.encode(text)) == text


def test_cache_hit_does_not_retrain(texts, tmp_path, monkeypatch):
    first = load_or_train_tokenizer(texts, VOCAB, str(tmp_path))
    files = os.listdir(tmp_path)
    assert len(files) == 1 and files[0].startswith("tokenizer-") and files[0].endswith(".json")
    assert files[0] == f"tokenizer-{tokenizer_module.tokenizer_cache_key(texts, VOCAB)}.json"

    def no_training(*args, **kwargs):
        raise AssertionError("retrained despite a cached tokenizer")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    second = load_or_train_tokenizer(texts, VOCAB, str(tmp_path))
    assert second.content_hash == first.content_hash
    # Other texts or another vocab size are a different cache entry.
    with pytest.raises(AssertionError, match="retrained"):
        load_or_train_tokenizer(texts[:-1], VOCAB, str(tmp_path))
    with pytest.raises(AssertionError, match="retrained"):
        load_or_train_tokenizer(texts, VOCAB + 1, str(tmp_path))


def test_cache_key_is_unambiguous():
    key = tokenizer_module.tokenizer_cache_key
    assert key(["ab", "c"], 300) != key(["a", "bc"], 300)
    assert key(["ab"], 300) != key(["ab"], 301)
    assert len(key(["ab"], 300)) == 16


def test_errors(texts):
    with pytest.raises(ValueError, match=r"vocab_size=100 is too small.*at least 257"):
        train_tokenizer(texts, 100)
    with pytest.raises(ValueError, match=r"yields a vocabulary of \d+ tokens.*vocab_size=4096"):
        train_tokenizer(["a tiny corpus", "of two texts"], 4096)
    with pytest.raises(ValueError, match=r"empty text"):
        train_tokenizer(["", ""], 300)
    with pytest.raises(FileNotFoundError, match=r"missing.json' does not exist"):
        Tokenizer.load("missing.json")
