"""transformers-native hybrids: configs and model classes registered with the Auto classes.

After ``import hedgecats`` a converted model saves and loads like any transformers model:

    convert_to_hybrid(model, HybridConfig(window=64))     # model is now a HedgecatsLlamaForCausalLM
    model.save_pretrained("out")                          # config.json + model.safetensors
    AutoModelForCausalLM.from_pretrained("out")           # the same hybrid, the same logits

``config.json`` is the base model's config with ``model_type`` ``hedgecats_<family>`` (a type
transformers alone does not know: without hedgecats ``AutoConfig`` fails and names it, it never
loads a softmax model) and a ``hybrid`` section::

    "hybrid": {
      "format": "hedgecats-hybrid/1",
      "family": "llama",                      base model type (llama | mistral | qwen2)
      "config": {...},                        HybridConfig.to_dict(): the architecture, and the
                                              runtime switches (mode, windows, ...) the layers ran
                                              with when saved
      "base_sliding_window": null,            the base model's own window (Mistral-7B-v0.1: 4096),
                                              applied by the hedgecats attention function
      "adapter": null,                        or the subfolder of a peft LoRA adapter
      "hedgecats_version": "0.1.0"
    }

The weights hold the base model and every feature-map / mixer tensor (fp32). LoRA is either
merged into the weights (``save_hybrid(model, dir, lora="merge")``) or kept as a peft adapter
(``lora="adapter"``: ``<dir>/adapter/adapter_config.json`` + ``adapter_model.safetensors``,
loaded back through transformers' peft integration). Loading is exact: a missing, unexpected or
mis-shaped tensor is an error that names the hybrid section, never a fresh initialisation.

``convert_to_hybrid`` turns a ``LlamaForCausalLM`` / ``MistralForCausalLM`` /
``Qwen2ForCausalLM`` into the matching ``Hedgecats...ForCausalLM`` (a subclass: ``isinstance``
still holds) by setting its class; the live model keeps its base config (``model_type``
``llama``...), the hybrid config is what ``save_pretrained`` writes. The class also gives
``generate``, and any call with ``use_cache`` that brings no cache, the constant-memory
``HybridCache`` (``models.cache``) where transformers would make its full ``DynamicCache``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from ..version import __version__
from .cache import CACHE_KWARG, HybridCache, unsupported_reason
from .config import HybridConfig
from .layer import convert_layers
from .structure import family, hybrid_layers, unwrap

log = logging.getLogger(__name__)

__all__ = [
    "FORMAT",
    "HedgecatsLlamaConfig",
    "HedgecatsLlamaForCausalLM",
    "HedgecatsMistralConfig",
    "HedgecatsMistralForCausalLM",
    "HedgecatsQwen2Config",
    "HedgecatsQwen2ForCausalLM",
    "HybridCausalLM",
    "adopt",
    "hybrid_section",
    "load_pretrained_hybrid",
    "read_hybrid_config",
    "register",
    "save_hybrid",
]

FORMAT = "hedgecats-hybrid/1"
ADAPTER_DIR = "adapter"
_SECTION_KEYS = {"format", "family", "config", "base_sliding_window", "adapter",
                 "hedgecats_version"}
#: runtime switches that ``set_attention_mode`` sets on every layer at once (all but the window,
#: which a saved hybrid records per layer)
_UNIFORM_SWITCHES = tuple(n for n in HybridConfig.RUNTIME if n != "window")


# ----------------------------------------------------------------------------- configs
@strict
class HedgecatsLlamaConfig(LlamaConfig):
    """A Llama config plus the ``hybrid`` section (module docstring)."""

    model_type = "hedgecats_llama"
    hedgecats_family = "llama"
    hybrid: dict | None = None


@strict
class HedgecatsMistralConfig(MistralConfig):
    """A Mistral config plus the ``hybrid`` section (module docstring)."""

    model_type = "hedgecats_mistral"
    hedgecats_family = "mistral"
    hybrid: dict | None = None


@strict
class HedgecatsQwen2Config(Qwen2Config):
    """A Qwen2 config plus the ``hybrid`` section (module docstring)."""

    model_type = "hedgecats_qwen2"
    hedgecats_family = "qwen2"
    hybrid: dict | None = None


# ----------------------------------------------------------------------------- model classes
def _lora_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module with peft LoRA layers injected (a ``base_layer``)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "base_layer") and hasattr(m, "lora_A")]


class HybridCausalLM:
    """What the ``Hedgecats...ForCausalLM`` classes add to their transformers base class:
    building the hybrid from the ``hybrid`` section, writing it back, exact loading, and the
    constant-memory cache in ``generate`` (and, through each class's ``forward``
    (``_with_call_cache``), in every call that asks transformers for a cache)."""

    _keep_in_fp32_modules = ["phi_q", "phi_k", "mixer"]

    def __init__(self, config, *args, **kwargs) -> None:
        section = _validate_section(getattr(config, "hybrid", None),
                                    where=getattr(config, "_name_or_path", "") or "the config")
        super().__init__(config, *args, **kwargs)
        # the layers only: the model's class is already the hybrid one
        convert_layers(self, HybridConfig.from_dict(section["config"]))

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, save_directory, *args, state_dict=None, hybrid_adapter=None,
                        **kwargs):
        """``PreTrainedModel.save_pretrained``, writing the hybrid config (module docstring).

        A model loaded with its LoRA adapter saves it again as an adapter (so ``push_to_hub``
        uploads what was loaded); other models with LoRA layers injected are refused:
        ``save_hybrid(model, dir, lora=...)`` chooses between merging and an adapter.
        ``hybrid_adapter`` (used by ``save_hybrid``) records the adapter subfolder."""
        if state_dict is None and "_hedgecats_peft" in self.__dict__:
            return save_hybrid(self, save_directory, lora="adapter", **kwargs)
        if state_dict is None and _lora_modules(self):
            raise ValueError(
                "this hybrid has LoRA layers: save it with hedgecats.models.hf.save_hybrid(model, "
                "dir, lora='merge') (LoRA merged into the weights) or lora='adapter' (a peft "
                "adapter beside the hybrid)")
        live = self.config
        self.config = pretrained_config(self, adapter=hybrid_adapter)
        try:
            return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        finally:
            self.config = live

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, exact: every tensor of the checkpoint must be a
        parameter of the hybrid its config describes and the other way round; the LoRA adapter
        named by the section is loaded through transformers' peft integration."""
        want_info = kwargs.pop("output_loading_info", False)
        # mismatched shapes are reported back (not raised by transformers) so that the error
        # below names the hybrid section; they are never accepted
        kwargs["ignore_mismatched_sizes"] = True
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args,
                                              output_loading_info=True, **kwargs)
        bad = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys",
                                                      "mismatched_keys")}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            desc = "; ".join(f"{k.replace('_', ' ')}: {v[:6]}{' ...' if len(v) > 6 else ''} "
                             f"({len(v)})" for k, v in bad.items())
            raise ValueError(
                f"{str(pretrained_model_name_or_path)!r}: the weights do not match the hybrid that "
                f"config.json's 'hybrid' section describes ({desc}); the config and the weights "
                f"come from different models or conversions")
        adapter = model.config.hybrid.get("adapter")
        if adapter:
            _load_adapter(model, str(pretrained_model_name_or_path), adapter,
                          revision=kwargs.get("revision"))
        model.eval()
        return (model, info) if want_info else model

    # ------------------------------------------------------------------ generation
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' cache choice, then its default ``DynamicCache`` replaced by a
        ``HybridCache`` unless a converted layer runs ``softmax`` (which reads every key: the
        full cache stays, and a warning says so). A user's own cache is kept."""
        impl = generation_config.cache_implementation
        if impl not in (None, "dynamic") and _full_cache_reason(self) is None:
            raise ValueError(
                f"cache_implementation={impl!r} is a transformers cache of every key, laid out "
                f"for softmax layers; a hedgecats hybrid generates with its own HybridCache "
                f"(leave cache_implementation unset; for CUDA graphs see "
                f"hedgecats.models.decode)")
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        for key in ("cache", "past_key_values"):
            made = model_kwargs.get(key)
            if type(made) is DynamicCache and not getattr(made, "_is_user_defined", False):
                why = _full_cache_reason(self)
                if why is not None:
                    _warn_once(f"{type(self).__name__}: {why}: generating with transformers' "
                               f"full DynamicCache (memory grows with the context)")
                else:
                    model_kwargs[key] = HybridCache(self)


