"""Whether the transfer losses' kernels take a call, and the calls: ``weights_xent`` (the fused
cross-entropy, ``xent``) and ``masked_mse`` (the output MSE, ``mse``).

The one place that decides for each: ``xent_unsupported_reason`` / ``mse_unsupported_reason``
say why the kernels cannot take a call (``None``: they can). Where they cannot, or their
forward does not compile or fit here (Triton's resource and compile errors: recorded with
``TRACE.fallback``), the PyTorch reference (``reference``) computes the same function. A
refusal of a CUDA call the kernels were expected to take is logged once.
"""

from __future__ import annotations

import torch

from ..hybrid.reference import LA_EPS
from ..instrument import TRACE
from ..triton_common import (GRID_AXIS_MAX, available, errors, interpret, launch_reason, pow2,
                             switched_on, warn_once)
from . import reference
from .mse import mse_kernel
from .xent import xent_rows

__all__ = ["masked_mse", "mse_unsupported_reason", "weights_xent", "xent_unsupported_reason"]


def _refused(what: str, reason: str, x: torch.Tensor, instead: str) -> None:
    """Say once why a CUDA call (or one under the interpreter) did not take the kernels."""
    if switched_on() and available() and (x.is_cuda or interpret()):
        warn_once(__name__, f"fused {what} not used: {reason}; {instead}")


def xent_unsupported_reason(q, k, fq, fk) -> str | None:
    """Why the fused cross-entropy cannot take q (B, H, T, D), k (B, Hkv, T, D), fq (B, H, T,
    F), fk (B, Hkv, T, F) (``None``: it can): the kernel takes bf16 or fp32, head dims powers of
    two in [16, 128], feature dims in [16, 256], at most ``GRID_AXIS_MAX`` batch x heads."""
    reason = launch_reason(q)
    if reason is not None:
        return reason
    if q.dtype != k.dtype or fq.dtype != fk.dtype:
        return f"q/k dtypes {q.dtype}/{k.dtype} or fq/fk dtypes {fq.dtype}/{fk.dtype} differ"
    for x in (q, fq):
        if x.dtype not in (torch.bfloat16, torch.float32):
            return f"dtype {x.dtype} (the kernel takes bf16 and fp32)"
    B, H, T, D = q.shape
    F = fq.shape[-1]
    if k.shape[2] != T or fk.shape[2] != T or fk.shape[1] != k.shape[1] or H % k.shape[1]:
        return "q, k, fq, fk shapes do not match"
    if not (pow2(D) and 16 <= D <= 128):
        return f"head dim {D} (powers of two in [16, 128])"
    if not (pow2(F) and 16 <= F <= 256):
        return f"feature dim {F} (powers of two in [16, 256])"
    if B * H > GRID_AXIS_MAX:
        return (f"batch x heads = {B * H} (the kernels' second grid axis holds at most "
                f"{GRID_AXIS_MAX})")
    if T == 0:
        return "empty sequence"
    return None


def weights_xent(q: torch.Tensor, k: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, *,
                 scale: float | None = None, key_padding_mask: torch.Tensor | None = None,
                 block: int = 64, return_entropy: bool = False, eps: float = LA_EPS
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``reference.weights_xent`` (same arguments and result) through the fused kernel where
    it takes the call, else the blocked PyTorch version (``block``: its query block; the
    kernel ignores it). ``eps``: the kernel floor."""
    kw = dict(scale=scale, key_padding_mask=key_padding_mask, block=block,
              return_entropy=return_entropy, eps=eps)
    instead = "running the blocked PyTorch version"
    reason = xent_unsupported_reason(q, k, fq, fk)
    if reason is not None:
        _refused("weights_xent", reason, q, instead)
        return reference.weights_xent(q, k, fq, fk, **kw)
    B, H, T, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    try:
        xe, ent = xent_rows(q, k, fq, fk, scale=scale, key_padding_mask=key_padding_mask,
                            eps=eps)
    except errors() as e:
        TRACE.fallback("transfer.xent", "weights_xent", e, instead)
        return reference.weights_xent(q, k, fq, fk, **kw)
    TRACE.count("transfer.xent.forward")
    if key_padding_mask is None:
        norm = float(B * T * H)
        total, total_ent = xe.sum(), ent.sum()
    else:
        real = key_padding_mask.bool()[:, None, :].float()  # padded queries do not count
        norm = real.sum().clamp_min(1.0) * H
        total, total_ent = (xe * real).sum(), (ent * real).sum()
    if return_entropy:
        return total / norm, (total_ent / norm).detach()
    return total / norm


def mse_unsupported_reason(student: torch.Tensor, teacher: torch.Tensor, kpm) -> str | None:
    """Why the output-MSE kernels cannot take these (B, H, T, D) tensors and key padding mask
    (B, T) (``None``: they can): not 4-D, shapes that differ, not floating point, head dims
    above 256, more than ``GRID_AXIS_MAX`` batch x heads."""
    reason = launch_reason(student)
    if reason is not None:
        return reason
    if not ((student.is_cuda and teacher.is_cuda) or interpret()):
        return "the kernels run on CUDA tensors"
    if student.dim() != 4 or student.shape != teacher.shape:
        return (f"shapes {tuple(student.shape)} and {tuple(teacher.shape)} (the kernels take two "
                "(B, H, T, D) tensors of one shape)")
    if not (student.is_floating_point() and teacher.is_floating_point()):
        return f"dtypes {student.dtype}, {teacher.dtype}"
    B, H, T, D = student.shape
    if D > 256 or D == 0 or T == 0:
        return f"head dim {D}, length {T} (the kernels take 1 <= D <= 256, T >= 1)"
    if B * H > GRID_AXIS_MAX:
        return f"batch x heads = {B * H} (at most {GRID_AXIS_MAX})"
    if kpm is not None and tuple(kpm.shape) != (B, T):
        return f"a key padding mask of shape {tuple(kpm.shape)} (want {(B, T)})"
    return None


def masked_mse(student: torch.Tensor, teacher: torch.Tensor,
               key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``reference.masked_mse_reference`` (same arguments and value, an fp32 scalar) through
    the kernels where they take the call, else the reference; differentiable in both
    tensors."""
    reason = mse_unsupported_reason(student, teacher, key_padding_mask)
    if reason is not None:
        _refused("output MSE", reason, student, "running PyTorch")
        return reference.masked_mse_reference(student, teacher, key_padding_mask)
    try:
        loss = mse_kernel(student, teacher, key_padding_mask)
    except errors() as e:
        TRACE.fallback("transfer.mse", "output MSE", e, "running PyTorch")
        return reference.masked_mse_reference(student, teacher, key_padding_mask)
    TRACE.count("transfer.mse.forward")
    return loss
