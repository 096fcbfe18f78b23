"""Component ablations through lm-eval: one model, every mode (docs/method.md#modes-and-switches).

A *mode spec* is a mode name with optional switches joined by ``+``::

    hybrid                     swa_only+rescale           la_only+la_span=all
    la_only+rescale+la_span=all                           hybrid+overlap
    swa_only+window=128        sinks_only+n_sinks=4       softmax

Switches (each only where it changes the output, anything else is rejected):

    rescale[=true|false]   swa_only, la_only: the surviving branch gets weight 1
    la_span=outside|all    la_only: LA over keys outside the window (default) or all causal keys
    overlap[=true|false]   hybrid, la_only: LA also over the window's keys
    window=N               hybrid, swa_only, la_only: SWA window (and LA shift) of every layer
    n_sinks=N              sinks_only: number of sink keys

The full spec string is the row label. ``softmax`` is the original model's attention; it is the
only mode of a model that was not converted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hedgecats.models import MODES, attention_mode, hybrid_layers

from .lm_eval_bridge import TaskScore, TaskSelection, evaluate_tasks, make_lm

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_MODES",
    "ModeSpec",
    "check_modes_supported",
    "is_converted",
    "parse_modes",
    "run_modes",
]

DEFAULT_MODES = ("hybrid", "swa_only", "la_only", "sinks_only", "none")

_TRUE = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}
_LA_SPANS = ("outside", "all")
#: switch -> (modes where it has an effect, parser)
_SWITCHES: dict[str, tuple[tuple[str, ...], Callable[[str | None], object]]] = {}


def _bool(name):
    def parse(v):
        if v is None:
            return True
        if v.lower() not in _TRUE:
            raise ValueError(f"switch {name!r} takes true/false, got {v!r}")
        return _TRUE[v.lower()]
    return parse


def _int(name):
    def parse(v):
        try:
            n = int(v) if v is not None else None
        except ValueError:
            n = None
        if n is None or n < 1:
            raise ValueError(f"switch {name!r} needs an integer >= 1, e.g. {name}=64; got {v!r}")
        return n
    return parse


def _la_span(v):
    if v not in _LA_SPANS:
        raise ValueError(f"switch 'la_span' takes one of {', '.join(_LA_SPANS)}; got {v!r}")
    return v


_SWITCHES.update({
    "rescale": (("swa_only", "la_only"), _bool("rescale")),
    "la_span": (("la_only",), _la_span),
    "overlap": (("hybrid", "la_only"), _bool("overlap")),
    "window": (("hybrid", "swa_only", "la_only"), _int("window")),
    "n_sinks": (("sinks_only",), _int("n_sinks")),
})


@dataclass(frozen=True)
class ModeSpec:
    """A mode and its switches (``attention_mode`` keyword arguments); ``label`` is the row name."""

    label: str
    mode: str
    switches: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, text: str) -> ModeSpec:
        """Parse ``mode[+switch[=value]]...``; raise ``ValueError`` naming what is valid."""
        label = text.strip()
        parts = [p.strip() for p in label.split("+")]
        mode = parts[0]
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} in {label!r}; valid modes: {', '.join(MODES)}")
        switches: dict = {}
        for part in parts[1:]:
            name, sep, value = part.partition("=")
            name = name.strip()
            if name not in _SWITCHES:
                raise ValueError(f"unknown switch {name!r} in mode {label!r}; valid switches: "
                                 f"{', '.join(_SWITCHES)}")
            modes, parse = _SWITCHES[name]
            if mode not in modes:
                raise ValueError(f"switch {name!r} has no effect in mode {mode!r} ({label!r}); "
                                 f"it applies to: {', '.join(modes)}")
            if name in switches:
                raise ValueError(f"switch {name!r} given twice in {label!r}")
            switches[name] = parse(value.strip() if sep else None)
        return cls(label=label, mode=mode, switches=switches)


def parse_modes(text: str | list[str]) -> list[ModeSpec]:
    """A comma-separated list (or a list) of mode specs; labels must be distinct."""
    items = text.split(",") if isinstance(text, str) else list(text)
    specs = [ModeSpec.parse(t) for t in items if t.strip()]
    if not specs:
        raise ValueError("no modes given")
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"modes given more than once: {dup}")
    return specs


def is_converted(model) -> bool:
    """Whether ``model`` has hybrid layers (``convert_to_hybrid`` or a stage checkpoint)."""
    try:
        return next(hybrid_layers(model), None) is not None
    except ValueError:  # a model family the converter does not know
        return False


def check_modes_supported(model, specs: list[ModeSpec]) -> None:
    """Raise if a mode needs hybrid layers the model does not have."""
    if is_converted(model):
        return
    bad = [s.label for s in specs if s.mode != "softmax"]
    if bad:
        raise ValueError(f"modes {bad} need a converted (hybrid) model, but the model has no "
                         "hybrid layers; pass a stage checkpoint, or --hybrid <HybridConfig YAML> "
                         "to convert it, or evaluate it with --modes softmax")


def run_modes(model, tokenizer, specs: list[ModeSpec], selection: TaskSelection, *,
              metric_overrides: dict[str, str] | None = None, limit: float | None = None,
              batch_size: int | str = 8, max_length: int | None = None,
              device: str | None = None, bootstrap_iters: int = 100_000, seed: int = 0,
              progress: Callable[[str], None] = print) -> dict[str, dict[str, TaskScore]]:
    """lm-eval every task in every mode, reusing ``model``; ``{label: {task: TaskScore}}``.

    The model's attention runtime is restored after each mode (``attention_mode``).
    """
    check_modes_supported(model, specs)
    lm = make_lm(model, tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    converted = is_converted(model)
    out: dict[str, dict[str, TaskScore]] = {}
    for i, spec in enumerate(specs, 1):
        progress(f"[{i}/{len(specs)}] mode {spec.label}: {len(selection.names)} task(s) "
                 f"{', '.join(selection.names)}")
        if converted:
            with attention_mode(model, spec.mode, **spec.switches):
                scores, _ = evaluate_tasks(lm, selection, metric_overrides=metric_overrides,
                                           limit=limit, bootstrap_iters=bootstrap_iters, seed=seed)
        else:
            scores, _ = evaluate_tasks(lm, selection, metric_overrides=metric_overrides,
                                       limit=limit, bootstrap_iters=bootstrap_iters, seed=seed)
        for task, s in scores.items():
            se = "" if s.stderr != s.stderr else f" ± {s.stderr:.2f}"
            progress(f"      {spec.label} / {task}: {s.metric} {s.score:.2f}{se}")
        out[spec.label] = scores
    return out
