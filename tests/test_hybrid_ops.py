"""The functional hybrid against an independent naive implementation (explicit T x T masks,
float64), values and gradients, over a table of shapes and every mode and switch."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from hedgecats.models import MODES, HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.hybrid.reference import default_eps


# ----------------------------------------------------------------------------- naive oracle
def naive(q, k, v, fq, fk, *, window, mode, g, shared_norm=False, overlap=False, rescale=False,
          la_span="outside", n_sinks=8, swa_drop=None, kpm=None, eps=1e-6):
    q_BHTD, k, v, fq, fk = (x.double() for x in (q, k, v, fq, fk))
    B, H, T, D = q_BHTD.shape
    rep = H // k.shape[1]
    k_BHTD, v_BHTD = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    fk_BHTF = fk.repeat_interleave(rep, 1)
    s_BHTT = q_BHTD @ k_BHTD.transpose(-1, -2) / D ** 0.5
    t = torch.arange(T)[:, None]
    i = torch.arange(T)[None, :]
    valid = torch.ones(B, 1, 1, T, dtype=torch.bool) if kpm is None else kpm[:, None, None, :]
    causal = (i <= t) & valid
    win = causal & (i > t - window)
    far_out = (i <= t - window) & valid
    far = causal if overlap else far_out

    def softmax_on(mask):
        e = torch.exp(s_BHTT) * mask
        z = e.sum(-1, keepdim=True)
        return torch.where(z > 0, (e @ v_BHTD) / z.clamp_min(1e-300), 0.0), z

    def la_on(mask):
        a = (fq @ fk_BHTF.transpose(-1, -2) + eps) * mask  # the kernel floor (LA_EPS)
        z = a.sum(-1, keepdim=True)
        has = mask.any(-1, keepdim=True)
        return torch.where(has, (a @ v_BHTD) / z.clamp_min(eps), 0.0), z, has

    if mode == "none":
        return torch.zeros_like(q_BHTD)
    if mode == "softmax":
        return softmax_on(causal)[0]
    if mode == "sinks_only":
        sink_keys = valid & (valid.cumsum(-1) <= n_sinks)  # the first n_sinks real keys
        return softmax_on(causal & sink_keys)[0]
    swa, z_near = softmax_on(win)
    la, z_far, has = la_on(far)
    if shared_norm == "la_mass":  # LA's kernel mass in the window against outside it
        z_near = la_on(win)[1]
    if shared_norm:
        sig = torch.as_tensor(g, dtype=torch.float64)
        alpha = sig * z_near / (sig * z_near + z_far).clamp_min(1e-300)  # 0/0 out of the graph
        alpha = torch.where(has, alpha, 1.0)
        alpha = torch.where(z_near > 0, alpha, 0.0)
        w_swa, w_la = alpha, 1 - alpha
    else:
        w_swa = torch.as_tensor(g, dtype=torch.float64) if torch.is_tensor(g) else g
        w_la = 1 - w_swa

    la_all = la_on(causal)[0] if la_span == "all" else la
    la_only = la_all if rescale else w_la * la_all
    out = {"hybrid": w_swa * swa + w_la * la,
           "swa_only": swa if rescale else w_swa * swa,
           "la_only": la_only}[mode]
    if swa_drop is not None:
        out = torch.where(swa_drop, la_only, out)
    return out


# ----------------------------------------------------------------------------- inputs
SHAPES = [  # B, H, Hkv, T, D, window
    (1, 2, 2, 16, 8, 4),
    (2, 4, 2, 37, 8, 8),      # GQA, T not a multiple of any block
    (2, 4, 1, 5, 8, 8),       # T < window
    (1, 2, 2, 150, 16, 64),   # more than one 128-query block, window 64
    (3, 2, 2, 70, 4, 1),      # window 1 (only the diagonal)
]


def shape_id(s):
    return "B{}-H{}-Hkv{}-T{}-D{}-w{}".format(*s)


def make_inputs(B, H, Hkv, T, D, activation="softmax", projection="square", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen)
    k = torch.randn(B, Hkv, T, D, generator=gen)
    v = torch.randn(B, Hkv, T, D, generator=gen)
    phi_q = HedgehogFeatureMap(H, D, activation, projection, seed=seed + 1)
    phi_k = HedgehogFeatureMap(Hkv, D, activation, projection, seed=seed + 2)
    return q, k, v, phi_q, phi_k


def run_both(shape, *, mode, g=0.5, activation="softmax", kpm=None, swa_drop=None, **sw):
    """Reference and naive outputs plus gradients w.r.t. q, k, v and the feature maps."""
    B, H, Hkv, T, D, window = shape
    results = []
    for impl in ("reference", "naive"):
        q, k, v, phi_q, phi_k = make_inputs(B, H, Hkv, T, D, activation)
        for x in (q, k, v):
            x.requires_grad_(True)
        fq, fk = phi_q(q), phi_k(k)
        gg = g() if callable(g) else g
        if impl == "reference":
            out = hybrid_attention(q, k, v, fq, fk, window=window, mode=mode, g=gg,
                                   eps=default_eps(activation),
                                   key_padding_mask=kpm, swa_drop=swa_drop, backend="reference",
                                   **sw)
        else:
            out = naive(q, k, v, fq, fk, window=window, mode=mode, g=gg, kpm=kpm,
                        eps=default_eps(activation),
                        swa_drop=swa_drop, **sw)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.dtype)
        if out.requires_grad:  # mode "none" is a constant 0
            (out * weights).sum().backward()
        params = [q, k, v, phi_q.weight, phi_q.bias, phi_k.weight, phi_k.bias]
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        results.append((out.detach(), grads))
    return results


def assert_close(a, b, what, rtol=1e-4, atol=1e-5):
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), f"{what}: NaN"
    err = (a - b).abs().max().item()
    scale = b.abs().max().item() + 1e-12
    assert err <= atol + rtol * scale, f"{what}: max abs err {err:.3g} (scale {scale:.3g})"


def check(shape, **kw):
    (o_ref, g_ref), (o_nv, g_nv) = run_both(shape, **kw)
    assert_close(o_ref, o_nv, "output")
    for name, a, b in zip(("q", "k", "v", "Wq", "bq", "Wk", "bk"), g_ref, g_nv):
        assert_close(a, b, f"grad {name}", rtol=1e-3, atol=1e-5)


# ----------------------------------------------------------------------------- the tables
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_naive(shape, mode):
    check(shape, mode=mode)


SWITCHES = [
    dict(overlap=True),
    dict(rescale=True),
    dict(la_span="all"),
    dict(rescale=True, la_span="all"),
    dict(overlap=True, rescale=True),
]


@pytest.mark.parametrize("shape", SHAPES[:3], ids=shape_id)
@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only"])
@pytest.mark.parametrize("sw", SWITCHES, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_switches_match_naive(shape, mode, sw):
    check(shape, mode=mode, **sw)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=shape_id)
@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only"])
def test_shared_norm_matches_direct_formula(shape, mode):
    """The log-space alpha form equals LoLCATs' one-denominator formula, computed directly."""
    H = shape[1]
    factor = torch.sigmoid(torch.linspace(-2.0, 1.0, H))[None, :, None, None]
    check(shape, mode=mode, g=factor, shared_norm=True)


