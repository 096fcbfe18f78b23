"""One attention layer as the benchmarks time it: inputs, feature maps and mixers at a head shape,
the teacher's attention, the hybrid's paths, a LoLCATs-style T x T hybrid, and the fused
kernel's tile configurations.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys

import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.mixers import LearnedHeadMixer, SharedNormMixer
from benchmarks import switches as kernel_switches
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid import config as kconfig
from hedgecats.models.ops.hybrid import reference as ref

from benchmarks import timing


def rel(a, b) -> float:
    """Relative L2 error of ``a`` against ``b``, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def add_head_args(p: argparse.ArgumentParser) -> None:
    """The layer's head shape and window, Llama-3-8B's by default (``--heads 28 --kv-heads 4``
    for Qwen2-7B's): the arguments every layer benchmark takes."""
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=64)


class _TeacherModule(torch.nn.Module):
    """What ``sdpa_attention_forward`` reads off a Llama attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def teacher_attention(module, q, k, v, scale):
    """The unconverted model's attention call: (B, H, T, D) in, (B, T, H, D) out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scale)[0]


def materialised_hybrid(q, k, v, fq, fk, *, window: int, g=0.5, shared_norm: bool = False,
                        scale: float | None = None, eps: float = ref.LA_EPS) -> torch.Tensor:
    """The hybrid computed LoLCATs-style, with T x T score matrices: SWA weights
    ``exp(s - max)`` on the window, LA weights ``fq.fk + eps`` (the kernel floor,
    ``reference.LA_EPS``) outside it (non-overlapping), in fp32;
    shared_norm as LoLCATs (one denominator, factor ``g`` on the softmax terms), otherwise
    ``g SWA + (1 - g) LA``. (B, H, T, D) in the input dtype. Memory O(B H T^2)."""
    B, H, T, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    k, v, fk = (ref.repeat_kv(x, H) for x in (k, v, fk))
    t = torch.arange(T, device=q.device)
    causal = t[None, :] <= t[:, None]
    win = causal & (t[None, :] > t[:, None] - window)
    far = t[None, :] <= t[:, None] - window
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (B, H, T, T)
    s = s.masked_fill(~win, float("-inf"))
    m = s.amax(-1, keepdim=True)  # finite: the diagonal is always in the window
    a_sm = torch.exp(s - m)
    a_ln = (torch.matmul(fq, fk.transpose(-1, -2)).float() + eps).masked_fill(~far, 0.0)
    vf = v.float()
    if shared_norm:
        # LoLCATs' shared denominator; the LA terms are scaled by the same exp(-m) as the
        # softmax terms (LoLCATs' code leaves them unscaled, a different function once logits
        # are large), so that this computes the function hybrid_attention does
        f = g if not torch.is_tensor(g) else g.float().view(1, H, 1, 1)
        a_ln = a_ln * torch.exp(-m)
        num = torch.matmul(f * a_sm + a_ln, vf)
        den = (f * a_sm).sum(-1, keepdim=True) + a_ln.sum(-1, keepdim=True)
        out = num / den
    else:
        gg = g if not torch.is_tensor(g) else g.float().view(1, H, 1, 1)
        swa = torch.matmul(a_sm, vf) / a_sm.sum(-1, keepdim=True)
        la_den = a_ln.sum(-1, keepdim=True)
        la = torch.where(la_den > 0, torch.matmul(a_ln, vf) / la_den.clamp_min(1e-30), 0.0)
        out = gg * swa + (1 - gg) * la
    return out.to(q.dtype)


