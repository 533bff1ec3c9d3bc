"""What keeps a run's folder and checkpoints safe: one trainer per run folder (``run_lock``), no silent restart
over a previous run (``check_new_run``), a stop before NaN or infinite weights are saved (``FiniteCheck``), and
Ctrl-C that saves the current step before it stops (``InterruptFlag``).

The lock is ``fcntl.flock`` on ``OUT/.lock``: the kernel drops it when the process ends, however it ends
(kill -9 included), so a stale lock file never blocks the next run. The file is left in place: deleting it
would let a second trainer lock a new file while the first still holds the old one.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from kvlm.errors import TrainingError
from kvlm.files import leftovers
from kvlm.logs import get_logger
from kvlm.parallel import data_parallel as dt
from kvlm.training.state import CHECKPOINT_DIR

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; runs are not guarded against a second trainer there
    fcntl = None

logger = get_logger(__name__)
LOCK_FILE = ".lock"
# what a previous run leaves in its folder
RUN_FILES = (CHECKPOINT_DIR, "metrics.jsonl", "result.json")

_held: dict[str, list[int]] = {}  # lock path -> [fd, depth]: the lock is re-entrant within a process


@contextlib.contextmanager
def run_lock(out_dir: str | Path) -> Iterator[None]:
    """Hold the run folder's lock (creating the folder); a second trainer on it fails at once with TrainingError."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    key = str((out_dir / LOCK_FILE).resolve())
    if fcntl is None:
        yield
        return
    if key in _held:
        _held[key][1] += 1
    else:
        fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise TrainingError(
                f"run folder {out_dir} is in use by another trainer (process {holder}); wait for it to end "
                "or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held[key] = [fd, 1]
    try:
        yield
    finally:
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fd = _held.pop(key)[0]
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def previous_run(out_dir: str | Path) -> list[str]:
    """What of a previous run ``out_dir`` holds (checkpoint, metrics.jsonl, result.json, a crashed save's copy)."""
    out_dir = Path(out_dir)
    found = [n for n in RUN_FILES if (out_dir / n).exists()]
    found += [p.name for kind, _, p in leftovers(out_dir / CHECKPOINT_DIR) if kind != "tmp"]
    return found


def check_new_run(out_dir: str | Path, resume: bool, force: bool) -> None:
    """A fresh run (no ``resume``) into a folder that holds a previous one: TrainingError unless ``force``;
    with ``force`` say what the new run replaces."""
    found = [] if resume else previous_run(out_dir)
    if not found:
        return
    if not force:
        raise TrainingError(
            f"{out_dir} holds a previous run ({', '.join(found)}); pass --resume to continue it, or --force to "
            "start over and replace it"
        )
    logger.warning(
        f"--force: starting a new run in {out_dir}; it replaces {', '.join(found)} (the checkpoint at the new "
        "run's first save, metrics.jsonl now)"
    )


def weights_finite(model: torch.nn.Module, info: dt.DistInfo) -> bool:
    """Whether every parameter on every rank is finite (one all-reduce: all ranks call it)."""
    bad = torch.zeros((), dtype=torch.float32)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 / tensor-parallel shards
        if not torch.isfinite(local.detach()).all():
            bad += 1
            break
    if info.enabled:
        bad = dt.all_reduce_sum(bad.to(next(model.parameters()).device), info).cpu()
    return bool(bad.item() == 0)


class FiniteCheck:
    """Stops a run whose loss or weights are no longer finite before anything non-finite is saved."""

    def __init__(self, checked: int = 0):
        self.checked = checked  # losses[:checked] were finite

    def losses(self, losses: list[float], checkpoint: Path | None) -> None:
        for i in range(self.checked, len(losses)):
            if not math.isfinite(losses[i]):
                raise diverged(f"the training loss is {losses[i]} at step {i + 1}", checkpoint)
        self.checked = len(losses)

    def weights(self, model, info: dt.DistInfo, step: int, checkpoint: Path | None) -> None:
        if not weights_finite(model, info):
            raise diverged(f"the weights hold NaN or infinite values after step {step}", checkpoint)


def diverged(what: str, checkpoint: Path | None) -> TrainingError:
    kept = (
        f"the last checkpoint, {checkpoint}, is kept unchanged"
        if checkpoint is not None and checkpoint.is_dir()
        else "no checkpoint was saved"
    )
    return TrainingError(
        f"training diverged: {what}. Stopped without saving these weights; {kept}. Lower --lr, lengthen the "
        "warm-up or clip gradients (grad_clip), then start again or --resume"
    )


class InterruptFlag:
    """Within ``with InterruptFlag(on) as flag:`` the first Ctrl-C (SIGINT) only sets ``flag.requested``, so the
    loop can save the current step and stop; a second one raises KeyboardInterrupt at once. ``on=False`` (or not
    the main thread, where signals cannot be caught) leaves SIGINT as it is."""

    def __init__(self, on: bool = True):
        self.on = on and threading.current_thread() is threading.main_thread()
        self.requested = False
        self._previous = None

    def __enter__(self) -> InterruptFlag:
        if self.on and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:  # the second Ctrl-C: abort now
            signal.signal(signal.SIGINT, self._previous)
            raise KeyboardInterrupt
        self.requested = True
        logger.warning("interrupted: saving a checkpoint at the end of this step (Ctrl-C again to abort)")

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
