"""Fused decode kernels and their dispatch: attention of a few new tokens over a cache read in place.

- ``latent_decode(q_lat, q_rope, c_kv, k_rope, n_new, scale)``: MLA's absorbed route, softmax(scale (q_lat
  c_kv^T + q_rope k_rope^T)) c_kv, every cached latent read once for all heads.
- ``latent_block_decode(...)``: GLA / MLRA's absorbed route, the same per latent block (the kernel's group axis),
  the RoPE key shared by all blocks.
- ``gqa_decode(q, k, v, n_new, scale)``: MHA/GQA/MQA, each cached K/V head read once for its query heads.

Both read the cache through ``BlockView``s (kvlm.cache.layer: pool + block table + start/end), so the same
kernel serves the contiguous cache (zero copy) and the paged / int8 / fp8 one. On CPU tensors they run the C++/OpenMP
flash-decoding kernel of ``kvlm.kernels.cpu`` (built on first use); on CUDA, ``latent_decode`` runs the Triton
kernel of ``kvlm.kernels.triton_decode``. When no fast path applies (kernels disabled with ``KVLM_KERNELS=0``,
no compiler, an unsupported dtype, autograd recording, too many new tokens) they return None, or raise
``KernelUnavailable`` with the reason when called with ``strict=True``; callers then take the plain PyTorch
path, which stays the reference the kernels are tested against (tests/test_kernels.py).

``rms_norm(x, weight, eps)``: RMSNorm in one C++ pass on float32 CPU tensors without autograd (decode's norms).

Under ``torch.compile`` the CPU calls go through the custom operator ``kvlm::decode_attention``
(``kvlm.kernels.library``), which the compiler keeps in its graph as one opaque call, and ``rms_norm`` declines
(the compiler fuses torch's own); eager calls go to the extension directly.

``CALLS`` counts the attention kernels' calls by name ("latent_cpu", "latent_block_cpu", "gqa_cpu",
"latent_triton"; ``NORM_CALLS`` rms_norm's), so
tests can prove the decode routes use the kernels.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvlm.kernels import cpu
from kvlm.kernels.block import block_stack, gqa_block_call, mla_block_call  # noqa: F401 (re-exported)
from kvlm.kernels.shared import (  # noqa: F401 (re-exported)
    CALLS,
    FLOPS,
    LINEAR_CALLS,
    MIN_SPLIT_KEYS,
    NORM_CALLS,
    PLAIN_TENSORS,
    count_flops,
    split_count,
    visible_keys,
)
from kvlm.kernels.views import (  # noqa: F401
    _FP8,
    _POOL_DTYPES,
    _QUANT,
    _check_pool,
    _check_rope,
    _keys,
    _same_pages,
    _splits,
    _too_short,
)

if TYPE_CHECKING:
    from kvlm.cache.layer import BlockView

MAX_NEW = 16  # new tokens per call the kernels take (decode, speculative verification); prefill goes to SDPA

class KernelUnavailable(RuntimeError):
    """No fast kernel applies to this call (the message says why); the caller takes the plain path."""


def ready(q: torch.Tensor, n_new: int, latent: bool = False) -> bool:
    """Whether a decode call with queries ``q`` and ``n_new`` new tokens may go to a kernel (before the caller
    writes the cache for it): on CPU float32/64 tensors, few new tokens, no autograd, kernels enabled and built
    (the first call builds them); on CUDA the Triton kernel, for latent attention only."""
    if q.device.type == "cuda":
        return latent and _triton_reason(q) is None
    return _cpu_reason(q, n_new) is None


def _cpu_reason(q: torch.Tensor, n_new: int) -> str | None:
    if q.device.type != "cpu":
        return f"tensors on {q.device}"
    if q.dtype not in _POOL_DTYPES:
        return f"queries of {q.dtype} (the CPU kernel computes in float32 / float64)"
    if n_new > MAX_NEW:
        return f"{n_new} new tokens (more than {MAX_NEW}: prefill-sized)"
    if torch.is_grad_enabled() and q.requires_grad:
        return "autograd is recording (the kernel has no backward)"
    if cpu.extension() is None:  # None when disabled or not built (one check of the environment, not two)
        return (
            f"disabled by {cpu.ENV}=0"
            if not cpu.enabled()
            else f"the extension did not build ({cpu.build_error()})"
        )
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of float32 CPU ``x`` over its last axis in one C++ pass (``F.rms_norm`` runs ~10 operators on
    CPU, the largest share of a decode step's small-operator time), or None where it does not apply: another
    dtype or device, a tensor subclass (a tensor-parallel DTensor), autograd recording, kernels unavailable, or
    under torch.compile."""
    # cheap checks first (19 calls a decode step): is_cpu and the class, not .device / .data, which build objects
    if type(x) is not torch.Tensor or x.dtype is not torch.float32 or not x.is_cpu:
        return None
    if type(weight) not in PLAIN_TENSORS or weight.dtype is not torch.float32 or not weight.is_cpu:
        return None  # a DTensor parameter is a DTensor: not taken
    if torch.compiler.is_compiling():
        return None  # F.rms_norm, which the compiler fuses
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    ext = cpu.extension()
    if ext is None:
        return None
    NORM_CALLS["rms_norm_cpu"] += 1
    return ext.rms_norm(x, weight, eps)


