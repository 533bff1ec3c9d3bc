"""The tables of a `kvlm bench` result (GitHub markdown, what benchmarks/README.md shows) and the derived
comparisons they print: ``peer_ratios`` (kvlm against its transformers peer), ``route_table`` (every decode
route against a baseline variant and against its own naive route), ``pivot`` (one column per context) and
``operations_table`` (the roofline per operation class)."""

from __future__ import annotations

from typing import Any

MIB = 2**20

# table columns: (header, key in the row, or a function of the row)
MODEL_COLUMNS = [
    ("variant", "label"),
    ("params M", lambda m: m["parameters"]["total"] / 1e6),
    ("streamed weights MiB", lambda m: m["streamed_weight_bytes"] / MIB),
    ("KV bytes/token", "kv_bytes_per_token"),
    ("naive KV bytes/token", "naive_kv_bytes_per_token"),
]
DECODE_COLUMNS = [
    ("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch"), ("context", "context"),
    ("ms/step", "median_ms"), ("IQR ms", "iqr_ms"), ("n", "n"), ("tokens/s", "tokens_per_s"),
    ("KV MiB", lambda r: r["kv_cache_bytes"] / MIB), ("+state MiB", lambda r: r["extra_state_bytes"] / MIB),
    ("peak +MiB", lambda r: r["peak_extra_bytes"] / MIB), ("bandwidth floor ms", "floor_ms"),
    ("x bw floor", "roofline_ratio"), ("GFLOP/step", lambda r: r["flops_per_step"] / 1e9),
    ("compute floor ms", "compute_floor_ms"), ("x roofline", "x_roofline"),
]  # fmt: skip
PREFILL_COLUMNS = [
    ("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch"), ("prompt", "prompt"),
    ("ms", "median_ms"), ("IQR ms", "iqr_ms"), ("n", "n"), ("tokens/s", "tokens_per_s"),
    ("peak +MiB", lambda r: r["peak_extra_bytes"] / MIB),
]  # fmt: skip
PEER_COLUMNS = [
    ("variant", "variant"), ("peer", "peer"), ("attention kernel", "attn_implementation"),
    ("max abs logit diff", "max_logit_diff"), ("max abs logit", "logit_scale"), ("agree", "agree"),
    ("note", lambda p: p.get("skipped", "")),
]  # fmt: skip
RATIO_COLUMNS = [
    ("kind", "kind"), ("variant", "variant"), ("kvlm route", "route"), ("batch", "batch"),
    ("length", lambda r: r.get("context", r.get("prompt"))), ("kvlm ms", "kvlm_ms"), ("peer ms", "peer_ms"),
    ("speed-up", lambda r: f"{r['speedup']:.2f}x"),
]  # fmt: skip
ROUTE_COLUMNS = [
    ("batch", "batch"), ("context", "context"), ("variant", "variant"), ("route", "route"), ("ms", "ms"),
    ("baseline ms", "baseline_ms"), ("x baseline", "x_baseline"), ("speed-up over naive", "naive_speedup"),
    ("KV MiB", "kv_mib"), ("+state MiB", "state_mib"), ("peak +MiB", "peak_mib"),
]  # fmt: skip
OPERATION_COLUMNS = [
    ("variant", "variant"), ("route", "route"), ("batch", "batch"), ("context", "context"),
    ("weights MiB", lambda r: r["weight GEMMs"]["bytes"] / MIB),
    ("weights floor ms", lambda r: r["weight GEMMs"]["floor_ms"]),
    ("attention MiB", lambda r: r["attention"]["bytes"] / MIB),
    ("attention GFLOP", lambda r: None if r["attention"]["flops"] is None else r["attention"]["flops"] / 1e9),
    ("attention FLOP/byte", lambda r: r["attention"]["flops_per_byte"]),
    ("attention floor ms", lambda r: r["attention"]["floor_ms"]),
    ("LM head floor ms", lambda r: r["LM head"]["floor_ms"]),
    ("sum of floors ms", lambda r: sum(c["floor_ms"] for c in r["operations"].values())),
    ("ms/step", "median_ms"),
    ("x floor", lambda r: r["median_ms"] / sum(c["floor_ms"] for c in r["operations"].values())),
    ("weights x floor", lambda r: r["weight GEMMs"].get("x_floor")),
    ("attention x floor", lambda r: r["attention"].get("x_floor")),
    ("LM head x floor", lambda r: r["LM head"].get("x_floor")),
]  # fmt: skip


