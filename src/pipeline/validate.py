"""Everything a pipeline can get wrong, found in seconds before anything trains.

``validate_pipeline`` checks the top-level settings, then every stage's *full* config (the
one ``config.yaml`` will hold) against the classes' signatures: class names, unknown keys (with
the nearest valid one), types, values that the classes refuse in ``__init__`` (they are
instantiated: cheap, no model is loaded), paths that must exist (or that an earlier stage
writes), then the ``evaluate:`` section (one mapping or a list). Each problem is a
``ConfigError`` naming the file, the key and the value and saying what is valid.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import glob
import importlib
import importlib.util
import inspect
import io
import math
import os
import re
import typing
from pathlib import Path

from .errors import ConfigError
from .runner import DIVERGENCE_KEYS, LOGGERS, build_cli, logger_entries, stage_config

__all__ = ["EVALUATE_KEYS", "resolve_class", "validate_pipeline"]

FIT_KEYS = ("seed_everything", "model", "data", "trainer", "optimizer", "lr_scheduler")
#: where a short class name is looked up
SHORT_NAME_MODULES = ("hedgecats.lightning_modules", "lightning.pytorch.callbacks",
                      "lightning.pytorch.loggers", "lightning.pytorch.strategies",
                      "hedgecats.data")
#: the keys of each kind of evaluation (``evaluate:``)
EVALUATE_KEYS = {
    "recall": {"kind", "stage", "model", "hybrid", "teacher", "modes", "variants", "batch_size",
               "data", "device", "precision"},
    "command": {"kind", "stage", "argv"},
}
#: init arguments that name a file or directory
PATH_KEYS = ("model_name_or_path", "init_from", "tokenizer", "data_files")
LOGGER_EXTRAS = {"tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
                 "wandb": (("wandb",), "wandb")}


def _suggest(word: str, options) -> str:
    near = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


# ----------------------------------------------------------------------------- top level
def _check_top_level(spec: dict, src: str) -> None:
    every = spec.get("checkpoint_every_n_steps")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"{src!r}: checkpoint_every_n_steps={every!r} must be an integer >= 1 "
                          "(optimiser steps between the checkpoints an interrupted stage resumes "
                          "from)")
    _check_divergence(spec.get("divergence"), f"{src!r}: divergence")
    for name, opts in logger_entries(spec):
        if name not in LOGGERS:
            raise ConfigError(f"{src!r}: loggers entry {name} is not valid; choose from "
                              f"{', '.join(LOGGERS)} (a name, or a one-key mapping of a name to "
                              "its options)")
        if name in LOGGER_EXTRAS:
            modules, extra = LOGGER_EXTRAS[name]
            if not any(importlib.util.find_spec(m) for m in modules):
                raise ConfigError(f"{src!r}: loggers: {name!r} needs the {modules[0]} package, "
                                  f"which is not installed: pip install 'hedgecats[{extra}]'")
    out = Path(spec["output"])
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output {str(out)!r} is a file, not a directory")


def _check_divergence(div, where: str) -> None:
    if div is None:
        return
    if not isinstance(div, dict):
        raise ConfigError(f"{where} must be a mapping with keys {', '.join(DIVERGENCE_KEYS)}")
    unknown = sorted(set(div) - set(DIVERGENCE_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; valid: "
                          f"{', '.join(DIVERGENCE_KEYS)}{_suggest(unknown[0], DIVERGENCE_KEYS)}")
    from ..lightning_modules.guard import TrainingGuard

    try:
        TrainingGuard(**{DIVERGENCE_KEYS[k]: v for k, v in div.items()})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err


# ----------------------------------------------------------------------------- classes
def resolve_class(name: str, where: str = "class_path", kind: str = "LightningDataModule"):
    """The class a ``class_path`` names: a dotted path, or a short name exported by the stage,
    callback, logger, strategy or data modules (``RecallDataModule``)."""
    return _resolve(name, where, kind)


def _resolve(name, where: str, kind: str):
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: class_path must be a class name, got {name!r}")
    if "." in name:
        mod, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"{where}: class_path {name!r} cannot be imported ({err})") from err
    known = {}
    for mod in SHORT_NAME_MODULES:
        with contextlib.suppress(ImportError):
            m = importlib.import_module(mod)
            known.update({k: getattr(m, k) for k in getattr(m, "__all__", dir(m))
                          if inspect.isclass(getattr(m, k, None))})
    if name in known:
        return known[name]
    raise ConfigError(f"{where}: {name!r} is not a {kind} class that hedgecats knows"
                      f"{_suggest(name, known)} (give the full class path, e.g. "
                      "hedgecats.lightning_modules.AttentionTransfer)")


def _check_class_spec(value, where: str, kind: str) -> None:
    """Class name, and init_args keys against the signature (nested dataclasses too)."""
    if isinstance(value, str):
        _resolve(value, where, kind)
        return
    if not isinstance(value, dict) or "class_path" not in value:
        return  # jsonargparse accepts other forms (e.g. a bool logger); it checks them
    extra = sorted(set(value) - {"class_path", "init_args", "dict_kwargs"})
    if extra:
        raise ConfigError(f"{where}: unknown keys {extra} beside class_path; the arguments go "
                          "under init_args")
    cls = _resolve(value["class_path"], f"{where}.class_path", kind)
    args = value.get("init_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}.init_args must be a mapping, got {args!r}")
    _check_keys(cls, args, f"{where}.init_args")


def _check_keys(cls, args: dict, where: str) -> None:
    init = cls.__init__ if inspect.isclass(cls) else cls
    try:
        sig = inspect.signature(init)
    except (TypeError, ValueError):
        return
    params = {n: p for n, p in sig.parameters.items() if n != "self"}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # arguments forwarded elsewhere: jsonargparse follows them
    unknown = sorted(set(args) - set(params))
    if unknown:
        raise ConfigError(f"{where}: {unknown[0]!r} is not an argument of "
                          f"{getattr(cls, '__name__', cls)}{_suggest(unknown[0], params)}; valid: "
                          f"{', '.join(params)}")
    try:
        hints = typing.get_type_hints(init)
    except (NameError, TypeError, AttributeError):  # annotations that do not resolve here
        hints = {}
    for name, val in args.items():
        dc = _dataclass_of(hints.get(name))
        if dc is not None and isinstance(val, dict):
            fields = [f.name for f in dataclasses.fields(dc) if f.init]
            bad = sorted(set(val) - set(fields))
            if bad:
                raise ConfigError(f"{where}.{name}: {bad[0]!r} is not a field of {dc.__name__}"
                                  f"{_suggest(bad[0], fields)}; valid: {', '.join(fields)}")


def _dataclass_of(tp):
    if tp is None:
        return None
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg) and isinstance(arg, type):
            return arg
    return None


_BOILERPLATE = re.compile(r"^(Does not validate against|Subtypes:|Errors:|Given value|"
                          r"Expected a <class 'NoneType'>|Problem with given class_path|"
                          r"Not a valid subclass|Subclass types expect|- a |Parser key)")


def _condense(err: BaseException) -> str:
    """The key path and the first real message of a jsonargparse error."""
    text = str(err)
    keys = re.findall(r'Parser key "([^"]+)"', text)
    for line in text.splitlines():
        line = line.strip().lstrip("- ").strip()
        if line and not _BOILERPLATE.match(line):
            return f"{'.init_args.'.join(keys)}: {line}" if keys else line
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- paths
def _looks_local(value: str) -> bool:
    """A value that can only be a local path (a hub id is ``name`` or ``org/name``)."""
    return (value.startswith(("/", "./", "../", "~")) or value.count("/") >= 2
            or value.endswith((".pt", ".ckpt", ".safetensors", ".json", ".yaml", ".parquet",
                               ".jsonl")))


def _check_paths(spec: dict, st: dict, i: int, where: str) -> None:
    out = Path(spec["output"])
    names = [s["name"] for s in spec["stages"]]
    for section in ("model", "data"):
        args = ((st["fit"].get(section) or {}) if isinstance(st["fit"].get(section), dict)
                else {}).get("init_args") or {}
        for key in PATH_KEYS:
            values = args.get(key)
            for value in values if isinstance(values, list) else [values]:
                if not isinstance(value, str) or not value:
                    continue
                at = f"{where}.fit.{section}.init_args.{key}"
                path = Path(value).expanduser()
                if str(path).startswith(str(out) + "/"):
                    producer = path.relative_to(out).parts[0]
                    if producer not in names:
                        raise ConfigError(f"{at}={value!r} points into the run directory but "
                                          f"not at a stage; stages: {', '.join(names)}")
                    if names.index(producer) >= i:
                        raise ConfigError(f"{at}={value!r} is written by stage {producer!r}, "
                                          f"which does not run before {st['name']!r}")
                    continue  # an earlier stage writes it
                if key == "data_files" and any(c in value for c in "*?["):
                    if not glob.glob(str(path), recursive=True):
                        raise ConfigError(f"{at}={value!r} matches no file")
                    continue
                if (key == "init_from" or _looks_local(value)) and not path.exists():
                    kind = "file" if key == "init_from" or path.suffix else "directory"
                    raise ConfigError(f"{at}={value!r}: no such {kind}"
                                      + (" (a model id on the hub has the form name or "
                                         "org/name)" if key == "model_name_or_path" else ""))


# ----------------------------------------------------------------------------- stages
def _check_stage(spec: dict, st: dict, i: int, warn) -> None:
    src = spec.get("source", "?")
    where = f"{src}: stages.{st['name']}"
    fit = st["fit"]
    unknown = sorted(set(fit) - set(FIT_KEYS))
    if unknown:
        hint = " (the pipeline resumes stages itself)" if "ckpt_path" in unknown else \
            _suggest(unknown[0], FIT_KEYS)
        raise ConfigError(f"{where}.fit: unknown key {unknown[0]!r}{hint}; valid: "
                          f"{', '.join(FIT_KEYS)}")
    _check_divergence(st.get("divergence"), f"{where}.divergence")
    _check_class_spec(fit["model"], f"{where}.fit.model", "LightningModule")
    if fit.get("data") is not None:
        _check_class_spec(fit["data"], f"{where}.fit.data", "LightningDataModule")
    trainer = fit.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise ConfigError(f"{where}.fit.trainer must be a mapping, got {trainer!r}")
    if trainer.get("enable_checkpointing") is False:
        raise ConfigError(f"{where}.fit.trainer.enable_checkpointing=false: a pipeline stage "
                          "always checkpoints (that is how it resumes); remove the key and set "
                          "checkpoint_every_n_steps instead")
    from lightning.pytorch import Trainer

    _check_keys(Trainer, trainer, f"{where}.fit.trainer")  # jsonargparse names no near key
    _check_budget(trainer, f"{where}.fit.trainer")
    for j, cb in enumerate(trainer.get("callbacks") or []):
        _check_class_spec(cb, f"{where}.fit.trainer.callbacks[{j}]", "Callback")
    for key in ("logger", "strategy", "plugins"):
        for j, x in enumerate(v if isinstance(v := trainer.get(key), list) else [v]):
            if isinstance(x, dict):
                _check_class_spec(x, f"{where}.fit.trainer.{key}"
                                  + (f"[{j}]" if isinstance(v, list) else ""), key)
    model_args = fit["model"].get("init_args") or {} if isinstance(fit["model"], dict) else {}
    lr = model_args.get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not (lr > 0
                                                                          and math.isfinite(lr)):
        raise ConfigError(f"{where}.fit.model.init_args.lr={lr!r} must be a finite number > 0")
    _check_paths(spec, st, i, where)
    cfg = stage_config(spec, st, Path(spec["output"]) / st["name"], attempt=0)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            cli = build_cli(cfg, parse_only=True)
    except ConfigError:
        raise
    except (Exception, SystemExit) as err:
        raise ConfigError(f"{where}.fit{_instantiated(err)}: {_condense(err)}") from err
    _check_epoch(getattr(cli.config_init, "data", None), trainer, where)
    _check_positions(spec, st, where)
    accelerator = trainer.get("accelerator", "auto")
    _check_backend_device(model_args.get("hybrid"), str(accelerator),
                          f"{where}.fit.trainer.accelerator={accelerator!r}",
                          f"{where}.fit.model.init_args.hybrid")
    _warn_window(st, where, warn)


def _instantiated(err: BaseException) -> str:
    """``.data: RecallDataModule`` when ``err`` was raised while a stage's model or data class
    was built (jsonargparse reports it as a union that did not validate, naming the base class
    and the class_path); ``""`` otherwise (a parse error names its own key)."""
    text = str(err)
    cls = re.search(r"Given value: Namespace\(class_path='([^']+)'", text)
    base = re.search(r"Subtypes: \[<class '[\w.]+\.(LightningDataModule|LightningModule)'>", text)
    if not cls or not base:
        return ""
    section = "data" if base.group(1) == "LightningDataModule" else "model"
    return f".{section}: {cls.group(1).rsplit('.', 1)[-1]}"


# ----------------------------------------------------------------------------- lengths
def _check_budget(trainer: dict, at: str) -> None:
    """A stage that would train nothing (Lightning accepts it, then fails or skips silently
    after the model has loaded)."""
    for key, unbounded in (("max_steps", -1), ("max_epochs", -1)):
        v = trainer.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            continue  # absent, null, or a wrong type that jsonargparse reports
        if v == 0 or v < unbounded:
            raise ConfigError(f"{at}.{key}={v} trains nothing: give the number of "
                              f"{'optimiser steps' if key == 'max_steps' else 'epochs'} (>= 1), "
                              f"or -1 for no limit")


def _world_size(trainer: dict) -> int:
    """Processes a stage trains on, from its trainer config (``auto``: every visible GPU, or
    one CPU process)."""
    devices, nodes = trainer.get("devices", "auto"), trainer.get("num_nodes", 1)
    if isinstance(devices, list):
        n = len(devices)
    elif isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        n = devices
    elif str(trainer.get("accelerator", "auto")) == "cpu":
        n = 1
    else:
        import torch

        n = max(1, torch.cuda.device_count())
    return n * (nodes if isinstance(nodes, int) and nodes > 0 else 1)


def _check_epoch(dm, trainer: dict, where: str) -> None:
    """An integer ``val_check_interval`` longer than an epoch: Lightning refuses it only once
    the data is set up (the model loaded). The DataModules of this package tell their epoch's
    length without reading data (``train_batches_per_epoch``)."""
    vci = trainer.get("val_check_interval")
    count = getattr(dm, "train_batches_per_epoch", None)
    if isinstance(vci, bool) or not isinstance(vci, int) or count is None \
            or "check_val_every_n_epoch" in trainer and trainer["check_val_every_n_epoch"] is None \
            or trainer.get("limit_val_batches", 1) in (0, 0.0):
        return
    world = _world_size(trainer)
    try:
        n = count(world)
    except ValueError as err:
        raise ConfigError(f"{where}.fit.data: {type(dm).__name__}: {err}") from err
    limit = trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        n = min(n, limit)
    elif isinstance(limit, float):
        n = int(n * limit)
    if vci > n:
        raise ConfigError(
            f"{where}.fit.trainer.val_check_interval={vci} is longer than an epoch ({n} batches "
            f"per process{f' on {world} processes' if world > 1 else ''}): Lightning would refuse "
            f"it after loading the model. Give at most {n}, or set "
            "check_val_every_n_epoch: null to count batches across epochs")


def _model_positions(spec: dict, st: dict, seen: frozenset = frozenset()
                     ) -> tuple[int, str] | None:
    """``(max_position_embeddings, where it comes from)`` of the model a stage trains, when it
    can be known without loading anything: the stage's own argument (a model built from
    scratch), a local model's config.json, or the stage that writes the model it reads."""
    model = st["fit"].get("model")
    if not isinstance(model, dict) or st["name"] in seen:
        return None
    args = model.get("init_args") or {}
    with contextlib.suppress(ConfigError):
        cls = _resolve(model.get("class_path"), "", "LightningModule")
        param = inspect.signature(cls.__init__).parameters.get("max_position_embeddings")
        if param is not None:
            n = args.get("max_position_embeddings", param.default)
            return (n, "this stage's model.init_args.max_position_embeddings") \
                if isinstance(n, int) else None
    out = Path(spec["output"])
    for key in ("model_name_or_path", "init_from"):
        value = args.get(key)
        if not isinstance(value, str) or not value:
            continue
        path = Path(value).expanduser()
        if str(path).startswith(str(out) + "/"):
            producer = next((s for s in spec["stages"]
                             if s["name"] == path.relative_to(out).parts[0]), None)
            found = producer and _model_positions(spec, producer, seen | {st["name"]})
            if found:
                return found[0], f"stage {producer['name']!r}" if found[1].startswith(
                    "this stage") else found[1]
        elif (path / "config.json").is_file():
            with contextlib.suppress(OSError, ValueError):
                import json

                n = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
                if isinstance(n, int):
                    return n, f"{str(path / 'config.json')!r}"
    return None


