"""More than one device, on torch.distributed (gloo on CPU, NCCL on CUDA), launched with torchrun.

Tensor-parallel decoding (mlra.md Sec. 3.4, Table 1). ``shard_model(model, rank, world)`` replaces every
attention layer by the part one rank computes and every FFN by its Megatron slice:

- attention: each rank holds a shard of the heads / latent blocks (a module of the mechanism's own class
  built from a per-rank config, its weights sliced out of the full layer) and the matching column slice
  of W_O; the per-rank partial outputs of W_O are summed with one all-reduce (row-parallel W_O). Each rank
  caches only what its shard reads, so ``model.new_cache`` on a sharded model allocates only that part,
  and every attention mode (auto / naive / absorbed / expand) runs unchanged on the shard.
- FFN: column-parallel W1 (and W2 of SwiGLU), row-parallel W_O, one all-reduce (Megatron style).
- token embedding, final norm and LM head: replicated (every rank computes the same logits, bit for bit,
  so ``kvlm.inference.generation`` runs unchanged on every rank and samples the same tokens from the same seed).

How each mechanism splits (as its paper deploys it; ``tp_plan`` says what a rank holds):
MHA/MQA/GQA by KV head, GTA by group (beyond g ranks a KV head / group is replicated and its query heads
split); MLA and EG-MLA by query head with the latent cache (c_kv, k_rope) replicated on every rank, as
FlashMLA deploys it (the redundancy MLRA criticises); MFA by query head, its one K/V head replicated; TPA by
coefficient (A^K, A^V columns of the rank's heads), the shared factors replicated; GLA-2/4 by latent head;
MLRA-2/4 by latent block, the branches of a head summed by the all-reduce (Eqs. 5-6). k_rope is replicated
wherever it exists. ``attention="dp"`` instead keeps whole attention layers and gives each rank its own
requests (data-parallel attention, how the MLRA paper serves MLA), the FFN still sharded.

EG-MLA embedding parallelism (eg-mla.md "Embedding Parallelism", Eqs. 9-11, Table 6).
``shard_gate_embeddings(model, rank, world)`` keeps on each data-parallel rank only a column slice
(d_kv / W dims, Eq. 9) of every layer's gating embedding table. The ranks hold different batches (DDP), so
a rank needs every rank's slice of its own tokens: the token ids are all-gathered, each rank looks up its
slice for all of them (Eq. 10) and one exchange gives every rank the concatenated embedding of its own
tokens (an all-to-all: the part of the paper's all-gather that each rank actually needs). W^UE (Eq. 11)
and the rest of the model stay replicated under DDP; ``wrap_ddp`` keeps DDP off the sharded tables,
``clip_grad_norm`` clips by the whole gradient's norm, ``gather_gate_embeddings`` rebuilds full tables
for a checkpoint.

Commands: ``kvlm generate --tp N`` and ``kvlm bench --tp N`` under ``torchrun --nproc-per-node N -m kvlm.cli``;
``python -m kvlm.parallel.tensor_parallel tp-bench | embedding-parallel-bench | embedding-parallel-table`` (see --help).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kvlm.config import ConfigError, _numel

# =====================================================================================================
# Process group
# =====================================================================================================


@dataclass
class TPContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: dist.ProcessGroup | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_tp(backend: str | None = None, device: str | None = None) -> TPContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Backend: NCCL when CUDA is used, else gloo. Each rank uses cuda:LOCAL_RANK on a GPU machine.
    Without torchrun's environment (a plain single process) this returns a world of one."""
    want_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            dev = torch.device("cuda" if want_cuda else "cpu")
            return TPContext(0, 1, 0, dev, None)
        backend = backend or ("nccl" if want_cuda else "gloo")
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if want_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device(f"cuda:{local_rank}") if want_cuda else torch.device("cpu")
    return TPContext(dist.get_rank(), dist.get_world_size(), local_rank, dev, None)


def require_world(tp: int, ctx: TPContext) -> None:
    """A clear error when --tp N does not match the processes torchrun started."""
    if tp != ctx.world:
        raise ConfigError(
            f"--tp {tp} needs {tp} processes but this run has {ctx.world}: launch with "
            f"`torchrun --nproc-per-node {tp} -m kvlm.cli ...`"
        )


# =====================================================================================================
# Collectives with autograd
# =====================================================================================================


