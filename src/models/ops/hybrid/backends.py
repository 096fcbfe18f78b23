"""Backend registry: one readable reference, fast GPU kernels chosen per piece.

Each backend provides some of four pieces; ``select`` returns an object whose pieces come from
the requested backend, falling back piece by piece to the reference where that backend cannot
do a call (a padding mask fla's SWA cannot take, a log-sum-exp flash-attn cannot differentiate).
A fallback changes speed only, never the result, and is logged once per reason.

    swa(q, k, v, scale, window, need_lse, key_padding_mask[, window_shape])  -> (out, lse | None)
    linear(fq, fk, v, shift, eps, need_den, key_padding_mask[, window_shape])
                                                              -> (out, den | None, has_keys)
    sinks(q, k, v, scale, n_sinks, key_padding_mask)         -> (out, lse)
    softmax(q, k, v, scale, key_padding_mask)                -> out

Shapes as in ``ops.reference``; outputs may be fp32 (reference) or the input dtype (kernels).
``window_shape`` (``ops.windows``, default ``sliding``): the terraced windows of LoLCATs'
conversions have no kernel here; ``Ops`` sends their SWA, and their LA outside the window, to the
PyTorch reference on every backend (logged once), so no kernel ever sees a window it would
compute as a sliding one.

``auto`` on CUDA: SWA from flash-attn when installed, else fla's windowed ``parallel_attn``
(both without padding or lse: such calls go to flex_attention), else flex_attention; LA from fla's ``chunk_linear_attn`` with the shift trick;
full softmax from torch SDPA. On CPU everything is the reference (fla and flash-attn are
GPU-only).

One more, whole-layer piece: ``Ops.fused`` runs SWA, LA and the mixer of ``hybrid``,
``swa_only`` and ``la_only`` calls in one Triton kernel per direction (``ops.triton_hybrid``),
and returns ``None`` for the calls it does not cover (reason logged once), which then take the
pieces above. ``triton`` is ``auto`` with it. ``auto`` uses it wherever Triton is installed on
CUDA; ``HEDGECATS_TRITON=0`` turns it off (and with it the fused weights_xent of stage 1). It is
checked against the reference under Triton's interpreter (CPU) and on an H200
(tests/test_triton_kernels.py through scripts/gpu_check.sh: the first run found a backward
defect for query tiles taller than key tiles, fixed; after it every hybrid case passed, bf16 and
fp32; benchmarks/results/kernels_h200/).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os

import torch
import torch.nn.functional as F

from .. import triton_common
from . import reference as ref
from . import windows

log = logging.getLogger(__name__)

BACKENDS = ("auto", "reference", "fla", "flash_attn", "flex", "triton")


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


@functools.cache
def available(name: str) -> bool:
    """Whether a GPU backend can run here (CUDA present and its package importable)."""
    if name == "reference":
        return True
    if not torch.cuda.is_available():
        return False
    if name == "fla":
        return importlib.util.find_spec("fla") is not None
    if name == "flash_attn":
        return importlib.util.find_spec("flash_attn") is not None
    if name == "flex":
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    if name == "triton":
        return triton_common.available()
    raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")


# ----------------------------------------------------------------------------- reference pieces
def ref_swa(q, k, v, *, scale, window, need_lse, key_padding_mask, window_shape="sliding"):
    if window_shape in windows.TERRACED:
        return windows.softmax_attention_terraced(q, k, v, scale=scale, window=window,
                                                  window_shape=window_shape,
                                                  key_padding_mask=key_padding_mask)
    return ref.softmax_attention_blocked(q, k, v, scale=scale, window=window,
                                         key_padding_mask=key_padding_mask)


def ref_linear(fq, fk, v, *, shift, eps, need_den, key_padding_mask, window_shape="sliding"):
    """``shift``: the window the keys lie outside of (0: every causal key, whatever the shape)."""
    if window_shape in windows.TERRACED and shift > 0:
        return windows.linear_attention_terraced(fq, fk, v, window=shift,
                                                 window_shape=window_shape, eps=eps,
                                                 key_padding_mask=key_padding_mask)
    return ref.linear_attention_chunked(fq, fk, v, shift=shift, eps=eps,
                                        key_padding_mask=key_padding_mask)


def ref_sinks(q, k, v, *, scale, n_sinks, key_padding_mask):
    """The sinks are the first ``n_sinks`` real keys of each sequence: behind left padding
    they start later (the pad keys are not sinks)."""
    if key_padding_mask is None:
        return ref.softmax_attention_blocked(q, k, v, scale=scale, n_sinks=n_sinks)
    real = key_padding_mask.bool()
    sinks = real & (real.long().cumsum(-1) <= n_sinks)  # (B, Tk)
    cols = sinks.any(0).nonzero()
    bound = int(cols.max()) + 1 if len(cols) else 0  # keys past every row's last sink
    return ref.softmax_attention_blocked(q, k, v, scale=scale, n_sinks=bound,
                                         key_padding_mask=sinks)


def ref_softmax(q, k, v, *, scale, key_padding_mask):
    return ref.softmax_attention_blocked(q, k, v, scale=scale,
                                         key_padding_mask=key_padding_mask)[0]


# ----------------------------------------------------------------------------- GPU pieces
def sdpa_softmax(q, k, v, *, scale, key_padding_mask):
    """Full causal softmax through torch SDPA (flash / efficient kernels on GPU)."""
    H, Tq, Tk = q.shape[1], q.shape[2], k.shape[2]
    k, v = ref.repeat_kv(k, H), ref.repeat_kv(v, H)
    if key_padding_mask is None and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    tpos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    mask = torch.arange(Tk, device=q.device)[None, :] <= tpos  # (Tq, Tk)
    mask = mask[None, None]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask[:, None, None, :].bool()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))


def fla_swa(q, k, v, *, scale, window, need_lse, key_padding_mask):
    from fla.ops.attn.parallel import parallel_attn

    o = parallel_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                      window_size=window)  # (B, T, H, D)
    return o.transpose(1, 2), None


def flash_swa(q, k, v, *, scale, window, need_lse, key_padding_mask):
    from flash_attn import flash_attn_func

    o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        softmax_scale=scale, causal=True, window_size=(window - 1, 0))
    return o.transpose(1, 2), None


@functools.cache
def _compiled_flex():
    """flex_attention compiled once, static shapes: lengths come bucketed (``flex_length``), so
    the number of graphs stays small. (Dynamo's automatic dynamic lengths were tried: with GQA
    the dynamic-length kernel failed to lower on the H200, "NoValidChoicesError".)"""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_length(T: int) -> int:
    """The length a flex_attention call is padded to: a multiple of 128 up to 1024, then of an
    eighth of T's power of two (at most 12.5% padding; 8 lengths per octave). Without buckets
    every new length was a new compilation, and after dynamo's recompile limit flex_attention
    fell back to its eager T x T implementation (seen in the GPU tests; lm-eval sends every
    request length)."""
    p = 1 << (max(T, 1).bit_length() - 1)
    step = max(128, p // 8)
    return -(-T // step) * step


# Each (dtype, GQA, lse, head dim, length bucket) combination is its own dynamo graph. With
# dynamo's default limit of 8 graphs per function, a GPU test worker that had compiled 8
# combinations got flex_attention's eager T x T version for the 9th, silently; a process that
# trains and evaluates in several such combinations could too. The limit is raised for these
# calls only.
FLEX_RECOMPILE_LIMIT = 64


def _flex_call(q, k, v, *, scale, block_mask, need_lse):
    """flex_attention (compiled once) on q (B, H, T, D); GQA through enable_gqa."""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT):
        res = _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale,
                               enable_gqa=k.shape[1] != q.shape[1], return_lse=need_lse)
    return res if need_lse else (res, None)


@functools.lru_cache(maxsize=64)
def _window_block_mask(T: int, window: int, device: str):
    """Block mask of the causal sliding window over T queries and keys, built once per length:
    the same mask_mod object every call, so the compiled flex kernel is not recompiled."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(b, h, t, i):
        return (i <= t) & (i > t - window)

    return create_block_mask(keep, None, None, T, T, device=device)


