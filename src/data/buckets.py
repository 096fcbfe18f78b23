"""Distance buckets: the one definition every recall evaluation groups its answers by.

A recall's *distance* is how many positions the prediction must look back to the fact (the
data modules' convention: the answer at position ``p`` is predicted from ``p - 1``; a causal
window of ``w`` keys contains the fact exactly when ``distance < w``). Two families of buckets:

- **relative to a window** ``w`` (``WINDOW_BUCKETS``): ``inside`` (< w), ``1-4x`` (w to 4w),
  ``4-16x`` (4w to 16w), ``beyond`` (>= 16w); used by the retrieval probe
  (``hedgecats.evaluation.retrieval``), where the window is the model's;
- **absolute ranges** ``(name, lo, hi)``, bounds inclusive, named ``d<lo>-<hi>`` (``near`` for
  the corpus's near range); used on the byte recall corpus, whose near / far split is fixed by
  the data whatever window a model is evaluated with (``range_buckets``).
"""

from __future__ import annotations

from itertools import pairwise

__all__ = [
    "WINDOW_BUCKETS",
    "WINDOW_MULTIPLES",
    "range_bucket",
    "range_buckets",
    "window_bucket",
]

#: bucket names relative to a window ``w``, closest first
WINDOW_BUCKETS = ("inside", "1-4x", "4-16x", "beyond")
#: upper bounds (exclusive) of the first three, in multiples of ``w``
WINDOW_MULTIPLES = (1, 4, 16)


def window_bucket(distance: int, window: int) -> str:
    """``inside`` (< w), ``1-4x`` (w to 4w), ``4-16x`` (4w to 16w) or ``beyond`` (>= 16w)."""
    if window < 1:
        raise ValueError(f"window={window!r} must be >= 1")
    for name, k in zip(WINDOW_BUCKETS, WINDOW_MULTIPLES):
        if distance < k * window:
            return name
    return WINDOW_BUCKETS[-1]


def range_bucket(lo: int, hi: int, name: str | None = None) -> tuple[str, int, int]:
    """``(name, lo, hi)``, bounds inclusive, named ``d<lo>-<hi>`` unless ``name`` is given."""
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi:
        raise ValueError(f"bucket [{lo!r}, {hi!r}] is not valid: give [lo, hi] with integer "
                         "distances lo <= hi (bounds inclusive)")
    return (name or f"d{lo}-{hi}", lo, hi)


def range_buckets(near_min: int, near_max: int, far_min: int, far_max: int,
                  n_far: int = 3) -> list[tuple[str, int, int]]:
    """``near`` (``near_min..near_max``) and ``n_far`` equal slices of ``far_min..far_max``
    (``d150-233`` ...); empty slices are left out."""
    out = [range_bucket(near_min, near_max, "near")]
    edges = [far_min + round(k * (far_max + 1 - far_min) / n_far) for k in range(n_far + 1)]
    out += [range_bucket(lo, hi - 1) for lo, hi in pairwise(edges) if hi > lo]
    return out
