"""Our layer with LoLCATs' settings against LoLCATs' own formula, and the terraced windows.

The oracle is ``models.lolcats.lolcats_attention``: their ``hybrid_attention_quadratic`` written
out with T x T masks (their ``get_masks``, the one-block case included), softmax scores shifted
by the window's max logit, unscaled LA scores, one denominator. Ours is ``hybrid_attention`` with
``shared_norm="window_max"``, the terraced / sliding window, key maps per query head and the
feature floor. Values and gradients (q, k, v, both maps' weights, the window factors) in fp32;
the padded cases are checked against each sequence run alone.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.lolcats import lolcats_attention, lolcats_feature_map, lolcats_masks
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid import windows

TYPES = {"lolcats_llama_window_tk": "terraced_end", "lolcats_llama_window_sw": "sliding"}
NO_FLOOR = torch.finfo(torch.float32).tiny  # LoLCATs' LA has no kernel floor (lolcats.hybrid_config)
SHAPES = [  # B, H, Hkv, T, D, w
    (2, 4, 2, 5, 16, 8),      # T < w: one block (LoLCATs' tk: LA over every causal key)
    (1, 2, 2, 8, 8, 8),       # T == w
    (2, 4, 2, 37, 16, 8),     # GQA, T not a multiple of w
    (1, 2, 1, 64, 8, 16),     # T a multiple of w
    (1, 2, 2, 140, 8, 16),    # more than one 128-query block
]


def shape_id(s):
    return "B{}-H{}-Hkv{}-T{}-D{}-w{}".format(*s)


def make(B, H, Hkv, T, D, seed=0, scale=2.0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen) * scale
    k = torch.randn(B, Hkv, T, D, generator=gen) * scale
    v = torch.randn(B, Hkv, T, D, generator=gen)
    Lq = torch.randn(H, D, D // 2, generator=gen) * 0.5
    Lk = torch.randn(H, D, D // 2, generator=gen) * 0.5
    wf = torch.randn(1, H, 1, 1, generator=gen)
    bq = torch.randn(1, H, 1, 1, generator=gen) if bias else None
    bk = torch.randn(1, H, 1, 1, generator=gen) if bias else None
    return q, k, v, Lq, Lk, wf, bq, bk


def ours(q, k, v, Lq, Lk, wf, bq, bk, *, w, shape, mode="hybrid", kpm=None, **kw):
    """Our layer with the LoLCATs tensors copied in, as ``models.lolcats.load_into`` does."""
    H, Hkv, D = q.shape[1], k.shape[1], q.shape[-1]
    phi_q = HedgehogFeatureMap(H, D, projection="rectangular", floor=1e-12)
    phi_k = HedgehogFeatureMap(H, D, projection="rectangular", floor=1e-12, input_heads=Hkv)
    with torch.no_grad():
        for phi, L, b in ((phi_q, Lq, bq), (phi_k, Lk, bk)):
            phi.weight.copy_(L)
            phi.bias.copy_(torch.zeros_like(phi.bias) if b is None
                           else b.reshape(-1, 1).expand_as(phi.bias))
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=w, mode=mode,
                           g=torch.sigmoid(wf), shared_norm="window_max", window_shape=shape,
                           key_padding_mask=kpm, backend="reference", eps=NO_FLOOR, **kw)
    return out, (phi_q, phi_k)


def theirs(q, k, v, Lq, Lk, wf, bq, bk, *, w, atype):
    rep = q.shape[1] // k.shape[1]
    fq = lolcats_feature_map(q, Lq, 0.0 if bq is None else bq)
    fk = lolcats_feature_map(k.repeat_interleave(rep, 1), Lk, 0.0 if bk is None else bk)
    return lolcats_attention(q, k, v, fq, fk, wf, window_size=w, attention_type=atype)


def close(a, b, what, rtol=1e-5, atol=1e-6):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), f"{what}: not finite"
    err = (a - b).abs().max().item()
    ref = b.abs().max().item()
    assert err <= atol + rtol * ref, f"{what}: max abs err {err:.3g} (scale {ref:.3g})"


# ----------------------------------------------------------------------------- the formula
@pytest.mark.parametrize("atype", list(TYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_values_and_gradients_match_lolcats(atype, shape):
    B, H, Hkv, T, D, w = shape
    grads = []
    for impl in ("ours", "theirs"):
        t = make(B, H, Hkv, T, D, bias=True)
        for x in t[:6]:
            x.requires_grad_(True)
        if impl == "ours":
            out, maps = ours(*t, w=w, shape=TYPES[atype])
        else:
            out = theirs(*t, w=w, atype=atype)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        (out * weights).sum().backward()
        if impl == "ours":  # our maps hold copies of Lq / Lk: their gradients are the maps'
            t[3].grad, t[4].grad = maps[0].weight.grad, maps[1].weight.grad
        grads.append((out.detach(), [torch.zeros_like(x) if x.grad is None else x.grad
                                     for x in t[:6]]))
    (o1, g1), (o2, g2) = grads
    close(o1, o2, "output")
    for name, a, b in zip(("q", "k", "v", "W_q", "W_k", "window_factors"), g1, g2):
        close(a, b, f"grad {name}", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("atype", list(TYPES))
def test_large_logits(atype):
    """Logits in the hundreds: LoLCATs' terms stay bounded (exp(s - m) <= 1), and so do ours."""
    t = make(1, 2, 2, 40, 8, scale=12.0)
    close(ours(*t, w=8, shape=TYPES[atype])[0], theirs(*t, w=8, atype=atype), "output")


