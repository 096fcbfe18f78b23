"""Recall loss and accuracy per ablation mode on held-out byte recall documents.

The pipeline's ``evaluate: {kind: recall}`` step (the embedded default's last step); its sibling
``retrieval.py`` scores greedy exact match on English facts for ``hedgecats evaluate``. Both group
answers by the distance buckets of ``hedgecats.data.buckets``, and ``recall_summary`` writes the
pipeline's section of ``results.json`` in the schema ``report.read_results`` reads.

For every attention mode: the mean next-token loss over all tokens, and the loss and accuracy on
the recalled values whose fact lies near (distance ``<= corpus.near_max``) or far (``>=
corpus.far_min``), plus the accuracy per distance bucket (``corpus.buckets()``). The split is
fixed by the data, not by the model's window: recipes that end at different windows (SSD) are
scored on the same recalls. A model whose LA branch carries information from beyond its window
keeps its far accuracy in ``hybrid`` and ``la_only``; ``swa_only`` cannot, when the window is
shorter than ``far_min``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..data.recall_bytes import RecallCorpus
from ..models import attention_mode

__all__ = ["EVAL_MODES", "evaluate_recall", "format_table"]

EVAL_MODES = ("softmax", "hybrid", "swa_only", "la_only", "sinks_only", "none")
COLUMNS = ("lm_loss", "near_loss", "near_acc", "far_loss", "far_acc")
#: the printed table's columns (results.json keeps every value)
TABLE_COLUMNS = ("lm_loss", "near_acc", "far_acc")


@torch.no_grad()
def _score(model: nn.Module, corpus: RecallCorpus, batch_size: int, device,
           autocast_dtype: torch.dtype | None) -> dict[str, float]:
    ids_all = corpus.input_ids
    N, T = ids_all.shape
    ans = corpus.answers  # (M, 3): doc, position, distance
    tok_loss = torch.empty(N, T - 1)
    correct = torch.empty(N, T - 1, dtype=torch.bool)
    amp = (torch.autocast(torch.device(device).type, dtype=autocast_dtype)
           if autocast_dtype is not None else contextlib.nullcontext())
    for s in range(0, N, batch_size):
        ids = ids_all[s:s + batch_size].to(device)
        with amp:
            # (b, T-1, V): predicts ids[:, 1:]; no cache: nothing continues these sequences
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        tgt = ids[:, 1:]
        tok_loss[s:s + len(ids)] = F.cross_entropy(logits.transpose(1, 2), tgt,
                                                   reduction="none").cpu()
        correct[s:s + len(ids)] = (logits.argmax(-1) == tgt).cpu()
    # the value at position p is predicted from position p - 1
    doc, pred_pos, dist = ans[:, 0], ans[:, 1] - 1, ans[:, 2]
    out = {"lm_loss": tok_loss.mean().item()}
    for name, sel in (("near", dist <= corpus.near_max), ("far", dist >= corpus.far_min)):
        d, p = doc[sel], pred_pos[sel]
        out[f"{name}_loss"] = tok_loss[d, p].mean().item() if len(d) else float("nan")
        out[f"{name}_acc"] = correct[d, p].float().mean().item() if len(d) else float("nan")
        out[f"n_{name}"] = len(d)
    for name, lo, hi in corpus.buckets():
        sel = (dist >= lo) & (dist <= hi)
        out[f"acc_{name}"] = correct[doc[sel], pred_pos[sel]].float().mean().item() \
            if sel.any() else float("nan")
    return out


def evaluate_recall(model: nn.Module, corpus: RecallCorpus, *,
                    modes: tuple[str, ...] = EVAL_MODES, batch_size: int = 16,
                    autocast_dtype: torch.dtype | None = None,
                    **switches) -> dict[str, dict[str, float]]:
    """``{mode: {lm_loss, near_loss, near_acc, far_loss, far_acc, n_near, n_far, acc_<bucket>}}``.

    Runs on the model's device (under autocast to ``autocast_dtype`` when given); ``switches``
    go to ``attention_mode`` (e.g. ``rescale=True``, ``la_span="all"``). The model is restored to
    its previous modes afterwards.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    results = {}
    try:
        for mode in modes:
            with attention_mode(model, mode, **switches):
                results[mode] = _score(model, corpus, batch_size, device, autocast_dtype)
    finally:
        model.train(was_training)
    return results


def recall_summary(results: dict[str, dict[str, float]], corpus: RecallCorpus, *,
                   stage: str | None, checkpoint: str, window: int, device: str,
                   precision: str) -> dict:
    """One recall evaluation as the pipeline's ``results.json`` records it (``{"kind": "recall",
    **recall_summary(...)}``; ``report.read_results`` reads it): ``results`` is
    ``{row label: evaluate_recall's row}``, the rows in printed order (``teacher``, modes,
    ``"<mode> (<variant>)"``)."""
    return {"stage": stage, "checkpoint": checkpoint, "window": window,
            "near_max": corpus.near_max, "far_min": corpus.far_min, "far_max": corpus.far_max,
            "buckets": [list(b) for b in corpus.buckets()], "device": device,
            "precision": precision, "n_docs": len(corpus.input_ids), "results": results}


def format_table(results: dict[str, dict[str, float]], title: str = ""):
    """A ``rich`` table: rows are modes; columns the LM loss, near and far accuracy, and the
    accuracy per far-distance bucket (``d150-233`` ...)."""
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("mode")
    buckets = [k for k in next(iter(results.values()), {}) if k.startswith("acc_d")]
    cols = (*TABLE_COLUMNS, *buckets)
    for c in cols:
        table.add_column(c.removeprefix("acc_"), justify="right")
    for mode, r in results.items():
        table.add_row(mode, *(f"{r.get(c, float('nan')):.3f}" for c in cols))
    return table
