"""What every mechanism shares: the contract, the per-call step context, masks and the SDPA call.

The contract (DESIGN.md):
- ``cache_spec()`` declares the per-token tensors the mechanism caches; the cache allocates exactly these and
  every KV number in kvlm is derived from them.
- ``forward(x, step, cache)``: with ``cache=None`` the full causal forward (training); with a cache, the
  new tokens' tensors are written into it and attention runs over everything cached.
- ``mode``: ``"auto"`` picks the fast route, ``"naive"`` uses the materialised per-head K/V cache
  (``cache_spec(naive=True)``), ``"absorbed"`` forces weight absorption and ``"expand"`` forces re-expanding
  the compact cache into keys and values (the route prefill takes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvlm.config import ConfigError, ModelConfig

MODES = ("auto", "naive", "absorbed", "expand")


@dataclass
class Step:
    """Where the new tokens of one forward call sit. Built once per model call, shared by all layers.

    Cache slots are shared by the batch; a sequence b uses slots [pad[b], end). Its token in slot s has
    position s - pad[b]. ``start`` is the first slot written by this call, ``end`` one past the last.
    """

    positions: torch.Tensor  # (B, T) absolute positions of the new tokens
    start: int = 0
    end: int = 0
    mask: torch.Tensor | None = None  # (B, 1, T, end) bool, True = may attend; None = see `causal`
    causal: bool = True  # with mask None: causal among new tokens (start == 0) or all visible (T == 1)
    token_ids: torch.Tensor | None = None  # (B, T), for mechanisms gated by the token (eg-mla)
    mode: str = "auto"
    cached_token_ids: torch.Tensor | None = None  # (B, end): token ids of every filled slot (eg-mla)

    @property
    def n_new(self) -> int:
        return self.positions.shape[1]

    def visible(self, T: int, S: int, device: torch.device) -> torch.Tensor | None:
        """Which of the S keys each of the T new queries may see, (B or 1, 1, T, S) bool, or None for all:
        the explicit mask, else causal with the new tokens last (the rule ``attend`` applies)."""
        if self.mask is not None:
            return self.mask
        if self.causal and T > 1:
            return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T)[None, None]
        return None

    @staticmethod
    def build(
        token_ids: torch.Tensor,
        start: int = 0,
        pad: torch.Tensor | None = None,
        mode: str = "auto",
    ) -> Step:
        """Positions and mask for new tokens written at slots [start, start + T).

        pad (B,) counts left-padding slots per sequence (None or all zero: no padding)."""
        if mode not in MODES:
            raise ValueError(f"unknown attention mode {mode!r}; known: {', '.join(MODES)}")
        B, T = token_ids.shape
        device = token_ids.device
        end = start + T
        slots = torch.arange(start, end, device=device)
        if pad is None or not bool(pad.any()):
            positions = slots.expand(B, T)
            needs_mask = start > 0 and T > 1  # causal among the new tokens, all of the past visible
            mask = None
            if needs_mask:
                key = torch.arange(end, device=device)
                mask = (key[None, :] <= slots[:, None])[None, None].expand(B, 1, T, end)
            return Step(positions, start, end, mask, True, token_ids, mode)
        pad = pad.to(device)
        positions = (slots[None, :] - pad[:, None]).clamp(min=0)
        key = torch.arange(end, device=device)
        causal = key[None, :] <= slots[:, None]  # (T, end)
        valid = key[None, :] >= pad[:, None]  # (B, end)
        mask = causal[None] & valid[:, None, :]  # (B, T, end)
        # a padding query would attend to nothing (NaN); let it see itself, its output is discarded
        own = torch.zeros_like(mask)
        own[:, torch.arange(T, device=device), slots] = True
        mask = (mask | (own & ~valid[:, None, :]))[:, None]
        return Step(positions, start, end, mask, False, token_ids, mode)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    step: Step,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of q (B, Hq, T, D) over k (B, Hk, S, D), v (B, Hk, S, Dv), Hk divides Hq.

    Query head i uses key head i // (Hq / Hk) (repeat-interleave, as GQA). Returns (B, Hq, T, Dv).
    With shared key heads the query heads of a group are folded into the query-length axis, so each cached
    key and value is read once per group rather than once per query head: this is what makes MQA-style
    decoding (GQA, absorbed MLA) memory-efficient.
    """
    B, Hq, T, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    r = Hq // Hk
    mask = step.mask
    is_causal = mask is None and step.causal and T > 1
    if r > 1 and not is_causal:
        qf = q.reshape(B, Hk, r * T, D)
        if mask is not None:
            mask = mask[:, :, None].expand(B, 1, r, T, S).reshape(B, 1, r * T, S)
        out = _sdpa(qf, k, v, mask, False, scale)
        return out.reshape(B, Hq, T, v.shape[-1])
    if r > 1:
        k = k.repeat_interleave(r, dim=1)
        v = v.repeat_interleave(r, dim=1)
    return _sdpa(q, k, v, mask, is_causal, scale)


