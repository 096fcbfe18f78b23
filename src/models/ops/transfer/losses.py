"""Attention-transfer objectives (docs/method.md#stage-1-attention-transfer), one layer at a time.

The teacher is the layer's own causal softmax attention on the same (detached) q, k, v; the
student is the layer's feature maps (and mixer). Three objectives, each a scalar averaged over
real query positions and heads:

    weights_xent       -sum_t sum_{i<=t} A_soft[t,i] log A_phi[t,i]   (HedgeHog; summed over keys,
                       averaged over queries) with A_phi[t,i] = k_ti / sum_{j<=t} k_tj and the
                       kernel k_ti = fq_t.fk_i + eps (see below)
    la_output_mse      mean || O_soft - O_LA ||^2     (LA over all causal keys)
    hybrid_output_mse  mean || O_soft - (g O_SWA + (1-g) O_LA) ||^2   (LoLCATs; the layer's mixer)

Outputs are compared before ``o_proj``; the MSE is the mean over (B, H, T, D) of real queries.

**The cross-entropy is exact and bounded below by the teacher's entropy.** ``A_phi`` is always a
distribution over the visible keys: numerator and normaliser are formed from the *same* kernel
values ``k_ti = fq_t . fk_i + eps`` (``eps``: the layer's kernel floor, ``hybrid.reference.LA_EPS``,
1e-6), and the LA at inference divides the same sums (``hybrid.reference.linear_attention_chunked``
and the GPU backends), so inference uses the normalised weights this objective trains (tested:
``tests/test_transfer.py``). So ``xent >= H(A_soft)`` row by row (Gibbs), and a row whose every
product is far below ``eps`` scores the cross-entropy against *uniform* weights: a high loss,
never a minimum, with a gradient through every product. (A numerator floored elementwise at
``eps`` and a normaliser floored only as a sum would read exactly 0 with no gradient once every
product of a row fell below ``eps``, and training finds that region by pushing query and key
features onto disjoint coordinates: docs/testbed.md.)
``weights_xent(..., return_entropy=True)`` also returns the teacher's entropy, so that
``KL = xent - entropy >= 0`` (0 = match) can be logged. With activation ``none`` products can be
negative; kernel values are then floored at fp32's smallest normal number before the log (its
weights are not a distribution at inference either).

``weights_xent`` (``reference``: blocked over queries, each block recomputed in the backward)
takes O(B H block T) memory; on CUDA the fused kernel (``xent``) takes its place, and the
output MSE's kernels (``mse``) the MSE's, where ``dispatch`` finds that they take the call.
"""

from __future__ import annotations

import torch

from ..hybrid import backends
from ..hybrid.attention import hybrid_attention
from ..hybrid.reference import LA_EPS
from . import dispatch
from .reference import TINY, la_log_weights, masked_mse_reference, weights_xent

__all__ = ["OBJECTIVES", "TINY", "hybrid_output_mse", "la_log_weights", "la_output_mse",
           "masked_mse_reference", "transfer_health", "transfer_loss", "weights_xent"]

OBJECTIVES = ("weights_xent", "la_output_mse", "hybrid_output_mse")


def _teacher_output(q, k, v, scale, kpm, backend):
    with torch.no_grad():
        ops = backends.select(backend, q, kpm)
        return ops.softmax(q.detach(), k.detach(), v.detach(), scale=scale, key_padding_mask=kpm)


