"""Decode's weight products at a few rows on CPU: ``few_rows_linear`` runs [x W_1^T + b_1, ...] through the
few-row kernel (csrc/few_rows.h; AVX-512, or AVX2 + FMA), which reads each plain float32 weight once for all
rows of x; ``few_rows_head_matmul`` runs absorbed MLA's per-head products x_h W_h the same way.

Decode multiplies batch x new-token rows by every weight, so its time is the time to read them. Streaming the
reference shape's 268 MB of weights, 2 threads (``benchmarks/few_rows_gemm.py``; ms, lower is better):

| CPU | rows | F.linear | MKL packed for the rows | few-row kernel |
|---|---:|---:|---:|---:|
| AMD EPYC (Zen 5) | 1 / 2 / 8 | 16.4 / 29.9 / 25.4 | - / 20.1 / 24.6 | 4.8 / 5.2 / 7.6 |
| Intel Xeon 2.5 GHz | 1 / 2 / 8 | 15.7 / 16.0 / 43.1 | - / 18.5 / 21.5 | 14.9 / 15.5 / 20.4 |

From 4 rows the kernel prefetches each weight row 32 KiB ahead into L2 and 2 KiB ahead into L1 (csrc/few_rows.h):
at 8 rows on the AMD EPYC 4.8-4.9 ms (55 GB/s) where 16 KiB ahead into L1 alone took 6.9-7.1 ms, in rounds when
the machine streamed ~60 GB/s; even (1.05x) when other tenants held it at ~37.

So up to ``FEW_ROWS`` rows ``kvlm.attention.linear.Linear`` takes it before any packed copy. From 9 to
``MAX_ROWS`` rows the products become compute-dense and which path wins depends on the CPU: at 16 rows the
kernel streamed the weights in 11.4 ms against MKL packed 29.7 on the AMD EPYC, 33.5 against 26.2 on the Intel
Xeon, and oneDNN's blocked layout in 10.1 on the AMD EPYC. There it runs where no packed copy applies, and
``generate`` packs where MKL's or oneDNN's layout measured faster on this machine
(``kvlm.attention.linear.fastest_packing``). On AVX2 (the kernel's 4 x 3 micro-kernel, few_rows_avx2.h) it stays
ahead further: on the Zen 3 EPYC, the reference shape's weights at 24 / 32 / 48 / 64 rows in 24.6 / 33.5 / 49.4 /
71.8 ms against oneDNN's layout 33.2 / 45.4 / 58.2 / 80.7 and F.linear 59.6 / 72.3 / 96.4 / 127.4, so there
``MAX_ROWS`` is 64 (decode steps of 24-64 rows 1.22-1.56x faster than on oneDNN's copy, benchmarks/decode-limit.md).

``pack_panels`` makes the decode-time copy in panels (``Linear.pack_for_decode(PANELS)``, csrc/few_rows_panels.h):
32 weight rows column by column, read as one sequential stream by an outer product. On the AMD EPYC, the reference
shape's 268 MB: 1.06-1.29x faster than the plain-weight kernel at 2-8 rows (level at 1), 1.14-1.17x faster than
oneDNN's layout at 12-16 rows (benchmarks/decode-limit.md); a second copy of the weights, so ``generate`` takes it
from 2 rows where it measured faster (``fastest_packing``).
"""

from __future__ import annotations

import torch

from kvlm.hugepages import zeros_in_huge_pages
from kvlm.kernels.cpu import avx2_only, extension, has
from kvlm.kernels.shared import LINEAR_CALLS, PLAIN_TENSORS, count_flops

FEW_ROWS = 8  # rows up to which the kernel takes the product first (faster than every library path measured)
# rows up to which it takes the products that no packed copy serves: 64 where it is the AVX2 micro-kernel (its lead
# over oneDNN's layout 1.35x at 32 rows, 1.12-1.23x at 64 on the Zen 3 EPYC; the decode step there at 64 rows
# 1.22-1.33x, and 64 is the serving engine's default batch); 16 on AVX-512, where oneDNN's layout was ahead from
# 12-16 rows
MAX_ROWS = 64 if avx2_only() else 16


def few_rows_fit(x: torch.Tensor, first: bool = True) -> bool:
    """Whether products of ``x`` have the shape and kind the kernel takes: float32 on CPU, 1 to ``FEW_ROWS`` rows
    (``first``: before any packed copy) or to ``MAX_ROWS`` (those no packed copy serves). (The weights and the
    kernel's presence are checked when it runs.)"""
    k = x.shape[-1]
    most = FEW_ROWS if first else MAX_ROWS
    return x.is_cpu and x.dtype is torch.float32 and k > 0 and 0 < x.numel() <= most * k


def _plain(t: torch.Tensor) -> bool:
    """A contiguous float32 CPU tensor of torch's own classes."""
    return type(t) in PLAIN_TENSORS and t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def few_rows_available() -> bool:
    """Whether this machine has the kernel: the extension built (kernels enabled) on an AVX-512 or AVX2 + FMA CPU."""
    return has("few_rows_linear")


