"""``weights_xent`` as a fused, flash-style Triton kernel (``reference.weights_xent``'s
function: read its docstring for the semantics): per real query ``t`` and head,

    xent_t = -sum_{i <= t, real} A_soft[t, i] log A_phi[t, i]
           = log Z_t - sum_i A_soft[t, i] log k_ti,     k_ti = max(fq_t.fk_i + eps, TINY),
                                                        Z_t  = sum_i k_ti
    ent_t  = -sum_i A_soft[t, i] log A_soft[t, i] = lse_t - sum_i A_soft[t, i] s_ti

averaged over real queries and heads. The teacher's weights ``A_soft = softmax(s)``,
``s = scale q.k``, are formed online (running max, exp2) in the same pass over the keys as the
student's kernel values; nothing of size T x T is ever stored. Per row the forward keeps
``lse_t`` and ``Z_t`` (fp32); the backward recomputes both products per tile:

    d xent_t / d a_ti = 1 / Z_t - A_soft[t, i] / k_ti   where a_ti + eps >= TINY (else 0)

and accumulates ``dfq`` per query block (``_bwd_dq``) and ``dfk`` per key block of each kv head,
summed over its query heads (``_bwd_dk``: GQA without atomics). Only ``fq`` and ``fk`` get
gradients; ``q`` and ``k`` are the (detached) teacher's.

Which calls it takes: ``dispatch.xent_unsupported_reason``; the entry: ``dispatch.weights_xent``.
"""

from __future__ import annotations

import torch

from ..hybrid.reference import DEN_TINY
from ..instrument import TRACE
from ..triton_common import HAVE_TRITON, cdiv, errors, fast, tl, triton

__all__ = ["xent_rows"]

TINY = DEN_TINY


