"""MFA, multi-matrix factorization attention (Hu et al.; mlra.md App. C.4).

Low-rank query C^Q = RMSNorm(H W^CQ) (d'_c = q_lora_rank), up-projected to h heads of cfg.head_dim (the paper's
2 d_h: a preset sets head_dim = 256), RoPE on the whole head; one shared key head and one value head, as MQA.
Caches K^C (1, head_dim) and V^C (1, head_dim). With q_lora_rank = 0 the query is a plain W_Q (then MFA is MQA).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvlm import kernels
from kvlm.attention.base import Attention, Linear, Step, attend
from kvlm.attention.norm import RMSNorm
from kvlm.attention.registry import register
from kvlm.attention.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from kvlm.cache import CacheLayer
    from kvlm.config import ModelConfig


@register("mfa")
class MultiMatrixFactorizationAttention(Attention):
    name = "mfa"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h, dh = cfg.n_head, cfg.head_dim
        self.n_head, self.head_dim = h, dh
        self.q_norm = None
        if cfg.q_lora_rank:
            self.wq_a = Linear(cfg.d_model, cfg.q_lora_rank, bias=cfg.bias)  # W^CQ
            if cfg.latent_norm:
                self.q_norm = RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = Linear(cfg.q_lora_rank, h * dh, bias=cfg.bias)  # W^UQ
            self.alpha_q = math.sqrt(cfg.d_model / cfg.q_lora_rank) if cfg.latent_scaling else 1.0
        else:
            self.wq = Linear(cfg.d_model, h * dh, bias=cfg.bias)
        self.wk = Linear(cfg.d_model, dh, bias=cfg.bias)  # W^K: one key head
        self.wv = Linear(cfg.d_model, dh, bias=cfg.bias)  # W^V: one value head
        self.rope = RotaryEmbedding(dh, cfg.max_seq_len, cfg.rope_theta) if cfg.rope else None
        self.make_output(h * dh)

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        return {"k": (1, cfg.head_dim), "v": (1, cfg.head_dim)}

    @classmethod
    def tp_shards(cls, cfg):
        return {"k": "replicated", "v": "replicated"}  # one KV head: every device loads it all

    @classmethod
    def tp_max_degree(cls, cfg):
        return 1

    @classmethod
    def decode_flops(cls, cfg, layer_idx=0):
        spec = cls.spec_for(cfg, layer_idx)
        return 2.0 * cfg.n_head * (spec["k"][-1] + spec["v"][-1])  # as MQA: every head over the one K, V

    def forward(self, x: torch.Tensor, step: Step, cache: CacheLayer | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if self.cfg.q_lora_rank:
            c_q = self.wq_a(x)
            if self.q_norm is not None:
                c_q = self.q_norm(c_q)
            q = self.wq_b(c_q * self.alpha_q if self.alpha_q != 1.0 else c_q)
        else:
            q = self.wq(x)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, 1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, 1, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            cos, sin = step.cos_sin(self.rope, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.record_route(step, "plain")
        scale = 1.0 / math.sqrt(self.head_dim)
        if cache is not None and kernels.ready(q, step.n_new):
            # MQA decode through the fused kernel over the cache in place (kvlm.kernels.gqa_decode, one KV head)
            cache.store("k", k, step)
            cache.store("v", v, step)
            k_view, v_view = cache.block_view("k", step), cache.block_view("v", step)
            o = kernels.gqa_decode(q, k_view, v_view, step.n_new, scale)
            if o is not None:
                return self.output(o, x)
            k, v = cache.read("k", step.end), cache.read("v", step.end)  # declined: the plain path
        elif cache is not None:
            k = self.write(cache, "k", k, step)
            v = self.write(cache, "v", v, step)
        o = attend(q, k, v, step, scale)
        return self.output(o, x)

    def tp_plan(self, rank: int, world: int) -> dict:
        """By query head (torch's ColwiseParallel W^UQ / W^Q, RowwiseParallel W^O); the low-rank query input and
        the one shared key and value head are on every rank (mlra.md Table 1)."""
        from torch.distributed.tensor.parallel import ColwiseParallel  # ~2 s: only for TP

        q = self.tp_heads(self.n_head, rank, world)
        query = "wq_b" if self.cfg.q_lora_rank else "wq"
        return {
            "config": {"n_head": len(q)},
            "parallelize": {query: ColwiseParallel(), **self.tp_output_styles()},
            "holds": {"query_heads": q, "kv_heads": "replicated"},
        }
