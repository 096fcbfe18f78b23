"""Fused Triton kernels for the hybrid layer: windowed softmax + linear attention + mixer.

One forward and one backward per call, recomputing instead of storing (issue 11). What the
kernels compute, per batch row ``b`` and query head ``h`` (``c_A, c_B, shift`` per ``(b, h)``):

    SWA_t = softmax over the window keys  t - w < i <= t           (lse_t kept, fp32)
    LA_t  = sum_{i <= t - shift} k_ti v_i / max(den_t, eps)    den_t = sum k_ti, fp32,
            k_ti = fq_t.fk_i + eps (the kernel floor of ops.reference.linear_attention_chunked:
            eps in numerator and normaliser alike; 0 where no real key i <= t - shift)
    out_t = c_A SWA_t + c_B LA_t                                    (fixed / per-head / SSD)
    out_t = alpha_t SWA_t + (1 - alpha_t) LA_t,
            alpha_t = sigmoid(log s_h + lse_t - log max(den_t, eps))   (``shared_norm``)

``shift`` is ``w`` (non-overlapping), 0 (``overlap``, or ``la_only`` with ``la_span="all"``).
``ops.hybrid.hybrid_attention``'s modes map onto it (``fused_hybrid``): ``hybrid``, ``swa_only``
(no LA pass), ``la_only`` (no SWA pass), SSD (``swa_drop``: a dropped ``(b, h)`` gets
``c_A = 0`` and the ``la_only`` weight and span) and ``shared_norm`` in ``hybrid`` mode.
Output-gate mixers (a ``g`` per position and channel, which per-head weights cannot carry) take
one call per branch at weight 1 (SWA with no features, LA with the maps) mixed in PyTorch
(``_gated``). What it does not cover returns ``None`` with the reason logged once, and the
caller runs the piece-by-piece path: sinks / softmax / none, ``shared_norm`` outside
``hybrid`` mode or with SSD, KV-cache calls (fewer queries than keys),
dtypes other than bf16 / fp32, mixed dtypes, head or feature dims that are not powers of two in
[16, 128] / [16, 256], CPU tensors.

How (all kernels take strided (B, H, T, X) tensors, no copies of q, k, v; the output and the
gradients of q, k, v are written in their inputs' memory (``like``): the model's (B, T, H, D)
projections, which its transpose-reshape and autograd's accumulation then take as they are):

    _state_fwd    per (b, kv head, F-block, D-block), walking T: the LA state
                  S_j = sum_{i < j C} fk_i v_i^T, z_j = sum fk_i and u_j = sum v_i (the floor's
                  share) at every C-th position (C = ``state_chunk``), masked keys left out.
                  (B, Hkv, T/C, F, D) in the input dtype; z, u in fp32. Past
                  ``SPLIT_STATES_MIN_CHUNKS`` chunks (``KernelConfig.split_states``) instead
                  _state_local, per (chunk, tile, b, kv head): each chunk's share in fp32, and
                  _state_scan their running sums (a long walk at batch 1 had too few programs).
    _fwd          per (b, P query heads of one kv head, block of BM / P positions; P from
                  ``KernelConfig.pack_heads``, ``pack_of``): LA from the nearest state at or
                  before t0 - shift + 1 plus the keys between it and the block (masked), the
                  window keys (online softmax, exp2), the mixer, the output; keeps lse_t and
                  den_t (fp32). The P heads share every key, value and state load; the
                  query-side backward kernels (_bwd_dq, _bwd_dfq) take rows the same way.
    backward      _state_fwd again; _bwd_dq per query block reads LA_t . dO_t and SWA_t . dO_t
                  from the branch outputs the forward stored (``KernelConfig.save_branches``,
                  the default; without it, a first pass recomputes both), forms the mixer's
                  per-query factors, then dq (second pass, skipped when q takes no gradient);
                  _bwd_dfq per query block and feature slice: dfq (or, fq being a Hedgehog
                  map's output, the map's du: ``triton_phi.DuSlot``); _state_rev walks T
                  backwards summing fq_t dnum_t^T over the query heads of each kv head (GQA) into
                  reverse states (split as the forward's, reversed, past the threshold); per
                  key block and kv head, _bwd_dkv_swa gets dk and the window's dv from the
                  window queries, and _bwd_dkv_la dfk (per feature slice) and the rest of dv
                  from the queries between the block and the next reverse state, and that
                  state. At D 128 bf16 (``default_config``) the passes run fused, the same
                  arithmetic in fewer launches: _bwd_q the dq pass then the dfq pass
                  (``KernelConfig.fuse_q_side``, walked states), _bwd_kv the key side in one
                  grid, its dv programs doing _bwd_dkv_swa's work first (``fuse_kv_side``).
                  Passes that only serve gradients autograd does not ask for (dq,
                  the window's dk / dv, LA's dv: stage 1's teacher q, k, v) are not launched.
                  Mixer gradients (c_A, c_B or log s_h) come back as per-block partial sums,
                  reduced in torch (deterministic).

The reverse-state kernels read their tiles through device-side tensor descriptors (TMA,
``_tiles_of`` / ``_tile``; ``KernelConfig.tma``) where ``triton_common.tma_ok`` allows (sm_90+,
16-byte-aligned tensors), else through pointer tensors (same values): a loop over pointer
tensors keeps them in registers (ptxas: 255 per thread against ~100), the descriptors' loads
are pipelined. The forward kernel measured slower through them and stays on pointers.

The feature dimension is taken ``f_chunk`` at a time in the forward's and dq's products over
it, so no program holds an F-wide operand and an F-wide accumulator at once; the dfq / dfk
programs take ``grad_f_chunk`` (the whole F at D 128 bf16: one D-wide dO . v product per
block). Tile sizes were chosen from ptxas's register report for sm_90a (``default_config``).
Tiles that do not compile on a device are replaced once by ``SAFE_CONFIG`` (``TRACE.retries``); any
other Triton failure sends the call to the piece-by-piece path (``TRACE.fallbacks``), and where
the safe tiles fail too that is remembered per problem (``_SAFE_FAILED``: later calls go to that
path without compiling again).

The layer's feature maps can run inside the kernels' autograd Function (``fold_maps``,
``hybrid_kernel(maps=...)``; ``ops.hybrid.hybrid_attention(maps=...)``, the converted layer's
call): their kernels (``triton_phi``, both maps in one launch) in its forward, their backward
from the dfq pass's du and dfk in its backward; one autograd node instead of three.

Numerics: matrix products in the input dtype with fp32 accumulation (fp32 inputs: ``tf32x3``,
three tf32 products, about fp32 accuracy); the stored LA states are in the input dtype (they are
a matrix operand anyway), the key sums z, the denominators, lse and every normaliser in fp32;
per-query factors (mixer weights, 1/den) are applied in fp32 to the products' rows rather than
to a rounded operand.

Checked against ``kernel_reference`` (pure PyTorch, the same function built from
``ops.reference``) under ``TRITON_INTERPRET=1`` on CPU (tests/test_triton_interpreter.py) and
against ``hybrid_attention(backend="reference")`` on the GPU (tests/test_triton_kernels.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..feature_map import kernels as triton_phi
from ..feature_map.function import DU_SLOT_ATTR, DuSlot
from ..feature_map.reference import reference_features
from ..instrument import TRACE
from ..triton_common import cast, cdiv, errors
from . import backward, forward
from .config import (KernelConfig, _with_retry, check, default_config,
                     use_split_states)
from .reference import kernel_reference


@functools.lru_cache(maxsize=256)
def _filled(shape: tuple, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A constant tensor made once per (shape, value, dtype, device): a fixed g's (B, H) mixer
    weights and shifts, an unpadded batch's first keys (each was a fill launch and a few
    microseconds of host time per call). Only read (the kernels, the backward's saved inputs);
    made outside inference mode, so that a cache filled during evaluation can be saved for a
    later training call's backward."""
    with torch.inference_mode(False):
        return torch.full(shape, value, dtype=dtype, device=device)


