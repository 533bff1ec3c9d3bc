"""Benchmark of the Triton absorbed-latent decode kernel (kvlm.kernels.triton_decode) on a CUDA GPU.

    PYTHONPATH=. python benchmarks/triton_decode.py --out DIR [--budget-s 150] [--sweep]

For each shape (D_c + d_R, heads H, batch B, context S, new tokens T, cache dtype) it times
- the kernel over a paged cache (page size 64, pages shuffled in the pool, as a serving cache holds them),
- the same kernel over the contiguous cache (one page of S slots per sequence, zero copy),
- kvlm's plain absorbed path on CUDA (kvlm.attention.latent_ops.latent_attention: RoPE scores as an additive mask
  into PyTorch SDPA over the latent, contiguous cache; for int8 the dequantisation it would need is not timed),
and the roofline: max(cache bytes read / HBM bandwidth, FLOPs / peak), with the bandwidth both the H100 SXM spec
(3.35 TB/s) and measured in this run (a device-to-device copy, read + write bytes / time), peak the bf16 dense
spec (989 TFLOP/s).

Timing: each call is captured in a CUDA graph (what a serving engine does for decode, so the Python launch cost of
~0.1 ms does not hide the kernel), over enough distinct copies of the cache that together exceed L2 three times
(each call reads its latents from HBM, as in a real step where other layers evict them); ms per call = graph
replay time / copies. "eager ms" is the plain launched call (triton.testing.do_bench, L2 flushed), launch cost
included. Writes triton_decode.json and triton_decode.md under --out; stops adding shapes when --budget-s runs
out. ``--sweep`` first times a few launch configs on representative shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from kvlm.attention.latent_ops import latent_attention
from kvlm.attention.step import Step
from kvlm.kernels.triton_decode import Config, choose_splits, default_config, latent_decode_paged

DEVICE = "cuda"  # a CPU dry run of this script (TRITON_INTERPRET=1) sets "cpu"
SPEC_BW = 3.35e12  # H100 SXM5 HBM3, NVIDIA H100 datasheet
SPEC_BF16 = 989e12  # H100 SXM5 bf16 dense tensor core, same datasheet


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    x = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def build(B, H, T, D, DR, S, cache, page_size, contiguous, seed=0):
    """Queries and a cache of S keys per sequence (the T new tokens last). Returns (kernel kwargs, plain args)."""
    dev = DEVICE
    g = torch.Generator(device=dev).manual_seed(seed)
    qdt = torch.float16 if cache == "fp16" else torch.bfloat16
    q = torch.randn(B, H, T, D, device=dev, dtype=qdt, generator=g)
    q_r = torch.randn(B, H, T, DR, device=dev, dtype=qdt, generator=g) if DR else None
    if contiguous:
        P, n_blocks = S, 1
        table = torch.arange(B, dtype=torch.int32, device=dev)[:, None]
        n_pages = B
    else:
        P, n_blocks = page_size, math.ceil(S / page_size)
        n_pages = B * n_blocks
        table = torch.randperm(n_pages, device=dev, generator=g).to(torch.int32).view(B, n_blocks)
    c = torch.randn(n_pages, P, D, device=dev, dtype=qdt, generator=g)
    r = torch.randn(n_pages, P, DR, device=dev, dtype=qdt, generator=g) if DR else None
    c_s = r_s = None
    if cache == "int8":
        c_s = c.float().abs().amax(-1, keepdim=True) / 127
        c = (c.float() / c_s).round().to(torch.int8)
        if DR:
            r_s = r.float().abs().amax(-1, keepdim=True) / 127
            r = (r.float() / r_s).round().to(torch.int8)
    kw = dict(
        q_lat=q, q_rope=q_r, c_kv_pool=c, k_rope_pool=r, block_table=table,
        start=torch.zeros(B, dtype=torch.int32, device=dev), end=torch.full((B,), S, dtype=torch.int32, device=dev),
        page_size=P, softmax_scale=1 / math.sqrt(D + DR), c_kv_scale=c_s, k_rope_scale=r_s,
    )  # fmt: skip
    return kw


def plain_fn(kw, T, S):
    """kvlm's absorbed path on the contiguous cache (bf16/fp16 only)."""
    c = kw["c_kv_pool"][:, :S]
    r = kw["k_rope_pool"][:, :S] if kw["k_rope_pool"] is not None else None
    B = c.shape[0]
    step = Step(positions=torch.arange(S - T, S, device=c.device).expand(B, T), start=S - T, end=S)
    return lambda: latent_attention(kw["q_lat"], kw["q_rope"], c, r, c, step, kw["softmax_scale"])


def cost(B, H, T, D, DR, S, cache):
    item = {"bf16": 2, "fp16": 2, "int8": 1}[cache]
    per_key = (D + DR) * item + (8 if cache == "int8" else 0)  # two fp32 scales per token
    bytes_ = B * S * per_key + 2 * B * H * T * (2 * D + DR)  # cache + queries + outputs
    flops = 2 * B * H * T * S * (2 * D + DR)  # scores (D + d_R) and p . c_kv (D)
    return bytes_, flops


