"""MHA, MQA and GQA (mlra.md Appendix C.1-C.2): one class, g = n_kv_head key-value heads.

MHA: g = h. MQA: g = 1. GQA: 1 < g < h, query head i reads key-value head i // (h / g).
Caches K^C and V^C: 2 g d_h elements per token per layer.
"""

from __future__ import annotations

import torch

from kvlm.attention import register
from kvlm.attention.base import Attention, Linear, Step, attend, require, softmax_scale
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.config import ModelConfig


@register("mha", "mqa", "gqa")
class MultiHeadAttention(Attention):
    name = "mha"

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h, g, dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.n_head, self.n_kv_head, self.head_dim = h, g, dh
        self.wq = Linear(cfg.d_model, h * dh, bias=cfg.bias)
        self.wk = Linear(cfg.d_model, g * dh, bias=cfg.bias)
        self.wv = Linear(cfg.d_model, g * dh, bias=cfg.bias)
        self.rope = RotaryEmbedding(dh, cfg.max_seq_len, cfg.rope_theta) if cfg.rope else None
        self.make_output(h * dh)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        require(
            cfg.n_head % cfg.n_kv_head == 0, f"n_head={cfg.n_head} not divisible by n_kv_head={cfg.n_kv_head}"
        )

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        return {"k": (cfg.n_kv_head, cfg.head_dim), "v": (cfg.n_kv_head, cfg.head_dim)}

    @classmethod
    def tp_shards(cls, cfg):
        return {"k": "heads", "v": "heads"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return cfg.n_kv_head

    def forward(self, x: torch.Tensor, step: Step, cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(step.positions, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k = self.write(cache, "k", k, step)
            v = self.write(cache, "v", v, step)
        o = attend(q, k, v, step, softmax_scale(self.head_dim))
        return self.output(o, x)
