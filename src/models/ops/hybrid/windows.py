"""Window shapes of the SWA branch, the window's largest logit (LoLCATs' shift) and LA's kernel
mass inside the window (the ``la_mass`` mixer).

Which keys query ``t`` reads with softmax (the window ``W_t``) and with linear attention (the keys
outside it, ``O_t``), for a window / block of ``w`` tokens:

    sliding        W_t = {i : t - w < i <= t}                     O_t = {i : i <= t - w}
    terraced       blocks of w tokens; W_t = the keys of t's block up to t and every key of the
    terraced_end   block before it (w to 2w - 1 keys); O_t = every key of the blocks before those

``sliding`` is the paper's window and LoLCATs' ``lolcats_llama_window_sw``. The two terraced
shapes are LoLCATs' ``lolcats_llama_window_tk`` ("terracing": a 64-token block plus the previous
block), and differ only in where the blocks lie:

    terraced       blocks start at each sequence's first real key (position 0 unpadded): an
                   output never depends on later tokens, and a batch of right-padded sequences
                   gives each the result it gets alone
    terraced_end   blocks end at each sequence's last real key (its last position unpadded), as
                   LoLCATs' quadratic code builds its masks (``get_masks`` in
                   ``linear_window_attention_tk.py``): a block-diagonal matrix of ``ceil(T/w)``
                   blocks, cut to its last ``T`` rows and columns; every output depends on the
                   sequence length, and right padding without an attention mask moves the blocks

Both equal LoLCATs' whenever the length is a multiple of ``w`` (their training sequences: 1024).
Per sequence, "real" keys are those the key padding mask keeps; without a mask every key is real.

One more property of LoLCATs' masks is kept by ``terraced_end`` (it is what their code computes):
a sequence of at most ``w`` real tokens is one block, and ``get_masks`` then adds the block to
its own roll (a ``w x w`` matrix of ones rolled by ``w`` is itself), so the mask holds 2, its
``tril(1 - mask)`` holds -1, which is truthy: every causal key is in the window *and* outside
it, and linear attention covers every causal key. ``terraced`` (our own alignment) has no such
case: its keys outside the window are those of the blocks before the previous one, always.

The functions here are the readable references of the terraced shapes (fp32 accumulation, memory
linear in T, as ``ops.reference``) and of the window's max logit for either shape. No GPU kernel
of ours covers the terraced shapes: ``ops.backends`` routes them here (logged once).
"""

from __future__ import annotations

import torch

from .reference import LA_EPS, repeat_kv

__all__ = [
    "TERRACED",
    "WINDOW_SHAPES",
    "block_anchor",
    "linear_attention_terraced",
    "softmax_attention_terraced",
    "window_keys",
    "window_la_mass",
    "window_max_logit",
]

WINDOW_SHAPES = ("sliding", "terraced", "terraced_end")
TERRACED = ("terraced", "terraced_end")
NEG_INF = float("-inf")


def _check_shape(window_shape: str) -> None:
    if window_shape not in WINDOW_SHAPES:
        raise ValueError(f"unknown window shape {window_shape!r}; valid: "
                         f"{', '.join(WINDOW_SHAPES)}")


def block_anchor(window_shape: str, key_padding_mask: torch.Tensor | None, B: int, Tk: int,
                 device) -> torch.Tensor:
    """(B,) long: a position where a block starts in each row (blocks are
    ``[anchor + j w, anchor + (j + 1) w)`` for every integer ``j``): the first real key
    (``terraced``) or the position after the last real key (``terraced_end``). A row without a
    real key sees nothing, whatever its anchor."""
    if window_shape not in TERRACED:
        raise ValueError(f"block_anchor is for the terraced shapes {TERRACED}, not "
                         f"{window_shape!r}")
    if key_padding_mask is None:
        return torch.full((B,), 0 if window_shape == "terraced" else Tk, dtype=torch.long,
                          device=device)
    real = key_padding_mask.bool()
    pos = torch.arange(Tk, device=device)[None, :]
    if window_shape == "terraced":
        return torch.where(real, pos, Tk).amin(dim=1)  # first real key (Tk when none)
    return torch.where(real, pos + 1, 0).amax(dim=1)  # after the last real key (0 when none)


