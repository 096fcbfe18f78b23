"""Stage checkpoints: the few trained tensors of a hybrid, and how to rebuild the model from them.

A stage checkpoint (``stage.pt``, written with ``torch.save``) never holds the frozen base
weights; it is a plain dict (no Lightning object inside, loadable with ``weights_only=True``):

    format         "hedgecats-stage/1"
    stage          name of the stage class that wrote it (e.g. "AttentionTransfer")
    base_model     id or path given to ``AutoModelForCausalLM.from_pretrained``
    base_model_relative   (a local base model only) its path relative to the directory of
                   ``stage.pt``: a run directory that moved still finds the base model it
                   produced (``resolve_base_model``)
    revision       its revision (``None`` = default branch / a local directory)
    hybrid_config  ``HybridConfig.to_dict()`` used at conversion (``None``: not converted)
    lora_config    keyword arguments of ``peft.LoraConfig`` (``None``: no LoRA)
    tensors        {name: tensor}: every trainable tensor and every feature-map, mixer and
                   LoRA tensor (trained in an earlier stage or this one), named as in
                   ``unwrap(model).named_parameters()`` -- the transformers model itself, with
                   peft's LoRA layers injected in place when there is LoRA, e.g.
                   ``model.layers.0.self_attn.phi_q.weight`` and
                   ``model.layers.0.self_attn.q_proj.lora_A.default.weight``
    meta           free-form dict (steps, metrics, torch_dtype)

``load_hybrid(path)`` rebuilds base model + conversion + feature maps + LoRA (merged by default)
from it. Loading is exact: a tensor the model does not have, or a hybrid / LoRA parameter the
checkpoint does not have, raises ``KeyError``. This module never imports lightning.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .config import HybridConfig
from .convert import convert_to_hybrid
from .io import atomic_write
from .structure import HYBRID_PARTS, hybrid_parameter_names, unwrap

log = logging.getLogger(__name__)

__all__ = [
    "DTYPES",
    "FORMAT",
    "build_hybrid",
    "check_local_model",
    "converted_layers",
    "load_hybrid",
    "load_tensors",
    "read_stage",
    "resolve_base_model",
    "restrict_to_layers",
    "save_stage",
    "stage_tensors",
]

FORMAT = "hedgecats-stage/1"
#: names accepted wherever a dtype is configured (YAML ``torch_dtype``, ``--dtype``)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: short names for the same dtypes
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_LORA_MARK = ".lora_"


def resolve_dtype(dtype: str | torch.dtype | None, device: str | None = None
                  ) -> torch.dtype | None:
    """The torch dtype a name means (``None`` and dtypes pass through). ``"auto"``, allowed
    when a ``device`` is given, is bfloat16 on CUDA and float32 elsewhere."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and device is not None:
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    name = DTYPE_ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        valid = [*(["auto"] if device is not None else []), *DTYPES, *DTYPE_ALIASES]
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(valid)}")
    return DTYPES[name]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor, gathering a DTensor (FSDP2) first: a collective on every rank."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to("cpu").clone()


