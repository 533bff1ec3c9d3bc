"""The machine a benchmark ran on: what it is (``machine_info``) and what it can do (``measure_hardware``:
memory bandwidth and fp32 matmul throughput, which set the roofline's floors)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from kvlm.bench.peers import transformers_version
from kvlm.bench.timing import best_time


def machine_info(device: torch.device) -> dict[str, Any]:
    """CPU model, cores, torch threads, library versions, device and load average."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "python": platform.python_version(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "load_average": load_average(),
    }


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def measure_hardware(device: torch.device, mib: int = 512, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth (GB/s) and fp32 matmul throughput (GFLOP/s), best of ``repeats``.

    copy: dst.copy_(src) of ``mib`` MiB moves 2x that (read + write). read: src.sum() reads it once.
    ``bandwidth_gbs`` is the larger: the floor uses the best this machine has shown."""
    n = mib * 2**20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    copy_gbs = 2 * n * 4 / best_time(lambda: dst.copy_(src), device, repeats) / 1e9
    read_gbs = n * 4 / best_time(lambda: src.sum(), device, repeats) / 1e9
    src = dst = None  # free 2 x mib before the matmul
    m = 8192 if device.type == "cuda" else (2048 if mib >= 256 else 512)  # small buffers: a quick run
    a = torch.randn(m, m, device=device)
    b = torch.randn(m, m, device=device)
    a @ b  # warm-up
    gflops = 2 * m**3 / best_time(lambda: a @ b, device, repeats) / 1e9
    return {
        "copy_gbs": copy_gbs,
        "read_gbs": read_gbs,
        "bandwidth_gbs": max(copy_gbs, read_gbs),
        "matmul_fp32_gflops": gflops,
        "bandwidth_buffer_mib": mib,
    }


def best_of(start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
    """The hardware numbers a run's floors use: the best of the measurements at its start and its end (a
    busy machine at either end does not lower the floors), with both kept."""
    keys = ("copy_gbs", "read_gbs", "bandwidth_gbs", "matmul_fp32_gflops")
    return {**start, **{k: max(start[k], end[k]) for k in keys}, "start": start, "end": end}
