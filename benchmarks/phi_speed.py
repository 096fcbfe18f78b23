"""The fused feature map (``ops.feature_map``) under variants, against the fp32 PyTorch map, in
one run: other rows per program (``VARIANTS``: the tiles ``feature_map.kernels._tiles`` picks,
replaced for the row).

    python -m benchmarks.phi_speed --shapes 1x65536,8x1024 [--variants a,b] --out DIR

Per shape (Llama-3-8B heads: the query map over 32 heads, the key map over 8, D = 128,
square maps), for each variant: the gradients of x, the weight and the bias of both maps
against ``reference_features`` in fp32 (relative L2 error), then the median milliseconds of
both maps' forward + backward (CUDA events, ``timing.bench``; and in device time,
``timing.device_ms``) and of the forward alone. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hedgecats.models.ops.feature_map import dispatch, reference
from hedgecats.models.ops.feature_map import kernels as tp

from benchmarks.layer import rel
from benchmarks.timing import bench, device_ms, environment

#: name: ((rows, warps) of the forward or None for ``_tiles``'s, the same for the backward).
#: ptxas's report with the launch's divisibility hints shows the D 128 / F 256 backward at 64
#: rows without spill (102 registers, wgmma; 32 rows get mma.sync) and the forward at 128 rows
#: (182)
VARIANTS = {
    "default": (None, None),
    "bwd32": (None, (32, 8)),
    "bwd128": (None, (128, 8)),
    "fwd128": ((128, 8), None),
    "fwd32w4": ((32, 4), None),
    "fwd64w4": ((64, 4), None),
    "bwd64w4": (None, (64, 4)),
}


def maps(B: int, T: int, heads: tuple[int, ...], D: int, seed: int = 0):
    """(x, weight, bias) per map, x in the (B, T, H, D) layout transposed (as attention gets
    q and k from transformers), bf16; weights fp32 (master weights)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for H in heads:
        x = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16().transpose(1, 2)
        w = torch.randn(H, D, D, device="cuda", generator=gen) * D ** -0.5
        b = torch.randn(H, D, device="cuda", generator=gen) * 0.1
        out.append([t.requires_grad_() for t in (x, w, b)])
    return out


def grads(args, dys, fn):
    for t in (t for a in args for t in a):
        t.grad = None
    for (x, w, b), dy in zip(args, dys):
        fn(x, w, b).backward(dy)
    return [t.grad.float() for a in args for t in a]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x65536,8x1024")
    p.add_argument("--out", default=None)
    p.add_argument("--variants", default="default,bwd32",
                   help=f"comma-separated, of {', '.join(VARIANTS)} (each timed twice)")
    a = p.parse_args(argv)
    names = a.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: choose from {', '.join(VARIANTS)}")
    H, Hkv, D = 32, 8, 128
    res = dict(environment=environment(), rows=[],
               command=" ".join(["python", "-m", "benchmarks.phi_speed"] + (argv or sys.argv[1:])))
    fused = lambda x, w, b: dispatch.hedgehog_features(x, w, b, "softmax")  # noqa: E731
    default_tiles = tp._tiles
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        args = maps(B, T, (H, Hkv), D)
        dys = [torch.randn(B, h, T, 2 * D, device="cuda", dtype=torch.bfloat16)
               for h in (H, Hkv)]
        want = grads([[t.detach().float().requires_grad_() for t in m] for m in args], dys,
                     reference.reference_features)

        def fwd():
            with torch.no_grad():
                for x, w, b in args:
                    fused(x, w, b)

        def fwd_bwd():
            for (x, w, b), dy in zip(args, dys):
                fused(x, w, b).backward(dy)
            for t in (t for m in args for t in m):
                t.grad = None
        try:
            for variant in names + names:  # twice: the spread between repeats
                fwd_tiles, bwd_tiles = VARIANTS[variant]

                def tiles(D_, FH, backward, f=fwd_tiles, b=bwd_tiles):
                    pick = b if backward else f
                    return pick if pick is not None else default_tiles(D_, FH, backward)
                tp._tiles = tiles
                got = grads(args, dys, fused)
                err = max(rel(g, w) for g, w in zip(got, want))
                fwd_ms = bench(fwd)[0]
                ms, peak = bench(fwd_bwd)
                row = dict(B=B, T=T, variant=variant, fwd_bwd_ms=round(ms, 4),
                           fwd_ms=round(fwd_ms, 4),
                           fwd_bwd_device_ms=round(device_ms(fwd_bwd, ms)["device_ms"], 4),
                           fwd_device_ms=round(device_ms(fwd, fwd_ms)["device_ms"], 4),
                           peak_gib=round(peak, 3), max_rel_err_grads=float(f"{err:.2e}"))
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        finally:
            tp._tiles = default_tiles
        args = dys = want = None
        torch.cuda.empty_cache()
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "phi_speed.json").write_text(json.dumps(res, indent=1))
        lines = [f"`{res['command']}`", "", "| B x T | variant | fwd + bwd ms | fwd ms | "
                 "fwd + bwd / fwd device ms | peak GiB | max rel err of the gradients "
                 "(fp32 reference) |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['B']} x {r['T']} | {r['variant']} | "
                  f"{r['fwd_bwd_ms']} | {r['fwd_ms']} | {r['fwd_bwd_device_ms']} / "
                  f"{r['fwd_device_ms']} | {r['peak_gib']} | "
                  f"{r['max_rel_err_grads']:.1e} |" for r in res["rows"]]
        (out / "phi_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
