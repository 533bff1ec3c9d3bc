"""The comparison's plots: the Pareto front of validation loss against KV bytes per token, the loss curves and
decode speed against context length."""

from __future__ import annotations

from pathlib import Path

from kvlm.compare.aggregate import KV_DTYPE_BYTES


def write_plots(paths: dict[str, Path], rows: list[dict], results: list[dict], ctxs: list[str]) -> None:
    """pareto.png (loss against KV bytes), loss_curves.png (validation loss against tokens), decode_speed.png."""
    # matplotlib is imported here: it takes a second to import and its backend must be chosen first
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.errorbar(
            r["kv_bytes_per_token"],
            r["val_loss"],
            yerr=r["val_loss_std"] or 0,
            fmt="o" if r["pareto"] else "x",
        )
        ax.annotate(
            r["label"],
            (r["kv_bytes_per_token"], r["val_loss"]),
            fontsize=8,
            xytext=(4, 3),
            textcoords="offset points",
        )
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["kv_bytes_per_token"])
    ax.plot(
        [r["kv_bytes_per_token"] for r in front],
        [r["val_loss"] for r in front],
        "-",
        alpha=0.5,
        label="Pareto front",
    )
    ax.set_xscale("log")
    ax.set_xlabel(f"KV cache bytes per token (all layers, {KV_DTYPE_BYTES}-byte elements)")
    ax.set_ylabel("validation loss")
    ax.set_title("quality against KV cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths["pareto_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        hist = [h for h in r["history"] if h.get("val_loss") is not None]
        if hist:
            ax.plot(
                [h["tokens"] for h in hist], [h["val_loss"] for h in hist], label=f"{r['label']} s{r['seed']}"
            )
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("loss curves")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["loss_curves_png"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        xs = [int(c) for c in ctxs if c in r["decode_tokens_per_s"]]
        ax.plot(xs, [r["decode_tokens_per_s"][str(c)] for c in xs], "o-", label=r["label"])
    ax.set_xlabel("cached tokens (context)")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title("decode speed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(paths["decode_png"], dpi=120)
    plt.close(fig)
