"""Which split-state case faults with state_sums_mma (session 18, call 3's illegal access).

    python bisect.py KPM T SM WHICH B     # e.g. 1 300 1 fwd 2

KPM 1: a padding mask (the first 9 keys of sequence 0 padded); T: the length; SM 1: the state
kernels' sums on the tensor cores; WHICH: where (``fwd``: the forward share, ``rev``: the
reverse share, ``both``); B: the batch. One forward + backward of ``hybrid_kernel`` at the 8B
tiles with split states; prints OK with the output's error against the fp32 reference, or
FAIL with the error (run each case in its own process: a fault breaks the CUDA context).
"""
import dataclasses
import sys
import traceback

import torch

from hedgecats.models.ops import triton_hybrid as th

kpm_on, T, sm, which, B = (sys.argv[1] == "1", int(sys.argv[2]), sys.argv[3] == "1",
                           sys.argv[4], int(sys.argv[5]))
H, Hkv, D, F, w = 8, 2, 128, 256, 64
orig = th._sums_mma_on


def patched(cfg, x):
    """The sums on the tensor cores only in the share WHICH names (x: fk forward, fq reverse)."""
    if not orig(cfg, x):
        return False
    return which == "both" or (which == "fwd") == (x.shape[1] == Hkv)


th._sums_mma_on = patched
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(7)
q = torch.randn(B, H, T, D, device=dev, generator=gen).bfloat16().requires_grad_()
k, v = (torch.randn(B, Hkv, T, D, device=dev, generator=gen).bfloat16().requires_grad_()
        for _ in range(2))
fq = torch.softmax(torch.randn(B, H, T, F, device=dev, generator=gen), -1).bfloat16()
fk = torch.softmax(torch.randn(B, Hkv, T, F, device=dev, generator=gen), -1).bfloat16()
fq, fk = fq.requires_grad_(), fk.requires_grad_()
ca = torch.rand(B, H, device=dev, generator=gen)
cb = 1 - ca
logs = torch.randn(B, H, device=dev)
shift = torch.full((B, H), w, dtype=torch.int32, device=dev)
kpm = None
if kpm_on:
    kpm = torch.ones(B, T, dtype=torch.bool, device=dev)
    kpm[0, :9] = False
cfg = dataclasses.replace(th.default_config(D, F, torch.bfloat16), split_states=True,
                          state_sums_mma=sm)
kw = dict(window=w, scale=D ** -0.5, eps=1e-3, key_padding_mask=kpm, shared=False)
try:
    out = th.hybrid_kernel(q, k, v, fq, fk, ca, cb, logs, shift, config=cfg, **kw)
    out.float().sum().backward()
    torch.cuda.synchronize()
    ref = th.kernel_reference(*(x.detach().float() for x in (q, k, v, fq, fk)), ca, cb, logs,
                              shift, **kw)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print("OK", sys.argv[1:], f"out err {err:.2e}", th.CALLS["state_sums_mma"])
except Exception as e:
    print("FAIL", sys.argv[1:], type(e).__name__, str(e).split("\n")[0])
    traceback.print_exc(limit=-3)
