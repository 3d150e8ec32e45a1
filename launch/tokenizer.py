"""Tokenizers: bytes (the default, no files needed) and Hugging Face `tokenizer.json` via `tokenizers`.

Byte tokenizer ids: 0..255 are the raw bytes, then 256 = <bos>, 257 = <eos>, 258 = <pad>; vocab_size 259,
so it fits any model whose vocabulary has at least 259 entries (the tiny model has 512).
Both expose `vocab_size`, `eos_id`, `encode_batch(list[bytes]) -> list[np.ndarray]`, `decode(ids)` and
`identity` (a string that changes whenever the token ids would, used to key the token cache).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np


class ByteTokenizer:
    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    identity = "bytes-v1"

    def encode(self, text: str | bytes) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, docs: list[bytes]) -> list[np.ndarray]:
        return [self.encode(d) for d in docs]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`). eos is the first of the usual end tokens it knows."""

    _EOS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
    _BOS = ("<|begin_of_text|>", "<s>", "<bos>")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                "--tokenizer tokenizer.json needs the `tokenizers` package: pip install tokenizers"
            ) from None
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--tokenizer {str(path)!r}: no such file; pass 'bytes' or a tokenizer.json file")
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:
            raise ValueError(f"--tokenizer {path}: not a Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.identity = "hf-" + hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.eos_id = next((vocab[t] for t in self._EOS if t in vocab), None)
        self.bos_id = next((vocab[t] for t in self._BOS if t in vocab), None)

    def encode(self, text: str | bytes) -> np.ndarray:
        return self.encode_batch([text])[0]

    def encode_batch(self, docs: list) -> list[np.ndarray]:
        texts = [d.decode("utf-8", errors="replace") if isinstance(d, bytes) else d for d in docs]
        return [np.asarray(e.ids, dtype=np.uint32) for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


def load_tokenizer(spec: str):
    """`bytes` or a path to tokenizer.json."""
    if spec in ("bytes", "byte", ""):
        return ByteTokenizer()
    return HFTokenizer(spec)
