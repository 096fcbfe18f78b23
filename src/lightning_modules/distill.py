"""Stage 2 by distillation: the KL from the teacher's next-token distribution to the student's
(docs/method.md#stage-2-by-distillation).

The teacher is the student's own weights in ``softmax`` mode with its adapters disabled, the
original model bit for bit; ``HybridFinetune`` runs it under ``no_grad`` in the same step.
This module holds the objective, in plain PyTorch, on logits:

    kl_reference        the readable KL at temperature T over the whole vocabulary, (B, T, V)
    topk_kl_reference   the readable KL over the teacher's k most likely tokens + one bucket
    teacher_targets     what the teacher hands the loss: its logits, or its top-k log-probs
    distill_terms       the memory-bounded loss: ``[kl, next_token]`` computed chunk by chunk
                        over positions (fp32 inside a chunk only), gradients recomputed per
                        chunk in the backward; exact, or the top-k KL with ``teacher_targets(k)``

Positions are those of the next-token loss: position t predicts token t + 1 where that token is
not padding (``next_token_targets``), each weighted 1 / (number of such positions).

Temperature: both distributions are ``softmax(z / T)``; the objective is ``T^2 KL`` (Hinton et
al.'s scaling: the gradient of the KL w.r.t. the logits shrinks as 1 / T^2 for large T, so the
factor keeps the step size comparable across temperatures; at T = 1 it is the plain KL). The
logged ``kl`` is the KL itself, without the factor.

This module never imports lightning.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DEFAULT_CHUNK",
    "LOSSES",
    "TeacherTargets",
    "TeacherUnavailableError",
    "adapter_parameter_names",
    "check_distillation",
    "distill_terms",
    "kl_reference",
    "next_token_reference",
    "next_token_targets",
    "teacher_targets",
    "topk_kl_reference",
]

#: stage 2's objectives: next-token cross-entropy, the KL to the teacher, or a mix of the two
LOSSES = ("next_token", "kl", "mixed")
#: positions per chunk of ``distill_terms``: at a 128k vocabulary one fp32 (chunk, V) tensor
#: is about 250 MiB, and a chunk holds a handful of them
DEFAULT_CHUNK = 512


class TeacherUnavailableError(ValueError):
    """``loss: kl | mixed`` on a model whose ``softmax`` mode with adapters disabled is not the
    original model, so no teacher can be formed from its weights."""


# ----------------------------------------------------------------------------- settings
def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_distillation(loss: str, kl_weight: float | None, temperature: float | None,
                       topk: int | None, chunk: int) -> tuple[float, float]:
    """Validate stage 2's objective settings; returns ``(kl_weight, temperature)`` resolved.

    ``kl_weight`` is the KL's share in ``mixed`` (default 0.5) and nowhere else;
    ``temperature`` (default 1) and ``topk`` belong to ``kl`` and ``mixed``. A setting given
    to a loss that does not use it is an error: it would change nothing."""
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not valid; choose one of {', '.join(LOSSES)}")
    if kl_weight is not None:
        if loss != "mixed":
            raise ValueError(f"kl_weight={kl_weight!r} is the KL's share in loss: mixed; with "
                             f"loss: {loss} it would do nothing: leave it unset, or use "
                             f"loss: mixed")
        if not _number(kl_weight) or not 0 < kl_weight < 1:
            raise ValueError(f"kl_weight={kl_weight!r} must lie strictly between 0 and 1 (the "
                             f"objective is (1 - kl_weight) next_token + kl_weight T^2 KL; for "
                             f"0 or 1 use loss: next_token or loss: kl)")
    if loss == "next_token":
        for name, value in (("temperature", temperature), ("kl_topk", topk)):
            if value is not None:
                raise ValueError(f"{name}={value!r} belongs to the KL; with loss: next_token it "
                                 f"would do nothing: leave it unset, or use loss: kl or mixed")
    if temperature is not None and (not _number(temperature) or not temperature > 0):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (1: the "
                         f"teacher's own distribution)")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise ValueError(f"kl_topk={topk!r} must be an integer >= 1 (the teacher's most likely "
                         f"tokens kept), or null for the KL over the whole vocabulary")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"kl_chunk={chunk!r} must be an integer >= 1 (positions per chunk)")
    weight = (0.5 if kl_weight is None else float(kl_weight)) if loss == "mixed" else \
        (1.0 if loss == "kl" else 0.0)
    return weight, 1.0 if temperature is None else float(temperature)


# ----------------------------------------------------------------------------- positions
def next_token_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, weights)``, both (B, T): position t's target is token t + 1; its weight is
    1 / n where token t + 1 is real (the positions the next-token loss counts, n of them), 0 at
    the last position and where the next token is padding."""
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None \
        else attention_mask.bool()
    valid = torch.cat([valid[:, 1:], torch.zeros_like(valid[:, :1])], dim=1)
    targets = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)
    weights = valid.float() / valid.sum()  # no real target: 0 / 0, a loss the stage refuses
    return targets, weights


