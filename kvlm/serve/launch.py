"""Assembling and running a server: what is served, the engine + app, and uvicorn with a graceful shutdown.

- ``load_served_model(spec)``: a checkpoint folder, a preset (random weights) or ``bench/<attention>``.
- ``build_server(served, ...)``: the Engine, its AsyncEngine thread, the metrics and the FastAPI app.
- ``uvicorn_server(app, ...)``: uvicorn whose shutdown drains the engine first (used by ``kvlm serve``).
- ``ServerThread(app)``: the same on a background thread, port 0 = a free port (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlm.logs import get_logger
from kvlm.serve.async_engine import AsyncEngine
from kvlm.serve.chat import ChatFormatter, load_chat_template
from kvlm.serve.server import create_app, require_server_stack

logger = get_logger(__name__)


# --- what is served -------------------------------------------------------------------------------------
@dataclass
class Served:
    model: torch.nn.Module
    tokenizer: object
    name: str
    chat_template: str | None = None
    random_weights: bool = False


def byte_tokenizer():
    """A byte-level tokenizer (256 bytes + end-of-text = id 0) for models without one: presets with random
    weights. Ids past 256 decode to nothing."""
    from kvlm.data.tokenizer import train_bpe

    return train_bpe(["a"], vocab_size=257)


def load_served_model(spec: str, *, seed: int = 0, device=None, dtype=None) -> Served:
    """A checkpoint folder (with its tokenizer and chat template), a preset name (``tiny/mla``, see
    ``kvlm.presets()``) or ``bench/<attention>[:key=value...]`` (the bench reference shape, kvlm.bench.suites);
    presets get random weights from ``seed`` and the byte-level tokenizer."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if Path(spec).is_dir():
        from kvlm.checkpoint import load_checkpoint

        model, tokenizer, _ = load_checkpoint(spec, device=device, dtype=dtype)
        if tokenizer is None:
            logger.warning("checkpoint %s has no tokenizer.json: serving with the byte-level tokenizer", spec)
            tokenizer = byte_tokenizer()
        return Served(model, tokenizer, Path(spec).resolve().name, load_chat_template(spec))
    from kvlm.model import build_model

    if spec.startswith("bench/"):
        from kvlm.bench.plan import parse_variant
        from kvlm.bench.suites import REFERENCE_SHAPE

        _, cfg = parse_variant(spec[len("bench/") :], REFERENCE_SHAPE)
    else:
        from kvlm.preset_table import get_preset

        try:
            cfg = get_preset(spec)
        except KeyError as e:
            raise ValueError(
                f"{spec!r} is neither a checkpoint folder nor a preset ({e}); presets: kvlm.presets(), or "
                "bench/<attention>"
            ) from None
    torch.manual_seed(seed)
    model = build_model(cfg).to(device=device, dtype=dtype).eval()
    return Served(model, byte_tokenizer(), spec, None, random_weights=True)


# --- assembling and running ----------------------------------------------------------------------------
def build_server(
    served: Served,
    *,
    model_name: str | None = None,
    max_batch: int = 64,
    max_waiting: int = 256,
    shutdown_grace_s: float = 0.0,
    metrics: bool = True,
    **engine_options,
):
    """(app, AsyncEngine) serving ``served``; ``engine_options`` go to Engine (cache_bytes, cache_tokens,
    page_size, kv_dtype, prefill_chunk, enable_prefix_cache)."""
    require_server_stack()
    from kvlm.serve.engine import Engine
    from kvlm.serve.metrics import ServeMetrics

    if next(served.model.parameters()).device.type == "cpu":
        from kvlm.kernels import cpu as cpu_kernels

        # build (or load the cached build of) the decode kernel before the port opens, so the first request does
        # not wait for the compiler (~1 min on a fresh machine); None (plain path) if it cannot be built
        cpu_kernels.extension()
    engine = Engine(served.model, served.tokenizer, max_batch=max_batch, **engine_options)
    name = model_name or served.name
    async_engine = AsyncEngine(engine, max_batch=max_batch, max_waiting=max_waiting)
    if metrics:
        async_engine.metrics = ServeMetrics(async_engine.stats, name)
    tok = served.tokenizer
    chat = ChatFormatter(
        served.chat_template,
        bos_token=getattr(tok, "bos_token", "") or "",
        eos_token=getattr(tok, "eos_token", ""),
    )
    app = create_app(
        async_engine, tok, model_name=name, max_model_len=engine.max_model_len,
        vocab_size=served.model.cfg.vocab_size, chat=chat, shutdown_grace_s=shutdown_grace_s,
    )  # fmt: skip
    return app, async_engine


def uvicorn_server(
    app,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    graceful_s: float = 30.0,
    log_level="info",
    access_log=True,
):
    """A uvicorn.Server for ``app`` (from create_app) whose shutdown (SIGTERM, Ctrl-C, ``should_exit``) first
    stops accepting connections, then gives in-flight requests ``graceful_s`` seconds to finish and aborts the
    rest through the engine (their streams end with finish_reason "abort" and [DONE]), then lets uvicorn close
    the connections and run the lifespan's shutdown."""
    _, uvicorn = require_server_stack()
    engine = app.state.kvlm.engine

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            for server in self.servers:
                server.close()
            await asyncio.to_thread(engine.stop, graceful_s)
            await super().shutdown(sockets)

    missing = [m for m in ("httptools", "uvloop") if importlib.util.find_spec(m) is None]
    if missing:  # uvicorn then falls back to h11 (pure Python) and asyncio's own loop
        logger.info(
            "uvicorn runs without %s: each streamed token costs the event loop more CPU, which the engine thread "
            "waits for (one GIL); pip install 'uvicorn[standard]'", " and ".join(missing),
        )  # fmt: skip
    # uvicorn's own wait only covers sending what the stopped engine produced
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5.0
    )
    return Server(config)


class ServerThread:
    """uvicorn serving ``app`` on a background thread (tests, the load generator); port 0 picks a free one.

    ``stop()`` is uvicorn's graceful shutdown: stop accepting, wait up to ``graceful_s`` for open requests,
    cancel the rest, then the app's lifespan stops the engine."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, graceful_s: float = 5.0):
        import threading

        self.server = uvicorn_server(app, host=host, port=port, graceful_s=graceful_s, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="kvlm-uvicorn", daemon=True)
        self.host = host
        self.port = port

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
