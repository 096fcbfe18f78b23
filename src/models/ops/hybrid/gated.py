"""The fused hybrid kernels for an output-gate mixer (a g per position and channel): a kernel
call per branch at weight 1, mixed in PyTorch."""

from __future__ import annotations

import torch

from ..instrument import TRACE
from .function import _filled, _launch


def _no_features(q, k):
    """Stand-ins for fq and fk in a call that runs no LA (``has_la=False``: the kernels read
    neither): (B, H, T, D) and (B, Hkv, T, D) views of one cached row, nothing allocated, no
    feature map run (the LA's F does not enter such a call's tiles: ``default_config``)."""
    (B, H, T, D), Hkv = q.shape, k.shape[1]
    row = _filled((1, 1, 1, D), 0.0, q.dtype, q.device)
    return row.expand(B, H, T, D), row.expand(B, Hkv, T, D)


def _gated(q, k, v, fq, fk, g, *, mode, rescale, drop, shift0, shift_la_only, window, scale,
           eps, kpm, config, maps):
    """``fused_hybrid`` for a g that varies over positions or channels (an output-gate mixer:
    ``w_swa = g``, ``w_la = 1 - g`` per element, which the kernels' per-head weights cannot
    carry): ``w_swa * SWA + w_la * LA`` with each branch from its own kernel call at weight 1
    (SWA: ``has_la=False``, no features; LA: ``has_swa=False``, the maps folded into it where
    they are), mixed here in PyTorch, which also gives g's gradient. SSD (``drop``, per (b, h)):
    a dropped head's SWA call weight is 0 and its LA call sees ``la_only``'s keys
    (``shift_la_only``), weighted as ``la_only`` weighs them. ``None`` where a kernel call
    declines (the caller's pieces then compute the whole call).

    The branch calls at weight 1 (the SWA call without SSD, the LA call of ``hybrid`` and
    ``la_only``) save their output as their branch (``hybrid_kernel``'s ``output_is_branch``):
    each branch is held once, by the gate's mix (its lerp saves both), instead of also as the
    kernel's own saved copy (~1 GiB less at 1 x 64k on the 8B's heads), and the forward stores
    neither; bit for bit the results of calls storing a copy (tested)."""
    B, H = q.shape[:2]
    f32, dev = torch.float32, q.device
    zeros, one = _filled((B, H), 0.0, f32, dev), _filled((B, H), 1.0, f32, dev)
    swa = la = None
    if mode in ("hybrid", "swa_only"):
        ca = one if drop is None else torch.where(drop, zeros, one)
        swa = _launch(q, k, v, *_no_features(q, k), ca, zeros, zeros,
                      _filled((B, H), shift0, torch.int32, dev), window, scale, eps, kpm,
                      True, False, False, config,
                      output_is_branch=drop is None)
        if swa is None:
            return None
    if mode != "swa_only" or drop is not None:
        if mode == "la_only":
            cb, shift = one, _filled((B, H), shift_la_only, torch.int32, dev)
        else:  # (a kept head's LA in the hybrid, none in swa_only; a dropped head's la_only)
            cb = one if mode == "hybrid" else torch.where(drop, one, zeros)
            shift = _filled((B, H), shift0, torch.int32, dev)
            if drop is not None:
                shift = torch.where(drop, torch.full_like(shift, shift_la_only), shift)
        la = _launch(q, k, v, fq, fk, zeros, cb, zeros, shift, window, scale, eps, kpm,
                     False, True, False, config, maps,
                     output_is_branch=mode != "swa_only")
        # (cb is 1 for every head in hybrid and la_only; in swa_only only a dropped head's)
        if la is None:
            return None
    TRACE.count("hybrid.gated")
    # (one op where it can be: each rounds once. A dropped head's SWA and a kept head's LA in
    # swa_only are 0, so the same formulas hold for every head)
    if mode == "la_only":
        return la if rescale else la * (1 - g)
    if la is None:  # swa_only, no drops
        return swa if rescale else swa * g
    if rescale and mode == "swa_only":
        return swa + la
    if rescale and drop is not None:  # (a dropped head's LA at weight 1, as la_only's rescale)
        g = torch.where(drop[:, :, None, None], 0.0, g)
    # w_swa SWA + w_la LA = LA + g (SWA - LA); a g in another dtype than the branches' (an fp32
    # g on a bf16 call) mixes in fp32, SWA - LA not rounded first
    if g.dtype == la.dtype:
        return torch.lerp(la, swa, g)
    return torch.lerp(la.float(), swa.float(), g.float())

