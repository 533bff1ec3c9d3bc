"""The serving benchmark without HTTP: kvlm's engine and transformers' continuous batching driven alike.

Both take the same closed loop as ``kvlm.bench.serve.run_load``: ``concurrency`` requests in flight (a finished
one is replaced by the next), ``concurrency * rounds`` requests of the same random prompts
(``make_prompts(..., seed)``), ``output_len`` greedy tokens each with EOS ignored, a paged cache of
``cache_bytes``, two untimed warm-up requests before the clock starts. Times are taken the same way on both sides:
time to first token from adding the request to the step that produced its first token, inter-token latency as
the gaps between a request's tokens (tokens produced by one step share its gap), tokens/s over the wall time.

- ``engine_load(model, ...)``: ``kvlm.serve.Engine`` stepped in this thread, as the server's engine thread does.
- ``peer_load(model, ...)``: the manager behind transformers' ``generate_batch`` (its own background thread,
  its paged cache) on the transformers model computing the same function (``build_peer(model, paged=True)``:
  LlamaForCausalLM for MHA/GQA, DeepseekV3ForCausalLM with padded values for MLA, see kvlm.bench.peers).
"""

from __future__ import annotations

import time

import numpy as np

from kvlm.bench.serve import ServeBenchError, make_prompts, summarize
from kvlm.logs import get_logger

logger = get_logger(__name__)

WARMUP_SEED = 12345  # the warm-up prompts of kvlm.bench.serve.warmup


def engine_load(model, concurrency: int, *, prompt_len: int, output_len: int, rounds: int, cache_bytes: int,
                page_size: int = 16, max_batch: int = 64, prefill_chunk: int = 256, kv_dtype: str | None = None,
                seed: int = 0) -> dict:  # fmt: skip
    """kvlm's serving engine on ``model``, in-process (no HTTP, no client process); see the module docstring."""
    from kvlm.serve import Engine, SamplingParams

    engine = Engine(model, cache_bytes=cache_bytes, page_size=page_size, max_batch=max_batch,
                    prefill_chunk=prefill_chunk, kv_dtype=kv_dtype)  # fmt: skip
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.generate(
        make_prompts(2, prompt_len, seed=WARMUP_SEED), params
    )  # untimed, as warmup() for the server
    prompts = make_prompts(concurrency * rounds, prompt_len, seed)
    todo = list(prompts)
    ttft, itl, counts = [], [], []
    live: dict[str, list] = {}  # request id -> [added at, last token at, tokens]
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            rid = engine.add_request(todo.pop(), params)
            live[rid] = [time.perf_counter(), None, 0]
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            state = live[out.request_id]
            k = len(out.new_token_ids)
            if k:
                if state[1] is None:
                    ttft.append(now - state[0])
                else:
                    itl.extend([(now - state[1]) / k] * k)
                state[1] = now
                state[2] += k
            if out.finished:
                counts.append(live.pop(out.request_id)[2])
    wall = time.perf_counter() - t0
    result = summarize(ttft, itl, sum(counts), len(counts), wall)
    result.update(
        concurrency=concurrency, preemptions=engine.stats()["preemptions"], per_request_tokens=counts
    )
    return result


def peer_cache_blocks(config, cache_bytes: int, page_size: int, element_size: int) -> int:
    """Pages of ``page_size`` tokens that fit ``cache_bytes`` in transformers' paged cache, which holds keys and
    values of ``find_num_key_value_heads x find_head_dim`` per token and layer (its own sizing functions)."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    per_token = 2 * find_num_key_value_heads(config) * find_head_dim(config) * config.num_hidden_layers
    return max(1, cache_bytes // (per_token * element_size * page_size))


def peer_load(model, concurrency: int, *, prompt_len: int, output_len: int, rounds: int, cache_bytes: int,
              page_size: int = 16, seed: int = 0, peer=None) -> dict:  # fmt: skip
    """transformers' continuous batching on ``model``'s weights (or on ``peer``, from ``build_peer(model,
    paged=True)``), driven as ``engine_load`` drives kvlm's engine; see the module docstring."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from kvlm.bench.peers import build_peer

    peer = peer or build_peer(model, paged=True)
    hf = peer.model
    blocks = peer_cache_blocks(hf.config, cache_bytes, page_size, next(hf.parameters()).element_size())
    cb = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=blocks, max_requests_per_batch=concurrency, allow_block_sharing=False,
        # tokens per forward as kvlm's engine (a prefill chunk of 256 + the decodes); left to itself transformers
        # sizes it from the pool and, for a small per-token cache, asks for more memory than the machine has
        max_batch_tokens=max(256, prompt_len) + concurrency,
    )  # fmt: skip
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = make_prompts(concurrency * rounds, prompt_len, seed)
    hints = WorkloadHints(
        max_prompt_length=prompt_len, max_generated_length=output_len, num_requests=len(prompts)
    )
    outs = []
    with hf.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb, block=True,
                                                timeout=5, warmup=False, workload_hints=hints) as manager:  # fmt: skip

        def result(timeout: float):
            out = manager.get_result(timeout=timeout)
            if out is None and not manager.is_running():
                raise ServeBenchError(
                    "transformers' continuous batching thread stopped (its log has the error)"
                )
            if out is not None and getattr(out, "error", None):
                raise ServeBenchError(f"transformers continuous batching failed: {str(out.error)[:300]}")
            return out

        warm = make_prompts(2, prompt_len, seed=WARMUP_SEED)  # untimed, as engine_load's
        for p in warm:
            manager.add_request(p, max_new_tokens=output_len)
        finished = 0
        while finished < len(warm):
            out = result(600)
            finished += out is not None and out.is_finished()
        todo = list(prompts)
        t0 = time.perf_counter()
        for _ in range(min(concurrency, len(todo))):
            manager.add_request(todo.pop(), max_new_tokens=output_len, record_timestamps=True)
        while len(outs) < len(prompts):
            out = result(60)
            if out is not None and out.is_finished():
                outs.append(out)
                if todo:
                    manager.add_request(todo.pop(), max_new_tokens=output_len, record_timestamps=True)
        wall = time.perf_counter() - t0
    ttft, itl, counts = [], [], []
    for o in outs:
        counts.append(len(o.generated_tokens))
        ts = list(o.timestamps or [])
        if ts:
            ttft.append(ts[0] - o.created_time)
            itl.extend(np.diff(ts).tolist())
    row = summarize(ttft, itl, sum(counts), len(outs), wall)
    row.update(concurrency=concurrency, peer=f"transformers CB ({peer.name.removeprefix('transformers ')})",
               per_request_tokens=counts, cache_blocks=blocks)  # fmt: skip
    return row
