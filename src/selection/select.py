"""The layer selector: score the converted layers, rank them, apply the budget, hand on the rest.

``select_layers`` measures the scores of one or several stage-1 models (seeds) on the same
held-out batches, ranks the layers by the chosen score (several seeds: by mean position), measures
the held-out KL curve along that ranking, and lets the budget decide how many of the worst layers
stay softmax. ``write_selected_stage`` writes the hand-off: the input ``stage.pt`` converting only
the layers left hybrid (``hybrid_config.layers``), which the next stage's ``init_from`` reads
(a stage without ``hybrid.layers`` of its own converts the layers its ``init_from`` converted).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from ..models import hybrid_layers
from ..models.stage_files import (
    load_tensors,
    read_stage,
    resolve_base_model,
    restrict_to_layers,
    save_stage,
)
from .budget import Budget
from .ranking import agreement, consensus, rank, stability
from .scores import check_scores, kl_curve, measure

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "held_out_size", "held_out_tokens", "load_stage_model", "select_layers",
           "write_selected_stage"]

FORMAT = "hedgecats-selection/1"


def held_out_tokens(batches: Sequence[dict]) -> int:
    """Real tokens in ``batches`` (the positions a score averages over)."""
    return sum(int(b["attention_mask"].sum()) if b.get("attention_mask") is not None
               else b["input_ids"].numel() for b in batches)


def held_out_size(dm, max_batches: int | None = None) -> int | None:
    """Tokens of a DataModule's validation split (at most ``max_batches`` batches of it), known
    without reading data for this package's DataModules; ``None`` for another."""
    h = getattr(dm, "hparams", {})
    if all(k in h for k in ("num_val", "seq_len", "batch_size")):  # RecallDataModule
        total, per_batch = h["num_val"] * h["seq_len"], h["batch_size"] * h["seq_len"]
    elif isinstance(getattr(dm, "val_tokens", None), int) and hasattr(dm, "seq_len"):  # FineWeb
        try:
            per_batch = dm.seq_len * dm.micro_batch_size
        except (ValueError, AttributeError, TypeError):
            return None
        total = dm.val_tokens // per_batch * per_batch
    else:
        return None
    return total if max_batches is None else min(total, max_batches * per_batch)


def load_stage_model(path: str | Path, *, base_model: str | None = None,
                     dtype=None, device=None) -> tuple[nn.Module, dict]:
    """The converted model of a stage checkpoint without LoRA (stage 1's), in eval mode, and the
    checkpoint's dict. A checkpoint with LoRA is refused: its teacher would need its adapters
    off, and the selector chooses layers before stage 2."""
    from ..models.stage_files import build_hybrid

    payload = read_stage(path)
    if payload["lora_config"] is not None:
        raise ValueError(f"{str(path)!r} carries LoRA ({payload.get('stage')}): the layer "
                         "selector ranks the layers of a stage-1 model (AttentionTransfer's "
                         "stage.pt), before stage 2")
    if payload["hybrid_config"] is None:
        raise ValueError(f"{str(path)!r} holds no converted model (no hybrid_config)")
    base = base_model or resolve_base_model(payload, path)
    dtype = dtype if dtype is not None else payload["meta"].get("torch_dtype")
    model = build_hybrid(base, revision=payload["revision"],
                         hybrid_config=payload["hybrid_config"], dtype=dtype, device=device)
    load_tensors(model, payload["tensors"])
    model.eval()
    return model, payload


