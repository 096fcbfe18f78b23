"""The fused Triton kernels on the GPU against the references: values and gradients.

Marked ``gpu``: skipped without CUDA. On the GPU machine: ``bash scripts/gpu_check.sh``
(or ``python -m pytest -m gpu tests/test_triton_kernels.py``).

``hybrid_attention(backend="triton")`` (the kernel behind ``auto``) against
``hybrid_attention(backend="reference")``: the output and the gradients of q, k, v and of both
feature maps' weights (``dWq``, ``dWk``; ``dg`` for a learned mixer), compared as in
tests/test_backends_gpu.py: against the reference run in the same dtype (relative L2 < 1e-2 in
bf16, < 2e-3 in fp32), and in bf16 also against the fp32 oracle (< 2.5e-2). Every case checks
that the fused kernel actually ran (``TRACE.calls``) and that no Triton error was caught
on the way (``TRACE.fallbacks``); the routing cases check the opposite: calls the kernel does
not cover reach the piece-by-piece path and still give the reference's result.

``weights_xent`` of ``ops.triton_xent`` against the blocked ``ops.transfer.weights_xent``:
value, teacher entropy, gradients of fq and fk.

Each case prints one line with its errors, and with ``HEDGECATS_GPU_REPORT=DIR`` writes it to
``DIR/<worker>.jsonl`` (scripts/gpu_tests_report.py makes the table). ``HEDGECATS_TEST_DEVICE``
(default cuda) lets the test logic itself be dry-run on CPU under the interpreter.
"""

from __future__ import annotations

import functools
import json
import os
import time

import pytest
import torch
from gpu_report import write_report
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.transfer import losses as transfer
from hedgecats.models.ops.instrument import TRACE

pytestmark = pytest.mark.gpu
DEVICE = os.environ.get("HEDGECATS_TEST_DEVICE", "cuda")

TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}
BF16_VS_ORACLE = 2.5e-2
GRADS = ("dq", "dk", "dv", "dWq", "dWk")

#: Qwen2-7B's heads: 28 query heads on 4 kv heads, an odd group of 7 (three cases, below)
QWEN2 = "B1-H28-Hkv4-T300-D128-w64-F256"
WIDE = "B8-H16-Hkv8-T256-D128-w64-F256"
# B, H, Hkv, T, D, window, projection (square: F = 2D; rectangular: F = D)
SHAPES = {
    "B2-H8-Hkv2-T300-D128-w64-F256": (2, 8, 2, 300, 128, 64, "square"),  # GQA, T % 64 != 0
    "B1-H4-Hkv4-T40-D64-w64-F128": (1, 4, 4, 40, 64, 64, "square"),  # T < window, MHA
    "B1-H4-Hkv2-T1024-D128-w32-F128": (1, 4, 2, 1024, 128, 32, "rectangular"),  # F = D
    "B2-H4-Hkv1-T200-D64-w16-F64": (2, 4, 1, 200, 64, 16, "rectangular"),  # F = D, 4 q per kv
    QWEN2: (1, 28, 4, 300, 128, 64, "square"),
    # batch x kv heads 64: the walked LA states on 128 x 128 tiles (the D 128 bf16 default
    # where that leaves 128 programs), 2 query heads a program
    WIDE: (8, 16, 8, 256, 128, 64, "square"),
}
CASES = {  # id -> (mode, switches); "g": "head" = a learned per-head mixer (tensor g)
    "hybrid": ("hybrid", {}),
    "hybrid-overlap": ("hybrid", {"overlap": True}),
    "hybrid-g-per-head": ("hybrid", {"g": "head"}),
    "shared_norm": ("hybrid", {"shared_norm": True, "g": 0.1}),
    "shared_norm-per-head": ("hybrid", {"shared_norm": True, "g": "head"}),
    "swa_only": ("swa_only", {}),
    "swa_only-rescale": ("swa_only", {"rescale": True}),
    "la_only": ("la_only", {}),
    "la_only-all": ("la_only", {"la_span": "all"}),
    "la_only-all-rescale": ("la_only", {"la_span": "all", "rescale": True}),
    "ssd-sample": ("hybrid", {"swa_drop": "sample", "g": "head"}),
    "ssd-head-all": ("hybrid", {"swa_drop": "head", "la_span": "all"}),
    # a kernel floor large enough to show (products of these maps are ~1e-2): k = fq.fk + eps
    "hybrid-floor": ("hybrid", {"eps": 0.05}),
    "shared_norm-floor-la_only": ("la_only", {"eps": 0.05, "la_span": "all"}),
}
BF16_CASES = [(s, c) for s in SHAPES if s not in (QWEN2, WIDE) for c in
              ("hybrid", "hybrid-overlap", "hybrid-g-per-head", "shared_norm", "swa_only",
               "la_only-all", "ssd-head-all")]
BF16_CASES += [("B2-H4-Hkv1-T200-D64-w16-F64", c) for c in
               ("shared_norm-per-head", "swa_only-rescale", "la_only", "la_only-all-rescale",
                "ssd-sample")]
BF16_CASES += [("B2-H8-Hkv2-T300-D128-w64-F256", c) for c in
               ("hybrid-floor", "shared_norm-floor-la_only")]
BF16_CASES += [(QWEN2, c) for c in ("hybrid", "shared_norm-per-head", "ssd-sample")]
BF16_CASES += [(WIDE, c) for c in ("hybrid", "ssd-head-all")]
# fp32 kernels take long to compile (tf32x3 products, spills): one shape of each head dim
FP32_CASES = [("B2-H8-Hkv2-T300-D128-w64-F256", "hybrid"), ("B2-H8-Hkv2-T300-D128-w64-F256",
                                                             "shared_norm")]
FP32_CASES += [("B2-H4-Hkv1-T200-D64-w16-F64", c) for c in ("hybrid", "la_only-all", "ssd-sample")]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def report(**row) -> None:
    print(json.dumps(row), flush=True)
    write_report(row)


def _kernels():
    if not backends.available("triton"):
        pytest.skip("triton not available")


def run(backend, shape, dtype, mode, *, pad=None, strided=False, seed=0, frozen=False, **kw):
    """Output and gradients (q, k, v, both feature-map weights, and g when it is a tensor) of
    one ``hybrid_attention`` call with real feature maps, on bf16-representable inputs
    (``frozen``: q, k, v take no gradient, as stage 1's teacher projections)."""
    B, H, Hkv, T, D, w, proj = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def mk(*s):  # bf16-representable values, so every dtype sees the same numbers
        return torch.randn(*s, device=DEVICE, generator=gen).bfloat16().to(dtype)

    if strided:  # the layout transformers hands attention: (B, T, H, D) transposed
        q = mk(B, T, H, D).transpose(1, 2).requires_grad_(not frozen)
        k = mk(B, T, Hkv, D).transpose(1, 2).requires_grad_(not frozen)
        v = mk(B, T, Hkv, D).transpose(1, 2).requires_grad_(not frozen)
        leaves = [q, k, v]
    else:
        q, k, v = (mk(B, h, T, D).requires_grad_(not frozen) for h in (H, Hkv, Hkv))
        leaves = [q, k, v]
    phi_q = HedgehogFeatureMap(H, D, projection=proj, seed=1).to(DEVICE)
    phi_k = HedgehogFeatureMap(Hkv, D, projection=proj, seed=2).to(DEVICE)
    kw = dict(kw)
    g = kw.pop("g", 0.5)
    if g == "head":
        g = torch.linspace(0.2, 0.8, H, device=DEVICE).view(1, H, 1, 1).requires_grad_()
    drop = kw.pop("swa_drop", None)
    if drop == "sample":
        kw["swa_drop"] = (torch.arange(B, device=DEVICE) % 2 == 0).view(B, 1, 1, 1)
    elif drop == "head":
        kw["swa_drop"] = (torch.arange(B * H, device=DEVICE) % 3 == 0).view(B, H, 1, 1)
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode=mode, g=g,
                           backend=backend, key_padding_mask=pad, **kw)
    (out.float() * mk(*out.shape).float()).sum().backward()
    grads = [x.grad for x in leaves] + [phi_q.weight.grad, phi_k.weight.grad]
    res = {"out": out.detach(), **{n: t if t is not None else torch.zeros(1, device=DEVICE)
                                   for n, t in zip(GRADS, grads)}}
    if torch.is_tensor(g):
        res["dg"] = g.grad
    return res