def test_shared_norm_large_logits_stay_finite():
    """Logits of several hundred overflow exp() in LoLCATs' form; ours stays finite."""
    q, k, v, phi_q, phi_k = make_inputs(1, 2, 2, 40, 8)
    out = hybrid_attention(q * 30, k * 30, v, phi_q(q), phi_k(k), window=4, g=0.1,
                           shared_norm=True, backend="reference")
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only"])
def test_la_mass_matches_naive(shape, mode):
    """alpha_t = Z_win / (Z_win + Z_far), both sums of LA's kernel values, computed directly."""
    check(shape, mode=mode, g=1.0, shared_norm="la_mass")


@pytest.mark.parametrize("sw", [dict(rescale=True), dict(rescale=True, la_span="all")], ids=str)
def test_la_mass_switches_and_padding_match_naive(sw):
    kpm = torch.ones(2, 37, dtype=torch.bool)
    kpm[0, :9] = False  # left padding
    kpm[1, 30:] = False  # right padding
    for mode in ("hybrid", "swa_only", "la_only"):
        check(SHAPES[1], mode=mode, g=1.0, shared_norm="la_mass", kpm=kpm, **sw)


def test_la_mass_is_full_softmax_when_the_kernel_is_exp():
    """Softmax attention is its window part and its far part weighted by their exp masses.
    With features whose products are exactly exp(q.k / sqrt(D)) (one-hot q and k: the score is
    c^2 / sqrt(D) on a match, 0 elsewhere; phi(x) = [1, sqrt(E - 1) onehot(x)], E = the match's
    exp), the la_mass hybrid is full softmax attention; the fixed mix is not."""
    B, H, T, D, w, c = 1, 2, 96, 4, 8, 3.0
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, D, (B, H, T), generator=gen)
    onehot = torch.nn.functional.one_hot(idx, D).double()
    q = k = c * onehot
    v = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    E = torch.exp(torch.tensor(c * c / D ** 0.5, dtype=torch.float64))
    f = torch.cat([torch.ones(B, H, T, 1, dtype=torch.float64), (E - 1).sqrt() * onehot], -1)
    kw = dict(window=w, backend="reference", eps=torch.finfo(torch.float32).tiny)
    full = hybrid_attention(q, k, v, f, f, mode="softmax", **kw)
    mass = hybrid_attention(q, k, v, f, f, g=1.0, shared_norm="la_mass", **kw)
    fixed = hybrid_attention(q, k, v, f, f, g=0.5, **kw)
    assert_close(mass, full, "la_mass vs softmax", rtol=1e-5, atol=1e-6)
    assert (fixed - full).abs().max() > 0.1


