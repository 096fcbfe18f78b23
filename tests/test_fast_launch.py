"""``ops.triton_common.FastLaunch``: a kernel's later launches call the compiled handle its
first launch through Triton returned, with the same arguments in the same order, and only where
Triton would have picked that same compiled kernel. No Triton or GPU needed: a stand-in kernel
records what Triton's path and the launcher receive (the GPU tests run the real kernels through
it, tests/test_triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from hedgecats.models.ops import triton_common as tc


class Compiled:
    """What ``kernel[grid](...)`` returns in Triton 3.6: a handle whose ``run`` launches."""

    function = "cu-function"
    packed_metadata = ("meta",)

    def __init__(self):
        self.runs = []

    def run(self, *a):
        self.runs.append(a)


class Kernel:
    """A stand-in ``@triton.jit`` function: ``arg_names`` and ``kernel[grid](*args, **kw)``."""

    arg_names = ["X", "Y", "n", "scale", "flag", "BM", "PREC"]

    def __init__(self, handle: bool = True):
        self.calls = []
        self.compiled = []
        self.handle = handle  # False: the launch returns no compiled handle (the interpreter's)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((grid, args, kw))
            if not self.handle:
                return None
            c = Compiled()
            self.compiled.append(c)
            return c
        return launch


@pytest.fixture
def fast_path(monkeypatch):
    monkeypatch.setattr(tc, "_fast_state", lambda: None)
    monkeypatch.setattr(tc, "_no_hooks", lambda: True)
    monkeypatch.setattr(tc, "_device_and_stream", lambda: (0, 77))


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: only launches whose tensors are all CUDA tensors
    are cached."""

    @property
    def is_cuda(self):
        return True


def cuda_like(x: torch.Tensor) -> torch.Tensor:
    return x.as_subclass(OnCuda)


def args(x=None, n=64, flag=True):
    x = torch.zeros(64, dtype=torch.bfloat16) if x is None else x
    return (cuda_like(x), cuda_like(torch.zeros(8)), n, 0.5, flag)


def test_the_second_launch_calls_the_compiled_handle_with_every_argument_in_order(fast_path,
                                                                                 trace):
    k = Kernel()
    f = tc.FastLaunch(k)
    a = args()
    first = f[(4, 2)](*a, BM=64, PREC="tf32", num_warps=8)
    assert len(k.calls) == 1 and first is k.compiled[0]
    assert dict(trace.calls) == {"launch.triton": 1}
    second = f[(4, 2)](*a, BM=64, PREC="tf32", num_warps=8)
    assert len(k.calls) == 1 and second is first  # Triton's path not taken again
    assert dict(trace.calls) == {"launch.triton": 1, "launch.fast": 1}
    (run,) = first.runs
    # grid padded to three axes, the stream, the handle, no launch metadata or hooks, then the
    # positional arguments (tensors as their addresses) and the constexprs in the kernel's own
    # order (BM before PREC)
    assert run[:9] == (4, 2, 1, 77, "cu-function", ("meta",), None, None, None)
    assert run[9:14] == (a[0].data_ptr(), a[1].data_ptr(), *a[2:])
    assert run[14:] == (64, "tf32")
    f[(5,)](*a, BM=64, PREC="tf32", num_warps=8)
    assert first.runs[1][:3] == (5, 1, 1)


@pytest.mark.parametrize("change", ["misaligned", "other dtype", "other int", "True for 1",
                                    "constexpr", "num_warps"])
def test_what_triton_would_compile_differently_goes_through_triton(fast_path, change):
    """A tensor whose address is not 16-byte aligned, another dtype, another integer value
    (Triton specialises on 1 and on divisibility by 16), a bool where an int was (i1 against a
    constant), another constexpr or launch option: not the cached handle."""
    k = Kernel()
    f = tc.FastLaunch(k)
    base = torch.zeros(64, dtype=torch.bfloat16)
    f[(1,)](*args(base, n=1), BM=64, PREC="tf32", num_warps=8)
    a, kw = args(base, n=1), dict(BM=64, PREC="tf32", num_warps=8)
    if change == "misaligned":
        a = args(base[1:])  # 2 bytes past an aligned address
        assert base[1:].data_ptr() % 16 and not base.data_ptr() % 16
    elif change == "other dtype":
        a = args(base.float())
    elif change == "other int":
        a = args(base, n=2)
    elif change == "True for 1":
        a = (cuda_like(base), a[1], True, 0.5, True)
    elif change == "constexpr":
        kw["BM"] = 32
    else:
        kw["num_warps"] = 4
    f[(1,)](*a, **kw)
    assert len(k.calls) == 2 and not k.compiled[0].runs
    f[(1,)](*a, **kw)  # and that key is cached in turn
    assert len(k.calls) == 2 and len(k.compiled[1].runs) == 1


