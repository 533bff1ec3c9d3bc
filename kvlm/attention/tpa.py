"""TPA, tensor product attention (Zhang et al.; mlra.md App. C.5).

Every head's query, key and value at a token is a rank-beta mixture: head coefficients A (beta, h) times shared
factors C (beta, d_h), e.g. K[t] = (1/beta_kv) (K^A[t])^T K^C[t]; RoPE rotates the factors Q^C and K^C.
Caches K^A, K^C, V^A, V^C: 2 beta_kv (h + d_h) per token per layer.

Routes: "absorbed" (the decode route "auto" takes) never builds per-head keys or values. Logits are
    (1 / (beta_q beta_kv)) sum_{p,c} Q^A[t,p,i] K^A[s,c,i] <Q^C[t,p], K^C[s,c]>     (Remark 6)
computed as the factor products <Q^C, K^C> over the cache (beta_q beta_kv dot products of d_h per cached token,
where per-head keys would need h beta_kv), then contracted with the coefficients; the output is
sum_c (P * V^A[:, c]) V^C[c]. Each cached factor is read once. "expand" rebuilds K, V from the cached factors
(prefill); "naive" caches the materialised per-head K, V (the baseline). The routes ``forward`` records in
``step.trace`` are "factorised", "expand" and "materialised".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvlm.attention.base import ABSORB_MAX_NEW, MATERIALISED, Attention, Linear, Step, attend, require
from kvlm.attention.registry import register
from kvlm.attention.rope import RotaryEmbedding, apply_rope
from kvlm.config import spec_numel
from kvlm.errors import CacheError

if TYPE_CHECKING:
    from kvlm.cache import CacheLayer
    from kvlm.config import ModelConfig


@register("tpa")
class TensorProductAttention(Attention):
    name = "tpa"
    has_naive_cache = True

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__(cfg, layer_idx)
        h, dh, bq, bkv = cfg.n_head, cfg.head_dim, cfg.tpa_q_rank, cfg.tpa_kv_rank
        self.n_head, self.head_dim, self.beta_q, self.beta_kv = h, dh, bq, bkv
        # [W^AQ, W^AK, W^AV] and [W^CQ, W^CK, W^CV], each stacked into one matmul
        self.w_a = Linear(cfg.d_model, (bq + 2 * bkv) * h, bias=cfg.bias)
        self.w_c = Linear(cfg.d_model, (bq + 2 * bkv) * dh, bias=cfg.bias)
        self.rope = RotaryEmbedding(dh, cfg.max_seq_len, cfg.rope_theta) if cfg.rope else None
        self.scale = 1.0 / math.sqrt(dh)
        self.make_output(h * dh)

    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        require(cfg.tpa_q_rank >= 1, f"tpa_q_rank (beta_q) must be >= 1, got {cfg.tpa_q_rank}")
        require(cfg.tpa_kv_rank >= 1, f"tpa_kv_rank (beta_kv) must be >= 1, got {cfg.tpa_kv_rank}")

    @classmethod
    def spec_for(cls, cfg, layer_idx=0, naive=False):
        h, dh, bkv = cfg.n_head, cfg.head_dim, cfg.tpa_kv_rank
        if naive:
            return {"k": (h, dh), "v": (h, dh)}
        return {"k_a": (bkv, h), "k_c": (bkv, dh), "v_a": (bkv, h), "v_c": (bkv, dh)}

    @classmethod
    def tp_shards(cls, cfg):
        # coefficients split by head; the shared factors are needed by every head, so every device loads them
        return {"k_a": "coefficients", "v_a": "coefficients", "k_c": "replicated", "v_c": "replicated"}

    @classmethod
    def tp_max_degree(cls, cfg):
        return cfg.n_head

    # --- routes and their cost ----------------------------------------------------------------
    @classmethod
    def decode_routes(cls, cfg):
        return {"auto": "factorised", "absorbed": "factorised", "expand": "expand", "naive": MATERIALISED}

    @classmethod
    def decode_flops(cls, cfg, layer_idx=0):
        """mlra.md Table 2's count: rebuild K, V from beta_kv factors (4 h beta_kv d_h), then attend (4 h d_h)."""
        h, dh = cfg.n_head, cfg.head_dim
        return 4.0 * h * cfg.tpa_kv_rank * dh + 4.0 * h * dh

    @classmethod
    def decode_cost(cls, cfg, batch, n_cached, route="auto", layer_idx=0):
        """Per cached token and query: "factorised" computes <Q^C, K^C> (2 beta_q beta_kv d_h), contracts it with
        Q^A and K^A (2 beta_q beta_kv h + 2 beta_kv h), weights V^A by the probabilities (beta_kv h) and sums
        over V^C (2 beta_kv h d_h); "expand" is ``decode_flops``; "materialised" attends over per-head K, V
        (4 h d_h) read from the naive cache."""
        route = cls.route_of(cfg, route)
        h, dh, bq, bkv = cfg.n_head, cfg.head_dim, cfg.tpa_q_rank, cfg.tpa_kv_rank
        per_token = {
            "factorised": 2.0 * bq * bkv * dh
            + 2.0 * bq * bkv * h
            + 2.0 * bkv * h
            + bkv * h
            + 2.0 * bkv * h * dh,
            "expand": cls.decode_flops(cfg, layer_idx),
            MATERIALISED: 4.0 * h * dh,
        }[route]
        tokens = batch * n_cached
        spec = cls.spec_for(cfg, layer_idx, naive=route == MATERIALISED)
        return {
            "flops": tokens * per_token,
            "cache_elements": tokens * spec_numel(spec),
            "weight_elements": 0,
        }

    # --- pieces -------------------------------------------------------------------------------
    def factors(self, x: torch.Tensor, step: Step):
        """x (B, T, d) -> Q^A (B, T, beta_q, h), Q^C (B, beta_q, T, d_h), and the cached-layout factors
        K^A, V^A (B, beta_kv, T, h), K^C, V^C (B, beta_kv, T, d_h); RoPE on Q^C and K^C."""
        B, T, _ = x.shape
        h, dh, bq, bkv = self.n_head, self.head_dim, self.beta_q, self.beta_kv
        qa, ka, va = self.w_a(x).split([bq * h, bkv * h, bkv * h], dim=-1)
        qc, kc, vc = self.w_c(x).split([bq * dh, bkv * dh, bkv * dh], dim=-1)
        qa = qa.view(B, T, bq, h)
        ka, va = (t.view(B, T, bkv, h).transpose(1, 2) for t in (ka, va))
        qc = qc.view(B, T, bq, dh).transpose(1, 2)
        kc, vc = (t.view(B, T, bkv, dh).transpose(1, 2) for t in (kc, vc))
        if self.rope is not None:
            cos, sin = step.cos_sin(self.rope, x.dtype)
            qc, kc = apply_rope(qc, cos, sin), apply_rope(kc, cos, sin)
        return qa, qc, ka, kc, va, vc

    def heads(self, a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """(1/beta) A^T C per token: A (B, beta, S, h), C (B, beta, S, d_h) -> (B, h, S, d_h)."""
        return torch.einsum("bcsi,bcsd->bisd", a, c) / a.shape[1]

    def factorized(self, qa, qc, ka, kc, va, vc, step: Step) -> torch.Tensor:
        """Attention straight from the cached factors -> (B, h, T, d_h)."""
        B, T, bq, h = qa.shape
        bkv, S = kc.shape[1], kc.shape[2]
        # <Q^C[t,p], K^C[s,c]>: every query factor against every cached key factor, (B, beta_kv, beta_q T, S)
        g = torch.matmul(qc.reshape(B, 1, bq * T, -1), kc.transpose(-1, -2)).view(B, bkv, bq, T, S)
        # contract with Q^A over p (the 1/(beta_q beta_kv) and softmax scales folded into Q^A), then K^A over c
        qa = qa * (self.scale / (bq * bkv))
        gq = torch.einsum("btpi,bcpts->bcits", qa, g)  # (B, beta_kv, h, T, S)
        scores = (gq * ka.transpose(-1, -2)[:, :, :, None, :]).sum(dim=1)  # (B, h, T, S)
        visible = step.visible(T, S, qa.device)
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # O_i = (1/beta_kv) sum_c (P_i * V^A[:, c, i]) V^C[c]
        weighted = probs[:, None] * va.transpose(-1, -2)[:, :, :, None, :]  # (B, beta_kv, h, T, S)
        o = torch.matmul(weighted.view(B, bkv, h * T, S), vc).sum(dim=1) / bkv
        return o.view(B, h, T, -1)

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, step: Step, cache: CacheLayer | None = None) -> torch.Tensor:
        T = x.shape[1]
        qa, qc, ka, kc, va, vc = self.factors(x, step)
        mode = step.mode
        naive_cache = cache is not None and cache.naive
        if naive_cache and mode not in ("auto", "naive"):
            raise CacheError(f"mode={mode!r} needs the compact cache; this one is naive (materialised K/V)")
        if mode == "naive" and cache is not None and not naive_cache:
            raise CacheError("mode='naive' needs the materialised cache: model.new_cache(..., naive=True)")
        if naive_cache:
            self.record_route(step, MATERIALISED)
            k = self.write(cache, "k", self.heads(ka, kc), step)
            v = self.write(cache, "v", self.heads(va, vc), step)
        else:
            if cache is not None:
                ka, kc = self.write(cache, "k_a", ka, step), self.write(cache, "k_c", kc, step)
                va, vc = self.write(cache, "v_a", va, step), self.write(cache, "v_c", vc, step)
            if mode == "auto":
                mode = "absorbed" if cache is not None and T <= ABSORB_MAX_NEW else "expand"
            if mode == "absorbed":
                self.record_route(step, "factorised")
                return self.output(self.factorized(qa, qc, ka, kc, va, vc, step), x)
            self.record_route(step, "expand")
            k, v = self.heads(ka, kc), self.heads(va, vc)
        q = torch.einsum("btpi,bptd->bitd", qa, qc) / self.beta_q  # Q[t] = (1/beta_q) (Q^A[t])^T Q^C[t]
        return self.output(attend(q, k, v, step, self.scale), x)

    def tp_plan(self, rank: int, world: int) -> dict:
        """By coefficient (mlra.md Sec. 3.4): the rank's heads' columns of Q^A, K^A, V^A. W^A's rows are laid out
        (factor p, head i), so a rank's rows are interleaved, which no even Shard expresses: sliced. The shared
        factors Q^C, K^C, V^C (W^C) on every rank; the output on torch's styles."""
        h = self.n_head
        q = self.tp_heads(h, rank, world)
        rows = [p * h + i for p in range(self.beta_q + 2 * self.beta_kv) for i in q]  # [A^Q; A^K; A^V]
        return {
            "config": {"n_head": len(q)},
            "parallelize": self.tp_output_styles(),
            "slices": {"w_a.weight": ("rows", 1, rows), "w_a.bias": ("rows", 1, rows)},
            "holds": {"query_heads": q, "coefficients": q, "factors": "replicated"},
        }
