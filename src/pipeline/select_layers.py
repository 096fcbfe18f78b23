"""The pipeline's checks of a ``select-layers`` stage (``LayerSelection``, from
``hedgecats.selection``), before any model loads: its budget against the number of layers the
stage it reads converted, the size and length of its held-out text, one device, and a later
stage that names its own ``hybrid.layers`` instead of the selector's (the pipeline says which
it uses). Called by ``validate_pipeline`` after every stage passed the generic checks (the
stage's own arguments are checked there, when ``LayerSelection`` is built)."""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from pathlib import Path

from .errors import ConfigError

__all__ = ["check_selection_stages", "selection_stages"]

SELECTOR = "LayerSelection"


def _args(stage: dict, section: str = "model") -> dict:
    value = stage["fit"].get(section)
    return (value.get("init_args") or {}) if isinstance(value, dict) else {}


def _class(stage: dict, section: str = "model"):
    value = stage["fit"].get(section)
    return value.get("class_path") if isinstance(value, dict) else value


def _is_selector(stage: dict) -> bool:
    path = _class(stage)
    if not isinstance(path, str):
        return False
    if "." not in path:
        return path == SELECTOR
    from ..selection import LayerSelection

    mod, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError):
        return False  # the generic checks name it
    return inspect.isclass(cls) and issubclass(cls, LayerSelection)


def selection_stages(spec: dict) -> list[dict]:
    """The stages of ``spec`` that are layer selectors."""
    return [st for st in spec["stages"] if _is_selector(st)]


def _producer(spec: dict, value) -> dict | None:
    """The stage of this run whose directory ``value`` points into."""
    out = str(spec["output"]).rstrip("/") + "/"
    if not isinstance(value, str) or not value.startswith(out):
        return None
    name = value[len(out):].split("/", 1)[0]
    return next((s for s in spec["stages"] if s["name"] == name), None)


