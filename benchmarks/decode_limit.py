"""Decode at the hardware limit (issue 15): ms per decode step against the per-operation floor, kvlm with its
CPU kernels, kvlm's plain PyTorch path (KVLM_KERNELS=0) and transformers' peers, in one run.

    python benchmarks/decode_limit.py                 # the full run, 3 passes (~25-30 min on 2 quiet cores)
    python benchmarks/decode_limit.py --quick         # a toy shape: checks the script, numbers mean nothing

Writes benchmarks/decode-limit.md (tables) and benchmarks/decode-limit.json (every row). Rows:

- batch 8 / 4096 cached tokens and batch 1 / 8192, 2 threads: MHA, GQA-3, MLA absorbed and naive
  (d_c 256, d_h^R 32), kernels on and off, peers (Llama for MHA/GQA, DeepseekV3 for MLA) at batch 8 / 4096;
- batch 1 / 8192 at 1 thread (does batch-1 decode use both cores?);
- T = 4 new tokens against T = 1 for absorbed MLA at 4096 cached tokens (speculative verification);
- after the passes, the step compiled (``generate(compile=True)``) against the eager one at both sizes;
- last, the step rows of kvlm with its kernels against a floor measured beside each timed round
  (``benchmarks/paired_floor.py``): on a shared machine, the ratios to read.

The step rows are measured in ``--passes`` passes (default 3), the configurations in a rotated order in each
pass (the transformers peers in the first only): on a shared machine other tenants only ever slow a
measurement down, so a row's time is its best pass (the median of its decode steps in that pass), set against
the lowest floor any pass measured (from the highest bandwidth and peak the run saw); the x floor of every
pass against its own floor is listed beside it, and the host's steal time during each pass (``/proc/stat``).

The floor of a step is the sum over its operation classes (weight GEMMs, attention over the cache, LM head)
of max(bytes / bandwidth, FLOPs / matmul peak), with bandwidth and peak measured at the same thread count
(kvlm.bench.roofline, kvlm.bench.opstime for the measured time per class).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import decode_targets  # this folder
import paired_floor  # this folder
import torch

from kvlm.bench import make_plan, run
from kvlm.bench.hardware import best_of, measure_hardware
from kvlm.bench.measure import fill_cache
from kvlm.bench.roofline import attention_cost, operation_classes, operation_roofline, weight_classes
from kvlm.inference.generation import packs_for
from kvlm.kernels import few_rows
from kvlm.model import build_model

HERE = Path(__file__).parent
SHAPE = dict(n_layer=6, d_model=768, n_head=12, vocab_size=32000, ffn_dim=2048)
MLA = "mla:kv_lora_rank=256:rope_head_dim=32"
VARIANTS = ["mha", "gqa:n_kv_head=3", MLA]
QUICK = dict(n_layer=1, d_model=64, n_head=4, vocab_size=256, ffn_dim=128)
MLA_QUICK = "mla:kv_lora_rank=32:rope_head_dim=8"


def bench(batch, context, threads, kernels, peers, quick):
    """One `kvlm bench` run (library API) at ``threads`` threads, kernels on or off."""
    os.environ["KVLM_KERNELS"] = "1" if kernels else "0"
    torch.set_num_threads(threads)
    shape = QUICK if quick else SHAPE
    variants = ["mha", "gqa:n_kv_head=2", MLA_QUICK] if quick else VARIANTS
    plan = make_plan(
        None,
        dict(
            variants=variants, modes=["naive", "absorbed"], batch=[batch], context=[context], prompt=[16],
            steps=3 if quick else 6, warmup=1 if quick else 2, repeats=1, bandwidth_mib=8 if quick else 512, **shape,
        ),
        peers=peers,
        budget_s=None if quick else 30.0,
    )  # fmt: skip
    res = run(plan)
    for r in res["decode"]:
        r.update(threads=threads, kernels=kernels if r["impl"] == "kvlm" else None)
    return res


def _interleaved(calls: dict, reps: int) -> dict:
    """Median ms of each zero-argument call, the calls interleaved (the machine may be shared: ratios count)."""
    times: dict = {k: [] for k in calls}
    for _ in range(reps):
        for k, f in calls.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def _packs(model) -> dict:
    """Every module's packed decode copies (Linear's ``_packed``, ``GroupPacking``'s groups), to swap in and out."""
    keys = ("_packed", "_decode_groups")
    return {m: {k: m.__dict__[k] for k in keys if k in m.__dict__} for m in model.modules()}


def _swap_in(packs: dict, on: bool = True) -> None:
    for m, state in packs.items():
        for k, v in state.items():
            m.__dict__[k] = v if on else ({} if k == "_decode_groups" else None)


