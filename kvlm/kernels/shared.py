"""What the kernels' dispatch (``kvlm.kernels``) and their custom operator (``kvlm.kernels.library``) share: the
call and FLOP counters and the split of the key axis over the threads."""

from __future__ import annotations

import math
from collections import Counter

import torch

MIN_SPLIT_KEYS = (
    512  # keys per split of the sequence axis at least: fewer cost more in merging than they save
)
# torch's own tensor classes: a tensor subclass (a tensor-parallel DTensor, as a Parameter too) is not taken
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
CALLS: Counter[str] = Counter()
NORM_CALLS: Counter[str] = Counter()  # rms_norm's calls, apart: CALLS counts attention over the cache
LINEAR_CALLS: Counter[str] = Counter()  # the few-row weight products' calls (kvlm.kernels.few_rows)
# FLOPs the kernels ran (2 per multiply-add; attention: scores and values, every visible key counted): torch's
# FLOP counter does not see them, so kvlm.bench.flops.CountFlops adds the increase of "total"; "attention" and
# "linear" (the few-row weight products) split it
FLOPS: Counter[str] = Counter()


def count_flops(kind: str, n: int) -> None:
    FLOPS["total"] += n
    FLOPS[kind] += n


def visible_keys(start: torch.Tensor, end: torch.Tensor) -> int:
    """Keys of all sequences together, read back from their ranges [start, end) (the FLOP count's key total)."""
    return int((end - start).sum())  # int32 ranges, an int64 sum


def split_count(items: int, longest: int | None, start: torch.Tensor, end: torch.Tensor) -> int:
    """Pieces of the key axis per (sequence, group): the fewest that make the work items a multiple of the
    threads (batch 1 on 2 threads: 2 halves of the sequence; 3 KV heads on 2 threads: 6 items, not 2 + 1),
    each at least MIN_SPLIT_KEYS long, else 1. ``longest``: the longest sequence's keys as the cache knows them
    on the host, or None: then read back from the key ranges [start, end), only when a split is possible."""
    threads = torch.get_num_threads()
    want = threads // math.gcd(items, threads)
    if want == 1:
        return 1
    if longest is None:
        longest = int((end - start).max()) if end.numel() else 0
    return want if longest // want >= MIN_SPLIT_KEYS else 1
