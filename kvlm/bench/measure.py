"""The measurements of one model at one size: prefill latency and per-token decode latency, of a kvlm
model (``bench_prefill``, ``bench_decode``) or of its transformers peer (``bench_peer_prefill``,
``bench_peer_decode``), each a row dict (median and spread in ms, tokens/s, KV bytes, peak memory, FLOPs).

Decode starts from a cache holding ``context`` random tokens (``fill_cache``: what a prefill would leave,
minus the long prefill), so long contexts cost seconds, not minutes.
"""

from __future__ import annotations

import torch

from kvlm.bench.timing import time_decode, time_prefill
from kvlm.inference.generation import packs_for
from kvlm.model import KVLM


def fill_cache(cache, length: int, vocab_size: int) -> None:
    """Make the cache hold ``length`` random tokens, as a prefill would have left it."""
    cache.fill_random_(length, vocab_size)


def bench_prefill(
    model: KVLM, batch: int, prompt: int, mode: str, warmup: int, repeats: int, budget_s=None
) -> dict:
    """Latency of one prefill of ``batch`` x ``prompt`` tokens into a preallocated cache."""
    device = model.embed.weight.device
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, prompt), device=device)
    row = time_prefill(
        lambda: model.new_cache(batch, prompt, naive=(mode == "naive")),
        lambda cache: model(tokens, cache=cache, mode=mode, last_only=True),
        lambda cache: cache.nbytes_used,
        device,
        warmup,
        repeats,
        budget_s,
    )
    row["tokens_per_s"] = batch * prompt / (row["median_ms"] * 1e-3)
    return row


def bench_decode(
    model: KVLM, batch: int, context: int, mode: str, warmup: int, steps: int, budget_s=None
) -> dict:
    """Per-token decode latency with ``context`` tokens cached (greedy next token, as generate does)."""
    device = model.embed.weight.device

    def new_cache():
        cache = model.new_cache(batch, context + max(warmup, 1) + steps, naive=(mode == "naive"))
        fill_cache(cache, context, model.cfg.vocab_size)
        return cache, cache.nbytes_used, torch.randint(0, model.cfg.vocab_size, (batch, 1), device=device)

    # as generate decodes: weights packed where packs_for says it pays, in its layout (kvlm.inference.generation)
    layout = packs_for(model, batch)
    packed = layout is not None and model.pack_for_decode(layout) > 0
    try:
        row = time_decode(
            new_cache,
            lambda tok, cache: model(tok, cache=cache, mode=mode, last_only=True).argmax(-1),
            device,
            warmup,
            steps,
            budget_s,
        )
    finally:
        if packed:
            model.pack_for_decode(None)
    row["tokens_per_s"] = batch / (row["median_ms"] * 1e-3)
    row["weights_packed"] = layout if packed else None  # MKL's layout for that many rows, "any" (oneDNN's) or None
    return row


def bench_peer_prefill(
    peer, batch: int, prompt: int, vocab_size: int, device, warmup: int, repeats: int, budget_s=None
) -> dict:
    """``bench_prefill`` for a transformers peer (``kvlm.bench.peers.Peer``)."""
    tokens = torch.randint(0, vocab_size, (batch, prompt), device=device)
    row = time_prefill(
        peer.new_cache,
        lambda cache: peer.forward(tokens, cache, last_only=True),
        peer.cache_nbytes,
        device,
        warmup,
        repeats,
        budget_s,
    )
    row["tokens_per_s"] = batch * prompt / (row["median_ms"] * 1e-3)
    return row


def bench_peer_decode(
    peer, batch: int, context: int, vocab_size: int, device, warmup: int, steps: int, budget_s=None
) -> dict:
    """``bench_decode`` for a transformers peer, from its own synthetic cache of ``context`` tokens."""

    def new_cache():
        cache = peer.synthetic_cache(batch, context)
        return cache, peer.cache_nbytes(cache), torch.randint(0, vocab_size, (batch, 1), device=device)

    row = time_decode(
        new_cache,
        lambda tok, cache: peer.forward(tok, cache, last_only=True)[:, -1].argmax(-1, keepdim=True),
        device,
        warmup,
        steps,
        budget_s,
    )
    row["tokens_per_s"] = batch / (row["median_ms"] * 1e-3)
    return row
