"""The decoder blocks in one kernel call against each block in one call and against the blocks module by module
(issue 15, "the rest of the step"): a decode step at the bench reference shape with the model's stack of blocks
(``KVLM.decode_stack``, ``kvlm.kernels.block_stack``), with each block's call on its own (``Block.one_call``:
``kvlm.kernels.gqa_block_call`` / ``mla_block_call``; the stack off) and with neither (``Block.kept_plan`` off),
interleaved in one process (the arms alternate, their order reversed every round), weights packed as ``generate``
packs them, the cache filled to the context and rolled back each step. (The plan kept against rebuilt every step
was measured by this script's version of 2026-11-28 18:11, benchmarks/decode-limit.md.)

    OMP_NUM_THREADS=2 python benchmarks/block_ab.py                      # ~2 min on 2 quiet cores
    OMP_NUM_THREADS=2 python benchmarks/block_ab.py --quick              # a toy shape: checks the script
    OMP_NUM_THREADS=2 python benchmarks/block_ab.py --tokens 4           # calls of 4 new tokens a sequence
    OMP_NUM_THREADS=2 python benchmarks/block_ab.py --batch 16           # 16 sequences, 1 and 4096 cached tokens

``--tokens T``: each call appends T new tokens a sequence (speculative verification) with the logits of all T, in
the cells of at most ``MAX_ROWS`` rows (batch x T) that the block kernels take (past ``FEW_ROWS`` only with no
weight in a library's packed layout: where ``generate`` packs one for the batch, the three arms run alike).

Prints per variant, batch and context the median ms of each arm, modules / blocks (>1: each block in one call is
faster than its modules) and blocks / stack (>1: all blocks in one call is faster than one call each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK  # this folder

from kvlm.bench.plan import parse_variant
from kvlm.inference.generation import packs_for
from kvlm.kernels.few_rows import MAX_ROWS
from kvlm.model import KVLM, Block, build_model

CELLS = ((1, 1), (8, 1), (1, 8192), (8, 4096))  # (batch, cached tokens)
CELLS_QUICK = ((1, 1), (4, 40))


def ab(spec: str, batch: int, ctx: int, shape: dict, rounds: int, T: int = 1) -> tuple[float, float, float]:
    _, cfg = parse_variant(spec, shape)
    cfg = cfg.replace(max_seq_len=ctx + 8)
    torch.manual_seed(0)
    model = build_model(cfg).eval().prepare_for_inference()
    layout = packs_for(model, batch * T)
    if layout is not None:
        model.pack_for_decode(layout)
    cache = model.new_cache(batch, ctx + 8)
    cache.fill_random_(ctx, cfg.vocab_size)
    tok = torch.randint(0, cfg.vocab_size, (batch, T))
    mode = "absorbed" if spec.startswith("mla") else "auto"
    kept_plan, decode_stack = Block.kept_plan, KVLM.decode_stack
    off = lambda *args: None  # noqa: E731
    arms = {"modules": (off, off), "blocks": (kept_plan, off), "stack": (kept_plan, decode_stack)}
    times: dict[str, list[float]] = {k: [] for k in arms}
    try:
        with torch.inference_mode():
            for r in range(rounds + 1):
                for name in list(arms) if r % 2 else list(arms)[::-1]:
                    Block.kept_plan, KVLM.decode_stack = arms[name]
                    cache.length = ctx
                    t0 = time.perf_counter()
                    model(tok, cache=cache, mode=mode, last_only=T == 1)
                    if r:  # the first round warms both arms up
                        times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        Block.kept_plan, KVLM.decode_stack = kept_plan, decode_stack
    return tuple(statistics.median(times[k]) for k in arms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--tokens", type=int, default=1, help="new tokens a sequence per call (default 1)")
    ap.add_argument("--batch", type=int, help="this many sequences at 1 and 4096 cached tokens instead of the cells")
    args = ap.parse_args()
    shape, variants, cells = (QUICK, VARIANTS_QUICK, CELLS_QUICK) if args.quick else (SHAPE, VARIANTS, CELLS)
    if args.batch:
        cells = [(args.batch, c) for c in ((1, 40) if args.quick else (1, 4096))]
    cells = [(b, c) for b, c in cells if b * args.tokens <= MAX_ROWS]
    print(
        f"{torch.get_num_threads()} threads, ms per call of {args.tokens} new token(s) a sequence, medians of "
        f"{args.rounds} interleaved rounds\n"
    )
    print("| variant | batch | cached tokens | modules | blocks | stack | modules / blocks | blocks / stack |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in variants:
        for batch, ctx in cells:
            mod, blocks, stack = ab(spec, batch, ctx, shape, args.rounds, args.tokens)
            print(
                f"| {spec} | {batch} | {ctx} | {mod:.2f} | {blocks:.2f} | {stack:.2f} | {mod / blocks:.3f} | "
                f"{blocks / stack:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
