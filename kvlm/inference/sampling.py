"""Sampling: the next token from the logits, and when a sequence stops.

Order: temperature, then top-k, then top-p (nucleus) on what top-k kept, then a draw from a seeded
``torch.Generator`` so that a seed reproduces a run. ``temperature=0`` is greedy (argmax).

- ``sample(logits, temperature, top_k, top_p, generator)``: (B, V) logits -> (B,) next ids.
- ``filter_logits(logits, top_k, top_p)``: the top-k / top-p filter alone (the rest set to -inf).
- ``check_sampling(temperature, top_k, top_p)``: one clear error for a setting out of range.
- ``StopTracker``: which sequences of a batch have finished and why ("stop" on a stop token, else
  "length"); a stop token ends its sequence and is not emitted.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable

import torch


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """logits (B, V) -> next ids (B,). temperature 0: argmax; else filter (top-k, top-p) and draw."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 -> fp32, fp64 stays
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits / temperature, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """Set to -inf every logit outside the top_k largest, then outside the smallest set of tokens whose
    probability reaches top_p (the token that crosses top_p is kept, so at least one token survives)."""
    V = logits.shape[-1]
    if top_k and top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # probability mass of the tokens ranked above
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError naming the first sampling setting out of range (nan and inf included: a nan temperature
    would pass `< 0` and turn every probability into nan)."""
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and (
        not isinstance(top_k, numbers.Integral) or isinstance(top_k, bool) or top_k < 0
    ):
        raise ValueError(f"top_k must be >= 1 (or 0/None to disable), got {top_k}")
    if top_p is not None and (not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def stop_set(stop_tokens: Iterable[int] | int | None) -> set[int]:
    """None, one id or several ids -> the set of stop ids."""
    if stop_tokens is None:
        return set()
    if isinstance(stop_tokens, int):
        return {stop_tokens}
    return {int(t) for t in stop_tokens}


class StopTracker:
    """The finished sequences of a batch of ``batch_size``: a sequence stops at its first stop token (which
    is not emitted), the others run to the length limit. ``reasons[b]`` is "stop" or "length"."""

    def __init__(self, batch_size: int, stop_tokens: Iterable[int] | int | None = None):
        self.stops = stop_set(stop_tokens)
        self.done = [False] * batch_size
        self.reasons = ["length"] * batch_size

    def step(self, ids: list[int]) -> list[int | None]:
        """One new id per sequence -> what each emits: the id, or None for a sequence that had already
        stopped or stops now on a stop token."""
        emitted: list[int | None] = []
        for b, t in enumerate(ids):
            if self.done[b] or t in self.stops:
                emitted.append(None)
                if not self.done[b]:
                    self.reasons[b] = "stop"
                    self.done[b] = True
                continue
            emitted.append(t)
        return emitted

    @property
    def all_done(self) -> bool:
        return all(self.done)

    @property
    def active(self) -> int:
        """Sequences still running."""
        return len(self.done) - sum(self.done)


__all__ = ["StopTracker", "check_sampling", "filter_logits", "sample", "stop_set"]