class _AllReduceSum(torch.autograd.Function):
    """Sum of the ranks' partial outputs (Megatron's reduce out of the tensor-parallel region). The input
    of the layer is replicated, so the gradient of each partial output is the gradient of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    return _AllReduceSum.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a flat tensor with uneven splits; the backward sends gradients back the
    way the values came. `exchange` (a GateExchange) gives the group and times the transfers."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, exchange):
        ctx.splits = (out_splits, in_splits, exchange)
        out = x.new_empty(sum(out_splits))
        with exchange.timed(x.device):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=exchange.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, exchange = ctx.splits
        back = grad.new_empty(sum(in_splits))
        with exchange.timed(grad.device):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=exchange.group)
        return back, None, None, None


# =====================================================================================================
# Slicing a module's weights into a per-rank module
# =====================================================================================================

# A rule says how one parameter of the full module becomes the rank's: ("rows"/"cols", unit, units kept)
# keeps the listed blocks of `unit` rows (dim 0) or columns (dim 1); "first" keeps the tensor on rank 0
# and zeros elsewhere (the bias of a row-parallel output, added once by the all-reduce); a callable maps
# the full tensor to the rank's. Unlisted parameters are replicated.
Rule = tuple


def _take(t: torch.Tensor, dim: int, unit: int, keep: Sequence[int]) -> torch.Tensor:
    if dim >= t.dim():
        raise ValueError(f"cannot slice dim {dim} of a {t.dim()}-d tensor")
    blocks = t.unflatten(dim, (t.shape[dim] // unit, unit))
    idx = torch.as_tensor(list(keep), dtype=torch.long, device=t.device)
    return blocks.index_select(dim, idx).flatten(dim, dim + 1).clone()


def slice_state(module: nn.Module, rules: dict[str, Rule], rank: int) -> dict[str, torch.Tensor]:
    """The state dict of `module` with each ruled parameter replaced by this rank's part."""
    state = {}
    for name, t in module.state_dict().items():
        rule = rules.get(name)
        if rule is None:
            state[name] = t.clone()
        elif callable(rule):
            state[name] = rule(t).clone()
        elif rule[0] == "first":
            state[name] = t.clone() if rank == 0 else torch.zeros_like(t)
        else:
            kind, unit, keep = rule
            state[name] = _take(t, 0 if kind == "rows" else 1, unit, keep)
    return state


def build_shard(cls, cfg, layer_idx: int, like: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A module of class `cls` built from the per-rank config, holding the sliced weights (strict load:
    a shape that does not fit says which parameter and how)."""
    p = next(like.parameters())
    with torch.device(p.device):
        shard = cls(cfg, layer_idx) if layer_idx is not None else cls(cfg)
    shard = shard.to(p.dtype)
    try:
        shard.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ConfigError(f"cannot shard {cls.__name__}: per-rank weights do not fit ({e})") from e
    return shard


def local_config(cfg, **fields):
    """The config a shard's module is built from: the full config with per-rank sizes (n_head, n_kv_head,
    kv_lora_rank, ...). Not validated as a model of its own: a shard need not be one (e.g. one latent block
    of MLRA-4 with a d_c that is no multiple of 4)."""
    local = copy.copy(cfg)
    local.extra = dict(cfg.extra)
    for k, v in fields.items():
        if not hasattr(cfg, k):
            raise ConfigError(f"internal: ModelConfig has no field {k!r}")
        setattr(local, k, v)
    return local


def _rng(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# =====================================================================================================
# Tensor-parallel modules
# =====================================================================================================


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
        return getattr(self.inner, "has_naive_cache", False)

    @property
    def needs_token_ids(self) -> bool:
        return getattr(self.inner, "needs_token_ids", False)

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


# --- per-mechanism sharders ------------------------------------------------------------------------
# Each takes (attn module, rank, world) and returns (inner shard module, plan dict). The plan says which
# query heads / KV heads / latent blocks the rank holds.

Sharder = Callable[[nn.Module, int, int], tuple[nn.Module, dict]]
SHARDERS: dict[str, Sharder] = {}


def sharder(*names: str):
    def deco(fn: Sharder) -> Sharder:
        for n in names:
            SHARDERS[n] = fn
        return fn

    return deco


def _heads_of(h: int, rank: int, world: int) -> list[int]:
    """The query heads of `rank` when h heads split evenly across `world` ranks."""
    if h % world:
        raise ConfigError(f"n_head={h} is not divisible by the tensor-parallel degree {world}")
    return _rng(rank * (h // world), h // world)


def _output_rules(heads: list[int], dv: int) -> dict[str, Rule]:
    """W_O columns and the output gate's rows of the rank's heads (d_v = dv each); W_O's bias once."""
    return {
        "wo.weight": ("cols", dv, heads),
        "wo.bias": ("first",),
        "gate.weight": ("rows", dv, heads),
        "gate.bias": ("rows", dv, heads),
    }