def _check_positions(spec: dict, st: dict, where: str) -> None:
    """A data ``seq_len`` past the model's positions: RoPE never saw them, and a converted
    model refuses them at its first batch (with advice meant for generation)."""
    data = st["fit"].get("data")
    seq_len = ((data.get("init_args") or {}) if isinstance(data, dict) else {}).get("seq_len")
    found = _model_positions(spec, st) if isinstance(seq_len, int) else None
    if found and seq_len > found[0]:
        raise ConfigError(
            f"{where}.fit.data.init_args.seq_len={seq_len} is longer than the model's "
            f"max_position_embeddings={found[0]} ({found[1]}): positions past it were never "
            f"trained, and a converted model refuses them. Give a seq_len of at most {found[0]}")


def _warn_window(st: dict, where: str, warn) -> None:
    model, data = st["fit"].get("model"), st["fit"].get("data")
    if not isinstance(model, dict) or not isinstance(data, dict):
        return
    args = model.get("init_args") or {}
    hybrid = args.get("hybrid") or {}
    seq_len = (data.get("init_args") or {}).get("seq_len")
    if "hybrid" not in args or not isinstance(hybrid, dict) or not isinstance(seq_len, int):
        return
    windows = [hybrid.get("window", 64), *((hybrid.get("layer_windows") or {}).values())]
    if all(isinstance(w, int) and w >= seq_len for w in windows):
        warn(f"warning: {where}: hybrid window {max(windows)} >= data seq_len {seq_len}: every "
             "key is inside the sliding window, so linear attention never contributes")


