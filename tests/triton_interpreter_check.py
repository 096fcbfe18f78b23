"""The Triton kernels on CPU through Triton's interpreter, against the PyTorch references.

    TRITON_INTERPRET=1 python tests/triton_interpreter_check.py [--quick] [--poison] [--reverse]
        [--shard K/N] [ids] > r.jsonl

Run by tests/test_triton_interpreter.py in a subprocess (the interpreter must be switched on
before the kernels are defined, and must not be on in a process that runs them on a GPU).
Prints one JSON line per case: its id, dtype, the relative L2 error of every output and
gradient against the reference (fp32, on the same inputs) and the tolerance.

Three shims make Triton 3.6's interpreter usable here, each for a bug of the interpreter, not
of the kernels: it multiplies bf16 dot operands as raw uint16 bits, it rounds fp32 -> bf16 casts
by truncation (the GPU rounds to nearest even), and it calls ``int()`` on 1-element arrays,
which NumPy 2 refuses.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch
from hedgecats.models.ops.instrument import TRACE
try:
    from poison import Poisoned  # run as a script: tests/ is first on the path
except ImportError:  # imported as tests.triton_interpreter_check (benchmarks, experiments)
    from tests.poison import Poisoned


def _install_shims() -> None:
    import triton.language as tl
    import triton.runtime.interpreter as ti

    dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def f32(x):
            if x.dtype.scalar == tl.bfloat16:
                return ti.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32),
                                       tl.float32)
            return x
        return dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    cast = ti.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = src.data.astype(np.float32).view(np.uint32).astype(np.uint64)
            r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            return ti.TensorHandle(r, tl.bfloat16)
        return cast(self, src, dst_type)

    patch = ti._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    ti.InterpreterBuilder.create_dot = create_dot
    ti.InterpreterBuilder.cast_impl = cast_impl
    ti._patch_lang_tensor = patch_lang_tensor


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def errors(got: dict, want: dict) -> dict:
    out = {}
    for name, w in want.items():
        g = got.get(name)
        if w is None or not bool(w.abs().max() > 0):
            out[name] = 0.0 if g is None or not bool(g.abs().max() > 0) else float("inf")
        elif g is None:
            out[name] = float("inf")
        else:
            out[name] = rel(g, w) if torch.isfinite(g).all() else float("nan")
    return out


TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def _floors():
    """Kernel floors to test with, large enough to matter (the references add the floor to every
    kernel value, ops.reference.LA_EPS)."""
    return 0.3, 0.05, True
SMALL = dict(block_m=16, block_n=16, state_chunk=16, bwd_block_m=16, bwd_block_n=16,
             state_f=16, state_d=16, f_chunk=16)  # F = 32: two feature slices
MIXED = dict(block_m=32, block_n=16, state_chunk=32, bwd_block_m=16, bwd_block_n=32,
             state_f=16, state_d=16, f_chunk=32)
#: the backward's query tiles taller than its key tiles, as the GPU's bf16 D >= 128 tiles are
#: (64 x 32 with state_chunk 64): a key block not aligned to a query tile (GPU run of
#: 2026-12-02: dk, dv, dfk off by 0.2 in every bf16 D = 128 case; fixed, this case failed)
TALL_BWD = dict(block_m=16, block_n=16, state_chunk=32, bwd_block_m=32, bwd_block_n=16,
                state_f=16, state_d=16, f_chunk=16)

#: the GPU's bf16 D >= 128 tiles since 2026-12-02 in miniature: LA states every 4 key tiles of the
#: backward and 2 query tiles of the forward (state_chunk 128 over 64 x 64 / 64 x 32 tiles)
LONG_CHUNK = dict(block_m=32, block_n=32, state_chunk=64, bwd_block_m=32, bwd_block_n=16,
                  state_f=16, state_d=16, f_chunk=16)
#: the key-side backward at its own key tile (``dkv_block_n``): the window kernel, the dfk and
#: the dv programs at 32 keys, the query-side kernels at ``bwd_block_n`` 16
DKV_TILE = dict(LONG_CHUNK, dkv_block_n=32)
#: the forward with the query heads of a kv head packed into one program (``pack_heads``):
#: 32 rows = 16 positions of 2 heads; with block_m 64 and 4 heads, 16 positions of 4
PACKED = dict(block_m=32, block_n=16, state_chunk=32, bwd_block_m=16, bwd_block_n=16,
              state_f=16, state_d=16, f_chunk=16, pack_heads=2)
PACKED4 = dict(PACKED, block_m=64, pack_heads=4)
#: the query-side backward packed (``dq_block_m`` 32 / 64 rows: 16 positions of 2 / 4 heads):
#: PACKED_DQ alone (its forward's 16 rows leave no head 16 positions: one head a program),
#: PACKED4_DQ with the forward packed too
PACKED_DQ = dict(PACKED, block_m=16, dq_block_m=32)
PACKED4_DQ = dict(PACKED4, dq_block_m=64)
#: one dfq program over all F features (``grad_f_chunk`` = F = 32 at D 16): where the kernel
#: computes the q map's du (``_bwd_dfq``'s MAP_DU)
MAP_DU = dict(PACKED4_DQ, grad_f_chunk=32)


def _inputs(B, H, Hkv, T, D, dtype, seed, features):
    from hedgecats.models import HedgehogFeatureMap

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    if features == "rand":
        F = 2 * D
        fq = torch.rand(B, H, T, F, generator=g).to(dtype)
        fk = torch.rand(B, Hkv, T, F, generator=g).to(dtype)
    else:
        with torch.no_grad():
            fq = HedgehogFeatureMap(H, D, features, seed=1)(q.float()).to(dtype)
            fk = HedgehogFeatureMap(Hkv, D, features, seed=2)(k.float()).to(dtype)
    do = torch.randn(B, H, T, D, generator=g).to(dtype).float()  # representable in dtype
    return q, k, v, fq, fk, do, g


def _kpm(B, T):
    kpm = torch.ones(B, T, dtype=torch.bool)
    kpm[0, :7] = False  # left padding
    kpm[-1, T - 5:] = False  # right padding
    kpm[-1, 20:23] = False  # a hole
    return kpm


def kernel_case(cid, *, B=2, H=4, Hkv=2, T=50, D=16, window=8, shift=None, shared=False,
                has_swa=True, has_la=True, pad=False, dtype=torch.float32, cfg=SMALL,
                per_bh_shift=False, features="rand", seed=0, eps=None, frozen=(),
                expect_split=None, model_layout=False):
    """hybrid_kernel vs kernel_reference: outputs and gradients of all 8 inputs; those named
    in ``frozen`` (of q, k, v) take no gradient (stage 1: the teacher's q, k, v), so the
    kernels skip their passes: their grads must stay None and the others unchanged.
    ``expect_split``: whether the LA states must have been built split (None: as configured).
    ``model_layout``: q, k, v as (B, H, T, D) views of (B, T, H, D) memory (transformers'
    projections); the output and their gradients must come back in that memory (no copies)."""
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function as kfunction
    from hedgecats.models.ops.hybrid import reference as kreference

    q, k, v, fq, fk, do, g = _inputs(B, H, Hkv, T, D, dtype, seed, features)
    if model_layout:
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    ca, cb, logs = torch.rand(B, H, generator=g), torch.rand(B, H, generator=g), \
        torch.randn(B, H, generator=g)
    sh = torch.full((B, H), window if shift is None else shift, dtype=torch.int32)
    if per_bh_shift:
        sh[0, 1] = 0
        sh[-1, 0] = 0
    kpm = _kpm(B, T) if pad else None
    eps = _floors()[0] if eps is None else eps
    kw = dict(window=window, scale=D ** -0.5, eps=eps, key_padding_mask=kpm,
              has_swa=has_swa, has_la=has_la, shared=shared)
    names = ["out", "dq", "dk", "dv", "dfq", "dfk", "dca", "dcb", "dlogs"]
    ins = [t.clone().requires_grad_(name[1:] not in frozen)
           for name, t in zip(names[1:], (q, k, v, fq, fk, ca, cb, logs))]
    calls = TRACE.calls.copy()
    out = kfunction.hybrid_kernel(*ins, sh, config=kconfig.KernelConfig(**cfg), **kw)
    out.float().backward(do)
    ran = {n: TRACE.calls["hybrid." + n] - calls["hybrid." + n]
           for n in ("dq_pass", "dkv_swa", "dv_la", "factors_from_saved", "split_states",
                     "states_from_forward", "packed_forward", "packed_dq")}
    got = dict(zip(names, [out.detach()] + [x.grad for x in ins]))
    # the output and q, k, v's gradients laid out as their inputs (a view of the model's
    # memory in, the same memory out: no copy in its transpose-reshape or grad accumulation)
    laid_out = [out.stride() == ins[0].stride()] + [
        x.grad is None or x.grad.stride() == x.stride() for x in ins[:3]]
    got["layout_ok"] = all(laid_out)
    # the passes that only serve frozen inputs must not run
    skipped = {"dq_pass": "q" in frozen, "dkv_swa": {"k", "v"} <= set(frozen),
               "dv_la": "v" in frozen}
    for n, must_skip in skipped.items():
        if must_skip:
            got[f"{n}_skipped_ok"] = ran[n] == 0
    # the saved branches were read (not silently recomputed), and only when configured
    got["factors_from_saved_ok"] = ran["factors_from_saved"] == int(
        kconfig.KernelConfig(**cfg).save_branches)
    # the backward takes the forward's LA states when they were saved (with the branches)
    conf = kconfig.KernelConfig(**cfg)
    reused = has_la and conf.save_branches
    got["states_from_forward_ok"] = ran["states_from_forward"] == int(reused)
    # the LA states split (the forward's, the backward's own unless reused, the reverse ones)
    # exactly where configured or, by default, past SPLIT_STATES_MIN_CHUNKS chunks
    split = has_la and kconfig.use_split_states(conf, -(-T // conf.state_chunk))
    got["split_states_ok"] = ran["split_states"] == ((2 if reused else 3) if split else 0) and (
        expect_split is None or split == expect_split)
    # the forward packed query heads exactly where the config and the group allow it
    got["packed_ok"] = ran["packed_forward"] == int(kconfig.pack_of(conf, H // Hkv) > 1)
    got["packed_dq_ok"] = ran["packed_dq"] == int(kconfig.dq_pack_of(conf, H // Hkv) > 1)
    for name in frozen:  # a gradient where none was asked for: a wasted pass, or a wrong one
        got[f"{name}_grad_none_ok"] = got.pop(f"d{name}") is None
    ins2 = [t.detach().float().clone().requires_grad_() for t in (q, k, v, fq, fk, ca, cb, logs)]
    ref = kreference.kernel_reference(*ins2, sh, **kw)
    ref.backward(do)
    want = dict(zip(names, [ref.detach()] + [x.grad for x in ins2]))
    flags = {n: 0.0 if got.pop(n) else float("inf") for n in list(got) if n.endswith("_ok")}
    for name in frozen:
        del want[f"d{name}"]
    return {**errors(got, want), **flags}


def _grads_with_forward_poisoned(poison, T: int):
    """The fused kernel's gradients (q, k, v, fq, fk, ca, cb) at a small shape with the saved
    branches on, clean and with ``poison`` applied to what the forward hands the backward
    (``_forward``'s result tuple in, a changed tuple out)."""
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import forward as kforward
    from hedgecats.models.ops.hybrid import function as kfunction

    q, k, v, fq, fk, do, g = _inputs(2, 4, 2, T, 16, torch.float32, 0, "rand")
    ca, cb, logs = torch.rand(2, 4, generator=g), torch.rand(2, 4, generator=g), \
        torch.randn(2, 4, generator=g)
    sh = torch.full((2, 4), 8, dtype=torch.int32)
    cfg = kconfig.KernelConfig(**SMALL, save_branches=True)
    names = ["dq", "dk", "dv", "dfq", "dfk", "dca", "dcb"]

    def grads():
        ins = [t.clone().requires_grad_() for t in (q, k, v, fq, fk, ca, cb, logs)]
        out = kfunction.hybrid_kernel(*ins, sh, window=8, scale=16 ** -0.5, eps=0.3, config=cfg)
        out.backward(do)
        return dict(zip(names, (x.grad for x in ins)))

    clean = grads()
    forward = kforward.launch_forward
    kforward.launch_forward = lambda *a, **kw: poison(forward(*a, **kw))
    try:
        bad = grads()
    finally:
        kforward.launch_forward = forward
    return clean, bad


def _flags(ok: dict) -> dict:
    return {n: 0.0 if good else float("inf") for n, good in ok.items()}


def saved_branches_read_case(cid):
    """The backward with ``save_branches`` reads the forward's stored branches (the launch
    counters only say which path was chosen): halving the stored SWA_t and LA_t must move every
    gradient that depends on SWA_t . dO_t or LA_t . dO_t (dq, dk, dfq, dfk, the mixer's; not dv)."""
    def halve_branches(res):
        o, lse, den, swa_o, la_o, states = res
        return o, lse, den, swa_o * 0.5, la_o * 0.5, states
    clean, bad = _grads_with_forward_poisoned(halve_branches, T=50)
    ok = {f"{n}_moved_ok": rel(bad[n], clean[n]) > 1e-2 for n in clean if n != "dv"}
    ok["dv_unmoved_ok"] = rel(bad["dv"], clean["dv"]) < 1e-6
    return _flags(ok)


def saved_states_read_case(cid):
    """The backward reads the forward's saved LA states (not only the counter): halving them
    must move dfq, the one gradient that reads them (with the saved branches the per-query
    factors come from LA_t itself, and dq, dk, dv, dfk from the window, the keys near their
    block and the reverse states), and leave dq alone."""
    def halve_states(res):
        o, lse, den, swa_o, la_o, (S, z, u, cs) = res
        return o, lse, den, swa_o, la_o, (S * 0.5, z, u, cs)
    clean, bad = _grads_with_forward_poisoned(halve_states, T=70)
    return _flags({"dfq_moved_ok": rel(bad["dfq"], clean["dfq"]) > 1e-2,
                   "dq_unmoved_ok": rel(bad["dq"], clean["dq"]) < 1e-6})


def _layer_call(B, H, D, window, mode, kpm, g_kind, ssd, gen, switches, T=None):
    """(g, the other keyword arguments of ``fused_hybrid`` / ``hybrid_attention``) of a layer
    case: g a float ("float": 0.1 with ``shared_norm``, else 0.3), per head ("head"), an
    output gate per position and channel ("gate": (B, H, T, D)) or per position only
    ("gate-position": (B, 1, T, 1)), drawn from ``gen``; SSD's drops per sample ("sample") or
    per (b, h) ("head", from ``gen``); ``switches`` override the rest."""
    shapes = {"head": (1, H, 1, 1), "gate": (B, H, T, D), "gate-position": (B, 1, T, 1)}
    if g_kind == "float":
        g0 = 0.1 if switches.get("shared_norm") else 0.3
    else:
        g0 = torch.rand(*shapes[g_kind], generator=gen) * 0.8 + 0.1
    swa_drop = None
    if ssd == "sample":
        swa_drop = torch.tensor([True, False]).view(B, 1, 1, 1)
    elif ssd == "head":
        swa_drop = torch.rand(B, H, 1, 1, generator=gen) < 0.5
    args = dict(window=window, mode=mode, shared_norm=False, overlap=False, rescale=False,
                la_span="outside", swa_drop=swa_drop, key_padding_mask=kpm, scale=D ** -0.5,
                eps=_floors()[1])
    args.update(switches)
    return g0, args


def layer_case(cid, *, mode="hybrid", B=2, H=4, Hkv=2, T=45, D=16, window=8, dtype=torch.float32,
               pad=False, g_kind="float", ssd=None, cfg=SMALL, g_in_dtype=False, **switches):
    """fused_hybrid (the kernel behind hybrid_attention's modes) vs
    hybrid_attention(backend="reference"), gradients of q, k, v, fq, fk and a tensor g. An
    output gate (``g_kind`` "gate..."): also against its branch calls each storing its own
    copy of its branch (``gated_copies.branches_copied``), bit for bit, and the
    memory held after the forward (the storages saved for the backward and the output's)
    exactly one (B, H, T, D) branch less for each call at weight 1 ("branch_held_once"),
    where the mix keeps the branches themselves (a g in another dtype than a hybrid call's
    branches mixes fp32 copies of them: there the branches are transient either way, and
    the saving is 0). ``g_in_dtype``: a tensor g in the call's dtype (a bf16 model's gate),
    else fp32."""
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import dispatch as kdispatch
    from gated_copies import branches_copied
    from hedgecats.models.ops.hybrid.attention import hybrid_attention

    q, k, v, fq, fk, do, gen = _inputs(B, H, Hkv, T, D, dtype, 3, "softmax")
    kpm = _kpm(B, T) if pad else None
    g0, args = _layer_call(B, H, D, window, mode, kpm, g_kind, ssd, gen, switches, T)
    if g_in_dtype and torch.is_tensor(g0):
        g0 = g0.to(dtype)

    def run(fn, cast, held=None):
        ins = [t.detach().to(cast).clone().requires_grad_() for t in (q, k, v, fq, fk)]
        gt = g0.clone().requires_grad_() if torch.is_tensor(g0) else g0
        if held is None:
            out = fn(*ins, gt)
        else:  # (each storage saved for the backward, and the output's: bytes by address)
            def pack(t):
                held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = fn(*ins, gt)
            held[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
        out.float().backward(do)
        res = {"out": out.detach(), **{n: x.grad for n, x in zip(["dq", "dk", "dv", "dfq", "dfk"],
                                                                  ins)}}
        if torch.is_tensor(gt):
            res["dg"] = gt.grad
        return res

    def fused(q, k, v, fq, fk, g):
        out = kdispatch.fused_hybrid(q, k, v, fq, fk, g=g, config=kconfig.KernelConfig(**cfg), **args)
        if out is None:
            raise RuntimeError("fused_hybrid declined a case it should take")
        return out

    def reference(q, k, v, fq, fk, g):
        a = {k_: v_ for k_, v_ in args.items() if k_ != "eps"}
        return hybrid_attention(q, k, v, fq, fk, g=g, backend="reference", eps=args["eps"], **a)

    gated = TRACE.calls["hybrid.gated"]
    held = {}
    got = run(fused, dtype, held)
    out = errors(got, run(reference, torch.float32))
    if g_kind.startswith("gate"):  # (a kernel call per branch, mixed in PyTorch)
        out["gated_ran"] = 0.0 if TRACE.calls["hybrid.gated"] == gated + 1 else float("inf")
        copied = {}
        with branches_copied():
            want = run(fused, dtype, copied)
        for n, a in got.items():
            b = want[n]
            same = (a is None and b is None) or (a is not None and b is not None and
                                                  torch.equal(a, b))
            out[f"same_as_copied_{n}"] = 0.0 if same else float("inf")
        mode_ = args["mode"]  # (la_only ignores SSD's drops)
        drop = args["swa_drop"] is not None and mode_ != "la_only"
        at_one = int(mode_ in ("hybrid", "swa_only") and not drop) + int(
            mode_ in ("hybrid", "la_only"))
        branch = B * H * T * D * q.element_size()
        if mode_ == "hybrid" and g0.dtype != dtype:  # (``_gated``'s lerp of fp32 copies)
            at_one = 0
        saved = sum(copied.values()) - sum(held.values())
        out["branch_held_once"] = 0.0 if saved == at_one * branch else float("inf")
    return out


def xent_case(cid, *, B=2, H=4, Hkv=2, T=50, D=16, pad=False, dtype=torch.float32, bm=16, bn=16,
              features="softmax", projection="square", seed=0, underflow=False, eps=None):
    """transfer.xent (the kernel) vs transfer.reference.weights_xent (blocked): value,
    entropy, dfq, dfk."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.transfer import losses as transfer
    from hedgecats.models.ops.transfer import xent as tx

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    with torch.no_grad():
        fq0 = HedgehogFeatureMap(H, D, features, projection, seed=1)(q.float())
        fk0 = HedgehogFeatureMap(Hkv, D, features, projection, seed=2)(k.float())
    if underflow:  # disjoint supports: every product of the first query heads is 0 (< TINY)
        half = fq0.shape[-1] // 2
        fq0[:, :2, :, half:] = 0
        fk0[:, :1, :, :half] = 0
    fq0, fk0 = fq0.to(dtype), fk0.to(dtype)
    kpm = _kpm(B, T) if pad else None

    def run(fn, cast):
        fq, fk = fq0.to(cast).clone().requires_grad_(), fk0.to(cast).clone().requires_grad_()
        x, e = fn(q.to(cast), k.to(cast), fq, fk)
        x.backward()
        return {"xent": x.detach().reshape(1), "entropy": e.reshape(1), "dfq": fq.grad,
                "dfk": fk.grad}

    additive = _floors()[2]
    eps = (0.01 if additive else 0.0) if eps is None else eps

    def fused(q, k, fq, fk):
        xe, ent = tx.xent_rows(q, k, fq, fk, scale=D ** -0.5, key_padding_mask=kpm, eps=eps,
                               block_m=bm, block_n=bn)
        r = torch.ones(B, 1, T) if kpm is None else kpm[:, None].float()
        n = r.sum() * H
        return (xe * r).sum() / n, (ent * r).sum() / n

    def blocked(q, k, fq, fk):
        kw = {"eps": eps} if additive else {}
        return transfer.weights_xent(q, k, fq, fk, key_padding_mask=kpm, return_entropy=True,
                                     **kw)

    return errors(run(fused, dtype), run(blocked, torch.float32))


def xent_entry_case(cid):
    """The entry (``transfer.dispatch.weights_xent``: the kernel under the interpreter) equals
    the blocked version."""
    from hedgecats.models.ops.transfer import dispatch
    from hedgecats.models.ops.transfer import losses as transfer

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 33, 16, generator=g), torch.randn(2, 2, 33, 16, generator=g)
    fq, fk = torch.rand(2, 4, 33, 32, generator=g), torch.rand(2, 2, 33, 32, generator=g)
    kpm = _kpm(2, 33)
    before = TRACE.calls["transfer.xent.forward"]
    got = dispatch.weights_xent(q, k, fq, fk, key_padding_mask=kpm, return_entropy=True)
    ran = TRACE.calls["transfer.xent.forward"] == before + 1
    want = transfer.weights_xent(q, k, fq, fk, key_padding_mask=kpm, return_entropy=True)
    return {"xent": rel(got[0].reshape(1), want[0].reshape(1)),
            "entropy": rel(got[1].reshape(1), want[1].reshape(1)),
            "kernel_ran_ok": 0.0 if ran else float("inf")}


def mse_case(cid, *, B=2, H=3, T=70, D=16, pad=False, dtype=torch.float32, sdpa_layout=False,
             nan_in_padding=False, teacher_grad=False):
    """transfer.dispatch.masked_mse (the kernels) vs transfer.reference.masked_mse_reference
    (fp32, same inputs): loss and
    the gradients; ``sdpa_layout``: the teacher as SDPA returns it ((B, T, H, D) memory);
    ``nan_in_padding``: the teacher's padded rows NaN (neither loss nor gradient may see it)."""
    from hedgecats.models.ops.transfer import dispatch
    from hedgecats.models.ops.transfer import losses as transfer

    g = torch.Generator().manual_seed(11)
    s0 = torch.randn(B, H, T, D, generator=g)
    t0 = (s0 + 0.3 * torch.randn(B, H, T, D, generator=g))
    if sdpa_layout:
        t0 = t0.transpose(1, 2).contiguous().transpose(1, 2)
    kpm = _kpm(B, T) if pad else None
    if nan_in_padding:
        t0 = t0.clone()
        t0[~kpm[:, None, :, None].expand_as(t0)] = float("nan")

    def run(fn, dt):  # (copies: a same-dtype .to() is the tensor itself, and .grad would be
        s = s0.detach().clone().to(dt).requires_grad_()  # shared between the two runs)
        t = t0.detach().clone().to(dt).requires_grad_(teacher_grad)
        loss = fn(s, t, kpm)
        (loss * 3.0).backward()
        out = {"loss": loss.detach().float().reshape(1), "ds": s.grad.float()}
        if teacher_grad:
            out["dt"] = t.grad.float()
        return out

    before = TRACE.calls["transfer.mse.backward"]
    got = run(dispatch.masked_mse, dtype)
    ran = TRACE.calls["transfer.mse.backward"] == before + 1
    want = run(transfer.masked_mse_reference, torch.float32)
    errs = errors(got, want)
    errs["kernel_ran_ok"] = 0.0 if ran else float("inf")
    return errs


def mse_backward_fallback_case(cid):
    """A backward kernel that fails in Triton (OutOfResources): the gradient comes from the
    reference instead, the same one, with padded teacher rows NaN."""
    from hedgecats.models.ops.transfer import dispatch
    from hedgecats.models.ops.transfer import losses as transfer
    from hedgecats.models.ops.transfer import mse as tm
    from triton.runtime.errors import OutOfResources

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(1, 0, "shared memory")
            return launch

    g = torch.Generator().manual_seed(12)
    s0, t0 = torch.randn(2, 3, 40, 16, generator=g), torch.randn(2, 3, 40, 16, generator=g)
    kpm = _kpm(2, 40)
    t0 = t0.masked_fill(~kpm[:, None, :, None], float("nan"))
    kernel, tm._mse_bwd = tm._mse_bwd, Failing()
    n_err = len(TRACE.fallbacks)
    try:
        s = s0.clone().requires_grad_()
        (3.0 * dispatch.masked_mse(s, t0, kpm)).backward()
    finally:
        tm._mse_bwd = kernel
    r = s0.clone().requires_grad_()
    (3.0 * transfer.masked_mse_reference(r, t0, kpm)).backward()
    errs = errors({"ds": s.grad}, {"ds": r.grad})
    new = TRACE.fallbacks[n_err:]
    errs["fallback_taken_ok"] = 0.0 if len(new) == 1 and new[0].startswith("transfer.mse") \
        else float("inf")
    return errs


def phi_case(cid, *, B=2, H=3, T=45, D=16, proj="square", activation="softmax",
             dtype=torch.float32, strided=False, frozen_x=False, heads_first=False,
             with_input=False):
    """feature_map.dispatch.hedgehog_features vs the fp32 map: values and gradients of x, W, b
    (``frozen_x``: x takes no gradient, as stage 1's teacher q, k; dW, db unchanged;
    ``with_input``: x handed on through the map and used by a second consumer (x' * c, c a
    random tensor, as the attention uses q): its gradient added in the map's kernel, against
    autograd's sum)."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.feature_map import dispatch as fmd
    from hedgecats.models.ops.feature_map import reference as fmr

    g = torch.Generator().manual_seed(11)
    fm = HedgehogFeatureMap(H, D, activation, proj, seed=4)
    with torch.no_grad():
        fm.bias.normal_(0, 0.5, generator=g)
    if strided:  # (B, T, H, D) memory, as transformers hands attention q and k
        x0 = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    elif heads_first:  # (H, B, T, D) memory: neither layout the weight gradient reads in place
        x0 = torch.randn(H, B, T, D, generator=g).transpose(0, 1)
    else:
        x0 = torch.randn(B, H, T, D, generator=g)
    x0 = x0.to(dtype)
    dy = torch.randn(B, H, T, fm.feature_dim, generator=g).to(dtype).float()
    c = torch.randn(B, H, T, D, generator=g)

    def run(fn, cast):
        x = x0.detach().to(cast).requires_grad_(not frozen_x)
        fm.zero_grad()
        y = fn(x)
        if with_input:  # (phi(x), x') from the kernel; (phi(x), x) from the reference
            y, x_on = y if isinstance(y, tuple) else (y, x)
            ((y.float() * dy).sum() + (x_on.float() * c).sum()).backward()
        else:
            y.float().backward(dy)
        # dx laid out as x: (B, T, H, D) memory in, the same out (summed with the attention
        # kernel's dq and accumulated without a copy)
        laid_out.append(x.grad is None or x.grad.stride() == x.stride())
        return {"y": y.detach(), "dx": x.grad, "dW": fm.weight.grad.clone(),
                "db": fm.bias.grad.clone()}

    laid_out = []

    before = TRACE.calls["feature_map.backward_dx"], TRACE.calls["feature_map.backward_added"]
    got = run(lambda x: fmd.hedgehog_features(x, fm.weight, fm.bias, activation,
                                              with_input=with_input), dtype)
    dx_passes = TRACE.calls["feature_map.backward_dx"] - before[0]
    dx_added = TRACE.calls["feature_map.backward_added"] - before[1]
    want = run(lambda x: fmr.reference_features(x, fm.weight, fm.bias, activation),
               torch.float32)
    # dx computed only when x takes a gradient
    return {**errors(got, want), "dx_pass": 0.0 if dx_passes == (not frozen_x) else float("inf"),
            "dx_added": 0.0 if dx_added == (with_input and not frozen_x) else float("inf"),
            "dx_layout": 0.0 if laid_out[0] else float("inf")}


def pair_walk_case(cid, *, B=3, Hq=4, Hk=2, T=150, D=64, per_sm=3, tma=False,
                   activations=("softmax", "exp"), stages=3, dtype=torch.bfloat16,
                   several=True):
    """The maps' forward pair on walking programs (``PairPlan(per_sm, ...)``: each program a
    share of one head's row blocks, its weight read once; ``tma``: through tensor descriptors,
    else by pointers, as where ``tma_ok`` refuses: x one element past a 16-byte boundary)
    against the pair on one program a block on the same tiles: bit for bit (the same
    arithmetic per row), both maps, and each against the fp32 map. x in (B, T, H, D) memory;
    T not a multiple of the blocks, heads of both maps split into several programs
    (``walk_split`` on the interpreter's 4 multiprocessors; ``several``: several programs of
    several blocks, some spanning two heads; every program has a block, every block a
    program). bf16 only (``dtype``: the tolerance's)."""
    from hedgecats.models.ops.feature_map import kernels as tp
    from hedgecats.models.ops.feature_map import reference as fmr

    g = torch.Generator().manual_seed(21)
    maps = []
    for H, act in zip((Hq, Hk), activations):
        x = torch.randn(B, T, H, D, generator=g).to(dtype)
        if not tma:  # (a copy one element into a buffer: an address tma_ok refuses)
            x = torch.empty(x.numel() + 1, dtype=dtype)[1:].view_as(x).copy_(x)
        w = torch.randn(H, D, D, generator=g) * D ** -0.5
        maps.append((x.transpose(1, 2), w, torch.randn(H, D, generator=g) * 0.3,
                     act == "softmax"))
    args = [a for m in maps for a in m]
    rows, warps = tp._tiles(D, D, backward=False)
    walks = TRACE.calls["feature_map.forward_walk"], TRACE.calls["feature_map.forward_tma"]
    grid = tp.map_forward_pair(*args, plan=tp.PairPlan(None, rows, warps))
    walked = tp.map_forward_pair(*args, plan=tp.PairPlan(per_sm, rows, warps, stages))
    out = {}
    for name, (x, w, b, soft), (yg, *_), (yw, *_) in zip("qk", maps, grid, walked):
        out[f"same_y{name}"] = 0.0 if torch.equal(yg, yw) else float("inf")
        want = fmr.reference_features(x.float(), w, b, "softmax" if soft else "exp")
        out[f"y{name}"] = rel(yw.float(), want)
    ran = [TRACE.calls["feature_map.forward_walk"] - walks[0],
           TRACE.calls["feature_map.forward_tma"] - walks[1]]
    out["walked"] = 0.0 if ran == [1, int(tma)] else float("inf")
    tiles = (Hq + Hk) * B * tp.cdiv(T, rows)
    programs, tpp = tp.walk_split(tiles, per_sm, torch.device("cpu"))
    covered = (programs - 1) * tpp < tiles <= programs * tpp
    spans = tiles // (Hq + Hk) % tpp != 0  # (some program's blocks span two heads)
    out["split"] = 0.0 if covered and (tpp > 1 and programs > 1 and spans) == several \
        else float("inf")
    return out


#: the backward's fused kernels' ``KernelConfig`` switches (each also its counter in ``TRACE.calls``)
FUSIONS = ("fuse_q_side", "fuse_kv_side")


def fused_case(cid, *, cfg, switch="fuse_q_side", fused: bool = True, B=2, H=4, Hkv=2, T=70,
               D=16, window=10, dtype=torch.float32, frozen=(), map_du=False, one_program=False,
               **kw):
    """A fused backward kernel switched on (``switch``: ``KernelConfig.fuse_q_side``, the dq
    and dfq passes in one kernel, ``_bwd_q``; ``fuse_kv_side``, the window's dk / dv in the LA
    key kernel's dv programs, ``_bwd_kv``; "both") against the same config with it off: the
    output and every gradient bit for bit equal (the same arithmetic in the same order), and
    the fused kernel ran exactly where it applies (``fused``). ``map_du``: phi(q) comes from
    the fused feature map with ``kernel_du`` (the dfq pass writes the map's du). Errors: 0
    where equal, inf where not (tolerance 0 in effect). ``one_program``: instead of a
    switch, ``_bwd_kv`` as one program a key block (``KernelConfig.kv_one_program``) against
    its dfk programs then its dv program (both with ``fuse_kv_side``): dv's terms summed in
    another order, so its errors are the relative errors against the other's results (the
    case's tolerance applies)."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function as kfunction
    from hedgecats.models.ops.feature_map import dispatch as fmd

    q, k, v, fq0, fk0, do, g = _inputs(B, H, Hkv, T, D, dtype, 3, "rand")
    ca, cb, logs = torch.rand(B, H, generator=g), torch.rand(B, H, generator=g), \
        torch.randn(B, H, generator=g)
    sh = torch.full((B, H), window, dtype=torch.int32)
    if kw.pop("per_bh_shift", False):
        sh[0, 1] = 0
    kpm = _kpm(B, T) if kw.pop("pad", False) else None
    args = dict(window=window, scale=D ** -0.5, eps=_floors()[0], key_padding_mask=kpm, **kw)
    maps = [HedgehogFeatureMap(n, D, seed=s) for n, s in ((H, 1), (Hkv, 2))]

    def run(fuse):
        ins = [t.clone().requires_grad_(n not in frozen) for n, t in zip("qkv", (q, k, v))]
        for m in maps:
            m.zero_grad()
        if map_du:
            fq = fmd.hedgehog_features(ins[0], maps[0].weight, maps[0].bias, kernel_du=True)
            fk = fmd.hedgehog_features(ins[1], maps[1].weight, maps[1].bias)
        else:
            fq, fk = (x.clone().requires_grad_() for x in (fq0, fk0))
        mix = [x.clone().requires_grad_() for x in (ca, cb, logs)]
        switches = list(FUSIONS) if switch == "both" else [switch]
        if one_program:
            switches = ["kv_one_program"]
            conf = kconfig.KernelConfig(**{**cfg, "fuse_kv_side": True,
                                      "kv_one_program": fuse})
        else:
            conf = kconfig.KernelConfig(**{**cfg, **{n: fuse for n in switches}})
        before = [TRACE.calls["hybrid." + n] for n in switches]
        out = kfunction.hybrid_kernel(*ins, fq, fk, *mix, sh, config=conf, **args)
        out.float().backward(do)
        grads = [out.detach()] + [x.grad for x in ins + mix]
        grads += [m.weight.grad for m in maps] if map_du else [fq.grad, fk.grad]
        return grads, [TRACE.calls["hybrid." + n] - b for n, b in zip(switches, before)]

    want, ran_off = run(False)
    got, ran_on = run(True)
    expect = [int(fused)] * len(ran_on)
    out = {"ran_where_it_applies": 0.0 if (ran_on, ran_off) == (expect, [0] * len(ran_on))
           else float("inf")}
    for i, (a, b) in enumerate(zip(got, want)):
        same = (a is None and b is None) or (a is not None and b is not None and
                                              torch.equal(a, b))
        if one_program and not same and a is not None and b is not None:
            out[f"t{i}"] = float((a.float() - b.float()).norm() / b.float().norm().clamp_min(
                1e-30))
        else:
            out[f"t{i}"] = 0.0 if same else float("inf")
    return out


def state_sums_case(cid, *, split: bool, pad: bool = False, B=2, H=4, Hkv=2, T=70, D=16,
                    F=32, window=10, cfg=SMALL, dtype=torch.bfloat16):
    """The LA state kernels' vector sums on the tensor cores (``KernelConfig.state_sums_mma``)
    against their row reductions, bf16 inputs, walked or split: the forward's S, z and value
    sums (``_la_states``) and the backward's R, u, w (``_la_states_rev``, the reverse states
    with per-head shifts and a signed DDEN). z, the value sums and w are exact products summed
    in fp32, so they (and S, R: the same products) must agree to fp32 rounding (2^-20 of their
    norm); u takes DDEN in two 16-bit parts, so it must agree to 2^-14 of the norm of the sum
    of |DDEN_t| fq_t (its docstring claims ~2^-16). And the option ran in each state kernel
    it applies to (not the padded forward split share: ``_split_states``). Errors: 0 within
    the bound, inf past it."""
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import states as kstates

    g = torch.Generator().manual_seed(11)
    fk = torch.softmax(torch.randn(B, Hkv, T, F, generator=g), -1).to(dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(dtype)
    fq = torch.softmax(torch.randn(B, H, T, F, generator=g), -1).to(dtype)
    dnum = torch.randn(B, H, T, D, generator=g).to(dtype)
    dden = torch.randn(B * H, T, generator=g)
    shift = torch.full((B, H), window, dtype=torch.int32)
    shift[0, 1] = 0
    kpm_i8 = _kpm(B, T).to(torch.int8) if pad else None

    def states(on: bool, dd=dden):
        conf = kconfig.KernelConfig(**{**cfg, "split_states": split, "state_sums_mma": on})
        before = TRACE.calls["hybrid.state_sums_mma"]
        S, z, vs, NC = kstates.la_states(fk, v, kpm_i8, conf)
        R, U, W = kstates.la_states_rev(fq, dnum, dd, shift, Hkv, NC, conf)
        return (S, z, vs, R, U, W), TRACE.calls["hybrid.state_sums_mma"] - before

    got, ran = states(True)
    want, ran_off = states(False)
    u_scale = states(False, dden.abs())[0][4].norm()

    def within(a, b, bound, scale=None):
        scale = b.float().norm() if scale is None else scale
        return 0.0 if (a.float() - b.float()).norm() <= bound * scale else float("inf")

    exact = 2.0 ** -20
    out = {n: within(a, b, exact) for n, a, b in zip(("S", "z", "vs", "R"), got, want)}
    out["w"] = within(got[5], want[5], exact)
    out["u"] = within(got[4], want[4], 2.0 ** -14, u_scale)
    out["ran_where_it_applies"] = 0.0 if (ran, ran_off) == (1 if split and pad else 2, 0) \
        else float("inf")
    return out


def map_du_case(cid, *, B=2, H=4, Hkv=2, T=150, D=16, window=20, activation="softmax",
                other=False, frozen_q=False, pad=False, cfg=None, dtype=torch.bfloat16,
                expect_du=True, twice=False, watched=False):
    """The layer's q map and the fused kernel together, the map's backward starting from the
    du the kernel's dfq pass computes (``feature_map.function.DuSlot``: ``kernel_du``),
    against the fp32 maps and ``kernel_reference``: the output and the gradients of q, k, v
    and both maps' weight and bias. q, k, v as transformers lays them out. ``other``: phi(q) has a second
    consumer ((fq * c).sum(), c random) whose gradient must still count (the map adds the
    kernel's du to the du of the gradient autograd summed); ``frozen_q``: stage 1 (q takes no
    gradient); ``expect_du``: whether the config lets the kernel compute du (one dfq program
    over all F features); ``twice``: phi(q) goes to two kernel calls (their outputs summed):
    the first hands du back, the second dfq, added in the map's backward; ``watched``: phi(q)
    retains its gradient: the kernel hands back dfq, which must be the reference's dphi)."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function as kfunction
    from hedgecats.models.ops.hybrid import reference as kreference
    from hedgecats.models.ops.feature_map import dispatch as fmd
    from hedgecats.models.ops.feature_map import reference as fmr

    g = torch.Generator().manual_seed(5)
    maps = [HedgehogFeatureMap(n, D, activation, seed=s) for n, s in ((H, 1), (Hkv, 2))]
    with torch.no_grad():
        for m in maps:
            m.bias.normal_(0, 0.5, generator=g)
    q0, k0, v0 = (torch.randn(B, T, n, D, generator=g).transpose(1, 2)
                  for n in (H, Hkv, Hkv))
    F = maps[0].feature_dim
    do = torch.randn(B, H, T, D, generator=g)
    c = torch.randn(B, H, T, F, generator=g)
    ca = torch.rand(B, H, generator=g)
    cb, logs = 1 - ca, torch.zeros(B, H)
    sh = torch.full((B, H), window, dtype=torch.int32)
    kpm = _kpm(B, T) if pad else None
    kw = dict(window=window, scale=D ** -0.5, eps=_floors()[0], key_padding_mask=kpm)

    def run(fused):
        cast = dtype if fused else torch.float32
        q = q0.to(dtype).to(cast).requires_grad_(not frozen_q)
        k, v = (x.to(dtype).to(cast).requires_grad_() for x in (k0, v0))
        for m in maps:
            m.zero_grad()
        (mq, mk) = maps
        if fused:
            fq = fmd.hedgehog_features(q, mq.weight, mq.bias, activation,
                                       with_input=not frozen_q, kernel_du=True)
            fq, q_on = (fq, q) if frozen_q else fq
            fk, k_on = fmd.hedgehog_features(k, mk.weight, mk.bias, activation, with_input=True)
            out = kfunction.hybrid_kernel(q_on, k_on, v, fq, fk, ca, cb, logs, sh,
                                   config=kconfig.KernelConfig(**cfg), **kw)
            if twice:
                out = out + kfunction.hybrid_kernel(q_on, k_on, v, fq, fk, ca, cb, logs, sh,
                                             config=kconfig.KernelConfig(**cfg), **kw)
            if watched:
                fq.retain_grad()
        else:
            fq = fmr.reference_features(q, mq.weight, mq.bias, activation)
            fk = fmr.reference_features(k, mk.weight, mk.bias, activation)
            out = kreference.kernel_reference(q, k, v, fq, fk, ca, cb, logs, sh, **kw)
            if twice:
                out = out + kreference.kernel_reference(q, k, v, fq, fk, ca, cb, logs, sh, **kw)
            if watched:
                fq.retain_grad()
        loss = (out.float() * do).sum()
        if other:
            loss = loss + (fq.float() * c).sum()
        loss.backward()
        return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "dWq": mq.weight.grad.clone(), "dbq": mq.bias.grad.clone(),
                "dWk": mk.weight.grad.clone(), "dbk": mk.bias.grad.clone(),
                **({"dfq": fq.grad} if watched else {})}

    before = TRACE.calls.copy(), TRACE.calls.copy()
    got = run(True)
    ran = {"du_from_kernel": TRACE.calls["feature_map.du_from_kernel"]
           - before[0].get("feature_map.du_from_kernel", 0),
           "du_added": TRACE.calls["feature_map.du_added"]
           - before[0].get("feature_map.du_added", 0),
           "map_du": TRACE.calls["hybrid.map_du"] - before[1]["map_du"]}
    want = run(False)
    # the kernel computed du exactly where it could, and the map's backward took it: alone,
    # or added to the du of the other consumer's gradient
    du_used = expect_du and not watched
    path_ok = ran == {"du_from_kernel": int(du_used and not (other or twice)),
                      "du_added": int(du_used and (other or twice)), "map_du": int(du_used)}
    return {**errors(got, want), "du_path": 0.0 if path_ok else float("inf")}


@contextlib.contextmanager
def _maps_on_their_kernel():
    """``HedgehogFeatureMap`` modules run the fused map (``feature_map.dispatch``) on CPU tensors, as
    they do on CUDA ones (their ``_fused`` asks for CUDA)."""
    from hedgecats.models import feature_maps as fm
    from hedgecats.models.ops.feature_map import dispatch as fmd

    old = fm.HedgehogFeatureMap._fused

    def fused(self, x, with_input=False, kernel_du=False):
        return fmd.hedgehog_features(x, self.weight, self.bias, self.activation,
                                     with_input=with_input, kernel_du=kernel_du)

    fm.HedgehogFeatureMap._fused = fused
    try:
        yield
    finally:
        fm.HedgehogFeatureMap._fused = old


def fold_case(cid, *, mode="hybrid", B=2, H=4, Hkv=2, T=150, D=16, window=20,
              activation="softmax", pad=False, g_kind="float", ssd=None, frozen=(),
              cfg=MAP_DU, through="fused", dtype=torch.bfloat16, backward_fails=False,
              floor=0.0, expect_fold=True, walk=None, **switches):
    """The feature maps folded into the fused kernel's autograd Function (``maps=(phi_q,
    phi_k)``, the layer's call since 2026-12-04) against the call as the layer made it before:
    the maps run first as their own Functions (``ops.hybrid._apply_maps``: q and k handed on,
    the q map's du from the kernel), then the kernel. The output and every gradient (q, k, v,
    both maps' weight and bias, a per-head g) must be bit for bit equal ("same_*": 0 or inf):
    the same kernels run on the same arguments. Both against the fp32 reference (the maps by
    ``feature_map.reference``, ``hybrid_attention(backend="reference")``) within the
    dtype's tolerance; and the fold ran, forward and backward, with the kernel's du where the
    config gives one. q, k, v as transformers lays them out. ``frozen``: what takes no
    gradient ("q", "k", "v": stage 1's detached teacher; "maps"). ``through``: "fused" calls
    ``fused_hybrid(config=cfg)``; "attention" calls ``hybrid_attention`` with the CUDA pieces
    and the fused kernel (``backends._cuda_ops``) at the default tiles: the layer's routing.
    ``backward_fails``: every backward kernel launch raises Triton's OutOfResources: both paths'
    gradients come from the PyTorch reference (``_reference_backward``; folded, the maps'
    too), each against the fp32 reference, not bit for bit against the other; the fallback is
    recorded once per backward. ``floor`` (the maps'), ``expect_fold=False``: maps the fold
    must refuse (a floor, fp32): the call runs them as modules, the same path as before.
    ``walk``: the folded calls' map pair on walking programs of this ``PairPlan`` (set as
    the shape's plan in ``WALK_PLANS`` for the run; None: the plans as they are, the walk at
    D = F/2 = 128): still bit for bit the maps' own kernels. Folded, both maps' forward
    kernels run in one launch."""
    from triton.runtime.errors import OutOfResources
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.hybrid import attention as hybrid
    from hedgecats.models.ops.hybrid import backward as kbackward
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import dispatch as kdispatch

    gen = torch.Generator().manual_seed(7)
    maps = [HedgehogFeatureMap(n, D, activation, seed=s, floor=floor)
            for n, s in ((H, 1), (Hkv, 2))]
    with torch.no_grad():
        for m in maps:
            m.bias.normal_(0, 0.5, generator=gen)
    q0, k0, v0 = (torch.randn(B, T, n, D, generator=gen).transpose(1, 2) for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, generator=gen)
    kpm = _kpm(B, T) if pad else None
    g0, args = _layer_call(B, H, D, window, mode, kpm, g_kind, ssd, gen, switches, T)
    ops = backends._cuda_ops("auto", True)

    def kernel(q, k, v, fq, fk, g, **kw):
        if through == "attention":
            return hybrid.hybrid_attention(q, k, v, fq, fk, g=g, ops=ops, **args, **kw)
        out = kdispatch.fused_hybrid(q, k, v, fq, fk, g=g, config=kconfig.KernelConfig(**cfg), **args,
                              **kw)
        if out is None:
            raise RuntimeError("fused_hybrid declined a case it should take")
        return out

    def run(path):
        cast = torch.float32 if path == "reference" else dtype
        q, k, v = (x.to(dtype).to(cast).clone().requires_grad_(n not in frozen)
                   for n, x in zip("qkv", (q0, k0, v0)))  # (clone: fresh leaves each run)
        for m in maps:
            m.zero_grad()
            m.requires_grad_("maps" not in frozen)
        g = g0.clone().requires_grad_() if torch.is_tensor(g0) else g0
        if path == "no_grad":  # (evaluation, prefill: the forward without autograd's node)
            with torch.no_grad(), _maps_on_their_kernel():
                return {"out": kernel(q, k, v, None, None, g, maps=maps).clone()}
        if path == "folded":
            with _maps_on_their_kernel():  # (where the fold refuses, the modules run)
                out = kernel(q, k, v, None, None, g, maps=maps)
        elif path == "unfolded":
            with _maps_on_their_kernel():
                fq, fk, q_on, k_on = hybrid._apply_maps(maps, q, k)
            out = kernel(q_on, k_on, v, fq, fk, g)
        else:
            fq, fk = (tp_ref(x, m) for x, m in zip((q, k), maps))
            a = {n: x for n, x in args.items() if n != "eps"}
            out = hybrid.hybrid_attention(q, k, v, fq, fk, g=g, backend="reference",
                                          eps=args["eps"], **a)
        loss = (out.float() * do).sum()
        if backward_fails and path != "reference":
            def fail(*a, **kw):
                raise OutOfResources(1, 0, "shared memory")
            real, kbackward.launch_backward = kbackward.launch_backward, fail
            # (what the failures record is this case's: later cases of the same problem key
            # in this process must compile their own tiles)
            failed = set(kconfig._FAILED), dict(kconfig._SAFE_FAILED)
            try:
                loss.backward()
            finally:
                kbackward.launch_backward = real
                kconfig._FAILED.clear()
                kconfig._FAILED.update(failed[0])
                kconfig._SAFE_FAILED.clear()
                kconfig._SAFE_FAILED.update(failed[1])
        else:
            loss.backward()
        res = {"out": out.detach()}
        res.update({n: x.grad for n, x in zip(("dq", "dk", "dv"), (q, k, v))
                    if x.requires_grad})
        if "maps" not in frozen:
            res.update({"dWq": maps[0].weight.grad, "dbq": maps[0].bias.grad,
                        "dWk": maps[1].weight.grad, "dbk": maps[1].bias.grad})
        if torch.is_tensor(g):
            res["dg"] = g.grad
        return {n: None if x is None else x.clone() for n, x in res.items()}

    def tp_ref(x, m):
        return fmr.reference_features(x, m.weight, m.bias, activation).clamp_min(floor)

    from hedgecats.models.ops.feature_map import kernels as tp
    from hedgecats.models.ops.feature_map import reference as fmr

    @contextlib.contextmanager
    def maps_as_asked():
        """The run's pair plan (``walk``), restored after."""
        plans = dict(tp.WALK_PLANS)
        if walk is not None:
            tp.WALK_PLANS[(D, D)] = walk  # (square maps: F/2 = D)
        try:
            yield
        finally:
            tp.WALK_PLANS.clear()
            tp.WALK_PLANS.update(plans)

    def fm_calls(*names):
        return [TRACE.calls[f"feature_map.{n}"] for n in names]

    names = ("maps_folded", "maps_folded_backward", "map_du")
    n_err = len(TRACE.fallbacks)
    before = [TRACE.calls["hybrid." + n] for n in names]
    pairs, in_place = fm_calls("pair_forward", "dx_in_place")
    walks = fm_calls("forward_walk", "forward_tma")
    with maps_as_asked():
        walked = tp.pair_plan(D, D).per_sm is not None  # (square maps: F/2 = D)
        got = run("folded")
        ran = [TRACE.calls["hybrid." + n] - b for n, b in zip(names, before)]
        pairs, in_place = (a - b for a, b in zip(fm_calls("pair_forward", "dx_in_place"),
                                                 (pairs, in_place)))
        before = (TRACE.calls["hybrid.forward_without_autograd"], TRACE.calls["hybrid.forward"])
        no_grad = run("no_grad")
    walks = [a - b for a, b in zip(fm_calls("forward_walk", "forward_tma"), walks)]
    without_autograd = TRACE.calls["hybrid.forward_without_autograd"] - before[0]
    kernel_calls = TRACE.calls["hybrid.forward"] - before[1]
    before = TRACE.calls["hybrid.map_du"]
    old = run("unfolded")
    du_unfolded = TRACE.calls["hybrid.map_du"] - before
    want = run("reference")
    out = errors(got, want)
    if backward_fails:
        out.update({f"unfolded_{n}": e for n, e in errors(old, want).items()})
        out["fallbacks_recorded"] = 0.0 if len(TRACE.fallbacks) == n_err + 2 and \
            ran == [1, 0, 0] else float("inf")
        return out
    # an output gate: q and k reach both branches' calls; before the fold the window's dq / dk
    # was added to the map's in its kernel (fp32, one rounding), folded autograd adds the two
    # (bf16): the same gradients, rounded differently, so within the tolerance, not bit for bit
    rounded = {"dq", "dk"} if g_kind.startswith("gate") else set()
    for n in want:  # (the maps' gradients: None where they did not run (swa_only), zeros
        # where they ran, as their own Functions, and the call did not use their output)
        a, b = got.get(n), old.get(n)
        if n in rounded and a is not None and b is not None:
            out[f"same_{n}"] = rel(a, b)
            continue
        same = (a is None and b is None) or (a is not None and b is not None and
                                              torch.equal(a, b)) or \
            (a is None and b is not None and n.startswith(("dW", "db")) and not b.any())
        out[f"same_{n}"] = 0.0 if same else float("inf")
    # folded once each way (or, refused, not at all), with the kernel's du exactly where the
    # path before the fold used it
    folds = [1, 1] if expect_fold else [0, 0]
    out["fold_ran"] = 0.0 if ran == [*folds, du_unfolded] else float("inf")
    # folded, both maps' forward kernels in one launch
    out["maps_paired"] = 0.0 if pairs == int(expect_fold) else float("inf")
    # folded, the maps' dx written over the kernel's own dq / dk (no second buffer of their
    # size): both maps where the window gives q and k a gradient in the folded call (not
    # under an output gate: there the folded call is the LA branch's alone)
    want_in_place = 2 if expect_fold and mode == "hybrid" and not frozen and \
        not g_kind.startswith("gate") and not backward_fails else None
    out["dx_in_place"] = 0.0 if want_in_place is None or in_place == want_in_place \
        else float("inf")
    # the pair on walking programs (through descriptors) in both folded forwards
    want_walks = 2 if walked and expect_fold else 0
    out["forward_walk"] = 0.0 if walks == [want_walks, want_walks] else float("inf")
    # under no_grad the same forward without an autograd Function: the same output, bit for bit
    out["same_out_no_grad"] = 0.0 if torch.equal(no_grad["out"], got["out"]) else float("inf")
    out["no_grad_without_autograd"] = 0.0 if without_autograd == kernel_calls >= 1 \
        else float("inf")
    return out


def model_case(cid, *, mixer="fixed", mode="hybrid", pad=False, H=4, Hkv=2, window=8, T=40,
               ssd_p=0.0, rescale=False, dtype=torch.bfloat16):
    """What a stage runs: a 2-layer converted Llama in training mode, loss and backward, with
    its layers on the GPU's path (``backends.select`` gives ``auto``'s CUDA ops: the fused
    kernel, the maps folded in) against the same model in fp32 on the reference pieces: the
    loss, the logits and the gradients of every parameter group (projections, feature maps,
    mixer, the rest), and that every layer call took the fused kernel (twice for an output
    gate).
    ``ssd_p``: SSD's drops per (b, h), the same draws both runs (the global RNG reseeded).
    The feature maps' gradients read ~1.2e-2 from the fp32 model's: the bf16 model's own (on
    the reference pieces it reads 1.07e-2 for ``model-fixed-pad``), not the kernel's."""
    from hedgecats.models import HybridConfig, convert_to_hybrid, set_attention_mode
    from hedgecats.models.ops.hybrid import backends
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=61, hidden_size=16 * H, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=Hkv, max_position_embeddings=512))
    convert_to_hybrid(model, HybridConfig(window=window, mixer=mixer, seed=0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".phi_" in n or ".mixer." in n:
                p.add_(0.3 * torch.randn_like(p))
    switches = dict(rescale=rescale)
    if ssd_p:
        switches.update(ssd_p=ssd_p, ssd_granularity="head")
    set_attention_mode(model, mode, **switches)
    reference = copy.deepcopy(model).float().train()
    model.to(dtype).train()
    g = torch.Generator().manual_seed(3)
    B = 2
    x = torch.randint(0, 61, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[0, :5] = 0

    def group(name):
        return ("maps" if ".phi_" in name else "mixer" if ".mixer." in name else
                "projections" if "_proj" in name and ".self_attn." in name else "other")

    def run(fused: bool):
        m = model if fused else reference
        m.zero_grad()
        torch.manual_seed(11)  # (SSD's draws)
        select = backends.select
        if fused:
            backends.select = lambda backend, q, kpm=None: (
                backends._cuda_ops("auto", True) if backend == "auto" else
                select(backend, q, kpm))
        try:
            out = m(x, attention_mask=mask if pad else None, labels=x)
            out.loss.backward()
        finally:
            backends.select = select
        grads: dict = {}
        for n, p in m.named_parameters():
            if p.grad is not None:
                grads.setdefault(group(n), []).append(p.grad.float().flatten())
        res = {"loss": out.loss.detach().float().reshape(1), "logits": out.logits.float()}
        res.update({f"d_{k}": torch.cat(v) for k, v in grads.items()})
        return res

    calls = TRACE.calls["hybrid.forward"], TRACE.calls["hybrid.gated"]
    got = run(True)
    calls = TRACE.calls["hybrid.forward"] - calls[0], TRACE.calls["hybrid.gated"] - calls[1]
    want = run(False)
    out = errors(got, want)
    gated = mixer.startswith("gate")
    per_layer = 2 if gated and mode == "hybrid" else 1
    out["fused_ran"] = 0.0 if calls == (2 * per_layer, 2 if gated else 0) else float("inf")
    return out


def checkpointed_case(cid, *, B=2, H=4, Hkv=2, T=150, D=16, window=20, dtype=torch.bfloat16,
                      g_kind="float"):
    """The fused call with the maps folded in, under non-reentrant activation checkpointing
    (``torch.utils.checkpoint``, ``use_reentrant=False``: stage 2's), against the same call
    without it: the output and every gradient bit for bit (the backward recomputes the forward
    and reads, then releases, the recomputed branches and states: ``_release_saved``), and
    the release ran once per backward. ``g_kind`` "gate": an output gate in the call's dtype
    (a call per branch, each saving its output as its branch (``hybrid.gated``);
    the LA call's, folded, releases its states only), g's gradient compared too."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import dispatch as kdispatch
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(9)
    maps = [HedgehogFeatureMap(n, D, seed=s) for n, s in ((H, 1), (Hkv, 2))]
    q0, k0, v0 = (torch.randn(B, T, n, D, generator=gen).to(dtype).transpose(1, 2)
                  for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, generator=gen)
    kpm = _kpm(B, T)
    g0, args = _layer_call(B, H, D, window, "hybrid", kpm, g_kind, None, gen, {}, T)
    gated = torch.is_tensor(g0)
    names = ["out", "dq", "dk", "dv", "dWq", "dbq", "dWk", "dbk"] + (["dg"] if gated else [])

    def call(q, k, v, g):
        with _maps_on_their_kernel():
            return kdispatch.fused_hybrid(q, k, v, None, None, g=g, config=kconfig.KernelConfig(**MAP_DU),
                                   maps=maps, **args)

    def run(checkpointed: bool):
        q, k, v = (x.detach().clone().requires_grad_() for x in (q0, k0, v0))
        g = g0.to(dtype).requires_grad_() if gated else g0
        for m in maps:
            m.zero_grad()
        released, n_gated = TRACE.calls["hybrid.saved_released"], TRACE.calls["hybrid.gated"]
        out = checkpoint(call, q, k, v, g, use_reentrant=False) if checkpointed \
            else call(q, k, v, g)
        (out.float() * do).sum().backward()
        got = [out.detach(), q.grad, k.grad, v.grad] + [
            p_.grad.clone() for m in maps for p_ in (m.weight, m.bias)]
        got += [g.grad] if gated else []
        assert TRACE.calls["hybrid.gated"] - n_gated == (1 + checkpointed) * gated, "no gated call"
        return dict(zip(names, got)), TRACE.calls["hybrid.saved_released"] - released

    plain, released_plain = run(False)
    ckpt, released_ckpt = run(True)
    out = {f"same_{n}": 0.0 if torch.equal(ckpt[n], plain[n]) else float("inf") for n in names}
    out["released"] = 0.0 if released_plain == released_ckpt == 1 else float("inf")
    return out


def retain_graph_case(cid, *, B=2, H=4, Hkv=2, T=150, D=16, window=20, dtype=torch.bfloat16,
                      g_kind="float"):
    """The fused call's backward run twice on one graph (``retain_graph=True``), the maps
    folded in, bf16, padding. The first reads the branches and LA states the forward saved
    and then releases them (``triton_hybrid._release_saved``: their storage emptied before the
    maps' backward); the second finds them released and recomputes what they held. The
    second's gradients (the second accumulation minus the first) against the first's, within
    the dtype's tolerance, and the paths: saved, released, then recomputed. ``g_kind`` "gate":
    an output gate in the call's dtype: each branch call saves its output as its branch, never
    released (the gate's mix reads it in both backwards), so both backwards take the factors
    from it; the folded LA call releases its states, and the second builds them again."""
    from hedgecats.models import HedgehogFeatureMap
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import dispatch as kdispatch

    gen = torch.Generator().manual_seed(8)
    maps = [HedgehogFeatureMap(n, D, seed=s) for n, s in ((H, 1), (Hkv, 2))]
    q, k, v = (torch.randn(B, T, n, D, generator=gen).to(dtype).transpose(1, 2)
               .requires_grad_() for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, generator=gen)
    kpm = _kpm(B, T)
    g0, args = _layer_call(B, H, D, window, "hybrid", kpm, g_kind, None, gen, {}, T)
    gated = torch.is_tensor(g0)
    if gated:
        g0 = g0.to(dtype)
    with _maps_on_their_kernel():
        out = kdispatch.fused_hybrid(q, k, v, None, None, g=g0, config=kconfig.KernelConfig(**MAP_DU),
                              maps=maps, **args)
    loss = (out.float() * do).sum()
    params = [q, k, v] + [p_ for m in maps for p_ in (m.weight, m.bias)]
    names = ["dq", "dk", "dv", "dWq", "dbq", "dWk", "dbk"]
    counters = ("factors_from_saved", "states_from_forward", "saved_released",
                "saved_recomputed")
    saved = [TRACE.calls["hybrid." + n] for n in counters]
    loss.backward(retain_graph=True)
    first = {n: p_.grad.clone() for n, p_ in zip(names, params)}
    ran_first = tuple(TRACE.calls["hybrid." + n] - b for n, b in zip(counters, saved))
    loss.backward()
    second = {n: p_.grad.float() - first[n].float() for n, p_ in zip(names, params)}
    ran_second = tuple(TRACE.calls["hybrid." + n] - b for n, b in zip(counters, saved))
    out_ = errors(second, {n: x.float() for n, x in first.items()})
    want = ((2, 1, 1, 0), (4, 1, 1, 0)) if gated else ((1, 1, 1, 0), (1, 1, 1, 1))
    out_["paths"] = 0.0 if (ran_first, ran_second) == want else float("inf")
    return out_


def decode_case(cid, *, mode="hybrid", mixer="fixed", rescale=False, pad=False, H=4, Hkv=2,
                window=8, n_sinks=4, steps=13, dtype=torch.bfloat16):
    """The fused decode step (ops.decode) against the composed one (models.cache._step):
    a 2-layer converted Llama prefilled with 6 tokens, then ``steps`` single-token steps (past
    the window: keys leave it into the state; the sinks fill): every step's logits, and the
    cache's tensors at the end. ``pad``: the first sequence left-padded (mask passed)."""
    from hedgecats.models import HybridConfig, convert_to_hybrid, set_attention_mode
    from hedgecats.models.cache import HybridCache
    from hedgecats.models.decode import CACHE_KWARG
    from hedgecats.models.ops.hybrid import backends
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=61, hidden_size=16 * H, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=H, num_key_value_heads=Hkv, max_position_embeddings=512))
    convert_to_hybrid(model.eval(), HybridConfig(window=window, n_sinks=n_sinks, mixer=mixer,
                                                 seed=0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".phi_" in n or ".mixer." in n:
                p.add_(0.3 * torch.randn_like(p))
    model.to(dtype)
    set_attention_mode(model, mode, rescale=rescale)
    g = torch.Generator().manual_seed(3)
    B, P = 2, 6
    x = torch.randint(0, 61, (B, P + steps), generator=g)
    mask = torch.ones(B, P + steps, dtype=torch.long)
    if pad:
        mask[0, :3] = 0

    def run(fused: bool):
        cache = HybridCache(model)
        before = TRACE.calls["decode.step"]
        logits = []
        ctx = contextlib.nullcontext() if fused else backends.triton_disabled()
        with torch.no_grad(), ctx:
            t0 = 0
            for n in [P] + [1] * steps:
                kw = {"attention_mask": mask[:, :t0 + n]} if pad else {}
                out = model(x[:, t0:t0 + n], **{CACHE_KWARG: cache}, use_cache=True, **kw)
                logits.append(out.logits.float())
                t0 += n
        used = TRACE.calls["decode.step"] - before
        return torch.cat(logits, 1), cache, used

    got, c_got, used = run(True)
    want, c_want, unused = run(False)
    assert used == 2 * steps and unused == 0, (used, unused)
    errs = {"logits": rel(got, want)}
    for name in ("keys", "values", "S", "z", "vsum"):
        errs[name] = max(rel(getattr(a, name).float(), getattr(b, name).float())
                         for a, b in zip(c_got.layers, c_want.layers))
    for name in ("real", "n_state", "n_real", "sink_real", "pos"):
        same = all(torch.equal(getattr(a, name), getattr(b, name))
                   for a, b in zip(c_got.layers, c_want.layers))
        errs[name] = 0.0 if same else float("inf")
    if n_sinks:  # the scratch slot n_sinks holds whatever came last: not compared
        errs["sink_keys"] = max(rel(a.sink_keys[:, :, :n_sinks].float(),
                                    b.sink_keys[:, :, :n_sinks].float())
                                for a, b in zip(c_got.layers, c_want.layers))
    return errs


def cases(quick: bool = False):
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.feature_map import kernels as tp

    bf16 = torch.bfloat16
    # the GPU's default tiles at D 128 in bf16, as a dict
    d128 = dataclasses.asdict(kconfig.default_config(128, 256, bf16))
    k = kernel_case
    fc = fused_case
    out = [
        ("kernel-hybrid", k, {}),
        ("kernel-floor-tiny", k, dict(eps=1.1754943508222875e-38, pad=True)),
        ("kernel-shared", k, dict(shared=True)),
        ("kernel-overlap", k, dict(shift=0)),
        ("kernel-swa-only", k, dict(has_la=False)),
        ("kernel-la-only", k, dict(has_swa=False)),
        ("kernel-pad", k, dict(pad=True)),
        ("kernel-split-tile-pad-shifts-shared", k, dict(T=70, window=10, per_bh_shift=True,
                                                        pad=True, shared=True,
                                                        cfg=dict(SMALL, split_states=True,
                                                                 split_tile=32))),
        ("kernel-dkv-tile-pad-shifts-shared", k, dict(T=150, window=40, per_bh_shift=True,
                                                      pad=True, shared=True, cfg=DKV_TILE)),
        ("kernel-dkv-tile-frozen-v", k, dict(T=70, window=10, frozen=("v",), cfg=DKV_TILE)),
        ("kernel-dkv-tile-swa-only-pad", k, dict(T=70, window=10, has_la=False, pad=True,
                                                 cfg=DKV_TILE)),
        # q, k, v as views of the model's (B, T, H, D) memory: output and gradients so too
        ("kernel-model-layout", k, dict(model_layout=True)),
        ("kernel-model-layout-swa-only", k, dict(model_layout=True, has_la=False)),
        ("kernel-model-layout-frozen-v-pad-shared", k, dict(model_layout=True, frozen=("v",),
                                                            pad=True, shared=True)),
        ("kernel-model-layout-la-only-split", k, dict(model_layout=True, has_swa=False,
                                                      cfg=dict(SMALL, split_states=True))),
        ("kernel-pad-shared", k, dict(pad=True, shared=True)),
        ("kernel-per-bh-shift", k, dict(per_bh_shift=True)),
        ("kernel-T-lt-window", k, dict(T=5, window=8)),
        ("kernel-Hkv1-T37-w20", k, dict(T=37, window=20, Hkv=1)),
        ("kernel-MHA-D32-F32", k, dict(T=37, window=3, H=2, Hkv=2, D=32)),
        # groups of 7 query heads a kv head (Qwen2-7B: 28 heads, 4 kv heads): odd group sizes
        # in the kernels' head arithmetic and the reverse states' sum over a group
        ("kernel-group7-pad-shared", k, dict(T=45, window=10, H=7, Hkv=1, pad=True, shared=True)),
        ("kernel-group3-shifts-tall", k, dict(T=70, window=10, H=6, Hkv=2, per_bh_shift=True,
                                              cfg=TALL_BWD)),
        ("kernel-mixed-blocks", k, dict(T=70, window=10, cfg=MIXED)),
        ("kernel-mixed-blocks-pad-shared", k, dict(T=70, window=10, pad=True, shared=True,
                                                   cfg=MIXED)),
        ("kernel-mixed-blocks-w40-shifts", k, dict(T=70, window=40, per_bh_shift=True, pad=True,
                                                   cfg=MIXED)),
        ("kernel-tall-bwd-tiles", k, dict(T=70, window=10, cfg=TALL_BWD)),
        ("kernel-tall-bwd-tiles-pad-shifts", k, dict(T=70, window=40, per_bh_shift=True, pad=True,
                                                     cfg=TALL_BWD)),
        ("kernel-long-chunk", k, dict(T=150, window=10, cfg=LONG_CHUNK)),
        ("kernel-long-chunk-pad-shifts-shared", k, dict(T=150, window=40, per_bh_shift=True,
                                                        pad=True, shared=True, cfg=LONG_CHUNK)),
        ("kernel-wide-fwd-tiles", k, dict(T=70, window=10, cfg=dict(
            TALL_BWD, block_m=16, block_n=32, bwd_block_m=16, bwd_block_n=32))),
        # forward query tiles taller than the state chunk and the key tiles (the "fwd128"
        # tiles of benchmarks/attention_speed.py in miniature: 128 queries, 128-chunk states)
        ("kernel-tall-fwd-tiles-pad-shifts-shared", k, dict(T=150, window=40,
                                                            per_bh_shift=True, pad=True,
                                                            shared=True, cfg=dict(
            LONG_CHUNK, block_m=128, block_n=16, state_chunk=32))),
        # the query-side backward (dq, dfq) on its own query tile (``dq_block_m``), taller than
        # the key-side kernels' and than the state chunk
        ("kernel-tall-dq-tiles-pad-shifts-shared", k, dict(T=150, window=40, per_bh_shift=True,
                                                           pad=True, shared=True, cfg=dict(
            LONG_CHUNK, dq_block_m=64))),
        ("kernel-tall-dq-tiles-recomputed-frozen-v", k, dict(T=150, window=10, frozen=("v",),
                                                             cfg=dict(LONG_CHUNK, dq_block_m=128,
                                                                      save_branches=False))),
        ("kernel-frozen-qkv", k, dict(frozen=("q", "k", "v"))),
        ("kernel-frozen-qkv-pad-shared-tall", k, dict(T=70, window=10, pad=True, shared=True,
                                                      cfg=TALL_BWD, frozen=("q", "k", "v"))),
        ("kernel-frozen-q", k, dict(frozen=("q",))),
        ("kernel-frozen-v", k, dict(frozen=("v",))),
        ("kernel-frozen-k-swa-only", k, dict(has_la=False, frozen=("k",))),
        ("kernel-frozen-v-swa-only", k, dict(has_la=False, frozen=("v",))),
        ("kernel-frozen-dk-la-only", k, dict(has_swa=False, frozen=("k",))),
        # the forward's saved branches feed the backward's per-query factors
        ("kernel-saved", k, dict(cfg=dict(SMALL, save_branches=True))),
        ("kernel-saved-frozen-qkv", k, dict(cfg=dict(SMALL, save_branches=True),
                                            frozen=("q", "k", "v"))),
        ("kernel-saved-pad-shared-shifts", k, dict(T=70, window=10, pad=True, shared=True,
                                                   per_bh_shift=True,
                                                   cfg=dict(TALL_BWD, save_branches=True))),
        ("kernel-saved-swa-only", k, dict(has_la=False, cfg=dict(SMALL, save_branches=True))),
        ("kernel-saved-la-only-frozen", k, dict(has_swa=False, frozen=("q", "k", "v"),
                                                cfg=dict(SMALL, save_branches=True))),
        ("kernel-saved-branches-are-read", saved_branches_read_case, None),
        ("kernel-saved-states-are-read", saved_states_read_case, None),
        ("kernel-saved-D64-two-channel-slices", k, dict(D=64, H=2, Hkv=1, T=40, window=8,
                                                        cfg=dict(SMALL, save_branches=True))),
        ("kernel-saved-bf16-shared-pad", k, dict(dtype=bf16, shared=True, pad=True,
                                                 cfg=dict(SMALL, save_branches=True))),
        # save_branches is the default since 2026-12-02's sixth session, split_states from 17
        # chunks on (shorter cases walk): the recomputing backward and both state paths keep
        # cases of their own
        ("kernel-recomputed", k, dict(cfg=dict(SMALL, save_branches=False))),
        ("kernel-recomputed-pad-shared-shifts", k, dict(T=70, window=10, pad=True, shared=True,
                                                        per_bh_shift=True,
                                                        cfg=dict(TALL_BWD, save_branches=False))),
        ("kernel-sequential-states", k, dict(cfg=dict(SMALL, split_states=False))),
        ("kernel-sequential-states-pad-shifts-shared", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True, shared=True,
            cfg=dict(LONG_CHUNK, split_states=False))),
        ("kernel-split-states", k, dict(cfg=dict(SMALL, split_states=True))),
        ("kernel-split-states-overlap-T-lt-chunk", k, dict(T=11, window=4, shift=0,
                                                           cfg=dict(SMALL, split_states=True))),
        ("kernel-split-states-Hkv1-long-chunk-frozen", k, dict(
            T=150, window=10, Hkv=1, pad=True, frozen=("q", "k", "v"),
            cfg=dict(LONG_CHUNK, split_states=True))),
        ("kernel-split-states-pad-shifts-shared", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True, shared=True,
            cfg=dict(LONG_CHUNK, split_states=True))),
        # the kernels' pointer path (tma False: what a GPU before sm_90 or an unaligned
        # tensor takes; the cases above read through tensor descriptors)
        ("kernel-sequential-states-pointer-path-pad-shifts", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True,
            cfg=dict(LONG_CHUNK, split_states=False, tma=False))),
        ("kernel-split-states-pointer-path", k, dict(cfg=dict(SMALL, split_states=True,
                                                             tma=False))),
        ("kernel-split-states-pointer-path-pad-shifts-shared", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True, shared=True,
            cfg=dict(LONG_CHUNK, split_states=True, tma=False))),
        # D 32 over 16-wide state tiles: the programs with pid_d > 0 run
        ("kernel-split-states-D32-two-tiles-pad-shifts", k, dict(
            D=32, T=90, window=10, Hkv=1, pad=True, per_bh_shift=True, shared=True,
            cfg=dict(SMALL, split_states=True))),
        # the default (split_states None) past SPLIT_STATES_MIN_CHUNKS: 19 chunks of 16
        ("kernel-auto-split-19-chunks-pad-shared", k, dict(T=300, window=20, pad=True,
                                                           shared=True, expect_split=True)),
        # the gradient kernels' whole-F programs (grad_f_chunk = F: one dfq / dfk program per
        # block, the dO . v product once), with the tiles that cross states and padding
        ("kernel-grad-whole-f-pad-shared", k, dict(
            T=150, window=10, pad=True, shared=True, cfg=dict(LONG_CHUNK, grad_f_chunk=32))),
        ("kernel-grad-whole-f-tall-shifts-split", k, dict(
            T=90, window=20, per_bh_shift=True, cfg=dict(TALL_BWD, grad_f_chunk=32,
                                                         split_states=True))),
        # a state chunk of 128 walked (the GPU's D 128 chunk), per-head shifts and padding
        ("kernel-walked-reverse-chunk128-pad-shifts", k, dict(
            T=300, window=20, pad=True, per_bh_shift=True,
            cfg=dict(SMALL, state_chunk=128, split_states=False))),
        # query heads packed into one forward program (pack_heads): 2 of a group of 2, 4 of
        # a group of 4, per-head shifts (rows of one program masked at different t - shift);
        # then the query-side backward packed too (dq_block_m; each branch alone there)
        ("kernel-packed2-pad-shared-shifts", k, dict(T=70, window=10, pad=True, shared=True,
                                                     per_bh_shift=True, cfg=PACKED)),
        ("kernel-packed4-G4-pad-shifts", k, dict(H=8, T=90, window=20, pad=True,
                                                 per_bh_shift=True, cfg=PACKED4)),
        ("kernel-packed4-G4-bf16-overlap", k, dict(H=8, T=50, shift=0, dtype=bf16,
                                                   cfg=PACKED4)),
        ("kernel-packed4-group3-takes-one-head", k, dict(H=6, T=40, pad=True, cfg=PACKED4)),
        ("kernel-packed-dq2-pad-shared-shifts", k, dict(T=70, window=10, pad=True, shared=True,
                                                        per_bh_shift=True, cfg=PACKED_DQ)),
        ("kernel-packed4-dq4-G4-pad-shifts", k, dict(H=8, T=90, window=20, pad=True,
                                                     per_bh_shift=True, cfg=PACKED4_DQ)),
        ("kernel-packed4-dq4-G4-recomputed-shared-shifts", k, dict(
            H=8, T=90, window=20, shared=True, per_bh_shift=True,
            cfg=dict(PACKED4_DQ, save_branches=False))),
        ("kernel-packed4-dq4-G4-bf16-frozen-q", k, dict(H=8, T=70, dtype=bf16, frozen=("q",),
                                                        cfg=PACKED4_DQ)),
        ("kernel-packed4-dq4-G4-swa-only-pad", k, dict(H=8, T=40, has_la=False, pad=True,
                                                       cfg=PACKED4_DQ)),
        ("kernel-packed4-dq4-G4-la-only-split-shifts", k, dict(
            H=8, T=100, window=12, has_swa=False, per_bh_shift=True,
            cfg=dict(PACKED4_DQ, split_states=True))),
        # the LA state's share as a pipelined loop over feature slices (state_product_stages),
        # in the forward and in the recomputing dq pass
        ("kernel-pipelined-state-packed4-pad-shifts", k, dict(
            H=8, T=90, window=20, pad=True, per_bh_shift=True,
            cfg=dict(PACKED4_DQ, state_product_stages=2))),
        ("kernel-pipelined-state-recomputed-shared-bf16", k, dict(
            T=70, window=10, shared=True, dtype=bf16,
            cfg=dict(SMALL, state_product_stages=2, save_branches=False))),
        ("kernel-bf16", k, dict(dtype=bf16)),
        ("kernel-bf16-shared-pad", k, dict(dtype=bf16, shared=True, pad=True)),
        ("kernel-bf16-hedgehog-D32", k, dict(dtype=bf16, D=32, T=70, window=10,
                                             features="softmax", cfg=MIXED)),
        ("layer-hybrid", layer_case, {}),
        ("layer-hybrid-g-per-head", layer_case, dict(g_kind="head")),
        ("layer-hybrid-overlap", layer_case, dict(overlap=True)),
        ("layer-group7-bf16-g-per-head", layer_case, dict(H=7, Hkv=1, dtype=bf16,
                                                          g_kind="head")),
        ("layer-shared-norm", layer_case, dict(shared_norm=True)),
        ("layer-shared-norm-head-pad", layer_case, dict(shared_norm=True, g_kind="head", pad=True)),
        ("layer-swa-only", layer_case, dict(mode="swa_only")),
        ("layer-swa-only-rescale", layer_case, dict(mode="swa_only", rescale=True)),
        ("layer-la-only", layer_case, dict(mode="la_only")),
        ("layer-la-only-all-rescale", layer_case, dict(mode="la_only", la_span="all",
                                                       rescale=True)),
        ("layer-ssd-sample", layer_case, dict(ssd="sample", g_kind="head")),
        ("layer-gate-hybrid-pad", layer_case, dict(g_kind="gate", pad=True)),
        ("layer-gate-position-overlap", layer_case, dict(g_kind="gate-position", overlap=True)),
        ("layer-gate-ssd-head-rescale-all", layer_case, dict(g_kind="gate", ssd="head",
                                                             rescale=True, la_span="all")),
        ("layer-gate-ssd-sample-pad", layer_case, dict(g_kind="gate", ssd="sample", pad=True)),
        ("layer-gate-swa-only", layer_case, dict(g_kind="gate", mode="swa_only")),
        ("layer-gate-swa-only-ssd-head", layer_case, dict(g_kind="gate", mode="swa_only",
                                                          ssd="head")),
        ("layer-gate-swa-only-rescale-ssd-all", layer_case, dict(
            g_kind="gate", mode="swa_only", ssd="head", rescale=True, la_span="all")),
        ("layer-gate-la-only-all", layer_case, dict(g_kind="gate", mode="la_only",
                                                    la_span="all")),
        ("layer-gate-la-only-rescale-pad", layer_case, dict(g_kind="gate", mode="la_only",
                                                            rescale=True, pad=True)),
        ("layer-gate-bf16-packed4-pad", layer_case, dict(
            g_kind="gate", dtype=bf16, H=8, T=60, pad=True, cfg=PACKED4)),
        # a bf16 gate on a bf16 call (a bf16 model's): the mix keeps both branches, each
        # held once (``hybrid.gated``)
        ("layer-gate-bf16-g-bf16-packed4-pad", layer_case, dict(
            g_kind="gate", dtype=bf16, H=8, T=60, pad=True, cfg=PACKED4, g_in_dtype=True)),
        ("layer-gate-bf16-g-bf16-la-only", layer_case, dict(
            g_kind="gate", mode="la_only", dtype=bf16, cfg=PACKED4, H=8, g_in_dtype=True)),
        ("layer-ssd-head-all", layer_case, dict(ssd="head", la_span="all", pad=True)),
        ("layer-bf16-pad", layer_case, dict(dtype=bf16, pad=True, g_kind="head")),
        ("layer-ssd-head-packed4-pad", layer_case, dict(
            H=8, T=60, ssd="head", pad=True, g_kind="head", cfg=PACKED4)),
        ("layer-shared-norm-packed4-bf16", layer_case, dict(H=8, T=60, shared_norm=True,
                                                            dtype=bf16, cfg=PACKED4_DQ)),
        ("layer-learned-head-packed4-dq4-pad", layer_case, dict(
            H=8, T=60, g_kind="head", pad=True, cfg=PACKED4_DQ)),
        ("mse", mse_case, {}),
        ("mse-pad-teacher-grad", mse_case, dict(pad=True, teacher_grad=True)),
        ("mse-bf16-pad-sdpa-layout", mse_case, dict(pad=True, dtype=bf16, sdpa_layout=True)),
        ("mse-D48-T130-nan-in-padding", mse_case, dict(D=48, T=130, pad=True,
                                                        nan_in_padding=True)),
        ("mse-T1", mse_case, dict(T=1, B=1, H=1)),
        ("mse-backward-fallback", mse_backward_fallback_case, {}),
        ("xent", xent_case, {}),
        ("xent-pad", xent_case, dict(pad=True)),
        ("xent-blocks-16x32-T37", xent_case, dict(T=37, bn=32)),
        ("xent-blocks-32x16-Hkv1-pad", xent_case, dict(T=70, bm=32, Hkv=1, pad=True)),
        ("xent-T5", xent_case, dict(T=5)),
        ("xent-exp", xent_case, dict(features="exp")),
        ("xent-relu-pad", xent_case, dict(features="relu", pad=True)),
        ("xent-rectangular-D32", xent_case, dict(D=32, projection="rectangular", T=40)),
        ("xent-underflow", xent_case, dict(underflow=True, features="relu")),
        ("xent-underflow-no-floor", xent_case, dict(underflow=True, features="relu", eps=0.0)),
        ("xent-bf16", xent_case, dict(dtype=bf16, T=64, D=32)),
        ("xent-bf16-default-tiles", xent_case, dict(dtype=bf16, T=150, D=32, bm=None, bn=None)),
        ("xent-entry", xent_entry_case, None),
        ("poison-canary", poison_canary_case, None),
        ("order-canary", order_canary_case, None),
        # the q map's backward from the du of the kernel's dfq pass (feature_map DuSlot)
        ("map-du", map_du_case, dict(cfg=MAP_DU, dtype=bf16)),
        ("map-du-exp-pad", map_du_case, dict(cfg=MAP_DU, activation="exp", pad=True, dtype=bf16)),
        ("map-du-other-consumer", map_du_case, dict(cfg=MAP_DU, other=True, dtype=bf16)),
        ("map-du-two-kernels", map_du_case, dict(cfg=MAP_DU, twice=True, dtype=bf16)),
        ("map-du-phi-retains-grad", map_du_case, dict(cfg=MAP_DU, watched=True, dtype=bf16)),
        ("map-du-frozen-q-unpacked", map_du_case, dict(
            cfg=dict(LONG_CHUNK, grad_f_chunk=32), frozen_q=True, T=100, dtype=bf16)),
        ("map-du-feature-slices", map_du_case, dict(cfg=PACKED4_DQ, expect_du=False,
                                                    dtype=bf16)),
        # the query side of the backward in one kernel (KernelConfig.fuse_q_side)
        ("fused-q", fc, dict(cfg=MAP_DU)),
        ("fused-q-pad-shifts-shared", fc, dict(cfg=MAP_DU, pad=True, per_bh_shift=True,
                                               shared=True)),
        ("fused-q-frozen-q-recomputed", fc, dict(cfg=dict(MAP_DU, save_branches=False),
                                                 frozen=("q",))),
        ("fused-q-la-only-bf16", fc, dict(cfg=MAP_DU, has_swa=False, dtype=bf16)),
        ("fused-q-map-du-bf16", fc, dict(cfg=MAP_DU, map_du=True, dtype=bf16, T=100)),
        ("fused-q-not-for-feature-slices", fc, dict(cfg=PACKED4_DQ, fused=False)),
        ("fused-q-not-for-split-states", fc, dict(cfg=dict(MAP_DU, split_states=True),
                                                  fused=False)),
        ("fused-q-not-without-la", fc, dict(cfg=MAP_DU, has_la=False, fused=False)),
        # the key side of the backward in one grid (KernelConfig.fuse_kv_side)
        ("fused-kv", fc, dict(cfg=LONG_CHUNK, switch="fuse_kv_side", T=150, window=40)),
        ("fused-kv-pad-shifts-shared-tall", fc, dict(cfg=TALL_BWD, switch="fuse_kv_side",
                                                     pad=True, per_bh_shift=True, shared=True)),
        ("fused-kv-frozen-k-split-bf16", fc, dict(cfg=dict(MAP_DU, split_states=True),
                                                  switch="fuse_kv_side", frozen=("k",),
                                                  dtype=bf16)),
        ("fused-kv-group3", fc, dict(cfg=SMALL, switch="fuse_kv_side", H=6, Hkv=2)),
        ("fused-kv-not-without-dv", fc, dict(cfg=SMALL, switch="fuse_kv_side", frozen=("v",),
                                             fused=False)),
        ("fused-kv-not-for-swa-only", fc, dict(cfg=SMALL, switch="fuse_kv_side", has_la=False,
                                               fused=False)),
        ("fused-kv-not-for-la-only", fc, dict(cfg=SMALL, switch="fuse_kv_side", has_swa=False,
                                              fused=False)),
        ("fused-both-map-du-pad-bf16", fc, dict(cfg=MAP_DU, switch="both", map_du=True,
                                                pad=True, dtype=bf16, T=100)),
        # the GPU's default tiles at the 8B head shape (64-row packed query blocks of 4-warp
        # programs, 32-key tiles, the state product pipelined, 128-position state chunks, F 256
        # in one dfq / dfk program, the backward's fused kernels) against the reference; with
        # the forward's key tile at 32; and both fused backward kernels against the separate
        # ones at them
        ("kernel-8b-tiles-pad-shared-bf16", k, dict(
            cfg=d128, H=8, Hkv=2, T=150, D=128, window=64, pad=True, shared=True,
            dtype=bf16, B=1)),
        ("kernel-8b-tiles-fwd-bn32-pad-shared-bf16", k, dict(
            cfg=dict(d128, block_n=32), H=8, Hkv=2, T=150, D=128, window=64, pad=True,
            shared=True, dtype=bf16, B=1)),
        ("fused-both-8b-tiles-pad-shared-bf16", fc, dict(
            cfg=d128, switch="both", map_du=True, pad=True, shared=True, dtype=bf16,
            H=8, Hkv=2, T=150, D=128, window=64, B=1)),
        # _bwd_kv as one program a key block (KernelConfig.kv_one_program: dv summed in
        # another order; against the reference at the 8B tiles: kernel-8b-tiles-pad-shared-bf16,
        # since it is the default)
        ("kv-one-program-8b-tiles-pad-shared-bf16", fc, dict(
            cfg=d128, one_program=True, map_du=True, pad=True, shared=True, dtype=bf16,
            H=8, Hkv=2, T=150, D=128, window=64, B=1)),
        ("kv-one-program-pad-shifts-group3", fc, dict(
            cfg=dict(SMALL, grad_f_chunk=32), one_program=True, H=6, Hkv=2, pad=True,
            per_bh_shift=True)),
        ("kv-one-program-not-for-feature-slices", fc, dict(
            cfg=dict(SMALL, grad_f_chunk=16), one_program=True, fused=False)),
        # the LA state kernels' vector sums on the tensor cores (KernelConfig.state_sums_mma;
        # bf16 only): walked and split
        ("kernel-state-sums-mma-pad-shifts-bf16", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True, dtype=bf16,
            cfg=dict(SMALL, split_states=False, state_sums_mma=True))),
        ("kernel-state-sums-mma-shared-group3-bf16", k, dict(
            T=70, window=10, H=6, Hkv=2, shared=True, dtype=bf16,
            cfg=dict(SMALL, split_states=False, state_sums_mma=True))),
        ("state-sums-walked-pad-bf16", state_sums_case, dict(split=False, pad=True,
                                                              dtype=bf16)),
        ("state-sums-split-bf16", state_sums_case, dict(split=True, dtype=bf16)),
        ("state-sums-split-pad-bf16", state_sums_case, dict(split=True, pad=True, dtype=bf16)),
        ("state-sums-walked-group3-T150-bf16", state_sums_case, dict(split=False, H=6, T=150,
                                                                      dtype=bf16)),
        ("kernel-state-sums-mma-split-pad-shifts-bf16", k, dict(
            T=150, window=40, per_bh_shift=True, pad=True, dtype=bf16,
            cfg=dict(SMALL, split_states=True, state_sums_mma=True))),
        ("kernel-8b-tiles-state-sums-mma-split-pad-bf16", k, dict(
            cfg=dict(d128, state_sums_mma=True, split_states=True), H=8, Hkv=2, T=300,
            D=128, window=64, pad=True, dtype=bf16, B=1)),
        ("kernel-8b-tiles-state-sums-mma-pad-shared-bf16", k, dict(
            cfg=dict(d128, state_sums_mma=True), H=8, Hkv=2, T=300, D=128, window=64,
            pad=True, shared=True, dtype=bf16, B=1)),
        ("map-du-fused-q-kv", map_du_case, dict(cfg=dict(MAP_DU, fuse_q_side=True,
                                                         fuse_kv_side=True), pad=True,
                                                dtype=bf16)),
        # the maps folded into the fused kernel's Function (the layer's call), bit for bit as
        # the maps' own Functions then the kernel
        ("fold-hybrid", fold_case, dict(dtype=bf16)),
        ("fold-exp-pad-g-per-head", fold_case, dict(dtype=bf16, activation="exp", pad=True,
                                                    g_kind="head")),
        ("fold-shared-norm-pad", fold_case, dict(dtype=bf16, shared_norm=True, pad=True,
                                                 g_kind="head")),
        ("fold-ssd-head-pad", fold_case, dict(dtype=bf16, ssd="head", pad=True, g_kind="head")),
        ("fold-swa-only", fold_case, dict(dtype=bf16, mode="swa_only", expect_fold=False)),
        ("fold-gate-hybrid-pad", fold_case, dict(dtype=bf16, g_kind="gate", pad=True)),
        ("fold-gate-ssd-head-rescale", fold_case, dict(dtype=bf16, g_kind="gate", ssd="head",
                                                       rescale=True)),
        ("fold-gate-attention-8b-tiles-pad", fold_case, dict(
            dtype=bf16, g_kind="gate", through="attention", pad=True, H=8, Hkv=2, T=300,
            D=128, window=64, B=1)),
        ("fold-la-only-all-rescale-stage1", fold_case, dict(
            dtype=bf16, mode="la_only", la_span="all", overlap=True, rescale=True, window=1,
            frozen=("q", "k", "v"))),
        ("fold-hybrid-stage1-pad", fold_case, dict(dtype=bf16, frozen=("q", "k", "v"),
                                                   pad=True)),
        ("fold-frozen-maps", fold_case, dict(dtype=bf16, frozen=("maps",), g_kind="head")),
        ("fold-frozen-v-k", fold_case, dict(dtype=bf16, frozen=("v", "k"))),
        ("fold-feature-slices-no-du", fold_case, dict(dtype=bf16, cfg=PACKED4_DQ)),
        ("fold-fused-q-kv-pad", fold_case, dict(
            dtype=bf16, cfg=dict(MAP_DU, fuse_q_side=True, fuse_kv_side=True), pad=True)),
        ("fold-attention-default-tiles-pad", fold_case, dict(
            dtype=bf16, through="attention", pad=True, g_kind="head")),
        ("fold-refused-floor", fold_case, dict(dtype=bf16, floor=1e-3, through="attention",
                                               expect_fold=False)),
        ("fold-refused-fp32-attention", fold_case, dict(dtype=torch.float32,
                                                        through="attention",
                                                        expect_fold=False)),
        ("fold-backward-fallback-pad", fold_case, dict(dtype=bf16, backward_fails=True,
                                                       pad=True, g_kind="head")),
        ("fold-attention-8b-tiles-pad", fold_case, dict(
            dtype=bf16, through="attention", pad=True, H=8, Hkv=2, T=300, D=128, window=64,
            B=1)),
        # the maps' pair on walking programs (``PairPlan``), through descriptors or by
        # pointers, against one program a block: bit for bit
        ("pair-walk", pair_walk_case, dict(dtype=bf16)),
        ("pair-walk-tma", pair_walk_case, dict(dtype=bf16, tma=True)),
        ("pair-walk-tma-8b-D128-T300", pair_walk_case, dict(
            dtype=bf16, tma=True, B=2, Hq=4, Hk=1, T=300, D=128, per_sm=2)),
        ("pair-walk-stages1-B1-T40", pair_walk_case, dict(dtype=bf16, B=1, T=40, stages=1,
                                                           several=False)),
        ("fold-forward-walk-tma-8b-tiles-pad", fold_case, dict(
            dtype=bf16, pad=True, H=8, Hkv=2, T=300, D=128, window=64, B=1, cfg=d128,
            walk=tp.PairPlan(2, 64, 8))),
        ("fold-forward-walk-pad-exp", fold_case, dict(
            dtype=bf16, pad=True, activation="exp", walk=tp.PairPlan(3, 64, 4))),
        ("phi-softmax", phi_case, dict(dtype=bf16)),
        ("phi-softmax-strided-rect", phi_case, dict(dtype=bf16, strided=True,
                                                    proj="rectangular", D=32)),
        ("phi-exp", phi_case, dict(dtype=bf16, activation="exp")),
        ("phi-frozen-x", phi_case, dict(dtype=bf16, frozen_x=True)),
        ("phi-heads-first-layout", phi_case, dict(dtype=bf16, heads_first=True)),
        ("phi-strided-B1", phi_case, dict(dtype=bf16, strided=True, B=1)),
        ("phi-strided-H1", phi_case, dict(dtype=bf16, strided=True, H=1)),
        ("phi-strided-frozen-x", phi_case, dict(dtype=bf16, strided=True, frozen_x=True)),
        ("phi-D32-T70", phi_case, dict(dtype=bf16, T=70, D=32)),
        # several row blocks along T (300 rows: 5 blocks of 64, the last partial)
        ("phi-blocks-T300-strided", phi_case, dict(dtype=bf16, T=300, strided=True)),
        ("phi-blocks-T300-exp", phi_case, dict(dtype=bf16, T=300, activation="exp")),
        ("phi-with-input", phi_case, dict(dtype=bf16, with_input=True)),
        ("phi-with-input-strided-exp", phi_case, dict(dtype=bf16, with_input=True,
                                                      strided=True, activation="exp")),
        ("phi-with-input-frozen-x", phi_case, dict(dtype=bf16, with_input=True,
                                                   frozen_x=True)),
        ("retain-graph-twice-pad-bf16", retain_graph_case, dict(dtype=bf16)),
        ("checkpointed-fold-pad-bf16", checkpointed_case, dict(dtype=bf16)),
        ("checkpointed-gate-pad-bf16", checkpointed_case, dict(dtype=bf16, g_kind="gate")),
        ("retain-graph-twice-gate-pad-bf16", retain_graph_case, dict(dtype=bf16,
                                                                    g_kind="gate")),
        ("model-fixed-pad", model_case, dict(pad=True, dtype=bf16)),
        ("model-learned-head-ssd", model_case, dict(mixer="learned_head", ssd_p=0.5,
                                                           dtype=bf16)),
        ("model-shared-norm", model_case, dict(mixer="shared_norm", dtype=bf16)),
        ("model-gate-elementwise-pad", model_case, dict(mixer="gate_elementwise", pad=True,
                                                                dtype=bf16)),
        ("model-gate-lowrank-ssd-rescale", model_case, dict(mixer="gate_lowrank", ssd_p=0.5,
                                                            rescale=True, dtype=bf16)),
        ("model-gate-elementwise-swa-only", model_case, dict(mixer="gate_elementwise",
                                                             mode="swa_only", dtype=bf16)),
        ("model-gate-elementwise-la-only", model_case, dict(mixer="gate_elementwise",
                                                            mode="la_only", dtype=bf16)),
        ("decode-hybrid", decode_case, dict(dtype=torch.float32)),
        ("decode-pad-learned-head", decode_case, dict(dtype=torch.float32, pad=True,
                                                      mixer="learned_head")),
        ("decode-shared-norm-pad", decode_case, dict(dtype=torch.float32, mixer="shared_norm",
                                                     pad=True)),
        ("decode-gate-elementwise-pad", decode_case, dict(dtype=torch.float32,
                                                          mixer="gate_elementwise", pad=True)),
        ("decode-gate-lowrank-MHA", decode_case, dict(dtype=torch.float32, mixer="gate_lowrank",
                                                      Hkv=4)),
        ("decode-swa-only", decode_case, dict(dtype=torch.float32, mode="swa_only")),
        ("decode-swa-only-rescale-shared", decode_case, dict(dtype=torch.float32,
                                                             mode="swa_only", rescale=True,
                                                             mixer="shared_norm")),
        ("decode-la-only", decode_case, dict(dtype=torch.float32, mode="la_only")),
        ("decode-la-only-rescale-gqa4", decode_case, dict(dtype=torch.float32, mode="la_only",
                                                          rescale=True, H=8, Hkv=2)),
        ("decode-w5-sinks0-group3", decode_case, dict(dtype=torch.float32, window=5, n_sinks=0,
                                                      H=6, Hkv=2)),
        ("decode-bf16-pad-gate", decode_case, dict(dtype=bf16, pad=True,
                                                   mixer="gate_elementwise")),
    ]
    if quick:
        keep = {"kernel-hybrid", "kernel-pad-shared", "kernel-tall-bwd-tiles", "layer-ssd-head-all", "xent-pad",
                "xent-entry", "phi-softmax", "decode-pad-learned-head", "kernel-frozen-qkv",
                "kernel-split-states-D32-two-tiles-pad-shifts", "mse-bf16-pad-sdpa-layout"}
        out = [c for c in out if c[0] in keep]
    return [(cid, fn, kw, "bfloat16" if kw and kw.get("dtype") == bf16 else "float32")
            for cid, fn, kw in out]