def stage_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a stage checkpoint holds: every trainable tensor, plus every hybrid (feature map,
    mixer) and LoRA parameter even when frozen in this stage -- the model is not complete
    without them. Never the base weights."""
    inner = unwrap(model)
    keep = set(hybrid_parameter_names(inner)) | set(lora_parameter_names(inner))
    return {n: _full(p) for n, p in inner.named_parameters() if p.requires_grad or n in keep}


def save_stage(path: str | os.PathLike, model: nn.Module, *, base_model: str,
               revision: str | None = None, hybrid_config: HybridConfig | dict | None = None,
               lora_config: dict | None = None, stage: str | None = None,
               tensors: dict[str, torch.Tensor] | None = None, meta: dict | None = None) -> Path:
    """Write a stage checkpoint (format in the module docstring); returns its path.

    ``tensors`` defaults to ``stage_tensors(model)``. The file is written atomically (a
    temporary name, flushed to disk, then renamed), so a crash or a full disk never leaves a
    half-written ``stage.pt`` (``io.WriteFailedError`` names it and keeps the previous one).
    """
    if isinstance(hybrid_config, HybridConfig):
        hybrid_config = hybrid_config.to_dict()
    tensors = stage_tensors(model) if tensors is None else tensors
    if not tensors:
        raise ValueError("the model has no trainable tensors: nothing to save in a stage checkpoint")
    path = Path(path)
    payload = {"format": FORMAT, "stage": stage, "base_model": str(base_model),
               "revision": revision, "hybrid_config": hybrid_config,
               "lora_config": lora_config, "tensors": tensors, "meta": dict(meta or {})}
    if Path(base_model).is_dir():  # a local model: also where it lies relative to stage.pt
        payload["base_model_relative"] = os.path.relpath(Path(base_model).resolve(),
                                                         path.parent.resolve())
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as f:
        torch.save(payload, f)
    return path


def read_stage(path: str | os.PathLike) -> dict:
    """Load and validate a stage checkpoint dict (tensors on CPU); a missing or damaged file
    is an error that names it."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no such stage checkpoint: {str(path)!r}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, ValueError, __import__("pickle").UnpicklingError) as err:
        raise ValueError(f"cannot read stage checkpoint {str(path)!r} "
                         f"({str(err).splitlines()[0][:200]}): it is damaged, truncated or not a "
                         "stage checkpoint. In a pipeline run, delete that stage's done file: "
                         "the stage then resumes from its last checkpoint and writes stage.pt "
                         "again") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{str(path)!r} is not a hedgecats stage checkpoint (format {got!r}, "
                         f"expected {FORMAT!r}); a Lightning .ckpt resumes a stage with ckpt_path, "
                         "stage.pt starts the next one with init_from")
    return payload


#: a converted layer's own tensor: ``model.layers.3.self_attn.phi_q.weight`` -> layer 3
_HYBRID_TENSOR = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:%s)\." % "|".join(HYBRID_PARTS))


def converted_layers(payload: dict) -> list[int]:
    """The layers a stage checkpoint converted: those its feature maps and mixers belong to."""
    return sorted({int(m.group(1)) for name in payload["tensors"]
                   if (m := _HYBRID_TENSOR.search(name))})


def restrict_to_layers(payload: dict, layers: Iterable[int], where: str = "the checkpoint"
                       ) -> dict:
    """A copy of ``payload`` that converts only ``layers`` (a subset of ``converted_layers``):
    ``hybrid_config.layers`` (and ``layer_windows``) name them, and the feature maps and mixers
    of the other layers are dropped; the other layers run softmax attention. A layer that
    ``payload`` did not convert has no trained feature maps: ``ValueError``."""
    layers = sorted(set(int(i) for i in layers))
    have = converted_layers(payload)
    missing = sorted(set(layers) - set(have))
    if missing:
        raise ValueError(f"{where} holds feature maps for layers {have} only; layers {missing} "
                         "were never converted there (kept softmax), so nothing trained their "
                         f"feature maps: name layers among {have}, or start from a stage that "
                         "converted them")
    cfg = dict(payload["hybrid_config"] or {})
    cfg["layers"] = layers
    if cfg.get("layer_windows"):
        cfg["layer_windows"] = {int(i): w for i, w in cfg["layer_windows"].items()
                                if int(i) in layers} or None
    tensors = {n: t for n, t in payload["tensors"].items()
               if (m := _HYBRID_TENSOR.search(n)) is None or int(m.group(1)) in layers}
    return {**payload, "hybrid_config": cfg, "tensors": tensors}


def resolve_base_model(payload: dict, stage_path: str | os.PathLike) -> str:
    """The base model of a stage checkpoint: the local directory recorded relative to the
    checkpoint when it exists there (the run directory may have moved), else the recorded id or
    path."""
    rel = payload.get("base_model_relative")
    if rel:
        here = Path(stage_path).parent / rel
        if here.is_dir():
            return str(here.resolve())
    return payload["base_model"]


def check_local_model(name: str) -> None:
    """A value that can only be a local path (absolute, ``./``, ``~``, or with two or more
    slashes; hub ids are ``name`` or ``org/name``) must exist: ``FileNotFoundError`` says "no
    such directory" instead of the hub's "Repo id must be in the form ..."."""
    name = str(name)
    local = name.startswith(("/", "./", "../", "~")) or name.count("/") >= 2
    if local and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"no such directory: {name!r} (a local model path; a model id "
                                "on the hub has the form name or org/name)")


