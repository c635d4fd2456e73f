"""Byte-level BPE tokenizer (HuggingFace `tokenizers`), trained on the training split and cached.

GPT-2 style: ByteLevel pre-tokenizer (no prefix space) and ByteLevel decoder, no normaliser, so
`decode(encode(text)) == text` for any Unicode text. Id 0 is `<|endoftext|>`, the end-of-document
(and padding) token. A literal "<|endoftext|>" inside a document is encoded as ordinary text, not
as the special id, so document boundaries come only from the data pipeline.

`Tokenizer` also wraps any Hugging Face `tokenizer.json` (a pretrained model's): its
end-of-document token is the one its `tokenizer_config.json` names, wherever its id is.

What a text starts with belongs to the model (`Tokenizer.document_prefix`): a v41jax run
trained on documents each following the eos of the one before, so its prompts start with eos;
a pretrained model saw each text as its tokenizer's template frames it (Llama and Mistral a
BOS `<s>` first, Qwen nothing), so its prompts and documents start with that template.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from v41jax.data.corpus import atomic_write, resolve_cache_dir

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
TOKENIZER_CONFIG = "tokenizer_config.json"  # Hugging Face's name; holds "eos_token"
NUM_BYTES = 256
MIN_VOCAB_SIZE = NUM_BYTES + 1  # every byte + <|endoftext|>
# Bump when training settings change so old cache files are not reused.
_CACHE_VERSION = "bpe-v1"


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer`: v41jax's own byte-level BPE (eos
    `<|endoftext|>` at id 0) or any Hugging Face `tokenizer.json`, whose end-of-document token
    `eos_token` names (`load` reads it from a `tokenizer_config.json` beside the file, the
    Hugging Face convention, as `save` writes it).

    `hf`: the tokenizer is a Hugging Face model's (its texts start as its template says, see
    `document_prefix`), not v41jax's own (each document follows an eos). Default: whether
    `eos_token` is not v41jax's; `load` says True when a tokenizer_config.json is beside the
    file (`import-hf` copies the model's), and `save` writes one for every HF tokenizer."""

    def __init__(
        self, tok: tokenizers.Tokenizer, eos_token: str = EOS_TOKEN, hf: bool | None = None
    ):
        eos = tok.token_to_id(eos_token)
        if eos is None:
            raise ValueError(f"tokenizer has no eos token {eos_token!r} in its vocabulary")
        self.eos_token, self._eos_id = eos_token, eos
        self.hf = eos_token != EOS_TOKEN if hf is None else hf
        # Not serialised by `tokenizers`, so set on every construction: special-token text in a
        # document stays text (see module docstring).
        tok.encode_special_tokens = True
        self._tok = tok
        self._content_hash: str | None = None
        self._prefix: tuple[int, ...] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def document_prefix(self) -> tuple[int, ...]:
        """The ids every document, and so every prompt, starts with, as the model was trained.

        The tokenizer's template (tokenizer.json's post-processor, e.g. Llama's
        TemplateProcessing "<s> $A") when it puts special tokens before a text: transformers
        (5.x) encodes a text with it, ignoring tokenizer_config.json's add_bos_token when a
        tokenizer.json exists, so a pretrained model saw every text start with them. Otherwise
        (eos,) for v41jax's own tokenizer: its runs trained on documents that each follow the
        eos of the one before (the data pipeline's streams), and () for a Hugging Face one
        without a prefix (Qwen's: its texts start with their first token)."""
        if self._prefix is None:
            lead = self._template_lead()
            self._prefix = lead or (() if self.hf else (self._eos_id,))
        return self._prefix

    def _template_lead(self) -> tuple[int, ...]:
        """The special tokens the template puts before a text's first token: those before the
        first non-special one of a probe text (any text the vocabulary encodes)."""
        added = self._tok.get_added_tokens_decoder()
        probes = ["a"] + [
            self._tok.id_to_token(i) for i in range(min(self.vocab_size, 64)) if i not in added
        ]
        for text in probes:
            try:
                enc = self._tok.encode(text, add_special_tokens=True)
            except Exception:  # e.g. a WordLevel without an unk token: not one of its words
                continue
            if 0 in enc.special_tokens_mask:
                return tuple(enc.ids[: enc.special_tokens_mask.index(0)])
        return ()

    def prompt_ids(self, text: str) -> list[int]:
        """`document_prefix` then `text`'s ids: a prompt as the model's documents start. An
        empty prompt of a tokenizer without a prefix (Qwen's) is [eos]: the model's documents
        follow one (the data pipeline's streams), and a prompt needs a token."""
        return [*self.document_prefix, *self.encode(text)] or [self._eos_id]

    @property
    def content_hash(self) -> str:
        """sha256 (hex) of the serialised tokenizer: keys caches of data tokenized with it."""
        if self._content_hash is None:
            self._content_hash = hashlib.sha256(self._tok.to_str().encode()).hexdigest()
        return self._content_hash

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts, in parallel (Rust threads)."""
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens are kept so decode inverts encode exactly."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} out of range [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str:
        """The raw vocabulary string of id `i` (byte-level alphabet, e.g. 'Ġthe')."""
        token = self._tok.id_to_token(int(i))
        if token is None:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return token

    def save(self, path: str) -> None:
        """Write the tokenizer JSON atomically (a reader never sees a half-written file), and
        a tokenizer_config.json naming the eos token beside it when it is a Hugging Face one
        (`hf`: `load` then knows it for one, though its eos be `<|endoftext|>`)."""
        atomic_write(path, self._tok.save)
        if self.hf:
            side = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)
            text = json.dumps({"eos_token": self.eos_token})

            def write(tmp: str) -> None:
                with open(tmp, "w") as f:
                    f.write(text)

            atomic_write(side, write)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """A tokenizer.json; its eos token from a tokenizer_config.json beside it (its
        "eos_token", a string or {"content": ...}), else `<|endoftext|>`. With that file it is
        a Hugging Face tokenizer (`hf`), without it v41jax's own."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path!r} does not exist")
        eos = EOS_TOKEN
        side = os.path.join(os.path.dirname(path), TOKENIZER_CONFIG)
        hf = os.path.isfile(side)
        if hf:
            with open(side) as f:
                named = json.load(f).get("eos_token") or EOS_TOKEN
            eos = named["content"] if isinstance(named, dict) else str(named)
        return cls(tokenizers.Tokenizer.from_file(path), eos, hf=hf)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, hash={self.content_hash[:12]})"