def test_the_shift_changes_the_function():
    """``window_max`` is LoLCATs' formula; ``shared_norm=True`` (docs/method.md) is another one:
    LA weighs exp(m_t) times less there. With the LA terms scaled by exp(-m_t) by hand, theirs
    equals ours with ``shared_norm=True``."""
    q, k, v, Lq, Lk, wf, _, _ = make(1, 2, 2, 30, 8)
    fq, fk = lolcats_feature_map(q, Lq), lolcats_feature_map(k, Lk)
    w = 4
    plain = hybrid_attention(q, k, v, fq, fk, window=w, g=torch.sigmoid(wf), shared_norm=True,
                             backend="reference", eps=NO_FLOOR)
    shifted = hybrid_attention(q, k, v, fq, fk, window=w, g=torch.sigmoid(wf),
                               shared_norm="window_max", backend="reference", eps=NO_FLOOR)
    assert (plain - shifted).abs().max() > 1e-2
    m = windows.window_max_logit(q, k, scale=8 ** -0.5, window=w)  # (B, H, T)
    fq_scaled = fq * torch.exp(-m)[..., None]  # LA scores times exp(-m_t)
    close(theirs_direct(q, k, v, fq_scaled, fk, wf, w), plain, "LoLCATs with LA scaled")


def theirs_direct(q, k, v, fq, fk, wf, w):
    return lolcats_attention(q, k, v, fq, fk, wf, window_size=w,
                             attention_type="lolcats_llama_window_sw")


@pytest.mark.parametrize("atype", list(TYPES))
def test_ablation_modes_are_the_shared_norm_terms(atype):
    """swa_only = alpha SWA and la_only = (1 - alpha) LA: the two terms of LoLCATs' sum."""
    q, k, v, Lq, Lk, wf, _, _ = make(2, 4, 2, 37, 16)
    w = 8
    full = ours(q, k, v, Lq, Lk, wf, None, None, w=w, shape=TYPES[atype])[0]
    swa = ours(q, k, v, Lq, Lk, wf, None, None, w=w, shape=TYPES[atype], mode="swa_only")[0]
    la = ours(q, k, v, Lq, Lk, wf, None, None, w=w, shape=TYPES[atype], mode="la_only")[0]
    close(swa + la, full, "swa_only + la_only")
    # the SWA term by hand: LoLCATs' formula with the LA scores zeroed in the numerator only
    fq = lolcats_feature_map(q, Lq)
    fk = lolcats_feature_map(k.repeat_interleave(2, 1), Lk)
    win, lin = lolcats_masks(w, 37, atype)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kk.transpose(-1, -2) * 16 ** -0.5).masked_fill(~win, float("-inf"))
    a_sm = torch.sigmoid(wf) * torch.exp(s - s.amax(-1, keepdim=True))
    a_ln = (fq @ fk.transpose(-1, -2)).masked_fill(~lin, 0.0)
    den = a_sm.sum(-1, keepdim=True) + a_ln.sum(-1, keepdim=True)
    close(swa, a_sm @ vv / den, "swa_only")
    close(la, a_ln @ vv / den, "la_only")


