"""The cost model (``kvlm.bench.costmodel.project_decode``) against a GPU's decode step (issue 15).

For each shape, mechanism, route, batch and context: kvlm's whole decode step in bf16 (one new token per
sequence, the cache holding ``context`` tokens), captured in a CUDA graph and replayed, so that launch cost does
not hide the hardware; the same step at one cached token (weights and LM head: the rest is attention). Set against
the per-operation floor that ``project_decode`` projects from the model's own accounting, with the GPU's copy
bandwidth and bf16 matmul peak measured in the same run, and with the vendor's spec (``HARDWARE``). The mechanisms'
order by projected floor is set against their order by measured time: what ``kvlm compare``'s cost columns claim.

    python benchmarks/gpu_costmodel.py --out DIR             # a CUDA machine, ~2-3 min
    python benchmarks/gpu_costmodel.py --quick --out DIR     # CPU or GPU, a toy shape: checks the script

Writes DIR/gpu-costmodel.json and DIR/gpu-costmodel.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from kvlm import kernels
from kvlm.bench.costmodel import ALIASES, HARDWARE, Hardware, project_decode
from kvlm.bench.hardware import machine_info
from kvlm.bench.plan import parse_variant
from kvlm.bench.suites import REFERENCE_SHAPE
from kvlm.config import spec_numel
from kvlm.model import build_model

SHAPES = {
    # the lead's reference shape (6 layers, d 768, 12 heads of 64, SwiGLU 2048, vocabulary 32000)
    "reference": (
        dict(REFERENCE_SHAPE),
        ["mha", "gqa:n_kv_head=3", "mla:kv_lora_rank=256:rope_head_dim=32"],
    ),
    # a ~1B model (16 layers, d 2048, 16 heads of 128): DeepSeek-V2's latent 512 + 64
    "1b": (
        dict(n_layer=16, d_model=2048, n_head=16, vocab_size=32000),
        ["mla:kv_lora_rank=512:rope_head_dim=64", "gqa:n_kv_head=4", "mha"],
    ),
}
CELLS = [(1, 8192), (8, 4096), (32, 8192), (64, 16384)]
QUICK = {
    "toy": (
        dict(n_layer=2, d_model=64, n_head=4, vocab_size=256),
        ["mha", "gqa:n_kv_head=2", "mla:kv_lora_rank=32:rope_head_dim=8"],
    )
}
QUICK_CELLS = [(1, 64), (2, 128)]
CACHE_LIMIT_GB = (
    40.0  # cells whose cache would exceed this are skipped (H100: 80 GB; the naive MLA cache too)
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, rounds: int = 7, min_s: float = 0.02) -> float:
    """Median over rounds of ms per call; each round repeats ``fn`` until it has run ``min_s`` seconds."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    reps = max(1, int(min_s / max(time.perf_counter() - t0, 1e-6)))
    out = []
    for _ in range(rounds):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return statistics.median(out)


def measure_gpu(device: torch.device, dtype: torch.dtype) -> dict:
    """Copy bandwidth (bytes read + written / time, 2 GiB) and matmul peak (8192^3 in ``dtype``)."""
    n = 2**29 if device.type == "cuda" else 2**24
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    copy_ms = timed(lambda: dst.copy_(src), device, rounds=5)
    src = dst = None
    m = 8192 if device.type == "cuda" else 1024
    a = torch.randn(m, m, device=device, dtype=dtype)
    b = torch.randn(m, m, device=device, dtype=dtype)
    mm_ms = timed(lambda: torch.mm(a, b), device, rounds=5)
    return {"bandwidth_gbs": 2 * n * 4 / copy_ms / 1e6, "matmul_gflops": 2 * m**3 / mm_ms / 1e6}


class CaptureFailed(RuntimeError):
    """The decode step could not be captured in a CUDA graph (the run stops there and writes what it has)."""


class StepTimer:
    """One decode step of ``model`` over a cache holding ``context`` tokens, the same step replayed (it writes
    the same slot each time): captured in a CUDA graph on a GPU, eager on CPU (or when capture fails)."""

    def __init__(self, model, batch: int, context: int, mode: str, device: torch.device):
        self.cache = model.new_cache(batch, context + 1, naive=(mode == "naive"))
        self.cache.fill_random_(context, model.cfg.vocab_size)
        self.context = context
        tokens = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)

        def step():
            self.cache.length = context
            return model(tokens, cache=self.cache, mode=mode, last_only=True)

        self.eager = step
        self.how = "eager"
        self.call = step
        if device.type == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.out = step()
            except Exception as e:  # a failed capture leaves CUDA unusable in this process: stop the run
                raise CaptureFailed(f"{type(e).__name__}: {e}") from e
            self.call, self.how = graph.replay, "cuda graph"
            self.cache.length = context

    def ms(self) -> float:
        return timed(self.call, self.cache.device)


