"""Checks of the cache views (``BlockView``: pool, block table, start / end) that the decode kernels read in
place, shared by the attention kernels' dispatch (``kvlm.kernels``) and the block kernels (``kvlm.kernels.block``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvlm.kernels.shared import split_count, visible_keys

if TYPE_CHECKING:
    from kvlm.cache.layer import BlockView

_FP8 = getattr(torch, "float8_e4m3fn", None)  # fp8 e4m3 codes, where this torch has the dtype
_QUANT = tuple(t for t in (torch.int8, _FP8) if t is not None)  # 1-byte codes with a per-token scale
_POOL_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16, *_QUANT),
    torch.float64: (torch.float64, *_QUANT),
}



def _check_pool(q: torch.Tensor, view: BlockView, what: str) -> str | None:
    if view.pool.dtype not in _POOL_DTYPES[q.dtype]:
        return f"{what} pool of {view.pool.dtype} with {q.dtype} queries"
    if view.pool.stride(-1) != 1:
        return f"{what} pool not contiguous in its last axis"
    if view.block_table.dtype != torch.int32 or view.start.dtype != torch.int32:
        return f"{what} block table / start / end not int32"
    if (view.scale is not None) != (view.pool.dtype in _QUANT):
        return f"{what}: int8 / fp8 pools need a per-token scale, others none"
    if view.pool.shape[-2] != view.page_size:
        return f"{what} pool's page axis {view.pool.shape[-2]} is not the page size {view.page_size}"
    return None


def _check_rope(q: torch.Tensor, k_rope: BlockView | None, partner: BlockView, name: str) -> str | None:
    """Why the kernel cannot read the shared RoPE key pool beside ``partner`` (None if it can, or if none)."""
    if k_rope is None:
        return None
    why = _check_pool(q, k_rope, "k_rope")
    if why is None and (k_rope.pool.dim() != 3 or k_rope.scale is not None):
        why = "grouped or quantized RoPE keys"
    if why is None and not _same_pages(partner, k_rope):
        why = f"{name} and k_rope on different pages"
    return why


def _same_pages(a: BlockView, b: BlockView) -> bool:
    if a.page_size != b.page_size:
        return False
    if a.block_table is b.block_table and a.start is b.start and a.end is b.end:
        return True
    return all(
        torch.equal(x, y) for x, y in ((a.block_table, b.block_table), (a.start, b.start), (a.end, b.end))
    )


def _splits(items: int, view: BlockView) -> int:
    return split_count(items, view.longest, view.start, view.end)


def _keys(view: BlockView) -> int:
    """Cached keys of all sequences of a view (for the FLOP count): the cache's host value, else read back."""
    return view.keys if view.keys is not None else visible_keys(view.start, view.end)


def _too_short(view: BlockView, T: int) -> str | None:
    """Why a kernel cannot take a call whose rows' last T slots are not all new tokens: a row of a paged call
    left-padded to T columns holding fewer than T slots (its padding is never stored)."""
    if view.shortest is not None and view.shortest < T:
        return f"a row holds {view.shortest} slots, fewer than the call's {T} new tokens (a padded row)"
    return None