# ----------------------------------------------------------------------------- devices
def _gpu_backend(hybrid) -> str | None:
    """The ``backend`` of a ``hybrid`` mapping when it runs on CUDA tensors only: every backend
    but ``auto`` (the reference on the CPU) and ``reference`` (``backends.select``)."""
    from ..models.ops.hybrid.backends import BACKENDS

    backend = hybrid.get("backend", "auto") if isinstance(hybrid, dict) else "auto"
    return backend if backend in BACKENDS and backend not in ("auto", "reference") else None


def _check_backend_device(hybrid, device: str, device_at: str, hybrid_at: str) -> None:
    """A GPU-only backend where the recipe names the CPU: the stage (or the evaluation) would
    fail at its first forward, or after training."""
    backend = _gpu_backend(hybrid)
    if backend and device == "cpu":
        raise ConfigError(
            f"{hybrid_at}.backend={backend!r} runs on a GPU only, but {device_at} runs it on "
            "the CPU: use backend 'reference' (or 'auto': the reference on the CPU, the GPU "
            "kernels on a GPU), or run on a GPU")


# ----------------------------------------------------------------------------- evaluate
def evaluations(spec: dict) -> list[dict]:
    ev = spec.get("evaluate")
    if not ev:
        return []
    return [ev] if isinstance(ev, dict) else ev if isinstance(ev, list) else [ev]


