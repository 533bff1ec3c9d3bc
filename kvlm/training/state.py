"""What a run keeps between sessions: its progress counters, checkpoints with trainer state, RNG states, and the
run folder's config.yaml and metrics.jsonl.

A checkpoint (kvlm.checkpoint format) holds trainer_state.pt: step, tokens, elapsed seconds, the AdamW state,
every rank's RNG states (torch, CUDA, numpy, random), the losses so far and the TrainConfig. Restoring all of
them, with the data order a pure function of (seed, step), makes a resumed run reproduce the uninterrupted one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from kvlm.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from kvlm.config import ConfigError, ModelConfig
from kvlm.data import PreparedData
from kvlm.files import recover_folder
from kvlm.parallel import data_parallel as dt
from kvlm.training.config import DATA_ORDER_FIELDS, TrainConfig

CHECKPOINT_DIR = "checkpoint"


@dataclass
class RunProgress:
    """The counters a run carries across a resume: optimizer steps, training tokens, seconds of training
    before this session started (from the checkpoint), and the loss history (every step's training loss, all
    ranks' mean; (step, validation loss))."""

    step: int = 0
    tokens: int = 0
    elapsed_before: float = 0.0
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunProgress:
        return cls(
            state["step"],
            state["tokens"],
            state["elapsed"],
            list(state["losses"]),
            [tuple(v) for v in state["val_losses"]],
        )


def rng_state() -> dict[str, Any]:
    """This process's torch, CUDA, numpy and random generator states, in a form torch.load(weights_only) reads."""
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        # plain lists so the file loads with torch.load(weights_only=True)
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": _to_lists(random.getstate()),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
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


def load_for_resume(
    path: Path, model_cfg: ModelConfig | None, tcfg: TrainConfig, data: PreparedData
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """(model, trainer state) from a checkpoint folder, after checking that resuming it with ``tcfg`` on ``data``
    continues the same run: same tokenizer, same model config (if given), same data order."""
    recover_folder(path)  # a save cut by a crash between its renames: put its complete copy back
    if not path.is_dir():
        raise CheckpointError(f"nothing to resume: no checkpoint folder at {path}")
    if not (path / "trainer_state.pt").is_file():
        raise CheckpointError(f"checkpoint {path} cannot be resumed: trainer_state.pt is missing")
    model, tokenizer, meta = load_checkpoint(path)
    try:
        state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, unpickling errors: torch raises several kinds
        raise CheckpointError(f"checkpoint {path}: cannot read trainer_state.pt: {e}") from e
    # without tokenizer.json, the sha256 that meta.json recorded of the data's tokenizer; with neither, refuse
    # rather than skip the check (a resume on other token ids trains silently on garbage)
    recorded = (((meta.get("data") or {}).get("tokenizer") or {}).get("sha256") if tokenizer is None
                else tokenizer.sha256())  # fmt: skip
    if recorded is None:
        raise CheckpointError(
            f"checkpoint {path} has no tokenizer.json (and meta.json records no tokenizer): cannot check that "
            f"{data.path} uses the tokenizer it was trained with; copy the run's tokenizer.json into the checkpoint"
        )
    if recorded != data.tokenizer.sha256():
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
    # the trainable set fixes the optimizer's parameter list: another one cannot load its AdamW state
    diff = [k for k in ("train_only", "freeze") if saved.get(k) != getattr(tcfg, k)]
    if diff:
        raise ConfigError(
            "resume: "
            + ", ".join(f"{k}={getattr(tcfg, k)!r} (checkpoint: {saved.get(k)!r})" for k in diff)
            + " would change which parameters train; pass the checkpoint's"
        )
    diff = [k for k in DATA_ORDER_FIELDS if saved.get(k) != getattr(tcfg, k)]
    if diff:
        raise ConfigError(
            "resume: "
            + ", ".join(f"{k}={getattr(tcfg, k)} (checkpoint: {saved.get(k)})" for k in diff)
            + " would change the data order"
        )
    state["path"] = str(path)
    return model, state


def save_training_checkpoint(
    out_dir: Path,
    model: torch.nn.Module,
    data: PreparedData,
    tcfg: TrainConfig,
    optimizer: torch.optim.Optimizer,
    progress: RunProgress,
    elapsed: float,
    info: dt.DistInfo,
    sharded: bool = False,
    origin: dict[str, Any] | None = None,
) -> Path:
    """Write out_dir/checkpoint (weights, tokenizer, trainer_state.pt) atomically, ``elapsed`` seconds of
    training in; every rank calls it (the RNG states and sharded tables are gathered)."""
    rngs = dt.gather_objects(rng_state(), info)  # every rank's generators, for an exact resume
    path = out_dir / CHECKPOINT_DIR
    # sharded gate tables or FSDP2: whole weights and AdamW moments on rank 0 (collectives: every rank takes
    # part), so the checkpoint is the one an unsharded run writes
    with dt.checkpoint_view(model, optimizer, sharded) as (model, opt_state):
        if info.is_main:
            state = {
                "step": progress.step,
                "tokens": progress.tokens,
                "elapsed": elapsed,
                "optimizer": opt_state,
                "schedule": {"total_steps": tcfg.total_steps(), "warmup_steps": tcfg.warmup()},
                "data": {"samples_seen": progress.step * tcfg.batch_size, "content_hash": data.content_hash},
                "rng": rngs,
                "losses": list(progress.losses),
                "val_losses": [list(v) for v in progress.val_losses],
                "world_size": info.world_size,
                "train_config": tcfg.to_dict(),
                "origin": origin,  # a fine-tune's starting weights (kvlm.training.start), for config.yaml
            }
            meta = {
                "step": progress.step,
                "tokens": progress.tokens,
                "val_loss": progress.val_losses[-1][1] if progress.val_losses else None,
                "train_config": tcfg.to_dict(),
                "data": data.summary(),
                **({"init": {k: v for k, v in origin.items() if k != "hf_tokenizer"}} if origin else {}),
                # the init's tokenizer settings (stop tokens, chat template) stay with the fine-tuned weights
                **({"hf_tokenizer": origin["hf_tokenizer"]} if origin and origin.get("hf_tokenizer") else {}),
            }
            save_checkpoint(path, model, tokenizer=data.tokenizer, meta=meta, trainer_state=state)
    dt.barrier(info)
    return path


def write_config(
    out_dir: Path,
    cfg: ModelConfig,
    tcfg: TrainConfig,
    data: PreparedData,
    world: int,
    origin: dict[str, Any] | None = None,
) -> None:
    """config.yaml of the run folder: model, train and data sections, the number of ranks and, for a fine-tune,
    ``init``: where its weights came from (path, kind, the init checkpoint's step and tokens)."""
    doc = {"model": cfg.to_dict(), "train": tcfg.to_dict(), "data": data.summary(), "world_size": world}
    if origin:
        doc["init"] = {k: v for k, v in origin.items() if k != "hf_tokenizer"}  # that one goes to meta.json
    (out_dir / "config.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
