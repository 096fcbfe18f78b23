"""The host-side reductions of transformers' attention mask that every layer of a forward needs,
each made once per mask (a reduction of a CUDA tensor read on the host is a synchronisation)."""

from __future__ import annotations

import weakref

import torch

__all__ = ["ReducedOnce", "key_padding_mask"]


class ReducedOnce:
    """The last host-side reduction of one tensor, kept while that tensor is unchanged.

    Every layer of one forward gets the same 4D mask and the same position ids, and activation
    checkpointing's recomputation gets them again: reducing each once spares the other layers
    a reduction and a host synchronisation each (``bool(...)`` / ``int(...)`` of a CUDA tensor),
    which drained the GPU's queue once per layer (32 a forward on an 8B model, twice per step
    under checkpointing: measured as idle GPU time in stage 2's step) and would hold
    stage 1's side-stream students back. A tensor is the same if it is the same object at the
    same version (an in-place change bumps it); inference-mode tensors have no version, so
    theirs are reduced every time."""

    def __init__(self) -> None:
        self.last = None  # (weak reference, version, key, result)

    def __call__(self, tensor: torch.Tensor, key, reduce):
        version = None if tensor.is_inference() else tensor._version
        last = self.last
        if version is not None and last is not None and last[0]() is tensor and \
                last[1] == version and last[2] == key:
            return last[3]
        result = reduce()
        self.last = None if version is None else (weakref.ref(tensor), version, key, result)
        return result


_KPM_ONCE = ReducedOnce()


def key_padding_mask(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """(B, Tk) bool from transformers' 4D mask: a key is real if some query may attend to it
    (each real key is visible at least to itself). ``None`` when there is no mask. Reduced
    once per mask and ``kv_len`` (``ReducedOnce``)."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None

    def reduce():
        m = attention_mask[..., :kv_len]
        if m.dtype != torch.bool:
            m = m > torch.finfo(m.dtype).min / 2
        kpm = m.any(dim=-2)[:, 0]  # (B, Tk)
        return None if bool(kpm.all()) else kpm

    return _KPM_ONCE(attention_mask, kv_len, reduce)
