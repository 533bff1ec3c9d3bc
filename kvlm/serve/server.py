"""The OpenAI-compatible HTTP server: ``create_app`` builds the FastAPI app around an AsyncEngine.

    POST /v1/completions        text or token-id prompt; ``stream: true`` -> server-sent events ending in [DONE]
    POST /v1/chat/completions   messages -> the chat template (kvlm/serve/chat.py); streaming the same way
    GET  /v1/models             the one served model
    GET  /health                200 while the engine runs, 503 otherwise
    GET  /metrics               Prometheus text (kvlm/serve/metrics.py)

Every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad request (unknown model,
a prompt longer than the context, invalid sampling values, malformed JSON, wrong types), 404 for an unknown path,
429 when ``max_batch + max_waiting`` requests are already in flight, 503 while shutting down. A streaming client
that disconnects is noticed by Starlette (it cancels the response task), and closing the request's stream aborts
it on the engine, which frees its pages; a non-streaming request awaits its client's disconnect the same way.

``n`` > 1 fans out to n engine requests sharing one RequestStream (the prefix cache shares the prompt's pages;
a seeded request's completion i uses seed + i); the choices carry their index, in a stream chunk by chunk.
A streamed response writes everything that arrived for it in one engine step as one write, and each event is
built by ``StreamFrames`` (the envelope serialized once per response).

FastAPI and uvicorn are the optional extra ``kvlm[serve]``; they are imported when a server is built.
kvlm/serve/launch.py loads what is served, builds the engine and runs uvicorn.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (fastapi.Request) at runtime
import asyncio
import contextlib
import dataclasses
import time

from kvlm.logs import get_logger
from kvlm.serve.async_engine import AsyncEngine, EngineStopped, Overloaded
from kvlm.serve.chat import ChatFormatter, ChatTemplateError
from kvlm.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    StreamFrames,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    delta,
    merge_outputs,
    new_id,
    parse_request,
    usage,
)

logger = get_logger(__name__)

_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "logprobs")


def require_server_stack():
    """(fastapi, uvicorn), or an ImportError that says how to install them."""
    try:
        import fastapi
        import uvicorn
    except ImportError as e:
        raise ImportError(
            f"kvlm serve needs FastAPI and uvicorn ({e.name} is missing): pip install 'kvlm[serve]'"
        ) from e
    return fastapi, uvicorn


# --- the app --------------------------------------------------------------------------------------------
class _State:
    """What the handlers share: the engine, the tokenizer, the model's name and context."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, max_model_len: int, vocab_size, chat):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.max_model_len, self.vocab_size, self.chat = max_model_len, vocab_size, chat

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
            if not ids:
                raise APIError("the prompt encodes to no tokens", param="prompt")
            return ids
        if self.vocab_size is not None:
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(f"prompt token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
                               param="prompt")  # fmt: skip
        return list(prompt)

    def sampling(self, req, n_prompt: int, max_tokens: int | None, explicit: bool, logprobs: int | None):
        """SamplingParams for a request; the context check (prompt + max_tokens <= the model's context)."""
        from kvlm.serve.engine import SamplingParams

        room = self.max_model_len - n_prompt
        if room < 1:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n_prompt}",
                param="prompt", code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None or (not explicit and max_tokens > room):
            max_tokens = room
        elif max_tokens > room:
            raise APIError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {n_prompt} "
                f"and max_tokens is {max_tokens} ({n_prompt + max_tokens} in all)",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_k=max(0, req.top_k or 0),
                top_p=1.0 if req.top_p is None else req.top_p,
                seed=req.seed,
                stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids or []),
                logprobs=logprobs,
                ignore_eos=req.ignore_eos,
            )
        except ValueError as e:  # SamplingParams names the field first ("top_k must be ...")
            field = str(e).split(" ", 1)[0]
            raise APIError(
                f"invalid sampling parameters: {e}", param=field if field in _FIELDS else None
            ) from None

    def fan_out(self, params, n: int) -> list:
        """n SamplingParams for n completions of one prompt: a seeded request's completion i uses seed + i (so
        they differ, and the whole response is reproducible)."""
        if n > self.engine.max_inflight:
            raise APIError(
                f"n={n} is more than this server runs at once ({self.engine.max_inflight})", param="n"
            )
        if params.seed is None:
            return [params] * n  # each engine request draws its own random seed
        return [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]

    async def submit(self, ids: list[int], params: list):
        try:
            return await self.engine.add(ids, params)
        except Overloaded as e:
            raise APIError(str(e), status=429, type="rate_limit_error", code="server_overloaded") from None
        except EngineStopped as e:
            raise APIError(str(e), status=503, type="server_error", code="unavailable") from None
        except ValueError as e:  # the engine refuses: the sequence can never fit its cache pool
            raise APIError(str(e), param="prompt") from None

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def create_app(
    engine: AsyncEngine,
    tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    vocab_size: int | None = None,
    chat: ChatFormatter | None = None,
    shutdown_grace_s: float = 0.0,
):
    """The FastAPI app; its lifespan starts the engine thread and stops it (``shutdown_grace_s`` to finish)."""
    fastapi, _ = require_server_stack()
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    st = _State(engine, tokenizer, model_name, max_model_len, vocab_size, chat or ChatFormatter())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        logger.info("serving %s (context %d tokens)", model_name, max_model_len)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop, shutdown_grace_s)

    app = fastapi.FastAPI(title="kvlm", lifespan=lifespan)
    app.state.kvlm = st

    def error_response(e: APIError):
        if engine.metrics is not None:
            engine.metrics.rejected.labels(status=str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request, e):  # OpenAI answers 400 where FastAPI would answer 422
        return error_response(APIError(f"invalid request: {e.errors()[:1]}"))

    @app.exception_handler(HTTPException)
    async def _http(request, e):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(e.detail), status=e.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _internal(request, e):
        logger.exception("internal error")
        return error_response(APIError(f"internal server error: {e}", status=500, type="server_error"))

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "stopped", "error": str(engine.error or "")}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "kvlm",
                "max_model_len": max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        if engine.metrics is None:
            raise APIError("metrics are disabled", status=404, type="not_found_error")
        return Response(engine.metrics.render(), media_type=engine.metrics.content_type)

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        req: CompletionRequest = parse_request(await request.body(), CompletionRequest)
        st.check_model(req.model)
        prompt = req.one_prompt()
        ids = st.encode(prompt)
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        params = st.sampling(req, len(ids), req.max_tokens, explicit, req.logprobs)
        stream = await st.submit(ids, st.fan_out(params, req.n))
        rid = new_id("cmpl")
        echo = prompt if req.echo else ""

        def choice(index: int, out, text: str, finish: str | None, offset: int) -> dict:
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            if req.logprobs is not None and out["token_logprobs"] is not None:
                c["logprobs"] = completion_logprobs(
                    st.token_texts(out["ids"]), out["token_logprobs"], out["top_logprobs"], offset
                )
            if req.return_token_ids:
                c["token_ids"] = out["ids"]
            return c

        if req.stream:
            frames = StreamFrames(rid, "text_completion", model_name)

            async def events():
                offsets, started, completion = [len(echo)] * req.n, [False] * req.n, [0] * req.n
                async for batch in stream:
                    chunks = []
                    for i, out in batch:
                        text = out.new_text if started[i] else echo + out.new_text
                        started[i] = True
                        completion[i] = out.completion_tokens
                        if text or out.new_token_ids or out.finished:
                            chunks.append(
                                frames.choice(choice(i, delta(out), text, out.finish_reason, offsets[i]))
                            )
                            offsets[i] += len(out.new_text)
                    if chunks:  # one write for all that arrived together
                        yield "".join(chunks)
                if req.stream_options and req.stream_options.include_usage:
                    yield frames.usage(usage(len(ids), sum(completion)))

            return _streaming(StreamingResponse, stream, events())
        per_index = await _collect(stream, request, req.n)
        if per_index is None:
            return Response(status_code=499)
        choices, completion = [], 0
        for i, outs in enumerate(per_index):
            whole, last = merge_outputs(outs), outs[-1]
            choices.append(choice(i, whole, echo + whole["text"], last.finish_reason, len(echo)))
            completion += last.completion_tokens
        return completion_body(rid, model_name, choices, usage(len(ids), completion), chunk=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request):
        req: ChatCompletionRequest = parse_request(await request.body(), ChatCompletionRequest)
        st.check_model(req.model)
        try:
            text = st.chat.render([(m.role, m.text()) for m in req.messages])
        except ChatTemplateError as e:
            raise APIError(str(e), param="messages") from None
        ids = st.encode(text)
        limit = req.requested_max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = st.sampling(req, len(ids), limit, limit is not None, logprobs)
        stream = await st.submit(ids, st.fan_out(params, req.n))
        rid = new_id("chatcmpl")

        def lp(part) -> dict | None:
            if not req.logprobs or part["token_logprobs"] is None:
                return None
            return chat_logprobs(st.token_texts(part["ids"]), part["token_logprobs"], part["top_logprobs"])

        if req.stream:
            frames = StreamFrames(rid, "chat.completion.chunk", model_name)

            async def events():
                yield "".join(
                    frames.choice({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None})
                    for i in range(req.n)
                )  # fmt: skip
                completion = [0] * req.n
                async for batch in stream:
                    chunks = []
                    for i, out in batch:
                        completion[i] = out.completion_tokens
                        part = delta(out)
                        if not (out.new_text or part["ids"] or out.finished):
                            continue
                        content = {"content": out.new_text} if (out.new_text or not out.finished) else {}
                        c = {
                            "index": i,
                            "delta": content,
                            "logprobs": lp(part),
                            "finish_reason": out.finish_reason,
                        }
                        if req.return_token_ids:
                            c["token_ids"] = part["ids"]
                        chunks.append(frames.choice(c))
                    if chunks:
                        yield "".join(chunks)
                if req.stream_options and req.stream_options.include_usage:
                    yield frames.usage(usage(len(ids), sum(completion)))

            return _streaming(StreamingResponse, stream, events())
        per_index = await _collect(stream, request, req.n)
        if per_index is None:
            return Response(status_code=499)
        choices, completion = [], 0
        for i, outs in enumerate(per_index):
            whole, last = merge_outputs(outs), outs[-1]
            c = {"index": i, "message": {"role": "assistant", "content": whole["text"]}, "logprobs": lp(whole),
                 "finish_reason": last.finish_reason}  # fmt: skip
            if req.return_token_ids:
                c["token_ids"] = whole["ids"]
            choices.append(c)
            completion += last.completion_tokens
        return chat_body(rid, model_name, choices, usage(len(ids), completion), chunk=False)

    return app


# --- helpers --------------------------------------------------------------------------------------------
def _streaming(response_cls, stream, events):
    async def body():
        try:
            async for event in events:
                yield event
            yield "data: [DONE]\n\n"
        finally:  # the client went away (Starlette cancels this task) or the stream ended: abort if unfinished
            stream.close()

    return response_cls(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _collect(stream, request, n: int) -> list[list] | None:
    """All outputs of a non-streaming request, per choice index; None (and the request aborted) if its client
    disconnected.

    The client's disconnect is awaited as Starlette's StreamingResponse awaits it (the next ASGI message after the
    body is "http.disconnect"); ``Request.is_disconnected()`` polling does not see a client that closed its
    socket while the server is not reading."""

    async def drain():
        per_index: list[list] = [[] for _ in range(n)]
        async for batch in stream:
            for i, out in batch:
                per_index[i].append(out)
        return per_index

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    collector, listener = asyncio.ensure_future(drain()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collector, listener}, return_when=asyncio.FIRST_COMPLETED)
        return collector.result() if collector.done() else None
    finally:
        for task in (collector, listener):
            task.cancel()
        stream.close()
