"""From runs to rows: one row per variant with the mean (and spread) over seeds, its KV reduction and loss
change against the first MHA variant, whether it is within noise of the best loss, and whether it is on the
Pareto front of validation loss against KV bytes per token.

Definitions (tested against hand-computed values in tests/test_compare.py):
    kv_reduction_vs_first_mha = 1 - kv_bytes / kv_bytes(MHA)            (0.75: a quarter of MHA's cache)
    val_loss_delta_pct        = 100 * (val_loss / val_loss(MHA) - 1)     (negative: better than MHA)
    within_noise_of_best      = gap to the best loss <= 2 * hypot(noise, noise of the best), where noise is
                                std over seeds / sqrt(seeds), or the validation standard error for one seed
    pareto                    = no other variant has <= KV bytes and <= loss with one of them strictly less
"Mean" perplexity is the mean of the runs' perplexities (exp of each run's loss), not exp of the mean loss.
"""

from __future__ import annotations

import math
import statistics

KV_DTYPE_BYTES = 2  # bytes per cached element in the report: bf16, how the papers and deployments count


def aggregate(results: list[dict]) -> list[dict]:
    """One row per variant: mean and std over seeds of the quality and speed numbers."""
    rows = []
    labels = list(dict.fromkeys(r["label"] for r in results))
    for label in labels:
        rs = [r for r in results if r["label"] == label]
        losses = [r["val_loss"] for r in rs]
        row = {
            "label": label,
            "attention": rs[0]["attention"],
            "seeds": [r["seed"] for r in rs],
            "params_total": rs[0]["params"]["total"],
            "params_activated": rs[0]["params"]["activated"],
            "params_embedding": rs[0]["params"]["embedding"] + rs[0]["params"]["gate_embedding"],
            "kv_elements_per_token": rs[0]["kv_elements_per_token"],
            "kv_bytes_per_token": rs[0]["kv_bytes_per_token"],
            "val_loss": statistics.fmean(losses),
            "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else None,
            "val_loss_stderr": statistics.fmean([r["val_loss_stderr"] or 0.0 for r in rs]),
            "val_perplexity": statistics.fmean([r["val_perplexity"] for r in rs]),
            "prefill_ms": statistics.fmean([r["prefill_ms"] for r in rs]),
            "train_tokens_per_s": statistics.fmean([r["train_tokens_per_s"] for r in rs]),
            "decode_tokens_per_s": {
                ctx: statistics.fmean(
                    [r["decode_tokens_per_s"][ctx] for r in rs if ctx in r["decode_tokens_per_s"]]
                )
                for ctx in rs[0]["decode_tokens_per_s"]
            },
            "distinct_2": _mean_of(r["repetition"].get("distinct_2") for r in rs),
            "repeated_4gram_rate": _mean_of(r["repetition"].get("rep_4") for r in rs),
        }
        rows.append(row)
    mha = next((r for r in rows if r["attention"] == "mha"), rows[0])
    for r in rows:
        r["kv_reduction_vs_first_mha"] = 1 - r["kv_bytes_per_token"] / mha["kv_bytes_per_token"]
        r["val_loss_delta_pct"] = 100 * (r["val_loss"] / mha["val_loss"] - 1)
    _mark_noise(rows)
    _mark_pareto(rows)
    return rows


def _mean_of(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def _noise(row: dict) -> float:
    """One standard deviation of a variant's mean loss: across seeds when there are several, else the
    standard error of the validation estimate (which ignores seed-to-seed training noise)."""
    n = len(row["seeds"])
    if row["val_loss_std"] is not None:
        return row["val_loss_std"] / math.sqrt(n)
    return row["val_loss_stderr"] or 0.0


def _mark_noise(rows: list[dict]) -> None:
    best = min(rows, key=lambda r: r["val_loss"])
    for r in rows:
        gap = r["val_loss"] - best["val_loss"]
        sigma = math.hypot(_noise(r), _noise(best))
        r["within_noise_of_best"] = r is best or (sigma > 0 and gap <= 2 * sigma)


def _mark_pareto(rows: list[dict]) -> None:
    for r in rows:
        r["pareto"] = not any(
            o is not r
            and o["kv_bytes_per_token"] <= r["kv_bytes_per_token"]
            and o["val_loss"] <= r["val_loss"]
            and (o["kv_bytes_per_token"] < r["kv_bytes_per_token"] or o["val_loss"] < r["val_loss"])
            for o in rows
        )
