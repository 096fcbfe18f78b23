"""Rankings of layers (worst first), how two rankings agree, and how stable several are.

Every score ranks the worst layer first (the highest value: the layer whose conversion costs
most), ties by layer index. Two rankings of the same layers agree by Kendall's tau (1: the same
order, -1: reversed; tau-a over every pair of layers) and by the overlap of their first ``k``
(the layers a keep-``k`` budget would keep softmax). Several rankings (seeds) are as stable as
the mean of those figures over every pair; their consensus orders layers by mean position.
"""

from __future__ import annotations

from itertools import combinations

__all__ = ["agreement", "consensus", "kendall_tau", "rank", "stability", "top_k_overlap"]


def rank(values: dict[int, float]) -> list[int]:
    """Layers from the worst (highest value) to the best; ties by layer index."""
    return sorted(values, key=lambda i: (-values[i], i))


def _same_layers(a: list[int], b: list[int]) -> None:
    if sorted(a) != sorted(b) or len(set(a)) != len(a):
        raise ValueError(f"rankings of different layers cannot be compared: {a} and {b} (each "
                         "input must convert the same layers)")


def kendall_tau(a: list[int], b: list[int]) -> float:
    """Kendall's tau-a between two rankings of the same layers (1.0 for fewer than 2)."""
    _same_layers(a, b)
    if len(a) < 2:
        return 1.0
    pos_a = {x: i for i, x in enumerate(a)}
    pos_b = {x: i for i, x in enumerate(b)}
    concordant = sum(1 if (pos_a[x] - pos_a[y]) * (pos_b[x] - pos_b[y]) > 0 else -1
                     for x, y in combinations(a, 2))
    return concordant / (len(a) * (len(a) - 1) / 2)


def top_k_overlap(a: list[int], b: list[int], k: int) -> float:
    """Share of the first ``k`` layers of ``a`` that are among the first ``k`` of ``b``."""
    _same_layers(a, b)
    if k < 1:
        return 1.0
    return len(set(a[:k]) & set(b[:k])) / k


def agreement(ranking: list[int], reference: list[int], k: int) -> dict:
    """How ``ranking`` agrees with ``reference``: Kendall's tau and the top-``k`` overlap."""
    return {"kendall_tau": kendall_tau(ranking, reference),
            "top_k_overlap": top_k_overlap(ranking, reference, k), "k": k}


def consensus(rankings: list[list[int]]) -> list[int]:
    """One ranking from several: by mean position, ties by layer index."""
    for r in rankings[1:]:
        _same_layers(rankings[0], r)
    mean = {x: sum(r.index(x) for r in rankings) / len(rankings) for x in rankings[0]}
    return sorted(mean, key=lambda x: (mean[x], x))


def stability(rankings: list[list[int]], k: int) -> dict | None:
    """Mean and lowest Kendall's tau and mean top-``k`` overlap over every pair of rankings
    (``None`` for a single ranking)."""
    if len(rankings) < 2:
        return None
    pairs = [agreement(a, b, k) for a, b in combinations(rankings, 2)]
    taus = [p["kendall_tau"] for p in pairs]
    return {"rankings": len(rankings), "pairs": len(pairs),
            "kendall_tau_mean": sum(taus) / len(taus), "kendall_tau_min": min(taus),
            "top_k_overlap_mean": sum(p["top_k_overlap"] for p in pairs) / len(pairs), "k": k}
