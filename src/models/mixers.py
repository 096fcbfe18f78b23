"""How the SWA and LA branches are mixed (docs/method.md#mixers).

Every mixer is a module whose ``forward(hidden_states)`` returns the ``g`` argument of
``ops.hybrid_attention``: a float or a tensor broadcastable to ``(B, H, T, D)``; ``shared_norm``
mixers set ``shared_norm = True`` and return the per-head factor ``sigmoid(a_h)`` instead.

    fixed             g (a constant, the paper's 0.5); no parameters
    learned_head      g_h = sigmoid(a_h), a_h initialised to logit(g)
    shared_norm       LoLCATs' shared denominator, factor sigmoid(a_h) initialised to 0.1
    gate_elementwise  g = sigmoid(x W + c), per channel, from the layer input x (second seed)
    gate_lowrank      g = sigmoid((x A) B + c), through a rank-r bottleneck
    la_mass           the window's weight is the share of LA's kernel mass that lies in the
                      window, query by query; no parameters (``ops.hybrid.attention``)

Gates start at zero weights and bias logit(g), so a converted model starts at the paper's fixed
mix and the gate learns to depart from it. Every random draw comes from a CPU generator seeded
by the mixer's ``seed`` (``reset_parameters``), so the numbers do not depend on the device the
module is built on or on the global RNG.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MASS_MIXERS", "MIXERS", "build_mixer", "logit"]


def logit(p: float) -> float:
    """Inverse sigmoid: the pre-activation that gives probability ``p``."""
    return math.log(p / (1.0 - p))


class FixedMixer(nn.Module):
    shared_norm = False
    needs_input = False  # forward ignores the layer input

    def __init__(self, g: float = 0.5) -> None:
        super().__init__()
        self.g = g

    def forward(self, hidden_states: torch.Tensor | None = None) -> float:
        return self.g

    def extra_repr(self) -> str:
        return f"g={self.g}"


class LearnedHeadMixer(nn.Module):
    shared_norm = False
    needs_input = False

    def __init__(self, num_heads: int, g: float = 0.5) -> None:
        super().__init__()
        self.g = g
        self.logit_g = nn.Parameter(torch.full((num_heads,), logit(g)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.logit_g.fill_(logit(self.g))

    def forward(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logit_g)[None, :, None, None]  # (1, H, 1, 1)


class SharedNormMixer(nn.Module):
    """LoLCATs' per-head factor on the window's softmax terms, ``sigmoid(a_h)``, init 0.1.

    ``shift="window_max"``: the window's softmax terms are shifted by its largest logit and the
    LA terms are not, as in LoLCATs' code (``ops.hybrid``); ``shared_norm`` then reads
    ``"window_max"`` instead of ``True``, which is what ``hybrid_attention`` takes."""

    shared_norm: bool | str = True
    needs_input = False

    def __init__(self, num_heads: int, init: float = 0.1, shift: str = "none") -> None:
        super().__init__()
        if shift not in SHARED_NORM_SHIFTS:
            raise ValueError(f"unknown shared-norm shift {shift!r}; valid: "
                             f"{', '.join(SHARED_NORM_SHIFTS)}")
        self.init, self.shift = init, shift
        self.shared_norm = True if shift == "none" else "window_max"
        self.logit_factor = nn.Parameter(torch.full((num_heads,), logit(init)))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.logit_factor.fill_(logit(self.init))

    def forward(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sigmoid(self.logit_factor)[None, :, None, None]  # (1, H, 1, 1)

    def extra_repr(self) -> str:
        return f"heads={self.logit_factor.numel()}, shift={self.shift!r}"


class LAMassMixer(nn.Module):
    """Weights from LA's own kernel mass: ``alpha_t = Z_win_t / (Z_win_t + Z_far_t)`` on SWA
    (``hybrid_attention(shared_norm="la_mass")``), as full softmax attention weighs its window
    and the keys beyond it by their ``exp`` masses. No parameters: ``forward`` returns the
    factor on the window's mass, 1."""

    shared_norm = "la_mass"
    needs_input = False

    def forward(self, hidden_states: torch.Tensor | None = None) -> float:
        return 1.0


class OutputGateMixer(nn.Module):
    """``g = sigmoid(gate(x))`` per token and channel, ``x`` the attention layer's input.

    ``rank=None``: one ``Linear(hidden, H * D)`` (elementwise gate); ``rank=r``:
    ``Linear(hidden, r, bias=False)`` then ``Linear(r, H * D)`` (low-rank gate). ``up`` starts
    at zero weights and bias ``logit(g)``; ``down`` at N(0, 1/hidden) drawn from ``seed``.
    """

    shared_norm = False
    needs_input = True  # forward needs the layer input

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, g: float = 0.5,
                 rank: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.g, self.seed = num_heads, head_dim, g, seed
        out = num_heads * head_dim
        if rank is None:
            self.down = None
            self.up = nn.Linear(hidden_size, out)
        else:
            self.down = nn.Linear(hidden_size, rank, bias=False)
            self.up = nn.Linear(rank, out)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.down is not None:
            w = self.down.weight
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            w.copy_(torch.randn(w.shape, generator=gen, device="cpu") * w.shape[1] ** -0.5)
        self.up.weight.zero_()
        self.up.bias.fill_(logit(self.g))

    def forward(self, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        if hidden_states is None:
            raise RuntimeError("an output-gate mixer needs the layer input; convert_to_hybrid "
                               "installs a hook that provides it")
        # in the input's dtype, as the feature maps compute (fp32 master weights, a bf16 model
        # run without autocast: e.g. generation right after conversion)
        x = hidden_states
        if self.down is not None:
            x = F.linear(x, self.down.weight.to(x.dtype))
        g = torch.sigmoid(F.linear(x, self.up.weight.to(x.dtype), self.up.bias.to(x.dtype)))
        B, T, _ = g.shape
        return g.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)


MIXERS = ("fixed", "learned_head", "shared_norm", "gate_elementwise", "gate_lowrank", "la_mass")
#: mixers whose weights compare the window's mass with LA's: a row whose LA products sum below
#: the kernel floor gets its weight from the window by design
MASS_MIXERS = ("shared_norm", "la_mass")
#: what ``shared_norm`` subtracts from the window's scores: nothing (docs/method.md#mixers,
#: computed in log space) or the window's max logit while leaving LA's unscaled (LoLCATs' code)
SHARED_NORM_SHIFTS = ("none", "window_max")


def build_mixer(name: str, *, hidden_size: int, num_heads: int, head_dim: int, g: float,
                gate_rank: int, shared_norm_init: float = 0.1, seed: int = 0,
                shared_norm_shift: str = "none") -> nn.Module:
    """The mixer called ``name`` for one layer (``seed``: its random init, gates only)."""
    builders = {
        "fixed": lambda: FixedMixer(g),
        "learned_head": lambda: LearnedHeadMixer(num_heads, g),
        "shared_norm": lambda: SharedNormMixer(num_heads, shared_norm_init, shared_norm_shift),
        "gate_elementwise": lambda: OutputGateMixer(hidden_size, num_heads, head_dim, g, seed=seed),
        "gate_lowrank": lambda: OutputGateMixer(hidden_size, num_heads, head_dim, g, gate_rank,
                                                 seed=seed),
        "la_mass": LAMassMixer,
    }
    if name not in builders:
        raise ValueError(f"unknown mixer {name!r}; valid: {', '.join(MIXERS)}")
    return builders[name]()
