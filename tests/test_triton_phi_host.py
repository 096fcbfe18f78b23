"""The maps' forward pair's host-side plan (``feature_map.kernels.pair_plan``, ``walk_split``):
which kernel a shape gets and how its blocks are shared among programs (CPU, no kernel runs);
and the fused map's dispatch (``feature_map.dispatch.unsupported_reason``)."""

from __future__ import annotations

import pytest
import torch
from hedgecats.models.ops.feature_map import dispatch
from hedgecats.models.ops.feature_map import kernels as tp


def test_pair_walks_only_where_measured():
    assert tp.pair_plan(128, 128) == tp.WALK_PLANS[(128, 128)]
    assert tp.pair_plan(128, 128).per_sm is not None
    for D, FH in ((64, 64), (128, 64)):
        assert tp.pair_plan(D, FH) == tp.PairPlan(None, *tp._tiles(D, FH, backward=False))


@pytest.mark.parametrize("tiles, per_sm", [(5120, 2), (10, 2), (1, 1), (7, 3), (9, 100)])
def test_walk_split_covers_every_block_once_and_leaves_no_program_empty(tiles, per_sm):
    programs, tpp = tp.walk_split(tiles, per_sm, torch.device("cpu"))  # (4 "multiprocessors")
    assert programs <= max(1, min(tiles, per_sm * 4))
    assert (programs - 1) * tpp < tiles <= programs * tpp


@pytest.mark.parametrize("shape, w_shape, dtype, activation, says", [
    ((1, 2, 8, 16), (2, 16, 16), torch.bfloat16, "relu", "activation 'relu'"),
    ((1, 2, 8, 16), (2, 16, 16), torch.bfloat16, "softmax", "CUDA"),
])
def test_the_dispatch_says_why_it_refuses_a_cpu_call(shape, w_shape, dtype, activation, says):
    """On the CPU (no interpreter) the map's kernels take no call, and the dispatch says why:
    the activation first, then where the call runs; ``hedgehog_features`` returns None."""
    x, w, b = torch.randn(shape, dtype=dtype), torch.randn(w_shape), torch.zeros(w_shape[::2])
    reason = dispatch.unsupported_reason(x, w, b, activation)
    assert reason is not None and says in reason or (
        says == "CUDA" and "triton is not installed" in reason), reason
    assert dispatch.hedgehog_features(x, w, b, activation) is None


def test_the_dispatch_refuses_while_switched_off(monkeypatch):
    monkeypatch.setenv("HEDGECATS_TRITON", "0")
    x, w, b = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16), torch.randn(2, 16, 16), \
        torch.zeros(2, 16)
    assert "HEDGECATS_TRITON=0" in dispatch.unsupported_reason(x, w, b, "softmax")
