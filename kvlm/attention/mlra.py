"""GLA-2/4 (Zadouri et al.; mlra.md Sec. 2.2, App. C.6) and MLRA-2/4 (mlra.md Sec. 3): latent-block attention.

All four share MLA's query path (App. C.3: optional low-rank query d'_c with RMSNorm and alpha_q, decoupled RoPE
query of d_h^R per head) and cache what MLA caches, d_c + d_h^R per token per layer: the KV latent, split into
``n_blocks`` blocks c_kv (n_blocks, d_c / n_blocks), each with its own RMSNorm, and one RoPE key k_rope shared by
every head and block. They differ in which heads a block serves and how the outputs combine:

    name    blocks  heads per block r   block b serves        output of head i
    gla-g   g       h / g               head group b          one softmax over its block         (App. C.6)
    mlra-4  4       h                   all heads             sum of 4 branch softmaxes          (Eq. 5)
    mlra-2  4       h / 2               head group b // 2     sum of 2 branch softmaxes          (Eq. 6)

One code path serves all of them. A (block, head) pair is a *unit*: unit u = b * r + j is head (b // bpg) * r + j
(bpg = blocks per head group) attending over block b; each unit is an MLA head over a latent of d_c / n_blocks, and
the output of head i sums the units of its group (times alpha_attn = 1/sqrt(bpg), Eq. 10, under attn_out_scaling).

Up-projections are stored per unit, in the layout weight absorption reads: w_uk[b, j] = (W^UK_(b),(i))^T (d_h, d_lat)
and w_uv[b, j] = W^UV_(b),(i) (d_lat, d_h). The absorbed decode therefore multiplies by the parameters themselves:
there is no derived weight to prepare per step, nor one that can go stale when the weights change.

Routes (``Step.mode``): "expand" re-expands the cached latent into per-unit K/V and runs SDPA (prefill, training);
"absorbed" folds W_UK into the query and W_UV after attention, so attention runs MQA-style over each block's latent
(mlra.md Sec. 2.1 Steps 1-3, per block); "naive" caches the materialised per-unit K/V; "auto" absorbs when decoding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention import register
from kvlm.attention.base import Attention, Linear, Step, attend, require
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.cache import CacheError
from kvlm.config import ModelConfig

# "auto" absorbs when a call appends at most this many tokens to a cache (decode, speculative chunks); longer
# prefills expand the latent once instead (absorption costs d_c / n_blocks per query and cached token, expansion
# d_h per query and cached token plus re-expanding every cached token once).
ABSORB_MAX_NEW = 16


def split_score_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_rope: torch.Tensor | None,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """softmax(scale * (q k^T + q_rope k_rope^T)) v, reading k, k_rope and v in place.

    q (B, Hk, R, T, D): R query rows per key head; k (B, Hk, S, D); v (B, Hk, S, Dv) (may be k itself, as for an
    absorbed latent); q_rope (B, G * R, T, d_R) with G dividing Hk: one RoPE query per query head, shared by the
    Hk / G key heads of its group (the branches of MLRA); k_rope (B, S, d_R), shared by every head.
    Returns (B, Hk, R, T, Dv). Splitting the logits this way means the cached latent and RoPE key are never
    concatenated into one key tensor, which would copy the whole cache on every step."""
    B, Hk, R, T, D = q.shape
    S = k.shape[-2]
    scores = torch.matmul(q.reshape(B, Hk, R * T, D), k.transpose(-1, -2))  # (B, Hk, R*T, S)
    if q_rope is not None:
        G = q_rope.shape[1] // R
        rope_scores = torch.matmul(q_rope.reshape(B, G * R * T, -1), k_rope.transpose(-1, -2))
        scores = scores.view(B, G, Hk // G, R, T, S) + rope_scores.view(B, G, 1, R, T, S)
    scores = scores.view(B, Hk, R, T, S).mul_(scale)
    visible = step.visible(T, S, q.device)
    if visible is not None:
        scores = scores.masked_fill_(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(B, Hk, R * T, S), v)
    return out.view(B, Hk, R, T, v.shape[-1])


class BlockRMSNorm(nn.Module):
    """RMSNorm of each latent block on its own (one weight row per block): x (..., n_blocks, dim)."""

    def __init__(self, n_blocks: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_blocks, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight


class LatentQueryMixin:
    """MLA's query path (App. C.3): C^Q = alpha_q RMSNorm(H W^DQ), [Q^NoPE, Q^RoPE] = C^Q W^UQ (W^UQ and W^QR
    stacked per head), or a plain W_Q when q_lora_rank = 0."""

    def make_query(self, cfg: ModelConfig) -> None:
        width = cfg.n_head * (cfg.head_dim + cfg.rope_head_dim)
        self.q_norm = None
        if cfg.q_lora_rank:
            self.wq_a = Linear(cfg.d_model, cfg.q_lora_rank, bias=cfg.bias)  # W^DQ
            if cfg.latent_norm:
                self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = Linear(cfg.q_lora_rank, width, bias=cfg.bias)  # [W^UQ_i, W^QR_i] per head i
            self.alpha_q = math.sqrt(cfg.d_model / cfg.q_lora_rank) if cfg.latent_scaling else 1.0
        else:
            self.wq = Linear(cfg.d_model, width, bias=cfg.bias)

    def query(self, x: torch.Tensor, rope_cs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> Q^NoPE (B, h, T, d_h), RoPE'd Q^RoPE (B, h, T, d_h^R) or None."""
        cfg = self.cfg
        B, T, _ = x.shape
        if cfg.q_lora_rank:
            c_q = self.wq_a(x)
            if self.q_norm is not None:
                c_q = self.q_norm(c_q)
            q = self.wq_b(c_q * self.alpha_q if self.alpha_q != 1.0 else c_q)
        else:
            q = self.wq(x)
        q = q.view(B, T, cfg.n_head, cfg.head_dim + cfg.rope_head_dim).transpose(1, 2)
        if not cfg.rope_head_dim:
            return q, None
        q_nope, q_rope = q.split([cfg.head_dim, cfg.rope_head_dim], dim=-1)
        return q_nope, apply_rope(q_rope, *rope_cs)