def errors(got: dict, want: dict) -> dict:
    return {name: rel_err(got[name], want[name]) for name in want}


def check(cid, shape_id, dtype, mode, *, expect_fused=True, **kw):
    _kernels()
    shape = SHAPES[shape_id] if isinstance(shape_id, str) else shape_id
    t0 = time.time()
    oracle = run("reference", shape, torch.float32, mode, **kw)
    same = oracle if dtype == torch.float32 else run("reference", shape, dtype, mode, **kw)
    calls, n_err, n_retry = TRACE.calls["hybrid.forward"], len(TRACE.fallbacks), len(TRACE.retries)
    got = run("triton", shape, dtype, mode, **kw)
    fused = TRACE.calls["hybrid.forward"] - calls
    new_errors = TRACE.fallbacks[n_err:]
    vs_same, vs_oracle = errors(got, same), errors(got, oracle)
    ref_vs_oracle = errors(same, oracle)
    report(test="hybrid", case=cid, shape=str(shape_id), dtype=str(dtype), fused_calls=fused,
           vs_reference_same_dtype={n: float(f"{e:.2e}") for n, e in vs_same.items()},
           vs_fp32_oracle={n: float(f"{e:.2e}") for n, e in vs_oracle.items()},
           reference_same_dtype_vs_oracle={n: float(f"{e:.2e}") for n, e in ref_vs_oracle.items()},
           triton_errors=new_errors, tile_retries=TRACE.retries[n_retry:],
           seconds=round(time.time() - t0, 2))
    assert not new_errors, f"Triton failed and the call fell back: {new_errors}"
    assert (fused > 0) == expect_fused, \
        f"fused kernel {'not ' if expect_fused else ''}used ({fused} calls)"
    assert torch.isfinite(got["out"]).all()
    # within the tolerance of the same-dtype reference, or at least as close to the fp32 oracle
    # as that reference is (two bf16 computations differ by about twice the dtype's noise)
    bad = {n: f"{e:.2e} (oracle {vs_oracle[n]:.2e}, reference's {ref_vs_oracle[n]:.2e})"
           for n, e in vs_same.items()
           if not (e < TOL[dtype] or vs_oracle[n] <= 1.25 * ref_vs_oracle[n])}
    assert not bad, f"triton vs the reference in {dtype} (tolerance {TOL[dtype]}): {bad}"
    if dtype == torch.bfloat16:
        bad = {n: f"{e:.2e}" for n, e in vs_oracle.items() if not e < BF16_VS_ORACLE}
        assert not bad, f"triton in bf16 vs the fp32 oracle (tolerance {BF16_VS_ORACLE}): {bad}"


def _switches(case_id):
    mode, kw = CASES[case_id]
    return mode, dict(kw)


@pytest.mark.parametrize("shape_id,case_id", BF16_CASES, ids=[f"{s}-{c}" for s, c in BF16_CASES])
def test_fused_bf16(shape_id, case_id):
    mode, kw = _switches(case_id)
    check(case_id, shape_id, torch.bfloat16, mode, **kw)


@pytest.mark.parametrize("shape_id,case_id", FP32_CASES, ids=[f"{s}-{c}" for s, c in FP32_CASES])
def test_fused_fp32(shape_id, case_id):
    mode, kw = _switches(case_id)
    check(case_id, shape_id, torch.float32, mode, **kw)


PADDING_CASES = [(torch.bfloat16, c) for c in ("hybrid", "shared_norm", "ssd-head-all", "la_only")]
PADDING_CASES += [(torch.float32, c) for c in ("hybrid", "shared_norm")]


@pytest.mark.parametrize("dtype,case_id", PADDING_CASES,
                         ids=[f"{str(d)[6:]}-{c}" for d, c in PADDING_CASES])
