"""The decode step with the weights in the few-row kernel's panels against the plain weights (issue 15, the
weights at 1-8 rows): the bench reference shape, MHA, GQA-3 and absorbed MLA at batch 1 / 8192 and batch 8 / 4096
cached tokens, 2 threads, the two arms interleaved in one process (16 rounds of 4 steps each, medians), a bandwidth
probe before and after each case, and the layout ``fastest_packing`` names on the LM head (what ``generate``
packs). The weights are packed once and the arms switch by setting the packed copies aside, as a generation
decodes many steps on one packing: packing anew every round measured the step at batch 1 3-5 % slower on panels,
from memory freshly allocated, where on one packing it was level.

    OMP_NUM_THREADS=2 python benchmarks/step_panels.py      # ~3 min

Prints per case: ms per step unpacked and on panels, the median over rounds of unpacked / panels, the layout
``fastest_packing`` named, and the largest difference of the logits between the arms.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlm.attention.linear import PANELS, GroupPacking, Linear, fastest_packing
from kvlm.bench.hardware import Probe
from kvlm.bench.plan import parse_variant
from kvlm.model import build_model

SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000, ffn_dim=2048)
VARIANTS = ["mha", "gqa:n_kv_head=3", "mla:kv_lora_rank=256:rope_head_dim=32"]


def case(spec: str, batch: int, context: int, probe: Probe) -> str:
    _, cfg = parse_variant(spec, SHAPE)
    torch.manual_seed(0)
    model = build_model(cfg.replace(max_seq_len=context + 64)).eval().prepare_for_inference()
    mode = "absorbed" if spec.startswith("mla") else "auto"
    cache = model.new_cache(batch, context + 32)
    cache.fill_random_(context, cfg.vocab_size)
    tok = torch.randint(0, cfg.vocab_size, (batch, 1))
    named = fastest_packing(model.lm_head.weight, batch)

    def step():
        cache.length = context
        return model(tok, cache=cache, mode=mode, last_only=True)

    model.pack_for_decode(PANELS)
    linears = {m: m._packed for m in model.modules() if isinstance(m, Linear)}
    groups = {m: m.__dict__.get("_decode_groups", {}) for m in model.modules() if isinstance(m, GroupPacking)}

    def use_panels(on: bool) -> None:
        for m, packed in linears.items():
            m._packed = packed if on else None
        for m, g in groups.items():
            m.__dict__["_decode_groups"] = g if on else {}

    times = {"plain": [], "panels": []}
    with torch.inference_mode():
        use_panels(True)
        on_panels = step()
        use_panels(False)
        diff = (on_panels - step()).abs().max().item()
        before = probe.read_gbs()
        for r in range(16):
            for arm in ["plain", "panels"] if r % 2 else ["panels", "plain"]:
                use_panels(arm == "panels")
                step()
                ts = []
                for _ in range(4):
                    t0 = time.perf_counter()
                    step()
                    ts.append(time.perf_counter() - t0)
                times[arm].append(statistics.median(ts))
        after = probe.read_gbs()
        model.pack_for_decode(None)
    ratio = statistics.median(a / b for a, b in zip(times["plain"], times["panels"]))
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return (f"| {spec.split(':')[0]} | {batch} | {context} | {before:.0f}, {after:.0f} | {ms['plain']:.2f} | "
            f"{ms['panels']:.2f} | {ratio:.3f} | {named} | {diff:.1e} |")  # fmt: skip


def main() -> None:
    probe = Probe(torch.device("cpu"), mib=256, matmul=512)
    print(f"{torch.get_num_threads()} threads\n")
    print("| variant | batch | context | probe GB/s before, after | unpacked ms | panels ms | unpacked / panels "
          "| fastest_packing | max logit diff |")  # fmt: skip
    print("|---|---:|---:|---|---:|---:|---:|---|---:|")
    for spec in VARIANTS:
        for batch, context in ((1, 8192), (8, 4096)):
            print(case(spec, batch, context, probe), flush=True)


if __name__ == "__main__":
    main()