def flex_swa(q, k, v, *, scale, window, need_lse, key_padding_mask):
    """Sliding-window softmax through compiled flex_attention, q and k of equal length (cache
    calls go elsewhere, see ``Ops.swa``), padded at the end to ``flex_length``: padded keys
    come after every real query, so causality hides them; padded queries are cut off."""
    T = q.shape[2]
    if k.shape[2] != T:
        raise NotImplementedError("flex_swa needs equal query and key lengths")
    L = flex_length(T)
    if L != T:
        q, k, v = (F.pad(x, (0, 0, 0, L - T)) for x in (q, k, v))
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, L - T), value=False)
    if key_padding_mask is None:
        block_mask = _window_block_mask(L, window, str(q.device))
        out, lse = _flex_call(q, k, v, scale=scale, block_mask=block_mask, need_lse=need_lse)
    else:
        from torch.nn.attention.flex_attention import create_block_mask

        kpm = key_padding_mask.bool()

        def keep(b, h, t, i):
            return (i <= t) & (i > t - window) & kpm[b, i]

        block_mask = create_block_mask(keep, q.shape[0], None, L, L, device=q.device)
        out, lse = _flex_call(q, k, v, scale=scale, block_mask=block_mask, need_lse=True)
        # queries with no visible key: 0, as in the reference
        out = torch.where(torch.isfinite(lse)[..., None], out, torch.zeros_like(out))
    out = out[:, :, :T]
    return out, (lse[:, :, :T] if need_lse else None)


