"""``HEDGECATS_TEST_SWITCHES`` (tests/conftest.py): a whole test run with kernel switches set,
e.g. the GPU matrix on other tiles."""

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
    assert parse_switches("hybrid.config.SPLIT_STATES_MIN_CHUNKS=4, "
                          "hybrid.config.FORWARD_TILES_D128={'block_m': 128, 'warps': 8}") == [
        ("hybrid.config", "SPLIT_STATES_MIN_CHUNKS", 4),
        ("hybrid.config", "FORWARD_TILES_D128", {"block_m": 128, "warps": 8})]


@pytest.mark.parametrize("spec, says", [("hybrid.config.SPLIT_STATES_MIN_CHUNKS",
                                         "module.NAME=value"),
                                        ("SPLIT_STATES_MIN_CHUNKS=4", "module.NAME=value"),
                                        ("feature_map.kernels.NO_SUCH=1", "no switch 'NO_SUCH'"),
                                        ("no_such_module.X=1", "no module"),
                                        ("hybrid.config.SPLIT_STATES_MIN_CHUNKS=four",
                                         "not a Python literal")])
def test_parse_switches_refuses_what_it_cannot_set(spec, says):
    with pytest.raises(ValueError, match=says):
        parse_switches(spec)


def test_switched_forward_tiles_reach_the_configs_built_before_them():
    """``default_config`` caches a shape's config and reads ``FORWARD_TILES_D128`` only when
    it builds it: a switch of it must reach a shape asked for before (``attention_speed.py``
    asks for the 8B's at import), and must not outlive its run."""
    import torch
    from benchmarks import switches
    from hedgecats.models.ops.hybrid import config as kconfig

    before = kconfig.default_config(128, 256, torch.bfloat16)
    tiles = {**kconfig.FORWARD_TILES_D128, "block_m": 128, "warps": 8}
    with switches.applied(switches.parse(f"hybrid.config.FORWARD_TILES_D128={tiles!r}")):
        inside = kconfig.default_config(128, 256, torch.bfloat16)
    after = kconfig.default_config(128, 256, torch.bfloat16)
    assert (inside.block_m, inside.warps) == (128, 8)
    assert after == before and (before.block_m, before.warps) == (64, 4)


def test_switch_seen_by_the_tests():
    """Run by the test below with the variable set; skipped otherwise."""
    want = os.environ.get("HEDGECATS_TEST_SWITCHES_EXPECT")
    if want is None:
        pytest.skip("run by test_a_run_with_switches_sees_them_set")
    from hedgecats.models.ops.hybrid import config as kconfig
    assert repr(kconfig.SPLIT_STATES_MIN_CHUNKS) == want


def test_a_run_with_switches_sees_them_set():
    from hedgecats.models.ops.hybrid import config as kconfig
    ours = kconfig.SPLIT_STATES_MIN_CHUNKS
    env = {**os.environ, "HEDGECATS_TEST_SWITCHES": "hybrid.config.SPLIT_STATES_MIN_CHUNKS=3",
           "HEDGECATS_TEST_SWITCHES_EXPECT": "3"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"{Path(__file__).name}::test_switch_seen_by_the_tests"],
                          cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]
    from hedgecats.models.ops.hybrid import config as kconfig
    assert kconfig.SPLIT_STATES_MIN_CHUNKS == ours  # (this run's own, unchanged)
