"""Per-request sampling over a batch: each row of logits with its own request's settings and generator.

The filters are ``kvlm.inference.sampling``'s (temperature, then top-k, then top-p); each request draws from its
own seeded ``torch.Generator``, so a seeded request samples the same tokens whatever runs beside it. Log-probs
are those of the model's distribution (log-softmax of the raw logits, before temperature and filters), as
OpenAI and vLLM report them.
"""

from __future__ import annotations

import torch

from kvlm.inference.sampling import filter_logits


def sample_row(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    """logits (V,) -> the next token id for one request."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if params.temperature == 0:
        return int(logits.argmax())
    filtered = filter_logits(logits[None] / params.temperature, params.top_k or None, params.top_p)
    probs = torch.softmax(filtered, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator)[0, 0])


def logprobs_row(
    logits: torch.Tensor, token: int, n_top: int, decode
) -> tuple[float, dict[str, float] | None]:
    """The chosen token's log-probability and, for n_top > 0, the n_top most likely tokens' (text -> logprob;
    ``decode(id)`` gives the text)."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = float(lp[token])
    if not n_top:
        return chosen, None
    values, ids = lp.topk(min(n_top, lp.shape[-1]))
    return chosen, {decode(int(i)): float(v) for v, i in zip(values, ids)}


__all__ = ["logprobs_row", "sample_row"]