def fla_linear(fq, fk, v, *, shift, eps, need_den, key_padding_mask):
    """Causal normalised LA from fla's chunk kernel; keys outside the window by shifting
    ``phi(k)`` and ``v`` right by ``shift`` with zeros in front (then causal LA over the shifted
    sequence sees exactly the keys ``i <= t - shift``)."""
    from fla.ops.linear_attn import chunk_linear_attn

    B, H, Tq, _ = fq.shape
    Tk = fk.shape[2]
    if Tq != Tk:
        raise NotImplementedError("fla_linear needs Tq == Tk")
    if key_padding_mask is not None:
        keep = key_padding_mask[:, None, :, None].to(fk.dtype)
        fk, v_real = fk * keep, v * keep.to(v.dtype)
    else:
        v_real = v
    fk_s, v_s = _shift_right(fk, shift), _shift_right(v, shift)  # on the KV heads, before repeat
    # numerator from the chunk kernel (fp32 accumulation inside); the denominator in fp32 by us:
    # fla's own normalize=True sums the keys in the input dtype, which in bf16 was off by 16%
    # (T=1024) and 74% (T=32768) relative L2 on an H200 (benchmarks/profile_hybrid.py)
    num, _ = chunk_linear_attn(fq.transpose(1, 2), ref.repeat_kv(fk_s, H).transpose(1, 2),
                               ref.repeat_kv(v_s, H).transpose(1, 2), scale=1.0, normalize=False)
    num = num.transpose(1, 2).float()  # (B, H, T, D)
    den = la_denominator(fq, fk_s)
    n_keys = _visible_keys(key_padding_mask, B, Tk, shift, fq.device)  # (B, T)
    # the kernel floor (ops.reference.LA_EPS): + eps per visible key, in numerator and denominator
    vsum = prefix_sum(_shift_right(v_real, shift))  # (B, Hkv, T, D) fp32, per KV head
    num = num + eps * ref.repeat_kv(vsum, H)
    den = den + eps * n_keys[:, None, :].to(den.dtype)
    has = (n_keys > 0)[:, None].expand(B, H, Tk)
    out = torch.where(has[..., None], num / den.clamp_min(eps)[..., None], torch.zeros_like(num))
    return out, (den if need_den else None), has


