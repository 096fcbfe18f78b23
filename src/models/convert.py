"""Convert a transformers causal LM into a hybrid, and switch its attention mode.

``convert_to_hybrid`` walks the decoder layers, adds ``phi_q``, ``phi_k`` and ``mixer`` as
submodules of each converted ``self_attn`` (so state-dict keys are stable and peft's
``q_proj``... targets still match), attaches a ``LayerRuntime`` with the switches, and routes
attention through the ``"hedgecats"`` attention implementation registered with transformers
(both in ``models.layer``, which also lists where a converted model keeps its state).
The original weights are not touched; layers that are not converted keep softmax attention.

A base model with its own sliding window (Mistral-7B-v0.1: 4096) keeps it for its softmax
attention, but the window is applied by our attention function rather than by transformers'
mask and cache: the model's ``config.sliding_window`` is set to ``None`` at conversion, because
transformers' sliding-window cache drops keys older than the window and its mask hides them,
and linear attention needs every key (see ``convert_to_hybrid``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from .config import HybridConfig, check_mode, validate_switches
from .feature_maps import HedgehogFeatureMap, feature_dim
from .layer import ATTN_IMPLEMENTATION, LayerRuntime, check_positions, install, register
from .mixers import build_mixer

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "attention_mode",
    "convert_to_hybrid",
    "hybrid_layers",
    "hybrid_parameter_names",
    "set_attention_mode",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


# ----------------------------------------------------------------------------- conversion
def _family(cfg) -> str | None:
    """The base model type: ``model_type``, or for a saved hybrid's config (``models.hf``) the
    family it was converted from."""
    return getattr(type(cfg), "hedgecats_family", None) or getattr(cfg, "model_type", None)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    model_type = _family(getattr(model, "config", None))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"cannot convert a model of type {model_type!r}: supported are "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (transformers causal LMs)")
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def _head_dims(cfg) -> tuple[int, int, int, int]:
    H = cfg.num_attention_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return H, Hkv, D, cfg.hidden_size


def _base_sliding_window(cfg) -> int | None:
    """The window of the base model's own softmax attention, if it has one (Mistral-7B-v0.1:
    4096; later Mistrals and Llama: None). Models with per-layer window types (Qwen2 with
    ``use_sliding_window``) are refused: their masks are built per layer type at init."""
    layer_types = getattr(cfg, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        raise ValueError(
            f"{cfg.model_type} with sliding-window layers (use_sliding_window=True) is not "
            f"supported: convert a model whose layers use full attention")
    section = getattr(cfg, "hybrid", None)
    if isinstance(section, dict):  # a saved hybrid: the window was lifted at conversion
        return section.get("base_sliding_window")
    return getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None


def convert_to_hybrid(model: nn.Module, config: HybridConfig) -> nn.Module:
    """Turn ``model`` (Llama, Mistral or Qwen2 causal LM) into a hybrid in place; return it.

    All checks run before anything is built: an unsupported family, a layer index out of range,
    a head dimension the rectangular projection cannot halve raise ``ValueError``. Logs which
    layers were converted and which were left as softmax.

    The model then has the hybrid class of its family (``models.hf``: e.g. ``LlamaForCausalLM``
    -> ``HedgecatsLlamaForCausalLM``, a subclass), so that ``save_pretrained`` writes a hybrid
    that ``AutoModelForCausalLM.from_pretrained`` rebuilds and ``generate`` uses the
    constant-memory ``HybridCache``; and a forward pre-hook refuses positions past the base
    model's ``max_position_embeddings``.
    """
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
    layers = _decoder_layers(model)
    H, Hkv, D, hidden = _head_dims(model.config)
    feature_dim(D, config.feature_projection)  # raises if D cannot be halved
    n = len(layers)
    todo = list(range(n)) if config.layers is None else sorted(config.layers)
    bad = [i for i in todo + list(config.layer_windows or {}) if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {sorted(set(bad))} are out of range for a model of {n} layers")
    already = [i for i in todo if hasattr(layers[i].self_attn, "hedgecats")]
    if already:
        raise ValueError(f"layers {already} are already converted; convert a fresh model")
    base_window = _base_sliding_window(model.config)

    register()
    for i in todo:
        attn = layers[i].self_attn
        ref = attn.q_proj.weight
        seed = (config.seed or 0) + 2 * i  # None: 0
        attn.phi_q = HedgehogFeatureMap(H, D, config.feature_activation, config.feature_projection,
                                        config.feature_init_std, seed=seed,
                                        floor=config.feature_floor)
        attn.phi_k = HedgehogFeatureMap(H if config.key_map_heads == "query" else Hkv, D,
                                        config.feature_activation, config.feature_projection,
                                        config.feature_init_std, seed=seed + 1,
                                        floor=config.feature_floor, input_heads=Hkv)
        attn.mixer = build_mixer(config.mixer, hidden_size=hidden, num_heads=H, head_dim=D,
                                 g=config.g, gate_rank=config.gate_rank,
                                 shared_norm_init=config.shared_norm_init, seed=seed,
                                 shared_norm_shift=config.shared_norm_shift)
        for name in ("phi_q", "phi_k", "mixer"):  # fp32 master weights on the layer's device
            getattr(attn, name).to(device=ref.device, dtype=torch.float32)
        install(attn, config, i)
    if base_window is not None:
        # our attention function applies the base model's window to its softmax attention;
        # transformers must neither mask nor evict the older keys linear attention reads
        for layer in layers:
            layer.self_attn.__dict__["hedgecats_base_window"] = base_window
        model.config.sliding_window = None
        log.info("the base model's sliding window (%d) is applied by the hedgecats attention "
                 "function; config.sliding_window set to None so that caches keep every key",
                 base_window)
    model.hedgecats_config = config
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.register_forward_pre_hook(check_positions, with_kwargs=True)
    from .hf import adopt

    adopt(model)  # its hybrid class: save_pretrained and generate know it is a hybrid
    skipped = sorted(set(range(n)) - set(todo))
    log.info("converted %d/%d layers to hybrid attention (window %d, %s mixer)%s", len(todo), n,
             config.window, config.mixer, f"; left as softmax: {skipped}" if skipped else "")
    return model


def hybrid_layers(model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """``(layer_index, self_attn)`` for every converted layer."""
    for i, layer in enumerate(_decoder_layers(model)):
        if hasattr(layer.self_attn, "hedgecats"):
            yield i, layer.self_attn


def hybrid_parameter_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of every feature-map and mixer parameter."""
    return [n for n, _ in model.named_parameters()
            if any(f".{part}." in n for part in ("phi_q", "phi_k", "mixer"))]


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