class Launcher:
    """Triton 3.6's ``CudaLauncher`` as ``compiled.run``: ``launch`` is its C function."""

    launch_cooperative_grid, launch_pdl = False, True

    def __init__(self, scratch: int):
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.calls, self.launches = [], []

    def __call__(self, *a):
        self.calls.append(a)

    def launch(self, *a):
        self.launches.append(a)


@pytest.mark.parametrize("scratch", [0, 128])
def test_a_launcher_without_scratch_is_called_at_its_c_function(fast_path, scratch):
    """Where the compiled launcher allocates no scratch, its C ``launch`` is called with what
    its ``__call__`` would pass it (the two flags, no scratch, then the rest as before);
    a kernel that needs scratch (tensor descriptors built on the device) goes through
    ``compiled.run``, which allocates it."""
    class WithLauncher(Kernel):
        def __getitem__(self, grid):
            def launch(*a, **kw):
                c = Kernel.__getitem__(self, grid)(*a, **kw)
                c.run = Launcher(scratch)
                return c
            return launch

    k = WithLauncher()
    f = tc.FastLaunch(k)
    a = args()
    run = f[(4, 2)](*a, BM=64, PREC="tf32").run
    f[(4, 2)](*a, BM=64, PREC="tf32")
    rest = (("meta",), None, None, None, a[0].data_ptr(), a[1].data_ptr(), *a[2:], 64, "tf32")
    if scratch:
        assert not run.launches and run.calls == [(4, 2, 1, 77, "cu-function", *rest)]
    else:
        assert not run.calls
        assert run.launches == [(4, 2, 1, 77, "cu-function", False, True, None, None, *rest)]


def test_a_launch_with_a_host_tensor_is_never_cached(fast_path):
    """The launcher is handed addresses, not tensors, so it cannot tell a host address from a
    device one (and Triton's own check lets pinned host memory through): a launch with any
    tensor not on CUDA goes through Triton every time, and never takes nor leaves a handle."""
    k = Kernel()
    f = tc.FastLaunch(k)
    x = torch.zeros(64, dtype=torch.bfloat16)
    f[(1,)](*args(x), BM=64, PREC="tf32")  # (cached: both tensors on "CUDA")
    host = (x, torch.zeros(8), 64, 0.5, True)
    for _ in range(2):
        f[(1,)](*host, BM=64, PREC="tf32")
    mixed = (cuda_like(x), torch.zeros(8), 64, 0.5, True)
    f[(1,)](*mixed, BM=64, PREC="tf32")
    assert len(k.calls) == 4 and not k.compiled[0].runs and len(f.cache) == 1


def test_floats_do_not_split_the_cache(fast_path):
    """Triton does not specialise floats: another scale takes the same handle."""
    k = Kernel()
    f = tc.FastLaunch(k)
    x, y, n, _, flag = args()
    f[(1,)](x, y, n, 0.5, flag, BM=64, PREC="tf32")
    f[(1,)](x, y, n, 0.25, flag, BM=64, PREC="tf32")
    assert len(k.calls) == 1 and k.compiled[0].runs[0][12] == 0.25


def test_a_launch_that_leaves_a_constexpr_to_its_default_is_never_cached(fast_path):
    k = Kernel()
    f = tc.FastLaunch(k)
    for _ in range(3):
        f[(1,)](*args(), BM=64)  # PREC left out: its value is Triton's to fill in
    assert len(k.calls) == 3


def test_triton_path_when_the_fast_one_does_not_apply(monkeypatch, fast_path):
    k = Kernel()
    f = tc.FastLaunch(k)
    monkeypatch.setattr(tc, "_no_hooks", lambda: False)  # a profiler's launch hooks
    for _ in range(2):
        f[(1,)](*args(), BM=64, PREC="tf32")
    assert len(k.calls) == 2
    monkeypatch.setattr(tc, "_no_hooks", lambda: True)
    monkeypatch.setattr(tc, "_fast_state", lambda: "HEDGECATS_TRITON_FAST_LAUNCH=0")
    for _ in range(2):
        f[(1,)](*args(), BM=64, PREC="tf32")
    assert len(k.calls) == 4
    monkeypatch.setattr(tc, "_fast_state", lambda: None)
    f[lambda meta: (1,)](*args(), BM=64, PREC="tf32")  # a callable grid: Triton's to evaluate
    f[lambda meta: (1,)](*args(), BM=64, PREC="tf32")
    assert len(k.calls) == 6


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(tc, "FAST_LAUNCH", False)
    assert tc._fast_state() == "HEDGECATS_TRITON_FAST_LAUNCH=0"


