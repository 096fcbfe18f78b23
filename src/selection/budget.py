"""How many of the ranked layers stay softmax: the budget rules (docs/layer-selection.md).

``keep: k``          the ``k`` worst layers, whatever the KL they leave
``kl_below: X``      the fewest worst layers with which the held-out KL to the teacher (the
                     whole model: those layers softmax, the others hybrid) is below ``X``
``max_softmax: N``   at most ``N``: with ``kl_below``, the search stops at ``N`` (the budget
                     cannot be met when ``N`` layers do not bring the KL below ``X``); alone,
                     the number ``n <= N`` with the lowest held-out KL (the fewest among equals)

Every rule leaves at least one converted layer hybrid. ``Budget`` checks its own values when it
is built and the count of converted layers in ``check``, both before any model is loaded where
the count is known (the pipeline's validation).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

__all__ = ["Budget", "BudgetNotMetError"]


class BudgetNotMetError(ValueError):
    """The held-out KL did not fall below ``kl_below`` within the softmax layers allowed."""


def _count(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{name}={value!r} must be an integer >= 0 (layers kept softmax)")


@dataclass(frozen=True)
class Budget:
    keep: int | None = None
    max_softmax: int | None = None
    kl_below: float | None = None

    def __post_init__(self) -> None:
        _count("keep", self.keep)
        _count("max_softmax", self.max_softmax)
        if self.kl_below is not None:
            x = self.kl_below
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise ValueError(f"kl_below={x!r} must be a finite number (nats per token)")
            if x <= 0:
                raise ValueError(f"kl_below={x!r} cannot be met: the KL to the teacher is >= 0, "
                                 "and 0 only with every layer softmax; give a positive target "
                                 "(nats per token), e.g. 0.05")
        if self.keep is not None and (self.max_softmax is not None or self.kl_below is not None):
            raise ValueError("choose keep (the k worst layers) or a budget (max_softmax and / or "
                             f"kl_below), not both: got keep={self.keep}, max_softmax="
                             f"{self.max_softmax}, kl_below={self.kl_below}")
        if self.keep is None and self.max_softmax is None and self.kl_below is None:
            raise ValueError("name how many layers stay softmax: keep (the k worst), "
                             "max_softmax (at most N) and / or kl_below (until the held-out KL "
                             "to the teacher is below X)")

    def check(self, n_converted: int, where: str = "the model") -> None:
        """Refuse a budget that ``n_converted`` converted layers cannot hold: every rule leaves
        at least one layer hybrid."""
        for name in ("keep", "max_softmax"):
            k = getattr(self, name)
            if k is not None and k >= n_converted:
                raise ValueError(
                    f"{name}={k} but {where} converts {n_converted} layer"
                    f"{'s' if n_converted != 1 else ''}: at least one must stay hybrid, so "
                    f"{name} is at most {n_converted - 1}")
        if self.kl_below is not None and n_converted < 2 and self.max_softmax is None:
            raise ValueError(f"kl_below={self.kl_below} but {where} converts one layer: none "
                             "can be kept softmax with another left hybrid")

    def n_max(self, n_converted: int) -> int:
        """The most layers this budget may keep softmax (the held-out KL curve's length - 1)."""
        if self.keep is not None:
            return self.keep
        if self.max_softmax is not None:
            return self.max_softmax
        return n_converted - 1

    def choose(self, curve: list[float]) -> int:
        """How many of the worst layers stay softmax, from the held-out KL with ``n`` of them
        softmax (``curve[n]``, ``n = 0 .. n_max``)."""
        if self.keep is not None:
            return self.keep
        if self.kl_below is not None:
            for n, kl in enumerate(curve):
                if kl < self.kl_below:
                    return n
            best = min(range(len(curve)), key=lambda n: (curve[n], n))
            raise BudgetNotMetError(
                f"the budget cannot be met: the held-out KL to the teacher stays at or above "
                f"kl_below={self.kl_below} with up to {len(curve) - 1} softmax layers (lowest "
                f"{curve[best]:.4g} with {best}); allow more softmax layers (max_softmax), "
                "raise kl_below, or keep a fixed number (keep)")
        return min(range(len(curve)), key=lambda n: (curve[n], n))

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def describe(self) -> str:
        if self.keep is not None:
            return f"keep the {self.keep} worst layer{'s' if self.keep != 1 else ''} softmax"
        cap = f"at most {self.max_softmax} softmax layers" if self.max_softmax is not None else ""
        if self.kl_below is None:
            return f"{cap}, as many as lower the held-out KL most"
        target = f"softmax layers until the held-out KL to the teacher is below {self.kl_below}"
        return f"{target}, {cap}" if cap else target
