"""Weight GEMMs of a decode step at a few rows (1-16; more for speculative verification or a large batch): torch's
F.linear, MKL's packed layout, oneDNN's (``generate`` packs from 9 rows in whichever measured fastest:
``fastest_packing``) and the few-row kernel on the plain weight, interleaved in one process. Issue 15's "weight GEMMs at
batch 1-8 read weights near bandwidth": the experiment behind benchmarks/decode-limit.md's sections "Three
passes..." and "A new machine...". benchmarks/csrc/few_rows.cpp is the experiment's copy of the kernel, with its
prefetch distances as arguments (the package's, kvlm/kernels/csrc/few_rows.h, fixes them from 4 rows at 32 KiB
into L2 and 2 KiB into L1: ``--prefetch -32768 --near 2048``).

    OMP_NUM_THREADS=2 python benchmarks/few_rows_gemm.py 1 2 4 8 16     # ~2 min after a ~1 min build
    OMP_NUM_THREADS=2 python benchmarks/few_rows_gemm.py 4 8 --baseline HEAD --no-libraries --rounds 21
        # the package's kernel against git revision HEAD's sources (kernel_micro.py's build_baseline), alone

With ``--baseline`` each row count also prints ``package@REV / package``: the median over rounds of each round's
ratio (the arms alternate within a round, so the machine's drift moves both).

Weights: the reference shape's projections (fused q/k/v, output, fused gate/up, down; 6 layers) and the LM head,
268 MB, allocated in 2 MiB pages as ``prepare_for_inference`` leaves them. Each line: the median over rounds of
the time to stream them all once, and the rate in GB/s of weights read; ``few pfN`` prefetches N bytes ahead;
``MKL packed``: MKL's layout for exactly M rows; ``oneDNN packed``: oneDNN's blocked layout for any M (ANY_ROWS);
``package``: the package's kernel on the plain weight (kvlm.kernels.few_rows_linear, csrc/few_rows.h; on an AVX2
CPU its few_rows_avx2.h micro-kernel, and then the experiment's own AVX-512 kernel is left out);
``panels``: the package's kernel on its panels (kvlm.kernels.few_rows.pack_panels, csrc/few_rows_panels.h).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvlm.hugepages import zeros_in_huge_pages
from kvlm.kernels import cpu
from kvlm.kernels.few_rows import pack_panels

HERE = Path(__file__).parent
D, FFN, VOCAB = 768, 2048, 32000


def build():
    from torch.utils.cpp_extension import load

    return load(
        name="kvlm_bench_few_rows",
        sources=[str(HERE / "csrc" / "few_rows.cpp")],
        extra_include_paths=[str(HERE.parent / "kvlm" / "kernels" / "csrc")],
        extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int, nargs="+", help="row counts (batch x new tokens)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 16384, -32768],
                    help="prefetch distances in bytes: > 0 into L1, < 0 into L2 (with --near into L1)")
    ap.add_argument("--near", type=int, default=2048, help="with an L2 distance, also this far into L1 (0: not)")
    ap.add_argument("--baseline", metavar="REV", help="also the package's kernel built from git revision REV's sources")
    ap.add_argument("--define", nargs="+", default=[], metavar="NAME[=VALUE]",
                    help="build knobs for the --baseline build (e.g. KVLM_FEW_SPREAD=4096: few_rows.h lists them)")
    ap.add_argument("--no-libraries", action="store_true", help="leave out F.linear, MKL's and oneDNN's arms")
    args = ap.parse_args()
    # the experiment's kernel is AVX-512's; on other CPUs (AVX2) the package's arms and the libraries' run alone
    ext = build() if "avx512f" in Path("/proc/cpuinfo").read_text() and not args.no_libraries else None
    base = None
    if args.baseline:
        from kernel_micro import build_baseline  # this folder

        base = build_baseline(args.baseline, tuple(args.define))
    shapes = [(3 * D, D), (D, D), (2 * FFN, D), (D, FFN)] * 6 + [(VOCAB, D)]
    weights = []
    for o, i in shapes:
        w = zeros_in_huge_pages((o, i), torch.float32, torch.device("cpu"))
        weights.append(w.copy_(torch.randn(o, i)))
    package = cpu.extension()
    panels = [pack_panels(w) for w in weights] if package is not None and hasattr(package, "panel_linear") else []
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"{torch.get_num_threads()} threads, {mb:.0f} MB of weights; ms (GB/s)", flush=True)
    for M in args.rows:
        xs = {i: torch.randn(M, i) for i in (D, FFN)}
        calls = {} if args.no_libraries else {"F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights]}
        for pfd in args.prefetch if ext is not None else []:
            calls[f"few pf{pfd}"] = lambda xs=xs, pfd=pfd: [
                ext.few_rows(xs[w.shape[1]], w, pfd, 8, args.near) for w in weights
            ]
            for w in weights[:4] + weights[-1:]:  # the kernel computes the product
                got, ref = ext.few_rows(xs[w.shape[1]], w, pfd, 8, args.near), F.linear(xs[w.shape[1]], w)
                torch.testing.assert_close(
                    got, ref, rtol=1e-4, atol=1e-3
                )  # K products summed in another order
        if M >= 2 and not args.no_libraries:
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in weights]
            calls["MKL packed"] = lambda xs=xs, packed=packed, M=M: [
                torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, M) for w, p in zip(weights, packed)
            ]
        if not args.no_libraries:
            blocked = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]  # ANY_ROWS: any M
            calls["oneDNN packed"] = lambda xs=xs, blocked=blocked: [
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                for w, p in zip(weights, blocked)
            ]
        if package is not None and hasattr(package, "few_rows_linear"):
            calls["package"] = lambda xs=xs: [package.few_rows_linear(xs[w.shape[1]], [w], [None]) for w in weights]
        if base is not None:
            calls[f"package@{args.baseline}"] = lambda xs=xs: [
                base.few_rows_linear(xs[w.shape[1]], [w], [None]) for w in weights
            ]
            for w in weights[:4] + weights[-1:]:  # the two builds compute the same product
                x = xs[w.shape[1]]
                torch.testing.assert_close(base.few_rows_linear(x, [w], [None]), F.linear(x, w), rtol=1e-4, atol=1e-3)
                torch.testing.assert_close(package.few_rows_linear(x, [w], [None]), F.linear(x, w), rtol=1e-4, atol=1e-3)
        if panels:
            calls["panels"] = lambda xs=xs: [
                package.panel_linear(xs[w.shape[1]], p, w.shape[0], None) for w, p in zip(weights, panels)
            ]
            for w, p in zip(weights[:4] + weights[-1:], panels[:4] + panels[-1:]):
                x = xs[w.shape[1]]
                torch.testing.assert_close(package.panel_linear(x, p, w.shape[0], None), F.linear(x, w), rtol=1e-4, atol=1e-3)
        times: dict = {k: [] for k in calls}
        with torch.inference_mode():
            for _ in range(args.rounds):
                for k, call in calls.items():
                    t0 = time.perf_counter()
                    call()
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(
            f"M={M}: " + "  ".join(f"{k} {t * 1e3:.1f} ({mb / t / 1e3:.1f})" for k, t in med.items()),
            flush=True,
        )
        if base is not None:
            ratio = statistics.median(o / n for o, n in zip(times[f"package@{args.baseline}"], times["package"]))
            print(f"M={M}: package@{args.baseline} / package {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
