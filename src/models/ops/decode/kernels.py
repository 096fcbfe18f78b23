"""One decode step of a converted layer from its ``HybridCache`` slot, in two Triton kernels.

The composed step (``models.cache._step``, the reference) runs ~80 small GPU kernels per layer
and token - index selects, dtype copies, the blocked softmax over the ring, the chunked LA
reference with the state repeated per query head, the state update - and at 2-3 us each they
make a 32-layer decode step slower than the softmax model's (docs/performance.md). Here the
same step is:

    main   grid (B * Hkv,): one program per sequence and KV head, for its G = H / Hkv query
           heads. The key leaving the window (ring slot ``pos % w``, its feature map ``fk_old``
           computed by the caller) enters the state in place (S += fk_old v_old^T, z += fk_old,
           vsum += v_old, if it is a real key); the new key and value take its slot; then per
           query head
               SWA  = softmax over the ring (the new key in the leaving key's slot) of q.k*scale
               LA   = (fq.S + eps vsum) / (fq.z + eps n)     (0 where the state holds no key)
           mixed as ``hybrid.attention.hybrid_attention`` mixes them (fixed / per-head /
           per-channel ``g``, the shared norm, the modes ``hybrid`` / ``swa_only`` /
           ``la_only`` and ``rescale``), written to out (B, 1, H, D); a new key among the
           first ``n_sinks`` real ones is stored as a sink.
    post   grid (1,): the per-sequence counters, read by every ``main`` program and so moved
           only after it: the ring's real flag of the slot, the state's key count, the sink
           flag and count, and the position counter.

Products: tf32 in bf16 / fp16 models (its 10-bit mantissa holds their inputs exactly; the fp32
state and softmax weights round at 2^-11, below the bf16 output's 2^-8 rounding); accumulation,
softmax and mixing in fp32. fp32 models: IEEE products (compiled for sm_90a they are FMA, no
tensor-core or tf32 instruction: tests/test_triton_compile.py); under Triton's interpreter the
fp32 kernels match the composed step to 2e-7 and a float64 oracle to 1e-7.

Both read the position from the device (no host synchronisation), so a step can be captured in
a CUDA graph (``models.decode``). Programs never read what another program writes: the only
values several programs read and one changes (the counters) are changed by ``post``.

Which calls they take: ``dispatch.unsupported_reason``; the entry: ``dispatch.decode_step``.
"""

from __future__ import annotations

import torch

from ..triton_common import HAVE_TRITON, fast, next_pow2, tl, triton

__all__ = ["MODES", "launch_main", "launch_post"]

MODES = {"hybrid": 0, "swa_only": 1, "la_only": 2}