@functools.lru_cache(maxsize=16)  # (B T int32 each: 4 MB at 8 x 128k)
def _key_counts(B: int, T: int, device: torch.device) -> torch.Tensor:
    """cnt[b, i] = i (B, T + 1) int32: an unpadded batch's real keys before position i
    (``_filled``'s terms)."""
    with torch.inference_mode(False):
        return torch.arange(T + 1, device=device, dtype=torch.int32).expand(B, T + 1).contiguous()


class FoldedMaps(NamedTuple):
    """The layer's two Hedgehog maps as ``hybrid_kernel(maps=...)`` runs them inside its own
    autograd Function (``fold_maps``): each map's weight (H, D, F/2) and bias (H, F/2), the
    parameters themselves, and whether its activation is the softmax (else exp)."""
    wq: torch.Tensor
    bq: torch.Tensor
    wk: torch.Tensor
    bk: torch.Tensor
    softmax_q: bool
    softmax_k: bool


#: _HybridFn's inputs before the folded maps' (their gradients' positions in its backward)
_N_KERNEL_INPUTS = 22


class _Forward(NamedTuple):
    """What ``_function_forward`` gives: the output, the features (the folded maps' outputs
    where they ran), the maps' weights and biases as their kernels read them (``None`` without
    folded maps), and what the backward reads (``_forward``'s lse, den, branches, states)."""
    o: torch.Tensor
    fq: torch.Tensor
    fk: torch.Tensor
    casts: tuple | None
    lse: torch.Tensor
    den: torch.Tensor
    swa_o: torch.Tensor | None
    la_o: torch.Tensor | None
    states: tuple | None


