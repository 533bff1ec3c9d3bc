"""The comparison's files: results.json (meta, rows, runs), results.csv (one row per variant), report.md and the
plots. The report leads with one sentence per question (``kvlm.compare.findings``), then the tables behind them."""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path

from kvlm.compare.costs import KV_DTYPES, SCALE_BYTES
from kvlm.compare.findings import MIB, answers
from kvlm.compare.plots import write_plots
from kvlm.compare.stats import ALPHA

CSV_COLUMNS = [
    "label",
    "attention",
    "n_seeds",
    "train_tokens",
    "params_total",
    "params_non_embedding",
    "params_embedding",
    "params_gate_embedding",
    "params_ratio_vs_baseline",
    "kv_elements_per_token",
    "kv_bytes_per_token",
    "kv_reduction_vs_baseline",
    "val_loss",
    "val_loss_std",
    "val_loss_ci95_low",
    "val_loss_ci95_high",
    "val_loss_delta_pct",
    "vs_baseline",
    "vs_baseline_p",
    "pareto",
    "val_perplexity",
]


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _csv_value(r: dict, c: str):
    if c == "train_tokens":
        return ";".join(str(t) for t in r["train_tokens"])
    if c.startswith("val_loss_ci95_"):
        return None if r["val_loss_ci95"] is None else r["val_loss_ci95"][0 if c.endswith("low") else 1]
    if c == "vs_baseline":
        return r["vs_baseline"]["verdict"]
    if c == "vs_baseline_p":
        return r["vs_baseline"].get("p")
    return r.get(c)