def _load_adapter(model: nn.Module, where: str, subfolder: str, revision: str | None) -> None:
    """Inject the peft LoRA adapter saved in ``where/subfolder`` into ``model`` in place, with
    peft's own loader (``PeftModel.from_pretrained``; transformers' integration needs a newer
    peft than some installations have). The ``PeftModel`` is kept on the model, so that
    ``save_hybrid(model, dir, lora=...)`` writes the adapter in peft's format again."""
    from peft import PeftModel

    path = Path(where) / subfolder
    if path.is_dir():
        peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False)
    else:  # a hub id
        peft_model = PeftModel.from_pretrained(model, where, subfolder=subfolder,
                                               revision=revision, is_trainable=False)
    model.__dict__["_hedgecats_peft"] = peft_model  # not a submodule: no second state-dict path


#: positional arguments of a causal LM's forward before its cache (input_ids, attention_mask,
#: position_ids): a call that passes more names its cache itself
_ARGS_BEFORE_CACHE = 3


def _with_call_cache(forward):
    """A transformers causal LM's ``forward``, with the constant-memory ``HybridCache`` where
    transformers would make its full ``DynamicCache``: a call with ``use_cache`` (given, or the
    config's default) and no cache gets the cache ``_call_cache`` chooses, as transformers' own
    hybrid models get theirs; the output carries it to the next call. The signature stays
    ``forward``'s (``generate`` reads it to choose what to pass)."""

    @functools.wraps(forward)
    def forward_with_call_cache(self, *args, **kwargs):
        if len(args) <= _ARGS_BEFORE_CACHE and kwargs.get("cache") is None and \
                kwargs.get("past_key_values") is None:
            cache = _call_cache(self, kwargs.get("use_cache"))
            if cache is not None:
                kwargs[CACHE_KWARG] = cache
        return forward(self, *args, **kwargs)

    return forward_with_call_cache