def _map_pair(q, k, wq, bq, wk, bk, maps_softmax) -> tuple:
    """(fq, fk, the maps' weights and biases as their kernels read them): both folded maps in
    one launch (``triton_phi.map_forward_pair``)."""
    (fq, wqc, bqc), (fk, wkc, bkc) = triton_phi.map_forward_pair(
        q, wq, bq, maps_softmax[0], k, wk, bk, maps_softmax[1])
    TRACE.count("feature_map.forward", 2)
    return fq, fk, (wqc, bqc, wkc, bkc)


def _function_forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window, scale,
                      eps, has_swa, has_la, shared, cfg, save, wq=None, bq=None, wk=None,
                      bk=None, maps_softmax=None, *, autograd: bool = True,
                      branch_is_output: bool = False, premapped=None) -> _Forward:
    """The forward of ``_HybridFn``'s function (its arguments, less the du slot): with the maps
    folded in (``maps_softmax`` given), fq = phi_q(q) and fk = phi_k(k) first, both maps in one
    launch (``_map_pair``; ``premapped``: its result, launched already by ``hybrid_kernel``
    for a forward without autograd); then the kernels (``forward.launch_forward``, through the
    tile retry chain). ``hybrid_kernel`` calls it directly where no gradient will be asked for
    (evaluation, prefill; ``autograd`` False): the same launches, without the autograd
    Function's host work."""
    casts = None
    if premapped is not None:
        fq, fk, casts = premapped
    elif maps_softmax is not None:  # (both maps in one launch)
        fq, fk, casts = _map_pair(q, k, wq, bq, wk, bk, maps_softmax)
    # the state path is part of the problem: a split build that fails to compile at long T
    # must not send short calls (which walk) down the retry chain
    F = fk.shape[-1]
    key = (q.dtype, q.shape[-1], F, has_swa, has_la, shared, kpm_i8 is not None,
           save, use_split_states(cfg, cdiv(q.shape[2], cfg.state_chunk)))
    o, lse, den, swa_o, la_o, states = _with_retry(
        "forward", key, cfg, lambda c: forward.launch_forward(
            q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window=window,
            scale=scale, eps=eps, has_swa=has_swa, has_la=has_la, shared=shared, cfg=c,
            save=save and c.save_branches, branch_is_output=branch_is_output))
    return _Forward(o, fq, fk, casts, lse, den, swa_o, la_o, states)