def _sdpa(q, k, v, mask, is_causal, scale):
    if q.shape[-1] != v.shape[-1] or q.dtype == torch.float64:
        # SDPA's fused CPU kernels need equal q/v widths; float64 gets the plain math for exact tests
        return _math_attention(q, k, v, mask, is_causal, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _math_attention(q, k, v, mask, is_causal, scale):
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if is_causal:
        T, S = q.shape[-2], k.shape[-2]
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~causal, float("-inf"))
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


class Linear(nn.Linear):
    """nn.Linear whose few-row products (decode: batch x 1 token) run as W x^T instead of x W^T.

    Decode multiplies a handful of rows by every weight, so it is bound by reading the weights. On CPU, MKL
    streams a (out, in) weight markedly faster as the left operand: measured on this project's 2-core machine,
    the 32000 x 768 LM head at batch 8 took 12.4 ms this way against 25.6 ms for F.linear, the 768 x 2048 FFN
    down-projection 1.0 ms against 3.0 ms. Same parameters and state dict as nn.Linear."""

    small_rows = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.numel() else 0
        if rows == 0 or rows > self.small_rows or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t()
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().view(*x.shape[:-1], self.out_features)


class Attention(nn.Module):
    """Base class. Subclasses set ``name`` and implement ``cache_spec``, ``forward`` and (for reports)
    ``tp_shards``. ``q_dim``/``out_dim`` describe the attention output fed to W_O."""

    name: str = ""
    has_naive_cache: bool = False  # True if cache_spec(naive=True) differs (latent mechanisms)

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.gate: nn.Linear | None = None

    # --- configuration ----------------------------------------------------------------------
    @classmethod
    def check_config(cls, cfg: ModelConfig) -> None:
        """Raise ConfigError for dimensions this mechanism cannot use."""

    @classmethod
    def spec_for(
        cls, cfg: ModelConfig, layer_idx: int = 0, naive: bool = False
    ) -> dict[str, tuple[int, ...]]:
        """cache_spec computed from the config alone (no weights), for accounting."""
        raise NotImplementedError

    def cache_spec(self, naive: bool = False) -> dict[str, tuple[int, ...]]:
        return self.spec_for(self.cfg, self.layer_idx, naive)

    @classmethod
    def tp_shards(cls, cfg: ModelConfig) -> dict[str, str]:
        """For each cached tensor: the axis along which tensor parallelism splits it
        ("heads", "blocks", "coefficients") or "replicated". Used by kv-table --tp and distributed decode."""
        return {}

    @classmethod
    def tp_max_degree(cls, cfg: ModelConfig) -> int:
        """Largest TP degree that still splits the sharded tensors (beyond it they are replicated)."""
        return cfg.n_head

    # --- shared helpers -----------------------------------------------------------------------
    def make_output(self, in_dim: int) -> None:
        """W_O (and the optional output gate of mlra.md Appendix E) from in_dim = h * d_v to d_model."""
        cfg = self.cfg
        self.wo = Linear(in_dim, cfg.d_model, bias=cfg.bias)
        self.wo.is_output_projection = True  # zero-init / scaled-init marker for the model's init
        if cfg.gated:
            self.gate = Linear(cfg.d_model, in_dim, bias=cfg.bias)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, T, d_v) -> (B, T, d_model): optional sigmoid gate G = sigma(x W_G), then W_O."""
        B, H, T, Dv = o.shape
        o = o.transpose(1, 2).reshape(B, T, H * Dv)
        if self.gate is not None:
            o = o * torch.sigmoid(self.gate(x))
        return self.wo(o)

    @staticmethod
    def write(cache: dict[str, torch.Tensor], name: str, value: torch.Tensor, step: Step) -> torch.Tensor:
        """Write value (B, *lead, T, last) into cache slots [start, end) and return the filled view
        (B, *lead, end, last): the sequence axis is second to last in every cache buffer."""
        buf = cache[name]
        buf[..., step.start : step.end, :] = value.to(buf.dtype)
        return buf[..., : step.end, :]

    def forward(self, x: torch.Tensor, step: Step, cache: dict[str, torch.Tensor] | None = None):
        raise NotImplementedError


def softmax_scale(dim: int) -> float:
    return 1.0 / math.sqrt(dim)


def require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)
