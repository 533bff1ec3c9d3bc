"""EG-MLA from eg-mla.md Appendix C (Eqs. 1-14): MLA with the joint up-projection gated by a per-layer token
embedding, LN(W^UKV c^KV * W^UE Emb(i)), split per head as Listing 1. Structure (eg_op, eg_norm, biases) from
``m.cfg``; W^UKV is the module's wkv_b (rows of head i: [key; value])."""

from __future__ import annotations

import math

import torch

from kvlm.reference import register
from kvlm.reference.common import causal_attention, linear, output
from kvlm.reference.mla import mla_latents, mla_query


def layer_norm(x, ln, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * ln.weight + ln.bias


@register("eg-mla")
def eg_mla_reference(m, x, positions, token_ids):
    cfg = m.cfg
    B, T, _ = x.shape
    h, dh, dr = cfg.n_head, cfg.head_dim, cfg.rope_head_dim
    c_kv, _, k_r = mla_latents(m, x, positions)  # Eqs. 1, 10
    kv = linear(m.wkv_b, c_kv, bias=cfg.bias)  # Eq. 2
    e = m.emb_gate.kv_emb.weight[token_ids]  # Eq. 3
    g = linear(m.emb_gate.w_ue, e, bias=cfg.bias)  # Eq. 4
    kv = kv + g if cfg.eg_op == "add" else kv * g
    if cfg.eg_norm:
        kv = layer_norm(kv, m.ln_emb, cfg.norm_eps)  # Eq. 5
    kv = kv.view(B, T, h, 2 * dh)
    k_c, v_c = kv[..., :dh], kv[..., dh:]  # Eq. 6
    q = mla_query(m, x, positions)  # Eqs. 7-9, 11
    k = torch.cat([k_c, k_r[:, :, None].expand(B, T, h, dr)], dim=-1) if dr else k_c  # Eq. 12
    o = causal_attention(q, k, v_c, 1 / math.sqrt(dh + dr))  # Eq. 13
    return output(m, o, x)  # Eq. 14
