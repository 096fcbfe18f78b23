"""Component ablations through lm-eval: one model, every mode (docs/method.md#modes-and-switches).

A *mode spec* is a mode name with optional switches joined by ``+``::

    hybrid                     swa_only+rescale           la_only+la_span=all
    la_only+rescale+la_span=all                           hybrid+overlap
    swa_only+window=128        sinks_only+n_sinks=4       softmax

The syntax, the modes and the switches (each allowed only where it changes the output) are
``models.config``'s (``parse_variant``, ``SWITCHES``; ``config.variant_syntax()`` lists them).
The full spec string is the row label. ``softmax`` is the original model's attention; it is the
only mode of a model that was not converted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hedgecats.models import MODES, attention_mode, hybrid_layers, parse_variant

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

#: every mode but the original attention
DEFAULT_MODES = tuple(m for m in MODES if m != "softmax")


@dataclass(frozen=True)
class ModeSpec:
    """A mode and its switches (``attention_mode`` keyword arguments); ``label`` is the row name."""

    label: str
    mode: str
    switches: dict = field(default_factory=dict, hash=False)

    @classmethod
    def parse(cls, text: str) -> ModeSpec:
        """Parse ``mode[+switch[=value]]...`` (``models.config.parse_variant``); raise
        ``ValueError`` naming what is valid."""
        mode, switches = parse_variant(text)
        return cls(label=text.strip(), mode=mode, switches=switches)


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