def la_output_mse(q, k, v, fq, fk, *, scale: float | None = None,
                  key_padding_mask: torch.Tensor | None = None, eps: float = LA_EPS,
                  backend: str = "auto", teacher_output: torch.Tensor | None = None,
                  maps=None) -> torch.Tensor:
    """``mean ||O_soft - O_LA||^2`` with LA over all causal keys. Shapes as ``weights_xent``,
    v (B, Hkv, T, D).

    LA is ``hybrid_attention``'s ``la_only`` mode over every causal key at weight 1 (``la_span
    "all"``, ``overlap``: one LA pass, shift 0; ``rescale``), so it takes the layer's dispatch:
    the fused kernel on CUDA (1.3x the fla pieces' stage-1 step on an 8B model), the backends'
    ``linear`` elsewhere; the window is not computed in this mode. LA comes back in q's dtype,
    as the layer computes it, whatever the backend (so a bf16 loss is the same on each).
    ``teacher_output``: O_soft (B, H, T, D) as the teacher computed it (stage 1 hands it over
    from the teacher's forward); None: computed here by SDPA. ``maps``: ``(phi_q, phi_k)`` in
    place of fq and fk (both ``None``), as ``hybrid_attention`` takes them (stage 1's call: the
    maps inside the fused kernel's Function where it runs)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o_soft = (_teacher_output(q, k, v, scale, key_padding_mask, backend)
              if teacher_output is None else teacher_output.detach())
    o_la = hybrid_attention(q.detach(), k.detach(), v.detach(), fq, fk, window=1,
                            mode="la_only", la_span="all", overlap=True, rescale=True,
                            key_padding_mask=key_padding_mask, scale=scale, eps=eps,
                            backend=backend, maps=maps)
    return dispatch.masked_mse(o_la, o_soft, key_padding_mask)


def hybrid_output_mse(q, k, v, fq, fk, *, window: int, g=0.5, shared_norm: bool | str = False,
                      overlap: bool = False, scale: float | None = None,
                      key_padding_mask: torch.Tensor | None = None, eps: float = LA_EPS,
                      backend: str = "auto", window_shape: str = "sliding",
                      teacher_output: torch.Tensor | None = None, maps=None) -> torch.Tensor:
    """``mean ||O_soft - hybrid||^2``, the hybrid as ``hybrid_attention(mode="hybrid")``
    (``window_shape``: ``hybrid.windows``); ``teacher_output`` and ``maps`` as in
    ``la_output_mse``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o_soft = (_teacher_output(q, k, v, scale, key_padding_mask, backend)
              if teacher_output is None else teacher_output.detach())
    o_hyb = hybrid_attention(q.detach(), k.detach(), v.detach(), fq, fk, window=window,
                             mode="hybrid", g=g, shared_norm=shared_norm, overlap=overlap,
                             key_padding_mask=key_padding_mask, scale=scale, eps=eps,
                             backend=backend, window_shape=window_shape, maps=maps)
    return dispatch.masked_mse(o_hyb, o_soft, key_padding_mask)


def _gate(module, hidden_states):
    """The mixer's ``g`` for this layer (output gates read the layer input)."""
    if getattr(module.mixer, "needs_input", False) and hidden_states is None:
        raise ValueError(f"layer {module.hedgecats.layer_idx}: the {type(module.mixer).__name__} "
                         "mixer needs the layer input, and the observer received none (the "
                         "input hook that convert_to_hybrid installs for gated mixers is missing)")
    return module.mixer(None if hidden_states is None else hidden_states.detach())