def graph_ms(fns) -> float:
    """ms per call of the callables ``fns`` (each on its own buffers), captured back to back in one CUDA graph."""
    for f in fns:  # compile, and let an out-of-resources default config shrink, before capture
        f()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    n = int(min(200, max(3, 0.05 / max(time.perf_counter() - t, 1e-6))))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / (n * len(fns))


def copies(shape, cache, contiguous, l2_bytes):
    """Enough distinct caches of this shape to exceed L2 three times (at most 128)."""
    B, H, T, D, DR, S = shape
    k = int(min(128, max(1, math.ceil(3 * l2_bytes / cost(B, H, T, D, DR, S, cache)[0]))))
    return [build(B, H, T, D, DR, S, cache, 64, contiguous, seed=i) for i in range(k)]


# launch configs tried by --sweep: (block_m, block_n, num_warps, num_stages); block_m above the rows is skipped
SWEEP = [(64, 32, 8, 2), (64, 64, 8, 2), (64, 64, 8, 3), (64, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2),
         (16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 64, 8, 2),
         (16, 32, 4, 3), (16, 32, 4, 4), (16, 64, 4, 4), (16, 32, 8, 3), (16, 16, 4, 4), (16, 128, 8, 3)]  # fmt: skip
SWEEP_SHAPES = [(8, 128, 1, 512, 64, 4096), (8, 16, 1, 512, 64, 4096)]  # (B, H, T, D_c, d_R, S)


def sweep(out_rows, budget_end, l2_bytes, shapes=SWEEP_SHAPES):
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in shapes:
        B, H, T, D, DR, S = shape
        kws = copies(shape, "bf16", False, l2_bytes)
        base = default_config(H * T, D, DR, 2)
        n = choose_splits(B, triton.cdiv(H * T, base.block_m), S, base.block_n, sm, base.block_m)
        cfgs = [base] + [Config(*c) for c in SWEEP if Config(*c) != base]
        cfgs += [replace(base, num_splits=max(1, int(n * m))) for m in (0.5, 2)]
        # the rule before the sweep of 2026-11-28 (2 programs per SM, 2 tiles per split), for comparison
        old = choose_splits(B, triton.cdiv(H * T, base.block_m), S, base.block_n, sm, per_sm=2, min_tiles=2)
        cfgs += [replace(base, num_splits=old)] if old != n else []
        for cfg in cfgs:
            if cfg.block_m > max(16, triton.next_power_of_2(H * T)) or time.time() > budget_end:
                continue
            try:
                ms = graph_ms([lambda c=cfg, kw=kw: latent_decode_paged(**kw, config=c) for kw in kws])
            except Exception as err:  # noqa: BLE001 - a config that does not compile is a result too
                ms = None
                print("sweep", shape, cfg, type(err).__name__, flush=True)
            out_rows.append(
                dict(shape=list(shape), config=cfg.__dict__, default=cfg == base, splits=n, ms=ms)
            )
            if ms is not None:
                gbs = cost(*shape, "bf16")[0] / ms / 1e6
                print(f"sweep {shape} {cfg} splits {n}: {ms:.4f} ms, {gbs:.0f} GB/s", flush=True)
        del kws
        torch.cuda.empty_cache()


