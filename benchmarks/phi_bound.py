"""What bounds the maps' forward pair (``feature_map.kernels.map_forward_pair``): the pair against
kernels of its grid and tiles that do less, in device time, in one run.

    python -m benchmarks.phi_bound --shape 8x1024 --out DIR

Why: at 8 x 1k the pair reads 84 MB (q, k) and writes 168 MB (phi_q, phi_k) in ~0.13 ms
(~1.9 TB/s, the HBM's floor ~0.05 ms), and no tile choice moved it (session 14's
``phi_speed.py`` rows, sessions 12 and 23: 0.131-0.150 ms). Rows (Llama-3-8B heads: q map 32
heads, k map 8, D = F/2 = 128, bf16, x in the (B, T, H, D) layout transposed as attention
gets it):

    pair        the maps' kernel (``map_forward_pair``) on one program a block
    default     ... on the shape's own plan (``pair_plan``: the walk at D = F/2 = 128)
    walk*       ... on walking programs (``PairPlan``: walkN, N programs a multiprocessor;
                -tma: through descriptors, else by pointers; -s4: 4 stages; -32x4: 32 rows
                on 4 warps)
    dot         the same grid, loads and stores; u = x W stored in both halves (no activations)
    copy        the same grid; x stored in both halves (no weight, no product)
    read        the same grid; x read, one value a program stored
    write       the same grid; both halves of y written (constants), nothing read
    torch-cat   torch.cat((x, x), -1) into y per map (PyTorch's copy kernels; from the
                transposed x a strided copy: 0.34 ms on an H100 and an H200, session 24, so
                not the bandwidth reference it was meant to be)

If ``copy`` is as slow as ``pair``, the grid's memory pattern bounds it (the activations are
free); if ``copy`` is near the floor and ``dot`` is not, the product and its operands' path
(the weight read per program); if ``dot`` is fast and ``pair`` slow, the activations.
Each row's outputs are checked against what it computes in PyTorch (the pair's rows against
``reference_features``) before it is timed; then its median device ms
(``attention_speed.device_ms``, the host ahead), twice interleaved, and the TB/s of the bytes
the pair moves (for every row: ``read`` and ``write`` move less).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from hedgecats.models.ops.feature_map import kernels as tp
from hedgecats.models.ops.feature_map import reference
from hedgecats.models.ops.triton_common import cdiv, tl, triton

from benchmarks import timing
from benchmarks.layer import rel
from benchmarks.timing import device_ms, environment

#: the pair's rows: (the plan each runs, ``PairPlan``'s fields; through descriptors, else x one
#: element past an aligned address, which ``tma_ok`` refuses: by pointers); ``default``: the
#: shape's own plan. ptxas, sm_90a, D = F/2 = 128: the walk at 64 x 8 warps 183 registers by
#: pointers (one program a multiprocessor), 170-175 and 131-164 KB of shared memory through
#: descriptors (one); at 32 x 4 through descriptors 156 and 82 KB (two), 66 KB at 2 stages
#: (three)
PAIR_ROWS = {"default": None, "pair": ((None, 64, 8), True),
             "walk1": ((1, 64, 8, 3), False), "walk1-tma": ((1, 64, 8, 3), True),
             "walk1-tma-s4": ((1, 64, 8, 4), True), "walk2-tma-32x4": ((2, 32, 4, 3), True),
             "walk2-tma-32x4-s2": ((2, 32, 4, 2), True),
             "walk3-tma-32x4-s2": ((3, 32, 4, 2), True),
             "walk2-tma-64x4-s2": ((2, 64, 4, 2), True),
             "walk2-tma-32x4-s4": ((2, 32, 4, 4), True)}
ROWS = (*PAIR_ROWS, "dot", "copy", "read", "write", "torch-cat")


@triton.jit
def _less(X, W, Y, S, sx_b, sx_h, sx_t, T, H, D: tl.constexpr, FH: tl.constexpr,
          BM: tl.constexpr, MODE: tl.constexpr):
    """One map's ``_phi_fwd`` program doing less: MODE 0 dot, 1 copy, 2 read, 3 write."""
    pid_bh, pid_m = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    rows = offs_m < T
    y = Y + (pid_bh.to(tl.int64) * T + offs_m[:, None]) * (2 * FH) + tl.arange(0, FH)[None, :]
    if MODE == 3:
        c = (tl.zeros([BM, FH], dtype=tl.float32) + 1.0).to(Y.dtype.element_ty)
        tl.store(y, c, mask=rows[:, None])
        tl.store(y + FH, c, mask=rows[:, None])
        return
    x = tl.load(X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + offs_m[:, None] * sx_t
                + offs_d[None, :], mask=rows[:, None], other=0.0)
    if MODE == 2:
        tl.store(S + pid_bh * tl.num_programs(1) + pid_m, tl.sum(tl.sum(x.to(tl.float32), 1), 0))
    elif MODE == 1:
        tl.store(y, x, mask=rows[:, None])
        tl.store(y + FH, x, mask=rows[:, None])
    else:
        offs_f = tl.arange(0, FH)
        w = tl.load(W + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        u = tl.dot(x, w).to(Y.dtype.element_ty)
        tl.store(y, u, mask=rows[:, None])
        tl.store(y + FH, u, mask=rows[:, None])


def maps_inputs(B: int, T: int, heads=(32, 8), D: int = 128, device="cuda", seed: int = 0):
    """(x, weight, bias) per map: x (B, T, H, D) transposed, bf16; fp32 weights."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for H in heads:
        x = torch.randn(B, T, H, D, device=device, generator=gen).bfloat16().transpose(1, 2)
        w = torch.randn(H, D, D, device=device, generator=gen) * D ** -0.5
        out.append((x, w, torch.randn(H, D, device=device, generator=gen) * 0.1))
    return out


def row_fn(name: str, inputs):
    """A callable running row ``name`` once over both maps."""
    (xq, wq, bq), (xk, wk, bk) = inputs
    if name in PAIR_ROWS:
        plan, tma = PAIR_ROWS[name] or (None, True)
        plan = None if plan is None else tp.PairPlan(*plan)
        if not tma:  # (copies one element past an aligned address: no descriptors)
            xq, xk = (torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)[1:]
                      .view(x.shape[0], x.shape[2], x.shape[1], x.shape[3])
                      .copy_(x.transpose(1, 2)).transpose(1, 2) for x in (xq, xk))

        def pair():
            return tp.map_forward_pair(xq, wq, bq, True, xk, wk, bk, True, plan=plan)
        return pair
    ys = [torch.empty(*x.shape[:3], 2 * w.shape[-1], device=x.device, dtype=x.dtype)
          for x, w, _ in inputs]
    if name == "torch-cat":
        return lambda: [torch.cat((x, x), -1, out=y) for (x, _, _), y in zip(inputs, ys)]
    mode = ("dot", "copy", "read", "write").index(name)
    ws = [w.to(x.dtype).contiguous() for x, w, _ in inputs]
    BM, warps = tp._tiles(xq.shape[-1], wq.shape[-1], backward=False)
    sums = torch.empty(xq.shape[0] * xq.shape[1] * cdiv(xq.shape[2], BM), device=xq.device)

    def less():
        for (x, _, _), w, y in zip(inputs, ws, ys):
            B, H, T, D = x.shape
            _less[(B * H, cdiv(T, BM))](x, w, y, sums, *x.stride()[:3], T, H, D=D,
                                        FH=w.shape[-1], BM=BM, MODE=mode, num_warps=warps)
        return ys
    return less


def row_error(name: str, inputs, ys) -> float:
    """Relative error of row ``name``'s outputs against what it computes, in PyTorch (0 for
    ``read``, whose output is one sum a program)."""
    if name == "read":
        return 0.0
    if name in PAIR_ROWS:
        ys = [y for y, _, _ in ys]
    errs = []
    for (x, w, b), y in zip(inputs, ys):
        if name in PAIR_ROWS:
            want = reference.reference_features(x.float(), w, b, "softmax")
        elif name == "dot":
            u = torch.einsum("bhtd,hdf->bhtf", x.float(), w.to(x.dtype).float())
            want = torch.cat((u, u), -1)
        elif name == "write":
            want = torch.ones_like(y, dtype=torch.float32)
        else:  # copy, torch-cat
            want = torch.cat((x, x), -1).float()
        errs.append(rel(y.float(), want))
    return max(errs)


def pair_bytes(inputs) -> int:
    return sum(x.numel() * x.element_size() * 3 for x, _, _ in inputs)  # x read, 2x written


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8x1024", help="B x T (default 8x1024)")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    names = a.rows.split(",")
    if set(names) - set(ROWS):
        p.error(f"unknown rows {sorted(set(names) - set(ROWS))}: choose from {ROWS}")
    B, T = map(int, a.shape.split("x"))
    cuda = torch.cuda.is_available()
    timing.DEVICE = "cuda" if cuda else "cpu"
    inputs = maps_inputs(B, T, device="cuda" if cuda else "cpu")  # (CPU: Triton's interpreter)
    res = dict(environment=environment(), shape=a.shape,
               mb_moved=round(pair_bytes(inputs) / 1e6, 1), rows={},
               command=" ".join(["python", "-m", "benchmarks.phi_bound"] + (argv or sys.argv[1:])))
    fns = {n: row_fn(n, inputs) for n in names}
    for n in names:  # each row checked against what it computes before it is timed
        res["rows"][n] = dict(max_rel_err=float(f"{row_error(n, inputs, fns[n]()):.2e}"),
                              device_ms=[])
    for _ in range(2 if cuda else 0):  # interleaved twice: the spread between repeats
        for n in names:
            res["rows"][n]["device_ms"].append(round(device_ms(fns[n], 0.2)["device_ms"], 4))
    for n in names:
        if cuda:
            res["rows"][n]["tb_per_s"] = round(res["mb_moved"] / 1e3
                                               / min(res["rows"][n]["device_ms"]), 2)
        print(json.dumps({n: res["rows"][n]}), flush=True)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "phi_bound.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