class _HybridFn(torch.autograd.Function):
    """The kernels' function of (q, k, v, fq, fk, the mixer's ca / cb / logs); with the maps
    folded in (``wq, bq, wk, bk, maps_softmax`` given, fq and fk ``None``), of (q, k, v, the
    maps' weights and biases, the mixer's): the forward computes fq = phi_q(q), fk = phi_k(k)
    with the maps' kernels in one launch (``triton_phi.map_forward_pair``), the backward hands
    the maps' backward (``triton_phi.map_backward_pair``) the kernel's du for the q map and dfk
    for the k map, with the attention's dq and dk to add in the maps' kernels. One autograd
    node for the three; the same kernels, with the same arguments, as the maps' own Functions
    would launch (the gradients are bit for bit the same: tests/triton_interpreter_check.py
    ``fold_case``)."""

    @staticmethod
    def forward(ctx, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window, scale,
                eps, has_swa, has_la, shared, cfg, save, du_slot, branch_is_output, wq=None,
                bq=None, wk=None, bk=None, maps_softmax=None):
        r = _function_forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, window,
                              scale, eps, has_swa, has_la, shared, cfg, save, wq, bq, wk, bk,
                              maps_softmax, branch_is_output=branch_is_output)
        ctx.maps = None if r.casts is None else (
            maps_softmax, (wq.dtype, bq.dtype), (wk.dtype, bk.dtype))
        # (all through save_for_backward, the branches and states too: held on ctx instead,
        # the backward could drop them before the folded maps' backward allocates, but
        # non-reentrant activation checkpointing, which the stages use, discards and recomputes
        # only saved tensors: every layer's branches would stay alive through the forward)
        ctx.saved_branches = (r.swa_o is not None, r.la_o is not None)
        # the branch saved is the output (``output_is_branch``): never released by the
        # backward (whoever holds the output, e.g. an output gate's lerp, still reads it)
        ctx.branch_is_output = r.o is r.swa_o or r.o is r.la_o
        ctx.states_chunk = None if r.states is None else r.states[3]
        ctx.save_for_backward(q, k, v, r.fq, r.fk, ca, cb, logs, shift, first, cnt, r.lse,
                              r.den, *(x for x in (r.swa_o, r.la_o) if x is not None),
                              *(() if r.states is None else r.states[:3]),
                              *(() if kpm_i8 is None else (kpm_i8,)),
                              *(() if r.casts is None else r.casts))
        ctx.args = dict(window=window, scale=scale, eps=eps, has_swa=has_swa, has_la=has_la,
                        shared=shared, cfg=cfg)
        ctx.has_kpm = kpm_i8 is not None
        ctx.du_slot = du_slot
        return r.o

    @staticmethod
    def backward(ctx, do):
        q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, lse, den, *rest = ctx.saved_tensors
        swa_o = rest.pop(0) if ctx.saved_branches[0] else None
        la_o = rest.pop(0) if ctx.saved_branches[1] else None
        states = None
        if ctx.states_chunk is not None:
            states = (rest.pop(0), rest.pop(0), rest.pop(0), ctx.states_chunk)
        kpm_i8 = rest.pop(0) if ctx.has_kpm else None
        folded = ctx.maps is not None
        # a second backward through the graph (retain_graph) after the first released them
        # (``_release_saved``): the kernels recompute both branches' factors and the states
        if swa_o is not None and _released(swa_o) or la_o is not None and _released(la_o):
            swa_o = la_o = None
            TRACE.count("hybrid.saved_recomputed")
        if states is not None and _released(states[0]):
            states = None
        a = ctx.args
        do = do if do.stride(-1) == 1 else do.contiguous()
        if do.dtype != q.dtype:
            do = do.to(q.dtype)
        need = tuple(ctx.needs_input_grad[:3])  # dq, dk, dv
        key = (q.dtype, q.shape[-1], fq.shape[-1], a["has_swa"], a["has_la"], a["shared"],
               kpm_i8 is not None, swa_o is not None or la_o is not None, need,
               use_split_states(a["cfg"], cdiv(q.shape[2], a["cfg"].state_chunk)))
        args = {n: x for n, x in a.items() if n != "cfg"}
        if folded:  # (the q map's du straight from the kernel: no other consumer of fq)
            du_slot = DuSlot(q, fq.shape[-1] // 2, ctx.maps[0][0]) if any(
                _map_needs(ctx, 0)) else None
        else:
            du_slot = ctx.du_slot if ctx.needs_input_grad[3] else None
        if du_slot is not None:
            du_slot.clear()  # (nothing stale from a backward whose map's never ran)
            if not folded and du_slot.observed():  # (fq's own gradient asked for: dfq)
                du_slot = None
        try:
            dq, dk, dv, dfq, dfk, pa, pb = _with_retry("backward", key, a["cfg"], lambda c: (
                backward.launch_backward(do, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt,
                                         kpm_i8, lse,
                          den, cfg=c, need=need, swa_o=swa_o, la_o=la_o, states=states,
                          du_slot=du_slot, **args)))
        except errors() as e:  # a Triton resource / compile failure: say so, stay right
            TRACE.fallback("hybrid", "hybrid backward", e, "this call's gradients come from "
                           "the PyTorch reference", phase="backward")
            return _reference_backward(ctx, do, q, k, v, fq, fk, ca, cb, logs, shift, first,
                                       kpm_i8, a, rest if folded else None)
        if dfq is None and folded:  # (no LA: the maps' backward takes zeros; autograd, None)
            dfq, dfk = torch.zeros_like(fq), torch.zeros_like(fk)
        if folded:  # (the kernels have read the saved branches and states: their memory back
            # before the maps' backward allocates)
            _release_saved(*(() if ctx.branch_is_output else (swa_o, la_o)),
                           *(() if states is None else states[:3]))
            dq, dk, map_grads = _folded_maps_backward(ctx, q, k, fq, fk, dq, dk, dfq, dfk,
                                                      du_slot, rest)
        elif dq is None and need[0]:  # no window (la_only): q has no other path
            dq = torch.zeros_like(q)
        # the mixer's gradients from the per-block partial sums, only those autograd asks for
        # (a fixed g takes none: two reductions fewer per call)
        want_ca, want_cb, want_logs = ctx.needs_input_grad[5:8]
        if a["shared"]:
            dca, dcb, dlogs = None, None, pa.sum(-1) if want_logs else None
        else:
            dca = pa.sum(-1) if want_ca else None
            dcb = pb.sum(-1) if want_cb else None
            dlogs = None
        if folded:
            return (dq, dk, dv, None, None, dca, dcb, dlogs) + (None,) * 14 + map_grads
        return (dq, dk, dv, dfq, dfk, dca, dcb, dlogs) + (None,) * 14