def test_fused_padding(dtype, case_id):
    """Left padding on one row, right padding and a hole on the other."""
    shape = (2, 4, 2, 200, 64, 32, "square")
    kpm = torch.ones(2, 200, dtype=torch.bool, device=DEVICE)
    kpm[0, :50] = False
    kpm[1, 180:] = False
    kpm[1, 90:95] = False
    mode, kw = _switches(case_id)
    check(f"{case_id}-padding", shape, dtype, mode, pad=kpm, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case_id", ["hybrid", "shared_norm", "la_only-all-rescale"])
def test_fused_stage1_call_skips_the_unneeded_passes(dtype, case_id):
    """Stage 1 trains the feature maps on the teacher's detached q, k, v: dWq, dWk (and the
    mixer's) as the reference's, while the backward passes that only serve dq, dk, dv (the dq
    pass, the window's dk / dv kernel, LA's dv programs) and the feature map's dx do not run."""
    _kernels()

    before, dx_before = TRACE.calls.copy(), TRACE.calls["feature_map.backward_dx"]
    mode, kw = _switches(case_id)
    check(f"stage1-{case_id}", "B2-H8-Hkv2-T300-D128-w64-F256", dtype, mode, frozen=True, **kw)
    # (la_only has no window: its dq pass and window kernel never run; dv_la is what it tests)
    ran = {n: TRACE.calls["hybrid." + n] - before["hybrid." + n] for n in ("dq_pass", "dkv_swa", "dv_la")}
    assert ran == {"dq_pass": 0, "dkv_swa": 0, "dv_la": 0}, ran
    if dtype == torch.bfloat16:  # (the fused feature map takes bf16 only)
        assert TRACE.calls["feature_map.backward_dx"] == dx_before


def test_fused_transformers_layout():
    """q, k, v as views of (B, T, H, D) tensors, the layout the model hands attention."""
    check("hybrid-strided", (2, 8, 2, 300, 128, 64, "square"), torch.bfloat16, "hybrid",
          strided=True)


def test_fused_long_sequence_matches_reference():
    """8192 positions: the LA state accumulates over 128 chunks."""
    check("hybrid-T8192", (1, 8, 2, 8192, 128, 64, "square"), torch.bfloat16, "hybrid")


SAVED_SHAPE = (2, 8, 2, 300, 128, 256, 64)  # B, H, Hkv, T, D, F, window


#: (option under test, its counter in TRACE.calls and how much one call adds to it)
OPTIONS = {"save_branches": ("factors_from_saved", 1),
           # the forward's states and the reverse ones (the backward reuses the forward's)
           "split_states": ("split_states", 2)}


@pytest.mark.parametrize("frozen", [False, True], ids=["all-grads", "stage1"])
@pytest.mark.parametrize("shared", [False, True], ids=["fixed", "shared"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_kernel_options_match_the_reference(option, shared, frozen):
    """The kernel's options at the 8B head shape in bf16, GQA, padding, T not a multiple of
    the tiles, each on against off: ``save_branches`` (the backward's per-query factors from
    the forward's stored SWA_t and LA_t) and ``split_states`` (the LA states from every
    chunk's share and a running sum, forced on at this length, where the default walks):
    output and every gradient against the fp32 ``kernel_reference`` within the tolerance the
    option-off call meets, and the option's path actually taken."""
    import dataclasses

    _kernels()
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function as kfunction
    from hedgecats.models.ops.hybrid import reference as kreference
    B, H, Hkv, T, D, F, w = SAVED_SHAPE
    gen = torch.Generator(device=DEVICE).manual_seed(7)

    def mk(*s):
        return torch.randn(*s, device=DEVICE, generator=gen)
    q, k, v = mk(B, H, T, D), mk(B, Hkv, T, D), mk(B, Hkv, T, D)
    fq, fk = torch.rand(B, H, T, F, device=DEVICE, generator=gen), \
        torch.rand(B, Hkv, T, F, device=DEVICE, generator=gen)
    ca, cb, logs = mk(B, H).sigmoid(), mk(B, H).sigmoid(), mk(B, H)
    shift = torch.full((B, H), w, dtype=torch.int32, device=DEVICE)
    kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    kpm[0, :9] = False
    do = mk(B, H, T, D).bfloat16().float()
    kw = dict(window=w, scale=D ** -0.5, eps=1e-3, key_padding_mask=kpm, shared=shared)
    names = ["q", "k", "v", "fq", "fk", "ca", "cb", "logs"]
    trained = [n for n in names if not (frozen and n in ("q", "k", "v"))]

    def grads(fn, cast):
        ins = [x.to(cast).clone().requires_grad_(n in trained)
               for n, x in zip(names, (q, k, v, fq, fk, ca, cb, logs))]
        out = fn(*ins)
        out.float().backward(do)
        return {"out": out.detach().float(), **{n: x.grad.float() for n, x in zip(names, ins)
                                                if n in trained and x.grad is not None}}

    base = dataclasses.replace(kconfig.default_config(D, F, torch.bfloat16), save_branches=True,
                               split_states=False)
    on, off = (dataclasses.replace(base, **{option: flag}) for flag in (True, False))
    counter, adds = OPTIONS[option]
    before = TRACE.calls["hybrid." + counter]
    got = grads(lambda *x: kfunction.hybrid_kernel(*x[:5], *(t.float() for t in x[5:]), shift,
                                            config=on, **kw), torch.bfloat16)
    assert TRACE.calls["hybrid." + counter] == before + adds, (counter, TRACE.calls["hybrid." + counter] - before)
    plain = grads(lambda *x: kfunction.hybrid_kernel(*x[:5], *(t.float() for t in x[5:]), shift,
                                              config=off, **kw), torch.bfloat16)
    want = grads(lambda *x: kreference.kernel_reference(*x, shift, **kw), torch.float32)
    errs = {n: rel_err(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    errs_plain = {n: rel_err(plain[n], want[n]) for n in errs}
    case = f"{'shared' if shared else 'fixed'}-{'stage1' if frozen else 'all-grads'}"
    report(test=option, case=case, shape=str(SAVED_SHAPE), dtype=str(torch.bfloat16),
           vs_fp32_oracle={n: float(f"{e:.2e}") for n, e in errs.items()},
           option_off_vs_fp32={n: float(f"{e:.2e}") for n, e in errs_plain.items()})
    bad = {n: f"{e:.2e} (option off: {errs_plain[n]:.2e})" for n, e in errs.items()
           if not (e < BF16_VS_ORACLE)}
    assert not bad, f"{option} vs the fp32 reference (tolerance {BF16_VS_ORACLE}): {bad}"


#: the backward's fused kernels' ``KernelConfig`` switches (each also its counter in ``TRACE.calls``)
FUSED_BACKWARD = ("fuse_q_side", "fuse_kv_side")


def _run_at_8b_shape(changes: dict, counters, shared: bool, frozen: bool):
    """One forward + backward of the fused kernel at the 8B head shape in bf16 (GQA, padding,
    T not a multiple of the tiles, the q map's du path on: the layer's) with the default
    config changed by ``changes``: (the output and every gradient: q, k, v, both maps' weights,
    the mixer's; how many times each of ``counters`` in ``TRACE.calls`` went up)."""
    import dataclasses

    from hedgecats.models.ops.feature_map import dispatch as tp

    _kernels()
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function as kfunction
    B, H, Hkv, T, D, F, w = SAVED_SHAPE
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    maps = [HedgehogFeatureMap(n, D, seed=s).to(DEVICE) for n, s in ((H, 1), (Hkv, 2))]
    q, k, v = (torch.randn(B, T, n, D, device=DEVICE, generator=gen).bfloat16()
               .transpose(1, 2) for n in (H, Hkv, Hkv))
    ca = torch.rand(B, H, device=DEVICE, generator=gen)
    cb, logs = 1 - ca, torch.randn(B, H, device=DEVICE, generator=gen)
    shift = torch.full((B, H), w, dtype=torch.int32, device=DEVICE)
    kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    kpm[0, :9] = False
    do = torch.randn(B, H, T, D, device=DEVICE, generator=gen).bfloat16()
    kw = dict(window=w, scale=D ** -0.5, eps=1e-3, key_padding_mask=kpm, shared=shared)
    ins = [x.detach().clone().requires_grad_(not frozen) for x in (q, k, v)]
    mix = [x.clone().requires_grad_() for x in (ca, cb, logs)]
    fq = tp.hedgehog_features(ins[0], maps[0].weight, maps[0].bias, kernel_du=True)
    fk = tp.hedgehog_features(ins[1], maps[1].weight, maps[1].bias)
    cfg = dataclasses.replace(kconfig.default_config(D, F, torch.bfloat16), **changes)
    before = [TRACE.calls["hybrid." + n] for n in counters]
    out = kfunction.hybrid_kernel(*ins, fq, fk, *mix, shift, config=cfg, **kw)
    out.backward(do)
    ran = [TRACE.calls["hybrid." + n] - b for n, b in zip(counters, before)]
    grads = {"out": out.detach(), **{n: x.grad for n, x in zip("qkv", ins)},
             **{n: x.grad for n, x in zip(("ca", "cb", "logs"), mix)},
             "dWq": maps[0].weight.grad, "dbq": maps[0].bias.grad,
             "dWk": maps[1].weight.grad, "dbk": maps[1].bias.grad}
    return grads, ran


def _same_results(got: dict, want: dict, test: str, case: str) -> dict:
    """The gradients that differ from ``want``'s and by how much (relative), reported; those
    that differ by more than one bf16 rounding (2^-8) as an assertion's message."""
    assert {n for n, x in got.items() if x is None} == {n for n, x in want.items() if x is None}
    differ = {n: rel_err(a.float(), want[n].float()) for n, a in got.items()
              if a is not None and not torch.equal(a, want[n])}
    report(test=test, case=case, shape=str(SAVED_SHAPE),
           bit_for_bit=sorted(n for n, x in got.items() if x is not None and n not in differ),
           differ={n: float(f"{e:.2e}") for n, e in differ.items()})
    return {n: f"{e:.2e}" for n, e in differ.items() if not e <= 2 ** -8}


@pytest.mark.parametrize("frozen", [False, True], ids=["all-grads", "stage1"])
@pytest.mark.parametrize("shared", [False, True], ids=["fixed", "shared"])
@pytest.mark.parametrize("switch", [*FUSED_BACKWARD, "both"])
def test_fused_backward_kernels_give_the_separate_kernels_results(switch, shared, frozen):
    """``KernelConfig.fuse_q_side`` (``_bwd_q``) and ``fuse_kv_side`` (``_bwd_kv``) at the 8B
    head shape (``_run_at_8b_shape``): the output and every gradient those of the same config
    with the switch off - the same arithmetic in the same order (bit for bit under Triton's
    interpreter, cases ``fused-*``; compiled apart, a product may contract into an FMA in one
    kernel and not in the other, so here within one bf16 rounding, 2^-8, and the report says
    which ones are bit for bit) - and each fused kernel ran exactly where it applies (stage 1
    asks for no dk / dv: no key side to fuse)."""
    switches = list(FUSED_BACKWARD) if switch == "both" else [switch]
    want, ran_off = _run_at_8b_shape({n: False for n in switches}, switches, shared, frozen)
    got, ran_on = _run_at_8b_shape({n: True for n in switches}, switches, shared, frozen)
    expect = [int(not (frozen and n == "fuse_kv_side")) for n in switches]
    assert ran_off == [0] * len(switches) and ran_on == expect, (ran_on, expect)
    bad = _same_results(got, want, "fused_backward", f"{switch}-{'shared' if shared else 'fixed'}"
                        f"-{'stage1' if frozen else 'all-grads'}")
    assert not bad, f"{switch}: the fused kernels' results differ from the separate ones: {bad}"


#: options of the default config, each off against on: (``KernelConfig`` changes off, on, the
#: ``TRACE.calls`` counter that says the option ran)
SAME_RESULT_OPTIONS = {"kv_one_program": (dict(kv_one_program=False),
                                           dict(kv_one_program=True), "kv_one_program"),
                       "state_sums_mma": (dict(state_sums_mma=False), dict(state_sums_mma=True),
                                          "state_sums_mma")}


@pytest.mark.parametrize("shared", [False, True], ids=["fixed", "shared"])
@pytest.mark.parametrize("option", list(SAME_RESULT_OPTIONS))
def test_options_give_the_same_results(option, shared):
    """Options of the default config at the 8B head shape (``_run_at_8b_shape``), on against
    off: the output and every gradient within one bf16 rounding, and the option ran where on
    only. ``KernelConfig.kv_one_program`` (the default: one program a key block,
    ``_dkv_la_both``, dv's terms summed in another order) against a key block's dfk programs
    then its dv program; ``state_sums_mma`` (the default: the state kernels'
    vector sums on the tensor cores, u within ~2^-16 of the fp32 sum) against the row
    reductions. The report says which results are bit for bit."""
    off, on, counter = SAME_RESULT_OPTIONS[option]
    counters = [] if counter is None else [counter]
    want, ran_off = _run_at_8b_shape(off, counters, shared, False)
    got, ran_on = _run_at_8b_shape(on, counters, shared, False)
    assert counter is None or (ran_off == [0] and ran_on[0] >= 1), (ran_off, ran_on)
    bad = _same_results(got, want, "options", f"{option}-{'shared' if shared else 'fixed'}")
    assert not bad, f"{option}: results differ with the option on: {bad}"


# ----------------------------------------------------------------------------- routing
def _route(cid, shape, dtype, mode, **kw):
    """A call the kernel does not cover: the pieces run and agree with the reference."""
    check(cid, shape, dtype, mode, expect_fused=False, **kw)


def test_routing_fp16_goes_to_the_pieces():
    _route("fp16", (1, 4, 2, 128, 64, 16, "square"), torch.float16, "hybrid")


def test_routing_head_dim_80_goes_to_the_pieces():
    _route("D80", (1, 4, 2, 128, 80, 16, "square"), torch.bfloat16, "hybrid")


def test_routing_shared_norm_outside_hybrid_goes_to_the_pieces():
    _route("shared_norm-swa_only", (1, 4, 2, 128, 64, 16, "square"), torch.bfloat16, "swa_only",
           shared_norm=True, g=0.1)


def _failure_counts() -> tuple[int, int]:
    """How many tiles were retried (``TRACE.retries``) and calls sent to PyTorch (every
    family's ``TRACE.fallbacks``: the hybrid's and the feature maps') so far
    (``_no_failures_since``)."""
    return len(TRACE.retries), len(TRACE.fallbacks)


def _no_failures_since(counts: tuple[int, int]) -> None:
    """No tiles retried (a config that did not compile: its call then on other tiles, other
    bits) and no call sent to PyTorch since ``counts`` (``_failure_counts``): each would make
    calls that should agree bit for bit differ."""

    got = (TRACE.retries[counts[0]:], TRACE.fallbacks[counts[1]:])
    assert not any(got), "tiles retried: {}; fell back to PyTorch: {}".format(*got)


class _LayerAt8BHeads:
    """A layer's call at the 8B head shape (H 8, Hkv 2, D 128, T 300, window 64), the maps
    folded in, the second row left-padded by 37: inputs drawn from ``seed`` (q, k, v as views
    of (B, T, H, D) memory, an output gate g per position and channel, dO)."""

    B, H, Hkv, T, D = 2, 8, 2, 300, 128
    #: what ``run`` returns, in order
    NAMES = ("out", "dq", "dk", "dv", "dg", "dWq", "dWk")

    def __init__(self, seed: int):
        B, H, Hkv, T, D = self.B, self.H, self.Hkv, self.T, self.D
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.maps = [HedgehogFeatureMap(n, D, seed=s).to(DEVICE) for n, s in ((H, 1), (Hkv, 2))]
        self.q, self.k, self.v = (torch.randn(B, T, n, D, device=DEVICE, generator=gen)
                                  .bfloat16().transpose(1, 2) for n in (H, Hkv, Hkv))
        self.g = torch.rand(B, H, T, D, device=DEVICE, generator=gen).bfloat16()
        self.do = torch.randn(B, H, T, D, device=DEVICE, generator=gen)
        self.kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        self.kpm[1, :37] = False

    def run(self, backend: str, mode: str, gated: bool = True, held=None) -> list:
        """[out, dq, dk, dv, dg, dWq, dWk] of one call (g the gate, or 0.5 without
        ``gated``: dg None); ``held``: a list to append the bytes the forward left allocated."""
        q, k, v = (x.detach().clone().requires_grad_() for x in (self.q, self.k, self.v))
        g = self.g.detach().clone().requires_grad_() if gated else 0.5
        for m in self.maps:
            m.zero_grad()
        before = torch.cuda.memory_allocated() if held is not None else 0
        out = hybrid_attention(q, k, v, None, None, maps=self.maps, window=64, g=g, mode=mode,
                               key_padding_mask=self.kpm, backend=backend)
        if held is not None:
            held.append(torch.cuda.memory_allocated() - before)
        (out.float() * self.do).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad, g.grad if gated else None] + \
            [m.weight.grad for m in self.maps]


@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only"])
def test_output_gate_takes_a_kernel_call_per_branch(mode):
    """A g per channel and position (output-gate mixers): each branch its own kernel call,
    mixed in PyTorch (``triton_hybrid._gated``), against the reference: output and the
    gradients of q, k, v, the maps' weights and g, at the 8B head shape with padding. Each
    branch call at weight 1 saves its output as its branch (``hybrid.gated``):
    bit for bit the results of the calls storing a copy, with one (B, H, T, D) branch less
    allocated after the forward per such call."""
    _kernels()
    from gated_copies import branches_copied
    layer = _LayerAt8BHeads(seed=3)
    B, H, T, D = layer.B, layer.H, layer.T, layer.D

    def run(backend, held=None):
        return layer.run(backend, mode, held=held)

    calls, gated = TRACE.calls["hybrid.forward"], TRACE.calls["hybrid.gated"]
    failures = _failure_counts()
    got = run("triton")
    assert TRACE.calls["hybrid.forward"] - calls == (2 if mode == "hybrid" else 1)
    assert TRACE.calls["hybrid.gated"] == gated + 1
    # the bytes allocated by the forward, each way, after the first call made the cached
    # constants (``_filled``: 1.5-2 KB that the first call alone allocates)
    on_cuda = torch.device(DEVICE).type == "cuda"
    held = [] if on_cuda else None
    again = run("triton", held)
    copied = [] if on_cuda else None
    with branches_copied():
        got_copied = run("triton", copied)
    _no_failures_since(failures)
    for a, b, c in zip(got, got_copied, again):
        assert (a is None and b is None and c is None) or (torch.equal(a, b) and
                                                              torch.equal(a, c))
    if on_cuda:  # (every branch call is at weight 1 here: no SSD)
        branch = B * H * T * D * 2
        assert held[0] <= copied[0] - (2 if mode == "hybrid" else 1) * branch, (held, copied)
    want = run("reference")
    for name, a, b in zip(layer.NAMES, got, want):
        if b is None or (name.startswith("dW") and not b.any()):  # (swa_only: the maps
            # take none; on the reference path they ran, their gradients zeros)
            assert a is None or not a.any(), name
        else:
            assert rel_err(a, b) < 2e-2, (name, rel_err(a, b))


@pytest.mark.parametrize("mode,mixer", [("hybrid", "fixed"), ("hybrid", "gate"),
                                        ("la_only", "gate"), ("swa_only", "gate")])
def test_the_layer_reads_no_memory_nobody_wrote(mode, mixer):
    """The layer's call (maps folded in, padding, the 8B head shape) three times: twice as
    usual, then with every uninitialised allocation poisoned (``poison.Poisoned``: NaN, a large
    integer, True). Output and every gradient must be bit for bit the same each time: two clean
    calls that differ point to a race or an order the device does not keep (a run's values
    depend on timing), a poisoned call that differs to a read of memory nobody wrote (they
    depend on what the allocator hands out). An output gate's la_only call has read a
    different output on a second identical call on a GPU: this test tells the two apart,
    and a third cause first: a config that did not compile on the first call (its tiles
    retried, ``TRACE.retries``; or the call sent to the pieces), which the gate's test now reports
    too."""
    from poison import Poisoned

    _kernels()
    layer = _LayerAt8BHeads(seed=5)

    def run():
        return layer.run("triton", mode, gated=mixer == "gate")

    calls, failures = TRACE.calls["hybrid.forward"], _failure_counts()
    first, second = run(), run()
    with Poisoned() as poison:
        poisoned = run()
    assert TRACE.calls["hybrid.forward"] > calls and poison.count > 0
    _no_failures_since(failures)

    def differ(a, b):
        return [n for n, x, y in zip(layer.NAMES, a, b)
                if not ((x is None and y is None) or (x is not None and y is not None
                                                      and torch.equal(x, y)))]

    raced, unwritten = differ(first, second), differ(first, poisoned)
    assert not raced, f"two identical calls differ in {raced}: a race or unkept order"
    assert not unwritten, f"the call with poisoned allocations differs in {unwritten}: " \
        "a read of memory nobody wrote"


def test_routing_kv_cache_call_goes_to_the_pieces():
    """Fewer queries than keys (decoding with a cache)."""
    _kernels()
    B, H, Hkv, T, D = 1, 4, 2, 96, 64
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    q = torch.randn(B, H, 1, D, device=DEVICE, generator=gen).bfloat16()
    k, v = (torch.randn(B, Hkv, T, D, device=DEVICE, generator=gen).bfloat16() for _ in range(2))
    fq = HedgehogFeatureMap(H, D).to(DEVICE)(q)
    fk = HedgehogFeatureMap(Hkv, D).to(DEVICE)(k)
    calls = TRACE.calls["hybrid.forward"]
    got = hybrid_attention(q, k, v, fq, fk, window=16, backend="triton")
    want = hybrid_attention(q, k, v, fq, fk, window=16, backend="reference")
    assert TRACE.calls["hybrid.forward"] == calls
    assert rel_err(got, want) < 1e-2


def test_auto_uses_the_fused_kernel():
    _kernels()
    assert backends.triton_enabled()
    calls = TRACE.calls["hybrid.forward"]
    shape = (1, 4, 2, 128, 64, 16, "square")
    run("auto", shape, torch.bfloat16, "hybrid")
    assert TRACE.calls["hybrid.forward"] == calls + 1


def test_output_and_gradients_stay_in_the_models_memory():
    """transformers hands attention q, k, v as (B, H, T, D) views of (B, T, H, D) projections
    and transposes the output back: the fused path writes its output, and the gradients that
    reach q, k, v (the kernel's plus the feature maps'), in that memory, so that neither the
    layer's transpose-reshape nor autograd copies them (the kernel wrote contiguous (B, H, T,
    D) tensors until 2026-12-03: ~0.5 ms of copies per layer at 64k)."""
    _kernels()
    B, H, Hkv, T, D = 2, 8, 2, 300, 128
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    base = {n: torch.randn(B, T, h, D, device=DEVICE, generator=gen).bfloat16().requires_grad_()
            for n, h in (("q", H), ("k", Hkv), ("v", Hkv))}
    q, k, v = (base[n].transpose(1, 2) for n in "qkv")
    seen = {}
    for n, x in zip("qkv", (q, k, v)):
        x.register_hook(lambda g, n=n: seen.__setitem__(n, g.stride()))
    phi_q = HedgehogFeatureMap(H, D, seed=1).to(DEVICE)
    phi_k = HedgehogFeatureMap(Hkv, D, seed=2).to(DEVICE)
    calls = TRACE.calls["hybrid.forward"]
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=64)
    assert TRACE.calls["hybrid.forward"] == calls + 1, "the fused kernel did not run"
    assert out.stride() == q.stride() and out.transpose(1, 2).is_contiguous()
    out.float().square().sum().backward()
    assert seen == {"q": q.stride(), "k": k.stride(), "v": v.stride()}, seen


def test_fast_launch_gives_tritons_results_bit_for_bit(monkeypatch):
    """``triton_common.FastLaunch``: the layer's forward + backward through the cached compiled
    handles (every launch after the first of its key) equals, bit for bit, the same call
    launched through Triton's own path (``HEDGECATS_TRITON_FAST_LAUNCH=0``); q, k, v 2 bytes
    off a 16-byte boundary (Triton compiles other kernels for them) still give those results
    through the fast path, which then runs their own handles."""
    from hedgecats.models.ops import triton_common as tc

    _kernels()
    B, H, Hkv, T, D = 2, 8, 2, 300, 128
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    phi_q = HedgehogFeatureMap(H, D, seed=1).to(DEVICE)
    phi_k = HedgehogFeatureMap(Hkv, D, seed=2).to(DEVICE)

    def inputs(offset: int):
        flat = {n: torch.randn(B * T * h * D + offset, device=DEVICE, generator=gen).bfloat16()
                for n, h in (("q", H), ("k", Hkv), ("v", Hkv))}
        return {n: x[offset:].view(B, T, -1, D).transpose(1, 2) for n, x in flat.items()}

    def step(x):
        q, k, v = (x[n].detach().requires_grad_() for n in "qkv")
        out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=64)
        out.float().square().sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad]

    for offset in (0, 1):  # 1 bf16 element: 2 bytes past the allocation's aligned start
        x = inputs(offset)
        assert (x["q"].data_ptr() % 16 == 0) == (offset == 0)
        monkeypatch.setattr(tc, "FAST_LAUNCH", False)
        calls = TRACE.calls["hybrid.forward"]
        want = step(x)
        monkeypatch.setattr(tc, "FAST_LAUNCH", True)
        step(x)  # (first launch of each key: Triton's path, the handle cached)
        fast = TRACE.calls["launch.fast"]
        got = step(x)
        assert TRACE.calls["hybrid.forward"] == calls + 3, "the fused kernel did not run"
        assert TRACE.calls["launch.fast"] >= fast + 8, "the cached handles were not used"
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            assert torch.equal(a, b), (offset, name, (a.float() - b.float()).abs().max())


# ----------------------------------------------------------------------------- weights_xent
XENT_SHAPES = {  # B, H, Hkv, T, D, projection
    "B2-H8-Hkv2-T300-D128-F256": (2, 8, 2, 300, 128, "square"),
    "B1-H4-Hkv4-T40-D64-F128": (1, 4, 4, 40, 64, "square"),
    "B2-H4-Hkv1-T200-D64-F64": (2, 4, 1, 200, 64, "rectangular"),
    "B1-H8-Hkv2-T2048-D128-F256": (1, 8, 2, 2048, 128, "square"),
}
XENT_CASES = [(s, dt, pad) for s in XENT_SHAPES for dt in ("bf16", "fp32")
              for pad in (False, True) if not (s.startswith("B1-H8") and (dt == "fp32" or pad))]


def _xent_run(fn, q, k, fq0, fk0, kpm):
    fq, fk = fq0.clone().requires_grad_(), fk0.clone().requires_grad_()
    x, e = fn(q, k, fq, fk, key_padding_mask=kpm, return_entropy=True)
    x.backward()
    return {"xent": x.detach().reshape(1), "entropy": e.detach().reshape(1), "dfq": fq.grad,
            "dfk": fk.grad}


def xent_check(cid, shape, dtype, pad, *, underflow=False, activation="softmax", eps=None):
    from hedgecats.models.ops.transfer import dispatch as tx

    if not backends.available("triton"):
        pytest.skip("triton not available")
    B, H, Hkv, T, D, proj = shape
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q = torch.randn(B, H, T, D, device=DEVICE, generator=gen).bfloat16().to(dtype)
    k = torch.randn(B, Hkv, T, D, device=DEVICE, generator=gen).bfloat16().to(dtype)
    with torch.no_grad():
        fq = HedgehogFeatureMap(H, D, activation, proj, seed=1).to(DEVICE)(q.float())
        fk = HedgehogFeatureMap(Hkv, D, activation, proj, seed=2).to(DEVICE)(k.float())
        if underflow:  # disjoint supports: every product of head 0 underflows to 0
            half = fq.shape[-1] // 2
            fq[:, :2, :, half:] = 0
            fk[:, :1, :, :half] = 0
    fq, fk = fq.to(dtype), fk.to(dtype)
    kpm = None
    if pad:
        kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        kpm[0, : T // 5] = False
        kpm[-1, T - T // 7:] = False
    t0 = time.time()
    calls, n_err = TRACE.calls["transfer.xent.forward"], len(TRACE.fallbacks)
    n_retry = len(TRACE.retries)
    kw = {} if eps is None else {"eps": eps}
    got = _xent_run(functools.partial(tx.weights_xent, **kw), q, k, fq, fk, kpm)
    fused = TRACE.calls["transfer.xent.forward"] - calls
    new_errors = TRACE.fallbacks[n_err:]
    same = _xent_run(functools.partial(transfer.weights_xent, **kw), q, k, fq, fk, kpm)
    err = errors(got, same)
    report(test="weights_xent", case=cid, shape=list(shape), dtype=str(dtype), pad=pad,
           fused_calls=fused, vs_blocked_same_dtype={n: float(f"{e:.2e}") for n, e in err.items()},
           xent=got["xent"].item(), entropy=got["entropy"].item(), triton_errors=new_errors,
           tile_retries=TRACE.retries[n_retry:], seconds=round(time.time() - t0, 2))
    assert not new_errors and fused == 1
    assert torch.isfinite(got["xent"]).all() and torch.isfinite(got["dfq"]).all()
    assert got["xent"].item() >= got["entropy"].item() - 1e-4  # Gibbs: xent >= H(A_soft)
    tol = {"xent": 1e-4, "entropy": 1e-4, "dfq": TOL[dtype], "dfk": TOL[dtype]}
    bad = {n: f"{e:.2e}" for n, e in err.items() if not e < tol[n]}
    assert not bad, f"fused weights_xent vs the blocked version in {dtype}: {bad}"


@pytest.mark.parametrize("shape_id,dt,pad", XENT_CASES,
                         ids=[f"{s}-{d}{'-pad' if p else ''}" for s, d, p in XENT_CASES])
def test_weights_xent_matches_blocked(shape_id, dt, pad):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    xent_check(shape_id, XENT_SHAPES[shape_id], dtype, pad)


@pytest.mark.parametrize("activation", ["relu", "exp"])
def test_weights_xent_underflow_and_activations(activation):
    xent_check(f"underflow-{activation}", (2, 4, 2, 130, 64, "square"), torch.float32, True,
               underflow=True, activation=activation)


def test_weights_xent_kernel_floor():
    """A floor large enough to show: k = max(fq.fk + eps, TINY) in both versions."""
    xent_check("floor-0.01", (2, 4, 2, 200, 64, "square"), torch.bfloat16, True, eps=0.01)


# ----------------------------------------------------------------------------- feature maps
PHI_SHAPES = {  # B, H, T, D, projection
    "B2-H8-T300-D128-square": (2, 8, 300, 128, "square"),
    "B2-H8-T300-D128-rectangular": (2, 8, 300, 128, "rectangular"),
    "B1-H4-T40-D64-square": (1, 4, 40, 64, "square"),
}
PHI_CASES = [(s, a) for s in PHI_SHAPES for a in ("softmax", "exp")]


def test_feature_map_hands_its_input_on():
    """``fm(x, with_input=True)`` on CUDA (bf16, the model's (B, T, H, D) layout): x's
    gradient from its other consumer (here x' * c, as the attention uses q) is added in the
    map's backward kernel; x's gradient as close to the fp32 oracle's as autograd's bf16 sum
    of the two, the map's weight and bias gradients the same as without handing x on."""

    if not backends.available("triton"):
        pytest.skip("triton not available")
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    fm = HedgehogFeatureMap(8, 128, seed=2).to(DEVICE)
    with torch.no_grad():
        fm.bias.normal_(0, 0.3, generator=gen)
    x0 = torch.randn(2, 300, 8, 128, device=DEVICE, generator=gen).bfloat16().transpose(1, 2)
    dy = torch.randn(2, 8, 300, 256, device=DEVICE, generator=gen)
    c = torch.randn(2, 8, 300, 128, device=DEVICE, generator=gen)

    def run(dtype, hand_on):
        x = x0.detach().to(dtype).requires_grad_()
        fm.zero_grad()
        if hand_on:
            y, x_on = fm(x, with_input=True)
        else:
            y, x_on = fm(x), x
        ((y.float() * dy).sum() + (x_on.float() * c).sum()).backward()
        return {"y": y.detach(), "dx": x.grad, "dW": fm.weight.grad.clone(),
                "db": fm.bias.grad.clone()}

    added = TRACE.calls["feature_map.backward_added"]
    got = run(torch.bfloat16, True)
    assert TRACE.calls["feature_map.backward_added"] == added + 1, \
        "x's gradients were not summed in the kernel"
    summed = run(torch.bfloat16, False)
    with backends.triton_disabled():
        oracle = run(torch.float32, False)
    assert torch.equal(got["y"], summed["y"]) and torch.equal(got["dW"], summed["dW"]) and \
        torch.equal(got["db"], summed["db"])
    err, err_sum = rel_err(got["dx"], oracle["dx"]), rel_err(summed["dx"], oracle["dx"])
    assert err <= 1.25 * err_sum + 1e-4, f"dx {err:.2e} against autograd's sum {err_sum:.2e}"
    assert got["dx"].stride() == x0.stride()


@pytest.mark.parametrize("other", [False, True], ids=["kernel-only", "other-consumer"])
def test_q_map_backward_starts_from_the_kernels_du(other):
    """The layer's path (``phi_q(q, with_input=True, kernel_du=True)`` into the fused hybrid,
    Llama-3-8B's head shape, bf16, (B, T, H, D) memory, T not a multiple of the state chunk):
    the kernel's dfq pass computes the q map's du and the map's backward starts from it
    (``feature_map.function.DuSlot``). The output and dk, dv bit for bit the path without it;
    dq and
    the q map's weight and bias gradients as close to the fp32 oracle as that path's.
    ``other``: phi(q) feeds a second consumer too, whose gradient must still count."""
    from hedgecats.models.ops.hybrid import dispatch as kdispatch

    if not kdispatch.available():
        pytest.skip("triton not available")
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    H, Hkv, D, B, T = 8, 2, 128, 2, 300
    fq_map, fk_map = (HedgehogFeatureMap(n, D, seed=s).to(DEVICE) for n, s in ((H, 1), (Hkv, 2)))
    with torch.no_grad():
        for m in (fq_map, fk_map):
            m.bias.normal_(0, 0.3, generator=gen)
    q0, k0, v0 = (torch.randn(B, T, n, D, device=DEVICE, generator=gen).bfloat16()
                  .transpose(1, 2) for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, device=DEVICE, generator=gen)
    c = torch.randn(B, H, T, 2 * D, device=DEVICE, generator=gen)

    def run(dtype, kernel_du):
        q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q0, k0, v0))
        for m in (fq_map, fk_map):
            m.zero_grad()
        fq, q_on = fq_map(q, with_input=True, kernel_du=kernel_du)
        fk, k_on = fk_map(k, with_input=True)
        out = hybrid_attention(q_on, k_on, v, fq, fk, window=64, mode="hybrid", g=0.5)
        loss = (out.float() * do).sum() + ((fq.float() * c).sum() if other else 0.0)
        loss.backward()
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "dWq": fq_map.weight.grad.clone(), "dbq": fq_map.bias.grad.clone(),
                "dWk": fk_map.weight.grad.clone()}

    before = TRACE.calls.copy(), TRACE.calls["hybrid.map_du"]
    got = run(torch.bfloat16, True)
    assert TRACE.calls["hybrid.map_du"] == before[1] + 1, "the kernel did not compute the q map's du"
    taken = "feature_map.du_added" if other else "feature_map.du_from_kernel"
    assert TRACE.calls[taken] == before[0].get(taken, 0) + 1, \
        f"the map's backward did not take du ({taken})"
    plain = run(torch.bfloat16, False)
    assert TRACE.calls["hybrid.map_du"] == before[1] + 1, "kernel_du=False still computed du"
    with backends.triton_disabled():
        oracle = run(torch.float32, False)
    for name in ("out", "dk", "dv", "dWk"):
        assert torch.equal(got[name], plain[name]), name
    for name in ("dq", "dWq", "dbq"):
        err, err_plain = rel_err(got[name], oracle[name]), rel_err(plain[name], oracle[name])
        assert err <= 1.25 * err_plain + 1e-4, f"{name} {err:.2e} against {err_plain:.2e}"
    assert got["dq"].stride() == q0.stride()


