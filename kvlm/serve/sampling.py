"""Sampling for a batch of requests, each with its own settings, on one logits tensor.

``sample_batch(logits, params, generators)``: row b of logits (R, V) is request b's. Greedy rows (temperature 0)
take one argmax. The sampled rows are filtered together, in the order of ``kvlm.inference.sampling``
(temperature, then top-k, then top-p on what top-k kept, the token that crosses top_p kept): one softmax,
and one descending sort for the rows that filter (top-k's k-th value and top-p's cumulative mass both read
it). Each row then draws by inverse CDF with ONE uniform number from its request's own ``torch.Generator``
(the first sorted index whose cumulative probability passes u times the total, in float64, so a token of
probability 0 is never drawn): a seeded request draws the same tokens whatever runs beside it, since no
row's draw depends on another's, and a row costs one tiny draw instead of a vocabulary of them.

``logprobs_batch``: the chosen tokens' log-probabilities and the top alternatives, from one log-softmax of
the raw logits (before temperature and filters), as OpenAI and vLLM report them.
"""

from __future__ import annotations

import torch


def sample_batch(logits: torch.Tensor, params: list, generators: list[torch.Generator]) -> list[int]:
    """logits (R, V) -> the next token id of each row; params[b] (``SamplingParams``) and generators[b] are
    row b's (a greedy row's generator is not used)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    out = logits.argmax(-1)  # ties: the first index, as argmax of one row gives
    rows = [b for b, p in enumerate(params) if p.temperature != 0]
    if not rows:
        return out.tolist()
    u = torch.tensor([float(torch.rand((), generator=generators[b], dtype=torch.float64)) for b in rows])
    V = logits.shape[-1]
    filters = [_filters(params[b], V) for b in rows]
    picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    for group in ([i for i, f in enumerate(filters) if not f], [i for i, f in enumerate(filters) if f]):
        if group:  # rows that do not filter skip the sort
            probs, order = _distributions(logits[[rows[i] for i in group]], [params[rows[i]] for i in group])
            got = _inverse_cdf(probs, u[group])
            picks[group] = got if order is None else order.gather(1, got[:, None])[:, 0]
    out[rows] = picks
    return out.tolist()


def distributions(logits: torch.Tensor, params: list) -> torch.Tensor:
    """The probabilities (R, V) each sampled row draws from (after temperature, top-k, top-p), in vocabulary
    order: what ``sample_batch`` draws from, for tests and callers that need the distribution itself."""
    probs, order = _distributions(logits.to(torch.promote_types(logits.dtype, torch.float32)), params)
    probs = probs / probs.sum(-1, keepdim=True)  # top-p zeroes the tail; the draw needs no renormalising
    return probs if order is None else torch.zeros_like(probs).scatter(1, order, probs)


def _filters(p, vocab_size: int) -> bool:
    return 0 < p.top_k < vocab_size or p.top_p < 1.0


def _distributions(x: torch.Tensor, params: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of logits x (R, V) with their params (temperature > 0) -> (probs, order): the probabilities to draw
    from, in vocabulary order (order None) when no row filters, else every row sorted descending (order maps
    a sorted index to the token id): one sort serves top-k's k-th value and top-p's cumulative mass."""
    V = x.shape[-1]
    x = x / torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)[:, None]
    k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=x.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=x.device)
    if not any(_filters(p, V) for p in params):
        return torch.softmax(x, -1), None
    xs, order = x.sort(-1, descending=True)
    kth = xs.gather(1, (k - 1)[:, None])
    xs = xs.masked_fill(xs < kth, float("-inf"))  # ties with the k-th value stay, as filter_logits keeps them
    probs = torch.softmax(xs, -1)
    before = probs.cumsum(-1) - probs  # the mass ranked above each token; the one that crosses top_p stays
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    return probs.masked_fill(drop, 0.0), order


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row the first index whose cumulative probability exceeds u times the row's total (R,)."""
    cdf = probs.double().cumsum(-1)
    target = u.to(cdf.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def logprobs_batch(
    logits: torch.Tensor, tokens: list[int], n_top: list[int]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """For each row b: the log-probability of tokens[b], and the n_top[b] most likely (id, logprob) pairs."""
    lp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = min(max(n_top, default=0), lp.shape[-1])
    if not k:
        return chosen, [[] for _ in tokens]
    values, ids = (t.tolist() for t in lp.topk(k, dim=-1))
    return chosen, [list(zip(ids[b][:n], values[b][:n])) for b, n in enumerate(n_top)]


__all__ = ["distributions", "logprobs_batch", "sample_batch"]
