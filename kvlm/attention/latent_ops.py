"""Attention kernels of the latent family (kvlm.attention.latent): attention over compact latents and over keys
whose RoPE part is shared, reading the cache views in place.

- ``latent_attention``: MQA-style attention in latent space, one shared key/value head (MLA's absorbed route).
- ``split_score_attention``: the same per latent block, several key heads (GLA / MLRA's absorbed route).
- ``attend_split``: per-head keys [k^C_i; k^R] whose RoPE part is shared by all heads (the expand route).
- ``attend_padded``: ``attend`` for values narrower than the queries (the naive route).
- ``rope_scores`` / ``rope_keys_per_head``: the shared RoPE key's scores and per-head copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlm.attention.base import Step, attend
from kvlm.kernels.few_rows import few_rows_head_matmul


def latent_attention(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_k: torch.Tensor,
    k_rope: torch.Tensor | None,
    c_v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """MQA-style attention in latent space (mlra.md Sec. 2.1 Step 2), one shared key/value head.

    q (B, H, T, D_c), q_rope (B, H, T, d_R) or None; c_k (B, S, D_c), k_rope (B, S, d_R) (or (B, n_R, S, d_R):
    grouped RoPE keys) or None, c_v (B, S, D_v): usually strided views of cache buffers (B, max_len, .), never
    copied. Returns z (B, H, T, D_v) with
    z = softmax(scale (q c_k^T + q_rope k_rope^T)) c_v. Heads and new tokens share one query axis, so each
    cached latent is read once per sequence, not once per head.

    When q and c_v have the same width (always for MLA's absorbed route, D_c = D_v) the latent part runs in
    SDPA's fused kernel, one pass over the cache with scores kept in blocks, and the small RoPE term
    scale q_rope k_rope^T (d_R = d_h/2 wide) plus any mask enters as its additive float mask: about 20 % faster
    on CPU than separate score and value matmuls. Float64 keeps the plain matmuls (exact tests).
    """
    B, H, T, Dc = q.shape
    S = c_k.shape[1]
    mask = step.visible(T, S, q.device)
    if q.dtype != torch.float64 and Dc == c_v.shape[-1]:
        bias = None
        if q_rope is not None:
            bias = rope_scores(q_rope, k_rope).mul_(scale)
        if mask is not None:
            if bias is None:
                bias = torch.zeros(B, H * T, S, dtype=q.dtype, device=q.device)
            bias.view(B, H, T, S).masked_fill_(~mask, float("-inf"))
        z = F.scaled_dot_product_attention(
            q.reshape(B, 1, H * T, Dc),
            c_k[:, None],
            c_v[:, None],
            attn_mask=bias[:, None] if bias is not None else None,
            scale=scale,
        )
        return z.view(B, H, T, Dc)
    scores = torch.bmm((q * scale).reshape(B, H * T, Dc), c_k.transpose(1, 2))  # (B, H T, S)
    if q_rope is not None and k_rope.dim() == 3:
        scores.baddbmm_(q_rope.reshape(B, H * T, -1), k_rope.transpose(1, 2), alpha=scale)
    elif q_rope is not None:
        scores.add_(rope_scores(q_rope, k_rope), alpha=scale)
    if mask is not None:
        scores = scores.view(B, H, T, S).masked_fill(~mask, float("-inf")).view(B, H * T, S)
    p = torch.softmax(scores, dim=-1)
    return torch.bmm(p, c_v).view(B, H, T, c_v.shape[-1])


def head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, h, T, a) times w (h, a, b) head by head -> (B, h, T, b): one batched GEMM over the heads, as
    einsum("bhtp,hpc->bhtc") computes it, without einsum's parsing (~3 % of an absorbed MLA decode step); at
    decode's few rows on CPU by the few-row kernel's per-head product (``few_rows_head_matmul``) where it applies."""
    y = few_rows_head_matmul(x, w)
    if y is not None:
        return y
    B, h, T, a = x.shape
    return torch.bmm(x.transpose(0, 1).reshape(h, B * T, a), w).view(h, B, T, -1).transpose(0, 1)


def rope_scores(q_rope: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """q^R k^R^T as (B, H T, S): q_rope (B, H, T, d_R); k_rope (B, S, d_R), one key for every head, or
    (B, n_R, S, d_R), head i reading key i // (H / n_R): one matmul per key head over its H / n_R query heads."""
    B, H, T, dr = q_rope.shape
    if k_rope.dim() == 3:
        return torch.bmm(q_rope.reshape(B, H * T, dr), k_rope.transpose(1, 2))
    n_r, S = k_rope.shape[1], k_rope.shape[2]
    return torch.matmul(q_rope.reshape(B, n_r, H // n_r * T, dr), k_rope.transpose(-1, -2)).view(B, H * T, S)


def rope_keys_per_head(k_rope: torch.Tensor, n_head: int) -> torch.Tensor:
    """The RoPE key of every query head, (B, h, S, d_R), from k_rope (B, S, d_R) or (B, n_R, S, d_R)."""
    if k_rope.dim() == 3:
        return k_rope[:, None].expand(-1, n_head, -1, -1)
    return k_rope.repeat_interleave(n_head // k_rope.shape[1], dim=1)


def split_score_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_rope: torch.Tensor | None,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """softmax(scale * (q k^T + q_rope k_rope^T)) v, reading k, k_rope and v in place.

    q (B, Hk, R, T, D): R query rows per key head; k (B, Hk, S, D); v (B, Hk, S, Dv) (may be k itself, as for an
    absorbed latent); q_rope (B, G * R, T, d_R) with G dividing Hk: one RoPE query per query head, shared by the
    Hk / G key heads of its group (the branches of MLRA); k_rope (B, S, d_R), shared by every head.
    Returns (B, Hk, R, T, Dv). Splitting the logits this way means the cached latent and RoPE key are never
    concatenated into one key tensor, which would copy the whole cache on every step."""
    B, Hk, R, T, D = q.shape
    S = k.shape[-2]
    scores = torch.matmul(q.reshape(B, Hk, R * T, D), k.transpose(-1, -2))  # (B, Hk, R*T, S)
    if q_rope is not None:
        G = q_rope.shape[1] // R
        rope_scores = torch.matmul(q_rope.reshape(B, G * R * T, -1), k_rope.transpose(-1, -2))
        scores = scores.view(B, G, Hk // G, R, T, S) + rope_scores.view(B, G, 1, R, T, S)
    scores = scores.view(B, Hk, R, T, S).mul_(scale)
    visible = step.visible(T, S, q.device)
    if visible is not None:
        scores = scores.masked_fill_(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(B, Hk, R * T, S), v)
    return out.view(B, Hk, R, T, v.shape[-1])


# attend_split adds the RoPE scores as a float mask while that (B, h, T, S) tensor stays this small
_BIAS_ELEMENTS = 1 << 22


def attend_split(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor | None,
    v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """Attention with per-head keys [k^C_i; k^R] whose RoPE part k^R is one vector shared by all heads (Eq. 44).

    q_nope (B, h, T, d_h), q_rope (B, h, T, d_R) or None, k_nope (B, h, S, d_h) (any strides), k_rope (B, S, d_R)
    (or (B, n_R, S, d_R), shared within groups of h / n_R heads), v (B, h, S, d_h). For decode-sized calls the shared RoPE key is never broadcast into h copies: its scores
    scale q^R k^R^T come from one (B, h T, d_R) x (B, d_R, S) matmul and enter SDPA as an additive mask, while
    the d_h-wide nope part runs in SDPA's fused kernel (5x faster than concatenating K on CPU). Long prefills
    and training (where SDPA with a float mask falls back to its math kernels) concatenate instead.
    """
    if q_rope is None:
        return attend(q_nope, k_nope, v, step, scale)
    B, H, T, _ = q_nope.shape
    S = k_nope.shape[2]
    if T == 1 or (B * H * T * S <= _BIAS_ELEMENTS and not torch.is_grad_enabled()):
        bias = rope_scores(q_rope, k_rope).mul_(scale).view(B, H, T, S)
        mask = step.visible(T, S, q_nope.device)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q_nope, k_nope, v, attn_mask=bias, scale=scale)
    k = torch.cat([k_nope, rope_keys_per_head(k_rope, H)], dim=-1)
    return attend_padded(torch.cat([q_nope, q_rope], dim=-1), k, v, step, scale)


def attend_padded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: Step, scale: float
) -> torch.Tensor:
    """``attend`` for values narrower than queries (d_h vs d_h + d_h^R): zero-pad v to the query width so SDPA's
    fused kernels (O(T) memory, no (T, S) score matrix) run, then drop the padding. Float64 (exact tests) and
    single-query decode keep the plain math path, where padding buys nothing."""
    dv = v.shape[-1]
    if q.shape[-1] == dv or q.dtype == torch.float64 or q.shape[2] == 1:
        return attend(q, k, v, step, scale)
    v = F.pad(v, (0, q.shape[-1] - dv))
    return attend(q, k, v, step, scale)[..., :dv]