class Layer:
    """Inputs and modules of one benchmark shape, on ``timing.DEVICE``."""

    def __init__(self, B, T, H, Hkv, D, window, dtype, projection, seed=0):
        dev = timing.DEVICE
        self.B, self.T, self.H, self.Hkv, self.D, self.w = B, T, H, Hkv, D, window
        self.scale = D ** -0.5
        gen = torch.Generator(device=dev).manual_seed(seed)

        def leaf(h):  # a view of (B, T, h, D), as the model hands attention its q, k, v
            x = torch.randn(B, T, h, D, device=dev, generator=gen, dtype=dtype)
            return x.transpose(1, 2).requires_grad_()

        self.q, self.k, self.v = leaf(H), leaf(Hkv), leaf(Hkv)
        self.do = torch.randn(B, T, H, D, device=dev, generator=gen, dtype=dtype)
        self.phi_q = HedgehogFeatureMap(H, D, projection=projection, seed=1).to(dev)
        self.phi_k = HedgehogFeatureMap(Hkv, D, projection=projection, seed=2).to(dev)
        self.F = self.phi_q.feature_dim
        self.mixers = {"fixed": None, "learned_head": LearnedHeadMixer(H, 0.5).to(dev),
                       "shared_norm": SharedNormMixer(H).to(dev)}
        self.teacher_module = _TeacherModule(H // Hkv)
        self.params = [self.q, self.k, self.v, self.phi_q.weight, self.phi_k.weight,
                       self.phi_q.bias, self.phi_k.bias]
        self.params += [p for m in self.mixers.values() if m is not None for p in m.parameters()]
        self.gate_logit = None  # (made by the first gate row: other rows' peaks leave it out)

    def mixer_args(self, mixer):
        if mixer == "gate":  # g per position and channel: sigmoid(x W + c), (B, H, T, D)
            if self.gate_logit is None:  # an output gate's pre-activation, as the model's
                # OutputGateMixer hands it on ((B, T, H, D) memory; its Linear is not attention)
                gen = torch.Generator(device=timing.DEVICE).manual_seed(5)
                B, T, H, D = self.do.shape
                self.gate_logit = (torch.randn(B, T, H, D, device=timing.DEVICE, generator=gen,
                                               dtype=self.do.dtype) * 0.5).requires_grad_()
                self.params.append(self.gate_logit)
            return {"g": torch.sigmoid(self.gate_logit).transpose(1, 2), "shared_norm": False}
        m = self.mixers[mixer]
        if m is None:
            return {"g": 0.5, "shared_norm": False}
        return {"g": m(None), "shared_norm": m.shared_norm}

    def zero(self):
        for p in self.params:
            p.grad = None

    # forward callables, (B, T, H, D) out
    def teacher(self):
        return teacher_attention(self.teacher_module, self.q, self.k, self.v, self.scale)

    def features(self, pytorch: bool = False):
        """(fq, fk): the modules' forward (the fused Triton map wherever it applies), or with
        ``pytorch`` their PyTorch path (``backends.triton_disabled()`` around the two calls
        only; the attention kernel is unaffected)."""
        if not pytorch:
            return self.phi_q(self.q), self.phi_k(self.k)
        with backends.triton_disabled():
            return self.phi_q(self.q), self.phi_k(self.k)

    def feature_maps(self, pytorch: bool = False):
        """Both feature maps alone, as one (B, T, H, F)-shaped output for the timing loop."""
        fq, fk = self.features(pytorch)
        return (fq.sum() + fk.sum()).reshape(1, 1, 1, 1).expand(self.do.shape)

    def hybrid(self, mixer="fixed", backend="auto", fq=None, fk=None, pytorch_phi=False,
               fold=True):
        """The layer's attention, (B, T, H, D). Without fq / fk, as the model's layer calls it:
        the maps handed over as modules (``maps=``: folded into the fused kernel's autograd
        Function where it takes the call). ``fold=False``: the maps run first as their own
        Functions (q and k handed on through them); ``pytorch_phi``: so, with the maps'
        PyTorch path."""
        q, k = self.q, self.k
        kw = dict(window=self.w, backend=backend, scale=self.scale, **self.mixer_args(mixer))
        if fq is None and fold and not pytorch_phi:
            out = hybrid_attention(q, k, self.v, None, None, maps=(self.phi_q, self.phi_k), **kw)
            return out.transpose(1, 2).contiguous()
        if fq is None:
            with backends.triton_disabled() if pytorch_phi else contextlib.nullcontext():
                fq, q = self.phi_q(q, with_input=True)
                fk, k = self.phi_k(k, with_input=True)
        out = hybrid_attention(q, k, self.v, fq, fk, **kw)
        return out.transpose(1, 2).contiguous()

    def hybrid_stage1(self):
        """The layer as stage 1 trains it (the output-MSE objective's call): the teacher's q,
        k, v detached, the maps handed over as modules, gradients for the feature maps only
        (the kernels skip the dq / dk / dv passes)."""
        q, k, v = (x.detach() for x in (self.q, self.k, self.v))
        out = hybrid_attention(q, k, v, None, None, maps=(self.phi_q, self.phi_k), window=self.w,
                               scale=self.scale, **self.mixer_args("fixed"))
        return out.transpose(1, 2).contiguous()

    def swa(self):
        ops = backends.select("auto", self.q)
        out, _ = ops.swa(self.q, self.k, self.v, scale=self.scale, window=self.w, need_lse=False,
                         key_padding_mask=None)
        return out.transpose(1, 2).contiguous()

    def lolcats(self, mixer="fixed"):
        a = self.mixer_args(mixer)
        out = materialised_hybrid(self.q, self.k, self.v, self.phi_q(self.q), self.phi_k(self.k),
                                  window=self.w, scale=self.scale, **a)
        return out.transpose(1, 2).contiguous()

    def reference(self, mixer="fixed"):
        """fp32 oracle on the same inputs."""
        q, k, v = (x.detach().float().requires_grad_() for x in (self.q, self.k, self.v))
        fq, fk = self.phi_q(q), self.phi_k(k)
        out = hybrid_attention(q, k, v, fq, fk, window=self.w, backend="reference",
                               scale=self.scale, **self.mixer_args(mixer))
        return out, (q, k, v)

    def grads_of(self, fwd):
        """Output and gradients of q, k, v, Wq, Wk for the callable ``fwd``."""
        self.zero()
        out = fwd()
        out.float().backward(self.do.float())
        res = {"out": out.detach().float(), "dq": self.q.grad, "dk": self.k.grad,
               "dv": self.v.grad, "dWq": self.phi_q.weight.grad, "dWk": self.phi_k.weight.grad}
        self.zero()
        return res


def step_fwd_bwd(layer: Layer, fwd):
    def fn():
        out = fwd()
        out.backward(layer.do)
        layer.zero()
    return fn


def step_fwd(fwd):
    def fn():
        with torch.no_grad():
            fwd()
    return fn


#: tile configurations of the fused kernel that ``--tune`` (attention_speed) and ``--configs``
#: (kernel_anatomy) compare with the default: name -> the ``KernelConfig`` fields changed from
#: ``default_config``'s at the call's head size and dtype
TUNE_CONFIGS = {
    "default": {},
    # the backward recomputing both branches' per-query factors instead of reading the
    # forward's saved branches (less memory, more time)
    "recomputed": {"save_branches": False},
    # the LA states built split at any length, and walked at any length (by default the
    # split starts past ``SPLIT_STATES_MIN_CHUNKS`` chunks)
    "split-states": {"split_states": True},
    "walk-states": {"split_states": False},
    # every tile read through pointers (what a GPU before sm_90 runs) where the default reads
    # some through tensor descriptors
    "no-tma": {"tma": False},
}


def tile_config(name: str, D: int, F: int, dtype: torch.dtype):
    """``TUNE_CONFIGS[name]`` as a ``KernelConfig`` for head size ``D``, feature size ``F``."""
    return dataclasses.replace(kconfig.default_config(D, F, dtype), **TUNE_CONFIGS[name])


def parse_tiles(spec: str) -> dict:
    """``--tiles``' "field=value,..." (``KernelConfig`` fields, values Python literals)."""
    fields = {f.name for f in dataclasses.fields(kconfig.KernelConfig)}
    out = {}
    for item, name, value in kernel_switches.assignments(
            spec, "--tiles", "field=value (e.g. save_branches=False)"):
        if name not in fields:
            raise ValueError(f"--tiles: {item!r} is not field=value of a KernelConfig field "
                             f"(e.g. save_branches=False)")
        out[name] = value
    return out


@contextlib.contextmanager
def default_config_replaced(replacement):
    """``default_config`` replaced by ``replacement`` (D, F, dtype) -> KernelConfig inside, in
    its module and in every loaded module of the hybrid family that holds it by name (the
    kernel asks it when a call is given no config)."""
    base = kconfig.default_config
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("hedgecats.models.ops.hybrid") and m is not None
               and getattr(m, "default_config", None) is base]
    for m in holders:
        m.default_config = replacement
    try:
        yield
    finally:
        for m in holders:
            m.default_config = base


@contextlib.contextmanager
def default_tiles_changed(changes: dict | None):
    """``default_config`` returning its tiles with ``changes`` inside (what the layer's call
    reaches)."""
    if not changes:
        yield
        return
    base = kconfig.default_config

    @functools.lru_cache(maxsize=64)  # (one config a shape, as the default's: the host time
    def changed(D, F, dtype):  # of a call with changed tiles is the default's)
        return dataclasses.replace(base(D, F, dtype), **changes)

    with default_config_replaced(changed):
        yield
