"""Timers: the timed loops of `kvlm bench` and the statistics of their samples.

``time_prefill`` and ``time_decode`` time any model through two callables (a cache factory and a forward
or step), so kvlm models and their transformers peers run through the same loop; ``summarize`` gives the
median and spread; ``fit_to_budget`` shortens slow measurements. The timed loops are the hot path of every
number `kvlm bench` reports: keep them free of work that is not the model's.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlm.bench.flops import CountFlops
from kvlm.bench.memory import PeakMemory


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; CPU needs nothing)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs of ``fn()`` (seconds)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times)


def summarize(seconds: list[float]) -> dict[str, float]:
    """Median and spread (ms) of repeated timings."""
    ms = sorted(1e3 * s for s in seconds)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    return {
        "median_ms": statistics.median(ms),
        "min_ms": ms[0],
        "max_ms": ms[-1],
        "iqr_ms": q[2] - q[0],
        "n": len(ms),
    }


def fit_to_budget(
    first_s: float, warmup: int, steps: int, budget_s: float | None, minimum: int = 3
) -> tuple[int, int]:
    """Fewer timed steps for slow measurements, so that each stays near ``budget_s`` seconds: when the first
    (untimed) step says warm-up + steps would overrun, skip the warm-up (that first step was one) and time
    max(minimum, budget / first) steps, never more than ``steps`` (the cache has room for no more)."""
    if budget_s and first_s * (warmup + steps) > budget_s:
        return 0, max(min(minimum, steps), min(steps, int(budget_s / first_s)))
    return warmup, steps


@torch.inference_mode()
def time_prefill(new_cache, forward, cache_bytes, device, warmup: int, repeats: int, budget_s=None) -> dict:
    """Median latency of ``forward(cache)`` on fresh caches from ``new_cache()`` (allocation untimed)."""
    times = []
    n = warmup + repeats
    with PeakMemory(device) as mem:
        i = 0
        while i < n:
            cache = new_cache()
            sync(device)
            t0 = time.perf_counter()
            forward(cache).argmax(-1)
            sync(device)
            dt = time.perf_counter() - t0
            if i == 0 and budget_s and dt * n > budget_s:  # slow: fewer repeats (at least 2)
                n = warmup + max(2, min(repeats, int(budget_s / dt)))
            if i >= warmup:
                times.append(dt)
            kv_bytes = cache_bytes(cache)
            del cache
            i += 1
    row = summarize(times)
    row.update(kv_cache_bytes=kv_bytes, peak_mem_bytes=mem.peak, peak_extra_bytes=mem.extra)
    return row


@torch.inference_mode()
def time_decode(new_cache, step, device, warmup: int, steps: int, budget_s=None) -> dict:
    """Per-step latency of ``tok = step(tok, cache)`` on the cache ``new_cache()`` returns (with its KV bytes).
    The first step is untimed (the first warm-up step; an extra one when ``warmup`` is 0) and its FLOPs are
    counted: the cache needs room for ``max(warmup, 1) + steps`` new tokens."""
    with PeakMemory(device) as mem:  # the cache and the first step, whose temporaries every step repeats
        cache, kv_bytes, tok = new_cache()
        sync(device)
        t0 = time.perf_counter()
        with CountFlops() as flops:
            tok = step(tok, cache)
        sync(device)
    warmup, steps = fit_to_budget(time.perf_counter() - t0, max(warmup - 1, 0), steps, budget_s)
    # the timed steps run without PeakMemory's sampling thread: waking every 2 ms, it takes a core from the
    # OpenMP workers when they use every core; the usage is read between steps instead
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        tok = step(tok, cache)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        mem.observe()
    del cache
    row = summarize(times)
    row.update(
        kv_cache_bytes=kv_bytes,
        peak_mem_bytes=mem.peak,
        peak_extra_bytes=mem.extra,
        flops_per_step=flops.total,
    )
    return row
