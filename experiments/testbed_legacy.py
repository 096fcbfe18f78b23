"""``hedgecats`` with the first version's weights cross-entropy, for before / after comparisons.

    python -m experiments.testbed_legacy pipeline configs/testbed/hedgecats.yaml --output ...

The first ``weights_xent`` floored each kernel value at ``eps`` = 1e-6 in the numerator but the
normaliser only as a sum, and inference floored the LA denominator at 1e-6: once every product
of a row fell below 1e-6 the loss read 0 with no gradient (docs/testbed.md, issue 20). This
wrapper restores exactly those two formulas - the objective's block, and at inference LA with
no kernel floor and its normaliser clamped at 1e-6 (``out = num / max(den, 1e-6)``, obtained
from today's LA run without a floor as ``out * den / max(den, 1e-6)``) - and switches the
end-of-stage health check (which the first version did not have) off, so that the collapse can
be measured; everything else is today's code. The fused kernels carry today's floor, so the
process runs without them (``HEDGECATS_TRITON=0``: the objective takes the blocked PyTorch
version, whose block is replaced here, and LA the pieces patched here). It is a measurement
tool, never a recipe.
"""

from __future__ import annotations

import os
import sys

import torch

LEGACY_EPS = 1e-6


def _legacy_xent_block(q_blk, k, fq_blk, fk, qpos, kpm, scale: float, eps: float = 0.0):
    """The first version's block (its formula verbatim; today's kernel floor ``eps`` is ignored),
    plus the teacher entropy that today's interface returns."""
    Tk = k.shape[2]
    allowed = torch.arange(Tk, device=q_blk.device)[None, :] <= qpos[:, None]
    allowed = allowed[None, None]
    if kpm is not None:
        allowed = allowed & kpm[:, None, None, :]
    with torch.no_grad():
        s = torch.einsum("bhqd,bhkd->bhqk", q_blk.float(), k.float()) * scale
        log_soft = torch.log_softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        a_soft = torch.exp(log_soft).nan_to_num(0.0)
        ent = -(a_soft * torch.where(allowed, log_soft, torch.zeros_like(log_soft))).sum(-1)
    a = torch.einsum("bhqf,bhkf->bhqk", fq_blk.float(), fk.float())
    a = a.masked_fill(~allowed, 0.0)
    log_den = torch.log(a.sum(dim=-1, keepdim=True).clamp_min(LEGACY_EPS))
    log_a = torch.log(a.clamp_min(LEGACY_EPS)) - log_den
    xent = -(a_soft * log_a).sum(dim=-1)
    if kpm is not None:
        real = kpm[:, None, qpos].to(xent.dtype)
        xent, ent = xent * real, ent * real
    return xent.sum(), ent.sum()


def _legacy_linear(impl):
    """An ``Ops.linear`` piece with the first version's inference: no kernel floor, the
    normaliser clamped at ``LEGACY_EPS``."""
    from hedgecats.models.ops.hybrid.reference import DEN_TINY

    def linear(fq, fk, v, *, shift, eps, need_den, key_padding_mask, **kw):
        out, den, has = impl(fq, fk, v, shift=shift, eps=DEN_TINY, need_den=True,
                             key_padding_mask=key_padding_mask, **kw)
        out = out * (den / den.clamp_min(LEGACY_EPS))[..., None].to(out.dtype)
        return out, (den if need_den else None), has

    return linear


def install() -> None:
    from hedgecats.lightning_modules import stages
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.transfer import reference as transfer_reference

    # every fused kernel (objective, hybrid, feature maps) reads this switch on each call
    os.environ["HEDGECATS_TRITON"] = "0"
    transfer_reference._xent_block = _legacy_xent_block  # the blocked objective's block
    for name in ("ref_linear", "fla_linear"):
        setattr(backends, name, _legacy_linear(getattr(backends, name)))
    backends.REFERENCE = backends.Ops(backends.ref_swa, backends.ref_linear,
                                      backends.ref_softmax, "reference")
    backends._cuda_ops.cache_clear()
    stages.AttentionTransfer._check_health = lambda self, health: None  # measured, not enforced


if __name__ == "__main__":
    install()
    from hedgecats.cli import main

    sys.exit(main(sys.argv[1:]))