def _run(
    name: str,
    flops_per_key: int,
    items: int,
    view: BlockView,
    q,
    q_rope,
    k_pool,
    k_scale,
    v_pool,
    v_scale,
    kr_pool,
    n_new: int,
    scale: float,
) -> torch.Tensor:
    """The CPU kernel over ``view``'s pages: eagerly the extension itself, under torch.compile the custom
    operator of kvlm.kernels.library (the same call, opaque to the compiler, its host work inside: the split
    and the FLOP count, ``flops_per_key`` times the visible keys, which a traced step does not know)."""
    if torch.compiler.is_compiling():
        from kvlm.kernels.library import decode_attention

        return decode_attention(
            q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, view.block_table, view.start, view.end,
            view.page_size, n_new, scale, items, view.longest, name, flops_per_key,
        )  # fmt: skip
    CALLS[name] += 1
    count_flops("attention", flops_per_key * _keys(view))
    return cpu.extension().decode_attention(
        q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, view.block_table, view.start, view.end,
        view.page_size, n_new, scale, _splits(items, view),
    )  # fmt: skip


def _unavailable(strict: bool, why: str) -> None:
    if strict:
        raise KernelUnavailable(why)
    return None


def _check_call(name: str, T: int, n_new: int, q_rope, k_rope) -> None:
    """The errors every kernel entry raises for a malformed call (not a decline: a caller's bug)."""
    if T != n_new:
        raise ValueError(f"{name} has {T} new tokens, n_new says {n_new}")
    if (q_rope is None) != (k_rope is None):
        raise ValueError("q_rope and k_rope go together")


def _scale(scale: torch.Tensor | None) -> torch.Tensor | None:
    """(N, *lead, P, 1) per-token scales as float32 (what the kernel reads)."""
    return None if scale is None else scale.to(torch.float32)


