"""The functional hybrid layer (docs/method.md#the-hybrid-layer): SWA + LA, mixers, modes.

    hybrid      w_swa * SWA + w_la * LA          (w_swa, w_la) = (g, 1 - g), or the
                                                shared-norm weights (alpha_t, 1 - alpha_t)
    swa_only    w_swa * SWA                     (LA zero-ablated; rescale=True: SWA)
    la_only     w_la  * LA                      (SWA zero-ablated; rescale=True: LA)
    sinks_only  softmax over the first n_sinks real keys (after any left padding), i <= t,
                weight 1
    none        0
    softmax     full causal softmax attention (the teacher)

SWA_t is softmax over keys ``t - w < i <= t``. LA_t sees keys ``i <= t - w`` (non-overlapping,
the default) or ``i <= t`` (``overlap=True``); in ``la_only`` mode ``la_span="all"`` widens LA to
every causal key whatever ``overlap`` says (elsewhere ``la_span`` has no effect). LA is 0 for a
query with no visible key. ``window_shape`` (``ops.windows``) replaces the sliding window by
LoLCATs' terraced one (the query's block of ``w`` tokens plus the previous block); "keys outside
the window" then means the keys of the blocks before those.

``shared_norm`` (LoLCATs) uses one denominator for both branches,

    out_t = (s * sum_win exp(q.k_i/sqrt(D)) v_i + sum_far kappa_i v_i)
            / (s * sum_win exp(q.k_i/sqrt(D)) + sum_far kappa_i),       s = sigmoid(a_h),

(``kappa_i = phi_q.phi_k_i + eps``, the LA kernel with its floor, ``ops.reference.LA_EPS``)

which equals ``alpha_t SWA_t + (1 - alpha_t) LA_t`` with
``alpha_t = sigmoid(log s + lse_t - log Z_far_t)`` (``lse_t`` the window's log-sum-exp, ``Z_far_t``
the LA denominator; ``alpha_t = 1`` where LA sees no key). We compute it in that form: both
branches are normalised separately and the weight is formed in log space, so it is exact for any
logit size (this formula's exp(s_ti) overflows fp32 once logits pass ~88).

LoLCATs' own code (``hybrid_attention_quadratic`` in ``linear_window_attention_{sw,tk}.py``) is
a different function, not only a different computation: it subtracts the window's largest logit
``m_t`` from the softmax scores and leaves the LA scores unscaled,

    out_t = (s * sum_win exp(s_ti - m_t) v_i + sum_far phi_q.phi_k v_i)
            / (s * sum_win exp(s_ti - m_t) + sum_far phi_q.phi_k),

so its weight is ``alpha_t = sigmoid(log s + lse_t - m_t - log Z_far_t)``: LA counts ``exp(m_t)``
times more than in the formula above. ``shared_norm="window_max"`` computes that one (for
conversions imported from LoLCATs, ``models.lolcats``), in the same log-space form; its terms
are bounded (``exp(s_ti - m_t) <= 1``), so LoLCATs' direct form is finite too and the two agree
to rounding.

``shared_norm="la_mass"`` (the ``la_mass`` mixer) weighs the two branches by where LA's own
kernel mass lies: ``alpha_t = Z_win_t / (Z_win_t + Z_far_t)``, ``Z_win_t = sum_win kappa_i``
(``windows.window_la_mass``) and ``Z_far_t`` the LA denominator. Full softmax attention is
exactly that mix of its window part and its far part, weighted by ``exp`` masses; LA's kernel
stands in for ``exp`` in both masses, so the mix follows the teacher query by query, and it is
exact where the kernel is ``exp(q.k / sqrt(D))`` itself (tested). No parameters, no scale to
calibrate: a query-dependent factor between kernel and ``exp`` cancels in the ratio.
"""

from __future__ import annotations

import torch

from . import backends, windows
from .reference import LA_EPS

__all__ = ["LA_SPANS", "MODES", "hybrid_attention"]

MODES = ("hybrid", "swa_only", "la_only", "sinks_only", "none", "softmax")
LA_SPANS = ("outside", "all")
#: ``shared_norm`` values: off, the formula of docs/method.md#mixers, LoLCATs' max-shifted one,
#: the split of LA's kernel mass (module docstring)
SHARED_NORMS = (False, True, "window_max", "la_mass")


