"""Poisoned allocations: a check that no kernel or host reads memory nobody wrote.

Under ``Poisoned`` every tensor PyTorch allocates uninitialised (``torch.empty`` and its kin:
the buffers the kernels' hosts hand them) comes filled with poison: NaN in a float, a large
value in an integer, True in a bool. A call that reads memory nobody wrote then gives other
results than with ordinary allocations, whose leftovers are mostly what the same call wrote
last time on a CPU, and on a GPU whatever the caching allocator hands out (where two identical
calls may then differ). Used by tests/triton_interpreter_check.py (``--poison``) and by the GPU
tests (the same call on the device, clean against poisoned).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Poisoned(TorchDispatchMode):
    """Fills every uninitialised allocation with poison; ``count``: how many it filled."""

    EMPTY = frozenset({"empty", "empty_strided", "empty_like", "new_empty",
                       "new_empty_strided"})

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.EMPTY and out.numel():
            self.count += 1
            if out.dtype == torch.bool:
                out.fill_(True)
            elif out.is_floating_point():
                out.fill_(float("nan"))
            else:
                out.fill_(min(torch.iinfo(out.dtype).max, 0x5A5A5A5A))
        return out
