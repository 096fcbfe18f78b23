"""Whether the fused hybrid kernels take a call of ``ops.hybrid.hybrid_attention``, and the call
in the kernels' terms (``fused_hybrid``)."""

from __future__ import annotations

import torch

from ..feature_map import dispatch as triton_phi
from ..triton_common import GRID_AXIS_MAX, available, interpret, pow2, switched_on, warn_once
from .config import KernelConfig
from .function import FoldedMaps, _filled, _launch
from .gated import _gated, _no_features

def fold_maps(maps, q: torch.Tensor, k: torch.Tensor) -> tuple[FoldedMaps | None, str | None]:
    """``(FoldedMaps, None)`` where the two feature-map modules ``maps = (phi_q, phi_k)`` can
    run inside the hybrid kernel's Function on these q (B, H, T, D) and k (B, Hkv, T, D): each
    map's function is the fused map's (``HedgehogFeatureMap.kernel_form``: no floor, softmax or
    exp) and its kernel takes x (``triton_phi.unsupported_reason``: bf16, power-of-two dims, one
    map per head of x), both with the same feature dim; else ``(None, why)``."""
    if not switched_on():  # (the modules' own fused path: HEDGECATS_TRITON=0)
        return None, "the fused feature maps are off (HEDGECATS_TRITON=0)"
    forms = []
    for m, x, name in zip(maps, (q, k), ("phi_q", "phi_k")):
        form = getattr(m, "kernel_form", lambda: None)()
        if form is None:
            return None, (f"{name} ({m.extra_repr() if hasattr(m, 'extra_repr') else m}) is not "
                          f"the fused map's function (softmax or exp, no floor)")
        reason = triton_phi.unsupported_reason(x, *form)
        if reason is not None:
            return None, f"{name}: {reason}"
        forms.append(form)
    (wq, bq, aq), (wk, bk, ak) = forms
    if wq.shape[-1] != wk.shape[-1]:
        return None, f"the maps' feature dims differ ({2 * wq.shape[-1]}, {2 * wk.shape[-1]})"
    return FoldedMaps(wq, bq, wk, bk, aq == "softmax", ak == "softmax"), None



def unsupported_reason(q, k, v, fq, fk, key_padding_mask=None, *,
                       maps: FoldedMaps | None = None) -> str | None:
    """Why the fused kernels cannot take these tensors (``None``: they can); ``maps`` in
    place of fq and fk: the features the folded maps will compute (``fold_maps``: q's and k's
    dtype, k's heads)."""
    if not available():
        return "triton is not installed or there is no CUDA device"
    if not (q.is_cuda or interpret()):
        return "the fused kernels run on CUDA tensors"
    if maps is None and (fq is None or fk is None):
        return "no feature maps"
    dtypes = {x.dtype for x in ((q, k, v) if maps is not None else (q, k, v, fq, fk))}
    if len(dtypes) != 1:
        return f"mixed dtypes {sorted(str(d) for d in dtypes)}"
    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (the fused kernels take bf16 and fp32)"
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    F = fq.shape[-1] if maps is None else 2 * maps.wq.shape[-1]
    if Tq != Tk:
        return "fewer queries than keys (KV-cache decoding)"
    if v.shape[-1] != D or (maps is None and (fk.shape[1] != Hkv or fk.shape[2] != Tk or
                                              fk.shape[-1] != F)):
        return "shapes of fq/fk/v do not match q/k"
    if H % Hkv:
        return f"{H} query heads are not a multiple of {Hkv} kv heads"
    if not (pow2(D) and 16 <= D <= 128):
        return f"head dim {D} (the fused kernels take powers of two in [16, 128])"
    if not (pow2(F) and 16 <= F <= 256):
        return f"feature dim {F} (the fused kernels take powers of two in [16, 256])"
    if B * H > GRID_AXIS_MAX:
        return (f"batch x heads = {B * H} (the kernels' second grid axis holds at most "
                f"{GRID_AXIS_MAX})")
    if Tq == 0:
        return "empty sequence"
    return None


def _per_head(x, B: int, H: int, what: str):
    """A float, or a tensor broadcastable to (B, H, T, D) that is constant over T and D, as a
    (B, H) fp32 tensor (differentiable); ``None`` when it varies over T or D."""
    if not torch.is_tensor(x):
        return None, float(x)
    t = x
    while t.dim() < 4:
        t = t[None]
    if t.dim() != 4 or t.shape[2] != 1 or t.shape[3] != 1:
        return None, None
    return t.float().expand(B, H, 1, 1).reshape(B, H), None


