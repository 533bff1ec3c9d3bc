"""The report's answers: one sentence per question, from the aggregated rows (``aggregate``) and the meta.

data      what the models were trained on (synthetic stories are said to be not real text)
budget    training tokens per run, seeds, and the parameters against the baseline's (gate tables apart)
pareto    which variants are on the Pareto front of validation loss against KV bytes per token
noise     which differences from the baseline are significant and which are within seed noise
cost      the cache at the deployment point and the projected decode at the reference size
"""

from __future__ import annotations

from kvlm.compare.stats import ALPHA

MIB = 2**20


def _p(x: float | None) -> str:
    if x is None:
        return "p n/a"
    return "p < 0.001" if x < 0.001 else f"p = {x:.3f}"


def _count(n: int) -> str:
    """Parameters: millions when large, the exact count when small."""
    return f"{n / 1e6:.3f} M" if n >= 100_000 else f"{n:,}"


def _names(items: list[str]) -> str:
    return ", ".join(items) if items else "none"


def data_sentence(meta: dict) -> str:
    if meta.get("synthetic"):
        return (
            f"Data: {meta['data']}. These are templated, machine-generated stories (not real text): they check "
            "the machinery and rank mechanisms on an easy language; run `kvlm compare --data PATH` on real text "
            "before drawing conclusions about language modelling."
        )
    return f"Data: {meta['data']}."


def budget_sentence(rows: list[dict], meta: dict) -> str:
    tokens = meta.get("train_tokens_per_run") or []
    tok = (
        f"{tokens[0]:,} training tokens"
        if len(tokens) == 1
        else f"{_names([f'{t:,}' for t in tokens])} training tokens (budgets differ!)"
    )
    n = sorted({r["n_seeds"] for r in rows})
    seeds = f"{n[0]} seed{'s' if n[0] > 1 else ''}" if len(n) == 1 else f"{n[0]}-{n[-1]} seeds"
    ratios = [r["params_ratio_vs_baseline"] for r in rows]
    base = next(r for r in rows if r["is_baseline"])
    gate = [r for r in rows if r["params_gate_embedding"]]
    gate_text = (
        " Gate-embedding tables (counted in the total, not in non-embedding): "
        + ", ".join(f"{r['label']} {_count(r['params_gate_embedding'])}" for r in gate)
        + "."
        if gate
        else ""
    )
    return (
        f"Budget: every run trained on {tok} ({meta['budget']}), {seeds} per variant; total parameters are "
        f"{min(ratios):.3f}-{max(ratios):.3f} x the baseline {base['label']}'s {_count(base['params_total'])} "
        f"(sizing: {meta['match']}).{gate_text}"
    )


def pareto_sentence(rows: list[dict]) -> str:
    front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["kv_bytes_per_token"])
    dominated = [r for r in rows if not r["pareto"]]
    front_text = _names(
        [f"{r['label']} ({r['kv_bytes_per_token']:,} B/token, loss {r['val_loss']:.4f})" for r in front]
    )
    dom_text = _names([f"{r['label']} (by {r['dominated_by']})" for r in dominated])
    if front and front[0]["pareto_tested"]:
        rule = (
            "a variant is dominated only by one that caches no more bytes and has a significantly lower loss, "
            f"Welch's t-test over seeds at p < {ALPHA}"
        )
    else:
        rule = "one seed, so nothing is tested: dominance by the mean losses alone"
    return f"Pareto front of validation loss against KV bytes per token ({rule}): {front_text}. Dominated: {dom_text}."


def noise_sentence(rows: list[dict]) -> str:
    base = next(r for r in rows if r["is_baseline"])
    others = [r for r in rows if not r["is_baseline"]]
    if any(r["vs_baseline"]["verdict"] == "not tested" for r in others) or base["n_seeds"] < 2:
        return (
            f"One seed per variant: differences from the baseline {base['label']} are not tested and may be seed "
            "noise (run with at least --seeds 0,1,2)."
        )

    def item(r):
        return f"{r['label']} ({r['val_loss_delta_pct']:+.2f} %, {_p(r['vs_baseline'].get('p'))})"

    groups = {
        w: [item(r) for r in others if r["vs_baseline"]["verdict"] == w]
        for w in ("better", "worse", "within seed noise")
    }
    return (
        f"Against the baseline {base['label']} (Welch's t-test over {base['n_seeds']} seeds, p < {ALPHA}, no "
        f"correction for the {len(others)} comparisons): significantly lower loss: {_names(groups['better'])}; "
        f"significantly higher: {_names(groups['worse'])}; within seed noise: {_names(groups['within seed noise'])}."
    )


def cost_sentence(rows: list[dict], meta: dict) -> str:
    batch, context = meta["deploy"]["batch"], meta["deploy"]["context"]
    base = next(r for r in rows if r["is_baseline"])
    small = min(rows, key=lambda r: r["kv_bytes_per_token"])
    text = (
        f"Cost: at batch {batch} x {context:,} tokens of context the bf16 cache of the trained models is "
        f"{base['deploy_cache_bytes']['bf16'] / MIB:,.1f} MiB for {base['label']} and "
        f"{small['deploy_cache_bytes']['bf16'] / MIB:,.1f} MiB for {small['label']} (the smallest, "
        f"{base['kv_bytes_per_token'] / small['kv_bytes_per_token']:.1f}x less)"
    )
    if base.get("reference") and meta.get("hardware"):
        parts = []
        for hw in meta["hardware"]:
            b = base["reference"]["projection"][hw["name"]]["ms_per_token"]
            s = small["reference"]["projection"][hw["name"]]["ms_per_token"]
            parts.append(f"{hw['name']} {b:.3g} vs {s:.3g} ms/token")
        text += (
            "; at the reference size (6 layers, d = 768, same mechanism ratios) the projected decode floor is "
            + ", ".join(parts)
            + f" ({base['label']} vs {small['label']})"
        )
    return text + "."


def answers(rows: list[dict], meta: dict) -> list[str]:
    """The report's sentences, in the order of the questions."""
    return [
        pareto_sentence(rows),
        noise_sentence(rows),
        budget_sentence(rows, meta),
        cost_sentence(rows, meta),
        data_sentence(meta),
    ]