def _group_split(
    h: int, g: int, rank: int, world: int, what: str = "n_kv_head"
) -> tuple[list[int], list[int]]:
    """Query heads and KV heads (groups) of `rank` when h query heads share g KV heads (head i reads
    group i // (h/g)). Up to g ranks split the groups; beyond, each group is replicated on world/g ranks
    that split its query heads."""
    if h % world:
        raise ConfigError(f"n_head={h} is not divisible by the tensor-parallel degree {world}")
    hl = h // world
    q = _rng(rank * hl, hl)
    if world <= g:
        if g % world:
            raise ConfigError(f"{what}={g} is not divisible by the tensor-parallel degree {world}")
        gl = g // world
        return q, _rng(rank * gl, gl)
    if world % g:
        raise ConfigError(f"tensor-parallel degree {world} is not a multiple of {what}={g}")
    return q, [rank // (world // g)]


@sharder("mha", "mqa", "gqa")
def _shard_mha(attn, rank, world):
    cfg = attn.cfg
    dh = cfg.head_dim
    q, kv = _group_split(cfg.n_head, cfg.n_kv_head, rank, world)
    rules = {"wq.weight": ("rows", dh, q), "wq.bias": ("rows", dh, q), **_output_rules(q, dh)}
    for w in ("wk", "wv"):
        rules[f"{w}.weight"] = ("rows", dh, kv)
        rules[f"{w}.bias"] = ("rows", dh, kv)
    local = local_config(cfg, n_head=len(q), n_kv_head=len(kv))
    inner = build_shard(type(attn), local, attn.layer_idx, attn, slice_state(attn, rules, rank))
    return inner, {"query_heads": q, "kv_heads": kv}


@sharder("mla", "eg-mla")
def _shard_mla(attn, rank, world):
    """By query head, as FlashMLA: W^UQ, W^QR, W^UK, W^UV rows and W^O columns of the rank's heads; the
    down-projections and the whole latent cache (c_kv, k_rope) on every rank (mlra.md Sec. 3.4).

    EG-MLA the same way, with the rank's heads' rows of W^UKV and W^UE (2 d_h per head, Listing 1) and the
    gating table replicated (every head's gate needs the whole e, Eq. 4). Its LayerNorm (Eq. 5) spans all
    heads of a token, so the shard's LayerNorm gets the token's mean and variance with two all-reduces of
    one number per token (TPLayerNorm)."""
    cfg = attn.cfg
    if getattr(cfg, "rope_kv_heads", 1) > 1:
        from kvlm.config import ConfigError

        raise ConfigError("tensor parallelism of MLA with rope_kv_heads > 1 is not implemented")
    dh, dr = cfg.head_dim, cfg.rope_head_dim
    q = _heads_of(cfg.n_head, rank, world)
    rules = _output_rules(q, dh)
    per_head = {"w_uk": dh, "w_uv": dh, "w_uq": dh, "w_qr": dr, "wq": dh + dr}
    per_head.update({"w_ukv": 2 * dh, "emb_gate.w_ue": 2 * dh, "ln_emb": 2 * dh})  # eg-mla
    for w, width in per_head.items():
        rules[f"{w}.weight"] = ("rows", width, q)
        rules[f"{w}.bias"] = ("rows", width, q)
    inner = build_shard(
        type(attn), local_config(cfg, n_head=len(q)), attn.layer_idx, attn, slice_state(attn, rules, rank)
    )
    inner.absorb_fold = attn.absorb_fold
    if getattr(inner, "ln_emb", None) is not None:
        inner.ln_emb = TPLayerNorm(inner.ln_emb, attn.ln_emb.normalized_shape[0])
    return inner, {"query_heads": q, "latent": "replicated"}


class TPLayerNorm(nn.Module):
    """LayerNorm over a vector split across ranks (each holds some heads' columns): the mean and the
    variance of the whole vector come from all-reduced partial sums (two passes, as exact as LayerNorm's)."""

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


@sharder("mfa")
def _shard_mfa(attn, rank, world):
    """By query head; the one shared key and value head is cached on every rank (mlra.md Table 1)."""
    cfg = attn.cfg
    dh = cfg.head_dim
    q = _heads_of(cfg.n_head, rank, world)
    rules = _output_rules(q, dh)
    for w in ("wq", "wq_b"):
        rules[f"{w}.weight"] = ("rows", dh, q)
        rules[f"{w}.bias"] = ("rows", dh, q)
    inner = build_shard(
        type(attn), local_config(cfg, n_head=len(q)), attn.layer_idx, attn, slice_state(attn, rules, rank)
    )
    return inner, {"query_heads": q, "kv_heads": "replicated"}


@sharder("gta")
def _shard_gta(attn, rank, world):
    """By group: the rank's query heads and their tied value/key heads; k_rope on every rank."""
    cfg = attn.cfg
    dh = cfg.head_dim
    q, kv = _group_split(cfg.n_head, cfg.n_kv_head, rank, world)
    rules = {"wq.weight": ("rows", dh, q), "wq.bias": ("rows", dh, q), **_output_rules(q, dh)}
    rules["wkv.weight"] = ("rows", dh, kv)
    rules["wkv.bias"] = ("rows", dh, kv)
    local = local_config(cfg, n_head=len(q), n_kv_head=len(kv))
    inner = build_shard(type(attn), local, attn.layer_idx, attn, slice_state(attn, rules, rank))
    return inner, {"query_heads": q, "kv_heads": kv, "k_rope": "replicated"}


@sharder("tpa")
def _shard_tpa(attn, rank, world):
    """By coefficient: the rank's heads' columns of Q^A, K^A, V^A (rows of W^A laid out (beta, h) per
    factor); the shared factors Q^C, K^C, V^C (W^C) on every rank (mlra.md Sec. 3.4)."""
    cfg = attn.cfg
    h, dh, bq, bkv = cfg.n_head, cfg.head_dim, cfg.tpa_q_rank, cfg.tpa_kv_rank
    q = _heads_of(h, rank, world)
    rows = [p * h + i for p in range(bq + 2 * bkv) for i in q]  # [A^Q (bq, h); A^K (bkv, h); A^V (bkv, h)]
    rules = {"w_a.weight": ("rows", 1, rows), "w_a.bias": ("rows", 1, rows), **_output_rules(q, dh)}
    inner = build_shard(
        type(attn), local_config(cfg, n_head=len(q)), attn.layer_idx, attn, slice_state(attn, rules, rank)
    )
    return inner, {"query_heads": q, "coefficients": q, "factors": "replicated"}


@sharder("gla-2", "gla-4", "mlra-2", "mlra-4")
def _shard_latent_blocks(attn, rank, world):
    """By latent block (mlra.md Sec. 3.2-3.4): a rank holds whole blocks of the KV latent with the up-projections
    of the heads they serve, caches only those blocks (plus the shared k_rope), and its partial W^O output sums
    with the other ranks'. MLRA's branches of one head may sit on different ranks: the per-branch outputs are
    linear in W^O, so the all-reduce completes the branch sum of Eqs. 5-6. Beyond one block per rank (degree >
    n_blocks) a block is replicated on world / n_blocks ranks that split its heads."""
    cfg = attn.cfg
    bpg, nb, r, d_lat = attn.bpg, attn.n_blocks, attn.r, attn.d_lat
    dh, dr, dc = cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
    if world <= nb:
        if nb % world:
            raise ConfigError(
                f"{cfg.attention} has {nb} latent blocks, not divisible by the tensor-parallel degree {world}"
            )
        k = nb // world
        blocks = _rng(rank * k, k)
        within = list(range(r))  # every head of each block
        if k >= bpg:  # whole head groups
            if k % bpg:
                raise ConfigError(
                    f"{cfg.attention}: {k} blocks per rank would split a head group of {bpg} blocks"
                )
            G_loc, bpg_loc = k // bpg, bpg
        else:  # some branches of one head group
            G_loc, bpg_loc = 1, k
    else:
        if world % nb or r % (world // nb):
            raise ConfigError(
                f"{cfg.attention}: tensor-parallel degree {world} must be a multiple of its {nb} latent blocks "
                f"and split the {r} heads of a block evenly"
            )
        per = world // nb
        blocks = [rank // per]
        r_loc = r // per
        within = _rng((rank % per) * r_loc, r_loc)
        G_loc, bpg_loc = 1, 1
    groups = sorted({b // bpg for b in blocks})
    heads = [g * r + j for g in groups for j in within]  # global heads, in the local head order
    bl = torch.as_tensor(blocks)
    wi = torch.as_tensor(within)
    rules = _output_rules(heads, dh)
    for w in ("wq", "wq_b"):
        rules[f"{w}.weight"] = ("rows", dh + dr, heads)
        rules[f"{w}.bias"] = ("rows", dh + dr, heads)
    latent_rows = [b * d_lat + i for b in blocks for i in range(d_lat)] + list(range(dc, dc + dr))
    rules["wkv_a.weight"] = ("rows", 1, latent_rows)
    rules["wkv_a.bias"] = ("rows", 1, latent_rows)
    rules["kv_norm.weight"] = ("rows", 1, blocks)
    for w in ("w_uk", "w_uv"):
        rules[w] = lambda t: t[bl.to(t.device)][:, wi.to(t.device)]
    shard_cls = type(
        f"{type(attn).__name__}Shard", (type(attn),), {"n_groups": G_loc, "blocks_per_group": bpg_loc}
    )
    local = local_config(cfg, n_head=G_loc * len(within), kv_lora_rank=len(blocks) * d_lat)
    inner = build_shard(shard_cls, local, attn.layer_idx, attn, slice_state(attn, rules, rank))
    inner.alpha_attn = attn.alpha_attn  # Eq. 10 scales by the full branch count, not the rank's
    inner.alpha_kv = attn.alpha_kv  # sqrt(d / d_lat): unchanged, d_lat is the same
    return inner, {"latent_blocks": blocks, "query_heads": heads, "k_rope": "replicated"}


# =====================================================================================================
# The sharded model
# =====================================================================================================


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
    tie = getattr(type(inners[0]), "tie_layers", None) if inners else None
    if tie is not None:  # e.g. eg-mla's layer groups sharing a gate: identical slices, shared again
        tie(inners)
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
        world = dist.get_world_size(self.group)
        flat = x.reshape(-1, x.shape[-1])
        n = torch.tensor([flat.shape[0]], device=x.device)
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n, group=self.group)
        counts = [int(c) for c in counts]
        padded = flat.new_zeros(max(counts), flat.shape[1])
        padded[: flat.shape[0]] = flat
        gathered = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        every = torch.cat([g[:c] for g, c in zip(gathered, counts)])
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


def copy_model(model: nn.Module) -> nn.Module:
    """copy.deepcopy, keeping the attributes set on parameters (is_gate_embedding, ...): deepcopy of an
    nn.Parameter drops them."""
    new = copy.deepcopy(model)
    for (_, p), (_, q) in zip(model.named_parameters(), new.named_parameters()):
        for k, v in vars(p).items():
            if not hasattr(q, k):
                setattr(q, k, v)
    return new


def tp_plan(model: nn.Module) -> list[dict]:
    """Per layer: what this rank holds (query heads, KV heads or latent blocks)."""
    return [getattr(b.attn, "plan", {}) for b in model.layers]


def kv_elements_per_token(model: nn.Module) -> int:
    """Cache elements per token this rank holds, all layers: from the (sharded) modules' cache_spec."""
    return sum(_numel(b.attn.cache_spec()) for b in model.layers)


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


# =====================================================================================================
# EG-MLA embedding parallelism (dimension-wise sharding of the gating embedding tables)
# =====================================================================================================


class GateExchange:
    """What the sharded gate tables of one model share: the process group, the token ids of the current call
    gathered from every rank (all layers look up the same ids, so they are gathered once per model call) and
    the time spent communicating (``timing = True``; synchronises CUDA around each collective)."""

    def __init__(self, rank: int, world: int, group=None):
        self.rank, self.world, self.group = rank, world, group
        self.timing = False
        self.comm_seconds = 0.0
        self._memo: tuple | None = None  # (ids, version, counts, every)

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
        memo = self._memo
        if memo is not None and memo[0] is ids and memo[1] == ids._version:
            return memo[2], memo[3]
        flat = ids.reshape(-1)
        with self.timed(flat.device):
            n = torch.tensor([flat.numel()], device=flat.device)
            counts = [torch.zeros_like(n) for _ in range(self.world)]
            dist.all_gather(counts, n, group=self.group)
            counts = [int(c) for c in counts]
            padded = torch.zeros(max(counts), dtype=flat.dtype, device=flat.device)
            padded[: flat.numel()] = flat
            gathered = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(gathered, padded, group=self.group)
        every = torch.cat([g[:c] for g, c in zip(gathered, counts)])
        self._memo = (ids, ids._version, counts, every)
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
        self.weight.is_gate_embedding = True
        self.weight.is_sharded_gate_embedding = True
        if average_grads and self.world > 1:
            self.weight.register_hook(lambda g: g / self.world)

    def extra_repr(self) -> str:
        lo, hi = self.bounds[self.rank], self.bounds[self.rank + 1]
        return f"{self.num_embeddings}, columns [{lo}, {hi}) of {self.embedding_dim}, rank {self.rank}/{self.world}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        counts, every = self.exchange.gather_ids(ids)
        n = ids.numel()
        mine = nn.functional.embedding(every, self.weight)  # (sum counts, d_local), Eq. 10
        widths = [self.bounds[r + 1] - self.bounds[r] for r in range(self.world)]
        in_splits = [c * widths[self.rank] for c in counts]  # to rank j: my columns of j's tokens
        out_splits = [n * w for w in widths]  # from rank s: s's columns of my tokens
        recv = _AllToAll.apply(mine.reshape(-1), out_splits, in_splits, self.exchange)
        parts = [p.view(n, w) for p, w in zip(recv.split(out_splits), widths)]
        return torch.cat(parts, dim=-1).view(*ids.shape, self.embedding_dim)  # Eq. 11's concatenation


def _gate_tables(model: nn.Module) -> list[tuple[nn.Module, str, nn.Embedding]]:
    """(parent, attribute, embedding) for every nn.Embedding whose weight is marked is_gate_embedding."""
    out = []
    for parent in model.modules():
        for attr, child in parent.named_children():
            if isinstance(child, nn.Embedding) and getattr(child.weight, "is_gate_embedding", False):
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
        model = copy_model(model)
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
    return model


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names of parameters that differ between ranks (sharded gate tables): DDP must not average them."""
    return [n for n, p in model.named_parameters() if getattr(p, "is_sharded_gate_embedding", False)]


def clip_grad_norm(model: nn.Module, max_norm: float, group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for a model with sharded gate tables (call after backward, when DDP
    has averaged the replicated gradients): the squared norms of the ranks' slices are summed across ranks,
    so every rank gets the norm of the whole gradient and scales by the same factor. Returns that norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    sharded = [p.grad for p in params if getattr(p, "is_sharded_gate_embedding", False)]
    replicated = [p.grad for p in params if not getattr(p, "is_sharded_gate_embedding", False)]
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


def gather_gate_embeddings(model: nn.Module, group=None) -> nn.Module:
    """A copy of the model with every sharded gate table gathered back into one nn.Embedding (a collective:
    every rank calls it; each gets the full model), e.g. for rank 0 to save an ordinary checkpoint."""
    full = copy_model(model)
    done: dict[int, nn.Embedding] = {}
    for parent in list(full.modules()):
        for attr, child in list(parent.named_children()):
            if not isinstance(child, ShardedGateEmbedding):
                continue
            if id(child) not in done:
                w = child.weight.detach()
                widest = max(child.bounds[r + 1] - child.bounds[r] for r in range(child.world))
                padded = w.new_zeros(w.shape[0], widest)
                padded[:, : w.shape[1]] = w
                parts = [torch.empty_like(padded) for _ in range(child.world)]
                dist.all_gather(parts, padded.contiguous(), group=group)
                widths = [child.bounds[r + 1] - child.bounds[r] for r in range(child.world)]
                table = torch.cat([p[:, :wd] for p, wd in zip(parts, widths)], dim=1)
                emb = nn.Embedding(child.num_embeddings, child.embedding_dim, device=w.device, dtype=w.dtype)
                emb.weight.data.copy_(table)
                emb.weight.is_gate_embedding = True
                done[id(child)] = emb
            setattr(parent, attr, done[id(child)])
    return full


def wrap_ddp(model: nn.Module, device: torch.device | None = None, **kw) -> nn.Module:
    """DistributedDataParallel over the replicated parameters only; sharded gate tables are left out."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ignore = sharded_parameter_names(model)
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
    if device is not None and device.type == "cuda":
        kw.setdefault("device_ids", [device.index])
    return DDP(model, **kw)


# =====================================================================================================
# Command-line helpers: `kvlm generate --tp N` / `kvlm bench --tp N` (under torchrun) and the entries of
# `python -m kvlm.parallel.tensor_parallel` (tp-bench, embedding-parallel-bench, embedding-parallel-table)
# =====================================================================================================


def tp_setup(tp: int, device: str | None = None) -> TPContext:
    """For a command's --tp N: join torchrun's group (a clear error when the launch has another number of
    processes) and silence stdout on ranks other than 0, so that the command prints its result once."""
    ctx = init_tp(device=None if device in (None, "auto") else device)
    require_world(tp, ctx)
    atexit.register(_shutdown)  # a gloo group left open at exit aborts the process ("terminate called ...")
    if ctx.rank != 0:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)
    return ctx


def _shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _gather(obj, ctx: TPContext) -> list:
    if ctx.world == 1:
        return [obj]
    out = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def check_against_single_process(
    model: nn.Module, tp_model: nn.Module, steps: int = 8, batch: int = 2
) -> dict:
    """Greedy decoding with the full model and with this rank's shard from the same prompt: the largest
    |logit difference| and whether every step picked the same token."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (batch, 8), generator=gen).to(model.embed.weight.device)
    out = []
    for m in (model, tp_model):
        cache = m.new_cache(batch, 8 + steps)
        logits = [m(prompt, cache=cache, last_only=True)]
        for _ in range(steps - 1):
            logits.append(m(logits[-1].argmax(-1), cache=cache))
        out.append(torch.cat(logits, dim=1).float())
    return {
        "max_logit_diff": (out[0] - out[1]).abs().max().item(),
        "same_tokens": bool(torch.equal(out[0].argmax(-1), out[1].argmax(-1))),
    }


def tp_bench(
    variants,
    ctx: TPContext,
    batch=(1,),
    context=(512,),
    prompt=(128,),
    steps=8,
    warmup=2,
    repeats=3,
    dtype=torch.float32,
    seed=0,
    check=False,
    log=print,
    attention="tp",
) -> list[dict]:
    """Prefill and decode timings of every (label, config, modes) at this launch's TP degree, and what each
    rank holds: its KV bytes per token (which must equal ``kvlm kv-table --tp N``'s per-device column), its
    weight bytes, its plan. Every rank runs the same calls; rank 0 gets every rank's rows.
    attention="dp": data-parallel attention, each rank decoding its own `batch` requests (whole layers,
    the full per-token cache of its requests), the FFN sharded."""
    from kvlm.accounting import per_device_elements
    from kvlm.bench.run import bench_decode, bench_prefill
    from kvlm.model import build_model

    rows = []
    elt = torch.empty((), dtype=dtype).element_size()
    for label, cfg, modes in variants:
        need = max(max(context) + warmup + steps, max(prompt), 16)
        if cfg.max_seq_len < need:
            cfg = cfg.replace(max_seq_len=need)
        torch.manual_seed(seed)  # the same weights on every rank
        model = build_model(cfg, device=ctx.device, dtype=dtype).eval()
        full = model if check else None
        model = shard_model(model, ctx.rank, ctx.world, inplace=not check, attention=attention)
        row = {
            "variant": label,
            "attention": cfg.attention,
            "attention_parallel": attention,
            "tp": ctx.world,
            "rank": ctx.rank,
            "plan": tp_plan(model)[0],
            "kv_bytes_per_token": kv_bytes_per_token(model, elt),
            "kv_table_bytes_per_token": round(
                sum(
                    per_device_elements(cfg, ctx.world if attention == "tp" else 1, i)
                    for i in range(cfg.n_layer)
                )
                * elt
            ),
            "parameter_bytes": parameter_bytes(model),
            "prefill": [],
            "decode": [],
        }
        if check:
            row["check"] = check_against_single_process(full, model)
            del full
        for mode in modes:
            run_mode = mode
            if mode == "table":  # EG-MLA-A: each rank precomputes the gate of its heads for every token
                from kvlm.attention.eg_mla import precompute_gate_tables

                precompute_gate_tables(model, True)
                run_mode = "auto"
            for b in batch:
                for p in prompt:
                    r = bench_prefill(model, b, p, "naive" if mode == "naive" else "auto", 1, repeats)
                    row["prefill"].append({"mode": mode, "batch": b, "prompt": p, **r})
                for c in context:
                    r = bench_decode(model, b, c, run_mode, warmup, steps)
                    row["decode"].append({"mode": mode, "batch": b, "context": c, **r})
            if mode == "table":
                precompute_gate_tables(model, False)
        rows.extend(r for r in _gather(row, ctx))
        if ctx.is_main:
            _log_tp_rows(rows[-ctx.world :], log)
        del model
    return rows


def _log_tp_rows(rows: list[dict], log) -> None:
    r0 = rows[0]
    how = "tp" if r0.get("attention_parallel", "tp") == "tp" else "dp-attention"
    log(
        f"{r0['variant']} ({how}={r0['tp']}, {r0['attention']}): KV bytes/token per rank "
        f"{[r['kv_bytes_per_token'] for r in rows]} (kv-table per device {r0['kv_table_bytes_per_token']}), "
        f"weights per rank {[round(r['parameter_bytes'] / 2**20, 1) for r in rows]} MiB"
    )
    if "check" in r0:
        log(
            f"  vs one process: max |logit diff| {max(r['check']['max_logit_diff'] for r in rows):.2e}, "
            f"same greedy tokens: {all(r['check']['same_tokens'] for r in rows)}"
        )
    for i, d in enumerate(r0["decode"]):
        slowest = max(r["decode"][i]["median_ms"] for r in rows)
        log(
            f"  decode {d['mode']:8s} B={d['batch']:<3d} L={d['context']:<6d} {slowest:9.2f} ms/token "
            f"({d['batch'] * (r0['tp'] if how != 'tp' else 1) / slowest * 1e3:.1f} tokens/s, all ranks)"
        )
    for i, p in enumerate(r0["prefill"]):
        slowest = max(r["prefill"][i]["median_ms"] for r in rows)
        log(f"  prefill {p['mode']:7s} B={p['batch']:<3d} T={p['prompt']:<6d} {slowest:9.2f} ms")


def bench_main(args, plan) -> int:
    """`kvlm bench --tp N` (kvlm.bench.run hands its parsed plan over): every variant sharded N ways."""
    ctx = tp_setup(args.tp, str(plan.device) if plan.device.type == "cpu" else None)
    if plan.device.type == "cpu" and args.threads is None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ctx.world))
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
    if ctx.is_main:
        log(f"tensor-parallel bench: {ctx.world} ranks on {ctx.device} ({dist.get_backend()})")
    variants = [(v.label, v.cfg, v.modes) for v in plan.variants]
    rows = tp_bench(
        variants,
        ctx,
        plan.batch,
        plan.context,
        plan.prompt,
        plan.steps,
        plan.warmup,
        plan.repeats,
        plan.dtype,
        plan.seed,
        check=getattr(args, "check", False),
        log=log,
    )
    result = {"kvlm_bench": 1, "tp": ctx.world, "device": str(ctx.device), "rows": rows}
    if args.out and ctx.is_main:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.json:
        print(json.dumps(result))
    dist.barrier()
    return 0


# --- embedding parallelism: the Table 6 comparison ----------------------------------------------------


def embedding_parallel_bench(
    cfg, mode: str, ctx: TPContext, batch=4, seq=128, steps=5, warmup=2, lr=1e-4, seed=0
) -> dict:
    """DDP training steps of an EG-MLA model, "vanilla" (every rank holds every gate table) or
    "dimension-wise" (each holds a 1/W column slice, eg-mla.md Eqs. 9-11). Per rank: parameter, gradient
    and AdamW-state bytes, peak memory (CUDA allocator, or the process's peak RSS on CPU), step time and the
    time in the gate exchange; throughput counts every rank's tokens (eg-mla.md Table 6's columns)."""
    import resource

    import torch.nn.functional as F

    from kvlm.model import build_model

    if mode not in ("vanilla", "dimension-wise"):
        raise ConfigError(f"mode must be 'vanilla' or 'dimension-wise', got {mode!r}")
    device = ctx.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)
    model = build_model(cfg, device=device).train()
    exchange = None
    if mode == "dimension-wise" and ctx.world > 1:
        shard_gate_embeddings(model, ctx.rank, ctx.world)
        exchange = next(m.exchange for m in model.modules() if isinstance(m, ShardedGateEmbedding))
        exchange.timing = True
    net = wrap_ddp(model, device) if ctx.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator(device=device).manual_seed(seed + 1 + ctx.rank)
    times, comm = [], []
    grad_bytes = 0
    for i in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen, device=device)
        if exchange is not None:
            exchange.comm_seconds = 0.0
        _sync(device)
        t0 = time.perf_counter()
        logits = net(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        grad_bytes = sum(
            p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            comm.append(exchange.comm_seconds if exchange is not None else None)
    state_bytes = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    gate = sum(
        p.numel() * p.element_size() for p in model.parameters() if getattr(p, "is_gate_embedding", False)
    )
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    peak = (
        torch.cuda.max_memory_allocated(device)
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    return {
        "mode": mode,
        "workers": ctx.world,
        "rank": ctx.rank,
        "parameter_bytes": parameter_bytes(model),
        "gate_table_bytes": gate,
        "gradient_bytes": grad_bytes,
        "optimizer_state_bytes": state_bytes,
        "model_state_bytes": parameter_bytes(model) + grad_bytes + state_bytes,
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
        "step_ms": step_ms,
        "comm_ms": None if exchange is None else 1e3 * sorted(comm)[len(comm) // 2],
        "throughput_tokens_per_s": ctx.world * batch * seq / (step_ms / 1e3),
        "loss": loss.item(),
    }


def _model_config(preset: str, overrides: list[str]):
    from kvlm.config import ModelConfig, load_yaml_or_json

    changes = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        k, v = item.split("=", 1)
        changes[k.strip()] = load_yaml_or_json(f"v: {v}")["v"]
    from kvlm.attention import registry

    if preset in registry():
        return ModelConfig(attention=preset, **changes)
    cfg = ModelConfig.from_preset(preset)
    if "n_head" in changes:  # re-derive what follows from the changed shape unless given
        changes.setdefault("n_kv_head", None)
    if "d_model" in changes:
        changes.setdefault("ffn_dim", None)
    return cfg.replace(**changes) if changes else cfg


def embedding_parallel_table(
    workers=(1, 2, 4), modes=("vanilla", "dimension-wise"), bench_args=(), log=print
) -> list[dict]:
    """Run embedding-parallel-bench under torchrun for each worker count and mode; one row per run with
    the per-rank maximum of memory and time (the busiest rank, as the paper's Table 6 reports per node)."""
    import subprocess

    rows = []
    for w in workers:
        for mode in modes:
            if w == 1 and mode == "dimension-wise":
                continue  # nothing to shard
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={w}",
                "-m",
                "kvlm.parallel.tensor_parallel",
                "embedding-parallel-bench",
                "--mode",
                mode,
                "--json",
                *bench_args,
            ]
            env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // w)))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                first = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()][:3]
                raise RuntimeError(f"{' '.join(cmd)} failed: {' / '.join(first) or proc.stderr[-2000:]}")
            ranks = json.loads(proc.stdout.strip().splitlines()[-1])["ranks"]
            row = {"mode": mode, "workers": w}
            for k in (
                "parameter_bytes",
                "gate_table_bytes",
                "model_state_bytes",
                "peak_memory_bytes",
                "step_ms",
            ):
                row[k] = max(r[k] for r in ranks)
            comm = [r["comm_ms"] for r in ranks if r["comm_ms"] is not None]
            row["comm_ms"] = max(comm) if comm else None
            row["throughput_tokens_per_s"] = min(r["throughput_tokens_per_s"] for r in ranks)
            row["peak_memory_kind"] = ranks[0]["peak_memory_kind"]
            rows.append(row)
            log(_ep_line(row))
    return rows


def _ep_line(r: dict) -> str:
    comm = f"{r['comm_ms']:.2f}" if r.get("comm_ms") is not None else "-"
    return (
        f"{r['mode']:15s} {r['workers']:>7d} {r['parameter_bytes'] / 2**20:12.1f} {r['model_state_bytes'] / 2**20:14.1f} "
        f"{r['peak_memory_bytes'] / 2**20:12.1f} {r['throughput_tokens_per_s']:12.0f} {r['step_ms']:10.2f} {comm:>9s}"
    )


EP_HEADER = (
    f"{'method':15s} {'workers':>7s} {'params MiB':>12s} {'states MiB':>14s} {'peak MiB':>12s} "
    f"{'tokens/s':>12s} {'step ms':>10s} {'comm ms':>9s}"
)


def _bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--preset",
        default="eg-mla-base/eg-mla-base-emb512",
        help="preset or attention name (default: eg-mla.md's Base model with 512-wide gate tables)",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvlm.parallel.tensor_parallel", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("tp-bench", help="tensor-parallel decode bench and per-rank KV (under torchrun)")
    p.add_argument(
        "--variants",
        default="mha,gqa,mla,gla-2,gta,mlra-2,mlra-4,tpa,mfa,eg-mla",
        help="attentions or presets, comma-separated",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--check", action="store_true", help="also compare greedy decoding with one process")
    p.add_argument(
        "--dp-attention",
        action="store_true",
        help="data-parallel attention: every rank decodes its own --batch requests, FFN sharded",
    )
    p.add_argument("--json", action="store_true")
    p = sub.add_parser(
        "embedding-parallel-bench", help="one Table 6 run: DDP training steps (under torchrun)"
    )
    _bench_options(p)
    p.add_argument("--mode", choices=["vanilla", "dimension-wise"], default="dimension-wise")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser(
        "embedding-parallel-table", help="eg-mla.md Table 6: vanilla vs dimension-wise, launching torchrun"
    )
    _bench_options(p)
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    p.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except ConfigError as e:
        print(f"kvlm.parallel.tensor_parallel {args.command}: error: {e}", file=sys.stderr)
        return 1
    finally:
        _shutdown()


def _main(args) -> int:
    if args.command == "embedding-parallel-table":
        passed = [
            "--preset",
            args.preset,
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        passed += [x for s in args.set for x in ("--set", s)] + (
            ["--device", args.device] if args.device else []
        )
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
        log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
        log(EP_HEADER)
        rows = embedding_parallel_table(workers, bench_args=passed, log=log)
        if args.json:
            print(json.dumps({"rows": rows}))
        return 0
    ctx = init_tp(device=args.device)
    if ctx.device.type == "cpu":
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", 1))))
    if args.command == "embedding-parallel-bench":
        cfg = _model_config(args.preset, args.set)
        if cfg.attention != "eg-mla":
            raise ConfigError(
                f"embedding parallelism shards eg-mla's gate tables; {args.preset} is {cfg.attention}"
            )
        row = embedding_parallel_bench(cfg, args.mode, ctx, args.batch, args.seq, args.steps, args.warmup)
        rows = _gather(row, ctx)
        if ctx.is_main:
            if args.json:
                print(json.dumps({"ranks": rows}))
            else:
                print(EP_HEADER)
                for r in rows:
                    print(_ep_line(r))
    else:  # tp-bench
        variants = []
        for name in args.variants.split(","):
            cfg = _model_config(name.strip(), args.set)
            variants.append((name.strip(), cfg, ["auto"]))
        log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else print
        rows = tp_bench(
            variants,
            ctx,
            (args.batch,),
            (args.context,),
            (args.prompt,),
            args.steps,
            1,
            2,
            getattr(torch, args.dtype),
            check=args.check,
            log=log if ctx.is_main else (lambda *a: None),
            attention="dp" if args.dp_attention else "tp",
        )
        if ctx.is_main and args.json:
            print(json.dumps({"tp": ctx.world, "rows": rows}))
    if dist.is_initialized():
        dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
