"""The CPU decode kernel as a ``torch.library`` custom operator, for compiled decode steps.

Eager calls go straight to the extension (``kvlm.kernels``: no dispatcher in between). Under ``torch.compile``
the extension's pybind function would break the graph, and the kernels' host-side work (the call and FLOP
counters, the thread count that sets the splits) would be traced and guarded on; ``kvlm::decode_attention``
does that work inside, opaque to the compiler, with a fake implementation that gives the output's shape.
"""

from __future__ import annotations

import torch

from kvlm.kernels.cpu import extension


@torch.library.custom_op("kvlm::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    q_rope: torch.Tensor | None,
    k_pool: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_pool: torch.Tensor,
    v_scale: torch.Tensor | None,
    kr_pool: torch.Tensor | None,
    block_table: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    page_size: int,
    n_new: int,
    scale: float,
    items: int,
    longest: int,
    name: str,
    flops: int,
) -> torch.Tensor:
    from kvlm.kernels.shared import CALLS, FLOPS, split_count

    CALLS[name] += 1
    FLOPS["total"] += flops
    return extension().decode_attention(
        q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, block_table, start, end, page_size, n_new, scale,
        split_count(items, longest),
    )  # fmt: skip


@decode_attention.register_fake
def _(q, q_rope, k_pool, k_scale, v_pool, v_scale, kr_pool, block_table, start, end, page_size, n_new, scale,
      items, longest, name, flops):  # fmt: skip
    return q.new_empty((*q.shape[:-1], v_pool.shape[-1]))
