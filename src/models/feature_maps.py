"""Hedgehog feature maps (docs/method.md#feature-maps, Eq. 4).

    phi(x) = [ act(x W + b)  ++  act(-x W - b) ]          (++ = concatenate on the feature axis)

``W`` is one matrix per head, ``(D, D)`` ("square", feature dim ``F = 2D``, HedgeHog) or
``(D, D/2)`` ("rectangular", ``F = D``, LoLCATs); ``b`` is one bias per output feature (LoLCATs
uses a scalar per head, which a softmax ignores; we follow the formula). ``act`` acts over the
feature axis of each half separately.

Two options exist for maps imported from LoLCATs (``models.lolcats``): ``floor`` clamps every
feature from below (LoLCATs' ``SoftmaxDim`` clamps at its ``eps``, 1e-12), and ``input_heads``
lets a map with one head per *query* head take the keys' fewer heads under GQA, repeating each
key head for its query heads first (LoLCATs applies ``feature_map_k`` after ``repeat_kv``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ACTIVATIONS", "PROJECTIONS", "HedgehogFeatureMap", "feature_dim"]


def _softmax(u: torch.Tensor) -> torch.Tensor:
    # fp32 softmax whatever the input dtype: bf16 exponentials lose the small weights.
    return torch.softmax(u, dim=-1, dtype=torch.float32).to(u.dtype)


def _exp(u: torch.Tensor) -> torch.Tensor:
    # Plain exp, no max-subtraction: subtracting a per-key max would rescale each key differently
    # and change the normalised LA output. Overflows only for |xW + b| > 88 (fp32/bf16 range).
    return torch.exp(u)


def _elu1p(u: torch.Tensor) -> torch.Tensor:
    return 1.0 + F.elu(u)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "softmax": _softmax,
    "exp": _exp,
    "relu": F.relu,
    "elu1p": _elu1p,
    "none": lambda u: u,  # can be negative: the LA denominator is guarded (see ops.reference)
}

#: projection name -> output columns of W as a fraction of head_dim
PROJECTIONS: dict[str, int] = {"square": 1, "rectangular": 2}


def _choice(value: str, options: dict, what: str) -> str:
    if value not in options:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(sorted(options))}")
    return value


def feature_dim(head_dim: int, projection: str = "square") -> int:
    """Feature dimension ``F`` of a map: ``2 * D`` for square, ``D`` for rectangular."""
    _choice(projection, PROJECTIONS, "feature-map projection")
    if head_dim % PROJECTIONS[projection]:
        raise ValueError(
            f"head_dim={head_dim} cannot be halved for the rectangular projection; "
            "use projection='square' or a model with an even head dimension"
        )
    return 2 * (head_dim // PROJECTIONS[projection])


class HedgehogFeatureMap(nn.Module):
    """Learned feature map, untied per head.

    Args:
        num_heads: heads ``H`` (use the key/value head count for ``phi_k`` under GQA).
        head_dim: ``D``.
        activation: ``softmax | exp | relu | elu1p | none``.
        projection: ``square`` (``W: (H, D, D)``, ``F = 2D``) or ``rectangular``
            (``W: (H, D, D/2)``, ``F = D``).
        init_std: std of the Gaussian noise added to the identity init.
        floor: every feature is at least this (``clamp_min``; 0 = no clamp). LoLCATs: 1e-12.
        input_heads: heads of the input, when fewer than ``num_heads`` (GQA keys for a map per
            query head): input head ``j`` feeds map heads ``j * r ... (j + 1) * r - 1``,
            ``r = num_heads // input_heads``, as ``repeat_kv`` orders them. ``None``: equal.
        seed: the init is drawn on the CPU from ``torch.Generator().manual_seed(seed)`` only,
            then copied to the parameters' device: the same numbers on every rank and machine,
            whatever the global RNG state and whatever default device the module is built
            under (Lightning builds models under ``torch.device("cuda")``, FSDP under ``meta``
            and materialises them later through ``reset_parameters``).

    Shapes: ``forward(x: (B, H or input_heads, T, D)) -> (B, H, T, F)``.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        activation: str = "softmax",
        projection: str = "square",
        init_std: float = 0.1,
        seed: int = 0,
        floor: float = 0.0,
        input_heads: int | None = None,
    ) -> None:
        super().__init__()
        _choice(activation, ACTIVATIONS, "feature-map activation")
        input_heads = num_heads if input_heads is None else input_heads
        if input_heads < 1 or num_heads % input_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"input_heads={input_heads}")
        if floor < 0:
            raise ValueError(f"floor={floor!r} must be >= 0")
        self.input_heads, self.floor = input_heads, float(floor)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.activation, self.projection = activation, projection
        self.init_std, self.seed = init_std, seed
        self.feature_dim = feature_dim(head_dim, projection)
        out = self.feature_dim // 2
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, out))  # (H, D, F/2)
        self.bias = nn.Parameter(torch.empty(num_heads, out))  # (H, F/2)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity (its first ``F/2`` columns) plus N(0, init_std) noise; bias 0."""
        gen = torch.Generator(device="cpu").manual_seed(self.seed)
        H, D, out = self.weight.shape
        eye = torch.eye(D, device="cpu")[:, :out].expand(H, D, out)
        noise = torch.randn(H, D, out, generator=gen, device="cpu") * self.init_std
        self.weight.copy_(eye + noise)  # copy_ moves it to the parameter's device and dtype
        self.bias.zero_()

    def forward(self, x: torch.Tensor, *, with_input: bool = False, kernel_du: bool = False):
        """``phi(x)``; with ``with_input``, ``(phi(x), x')``: x' has x's values and goes to x's
        other consumer (the attention). Where the fused kernel runs and x takes a gradient, the
        gradient reaching x' is added to the map's inside the map's backward kernel
        (``triton_phi.hedgehog_features(with_input=True)``) instead of in a separate pass of
        autograd's over x's gradient; elsewhere x' is x itself.

        ``kernel_du``: phi(x) is going to the fused hybrid kernel as its fq: where both
        kernels run, the hybrid kernel's backward hands this map's backward du instead of
        dphi (``triton_phi.DuSlot``; the same gradients, whatever else consumes phi(x))."""
        heads = (self.num_heads,) if self.input_heads == self.num_heads else (
            self.input_heads, self.num_heads)
        if x.dim() != 4 or x.shape[1] not in heads or x.shape[-1] != self.head_dim:
            want = " or ".join(f"(B, {h}, T, {self.head_dim})" for h in heads)
            raise ValueError(f"expected x of shape {want}, got {tuple(x.shape)}")
        x_in = x
        if x.shape[1] != self.num_heads:  # GQA keys, one map per query head
            x = x.repeat_interleave(self.num_heads // x.shape[1], dim=1)  # (B, H, T, D)
        handed_on = with_input and x is x_in and x.requires_grad and torch.is_grad_enabled()
        phi = self._fused(x, with_input=handed_on, kernel_du=kernel_du and self.floor == 0)
        if handed_on and phi is not None:
            phi, x_in = phi
        if phi is None:
            w = self.weight.to(x.dtype)
            u = torch.einsum("bhtd,hdf->bhtf", x, w) + self.bias.to(x.dtype)[None, :, None, :]
            act = ACTIVATIONS[self.activation]
            phi = torch.cat([act(u), act(-u)], dim=-1)  # (B, H, T, F)
        phi = phi.clamp_min(self.floor) if self.floor > 0 else phi
        return (phi, x_in) if with_input else phi

    def kernel_form(self):
        """``(weight, bias, activation)`` where this map's function is the fused map's
        (``ops.triton_phi``: no floor, softmax or exp), for a kernel to run it on x of the
        map's own heads (``triton_hybrid.fold_maps``: the layer's maps inside the hybrid
        kernel's Function); else ``None``."""
        if self.floor > 0 or self.activation not in ("softmax", "exp"):
            return None
        return self.weight, self.bias, self.activation

    def _fused(self, x: torch.Tensor, with_input: bool = False, kernel_du: bool = False):
        """The map as one Triton kernel per direction (``ops.triton_phi``) on CUDA where it
        applies (bf16, softmax / exp, power-of-two dims) and ``backends.triton_enabled()``
        (``HEDGECATS_TRITON=0`` turns it off); else None and the PyTorch path above runs.
        Same function; the kernel keeps ``x W + b`` in fp32 up to the activations where the
        PyTorch path rounds it to x's dtype first, so on the GPU it is the closer of the two
        to the fp32 map (H200, B 8 x T 1k: relative error 6.0e-3 against 9.3e-3 for the
        whole layer, and 1.8 against 2.9 ms forward + backward for both maps;
        docs/performance.md)."""
        if not x.is_cuda or self.activation not in ("softmax", "exp"):
            return None
        from .ops.hybrid import backends
        from .ops.feature_map import dispatch as triton_phi

        if not backends.triton_enabled():
            return None
        return triton_phi.hedgehog_features(x, self.weight, self.bias, self.activation,
                                            with_input=with_input, kernel_du=kernel_du)

    def extra_repr(self) -> str:
        extra = "" if self.input_heads == self.num_heads else f", input_heads={self.input_heads}"
        extra += f", floor={self.floor:g}" if self.floor > 0 else ""
        return (
            f"heads={self.num_heads}, head_dim={self.head_dim}, features={self.feature_dim}, "
            f"activation={self.activation!r}, projection={self.projection!r}{extra}"
        )

