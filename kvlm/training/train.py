"""`kvlm train`: the training loop, its configuration, checkpoints, logs and exact resume.

    from kvlm.training.train import TrainConfig, train
    result = train(model_cfg, TrainConfig(max_steps=300), data="data/stories", out_dir="runs/mla")

- AdamW (beta 0.9 / 0.95, weight decay on the >= 2-D weights: matrices and embeddings, as nanoGPT;
  norms and biases are not decayed), linear warm-up, cosine decay to min_lr_ratio of the peak, gradient
  clipping, gradient accumulation. CPU trains in float32; CUDA in bf16 autocast (optional torch.compile).
- Data order is a pure function of (seed, step): each epoch is a seeded permutation of non-overlapping
  seq_len windows, so a resumed run (weights, optimizer, RNG states and step restored from the
  checkpoint) reproduces the uninterrupted run's losses exactly on CPU.
- Data parallel under torchrun (kvlm.parallel.data_parallel): rank r takes a disjoint slice of every global
  batch; rank 0 writes metrics.jsonl, config.yaml and checkpoints.
- embedding_parallel (EG-MLA only, eg-mla.md "Embedding Parallelism", Eqs. 9-11, Table 6): under DDP each
  rank keeps a 1/W column slice of every gating embedding table (kvlm.parallel.tensor_parallel.shard_gate_embeddings),
  DDP covers the replicated parameters only, gradients are clipped by the whole model's norm. The
  training is the same computation as plain DDP (same losses up to float rounding). Checkpoints hold whole
  tables and whole AdamW moments (gathered to rank 0), so they load unsharded and resume with or without
  embedding parallelism, at any number of ranks. With one process it is a no-op (logged); a model without
  gate tables is a ConfigError; torch.compile is not supported with it (ConfigError).
- Every logged record carries per-rank memory and time (gathered once per log interval): peak memory
  (process peak RSS on CPU, torch.cuda.max_memory_allocated on CUDA), parameter / gradient / optimizer
  state bytes, and the mean step time of the interval (evaluation and checkpoint time left out).

Run folder: config.yaml (model + train + data), metrics.jsonl (one JSON record per logged step:
step, tokens, loss, val_loss, lr, tokens_per_s, elapsed, step_time_ms, peak_memory_bytes (max over ranks),
peak_memory_kind and per rank: peak_memory_bytes_per_rank, parameter_bytes_per_rank, gradient_bytes_per_rank,
optimizer_bytes_per_rank), checkpoint/ (the latest, kvlm.checkpoint format
with trainer_state.pt), result.json, tensorboard/ (optional).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvlm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvlm.config import ConfigError, ModelConfig, load_yaml_or_json
from kvlm.data.prepare import DataError, PreparedData, TokenStream, load_prepared
from kvlm.model import build_model
from kvlm.parallel import data_parallel as dt
from kvlm.parallel.tensor_parallel import clip_grad_norm, shard_gate_embeddings

CHECKPOINT_DIR = "checkpoint"
# fields that fix which tokens each step sees: a resumed run must keep them
DATA_ORDER_FIELDS = ("batch_size", "seq_len", "seed")


@dataclass
class TrainConfig:
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

    def __post_init__(self) -> None:
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
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.embedding_parallel and self.compile:
            raise ConfigError("embedding_parallel does not support compile (the gate exchange's collectives)")

    def replace(self, **changes: Any) -> TrainConfig:
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s): {', '.join(sorted(unknown))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
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


# ------------------------------------------------------------------------------------------------
# schedule, optimizer, data order
# ------------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int, elapsed: float = 0.0) -> float:
    """Learning rate for update `step` (0-based): linear warm-up, then cosine from lr down to
    min_lr_ratio * lr over the rest of the budget. A step or token budget counts in steps; a time budget
    alone counts in seconds of training (`elapsed`), and by default warms up over its first 5 %."""
    total = cfg.total_steps()
    if total is None and cfg.warmup_steps is None:
        frac, warm = elapsed / (cfg.max_minutes * 60.0), 0.05
        if frac < warm:
            return cfg.lr * frac / warm
        p = (frac - warm) / (1 - warm)
    else:
        warmup = cfg.warmup()
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        p = (
            (step - warmup) / max(1, total - warmup)
            if total is not None
            else elapsed / (cfg.max_minutes * 60.0)
        )
    p = min(max(p, 0.0), 1.0)
    min_lr = cfg.min_lr_ratio * cfg.lr
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * p))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # named_parameters yields tied weights once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **extra)


class BatchOrder:
    """Which windows of the training stream each step reads: a pure function of (seed, step).

    Epoch e is a seeded permutation of the non-overlapping windows of seq_len + 1 tokens (inputs and
    next-token targets) starting at a seeded offset; global sample g is window g mod n of epoch g // n."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int):
        self.stream, self.seq_len, self.seed = stream, seq_len, seed
        self.n = (len(stream) - seq_len) // seq_len
        if self.n < 1:
            raise DataError(
                f"the training split has {len(stream)} tokens: too few for one window of seq_len + 1 = {seq_len + 1}"
            )
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, e: int) -> tuple[int, np.ndarray]:
        if e not in self._epochs:
            rng = np.random.default_rng([self.seed, e])
            offset = int(rng.integers(0, len(self.stream) - 1 - self.n * self.seq_len + 1))
            self._epochs = {e: (offset, rng.permutation(self.n))}  # one epoch cached at a time
        return self._epochs[e]

    def starts(self, first_sample: int, count: int) -> list[int]:
        out = []
        for g in range(first_sample, first_sample + count):
            offset, perm = self._epoch(g // self.n)
            out.append(offset + int(perm[g % self.n]) * self.seq_len)
        return out

    def epoch_of(self, sample: int) -> float:
        return sample / self.n


def eval_starts(stream: TokenStream, seq_len: int, count: int) -> list[int]:
    """The same `count` validation windows every evaluation, spread evenly over the split."""
    n = (len(stream) - 1) // seq_len
    if n < 1:
        return []
    idx = np.unique(np.linspace(0, n - 1, min(count, n)).round().astype(np.int64))
    return [int(i) * seq_len for i in idx]


# ------------------------------------------------------------------------------------------------
# devices, precision, RNG
# ------------------------------------------------------------------------------------------------
def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local_rank)
    return dev


