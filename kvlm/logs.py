"""Logging for the library and the CLI: the standard ``logging`` module, one ``kvlm`` logger tree.

Library code logs through ``get_logger(__name__)`` and never prints; the CLI calls ``setup_logging`` once, which
writes records as plain lines to stderr (stdout stays for results and the ``--json`` line). Under
torch.distributed only rank 0 writes, unless a record is logged with ``extra={"all_ranks": True}``.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "kvlm"


def get_logger(name: str) -> logging.Logger:
    """The logger for a kvlm module (``get_logger(__name__)``), a child of the ``kvlm`` logger."""
    return logging.getLogger(name if name == ROOT or name.startswith(ROOT + ".") else f"{ROOT}.{name}")


def process_rank() -> int:
    """This process's rank under torchrun (RANK), 0 otherwise."""
    return int(os.environ.get("RANK", "0") or 0)


class RankZeroFilter(logging.Filter):
    """Pass records on rank 0, and records marked ``all_ranks`` on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return process_rank() == 0 or bool(getattr(record, "all_ranks", False))


def setup_logging(level: int | str = logging.INFO, stream=None) -> logging.Handler:
    """Send ``kvlm`` records at ``level`` and above to ``stream`` (stderr), rank 0 only. Idempotent."""
    logger = logging.getLogger(ROOT)
    for h in list(logger.handlers):
        if getattr(h, "_kvlm_cli", False):
            logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler._kvlm_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankZeroFilter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler
