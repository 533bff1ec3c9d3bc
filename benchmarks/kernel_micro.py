"""The CPU decode kernel alone (kvlm/kernels/csrc) at the bench reference shape, one layer: GFLOP/s, GB/s and
time against the per-operation floor max(bytes / bandwidth, FLOPs / peak), with bandwidth and peak measured here
at the same thread count (kvlm.bench.hardware). With ``--baseline REV`` the kernel sources of git revision REV
are built too (a separate extension) and both are timed interleaved in one process: medians of ``--repeats``
alternating rounds, so a busy shared machine slows both alike; base/new is the median over the rounds of the
ratio of the two runs of a round. The cache pools are in 2 MiB pages, as the model's caches are (before
2026-11-28 13:00 they were in 4 KiB pages, as ``KVLM_HUGE_PAGES=0`` still gives them; interleaved, 2 MiB pages
ran MLA and GQA-3 1.05-1.12x and MHA 0.92-0.93x as fast, benchmarks/decode-limit.md).

    OMP_NUM_THREADS=2 python benchmarks/kernel_micro.py --baseline HEAD     # ~1 min after the builds
    OMP_NUM_THREADS=2 python benchmarks/kernel_micro.py --baseline HEAD --define KVLM_NO_PREFETCH   # a build knob
    OMP_NUM_THREADS=2 python benchmarks/kernel_micro.py --baseline HEAD --page-size 16   # a serving cache's blocks
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from kvlm import kernels
from kvlm.bench.hardware import measure_hardware
from kvlm.cache.quantized import fp8_dtype, quantize
from kvlm.hugepages import zeros_in_huge_pages
from kvlm.kernels import cpu

ROOT = Path(__file__).resolve().parents[1]
CSRC = "kvlm/kernels/csrc"

# (name, query heads, KV groups, latent width (0: not latent), head / latent width, RoPE width, cache dtype)
CASES = [
    ("mla", 12, 1, True, 256, 32, "fp32"),
    ("mla-int8", 12, 1, True, 256, 32, "int8"),
    ("mla-fp8", 12, 1, True, 256, 32, "fp8"),
    ("mla-T2", 12, 1, True, 256, 32, "fp32"),  # -Tn: n new tokens a call (speculative verification)
    ("mla-T4", 12, 1, True, 256, 32, "fp32"),
    ("gqa-3", 12, 3, False, 64, 0, "fp32"),
    ("mha", 12, 12, False, 64, 0, "fp32"),
]


def build_baseline(rev: str, defines: tuple[str, ...] = ()):
    """The kernel extension built from the sources of git revision ``rev`` (cached by their hash), with the build
    knobs ``defines`` (e.g. ``KVLM_NO_PREFETCH``, ``KVLM_PREFETCH_TILES=4``: decode_avx512.h lists them)."""
    files = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{CSRC}"],
                           check=True, capture_output=True, text=True).stdout.split()  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="kvlm_kernel_base_"))
    digest = hashlib.sha1()
    for name in files:
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{CSRC}/{name}"],
                              check=True, capture_output=True).stdout  # fmt: skip
        (out / name).write_bytes(text)
        digest.update(text)
    from torch.utils.cpp_extension import load

    digest.update(" ".join(defines).encode())
    return load(name=f"kvlm_decode_base_{digest.hexdigest()[:10]}", sources=[str(out / "decode.cpp")],
                extra_cflags=cpu.build_flags() + [f"-D{d}" for d in defines], extra_ldflags=["-fopenmp"],
                verbose=False)  # fmt: skip


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """t copied into 2 MiB pages, as the model's caches are (kvlm.hugepages, which ``KVLM_HUGE_PAGES=0`` turns off;
    the hardware prefetchers stop at page boundaries, so a pool in 4 KiB pages is read differently)."""
    return zeros_in_huge_pages(tuple(t.shape), t.dtype).copy_(t)


def paged(t: torch.Tensor, P: int, perm: torch.Tensor) -> torch.Tensor:
    """(B, [G,] S, D) cached rows -> a pool of B S / P pages of P rows, (N, [G,] P, D), page k of the sequences'
    order stored at perm[k]."""
    S = t.shape[-2]
    # (B S / P, [G,] P, D) in the sequences' order
    pages = t.unflatten(-2, (S // P, P)).movedim(-3, 1).flatten(0, 1)
    out = torch.empty_like(pages)
    out[perm] = pages
    return out


def make_case(name, H, G, latent, D, dR, store, B, S, T, seed=0, page_size=0):
    """Arguments of decode_attention for one layer: B sequences of S cached tokens, the pools in 2 MiB pages as
    the model's caches (``in_huge_pages``); contiguous (one block each) or, with ``page_size`` P, in blocks of P
    tokens scattered over the pool in random order, as a paged cache's are after a while of serving."""
    gen = torch.Generator().manual_seed(seed)
    start, end = torch.zeros(B, dtype=torch.int32), torch.full((B,), S, dtype=torch.int32)
    P = page_size or S
    if S % P:
        raise SystemExit(f"--page-size {P} must divide --context {S}")
    perm = torch.randperm(B * (S // P), generator=gen)
    table = perm.view(B, S // P).to(torch.int32)
    if latent:
        pool = paged(torch.randn(B, 1, S, D, generator=gen), P, perm)
        q = torch.randn(B, 1, H * T, D, generator=gen)
        kr = paged(torch.randn(B, S, dR, generator=gen), P, perm) if dR else None
        qr = torch.randn(B, 1, H * T, dR, generator=gen) if dR else None
        scale = None
        if store in ("int8", "fp8"):
            pool, scale = quantize(pool, torch.int8 if store == "int8" else fp8_dtype())
        pool, kr = in_huge_pages(pool), None if kr is None else in_huge_pages(kr)
        kv_bytes = pool.numel() * pool.element_size() + (0 if scale is None else scale.numel() * 4)
        nbytes = kv_bytes + (0 if kr is None else kr.numel() * 4)
        flops = 2 * B * H * T * S * (2 * D + dR)
        args = (q, qr, pool, scale, pool, scale, kr, table, start, end, P, T, 1 / (D + dR) ** 0.5)
    else:
        k = in_huge_pages(paged(torch.randn(B, G, S, D, generator=gen), P, perm))
        v = in_huge_pages(paged(torch.randn(B, G, S, D, generator=gen), P, perm))
        q = torch.randn(B, G, H // G * T, D, generator=gen)
        nbytes = 2 * k.numel() * 4
        flops = 2 * B * H * T * S * 2 * D
        args = (q, None, k, None, v, None, None, table, start, end, P, T, D**-0.5)
    n_split = kernels.split_count(B * G, S, start, end)  # what kvlm.kernels._splits picks
    return args + (n_split,), flops, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=None, help="git revision whose kernel to time against (e.g. HEAD)")
    ap.add_argument("--define", nargs="*", default=[], metavar="KNOB[=V]", help="build knobs for the baseline")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument(
        "--page-size",
        type=int,
        default=0,
        help="cache blocks of this many tokens in random order (0: one block per sequence)",
    )
    ap.add_argument("--repeats", type=int, default=9, help="interleaved rounds (medians)")
    ap.add_argument("--layers", type=int, default=3,
                    help="distinct caches, called in turn, so that a layer is not read from the last level cache")
    ap.add_argument("--cases", default=",".join(c[0] for c in CASES if c[0] != "mla-T2"))
    ap.add_argument("--no-hardware", action="store_true", help="skip the bandwidth / peak measurement")
    a = ap.parse_args()
    threads = torch.get_num_threads()
    mods = {"new": cpu.extension()}
    if mods["new"] is None:
        raise SystemExit(f"the kernel did not build: {cpu.build_error()}")
    if a.baseline:
        mods = {"base": build_baseline(a.baseline, tuple(a.define)), **mods}
    hw = None
    if not a.no_hardware:
        hw = measure_hardware(torch.device("cpu"), mib=256, repeats=3)
        print(
            f"hardware, {threads} threads: {hw['bandwidth_gbs']:.1f} GB/s, {hw['matmul_fp32_gflops']:.0f} GFLOP/s"
        )
    print(f"load average (1 min) before timing: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(
        f"{'case':10s} {'kernel':5s} {'ms':>7s} {'GFLOP/s':>8s} {'GB/s':>6s} {'floor ms':>8s} {'x floor':>7s}"
        + (f" {'base/new':>9s}" if a.baseline else "")
    )
    wanted = a.cases.split(",")
    for name, H, G, latent, D, dR, store in CASES:
        if name not in wanted:
            continue
        T = int(name.rsplit("-T", 1)[1]) if "-T" in name else 1
        layers = [
            make_case(name, H, G, latent, D, dR, store, a.batch, a.context, T, seed=i, page_size=a.page_size)
            for i in range(a.layers)
        ]
        _, flops, nbytes = layers[0]
        times = {k: [] for k in mods}
        for m in mods.values():
            m.decode_attention(*layers[-1][0])  # warm
        with torch.inference_mode():
            calls = 0
            for rnd in range(a.repeats):
                order = list(mods.items())
                for k, m in order[::-1] if rnd % 2 else order:  # each second first in turn: no order bias
                    args = layers[calls % a.layers][0]  # each call a layer the last ones did not read
                    calls += 1
                    t0 = time.perf_counter()
                    m.decode_attention(*args)
                    times[k].append(time.perf_counter() - t0)
        floor = None
        if hw:
            floor = max(nbytes / hw["bandwidth_gbs"] / 1e9, flops / hw["matmul_fp32_gflops"] / 1e9)
        for k, ts in times.items():
            t = statistics.median(ts)
            line = f"{name:10s} {k:5s} {t * 1e3:7.2f} {flops / t / 1e9:8.1f} {nbytes / t / 1e9:6.1f}"
            line += f" {floor * 1e3:8.2f} {t / floor:7.2f}" if floor else f" {'':8s} {'':7s}"
            if k == "new" and "base" in times:  # per round, the two runs side by side: load hits both alike
                line += f" {statistics.median(b / n for b, n in zip(times['base'], ts)):9.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
