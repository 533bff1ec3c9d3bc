"""Checkpoints: a folder that is complete or absent, never half-written.

Layout of a checkpoint folder:
    config.json          ModelConfig fields
    model.safetensors    weights (tied weights stored once)
    tokenizer.json       the tokenizers-library tokenizer the model was trained with (optional)
    meta.json            {"format": "kvlm-checkpoint", "version": 1, ...caller's metadata}
    trainer_state.pt     optimizer / scheduler / data position / RNG states (training checkpoints only)

Writes go to a temporary sibling folder which is swapped into place at the end (kvlm.files.replace_folder), so a
crash at any instant leaves the previous checkpoint or the new one; ``load_checkpoint`` puts one back if a crash
cut the swap between its renames, and the next save deletes what crashed saves left behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from kvlm.config import ModelConfig
from kvlm.files import clean_leftovers, recover_folder, replace_folder, temp_folder

FORMAT = "kvlm-checkpoint"
# what save_checkpoint writes: a folder holding only these is a checkpoint kvlm may replace
FILES = ("config.json", "model.safetensors", "tokenizer.json", "meta.json", "trainer_state.pt")


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, partial or corrupt."""


def save_checkpoint(
    path: str | Path,
    model,
    tokenizer=None,
    meta: dict[str, Any] | None = None,
    trainer_state: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a KVLM) to the checkpoint folder ``path`` atomically (see the module docstring): the
    previous checkpoint there, or the new one, never a mix. ``tokenizer``: a kvlm Tokenizer (or a tokenizers
    Tokenizer) saved as tokenizer.json; ``meta``: JSON-able fields added to meta.json; ``trainer_state``: what
    kvlm.training saves to resume (trainer_state.pt). Returns ``path``; load it back with ``load_checkpoint``."""
    from safetensors.torch import save_model

    path = Path(path)
    clean_leftovers(path)  # first: a crashed save's copy may be the only complete one
    tmp = temp_folder(path)
    try:
        (tmp / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2))
        save_model(model, str(tmp / "model.safetensors"))
        if tokenizer is not None:
            _tokenizer_obj(tokenizer).save(str(tmp / "tokenizer.json"))
        if trainer_state is not None:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, "version": 1, **(meta or {})}, indent=2))
        replace_folder(tmp, path)  # fsyncs, applies the umask, swaps
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
    recover_folder(path)  # a save cut by a crash between its renames: put its complete copy back
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


def foreign_files(folder: Path, training: bool = True) -> list[str]:
    """What in ``folder`` is not part of a kvlm checkpoint (``training=False``: nor of a training run's, i.e.
    trainer_state.pt counts as foreign). Empty: the folder is a checkpoint kvlm wrote and may replace."""
    names = sorted(p.name for p in Path(folder).iterdir())
    own = set(FILES) - (set() if training else {"trainer_state.pt"})
    out = [n + ("/" if (Path(folder) / n).is_dir() else "") for n in names if n not in own]
    if not out and "meta.json" in names:
        try:
            fmt = json.loads((Path(folder) / "meta.json").read_text()).get("format")
        except (json.JSONDecodeError, OSError, AttributeError):
            fmt = None
        if fmt != FORMAT:
            out.append("meta.json (not a kvlm checkpoint's)")
    elif not out:
        out.append("(no meta.json: not a kvlm checkpoint)")
    return out
