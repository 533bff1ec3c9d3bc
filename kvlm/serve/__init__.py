"""Serving: the engine (paged compact cache, continuous batching, prefix reuse, per-request sampling) and, on
top of it, the OpenAI-compatible HTTP server.

- ``Engine`` (engine.py): ``add_request(prompt_ids, SamplingParams)``, ``step()`` -> ``RequestOutput`` deltas,
  ``abort``, ``stats``. Single-threaded.
- ``Scheduler`` (scheduler.py): which requests run each step (chunked prefill, decodes, FCFS admission,
  preemption by recomputation when the page pool is short).
- ``SamplingParams``, ``RequestOutput``, ``Request`` (request.py); per-row sampling (sampling.py).
The pages themselves are ``kvlm.cache.PagedKVCache``.
"""

from kvlm.serve.engine import Engine
from kvlm.serve.request import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