def autocast_for(cfg: TrainConfig, device: torch.device):
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return contextlib.nullcontext, "float32"
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), "bfloat16"


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # plain lists so the file loads with torch.load(weights_only=True)
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": _to_lists(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    random.setstate(_to_tuples(state["python"]))


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


# ------------------------------------------------------------------------------------------------
# evaluation
# ------------------------------------------------------------------------------------------------
@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    stream: TokenStream,
    starts: list[int],
    seq_len: int,
    batch_size: int,
    device: torch.device,
    autocast=contextlib.nullcontext,
    info: dt.DistInfo | None = None,
    lockstep: bool = False,
) -> float | None:
    """Mean next-token loss over the windows at `starts` (split over ranks, summed across them).
    lockstep: every rank makes the same number of model calls (sharded gate tables exchange in each call);
    a rank out of windows runs a throw-away call."""
    info = info or dt.DistInfo()
    mine = starts[info.rank :: info.world_size]
    calls = math.ceil(len(starts[:: info.world_size] if lockstep else mine) / batch_size)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, tokens)
    for i in range(0, calls * batch_size, batch_size):
        if not mine[i : i + batch_size]:
            xy = torch.from_numpy(stream.windows(starts[:1], seq_len + 1)).to(device)
            with autocast():
                model(xy[:, :-1])
            continue
        xy = torch.from_numpy(stream.windows(mine[i : i + batch_size], seq_len + 1)).to(device)
        with autocast():
            logits = model(xy[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten(), reduction="sum")
        total += torch.stack(
            [loss.double(), torch.tensor(xy[:, 1:].numel(), dtype=torch.float64, device=device)]
        )
    dt.all_reduce_sum(total, info)
    model.train(was_training)
    return None if total[1] == 0 else float(total[0] / total[1])


# ------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------
def train(
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig,
    data: PreparedData | str | Path,
    out_dir: str | Path | None = None,
    *,
    resume: bool | str | Path = False,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
    callback: Callable[[dict[str, Any]], None] | None = None,
    adapt_vocab: bool = False,
    tensorboard: bool = False,
) -> TrainResult:
    """Train a model of `model_cfg` on prepared `data` (a PreparedData or its folder).

    out_dir: where config.yaml, metrics.jsonl and checkpoint/ go (None: nothing is written).
    resume: True = continue from out_dir/checkpoint, or a checkpoint folder; the model config then
    comes from the checkpoint (model_cfg may be None). adapt_vocab: set the model's vocab_size to the
    tokenizer's instead of failing when it is smaller. progress / log / callback: a tqdm bar, a
    line logger (None = quiet) and a function called with every metrics record (rank 0 only).
    Seeds the global torch / numpy / random generators from train_cfg.seed."""
    data = data if isinstance(data, PreparedData) else load_prepared(data)
    device_probe = resolve_device(train_cfg.device)
    info = dt.setup(device_probe.type)
    try:
        return _train(
            model_cfg,
            train_cfg,
            data,
            out_dir,
            resume,
            progress,
            log,
            callback,
            adapt_vocab,
            tensorboard,
            info,
        )
    finally:
        dt.teardown(info)


def _train(model_cfg, tcfg, data, out_dir, resume, progress, log, callback, adapt_vocab, tensorboard, info):
    from tqdm.auto import tqdm

    main = info.is_main
    say = (log if main and log is not None else None) or (lambda msg: None)
    out_dir = Path(out_dir) if out_dir is not None else None
    device = resolve_device(tcfg.device, info.local_rank)
    autocast, precision = autocast_for(tcfg, device)
    if tcfg.batch_size % (tcfg.grad_accum * info.world_size):
        raise ConfigError(
            f"batch_size={tcfg.batch_size} does not split into grad_accum={tcfg.grad_accum} micro-steps "
            f"x {info.world_size} ranks"
        )
    share = tcfg.batch_size // info.world_size  # this rank's rows of each global batch
    micro = share // tcfg.grad_accum

    # --- model, optimizer, state (fresh or resumed) ------------------------------------------------
    state = None
    if resume:
        ckpt = (
            Path(resume) if not isinstance(resume, bool) else (out_dir / CHECKPOINT_DIR if out_dir else None)
        )
        if ckpt is None:
            raise ConfigError("resume=True needs an out_dir (or pass the checkpoint folder)")
        model, state = _load_for_resume(ckpt, model_cfg, tcfg, data)
        model_cfg = model.cfg
    else:
        if model_cfg is None:
            raise ConfigError("no model config given")
        model_cfg = _fit_vocab(model_cfg, data, adapt_vocab, say)
        torch.manual_seed(tcfg.seed)  # the same initial weights on every rank, whatever came before
        model = build_model(model_cfg)
    _check_fit(model_cfg, tcfg, data)
    model.to(device).train()
    n_params = model.parameter_counts()  # the whole model's, before any sharding
    sharded = _shard_for_embedding_parallel(model, tcfg, info, say)
    optimizer = make_optimizer(model, tcfg, device)
    order = BatchOrder(data.train, tcfg.seq_len, tcfg.seed)
    # eval_iters global batches of validation windows: the same windows whatever the ranks / accumulation
    val_starts = eval_starts(data.val, tcfg.seq_len, tcfg.eval_iters * tcfg.batch_size)
    if not val_starts:
        say(f"warning: the validation split ({len(data.val)} tokens) is too short for seq_len {tcfg.seq_len}")

    step, tokens, elapsed_before = 0, 0, 0.0
    losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    if state is not None:
        # checkpoints hold whole-table moments: re-slice them to this rank's columns
        opt_state = (
            dt.shard_optimizer_state(state["optimizer"], optimizer, model) if sharded else state["optimizer"]
        )
        optimizer.load_state_dict(opt_state)
        step, tokens, elapsed_before = state["step"], state["tokens"], state["elapsed"]
        losses, val_losses = list(state["losses"]), [tuple(v) for v in state["val_losses"]]
        rngs = state["rng"]
        set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0])
        say(f"resumed from {state['path']} at step {step} ({tokens:,} tokens)")
        if state["data"]["content_hash"] != data.content_hash:
            say(f"warning: {data.path} differs from the data this checkpoint was trained on")
    else:
        torch.manual_seed(tcfg.seed + info.rank)  # dropout masks differ per rank
        np.random.seed(tcfg.seed + info.rank)
        random.seed(tcfg.seed + info.rank)

    core = torch.compile(model) if tcfg.compile else model
    net = dt.wrap_for(core, info, device, sharded)
    total = tcfg.total_steps()
    budget_s = tcfg.max_minutes * 60.0 if tcfg.max_minutes is not None else 0.0
    ckpt_every = tcfg.checkpoint_interval or tcfg.eval_interval

    # --- run folder ------------------------------------------------------------------------------------
    metrics_f = tb = None
    history: list[dict[str, Any]] = []
    if main and out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        _write_config(out_dir, model_cfg, tcfg, data, info.world_size)
        history = _metrics_upto(out_dir / "metrics.jsonl", step if state is not None else 0)
        metrics_f = open(out_dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            tb = _tensorboard(out_dir / "tensorboard")
    say(
        f"training {model_cfg.attention} ({n_params['total'] / 1e6:.2f} M parameters) on {data.source}: "
        f"{_budget_text(tcfg)}, batch {tcfg.batch_size} x {tcfg.seq_len} tokens, {device}, {precision}"
        + (f", {info.world_size} ranks" if info.enabled else "")
        + (", embedding-parallel gate tables" if sharded else "")
    )

    bar = tqdm(
        total=total,
        initial=step,
        disable=not (progress and main),
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        leave=False,
    )
    pending: list[torch.Tensor] = []  # per-step loss tensors not yet reduced (one sync per log interval)
    t_start = time.perf_counter()
    t_mark, tokens_mark = t_start, tokens
    run_tokens = 0
    last_ckpt = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this run's peak
    # step timing: laps from the end of the last log / checkpoint bookkeeping (evaluation, saving) to the
    # next one's loss flush (which waits for the device), so only optimizer steps are timed
    t_steps, steps_mark = time.perf_counter(), step
    lap_s, lap_steps = 0.0, 0  # since the last log record
    train_s, train_steps = 0.0, 0  # the whole run
    grad_bytes = 0
    memory: dict[str, Any] = {}

    def elapsed() -> float:
        return elapsed_before + time.perf_counter() - t_start

    def flush_losses() -> None:
        if pending:
            t = dt.all_reduce_sum(torch.stack(pending).float(), info) / info.world_size
            losses.extend(t.tolist())
            pending.clear()

    def emit(rec: dict[str, Any]) -> None:
        history.append(rec)
        if metrics_f is not None:
            metrics_f.write(json.dumps(rec) + "\n")
        if tb is not None:
            for k in ("loss", "val_loss", "lr", "tokens_per_s"):
                if rec.get(k) is not None:
                    tb.add_scalar(k, rec[k], rec["step"])
        if callback is not None and main:
            callback(rec)

    def evaluate_now() -> float | None:
        if not val_starts:
            return None
        return validation_loss(
            core, data.val, val_starts, tcfg.seq_len, micro, device, autocast, info, lockstep=sharded
        )

    try:
        if tcfg.eval_at_start and step == 0 and not val_losses:
            v = evaluate_now()
            if v is not None:
                val_losses.append((0, v))
                emit(_record(0, 0, None, v, 0.0, 0.0, 0.0))
                say(f"step 0: val loss {v:.4f}")
        # a time budget is judged by rank 0's clock, shared once a step: every rank must take the same
        # learning rate and stop at the same step
        shared_elapsed = dt.broadcast_float(elapsed(), info, device) if budget_s else 0.0
        while not ((total is not None and step >= total) or (budget_s and shared_elapsed >= budget_s)):
            lr = lr_at(tcfg, step, shared_elapsed)
            for g in optimizer.param_groups:
                g["lr"] = lr
            # this rank's rows of the global batch: a contiguous slice, then cut into micro-batches
            mine = order.starts(step * tcfg.batch_size + info.rank * share, share)
            step_loss = torch.zeros((), device=device)
            for m in range(tcfg.grad_accum):
                xy = torch.from_numpy(data.train.windows(mine[m * micro : (m + 1) * micro], tcfg.seq_len + 1))
                xy = xy.to(device, non_blocking=True)
                sync = m == tcfg.grad_accum - 1 or not info.enabled
                with contextlib.nullcontext() if sync else net.no_sync():
                    with autocast():
                        logits = net(xy[:, :-1])
                    loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten())
                    (loss / tcfg.grad_accum).backward()
                step_loss += loss.detach() / tcfg.grad_accum
            if tcfg.grad_clip > 0:
                if sharded:  # the norm of the whole gradient: the ranks' table slices summed
                    clip_grad_norm(model, tcfg.grad_clip)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            if grad_bytes == 0 or (step + 1) % tcfg.log_interval == 0:
                grad_bytes = dt.gradient_bytes(model)  # the .grad tensors exist until zero_grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(step_loss)
            step += 1
            tokens += tcfg.tokens_per_step
            run_tokens += tcfg.tokens_per_step
            bar.update(1)

            is_last = total is not None and step >= total
            is_eval = step % tcfg.eval_interval == 0 or is_last
            is_log = step % tcfg.log_interval == 0 or is_eval
            is_ckpt = out_dir is not None and (step % ckpt_every == 0 or is_last)
            if budget_s:
                shared_elapsed = dt.broadcast_float(elapsed(), info, device)
                if shared_elapsed >= budget_s:  # the time budget ends the run: evaluate and save now
                    is_eval, is_log, is_ckpt = True, True, out_dir is not None
            if is_log or is_ckpt:
                flush_losses()
                lap_s += time.perf_counter() - t_steps
                lap_steps += step - steps_mark
            if is_log:
                train_s, train_steps = train_s + lap_s, train_steps + lap_steps
                memory = _rank_memory(model, optimizer, grad_bytes, lap_s / lap_steps, device, info)
                lap_s, lap_steps = 0.0, 0
                v = evaluate_now() if is_eval else None
                if v is not None:
                    val_losses.append((step, v))
                now = time.perf_counter()
                tps = (tokens - tokens_mark) / max(now - t_mark, 1e-9)
                t_mark, tokens_mark = now, tokens
                record = _record(step, tokens, losses[-1], v, lr, tps, elapsed())
                record.update(memory)
                emit(record)
                postfix = {"loss": f"{losses[-1]:.3f}", "tok/s": f"{tps:,.0f}"}
                if budget_s:
                    postfix["left"] = f"{max(0.0, budget_s - shared_elapsed):.0f}s"
                bar.set_postfix(postfix, refresh=False)
                line = _log_line(record, total)
                if bar.disable:
                    say(line)
                elif v is not None and main and log is not None:
                    bar.write(line, file=sys.stderr)
            if is_ckpt:
                last_ckpt = _save(
                    out_dir, model, data, tcfg, optimizer, step, tokens, elapsed(), losses, val_losses, info,
                    sharded,
                )  # fmt: skip
            if is_log or is_ckpt:
                t_steps, steps_mark = time.perf_counter(), step
    finally:
        bar.close()
        if metrics_f is not None:
            metrics_f.close()
        if tb is not None:
            tb.close()

    flush_losses()
    if sharded:  # hand back the whole model (every rank), as a plain DDP run does
        dt.unshard_gate_tables(model)
    wall = time.perf_counter() - t_start
    best = min((v for _, v in val_losses), default=None)
    result = TrainResult(
        final_val_loss=val_losses[-1][1] if val_losses and val_losses[-1][0] == step else None,
        best_val_loss=best,
        final_train_loss=losses[-1] if losses else None,
        losses=losses,
        val_losses=val_losses,
        steps=step,
        tokens=tokens,
        tokens_per_s=run_tokens / max(wall, 1e-9),
        wall_time_s=wall,
        checkpoint=last_ckpt,
        out_dir=out_dir,
        n_params=n_params,
        model_config=model_cfg.to_dict(),
        train_config=tcfg.to_dict(),
        data_source=data.source,
        history=history,
        step_time_ms=1e3 * train_s / train_steps if train_steps else None,
        memory=memory,
        model=model,
    )
    if main and out_dir is not None:
        (out_dir / "result.json").write_text(json.dumps(result.to_dict(), indent=2))
    fv = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
    say(f"done: {step} steps, {tokens:,} tokens, {wall:.1f} s, final val loss {fv}" + _memory_text(result))
    return result


