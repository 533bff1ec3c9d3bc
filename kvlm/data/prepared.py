"""PreparedData: the handle on a prepared folder (train / val TokenStreams, tokenizer, metadata), and
``load_prepared``, which opens one and names whatever is missing, partial or corrupt."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlm.data.format import FORMAT, SPLITS, DataError, content_hash
from kvlm.data.shards import TokenStream
from kvlm.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer


@dataclass
class PreparedData:
    """A prepared data folder: train / val token streams (numpy memmaps), tokenizer and metadata."""

    path: Path
    meta: dict[str, Any]
    tokenizer: Tokenizer
    train: TokenStream
    val: TokenStream
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def source(self) -> str:
        return self.meta["source"]

    @property
    def content_hash(self) -> str:
        return self.meta["content_hash"]

    def val_tokens(self, max_tokens: int | None = None) -> np.ndarray:
        """The validation split (or its first max_tokens) as int64."""
        n = len(self.val) if max_tokens is None else min(max_tokens, len(self.val))
        return self.val[:n]

    def train_tokens(self, max_tokens: int | None = None) -> np.ndarray:
        n = len(self.train) if max_tokens is None else min(max_tokens, len(self.train))
        return self.train[:n]

    def describe(self) -> str:
        t = self.meta["tokenizer"]
        return (
            f"{self.source}: {len(self.train):,} train + {len(self.val):,} val tokens, "
            f"{t['kind']} tokenizer of {t['vocab_size']:,} tokens ({self.path})"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "source": self.source,
            "tokenizer": self.meta["tokenizer"],
            "train_tokens": len(self.train),
            "val_tokens": len(self.val),
            "dtype": self.meta["dtype"],
            "content_hash": self.content_hash,
        }

    @classmethod
    def load(cls, path: str | Path, verify: bool = False) -> PreparedData:
        return load_prepared(path, verify=verify)

    def __repr__(self) -> str:
        return (
            f"PreparedData({str(self.path)!r}, source={self.source!r}, train={len(self.train):,} tokens, "
            f"val={len(self.val):,} tokens, vocab={self.vocab_size})"
        )


def load_prepared(path: str | Path, verify: bool = False) -> PreparedData:
    """Open a folder written by `prepare`; DataError names what is missing, partial or corrupt.
    verify=True also recomputes the content hash."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"no prepared data at {path} (run `kvlm prepare` first)")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise DataError(f"{path} is not a prepared data folder: meta.json is missing")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{meta_file} is corrupt: {e}") from e
    if meta.get("format") != FORMAT:
        raise DataError(f"{path} is not kvlm prepared data (format={meta.get('format')!r})")
    try:
        tokenizer = load_tokenizer(path / "tokenizer.json")
    except TokenizerError as e:
        raise DataError(f"{path}: {e}") from e
    dtype = np.dtype(meta["dtype"])
    streams = {}
    for split in SPLITS:
        shards = []
        for shard in meta["splits"][split]["shards"]:
            f = path / shard["file"]
            if not f.is_file():
                raise DataError(f"{path}: shard {shard['file']} is missing")
            expected = shard["tokens"] * dtype.itemsize
            if f.stat().st_size != expected:
                raise DataError(
                    f"{path}: shard {shard['file']} is partial or corrupt "
                    f"({f.stat().st_size} bytes, expected {expected})"
                )
            if shard["tokens"]:
                shards.append(np.memmap(f, dtype=dtype, mode="r"))
        streams[split] = TokenStream(shards)
    if len(streams["train"]) == 0:
        raise DataError(f"{path}: the training split is empty")
    if verify:
        digest = content_hash(path, meta)
        if digest != meta["content_hash"]:
            raise DataError(f"{path}: content hash mismatch (files changed since they were prepared)")
    return PreparedData(path, meta, tokenizer, streams["train"], streams["val"])