def _model(spec_full, spec_quick, context, quick):
    from kvlm.bench.plan import parse_variant

    _, cfg = parse_variant(spec_quick if quick else spec_full, QUICK if quick else SHAPE)
    cfg = cfg.replace(max_seq_len=context + 64)
    return cfg, build_model(cfg).eval().prepare_for_inference()


def multi_token(threads, quick):
    """ms per call of MLA with T = 1, 2, 4, 8, 16 new tokens (speculative verification) on a cache of 4096
    tokens, batch 1 and 8: the "auto" route (prefers_absorbed) and the expand route it declines, interleaved.
    Every call computes the logits of all T positions (verification needs them: the LM head reads T B rows).
    The cache is rolled back to ``context`` after every call, so each call sees the same cache."""
    os.environ["KVLM_KERNELS"] = "1"
    torch.set_num_threads(threads)
    context = 64 if quick else 4096
    cfg, model = _model(MLA, MLA_QUICK, context, quick)
    out = {}
    with torch.inference_mode():
        for batch in (1, 2) if quick else (1, 8):
            out[batch] = _multi_token_batch(model, cfg, batch, context, quick)
    return out


def _multi_token_batch(model, cfg, batch, context, quick):
    """One batch size of ``multi_token``: {"T=.. mode (route)": ms}."""
    cache = model.new_cache(batch, context + 16)
    fill_cache(cache, context, cfg.vocab_size)
    calls = {}
    for T in (1, 2, 4, 8, 16):
        tok = torch.randint(0, cfg.vocab_size, (batch, T))
        # weights packed for the call's B T rows (KVLM.pack_for_decode) as generate decides for a batch of that
        # many rows (packs_for: the fastest layout measured here, or none)
        model.pack_for_decode(packs_for(model, batch * T))
        packs = _packs(model)
        for mode in ("auto", "expand") if T in (1, 4, 16) else ("auto",):
            trace: list = []

            def call(tok=tok, mode=mode, trace=trace, cache=cache, packs=packs):
                _swap_in(packs)
                trace.clear()
                model(tok, cache=cache, mode=mode, trace=trace)  # logits at every new position: verification
                cache.length = context  # roll back: the next call verifies against the same cache

            calls[(T, mode)] = call
            call()  # warm; records the route
            calls[(T, mode)].route = trace[0][1]
    hw = [measure_hardware(torch.device("cpu"), mib=8 if quick else 256, repeats=3)]
    ms = _interleaved(calls, 3 if quick else 6)
    hw.append(measure_hardware(torch.device("cpu"), mib=8 if quick else 256, repeats=3))
    model.pack_for_decode(None)
    best = best_of(*hw)
    return {
        f"T={T} {mode} ({calls[(T, mode)].route})": {
            "ms": v, "floor_ms": _multi_token_floor(model, cfg, batch, context, T, calls[(T, mode)].route, best),
            "gbs": best["bandwidth_gbs"], "gflops": best["matmul_fp32_gflops"],
        }
        for (T, mode), v in ms.items()
    }  # fmt: skip


def _multi_token_floor(model, cfg, batch, context, T, route, hw) -> float | None:
    """The per-operation floor (ms) of a call of T new tokens per sequence on the absorbed route after
    ``context`` cached tokens: the weights read once for B T rows; the cache read once, new token t attending to
    context + t + 1 keys; the LM head at every new position. None on the expand route, whose up-projection of
    the cache (once a call) the per-token ``decode_cost`` counts with every token."""
    if route != "absorbed":
        return None
    per_t = [attention_cost(cfg, batch, context + t + 1, route, 4) for t in range(T)]
    attention = {"bytes": per_t[-1]["bytes"], "flops": sum(a["flops"] for a in per_t)}
    classes = operation_classes(weight_classes(model), attention, batch * T)
    return sum(c["floor_ms"] for c in operation_roofline(classes, hw).values())


