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
    assert parse_switches("feature_map.kernels.WEIGHTS_IN_KERNEL='walk', "
                          "hybrid.config.DEFAULT_FORWARD={'block_m': 128, 'warps': 8}") == [
        ("feature_map.kernels", "WEIGHTS_IN_KERNEL", "walk"),
        ("hybrid.config", "DEFAULT_FORWARD", {"block_m": 128, "warps": 8})]


@pytest.mark.parametrize("spec, says", [("feature_map.kernels.WEIGHTS_IN_KERNEL",
                                         "module.NAME=value"),
                                        ("WEIGHTS_IN_KERNEL=True", "module.NAME=value"),
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
    for the 8B's at import), and must not outlive its run."""
    import torch
    from benchmarks import switches
    from hedgecats.models.ops.hybrid import config as kconfig

    before = kconfig.default_config(128, 256, torch.bfloat16)
    parked = switches.parse(f"hybrid.config.DEFAULT_FORWARD={kconfig.PARKED_FORWARD!r}")
    with switches.applied(parked):
        inside = kconfig.default_config(128, 256, torch.bfloat16)
    after = kconfig.default_config(128, 256, torch.bfloat16)
    assert (inside.block_m, inside.warps, inside.park_la, inside.fwd_maxnreg) == (
        kconfig.PARKED_FORWARD["block_m"], kconfig.PARKED_FORWARD["warps"], True,
        kconfig.PARKED_FORWARD["fwd_maxnreg"])
    assert after == before and not before.park_la


def test_switch_seen_by_the_tests():
    """Run by the test below with the variable set; skipped otherwise."""
    want = os.environ.get("HEDGECATS_TEST_SWITCHES_EXPECT")
    if want is None:
        pytest.skip("run by test_a_run_with_switches_sees_them_set")
    from hedgecats.models.ops.feature_map import kernels as fm_kernels
    assert repr(fm_kernels.WEIGHTS_IN_KERNEL) == want


def test_a_run_with_switches_sees_them_set():
    from hedgecats.models.ops.feature_map import kernels as fm_kernels
    weights_in_kernel = fm_kernels.WEIGHTS_IN_KERNEL
    env = {**os.environ, "HEDGECATS_TEST_SWITCHES": "feature_map.kernels.WEIGHTS_IN_KERNEL=True",
           "HEDGECATS_TEST_SWITCHES_EXPECT": "True"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{Path(__file__).name}::test_switch_seen_by_the_tests"],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]
    from hedgecats.models.ops.feature_map import kernels as fm_kernels
    assert fm_kernels.WEIGHTS_IN_KERNEL is weights_in_kernel  # (this run's own, unchanged)
