"""Shared pieces of the reference implementations: RoPE from its definition, causal softmax attention,
the output gate and W_O. Structure (gate, biases, norms) follows ``m.cfg``; only weights come from the module."""

from __future__ import annotations

import math

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (B, T, ..., dim), rotating pairs (i, i + dim/2) by pos * theta^(-2i/dim); computed in float64."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # (B, T, dim/2)
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (B, T, H, D), k (B, T, H, D), v (B, T, H, Dv) -> (B, T, H, Dv); o_t = sum_j<=t softmax_j(q k / s) v."""
    T = q.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


def output(module, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """o (B, T, H, Dv) -> W_O [o_1; ...; o_H], gated by sigmoid(x W_G) with cfg.gated (mlra.md Appendix E)."""
    cfg = module.cfg
    B, T = o.shape[:2]
    o = o.reshape(B, T, -1)
    if cfg.gated:
        o = o * torch.sigmoid(linear(module.gate, x, bias=cfg.bias))
    return linear(module.wo, o, bias=cfg.bias)


def linear(layer: torch.nn.Linear, x: torch.Tensor, bias: bool | None = None) -> torch.Tensor:
    """x W^T (+ b). bias: whether the config gives this projection a bias (then the module must hold one);
    None takes whatever the module holds."""
    y = x @ layer.weight.T
    if bias is None:
        bias = layer.bias is not None
    if bias:
        if layer.bias is None:
            raise AssertionError("the config asks for a bias that the module under test did not build")
        y = y + layer.bias
    return y


def low_rank_query(m, x: torch.Tensor) -> torch.Tensor:
    """q = W^UQ (alpha_q RMSNorm(W^DQ x)) with q_lora_rank > 0 (mlra.md App. C.3-C.4), else W^Q x; the
    weights named wq_a / q_norm / wq_b / wq as in the MFA, GLA and MLRA modules."""
    cfg = m.cfg
    if not cfg.q_lora_rank:
        return linear(m.wq, x, bias=cfg.bias)
    c_q = linear(m.wq_a, x, bias=cfg.bias)
    if cfg.latent_norm:
        c_q = rms_norm(c_q, m.q_norm.weight, cfg.norm_eps)
    if cfg.latent_scaling:
        c_q = c_q * math.sqrt(cfg.d_model / cfg.q_lora_rank)
    return linear(m.wq_b, c_q, bias=cfg.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