def _block_index(pos: torch.Tensor, anchor: torch.Tensor, w: int) -> torch.Tensor:
    """(B, n) block of each position (n,) in each row, counted from the anchor (may be < 0)."""
    return torch.div(pos[None, :] - anchor[:, None], w, rounding_mode="floor")


def window_keys(tpos: torch.Tensor, ipos: torch.Tensor, *, window: int, window_shape: str,
                anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Whether key ``ipos[k]`` is in the window of query ``tpos[q]``: (1, q, k) for ``sliding``,
    (B, q, k) for the terraced shapes (``anchor`` (B,) from ``block_anchor``). Causal."""
    _check_shape(window_shape)
    causal = ipos[None, None, :] <= tpos[None, :, None]
    if window_shape == "sliding":
        return causal & (ipos[None, None, :] > tpos[None, :, None] - window)
    bt, bi = _block_index(tpos, anchor, window), _block_index(ipos, anchor, window)
    return causal & (bi[:, None, :] >= bt[:, :, None] - 1)


def _first_key(a_s: int, window: int, window_shape: str) -> int:
    """The earliest key any query at position >= ``a_s`` can see in its window."""
    span = window if window_shape == "sliding" else 2 * window  # a terraced window: < 2w keys
    return max(0, a_s - span + 1)


def _window_blocks(q, k, *, scale, window, window_shape, key_padding_mask, block):
    """Yield ``(qs, qe, lo, hi, scores (B, H, q, k) with -inf outside the window)`` for each
    block of queries (the queries are the last Tq of the Tk keys), fp32; ``lo == hi`` when no
    key is visible to the block."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    offset = Tk - Tq
    anchor = (None if window_shape == "sliding"
              else block_anchor(window_shape, key_padding_mask, B, Tk, q.device))
    k, q = repeat_kv(k, H).float(), q.float()
    for qs in range(0, Tq, block):
        qe = min(qs + block, Tq)
        a_s, a_e = offset + qs, offset + qe
        lo, hi = _first_key(a_s, window, window_shape), a_e
        s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, qs:qe], k[:, :, lo:hi]) * scale
        tpos = torch.arange(a_s, a_e, device=q.device)
        ipos = torch.arange(lo, hi, device=q.device)
        allowed = window_keys(tpos, ipos, window=window, window_shape=window_shape,
                              anchor=anchor)[:, None]  # (B|1, 1, q, k)
        if key_padding_mask is not None:
            allowed = allowed & key_padding_mask[:, None, None, lo:hi].bool()
        yield qs, qe, lo, hi, s.masked_fill(~allowed, NEG_INF)


