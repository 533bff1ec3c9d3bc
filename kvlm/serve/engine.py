"""The serving engine: requests in, tokens out, over a paged compact cache with continuous batching.

    engine = Engine(model, tokenizer, cache_bytes=2**30, page_size=16)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: the new tokens / text of each request this step
            ...

Each ``step()`` asks the ``Scheduler`` for this iteration's work, runs the decodes of all running sequences as
one batched forward over sequences of different lengths (``PagedKVCache.batch``: per-sequence positions and
masks, no padding), runs the prefill chunks of several requests as one forward (left-padded to the longest of
a group, ``group_chunks``; the cache stores no padding), samples the greedy requests by one batched argmax and
the others with their own settings and generators, applies the stop rules (EOS unless ``ignore_eos``, stop token ids, stop strings on the
decoded text, ``max_tokens``, the model's context) and frees finished requests' pages at once.

Single-threaded: the HTTP server drives it from one background thread.
"""

from __future__ import annotations

import secrets

import torch

from kvlm.cache import PagedKVCache
from kvlm.kernels import MAX_NEW
from kvlm.logs import get_logger
from kvlm.serve.request import Request, RequestOutput, SamplingParams, Status
from kvlm.serve.sampling import logprobs_row, sample_row
from kvlm.serve.scheduler import Scheduler

logger = get_logger(__name__)

DEFAULT_CACHE_TOKENS = 65536  # when neither cache_bytes nor cache_tokens is given


