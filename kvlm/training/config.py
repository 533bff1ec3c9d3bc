"""TrainConfig: everything that decides how a model is trained (budget, batch, schedule, optimizer, device).

The budget is the first reached of max_steps / max_tokens / max_minutes; ``total_steps()`` is what a step or
token budget allows and ``warmup()`` the warm-up it implies (5 % of the steps, at most 100, unless given).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvlm.config import ConfigError, check_mapping, coerce_fields

# fields that fix which tokens each step sees: a resumed run must keep them
DATA_ORDER_FIELDS = ("batch_size", "seq_len", "seed")


@dataclass
class TrainConfig:
    """How a model is trained: the budget (the first of max_steps / max_tokens / max_minutes reached ends the
    run), batch and window, AdamW and its schedule, evaluation, logging and checkpoint intervals, device and
    precision, parallelism, and fine-tuning (init, train_only, freeze). Every field can be set from YAML or the
    command line (``kvlm train --set FIELD=VALUE``); a bad value is one ConfigError naming the field."""

    batch_size: int = 32  # sequences per optimizer step, over all ranks and accumulation steps
    grad_accum: int = 1  # micro-steps per optimizer step (each rank): micro batch = batch / (accum * ranks)
    seq_len: int = 256
    max_steps: int | None = 1000  # the budget: the first of steps / tokens / minutes reached ends training
    max_tokens: int | None = None
    max_minutes: float | None = None
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decay ends at min_lr_ratio * lr
    warmup_steps: int | None = None  # None: 5 % of the budget (of the steps, at most 100; or of the time)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    eval_interval: int = 100  # steps between validation losses (and the last step)
    eval_iters: int = 20  # validation batches (of batch_size windows) per evaluation
    eval_at_start: bool = False  # also evaluate the untrained model (step 0)
    log_interval: int = 10
    checkpoint_interval: int | None = None  # default: eval_interval; checkpoints need an out_dir
    seed: int = 0
    device: str = "auto"  # "auto" = cuda if available, else cpu
    dtype: str = "auto"  # "auto" = bfloat16 autocast on CUDA, float32 on CPU; or "float32" / "bfloat16"
    compile: bool = False  # torch.compile the model
    embedding_parallel: bool = False  # EG-MLA: shard the gate tables by columns over the DDP ranks (Eq. 9)
    fsdp: bool = False  # FSDP2 (fully_shard) instead of DDP across ranks: 1/N of weights, grads, AdamW state
    # fine-tuning (kvlm.training.start): start from these weights (a kvlm checkpoint or a Hugging Face folder)
    # with a fresh optimizer at step 0, and train only some parameters (comma-separated fnmatch globs on
    # parameter names, e.g. "*.attn.wkv_a*"): train_only selects, freeze removes from the selection
    init: str | None = None
    freeze: str | None = None
    train_only: str | None = None

    def __post_init__(self) -> None:
        coerce_fields(
            self
        )  # `lr: 1e-3` from YAML is the string "1e-3": a float, or one error naming the field
        self.validate()

    def validate(self) -> None:
        for name in ("batch_size", "grad_accum", "seq_len", "eval_interval", "eval_iters", "log_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ConfigError(
                f"batch_size={self.batch_size} is not divisible by grad_accum={self.grad_accum}"
            )
        if self.max_steps is None and self.max_tokens is None and self.max_minutes is None:
            raise ConfigError("give a training budget: max_steps, max_tokens or max_minutes")
        for name in ("max_steps", "max_tokens", "max_minutes", "checkpoint_interval"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ConfigError(f"{name} must be positive, got {v}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"need lr > 0 and 0 <= min_lr_ratio <= 1 (got {self.lr}, {self.min_lr_ratio})")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.device != "auto":
            _check_device(self.device)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.embedding_parallel and self.compile:
            raise ConfigError("embedding_parallel does not support compile (the gate exchange's collectives)")
        if self.fsdp and self.embedding_parallel:
            raise ConfigError("fsdp and embedding_parallel do not combine (choose one way to shard)")
        if self.fsdp and (self.freeze or self.train_only):
            raise ConfigError("freeze / train_only do not combine with fsdp here (untested); use DDP")
        if self.fsdp and self.compile:
            raise ConfigError("fsdp does not support compile here (wrap order); drop one of them")

    def replace(self, **changes: Any) -> TrainConfig:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        check_mapping(data, "TrainConfig")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s): {', '.join(sorted(unknown))}")
        return cls(**data)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        total = self.total_steps()
        return 0 if total is None else min(100, math.ceil(0.05 * total))  # time budgets: see lr_at

    def total_steps(self) -> int | None:
        """Steps the step or token budget allows (None for a time budget alone)."""
        limits = []
        if self.max_steps is not None:
            limits.append(self.max_steps)
        if self.max_tokens is not None:
            limits.append(math.ceil(self.max_tokens / self.tokens_per_step))
        return min(limits) if limits else None


def _check_device(name: str) -> None:
    """ConfigError for a device string torch cannot parse (``tpu``); availability is checked when training starts."""
    import torch  # on use: a config can be built and validated without importing torch

    try:
        torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device {name!r} is not a device (use auto, cpu, cuda, cuda:N or mps)") from None


def budget_text(t: TrainConfig) -> str:
    """The budget in words: "300 steps / 1,000,000 tokens / 5 min"."""
    parts = []
    if t.max_steps is not None:
        parts.append(f"{t.max_steps} steps")
    if t.max_tokens is not None:
        parts.append(f"{t.max_tokens:,} tokens")
    if t.max_minutes is not None:
        parts.append(f"{t.max_minutes:g} min")
    return " / ".join(parts)
