"""The device a run trains on and its precision (float32 on CPU, bfloat16 autocast on CUDA by default)."""

from __future__ import annotations

import contextlib

import torch

from kvlm.config import ConfigError
from kvlm.training.config import TrainConfig


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