def _check_choice(value: str, options: tuple[str, ...], what: str) -> None:
    if value not in options:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(options)}")


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fq: torch.Tensor | None,
    fk: torch.Tensor | None,
    *,
    window: int,
    mode: str = "hybrid",
    g: float | torch.Tensor = 0.5,
    shared_norm: bool | str = False,
    overlap: bool = False,
    rescale: bool = False,
    la_span: str = "outside",
    n_sinks: int = 8,
    swa_drop: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    eps: float = LA_EPS,
    backend: str = "auto",
    ops: backends.Ops | None = None,
    window_shape: str = "sliding",
    maps: tuple | None = None,
) -> torch.Tensor:
    """Hybrid attention of one layer.

    Args:
        q: (B, H, T, D), RoPE applied.     k, v: (B, Hkv, Tk, D) (GQA when Hkv < H).
        fq: (B, H, T, F) = phi_q(q).       fk: (B, Hkv, Tk, F) = phi_k(k), or (B, H, Tk, F)
            for key maps untied per query head (LoLCATs). Unused (may be None) in modes that
            run no LA (``sinks_only``, ``none``, ``softmax``).
        window: SWA window ``w`` (>= 1); the block length of the terraced shapes.
        mode: one of ``MODES``.
        g: SWA weight. A float, or a tensor broadcastable to (B, H, T, D) (learned per head,
            or an output gate per channel). With ``shared_norm=True`` it is instead the per-head
            factor ``sigmoid(a_h)``, broadcastable to (B, H, T, 1).
        shared_norm: ``False``; ``True`` for the shared denominator of docs/method.md#mixers;
            ``"window_max"`` for LoLCATs' code, softmax scores shifted by the window's max
            logit; ``"la_mass"`` for the weights of LA's kernel mass inside and outside the
            window (module docstring; ``g`` is then the factor on the window's mass, 1).
        overlap: LA over all causal keys instead of keys outside the window.
        rescale: in ``swa_only`` / ``la_only`` the surviving branch gets weight 1.
        la_span: ``outside`` or ``all``; ``all`` lets LA see every causal key in ``la_only``.
        n_sinks: keys kept by ``sinks_only``.
        swa_drop: optional bool tensor broadcastable to (B, H, 1, 1); where True the output is
            that of ``la_only`` with the same switches (Scheduled Sliding-window Dropout).
        key_padding_mask: (B, Tk) bool, True for real tokens.
        scale: score scale, default ``1/sqrt(D)``.
        eps: the LA kernel floor, added to every kernel value ``fq . fk`` in numerator and
            normaliser alike (``ops.reference.LA_EPS``, 1e-6).
        backend: ``auto | reference | fla | flash_attn | flex | triton`` (see ``ops.backends``).
        ops: the pieces to compute with, an object like ``backends.Ops``; default
            ``backends.select(backend, q, key_padding_mask)``. A KV cache passes its own, whose
            pieces add what it keeps of earlier keys (``models.cache``); the mixing and the
            modes stay the ones above.
        window_shape: ``sliding`` (default) | ``terraced`` | ``terraced_end`` (``ops.windows``).
        maps: ``(phi_q, phi_k)``, the feature maps (``HedgehogFeatureMap``), in place of fq
            and fk (both ``None``): the converted layer's call. Where the fused kernel takes
            the call and can fold the maps (``triton_hybrid.fold_maps``), they run inside its
            autograd Function (one node, the q map's backward from the kernel's du); elsewhere
            ``fq, q = phi_q(q, with_input=True, kernel_du=True)`` and ``fk, k = phi_k(k,
            with_input=True)`` run here first. The same values either way.

    Returns:
        (B, H, T, D) in q's dtype.
    """
    _check_choice(mode, MODES, "attention mode")
    _check_choice(la_span, LA_SPANS, "la_span")
    _check_choice(window_shape, windows.WINDOW_SHAPES, "window shape")
    if shared_norm not in SHARED_NORMS:
        raise ValueError(f"shared_norm={shared_norm!r}; valid: "
                         f"{', '.join(repr(x) for x in SHARED_NORMS)}")
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window!r}")
    if k.shape[2] != v.shape[2] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in heads and length")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ops = backends.select(backend, q, key_padding_mask) if ops is None else ops
    dtype = q.dtype

    if mode == "none":
        return torch.zeros_like(q)
    if mode == "softmax":
        return ops.softmax(q, k, v, scale=scale, key_padding_mask=key_padding_mask).to(dtype)
    if mode == "sinks_only":
        if n_sinks < 1:
            raise ValueError(f"sinks_only needs n_sinks >= 1, got {n_sinks!r}")
        out, _ = ops.sinks(q, k, v, scale=scale, n_sinks=n_sinks, key_padding_mask=key_padding_mask)
        return out.to(dtype)
    if maps is not None:
        if fq is not None or fk is not None:
            raise ValueError("pass the features (fq, fk) or the maps (maps=(phi_q, phi_k)), "
                             "not both")
        out = None
        if isinstance(ops, backends.Ops) and _fused_cannot(window_shape, shared_norm, k,
                                                           None) is None:
            out = ops.fused(q, k, v, None, None, window=window, mode=mode, g=g,
                            shared_norm=shared_norm, overlap=overlap, rescale=rescale,
                            la_span=la_span, swa_drop=swa_drop,
                            key_padding_mask=key_padding_mask, scale=scale, eps=eps, maps=maps)
        if out is not None:
            return out.to(dtype)
        fq, fk, q, k = _apply_maps(maps, q, k)
    if fq is None or fk is None:
        raise ValueError(f"mode {mode!r} runs linear attention: fq and fk (or maps) are "
                         f"required")

    # the whole layer in one fused kernel, where the backend has one that covers this call
    # (``backends.Ops.fused``; ``None``: compose the pieces below). It computes the sliding
    # window, the unshifted shared norm and key maps per KV head only: other calls never reach it.
    fused = getattr(ops, "fused", None)
    unfused = _fused_cannot(window_shape, shared_norm, k, fk)
    if fused is not None and unfused is not None:
        if getattr(ops, "_fused", None) is not None:  # a kernel was there to be used
            backends._warn_once(f"fused Triton hybrid not used for {unfused}: composing the "
                                f"pieces")
        fused = None
    shape_kw = {}
    if window_shape != "sliding":
        if not isinstance(ops, backends.Ops):
            raise ValueError(f"{type(ops).__name__} (a KV cache's pieces) cannot compute the "
                             f"{window_shape!r} window; run without the cache")
        shape_kw = {"window_shape": window_shape}
    out = None if fused is None else fused(
        q, k, v, fq, fk, window=window, mode=mode, g=g, shared_norm=shared_norm, overlap=overlap,
        rescale=rescale, la_span=la_span, swa_drop=swa_drop, key_padding_mask=key_padding_mask,
        scale=scale, eps=eps)
    if out is not None:
        return out.to(dtype)

    need_swa = mode in ("hybrid", "swa_only")
    need_la = mode in ("hybrid", "la_only") or shared_norm or swa_drop is not None
    need_lse = bool(shared_norm)

    swa = lse = None
    if need_swa or shared_norm:
        swa, lse = ops.swa(q, k, v, scale=scale, window=window, need_lse=need_lse,
                           key_padding_mask=key_padding_mask, **shape_kw)
    shift = 0 if overlap else window
    la = la_den = la_has = None
    if need_la:
        la, la_den, la_has = ops.linear(fq, fk, v, shift=shift, eps=eps,
                                        need_den=bool(shared_norm),
                                        key_padding_mask=key_padding_mask, **shape_kw)
    log_near = None
    if shared_norm:
        log_near = _log_window_mass(shared_norm, q, k, fq, fk, lse, scale=scale, window=window,
                                    window_shape=window_shape, eps=eps,
                                    key_padding_mask=key_padding_mask)
    w_swa, w_la = _branch_weights(g, shared_norm, log_near, la_den, la_has, eps)

    def la_only_output() -> torch.Tensor:
        la_all = la
        if la_span == "all" and shift != 0:
            la_all, _, _ = ops.linear(fq, fk, v, shift=0, eps=eps, need_den=False,
                                      key_padding_mask=key_padding_mask)
        return la_all if rescale else w_la * la_all

    if mode == "hybrid":
        out = w_swa * swa + w_la * la
    elif mode == "swa_only":
        out = swa if rescale else w_swa * swa
    else:  # la_only
        out = la_only_output()
    if swa_drop is not None and mode != "la_only":
        out = torch.where(swa_drop.bool(), la_only_output(), out)
    return out.to(dtype)