# ----------------------------------------------------------------------------- references
def kl_reference(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
                 temperature: float = 1.0) -> torch.Tensor:
    """``sum_t w_t KL(p_t || q_t)`` with ``p = softmax(teacher / T)``, ``q = softmax(student /
    T)`` over the whole vocabulary (no ``T^2`` factor): logits (..., V), weights (...)."""
    log_p = torch.log_softmax(teacher.double() / temperature, dim=-1)
    log_q = torch.log_softmax(student.double() / temperature, dim=-1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (weights.double() * per_position).sum()


def topk_kl_reference(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor,
                      temperature: float, k: int) -> torch.Tensor:
    """The KL between the two distributions coarsened to k + 1 buckets: the teacher's k most
    likely tokens, one each, and every other token in one bucket. A coarsening never increases
    a KL, so this is <= ``kl_reference``, and equal to it when the bucket holds one token."""
    p = torch.softmax(teacher.double() / temperature, dim=-1)
    q = torch.softmax(student.double() / temperature, dim=-1)
    top = p.topk(k, dim=-1).indices
    p_top, q_top = p.gather(-1, top), q.gather(-1, top)
    p_b = torch.cat([p_top, 1 - p_top.sum(-1, keepdim=True)], dim=-1)
    q_b = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=-1)
    per_position = (p_b * (p_b.log() - q_b.log())).sum(-1)
    return (weights.double() * per_position).sum()


