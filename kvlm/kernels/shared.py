"""What the kernels' dispatch (``kvlm.kernels``) and their custom operator (``kvlm.kernels.library``) share: the
call and FLOP counters and the split of the key axis over the threads."""

from __future__ import annotations

import math
from collections import Counter

import torch

MIN_SPLIT_KEYS = (
    512  # keys per split of the sequence axis at least: fewer cost more in merging than they save
)
# Split further, while a call has fewer than BALANCE_ITEMS work items a thread, into pieces of at least
# BALANCE_KEYS keys: the threads take over each other's unfinished items (csrc/steal.h), and one item a thread
# leaves a core that streams slower than the other nothing to hand over. Measured on the Zen 4 EPYC, 2 threads,
# one layer at the bench shape interleaved (benchmarks/decode-limit.md): MLA batch 2 / 4096 1.03-1.20x faster
# with 4 items than 2, batch 1 / 8192 1.01-1.05x with 4 than 2, GQA-3 batch 2 / 4096 1.07-1.27x with 12 than 6;
# pieces of 1024 keys lost (GQA-3 batch 1 / 8192 in 24: 0.52-0.71x).
BALANCE_ITEMS = 4
BALANCE_KEYS = 2048
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
    each at least MIN_SPLIT_KEYS long, else 1; then, while there are fewer than BALANCE_ITEMS items a thread,
    as many more (still a multiple of the threads) as keep pieces BALANCE_KEYS long (batch 1 at 8192 keys on 2
    threads: 4 pieces). ``longest``: the longest sequence's keys as the cache knows them on the host, or None:
    then read back from the key ranges [start, end), only when a split is possible."""
    threads = torch.get_num_threads()
    want = threads // math.gcd(items, threads)
    if threads == 1 or (want == 1 and items >= BALANCE_ITEMS * threads):
        return 1
    if longest is None:
        longest = int((end - start).max()) if end.numel() else 0
    n = want if want > 1 and longest // want >= MIN_SPLIT_KEYS else 1
    while items * n < BALANCE_ITEMS * threads and longest // (n + want) >= BALANCE_KEYS:
        n += want
    return n
