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
    "default_eps",
    "repeat_kv",
    "softmax_attention_blocked",
    "linear_attention_chunked",
]

NEG_INF = float("-inf")

#: the LA denominator guard of the non-negative feature maps: fp32's smallest normal number.
#: Their denominator is a sum of products >= 0, positive whenever a key is visible, so a floor
#: this small only catches an underflow and never changes a normalised weight: inference then
#: uses exactly the normalised weights that the ``weights_xent`` objective trains
#: (``ops.transfer``). A floor such as 1e-6 would rescale every row whose products are small,
#: and such rows are legitimate: the normalised weights do not depend on the products' scale.
DEN_TINY = torch.finfo(torch.float32).tiny


def default_eps(activation: str) -> float:
    """The LA denominator guard for a feature-map activation: ``DEN_TINY`` for the non-negative
    maps, 1e-6 for ``none``, whose features (and so denominators) can be negative or zero: its
    normalised weights are not a distribution, and the guard only keeps the division finite."""
    return 1e-6 if activation == "none" else DEN_TINY


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
    eps: float = DEN_TINY,
    chunk: int = 64,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised causal linear attention over keys ``i <= t - shift``.

        o_t = sum_i (fq_t . fk_i) v_i / sum_i (fq_t . fk_i)

    ``shift = 0`` is ordinary causal LA (all causal keys, "overlapping"); ``shift = w`` sees only
    keys outside a window of ``w`` ("non-overlapping", docs/method.md#the-hybrid-layer).

    Returns ``(out (B, H, Tq, D), den (B, H, Tq), has_keys (B, H, Tq) bool)``, fp32. ``out`` is 0
    where no key is visible. The denominator is clamped to ``eps`` before dividing (see
    ``DEN_TINY`` and ``default_eps``: an underflow guard for the non-negative maps, a finite
    guard for ``activation="none"`` whose features can be negative, when the output is not a
    convex combination of values).

    ``state``: keys that came before ``fk`` (a KV cache's linear-attention state,
    ``models.cache``), visible to every query: ``(S (B, Hkv, F, D), z (B, Hkv, F), count (B,))``
    with ``S = sum_i fk_i v_i^T``, ``z = sum_i fk_i`` over those keys and ``count`` the number of
    real ones among them. They enter numerator, denominator and ``has_keys`` exactly as keys of
    ``fk`` would. ``None``: no earlier key.

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
        valid = key_padding_mask[:, None, :].bool()  # (B, 1, Tk)
    else:
        valid = None
    F_, D = fk.shape[-1], v.shape[-1]
    if state is None:
        state = fq.new_zeros(B, H, F_, D)
        zsum = fq.new_zeros(B, H, F_)
        count = torch.zeros(B, 1, dtype=torch.long, device=fq.device)  # visible real keys so far
    else:  # per KV head -> per query head, as fk and v above
        S0, z0, c0 = state
        state, zsum = repeat_kv(S0.float(), H), repeat_kv(z0.float(), H)
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
            count = count + _count_valid(valid, done, full, B, fq.device)
            done = full
        q_c = fq[:, :, qs:qe]
        num = torch.einsum("bhqf,bhfd->bhqd", q_c, state)
        den = torch.einsum("bhqf,bhf->bhq", q_c, zsum)
        n_keys = count.expand(B, qe - qs).clone()  # (B, q)
        # keys seen only by part of the chunk: done <= i <= a_e - 1 - shift
        hi = max(done, min(Tk, a_e - shift))
        if hi > done:
            tpos = torch.arange(a_s, a_e, device=fq.device)[:, None]
            ipos = torch.arange(done, hi, device=fq.device)[None, :]
            vis = (ipos <= tpos - shift).to(fq.dtype)  # (q, k)
            a = torch.einsum("bhqf,bhkf->bhqk", q_c, fk[:, :, done:hi]) * vis
            num = num + torch.einsum("bhqk,bhkd->bhqd", a, v[:, :, done:hi])
            den = den + a.sum(dim=-1)
            real = vis[None] if valid is None else vis[None] * valid[:, 0, done:hi][:, None, :]
            n_keys = n_keys + real.sum(dim=-1).long()
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