def test_a_launch_without_a_compiled_handle_is_never_cached(fast_path):
    """The interpreter's launches return no compiled kernel (no ``packed_metadata``): every
    launch then goes through Triton."""
    k = Kernel(handle=False)
    f = tc.FastLaunch(k)
    for _ in range(3):
        f[(1,)](*args(), BM=64, PREC="tf32")
    assert len(k.calls) == 3 and not f.cache


def test_the_interpreters_kernels_go_through_triton(fast_path):
    """Under TRITON_INTERPRET=1 the kernels are InterpretedFunctions: no device to ask for a
    stream, Triton's path every time."""
    class InterpretedFunction(Kernel):
        pass

    k = InterpretedFunction()
    f = tc.FastLaunch(k)
    for _ in range(2):
        f[(1,)](*args(), BM=64, PREC="tf32")
    assert len(k.calls) == 2 and not f.cache


def test_a_stand_in_without_a_signature_goes_through_its_own_launch(fast_path):
    """The tests replace kernels by objects that only raise on launch (the fallback tests, e.g.
    tests/triton_interpreter_check.py mse-backward-fallback): their error comes through."""
    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise RuntimeError("out of resources")
            return launch

    with pytest.raises(RuntimeError, match="out of resources"):
        tc.FastLaunch(Failing())[(1,)](*args(), BM=64)


def test_host_helpers():
    x = torch.zeros(3, dtype=torch.float32)
    assert tc.cast(x, torch.float32) is x and tc.cast(x, torch.bfloat16).dtype == torch.bfloat16
    assert [tc.cdiv(a, 64) for a in (1, 63, 64, 65, 1024)] == [1, 1, 1, 2, 16]
    assert [tc.next_pow2(n) for n in (1, 2, 3, 16, 17, 1000)] == [1, 2, 4, 16, 32, 1024]


def test_the_cache_stays_bounded(fast_path, monkeypatch):
    monkeypatch.setattr(tc, "FAST_CACHE_MAX", 4)
    k = Kernel()
    f = tc.FastLaunch(k)
    for n in range(10):
        f[(1,)](*args(n=n), BM=64, PREC="tf32")
    assert len(f.cache) <= 4
    f[(1,)](*args(n=9), BM=64, PREC="tf32")  # the newest is still there
    assert len(k.calls) == 10


def test_one_launcher_per_kernel():
    k = Kernel()
    assert tc.fast(k) is tc.fast(k) and tc.fast(k).fn is k


def test_the_launcher_takes_what_the_fast_path_hands_it():
    """What ``FastLaunch`` relies on in the Triton versions it is read for
    (``FAST_LAUNCH_VERSIONS``), read off the installed Triton's NVIDIA driver: the launcher's
    ``__call__`` only adds its two flags and the two scratches before the rest (so calling its
    C ``launch`` with them is the same call), the C function parses its arguments in that
    order, and its ``getPointer`` takes an int as the address itself. Needs Triton (the CPU
    set-up installs it)."""
    import inspect

    triton = pytest.importorskip("triton")
    if not triton.__version__.startswith(tc.FAST_LAUNCH_VERSIONS):
        pytest.skip(f"triton {triton.__version__}: the fast path is off for it")
    from triton.backends.nvidia import driver

    call = " ".join(inspect.getsource(driver.CudaLauncher.__call__).split())
    assert ("self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, "
            "self.launch_pdl, global_scratch, profile_scratch, *args)") in call
    assert "return alloc_fn(alloc_size, align, stream)" in call and "if size > 0:" in call
    src = " ".join(inspect.getsource(driver).split())
    assert ("&gridX, &gridY, &gridZ, &_stream, &_function, &launch_cooperative_grid, "
            "&launch_pdl, &global_scratch_obj, &profile_scratch_obj, &kernel_metadata, "
            "&launch_metadata, &launch_enter_hook, &launch_exit_hook") in src
    get_pointer = src[src.index("getPointer(PyObject *obj, int idx)"):]
    assert get_pointer.index("if (PyLong_Check(obj))") < get_pointer.index("data_ptr_str")
    init = " ".join(inspect.getsource(driver.CudaLauncher.__init__).split())
    for name in ("self.launch =", "self.global_scratch_size", "self.profile_scratch_size",
                 "self.launch_cooperative_grid", "self.launch_pdl"):
        assert name in init
