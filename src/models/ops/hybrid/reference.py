"""Pure-PyTorch reference kernels: readable, fp32-accumulating, memory linear in T.

These are the test oracle for every fast backend and the CPU path. Nothing here builds a
``T x T`` tensor: softmax branches work on query blocks against the keys a block can see, and
linear attention runs chunk by chunk with a running state.

Conventions (all functions):
    q: (B, H, Tq, D)        k, v: (B, Hkv, Tk, D)      (GQA when Hkv < H; query head h reads
    fq: (B, H, Tq, F)       fk: (B, Hkv, Tk, F)          key/value head h // (H // Hkv))
    The queries are the *last* Tq positions of the Tk keys (Tq == Tk in training; Tq < Tk when
    decoding with a cache). key_padding_mask: (B, Tk) bool, True = real token; padded keys are
    invisible to every branch. Queries with no visible key get output 0 (never NaN).
"""

from __future__ import annotations

import torch

__all__ = [
    "DEN_TINY",
    "LA_EPS",
    "default_eps",
    "linear_attention_chunked",
    "repeat_kv",
    "softmax_attention_blocked",
]

NEG_INF = float("-inf")

#: fp32's smallest normal number: a floor that only keeps a log or a division finite
DEN_TINY = torch.finfo(torch.float32).tiny

#: The LA kernel floor ``eps``: every kernel value is ``k_ti = fq_t . fk_i + eps``, in the
#: numerator and the normaliser alike, at inference and in the ``weights_xent`` objective
#: (``ops.transfer``), so the normalised weights are always a distribution over the visible keys
#: and the objective and inference use the same ones. It also bounds the normaliser from below
#: (``>= eps`` per visible key), and so the gradients through it: with no floor (the second
#: version: only an underflow guard) rows whose products fell to 1e-20 after stage 1 - a fifth of
#: them on the GPU testbed - gave inf / NaN gradients in stage 2 (``d(num/den)/d den`` goes
#: through ``den**2``), first seen as NaN in a CPU fine-tune. A row whose products are all far
#: below ``eps`` averages its visible values uniformly: in the objective that is a high loss (the
#: cross-entropy against uniform weights), never a minimum. Against typical softmax-feature
#: products (~1e-2) the floor changes a weight by ~1e-4 relative.
LA_EPS = 1e-6


