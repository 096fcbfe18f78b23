"""What the Triton kernel families (``hybrid``, ``feature_map``, ``transfer``, ``decode``)
share: whether they can run here and are switched on, whether Triton's interpreter is on, the
errors after which a caller takes its PyTorch path, a warning logged once, and the launcher
that skips Triton's per-launch host work (``fast``)."""

from __future__ import annotations

import functools
import logging
import os

import torch

from .instrument import TRACE

__all__ = ["GRID_AXIS_MAX", "HAVE_TRITON", "available", "cast", "cdiv", "ensure_allocator",
           "errors", "fast", "interpret", "key_block", "launch_reason", "next_pow2", "pow2",
           "switched_on", "tl", "tma_ok",
           "triton", "warn_once"]

try:  # the kernel modules define their kernels only where triton imports
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - no triton; a broken install counts as none
    triton = tl = None
    HAVE_TRITON = False

#: CUDA's limit on a launch grid's second and third axes (the first takes up to 2^31 - 1)
GRID_AXIS_MAX = 65535


# ----------------------------------------------------------------------------- device helpers
if HAVE_TRITON:

    @triton.jit
    def key_block(KPM, b, T, pid_n, BN: tl.constexpr, HAS_KPM: tl.constexpr):
        """Key block ``pid_n`` of sequence b in a key-side backward kernel (the hybrid's
        ``_bwd_kv`` / ``_bwd_dkv_*``, the stage-1 cross-entropy's ``_xent_bwd_dk``): (its first
        position, its positions, those inside T, those that are real keys: inside T and not
        padded, ``KPM`` (B, T) int8 nonzero)."""
        i0 = pid_n * BN
        offs_n = i0 + tl.arange(0, BN)
        kin = offs_n < T
        kreal = kin
        if HAS_KPM:
            kreal = kreal & (tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0)
        return i0, offs_n, kin, kreal


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host (``triton.cdiv`` is a constexpr function in Triton 3.6: a
    few microseconds a call through its argument unwrapping, ~11 calls a layer)."""
    return -(-a // b)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself where it already is (a no-op ``.to`` still costs
    microseconds of host time, and the layer makes a dozen per call)."""
    return t if t.dtype == dtype else t.to(dtype)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1; ``triton.next_power_of_2`` on the
    host, without its constexpr-function call)."""
    return 1 << (n - 1).bit_length()


def interpret() -> bool:
    """Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def switched_on() -> bool:
    """``HEDGECATS_TRITON`` is not ``0`` (the switch to run or measure without the fused
    kernels; read on every call, so that ``hybrid.backends.triton_disabled`` acts at once)."""
    return os.environ.get("HEDGECATS_TRITON", "1") != "0"


def pow2(n: int) -> bool:
    """``n`` is a power of two (the kernels' tile dims)."""
    return n > 0 and n & (n - 1) == 0


def launch_reason(x: torch.Tensor) -> str | None:
    """Why no fused kernel runs for tensors like ``x`` here (``None``: one may): switched off
    (``HEDGECATS_TRITON=0``), no Triton or CUDA, or ``x`` not on CUDA (the interpreter takes
    CPU tensors). The first check of each family's dispatch."""
    if not switched_on():
        return "the fused kernels are switched off (HEDGECATS_TRITON=0)"
    if not available():
        return "triton is not installed or there is no CUDA device"
    if not (x.is_cuda or interpret()):
        return "the kernels run on CUDA tensors"
    return None


@functools.cache
def available() -> bool:
    """Triton importable, and CUDA present (or the interpreter switched on, for CPU tests)."""
    return HAVE_TRITON and (torch.cuda.is_available() or interpret())


@functools.cache
def warn_once(logger: str, msg: str) -> None:
    """``msg`` at WARNING on ``logger``, once per process."""
    logging.getLogger(logger).warning(msg)


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
    for t in tensors:  # (one pass a tensor: the layer asks on every call)
        size, strides = t.element_size(), t.stride()
        if strides[-1] != 1 or t.data_ptr() % 16:
            return False
        for s, n in zip(strides[:-1], t.shape):
            if s * size % 16 or (s == 0 and n > 1):  # (s == 0: expanded)
                return False
    ensure_allocator()
    return True


@functools.cache
def _hopper_or_later(device: int) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def ensure_allocator() -> None:
    """Triton's scratch allocator in this thread's context, where none is set: Triton keeps it
    in a ContextVar, so one set on the main thread is not set in autograd's backward threads
    (there a launch fails with "no allocator was set"). One that a caller or another library
    set is kept."""
    got = _allocator_state()
    if got is not None:
        holder, null = got
        if not isinstance(holder.get(), null):
            return
    triton.set_allocator(_scratch)


