"""Peak-memory measurement, the one home for it in kvlm.

- ``PeakMemory``: the peak while a block runs (CUDA: the allocator's max allocated; CPU: the process RSS,
  sampled by a thread), with ``extra`` = peak minus the usage when the block began. `kvlm bench` uses it.
- ``process_peak_memory(device)``: the peak since the process (or the last CUDA peak reset) began, as
  ``(bytes, kind)``; for per-rank training and tensor-parallel records.
- ``rss()`` and ``malloc_trim()``: the current resident set size, and handing freed heap back to the OS so
  that RSS growth shows new allocations.
"""

from __future__ import annotations

import ctypes
import gc
import os
import resource
import sys
import threading

import torch


def malloc_trim() -> None:
    """Hand freed heap memory back to the OS (glibc), so that RSS growth shows new allocations instead of
    being absorbed by memory an earlier measurement freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _max_rss() -> int:
    """The process's peak resident set size in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def rss() -> int:
    """The process's resident set size now (bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the high-water mark of the process, the best portable number
        return _max_rss()


def process_peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the CUDA allocator's peak on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    return _max_rss(), "process peak RSS"


class PeakMemory:
    """Peak memory while the block runs: max allocated on CUDA; on CPU the process RSS, sampled from
    /proc/self/statm by a thread every ``interval`` s (torch kernels release the GIL, so it keeps sampling
    during long ops). ``peak`` is absolute, ``extra`` is the peak minus the usage when the block began."""

    rss = staticmethod(rss)

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device = device
        self.interval = interval
        self.peak = 0
        self.start = 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            gc.collect()
            malloc_trim()
            self.start = self.peak = rss()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())

    def observe(self) -> None:
        """Fold the usage now into ``peak``: for work after the block, run without the sampling thread."""
        if self.device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        else:
            self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.start)