def weights_packed(threads, quick):
    """Weight GEMMs at batch 1-8: the whole step (absorbed MLA, GQA-3, 4096 cached tokens) with the library
    products (the few-row kernel off), unpacked or in MKL's packed layout (KVLM.pack_for_decode), and with the
    few-row kernel (kvlm.kernels.few_rows), interleaved; and the GEMMs alone (the projections of every layer +
    LM head, every weight streamed from memory) per path: F.linear (x W^T), Linear's W x^T, the packed
    product and the few-row kernel."""
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    context = 64 if quick else 4096
    out = {}
    with torch.inference_mode():
        for spec, spec_q in ((MLA, MLA_QUICK), ("gqa:n_kv_head=3", "gqa:n_kv_head=2")):
            cfg, model = _model(spec, spec_q, context, quick)
            for batch in (1, 8):
                cache = model.new_cache(batch, context + 4)
                fill_cache(cache, context, cfg.vocab_size)
                tok = torch.randint(0, cfg.vocab_size, (batch, 1))

                model.pack_for_decode(batch)  # once; the calls below swap the packed copies in and out
                packs = _packs(model)

                def step(packed, few=False, tok=tok, cache=cache, model=model, packs=packs):
                    _swap_in(packs, packed)
                    saved = few_rows.FEW_ROWS, few_rows.MAX_ROWS
                    if not few:  # the library products
                        few_rows.FEW_ROWS, few_rows.MAX_ROWS = 0, 0
                    try:
                        model(tok, cache=cache, last_only=True)
                    finally:
                        few_rows.FEW_ROWS, few_rows.MAX_ROWS = saved
                    cache.length = context

                arms = {"unpacked": lambda: step(False), "packed": lambda: step(True)}
                if few_rows.few_rows_available():
                    arms["few-row"] = lambda: step(False, True)
                ms = _interleaved(arms, 3 if quick else 8)
                out[f"step {spec if not quick else spec_q} batch {batch}"] = ms
            model.pack_for_decode(None)
        shape = QUICK if quick else SHAPE
        d, f, v = shape["d_model"], shape["ffn_dim"], shape["vocab_size"]
        weights = [
            torch.randn(o, i)
            for _ in range(shape["n_layer"])
            for o, i in ((3 * d, d), (d, d), (f, d), (f, d), (d, f))
        ]
        weights.append(torch.randn(v, d))
        for M in (1, 2, 3, 4, 8):
            xs = {i: torch.randn(M, i) for i in (d, f)}
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, M) for w in weights]
            calls = {
                "F.linear": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights],
                "W x^T": lambda xs=xs: [torch.mm(w, xs[w.shape[1]].t()).t().contiguous() for w in weights],
                "packed": lambda xs=xs, packed=packed, M=M: [
                    torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, M) for w, p in zip(weights, packed)
                ],
            }  # fmt: skip
            if few_rows.few_rows_available():
                calls["few-row"] = lambda xs=xs: [
                    few_rows.few_rows_linear(xs[w.shape[1]], [w], [None]) for w in weights
                ]
            ms = _interleaved(calls, 3 if quick else 8)
            mb = sum(w.numel() for w in weights) * 4 / 1e6
            out[f"GEMMs M={M} ({mb:.0f} MB)"] = {k: round(t, 2) for k, t in ms.items()}
    return out


def compiled_steps(rows: list[dict], sizes: list[tuple[int, int]], quick: bool) -> list[dict]:
    """The decode step compiled (``generate(compile=True)``) against the eager one, timed interleaved in one
    process (benchmarks/step_compiled.py), 2 threads, kernels on; each against the floor of its step row above."""
    import step_compiled

    os.environ["KVLM_KERNELS"] = "1"
    torch.set_num_threads(2)
    out = []
    for b, c in sizes:
        for spec in (["mha", "gqa:n_kv_head=2", MLA_QUICK] if quick else VARIANTS):
            print(f"compiled step: {spec}, batch {b}, context {c}", flush=True)
            r = step_compiled.case(spec, b, c, QUICK if quick else SHAPE, 3 if quick else 10)
            route = "absorbed" if spec.startswith("mla") else "plain"
            row = next(
                x for x in rows
                if (x["impl"], x["variant"], x["route"], x["batch"], x["context"], x["threads"], x["kernels"])
                == ("kvlm", spec, route, b, c, 2, True)
            )  # fmt: skip
            floor = sum(o["floor_ms"] for o in row["operations"].values())
            out.append({"variant": spec, "route": route, "batch": b, "context": c, "floor_ms": floor, **r})
    return out


