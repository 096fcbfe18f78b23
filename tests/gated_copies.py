"""``branches_copied()``: inside, an output gate's branch calls each store their own copy of
their branch (``hybrid_kernel(output_is_branch=False)``) instead of saving their output as the
branch: the A/B that shows the two ways of holding a branch give the same bits, used by the
interpreter check and the GPU test of the output gate."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def branches_copied():
    from hedgecats.models.ops.hybrid import gated

    launch = gated._launch

    def copying(*args, **kwargs):
        return launch(*args, **{**kwargs, "output_is_branch": False})

    gated._launch = copying
    try:
        yield
    finally:
        gated._launch = launch