if HAVE_TRITON:

    @triton.jit
    def _step_main(Q, FQ, K_NEW, V_NEW, FK_OLD, RING_K, RING_V, REAL, REAL_NEW, S, Z, VSUM,
                   N_STATE, N_REAL, SINK_K, SINK_V, POS, G, OUT,
                   sq_b, sq_h, sfq_b, sfq_h, sk_b, sk_h, sv_b, sv_h, sg_b, sg_h, sg_d,
                   g_scalar, scale, eps, Hkv, W, NS,
                   GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
                   BW: tl.constexpr, BF: tl.constexpr, MODE: tl.constexpr,
                   SHARED: tl.constexpr, RESCALE: tl.constexpr, G_TENSOR: tl.constexpr,
                   HAS_REAL_NEW: tl.constexpr, PREC: tl.constexpr):
        pid = tl.program_id(0)
        b = pid // Hkv
        hkv = pid % Hkv
        b64 = b.to(tl.int64)
        bh = pid.to(tl.int64)  # (b, hkv) flattened: the cache tensors are contiguous
        offs_d = tl.arange(0, D)
        offs_w = tl.arange(0, BW)
        offs_g = tl.arange(0, GP)
        offs_f = tl.arange(0, BF)
        in_w = offs_w < W
        in_g = offs_g < GROUP

        pos = tl.load(POS)
        slot = pos % W
        real_old = tl.load(REAL + b64 * W + slot).to(tl.float32)
        if HAS_REAL_NEW:
            real_new = tl.load(REAL_NEW + b64)
        else:
            real_new = tl.full((), 1, tl.int1)
        n_state = tl.load(N_STATE + b64) + real_old.to(tl.int64)  # after the leaving key
        n_real = tl.load(N_REAL + b64)

        # ---- the window: the ring with the new key in the leaving key's slot
        ring = bh * W * D + offs_w[:, None] * D + offs_d[None, :]
        kr = tl.load(RING_K + ring, mask=in_w[:, None], other=0.0)
        vr = tl.load(RING_V + ring, mask=in_w[:, None], other=0.0).to(tl.float32)
        k_new = tl.load(K_NEW + b64 * sk_b + hkv * sk_h + offs_d)
        v_new = tl.load(V_NEW + b64 * sv_b + hkv * sv_h + offs_d)
        is_slot = offs_w == slot
        v_old = tl.sum(tl.where(is_slot[:, None], vr, 0.0), axis=0)  # (D,) fp32
        kr = tl.where(is_slot[:, None], k_new[None, :].to(kr.dtype), kr)
        vr = tl.where(is_slot[:, None], v_new[None, :].to(tl.float32), vr)
        flags = tl.load(REAL + b64 * W + offs_w, mask=in_w, other=0).to(tl.int1)
        flags = tl.where(is_slot, real_new, flags) & in_w

        h0 = hkv * GROUP
        rows_q = b64 * sq_b + (h0 + offs_g)[:, None] * sq_h + offs_d[None, :]
        q = tl.load(Q + rows_q, mask=in_g[:, None], other=0.0)  # (GP, D)
        s = tl.dot(q.to(kr.dtype), tl.trans(kr), input_precision=PREC) * scale  # (GP, BW)
        s = tl.where(flags[None, :], s, float("-inf"))
        m = tl.max(s, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        p = tl.exp(s - m_safe[:, None])
        p = tl.where(flags[None, :], p, 0.0)
        den_w = tl.sum(p, axis=1)
        swa = tl.dot(p, vr, input_precision=PREC) / tl.maximum(den_w, 1e-30)[:, None]
        any_w = den_w > 0
        swa = tl.where(any_w[:, None], swa, 0.0)
        lse = tl.where(any_w, m_safe + tl.log(tl.maximum(den_w, 1e-30)), float("-inf"))

        # ---- the state: absorb the leaving key, read it out (F in blocks of BF)
        fq_rows = (b64 * sfq_b + (h0 + offs_g)[:, None] * sfq_h)
        num = tl.zeros((GP, D), tl.float32)
        den = tl.zeros((GP,), tl.float32)
        for f0 in range(0, F, BF):
            fk = tl.load(FK_OLD + bh * F + f0 + offs_f).to(tl.float32) * real_old  # (BF,)
            st = S + bh * F * D + (f0 + offs_f)[:, None] * D + offs_d[None, :]
            S_blk = tl.load(st) + fk[:, None] * v_old[None, :]
            tl.store(st, S_blk)
            z_blk = tl.load(Z + bh * F + f0 + offs_f) + fk
            tl.store(Z + bh * F + f0 + offs_f, z_blk)
            fq = tl.load(FQ + fq_rows + f0 + offs_f[None, :], mask=in_g[:, None],
                         other=0.0).to(tl.float32)  # (GP, BF)
            num += tl.dot(fq, S_blk, input_precision=PREC)
            den += tl.sum(fq * z_blk[None, :], axis=1)
        vsum = tl.load(VSUM + bh * D + offs_d) + v_old * real_old
        tl.store(VSUM + bh * D + offs_d, vsum)
        num += eps * vsum[None, :]
        den += eps * n_state.to(tl.float32)
        has = n_state > 0
        la = num / tl.maximum(den, eps)[:, None]
        la = tl.where(has, la, 0.0)

        # ---- mix (hybrid.attention.hybrid_attention / _branch_weights)
        if SHARED:
            fac = tl.load(G + b64 * sg_b + (h0 + offs_g) * sg_h, mask=in_g, other=1.0)
            log_s = tl.log(tl.maximum(fac.to(tl.float32), 1e-30))
            alpha = tl.sigmoid(log_s + lse - tl.log(tl.maximum(den, eps)))
            alpha = tl.where(has, alpha, 1.0)
            alpha = tl.where(any_w, alpha, 0.0)
            w_swa = alpha[:, None]
        elif G_TENSOR:
            w_swa = tl.load(G + b64 * sg_b + (h0 + offs_g)[:, None] * sg_h
                            + offs_d[None, :] * sg_d, mask=in_g[:, None],
                            other=0.0).to(tl.float32)
        else:
            w_swa = g_scalar
        if MODE == 0:
            out = w_swa * swa + (1.0 - w_swa) * la
        elif MODE == 1:
            if RESCALE:
                out = swa
            else:
                out = w_swa * swa
        else:
            if RESCALE:
                out = la
            else:
                out = (1.0 - w_swa) * la
        # out is (B, 1, H, D) contiguous
        o_ptr = OUT + (b64 * (Hkv * GROUP) + h0 + offs_g)[:, None] * D + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=in_g[:, None])

        # ---- the cache: the new key in the slot, a new sink
        tl.store(RING_K + bh * W * D + slot * D + offs_d, k_new.to(RING_K.dtype.element_ty))
        tl.store(RING_V + bh * W * D + slot * D + offs_d, v_new.to(RING_V.dtype.element_ty))
        sink = real_new & (n_real < NS)
        sk = bh * (NS + 1) * D + n_real * D + offs_d
        tl.store(SINK_K + sk, k_new.to(SINK_K.dtype.element_ty), mask=sink & (offs_d < D))
        tl.store(SINK_V + sk, v_new.to(SINK_V.dtype.element_ty), mask=sink & (offs_d < D))

    @triton.jit
    def _step_post(REAL, REAL_NEW, N_STATE, N_REAL, SINK_REAL, POS, B, W, NS,
                   BB: tl.constexpr, HAS_REAL_NEW: tl.constexpr):
        pos = tl.load(POS)
        slot = pos % W
        for b0 in range(0, B, BB):
            offs = b0 + tl.arange(0, BB)
            ok = offs < B
            r64 = offs.to(tl.int64)
            real_old = tl.load(REAL + r64 * W + slot, mask=ok, other=0).to(tl.int64)
            if HAS_REAL_NEW:
                real_new = tl.load(REAL_NEW + r64, mask=ok, other=0).to(tl.int1)
            else:
                real_new = ok
            n_state = tl.load(N_STATE + r64, mask=ok, other=0)
            n_real = tl.load(N_REAL + r64, mask=ok, other=0)
            tl.debug_barrier()
            tl.store(REAL + r64 * W + slot, real_new, mask=ok)
            tl.store(N_STATE + r64, n_state + real_old, mask=ok)
            sink = ok & real_new & (n_real < NS)
            tl.store(SINK_REAL + r64 * (NS + 1) + n_real, sink, mask=sink)
            tl.store(N_REAL + r64, n_real + real_new.to(tl.int64), mask=ok)
        tl.debug_barrier()
        tl.store(POS, pos + 1)


