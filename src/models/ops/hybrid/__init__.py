"""The hybrid layer's attention: sliding-window softmax (SWA) plus linear attention (LA) over
the keys outside the window, mixed.

``attention.hybrid_attention`` is the entry; ``reference`` and ``windows`` hold the readable
PyTorch references; ``backends`` the per-branch backends; ``kernels`` the fused Triton path."""

from .attention import LA_SPANS, MODES, hybrid_attention

__all__ = ["LA_SPANS", "MODES", "hybrid_attention"]
