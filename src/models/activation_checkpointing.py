"""Activation checkpointing of a converted model for stage 2: whole decoder layers, or only their
MLP blocks.

``"layer"`` (``True`` in YAML) is transformers' own: every decoder layer's forward runs again in
the backward, the attention included. For a hybrid layer that second forward costs more than
softmax attention's (the feature maps, the LA states, the fused kernel: about 3x flash
attention's forward at 8 x 1k on the 8B shape), so it widens the gap to a softmax LoRA step.

``"mlp"`` recomputes only each decoder layer's MLP block (its activations are the largest: three
(B, T, 14336) tensors a layer on Llama-3-8B) and keeps the attention block's, so the hybrid
attention runs once per step. It saves less memory than ``"layer"`` and more than none; the
speed and peak of the three on an H200: docs/performance.md.

The MLP of each decoder layer (a module with both ``self_attn`` and ``mlp``) gets a subclass of
its own class whose forward is checkpointed (non-reentrant) while gradients are enabled: its
parameter names, ``isinstance`` checks and the state dict stay as they were, and a deep copy
works. The subclass is made at run time, so such a model cannot be pickled whole
(``torch.save(model)`` raises PicklingError; ``uncheckpoint_mlps`` first); stage checkpoints
store tensors only.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_mlps", "checkpointing_mode", "enable_checkpointing", "uncheckpoint_mlps"]


def checkpointing_mode(value) -> str | None:
    """``None`` (off), ``"layer"`` or ``"mlp"`` for a value of ``activation_checkpointing``;
    a ValueError naming the valid ones for anything else."""
    if value is False or value is None:
        return None
    if value is True or value == "layer":
        return "layer"
    if value == "mlp":
        return "mlp"
    raise ValueError(f"activation_checkpointing={value!r} is not valid; use false, true "
                     "(= 'layer': whole decoder layers) or 'mlp' (only their MLP blocks)")


@functools.cache
def _checkpointed_class(cls: type) -> type:
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(super(sub, self).forward, *args, use_reentrant=False, **kwargs)
        return super(sub, self).forward(*args, **kwargs)

    sub = type(cls.__name__, (cls,), {"forward": forward, "_hedgecats_checkpointed": True,
                                      "__module__": cls.__module__})
    return sub


def checkpoint_mlps(model: nn.Module) -> int:
    """Checkpoint the MLP block of every decoder layer of ``model`` (in place); returns how many.
    A ValueError when the model has no decoder layer with an ``mlp``."""
    n = 0
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Module) and hasattr(module, "self_attn"):
            if not getattr(mlp, "_hedgecats_checkpointed", False):
                mlp.__class__ = _checkpointed_class(type(mlp))
            n += 1
    if n == 0:
        raise ValueError(f"activation_checkpointing='mlp': {type(model).__name__} has no "
                         "decoder layer with an 'mlp' block (Llama / Mistral / Qwen2 layers have "
                         "one); use true to checkpoint whole layers")
    return n


def uncheckpoint_mlps(model: nn.Module) -> int:
    """Undo ``checkpoint_mlps`` (the MLPs get their own class back); returns how many."""
    n = 0
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(mlp, nn.Module) and getattr(mlp, "_hedgecats_checkpointed", False):
            mlp.__class__ = type(mlp).__mro__[1]
            n += 1
    return n


def enable_checkpointing(model: nn.Module, value) -> str | None:
    """Turn on ``activation_checkpointing=value`` for ``model`` (a transformers model, before
    LoRA is added); returns the mode taken."""
    mode = checkpointing_mode(value)
    if mode == "layer":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "mlp":
        checkpoint_mlps(model)
    return mode
