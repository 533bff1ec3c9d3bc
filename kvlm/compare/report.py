"""The comparison's files: results.json (meta, rows, runs), results.csv (one row per variant) and report.md."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from kvlm.compare.aggregate import KV_DTYPE_BYTES
from kvlm.compare.plots import write_plots


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_outputs(out: Path, rows: list[dict], results: list[dict], meta: dict) -> dict[str, Path]:
    """results.json, results.csv, report.md and the three plots in ``out``; -> their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        k: out / v
        for k, v in {
            "results_json": "results.json",
            "results_csv": "results.csv",
            "report": "report.md",
            "pareto_png": "pareto.png",
            "loss_curves_png": "loss_curves.png",
            "decode_png": "decode_speed.png",
        }.items()
    }
    atomic_write(
        paths["results_json"],
        json.dumps({"meta": meta, "variants": rows, "runs": results}, indent=2, default=str),
    )
    ctxs = sorted({c for r in rows for c in r["decode_tokens_per_s"]}, key=int)
    cols = [
        "label",
        "attention",
        "params_total",
        "params_activated",
        "params_embedding",
        "kv_elements_per_token",
        "kv_bytes_per_token",
        "kv_reduction_vs_first_mha",
        "val_loss",
        "val_loss_std",
        "val_perplexity",
        "val_loss_delta_pct",
        "within_noise_of_best",
        "pareto",
        "prefill_ms",
        "train_tokens_per_s",
        "distinct_2",
        "repeated_4gram_rate",
    ] + [f"decode_tok_s@{c}" for c in ctxs]
    tmp = paths["results_csv"].with_name(".results.csv.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rows:
            w.writerow(
                [
                    r.get(c)
                    if not c.startswith("decode_tok_s@")
                    else r["decode_tokens_per_s"].get(c.split("@")[1])
                    for c in cols
                ]
            )
    os.replace(tmp, paths["results_csv"])
    write_plots(paths, rows, results, ctxs)
    atomic_write(paths["report"], render_report(rows, results, meta, ctxs))
    return paths


def _fmt(x, spec=".4f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def render_report(rows: list[dict], results: list[dict], meta: dict, ctxs: list[str]) -> str:
    """report.md: the rows of ``aggregate`` as tables (best values in bold), samples, the reproduce command."""
    best_loss = min(r["val_loss"] for r in rows)
    best_kv = min(r["kv_bytes_per_token"] for r in rows)
    n_seeds = max(len(r["seeds"]) for r in rows)

    def b(text, cond):
        return f"**{text}**" if cond else text

    lines = [
        f"# kvlm compare: {meta['preset']}",
        "",
        f"- data: {meta['data']}",
        f"- budget per run: {meta['budget']}; seeds: {meta['seeds']}",
        f"- models: {meta['models_note']}",
        f"- machine: {meta['machine']['gpu'] or meta['machine']['cpu']} ({meta['machine']['threads']} threads), "
        f"torch {meta['machine']['torch']}, "
        f"kvlm {meta['kvlm']}, {meta['date']}",
        "",
        "Best values in **bold**. KV bytes count every layer at "
        f"{KV_DTYPE_BYTES} bytes per element (bf16) and come from each mechanism's `cache_spec()`.",
        "",
        "## Which attention gives the best quality for its KV cache?",
        "",
        "| variant | KV elements/token | KV bytes/token | vs MHA | val loss | ppl | Δ loss vs MHA | noise | Pareto |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: r["kv_bytes_per_token"]):
        std = f" ± {r['val_loss_std']:.4f}" if r["val_loss_std"] is not None else ""
        noise = "within noise of best" if r["within_noise_of_best"] else "worse than best"
        kv = b(format(r["kv_bytes_per_token"], ","), r["kv_bytes_per_token"] == best_kv)
        loss = b(format(r["val_loss"], ".4f"), r["val_loss"] == best_loss)
        pareto = "yes" if r["pareto"] else ""
        lines.append(
            f"| {r['label']} | {r['kv_elements_per_token']:,} | {kv} | {-100 * r['kv_reduction_vs_first_mha'] + 0.0:+.1f} % "
            f"| {loss}{std} | {r['val_perplexity']:.2f} | {r['val_loss_delta_pct']:+.2f} % | {noise} | {pareto} |"
        )
    if n_seeds == 1:
        lines += [
            "",
            "One seed per variant: 'noise' uses only the standard error of the validation estimate, not "
            "seed-to-seed training variance; run with `--seeds 0,1,2` before trusting small differences.",
        ]
    else:
        lines += [
            "",
            f"Mean ± standard deviation over {n_seeds} seeds; 'within noise' = gap to the best below twice "
            "the combined standard error of the two means.",
        ]
    lines += [
        "",
        "![Pareto front](pareto.png)",
        "",
        "## What does each cost in parameters?",
        "",
        "| variant | total | activated | embedding (token + gate tables) |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['params_total'] / 1e6:.3f} M | {r['params_activated'] / 1e6:.3f} M | "
            f"{r['params_embedding'] / 1e6:.3f} M |"
        )
    best_dec = {c: max(r["decode_tokens_per_s"].get(c, 0) for r in rows) for c in ctxs}
    best_pre = min(r["prefill_ms"] for r in rows)
    lines += [
        "",
        "## How fast does each run? (batch 1, this machine, trained weights)",
        "",
        "| variant | prefill ms (128 tokens) | "
        + " | ".join(f"decode tok/s @ {c}" for c in ctxs)
        + " | train tok/s |",
        "|---|---:|" + "---:|" * len(ctxs) + "---:|",
    ]
    for r in rows:
        dec = " | ".join(
            b(format(r["decode_tokens_per_s"][c], ".1f"), r["decode_tokens_per_s"][c] == best_dec[c])
            if c in r["decode_tokens_per_s"]
            else "n/a"
            for c in ctxs
        )
        pre = b(format(r["prefill_ms"], ".1f"), r["prefill_ms"] == best_pre)
        lines.append(f"| {r['label']} | {pre} | {dec} | {r['train_tokens_per_s']:.0f} |")
    lines += [
        "",
        "Tiny models are compute-bound on a CPU: their decode speed reflects kernel overheads more than KV "
        "bytes. `kvlm bench` measures the memory-bound regime at realistic sizes (see benchmarks/).",
        "",
        "![decode speed](decode_speed.png)",
        "",
        "## Loss curves",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## Samples (temperature 0.8, top-k 50) and repetition",
        "",
        "| variant | distinct-2 | repeated 4-gram rate |",
        "|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {_fmt(r['distinct_2'], '.3f')} | {_fmt(r['repeated_4gram_rate'], '.3f')} |"
        )
    lines.append("")
    for res in results:
        if res["seed"] != results[0]["seed"]:
            continue
        lines.append(f"**{res['label']}**")
        lines.append("")
        for s in res["samples"]:
            text = (s["prompt"] + s["text"]).replace("\n", " ").replace("|", "\\|")
            lines.append(f"> {text}")
            lines.append(">")
        lines.append("")
    lines += ["## Reproduce", "", "```bash", meta["command"], "```", ""]
    return "\n".join(lines)
