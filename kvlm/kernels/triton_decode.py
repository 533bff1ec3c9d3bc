"""Triton kernel for absorbed latent-attention decode (MLA's absorbed route) over a paged cache, any widths.

    z[b, h, t] = softmax_j(scale (q_lat[b,h,t] . c_kv[b,j] + q_rope[b,h,t] . k_rope[b,j])) c_kv[b, j]

over sequence b's logical key slots j in [start_b, end_b), query t of the T new tokens seeing keys
j < end_b - T + t + 1 (the new tokens are the last T slots). Flash-decoding, FlashMLA style: the grid is
(sequence, block of query rows, split of the key axis). The H x T query rows of one sequence share one latent
per key (that is what absorption buys), so a program loads each tile of cached latents once for a whole block of
rows, uses it both as key (scores) and as value (p . c_kv), and keeps an online softmax; with several splits
each writes its partial (lse, normalised acc) and a second small kernel merges them by log-sum-exp.

Unlike FlashMLA (512 + 64 only; its issue #78 asks for other sizes) any D_c and d_R work: tiles are padded
to the next power of two and masked, d_R = 0 drops the RoPE term. The cache is read through a block table
(page size any value >= 1, the physical slot computed per key), so one kernel serves the contiguous cache
(N = B pages of P = max_seq_len slots) and the paged one. int8 / fp8 pools carry a per-token scale; since it is
one number per key it is applied to that key's score and probability rather than to every element of the
tile (exact: s_j (q . c_j) = q . (s_j c_j)), and int8 values convert exactly to fp16/bf16 for the MMA.

Inputs fp32/bf16/fp16, accumulation fp32; fp32 inputs use IEEE fp32 products (no TF32), so the kernel stays
comparable with the float64 reference. Tested on CPU with TRITON_INTERPRET=1 (tests/test_triton_decode.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kvlm.logs import get_logger

if TYPE_CHECKING:
    from kvlm.cache.layer import BlockView

log = get_logger(__name__)

try:  # triton is optional: CPU-only installs import this module and see `available() == False`
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = tl = None
    OutOfResources = RuntimeError

_LOG2E = 1.4426950408889634
_QUANT_DTYPES = (torch.int8, getattr(torch, "float8_e4m3fn", torch.int8))


def available() -> bool:
    """Whether triton imported (the kernel also needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors)."""
    return triton is not None


@dataclass(frozen=True)
class Config:
    """Launch parameters. ``block_m`` query rows (heads x new tokens) per program, ``block_n`` keys per tile,
    ``num_splits`` pieces of the key axis (None: enough to fill the GPU, see ``choose_splits``)."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None


def default_config(rows: int, d_c: int, d_r: int, itemsize: int = 2) -> Config:
    """A launch config from the shape alone. BLOCK_M at least 16 (the MMA's smallest M), at most 64 rows: the
    fp32 accumulator of 64 x D_c stays in registers up to D_c = 512 with 8 warps.

    Keys per tile, from two runs on an H100 (benchmarks/triton.md): with 64 rows per program 64 keys beat 32
    (2.9 vs 3.8 ms at 512 + 64, 128 heads, batch 64, 32K tokens); with 16 rows and a 512-wide latent 32 keys
    beat 64 (1.45 vs 2.0 ms, 16 heads, same size); narrower latents take 64. fp32 (the exact path) keeps
    32 keys for wide latents, the config its GPU tests passed with (with 64 the fp32 512 + 64 test had not
    finished within 90 s: 2 x 64 x 576 x 4 bytes of tiles exceed shared memory, and the retries recompile)."""
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    width = triton.next_power_of_2(d_c) + (triton.next_power_of_2(d_r) if d_r else 0)
    num_warps = 8 if block_m * width >= 64 * 512 else 4
    wide = width >= 512
    block_n = 32 if wide and (itemsize >= 4 or block_m < 64) else 64
    return Config(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=2)


_SHRUNK: dict[tuple, Config] = {}  # default configs that ran out of resources -> the one that launched


