"""TPA from mlra.md App. C.5: Q[t] = (1/beta_q) (Q^A[t])^T Q^C[t], K and V likewise with beta_kv; RoPE on the
factors Q^C and K^C; then ordinary causal attention over the h heads."""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output, rope


@register("tpa")
def tpa_reference(m, x, positions):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, bq, bkv = cfg.n_head, cfg.head_dim, cfg.tpa_q_rank, cfg.tpa_kv_rank
    a, c = linear(m.w_a, x, bias=cfg.bias), linear(m.w_c, x, bias=cfg.bias)
    QA, KA, VA = a.split([bq * h, bkv * h, bkv * h], dim=-1)
    QC, KC, VC = c.split([bq * dh, bkv * dh, bkv * dh], dim=-1)
    QA, KA, VA = QA.view(B, T, bq, h), KA.view(B, T, bkv, h), VA.view(B, T, bkv, h)
    QC, KC, VC = QC.view(B, T, bq, dh), KC.view(B, T, bkv, dh), VC.view(B, T, bkv, dh)
    if cfg.rope:
        QC, KC = rope(QC, positions, cfg.rope_theta), rope(KC, positions, cfg.rope_theta)
    Q = torch.einsum("btpi,btpd->btid", QA, QC) / bq
    K = torch.einsum("btci,btcd->btid", KA, KC) / bkv
    V = torch.einsum("btci,btcd->btid", VA, VC) / bkv
    return output(m, causal_attention(Q, K, V, 1 / math.sqrt(dh)), x)
