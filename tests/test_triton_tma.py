"""When the kernels read through tensor descriptors (TMA), and the scratch allocator those need
(``ops.triton_common.tma_ok`` / ``ensure_allocator``). Needs triton (skipped on CI, which has
none); no GPU: the interpreter's rules stand in for the device's."""

from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from hedgecats.models.ops import triton_common as tc  # noqa: E402
from triton.runtime import _allocation  # noqa: E402


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def in_new_thread(fn):
    """``fn()``'s result, run on a fresh thread (a fresh ContextVar context, as autograd's
    backward threads have)."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_the_allocator_is_set_in_every_thread_that_asks(interpreter):
    """Triton keeps its allocator in a ContextVar: set on one thread, it is unset on the
    backward's. The GPU run that found it: "no allocator was set" in the backward."""
    def allocator_after_check():
        before = _allocation._allocator.get()
        ok = tc.tma_ok(torch.zeros(2, 3, 8, 16))
        return before, ok, _allocation._allocator.get()

    before, ok, after = in_new_thread(allocator_after_check)
    assert isinstance(before, _allocation.NullAllocator)
    assert ok and after is tc._scratch
    before, ok, after = in_new_thread(allocator_after_check)  # and again on another thread
    assert isinstance(before, _allocation.NullAllocator) and after is tc._scratch


def test_an_allocator_someone_else_set_is_kept(interpreter):
    def theirs(size, alignment, stream):  # pragma: no cover - never called here
        return torch.empty(size, dtype=torch.int8)

    def run():
        triton.set_allocator(theirs)
        tc.ensure_allocator()
        return _allocation._allocator.get()

    assert in_new_thread(run) is theirs


def test_tma_needs_16_byte_aligned_bases_and_strides(interpreter):
    x = torch.zeros(2, 3, 8, 16)  # fp32: rows of 64 bytes
    assert tc.tma_ok(x, x.transpose(1, 2))  # strided like transformers' q: still aligned
    assert not tc.tma_ok(x[..., 1:9])  # base 4 bytes past an aligned one
    assert not tc.tma_ok(torch.zeros(2, 3, 8, 17)[..., :16])  # rows of 68 bytes
    assert not tc.tma_ok(x.transpose(2, 3))  # last dim not contiguous
    y = torch.zeros(2, 3, 8, 24, dtype=torch.bfloat16)[..., :8]  # rows of 48 bytes: fine
    assert tc.tma_ok(y)
    assert not tc.tma_ok(torch.zeros(2, 1, 8, 16).expand(2, 3, 8, 16))  # a broadcast head axis
    assert tc.tma_ok(torch.zeros(1, 3, 8, 16))  # a size-1 axis is no broadcast


def test_no_tma_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the answer is its capability")
    assert not tc.tma_ok(torch.zeros(2, 3, 8, 16))
