"""Peak memory of one hybrid layer's pieces at one shape (CUDA), each above what was allocated
before it: the feature maps' fused forward + backward (with and without dx), the bias
gradient's reduction both ways, the fused hybrid kernel with and without ``split_states`` /
``save_branches``, and the whole layer. Also prints the kernels' retries and fallbacks.

    python -m benchmarks.memory_probe --shape 1x65536
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from hedgecats.models import HedgehogFeatureMap
from hedgecats.models.ops.feature_map import kernels as tp
from hedgecats.models.ops.instrument import TRACE
from hedgecats.models.ops.hybrid import config as kconfig
from hedgecats.models.ops.hybrid.function import hybrid_kernel

from benchmarks.layer import add_head_args


def peak_above(fn) -> float:
    """GiB allocated at the peak of ``fn()`` above what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1x65536")
    add_head_args(p)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    B, T = map(int, a.shape.split("x"))
    H, Hkv, D, w = a.heads, a.kv_heads, a.head_dim, a.window
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def leaf(h):  # (B, T, h, D) transposed, as transformers hands attention q, k, v
        return torch.randn(B, T, h, D, device=dev, generator=gen, dtype=dt).transpose(1, 2)
    q, k, v = leaf(H), leaf(Hkv), leaf(Hkv)
    do = torch.randn(B, H, T, D, device=dev, generator=gen, dtype=dt)
    phi_q = HedgehogFeatureMap(H, D, seed=1).to(dev)
    phi_k = HedgehogFeatureMap(Hkv, D, seed=2).to(dev)
    res = {"shape": [B, T, H, Hkv, D, w], "gib": {}}

    def record(name, fn):
        res["gib"][name] = peak_above(fn)
        print(f"{name:55s} {res['gib'][name]:8.3f} GiB above start", flush=True)

    for need_dx in (False, True):
        def phi_step(need_dx=need_dx):
            x = q.detach().requires_grad_(need_dx)
            y = phi_q(x)
            y.backward(torch.ones_like(y))
            phi_q.zero_grad(set_to_none=True)
        record(f"feature map q fwd+bwd (dx {need_dx})", phi_step)
    FH = phi_q.weight.shape[-1]
    du = tp.new_du(q, FH)
    du.normal_()
    record("bias grad: du.float().sum((0, 2))", lambda: du.float().sum(dim=(0, 2)))
    record("bias grad: du.sum((0, 2), dtype=float32)",
           lambda: du.sum(dim=(0, 2), dtype=torch.float32))
    du = None  # (freed; the lambdas above read the name)
    with torch.no_grad():
        fq, fk = phi_q(q), phi_k(k)
    half = torch.full((B, H), 0.5, device=dev)
    shift = torch.full((B, H), w, device=dev, dtype=torch.int32)
    base_cfg = kconfig.default_config(D, fq.shape[-1], dt)
    for split in (True, False):
        for save in (True, False):
            cfg = dataclasses.replace(base_cfg, split_states=split, save_branches=save)

            def kernel_step(cfg=cfg):
                ins = [x.detach().requires_grad_() for x in (q, k, v, fq, fk)]
                out = hybrid_kernel(*ins, half, half, half, shift, window=w,
                                scale=D ** -0.5, eps=1e-6, config=cfg)
                out.backward(do)
            record(f"fused kernel fwd+bwd (split {split}, save {save})", kernel_step)

    def layer_step():
        from hedgecats.models import hybrid_attention
        ins = [x.detach().requires_grad_() for x in (q, k, v)]
        out = hybrid_attention(*ins, phi_q(ins[0]), phi_k(ins[1]), window=w, backend="auto")
        out.backward(do)
        phi_q.zero_grad(set_to_none=True)
        phi_k.zero_grad(set_to_none=True)
    record("layer fwd+bwd (default path)", layer_step)
    res["retries"], res["fallbacks"] = TRACE.retries, TRACE.fallbacks
    print("retries:", TRACE.retries, "fallbacks:", res["fallbacks"], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
