"""MHA, MQA and GQA (mlra.md Appendix C.1-C.2): one computation, g = n_kv_head key-value heads.

MHA: g = h. MQA: g = 1. GQA: 1 < g < h (default h / 4), query head i reads key-value head i // (h / g).
Caches K^C and V^C: 2 g d_h elements per token per layer. One route ("plain"): attention over the cached K, V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm import kernels
from kvlm.attention.base import (
    Attention,
    BlockPlan,
    GroupPacking,
    Linear,
    Step,
    attend,
    require,
    softmax_scale,
)
from kvlm.attention.registry import register
from kvlm.attention.rope import RotaryEmbedding, apply_rope

if TYPE_CHECKING:
    from kvlm.cache import CacheLayer
    from kvlm.config import ModelConfig


@register("mha")
class MultiHeadAttention(Attention, GroupPacking):
    name = "mha"
    hf_peer = "llama"
    packed_groups = (("wq", "wk", "wv"),)  # one GEMM [W^Q; W^K; W^V] at decode with packed weights

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
    def config_defaults(cls, cfg: ModelConfig) -> None:
        cfg.n_kv_head = cfg.n_head  # MHA: one key-value head per query head, whatever was asked

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

    @classmethod
    def decode_flops(cls, cfg, layer_idx=0):
        spec = cls.spec_for(cfg, layer_idx)
        return 2.0 * cfg.n_head * (spec["k"][-1] + spec["v"][-1])  # scores and values over the per-head K, V

    def forward(self, x: torch.Tensor, step: Step, cache: CacheLayer | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.group_outputs(("wq", "wk", "wv"), x)
        q, k, v = qkv if qkv is not None else (self.wq(x), self.wk(x), self.wv(x))
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rope is not None:
            cos, sin = step.cos_sin(self.rope, x.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.record_route(step, "plain")
        if cache is not None and kernels.ready(q, step.n_new):
            return self.output(self.attend_kernel(q, k, v, step, cache), x)
        if cache is not None:
            k = self.write(cache, "k", k, step)
            v = self.write(cache, "v", v, step)
        o = attend(q, k, v, step, softmax_scale(self.head_dim))
        return self.output(o, x)

    def decode_block_plan(self, block_weights: tuple):
        """The block in one call of kvlm.kernels.gqa_block_call (RoPE, no bias, no output gate; each product on its
        panels where they go first, else on the plain weights), else None. The same values as the modules one by
        one, whose operators between the step's kernels cost ~190 us a layer."""
        if self.rope is None or self.gate is not None or self.cfg.bias:
            return None
        (qkv_ok, qkv_panels), (o_ok, o_panels) = self.group_panels(("wq", "wk", "wv")), self.wo.first_panels()
        if not (qkv_ok and o_ok):
            return None
        attn_norm, mlp_norm, eps, w_up, w_down, up_panels, down_panels = block_weights
        call = kernels.gqa_block_call(
            (attn_norm, mlp_norm, eps), [self.wq.weight, self.wk.weight, self.wv.weight], self.wo.weight,
            (w_up, w_down), self.n_head, softmax_scale(self.head_dim), [qkv_panels, o_panels, up_panels, down_panels],
        )  # fmt: skip
        if call is None:
            return None
        return BlockPlan(self, call, ("k", "v"), lambda step, dtype: step.cos_sin(self.rope, dtype), "plain")

    def attend_kernel(self, q, k, v, step: Step, cache: CacheLayer) -> torch.Tensor:
        """Decode through the fused kernel over the cache in place (kvlm.kernels.gqa_decode); ``attend`` over
        what was just stored when it declines the cache (e.g. an fp8 pool)."""
        cache.store("k", k, step)
        cache.store("v", v, step)
        scale = softmax_scale(self.head_dim)
        o = kernels.gqa_decode(q, cache.block_view("k", step), cache.block_view("v", step), step.n_new, scale)
        if o is None:
            o = attend(q, cache.read("k", step.end), cache.read("v", step.end), step, scale)
        return o

    def tp_plan(self, rank: int, world: int) -> dict:
        """By KV head (mlra.md Table 1): the rank's query heads and the KV heads they read, on torch's
        ColwiseParallel / RowwiseParallel. Beyond g ranks a KV head is replicated on world / g ranks that split its
        query heads: no even split of wk and wv, so those are sliced."""
        from torch.distributed.tensor.parallel import ColwiseParallel  # ~2 s: only for TP

        q, kv = self.tp_groups(self.n_head, self.n_kv_head, rank, world)
        styles = {"wq": ColwiseParallel(), **self.tp_output_styles()}
        slices = {}
        if world <= self.n_kv_head:
            styles.update(wk=ColwiseParallel(), wv=ColwiseParallel())
        else:
            for w in ("wk", "wv"):
                slices[f"{w}.weight"] = slices[f"{w}.bias"] = ("rows", self.head_dim, kv)
        return {
            "config": {"n_head": len(q), "n_kv_head": len(kv)},
            "parallelize": styles,
            "slices": slices,
            "holds": {"query_heads": q, "kv_heads": kv},
        }


@register("mqa")
class MultiQueryAttention(MultiHeadAttention):
    """MQA: one key-value head shared by every query head."""

    name = "mqa"

    @classmethod
    def config_defaults(cls, cfg: ModelConfig) -> None:
        cfg.n_kv_head = 1


@register("gqa")
class GroupedQueryAttention(MultiHeadAttention):
    """GQA: g key-value heads, each shared by h / g query heads (default g = h / 4)."""

    name = "gqa"

    @classmethod
    def config_defaults(cls, cfg: ModelConfig) -> None:
        if cfg.n_kv_head is None:
            cfg.n_kv_head = max(1, cfg.n_head // 4)
