"""Data-parallel training helpers (torch.distributed DDP): gloo on CPU, NCCL on CUDA.

`torchrun --nproc_per_node N -m kvlm.cli train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; `setup()` joins
the group. A process group the caller created already (tests spawn their own) is used as it is.
Each rank reads a disjoint slice of every global batch; rank 0 writes metrics and checkpoints.
(Tensor-parallel decode lives in kvlm/distributed.py.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    started_here: bool = False  # we created the process group, so we destroy it at the end

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device_type: str) -> DistInfo:
    """Join (or reuse) the process group when more than one process runs."""
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, started_here=True)


def teardown(info: DistInfo) -> None:
    if info.started_here and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_float(value: float, info: DistInfo, device) -> float:
    """Rank 0's value for everyone (its clock, for a time budget: all ranks stop at the same step)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def gather_objects(obj, info: DistInfo) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def wrap(model: torch.nn.Module, info: DistInfo, device: torch.device) -> torch.nn.Module:
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