def launch_main(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                fq: torch.Tensor, fk_old: torch.Tensor, real: torch.Tensor | None, *,
                mode: str, g, shared_norm: bool, rescale: bool, scale: float,
                eps: float) -> torch.Tensor:
    """The step's ``main`` kernel (module docstring), arguments as ``dispatch.decode_step``'s;
    the output (B, H, 1, D). Raises Triton's errors (``errors()``) where it does not compile or
    fit here: it is compiled before it runs, so the cache is then untouched. ``launch_post``
    must follow."""
    B, H, _, D = query.shape
    Hkv, W, NS, F = key.shape[1], layer.window, layer.n_sinks, fq.shape[-1]
    GROUP = H // Hkv
    out = torch.empty(B, 1, H, D, device=query.device, dtype=query.dtype)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    fq = fq if fq.stride(-1) == 1 else fq.contiguous()
    fk_old = fk_old.contiguous()
    if torch.is_tensor(g):
        gt = g.expand(B, H, 1, D) if not shared_norm else g.expand(B, H, 1, 1)
        sg = (gt.stride(0), gt.stride(1), gt.stride(3))
        g_scalar = 0.0
    else:
        gt, sg, g_scalar = q, (0, 0, 0), float(g)  # G unused
    real_new = real if real is not None else layer.real  # a pointer, unused without the flag
    BF = min(F, 32 if D >= 128 else 64)
    fast(_step_main)[(B * Hkv,)](
        q, fq, k, v, fk_old, layer.keys, layer.values, layer.real, real_new, layer.S,
        layer.z, layer.vsum, layer.n_state, layer.n_real, layer.sink_keys, layer.sink_values,
        layer.pos, gt, out, q.stride(0), q.stride(1), fq.stride(0), fq.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *sg, g_scalar, float(scale),
        float(eps), Hkv, W, NS, GROUP=GROUP, GP=max(16, next_pow2(GROUP)), D=D,
        F=F, BW=max(16, next_pow2(W)), BF=BF, MODE=MODES[mode],
        SHARED=bool(shared_norm), RESCALE=bool(rescale), G_TENSOR=torch.is_tensor(g),
        HAS_REAL_NEW=real is not None,
        PREC="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4 if D <= 64 else 8)
    return out.transpose(1, 2)


def launch_post(layer, real: torch.Tensor | None) -> None:
    """The step's ``post`` kernel: the per-sequence counters moved after ``launch_main``."""
    B = layer.real.shape[0]
    real_new = real if real is not None else layer.real  # a pointer, unused without the flag
    fast(_step_post)[(1,)](layer.real, real_new, layer.n_state, layer.n_real, layer.sink_real,
                           layer.pos, B, layer.window, layer.n_sinks,
                           BB=min(1024, next_pow2(B)), HAS_REAL_NEW=real is not None,
                           num_warps=4)