def transfer_loss(objective: str, module, query, key, value, key_padding_mask=None,
                  hidden_states=None, *, xent_block: int = 64,
                  teacher_output: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One converted layer's loss: ``module`` is its ``self_attn`` (``phi_q``, ``phi_k``,
    ``mixer``, ``hedgecats`` runtime), q/k/v as the attention function receives them,
    ``hidden_states`` the layer input (needed by output-gate mixers), ``teacher_output`` the
    teacher's attention output (B, H, T, D) where the caller has it (the output-MSE
    objectives then do not compute it again; ``weights_xent`` does not read it).

    Returns ``(loss, extras)``: ``extras`` holds detached values worth logging; for
    ``weights_xent`` ``{"kl": loss - teacher entropy}`` (>= 0, 0 = the LA weights match)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown transfer objective {objective!r}; valid: {', '.join(OBJECTIVES)}")
    rt = module.hedgecats
    q, k, v = query.detach(), key.detach(), value.detach()
    scale = getattr(module, "scaling", None)
    maps = (module.phi_q, module.phi_k)  # (the output objectives hand them to the kernel)
    if objective == "weights_xent":
        fq, fk = module.phi_q(q), module.phi_k(k)
        loss, entropy = dispatch.weights_xent(q, k, fq, fk, scale=scale,
                                              key_padding_mask=key_padding_mask,
                                              block=xent_block, return_entropy=True, eps=rt.eps)
        return loss, {"kl": loss.detach() - entropy}
    if objective == "la_output_mse":
        return la_output_mse(q, k, v, None, None, scale=scale,
                             key_padding_mask=key_padding_mask, eps=rt.eps, backend=rt.backend,
                             teacher_output=teacher_output, maps=maps), {}
    return hybrid_output_mse(q, k, v, None, None, window=rt.window,
                             g=_gate(module, hidden_states), maps=maps,
                             shared_norm=module.mixer.shared_norm, overlap=rt.overlap, scale=scale,
                             key_padding_mask=key_padding_mask, eps=rt.eps,
                             backend=rt.backend, window_shape=rt.window_shape,
                             teacher_output=teacher_output), {}


@torch.no_grad()
def transfer_health(module, query, key, value, key_padding_mask=None,
                    hidden_states=None) -> dict[str, torch.Tensor]:
    """How well one layer's student reproduces its teacher, whatever the objective trained.

    ``la_rel_err``      sum ||O_LA - O_soft||^2 / sum ||O_soft||^2, LA over every causal key
                        (what ``weights_xent`` and ``la_output_mse`` train); 1 = no better than
                        an output of 0
    ``hybrid_rel_err``  the same for the layer's hybrid output (``hybrid_output_mse`` trains it)
    ``den_collapsed``   fraction of real query rows (LA over every causal key) whose products
                        sum to less than the kernel floor's share (``eps`` per visible key): the
                        floor then carries most of the row, which averages its values nearly
                        uniformly. Query and key features on disjoint coordinates, the signature
                        of the collapse the first ``weights_xent`` found
    Sums run over real (unpadded) queries only; values are fp32 scalars.
    """
    rt = module.hedgecats
    q, k, v = query.detach(), key.detach(), value.detach()
    scale = getattr(module, "scaling", None)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kpm = key_padding_mask
    fq, fk = module.phi_q(q), module.phi_k(k)
    o_soft = _teacher_output(q, k, v, scale, kpm, rt.backend).float()
    ops = backends.select(rt.backend, q, kpm)
    o_la, den, _ = ops.linear(fq, fk, v, shift=0, eps=rt.eps, need_den=True, key_padding_mask=kpm)
    o_hyb = hybrid_attention(q, k, v, fq, fk, window=rt.window, mode="hybrid",
                             g=_gate(module, hidden_states), shared_norm=module.mixer.shared_norm,
                             overlap=rt.overlap, key_padding_mask=kpm, scale=scale, eps=rt.eps,
                             backend=rt.backend,
                             window_shape=rt.window_shape)
    real = (torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device) if kpm is None
            else kpm.bool())  # (B, T)
    w = real[:, None, :, None].float()

    def rel_err(o):
        return ((o.float() - o_soft).pow(2) * w).sum() / (o_soft.pow(2) * w).sum().clamp_min(TINY)

    rows = real[:, None, :].expand_as(den)
    n_keys = real.long().cumsum(-1)[:, None, :].float()  # visible real keys (LA over every key)
    products = den.float() - rt.eps * n_keys  # the kernel sums without the floor
    return {"la_rel_err": rel_err(o_la), "hybrid_rel_err": rel_err(o_hyb),
            "den_collapsed": (products < rt.eps * n_keys)[rows].float().mean()}