def write_outputs(out: Path, rows: list[dict], results: list[dict], meta: dict) -> dict[str, Path]:
    """results.json, results.csv, report.md and the plots in ``out``; -> their paths by kind."""
    out.mkdir(parents=True, exist_ok=True)
    names = {
        "results_json": "results.json",
        "results_csv": "results.csv",
        "report": "report.md",
        "pareto_png": "pareto.png",
        "loss_curves_png": "loss_curves.png",
    }
    if any(r.get("tiny_speed") for r in rows):
        names["decode_png"] = "decode_speed.png"
    paths = {k: out / v for k, v in names.items()}
    atomic_write(
        paths["results_json"],
        json.dumps({"meta": meta, "variants": rows, "runs": results}, indent=2, default=str),
    )
    tmp = paths["results_csv"].with_name(".results.csv.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow([_csv_value(r, c) for c in CSV_COLUMNS])
    os.replace(tmp, paths["results_csv"])
    write_plots(paths, rows, results)
    atomic_write(paths["report"], render_report(rows, results, meta))
    return paths


def _fmt(x, spec=".4f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _loss_cell(r: dict) -> str:
    std = f" ± {r['val_loss_std']:.4f}" if r["val_loss_std"] is not None else ""
    return f"{r['val_loss']:.4f}{std}"


def _ci_cell(r: dict) -> str:
    ci = r["val_loss_ci95"]
    return "n/a (1 seed)" if ci is None else f"{ci[0]:.4f} - {ci[1]:.4f}"


def _verdict_cell(r: dict) -> str:
    v = r["vs_baseline"]
    if v["verdict"] in ("baseline", "not tested"):
        return v["verdict"]
    p = v["p"]
    return f"{v['verdict']} ({'p < 0.001' if p < 0.001 else f'p = {p:.3f}'})"


def render_report(rows: list[dict], results: list[dict], meta: dict) -> str:
    """report.md: the answers, then the tables (quality, budget, cost), the plots, samples, method, command."""
    base = next(r for r in rows if r["is_baseline"])
    machine = meta["machine"]
    lines = [
        f"# kvlm compare: {meta['preset']}",
        "",
        f"- data: {meta['data']}",
        f"- budget per run: {meta['budget']}; seeds: {meta['seeds']}",
        f"- models: {meta['models_note']}; sizing: {meta['match']}",
        f"- baseline: {base['label']}",
        f"- machine: {machine.get('gpu') or machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}, "
        f"kvlm {meta['kvlm']}, {meta['date']}",
        f"- time: {meta.get('train_minutes_all_runs', 0):.1f} min of training over all runs; this invocation "
        f"{meta.get('wall_minutes', 0):.1f} min (finished runs it reused are not counted again)",
        "",
        "## Answers",
        "",
        *[f"- {s}" for s in answers(rows, meta)],
        "",
        "## Quality against KV cache",
        "",
        "KV bytes per token count every layer's `cache_spec()` at 2 bytes per element (bf16). Loss: mean ± "
        "standard deviation over seeds, with the 95 % t interval of the mean.",
        "",
        f"| variant | KV bytes/token | vs {base['label']} | val loss | 95 % CI | Δ loss vs {base['label']} "
        f"| vs {base['label']} | Pareto |",
        "|---|---:|---:|---:|---|---:|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["kv_bytes_per_token"], r["val_loss"])):
        lines.append(
            f"| {r['label']} | {r['kv_bytes_per_token']:,} | {-100 * r['kv_reduction_vs_baseline'] + 0.0:+.1f} % "
            f"| {_loss_cell(r)} | {_ci_cell(r)} | {r['val_loss_delta_pct']:+.2f} % | {_verdict_cell(r)} "
            f"| {'yes' if r['pareto'] else 'no (' + r['dominated_by'] + ')'} |"
        )
    lines += [
        "",
        "![Pareto front](pareto.png)",
        "",
        "## Budget: tokens and parameters",
        "",
        "| variant | training tokens | total | non-embedding | token embedding | gate tables | total vs baseline |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {', '.join(f'{t:,}' for t in r['train_tokens'])} | {r['params_total'] / 1e6:.3f} M "
            f"| {r['params_non_embedding'] / 1e6:.3f} M | {r['params_embedding'] / 1e6:.3f} M "
            f"| {r['params_gate_embedding'] / 1e6:.3f} M | {r['params_ratio_vs_baseline']:.3f} |"
        )
    lines += _cost_section(rows, meta)
    lines += [
        "",
        "## Loss curves",
        "",
        "Validation loss during training: the mean over seeds, the band from the lowest to the highest seed.",
        "",
        "![loss curves](loss_curves.png)",
        "",
    ]
    lines += _samples_section(rows, results)
    lines += _speed_appendix(rows)
    lines += [
        "## Method",
        "",
        f"- Verdicts: Welch's unequal-variance t-test of the seeds' final validation losses, two-sided, p < {ALPHA}; "
        "no correction for multiple comparisons. Intervals: mean ± t(0.975, n - 1) x std / sqrt(n). With one "
        "seed nothing is tested.",
        "- Pareto front: a variant is dominated only by another that caches no more bytes per token and has a "
        "significantly lower loss (one seed: by the means).",
        "- Each seed changes the initial weights and the order of the training batches; the validation tokens "
        "are the same for every run.",
        "",
        "## Reproduce",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
    ]
    return "\n".join(lines)


def _cost_section(rows: list[dict], meta: dict) -> list[str]:
    batch, context = meta["deploy"]["batch"], meta["deploy"]["context"]
    hws = [h["name"] for h in meta.get("hardware", [])]
    lines = [
        "",
        "## Cost",
        "",
        f"KV bytes per token of the trained models per cache dtype (int8: 1 byte per element plus one {SCALE_BYTES}-byte "
        f"scale per cached vector), and the cache of batch {batch} x {context:,} tokens of context.",
        "",
        "| variant | "
        + " | ".join(f"{d} B/token" for d in KV_DTYPES)
        + f" | bf16 cache @ {batch}x{context} |",
        "|---|" + "---:|" * (len(KV_DTYPES) + 1),
    ]
    for r in rows:
        by = r["kv_bytes_per_token_by_dtype"]
        cells = " | ".join(f"{by[d]:,}" if d in by else "n/a" for d in KV_DTYPES)
        lines.append(f"| {r['label']} | {cells} | {r['deploy_cache_bytes']['bf16'] / MIB:,.1f} MiB |")
    if not hws or not rows[0].get("reference"):
        return lines
    lines += [
        "",
        f"Decode projected at the bench reference size (6 layers, d = 768, vocabulary 32,000; every width of the "
        f"trained model scaled, head counts and ratios kept), batch {batch}, {context:,} cached tokens: the "
        "per-operation roofline floor of `kvlm.bench.costmodel` (bytes and FLOPs from each mechanism's own "
        "accounting; a lower bound, not a measurement). Weights and cache in the hardware's decode dtype.",
        "",
        "| variant | KV bytes/token (bf16) | cache | "
        + " | ".join(f"{h} ms/token" for h in hws)
        + " | mostly |",
        "|---|---:|---:|" + "---:|" * len(hws) + "---|",
    ]
    for r in rows:
        ref = r["reference"]
        proj = ref["projection"]
        cells = " | ".join(f"{proj[h]['ms_per_token']:.3g}" for h in hws)
        lines.append(
            f"| {r['label']} | {ref['kv_bytes_per_token_bf16']:,} | {ref['cache_bytes_bf16'] / MIB:,.0f} MiB | {cells} "
            f"| {proj[hws[-1]]['mostly']} on {hws[-1]} |"
        )
    sources = "; ".join(f"{h['name']}: {h['source']}" for h in meta["hardware"])
    lines += ["", f"Hardware: {sources}."]
    return lines


def _samples_section(rows: list[dict], results: list[dict]) -> list[str]:
    lines = [
        "## Samples (first seed, temperature 0.8, top-k 50) and repetition (mean over seeds)",
        "",
        "| variant | distinct-2 | repeated 4-gram rate |",
        "|---|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {_fmt(r['distinct_2'], '.3f')} | {_fmt(r['repeated_4gram_rate'], '.3f')} |"
        )
    lines.append("")
    first = {r["label"]: min(r["seeds"]) for r in rows}
    for res in results:
        if res["seed"] != first.get(res["label"]):
            continue
        lines += [f"**{res['label']}**", ""]
        for s in res.get("samples", []):
            text = (s["prompt"] + s["text"]).replace("\n", " ").replace("|", "\\|")
            lines += [f"> {text}", ">"]
        lines.append("")
    return lines


def _speed_appendix(rows: list[dict]) -> list[str]:
    timed = [r for r in rows if r.get("tiny_speed")]
    if not timed:
        return []
    ctxs = sorted({c for r in timed for c in r["tiny_speed"]["decode_tokens_per_s"]}, key=int)
    lines = [
        "## Appendix: the tiny trained models' own speed on this machine (not a cost claim)",
        "",
        "Batch 1, first seed. Models this small are bound by per-call overheads, not by KV bytes, and the "
        "numbers move with the machine's load; the cost section above is the one to read.",
        "",
        "| variant | prefill ms | " + " | ".join(f"decode tok/s @ {c}" for c in ctxs) + " |",
        "|---|---:|" + "---:|" * len(ctxs),
    ]
    for r in timed:
        s = r["tiny_speed"]
        dec = " | ".join(_fmt(s["decode_tokens_per_s"].get(c), ".1f") for c in ctxs)
        lines.append(f"| {r['label']} | {s['prefill_ms']:.1f} | {dec} |")
    return lines + ["", "![decode speed](decode_speed.png)", ""]
