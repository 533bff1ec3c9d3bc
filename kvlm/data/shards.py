"""Token shards: the writer that appends documents to <split>-NNNNN.bin files, and TokenStream, which reads a
split back as one sequence over its memory-mapped shards."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np


class ShardWriter:
    """Appends token ids to <split>-NNNNN.bin files of at most `shard_tokens` each, up to `cap`."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, cap: int | None, shard_tokens: int):
        self.folder, self.split, self.dtype = folder, split, dtype
        self.cap, self.shard_tokens = cap, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.tokens = 0
        self.documents = 0
        self._fh = None

    @property
    def full(self) -> bool:
        return self.cap is not None and self.tokens >= self.cap

    def add(self, ids: np.ndarray) -> int:
        """Write one document's ids (eos included); returns how many were written."""
        if self.full:
            return 0
        if self.cap is not None:
            ids = ids[: self.cap - self.tokens]
        self.documents += 1
        pos = 0
        while pos < len(ids):
            if self._fh is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._open()
            take = min(len(ids) - pos, self.shard_tokens - self.shards[-1]["tokens"])
            self._fh.write(ids[pos : pos + take].astype(self.dtype).tobytes())
            self.shards[-1]["tokens"] += take
            pos += take
        self.tokens += len(ids)
        return len(ids)

    def _open(self) -> None:
        if self._fh is not None:
            self._fh.close()
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._fh = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None

    def pop_tail(self, n: int) -> np.ndarray:
        """Remove and return the last n tokens (for a validation split cut from the training tail)."""
        self.close()
        out = []
        while n > 0 and self.shards:
            shard = self.shards[-1]
            f = self.folder / shard["file"]
            take = min(n, shard["tokens"])
            arr = np.fromfile(f, dtype=self.dtype)
            out.insert(0, arr[len(arr) - take :])
            shard["tokens"] -= take
            os.truncate(f, shard["tokens"] * self.dtype.itemsize)
            if shard["tokens"] == 0:
                f.unlink()
                self.shards.pop()
            n -= take
            self.tokens -= take
        return np.concatenate(out) if out else np.zeros(0, self.dtype)


class TokenStream:
    """One split: a sequence of token ids over one or more memory-mapped shard files."""

    def __init__(self, shards: list[np.ndarray]):
        self.shards = shards
        self.offsets = np.cumsum([0] + [len(s) for s in shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """tokens[start : start + length] as int64 (crossing shard boundaries if needed)."""
        if start < 0 or start + length > len(self):
            raise IndexError(f"window [{start}, {start + length}) outside a stream of {len(self)} tokens")
        if length <= 0:
            return np.zeros(0, dtype=np.int64)
        parts, pos, end = [], start, start + length
        while pos < end:
            i = int(np.searchsorted(self.offsets, pos, side="right")) - 1
            lo = pos - int(self.offsets[i])
            take = min(end - pos, len(self.shards[i]) - lo)
            parts.append(self.shards[i][lo : lo + take])
            pos += take
        return np.concatenate(parts).astype(np.int64) if len(parts) > 1 else parts[0].astype(np.int64)

    def windows(self, starts: Iterable[int], length: int) -> np.ndarray:
        """(len(starts), length) int64."""
        return np.stack([self.window(int(s), length) for s in starts])

    def __getitem__(self, item):
        if isinstance(item, slice):
            start, stop, step = item.indices(len(self))
            if step != 1:
                raise IndexError("TokenStream slices must have step 1")
            return self.window(start, max(0, stop - start))
        if item < 0:
            item += len(self)
        return int(self.window(int(item), 1)[0])
