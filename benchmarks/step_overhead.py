"""The decode step outside attention (issue 15, "the rest of the step"): the step at 1 cached token (weights, LM
head, per-layer overhead) at the bench reference shape, with its pieces toggled in one process, interleaved.

    OMP_NUM_THREADS=2 python benchmarks/step_overhead.py            # ~1 min on 2 quiet cores
    OMP_NUM_THREADS=2 python benchmarks/step_overhead.py --quick    # a toy shape: checks the script

Per variant (MHA, GQA-3, absorbed MLA) and batch (1, 8), medians of interleaved runs:
- ``step``: the step as ``generate`` runs it (batch 4-16: weights packed, SwiGLU's W1/W2 and MHA's W^Q/W^K/W^V as
  one packed GEMM each, ``GroupPacking``); ``step, groups off``: the same with every Linear packed on its own;
- ``LM head packed`` / ``unpacked``: the final norm + LM head alone, packed as the step runs it at batch 4-16
  (what kvlm bench's per-operation time now runs) or not (what it ran before);
- ``weights x`` / ``LM head x``: (step - LM head) and LM head against their floors (kvlm.bench.roofline), with
  bandwidth and matmul peak measured here at the same thread count;
- ``aten ops``: the operators one step dispatches (Python overhead scales with it);
- ``read-backs``: of those, the ones that copy a tensor's value to the host (``item``, ``is_nonzero``: a
  device sync on an accelerator); the caches hand the kernels their key counts on the host, so this does
  not grow with the layers (tests/test_step_memo.py).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvlm.bench.hardware import measure_hardware
from kvlm.bench.plan import parse_variant
from kvlm.bench.roofline import operation_classes, operation_roofline, weight_classes
from kvlm.inference.generation import packs_for
from kvlm.model import build_model

SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000, ffn_dim=2048)
QUICK = dict(n_layer=2, d_model=64, n_head=4, vocab_size=256, ffn_dim=128)
VARIANTS = ["mha", "gqa:n_kv_head=3", "mla:kv_lora_rank=256:rope_head_dim=32"]
VARIANTS_QUICK = ["mha", "gqa:n_kv_head=2", "mla:kv_lora_rank=32:rope_head_dim=8"]


class _Count(TorchDispatchMode):
    READ_BACKS = (
        torch.ops.aten.item.default,
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.is_nonzero.default,
    )

    def __init__(self):
        super().__init__()
        self.n = 0
        self.read_backs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        self.read_backs += func in self.READ_BACKS
        return func(*args, **(kwargs or {}))


def _interleaved(calls: dict, reps: int) -> dict:
    times: dict = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def short_step(spec: str, batch: int, shape: dict, context: int = 1):
    """(cfg, model ready for inference, its decode mode, a cache holding ``context`` tokens, next tokens) for
    ``spec``."""
    _, cfg = parse_variant(spec, shape)
    cfg = cfg.replace(max_seq_len=max(64, context + 8))
    torch.manual_seed(0)
    model = build_model(cfg).eval().prepare_for_inference()
    mode = "absorbed" if spec.startswith("mla") else "auto"
    cache = model.new_cache(batch, max(32, context + 8))
    cache.fill_random_(context, cfg.vocab_size)
    return cfg, model, mode, cache, torch.randint(0, cfg.vocab_size, (batch, 1))


def one_token_step(spec: str, batch: int, shape: dict):
    """One decode step of ``spec`` at 1 cached token (every call sees the same single token), the weights packed as
    ``generate`` packs them for ``batch``: a function of no arguments."""
    _, model, mode, cache, tok = short_step(spec, batch, shape)
    layout = packs_for(model, batch)
    if layout is not None:
        model.pack_for_decode(layout)

    def step():
        cache.length = 1
        model(tok, cache=cache, mode=mode, last_only=True)

    return step


def one(spec: str, batch: int, shape: dict, hw: dict, reps: int) -> dict:
    cfg, model, mode, cache, tok = short_step(spec, batch, shape)
    x = torch.randn(batch, 1, cfg.d_model)
    packs = packs_for(model, batch)
    grouped = [m for m in model.modules() if hasattr(m, "group_outputs")]
    head = model.lm_head
    if packs is not None:
        model.pack_for_decode(packs)
        groups = {m: m.__dict__["_decode_groups"] for m in grouped}
        singles = {m: m.__dict__.get("_packed") for m in model.modules() if hasattr(m, "unpack")}
        for m in model.modules():  # every Linear also packed alone, for the "groups off" arm
            if hasattr(m, "unpack") and m.__dict__.get("_packed") is None:
                m.pack_for_decode(batch)
        alone = {m: m.__dict__.get("_packed") for m in singles}

    def step(groups_on: bool = True):
        if packs:
            for m in grouped:
                m.__dict__["_decode_groups"] = groups[m] if groups_on else {}
            for m in singles:
                m._packed = singles[m] if groups_on else alone[m]
        cache.length = 1
        model(tok, cache=cache, mode=mode, last_only=True)

    def lm_head(packed: bool):
        saved = head._packed
        if not packed:
            head._packed = None
        head(model.norm(x))
        head._packed = saved

    calls = {"step": step, "LM head unpacked": lambda: lm_head(False)}
    if packs:  # below 4 rows the step runs unpacked weights: no packed arms
        calls.update({"step, groups off": lambda: step(False), "LM head packed": lambda: lm_head(True)})
    with torch.inference_mode():
        for f in calls.values():
            f()
        ms = _interleaved(calls, reps)
        with _Count() as c:
            step()
    ops = operation_roofline(operation_classes(weight_classes(model), {"bytes": 0, "flops": 0.0}, batch), hw)
    head_ms = ms["LM head packed" if packs else "LM head unpacked"]
    ms["weights x"] = (ms["step"] - head_ms) / ops["weight GEMMs"]["floor_ms"]
    ms["LM head x"] = head_ms / ops["LM head"]["floor_ms"]
    ms["aten ops"] = c.n
    ms["read-backs"] = c.read_backs
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per measurement")
    args = ap.parse_args()
    shape = QUICK if args.quick else SHAPE
    hw = measure_hardware(torch.device("cpu"), mib=8 if args.quick else 512)
    print(
        f"{torch.get_num_threads()} threads: {hw['bandwidth_gbs']:.1f} GB/s, {hw['matmul_fp32_gflops']:.0f} GFLOP/s"
    )
    cols = [
        "step",
        "step, groups off",
        "LM head packed",
        "LM head unpacked",
        "weights x",
        "LM head x",
        "aten ops",
        "read-backs",
    ]
    print("| variant | batch | " + " | ".join(cols) + " |\n|---|---:|" + "---:|" * len(cols))
    for spec in VARIANTS_QUICK if args.quick else VARIANTS:
        for batch in (1, 8):
            r = one(spec, batch, shape, hw, 3 if args.quick else args.reps)
            cells = [f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
            print(f"| {spec} | {batch} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