def _release_saved(*tensors) -> None:
    """Empty the storage of the forward's saved branches and LA states (``_HybridFn``'s own
    allocations, read by the backward's kernels by now) in place, as FSDP frees a parameter:
    a saved tensor lives until its node's backward returns, and with the maps folded in, the
    maps' backward runs inside that node (at 1 x 64k on the 8B's heads it had peaked 0.59 GiB
    above the call before the fold). They stay saved tensors - activation
    checkpointing discards and recomputes only those - and a second backward through the
    graph (``retain_graph``) finds them empty (``_released``) and recomputes what they held.
    On a GPU the caching allocator takes the blocks back in stream order (the kernels that
    read them were launched on this stream before)."""
    held = [x for x in tensors if x is not None]
    for x in held:
        x.untyped_storage().resize_(0)
    TRACE.count("hybrid.saved_released", bool(held))


def _released(x: torch.Tensor) -> bool:
    """Whether ``_release_saved`` emptied ``x``'s storage (a non-empty tensor with none)."""
    return x.numel() > 0 and x.untyped_storage().nbytes() == 0


def _folded_maps_backward(ctx, q, k, fq, fk, dq, dk, dfq, dfk, du_slot, saved):
    """(dq, dk, the gradients of wq, bq, wk, bk and ``maps_softmax``) of ``_HybridFn`` with the
    maps folded in: each map's backward (``triton_phi.map_backward``) from the kernel's du
    (q; or its dfq, where the config's dfq programs take a feature slice: no du) and dfk (k),
    adding the attention's dq / dk in its kernel."""
    wqc, bqc, wkc, bkc = saved  # (the weights in the inputs' dtype, as the kernels read them)
    softmax, q_dtypes, k_dtypes = ctx.maps
    q_side = k_side = None
    if any(_map_needs(ctx, 0)):
        du, only = du_slot.take(dfq) if du_slot is not None else (None, False)
        q_side = dict(x=q, wc=wqc, bc=bqc, y=fq, dy=dfq, dx_in=dq, softmax=softmax[0],
                      dtypes=q_dtypes, du=du, du_only=only, need=_map_needs(ctx, 0),
                      dx_into_input=True)
    if any(_map_needs(ctx, 1)):  # (dq, dk: the kernels' own buffers, written over)
        k_side = dict(x=k, wc=wkc, bc=bkc, y=fk, dy=dfk, dx_in=dk, softmax=softmax[1],
                      dtypes=k_dtypes, need=_map_needs(ctx, 1), dx_into_input=True)
    got_q, got_k = triton_phi.map_backward_pair(q_side, k_side)  # (one launch where both run)
    dwq = dbq = dwk = dbk = None
    if got_q is not None:
        dq, dwq, dbq = got_q
    if got_k is not None:
        dk, dwk, dbk = got_k
    TRACE.count("hybrid.maps_folded_backward")
    return dq, dk, (dwq, dbq, dwk, dbk, None)


