"""Relative errors of every GPU backend against the reference, as a table (quick diagnosis;
the pass/fail version is tests/test_backends_gpu.py).

    python benchmarks/check_backends.py --out check.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.hybrid import backends

CASES = {
    "hybrid": ("hybrid", {}),
    "swa_only": ("swa_only", {}),
    "la_only": ("la_only", {}),
    "la_only+all": ("la_only", {"la_span": "all"}),
    "hybrid+overlap": ("hybrid", {"overlap": True}),
    "softmax": ("softmax", {}),
    "shared_norm": ("hybrid", {"shared_norm": True, "g": 0.1}),
    "hybrid+padding": ("hybrid", {"pad": True}),
}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def inputs(shape, seed=0):
    """bf16-representable inputs, so every dtype sees the same numbers."""
    B, H, Hkv, T, D, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)

    def mk(*s):
        return torch.randn(*s, device="cuda", generator=g).bfloat16().float()
    return mk(B, H, T, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D), mk(B, H, T, D)


def run(backend, shape, dtype, mode, kw, data):
    B, H, Hkv, T, D, w = shape
    kw = dict(kw)
    if kw.pop("pad", False):
        kpm = torch.ones(B, T, dtype=torch.bool, device="cuda")
        kpm[0, : T // 4] = False
        kw["key_padding_mask"] = kpm
    q, k, v, do = (x.to(dtype, copy=True).requires_grad_(i < 3) for i, x in enumerate(data))
    phi_q, phi_k = HedgehogFeatureMap(H, D, seed=1).cuda(), HedgehogFeatureMap(Hkv, D, seed=2).cuda()
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode=mode, backend=backend, **kw)
    (out.float() * do.float()).sum().backward()
    return [out.detach()] + [t.grad if t.grad is not None else torch.zeros(1, device="cuda")
                             for t in (q, k, v, phi_q.weight, phi_k.weight)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--shapes", default="2x4x4x256x64x64,2x8x2x300x128x64,1x4x4x40x64x64")
    a = p.parse_args()
    rows = []
    for s in a.shapes.split(","):
        shape = tuple(map(int, s.split("x")))
        data = inputs(shape)
        for name, (mode, kw) in CASES.items():
            ref = run("reference", shape, torch.float32, mode, kw, data)
            for be in ("fla", "flex", "auto"):
                if be != "auto" and not backends.available(be):
                    continue
                for dt in (torch.bfloat16, torch.float32):
                    t0 = time.time()
                    try:
                        got = run(be, shape, dt, mode, kw, data)
                        errs = [rel(x, r) for x, r in zip(got, ref)]
                        row = dict(shape=s, case=name, backend=be, dtype=str(dt)[6:],
                                   out=errs[0], dq=errs[1], dk=errs[2], dv=errs[3],
                                   dWq=errs[4], dWk=errs[5], secs=round(time.time() - t0, 1))
                    except Exception as e:
                        row = dict(shape=s, case=name, backend=be, dtype=str(dt)[6:],
                                   error=f"{type(e).__name__}: {e}"[:400])
                    rows.append(row)
                    print(" ".join(f"{k}={v:.1e}" if isinstance(v, float) and k != "secs" else f"{k}={v}"
                                   for k, v in row.items()), flush=True)
    if a.out:
        json.dump(dict(torch=torch.__version__, rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
