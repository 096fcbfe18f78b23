"""The Hedgehog feature map as one Triton kernel per direction (issue 11: "the feature maps may
stay a separate GEMM if fusing them does not pay; measure it").

    phi(x) = [ act(x W_h + b_h)  ++  act(-(x W_h + b_h)) ]      act = softmax over the F/2
                                                                features, or exp

the function of ``models.feature_maps.HedgehogFeatureMap`` (activations ``softmax`` and ``exp``).
The PyTorch module runs it as an einsum, a bias add, two fp32 softmaxes, two casts and a
concatenation, and autograd keeps the fp32 softmax outputs (at T = 64k with 32 heads, F = 256:
about 3 GiB for phi_q). Here:

    forward     per (b, h, block of rows): u = x W + b in fp32 (one matrix product), both
                activations, one (rows, F) store; x and the output kept for the backward
    backward    per (b, h, block of rows): both activations read from the forward's output
                (saved: the LA kernel keeps it anyway; ``BWD_FROM_OUTPUT``, measured on an
                H200 on 2026-12-03: both maps' fwd + bwd at 1 x 64k 3.72 against 4.96 ms
                recomputing u = x W and the activations, which the switch still does),
                du = s1 (dy1 - <dy1, s1>) - s2 (dy2 - <dy2, s2>) (softmax; exp: dy1 e1 - dy2 e2),
                dx = du W^T in the kernel (when x takes a gradient); du is written once (input
                dtype) and torch reduces dW = sum_(b,t) x^T du (one batched GEMM, x read where
                it lies: ``_du_buffer``) and db = sum du (fp32). The layer's q map
                (``kernel_du``): the hybrid kernel's dfq pass computes du itself from its fp32
                dphi and phi (``DuSlot``); the backward then reads du instead of dy and phi
    pairs       a layer's two maps in one grid (``map_forward_pair``, ``map_backward_pair``:
                the same programs, the q map's first), as the hybrid kernel's Function runs
                them with the maps folded in (``triton_hybrid.fold_maps``); the backward's
                pair only with ``PAIR_BACKWARD``

Numerics: u stays fp32 until the activations (the PyTorch module rounds it to the input dtype
first), so the kernel's output is at least as close to the fp32 map as the module's; the
backward takes the activations as stored (input dtype), as autograd's softmax backward does.
Gradients of the weight and bias come back in their own dtype (fp32 master weights).

Unsupported calls (no Triton / CPU without the interpreter, activations ``relu``, ``elu1p``,
``none``, head dims that are not powers of two in [16, 128], F/2 not a power of two in
[16, 128], dtypes other than bf16) return ``None`` from ``hedgehog_features``; callers
keep the module's own forward. Wiring (``models.feature_maps.HedgehogFeatureMap.forward``)::

    out = triton_phi.hedgehog_features(x, self.weight, self.bias, self.activation)
    if out is not None:
        return out
"""

from __future__ import annotations

import functools
import weakref

import torch

from ..triton_common import (HAVE_TRITON, available, cast, cdiv, errors, fast, interpret,
                            record_fallback, tl, tma_ok, triton, warn_once)

__all__ = ["available", "hedgehog_features", "reference_features", "unsupported_reason"]

FALLBACK_ERRORS: list[str] = []
#: dx: only when x takes a gradient; added: those that added x's other gradient in the kernel
#: du_from_kernel / du_added: backward passes that started from the hybrid kernel's du (``DuSlot``)
#: alone / with another consumer's gradient added; pair_forward / pair_backward: launches that
#: ran a layer's two maps in one grid (``map_forward_pair``, ``map_backward_pair``); dx_in_place:
#: backward passes that wrote dx over the caller's dx_in (``_MapBackward``'s dx_into_input);
#: weights_in_kernel: map pairs whose kernel rounded weights of another dtype itself
#: (``WEIGHTS_IN_KERNEL``); forward_walk / forward_tma: pair launches on walking programs
#: (``FORWARD_WALK``) / through tensor descriptors (``FORWARD_TMA``)
CALLS = {"forward": 0, "backward_dx": 0, "backward_added": 0, "du_from_kernel": 0,
         "du_added": 0, "pair_forward": 0, "pair_backward": 0, "dx_in_place": 0,
         "weights_in_kernel": 0, "forward_walk": 0, "forward_tma": 0}
ACTIVATIONS = ("softmax", "exp")


