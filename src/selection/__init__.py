"""Layer selection: which converted layers stay softmax, chosen by a measured score and a budget
(``hedgecats select-layers`` and the pipeline stage ``select-layers``; docs/layer-selection.md).

    scores    the per-layer scores, each one pass over held-out text; the held-out KL curve
    ranking   rankings (worst first), their agreement, their stability across seeds
    budget    how many of the worst layers stay softmax (keep k, at most N, KL below X)
    select    scoring, ranking and the budget together; the hand-off stage.pt
    report    selection.json, selection.md, selection.png
    stage     ``LayerSelection``, the pipeline stage
    cli       ``hedgecats select-layers``
"""

from .budget import Budget, BudgetNotMetError
from .ranking import agreement, consensus, kendall_tau, rank, stability, top_k_overlap
from .report import write_report
from .scores import CHEAP, SCORES, kl_curve, measure, token_kl
from .select import load_stage_model, select_layers, write_selected_stage
from .stage import LayerSelection

__all__ = [
    "CHEAP",
    "SCORES",
    "Budget",
    "BudgetNotMetError",
    "LayerSelection",
    "agreement",
    "consensus",
    "kendall_tau",
    "kl_curve",
    "load_stage_model",
    "measure",
    "rank",
    "select_layers",
    "stability",
    "token_kl",
    "top_k_overlap",
    "write_report",
    "write_selected_stage",
]