def poison_canary_case(cid) -> dict:
    """A host that reads memory nobody wrote: a buffer from ``torch.empty`` of which only the
    first half is written, then read whole (its NaNs counted: 8 under ``Poisoned``; otherwise
    whatever the leftovers hold, NaN too where they are an earlier poisoned run's). Under
    ``--poison`` it must read all 8: the check's own test, where every real case must report
    nothing."""
    buf = torch.empty(16)
    buf[:8] = torch.arange(8, dtype=torch.float32)
    return {"nan_read": float(torch.isnan(buf).sum())}


def _chain_kernel():
    """A kernel whose program p writes its slot of X, then reads its predecessor's (p - 1):
    right only where programs run in order (``order_canary_case``)."""
    import triton
    import triton.language as tl

    @triton.jit
    def chain(X, Y):
        p = tl.program_id(0)
        tl.store(X + p, p + 1)
        tl.store(Y + p, tl.load(X + p - 1, mask=p > 0, other=0))

    return chain


def order_canary_case(cid) -> dict:
    """Programs that read what another program of the same launch wrote (``_chain_kernel``):
    in the interpreter's order every read finds its value, in reverse none does. ``--reverse``
    must report it: the check's own test, where every real case must report nothing."""
    x, y = torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
    _chain_kernel()[(8,)](x, y)
    return {"reads_before_the_write": float((y != torch.arange(8, dtype=torch.int32)).sum())}


