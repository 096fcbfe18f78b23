"""The Hedgehog feature map in plain PyTorch, fp32: what the kernels compute and the tests'
oracle.

    u      = x W_h + b_h                               (per head h: W_h (D, F/2), b_h (F/2))
    phi(x) = [ act(u)  ++  act(-u) ]                   act = softmax over the F/2 features,
                                                             or exp

``models.feature_maps.HedgehogFeatureMap`` is the module (its PyTorch path rounds u to x's
dtype before the activations; this reference and the kernels keep u in fp32).
"""

from __future__ import annotations

import torch

__all__ = ["ACTIVATIONS", "reference_features"]

#: the activations the kernels compute
ACTIVATIONS = ("softmax", "exp")


def reference_features(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       activation: str = "softmax") -> torch.Tensor:
    """phi(x) (B, H, T, F) in fp32 for x (B, H, T, D), weight (H, D, F/2), bias (H, F/2)."""
    u = torch.einsum("bhtd,hdf->bhtf", x.float(), weight.float()) + \
        bias.float()[None, :, None, :]
    if activation == "softmax":
        return torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], dim=-1)
    return torch.cat([torch.exp(u), torch.exp(-u)], dim=-1)