def test_feature_map_matches_lolcats():
    """Our map with LoLCATs' matrix, the per-head scalar bias filled into every feature, the
    clamp at 1e-12, and key maps per query head over repeated keys."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 9, 16, generator=gen) * 30  # large: features underflow to the clamp
    L, b = torch.randn(4, 16, 8, generator=gen), torch.randn(1, 4, 1, 1, generator=gen)
    phi = HedgehogFeatureMap(4, 16, projection="rectangular", floor=1e-12, input_heads=2)
    with torch.no_grad():
        phi.weight.copy_(L)
        phi.bias.copy_(b.reshape(4, 1).expand(4, 8))
    want = lolcats_feature_map(x.repeat_interleave(2, 1), L, b)
    assert (want == 1e-12).any(), "the test should reach the clamp"
    close(phi(x), want, "features", rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match=r"expected x of shape \(B, 2, T, 16\) or \(B, 4, T, 16\)"):
        phi(torch.randn(1, 3, 4, 16))


# ----------------------------------------------------------------------------- the windows
def naive_terraced(T, w, anchor):
    """Window / outside masks (T, T) of a terraced window from explicit block numbers."""
    blk = [(p - anchor) // w for p in range(T)]
    win = torch.tensor([[i <= t and blk[i] >= blk[t] - 1 for i in range(T)] for t in range(T)])
    out = torch.tensor([[i <= t and blk[i] <= blk[t] - 2 for i in range(T)] for t in range(T)])
    return win, out


@pytest.mark.parametrize("T,w", [(5, 4), (16, 4), (37, 8), (150, 16)])
def test_terraced_masks(T, w):
    """terraced: blocks from position 0; terraced_end: blocks ending at T - 1, as LoLCATs' masks
    (for T > w; their one-block case is tested above)."""
    tpos = ipos = torch.arange(T)
    for shape, anchor in (("terraced", 0), ("terraced_end", T)):
        a = torch.tensor([anchor])
        got = windows.window_keys(tpos, ipos, window=w, window_shape=shape, anchor=a)[0]
        win, _ = naive_terraced(T, w, anchor)
        assert torch.equal(got, win), shape
    if T > w:
        assert torch.equal(lolcats_masks(w, T, "lolcats_llama_window_tk")[0],
                           naive_terraced(T, w, T)[0])


@pytest.mark.parametrize("shape", ["terraced", "terraced_end", "sliding"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_rows_equal_each_sequence_alone(shape, side):
    """Per row, the blocks follow the row's real tokens: a padded batch gives every sequence
    what it gets unpadded (every window shape; the hybrid and its LA term)."""
    B, H, Hkv, T, D, w = 3, 2, 1, 45, 8, 8
    lengths = [45, 30, 7]
    q, k, v, Lq, Lk, wf, _, _ = make(B, H, Hkv, T, D)
    kpm = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        kpm[b, :n] = True
    if side == "left":
        kpm = kpm.flip(1)
    for mode in ("hybrid", "la_only"):
        got = ours(q, k, v, Lq, Lk, wf, None, None, w=w, shape=shape, mode=mode, kpm=kpm)[0]
        for b in range(B):
            idx = kpm[b].nonzero().squeeze(1)
            alone = ours(q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], Lq, Lk,
                         wf, None, None, w=w, shape=shape, mode=mode)[0]
            close(got[b:b + 1, :, idx], alone, f"{mode}, row {b}")


@pytest.mark.parametrize("shape", ["terraced", "terraced_end"])
def test_terraced_la_with_a_kernel_floor(shape):
    """Keys outside a terraced window, with the kernel floor ``eps`` added to every visible real
    key's product (numerator and normaliser alike, as the sliding reference does), against
    explicit T x T masks."""
    T, w, eps = 37, 8, 1e-2
    q, k, v, Lq, Lk, _, _, _ = make(1, 2, 2, T, 8)
    fq, fk = lolcats_feature_map(q, Lq), lolcats_feature_map(k, Lk)
    got = hybrid_attention(q, k, v, fq, fk, window=w, mode="la_only", rescale=True, eps=eps,
                           window_shape=shape, backend="reference")
    _, outside = naive_terraced(T, w, 0 if shape == "terraced" else T)
    a = (fq.double() @ fk.double().transpose(-1, -2) + eps) * outside
    want = torch.where(outside.any(-1)[:, None], (a @ v.double()) / a.sum(-1, keepdim=True)
                       .clamp_min(1e-300), 0.0)
    close(got, want, "la_only")


@pytest.mark.parametrize("shape", ["terraced", "terraced_end", "sliding"])
def test_fewer_queries_than_keys(shape):
    """The last queries over every key (a full KV cache) equal the last rows of the full call."""
    q, k, v, Lq, Lk, wf, _, _ = make(1, 2, 2, 41, 8)
    full = ours(q, k, v, Lq, Lk, wf, None, None, w=8, shape=shape)[0]
    for n in (1, 5):
        tail = ours(q[:, :, -n:], k, v, Lq, Lk, wf, None, None, w=8, shape=shape)[0]
        close(tail, full[:, :, -n:], f"last {n} queries")


def test_terraced_alignments_agree_on_whole_blocks():
    t = make(1, 2, 2, 48, 8)
    a = ours(*t, w=16, shape="terraced")[0]
    b = ours(*t, w=16, shape="terraced_end")[0]
    close(a, b, "T a multiple of w")
    t = make(1, 2, 2, 40, 8)
    a = ours(*t, w=16, shape="terraced")[0]
    b = ours(*t, w=16, shape="terraced_end")[0]
    assert (a - b).abs().max() > 1e-3  # the blocks lie elsewhere


# ----------------------------------------------------------------------------- routing
def _must_not_run(*args, **kwargs):
    raise AssertionError("a sliding-window kernel received a terraced call")


def test_terraced_calls_never_reach_a_sliding_kernel(caplog):
    """A backend whose kernels only know the sliding window (as fla's, flash-attn's and the
    fused Triton kernel) sends terraced calls and LoLCATs' shift to the reference, logged once,
    with the reference's result."""
    gpu_like = backends.Ops(_must_not_run, _must_not_run, backends.ref_softmax, "gpu-like",
                            fused_impl=_must_not_run)
    q, k, v, Lq, Lk, wf, _, _ = make(1, 2, 1, 37, 8)
    fq = lolcats_feature_map(q, Lq)
    fk = lolcats_feature_map(k.repeat_interleave(2, 1), Lk)
    kw = {"window": 8, "g": torch.sigmoid(wf), "shared_norm": "window_max",
          "window_shape": "terraced_end"}
    with caplog.at_level(logging.WARNING):
        got = hybrid_attention(q, k, v, fq, fk, ops=gpu_like, **kw)
    want = hybrid_attention(q, k, v, fq, fk, backend="reference", **kw)
    assert torch.equal(got, want)
    text = caplog.text
    assert "no GPU kernel for the 'terraced_end' window" in text
    assert "fused Triton hybrid not used" in text
    # the sliding window keeps the backend's kernels; the shift alone keeps its pieces too
    with pytest.raises(AssertionError, match="sliding-window kernel"):
        hybrid_attention(q, k, v, fq, fk, ops=gpu_like, window=8, g=0.5)


