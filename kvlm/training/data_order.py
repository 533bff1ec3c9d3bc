"""Which token windows each training step and each evaluation reads.

Data order is a pure function of (seed, step): each epoch is a seeded permutation of non-overlapping
seq_len + 1 windows, so a resumed run reads exactly the tokens the uninterrupted run would have read.
"""

from __future__ import annotations

import numpy as np

from kvlm.data import DataError, TokenStream


class BatchOrder:
    """Which windows of the training stream each step reads: a pure function of (seed, step).

    Epoch e is a seeded permutation of the non-overlapping windows of seq_len + 1 tokens (inputs and
    next-token targets) starting at a seeded offset; global sample g is window g mod n of epoch g // n."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int):
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.n = (len(stream) - seq_len) // seq_len
        if self.n < 1:
            raise DataError(
                f"the training split has {len(stream)} tokens: too few for one window of seq_len + 1 = {seq_len + 1}"
            )
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[int, np.ndarray]:
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, e])
            offset = int(rng.integers(0, len(self.stream) - 1 - self.n * self.seq_len + 1))
            self._epochs = {e: (offset, rng.permutation(self.n))}  # one epoch cached at a time
        return self._epochs[e]

    def starts(self, first_sample: int, count: int) -> list[int]:
        out = []
        for g in range(first_sample, first_sample + count):
            offset, perm = self._epoch(g // self.n)
            out.append(offset + int(perm[g % self.n]) * self.seq_len)
        return out

    def epoch_of(self, sample: int) -> float:
        return sample / self.n


def eval_starts(stream: TokenStream, seq_len: int, count: int) -> list[int]:
    """The same `count` validation windows every evaluation, spread evenly over the split."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        return []
    idx = np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(np.int64))
    return [int(i) * seq_len for i in idx]
