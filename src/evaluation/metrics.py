"""Table arithmetic (docs/method.md#metrics) with standard errors, and aggregation over seeds.

    AVG       = mean over tasks of the task scores (percent)
    se(AVG)   = sqrt(sum_task se_task^2) / n_tasks          (tasks are independent samples)
    Rec. Perf = AVG / AVG_baseline * 100
    se(Rec)   = Rec * sqrt((se_AVG / AVG)^2 + (se_AVG_base / AVG_base)^2)    (delta method)
    Delta_LA  = AVG(hybrid) - AVG(swa_only)                  (points)
    se(Delta) = sqrt(se_AVG(hybrid)^2 + se_AVG(swa_only)^2)

The two modes of Delta_LA are scored on the same documents, so their errors are positively
correlated and this standard error is conservative (too wide). When lm-eval's per-document
scores are at hand, the paired standard error is reported too and used for the verdict:

    se_paired(Delta) = sqrt(sum_task se(mean_i (x_hybrid,i - x_swa_only,i))^2) / n_tasks

with ``se(mean d) = sd(d, ddof=1) / sqrt(n)``, the same estimator lm-eval uses for accuracy.
A missing per-task stderr (``None``/NaN) makes the derived stderr ``None``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "avg",
    "avg_stderr",
    "delta",
    "paired_delta_stderr",
    "rec_perf",
    "seed_summary",
]


def _finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def avg(scores: Sequence[float]) -> float:
    """Plain mean of task scores."""
    if not scores:
        raise ValueError("AVG of no tasks is undefined")
    return sum(scores) / len(scores)


def avg_stderr(stderrs: Sequence[float | None]) -> float | None:
    """sqrt(sum se^2) / n; ``None`` if any task has no stderr."""
    if not stderrs or not all(_finite(s) for s in stderrs):
        return None
    return math.sqrt(sum(s * s for s in stderrs)) / len(stderrs)


def rec_perf(value: float, base: float, se: float | None = None,
             base_se: float | None = None) -> tuple[float, float | None]:
    """(AVG / base * 100, its delta-method stderr or ``None``)."""
    if base == 0:
        raise ValueError("Rec. Perf is undefined for a baseline AVG of 0")
    r = value / base * 100.0
    if not (_finite(se) and _finite(base_se)) or value == 0:
        return r, None
    return r, abs(r) * math.sqrt((se / value) ** 2 + (base_se / base) ** 2)


def delta(a: float, b: float, se_a: float | None = None,
          se_b: float | None = None) -> tuple[float, float | None]:
    """(a - b, sqrt(se_a^2 + se_b^2) or ``None``)."""
    if _finite(se_a) and _finite(se_b):
        return a - b, math.sqrt(se_a ** 2 + se_b ** 2)
    return a - b, None


def paired_delta_stderr(a: Sequence[dict | None], b: Sequence[dict | None]) -> float | None:
    """Paired stderr (points) of AVG(a) - AVG(b) from per-document values in [0, 1].

    ``a`` and ``b`` hold one ``{doc_key: value}`` per task, in the same task order; ``None`` if a
    task lacks them or the two modes were not scored on the same documents.
    """
    if not a or len(a) != len(b):
        return None
    ses = []
    for da, db in zip(a, b):
        if not da or not db or set(da) != set(db) or len(da) < 2:
            return None
        d = [100.0 * (da[k] - db[k]) for k in da]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
        ses.append(sd / math.sqrt(len(d)))
    return math.sqrt(sum(s * s for s in ses)) / len(ses)


# two-sided 95% Student-t quantiles by degrees of freedom (1..30); normal beyond
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def seed_summary(values: Sequence[float]) -> dict:
    """Mean, sample std (ddof=1) and a 95% t confidence interval of one number over seeds.

    With one seed, std and the interval are ``None``.
    """
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "std": None, "ci95": None, "n": len(values), "values": values}
    std = statistics.stdev(values)
    df = len(values) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.960
    half = t * std / math.sqrt(len(values))
    return {"mean": mean, "std": std, "ci95": [mean - half, mean + half], "n": len(values),
            "values": values}