def _run_case(fn, cid, kw) -> dict:
    return fn(cid) if kw is None else fn(cid, **kw)


@contextlib.contextmanager
def programs_reversed():
    """Every launch's programs run in the reverse of the interpreter's order (the last program
    first: each grid index mirrored). A kernel whose programs read what other programs of the
    same launch write then gives other results: on a GPU its programs run at once, in any
    order, and that read is a race."""
    import triton.runtime.interpreter as ti

    builder = ti.InterpreterBuilder
    set_idx = builder.set_grid_idx

    def mirrored(self, x, y, z):
        nx, ny, nz = self.grid_dim
        set_idx(self, nx - 1 - x, ny - 1 - y, nz - 1 - z)

    builder.set_grid_idx = mirrored
    try:
        yield
    finally:
        builder.set_grid_idx = set_idx


def _moved(errs: dict, again: dict) -> list[str]:
    """The names whose error or flag differs between two runs of a case (NaN equals NaN)."""
    return sorted(n for n in set(errs) | set(again)
                  if not (errs.get(n) == again.get(n)
                          or (errs.get(n) != errs.get(n) and again.get(n) != again.get(n))))


def main() -> int:
    """``--poison``: each case again under ``poison.Poisoned`` (every uninitialised allocation
    filled with NaN / a large integer / True); ``--reverse``: again with every launch's
    programs in reverse order (``programs_reversed``). The row's ``poison_changed`` /
    ``reverse_changed`` list the errors and flags that moved (bit for bit: the interpreter is
    deterministic), which must be none but for the canaries' own (``poison-canary``'s poison,
    ``order-canary``'s reverse)."""
    _install_shims()
    args = sys.argv[1:]
    shard, n_shards = 0, 1
    if "--shard" in args:  # K/N: every N-th selected case from the K-th (processes side by side)
        i = args.index("--shard")
        shard, n_shards = (int(x) for x in args[i + 1].split("/"))
        del args[i:i + 2]
    torch.set_num_threads(max(1, 2 // n_shards))
    quick = "--quick" in args
    again = {"poison": Poisoned, "reverse": programs_reversed}
    again = {name: ctx for name, ctx in again.items() if f"--{name}" in args}
    only = [a for a in args if not a.startswith("--")]
    selected = [c for c in cases(quick) if not only or c[0] in only]
    for cid, fn, kw, dtype in selected[shard::n_shards]:
        t0 = time.time()
        try:
            errs = _run_case(fn, cid, kw)
            row = {"id": cid, "dtype": dtype, "errors": errs, "tol": TOL[dtype]}
            for name, ctx in again.items():
                with ctx() as mode:
                    rerun = _run_case(fn, cid, kw)
                row[f"{name}_changed"] = _moved(errs, rerun)
                if cid.endswith("-canary"):  # (what the rerun itself read: the leftovers of
                    # an ordinary run may be an earlier poisoned run's)
                    row[f"{name}_errors"] = rerun
                if name == "poison":
                    row["poisoned"] = mode.count
        except Exception as e:  # one failing case must not hide the others
            row = {"id": cid, "dtype": dtype, "error": f"{type(e).__name__}: {e}"[:1000]}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
