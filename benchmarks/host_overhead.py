"""The hybrid layer's host work per call, on the CPU: Python, PyTorch dispatch and the launch
arguments, with every Triton launch stubbed out (counted, not run). No GPU needed.

    TRITON_INTERPRET=1 python -m benchmarks.host_overhead            # needs triton importable
    TRITON_INTERPRET=1 python -m benchmarks.host_overhead --profile  # + cProfile, by own time

Why: at 8 x 1k the layer's host work per forward + backward is about its GPU time (1.7 ms on
an H200's host), so an isolated call's event timing can read the host.
What runs here is the layer's CUDA path (the fused feature maps, ``hybrid_attention`` through
``triton_hybrid``) on CPU tensors: the routing that sends CPU tensors to the reference is
patched to take the fused path, the maps' dW product (``triton_phi.bmm_fp32``) returns an
empty tensor, and each kernel's ``FastLaunch`` gets a handle whose launch does nothing (its
own Python - the argument key, the cache lookup - runs; Triton's C launcher does not: per
launch on the GPU's host it parses the arguments and calls the driver). So the figures are
the Python and dispatch cost of everything around the kernels, on this machine's CPU, at a
short length and 4 query heads (1 x 32: the few PyTorch kernels that compute - the bias sums -
cost microseconds), with PyTorch's CPU ops in place of CUDA launches (cheaper: no driver
call). A proxy to compare versions on one machine, not the GPU host's time.

Prints per phase (the forward, the backward, the whole call) the median microseconds per
call, the forward alone under no_grad (evaluation, prefill) and its first launch's latency
(where an isolated call's GPU waits), and the counts per call of
Triton launches and of PyTorch ops that reach a device kernel (allocations and views apart).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
import weakref
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # (triton_common.available() on a CPU)

import torch  # noqa: E402
from hedgecats.models import hybrid_attention  # noqa: E402
from hedgecats.models.ops.instrument import TRACE
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import timing  # noqa: E402
from benchmarks.layer import Layer, default_tiles_changed  # noqa: E402

#: the backward's fused kernels off (``--unfused``): the separate kernels
UNFUSED = dict(fuse_q_side=False, fuse_kv_side=False)

#: aten ops that launch no device kernel (allocations, views, metadata)
NO_KERNEL = ("empty", "empty_like", "empty_strided", "view", "t", "transpose", "permute",
             "as_strided", "unsqueeze", "squeeze", "detach", "_reshape_alias", "expand",
             "slice", "alias", "_unsafe_view", "select", "reshape", "view_as", "lift_fresh")


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()
        self.other = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        (self.other if name in NO_KERNEL else self.kernels)[name] += 1
        return func(*args, **(kwargs or {}))


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensors PyTorch allocates (each storage once, views apart) alive at
    each moment, and their peak: the allocations the layer's path makes, with the launches
    stubbed (the same buffers, their values garbage). A CPU proxy of the GPU's peak memory
    above the inputs (``torch.cuda.max_memory_allocated``), without the caching allocator's
    rounding or the libraries' workspaces. The bytes alive are the storages' sizes as they
    are at each allocation: a storage emptied in place (``untyped_storage().resize_(0)``, as
    ``triton_hybrid`` releases the forward's saved branches once the backward has read them)
    counts from then on as its new size."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}  # id of a storage -> a weak reference to it
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        new = False
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()  # (one Python object per storage, views included)
                if id(st) not in self.live and st.nbytes():
                    self.live[id(st)] = weakref.ref(st)
                    weakref.finalize(st, self.live.pop, id(st), None)
                    new = True
        if new:
            self.now = self.alive()
            self.peak = max(self.peak, self.now)
        return out

    def alive(self) -> int:
        """The bytes of the storages alive now, at their current sizes."""
        return sum(st.nbytes() for ref in list(self.live.values()) if (st := ref()) is not None)


def memory_peaks(shape: str) -> dict:
    """MiB allocated at the peak of the forward and of the whole forward + backward (inputs
    and parameters apart) of the layer's call (the maps folded into the kernel's Function) and
    of the call before the fold (the maps as their own Functions), at the 8B's heads (32 / 8,
    D 128) and ``shape`` (B x T); and the MiB still alive after the layer's forward under
    non-reentrant activation checkpointing (as the stages run it: what the backward keeps
    must go through ``save_for_backward``, which checkpointing discards), beside its output's."""
    import gc

    from hedgecats.models.ops.hybrid import attention as hybrid_mod

    B, T = map(int, shape.split("x"))
    L = Layer(B, T, 32, 8, 128, 64, torch.bfloat16, "square")
    do = L.do.transpose(1, 2)

    def run(folded: bool) -> list[float]:
        L.zero()
        mode = LiveBytes()
        with mode:
            if folded:
                out = hybrid_attention(L.q, L.k, L.v, None, None, maps=(L.phi_q, L.phi_k),
                                         window=L.w, scale=L.scale, g=0.5)
            else:
                fq, fk, q, k = hybrid_mod._apply_maps((L.phi_q, L.phi_k), L.q, L.k)
                out = hybrid_attention(q, k, L.v, fq, fk, window=L.w, scale=L.scale, g=0.5)
                del fq, fk, q, k
            forward = mode.peak
            out.backward(do)
            del out
            gc.collect()
        L.zero()
        return [round(forward / 2**20, 2), round(mode.peak / 2**20, 2)]

    def checkpointed() -> list[float]:  # (MiB alive after the forward, the output's MiB)
        from torch.utils.checkpoint import checkpoint

        L.zero()
        mode = LiveBytes()
        with mode:
            out = checkpoint(lambda q, k, v: hybrid_attention(
                q, k, v, None, None, maps=(L.phi_q, L.phi_k), window=L.w, scale=L.scale,
                g=0.5), L.q, L.k, L.v, use_reentrant=False)
            gc.collect()
            alive = mode.alive()
            out.backward(do)
            del out
        L.zero()
        return [round(alive / 2**20, 2), round(do.numel() * do.element_size() / 2**20, 2)]

    run(True), run(False)  # (this shape's one-time allocations, e.g. cached constants, first)
    return {"shape": shape, "layer": run(True), "unfolded": run(False),
            "checkpointed_forward_alive_and_output": checkpointed()}


