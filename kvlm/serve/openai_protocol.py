"""The OpenAI HTTP protocol: request models (pydantic), OpenAI-style errors, and the response bodies.

Requests are validated strictly (``strict=True``: a string where a number belongs is an error, not a number),
so a wrong type is one clear 400, as the OpenAI API answers, never FastAPI's 422. Unknown fields are ignored
(clients send fields a small server does not implement, e.g. ``user``); fields that would change the output and
are not implemented (penalties, ``logit_bias``, ``best_of`` > 1, ``suffix``, tools) get a 400 naming them
rather than being silently dropped. ``n`` (1..128, OpenAI's limit) completions of one prompt are served as n
engine requests (the prefix cache shares the prompt's pages); a seeded request's completion i uses seed + i.
``best_of`` > 1 is refused, as vLLM V1 does: ask for ``n`` with ``logprobs`` and rank them yourself.
Extensions, as vLLM spells them: ``top_k``, ``ignore_eos``, ``stop_token_ids`` and ``return_token_ids`` (the
generated token ids in each choice, ``token_ids``).

Streamed chunks are built by ``StreamFrames``: the envelope every chunk of a stream shares (id, object, created,
model) is serialized once per response, so each event encodes only its choice, one small ``json.dumps``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

try:
    from pydantic import BaseModel, ConfigDict, ValidationError
except ImportError as e:  # pydantic comes with FastAPI, the optional extra
    raise ImportError("kvlm serve needs FastAPI, uvicorn and pydantic: pip install 'kvlm[serve]'") from e

# what OpenAI allows for logprobs / top_logprobs, and for n
MAX_LOGPROBS = 20
MAX_N = 128


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    ignore_eos: bool = False  # extension
    return_token_ids: bool = False  # extension: choices[i].token_ids
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.temperature is not None and not 0 <= self.temperature <= 2:
            raise APIError(f"temperature must be in [0, 2], got {self.temperature}", param="temperature")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise APIError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k is not None and self.top_k < -1:
            raise APIError(
                f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k}", param="top_k"
            )
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream: true", param="stream_options")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4:
            raise APIError(f"at most 4 stop sequences, got {len(stops)}", param="stop")
        if any(not s for s in stops):
            raise APIError("stop sequences must not be empty", param="stop")
        return stops


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        if self.best_of not in (None, 1):
            raise APIError(
                f"best_of={self.best_of} is not supported (as in vLLM V1): ask for n completions, with logprobs "
                "to rank them",
                param="best_of",
            )
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        if self.echo and (self.logprobs is not None or not isinstance(self.one_prompt(), str)):
            raise APIError("echo is supported for a text prompt without logprobs", param="echo")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")

    def one_prompt(self) -> str | list[int]:
        """The single prompt: a string or a list of token ids (a list holding one of them is accepted)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(
                    f"{len(p)} prompts in one request: this server takes one prompt per request",
                    param="prompt",
                )
            p = p[0]
        if len(p) == 0:
            raise APIError("prompt is empty", param="prompt")
        return p


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"content part of type {part.type!r} is not supported (text only)", param="messages"
                )
            parts.append(part.text)
        return "".join(parts)


class ResponseFormat(_Strict):
    type: str


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise APIError("messages is empty", param="messages")
        if self.tools:
            raise APIError("tools are not supported", param="tools")
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(
                f"response_format {self.response_format.type!r} is not supported (text only)",
                param="response_format",
            )
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                    param="top_logprobs",
                )
        limit = self.requested_max_tokens
        if limit is not None and limit < 1:
            raise APIError(f"max_tokens must be >= 1, got {limit}", param="max_tokens")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(body: bytes, model: type[_Strict]) -> Any:
    """The request model from a raw JSON body; any problem is one APIError naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        message, param = _validation_message(e)
        raise APIError(message, param=param) from None
    req.check()
    return req


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return f"malformed JSON body: {err['msg']}", None
    loc = ".".join(str(x) for x in err["loc"])
    if not loc:
        return f"the request body must be a JSON object: {err['msg']}", None
    # a field of a union reports one error per member; the field itself is what the user needs
    param = str(err["loc"][0])
    return f"invalid value for {param!r}: {err['msg']} (at {loc}, got {err.get('input')!r})", param


# --- responses ------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choices(choices: list[dict] | dict | None) -> list[dict]:
    return choices if isinstance(choices, list) else [choices] if choices else []


def completion_body(
    rid: str, model: str, choices: list[dict] | dict | None, usage_: dict | None, chunk: bool
) -> dict:
    """A completions response (or one chunk of a stream) with one choice or a list of them."""
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model}
    body["choices"] = _choices(choices)
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def chat_body(
    rid: str, model: str, choices: list[dict] | dict | None, usage_: dict | None, chunk: bool
) -> dict:
    """A chat completions response (or one chunk of a stream) with one choice or a list of them."""
    obj = "chat.completion.chunk" if chunk else "chat.completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model}
    body["choices"] = _choices(choices)
    if usage_ is not None or not chunk:
        body["usage"] = usage_
    return body


def completion_logprobs(
    tokens: list[str], logprobs: list[float], top: list[dict] | None, offset0: int
) -> dict:
    """The legacy completions ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""
    offsets, pos = [], offset0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokens: list[str], logprobs: list[float], top: list[dict] | None) -> dict:
    """The chat ``logprobs`` object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for i, (t, lp) in enumerate(zip(tokens, logprobs)):
        alts = top[i] if top and i < len(top) else {}
        content.append({**entry(t, lp), "top_logprobs": [entry(k, v) for k, v in alts.items()]})
    return {"content": content}


# one encoder for every event: json.dumps with non-default separators builds a new JSONEncoder per call, which
# was ~10 % of the event loop's time per streamed token
_dumps = json.JSONEncoder(separators=(",", ":")).encode


def sse(obj: dict) -> str:
    """One server-sent event."""
    return f"data: {_dumps(obj)}\n\n"


class StreamFrames:
    """The server-sent events of one streamed response, as ``sse(completion_body(...))`` / ``sse(chat_body(...))``
    give them, with the envelope all its chunks share serialized once."""

    def __init__(self, rid: str, obj: str, model: str):
        created = int(time.time())
        self._head = (
            f'data: {{"id":{_dumps(rid)},"object":{_dumps(obj)},"created":{created},'
            f'"model":{_dumps(model)},"choices":['
        )

    def choice(self, choice: dict[str, Any]) -> str:
        """A chunk with one choice."""
        return f"{self._head}{_dumps(choice)}]}}\n\n"

    def usage(self, usage_: dict[str, int]) -> str:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return f'{self._head}],"usage":{_dumps(usage_)}}}\n\n'


def delta(out) -> dict:
    """The token part of one RequestOutput."""
    return {
        "ids": list(out.new_token_ids),
        "token_logprobs": out.token_logprobs,
        "top_logprobs": out.top_logprobs,
    }


def merge_outputs(outs) -> dict:
    """The RequestOutputs of one request joined: ids, text, token_logprobs, top_logprobs."""
    ids, text, lps, tops = [], [], [], []
    has_lp = any(o.token_logprobs is not None for o in outs)
    for o in outs:
        ids += o.new_token_ids
        text.append(o.new_text)
        lps += o.token_logprobs or []
        tops += o.top_logprobs or []
    return {"ids": ids, "text": "".join(text), "token_logprobs": lps if has_lp else None,
            "top_logprobs": tops if has_lp and tops else None}  # fmt: skip