if HAVE_TRITON:
    from ..triton_common import key_block  # (defined where triton imports)

    @triton.jit
    def _xent_fwd(Q, K, FQ, FK, KPM, XE, ENT, LSE, LZ,
                  sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t,
                  T, H, G, scale_log2, tiny, eps,
                  D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  HAS_KPM: tl.constexpr, PREC_S: tl.constexpr, PREC_A: tl.constexpr):
        LN2: tl.constexpr = 0.6931471805599453
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // G
        t0 = pid_m * BM
        offs_m = t0 + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, F)
        rows = offs_m < T
        q = tl.load(Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + offs_m[:, None] * sq_t
                    + offs_d[None, :], mask=rows[:, None], other=0.0)
        fq = tl.load(FQ + b.to(tl.int64) * sfq_b + h.to(tl.int64) * sfq_h
                     + offs_m[:, None] * sfq_t + offs_f[None, :], mask=rows[:, None], other=0.0)
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        c_i = tl.zeros([BM], dtype=tl.float32)  # sum_i p_ti log k_ti      (p unnormalised)
        e_i = tl.zeros([BM], dtype=tl.float32)  # sum_i p_ti s_ti (log2 units)
        z_i = tl.zeros([BM], dtype=tl.float32)  # sum_i k_ti
        hi = tl.minimum(t0 + BM, T)
        for start in range(0, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                         other=0.0)
            fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :], mask=kin[:, None],
                          other=0.0)
            ok = (offs_n[None, :] <= offs_m[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            s = tl.dot(q, tl.trans(kb), input_precision=PREC_S) * scale_log2
            a = tl.dot(fq, tl.trans(fkb), input_precision=PREC_A)
            kk = tl.where(ok, tl.maximum(a + eps, tiny), 0.0)
            z_i += tl.sum(kk, axis=1)
            logk = tl.log(tl.where(ok, kk, 1.0))
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            c_i = c_i * alpha + tl.sum(p * logk, axis=1)
            e_i = e_i * alpha + tl.sum(p * tl.where(ok, s, 0.0), axis=1)
            m_i = m_new
        live = l_i > 0
        l_safe = tl.where(live, l_i, 1.0)
        lse2 = tl.where(live, m_i + tl.log2(l_safe), float("-inf"))
        lz = tl.log(tl.where(live, z_i, 1.0))
        xent = tl.where(live, lz - c_i / l_safe, 0.0)
        ent = tl.where(live, (lse2 - e_i / l_safe) * LN2, 0.0)
        base = pid_bh.to(tl.int64) * T
        tl.store(XE + base + offs_m, xent, mask=rows)
        tl.store(ENT + base + offs_m, ent, mask=rows)
        tl.store(LSE + base + offs_m, lse2, mask=rows)
        tl.store(LZ + base + offs_m, lz, mask=rows)

    @triton.jit
    def _xent_bwd_dq(Q, K, FQ, FK, KPM, LSE, LZ, W, DFQ,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t,
                     T, H, G, scale_log2, tiny, eps,
                     D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC_S: tl.constexpr, PREC_A: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // G
        t0 = pid_m * BM
        offs_m = t0 + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, F)
        rows = offs_m < T
        q = tl.load(Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + offs_m[:, None] * sq_t
                    + offs_d[None, :], mask=rows[:, None], other=0.0)
        fq = tl.load(FQ + b.to(tl.int64) * sfq_b + h.to(tl.int64) * sfq_h
                     + offs_m[:, None] * sfq_t + offs_f[None, :], mask=rows[:, None], other=0.0)
        base = pid_bh.to(tl.int64) * T
        lse2 = tl.load(LSE + base + offs_m, mask=rows, other=float("-inf"))
        live = lse2 > float("-inf")
        lse_safe = tl.where(live, lse2, 0.0)
        rz = tl.where(live, tl.exp(-tl.load(LZ + base + offs_m, mask=rows, other=0.0)), 0.0)
        w = tl.where(live, tl.load(W + base + offs_m, mask=rows, other=0.0), 0.0)
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        dfq = tl.zeros([BM, F], dtype=tl.float32)
        hi = tl.minimum(t0 + BM, T)
        for start in range(0, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                         other=0.0)
            fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :], mask=kin[:, None],
                          other=0.0)
            ok = (offs_n[None, :] <= offs_m[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            s = tl.dot(q, tl.trans(kb), input_precision=PREC_S) * scale_log2
            a = tl.dot(fq, tl.trans(fkb), input_precision=PREC_A) + eps
            p = tl.exp2(s - lse_safe[:, None])
            pass_ = ok & (a >= tiny)
            da = tl.where(pass_, w[:, None] * (rz[:, None] - p / tl.where(pass_, a, 1.0)), 0.0)
            dfq += tl.dot(da.to(fkb.dtype), fkb, input_precision=PREC_A)
        tl.store(DFQ + base * F + offs_m[:, None] * F + offs_f[None, :],
                 dfq.to(DFQ.dtype.element_ty), mask=rows[:, None])

    @triton.jit
    def _xent_bwd_dk(Q, K, FQ, FK, KPM, LSE, LZ, W, DFK,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t,
                     T, H, G, scale_log2, tiny, eps,
                     D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC_S: tl.constexpr, PREC_A: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * Hkv + hk
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, F)
        kb = tl.load(K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h + offs_n[:, None] * sk_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        fkb = tl.load(FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
                      + offs_n[:, None] * sfk_t + offs_f[None, :], mask=kin[:, None], other=0.0)
        dfk = tl.zeros([BN, F], dtype=tl.float32)
        for g in range(0, G):
            h = hk * G + g
            bh = b * H + h
            base = bh.to(tl.int64) * T
            q_base = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
            fq_base = FQ + b.to(tl.int64) * sfq_b + h.to(tl.int64) * sfq_h
            for start in range(i0, T, BM):
                offs_m = start + tl.arange(0, BM)
                qin = offs_m < T
                qb = tl.load(q_base + offs_m[:, None] * sq_t + offs_d[None, :], mask=qin[:, None],
                             other=0.0)
                fqb = tl.load(fq_base + offs_m[:, None] * sfq_t + offs_f[None, :],
                              mask=qin[:, None], other=0.0)
                lse2 = tl.load(LSE + base + offs_m, mask=qin, other=float("-inf"))
                live = lse2 > float("-inf")
                lse_safe = tl.where(live, lse2, 0.0)
                rz = tl.where(live, tl.exp(-tl.load(LZ + base + offs_m, mask=qin, other=0.0)), 0.0)
                w = tl.where(live, tl.load(W + base + offs_m, mask=qin, other=0.0), 0.0)
                sT = tl.dot(kb, tl.trans(qb), input_precision=PREC_S) * scale_log2  # (BN, BM)
                aT = tl.dot(fkb, tl.trans(fqb), input_precision=PREC_A) + eps
                ok = (offs_m[None, :] >= offs_n[:, None]) & qin[None, :] & kreal[:, None]
                pT = tl.exp2(sT - lse_safe[None, :])
                pass_ = ok & (aT >= tiny)
                daT = tl.where(pass_, w[None, :] * (rz[None, :] - pT / tl.where(pass_, aT, 1.0)),
                               0.0)
                dfk += tl.dot(daT.to(fqb.dtype), fqb, input_precision=PREC_A)
        tl.store(DFK + (pid_bh.to(tl.int64) * T + offs_n[:, None]) * F + offs_f[None, :],
                 dfk.to(DFK.dtype.element_ty), mask=kin[:, None])


LOG2E = 1.4426950408889634


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def _prec(dtype):
    # fp32 operands: three tf32 products (about fp32 accuracy)
    return "tf32x3" if dtype == torch.float32 else "tf32"


#: (block_m, block_n, warps, stages) of the forward, the dfq and the dfk kernel, tried when the
#: chosen tiles do not compile here
SAFE_BLOCKS = ((32, 32, 4, 1),) * 3
#: (phase, tiles, problem) that did not compile here: later calls go to ``SAFE_BLOCKS`` at once
_FAILED: set = set()


def _blocks(q, fq, block_m, block_n):
    """Tiles per kernel (forward, dfq, dfk): (queries, keys, warps, stages). From ptxas's
    register report for sm_90a: the backward kernels hold an F-wide fp32 accumulator for their
    own rows, so those rows come 32 at a time when D x F is large (no spills then; 64 x 64
    spilled up to 600 bytes per thread); fp32 operands on 32 x 32 tiles."""
    if block_m is not None:
        t = (block_m, block_n or block_m, 4, 2)
        return (t, t, t)
    if torch.float32 in (q.dtype, fq.dtype):
        return SAFE_BLOCKS
    if q.shape[-1] * fq.shape[-1] >= 128 * 256:
        return (64, 64, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2)
    return (64, 64, 8, 2), (64, 64, 8, 2), (64, 32, 8, 2)


def _with_retry(phase, key, blocks, fn):
    """``fn(blocks)``, or ``fn(SAFE_BLOCKS)`` where ``blocks`` do not compile here (recorded:
    ``TRACE.retry``); the safe tiles' own failure is raised."""
    if (phase, blocks, key) not in _FAILED:
        try:
            return fn(blocks)
        except errors() as e:
            if blocks == SAFE_BLOCKS:
                raise
            _FAILED.add((phase, blocks, key))
            TRACE.retry("transfer.xent", f"weights_xent {phase} {key} at {blocks}", e,
                        f"using {SAFE_BLOCKS}")
    return fn(SAFE_BLOCKS)


class _XentFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, fq, fk, kpm_i8, scale, eps, block_m, block_n):
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        F = fq.shape[-1]
        blocks = _blocks(q, fq, block_m, block_n)
        f32 = dict(device=q.device, dtype=torch.float32)
        xe, ent, lse, lz = (torch.empty(B * H, T, **f32) for _ in range(4))
        kpm_arg = kpm_i8 if kpm_i8 is not None else lse
        key = (q.dtype, fq.dtype, D, F, kpm_i8 is not None)

        def launch(bl):
            BM, BN, warps, stages = bl[0]
            fast(_xent_fwd)[(cdiv(T, BM), B * H)](
                q, k, fq, fk, kpm_arg, xe, ent, lse, lz, *_strides(q), *_strides(k),
                *_strides(fq), *_strides(fk), T, H, H // Hkv, scale * LOG2E, TINY, eps,
                D=D, F=F, BM=BM, BN=BN, HAS_KPM=kpm_i8 is not None, PREC_S=_prec(q.dtype),
                PREC_A=_prec(fq.dtype), num_warps=warps, num_stages=stages)

        _with_retry("forward", key, blocks, launch)
        ctx.save_for_backward(q, k, fq, fk, lse, lz, *(() if kpm_i8 is None else (kpm_i8,)))
        ctx.meta = (scale, eps, blocks, kpm_i8 is not None)
        ctx.mark_non_differentiable(ent)
        return xe.view(B, H, T), ent.view(B, H, T)

    @staticmethod
    def backward(ctx, dxe, _dent):
        q, k, fq, fk, lse, lz, *rest = ctx.saved_tensors
        scale, eps, blocks, has_kpm = ctx.meta
        kpm_i8 = rest[0] if has_kpm else None
        B, H, T, D = q.shape
        Hkv = k.shape[1]
        F = fq.shape[-1]
        w = dxe.float().reshape(B * H, T).contiguous()
        dfq = torch.empty(B, H, T, F, device=fq.device, dtype=fq.dtype)
        dfk = torch.empty(B, Hkv, T, F, device=fk.device, dtype=fk.dtype)
        kpm_arg = kpm_i8 if kpm_i8 is not None else lse
        args = (*_strides(q), *_strides(k), *_strides(fq), *_strides(fk), T, H, H // Hkv,
                scale * LOG2E, TINY, eps)
        key = (q.dtype, fq.dtype, D, F, has_kpm)

        def launch(bl):
            for kernel, (BM, BN, warps, stages), grid, out in (
                    (_xent_bwd_dq, bl[1], lambda bm, bn: (cdiv(T, bm), B * H), dfq),
                    (_xent_bwd_dk, bl[2], lambda bm, bn: (cdiv(T, bn), B * Hkv), dfk)):
                fast(kernel)[grid(BM, BN)](
                    q, k, fq, fk, kpm_arg, lse, lz, w, out, *args, D=D, F=F, BM=BM, BN=BN,
                    HAS_KPM=has_kpm, PREC_S=_prec(q.dtype), PREC_A=_prec(fq.dtype),
                    num_warps=warps, num_stages=stages)

        _with_retry("backward", key, blocks, launch)
        return None, None, dfq, dfk, None, None, None, None, None


def xent_rows(q, k, fq, fk, *, scale: float, key_padding_mask=None, eps: float = 0.0,
              block_m: int | None = None, block_n: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy (differentiable in fq, fk) and teacher entropy, both (B, H, T)
    fp32, 0 for rows with no visible key; padded query rows are *not* zeroed here. Kernel
    values ``max(fq.fk + eps, TINY)``."""
    q, k, fq, fk = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, fq, fk))
    kpm_i8 = None if key_padding_mask is None else \
        key_padding_mask.bool().to(torch.int8).contiguous()
    return _XentFn.apply(q.detach(), k.detach(), fq, fk, kpm_i8, float(scale), float(eps),
                         block_m, block_n)
