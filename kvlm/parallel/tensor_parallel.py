"""Tensor-parallel decoding (mlra.md Sec. 3.4, Table 1): the model as one rank runs it, on torch's DTensor engine.

``shard_model(model, rank, world)`` replaces every attention layer by the part one rank computes and every FFN
by its Megatron slice. What a layer's rank holds is the mechanism's own declaration, ``Attention.tp_plan(rank,
world)`` (nothing here tests a mechanism's name), a dict:

- ``"config"``: the per-rank config fields (n_head, n_kv_head, kv_lora_rank, ...). The rank's module is a module
  of the mechanism's class built from that config (``local_config``), so it runs with its local head / block
  counts and its cache (``model.new_cache`` on a sharded model) holds only the rank's shard; every attention
  mode (auto / naive / absorbed / expand) runs unchanged on it. (torch's Llama example instead edits
  ``n_heads`` after ``parallelize_module``; a kvlm mechanism derives more than a head count from its config.)
- ``"parallelize"``: a ``parallelize_module`` plan, {submodule: torch ParallelStyle}, for the contiguous even
  splits: ColwiseParallel for the projections into the rank's heads (W_Q, W_K, W_V, the output gate),
  RowwiseParallel for W_O, whose partial outputs torch's engine sums (DTensor ``Partial`` -> ``Replicate``).
  Those submodules hold DTensor weights.
- ``"slices"``: slicing rules (kvlm.parallel.slicing) for what no even ``Shard`` expresses or what the module
  reads in its local geometry: TPA's interleaved coefficient rows, GLA / MLRA latent blocks, a KV head
  replicated on several ranks, and the whole latent family (its absorbed route folds W^UK, W^UV, W^O into new
  matrices, and MLRA's branches of one head may sit on different ranks). These stay plain tensors, and when W_O
  is among them kvlm's own all-reduce (``all_reduce_sum``) sums the ranks' partial outputs (``TPAttention``).
- ``"holds"``: what the rank holds, for reports (query heads, KV heads, latent blocks); optional
  ``"class_attrs"`` (class attributes of the rank's module, e.g. a latent-block shard's geometry),
  ``"inherit"`` (instance attributes copied from the full layer) and ``"norms"`` ({LayerNorm: full width}: a
  norm over a vector split across ranks, ``TPLayerNorm``).

FFN: ColwiseParallel W1 (and W2 of SwiGLU), RowwiseParallel W_O (Megatron). Token embedding, final norm and LM
head: replicated (every rank computes the same logits, bit for bit, so ``kvlm.inference.generation`` runs
unchanged on every rank and samples the same tokens from the same seed).

With a process group whose rank and size are ``rank`` and ``world`` the plan runs on a 1-D ``DeviceMesh``;
without one (a single process asking what rank r of `world` would hold, e.g. on the meta device for the
paper-size configs of mlra.md Table 1) torch's styles become the equivalent slices and the model's forward,
which needs the all-reduce, cannot run.

``attention="dp"`` instead keeps whole attention layers and gives each rank its own requests (data-parallel
attention, how the MLRA paper serves MLA), the FFN still sharded (``DPGatherMLP``).

Commands: ``kvlm generate --tp N`` and ``kvlm bench --tp N`` under ``torchrun --nproc-per-node N -m kvlm.cli``;
``kvlm bench-parallel tp-bench`` (kvlm.bench.parallel).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from kvlm.config import ConfigError, spec_numel
from kvlm.parallel.collectives import all_gather_uneven, all_reduce_sum
from kvlm.parallel.slicing import (
    build_shard,
    chunk_indices,
    load_shard,
    local_config,
    slice_state,
    style_slices,
)


class TPAttention(nn.Module):
    """One rank's shard of an attention layer. `inner` computes the shard's heads or latent blocks and its part
    of W_O; unless torch's RowwiseParallel W_O already summed the ranks' partial outputs (``reduce=False``),
    kvlm's all-reduce does."""

    def __init__(self, inner: nn.Module, holds: dict, group=None, reduce: bool = True):
        super().__init__()
        self.inner = inner
        self.plan = holds  # what this rank holds (for reports)
        self.group = group
        self.reduce = reduce

    @property
    def has_naive_cache(self) -> bool:
        return self.inner.has_naive_cache

    @property
    def needs_token_ids(self) -> bool:
        return self.inner.needs_token_ids

    @property
    def layer_idx(self) -> int:
        return self.inner.layer_idx

    def cache_spec(self, naive: bool = False) -> dict[str, tuple[int, ...]]:
        return self.inner.cache_spec(naive=naive)

    def forward(self, x, step, cache=None):
        out = self.inner(x, step, cache)
        return all_reduce_sum(out, self.group) if self.reduce else out


