"""Load what ``hedgecats evaluate --model`` names: a stage checkpoint, or a transformers model
(path or hub id), converted on the fly when a ``HybridConfig`` YAML is given."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from hedgecats.models import HybridConfig, convert_to_hybrid, stage_files
from hedgecats.models.stage_files import resolve_dtype

log = logging.getLogger(__name__)

__all__ = ["LoadedModel", "check_base_model", "is_stage_checkpoint", "load_for_eval",
           "peek_base_model", "peek_stage", "read_hybrid_config", "resolve_dtype", "stage_checkpoint_path"]

#: keys under which a stage checkpoint's info may name its base model
_BASE_KEYS = ("base_model", "base_model_id", "model_id", "base_model_name_or_path")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    source: str            # "stage_checkpoint" | "transformers" | "transformers+hybrid"
    base_model: str | None
    info: dict = field(default_factory=dict)


def read_hybrid_config(path: str | Path) -> HybridConfig:
    """A ``HybridConfig`` from YAML: its fields at the top level, or LightningCLI style
    (``class_path`` + ``init_args``), or under a ``hybrid:`` / ``hybrid_config:`` key."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"--hybrid {str(path)!r} is not a file")
    d = yaml.safe_load(p.read_text()) or {}
    if not isinstance(d, dict):
        # ValueError, not TypeError: bad user input, reported by the CLI
        raise ValueError(f"--hybrid {str(path)!r} must hold a mapping of HybridConfig fields")  # noqa: TRY004
    for key in ("hybrid", "hybrid_config"):
        if isinstance(d.get(key), dict):
            d = d[key]
    if "init_args" in d:
        d = d["init_args"] or {}
    try:
        return HybridConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--hybrid {str(path)!r}: {e}") from e


def _same_model(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def check_base_model(base: str | None, expected: str | None, what: str = "--expect-base") -> None:
    """Raise if a checkpoint's base model differs from the one it is compared against."""
    if expected is None:
        return
    if base is None:
        raise ValueError(f"the checkpoint does not record its base model, so it cannot be checked "
                         f"against {what} {expected!r}")
    if not _same_model(base, expected):
        raise ValueError(f"the checkpoint was trained from base model {base!r}, not {expected!r} "
                         f"({what}); evaluate it against its own base model")


def _load_hybrid(path: str, device: str, dtype: torch.dtype):
    return stage_files.load_hybrid(path, device=device, dtype=dtype)


def is_stage_checkpoint(spec: str) -> bool:
    """An existing path that is not a transformers model directory (``config.json``)."""
    p = Path(spec).expanduser()
    return p.exists() and not _is_transformers_dir(p)


def stage_checkpoint_path(spec: str) -> Path:
    """``stage.pt`` itself, or the ``stage.pt`` inside a run directory."""
    p = Path(spec).expanduser()
    if p.is_dir():
        if not (p / "stage.pt").is_file():
            raise ValueError(f"--model {spec!r} is a directory with neither config.json (a "
                             "transformers model) nor stage.pt (a stage checkpoint)")
        return p / "stage.pt"
    return p


def peek_stage(spec: str) -> dict:
    """A stage checkpoint's dict (tensors included, on CPU: they are small), without building
    the model; raises ``ValueError`` if it cannot be read."""
    try:
        return stage_files.read_stage(stage_checkpoint_path(spec))
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise ValueError(f"cannot read stage checkpoint {spec!r}: {e}") from e


def peek_base_model(spec: str) -> str | None:
    """The base model recorded in a stage checkpoint, read without building the model."""
    info = peek_stage(spec)
    return next((str(info[k]) for k in _BASE_KEYS if info.get(k)), None)


def _is_transformers_dir(p: Path) -> bool:
    return p.is_dir() and (p / "config.json").is_file()


def load_for_eval(spec: str, *, hybrid: HybridConfig | None = None, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load ``spec`` for evaluation, in eval mode on ``device``.

    - a transformers directory (``config.json``) or a hub id: ``from_pretrained``; converted with
      ``hybrid`` (freshly initialised feature maps, from ``hybrid.seed``) when given;
    - any other existing path: a stage checkpoint through ``load_hybrid`` (``hybrid`` must then
      be ``None``: the checkpoint carries its own config).
    """
    if is_stage_checkpoint(spec):
        if hybrid is not None:
            raise ValueError(f"--hybrid converts a plain transformers model; {spec!r} is a stage "
                             "checkpoint, which carries its own HybridConfig")
        model, tok, info = _load_hybrid(str(stage_checkpoint_path(spec)), device, dtype)
        if tok is None:
            raise ValueError(f"stage checkpoint {spec!r}: its base model has no tokenizer")
        info = dict(info or {})
        base = next((str(info[k]) for k in _BASE_KEYS if info.get(k)), None)
        return LoadedModel(model.eval(), tok, "stage_checkpoint", base, info)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except OSError as e:
        raise ValueError(f"cannot load --model {spec!r} as a transformers model (a local "
                         f"directory with config.json, or a hub id reachable from here): {e}") from e
    model.to(device).eval()
    if hybrid is not None:
        convert_to_hybrid(model, hybrid)
        return LoadedModel(model, tok, "transformers+hybrid", spec,
                           {"hybrid_config": hybrid.to_dict()})
    return LoadedModel(model, tok, "transformers", spec, {})