@functools.cache
def _allocator_state():
    """(Triton's ContextVar holding the scratch allocator, its NullAllocator class), or None
    for a Triton without them (imported once: ``tma_ok`` asks on every layer call)."""
    try:
        from triton.runtime import _allocation
        return _allocation._allocator, _allocation.NullAllocator
    except (ImportError, AttributeError):  # pragma: no cover - another Triton's internals
        return None


# ----------------------------------------------------------------------------- launching
#: Triton versions whose ``CompiledKernel.run`` takes the arguments ``FastLaunch`` passes
#: (read in triton 3.6's ``JITFunction.run``); another version launches through Triton's own path
FAST_LAUNCH_VERSIONS = ("3.6.",)
#: cached compiled kernels per ``FastLaunch`` (a new shape adds one; past this, the cache starts
#: over: a long-running process that sees many shapes stays bounded)
FAST_CACHE_MAX = 512


def _key_and_values(args) -> tuple[list, list, bool]:
    """(key, values, on_cuda) of a launch's positional arguments, in one pass.

    key: what of each argument Triton's compiled kernel depends on, exactly or more finely: a
    tensor's dtype and whether its address is 16-byte aligned (Triton specialises on both); an
    integer's value (Triton specialises on 1 and on divisibility by 16: the value decides
    both); a float's type only (Triton does not specialise floats); a bool (True is not 1 to
    Triton: i1 against a constant 1), a string or anything else as (type, value).
    Flat: a dtype only ever opens a tensor's two entries, so two keys are equal only where
    every argument's are.

    values: the arguments as the compiled launcher takes them, a tensor as its address (an
    int): the launcher then skips its per-pointer ``data_ptr()`` call and
    ``cuPointerGetAttribute`` (its check that the address is a device's, which the first
    launch of the key, through Triton, made).

    on_cuda: every tensor is a CUDA tensor. Only such launches are cached: a host address
    handed to the launcher unchecked would fault on the device, and Triton's own check lets
    pinned host memory through (so a key of host tensors could be cached, then taken by
    pageable ones)."""
    key: list = []
    values: list = []
    k, v = key.append, values.append
    on_cuda = True
    for a in args:
        t = type(a)
        if t is int:
            k(a)
            v(a)
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            p = a.data_ptr()
            k(a.dtype)
            k(p & 15 == 0)
            v(p)
            on_cuda = on_cuda and a.is_cuda
        elif t is float:
            k(float)
            v(a)
        else:
            k(None if a is None else (t, a))
            v(a)
    return key, values, on_cuda


#: ``HEDGECATS_TRITON_FAST_LAUNCH=0`` (read at import) launches every kernel through Triton's
#: own path (tests set the attribute)
FAST_LAUNCH = os.environ.get("HEDGECATS_TRITON_FAST_LAUNCH", "1") != "0"


def _fast_state() -> str | None:
    """Why launches go through Triton's own path (``None``: they may take the fast one). Under
    the interpreter a launch returns no compiled handle (nothing is cached: Triton's path)."""
    if not FAST_LAUNCH:
        return "HEDGECATS_TRITON_FAST_LAUNCH=0"
    return _version_reason()


@functools.cache
def _version_reason() -> str | None:
    if not triton.__version__.startswith(FAST_LAUNCH_VERSIONS):
        return f"triton {triton.__version__} (read for {', '.join(FAST_LAUNCH_VERSIONS)})"
    return None


@functools.cache
def _hook_chains():
    """(Triton's launch-hook holder, its HookChain class), or None for a Triton without them."""
    try:
        from triton import knobs
        from triton.knobs import HookChain
        return knobs.runtime, HookChain
    except (ImportError, AttributeError):  # pragma: no cover - another Triton's internals
        return None


def _no_hooks() -> bool:
    """No launch hooks registered (a profiler such as proton adds some; its launches then go
    through Triton's path, which calls them)."""
    got = _hook_chains()
    if got is None:  # pragma: no cover - another Triton's internals
        return False
    rt, chain = got
    e, x = rt.launch_enter_hook, rt.launch_exit_hook
    return (e is None or (type(e) is chain and not e.calls)) and \
        (x is None or (type(x) is chain and not x.calls))


def _device_and_stream() -> tuple[int, int]:
    dev = torch.cuda.current_device()
    return dev, torch._C._cuda_getCurrentRawStream(dev)


