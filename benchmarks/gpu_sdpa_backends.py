"""Which SDPA backend runs MHA / GQA decode on a GPU, and what each would cost (issue 15, a check prepared for the
next session with a GPU).

benchmarks/gpu-costmodel.md found GQA's attention at batch 1 on an H200 27-53x its floor: kvlm folds a group's
query heads into the query axis and calls ``F.scaled_dot_product_attention``, and few programs run. PyTorch's
flash forward splits the key axis at decode (``set_params_splitkv`` in its ``mha_fwd``) and swaps the group into
the query axis itself, so the slowness suggests another backend ran (cuDNN or memory-efficient, which do not
split). This script answers it: for each shape, variant and cell, kvlm's whole decode step in bf16 captured in a
CUDA graph (``gpu_costmodel.StepTimer``) with SDPA left to choose (``default``) and forced to each backend
(``torch.nn.attention.sdpa_kernel``); the CUDA kernels the eager step launched (torch.profiler), and the step at one
cached token, so that attention = step - that, against the cache's bytes over the measured copy bandwidth.

    python benchmarks/gpu_sdpa_backends.py --out DIR            # a CUDA machine, ~2 min
    KVLM_KERNELS=0 python benchmarks/gpu_sdpa_backends.py --quick --out DIR   # CPU: checks the script

Writes DIR/gpu-sdpa-backends.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from gpu_costmodel import QUICK, SHAPES, StepTimer, measure_gpu  # this folder
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from kvlm.bench.hardware import machine_info
from kvlm.bench.plan import parse_variant
from kvlm.config import spec_numel
from kvlm.model import build_model

BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
CELLS = [(1, 8192), (1, 16384), (8, 4096), (32, 8192)]
QUICK_CELLS = [(1, 64), (2, 128)]
ATTENTION_WORDS = ("flash", "fmha", "attention", "attn", "cudnn", "sdpa", "softmax")


def kernels_launched(step, device: torch.device) -> list[str]:
    """Names of the attention-like kernels (CUDA; aten operators on CPU) one eager step ran, by total time."""
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        step()
    names = [
        (e.self_device_time_total if device.type == "cuda" else e.self_cpu_time_total, e.key)
        for e in prof.key_averages()
    ]
    return [k for _, k in sorted(names, reverse=True) if any(w in k.lower() for w in ATTENTION_WORDS)][:3]


def cell_rows(
    model, spec: str, shape: str, batch: int, context: int, device, bandwidth_gbs: float
) -> list[dict]:
    per_token = sum(spec_numel(s) for s in model.cache_specs()) * model.embed.weight.element_size()
    floor_ms = per_token * batch * context / (bandwidth_gbs * 1e6)
    with torch.inference_mode():
        one = StepTimer(model, batch, 1, "auto", device).ms()
    rows = []
    for name, backend in BACKENDS.items():
        row = dict(
            shape=shape, variant=spec, batch=batch, context=context, backend=name, attention_floor_ms=floor_ms
        )
        try:
            with torch.inference_mode(), sdpa_kernel([backend] if backend else list(BACKENDS.values())[1:]):
                timer = StepTimer(model, batch, context, "auto", device)
                row.update(how=timer.how, kernels=kernels_launched(timer.eager, device), ms=timer.ms())
                del timer
            row.update(ms_one_token=one, attention_ms=row["ms"] - one)
        except RuntimeError as e:  # a backend that does not take this shape or device
            row["unavailable"] = str(e).splitlines()[0][:160]
        rows.append(row)
        print(json.dumps(row), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> list[str]:
    out = [
        "| shape | variant | batch | context | backend | ms/step | attention ms | attention x floor | kernels |",
        "|---|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "unavailable" in r:
            cells = ["", "", "", "unavailable: " + r["unavailable"]]
        else:
            x = r["attention_ms"] / r["attention_floor_ms"] if r["attention_floor_ms"] else float("nan")
            cells = [f"{r['ms']:.3f}", f"{r['attention_ms']:.3f}", f"{x:.2f}", ", ".join(r["kernels"])]
        head = [r["shape"], r["variant"], str(r["batch"]), str(r["context"]), r["backend"]]
        out.append("| " + " | ".join(head + cells) + " |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a toy shape and small cells (checks the script)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, cells = (QUICK, QUICK_CELLS) if args.quick else (SHAPES, CELLS)
    hw = measure_gpu(device, dtype)
    rows = []
    for shape_name, (shape, variants) in shapes.items():
        for spec in [v for v in variants if not v.startswith("mla")]:
            _, cfg = parse_variant(spec, shape)
            cfg = cfg.replace(max_seq_len=max(c for _, c in cells) + 2)
            model = build_model(cfg, device=device, dtype=dtype).eval().prepare_for_inference()
            for batch, context in cells:
                rows += cell_rows(model, spec, shape_name, batch, context, device, hw["bandwidth_gbs"])
            del model
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_info(device), "hardware": hw, "rows": rows}
    (args.out / "gpu-sdpa-backends.json").write_text(json.dumps(result, indent=1))
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
