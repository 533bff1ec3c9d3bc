"""The mechanism-specific tensor-parallel sharders (mlra.md Sec. 3.4, Table 1): how each attention's weights split.

Each sharder takes (attention module, rank, world) and returns (inner shard module, plan dict): a module of the
mechanism's own class built from a per-rank config (kvlm.parallel.slicing.local_config), holding the rank's slice of
the full layer's weights, and a plan saying which query heads / KV heads / latent blocks the rank holds.
``SHARDERS`` maps an attention name to its sharder. kvlm.parallel.tensor_parallel wraps the shard (TPAttention)
and sums the ranks' partial W_O outputs.

How each mechanism splits (as its paper deploys it):
MHA/MQA/GQA by KV head, GTA by group (beyond g ranks a KV head / group is replicated and its query heads
split); MLA and EG-MLA by query head with the latent cache (c_kv, k_rope) replicated on every rank, as
FlashMLA deploys it (the redundancy MLRA criticises); MFA by query head, its one K/V head replicated; TPA by
coefficient (A^K, A^V columns of the rank's heads), the shared factors replicated; GLA-2/4 by latent head;
MLRA-2/4 by latent block, the branches of a head summed by the all-reduce (Eqs. 5-6). k_rope is replicated
wherever it exists.

These address parameters by name; they stay together in this one file until each mechanism declares its own
tensor-parallel plan.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kvlm.config import ConfigError
from kvlm.parallel.collectives import all_reduce_sum
from kvlm.parallel.slicing import Rule, build_shard, local_config, slice_state


def _rng(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


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
    """By query head, as FlashMLA: the rank's heads' rows of wq / wq_b ([W^UQ_i; W^QR_i]) and wkv_b
    ([W^UK_i; W^UV_i]) and W^O columns; the down-projections and the whole latent cache (c_kv, k_rope) on every
    rank (mlra.md Sec. 3.4).

    EG-MLA the same way, with the rank's heads' rows of wkv_b (W^UKV) and W^UE (2 d_h per head, Listing 1) and the
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
    per_head = {"wq": dh + dr, "wq_b": dh + dr, "wkv_b": 2 * dh}
    per_head.update({"emb_gate.w_ue": 2 * dh, "ln_emb": 2 * dh})  # eg-mla
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
    # wkv_b (n_blocks, r 2 d_h, d_lat): the rank's blocks, and within each the rows [W^UK; W^UV] of its heads
    rules["wkv_b.weight"] = lambda t: (
        t.view(nb, r, 2 * dh, d_lat)[bl.to(t.device)][:, wi.to(t.device)].reshape(len(blocks), -1, d_lat)
    )
    shard_cls = type(
        f"{type(attn).__name__}Shard", (type(attn),), {"n_groups": G_loc, "blocks_per_group": bpg_loc}
    )
    local = local_config(cfg, n_head=G_loc * len(within), kv_lora_rank=len(blocks) * d_lat)
    inner = build_shard(shard_cls, local, attn.layer_idx, attn, slice_state(attn, rules, rank))
    inner.alpha_attn = attn.alpha_attn  # Eq. 10 scales by the full branch count, not the rank's
    inner.alpha_kv = attn.alpha_kv  # sqrt(d / d_lat): unchanged, d_lat is the same
    return inner, {"latent_blocks": blocks, "query_heads": heads, "k_rope": "replicated"}
