"""What a run reports: metrics.jsonl records (and TensorBoard scalars), the log line of each record, per-rank
memory and step time, and ``TrainResult``, what ``train`` returns.

metrics.jsonl holds one JSON record per logged step: step, tokens, loss, val_loss, lr, tokens_per_s, elapsed,
and once steps were timed step_time_ms (the slowest rank's mean), peak_memory_bytes (max over ranks),
peak_memory_kind (process peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA) and per rank
peak_memory_bytes_per_rank, parameter_bytes_per_rank, gradient_bytes_per_rank, optimizer_bytes_per_rank.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvlm.config import ConfigError
from kvlm.files import json_text
from kvlm.parallel import data_parallel as dt


@dataclass
class TrainResult:
    final_val_loss: float | None
    best_val_loss: float | None
    final_train_loss: float | None
    losses: list[float]  # training loss of every step (all ranks' mean)
    val_losses: list[tuple[int, float]]  # (step, validation loss)
    steps: int
    tokens: int
    tokens_per_s: float  # training tokens per second of this run (all ranks)
    wall_time_s: float
    checkpoint: Path | None
    out_dir: Path | None
    n_params: dict[str, int]
    model_config: dict[str, Any]
    train_config: dict[str, Any]
    data_source: str
    history: list[dict[str, Any]] = field(default_factory=list)  # the metrics.jsonl records
    step_time_ms: float | None = None  # mean optimizer-step time of this run (slowest rank; no eval / saves)
    memory: dict[str, Any] = field(default_factory=dict)  # the last record's per-rank memory figures
    model: Any = field(default=None, repr=False)  # the trained model (unwrapped, on its device)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "model"}
        d["checkpoint"] = str(self.checkpoint) if self.checkpoint else None
        d["out_dir"] = str(self.out_dir) if self.out_dir else None
        return d


@dataclass
class StepClock:
    """Timing of optimizer steps only: laps run from the end of the last log / checkpoint bookkeeping
    (evaluation, saving) to the next one's loss flush (which waits for the device)."""

    lap_start: float = 0.0  # when the current lap began
    lap_start_step: int = 0
    lap_s: float = 0.0  # timed seconds and steps since the last log record
    lap_steps: int = 0
    train_s: float = 0.0  # timed seconds and steps of the whole run
    train_steps: int = 0

    def restart(self, step: int) -> None:
        self.lap_start, self.lap_start_step = time.perf_counter(), step

    def stop(self, step: int) -> None:
        self.lap_s += time.perf_counter() - self.lap_start
        self.lap_steps += step - self.lap_start_step

    def take_lap(self) -> float:
        """Mean seconds per step since the last call; adds them to the run's totals."""
        self.train_s, self.train_steps = self.train_s + self.lap_s, self.train_steps + self.lap_steps
        mean = self.lap_s / self.lap_steps
        self.lap_s, self.lap_steps = 0.0, 0
        return mean

    def mean_step_ms(self) -> float | None:
        return 1e3 * self.train_s / self.train_steps if self.train_steps else None


class MetricsLog:
    """Where records go: ``history`` (every record of this run folder), metrics.jsonl (rank 0 with a run
    folder), TensorBoard (optional) and the caller's callback (rank 0)."""

    SCALARS = ("loss", "val_loss", "lr", "tokens_per_s")

    def __init__(
        self,
        out_dir: Path | None,
        resumed_step: int,
        tensorboard: bool,
        callback: Callable[[dict[str, Any]], None] | None,
        is_main: bool,
    ):
        self.history: list[dict[str, Any]] = []
        self.callback = callback if is_main else None
        self.file = self.tb = None
        if is_main and out_dir is not None:
            self.history = metrics_upto(out_dir / "metrics.jsonl", resumed_step)
            self.file = open(out_dir / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                self.tb = _tensorboard(out_dir / "tensorboard")

    def emit(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        if self.file is not None:
            # strict JSON has no NaN: such a value is written as null, and non_finite names it
            bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
            self.file.write(json_text({**rec, "non_finite": bad} if bad else rec) + "\n")
        if self.tb is not None:
            for k in self.SCALARS:
                if rec.get(k) is not None:
                    self.tb.add_scalar(k, rec[k], rec["step"])
        if self.callback is not None:
            self.callback(rec)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


def rank_memory(model, optimizer, grad_bytes: int, step_s: float, device, info: dt.DistInfo) -> dict:
    """Per-rank memory and step time, gathered to every rank with one all-reduce (all ranks call it)."""
    peak, kind = dt.peak_memory(device)
    mine = [peak, dt.parameter_bytes(model), grad_bytes, dt.optimizer_bytes(optimizer), step_s]
    rows = dt.gather_rows(mine, info, device)
    col = [[int(r[i]) for r in rows] for i in range(4)]
    return {
        "step_time_ms": round(1e3 * max(r[4] for r in rows), 3),  # the slowest rank's mean
        "peak_memory_bytes": max(col[0]),
        "peak_memory_kind": kind,
        "peak_memory_bytes_per_rank": col[0],
        "parameter_bytes_per_rank": col[1],
        "gradient_bytes_per_rank": col[2],
        "optimizer_bytes_per_rank": col[3],
    }


def memory_text(result: TrainResult) -> str:
    m = result.memory
    if not m:
        return ""
    mib = 2**20
    per_rank = "/".join(f"{b / mib:.0f}" for b in m["peak_memory_bytes_per_rank"])
    state = max(
        p + g + o
        for p, g, o in zip(
            m["parameter_bytes_per_rank"], m["gradient_bytes_per_rank"], m["optimizer_bytes_per_rank"]
        )
    )
    return (
        f", {result.step_time_ms:.1f} ms/step, peak memory {m['peak_memory_bytes'] / mib:.0f} MiB "
        f"({m['peak_memory_kind']}; per rank {per_rank}), params+grads+optimizer {state / mib:.1f} MiB per rank"
    )


def metrics_upto(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the records up to `step` (a resumed run rewrites what came after its checkpoint)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if rec.get("step", 0) <= step:
            kept.append(rec)
    # written beside and renamed over: a crash mid-write must not cut the run's history
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)
    return kept


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            "TensorBoard logging needs the tensorboard package: pip install 'kvlm[tensorboard]'"
        ) from e
    return SummaryWriter(str(path))


def record(step, tokens, loss, val_loss, lr, tps, elapsed) -> dict[str, Any]:
    return {
        "step": step,
        "tokens": tokens,
        "loss": loss,
        "val_loss": val_loss,
        "lr": lr,
        "tokens_per_s": round(tps, 1),
        "elapsed": round(elapsed, 3),
    }


def log_line(rec: dict[str, Any], total: int | None) -> str:
    parts = [f"step {rec['step']}" + (f"/{total}" if total else "")]
    if rec["loss"] is not None:
        parts.append(f"loss {rec['loss']:.4f}")
    if rec["val_loss"] is not None:
        parts.append(f"val {rec['val_loss']:.4f}")
    parts += [f"lr {rec['lr']:.2e}", f"{rec['tokens_per_s']:,.0f} tok/s", f"{rec['elapsed']:.0f} s"]
    if rec.get("step_time_ms") is not None:
        parts.append(f"{rec['step_time_ms']:.1f} ms/step")
        parts.append(f"peak {rec['peak_memory_bytes'] / 2**20:.0f} MiB")
    return " | ".join(parts)
