"""GLA (mlra.md App. C.6) and MLRA-2 / MLRA-4 (Eq. 5, 6, 9, 10), head by head as the paper writes them.

Structure (low-rank query, norms, biases, gate, scaling) comes from ``m.cfg``; only the weights come from the fast
module, cut out of its fused parameters (kvlm/attention/latent.py): ``wkv_b.weight[b]`` holds, for the j-th head
served by latent block b, the rows [(W^UK_(b),(i))^T (d_h rows); (W^UV_(b),(i))^T (d_h rows)].
"""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, low_rank_query, output, rms_norm, rope


def mla_query(m, x, positions):
    """App. C.3: C^Q = alpha_q RMSNorm(H W^DQ); Q = [C^Q W^UQ, RoPE(C^Q W^QR)] per head -> (B, T, h, d_h + d_h^R)."""
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    q = low_rank_query(m, x)
    q = q.view(B, T, h, dh + dr)
    if dr:
        q = torch.cat([q[..., :dh], rope(q[..., dh:], positions, cfg.rope_theta)], dim=-1)
    return q


def latent_blocks(m, x, positions, n_blocks):
    """C^KV split into n_blocks blocks, each alpha_kv RMSNorm(H W^DKV_b), and K^RoPE = RoPE(H W^KR)."""
    cfg = m.cfg
    dc, dr = cfg.kv_lora_rank, cfg.rope_head_dim
    d_lat = dc // n_blocks
    kv = linear(m.wkv_a, x, bias=cfg.bias)
    alpha_kv = math.sqrt(cfg.d_model / d_lat) if cfg.latent_scaling else 1.0
    blocks = []
    for b in range(n_blocks):
        c_b = kv[..., b * d_lat : (b + 1) * d_lat]
        if cfg.latent_norm:
            c_b = rms_norm(c_b, m.kv_norm.weight[b], cfg.norm_eps)
        blocks.append(alpha_kv * c_b)
    k_rope = rope(kv[..., dc:], positions, cfg.rope_theta) if dr else kv[..., dc:]
    return blocks, k_rope


def up_projections(m, n_blocks):
    """W^UK_(b),(i)^T and W^UV_(b),(i)^T of the j-th head of block b: two (n_blocks, r, d_h, d_lat) tensors."""
    cfg = m.cfg
    w = m.wkv_b.weight.view(n_blocks, -1, 2, cfg.head_dim, cfg.kv_lora_rank // n_blocks)
    return w[:, :, 0], w[:, :, 1]


@register("gla-2", "gla-4")
def gla_reference(m, x, positions):
    """C.6: g latent heads; group j's keys K^j = [C^j W^{j,UK}, K^RoPE], values V^j = C^j W^{j,UV}; concat groups."""
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    g = {"gla-2": 2, "gla-4": 4}[cfg.attention]
    r = h // g
    q = mla_query(m, x, positions)
    C, k_rope = latent_blocks(m, x, positions, g)
    w_uk, w_uv = up_projections(m, g)
    keys, values = [], []
    for j in range(g):
        W_UK = w_uk[j].permute(2, 0, 1).reshape(-1, r * dh)  # (d_c/g, r d_h): head columns side by side
        W_UV = w_uv[j].permute(2, 0, 1).reshape(-1, r * dh)
        k_nope = (C[j] @ W_UK).view(B, T, r, dh)
        keys.append(torch.cat([k_nope, k_rope[:, :, None].expand(B, T, r, dr)], dim=-1))
        values.append((C[j] @ W_UV).view(B, T, r, dh))
    K, V = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    return output(m, causal_attention(q, K, V, 1 / math.sqrt(dh + dr)), x)


@register("mlra-2", "mlra-4")
def mlra_reference(m, x, positions):
    """Eq. 5 (MLRA-4): O_i = sum_b Softmax(tau Q_i [C_b W^UK_(b),i, K^RoPE]^T) C_b W^UV_(b),i over 4 blocks;
    Eq. 6 (MLRA-2): head i's branches are blocks 2 gamma(i) and 2 gamma(i) + 1, gamma(i) = [i >= h/2]."""
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    q = mla_query(m, x, positions)
    C, k_rope = latent_blocks(m, x, positions, 4)
    w_uk, w_uv = up_projections(m, 4)
    tau = 1 / math.sqrt(dh + dr)
    if cfg.attention == "mlra-4":
        branches = {i: [(b, i) for b in range(4)] for i in range(h)}  # (block, index of head i within block)
        alpha_attn = 1 / 2
    else:
        half = h // 2
        branches = {i: [(2 * (i // half), i % half), (2 * (i // half) + 1, i % half)] for i in range(h)}
        alpha_attn = 1 / math.sqrt(2)
    if not cfg.attn_out_scaling:
        alpha_attn = 1.0
    heads = []
    for i in range(h):
        o_i = 0
        for b, j in branches[i]:
            k_nope = C[b] @ w_uk[b, j].T  # C_b W^UK_(b),i
            v = C[b] @ w_uv[b, j].T  # C_b W^UV_(b),i
            k = torch.cat([k_nope, k_rope], dim=-1)
            o_i = o_i + causal_attention(q[:, :, i : i + 1], k[:, :, None], v[:, :, None], tau)[:, :, 0]
        heads.append(alpha_attn * o_i)
    return output(m, torch.stack(heads, dim=2), x)