@pytest.mark.parametrize("frozen", [(), ("q", "k", "v")], ids=["stage2", "stage1"])
def test_maps_folded_into_the_kernel_are_their_own_functions(frozen, monkeypatch):
    """The layer's call (``hybrid_attention(maps=(phi_q, phi_k))``: the maps inside the fused
    kernel's autograd Function) against the call before it (the maps as their own Functions,
    q and k handed on, the q map's du from the kernel), Llama-3-8B's head shape, bf16,
    (B, T, H, D) memory, padding, T not a multiple of the state chunk: the output and every
    gradient bit for bit (the same kernels on the same arguments; the maps of the call before
    on the tiles the folded pair walks on: on others their products round otherwise, mma.sync
    against wgmma), the fold taken both ways.
    ``stage1``: the teacher's q, k, v detached (the maps' gradients only). Under no_grad
    (evaluation, prefill) the forward runs without the autograd Function: the same output."""
    from hedgecats.models.ops.hybrid import attention as hybrid_mod
    from hedgecats.models.ops.hybrid import dispatch as kdispatch
    from hedgecats.models.ops.feature_map import kernels as tp

    if not kdispatch.available():
        pytest.skip("triton not available")
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    H, Hkv, D, B, T = 8, 2, 128, 2, 300
    maps = [HedgehogFeatureMap(n, D, seed=s).to(DEVICE) for n, s in ((H, 1), (Hkv, 2))]
    with torch.no_grad():
        for m in maps:
            m.bias.normal_(0, 0.3, generator=gen)
    q0, k0, v0 = (torch.randn(B, T, n, D, device=DEVICE, generator=gen).bfloat16()
                  .transpose(1, 2) for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, device=DEVICE, generator=gen)
    kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    kpm[1, :37] = False
    kw = dict(window=64, mode="hybrid", g=0.5, key_padding_mask=kpm)
    plan = tp.pair_plan(D, D)  # (the pair's tiles: each map alone takes them below)
    tiles = tp._tiles

    def map_tiles(D, FH, backward):  # (the maps' own forward on the pair's tiles)
        return tiles(D, FH, backward) if backward else (plan.rows, plan.warps)

    def run(folded):
        q, k, v = (x.detach().clone().requires_grad_(n not in frozen)
                   for n, x in zip("qkv", (q0, k0, v0)))
        for m in maps:
            m.zero_grad()
        if folded:
            out = hybrid_attention(q, k, v, None, None, maps=maps, **kw)
        else:  # (each map on the tiles the folded call's pair takes: the same products)
            monkeypatch.setattr(tp, "_tiles", map_tiles)
            fq, fk, q_on, k_on = hybrid_mod._apply_maps(maps, q, k)
            monkeypatch.setattr(tp, "_tiles", tiles)
            out = hybrid_attention(q_on, k_on, v, fq, fk, **kw)
        (out.float() * do).sum().backward()
        return [out.detach(), q.grad, k.grad, v.grad] + [
            p.grad.clone() for m in maps for p in (m.weight, m.bias)]

    before = TRACE.calls["hybrid.maps_folded"], TRACE.calls["hybrid.maps_folded_backward"]
    got = run(True)
    assert (TRACE.calls["hybrid.maps_folded"], TRACE.calls["hybrid.maps_folded_backward"]) == \
        (before[0] + 1, before[1] + 1), "the maps were not folded into the kernel's call"
    want = run(False)
    names = ("out", "dq", "dk", "dv", "dWq", "dbq", "dWk", "dbk")
    for name, a, b in zip(names, got, want):
        assert (a is None and b is None) or torch.equal(a, b), name
    assert got[1] is None or got[1].stride() == q0.stride()
    # evaluation / prefill: the same forward without the autograd Function, bit for bit
    before = TRACE.calls["hybrid.forward_without_autograd"]
    with torch.no_grad():
        out = hybrid_attention(q0, k0, v0, None, None, maps=maps, **kw)
    assert TRACE.calls["hybrid.forward_without_autograd"] == before + 1
    assert torch.equal(out, got[0]), "the forward under no_grad differs from the one under grad"


