"""Data-parallel training helpers (torch.distributed DDP): gloo on CPU, NCCL on CUDA.

`torchrun --nproc_per_node N -m kvlm.cli train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; `setup()` joins
the group. A process group the caller created already (tests spawn their own) is used as it is.
Each rank reads a disjoint slice of every global batch; rank 0 writes metrics and checkpoints.
(Tensor-parallel decode lives in kvlm/distributed.py.)

Also here: the per-rank memory / time figures of the metrics records, and what training with EG-MLA's
dimension-wise embedding parallelism (eg-mla.md Eqs. 9-11; TrainConfig.embedding_parallel) needs around
kvlm.parallel.tensor_parallel's sharded gate tables: whole tables and whole optimizer moments in checkpoints (gathered
to rank 0), re-sliced on resume.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any

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


def wrap_for(model: torch.nn.Module, info: DistInfo, device: torch.device, sharded: bool) -> torch.nn.Module:
    """DDP over the model, or (embedding parallelism) over its replicated parameters only."""
    if not (info.enabled and sharded):
        return wrap(model, info, device)
    from kvlm.parallel.tensor_parallel import wrap_ddp

    return wrap_ddp(model, device)


# ------------------------------------------------------------------------------------------------
# Per-rank memory and time (metrics records)
# ------------------------------------------------------------------------------------------------
def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, kind): the CUDA allocator's peak on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"  # Linux: KiB


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def parameter_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes(model.parameters())


def gradient_bytes(model: torch.nn.Module) -> int:
    return tensor_bytes(p.grad for p in model.parameters())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def gather_rows(values: list[float], info: DistInfo, device) -> list[list[float]]:
    """Every rank's `values` (one row per rank, in rank order), on every rank: one all-reduce."""
    t = torch.zeros(info.world_size, len(values), dtype=torch.float64, device=device)
    t[info.rank] = torch.tensor(values, dtype=torch.float64)
    return all_reduce_sum(t, info).tolist()


# ------------------------------------------------------------------------------------------------
# EG-MLA embedding parallelism (kvlm.parallel.tensor_parallel.shard_gate_embeddings) in training: checkpoints hold
# whole tables and whole optimizer moments, so they load unsharded and resume at any number of ranks
# ------------------------------------------------------------------------------------------------
def _sharded_children(model: torch.nn.Module) -> list:
    """(parent, attribute, ShardedGateEmbedding) for every sharded table slot (shared tables repeat)."""
    from kvlm.parallel.tensor_parallel import ShardedGateEmbedding

    return [
        (parent, attr, child)
        for parent in model.modules()
        for attr, child in parent.named_children()
        if isinstance(child, ShardedGateEmbedding)
    ]


def _widths(mod) -> list[int]:
    return [mod.bounds[r + 1] - mod.bounds[r] for r in range(mod.world)]


def _gather_columns(mod, t: torch.Tensor, dst: int | None) -> torch.Tensor | None:
    """Concatenate every rank's column slice `t` (rows, width_r) of table `mod`: on rank `dst` only
    (dist.gather; None elsewhere), or on every rank (dst=None). Slices are padded to the widest."""
    widths = _widths(mod)
    padded = t.new_zeros(t.shape[0], max(widths))
    padded[:, : t.shape[1]] = t
    group = mod.exchange.group
    if dst is None:
        parts = [torch.empty_like(padded) for _ in widths]
        dist.all_gather(parts, padded, group=group)
    else:
        parts = [torch.empty_like(padded) for _ in widths] if mod.rank == dst else None
        dist.gather(padded, parts, dst=dst, group=group)
        if parts is None:
            return None
    return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)


def _full_embedding(table: torch.Tensor) -> torch.nn.Embedding:
    emb = torch.nn.Embedding(*table.shape, _weight=table)  # wraps the gathered tensor: no second copy
    emb.weight.is_gate_embedding = True
    return emb


def _swap_in_full_tables(model: torch.nn.Module, dst: int | None) -> list:
    """Gather each sharded table (a collective) and put the whole nn.Embedding in its place, on `dst`
    (or every rank); returns the (parent, attribute, sharded module) swaps made here, to undo them."""
    full: dict[int, torch.nn.Embedding | None] = {}
    swaps = []
    for parent, attr, child in _sharded_children(model):
        if id(child) not in full:  # a table shared by a layer group: gathered once, still shared
            table = _gather_columns(child, child.weight.detach(), dst)
            full[id(child)] = None if table is None else _full_embedding(table)
        if full[id(child)] is not None:
            setattr(parent, attr, full[id(child)])
            swaps.append((parent, attr, child))
    return swaps


@contextlib.contextmanager
def full_gate_tables(model: torch.nn.Module, dst: int = 0):
    """Within the block, rank `dst`'s model holds whole gate tables (gathered from every rank's slices, a
    collective every rank enters), so it saves as an ordinary checkpoint; the other ranks only send. Unlike
    kvlm.parallel.tensor_parallel.gather_gate_embeddings this copies nothing but the tables, and only on `dst`: a save
    does not raise the other ranks' peak memory, which the metrics report."""
    swaps = _swap_in_full_tables(model, dst)
    try:
        yield model
    finally:
        for parent, attr, child in swaps:
            setattr(parent, attr, child)


def unshard_gate_tables(model: torch.nn.Module) -> torch.nn.Module:
    """Put whole tables back into the model on every rank, for good (the end of training)."""
    _swap_in_full_tables(model, None)
    return model


def _sharded_state_index(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[int, Any]:
    """{index of the parameter in optimizer.state_dict(): its ShardedGateEmbedding}."""
    owner = {id(child.weight): child for _, _, child in _sharded_children(model)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: owner[id(p)] for i, p in enumerate(params) if id(p) in owner}


def full_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module, dst: int = 0):
    """optimizer.state_dict() with each sharded table's per-element state (AdamW's two moments) gathered
    into whole-table tensors on rank `dst`: the state an unsharded run would hold (None elsewhere).
    A collective: every rank calls it."""
    sd = optimizer.state_dict()
    for i, mod in _sharded_state_index(optimizer, model).items():
        st = sd["state"].get(i)
        if st is None:  # no step taken yet: the same on every rank
            continue
        new = {}  # a new dict: state_dict() shares the live state's tensors
        for k, v in st.items():
            if torch.is_tensor(v) and v.shape == mod.weight.shape:
                v = _gather_columns(mod, v, dst)
            new[k] = v
        sd["state"][i] = new
    return sd if dist.get_rank() == dst else None


def shard_optimizer_state(sd: dict, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """The inverse of full_optimizer_state for this rank: whole-table state -> this rank's columns."""
    from kvlm.checkpoint import CheckpointError

    sd = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
    for i, mod in _sharded_state_index(optimizer, model).items():
        st = sd["state"].get(i)
        if st is None:
            continue
        lo, hi = mod.bounds[mod.rank], mod.bounds[mod.rank + 1]
        new = {}
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 2:
                if tuple(v.shape) != (mod.num_embeddings, mod.embedding_dim):
                    raise CheckpointError(
                        f"optimizer state {k} of gate table {i} has shape {tuple(v.shape)}, expected the whole "
                        f"table ({mod.num_embeddings}, {mod.embedding_dim})"
                    )
                v = v[:, lo:hi].clone()
            new[k] = v
        sd["state"][i] = new
    return sd
