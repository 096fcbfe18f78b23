"""The layer selector's measured scores, each one pass over held-out text (docs/layer-selection.md).

Every score is per converted layer, and the higher it is, the more that layer's conversion costs:
the ranking keeps the highest softmax first.

``kl``              (a) the KL from the teacher's next-token distribution to the model's when only
                    this layer is hybrid, every other layer softmax; nats per token, averaged over
                    the real positions. The teacher is the same model in ``softmax`` mode (a stage-1
                    model has no adapters), bit for bit the original. One forward per converted
                    layer and batch, besides the teacher's.
``la_rel_err``      (b) stage 1's health figure (``ops.transfer.transfer_health``): the layer's LA
                    output (over every causal key) against its softmax output, relative squared
                    error; 1 = no better than an output of 0
``hybrid_rel_err``  (b) the same for the layer's hybrid output
``la_share``        (b) branch usage (``evaluation.branch_usage``): LA's share of the layer's two
                    weighted branch output norms where LA sees a key, mean over heads
``random``          the control: a random order drawn from ``seed``

The (b) scores come from the teacher's forward itself (an observer on every converted layer, on
the teacher's residual stream, as stage 1 measures its health): one forward per batch for all
of them. ``kl_curve`` measures the whole model against the teacher with the ``n`` worst layers
softmax, for the budget rules.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from ..evaluation.branch_usage import branch_norms, far_positions
from ..models import attention_mode, hybrid_layers
from ..models.ops.transfer.losses import transfer_health

log = logging.getLogger(__name__)

__all__ = ["CHEAP", "SCORES", "kl_curve", "measure", "token_kl"]

#: every score, with what it measures (``hedgecats select-layers --help`` lists them)
SCORES = {
    "kl": "KL(teacher || model) per token with only this layer hybrid (the others softmax)",
    "la_rel_err": "stage 1's health: relative error of the layer's LA output against softmax",
    "hybrid_rel_err": "stage 1's health: relative error of the layer's hybrid output",
    "la_share": "branch usage: LA's share of the layer's output norms where LA sees a key",
    "random": "a random order (the control)",
}
#: the scores read from the teacher's forward (no forward of their own)
CHEAP = ("la_rel_err", "hybrid_rel_err", "la_share")
_HEALTH = ("la_rel_err", "hybrid_rel_err")
#: positions per chunk of the KL: bounds its fp32 copies of the logits
KL_CHUNK = 1024


def check_scores(names: Iterable[str], what: str = "score") -> list[str]:
    names = list(names)
    for name in names:
        if name not in SCORES:
            raise ValueError(f"{what}={name!r} is not a score; choose from {', '.join(SCORES)}")
    return names


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor,
             mask: torch.Tensor | None = None, chunk: int = KL_CHUNK) -> tuple[float, int]:
    """``(sum over real positions of KL(p_teacher || p_student), number of positions)``; the
    distributions are the softmax of each position's logits (fp32 per chunk of positions,
    summed in fp64). ``mask`` (B, T): 1 at real tokens."""
    V = teacher_logits.shape[-1]
    t, s = teacher_logits.reshape(-1, V), student_logits.reshape(-1, V)
    rows = torch.arange(t.shape[0], device=t.device) if mask is None else \
        mask.reshape(-1).nonzero().squeeze(1)
    total = torch.zeros((), dtype=torch.float64, device=t.device)
    for start in range(0, rows.numel(), chunk):
        r = rows[start:start + chunk]
        lt = torch.log_softmax(t[r].float(), dim=-1)
        ls = torch.log_softmax(s[r].float(), dim=-1)
        total += (lt.exp() * (lt - ls)).sum(dtype=torch.float64)
    return float(total), int(rows.numel())


def _inputs(batch: dict, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = batch["input_ids"].to(device)
    mask = batch.get("attention_mask")
    return ids, (None if mask is None else mask.to(device))


def _logits(model, ids, mask, context) -> torch.Tensor:
    with context():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


def _converted(model) -> dict[int, torch.nn.Module]:
    layers = dict(hybrid_layers(model))
    if not layers:
        raise ValueError("layer selection needs a converted (hybrid) model: this one has no "
                         "hybrid layers")
    return layers


@torch.no_grad()
def measure(model, batches: Iterable[dict], scores: Sequence[str], *,
            context: Callable = contextlib.nullcontext, seed: int = 0) -> dict:
    """Every score in ``scores`` for every converted layer, in one pass over ``batches``
    (dicts with ``input_ids`` and an optional ``attention_mask``). Returns ``{"values":
    {score: {layer: value}}, "tokens": real positions scored, "batches": n, "longest": the
    longest real sequence}``. ``context``: a callable giving the forward's context (autocast).
    ``ValueError`` when no sequence is longer than a layer's window (LA sees no key: every
    layer's hybrid is its softmax)."""
    want = check_scores(scores)
    modules = _converted(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    kl_sums = dict.fromkeys(modules, 0.0)
    health = {name: dict.fromkeys(modules, 0.0) for name in _HEALTH}
    norms: dict[int, list[torch.Tensor]] = {}
    tokens = n_batches = longest = 0
    observed = [s for s in want if s in CHEAP]

    def observer(module, query, key, value, key_padding_mask, hidden_states):
        i = module.hedgecats.layer_idx
        if any(s in _HEALTH for s in observed):
            figures = transfer_health(module, query, key, value, key_padding_mask, hidden_states)
            for name in _HEALTH:
                health[name][i] += float(figures[name])
        if "la_share" in observed:
            n_swa_BHT, n_la_BHT = branch_norms(module, query, key, value, key_padding_mask,
                                               hidden_states)
            B, _, T = n_swa_BHT.shape
            w_BT = far_positions(module.hedgecats, T, n_swa_BHT.device)[None, :].float()
            if key_padding_mask is not None:
                w_BT = w_BT * key_padding_mask.reshape(B, T).float()
            acc = norms.setdefault(i, [0, 0])
            for j, n_BHT in enumerate((n_la_BHT, n_swa_BHT)):
                acc[j] = acc[j] + (n_BHT * w_BT[:, None, :]).sum(dim=(0, 2)).double().cpu()

    try:
        for batch in batches:
            ids, mask = _inputs(batch, device)
            with attention_mode(model, "softmax", observer=observer if observed else None):
                teacher = _logits(model, ids, mask, context)
            n_real = ids.numel() if mask is None else int(mask.sum())
            tokens += n_real
            longest = max(longest, ids.shape[1] if mask is None else int(mask.sum(1).max()))
            if "kl" in want:
                for i, attn in modules.items():
                    with attention_mode(model, "softmax"):
                        attn.hedgecats.mode = "hybrid"  # this layer alone
                        student = _logits(model, ids, mask, context)
                    kl_sums[i] += token_kl(teacher, student, mask)[0]
                    del student
            n_batches += 1
            log.info("layer selection: scored batch %d (%d tokens)", n_batches, tokens)
    finally:
        model.train(was_training)
    if not n_batches or not tokens:
        raise ValueError("the held-out set is empty: nothing to score")
    if not any(far_positions(a.hedgecats, longest, "cpu").any() for a in modules.values()):
        windows = sorted({a.hedgecats.window for a in modules.values()})
        raise ValueError(f"the held-out sequences ({longest} tokens at most) are no longer than "
                         f"the hybrid window ({', '.join(map(str, windows))}): LA sees no key, "
                         "every layer's hybrid is its softmax, and there is nothing to score. "
                         "Give longer held-out sequences")
    values: dict[str, dict[int, float]] = {}
    for name in want:
        if name == "kl":
            values[name] = {i: s / tokens for i, s in kl_sums.items()}
        elif name in _HEALTH:
            values[name] = {i: s / n_batches for i, s in health[name].items()}
        elif name == "la_share":
            values[name] = {i: _mean_share(*norms[i]) for i in modules}
        else:  # random: the control
            draw = torch.rand(len(modules), generator=torch.Generator().manual_seed(seed))
            values[name] = {i: float(x) for i, x in zip(modules, draw)}
    return {"values": values, "tokens": tokens, "batches": n_batches, "longest": longest}


def _mean_share(la_H: torch.Tensor, swa_H: torch.Tensor) -> float:
    """Mean over heads of LA's share of the two branches' norms (heads with none left out)."""
    total = la_H + swa_H
    shares = [float(a / t) for a, t in zip(la_H.tolist(), total.tolist()) if t > 0]
    return sum(shares) / len(shares) if shares else 0.0


@torch.no_grad()
def kl_curve(model, batches: Iterable[dict], order: Sequence[int], n_max: int, *,
             context: Callable = contextlib.nullcontext) -> list[float]:
    """The held-out KL to the teacher (nats per token) of the whole model with the first ``n``
    layers of ``order`` softmax and every other converted layer hybrid, ``n = 0 .. n_max``:
    one pass over ``batches``, ``n_max + 1`` forwards per batch besides the teacher's."""
    modules = _converted(model)
    if sorted(order) != sorted(modules) or not 0 <= n_max < len(order):
        raise ValueError(f"kl_curve: order {list(order)} must rank the converted layers "
                         f"{sorted(modules)} and n_max={n_max} lie in [0, {len(order) - 1}]")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums, tokens = [0.0] * (n_max + 1), 0
    try:
        for batch in batches:
            ids, mask = _inputs(batch, device)
            with attention_mode(model, "softmax"):
                teacher = _logits(model, ids, mask, context)
            for n in range(n_max + 1):
                with attention_mode(model, "hybrid"):
                    for i in order[:n]:
                        modules[i].hedgecats.mode = "softmax"
                    student = _logits(model, ids, mask, context)
                kl, count = token_kl(teacher, student, mask)
                sums[n] += kl
                del student
            tokens += count
    finally:
        model.train(was_training)
    if not tokens:
        raise ValueError("the held-out set is empty: nothing to score")
    return [s / tokens for s in sums]
