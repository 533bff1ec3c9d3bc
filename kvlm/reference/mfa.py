"""MFA from mlra.md App. C.4: Q = RoPE(RMSNorm(H W^CQ) W^UQ) in h heads; one key and one value head."""

from __future__ import annotations

import math

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, low_rank_query, output, rope


@register("mfa")
def mfa_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh = cfg.n_head, cfg.head_dim
    q = low_rank_query(m, x)
    q = q.view(B, T, h, dh)
    k = linear(m.wk, x, bias=cfg.bias).view(B, T, 1, dh)
    v = linear(m.wv, x, bias=cfg.bias).view(B, T, 1, dh)
    if cfg.rope:
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    K, V = k.expand(B, T, h, dh), v.expand(B, T, h, dh)  # RepeatInterleave(K^C, h)
    return output(m, causal_attention(q, K, V, 1 / math.sqrt(dh)), x)
