"""Joining the process group and the one handle on it: a ``DeviceMesh``.

torchrun describes the launch with RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; ``init_distributed``
joins that group (gloo on CPU, NCCL on CUDA; each rank on cuda:LOCAL_RANK), or reuses a group the caller created
already (tests spawn their own), or answers a world of one when no launcher is involved. The result, a
``ParallelContext``, carries the rank, the world size, the device and a 1-D ``DeviceMesh`` over all ranks
(torch.distributed.device_mesh.init_device_mesh; None in a world of one): DDP, FSDP2, DTensor and the collectives
take their process group from it (``ctx.group``). On CPU a mesh over every rank reuses the default group, so
building it costs no new communicator.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kvlm.config import ConfigError


@dataclass
class ParallelContext:
    """Where this process stands in the launch. ``started_here``: init_distributed created the process group,
    so ``teardown`` destroys it."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: DeviceMesh | None = None
    started_here: bool = False

    @property
    def world_size(self) -> int:
        return self.world

    @property
    def enabled(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group of the mesh (None: the default group, or no group in a world of one)."""
        return self.mesh.get_group() if self.mesh is not None else None


def init_distributed(
    device: str | torch.device | None = None, backend: str | None = None, mesh_dim: str = "world"
) -> ParallelContext:
    """Join the process group torchrun describes, reuse an initialised one, or return a world of one.

    `device`: "cpu", "cuda" (or a device; its type counts) or None (cuda if available). Backend: NCCL when
    CUDA is used, else gloo. `mesh_dim` names the mesh's one dimension (e.g. "tp", "dp")."""
    kind = (
        torch.device(device).type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    started = False
    if not (dist.is_available() and dist.is_initialized()):
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if "RANK" not in os.environ or world <= 1:
            return ParallelContext(device=torch.device(kind))
        if kind == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend or ("nccl" if kind == "cuda" else "gloo"))
        started = True
    dev = torch.device(f"cuda:{local_rank}") if kind == "cuda" else torch.device("cpu")
    world = dist.get_world_size()
    mesh = init_device_mesh(kind, (world,), mesh_dim_names=(mesh_dim,)) if world > 1 else None
    return ParallelContext(dist.get_rank(), world, local_rank, dev, mesh, started)


def teardown(ctx: ParallelContext) -> None:
    """Destroy the process group if init_distributed created it."""
    if ctx.started_here and dist.is_initialized():
        dist.destroy_process_group()


def shutdown() -> None:
    """Destroy the process group, if any (a gloo group left open at exit aborts the process)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def require_world(tp: int, ctx: ParallelContext) -> None:
    """A clear error when --tp N does not match the processes torchrun started."""
    if tp != ctx.world:
        raise ConfigError(
            f"--tp {tp} needs {tp} processes but this run has {ctx.world}: launch with "
            f"`torchrun --nproc-per-node {tp} -m kvlm.cli ...`"
        )


def tp_setup(tp: int, device: str | None = None) -> ParallelContext:
    """For a command's --tp N: join torchrun's group (a clear error when the launch has another number of
    processes) and silence stdout on ranks other than 0, so that the command prints its result once."""
    ctx = init_distributed(None if device in (None, "auto") else device, mesh_dim="tp")
    require_world(tp, ctx)
    atexit.register(shutdown)
    if ctx.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    return ctx