def test_folded_call_peaks_no_higher_than_the_maps_as_their_own_functions():
    """Peak memory of the layer's call (the maps folded into the kernel's Function) over its
    forward + backward, against the call before the fold, at the 8B head shape: no higher. The
    node's saved branches and LA states live until its backward returns, so through the maps'
    backward, unless the backward empties their storage once its kernels have read them
    (``hybrid.function._release_saved``; the CPU proxy is tests/test_host_work.py), and the
    maps' dx is written over the kernel's dq / dk (``python -m benchmarks.fold_memory`` takes
    the peak apart). The message gives both phases of both calls."""
    from hedgecats.models.ops.hybrid import attention as hybrid_mod
    from hedgecats.models.ops.hybrid import dispatch as kdispatch

    if not kdispatch.available():
        pytest.skip("triton not available")
    gen = torch.Generator(device=DEVICE).manual_seed(12)
    H, Hkv, D, B, T = 32, 8, 128, 1, 8192
    maps = [HedgehogFeatureMap(n, D, seed=s).to(DEVICE) for n, s in ((H, 1), (Hkv, 2))]
    q, k, v = (torch.randn(B, T, n, D, device=DEVICE, generator=gen).bfloat16()
               .transpose(1, 2).requires_grad_() for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, device=DEVICE, generator=gen).bfloat16()

    def peak(folded):
        for x in (q, k, v):
            x.grad = None
        for m in maps:
            m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if folded:
            out = hybrid_attention(q, k, v, None, None, maps=maps, window=64)
        else:
            fq, fk, q_on, k_on = hybrid_mod._apply_maps(maps, q, k)
            out = hybrid_attention(q_on, k_on, v, fq, fk, window=64)
            del fq, fk, q_on, k_on
        torch.cuda.synchronize()
        forward = (torch.cuda.max_memory_allocated() - base) / 2**30
        out.backward(do)
        del out
        torch.cuda.synchronize()
        return round(forward, 3), round((torch.cuda.max_memory_allocated() - base) / 2**30, 3)

    peak(True), peak(False)  # (compiled, allocator warm)
    folded, unfolded = peak(True), peak(False)
    assert folded[1] <= unfolded[1] + 0.01, \
        f"GiB (forward, fwd + bwd): folded {folded}, before the fold {unfolded}"


