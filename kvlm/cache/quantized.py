"""Quantized cache storage: int8 or fp8 (e4m3) with one float32 scale per token per cached row.

A cached tensor with per-token shape (*lead, last) is stored as (*lead, last) 1-byte codes plus one scale per
lead row (a per-token, per-head scale for MHA's K/V, one per token for a latent): value ~= code * scale.
Symmetric: scale = max|x| / Q_MAX (127 for int8, 448 for e4m3), so the largest entry of each row is exact
and the rest round to the nearest code (int8: error <= scale / 2 per entry).

The decoupled RoPE key (``k_rope``) stays in the model dtype, as FlashMLA's FP8 layout keeps it in bf16 (656
bytes per token for DeepSeek's 512 + 64: 512 fp8 codes, 4 float32 scales, 64 bf16 RoPE values): RoPE rotates
pairs of dimensions by position, and a coarse key there costs more accuracy than it saves (FlashMLA's note).

The decode kernels read both code types in place with their scales (kvlm.kernels: the CPU kernel decodes e4m3 in
registers, the Triton kernel converts tiles), so a quantized cache is read at its 1-byte size.
"""

from __future__ import annotations

import math

import torch

from kvlm.errors import CacheError

KV_DTYPES = ("int8", "fp8")
SCALE_DTYPE = torch.float32  # one scale per token per lead row, as FlashMLA's float32 tile scales


def fp8_dtype() -> torch.dtype | None:
    """torch.float8_e4m3fn where this torch has it (and can cast to it on CPU), else None."""
    dtype = getattr(torch, "float8_e4m3fn", None)
    if dtype is None:
        return None
    try:
        torch.zeros(1).to(dtype).to(torch.float32)
    except (RuntimeError, TypeError):
        return None
    return dtype


def storage_dtype(kv_dtype: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of quantized tensors for ``kv_dtype`` (None: the model dtype, unquantized)."""
    if kv_dtype in (None, "auto", "none"):
        return model_dtype
    if kv_dtype == "int8":
        return torch.int8
    if kv_dtype == "fp8":
        dtype = fp8_dtype()
        if dtype is None:
            raise CacheError(
                "kv_dtype='fp8' needs torch.float8_e4m3fn, which this torch build lacks; use 'int8'"
            )
        return dtype
    raise CacheError(
        f"unknown kv_dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)} (or None for the model dtype)"
    )


def is_quantized_name(name: str, kv_dtype: str | None) -> bool:
    """Whether ``name`` is stored quantized: every cached tensor but the RoPE keys (kept in the model dtype)."""
    return kv_dtype in KV_DTYPES and "rope" not in name


def q_max(dtype: torch.dtype) -> float:
    return 127.0 if dtype == torch.int8 else float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., last) -> codes (..., last) of ``dtype`` and scales (..., 1) (float32), x ~= codes * scales."""
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = (amax / q_max(dtype)).clamp_min(torch.finfo(SCALE_DTYPE).tiny).to(SCALE_DTYPE)
    y = xf / scale.to(xf.dtype)  # the stored (float32) scale, so that codes * scale is the nearest value
    if dtype == torch.int8:
        codes = y.round_().clamp_(-127, 127).to(torch.int8)
    else:
        codes = y.to(dtype)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes (..., last), scale (..., 1) -> values of ``dtype``."""
    return codes.to(dtype) * scale.to(dtype)


def bytes_per_token(
    spec: dict[str, tuple[int, ...]], model_dtype: torch.dtype, kv_dtype: str | None = None
) -> int:
    """Bytes one token occupies in one layer's cache of ``spec``: every tensor at its storage dtype, plus a
    float32 scale per lead row of each quantized tensor."""
    model_size = torch.empty((), dtype=model_dtype).element_size()
    total = 0
    for name, shape in spec.items():
        numel = math.prod(shape)
        if is_quantized_name(name, kv_dtype):
            code_size = torch.empty((), dtype=storage_dtype(kv_dtype, model_dtype)).element_size()
            rows = math.prod(shape[:-1])
            total += numel * code_size + rows * torch.empty((), dtype=SCALE_DTYPE).element_size()
        else:
            total += numel * model_size
    return total


__all__ = [
    "KV_DTYPES",
    "bytes_per_token",
    "dequantize",
    "fp8_dtype",
    "is_quantized_name",
    "quantize",
    "storage_dtype",
]
