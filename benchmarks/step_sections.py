"""Where a decode step's time goes inside the decoder blocks' one kernel call (issue 15, "the rest of the step"):
the extension built with the knob ``KVLM_SECTION_TIMES`` (csrc/decode_block.h: a clock between the parts of a
block, nothing in the package's own build), the step at the bench reference shape with the cache holding
``--context`` tokens, ms per step summed over the layers, and outside the blocks' call the LM head (timed apart,
on the same rows) and the rest (Python, embedding, norms, small operators).

    OMP_NUM_THREADS=2 python benchmarks/step_sections.py                    # ~2 min after a ~1 min build
    OMP_NUM_THREADS=2 python benchmarks/step_sections.py --quick            # a toy shape: checks the script

Cases (variant, batch, cached tokens): MHA, GQA-3 and absorbed MLA at batch 8 / 4096 and batch 1 / 8192, and
at 1 cached token, weights packed as ``generate`` packs them. Medians over ``--steps`` steps. Prints a markdown
table.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch
from step_overhead import QUICK, SHAPE, VARIANTS, VARIANTS_QUICK, short_step  # this folder
from torch.utils.cpp_extension import load

from kvlm.inference.generation import packs_for
from kvlm.kernels import cpu

PARTS = ["norm + input product", "RoPE, latent norm, cache write", "q W~^UK (MLA)", "attention", "z W~^UV (MLA)",
         "W^O + residual", "norm + W_1, W_2", "SiLU gate", "W_O of the MLP", "residual"]  # fmt: skip


def timed_extension():
    """The kernel extension built from the package's sources with KVLM_SECTION_TIMES (cached by their hash)."""
    flags = cpu.build_flags() + ["-DKVLM_SECTION_TIMES"]
    tag = hashlib.sha1((cpu._source_tag() + " ".join(flags)).encode()).hexdigest()[:10]
    return load(name=f"kvlm_decode_sections_{tag}", sources=[str(cpu.SOURCE)], extra_cflags=flags,
                extra_ldflags=["-fopenmp"], verbose=False)  # fmt: skip


def case(spec: str, batch: int, context: int, shape: dict, steps: int, ext) -> dict:
    cfg, model, mode, cache, tok = short_step(spec, batch, shape, context)
    layout = packs_for(model, batch)
    if layout is not None:
        model.pack_for_decode(layout)
    h = torch.randn(batch, 1, cfg.d_model)

    def step():
        cache.length = context
        model(tok, cache=cache, mode=mode, last_only=True)

    for _ in range(3):
        step()
    ext.section_times()
    total, head, parts = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        total.append(time.perf_counter() - t0)
        parts.append(ext.section_times())
        t0 = time.perf_counter()
        model.lm_head(h)
        head.append(time.perf_counter() - t0)
    by_part = [statistics.median(p[i] for p in parts) * 1e3 for i in range(len(PARTS))]
    t, lm = statistics.median(total) * 1e3, statistics.median(head) * 1e3
    return {"step": t, "parts": by_part, "lm_head": lm, "rest": t - sum(by_part) - lm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    shape, variants = (QUICK, VARIANTS_QUICK) if a.quick else (SHAPE, VARIANTS)
    cells = [(8, 64), (1, 128), (8, 1)] if a.quick else [(8, 4096), (1, 8192), (8, 1)]
    ext = timed_extension()
    cpu.extension()  # the package's build first, then the timed one in its place for these steps
    cpu._state["module"] = ext
    rows = []
    with torch.inference_mode():
        for spec in variants:
            for batch, context in cells:
                r = case(spec, batch, context, shape, 3 if a.quick else a.steps, ext)
                rows.append((spec.split(":")[0], batch, context, r))
    print(f"{torch.get_num_threads()} threads, ms per step (medians of {3 if a.quick else a.steps} steps), parts "
          "summed over the layers\n")  # fmt: skip
    print("| part | " + " | ".join(f"{v} b{b} / {c}" for v, b, c, _ in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for i, name in enumerate(PARTS):
        print(f"| {name} | " + " | ".join(f"{r['parts'][i]:.2f}" for *_, r in rows) + " |")
    for key, name in (("lm_head", "LM head (timed apart)"), ("rest", "the rest (Python, small operators)"),
                      ("step", "step")):  # fmt: skip
        print(f"| {name} | " + " | ".join(f"{r[key]:.2f}" for *_, r in rows) + " |")


if __name__ == "__main__":
    main()