def _call_cache(model: nn.Module, use_cache: bool | None) -> HybridCache | None:
    """The cache for a call of ``model`` that brings none, or ``None`` where transformers'
    choice stays: no cache without ``use_cache`` (``None``: the config's), and transformers'
    ``DynamicCache`` in train mode (nothing continues a training forward, and the cached path
    would keep its state under autograd), with an observer (attention transfer, branch usage:
    they read whole sequences; ``HybridCache.bind`` refuses them), and where the model needs
    every key (``_full_cache_reason``; said once when the call asked for a cache)."""
    wanted = model.config.use_cache if use_cache is None else use_cache
    if not wanted or model.training:
        return None
    if any(a.hedgecats.observer is not None for _, a in hybrid_layers(model)):
        return None
    why = _full_cache_reason(model)
    if why is not None:
        if use_cache:
            _warn_once(f"{type(model).__name__}: {why}: a call with use_cache keeps "
                       f"transformers' full DynamicCache (memory grows with the context)")
        return None
    return HybridCache(model)


def _full_cache_reason(model: nn.Module) -> str | None:
    """Why ``generate`` must keep every key (a ``DynamicCache``), or ``None``: a converted layer
    in mode ``softmax`` (it reads every key), or one the ``HybridCache`` cannot serve
    (``cache.unsupported_reason``: a terraced window, key maps per query head under GQA)."""
    for i, a in hybrid_layers(model):
        if a.hedgecats.mode == "softmax":
            return "a converted layer runs mode 'softmax', which reads every earlier key"
        why = unsupported_reason(a)
        if why is not None:
            return f"layer {i} cannot use the constant-memory HybridCache because of {why}"
    return None


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


class HedgecatsLlamaForCausalLM(HybridCausalLM, LlamaForCausalLM):
    config_class = HedgecatsLlamaConfig
    forward = _with_call_cache(LlamaForCausalLM.forward)


class HedgecatsMistralForCausalLM(HybridCausalLM, MistralForCausalLM):
    config_class = HedgecatsMistralConfig
    forward = _with_call_cache(MistralForCausalLM.forward)


class HedgecatsQwen2ForCausalLM(HybridCausalLM, Qwen2ForCausalLM):
    config_class = HedgecatsQwen2Config
    forward = _with_call_cache(Qwen2ForCausalLM.forward)


#: base class -> (hybrid class, family)
_CLASSES = {
    LlamaForCausalLM: HedgecatsLlamaForCausalLM,
    MistralForCausalLM: HedgecatsMistralForCausalLM,
    Qwen2ForCausalLM: HedgecatsQwen2ForCausalLM,
}


def register() -> None:
    """Register the hybrid configs and classes with ``AutoConfig`` / ``AutoModelForCausalLM``
    (``import hedgecats`` does it)."""
    for cls in _CLASSES.values():
        AutoConfig.register(cls.config_class.model_type, cls.config_class, exist_ok=True)
        AutoModelForCausalLM.register(cls.config_class, cls, exist_ok=True)