def test_cache_ops_refuse_terraced():
    class CacheLikeOps:  # the signature a KV cache's pieces have (models.cache._CacheOps)
        def swa(self, q, k, v, *, scale, window, need_lse, key_padding_mask):
            raise AssertionError

    q, k, v, Lq, Lk, _, _, _ = make(1, 2, 2, 10, 8)
    fq, fk = lolcats_feature_map(q, Lq), lolcats_feature_map(k, Lk)
    with pytest.raises(ValueError, match="cannot compute the 'terraced' window"):
        hybrid_attention(q, k, v, fq, fk, window=4, ops=CacheLikeOps(), window_shape="terraced")


def test_bad_arguments_are_named():
    q, k, v, Lq, Lk, _, _, _ = make(1, 2, 2, 10, 8)
    fq, fk = lolcats_feature_map(q, Lq), lolcats_feature_map(k, Lk)
    with pytest.raises(ValueError, match="unknown window shape 'blocky'"):
        hybrid_attention(q, k, v, fq, fk, window=4, window_shape="blocky")
    with pytest.raises(ValueError, match="shared_norm='max'"):
        hybrid_attention(q, k, v, fq, fk, window=4, shared_norm="max")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", ["terraced_end", "sliding"])
def test_gpu_backends_match_reference(dtype, shape):
    """On CUDA, ``auto`` (fla / flex / the fused kernel where they apply, the reference where
    they cannot) against the reference in the same dtype, LoLCATs' settings."""
    q, k, v, Lq, Lk, wf, _, _ = (x.cuda() if x is not None else None
                                 for x in make(2, 4, 2, 300, 64))
    fq = lolcats_feature_map(q, Lq).to(dtype)
    fk = lolcats_feature_map(k.repeat_interleave(2, 1), Lk).to(dtype)
    kw = {"window": 64, "g": torch.sigmoid(wf), "shared_norm": "window_max",
          "window_shape": shape, "eps": NO_FLOOR}
    got = hybrid_attention(q.to(dtype), k.to(dtype), v.to(dtype), fq, fk, backend="auto", **kw)
    want = hybrid_attention(q.to(dtype), k.to(dtype), v.to(dtype), fq, fk, backend="reference",
                            **kw)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    close(got.float(), want.float(), "auto vs reference", rtol=tol, atol=tol)
