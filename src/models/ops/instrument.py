"""What the kernels did, for tests and benchmarks: how many calls took each fast path, every
fallback from a fast path to PyTorch with its reason, and every retry on safer tiles.

Product code reports into the one ``TRACE`` and never reads it; tests reset and read it (the
``trace`` fixture in tests/conftest.py), benchmarks read it to check the path they time.
Event names are ``"<family>.<event>"``: ``"hybrid.forward"``, ``"feature_map.backward_dx"``,
``"decode.step"``, ``"launch.fast"``.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter


class Trace:
    """Counts of the fast paths taken, the messages of the fallbacks from them and of the tile
    retries."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.fallbacks: list[str] = []
        self.retries: list[str] = []

    def count(self, event: str, n: int = 1) -> None:
        self.calls[event] += n

    def fallback(self, family: str, what: str, error: BaseException, instead: str,
                 phase: str = "") -> None:
        """A kernel of ``family`` that failed (one of Triton's resource or compile errors) and
        the PyTorch path taken instead: recorded, and said once per process and message as
        ``fused <what> failed in Triton (<error>); <instead>``."""
        self.fallbacks.append(f"{family}: {phase + ': ' if phase else ''}"
                              f"{type(error).__name__}: {error}"[:500])
        _warn_once(f"hedgecats.models.ops.{family}",
                   f"fused {what} failed in Triton ({type(error).__name__}: "
                   f"{str(error)[:200]}); {instead}")

    def retry(self, family: str, what: str, error: BaseException, instead: str) -> None:
        """Tiles of ``family``'s kernel that did not compile or fit here (``what``: the
        problem), and the safer ones tried instead: recorded, and said once per process and
        message."""
        self.retries.append(f"{family}: {what}: {type(error).__name__}: {str(error)[:300]}")
        _warn_once(f"hedgecats.models.ops.{family}",
                   f"fused {what}: tiles do not compile here ({type(error).__name__}); "
                   f"{instead}")

    def reset(self) -> None:
        self.calls.clear()
        self.fallbacks.clear()
        self.retries.clear()


@functools.cache
def _warn_once(logger: str, msg: str) -> None:
    logging.getLogger(logger).warning(msg)


TRACE = Trace()
