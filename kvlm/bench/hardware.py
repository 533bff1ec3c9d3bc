"""The machine a benchmark ran on: what it is (``machine_info``) and what it can do (``measure_hardware``:
memory bandwidth and fp32 matmul throughput, which set the roofline's floors)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvlm.bench.peers import transformers_version
from kvlm.bench.timing import best_time
from kvlm.hugepages import zeros_in_huge_pages


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


def measure_hardware(device: torch.device, mib: int = 512, repeats: int = 5) -> dict[str, Any]:
    """Memory bandwidth (GB/s) and fp32 matmul throughput (GFLOP/s), best of ``repeats``; the matmul peak is the
    fastest of torch's routes (``matmul_calls``), each kept in ``matmul_routes_gflops``.

    copy: dst.copy_(src) of ``mib`` MiB moves 2x that (read + write). read: src.sum() reads it once (``Probe``).
    ``bandwidth_gbs`` is the larger: the floor uses the best this machine has shown. Both buffers are in huge
    pages where kvlm puts its caches and weights (kvlm.hugepages; 4 KiB pages read ~8 % slower on this
    project's VM), so the floor is what the same memory can do."""
    m = 8192 if device.type == "cuda" else (2048 if mib >= 256 else 512)  # small buffers: a quick run
    probe = Probe(device, mib, m, repeats)
    dst = zeros_in_huge_pages(probe.src.shape, torch.float32, device)
    copy_gbs = 2 * probe.src.numel() * 4 / best_time(lambda: dst.copy_(probe.src), device, repeats) / 1e9
    dst = None
    read_gbs = probe.read_gbs()
    probe.src = None  # free the buffer before the matmul
    routes = probe.routes_gflops()
    return {
        "copy_gbs": copy_gbs,
        "read_gbs": read_gbs,
        "bandwidth_gbs": max(copy_gbs, read_gbs),
        "matmul_fp32_gflops": max(routes.values()),
        "matmul_routes_gflops": routes,
        "bandwidth_buffer_mib": mib,
    }


class Probe:
    """Read bandwidth (``src.sum()`` over ``mib`` MiB in huge pages, as kvlm's caches and weights are) and fp32
    matmul peak (``matmul`` x ``matmul`` products by every route, ``matmul_calls``), each the best of ``repeats``,
    from buffers made once: ``measure_hardware`` measures with one, kvlm.bench.paired again and again."""

    def __init__(self, device: torch.device, mib: int = 256, matmul: int = 2048, repeats: int = 2):
        self.src: torch.Tensor | None = zeros_in_huge_pages(
            (mib * 2**20 // 4,), torch.float32, device
        ).uniform_()
        self.m = matmul
        self.matmuls = matmul_calls(
            torch.randn(matmul, matmul, device=device), torch.randn(matmul, matmul, device=device)
        )
        self.repeats = repeats
        self.device = device

    def read_gbs(self) -> float:
        src = self.src
        return src.numel() * 4 / best_time(lambda: src.sum(), self.device, self.repeats) / 1e9

    def routes_gflops(self) -> dict[str, float]:
        flop = 2 * self.m**3
        return {
            name: flop / best_time(call, self.device, self.repeats) / 1e9
            for name, call in self.matmuls.items()
        }

    def __call__(self) -> dict[str, float]:
        return {"bandwidth_gbs": self.read_gbs(), "matmul_fp32_gflops": max(self.routes_gflops().values())}


def matmul_calls(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The product a b^T (fp32) by each route torch has for it here, each warmed up: ``torch.mm`` (MKL on CPU,
    cuBLAS) and, on a CPU where torch has oneDNN, oneDNN's linear on its own blocked layout (returned dense).
    The matmul peak is the best of them: on AMD CPUs MKL keeps off the AVX-512 paths (this project's 2-core AMD
    EPYC: ``torch.mm`` 190 GFLOP/s, oneDNN 440, an FMA loop 460), so ``torch.mm`` alone would set compute floors
    2.3x too high."""
    bt = b.t()
    calls: dict[str, Callable[[], torch.Tensor]] = {"torch.mm": lambda: torch.mm(a, bt)}
    if a.device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            a_dnn, b_dnn = a.to_mkldnn(), b.to_mkldnn()
            torch._C._nn.mkldnn_linear(a_dnn, b_dnn)
            calls["oneDNN"] = lambda: torch._C._nn.mkldnn_linear(a_dnn, b_dnn)
        except RuntimeError:  # a build whose oneDNN does not take the product: the other routes
            pass
    for call in calls.values():
        call()  # warm-up
    return calls


def best_of(start: dict[str, float], end: dict[str, float]) -> dict[str, Any]:
    """The hardware numbers a run's floors use: the best of the measurements at its start and its end (a
    busy machine at either end does not lower the floors), with both kept."""
    keys = ("copy_gbs", "read_gbs", "bandwidth_gbs", "matmul_fp32_gflops")
    return {**start, **{k: max(start[k], end[k]) for k in keys}, "start": start, "end": end}