def steal_s() -> float | None:
    """Seconds of CPU time the host has taken from this VM so far (all CPUs), None where /proc/stat has none."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def row_key(r) -> tuple:
    return (r["variant"], r["route"], r["impl"], r["batch"], r["context"], r["threads"], r.get("kernels"))


def combine(passes: list[dict]) -> list[dict]:
    """One row per step row of the passes: its best pass's time against the lowest floor of any pass (per
    operation class likewise), and each pass's own x floor (``pass_x``)."""
    by_key: dict[tuple, list[dict]] = {}
    for res in passes:
        for r in res["decode"]:
            by_key.setdefault(row_key(r), []).append(r)
    rows = []
    for same in by_key.values():
        row = dict(same[0])
        row["pass_ms"] = [r["median_ms"] for r in same]
        row["median_ms"] = min(row["pass_ms"])
        ops = [r.get("operations") or {} for r in same]
        if ops[0]:
            row["pass_x"] = [
                r["median_ms"] / sum(o["floor_ms"] for o in op.values()) for r, op in zip(same, ops)
            ]
            row["operations"] = {
                name: {
                    "floor_ms": min(op[name]["floor_ms"] for op in ops),
                    **(
                        {"measured_ms": min(op[name]["measured_ms"] for op in ops)}
                        if all("measured_ms" in op[name] for op in ops)
                        else {}
                    ),
                }
                for name in ops[0]
            }
            for o in row["operations"].values():
                if "measured_ms" in o and o["floor_ms"]:
                    o["x_floor"] = o["measured_ms"] / o["floor_ms"]
        rows.append(row)
    return rows


