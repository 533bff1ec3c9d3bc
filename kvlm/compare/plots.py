"""The comparison's plots: the Pareto front of validation loss against KV bytes per token (95 % intervals),
the loss curves with seed bands, and (when measured) the tiny models' own decode speed. Legends list only
what is drawn."""

from __future__ import annotations

import statistics
from pathlib import Path


def loss_curves(rows: list[dict], results: list[dict]) -> dict[str, dict]:
    """{label: {"tokens", "mean", "low", "high"}}: validation loss at each evaluated point, over the seeds that
    have it (mean, lowest, highest)."""
    out = {}
    for row in rows:
        points: dict[int, list[float]] = {}
        for r in results:
            if r["label"] != row["label"]:
                continue
            for h in r.get("history", []):
                if h.get("val_loss") is not None:
                    points.setdefault(h["tokens"], []).append(h["val_loss"])
        xs = sorted(points)
        out[row["label"]] = {
            "tokens": xs,
            "mean": [statistics.fmean(points[x]) for x in xs],
            "low": [min(points[x]) for x in xs],
            "high": [max(points[x]) for x in xs],
        }
    return out


def _rank_at_same_bytes(rows: list[dict], row: dict) -> int:
    """Labels of variants with the same KV bytes (e.g. MLA and MLRA-4) are stacked instead of overprinted."""
    same = sorted(
        (r for r in rows if r["kv_bytes_per_token"] == row["kv_bytes_per_token"]), key=lambda r: r["label"]
    )
    return same.index(row)


def write_plots(paths: dict[str, Path], rows: list[dict], results: list[dict]) -> None:
    """pareto.png, loss_curves.png and, when paths has "decode_png", decode_speed.png."""
    # matplotlib is imported here: it takes a second to import and its backend must be chosen first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlm.training.plot import readable_log_ticks

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for on_front, style, name in ((True, "o", "on the Pareto front"), (False, "x", "dominated")):
        pts = [r for r in rows if r["pareto"] == on_front]
        if not pts:
            continue
        yerr = [
            [r["val_loss"] - r["val_loss_ci95"][0] if r["val_loss_ci95"] else 0 for r in pts],
            [r["val_loss_ci95"][1] - r["val_loss"] if r["val_loss_ci95"] else 0 for r in pts],
        ]
        ax.errorbar(
            [r["kv_bytes_per_token"] for r in pts],
            [r["val_loss"] for r in pts],
            yerr=yerr if any(r["val_loss_ci95"] for r in pts) else None,
            fmt=style,
            color="C0" if on_front else "C3",
            capsize=3,
            label=name + (" (95 % CI)" if any(r["val_loss_ci95"] for r in pts) else ""),
        )
        for r in pts:
            ax.annotate(r["label"], (r["kv_bytes_per_token"], r["val_loss"]), fontsize=8,
                        xytext=(5, 3 - 10 * _rank_at_same_bytes(rows, r)), textcoords="offset points")  # fmt: skip
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["kv_bytes_per_token"])
    if len(front) > 1:
        ax.plot([r["kv_bytes_per_token"] for r in front], [r["val_loss"] for r in front], "-", color="C0",
                alpha=0.4, label="front")  # fmt: skip
    ax.set_xscale("log")
    readable_log_ticks(ax.xaxis)  # plain numbers, not only powers of ten
    ax.set_xlabel("KV cache bytes per token (all layers, bf16)")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title("quality against KV cache")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths["pareto_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (label, c) in enumerate(loss_curves(rows, results).items()):
        if not c["tokens"]:
            continue
        color = f"C{i % 10}"
        ax.plot(c["tokens"], c["mean"], "-", color=color, label=label)
        if c["low"] != c["high"]:
            ax.fill_between(c["tokens"], c["low"], c["high"], color=color, alpha=0.2, linewidth=0)
    ax.set_yscale("log")  # early losses are several times the final ones; the end is where variants differ
    readable_log_ticks(ax.yaxis)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (mean; band: min-max over seeds)")
    ax.set_title("loss curves")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["loss_curves_png"], dpi=120)
    plt.close(fig)

    if "decode_png" not in paths:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if not r.get("tiny_speed"):
            continue
        dec = r["tiny_speed"]["decode_tokens_per_s"]
        xs = sorted(dec, key=int)
        ax.plot([int(c) for c in xs], [dec[c] for c in xs], "o-", label=r["label"])
    ax.set_xlabel("cached tokens (context)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("tiny trained models on this machine (overhead-bound, not a cost)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["decode_png"], dpi=120)
    plt.close(fig)
