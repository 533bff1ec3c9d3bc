"""The latent-attention family: one base for MLA, GLA-2/4, MLRA-2/4 and EG-MLA (mlra.md Sec. 2-3, App. C.3, C.6;
DeepSeek-V2 App. C; eg-mla.md).

Symbols: d = d_model, h heads of d_h (+ d_h^R decoupled RoPE dims), d_c = kv_lora_rank, d'_c = q_lora_rank,
n_R = rope_kv_heads. Each token is compressed into a latent that is cached, d_c + n_R d_h^R per layer (2 d_c + ...
with the small-LM paper's separate key and value latents). GLA and MLRA split the latent into ``n_blocks`` blocks
of d_lat = d_c / n_blocks. A *unit* is a (block, head) pair: unit u = b r + j is head (b // bpg) r + j attending
over block b (r heads per block, bpg blocks per head group: MLRA's branches); MLA has one block and h units, its
heads. Per unit the attention is MLA's: keys [k^C_u; k^R], values v^C_u, both linear in the block's latent.

Parameters, in DeepSeek-V3's names (the field's lingua franca) and fused as its inference code fuses them:

    wq      d -> h (d_h + d_h^R)          q_lora_rank = 0; the rows of head i are [q^C_i; q^R_i]
    wq_a    d -> d'_c                      W^DQ                 (q_lora_rank > 0)
    q_norm  RMSNorm(d'_c)                  with cfg.latent_norm
    wq_b    d'_c -> h (d_h + d_h^R)        rows of head i: [W^UQ_i; W^QR_i]
    wkv_a   d -> n_lat d_c + n_R d_h^R     rows [W^DKV (its blocks in order); W^KR], or [W^DK; W^DV; W^KR] (separate)
    kv_norm RMSNorm of each latent block   weight (d_c,) for one latent, (n_blocks, d_lat) for blocks, (2, d_c)
                                           for separate key and value latents; with cfg.latent_norm
    wkv_b   up-projection, rows of unit u: [W^UK_u (d_h); W^UV_u (d_h)]: a Linear d_c -> h 2 d_h for one latent
            (DeepSeek's wkv_b, EG-MLA's W^UKV), a BlockLinear (n_blocks, r 2 d_h, d_lat) without bias for blocks
            (``block_layout``: GLA / MLRA, also a tensor-parallel shard holding one of their blocks)
    wo, gate                               Attention.make_output

``up_weights()`` gives W^UK and W^UV as (n_blocks, r, d_h, d_lat) views of wkv_b. ``upgrade_state_dict`` renames
and fuses the parameters of checkpoints written before this layout (w_dq, w_uq, w_qr, w_dkv, w_kr, w_uk, w_uv,
w_ukv, ...); it runs as a load_state_dict pre-hook, so every loader upgrades old checkpoints.

Routes (``route``, the one place a mode is resolved; ``step.trace`` records the route taken):
- "expand": up-project the (cached) latents to per-unit keys and values through the hook ``keys_values``, attend.
- "absorbed" (mlra.md Sec. 2.1 Steps 1-3): W^UK folded into the query and W^UV after attention, attention runs in
  latent space over the cache in place (``forward_absorbed``, per subclass). Only where ``supports_absorption``.
- "naive" (traced as "materialised"): write materialised per-unit K/V to the naive cache
  (``cache_spec(naive=True)``), attend over them.
- "auto": naive on a naive cache, expand without a cache, else ``prefers_absorbed``: the one rule of the family,
  by arithmetic: per new token and cached token a unit costs 2 d_lat + d_h^R multiply-adds absorbed against
  2 d_h + d_h^R expanded, and expanding costs 2 d_lat d_h per cached token once per call. Absorbed wins while
  T (d_lat - d_h) < d_lat d_h; it is also required that the new queries are few against the cache
  (absorb_ratio T <= S), so a first prefill (T = S) takes the large GEMMs and SDPA's fused causal kernel.

Derived weights (MLA's absorbed weights, EG-MLA's gate tables) are built once by ``prepare_for_inference()``,
dropped when the module goes back to training or is moved/cast, and otherwise built on the fly (uncached).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention.base import MATERIALISED, Attention, Linear, Step, require
from kvlm.attention.latent_ops import attend_padded, attend_split, rope_keys_per_head
from kvlm.attention.norm import RMSNorm
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.cache import CacheError
from kvlm.config import ModelConfig, spec_numel


class BlockRMSNorm(nn.Module):
    """RMSNorm of each latent block on its own (one weight row per block): x (..., n_blocks, dim)."""

    def __init__(self, n_blocks: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n_blocks, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), None, self.eps) * self.weight


class BlockLinear(nn.Module):
    """One bias-free linear map per latent block: weight (n_blocks, out, in), x (B, n_blocks, S, in) ->
    (B, n_blocks, S, out). Initialised by the attention's ``reset_extra_parameters``."""

    def __init__(self, n_blocks: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_blocks, out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bnsi,noi->bnso", x, self.weight)


def _upgrade_hook(module, state_dict, prefix, *args) -> None:
    type(module).upgrade_state_dict(state_dict, prefix, module.cfg)
    module.release_prepared()  # new weights: derived ones built from the old would be stale


class LatentAttention(Attention):
    """Base of the latent family. Subclasses set the geometry (``n_groups``, ``blocks_per_group``), the absorbed
    route (``forward_absorbed``) and, where keys and values are not a linear up-projection of the latent (EG-MLA),
    the hook ``keys_values``."""

    has_naive_cache = True
    supports_absorption = True  # False: "absorbed" runs the expand route (EG-MLA: a LayerNorm after the gate)
    no_absorption_reason = ""
    n_groups: int = 1  # G: head groups (GLA's g; 2 for MLRA-2)
    blocks_per_group: int = 1  # bpg: latent blocks (= branches) per head group
    # per-block parameters (kv_norm (n_blocks, d_lat), wkv_b a BlockLinear) and cache (c_kv (n_blocks, d_lat)),
    # also for one block (a tensor-parallel shard of GLA / MLRA); False: MLA's single-latent layout
    block_layout: bool = False
    absorb_ratio = 4  # "auto" absorbs only while absorb_ratio * new tokens <= cached tokens
    absorb_fold = (
        "auto"  # MLA's weight folds in the absorbed route ("auto" | "none" | "all", MLA.fold_choice)
    )
    _warned_absorbed = False

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        d, h, dh, dr = cfg.d_model, cfg.n_head, cfg.head_dim, cfg.rope_head_dim
        dc, dq = cfg.kv_lora_rank, cfg.q_lora_rank
        self.n_head, self.head_dim, self.rope_head_dim = h, dh, dr
        self.rope_kv_heads = cfg.rope_kv_heads  # n_R
        self.kv_lora_rank, self.q_lora_rank = dc, dq
        self.separate = cfg.kv_latent == "separate"
        self.G, self.bpg = self.n_groups, self.blocks_per_group
        self.n_blocks = self.G * self.bpg
        self.r = h // self.G  # heads per block
        self.n_units = self.n_blocks * self.r
        self.d_lat = dc // self.n_blocks
        self.scale = 1.0 / math.sqrt(dh + dr)  # Eq. 46, tau
        self.alpha_q = math.sqrt(d / dq) if cfg.latent_scaling and dq else 1.0
        # alpha_kv = sqrt(d / d_lat): MLA's sqrt(d / d_c), GLA's sqrt(g d / d_c) (C.6), MLRA's sqrt(4 d / d_c) (Eq. 9)
        self.alpha_kv = math.sqrt(d / self.d_lat) if cfg.latent_scaling else 1.0
        self.alpha_attn = 1.0 / math.sqrt(self.bpg) if cfg.attn_out_scaling else 1.0  # Eq. 10
        bias, width = cfg.bias, h * (dh + dr)
        self.q_norm = None
        if dq:  # query path, Eqs. 37-40
            self.wq_a = Linear(d, dq, bias=bias)
            self.q_norm = RMSNorm(dq, eps=cfg.norm_eps) if cfg.latent_norm else None
            self.wq_b = Linear(dq, width, bias=bias)
        else:
            self.wq = Linear(d, width, bias=bias)
        n_lat = 2 if self.separate else 1  # latent path, Eqs. 41-45
        self.wkv_a = Linear(d, n_lat * dc + self.rope_kv_heads * dr, bias=bias)
        rows = n_lat * self.n_blocks
        self.kv_norm = None
        if cfg.latent_norm:
            eps = cfg.norm_eps
            single = rows == 1 and not self.block_layout
            self.kv_norm = RMSNorm(self.d_lat, eps=eps) if single else BlockRMSNorm(rows, self.d_lat, eps)
        if self.block_layout:
            self.wkv_b = BlockLinear(self.n_blocks, self.d_lat, self.r * 2 * dh)
        else:
            self.wkv_b = Linear(self.d_lat, self.n_units * 2 * dh, bias=bias)
        self.rope = RotaryEmbedding(dr, cfg.max_seq_len, cfg.rope_theta) if dr else None
        self.make_output(h * dh)
        self.register_load_state_dict_pre_hook(_upgrade_hook)

    def reset_extra_parameters(self) -> None:
        if self.block_layout:
            nn.init.normal_(self.wkv_b.weight, 0.0, self.cfg.init_std)

    # --- configuration ----------------------------------------------------------------------------
    @classmethod
    def _blocks(cls, cfg: ModelConfig) -> int:
        return cls.n_groups * cls.blocks_per_group

    @classmethod
    def _units(cls, cfg: ModelConfig) -> tuple[int, int]:
        """(units, latent width each unit attends over)."""
        return cls.blocks_per_group * cfg.n_head, cfg.kv_lora_rank // cls._blocks(cfg)

    @classmethod
    def decode_routes(cls, cfg: ModelConfig) -> dict[str, str]:
        return {"auto": "absorbed", "absorbed": "absorbed", "expand": "expand", "naive": MATERIALISED}

    @classmethod
    def decode_flops(cls, cfg: ModelConfig, layer_idx: int = 0) -> float:
        """Absorbed route: per unit, scores over d_lat + d_h^R and values over d_lat (mlra.md Table 2)."""
        units, d_lat = cls._units(cfg)
        return units * (4.0 * d_lat + 2.0 * cfg.rope_head_dim)

    @classmethod
    def decode_cost(
        cls, cfg: ModelConfig, batch: int, n_cached: int, route: str = "auto", layer_idx: int = 0
    ):
        """One decode step over ``n_cached`` tokens of ``batch`` sequences, the cache-proportional work only:
        absorbed reads the compact cache and attends in latent space; expand reads it and up-projects every
        cached token to per-unit K/V (2 d_lat 2 d_h per unit) before attending; naive reads materialised K/V."""
        route = cls.route_of(cfg, route)
        units, d_lat = cls._units(cfg)
        dh, dr = cfg.head_dim, cfg.rope_head_dim
        attend = 2.0 * units * (dh + dr) + 2.0 * units * dh
        flops = {
            "absorbed": cls.decode_flops(cfg, layer_idx),
            "expand": 2.0 * d_lat * units * 2 * dh + attend,
            MATERIALISED: attend,
        }
        spec = cls.spec_for(cfg, layer_idx, naive=route == MATERIALISED)
        tokens = batch * n_cached
        return {
            "flops": tokens * flops[route],
            "cache_elements": tokens * spec_numel(spec),
            "weight_elements": 0,
        }

    # --- routes -------------------------------------------------------------------------------------
    def prefers_absorbed(self, n_new: int, n_cached: int) -> bool:
        """The family's "auto" rule (module docstring): absorbed costs ~T U S (2 d_lat + d_R) multiply-adds,
        expand ~S U 2 d_lat d_h + T U S (2 d_h + d_R); absorbed wins while T (d_lat - d_h) < d_lat d_h, and only
        for few new tokens against the cache (absorb_ratio T <= S)."""
        if not self.supports_absorption:
            return False
        d_lat, dh = self.d_lat, self.head_dim
        cheaper = d_lat <= dh or n_new * (d_lat - dh) < d_lat * dh
        return cheaper and n_new * self.absorb_ratio <= n_cached

    def route(self, step: Step, cache) -> str:
        """ "absorbed", "expand" or "naive" for this call; a mode the cache cannot serve is a CacheError."""
        mode = step.mode
        if cache is not None and cache.naive:
            if mode not in ("auto", "naive"):
                raise CacheError(
                    f"mode={mode!r} needs the compact cache (model.new_cache(..., naive=False)); "
                    "this one is naive (materialised K/V)"
                )
            return "naive"
        if mode == "naive":
            if cache is not None:
                raise CacheError(
                    "mode='naive' needs the materialised cache: model.new_cache(..., naive=True)"
                )
            return "expand"  # without a cache, naive and expand are the same computation
        if mode == "absorbed" and not self.supports_absorption:
            if not type(self)._warned_absorbed:
                type(self)._warned_absorbed = True
                warnings.warn(
                    f"{self.name} has no absorbed route ({self.no_absorption_reason}); running the "
                    f"{self.route_label('expand')} route instead",
                    stacklevel=3,
                )
            return "expand"
        if mode == "auto":
            absorb = cache is not None and self.prefers_absorbed(step.n_new, step.end)
            return "absorbed" if absorb else "expand"
        return mode

    def route_label(self, route: str) -> str:
        """The name ``step.trace`` records for a route (EG-MLA calls its expand route "rebuild")."""
        return MATERIALISED if route == "naive" else route

    # --- query path ---------------------------------------------------------------------------------
    def cos_sin(self, step: Step, dtype: torch.dtype):
        """RoPE angles of the new tokens (None without RoPE), computed once per call for all layers."""
        return step.cos_sin(self.rope, dtype) if self.rope is not None else None

    def query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the query is a linear map of: c^Q = alpha_q RMSNorm(W^DQ x) (Eq. 37), or x itself."""
        if not self.q_lora_rank:
            return x
        c_q = self.wq_a(x)
        if self.q_norm is not None:
            c_q = self.q_norm(c_q)
        return c_q * self.alpha_q if self.alpha_q != 1.0 else c_q

    def query_weight(self) -> Linear:
        """The linear map c^Q (or x) -> per-head [q^C_i; q^R_i]: wq_b, or wq with q_lora_rank = 0."""
        return self.wq_b if self.q_lora_rank else self.wq

    def query(self, x: torch.Tensor, cs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x (B, T, d) -> q^C (B, h, T, d_h), RoPE'd q^R (B, h, T, d_h^R) or None (Eqs. 37-40)."""
        return self.query_from(self.query_input(x), cs)

    def query_from(self, c_q: torch.Tensor, cs) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = c_q.shape
        dh, dr = self.head_dim, self.rope_head_dim
        q = self.query_weight()(c_q).view(B, T, self.n_head, dh + dr).transpose(1, 2)
        if not dr:
            return q, None
        q_nope, q_rope = q.split([dh, dr], dim=-1)
        return q_nope, apply_rope(q_rope, *cs)

    # --- latent path --------------------------------------------------------------------------------
    def latents(self, x: torch.Tensor, cs) -> dict[str, torch.Tensor]:
        """x (B, T, d) -> the cache entries of the new tokens, keyed as ``cache_spec()``: c_kv (B, T, d_c) (c_k,
        c_v with separate latents; (B, n_blocks, T, d_lat) for blocks) = alpha_kv RMSNorm(W^DKV x) (Eq. 41) and
        k_rope (B, T, d_h^R) = RoPE(W^KR x) (Eq. 43), (B, n_R, T, d_h^R) with n_R > 1 RoPE key heads."""
        B, T, _ = x.shape
        dc, nb = self.kv_lora_rank, self.n_blocks
        n_lat = 2 if self.separate else 1
        kv = self.wkv_a(x)
        c = kv[..., : n_lat * dc]
        if self.block_layout or self.separate:
            c = c.reshape(B, T, n_lat * nb, self.d_lat)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        if self.alpha_kv != 1.0:
            c = c * self.alpha_kv
        if self.separate:
            out = {"c_k": c[:, :, 0], "c_v": c[:, :, 1]}
        else:
            out = {"c_kv": c.transpose(1, 2) if self.block_layout else c}
        if self.rope_head_dim:
            k_rope = kv[..., n_lat * dc :].view(B, T, self.rope_kv_heads, -1).transpose(1, 2)
            k_rope = apply_rope(k_rope, *cs)
            out["k_rope"] = k_rope[:, 0] if self.rope_kv_heads == 1 else k_rope
        return out

    def up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^UK, W^UV as (n_blocks, r, d_h, d_lat) views of wkv_b: unit (b, j)'s key is c_b W^UK[b, j]^T."""
        dh = self.head_dim
        w = self.wkv_b.weight.view(self.n_blocks, self.r, 2 * dh, self.d_lat)
        return w[:, :, :dh], w[:, :, dh:]

    def keys_values(self, lat: dict[str, torch.Tensor], step: Step, cached: bool):
        """The hook for how latents become keys and values: latents (of every cached token if ``cached``, else of
        the new tokens) -> per-unit k^C (B, U, S, d_h) and v^C (B, U, S, d_h) (Eqs. 42, 45): W^UK, W^UV."""
        dh = self.head_dim
        if self.separate:
            c_k, c_v = lat["c_k"], lat["c_v"]
            B, S, _ = c_k.shape
            w = self.wkv_b.weight.view(self.n_head, 2 * dh, -1)
            b = self.wkv_b.bias.view(self.n_head, 2 * dh) if self.wkv_b.bias is not None else None
            k = F.linear(
                c_k, w[:, :dh].reshape(-1, w.shape[-1]), b[:, :dh].reshape(-1) if b is not None else None
            )
            v = F.linear(
                c_v, w[:, dh:].reshape(-1, w.shape[-1]), b[:, dh:].reshape(-1) if b is not None else None
            )
            return k.view(B, S, -1, dh).transpose(1, 2), v.view(B, S, -1, dh).transpose(1, 2)
        c = lat["c_kv"]
        if not self.block_layout:
            B, S, _ = c.shape
            kv = self.wkv_b(c).view(B, S, self.n_units, 2 * dh).transpose(1, 2)
            return kv[..., :dh], kv[..., dh:]
        B, nb, S, _ = c.shape
        kv = self.wkv_b(c).view(B, nb, S, self.r, 2 * dh).transpose(2, 3)
        kv = kv.reshape(B, self.n_units, S, 2 * dh)
        return kv[..., :dh], kv[..., dh:]

    # --- units -------------------------------------------------------------------------------------
    def to_units(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """Per-head (B, h, T, D) -> per-unit (B, U, T, D): unit (b, j) reads head (b // bpg) r + j."""
        if t is None or self.bpg == 1:
            return t
        B, _, T, D = t.shape
        t = t.view(B, self.G, 1, self.r, T, D).expand(B, self.G, self.bpg, self.r, T, D)
        return t.reshape(B, self.n_units, T, D)

    def combine(self, o: torch.Tensor) -> torch.Tensor:
        """Per-unit outputs (B, U, T, d_h) -> per-head (B, h, T, d_h): sum each head's branches (Eq. 5, 6)."""
        B, _, T, D = o.shape
        if self.bpg > 1:
            o = o.view(B, self.G, self.bpg, self.r, T, D).sum(dim=2).reshape(B, self.n_head, T, D)
        return o * self.alpha_attn if self.alpha_attn != 1.0 else o

    # --- forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: Step, cache=None) -> torch.Tensor:
        route = self.route(step, cache)
        self.record_route(step, self.route_label(route))
        cs = self.cos_sin(step, x.dtype)
        if route == "absorbed":
            return self.forward_absorbed(x, step, cache, cs)
        q_nope, q_rope = self.query(x, cs)
        lat = self.latents(x, cs)
        if route == "naive":
            k, v = self.keys_values(lat, step, cached=False)
            if self.rope_head_dim:
                k = torch.cat([k, rope_keys_per_head(lat["k_rope"], self.n_units)], dim=-1)
            k, v = self.write(cache, "k", k, step), self.write(cache, "v", v, step)
            q = torch.cat([q_nope, q_rope], dim=-1) if q_rope is not None else q_nope
            return self.output(self.combine(attend_padded(self.to_units(q), k, v, step, self.scale)), x)
        lat = self.write_latents(lat, step, cache)  # expand: the whole cached latent to per-unit K/V
        k_nope, v = self.keys_values(lat, step, cached=cache is not None)
        q_nope, q_rope = self.to_units(q_nope), self.to_units(q_rope)
        o = attend_split(q_nope, q_rope, k_nope, lat.get("k_rope"), v, step, self.scale)
        return self.output(self.combine(o), x)

    def forward_absorbed(self, x: torch.Tensor, step: Step, cache, cs) -> torch.Tensor:
        """Attention in latent space (mlra.md Sec. 2.1 Steps 1-3); writes the new latents when given a cache."""
        raise NotImplementedError(f"{self.name} has no absorbed route: {self.no_absorption_reason}")

    def write_latents(self, lat: dict[str, torch.Tensor], step: Step, cache) -> dict[str, torch.Tensor]:
        """Append the new tokens' latents to the cache and return every cached token's (as is without a cache)."""
        if cache is None:
            return lat
        return {n: self.write(cache, n, t, step) for n, t in lat.items()}

    # --- derived weights -----------------------------------------------------------------------------
    def release_prepared(self) -> None:
        """Drop what prepare_for_inference built (subclasses that build something)."""

    def train(self, mode: bool = True):
        if mode:
            self.release_prepared()  # the weights are about to change
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.release_prepared()  # derived weights would keep the old dtype / device
        return super()._apply(fn, recurse)

    # --- checkpoints written before this layout --------------------------------------------------------
    @classmethod
    def upgrade_state_dict(cls, state: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig) -> None:
        """Rename and fuse, in place, the parameters under ``prefix`` of a checkpoint written before the
        DeepSeek names (MLA's w_dq / w_uq / w_qr / w_dkv / w_dk / w_dv / k_norm / v_norm / w_kr / w_uk / w_uv,
        EG-MLA's w_ukv, GLA / MLRA's w_uk / w_uv parameters). A state already in today's names is left as is."""
        h, dh = cfg.n_head, cfg.head_dim

        def pop(name):
            return state.pop(prefix + name, None)

        def per_head(*parts):  # [a_i; b_i] for each head i, parts (h * n_part, ...)
            parts = [p.reshape(h, -1, *p.shape[1:]) for p in parts if p is not None]
            return torch.cat(parts, dim=1).reshape(-1, *parts[0].shape[2:])

        for s in ("weight", "bias"):
            if prefix + f"w_dq.{s}" in state:
                state[prefix + f"wq_a.{s}"] = pop(f"w_dq.{s}")
            if prefix + f"w_uq.{s}" in state:
                state[prefix + f"wq_b.{s}"] = per_head(pop(f"w_uq.{s}"), pop(f"w_qr.{s}"))
            down = [pop(f"{n}.{s}") for n in ("w_dkv", "w_dk", "w_dv", "w_kr")]
            if any(t is not None for t in down):
                state[prefix + f"wkv_a.{s}"] = torch.cat([t for t in down if t is not None])
            if prefix + f"w_uk.{s}" in state:
                state[prefix + f"wkv_b.{s}"] = per_head(pop(f"w_uk.{s}"), pop(f"w_uv.{s}"))
            if prefix + f"w_ukv.{s}" in state:
                state[prefix + f"wkv_b.{s}"] = pop(f"w_ukv.{s}")
        if prefix + "k_norm.weight" in state:
            state[prefix + "kv_norm.weight"] = torch.stack([pop("k_norm.weight"), pop("v_norm.weight")])
        if prefix + "w_uk" in state:  # GLA / MLRA: (nb, r, d_h, d_lat) and (nb, r, d_lat, d_h) parameters
            w_uk, w_uv = pop("w_uk"), pop("w_uv")
            nb, r, _, d_lat = w_uk.shape
            w = torch.cat([w_uk, w_uv.transpose(-1, -2)], dim=2)
            state[prefix + "wkv_b.weight"] = w.reshape(nb, r * 2 * dh, d_lat)

    # --- tensor parallelism ------------------------------------------------------------------------------
    def tp_plan(self, rank: int, world: int) -> dict:
        """By query head, as FlashMLA (mlra.md Sec. 3.4): the rank's heads' rows of wq / wq_b ([W^UQ_i; W^QR_i]) and
        wkv_b ([W^UK_i; W^UV_i]) and W^O's columns; the down-projections and the whole latent cache on every rank.
        All slices, not torch's styles: the absorbed route folds these weights into new matrices in the rank's
        geometry, which a DTensor (global shape) cannot give. GLA / MLRA split by latent block instead."""
        require(
            self.rope_kv_heads == 1, "tensor parallelism of MLA with rope_kv_heads > 1 is not implemented"
        )
        dh, dr = self.head_dim, self.rope_head_dim
        q = self.tp_heads(self.n_head, rank, world)
        slices = self.tp_output_slices(q, dh)
        for w, width in (("wq", dh + dr), ("wq_b", dh + dr), ("wkv_b", 2 * dh)):
            slices[f"{w}.weight"] = slices[f"{w}.bias"] = ("rows", width, q)
        return {
            "config": {"n_head": len(q)},
            "slices": slices,
            "inherit": ("absorb_fold",),
            "holds": {"query_heads": q, "latent": "replicated"},
        }


def check_latent_config(cfg: ModelConfig) -> None:
    """Dimensions every single-latent mechanism (MLA, EG-MLA) needs."""
    d = cfg.d_model
    require(cfg.kv_lora_rank > 0, f"kv_lora_rank (d_c) must be positive, got {cfg.kv_lora_rank}")
    require(
        cfg.kv_lora_rank <= d,
        f"kv_lora_rank={cfg.kv_lora_rank} is larger than its input d_model={d}: a latent wider than the "
        "hidden state compresses nothing (the small-LM grid tops out at r = d)",
    )
    require(
        cfg.q_lora_rank <= d,
        f"q_lora_rank={cfg.q_lora_rank} is larger than its input d_model={d}; use 0 for a plain W^Q",
    )
    require(
        cfg.rope_head_dim <= cfg.head_dim,
        f"rope_head_dim={cfg.rope_head_dim} is larger than head_dim={cfg.head_dim}: the decoupled RoPE key "
        "is at most one head wide (DeepSeek uses d_h/2)",
    )
