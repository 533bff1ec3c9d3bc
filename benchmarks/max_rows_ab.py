"""Decode steps past 16 rows on the few-row kernel or on oneDNN's copy (issue 15; benchmarks/decode-limit.md,
"AVX2: the kernel to 64 rows"): the bench reference shape, the two arms alternating round by round in one process,
each round the median of ``--steps`` steps; prints the medians and old / new, the median of the rounds' ratios.

- old: ``MAX_ROWS`` 16 (as before 2026-11-30 on every CPU), the weights in oneDNN's layout for any rows (``ANY_ROWS``:
  what ``generate``'s measurement and the serving engine chose past 16 rows);
- new: ``MAX_ROWS`` ``--max-rows`` (the package's: 64 on AVX2), the weights packed ``PAST_KERNEL`` (the serving
  engine where the kernel leads) or, with ``--unpacked``, not at all (``generate`` at 17-32 rows on AVX2).

    OMP_NUM_THREADS=2 python benchmarks/max_rows_ab.py --batch 24 32                          # serve-shaped steps
    OMP_NUM_THREADS=2 python benchmarks/max_rows_ab.py --batch 8 --tokens 4 --context 4096 --unpacked   # T = 4
    OMP_NUM_THREADS=2 python benchmarks/max_rows_ab.py --clients 24 --variants gqa:n_kv_head=3     # the engine

With ``--clients N`` the serving engine in-process instead (``kvlm.bench.serve_inprocess.engine_load``: N clients,
prompts of ``--prompt-len`` tokens (64), ``--output-len`` generated (48), 2 rounds, 1 GiB cache), which packs
``PAST_KERNEL`` in both arms where the kernel leads at MAX_ROWS rows (``kernel_leads``): tokens/s and the
inter-token latency's median, ``--rounds`` runs an arm.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_overhead import SHAPE, VARIANTS, short_step  # this folder

import kvlm.attention.linear as linear
import kvlm.kernels.few_rows as few_rows
from kvlm.attention.linear import ANY_ROWS, PAST_KERNEL


def one(spec: str, batch: int, tokens: int, context: int, args) -> str:
    _, model, mode, cache, _ = short_step(spec, batch, SHAPE, context)
    new_tokens = torch.randint(0, model.cfg.vocab_size, (batch, tokens))

    def arm(name: str) -> None:  # linear.py holds MAX_ROWS by name: both set
        few_rows.MAX_ROWS = linear.MAX_ROWS = 16 if name == "old" else args.max_rows
        model.pack_for_decode(ANY_ROWS if name == "old" else None if args.unpacked else PAST_KERNEL)

    def step() -> torch.Tensor:
        cache.length = context  # every step sees the same cache
        with torch.inference_mode():
            return model(new_tokens, cache=cache, mode=mode, last_only=True)

    times: dict[str, list[float]] = {"old": [], "new": []}
    logits = {}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            arm(name)
            logits[name] = step()  # also the warm-up after repacking
            ts = []
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t)
            times[name].append(statistics.median(ts))
    old, new = (statistics.median(times[k]) * 1e3 for k in ("old", "new"))
    ratio = statistics.median(a / b for a, b in zip(times["old"], times["new"]))
    diff = (logits["old"] - logits["new"]).abs().max().item()
    return f"| {spec} | {batch} x {tokens} | {context} | {old:.1f} | {new:.1f} | **{ratio:.3f}** | {diff:.1e} |"


def clients(spec: str, n: int, args) -> str:
    from kvlm import build_model
    from kvlm.bench.plan import parse_variant
    from kvlm.bench.serve_inprocess import engine_load

    _, cfg = parse_variant(spec, SHAPE)
    torch.manual_seed(0)
    model = build_model(cfg.replace(max_seq_len=256)).eval().prepare_for_inference()
    runs: dict[int, list[dict]] = {16: [], args.max_rows: []}
    for r in range(args.rounds):
        for most in (16, args.max_rows) if r % 2 == 0 else (args.max_rows, 16):
            few_rows.MAX_ROWS = linear.MAX_ROWS = most  # the engine's race (kernel_leads) runs at these rows
            runs[most].append(engine_load(model, n, prompt_len=args.prompt_len, output_len=args.output_len, rounds=2,
                                          cache_bytes=1 << 30))

    def cell(most: int, key: str) -> str:
        return " / ".join(f"{run[key]:.0f}" for run in runs[most])

    tps = [statistics.median(run["tokens_per_s"] for run in runs[m]) for m in (16, args.max_rows)]
    return (f"| {spec} | {n} | {cell(16, 'tokens_per_s')} | {cell(args.max_rows, 'tokens_per_s')} | "
            f"**{tps[1] / tps[0]:.2f}** | {cell(16, 'itl_p50_ms')} | {cell(args.max_rows, 'itl_p50_ms')} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[24, 32])
    ap.add_argument("--tokens", type=int, default=1, help="new tokens a sequence (rows = batch x tokens)")
    ap.add_argument("--context", type=int, default=32, help="cached tokens")
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    ap.add_argument("--max-rows", type=int, default=few_rows.MAX_ROWS, help="the new arm's MAX_ROWS")
    ap.add_argument("--unpacked", action="store_true", help="the new arm without a packed copy (generate's)")
    ap.add_argument("--clients", type=int, help="the serving engine with this many clients instead of steps")
    ap.add_argument("--prompt-len", type=int, default=64, help="with --clients: prompt tokens a request")
    ap.add_argument("--output-len", type=int, default=48, help="with --clients: tokens generated a request")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if args.clients:
        print(f"| variant | clients | tokens/s, MAX_ROWS 16 | tokens/s, {args.max_rows} | medians | ITL p50 ms, 16 | "
              f"ITL p50 ms, {args.max_rows} |\n|---|---:|---|---|---:|---|---|")  # fmt: skip
        for spec in args.variants:
            print(clients(spec, args.clients, args), flush=True)
        return
    print(f"{torch.get_num_threads()} threads; old: MAX_ROWS 16 + ANY_ROWS, new: MAX_ROWS {args.max_rows} + "
          f"{'no copy' if args.unpacked else 'PAST_KERNEL'}; ms per step, medians of {args.rounds} rounds\n")  # fmt: skip
    print("| variant | rows | cached | old ms | new ms | old / new | logits max diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for spec in args.variants:
        for batch in args.batch:
            print(one(spec, batch, args.tokens, args.context, args), flush=True)


if __name__ == "__main__":
    main()
