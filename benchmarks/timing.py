"""Timing and environment of the benchmarks: CUDA-event medians, a call's GPU time with the host
ahead, and the machine a result was measured on.

``DEVICE`` is "cuda", or "cpu" for the ``--tiny`` smoke runs (the host clock, no memory
statistics); a script sets it before timing (``timing.DEVICE = "cpu"``).
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time

import torch

DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn) -> float:
    """One call's milliseconds: CUDA events on the GPU, the host clock on the CPU."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def bench(fn, warmup: int = 3, iters: int = 10) -> tuple[float, float]:
    """(median ms over ``iters`` CUDA-event-timed calls after ``warmup``, peak GiB)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


def bench_adaptive(fn, budget_ms: float = 1500.0, max_iters: int = 20) -> dict:
    """Warm up (twice: compilation, then caches), time one call, then repeat so that the row
    takes about ``budget_ms``: median, spread, peak memory (absolute and above the start)."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = (time.perf_counter() - t0) * 1e3
    iters = int(max(3, min(max_iters, budget_ms // max(one, 1e-3))))
    cuda = DEVICE == "cuda"
    # what earlier work left in reference cycles goes before the peak is taken (a correctness
    # check's tensors held in a cycle would otherwise count in the next row's peak)
    gc.collect()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [timed(fn) for _ in range(iters)]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "iters": iters, "peak_gib": peak / 2**30, "peak_above_start_gib": (peak - base) / 2**30}


def hold_device(ms: float) -> None:
    """Enqueue a kernel that keeps the GPU busy for ``ms`` milliseconds (its clock's cycles), so
    that the host's launches after it queue up instead of waiting on the GPU."""
    torch.cuda._sleep(int(ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3))


def device_ms(fn, per_call_ms: float, budget_ms: float = 400.0, max_calls: int = 20,
              sleep_ms: float | None = None) -> dict:
    """``fn``'s GPU time per call with the host ahead, and its host (Python + launch) time
    apart: a sleep kernel holds the GPU while the host enqueues the calls (host time: the CPU
    clock over them, no sync), which then run back to back (device time: CUDA events around
    them). An isolated call whose Python and launches take longer than its kernels (the hybrid
    layer at 8 x 1k on a slow host) is timed by ``bench_adaptive`` at its host's speed; inside
    a model the host runs ahead and the GPU time is what a step pays. Calls:
    ``budget_ms / per_call_ms`` within [3, ``max_calls``]; the sleep lasts ``sleep_ms``
    (default: 50 ms + 5 ms a call). ``host_ahead`` False: the sleep ended before the host had
    enqueued every call (the device figure then holds launch gaps). None on the CPU."""
    if DEVICE != "cuda":
        return {"device_ms": None, "host_ahead": None}
    n = int(max(3, min(max_calls, budget_ms // max(per_call_ms, 1e-3))))
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold_device(50.0 + 5.0 * n if sleep_ms is None else sleep_ms)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    end.record()
    ahead = not start.query()  # the sleep still ran when the host finished enqueueing
    torch.cuda.synchronize()
    return {"device_ms": start.elapsed_time(end) / n, "host_ms": host, "host_ahead": ahead,
            "device_calls": n}


def environment() -> dict:
    """The machine and versions of a result, and the date it was measured."""
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (--tiny smoke run)"
    env = {"gpu": gpu, "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": datetime.date.today().isoformat()}
    for mod in ("triton", "fla", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env