def adopt(model: nn.Module) -> None:
    """Give a freshly converted model its hybrid class (``convert_to_hybrid`` calls this), so
    that ``save_pretrained`` and ``generate`` know it is a hybrid. Other classes (a bare
    ``LlamaModel``, a subclass) keep theirs, with a warning: ``save_pretrained`` would not
    record the conversion."""
    if isinstance(model, HybridCausalLM):
        return
    new = _CLASSES.get(type(model))
    if new is None:
        log.warning("%s is not one of %s: it stays as it is, and its save_pretrained does not "
                    "record the conversion (load stage checkpoints with load_hybrid instead)",
                    type(model).__name__, ", ".join(c.__name__ for c in _CLASSES))
        return
    model.__class__ = new


# ----------------------------------------------------------------------------- the section
def _validate_section(section, where: str) -> dict:
    if not isinstance(section, dict):
        raise ValueError(
            f"{where}: not a hedgecats hybrid (config.json has no 'hybrid' section). A plain "
            f"model is converted with hedgecats.models.convert_to_hybrid, a trained stage is "
            f"turned into a hybrid directory with `hedgecats export`")
    if section.get("format") != FORMAT:
        raise ValueError(f"{where}: hybrid section format {section.get('format')!r}, this "
                         f"hedgecats reads {FORMAT!r}")
    unknown = sorted(set(section) - _SECTION_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} in the hybrid section; valid: "
                         f"{sorted(_SECTION_KEYS)}")
    if not isinstance(section.get("config"), dict):
        raise ValueError(f"{where}: the hybrid section has no 'config' (a HybridConfig dict)")
    return section


def live_hybrid_config(model: nn.Module) -> HybridConfig:
    """The ``HybridConfig`` the converted layers run with now: the conversion's architecture
    and the layers' current switches (their windows become ``window`` + ``layer_windows``)."""
    inner = unwrap(model)
    layers = dict(hybrid_layers(inner))
    if not layers:
        raise ValueError("the model has no hybrid layers (convert it with convert_to_hybrid)")
    base: HybridConfig = inner.hedgecats_config
    first = next(iter(layers.values())).hedgecats
    switches = {name: getattr(first, name) for name in _UNIFORM_SWITCHES}
    for i, attn in layers.items():
        differ = [n for n in _UNIFORM_SWITCHES if getattr(attn.hedgecats, n) != switches[n]]
        if differ:
            raise ValueError(f"layer {i} differs from layer {first.layer_idx} in {differ}: a "
                             f"saved hybrid has one value of these switches for every layer "
                             f"(set them with set_attention_mode)")
    windows = {i: a.hedgecats.window for i, a in layers.items()}
    window = base.window if base.window in windows.values() else next(iter(windows.values()))
    per_layer = {i: w for i, w in windows.items() if w != window} or None
    return replace(base, window=window, layer_windows=per_layer, **switches)


def hybrid_section(model: nn.Module, adapter: str | None = None) -> dict:
    """The ``hybrid`` section describing ``model`` as it runs now (module docstring)."""
    inner = unwrap(model)
    base_windows = {a.__dict__.get("hedgecats_base_window") for _, a in hybrid_layers(inner)}
    return {"format": FORMAT, "family": family(inner.config),
            "config": live_hybrid_config(inner).to_dict(),
            "base_sliding_window": next(iter(base_windows)), "adapter": adapter,
            "hedgecats_version": __version__}


def pretrained_config(model: nn.Module, adapter: str | None = None):
    """The config ``save_pretrained`` writes: the base config's fields, the hybrid class's
    ``model_type``, the live ``hybrid`` section."""
    inner = unwrap(model)
    cls = type(inner).config_class
    fields = {k: v for k, v in inner.config.to_dict().items()
              if k not in ("model_type", "transformers_version", "hybrid")}
    cfg = cls(**fields, hybrid=hybrid_section(inner, adapter))
    cfg._attn_implementation = inner.config._attn_implementation
    return cfg


