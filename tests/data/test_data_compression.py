"""Tokenizer compression (Engram): canonical ids for case/accent/space variants."""

import numpy as np
import pytest

from v41jax.data.compression import (
    CompressionTable,
    build_compression_table,
    compress_ids,
    normalize_token_text,
)
from v41jax.data.corpus import load_documents
from v41jax.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def sotu_texts():
    return [d.text for d in load_documents([])]


@pytest.fixture(scope="module")
def tok(sotu_texts):
    return train_tokenizer(sotu_texts[:8], 1024)


@pytest.fixture(scope="module")
def table(tok):
    return build_compression_table(tok)


@pytest.mark.parametrize(
    "text, want",
    [
        (" ", " "),
        ("\n\n", " "),
        ("\t \r\n", " "),
        ("  Hello ", "hello"),
        ("Café", "cafe"),
        ("e\u0301", "e"),
        ("\ufb01", "fi"),  # NFKC ligature
        ("Ⅻ", "xii"),
        ("ÀB\u00a0C", "ab c"),  # NBSP -> space by NFKC, then kept as an inner space
        ("x\n\ny", "x y"),
    ],
)
def test_normalize_token_text(text, want):
    assert normalize_token_text(text) == want == _handwritten_normalize(text)


def _handwritten_normalize(text):
    """The plain-Python normalisation v41jax used before the `tokenizers` pipeline (and an
    independent check of it): unicodedata NFKC, NFD, drop Mn marks, lower, collapse runs of
    space/tab/CR/LF, strip unless exactly " "."""
    import re
    import unicodedata

    text = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    text = "".join(c for c in text if unicodedata.category(c) != "Mn").lower()
    text = re.sub(r"[ \t\r\n]+", " ", text)
    return text if text == " " else text.strip()


def _reference_table(tok):
    key_to_id, out = {}, []
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        key = tok.id_to_token(i) if "\ufffd" in text else (_handwritten_normalize(text) or text)
        out.append(key_to_id.setdefault(key, len(key_to_id)))
    return np.array(out, np.int32), len(key_to_id)


def test_sanity(tok, table):
    v, vc = tok.vocab_size, table.compressed_vocab_size
    assert table.table.shape == (v,) and table.table.dtype == np.int32
    assert vc < v and table.vocab_size == v
    assert table.table.min() == 0 and table.table.max() == vc - 1
    assert len(np.unique(table.table)) == vc
    # First-seen order: each id is at most one above every id before it.
    prev_max = np.concatenate([[-1], np.maximum.accumulate(table.table)[:-1]])
    assert np.all(table.table <= prev_max + 1)
    assert table.table[0] == 0  # the pad/eos id is mapped like any other


def test_case_and_space_variants_merge(tok, table):
    vocab = tok.backend.get_vocab()
    pairs = [("ĠThe", "Ġthe"), ("The", "the"), ("ĠThe", "the")]
    present = [(a, b) for a, b in pairs if a in vocab and b in vocab]
    assert present, "expected 'The'/'the' style tokens in a 1024-token English vocab"
    for a, b in present:
        assert table.table[vocab[a]] == table.table[vocab[b]], (a, b)


def test_partial_utf8_tokens_stay_distinct(tok, table):
    # Lone bytes >= 0x80 decode to U+FFFD; their raw token strings keep them apart.
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 128
    assert len(set(table.table[partial].tolist())) == len(partial)


def test_matches_reference_normalizer_sequence(tok, table):
    ref, ref_size = _reference_table(tok)
    assert ref_size == table.compressed_vocab_size
    np.testing.assert_array_equal(ref, table.table)


def test_compress_ids(table):
    ids = np.array([[0, 5, -1], [table.vocab_size - 1, -7, 3]], dtype=np.int64)
    out = compress_ids(ids, table)
    assert out.dtype == np.int32 and out.shape == ids.shape
    assert out[0, 2] == -1 and out[1, 1] == -7  # negatives pass through
    assert out[0, 1] == table.table[5] and out[1, 0] == table.table[-1]
    assert compress_ids(np.zeros((0,), np.int32), table).shape == (0,)
    with pytest.raises(ValueError, match=rf"token id {table.vocab_size + 3} out of range"):
        compress_ids(np.array([1, table.vocab_size + 3]), table)
    with pytest.raises(TypeError, match=r"must be integers"):
        compress_ids(np.array([1.0]), table)


