"""The output-MSE objectives' loss in one Triton pass per direction.

``la_output_mse`` and ``hybrid_output_mse`` (``losses``) end in

    loss = sum_{b, h, t real, d} (student - teacher)^2 / (real queries x H x D)

over (B, H, T, D) outputs in the model's dtype. In PyTorch (``reference.masked_mse_reference``,
the CPU path and the tests' oracle) that is a chain of fp32 copies (two casts, a difference, a
square, a masked sum; the backward as many again): on the 8B shape at 8 x 1k about ten passes of
134 MB a layer. Here the forward reads both tensors once and writes one fp32 partial sum per
(b, h, tile of rows); the backward reads them once more and writes the student's gradient
``2 (student - teacher) w_t g / N`` in its dtype (``w_t`` 0 for a padded query), each
difference taken in fp32 as the reference takes it. Padded query rows are never read, so
whatever the teacher put there (transformers' SDPA may leave a fully masked row undefined)
cannot reach the loss; the reference selects them away (``torch.where``) for the same reason.

The partial sums are added in a fixed order (``torch.sum`` over a buffer, no atomics), so the
kernels add nothing nondeterministic.

Which calls they take: ``dispatch.mse_unsupported_reason``; the entry: ``dispatch.masked_mse``.
"""

from __future__ import annotations

import torch

from ..instrument import TRACE
from ..triton_common import HAVE_TRITON, cdiv, errors, fast, next_pow2, tl, triton
from .reference import masked_mse_reference

__all__ = ["ROWS", "mse_kernel"]

ROWS = 32  # query rows of one program (D 128, 4 warps: 96 / 147 registers, no spill; ptxas)

if HAVE_TRITON:

    @triton.jit
    def _tile(S, TT, KPM, ss_b, ss_h, ss_t, st_b, st_h, st_t, T, H,
              D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_KPM: tl.constexpr):
        """This program's (b, h, rows) of both tensors in fp32, padded rows and columns past D
        never read (0); and the row offsets (int64: T x H x D passes 2^31 in SDPA's layout at
        512k positions), the tile's mask, b, h."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_t = pid_t * BT + tl.arange(0, BT)
        offs_d = tl.arange(0, BD)
        rows = offs_t < T
        if HAS_KPM:
            rows = rows & (tl.load(KPM + b * T + offs_t, mask=offs_t < T, other=0) != 0)
        m = rows[:, None] & (offs_d[None, :] < D)
        rows64 = offs_t.to(tl.int64)[:, None]
        s = tl.load(S + b.to(tl.int64) * ss_b + h.to(tl.int64) * ss_h + rows64 * ss_t
                    + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        t = tl.load(TT + b.to(tl.int64) * st_b + h.to(tl.int64) * st_h + rows64 * st_t
                    + offs_d[None, :], mask=m, other=0.0).to(tl.float32)
        return s, t, rows64, m, b, h

    @triton.jit
    def _mse_fwd(S, TT, KPM, PART, ss_b, ss_h, ss_t, st_b, st_h, st_t, T, H, NTB,
                 D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_KPM: tl.constexpr):
        s, t, _, _, _, _ = _tile(S, TT, KPM, ss_b, ss_h, ss_t, st_b, st_h, st_t, T, H, D, BD, BT,
                                 HAS_KPM)
        e = s - t
        tl.store(PART + tl.program_id(1).to(tl.int64) * NTB + tl.program_id(0),
                 tl.sum(tl.sum(e * e, axis=1), axis=0))

    @triton.jit
    def _mse_bwd(S, TT, KPM, C, DS, ss_b, ss_h, ss_t, st_b, st_h, st_t, sd_b, sd_h, sd_t, T, H,
                 D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_KPM: tl.constexpr):
        s, t, rows64, m, b, h = _tile(S, TT, KPM, ss_b, ss_h, ss_t, st_b, st_h, st_t, T, H, D,
                                      BD, BT, HAS_KPM)
        offs_d = tl.arange(0, BD)
        inside = (rows64 < T) & (offs_d[None, :] < D)
        c = tl.load(C)  # 2 g / N, fp32
        ds = tl.where(m, (s - t) * c, 0.0)  # padded rows: exactly 0
        tl.store(DS + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + rows64 * sd_t
                 + offs_d[None, :], ds.to(DS.dtype.element_ty), mask=inside)


def _rows_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _MSEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, kpm_i8, denom):
        B, H, T, D = student.shape
        ntb = cdiv(T, ROWS)
        part = torch.empty(B * H, ntb, device=student.device, dtype=torch.float32)
        kpm_arg = part if kpm_i8 is None else kpm_i8
        fast(_mse_fwd)[(ntb, B * H)](
            student, teacher, kpm_arg, part, *student.stride()[:3], *teacher.stride()[:3], T, H,
            ntb, D=D, BD=next_pow2(D), BT=ROWS, HAS_KPM=kpm_i8 is not None,
            num_warps=4)
        ctx.save_for_backward(student, teacher, denom, *(() if kpm_i8 is None else (kpm_i8,)))
        return part.sum() / denom

    @staticmethod
    def backward(ctx, g):
        student, teacher, denom, *kpm = ctx.saved_tensors
        kpm_i8 = kpm[0] if kpm else None
        B, H, T, D = student.shape
        c = (2.0 * g.float() / denom).reshape(1).contiguous()
        ds = torch.empty(B, H, T, D, device=student.device, dtype=student.dtype)
        try:
            fast(_mse_bwd)[(cdiv(T, ROWS), B * H)](
                student, teacher, c if kpm_i8 is None else kpm_i8, c, ds, *student.stride()[:3],
                *teacher.stride()[:3], *ds.stride()[:3], T, H, D=D,
                BD=next_pow2(D), BT=ROWS, HAS_KPM=kpm_i8 is not None, num_warps=4)
            TRACE.count("transfer.mse.backward")
        except errors() as e:  # the same gradient in PyTorch
            TRACE.fallback("transfer.mse", "output MSE backward", e,
                           "this call's gradient comes from PyTorch", phase="backward")
            with torch.enable_grad():
                s = student.detach().requires_grad_()
                loss = masked_mse_reference(
                    s, teacher.detach(), None if kpm_i8 is None else kpm_i8.bool())
                ds = torch.autograd.grad(loss, s, g)[0].to(student.dtype)
        dt = (-ds).to(teacher.dtype) if ctx.needs_input_grad[1] else None
        return ds, dt, None, None


def mse_kernel(student: torch.Tensor, teacher: torch.Tensor,
               key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.masked_mse_reference`` (same arguments and value, fp32 scalar) through the
    kernels, differentiable in both tensors; for calls ``dispatch.mse_unsupported_reason``
    accepts. Raises Triton's errors (``errors()``) where the forward kernel does not compile or
    fit here."""
    B, H, T, D = student.shape
    student, teacher = _rows_last(student), _rows_last(teacher)
    if key_padding_mask is None:
        kpm_i8 = None
        denom = torch.full((), float(B * H * T * D), device=student.device)
    else:
        kpm_i8 = key_padding_mask.to(torch.int8).contiguous()
        # (a batch of padding alone: loss 0, rather than 0 / 0, as the reference)
        denom = (key_padding_mask.sum(dtype=torch.float32) * (H * D)).clamp_min(1.0)
    return _MSEFn.apply(student, teacher, kpm_i8, denom)
