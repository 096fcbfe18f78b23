"""Shared test settings: GPU tests are skipped without CUDA; threads kept to the 2 CI cores;
every test starts from the same global RNG state, so none depends on the tests before it."""

from __future__ import annotations

import ast
import importlib
import os
import re

import pytest
import torch

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
    orders (tests/test_backends_cpu.py, 2026-12-02)."""
    torch.manual_seed(0)
    yield


def parse_switches(spec: str) -> list[tuple[str, str, object]]:
    """``HEDGECATS_TEST_SWITCHES``' value, "module.NAME=value,..." (modules of
    ``hedgecats.models.ops``, values Python literals), as (module, attribute, value)."""
    out = []
    # (split at the commas that start the next "module.NAME=": a value may hold commas)
    for item in filter(None, (s.strip() for s in re.split(r",(?=\s*[\w.]+\s*=)", spec))):
        target, sep, value = item.partition("=")
        module, dot, name = target.strip().rpartition(".")
        if not (sep and dot and module and name):
            raise ValueError(f"HEDGECATS_TEST_SWITCHES: {item!r} is not module.NAME=value "
                             "(e.g. triton_phi.RECIPROCAL_SOFTMAX=True)")
        mod = importlib.import_module(f"hedgecats.models.ops.{module}")
        if not hasattr(mod, name):
            raise ValueError(f"HEDGECATS_TEST_SWITCHES: hedgecats.models.ops.{module} has no "
                             f"switch {name!r}")
        out.append((module, name, ast.literal_eval(value.strip())))
    return out


@pytest.fixture(autouse=True, scope="session")
def _switches_from_the_environment():
    """The whole run with kernel switches set (``HEDGECATS_TEST_SWITCHES``, e.g. the GPU
    matrix with an option that is off by default: ``benchmarks/validate_gpu.sh rcp``); tests
    that set a switch themselves still do."""
    switches = parse_switches(os.environ.get("HEDGECATS_TEST_SWITCHES", ""))
    before = []
    for module, name, value in switches:
        mod = importlib.import_module(f"hedgecats.models.ops.{module}")
        before.append((mod, name, getattr(mod, name)))
        setattr(mod, name, value)
    yield
    for mod, name, value in reversed(before):
        setattr(mod, name, value)
