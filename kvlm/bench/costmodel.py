"""Decode time projected per hardware: the per-operation roofline of ``kvlm.bench.roofline`` applied to a
config alone (no weights), with a hardware's memory bandwidth and peak matmul throughput.

``project_decode(cfg, hw, batch, context)`` splits one decode step (one new token per sequence) into the
operation classes of the measured roofline (weight GEMMs, attention over the cache, LM head), takes each
one's bytes and FLOPs from the code that runs (parameters of the model built on the meta device, the
mechanism's ``decode_cost`` and ``cache_spec``), and bounds its time below by max(bytes / bandwidth,
FLOPs / peak). The step's floor is the sum over the operations. Nothing here names a mechanism.

``HARDWARE`` holds published specs (dense matmul peak at the decode dtype, no sparsity; memory bandwidth),
each with its source; ``measured_cpu(threads)`` measures this machine with ``measure_hardware`` (fp32).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvlm.accounting import DTYPE_BYTES
from kvlm.bench.roofline import attention_cost, operation_classes, operation_roofline, weight_classes
from kvlm.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Hardware:
    """A device's limits for the roofline: bytes/s it can read and FLOP/s of its matmul units."""

    name: str
    bandwidth_bytes_per_s: float
    peak_flops: float
    source: str
    dtype: str = "bf16"  # the dtype its peak is quoted for, and the one decode runs in on it

    def roofline_limits(self) -> dict[str, float]:
        """The keys ``operation_roofline`` reads (GB/s and GFLOP/s)."""
        return {
            "bandwidth_gbs": self.bandwidth_bytes_per_s / 1e9,
            "matmul_fp32_gflops": self.peak_flops / 1e9,
        }

    @property
    def ridge_flops_per_byte(self) -> float:
        """The arithmetic intensity above which an operation is compute-bound on this device."""
        return self.peak_flops / self.bandwidth_bytes_per_s


# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peak with fp32 accumulation, and peak memory bandwidth, as
# the vendors publish them. GPU decode runs in bf16, so these pair with dtype="bf16".
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100",  # H100 SXM5 80GB: HBM3 3.35 TB/s, BF16 dense 989.4 TFLOPS (1979 with sparsity)
            3.35e12,
            989.4e12,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5), nvidia.com/en-us/data-center/h100",
        ),
        Hardware(
            "h100-pcie",  # H100 PCIe 80GB: HBM2e 2.0 TB/s, BF16 dense 756 TFLOPS
            2.0e12,
            756.0e12,
            "NVIDIA H100 Tensor Core GPU datasheet (PCIe), nvidia.com/en-us/data-center/h100",
        ),
        Hardware(
            "h200",  # H200 SXM 141GB: HBM3e 4.8 TB/s, BF16 dense 989 TFLOPS (same tensor cores as H100)
            4.8e12,
            989.4e12,
            "NVIDIA H200 Tensor Core GPU datasheet (SXM), nvidia.com/en-us/data-center/h200",
        ),
        Hardware(
            "a100",  # A100 80GB SXM: HBM2e 2,039 GB/s, BF16 dense 312 TFLOPS
            2.039e12,
            312e12,
            "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), nvidia.com/en-us/data-center/a100",
        ),
        Hardware(
            "a100-40g",  # A100 40GB SXM: HBM2 1,555 GB/s, BF16 dense 312 TFLOPS
            1.555e12,
            312e12,
            "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM), nvidia.com/en-us/data-center/a100",
        ),
        Hardware(
            "l4",  # L4 24GB: GDDR6 300 GB/s, BF16 dense 121 TFLOPS (242 with sparsity)
            300e9,
            121e12,
            "NVIDIA L4 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/l4",
        ),
        Hardware(
            "rtx4090",  # GeForce RTX 4090: GDDR6X 1,008 GB/s; FP16/BF16 tensor, FP32 accumulate 165.2 TFLOPS
            1.008e12,
            165.2e12,
            "NVIDIA Ada Lovelace GPU Architecture whitepaper v2.1, Appendix A (GeForce RTX 4090)",
        ),
        Hardware(
            "mi300x",  # AMD Instinct MI300X: HBM3 5.3 TB/s, BF16 dense 1307.4 TFLOPS
            5.3e12,
            1307.4e12,
            "AMD Instinct MI300X data sheet, amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
        ),
        Hardware(
            "apple-m2",  # Apple M2: 100 GB/s unified memory, 10-core GPU 3.6 TFLOPS (fp32)
            100e9,
            3.6e12,
            "Apple M2 press release (June 2022), apple.com/newsroom/2022/06/apple-unveils-m2",
        ),
    )
}
ALIASES = {"h100-sxm": "h100", "a100-80g": "a100", "h200-sxm": "h200", "4090": "rtx4090"}
MEASURED = "cpu-measured"


def measured_cpu(threads: int | None = None, mib: int = 256, repeats: int = 3) -> Hardware:
    """This machine at ``threads`` torch threads (default: the current count), measured now: read/copy
    bandwidth and fp32 matmul throughput (``kvlm.bench.hardware.measure_hardware``)."""
    from kvlm.bench.hardware import measure_hardware  # imports transformers' version: only when measuring

    before = torch.get_num_threads()
    threads = threads or before
    torch.set_num_threads(threads)
    try:
        hw = measure_hardware(torch.device("cpu"), mib=mib, repeats=repeats)
    finally:
        torch.set_num_threads(before)
    return from_measurement(hw, f"{MEASURED} ({threads} threads)")


