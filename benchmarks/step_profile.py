"""Where a decode step's time goes between operators (issue 15, "the rest of the step"): the step at 1 cached
token at the bench reference shape, timed on the clock (median of plain runs) and under ``torch.profiler``
(self CPU time of every operator). The difference is the time outside any operator: Python, module calls and
dispatch, which a static or compiled step would remove.

    OMP_NUM_THREADS=2 python benchmarks/step_profile.py            # ~1 min
    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --modules  # the blocks module by module (per operator)
    OMP_NUM_THREADS=2 python benchmarks/step_profile.py --quick    # a toy shape: checks the script

Per variant (MHA, GQA-3, absorbed MLA) and batch (1, 8; weights packed at 8 as ``generate`` packs them), ms per
step: ``clock`` (the lower of two medians of 10 plain steps, before and after profiling), ``in operators``
(profiler, 10 steps, per step; kvlm's C++ kernels recorded as ``kvlm::`` events), of which ``GEMMs`` (mm, addmm,
bmm, the libraries' packed products, kvlm's few-row kernel), and ``outside`` = clock
- in operators. The profiler adds a little to each operator, and the clock is the quieter of two moments, so
``outside`` is if anything an underestimate. Prints a markdown table.

As the step runs, its decoder blocks are one kernel call (``KVLM.decode_stack``, recorded as
``kvlm::block_stack``; ``kvlm::gqa_block`` / ``kvlm::mla_block`` where each block is its own call): their
products are inside that event, so ``GEMMs`` counts only the LM head's. ``--modules`` switches the block plans
off (``Block.kept_plan``), for the step operator by operator as it ran before the blocks.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK, one_token_step  # this folder
from torch.profiler import ProfilerActivity, profile, record_function

import kvlm.decode_plans as decode_plans
from kvlm.kernels import cpu
from kvlm.model import Block

GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "mkl::_mkl_linear", "mkldnn::_linear_pointwise",
         "kvlm::few_rows_linear"}  # fmt: skip
# the extension's calls: no dispatcher operators
KERNELS = ("few_rows_linear", "panel_linear", "head_products", "rms_norm", "decode_attention", "gqa_block", "mla_block")


class _RecordedStack:
    """A model's ``BlockStack`` whose ``run`` is recorded as the profiler event ``kvlm::block_stack``."""

    def __init__(self, stack):
        self.stack = stack

    def run(self, *args):
        with record_function("kvlm::block_stack"):
            return self.stack.run(*args)


@contextlib.contextmanager
def kernels_recorded():
    """The C++ extension's functions (kvlm.kernels.cpu) recorded as profiler events ``kvlm::NAME``: called through
    pybind, not the dispatcher, the profiler would count them as time outside any operator."""
    ext = cpu.extension()
    saved = {k: getattr(ext, k) for k in KERNELS if ext is not None and hasattr(ext, k)}

    def wrap(name, f):
        def call(*args):
            with record_function(f"kvlm::{name}"):
                return f(*args)

        return call

    for k, f in saved.items():
        setattr(ext, k, wrap(k, f))
    stacks = [kept[1] for kept in decode_plans._STACKS.values() if kept[1] is not None]  # built by the warm-up
    for s in stacks:
        s.stack = _RecordedStack(s.stack)
    try:
        yield
    finally:
        for k, f in saved.items():
            setattr(ext, k, f)
        for s in stacks:
            s.stack = s.stack.stack


def profile_step(spec: str, batch: int, shape: dict) -> dict:
    step = one_token_step(spec, batch, shape)

    with torch.inference_mode():
        for _ in range(5):
            step()

        def clock_ms() -> float:
            times = []
            for _ in range(10):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            return statistics.median(times) * 1e3

        before = clock_ms()
        n = 10
        with kernels_recorded(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                step()
        clock = min(
            before, clock_ms()
        )  # the quieter of the medians before and after: a busy moment is not counted
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / n
    gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMMS) / 1e3 / n
    return {"clock": clock, "ops": total, "gemm": gemm, "outside": clock - total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--modules", action="store_true", help="the blocks module by module (block plans off)")
    args = ap.parse_args()
    if args.modules:
        Block.kept_plan = lambda self: None
    shape, variants = (QUICK, VARIANTS_QUICK) if args.quick else (SHAPE, VARIANTS)
    how = "module by module" if args.modules else "as the step runs (blocks in one call)"
    print(f"{torch.get_num_threads()} threads, 1 cached token, ms per step, {how}\n")
    print("| variant | batch | clock | in operators | GEMMs | outside operators |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec in variants:
        for batch in (1, 8):
            r = profile_step(spec, batch, shape)
            print(
                f"| {spec.split(':')[0]} | {batch} | {r['clock']:.2f} | {r['ops']:.2f} | {r['gemm']:.2f} | "
                f"{r['outside']:.2f} ({r['outside'] / r['clock']:.0%}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
