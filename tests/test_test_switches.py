"""``HEDGECATS_TEST_SWITCHES`` (tests/conftest.py): a whole test run with kernel switches set,
e.g. the GPU matrix with an option that is off by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import parse_switches

ROOT = Path(__file__).resolve().parents[1]


def test_parse_switches_reads_module_name_and_literal():
    assert parse_switches("") == []
    assert parse_switches("feature_map.kernels.RECIPROCAL_SOFTMAX=True, feature_map.kernels.FORWARD_TILES=(32, 4)"
                          ) == [
        ("feature_map.kernels", "RECIPROCAL_SOFTMAX", True), ("feature_map.kernels", "FORWARD_TILES", (32, 4))]


@pytest.mark.parametrize("spec, says", [("triton_phi.RECIPROCAL_SOFTMAX", "module.NAME=value"),
                                        ("RECIPROCAL_SOFTMAX=True", "module.NAME=value"),
                                        ("feature_map.kernels.NO_SUCH=1", "no switch 'NO_SUCH'"),
                                        ("no_such_module.X=1", "no module"),
                                        ("feature_map.kernels.WEIGHTS_IN_KERNEL=walk",
                                         "not a Python literal")])
def test_parse_switches_refuses_what_it_cannot_set(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_switches(spec)


def test_a_switched_default_forward_reaches_the_configs_built_before_it():
    """``default_config`` caches a shape's config and reads ``DEFAULT_FORWARD`` only when it
    builds it: a switch of it must reach a shape asked for before (``attention_speed.py`` asks
    for the 8B's at import), and must not outlive its run (session 26's review: it did both)."""
    import torch
    from hedgecats.models.ops import switches
    from hedgecats.models.ops.hybrid import kernels as th

    before = th.default_config(128, 256, torch.bfloat16)
    parked = switches.parse(f"hybrid.kernels.DEFAULT_FORWARD={th.PARKED_FORWARD!r}")
    with switches.applied(parked):
        inside = th.default_config(128, 256, torch.bfloat16)
    after = th.default_config(128, 256, torch.bfloat16)
    assert (inside.block_m, inside.warps, inside.park_la, inside.fwd_maxnreg) == (
        th.PARKED_FORWARD["block_m"], th.PARKED_FORWARD["warps"], True,
        th.PARKED_FORWARD["fwd_maxnreg"])
    assert after == before and not before.park_la


def test_switch_seen_by_the_tests():
    """Run by the test below with the variable set; skipped otherwise."""
    want = os.environ.get("HEDGECATS_TEST_SWITCHES_EXPECT")
    if want is None:
        pytest.skip("run by test_a_run_with_switches_sees_them_set")
    from hedgecats.models.ops.feature_map import kernels as triton_phi
    assert repr(triton_phi.PAIR_BACKWARD) == want


def test_a_run_with_switches_sees_them_set():
    from hedgecats.models.ops.feature_map import kernels as triton_phi
    pair_backward = triton_phi.PAIR_BACKWARD
    env = {**os.environ, "HEDGECATS_TEST_SWITCHES": "feature_map.kernels.PAIR_BACKWARD=True",
           "HEDGECATS_TEST_SWITCHES_EXPECT": "True"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{Path(__file__).name}::test_switch_seen_by_the_tests"],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]
    from hedgecats.models.ops.feature_map import kernels as triton_phi
    assert triton_phi.PAIR_BACKWARD is pair_backward  # (this run's own, unchanged)