def table(columns: list[tuple[str, Any]], rows: list[dict]) -> list[str]:
    """A GitHub markdown table; numbers right-aligned, booleans as yes / **NO**."""
    cells = [[col(r) if callable(col) else r.get(col) for _, col in columns] for r in rows]
    numeric = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in cells[0]] if cells else []
    align = ["---:" if i and numeric and numeric[i] else "---" for i in range(len(columns))]
    out = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in cells]
    return out


def cell(v: Any) -> str:
    """A table cell: 3 significant digits below 10, one decimal below 1000, integers above; None as -."""
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "**NO**", None: "-"}[v]
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def markdown(result: dict) -> str:
    """Result tables (GitHub markdown): what benchmarks/README.md shows."""
    hw, mc, st = result["hardware"], result["machine"], result["settings"]
    lines = [
        f"{result['date']}; {mc['cpu']}, {mc['cores']} cores ({mc['threads']} torch threads), torch {mc['torch']}, "
        f"transformers {mc['transformers']}; {st['device']}, {st['dtype']}; load average at start "
        f"{_load(mc.get('load_average'))}, at end {_load(result.get('load_average_end'))}.",
        f"Bandwidth: copy {hw['copy_gbs']:.1f} GB/s, read {hw['read_gbs']:.1f} GB/s (floors use "
        f"{hw['bandwidth_gbs']:.1f}); fp32 matmul {hw['matmul_fp32_gflops']:.0f} GFLOP/s (best of the "
        f"measurements at start: {_hw(hw.get('start'))} and end: {_hw(hw.get('end'))}).",
        "",
    ]
    lines += table(MODEL_COLUMNS, [{"label": k, **m} for k, m in result["models"].items()])
    if len(result["settings"]["context"]) > 1:
        for title, key in (
            ("ms per decode step", "median_ms"),
            ("measured / bandwidth floor", "roofline_ratio"),
        ):
            columns, rows = pivot(result["decode"], key)
            lines += ["", f"Decode against context length, {title}:", ""] + table(columns, rows)
    lines += ["", "Decode, per step (median of the n timed steps, IQR = spread); floors: bytes that must be read "
              "/ bandwidth, and counted FLOPs / matmul throughput:", ""]  # fmt: skip
    lines += table(DECODE_COLUMNS, sorted(result["decode"], key=lambda r: (r["batch"], r["context"])))
    lines += ["", "Prefill (median of n repeats):", ""]
    lines += table(PREFILL_COLUMNS, sorted(result["prefill"], key=lambda r: (r["batch"], r["prompt"])))
    baseline = _baseline(result)
    sections = [
        ("Peers (logits checked against kvlm before timing):", PEER_COLUMNS, result["peers"]),
        ("kvlm speed-up over transformers (peer time / kvlm time):", RATIO_COLUMNS, result["ratios"]),
        (
            f"Decode routes side by side: x baseline = time / the fastest route of {baseline} at the same batch "
            "and context; speed-up over naive = the same variant's naive time / this time:",
            ROUTE_COLUMNS,
            route_table(result),
        ),
        (
            "Roofline per operation class at the longest context (floors: bytes / bandwidth or FLOPs / matmul "
            "throughput, the larger; attention from the mechanism's decode cost for the route):",
            OPERATION_COLUMNS,
            operations_table(result),
        ),
    ]
    for title, columns, rows in sections:
        if rows:
            lines += ["", title, ""] + table(columns, rows)
    return "\n".join(lines)


def pivot(decode: list[dict], key: str) -> tuple[list, list[dict]]:
    """One row per (variant, impl, route, batch), one column per context: the value ``key``."""
    contexts = sorted({r["context"] for r in decode})
    rows: dict[tuple, dict] = {}
    for r in decode:
        ident = (r["batch"], r["variant"], r["impl"], r["route"])
        rows.setdefault(ident, dict(zip(("batch", "variant", "impl", "route"), ident)))[r["context"]] = r[key]
    columns = [("variant", "variant"), ("impl", "impl"), ("route", "route"), ("batch", "batch")]
    return columns + [(f"L={c}", c) for c in contexts], [rows[k] for k in sorted(rows, key=lambda k: k[0])]