def _check_evaluations(spec: dict) -> None:
    from ..models.config import MODES, SWITCHES, parse_variant_mapping

    src = spec.get("source", "?")
    raw = spec.get("evaluate")
    if raw and not isinstance(raw, (dict, list)):
        raise ConfigError(f"{src}: evaluate must be a mapping (one evaluation) or a list of "
                          f"them, got {raw!r}")
    names = [s["name"] for s in spec["stages"]]
    evs = evaluations(spec)
    for j, ev in enumerate(evs):
        where = f"{src}: evaluate" + (f"[{j}]" if isinstance(raw, list) else "")
        if not isinstance(ev, dict):
            raise ConfigError(f"{where} must be a mapping, got {ev!r}")
        kind = ev.get("kind", "recall")
        if kind not in EVALUATE_KEYS:
            raise ConfigError(f"{where}.kind={kind!r} is not valid; choose one of "
                              f"{', '.join(EVALUATE_KEYS)}")
        unknown = sorted(set(ev) - EVALUATE_KEYS[kind])
        if unknown:
            raise ConfigError(f"{where}: {unknown[0]!r} is not a key of a {kind} evaluation"
                              f"{_suggest(unknown[0], EVALUATE_KEYS[kind])}; valid: "
                              f"{', '.join(sorted(EVALUATE_KEYS[kind]))}")
        stage = ev.get("stage")
        if kind == "recall" and ("stage" in ev) == ("model" in ev):
            raise ConfigError(f"{where}: a recall evaluation names either a stage of this "
                              "pipeline (its stage.pt) or a transformers model (with a hybrid "
                              f"config), not {'both' if 'stage' in ev else 'neither'}")
        if stage is not None and stage not in names:
            raise ConfigError(f"{where}.stage={stage!r} is not a stage of the pipeline; stages: "
                              f"{', '.join(names)}")
        if kind == "command":
            _check_command(ev, where)
            continue
        if "model" in ev:
            _check_eval_model(spec, ev, where)
        modes = ev.get("modes", MODES)
        if not isinstance(modes, list | tuple) or not modes:
            raise ConfigError(f"{where}.modes must be a non-empty list of modes, got {modes!r}")
        for m in modes:
            if m not in MODES:
                raise ConfigError(f"{where}.modes: {m!r} is not a mode{_suggest(m, MODES)}; "
                                  f"valid: {', '.join(MODES)}")
        variants = ev.get("variants") or {}
        if not isinstance(variants, dict):
            raise ConfigError(f"{where}.variants must be a mapping of names to switches")
        for vname, var in variants.items():
            at = f"{where}.variants.{vname}"
            if not isinstance(var, dict):
                raise ConfigError(f"{at} must be a mapping of switches, got {var!r}")
            bad = sorted(set(var) - set(SWITCHES) - {"modes"})
            if bad:
                raise ConfigError(f"{at}: {bad[0]!r} is not a switch"
                                  f"{_suggest(bad[0], SWITCHES)}; valid: modes, "
                                  f"{', '.join(SWITCHES)}")
            try:  # models.config: known modes, valid values, switches that act in those modes
                parse_variant_mapping(var)
            except ValueError as err:
                raise ConfigError(f"{at}: {err}") from err
        bs = ev.get("batch_size", 16)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
            raise ConfigError(f"{where}.batch_size={bs!r} must be an integer >= 1")
        if not isinstance(ev.get("teacher", False), bool):
            raise ConfigError(f"{where}.teacher={ev['teacher']!r} must be true or false")
        device = str(ev.get("device", "auto"))
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ConfigError(f"{where}.device={device!r} is not valid; choose auto, cpu, cuda "
                              "or cuda:N")
        scored = next((s for s in spec["stages"] if s["name"] == stage), None)
        hybrid, hybrid_at = (ev.get("hybrid"), f"{where}.hybrid") if scored is None else (
            ((scored["fit"].get("model") or {}).get("init_args") or {}).get("hybrid"),
            f"{src}: stages.{stage}.fit.model.init_args.hybrid")
        _check_backend_device(hybrid, device, f"{where}.device={device!r}", hybrid_at)
        if "precision" in ev and str(ev["precision"]) not in ("32", "bf16-mixed"):
            raise ConfigError(f"{where}.precision={ev['precision']!r} is not valid; choose 32 "
                              "or bf16-mixed")
        if "data" not in ev:
            raise ConfigError(f"{where}: a recall evaluation needs data (a DataModule with "
                              "test_corpus(), e.g. the stages' RecallDataModule)")
        _check_class_spec(ev["data"], f"{where}.data", "LightningDataModule")
        _instantiate(ev["data"], f"{where}.data")


