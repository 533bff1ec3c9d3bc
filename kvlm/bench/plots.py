"""The decode plot of a `kvlm bench` result (PNG): latency and tokens/s against context length, one column
per batch size, one line per (variant, route), transformers peers dashed; bars when there is one context."""

from __future__ import annotations

from pathlib import Path


def plot(result: dict, path: str | Path) -> None:
    """Decode latency (top) and tokens/s (bottom) against context length, one column per batch size, one
    line per (variant, route); transformers peers dashed."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    decode = result["decode"]
    batches = sorted({r["batch"] for r in decode})
    contexts = sorted({r["context"] for r in decode})
    fig, axes = plt.subplots(2, len(batches), figsize=(6.5 * len(batches), 8), squeeze=False)
    groups: dict[str, dict[int, list[dict]]] = {}
    for r in decode:
        name = f"{r['variant']} {r['route']}" if r["impl"] == "kvlm" else f"{r['variant']} {r['impl']}"
        groups.setdefault(name, {}).setdefault(r["batch"], []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(contexts) == 1:  # one point per line: bars read better
        names = sorted(groups)
        for j, b in enumerate(batches):
            for ax, key, xlabel in ((axes[0][j], "median_ms", "decode latency (ms / step)"),
                                    (axes[1][j], "tokens_per_s", "decode tokens/s")):  # fmt: skip
                values = [groups[n][b][0][key] if b in groups[n] else 0 for n in names]
                ax.barh(names, values, color=[colors[i % len(colors)] for i in range(len(names))])
                for y, v in enumerate(values):
                    ax.text(v, y, f" {v:.0f}" if v >= 100 else f" {v:.3g}", va="center", fontsize=7)
                ax.set_xscale("log")
                ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
                ax.set_xlabel(xlabel)
                ax.set_title(f"batch {b}, {contexts[0]} cached tokens")
                ax.invert_yaxis()
        _title(fig, result)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    for i, (name, by_batch) in enumerate(sorted(groups.items())):
        peer = " hf:" in name
        style = dict(
            color=colors[i % len(colors)], marker="s" if peer else "o", linestyle="--" if peer else "-"
        )
        for j, b in enumerate(batches):
            rows = sorted(by_batch.get(b, []), key=lambda r: r["context"])
            xs = [r["context"] for r in rows]
            axes[0][j].plot(xs, [r["median_ms"] for r in rows], label=name, **style)
            axes[1][j].plot(xs, [r["tokens_per_s"] for r in rows], label=name, **style)
    for j, b in enumerate(batches):
        for ax, ylabel in ((axes[0][j], "decode latency (ms / step)"), (axes[1][j], "decode tokens/s")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.set_xlabel("cached tokens (context)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"batch {b}")
            ax.grid(True, which="both", alpha=0.3)
            plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            low, high = ax.get_ylim()
            if high / low < 20:  # within about a decade: label the minor ticks too
                ax.yaxis.set_minor_formatter(plain)
                ax.tick_params(axis="y", which="minor", labelsize=7)
            else:
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    _title(fig, result)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _title(fig, result: dict) -> None:
    s, mc = result["settings"], result["machine"]
    threads = f"{mc['threads']} thread{'s' if mc['threads'] != 1 else ''}"
    fig.suptitle(
        f"kvlm bench {result.get('suite') or ''}: {s['dtype']}, {mc['cpu']} ({threads}), {result['date'][:10]}"
    )