# ------------------------------------------------------------------------------------------------
# helpers of the loop
# ------------------------------------------------------------------------------------------------
def _fit_vocab(cfg: ModelConfig, data: PreparedData, adapt: bool, say) -> ModelConfig:
    if cfg.vocab_size == data.vocab_size:
        return cfg
    if adapt:
        say(f"vocab_size {cfg.vocab_size} -> {data.vocab_size} (the data's tokenizer)")
        return cfg.replace(vocab_size=data.vocab_size)
    return cfg


def _check_fit(cfg: ModelConfig, tcfg: TrainConfig, data: PreparedData) -> None:
    if cfg.vocab_size < data.vocab_size:
        raise ConfigError(
            f"vocabulary mismatch: the model has vocab_size={cfg.vocab_size} but the data's tokenizer has "
            f"{data.vocab_size} tokens (set vocab_size={data.vocab_size}, or adapt_vocab=True)"
        )
    if tcfg.seq_len > cfg.max_seq_len:
        raise ConfigError(f"seq_len={tcfg.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")


def _load_for_resume(path: Path, model_cfg: ModelConfig | None, tcfg: TrainConfig, data: PreparedData):
    if not path.is_dir():
        raise CheckpointError(f"nothing to resume: no checkpoint folder at {path}")
    if not (path / "trainer_state.pt").is_file():
        raise CheckpointError(f"checkpoint {path} cannot be resumed: trainer_state.pt is missing")
    model, tokenizer, meta = load_checkpoint(path)
    try:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unpickling errors: torch raises several kinds
        raise CheckpointError(f"checkpoint {path}: cannot read trainer_state.pt: {e}") from e
    if tokenizer is not None and tokenizer.sha256() != data.tokenizer.sha256():
        raise CheckpointError(f"checkpoint {path} was trained with a different tokenizer than {data.path}")
    if model_cfg is not None:
        mine, theirs = model_cfg.to_dict(), model.cfg.to_dict()
        # the vocabulary may have been adapted to the data when the run started
        diff = [
            k
            for k in mine
            if mine[k] != theirs[k] and not (k == "vocab_size" and theirs[k] == data.vocab_size)
        ]
        if diff:
            raise ConfigError(f"resume: the model config differs from the checkpoint's in {', '.join(diff)}")
    saved = state["train_config"]
    diff = [k for k in DATA_ORDER_FIELDS if saved.get(k) != getattr(tcfg, k)]
    if diff:
        raise ConfigError(
            "resume: "
            + ", ".join(f"{k}={getattr(tcfg, k)} (checkpoint: {saved.get(k)})" for k in diff)
            + " would change the data order"
        )
    state["path"] = str(path)
    return model, state