def _check_eval_model(spec: dict, ev: dict, where: str) -> None:
    from ..models import HybridConfig

    model = ev["model"]
    out = Path(spec["output"])
    if not isinstance(model, str) or not model:
        raise ConfigError(f"{where}.model must be a model id or directory, got {model!r}")
    if not model.startswith(str(out) + "/") and _looks_local(model) and \
            not Path(model).expanduser().exists():
        raise ConfigError(f"{where}.model={model!r}: no such directory")
    hybrid = ev.get("hybrid") or {}
    if not isinstance(hybrid, dict):
        raise ConfigError(f"{where}.hybrid must be a mapping of HybridConfig fields")
    try:
        HybridConfig.from_dict(hybrid)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}.hybrid: {err}") from err


def _instantiate(value, where: str):
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping with class_path and init_args")
    cls = _resolve(value.get("class_path"), f"{where}.class_path", "LightningDataModule")
    try:
        return cls(**(value.get("init_args") or {}))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {cls.__name__}: {err}") from err


def _check_command(ev: dict, where: str) -> None:
    argv = ev.get("argv", [])
    if not isinstance(argv, list):
        raise ConfigError(f"{where}.argv must be a list of command-line words, got {argv!r}")
    from ..evaluation.cli import build_parser

    err_text = io.StringIO()
    try:
        with contextlib.redirect_stderr(err_text), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args([str(a) for a in argv])
    except SystemExit as err:
        lines = [x for x in err_text.getvalue().splitlines() if x.strip()]
        msg = lines[-1] if lines else f"exit {err.code}"
        raise ConfigError(f"{where}.argv: hedgecats evaluate refuses it: {msg}") from None


# ----------------------------------------------------------------------------- all
def validate_pipeline(spec: dict, warn=print) -> None:
    """Raise ``ConfigError`` for the first problem (module docstring); ``warn`` receives
    warnings (a window that covers whole sequences)."""
    src = spec.get("source", "?")
    _check_top_level(spec, src)
    old_env = os.environ.get("PL_GLOBAL_SEED")
    try:
        for i, st in enumerate(spec["stages"]):
            _check_stage(spec, st, i, warn)
    finally:  # instantiating the classes must not leave a seed behind
        if old_env is None:
            os.environ.pop("PL_GLOBAL_SEED", None)
        else:
            os.environ["PL_GLOBAL_SEED"] = old_env
    from .select_layers import check_selection_stages

    check_selection_stages(spec, warn, resolve_class)
    _check_evaluations(spec)
