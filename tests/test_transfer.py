"""Attention-transfer objectives against naive full T x T formulas: values and gradients."""

import pytest
import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.reference import repeat_kv
from hedgecats.models.ops.transfer import hybrid_output_mse, la_output_mse, weights_xent

CASES = [(2, 37, 4, 2, 8, False), (1, 64, 2, 2, 16, True), (2, 20, 4, 1, 8, True)]
IDS = [f"B{b}-T{t}-H{h}-Hkv{hk}-D{d}{'-pad' if p else ''}" for b, t, h, hk, d, p in CASES]


def _inputs(B, T, H, Hkv, D, pad, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_BHTD = torch.randn(B, H, T, D, generator=g)
    k_BHTD = torch.randn(B, Hkv, T, D, generator=g)
    v_BHTD = torch.randn(B, Hkv, T, D, generator=g)
    kpm = None
    if pad:
        kpm = torch.ones(B, T, dtype=torch.bool)
        kpm[0, T - 5:] = False  # right padding on the first sample
    phi_q, phi_k = HedgehogFeatureMap(H, D, seed=1), HedgehogFeatureMap(Hkv, D, seed=2)
    return q_BHTD, k_BHTD, v_BHTD, kpm, phi_q, phi_k


def _allowed(T, kpm, B):
    a = torch.ones(T, T).tril().bool()[None, None].expand(B, 1, T, T)
    if kpm is not None:
        a = a & kpm[:, None, None, :]
    return a


def _naive_xent(q, k, fq, fk, kpm):
    B, H, T, D = q.shape
    k, fk = repeat_kv(k, H), repeat_kv(fk, H)
    allowed = _allowed(T, kpm, B)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    a_soft = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    a = (fq @ fk.transpose(-1, -2)).masked_fill(~allowed, 0.0)
    a_phi = a / a.sum(-1, keepdim=True)
    xent = -(a_soft * torch.log(a_phi.clamp_min(1e-6))).sum(-1)  # (B, H, T)
    w = torch.ones(B, T) if kpm is None else kpm.float()
    return (xent * w[:, None]).sum() / (w.sum() * H)


def _naive_soft_out(q, k, v, kpm):
    B, H, T, D = q.shape
    k, v = repeat_kv(k, H), repeat_kv(v, H)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5
    p = torch.softmax(s.masked_fill(~_allowed(T, kpm, B), float("-inf")), -1).nan_to_num(0.0)
    return p @ v


def _masked_mean(err, kpm):
    if kpm is None:
        return err.mean()
    w = kpm[:, None, :, None].float()
    return (err * w).sum() / (w.sum() * err.shape[1] * err.shape[3])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("block", [7, 64])
def test_weights_xent_matches_naive(case, block):
    q, k, _v, kpm, phi_q, phi_k = _inputs(*case)
    got = weights_xent(q, k, phi_q(q), phi_k(k), key_padding_mask=kpm, block=block)
    got.backward()
    g_got = [p.grad.clone() for p in (*phi_q.parameters(), *phi_k.parameters())]
    for p in (*phi_q.parameters(), *phi_k.parameters()):
        p.grad = None
    want = _naive_xent(q, k, phi_q(q), phi_k(k), kpm)
    want.backward()
    g_want = [p.grad for p in (*phi_q.parameters(), *phi_k.parameters())]
    assert torch.isfinite(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_weights_xent_is_at_least_the_teacher_entropy():
    """Cross-entropy >= the teacher's entropy (Gibbs), so the loss cannot go below it."""
    q, k, _, _, phi_q, phi_k = _inputs(1, 24, 2, 2, 8, False, seed=3)
    got = weights_xent(q, k, phi_q(q), phi_k(k), block=5)
    a = torch.softmax((q @ k.transpose(-1, -2) * 8 ** -0.5).masked_fill(
        ~torch.ones(24, 24).tril().bool(), float("-inf")), -1)
    entropy = -(a * torch.log(a.clamp_min(1e-30))).sum(-1).mean()
    assert got >= entropy - 1e-6


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_la_output_mse_matches_naive(case):
    q, k, v, kpm, phi_q, phi_k = _inputs(*case)
    fq, fk = phi_q(q), phi_k(k)
    got = la_output_mse(q, k, v, fq, fk, key_padding_mask=kpm, backend="reference")
    B, H, T, _D = q.shape
    a = (fq @ repeat_kv(fk, H).transpose(-1, -2)).masked_fill(~_allowed(T, kpm, B), 0.0)
    o_la = (a @ repeat_kv(v, H)) / a.sum(-1, keepdim=True).clamp_min(1e-6)
    want = _masked_mean((o_la - _naive_soft_out(q, k, v, kpm)).pow(2), kpm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    got.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in phi_q.parameters())


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_hybrid_output_mse_matches_hybrid_layer(case):
    q, k, v, kpm, phi_q, phi_k = _inputs(*case)
    fq, fk = phi_q(q), phi_k(k)
    got = hybrid_output_mse(q, k, v, fq, fk, window=5, g=0.3, key_padding_mask=kpm,
                            backend="reference")
    hyb = hybrid_attention(q, k, v, fq, fk, window=5, mode="hybrid", g=0.3, key_padding_mask=kpm,
                           backend="reference")
    want = _masked_mean((hyb - _naive_soft_out(q, k, v, kpm)).pow(2), kpm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_only_feature_maps_get_gradients():
    q, k, _v, _kpm, phi_q, phi_k = _inputs(1, 16, 2, 2, 8, False)
    q.requires_grad_(True)
    k.requires_grad_(True)
    weights_xent(q, k, phi_q(q.detach()), phi_k(k.detach()), block=4).backward()
    assert q.grad is None and k.grad is None
    assert phi_q.weight.grad is not None and phi_k.weight.grad is not None