def _apply_maps(maps, q, k):
    """(fq, fk, q, k) from the maps (phi_q, phi_k): q and k handed on through them (their two
    gradients summed in the maps' kernels where those run), the q map's backward from the
    hybrid kernel's du where both kernels run (``triton_phi.DuSlot``)."""
    phi_q, phi_k = maps
    fq, q = phi_q(q, with_input=True, kernel_du=True)
    fk, k = phi_k(k, with_input=True)
    return fq, fk, q, k


def _fused_cannot(window_shape, shared_norm, k, fk) -> str | None:
    """Why the fused kernel must not take this call (it would compute another function), or
    ``None``."""
    if window_shape != "sliding":
        return f"the {window_shape!r} window"
    if shared_norm == "window_max":
        return "LoLCATs' max-shifted shared norm"
    if shared_norm == "la_mass":
        return "the la_mass mixer"
    if fk is not None and fk.shape[1] != k.shape[1]:
        return "key feature maps per query head"
    return None


def _log_window_mass(shared_norm, q, k, fq, fk, lse, *, scale, window, window_shape, eps,
                     key_padding_mask) -> torch.Tensor:
    """(B, H, T) fp32: the log of the window's mass that a shared normaliser weighs against LA's
    ``Z_far``, ``-inf`` where the window holds no real key: ``lse_t`` (``True``), ``lse_t - m_t``
    (LoLCATs' ``"window_max"``, ``m_t`` the window's largest logit) or ``log Z_win_t`` (LA's
    kernel mass in the window, ``"la_mass"``). The window's pieces run in PyTorch on any
    device."""
    if shared_norm is True:
        return lse.float()
    if shared_norm == "la_mass":
        z_win = windows.window_la_mass(fq, fk, window=window, window_shape=window_shape,
                                       key_padding_mask=key_padding_mask, eps=eps)
        # a window with real keys has Z >= eps per key (non-negative features: HybridConfig
        # refuses la_mass with activation none); the clamp only keeps log(0) out of the graph,
        # and those rows are set to -inf
        return torch.where(z_win > 0, torch.log(z_win.clamp_min(eps)), float("-inf"))
    m_win = windows.window_max_logit(q, k, scale=scale, window=window,
                                     window_shape=window_shape, key_padding_mask=key_padding_mask)
    return torch.where(torch.isfinite(lse), lse.float() - m_win.float(), float("-inf"))


