"""The serving engine: requests in, tokens out, over a paged compact cache with continuous batching.

    engine = Engine(model, tokenizer, cache_bytes=2**30, page_size=16)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_unfinished():
        for out in engine.step():          # RequestOutput: the new tokens / text of each request this step
            ...

Each ``step()`` asks the ``Scheduler`` for this iteration's work (decodes of one token, prompt chunks of n) and
runs all of it in ONE forward (``KVLM.forward_parts``: several cache calls whose attention runs per call, while
the embedding, norms, MLP and LM head run once on all their rows, as vLLM's mixed prefill and decode batch).
``plan_step`` splits the work into those calls: the decodes and the shortest prompt chunks, up to ``mix_tokens``
prompt tokens, form one call of one-token rows (``PackedBatch``: vLLM V1's flat varlen batch, no padding, each
sequence at its own positions); longer chunks form left-padded prefill calls (``group_chunks``; the cache stores
no padding). The LM head runs on the rows that are sampled only (each finished chunk's last). Then all requests
whose tokens are computed are sampled together on one logits tensor (``sample_batch``: one argmax for the greedy
rows; temperature, top-k and top-p for the others with one softmax and one sort, each drawing one number from its
own seeded generator), the stop rules are applied (EOS unless ``ignore_eos``, stop token ids, stop strings on the
decoded text, ``max_tokens``, the model's context) and finished requests' pages are freed at once.

One forward per step instead of one per call: at the reference shape (MLA, 2 threads, 32 clients with 128-token
prompts, ``kvlm bench-serve --in-process``), 4.4-4.8 s against 5.2-6.0 s before, in one A/B run; a prefill step
no longer streams the MLP and LM head weights a second time for its decodes.

Why packing stops at ``mix_tokens`` (default 64): a packed prompt token runs the one-token route (the decode
kernels) and reads its keys as a decode does; a chunk in a call of its own runs the prefill route, which reads
its keys once for all its tokens but pays that route's fixed costs. Measured inside one forward at the reference
shape (1 thread, CPU time, 8 decodes of 512 cached tokens plus one fresh prompt): packed / own call 66 / 80 ms
(16 tokens) and 106 / 116 ms (48) for MLA, 90 / 96 and 136 / 153 ms for MHA. Earlier, with one forward per
call, the 2-layer d = 256 bench model gave 1.08-1.26x at 128 tokens. The keys the packed rows read are capped
too (``MIX_KEYS``), so a chunk deep into a long prompt keeps its own prefill call: 8 decodes + a 32-token chunk
after 0 / 128 / 512 / 2048 cached tokens (528 / 4.6K / 17K / 66K keys) took 0.64 / 0.71 / 0.89 / 1.42x the
separate forwards' time for MHA, 0.65 / 0.63 / 0.66 / 0.84x for MLA (whose latent keys are cheap to read).

Single-threaded: the HTTP server drives it from one background thread.
"""

from __future__ import annotations

import secrets

import torch

from kvlm.attention.linear import ANY_ROWS, PAST_KERNEL, kernel_leads
from kvlm.cache import PagedKVCache
from kvlm.cache.paged_batch import PackedBatch
from kvlm.kernels import MAX_NEW
from kvlm.logs import get_logger
from kvlm.serve.request import Request, RequestOutput, SamplingParams, Status
from kvlm.serve.sampling import logprobs_batch, sample_batch
from kvlm.serve.scheduler import Scheduler

logger = get_logger(__name__)

DEFAULT_CACHE_TOKENS = 65536  # when neither cache_bytes nor cache_tokens is given
MIX_KEYS = 16384  # keys the packed prompt rows of one step may read in all (a 64-token prompt reads 2080)