def select_layers(models: Sequence[Callable[[], nn.Module]], batches: Sequence[dict], *,
                  score: str, budget: Budget, compare: Sequence[str] = (),
                  names: Sequence[str] | None = None, context: Callable = contextlib.nullcontext,
                  seed: int = 0, min_tokens: int = 1, source: str = "held-out batches") -> dict:
    """Rank the converted layers of each model (``models``: callables that build them, one at a
    time; several are seeds of one recipe) on ``batches`` and choose the layers kept softmax.

    Returns the selection (the ``selection.json`` of ``write_report``): ``layers`` (left hybrid:
    what the next stage converts), ``kept_softmax``, the scores per input and their mean, the
    ranking, the held-out KL curve, each compared score's agreement with ``score`` and, for
    several inputs, the stability of every score's ranking across them. ``ValueError`` for a
    held-out set under ``min_tokens`` real tokens or a budget the layers cannot hold;
    ``BudgetNotMetError`` when the KL target is not reached."""
    check_scores([score], "score")
    compare = [c for c in check_scores(compare, "compare") if c != score]
    names = list(names or [f"input {j}" for j in range(len(models))])
    if not models:
        raise ValueError("layer selection needs at least one model")
    tokens = held_out_tokens(batches)
    if tokens < min_tokens:
        raise ValueError(f"the held-out set is too small to score: {tokens} tokens in "
                         f"{len(batches)} batches, at least min_tokens={min_tokens} are needed "
                         "(more held-out data, more batches, or a lower min_tokens)")
    keep_one = len(models) == 1
    built: nn.Module | None = None
    measured = []
    for j, build in enumerate(models):
        model = build()
        if j == 0:  # before any scoring: a budget these layers cannot hold
            budget.check(len(list(hybrid_layers(model))), names[0])
        log.info("layer selection: scoring %s", names[j])
        # the random control draws anew for each input (seed + its index), as seeds' runs do
        measured.append(measure(model, batches, [score, *compare], context=context,
                                seed=seed + j))
        if keep_one:
            built = model
        del model
    converted = sorted(measured[0]["values"][score])
    for j, m in enumerate(measured[1:], 1):
        if sorted(m["values"][score]) != converted:
            raise ValueError(f"{names[j]} converts layers {sorted(m['values'][score])}, "
                             f"{names[0]} {converted}: seeds of one recipe convert the same "
                             "layers")
    per_input = [{s: rank(m["values"][s]) for s in [score, *compare]} for m in measured]
    order = consensus([r[score] for r in per_input])
    n_max = budget.n_max(len(converted))
    curves = []
    for j, build in enumerate(models):
        model = built if keep_one else build()
        log.info("layer selection: held-out KL with the 0..%d worst layers softmax (%s)", n_max,
                 names[j])
        curves.append(kl_curve(model, batches, order, n_max, context=context))
        del model
    curve = [sum(c[n] for c in curves) / len(curves) for n in range(n_max + 1)]
    n = budget.choose(curve)
    kept = order[:n]
    k = max(n, 1)
    mean = {s: {i: sum(m["values"][s][i] for m in measured) / len(measured) for i in converted}
            for s in [score, *compare]}
    return {
        "format": FORMAT, "score": score, "compare": compare, "budget": budget.to_dict(),
        "budget_text": budget.describe(), "converted": converted, "kept_softmax": sorted(kept),
        "layers": [i for i in converted if i not in kept], "ranking": order,
        "held_out": {"source": source, "batches": len(batches), "tokens": tokens,
                     "longest": measured[0]["longest"]},
        "scores": mean,
        "inputs": [{"name": names[j], "scores": m["values"], "ranking": per_input[j],
                    "curve": curves[j]} for j, m in enumerate(measured)],
        "curve": [{"softmax": sorted(order[:i]), "kl": kl} for i, kl in enumerate(curve)],
        "agreement": {c: _mean_agreement([agreement(r[c], r[score], k) for r in per_input])
                      for c in compare},
        "stability": {s: stability([r[s] for r in per_input], k) for s in [score, *compare]}
        if len(measured) > 1 else {},
    }


def _mean_agreement(items: list[dict]) -> dict:
    return {"kendall_tau": sum(a["kendall_tau"] for a in items) / len(items),
            "top_k_overlap": sum(a["top_k_overlap"] for a in items) / len(items),
            "k": items[0]["k"], "inputs": len(items)}


def write_selected_stage(source: str | Path, path: str | Path, selection: dict,
                         base_model: str | None = None) -> Path:
    """Write ``source`` (a stage-1 ``stage.pt``) converting only ``selection["layers"]``: the
    layers kept softmax are excluded from the conversion, their feature maps dropped."""
    payload = read_stage(source)
    narrowed = restrict_to_layers(payload, selection["layers"], f"{str(source)!r}")
    meta = {**payload["meta"], "init_from": str(source),
            "selection": {k: selection[k] for k in ("score", "budget", "kept_softmax", "layers",
                                                    "converted")}}
    return save_stage(path, None, base_model=base_model or resolve_base_model(payload, source),
                      revision=payload["revision"], hybrid_config=narrowed["hybrid_config"],
                      lora_config=None, stage="LayerSelection", tensors=narrowed["tensors"],
                      meta=meta)
