"""The linear-attention states of the fused hybrid kernels: the forward states (S, z and the
value sums at every ``state_chunk`` positions) and the backward's reverse states (R, u, w),
walked (one program per state tile walks T) or split (every chunk's share at once, then their
running sums), and the launch helpers the kernels' launchers share."""

from __future__ import annotations

import torch

from ..instrument import TRACE
from .config import KernelConfig, state_tile, use_split_states
from ..triton_common import HAVE_TRITON, cdiv, fast, next_pow2, tl, tma_ok, triton

if HAVE_TRITON:

    @triton.jit
    def _tiles_of(X, s0, s1, s2, N0, N1, T, C, BR: tl.constexpr, BC: tl.constexpr,
                  TMA: tl.constexpr):
        """Where ``_tile`` reads (BR, BC) tiles of the strided (N0, N1, T, C) tensor X from: a
        tensor descriptor (TMA: the loads go through the tensor memory accelerator, into
        shared memory, pipelined, no pointer tensors in registers), or X itself. Build it
        outside loops (the pipeliner cannot predicate a descriptor's creation)."""
        if TMA:
            return tl.make_tensor_descriptor(X, shape=[N0, N1, T, C], strides=[s0, s1, s2, 1],
                                             block_shape=[1, 1, BR, BC])
        else:
            return X

    @triton.jit
    def _tile(src, i0, i1, r0, c0, s0, s1, s2, T, BR: tl.constexpr, BC: tl.constexpr,
              TMA: tl.constexpr):
        """Rows r0 .. r0 + BR - 1 (zeros at rows past T; r0 >= 0), columns c0 .. c0 + BC - 1
        of entry (i0, i1) of the tensor ``_tiles_of`` gave ``src`` for."""
        if TMA:
            return src.load([i0, i1, r0, c0]).reshape(BR, BC)
        else:
            offs_r = r0 + tl.arange(0, BR)
            offs_c = c0 + tl.arange(0, BC)
            return tl.load(src + i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1
                           + offs_r[:, None] * s2 + offs_c[None, :], mask=(offs_r < T)[:, None],
                           other=0.0)

    @triton.jit
    def _state_fwd(FK, V, KPM, SST, ZST, VST,
                   sfk_b, sfk_h, sfk_t, sv_b, sv_h, sv_t,
                   T, Hkv, NC,
                   F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                   BD: tl.constexpr, HAS_KPM: tl.constexpr, PREC: tl.constexpr,
                   SM: tl.constexpr = 0):
        """S_j = sum_{i < j CS, real} fk_i v_i^T (F x D), z_j = sum fk_i, u_j = sum v_i (the
        kernel floor's share of the numerator), for j < NC. SM: z and u as tensor-core
        products (``_sums_mma``; ``KernelConfig.state_sums_mma``)."""
        pid_bh = tl.program_id(0)
        pid_f = tl.program_id(1)
        pid_d = tl.program_id(2)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        fk_base = FK + b.to(tl.int64) * sfk_b + hk.to(tl.int64) * sfk_h
        v_base = V + b.to(tl.int64) * sv_b + hk.to(tl.int64) * sv_h
        st_base = SST + pid_bh.to(tl.int64) * NC * F * D
        z_base = ZST + pid_bh.to(tl.int64) * NC * F
        v_sum_base = VST + pid_bh.to(tl.int64) * NC * D
        S = tl.zeros([BF, BD], dtype=tl.float32)
        z = tl.zeros([BF], dtype=tl.float32)
        vs = tl.zeros([BD], dtype=tl.float32)
        c16 = tl.arange(0, 16)
        z16 = tl.zeros([BF, 16], dtype=tl.float32)
        vs16 = tl.zeros([BD, 16], dtype=tl.float32)
        for j in range(0, NC):
            if SM:
                z = _first_cols(z16, c16, 1)
                vs = _first_cols(vs16, c16, 1)
            _store_state(st_base, z_base, v_sum_base, j, S, z, vs, offs_f, offs_d, pid_f, pid_d,
                         F, D)
            offs_n = j * CS + offs_c
            keep = offs_n < T
            if HAS_KPM:
                keep = keep & (tl.load(KPM + b * T + offs_n, mask=offs_n < T, other=0) != 0)
            fk = tl.load(fk_base + offs_n[:, None] * sfk_t + offs_f[None, :], mask=keep[:, None],
                         other=0.0)
            v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=keep[:, None],
                        other=0.0)
            S += tl.dot(tl.trans(fk), v, input_precision=PREC)
            if SM:
                z16 += _sums_mma(fk, c16, CS, PREC)
                if pid_f == 0:
                    vs16 += _sums_mma(v, c16, CS, PREC)
            else:
                z += tl.sum(fk.to(tl.float32), axis=0)
                if pid_f == 0:
                    vs += tl.sum(v.to(tl.float32), axis=0)

    @triton.jit
    def _state_local(X, Y, KPM, SHIFT, DDEN, LST, XL, YL,
                     sx_b, sx_h, sx_t, sy_b, sy_h, sy_t,
                     T, Hkv, G, NC,
                     F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                     BD: tl.constexpr, REVERSE: tl.constexpr, HAS_KPM: tl.constexpr,
                     PREC: tl.constexpr, TMA: tl.constexpr, SM: tl.constexpr = 0):
        """One chunk's share of the LA states (``split_states``; fp32, summed by
        ``_state_scan``), all chunks in parallel. Forward (X = fk, Y = v, G = 1): chunk j holds
        L_j = sum fk_i v_i^T, sum fk_i and sum v_i over its real keys i in [j CS, (j+1) CS).
        Reverse (X = fq, Y = dnum = GF dO as ``_bwd_dq`` stored it, summed over the G query
        heads h of the kv head): positions t with t - shift_h in [j CS, (j+1) CS) give
        L_j = sum fq_t dnum_t^T, sum DDEN_t fq_t and sum dnum_t. X and Y are read through
        ``_tile`` (ptxas, sm_90a, D 128, F 256: the reverse loop 104 registers through tensor
        descriptors, 255 through pointer tensors). SM: the vector sums as tensor-core products
        (``_sums_mma``, ``_wsums_mma``; ``KernelConfig.state_sums_mma``)."""
        j = tl.program_id(0)
        pid_t = tl.program_id(1)
        pid_bh = tl.program_id(2)  # b * Hkv + hk
        pid_f = pid_t // (D // BD)
        pid_d = pid_t % (D // BD)
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        H = Hkv * G
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        B = tl.num_programs(2) // Hkv
        NH = H if REVERSE else Hkv  # X, Y: (B, H, T, .) query-side, (B, Hkv, T, .) key-side
        xsrc = _tiles_of(X, sx_b, sx_h, sx_t, B, NH, T, F, CS, BF, TMA)
        ysrc = _tiles_of(Y, sy_b, sy_h, sy_t, B, NH, T, D, CS, BD, TMA)
        acc = tl.zeros([BF, BD], dtype=tl.float32)
        xs = tl.zeros([BF], dtype=tl.float32)
        ys = tl.zeros([BD], dtype=tl.float32)
        c16 = tl.arange(0, 16)
        xs16 = tl.zeros([BF, 16], dtype=tl.float32)
        ys16 = tl.zeros([BD, 16], dtype=tl.float32)
        if REVERSE:
            for g in range(0, G):
                h = hk * G + g
                bh = b * H + h  # the query head's row of SHIFT, DDEN
                t0 = j * CS + tl.load(SHIFT + bh)
                x = _tile(xsrc, b, h, t0, pid_f * BF, sx_b, sx_h, sx_t, T, CS, BF, TMA)
                y = _tile(ysrc, b, h, t0, pid_d * BD, sy_b, sy_h, sy_t, T, CS, BD, TMA)
                acc += tl.dot(tl.trans(x), y, input_precision=PREC)
                if pid_d == 0:
                    offs_t = t0 + offs_c
                    dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T,
                                 other=0.0)
                    if SM:
                        xs16 += _wsums_mma(x, dd, c16, PREC)
                    else:
                        xs += tl.sum(x.to(tl.float32) * dd[:, None], axis=0)
                if pid_f == 0:
                    if SM:
                        ys16 += _sums_mma(y, c16, CS, PREC)
                    else:
                        ys += tl.sum(y.to(tl.float32), axis=0)
            if SM:
                xs = _first_cols(xs16, c16, 2)
                ys = _first_cols(ys16, c16, 1)
        else:  # one kv head's keys (G = 1), as _state_fwd takes them
            offs_t = j * CS + offs_c
            x = _tile(xsrc, b, hk, j * CS, pid_f * BF, sx_b, sx_h, sx_t, T, CS, BF, TMA)
            y = _tile(ysrc, b, hk, j * CS, pid_d * BD, sy_b, sy_h, sy_t, T, CS, BD, TMA)
            if HAS_KPM:
                keep = tl.load(KPM + b * T + offs_t, mask=offs_t < T, other=0) != 0
                x = tl.where(keep[:, None], x, 0.0).to(x.dtype)
                y = tl.where(keep[:, None], y, 0.0).to(y.dtype)
            acc = tl.dot(tl.trans(x), y, input_precision=PREC)
            if SM:
                xs = _first_cols(_sums_mma(x, c16, CS, PREC), c16, 1)
                if pid_f == 0:
                    ys = _first_cols(_sums_mma(y, c16, CS, PREC), c16, 1)
            else:
                xs = tl.sum(x.to(tl.float32), axis=0)
                if pid_f == 0:
                    ys = tl.sum(y.to(tl.float32), axis=0)
        base = pid_bh.to(tl.int64) * NC + j
        tl.store(LST + base * F * D + offs_f[:, None] * D + offs_d[None, :], acc)
        if pid_d == 0:
            tl.store(XL + base * F + offs_f, xs)
        if pid_f == 0:
            tl.store(YL + base * D + offs_d, ys)

    @triton.jit
    def _state_scan(LST, SST, NC, N, BLK: tl.constexpr, U: tl.constexpr,
                    REVERSE: tl.constexpr):
        """The exclusive running sums of ``_state_local``'s chunk shares (LST, (rows, NC, N)
        fp32) in chunk order (forward: entry j sums the chunks before j) or reversed (entry j
        sums those after j), into SST (same shape, any dtype). One program per (row, BLK
        elements); U chunks per step, loaded at once, so that their loads do not wait on each
        other. Entry j is the carry plus an inclusive scan of the step's chunks shifted by one,
        so no entry is a difference of two sums."""
        row = tl.program_id(0)
        offs_e = tl.program_id(1) * BLK + tl.arange(0, BLK)
        offs_u = tl.arange(0, U)
        cols = offs_e < N
        base = row.to(tl.int64) * NC * N
        carry = tl.zeros([BLK], dtype=tl.float32)
        for step in range(0, tl.cdiv(NC, U)):
            j0 = step * U
            jj = j0 + offs_u  # the step's chunks in scan order
            prev = jj - 1  # the chunk before each in scan order
            if REVERSE:
                jj = NC - 1 - jj
                prev = NC - 1 - prev
            ok = (j0 + offs_u) < NC
            share = tl.load(LST + base + jj[:, None].to(tl.int64) * N + offs_e[None, :],
                            mask=ok[:, None] & cols[None, :], other=0.0)
            before = tl.load(LST + base + prev[:, None].to(tl.int64) * N + offs_e[None, :],
                             mask=(ok & (offs_u > 0))[:, None] & cols[None, :], other=0.0)
            out = carry[None, :] + tl.cumsum(before, axis=0)
            tl.store(SST + base + jj[:, None].to(tl.int64) * N + offs_e[None, :],
                     out.to(SST.dtype.element_ty), mask=ok[:, None] & cols[None, :])
            carry += tl.sum(share, axis=0)

    @triton.jit
    def _state_rev(FQ, DNUM, DDEN, SHIFT, RST, UST, WST,
                   sfq_b, sfq_h, sfq_t,
                   T, H, G, NC,
                   F: tl.constexpr, D: tl.constexpr, CS: tl.constexpr, BF: tl.constexpr,
                   BD: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr,
                   SM: tl.constexpr = 0):
        """Reverse states, summed over the G query heads of a kv head: entry j holds
        R = sum_{t - shift_h >= (j+1) CS} fq_t dnum_t^T (F x D), u = sum DDEN_t fq_t and
        w = sum dnum_t (the kernel floor's share of dv); dnum_t = GF_t dO_t as ``_bwd_dq``
        stored it ((B, H, T, D)). fq and dnum read through ``_tile``; a loop over the chunks
        and in it one over the heads. SM (``KernelConfig.state_sums_mma``; 16-bit fq and dnum):
        u and w as products on the tensor cores instead of sums across the tile's rows
        (``_rev_add_mma``)."""
        pid_bh = tl.program_id(0)  # b * Hkv + hk
        pid_f = tl.program_id(1)
        pid_d = tl.program_id(2)
        Hkv = H // G
        b = pid_bh // Hkv
        hk = pid_bh % Hkv
        B = tl.num_programs(0) // Hkv
        offs_f = pid_f * BF + tl.arange(0, BF)
        offs_d = pid_d * BD + tl.arange(0, BD)
        offs_c = tl.arange(0, CS)
        fq_src = _tiles_of(FQ, sfq_b, sfq_h, sfq_t, B, H, T, F, CS, BF, TMA)
        dn_src = _tiles_of(DNUM, H * T * D, T * D, D, B, H, T, D, CS, BD, TMA)
        st_base = RST + pid_bh.to(tl.int64) * NC * F * D
        u_base = UST + pid_bh.to(tl.int64) * NC * F
        w_base = WST + pid_bh.to(tl.int64) * NC * D
        R = tl.zeros([BF, BD], dtype=tl.float32)
        u = tl.zeros([BF], dtype=tl.float32)
        w = tl.zeros([BD], dtype=tl.float32)
        if SM:
            c16 = tl.arange(0, 16)
            u16 = tl.zeros([BF, 16], dtype=tl.float32)
            w16 = tl.zeros([BD, 16], dtype=tl.float32)
            for jj in range(0, NC):
                j = NC - 1 - jj
                u = _first_cols(u16, c16, 2)
                w = _first_cols(w16, c16, 1)
                _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                             F, D)
                for g in range(0, G):
                    R, u16, w16 = _rev_add_mma(fq_src, dn_src, DDEN, SHIFT, R, u16, w16, b,
                                               hk * G + g, j, pid_f, pid_d, offs_c, sfq_b,
                                               sfq_h, sfq_t, T, H, F, D, CS, BF, BD, PREC, TMA)
        else:
            for jj in range(0, NC):
                j = NC - 1 - jj
                _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                             F, D)
                for g in range(0, G):
                    R, u, w = _rev_add(fq_src, dn_src, DDEN, SHIFT, R, u, w, b, hk * G + g, j,
                                       pid_f, pid_d, offs_c, sfq_b, sfq_h, sfq_t, T, H,
                                       F, D, CS, BF, BD, PREC, TMA)

    @triton.jit
    def _sums_mma(x, c16, CS: tl.constexpr, PREC: tl.constexpr):
        """The sums over the CS rows of x (CS, N) as a product on the tensor cores: column 0
        of the returned (N, 16) fp32 (x^T [1, 0 ..]; the products exact, summed in fp32)."""
        ones = tl.where(c16[None, :] == 0, 1.0, 0.0) + tl.zeros([CS, 16], tl.float32)
        return tl.dot(tl.trans(x), ones.to(x.dtype), input_precision=PREC)

    @triton.jit
    def _wsums_mma(x, wt, c16, PREC: tl.constexpr):
        """sum_t wt_t x_t over the rows of x (CS, N), wt (CS,) fp32, on the tensor cores: the
        sum of columns 0 and 1 of the returned (N, 16) fp32, x^T [hi, lo, 0 ..] where wt =
        hi + lo, each rounded to x's 16-bit type (wt exact to ~2^-16 of itself; the products
        and sums in fp32)."""
        hi = wt.to(x.dtype).to(tl.float32)
        lo = (wt - hi).to(x.dtype).to(tl.float32)
        cols = tl.where(c16[None, :] == 0, hi[:, None],
                        tl.where(c16[None, :] == 1, lo[:, None], 0.0))
        return tl.dot(tl.trans(x), cols.to(x.dtype), input_precision=PREC)

    @triton.jit
    def _first_cols(acc16, c16, N: tl.constexpr):
        """The sum of the first N columns of an (R, 16) tile (``_sums_mma``: 1,
        ``_wsums_mma``: 2)."""
        return tl.sum(tl.where(c16[None, :] < N, acc16, 0.0), axis=1)

    @triton.jit
    def _rev_add_mma(fq_src, dn_src, DDEN, SHIFT, R, u16, w16, b, h, j, pid_f, pid_d, offs_c,
                     sfq_b, sfq_h, sfq_t, T, H, F: tl.constexpr, D: tl.constexpr,
                     CS: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                     TMA: tl.constexpr):
        """``_rev_add`` with u and w on the tensor cores: u16 (BF, 16) (``_wsums_mma``: u the
        sum of its first two columns) and w16 (BD, 16) (``_sums_mma``: w its first)."""
        bh = b * H + h
        t0 = j * CS + tl.load(SHIFT + bh)
        fq = _tile(fq_src, b, h, t0, pid_f * BF, sfq_b, sfq_h, sfq_t, T, CS, BF, TMA)
        dn = _tile(dn_src, b, h, t0, pid_d * BD, H * T * D, T * D, D, T, CS, BD, TMA)
        R += tl.dot(tl.trans(fq), dn, input_precision=PREC)
        c16 = tl.arange(0, 16)
        if pid_d == 0:
            offs_t = t0 + offs_c
            dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T, other=0.0)
            u16 += _wsums_mma(fq, dd, c16, PREC)
        if pid_f == 0:
            w16 += _sums_mma(dn, c16, CS, PREC)
        return R, u16, w16

    @triton.jit
    def _store_state(st_base, u_base, w_base, j, R, u, w, offs_f, offs_d, pid_f, pid_d,
                     F: tl.constexpr, D: tl.constexpr):
        """Entry j of a walked state kernel (``_state_fwd``: S, z, the value sum over the chunks
        before j; ``_state_rev``: R, u, w over those after it): the (F, D) tile, the F-vector
        from the programs of the first D tile, the D-vector from those of the first F tile."""
        tl.store(st_base + j * F * D + offs_f[:, None] * D + offs_d[None, :],
                 R.to(st_base.dtype.element_ty))
        if pid_d == 0:
            tl.store(u_base + j * F + offs_f, u)
        if pid_f == 0:
            tl.store(w_base + j * D + offs_d, w)

    @triton.jit
    def _rev_add(fq_src, dn_src, DDEN, SHIFT, R, u, w, b, h, j, pid_f, pid_d, offs_c,
                 sfq_b, sfq_h, sfq_t, T, H, F: tl.constexpr, D: tl.constexpr,
                 CS: tl.constexpr, BF: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                 TMA: tl.constexpr):
        """``_state_rev``'s sums plus chunk j of query head h."""
        bh = b * H + h
        t0 = j * CS + tl.load(SHIFT + bh)
        fq = _tile(fq_src, b, h, t0, pid_f * BF, sfq_b, sfq_h, sfq_t, T, CS, BF, TMA)
        dn = _tile(dn_src, b, h, t0, pid_d * BD, H * T * D, T * D, D, T, CS, BD, TMA)
        R += tl.dot(tl.trans(fq), dn, input_precision=PREC)
        if pid_d == 0:
            offs_t = t0 + offs_c
            dd = tl.load(DDEN + bh.to(tl.int64) * T + offs_t, mask=offs_t < T, other=0.0)
            u += tl.sum(fq.to(tl.float32) * dd[:, None], axis=0)
        if pid_f == 0:
            w += tl.sum(dn.to(tl.float32), axis=0)
        return R, u, w



