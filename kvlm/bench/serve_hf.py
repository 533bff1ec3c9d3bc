"""`transformers serve --continuous-batching` on an exported folder, measured over HTTP like `kvlm serve`.

- ``export_folder(model, folder)``: the transformers folder of ``model`` (``kvlm.bench.peers``: the weights and
  config of ``kvlm export-hf --format llama | deepseek-v3``), with the byte-level tokenizer of the bench models
  and no EOS token, so that every request generates its ``max_tokens`` (transformers serve has no ``ignore_eos``).
- ``start_hf_server(folder, ...)``: ``transformers serve FOLDER --continuous-batching`` in a subprocess on a free
  127.0.0.1 port, offline (``HF_HUB_OFFLINE=1``), with a paged cache of the given bytes.
- ``hf_run_load(url, model_id, C, ...)``: ``kvlm.bench.serve``'s closed loop of C streaming clients. What differs,
  because transformers serve takes only text prompts and streams only text: prompts are ``prompt_len`` random
  lowercase letters (one token each in the byte-level tokenizer; the server's usage count is checked), the
  generated tokens are counted from the final usage, the time to first token is to the first text chunk, and
  inter-token gaps are kept only for requests whose every token came in its own chunk (``itl_requests`` of
  them; a byte that does not complete a character streams nothing).

transformers serve cannot run MLA (DeepseekV3) with continuous batching: the stock export fails in the paged
cache (``index_copy_(): Source/destination tensor must have same slice shapes``: per-head keys of d_h + d_h^R
dims into slots of ``config.head_dim`` = d_h^R), and the padded peer of ``kvlm.bench.peers`` cannot be saved as
a folder: its ``head_dim = d_h + d_h^R`` is read back by DeepseekV3's rotary embedding as the RoPE width, and the
first forward fails in RoPE (``The size of tensor a (d_h^R/2) must match the size of tensor b (...)``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kvlm.bench.serve import ServeBenchError, _load, free_port, make_prompts
from kvlm.logs import get_logger

logger = get_logger(__name__)


def export_folder(model, folder: str | Path, paged: bool = False) -> Path:
    """``model``'s transformers peer saved to ``folder`` (created; must not exist), with the byte tokenizer."""
    from kvlm.bench.peers import build_peer
    from kvlm.interop.hf import hf_tokenizer
    from kvlm.serve.launch import byte_tokenizer

    folder = Path(folder)
    if folder.exists():
        raise ServeBenchError(f"{folder} exists: export_folder writes a new folder")
    hf = build_peer(model, paged=paged).model
    for cfg in (hf.config, hf.generation_config):  # no EOS: requests run to max_tokens, as ignore_eos does
        cfg.eos_token_id = None
    hf.save_pretrained(folder)
    tok = hf_tokenizer(byte_tokenizer(), model_max_length=model.cfg.max_seq_len)
    # the ids past the bytes get a text each, "<t300>", so that the streamed text shows every token (the bench
    # models' random weights draw from the whole vocabulary; an id the tokenizer lacks stops its text stream)
    tok.add_tokens([f"<t{i}>" for i in range(len(tok), model.cfg.vocab_size)])
    tok.save_pretrained(folder)
    return folder


def start_hf_server(folder: str | Path, *, cache_bytes: int, page_size: int, max_batch_tokens: int,
                    element_size: int = 4, threads: int | None = None, device: str = "cpu",
                    log_path: Path | None = None, timeout: float = 600.0):  # fmt: skip
    """``transformers serve folder --continuous-batching`` on a free 127.0.0.1 port, a pool of ``cache_bytes``
    in its own sizing; (process, url, model id) once /health answers (stop it with kvlm.bench.serve.stop_server).
    Its continuous-batching manager starts with the first request: ``hf_warmup`` before measuring."""
    import httpx
    from transformers import AutoConfig

    from kvlm.bench.serve_inprocess import peer_cache_blocks

    config = AutoConfig.from_pretrained(folder)
    blocks = peer_cache_blocks(config, cache_bytes, page_size, element_size)
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe), "serve", str(folder), "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
           "--device", device, "--cb-block-size", str(page_size), "--cb-num-blocks", str(blocks),
           "--cb-max-batch-tokens", str(max_batch_tokens), "--log-level", "warning"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log
    url, model_id = f"http://127.0.0.1:{port}", str(folder)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServeBenchError(f"`{' '.join(cmd)}` exited with status {proc.returncode} (log: {log_path})")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url, model_id
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise ServeBenchError(f"`{' '.join(cmd)}` did not answer /health within {timeout:.0f} s")
        time.sleep(0.25)


def text_prompts(n: int, prompt_len: int, seed: int) -> list[str]:
    """``prompt_len`` random lowercase letters: one token each in the byte-level tokenizer."""
    return ["".join(chr(96 + t) for t in row) for row in make_prompts(n, prompt_len, seed, vocab=27)]


def _text_request(prompt_len: int, exact: list):
    async def one(http, model: str, prompt: str, output_len: int, ttft: list, itl: list) -> int:
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        times, usage = [], None
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise ServeBenchError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ServeBenchError(f"transformers serve: {str(chunk['error'])[:300]}")
                usage = chunk.get("usage") or usage
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
        if usage is None:
            raise ServeBenchError("transformers serve ended a stream without a usage count")
        if usage["prompt_tokens"] != prompt_len:
            raise ServeBenchError(f"a prompt of {prompt_len} letters became {usage['prompt_tokens']} tokens")
        n = usage["completion_tokens"]
        if times:
            ttft.append(times[0] - t0)
            if len(times) == n:  # one chunk per token: the gaps are inter-token latencies
                itl.extend(b - a for a, b in zip(times, times[1:]))
                exact.append(1)
        return n

    return one


def hf_run_load(url: str, model_id: str, concurrency: int, *, prompt_len: int, output_len: int, rounds: int = 2,
                seed: int = 0) -> dict:  # fmt: skip
    """C closed-loop streaming clients against transformers serve (see the module docstring)."""
    prompts = text_prompts(concurrency * rounds, prompt_len, seed)
    exact = []
    row = asyncio.run(
        _load(url, concurrency, prompts, output_len, model_id, _text_request(prompt_len, exact))
    )
    row.update(concurrency=concurrency, itl_requests=len(exact))  # requests whose gaps are in the ITL columns
    return row


def hf_warmup(url: str, model_id: str, *, prompt_len: int, output_len: int) -> None:
    prompts = text_prompts(2, prompt_len, seed=12345)
    asyncio.run(_load(url, 2, prompts, output_len, model_id, _text_request(prompt_len, [])))