def test_save_load(table, tmp_path):
    path = str(tmp_path / "compression.npz")
    table.save(path)
    loaded = CompressionTable.load(path)
    assert loaded.compressed_vocab_size == table.compressed_vocab_size
    np.testing.assert_array_equal(loaded.table, table.table)


def test_invalid_table():
    with pytest.raises(ValueError, match=r"outside \[0, compressed_vocab_size=2\)"):
        CompressionTable(np.array([0, 1, 2], np.int32), 2)
    with pytest.raises(ValueError, match=r"must be int32"):
        CompressionTable(np.array([0, 1], np.int64), 2)


def test_full_sotu_4096_reduction(sotu_texts):
    tok = train_tokenizer(sotu_texts, 4096)
    table = build_compression_table(tok)
    ref, ref_size = _reference_table(tok)
    np.testing.assert_array_equal(ref, table.table)
    reduction = 1 - table.compressed_vocab_size / tok.vocab_size
    print(f"sotu 4096: compressed vocab {table.compressed_vocab_size} ({reduction:.1%} fewer)")
    assert table.compressed_vocab_size < 0.95 * tok.vocab_size


def _sentencepiece_style(texts):
    """A SentencePiece-style tokenizer (Metaspace "▁" word boundaries, byte fallback, eos
    "</s>"), trained here with `tokenizers` as Llama/Mistral-style tokenizers are built."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from v41jax.data.tokenizer import Tokenizer

    tok = tokenizers.Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Metaspace(), decoders.ByteFallback(),
                                     decoders.Fuse()])  # fmt: skip
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eos_token="</s>")


def test_a_sentencepiece_style_tokenizer_compresses_too(sotu_texts):
    tok = _sentencepiece_style(sotu_texts[:8])
    assert tok.eos_id == 2
    table = build_compression_table(tok)
    ref, ref_size = _reference_table(tok)
    np.testing.assert_array_equal(ref, table.table)
    assert ref_size == table.compressed_vocab_size < 0.97 * tok.vocab_size
    ids = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    pairs = [(w, w.lower()) for w in ("▁The", "▁And", "▁We") if w in ids and w.lower() in ids]
    assert pairs
    for a, b in pairs:  # "▁The" and "▁the" are one canonical id
        assert table.table[ids[a]] == table.table[ids[b]]
    fallback = [ids[f"<0x{b:02X}>"] for b in range(0x80, 0x100)]  # lone bytes stay apart
    assert len(set(table.table[fallback].tolist())) == len(fallback)


def test_a_byte_level_tokenizer_of_another_vocabulary(sotu_texts):
    """Byte-level BPE as GPT-2 / Llama-3 / Qwen build it ("Ġ" spaces), a larger vocabulary."""
    tok = train_tokenizer(sotu_texts[8:20], 2048)
    table = build_compression_table(tok)
    ref, ref_size = _reference_table(tok)
    np.testing.assert_array_equal(ref, table.table)
    ids = {tok.id_to_token(i): i for i in range(tok.vocab_size)}
    assert table.table[ids["ĠThe"]] == table.table[ids["Ġthe"]]
    assert table.compressed_vocab_size < 0.95 * tok.vocab_size


def test_a_foreign_tokenizer_keeps_its_eos_through_save_and_load(sotu_texts, tmp_path):
    """Saved as Hugging Face does it: tokenizer.json + tokenizer_config.json naming the eos."""
    import json

    from v41jax.data.tokenizer import Tokenizer

    tok = _sentencepiece_style(sotu_texts[:2])
    path = str(tmp_path / "tokenizer.json")
    tok.save(path)
    with open(tmp_path / "tokenizer_config.json") as f:
        assert json.load(f) == {"eos_token": "</s>"}
    again = Tokenizer.load(path)
    assert again.eos_id == tok.eos_id == 2 and again.content_hash == tok.content_hash
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert Tokenizer.load(path).eos_id == 1  # HF's AddedToken form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|none|>"}))
    with pytest.raises(ValueError, match="<\\|none\\|>"):
        Tokenizer.load(path)