def measure_cells(shapes: dict, cells: list, device: torch.device, dtype: torch.dtype, rows: list) -> None:
    """Appends a row per (shape, variant, route, cell): the step at its context and at one cached token."""
    for shape_name, (shape, variants) in shapes.items():
        for spec in variants:
            _, cfg = parse_variant(spec, shape)
            cfg = cfg.replace(max_seq_len=max(c for _, c in cells) + 2)
            model = build_model(cfg, device=device, dtype=dtype).eval().prepare_for_inference()
            modes = ["absorbed", "naive"] if cfg.attention == "mla" else ["auto"]
            for mode in modes:
                for batch, context in cells:
                    naive = mode == "naive"
                    per_token = sum(spec_numel(s) for s in model.cache_specs(naive=naive)) * dtype.itemsize
                    gb = per_token * batch * (context + 1) / 1e9
                    row = dict(
                        shape=shape_name, variant=spec, mode=mode, batch=batch, context=context, cache_gb=gb
                    )
                    if gb > CACHE_LIMIT_GB:
                        rows.append({**row, "skipped": f"cache {gb:.0f} GB > {CACHE_LIMIT_GB:.0f}"})
                        continue
                    print(f"{shape_name} {spec} {mode} b{batch} ctx{context} ({gb:.2f} GB)", flush=True)
                    with torch.inference_mode():
                        calls = dict(kernels.CALLS)
                        long = StepTimer(model, batch, context, mode, device)
                        used = {
                            k: v - calls.get(k, 0) for k, v in kernels.CALLS.items() if v != calls.get(k, 0)
                        }
                        row.update(how=long.how, kernel_calls=used, ms=long.ms())
                        del long
                        short = StepTimer(model, batch, 1, mode, device)
                        row.update(ms_one_token=short.ms())
                        del short
                    rows.append(row)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del model


def spec_for(gpu_name: str | None) -> Hardware | None:
    """The ``HARDWARE`` entry of the GPU ``torch.cuda.get_device_name`` names, if there is one."""
    if not gpu_name:
        return None
    name = gpu_name.lower()
    for key in ("h200", "h100", "a100", "l4", "4090", "mi300x"):
        if key in name:
            key = ALIASES.get(key, key)
            if key == "h100" and "pcie" in name:
                key = "h100-pcie"
            return HARDWARE[key]
    return None


def run(quick: bool, only: list[str] | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dname = "bf16" if dtype == torch.bfloat16 else "fp32"
    torch.manual_seed(0)
    info = machine_info(device)
    hw_before = measure_gpu(device, dtype)
    shapes, cells = (QUICK, QUICK_CELLS) if quick else (SHAPES, CELLS)
    if only:
        shapes = {k: v for k, v in shapes.items() if k in only}
    rows = []
    try:
        measure_cells(shapes, cells, device, dtype, rows)
    except CaptureFailed as e:
        print(f"stopped: {e}", flush=True)
        rows.append({"stopped": str(e)[:2000]})
    rows, stopped = [r for r in rows if "stopped" not in r], [r["stopped"] for r in rows if "stopped" in r]
    hw_after = hw_before if stopped else measure_gpu(device, dtype)  # CUDA is unusable after a failed capture
    hw = {k: max(hw_before[k], hw_after[k]) for k in hw_before}
    measured = Hardware(
        f"{info.get('gpu') or 'cpu'} (measured)", hw["bandwidth_gbs"] * 1e9, hw["matmul_gflops"] * 1e9,
        "benchmarks/gpu_costmodel.py: copy bandwidth and torch.mm peak, this run", dname,
    )  # fmt: skip
    spec_hw = spec_for(info.get("gpu"))
    for r in rows:
        if "skipped" in r:
            continue
        _, cfg = parse_variant(r["variant"], shapes[r["shape"]][0])
        for key, hw_ in (("measured", measured), ("spec", spec_hw)):
            if hw_ is None:
                continue
            long = project_decode(cfg, hw_, r["batch"], r["context"], dname, mode=r["mode"])
            one = project_decode(cfg, hw_, r["batch"], 1, dname, mode=r["mode"])
            r[f"floor_ms_{key}"] = long["ms_per_step"]
            r[f"floor_one_ms_{key}"] = one["ms_per_step"]
            if key == "measured":
                att = long["operations"]["attention"]
                r["attention_floor_ms"] = att["floor_ms"]
                r["attention_bound"] = att["bound"]
                r["attention_flops_per_byte"] = att["flops_per_byte"]
        r["x_floor"] = r["ms"] / r["floor_ms_measured"]
        r["x_floor_one_token"] = r["ms_one_token"] / r["floor_one_ms_measured"]
        r["attention_ms"] = r["ms"] - r["ms_one_token"]
        r["attention_x"] = r["attention_ms"] / r["attention_floor_ms"] if r["attention_floor_ms"] else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": info,
        "dtype": dname,
        "hardware_before": hw_before,
        "hardware_after": hw_after,
        "measured": measured.__dict__,
        "spec": spec_hw.__dict__ if spec_hw else None,
        "rows": rows,
        "stopped": stopped,
        "order": orders(rows),
    }


