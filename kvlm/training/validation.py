"""Validation loss: the mean next-token loss over fixed windows of the validation split, split over the ranks."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from kvlm.data import TokenStream
from kvlm.parallel import data_parallel as dt


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    stream: TokenStream,
    starts: list[int],
    seq_len: int,
    batch_size: int,
    device: torch.device,
    autocast=contextlib.nullcontext,
    info: dt.DistInfo | None = None,
    lockstep: bool = False,
) -> float | None:
    """Mean next-token loss over the windows at `starts` (split over ranks, summed across them).
    lockstep: every rank makes the same number of model calls (sharded gate tables exchange in each call);
    a rank out of windows runs a throw-away call."""
    info = info or dt.DistInfo()
    mine = starts[info.rank :: info.world_size]
    calls = math.ceil(len(starts[:: info.world_size] if lockstep else mine) / batch_size)
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses, tokens)
    for i in range(0, calls * batch_size, batch_size):
        if not mine[i : i + batch_size]:
            xy = torch.from_numpy(stream.windows(starts[:1], seq_len + 1)).to(device)
            with autocast():
                model(xy[:, :-1])
            continue
        xy = torch.from_numpy(stream.windows(mine[i : i + batch_size], seq_len + 1)).to(device)
        with autocast():
            logits = model(xy[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), xy[:, 1:].flatten(), reduction="sum")
        total += torch.stack(
            [loss.double(), torch.tensor(xy[:, 1:].numel(), dtype=torch.float64, device=device)]
        )
    dt.all_reduce_sum(total, info)
    model.train(was_training)
    return None if total[1] == 0 else float(total[0] / total[1])