class FastLaunch:
    """A ``@triton.jit`` kernel launched as ``fast(kernel)[grid](*args, **constexprs)``, like
    ``kernel[grid](...)``, the same kernel with the same arguments, at a fraction of the host
    time: the first launch of each argument key goes through Triton (which compiles or finds the
    kernel and returns its compiled handle), later ones call that handle's launcher directly (its C
    function itself where no scratch is needed: ``_direct_launcher``), tensors passed as their
    addresses (``_key_and_values``; launches with a tensor not on CUDA always go through
    Triton).

    Why: Triton 3.6's ``JITFunction.run`` spends tens of microseconds of Python per launch
    (binding and specialising ~50 arguments, the cache key, launch metadata and two hook
    calls); the hybrid layer launches 9 to 12 kernels per forward + backward, and at 8 x 1k its
    Python and launches took longer than its kernels.

    The key (``_key_and_values``) holds everything the compiled kernel depends on, or more
    (integers by value where Triton keeps only ``== 1`` and divisibility by 16), plus the keyword
    arguments (constexprs, ``num_warps``, ``num_stages``) and the device: a launch whose
    arguments Triton would compile differently never takes a cached handle. Triton's own path
    runs instead under the interpreter (its launches return no compiled handle), for Triton
    versions not read (``FAST_LAUNCH_VERSIONS``), while launch hooks are registered, with a
    callable grid, keyword arguments in place of positional ones, and with
    ``HEDGECATS_TRITON_FAST_LAUNCH=0`` (logged once): only host time differs."""

    __slots__ = ("fn", "cache", "names", "compiled")

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}
        self.names = tuple(getattr(fn, "arg_names", ()))
        #: a kernel Triton compiles (a JITFunction), not the interpreter's (under
        #: TRITON_INTERPRET=1 ``triton.jit`` makes an InterpretedFunction: no device, no handle)
        #: nor a stand-in without a signature (the tests' failing kernels): Triton's path
        self.compiled = type(fn).__name__ != "InterpretedFunction" and hasattr(fn, "arg_names")

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kw):
        if not self.compiled:
            TRACE.count("launch.triton")
            return self.fn[grid](*args, **kw)
        reason = _fast_state()
        if reason is not None or type(grid) is not tuple or not _no_hooks():
            if reason is not None:
                warn_once(__name__, f"Triton kernels launched through Triton's own path "
                          f"({reason}): the same kernels, more host time per launch")
            TRACE.count("launch.triton")
            return self.fn[grid](*args, **kw)
        dev, stream = _device_and_stream()
        key, values, on_cuda = _key_and_values(args)
        key.append(dev)
        key.append(tuple(kw.items()))
        key = tuple(key)
        try:
            hit = self.cache.get(key)
        except TypeError:  # an unhashable argument (a host-side tensor descriptor, ...)
            TRACE.count("launch.triton")
            return self.fn[grid](*args, **kw)
        if hit is None or not on_cuda:
            compiled = self.fn[grid](*args, **kw)
            TRACE.count("launch.triton")
            tail = self.names[len(args):]
            if on_cuda and all(n in kw for n in tail) and hasattr(compiled, "packed_metadata"):
                if len(self.cache) >= FAST_CACHE_MAX:
                    self.cache.clear()
                self.cache[key] = (compiled, tail, _direct_launcher(compiled))
            return compiled
        compiled, tail, direct = hit
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        if direct is not None:  # the launcher's C function itself (no scratch to allocate)
            launch, coop, pdl = direct
            launch(grid[0], g1, g2, stream, compiled.function, coop, pdl, None, None,
                   compiled.packed_metadata, None, None, None, *values,
                   *[kw[n] for n in tail])
        else:
            compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *values, *[kw[n] for n in tail])
        TRACE.count("launch.fast")
        return compiled


def _direct_launcher(compiled):
    """(the C launch function, cooperative-grid flag, PDL flag) of a compiled kernel whose
    launcher (Triton 3.6's ``CudaLauncher``) would allocate no global or profile scratch: its
    Python ``__call__`` then only forwards to ``launch``, with those two flags and ``None`` for
    both scratches, so a launch may call ``launch`` itself. None for any other launcher (a
    kernel building tensor descriptors on the device needs scratch: ``compiled.run`` allocates
    it)."""
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if launch is None or getattr(run, "global_scratch_size", 1) or \
            getattr(run, "profile_scratch_size", 1):
        return None
    try:
        return launch, run.launch_cooperative_grid, run.launch_pdl
    except AttributeError:  # pragma: no cover - another Triton's launcher
        return None


_FAST: dict = {}


def fast(fn) -> FastLaunch:
    """``fn``'s ``FastLaunch`` (one per kernel and process)."""
    f = _FAST.get(fn)
    if f is None:
        f = _FAST[fn] = FastLaunch(fn)
    return f