def next_token_reference(student: torch.Tensor, targets: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """``sum_t w_t CE(student_t, target_t)`` at temperature 1: the next-token loss."""
    ce = F.cross_entropy(student.double().flatten(0, -2), targets.flatten(), reduction="none")
    return (weights.double().flatten() * ce).sum()


# ----------------------------------------------------------------------------- the teacher
@dataclass
class TeacherTargets:
    """The teacher's side of the KL, per position (N rows): its logits (N, V), or, with top-k,
    the log-probabilities at temperature T of its k most likely tokens (N, k), their indices,
    and the log of the probability of every other token together (N,)."""

    logits: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None
    top_idx: torch.Tensor | None = None
    rest_logp: torch.Tensor | None = None

    def rows(self) -> tuple:
        return (self.logits, self.top_logp, self.top_idx, self.rest_logp)


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


@torch.no_grad()
def teacher_targets(logits: torch.Tensor, temperature: float, topk: int | None,
                    chunk: int = DEFAULT_CHUNK) -> TeacherTargets:
    """The teacher's logits (N, V) as the loss takes them: as they are (``topk`` None), or
    reduced to its ``topk`` most likely tokens and one bucket for the rest, chunk by chunk
    (fp32 inside a chunk only), so that the full logits can be freed before the student's
    forward."""
    if topk is None:
        return TeacherTargets(logits=logits)
    n, vocab = logits.shape
    if topk >= vocab:
        raise ValueError(f"kl_topk={topk} keeps every token of a {vocab}-token vocabulary; set "
                         f"it below {vocab}, or to null for the exact KL")
    top_logp = logits.new_empty((n, topk), dtype=torch.float32)
    top_idx = logits.new_empty((n, topk), dtype=torch.long)
    rest_logp = logits.new_empty((n,), dtype=torch.float32)
    for sl in _chunks(n, chunk):
        z = logits[sl].float() / temperature
        lse = z.logsumexp(-1)
        values, idx = z.topk(topk, dim=-1)
        top_logp[sl] = values - lse[:, None]
        top_idx[sl] = idx
        rest_logp[sl] = z.scatter(-1, idx, -math.inf).logsumexp(-1) - lse
    return TeacherTargets(top_logp=top_logp, top_idx=top_idx, rest_logp=rest_logp)


# ----------------------------------------------------------------------------- the loss
def _chunk_terms(student: torch.Tensor, logits, top_logp, top_idx, rest_logp,
                 targets: torch.Tensor, weights: torch.Tensor,
                 temperature: float) -> torch.Tensor:
    """``[sum w KL, sum w CE]`` of one chunk of positions, in fp32 whatever the autocast.

    The student's log-probabilities are computed as the teacher's are (``teacher_targets``),
    so equal logits give a KL of exactly 0. Where the two nearly match, rounding can put a
    position's sum a hair below 0: it is floored at 0 (its gradient there is 0 to rounding
    as well), so the loss never reads below its bound."""
    with torch.autocast(student.device.type, enabled=False):
        s = student.float()
        z = s / temperature
        if logits is not None:
            log_p = torch.log_softmax(logits.float() / temperature, dim=-1)
            kl = (log_p.exp() * (log_p - torch.log_softmax(z, dim=-1))).sum(-1)
        else:
            lse = z.logsumexp(-1)
            log_q_top = z.gather(-1, top_idx) - lse[:, None]
            log_q_rest = z.scatter(-1, top_idx, -math.inf).logsumexp(-1) - lse
            kl = (top_logp.exp() * (top_logp - log_q_top)).sum(-1) + \
                rest_logp.exp() * (rest_logp - log_q_rest)
        ce = s.logsumexp(-1) - s.gather(-1, targets[:, None])[:, 0]
        return torch.stack([(weights * kl.clamp_min(0)).sum(), (weights * ce).sum()])


class _ChunkedTerms(torch.autograd.Function):
    """``[kl, next_token]`` over (N, V) student logits, a chunk of positions at a time; the
    backward recomputes each chunk's terms and writes its gradient into one (N, V) tensor, so
    no fp32 (N, V) tensor ever exists."""

    @staticmethod
    def forward(ctx, student, temperature, chunk, *rows):
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.save_for_backward(student, *rows)
        out = torch.zeros(2, dtype=torch.float32, device=student.device)
        for sl in _chunks(student.shape[0], chunk):
            out += _chunk_terms(student[sl], *_sliced(rows, sl), temperature=temperature)
        return out

    @staticmethod
    def backward(ctx, grad):
        student, *rows = ctx.saved_tensors
        grad_student = torch.empty_like(student)
        for sl in _chunks(student.shape[0], ctx.chunk):
            with torch.enable_grad():
                s = student[sl].detach().requires_grad_(True)
                terms = _chunk_terms(s, *_sliced(rows, sl), temperature=ctx.temperature)
                (grad_student[sl],) = torch.autograd.grad(terms, s, grad)
        return (grad_student, None, None, *(None,) * len(rows))


def _sliced(rows, sl: slice) -> list:
    return [None if r is None else r[sl] for r in rows]


def distill_terms(student: torch.Tensor, teacher: TeacherTargets, targets: torch.Tensor,
                  weights: torch.Tensor, temperature: float = 1.0,
                  chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kl, next_token)`` of student logits (N, V) against the teacher, each summed over
    positions with ``weights`` (N,) (``next_token_targets``, flattened): the KL at
    ``temperature`` (exact, or over the teacher's top-k buckets as ``teacher`` holds it) and
    the cross-entropy at temperature 1. Both carry gradients to ``student``; memory beyond the
    logits is one chunk of ``chunk`` positions in fp32."""
    if student.dim() != 2:
        raise ValueError(f"student logits must be (N, V), got shape {tuple(student.shape)}")
    out = _ChunkedTerms.apply(student, float(temperature), int(chunk), *teacher.rows(),
                              targets, weights.float())
    return out[0], out[1]


# ----------------------------------------------------------------------------- adapters
def adapter_parameter_names(model: nn.Module) -> set[str]:
    """Names (as in ``model.named_parameters()``) of the parameters that disabled adapters do
    not read: LoRA's weights, and the trained copies of peft's modules_to_save."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    out: set[str] = set()
    for prefix, m in model.named_modules():
        if isinstance(m, BaseTunerLayer):
            parts = m.adapter_layer_names
        elif isinstance(m, AuxiliaryTrainingWrapper):
            parts = tuple(n for n, _ in m.named_children() if n != "original_module")
        else:
            continue
        for part in parts:
            sub = getattr(m, part, None)
            if isinstance(sub, nn.Module):
                out |= {f"{prefix}.{part}.{n}" for n, _ in sub.named_parameters()}
    return out
