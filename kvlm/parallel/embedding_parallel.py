"""EG-MLA embedding parallelism (eg-mla.md "Embedding Parallelism", Eqs. 9-11, Table 6).

``shard_gate_embeddings(model, rank, world)`` keeps on each data-parallel rank only a column slice (d_kv / W dims,
Eq. 9) of every layer's gating embedding table (``ShardedGateEmbedding``). The ranks hold different batches (DDP),
so a rank needs every rank's slice of its own tokens: the token ids are all-gathered once per model call
(``GateExchange``), each rank looks up its slice for all of them (Eq. 10) and one uneven all-to-all gives every
rank the concatenated embedding of its own tokens (the part of the paper's all-gather that each rank actually
needs). W^UE (Eq. 11) and the rest of the model stay replicated under DDP; ``wrap_ddp``
(kvlm.parallel.data_parallel) keeps DDP off the sharded tables (``sharded_parameter_names``), ``clip_grad_norm``
clips by the whole gradient's norm. Whole tables for checkpoints: kvlm.parallel.sharded_state.
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch
import torch.distributed as dist
from torch import nn

from kvlm.attention import GateEmbedding
from kvlm.config import ConfigError
from kvlm.parallel.collectives import all_gather_uneven, all_to_all_uneven


class GateExchange:
    """What the sharded gate tables of one model share: the process group, the token ids of the current call
    gathered from every rank (all layers look up the same ids, so they are gathered once per model call; the
    model's forward pre-hook calls ``new_call``) and the time spent communicating (``timing = True``;
    synchronises CUDA around each collective)."""

    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.timing = False
        self.comm_seconds = 0.0
        self._gathered: tuple | None = None  # (ids of this call, counts, every rank's ids)

    def new_call(self, *_) -> None:
        """Forget the ids gathered for the previous model call."""
        self._gathered = None

    @contextlib.contextmanager
    def timed(self, device: torch.device):
        if not self.timing:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.comm_seconds += time.perf_counter() - t0

    def gather_ids(self, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """(number of ids per rank, every rank's ids concatenated in rank order)."""
        if self._gathered is not None and self._gathered[0] is ids:
            return self._gathered[1], self._gathered[2]
        with self.timed(ids.device):
            every, counts = all_gather_uneven(ids.reshape(-1), 0, self.group)
        self._gathered = (ids, counts, every)
        return counts, every


class ShardedGateEmbedding(nn.Module):
    """Columns [lo, hi) of a gating embedding table (Eq. 9: d_local = d_kv / W) on this rank.

    forward(ids) returns the full-width embedding of this rank's own ids: token ids are all-gathered, each
    rank looks up its column slice for every rank's ids (Eq. 10) and one all-to-all hands each rank the
    slices of its tokens, concatenated in rank order. Backward sends the gradient slices back the same way,
    so the table's gradient is the sum over every rank's tokens; with average_grads it is divided by the
    world size, the mean that DDP applies to the replicated parameters."""

    def __init__(self, table: torch.Tensor, bounds: list[int], exchange: GateExchange, average_grads=True):
        super().__init__()
        self.bounds = bounds  # column boundaries of the ranks: rank r holds [bounds[r], bounds[r+1])
        self.exchange = exchange
        self.rank, self.world = exchange.rank, exchange.world
        self.num_embeddings = table.shape[0]
        self.embedding_dim = bounds[-1]
        self.weight = nn.Parameter(table[:, bounds[self.rank] : bounds[self.rank + 1]].detach().clone())
        if average_grads and self.world > 1:
            self.weight.register_hook(lambda g: g / self.world)

    @property
    def widths(self) -> list[int]:
        """Columns each rank holds."""
        return [self.bounds[r + 1] - self.bounds[r] for r in range(self.world)]

    def extra_repr(self) -> str:
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return f"{self.num_embeddings}, columns [{lo}, {hi}) of {self.embedding_dim}, rank {self.rank}/{self.world}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        counts, every = self.exchange.gather_ids(ids)
        n = ids.numel()
        mine = nn.functional.embedding(every, self.weight)  # (sum counts, d_local), Eq. 10
        widths = self.widths
        in_splits = [c * widths[self.rank] for c in counts]  # to rank j: my columns of j's tokens
        out_splits = [n * w for w in widths]  # from rank s: s's columns of my tokens
        ex = self.exchange
        recv = all_to_all_uneven(mine.reshape(-1), out_splits, in_splits, ex.group, ex.timed)
        parts = [p.view(n, w) for p, w in zip(recv.split(out_splits), widths)]
        return torch.cat(parts, dim=-1).view(*ids.shape, self.embedding_dim)  # Eq. 11's concatenation


def _gate_tables(model: nn.Module) -> list[tuple[nn.Module, str, nn.Embedding]]:
    """(parent, attribute, table) for every gating embedding table (kvlm.attention.GateEmbedding)."""
    out = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, GateEmbedding):
                out.append((parent, attr, child))
    return out


def shard_gate_embeddings(
    model: nn.Module, rank: int, world: int, group=None, average_grads: bool = True, inplace: bool = True
) -> nn.Module:
    """Replace every EG-MLA gating embedding table by this rank's column slice (ShardedGateEmbedding).
    Tables shared by a layer group stay shared. Raises ConfigError when the model has no gate table."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in a world of {world}")
    if not inplace:
        model = copy.deepcopy(model)
    tables = _gate_tables(model)
    if not tables:
        raise ConfigError(
            f"attention {model.cfg.attention!r} has no gating embedding tables to shard (EG-MLA has them)"
        )
    if world == 1:
        return model
    done: dict[int, ShardedGateEmbedding] = {}
    exchange = GateExchange(rank, world, group)
    for parent, attr, emb in tables:
        if id(emb) not in done:
            d = emb.embedding_dim
            if d < world:
                raise ConfigError(f"gate embedding width {d} is smaller than the number of workers {world}")
            sizes = [len(c) for c in torch.tensor_split(torch.arange(d), world)]
            bounds = [0]
            for s in sizes:
                bounds.append(bounds[-1] + s)
            done[id(emb)] = ShardedGateEmbedding(emb.weight.data, bounds, exchange, average_grads)
        setattr(parent, attr, done[id(emb)])
    model.register_forward_pre_hook(exchange.new_call)  # every call gathers its own token ids once
    return model


def sharded_gate_tables(model: nn.Module) -> list[ShardedGateEmbedding]:
    """The model's sharded gate tables, each once (a table shared by a layer group appears once)."""
    return list({id(m): m for m in model.modules() if isinstance(m, ShardedGateEmbedding)}.values())


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names of parameters that differ between ranks (sharded gate tables): DDP must not average them."""
    sharded = {id(t.weight) for t in sharded_gate_tables(model)}
    return [n for n, p in model.named_parameters() if id(p) in sharded]


def clip_grad_norm(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model with sharded gate tables (call after backward, when DDP
    has averaged the replicated gradients): the squared norms of the ranks' slices are summed across ranks,
    so every rank gets the norm of the whole gradient and scales by the same factor. Returns that norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    is_sharded = {id(t.weight) for t in sharded_gate_tables(model)}
    sharded = [p.grad for p in params if id(p) in is_sharded]
    replicated = [p.grad for p in params if id(p) not in is_sharded]
    device = params[0].grad.device if params else torch.device("cpu")

    def sq(grads):
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return sum((g.detach().double().pow(2).sum() for g in grads), zero)

    sq_sharded = sq(sharded)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq_sharded, group=group)
    total = (sq(replicated) + sq_sharded).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.dtype))
    return total
