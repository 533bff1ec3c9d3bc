"""kvlm's serving engine with the C++ kernels of a git revision against the working tree's, in one process
(issue 15: a kernel change seen where short sequences are served): ``kvlm.bench.serve_inprocess.engine_load`` at
the bench reference shape, the two builds alternating run by run, medians over rounds.

    OMP_NUM_THREADS=2 python benchmarks/serve_ab.py --baseline e2c05ef     # ~2 min after the build
    OMP_NUM_THREADS=2 python benchmarks/serve_ab.py --baseline HEAD --quick  # a toy shape: checks the script

Per variant (MHA, GQA-3, absorbed MLA) and client count: tokens per second and the median inter-token latency,
base / new. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kernel_micro import build_baseline  # this folder
from step_ab import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK  # this folder

from kvlm.bench.plan import parse_variant
from kvlm.bench.serve_inprocess import engine_load
from kvlm.kernels import cpu
from kvlm.model import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, metavar="REV", help="git revision whose kernels to serve with too")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=4, help="runs of each build, alternating")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    a = ap.parse_args()
    new = cpu.extension()
    if new is None:
        ap.error(f"the kernels did not build here: {cpu.build_error()}")
    builds = {"base": build_baseline(a.baseline), "new": new}
    shape, variants = ({**QUICK, "vocab_size": 512}, VARIANTS_QUICK) if a.quick else (SHAPE, VARIANTS)  # prompts: ids < 257
    print(f"{torch.get_num_threads()} threads, {a.prompt_len}-token prompts, {a.output_len} tokens out, "
          f"{a.rounds} rounds a build\n")  # fmt: skip
    print("| variant | clients | base tok/s | new tok/s | new / base | base ITL ms | new ITL ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for spec in variants:
        _, cfg = parse_variant(spec, shape)
        torch.manual_seed(0)
        model = build_model(cfg.replace(max_seq_len=a.prompt_len + a.output_len + 8)).eval()
        model.prepare_for_inference()
        for clients in a.clients:
            runs: dict = {k: [] for k in builds}
            try:
                for rnd in range(a.rounds):
                    for arm in list(builds)[:: 1 if rnd % 2 == 0 else -1]:  # each build first in turn
                        cpu._state["module"] = builds[arm]
                        runs[arm].append(engine_load(model, clients, prompt_len=a.prompt_len,
                                                     output_len=a.output_len, rounds=1, cache_bytes=2**28))  # fmt: skip
            finally:
                cpu._state["module"] = new
            med = {k: {m: statistics.median(r[m] for r in v) for m in ("tokens_per_s", "itl_p50_ms")}
                   for k, v in runs.items()}  # fmt: skip
            b, n = med["base"], med["new"]
            print(f"| {spec.split(':')[0]} | {clients} | {b['tokens_per_s']:.1f} | {n['tokens_per_s']:.1f} | "
                  f"{n['tokens_per_s'] / b['tokens_per_s']:.3f} | {b['itl_p50_ms']:.2f} | {n['itl_p50_ms']:.2f} |",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
