"""MHA / MQA / GQA from mlra.md Appendix C.1-C.2: K = RepeatInterleave(K^C, h/g)."""

from __future__ import annotations

import math

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output, rope


@register("mha", "mqa", "gqa")
def mha_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, g, dh = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    q = linear(m.wq, x, bias=cfg.bias).view(B, T, h, dh)
    k = linear(m.wk, x, bias=cfg.bias).view(B, T, g, dh)
    v = linear(m.wv, x, bias=cfg.bias).view(B, T, g, dh)
    if cfg.rope:
        q, k = rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    k = k.repeat_interleave(h // g, dim=2)
    v = v.repeat_interleave(h // g, dim=2)
    return output(m, causal_attention(q, k, v, 1 / math.sqrt(dh)), x)