def _hw(h: dict | None) -> str:
    return f"{h['bandwidth_gbs']:.1f} GB/s, {h['matmul_fp32_gflops']:.0f} GFLOP/s" if h else "?"


def _load(avg) -> str:
    return "/".join(f"{x:.1f}" for x in avg) if avg else "?"


def peer_ratios(decode: list[dict], prefill: list[dict]) -> list[dict]:
    """kvlm's speed-up over its peer (peer time / kvlm time) for every kvlm row that has a peer row."""
    out = []
    for kind, rows, key in (("decode", decode, "context"), ("prefill", prefill, "prompt")):
        peer = {(r["variant"], r["batch"], r[key]): r for r in rows if r["impl"] != "kvlm"}
        for r in rows:
            p = peer.get((r["variant"], r["batch"], r[key]))
            if r["impl"] != "kvlm" or p is None:
                continue
            out.append(
                {
                    "kind": kind,
                    "variant": r["variant"],
                    "mode": r["mode"],
                    "route": r["route"],
                    "batch": r["batch"],
                    key: r[key],
                    "peer": p["impl"],
                    "kvlm_ms": r["median_ms"],
                    "peer_ms": p["median_ms"],
                    "speedup": p["median_ms"] / r["median_ms"],
                }
            )
    return out


def _baseline(result: dict) -> str | None:
    baseline = result.get("settings", {}).get("baseline")
    return baseline if baseline in result["models"] else next(iter(result["models"]), None)


def route_table(result: dict) -> list[dict]:
    """Every kvlm decode row next to the baseline variant's fastest route at the same batch and context
    (``x_baseline`` = ms / baseline ms) and to its own variant's naive route (``naive_speedup`` = naive ms /
    ms, None without one), with its memory; sorted by batch and context."""
    kvlm = [r for r in result["decode"] if r["impl"] == "kvlm"]
    baseline = _baseline(result)
    fastest: dict[tuple, dict] = {}
    for r in kvlm:
        key = (r["batch"], r["context"])
        if r["variant"] == baseline and (key not in fastest or r["median_ms"] < fastest[key]["median_ms"]):
            fastest[key] = r
    naive = {(r["variant"], r["batch"], r["context"]): r for r in kvlm if r["mode"] == "naive"}
    out = []
    for r in kvlm:
        base = fastest.get((r["batch"], r["context"]))
        if base is None:
            continue
        own_naive = naive.get((r["variant"], r["batch"], r["context"]))
        out.append(
            {
                "batch": r["batch"],
                "context": r["context"],
                "variant": r["variant"],
                "route": r["route"],
                "ms": r["median_ms"],
                "baseline": f"{base['variant']} {base['route']}",
                "baseline_ms": base["median_ms"],
                "x_baseline": r["median_ms"] / base["median_ms"],
                "naive_speedup": own_naive["median_ms"] / r["median_ms"] if own_naive else None,
                "kv_mib": r["kv_cache_bytes"] / MIB,
                "state_mib": r["extra_state_bytes"] / MIB,
                "peak_mib": r["peak_extra_bytes"] / MIB,
            }
        )
    return sorted(out, key=lambda r: (r["batch"], r["context"]))


def operations_table(result: dict) -> list[dict]:
    """The kvlm decode rows at each (variant, route, batch)'s longest context, with their operation
    classes flattened into the row (``row[class]``) for the table."""
    rows = [r for r in result["decode"] if r["impl"] == "kvlm" and r.get("operations")]
    longest: dict[tuple, dict] = {}
    for r in rows:
        key = (r["variant"], r["route"], r["batch"])
        if key not in longest or r["context"] > longest[key]["context"]:
            longest[key] = r
    return [
        {**r, **r["operations"]} for r in sorted(longest.values(), key=lambda r: (r["batch"], r["context"]))
    ]
