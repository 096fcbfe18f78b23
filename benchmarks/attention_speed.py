"""One attention layer, forward + backward, per backend: median milliseconds and peak memory.

    python benchmarks/attention_speed.py --out results.json

Compares full causal softmax (torch SDPA, the teacher) with the hybrid (phi in PyTorch + SWA +
normalised LA) through each available backend. Timings are medians over ``--iters`` runs after
``--warmup``, with CUDA events. Where the reference fits (B * T <= 8192), each hybrid backend's
output is also compared with it (relative L2, column ``rel_err_vs_reference``): a fast wrong
kernel is not a result.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops import backends


def layer_inputs(B, H, Hkv, T, D, dtype):
    q = torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype, requires_grad=True)
    return q, k, v


def bench(fn, warmup, iters):
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x1024,1x8192,1x32768", help="BxT list")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    H, Hkv, D, w, dtype = a.heads, a.kv_heads, a.head_dim, a.window, torch.bfloat16
    phi_q = HedgehogFeatureMap(H, D).cuda()
    phi_k = HedgehogFeatureMap(Hkv, D).cuda()
    rows = []
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        q, k, v = layer_inputs(B, H, Hkv, T, D, dtype)
        do = torch.randn(B, H, T, D, device="cuda", dtype=dtype)

        def run(mode, backend):
            def fn():
                fq, fk = phi_q(q), phi_k(k)
                out = hybrid_attention(q, k, v, fq, fk, window=w, mode=mode, backend=backend)
                out.backward(do)
                for t in (q, k, v, phi_q.weight, phi_k.weight, phi_q.bias, phi_k.bias):
                    t.grad = None
            return fn

        cases = [("softmax (SDPA)", "softmax", "auto")]
        for be in ("auto", "fla", "flex", "flash_attn"):
            if be == "auto" or backends.available(be):
                cases.append((f"hybrid [{be}]", "hybrid", be))
        if B * T <= 8192:
            cases.append(("hybrid [reference]", "hybrid", "reference"))
        ref_out = None
        if B * T <= 8192:
            with torch.no_grad():
                ref_out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode="hybrid",
                                           backend="reference").float()
        for name, mode, be in cases:
            torch.cuda.empty_cache()
            err = None
            try:
                if ref_out is not None and mode == "hybrid" and be != "reference":
                    with torch.no_grad():
                        out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode=mode,
                                               backend=be).float()
                    err = ((out - ref_out).norm() / ref_out.norm()).item()
                ms, mem = bench(run(mode, be), a.warmup, a.iters)
            except Exception as e:  # report, do not hide: a backend that fails is a finding
                rows.append(dict(B=B, T=T, case=name, error=f"{type(e).__name__}: {e}"[:300]))
                print(f"B={B} T={T} {name:24s} FAILED {e}", file=sys.stderr)
                continue
            rows.append(dict(B=B, T=T, case=name, ms=round(ms, 3), peak_gib=round(mem, 2),
                             tokens_per_s=round(B * T / ms * 1e3),
                             rel_err_vs_reference=None if err is None else float(f"{err:.2e}")))
            print(f"B={B:2d} T={T:6d} {name:24s} {ms:9.2f} ms  {mem:6.2f} GiB"
                  + ("" if err is None else f"  err {err:.1e}"), flush=True)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, heads=H,
               kv_heads=Hkv, head_dim=D, window=w, dtype="bf16", measure="fwd+bwd one layer",
               rows=rows, command=" ".join(["python", "benchmarks/attention_speed.py"] + (argv or sys.argv[1:])))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
