"""Shared test settings: GPU tests are skipped without CUDA; threads kept to the 2 CI cores;
every test starts from the same global RNG state, so none depends on the tests before it; the
kernels' trace (``ops.instrument.TRACE``) empty at the start of a test that asks for it
(``trace``)."""

from __future__ import annotations

import os

import pytest
import torch
from benchmarks import switches
from hedgecats.models.ops.instrument import TRACE

torch.set_num_threads(2)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _same_rng_state_for_every_test():
    """A test that draws from the global RNG (``torch.randn`` without a generator) sees the same
    numbers whatever ran before it: one such draw made a tolerance check fail only in some test
    orders (tests/test_backends_cpu.py)."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def trace():
    """``ops.instrument.TRACE``, emptied: what the kernels this test runs report (the fast
    paths taken, ``trace.calls["<family>.<event>"]``; the fallbacks to PyTorch,
    ``trace.fallbacks``; the tile retries, ``trace.retries``); emptied again after."""
    TRACE.reset()
    yield TRACE
    TRACE.reset()


def parse_switches(spec: str) -> list[tuple[str, str, object]]:
    """``HEDGECATS_TEST_SWITCHES``' value, "module.NAME=value,..." (``benchmarks.switches.parse``)."""
    return switches.parse(spec, "HEDGECATS_TEST_SWITCHES")


@pytest.fixture(autouse=True, scope="session")
def _switches_from_the_environment():
    """The whole run with kernel switches set (``HEDGECATS_TEST_SWITCHES``, e.g. the GPU
    matrix with an option that is off by default: ``HEDGECATS_TEST_SWITCHES=... bash scripts/gpu_check.sh``); tests
    that set a switch themselves still do. In this process only: the tests that run their
    kernels in a subprocess (the interpreter checks, ``host_overhead.py``) see the defaults."""
    with switches.applied(parse_switches(os.environ.get("HEDGECATS_TEST_SWITCHES", ""))):
        yield
