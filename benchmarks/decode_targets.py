"""Issue 15's targets ("What the numbers must show") checked against one run of benchmarks/decode_limit.py: a
markdown table of each target, what the run measured and whether it is met. decode_limit.py puts it at the top of
its page; for a saved run:

    python benchmarks/decode_targets.py benchmarks/decode-limit.json
"""

from __future__ import annotations

import argparse
import json

FLOOR_X = 1.3  # "within 1.3x of the per-operation floor"
NAIVE_X = 2.0  # "absorbed MLA at least 2x faster than naive MLA"
T4_X = 2.0  # "T = 4 new tokens costs less than 2x T = 1"
BIG, LONG, MT_CONTEXT = (8, 4096), (1, 8192), 4096  # the cells: batch / cached tokens
VARIANTS = [("MHA", "mha", "plain"), ("GQA", "gqa", "plain"), ("MLA absorbed", "mla", "absorbed")]
PEERS = {"Llama MHA": ("LlamaForCausalLM", "mha"), "Llama GQA": ("LlamaForCausalLM", "gqa"),
         "DeepseekV3": ("DeepseekV3ForCausalLM", "mla")}  # fmt: skip


def step_floor(row: dict) -> float | None:
    """The step's per-operation floor: the sum of its operation classes' floors (as the page's rows)."""
    ops = row.get("operations") or {}
    return sum(o["floor_ms"] for o in ops.values()) if ops else None


def _kvlm(rows: list[dict], variant: str, route: str, batch: int, context: int, threads: int) -> dict | None:
    for r in rows:
        if (r["impl"] == "kvlm" and r.get("kernels") and r["variant"].startswith(variant) and r["route"] == route
                and (r["batch"], r["context"], r["threads"]) == (batch, context, threads)):  # fmt: skip
            return r
    return None


def _paired(paired: list[dict], variant: str, batch: int, context: int, threads: int) -> dict | None:
    for p in paired:
        if p["variant"].startswith(variant) and (p["batch"], p["context"], p["threads"]) == (batch, context, threads):  # fmt: skip
            return p
    return None


def _row(target: str, cell: str, measured: str, met: bool | None, why: str = "") -> dict:
    return {"target": target, "cell": cell, "measured": measured, "met": met, "why": why}


def targets(
    rows: list[dict],
    paired: list[dict],
    multi_token: dict,
    big: tuple[int, int] = BIG,
    long: tuple[int, int] = LONG,
    mt_context: int = MT_CONTEXT,
) -> list[dict]:
    """One entry per target and cell: {"target", "cell", "measured", "met" (None: not measured), "why"}. ``big``
    and ``long``: the (batch, cached tokens) cells of the run (decode_limit.py --quick runs smaller ones)."""
    out = []
    for name, variant, route in VARIANTS:
        for batch, context in (big, long):
            r = _kvlm(rows, variant, route, batch, context, 2)
            p = _paired(paired, variant, batch, context, 2)
            floor = step_floor(r) if r else None
            best = r["median_ms"] / floor if floor else None
            xp = p["x_floor"] if p else None
            shown = [f"best pass {best:.2f}" if best else "", f"paired {xp:.2f}" if xp else ""]
            measured = [x for x in (best, xp) if x is not None]
            met = all(x <= FLOOR_X for x in measured) if measured else None
            why = "met by the best pass only" if not met and best and best <= FLOOR_X else ""
            out.append(_row(f"within {FLOOR_X}x of the floor", f"{name}, batch {batch} / {context}",
                            ", ".join(s for s in shown if s), met, why))  # fmt: skip
    absorbed = _kvlm(rows, "mla", "absorbed", *big, 2)
    naive = _kvlm(rows, "mla", "materialised", *big, 2)
    if absorbed and naive:
        x = naive["median_ms"] / absorbed["median_ms"]
        out.append(_row(f"absorbed MLA >= {NAIVE_X}x faster than naive", f"batch {big[0]} / {big[1]}",
                        f"{naive['median_ms']:.1f} / {absorbed['median_ms']:.1f} ms = {x:.2f}x", x >= NAIVE_X))  # fmt: skip
    for name, variant, route in VARIANTS:
        two, one = _kvlm(rows, variant, route, *long, 2), _kvlm(rows, variant, route, *long, 1)
        if two and one:
            x = one["median_ms"] / two["median_ms"]
            out.append(_row("batch 1: 2 threads faster than 1", f"{name}, batch {long[0]} / {long[1]}",
                            f"{one['median_ms']:.1f} / {two['median_ms']:.1f} ms = {x:.2f}x", x > 1.0))  # fmt: skip
    for batch, calls in multi_token.items():
        t1 = next((v for k, v in calls.items() if k.startswith("T=1 auto")), None)
        t4 = next((v for k, v in calls.items() if k.startswith("T=4 auto")), None)
        if t1 and t4:
            x = t4["ms"] / t1["ms"]
            floor_x = t4["floor_ms"] / t1["floor_ms"] if t4.get("floor_ms") and t1.get("floor_ms") else None
            why = ""
            if x >= T4_X and floor_x is not None and floor_x >= T4_X:
                why = f"the floor itself is {floor_x:.2f}x: T = 4 is 4x the compute-bound attention's FLOPs"
            shown = f"{x:.2f}x" + (f" (floor {floor_x:.2f}x)" if floor_x is not None else "")
            out.append(
                _row(f"MLA T = 4 < {T4_X}x T = 1", f"batch {batch} / {mt_context}", shown, x < T4_X, why)
            )
    found = []
    for label, (cls, variant) in PEERS.items():
        r = next((r for r in rows if r["impl"].endswith(cls) and r["variant"].startswith(variant)), None)
        found.append(f"{label} {r['median_ms']:.0f} ms" if r else f"{label} missing")
    out.append(_row("transformers' peers in the same run", f"batch {big[0]} / {big[1]}", ", ".join(found),
                    all(not f.endswith("missing") for f in found)))  # fmt: skip
    return out


def table(entries: list[dict]) -> list[str]:
    """Markdown lines: target, cell, measured, verdict."""
    lines = ["| target | cell | measured | met |", "|---|---|---|---|"]
    for e in entries:
        verdict = "not measured" if e["met"] is None else ("yes" if e["met"] else "**no**")
        if e["why"]:
            verdict += f" ({e['why']})"
        lines.append(f"| {e['target']} | {e['cell']} | {e['measured']} | {verdict} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a decode_limit.py JSON (its --out path + .json)")
    args = ap.parse_args()
    with open(args.run) as f:
        run = json.load(f)
    print("\n".join(table(targets(run["rows"], run.get("paired", []), run.get("multi_token_ms", {})))))


if __name__ == "__main__":
    main()