def _save(
    out_dir, model, data, tcfg, optimizer, step, tokens, elapsed, losses, val_losses, info, sharded=False
) -> Path:
    rngs = dt.gather_objects(rng_state(), info)  # every rank's generators, for an exact resume
    path = out_dir / CHECKPOINT_DIR
    # sharded gate tables: whole tables and AdamW moments on rank 0 (collectives: every rank takes part),
    # so the checkpoint is the one an unsharded run writes
    opt_state = dt.full_optimizer_state(optimizer, model) if sharded else optimizer.state_dict()
    with dt.full_gate_tables(model) if sharded else contextlib.nullcontext():
        if info.is_main:
            state = {
                "step": step,
                "tokens": tokens,
                "elapsed": elapsed,
                "optimizer": opt_state,
                "schedule": {"total_steps": tcfg.total_steps(), "warmup_steps": tcfg.warmup()},
                "data": {"samples_seen": step * tcfg.batch_size, "content_hash": data.content_hash},
                "rng": rngs,
                "losses": list(losses),
                "val_losses": [list(v) for v in val_losses],
                "world_size": info.world_size,
                "train_config": tcfg.to_dict(),
            }
            meta = {
                "step": step,
                "tokens": tokens,
                "val_loss": val_losses[-1][1] if val_losses else None,
                "train_config": tcfg.to_dict(),
                "data": data.summary(),
            }
            save_checkpoint(path, model, tokenizer=data.tokenizer, meta=meta, trainer_state=state)
    dt.barrier(info)
    return path