if HAVE_TRITON:

    @triton.jit
    def _acts(x, W, bias, SOFTMAX: tl.constexpr, PREC: tl.constexpr, RCP: tl.constexpr = False):
        """Both halves' activations (fp32) of the rows x (BM, D) for one head. RCP
        (``RECIPROCAL_SOFTMAX``): the softmax's normalisation as one reciprocal per row and a
        product per feature instead of a division per feature."""
        u = tl.dot(x, W, input_precision=PREC) + bias[None, :]
        if SOFTMAX:
            e1 = tl.exp(u - tl.max(u, axis=1)[:, None])
            e2 = tl.exp(tl.min(u, axis=1)[:, None] - u)
            if RCP:
                a1 = e1 * (1.0 / tl.sum(e1, axis=1))[:, None]
                a2 = e2 * (1.0 / tl.sum(e2, axis=1))[:, None]
            else:
                a1 = e1 / tl.sum(e1, axis=1)[:, None]
                a2 = e2 / tl.sum(e2, axis=1)[:, None]
        else:
            a1 = tl.exp(u)
            a2 = tl.exp(-u)
        return a1, a2

    @triton.jit
    def _phi_fwd_tile(xsrc, ysrc, w, bias, b, h, t0, T, H, sx_b, sx_h, sx_t,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, RCP: tl.constexpr,
                      TMA: tl.constexpr):
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
        a1, a2 = _acts(x, w, bias, SOFTMAX, PREC, RCP)
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
        """Head h's weight (D, F/2) in x's dtype (W in it, or in fp32 rounded here as torch's
        cast rounds it: ``WEIGHTS_IN_KERNEL``) and bias (F/2, fp32)."""
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, FH)
        w = tl.load(W + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        return w.to(X.dtype.element_ty), tl.load(BIAS + h * FH + offs_f).to(tl.float32)

    @triton.jit
    def _phi_fwd_rows(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, pid_bh, pid_m,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, RCP: tl.constexpr):
        """One program's rows: block ``pid_m`` of (batch row, head) ``pid_bh``."""
        b = pid_bh // H
        h = pid_bh % H
        w, bias = _head_weights(X, W, BIAS, h, D, FH)
        _phi_fwd_tile(X, Y, w, bias, b, h, pid_m * BM, T, H, sx_b, sx_h, sx_t, D, FH, BM,
                      SOFTMAX, PREC, RCP, False)

    @triton.jit
    def _phi_fwd_walk(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, B, h, lo, hi,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, RCP: tl.constexpr,
                      TMA: tl.constexpr, NS: tl.constexpr):
        """Head h's row blocks lo .. hi - 1 of its B cdiv(T, BM) (block i: batch row
        i // cdiv(T, BM)) for a program of ``FORWARD_WALK``: the head's weight read once, the
        next blocks' x loaded while this one's activations run (a loop the compiler pipelines,
        NS stages). TMA: x read and y written through tensor descriptors (the stores
        asynchronous, out of the registers' way)."""
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
                          sx_t, D, FH, BM, SOFTMAX, PREC, RCP, TMA)

    @triton.jit
    def _phi_fwd(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H,
                 D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr, SOFTMAX: tl.constexpr,
                 PREC: tl.constexpr, RCP: tl.constexpr = False):
        # axis 0: up to 2^31 - 1 (B * H of a large decode batch)
        _phi_fwd_rows(X, W, BIAS, Y, sx_b, sx_h, sx_t, T, H, tl.program_id(0),
                      tl.program_id(1), D, FH, BM, SOFTMAX, PREC, RCP)

    @triton.jit
    def _phi_fwd_pair(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, HQ, XK, WK, BK, YK, sk_b, sk_h, sk_t,
                      HK, NQ, T, D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX_Q: tl.constexpr, SOFTMAX_K: tl.constexpr, PREC: tl.constexpr,
                      RCP: tl.constexpr = False):
        """Both maps of a layer in one grid (``map_forward_pair``): programs 0 .. NQ - 1 of axis
        0 (NQ = B HQ) run the q map, the rest the k map, each ``_phi_fwd``'s program."""
        pid = tl.program_id(0)
        if pid < NQ:
            _phi_fwd_rows(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, T, HQ, pid, tl.program_id(1),
                          D, FH, BM, SOFTMAX_Q, PREC, RCP)
        else:
            _phi_fwd_rows(XK, WK, BK, YK, sk_b, sk_h, sk_t, T, HK, pid - NQ, tl.program_id(1),
                          D, FH, BM, SOFTMAX_K, PREC, RCP)

    @triton.jit
    def _phi_fwd_pair_walk(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, HQ, XK, WK, BK, YK, sk_b, sk_h,
                           sk_t, HK, B, T, TPP, D: tl.constexpr, FH: tl.constexpr,
                           BM: tl.constexpr, SOFTMAX_Q: tl.constexpr, SOFTMAX_K: tl.constexpr,
                           PREC: tl.constexpr, RCP: tl.constexpr, TMA: tl.constexpr,
                           NS: tl.constexpr):
        """Both maps of a layer on programs that walk their rows (``FORWARD_WALK``): the
        blocks of every head in a row (the q map's HQ heads first, B cdiv(T, BM) blocks a
        head), TPP a program; a program whose blocks span two heads walks each head's share
        with that head's weight (``_phi_fwd_walk``)."""
        n = B * tl.cdiv(T, BM)
        lo = tl.program_id(0) * TPP
        hi = tl.minimum(lo + TPP, (HQ + HK) * n)
        for j in range(0, (hi - 1) // n - lo // n + 1):
            u = lo // n + j
            a = tl.maximum(lo, u * n) - u * n
            e = tl.minimum(hi, (u + 1) * n) - u * n
            if u < HQ:
                _phi_fwd_walk(XQ, WQ, BQ, YQ, sq_b, sq_h, sq_t, T, HQ, B, u, a, e, D, FH, BM,
                              SOFTMAX_Q, PREC, RCP, TMA, NS)
            else:
                _phi_fwd_walk(XK, WK, BK, YK, sk_b, sk_h, sk_t, T, HK, B, u - HQ, a, e, D, FH,
                              BM, SOFTMAX_K, PREC, RCP, TMA, NS)

    @triton.jit
    def _phi_bwd_rows(X, W, BIAS, Y, DY, DX, DU, DXI, sx_b, sx_h, sx_t, sdy_b, sdy_h, sdy_t,
                      sdx_b, sdx_h, sdx_t, sdxi_b, sdxi_h, sdxi_t, T, H, B, pid_bh, pid_m,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr,
                      SOFTMAX: tl.constexpr, PREC: tl.constexpr, NEED_DX: tl.constexpr,
                      DU_HEADS_FIRST: tl.constexpr, FROM_Y: tl.constexpr,
                      ADD_DXI: tl.constexpr, DU_GIVEN: tl.constexpr, RCP: tl.constexpr):
        """One program's rows of ``_phi_bwd``: block ``pid_m`` of (batch row, head) ``pid_bh``.

        FROM_Y: both activations read from the forward's output Y ((B H, T, F), the input
        dtype) instead of recomputed from x (one matrix product and the exponentials fewer;
        the activations rounded to the input dtype, as autograd's softmax saves them).
        ADD_DXI: dx = DXI + du W^T, summed in fp32 (DXI: x's gradient from its other consumer,
        the attention kernel's dq / dk, ``hedgehog_features(with_input=True)``).
        DU_GIVEN (the hybrid kernel wrote du into DU: ``DuSlot``): 1, du read from DU, DY and
        Y not read, du not written (the map's output had no other consumer); 2, du from DY
        as usual plus DU's, written back to DU (another consumer's gradient came in DY)."""
        b = pid_bh // H
        h = pid_bh % H
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, FH)
        rows = offs_m < T
        w = tl.load(W + h.to(tl.int64) * D * FH + offs_d[:, None] * FH + offs_f[None, :])
        # du (H, B, T, F/2) or (B, H, T, F/2), contiguous (``_du_buffer``)
        du_row = (h * B + b).to(tl.int64) if DU_HEADS_FIRST else pid_bh.to(tl.int64)
        du_ptr = DU + (du_row * T + offs_m[:, None]) * FH + offs_f[None, :]
        if DU_GIVEN == 1:
            du = tl.load(du_ptr, mask=rows[:, None], other=0.0)
        else:
            if FROM_Y:
                y = Y + (pid_bh.to(tl.int64) * T + offs_m[:, None]) * (2 * FH) + offs_f[None, :]
                a1 = tl.load(y, mask=rows[:, None], other=0.0).to(tl.float32)
                a2 = tl.load(y + FH, mask=rows[:, None], other=0.0).to(tl.float32)
            else:
                x = tl.load(X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
                            + offs_m[:, None] * sx_t + offs_d[None, :], mask=rows[:, None],
                            other=0.0)
                bias = tl.load(BIAS + h * FH + offs_f).to(tl.float32)
                a1, a2 = _acts(x, w, bias, SOFTMAX, PREC, RCP)
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

    @triton.jit
    def _phi_bwd(X, W, BIAS, Y, DY, DX, DU, DXI, sx_b, sx_h, sx_t, sdy_b, sdy_h, sdy_t,
                 sdx_b, sdx_h, sdx_t, sdxi_b, sdxi_h, sdxi_t, T, H, B,
                 D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr, SOFTMAX: tl.constexpr,
                 PREC: tl.constexpr, NEED_DX: tl.constexpr, DU_HEADS_FIRST: tl.constexpr,
                 FROM_Y: tl.constexpr, ADD_DXI: tl.constexpr, DU_GIVEN: tl.constexpr = 0,
                 RCP: tl.constexpr = False):
        """The map's backward (``_phi_bwd_rows``), one program per row block and (b, h);
        axis 0 up to 2^31 - 1 (B * H of a large decode batch)."""
        _phi_bwd_rows(X, W, BIAS, Y, DY, DX, DU, DXI, sx_b, sx_h, sx_t, sdy_b, sdy_h, sdy_t,
                      sdx_b, sdx_h, sdx_t, sdxi_b, sdxi_h, sdxi_t, T, H, B, tl.program_id(0),
                      tl.program_id(1), D, FH, BM, SOFTMAX, PREC, NEED_DX, DU_HEADS_FIRST,
                      FROM_Y, ADD_DXI, DU_GIVEN, RCP)

    @triton.jit
    def _phi_bwd_pair(XQ, WQ, BQ, YQ, DYQ, DXQ, DUQ, DXIQ, sq0, sq1, sq2, sq3, sq4, sq5, sq6,
                      sq7, sq8, sq9, sq10, sq11, HQ, XK, WK, BK, YK, DYK, DXK, DUK, DXIK,
                      sk0, sk1, sk2, sk3, sk4, sk5, sk6, sk7, sk8, sk9, sk10, sk11, HK, NQ, T, B,
                      D: tl.constexpr, FH: tl.constexpr, BM: tl.constexpr, PREC: tl.constexpr,
                      FROM_Y: tl.constexpr, SOFTMAX_Q: tl.constexpr,
                      NEED_DX_Q: tl.constexpr, DU_HEADS_FIRST_Q: tl.constexpr,
                      ADD_DXI_Q: tl.constexpr, DU_GIVEN_Q: tl.constexpr,
                      SOFTMAX_K: tl.constexpr, NEED_DX_K: tl.constexpr,
                      DU_HEADS_FIRST_K: tl.constexpr, ADD_DXI_K: tl.constexpr,
                      DU_GIVEN_K: tl.constexpr, RCP: tl.constexpr = False):
        """Both maps' backward in one grid (``map_backward_pair``): programs 0 .. NQ - 1 of
        axis 0 (NQ = B HQ) the q map's, the rest the k map's, each ``_phi_bwd``'s program with
        its map's switches; the strides per map in ``_phi_bwd``'s order (x, dy, dx, dxi)."""
        pid = tl.program_id(0)
        if pid < NQ:
            _phi_bwd_rows(XQ, WQ, BQ, YQ, DYQ, DXQ, DUQ, DXIQ, sq0, sq1, sq2, sq3, sq4, sq5,
                          sq6, sq7, sq8, sq9, sq10, sq11, T, HQ, B, pid, tl.program_id(1), D, FH,
                          BM, SOFTMAX_Q, PREC, NEED_DX_Q, DU_HEADS_FIRST_Q, FROM_Y, ADD_DXI_Q,
                          DU_GIVEN_Q, RCP)
        else:
            _phi_bwd_rows(XK, WK, BK, YK, DYK, DXK, DUK, DXIK, sk0, sk1, sk2, sk3, sk4, sk5,
                          sk6, sk7, sk8, sk9, sk10, sk11, T, HK, B, pid - NQ, tl.program_id(1),
                          D, FH, BM, SOFTMAX_K, PREC, NEED_DX_K, DU_HEADS_FIRST_K, FROM_Y,
                          ADD_DXI_K, DU_GIVEN_K, RCP)


