"""The decoder block in one kernel call against the same block module by module (issue 15, "the rest of the
step"): a decode step at the bench reference shape with ``kvlm.kernels.gqa_block_call`` / ``mla_block_call`` on and off,
and on with its plan (the block's weights gathered and checked, ``Block.one_call_plan``) built again every step
instead of kept (``kvlm.attention.watch.Bound``), interleaved in one process (the arms alternate, their order
reversed every round), weights packed as ``generate`` packs them, the cache filled to the context and rolled back
each step.

    OMP_NUM_THREADS=2 python benchmarks/block_ab.py                      # ~2 min on 2 quiet cores
    OMP_NUM_THREADS=2 python benchmarks/block_ab.py --quick              # a toy shape: checks the script

Prints per variant, batch and context the median ms of each arm, module-by-module / one-call (>1: the block
kernel is faster) and rebuilt / kept (>1: keeping the plan is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK  # this folder

from kvlm.bench.plan import parse_variant
from kvlm.inference.generation import packs_for
from kvlm.model import Block, build_model

CELLS = ((1, 1), (8, 1), (1, 8192), (8, 4096))  # (batch, cached tokens)
CELLS_QUICK = ((1, 1), (4, 40))


def _rebuilt(self, x, step, cache):
    """``Block.one_call`` with its plan built again at every step (what each step paid before plans were kept)."""
    if self.training or step.n_new != 1 or torch.is_grad_enabled():
        return None
    plan = self.one_call_plan()
    return None if plan is None else plan(x, step, cache)


def ab(spec: str, batch: int, ctx: int, shape: dict, rounds: int) -> tuple[float, float, float]:
    _, cfg = parse_variant(spec, shape)
    cfg = cfg.replace(max_seq_len=ctx + 8)
    torch.manual_seed(0)
    model = build_model(cfg).eval().prepare_for_inference()
    layout = packs_for(model, batch)
    if layout is not None:
        model.pack_for_decode(layout)
    cache = model.new_cache(batch, ctx + 8)
    cache.fill_random_(ctx, cfg.vocab_size)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1))
    mode = "absorbed" if spec.startswith("mla") else "auto"
    one_call = Block.one_call
    arms = {"modules": lambda self, x, step, cache: None, "rebuilt": _rebuilt, "one call": one_call}
    times: dict[str, list[float]] = {k: [] for k in arms}
    try:
        with torch.inference_mode():
            for r in range(rounds + 1):
                for name in list(arms) if r % 2 else list(arms)[::-1]:
                    Block.one_call = arms[name]
                    cache.length = ctx
                    t0 = time.perf_counter()
                    model(tok, cache=cache, mode=mode, last_only=True)
                    if r:  # the first round warms both arms up
                        times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        Block.one_call = one_call
    return tuple(statistics.median(times[k]) for k in arms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    shape, variants, cells = (QUICK, VARIANTS_QUICK, CELLS_QUICK) if args.quick else (SHAPE, VARIANTS, CELLS)
    print(
        f"{torch.get_num_threads()} threads, ms per decode step, medians of {args.rounds} interleaved rounds\n"
    )
    print("| variant | batch | cached tokens | modules | one call, plan rebuilt | one call | modules / one call | rebuilt / kept |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in variants:
        for batch, ctx in cells:
            mod, rebuilt, one = ab(spec, batch, ctx, shape, args.rounds)
            print(
                f"| {spec} | {batch} | {ctx} | {mod:.2f} | {rebuilt:.2f} | {one:.2f} | {mod / one:.3f} | {rebuilt / one:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
