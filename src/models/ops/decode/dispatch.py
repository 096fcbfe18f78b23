"""Whether the fused decode step (``kernels``) takes a call, and the call: ``decode_step``.

The one place that decides: ``unsupported_reason`` says why the kernels cannot take a step
(``None``: they can); the composed step (``models.cache._step``, the reference) then computes
the same function (``note_fallback`` logs the reason once: a fallback that changes only speed).
Calls they do not cover: ``overlap`` / ``la_span="all"`` (LA reading the ring's keys),
LoLCATs' max-shifted shared norm, SSD's dropout in training, ``sinks_only`` / ``none``, fp32 on
CUDA, non-power-of-two shapes.
"""

from __future__ import annotations

import torch

from ..instrument import TRACE
from ..triton_common import errors, interpret, launch_reason, pow2, warn_once
from .kernels import MODES, launch_main, launch_post

__all__ = ["decode_step", "note_fallback", "unsupported_reason"]


def unsupported_reason(layer, query, key, fq, *, mode: str, shared_norm, overlap: bool,
                       la_span: str, swa_drop, g) -> str | None:
    """Why the fused step cannot take this call (the composed step then runs), or ``None``."""
    reason = launch_reason(query)
    if reason is not None:
        return reason
    if mode not in MODES:
        return f"mode {mode!r} (the fused step computes {', '.join(MODES)})"
    if overlap or (mode == "la_only" and la_span == "all"):
        return "LA reading the window's keys (overlap / la_span='all')"
    if shared_norm not in (False, True):
        return f"shared_norm={shared_norm!r} (the step computes the unshifted shared norm only)"
    if swa_drop is not None:
        return "SSD's sliding-window dropout (training)"
    if fq is None:
        return "no query features"
    if query.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"dtype {query.dtype} (the kernels take bf16, fp16, fp32)"
    if query.dtype == torch.float32 and not interpret():
        # a decode run reads 4e-4 from the fp32 references in LA-heavy cases on an H200, where
        # one fused step from a random state is 3.7e-7 from a float64 oracle
        # (experiments/decode_precision.py): not the step's arithmetic, and not explained, so
        # fp32 models keep the composed step on CUDA; the interpreter (exact fp32) checks the
        # algorithm to 2e-7 (tests/triton_interpreter_check.py)
        return "fp32 on CUDA (an unexplained 4e-4 from the fp32 reference, measured on an H200)"
    B, H, T, D = query.shape
    Hkv = key.shape[1]
    F = fq.shape[-1]
    if T != 1 or H % Hkv:
        return "not one new token per sequence"
    if not (pow2(D) and 16 <= D <= 256):
        return f"head dim {D} (powers of two in [16, 256])"
    if not (pow2(F) and 16 <= F <= 1024):
        return f"feature dim {F} (powers of two in [16, 1024])"
    if layer.window > 1024:
        return f"window {layer.window} (at most 1024 keys in the ring)"
    for name in ("keys", "values", "real", "S", "z", "vsum", "sink_keys", "sink_values"):
        if not getattr(layer, name).is_contiguous():
            return f"the cache's {name} is not contiguous"
    if layer.values.shape[-1] != D:
        return "value head dim differs from the key head dim"
    if torch.is_tensor(g) and g.dim() != 4:
        return f"mixer output of shape {tuple(g.shape)}"
    return None


def decode_step(layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                fq: torch.Tensor, fk_old: torch.Tensor, real: torch.Tensor | None, *,
                mode: str, g, shared_norm: bool, rescale: bool, scale: float,
                eps: float) -> torch.Tensor | None:
    """The fused step (``kernels``) for a call ``unsupported_reason`` accepts. ``query``
    (B, H, 1, D), ``key`` / ``value`` (B, Hkv, 1, D) of the new token, ``fq`` (B, H, 1, F) =
    phi_q(query), ``fk_old`` (B, Hkv, 1, F) = phi_k of the key in ring slot ``pos % w``;
    ``real`` (B,) bool for the new keys or None (all real). Advances the cache's device tensors
    (not ``layer.seen``). Returns (B, H, 1, D) in query's dtype, a view of a (B, 1, H, D)
    contiguous tensor; ``None`` (cache untouched, the fallback recorded) if the main kernel does
    not compile or fit here."""
    try:
        out = launch_main(layer, query, key, value, fq, fk_old, real, mode=mode, g=g,
                          shared_norm=shared_norm, rescale=rescale, scale=scale, eps=eps)
    except errors() as e:
        TRACE.fallback("decode", "decode step", e,
                       "composing the step's pieces (same function, slower)")
        return None
    launch_post(layer, real)
    TRACE.count("decode.step")
    return out


def note_fallback(reason: str) -> None:
    """Say once that a step takes the composed path, and why."""
    warn_once(__name__, f"fused decode step not used: {reason}; composing the step's pieces "
                        f"(same function, slower)")
