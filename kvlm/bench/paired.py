"""The decode step against a floor measured at the same moment (issue 15's ratios on a shared machine).

On a machine whose memory other tenants share, read bandwidth moves 1.5-2x within minutes (this project's VMs:
17-68 GB/s on 2 threads within an hour), so a step timed at one moment against a floor measured at another
mostly measures the neighbours. ``paired_step`` times the decode step in rounds; each round is bracketed by two
probes of the machine (kvlm.bench.hardware.Probe: read bandwidth and fp32 matmul peak) and set against the floor
of the mean of its two probes. The median over rounds of those per-round ratios is the step's x floor; the
per-class split (kvlm.bench.opstime) is paired the same way: the step at its context, the step at one cached
token and the LM head run in every round.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from kvlm.bench.roofline import attention_cost, operation_classes, operation_roofline, weight_classes
from kvlm.inference.generation import packs_for
from kvlm.model import KVLM

HW_KEYS = ("bandwidth_gbs", "matmul_fp32_gflops")


def timed_rounds(
    calls: dict[str, Callable[[], object]],
    probe: Callable[[], dict[str, float]],
    rounds: int,
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> list[dict]:
    """``rounds`` rounds of: probe, each call ``steps`` times in turn, probe. Each round: ``ms`` (per call, the
    median of its steps) and ``hardware`` (the mean of the round's two probes)."""
    out = []
    for _ in range(rounds):
        before = probe()
        ms = {}
        for name, call in calls.items():
            times = []
            for _ in range(steps):
                t0 = clock()
                call()
                times.append((clock() - t0) * 1e3)
            ms[name] = statistics.median(times)
        after = probe()
        out.append({"ms": ms, "hardware": {k: (before[k] + after[k]) / 2 for k in HW_KEYS}})
    return out


def paired_ratios(rounds: list[dict], classes: dict[str, dict]) -> dict:
    """Each round's times against the floor of its own hardware (kvlm.bench.roofline.operation_roofline of the
    step's ``classes``): ``x_floor`` per round and its median, and per class (weight GEMMs = the step at one
    cached token - the LM head; attention = the step - the step at one cached token; LM head alone)."""
    per_round = []
    for r in rounds:
        ops = operation_roofline(classes, r["hardware"])
        step, short, head = r["ms"]["step"], r["ms"]["short"], r["ms"]["head"]
        measured = {
            "weight GEMMs": max(short - head, 0.0),
            "attention": max(step - short, 0.0),
            "LM head": head,
        }
        floor = sum(o["floor_ms"] for o in ops.values())
        per_round.append(
            {
                "x_floor": step / floor,
                "floor_ms": floor,
                "classes": {k: measured[k] / ops[k]["floor_ms"] for k in measured if ops[k]["floor_ms"]},
            }
        )
    xs = [p["x_floor"] for p in per_round]
    return {
        "x_floor": statistics.median(xs),
        "x_floor_min": min(xs),
        "x_floor_max": max(xs),
        "ms": statistics.median(r["ms"]["step"] for r in rounds),
        "floor_ms": statistics.median(p["floor_ms"] for p in per_round),
        "bandwidth_gbs": [
            min(r["hardware"]["bandwidth_gbs"] for r in rounds),
            max(r["hardware"]["bandwidth_gbs"] for r in rounds),
        ],  # fmt: skip
        "classes": {
            k: statistics.median(p["classes"][k] for p in per_round) for k in per_round[0]["classes"]
        },
        "rounds": [{**r, **p} for r, p in zip(rounds, per_round)],
    }


@torch.inference_mode()
def paired_step(
    model: KVLM,
    batch: int,
    context: int,
    mode: str,
    probe: Callable[[], dict[str, float]],
    rounds: int = 12,
    steps: int = 4,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """The decode step of ``batch`` sequences at ``context`` cached tokens (weights packed as ``generate`` packs
    them), the step at one cached token and the LM head, in ``rounds`` probed rounds (``timed_rounds``), against
    the floor of each round's hardware (``paired_ratios``). The caches grow a token a step: the floor counts
    ``context`` tokens, the fewest any timed step read."""
    cfg = model.cfg
    dev = model.embed.weight.device
    room = 2 + rounds * steps
    caches, toks = {}, {}
    for name, n in (("step", context), ("short", 1)):
        caches[name] = model.new_cache(batch, n + room, naive=(mode == "naive"))
        caches[name].fill_random_(n, cfg.vocab_size)
        toks[name] = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev)
    hidden = torch.randn(batch, 1, cfg.d_model, device=dev, dtype=model.embed.weight.dtype)

    def step(name):
        toks[name] = model(toks[name], cache=caches[name], mode=mode, last_only=True).argmax(-1)

    calls = {
        "step": lambda: step("step"),
        "short": lambda: step("short"),
        "head": lambda: model.lm_head(model.norm(hidden)),
    }
    layout = packs_for(model, batch)
    packed = layout is not None and model.pack_for_decode(layout) > 0
    try:
        for call in calls.values():  # warm-up (the first step of a cache; the packed products' first call)
            call()
        measured = timed_rounds(calls, probe, rounds, steps, clock)
    finally:
        if packed:
            model.pack_for_decode(None)
    elt = model.embed.weight.element_size()
    classes = operation_classes(weight_classes(model), attention_cost(cfg, batch, context, mode, elt), batch)
    return {"weights_packed": layout if packed else None, **paired_ratios(measured, classes)}
