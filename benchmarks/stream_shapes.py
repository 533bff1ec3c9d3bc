"""Why the few-row kernel streams weights at 8 rows below the machine's read bandwidth (issue 15): the access
patterns of the 8-row product stripped of everything else (benchmarks/csrc/stream_shapes.cpp), 256 MB in 2 MiB
pages, 2 threads, interleaved rounds, a bandwidth probe (kvlm.bench.hardware.Probe) before and after.

    OMP_NUM_THREADS=2 python benchmarks/stream_shapes.py     # ~1 min after a ~30 s build

Patterns (each 8 FMAs per 64-byte line against 8 rows of x in L1, every line prefetched 32 KiB ahead into L2,
except the plain read): ``plain read`` (no FMA, no software prefetch); ``one stream`` (two consecutive lines a step
as two weight rows at one k: the order a layout interleaving pairs of weight rows would give); ``two rows side by
side`` (the package's block<8> on the plain weight); ``one row at a time`` (8 x loads a line); each with x's
loads over whole rows of 768 (24 KiB of x) or cycling through the first 384 or 192 floats of each row (12 or 6 KiB:
what a product tiled along K would keep in L1). Prints GB/s per arm (median over rounds) and each round's ratio
to ``two rows side by side`` over whole rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvlm.bench.hardware import Probe
from kvlm.hugepages import zeros_in_huge_pages

HERE = Path(__file__).parent
PATTERNS = ["plain read", "one stream", "two rows side by side", "one row at a time"]
ARMS = [(0, 768), (1, 768), (2, 768), (3, 768), (1, 384), (1, 192), (2, 384)]  # (pattern, x floats a row cycled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    from torch.utils.cpp_extension import load

    ext = load(name="kvlm_bench_stream_shapes", sources=[str(HERE / "csrc" / "stream_shapes.cpp")],
               extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])  # fmt: skip
    w = zeros_in_huge_pages((args.mib * 2**18,), torch.float32, torch.device("cpu")).fill_(1.0)
    x = torch.randn(8 * 768)
    probe = Probe(torch.device("cpu"), mib=256, matmul=512)
    before = [probe.read_gbs() for _ in range(3)]
    times = {a: [] for a in ARMS}
    for r in range(args.rounds):
        order = list(times) if r % 2 else list(times)[::-1]
        for p in order:
            t0 = time.perf_counter()
            ext.run(w, x, *p)
            times[p].append(time.perf_counter() - t0)
    after = [probe.read_gbs() for _ in range(3)]
    nbytes = w.numel() * 4
    print(f"{torch.get_num_threads()} threads, {nbytes / 1e6:.0f} MB; probe before "
          f"{' '.join(f'{b:.0f}' for b in before)}, after {' '.join(f'{a:.0f}' for a in after)} GB/s\n")  # fmt: skip
    print("| pattern | GB/s | x two rows side by side (rounds: median, range) |")
    print("|---|---:|---|")
    side = times[(2, 768)]
    for (p, cycle), ts in times.items():
        ratios = [s / t for s, t in zip(side, ts)]
        print(f"| {PATTERNS[p]}{f', x {cycle * 32 // 1024} KiB' if p else ''} | {nbytes / statistics.median(ts) / 1e9:.0f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")  # fmt: skip


if __name__ == "__main__":
    main()
