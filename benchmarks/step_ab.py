"""The decode step with and without each of its cheaper pieces (issue 15, "the rest of the step"), interleaved in one
process: the two arms alternate step by step and each line gives the median over rounds of the per-round ratio
old / new, so a busy shared machine slows both alike (benchmarks/decode-limit.md, last section).

    OMP_NUM_THREADS=2 python benchmarks/step_ab.py            # ~3 min on 2 quiet cores
    OMP_NUM_THREADS=2 python benchmarks/step_ab.py --quick    # a toy shape: checks the script

Pieces (old arm -> new arm), at the bench reference shape:
- ``rms_norm``: torch's ``F.rms_norm`` -> ``kvlm.kernels.rms_norm`` (one C++ pass), 1 cached token;
- ``head_matmul``: ``einsum`` -> ``latent_ops.head_matmul`` for MLA's per-head absorption, 1 cached token;
- ``huge-page cache``: the cache's pools in 4 KiB pages -> in 2 MiB pages (``kvlm.hugepages``), long contexts;
- ``huge-page weights``: parameters in 4 KiB pages -> moved by ``prepare_for_inference``, batch 1, 1 token;
- ``few-row GEMMs``: the weight products as before the few-row kernel (F.linear, or MKL's copy packed for the
  batch at 4-16 rows) -> ``kvlm.kernels.few_rows`` (up to 8 rows), 1 cached token;
- ``kernel sources`` (with ``--baseline REV``): the C++ kernels built from git revision REV's sources (as
  ``kernel_micro.py --baseline`` builds them) -> the working tree's, long contexts: a kernel change seen in the
  whole step.

``--pieces`` picks some (names as above).

    OMP_NUM_THREADS=2 python benchmarks/step_ab.py --baseline HEAD --pieces "kernel sources"   # ~1 min + builds
    OMP_NUM_THREADS=2 python benchmarks/step_ab.py --baseline HEAD --pieces "kernel sources" --one-token  # and at 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from kernel_micro import build_baseline  # this folder

import kvlm.attention.mla as mla_module
import kvlm.attention.norm as model_module
import kvlm.kernels.few_rows as few_rows_module
from kvlm import hugepages
from kvlm.bench.plan import parse_variant
from kvlm.inference.generation import packs_for
from kvlm.kernels import cpu
from kvlm.model import build_model

SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000, ffn_dim=2048)
QUICK = dict(n_layer=2, d_model=64, n_head=4, vocab_size=256, ffn_dim=128)
MLA = "mla:kv_lora_rank=256:rope_head_dim=32"
VARIANTS = ["mha", "gqa:n_kv_head=3", MLA]
VARIANTS_QUICK = ["mha", "gqa:n_kv_head=2", "mla:kv_lora_rank=32:rope_head_dim=8"]


PIECES = [
    "rms_norm",
    "head_matmul",
    "huge-page cache",
    "huge-page weights",
    "few-row GEMMs",
    "kernel sources",
]
LONG = ("huge-page cache", "kernel sources")  # pieces timed at long contexts


def _einsum_heads(x, w):
    return torch.einsum("bhtp,hpc->bhtc", x, w)  # as MLA wrote it before head_matmul


def _model(spec: str, shape: dict, max_len: int, huge_weights: bool = True):
    _, cfg = parse_variant(spec, shape)
    torch.manual_seed(0)
    os.environ[hugepages.ENV] = "1" if huge_weights else "0"
    try:
        return build_model(cfg.replace(max_seq_len=max_len)).eval().prepare_for_inference()
    finally:
        os.environ.pop(hugepages.ENV)


def _cache(model, batch: int, context: int, huge: bool):
    os.environ[hugepages.ENV] = "1" if huge else "0"
    try:
        cache = model.new_cache(batch, context + 4)
    finally:
        os.environ.pop(hugepages.ENV)
    torch.manual_seed(1)
    cache.fill_random_(context, model.cfg.vocab_size)
    return cache


def ab(arms: dict, rounds: int) -> tuple[float, float, float]:
    """arms: {"old": f, "new": f}, each one decode step; (old ms, new ms, median per-round old / new)."""
    times: dict = {k: [] for k in arms}
    for f in arms.values():
        f()
    for rnd in range(rounds):
        order = list(arms.items())
        for k, f in order[::-1] if rnd % 2 else order:  # each arm first in turn: no order bias
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    ratio = statistics.median(o / n for o, n in zip(times["old"], times["new"]))
    return statistics.median(times["old"]) * 1e3, statistics.median(times["new"]) * 1e3, ratio


def run(
    spec: str, batch: int, context: int, piece: str, shape: dict, rounds: int, baseline=None
) -> tuple[float, float, float]:
    mode = "absorbed" if spec.startswith("mla") else "auto"
    huge_weights = piece != "huge-page weights"
    model = _model(spec, shape, context + 8, huge_weights)
    # a model per arm where the arms differ in the model or in the kernel: the blocks' stack (decode_plans) is
    # built once per model from the extension loaded then and holds it
    separate = not huge_weights or piece == "kernel sources"
    old_model = _model(spec, shape, context + 8, huge_weights) if separate else model
    caches = {"old": _cache(model, batch, context, piece != "huge-page cache"), "new": None}
    caches["new"] = caches["old"] if piece != "huge-page cache" else _cache(model, batch, context, True)
    tok = torch.randint(0, model.cfg.vocab_size, (batch, 1))
    for m in {id(model): model, id(old_model): old_model}.values():
        layout = packs_for(m, batch)
        if layout is None and piece == "few-row GEMMs" and 4 <= batch <= 16:  # the old arm's packing
            layout = batch
        if layout is not None:
            m.pack_for_decode(layout)
    few = few_rows_module.FEW_ROWS, few_rows_module.MAX_ROWS
    fused, heads = model_module.one_pass_rms_norm, mla_module.head_matmul
    kernels = cpu.extension()

    def step(arm: str):
        use_old = arm == "old"
        model_module.one_pass_rms_norm = (lambda *a: None) if use_old and piece == "rms_norm" else fused
        mla_module.head_matmul = _einsum_heads if use_old and piece == "head_matmul" else heads
        off = use_old and piece == "few-row GEMMs"
        few_rows_module.FEW_ROWS, few_rows_module.MAX_ROWS = (0, 0) if off else few
        cpu._state["module"] = baseline if use_old and piece == "kernel sources" else kernels
        m = old_model if use_old else model
        cache = caches[arm]
        cache.length = context
        out = m(tok, cache=cache, mode=mode, last_only=True)
        model_module.one_pass_rms_norm, mla_module.head_matmul = fused, heads
        few_rows_module.FEW_ROWS, few_rows_module.MAX_ROWS = few
        cpu._state["module"] = kernels
        return out

    with torch.inference_mode():
        old, new = step("old"), step("new")
        assert (old - new).abs().max().item() < 1e-3, f"{piece}: the arms disagree"
        return ab({"old": lambda: step("old"), "new": lambda: step("new")}, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--rounds", type=int, default=25, help="interleaved rounds per line")
    ap.add_argument(
        "--pieces",
        nargs="+",
        default=[p for p in PIECES if p != "kernel sources"],
        choices=PIECES,
        metavar="PIECE",
    )
    ap.add_argument(
        "--baseline",
        metavar="REV",
        help="git revision whose kernel sources the piece 'kernel sources' times against the working tree's",
    )
    ap.add_argument(
        "--one-token",
        action="store_true",
        help="'kernel sources' also at 1 cached token (the step outside attention: the weight products and the rest)",
    )
    a = ap.parse_args()
    if "kernel sources" in a.pieces and not a.baseline:
        ap.error("the piece 'kernel sources' needs --baseline REV")
    if cpu.extension() is None and "kernel sources" in a.pieces:
        ap.error(f"the kernels did not build here: {cpu.build_error()}")
    baseline = build_baseline(a.baseline) if "kernel sources" in a.pieces else None
    shape = QUICK if a.quick else SHAPE
    variants = VARIANTS_QUICK if a.quick else VARIANTS
    long = {1: 256, 8: 128} if a.quick else {1: 8192, 8: 4096}
    print(f"{torch.get_num_threads()} threads, THP: {open('/sys/kernel/mm/transparent_hugepage/enabled').read().strip()}"
          if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") else "")  # fmt: skip
    print(
        "| piece | variant | batch | cached tokens | old ms | new ms | old / new |\n|---|---|---:|---:|---:|---:|---:|"
    )
    for piece in a.pieces:
        for spec in variants:
            if piece == "head_matmul" and not spec.startswith("mla"):
                continue
            for batch in (1, 8):
                if piece == "huge-page weights" and batch != 1:
                    continue  # batch 4-16 reads MKL's packed copies, which torch allocates
                contexts = [long[batch] if piece in LONG else 1]
                if piece == "kernel sources" and a.one_token:
                    contexts.insert(0, 1)
                for context in contexts:
                    old, new, ratio = run(
                        spec, batch, context, piece, shape, 3 if a.quick else a.rounds, baseline
                    )
                    name = spec.split(":")[0]
                    print(
                        f"| {piece} | {name} | {batch} | {context} | {old:.2f} | {new:.2f} | {ratio:.3f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