def _shard_for_embedding_parallel(model, tcfg: TrainConfig, info: dt.DistInfo, say) -> bool:
    """TrainConfig.embedding_parallel: shard the gate tables over the ranks; True when they are sharded."""
    if not tcfg.embedding_parallel:
        return False
    if not any(getattr(p, "is_gate_embedding", False) for p in model.parameters()):
        raise ConfigError(
            f"embedding_parallel shards EG-MLA's gating embedding tables; attention {model.cfg.attention!r} "
            "has none (use attention eg-mla, or drop --embedding-parallel)"
        )
    if not info.enabled:
        say("embedding_parallel: one process, nothing to shard (the gate tables stay whole)")
        return False
    shard_gate_embeddings(model, info.rank, info.world_size)
    return True


def _rank_memory(model, optimizer, grad_bytes: int, step_s: float, device, info: dt.DistInfo) -> dict:
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


def _memory_text(result: TrainResult) -> str:
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


def _write_config(out_dir: Path, cfg: ModelConfig, tcfg: TrainConfig, data: PreparedData, world: int) -> None:
    import yaml

    doc = {"model": cfg.to_dict(), "train": tcfg.to_dict(), "data": data.summary(), "world_size": world}
    (out_dir / "config.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def _metrics_upto(path: Path, step: int) -> list[dict[str, Any]]:
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
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    return kept


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ConfigError(
            "TensorBoard logging needs the tensorboard package: pip install 'kvlm[tensorboard]'"
        ) from e
    return SummaryWriter(str(path))


def _record(step, tokens, loss, val_loss, lr, tps, elapsed) -> dict[str, Any]:
    return {
        "step": step,
        "tokens": tokens,
        "loss": loss,
        "val_loss": val_loss,
        "lr": lr,
        "tokens_per_s": round(tps, 1),
        "elapsed": round(elapsed, 3),
    }


def _log_line(rec: dict[str, Any], total: int | None) -> str:
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


def _budget_text(t: TrainConfig) -> str:
    parts = []
    if t.max_steps is not None:
        parts.append(f"{t.max_steps} steps")
    if t.max_tokens is not None:
        parts.append(f"{t.max_tokens:,} tokens")
    if t.max_minutes is not None:
        parts.append(f"{t.max_minutes:g} min")
    return " / ".join(parts)


# ------------------------------------------------------------------------------------------------
# CLI: kvlm train
# ------------------------------------------------------------------------------------------------
# model flags: (flag, field, type)
MODEL_FLAGS = [
    ("--attention", "attention", str),
    ("--arch", "arch", str),
    ("--n-layer", "n_layer", int),
    ("--d-model", "d_model", int),
    ("--n-head", "n_head", int),
    ("--head-dim", "head_dim", int),
    ("--n-kv-head", "n_kv_head", int),
    ("--ffn-dim", "ffn_dim", int),
    ("--kv-lora-rank", "kv_lora_rank", int),
    ("--q-lora-rank", "q_lora_rank", int),
    ("--rope-head-dim", "rope_head_dim", int),
    ("--max-seq-len", "max_seq_len", int),
    ("--vocab-size", "vocab_size", int),
    ("--dropout", "dropout", float),
]
TRAIN_FLAGS = [
    ("--batch-size", "batch_size", int),
    ("--grad-accum", "grad_accum", int),
    ("--seq-len", "seq_len", int),
    ("--lr", "lr", float),
    ("--min-lr-ratio", "min_lr_ratio", float),
    ("--warmup", "warmup_steps", int),
    ("--weight-decay", "weight_decay", float),
    ("--grad-clip", "grad_clip", float),
    ("--eval-interval", "eval_interval", int),
    ("--eval-iters", "eval_iters", int),
    ("--log-interval", "log_interval", int),
    ("--checkpoint-interval", "checkpoint_interval", int),
    ("--seed", "seed", int),
    ("--device", "device", str),
    ("--dtype", "dtype", str),
]


def add_arguments(p) -> None:
    p.add_argument("--data", required=True, help="a prepared data folder (kvlm prepare), or 'synthetic' / text files "
                   "to prepare into OUT/data first")  # fmt: skip
    p.add_argument("--out", "-o", required=True, help="run folder: config.yaml, metrics.jsonl, checkpoint/")
    p.add_argument("--preset", help="a named model configuration (kvlm kv-table --list)")
    p.add_argument(
        "--config", help="YAML/JSON: ModelConfig fields, TrainConfig fields, or model:/train: sections"
    )
    g = p.add_argument_group("model overrides")
    for flag, name, typ in MODEL_FLAGS:
        g.add_argument(flag, dest=f"m_{name}", type=typ, metavar=name.upper(), help=f"ModelConfig.{name}")
    g = p.add_argument_group("budget (the first reached ends training)")
    g.add_argument("--steps", type=int, help="optimizer steps (default 1000 when no other budget is given)")
    g.add_argument("--tokens", type=int, help="training tokens")
    g.add_argument("--minutes", type=float, help="training time")
    g = p.add_argument_group("training")
    for flag, name, typ in TRAIN_FLAGS:
        g.add_argument(flag, dest=f"t_{name}", type=typ, metavar=name.upper(), help=f"TrainConfig.{name}")
    g.add_argument("--compile", action="store_true", help="torch.compile the model")
    g.add_argument("--embedding-parallel", action="store_true",
                   help="EG-MLA under torchrun: shard each gating embedding table by columns over the ranks "
                   "(eg-mla.md Eqs. 9-11); a no-op with one process")  # fmt: skip
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any ModelConfig or TrainConfig field (repeatable)")  # fmt: skip
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--tensorboard", action="store_true", help="also log to OUT/tensorboard")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")