def patch_routing():
    """The layer's CUDA path on CPU tensors, launches stubbed; returns the launch counter."""
    from hedgecats.models import feature_maps as fm
    from hedgecats.models.ops import triton_common
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.feature_map import dispatch as fm_dispatch
    from hedgecats.models.ops.feature_map import kernels as triton_phi

    if not triton_common.HAVE_TRITON:
        raise SystemExit("host_overhead.py needs triton importable (the kernels' definitions)")
    launches = collections.Counter()
    launches.times = []  # (perf_counter at each launch: the forward's first launch's latency)
    tc = triton_common

    class Launcher:  # Triton 3.6's CudaLauncher: its C function called directly (no scratch)
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def __call__(self, *args):
            pass

        def launch(self, *args):
            pass

    class Compiled:  # what a launch through Triton returns: a handle whose run launches
        function, packed_metadata = 0, (4, 1, 0)

        def __init__(self):
            self.run = Launcher()

    class Kernel:  # the kernel's signature, launches that compile nothing
        def __init__(self, fn):
            self.arg_names = list(fn.arg_names)
            self.__name__ = getattr(fn, "__name__", "?")

        def __getitem__(self, grid):
            return lambda *args, **kw: Compiled()

    launch = tc.FastLaunch._launch

    def counted(self, grid, *args, **kw):  # FastLaunch's own Python runs, the launch does not
        if not isinstance(self.fn, Kernel):
            self.fn, self.compiled = Kernel(self.fn), True
        launches[self.fn.__name__] += 1
        launches.times.append(time.perf_counter())
        return launch(self, grid, *args, **kw)

    tc.FastLaunch._launch = counted
    key_and_values = tc._key_and_values

    def as_if_on_cuda(args):  # (CPU tensors here: FastLaunch caches CUDA launches only)
        key, values, _ = key_and_values(args)
        return key, values, True

    tc._key_and_values = as_if_on_cuda
    tc._fast_state = lambda: None
    tc._no_hooks = lambda: True
    tc._device_and_stream = lambda: (0, 0)
    select = backends.select
    backends.select = lambda backend, q, kpm=None: (
        backends._cuda_ops("auto", True) if backend == "auto" else select(backend, q, kpm))
    backends.triton_enabled = lambda: True

    def fused(self, x, with_input=False, kernel_du=False):
        return fm_dispatch.hedgehog_features(x, self.weight, self.bias, self.activation,
                                             with_input=with_input, kernel_du=kernel_du)

    fm.HedgehogFeatureMap._fused = fused

    def bmm_fp32(a, b):  # (a GEMM on the GPU: its CPU product here would dominate the figures)
        launches["bmm_fp32 (torch)"] += 1
        return torch.empty(a.shape[0], a.shape[1], b.shape[2])

    triton_phi.bmm_fp32 = bmm_fp32
    return launches


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1x32", help="B x T (default 1x32)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="cProfile of the calls, own time")
    p.add_argument("--unfused", action="store_true",
                   help="the backward's fused kernels off (KernelConfig.fuse_q_side and "
                        "fuse_kv_side, on by default at D 128 bf16): the separate kernels")
    p.add_argument("--maps-share", action="store_true",
                   help="also the whole call with the k map's output, then both maps' outputs, "
                        "precomputed (the maps' Functions left out): how much of the host work "
                        "the maps are")
    p.add_argument("--memory", metavar="BxT", nargs="?", const="1x1024",
                   help="also the peak MiB allocated over the forward and the fwd + bwd of the "
                        "layer's call and of the call before the fold, at the 8B's heads and "
                        "this B x T (default 1x1024): LiveBytes, the launches stubbed")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    launches = patch_routing()
    timing.DEVICE = "cpu"
    with default_tiles_changed(UNFUSED if a.unfused else None):
        return _measure(a, launches)


