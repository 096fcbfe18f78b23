"""Evaluation: lm-eval component ablations, retrieval beyond the window, branch usage, reports.

Entry point: ``hedgecats evaluate`` (``hedgecats.evaluation.cli.main``).
"""

from .ablation import DEFAULT_MODES, ModeSpec, check_modes_supported, parse_modes, run_modes
from .lm_eval_bridge import (
    PAPER_METRICS,
    PAPER_TASKS,
    TaskScore,
    evaluate_tasks,
    make_lm,
    resolve_tasks,
)
from .report import build_results, format_markdown, write_results

__all__ = [
    "DEFAULT_MODES",
    "PAPER_METRICS",
    "PAPER_TASKS",
    "ModeSpec",
    "TaskScore",
    "build_results",
    "check_modes_supported",
    "evaluate_tasks",
    "format_markdown",
    "make_lm",
    "parse_modes",
    "resolve_tasks",
    "run_modes",
    "write_results",
]
