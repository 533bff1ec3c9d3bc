"""The engine loop in one background thread, and per HTTP request a stream of its outputs on the event loop.

``Engine`` (kvlm/serve/engine.py) is single-threaded: every call to it (add_request, abort, step, stats)
happens on the one thread started here. The HTTP handlers, on uvicorn's event loop, talk to that thread through
a command queue (add, abort, stop). While the engine has work the thread steps it as fast as it can, taking new
commands between steps; when idle it sleeps on an event that a new command sets (no polling), so an idle server
uses no CPU.

The hand-off back is batched, because the engine thread and the event loop share one GIL and every Python
instruction the loop runs is time the engine does not step: after each step ONE ``call_soon_threadsafe`` per
event loop carries every request's new tokens (not one wake-up per request), and each HTTP request has a
``_Sink`` that merges the outputs its consumer has not taken yet (vLLM's RequestOutputCollector), so a consumer
that falls behind sends one event with several tokens instead of queueing one event per token.

One HTTP request may hold ``n`` engine requests (OpenAI's ``n`` completions of one prompt): ``add`` takes a
list of SamplingParams and returns one ``RequestStream`` yielding ``(index, RequestOutput)`` pairs.

Admission control: at most ``max_batch + max_waiting`` engine requests are in flight (running or queued);
``add`` raises ``Overloaded`` beyond that, which the server answers with 429, so a flood of clients can neither
grow the queue without bound nor crash the server. A request whose consumer goes away (``RequestStream.close``,
a cancelled task, a client disconnect) is aborted on the engine thread, which frees its cache pages at once.

``stop(grace_s)`` refuses new requests, lets in-flight ones finish for up to ``grace_s`` seconds, then aborts the
rest (their streams end with finish_reason "abort") and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from kvlm.logs import get_logger

logger = get_logger(__name__)


class Overloaded(RuntimeError):
    """Too many requests in flight; retry later (HTTP 429)."""


class EngineStopped(RuntimeError):
    """The engine is stopping or has failed; no new requests (HTTP 503)."""


@dataclass
class _Abort:
    """A final output for a request ended by the server (shutdown or engine failure)."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    new_token_ids: list = field(default_factory=list)
    new_text: str = ""
    token_logprobs: list | None = None
    top_logprobs: list | None = None
    finished: bool = True
    finish_reason: str = "abort"


def merge_output(a, b):
    """Two consecutive outputs of one request as one: the deltas joined, the rest (finished, counts) from ``b``."""

    def join(x, y):
        return None if x is None and y is None else (x or []) + (y or [])

    return dataclasses.replace(
        b,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        new_text=a.new_text + b.new_text,
        token_logprobs=join(a.token_logprobs, b.token_logprobs),
        top_logprobs=join(a.top_logprobs, b.top_logprobs),
    )


