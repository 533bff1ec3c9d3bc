"""Checkpoints of state that is sharded across ranks.

Two kinds of sharded state, two ways to save it:

- FSDP2 models (kvlm.parallel.data_parallel.wrap_fsdp): ``save_sharded`` / ``load_sharded`` write and read the
  model's and the optimizer's DTensor shards with torch.distributed.checkpoint (every rank writes its own part of
  one folder, in parallel; the folder loads at another number of ranks, DCP reshards). ``full_model_state``
  gathers an ordinary state dict onto rank 0 (CPU) for kvlm's own checkpoint format.
- EG-MLA's embedding-parallel gate tables (kvlm.parallel.embedding_parallel): checkpoints hold whole tables and
  whole optimizer moments, gathered to rank 0 (``full_gate_tables``, ``full_optimizer_state``), so they load
  unsharded and resume at any number of ranks (``shard_optimizer_state`` re-slices the moments);
  ``gather_gate_embeddings`` / ``unshard_gate_tables`` put whole tables back on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from kvlm.attention import GateEmbedding
from kvlm.checkpoint import CheckpointError
from kvlm.parallel.collectives import all_gather_uneven, barrier
from kvlm.parallel.embedding_parallel import ShardedGateEmbedding

# ------------------------------------------------------------------------------------------------
# FSDP2 (DTensor) state: torch.distributed.checkpoint
# ------------------------------------------------------------------------------------------------


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> Path:
    """Write the model's (and the optimizer's) sharded state to the folder `path` with
    torch.distributed.checkpoint; a collective every rank enters. Atomic: the ranks write into a temporary
    folder that rank 0 renames once all have finished, so a crash leaves the previous checkpoint intact."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if _is_rank0() and tmp.exists():
        shutil.rmtree(tmp)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    dcp.save(state, checkpoint_id=str(tmp))
    barrier()
    if _is_rank0():
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        if old.exists():
            shutil.rmtree(old)
    barrier()
    return path


def load_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> None:
    """Load a folder written by ``save_sharded`` into the (FSDP2-wrapped) model and optimizer, in place; each
    rank reads the parts its shards need (the folder may come from another number of ranks)."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"{path} is not a sharded checkpoint (no .metadata from torch.distributed.checkpoint)"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [])
    state = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    with warnings.catch_warnings():  # one process reading a folder that several wrote is intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
    )


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict of an FSDP2 model on rank 0, on the CPU ({} on other ranks); a
    collective. For an ordinary kvlm checkpoint of a model trained with FSDP2."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def _param_index(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """{parameter name: its index in optimizer.state_dict()} (indices run over the param groups in order)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {names[id(p)]: i for i, p in enumerate(params)}


def fsdp_full_optimizer_state(model: torch.nn.Module, optimizer) -> dict | None:
    """The optimizer state of an FSDP2 model gathered whole on rank 0 (CPU) in the layout of an unsharded
    ``optimizer.state_dict()`` (integer parameter indices), so the checkpoint is the one DDP or one process
    writes; None on other ranks. A collective."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not _is_rank0():
        return None
    index = _param_index(model, optimizer)
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return {"state": {index[n]: st for n, st in sd["state"].items()}, "param_groups": groups}


def fsdp_load_full_optimizer_state(model: torch.nn.Module, optimizer, sd: dict) -> None:
    """The inverse of fsdp_full_optimizer_state on every rank (each holds the whole state, e.g. read from a
    checkpoint): each rank keeps its shards."""
    name = {i: n for n, i in _param_index(model, optimizer).items()}
    full = {
        "state": {name[int(i)]: st for i, st in sd["state"].items()},
        "param_groups": [{**g, "params": [name[int(i)] for i in g["params"]]} for g in sd["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(model: torch.nn.Module, like: torch.nn.Module) -> torch.nn.Module:
    """`like` (an unsharded module of the same structure) loaded with the FSDP2 model's whole weights; a
    collective every rank enters, and every rank gets the whole model."""
    like.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    return like


# ------------------------------------------------------------------------------------------------
# EG-MLA embedding parallelism in training: whole tables and whole optimizer moments in checkpoints
# ------------------------------------------------------------------------------------------------
def _sharded_children(model: torch.nn.Module) -> list:
    """(parent, attribute, ShardedGateEmbedding) for every sharded table slot (shared tables repeat)."""
    return [
        (parent, attr, child)
        for parent in model.modules()
        for attr, child in parent.named_children()
        if isinstance(child, ShardedGateEmbedding)
    ]


def _gather_columns(mod: ShardedGateEmbedding, t: torch.Tensor, dst: int | None) -> torch.Tensor | None:
    """Concatenate every rank's column slice `t` (rows, width_r) of table `mod`: on rank `dst` only
    (None elsewhere), or on every rank (dst=None)."""
    return all_gather_uneven(t, 1, mod.exchange.group, sizes=mod.widths, dst=dst)[0]


def _full_embedding(table: torch.Tensor) -> GateEmbedding:
    emb = GateEmbedding(*table.shape, _weight=table)  # wraps the gathered tensor: no second copy
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
    gather_gate_embeddings this copies nothing but the tables, and only on `dst`: a save
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


def gather_gate_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the model with every sharded gate table gathered back into one nn.Embedding (a collective:
    every rank calls it; each gets the full model), e.g. for rank 0 to save an ordinary checkpoint."""
    full = copy.deepcopy(model)
    _swap_in_full_tables(full, None)
    return full
