"""From runs to rows: one row per variant with its validation loss over seeds (mean, std, 95 % t interval), its
budget (training tokens, parameters), its cache (KV bytes per token per dtype), a verdict against the baseline
and whether it is on the Pareto front of validation loss against KV bytes per token.

Definitions (tested against hand-computed values in tests/test_compare_stats.py):
    baseline                  the variant named by ``baseline``; default the first MHA variant, else the first
    kv_reduction_vs_baseline  1 - kv_bytes / kv_bytes(baseline)            (0.75: a quarter of its cache)
    val_loss_delta_pct        100 * (val_loss / val_loss(baseline) - 1)   (negative: lower loss)
    vs_baseline               Welch's t-test of the seeds' losses against the baseline's (kvlm.compare.stats):
                              "better" / "worse" when p < 0.05, "within seed noise" otherwise, "not tested"
                              with fewer than two seeds on either side
    pareto                    no other variant caches no more bytes per token AND has a significantly lower loss
                              (Welch, p < 0.05). With one seed nothing is tested (``pareto_tested`` False):
                              classical dominance by the means (no more bytes, no higher loss, one strictly)
"Mean" perplexity is the mean of the runs' perplexities (exp of each run's loss), not exp of the mean loss.
"""

from __future__ import annotations

import statistics

from kvlm.compare.costs import HEADLINE_DTYPE
from kvlm.compare.stats import summarize, welch
from kvlm.config import ConfigError


def choose_baseline(labels_attention: list[tuple[str, str]], baseline: str | None) -> str:
    """The baseline label: ``baseline`` if given (it must be a variant), else the first MHA, else the first."""
    labels = [label for label, _ in labels_attention]
    if baseline is not None:
        if baseline not in labels:
            raise ConfigError(
                f"--baseline {baseline!r} is not a variant of this comparison: {', '.join(labels)}"
            )
        return baseline
    return next((label for label, att in labels_attention if att == "mha"), labels[0])


def aggregate(results: list[dict], baseline: str | None = None) -> list[dict]:
    """One row per variant (in the order of ``results``), compared with ``baseline`` (see module docstring)."""
    labels = list(dict.fromkeys(r["label"] for r in results))
    rows = [_row([r for r in results if r["label"] == label]) for label in labels]
    base_label = choose_baseline([(r["label"], r["attention"]) for r in rows], baseline)
    base = next(r for r in rows if r["label"] == base_label)
    for r in rows:
        r["baseline"] = base_label
        r["is_baseline"] = r is base
        r["kv_reduction_vs_baseline"] = 1 - r["kv_bytes_per_token"] / base["kv_bytes_per_token"]
        r["val_loss_delta_pct"] = 100 * (r["val_loss"] / base["val_loss"] - 1)
        r["params_ratio_vs_baseline"] = r["params_total"] / base["params_total"]
        test = None if r is base else welch(r["losses"], base["losses"])
        r["vs_baseline"] = _verdict(test) if r is not base else {"verdict": "baseline"}
    _mark_pareto(rows)
    best = min(rows, key=lambda r: r["val_loss"])
    for r in rows:
        test = welch(r["losses"], best["losses"])
        r["within_noise_of_best"] = r is best or (test is not None and not test["significant"])
    return rows


def _row(rs: list[dict]) -> dict:
    first = rs[0]
    losses = [r["val_loss"] for r in rs]
    s = summarize(losses)
    p = first["params"]
    return {
        "label": first["label"],
        "attention": first["attention"],
        "seeds": [r["seed"] for r in rs],
        "n_seeds": len(rs),
        "losses": losses,
        "train_tokens": sorted({r["train_tokens"] for r in rs}) if "train_tokens" in first else [],
        "params_total": p["total"],
        "params_activated": p["activated"],
        "params_embedding": p["embedding"],
        "params_gate_embedding": p["gate_embedding"],
        "params_non_embedding": p["total"] - p["embedding"] - p["gate_embedding"],
        "kv_elements_per_token": first["kv_elements_per_token"],
        "kv_bytes_per_token": first["kv_bytes_per_token"],
        "kv_bytes_per_token_by_dtype": first.get(
            "kv_bytes_per_token_by_dtype", {HEADLINE_DTYPE: first["kv_bytes_per_token"]}
        ),
        "val_loss": s["mean"],
        "val_loss_std": s["std"],
        "val_loss_sem": s["sem"],
        "val_loss_ci95": [s["ci_low"], s["ci_high"]] if s["std"] is not None else None,
        "val_loss_stderr": statistics.fmean([r.get("val_loss_stderr") or 0.0 for r in rs]),
        "val_perplexity": statistics.fmean([r["val_perplexity"] for r in rs]),
        "distinct_2": _mean_of(r.get("repetition", {}).get("distinct_2") for r in rs),
        "repeated_4gram_rate": _mean_of(r.get("repetition", {}).get("rep_4") for r in rs),
        "tiny_speed": next((r["tiny_speed"] for r in rs if r.get("tiny_speed")), None),
        "train_tokens_per_s": statistics.fmean([r.get("train_tokens_per_s", 0.0) for r in rs]),
    }


def _mean_of(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _verdict(test: dict | None) -> dict:
    if test is None:
        return {"verdict": "not tested"}
    if not test["significant"]:
        word = "within seed noise"
    else:
        word = "better" if test["diff"] < 0 else "worse"  # lower loss is better
    return {"verdict": word, **test}


def significantly_lower(a: dict, b: dict) -> bool | None:
    """Is a's loss significantly below b's (Welch, p < 0.05)? None when untestable (one seed a side)."""
    test = welch(a["losses"], b["losses"])
    if test is None:
        return None
    return test["significant"] and test["diff"] < 0


def _mark_pareto(rows: list[dict]) -> None:
    tested = all(r["n_seeds"] >= 2 for r in rows)
    for r in rows:
        r["pareto_tested"] = tested
        r["dominated_by"] = None
        for o in sorted(rows, key=lambda o: (o["kv_bytes_per_token"], o["val_loss"])):
            if o is r or o["kv_bytes_per_token"] > r["kv_bytes_per_token"]:
                continue
            lower = significantly_lower(o, r)
            if lower is None:  # one seed: classical dominance by the means (a tie goes to the smaller cache)
                fewer = o["kv_bytes_per_token"] < r["kv_bytes_per_token"]
                lower = o["val_loss"] < r["val_loss"] or (fewer and o["val_loss"] == r["val_loss"])
            if lower:
                r["dominated_by"] = o["label"]
                break
        r["pareto"] = r["dominated_by"] is None
