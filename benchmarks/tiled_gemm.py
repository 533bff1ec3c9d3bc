"""The weight products at 1-8 rows on a copy of each weight laid out in the order the product reads it
(benchmarks/csrc/tiled_gemm.cpp, an experiment of issue 15, not part of the package) against the package's
few-row kernel on the plain weight, interleaved in one process: the reference shape's weights (fused q/k/v,
output, fused gate/up, down; 6 layers; the LM head), 268 MB in 2 MiB pages, and a bandwidth probe before and after
each row count.

    OMP_NUM_THREADS=2 python benchmarks/tiled_gemm.py 1 2 4 8     # ~2 min after a ~1 min build

The copy (``tile``): each block of 16 weight rows cut along K into chunks of 256 floats, pairs of rows interleaved
by 16 floats within a chunk, so that the product streams one sequential run a thread and its loads of x stay in 8
KiB of L1 (benchmarks/stream_shapes.py: 8 FMAs a line over 24 KiB of x stream 1.2-1.3x below the plain read in
any order; in one stream over 12 KiB they read at its rate). A second copy of the weights: what ``generate``
holds from 9 rows for the GEMM libraries' layouts. Checked against float64 first. Prints, per row count, ms and
GB/s of weights read for both and the median over rounds of plain / tiled.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvlm.bench.hardware import Probe
from kvlm.hugepages import zeros_in_huge_pages
from kvlm.kernels import cpu

HERE = Path(__file__).parent
D, FFN, VOCAB, CHUNK = 768, 2048, 32000, 256


def tile(w: torch.Tensor) -> torch.Tensor:
    """W (N, K) -> (ceil(N / 16), 16 Kp) in tiled_gemm.cpp's layout (zeros past N and K), in huge pages."""
    N, K = w.shape
    n16, kp = -(-N // 16) * 16, -(-K // 16) * 16
    padded = w.new_zeros(n16, kp)
    padded[:N, :K] = w
    parts = []
    for k0 in range(0, kp, CHUNK):
        kc = min(CHUNK, kp - k0)  # block, pair, row in pair, step, 16 -> block, pair, step, row in pair, 16
        part = padded[:, k0 : k0 + kc].reshape(n16 // 16, 8, 2, kc // 16, 16).permute(0, 1, 3, 2, 4)
        parts.append(part.reshape(n16 // 16, 16 * kc))
    return zeros_in_huge_pages((n16 // 16, 16 * kp), torch.float32, torch.device("cpu")).copy_(torch.cat(parts, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int, nargs="+", help="row counts (batch x new tokens)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load

    kernels = HERE.parent / "kvlm" / "kernels" / "csrc"
    ext = load(name="kvlm_bench_tiled_gemm", sources=[str(HERE / "csrc" / "tiled_gemm.cpp")],
               extra_include_paths=[str(kernels)], extra_cflags=cpu.CFLAGS, extra_ldflags=["-fopenmp"])  # fmt: skip
    package = cpu.extension()
    if package is None or not hasattr(package, "few_rows_linear"):
        raise SystemExit("the package's few-row kernel is not available here (no AVX-512 or no compiler)")
    for n, k in [(37, 100), (5, 3), (2304, 768), (768, 2048), (33, 257)]:  # the layout and the kernel, checked
        w, b = torch.randn(n, k, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
        for m in (1, 3, 4, 8, 13):
            x = torch.randn(m, k, dtype=torch.float64)
            got = ext.tiled_linear(x.float(), tile(w.float()), n, b.float()).double()
            ref = x @ w.T + b
            assert (got - ref).abs().max() <= 1e-4 * (1 + ref.abs().max()), (n, k, m)
    shapes = [(3 * D, D), (D, D), (2 * FFN, D), (D, FFN)] * 6 + [(VOCAB, D)]
    weights = [zeros_in_huge_pages(s, torch.float32, torch.device("cpu")).copy_(torch.randn(s)) for s in shapes]
    tiled = [tile(w) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    probe = Probe(torch.device("cpu"), mib=256, matmul=512)
    print(f"{torch.get_num_threads()} threads, {nbytes / 1e6:.0f} MB of weights\n")
    print("| rows | probe GB/s before, after | plain ms (GB/s) | tiled ms (GB/s) | plain / tiled |")
    print("|---:|---|---:|---:|---:|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in (D, FFN)}
            arms = {
                "plain": lambda xs=xs: [package.few_rows_linear(xs[w.shape[1]], [w], [None]) for w in weights],
                "tiled": lambda xs=xs: [ext.tiled_linear(xs[w.shape[1]], t, w.shape[0], None) for w, t in zip(weights, tiled)],
            }  # fmt: skip
            before = probe.read_gbs()
            times = {k: [] for k in arms}
            for r in range(args.rounds):
                for k in list(arms) if r % 2 else list(arms)[::-1]:
                    t0 = time.perf_counter()
                    arms[k]()
                    times[k].append(time.perf_counter() - t0)
            after = probe.read_gbs()
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            ratio = statistics.median(a / b for a, b in zip(times["plain"], times["tiled"]))
            print(f"| {m} | {before:.0f}, {after:.0f} | {ms['plain']:.2f} ({nbytes / ms['plain'] / 1e6:.0f}) | "
                  f"{ms['tiled']:.2f} ({nbytes / ms['tiled'] / 1e6:.0f}) | {ratio:.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
