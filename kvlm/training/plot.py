"""The run's loss plot (loss.png beside metrics.jsonl) and readable tick labels for log-scale axes.

Both axes of the loss plot are logarithmic: the first steps fall by several times what the last ones do, and
equal ratios are what a power-law fit of the curve compares. Matplotlib's own log axis labels only powers of
ten, so a loss between 3 and 6 gets no label at all; ``readable_log_ticks`` labels 1-2-5 (or finer) steps
in plain numbers instead. kvlm.compare's plots use it too.
"""

from __future__ import annotations

import math
from pathlib import Path

from kvlm.logs import get_logger

logger = get_logger(__name__)
LOSS_PNG = "loss.png"


def short_number(value: float) -> str:
    """3.5 -> "3.5", 20000 -> "20k", 3e6 -> "3M": tick labels that stay short."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def readable_log_ticks(axis) -> None:
    """Label a log-scale matplotlib axis (``ax.xaxis`` / ``ax.yaxis``, after plotting: it reads the limits)
    with plain numbers at 1-2-5 steps per decade, or finer when the axis spans less than a decade."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    decades = math.log10(hi / lo) if lo > 0 and hi > 0 else 3.0
    if decades >= 4:
        subs: tuple[float, ...] = (1.0,)
    elif decades >= 1.2:
        subs = (1.0, 2.0, 5.0)
    elif decades >= 0.5:
        subs = (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.0)
    else:
        subs = (1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0)
    axis.set_major_locator(LogLocator(base=10.0, subs=subs, numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: short_number(v)))
    axis.set_minor_formatter(NullFormatter())  # the default minor labels would overprint the major ones


def write_loss_plot(
    path: str | Path, losses: list[float], val_losses: list[tuple[int, float]], title: str = ""
) -> Path | None:
    """loss.png: every step's training loss and the validation losses against the step, log-log. Returns the
    file, or None when there is nothing to draw (no finite loss at a step > 0) or matplotlib is missing."""
    train = [(i + 1, v) for i, v in enumerate(losses) if math.isfinite(v) and v > 0]
    val = [(s, v) for s, v in val_losses if s > 0 and math.isfinite(v) and v > 0]  # step 0 has no log place
    if not train and not val:
        return None
    try:
        import matplotlib  # here: a second to import, and the backend must be chosen first
    except ImportError:
        logger.info("no loss plot: matplotlib is not installed")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    try:
        if train:
            ax.plot(*zip(*train), "-", color="C0", linewidth=1, alpha=0.8, label="training loss (each step)")
        if val:
            ax.plot(*zip(*val), "o-", color="C3", markersize=4, label="validation loss")
        ax.set_xscale("log")
        ax.set_yscale("log")
        readable_log_ticks(ax.xaxis)
        readable_log_ticks(ax.yaxis)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats / token)")
        ax.set_title(title or "loss")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)