def _shrink(cfg: Config) -> Config | None:
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 16:
        return replace(cfg, block_n=cfg.block_n // 2, num_stages=2)
    return None


def choose_splits(
    batch: int,
    row_blocks: int,
    max_keys: int,
    block_n: int,
    n_sm: int,
    block_m: int = 16,
    per_sm: int | None = None,
    min_tiles: int = 4,
) -> int:
    """Split the key axis until about ``per_sm`` programs per SM are in flight (a memory-bound kernel needs many
    loads in flight), but give each split at least ``min_tiles`` key tiles: each split writes a (rows, D_c) fp32
    partial that the merge reads back, which must stay small next to the latents it summarises.

    ``per_sm`` by default 8 for programs of up to 16 query rows, 2 up to 32, 1 for 64 (a 64-row program does 4x
    the work per key: fewer in flight, fewer partials). From a sweep on an H200 (benchmarks/triton.md), against
    the earlier rule (2 per SM, 2 tiles): 16 heads of 512 + 64 at batch 64 / 16K keys 1.46x faster (17 splits,
    not 5), batch 1 / 8K 1.27x (64, not 128); 128 heads at batch 8 / 4K about 1.2x (8 splits, not 17) and batch
    1 / 32K about 1.5x (64, not 132); batch 8 / 4K at 16 heads unchanged. The 32-row value is interpolated."""
    if per_sm is None:
        per_sm = 8 if block_m <= 16 else 2 if block_m <= 32 else 1
    programs = batch * row_blocks
    want = max(1, (per_sm * n_sm + programs - 1) // programs)
    most = max(1, max_keys // (min_tiles * block_n))
    return int(min(want, most, 256))


if triton is not None:

    @triton.jit
    def _latent_decode_kernel(
        Q, QR, KV, KR, KV_SCALE, KR_SCALE, BT, START, END, O, O_PART, LSE_PART,
        sm_scale_log2,
        s_qb, s_qh, s_qt, s_qd,
        s_qrb, s_qrh, s_qrt, s_qrd,
        s_kvn, s_kvp, s_kvd,
        s_krn, s_krp, s_krd,
        s_kvsn, s_kvsp,
        s_krsn, s_krsp,
        s_btb, s_btk,
        s_ob, s_oh, s_ot, s_od,
        s_pb, s_pr, s_ps,
        T, D, DR, page_size, num_splits, n_rows,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
        HAS_ROPE: tl.constexpr, KV_QUANT: tl.constexpr, KR_QUANT: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        # row blocks vary fastest, so the programs sharing one sequence's keys run together and the second
        # reads the latents from L2
        row0 = tl.program_id(0) * BLOCK_M
        b = tl.program_id(1)
        split = tl.program_id(2)
        dtype = tl.float32 if DOT_F32 else Q.dtype.element_ty  # the MMA's input type

        rows = row0 + tl.arange(0, BLOCK_M)  # row r = h * T + t
        row_ok = rows < n_rows
        h = rows // T
        t = rows % T
        start = tl.load(START + b)
        end = tl.load(END + b)
        # this split's keys: the sequence's range cut into num_splits pieces of whole tiles
        chunk = tl.cdiv(tl.cdiv(end - start, num_splits), BLOCK_N) * BLOCK_N
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, end)
        limit = end - T + t + 1  # query t sees keys j < limit (causal among the new tokens)

        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q = tl.load(
            Q + b * s_qb + h[:, None] * s_qh + t[:, None] * s_qt + offs_d[None, :] * s_qd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(dtype)
        if HAS_ROPE:
            offs_r = tl.arange(0, BLOCK_R)
            r_ok = offs_r < DR
            qr = tl.load(
                QR + b * s_qrb + h[:, None] * s_qrh + t[:, None] * s_qrt + offs_r[None, :] * s_qrd,
                mask=row_ok[:, None] & r_ok[None, :],
                other=0.0,
            ).to(dtype)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for j0 in range(lo, hi, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            j_ok = j < hi
            # physical slot of every key: tiles may span pages, so look each one up
            page = tl.load(BT + b * s_btb + (j // page_size) * s_btk, mask=j_ok, other=0).to(tl.int64)
            slot = j % page_size
            kv = tl.load(
                KV + page[:, None] * s_kvn + slot[:, None] * s_kvp + offs_d[None, :] * s_kvd,
                mask=j_ok[:, None] & d_ok[None, :],
                other=0.0,
            ).to(dtype)  # int8 values are exact in fp16/bf16/fp32; the scale is applied per key below
            qk = tl.dot(q, tl.trans(kv), input_precision=PRECISION)
            if KV_QUANT:
                kv_s = tl.load(KV_SCALE + page * s_kvsn + slot * s_kvsp, mask=j_ok, other=0.0).to(tl.float32)
                qk = qk * kv_s[None, :]
            if HAS_ROPE:
                kr = tl.load(
                    KR + page[:, None] * s_krn + slot[:, None] * s_krp + offs_r[None, :] * s_krd,
                    mask=j_ok[:, None] & r_ok[None, :],
                    other=0.0,
                ).to(dtype)
                qk_r = tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
                if KR_QUANT:
                    kr_s = tl.load(KR_SCALE + page * s_krsn + slot * s_krsp, mask=j_ok, other=0.0)
                    qk_r = qk_r * kr_s.to(tl.float32)[None, :]
                qk += qk_r
            visible = j_ok[None, :] & (j[None, :] < limit[:, None])
            qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if KV_QUANT:
                p = p * kv_s[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(dtype), kv, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0.0  # rows that saw no key (an empty split, or an empty sequence) write zeros
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if SPLIT:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            part = b * s_pb + rows * s_pr + split * s_ps
            tl.store(LSE_PART + part // BLOCK_D, lse, mask=row_ok)  # the lse pool is the partials' stride / D
            tl.store(O_PART + part[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        else:
            o_ptr = O + b * s_ob + h[:, None] * s_oh + t[:, None] * s_ot + offs_d[None, :] * s_od
            tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _merge_kernel(
        O_PART, LSE_PART, O,
        s_pb, s_pr, s_ps,
        s_ob, s_oh, s_ot, s_od,
        T, D, num_splits,
        BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program per (sequence, query row): sum the splits' partials weighted by exp2(lse_s - lse)."""
        b = tl.program_id(0)
        r = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        base = b * s_pb + r * s_pr
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        den = tl.zeros([1], dtype=tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(LSE_PART + (base + s * s_ps) // BLOCK_D + tl.arange(0, 1))
            o = tl.load(O_PART + base + s * s_ps + offs_d, mask=d_ok, other=0.0)
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m - m_safe)
            w = tl.exp2(lse - m_safe)
            den = den * alpha + w
            acc = acc * alpha + w * o
            m = m_new
        out = acc / tl.where(den > 0.0, den, 1.0)
        h = r // T
        t = r % T
        tl.store(O + b * s_ob + h * s_oh + t * s_ot + offs_d * s_od, out.to(O.dtype.element_ty), mask=d_ok)


def _check(
    q_lat, q_rope, c_kv_pool, k_rope_pool, block_table, start, end, page_size, c_kv_scale, k_rope_scale
):
    """One clear error for each shape or dtype the kernel cannot take."""
    if q_lat.dim() != 4:
        raise ValueError(f"q_lat must be (B, H, T, D_c), got shape {tuple(q_lat.shape)}")
    B, H, T, D = q_lat.shape
    if q_lat.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q_lat must be float32, float16 or bfloat16, got {q_lat.dtype}")
    if c_kv_pool.dim() != 3 or c_kv_pool.shape[-1] != D:
        raise ValueError(f"c_kv pool must be (N_pages, P, D_c={D}), got shape {tuple(c_kv_pool.shape)}")
    if c_kv_pool.shape[1] != page_size or page_size < 1:
        raise ValueError(
            f"page_size {page_size} does not match the c_kv pool's page axis {c_kv_pool.shape[1]}"
        )
    if (q_rope is None) != (k_rope_pool is None):
        raise ValueError("q_rope and the k_rope pool must be given together (or both None for d_R = 0)")
    if q_rope is not None:
        if q_rope.shape[:3] != q_lat.shape[:3]:
            raise ValueError(
                f"q_rope {tuple(q_rope.shape)} must be (B, H, T, d_R) like q_lat {tuple(q_lat.shape)}"
            )
        if k_rope_pool.dim() != 3 or k_rope_pool.shape[:2] != c_kv_pool.shape[:2]:
            raise ValueError(
                f"k_rope pool must be (N_pages, P, d_R) with the c_kv pool's pages {tuple(c_kv_pool.shape[:2])}, "
                f"got {tuple(k_rope_pool.shape)} (grouped RoPE keys are not supported by this kernel)"
            )
        if k_rope_pool.shape[-1] != q_rope.shape[-1]:
            raise ValueError(f"d_R differs: q_rope {q_rope.shape[-1]}, k_rope pool {k_rope_pool.shape[-1]}")
    for name, pool, scale in (("c_kv", c_kv_pool, c_kv_scale), ("k_rope", k_rope_pool, k_rope_scale)):
        if pool is None:
            continue
        if (pool.dtype in _QUANT_DTYPES) != (scale is not None):
            raise ValueError(f"{name} pool of {pool.dtype} needs a per-token scale exactly when int8/fp8")
        if scale is not None and scale.numel() != pool.shape[0] * pool.shape[1]:
            raise ValueError(f"{name} scale must be (N_pages, P[, 1]), got {tuple(scale.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be (B={B}, max_blocks), got {tuple(block_table.shape)}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32 or int64, got {block_table.dtype}")
    for name, x in (("start", start), ("end", end)):
        if x.shape != (B,) or x.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an int32 (B={B},) tensor, got {x.dtype} {tuple(x.shape)}")
    tensors = [q_lat, q_rope, c_kv_pool, k_rope_pool, block_table, start, end, c_kv_scale, k_rope_scale]
    devices = {x.device for x in tensors if x is not None}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def latent_decode_paged(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_kv_pool: torch.Tensor,
    k_rope_pool: torch.Tensor | None,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    c_kv_scale: torch.Tensor | None = None,
    k_rope_scale: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """Absorbed latent attention over a paged cache; returns (B, H, T, D_c) in q_lat's dtype.

    q_lat (B, H, T, D_c), q_rope (B, H, T, d_R) or None; c_kv_pool (N_pages, P, D_c) and k_rope_pool
    (N_pages, P, d_R) (any strides, any dtype, int8/fp8 with per-token scales (N_pages, P[, 1])); logical slot j of
    sequence b lives at page block_table[b, j // P], offset j % P; sequence b's keys are slots [start_b, end_b),
    its T new tokens the last T of them. Rows that see no key at all (end_b - start_b < T) come out zero.
    """
    _check(
        q_lat, q_rope, c_kv_pool, k_rope_pool, block_table, start, end, page_size, c_kv_scale, k_rope_scale
    )
    if triton is None:
        raise RuntimeError("latent_decode_paged needs triton, which is not installed")
    B, H, T, D = q_lat.shape
    DR = 0 if q_rope is None else q_rope.shape[-1]
    n_rows = H * T
    cfg = config or default_config(n_rows, D, DR, q_lat.element_size())
    block_d = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16
    block_r = max(16, triton.next_power_of_2(DR)) if DR else 16
    row_blocks = triton.cdiv(n_rows, cfg.block_m)
    if cfg.num_splits is not None:
        splits = cfg.num_splits
    else:
        # the largest context bounds the splits; a host-side bound avoids a device sync on `end - start`
        n_sm = torch.cuda.get_device_properties(q_lat.device).multi_processor_count if q_lat.is_cuda else 8
        max_keys = block_table.shape[1] * page_size
        splits = choose_splits(B, row_blocks, max_keys, cfg.block_n, n_sm, cfg.block_m)
    out = torch.empty(B, H, T, D, dtype=q_lat.dtype, device=q_lat.device)
    dummy = torch.empty(1, dtype=torch.float32, device=q_lat.device)
    qr = q_rope if DR else dummy
    kr = k_rope_pool if DR else dummy
    kv_s = c_kv_scale.reshape(c_kv_pool.shape[:2]) if c_kv_scale is not None else dummy.view(1, 1)
    kr_s = (
        k_rope_scale.reshape(c_kv_pool.shape[:2]) if (DR and k_rope_scale is not None) else dummy.view(1, 1)
    )
    if splits > 1:
        # partials (B, rows, splits, BLOCK_D) fp32 and their lse (B, rows, splits): same index / BLOCK_D
        o_part = torch.empty(B, n_rows, splits, block_d, dtype=torch.float32, device=q_lat.device)
        lse_part = torch.empty(B, n_rows, splits, dtype=torch.float32, device=q_lat.device)
    else:
        o_part = lse_part = dummy
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"  # tf32 is ignored for 16-bit inputs
    # Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584, "not supported
    # yet"): there the MMA inputs are upcast to fp32; compiled kernels keep bf16
    dot_f32 = q_lat.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    precision = "ieee" if dot_f32 else precision
    qr_strides = qr.stride() if DR else (0, 0, 0, 0)
    kr_strides = kr.stride() if DR else (0, 0, 0)
    part_strides = (n_rows * splits * block_d, splits * block_d, block_d) if splits > 1 else (0, 0, 0)
    args = (
        q_lat, qr, c_kv_pool, kr, kv_s, kr_s, block_table, start, end, out, o_part, lse_part,
        softmax_scale * _LOG2E,
        *q_lat.stride(), *qr_strides, *c_kv_pool.stride(), *kr_strides, *kv_s.stride(), *kr_s.stride(),
        *block_table.stride(), *out.stride(), *part_strides,
        T, D, DR, page_size, splits, n_rows,
    )  # fmt: skip
    flags = dict(
        BLOCK_D=block_d, BLOCK_R=block_r, HAS_ROPE=DR > 0, KV_QUANT=c_kv_scale is not None,
        KR_QUANT=DR > 0 and k_rope_scale is not None, SPLIT=splits > 1, PRECISION=precision, DOT_F32=dot_f32,
    )  # fmt: skip
    key = (D, DR, cfg, q_lat.dtype, c_kv_pool.dtype)
    cfg = _SHRUNK.get(key, cfg)
    while True:
        try:
            _latent_decode_kernel[(row_blocks, B, splits)](
                *args, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **flags,
            )  # fmt: skip
            break
        except OutOfResources:
            # a default config too big for this GPU's shared memory (fp32 tiles of a wide latent): smaller key
            # tiles, then fewer pipeline stages; a config the caller chose is not second-guessed
            smaller = _shrink(cfg)
            if config is not None or smaller is None:
                raise
            log.info("latent decode kernel: %s is out of resources here, trying %s", cfg, smaller)
            cfg = _SHRUNK[key] = smaller
    if splits > 1:
        _merge_kernel[(B, n_rows)](
            o_part, lse_part, out, *part_strides, *out.stride(), T, D, splits,
            BLOCK_D=block_d, num_warps=4 if block_d >= 256 else 1,
        )  # fmt: skip
    return out


def latent_decode_triton(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor | None,
    c_kv: BlockView,
    k_rope: BlockView | None,
    softmax_scale: float | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """``latent_decode_paged`` reading the cache through BlockViews (kvlm.cache.layer): c_kv's and k_rope's
    pools (N_pages, P, last) share the block table, start/end and page size; ``scale`` is the per-token scale
    pool of an int8/fp8 cache. softmax_scale defaults to 1/sqrt(D_c + d_R)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q_lat.shape[-1] + (0 if q_rope is None else q_rope.shape[-1]))
    return latent_decode_paged(
        q_lat,
        q_rope,
        c_kv.pool,
        None if k_rope is None else k_rope.pool,
        c_kv.block_table,
        c_kv.start,
        c_kv.end,
        c_kv.page_size,
        softmax_scale,
        c_kv_scale=c_kv.scale,
        k_rope_scale=None if k_rope is None else k_rope.scale,
        config=config,
    )
