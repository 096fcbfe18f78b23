"""The layer tier: what makes a decoder layer's ``self_attn`` a hybrid one (``convert_layers``),
its per-layer runtime (``LayerRuntime``), and the ``"hedgecats"`` attention function it runs.
``models.convert`` is the public entry (``convert_to_hybrid``: this, plus the hybrid class);
``models.ops`` computes (kernels); this module wires one layer's call to the ops.

Where a converted model keeps its state (plain Python attributes, never parameters; nothing
here is in the state dict, so checkpoints hold only the weights of ``phi_q`` / ``phi_k`` /
``mixer`` and the ``HybridConfig`` dict):

* ``model.hedgecats_config``: the ``HybridConfig`` the model was converted with (the
  architecture; ``models.hf.live_hybrid_config`` combines it with the layers' current switches).
* ``self_attn.hedgecats``: the layer's ``LayerRuntime``, whose fields are ``HybridConfig``'s
  runtime fields (``LAYER_FIELDS``: the switches ``set_attention_mode`` changes, and the window
  shape) plus ``layer_idx`` and the ``observer`` hook. A layer without it was not converted.
* ``self_attn.__dict__["hedgecats_base_window"]`` (outside ``nn.Module``'s registries, so
  neither a submodule nor a buffer): the base model's own sliding window, set at conversion on
  *every* layer (unconverted ones too, which have no runtime).

What one call needs besides (the layer input, for gated mixers; the bound ``HybridCache``
slot) travels with the call: a forward pre-hook of the converted ``self_attn`` adds them to its
keyword arguments (``hedgecats_input``, ``hedgecats_cache``), which transformers' attention
modules hand on to the attention function.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import field, fields, make_dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import HybridCache, cached_attention
from .config import HybridConfig
from .feature_maps import HedgehogFeatureMap, feature_dim
from .masks import ReducedOnce, key_padding_mask
from .mixers import build_mixer
from .ops.hybrid.attention import hybrid_attention
from .structure import HYBRID_PARTS, decoder_layers, head_dims

log = logging.getLogger(__name__)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LAYER_FIELDS",
    "LayerRuntime",
    "check_positions",
    "convert_layers",
    "hedgecats_attention_forward",
    "register",
]

ATTN_IMPLEMENTATION = "hedgecats"

#: the ``HybridConfig`` fields one converted layer carries at run time: the runtime switches
#: (``HybridConfig.RUNTIME``; ``window`` per layer, from ``window_for``) and the window shape
_CONFIG = {f.name: f for f in fields(HybridConfig)}
LAYER_FIELDS: tuple[str, ...] = (*HybridConfig.RUNTIME, "window_shape")


def _from_config(cls, config: HybridConfig, layer_idx: int):
    """Layer ``layer_idx``'s runtime as ``config`` sets it (its window: ``window_for``)."""
    values = {name: getattr(config, name) for name in LAYER_FIELDS}
    values["window"] = config.window_for(layer_idx)
    return cls(layer_idx=layer_idx, **values)


#: The switches of one converted layer (plain data, not parameters): ``layer_idx``, the
#: ``HybridConfig`` fields named in ``LAYER_FIELDS`` (their types and defaults are
#: ``HybridConfig``'s, so they are declared once), and ``observer``: an optional
#: ``fn(module, query, key, value, key_padding_mask, hidden_states)`` called before the layer's
#: attention (attention transfer, branch-usage probes); ``hidden_states`` is the layer input
#: for gated mixers, else None; the return is ignored. An observer with a true attribute
#: ``wants_teacher_output`` is called, in ``softmax`` mode, after the attention instead, with
#: the keyword ``teacher_output``: the layer's softmax output (B, H, T, D), where that is plain
#: causal softmax (no attention dropout, no base window acting; else as above, without it).
#: Build it with
#: ``LayerRuntime.from_config(config, layer_idx)``.
LayerRuntime = make_dataclass(
    "LayerRuntime",
    [("layer_idx", int),
     *[(n, _CONFIG[n].type, field(default=_CONFIG[n].default)) for n in LAYER_FIELDS],
     ("observer", object, field(default=None))],
    namespace={"from_config": classmethod(_from_config)},
)
LayerRuntime.__module__ = __name__
LayerRuntime.__doc__ = ("The switches of one converted layer: ``layer_idx``, HybridConfig's "
                        "``LAYER_FIELDS`` and an ``observer`` hook (module ``models.layer``).")


