"""The fused hybrid kernels' compile-failure retries (``hybrid.config._with_retry``), on CPU:
pure Python, no Triton needed (Triton's error types are stood in for)."""

from __future__ import annotations

import dataclasses

import pytest
from hedgecats.models.ops.hybrid import config as kconfig
from hedgecats.models.ops.instrument import TRACE


class Boom(Exception):
    """Stands in for Triton's OutOfResources / CompilationError."""


@pytest.fixture
def retries(monkeypatch):
    monkeypatch.setattr(kconfig, "errors", lambda: (Boom,))
    monkeypatch.setattr(kconfig, "_FAILED", set())
    monkeypatch.setattr(kconfig, "_SAFE_FAILED", {})
    TRACE.reset()
    yield kconfig
    TRACE.reset()


def _fn(failing, tried):
    def fn(cfg):
        tried.append(cfg)
        if cfg in failing:
            raise Boom(f"does not fit: {cfg}")
        return cfg
    return fn


def test_saved_branches_failing_retries_the_same_tiles_without_them(retries):
    cfg = dataclasses.replace(kconfig.KernelConfig(), save_branches=True)
    plain = dataclasses.replace(cfg, save_branches=False)
    tried = []
    assert kconfig._with_retry("forward", ("k",), cfg, _fn({cfg}, tried)) == plain
    assert tried == [cfg, plain] and len(TRACE.retries) == 1
    tried.clear()  # once failed, never tried again for this problem
    assert kconfig._with_retry("forward", ("k",), cfg, _fn({cfg}, tried)) == plain
    assert tried == [plain]


def test_both_failing_fall_back_to_the_safe_tiles_once(retries):
    cfg = dataclasses.replace(kconfig.KernelConfig(), save_branches=True)
    plain = dataclasses.replace(cfg, save_branches=False)
    tried = []
    assert kconfig._with_retry("backward", ("k",), cfg, _fn({cfg, plain}, tried)) == kconfig.SAFE_CONFIG
    assert tried == [cfg, plain, kconfig.SAFE_CONFIG] and len(TRACE.retries) == 2
    tried.clear()
    kconfig._with_retry("backward", ("k",), cfg, _fn({cfg, plain}, tried))
    assert tried == [kconfig.SAFE_CONFIG]
    # another problem key (e.g. the backward without dq) tries its own tiles again
    tried.clear()
    kconfig._with_retry("backward", ("other",), cfg, _fn(set(), tried))
    assert tried == [cfg]


def test_a_fused_backward_kernel_failing_retries_the_same_tiles_unfused(retries):
    """A config with the backward's fused kernels on (``fuse_q_side``, ``fuse_kv_side``) that
    does not compile falls back to the same tiles with the separate kernels, then to those
    without saved branches, before the safe tiles (not straight to the safe, smaller ones)."""
    cfg = dataclasses.replace(kconfig.KernelConfig(), save_branches=True, fuse_q_side=True,
                              fuse_kv_side=True)
    unfused = dataclasses.replace(cfg, fuse_q_side=False, fuse_kv_side=False)
    plain = dataclasses.replace(unfused, save_branches=False)
    assert kconfig._retry_chain(cfg) == (cfg, unfused, plain)
    tried = []
    assert kconfig._with_retry("backward", ("k",), cfg, _fn({cfg}, tried)) == unfused
    assert tried == [cfg, unfused] and len(TRACE.retries) == 1
    tried.clear()
    assert kconfig._with_retry("backward", ("k2",), cfg, _fn({cfg, unfused}, tried)) == plain
    assert tried == [cfg, unfused, plain]


def test_the_safe_tiles_failing_raise(retries):
    with pytest.raises(Boom):
        kconfig._with_retry("forward", ("k",), kconfig.SAFE_CONFIG, _fn({kconfig.SAFE_CONFIG}, []))


def test_the_safe_tiles_failing_raise_again_without_compiling(retries):
    """Where every config of a problem failed, later calls raise the same error at once (each
    had compiled the safe tiles anew: seconds a call on a device that cannot take them); the
    layer's call, which tries the fused kernel with its maps folded in and then without, no
    longer compiles twice. Another problem key still tries its tiles."""
    cfg = dataclasses.replace(kconfig.KernelConfig(), save_branches=False)
    tried = []
    with pytest.raises(Boom):
        kconfig._with_retry("forward", ("k",), cfg, _fn({cfg, kconfig.SAFE_CONFIG}, tried))
    assert tried == [cfg, kconfig.SAFE_CONFIG]
    tried.clear()
    with pytest.raises(Boom, match="does not fit"):
        kconfig._with_retry("forward", ("k",), cfg, _fn({cfg, kconfig.SAFE_CONFIG}, tried))
    assert tried == []
    assert kconfig._with_retry("forward", ("other",), cfg, _fn(set(), tried)) == cfg


def test_a_fallback_is_recorded_and_said_once(trace, caplog):
    """A kernel's Triton failure is kept in ``TRACE.fallbacks`` (which the GPU tests keep
    empty), named by its family, and said once per process, naming the error and the path
    taken instead."""
    with caplog.at_level("WARNING", logger="hedgecats.models.ops.test_family"):
        for _ in range(2):
            trace.fallback("test_family", "thing", Boom("out of smem " * 60), "using PyTorch",
                           phase="backward")
    assert len(trace.fallbacks) == 2
    assert trace.fallbacks[0].startswith("test_family: backward: Boom: out of smem")
    assert len(trace.fallbacks[0]) == 500
    warned = [r.getMessage() for r in caplog.records
              if r.name == "hedgecats.models.ops.test_family"]
    assert len(warned) == 1
    assert warned[0].startswith("fused thing failed in Triton (Boom: out of smem")
    assert warned[0].endswith("); using PyTorch")