def orders(rows: list[dict]) -> list[dict]:
    """Per shape and cell: the routes ranked by projected floor and by measured time (MLA absorbed only, the
    route ``auto`` takes on a GPU, beside MHA and GQA)."""
    out = []
    cells = sorted({(r["shape"], r["batch"], r["context"]) for r in rows})
    for shape, batch, context in cells:
        here = [
            r for r in rows
            if (r["shape"], r["batch"], r["context"]) == (shape, batch, context) and "skipped" not in r
            and r["mode"] != "naive"
        ]  # fmt: skip
        if len(here) < 2:
            continue
        name = lambda r: r["variant"].split(":")[0]  # noqa: E731
        by_floor = [name(r) for r in sorted(here, key=lambda r: r["floor_ms_measured"])]
        by_time = [name(r) for r in sorted(here, key=lambda r: r["ms"])]
        out.append(dict(shape=shape, batch=batch, context=context, by_floor=by_floor, by_time=by_time,
                        agree=by_floor == by_time))  # fmt: skip
    return out


def markdown(res: dict) -> str:
    m, hb, ha = res["machine"], res["hardware_before"], res["hardware_after"]
    lines = [
        f"Run {res['date']}: {m.get('gpu') or m['cpu']}, torch {m['torch']}, {res['dtype']}. Measured: copy "
        f"{hb['bandwidth_gbs']:.0f} / {ha['bandwidth_gbs']:.0f} GB/s, matmul {hb['matmul_gflops'] / 1e3:.0f} / "
        f"{ha['matmul_gflops'] / 1e3:.0f} TFLOP/s (before / after); floors use the better of each.",
        "",
        "| shape | variant | route | batch | context | cache GB | timed as | ms/step | floor ms | x floor | "
        "spec floor ms | 1-token ms | x floor (1 token) | attention ms | attention floor ms | attention x | "
        "attention bound (FLOP/B) |",
        "|---|---|---|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in res["rows"]:
        head = f"| {r['shape']} | {r['variant']} | {r['mode']} | {r['batch']} | {r['context']} | {r['cache_gb']:.2f} |"
        if "skipped" in r:
            lines.append(head + f" {r['skipped']} |" + " |" * 11)
            continue
        spec = f"{r['floor_ms_spec']:.4f}" if "floor_ms_spec" in r else ""
        ax = f"{r['attention_x']:.2f}" if r["attention_x"] is not None else ""
        fpb = r["attention_flops_per_byte"]
        lines.append(
            head
            + f" {r['how']} | {r['ms']:.4f} | {r['floor_ms_measured']:.4f} | {r['x_floor']:.2f} | {spec} | "
            f"{r['ms_one_token']:.4f} | {r['x_floor_one_token']:.2f} | {r['attention_ms']:.4f} | "
            f"{r['attention_floor_ms']:.4f} | {ax} | {r['attention_bound']} ({fpb:.0f}) |"
        )
    for why in res["stopped"]:
        lines += ["", f"Stopped early, the step not captured: {why}"]
    lines += ["", "| shape | batch | context | order by projected floor | order by measured step | agree |",
              "|---|--:|--:|---|---|---|"]  # fmt: skip
    for o in res["order"]:
        lines.append(
            f"| {o['shape']} | {o['batch']} | {o['context']} | {' < '.join(o['by_floor'])} | "
            f"{' < '.join(o['by_time'])} | {'yes' if o['agree'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a toy shape and small cells (checks the script)")
    ap.add_argument("--shapes", default="", help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    args = ap.parse_args()
    only = [s for s in args.shapes.split(",") if s]
    res = run(args.quick, only)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu-costmodel" + "".join(f"-{s}" for s in only)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    table = markdown(res)
    (args.out / f"{stem}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