def row_line(r):
    ops = r.get("operations") or {}
    floor = decode_targets.step_floor(r)

    def x(name):
        v = ops.get(name, {}).get("x_floor")
        return f"{v:.2f}" if v is not None else ""

    impl = r["impl"] if r["impl"] != "kvlm" else ("kvlm kernels" if r["kernels"] else "kvlm plain")
    cells = [
        r["variant"], r["route"], impl, r["batch"], r["context"], r["threads"], f"{r['median_ms']:.1f}",
        f"{floor:.1f}" if floor else "", f"{r['median_ms'] / floor:.2f}" if floor else "",
        " / ".join(f"{v:.2f}" for v in r.get("pass_x", [])),
        x("weight GEMMs"), x("attention"), x("LM head"),
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


HEAD = (
    "| variant | route | impl | batch | context | threads | ms/step | floor ms | x floor | each pass x | weights x "
    "| attention x | LM head x |\n|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a toy shape, to check the script (seconds)")
    ap.add_argument("--passes", type=int, default=3, help="passes over the step rows (best pass counts)")
    ap.add_argument("--out", default=str(HERE / "decode-limit"), help="output path without extension")
    args = ap.parse_args()
    if args.passes < 1:
        ap.error(f"--passes must be at least 1, got {args.passes}")
    q = args.quick
    big, long = (2, 64) if q else (8, 4096), (1, 128) if q else (1, 8192)
    configs = [
        (big, 2, True, True), (big, 2, False, False),
        (long, 2, True, False), (long, 2, False, False), (long, 1, True, False),
    ]  # fmt: skip
    mt = multi_token(2, q)  # first: the short sections fail fast, before the long passes
    wp = weights_packed(2, q)
    passes, steal = [], []
    for k in range(args.passes):
        s0 = steal_s()
        runs: list = [None] * len(configs)
        for i in [(k + j) % len(configs) for j in range(len(configs))]:  # rotated: no config always first
            (b, c), threads, kernels, peers = configs[i]
            print(f"pass {k + 1}: batch {b}, context {c}, {threads} threads, kernels {'on' if kernels else 'off'}",
                  flush=True)  # fmt: skip
            runs[i] = bench(b, c, threads, kernels, peers and k == 0, q)
        s1 = steal_s()
        steal.append(None if s0 is None or s1 is None else s1 - s0)
        passes.append(runs)
    runs = passes[0]
    rows = [row for i in range(len(configs)) for row in combine([p[i] for p in passes])]
    comp = compiled_steps(rows, [big, long], q)
    paired = paired_floor.cells(q)
    lines = [
        "# Decode at the hardware limit (issue 15)",
        "",
        f"Generated by `python benchmarks/decode_limit.py{' --quick' if q else ''}`. Machine: "
        f"{runs[0]['machine']['cpu']}, {runs[0]['machine']['cores']} cores, torch {runs[0]['machine']['torch']}, "
        f"load average at start {runs[0]['machine']['load_average']}.",
        "",
        "Issue 15's targets in this run (`benchmarks/decode_targets.py`: best pass and paired ratios both within "
        "1.3x; the rows below):",
        "",
        *decode_targets.table(decode_targets.targets(rows, paired, mt, big, long, 64 if q else 4096)),
        "",
        f"{len(passes)} passes over the step rows; host steal time during each: "
        + ", ".join("n/a" if t is None else f"{t:.0f} s" for t in steal)
        + ". Hardware measured in each configuration of each pass at its thread count (floors use these): "
        + "; ".join(
            f"pass {k + 1}: "
            + ", ".join(
                f"{res['decode'][0]['threads']}t {res['hardware']['bandwidth_gbs']:.1f} GB/s "
                f"{res['hardware']['matmul_fp32_gflops']:.0f} GFLOP/s"
                for res in p
            )
            for k, p in enumerate(passes)
        ),
        "",
        "Floor = sum over operation classes of max(bytes / bandwidth, FLOPs / peak), the lowest of the passes; "
        "ms/step = the best pass (each pass: the median of its steps); `each pass x` = every pass against its own "
        "floor; `x` columns are measured / floor per class (attention = step - step at 1 cached token; LM head "
        "timed alone; weights = the rest).",
        "",
        HEAD,
        *[row_line(r) for r in rows],
        "",
        "The same cells against a floor measured at the same moment (`benchmarks/paired_floor.py`, "
        "kvlm.bench.paired): in each round, a probe of read bandwidth and matmul peak, the step at its context, the "
        "step at 1 cached token and the LM head (4 steps each, median), and a probe again; each round against the "
        "floor of the mean of its two probes. `x floor` is the median over rounds, `x floor, rounds` their range; "
        "kernels on, weights packed as `generate` packs them. On a machine whose bandwidth others move within "
        "minutes, these are the ratios to read.",
        "",
        *paired_floor.table(paired),
        "",
        "The step compiled (`generate(compile=True)`: `torch.compile`, the kernels and packed products as custom "
        "operators), 2 threads, kernels on, against the eager step (as in the rows above), the two timed "
        "interleaved in one process after the passes (medians of 10 rounds, the cache growing a token a step); "
        "x floor against the floor of the row above:",
        "",
        "| variant | route | batch | context | eager ms | compiled ms | eager / compiled | compiled x floor | "
        "eager x floor | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *[
            f"| {r['variant']} | {r['route']} | {r['batch']} | {r['context']} | {r['eager']:.1f} | "
            f"{r['compiled']:.1f} | {r['eager'] / r['compiled']:.2f} | {r['compiled'] / r['floor_ms']:.2f} | "
            f"{r['eager'] / r['floor_ms']:.2f} | {r['compile_s']:.0f} |"
            for r in comp
        ],
        "",
        f"Multi-token decode (speculative verification), MLA, {64 if q else 4096} cached tokens, 2 threads, ms "
        "per call with the logits of every new position, weights packed for the call's rows (route taken in "
        "parentheses; x T=1 = against T = 1 on the auto route); floor: the per-operation floor of the call (weights "
        "read once for the B T rows, the cache once, each new token's attention FLOPs, the LM head at every "
        "position) at the best of the bandwidth and matmul peak probed before and after the batch's timing:",
        "",
        "| batch | call | ms | x T=1 | floor ms | floor x T=1 | x floor |",
        "|---:|---|---:|---:|---:|---:|---:|",
        *[
            f"| {b} | {k} | {v['ms']:.1f} | {v['ms'] / first['ms']:.2f} | "
            + (f"{v['floor_ms']:.1f} | {v['floor_ms'] / first['floor_ms']:.2f} | {v['ms'] / v['floor_ms']:.2f} |"
               if v["floor_ms"] else " | | |")
            for b, row in mt.items()
            for first in [next(iter(row.values()))]
            for k, v in row.items()
        ],
        "",
        "Weight GEMMs at small batch, 2 threads, ms (median of interleaved runs): the whole step with the library "
        "products (the few-row kernel off), the weights packed for MKL (`KVLM.pack_for_decode`) or not, and with the "
        "few-row kernel (`kvlm.kernels.few_rows`, what the step runs up to 8 rows); and the GEMMs alone:",
        "",
        "| case | " + " | ".join(next(iter(wp.values())).keys()) + " |",
        "|---|" + "---:|" * len(next(iter(wp.values()))),
        *[
            f"| {k} | " + " | ".join(f"{t:.2f}" for t in row.values()) + " |"
            for k, row in wp.items()
            if k.startswith("step")
        ],
        "",
        "| GEMMs alone | " + " | ".join(wp[next(k for k in wp if k.startswith("GEMMs"))].keys()) + " |",
        "|---|" + "---:|" * len(wp[next(k for k in wp if k.startswith("GEMMs"))]),
        *[
            f"| {k} | " + " | ".join(f"{t:.2f}" for t in row.values()) + " |"
            for k, row in wp.items()
            if k.startswith("GEMMs")
        ],
    ]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    Path(args.out + ".json").write_text(
        json.dumps(
            {"rows": rows, "passes": passes, "steal_s": steal, "multi_token_ms": mt, "weights_packed_ms": wp,
             "compiled": comp, "paired": paired},
            indent=1,
            default=str,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
