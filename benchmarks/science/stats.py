"""Statistics of the science page: per-variant mean, standard deviation and t-interval over seeds, and the
difference of two variants (Welch's t-interval; seeds are independent runs, not pairs)."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats


def summarize(xs: list[float], level: float = 0.95) -> dict:
    """n, mean, sample std (n - 1) and the two-sided t-interval of the mean."""
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci": None}
    mean = float(np.mean(xs))
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "ci": None}
    std = float(np.std(xs, ddof=1))
    lo, hi = stats.t.interval(level, n - 1, loc=mean, scale=std / math.sqrt(n)) if std else (mean, mean)
    return {"n": n, "mean": mean, "std": std, "ci": [float(lo), float(hi)]}


def difference(a: list[float], b: list[float], level: float = 0.95) -> dict | None:
    """mean(a) - mean(b) with Welch's t-interval and p-value (scipy's ttest_ind, equal_var=False); rel is the
    difference relative to mean(b). None unless both have >= 2 values."""
    if len(a) < 2 or len(b) < 2:
        return None
    diff = float(np.mean(a) - np.mean(b))
    rel = diff / float(np.mean(b))
    if np.std(a) == 0 and np.std(b) == 0:  # no spread: the t statistic is undefined
        return {"diff": diff, "ci": [diff, diff], "p": 0.0 if diff else 1.0, "rel": rel}
    t = stats.ttest_ind(a, b, equal_var=False)
    ci = t.confidence_interval(level)
    return {"diff": diff, "ci": [float(ci.low), float(ci.high)], "p": float(t.pvalue), "rel": rel}


def verdict(d: dict | None, margin: float = 0.0) -> str:
    """Words for a difference a - b of losses (lower is better): whether a is worse, better or the two are
    within seed noise (the interval covers 0). With a relative margin: 'within margin' when the whole
    interval lies inside +- margin * mean(b)."""
    if d is None:
        return "too few seeds"
    lo, hi = d["ci"]
    base = d["diff"] / d["rel"] if d["rel"] else 0.0
    if margin and -margin * base <= lo and hi <= margin * base:
        return f"within {margin:.0%}"
    if lo > 0:
        return "worse"
    if hi < 0:
        return "better"
    return "within seed noise"
