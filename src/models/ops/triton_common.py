"""What the Triton kernel modules (``triton_hybrid``, ``triton_xent``, ``triton_phi``,
``triton_mse``, ``triton_decode``) share: whether they can run here, whether Triton's
interpreter is on, the errors after which a caller takes its PyTorch path, and a warning logged
once."""

from __future__ import annotations

import functools
import logging
import os

import torch

__all__ = ["GRID_AXIS_MAX", "HAVE_TRITON", "available", "ensure_allocator", "errors",
           "interpret", "tl", "tma_ok", "triton", "warn_once"]

try:  # the kernel modules define their kernels only where triton imports (never on CPU CI)
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - CPU CI has no triton; a broken install counts as none
    triton = tl = None
    HAVE_TRITON = False

#: CUDA's limit on a launch grid's second and third axes (the first takes up to 2^31 - 1)
GRID_AXIS_MAX = 65535


def interpret() -> bool:
    """Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def available() -> bool:
    """Triton importable, and CUDA present (or the interpreter switched on, for CPU tests)."""
    return HAVE_TRITON and (torch.cuda.is_available() or interpret())


@functools.cache
def warn_once(logger: str, msg: str) -> None:
    """``msg`` at WARNING on ``logger``, once per process."""
    logging.getLogger(logger).warning(msg)


def record_fallback(log: list[str], logger: str, what: str, error: BaseException, instead: str,
                    phase: str = "") -> None:
    """A kernel that failed in Triton (one of ``errors()``) and the PyTorch path taken instead:
    the error appended to the module's ``log`` (``FALLBACK_ERRORS``, which the GPU tests keep
    empty) and said once per process and message: ``fused <what> failed in Triton (<error>);
    <instead>``."""
    log.append(f"{phase + ': ' if phase else ''}{type(error).__name__}: {error}"[:500])
    warn_once(logger, f"fused {what} failed in Triton ({type(error).__name__}: "
              f"{str(error)[:200]}); {instead}")


@functools.cache
def errors() -> tuple[type[BaseException], ...]:
    """Triton's resource and compilation errors (a kernel that does not fit or build here):
    callers catch these and take their PyTorch path, never other errors."""
    errs: list[type[BaseException]] = []
    try:
        from triton.runtime.errors import OutOfResources
        errs.append(OutOfResources)
    except Exception:  # pragma: no cover - no triton
        pass
    try:
        from triton.compiler.errors import CompilationError
        errs.append(CompilationError)
    except Exception:  # pragma: no cover - no triton
        pass
    return tuple(errs)


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's global scratch (the tensor-memory-accelerator descriptors the kernels build on
    the device), from torch's allocator on the current device."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpret() else "cuda")


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether kernels may read ``tensors`` through device-side tensor descriptors (TMA): an
    sm_90+ GPU (or the interpreter), each base address and every stride but the last (which
    must be 1) multiples of 16 bytes, no broadcast (zero-stride) dimension. Installs the
    scratch allocator such descriptors need in this thread's context (``ensure_allocator``).
    Where this is False the kernels take their pointer path: the same values, slower (ptxas: a
    loop over pointer tensors keeps them in registers, 255 per thread)."""
    if not HAVE_TRITON:
        return False
    if not interpret() and not (torch.cuda.is_available()
                                and _hopper_or_later(torch.cuda.current_device())):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or \
                any(s * size % 16 for s in t.stride()[:-1]) or \
                any(s == 0 for s, n in zip(t.stride(), t.shape) if n > 1):  # (expanded)
            return False
    ensure_allocator()
    return True


@functools.cache
def _hopper_or_later(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def ensure_allocator() -> None:
    """Triton's scratch allocator in this thread's context, where none is set: Triton keeps it
    in a ContextVar, so one set on the main thread is not set in autograd's backward threads
    (found on an H200 on 2026-12-03: "no allocator was set" in the backward). One that a
    caller or another library set is kept."""
    try:
        from triton.runtime import _allocation
        if not isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
            return
    except (ImportError, AttributeError):  # pragma: no cover - another Triton's internals
        pass
    triton.set_allocator(_scratch)
