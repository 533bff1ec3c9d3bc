"""Data-parallel training: DDP or FSDP2 around the model, and the per-rank helpers the training loop calls.

`torchrun --nproc_per_node N -m kvlm.cli train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; ``setup`` joins the group
(kvlm.parallel.mesh.init_distributed; a group the caller created already is used as it is) and returns a
``DistInfo`` (kvlm.parallel.mesh.ParallelContext) with the mesh. Each rank reads a disjoint slice of every global
batch; rank 0 writes metrics and checkpoints.

- ``wrap``: DistributedDataParallel (every rank holds the whole model and optimizer; gradients all-reduced).
- ``wrap_fsdp``: FSDP2 (torch.distributed.fsdp.fully_shard on the mesh): every transformer block and then the
  root are sharded, so each rank holds 1/N of the parameters, gradients and optimizer state, gathered layer by
  layer for compute. Its checkpoints: kvlm.parallel.sharded_state (torch.distributed.checkpoint).
- ``wrap_ddp``: DDP over the replicated parameters only, for EG-MLA's embedding parallelism (sharded gate tables
  left out); ``wrap_for`` picks.
- per-rank memory and time figures of the metrics records (``peak_memory``, ``parameter_bytes``, ...,
  ``gather_rows``), and the small collectives of the loop taking a ``DistInfo``.
- EG-MLA embedding parallelism's whole-table checkpoint helpers are re-exported from kvlm.parallel.sharded_state
  for the training loop (``full_gate_tables``, ``full_optimizer_state``, ``shard_optimizer_state``,
  ``unshard_gate_tables``).
"""

from __future__ import annotations

import contextlib
import resource

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

import kvlm.parallel.collectives as collectives
from kvlm.model import build_model
from kvlm.parallel.embedding_parallel import sharded_parameter_names
from kvlm.parallel.mesh import ParallelContext, init_distributed, teardown
from kvlm.parallel.sharded_state import (
    fsdp_full_optimizer_state,
    fsdp_load_full_optimizer_state,
    full_gate_tables,
    full_model_state,
    full_optimizer_state,
    shard_optimizer_state,
    unshard_gate_tables,
    unsharded_copy,
)

DistInfo = ParallelContext  # the training loop's name for where this process stands

__all__ = [
    "DistInfo",
    "all_reduce_sum",
    "barrier",
    "broadcast_float",
    "checkpoint_view",
    "fsdp_load_full_optimizer_state",
    "full_gate_tables",
    "full_optimizer_state",
    "gather_objects",
    "gather_rows",
    "gradient_bytes",
    "is_fsdp",
    "optimizer_bytes",
    "parameter_bytes",
    "peak_memory",
    "setup",
    "shard_optimizer_state",
    "teardown",
    "tensor_bytes",
    "unshard_gate_tables",
    "unwrap_fsdp",
    "wrap",
    "wrap_ddp",
    "wrap_for",
    "wrap_fsdp",
]


def setup(device_type: str) -> DistInfo:
    """Join (or reuse) the process group when more than one process runs; a 1-D "dp" mesh over the ranks."""
    return init_distributed(device_type, mesh_dim="dp")


# ------------------------------------------------------------------------------------------------
# Wrapping the model
# ------------------------------------------------------------------------------------------------


def _ddp_class():
    # imported on first use: DistributedDataParallel pulls in torch._dynamo (seconds), which a single process
    # never needs
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def wrap(model: nn.Module, info: DistInfo, device: torch.device) -> nn.Module:
    """DDP over the model (the model itself in a world of one)."""
    if not info.enabled:
        return model
    return _ddp_class()(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=info.group
    )


def wrap_ddp(model: nn.Module, device: torch.device | None = None, **kw) -> nn.Module:
    """DistributedDataParallel over the replicated parameters only; sharded gate tables are left out."""
    ddp = _ddp_class()
    ignore = sharded_parameter_names(model)
    if ignore:
        ddp._set_params_and_buffers_to_ignore_for_model(model, ignore)
    if device is not None and device.type == "cuda":
        kw.setdefault("device_ids", [device.index])
    return ddp(model, **kw)


