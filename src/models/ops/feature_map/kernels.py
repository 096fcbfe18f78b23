"""The Hedgehog feature map's Triton kernels and their launches (the map itself:
``reference.reference_features``).

    forward    per (b, h, block of rows): u = x W + b in fp32 (one matrix product), both
               activations, one (rows, F) store (``_phi_fwd``).
    backward   per (b, h, block of rows): both activations read from the forward's output y
               (kept by its consumer anyway: reading them measured faster than recomputing
               them from x), du = s1 (dy1 - <dy1, s1>) - s2 (dy2 - <dy2, s2>) (softmax; exp:
               dy1 e1 - dy2 e2), dx = du W^T in the kernel where x takes a gradient; du written
               once in x's dtype, from which torch reduces dW = sum_(b,t) x^T du (one batched
               GEMM reading x where it lies: ``_dw_reducer``) and db = sum du (fp32). Given the
               hybrid kernel's du (``function.DuSlot``), the backward reads du instead of dy
               and y.
    pairs      a layer's two maps in one launch (``map_forward_pair``: the q map's programs,
               then the k map's), on programs that each walk a share of the heads' row blocks
               where ``WALK_PLANS`` has a plan for the shape (``PairPlan``); their backward
               one map after the other (``map_backward_pair``).

Numerics: u stays fp32 until the activations (the PyTorch module rounds it to x's dtype
first), so the output is at least as close to the fp32 map as the module's; the softmax
normalises by one reciprocal per row (within fp32 rounding of a division per feature, and
faster). The backward takes the activations as stored (x's dtype), as autograd's softmax
backward does. Gradients of the weight and bias come back in their own dtype.

The kernels take bf16 x, head dims and F/2 powers of two in [16, 128]
(``dispatch.unsupported_reason``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..instrument import TRACE
from ..triton_common import HAVE_TRITON, cast, cdiv, fast, tl, tma_ok, triton, warn_once

__all__ = ["PairPlan", "WALK_PLANS", "bmm_fp32", "kernel_weights",
           "empty_du", "map_backward", "map_backward_pair", "map_forward", "map_forward_pair",
           "new_du",
           "pair_plan", "walk_split"]


if HAVE_TRITON:

    @triton.jit
    def _acts(x, W, bias, SOFTMAX: tl.constexpr, PREC: tl.constexpr):
        """Both halves' activations (fp32) of the rows x (BM, D) for one head; the softmax
        normalised by one reciprocal per row."""
        u = tl.dot(x, W, input_precision=PREC) + bias[None, :]
        if SOFTMAX:
            e1 = tl.exp(u - tl.max(u, axis=1)[:, None])
            e2 = tl.exp(tl.min(u, axis=1)[:, None] - u)
            a1 = e1 * (1.0 / tl.sum(e1, axis=1))[:, None]
            a2 = e2 * (1.0 / tl.sum(e2, axis=1))[:, None]
        else:
            a1 = tl.exp(u)
            a2 = tl.exp(-u)
        return a1, a2

    @triton.jit
    def _phi_fwd_tile(xsrc, ysrc, w, bias, b, h, t0, T, H, sx_b, sx_h, sx_t,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
        """Rows t0 .. t0 + BM - 1 of (batch row b, head h): phi of x from ``xsrc`` into
        ``ysrc`` (the tensors, or with TMA their descriptors, ``_phi_fwd_walk``'s)."""
        offs_m = t0 + tl.arange(0, BM)
        offs_f = tl.arange(0, FH)
        rows = offs_m < T
        if TMA:  # rows past T read as zeros and are not written (the descriptors' bounds)
            x = xsrc.load([b, h, t0, 0]).reshape(BM, D)
        else:
            x = tl.load(xsrc + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
                        + offs_m[:, None] * sx_t + tl.arange(0, D)[None, :],
                        mask=rows[:, None], other=0.0)
        a1, a2 = _acts(x, w, bias, SOFTMAX, PREC)
        if TMA:
            dt = ysrc.dtype
            ysrc.store([b * H + h, t0, 0], a1.to(dt).reshape(1, BM, FH))
            ysrc.store([b * H + h, t0, FH], a2.to(dt).reshape(1, BM, FH))
        else:
            y = ysrc + ((b * H + h).to(tl.int64) * T + offs_m[:, None]) * (2 * FH) \
                + offs_f[None, :]
            tl.store(y, a1.to(ysrc.dtype.element_ty), mask=rows[:, None])
            tl.store(y + FH, a2.to(ysrc.dtype.element_ty), mask=rows[:, None])

    @triton.jit
    def _head_weights(X, W, BIAS, h, D: tl.constexpr, FH: tl.constexpr):
        """Head h's weight (D, F/2) in x's dtype and bias (F/2, fp32)."""
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, FH)
        w = tl.load(W + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        return w.to(X.dtype.element_ty), tl.load(BIAS + h * FH + offs_f).to(tl.float32)

    @triton.jit
    def _phi_fwd_rows(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, pid_bh, pid_m,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr):
        """One program's rows: block ``pid_m`` of (batch row, head) ``pid_bh``."""
        b = pid_bh // H
        h = pid_bh % H
        w, bias = _head_weights(X, W, BIAS, h, D, FH)
        _phi_fwd_tile(X, Y, w, bias, b, h, pid_m * BM, T, H, sx_b, sx_h, sx_t, D, FH, BM,
                      SOFTMAX, PREC, False)

    @triton.jit
    def _phi_fwd_walk(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, B, h, lo, hi,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                      NS: tl.constexpr):
        """Head h's row blocks lo .. hi - 1 of its B cdiv(T, BM) (block i: batch row
        i // cdiv(T, BM)) for a walking program: the head's weight read once, the next blocks'
        x loaded while this one's activations run (a loop the compiler pipelines, NS stages).
        TMA: x read and y written through tensor descriptors (the stores asynchronous, out of
        the registers' way); by pointers where the tensors do not allow them."""
        MT = tl.cdiv(T, BM)
        w, bias = _head_weights(X, W, BIAS, h, D, FH)
        if TMA:
            xsrc = tl.make_tensor_descriptor(X, shape=[B, H, T, D], strides=[sx_b, sx_h, sx_t, 1],
                                             block_shape=[1, 1, BM, D])
            ysrc = tl.make_tensor_descriptor(Y, shape=[B * H, T, 2 * FH],
                                             strides=[T * 2 * FH, 2 * FH, 1],
                                             block_shape=[1, BM, FH])
        else:
            xsrc = X
            ysrc = Y
        for i in tl.range(lo, hi, num_stages=NS):
            _phi_fwd_tile(xsrc, ysrc, w, bias, i // MT, h, (i % MT) * BM, T, H, sx_b, sx_h,
                          sx_t, D, FH, BM, SOFTMAX, PREC, TMA)

    @triton.jit
    def _phi_fwd(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H,
                 D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr, SOFTMAX: tl.constexpr,
                 PREC: tl.constexpr):
        # axis 0: up to 2^31 - 1 (B * H of a large decode batch)
        _phi_fwd_rows(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, tl.program_id(0),
                      tl.program_id(1), D, FH, BM, SOFTMAX, PREC)

    @triton.jit
    def _phi_fwd_pair(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, HQ, XK, WK, BK, YK, sk_b, sk_h, sk_t,
                      HK, NQ, T, D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX_Q: tl.constexpr, SOFTMAX_K: tl.constexpr, PREC: tl.constexpr):
        """Both maps of a layer in one grid (``map_forward_pair``): programs 0 .. NQ - 1 of axis
        0 (NQ = B HQ) run the q map, the rest the k map, each ``_phi_fwd``'s program."""
        pid = tl.program_id(0)
        if pid < NQ:
            _phi_fwd_rows(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, T, HQ, pid, tl.program_id(1),
                          D, FH, BM, SOFTMAX_Q, PREC)
        else:
            _phi_fwd_rows(XK, WK, BK, YK, sk_b, sk_h, sk_t, T, HK, pid - NQ, tl.program_id(1),
                          D, FH, BM, SOFTMAX_K, PREC)

    @triton.jit
    def _phi_fwd_pair_walk(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, HQ, XK, WK, BK, YK, sk_b, sk_h,
                           sk_t, HK, B, T, TPP, D: tl.constexpr, FH: tl.constexpr,
                           BM: tl.constexpr, SOFTMAX_Q: tl.constexpr, SOFTMAX_K: tl.constexpr,
                           PREC: tl.constexpr, TMA: tl.constexpr, NS: tl.constexpr):
        """Both maps of a layer on programs that walk their rows: the blocks of every head in
        a row (the q map's HQ heads first, B cdiv(T, BM) blocks a head), TPP a program; a
        program whose blocks span two heads walks each head's share with that head's weight
        (``_phi_fwd_walk``)."""
        n = B * tl.cdiv(T, BM)
        lo = tl.program_id(0) * TPP
        hi = tl.minimum(lo + TPP, (HQ + HK) * n)
        for j in range(0, (hi - 1) // n - lo // n + 1):
            u = lo // n + j
            a = tl.maximum(lo, u * n) - u * n
            e = tl.minimum(hi, (u + 1) * n) - u * n
            if u < HQ:
                _phi_fwd_walk(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, T, HQ, B, u, a, e, D, FH, BM,
                              SOFTMAX_Q, PREC, TMA, NS)
            else:
                _phi_fwd_walk(XK, WK, BK, YK, sk_b, sk_h, sk_t, T, HK, B, u - HQ, a, e, D, FH,
                              BM, SOFTMAX_K, PREC, TMA, NS)

    @triton.jit
    def _phi_bwd(W, Y, DY, DX, DU, DXI, sdy_b, sdy_h, sdy_t, sdx_b, sdx_h, sdx_t,
                 sdxi_b, sdxi_h, sdxi_t, T, H, B,
                 D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr, SOFTMAX: tl.constexpr,
                 PREC: tl.constexpr, NEED_DX: tl.constexpr, DU_HEADS_FIRST: tl.constexpr,
                 ADD_DXI: tl.constexpr, DU_GIVEN: tl.constexpr = 0):
        """The map's backward, one program per row block (axis 1) and (b, h) (axis 0, up to
        2^31 - 1: B * H of a large decode batch), the activations read from the forward's
        output Y ((B H, T, F), x's dtype).

        ADD_DXI: dx = DXI + du W^T, summed in fp32 (DXI: x's gradient from its other consumer,
        the attention kernel's dq / dk, ``dispatch.hedgehog_features(with_input=True)``).
        DU_GIVEN (the hybrid kernel wrote du into DU: ``function.DuSlot``): 1, du read from DU,
        DY and Y not read, du not written (the map's output had no other consumer); 2, du
        from DY as usual plus DU's, written back to DU (another consumer's gradient came in
        DY)."""
        pid_bh = tl.program_id(0)
        b = pid_bh // H
        h = pid_bh % H
        offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, FH)
        rows = offs_m < T
        w = tl.load(W + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        # du (H, B, T, F/2) or (B, H, T, F/2), contiguous (``new_du``)
        du_row = (h * B + b).to(tl.int64) if DU_HEADS_FIRST else pid_bh.to(tl.int64)
        du_ptr = DU + (du_row * T + offs_m[:, None]) * FH + offs_f[None, :]
        if DU_GIVEN == 1:
            du = tl.load(du_ptr, mask=rows[:, None], other=0.0)
        else:
            y = Y + (pid_bh.to(tl.int64) * T + offs_m[:, None]) * (2 * FH) + offs_f[None, :]
            a1 = tl.load(y, mask=rows[:, None], other=0.0).to(tl.float32)
            a2 = tl.load(y + FH, mask=rows[:, None], other=0.0).to(tl.float32)
            dy = DY + b.to(tl.int64) * sdy_b + h.to(tl.int64) * sdy_h + offs_m[:, None] * sdy_t \
                + offs_f[None, :]
            dy1 = tl.load(dy, mask=rows[:, None], other=0.0).to(tl.float32)
            dy2 = tl.load(dy + FH, mask=rows[:, None], other=0.0).to(tl.float32)
            if SOFTMAX:
                du = a1 * (dy1 - tl.sum(dy1 * a1, axis=1)[:, None]) - \
                    a2 * (dy2 - tl.sum(dy2 * a2, axis=1)[:, None])
            else:
                du = dy1 * a1 - dy2 * a2
            if DU_GIVEN == 2:
                du += tl.load(du_ptr, mask=rows[:, None], other=0.0).to(tl.float32)
            du = tl.where(rows[:, None], du, 0.0).to(Y.dtype.element_ty)
        if NEED_DX:  # not for stage 1's detached teacher q, k
            dx = tl.dot(du, tl.trans(w), input_precision=PREC)
            if ADD_DXI:
                dx += tl.load(DXI + b.to(tl.int64) * sdxi_b + h.to(tl.int64) * sdxi_h
                              + offs_m[:, None] * sdxi_t + offs_d[None, :], mask=rows[:, None],
                              other=0.0).to(tl.float32)
            tl.store(DX + b.to(tl.int64) * sdx_b + h.to(tl.int64) * sdx_h
                     + offs_m[:, None] * sdx_t + offs_d[None, :],
                     dx.to(DX.dtype.element_ty), mask=rows[:, None])
        if DU_GIVEN != 1:
            tl.store(du_ptr, du, mask=rows[:, None])


class PairPlan(NamedTuple):
    """How ``map_forward_pair`` runs a pair: ``per_sm`` walking programs a multiprocessor
    (``_phi_fwd_pair_walk``), or None for one program a row block (``_phi_fwd_pair``); blocks
    of ``rows`` rows on ``warps`` warps; ``stages`` blocks of x in flight in a walking
    program's loop."""

    per_sm: int | None
    rows: int
    warps: int
    stages: int = 3


#: the walk per (D, F/2) where it measured faster than one program a block. (128, 128), the
#: 8B models' square map: two 4-warp programs of 32-row blocks a multiprocessor (ptxas: 156
#: registers, 82 KB, mma.sync); the pair 0.154 to 0.121 ms at 8 x 1k on an H100, where one
#: 64-row 8-warp program a multiprocessor read 0.135 and two stages lost the gain
#: (docs/performance.md). Other shapes: one program a block (not measured).
WALK_PLANS = {(128, 128): PairPlan(2, 32, 4, 3)}


def pair_plan(D: int, FH: int) -> PairPlan:
    """The pair's plan for maps of head dim D and F/2 = FH: ``WALK_PLANS``' where it has one,
    else one program a block on the forward's tiles (``_tiles``)."""
    return WALK_PLANS.get((D, FH)) or PairPlan(None, *_tiles(D, FH, backward=False))


def _prec(dtype):
    return "tf32"  # bf16 operands (fp32 is routed away)


def _tiles(D: int, FH: int, backward: bool) -> tuple[int, int]:
    """(rows per program, warps), from ptxas's register report for sm_90a with a launch's
    divisibility hints (tests/test_triton_compile.py): no spills in either direction for
    D = 64 / 128 and F/2 = D / D/2. The backward holds x, dy and du: 32 rows where they are
    wide, but 64 at D = F/2 = 128 (102 registers, wgmma; 32 rows get mma.sync), measured
    faster than 32 and 128 rows there (docs/performance.md); at D = F/2 = 64 on 8 warps (4
    spilled)."""
    if backward and D * FH >= 128 * 128:
        return 64, 8
    if backward and D * FH >= 64 * 128:
        return 32, 8
    if backward:
        return 64, 8
    return 64, 4 if D * FH <= 64 * 64 else 8


# ----------------------------------------------------------------------------- dW and du
def du_heads_first(x: torch.Tensor) -> bool:
    """Whether the backward lays du out as (H, B, T, F/2) for this x (else (B, H, T, F/2)): x
    laid out as (B, T, H, D) (transformers' q, k) or any layout other than (B, H, T, D)
    contiguous, so that ``_dw_reducer``'s GEMM reads x where it lies."""
    return x.transpose(1, 2).is_contiguous() or not x.is_contiguous()


def new_du(x: torch.Tensor, FH: int) -> torch.Tensor:
    """An empty du (B, H, T, F/2) for x (B, H, T, D), viewed in the layout ``du_heads_first``
    picks (what ``_dw_reducer`` reads in place)."""
    B, H, T, _ = x.shape
    return empty_du((B, H, T, FH), du_heads_first(x), x.device, x.dtype)


def empty_du(shape: tuple, heads_first: bool, device, dtype) -> torch.Tensor:
    """An empty du of ``shape`` (B, H, T, F/2), its memory (H, B, T, F/2) where
    ``heads_first``."""
    B, H, T, FH = shape
    if heads_first:
        return torch.empty(H, B, T, FH, device=device, dtype=dtype).permute(1, 0, 2, 3)
    return torch.empty(B, H, T, FH, device=device, dtype=dtype)


def _dw_reducer(x: torch.Tensor, FH: int):
    """The function computing dW = sum over (b, t) of x^T du from (x, du), du laid out as
    ``new_du`` lays it out for this x: one batched GEMM that reads x where it lies.

    x laid out as (B, T, H, D): row (b, t) of head h sits at a fixed stride, so x is an
    (H, D, B T) view and du (H, B, T, F/2) an (H, B T, F/2) one: a bmm over H. x contiguous
    (B, H, T, D): a bmm over B H of (D, T) x (T, F/2), summed over B. Other layouts: du
    (H, B, T, F/2), x copied into (H, D, B T) by the reshape."""
    B, H, T, D = x.shape

    def heads_first(x, du):  # (H, D, B T) x (H, B T, F/2): views where the layouts allow
        xs = x.permute(1, 3, 0, 2).reshape(H, D, B * T)
        return bmm_fp32(xs, du.permute(1, 0, 2, 3).reshape(H, B * T, FH))
    if not du_heads_first(x):
        def per_head_row(x, du):
            per_bh = bmm_fp32(x.view(B * H, T, D).transpose(1, 2), du.view(B * H, T, FH))
            return per_bh.view(B, H, D, FH).sum(0)
        return per_head_row
    return heads_first


@functools.cache
def bmm_out_dtype_on_cuda() -> bool:
    """Whether this torch has a CUDA kernel for ``torch.bmm(..., out_dtype=...)``
    (``aten::bmm.dtype``; asked of the dispatcher once, so that no error of a real call - an
    out-of-memory error, a CUDA error surfacing late - is ever taken for its absence)."""
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key("aten::bmm.dtype", "CUDA"))
    except (AttributeError, RuntimeError):  # pragma: no cover - another torch's internals
        return False


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` batched, accumulated and returned in fp32 (the maps' dW, whose parameters
    are fp32): on CUDA the bf16 GEMM writes its fp32 accumulator as it is
    (``out_dtype=torch.float32``: no bf16 rounding of the product, no cast kernel after it);
    elsewhere (the CPU, where ``aten::bmm.dtype`` has no kernel: Triton's interpreter), and on
    CUDA with a torch that has no such kernel (logged once), the operands in fp32: the same
    products and sums."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if bmm_out_dtype_on_cuda():
            return torch.bmm(a, b, out_dtype=torch.float32)
        warn_once(__name__, "this torch has no CUDA kernel for bmm(out_dtype=float32): the "
                  "maps' dW from fp32 copies of their operands (the same values, more memory "
                  "traffic)")
    return torch.bmm(cast(a, torch.float32), cast(b, torch.float32))


# ----------------------------------------------------------------------------- forward
def kernel_weights(w, bias, dtype):
    """(the weight (H, D, F/2) in ``dtype``, as the module casts it, the bias in its own), both
    contiguous: what the maps' kernels read."""
    return cast(w, dtype).contiguous(), bias.contiguous()


def _forward_operands(x, w, bias):
    """(y to write, the weight in x's dtype, the bias in its own: both contiguous)."""
    B, H, T, _ = x.shape
    y = torch.empty(B, H, T, 2 * w.shape[-1], device=x.device, dtype=x.dtype)
    return (y, *kernel_weights(w, bias, x.dtype))


def map_forward(x, w, bias, softmax):
    """(y, the weight and bias as the kernel read them: the weight in x's dtype, the bias in
    its own (both contiguous)). The kernel adds the bias in fp32 to the fp32 product: an fp32
    module's bias is read as it is, without the rounding the PyTorch path gives it."""
    B, H, T, D = x.shape
    FH = w.shape[-1]
    y, wc, bc = _forward_operands(x, w, bias)
    BM, warps = _tiles(D, FH, backward=False)
    fast(_phi_fwd)[(B * H, cdiv(T, BM))](
        x, wc, bc, y, x.stride(0), x.stride(1), x.stride(2), T, H, D=D, FH=FH, BM=BM,
        SOFTMAX=softmax, PREC=_prec(x.dtype), num_warps=warps)
    return y, wc, bc


def _pairable(xq, wq, xk, wk) -> bool:
    """Whether two maps' kernels can share one grid: the same batch, length, head dim,
    features per half and input dtype (a layer's q and k maps: heads may differ)."""
    (Bq, _, Tq, Dq), (Bk, _, Tk, Dk) = xq.shape, xk.shape
    return (Bq, Tq, Dq, wq.shape[-1], xq.dtype) == (Bk, Tk, Dk, wk.shape[-1], xk.dtype)


@functools.cache
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def walk_split(tiles: int, per_sm: int, device: torch.device) -> tuple[int, int]:
    """(programs, blocks a program) of a walking pair: ``tiles`` blocks (every head's, in a
    row) over about ``per_sm`` programs a multiprocessor, each the same share but the last,
    none empty (on the interpreter: 4 multiprocessors)."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 4
    tpp = cdiv(tiles, max(1, min(tiles, per_sm * sms)))
    return cdiv(tiles, tpp), tpp


def map_forward_pair(xq, wq, bq, softmax_q, xk, wk, bk, softmax_k, *,
                     plan: PairPlan | None = None):
    """``map_forward`` of a layer's two maps, ``((yq, wqc, bqc), (yk, wkc, bkc))``, in one
    launch where ``_pairable`` (else two): on ``plan`` (None: ``pair_plan``'s for the shape;
    tests and benchmarks pass others)."""
    if not _pairable(xq, wq, xk, wk):
        return map_forward(xq, wq, bq, softmax_q), map_forward(xk, wk, bk, softmax_k)
    B, Hq, T, D = xq.shape
    Hk, FH = xk.shape[1], wq.shape[-1]
    plan = pair_plan(D, FH) if plan is None else plan
    walking = plan.per_sm is not None and B * T > 0  # (no rows: the grid's empty launch)
    yq, wqc, bqc = _forward_operands(xq, wq, bq)
    yk, wkc, bkc = _forward_operands(xk, wk, bk)
    common = dict(D=D, FH=FH, BM=plan.rows, SOFTMAX_Q=softmax_q, SOFTMAX_K=softmax_k,
                  PREC=_prec(xq.dtype), num_warps=plan.warps)
    if walking:
        programs, tpp = walk_split((Hq + Hk) * B * cdiv(T, plan.rows), plan.per_sm, xq.device)
        # (yq, yk: fresh contiguous allocations, their bases and strides 16-byte multiples)
        tma = tma_ok(xq, xk)
        fast(_phi_fwd_pair_walk)[(programs,)](
            xq, wqc, bqc, yq, xq.stride(0), xq.stride(1), xq.stride(2), Hq,
            xk, wkc, bkc, yk, xk.stride(0), xk.stride(1), xk.stride(2), Hk, B, T, tpp,
            TMA=tma, NS=plan.stages, **common)
        TRACE.count("feature_map.forward_walk")
        TRACE.count("feature_map.forward_tma", tma)
    else:
        fast(_phi_fwd_pair)[(B * (Hq + Hk), cdiv(T, plan.rows))](
            xq, wqc, bqc, yq, xq.stride(0), xq.stride(1), xq.stride(2), Hq,
            xk, wkc, bkc, yk, xk.stride(0), xk.stride(1), xk.stride(2), Hk, B * Hq, T,
            **common)
    TRACE.count("feature_map.pair_forward")
    return (yq, wqc, bqc), (yk, wkc, bkc)


# ----------------------------------------------------------------------------- backward
def map_backward(x, wc, bc, y, dy, dx_in, *, softmax: bool, dtypes: tuple, du=None,
                 du_only: bool = False, need: tuple = (True, True, True),
                 dx_into_input: bool = False):
    """(dx, dW, db) of the map y = phi(x) (``map_forward``'s x, weight and bias as the kernel
    read them, and y), each None where ``need`` (x, weight, bias) does not ask for it; dW and
    db in ``dtypes`` (the parameters' own). ``dx_in``: x's gradient from its other consumer
    (None: none), added in the kernel; ``dx_into_input``: the caller owns dx_in, and dx may be
    written over it. ``du``: the map's du as the hybrid kernel computed it (laid out as
    ``new_du``), alone (``du_only``: dy is not read) or to be added to dy's; None: du from dy.
    The maps' Functions and the hybrid kernel's Function with the maps folded in share it."""
    plan = _MapBackward(x, wc, bc, y, dy, dx_in, softmax=softmax, dtypes=dtypes, du=du,
                        du_only=du_only, need=need, dx_into_input=dx_into_input)
    if plan.launches:
        plan.launch()
    return plan.finish()


def map_backward_pair(q: dict | None, k: dict | None):
    """``map_backward`` of a layer's two maps (each side its keyword arguments, or None for a
    map whose backward nothing asks for), ``((dxq, dWq, dbq) or None, (dxk, dWk, dbk) or
    None)``: both kernels launched before either's dW and db are reduced."""
    plans = [None if a is None else _MapBackward(**a) for a in (q, k)]
    for p in plans:
        if p is not None and p.launches:
            p.launch()
    return tuple(None if p is None else p.finish() for p in plans)


class _MapBackward:
    """One map's backward (``map_backward``): planned here (dy and dx_in as the kernel reads
    them, dx and du allocated, the kernel's arguments), its kernel launched (``launch``), then
    finished (``finish``: dW and db from du)."""

    __slots__ = ("x", "FH", "du", "dx", "reduce_dw", "need", "dtypes", "du_given", "add",
                 "args", "meta", "launches")

    def __init__(self, x, wc, bc, y, dy, dx_in, *, softmax: bool, dtypes: tuple, du=None,
                 du_only: bool = False, need: tuple = (True, True, True),
                 dx_into_input: bool = False):
        self.x, self.FH, self.need, self.dtypes = x, wc.shape[-1], need, dtypes
        du_given = 0 if du is None else 1 if du_only else 2
        if du_given == 1:
            dy = y  # (not read)
        else:
            if dy.stride(-1) != 1:
                dy = dy.contiguous()
            dy = cast(dy, x.dtype)
        need_dx = need[0]
        add = need_dx and dx_in is not None
        if add and dx_in.stride(-1) != 1:  # (any float dtype: the kernel reads it into fp32)
            dx_in = dx_in.contiguous()
        # dx laid out as x (the model's (B, T, H, D) memory: summed with the attention
        # kernel's dq, laid out so too, and accumulated without a copy). ``dx_into_input``
        # (the fused kernel's own dq / dk): dx written over dx_in where their layouts and
        # dtypes agree - each program reads its tile of dx_in before it writes the same tile
        # - so that no second buffer of x's size is alive while both maps' backward run
        if add and dx_into_input and dx_in.dtype == x.dtype and dx_in.stride() == x.stride():
            dx = dx_in
            TRACE.count("feature_map.dx_in_place")
        else:
            dx = torch.empty_like(x) if need_dx else None
        if du is None:
            du = new_du(x, self.FH)
        self.reduce_dw = _dw_reducer(x, self.FH)
        self.du, self.dx, self.du_given, self.add = du, dx, du_given, add
        # (stage 1 with the kernel's du: du is all dW and db need, no kernel)
        self.launches = du_given != 1 or need_dx
        self.args = (
            wc, y, dy, du if dx is None else dx, du, dx_in if add else du,
            dy.stride(0), dy.stride(1), dy.stride(2),
            *((dx.stride(0), dx.stride(1), dx.stride(2)) if need_dx else (0, 0, 0)),
            *((dx_in.stride(0), dx_in.stride(1), dx_in.stride(2)) if add else (0, 0, 0)))
        self.meta = dict(SOFTMAX=softmax, NEED_DX=need_dx,
                         DU_HEADS_FIRST=du.stride(1) > du.stride(0), ADD_DXI=add,
                         DU_GIVEN=du_given)  # (du (H, B, T, F/2) where heads first)

    def launch(self) -> None:
        B, H, T, D = self.x.shape
        BM, warps = _tiles(D, self.FH, backward=True)
        fast(_phi_bwd)[(B * H, cdiv(T, BM))](
            *self.args, T, H, B, D=D, FH=self.FH, BM=BM, PREC=_prec(self.x.dtype),
            num_warps=warps, **self.meta)

    def finish(self):
        """(dx, dW, db), each None where not asked for."""
        need, du, (w_dtype, b_dtype) = self.need, self.du, self.dtypes
        TRACE.count("feature_map.backward_dx", need[0])
        TRACE.count("feature_map.backward_added", self.add)
        TRACE.count("feature_map.du_from_kernel", self.du_given == 1)
        TRACE.count("feature_map.du_added", self.du_given == 2)
        dw = dbias = None
        if need[1]:
            dw = cast(self.reduce_dw(self.x, du), w_dtype)
        if need[2]:
            # summed in fp32 straight from du (CUDA reduces bf16 into fp32 without a copy)
            dbias = cast(du.sum(dim=(0, 2), dtype=torch.float32), b_dtype)
        return self.dx, dw, dbias