def softmax_attention_terraced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    window: int,
    window_shape: str = "terraced",
    key_padding_mask: torch.Tensor | None = None,
    block: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the terraced window (module docstring), one query block at a time.

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D), the queries being the last Tq positions.
    Returns ``(out (B, H, Tq, D) fp32, lse (B, H, Tq) fp32)``, as
    ``reference.softmax_attention_blocked``: 0 and ``-inf`` where no key is visible.
    Memory ``O(Tq * (block + 2 window))``.
    """
    if window_shape not in TERRACED:
        raise ValueError(f"softmax_attention_terraced takes {TERRACED}, not {window_shape!r}")
    H = q.shape[1]
    v = repeat_kv(v, H).float()
    outs, lses = [], []
    for _, _, lo, hi, s in _window_blocks(q, k, scale=scale, window=window,
                                          window_shape=window_shape,
                                          key_padding_mask=key_padding_mask, block=block):
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.exp(s - m)  # 0 outside the window
        den = p.sum(dim=-1, keepdim=True)  # (B, H, q, 1)
        out = torch.einsum("bhqk,bhkd->bhqd", p, v[:, :, lo:hi])
        outs.append(torch.where(den > 0, out / den.clamp_min(1e-30), torch.zeros_like(out)))
        lses.append((m + torch.log(den)).squeeze(-1))  # -inf where nothing is visible
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def window_max_logit(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    window: int,
    window_shape: str = "sliding",
    key_padding_mask: torch.Tensor | None = None,
    block: int = 128,
) -> torch.Tensor:
    """``m_t = max_{i in W_t} q_t . k_i * scale``: (B, H, Tq) fp32, ``-inf`` where the window
    holds no real key. Differentiable (``amax``: the gradient goes to the largest logit, split
    evenly among ties), as LoLCATs' ``torch.amax`` over the masked scores.

    LoLCATs' hybrid subtracts it from the window's softmax scores but not from the linear
    attention scores (``ops.hybrid``, ``shared_norm="window_max"``), so it changes their
    output and is part of the formula, not only of its numerics. Pure PyTorch on any device;
    memory as ``softmax_attention_terraced``."""
    _check_shape(window_shape)
    return torch.cat([s.amax(dim=-1) for *_, s in _window_blocks(
        q, k, scale=scale, window=window, window_shape=window_shape,
        key_padding_mask=key_padding_mask, block=block)], dim=2)


def window_la_mass(
    fq: torch.Tensor,
    fk: torch.Tensor,
    *,
    window: int,
    window_shape: str = "sliding",
    key_padding_mask: torch.Tensor | None = None,
    eps: float = LA_EPS,
    block: int = 128,
) -> torch.Tensor:
    """``Z_t = sum_{i in W_t} (fq_t . fk_i + eps)`` over the window's real keys: (B, H, Tq)
    fp32, 0 where the window holds no real key. The same kernel values, floor included, as LA's
    normaliser over the keys outside the window (``reference.linear_attention_chunked``), so
    ``Z_t / (Z_t + den_t)`` is the share of LA's kernel mass over every causal key that lies in
    the window (the ``la_mass`` mixer, ``attention``). fq: (B, H, Tq, F); fk: (B, Hkv or H,
    Tk, F), the queries being the last Tq keys. Differentiable; pure PyTorch on any device,
    memory as ``window_max_logit``."""
    _check_shape(window_shape)
    return torch.cat([torch.where(torch.isfinite(s), s + eps, torch.zeros_like(s)).sum(dim=-1)
                      for *_, s in _window_blocks(fq, fk, scale=1.0, window=window,
                                                  window_shape=window_shape,
                                                  key_padding_mask=key_padding_mask,
                                                  block=block)], dim=2)


def outside_limit(window_shape: str, window: int, key_padding_mask: torch.Tensor | None,
                  B: int, Tq: int, Tk: int, device) -> torch.Tensor:
    """(B, Tq) long: query ``t`` (the last Tq of Tk positions) sees with linear attention the
    keys ``i < limit[b, t]``: those of the blocks before the previous one (terraced shapes);
    for ``terraced_end``, every causal key in a sequence of at most ``window`` real tokens
    (LoLCATs' one-block case, module docstring)."""
    anchor = block_anchor(window_shape, key_padding_mask, B, Tk, device)
    tpos = torch.arange(Tk - Tq, Tk, device=device)
    limit = anchor[:, None] + (_block_index(tpos, anchor, window) - 1) * window  # (B, Tq)
    if window_shape == "terraced_end":
        n_real = (torch.full((B,), Tk, device=device) if key_padding_mask is None
                  else key_padding_mask.bool().sum(dim=1))
        one_block = (n_real <= window)[:, None]
        limit = torch.where(one_block, (tpos + 1)[None, :], limit)
    return limit.clamp(0, Tk)


def linear_attention_terraced(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    window_shape: str = "terraced",
    key_padding_mask: torch.Tensor | None = None,
    eps: float = LA_EPS,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normalised linear attention over the keys outside the terraced window,

        o_t = sum_{i in O_t} (fq_t . fk_i + eps) v_i / sum_{i in O_t} (fq_t . fk_i + eps),

    ``O_t = {i < limit_t}`` (``outside_limit``: every key of the blocks before the previous one),
    real keys only; ``eps`` is the kernel floor of the sliding reference
    (``reference.linear_attention_chunked``), applied the same way; ``reference.DEN_TINY`` makes
    it vanish (LoLCATs' conversions have no floor).

    fq: (B, H, Tq, F); fk: (B, Hkv or H, Tk, F); v: (B, Hkv, Tk, D). Returns ``(out (B, H, Tq, D),
    den (B, H, Tq), has_keys (B, H, Tq) bool)``, fp32, as ``reference.linear_attention_chunked``
    (0 where no real key is visible; ``den`` includes the floor and is clamped to ``eps`` before
    dividing).

    Queries run in chunks; a running state holds the keys every query of a chunk sees (in every
    row), and the few keys only some of them see are added with an explicit mask. Memory: one
    ``(F, D)`` state per head plus ``chunk x (chunk + 2 window)`` scores.
    """
    if window_shape not in TERRACED:
        raise ValueError(f"linear_attention_terraced takes {TERRACED}, not {window_shape!r}")
    B, H, Tq, _ = fq.shape
    Tk = fk.shape[2]
    fk, v, fq = repeat_kv(fk, H).float(), repeat_kv(v, H).float(), fq.float()
    if key_padding_mask is not None:
        real = key_padding_mask.bool()  # (B, Tk)
        keep = real[:, None, :, None].to(fk.dtype)
        fk, v_real = fk * keep, v * keep  # padded keys add nothing, floor included
    else:
        real = torch.ones(B, Tk, dtype=torch.bool, device=fq.device)
        v_real = v
    limit = outside_limit(window_shape, window, key_padding_mask, B, Tq, Tk, fq.device)  # (B, Tq)
    # real keys before each limit: has_keys without a loop
    n_before = torch.nn.functional.pad(real.long().cumsum(dim=1), (1, 0))  # (B, Tk + 1)
    n_keys = n_before.gather(1, limit)  # (B, Tq) real keys each query sees
    has = (n_keys > 0)[:, None, :].expand(B, H, Tq)

    state = fq.new_zeros(B, H, fq.shape[-1], v.shape[-1])
    zsum = fq.new_zeros(B, H, fq.shape[-1])
    vsum = fq.new_zeros(B, H, v.shape[-1])  # sum of the state's values: the floor's numerator
    done = 0  # keys [0, done) are in the state
    outs, dens = [], []
    for qs in range(0, Tq, chunk):
        qe = min(qs + chunk, Tq)
        lim = limit[:, qs:qe]  # (B, q), non-decreasing along the queries
        full = int(lim.min())  # keys every query of the chunk sees, in every row
        if full > done:
            state = state + torch.einsum("bhkf,bhkd->bhfd", fk[:, :, done:full], v[:, :, done:full])
            zsum = zsum + fk[:, :, done:full].sum(dim=2)
            vsum = vsum + v_real[:, :, done:full].sum(dim=2)
            done = full
        q_c = fq[:, :, qs:qe]
        num = torch.einsum("bhqf,bhfd->bhqd", q_c, state) + eps * vsum[:, :, None]
        den = torch.einsum("bhqf,bhf->bhq", q_c, zsum)
        hi = int(lim.max())
        if hi > done:  # keys [done, hi) that only some queries see
            ipos = torch.arange(done, hi, device=fq.device)
            vis = (ipos[None, None, :] < lim[:, :, None]).to(fq.dtype)[:, None]  # (B, 1, q, k)
            a = torch.einsum("bhqf,bhkf->bhqk", q_c, fk[:, :, done:hi]) * vis
            num = num + torch.einsum("bhqk,bhkd->bhqd", a + eps * vis, v_real[:, :, done:hi])
            den = den + a.sum(dim=-1)
        den = den + eps * n_keys[:, None, qs:qe].to(den.dtype)  # the floor, once per visible key
        out = num / den.clamp_min(eps)[..., None]
        outs.append(out)
        dens.append(den)
    out = torch.cat(outs, 2)
    return torch.where(has[..., None], out, torch.zeros_like(out)), torch.cat(dens, 2), has