def fused_hybrid(q, k, v, fq, fk, *, window: int, mode: str, g, shared_norm: bool, overlap: bool,
                 rescale: bool, la_span: str, swa_drop, key_padding_mask, scale: float,
                 eps: float, config: KernelConfig | None = None,
                 maps=None) -> torch.Tensor | None:
    """``ops.hybrid.hybrid_attention`` for the modes the kernels cover (same arguments, checked
    by the caller), or ``None`` (reason logged once) for the caller's piece-by-piece path.
    ``maps`` ((phi_q, phi_k) modules) with fq and fk ``None``: the maps folded into the
    kernel's Function (``fold_maps``); ``None`` also where they cannot be (logged once): the
    caller then runs the maps itself and calls again with fq and fk. A call that runs no LA
    (``swa_only`` without SSD) takes neither features nor maps (``_no_features``); a g per
    position or channel (an output gate) takes a kernel call per branch (``_gated``)."""

    def no(reason: str):
        warn_once(__name__, f"fused Triton hybrid not used: {reason}; running the "
                  "piece-by-piece path")
        return None

    if mode not in ("hybrid", "swa_only", "la_only"):
        return None  # sinks / softmax / none need no LA: the pieces are the right tool
    folded = None
    if mode == "swa_only" and swa_drop is None:  # (no LA: neither the features nor the maps)
        fq, fk = _no_features(q, k)
        maps = None
    if fq is None and fk is None and maps is not None:
        if not available() or not (q.is_cuda or interpret()):
            return None  # (the second call, with the maps' outputs, says why)
        folded, why = fold_maps(maps, q, k)
        if folded is None:
            warn_once(__name__, f"feature maps not folded into the fused hybrid's autograd "
                      f"Function: {why}; they run as their own modules (same values)")
            return None
    reason = unsupported_reason(q, k, v, fq, fk, key_padding_mask, maps=folded)
    if reason is not None:
        return no(reason)
    B, H, T, D = q.shape
    dev = q.device
    shift0 = 0 if overlap else window
    shift_la_only = 0 if la_span == "all" else shift0
    drop = None
    if swa_drop is not None:
        sd = swa_drop
        while sd.dim() < 4:
            sd = sd[None]
        if sd.shape[2] != 1 or sd.shape[3] != 1:
            return no(f"swa_drop of shape {tuple(swa_drop.shape)} (needs one value per (b, h))")
        drop = sd.bool().expand(B, H, 1, 1).reshape(B, H)
        if mode == "la_only":
            drop = None  # la_only ignores it (as the reference does)
    f32 = torch.float32
    zeros = _filled((B, H), 0.0, f32, dev)
    if shared_norm:
        if mode != "hybrid" or drop is not None:
            return no(f"shared_norm in mode {mode!r}" + (" with swa_drop" if drop is not None
                                                           else ""))
        s_t, s_f = _per_head(g, B, H, "shared-norm factor")
        if s_t is None and s_f is None:
            return no("a shared-norm factor that varies over positions or channels")
        s = s_t if s_t is not None else _filled((B, H), s_f, f32, dev)
        logs = torch.log(s.clamp_min(1e-30))
        shift = _filled((B, H), shift0, torch.int32, dev)
        out = _launch(q, k, v, fq, fk, zeros, zeros, logs, shift, window, scale, eps,
                      key_padding_mask, True, True, True, config, folded)
        return out
    g_t, g_f = _per_head(g, B, H, "g")
    if g_t is None and g_f is None:  # an output gate: each branch its own call, mixed here
        try:
            fits = torch.broadcast_shapes(g.shape, q.shape) == q.shape
        except RuntimeError:
            fits = False
        if not fits:
            return no(f"a mixer g of shape {tuple(g.shape)} (not broadcastable to q's "
                      f"{tuple(q.shape)})")
        return _gated(q, k, v, fq, fk, g, mode=mode, rescale=rescale, drop=drop,
                      shift0=shift0, shift_la_only=shift_la_only, window=window, scale=scale,
                      eps=eps, kpm=key_padding_mask, config=config, maps=folded)
    gg = g_t if g_t is not None else _filled((B, H), g_f, f32, dev)
    one = _filled((B, H), 1.0, f32, dev)
    if mode == "hybrid":
        cb = 1 - gg if g_t is not None else _filled((B, H), 1.0 - g_f, f32, dev)
        ca, shift = gg, _filled((B, H), shift0, torch.int32, dev)
        has_swa = has_la = True
    elif mode == "swa_only":
        ca, cb = (one if rescale else gg), zeros
        shift = _filled((B, H), shift0, torch.int32, dev)
        has_swa, has_la = True, False
    else:  # la_only
        ca, cb = zeros, (one if rescale else 1 - gg)
        shift = _filled((B, H), shift_la_only, torch.int32, dev)
        has_swa, has_la = False, True
    if drop is not None:  # SSD: a dropped (b, h) is la_only with the same switches
        w_la_only = one if rescale else 1 - gg
        ca = torch.where(drop, zeros, ca)
        cb = torch.where(drop, w_la_only, cb)
        shift = torch.where(drop, torch.full_like(shift, shift_la_only), shift)
        has_swa = has_la = True
    return _launch(q, k, v, fq, fk, ca, cb, zeros, shift, window, scale, eps, key_padding_mask,
                   has_swa, has_la, False, config, folded)