#: the backward reads the activations from the forward's output instead of recomputing them
#: (``_phi_bwd``'s FROM_Y); a switch for the A/B of benchmarks/phi_speed.py
BWD_FROM_OUTPUT = True
#: ``map_backward_pair`` runs both maps' backward in one grid (``_phi_bwd_pair``). Off: one
#: launch less on the host, but the pair compiles at the larger side's resources (ptxas,
#: sm_90a, D = F/2 = 128: 125 registers and 64 KB for the k map's programs against 58 for the
#: q map's from the kernel's du), which halves the q map's programs a multiprocessor; the
#: device time that costs is not measured yet (``kernel_anatomy.py --branches
#: layer-maps-paired-bwd``). The forward's pair has the same resources as each map's kernel
#: and is always taken.
PAIR_BACKWARD = False
#: the softmax map's normalisation in its kernels as one reciprocal per row and a product per
#: feature (``_acts``' RCP) instead of a division per feature (the PyTorch module's): within
#: fp32 rounding of it, the bf16 output rarely one rounding apart. On since session 24: the
#: maps' GPU tests passed with it (``validate_gpu.sh pair``: 31 passed, the folded-map, option
#: and walk tests), and the pair read 0.154 to 0.145 ms at 8 x 1k (``phi_bound.py``, one H100,
#: two repeats; session 23's anatomy: 0.138 to 0.132; results/h100_2026-12-05d)
RECIPROCAL_SOFTMAX = True
#: the one-block forward kernels' (rows a program, warps; a walking pair takes its plan's,
#: ``WALK_TILES``), or None for ``_tiles``' (64 rows, 8 warps at
#: the 8B's D = F/2 = 128: ptxas 98 registers, 48 KB, two programs a multiprocessor by their
#: registers). A switch for the A/B of ``kernel_anatomy.py --branches layer-phi32``: (32, 4)
#: takes 103 registers and 41 KB (four programs a multiprocessor, the same 16 warps; each
#: reads the 32 KB weight for half the rows; mma.sync, not wgmma): the pair 0.138 to 0.134 ms
#: at 8 x 1k (session 23, one H100, one run: within its noise)
FORWARD_TILES: tuple[int, int] | None = None
#: ``map_forward_pair`` hands its kernel the maps' weights as they are (the fp32 master
#: weights ``convert`` keeps) and the kernel rounds them to x's dtype in its registers, as
#: torch's cast rounds them (round to nearest even: the same bf16 weights, bit for bit),
#: instead of a cast kernel per map before the launch. The pair's first launch then comes
#: ~two casts earlier (an isolated call's GPU waits for it), and a forward without autograd
#: casts nothing; the folded backward casts them where it needs them
#: (``triton_hybrid._folded_maps_backward``). Each program reads the 64 KB fp32 weight from
#: L2 instead of 32 KB (ptxas at D = F/2 = 128: 98 registers, 48 KB either way). Off:
#: measured slower (session 23, one H100, 8 x 1k, ``kernel_anatomy.py --branches
#: layer-w-in-kernel``: the pair 0.138 to 0.157 ms against the casts' 0.005 saved) on one
#: program a block. "walk": only where the pair walks (``walk_plan``), whose programs read a
#: head's weight once a share of ~5 blocks at the 8B's shape: measured on one H100 (session
#: 25, `kernel_anatomy --branches layer-w-in-kernel`, 8 x 1k, results/h100_2026-12-05f) the
#: walk 0.111 to 0.114 ms and the two casts (0.005) gone: the layer's forward 0.409 to 0.405
#: ms; on that machine's host 0.616 to 0.517 ms of host time per no-grad forward; on the CPU
#: proxy (``host_overhead.py --weights-in-kernel``) 135.6 to 111.8 us, its first launch 61.5
#: to 42.1. Not the default yet: see ``triton_hybrid.DEFAULT_FORWARD`` (the GPU test run with
#: it and ``PARKED_FORWARD`` on had output-gate failures not yet traced)
WEIGHTS_IN_KERNEL: bool | str = False