class Engine:
    """The serving engine (see the module docstring): ``add_request(prompt_ids, SamplingParams)`` -> request id,
    ``step()`` -> this iteration's ``RequestOutput`` list, ``has_unfinished()``, ``abort(id)``, ``stats()``, and
    ``generate(prompts, params)`` to run a batch to the end. The cache is sized by ``cache_bytes`` or
    ``cache_tokens`` (default 65536 tokens) in pages of ``page_size`` tokens, stored as ``kv_dtype`` (None: the
    model's; "int8" or "fp8" quantised); at most ``max_batch`` sequences decode together, prompts are prefilled in chunks
    of ``prefill_chunk`` tokens, and shared prompt prefixes reuse pages unless ``enable_prefix_cache=False``."""

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        cache_bytes: int | None = None,
        cache_tokens: int | None = None,
        page_size: int = 16,
        max_batch: int = 64,
        kv_dtype: str | None = None,
        prefill_chunk: int = 256,
        enable_prefix_cache: bool = True,
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        if cache_bytes is None and cache_tokens is None:
            cache_tokens = DEFAULT_CACHE_TOKENS
        self.model = model.eval().prepare_for_inference()
        self.tokenizer = tokenizer
        self.max_model_len: int = model.cfg.max_seq_len
        self.vocab_size: int = model.cfg.vocab_size
        self.cache = PagedKVCache.for_model(
            model,
            cache_bytes=cache_bytes,
            cache_tokens=cache_tokens,
            page_size=page_size,
            kv_dtype=kv_dtype,
            enable_prefix_cache=enable_prefix_cache,
        )
        self.scheduler = Scheduler(self.cache, max_batch, prefill_chunk)
        self.requests: dict[str, Request] = {}
        self._aborted: list[Request] = []  # reported by the next step()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.eos_id = getattr(tokenizer, "eos_id", None)
        logger.info(
            "engine: %d pages of %d tokens (%d bytes per token, kv_dtype %s), max_batch %d",
            self.cache.num_pages, page_size, self.cache.bytes_per_token, kv_dtype or "model", max_batch,
        )  # fmt: skip

    # --- requests ---------------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; returns its id. ValueError for a prompt or setting that cannot be served."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        prompt = (
            [int(t) for t in prompt_ids] if not isinstance(prompt_ids, torch.Tensor) else prompt_ids.tolist()
        )
        if not prompt:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens is longer than the model's context of {self.max_model_len} tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        # the last token is never fed back: a request caches at most prompt + max_tokens - 1 tokens
        worst = min(len(prompt) + params.max_tokens - 1, self.max_model_len)
        if self.cache.pages_for(worst) > self.cache.num_pages:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_tokens={params.max_tokens} needs {worst} cached tokens, more "
                f"than the whole cache pool ({self.cache.num_pages * self.cache.page_size} tokens)"
            )
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, prompt, params, self.tokenizer, secrets.randbits(63))
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        self.prompt_tokens_total += len(prompt)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its pages now; the next step() reports it finished ("abort")."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return
        self.scheduler.remove(req)
        req.finish("abort")
        req.release_text(final=False)
        self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or self._aborted)

    # --- one iteration ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = [req.take_output() for req in self._aborted]
        self._aborted = []
        work = self.scheduler.schedule()
        if not work:
            return outputs
        done: list[Request] = []
        with torch.inference_mode():
            singles = [req for req, n in work if n == 1]
            if singles:  # all decodes (and one-token prefills) in one forward over sequences of any length
                tokens = torch.tensor([[req.all_ids[req.computed]] for req in singles], device=self._device)
                logits = self.model(tokens, cache=self.cache.batch([r.request_id for r in singles]))[:, -1]
                for req in singles:
                    req.computed += 1
                self._sample_batch(singles, logits, done)
            for group in group_chunks([(req, n) for req, n in work if n > 1]):
                # several prompts' chunks in one forward: left-padded to the longest (the cache stores no
                # padding, and the last column is each row's last token, all that last_only keeps)
                T = max(n for _, n in group)
                rows = [[0] * (T - n) + req.all_ids[req.computed : req.computed + n] for req, n in group]
                view = self.cache.batch([req.request_id for req, _ in group], [n for _, n in group])
                tokens = torch.tensor(rows, device=self._device)
                logits = self.model(tokens, cache=view, last_only=True)[:, -1]
                for req, n in group:
                    req.computed += n
                self._sample_batch([req for req, _ in group], logits, done)
        for req in done:
            self.scheduler.remove(req)
            self.requests.pop(req.request_id, None)
        for req, _ in work:
            if req.new_ids or req.new_text or req.finished:
                outputs.append(req.take_output())
        return outputs

    @property
    def _device(self) -> torch.device:
        return self.cache.device

    def _sample_batch(self, reqs: list[Request], logits: torch.Tensor, done: list[Request]) -> None:
        """Sample the next token of each request whose tokens are all computed (row b of logits is reqs[b]'s):
        the greedy ones by one argmax over the batch and one copy of the ids to the host; the others row by
        row with their own settings and generators (reproducible whatever runs beside them)."""
        ready = [b for b, req in enumerate(reqs) if req.computed == req.num_tokens]
        if not ready:
            return
        greedy = None
        if any(reqs[b].params.temperature == 0 for b in ready):
            greedy = logits.argmax(-1).tolist()  # ties: the first index, as argmax of one row gives
        need_rows = any(reqs[b].params.temperature != 0 or reqs[b].params.logprobs is not None for b in ready)
        host = logits.cpu() if need_rows else None
        for b in ready:
            req = reqs[b]
            token = greedy[b] if req.params.temperature == 0 else None
            if self._sample(req, host[b] if host is not None else None, token):
                done.append(req)

    def _sample(self, req: Request, logits: torch.Tensor | None, token: int | None = None) -> bool:
        """Draw req's next token (or take ``token``, already drawn) and apply the stop rules; True when the
        request has finished."""
        p = req.params
        if req.computed != req.num_tokens:
            return False
        if token is None:
            token = sample_row(logits, p, req.generator)
        if token in p.stop_token_ids or (token == self.eos_id and not p.ignore_eos):
            req.finish("stop")  # a stop token ends the request and is not part of the output
            req.release_text(final=True)
            return True
        logprob = top = None
        if p.logprobs is not None:
            logprob, top = logprobs_row(logits, token, p.logprobs, self._token_text)
        req.append(token, logprob, top)
        self.generation_tokens_total += 1
        if req.check_stop_string():
            req.finish("stop")
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens > self.max_model_len:
            req.finish("stop" if req.release_text(final=True) else "length")
        else:
            req.release_text(final=False)
        return req.finished

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else str(token)

    # --- numbers ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Queue lengths, page use, bytes per token and totals so far (what /metrics and bench-serve report)."""
        cache = self.cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "pages_total": cache.num_pages,
            "pages_used": cache.num_used_pages,
            "pages_free": cache.num_free_pages,
            "page_size": cache.page_size,
            "bytes_per_token": cache.bytes_per_token,
            "cache_bytes": cache.nbytes,
            "kv_dtype": cache.kv_dtype or str(cache.dtype).removeprefix("torch."),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_hit_tokens": self.scheduler.prefix_hit_tokens,
            "preemptions": self.scheduler.preemptions,
        }

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Run prompts to completion (a convenience for tests and scripts); the generated ids of each."""
        ids = [self.add_request(p, params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for o in self.step():
                if o.request_id in out:
                    out[o.request_id].extend(o.new_token_ids)
        return [out[i] for i in ids]


def group_chunks(chunks: list[tuple[Request, int]], waste: float = 2.0) -> list[list[tuple[Request, int]]]:
    """Split prefill chunks (request, tokens) into groups that run as one padded forward each: longest first,
    a chunk joins the current group while the padded size (rows x longest) stays within ``waste`` times the
    real tokens, so a short chunk never pays for a long one's padding many times over. Chunks of equal length
    always group; a group of at most ``kernels.MAX_NEW`` columns is never padded, since the decode kernels
    (which take such calls) read each row's last T slots as its new tokens."""
    groups: list[list[tuple[Request, int]]] = []
    real = 0
    for req, n in sorted(chunks, key=lambda c: -c[1]):
        longest = groups[-1][0][1] if groups else 0
        if groups and (
            n == longest or longest > MAX_NEW and (len(groups[-1]) + 1) * longest <= waste * (real + n)
        ):
            groups[-1].append((req, n))
            real += n
        else:
            groups.append([(req, n)])
            real = n
    return groups


__all__ = ["Engine", "RequestOutput", "SamplingParams", "Status"]
