"""Issue 15's six cells (and batch 1 on 1 thread) against a floor measured beside each timed step
(kvlm.bench.paired): every round probes bandwidth and matmul peak, times the step at its context, the step at one
cached token and the LM head, and probes again; the round's times are set against the floor of its own probes.

    OMP_NUM_THREADS=2 python benchmarks/paired_floor.py            # ~2 min
    OMP_NUM_THREADS=2 python benchmarks/paired_floor.py --quick    # a toy shape: checks the script

``benchmarks/decode_limit.py`` runs it after its passes and puts its table on the page.
"""

from __future__ import annotations

import argparse
import os

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK  # this folder

from kvlm.bench.hardware import Probe
from kvlm.bench.paired import paired_step
from kvlm.bench.plan import parse_variant
from kvlm.model import build_model


def cells(quick: bool, rounds: int = 12) -> list[dict]:
    """One row per variant (MLA absorbed) and cell: batch 8 / 4096 and batch 1 / 8192 on 2 threads, batch 1 /
    8192 on 1 thread; kernels on."""
    os.environ["KVLM_KERNELS"] = "1"
    sizes = (
        [((2, 64), 2), ((1, 128), 2), ((1, 128), 1)]
        if quick
        else [((8, 4096), 2), ((1, 8192), 2), ((1, 8192), 1)]
    )
    probes: dict[int, Probe] = {}
    rows = []
    for spec in VARIANTS_QUICK if quick else VARIANTS:
        _, cfg = parse_variant(spec, QUICK if quick else SHAPE)
        cfg = cfg.replace(max_seq_len=max(c for (_, c), _ in sizes) + 2 + rounds * 4)
        model = build_model(cfg).eval().prepare_for_inference()
        mode = "absorbed" if spec.startswith("mla") else "auto"
        for (batch, context), threads in sizes:
            torch.set_num_threads(threads)
            if threads not in probes:
                probes[threads] = Probe(
                    torch.device("cpu"), mib=8 if quick else 256, matmul=256 if quick else 2048
                )
            print(f"paired: {spec}, batch {batch}, context {context}, {threads} threads", flush=True)
            r = paired_step(model, batch, context, mode, probes[threads], rounds=2 if quick else rounds)
            rows.append(
                {"variant": spec, "mode": mode, "batch": batch, "context": context, "threads": threads, **r}
            )
        del model
    torch.set_num_threads(2)
    return rows


HEAD = (
    "| variant | batch | context | threads | rounds | GB/s probed | GFLOP/s probed | ms/step | floor ms | x floor "
    "| x floor, rounds | weights x | attention x | LM head x |\n"
    "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---|---:|---:|---:|"
)


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: the head and a row per cell (medians over rounds; the rounds' range of x floor)."""
    out = [HEAD]
    for r in rows:
        peaks = [x["hardware"]["matmul_fp32_gflops"] for x in r["rounds"]]
        c = r["classes"]
        out.append(
            f"| {r['variant']} | {r['batch']} | {r['context']} | {r['threads']} | {len(r['rounds'])} | "
            f"{r['bandwidth_gbs'][0]:.0f}-{r['bandwidth_gbs'][1]:.0f} | {min(peaks):.0f}-{max(peaks):.0f} | "
            f"{r['ms']:.1f} | {r['floor_ms']:.1f} | **{r['x_floor']:.2f}** | "
            f"{r['x_floor_min']:.2f}-{r['x_floor_max']:.2f} | "
            + " | ".join(f"{c[k]:.2f}" if k in c else "" for k in ("weight GEMMs", "attention", "LM head"))
            + " |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--rounds", type=int, default=12, help="probed rounds per cell")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    print("\n".join(table(cells(args.quick, args.rounds))))


if __name__ == "__main__":
    main()