@pytest.mark.parametrize("floor", [0.0, 1e-3])
def test_feature_map_module_takes_the_fused_kernel(floor):
    """HedgehogFeatureMap on CUDA in bf16 is ops.feature_map's kernel (GQA keys repeated first,
    the floor applied after), bit for bit, gradients included; with HEDGECATS_TRITON=0 it is
    not."""
    from hedgecats.models.ops.feature_map import dispatch as tp

    if not backends.available("triton"):
        pytest.skip("triton not available")
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    fm = HedgehogFeatureMap(4, 64, seed=5, floor=floor, input_heads=2).to(DEVICE)
    x0 = torch.randn(2, 2, 40, 64, device=DEVICE, generator=gen).bfloat16()

    def run(fn):
        x = x0.detach().clone().requires_grad_()
        fm.zero_grad()
        y = fn(x)
        y.float().square().sum().backward()
        return y.detach(), x.grad, fm.weight.grad.clone()

    calls = TRACE.calls["feature_map.forward"]
    got = run(fm)
    assert TRACE.calls["feature_map.forward"] == calls + 1, \
        "the module did not take the fused kernel"
    want = run(lambda x: tp.hedgehog_features(x.repeat_interleave(2, dim=1), fm.weight, fm.bias,
                                              "softmax").clamp_min(floor))
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    with backends.triton_disabled():
        calls = TRACE.calls["feature_map.forward"]
        run(fm)
        assert TRACE.calls["feature_map.forward"] == calls


