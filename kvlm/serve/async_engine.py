"""The engine loop in one background thread, with an asyncio stream per request.

``Engine`` (kvlm/serve/engine.py) is single-threaded: every call to it (add_request, abort, step, stats)
happens on the one thread started here. The HTTP handlers, on uvicorn's event loop, talk to that thread through
a command queue (add, abort, stop) and receive each request's outputs on their own ``asyncio.Queue``, filled with
``loop.call_soon_threadsafe``. While the engine has work the thread steps it as fast as it can; when idle it
sleeps on an event that a new command sets, so an idle server uses no CPU.

Admission control: at most ``max_batch + max_waiting`` requests are in flight (running or queued in the engine);
``add`` raises ``Overloaded`` beyond that, which the server answers with 429, so a flood of clients can neither
grow the queue without bound nor crash the server. A request whose consumer goes away (``RequestStream.close``,
a cancelled task, a client disconnect) is aborted on the engine thread, which frees its cache pages at once.

``stop(grace_s)`` refuses new requests, lets in-flight ones finish for up to ``grace_s`` seconds, then aborts the
rest (their streams end with finish_reason "abort") and joins the thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
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
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    prompt_tokens: int
    t_arrival: float
    t_last: float | None = None
    completion_tokens: int = 0
    done: bool = False


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


class RequestStream:
    """The outputs of one request, as an async iterator; ``close()`` aborts it if it has not finished."""

    def __init__(self, owner: AsyncEngine, stream: _Stream):
        self._owner, self._s = owner, stream
        self.request_id = stream.request_id
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        out = await self._s.queue.get()
        if out.finished:
            self.finished = True
        return out

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)


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
        self._inflight = 0  # requests added and not yet finished; guarded by _lock
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
    async def add(self, prompt_ids: list[int], params, request_id: str | None = None) -> RequestStream:
        """Queue a request; raises Overloaded (429), EngineStopped (503) or the engine's ValueError (400)."""
        if not self._accepting or not self.alive:
            raise EngineStopped(
                "the server is shutting down" if not self._accepting else "the engine has stopped"
            )
        with self._lock:
            if self._inflight >= self.max_inflight:
                raise Overloaded(
                    f"server overloaded: {self._inflight} requests in flight (limit {self.max_inflight}); retry later"
                )
            self._inflight += 1
        rid = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        stream = _Stream(rid, loop, asyncio.Queue(), len(prompt_ids), time.perf_counter())
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", stream, list(prompt_ids), params, done))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)
        except BaseException:
            # refused by the engine (ValueError), or the caller was cancelled while waiting: if the add went
            # through meanwhile, abort it so nothing is left running for nobody
            self.abort(rid)
            with self._lock:
                if not stream.done:
                    stream.done = True
                    self._inflight -= 1
            raise
        return RequestStream(self, stream)

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
                _, stream, prompt_ids, params, done = cmd
                if done.cancelled():
                    continue
                if refuse:
                    done.set_exception(EngineStopped("the engine has stopped"))
                    continue
                try:
                    self.engine.add_request(prompt_ids, params, request_id=stream.request_id)
                except BaseException as e:  # ValueError: cannot fit, bad params -> 400 upstream
                    done.set_exception(e)
                    continue
                self._streams[stream.request_id] = stream
                if self.metrics is not None:
                    self.metrics.prompt_tokens.inc(stream.prompt_tokens)
                done.set_result(stream.request_id)
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._streams and not refuse:
                    try:
                        self.engine.abort(rid)
                    except (KeyError, ValueError):  # finished in the meantime
                        pass
                    self._end(rid, put=False)
                    self._stats = self.engine.stats()

    def _dispatch(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            s = self._streams.get(out.request_id)
            if s is None:  # aborted by its consumer while this step ran
                continue
            n = len(out.new_token_ids)
            if n:
                m = self.metrics
                if m is not None:
                    if s.t_last is None:
                        m.ttft.observe(now - s.t_arrival)
                    else:
                        for _ in range(n):  # tokens that arrive together share the gap
                            m.itl.observe((now - s.t_last) / n)
                    m.record_tokens(n, now)
                s.t_last = now
                s.completion_tokens += n
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, out)
            except RuntimeError:  # the request's event loop has closed: nobody is listening
                self.engine.abort(out.request_id)
                self._end(out.request_id, put=False)
                continue
            if out.finished:
                self._end(out.request_id, put=False, reason=out.finish_reason)

    def _end(self, rid: str, *, put: bool = True, reason: str = "abort", error: str | None = None) -> None:
        """Forget a request; with ``put``, its stream gets a final "abort" output (server-side end)."""
        s = self._streams.pop(rid, None)
        if s is None:
            return
        if put:
            final = _Abort(rid, s.prompt_tokens, s.completion_tokens, error=error)
            try:
                s.loop.call_soon_threadsafe(s.queue.put_nowait, final)
            except RuntimeError:  # its event loop is already closed
                pass
        if self.metrics is not None:
            self.metrics.finished.labels(finish_reason=reason or "abort").inc()
            self.metrics.e2e.observe(time.perf_counter() - s.t_arrival)
        with self._lock:
            if not s.done:
                s.done = True
                self._inflight -= 1
