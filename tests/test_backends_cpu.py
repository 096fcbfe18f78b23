"""The GPU backends' own PyTorch around the kernels, tested on CPU.

fla's kernels need CUDA, but what we wrap around them (the shift trick, GQA, padding, our fp32
denominator) is plain PyTorch: here fla's ``chunk_linear_attn`` is replaced by a direct causal
sum, and ``fla_linear`` must then equal the reference exactly (values and gradients).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid import reference as ref


def causal_linear_attn(q, k, v, scale=1.0, normalize=False):
    """fla's layout (B, T, H, X); unnormalised causal sum_i<=t (q_t . k_i) v_i."""
    assert not normalize
    s = torch.einsum("bthf,bihf->bhti", q, k) * scale
    s = s * torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.einsum("bhti,bihd->bthd", s, v), None


@pytest.fixture
def fake_fla(monkeypatch):
    mod = types.ModuleType("fla.ops.linear_attn")
    mod.chunk_linear_attn = causal_linear_attn
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", mod)


def inputs(B, H, Hkv, T, Fd, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    fq = torch.rand(B, H, T, Fd, generator=g, dtype=torch.float64).requires_grad_()
    fk = torch.rand(B, Hkv, T, Fd, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(B, Hkv, T, D, generator=g, dtype=torch.float64).requires_grad_()
    return fq, fk, v


SHAPES = [(2, 4, 2, 37, 6, 5), (1, 2, 2, 130, 4, 3), (1, 6, 3, 5, 4, 2)]  # B, H, Hkv, T, F, D


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("chunk", [4, 64])
def test_la_denominator_matches_cumsum(shape, chunk):
    B, H, Hkv, T, Fd, D = shape
    fq, fk, _ = inputs(*shape)
    want = (fq * ref.repeat_kv(fk, H).cumsum(dim=2)).sum(-1)
    got = backends.la_denominator(fq, fk, chunk=chunk)
    assert got.dtype == torch.float64 and got.shape == (B, H, T)
    assert backends.la_denominator(fq.bfloat16(), fk.bfloat16()).dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    g = torch.randn(B, H, T, dtype=torch.float64)
    gq, gk = torch.autograd.grad((want * g).sum(), (fq, fk))
    hq, hk = torch.autograd.grad((got.double() * g).sum(), (fq, fk))
    torch.testing.assert_close(hq, gq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hk, gk, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("shift", [0, 1, 7, 200])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_fla_linear_wrapper_matches_reference(fake_fla, shape, shift, padded):
    B, H, Hkv, T, Fd, D = shape
    kpm = None
    if padded:
        kpm = torch.ones(B, T, dtype=torch.bool)
        kpm[0, : T // 3] = False  # left padding in the first sequence
    fq, fk, v = inputs(*shape)
    want = ref.linear_attention_chunked(fq, fk, v, shift=shift, eps=1e-6, key_padding_mask=kpm)
    got = backends.fla_linear(fq, fk, v, shift=shift, eps=1e-6, need_den=True,
                              key_padding_mask=kpm)
    torch.testing.assert_close(got[2], want[2])  # which queries see keys
    torch.testing.assert_close(got[0].double(), want[0].double(), rtol=1e-5, atol=1e-6)
    has = want[2][..., None]
    # a fixed upstream gradient: it was drawn from the global RNG, so the test's outcome depended
    # on the tests before it (it failed in 8 of 200 draws at the old atol 1e-6, once in CI)
    do = torch.randn(want[0].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    gw = torch.autograd.grad((want[0].double() * do).sum(), (fq, fk, v), allow_unused=True)
    gg = torch.autograd.grad((got[0].double() * do * has).sum(), (fq, fk, v), allow_unused=True)
    for a, b, x, name in zip(gg, gw, (fq, fk, v), ("dfq", "dfk", "dv")):
        a, b = (torch.zeros_like(x) if t is None else t for t in (a, b))  # shift >= T: no keys
        # the reference accumulates in fp32 (its output is fp32 for these fp64 inputs), the
        # wrapper in fp64: the tolerance is fp32's, atol for the elements near zero
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("T", [1, 100, 128, 129, 1100])
def test_flex_length_buckets(T):
    L = backends.flex_length(T)
    assert L >= T and L % 128 == 0
    assert L - T < max(128, T / 8 + 1)  # at most 12.5% padding past the first 1024
    assert backends.flex_length(L) == L  # a bucket is its own bucket


def test_flex_lengths_per_octave_are_few():
    assert len({backends.flex_length(T) for T in range(1, 1025)}) == 8
    assert len({backends.flex_length(T) for T in range(4097, 8193)}) == 8


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention uncompiled (CPU has no Triton): the padding and slicing around it are
    ours and are what is tested; the compiled kernel is tested on the GPU."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(backends, "_compiled_flex", lambda: flex.flex_attention)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("T", [5, 130, 300])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_flex_swa_padding_to_buckets_matches_reference(eager_flex, T, padded):
    g = torch.Generator().manual_seed(T)
    q = torch.randn(2, 4, T, 16, generator=g)
    k, v = torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g)
    kpm = None
    if padded:
        kpm = torch.ones(2, T, dtype=torch.bool)
        kpm[1, : T // 2 + 1] = False
    got, got_lse = backends.flex_swa(q, k, v, scale=0.25, window=7, need_lse=True,
                                     key_padding_mask=kpm)
    want, want_lse = backends.ref_swa(q, k, v, scale=0.25, window=7, need_lse=True,
                                      key_padding_mask=kpm)
    assert got.shape == want.shape and got_lse.shape == want_lse.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-5)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(got_lse), seen)
    torch.testing.assert_close(got_lse[seen], want_lse[seen], rtol=1e-4, atol=1e-5)


def test_cache_calls_never_reach_flex():
    """Fewer queries than keys (KV-cache decoding) go to the blocked path, whatever the
    backend: no compilation per cache length (flex_swa itself refuses such a call)."""
    ops = backends.Ops(backends.flex_swa, backends.ref_linear, backends.ref_softmax, "flex")
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    got, _ = ops.swa(q, k, v, scale=0.3, window=5, need_lse=False, key_padding_mask=None)
    want, _ = backends.ref_swa(q, k, v, scale=0.3, window=5, need_lse=False, key_padding_mask=None)
    torch.testing.assert_close(got, want)


def test_fused_triton_switch_is_on_unless_set_to_zero(monkeypatch):
    """``auto`` takes the fused Triton kernels wherever Triton is installed (validated on an
    H200, benchmarks/results/kernels_h200/); ``HEDGECATS_TRITON=0`` is the way to run without."""
    from hedgecats.models.ops.hybrid import backends

    monkeypatch.setattr(backends, "available", lambda name: name == "triton")
    monkeypatch.delenv("HEDGECATS_TRITON", raising=False)
    assert backends.triton_enabled()
    monkeypatch.setenv("HEDGECATS_TRITON", "1")
    assert backends.triton_enabled()
    monkeypatch.setenv("HEDGECATS_TRITON", "0")
    assert not backends.triton_enabled()
    monkeypatch.delenv("HEDGECATS_TRITON")
    monkeypatch.setattr(backends, "available", lambda name: False)
    assert not backends.triton_enabled()  # no Triton (CPU CI): never


def test_triton_disabled_sets_the_switch_and_restores_it(monkeypatch):
    """``backends.triton_disabled()``: HEDGECATS_TRITON is 0 inside, as it was after (unset or
    set), also when the block raises."""
    import os

    monkeypatch.delenv("HEDGECATS_TRITON", raising=False)
    with backends.triton_disabled():
        assert os.environ["HEDGECATS_TRITON"] == "0" and not backends.triton_enabled()
    assert "HEDGECATS_TRITON" not in os.environ
    monkeypatch.setenv("HEDGECATS_TRITON", "1")
    with pytest.raises(RuntimeError), backends.triton_disabled():
        raise RuntimeError
    assert os.environ["HEDGECATS_TRITON"] == "1"
