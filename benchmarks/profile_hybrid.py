"""Where one hybrid layer's time goes (fwd + bwd, bf16, CUDA): a kernel table from
torch.profiler, and the LA denominator's variants timed and checked in isolation.

    python -m benchmarks.profile_hybrid --out profile.json

The denominator ``den_t = phi(q_t) . sum_{i <= t - shift} phi(k_i)`` is taken in fp32 by us
(fla's ``normalize=True`` sums keys in the input dtype). Variants: ``einsum_after_repeat``
(repeat the KV heads, cumsum, einsum), ``grouped`` (cumsum over the KV heads, then a broadcast
multiply-sum per query group), ``chunked_scans_grouped`` (ours since: the running sum as two
short scans, see ``backends.la_denominator``), ``fla_normalize`` (fla's own, bf16 sums) - each against an fp64
oracle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid import reference as ref

from benchmarks.layer import add_head_args
from benchmarks.timing import bench, device_ms, hold_device


def host_and_device_ms(fn, n: int = 20, sleep_ms: float = 200.0, repeats: int = 5) -> dict:
    """``fn``'s host (Python + launch) and device time per call apart, over ``n`` calls
    enqueued behind a ``sleep_ms`` sleep kernel (``timing.device_ms``), ``repeats``
    times: the medians, and the host's range (one window of 20 calls is noisy on a shared
    host: the same code can read 10% apart). When host > device, an isolated call is
    launch-bound and a timing of it with events measures the host; inside a model the host
    runs ahead while the GPU does the layer's other work."""
    got = [device_ms(fn, per_call_ms=0.0, max_calls=n, sleep_ms=sleep_ms)
           for _ in range(repeats)]
    host = sorted(r["host_ms"] for r in got)
    return dict(host_ms=round(statistics.median(host), 3),
                device_ms=round(statistics.median(r["device_ms"] for r in got), 3),
                host_ahead=all(bool(r["host_ahead"]) for r in got),
                host_ms_range=[round(host[0], 3), round(host[-1], 3)], repeats=repeats)


def host_profile(fn, n: int = 20, rows: int = 30) -> str:
    """cProfile of ``n`` calls of ``fn`` on the host (the autograd backward on this thread),
    by each function's own time, then by time including what it calls."""
    import cProfile
    import io
    import pstats
    torch.autograd.set_multithreading_enabled(False)
    try:
        fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            fn()
        pr.disable()
    finally:
        torch.autograd.set_multithreading_enabled(True)
    torch.cuda.synchronize()
    buf = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(rows)
    return buf.getvalue()