class ReduceSum(nn.Module):
    """kvlm's all-reduce after a module whose output is a partial sum (an FFN sliced without a mesh)."""

    def __init__(self, inner: nn.Module, group=None):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x):
        return all_reduce_sum(self.inner(x), self.group)


class TPLayerNorm(nn.Module):
    """LayerNorm over a vector split across ranks (each holds some heads' columns): the mean and the variance of
    the whole vector come from all-reduced partial sums (two passes, as exact as LayerNorm's). A plan asks for it
    with ``"norms"`` (EG-MLA's LayerNorm of Eq. 5 spans every head of a token); no ParallelStyle of torch's
    normalises over a sharded dimension."""

    def __init__(self, local: nn.LayerNorm, full_width: int, group=None):
        super().__init__()
        self.weight = local.weight
        self.bias = local.bias
        self.eps = local.eps
        self.full_width = full_width
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = all_reduce_sum(x.sum(-1, keepdim=True), self.group) / self.full_width
        xc = x - mean
        var = all_reduce_sum(xc.square().sum(-1, keepdim=True), self.group) / self.full_width
        y = xc * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            y = y * self.weight
        return y + self.bias if self.bias is not None else y


def shard_module(
    module: nn.Module,
    cfg,
    plan: dict,
    rank: int,
    world: int,
    mesh: DeviceMesh | None = None,
    layer_idx: int | None = None,
) -> tuple[nn.Module, bool]:
    """(the part of `module` rank `rank` holds, whether torch's engine sums its output over the ranks).

    The rank's module is built from ``local_config(cfg, **plan["config"])``; the sliced weights are loaded into
    it; with a mesh, the submodules of ``plan["parallelize"]`` are the full layer's, distributed by
    ``parallelize_module`` (without one, their equivalent slices)."""
    cls = type(module)
    if plan.get("class_attrs"):
        cls = type(f"{cls.__name__}Shard", (cls,), dict(plan["class_attrs"]))
    styles = dict(plan.get("parallelize", {}))
    rules = dict(plan.get("slices", {}))
    if mesh is None:
        rules.update(style_slices(styles, module, rank, world))
        styles = {}
    local = build_shard(cls, local_config(cfg, **plan.get("config", {})), layer_idx, module)
    load_shard(local, slice_state(module, rules, rank, skip=list(styles)), skip=list(styles))
    if styles:
        for path in styles:
            local.set_submodule(path, copy.deepcopy(module.get_submodule(path)))
        parallelize_module(local, mesh, styles)
    for name in plan.get("inherit", ()):
        setattr(local, name, getattr(module, name))
    group = mesh.get_group() if mesh is not None else None
    for path, width in plan.get("norms", {}).items():
        local.set_submodule(path, TPLayerNorm(local.get_submodule(path), width, group))
    return local, any(isinstance(s, RowwiseParallel) for s in styles.values())


def mlp_plan(mlp: nn.Module, rank: int, world: int) -> dict:
    """Megatron's FFN split: W1 (and W2) column-parallel, W_O row-parallel."""
    d_f = mlp.w1.weight.shape[0]
    if len(torch.arange(d_f).chunk(world)) < world:
        raise ConfigError(f"ffn_dim={d_f} is smaller than the tensor-parallel degree {world}")
    styles = {name: ColwiseParallel() for name in mlp.column_parallel}
    styles["wo"] = RowwiseParallel()
    return {"config": {"ffn_dim": len(chunk_indices(d_f, rank, world))}, "parallelize": styles}


