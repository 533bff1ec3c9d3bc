"""What a client asks for and what it gets back: ``SamplingParams``, ``RequestOutput``, and the engine's
per-request state ``Request`` (its tokens, how many are in the cache, its random generator, its text).

Stop strings are matched on the decoded text. Text is produced incrementally (``TextStream``: a short window
per token, so no O(n^2) re-decoding), and the last ``len(longest stop) - 1`` characters are held back: a stop
string that has not finished arriving is never sent, and the text sent excludes the stop string (OpenAI's rule).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvlm.inference.generation import TextStream

_ids = itertools.count()


@dataclass
class SamplingParams:
    """Per-request sampling; every field is checked here (a ValueError naming the field)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # a seed makes the request's draws reproducible, whatever else runs beside it
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top alternatives per token (0: only the chosen token's log-probability)
    ignore_eos: bool = False

    def __post_init__(self):
        def need(ok: bool, name: str, what: str):
            if not ok:
                raise ValueError(f"{name} {what}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(is_num(self.temperature) and 0 <= self.temperature < float("inf"), "temperature", "must be >= 0")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an integer >= 0 (0 disables it)")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "must be an integer or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(
            isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be a list of non-empty strings",
        )
        need(
            isinstance(self.stop_token_ids, (list, tuple))
            and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be a list of token ids >= 0",
        )
        need(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "must be an integer in [0, 20] or None",
        )
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)


@dataclass
class RequestOutput:
    """What one engine step produced for one request; the token/text fields are the delta since the last."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One request inside the engine. ``all_ids`` = prompt + generated; ``computed`` of them are in the cache."""

    def __init__(
        self, request_id: str | None, prompt_ids: list[int], params: SamplingParams, tokenizer, seed
    ):
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.status = Status.WAITING
        self.computed = 0  # tokens of all_ids whose K/V are cached
        self.finish_reason: str | None = None
        self.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else seed)
        self.tokenizer = tokenizer
        self.stream = TextStream(tokenizer) if tokenizer is not None else None
        self.pending_text = ""  # decoded but held back (a stop string may be starting)
        self.hold = max((len(s) for s in params.stop), default=1) - 1
        # the delta since the last RequestOutput
        self.new_ids: list[int] = []
        self.new_text = ""
        self.new_logprobs: list[float] = []
        self.new_top: list[dict[str, float]] = []

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    # --- a new token ------------------------------------------------------------------------------
    def append(self, token: int, logprob: float | None, top: dict[str, float] | None) -> None:
        """Record a sampled token (not yet checked against the stop conditions)."""
        self.output_ids.append(token)
        self.new_ids.append(token)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        if top is not None:
            self.new_top.append(top)
        if self.stream is not None:
            self.pending_text += self.stream.push(token)

    def check_stop_string(self) -> bool:
        """Cut the text at the first stop string in the held-back text; True when one was found."""
        for s in self.params.stop:
            i = self.pending_text.find(s)
            if i >= 0:
                self.new_text += self.pending_text[:i]
                self.pending_text = ""
                return True
        return False

    def release_text(self, final: bool) -> bool:
        """Move the text that can no longer be the start of a stop string to the delta. With ``final``, flush
        everything; returns True when the flushed text held a stop string (cut there)."""
        if final and self.stream is not None:
            self.pending_text += self.stream.flush()
            if self.check_stop_string():
                return True
        keep = 0 if final else self.hold
        cut = len(self.pending_text) - keep
        if cut > 0:
            self.new_text += self.pending_text[:cut]
            self.pending_text = self.pending_text[cut:]
        return False

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason

    def take_output(self) -> RequestOutput:
        """The delta since the last output, then cleared."""
        want_lp = self.params.logprobs is not None
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=self.new_ids,
            new_text=self.new_text,
            token_logprobs=self.new_logprobs if want_lp else None,
            top_logprobs=self.new_top if want_lp and self.params.logprobs > 0 else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
        )
        self.new_ids, self.new_text, self.new_logprobs, self.new_top = [], "", [], []
        return out


__all__ = ["Request", "RequestOutput", "SamplingParams", "Status"]
