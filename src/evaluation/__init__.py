"""Evaluation: lm-eval component ablations, retrieval beyond the window, branch usage, reports.

Entry point: ``hedgecats evaluate`` (``hedgecats.evaluation.cli.main``).
"""

from .ablation import DEFAULT_MODES, ModeSpec, check_modes_supported, parse_modes, run_modes
from .branch_usage import branch_usage, plot_branch_usage
from .lm_eval_bridge import (
    PAPER_METRICS,
    PAPER_TASKS,
    TaskScore,
    evaluate_tasks,
    make_lm,
    resolve_tasks,
)
from .report import build_results, format_markdown, write_results
from .retrieval import retrieval_probe

__all__ = [
    "DEFAULT_MODES",
    "PAPER_METRICS",
    "PAPER_TASKS",
    "ModeSpec",
    "TaskScore",
    "branch_usage",
    "build_results",
    "check_modes_supported",
    "evaluate_tasks",
    "format_markdown",
    "make_lm",
    "parse_modes",
    "plot_branch_usage",
    "resolve_tasks",
    "retrieval_probe",
    "run_modes",
    "write_results",
]