def host_aten_table(fn, n: int = 20, rows: int = 25) -> tuple[str, list]:
    """The host (CPU) time of each PyTorch op over ``n`` calls of ``fn``, by its own time
    (``torch.profiler``, CPU activity only; the backward on autograd's thread included): which
    aten ops - allocations, the maps' dW GEMM and bias sums, casts - the host pays for, and
    how often. The profiler's own cost inflates every op alike: read it for ranks and counts.
    Returns the table and its top rows as dicts (name, calls, self-CPU us per call)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
        sync()
    ev = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:rows]
    top = [dict(name=e.key[:120], calls_per_call=round(e.count / n, 2),
                self_cpu_us_per_call=round(e.self_cpu_time_total / n, 1)) for e in ev]
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows), top


#: (module, attribute) of the layer's host path whose wall time ``host_breakdown`` takes,
#: each patched where its callers look it up: the launch wrapper per kernel, its argument key,
#: the maps' forward and backward (one map, the pair), their dW product, the hybrid's
#: launches, its LA states (read by name in the forward and backward modules), the autograd
#: Function's entry and the dispatch, the TMA check
HOST_PARTS = (("triton_common", "_key_and_values"), ("triton_common", "tma_ok"),
              ("feature_map.function", "map_forward"), ("feature_map.function", "map_backward"),
              ("feature_map.kernels", "map_forward_pair"),
              ("feature_map.kernels", "map_backward_pair"), ("feature_map.kernels", "bmm_fp32"),
              ("hybrid.forward", "launch_forward"), ("hybrid.backward", "launch_backward"),
              ("hybrid.forward", "la_states"), ("hybrid.backward", "la_states"),
              ("hybrid.function", "hybrid_kernel"), ("hybrid.dispatch", "fused_hybrid"))


def host_breakdown(fn, n: int = 20, sleep_ms: float = 200.0) -> dict:
    """Host microseconds per call of ``fn`` in each of ``HOST_PARTS`` (inclusive: a part's
    figure holds the parts it calls) and in each kernel's ``FastLaunch`` launch, timed with
    the CPU clock around each (no profiler: ~0.2 us a wrapper), over ``n`` calls after one
    warm-up, the whole call's host time beside them (``total``; the backward on autograd's
    thread included: the main thread waits for it). The calls are enqueued behind a
    ``sleep_ms`` sleep kernel (on CUDA): with the GPU running them, a host faster than the GPU
    waits inside the launches once the launch queue fills (then one launch reads 70-100 us).
    Where the host work of a launch-bound layer goes, without cProfile's per-call inflation of
    small Python functions."""
    import importlib
    import time as _time

    spent: dict[str, float] = {}
    count: dict[str, int] = {}

    def add(name, t0):
        spent[name] = spent.get(name, 0.0) + _time.perf_counter() - t0
        count[name] = count.get(name, 0) + 1

    def timer(name, f):
        def timed_call(*args, **kw):
            t0 = _time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                add(name, t0)
        return timed_call

    patched = []
    for mod_name, attr in HOST_PARTS:
        mod = importlib.import_module(f"hedgecats.models.ops.{mod_name}")
        if hasattr(mod, attr):
            patched.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, timer(f"{mod_name}.{attr}", getattr(mod, attr)))
    tc = importlib.import_module("hedgecats.models.ops.triton_common")
    launch = tc.FastLaunch._launch

    def launch_timed(self, grid, *args, **kw):
        t0 = _time.perf_counter()
        try:
            return launch(self, grid, *args, **kw)
        finally:
            add("launch " + getattr(self.fn, "__name__", "?"), t0)
    tc.FastLaunch._launch = launch_timed
    try:
        fn()
        _sync()
        spent.clear()
        count.clear()
        if torch.cuda.is_available():
            hold_device(sleep_ms)
        t0 = _time.perf_counter()
        for _ in range(n):
            fn()
        total = _time.perf_counter() - t0
        _sync()
    finally:
        tc.FastLaunch._launch = launch
        for mod, attr, f in patched:
            setattr(mod, attr, f)
    rows = {k: dict(us=round(v * 1e6 / n, 1), calls=count[k] / n)
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
    return {"total_us": round(total * 1e6 / n, 1), "parts": rows}


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def triton_path_host_ms(fn) -> dict:
    """``host_and_device_ms`` of ``fn`` with every kernel launched through Triton's own path
    (``HEDGECATS_TRITON_FAST_LAUNCH=0``): what ``FastLaunch`` saves."""
    from hedgecats.models.ops import triton_common as tc
    before = tc.FAST_LAUNCH
    tc.FAST_LAUNCH = False
    try:
        return host_and_device_ms(fn)
    finally:
        tc.FAST_LAUNCH = before


def timed(fn) -> float:
    """Median milliseconds of ``fn`` (``timing.bench``: 3 warm-up runs, median of 10)."""
    return bench(fn, warmup=3, iters=10)[0]


def den_einsum_after_repeat(fq, fk):
    fk = ref.repeat_kv(fk, fq.shape[1])
    return torch.einsum("bhtf,bhtf->bht", fq.float(), fk.float().cumsum(dim=2))


def den_grouped(fq, fk):
    B, H, T, F = fq.shape
    Hkv = fk.shape[1]
    cum = fk.float().cumsum(dim=2)[:, :, None]  # (B, Hkv, 1, T, F)
    return (fq.float().view(B, Hkv, H // Hkv, T, F) * cum).sum(-1).view(B, H, T)


def den_fla_normalize(fq, fk):
    fk = ref.repeat_kv(fk, fq.shape[1])
    cum = fk.cumsum(dim=2)  # input dtype, as fla's normalize=True
    return (fq * cum).sum(-1).float()


VARIANTS = {"einsum_after_repeat": den_einsum_after_repeat, "grouped": den_grouped,
            "chunked_scans_grouped (ours)": backends.la_denominator,
            "fla_normalize_bf16": den_fla_normalize}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x1024,1x32768")
    add_head_args(p)
    p.add_argument("--out", default=None)
    p.add_argument("--no-denominator", action="store_true", help="kernel tables only")
    p.add_argument("--layout", choices=("model", "contiguous"), default="model",
                   help="q, k, v as (B, H, T, D) views of (B, T, H, D) memory, as the model's "
                        "projections hand them, and the output transposed back as the layer "
                        "does (model), or contiguous (B, H, T, D) and the output as it comes")
    p.add_argument("--host", action="store_true",
                   help="host vs device time per call (launch-bound?) and a cProfile of the host")
    a = p.parse_args(argv)
    H, Hkv, D, w, dt = a.heads, a.kv_heads, a.head_dim, a.window, torch.bfloat16
    phi_q, phi_k = HedgehogFeatureMap(H, D).cuda(), HedgehogFeatureMap(Hkv, D).cuda()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shapes=[], layout=a.layout,
               command=" ".join(["python", "-m", "benchmarks.profile_hybrid"] + (argv or sys.argv[1:])))
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        model = a.layout == "model"

        def leaf(h):
            if model:
                x = torch.randn(B, T, h, D, device="cuda", dtype=dt).transpose(1, 2)
            else:
                x = torch.randn(B, h, T, D, device="cuda", dtype=dt)
            return x.requires_grad_()

        q, k, v = leaf(H), leaf(Hkv), leaf(Hkv)
        do = torch.randn(B, T, H, D, device="cuda", dtype=dt)
        if not model:
            do = do.transpose(1, 2).contiguous()

        def layer(fold: bool = True):  # (grads dropped each call: a model's q, k, v
            # accumulate none). The layer's call: the maps handed over as modules, folded
            # into the kernel's Function; ``fold=False``: the maps as their own Functions
            # (q, k handed on, the q map's du from the kernel)
            if fold:
                out = hybrid_attention(q, k, v, None, None, maps=(phi_q, phi_k), window=w,
                                       backend="auto")
            else:
                fq, qh = phi_q(q, with_input=True, kernel_du=True)
                fk, kh = phi_k(k, with_input=True)
                out = hybrid_attention(qh, kh, v, fq, fk, window=w, backend="auto")
            if model:  # the layer's (B, T, H, D) output (models/layer.py)
                out = out.transpose(1, 2).contiguous()
            out.backward(do)
            q.grad = k.grad = v.grad = None

        def forward():
            with torch.no_grad():
                hybrid_attention(q, k, v, None, None, maps=(phi_q, phi_k), window=w,
                                 backend="auto")

        row = dict(B=B, T=T, layer_ms=round(timed(layer), 3), forward_ms=round(timed(forward), 3))
        if a.host:
            qd, kd, vd = (x.detach() for x in (q, k, v))

            def teacher():
                qg = qd.requires_grad_()
                out = torch.nn.functional.scaled_dot_product_attention(
                    qg, kd, vd, is_causal=True, enable_gqa=True)
                if model:
                    out = out.transpose(1, 2).contiguous()
                out.backward(do)
                qg.grad = None

            for name, fn in (("layer", layer), ("layer_unfolded", lambda: layer(False)),
                             ("forward", forward), ("teacher", teacher)):
                row[f"host_{name}"] = host_and_device_ms(fn)
                print(f"== B={B} T={T} {name}: {row[f'host_{name}']}", flush=True)
            for name, fn in (("layer", layer), ("forward", forward)):
                row[f"host_{name}_triton_path"] = triton_path_host_ms(fn)
                print(f"== B={B} T={T} {name} (Triton's launch path): "
                      f"{row[f'host_{name}_triton_path']}", flush=True)
                row[f"host_{name}_breakdown"] = got = host_breakdown(fn)
                print(f"== B={B} T={T} {name}: host us per call {got['total_us']}", flush=True)
                for part, r in got["parts"].items():
                    print(f"   {part:40s} {r['us']:8.1f} us  x{r['calls']:g}", flush=True)
            for name, fn in (("layer", layer), ("forward", forward)):
                print(f"== B={B} T={T} {name}: host profile of 20 calls\n{host_profile(fn)}",
                      flush=True)
                table, row[f"host_{name}_aten"] = host_aten_table(fn)
                print(f"== B={B} T={T} {name}: PyTorch ops' host time, 20 calls\n{table}",
                      flush=True)
        for name, fn in (("kernels", layer), ("forward_kernels", forward)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            what = "fwd+bwd" if name == "kernels" else "forward (no grad)"
            print(f"== B={B} T={T}: layer {what} {row['layer_ms' if name == 'kernels' else 'forward_ms']}"
                  f" ms\n{table}", flush=True)
            row[name] = [dict(name=e.key[:120], cuda_ms=round(e.device_time_total / 1e3, 3),
                              calls=e.count)
                         for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]]
        res["shapes"].append(row)
        if a.no_denominator:
            q = k = v = do = None  # (freed before the next shape; the closures read these names)
            torch.cuda.empty_cache()
            continue
        with torch.no_grad():
            fq, fk = phi_q(q), phi_k(k)
        fq64, fk64 = fq.double(), fk.double()
        oracle = torch.einsum("bhtf,bhtf->bht", fq64,
                              ref.repeat_kv(fk64, H).cumsum(dim=2))
        row["denominator"] = {}
        for name, fn in VARIANTS.items():
            fqg, fkg = fq.detach().requires_grad_(), fk.detach().requires_grad_()
            g = torch.randn(B, H, T, device="cuda")

            def step():
                fn(fqg, fkg).backward(g)
            ms = timed(step)
            with torch.no_grad():
                d = fn(fq, fk).double()
            err = ((d - oracle).norm() / oracle.norm()).item()
            row["denominator"][name] = dict(ms=round(ms, 3), rel_err=float(f"{err:.2e}"))
            print(f"   den {name:22s} {ms:8.3f} ms  rel err {err:.1e}", flush=True)
        q = k = v = do = fq = fk = fq64 = fk64 = oracle = None
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