class _Sink:
    """The outputs of one HTTP request's engine requests not yet taken by its consumer, merged per index.

    Touched only on its event loop (``put`` is called there by the batched hand-off)."""

    __slots__ = ("loop", "pending", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.pending: dict[int, object] = {}
        self.waiter: asyncio.Future | None = None

    def put(self, index: int, out) -> None:
        prev = self.pending.get(index)
        self.pending[index] = out if prev is None else merge_output(prev, out)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> list[tuple[int, object]]:
        while not self.pending:
            self.waiter = self.loop.create_future()
            await self.waiter
        items, self.pending = list(self.pending.items()), {}
        return items


@dataclass
class _Stream:
    """One engine request, as the engine thread tracks it."""

    request_id: str
    index: int
    sink: _Sink
    prompt_tokens: int
    t_arrival: float
    t_last: float | None = None
    completion_tokens: int = 0
    done: bool = False


def _deliver(batch: list) -> None:
    """On the event loop: one step's outputs to their sinks."""
    for sink, index, out in batch:
        sink.put(index, out)


class RequestStream:
    """The outputs of one HTTP request's ``n`` engine requests: ``async for batch in stream`` gives lists of
    ``(index, RequestOutput)`` (all that arrived since the last, merged per index) until every one has finished;
    ``close()`` aborts those that have not."""

    def __init__(self, owner: AsyncEngine, sink: _Sink, request_ids: list[str]):
        self._owner, self._sink = owner, sink
        self.request_ids = request_ids
        self._open = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._open

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[tuple[int, object]]:
        if not self._open:
            raise StopAsyncIteration
        items = await self._sink.get()
        for index, out in items:
            if out.finished:
                self._open.discard(index)
        return items

    def close(self) -> None:
        for index in sorted(self._open):
            self._owner.abort(self.request_ids[index])
        self._open.clear()


class AsyncEngine:
    """Runs ``engine`` on a background thread; ``add`` returns a RequestStream of its RequestOutputs."""

    def __init__(self, engine, *, max_batch: int = 64, max_waiting: int = 256, metrics=None):
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        self.engine = engine
        self.max_inflight = max_batch + max_waiting
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._inflight = 0  # engine requests added and not yet finished; guarded by _lock
        self._lock = threading.Lock()
        self._accepting = True
        self._stop_now = False
        self._thread: threading.Thread | None = None
        self._stats: dict = {}
        self.error: BaseException | None = None

    # --- lifecycle ---
    def start(self) -> None:
        if self._thread is None:
            self._stats = self.engine.stats()
            self._thread = threading.Thread(target=self._run, name="kvlm-engine", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop(self, grace_s: float = 0.0) -> None:
        """Refuse new requests; wait up to ``grace_s`` for in-flight ones; abort the rest; join the thread."""
        self._accepting = False
        if self._thread is None or not self._thread.is_alive():
            return
        deadline = time.monotonic() + grace_s
        while self.inflight and time.monotonic() < deadline and self.alive:
            time.sleep(0.02)
        if self.inflight:
            logger.info("stopping the engine: aborting %d in-flight requests", self.inflight)
        self._stop_now = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def stats(self) -> dict:
        """The engine's stats after its last step, plus ``inflight``; safe from any thread."""
        return {**self._stats, "inflight": self.inflight}

    # --- requests (any thread with a running event loop) ---
    async def add(self, prompt_ids: list[int], params) -> RequestStream:
        """Queue one request per SamplingParams in ``params`` (one, or a list: n completions of the prompt), all
        or none; raises Overloaded (429), EngineStopped (503) or the engine's ValueError (400)."""
        params_list = params if isinstance(params, list) else [params]
        n = len(params_list)
        if not self._accepting or not self.alive:
            raise EngineStopped(
                "the server is shutting down" if not self._accepting else "the engine has stopped"
            )
        with self._lock:
            if self._inflight + n > self.max_inflight:
                raise Overloaded(
                    f"server overloaded: {self._inflight} requests in flight (limit {self.max_inflight}); retry later"
                )
            self._inflight += n
        loop = asyncio.get_running_loop()
        sink, now, base = _Sink(loop), time.perf_counter(), uuid.uuid4().hex
        streams = [_Stream(f"{base}-{i}" if n > 1 else base, i, sink, len(prompt_ids), now) for i in range(n)]
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", streams, list(prompt_ids), params_list, done))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # refused by the engine (ValueError), or the caller was cancelled while waiting: if the add went
            # through meanwhile, abort it so nothing is left running for nobody
            for s in streams:
                self.abort(s.request_id)
            with self._lock:
                for s in streams:
                    if not s.done:
                        s.done = True
                        self._inflight -= 1
            raise
        return RequestStream(self, sink, [s.request_id for s in streams])

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # --- the engine thread ---
    def _run(self) -> None:
        try:
            while True:
                self._drain_commands()
                if self._stop_now:
                    break
                if self.engine.has_unfinished():
                    outputs = self.engine.step()
                    self._stats = self.engine.stats()
                    self._dispatch(outputs)
                else:
                    self._stats = self.engine.stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as e:  # an engine bug: end every stream rather than hang the clients
            logger.exception("the engine failed; ending all requests")
            self.error = e
        finally:
            for rid in list(self._streams):
                if self.error is None:  # a clean stop: the engine frees the request's pages
                    self.engine.abort(rid)
                self._end(rid, error=str(self.error) if self.error else None)
            self._drain_commands(refuse=True)
            if self.error is None:
                while self.engine.has_unfinished():  # reports the aborts; nothing is left scheduled
                    self.engine.step()
                self._stats = self.engine.stats()

    def _drain_commands(self, refuse: bool = False) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                self._add(*cmd[1:], refuse=refuse)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._streams and not refuse:
                    try:
                        self.engine.abort(rid)
                    except (KeyError, ValueError):  # finished in the meantime
                        pass
                    self._end(rid, put=False)
                    self._stats = self.engine.stats()

    def _add(self, streams: list[_Stream], prompt_ids, params_list, done, refuse: bool) -> None:
        if done.cancelled():
            return
        if refuse:
            done.set_exception(EngineStopped("the engine has stopped"))
            return
        added = []
        try:
            for s, params in zip(streams, params_list):
                added.append(self.engine.add_request(prompt_ids, params, request_id=s.request_id))
        except BaseException as e:  # ValueError: cannot fit, bad params -> 400 upstream; none of the n runs
            for rid in added:
                self.engine.abort(rid)
            done.set_exception(e)
            return
        for s in streams:
            self._streams[s.request_id] = s
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt_ids) * len(streams))
        done.set_result(None)

    def _dispatch(self, outputs) -> None:
        """One step's outputs to their consumers: the metrics, then one thread-safe hand-off per event loop."""
        now = time.perf_counter()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        m, generated = self.metrics, 0
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:  # aborted by its consumer while this step ran
                continue
            n = len(out.new_token_ids)
            if n:
                if m is not None:
                    if s.t_last is None:
                        m.ttft.observe(now - s.t_arrival)
                    else:
                        gap = (now - s.t_last) / n  # tokens that arrive together share the gap
                        for _ in range(n):
                            m.itl.observe(gap)
                s.t_last = now
                s.completion_tokens += n
                generated += n
            batches.setdefault(s.sink.loop, []).append((s.sink, s.index, out))
            if out.finished:
                self._end(out.request_id, put=False, reason=out.finish_reason)
        if m is not None:
            m.record_tokens(generated, now)
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the requests' event loop has closed: nobody is listening
                for _, _, out in batch:
                    if out.request_id in self._streams:
                        self.engine.abort(out.request_id)
                        self._end(out.request_id, put=False)

    def _end(self, rid: str, *, put: bool = True, reason: str = "abort", error: str | None = None) -> None:
        """Forget a request; with ``put``, its stream gets a final "abort" output (server-side end)."""
        s = self._streams.pop(rid, None)
        if s is None:
            return
        if put:
            final = _Abort(rid, s.prompt_tokens, s.completion_tokens, error=error)
            try:
                s.sink.loop.call_soon_threadsafe(s.sink.put, s.index, final)
            except RuntimeError:  # its event loop is already closed
                pass
        if self.metrics is not None:
            self.metrics.finished.labels(finish_reason=reason or "abort").inc()
            self.metrics.e2e.observe(time.perf_counter() - s.t_arrival)
        with self._lock:
            if not s.done:
                s.done = True
                self._inflight -= 1