def default_eps(activation: str) -> float:
    """The LA kernel floor for a feature-map activation: ``LA_EPS`` for all. With ``none``
    (features, and so products, can be negative) the weights are not a distribution anyway; the
    floor then only keeps the normaliser away from 0 in most rows (and the division is guarded)."""
    return LA_EPS


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, Hkv, T, X) -> (B, H, T, X), query head h reading kv head h // (H // Hkv)."""
    hkv = x.shape[1]
    if hkv == num_heads:
        return x
    if num_heads % hkv:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({hkv})")
    return x.repeat_interleave(num_heads // hkv, dim=1)


def softmax_attention_blocked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    n_sinks: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention restricted to a key set, one query block at a time.

    Query at absolute position ``t`` sees keys ``i <= t`` and additionally
    ``i > t - window`` (sliding window; ``None`` = unlimited) and ``i < n_sinks`` (sinks only;
    ``None`` = no such limit). Returns ``(out (B, H, Tq, D) fp32, lse (B, H, Tq) fp32)`` with
    ``lse = log sum_i exp(s_ti)`` over the visible keys (``-inf`` where none is visible).

    Memory is ``O(Tq * (block + window))``, so linear in T for a fixed window. With
    ``window=None`` every block sees all earlier keys (quadratic: use it for short T or tests).
    """
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    offset = Tk - Tq
    k, v = repeat_kv(k, H).float(), repeat_kv(v, H).float()
    q = q.float()
    outs, lses = [], []
    for qs in range(0, Tq, block):
        qe = min(qs + block, Tq)
        a_s, a_e = offset + qs, offset + qe  # absolute positions of the block's queries
        lo = 0 if window is None else max(0, a_s - window + 1)
        hi = a_e if n_sinks is None else min(a_e, n_sinks)
        if hi <= lo:  # no key visible to any query of this block
            outs.append(q.new_zeros(B, H, qe - qs, v.shape[-1]))
            lses.append(q.new_full((B, H, qe - qs), NEG_INF))
            continue
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, qs:qe], k[:, :, lo:hi]) * scale
        tpos = torch.arange(a_s, a_e, device=q.device)[:, None]  # (q, 1)
        ipos = torch.arange(lo, hi, device=q.device)[None, :]  # (1, k)
        allowed = ipos <= tpos
        if window is not None:
            allowed = allowed & (ipos > tpos - window)
        allowed = allowed[None, None]  # (1, 1, q, k)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, lo:hi].bool()
        s = s.masked_fill(~allowed, NEG_INF)
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)  # exp(-inf) = 0 on masked keys
        denom = p.sum(dim=-1, keepdim=True)  # (B, H, q, 1)
        out = torch.einsum("bhqk,bhkd->bhqd", p, v[:, :, lo:hi])
        # the clamp never acts where the result is used (denom > 0); it keeps 0/0 out of the graph
        out = torch.where(denom > 0, out / denom.clamp_min(1e-30), torch.zeros_like(out))
        outs.append(out)
        lses.append((m + torch.log(denom)).squeeze(-1))  # log(0) = -inf where nothing visible
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def linear_attention_chunked(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    shift: int = 0,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = LA_EPS,
    chunk: int = 64,
    state: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised causal linear attention over keys ``i <= t - shift``.

        o_t = sum_i (fq_t . fk_i + eps) v_i / sum_i (fq_t . fk_i + eps)

    (the sums over visible real keys; ``eps``: the kernel floor, ``LA_EPS``).

    ``shift = 0`` is ordinary causal LA (all causal keys, "overlapping"); ``shift = w`` sees only
    keys outside a window of ``w`` ("non-overlapping", docs/method.md#the-hybrid-layer).

    Returns ``(out (B, H, Tq, D), den (B, H, Tq), has_keys (B, H, Tq) bool)``, fp32. ``out`` is 0
    where no key is visible; ``den`` includes the floor (``eps`` times the visible keys). With
    non-negative features ``den >= eps`` wherever a key is visible; with activation ``none`` it
    can be negative, and the division is guarded by clamping it to ``eps`` (the output is then
    not a convex combination of values).

    ``state``: keys that came before ``fk`` (a KV cache's linear-attention state,
    ``models.cache``), visible to every query: ``(S (B, Hkv, F, D), z (B, Hkv, F), count (B,),
    vsum (B, Hkv, D))`` with ``S = sum_i fk_i v_i^T``, ``z = sum_i fk_i``, ``vsum = sum_i v_i``
    over those keys and ``count`` the number of real ones among them. They enter numerator,
    denominator and ``has_keys`` exactly as keys of ``fk`` would. ``None``: no earlier key.

    Memory: one ``(F, D)`` state per chunk and head, plus ``chunk x chunk`` intra-chunk scores.
    """
    B, H, Tq, _ = fq.shape
    Tk = fk.shape[2]
    offset = Tk - Tq
    fk, v = repeat_kv(fk, H).float(), repeat_kv(v, H).float()
    fq = fq.float()
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None].to(fk.dtype)  # (B, 1, Tk, 1)
        fk = fk * keep
        v_real = v * keep  # padded keys' values stay out of the floor's sum
        valid = key_padding_mask[:, None, :].bool()  # (B, 1, Tk)
    else:
        v_real, valid = v, None
    F_, D = fk.shape[-1], v.shape[-1]
    if state is None:
        state = fq.new_zeros(B, H, F_, D)
        zsum = fq.new_zeros(B, H, F_)
        vsum = fq.new_zeros(B, H, D)
        count = torch.zeros(B, 1, dtype=torch.long, device=fq.device)  # visible real keys so far
    else:  # per KV head -> per query head, as fk and v above
        if len(state) != 4:
            raise ValueError("the linear-attention state is (S, z, count, vsum); got "
                             f"{len(state)} tensors (a cache from before the kernel floor?)")
        S0, z0, c0, v0 = state
        state, zsum = repeat_kv(S0.float(), H), repeat_kv(z0.float(), H)
        vsum = repeat_kv(v0.float()[:, :, None], H)[:, :, 0]
        count = c0.reshape(B, 1).long()
    done = 0  # keys [0, done) are in the state
    outs, dens, hits = [], [], []
    for qs in range(0, Tq, chunk):
        qe = min(qs + chunk, Tq)
        a_s, a_e = offset + qs, offset + qe
        # keys visible to *every* query of the chunk: i <= a_s - shift
        full = max(0, min(Tk, a_s - shift + 1))
        if full > done:
            state = state + torch.einsum("bhkf,bhkd->bhfd", fk[:, :, done:full], v[:, :, done:full])
            zsum = zsum + fk[:, :, done:full].sum(dim=2)
            vsum = vsum + v_real[:, :, done:full].sum(dim=2)
            count = count + _count_valid(valid, done, full, B, fq.device)
            done = full
        q_c = fq[:, :, qs:qe]
        num = torch.einsum("bhqf,bhfd->bhqd", q_c, state) + eps * vsum[:, :, None]
        den = torch.einsum("bhqf,bhf->bhq", q_c, zsum)
        n_keys = count.expand(B, qe - qs).clone()  # (B, q)
        # keys seen only by part of the chunk: done <= i <= a_e - 1 - shift
        hi = max(done, min(Tk, a_e - shift))
        if hi > done:
            tpos = torch.arange(a_s, a_e, device=fq.device)[:, None]
            ipos = torch.arange(done, hi, device=fq.device)[None, :]
            vis = (ipos <= tpos - shift).to(fq.dtype)  # (q, k)
            a = torch.einsum("bhqf,bhkf->bhqk", q_c, fk[:, :, done:hi]) * vis
            real = vis[None] if valid is None else vis[None] * valid[:, 0, done:hi][:, None, :]
            num = num + torch.einsum("bhqk,bhkd->bhqd", a, v[:, :, done:hi]) \
                + eps * torch.einsum("bqk,bhkd->bhqd", real, v_real[:, :, done:hi])
            den = den + a.sum(dim=-1)
            n_keys = n_keys + real.sum(dim=-1).long()
        den = den + eps * n_keys[:, None, :].to(den.dtype)  # the floor, once per visible key
        has = (n_keys > 0)[:, None, :].expand(B, H, qe - qs)
        out = num / den.clamp_min(eps)[..., None]
        outs.append(torch.where(has[..., None], out, torch.zeros_like(out)))
        dens.append(den)
        hits.append(has)
    return torch.cat(outs, 2), torch.cat(dens, 2), torch.cat(hits, 2)


