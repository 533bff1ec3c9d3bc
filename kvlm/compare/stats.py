"""Statistics over seeds: mean, standard deviation, a 95 % confidence interval, and Welch's t-test.

scipy is not a dependency, so Student's t distribution is computed here from the regularized incomplete beta
function (continued fraction, Numerical Recipes 6.4): two-sided p = I_{df / (df + t^2)}(df / 2, 1 / 2). The
quantile is found by bisection on that CDF. The tests check both against published t-table values.

    summarize(values)  n, mean, std (sample, n - 1), sem, and the t interval mean +- t_{0.975, n-1} * sem
    welch(a, b)        Welch's unequal-variance t-test of mean(a) - mean(b): t, df (Welch-Satterthwaite), p
A difference is "significant" when p < ALPHA (two-sided). Nothing is tested with fewer than two values a side.
"""

from __future__ import annotations

import math
import statistics

ALPHA = 0.05  # two-sided significance level of every verdict; the intervals are 1 - ALPHA = 95 %


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz), Numerical Recipes' betacf."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    # the continued fraction converges fast for x < (a + 1) / (a + b + 2); use the symmetry otherwise
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom (df may be fractional, as Welch's is)."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be positive, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: float) -> float:
    """The q-quantile of Student's t (0.5 < q < 1), e.g. t_quantile(0.975, 2) = 4.303."""
    if not 0.5 < q < 1.0:
        raise ValueError(f"quantile must be in (0.5, 1), got {q}")
    target = 2.0 * (1.0 - q)  # the two-sided tail probability at the quantile
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2.0
    for _ in range(200):  # bisection to float precision: p(t) falls monotonically in t
        mid = 0.5 * (lo + hi)
        if t_two_sided_p(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def summarize(values: list[float]) -> dict:
    """n, mean, sample std, standard error of the mean and the (1 - ALPHA) t interval; std, sem and the
    interval are None for a single value (no spread can be estimated from one seed)."""
    if not values:
        raise ValueError("no values to summarize")
    n = len(values)
    mean = statistics.fmean(values)
    if n < 2:
        return {
            "n": 1,
            "mean": mean,
            "std": None,
            "sem": None,
            "ci_low": None,
            "ci_high": None,
            "ci_half": None,
        }
    std = statistics.stdev(values)
    sem = std / math.sqrt(n)
    half = t_quantile(1.0 - ALPHA / 2.0, n - 1) * sem
    return {
        "n": n,
        "mean": mean,
        "std": std,
        "sem": sem,
        "ci_low": mean - half,
        "ci_high": mean + half,
        "ci_half": half,
    }


def welch(a: list[float], b: list[float]) -> dict | None:
    """Welch's t-test of mean(a) - mean(b): {diff, t, df, p, significant}; None when either side has fewer
    than two values (untestable). Two sides without any spread differ exactly when their means differ."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = ma - mb
    se2 = va + vb
    if se2 == 0.0:
        p = 0.0 if diff != 0.0 else 1.0
        return {"diff": diff, "t": math.copysign(math.inf, diff) if diff else 0.0, "df": None, "p": p,
                "significant": p < ALPHA}  # fmt: skip
    t = diff / math.sqrt(se2)
    df = se2 * se2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    p = t_two_sided_p(t, df)
    return {"diff": diff, "t": t, "df": df, "p": p, "significant": p < ALPHA}
