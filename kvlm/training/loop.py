"""The training loop: ``train(model_cfg, train_cfg, data, out_dir)`` and the ``Trainer`` behind it.

A ``Trainer`` is one run: it builds (or resumes) the model and optimizer when constructed, and ``run()`` trains
until the budget is spent, evaluating, logging and checkpointing on the way. Its state is plain fields:
``progress`` (steps, tokens, losses: what a checkpoint restores), ``clock`` (what has been timed), ``pending``
(step losses not yet reduced over the ranks: one sync per log interval).

Data parallel under torchrun (kvlm.parallel.data_parallel): rank r takes a contiguous slice of every global
batch, cut into grad_accum micro-batches; rank 0 writes the run folder. With ``embedding_parallel`` (EG-MLA) each
rank holds a column slice of every gate table (kvlm.parallel.embedding_parallel.shard_gate_embeddings), gradients
are clipped by the whole model's norm, and checkpoints still hold whole tables and moments.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kvlm.attention import GateEmbedding
from kvlm.config import ConfigError, ModelConfig
from kvlm.data import PreparedData, load_prepared
from kvlm.errors import TrainingInterrupted
from kvlm.files import json_text
from kvlm.logs import get_logger
from kvlm.parallel import data_parallel as dt
from kvlm.parallel.embedding_parallel import clip_grad_norm, shard_gate_embeddings
from kvlm.progress import Progress
from kvlm.training.config import TrainConfig, budget_text
from kvlm.training.data_order import BatchOrder, eval_starts
from kvlm.training.device import autocast_for, resolve_device
from kvlm.training.guard import FiniteCheck, InterruptFlag, run_lock
from kvlm.training.metrics import (
    MetricsLog,
    StepClock,
    TrainResult,
    log_line,
    memory_text,
    rank_memory,
    record,
)
from kvlm.training.plot import LOSS_PNG, write_loss_plot
from kvlm.training.schedule import lr_at, make_optimizer
from kvlm.training.start import apply_freeze, check_fit, initial_model
from kvlm.training.state import (
    CHECKPOINT_DIR,
    RunProgress,
    load_for_resume,
    save_training_checkpoint,
    set_rng_state,
    write_config,
)
from kvlm.training.validation import validation_loss

logger = get_logger(__name__)


def train(
    model_cfg: ModelConfig | None,
    train_cfg: TrainConfig,
    data: PreparedData | str | Path,
    out_dir: str | Path | None = None,
    *,
    resume: bool | str | Path = False,
    progress: bool = True,
    callback: Callable[[dict[str, Any]], None] | None = None,
    adapt_vocab: bool = False,
    tensorboard: bool = False,
) -> TrainResult:
    """Train a model of `model_cfg` on prepared `data` (a PreparedData or its folder).

    out_dir: where config.yaml, metrics.jsonl and checkpoint/ go (None: nothing is written).
    resume: True = continue from out_dir/checkpoint, or a checkpoint folder; the model config then
    comes from the checkpoint (model_cfg may be None). adapt_vocab: set the model's vocab_size to the
    tokenizer's instead of failing when it is smaller. progress: kvlm.progress on rank 0 (a bar on a terminal, else
    periodic lines with rate and ETA besides one log record per log interval); callback: called with every metrics record (rank 0 only). Log records go to the
    ``kvlm.training`` loggers (rank 0). Seeds the global torch / numpy / random generators from train_cfg.seed."""
    data = data if isinstance(data, PreparedData) else load_prepared(data)
    info = dt.setup(resolve_device(train_cfg.device).type)
    try:
        trainer = Trainer(
            model_cfg,
            train_cfg,
            data,
            out_dir,
            info=info,
            resume=resume,
            callback=callback,
            adapt_vocab=adapt_vocab,
            tensorboard=tensorboard,
        )
        return trainer.run(progress=progress)
    finally:
        dt.teardown(info)


class Trainer:
    """One training run (see the module docstring). Construction builds or resumes the model, optimizer and
    counters; ``run()`` trains and returns the TrainResult."""

    def __init__(
        self,
        model_cfg: ModelConfig | None,
        tcfg: TrainConfig,
        data: PreparedData,
        out_dir: str | Path | None = None,
        *,
        info: dt.DistInfo,
        resume: bool | str | Path = False,
        callback: Callable[[dict[str, Any]], None] | None = None,
        adapt_vocab: bool = False,
        tensorboard: bool = False,
    ):
        self.tcfg, self.data, self.info = tcfg, data, info
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.callback, self.tensorboard = callback, tensorboard
        self.device = resolve_device(tcfg.device, info.local_rank)
        self.autocast, self.precision = autocast_for(tcfg, self.device)
        if tcfg.batch_size % (tcfg.grad_accum * info.world_size):
            raise ConfigError(
                f"batch_size={tcfg.batch_size} does not split into grad_accum={tcfg.grad_accum} micro-steps "
                f"x {info.world_size} ranks"
            )
        self.share = tcfg.batch_size // info.world_size  # this rank's rows of each global batch
        self.micro = self.share // tcfg.grad_accum

        state, self.origin = None, None
        if resume:
            ckpt = Path(resume) if not isinstance(resume, bool) else self._checkpoint_dir()
            if ckpt is None:
                raise ConfigError("resume=True needs an out_dir (or pass the checkpoint folder)")
            self.model, state = load_for_resume(ckpt, model_cfg, tcfg, data)
            self.model_cfg, self.origin = self.model.cfg, state.get("origin")
        else:  # a fresh model, or TrainConfig.init's weights (kvlm.training.start)
            self.model, self.origin = initial_model(model_cfg, tcfg, data, adapt_vocab, self._say)
            self.model_cfg = self.model.cfg
        check_fit(self.model_cfg, tcfg, data)
        self.model.to(self.device).train()
        self.n_params = self.model.parameter_counts()  # the whole model's, before any sharding
        # before the optimizer, which leaves out the frozen parameters
        self.n_trainable, n_frozen = apply_freeze(self.model, tcfg)
        if n_frozen:
            self._say(f"training {self.n_trainable:,} parameters, {n_frozen:,} frozen")
        self.sharded = self._shard_for_embedding_parallel()
        if tcfg.fsdp:  # FSDP2 before the optimizer: fully_shard turns the parameters into DTensors
            dt.wrap_fsdp(self.model, info)
        self.optimizer = make_optimizer(self.model, tcfg, self.device)
        self.order = BatchOrder(data.train, tcfg.seq_len, tcfg.seed)
        # eval_iters global batches of validation windows: the same windows whatever the ranks / accumulation
        self.val_starts = eval_starts(data.val, tcfg.seq_len, tcfg.eval_iters * tcfg.batch_size)
        if not self.val_starts:
            self._say(
                f"warning: the validation split ({len(data.val)} tokens) is too short for seq_len {tcfg.seq_len}",
                logging.WARNING,
            )
        if state is None:
            self.progress = RunProgress()
            self._seed_fresh_run()
        else:
            self.progress = self._restore(state)

        self.core = torch.compile(self.model) if tcfg.compile else self.model
        self.net = dt.wrap_for(self.core, info, self.device, self.sharded)
        self.total_steps = tcfg.total_steps()
        self.budget_s = tcfg.max_minutes * 60.0 if tcfg.max_minutes is not None else 0.0
        self.ckpt_every = tcfg.checkpoint_interval or tcfg.eval_interval

        # the state of run(): set there
        self.metrics: MetricsLog | None = None
        self.clock = StepClock()
        self.pending: list[torch.Tensor] = []  # per-step loss tensors not yet reduced over the ranks
        self.t_start = 0.0
        self.shared_elapsed = 0.0  # rank 0's elapsed() of the last broadcast (time budgets)
        self.mark = (0.0, 0)  # (time, tokens) of the last log record, for its tokens/s
        self.run_tokens = 0  # tokens trained in this session
        self.last_checkpoint: Path | None = None
        self.saved_step = -1  # the step of the last checkpoint this session saved
        self.finite = FiniteCheck(len(self.progress.losses))  # NaN / inf losses and weights stop the run
        self.interrupt = InterruptFlag(on=False)  # run() turns Ctrl-C into a save and a stop
        self.grad_bytes = 0
        self.memory: dict[str, Any] = {}

    # --- construction helpers --------------------------------------------------------------------------
    def _checkpoint_dir(self) -> Path | None:
        return self.out_dir / CHECKPOINT_DIR if self.out_dir is not None else None

    def _say(self, msg: str, level: int = logging.INFO) -> None:
        """Log on rank 0 only: every rank runs the same loop and would repeat each line."""
        if self.info.is_main:
            logger.log(level, msg)

    def _shard_for_embedding_parallel(self) -> bool:
        """TrainConfig.embedding_parallel: shard the gate tables over the ranks; True when they are sharded."""
        if not self.tcfg.embedding_parallel:
            return False
        if not any(isinstance(m, GateEmbedding) for m in self.model.modules()):
            raise ConfigError(
                f"embedding_parallel shards EG-MLA's gating embedding tables; attention "
                f"{self.model.cfg.attention!r} has none (use attention eg-mla, or drop --embedding-parallel)"
            )
        if not self.info.enabled:
            self._say("embedding_parallel: one process, nothing to shard (the gate tables stay whole)")
            return False
        shard_gate_embeddings(self.model, self.info.rank, self.info.world_size)
        return True

    def _restore(self, state: dict[str, Any]) -> RunProgress:
        """Optimizer, counters and this rank's RNG states from a checkpoint's trainer state."""
        # checkpoints hold whole-table moments: re-slice them to this rank's columns
        opt_state = state["optimizer"]
        if self.sharded:
            opt_state = dt.shard_optimizer_state(opt_state, self.optimizer, self.model)
        if dt.is_fsdp(self.model):  # whole moments in the checkpoint: each rank keeps its shards
            dt.fsdp_load_full_optimizer_state(self.model, self.optimizer, opt_state)
        else:
            self.optimizer.load_state_dict(opt_state)
        progress = RunProgress.from_state(state)
        rngs = state["rng"]
        set_rng_state(rngs[self.info.rank] if self.info.rank < len(rngs) else rngs[0])
        self._say(f"resumed from {state['path']} at step {progress.step} ({progress.tokens:,} tokens)")
        if state["data"]["content_hash"] != self.data.content_hash:
            self._say(
                f"warning: {self.data.path} differs from the data this checkpoint was trained on",
                logging.WARNING,
            )
        return progress

    def _seed_fresh_run(self) -> None:
        seed = self.tcfg.seed + self.info.rank  # dropout masks differ per rank
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)

    # --- the run -------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Seconds of training, this session and the ones before a resume."""
        return self.progress.elapsed_before + time.perf_counter() - self.t_start

    def run(self, progress: bool = True) -> TrainResult:
        """Train until the budget is spent; ``progress``: kvlm.progress on rank 0 (a bar on a terminal)."""
        info = self.info
        # one trainer per run folder (rank 0 writes it); under torchrun Ctrl-C stays as it is: the ranks would
        # stop at different steps
        lock = (
            run_lock(self.out_dir) if info.is_main and self.out_dir is not None else contextlib.nullcontext()
        )
        with lock, InterruptFlag(on=not info.enabled) as self.interrupt:
            return self._run(progress)

    def _run(self, progress: bool) -> TrainResult:
        tcfg, info = self.tcfg, self.info
        self._open_run_folder()
        self._say(
            f"training {self.model_cfg.attention} ({self.n_params['total'] / 1e6:.2f} M parameters) on "
            f"{self.data.source}: {budget_text(tcfg)}, batch {tcfg.batch_size} x {tcfg.seq_len} tokens, "
            f"{self.device}, {self.precision}"
            + (f", {info.world_size} ranks" if info.enabled else "")
            + (", embedding-parallel gate tables" if self.sharded else "")
        )
        # a bar on a terminal; elsewhere periodic lines with rate and ETA beside the per-record lines
        bar = Progress(self.total_steps, "train", "step", initial=self.progress.step,
                       enabled=progress and info.is_main)  # fmt: skip
        self.t_start = time.perf_counter()
        self.mark = (self.t_start, self.progress.tokens)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # this run's peak
        self.clock.restart(self.progress.step)
        try:
            self._loop(bar)
        finally:
            bar.close()
            self.metrics.close()
        return self._finish()

    def _open_run_folder(self) -> None:
        if self.info.is_main and self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            write_config(
                self.out_dir, self.model_cfg, self.tcfg, self.data, self.info.world_size, self.origin
            )
        self.metrics = MetricsLog(
            self.out_dir, self.progress.step, self.tensorboard, self.callback, self.info.is_main
        )

    def _budget_spent(self) -> bool:
        if self.total_steps is not None and self.progress.step >= self.total_steps:
            return True
        return bool(self.budget_s) and self.shared_elapsed >= self.budget_s

    def _loop(self, bar) -> None:
        p = self.progress
        if self.tcfg.eval_at_start and p.step == 0 and not p.val_losses:
            v = self.evaluate()
            if v is not None:
                p.val_losses.append((0, v))
                self.metrics.emit(record(0, 0, None, v, 0.0, 0.0, 0.0))
                self._say(f"step 0: val loss {v:.4f}")
        # a time budget is judged by rank 0's clock, shared once a step: every rank must take the same
        # learning rate and stop at the same step
        self.shared_elapsed = self._broadcast_elapsed() if self.budget_s else 0.0
        first = self.progress.step
        while not self._budget_spent():
            t0 = time.perf_counter()
            lr = self.train_step()
            bar.update(1)
            if self.progress.step == first + 1:
                self._expect(time.perf_counter() - t0)
            self._bookkeeping(lr, bar)
            if self.interrupt.requested:
                self._save_and_stop()

    def _expect(self, step_s: float) -> None:
        """After this session's first step: the time the step budget will take at that pace, said up front."""
        left = (self.total_steps or 0) - self.progress.step
        if left > 0 and step_s * left > 60:
            self._say(
                f"first step {step_s:.1f} s: about {step_s * left / 60:.0f} min for the {left} steps left"
            )

    def _broadcast_elapsed(self) -> float:
        return dt.broadcast_float(self.elapsed(), self.info, self.device)

    def train_step(self) -> float:
        """One optimizer step over this rank's rows of the global batch; returns its learning rate."""
        tcfg, info, p = self.tcfg, self.info, self.progress
        lr = lr_at(tcfg, p.step, self.shared_elapsed)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        # this rank's rows of the global batch: a contiguous slice, then cut into micro-batches
        mine = self.order.starts(p.step * tcfg.batch_size + info.rank * self.share, self.share)
        micro = self.micro
        step_loss = torch.zeros((), device=self.device)
        for m in range(tcfg.grad_accum):
            xy = torch.from_numpy(
                self.data.train.windows(mine[m * micro : (m + 1) * micro], tcfg.seq_len + 1)
            )
            xy = xy.to(self.device, non_blocking=True)
            sync = m == tcfg.grad_accum - 1 or not info.enabled
            with contextlib.nullcontext() if sync else dt.no_sync(self.net):
                with self.autocast():
                    logits = self.net(xy[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten())
                (loss / tcfg.grad_accum).backward()
            step_loss += loss.detach() / tcfg.grad_accum
        if tcfg.grad_clip > 0:
            if self.sharded:  # the norm of the whole gradient: the ranks' table slices summed
                clip_grad_norm(self.model, tcfg.grad_clip)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), tcfg.grad_clip)
        if self.grad_bytes == 0 or (p.step + 1) % tcfg.log_interval == 0:
            self.grad_bytes = dt.gradient_bytes(self.model)  # the .grad tensors exist until zero_grad
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.append(step_loss)
        p.step += 1
        p.tokens += tcfg.tokens_per_step
        self.run_tokens += tcfg.tokens_per_step
        return lr

    def _bookkeeping(self, lr: float, bar) -> None:
        """After a step: evaluate, log and checkpoint when their intervals (or the budget's end) come."""
        tcfg, step = self.tcfg, self.progress.step
        is_last = self.total_steps is not None and step >= self.total_steps
        is_eval = step % tcfg.eval_interval == 0 or is_last
        is_log = step % tcfg.log_interval == 0 or is_eval
        is_ckpt = self.out_dir is not None and (step % self.ckpt_every == 0 or is_last)
        if self.budget_s:
            self.shared_elapsed = self._broadcast_elapsed()
            if self.shared_elapsed >= self.budget_s:  # the time budget ends the run: evaluate and save now
                is_eval, is_log, is_ckpt = True, True, self.out_dir is not None
        if is_log or is_ckpt:
            self.flush_losses()
            self.clock.stop(step)
        if is_log:
            self._log(lr, is_eval, bar)
        if is_ckpt:
            self._save()
        if is_log or is_ckpt:
            self.clock.restart(step)

    def _save(self) -> None:
        """Checkpoint this step, unless a loss or weight is NaN / infinite (the last good checkpoint stays)."""
        self.finite.weights(self.model, self.info, self.progress.step, self._checkpoint_dir())
        self.last_checkpoint = save_training_checkpoint(self.out_dir, self.model, self.data, self.tcfg,
                                                        self.optimizer, self.progress, self.elapsed(), self.info,
                                                        self.sharded, self.origin)  # fmt: skip
        self.saved_step = self.progress.step

    def _save_and_stop(self) -> None:
        """Ctrl-C: save the current step (if not just saved) and raise TrainingInterrupted."""
        self.flush_losses()
        if self.out_dir is not None and self.saved_step != self.progress.step:
            self._save()
        raise TrainingInterrupted(self.progress.step, self.last_checkpoint)

    def _log(self, lr: float, is_eval: bool, bar) -> None:
        p = self.progress
        self.memory = rank_memory(
            self.model, self.optimizer, self.grad_bytes, self.clock.take_lap(), self.device, self.info
        )
        v = self.evaluate() if is_eval else None
        if v is not None:
            p.val_losses.append((p.step, v))
        now = time.perf_counter()
        tps = (p.tokens - self.mark[1]) / max(now - self.mark[0], 1e-9)
        self.mark = (now, p.tokens)
        rec = record(p.step, p.tokens, p.losses[-1], v, lr, tps, self.elapsed())
        rec.update(self.memory)
        self.metrics.emit(rec)
        postfix = {"loss": f"{p.losses[-1]:.3f}", "tok/s": f"{tps:,.0f}"}
        if self.budget_s:
            postfix["left"] = f"{max(0.0, self.budget_s - self.shared_elapsed):.0f}s"
        bar.set_postfix(postfix, refresh=False)
        if not bar.drawn or v is not None:  # the bar shows the rest
            self._say(log_line(rec, self.total_steps))

    def flush_losses(self) -> None:
        """Reduce the pending step losses over the ranks (the mean) into progress.losses; stop at a NaN / inf."""
        if self.pending:
            t = dt.all_reduce_sum(torch.stack(self.pending).float(), self.info) / self.info.world_size
            self.progress.losses.extend(t.tolist())
            self.pending.clear()
        self.finite.losses(self.progress.losses, self._checkpoint_dir())

    def evaluate(self) -> float | None:
        if not self.val_starts:
            return None
        return validation_loss(
            self.core,
            self.data.val,
            self.val_starts,
            self.tcfg.seq_len,
            self.micro,
            self.device,
            self.autocast,
            self.info,
            lockstep=self.sharded or dt.is_fsdp(self.model),
        )

    def _finish(self) -> TrainResult:
        p, out_dir = self.progress, self.out_dir
        self.flush_losses()
        if self.sharded:  # hand back the whole model (every rank), as a plain DDP run does
            dt.unshard_gate_tables(self.model)
        self.model = dt.unwrap_fsdp(self.model)  # FSDP2: the whole model on every rank
        wall = time.perf_counter() - self.t_start
        result = TrainResult(
            final_val_loss=p.val_losses[-1][1] if p.val_losses and p.val_losses[-1][0] == p.step else None,
            best_val_loss=min((v for _, v in p.val_losses), default=None),
            final_train_loss=p.losses[-1] if p.losses else None,
            losses=p.losses,
            val_losses=p.val_losses,
            steps=p.step,
            tokens=p.tokens,
            tokens_per_s=self.run_tokens / max(wall, 1e-9),
            wall_time_s=wall,
            checkpoint=self.last_checkpoint,
            out_dir=out_dir,
            n_params=self.n_params,
            model_config=self.model_cfg.to_dict(),
            train_config=self.tcfg.to_dict(),
            data_source=self.data.source,
            history=self.metrics.history,
            step_time_ms=self.clock.mean_step_ms(),
            memory=self.memory,
            model=self.model,
        )
        if self.info.is_main and out_dir is not None:
            (out_dir / "result.json").write_text(json_text(result.to_dict(), indent=2))
            title = f"{self.model_cfg.attention} on {self.data.source}"
            write_loss_plot(out_dir / LOSS_PNG, p.losses, p.val_losses, title)  # beside metrics.jsonl
        fv = f"{result.final_val_loss:.4f}" if result.final_val_loss is not None else "n/a"
        self._say(
            f"done: {p.step} steps, {p.tokens:,} tokens, {wall:.1f} s, final val loss {fv}"
            + memory_text(result)
        )
        return result
