"""A compiled decode step against the eager one (issue 15, "a static decode step, optionally torch.compile'd"):
``torch.compile`` of ``model(tok, cache=cache)`` at the bench reference shape, the CPU kernels entering the graph
as the custom operator ``kvlm::decode_attention`` (kvlm.kernels.library), against the eager step as ``generate``
runs it (weights packed for MKL at batch 4-16; the compiled step runs those products as ``kvlm::packed_linear``). The cache length grows by one every step, as in decoding: the first calls compile (a static length, then
a dynamic one), and the timed rounds alternate eager and compiled steps.

    OMP_NUM_THREADS=2 python benchmarks/step_compiled.py            # ~6 min on 2 cores (compiling: 25-50 s a case)
    OMP_NUM_THREADS=2 python benchmarks/step_compiled.py --quick    # a toy shape: checks the script
    OMP_NUM_THREADS=2 python benchmarks/step_compiled.py --generate # generate(compile=True) against eager, ~3 min

Prints a markdown table: ms per step (medians over rounds), eager / compiled, compile seconds, the largest
difference of the logits.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvlm.bench.plan import parse_variant
from kvlm.inference.generation import packs_for
from kvlm.model import build_model

SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000, ffn_dim=2048)
QUICK = dict(n_layer=2, d_model=64, n_head=4, vocab_size=256, ffn_dim=128)
MLA = "mla:kv_lora_rank=256:rope_head_dim=32"
VARIANTS = ["mha", "gqa:n_kv_head=3", MLA]
VARIANTS_QUICK = ["mha", "gqa:n_kv_head=2", "mla:kv_lora_rank=32:rope_head_dim=8"]


def case(spec: str, batch: int, context: int, shape: dict, rounds: int) -> dict:
    _, cfg = parse_variant(spec, shape)
    cfg = cfg.replace(max_seq_len=context + 2 * rounds + 16)
    torch.manual_seed(0)
    model = build_model(cfg).eval().prepare_for_inference()
    mode = "absorbed" if spec.startswith("mla") else "auto"
    cache = model.new_cache(batch, context + 2 * rounds + 8)
    cache.fill_random_(context, cfg.vocab_size)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1))
    layout = packs_for(model, batch)
    if layout is not None:
        model.pack_for_decode(layout)  # as generate; the compiled step goes around it

    def eager(t):
        return model(t, cache=cache, mode=mode, last_only=True)

    torch._dynamo.reset()
    compiled = torch.compile(eager)
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i in range(3):  # a static length, then a dynamic one
            cache.length = context + i
            compiled(tok)
        compile_s = time.perf_counter() - t0
        cache.length = context
        ref = eager(tok)
        cache.length = context
        diff = (compiled(tok) - ref).abs().max().item()
        times: dict = {"eager": [], "compiled": []}
        for r in range(rounds):
            for name, fn in (("eager", eager), ("compiled", compiled)):
                cache.length = context + r
                t0 = time.perf_counter()
                fn(tok)
                times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {**ms, "compile_s": compile_s, "diff": diff}


def generate_case(spec: str, shape: dict, prompt_len: int, new: int, rounds: int) -> dict:
    """``generate`` with and without ``compile=True`` at batch 1 (a random prompt, greedy), alternated over
    ``rounds``: ms per decoded token (``decode_s / decode_tokens``: the steps that compiled left out)."""
    from kvlm import generate

    _, cfg = parse_variant(spec, shape)
    cfg = cfg.replace(max_seq_len=prompt_len + new)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    prompt = [torch.randint(0, cfg.vocab_size, (prompt_len,)).tolist()]
    mode = "absorbed" if spec.startswith("mla") else "auto"
    ms: dict = {"eager": [], "compiled": []}
    for _ in range(rounds):
        for name in ms:
            _, st = generate(model, prompt, new, return_stats=True, compile=name == "compiled", mode=mode)
            ms[name].append(st["decode_s"] / st["decode_tokens"] * 1e3)
    return {k: statistics.median(v) for k, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--generate", action="store_true", help="time generate(compile=True) against eager instead")
    args = ap.parse_args()
    shape, variants = (QUICK, VARIANTS_QUICK) if args.quick else (SHAPE, VARIANTS)
    if args.generate:
        prompt_len, new = (16, 12) if args.quick else (1024, 120)
        print(f"{torch.get_num_threads()} threads, generate at batch 1, {prompt_len}-token prompt, {new} new tokens\n")
        print("| variant | eager ms / token | compiled ms / token | eager / compiled |\n|---|---:|---:|---:|")
        for spec in variants:
            r = generate_case(spec, shape, prompt_len, new, 5)
            print(f"| {spec.split(':')[0]} | {r['eager']:.2f} | {r['compiled']:.2f} | {r['eager'] / r['compiled']:.2f} |")
        return
    sizes = [(1, 64), (8, 64)] if args.quick else [(1, 8192), (8, 4096)]
    print(f"{torch.get_num_threads()} threads\n")
    print(
        "| variant | batch | context | eager ms | compiled ms | eager / compiled | compile s | max logit diff |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context in sizes:
        for spec in variants:
            r = case(spec, batch, context, shape, args.rounds)
            print(
                f"| {spec.split(':')[0]} | {batch} | {context} | {r['eager']:.2f} | {r['compiled']:.2f} | "
                f"{r['eager'] / r['compiled']:.2f} | {r['compile_s']:.0f} | {r['diff']:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