def wrap_fsdp(model: nn.Module, info: DistInfo, reshard_after_forward: bool = True) -> nn.Module:
    """FSDP2: ``fully_shard`` each transformer block, then the whole model (embedding, final norm, LM head),
    on the context's mesh. The model object itself becomes the sharded module (its parameters DTensors, so
    build the optimizer after this); returned for symmetry with ``wrap``. In a world of one, or when the model
    is sharded already, the model is returned unchanged."""
    if not info.enabled or isinstance(model, FSDPModule):
        return model
    if sharded_parameter_names(model):
        raise ValueError("FSDP2 does not combine with embedding parallelism's sharded gate tables")
    for block in model.layers:
        fully_shard(block, mesh=info.mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=info.mesh, reshard_after_forward=reshard_after_forward)
    return model


def wrap_for(
    model: nn.Module, info: DistInfo, device: torch.device, sharded: bool, fsdp: bool = False
) -> nn.Module:
    """FSDP2 (fsdp=True), DDP over the model, or (embedding parallelism, sharded=True) DDP over its
    replicated parameters only."""
    if fsdp or isinstance(model, FSDPModule):
        return wrap_fsdp(model, info)
    if not (info.enabled and sharded):
        return wrap(model, info, device)
    return wrap_ddp(model, device)


def is_fsdp(model: nn.Module) -> bool:
    """True when ``wrap_fsdp`` sharded the model (its parameters are DTensors)."""
    return isinstance(model, FSDPModule)


def unwrap_fsdp(model: nn.Module) -> nn.Module:
    """A plain model with the FSDP2 model's whole weights, on every rank (a collective); the model itself when
    it is not sharded. For handing a trained model back."""
    if not is_fsdp(model):
        return model
    device = next(p.to_local().device for p in model.parameters())
    return unsharded_copy(model, build_model(model.cfg, device=device))


@contextlib.contextmanager
def checkpoint_view(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: bool = False):
    """Yields (model, optimizer state) as an unsharded run holds them, for an ordinary checkpoint that loads at
    any number of ranks: whole weights and whole AdamW moments on rank 0 (collectives: every rank enters; other
    ranks get (None, None) for FSDP2, their own model and None with sharded gate tables)."""
    if is_fsdp(model):
        opt_state = fsdp_full_optimizer_state(model, optimizer)
        whole = full_model_state(model)  # rank 0 only, on the CPU
        plain = None
        if opt_state is not None:
            plain = build_model(model.cfg)
            plain.load_state_dict(whole)
        yield plain, opt_state
    elif sharded:
        opt_state = full_optimizer_state(optimizer, model)
        with full_gate_tables(model):
            yield model, opt_state
    else:
        yield model, optimizer.state_dict()


@contextlib.contextmanager
def no_sync(net: nn.Module):
    """Within the block, backward accumulates gradients without communicating (the first micro-steps of a
    gradient-accumulation step): DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``."""
    if isinstance(net, FSDPModule):
        net.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            net.set_requires_gradient_sync(True)
    elif isinstance(net, _ddp_class()):
        with net.no_sync():
            yield
    else:
        yield


# ------------------------------------------------------------------------------------------------
# The small collectives of the training loop
# ------------------------------------------------------------------------------------------------


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum `t` over the ranks in place (no autograd; see kvlm.parallel.collectives.all_reduce_sum)."""
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=info.group)
    return t


def broadcast_float(value: float, info: DistInfo, device) -> float:
    """Rank 0's value for everyone (its clock, for a time budget: all ranks stop at the same step)."""
    return collectives.broadcast_float(value, device, info.group) if info.enabled else value


def gather_objects(obj, info: DistInfo) -> list:
    return collectives.gather_objects(obj, info.group) if info.enabled else [obj]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        collectives.barrier(info.group)


# ------------------------------------------------------------------------------------------------
# Per-rank memory and time (metrics records)
# ------------------------------------------------------------------------------------------------


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the CUDA allocator's peak on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"  # Linux: KiB


def tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors (a DTensor counts its local shard: what this rank holds)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            local = t.to_local() if isinstance(t, DTensor) else t
            total += local.numel() * local.element_size()
    return total


def parameter_bytes(model: nn.Module) -> int:
    return tensor_bytes(model.parameters())


def gradient_bytes(model: nn.Module) -> int:
    return tensor_bytes(p.grad for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def gather_rows(values: list[float], info: DistInfo, device) -> list[list[float]]:
    """Every rank's `values` (one row per rank, in rank order), on every rank: one all-reduce."""
    t = torch.zeros(info.world_size, len(values), dtype=torch.float64, device=device)
    t[info.rank] = torch.tensor(values, dtype=torch.float64)
    return all_reduce_sum(t, info).tolist()