def latent_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_kv: BlockView,
    k_rope: BlockView | None,
    n_new: int,
    scale: float,
    strict: bool = False,
) -> torch.Tensor | None:
    """z (B, H, T, D_c) = softmax(scale (q_lat c_kv^T + q_rope k_rope^T)) c_kv over each sequence's cached
    slots [start_b, end_b), causal among its T = ``n_new`` new tokens (the last T slots). q_lat (B, H, T, D_c),
    q_rope (B, H, T, d_R) or None; c_kv pool (N, P, D_c), k_rope pool (N, P, d_R) on the same pages.
    None (or KernelUnavailable if ``strict``) when no kernel applies."""
    B, H, T, Dc = q_lat.shape
    _check_call("q_lat", T, n_new, q_rope, k_rope)
    short = _too_short(c_kv, T)
    if short:
        return _unavailable(strict, short)
    if q_lat.device.type == "cuda":
        return _latent_triton(q_lat, q_rope, c_kv, k_rope, scale, strict)
    why = _cpu_reason(q_lat, n_new)
    why = why or _check_pool(q_lat, c_kv, "c_kv")
    if why is None and c_kv.pool.dim() != 3:
        why = f"c_kv pool of shape {tuple(c_kv.pool.shape)} (latent blocks: not this kernel)"
    why = why or _check_rope(q_lat, k_rope, c_kv, "c_kv")
    if why is not None:
        return _unavailable(strict, why)
    q = q_lat.reshape(B, 1, H * T, Dc)
    qr = None if q_rope is None else q_rope.reshape(B, 1, H * T, q_rope.shape[-1])
    pool = c_kv.pool.unsqueeze(1)
    s = _scale(c_kv.scale)
    s = None if s is None else s.unsqueeze(1)
    per_key = 2 * H * T * (2 * Dc + (0 if q_rope is None else q_rope.shape[-1]))
    kr = None if k_rope is None else k_rope.pool
    out = _run("latent_cpu", per_key, B, c_kv, q, qr, pool, s, pool, s, kr, n_new, scale)
    return out.view(B, H, T, Dc)


def latent_block_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_kv: BlockView,
    k_rope: BlockView | None,
    n_new: int,
    scale: float,
    strict: bool = False,
) -> torch.Tensor | None:
    """GLA / MLRA's absorbed route: ``latent_decode`` per latent block, the R units of block g attending over
    block g of the latent and the RoPE key shared by all blocks. q_lat (B, G, R, T, D), q_rope (B, G, R, T, d_R)
    or None; c_kv pool (N, G, P, D) (int8 / fp8: scales (N, G, P, 1), one per token and block), k_rope pool (N, P, d_R).
    Returns z (B, G, R, T, D). On CPU one call of the kernel with G groups (its group axis is the block axis);
    on CUDA one Triton call per block over strided views of the pool. None / KernelUnavailable as
    ``latent_decode``."""
    B, G, R, T, D = q_lat.shape
    _check_call("q_lat", T, n_new, q_rope, k_rope)
    short = _too_short(c_kv, T)
    if short:
        return _unavailable(strict, short)
    if q_lat.device.type == "cuda":
        return _latent_block_triton(q_lat, q_rope, c_kv, k_rope, scale, strict)
    why = _cpu_reason(q_lat, n_new) or _check_pool(q_lat, c_kv, "c_kv")
    if why is None and (c_kv.pool.dim() != 4 or c_kv.pool.shape[1] != G or c_kv.pool.shape[-1] != D):
        why = f"c_kv pool of shape {tuple(c_kv.pool.shape)} for {G} latent blocks of {D}"
    why = why or _check_rope(q_lat, k_rope, c_kv, "c_kv")
    if why is not None:
        return _unavailable(strict, why)
    q = q_lat.reshape(B, G, R * T, D)
    qr = None if q_rope is None else q_rope.reshape(B, G, R * T, q_rope.shape[-1])
    s = _scale(c_kv.scale)
    per_key = 2 * G * R * T * (2 * D + (0 if q_rope is None else q_rope.shape[-1]))
    kr = None if k_rope is None else k_rope.pool
    out = _run("latent_block_cpu", per_key, B * G, c_kv, q, qr, c_kv.pool, s, c_kv.pool, s, kr, n_new, scale)
    return out.view(B, G, R, T, D)