def _model_layers(spec: dict, stage: dict, seen: frozenset = frozenset()) -> tuple[int, str] | None:
    """``(decoder layers, where that comes from)`` of the model a stage builds, when it is known
    without loading it: a model the stage builds from scratch (``num_layers``), a local
    config.json, or the stage that writes the model it reads."""
    if stage["name"] in seen:
        return None
    args = _args(stage)
    if "num_layers" in args or _class(stage) in ("TeacherPretraining",) or \
            str(_class(stage)).endswith(".TeacherPretraining"):
        from ..lightning_modules import TeacherPretraining

        n = args.get("num_layers",
                     inspect.signature(TeacherPretraining.__init__).parameters["num_layers"].default)
        return (n, f"stage {stage['name']!r} (num_layers)") if isinstance(n, int) else None
    value = args.get("model_name_or_path")
    producer = _producer(spec, value)
    if producer is not None:
        return _model_layers(spec, producer, seen | {stage["name"]})
    if isinstance(value, str) and (Path(value).expanduser() / "config.json").is_file():
        try:
            cfg = json.loads((Path(value).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None
        n = cfg.get("num_hidden_layers")
        return (n, f"{value}/config.json") if isinstance(n, int) else None
    return None


def _converted(spec: dict, selector: dict) -> tuple[int, str, dict] | None:
    """``(layers converted, where that comes from, the HybridConfig mapping)`` of the model the
    selector reads (its ``init_from``)."""
    init_from = _args(selector).get("init_from")
    producer = _producer(spec, init_from)
    if producer is None:
        if isinstance(init_from, str) and Path(init_from).is_file():
            from ..models.stage_files import converted_layers, read_stage

            try:
                payload = read_stage(init_from)
            except (OSError, ValueError):
                return None  # the stage names it when it runs
            return len(converted_layers(payload)), f"{init_from!r}", \
                payload.get("hybrid_config") or {}
        return None
    hybrid = _args(producer).get("hybrid")
    hybrid = hybrid if isinstance(hybrid, dict) else {}
    if hybrid.get("layers") is not None:
        return len(hybrid["layers"]), f"stage {producer['name']!r} (hybrid.layers)", hybrid
    found = _model_layers(spec, producer)
    if found is None:
        return None
    return found[0], f"stage {producer['name']!r} (every layer of {found[1]})", hybrid


def check_selection_stages(spec: dict, warn: Callable[[str], None],
                           resolve: Callable[..., type]) -> None:
    """``ConfigError`` for a selector whose budget the converted layers cannot hold, whose
    held-out text is too small or too short to score, or that would run on several processes;
    ``warn`` names each later stage that reads a selector's ``stage.pt`` but sets its own
    ``hybrid.layers``. ``resolve`` finds a DataModule class from its ``class_path``."""
    from ..selection import Budget
    from ..selection.select import held_out_size

    src = spec.get("source", "?")
    for st in selection_stages(spec):
        where = f"{src}: stages.{st['name']}.fit"
        args = _args(st)
        budget = Budget(keep=args.get("keep"), max_softmax=args.get("max_softmax"),
                        kl_below=args.get("kl_below"))
        found = _converted(spec, st)
        if found is not None:
            n, how, hybrid = found
            try:
                budget.check(n, how)
            except ValueError as err:
                raise ConfigError(f"{where}.model.init_args: {err}") from None
        _check_held_out(st, where, args, found[2] if found else None, resolve, held_out_size)
        devices = (st["fit"].get("trainer") or {}).get("devices")
        if isinstance(devices, list) and len(devices) > 1 or \
                isinstance(devices, int) and not isinstance(devices, bool) and devices > 1:
            raise ConfigError(f"{where}.trainer.devices={devices!r}: layer selection scores on "
                              "one device; set devices: 1")
        for later in spec["stages"][spec["stages"].index(st) + 1:]:
            init = _args(later).get("init_from")
            hybrid = _args(later).get("hybrid")
            if _producer(spec, init) is st and isinstance(hybrid, dict) and \
                    hybrid.get("layers") is not None:
                warn(f"note: stage {later['name']!r} starts from stage {st['name']!r} but sets "
                     f"hybrid.layers={hybrid['layers']} by hand: it converts those layers, not "
                     f"the ones {st['name']!r} selects (a layer {st['name']!r} keeps softmax "
                     f"has no feature maps in its stage.pt: naming one stops {later['name']!r} "
                     "at its start)")


def _check_held_out(st: dict, where: str, args: dict, hybrid: dict | None, resolve,
                    held_out_size) -> None:
    data = st["fit"].get("data")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: layer selection scores on held-out text: give the stage "
                          "a data module (its validation split is scored)")
    try:
        dm = resolve(data.get("class_path"), f"{where}.data.class_path")(
            **(data.get("init_args") or {}))
    except (TypeError, ValueError):
        return  # the generic checks report a data module that cannot be built
    min_tokens = args.get("min_tokens", 256)
    tokens = held_out_size(dm, args.get("max_batches"))
    if isinstance(min_tokens, int) and tokens is not None and tokens < min_tokens:
        raise ConfigError(
            f"{where}: the held-out set is too small to score: {type(dm).__name__}'s validation "
            f"split holds {tokens} tokens"
            + (f" in max_batches={args['max_batches']}" if args.get("max_batches") else "")
            + f", min_tokens={min_tokens}. Give more validation data (or max_batches), or a "
            "lower min_tokens")
    seq_len = (data.get("init_args") or {}).get("seq_len")
    if hybrid is None:  # the conversion is not known before it runs
        return
    windows = [hybrid.get("window", 64), *((hybrid.get("layer_windows") or {}).values())]
    if isinstance(seq_len, int) and not hybrid.get("overlap") and \
            all(isinstance(w, int) and w >= seq_len for w in windows):
        raise ConfigError(
            f"{where}.data.init_args.seq_len={seq_len} is no longer than the hybrid window "
            f"({min(windows)}): LA sees no key, every layer's hybrid is its softmax, and there "
            "is nothing to score. Give longer held-out sequences")