def _check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {EOS_TOKEN})"
        )


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly `vocab_size` tokens (id 0 = <|endoftext|>,
    then the 256 byte symbols, then merges). Raises if the texts cannot yield that many merges.
    """
    _check_vocab_size(vocab_size)
    texts = list(texts)
    if not any(texts):
        raise ValueError(f"cannot train a tokenizer on empty text ({len(texts)} texts)")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(
            f"the training text ({sum(len(t) for t in texts)} characters in {len(texts)} "
            f"documents) only yields a vocabulary of {got} tokens ({got - MIN_VOCAB_SIZE} merges), "
            f"fewer than vocab_size={vocab_size}; use more text or a smaller vocab_size"
        )
    return Tokenizer(tok)


def tokenizer_cache_key(texts: Sequence[str], vocab_size: int) -> str:
    """First 16 hex digits of sha256 over (settings version, vocab_size, every text)."""
    h = hashlib.sha256(f"{_CACHE_VERSION}:{vocab_size}:{len(texts)}\n".encode())
    for text in texts:
        data = text.encode("utf-8")
        # Length-prefix each text so ["ab", "c"] and ["a", "bc"] hash differently.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def load_or_train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: str) -> Tokenizer:
    """`train_tokenizer`, cached as `<cache_dir>/tokenizer-<tokenizer_cache_key>.json`."""
    texts = list(texts)
    _check_vocab_size(vocab_size)  # fail before hashing a large corpus
    path = os.path.join(
        resolve_cache_dir(cache_dir), f"tokenizer-{tokenizer_cache_key(texts, vocab_size)}.json"
    )
    if os.path.isfile(path):
        tok = Tokenizer.load(path)
        if tok.vocab_size != vocab_size:
            raise ValueError(
                f"cached tokenizer {path!r} has vocab_size={tok.vocab_size}, expected "
                f"{vocab_size}; delete the file to retrain"
            )
        return tok
    tok = train_tokenizer(texts, vocab_size)
    tok.save(path)
    return tok