# ============================================================================= launchers
LOG2E = 1.4426950408889634


def pointer(x, dummy):
    """A tensor for a pointer argument the kernel does not read (its flag is off)."""
    return dummy if x is None else x


def strides(x: torch.Tensor) -> tuple[int, int, int]:
    s = x.stride()  # (one call: three stride(i) calls cost ~1 us more, ~30 a layer call)
    return s[0], s[1], s[2]


def like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An output or gradient of ``x``'s shape laid out as ``x`` (its strides where ``x`` is
    dense): q, k, v come as (B, H, T, D) views of the model's (B, T, H, D) projections, and
    an output or gradient in that memory needs no copy in the model's transpose-reshape nor in
    autograd's gradient accumulation (which copies a gradient into its variable's strides)."""
    return torch.empty_like(x, dtype=dtype)


def precision(dtype: torch.dtype) -> str:
    return "tf32x3" if dtype == torch.float32 else "tf32"  # fp32: 3 tf32 products, ~fp32 accuracy

def use_tma(cfg: KernelConfig, *tensors) -> bool:
    """TMA reads for these tensors (``KernelConfig.tma``, ``triton_common.tma_ok``)."""
    return cfg.tma is not False and tma_ok(*tensors)


def _split_states(x, y, S, xs, ys, NC, cfg: KernelConfig, *, reverse: bool, kpm_i8=None,
                  shift=None, dden=None):
    """``KernelConfig.split_states``: every chunk's share (``_state_local``) into fp32
    scratch, then their exclusive running sums (``_state_scan``) into S, xs, ys."""
    B, Hkv, F, D = S.shape[0], S.shape[1], S.shape[-2], S.shape[-1]
    G = x.shape[1] // Hkv
    f32 = dict(device=S.device, dtype=torch.float32)
    L = torch.empty(S.shape, **f32)
    xl, yl = torch.empty(xs.shape, **f32), torch.empty(ys.shape, **f32)
    BF, BD = (cfg.split_tile, cfg.split_tile) if cfg.split_tile else (cfg.state_f, cfg.state_d)
    BF, BD = min(BF, F), min(BD, D)
    tma = use_tma(cfg, x, y)
    if not tma:  # pointer tensors in the loop (ptxas, sm_90a: a 128 x 128 tile spills 312 B)
        BF, BD = min(BF, 64), min(BD, 64)
    dummy = xl
    # the vector sums on the tensor cores, but not in the forward share with a padding mask:
    # compiled (triton 3.6, sm_90a, through descriptors) that case faults with an illegal
    # memory access on an H200 (every padded forward case, none without padding nor in the
    # reverse share; the interpreter gives the right values), so it keeps the row reductions
    sm = _sums_mma_on(cfg, x) and (reverse or kpm_i8 is None)
    fast(_state_local)[(NC, (F // BF) * (D // BD), B * Hkv)](
        x, y, pointer(kpm_i8, dummy), pointer(shift, dummy), pointer(dden, dummy),
        L, xl, yl, *strides(x), *strides(y), x.shape[2], Hkv, G, NC,
        F=F, D=D, CS=cfg.state_chunk, BF=BF, BD=BD, REVERSE=reverse,
        HAS_KPM=kpm_i8 is not None, PREC=precision(x.dtype), TMA=tma, SM=sm,
        num_warps=cfg.state_warps)
    TRACE.count("hybrid.state_sums_mma", sm)
    for share, total in ((L, S), (xl, xs), (yl, ys)):
        _scan_chunks(share, total, NC, reverse)
    TRACE.count("hybrid.split_states")


#: ``_state_scan``'s chunks per step and elements per program
SCAN_STEP, SCAN_BLOCK = 8, 512


def _scan_chunks(share: torch.Tensor, total: torch.Tensor, NC: int, reverse: bool) -> None:
    """``total`` (B, Hkv, NC, ...) = the exclusive running sums of ``share`` (same shape,
    fp32) over the chunk axis (``_state_scan``)."""
    rows = share.shape[0] * share.shape[1]
    N = share[0, 0, 0].numel()
    blk = min(SCAN_BLOCK, next_pow2(N))
    fast(_state_scan)[(rows, cdiv(N, blk))](
        share, total, NC, N, BLK=blk, U=SCAN_STEP, REVERSE=reverse, num_warps=4)


def la_states(fk, v, kpm_i8, cfg: KernelConfig):
    """Forward LA states (S, z) at every ``state_chunk`` positions."""
    B, Hkv, T, F = fk.shape
    D = v.shape[-1]
    CS = cfg.state_chunk
    NC = cdiv(T, CS)
    S = torch.empty(B, Hkv, NC, F, D, device=fk.device, dtype=fk.dtype)
    z = torch.empty(B, Hkv, NC, F, device=fk.device, dtype=torch.float32)
    vs = torch.empty(B, Hkv, NC, D, device=fk.device, dtype=torch.float32)
    if use_split_states(cfg, NC):
        _split_states(fk, v, S, z, vs, NC, cfg, reverse=False, kpm_i8=kpm_i8)
        return S, z, vs, NC
    BF, BD = state_tile(cfg, B * Hkv, F, D)
    grid = (B * Hkv, F // BF, D // BD)
    sm = _sums_mma_on(cfg, fk)
    fast(_state_fwd)[grid](
        fk, v, pointer(kpm_i8, z), S, z, vs, *strides(fk), *strides(v), T, Hkv, NC,
        F=F, D=D, CS=CS, BF=BF, BD=BD, HAS_KPM=kpm_i8 is not None, PREC=precision(fk.dtype),
        SM=sm, num_warps=cfg.state_warps, num_stages=STATE_FWD_STAGES[sm])
    TRACE.count("hybrid.state_sums_mma", sm)
    return S, z, vs, NC


#: ``_state_fwd``'s pipeline stages without / with ``state_sums_mma``: with the sums' products
#: the kernel needs more shared memory (ptxas, sm_90a, D 128, F 256, 128 x 128 tiles: 160 KB
#: at 3 stages without them, 228 KB with, past the 227 KB a program may have; 164 KB at 2)
STATE_FWD_STAGES = {False: 3, True: 2}


def la_states_rev(fq, dnum, dden, shift, Hkv: int, NC: int, cfg: KernelConfig):
    """The backward's reverse LA states (R, u, w) at every ``state_chunk`` positions, summed
    over each kv head's query heads (``_state_rev``; split: ``_split_states``)."""
    B, H, T, F = fq.shape
    D = dnum.shape[-1]
    f32 = dict(device=fq.device, dtype=torch.float32)
    R = torch.empty(B, Hkv, NC, F, D, device=fq.device, dtype=fq.dtype)
    U = torch.empty(B, Hkv, NC, F, **f32)
    W = torch.empty(B, Hkv, NC, D, **f32)
    if use_split_states(cfg, NC):
        _split_states(fq, dnum, R, U, W, NC, cfg, reverse=True, shift=shift, dden=dden)
        return R, U, W
    BF, BD = state_tile(cfg, B * Hkv, F, D)
    sm = _sums_mma_on(cfg, fq)
    fast(_state_rev)[(B * Hkv, F // BF, D // BD)](
        fq, dnum, dden, shift, R, U, W, *strides(fq), T, H, H // Hkv, NC,
        F=F, D=D, CS=cfg.state_chunk, BF=BF, BD=BD, PREC=precision(fq.dtype),
        TMA=use_tma(cfg, fq, dnum), SM=sm, num_warps=cfg.state_warps)
    TRACE.count("hybrid.state_sums_mma", sm)
    return R, U, W


def _sums_mma_on(cfg: KernelConfig, x: torch.Tensor) -> bool:
    """Whether the LA state kernels take their vector sums on the tensor cores
    (``KernelConfig.state_sums_mma``: 16-bit inputs only)."""
    return cfg.state_sums_mma and x.dtype != torch.float32