def _mesh_for(model: nn.Module, rank: int, world: int, group) -> DeviceMesh | None:
    """A 1-D mesh over `group` when this process is rank `rank` of a group of `world` (else None: planning)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size(group) != world or dist.get_rank(group) != rank:
        return None
    device_type = next(model.parameters()).device.type
    if device_type == "meta":
        return None
    return DeviceMesh.from_group(group or dist.group.WORLD, device_type)


def shard_model(
    model: nn.Module,
    rank: int,
    world: int,
    group=None,
    shard_ffn: bool = True,
    inplace: bool = False,
    attention: str = "tp",
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """The model as rank `rank` of `world` runs it. With world == 1 the model itself.

    attention="tp" (tensor parallel): attention layers compute only this rank's shard (and allocate only
    its cache) and sum the output of W_O over the ranks; FFNs Megatron-sharded (shard_ffn=False: replicated).
    attention="dp" (data-parallel attention, how the MLRA paper serves MLA): every rank keeps whole attention
    layers and serves its own requests with its own cache; the FFNs are Megatron-sharded and see every
    rank's tokens (gathered before, each rank's rows kept after). All ranks must call the model
    the same number of times (inference only).
    mesh: the 1-D DeviceMesh of the ranks (default: one over `group` when this process is rank `rank` of it).
    inplace=False works on a deep copy (the original stays usable)."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in a tensor-parallel world of {world}")
    if attention not in ("tp", "dp"):
        raise ConfigError(f"attention parallelism must be 'tp' or 'dp', got {attention!r}")
    if world == 1:
        return model
    if mesh is None:
        mesh = _mesh_for(model, rank, world, group)
    if mesh is not None:
        group = mesh.get_group()
    if not inplace:
        model = copy.deepcopy(model)
    inners = []
    for block in model.layers:
        mlp, mlp_reduced = None, False
        if attention == "dp" or shard_ffn:
            plan = mlp_plan(block.mlp, rank, world)
            mlp, mlp_reduced = shard_module(block.mlp, model.cfg, plan, rank, world, mesh)
        if attention == "dp":
            block.mlp = DPGatherMLP(mlp, rank, group, reduce=not mlp_reduced)
            continue
        inner, holds, reduced = _shard_attention(block.attn, rank, world, mesh)
        inners.append(inner)
        block.attn = TPAttention(inner, holds, group, reduce=not reduced)
        if mlp is not None:
            block.mlp = mlp if mlp_reduced else ReduceSum(mlp, group)
    if inners:  # e.g. eg-mla's layer groups sharing a gate: identical slices, shared again
        type(inners[0]).tie_layers(inners)
    model.tp = {
        "rank": rank,
        "world": world,
        "attention": model.cfg.attention,
        "attention_parallel": attention,
        "ffn": "megatron" if shard_ffn or attention == "dp" else "replicated",
    }
    return model


class DPGatherMLP(nn.Module):
    """FFN shard under data-parallel attention: the ranks' tokens (any number each) are all-gathered, every
    rank runs its FFN slice on all of them, the partial outputs are summed (by torch's RowwiseParallel W_O, or
    kvlm's all-reduce when ``reduce``) and each rank keeps its rows. The gather stays kvlm's: the ranks hold
    different numbers of tokens, which no DTensor placement describes."""

    def __init__(self, inner: nn.Module, rank: int, group=None, reduce: bool = True):
        super().__init__()
        self.inner = inner
        self.rank = rank
        self.group = group
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        every, counts = all_gather_uneven(flat, 0, self.group)
        out = self.inner(every)
        if self.reduce:
            out = all_reduce_sum(out, self.group)
        start = sum(counts[: self.rank])
        return out[start : start + flat.shape[0]].view_as(x)


def _shard_attention(attn: nn.Module, rank: int, world: int, mesh) -> tuple[nn.Module, dict, bool]:
    plan = attn.tp_plan(rank, world)
    inner, reduced = shard_module(attn, attn.cfg, plan, rank, world, mesh, attn.layer_idx)
    return inner, dict(plan.get("holds", {})), reduced


def shard_attention(
    attn: nn.Module, rank: int, world: int, mesh: DeviceMesh | None = None
) -> tuple[nn.Module, dict]:
    """This rank's shard of one attention module (computes the rank's part of the layer output) and what it
    holds. Without a mesh it needs no process group: on the meta device it answers what each rank would hold,
    e.g. for the paper-size configs of mlra.md Table 1."""
    inner, holds, _ = _shard_attention(attn, rank, world, mesh)
    return inner, holds


def tp_plan(model: nn.Module) -> list[dict]:
    """Per layer: what this rank holds (query heads, KV heads or latent blocks)."""
    return [b.attn.plan if isinstance(b.attn, TPAttention) else {} for b in model.layers]


def kv_elements_per_token(model: nn.Module) -> int:
    """Cache elements per token this rank holds, all layers: from the (sharded) modules' cache_spec."""
    return sum(spec_numel(b.attn.cache_spec()) for b in model.layers)


def kv_bytes_per_token(model: nn.Module, dtype_bytes: int = 2) -> int:
    return kv_elements_per_token(model) * dtype_bytes


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the unique parameters this process holds (a DTensor's local shard)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            local = p.to_local() if isinstance(p, DTensor) else p
            total += local.numel() * local.element_size()
    return total
