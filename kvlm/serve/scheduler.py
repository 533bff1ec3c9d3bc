"""Continuous batching: which requests run in this engine step, and with how many tokens (vLLM V1's scheduler).

Each request has ``num_tokens`` (prompt + generated) of which ``computed`` are in the cache; a step computes the
rest, at most one chunk. Running requests go first, oldest first: a decode (one token) always runs, a prompt
still being prefilled gets what is left of the step's prefill budget (``prefill_chunk`` tokens), so a long prompt
is split over steps and never stalls the decodes. Then waiting requests are admitted, first come first served,
while the batch has room, the budget lasts and their pages are free (a prompt prefix already cached is reused,
not recomputed).

The pages a scheduled request needs are booked at once (``PagedKVCache.reserve``). When the pool is short, the
newest running request is preempted: its pages are freed and it goes back to the front of the queue, to be
recomputed from its tokens later (vLLM's recompute preemption). The pool never runs out mid-step, and a request
that could never fit is refused when it is added (``Engine.add_request``).
"""

from __future__ import annotations

from collections import deque

from kvlm.cache import PagedKVCache
from kvlm.logs import get_logger
from kvlm.serve.request import Request, Status

logger = get_logger(__name__)


class Scheduler:
    def __init__(self, cache: PagedKVCache, max_batch: int, prefill_chunk: int):
        self.cache = cache
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens taken from the prefix cache instead of computed

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and free its pages now."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.cache.free(req.request_id)

    def schedule(self) -> list[tuple[Request, int]]:
        """This step's work: (request, tokens to compute), running requests first; pages booked."""
        cache = self.cache
        budget = self.prefill_chunk
        work: dict[Request, int] = {}
        i = 0
        while i < len(self.running):
            req = self.running[i]
            n = req.num_tokens - req.computed
            if n > 1:  # still prefilling (a prompt, or a preempted request's recompute)
                n = min(n, budget)
                if n == 0:
                    i += 1
                    continue
            while cache.pages_needed(req.request_id, n) > cache.num_free_pages:
                victim = self.running.pop()  # the newest
                work.pop(victim, None)
                self._preempt(victim)
                if victim is req:
                    break
            else:
                cache.reserve(req.request_id, n)
                work[req] = n
                if n > 1 or req.computed < len(req.prompt_ids):
                    budget -= n
                i += 1
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            req = self.waiting[0]
            cache.add_sequence(req.request_id)
            req.computed = cache.match_prefix(req.request_id, req.all_ids)
            n = min(req.num_tokens - req.computed, budget)
            if cache.pages_needed(req.request_id, n) > cache.num_free_pages:
                cache.free(req.request_id)
                req.computed = 0
                break
            cache.reserve(req.request_id, n)
            self.prefix_hit_tokens += req.computed
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            work[req] = n
            budget -= n
        return list(work.items())

    def _preempt(self, req: Request) -> None:
        self.cache.free(req.request_id)
        req.computed = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.preemptions += 1
        logger.debug("preempted %s (%d tokens) for lack of cache pages", req.request_id, req.num_tokens)


__all__ = ["Scheduler"]