def configs_from_args(args) -> tuple[ModelConfig, TrainConfig, bool]:
    """-> (model config, train config, whether vocab_size was given explicitly)."""
    import yaml

    model_fields = {f.name for f in fields(ModelConfig)}
    train_fields = {f.name for f in fields(TrainConfig)}
    model: dict[str, Any] = {}
    trn: dict[str, Any] = {}
    if args.preset:
        try:
            model.update(ModelConfig.from_preset(args.preset).to_dict())
        except ModuleNotFoundError as e:
            raise ConfigError("named presets are not available in this build (kvlm/presets.py)") from e
    explicit: dict[str, Any] = {}
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise ConfigError(f"no config file at {path}")
        doc = load_yaml_or_json(path.read_text(), path)
        if "model" in doc or "train" in doc:
            explicit.update(doc.get("model") or {})
            trn.update(doc.get("train") or {})
        else:
            for k, v in doc.items():
                if k in model_fields:
                    explicit[k] = v
                elif k in train_fields:
                    trn[k] = v
                else:
                    raise ConfigError(f"{path}: unknown field {k!r} (neither ModelConfig nor TrainConfig)")
    for _, name, _ in MODEL_FLAGS:
        v = getattr(args, f"m_{name}")
        if v is not None:
            explicit[name] = v
    for _, name, _ in TRAIN_FLAGS:
        v = getattr(args, f"t_{name}")
        if v is not None:
            trn[name] = v
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key = key.strip().replace("-", "_")
        parsed = yaml.safe_load(value)
        if key in model_fields:
            explicit[key] = parsed
        elif key in train_fields:
            trn[key] = parsed
        else:
            raise ConfigError(f"--set {key}: not a ModelConfig or TrainConfig field")
    if args.compile:
        trn["compile"] = True
    if getattr(args, "embedding_parallel", False):
        trn["embedding_parallel"] = True
    if args.steps is not None or args.tokens is not None or args.minutes is not None:
        trn["max_steps"], trn["max_tokens"], trn["max_minutes"] = args.steps, args.tokens, args.minutes
    if model and explicit.keys() & {"d_model", "n_head"} and "head_dim" not in explicit:
        model["head_dim"] = None  # re-derive from the changed shape
    if model and explicit.keys() & {"d_model"} and "ffn_dim" not in explicit:
        model["ffn_dim"] = None
    model.update(explicit)
    return ModelConfig.from_dict(model), TrainConfig.from_dict(trn), "vocab_size" in explicit


def main(args) -> int:
    from kvlm.data.prepare import load_or_prepare

    out = Path(args.out)
    model_cfg, tcfg, explicit_vocab = configs_from_args(args)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not (Path(args.data) / "meta.json").is_file():
        raise ConfigError(
            f"under torchrun, --data must be a prepared folder (run `kvlm prepare` first): {args.data}"
        )
    data = load_or_prepare(args.data, out / "data", log=print)
    if not explicit_vocab and model_cfg.vocab_size != data.vocab_size:
        if rank == 0:
            print(f"vocab_size {model_cfg.vocab_size} -> {data.vocab_size} (the data's tokenizer)")
        model_cfg = model_cfg.replace(vocab_size=data.vocab_size)
    result = train(
        model_cfg,
        tcfg,
        data,
        out,
        resume=args.resume,
        progress=not args.no_progress,
        log=print,
        tensorboard=args.tensorboard,
    )
    if args.json and rank == 0:
        summary = {k: v for k, v in result.to_dict().items() if k not in ("losses", "history")}
        print(json.dumps(summary))
    return 0