def weights_in_kernel(walking: bool) -> bool:
    """Whether the pair's kernel rounds the maps' weights itself (``WEIGHTS_IN_KERNEL``), for a
    pair that walks or not."""
    if WEIGHTS_IN_KERNEL in (True, False):
        return WEIGHTS_IN_KERNEL
    if WEIGHTS_IN_KERNEL != "walk":
        raise ValueError(f"triton_phi.WEIGHTS_IN_KERNEL {WEIGHTS_IN_KERNEL!r}: True, False or "
                         "'walk'")
    return walking


#: the forward pair on programs that each walk an equal share of the heads' row blocks in a
#: row (``_phi_fwd_pair_walk``; a share spanning two heads reads both weights): this many
#: programs a multiprocessor on ``WALK_TILES``; "auto": ``WALK_DEFAULTS``' plan for the
#: shape, where it has one; None: one program a block (``_phi_fwd_pair``). Why: at 8 x 1k
#: the pair moved 252 MB in 0.154 ms on an H100 where its grid's memory pattern alone (the
#: same loads and stores, no product: ``phi_bound.py``'s ``copy``) takes 0.094 and the
#: product adds nothing (``dot`` 0.096): its activations (four row reductions, 256
#: exponentials a row) ran after its loads and before its stores, in series, in each
#: one-block program. A walking program loads the next blocks (``WALK_STAGES``) and stores
#: through descriptors (``FORWARD_TMA``) while this one's activations run.
FORWARD_WALK: int | str | None = "auto"
#: the pipelined stages of a walking program's loop (x blocks in flight)
WALK_STAGES = 3
#: a walking program's (rows a block, warps); None: the plan's or ``_forward_tiles``'
WALK_TILES: tuple[int, int] | None = None
#: the walking programs read x and write y through tensor descriptors (TMA: the stores
#: asynchronous) where ``triton_common.tma_ok`` allows; pointer loads and stores otherwise
#: (the same values). Measured with the walk (session 24, one H100, 8 x 1k, ``phi_bound.py``
#: rows walk1-tma / walk1; results/h100_2026-12-05d): 0.135 against 0.163 ms by pointers
FORWARD_TMA = True
#: the walk by default, per (D, F/2): (programs a multiprocessor, rows a block, warps, stages).
#: (128, 128), the 8B models' square map: two 4-warp programs of 32-row blocks a multiprocessor
#: (ptxas: 156 registers, 82 KB, mma.sync), measured fastest of session 24's walks at 8 x 1k
#: (one H100, ``phi_bound.py``, two repeats, the reciprocal off; results/h100_2026-12-05d):
#: the pair 0.154 ms, walking at one 64 x 8 program a multiprocessor 0.135 (4 stages 0.130),
#: at two 32 x 4 ones 0.121. Other shapes keep one program a block (not measured)
WALK_DEFAULTS = {(128, 128): (2, 32, 4, 3)}


def _prec(dtype):
    return "tf32"  # bf16 operands (fp32 is routed away)