def _branch_weights(g, shared_norm, log_near, la_den, la_has, eps):
    """(w_swa, w_la), each a float or a tensor broadcastable to (B, H, T, D). ``log_near``
    (B, H, T): the window's log mass (``_log_window_mass``) for a shared normaliser, else
    ``None``."""
    if not shared_norm:
        return g, 1 - g
    s = g if torch.is_tensor(g) else torch.tensor(float(g), device=log_near.device)
    if torch.is_tensor(s) and s.dim() == 4:
        s = s[..., 0]  # (B|1, H, T|1, 1) -> (B|1, H, T|1)
    # clamps (audited with the weights_xent fix, docs/testbed.md): s = sigmoid(a_h) > 0, the
    # floor only keeps log finite for a saturated sigmoid; the LA denominator already holds the
    # kernel floor (eps per visible key, ops.reference.LA_EPS), so the clamp acts only where LA
    # sees no key (alpha is set to 1 there below): alpha and LA_t use the same weights
    log_s = torch.log(s.float().clamp_min(1e-30))
    log_far = torch.log(la_den.float().clamp_min(eps))
    alpha = torch.sigmoid(log_s + log_near - log_far)
    # no far key: all weight on the window; no window key either (padding): weight irrelevant
    alpha = torch.where(la_has, alpha, torch.ones_like(alpha))
    alpha = torch.where(torch.isfinite(log_near), alpha, torch.zeros_like(alpha))
    alpha = alpha[..., None]  # (B, H, T, 1)
    return alpha, 1 - alpha