# ----------------------------------------------------------------------------- attention function
_POSITIONS_ONCE = ReducedOnce()


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
    # one host sync per position tensor, not per layer (``_ReducedOnce``)
    seen = _POSITIONS_ONCE(position_ids, None, lambda: int(position_ids.max())) + 1
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
                                dropout: float = 0.0, scaling: float | None = None, *,
                                hedgecats_input: torch.Tensor | None = None,
                                hedgecats_cache=None, **kwargs):
    """The ``"hedgecats"`` attention implementation: (B, H, T, D) in, (B, T, H, D) out.

    ``hedgecats_input`` (the layer input, for gated mixers) and ``hedgecats_cache`` (the
    layer's bound ``HybridLayerCache``) come from the converted ``self_attn``'s forward
    pre-hook (``_call_inputs``) through the module's keyword arguments."""
    rt: LayerRuntime | None = getattr(module, "hedgecats", None)
    hidden = hedgecats_input
    base_window = module.__dict__.get("hedgecats_base_window")
    if rt is None:  # a layer left unconverted
        return sdpa_attention_forward(module, query, key, value,
                                      _with_window(attention_mask, query, key, base_window),
                                      dropout=dropout, scaling=scaling, **kwargs)
    if hedgecats_cache is not None:  # constant-memory cache: only the new tokens' keys came in
        query, key, value = _common_dtype(query, key, value)
        out = cached_attention(hedgecats_cache, module, query, key, value, attention_mask,
                               g=module.mixer(hidden), scale=scaling,
                               swa_drop=_ssd_mask(rt, query.shape[0], query.shape[1], query.device)
                               if module.training and rt.mode == "hybrid" else None)
        return out.transpose(1, 2).contiguous(), None
    _check_no_evicted_keys(key, kwargs.get("position_ids"), rt)
    # the padding mask costs a host synchronisation, which softmax mode does not need (it
    # would break the capture of a decode step in a CUDA graph)
    kpm = (key_padding_mask(attention_mask, key.shape[2])
           if rt.mode != "softmax" or rt.observer is not None else None)
    # the output-MSE objectives compare with the teacher's output: handed over after the
    # attention where it is the plain causal softmax they define, instead of computed again
    hand_over = rt.observer is not None and rt.mode == "softmax" and \
        getattr(rt.observer, "wants_teacher_output", False) and \
        _teacher_output_is_plain(dropout, key.shape[2], base_window)
    if rt.observer is not None and not hand_over:
        rt.observer(module, query, key, value, kpm, hidden)
    if rt.mode == "softmax":  # exactly the original model's attention
        out, weights = sdpa_attention_forward(
            module, query, key, value, _with_window(attention_mask, query, key, base_window),
            dropout=dropout, scaling=scaling, **kwargs)
        if hand_over:
            rt.observer(module, query, key, value, kpm, hidden,
                        teacher_output=out.transpose(1, 2))  # (B, H, T, D)
        return out, weights
    query, key, value = _common_dtype(query, key, value)
    if rt.window_shape == "terraced_end" and kpm is None and query.shape[0] > 1:
        _warn_once("a 'terraced_end' window (LoLCATs' blocks, ending at each sequence's last "
                   "token) runs a batch of several sequences with no padding in its mask: if "
                   "they were right-padded without a mask (lm-eval), the shorter ones get "
                   "blocks that end at the padded length; evaluate with batch size 1 or pass "
                   "the attention mask")
    swa_drop = _ssd_mask(rt, query.shape[0], query.shape[1], query.device) \
        if module.training and rt.mode == "hybrid" else None
    # the maps go in as modules: where the fused kernel takes the call they run inside its
    # autograd Function (``triton_hybrid.fold_maps``), elsewhere hybrid_attention runs them
    out = hybrid_attention(
        query, key, value, None, None, maps=(module.phi_q, module.phi_k), window=rt.window,
        mode=rt.mode, g=module.mixer(hidden),
        shared_norm=module.mixer.shared_norm, overlap=rt.overlap, rescale=rt.rescale,
        la_span=rt.la_span, n_sinks=rt.n_sinks, swa_drop=swa_drop, key_padding_mask=kpm,
        scale=scaling, eps=rt.eps, backend=rt.backend, window_shape=rt.window_shape,
    )  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def _teacher_output_is_plain(dropout: float, n_keys: int, base_window: int | None) -> bool:
    """Whether the model's own softmax output here is plain causal softmax attention, the
    target the output-MSE objectives define: no attention dropout (a base with it, in train
    mode, would hand over a random target) and no base window that acts (Mistral-7B-v0.1's 4096
    does past 4,096 keys; the objectives, the health check and ``weights_xent`` use full causal
    attention). Elsewhere the observer is called before the attention, without it."""
    return not dropout and (base_window is None or n_keys <= base_window)


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


