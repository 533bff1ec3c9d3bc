"""Checkpoints: a folder that is complete or absent, never half-written.

Layout of a checkpoint folder:
    config.json          ModelConfig fields
    model.safetensors    weights (tied weights stored once)
    tokenizer.json       the tokenizers-library tokenizer the model was trained with (optional)
    meta.json            {"format": "kvlm-checkpoint", "version": 1, ...caller's metadata}
    trainer_state.pt     optimizer / scheduler / data position / RNG states (training checkpoints only)

Writes go to a temporary sibling folder which is renamed into place at the end, so a crash leaves either
the previous checkpoint or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ModelConfig
from kvlm.files import replace_folder

FORMAT = "kvlm-checkpoint"


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, partial or corrupt."""


def save_checkpoint(
    path: str | Path,
    model,
    tokenizer=None,
    meta: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    from safetensors.torch import save_model

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
        save_model(model, str(tmp / "model.safetensors"))
        if tokenizer is not None:
            _tokenizer_obj(tokenizer).save(str(tmp / "tokenizer.json"))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "version": 1, **(meta or {})}, indent=2))
        _fsync_dir(tmp)
        replace_folder(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """-> (model, tokenizer or None, meta dict). Raises CheckpointError naming what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    from kvlm.model import build_model

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint folder at {path}")
    for name in ("config.json", "model.safetensors", "meta.json"):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        meta = json.loads((path / "meta.json").read_text())
        cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: {e}") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kvlm checkpoint (meta.json format={meta.get('format')!r})")
    model = build_model(cfg)
    try:
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except (SafetensorError, OSError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot read model.safetensors: {e}") from e
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path}: weights do not fit the config (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    model = model.to(device)
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from kvlm.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path / "tokenizer.json")
    return model.eval(), tokenizer, meta


def _tokenizer_obj(tokenizer):
    # accept kvlm.data.tokenizer.Tokenizer wrappers or a raw tokenizers.Tokenizer
    return getattr(tokenizer, "backend", tokenizer)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
