"""The serving benchmark (`kvlm bench-serve`): a load generator for `kvlm serve`, its capacity, and the peer.

- ``run_load(url, ...)``: C clients, each sending streaming completions one after another (a closed loop),
  ``rounds`` requests per client, random token-id prompts of ``prompt_len`` and ``output_len`` generated tokens
  (``ignore_eos``, greedy). It reports generated tokens/s over the wall time, requests/s, time to first token
  and inter-token latency (p50, p99, mean; tokens that arrive in one chunk share the gap).
- ``capacity(url, context)``: how many ``context``-token sequences the server's cache pool holds, from the
  engine's own accounting (/metrics: pages, page size, bytes per token); ``demonstrate=True`` then submits that
  many at once and watches /metrics for the peak of sequences running together, with no preemption.
- ``kvlm.bench.serve_inprocess``: the same closed loop without HTTP, for kvlm's engine (``engine_load``) and
  for transformers' continuous batching (``peer_load``: the manager behind ``generate_batch``, its paged cache,
  on the same weights), so that the two are compared on equal terms.
- ``kvlm.bench.serve_hf``: ``transformers serve --continuous-batching`` on an exported folder, measured over
  HTTP by this module's client.
- ``start_server(spec, ...)`` runs ``kvlm serve`` in a subprocess on a free 127.0.0.1 port, so client and
  server do not share an interpreter.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kvlm.logs import get_logger

logger = get_logger(__name__)


class ServeBenchError(RuntimeError):
    """The server did not start, or a request failed."""


# --- the server -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(spec: str, *, options: list[str], log_path: Path | None = None, timeout: float = 600.0):
    """``kvlm serve spec`` on a free port; returns (process, url) once /health answers."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kvlm.cli", "serve", spec, "--port", str(port), *options]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServeBenchError(f"`{' '.join(cmd)}` exited with status {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise ServeBenchError(f"`{' '.join(cmd)}` did not answer /health within {timeout:.0f} s")
        time.sleep(0.25)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.log is not subprocess.DEVNULL:
        proc.log.close()


def server_metrics(url: str) -> dict[str, float]:
    """The unlabelled samples of GET /metrics, by name."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def model_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# --- the load ---------------------------------------------------------------------------------------------
def make_prompts(n: int, prompt_len: int, seed: int, vocab: int = 257) -> list[list[int]]:
    """Random token ids in [1, vocab): ids every served model has (the byte tokenizer's range by default)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(n, prompt_len)).tolist()


def summarize(ttft: list[float], itl: list[float], tokens: int, requests: int, wall_s: float) -> dict:
    def pct(xs, q):
        return float(np.percentile(xs, q)) * 1e3 if xs else None

    return {
        "requests": requests,
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "requests_per_s": requests / wall_s if wall_s > 0 else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "ttft_mean_ms": float(np.mean(ttft)) * 1e3 if ttft else None,
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "itl_mean_ms": float(np.mean(itl)) * 1e3 if itl else None,
    }


async def _one_request(http, model: str, prompt: list[int], output_len: int, ttft: list, itl: list) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    t0 = time.perf_counter()
    last, n = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise ServeBenchError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            k = len(chunk["choices"][0].get("token_ids") or [])
            if not k:
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - t0)
            else:
                itl.extend([(now - last) / k] * k)
            last = now
    return n


async def _load(url: str, concurrency: int, prompts: list, output_len: int, model: str | None = None,
                one=_one_request) -> dict:  # fmt: skip
    """The closed loop: ``concurrency`` clients sending ``one(http, model, prompt, ...)`` until prompts run out."""
    import httpx

    model = model or model_name(url)
    todo = list(enumerate(prompts))
    ttft, itl, done = [], [], []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client(http):
        while todo:
            _, prompt = todo.pop()
            done.append(await one(http, model, prompt, output_len, ttft, itl))

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarize(ttft, itl, sum(done), len(done), wall)


def warmup(url: str, *, prompt_len: int, output_len: int, clients: int = 2) -> None:
    """Untimed requests first: one-time costs (a kernel compiled on first use, allocator growth, lazy imports)
    would otherwise land in the first measurement."""
    asyncio.run(_load(url, clients, make_prompts(clients, prompt_len, seed=12345), output_len))


def run_load(url: str, concurrency: int, *, prompt_len: int, output_len: int, rounds: int = 2, seed: int = 0):
    """C closed-loop clients, ``rounds`` requests each; see the module docstring for the numbers."""
    prompts = make_prompts(concurrency * rounds, prompt_len, seed)
    before = server_metrics(url)
    result = asyncio.run(_load(url, concurrency, prompts, output_len))
    after = server_metrics(url)
    result["concurrency"] = concurrency
    result["preemptions"] = int(after.get("kvlm_num_preemptions", 0) - before.get("kvlm_num_preemptions", 0))
    return result


# --- capacity ---------------------------------------------------------------------------------------------
def capacity(url: str, context: int, *, demonstrate: bool = False, poll_s: float = 0.1):
    """Sequences of ``context`` tokens the pool holds (the engine's accounting); with ``demonstrate``, submit
    that many at once, each with prompt + output = ``context`` tokens (half and half, so that all are admitted
    long before the first finishes, and all grow to full length together), and record the peak of sequences
    running together, the peak of pages in use, and preemptions (0 when the accounting is right)."""
    m = server_metrics(url)
    pages, page = int(m["kvlm_cache_pages_total"]), int(m["kvlm_cache_page_size_tokens"])
    per_seq = math.ceil((context - 1) / page)  # the last generated token is never cached
    out = {
        "context": context,
        "bytes_per_token": m.get("kvlm_cache_bytes_per_token"),
        "pool_tokens": pages * page,
        "pages_total": pages,
        "sequences": pages // per_seq,
    }
    if demonstrate and out["sequences"] > 0:
        out["pages_needed"] = out["sequences"] * per_seq
        out.update(_demonstrate(url, out["sequences"], context, context // 2, poll_s))
    return out


def _demonstrate(url: str, n: int, context: int, max_tokens: int, poll_s: float) -> dict:
    import threading

    import httpx

    model = model_name(url)
    prompts = make_prompts(n, context - max_tokens, seed=1)  # prompt + output = context tokens
    peak = {"running": 0, "pages_used": 0}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            m = server_metrics(url)
            peak["running"] = max(peak["running"], int(m.get("kvlm_num_requests_running", 0)))
            peak["pages_used"] = max(peak["pages_used"], int(m.get("kvlm_cache_pages_used", 0)))
            time.sleep(poll_s)

    async def send():
        async with httpx.AsyncClient(base_url=url, timeout=None) as http:
            body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            rs = await asyncio.gather(
                *(http.post("/v1/completions", json={**body, "prompt": p}) for p in prompts)
            )
        bad = [r for r in rs if r.status_code != 200]
        if bad:
            raise ServeBenchError(f"capacity demonstration: HTTP {bad[0].status_code}: {bad[0].text[:300]}")

    before = server_metrics(url).get("kvlm_num_preemptions", 0)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        asyncio.run(send())
    finally:
        stop.set()
        watcher.join()
    return {
        "admitted_together": peak["running"],
        "peak_pages_used": peak["pages_used"],
        "preemptions": int(server_metrics(url).get("kvlm_num_preemptions", 0) - before),
    }


# --- report -----------------------------------------------------------------------------------------------
def _f(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    lines = []
    if result.get("load"):
        lines += ["| variant | engine | clients | tokens/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | preempted |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in result.get("load", []):
        if "error" in row:
            lines.append(f"| {row['variant']} | {row['engine']} | {row.get('concurrency', '-')} | "
                         f"{row['error'][:200]} | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {row['variant']} | {row['engine']} | {row['concurrency']} | {_f(row['tokens_per_s'])} | "
            f"{_f(row['requests_per_s'], 2)} | {_f(row['ttft_p50_ms'])} / {_f(row['ttft_p99_ms'])} | "
            f"{_f(row['itl_p50_ms'])} / {_f(row['itl_p99_ms'])} | {_f(row.get('preemptions'), 0)} |"
        )
    if result.get("capacity"):
        ctx = result["capacity"][0]["context"]
        lines += ["" if lines else None,
                  f"| variant | kv dtype | bytes / token | pool tokens | sequences of {ctx} tokens | admitted together "
                  "| pages needed / peak used | preemptions |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        for row in result["capacity"]:
            pages = f"{row['pages_needed']} / {row['peak_pages_used']}" if "pages_needed" in row else "-"
            lines.append(
                f"| {row['variant']} | {row['kv_dtype']} | {_f(row['bytes_per_token'], 0)} | {row['pool_tokens']} | "
                f"{row['sequences']} | {row.get('admitted_together', '-')} | {pages} | {row.get('preemptions', '-')} |"
            )
    return "\n".join(x for x in lines if x is not None) + "\n"


def env_note() -> dict:
    import torch

    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None}  # fmt: skip
