"""MFA from mlra.md App. C.4: Q = RoPE(RMSNorm(H W^CQ) W^UQ) in h heads; one key and one value head."""

from __future__ import annotations

import math

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output, rms_norm, rope


@register("mfa")
def mfa_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh = cfg.n_head, cfg.head_dim
    if cfg.q_lora_rank:
        c_q = linear(m.wq_a, x)
        if cfg.latent_norm:
            c_q = rms_norm(c_q, m.q_norm.weight, cfg.norm_eps)
        if cfg.latent_scaling:
            c_q = c_q * math.sqrt(cfg.d_model / cfg.q_lora_rank)
        q = linear(m.wq_b, c_q)
    else:
        q = linear(m.wq, x)
    q = q.view(B, T, h, dh)
    k = linear(m.wk, x).view(B, T, 1, dh)
    v = linear(m.wv, x).view(B, T, 1, dh)
    if cfg.rope:
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    K, V = k.expand(B, T, h, dh), v.expand(B, T, h, dh)  # RepeatInterleave(K^C, h)
    return output(m, causal_attention(q, K, V, 1 / math.sqrt(dh)), x)
