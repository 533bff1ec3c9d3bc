"""RMSNorm, the one every norm of the decoder and of the latent attentions uses: at inference on a float32 CPU
tensor it runs kvlm's one-pass C++ kernel (``kvlm.kernels.rms_norm``; torch's ``nn.RMSNorm`` dispatches ~10
operators there: 8 us a call warm, ~0.1 ms inside a decode step under the profiler), elsewhere ``F.rms_norm``.
Its state (``weight``) is torch's ``nn.RMSNorm``'s, so checkpoints of either load into the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.attention.watch import Watched
from kvlm.kernels import rms_norm as one_pass_rms_norm


class RMSNorm(Watched, nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = one_pass_rms_norm(x, self.weight, self.eps)  # one pass at inference on CPU; None elsewhere
        return y if y is not None else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
