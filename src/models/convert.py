"""Convert a transformers causal LM into a hybrid, and switch its attention mode.

``convert_to_hybrid`` walks the decoder layers, adds ``phi_q``, ``phi_k`` and ``mixer`` as
submodules of each converted ``self_attn`` (so state-dict keys are stable and peft's
``q_proj``... targets still match), attaches a ``LayerRuntime`` with the switches, and routes
attention through the ``"hedgecats"`` attention implementation registered with transformers.
The original weights are not touched; layers that are not converted keep softmax attention.

A base model with its own sliding window (Mistral-7B-v0.1: 4096) keeps it for its softmax
attention, but the window is applied by our attention function rather than by transformers'
mask and cache: the model's ``config.sliding_window`` is set to ``None`` at conversion, because
transformers' sliding-window cache drops keys older than the window and its mask hides them,
and linear attention needs every key (see ``convert_to_hybrid``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from .config import SSD_GRANULARITIES, HybridConfig
from .feature_maps import HedgehogFeatureMap, feature_dim
from .mixers import build_mixer
from .ops.backends import BACKENDS
from .ops.hybrid import LA_SPANS, MODES, hybrid_attention

log = logging.getLogger(__name__)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "SUPPORTED_MODEL_TYPES",
    "LayerRuntime",
    "attention_mode",
    "convert_to_hybrid",
    "hybrid_layers",
    "hybrid_parameter_names",
    "set_attention_mode",
]

ATTN_IMPLEMENTATION = "hedgecats"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_GATED_MIXERS = ("gate_elementwise", "gate_lowrank")


@dataclass
class LayerRuntime:
    """The switches of one converted layer (plain data, not parameters)."""

    layer_idx: int
    window: int
    mode: str
    overlap: bool
    rescale: bool
    la_span: str
    n_sinks: int
    backend: str
    eps: float
    ssd_p: float = 0.0
    ssd_granularity: str = "sample"
    #: ``sliding`` | ``terraced`` | ``terraced_end`` (``ops.windows``): fixed at conversion
    window_shape: str = "sliding"
    #: optional ``fn(module, query, key, value, key_padding_mask, hidden_states)`` called
    #: before the layer's attention (attention transfer, branch-usage probes);
    #: ``hidden_states`` is the layer input for gated mixers, else None; the return is ignored
    observer: object = None


# ----------------------------------------------------------------------------- attention function
def _key_padding_mask(attention_mask: torch.Tensor | None, kv_len: int) -> torch.Tensor | None:
    """(B, Tk) bool from transformers' 4D mask: a key is real if some query may attend to it
    (each real key is visible at least to itself). ``None`` when there is no mask."""
    if attention_mask is None or attention_mask.dim() != 4:
        return None
    m = attention_mask[..., :kv_len]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    kpm = m.any(dim=-2)[:, 0]  # (B, Tk)
    return None if bool(kpm.all()) else kpm


def _with_window(attention_mask, query, key, window: int | None):
    """The base model's own sliding window (``window`` keys, the query's included) added to
    transformers' causal / padding mask, as its sliding-window mask would have it. Unchanged
    where the window cannot matter (no key is older than it)."""
    Tq, Tk = query.shape[2], key.shape[2]
    if window is None or Tk <= window:
        return attention_mask
    t = torch.arange(Tk - Tq, Tk, device=query.device)[:, None]
    i = torch.arange(Tk, device=query.device)[None, :]
    band = (i <= t) & (i > t - window)  # (Tq, Tk)
    if attention_mask is None:
        return band[None, None]
    m = attention_mask[..., :Tk]
    if m.dtype == torch.bool:
        return m & band
    return m.masked_fill(~band, torch.finfo(m.dtype).min)


def _check_no_evicted_keys(key, position_ids, rt: LayerRuntime) -> None:
    """Linear attention needs every earlier key: a cache that dropped some (a sliding-window
    cache) would silently shrink it to the cached ones. Position ids count real tokens only,
    so fewer keys than the largest position + 1 means keys were dropped."""
    if position_ids is None or rt.mode not in ("hybrid", "la_only", "swa_only"):
        return
    seen = int(position_ids.max()) + 1
    if key.shape[2] < seen:
        raise RuntimeError(
            f"layer {rt.layer_idx}: the KV cache holds {key.shape[2]} keys but the sequence is at "
            f"position {seen - 1}: older keys were dropped (a sliding-window cache?), and linear "
            f"attention needs them all. Use a full cache: model.config.sliding_window must stay "
            f"None after convert_to_hybrid (it sets it so), and caches must be created after it. "
            f"(Position ids that do not start at 0 without a cache also end here: LA reads "
            f"absolute positions through RoPE, so pass positions counted from the first token.)")


def _common_dtype(query, key, value):
    """q, k, v in one dtype. Under ``bf16-mixed`` with an fp32 base, RoPE hands attention fp32 q
    and k but a bf16 v (seen on an H200): the fast kernels take one dtype, and mixed calls went
    to the slow paths. Under autocast the autocast dtype is what the layer computes in anyway;
    without it, the wider dtype (nothing is rounded)."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) == 1:
        return query, key, value
    dev = query.device.type
    if torch.is_autocast_enabled(dev):
        dtype = torch.get_autocast_dtype(dev)
    else:
        dtype = functools.reduce(torch.promote_types, dtypes)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def _ssd_mask(rt: LayerRuntime, B: int, H: int, device) -> torch.Tensor | None:
    if rt.ssd_p <= 0.0:
        return None
    shape = {"sample": (B, 1, 1, 1), "batch": (1, 1, 1, 1), "head": (B, H, 1, 1)}[rt.ssd_granularity]
    return torch.rand(shape, device=device) < rt.ssd_p