class Engine:
    """The serving engine (see the module docstring): ``add_request(prompt_ids, SamplingParams)`` -> request id,
    ``step()`` -> this iteration's ``RequestOutput`` list, ``has_unfinished()``, ``abort(id)``, ``stats()``, and
    ``generate(prompts, params)`` to run a batch to the end. The cache is sized by ``cache_bytes`` or
    ``cache_tokens`` (default 65536 tokens) in pages of ``page_size`` tokens, stored as ``kv_dtype`` (None: the
    model's; "int8" or "fp8" quantised); at most ``max_batch`` sequences decode together, prompts are prefilled in chunks
    of ``prefill_chunk`` tokens, up to ``mix_tokens`` prompt tokens join the decodes' call (0: never), and
    shared prompt prefixes reuse pages unless ``enable_prefix_cache=False``; ``pack_weights`` (default on) packs the
    weights for any row count on CPU (``KVLM.pack_for_decode(ANY_ROWS)``), or for the rows past the few-row kernel's
    where the kernel measured faster than the packed layout at its most rows (``PAST_KERNEL``, ``kernel_leads``;
    ``weight_layout`` says which)."""

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
        mix_tokens: int = 64,
        pack_weights: bool = True,
    ):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        if not isinstance(mix_tokens, int) or isinstance(mix_tokens, bool) or mix_tokens < 0:
            raise ValueError(f"mix_tokens must be an integer >= 0, got {mix_tokens!r}")
        self.mix_tokens = mix_tokens
        if cache_bytes is None and cache_tokens is None:
            cache_tokens = DEFAULT_CACHE_TOKENS
        self.model = model.eval().prepare_for_inference()
        # a step's rows (decodes + packed prompt tokens, or a prefill chunk) change every step: the weights are
        # packed once in oneDNN's layout for any row count (kvlm.attention.linear; CPU float32 only, a second
        # copy of the weights in memory), which streams them 1.5-2x faster than F.linear at 8-32 rows; up to
        # MAX_ROWS rows the few-row kernel runs instead where it measured faster here (PAST_KERNEL)
        self.weight_layout, self.packed_weights = None, 0
        if pack_weights:
            head = getattr(self.model, "lm_head", None)
            self.weight_layout = PAST_KERNEL if head is not None and kernel_leads(head.weight) else ANY_ROWS
            self.packed_weights = self.model.pack_for_decode(self.weight_layout)
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
        # every token the model declares as the end of its output (a chat model's <|im_end|> too)
        self.stop_ids = set(getattr(tokenizer, "stop_ids", None) or [self.eos_id]) - {None}
        logger.info(
            "engine: %d pages of %d tokens (%d bytes per token, kv_dtype %s), max_batch %d, %d weights packed",
            self.cache.num_pages, page_size, self.cache.bytes_per_token, kv_dtype or "model", max_batch,
            self.packed_weights,
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
        packed, groups = plan_step(work, self.mix_tokens)
        calls, ready, picks = self._calls(packed, groups)
        with torch.inference_mode():
            logits = self.model.forward_parts(calls, picks)
            for req, n in work:
                req.computed += n
            done = self._sample(ready, logits) if ready else []
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

    def _calls(self, packed: list[tuple[Request, int]], groups: list[list[tuple[Request, int]]]):
        """The step's work as ``KVLM.forward_parts`` calls, all in one forward: the packed call (decodes only:
        the plain batch view, (B, 1) tokens; with prompt chunks: one-token rows, ``PackedBatch``), then each
        prefill group, left-padded to its longest chunk (the cache stores no padding; the last column is each
        row's last token). Returns (calls, the requests whose tokens this step completes, and the flat row of
        each one's last token: the rows whose logits are sampled, in the same order)."""
        calls, ready, picks, offset = [], [], [], 0

        def sample(chunks, last_rows):
            for (req, n), row in zip(chunks, last_rows):
                if req.computed + n == req.num_tokens:
                    ready.append(req)
                    picks.append(offset + row)

        if packed:
            seq_ids = [req.request_id for req, _ in packed]
            ids = [t for req, n in packed for t in req.all_ids[req.computed : req.computed + n]]
            if len(ids) == len(packed):
                view, last = self.cache.batch(seq_ids), range(len(ids))
            else:
                view = PackedBatch(self.cache, seq_ids, [n for _, n in packed])
                last = view.last_rows
            calls.append((torch.tensor(ids, device=self._device)[:, None], view))
            sample(packed, last)
            offset += len(ids)
        for group in groups:
            T = max(n for _, n in group)
            ids = [[0] * (T - n) + req.all_ids[req.computed : req.computed + n] for req, n in group]
            view = self.cache.batch([req.request_id for req, _ in group], [n for _, n in group])
            calls.append((torch.tensor(ids, device=self._device), view))
            sample(group, range(T - 1, len(group) * T, T))
            offset += len(group) * T
        return calls, ready, picks

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        """The next token of each request (row b of logits is reqs[b]'s), all drawn together, then the stop
        rules; returns the requests that finished."""
        params = [req.params for req in reqs]
        tokens = sample_batch(logits, params, [req.generator for req in reqs])
        lp_rows = [b for b, p in enumerate(params) if p.logprobs is not None]
        logprob: dict[int, tuple[float, dict[str, float] | None]] = {}
        if lp_rows:
            chosen, tops = logprobs_batch(
                logits[lp_rows], [tokens[b] for b in lp_rows], [params[b].logprobs for b in lp_rows]
            )
            for b, c, top in zip(lp_rows, chosen, tops):
                text = {self._token_text(i): v for i, v in top} if params[b].logprobs else None
                logprob[b] = (c, text)
        done = []
        for b, (req, token) in enumerate(zip(reqs, tokens)):
            if self._accept(req, token, *logprob.get(b, (None, None))):
                done.append(req)
        return done

    def _accept(self, req: Request, token: int, logprob: float | None, top: dict[str, float] | None) -> bool:
        """Apply the stop rules to req's new token; True when the request has finished."""
        p = req.params
        if token in p.stop_token_ids or (token in self.stop_ids and not p.ignore_eos):
            req.finish("stop")  # a stop token ends the request and is not part of the output
            req.release_text(final=True)
            return True
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


def plan_step(
    work: list[tuple[Request, int]], mix_tokens: int
) -> tuple[list[tuple[Request, int]], list[list[tuple[Request, int]]]]:
    """Split a step's work (request, new tokens) into the calls of its forward (``KVLM.forward_parts``): the
    packed call (decodes and the prompt chunks that join them as one-token rows) and the padded prefill groups
    (``group_chunks``).

    With decodes in the step, the shortest chunks join them while their tokens stay within ``mix_tokens`` and
    the keys their rows read (a chunk's token at position i reads i + 1) within ``MIX_KEYS`` (see the module
    docstring for the measurement). Without decodes, chunks are packed the same way only when that saves a call
    (short prompts of different lengths, which ``group_chunks`` would run one call each); a lone chunk or
    chunks of one padded group keep the prefill call."""
    singles = [(req, n) for req, n in work if n == 1]
    chunks = [(req, n) for req, n in work if n > 1]
    mixed, rest, tokens, keys = [], [], 0, 0
    for req, n in sorted(chunks, key=lambda c: c[1]):
        k = n * req.computed + n * (n + 1) // 2  # the keys its rows read
        if not rest and tokens + n <= mix_tokens and keys + k <= MIX_KEYS:
            mixed.append((req, n))
            tokens, keys = tokens + n, keys + k
        else:
            rest.append((req, n))
    if not mixed:
        return singles, group_chunks(chunks)
    groups = group_chunks(rest)
    if not singles and 1 + len(groups) >= len(group_chunks(chunks)):
        return [], group_chunks(chunks)
    return singles + mixed, groups


def group_chunks(chunks: list[tuple[Request, int]], waste: float = 2.0) -> list[list[tuple[Request, int]]]:
    """Split prefill chunks (request, tokens) into groups that run as one padded call each: longest first,
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
