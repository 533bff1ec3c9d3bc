"""Collectives kvlm needs beyond what DTensor does for it, each written once.

- ``all_reduce_sum``: the sum of the ranks' partial outputs with autograd (Megatron's reduce out of the
  tensor-parallel region; the gradient passes through unchanged because the input of the layer is replicated).
- ``all_to_all_uneven``: all_to_all_single of a flat tensor with uneven splits, with autograd (the gradient goes
  back the way the values came); EG-MLA's embedding parallelism exchanges gate-table slices with it.
- ``all_gather_uneven``: every rank's tensor, concatenated along one dim, when the ranks hold different sizes
  along it (padded to the largest for the transfer, trimmed after); optionally gathered to one rank only.
- small object collectives for the training loop: ``gather_objects``, ``broadcast_float``, ``barrier``.

Every function takes a process group (None: the default group; a DeviceMesh gives one with
``mesh.get_group()``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum of the ranks' partial outputs (Megatron's reduce out of the tensor-parallel region). The input
    of the layer is replicated, so the gradient of each partial output is the gradient of the sum."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of `x` over the ranks of `group` (a new tensor; differentiable)."""
    return _AllReduceSum.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of a flat tensor with uneven splits; the backward sends gradients back the
    way the values came. `timed` is a context manager factory wrapped around each transfer."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, timed):
        ctx.splits = (out_splits, in_splits, group, timed)
        out = x.new_empty(sum(out_splits))
        with timed(x.device):
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group, timed = ctx.splits
        back = grad.new_empty(sum(in_splits))
        with timed(grad.device):
            dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=group)
        return back, None, None, None, None


def _untimed(device: torch.device):
    return contextlib.nullcontext()


def all_to_all_uneven(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None, timed=_untimed
) -> torch.Tensor:
    """Send ``in_splits[j]`` elements of the flat `x` to rank j and receive ``out_splits[s]`` from rank s
    (concatenated in rank order); differentiable. ``timed(device)`` wraps each transfer (for timing)."""
    return _AllToAll.apply(x, out_splits, in_splits, group, timed)


def all_gather_uneven(
    t: torch.Tensor,
    dim: int = 0,
    group=None,
    sizes: list[int] | None = None,
    dst: int | None = None,
) -> tuple[torch.Tensor | None, list[int]]:
    """(every rank's `t` concatenated along `dim` in rank order, each rank's size along `dim`).

    The ranks may hold different sizes along `dim` (other dims equal): `sizes` when every rank knows them,
    else they are all-gathered first. With `dst` (a global rank) the result goes to that rank only (dist.gather;
    None elsewhere). Not differentiable."""
    world = dist.get_world_size(group)
    if sizes is None:
        n = torch.tensor([t.shape[dim]], device=t.device)
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n, group=group)
        sizes = [int(c) for c in counts]
    shape = list(t.shape)
    shape[dim] = max(sizes)
    padded = t.new_zeros(shape)
    padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    if dst is None:
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
    else:
        parts = [torch.empty_like(padded) for _ in range(world)] if dist.get_rank() == dst else None
        dist.gather(padded, parts, dst=dst, group=group)
        if parts is None:
            return None, sizes
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(parts, sizes)], dim=dim), sizes


def gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order, on every rank ([obj] without a process group)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_float(value: float, device, group=None) -> float:
    """Rank 0's `value` on every rank (e.g. its clock, so that a time budget stops all ranks at one step)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0, group=group)
    return float(t.item())


def barrier(group=None) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