def _map_needs(ctx, i: int) -> tuple[bool, bool, bool]:
    """Which of (x, weight, bias) of the folded map i (0: q, 1: k) autograd asks gradients
    of."""
    need = ctx.needs_input_grad
    w = _N_KERNEL_INPUTS + 2 * i
    return need[i], need[w], need[w + 1]


def _reference_backward(ctx, do, q, k, v, fq, fk, ca, cb, logs, shift, first, kpm_i8, a,
                        folded=None):
    """The gradients from ``kernel_reference`` (fp32); ``folded``: the maps' weights and
    biases as the kernels read them (``_HybridFn`` with the maps folded in): the maps run
    in it too (``feature_map.reference.reference_features``), and their gradients come back."""
    kpm = None if kpm_i8 is None else kpm_i8.bool()
    with torch.enable_grad():
        if folded is None:
            ins = [t.detach().requires_grad_() for t in (q, k, v, fq, fk, ca, cb, logs)]
            feats = ins[3:5]
        else:
            ins = [t.detach().requires_grad_() for t in (q, k, v, ca, cb, logs)]
            ins += [t.detach().float().requires_grad_() for t in folded]
            wq, bq, wk, bk = ins[6:]
            act = ["softmax" if s else "exp" for s in ctx.maps[0]]
            feats = [reference_features(ins[0], wq, bq, act[0]),
                     reference_features(ins[1], wk, bk, act[1])]
        mix = ins[5:8] if folded is None else ins[3:6]
        out = kernel_reference(*ins[:3], *feats, *mix, shift.view(q.shape[0], q.shape[1]),
                               window=a["window"], scale=a["scale"], eps=a["eps"],
                               key_padding_mask=kpm, has_swa=a["has_swa"], has_la=a["has_la"],
                               shared=a["shared"])
        grads = torch.autograd.grad(out, ins, do.float(), allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g.to(t.dtype) for g, t in zip(grads, ins)]
    if folded is None:
        dq, dk, dv, dfq, dfk, dca, dcb, dlogs = grads
        map_grads = ()
    else:
        dq, dk, dv, dca, dcb, dlogs = grads[:6]
        dfq = dfk = None
        dtypes = (*ctx.maps[1], *ctx.maps[2])  # (the parameters' own)
        map_grads = tuple(g.to(t) for g, t in zip(grads[6:], dtypes)) + (None,)
    if a["shared"]:
        dca = dcb = None
    else:
        dlogs = None
    return (dq, dk, dv, dfq, dfk, dca, dcb, dlogs) + (None,) * 14 + map_grads


