"""Measured time per operation class of a decode step, for the per-operation roofline (kvlm.bench.roofline).

The classes are timed with the model's own modules and routes, without instrumenting them:

- attention over the cache = the decode step at ``context`` cached tokens minus the same step at 1 cached token
  (the cache-proportional part: the same projections, MLPs and LM head run in both);
- LM head = the final norm and the LM head alone on ``batch`` hidden states, its weight packed as the
  timed step packs it (``bench_decode``, as ``generate``: ``packs_for``), so that the class times
  the product the step runs;
- weight GEMMs = the step at 1 cached token minus the LM head: the projections, MLPs, norms, the embedding
  gather and the per-step Python overhead (which a static or compiled step would remove).

``attach`` puts each measurement beside its floor (``measured_ms``, ``x_floor``) in a row's ``operations``.
"""

from __future__ import annotations

import torch

from kvlm.bench.measure import bench_decode
from kvlm.bench.timing import best_time
from kvlm.inference.generation import packs_for
from kvlm.model import KVLM


def lm_head_ms(model: KVLM, batch: int, repeats: int = 5) -> float:
    """Best time (ms) of the final norm + LM head on (batch, 1, d_model) hidden states, with the LM head packed
    for ``batch`` rows where the decode step packs it (``packs_for``); the head's packing is restored after."""
    head = model.lm_head
    p = head.weight
    x = torch.randn(batch, 1, model.cfg.d_model, device=p.device, dtype=p.dtype)
    saved = head._packed
    layout = packs_for(model, batch)
    if layout is not None:
        head.pack_for_decode(layout)
    try:
        with torch.inference_mode():
            head(model.norm(x))  # warm-up
            return best_time(lambda: head(model.norm(x)), p.device, repeats) * 1e3
    finally:
        head._packed = saved


def base_times(
    model: KVLM, batch: int, mode: str, warmup: int, steps: int, budget_s=None
) -> dict[str, float]:
    """What ``operation_times`` subtracts, measured once per batch size and mode: the step at 1 cached token
    (``short_ms``) and the LM head (``lm_head_ms``)."""
    short = bench_decode(model, batch, 1, mode, warmup, steps, budget_s)["median_ms"]
    return {"short_ms": short, "lm_head_ms": lm_head_ms(model, batch)}


def operation_times(step_ms: float, base: dict[str, float]) -> dict[str, float]:
    """{class: measured ms} of a decode step whose median at its context is ``step_ms``."""
    short, head = base["short_ms"], base["lm_head_ms"]
    return {
        "weight GEMMs": max(short - head, 0.0),
        "attention": max(step_ms - short, 0.0),
        "LM head": head,
    }


def attach(operations: dict[str, dict], measured: dict[str, float]) -> None:
    """Add ``measured_ms`` and ``x_floor`` (measured / floor) to each operation class that was timed."""
    for name, op in operations.items():
        if name in measured:
            op["measured_ms"] = measured[name]
            op["x_floor"] = measured[name] / op["floor_ms"] if op["floor_ms"] else None
