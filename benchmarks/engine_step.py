"""In-process throughput of the serving engine (no HTTP, no client): the closed loop of ``kvlm bench-serve``.

    python benchmarks/engine_step.py                                   # mha, 8 requests in flight, 2 layers d=256
    python benchmarks/engine_step.py --variants mha,gqa,mla --concurrency 8,32 --profile   # + cProfile top 25

C requests are kept in flight (a finished one is replaced by the next, as C closed-loop clients do) until
``--requests`` have run; prompts of ``--prompt-len`` random ids, ``--output-len`` greedy tokens (ignore_eos).
Reports generated tokens/s over the wall time and the mean time to first token in engine steps' wall time.
"""

import argparse
import cProfile
import json
import pstats
import time

import torch

from kvlm import ModelConfig, build_model
from kvlm.serve import Engine, SamplingParams


def run(variant, concurrency, n_requests, prompt_len, output_len, shape, seed=0):
    torch.manual_seed(seed)
    extra = {"n_kv_head": 1} if variant == "gqa" else {}
    model = build_model(ModelConfig(attention=variant, **shape, **extra)).eval()
    engine = Engine(model, cache_tokens=max(8192, concurrency * (prompt_len + output_len) * 2))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(0, shape["vocab_size"], (prompt_len,), generator=g).tolist() for _ in range(n_requests)
    ]
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    sent, tokens, ttft, started = 0, 0, [], {}
    t0 = time.perf_counter()
    while sent < n_requests or engine.has_unfinished():
        while sent < n_requests and len(started) < concurrency:
            started[engine.add_request(prompts[sent], params)] = (time.perf_counter(), False)
            sent += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
            t_start, seen = started[out.request_id]
            if out.new_token_ids and not seen:
                ttft.append(time.perf_counter() - t_start)
                started[out.request_id] = (t_start, True)
            if out.finished:
                del started[out.request_id]
    wall = time.perf_counter() - t0
    return {"variant": variant, "concurrency": concurrency, "requests": n_requests, "tokens": tokens,
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
            "ttft_ms_mean": round(1000 * sum(ttft) / len(ttft), 1)}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="mha")
    ap.add_argument("--concurrency", default="8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    shape = dict(
        n_layer=a.n_layer, d_model=a.d_model, n_head=a.n_head, vocab_size=a.vocab_size, max_seq_len=512
    )
    for v in a.variants.split(","):
        for c in (int(x) for x in a.concurrency.split(",")):
            prof = cProfile.Profile() if a.profile else None
            if prof:
                prof.enable()
            r = run(v, c, a.requests, a.prompt_len, a.output_len, shape)
            if prof:
                prof.disable()
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