def hedgecats_attention_forward(module: nn.Module, query, key, value, attention_mask,
                                dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The ``"hedgecats"`` attention implementation: (B, H, T, D) in, (B, T, H, D) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rt: LayerRuntime | None = getattr(module, "hedgecats", None)
    hidden = module.__dict__.pop("_hedgecats_input", None)
    base_window = module.__dict__.get("hedgecats_base_window")
    if rt is None:  # a layer left unconverted
        return sdpa_attention_forward(module, query, key, value,
                                      _with_window(attention_mask, query, key, base_window),
                                      dropout=dropout, scaling=scaling, **kwargs)
    cache_slot = module.__dict__.pop("_hedgecats_cache", None)  # bound by _bind_cache
    if cache_slot is not None:  # constant-memory cache: only the new tokens' keys came in
        from .cache import cached_attention

        query, key, value = _common_dtype(query, key, value)
        out = cached_attention(cache_slot, module, query, key, value, attention_mask,
                               g=module.mixer(hidden), scale=scaling,
                               swa_drop=_ssd_mask(rt, query.shape[0], query.shape[1], query.device)
                               if module.training and rt.mode == "hybrid" else None)
        return out.transpose(1, 2).contiguous(), None
    _check_no_evicted_keys(key, kwargs.get("position_ids"), rt)
    # the padding mask costs a host synchronisation, which softmax mode does not need (it
    # would break the capture of a decode step in a CUDA graph)
    kpm = (_key_padding_mask(attention_mask, key.shape[2])
           if rt.mode != "softmax" or rt.observer is not None else None)
    if rt.observer is not None:
        rt.observer(module, query, key, value, kpm, hidden)
    if rt.mode == "softmax":  # exactly the original model's attention
        return sdpa_attention_forward(module, query, key, value,
                                      _with_window(attention_mask, query, key, base_window),
                                      dropout=dropout, scaling=scaling, **kwargs)
    query, key, value = _common_dtype(query, key, value)
    if rt.window_shape == "terraced_end" and kpm is None and query.shape[0] > 1:
        _warn_once("a 'terraced_end' window (LoLCATs' blocks, ending at each sequence's last "
                   "token) runs a batch of several sequences with no padding in its mask: if "
                   "they were right-padded without a mask (lm-eval), the shorter ones get "
                   "blocks that end at the padded length; evaluate with batch size 1 or pass "
                   "the attention mask")
    needs_la = rt.mode in ("hybrid", "swa_only", "la_only")
    fq = module.phi_q(query) if needs_la else None
    fk = module.phi_k(key) if needs_la else None
    swa_drop = _ssd_mask(rt, query.shape[0], query.shape[1], query.device) \
        if module.training and rt.mode == "hybrid" else None
    out = hybrid_attention(
        query, key, value, fq, fk, window=rt.window, mode=rt.mode, g=module.mixer(hidden),
        shared_norm=module.mixer.shared_norm, overlap=rt.overlap, rescale=rt.rescale,
        la_span=rt.la_span, n_sinks=rt.n_sinks, swa_drop=swa_drop, key_padding_mask=kpm,
        scale=scaling, eps=rt.eps, backend=rt.backend, window_shape=rt.window_shape,
    )  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


def _stash_input(module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook: keep the layer input for output-gate mixers."""
    module.__dict__["_hedgecats_input"] = kwargs.get("hidden_states", args[0] if args else None)


def _call_cache(kwargs: dict):
    """The cache a decoder call carries (``cache`` since transformers 5.24, before that
    ``past_key_values``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def _bind_cache(module: nn.Module, args, kwargs) -> None:
    """Forward pre-hook of a converted ``self_attn``: with a ``HybridCache`` in the call, check
    and bind the layer's slot (``models.cache``); the attention function then uses it."""
    from .cache import HybridCache

    cache = _call_cache(kwargs)
    if isinstance(cache, HybridCache):
        module.__dict__["_hedgecats_cache"] = cache.bind(module.hedgecats.layer_idx, module)
    else:
        module.__dict__.pop("_hedgecats_cache", None)


def _check_positions(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook of a converted model: a position past the base model's
    ``max_position_embeddings`` is an error (RoPE, and the feature maps trained on its output,
    never saw it). Skipped while a CUDA graph is captured or torch.compile traces (reading
    position ids back is a host synchronisation)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is None or torch.compiler.is_compiling() or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    pos = kwargs.get("position_ids")
    if pos is not None:
        last = int(pos.max()) if pos.numel() else -1
    else:
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        if x is None:
            return
        cache = _call_cache(kwargs)
        past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
        last = past + x.shape[1] - 1
    if last >= limit:
        raise ValueError(
            f"position {last} is past the base model's max_position_embeddings={limit}: the "
            f"context (prompt + generated tokens) is longer than the positions the model was "
            f"trained on; shorten the prompt or max_new_tokens")


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, hedgecats_attention_forward)
    # without a mask entry the attention mask arrives as None even with padding
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


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

    _register()
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
        attn.hedgecats = LayerRuntime(
            layer_idx=i, window=config.window_for(i), mode=config.mode, overlap=config.overlap,
            rescale=config.rescale, la_span=config.la_span, n_sinks=config.n_sinks,
            backend=config.backend, eps=config.eps, ssd_p=config.ssd_p,
            ssd_granularity=config.ssd_granularity, window_shape=config.window_shape)
        if config.mixer in _GATED_MIXERS:
            attn.register_forward_pre_hook(_stash_input, with_kwargs=True)
        attn.register_forward_pre_hook(_bind_cache, with_kwargs=True)
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
    model.register_forward_pre_hook(_check_positions, with_kwargs=True)
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
_SWITCH_CHECKS = {
    "window": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "rescale": lambda v: isinstance(v, bool),
    "overlap": lambda v: isinstance(v, bool),
    "la_span": lambda v: v in LA_SPANS,
    "n_sinks": lambda v: isinstance(v, int) and v >= 1,
    "backend": lambda v: v in BACKENDS,
    "eps": lambda v: isinstance(v, float) and v > 0,
    "ssd_p": lambda v: isinstance(v, (int, float)) and 0.0 <= v <= 1.0,
    "ssd_granularity": lambda v: v in SSD_GRANULARITIES,
    "observer": lambda v: v is None or callable(v),
}


def set_attention_mode(model: nn.Module, mode: str | None = None, **switches) -> None:
    """Set the mode (one of ``MODES``) and any runtime switch on every converted layer.

    Switches: ``window`` (overrides per-layer windows), ``rescale``, ``overlap``, ``la_span``,
    ``n_sinks``, ``backend``, ``eps``, ``ssd_p``, ``ssd_granularity``, ``observer``.
    """
    layers = list(hybrid_layers(model))
    if not layers:
        raise ValueError("the model has no hybrid layers: convert it with convert_to_hybrid first "
                         f"(mode {mode!r} needs them)")
    if mode is not None and mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}; valid: {', '.join(MODES)}")
    for name, value in switches.items():
        check = _SWITCH_CHECKS.get(name)
        if check is None:
            raise ValueError(f"unknown switch {name!r}; valid: {', '.join(_SWITCH_CHECKS)}")
        if not check(value):
            raise ValueError(f"invalid value {value!r} for switch {name!r}")
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

