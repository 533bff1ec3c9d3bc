"""The prepared-data folder format: its names, the token dtype rule, the content hash and DataError.

A folder written by ``kvlm prepare`` holds tokenizer.json, <split>-NNNNN.bin shards of token ids (uint16 when
the vocabulary fits, else uint32; every document ends with the end-of-text id) and meta.json:
{"format": "kvlm-data", "version", tokenizer, dtype, eos_id, splits (tokens, documents, shards), sources,
source (label), synthetic, content_hash (sha256 of tokenizer.json + the shards), request (the arguments, so an
identical preparation is reused)}.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FORMAT = "kvlm-data"
VERSION = 1
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 28  # 256 M tokens: 512 MB of uint16 per file


class DataError(ValueError):
    """Missing, empty, partial or malformed data (the message names the file or source)."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 holds ids 0..65535, so a vocabulary of up to 65,536 tokens fits."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def content_hash(path: Path, meta: dict) -> str:
    """sha256 of tokenizer.json and every shard listed in ``meta``, in split order."""
    h = hashlib.sha256((path / "tokenizer.json").read_bytes())
    for split in SPLITS:
        for shard in meta["splits"][split]["shards"]:
            with open(path / shard["file"], "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
    return h.hexdigest()
