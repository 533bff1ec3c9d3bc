"""Collect the grid's summary.json files into results.json / results.csv, the claim tables and the plots.

    python benchmarks/science/aggregate.py --runs .science_data/runs --out benchmarks/science

Writes OUT/results.json (every run, every variant's statistics, every claim's comparisons), OUT/results.csv
(one row per run), OUT/claims.md (the tables pasted into benchmarks/science.md) and OUT/*.png (curves).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import grid  # noqa: E402
from stats import difference, summarize, verdict  # noqa: E402

# (claim, a, b, margin): is a worse / better / within noise than b (validation loss, lower is better)
COMPARISONS = [
    ("a", "sl-mla+rope-r128", "sl-mha", 0.01),
    ("a", "sl-mla-r128", "sl-mha", 0.0),
    ("a", "sl-mla-r128", "sl-mla+rope-r128", 0.0),
    ("a", "sl-mla+rope-r128", "sl-mha+rope", 0.01),
    ("a", "sl-mha+rope", "sl-mha", 0.0),
    ("b", "sl-mla+rope-r32", "sl-mla+rope-r64", 0.0),
    ("b", "sl-mla+rope-r16", "sl-mla+rope-r32", 0.0),
    ("b", "sl-mla+rope-r8", "sl-mla+rope-r16", 0.0),
    ("b", "sl-mla+rope-r8", "sl-mla+rope-r32", 0.0),
    ("b", "sl-mla-r32", "sl-mla-r64", 0.0),
    ("b", "sl-mla-r16", "sl-mla-r32", 0.0),
    ("b", "sl-mla-r8", "sl-mla-r16", 0.0),
    ("b", "sl-mla-r8", "sl-mla-r32", 0.0),
    ("c", "eg-mla-kv64", "mla-kv64", 0.0),
    ("c", "eg-mla-kv256", "mla-kv256", 0.0),
    ("c", "eg-mla-kv64-noLN", "eg-mla-kv64", 0.0),
    ("c", "eg-mla-kv64-add", "eg-mla-kv64", 0.0),
    ("d", "eg-mla-kv64", "mla-kv256", 0.01),
    ("d", "eg-mla-kv64-emb64", "eg-mla-kv64", 0.0),
    ("d", "eg-mla-kv64-emb128", "eg-mla-kv64", 0.0),
    ("d", "eg-mla-kv64-emb512", "eg-mla-kv64", 0.0),
    ("e", "tiny-mlra-4", "tiny-mla", 0.0),
    ("e", "tiny-mlra-4", "tiny-gqa", 0.0),
    ("e", "tiny-mlra-4", "tiny-mha", 0.0),
    ("e", "tiny-mlra-4-zero", "tiny-mha-zero", 0.0),
    ("e", "tiny-mlra-4-zero", "tiny-mla", 0.0),
    ("f", "tiny-mlra-4-zero", "tiny-mlra-4", 0.0),
    ("f", "tiny-mha-zero", "tiny-mha", 0.0),
]
METRICS = ("final_val_loss", "ood_val_loss", "gap")  # gap: OOD minus in-domain loss of the same run


def load_runs(runs: Path) -> list[dict]:
    rows = [json.loads(p.read_text()) for p in sorted(runs.rglob("summary.json"))]
    for r in rows:
        r["gap"] = r["ood_val_loss"] - r["final_val_loss"]
    return rows


def variant_stats(rows: list[dict]) -> dict[str, dict]:
    by = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    out = {}
    for v in grid.variants():
        rs = sorted(by.get(v.label, []), key=lambda r: r["seed"])
        if not rs:
            continue
        s = {m: summarize([r[m] for r in rs]) for m in METRICS}
        s["converged_drop_last20pct"] = summarize([r["converged_drop_last20pct"] for r in rs])
        s["seeds"] = [r["seed"] for r in rs]
        s["group"] = v.group
        s["params_total"] = rs[0]["n_params"]["total"]
        s["params_non_embedding"] = rs[0]["n_params"]["non_embedding"]
        s["params_gate_embedding"] = rs[0]["n_params"].get("gate_embedding", 0)
        s["kv_elements_per_token"] = rs[0]["kv_elements_per_token"]
        s["kv_bytes_per_token_bf16"] = rs[0]["kv_bytes_per_token_bf16"]
        s["tokens"] = rs[0]["tokens"]
        out[v.label] = s
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    by = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    out = []
    for claim, a, b, margin in COMPARISONS:
        for m in METRICS if claim in "cd" else METRICS[:2]:
            xa = [r[m] for r in by.get(a, [])]
            xb = [r[m] for r in by.get(b, [])]
            d = difference(xa, xb)
            out.append(
                {
                    "claim": claim,
                    "a": a,
                    "b": b,
                    "metric": m,
                    "margin": margin,
                    **(d or {}),
                    "verdict": verdict(d, margin) if xa and xb else "not run",
                    "n": [len(xa), len(xb)],
                }
            )
    return out


def _fmt(s: dict, digits: int = 3) -> str:
    if not s or s["mean"] is None:
        return "-"
    if s["std"] is None:
        return f"{s['mean']:.{digits}f} (n=1)"
    lo, hi = s["ci"]
    return f"{s['mean']:.{digits}f} ± {s['std']:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def tables(vs: dict[str, dict], comps: list[dict]) -> str:
    lines = []
    groups = {
        "small-lm": "Claims (a), (b): small-LM grid",
        "eg-mla": "Claims (c), (d): EG-MLA",
        "mlra": "Claims (e), (f): MLRA-4 and zero-init",
    }
    for g, title in groups.items():
        lines += [
            f"### {title}",
            "",
            "| variant | KV elems/token | params (non-emb) | n | val loss, in-domain | val loss, wikipedia (OOD) "
            "| OOD - in | still falling (last 20 %) |",
            "|---|---:|---:|---:|---|---|---|---:|",
        ]
        for label, s in vs.items():
            if s["group"] != g:
                continue
            gate = f" + {s['params_gate_embedding'] / 1e6:.2f} M gate" if s["params_gate_embedding"] else ""
            drop = s["converged_drop_last20pct"]["mean"]
            lines.append(
                f"| {label} | {s['kv_elements_per_token']:,} | {s['params_total'] / 1e6:.2f} M "
                f"({s['params_non_embedding'] / 1e6:.2f} M{gate}) | {s['final_val_loss']['n']} | "
                f"{_fmt(s['final_val_loss'])} | {_fmt(s['ood_val_loss'])} | {_fmt(s['gap'])} | "
                f"{drop * 100:.1f} % |"
            )
        lines.append("")
    lines += [
        "### Comparisons (a - b, Welch 95 % interval over seeds; lower loss is better)",
        "",
        "| claim | a | b | metric | a - b | 95 % CI | rel. | p | verdict |",
        "|---|---|---|---|---:|---|---:|---:|---|",
    ]
    for c in comps:
        metric = c["metric"].replace("final_val_loss", "in-domain").replace("ood_val_loss", "OOD")
        if "diff" not in c:
            lines.append(
                f"| {c['claim']} | {c['a']} | {c['b']} | {metric} | - | - | - | - | {c['verdict']} |"
            )
            continue
        lines.append(
            f"| {c['claim']} | {c['a']} | {c['b']} | {metric} | {c['diff']:+.4f} | "
            f"[{c['ci'][0]:+.4f}, {c['ci'][1]:+.4f}] | {c['rel'] * 100:+.2f} % | {c['p']:.3g} | {c['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plots(rows: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = []
    by = defaultdict(list)
    for r in rows:
        by[r["label"]].append(r)
    for g in ("small-lm", "eg-mla", "mlra"):
        labels = [v.label for v in grid.variants() if v.group == g and v.label in by]
        if not labels:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        # one colour per latent size / mechanism; dashed = no RoPE (small-lm) or zero-init (mlra)
        keys = list(dict.fromkeys(lb.replace("+rope", "").replace("-zero", "") for lb in labels))
        cmap = plt.get_cmap("tab10" if len(keys) <= 10 else "tab20")
        for label in labels:
            color = cmap(keys.index(label.replace("+rope", "").replace("-zero", "")) % cmap.N)
            for ax, key in zip(axes, ("train_curve", "val_curve")):
                curves = [np.array(r[key], dtype=float) for r in by[label] if r[key]]
                if not curves:
                    continue
                n = min(len(c) for c in curves)
                steps = curves[0][:n, 0]
                ys = np.stack([c[:n, 1] for c in curves])
                mean = ys.mean(0)
                style = "--" if ("-r" in label and "+rope" not in label) or "zero" in label else "-"
                ax.plot(steps, mean, style, color=color, label=f"{label} (n={len(curves)})", lw=1.2)
                if len(curves) > 1:
                    ax.fill_between(steps, ys.min(0), ys.max(0), color=color, alpha=0.2)
        axes[0].set_title(f"{g}: training loss (mean over seeds, band = min-max)")
        axes[1].set_title(f"{g}: in-domain validation loss")
        for ax in axes:
            ax.set_xlabel("step")
            ax.set_ylabel("loss (nats/token)")
            ax.grid(alpha=0.3)
        lo = min(min(r["final_val_loss"] for r in by[label]) for label in labels)
        axes[0].set_ylim(lo - 0.3, lo + 2.0)
        axes[1].set_ylim(lo - 0.1, lo + 1.2)
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        name = f"curves_{g}.png"
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        made.append(name)
    return made


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runs", type=Path, required=True)
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args(argv)
    rows = load_runs(args.runs)
    if not rows:
        raise SystemExit(f"no summary.json under {args.runs}")
    vs = variant_stats(rows)
    comps = comparisons(rows)
    slim = [
        {k: v for k, v in r.items() if k not in ("model_config", "train_config", "data", "ood_data")}
        for r in rows
    ]
    doc = {
        "runs": slim,
        "variants": vs,
        "comparisons": comps,
        "configs": {
            r["label"]: {
                "model": r["model_config"],
                "train": {k: v for k, v in r["train_config"].items() if k != "seed"},
            }
            for r in rows
        },
        "data": rows[0]["data"],
        "ood_data": rows[0]["ood_data"],
    }
    (args.out / "results.json").write_text(json.dumps(doc, indent=1))
    cols = [
        "label",
        "group",
        "seed",
        "attention",
        "steps",
        "tokens",
        "final_val_loss",
        "ood_val_loss",
        "best_val_loss",
        "final_train_loss_mean50",
        "converged_drop_last20pct",
        "kv_elements_per_token",
        "kv_bytes_per_token_bf16",
        "params_total",
        "params_non_embedding",
        "device",
        "precision",
        "wall_s",
    ]
    with (args.out / "results.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in sorted(rows, key=lambda r: (r["group"], r["label"], r["seed"])):
            r = dict(
                r, params_total=r["n_params"]["total"], params_non_embedding=r["n_params"]["non_embedding"]
            )
            w.writerow([r.get(c) for c in cols])
    (args.out / "claims.md").write_text(tables(vs, comps))
    made = plots(rows, args.out)
    print(f"{len(rows)} runs, {len(vs)} variants -> results.json, results.csv, claims.md, {', '.join(made)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