def from_measurement(hw: dict[str, float], name: str = MEASURED) -> Hardware:
    """A ``Hardware`` from ``measure_hardware``'s dict (GB/s, GFLOP/s), e.g. the one a bench run recorded."""
    return Hardware(
        name,
        hw["bandwidth_gbs"] * 1e9,
        hw["matmul_fp32_gflops"] * 1e9,
        "measured by kvlm.bench.hardware.measure_hardware",
        "fp32",  # the matmul peak is measured in float32, the dtype kvlm decodes in on CPU
    )


def get_hardware(name: str, threads: int | None = None) -> Hardware:
    """A ``HARDWARE`` entry by name (or alias), or ``cpu-measured`` (measured now)."""
    key = name.strip().lower()
    if key == MEASURED:
        return measured_cpu(threads)
    key = ALIASES.get(key, key)
    if key not in HARDWARE:
        raise ConfigError(f"unknown hardware {name!r}; known: {', '.join([MEASURED, *HARDWARE, *ALIASES])}")
    return HARDWARE[key]


def step_operations(
    cfg: ModelConfig,
    batch: int,
    context: int,
    dtype: str = "bf16",
    cache_dtype: str | None = None,
    mode: str = "auto",
) -> dict[str, dict]:
    """{operation class: {"bytes", "flops"}} of one decode step of ``batch`` sequences with ``context``
    cached tokens each: weights in ``dtype``, the cache in ``cache_dtype`` (default ``dtype``), the route
    ``mode`` selects."""
    if batch < 1 or context < 0:
        raise ConfigError(f"need batch >= 1 and context >= 0, got batch={batch}, context={context}")
    for d in (dtype, cache_dtype or dtype):
        if d not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {d!r}; known: {', '.join(DTYPE_BYTES)}")
    from kvlm.model import KVLM

    with torch.device("meta"):  # parameter shapes only, no memory: works for the largest presets
        model = KVLM(cfg)
    w = weight_classes(model)
    wb = DTYPE_BYTES[dtype]
    built = next(model.parameters()).element_size()  # weight_classes counts bytes in the built dtype
    norm_elements = w["norm_bytes"] // built
    weights = {
        "gemm_elements": w["gemm_elements"],
        "gemm_bytes": w["gemm_elements"] * wb,
        "norm_bytes": norm_elements * wb,
        "lm_head_elements": w["lm_head_elements"],
        "lm_head_bytes": w["lm_head_elements"] * wb,
    }
    attention = attention_cost(cfg, batch, context, mode, DTYPE_BYTES[cache_dtype or dtype])
    return operation_classes(weights, attention, batch)


def project_decode(
    cfg: ModelConfig,
    hw: Hardware,
    batch: int,
    context: int,
    dtype: str | None = None,
    cache_dtype: str | None = None,
    mode: str = "auto",
) -> dict:
    """The decode step's floor on ``hw`` with weights in ``dtype`` (default: the hardware's) and the cache
    in ``cache_dtype`` (default ``dtype``): per operation its bytes, FLOPs, bandwidth and compute floors (ms),
    the binding one (``bound``) and its share of the step; ``ms_per_step`` (the sum of the operations'
    floors), ``ms_per_token`` (per generated token: the step over ``batch``) and ``tokens_per_s``."""
    dtype = dtype or hw.dtype
    ops = operation_roofline(
        step_operations(cfg, batch, context, dtype, cache_dtype, mode), hw.roofline_limits()
    )
    step_ms = sum(op["floor_ms"] for op in ops.values())
    for op in ops.values():
        compute = op["compute_floor_ms"]
        op["bound"] = "compute" if compute is not None and compute > op["bandwidth_floor_ms"] else "memory"
        op["share"] = op["floor_ms"] / step_ms if step_ms else 0.0
    return {
        "hardware": asdict(hw),
        "batch": batch,
        "context": context,
        "dtype": dtype,
        "cache_dtype": cache_dtype or dtype,
        "mode": mode,
        "operations": ops,
        "bytes_per_step": sum(op["bytes"] for op in ops.values()),
        "ms_per_step": step_ms,
        "ms_per_token": step_ms / batch,
        "tokens_per_s": batch / (step_ms * 1e-3) if step_ms else float("inf"),
    }


def projection_rows(
    models: dict[str, ModelConfig],
    hardware: list[Hardware],
    batch: int,
    context: int,
    cache_dtype: str | None = None,
) -> list[dict]:
    """One row per model: its projected decode on each hardware (``project_decode``), keyed by name."""
    rows = []
    for name, cfg in models.items():
        proj = {hw.name: project_decode(cfg, hw, batch, context, cache_dtype=cache_dtype) for hw in hardware}
        rows.append({"name": name, "attention": cfg.attention, "projections": proj})
    return rows


def format_projection(rows: list[dict], hardware: list[Hardware]) -> str:
    """A markdown table: per model and hardware the floor in ms per step and per token, and the operation
    that takes most of it (e.g. "attention:compute")."""
    head = ["model"]
    for hw in hardware:
        head += [f"{hw.name} ms/step", "ms/token", "mostly"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:|---:|---" * len(hardware) + "|"]
    for r in rows:
        cells = [r["name"]]
        for hw in hardware:
            p = r["projections"][hw.name]
            top, op = max(p["operations"].items(), key=lambda kv: kv[1]["floor_ms"])
            cells.append(f"{p['ms_per_step']:.3g} | {p['ms_per_token']:.3g} | {top}:{op['bound']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
