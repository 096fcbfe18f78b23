"""Whether the fused feature map takes a call, and the call: ``hedgehog_features``.

The one place that decides: ``unsupported_reason`` says why the kernels cannot take a call
(``None``: they can); ``hedgehog_features`` then runs them, or returns ``None`` (the reason
logged once where the fast path was expected) and the caller computes the map itself. A kernel
that does not compile or fit here (Triton's resource and compile errors) is recorded
(``TRACE.fallback``) and the caller's PyTorch path runs: the same function. Wiring
(``models.feature_maps.HedgehogFeatureMap``)::

    out = dispatch.hedgehog_features(x, self.weight, self.bias, self.activation)
    if out is not None:
        return out
"""

from __future__ import annotations

import torch

from ..instrument import TRACE
from ..triton_common import (available, errors, interpret, launch_reason, pow2, switched_on,
                             warn_once)
from .function import DuSlot, MapFn, MapWithInputFn
from .reference import ACTIVATIONS

__all__ = ["hedgehog_features", "unsupported_reason"]


def unsupported_reason(x, weight, bias, activation: str) -> str | None:
    """Why the kernels cannot compute phi(x) for x (B, H, T, D), weight (H, D, F/2), bias
    (H, F/2) and ``activation`` (``None``: they can): another activation (``relu``,
    ``elu1p``, ``none``), ``HEDGECATS_TRITON=0``, no Triton or CUDA (the interpreter counts),
    a dtype other than bf16 (fp32 products spilled heavily; fp32 maps are not hot), head dims
    or F/2 not powers of two in [16, 128], an empty sequence."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (the kernel takes {', '.join(ACTIVATIONS)})"
    reason = launch_reason(x)
    if reason is not None:
        return reason
    if x.dtype != torch.bfloat16:
        return f"dtype {x.dtype} (the kernel takes bf16)"
    if x.dim() != 4 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or \
            x.shape[-1] != weight.shape[1]:
        return "shapes of x and weight do not match"
    D, FH = weight.shape[1], weight.shape[2]
    if not (pow2(D) and 16 <= D <= 128):
        return f"head dim {D} (powers of two in [16, 128])"
    if not (pow2(FH) and 16 <= FH <= 128):
        return f"{FH} features per half (powers of two in [16, 128])"
    if x.shape[2] == 0:
        return "empty sequence"
    return None


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      activation: str = "softmax", *, with_input: bool = False,
                      kernel_du: bool = False):
    """``phi(x)`` (B, H, T, F) in x's dtype for x (B, H, T, D), weight (H, D, F/2), bias
    (H, F/2); differentiable in all three. ``None`` where the kernels do not take the call
    (``unsupported_reason``, logged once for a CUDA call the kernels were expected to take):
    the caller computes the map itself.

    ``with_input``: ``(phi(x), x')``, x' the same values as x (a view of it) for x's other
    consumer (the attention): the gradient that reaches x' is added to the map's in the
    backward kernel (one pass over x's gradient fewer than autograd's sum of the two).

    ``kernel_du``: phi(x) carries a ``DuSlot``: the hybrid kernel, given phi(x) itself as its
    fq, hands the map's backward du instead of dphi (the layer's q map)."""
    reason = unsupported_reason(x, weight, bias, activation)
    if reason is not None:
        if activation in ACTIVATIONS and switched_on() and available() and \
                (x.is_cuda or interpret()):
            warn_once(__name__, f"fused feature map not used: {reason}")
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    fn = MapWithInputFn if with_input else MapFn
    softmax = activation == "softmax"
    slot = DuSlot(x, weight.shape[-1], softmax) if kernel_du and torch.is_grad_enabled() \
        else None
    try:
        out = fn.apply(x, weight, bias, softmax, slot)
    except errors() as e:
        TRACE.fallback("feature_map", "feature map", e, "using PyTorch")
        return None
    if slot is not None:
        slot.watch(out[0] if with_input else out)
    TRACE.count("feature_map.forward")
    return out
