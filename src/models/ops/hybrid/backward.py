"""The fused hybrid kernels' backward: the query side (``_bwd_dq`` / ``_bwd_dfq``, or both in
``_bwd_q``), the key side (``_bwd_dkv_swa`` / ``_bwd_dkv_la``, or both in ``_bwd_kv``), and
their launcher ``launch_backward``."""

from __future__ import annotations

import torch

from ..triton_common import HAVE_TRITON, cdiv, fast, tl, triton
from ..instrument import TRACE
from .config import (KernelConfig, dkv_block_n, dq_block_m, dq_pack_of, fc, grad_fc,
                     use_split_states)
from .states import LOG2E, la_states, la_states_rev, like, pointer, precision, strides

if HAVE_TRITON:
    from ..triton_common import key_block  # (defined where triton imports)
    from .forward import _la_num, _packed_rows

    @triton.jit
    def _saved_dot(SAVED, DO, s_rows, do_rows, rows, D: tl.constexpr, BM: tl.constexpr):
        """SAVED_t . dO_t for BM query rows (row r at ``SAVED + s_rows[r]``, dO at ``DO +
        do_rows[r]``), the forward's stored branch output read instead of recomputed;
        taken 32 channels at a time (dO re-read from cache) so that no (BM, D) fp32 tile
        is live: a whole-tile version spilled 232-632 bytes per thread in the dq kernel."""
        DC: tl.constexpr = 32 if D > 32 else D
        acc = tl.zeros([BM], dtype=tl.float32)
        for c in tl.static_range(D // DC):
            offs_c = c * DC + tl.arange(0, DC)
            x = tl.load(SAVED + s_rows[:, None] + offs_c[None, :], mask=rows[:, None],
                        other=0.0)
            do = tl.load(DO + do_rows[:, None] + offs_c[None, :], mask=rows[:, None], other=0.0)
            acc += tl.sum(x.to(tl.float32) * do.to(tl.float32), axis=1)
        return acc

    @triton.jit
    def _head_sums(x, PART, b, H, pid_m, NMB, pid_g, BM: tl.constexpr, P: tl.constexpr):
        """Per query head, the sum of ``x`` over its rows of the program (``_packed_rows``),
        stored at PART[(b H + h) NMB + pid_m] (the mixer gradients' partial sums)."""
        BQ: tl.constexpr = BM // P
        h0 = (pid_g % (H // P)) * P
        part = tl.sum(tl.reshape(x, [P, BQ]), axis=1)
        heads = b * H + h0 + tl.arange(0, P)
        tl.store(PART + heads.to(tl.int64) * NMB + pid_m, part)


    @triton.jit
    def _dq_part(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                 KPM, SWA_O, LA_O,
                 DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                 sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
                 sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t,
                 T, H, G, NC, NMB, window, scale, scale_log2, eps,
                 D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
                 HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
                 PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
                 STORE_DNUM: tl.constexpr, SS: tl.constexpr,
                 pid_m, pid_g):
        """dq of one query block (when NEED_DQ), and the per-query factors the other kernels
        need: DELTA (the softmax row term, incl. the shared-norm lse gradient), WS (SWA
        weight), GF (dnum = GF dO), DDEN (gradient of the LA denominator), with STORE_DNUM
        dnum itself ((B H, T, D), the input dtype: the reverse states' matrix operand); PA,
        PB: this block's partial mixer gradients (d c_A, d c_B; or d log s and 0 with
        SHARED). SWA_t . dO_t and LA_t . dO_t come from recomputing both branches (first
        pass), or with FROM_SAVED from the branches' outputs the forward stored (SWA_O, LA_O,
        (B, H, T, D) at strides ssv_*: the forward's own buffers, or the call's output where
        that is its one branch, ``hybrid_kernel``'s ``output_is_branch``). Rows: BM / P
        positions of P query heads of one kv head (``_packed_rows``, block ``pid_m`` of head
        group ``pid_g``), as the forward's.
        Returns (dO, GF, DDEN) of the block's rows, for ``_bwd_q``'s dfq part."""
        LN2: tl.constexpr = 0.6931471805599453
        BQ: tl.constexpr = BM // P
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        rows = offs_m < T
        k_base = K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        t_rows = bh_r.to(tl.int64) * T + offs_m  # each row in the (B H, T) buffers
        do_rows = b.to(tl.int64) * sdo_b + h_r.to(tl.int64) * sdo_h + offs_m.to(tl.int64) * sdo_t
        s_rows = b.to(tl.int64) * ssv_b + h_r.to(tl.int64) * ssv_h + offs_m.to(tl.int64) * ssv_t
        first = tl.load(FIRST + b)
        shift_r = tl.load(SHIFT + bh_r)
        do = tl.load(DO + do_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
        lse2 = tl.load(LSE + t_rows, mask=rows, other=float("-inf"))
        has_win = lse2 > float("-inf")
        lse_safe = tl.where(has_win, lse2, 0.0)
        den = tl.load(DEN + t_rows, mask=rows, other=0.0)
        has_far = ((offs_m - shift_r) >= first) & rows
        r = tl.where(has_far, 1.0 / tl.maximum(den, eps), 0.0)
        lo = tl.maximum(t0 - window + 1, 0)
        lo = (lo // BN) * BN
        hi = tl.minimum(t0 + BQ, T)

        # ---- first pass: LA_t . dO_t, then SWA_t . dO_t
        dot_la = tl.zeros([BM], dtype=tl.float32)
        if HAS_LA:
            if FROM_SAVED:
                dot_la = _saved_dot(LA_O, DO, s_rows, do_rows, rows, D, BM)
            else:
                fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                    + offs_m.to(tl.int64) * sfq_t
                num, _ = _la_num(FQ, FK, V, SST, ZST, VST, CNT, KPM, b, hk, Hkv, t0, offs_m,
                                 fq_rows, shift_r, T, NC, eps, sfk_b, sfk_h, sfk_t, sv_b, sv_h,
                                 sv_t, D, F, FC, BM, BQ, BN, CS, HAS_KPM, PREC, SS)
                dot_la = tl.sum(num * do.to(tl.float32), axis=1) * r
        dot_swa = tl.zeros([BM], dtype=tl.float32)
        if HAS_SWA and FROM_SAVED:
            dot_swa = _saved_dot(SWA_O, DO, s_rows, do_rows, rows, D, BM)
        q_rows = b.to(tl.int64) * sq_b + h_r.to(tl.int64) * sq_h + offs_m.to(tl.int64) * sq_t
        if HAS_SWA and not FROM_SAVED:
            q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                p = tl.where(ok, tl.exp2(s - lse_safe[:, None]), 0.0)
                dpv = tl.dot(do, tl.trans(vb), input_precision=PREC)
                dot_swa += tl.sum(p * dpv, axis=1)

        # ---- the mixer's per-query factors
        if SHARED:
            logs = tl.load(LOGS + bh_r)
            x = logs + lse2 * LN2 - tl.log(tl.maximum(den, eps))
            alpha_t = 1.0 / (1.0 + tl.exp(-x))
            alpha_t = tl.where(has_far, alpha_t, 1.0)
            alpha_t = tl.where(has_win, alpha_t, 0.0)
            live = has_far & has_win
            dx = tl.where(live, (dot_swa - dot_la) * alpha_t * (1.0 - alpha_t), 0.0)
            ws = alpha_t
            delta = alpha_t * dot_swa - dx
            gf = (1.0 - alpha_t) * r
            dden = tl.where(den >= eps, -gf * dot_la - dx * r, 0.0)
            _head_sums(tl.where(rows, dx, 0.0), PA, b, H, pid_m, NMB, pid_g, BM, P)
            _head_sums(tl.zeros([BM], dtype=tl.float32), PB, b, H, pid_m, NMB, pid_g, BM, P)
        else:
            ca = tl.load(CA + bh_r)
            cb = tl.load(CB + bh_r)
            ws = ca
            delta = ca * dot_swa
            gf = cb * r
            dden = tl.where(den >= eps, -gf * dot_la, 0.0)
            _head_sums(tl.where(rows, dot_swa, 0.0), PA, b, H, pid_m, NMB, pid_g, BM, P)
            _head_sums(tl.where(rows, dot_la, 0.0), PB, b, H, pid_m, NMB, pid_g, BM, P)
        tl.store(DELTA + t_rows, delta, mask=rows)
        tl.store(WS + t_rows, ws, mask=rows)
        tl.store(GF + t_rows, gf, mask=rows)
        tl.store(DDEN + t_rows, dden, mask=rows)
        if STORE_DNUM:  # 32 channels at a time (dO re-read from cache), as _saved_dot
            DC: tl.constexpr = 32 if D > 32 else D
            for c in tl.static_range(D // DC):
                offs_c = c * DC + tl.arange(0, DC)
                doc = tl.load(DO + do_rows[:, None] + offs_c[None, :], mask=rows[:, None],
                              other=0.0)
                tl.store(DNUM + t_rows[:, None] * D + offs_c[None, :],
                         (doc.to(tl.float32) * gf[:, None]).to(DNUM.dtype.element_ty),
                         mask=rows[:, None])

        # ---- second pass: dq (not when q takes no gradient: stage 1's teacher q)
        if HAS_SWA and NEED_DQ:
            if FROM_SAVED:  # (loaded only now: the saved branches' tiles are dead by here)
                q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=rows[:, None],
                            other=0.0)
            dq = tl.zeros([BM, D], dtype=tl.float32)
            for start in range(lo, hi, BN):
                offs_n = start + tl.arange(0, BN)
                kin = offs_n < T
                kb = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                             other=0.0)
                s = tl.dot(q, tl.trans(kb), input_precision=PREC) * scale_log2
                ok = (offs_n[None, :] <= offs_m[:, None]) & \
                     (offs_n[None, :] > offs_m[:, None] - window) & kin[None, :]
                if HAS_KPM:
                    real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                    ok = ok & real[None, :]
                p = tl.where(ok, tl.exp2(s - lse_safe[:, None]), 0.0)
                dpv = tl.dot(do, tl.trans(vb), input_precision=PREC)
                ds = p * (ws[:, None] * dpv - delta[:, None])
                dq += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
            dq_rows = b.to(tl.int64) * sdq_b + h_r.to(tl.int64) * sdq_h \
                + offs_m.to(tl.int64) * sdq_t
            tl.store(DQ + dq_rows[:, None] + offs_d[None, :],
                     (dq * scale).to(DQ.dtype.element_ty), mask=rows[:, None])
        return do, gf, dden

    @triton.jit
    def _bwd_dq(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                KPM, SWA_O, LA_O,
                DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
                sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t,
                T, H, G, NC, NMB, window, scale, scale_log2, eps,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
                HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
                STORE_DNUM: tl.constexpr, SS: tl.constexpr):
        """``_dq_part`` of one query block (its docstring)."""
        _dq_part(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
                 KPM, SWA_O, LA_O, DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, sq_b, sq_h, sq_t, sk_b,
                 sk_h, sk_t, sv_b, sv_h, sv_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b,
                 sdo_h, sdo_t, sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, T, H, G, NC, NMB, window,
                 scale, scale_log2, eps, D, F, FC, BM, BN, CS, P, HAS_SWA, HAS_LA, SHARED,
                 HAS_KPM, PREC, NEED_DQ,
                 FROM_SAVED, STORE_DNUM, SS, tl.program_id(0), tl.program_id(1))

    @triton.jit
    def _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU,
                  sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                  sfq_b, sfq_h, sfq_t, sdu_b, sdu_h, sdu_t,
                  T, H, G, NC, do, gf, dden, pid_m, pid_g, pid_f,
                  D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_KPM: tl.constexpr,
                  PREC: tl.constexpr, MAP_DU: tl.constexpr, SOFTMAX: tl.constexpr,
                  LOAD_ROWS: tl.constexpr):
        """dfq[:, c FC : (c + 1) FC] of one query block (program axis 2 is c; rows: BM / P
        positions of P query heads of one kv head, ``_packed_rows``):
        dfq_t = S^T dnum_t + dden_t z + sum_{intra i} (dnum_t . v_i + dden_t) fk_i,
        dnum_t = GF_t dO_t; in two halves of FC / 2 features (the Hedgehog map's two halves
        when FC = F).

        MAP_DU (FC = F; fq = phi(x) of a Hedgehog map, ``triton_phi``): instead of dfq, the
        map's du = a1 (dfq1 - <dfq1, a1>) - a2 (dfq2 - <dfq2, a2>) (SOFTMAX; exp:
        dfq1 a1 - dfq2 a2), a1 / a2 = fq's halves as stored, dfq in fp32 (never rounded):
        written to DU ((B, H, T, F/2) strides sdu_*), dfq not written. The map's backward
        then only multiplies du by its weight (``triton_phi._phi_bwd``'s DU_GIVEN).

        LOAD_ROWS: the block rows' dO (BM, D), GF and DDEN (BM) read here from DO, GF, DDEN
        (``_bwd_dfq``: where the kernel read them before it was split into parts, so that it
        compiles as it did); else ``do``, ``gf``, ``dden`` as ``_bwd_q``'s dq part holds
        them."""
        BQ: tl.constexpr = BM // P
        FC2: tl.constexpr = FC // 2
        b, hk, t0, h_r, offs_m = _packed_rows(pid_m, pid_g, H, G, BM, P)
        Hkv = H // G
        bh_r = b * H + h_r
        offs_d = tl.arange(0, D)
        offs_f = pid_f * FC + tl.arange(0, FC2)  # the first half; the second at + FC2
        rows = offs_m < T
        t_rows = bh_r.to(tl.int64) * T + offs_m
        shift_r = tl.load(SHIFT + bh_r)
        if LOAD_ROWS:
            do_rows = b.to(tl.int64) * sdo_b + h_r.to(tl.int64) * sdo_h \
                + offs_m.to(tl.int64) * sdo_t
            do = tl.load(DO + do_rows[:, None] + offs_d[None, :], mask=rows[:, None], other=0.0)
            gf = tl.load(GF + t_rows, mask=rows, other=0.0)
            dden = tl.load(DDEN + t_rows, mask=rows, other=0.0)
        jst = tl.minimum(tl.maximum(t0 - tl.max(shift_r, axis=0) + 1, 0) // CS, NC - 1)
        st = SST + (b * Hkv + hk).to(tl.int64) * NC * F * D + jst.to(tl.int64) * F * D
        z_base = ZST + (b * Hkv + hk).to(tl.int64) * NC * F + jst * F
        z1 = tl.load(z_base + offs_f)
        z2 = tl.load(z_base + FC2 + offs_f)
        S1 = tl.load(st + offs_f[None, :] * D + offs_d[:, None])  # (D, FC / 2)
        S2 = tl.load(st + (FC2 + offs_f)[None, :] * D + offs_d[:, None])
        # gf applied in fp32 to the products' rows (rounding gf * dO first cost accuracy)
        dfq1 = tl.dot(do, S1, input_precision=PREC) * gf[:, None] + dden[:, None] * z1[None, :]
        dfq2 = tl.dot(do, S2, input_precision=PREC) * gf[:, None] + dden[:, None] * z2[None, :]
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        hi = tl.minimum(t0 + BQ - tl.min(shift_r, axis=0), T)
        for start in range(jst * CS, hi, BN):
            offs_n = start + tl.arange(0, BN)
            kin = offs_n < T
            fk_rows = fk_base + offs_n[:, None] * sfk_t
            fk1 = tl.load(fk_rows + offs_f[None, :], mask=kin[:, None], other=0.0)
            fk2 = tl.load(fk_rows + (FC2 + offs_f)[None, :], mask=kin[:, None], other=0.0)
            vb = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=kin[:, None],
                         other=0.0)
            ok = (offs_n[None, :] <= offs_m[:, None] - shift_r[:, None]) & kin[None, :]
            if HAS_KPM:
                real = tl.load(KPM + b * T + offs_n, mask=kin, other=0) != 0
                ok = ok & real[None, :]
            da = tl.dot(do, tl.trans(vb), input_precision=PREC) * gf[:, None] + dden[:, None]
            da = tl.where(ok, da, 0.0).to(fk1.dtype)
            dfq1 += tl.dot(da, fk1, input_precision=PREC)
            dfq2 += tl.dot(da, fk2, input_precision=PREC)
        if MAP_DU:
            fq_rows = b.to(tl.int64) * sfq_b + h_r.to(tl.int64) * sfq_h \
                + offs_m.to(tl.int64) * sfq_t
            a1 = tl.load(FQ + fq_rows[:, None] + offs_f[None, :], mask=rows[:, None],
                         other=0.0).to(tl.float32)
            if SOFTMAX:
                du = a1 * (dfq1 - tl.sum(dfq1 * a1, axis=1)[:, None])
            else:
                du = dfq1 * a1
            a2 = tl.load(FQ + fq_rows[:, None] + (FC2 + offs_f)[None, :], mask=rows[:, None],
                         other=0.0).to(tl.float32)
            if SOFTMAX:
                du -= a2 * (dfq2 - tl.sum(dfq2 * a2, axis=1)[:, None])
            else:
                du -= dfq2 * a2
            du_rows = b.to(tl.int64) * sdu_b + h_r.to(tl.int64) * sdu_h \
                + offs_m.to(tl.int64) * sdu_t
            tl.store(DU + du_rows[:, None] + offs_f[None, :], du.to(DU.dtype.element_ty),
                     mask=rows[:, None])
        else:
            dfq_rows = DFQ + t_rows[:, None] * F
            tl.store(dfq_rows + offs_f[None, :], dfq1.to(DFQ.dtype.element_ty),
                     mask=rows[:, None])
            tl.store(dfq_rows + (FC2 + offs_f)[None, :], dfq2.to(DFQ.dtype.element_ty),
                     mask=rows[:, None])

    @triton.jit
    def _bwd_dfq(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU,
                 sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                 sfq_b, sfq_h, sfq_t, sdu_b, sdu_h, sdu_t,
                 T, H, G, NC,
                 D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_KPM: tl.constexpr,
                 PREC: tl.constexpr, MAP_DU: tl.constexpr = False,
                 SOFTMAX: tl.constexpr = True):
        """``_dfq_part`` of one query block and feature slice (program axis 2), its rows' dO,
        GF and DDEN read from memory (the dq pass wrote GF and DDEN)."""
        _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU, sfk_b, sfk_h, sfk_t,
                  sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sfq_b, sfq_h, sfq_t, sdu_b, sdu_h,
                  sdu_t, T, H, G, NC, 0.0, 0.0, 0.0, tl.program_id(0), tl.program_id(1),
                  tl.program_id(2), D, F, FC, BM, BN, CS, P, HAS_KPM, PREC, MAP_DU, SOFTMAX,
                  True)

    @triton.jit
    def _bwd_q(Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST,
               KPM, SWA_O, LA_O,
               DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, DFQ, DU,
               sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
               sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h, sdo_t,
               sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, sdu_b, sdu_h, sdu_t,
               T, H, G, NC, NMB, window, scale, scale_log2, eps,
               D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, CS: tl.constexpr, P: tl.constexpr, HAS_SWA: tl.constexpr,
               HAS_LA: tl.constexpr, SHARED: tl.constexpr, HAS_KPM: tl.constexpr,
               PREC: tl.constexpr, NEED_DQ: tl.constexpr, FROM_SAVED: tl.constexpr,
               STORE_DNUM: tl.constexpr, SS: tl.constexpr, MAP_DU: tl.constexpr,
               SOFTMAX: tl.constexpr):
        """The query side of the backward in one program per query block
        (``KernelConfig.fuse_q_side``): ``_dq_part`` (dq, the per-query factors, dnum), then
        ``_dfq_part`` over all F features (dfq, or the map's du) from the dO, GF and DDEN the
        first part holds: one launch and one read of dO fewer than ``_bwd_dq`` then
        ``_bwd_dfq``, the same arithmetic in the same order (bit for bit the same results).
        HAS_LA only (without LA there is no dfq)."""
        pid_m = tl.program_id(0)
        pid_g = tl.program_id(1)
        do, gf, dden = _dq_part(
            Q, K, V, FQ, FK, DO, SST, ZST, VST, CNT, LSE, DEN, CA, CB, LOGS, SHIFT, FIRST, KPM,
            SWA_O, LA_O, DQ, DELTA, WS, GF, DDEN, PA, PB, DNUM, sq_b, sq_h, sq_t, sk_b, sk_h,
            sk_t, sv_b, sv_h, sv_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sdo_b, sdo_h,
            sdo_t, sdq_b, sdq_h, sdq_t, ssv_b, ssv_h, ssv_t, T, H, G, NC, NMB, window, scale,
            scale_log2, eps, D, F, FC, BM, BN, CS, P, HAS_SWA, HAS_LA, SHARED, HAS_KPM, PREC,
            NEED_DQ, FROM_SAVED,
            STORE_DNUM, SS, pid_m, pid_g)
        _dfq_part(FK, V, DO, SST, ZST, GF, DDEN, SHIFT, KPM, DFQ, FQ, DU, sfk_b, sfk_h, sfk_t,
                  sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sfq_b, sfq_h, sfq_t, sdu_b, sdu_h,
                  sdu_t, T, H, G, NC, do, gf, dden, pid_m, pid_g, 0, D, F, F, BM, BN, CS, P,
                  HAS_KPM, PREC, MAP_DU, SOFTMAX, False)

    @triton.jit
    def _la_key_head(FQ, DO, SHIFT, b, h, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h,
                     CS: tl.constexpr):
        """Query head h of sequence b in a key block's LA gradients: (its rows' offset in the
        per-query vectors, its shift, its fq and dO bases, q_hi: its queries from the
        block's first reverse state ``jb`` on are in that state)."""
        row_base = (b * H + h).to(tl.int64) * T
        shift = tl.load(SHIFT + b * H + h)
        fq_base = FQ + b.to(tl.int64) * sfq_b + h.to(tl.int64) * sfq_h
        do_base = DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
        q_hi = tl.minimum(jb * CS + shift, T)
        return row_base, shift, fq_base, do_base, q_hi

    @triton.jit
    def _la_key_tile(fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n, kreal,
                     offs_f, offs_d, sfq_t, sdo_t, T, BM: tl.constexpr):
        """One query tile (start .. start + BM - 1, one head) of a key block's LA gradients:
        (fq's columns ``offs_f``, dO, GF and DDEN of its rows, the (key, query) pairs that
        count: the query at least ``shift`` past the key and before q_hi - the reverse state
        holds the later ones, so a query tile taller than the key tile must not count them
        twice - and both real)."""
        offs_m = start + tl.arange(0, BM)
        qin = offs_m < T
        fqb = tl.load(fq_base + offs_m[:, None] * sfq_t + offs_f[None, :], mask=qin[:, None],
                      other=0.0)
        dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :], mask=qin[:, None],
                      other=0.0)
        gf = tl.load(GF + row_base + offs_m, mask=qin, other=0.0)
        dd = tl.load(DDEN + row_base + offs_m, mask=qin, other=0.0)
        ok = (offs_m[None, :] - shift >= offs_n[:, None]) & qin[None, :] & \
            (offs_m[None, :] < q_hi) & kreal[:, None]
        return fqb, dob, gf, dd, ok

    @triton.jit
    def _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK,
                      sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                      sdk_b, sdk_h, sdk_t,
                      T, H, G, window, scale, scale_log2, pid_n, pid_bh,
                      D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                      HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """dk (stored) and the window's part of dv (returned, fp32, zero on padded keys) for
        key block ``pid_n`` of kv head ``pid_bh`` = b Hkv + hk (summed over its G query
        heads)."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        kb = tl.load(K + b.to(tl.int64) * sk_b + hk.to(tl.int64) * sk_h + offs_n[:, None] * sk_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        dk = tl.zeros([BN, D], dtype=tl.float32)
        dv = tl.zeros([BN, D], dtype=tl.float32)
        q_hi = tl.minimum(i0 + BN - 1 + window, T)
        for g in range(0, G):
            h = hk * G + g
            row_base = (b * H + h).to(tl.int64) * T
            q_base = Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
            do_base = DO + b.to(tl.int64) * sdo_b + h.to(tl.int64) * sdo_h
            for start in range(i0, q_hi, BM):
                offs_m = start + tl.arange(0, BM)
                qin = offs_m < T
                qb = tl.load(q_base + offs_m[:, None] * sq_t + offs_d[None, :], mask=qin[:, None],
                             other=0.0)
                dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :],
                              mask=qin[:, None], other=0.0)
                lse2 = tl.load(LSE + row_base + offs_m, mask=qin, other=float("-inf"))
                lse_safe = tl.where(lse2 > float("-inf"), lse2, 0.0)
                delta = tl.load(DELTA + row_base + offs_m, mask=qin, other=0.0)
                ws = tl.load(WS + row_base + offs_m, mask=qin, other=0.0)
                sT = tl.dot(kb, tl.trans(qb), input_precision=PREC) * scale_log2  # (BN, BM)
                ok = (offs_m[None, :] >= offs_n[:, None]) & \
                     (offs_m[None, :] - window < offs_n[:, None]) & qin[None, :] & \
                     kreal[:, None]
                pT = tl.where(ok, tl.exp2(sT - lse_safe[None, :]), 0.0)
                # dSWA_t = ws_t dO_t: the weight is applied in fp32 around the products
                # (rounding ws * dO to bf16 first cost ~1e-2 in dk)
                dv += tl.dot((pT * ws[None, :]).to(qb.dtype), dob, input_precision=PREC)
                dpT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * ws[None, :]
                dsT = pT * (dpT - delta[None, :])
                dk += tl.dot(dsT.to(qb.dtype), qb, input_precision=PREC)
        tl.store(DK + b.to(tl.int64) * sdk_b + hk.to(tl.int64) * sdk_h + offs_n[:, None] * sdk_t
                 + offs_d[None, :],
                 tl.where(kreal[:, None], dk * scale, 0.0).to(DK.dtype.element_ty),
                 mask=kin[:, None])
        return tl.where(kreal[:, None], dv, 0.0)

    @triton.jit
    def _bwd_dkv_swa(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, DV,
                     sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                     sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, window, scale, scale_log2,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """dk and the window's part of dv for one key block of one kv head (summed over its G
        query heads; ``_dkv_swa_part``). DV is the final dv (no LA) or an fp32 buffer the LA
        kernel adds to."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * Hkv + hk
        dv = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t, sk_b, sk_h,
                           sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, T,
                           H, G, window, scale, scale_log2, pid_n, pid_bh, D, BM, BN, HAS_KPM,
                           PREC)
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_d = tl.arange(0, D)
        tl.store(DV + b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
                 + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=(offs_n < T)[:, None])

    @triton.jit
    def _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK,
                     sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                     sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, NC, eps, pid_n, pid_bh, pid_f, dv_swa,
                     D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, CS: tl.constexpr, ADD_DVS: tl.constexpr,
                     HAS_KPM: tl.constexpr, PREC: tl.constexpr, PART: tl.constexpr,
                     ADD_SWA: tl.constexpr):
        """Linear attention's part of the key-side gradients for one key block of one kv head
        (summed over its G query heads): programs with axis-2 index c < F / FC write
        dfk[:, c FC : (c + 1) FC]; the one with c = F / FC writes dv (plus the window's part,
        DVS, when ADD_DVS). Keys see the reverse state past the block and the queries between
        the block and that state. PART 0: the program's kind from c (``_bwd_dkv_la``: both
        kinds in one grid); 1: a dfk program, 2: the dv program (``_bwd_kv``, which tells them
        apart itself, so that each call compiles one kind). ADD_SWA: the dv program adds ``dv_swa`` (the window's part of dv, fp32, which
        ``_bwd_kv``'s dv programs computed first) where ADD_DVS would read it from DVS."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        jb = tl.minimum(tl.cdiv(i0 + BN - 1, CS), NC)  # first reverse state past the block
        st = RST + pid_bh.to(tl.int64) * NC * F * D + (jb - 1).to(tl.int64) * F * D
        out_base = pid_bh.to(tl.int64) * T
        if PART == 0:
            dfk_program = pid_f * FC < F
        else:
            dfk_program = PART == 1
        if dfk_program:  # ---- dfk, one FC-wide slice
            offs_f = pid_f * FC + tl.arange(0, FC)
            Rt = tl.load(st + offs_f[None, :] * D + offs_d[:, None])  # (D, FC)
            u = tl.load(UST + pid_bh.to(tl.int64) * NC * F + (jb - 1) * F + offs_f)
            dfk = tl.dot(vb, Rt, input_precision=PREC) + u[None, :]
            for g in range(0, G):
                row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                    FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
                for start in range(i0 + shift, q_hi, BM):
                    fqb, dob, gf, dd, ok = _la_key_tile(
                        fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n,
                        kreal, offs_f, offs_d, sfq_t, sdo_t, T, BM)
                    daT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * gf[None, :] + \
                        dd[None, :]
                    daT = tl.where(ok, daT, 0.0)
                    dfk += tl.dot(daT.to(fqb.dtype), fqb, input_precision=PREC)
            tl.store(DFK + (out_base + offs_n[:, None]) * F + offs_f[None, :],
                     tl.where(kreal[:, None], dfk, 0.0).to(DFK.dtype.element_ty),
                     mask=kin[:, None])
        else:  # ---- dv (the floor: eps times every later dnum_t, from the state and below)
            w = tl.load(WST + pid_bh.to(tl.int64) * NC * D + (jb - 1) * D + offs_d)
            dv = tl.zeros([BN, D], dtype=tl.float32) + eps * w[None, :]
            for c in tl.static_range(F // FC):
                offs_f = c * FC + tl.arange(0, FC)
                fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                              mask=kin[:, None], other=0.0)
                R = tl.load(st + offs_f[:, None] * D + offs_d[None, :])  # (FC, D)
                dv += tl.dot(fkb, R, input_precision=PREC)
            for g in range(0, G):
                row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                    FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
                for start in range(i0 + shift, q_hi, BM):
                    offs_m = start + tl.arange(0, BM)
                    qin = offs_m < T
                    aT = tl.zeros([BN, BM], dtype=tl.float32)
                    for c in tl.static_range(F // FC):
                        offs_f = c * FC + tl.arange(0, FC)
                        fkb = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :],
                                      mask=kin[:, None], other=0.0)
                        fqb = tl.load(fq_base + offs_m[:, None] * sfq_t + offs_f[None, :],
                                      mask=qin[:, None], other=0.0)
                        aT += tl.dot(fkb, tl.trans(fqb), input_precision=PREC)
                    dob = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :],
                                  mask=qin[:, None], other=0.0)
                    gf = tl.load(GF + row_base + offs_m, mask=qin, other=0.0)
                    ok = (offs_m[None, :] - shift >= offs_n[:, None]) & qin[None, :] & \
                        (offs_m[None, :] < q_hi) & kreal[:, None]  # (q_hi: as for dfk)
                    # dnum_t = gf_t dO_t, the factor applied in fp32 (as for SWA)
                    aT = tl.where(ok, (aT + eps) * gf[None, :], 0.0)
                    dv += tl.dot(aT.to(dob.dtype), dob, input_precision=PREC)
            dv_rows = b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
            if ADD_DVS:  # (DVS laid out as DV)
                dv += tl.load(DVS + dv_rows + offs_d[None, :], mask=kin[:, None], other=0.0)
            if ADD_SWA:  # (the same values as DVS would hold)
                dv += dv_swa
            tl.store(DV + dv_rows + offs_d[None, :],
                     tl.where(kreal[:, None], dv, 0.0).to(DV.dtype.element_ty),
                     mask=kin[:, None])

    @triton.jit
    def _dkv_la_both(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DFK,
                     sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                     sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                     T, H, G, NC, eps, pid_n, pid_bh, dv_swa,
                     D: tl.constexpr, F: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     CS: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """``_dkv_la_part``'s dfk program (over all F features) and its dv program in one
        (``KernelConfig.kv_one_program``): each LA query tile's fq and dO are loaded once for both
        products, dfk += (v dO^T gf + dden) fq and dv += ((fk fq^T + eps) gf) dO. dv starts
        from ``dv_swa`` (the window's share, which the dv program adds last: another order of
        the same sums, and 32 registers fewer held through the loop)."""
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        i0, offs_n, kin, kreal = key_block(KPM, b, T, pid_n, BN, HAS_KPM)
        offs_d = tl.arange(0, D)
        offs_f = tl.arange(0, F)
        vb = tl.load(V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h + offs_n[:, None] * sv_t
                     + offs_d[None, :], mask=kin[:, None], other=0.0)
        fkb = tl.load(FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
                      + offs_n[:, None] * sfk_t + offs_f[None, :], mask=kin[:, None], other=0.0)
        jb = tl.minimum(tl.cdiv(i0 + BN - 1, CS), NC)  # first reverse state past the block
        st = RST + pid_bh.to(tl.int64) * NC * F * D + (jb - 1).to(tl.int64) * F * D
        R = tl.load(st + offs_f[:, None] * D + offs_d[None, :])  # (F, D)
        u = tl.load(UST + pid_bh.to(tl.int64) * NC * F + (jb - 1) * F + offs_f)
        dfk = tl.dot(vb, tl.trans(R), input_precision=PREC) + u[None, :]
        w = tl.load(WST + pid_bh.to(tl.int64) * NC * D + (jb - 1) * D + offs_d)
        dv = dv_swa + eps * w[None, :]
        dv += tl.dot(fkb, R, input_precision=PREC)
        for g in range(0, G):
            row_base, shift, fq_base, do_base, q_hi = _la_key_head(
                FQ, DO, SHIFT, b, hk * G + g, H, T, jb, sfq_b, sfq_h, sdo_b, sdo_h, CS)
            for start in range(i0 + shift, q_hi, BM):
                fqb, dob, gf, dd, ok = _la_key_tile(
                    fq_base, do_base, GF, DDEN, row_base, start, shift, q_hi, offs_n, kreal,
                    offs_f, offs_d, sfq_t, sdo_t, T, BM)
                daT = tl.dot(vb, tl.trans(dob), input_precision=PREC) * gf[None, :] + \
                    dd[None, :]
                daT = tl.where(ok, daT, 0.0)
                dfk += tl.dot(daT.to(fqb.dtype), fqb, input_precision=PREC)
                aT = tl.dot(fkb, tl.trans(fqb), input_precision=PREC)
                aT = tl.where(ok, (aT + eps) * gf[None, :], 0.0)
                dv += tl.dot(aT.to(dob.dtype), dob, input_precision=PREC)
        tl.store(DFK + (pid_bh.to(tl.int64) * T + offs_n[:, None]) * F + offs_f[None, :],
                 tl.where(kreal[:, None], dfk, 0.0).to(DFK.dtype.element_ty),
                 mask=kin[:, None])
        tl.store(DV + b.to(tl.int64) * sdv_b + hk.to(tl.int64) * sdv_h + offs_n[:, None] * sdv_t
                 + offs_d[None, :], tl.where(kreal[:, None], dv, 0.0).to(DV.dtype.element_ty),
                 mask=kin[:, None])

    @triton.jit
    def _bwd_dkv_la(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK,
                    sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                    sdo_b, sdo_h, sdo_t, sdv_b, sdv_h, sdv_t,
                    T, H, G, NC, eps,
                    D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, CS: tl.constexpr, ADD_DVS: tl.constexpr,
                    HAS_KPM: tl.constexpr, PREC: tl.constexpr):
        """``_dkv_la_part`` of one key block, kv head and program kind (its docstring): a key
        block's dfk programs, then its dv program, along the grid's third axis."""
        _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DVS, DV, DFK, sfq_b,
                     sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                     sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, tl.program_id(0), tl.program_id(1),
                     tl.program_id(2), 0.0, D, F, FC, BM, BN, CS, ADD_DVS, HAS_KPM, PREC, 0,
                     False)

    @triton.jit
    def _bwd_kv(Q, K, FQ, FK, V, DO, LSE, DELTA, WS, GF, DDEN, RST, UST, WST, SHIFT, KPM, DK,
                DV, DFK,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t,
                sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t, sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
                T, H, G, NC, window, scale, scale_log2, eps,
                D: tl.constexpr, F: tl.constexpr, FC: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, CS: tl.constexpr, HAS_KPM: tl.constexpr,
                PREC: tl.constexpr, ONE_PROGRAM: tl.constexpr = False):
        """The key side of the backward in one grid (``KernelConfig.fuse_kv_side``):
        ``_bwd_dkv_la``'s grid of one key block's dfk programs and its dv program, the dv
        program first doing ``_bwd_dkv_swa``'s work (dk, and the window's dv in registers,
        added where the two-kernel path reads it back from an fp32 buffer): one launch and
        that buffer fewer, the same results bit for bit. The grid's third axis holds a key
        block's dfk programs, then its dv program; ONE_PROGRAM
        (``KernelConfig.kv_one_program``): one program a key block doing both
        (``_dkv_la_both``; F // FC must be 1)."""
        pid_n = tl.program_id(0)
        pid_bh = tl.program_id(1)  # b * Hkv + hk
        pid_f = tl.program_id(2)
        if ONE_PROGRAM:
            dv_swa = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t,
                                   sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                   sdk_b, sdk_h, sdk_t, T, H, G, window, scale, scale_log2,
                                   pid_n, pid_bh, D, BM, BN, HAS_KPM, PREC)
            _dkv_la_both(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         dv_swa, D, F, BM, BN, CS, HAS_KPM, PREC)
        elif pid_f * FC < F:  # a dfk program (PART 1)
            _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         pid_f, 0.0, D, F, FC, BM, BN, CS, False, HAS_KPM, PREC, 1, False)
        else:  # the dv program: the window's dk and dv, then LA's dv plus the window's
            dv_swa = _dkv_swa_part(Q, K, V, DO, LSE, DELTA, WS, KPM, DK, sq_b, sq_h, sq_t,
                                   sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
                                   sdk_b, sdk_h, sdk_t, T, H, G, window, scale, scale_log2,
                                   pid_n, pid_bh, D, BM, BN, HAS_KPM, PREC)
            _dkv_la_part(FQ, FK, V, DO, GF, DDEN, RST, UST, WST, SHIFT, KPM, DV, DV, DFK,
                         sfq_b, sfq_h, sfq_t, sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t, sdo_b,
                         sdo_h, sdo_t, sdv_b, sdv_h, sdv_t, T, H, G, NC, eps, pid_n, pid_bh,
                         pid_f, dv_swa, D, F, FC, BM, BN, CS, False, HAS_KPM, PREC, 2, True)