def panels_available() -> bool:
    """Whether this machine has the kernel on panels (``pack_panels``; AVX-512 only)."""
    return has("panel_linear")


def head_products_available() -> bool:
    """Whether this machine has the per-head products (``few_rows_head_matmul``; AVX-512 or AVX2 + FMA)."""
    return has("head_products")


def few_rows_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    count: bool = True,
    first: bool = True,
) -> torch.Tensor | None:
    """[x W_1^T + b_1, ..., x W_n^T + b_n] concatenated on the last axis (x (..., K), W_i (N_i, K)) by the
    few-row kernel, or None where it does not apply: other shapes or dtypes (``few_rows_fit``: up to ``FEW_ROWS``
    rows when ``first``, else ``MAX_ROWS``), weights or biases not plain contiguous float32 CPU tensors, autograd recording,
    under torch.compile (the operator ``kvlm::packed_linear`` calls this when it runs), kernels disabled or neither
    AVX-512 nor AVX2. ``count``: add its FLOPs to the kernels' running total (torch's FLOP counter does not see the
    extension)."""
    # every weight and bias checked in one loop each, no generator, and the leading axes kept in C++: a decode
    # step makes ~30 of these calls, and their Python is part of its cost (~4.5 us a call, 1.8 of it the kernel)
    if type(x) not in PLAIN_TENSORS or not few_rows_fit(x, first) or torch.compiler.is_compiling():
        return None
    grad_on = torch.is_grad_enabled()
    grad = grad_on and x.requires_grad
    k, n = x.shape[-1], 0
    for w in weights:
        if not _plain(w) or w.dim() != 2 or w.shape[1] != k:
            return None  # a caller's shape error: F.linear names it
        grad = grad or (grad_on and w.requires_grad)
        n += w.shape[0]
    if grad:
        return None
    for b in biases:
        if b is not None and not _plain(b):
            return None
    ext = extension()
    if ext is None or not hasattr(ext, "few_rows_linear"):
        return None
    if count:
        count_flops("linear", 2 * x.numel() * n)
    LINEAR_CALLS["few_rows"] += 1
    return ext.few_rows_linear(x if x.is_contiguous() else x.contiguous(), weights, biases)


def few_rows_head_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x (B, h, T, a) times w (h, a, b) head by head -> (B, h, T, b), as ``latent_ops.head_matmul`` computes it
    with torch.bmm, by the kernel's per-head product (``head_products`` in csrc/few_rows.h: each head's matrix read
    once for the B T rows), or None where it does not apply: more than ``MAX_ROWS`` rows, b not a multiple of 16,
    tensors not plain float32 CPU ones, autograd recording, under torch.compile, kernels disabled or neither AVX-512
    nor AVX2. MLA's absorbed decode makes two such products a layer (q^C W~^UK, z W~^UV): at the bench reference shape a
    decode step 1.02-1.03x faster than through torch.bmm at batch 8, even at batch 1 (benchmarks/decode-limit.md)."""
    if type(x) not in PLAIN_TENSORS or x.dtype is not torch.float32 or not x.is_cpu or x.dim() != 4 or not _plain(w):
        return None
    B, h, T, a = x.shape
    rows = B * T
    if not 0 < rows <= MAX_ROWS or w.dim() != 3 or w.shape[0] != h or w.shape[1] != a or w.shape[2] % 16:
        return None
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return None
    ext = extension()
    if ext is None or not hasattr(ext, "head_products"):
        return None
    count_flops("linear", 2 * rows * h * a * w.shape[2])
    LINEAR_CALLS["head_products"] += 1
    if x.stride(-1) != 1:
        x = x.contiguous()
    # (h, B T, a): a view when T == 1 or B == 1 (decode), else a copy; the result (B T, h, b) viewed as (B, h, T, b)
    y = ext.head_products(x.transpose(0, 1).reshape(h, rows, a), w)
    return y.view(B, T, h, -1).transpose(1, 2)


PANEL = 32  # weight rows a panel (csrc/few_rows_panels.h)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """W (N, K) -> its panels (ceil(N / 32), 32 K): panel p holds rows [32 p, 32 p + 32) column by column,
    P[p, 32 k + j] = W[32 p + j, k], zeros past N; in huge pages where that applies, as the weights are."""
    n, k = w.shape
    rows = -(-n // PANEL) * PANEL
    padded = w.new_zeros(rows, k)
    padded[:n] = w
    out = zeros_in_huge_pages((rows // PANEL, PANEL * k), w.dtype, w.device)
    return out.copy_(padded.view(rows // PANEL, PANEL, k).transpose(1, 2).reshape(rows // PANEL, PANEL * k))


def panel_product(
    x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None, count: bool = True
) -> torch.Tensor:
    """x W^T + b from W's panels (``pack_panels``; n: W's rows) by the kernel, which must be available (the caller,
    ``kvlm.attention.linear``, packs only where ``panels_available``): float32 CPU tensors, no autograd.
    ``count``: add its FLOPs to the kernels' running total."""
    if count:
        count_flops("linear", 2 * x.numel() * n)
    LINEAR_CALLS["panels"] += 1
    return extension().panel_linear(x, panels, n, bias)