class LatentBlockAttention(LatentQueryMixin, Attention):
    """The shared latent-block mechanism; subclasses fix the head groups and blocks per group."""

    n_groups: int = 1  # G: head groups (GLA's g; 1 for MLRA-4, 2 for MLRA-2)
    blocks_per_group: int = 1  # bpg: latent blocks (= branches) per head group
    has_naive_cache = True

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h, dh, dr, dc = cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.kv_lora_rank
        self.G, self.bpg = self.n_groups, self.blocks_per_group
        self.n_blocks = self.G * self.bpg
        self.r = h // self.G  # heads per block
        self.n_units = self.n_blocks * self.r
        self.d_lat = dc // self.n_blocks
        self.make_query(cfg)
        self.wkv_a = Linear(cfg.d_model, dc + dr, bias=cfg.bias)  # [W^DKV (blocks in order), W^KR]
        self.kv_norm = BlockRMSNorm(self.n_blocks, self.d_lat, cfg.norm_eps) if cfg.latent_norm else None
        self.w_uk = nn.Parameter(torch.empty(self.n_blocks, self.r, dh, self.d_lat))
        self.w_uv = nn.Parameter(torch.empty(self.n_blocks, self.r, self.d_lat, dh))
        # alpha_kv = sqrt(d / d_lat): GLA's sqrt(g d / d_c) (C.6) and MLRA's sqrt(4 d / d_c) (Eq. 9)
        self.alpha_kv = math.sqrt(cfg.d_model / self.d_lat) if cfg.latent_scaling else 1.0
        self.alpha_attn = 1.0 / math.sqrt(self.bpg) if cfg.attn_out_scaling else 1.0  # Eq. 10
        self.scale = 1.0 / math.sqrt(dh + dr)  # tau
        self.rope = RotaryEmbedding(dr, cfg.max_seq_len, cfg.rope_theta) if dr else None
        self.make_output(h * dh)
        self.reset_extra_parameters()

    def reset_extra_parameters(self) -> None:
        nn.init.normal_(self.w_uk, 0.0, self.cfg.init_std)
        nn.init.normal_(self.w_uv, 0.0, self.cfg.init_std)

    # --- configuration ----------------------------------------------------------------------
    @classmethod
    def _blocks(cls, cfg: ModelConfig) -> int:
        return cls.n_groups * cls.blocks_per_group

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        nb = cls._blocks(cfg)
        require(
            cfg.kv_lora_rank > 0 and cfg.kv_lora_rank % nb == 0,
            f"{cfg.attention} splits kv_lora_rank (d_c) into {nb} latent blocks: "
            f"kv_lora_rank={cfg.kv_lora_rank} must be a positive multiple of {nb}",
        )
        require(
            cfg.n_head % cls.n_groups == 0,
            f"{cfg.attention} splits the heads into {cls.n_groups} groups: "
            f"n_head={cfg.n_head} is not divisible by {cls.n_groups}",
        )
        require(
            cfg.kv_latent == "joint",
            f"{cfg.attention} up-projects keys and values from one latent: kv_latent must be 'joint', "
            f"got {cfg.kv_latent!r}",
        )

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        nb = cls._blocks(cfg)
        if naive:  # materialised per-unit keys and values (h units for GLA, 2h for MLRA-2, 4h for MLRA-4)
            units = cls.blocks_per_group * cfg.n_head
            return {"k": (units, cfg.head_dim + cfg.rope_head_dim), "v": (units, cfg.head_dim)}
        spec = {"c_kv": (nb, cfg.kv_lora_rank // nb)}
        if cfg.rope_head_dim:
            spec["k_rope"] = (cfg.rope_head_dim,)
        return spec

    @classmethod
    def tp_shards(cls, cfg):
        # each block's heads live on the device that holds the block: only k_rope is loaded by every device
        return {"c_kv": "blocks", "k_rope": "replicated"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return cls._blocks(cfg)

    # --- pieces -------------------------------------------------------------------------------
    def latent(self, x: torch.Tensor, rope_cs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> C^KV blocks (B, n_blocks, T, d_lat) (normed and scaled: what is cached and
        up-projected) and the RoPE'd shared key k_rope (B, T, d_h^R) or None."""
        B, T, _ = x.shape
        dc = self.cfg.kv_lora_rank
        kv = self.wkv_a(x)
        c = kv[..., :dc].reshape(B, T, self.n_blocks, self.d_lat)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        if self.alpha_kv != 1.0:
            c = c * self.alpha_kv
        k_rope = None
        if self.rope is not None:
            k_rope = apply_rope(kv[..., dc:][:, None], *rope_cs)[:, 0]
        return c.transpose(1, 2), k_rope

    def to_units(self, t: torch.Tensor) -> torch.Tensor:
        """Per-head tensor (B, h, T, D) -> per-unit (B, n_blocks, r, T, D): head (b // bpg) * r + j for unit (b, j)."""
        B, _, T, D = t.shape
        t = t.view(B, self.G, 1, self.r, T, D).expand(B, self.G, self.bpg, self.r, T, D)
        return t.reshape(B, self.n_blocks, self.r, T, D)

    def expand_kv(self, c: torch.Tensor, k_rope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """C^KV blocks (B, n_blocks, S, d_lat) -> per-unit K (B, U, S, d_h + d_h^R) and V (B, U, S, d_h)."""
        B, nb, S, _ = c.shape
        k = torch.einsum("bnsl,nrpl->bnrsp", c, self.w_uk)  # K^NoPE_(b),i = C_b W^UK_(b),i
        v = torch.einsum("bnsl,nrlp->bnrsp", c, self.w_uv)
        if k_rope is not None:
            k = torch.cat([k, k_rope[:, None, None].expand(B, nb, self.r, S, k_rope.shape[-1])], dim=-1)
        return k.reshape(B, self.n_units, S, -1), v.reshape(B, self.n_units, S, -1)

    def absorbed(self, q_nope, q_rope, c, k_rope, step) -> torch.Tensor:
        """Attention per unit without materialising K/V (Sec. 2.1 Steps 1-3, block by block) -> (B, U, T, d_h)."""
        B, _, T, _ = q_nope.shape
        # Step 1: q~_(b),i = Q^NoPE_i (W^UK_(b),i)^T, one latent-space query per unit
        q_lat = torch.einsum("bnrtp,nrpl->bnrtl", self.to_units(q_nope), self.w_uk)
        # Step 2: MQA-style attention of the r units of block b over [c_b, k_rope]; the RoPE logits are computed
        # once per head and shared by its bpg branches
        z = split_score_attention(q_lat, c, c, q_rope, k_rope, step, self.scale)
        # Step 3: O_(b),i = Z_(b),i W^UV_(b),i
        o = torch.einsum("bnrtl,nrlp->bnrtp", z, self.w_uv)
        return o.reshape(B, self.n_units, T, -1)

    def combine(self, o: torch.Tensor) -> torch.Tensor:
        """Per-unit outputs (B, U, T, d_h) -> per-head (B, h, T, d_h): sum each head's branches (Eq. 5, 6)."""
        B, _, T, D = o.shape
        if self.bpg > 1:
            o = o.view(B, self.G, self.bpg, self.r, T, D).sum(dim=2)
        o = o.reshape(B, self.cfg.n_head, T, D)
        return o * self.alpha_attn if self.alpha_attn != 1.0 else o

    def route(self, step: Step, cache) -> str:
        naive_cache = cache is not None and "k" in cache
        mode = step.mode
        if naive_cache:
            if mode not in ("auto", "naive"):
                raise CacheError(
                    f"mode={mode!r} needs the compact cache; this one is naive (materialised K/V)"
                )
            return "naive"
        if mode == "naive":
            if cache is not None:
                raise CacheError(
                    "mode='naive' needs the materialised cache: model.new_cache(..., naive=True)"
                )
            return "expand"  # without a cache, naive and expand are the same computation
        if mode == "auto":
            return "absorbed" if cache is not None and step.n_new <= ABSORB_MAX_NEW else "expand"
        return mode

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: Step, cache=None) -> torch.Tensor:
        rope_cs = self.rope.cos_sin(step.positions, x.dtype) if self.rope is not None else None
        q_nope, q_rope = self.query(x, rope_cs)
        c, k_rope = self.latent(x, rope_cs)
        route = self.route(step, cache)
        if route == "naive":
            k, v = self.expand_kv(c, k_rope)
            k = self.write(cache, "k", k, step)
            v = self.write(cache, "v", v, step)
        else:
            if cache is not None:
                c = self.write(cache, "c_kv", c, step)
                if k_rope is not None:
                    k_rope = self.write(cache, "k_rope", k_rope, step)
            if route == "absorbed":
                return self.output(self.combine(self.absorbed(q_nope, q_rope, c, k_rope, step)), x)
            k, v = self.expand_kv(c, k_rope)
        q = q_nope if q_rope is None else torch.cat([q_nope, q_rope], dim=-1)
        B, _, T, D = q.shape
        o = attend(self.to_units(q).reshape(B, self.n_units, T, D), k, v, step, self.scale)
        return self.output(self.combine(o), x)


@register("gla-2")
class GLA2(LatentBlockAttention):
    name = "gla-2"
    n_groups, blocks_per_group = 2, 1


@register("gla-4")
class GLA4(LatentBlockAttention):
    name = "gla-4"
    n_groups, blocks_per_group = 4, 1


@register("mlra-2")
class MLRA2(LatentBlockAttention):
    name = "mlra-2"
    n_groups, blocks_per_group = 2, 2


@register("mlra-4")
class MLRA4(LatentBlockAttention):
    name = "mlra-4"
    n_groups, blocks_per_group = 1, 4