def build_hybrid(base_model: str, *, revision: str | None = None,
                 hybrid_config: HybridConfig | dict | None = None, lora_config: dict | None = None,
                 dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
                 ) -> nn.Module:
    """Base model from ``from_pretrained`` -> ``convert_to_hybrid`` -> peft LoRA (if any).

    Every base parameter is frozen; the caller decides what trains. Returns the ``PeftModel``
    when there is LoRA, else the transformers model.
    """
    check_local_model(base_model)
    model = AutoModelForCausalLM.from_pretrained(base_model, revision=revision,
                                                 dtype=resolve_dtype(dtype))
    if device is not None:
        model.to(device)
    model.requires_grad_(False)
    if hybrid_config is not None:
        if isinstance(hybrid_config, dict):
            hybrid_config = HybridConfig.from_dict(hybrid_config)
        convert_to_hybrid(model, hybrid_config)
        model.requires_grad_(False)
    if lora_config is not None:
        model = add_lora(model, lora_config)
    return model


def add_lora(model: nn.Module, lora_config: dict) -> nn.Module:
    """Wrap with peft LoRA (``lora_config``: ``peft.LoraConfig`` keyword arguments)."""
    from peft import LoraConfig, get_peft_model  # only with LoRA: peft is slow to import

    cfg = dict(lora_config)
    cfg.setdefault("task_type", "CAUSAL_LM")
    return get_peft_model(model, LoraConfig(**cfg))


def lora_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, _ in unwrap(model).named_parameters() if _LORA_MARK in n]


def load_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], *,
                 required: Iterable[str] | None = None) -> list[str]:
    """Copy ``tensors`` into ``unwrap(model)``'s parameters by name, exactly.

    Raises ``KeyError`` for a name the model lacks (unexpected) and for a ``required`` name the
    tensors lack (missing; default: every hybrid and LoRA parameter of the model). Shapes must
    match. Returns the loaded names.
    """
    inner = unwrap(model)
    params = dict(inner.named_parameters())
    unexpected = sorted(set(tensors) - set(params))
    if unexpected:
        raise KeyError(f"checkpoint tensors not in the model: {unexpected[:8]}"
                       f"{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)} in all); "
                       "was it written for another base model, conversion or LoRA config?")
    if required is None:
        required = set(hybrid_parameter_names(inner)) | set(lora_parameter_names(inner))
    missing = sorted(set(required) - set(tensors))
    if missing:
        raise KeyError(f"model parameters absent from the checkpoint: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all)")
    with torch.no_grad():
        for name, t in tensors.items():
            p = params[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(f"shape mismatch for {name!r}: model {tuple(p.shape)}, "
                                 f"checkpoint {tuple(t.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    return sorted(tensors)


def load_hybrid(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                dtype: str | torch.dtype | None = None, merge_lora: bool = True,
                base_model: str | None = None):
    """Rebuild a trained hybrid from a stage checkpoint, without Lightning.

    Args:
        path: a ``stage.pt`` (format in the module docstring).
        device, dtype: where and in what dtype to build the base model (default: the dtype the
            stage trained with, recorded in ``meta["torch_dtype"]``, else the checkpoint's own).
        merge_lora: merge LoRA into the base weights and return the plain transformers model
            (default); ``False`` returns the ``PeftModel``.
        base_model: override the recorded base model id/path (by default the recorded one, or
            the local directory at the same place relative to ``path`` when the run moved).

    Returns:
        ``(model, tokenizer, info)``: the model in eval mode; the tokenizer from the base model's
        id/path (``None`` if it has none); ``info`` = the checkpoint dict without ``tensors``.
    """
    payload = read_stage(path)
    base = base_model or resolve_base_model(payload, path)
    dtype = dtype if dtype is not None else payload["meta"].get("torch_dtype")
    model = build_hybrid(base, revision=payload["revision"], hybrid_config=payload["hybrid_config"],
                         lora_config=payload["lora_config"], dtype=dtype, device=device)
    load_tensors(model, payload["tensors"])
    if payload["lora_config"] is not None and merge_lora:
        model = model.merge_and_unload()
    model.eval()
    tokenizer = None
    try:
        tokenizer = AutoTokenizer.from_pretrained(base, revision=payload["revision"])
    except (OSError, ValueError) as err:  # a base model saved without a tokenizer
        log.info("no tokenizer for %r (%s)", base, err)
    info = {k: v for k, v in payload.items() if k != "tensors"}
    info["base_model_recorded"], info["base_model"] = payload["base_model"], base  # as loaded
    info["tensor_names"] = sorted(payload["tensors"])
    return model, tokenizer, info