@pytest.mark.parametrize("shape", SHAPES[:3], ids=shape_id)
@pytest.mark.parametrize("kind", ["per_head", "per_channel"])
def test_tensor_g_matches_naive(shape, kind):
    B, H, _, T, D, _ = shape
    gen = torch.Generator().manual_seed(3)
    g = (torch.rand(1, H, 1, 1, generator=gen) if kind == "per_head"
         else torch.rand(B, H, T, D, generator=gen))
    for mode in ("hybrid", "swa_only", "la_only"):
        check(shape, mode=mode, g=g)


@pytest.mark.parametrize("activation", ["softmax", "exp", "relu", "elu1p", "none"])
def test_activations_match_naive(activation):
    check((2, 4, 2, 37, 8, 8), mode="hybrid", activation=activation)


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=shape_id)
@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only", "sinks_only", "softmax"])
def test_padding_mask_matches_naive(shape, mode):
    B, T = shape[0], shape[3]
    kpm = torch.ones(B, T, dtype=torch.bool)
    kpm[0, : T // 3] = False  # left padding in sample 0
    kpm[-1, T - 2:] = False   # right padding in the last sample
    check(shape, mode=mode, kpm=kpm)


@pytest.mark.parametrize("sw", [{}, dict(rescale=True), dict(la_span="all")], ids=str)
def test_swa_drop_matches_naive(sw):
    shape = (3, 4, 2, 37, 8, 8)
    drop = torch.tensor([True, False, True])[:, None, None, None]
    check(shape, mode="hybrid", swa_drop=drop, **sw)


def test_no_keys_gives_zero_not_nan():
    """LA is 0 where it has no keys (t < w without overlap), SWA of a padded query is 0."""
    q, k, v, phi_q, phi_k = make_inputs(1, 2, 2, 10, 8)
    la = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=16, mode="la_only",
                          backend="reference")
    assert torch.equal(la, torch.zeros_like(la))
    kpm = torch.zeros(1, 10, dtype=torch.bool)
    out = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=4, key_padding_mask=kpm,
                           backend="reference")
    assert torch.equal(out, torch.zeros_like(out))


def test_decoding_queries_are_the_last_positions():
    """Tq < Tk (a KV cache): the reference equals the last rows of the full computation."""
    q, k, v, phi_q, phi_k = make_inputs(2, 4, 2, 30, 8)
    full = hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=6, backend="reference")
    last = hybrid_attention(q[:, :, -3:], k, v, phi_q(q[:, :, -3:]), phi_k(k), window=6,
                            backend="reference")
    torch.testing.assert_close(last, full[:, :, -3:], rtol=1e-5, atol=1e-6)


def test_errors_name_the_value():
    q, k, v, phi_q, phi_k = make_inputs(1, 2, 2, 8, 8)
    with pytest.raises(ValueError, match="'hybird'.*valid: hybrid"):
        hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=4, mode="hybird")
    with pytest.raises(ValueError, match="window must be >= 1"):
        hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=0)
    with pytest.raises(ValueError, match="la_span"):
        hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=4, la_span="near")
    with pytest.raises(ValueError, match="backend 'fla' needs a CUDA tensor"):
        hybrid_attention(q, k, v, phi_q(q), phi_k(k), window=4, backend="fla")