#: walking plans (programs a multiprocessor, rows a block, warps, stages), through descriptors
#: or by pointers (x one element past an aligned address: ``tma_ok`` refuses it); "auto": the
#: default's plan
WALKS = {"walk1": ((1, 64, 8, 3), False), "walk1-tma": ((1, 64, 8, 3), True),
         "walk1-tma-s4": ((1, 64, 8, 4), True), "walk2-tma-32x4": ((2, 32, 4, 3), True),
         "auto": (None, True)}


@pytest.mark.parametrize("walk", list(WALKS))
@pytest.mark.parametrize("B,T", [(2, 1000), (1, 40)])
def test_map_pair_on_walking_programs_is_the_grids_bit_for_bit(walk, B, T):
    """The maps' forward pair on walking programs (``feature_map.kernels.PairPlan``, through
    descriptors or by pointers; "auto": the default's plan) against one program a block on
    the walk's own tiles (the same products per row; on other tiles the products round
    otherwise - 32 x 4 takes mma.sync where 64 x 8 takes wgmma): the same bits, at the 8B's
    heads (q map 32, k map 8, D = F/2 = 128), x in (B, T, H, D) memory, T not a multiple of
    the blocks; and each within 1e-2 of the fp32 map."""
    from hedgecats.models.ops.feature_map import kernels as tp
    from hedgecats.models.ops.feature_map import reference

    if not backends.available("triton"):
        pytest.skip("triton not available")
    plan, tma = WALKS[walk]
    plan = tp.pair_plan(128, 128) if plan is None else tp.PairPlan(*plan)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    args = []
    for H, soft in ((32, True), (8, False)):
        x = torch.randn(B, T, H, 128, device=DEVICE, generator=gen).bfloat16()
        if not tma:
            x = torch.empty(x.numel() + 1, device=DEVICE, dtype=x.dtype)[1:].view_as(x).copy_(x)
        args += [x.transpose(1, 2), torch.randn(H, 128, 128, device=DEVICE, generator=gen)
                 / 128 ** 0.5, torch.randn(H, 128, device=DEVICE, generator=gen) * 0.3, soft]
    walks = TRACE.calls["feature_map.forward_walk"], TRACE.calls["feature_map.forward_tma"]
    walked = tp.map_forward_pair(*args, plan=plan)
    assert [TRACE.calls["feature_map.forward_walk"] - walks[0],
            TRACE.calls["feature_map.forward_tma"] - walks[1]] == [1, int(tma)]
    grid = tp.map_forward_pair(*args, plan=tp.PairPlan(None, plan.rows, plan.warps))
    for i, ((yg, *_), (yw, *_)) in enumerate(zip(grid, walked)):
        x, w, b, soft = args[4 * i: 4 * i + 4]
        want = reference.reference_features(x.float(), w, b, "softmax" if soft else "exp")
        assert ((yw.float() - want).norm() / want.norm()).item() < 1e-2
        assert torch.equal(yg, yw), \
            f"map {'qk'[i]}: the walk's output differs from the grid's on its tiles {plan}"