def _call_cache(kwargs: dict):
    """The cache a decoder call carries (``cache`` since transformers 5.24, before that
    ``past_key_values``)."""
    cache = kwargs.get("cache")
    return kwargs.get("past_key_values") if cache is None else cache


def _call_inputs(module: nn.Module, args, kwargs):
    """Forward pre-hook of a converted ``self_attn``: hand the attention function what this
    call needs besides q, k and v, as keyword arguments of the call: the layer input for
    output-gate mixers (``hedgecats_input``), and, with a ``HybridCache`` in the call, the
    layer's slot, checked and bound (``hedgecats_cache``, ``HybridCache.bind``)."""
    extra = {}
    if module.mixer.needs_input:
        extra["hedgecats_input"] = kwargs.get("hidden_states", args[0] if args else None)
    cache = _call_cache(kwargs)
    if isinstance(cache, HybridCache):
        extra["hedgecats_cache"] = cache.bind(module.hedgecats.layer_idx, module)
    return (args, {**kwargs, **extra}) if extra else None


def _install(attn: nn.Module, config: HybridConfig, layer_idx: int) -> None:
    """Give a ``self_attn`` (its ``phi_q``, ``phi_k`` and ``mixer`` already added) its runtime
    and the forward pre-hook that passes the attention function its per-call inputs."""
    attn.hedgecats = LayerRuntime.from_config(config, layer_idx)
    attn.register_forward_pre_hook(_call_inputs, with_kwargs=True)


def check_positions(model: nn.Module, args, kwargs) -> None:
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
            f"input is longer than the positions the model was trained on; shorten it (in "
            f"training: the data's seq_len; in generation: the prompt or max_new_tokens)")




def register() -> None:
    """Register the attention function (and its mask) with transformers as ``\"hedgecats\"``."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, hedgecats_attention_forward)
    # without a mask entry the attention mask arrives as None even with padding
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ----------------------------------------------------------------------------- conversion
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


def convert_layers(model: nn.Module, config: HybridConfig) -> list[int]:
    """Make the layers ``config`` names hybrid, in place; return their indices.

    All checks run before anything is built: an unsupported family, a layer index out of range,
    a head dimension the rectangular projection cannot halve, a layer already converted raise
    ``ValueError``. Each converted ``self_attn`` gets ``phi_q``, ``phi_k`` and ``mixer`` (fp32
    master weights on its device), its runtime and its pre-hook; the model routes attention
    through ``"hedgecats"``, records ``config`` and refuses positions past its
    ``max_position_embeddings`` (``check_positions``). The model's class is
    ``models.convert``'s business (``convert_to_hybrid``)."""
    if not isinstance(config, HybridConfig):
        raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
    layers = decoder_layers(model)
    H, Hkv, D, hidden = head_dims(model.config)
    feature_dim(D, config.feature_projection)  # raises if D cannot be halved
    n = len(layers)
    todo = list(range(n)) if config.layers is None else sorted(config.layers)
    bad = [i for i in todo + list(config.layer_windows or {}) if not 0 <= i < n]
    if bad:
        raise ValueError(f"layer indices {sorted(set(bad))} are out of range for a model of {n} "
                         f"layers")
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
        for name in HYBRID_PARTS:  # fp32 master weights on the layer's device
            getattr(attn, name).to(device=ref.device, dtype=torch.float32)
        _install(attn, config, i)
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
    return todo