def measure(shape, cache, l2_bytes) -> dict:
    B, H, T, D, DR, S = shape
    row = {}
    kws = copies(shape, cache, False, l2_bytes)
    row["paged_ms"] = graph_ms([lambda kw=kw: latent_decode_paged(**kw) for kw in kws])
    row["eager_ms"] = do_bench(lambda kw=kws[0]: latent_decode_paged(**kw), warmup=5, rep=25)
    del kws
    kws = copies(shape, cache, True, l2_bytes)
    row["contig_ms"] = graph_ms([lambda kw=kw: latent_decode_paged(**kw) for kw in kws])
    if cache != "int8":
        try:
            row["plain_ms"] = graph_ms([plain_fn(kw, T, S) for kw in kws])
        except Exception as err:  # noqa: BLE001 - a path that cannot be captured is timed eagerly
            print("plain path not capturable:", type(err).__name__, err, flush=True)
            row["plain_ms"] = do_bench(plain_fn(kws[0], T, S), warmup=5, rep=25)
            row["plain_eager"] = True
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-shapes", default="", help="B,H,T,D_c,d_R,S;... (default: the two of SWEEP_SHAPES)")
    ap.add_argument("--sweep-only", action="store_true", help="the sweep alone, over the whole budget")
    args = ap.parse_args()
    sweep_shapes = [tuple(int(x) for x in s.split(",")) for s in args.sweep_shapes.split(";") if s]
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    bw = copy_bandwidth()
    result = dict(
        device=props.name, sms=props.multi_processor_count, l2_bytes=l2, torch=torch.__version__,
        triton=triton.__version__, copy_bandwidth=bw, spec_bandwidth=SPEC_BW, spec_bf16=SPEC_BF16, rows=[],
        sweep=[],
    )  # fmt: skip
    print(f"{props.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if args.sweep or args.sweep_only:
        share = 1.0 if args.sweep_only else 0.2
        sweep(result["sweep"], t0 + args.budget_s * share, l2, sweep_shapes or SWEEP_SHAPES)
    if args.sweep_only:
        (args.out / "triton_sweep.json").write_text(json.dumps(result, indent=1))
        return
    # most telling first, so that a spent budget drops the least: bf16 grid, extras, then int8
    grid = [(B, H, 1, D, DR, S) for D, DR in ((512, 64), (256, 32)) for H in (128, 16) for B in (1, 8, 64)
            for S in (1024, 4096, 32768)]  # fmt: skip
    shapes = [(*g, "bf16") for g in grid]
    shapes += [((8, 16, 4, 256, 32, 4096), "bf16"), ((8, 128, 4, 512, 64, 4096), "bf16")]  # T = 4
    shapes += [((8, 16, 1, 256, 32, 4096), "fp16"), ((8, 16, 1, 200, 0, 4096), "bf16")]
    shapes += [((8, 16, 1, 96, 64, 4096), "bf16")]  # odd widths
    shapes += [(g, "int8") for g in grid if g[0] >= 8 and g[5] >= 4096]
    shapes = [(s[:6], s[6]) if len(s) == 7 else s for s in shapes]
    for shape, cache in shapes:
        if time.time() - t0 > args.budget_s:
            print("budget spent, stopping", flush=True)
            break
        B, H, T, D, DR, S = shape
        row = dict(B=B, H=H, T=T, D_c=D, d_R=DR, S=S, cache=cache)
        bytes_, flops = cost(B, H, T, D, DR, S, cache)
        row.update(bytes=bytes_, flops=flops)
        row["floor_spec_ms"] = max(bytes_ / SPEC_BW, flops / SPEC_BF16) * 1e3
        row["floor_copybw_ms"] = max(bytes_ / bw, flops / SPEC_BF16) * 1e3  # the copy's read + write rate
        try:
            row.update(measure(shape, cache, l2))
        except torch.cuda.OutOfMemoryError as err:
            row["error"] = f"out of memory: {err}"[:200]
        torch.cuda.empty_cache()
        if "paged_ms" in row:
            row["paged_TBps"] = bytes_ / row["paged_ms"] / 1e9
            row["paged_TFLOPs"] = flops / row["paged_ms"] / 1e9
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    (args.out / "triton_decode.json").write_text(json.dumps(result, indent=1))
    (args.out / "triton_decode.md").write_text(report(result))
    print(report(result))
    print(f"total {time.time() - t0:.0f} s")


def report(result) -> str:
    lines = [
        f"device {result['device']}, {result['sms']} SMs, torch {result['torch']}, triton {result['triton']}; "
        f"copy {result['copy_bandwidth'] / 1e12:.2f} TB/s (read + write), spec {SPEC_BW / 1e12} TB/s",
        "",
        "| B | H | T | D_c+d_R | S | cache | MB read | paged ms | contiguous ms | plain (SDPA) ms | eager ms "
        "| floor ms | TB/s | TFLOP/s | floor / paged | copy-bw floor / paged | plain / paged |",
        "|--:|--:|--:|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in result["rows"]:
        head = f"| {r['B']} | {r['H']} | {r['T']} | {r['D_c']}+{r['d_R']} | {r['S']} | {r['cache']} | "
        if "paged_ms" not in r:
            lines.append(head + f"{r.get('error', '')} |")
            continue
        plain, paged = r.get("plain_ms"), r["paged_ms"]
        plain_s = "" if plain is None else f"{plain:.4f}" + (" (eager)" if r.get("plain_eager") else "")
        lines.append(
            head
            + f"{r['bytes'] / 1e6:.1f} | {paged:.4f} | {r['contig_ms']:.4f} | {plain_s} | {r['eager_ms']:.4f} | "
            f"{r['floor_spec_ms']:.4f} | {r['paged_TBps']:.2f} | {r['paged_TFLOPs']:.0f} | "
            f"{r['floor_spec_ms'] / paged:.2f} | {r['floor_copybw_ms'] / paged:.2f} | "
            f"{'' if plain is None else f'{plain / paged:.1f}x'} |"
        )
    if result["sweep"]:
        lines += ["", "sweep (bf16, paged 64, CUDA graph): shape [B, H, T, D_c, d_R, S], config, ms", ""]
        for s in result["sweep"]:
            lines.append(f"- {s['shape']} {s['config']} {'default ' if s['default'] else ''}{s['ms']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
