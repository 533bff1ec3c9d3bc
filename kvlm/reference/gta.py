"""GTA from mlra.md App. C.7: K = [V[:, :, :d_h - d_h^R], RepeatInterleave(K^RoPE, h)], V = RepeatInterleave(V^C, h/g)."""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output, rope


@register("gta")
def gta_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, g, dh, dr = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_head_dim
    q = linear(m.wq, x, bias=cfg.bias).view(B, T, h, dh)  # Q~
    V = linear(m.wkv, x, bias=cfg.bias).view(B, T, g, dh).repeat_interleave(h // g, dim=2)
    if dr:
        q = torch.cat([q[..., : dh - dr], rope(q[..., dh - dr :], positions, cfg.rope_theta)], dim=-1)
        k_rope = rope(linear(m.wk_rope, x, bias=cfg.bias), positions, cfg.rope_theta)  # (B, T, d_h^R)
        K = torch.cat([V[..., : dh - dr], k_rope[:, :, None].expand(B, T, h, dr)], dim=-1)
    else:
        K = V  # no RoPE part: the whole key is tied to the value
    return output(m, causal_attention(q, K, V, 1 / math.sqrt(dh)), x)