# ============================================================================= entry points
def hybrid_kernel(q, k, v, fq, fk, ca, cb, logs, shift, *, window: int, scale: float, eps: float,
                  key_padding_mask: torch.Tensor | None = None, has_swa: bool = True,
                  has_la: bool = True, shared: bool = False,
                  config: KernelConfig | None = None,
                  maps: FoldedMaps | None = None,
                  output_is_branch: bool = False) -> torch.Tensor:
    """The kernels' own function (see the module docstring), differentiable in q, k, v, fq,
    fk, ca, cb (not ``shared``) and logs (``shared``).

    q (B, H, T, D), k, v (B, Hkv, T, D), fq (B, H, T, F), fk (B, Hkv, T, F), one dtype;
    ca, cb, logs (B, H) fp32; shift (B, H) int; key_padding_mask (B, T) bool or None.
    ``maps`` (``fold_maps``), with fq and fk ``None``: fq = phi_q(q) and fk = phi_k(k) are
    computed inside this call's autograd Function, which is then differentiable in the maps'
    weights and biases too (the layer's path: one autograd node instead of three).
    ``output_is_branch``: the caller promises the call has one branch (``has_swa`` or
    ``has_la``) at weight 1 for every head (ca 1 without LA, cb 1 without SWA; an output
    gate's branch calls, ``_gated``): the output is then that branch bit for bit, and the
    backward reads it as the saved branch instead of a second copy the forward would store
    (``save_branches``; ~0.5 GiB a branch at 1 x 64k on the 8B's heads).
    No checks beyond shapes: ``fused_hybrid`` decides what may come here.
    """
    B, H, T, D = q.shape
    if maps is not None and (fq is not None or fk is not None):
        raise ValueError("hybrid_kernel takes the features (fq, fk) or the maps, not both")
    F = fq.shape[-1] if maps is None else 2 * maps.wq.shape[-1]
    cfg = config or default_config(D, F, q.dtype)
    check(cfg)
    if output_is_branch and has_swa == has_la:
        raise ValueError("output_is_branch needs a call with one branch (has_swa or has_la, "
                         f"not both nor neither): has_swa={has_swa}, has_la={has_la}")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if maps is None:
        fq, fk = (x if x.stride(-1) == 1 else x.contiguous() for x in (fq, fk))
    ins = (q, k, v, ca, cb, logs) + ((fq, fk) if maps is None else tuple(maps[:4]))
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in ins)
    premapped = None
    if maps is not None and not grad:
        # evaluation, prefill: the maps' launch first, before the rest of the call's
        # preparation (an isolated call's GPU waits for its first launch, and its event time
        # reads that latency). Not under grad: there the host runs ahead of the GPU, and
        # launching outside the Function would need a no_grad context for the weights' casts
        premapped = _map_pair(q, k, *maps[:4], maps[4:])
    dev = q.device
    if key_padding_mask is None:
        kpm_i8 = None
        first = _filled((B,), 0, torch.int32, dev)
        cnt = _key_counts(B, T, dev)
    else:
        kpm = key_padding_mask.bool()
        kpm_i8 = kpm.to(torch.int8).contiguous()
        # index of the first real key of each row (T where there is none)
        idx = torch.where(kpm, torch.arange(T, device=dev)[None, :], T)
        first = idx.min(dim=1).values.to(torch.int32)
        # cnt[b, i]: real keys before position i (the kernel floor counts visible real keys)
        cnt = torch.nn.functional.pad(kpm.int().cumsum(1), (1, 0)).to(torch.int32).contiguous()
    ca, cb, logs = (cast(x, torch.float32).reshape(B * H).contiguous() for x in (ca, cb, logs))
    shift = cast(shift.to(dev), torch.int32).reshape(B * H).contiguous()
    folded = () if maps is None else (*maps[:4], maps[4:])
    if maps is not None:
        TRACE.count("hybrid.maps_folded")
    args = (q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, int(window), float(scale),
            float(eps), bool(has_swa), bool(has_la), bool(shared), cfg)
    if not grad:  # (evaluation, prefill: no autograd node, nothing stored for a backward)
        out = _function_forward(*args, False, *folded, autograd=False, premapped=premapped).o
        TRACE.count("hybrid.forward_without_autograd")
        return out
    # fq as a Hedgehog map's output, unchanged: the map's du from the dfq pass (``DuSlot``;
    # the first kernel given it only)
    du_slot = getattr(fq, DU_SLOT_ATTR, None) if has_la and maps is None else None
    if du_slot is not None and not du_slot.claim():
        du_slot = None
    # store the branches for the backward (``KernelConfig.save_branches``)
    return _HybridFn.apply(*args, cfg.save_branches, du_slot, bool(output_is_branch), *folded)



def _launch(q, k, v, fq, fk, ca, cb, logs, shift, window, scale, eps, kpm, has_swa, has_la,
            shared, config, maps=None, output_is_branch=False):
    try:
        out = hybrid_kernel(q, k, v, fq, fk, ca, cb, logs, shift, window=window, scale=scale,
                            eps=eps, key_padding_mask=kpm, has_swa=has_swa, has_la=has_la,
                            shared=shared, config=config, maps=maps,
                            output_is_branch=output_is_branch)
        TRACE.count("hybrid.forward")
        return out
    except errors() as e:  # never a crash inside Triton: the caller's path instead
        TRACE.fallback("hybrid", "hybrid forward", e, "running the piece-by-piece path",
                       phase="forward")
        return None
