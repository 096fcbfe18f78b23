"""The maps' forward pair's host-side plan (``triton_phi.walk_plan``, ``walk_split``): which
kernel a shape gets and how its blocks are shared among programs (CPU, no kernel runs)."""

from __future__ import annotations

import pytest
import torch
from hedgecats.models.ops.feature_map import kernels as tp


def test_walk_plan_by_default_only_where_measured(monkeypatch):
    monkeypatch.setattr(tp, "FORWARD_WALK", "auto")
    assert tp.walk_plan(128, 128) == tp.WALK_DEFAULTS[(128, 128)]
    assert tp.walk_plan(64, 64) is None and tp.walk_plan(128, 64) is None
    monkeypatch.setattr(tp, "FORWARD_WALK", None)
    assert tp.walk_plan(128, 128) is None
    monkeypatch.setattr(tp, "FORWARD_WALK", 3)
    monkeypatch.setattr(tp, "WALK_TILES", (32, 4))
    assert tp.walk_plan(64, 64) == (3, 32, 4, tp.WALK_STAGES)
    monkeypatch.setattr(tp, "WALK_TILES", None)
    assert tp.walk_plan(64, 64) == (3, *tp._forward_tiles(64, 64), tp.WALK_STAGES)


def test_walk_plan_refuses_what_is_not_a_count(monkeypatch):
    monkeypatch.setattr(tp, "FORWARD_WALK", "yes")
    with pytest.raises(ValueError, match="'auto' or None"):
        tp.walk_plan(128, 128)


@pytest.mark.parametrize("tiles, per_sm", [(5120, 2), (10, 2), (1, 1), (7, 3), (9, 100)])
def test_walk_split_covers_every_block_once_and_leaves_no_program_empty(tiles, per_sm):
    programs, tpp = tp.walk_split(tiles, per_sm, torch.device("cpu"))  # (4 "multiprocessors")
    assert programs <= max(1, min(tiles, per_sm * 4))
    assert (programs - 1) * tpp < tiles <= programs * tpp


def test_weights_in_kernel_by_switch(monkeypatch):
    """``WEIGHTS_IN_KERNEL``: always, never, or ("walk") only where the pair walks; anything
    else refused with the values it takes."""
    for value, walking, grid in ((True, True, True), (False, False, False),
                                 ("walk", True, False)):
        monkeypatch.setattr(tp, "WEIGHTS_IN_KERNEL", value)
        assert (tp.weights_in_kernel(True), tp.weights_in_kernel(False)) == (walking, grid)
    monkeypatch.setattr(tp, "WEIGHTS_IN_KERNEL", "always")
    with pytest.raises(ValueError, match="True, False or 'walk'"):
        tp.weights_in_kernel(True)