# ----------------------------------------------------------------------------- save / load
def save_hybrid(model: nn.Module, save_directory: str | os.PathLike, *, lora: str | None = None,
                **kwargs) -> Path:
    """Save a hybrid (a converted model, or a peft ``PeftModel`` around one) as a
    transformers-native directory; returns it.

    Args:
        model: the hybrid. It is not modified.
        save_directory: where to write (``save_pretrained`` semantics: files are overwritten).
        lora: only for a model with LoRA: ``"merge"`` writes the LoRA-merged weights (``W + s B
            A``, as peft's merge computes it), ``"adapter"`` the unmerged weights plus the peft
            adapter in ``<dir>/adapter/``. ``None`` with LoRA present is an error.
        kwargs: passed on to ``save_pretrained`` (``max_shard_size``, ``push_to_hub``, ...).
    """
    inner = unwrap(model)
    if not isinstance(inner, HybridCausalLM):
        raise ValueError(f"{type(inner).__name__} is not a hedgecats hybrid: convert it with "
                         f"convert_to_hybrid first")
    mods = _lora_modules(inner)
    save_directory = Path(save_directory)
    if not mods:
        if lora not in (None, "merge", "adapter"):
            raise ValueError(f"lora={lora!r}; valid: 'merge', 'adapter' (or None)")
        inner.save_pretrained(save_directory, **kwargs)
        return save_directory
    if lora not in ("merge", "adapter"):
        raise ValueError(f"the model has LoRA layers: lora must be 'merge' or 'adapter', got "
                         f"{lora!r}")
    state = _base_state_dict(inner, mods, merge=lora == "merge")
    inner.save_pretrained(save_directory, state_dict=state,
                          hybrid_adapter=ADAPTER_DIR if lora == "adapter" else None, **kwargs)
    if lora == "adapter":
        peft_model = model if model is not inner else inner.__dict__.get("_hedgecats_peft")
        if peft_model is None:
            raise ValueError("the model has LoRA layers but no peft model to save them with "
                             "(LoRA injected some other way): save with lora='merge'")
        target = save_directory / ADAPTER_DIR
        peft_model.save_pretrained(target)  # peft's own adapter format
        _detach_adapter(target)
    return save_directory


def _detach_adapter(target: Path) -> None:
    """The adapter belongs to the hybrid beside it: its ``base_model_name_or_path`` (peft writes
    the path of the model it was trained from, on the exporter's machine) is cleared, so that
    nothing applies it to the base model before conversion, and peft's template card goes."""
    cfg_file = target / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["base_model_name_or_path"] = None
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (target / "README.md").unlink(missing_ok=True)


def _base_state_dict(inner: nn.Module, mods, *, merge: bool) -> dict[str, torch.Tensor]:
    """The model's tensors under their plain names (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``), without LoRA tensors; LoRA merged into the weights when ``merge``."""
    state = {}
    for name, t in inner.state_dict().items():
        if ".lora_" in name:
            continue
        state[name.replace(".base_layer.", ".")] = t
    if merge:
        for name, m in mods:
            adapters = list(m.active_adapters)
            if getattr(m, "merged", False):
                raise ValueError(f"{name}: LoRA is already merged into the weights; unmerge it "
                                 f"or save the merged model without LoRA layers")
            variants = [a for a in adapters if a in getattr(m, "lora_variant", {})
                        or getattr(m, "lora_bias", {}).get(a)]
            if variants:
                raise NotImplementedError(f"{name}: adapters {variants} are LoRA variants (DoRA, "
                                          f"LoRA bias); save them with lora='adapter'")
            w = state[f"{name}.weight"]
            for a in adapters:
                w = w + m.get_delta_weight(a).to(w.dtype)
            state[f"{name}.weight"] = w
    return state


def read_hybrid_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a local directory, checked to be a hedgecats hybrid's (an error
    that says what the directory is otherwise)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a model directory")
    cfg = json.loads(cfg_file.read_text())
    mt = cfg.get("model_type")
    if not str(mt).startswith("hedgecats_"):
        raise ValueError(
            f"{str(path)!r} is not a hedgecats hybrid: its config.json has model_type {mt!r}. "
            f"Convert a plain model with hedgecats.models.convert_to_hybrid, or turn a trained "
            f"stage into a hybrid directory with `hedgecats export`")
    _validate_section(cfg.get("hybrid"), where=str(path))
    return cfg


def load_pretrained_hybrid(path: str, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` of a hybrid, with a clear error for a local
    directory that is not one (a hub id is checked by the loaded config instead)."""
    if Path(path).is_dir():
        read_hybrid_config(path)
    elif path.startswith(("/", "./", "../", "~")) or path.count("/") > 1:
        raise FileNotFoundError(f"{path!r}: no such directory (and not a hub id 'org/name')")
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if not isinstance(model, HybridCausalLM):
        raise ValueError(f"{path!r} loaded as {type(model).__name__}, not a hedgecats hybrid")
    return model