def test_long_sequence_memory_is_linear():
    """T = 16k on one head: a T x T fp32 tensor alone would be 1 GiB; the reference must stay
    far below (run in a fresh process so its peak RSS is its own)."""
    code = textwrap.dedent("""
        import resource, torch
        from hedgecats.models import hybrid_attention
        T, D = 16384, 16
        q, k, v = (torch.randn(1, 1, T, D) for _ in range(3))
        fq, fk = torch.rand(1, 1, T, 2 * D), torch.rand(1, 1, T, 2 * D)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = hybrid_attention(q, k, v, fq, fk, window=64, backend="reference")
        assert torch.isfinite(out).all()
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    grown_gib = float(res.stdout.strip().splitlines()[-1])
    assert grown_gib < 0.4, f"peak memory grew by {grown_gib:.2f} GiB"


def test_feature_map_definition():
    """phi(x) = [act(xW + b), act(-xW - b)] with identity + noise init from the seed."""
    fm = HedgehogFeatureMap(3, 8, "relu", "rectangular", init_std=0.1, seed=5)
    assert fm.weight.shape == (3, 8, 4) and fm.bias.shape == (3, 4) and fm.feature_dim == 8
    again = HedgehogFeatureMap(3, 8, "relu", "rectangular", init_std=0.1, seed=5)
    assert torch.equal(fm.weight, again.weight)
    noise = fm.weight - torch.eye(8)[:, :4]
    assert 0.05 < noise.std().item() < 0.2
    x = torch.randn(2, 3, 5, 8)
    with torch.no_grad():
        fm.bias.normal_()
    u = torch.einsum("bhtd,hdf->bhtf", x, fm.weight) + fm.bias[None, :, None]
    torch.testing.assert_close(fm(x), torch.cat([u.relu(), (-u).relu()], -1))
    sq = HedgehogFeatureMap(2, 6, "softmax", "square")
    y = sq(torch.randn(1, 2, 4, 6))
    assert y.shape == (1, 2, 4, 12)
    torch.testing.assert_close(y[..., :6].sum(-1), torch.ones(1, 2, 4))


def test_feature_map_hands_its_input_on_unchanged_off_the_kernel():
    """``fm(x, with_input=True)`` is ``(fm(x), x)`` where the fused kernel does not run (CPU,
    GQA keys repeated for a map per query head): x itself, its gradient autograd's sum."""
    fm = HedgehogFeatureMap(2, 8, floor=1e-3)
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    phi, x_on = fm(x, with_input=True)
    assert x_on is x
    torch.testing.assert_close(phi, fm(x))
    gqa = HedgehogFeatureMap(4, 8, input_heads=2)
    phi, x_on = gqa(x, with_input=True)
    assert x_on is x and phi.shape == (1, 4, 5, 16)


def test_feature_map_kernel_form_only_where_the_kernel_is_its_function():
    """``HedgehogFeatureMap.kernel_form`` (what the fused hybrid folds into its Function): the
    parameters themselves and the activation for softmax / exp maps without a floor; None for
    a floor (LoLCATs' imports: the kernel has no clamp) or another activation."""
    fm = HedgehogFeatureMap(2, 8, "exp", seed=1)
    w, b, act = fm.kernel_form()
    assert w is fm.weight and b is fm.bias and act == "exp"
    assert HedgehogFeatureMap(2, 8, floor=1e-12).kernel_form() is None
    assert HedgehogFeatureMap(2, 8, "relu").kernel_form() is None


def test_fold_refuses_maps_the_kernel_would_change():
    """``triton_hybrid.fold_maps`` says why it leaves the maps to their modules: the fused maps
    switched off (``HEDGECATS_TRITON=0``: the modules then take their PyTorch path, so folding
    would change the values), a map that is not the fused map's function (a floor)."""
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.hybrid import dispatch as kdispatch

    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    plain = (HedgehogFeatureMap(2, 8), HedgehogFeatureMap(2, 8))
    with backends.triton_disabled():
        got, why = kdispatch.fold_maps(plain, q, k)
    assert got is None and "HEDGECATS_TRITON=0" in why
    floored = (HedgehogFeatureMap(2, 8, floor=1e-12), HedgehogFeatureMap(2, 8))
    got, why = kdispatch.fold_maps(floored, q, k)
    assert got is None and why.startswith("phi_q") and "floor=1e-12" in why


@pytest.mark.parametrize("mode", ["hybrid", "la_only", "sinks_only"])
def test_maps_given_as_modules_match_their_features(mode):
    """``hybrid_attention(q, k, v, None, None, maps=(phi_q, phi_k))``, the converted layer's
    call, is ``hybrid_attention(q, k, v, phi_q(q), phi_k(k))`` where no fused kernel folds the
    maps in (here, the CPU): the same output and gradients of q, k, v and both maps. Passing
    features and maps together is an error that says which to pass."""
    g = torch.Generator().manual_seed(3)
    maps = [HedgehogFeatureMap(n, 8, seed=s) for n, s in ((4, 1), (2, 2))]
    q0, k0, v0 = (torch.randn(2, n, 20, 8, generator=g) for n in (4, 2, 2))
    kw = dict(window=5, mode=mode, g=0.3, key_padding_mask=torch.arange(20)[None].expand(2, -1)
              > 2)

    def run(as_modules):
        q, k, v = (x.clone().requires_grad_() for x in (q0, k0, v0))
        for m in maps:
            m.zero_grad()
        if as_modules:
            out = hybrid_attention(q, k, v, None, None, maps=maps, **kw)
        else:
            out = hybrid_attention(q, k, v, maps[0](q), maps[1](k), **kw)
        out.square().sum().backward()
        return [out, q.grad, k.grad, v.grad] + [p.grad for m in maps for p in m.parameters()]

    for a, b in zip(run(True), run(False)):
        assert (a is None and b is None) or torch.equal(a, b)
    q = q0.clone()
    with pytest.raises(ValueError, match="features .* or the maps"):
        hybrid_attention(q, k0, v0, maps[0](q), maps[1](k0), maps=maps, window=5)


def test_du_slot_tells_the_kernels_marker_from_a_summed_gradient():
    """``DuSlot``'s protocol on the CPU (no kernel needed): the map's backward gets
    the kernel's marker itself when the kernel was its output's only consumer (autograd hands
    a single gradient on unchanged: the assumption the protocol rests on), a summed tensor
    when another consumer added its gradient; ``take`` tells the two apart and empties the
    slot; du is laid out as the weight gradient's GEMM reads it in place; a y whose own
    gradient someone watches is ``observed``."""
    from hedgecats.models.ops.feature_map.function import DuSlot

    x = torch.randn(2, 5, 3, 4).transpose(1, 2)  # (B, H, T, D) view of (B, T, H, D) memory
    slot = DuSlot(x, 6)
    du = slot.new_du()
    assert du.shape == (2, 3, 5, 6) and du.permute(1, 0, 2, 3).is_contiguous()
    assert DuSlot(x.contiguous(), 6).new_du().is_contiguous()
    seen = []

    class Producer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, dy):
            seen.append(slot.take(dy))
            return dy

    class Kernel(torch.autograd.Function):  # returns the marker as its input's gradient
        @staticmethod
        def forward(ctx, y):
            return y.sum()

        @staticmethod
        def backward(ctx, g):
            return slot.put(du, y_ref)

    a = torch.randn(2, 3, 5, 8, requires_grad=True)
    y_ref = Producer.apply(a)
    Kernel.apply(y_ref).backward()
    got, only = seen.pop()
    assert got is du and only, "the kernel's marker did not reach the map's backward as is"
    assert slot.take(torch.zeros(1)) == (None, False), "take() must empty the slot"
    y_ref = Producer.apply(a)
    (Kernel.apply(y_ref) + (y_ref * 3).sum()).backward()
    got, only = seen.pop()
    assert got is du and not only, "another consumer's gradient would be dropped"
    assert not any(slot.put(du, y_ref).stride()), "the marker takes memory"
    # y's own gradient asked for (retain_grad, a hook): the kernel must return dphi
    for watch in (lambda y: y.retain_grad(), lambda y: y.register_hook(lambda g: g)):
        y = Producer.apply(a)
        slot.watch(y)
        assert not slot.observed()
        watch(y)
        assert slot.observed()