def la_denominator(fq: torch.Tensor, fk: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """``den[b, h, t] = fq[b, h, t] . sum_{i <= t} fk[b, h_kv, i]`` in fp32 (or wider), for fq (B, H, T, F)
    and fk (B, Hkv, T, F) with H a multiple of Hkv (GQA: the key sums are taken once per KV head).

    The running key sum is two short scans (within chunks of ``chunk`` positions, then over the
    chunk totals): torch's cumsum along T of a (B, H, T, F) tensor runs T sequential steps, which
    took 12.6 ms per call at T=32768 on an H200; the dot with fq is a broadcast multiply-sum (an
    einsum became thousands of 1 x F x 1 matrix products, 6.4 ms at B=8, T=1024)."""
    B, H, T, Fd = fq.shape
    Hkv = fk.shape[1]
    cum = prefix_sum(fk, chunk)  # (B, Hkv, T, F)
    prod = fq.view(B, Hkv, H // Hkv, T, Fd) * cum[:, :, None]  # fp32 by type promotion
    return prod.sum(-1).view(B, H, T)


def prefix_sum(x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """``out[b, h, t] = sum_{i <= t} x[b, h, i]`` along dim 2 of (B, H, T, X), in fp32 at least,
    as two short scans (within chunks of ``chunk`` positions, then over the chunk totals)."""
    B, Hx, T, X = x.shape
    n = -(-T // chunk)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32 at least (bf16 sums drift)
    y = F.pad(x.to(acc), (0, 0, 0, n * chunk - T)).view(B, Hx, n, chunk, X)
    within = y.cumsum(dim=3)
    totals = within[:, :, :, -1]  # (B, Hx, n, X)
    before = totals.cumsum(dim=2) - totals  # sum of all earlier chunks
    return (within + before[:, :, :, None]).view(B, Hx, n * chunk, X)[:, :, :T]


def _shift_right(x: torch.Tensor, shift: int) -> torch.Tensor:
    """(B, H, T, X) -> same, x[t - shift] at t, zeros for t < shift."""
    if shift == 0:
        return x
    T = x.shape[2]
    pad = x.new_zeros(*x.shape[:2], min(shift, T), x.shape[-1])
    return torch.cat([pad, x[:, :, : max(T - shift, 0)]], dim=2)


def _visible_keys(key_padding_mask, B, T, shift, device) -> torch.Tensor:
    """(B, T) long: how many real keys ``i <= t - shift`` query t sees."""
    if key_padding_mask is None:
        n = (torch.arange(T, device=device) - shift + 1).clamp_min(0)
        return n[None].expand(B, T)
    seen = key_padding_mask.long().cumsum(-1)  # real keys in [0, t]
    return torch.cat([seen.new_zeros(B, min(shift, T)), seen[:, : max(T - shift, 0)]], dim=1)


# ----------------------------------------------------------------------------- selection
class Ops:
    """The four pieces of one backend choice, with per-call fallback to the reference, and
    optionally the fused whole-layer kernel (``fused``)."""

    def __init__(self, swa_impl, linear_impl, softmax_impl, name: str, fused_impl=None):
        self._swa, self._linear, self._softmax, self.name = swa_impl, linear_impl, softmax_impl, name
        self._fused = fused_impl

    def fused(self, q, k, v, fq, fk, *, window, mode, g, shared_norm, overlap, rescale, la_span,
              swa_drop, key_padding_mask, scale, eps, maps=None):
        """The whole layer's output (``ops.hybrid.hybrid_attention``'s arguments, checked there)
        from one fused kernel, or ``None`` where this backend has none or it does not cover the
        call: the caller then composes the pieces. ``maps`` ((phi_q, phi_k), fq and fk
        ``None``): the maps run inside the kernel's call where it can take them, else ``None``
        (the caller then runs them and calls again with their outputs)."""
        if self._fused is None:
            return None
        return self._fused(q, k, v, fq, fk, window=window, mode=mode, g=g,
                           shared_norm=shared_norm, overlap=overlap, rescale=rescale,
                           la_span=la_span, swa_drop=swa_drop, key_padding_mask=key_padding_mask,
                           scale=scale, eps=eps, maps=maps)

    def swa(self, q, k, v, *, scale, window, need_lse, key_padding_mask, window_shape="sliding"):
        """``window_shape`` (``ops.windows``): the terraced shapes have no GPU kernel here and run
        the PyTorch reference on every backend (logged once), never a sliding-window kernel."""
        impl = self._swa
        if window_shape != "sliding":
            if impl is not ref_swa:
                _warn_once(f"no GPU kernel for the {window_shape!r} window: its SWA runs the "
                           f"PyTorch reference (exact, slower)")
            return ref_swa(q, k, v, scale=scale, window=window, need_lse=need_lse,
                           key_padding_mask=key_padding_mask, window_shape=window_shape)
        if impl is fla_swa and q.dtype == torch.float32:
            # fla 0.6.0 on an H200: fp32 with D=128 needs 256 KiB of shared memory (> 227 KiB)
            _warn_once("fla kernels run out of shared memory in fp32 at these sizes: fp32 SWA "
                       "goes to flex_attention / the reference (bf16 keeps fla)")
            impl = flex_swa if available("flex") else ref_swa
        if impl is not ref_swa and q.shape[2] != k.shape[2]:
            # KV-cache decoding: a few queries against the cache; the blocked PyTorch path
            # reads only the window's keys and compiles nothing per cache length
            _warn_once("SWA with a KV cache (fewer queries than keys) runs the blocked PyTorch "
                       "path")
            impl = ref_swa
        if impl in (fla_swa, flash_swa) and (need_lse or key_padding_mask is not None):
            _warn_once(f"{impl.__name__} takes no padding mask / log-sum-exp: using "
                       f"{'flex' if available('flex') else 'reference'} SWA for such calls")
            impl = flex_swa if available("flex") else ref_swa
        return impl(q, k, v, scale=scale, window=window, need_lse=need_lse,
                    key_padding_mask=key_padding_mask)

    def linear(self, fq, fk, v, *, shift, eps, need_den, key_padding_mask,
               window_shape="sliding"):
        """``window_shape``: keys outside a terraced window (``shift`` > 0) run the PyTorch
        reference on every backend (logged once); ``shift`` 0 is every causal key, any shape."""
        impl = self._linear
        if window_shape != "sliding" and shift > 0:
            if impl is not ref_linear:
                _warn_once(f"no GPU kernel for linear attention outside a {window_shape!r} "
                           f"window: it runs the PyTorch reference (exact, slower)")
            return ref_linear(fq, fk, v, shift=shift, eps=eps, need_den=need_den,
                              key_padding_mask=key_padding_mask, window_shape=window_shape)
        if impl is fla_linear and fq.dtype == torch.float32:
            _warn_once("fla kernels run out of shared memory in fp32 at these sizes: fp32 LA "
                       "runs the reference (bf16 keeps fla)")
            impl = ref_linear
        if impl is fla_linear and fq.shape[2] != fk.shape[2]:
            _warn_once("fla LA needs equal query and key lengths (no cache): using the reference")
            impl = ref_linear
        return impl(fq, fk, v, shift=shift, eps=eps, need_den=need_den,
                    key_padding_mask=key_padding_mask)

    def sinks(self, q, k, v, *, scale, n_sinks, key_padding_mask):
        return ref_sinks(q, k, v, scale=scale, n_sinks=n_sinks, key_padding_mask=key_padding_mask)

    def softmax(self, q, k, v, *, scale, key_padding_mask):
        return self._softmax(q, k, v, scale=scale, key_padding_mask=key_padding_mask)


REFERENCE = Ops(ref_swa, ref_linear, ref_softmax, "reference")


def select(backend: str, q: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> Ops:
    """The pieces for ``backend`` on q's device (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    if backend == "reference":
        return REFERENCE
    if not q.is_cuda:
        if backend != "auto":
            raise ValueError(f"backend {backend!r} needs a CUDA tensor; use 'reference' on CPU")
        return REFERENCE
    if backend != "auto" and not available(backend):
        raise ValueError(f"backend {backend!r} is not available here (install the [gpu] extra)")
    return _cuda_ops(backend, triton_enabled())


#: ``HEDGECATS_TRITON`` is not ``0`` (the switch to measure or run without the kernels)
triton_switched_on = triton_common.switched_on


def triton_enabled() -> bool:
    """Whether ``auto`` uses the fused Triton kernels: Triton present (with CUDA) and
    ``triton_switched_on()``."""
    return triton_switched_on() and available("triton")


@contextlib.contextmanager
def triton_disabled():
    """Inside, ``HEDGECATS_TRITON=0``: ``auto`` and the feature maps take their PyTorch paths
    (to measure or check against them); the previous value is restored on exit."""
    old = os.environ.get("HEDGECATS_TRITON")
    os.environ["HEDGECATS_TRITON"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HEDGECATS_TRITON", None)
        else:
            os.environ["HEDGECATS_TRITON"] = old


def _fused_triton(q, k, v, fq, fk, **kw):
    from . import dispatch

    return dispatch.fused_hybrid(q, k, v, fq, fk, **kw)


@functools.cache
def _cuda_ops(backend: str, use_triton: bool) -> Ops:
    """The pieces for ``backend``; ``use_triton``: whether ``auto`` takes the fused kernel (part
    of the cache key, so ``HEDGECATS_TRITON`` set later in a process still takes effect)."""
    linear = fla_linear if available("fla") else ref_linear
    if linear is ref_linear:
        _warn_once("fla is not installed: linear attention runs the PyTorch reference (slow); "
                   "pip install 'hedgecats[gpu]'")
    if backend in ("auto", "triton"):
        # fla's windowed kernel measured faster than flex_attention on an H200
        # (benchmarks/results/attention_speed.json); flex still serves padding and lse
        swa = (flash_swa if available("flash_attn") else fla_swa if available("fla")
               else flex_swa if available("flex") else ref_swa)
    else:
        swa = {"fla": fla_swa, "flash_attn": flash_swa, "flex": flex_swa}[backend]
    fused = None
    if backend == "triton" or (backend == "auto" and use_triton):
        fused = _fused_triton
    return Ops(swa, linear, sdpa_softmax, backend, fused)