def _tiles(D: int, FH: int, backward: bool) -> tuple[int, int]:
    """(rows per program, warps), from ptxas's register report for sm_90a: no spills in either
    direction for D = 64 / 128 and F/2 = D / D/2 (the backward holds x, dy and du: 32 rows
    when they are wide; at D = F/2 = 64 the backward takes 8 warps: with 4 it sat at 232
    registers and the (H, B, T, F/2) du address tipped it into a 120-byte spill).

    D = F/2 = 128 (the 8B models' square map): the backward at 64 rows since session 11. The
    report that had 64 rows spilling 368 bytes was compiled without the divisibility hints a
    launch passes; with them (tests/test_triton_compile.py) 102 registers, no spill, wgmma
    where 32 rows get mma.sync. Measured on one H200 (benchmarks/phi_speed.py, both maps'
    forward + backward in device time, two repeats each): 1 x 64k 2.76 to 2.60 ms, 8 x 1k 0.426
    either way; 128 rows slower at both (3.11 / 0.458), the forward at 128 rows too (1.44 vs
    1.01 ms at 64k; benchmarks/results/h200_2026-12-03c/README.md). Rectangular maps (F/2 =
    64) keep 32 rows: not measured.

    Measured slower and not taken (session 12, 2026-12-03, both maps, device time; benchmarks/
    results/h200_2026-12-03d/README.md): several row blocks a program (a loop over them, W read
    once, the loads pipelined): the forward at 8 x 1k 0.150 to 0.173 ms with four blocks,
    forward + backward 0.426 to 0.484, at 1 x 64k 2.60 to 3.32; the bias gradient summed per
    block in the kernel instead of torch reducing du: forward + backward 0.425 to 0.486 at
    8 x 1k, 2.59 to 3.27 at 1 x 64k.

    Measured and not taken (session 15, the backward from the hybrid kernel's du, DU_GIVEN 1,
    q map at 8 x 1k; results/h200_2026-12-03g, call 3): 128 rows a program (137 registers)
    0.064 against 0.062 ms at 64; the bias gradient's partial sums in the kernel again slower,
    0.064 to 0.110 ms (the torch reduction of du it saves: 0.030)."""
    if backward and D * FH >= 128 * 128:
        return 64, 8
    if backward and D * FH >= 64 * 128:
        return 32, 8
    if backward:
        return 64, 8
    return 64, 4 if D * FH <= 64 * 64 else 8


def _du_buffer(x: torch.Tensor, FH: int):
    """The backward's du (B, H, T, F/2), laid out so that dW = sum over (b, t) of x^T du is one
    batched GEMM that reads x where it lies, and the function computing dW from (x, du).

    x laid out as (B, T, H, D) (transformers hands attention q and k so, transposed): row (b, t)
    of head h sits at a fixed stride, so x is an (H, D, B T) view; du is written as (H, B, T,
    F/2), an (H, B T, F/2) view: dW = bmm over H. x contiguous (B, H, T, D): dW = bmm over B H
    of (D, T) x (T, F/2), summed over B (du written (B, H, T, F/2)). Other layouts: du (H, B, T,
    F/2) and x copied into (H, D, B T) by the reshape (until 2026-12-02 every layout copied
    both: the copy of x was a strided transpose, the largest PyTorch kernel of the layer's
    backward)."""
    return DuSlot(x, FH).new_du(), _dw_reducer(x, FH)


