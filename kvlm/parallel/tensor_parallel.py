"""Tensor-parallel decoding (mlra.md Sec. 3.4, Table 1): the model as one rank runs it.

``shard_model(model, rank, world)`` replaces every attention layer by the part one rank computes and every FFN
by its Megatron slice:

- attention: each rank holds a shard of the heads / latent blocks (a module of the mechanism's own class
  built from a per-rank config, its weights sliced out of the full layer by the mechanism's sharder in
  kvlm.parallel.sharders) and the matching column slice of W_O; the per-rank partial outputs of W_O are summed
  with one all-reduce (row-parallel W_O, ``TPAttention``). Each rank caches only what its shard reads, so
  ``model.new_cache`` on a sharded model allocates only that part, and every attention mode (auto / naive /
  absorbed / expand) runs unchanged on the shard.
- FFN: column-parallel W1 (and W2 of SwiGLU), row-parallel W_O, one all-reduce (Megatron style, ``TPMLP``).
- token embedding, final norm and LM head: replicated (every rank computes the same logits, bit for bit,
  so ``kvlm.inference.generation`` runs unchanged on every rank and samples the same tokens from the same seed).

``attention="dp"`` instead keeps whole attention layers and gives each rank its own requests (data-parallel
attention, how the MLRA paper serves MLA), the FFN still sharded (``DPGatherMLP``).

Commands: ``kvlm generate --tp N`` and ``kvlm bench --tp N`` under ``torchrun --nproc-per-node N -m kvlm.cli``;
``kvlm bench-parallel tp-bench`` (kvlm.bench.parallel).
"""

from __future__ import annotations

import torch
from torch import nn

from kvlm.config import ConfigError, spec_numel
from kvlm.parallel.collectives import all_gather_uneven, all_reduce_sum
from kvlm.parallel.sharders import SHARDERS, TPLayerNorm
from kvlm.parallel.slicing import build_shard, copy_model, local_config, slice_state


class TPAttention(nn.Module):
    """One rank's shard of an attention layer. `inner` computes the shard's heads or latent blocks and
    its slice of W_O; the partial outputs of all ranks are summed (row-parallel W_O)."""

    def __init__(self, inner: nn.Module, plan: dict, group=None):
        super().__init__()
        self.inner = inner
        self.plan = plan  # how this rank's part was cut (for reports)
        self.group = group

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
        return all_reduce_sum(self.inner(x, step, cache), self.group)


class TPMLP(nn.Module):
    """Megatron FFN shard: column-parallel W1 (and W2), row-parallel W_O, one all-reduce."""

    def __init__(self, inner: nn.Module, group=None):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, x):
        return all_reduce_sum(self.inner(x), self.group)


def _shard_mlp(mlp: nn.Module, cfg, rank: int, world: int) -> nn.Module:
    d_f = mlp.w1.weight.shape[0]
    keep = torch.tensor_split(torch.arange(d_f), world)[rank].tolist()
    if not keep:
        raise ConfigError(f"ffn_dim={d_f} is smaller than the tensor-parallel degree {world}")
    rules = {"wo.weight": ("cols", 1, keep), "wo.bias": ("first",)}
    for name in ("w1", "w2"):
        rules[f"{name}.weight"] = ("rows", 1, keep)
        rules[f"{name}.bias"] = ("rows", 1, keep)
    return build_shard(
        type(mlp), local_config(cfg, ffn_dim=len(keep)), None, mlp, slice_state(mlp, rules, rank)
    )


def shard_model(
    model: nn.Module,
    rank: int,
    world: int,
    group=None,
    shard_ffn: bool = True,
    inplace: bool = False,
    attention: str = "tp",
) -> nn.Module:
    """The model as rank `rank` of `world` runs it. With world == 1 the model itself.

    attention="tp" (tensor parallel): attention layers compute only this rank's shard (and allocate only
    its cache) and all-reduce the output of W_O; FFNs Megatron-sharded (shard_ffn=False: replicated).
    attention="dp" (data-parallel attention, how the MLRA paper serves MLA): every rank keeps whole attention
    layers and serves its own requests with its own cache; the FFNs are Megatron-sharded and see every
    rank's tokens (gathered before, the summed outputs handed back after). All ranks must call the model
    the same number of times (inference only).
    inplace=False works on a deep copy (the original stays usable)."""
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is not in a tensor-parallel world of {world}")
    if attention not in ("tp", "dp"):
        raise ConfigError(f"attention parallelism must be 'tp' or 'dp', got {attention!r}")
    if world == 1:
        return model
    name = model.cfg.attention
    if attention == "tp" and name not in SHARDERS:
        raise ConfigError(
            f"tensor-parallel decoding is not implemented for attention {name!r}; "
            f"supported: {', '.join(sorted(SHARDERS))}"
        )
    if not inplace:
        model = copy_model(model)
    inners = []
    for block in model.layers:
        if attention == "dp":
            block.mlp = DPGatherMLP(_shard_mlp(block.mlp, model.cfg, rank, world), rank, group)
            continue
        inner, plan = shard_attention(block.attn, rank, world)
        for m in inner.modules():  # collectives inside the shard (eg-mla's LayerNorm) use the same group
            if isinstance(m, TPLayerNorm):
                m.group = group
        inners.append(inner)
        block.attn = TPAttention(inner, plan, group)
        if shard_ffn:
            block.mlp = TPMLP(_shard_mlp(block.mlp, model.cfg, rank, world), group)
    if inners:  # e.g. eg-mla's layer groups sharing a gate: identical slices, shared again
        type(inners[0]).tie_layers(inners)
    model.tp = {
        "rank": rank,
        "world": world,
        "attention": name,
        "attention_parallel": attention,
        "ffn": "megatron" if shard_ffn or attention == "dp" else "replicated",
    }
    return model


class DPGatherMLP(nn.Module):
    """FFN shard under data-parallel attention: the ranks' tokens (any number each) are all-gathered, every
    rank runs its FFN slice on all of them, the partial outputs are summed and each rank keeps its rows."""

    def __init__(self, inner: nn.Module, rank: int, group=None):
        super().__init__()
        self.inner = inner
        self.rank = rank
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        every, counts = all_gather_uneven(flat, 0, self.group)
        out = all_reduce_sum(self.inner(every), self.group)
        start = sum(counts[: self.rank])
        return out[start : start + flat.shape[0]].view_as(x)


def shard_attention(attn: nn.Module, rank: int, world: int) -> tuple[nn.Module, dict]:
    """This rank's shard of one attention module (computes the rank's part of the layer output, before
    the all-reduce) and its plan. Needs no process group: on the meta device it answers what each rank
    would hold, e.g. for the paper-size configs of mlra.md Table 1."""
    name = attn.cfg.attention
    if name not in SHARDERS:
        raise ConfigError(
            f"tensor-parallel decoding is not implemented for attention {name!r}; "
            f"supported: {', '.join(sorted(SHARDERS))}"
        )
    return SHARDERS[name](attn, rank, world)


def tp_plan(model: nn.Module) -> list[dict]:
    """Per layer: what this rank holds (query heads, KV heads or latent blocks)."""
    return [b.attn.plan if isinstance(b.attn, TPAttention) else {} for b in model.layers]


def kv_elements_per_token(model: nn.Module) -> int:
    """Cache elements per token this rank holds, all layers: from the (sharded) modules' cache_spec."""
    return sum(spec_numel(b.attn.cache_spec()) for b in model.layers)


def kv_bytes_per_token(model: nn.Module, dtype_bytes: int = 2) -> int:
    return kv_elements_per_token(model) * dtype_bytes


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the unique parameters this process holds."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total
