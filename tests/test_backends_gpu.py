"""Every GPU backend against the reference, values and gradients, bf16 and fp32.

Marked ``gpu``: skipped without CUDA. Run on the GPU machine:
    python -m pytest -q -m gpu tests/test_backends_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops import backends

pytestmark = pytest.mark.gpu

GPU_BACKENDS = ["fla", "flash_attn", "flex", "auto"]
SHAPES = [  # B, H, Hkv, T, D, window
    (2, 8, 2, 300, 128, 64),   # GQA, T not a multiple of the kernels' blocks
    (1, 4, 4, 40, 64, 64),     # T < window
    (1, 4, 2, 1024, 128, 32),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def run(backend, shape, dtype, mode, **kw):
    B, H, Hkv, T, D, w = shape
    gen = torch.Generator(device="cuda").manual_seed(0)

    def mk(*s):  # bf16-representable values, so every dtype sees the same numbers
        return torch.randn(*s, device="cuda", generator=gen).bfloat16().to(dtype)

    q, k, v = mk(B, H, T, D).requires_grad_(), mk(B, Hkv, T, D).requires_grad_(), \
        mk(B, Hkv, T, D).requires_grad_()
    phi_q = HedgehogFeatureMap(H, D, seed=1).cuda()
    phi_k = HedgehogFeatureMap(Hkv, D, seed=2).cuda()
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode=mode, backend=backend, **kw)
    (out.float() * mk(*out.shape).float()).sum().backward()
    grads = [q.grad, k.grad, v.grad, phi_q.weight.grad, phi_k.weight.grad]
    return out.detach(), [g if g is not None else torch.zeros(1, device="cuda") for g in grads]


CASES = [("hybrid", {}), ("swa_only", {}), ("la_only", {}), ("la_only", {"la_span": "all"}),
         ("hybrid", {"overlap": True}), ("softmax", {}),
         ("hybrid", {"shared_norm": True, "g": 0.1})]


@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-Hkv{}-T{}-D{}-w{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + "".join(f"-{k}={v}" for k, v in c[1].items()))
def test_backend_matches_reference(backend, shape, dtype, case):
    if backend != "auto" and not backends.available(backend):
        pytest.skip(f"{backend} not installed")
    mode, kw = case
    ref_out, ref_grads = run("reference", shape, torch.float32, mode, **kw)
    out, grads = run(backend, shape, dtype, mode, **kw)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_out) < tol, f"output rel err {rel_err(out, ref_out):.2e}"
    for name, g, r in zip(("dq", "dk", "dv", "dWq", "dWk"), grads, ref_grads):
        assert rel_err(g, r) < tol, f"{name} rel err {rel_err(g, r):.2e}"


@pytest.mark.parametrize("backend", ["flex", "auto"])
def test_backend_padding_matches_reference(backend):
    shape = (2, 4, 2, 200, 64, 32)
    kpm = torch.ones(2, 200, dtype=torch.bool, device="cuda")
    kpm[0, :50] = False
    ref_out, _ = run("reference", shape, torch.float32, "hybrid", key_padding_mask=kpm)
    out, _ = run(backend, shape, torch.bfloat16, "hybrid", key_padding_mask=kpm)
    assert rel_err(out, ref_out) < 1e-2