@pytest.mark.parametrize("shape_id,activation", PHI_CASES,
                         ids=[f"{s}-{a}" for s, a in PHI_CASES])
def test_fused_feature_map(shape_id, activation):
    """ops.feature_map's kernels against the fp32 map, next to the module's own bf16 forward:
    values and gradients of x, W and b; the kernel must be about as close to fp32 as the module
    is."""
    from hedgecats.models.ops.feature_map import dispatch as tp
    from hedgecats.models.ops.feature_map import reference

    if not backends.available("triton"):
        pytest.skip("triton not available")
    B, H, T, D, proj = PHI_SHAPES[shape_id]
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    fm = HedgehogFeatureMap(H, D, activation, proj, seed=3).to(DEVICE)
    with torch.no_grad():
        fm.bias.normal_(0, 0.3, generator=gen)
    x0 = torch.randn(B, T, H, D, device=DEVICE, generator=gen).bfloat16().transpose(1, 2)
    dy = torch.randn(B, H, T, fm.feature_dim, device=DEVICE, generator=gen).bfloat16().float()

    def run(fn, dtype):
        x = x0.detach().to(dtype).requires_grad_()
        fm.zero_grad()
        y = fn(x)
        y.float().backward(dy)
        return {"y": y.detach(), "dx": x.grad, "dW": fm.weight.grad.clone(),
                "db": fm.bias.grad.clone()}

    t0 = time.time()
    calls, n_err = TRACE.calls["feature_map.forward"], len(TRACE.fallbacks)
    got = run(lambda x: tp.hedgehog_features(x, fm.weight, fm.bias, activation), torch.bfloat16)
    fused = TRACE.calls["feature_map.forward"] - calls
    with backends.triton_disabled():  # the module's own PyTorch path (it takes the kernel now)
        module = run(fm, torch.bfloat16)
    oracle = run(lambda x: reference.reference_features(x, fm.weight, fm.bias, activation),
                 torch.float32)
    vs_oracle, module_vs_oracle = errors(got, oracle), errors(module, oracle)
    new_errors = TRACE.fallbacks[n_err:]
    report(test="feature_map", case=activation, shape=shape_id, dtype="torch.bfloat16",
           fused_calls=fused, vs_fp32_oracle={n: float(f"{e:.2e}") for n, e in vs_oracle.items()},
           vs_reference_same_dtype=errors(got, module),
           module_vs_oracle={n: float(f"{e:.2e}") for n, e in module_vs_oracle.items()},
           triton_errors=new_errors, seconds=round(time.time() - t0, 2))
    assert not new_errors and fused == 1
    bad = {n: f"{e:.2e} (module {module_vs_oracle[n]:.2e})" for n, e in vs_oracle.items()
           if not (e < 1e-2 or e <= 1.25 * module_vs_oracle[n])}
    assert not bad, f"fused feature map vs the fp32 map: {bad}"


# ----------------------------------------------------------------------------- output MSE
MSE_CASES = {  # B, H, T, D, padding, teacher in SDPA's (B, T, H, D) memory layout
    "8b-heads-T1024-pad-sdpa-layout": (2, 32, 1024, 128, True, True),
    "T300-D64": (2, 8, 300, 64, False, False),
    "T37-D96-pad": (3, 4, 37, 96, True, False),
}


@pytest.mark.parametrize("case", list(MSE_CASES))
@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_output_mse_matches_reference(case, dt):
    """ops.transfer.dispatch.masked_mse (the output-MSE objectives' loss) against
    transfer.masked_mse_reference in fp32 on the same inputs: loss and both tensors'
    gradients; padded teacher rows NaN (what a fully masked SDPA row may hold) reach neither."""
    from hedgecats.models.ops.transfer import dispatch as tm

    if not backends.available("triton"):
        pytest.skip("triton not available")
    B, H, T, D, pad, sdpa_layout = MSE_CASES[case]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt]
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    s0 = torch.randn(B, H, T, D, device=DEVICE, generator=gen).to(dtype)
    t0 = (s0.float() + 0.2 * torch.randn(B, H, T, D, device=DEVICE, generator=gen)).to(dtype)
    if sdpa_layout:
        t0 = t0.transpose(1, 2).contiguous().transpose(1, 2)
    kpm = None
    if pad:
        kpm = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
        kpm[0, : T // 5] = False
        kpm[-1, T - T // 7:] = False
        t0 = t0.masked_fill(~kpm[:, None, :, None], float("nan"))

    def run(fn, cast):  # (detached first: .to() of the same dtype is the tensor itself)
        s = s0.detach().to(cast).requires_grad_()
        t = t0.detach().to(cast).requires_grad_()
        loss = fn(s, t, kpm)
        (2.0 * loss).backward()
        return {"loss": loss.detach().reshape(1), "ds": s.grad, "dt": t.grad}

    t_start = time.time()
    calls, n_err = TRACE.calls["transfer.mse.backward"], len(TRACE.fallbacks)
    got = run(tm.masked_mse, dtype)
    fused = TRACE.calls["transfer.mse.backward"] - calls
    want = run(transfer.masked_mse_reference, torch.float32)
    err = errors(got, want)
    new_errors = TRACE.fallbacks[n_err:]
    report(test="output_mse", case=case, dtype=str(dtype), fused_calls=fused,
           vs_fp32_oracle={n: float(f"{e:.2e}") for n, e in err.items()},
           triton_errors=new_errors, seconds=round(time.time() - t_start, 2))
    assert not new_errors and fused == 1
    tol = {"loss": 1e-5, "ds": 1e-5 if dtype == torch.float32 else 8e-3}
    tol["dt"] = tol["ds"]
    bad = {n: f"{e:.2e}" for n, e in err.items() if not e < tol[n]}
    assert not bad, f"fused output MSE vs the fp32 reference in {dtype}: {bad}"
