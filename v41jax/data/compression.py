"""Tokenizer compression for Engram n-gram hashing (arXiv 2601.07372).

Tokens that differ only in case, accents, Unicode compatibility form or surrounding whitespace
("ĠThe", "the", "THE") get one canonical id, so the hashed n-gram tables see fewer distinct
n-grams (Cheng et al., arXiv 2601.07372). The normalisation is the public Engram demo's
`tokenizers.normalizers` sequence; it works for any tokenizer `Tokenizer` wraps (byte-level
BPE, SentencePiece-style Metaspace): a token's key is the normalised text it decodes to.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tokenizers import Regex, normalizers

from v41jax.data.corpus import atomic_write
from v41jax.data.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class CompressionTable:
    """`table`: int32 [V], original token id -> canonical id in [0, compressed_vocab_size)."""

    table: np.ndarray
    compressed_vocab_size: int

    def __post_init__(self):
        t = self.table
        if t.ndim != 1 or t.dtype != np.int32:
            raise ValueError(f"table must be int32 [V], got {t.dtype} {t.shape}")
        if t.size and (t.min() < 0 or t.max() >= self.compressed_vocab_size):
            raise ValueError(
                f"table values [{t.min()}, {t.max()}] outside "
                f"[0, compressed_vocab_size={self.compressed_vocab_size})"
            )

    @property
    def vocab_size(self) -> int:
        """V, the original tokenizer's vocabulary size."""
        return int(self.table.shape[0])

    def save(self, path: str) -> None:
        """Write an .npz (atomically) with `table` and `compressed_vocab_size`."""

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, table=self.table, compressed_vocab_size=self.compressed_vocab_size)

        atomic_write(path, write)

    @classmethod
    def load(cls, path: str) -> CompressionTable:
        with np.load(path) as f:
            return cls(f["table"].astype(np.int32), int(f["compressed_vocab_size"]))


# The Engram demo's normaliser pipeline, from `tokenizers` itself: NFKC, NFD, strip accents,
# lowercase, collapse space/tab/CR/LF runs to one space; then Strip, except that a text that
# is exactly " " stays " " (the demo keeps the space token apart from the empty string).
_NORMALIZER = normalizers.Sequence(
    [
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    ]
)
_STRIP = normalizers.Strip()


def normalize_token_text(text: str) -> str:
    """The Engram demo's normalisation of one token's text (`_NORMALIZER`, then Strip unless
    the text is exactly " ")."""
    text = _NORMALIZER.normalize_str(text)
    return text if text == " " else _STRIP.normalize_str(text)


def token_key(tokenizer: Tokenizer, token_id: int) -> str:
    """The canonical key of one token: its normalised text, the raw decoded text if that
    normalises to nothing, or the raw vocabulary string when the token is a partial UTF-8
    sequence (decodes to U+FFFD), so distinct byte fragments never merge."""
    text = tokenizer.decode([token_id])
    if _REPLACEMENT_CHAR in text:
        return tokenizer.id_to_token(token_id)
    return normalize_token_text(text) or text


def build_compression_table(tokenizer: Tokenizer) -> CompressionTable:
    """Map every id of `tokenizer` (the pad/eos id included) to a canonical id.

    Keys get new ids in first-seen order of token id, so table[0] == 0 and each new key's id is
    one more than the largest id before it.
    """
    key_to_id: dict[str, int] = {}
    table = np.empty(tokenizer.vocab_size, dtype=np.int32)
    for token_id in range(tokenizer.vocab_size):
        table[token_id] = key_to_id.setdefault(token_key(tokenizer, token_id), len(key_to_id))
    return CompressionTable(table, len(key_to_id))


def compress_ids(ids: np.ndarray, table: CompressionTable) -> np.ndarray:
    """Canonical ids of `ids` (any shape, integer). Negative ids (padding/sentinels) pass through
    unchanged; an id >= V raises ValueError naming it. Returns int32 of the same shape."""
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
    if ids.size and ids.max() >= table.vocab_size:
        raise ValueError(
            f"token id {int(ids.max())} out of range for a compression table of "
            f"vocab_size={table.vocab_size}"
        )
    if ids.size and ids.min() < np.iinfo(np.int32).min:
        raise ValueError(f"negative id {int(ids.min())} does not fit in int32")
    out = ids.astype(np.int32, copy=True)
    valid = ids >= 0
    out[valid] = table.table[ids[valid]]
    return out
