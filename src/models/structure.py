"""Where the parts of a transformers causal LM are, converted or not: its decoder layers, its
converted attention modules, its hybrid parameters, the model inside a peft wrapper.

The bottom of the model tier: it imports nothing of hedgecats, and every module that walks a
model's layers (conversion, the cache, the hybrid classes, stage files) reads them here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "decoder_layers",
    "family",
    "head_dims",
    "hybrid_layers",
    "hybrid_parameter_names",
    "unwrap",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: the submodules a conversion adds to each converted ``self_attn``
HYBRID_PARTS = ("phi_q", "phi_k", "mixer")


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft ``PeftModel`` (LoRA layers stay injected)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def family(cfg) -> str | None:
    """The base model type: ``model_type``, or for a saved hybrid's config (``models.hf``) the
    family it was converted from."""
    return getattr(type(cfg), "hedgecats_family", None) or getattr(cfg, "model_type", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Llama, Mistral or Qwen2 causal LM (``model.model.layers``); a
    ``ValueError`` names another family or a model without them."""
    model_type = family(getattr(model, "config", None))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"cannot convert a model of type {model_type!r}: supported are "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (transformers causal LMs)")
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def head_dims(cfg) -> tuple[int, int, int, int]:
    """``(query heads, key/value heads, head dim, hidden size)`` of a model config."""
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hkv, D, cfg.hidden_size


def hybrid_layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """``(layer_index, self_attn)`` for every converted layer."""
    for i, layer in enumerate(decoder_layers(model)):
        if hasattr(layer.self_attn, "hedgecats"):
            yield i, layer.self_attn


def hybrid_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of every feature-map and mixer parameter."""
    return [n for n, _ in model.named_parameters()
            if any(f".{part}." in n for part in HYBRID_PARTS)]
