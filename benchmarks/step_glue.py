"""What a decode step spends besides its weight products (issue 15, "the rest of the step"): the step at 1 cached
token at the bench reference shape against the same step's weight products alone (the extension's few-row and
panel calls recorded in one step, then replayed with the same arguments), interleaved in one process with a
bandwidth probe (kvlm.bench.hardware.Probe) each round.

    OMP_NUM_THREADS=2 python benchmarks/step_glue.py            # ~1 min on 2 quiet cores
    OMP_NUM_THREADS=2 python benchmarks/step_glue.py --quick    # a toy shape: checks the script

Per variant (MHA, GQA-3, absorbed MLA) and batch (1, 8; weights packed as ``generate`` packs them), medians over
rounds: ``step`` ms (as ``generate`` runs it: the decoder blocks in one kernel call where they can); ``products`` ms, the recorded calls alone, and the GB/s of weights they read; ``probe`` GB/s
and the weights' floor (weight bytes / probe); ``rest`` = step - products: norms, RoPE, the cache write, attention
over one key, MLA's absorption products, the torch operators and Python between them. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK, one_token_step  # this folder

from kvlm.bench.hardware import Probe
from kvlm.kernels import cpu
from kvlm.model import Block

PRODUCTS = ("few_rows_linear", "panel_linear")  # the extension's weight products


def recorded_products(step) -> tuple[list, int]:
    """The extension's weight-product calls of one ``step()`` as (function, args), and the weight bytes they read
    (every tensor argument but the rows of x and the biases: the first argument is x). The step is recorded with
    the decoder blocks run module by module (``Block.kept_plan`` declining): the blocks' kernel call does the same
    products inside C++, where they cannot be recorded apart."""
    ext = cpu.extension()
    names = [n for n in PRODUCTS if ext is not None and hasattr(ext, n)]
    saved = {n: getattr(ext, n) for n in names}
    calls: list = []

    def recording(f):
        def call(*args):
            calls.append((f, args))
            return f(*args)

        return call

    for n in names:
        setattr(ext, n, recording(saved[n]))
    kept_plan = Block.kept_plan
    Block.kept_plan = lambda self: None
    try:
        step()
    finally:
        Block.kept_plan = kept_plan
        for n in names:
            setattr(ext, n, saved[n])

    def weights(arg) -> list:
        if isinstance(arg, torch.Tensor):
            return [arg] if arg.dim() >= 2 else []
        if isinstance(arg, (list, tuple)):
            return [w for a in arg for w in weights(a)]
        return []

    nbytes = sum(w.numel() * w.element_size() for _, args in calls for a in args[1:] for w in weights(a))
    return calls, nbytes


def one(spec: str, batch: int, shape: dict, probe: Probe, rounds: int) -> dict:
    step = one_token_step(spec, batch, shape)

    with torch.inference_mode():
        calls, nbytes = recorded_products(step)
        if not calls:
            raise SystemExit("the C++ extension did not run: no weight products to replay (KVLM_KERNELS=0?)")

        def products():
            for f, args in calls:
                f(*args)

        times: dict = {"step": [], "products": [], "probe": []}
        for _ in range(2):
            step(), products()
        for _ in range(rounds):
            times["probe"].append(probe.read_gbs())
            for k, f in (("step", step), ("products", products)):
                t0 = time.perf_counter()
                f()
                times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {**med, "bytes": nbytes, "calls": len(calls)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    shape, variants = (QUICK, VARIANTS_QUICK) if args.quick else (SHAPE, VARIANTS)
    probe = Probe(torch.device("cpu"), mib=8 if args.quick else 256)
    print(f"{torch.get_num_threads()} threads, 1 cached token, ms per step, medians of {args.rounds} rounds\n")
    print("| variant | batch | calls | weights MB | step | products | products GB/s | probe GB/s | floor | rest |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for spec in variants:
        for batch in (1, 8):
            r = one(spec, batch, shape, probe, 3 if args.quick else args.rounds)
            gb = r["bytes"] / 1e9
            print(
                f"| {spec.split(':')[0]} | {batch} | {r['calls']} | {r['bytes'] / 1e6:.0f} | {r['step']:.2f} | "
                f"{r['products']:.2f} | {gb / (r['products'] / 1e3):.1f} | {r['probe']:.1f} | "
                f"{gb / r['probe'] * 1e3:.2f} | {r['step'] - r['products']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