def test_feature_map_attaches_no_slot_off_the_kernel():
    """``kernel_du`` changes nothing where the fused map does not run (CPU): phi(x) carries no
    slot, so no kernel can hand its backward a du."""
    from hedgecats.models.ops.feature_map.function import DU_SLOT_ATTR

    fm = HedgehogFeatureMap(2, 8)
    x = torch.randn(1, 2, 5, 8, requires_grad=True)
    phi, x_on = fm(x, with_input=True, kernel_du=True)
    assert not hasattr(phi, DU_SLOT_ATTR) and x_on is x
    torch.testing.assert_close(phi, fm(x))


@pytest.mark.parametrize("bad,match", [
    (dict(activation="gelu"), "activation 'gelu'.*elu1p, exp, none, relu, softmax"),
    (dict(projection="wide"), "projection 'wide'.*rectangular, square"),
    (dict(head_dim=7, projection="rectangular"), "head_dim=7 cannot be halved"),
])
def test_feature_map_errors(bad, match):
    kw = dict(num_heads=2, head_dim=8) | bad
    with pytest.raises(ValueError, match=match):
        HedgehogFeatureMap(**kw)


def test_all_cases_are_distinct_ids():
    ids = [shape_id(s) for s in SHAPES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("fill", [1e-30, 0.0])
@pytest.mark.parametrize("mode", ["la_only", "hybrid"])
def test_la_gradients_stay_bounded_where_products_are_tiny(mode, fill):
    """Query and key features on disjoint coordinates, so every product is ~1e-30 or exactly 0
    (softmax features underflow; a fifth of the rows after a GPU testbed's stage 1 summed below
    1e-6). With only an underflow guard on the normaliser (fp32's smallest normal) the gradient
    was ~1e23 at 1e-30 and NaN at 0: stage 2 fine-tuning hit NaN at step 1 on a CPU. The kernel
    floor (LA_EPS per visible key) bounds it by ~|v| / eps, and such rows average their values."""
    B, H, T, D, F = 1, 2, 24, 4, 8
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    fq = torch.full((B, H, T, F), fill)
    fk = torch.full((B, H, T, F), fill)
    fq[..., 0], fk[..., 1] = 1.0, 1.0
    for t in (fq, fk, v):
        t.requires_grad_(True)
    out = hybrid_attention(q, k, v, fq, fk, window=4, mode=mode, la_span="all", rescale=True,
                           backend="reference")
    (out * w).sum().backward()
    for name, t in (("fq", fq), ("fk", fk), ("v", v)):
        assert torch.isfinite(t.grad).all() and t.grad.abs().max() < 10 / 1e-6, name
    if mode == "la_only":  # every product << eps: uniform weights over the visible keys
        uniform = torch.cumsum(v.detach(), 2) / torch.arange(1, T + 1)[:, None]
        torch.testing.assert_close(out.detach(), uniform, rtol=1e-4, atol=1e-5)


def test_the_maps_dw_comes_from_the_gemm_in_fp32(monkeypatch):
    """``triton_phi.bmm_fp32`` (the maps' dW): fp32 out, no bf16 rounding of the product, on
    the CPU from fp32 operands; on CUDA the GEMM's own fp32 output (``out_dtype``) where this
    torch has that kernel, else fp32 operands (said once). Asked of the dispatcher, never
    taken from an error of the call itself (an out-of-memory error must reach the caller)."""
    from hedgecats.models.ops.feature_map import kernels as tp
    from test_fast_launch import cuda_like

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 16, 300, generator=gen).bfloat16()
    b = torch.randn(4, 300, 8, generator=gen).bfloat16()
    want = torch.bmm(a.double(), b.double())
    got = tp.bmm_fp32(a, b)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    rounded = torch.bmm(a, b).float()  # (what dW was before: the product rounded to bf16)
    assert (rounded.double() - want).abs().max() > 10 * (got.double() - want).abs().max()

    seen = []

    def bmm(x, y, **kw):
        seen.append(kw)
        if kw:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return torch.matmul(x.as_subclass(torch.Tensor), y.as_subclass(torch.Tensor))

    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(tp, "bmm_out_dtype_on_cuda", lambda: True)
    with pytest.raises(torch.OutOfMemoryError):
        tp.bmm_fp32(cuda_like(a), b)
    assert seen == [{"out_dtype": torch.float32}]
    monkeypatch.setattr(tp, "bmm_out_dtype_on_cuda", lambda: False)
    out = tp.bmm_fp32(cuda_like(a), b)
    assert seen[-1] == {} and out.dtype == torch.float32
