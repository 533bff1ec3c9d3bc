"""MLA from DeepSeek-V2 Appendix C (Eqs. 37-47) with mlra.md App. C.3's scaling, written per head and per
token with einsum; separate K/V latents as mla-small-lm.md Eqs. 2-3."""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output, rms_norm, rope


def _norm(m, name, c):
    norm = getattr(m, name)
    return rms_norm(c, norm.weight, m.cfg.norm_eps) if norm is not None else c


def mla_query(m, x, positions):
    """q_{t,i} = [q^C_{t,i}; RoPE(q^R_{t,i})] (Eqs. 37-40), (B, T, h, d_h + d_h^R)."""
    cfg = m.cfg
    B, T, d = x.shape
    h, dh, dr, dq = cfg.n_head, cfg.head_dim, cfg.rope_head_dim, cfg.q_lora_rank
    if dq:
        c_q = _norm(m, "q_norm", linear(m.w_dq, x))  # Eq. 37
        if cfg.latent_scaling:
            c_q = c_q * math.sqrt(d / dq)
        q_c = linear(m.w_uq, c_q).view(B, T, h, dh)  # Eq. 38
        q_r = linear(m.w_qr, c_q).view(B, T, h, dr) if dr else None  # Eq. 39
    else:
        q = linear(m.wq, x).view(B, T, h, dh + dr)
        q_c, q_r = q[..., :dh], q[..., dh:]
    if dr:
        return torch.cat([q_c, rope(q_r, positions, cfg.rope_theta)], dim=-1)  # Eq. 40
    return q_c


def mla_latents(m, x, positions):
    """c^KV (or c^K, c^V) (B, T, d_c) (Eq. 41) and k^R (B, T, d_h^R) or None (Eq. 43); with n_R = rope_kv_heads
    > 1, k^R (B, T, n_R, d_h^R), one RoPE key per group of query heads."""
    cfg = m.cfg
    alpha = math.sqrt(cfg.d_model / cfg.kv_lora_rank) if cfg.latent_scaling else 1.0
    if cfg.kv_latent == "separate":
        c_k = alpha * _norm(m, "k_norm", linear(m.w_dk, x))
        c_v = alpha * _norm(m, "v_norm", linear(m.w_dv, x))
    else:
        c_k = c_v = alpha * _norm(m, "kv_norm", linear(m.w_dkv, x))
    k_r = None
    if cfg.rope_head_dim:
        k_r = linear(m.w_kr, x)
        if cfg.rope_kv_heads > 1:
            k_r = k_r.view(*x.shape[:2], cfg.rope_kv_heads, cfg.rope_head_dim)
        k_r = rope(k_r, positions, cfg.rope_theta)
    return c_k, c_v, k_r


@register("mla")
def mla_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    q = mla_query(m, x, positions)
    c_k, c_v, k_r = mla_latents(m, x, positions)
    k_c = linear(m.w_uk, c_k).view(B, T, h, dh)  # Eq. 42
    v_c = linear(m.w_uv, c_v).view(B, T, h, dh)  # Eq. 45
    if dr and cfg.rope_kv_heads > 1:  # query head i reads RoPE key i // (h / n_R)
        k_r = k_r[:, :, [i // (h // cfg.rope_kv_heads) for i in range(h)]]
    elif dr:
        k_r = k_r[:, :, None].expand(B, T, h, dr)
    k = torch.cat([k_c, k_r], dim=-1) if dr else k_c  # Eq. 44
    o = causal_attention(q, k, v_c, 1 / math.sqrt(dh + dr))  # Eq. 46
    return output(m, o, x)  # Eq. 47
