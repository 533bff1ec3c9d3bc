"""GTA, grouped-tied attention (Zadouri et al.; mlra.md App. C.7).

h query heads, g value heads. Each value head's first d_h - d_h^R dims double as the NoPE part of its key; the
RoPE part of every key is one shared k_rope (d_h^R): K_i = [V_{i // r}[:d_h - d_h^R], K^RoPE], r = h / g.
Caches V^C (g, d_h) and K^RoPE (d_h^R): g d_h + d_h^R per token per layer.

Routes: "absorbed" (the decode route "auto" takes) scores the cached values and k_rope in place
(q^NoPE . V[:d_h - d_h^R] + q^RoPE . K^RoPE) so no key tensor is built (at decode on CPU through the fused kernel
kvlm.kernels.gqa_decode, contiguous or paged / int8 cache read in place); "expand" / "naive" assemble the tied keys
and call SDPA (prefill, training). There is no separate materialised cache: V^C already is per-head.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvlm import kernels
from kvlm.attention.base import ABSORB_MAX_NEW, Attention, Linear, Step, attend, require
from kvlm.attention.latent_ops import split_score_attention
from kvlm.attention.registry import register
from kvlm.attention.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from kvlm.cache import CacheLayer
    from kvlm.config import ModelConfig


@register("gta")
class GroupedTiedAttention(Attention):
    name = "gta"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h, g, dh, dr = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_head_dim
        self.n_head, self.n_kv_head, self.head_dim, self.rope_dim = h, g, dh, dr
        self.nope_dim = dh - dr
        self.wq = Linear(cfg.d_model, h * dh, bias=cfg.bias)  # W^Q
        self.wkv = Linear(cfg.d_model, g * dh, bias=cfg.bias)  # W^KV: the tied value/key heads
        self.wk_rope = Linear(cfg.d_model, dr, bias=cfg.bias) if dr else None  # W^KR
        self.rope = RotaryEmbedding(dr, cfg.max_seq_len, cfg.rope_theta) if dr else None
        self.scale = 1.0 / math.sqrt(dh)
        self.make_output(h * dh)

    @classmethod
    def config_defaults(cls, cfg: ModelConfig) -> None:
        if cfg.n_kv_head is None:
            cfg.n_kv_head = max(1, cfg.n_head // 4)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        require(
            cfg.n_head % cfg.n_kv_head == 0, f"n_head={cfg.n_head} not divisible by n_kv_head={cfg.n_kv_head}"
        )
        require(
            cfg.rope_head_dim <= cfg.head_dim,
            f"gta's RoPE key is the last rope_head_dim dims of a head: rope_head_dim={cfg.rope_head_dim} "
            f"exceeds head_dim={cfg.head_dim}",
        )

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        spec = {"v": (cfg.n_kv_head, cfg.head_dim)}
        if cfg.rope_head_dim:
            spec["k_rope"] = (cfg.rope_head_dim,)
        return spec

    @classmethod
    def tp_shards(cls, cfg):
        return {"v": "heads", "k_rope": "replicated"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return cfg.n_kv_head

    @classmethod
    def decode_routes(cls, cfg):
        return {"auto": "absorbed", "absorbed": "absorbed", "expand": "expand"}

    @classmethod
    def decode_flops(cls, cfg, layer_idx=0):
        return 4.0 * cfg.n_head * cfg.head_dim  # keys tied to values: d_h - d_h^R + d_h^R wide, values d_h

    def forward(self, x: torch.Tensor, step: Step, cache: CacheLayer | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h, g, dh, dr = self.n_head, self.n_kv_head, self.head_dim, self.rope_dim
        q = self.wq(x).view(B, T, h, dh).transpose(1, 2)
        v = self.wkv(x).view(B, T, g, dh).transpose(1, 2)
        k_rope = None
        if self.rope is not None:
            cos, sin = step.cos_sin(self.rope, x.dtype)
            q = torch.cat([q[..., : self.nope_dim], apply_rope(q[..., self.nope_dim :], cos, sin)], dim=-1)
            k_rope = apply_rope(self.wk_rope(x)[:, None], cos, sin)[:, 0]  # (B, T, d_h^R)
        absorb = step.mode == "absorbed" or (step.mode == "auto" and T <= ABSORB_MAX_NEW)
        if cache is not None and absorb and kernels.ready(q, step.n_new):
            o = self.attend_kernel(q, v, k_rope, step, cache)
            if o is not None:
                self.record_route(step, "absorbed")
                return self.output(o, x)
            v, k_rope = cache.read("v", step.end), (cache.read("k_rope", step.end) if dr else None)
        elif cache is not None:
            v = self.write(cache, "v", v, step)
            if k_rope is not None:
                k_rope = self.write(cache, "k_rope", k_rope, step)
        S = v.shape[2]
        mode = step.mode
        if mode == "auto":
            mode = "absorbed" if cache is not None and T <= ABSORB_MAX_NEW else "expand"
        if mode == "absorbed":
            self.record_route(step, "absorbed")
            r = h // g
            q_nope = q[..., : self.nope_dim].reshape(B, g, r, T, self.nope_dim)
            q_rope = q[..., self.nope_dim :] if k_rope is not None else None
            o = split_score_attention(q_nope, v[..., : self.nope_dim], v, q_rope, k_rope, step, self.scale)
            return self.output(o.reshape(B, h, T, dh), x)
        self.record_route(step, "expand")
        k = v
        if k_rope is not None:  # K = [V[:, :, :d_h - d_h^R], K^RoPE] (C.7)
            k = torch.cat([v[..., : self.nope_dim], k_rope[:, None].expand(B, g, S, dr)], dim=-1)
        return self.output(attend(q, k, v, step, self.scale), x)

    def attend_kernel(self, q, v, k_rope, step: Step, cache: CacheLayer) -> torch.Tensor | None:
        """The absorbed route through the fused decode kernel (kvlm.kernels.gqa_decode) over the cache in place:
        keys are the first d_h - d_h^R columns of the cached V heads (a strided view of the same pool, int8
        scales included) plus the shared RoPE key. Stores the new tokens; None if the kernel declines."""
        cache.store("v", v, step)
        if k_rope is not None:
            cache.store("k_rope", k_rope, step)
        v_view = cache.block_view("v", step)
        k_view = replace(v_view, pool=v_view.pool[..., : self.nope_dim])
        kr_view = cache.block_view("k_rope", step) if k_rope is not None else None
        q_rope = q[..., self.nope_dim :] if k_rope is not None else None
        return kernels.gqa_decode(
            q[..., : self.nope_dim], k_view, v_view, step.n_new, self.scale, q_rope=q_rope, k_rope=kr_view
        )

    def tp_plan(self, rank: int, world: int) -> dict:
        """By group: the rank's query heads and their tied value/key heads on torch's ColwiseParallel (sliced
        beyond g ranks, where a group is replicated on world / g ranks); W^KR and so k_rope on every rank."""
        from torch.distributed.tensor.parallel import ColwiseParallel  # ~2 s: only for TP

        q, kv = self.tp_groups(self.n_head, self.n_kv_head, rank, world)
        styles = {"wq": ColwiseParallel(), **self.tp_output_styles()}
        slices = {}
        if world <= self.n_kv_head:
            styles["wkv"] = ColwiseParallel()
        else:
            slices["wkv.weight"] = slices["wkv.bias"] = ("rows", self.head_dim, kv)
        return {
            "config": {"n_head": len(q), "n_kv_head": len(kv)},
            "parallelize": styles,
            "slices": slices,
            "holds": {"query_heads": q, "kv_heads": kv, "k_rope": "replicated"},
        }