def _count_valid(valid: torch.Tensor | None, lo: int, hi: int, B: int, device) -> torch.Tensor:
    if valid is None:
        return torch.full((B, 1), hi - lo, dtype=torch.long, device=device)
    return valid[:, 0, lo:hi].sum(dim=-1, keepdim=True).long()


def kernel_reference(q, k, v, fq, fk, ca, cb, logs, shift, *, window: int, scale: float,
                     eps: float, key_padding_mask=None, has_swa: bool = True, has_la: bool = True,
                     shared: bool = False) -> torch.Tensor:
    """``hybrid_kernel``'s function in plain PyTorch (fp32), built from ``ops.reference``:
    the interpreter tests' oracle and the backward's fallback. Returns (B, H, T, D) fp32."""
    B, H, T, D = q.shape
    swa, lse = softmax_attention_blocked(q, k, v, scale=scale, window=window,
                                             key_padding_mask=key_padding_mask)
    shift = shift.reshape(B, H).to(q.device)
    la = torch.zeros(B, H, T, D, device=q.device)
    den = torch.zeros(B, H, T, device=q.device)
    has = torch.zeros(B, H, T, dtype=torch.bool, device=q.device)
    if has_la:
        for s in sorted({int(x) for x in shift.flatten().tolist()}):
            o_s, d_s, h_s = linear_attention_chunked(fq, fk, v, shift=s, eps=eps,
                                                         key_padding_mask=key_padding_mask)
            sel = (shift == s)[..., None]  # (B, H, 1)
            la = torch.where(sel[..., None], o_s, la)
            den = torch.where(sel, d_s, den)
            has = torch.where(sel, h_s, has)
    if shared:
        alpha = torch.sigmoid(logs.reshape(B, H, 1).float() + lse - torch.log(den.clamp_min(eps)))
        alpha = torch.where(has, alpha, torch.ones_like(alpha))
        alpha = torch.where(torch.isfinite(lse), alpha, torch.zeros_like(alpha))[..., None]
        return alpha * swa + (1 - alpha) * la
    ca, cb = ca.reshape(B, H, 1, 1).float(), cb.reshape(B, H, 1, 1).float()
    out = torch.zeros_like(swa)
    if has_swa:
        out = out + ca * swa
    if has_la:
        out = out + cb * la
    return out

