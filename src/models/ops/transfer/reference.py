"""The attention-transfer objectives' losses in plain PyTorch: the CPU path, what the kernels
compute (``xent``, ``mse``) and the tests' oracle.

    weights_xent         -sum_t sum_{i<=t} A_soft[t,i] log A_phi[t,i]   (HedgeHog; summed over
                         keys, averaged over real queries and heads), A_phi[t,i] = k_ti /
                         sum_{j<=t} k_tj, k_ti = fq_t.fk_i + eps
    masked_mse_reference sum (student - teacher)^2 / (real queries x H x D)

``weights_xent`` is quadratic in T. It runs over query blocks, and each block is recomputed in
the backward pass (``torch.utils.checkpoint``), so at most one ``(B, H, block, T)`` score tile is
alive at a time: peak memory is ``O(B H block T)``, independent of the number of layers when the
caller backpropagates each layer's loss as soon as it has it. ``losses`` explains why numerator
and normaliser share the kernel values.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..hybrid.reference import DEN_TINY, LA_EPS, repeat_kv

__all__ = ["TINY", "la_log_weights", "masked_mse_reference", "weights_xent"]

#: fp32's smallest normal number: keeps the log of a non-positive kernel value (activation
#: ``none``) finite; the kernel floor itself is the layer's ``eps`` (``hybrid.reference.LA_EPS``)
TINY = DEN_TINY


def la_log_weights(fq: torch.Tensor, fk: torch.Tensor, allowed: torch.Tensor,
                   eps: float = LA_EPS) -> torch.Tensor:
    """``log A_phi`` over keys: ``log k_ti - log sum_{j allowed} k_tj``, ``k = fq.fk + eps``.

    fq (B, H, q, F), fk (B, H, k, F) (heads already repeated), allowed (B|1, 1|H, q, k) bool.
    Returns (B, H, q, k) fp32, 0 where not allowed (so ``0 * log`` terms vanish; a row with no
    allowed key is all 0). The same kernel values form the numerator and the sum, so ``exp`` of a
    row is a distribution whatever the magnitudes (``TINY`` only keeps the log of a negative
    product, activation ``none``, finite).
    """
    a = (torch.einsum("bhqf,bhkf->bhqk", fq.float(), fk.float()) + eps).clamp_min(TINY)
    a = a.masked_fill(~allowed, 0.0)
    log_den = torch.log(a.sum(dim=-1, keepdim=True).clamp_min(TINY))  # TINY: rows with no key
    return torch.where(allowed, torch.log(a.clamp_min(TINY)) - log_den, torch.zeros_like(a))


def _xent_block(q_blk, k, fq_blk, fk, qpos, kpm, scale: float, eps: float = LA_EPS):
    """Summed cross-entropy and teacher entropy of one query block. q_blk (B,H,b,D),
    k (B,H,Tk,D), fq_blk (B,H,b,F), fk (B,H,Tk,F), qpos (b,) absolute positions, kpm (B,Tk)
    bool or None. Returns ``(xent_sum, entropy_sum)``, the entropy without gradient."""
    Tk = k.shape[2]
    allowed = torch.arange(Tk, device=q_blk.device)[None, :] <= qpos[:, None]  # (b, Tk)
    allowed = allowed[None, None]  # (1, 1, b, Tk)
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    with torch.no_grad():  # the teacher: detached
        s = torch.einsum("bhqd,bhkd->bhqk", q_blk.float(), k.float()) * scale
        log_soft = torch.log_softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        a_soft = torch.exp(log_soft).nan_to_num(0.0)  # a query with no visible key (padding)
        ent = -(a_soft * torch.where(allowed, log_soft, torch.zeros_like(log_soft))).sum(-1)
    xent = -(a_soft * la_log_weights(fq_blk, fk, allowed, eps)).sum(dim=-1)  # (B, H, b)
    if kpm is not None:  # padded queries do not count
        real = kpm[:, None, qpos].to(xent.dtype)
        xent, ent = xent * real, ent * real
    return xent.sum(), ent.sum()


def weights_xent(q: torch.Tensor, k: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, *,
                 scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                 block: int = 64, return_entropy: bool = False, eps: float = LA_EPS
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """HedgeHog attention-weight cross-entropy, blocked over queries (see the module docstring).

    Args: q (B, H, T, D), k (B, Hkv, T, D) with RoPE; fq (B, H, T, F), fk (B, Hkv, T, F);
    key_padding_mask (B, T) bool, True = real. Only ``fq`` and ``fk`` receive gradients.
    Returns the mean over real queries and heads of ``-sum_i A_soft log A_phi``; with
    ``return_entropy`` also the same mean of the teacher's entropy ``-sum_i A_soft log A_soft``
    (a detached lower bound of the first: their difference is the KL divergence). ``eps``: the
    kernel floor (``hybrid.reference.LA_EPS``; the layer's ``eps`` through
    ``losses.transfer_loss``).
    """
    B, H, T, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    k, fk = repeat_kv(k.detach(), H), repeat_kv(fk, H)
    q = q.detach()
    kpm = None if key_padding_mask is None else key_padding_mask.bool()
    total = fq.new_zeros((), dtype=torch.float32)
    entropy = fq.new_zeros((), dtype=torch.float32)
    for qs in range(0, T, block):
        qe = min(qs + block, T)
        qpos = torch.arange(qs, qe, device=q.device)
        args = (q[:, :, qs:qe], k[:, :, :qe], fq[:, :, qs:qe], fk[:, :, :qe], qpos,
                None if kpm is None else kpm[:, :qe], scale, eps)
        if torch.is_grad_enabled() and (fq.requires_grad or fk.requires_grad):
            x, e = checkpoint(_xent_block, *args, use_reentrant=False)
        else:
            x, e = _xent_block(*args)
        total, entropy = total + x, entropy + e
    norm = _n_queries(kpm, B, T, device=q.device) * H
    if return_entropy:
        return total / norm, entropy.detach() / norm
    return total / norm


def _n_queries(kpm, B: int, T: int, device) -> torch.Tensor:
    if kpm is None:
        return torch.tensor(float(B * T), device=device)
    return kpm.sum().float().clamp_min(1.0)


def masked_mse_reference(student: torch.Tensor, teacher: torch.Tensor, kpm) -> torch.Tensor:
    """``sum (student - teacher)^2`` over real queries (``kpm`` (B, T), True for real; None:
    all) / (real queries x H x D), in fp32, for (B, H, T, D) tensors: the output-MSE
    objectives' loss in PyTorch (the CPU path and ``mse``'s oracle). Padded rows
    are selected away before the difference, so a teacher row left undefined there (NaN)
    reaches neither the loss nor a gradient (a product with 0 would pass a NaN on)."""
    diff = student.float() - teacher.float()  # (B, H, T, D)
    if kpm is None:
        return diff.pow(2).mean()
    diff = torch.where(kpm.bool()[:, None, :, None], diff, 0.0)
    H, D = diff.shape[1], diff.shape[3]
    # the floor only acts for a batch of padding alone (loss 0 then, rather than 0/0)
    return diff.pow(2).sum() / (kpm.sum(dtype=torch.float32) * (H * D)).clamp_min(1.0)
