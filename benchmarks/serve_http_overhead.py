"""Where the time of `kvlm serve` goes under streaming load: CPU seconds per generated token of the engine thread,
the event loop thread and the client, with the real engine or with a model-free stand-in (--fake-step S: each
step sleeps S seconds, as a forward that releases the GIL, and gives every running request one token), so the
HTTP/SSE path's own cost is measured without the model's noise.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_http_overhead.py --fake-step 0.03 --rounds 4 --output-len 32
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/serve_http_overhead.py            # the 2-layer MLA toy model

The server runs in a subprocess (this file with --serve), the client here (the same closed loop of streaming
requests as `kvlm bench-serve`); SIGUSR1 makes the server append its counters to a file before and after the
timed round. Thread CPU comes from /proc (Linux only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

SPEC = "bench/mla:max_seq_len=4096:n_layer=2:d_model=256:n_head=4:vocab_size=4096"


# --- the server side ---------------------------------------------------------------------------------------
def serve(argv: list[str], stats_path: str, fake_step: float) -> int:
    from kvlm.serve import engine as engine_mod

    counters = {"steps": 0, "step_wall_s": 0.0, "step_cpu_s": 0.0}

    def timed(step):
        def wrapper(self):
            t, c = time.perf_counter(), time.thread_time()
            out = step(self)
            counters["step_wall_s"] += time.perf_counter() - t
            counters["step_cpu_s"] += time.thread_time() - c
            counters["steps"] += 1
            return out

        return wrapper

    if fake_step > 0:
        from kvlm.serve.request import RequestOutput

        class FakeEngine:  # the Engine's public surface, no model
            def __init__(self, model, tokenizer=None, **_):
                self.reqs, self.aborted = {}, []
                self.max_model_len, self.vocab_size = model.cfg.max_seq_len, model.cfg.vocab_size

            def add_request(self, prompt, params, request_id=None):
                self.reqs[request_id] = [params.max_tokens, len(prompt), 0]
                return request_id

            def abort(self, rid):
                st = self.reqs.pop(rid, None)
                if st:
                    self.aborted.append(RequestOutput(rid, [], "", None, None, True, "abort", st[1], st[2]))

            def has_unfinished(self):
                return bool(self.reqs or self.aborted)

            def step(self):
                time.sleep(fake_step)
                outs, self.aborted = self.aborted, []
                for rid, st in list(self.reqs.items()):
                    st[2] += 1
                    fin = st[2] >= st[0]
                    outs.append(
                        RequestOutput(
                            rid, [65], "A", None, None, fin, "length" if fin else None, st[1], st[2]
                        )
                    )
                    if fin:
                        del self.reqs[rid]
                return outs

            def stats(self):
                return {"running": len(self.reqs), "waiting": 0}

        engine_mod.Engine = FakeEngine
    engine_mod.Engine.step = timed(engine_mod.Engine.step)

    def dump(*_):
        tick, names, threads = (
            os.sysconf("SC_CLK_TCK"),
            {t.native_id: t.name for t in threading.enumerate()},
            {},
        )
        for tid in os.listdir("/proc/self/task"):
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            threads[names.get(int(tid), tid)] = (int(fields[11]) + int(fields[12])) / tick
        with open(stats_path, "a") as f:
            f.write(json.dumps({**counters, "threads": threads}) + "\n")

    signal.signal(signal.SIGUSR1, dump)
    from kvlm.cli import main

    return main(argv)


# --- the client side ------------------------------------------------------------------------------------------
async def _one(http, prompt, output_len, ttft, itl):
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}  # fmt: skip
    t0, last, n = time.perf_counter(), None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:])["choices"]:
                k = len(c.get("token_ids") or [])
                if k:
                    now = time.perf_counter()
                    ttft.append(now - t0) if last is None else itl.extend([(now - last) / k] * k)
                    last, n = now, n + k
    return n


async def _load(url, concurrency, prompts, output_len):
    import httpx

    todo, ttft, itl, done = list(prompts), [], [], []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async def client(http):
        while todo:
            done.append(await _one(http, todo.pop(), output_len, ttft, itl))

    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return sum(done), time.perf_counter() - t0, ttft, itl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=SPEC)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument(
        "--fake-step", type=float, default=0.0, help="seconds per model-free step (0: the real engine)"
    )
    p.add_argument("--prefill-chunk", type=int, default=256)
    args = p.parse_args()
    import httpx
    import numpy as np

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stats = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    cmd = [sys.executable, __file__, "--serve", stats, str(args.fake_step), "serve", args.spec, "--port", str(port),
           "--model-name", "m", "--cache-bytes", "256MiB", "--threads", "1", "--device", "cpu", "--no-access-log",
           "--prefill-chunk", str(args.prefill_chunk)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        rng = np.random.default_rng(0)
        asyncio.run(
            _load(url, 2, rng.integers(1, 257, (2, args.prompt_len)).tolist(), args.output_len)
        )  # warm-up
        prompts = rng.integers(1, 257, (args.concurrency * args.rounds, args.prompt_len)).tolist()
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        tokens, wall, ttft, itl = asyncio.run(_load(url, args.concurrency, prompts, args.output_len))
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        a, b = [json.loads(line) for line in open(stats)][-2:]
    finally:
        proc.terminate()
        proc.wait(60)
        os.unlink(stats)
    per_tok = lambda s: f"{s / tokens * 1e3:.3f} ms"  # noqa: E731
    th = {k: b["threads"][k] - a["threads"].get(k, 0) for k in b["threads"]}
    steps = b["steps"] - a["steps"]
    print(f"{tokens} tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s, {steps} steps; TTFT p50 "
          f"{np.percentile(ttft, 50) * 1e3:.1f} ms, ITL p50 {np.percentile(itl, 50) * 1e3:.1f} ms")  # fmt: skip
    print(f"CPU per token: event loop {per_tok(th.get('MainThread', 0))}, engine thread "
          f"{per_tok(th.get('kvlm-engine', 0))} (of which inside step() {per_tok(b['step_cpu_s'] - a['step_cpu_s'])}), "
          f"client {per_tok(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)}")  # fmt: skip
    if not args.fake_step:  # how much longer a step takes than its own CPU: waiting for the GIL or for a core
        ratio = (b["step_wall_s"] - a["step_wall_s"]) / max(b["step_cpu_s"] - a["step_cpu_s"], 1e-9)
        print(f"step wall / step CPU: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        sys.exit(serve(sys.argv[4:], sys.argv[2], float(sys.argv[3])))
    sys.exit(main())