def _dw_reducer(x: torch.Tensor, FH: int):
    """``_du_buffer``'s function computing dW from (x, du), du laid out as ``DuSlot.new_du``
    lays it out for this x."""
    B, H, T, D = x.shape

    def heads_first(x, du):  # (H, D, B T) x (H, B T, F/2): views where the layouts allow
        xs = x.permute(1, 3, 0, 2).reshape(H, D, B * T)
        return bmm_fp32(xs, du.permute(1, 0, 2, 3).reshape(H, B * T, FH))
    if x.is_contiguous() and not x.transpose(1, 2).is_contiguous():
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
    (``out_dtype=torch.float32``), where until 2026-12-04 it rounded the product to bf16 and
    a second kernel cast it back to fp32; elsewhere (the CPU, where ``aten::bmm.dtype`` has
    no kernel: Triton's interpreter), and on CUDA with a torch that has no such kernel
    (logged once), the operands in fp32: the same products and sums."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        if bmm_out_dtype_on_cuda():
            return torch.bmm(a, b, out_dtype=torch.float32)
        warn_once(__name__, "this torch has no CUDA kernel for bmm(out_dtype=float32): the "
                  "maps' dW from fp32 copies of their operands (the same values, more memory "
                  "traffic)")
    return torch.bmm(cast(a, torch.float32), cast(b, torch.float32))


#: the attribute of a map's output (``hedgehog_features(kernel_du=True)``) holding its
#: ``DuSlot``: the hybrid kernel (``triton_hybrid.hybrid_kernel``) looks for it on its fq
DU_SLOT_ATTR = "_hedgecats_du_slot"


_ZEROS: dict = {}


def _zero(device, dtype) -> torch.Tensor:
    """A zero scalar per (device, dtype), made once (the marker's storage: never written;
    autograd does not accumulate in place into an expanded tensor)."""
    key = (device, dtype)
    if key not in _ZEROS:
        _ZEROS[key] = torch.zeros((), device=device, dtype=dtype)
    return _ZEROS[key]


class DuSlot:
    """Where the hybrid kernel's backward leaves this map's du (``kernel_du``), so that the
    map's backward starts from du instead of from dphi: the kernel holds dphi_q in fp32 at
    the end of its dfq pass and turns it into du there (``triton_hybrid._bwd_dfq``'s or,
    fused with the dq pass, ``_bwd_q``'s MAP_DU: the activations it needs are phi itself,
    which the kernel reads anyway), and the (B, H, T, F) dphi_q is neither written nor read
    again (measured: benchmarks/README.md).

    Protocol (each side checks the other, so that a consumer that does not know it changes
    nothing but speed):
    - the map's forward attaches the slot to its output y (attribute ``DU_SLOT_ATTR``);
    - the hybrid kernel, given exactly that tensor as fq, computes du (``new_du``: laid out
      as the map's backward wants it), stores it with ``put`` and returns as fq's gradient
      ``marker``, zeros that take no memory (expanded);
    - the map's backward ``take``s du: where its dy is the marker itself (the kernel was y's
      only consumer), it starts from du; where dy is anything else (y had other consumers:
      autograd summed their gradients with the marker's zeros), it adds du to the du of dy
      (du is linear in dy), so every consumer's gradient counts.
    A caller asking autograd for y's gradient directly (``torch.autograd.grad(..., inputs=y)``)
    would get the marker: ask through ``retain_grad`` or a hook, or leave ``kernel_du`` off.
    Any op between y and the kernel (a floor's clamp, a cast, a view) makes another tensor,
    without the attribute: the kernel then returns dfq as usual; so does every kernel but the
    first given y itself (``claim``), and the kernel whose y someone watches (``retain_grad``
    or a hook on y: ``observed``), so that what they see is y's gradient, not the marker."""

    __slots__ = ("shape", "heads_first", "device", "dtype", "softmax", "du", "marker",
                 "claimed", "owner")

    def __init__(self, x: torch.Tensor, FH: int, softmax: bool = True):
        B, H, T, _ = x.shape
        self.shape, self.device, self.dtype = (B, H, T, FH), x.device, x.dtype
        # x laid out as (B, T, H, D) (transformers' q, k) or any layout other than (B, H, T,
        # D): du (H, B, T, F/2) memory (``_dw_reducer``)
        self.heads_first = x.transpose(1, 2).is_contiguous() or not x.is_contiguous()
        self.softmax = softmax
        self.du = self.marker = None
        self.claimed = False  # (by the first kernel given y: ``claim``)
        self.owner = None  # (a weak reference to y: ``watch``)

    def watch(self, y: torch.Tensor) -> None:
        """Attach the slot to y (the map's output)."""
        setattr(y, DU_SLOT_ATTR, self)
        self.owner = weakref.ref(y)

    def observed(self) -> bool:
        """Whether someone asked to see y's gradient itself (``retain_grad``, a hook): then
        the kernel must hand back dphi, not the marker (the kernel's backward asks, just
        before it would write du)."""
        y = self.owner() if self.owner is not None else None
        return y is not None and (y.retains_grad or bool(getattr(y, "_backward_hooks", None)))

    def claim(self) -> bool:
        """Whether the calling kernel may hand du back: the first kernel given y only (a
        second one's backward would overwrite the first's du; it returns dfq as usual, which
        reaches the map's backward summed with the marker and is added there)."""
        first, self.claimed = not self.claimed, True
        return first

    def new_du(self) -> torch.Tensor:
        """An empty du (B, H, T, F/2) view in the layout ``_dw_reducer`` reads in place."""
        B, H, T, FH = self.shape
        if self.heads_first:
            return torch.empty(H, B, T, FH, device=self.device,
                               dtype=self.dtype).permute(1, 0, 2, 3)
        return torch.empty(B, H, T, FH, device=self.device, dtype=self.dtype)

    def clear(self) -> None:
        self.du = self.marker = None

    def put(self, du: torch.Tensor, fq: torch.Tensor) -> torch.Tensor:
        """Leave du for the map's backward; returns the marker to hand autograd as fq's
        gradient."""
        self.du = du
        self.marker = _zero(fq.device, fq.dtype).expand(fq.shape)
        return self.marker

    def take(self, dy: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """(du or None, whether dy is only the marker); empties the slot."""
        du, marker, self.du, self.marker = self.du, self.marker, None, None
        if du is None:
            return None, False
        only = (marker is not None and dy.shape == marker.shape
                and dy.data_ptr() == marker.data_ptr() and not any(dy.stride()))
        return du, only


def kernel_weights(w, bias, dtype):
    """(the weight (H, D, F/2) in ``dtype``, as the module casts it, the bias in its own), both
    contiguous: what the maps' kernels read (and ``triton_hybrid``'s q map in ``_fwd``)."""
    return cast(w, dtype).contiguous(), bias.contiguous()


def _forward_tiles(D: int, FH: int) -> tuple[int, int]:
    """The forward's (rows a program, warps): ``FORWARD_TILES`` where set, else ``_tiles``'."""
    return FORWARD_TILES or _tiles(D, FH, backward=False)


def _forward_operands(x, w, bias, cast_w: bool = True):
    """(y to write, the weight in x's dtype - as it is without ``cast_w``: the kernel rounds
    it -, the bias in its own: both contiguous)."""
    B, H, T, _ = x.shape
    y = torch.empty(B, H, T, 2 * w.shape[-1], device=x.device, dtype=x.dtype)
    if not cast_w:
        return y, w.contiguous(), bias.contiguous()
    return (y, *kernel_weights(w, bias, x.dtype))


def map_forward(x, w, bias, softmax):
    """(y, the weight and bias as the kernel read them: the weight in x's dtype, the bias in
    its own (both contiguous)). The kernel adds the bias in fp32 to the fp32 product: an fp32
    module's bias is read as it is (until 2026-12-04 it was first cast to x's dtype, as the
    PyTorch path rounds it: a cast kernel a call, and a rounding the fp32 map does not have)."""
    B, H, T, D = x.shape
    FH = w.shape[-1]
    y, wc, bc = _forward_operands(x, w, bias)
    BM, warps = _forward_tiles(D, FH)
    fast(_phi_fwd)[(B * H, cdiv(T, BM))](
        x, wc, bc, y, x.stride(0), x.stride(1), x.stride(2), T, H, D=D, FH=FH, BM=BM,
        SOFTMAX=softmax, PREC=_prec(x.dtype), RCP=RECIPROCAL_SOFTMAX, num_warps=warps)
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
    """(programs, blocks a program) for ``FORWARD_WALK``: ``tiles`` blocks (every head's, in
    a row) over about ``per_sm`` programs a multiprocessor, each the same share but the last,
    none empty (on the interpreter: 4 multiprocessors)."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 4
    tpp = cdiv(tiles, max(1, min(tiles, per_sm * sms)))
    return cdiv(tiles, tpp), tpp


def walk_plan(D: int, FH: int) -> tuple[int, int, int, int] | None:
    """(programs a multiprocessor, rows a block, warps, stages) of the walking pair for maps of
    head dim D and F/2 = FH under ``FORWARD_WALK`` (None: one program a block)."""
    if FORWARD_WALK == "auto":
        return WALK_DEFAULTS.get((D, FH))
    if not FORWARD_WALK:
        return None
    if not isinstance(FORWARD_WALK, int):
        raise ValueError(f"triton_phi.FORWARD_WALK {FORWARD_WALK!r}: a number of programs a "
                         "multiprocessor, 'auto' or None")
    return (FORWARD_WALK, *(WALK_TILES or _forward_tiles(D, FH)), WALK_STAGES)


def map_forward_pair(xq, wq, bq, softmax_q, xk, wk, bk, softmax_k):
    """``map_forward`` of a layer's two maps, ``((yq, wqc, bqc), (yk, wkc, bkc))``, in one
    launch (``_phi_fwd_pair``: the same programs in one grid) where ``_pairable``, else two.
    Where ``weights_in_kernel`` the paired weights come back as they were given (fp32 master
    weights: the caller casts them where it needs them in x's dtype)."""
    if not _pairable(xq, wq, xk, wk):
        return map_forward(xq, wq, bq, softmax_q), map_forward(xk, wk, bk, softmax_k)
    B, Hq, T, D = xq.shape
    Hk, FH = xk.shape[1], wq.shape[-1]
    plan = walk_plan(D, FH) if B * T else None  # (no rows: the grid's empty launch)
    in_kernel = weights_in_kernel(plan is not None)
    yq, wqc, bqc = _forward_operands(xq, wq, bq, not in_kernel)
    yk, wkc, bkc = _forward_operands(xk, wk, bk, not in_kernel)
    if plan is not None:
        per_sm, BM, warps, stages = plan
        programs, tpp = walk_split((Hq + Hk) * B * cdiv(T, BM), per_sm, xq.device)
        # (yq, yk: fresh contiguous allocations, their bases and strides 16-byte multiples)
        tma = FORWARD_TMA and tma_ok(xq, xk)
        fast(_phi_fwd_pair_walk)[(programs,)](
            xq, wqc, bqc, yq, xq.stride(0), xq.stride(1), xq.stride(2), Hq,
            xk, wkc, bkc, yk, xk.stride(0), xk.stride(1), xk.stride(2), Hk, B, T, tpp,
            D=D, FH=FH, BM=BM, SOFTMAX_Q=softmax_q, SOFTMAX_K=softmax_k, PREC=_prec(xq.dtype),
            RCP=RECIPROCAL_SOFTMAX, TMA=tma, NS=stages, num_warps=warps)
        CALLS["forward_walk"] += 1
        CALLS["forward_tma"] += tma
    else:
        BM, warps = _forward_tiles(D, FH)
        fast(_phi_fwd_pair)[(B * (Hq + Hk), cdiv(T, BM))](
            xq, wqc, bqc, yq, xq.stride(0), xq.stride(1), xq.stride(2), Hq,
            xk, wkc, bkc, yk, xk.stride(0), xk.stride(1), xk.stride(2), Hk, B * Hq, T,
            D=D, FH=FH, BM=BM, SOFTMAX_Q=softmax_q, SOFTMAX_K=softmax_k, PREC=_prec(xq.dtype),
            RCP=RECIPROCAL_SOFTMAX, num_warps=warps)
    CALLS["pair_forward"] += 1
    CALLS["weights_in_kernel"] += in_kernel and (wq.dtype, wk.dtype) != (xq.dtype,) * 2
    return (yq, wqc, bqc), (yk, wkc, bkc)


def _phi_backward(ctx, dy, dx_in):
    """(dx, dW, db) for ``_PhiFn`` / ``_PhiWithInputFn``; ``dx_in``: x's gradient from its
    other consumer (None: none), added in the kernel. du from the hybrid kernel where it
    left one in the map's ``DuSlot``."""
    x, wc, bc, y = ctx.saved_tensors
    softmax, w_dtype, b_dtype, slot = ctx.meta
    du, only_kernel = slot.take(dy) if slot is not None else (None, False)
    return map_backward(x, wc, bc, y, dy, dx_in, softmax=softmax, dtypes=(w_dtype, b_dtype),
                        du=du, du_only=only_kernel, need=ctx.needs_input_grad[:3])


def map_backward(x, wc, bc, y, dy, dx_in, *, softmax: bool, dtypes: tuple, du=None,
                 du_only: bool = False, need: tuple = (True, True, True)):
    """(dx, dW, db) of the map y = phi(x) (``map_forward``'s x, weight and bias as the kernel
    read them, and y), each None where ``need`` (x, weight, bias) does not ask for it; dW and
    db in ``dtypes`` (the parameters' own). ``dx_in``: x's gradient from its other consumer
    (None: none), added in the kernel. ``du``: the map's du as the hybrid kernel computed it
    (laid out as ``DuSlot.new_du``), alone (``du_only``: dy is not read) or to be added to
    dy's; None: du from dy. The maps' Functions and the hybrid kernel's Function with the
    maps folded in (``triton_hybrid.hybrid_kernel(maps=...)``) share it."""
    plan = _MapBackward(x, wc, bc, y, dy, dx_in, softmax=softmax, dtypes=dtypes, du=du,
                        du_only=du_only, need=need)
    if plan.launches:
        plan.launch()
    return plan.finish()


def map_backward_pair(q: dict | None, k: dict | None):
    """``map_backward`` of a layer's two maps (each side its keyword arguments, or None for a
    map whose backward nothing asks for), ``((dxq, dWq, dbq) or None, (dxk, dWk, dbk) or
    None)``: with ``PAIR_BACKWARD``, both kernels in one launch (``_phi_bwd_pair``) where both
    run and ``_pairable``; else each alone."""
    plans = [None if a is None else _MapBackward(**a) for a in (q, k)]
    pq, pk = plans
    if PAIR_BACKWARD and pq is not None and pk is not None and pq.launches and pk.launches and \
            _pairable(pq.x, pq.wc, pk.x, pk.wc):
        B, Hq, T, D = pq.x.shape
        BM, warps = _tiles(D, pq.FH, backward=True)
        fast(_phi_bwd_pair)[(B * (Hq + pk.x.shape[1]), cdiv(T, BM))](
            *pq.args, Hq, *pk.args, pk.x.shape[1], B * Hq, T, B, D=D, FH=pq.FH, BM=BM,
            PREC=_prec(pq.x.dtype), FROM_Y=BWD_FROM_OUTPUT, RCP=RECIPROCAL_SOFTMAX,
            **{f"{n}_Q": v for n, v in pq.meta.items()},
            **{f"{n}_K": v for n, v in pk.meta.items()}, num_warps=warps)
        CALLS["pair_backward"] += 1
    else:
        for p in plans:
            if p is not None and p.launches:
                p.launch()
    return tuple(None if p is None else p.finish() for p in plans)


class _MapBackward:
    """One map's backward (``map_backward``): planned here (dy and dx_in as the kernel reads
    them, dx and du allocated, the kernel's arguments), its kernel launched alone
    (``launch``) or in one grid with the other map's (``map_backward_pair``), then finished
    (``finish``: dW and db from du, the counters)."""

    __slots__ = ("x", "wc", "FH", "du", "dx", "reduce_dw", "need", "dtypes", "du_given",
                 "add", "args", "meta", "launches")

    def __init__(self, x, wc, bc, y, dy, dx_in, *, softmax: bool, dtypes: tuple, du=None,
                 du_only: bool = False, need: tuple = (True, True, True),
                 dx_into_input: bool = False):
        self.x, self.wc, self.FH, self.need, self.dtypes = x, wc, wc.shape[-1], need, dtypes
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
        # (the caller owns dx_in: the fused kernel's own dq / dk, ``triton_hybrid``'s folded
        # maps): dx written over dx_in where their layouts and dtypes agree - each program
        # reads its tile of dx_in before it writes the same tile - so that no second buffer
        # of x's size is alive (the call before the fold had autograd free one map's
        # buffers before the other's backward; folded, both maps run in one node)
        if add and dx_into_input and dx_in.dtype == x.dtype and dx_in.stride() == x.stride():
            dx = dx_in
            CALLS["dx_in_place"] += 1
        else:
            dx = torch.empty_like(x) if need_dx else None
        if du is None:
            du, self.reduce_dw = _du_buffer(x, self.FH)
        else:
            self.reduce_dw = _dw_reducer(x, self.FH)
        self.du, self.dx, self.du_given, self.add = du, dx, du_given, add
        # (stage 1 with the kernel's du: du is all dW and db need, no kernel)
        self.launches = du_given != 1 or need_dx
        # ``_phi_bwd``'s arguments before T, H, B (its pair's per map, before H)
        self.args = (
            x, wc, bc, y, dy, du if dx is None else dx, du, dx_in if add else du,
            x.stride(0), x.stride(1), x.stride(2), dy.stride(0), dy.stride(1), dy.stride(2),
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
            FROM_Y=BWD_FROM_OUTPUT, RCP=RECIPROCAL_SOFTMAX, num_warps=warps, **self.meta)

    def finish(self):
        """(dx, dW, db), each None where not asked for."""
        need, du, (w_dtype, b_dtype) = self.need, self.du, self.dtypes
        CALLS["backward_dx"] += need[0]
        CALLS["backward_added"] += self.add
        CALLS["du_from_kernel"] += self.du_given == 1
        CALLS["du_added"] += self.du_given == 2
        dw = dbias = None
        if need[1]:
            dw = cast(self.reduce_dw(self.x, du), w_dtype)
        if need[2]:
            # summed in fp32 straight from du (CUDA reduces bf16 into fp32 without a copy; the
            # old du.float() made a strided fp32 copy of du: ~60 us per map at 8 x 1k and a
            # 1 GiB transient at 64k, benchmarks/results/h200_2026-12-02b)
            dbias = cast(du.sum(dim=(0, 2), dtype=torch.float32), b_dtype)
        return self.dx, dw, dbias


class _PhiFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, bias, softmax, slot):
        y, wc, bc = map_forward(x, w, bias, softmax)
        ctx.save_for_backward(x, wc, bc, y)  # y: kept by its consumer anyway (the LA kernel)
        ctx.meta = (softmax, w.dtype, bias.dtype, slot)
        return y

    @staticmethod
    def backward(ctx, dy):
        return (*_phi_backward(ctx, dy, None), None, None)


class _PhiWithInputFn(torch.autograd.Function):
    """(phi(x), x): x handed on through the map, so that its other consumer's gradient (the
    attention kernel's dq or dk) comes back here and is added to the map's in the kernel,
    instead of autograd summing the two in a separate pass over x's gradient."""

    @staticmethod
    def forward(ctx, x, w, bias, softmax, slot):
        y, wc, bc = map_forward(x, w, bias, softmax)
        ctx.save_for_backward(x, wc, bc, y)
        ctx.meta = (softmax, w.dtype, bias.dtype, slot)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dx_in):
        return (*_phi_backward(ctx, dy, dx_in), None, None)


def unsupported_reason(x, weight, bias, activation: str) -> str | None:
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (the kernel takes {', '.join(ACTIVATIONS)})"
    if not available():
        return "triton is not installed or there is no CUDA device"
    if not (x.is_cuda or interpret()):
        return "the kernel runs on CUDA tensors"
    if x.dtype != torch.bfloat16:  # fp32 products spilled heavily; fp32 maps are not hot
        return f"dtype {x.dtype} (the kernel takes bf16)"
    if x.dim() != 4 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or \
            x.shape[-1] != weight.shape[1]:
        return "shapes of x and weight do not match"

    def pow2(n):
        return n & (n - 1) == 0

    D, FH = weight.shape[1], weight.shape[2]
    if not (pow2(D) and 16 <= D <= 128):
        return f"head dim {D} (powers of two in [16, 128])"
    if not (pow2(FH) and 16 <= FH <= 128):
        return f"{FH} features per half (powers of two in [16, 128])"
    if x.shape[2] == 0:
        return "empty sequence"
    return None


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      activation: str = "softmax", *, with_input: bool = False,
                      kernel_du: bool = False):
    """``phi(x)`` (B, H, T, F) in x's dtype for x (B, H, T, D), weight (H, D, F/2), bias
    (H, F/2); differentiable in all three. ``None`` where the kernel does not apply (reason
    logged once): the caller computes the map itself.

    ``with_input``: ``(phi(x), x')``, x' the same values as x (a view of it) for x's other
    consumer (the attention): the gradient that reaches x' is added to the map's in the
    backward kernel (one pass over x's gradient fewer than autograd's sum of the two).

    ``kernel_du``: phi(x) carries a ``DuSlot``: the hybrid kernel, given phi(x) itself as its
    fq, hands the map's backward du instead of dphi (the layer's q map)."""
    reason = unsupported_reason(x, weight, bias, activation)
    if reason is not None:
        if activation in ACTIVATIONS:
            warn_once(__name__, f"fused feature map not used: {reason}")
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    fn = _PhiWithInputFn if with_input else _PhiFn
    softmax = activation == "softmax"
    slot = DuSlot(x, weight.shape[-1], softmax) if kernel_du and torch.is_grad_enabled() \
        else None
    try:
        out = fn.apply(x, weight, bias, softmax, slot)
    except errors() as e:
        record_fallback(FALLBACK_ERRORS, __name__, "feature map", e, "using PyTorch")
        return None
    if slot is not None:
        slot.watch(out[0] if with_input else out)
    CALLS["forward"] += 1
    return out


def reference_features(x, weight, bias, activation="softmax") -> torch.Tensor:
    """The same map in plain PyTorch, fp32 (the tests' oracle)."""
    u = torch.einsum("bhtd,hdf->bhtf", x.float(), weight.float()) + \
        bias.float()[None, :, None, :]
    if activation == "softmax":
        return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], dim=-1)
    return torch.cat([torch.exp(u), torch.exp(-u)], dim=-1)
