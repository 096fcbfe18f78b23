"""The fused hybrid kernels' forward: ``_fwd`` (per program, the LA branch from the nearest
stored state plus the keys after it, the window's online softmax, the mixer) and its launcher
``launch_forward``."""

from __future__ import annotations

import functools

import torch

from ..triton_common import HAVE_TRITON, cdiv, fast, tl, triton
from ..instrument import TRACE
from .config import KernelConfig, fc, pack_of
from .states import LOG2E, la_states, like, pointer, precision, strides

if HAVE_TRITON:

    @triton.jit
    def _packed_rows(pid_m, pid_g, H, G, BM: tl.constexpr, P: tl.constexpr):
        """A program's BM query rows over P query heads of one kv head (``pack_of``): batch
        row, kv head, first position t0 (blocks of BM / P positions), and per row its query
        head and position."""
        BQ: tl.constexpr = BM // P
        b = pid_g // (H // P)
        h0 = (pid_g % (H // P)) * P
        r_ = tl.arange(0, BM)
        t0 = pid_m * BQ
        return b, h0 // G, t0, h0 + r_ // BQ, t0 + r_ % BQ

    @triton.jit
    def _state_share(FQ, fq_rows, rows, st, zt, sl, num, den, D: tl.constexpr,
                     FC: tl.constexpr, PREC: tl.constexpr):
        """The stored state's share of LA over feature slice ``sl`` (FC wide): num += fq S,
        den += fq . z, for the rows whose fq starts at ``FQ + fq_rows``."""
        offs_d = tl.arange(0, D)
        offs_f = sl * FC + tl.arange(0, FC)
        fq = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None], other=0.0)
        S = tl.load(st + offs_f[:, None] * D + offs_d[None, :])
        z = tl.load(zt + offs_f)
        num += tl.dot(fq, S, input_precision=PREC)
        den += tl.sum(fq.to(tl.float32) * z[None, :], axis=1)
        return num, den

    @triton.jit
    def _la_num(FQ, FK, V, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m, fq_rows, shift_r, T,
                NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BQ: tl.constexpr, BN: tl.constexpr, CS: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, SS: tl.constexpr):
        """Numerator (BM, D) and denominator (BM) of LA over keys i <= t - shift for BM query
        rows of one kv head: row r is position ``offs_m[r]`` (in t0 .. t0 + BQ - 1) of the query
        head whose fq row starts at ``FQ + fq_rows[r]``, with its own ``shift_r[r]`` (the rows
        of a program may come from several query heads of the kv head, ``_fwd``'s P). Kernel
        values fq.fk + eps: the nearest stored state at or before t0 - max(shift) + 1 (with the
        floor's share, eps times its value sum and its count of real keys), plus the keys
        between it and t0 + BQ - min(shift), each row masked at its own t - shift. The feature
        dimension is taken FC at a time; the state's share in a pipelined loop when SS > 0
        (``KernelConfig.state_product_stages``)."""
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        jst = tl.minimum(tl.maximum(t0 - tl.max(shift_r, axis=0) + 1, 0) // CS, NC - 1)
        st = SST + (b * Hkv + hk).to(tl.int64) * NC * F * D + jst.to(tl.int64) * F * D
        zt = ZST + (b * Hkv + hk).to(tl.int64) * NC * F + jst * F
        vsum = tl.load(VST + (b * Hkv + hk).to(tl.int64) * NC * D + jst * D + offs_d)
        n_state = tl.load(CNT + b * (T + 1) + jst * CS).to(tl.float32)  # real keys < jst CS
        num = tl.zeros([BM, D], dtype=tl.float32) + eps * vsum[None, :]
        den = tl.zeros([BM], dtype=tl.float32) + eps * n_state
        if SS == 0:  # the slices unrolled: each slice's loads issued where the code reaches them
            for c in tl.static_range(F // FC):
                num, den = _state_share(FQ, fq_rows, rows, st, zt, c, num, den, D, FC, PREC)
        else:  # a loop the compiler pipelines (SS stages): the next slice's fq and S are
            # copied in asynchronously while this one multiplies (the same sums, same order)
            for sl in tl.range(F // FC, num_stages=SS):
                num, den = _state_share(FQ, fq_rows, rows, st, zt, sl, num, den, D, FC, PREC)
        hi = tl.minimum(t0 + BQ - tl.min(shift_r, axis=0), T)
        for start in range(jst * CS, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            a = tl.zeros([BM, BN], dtype=tl.float32)
            for c in tl.static_range(F // FC):
                offs_f = c * FC + tl.arange(0, FC)
                fq = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None],
                             other=0.0)
                fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                              mask=kin[:, None], other=0.0)
                a += tl.dot(fq, tl.trans(fkb), input_precision=PREC)
            ok = (offs_n[None, :] <= offs_m[:, None] - shift_r[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            a = tl.where(ok, a + eps, 0.0)
            den += tl.sum(a, axis=1)
            vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                         other=0.0)
            num += tl.dot(a.to(vb.dtype), vb, input_precision=PREC)
        return num, den

    @triton.jit
    def _fwd(Q, K, V, FQ, FK, SST, ZST, VST, CNT, OUT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST, KPM,
             SWA_O, LA_O,
             sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
             sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, so_b, so_h, so_t,
             T, H, G, NC, window, scale_log2, eps,
             D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
             HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
             PREC: tl.constexpr, SAVE: tl.constexpr, SS: tl.constexpr):
        """One program: BM query rows, BQ = BM / P positions t0 .. t0 + BQ - 1 of P query heads
        that share a kv head (P divides the group; ``KernelConfig.pack_heads``). The P heads
        read the same keys, values and LA state: one load and one product serves them all, and
        the block's key range (window and the LA keys after its state) spans BQ positions,
        not BM. SAVE: both branches' outputs stored (SWA_O, LA_O) for the backward."""
        LN2: tl.constexpr = 0.6931471805599453
        BQ: tl.constexpr = BM // P
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        first = tl.load(FIRST + b)
        shift_r = tl.load(SHIFT + bh_r)

        # ---- linear attention over keys i <= t - shift (first: its registers are free again
        # before the window's accumulator is live)
        num = tl.zeros([BM, D], dtype=tl.float32)
        den = tl.zeros([BM], dtype=tl.float32)
        if HAS_LA:
            fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                + offs_m.to(tl.int64) * sfq_t
            num, den = _la_num(FQ, FK, V, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m,
                               fq_rows, shift_r, T, NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h,
                               sv_t, D, F, FC, BM, BQ, BN, CS, HAS_KPM, PREC, SS)
        has_far = (offs_m - shift_r) >= first
        r = tl.where(has_far, 1.0 / tl.maximum(den, eps), 0.0)
        la = num * r[:, None]
        o_rows = b.to(tl.int64) * so_b + h_r.to(tl.int64) * so_h + offs_m.to(tl.int64) * so_t
        t_rows = bh_r.to(tl.int64) * T + offs_m

        # ---- windowed softmax
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        if HAS_SWA:
            q_rows = b.to(tl.int64) * sq_b + h_r.to(tl.int64) * sq_h + offs_m.to(tl.int64) * sq_t
            q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            lo = tl.maximum(t0 - window + 1, 0)
            lo = (lo // BN) * BN
            hi = tl.minimum(t0 + BQ, T)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :],
                             mask=kin[:, None], other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                s = tl.where(ok, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :],
                             mask=kin[:, None], other=0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
                m_i = m_new
        has_win = l_i > 0
        swa = acc / tl.where(has_win, l_i, 1.0)[:, None]
        lse2 = tl.where(has_win, m_i + tl.log2(tl.where(has_win, l_i, 1.0)), float("-inf"))

        # ---- mixer
        if SHARED:
            logs = tl.load(LOGS + bh_r)
            x = logs + lse2 * LN2 - tl.log(tl.maximum(den, eps))
            alpha_t = 1.0 / (1.0 + tl.exp(-x))
            alpha_t = tl.where(has_far, alpha_t, 1.0)
            alpha_t = tl.where(has_win, alpha_t, 0.0)
            out = alpha_t[:, None] * swa + (1.0 - alpha_t)[:, None] * la
        else:
            ca = tl.load(CA + bh_r)
            cb = tl.load(CB + bh_r)
            out = ca[:, None] * swa + cb[:, None] * la
        tl.store(OUT + o_rows[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=rows[:, None])
        tl.store(LSE + t_rows, lse2, mask=rows)
        tl.store(DEN + t_rows, den, mask=rows)
        if SAVE:  # both branches, for the backward's per-query factors
            s_rows = t_rows[:, None] * D + offs_d[None, :]
            if HAS_SWA:
                tl.store(SWA_O + s_rows, swa.to(SWA_O.dtype.element_ty), mask=rows[:, None])
            if HAS_LA:
                tl.store(LA_O + s_rows, la.to(LA_O.dtype.element_ty), mask=rows[:, None])


def launch_forward(q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, *, window, scale,
                   eps, has_swa, has_la, shared, cfg: KernelConfig, save: bool = False,
                   branch_is_output: bool = False):
    """(out, lse, den, swa_o, la_o, states): the branches' outputs (B, H, T, D) and the LA
    states ``(S, z, u, state_chunk)`` only with ``save`` (else ``None``), for the backward.
    ``branch_is_output`` (one branch at weight 1: ``hybrid_kernel``'s ``output_is_branch``):
    with ``save`` that branch is ``out`` itself, not stored a second time."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    F = fq.shape[-1]
    if has_la:
        S, z, vs, NC = la_states(fk, v, kpm_i8, cfg)
    else:  # (placeholders: the kernel reads no state)
        S, NC = torch.empty(1, device=q.device, dtype=q.dtype), 1
        z = torch.empty(1, device=q.device)
        vs = z
    o = like(q)
    lse = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    den = torch.empty(B * H, T, device=q.device, dtype=torch.float32)
    store = save and not branch_is_output  # (the kernel stores the branches: contiguous)
    swa_o = torch.empty(B, H, T, D, device=q.device, dtype=q.dtype) if store and has_swa else None
    la_o = torch.empty(B, H, T, D, device=q.device, dtype=q.dtype) if store and has_la else None
    P = pack_of(cfg, H // Hkv)
    TRACE.count("hybrid.packed_forward", P > 1)
    grid = (cdiv(T, cfg.block_m // P), B * H // P)
    fast(_fwd)[grid](
        q, k, v, fq, fk, S, z, vs, cnt, o, lse, den, ca, cb, logs, shift, first,
        pointer(kpm_i8, lse), pointer(swa_o, o), pointer(la_o, o),
        *strides(q), *strides(k), *strides(v), *strides(fq), *strides(fk),
        *strides(o), T, H, H // Hkv, NC, window, scale * LOG2E, eps,
        D=D, F=F, FC=fc(cfg, F), BM=cfg.block_m, BN=cfg.block_n, CS=cfg.state_chunk, P=P,
        HAS_SWA=has_swa, HAS_LA=has_la, SHARED=shared, HAS_KPM=kpm_i8 is not None,
        PREC=precision(q.dtype), SAVE=store, SS=cfg.state_product_stages,
        num_warps=cfg.warps, **fwd_launch_options(cfg))
    states = (S, z, vs, cfg.state_chunk) if save and has_la else None
    if save and branch_is_output:  # (its values, bit for bit: the other branch adds 0 x 0)
        swa_o, la_o = (o if has_swa else None), (o if has_la else None)
    return o, lse, den, swa_o, la_o, states


def fwd_launch_options(cfg: KernelConfig) -> dict:
    """``_fwd``'s launch options: its pipeline stages (a cached dict: the layer launches it
    every call)."""
    return _launch_options(cfg.stages if cfg.fwd_stages is None else cfg.fwd_stages)


@functools.lru_cache(maxsize=16)
def _launch_options(stages: int) -> dict:
    return {"num_stages": stages}
