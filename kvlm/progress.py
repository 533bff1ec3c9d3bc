"""Progress for every long verb (prepare, train, eval, import, bench): one helper, two renderings.

    with progress(total=1000, desc="train", unit="step") as bar:
        for ...:
            bar.update(1)
            bar.set_postfix({"loss": "3.21"})

When stderr is a terminal, a tqdm bar with rate and ETA (log records are written above it, not through it).
Otherwise (a log file, CI, a pipe) no ``\\r`` frames: plain lines through the ``kvlm`` logger, the one stream
all records take (kvlm.logs), at most every ``KVLM_PROGRESS_INTERVAL`` seconds (default 10) and once at the end:

    train: 40/100 step (40 %), 2.10 step/s, elapsed 19s, ETA 00:29, loss 3.21

Close it (``with``, or ``close()``): that restores the log handlers the bar redirected.
``enabled=False`` shows nothing (``--no-progress``). ``Progress.drawn`` says whether a bar is on the terminal, so a
caller that logs its own per-step lines can leave them to the bar.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kvlm.logs import ROOT, get_logger

logger = get_logger(__name__)
INTERVAL_ENV = "KVLM_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def log_interval() -> float:
    """Seconds between progress lines when there is no terminal (KVLM_PROGRESS_INTERVAL, default 10)."""
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


class Progress:
    """A tqdm bar on a terminal, periodic log lines elsewhere, or nothing (see the module docstring)."""

    def __init__(
        self,
        total: float | None = None,
        desc: str = "",
        unit: str = "it",
        *,
        enabled: bool = True,
        initial: float = 0,
        unit_scale: bool = False,
        stream=None,
        interval: float | None = None,
    ):
        stream = stream if stream is not None else sys.stderr
        self.total, self.desc, self.unit, self.unit_scale = total, desc, unit, unit_scale
        self.n = self.start_n = initial
        self.postfix: dict[str, Any] = {}
        self.interval = log_interval() if interval is None else interval
        self.t0 = self.last = time.perf_counter()
        self.logged = False
        tty = bool(getattr(stream, "isatty", lambda: False)())
        self.drawn = enabled and tty
        self.logging = enabled and not tty
        self._redirect = None
        self.bar = (
            tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                unit_scale=unit_scale,
                file=stream,
                dynamic_ncols=True,
                leave=False,
            )  # fmt: skip
            if self.drawn
            else None
        )
        if self.drawn:  # while the bar is drawn, kvlm's log records go above it instead of through it
            self._redirect = logging_redirect_tqdm([logging.getLogger(ROOT)])
            self._redirect.__enter__()

    # --- the tqdm-like surface the callers use ---------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.logging and time.perf_counter() - self.last >= self.interval:
            self._log()

    def set_postfix(self, values: dict[str, Any], refresh: bool = False) -> None:
        """Values shown after the counts (loss, tokens/s): on the bar, or at the end of the next line."""
        self.postfix = dict(values)
        if self.bar is not None:
            self.bar.set_postfix(values, refresh=refresh)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self._redirect.__exit__(None, None, None)
        elif self.logging and (self.n != self.start_n or not self.logged):
            self._log(final=True)
            self.logging = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the log-line rendering ------------------------------------------------------------------------------
    def line(self, final: bool = False) -> str:
        """``desc: n/total unit (pct), rate, elapsed, ETA, postfix``."""
        now = time.perf_counter()
        elapsed = now - self.t0
        done = self.n - self.start_n
        rate = done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self._num(self.n)}/{self._num(self.total)} {self.unit}" if self.total else
                 f"{self._num(self.n)} {self.unit}"]  # fmt: skip
        if self.total:
            parts[0] += f" ({100.0 * self.n / self.total:.0f} %)"
        parts.append(
            f"{self._num(rate)} {self.unit}/s" if rate >= 1 or rate == 0 else f"{1 / rate:.1f} s/{self.unit}"
        )
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total and rate > 0 and not final:
            parts.append(f"ETA {tqdm.format_interval(max(0.0, self.total - self.n) / rate)}")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        return (f"{self.desc}: " if self.desc else "") + ("done, " if final else "") + ", ".join(parts)

    def _num(self, x: float | None) -> str:
        if x is None:
            return "?"
        if self.unit_scale:
            return tqdm.format_sizeof(x)
        return f"{x:,.0f}" if float(x).is_integer() or x >= 100 else f"{x:.2f}"

    def _log(self, final: bool = False) -> None:
        logger.info(self.line(final))
        self.last = time.perf_counter()
        self.logged = True


def progress(total: float | None = None, desc: str = "", unit: str = "it", **kw: Any) -> Progress:
    """``Progress(total, desc, unit, enabled=True, initial=0, unit_scale=False, stream=sys.stderr)``."""
    return Progress(total, desc, unit, **kw)
