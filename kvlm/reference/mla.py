"""MLA from DeepSeek-V2 Appendix C (Eqs. 37-47) with mlra.md App. C.3's scaling, written per head and per
token with einsum; separate K/V latents as mla-small-lm.md Eqs. 2-3.

Structure (low-rank query, norms, biases, RoPE key heads, separate latents, gate) comes from ``m.cfg``; only the
weights are read from the module, as the paper's matrices cut out of its fused DeepSeek-layout parameters
(kvlm/attention/latent.py): wq_b / wq rows of head i = [W^UQ_i; W^QR_i], wkv_a rows = [W^DKV; W^KR]
([W^DK; W^DV; W^KR] for separate latents), wkv_b rows of head i = [W^UK_i; W^UV_i]."""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, low_rank_query, output, rms_norm, rope


def mla_query(m, x, positions):
    """q_{t,i} = [q^C_{t,i}; RoPE(q^R_{t,i})] (Eqs. 37-40), (B, T, h, d_h + d_h^R)."""
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    q = low_rank_query(m, x).view(B, T, h, dh + dr)  # Eqs. 37-39
    if dr:
        return torch.cat([q[..., :dh], rope(q[..., dh:], positions, cfg.rope_theta)], dim=-1)  # Eq. 40
    return q


def mla_latents(m, x, positions):
    """c^KV (or c^K, c^V) (B, T, d_c) (Eq. 41) and k^R (B, T, d_h^R) or None (Eq. 43); with n_R = rope_kv_heads
    > 1, k^R (B, T, n_R, d_h^R), one RoPE key per group of query heads."""
    cfg = m.cfg
    dc, dr = cfg.kv_lora_rank, cfg.rope_head_dim
    alpha = math.sqrt(cfg.d_model / dc) if cfg.latent_scaling else 1.0
    kv = linear(m.wkv_a, x, bias=cfg.bias)
    n_lat = 2 if cfg.kv_latent == "separate" else 1
    latents = []
    for j in range(n_lat):
        c = kv[..., j * dc : (j + 1) * dc]
        if cfg.latent_norm:
            weight = m.kv_norm.weight if n_lat == 1 else m.kv_norm.weight[j]
            c = rms_norm(c, weight, cfg.norm_eps)
        latents.append(alpha * c)
    c_k, c_v = latents[0], latents[-1]
    k_r = None
    if dr:
        k_r = kv[..., n_lat * dc :]
        if cfg.rope_kv_heads > 1:
            k_r = k_r.reshape(*x.shape[:2], cfg.rope_kv_heads, dr)
        k_r = rope(k_r, positions, cfg.rope_theta)
    return c_k, c_v, k_r


def up_projection(m, c, part):
    """W^UK c (part 0, Eq. 42) or W^UV c (part 1, Eq. 45) per head, (B, T, h, d_h); wkv_b's bias with cfg.bias."""
    cfg = m.cfg
    h, dh = cfg.n_head, cfg.head_dim
    w = m.wkv_b.weight.view(h, 2, dh, -1)[:, part]  # (h, d_h, d_c)
    y = torch.einsum("btc,hpc->bthp", c, w)
    if cfg.bias:
        y = y + m.wkv_b.bias.view(h, 2, dh)[:, part]
    return y


@register("mla")
def mla_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    q = mla_query(m, x, positions)
    c_k, c_v, k_r = mla_latents(m, x, positions)
    k_c = up_projection(m, c_k, 0)  # Eq. 42
    v_c = up_projection(m, c_v, 1)  # Eq. 45
    if dr and cfg.rope_kv_heads > 1:  # query head i reads RoPE key i // (h / n_R)
        k_r = k_r[:, :, [i // (h // cfg.rope_kv_heads) for i in range(h)]]
    elif dr:
        k_r = k_r[:, :, None].expand(B, T, h, dr)
    k = torch.cat([k_c, k_r], dim=-1) if dr else k_c  # Eq. 44
    o = causal_attention(q, k, v_c, 1 / math.sqrt(dh + dr))  # Eq. 46
    return output(m, o, x)  # Eq. 47