def maps_share(L, calls: int) -> dict:
    """Median microseconds per fwd + bwd of the layer's call (the maps folded into the kernel's
    Function), of the call as it was before that (``unfolded``: the maps as their own
    Functions, their outputs handed to the kernel), of that with the k map's output
    precomputed (fk a constant: the k map's Function, launches and backward left out) and with
    both maps' outputs precomputed; three rounds each, interleaved."""
    fq0, fk0 = L.phi_q(L.q).detach(), L.phi_k(L.k).detach()

    def run(maps):  # maps: two callables, each giving (phi(x), x as the attention takes it)
        if maps is None:  # the layer's call
            out = hybrid_attention(L.q, L.k, L.v, None, None, maps=(L.phi_q, L.phi_k),
                                     window=L.w, scale=L.scale, g=0.5)
        else:
            (fq, q), (fk, k) = maps[0](), maps[1]()
            out = hybrid_attention(q, k, L.v, fq, fk, window=L.w, scale=L.scale, g=0.5)
        out.transpose(1, 2).contiguous().backward(L.do)
        L.zero()

    q_map = lambda: L.phi_q(L.q, with_input=True, kernel_du=True)  # noqa: E731
    variants = {"layer": None,
                "unfolded": (q_map, lambda: L.phi_k(L.k, with_input=True)),
                "unfolded_without_k_map": (q_map, lambda: (fk0, L.k)),
                "unfolded_without_maps": (lambda: (fq0, L.q), lambda: (fk0, L.k))}
    got: dict = {name: [] for name in variants}
    for _ in range(3):
        for name, fns in variants.items():
            for _ in range(5):
                run(fns)
            ts = []
            for _ in range(calls):
                t0 = time.perf_counter()
                run(fns)
                ts.append(time.perf_counter() - t0)
            got[name].append(round(statistics.median(ts) * 1e6, 1))
    return got


def _measure(a, launches) -> dict:
    B, T = map(int, a.shape.split("x"))
    L = Layer(B, T, a.heads, a.kv_heads, 128, 64, torch.bfloat16, "square")
    torch.set_num_threads(1)

    def call(stamps):  # the layer's call: the maps handed over as modules (maps=)
        t0 = time.perf_counter()
        out = hybrid_attention(L.q, L.k, L.v, None, None, maps=(L.phi_q, L.phi_k), window=L.w,
                                 scale=L.scale, g=0.5)
        out = out.transpose(1, 2).contiguous()
        t1 = time.perf_counter()
        out.backward(L.do)
        L.zero()
        t2 = time.perf_counter()
        stamps.append((t1 - t0, t2 - t1, t2 - t0))

    for _ in range(5):
        call([])

    launches.clear()
    folded = TRACE.calls["hybrid.maps_folded"], TRACE.calls["hybrid.maps_folded_backward"]
    with CountOps() as ops:
        call([])
    per_call = dict(launches)
    folded = [TRACE.calls["hybrid.maps_folded"] - folded[0], TRACE.calls["hybrid.maps_folded_backward"] - folded[1]]
    stamps: list = []
    for _ in range(a.calls):
        call(stamps)
    med = [statistics.median(s[i] for s in stamps) * 1e6 for i in range(3)]
    no_grad = []  # evaluation, prefill: the forward alone under no_grad
    first = []  # ... and its first launch's latency (the GPU idles until then in an isolated
    # call: event timing reads it on top of the device time)
    with torch.no_grad():
        for _ in range(a.calls):
            launches.times.clear()
            t0 = time.perf_counter()
            hybrid_attention(L.q, L.k, L.v, None, None, maps=(L.phi_q, L.phi_k), window=L.w,
                               scale=L.scale, g=0.5)
            no_grad.append(time.perf_counter() - t0)
            first.append(launches.times[0] - t0)
    res = {"shape": a.shape, "heads": [a.heads, a.kv_heads], "calls": a.calls,
           "unfused": a.unfused,
           "us_per_call": dict(zip(("forward", "backward", "total"),
                                   [round(x, 1) for x in med])),
           "us_forward_no_grad": round(statistics.median(no_grad) * 1e6, 1),
           "us_to_first_launch_no_grad": round(statistics.median(first) * 1e6, 1),
           "triton_launches": per_call, "torch_kernel_ops": dict(ops.kernels),
           "maps_folded": folded,
           "torch_other_ops": sum(ops.other.values())}
    print(json.dumps(res, indent=1))
    if a.memory:
        res["memory_mib"] = memory_peaks(a.memory)
        print(json.dumps({"memory_mib": res["memory_mib"]}, indent=1))
    if a.maps_share:
        res["maps_share_us"] = maps_share(L, a.calls)
        print(json.dumps({"maps_share_us": res["maps_share_us"]}, indent=1))
    if a.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.calls):
            call([])
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(40)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
