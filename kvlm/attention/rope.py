"""Rotary position embedding (Su et al.), shared by every mechanism.

Half-split ("rotate_half") layout, as Llama and Hugging Face use: the pair (x[i], x[i + dim/2]) rotates
by angle pos * theta^(-2i/dim). Partial / decoupled RoPE (MLA's k_rope, GTA's last d_h^R dims) is the
same function applied to a slice.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_seq_len), kept in float64 and cast on use, so that a
    float64 model gets exact angles and a float32 one gets the same rounded values every call."""

    def __init__(self, dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.dim = dim
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def _apply(self, fn, recurse=True):
        # keep the tables in float64 whatever dtype the model is moved to (device moves still apply)
        cos, sin = self.cos_table, self.sin_table
        super()._apply(fn, recurse)
        self.cos_table = cos.to(self.cos_table.device)
        self.sin_table = sin.to(self.sin_table.device)
        return self

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, end: int | None = None, full: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin of shape (B, 1, T, dim/2), ready to broadcast over heads. ``end``: a bound
        the caller knows on the host (every position < end); within the table it spares reading positions back.
        ``full``: the whole-width tables [cos, cos] and [-sin, sin] (B, 1, T, dim) of ``apply_rope``'s short form."""
        n = self.cos_table.shape[0]
        if (end is None or end > n) and positions.numel() and int(positions.max()) >= n:
            raise ValueError(
                f"position {int(positions.max())} is beyond max_seq_len={self.cos_table.shape[0]}"
            )
        cos = self.cos_table[positions].to(dtype)[:, None]
        sin = self.sin_table[positions].to(dtype)[:, None]
        if full:
            return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, dim) by cos/sin (B, 1, T, dim/2), or by the whole-width tables of ``cos_sin(full=True)``
    (B, 1, T, dim): then x [cos, cos] + roll(x, dim/2) [-sin, sin], the same values bit for bit (x1 cos - x2 sin
    = x1 cos + x2 (-sin)) in 4 operators instead of 9; a decode step runs this twice per layer."""
    half = x.shape[-1] // 2
    if cos.shape[-1] == x.shape[-1]:
        return x * cos + torch.roll(x, half, dims=-1) * sin
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