def _dfq_buffers(B: int, H: int, T: int, F: int, fq: torch.Tensor, du_slot):
    """(dfq, du) for the dfq pass: the map's du (``DuSlot.new_du``) where it takes one, else
    dfq (B, H, T, F) in fq's dtype; the other None."""
    if du_slot is not None:
        return None, du_slot.new_du()
    return torch.empty(B, H, T, F, device=fq.device, dtype=fq.dtype), None


def launch_backward(do, q, k, v, fq, fk, ca, cb, logs, shift, first, cnt, kpm_i8, lse, den, *,
                    window, scale, eps, has_swa, has_la, shared, cfg: KernelConfig,
                    need: tuple[bool, bool, bool] = (True, True, True), swa_o=None, la_o=None,
                    states=None, du_slot=None):
    """The gradients; ``need`` says which of dq, dk, dv autograd asks for: the passes that
    only serve the others are skipped (stage 1 trains the feature maps on the teacher's
    detached q, k, v: no dq pass, no window dk / dv kernel, no dv programs) and those come
    back ``None``. ``swa_o`` / ``la_o``: the branches' outputs the forward saved
    (``KernelConfig.save_branches``), read instead of recomputing the branches for the
    per-query factors. ``states``: the forward's LA states ``(S, z, u, state_chunk)``, used
    when this config's state chunk is theirs (a retry with other tiles builds its own).
    ``du_slot``: fq is a Hedgehog map's output carrying a ``triton_phi.DuSlot``: where one
    dfq program takes all F features, it computes the map's du instead of dfq (``_bwd_dfq``'s
    or ``_bwd_q``'s MAP_DU), leaves it in the slot and returns the slot's marker as dfq."""
    need_dq, need_dk, need_dv = need
    from_saved = (swa_o is not None or not has_swa) and (la_o is not None or not has_la)
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    F = fq.shape[-1]
    FC, GFC = fc(cfg, F), grad_fc(cfg, F)
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    dummy = torch.empty(1, device=dev, dtype=q.dtype)
    kpm = pointer(kpm_i8, lse)
    has_kpm = kpm_i8 is not None
    prec = precision(q.dtype)
    if has_la and states is not None and states[3] == cfg.state_chunk:
        S, z, vs = states[:3]
        NC = S.shape[2]
        TRACE.count("hybrid.states_from_forward")
    elif has_la:
        S, z, vs, NC = la_states(fk, v, kpm_i8, cfg)
    else:
        S, z, NC = dummy, torch.empty(1, **f32), 1
        vs = z
    BM, BN = cfg.bwd_block_m, cfg.bwd_block_n
    BMQ = dq_block_m(cfg)  # the query tile of the query-side kernels (dq, dfq)
    PQ = dq_pack_of(cfg, G)  # query heads a program of theirs takes
    NMB = cdiv(T, BMQ // PQ)  # query blocks a head
    dq = like(q) if has_swa and need_dq else None
    delta, ws, gf, dden = (torch.empty(B * H, T, **f32) for _ in range(4))
    pa, pb = torch.empty(B * H, NMB, **f32), torch.empty(B * H, NMB, **f32)
    # dnum = GF dO, the reverse states' matrix operand (rounded once to the input dtype)
    dnum = torch.empty(B, H, T, D, device=dev, dtype=q.dtype) if has_la else None
    map_du = has_la and du_slot is not None and GFC == F
    dfq = du = None
    q_args = (q, k, v, fq, fk, do, S, z, vs, cnt, lse, den, ca, cb, logs, shift, first, kpm,
              pointer(swa_o, dummy), pointer(la_o, dummy), pointer(dq, dummy), delta, ws, gf,
              dden, pa, pb, pointer(dnum, dummy))
    saved = swa_o if swa_o is not None else la_o  # (one layout: see ``launch_forward``)
    q_strides = (*strides(q), *strides(k), *strides(v), *strides(fq), *strides(fk),
                 *strides(do), *strides(q if dq is None else dq),
                 *(strides(saved) if saved is not None else (0, 0, 0)))
    q_scalars = (T, H, G, NC, NMB, window, scale, scale * LOG2E, eps)
    q_meta = dict(D=D, F=F, FC=FC, BM=BMQ, BN=BN, CS=cfg.state_chunk, P=PQ, HAS_SWA=has_swa,
                  HAS_LA=has_la, SHARED=shared, HAS_KPM=has_kpm, PREC=prec,
                  NEED_DQ=dq is not None, FROM_SAVED=from_saved, STORE_DNUM=dnum is not None,
                  SS=cfg.state_product_stages, num_warps=cfg.bwd_warps, num_stages=cfg.stages)
    fuse_q = has_la and cfg.fuse_q_side and GFC == F and not use_split_states(cfg, NC)
    if fuse_q:  # dq, the factors, dnum and dfq (or du) in one kernel (``_bwd_q``)
        dfq, du = _dfq_buffers(B, H, T, F, fq, du_slot if map_du else None)
        fast(_bwd_q)[(NMB, B * H // PQ)](
            *q_args, pointer(dfq, dummy), pointer(du, dummy), *q_strides,
            *(strides(du) if map_du else (0, 0, 0)), *q_scalars, **q_meta, MAP_DU=map_du,
            SOFTMAX=du_slot.softmax if map_du else True)
        TRACE.count("hybrid.fuse_q_side")
    else:
        fast(_bwd_dq)[(NMB, B * H // PQ)](*q_args, *q_strides, *q_scalars, **q_meta)
    q_args = None  # (it holds S, z, vs: they must go where the names below go)
    TRACE.count("hybrid.dq_pass", dq is not None)
    TRACE.count("hybrid.factors_from_saved", from_saved)
    TRACE.count("hybrid.packed_dq", PQ > 1)
    R = U = W = None
    if fuse_q:  # (its dfq pass is done: the states go with the last references to them)
        S = z = vs = None
    if has_la:  # the reverse states first: dnum is freed before dfq is allocated (unless
        # fuse_q allocated it above)
        R, U, W = la_states_rev(fq, dnum, dden, shift, Hkv, NC, cfg)
        dnum = None  # (read by the reverse states only)
    if has_la and not fuse_q:
        dfq, du = _dfq_buffers(B, H, T, F, fq, du_slot if map_du else None)
        fast(_bwd_dfq)[(NMB, B * H // PQ, F // GFC)](
            fk, v, do, S, z, gf, dden, shift, kpm, pointer(dfq, dummy), fq, pointer(du, dummy),
            *strides(fk), *strides(v), *strides(do), *strides(fq),
            *(strides(du) if map_du else (0, 0, 0)), T, H, G, NC,
            D=D, F=F, FC=GFC, BM=BMQ, BN=BN, CS=cfg.state_chunk, P=PQ, HAS_KPM=has_kpm,
            PREC=prec, MAP_DU=map_du, SOFTMAX=du_slot.softmax if map_du else True,
            num_warps=cfg.bwd_warps, num_stages=cfg.stages)
    del S, z, vs
    dk = dv = dvs = dfk = None
    BNK = dkv_block_n(cfg)  # the key tile of the window kernel and of the dfk programs
    NNB = cdiv(T, BNK)
    # the window kernel writes dk and its dv together: when only one of them is asked for, the
    # other is computed into scratch (no stage takes this path: stage 1 needs neither, stage 2
    # both)
    if need_dk or (need_dv and has_swa):
        dk = like(k)
    if need_dv and (has_la or has_swa):
        dv = like(v)
    fuse_kv = cfg.fuse_kv_side and has_swa and has_la and dk is not None and dv is not None
    if fuse_kv:  # dk, dfk and dv from one grid (``_bwd_kv``)
        dfk = torch.empty(B, Hkv, T, F, device=dev, dtype=fk.dtype)
        one_program = cfg.kv_one_program and GFC == F
        fast(_bwd_kv)[(NNB, B * Hkv, 1 if one_program else F // GFC + 1)](
            q, k, fq, fk, v, do, lse, delta, ws, gf, dden, R, U, W, shift, kpm, dk, dv, dfk,
            *strides(q), *strides(k), *strides(fq), *strides(fk), *strides(v),
            *strides(do), *strides(dk), *strides(dv), T, H, G, NC, window, scale,
            scale * LOG2E, eps, D=D, F=F, FC=GFC, BM=BM, BN=BNK, CS=cfg.state_chunk,
            HAS_KPM=has_kpm, PREC=prec, ONE_PROGRAM=one_program, num_warps=cfg.bwd_warps,
            num_stages=cfg.stages)
        TRACE.count("hybrid.fuse_kv_side")
        TRACE.count("hybrid.kv_one_program", one_program)
        TRACE.count("hybrid.dkv_swa")
        TRACE.count("hybrid.dv_la")
    elif has_swa and dk is not None:  # the window's dk and dv come from one kernel
        # (the fp32 share laid out as dv: the LA kernel reads it with dv's strides)
        dvs = like(v, torch.float32) if has_la or dv is None else dv
        if dv is not None and dvs.stride() != dv.stride():
            raise AssertionError(f"dv scratch strides {dvs.stride()} differ from dv's "
                                 f"{dv.stride()}")
        fast(_bwd_dkv_swa)[(NNB, B * Hkv)](
            q, k, v, do, lse, delta, ws, kpm, dk, dvs,
            *strides(q), *strides(k), *strides(v), *strides(do), *strides(dk),
            *strides(dvs), T, H, G, window, scale, scale * LOG2E,
            D=D, BM=BM, BN=BNK, HAS_KPM=has_kpm, PREC=prec, num_warps=cfg.bwd_warps,
            num_stages=cfg.stages)
        TRACE.count("hybrid.dkv_swa")
        dvs = dvs if dv is not None and has_la else None  # only dv's share is kept
    elif dk is not None:
        dk.zero_()
    if has_la and not fuse_kv:
        dfk = torch.empty(B, Hkv, T, F, device=dev, dtype=fk.dtype)
        # (one grid; the last program of each key block: dv)
        fast(_bwd_dkv_la)[(NNB, B * Hkv, F // GFC + (dv is not None))](
            fq, fk, v, do, gf, dden, R, U, W, shift, kpm, pointer(dvs, dfk), pointer(dv, dfk),
            dfk, *strides(fq), *strides(fk), *strides(v), *strides(do),
            *strides(dfk if dv is None else dv), T, H, G, NC, eps,
            D=D, F=F, FC=GFC, BM=BM, BN=BNK, CS=cfg.state_chunk, ADD_DVS=dvs is not None,
            HAS_KPM=has_kpm, PREC=prec, num_warps=cfg.bwd_warps, num_stages=cfg.stages)
        TRACE.count("hybrid.dv_la", dv is not None)
    if du is not None:  # (last: a config that failed above leaves nothing in the slot)
        dfq = du_slot.put(du, fq)
        TRACE.count("hybrid.map_du")
    return dq, dk if need_dk else None, dv, dfq, dfk, pa, pb