def gqa_decode(
    q: torch.Tensor,
    k: BlockView,
    v: BlockView,
    n_new: int,
    scale: float,
    strict: bool = False,
    q_rope: torch.Tensor | None = None,
    k_rope: BlockView | None = None,
) -> torch.Tensor | None:
    """o (B, Hq, T, D_v) = softmax(scale q k^T) v, query head i reading KV head i // (Hq / G): q (B, Hq, T, D),
    k pool (N, G, P, D), v pool (N, G, P, D_v) on the same pages; slots and causality as ``latent_decode``.
    With q_rope (B, Hq, T, d_R) and k_rope pool (N, P, d_R), one RoPE key shared by every head (GTA), the
    scores gain q_rope k_rope^T."""
    B, Hq, T, D = q.shape
    _check_call("q", T, n_new, q_rope, k_rope)
    why = _too_short(k, T) or _cpu_reason(q, n_new) or _check_pool(q, k, "k") or _check_pool(q, v, "v")
    why = why or _check_rope(q, k_rope, k, "K")
    if why is None and (k.pool.dim() != 4 or v.pool.dim() != 4):
        why = f"K/V pools of shapes {tuple(k.pool.shape)}, {tuple(v.pool.shape)} (expected (N, G, P, D))"
    if why is None and (Hq % k.pool.shape[1] or k.pool.shape[1] != v.pool.shape[1]):
        why = f"{Hq} query heads over {k.pool.shape[1]} / {v.pool.shape[1]} K/V heads"
    if why is None and not _same_pages(k, v):
        why = "K and V on different pages"
    if why is not None:
        return _unavailable(strict, why)
    G = k.pool.shape[1]
    dr = 0 if q_rope is None else q_rope.shape[-1]
    per_key = 2 * Hq * T * (D + dr + v.pool.shape[-1])
    qr = None if q_rope is None else q_rope.reshape(B, G, Hq // G * T, dr)
    out = _run(
        "gqa_cpu", per_key, B * G, k, q.reshape(B, G, Hq // G * T, D), qr, k.pool, _scale(k.scale), v.pool,
        _scale(v.scale), None if k_rope is None else k_rope.pool, n_new, scale,
    )  # fmt: skip
    return out.view(B, Hq, T, v.pool.shape[-1])


def _triton_reason(q: torch.Tensor) -> str | None:
    try:
        from kvlm.kernels import triton_decode
    except ImportError as e:  # pragma: no cover - the module is part of kvlm; triton itself is optional
        return f"kvlm.kernels.triton_decode: {e}"
    if not triton_decode.available():
        return "triton is not installed"
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"queries of {q.dtype}"
    if torch.is_grad_enabled() and q.requires_grad:
        return "autograd is recording (the kernel has no backward)"
    if not cpu.enabled():
        return f"disabled by {cpu.ENV}=0"
    return None


def _latent_block_triton(q_lat, q_rope, c_kv, k_rope, scale, strict):
    """One Triton call per latent block (its kernel has no group axis): block g's columns of the pool are a
    strided view, and the kernel takes any strides. (Tested on CPU tensors in Triton's interpreter.)"""
    why = _triton_reason(q_lat)
    if why is not None:
        return _unavailable(strict, why)
    z = torch.empty_like(q_lat)
    for g in range(q_lat.shape[1]):
        view = replace(c_kv, pool=c_kv.pool[:, g], scale=None if c_kv.scale is None else c_kv.scale[:, g])
        qr = None if q_rope is None else q_rope[:, g]
        z[:, g] = _latent_triton(q_lat[:, g], qr, view, k_rope, scale, strict)
    return z


def _latent_triton(q_lat, q_rope, c_kv, k_rope, scale, strict):
    why = _triton_reason(q_lat)
    if why is not None:
        return _unavailable(strict, why)
    from kvlm.kernels import triton_decode

    CALLS["latent_triton"] += 1
    d_r = 0 if q_rope is None else q_rope.shape[-1]
    count_flops("attention", 2 * q_lat.shape[1] * q_lat.shape[2] * _keys(c_kv) * (2 * q_lat.shape[-1] + d_r))
    return triton_decode.latent_decode_triton(q_lat, q_rope, c_kv, k_rope, scale)


__all__ = [
    "CALLS",
    "FLOPS",
    "MAX_NEW",
    "KernelUnavailable",
    "ready",
    "gqa_block_call",
    "mla_block_call",
    "block_stack",
    "gqa_decode",
    "latent_block_decode",
    "latent_decode",
]
