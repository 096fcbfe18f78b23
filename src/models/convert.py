"""Convert a transformers causal LM into a hybrid, and switch its attention mode.

``convert_to_hybrid`` makes the decoder layers hybrid (``models.layer.convert_layers``: each
converted ``self_attn`` gets ``phi_q``, ``phi_k`` and ``mixer`` as submodules, so state-dict
keys are stable and peft's ``q_proj``... targets still match, and a ``LayerRuntime`` with the
switches; attention runs through the ``"hedgecats"`` attention implementation registered with
transformers), then gives the model its hybrid class (``models.hf``). The original weights are
not touched; layers that are not converted keep softmax attention.

A base model with its own sliding window (Mistral-7B-v0.1: 4096) keeps it for its softmax
attention, but the window is applied by our attention function rather than by transformers'
mask and cache: the model's ``config.sliding_window`` is set to ``None`` at conversion, because
transformers' sliding-window cache drops keys older than the window and its mask hides them,
and linear attention needs every key.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from torch import nn

from .config import HybridConfig, check_mode, validate_switches
from .hf import adopt
from .layer import LayerRuntime, convert_layers
from .structure import decoder_layers, hybrid_layers

log = logging.getLogger(__name__)

__all__ = [
    "attention_mode",
    "convert_to_hybrid",
    "set_attention_mode",
]


# ----------------------------------------------------------------------------- conversion
def convert_to_hybrid(model: nn.Module, config: HybridConfig) -> nn.Module:
    """Turn ``model`` (Llama, Mistral or Qwen2 causal LM) into a hybrid in place; return it.

    All checks run before anything is built: an unsupported family, a layer index out of range,
    a head dimension the rectangular projection cannot halve raise ``ValueError``. Logs which
    layers were converted and which were left as softmax.

    The model then has the hybrid class of its family (``models.hf``: e.g. ``LlamaForCausalLM``
    -> ``HedgecatsLlamaForCausalLM``, a subclass), so that ``save_pretrained`` writes a hybrid
    that ``AutoModelForCausalLM.from_pretrained`` rebuilds and ``generate`` and every call with
    ``use_cache`` use the constant-memory ``HybridCache``; and a forward pre-hook refuses
    positions past the base model's ``max_position_embeddings``.
    """
    todo = convert_layers(model, config)
    adopt(model)  # its hybrid class: save_pretrained and generate know it is a hybrid
    n = len(decoder_layers(model))
    skipped = sorted(set(range(n)) - set(todo))
    log.info("converted %d/%d layers to hybrid attention (window %d, %s mixer)%s", len(todo), n,
             config.window, config.mixer, f"; left as softmax: {skipped}" if skipped else "")
    return model


# ----------------------------------------------------------------------------- switching
def set_attention_mode(model: nn.Module, mode: str | None = None, **switches) -> None:
    """Set the mode (one of ``config.MODES``) and any runtime switch on every converted layer.

    Switches: ``config.SWITCHES`` (``window`` overrides per-layer windows, ``rescale``,
    ``overlap``, ``la_span``, ``n_sinks``, ``backend``, ``eps``, ``ssd_p``, ``ssd_granularity``),
    checked by ``config.validate_switches``; and the layer's ``observer`` hook (a callable or
    None).
    """
    layers = list(hybrid_layers(model))
    if not layers:
        raise ValueError("the model has no hybrid layers: convert it with convert_to_hybrid first "
                         f"(mode {mode!r} needs them)")
    if mode is not None:
        check_mode(mode)
    validate_switches(switches, extra=("observer",))
    observer = switches.get("observer")
    if observer is not None and not callable(observer):
        raise ValueError(f"invalid value {observer!r} for switch 'observer': a callable "
                         "fn(module, query, key, value, key_padding_mask, hidden_states) or None")
    if switches.get("overlap") and any(a.mixer.shared_norm for _, a in layers):
        raise ValueError("overlap=True contradicts the shared_norm mixer (window keys counted twice)")
    for _, attn in layers:
        rt = attn.hedgecats
        if mode is not None:
            rt.mode = mode
        for name, value in switches.items():
            setattr(rt, name, value)


def _snapshot(model: nn.Module) -> dict[int, LayerRuntime]:
    return {i: replace(a.hedgecats) for i, a in hybrid_layers(model)}


@contextlib.contextmanager
def attention_mode(model: nn.Module, mode: str | None = None, **switches):
    """Context manager: ``set_attention_mode`` inside, every layer's previous runtime after."""
    saved = _snapshot(model)
    try:
        set_attention_mode(model, mode, **switches)
        yield model
    finally:
        for i, attn in hybrid_layers(model):
            attn.hedgecats = saved[i]
