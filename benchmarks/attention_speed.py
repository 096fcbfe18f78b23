"""One attention layer on the GPU, every path the issue compares: time, memory, correctness.

    python benchmarks/attention_speed.py --out benchmarks/results          # all lengths
    python benchmarks/attention_speed.py --shapes 8x1024,2x4096 --out /tmp/r

Per B x T (H=32, Hkv=8, D=128, window 64, bf16 by default; q, k, v are views of (B, T, H, D)
tensors, as a transformers model hands them to attention), forward + backward unless the name
says ``fwd``:

    teacher          the unconverted model's attention, exactly as transformers runs it
                     (``sdpa_attention_forward``: SDPA, GQA, causal; no feature maps)
    swa              sliding-window attention alone (the backend's SWA piece: fla, else flex)
    hybrid <mixer>   the converted layer's default path (``backend="auto"``), feature maps
                     included: phi_q(q), phi_k(k), hybrid_attention, for the fixed g, a learned
                     per-head g, shared_norm and an output gate (g = sigmoid(logits) per
                     position and channel: a kernel call per branch, mixed in PyTorch)
    hybrid pieces    the same through the piece-by-piece path (fla SWA + fla LA, no fused kernel)
    hybrid fixed [stage 1]  the layer as stage 1 trains it: q, k, v detached (the teacher's),
                     gradients for the feature maps only
    kernel only      the fused Triton kernel with precomputed feature maps (no phi)
    lolcats T x T    the hybrid materialised as T x T scores (LoLCATs-style; fixed g and
                     shared_norm), where it fits in memory
    <...> fwd        forward alone, no autograd (evaluation, prefill)

Correctness first: before a row is timed, its output and gradients (q, k, v, feature-map
weights) are compared with the fp32 reference where B * T <= ``--ref-tokens``, else with the
independent piece-by-piece path; the relative errors are in the row. Times are medians of CUDA
event timings after warm-up (the number of repeats adapts to the row's length), and beside
them each row's GPU time with the host ahead (``device_ms``: where an isolated call is bound by
its Python and launches, as the layer at 8 x 1k is, the event timing measures the host; the
ratios are given in both, ``ratios`` and ``ratios_device_time``); peak memory is
``torch.cuda.max_memory_allocated`` over the timed repeats (inputs included) and, separately,
above what was allocated before. Every row is run in its own try block: a failure is a row with
an ``error``, never the end of the run.

Writes ``attention_speed.json`` and ``attention_speed.md`` to ``--out`` and the issue's ratios
into ``--summary`` (default ``<out>/summary.json``, merged with what is there).
``--tune`` also times a few tile configurations of the fused kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.mixers import LearnedHeadMixer, SharedNormMixer
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid import reference as ref
from hedgecats.models.ops import switches as kernel_switches
from hedgecats.models.ops.hybrid import kernels as th

# ----------------------------------------------------------------------------- timing


def bench(fn, warmup: int = 3, iters: int = 10) -> tuple[float, float]:
    """(median ms over ``iters`` CUDA-event-timed calls after ``warmup``, peak GiB)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


DEVICE = "cuda"  # "cpu" in --tiny mode: host clock, no memory statistics


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(fn) -> float:
    """One call's milliseconds: CUDA events on the GPU, the host clock on the CPU."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def bench_adaptive(fn, budget_ms: float = 1500.0, max_iters: int = 20) -> dict:
    """Warm up (twice: compilation, then caches), time one call, then repeat so that the row
    takes about ``budget_ms``: median, spread, peak memory (absolute and above the start)."""
    fn()
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    one = (time.perf_counter() - t0) * 1e3
    iters = int(max(3, min(max_iters, budget_ms // max(one, 1e-3))))
    cuda = DEVICE == "cuda"
    # what earlier work left in reference cycles goes before the peak is taken: on 2026-12-02
    # the rows checked against the piece-by-piece path read 21.59 GiB at 64k and the unchecked
    # shared_norm row of the same layer 8.09 (the check's tensors, freed only by the collector)
    gc.collect()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [_timed(fn) for _ in range(iters)]
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times),
            "iters": iters, "peak_gib": peak / 2**30, "peak_above_start_gib": (peak - base) / 2**30}


def hold_device(ms: float) -> None:
    """Enqueue a kernel that keeps the GPU busy for ``ms`` milliseconds (its clock's cycles), so
    that the host's launches after it queue up instead of waiting on the GPU."""
    torch.cuda._sleep(int(ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3))


def device_ms(fn, per_call_ms: float, budget_ms: float = 400.0, max_calls: int = 20,
              sleep_ms: float | None = None) -> dict:
    """``fn``'s GPU time per call with the host ahead, and its host (Python + launch) time
    apart: a sleep kernel holds the GPU while the host enqueues the calls (host time: the CPU
    clock over them, no sync), which then run back to back (device time: CUDA events around
    them). An isolated call whose Python and launches take longer than its kernels (the hybrid
    layer at 8 x 1k: host 2.4-3.1 ms, kernels 2.4-2.6 ms, 2026-12-03) is timed by
    ``bench_adaptive`` at its host's speed (the same code on two machines: 2.86 and 3.29 ms,
    the forward 0.83 and 1.20); inside a model the host runs ahead and the GPU time is what a
    step pays. Calls: ``budget_ms / per_call_ms`` within [3, ``max_calls``]; the sleep lasts
    ``sleep_ms`` (default: 50 ms + 5 ms a call, ~4 ms of host per call being the most seen).
    ``host_ahead`` False: the sleep ended before the host had enqueued every call (the device
    figure then holds launch gaps). None on the CPU. (``profile_hybrid.py --host`` uses it.)"""
    if DEVICE != "cuda":
        return {"device_ms": None, "host_ahead": None}
    n = int(max(3, min(max_calls, budget_ms // max(per_call_ms, 1e-3))))
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    hold_device(50.0 + 5.0 * n if sleep_ms is None else sleep_ms)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / n
    end.record()
    ahead = not start.query()  # the sleep still ran when the host finished enqueueing
    torch.cuda.synchronize()
    return {"device_ms": start.elapsed_time(end) / n, "host_ms": host, "host_ahead": ahead,
            "device_calls": n}


# ----------------------------------------------------------------------------- baselines


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
    ``ops.reference.LA_EPS``) outside it (non-overlapping), in fp32;
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
        # are large: see ops.hybrid), so that this computes the function hybrid_attention does
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


# ----------------------------------------------------------------------------- floors
PEAK_FLOPS = 790e12  # bf16 dense, H200 (this workplace's measured matrix rate)
PEAK_BYTES = 4.8e12  # HBM3e


def floors(B, H, Hkv, T, D, F, w, bytes_per=2) -> dict:
    """FLOPs and bytes each path must at least do (see benchmarks/README.md), and the floor in
    ms = max(FLOPs / 790 TFLOP/s, bytes / 4.8 TB/s)."""
    nq, nk = B * H * T, B * Hkv * T
    pairs_full = B * H * T * (T + 1) / 2
    pairs_win = B * H * sum(min(t + 1, w) for t in range(min(T, w))) + B * H * max(T - w, 0) * w
    attn_io_f = bytes_per * (2 * nq * D + 2 * nk * D)  # q, o; k, v
    attn_io_b = bytes_per * (3 * nq * D + 4 * nk * D)  # q, o, dO; k, v; dq; dk, dv
    attn_io_b += bytes_per * nq * D  # dq written
    la_f = 2 * F * D * (nq + nk)  # query . state, state update per key (kv heads)
    la_b = 4 * F * D * (nq + nk)
    la_io_f = bytes_per * (nq * F + nk * F)
    la_io_b = 2 * la_io_f
    phi_f = 2 * D * (F // 2) * (nq + nk)
    phi_b = 2 * phi_f
    phi_io_f = bytes_per * ((nq + nk) * D + (nq + nk) * F)
    phi_io_b = bytes_per * (2 * (nq + nk) * D + (nq + nk) * F)

    def ms(fl, by):
        return 1e3 * max(fl / PEAK_FLOPS, by / PEAK_BYTES)

    out = {}
    for name, ff, fb, bf, bb in (
        ("teacher", 4 * pairs_full * D, 10 * pairs_full * D, attn_io_f, attn_io_b),
        ("swa", 4 * pairs_win * D, 10 * pairs_win * D, attn_io_f, attn_io_b),
        ("kernel", 4 * pairs_win * D + la_f, 10 * pairs_win * D + la_b, attn_io_f + la_io_f,
         attn_io_b + la_io_b),
        ("hybrid", 4 * pairs_win * D + la_f + phi_f, 10 * pairs_win * D + la_b + phi_b,
         attn_io_f + la_io_f + phi_io_f, attn_io_b + la_io_b + phi_io_b),
        ("lolcats", 4 * pairs_full * (D + F / 2) + phi_f, 10 * pairs_full * (D + F / 2) + phi_b,
         attn_io_f + phi_io_f + 2 * 4 * B * H * T * T, 0),
        ("phi", phi_f, phi_b, phi_io_f, phi_io_b),
    ):
        out[name] = {"fwd_flops": ff, "fwd_bytes": bf, "fwd_ms": ms(ff, bf),
                     "fwd_bwd_flops": ff + fb, "fwd_bwd_bytes": bf + bb,
                     "fwd_bwd_ms": ms(ff + fb, bf + bb)}
    return out


# ----------------------------------------------------------------------------- the rows
def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


class Layer:
    """Inputs and modules of one benchmark shape."""

    def __init__(self, B, T, H, Hkv, D, window, dtype, projection, seed=0):
        self.B, self.T, self.H, self.Hkv, self.D, self.w = B, T, H, Hkv, D, window
        self.scale = D ** -0.5
        gen = torch.Generator(device=DEVICE).manual_seed(seed)

        def leaf(h):  # a view of (B, T, h, D), as the model hands attention its q, k, v
            x = torch.randn(B, T, h, D, device=DEVICE, generator=gen, dtype=dtype)
            return x.transpose(1, 2).requires_grad_()

        self.q, self.k, self.v = leaf(H), leaf(Hkv), leaf(Hkv)
        self.do = torch.randn(B, T, H, D, device=DEVICE, generator=gen, dtype=dtype)
        self.phi_q = HedgehogFeatureMap(H, D, projection=projection, seed=1).to(DEVICE)
        self.phi_k = HedgehogFeatureMap(Hkv, D, projection=projection, seed=2).to(DEVICE)
        self.F = self.phi_q.feature_dim
        self.mixers = {"fixed": None, "learned_head": LearnedHeadMixer(H, 0.5).to(DEVICE),
                       "shared_norm": SharedNormMixer(H).to(DEVICE)}
        self.teacher_module = _TeacherModule(H // Hkv)
        self.params = [self.q, self.k, self.v, self.phi_q.weight, self.phi_k.weight,
                       self.phi_q.bias, self.phi_k.bias]
        self.params += [p for m in self.mixers.values() if m is not None for p in m.parameters()]
        self.gate_logit = None  # (made by the first gate row: other rows' peaks leave it out)

    def mixer_args(self, mixer):
        if mixer == "gate":  # g per position and channel: sigmoid(x W + c), (B, H, T, D)
            if self.gate_logit is None:  # an output gate's pre-activation, as the model's
                # OutputGateMixer hands it on ((B, T, H, D) memory; its Linear is not attention)
                gen = torch.Generator(device=DEVICE).manual_seed(5)
                B, T, H, D = self.do.shape
                self.gate_logit = (torch.randn(B, T, H, D, device=DEVICE, generator=gen,
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
        """(fq, fk): the modules' forward (the fused Triton map, ops.triton_phi, wherever it
        applies: the default path since 2026-12-02), or with ``pytorch`` their PyTorch path
        (``backends.triton_disabled()`` around the two calls only; the attention kernel is
        unaffected)."""
        if not pytorch:
            return self.phi_q(self.q), self.phi_k(self.k)
        with backends.triton_disabled():
            return self.phi_q(self.q), self.phi_k(self.k)

    def feature_maps(self, pytorch: bool = False):
        """Both feature maps alone, as one (B, T, H, F)-shaped output for the timing loop."""
        fq, fk = self.features(pytorch)
        return (fq.sum() + fk.sum()).reshape(1, 1, 1, 1).expand(self.do.shape)

    def hybrid(self, mixer="fixed", backend="auto", fq=None, fk=None, pytorch_phi=False,
               kernel_du=True, fold=True):
        """The layer's attention, (B, T, H, D). Without fq / fk, as the model's layer calls it:
        the maps handed over as modules (``maps=``: folded into the fused kernel's autograd
        Function where it takes the call, since 2026-12-04). ``fold=False``: the call before
        that, the maps run first as their own Functions (q and k handed on through them, the q
        map's backward from the kernel's du unless ``kernel_du`` is off); ``pytorch_phi``: so,
        with the maps' PyTorch path."""
        q, k = self.q, self.k
        kw = dict(window=self.w, backend=backend, scale=self.scale, **self.mixer_args(mixer))
        if fq is None and fold and not pytorch_phi:
            out = hybrid_attention(q, k, self.v, None, None, maps=(self.phi_q, self.phi_k), **kw)
            return out.transpose(1, 2).contiguous()
        if fq is None:
            with backends.triton_disabled() if pytorch_phi else contextlib.nullcontext():
                fq, q = self.phi_q(q, with_input=True, kernel_du=kernel_du)
                fk, k = self.phi_k(k, with_input=True)
        out = hybrid_attention(q, k, self.v, fq, fk, **kw)
        return out.transpose(1, 2).contiguous()

    def hybrid_stage1(self):
        """The layer as stage 1 trains it (``ops.transfer.hybrid_output_mse``'s call): the
        teacher's q, k, v detached, the maps handed over as modules, gradients for the feature
        maps only (the kernels skip the dq / dk / dv passes)."""
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


def check_against(layer: Layer, fwd, mixer, use_reference: bool, pieces=None) -> dict:
    """Relative errors of ``fwd``'s output and gradients against the fp32 reference (or,
    for long sequences, the piece-by-piece path)."""
    got = layer.grads_of(fwd)
    if use_reference:
        out, (q, k, v) = layer.reference(mixer)
        layer.phi_q.zero_grad()
        layer.phi_k.zero_grad()
        out.transpose(1, 2).backward(layer.do.float())
        want = {"out": out.transpose(1, 2).detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad,
                "dWq": layer.phi_q.weight.grad, "dWk": layer.phi_k.weight.grad}
        layer.zero()
        against = "fp32 reference"
    else:
        want = layer.grads_of(pieces)
        against = "piece-by-piece path (bf16)"
    errs = {n: float(f"{rel(got[n], want[n]):.2e}") for n in want if got[n] is not None}
    return {"against": against, "rel_err": errs}


def fits_materialised(B, H, T, budget_gib) -> bool:
    # about six fp32 (B, H, T, T) tensors alive in forward + backward
    return 6 * 4 * B * H * T * T / 2**30 <= budget_gib


def run_shape(a, B, T, results, log):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    L = Layer(B, T, a.heads, a.kv_heads, a.head_dim, a.window, dtype, a.projection)
    fl = floors(B, a.heads, a.kv_heads, T, a.head_dim, L.F, a.window)
    use_ref = B * T <= a.ref_tokens
    from hedgecats.models.ops.hybrid import kernels as th

    have_triton = backends.available("triton")

    def pieces(mixer="fixed"):
        be = "reference" if DEVICE == "cpu" else "fla" if backends.available("fla") else "flex"
        return lambda: L.hybrid(mixer, backend=be)

    rows = []
    spec = [
        ("teacher", "fwd+bwd", L.teacher, None, "teacher"),
        ("teacher fwd", "fwd", L.teacher, None, "teacher"),
        ("swa", "fwd+bwd", L.swa, None, "swa"),
        ("swa fwd", "fwd", L.swa, None, "swa"),
    ]
    for mixer in ("fixed", "learned_head", "shared_norm"):
        spec.append((f"hybrid {mixer}", "fwd+bwd", lambda m=mixer: L.hybrid(m), mixer, "hybrid"))
    spec.append(("hybrid fixed fwd", "fwd", lambda: L.hybrid("fixed"), "fixed", "hybrid"))
    # (no floor: the hybrid's counts the q, k, v gradients this call does not compute)
    spec.append(("hybrid fixed [stage 1]", "fwd+bwd", L.hybrid_stage1, None, None))
    spec.append(("hybrid pieces fixed", "fwd+bwd", pieces("fixed"), "fixed", "hybrid"))
    if have_triton:
        spec.append(("hybrid fixed [pytorch phi]", "fwd+bwd",
                     lambda: L.hybrid("fixed", pytorch_phi=True), "fixed", "hybrid"))
        spec.append(("hybrid fixed fwd [pytorch phi]", "fwd",
                     lambda: L.hybrid("fixed", pytorch_phi=True), "fixed", "hybrid"))
        spec.append(("feature maps", "fwd+bwd", lambda: L.feature_maps(), None, "phi"))
        spec.append(("feature maps [pytorch]", "fwd+bwd", lambda: L.feature_maps(True), None,
                     "phi"))
        fq = L.phi_q(L.q).detach().requires_grad_()
        fk = L.phi_k(L.k).detach().requires_grad_()
        L.params += [fq, fk]
        spec.append(("kernel only fixed", "fwd+bwd",
                     lambda: L.hybrid("fixed", backend="triton", fq=fq, fk=fk), None, "kernel"))
        spec.append(("kernel only fixed fwd", "fwd",
                     lambda: L.hybrid("fixed", backend="triton", fq=fq, fk=fk), None, "kernel"))
    if fits_materialised(B, a.heads, T, a.materialised_gib):
        for mixer in ("fixed", "shared_norm"):
            spec.append((f"lolcats T x T {mixer}", "fwd+bwd", lambda m=mixer: L.lolcats(m), mixer,
                         "lolcats"))
    # an output gate (its (B, T, H, D) input made by the first of these rows: last, so that no
    # other row's peak memory holds it); the pieces took such calls until 2026-12-05 (the
    # before of ``triton_hybrid._gated``)
    spec += [("hybrid gate", "fwd+bwd", lambda: L.hybrid("gate"), "gate", "hybrid"),
             ("hybrid gate fwd", "fwd", lambda: L.hybrid("gate"), "gate", "hybrid"),
             ("hybrid pieces gate", "fwd+bwd", pieces("gate"), "gate", "hybrid")]
    if a.cases:
        spec = [row for row in spec if re.search(a.cases, row[0])]
    for name, kind, fwd, mixer, floor_key in spec:
        row = {"B": B, "T": T, "case": name, "kind": kind}
        torch.cuda.empty_cache()
        try:
            # long sequences are checked against the pieces (fla), except shared_norm, whose
            # pieces need flex_attention's log-sum-exp: a compilation per length, minutes
            long_ok = a.check_max_tokens is None or B * T <= a.check_max_tokens
            if mixer is not None and kind == "fwd+bwd" and not long_ok:
                row["check"] = None
                row["check_skipped"] = (f"B*T = {B * T} > --check-max-tokens "
                                        f"{a.check_max_tokens}")
            elif mixer is not None and kind == "fwd+bwd" and (use_ref or (
                    "pieces" not in name and mixer != "shared_norm")):
                row["check"] = check_against(L, fwd, mixer, use_ref,
                                             pieces=None if use_ref else pieces(mixer))
            if have_triton and name.startswith("hybrid") and "pieces" not in name:
                with torch.no_grad():
                    c0 = th.CALLS["forward"]
                    fwd()
                    row["fused_kernel"] = th.CALLS["forward"] > c0
            fn = step_fwd_bwd(L, fwd) if kind == "fwd+bwd" else step_fwd(fwd)
            row.update(bench_adaptive(fn, a.budget_ms))
            row.update(device_ms(fn, row["ms"]))
            if floor_key is not None:  # (None: no floor counted for this computation)
                f = fl[floor_key]
                row["floor_ms"] = f["fwd_bwd_ms"] if kind == "fwd+bwd" else f["fwd_ms"]
                row["floor_fraction"] = row["floor_ms"] / row["ms"]
            row["tokens_per_s"] = B * T / row["ms"] * 1e3
        except Exception as e:  # a failing row is a finding, not the end of the run
            row["error"] = f"{type(e).__name__}: {e}"[:600]
            row["traceback"] = traceback.format_exc()[-1500:]
            L.zero()
        rows.append(row)
        log(row)
    results["rows"].extend(rows)


#: the tiles of session 11's default (D 128 bf16), which the configs after it vary
_FWD128 = dict(block_m=128, block_n=64, state_chunk=128, warps=8, stages=2, bwd_block_m=64,
               bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8, grad_f_chunk=256,
               dkv_block_n=64, split_tile=128)

#: the default tiles at D 128 in bf16 (``default_config``), as a dict for the configs that
#: change one thing of them
_DEFAULT_D128 = dataclasses.asdict(th.default_config(128, 256, torch.bfloat16))

TUNE_CONFIGS = {  # None: default_config (D=128 since session 13: fwd 128x64 w8 over 4 query
    # heads of 32 positions, dq / dfq 128 queries likewise, key-side backward 64x32 w8 with
    # 64-key dfk / window tiles, walked state tiles 128 x 128 while 128 programs, split-state
    # tiles 128, f_chunk 64, grad_f_chunk 256: "st128" below); a named one without
    # grad_f_chunk takes f_chunk (64) for it
    "default": None,
    # smaller tiles: no spills at all in ptxas's report, but mma.sync instead of wgmma
    "fwd32-bwd32": dict(block_m=32, block_n=64, state_chunk=64, warps=8, stages=2,
                        bwd_block_m=32, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8),
    # the default before 2026-12-02 (states every 64 positions; the default is 128 since:
    # half the stored states, twice the keys between a state and its block)
    "chunk64": dict(block_m=64, block_n=64, state_chunk=64, warps=8, stages=2,
                    bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8),
    # the default's tiles, the backward recomputing both branches' per-query factors instead of
    # reading the forward's stored SWA_t / LA_t (save_branches off: the default until
    # 2026-12-02's sixth session; tables before then have a "saved" row, the option on)
    "recomputed": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                       bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                       save_branches=False, dkv_block_n=64, grad_f_chunk=256,
                       split_tile=128),
    # the default's tiles, the LA states built split at any length (split_states True; the
    # default splits past SPLIT_STATES_MIN_CHUNKS chunks only, so at 8 x 1k it walks)
    "split-states": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                         bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64,
                         state_warps=8, split_states=True, dkv_block_n=64, grad_f_chunk=256,
                         split_tile=128),
    # the default before 2026-12-02's eighth session: dfq and dfk in 64-wide feature slices,
    # one program each (the dO . v product computed once per slice; the default since takes
    # the whole F per program, grad_f_chunk 256)
    "grad-f64": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                     bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8),
    # the default's tiles, every tile read through pointer tensors (tma False: what a GPU
    # before sm_90 runs) where the default reads some through tensor descriptors (TMA)
    "no-tma": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                   bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                   grad_f_chunk=256, tma=False, dkv_block_n=64,
                   split_tile=128),
    # the same, the states walked at any length (split_states False): with "split-states",
    # where between 8 and 512 chunks the split starts to pay (SPLIT_STATES_MIN_CHUNKS)
    "walk-states": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                        bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64,
                        state_warps=8, split_states=False, dkv_block_n=64, grad_f_chunk=256,
                        split_tile=128),
    # the default until session 10 (2026-12-03): the key-side backward on the backward's
    # 32-key tiles in one launch, the split states on 64 x 64 tiles
    "session9": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                     bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                     grad_f_chunk=256),
    # the default with one of session 10's two changes taken back: the key-side backward on
    # 32-key tiles (dkv32), the split states on 64 x 64 tiles (split-64)
    "dkv32": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                  bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                  grad_f_chunk=256, split_tile=128),
    "split-64": dict(block_m=64, block_n=64, state_chunk=128, warps=8, stages=2,
                     bwd_block_m=64, bwd_block_n=32, bwd_warps=8, f_chunk=64, state_warps=8,
                     grad_f_chunk=256, dkv_block_n=64),
    # session 11 (2026-12-03): ptxas's report with the divisibility hints a real launch gives
    # (tests/test_triton_compile.py launch_hints) showed no spill at tiles the hint-less report
    # had ruled out: the forward at 128 queries a program (255 registers, 4 B spill, loads
    # pipelined; "fwd128", the default of session 11), the backward's key tiles at 64 (one
    # _bwd_dkv_la launch, its dv programs on wgmma instead of mma.sync)
    "fwd128": _FWD128,
    "bwd64": dict(_FWD128, block_m=64, bwd_block_n=64, dkv_block_n=None),
    "fwd128-bwd64": dict(_FWD128, bwd_block_n=64, dkv_block_n=None),
    # the query-side backward (dq, dfq) on 128-query tiles (dq_block_m; the key-side kernels
    # keep 64: they spill at 128); 243 / 254 registers, no spill (ptxas with the launch hints);
    # the default since session 12 (measured against "fwd128", the default before it)
    "dq128": dict(_FWD128, dq_block_m=128),
    # session 12: LA states every 64 positions with the 128-query forward (the intra-chunk
    # keys of a query block, and the queries of a key block before its reverse state, 192 to
    # 128; twice the stored states), alone and with the 128-query dq / dfq tiles: both slower
    # than the default (the forward 0.40 to 0.50 ms at 8 x 1k; results/h200_2026-12-03d)
    "cs64": dict(_FWD128, state_chunk=64),
    "dq128-cs64": dict(_FWD128, state_chunk=64, dq_block_m=128),
    # session 13: the forward with the query heads of a kv head packed into one program
    # (pack_heads; 128 rows = 32 positions of 4 heads, or 64 of 2): "pack1" is session 12's
    # default (one head a program). And cs64 with its states walked: session 12's cs64 rows
    # went split (16 chunks > SPLIT_STATES_MIN_CHUNKS), 0.18 ms more than the walk forward
    # (kernel_anatomy.py, results/h200_2026-12-03e)
    "pack1": dict(_FWD128, dq_block_m=128),
    "pack2": dict(_FWD128, dq_block_m=128, pack_heads=2),
    "cs64-walk": dict(_FWD128, dq_block_m=128, state_chunk=64, split_states=False),
    "pack4-cs64-walk": dict(_FWD128, dq_block_m=128, pack_heads=4, state_chunk=64,
                            split_states=False),
    # the query-side backward (dq, dfq) packed as the forward (the default since session 13's
    # call 3) or not ("pack4-dq1": the forward packed only, the default of its call 2)
    "pack4-dq1": dict(_FWD128, dq_block_m=128, pack_heads=4, dq_pack_heads=1),
    # session 13, call 4: the forward's products over F in 128-wide slices (f_chunk; 254
    # registers, no spill, 224 KB of shared memory) and the walked state kernels on larger
    # tiles (the fq / dnum tiles re-read F / state_f and D / state_d times; 128 x 64: 256
    # programs at 8 x 1k, 128 x 128: 128). st128 is the default since (state_programs 128)
    "fc128": dict(_FWD128, dq_block_m=128, pack_heads=4, f_chunk=128),
    "st128x64": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=64,
                     state_programs=0),
    "st128": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                  state_programs=0),
    # after session 13's GPU time: the LA state's share in the forward as a pipelined loop over
    # its feature slices (state_product_stages 2; ptxas: 86 async copies against 58, no
    # spill), with the default's tiles (st128's at 8 x 1k); measured in session 14: no gain
    "pipe-state": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                       state_programs=128, state_product_stages=2),
    # session 14: _bwd_dkv_la's dv programs at 64 keys, in one grid with the dfk programs
    # (dv_block_n; ptxas: 193 registers, wgmma, no spill, where 32 keys get mma.sync); the
    # default since (0.406 to 0.394 ms); "dv32" the default before
    "dv64": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                 state_programs=128, dv_block_n=64),
    "dv32": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                 state_programs=128),
    # after session 14's GPU time: the walked reverse states as one loop over (chunk, head)
    # pairs, pipelined over 2 stages (state_rev_stages; ptxas through descriptors: no spill,
    # 98 against 69 KB of shared memory); with the default's tiles; not yet measured
    "rev-flat": dict(_FWD128, dq_block_m=128, pack_heads=4, state_f=128, state_d=128,
                     state_programs=128, dv_block_n=64, state_rev_stages=2),
    # the default's tiles without the backward's fused kernels (session 16's _bwd_q: the dq
    # pass then the dfq pass; _bwd_kv: the window kernel's work in the LA key kernel's dv
    # programs; on by default since session 17: the layer at 8 x 1k 1.980 to 1.927 ms device,
    # the kernel alone 1.590 to 1.537; results/h200_2026-12-04, call 1)
    "unfused": dict(_DEFAULT_D128, fuse_q_side=False, fuse_kv_side=False),
    # the forward's key tile at 32 (its packed 32-position blocks need the 95 keys t0 - 63 ..
    # t0 + 31: 3 tiles of 32, where 2 of 64 read 128; ptxas: 254 registers, no spill, 144
    # against 192 KB of shared memory): measured slower, the forward 0.328 to 0.344 ms device
    # at 8 x 1k (predicted ~0.26 or slower; results/h200_2026-12-04, call 1). Not taken
    "fwd-bn32": dict(_DEFAULT_D128, block_n=32),
    # _bwd_kv's programs (KernelConfig.kv_order; 2 by default since session 18): order 0 (the
    # dfk programs first, the dv program - window dk, dv, then LA's dv, ~2x a dfk program's
    # work - last), the dv program first (1: the same results bit for bit), one program a key
    # block doing both (2: each LA query tile's fq, dO loaded once; ptxas 120 against 68 B of
    # spill). Measured (session 18, call 1, device ms): `_bwd_kv` at 8 x 1k 0.610 / 0.597 /
    # 0.565; the kernel alone at 1 x 64k 13.31 / 13.31 / 12.92
    "kv-order0": dict(_DEFAULT_D128, kv_order=0),
    "kv-order1": dict(_DEFAULT_D128, kv_order=1),
    # the LA state kernels' vector sums as row reductions (state_sums_mma False; on by default
    # since session 18: at 8 x 1k `_state_rev` 0.166 to 0.086 ms and `_state_fwd` 0.045 to
    # 0.028 with them on, the layer 1.887 to 1.792; results/h200_2026-12-04b, calls 1-2)
    "sums-reduced": dict(_DEFAULT_D128, state_sums_mma=False),
    # session 17's default (both of the above off; the kernel alone at 1 x 64k 13.34 against
    # the new default's 12.38 ms device, call 2)
    "session17": dict(_DEFAULT_D128, kv_order=0, state_sums_mma=False),
    # the forward on 128 x 64 tiles, 8 warps, one program a multiprocessor (th.ONE_PROGRAM_FORWARD:
    # the default until session 21, which took th.TWO_PROGRAM_FORWARD's; `_fwd` 0.281 against
    # 0.249 ms at 8 x 1k, session 19 call 1, results/h200_2026-12-04c)
    "fwd-one-program": dict(_DEFAULT_D128, **th.ONE_PROGRAM_FORWARD),
}


def tune(L: Layer, B, T, log, names: list[str] | None = None) -> list[dict]:
    """The fused kernel alone (precomputed feature maps, fixed g) under a few tile configs."""
    from hedgecats.models.ops.hybrid import kernels as th

    fq = L.phi_q(L.q).detach().requires_grad_()
    fk = L.phi_k(L.k).detach().requires_grad_()
    B_, H, T_, D = L.q.shape
    ones = torch.full((B, H), 0.5, device=DEVICE)
    shift = torch.full((B, H), L.w, device=DEVICE, dtype=torch.int32)
    out_rows = []
    want = want_grads = None
    for name, cfg in TUNE_CONFIGS.items():
        if names is not None and name not in names:
            continue
        row = {"B": B, "T": T, "config": name, "tiles": cfg}
        try:
            conf = th.default_config(D, L.F, L.q.dtype) if cfg is None else th.KernelConfig(**cfg)
            row["tiles"] = conf.__dict__

            def fwd(q=L.q, k=L.k, v=L.v):
                return th.hybrid_kernel(q, k, v, fq, fk, ones, 1 - ones, ones, shift,
                                        window=L.w, scale=L.scale, eps=ref.DEN_TINY, config=conf)
            with torch.no_grad():
                out = fwd().float()
            if want is None:
                want = out
            row["rel_err_vs_default"] = float(f"{rel(out, want):.2e}")
            row["fwd"] = bench_adaptive(step_fwd(fwd), 600)["ms"]
            row["fwd_device"] = device_ms(step_fwd(fwd), row["fwd"])["device_ms"]

            def fb():
                fwd().backward(L.do.transpose(1, 2))
                L.q.grad = L.k.grad = L.v.grad = fq.grad = fk.grad = None
            fwd().backward(L.do.transpose(1, 2))  # the gradients against the first config's
            g = [x.grad.float() for x in (L.q, L.k, L.v, fq, fk)]
            L.q.grad = L.k.grad = L.v.grad = fq.grad = fk.grad = None
            if want_grads is None:
                want_grads = g
            row["rel_err_grads_vs_default"] = float(f"{max(map(rel, g, want_grads)):.2e}")
            row["fwd_bwd"] = bench_adaptive(fb, 600)["ms"]
            row["fwd_bwd_device"] = device_ms(fb, row["fwd_bwd"])["device_ms"]

            def fb_stage1():  # q, k, v the teacher's: gradients of fq, fk only
                fwd(L.q.detach(), L.k.detach(), L.v.detach()).backward(L.do.transpose(1, 2))
                fq.grad = fk.grad = None
            row["stage1_fwd_bwd"] = bench_adaptive(fb_stage1, 600)["ms"]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        out_rows.append(row)
        log(row)
    return out_rows


# ----------------------------------------------------------------------------- reporting
def environment() -> dict:
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (--tiny smoke run)"
    env = {"gpu": gpu, "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": datetime.date.today().isoformat()}
    for mod in ("triton", "fla", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    return env


def _find(rows, T, case):
    for r in rows:
        if r["T"] == T and r["case"] == case and "ms" in r:
            return r
    return None


def ratios(rows, suffix: str = "", time_key: str = "ms") -> dict:
    """The issue's ratios (ours / theirs), where both rows exist; ``suffix`` " [pytorch phi]"
    takes our rows with the feature maps' PyTorch path instead of the default (fused) one;
    ``time_key`` "device_ms" the time ratios in GPU time with the host ahead (``device_ms``;
    the memory ratio is the same either way)."""
    def ratio(T, ours, theirs, key=time_key):
        a, b = _find(rows, T, ours + suffix), _find(rows, T, theirs)
        if a is None or b is None or a.get(key) is None or b.get(key) is None:
            return None
        return round(a[key] / b[key], 4)

    return {
        "layer_vs_teacher_T1k": ratio(1024, "hybrid fixed", "teacher"),
        "layer_vs_teacher_T64k": ratio(65536, "hybrid fixed", "teacher"),
        "layer_fwd_vs_teacher_T1k": ratio(1024, "hybrid fixed fwd", "teacher fwd"),
        "layer_mem_vs_swa_T64k": ratio(65536, "hybrid fixed", "swa", "peak_gib"),
        "layer_vs_lolcats_T4k": ratio(4096, "hybrid fixed", "lolcats T x T fixed"),
    }


TARGETS = {"layer_vs_teacher_T1k": 2.5, "layer_vs_teacher_T64k": 0.1,
           "layer_fwd_vs_teacher_T1k": 2.0, "layer_mem_vs_swa_T64k": 1.5,
           "layer_vs_lolcats_T4k": 0.2}


def _f3(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _f2(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(res) -> str:
    e = res["environment"]
    lines = [f"# attention_speed ({e['gpu']}, {e['date']})", "",
             f"{len(res['rows'])} rows in {res.get('seconds', '?')} s.", "",
             f"`{res['command']}`", "",
             f"torch {e['torch']}, CUDA {e['cuda']}, triton {e['triton']}, fla {e['fla']}, "
             f"transformers {e['transformers']}. H={res['heads']}, Hkv={res['kv_heads']}, "
             f"D={res['head_dim']}, window {res['window']}, {res['dtype']}, feature maps "
             f"{res['projection']}. Median of CUDA-event timings after warm-up; peak memory "
             "includes the inputs. Device ms: the GPU time per call with the host ahead; host "
             "ms: the host's (Python, launches) per call meanwhile (where it exceeds the device "
             "time, an isolated call is host-bound and its event timing reads the host).", "",
             "| B x T | case | ms | device ms | host ms | peak GiB | tokens/s | floor ms "
             "| floor / ms | max rel err (against) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['B']} x {r['T']} | {r['case']} | error: "
                         f"{r['error'][:120].replace('|', '/')} | | | | | | | |")
            continue
        chk = r.get("check")
        err = "" if not chk else f"{max(chk['rel_err'].values()):.1e} ({chk['against']})"
        if r.get("check_skipped"):
            err = f"not checked ({r['check_skipped']})"
        dev = _f3(r.get("device_ms")) + ("" if r.get("host_ahead") in (None, True) else " (gaps)")
        lines.append(f"| {r['B']} x {r['T']} | {r['case']} | {r['ms']:.3f} | {dev} | "
                     f"{_f3(r.get('host_ms'))} | {r['peak_gib']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} | {_f3(r.get('floor_ms'))} | "
                     f"{_f2(r.get('floor_fraction'))} | {err} |")
    lines += ["", "| ratio (ours / theirs) | measured (default path) | in device time (host "
              "ahead) | with the feature maps' PyTorch path | target |",
              "| --- | --- | --- | --- | --- |"]
    fused = res.get("ratios_with_pytorch_phi", {})
    dev = res.get("ratios_device_time", {})

    def cell(x):
        return "-" if x is None else x

    for k, v in res["ratios"].items():
        lines.append(f"| {k} | {cell(v)} | {cell(dev.get(k))} | {cell(fused.get(k))} | "
                     f"<= {TARGETS[k]} |")
    if res.get("tuning"):
        lines += ["", "Fused kernel alone under tile configurations (fixed g, feature maps "
                  "precomputed; stage 1: q, k, v detached):", "",
                  "| B x T | config | fwd ms | fwd+bwd ms | fwd / fwd+bwd device ms "
                  "| stage-1 fwd+bwd ms | rel err output / grads |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in res["tuning"]:
            if "error" in r:
                lines.append(f"| {r['B']} x {r['T']} | {r['config']} | error: "
                             f"{r['error'][:100]} | | | | |")
            else:
                lines.append(f"| {r['B']} x {r['T']} | {r['config']} | {r['fwd']:.3f} | "
                             f"{r['fwd_bwd']:.3f} | {_f3(r.get('fwd_device'))} / "
                             f"{_f3(r.get('fwd_bwd_device'))} | {_f3(r.get('stage1_fwd_bwd'))} | "
                             f"{r['rel_err_vs_default']:.1e} / "
                             f"{r.get('rel_err_grads_vs_default', float('nan')):.1e} |")
    return "\n".join(lines) + "\n"


def update_summary(path: Path, values: dict, env: dict, changed: dict | None = None) -> None:
    """``values`` (ratios) into the summary at ``path``, with the GPU and the date; ``changed``:
    what the run measured other than the defaults (``--switches``, ``--tiles``), kept beside
    the ratios (and dropped by a run of the defaults)."""
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary.update({k: v for k, v in values.items()})
    summary["gpu"], summary["date"] = env["gpu"], env["date"]
    summary.pop("layer_changed_from_defaults", None)
    if changed:
        summary["layer_changed_from_defaults"] = changed
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1) + "\n")


#: the paths drawn (row names without " fwd"), in the legend's order
PLOT_CASES = ("teacher", "swa", "hybrid fixed", "hybrid gate", "hybrid fixed [pytorch phi]",
              "lolcats T x T fixed")


def plot(res: dict, path: Path) -> Path | None:
    """Time per token (forward + backward solid, forward dashed) and peak memory against T for
    each path of ``PLOT_CASES`` measured in ``res`` (``rows`` of attention_speed.json); None
    without matplotlib or without rows to draw."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "error" not in r and "ms" in r]
    drawn = [c for c in PLOT_CASES if any(r["case"] == c for r in rows)]
    if not drawn:
        return None
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.3))
    for i, case in enumerate(drawn):
        color = plt.get_cmap("tab10")(i)
        base, bracket, tag = case.partition(" [")
        fwd_name = f"{base} fwd{bracket}{tag}"  # "hybrid fixed fwd [pytorch phi]"
        for name, style, fwd in ((case, "-o", False), (fwd_name, "--s", True)):
            pts = sorted((r["T"], 1e3 * r["ms"] / (r["B"] * r["T"]), r["peak_gib"])
                         for r in rows if r["case"] == name)
            if not pts:
                continue
            ax_t.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, ms=4,
                      label=case + (" (fwd)" if fwd else " (fwd+bwd)"))
            if not fwd:
                ax_m.plot([p[0] for p in pts], [p[2] for p in pts], "-o", color=color, ms=4,
                          label=case)
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (tokens per sequence; B x T as measured)")
        ax.grid(alpha=0.3, which="both")
    ax_t.set_ylabel("microseconds per token")
    ax_t.set_title("one attention layer: time per token")
    ax_m.set_ylabel("peak GiB (inputs included)")
    ax_m.set_title("peak memory (fwd+bwd)")
    ax_t.legend(fontsize=7)
    env = res.get("environment", {})
    fig.suptitle(f"{env.get('gpu', '?')} ({env.get('date', '?')}): H {res['heads']}, Hkv {res['kv_heads']}, "
                 f"D {res['head_dim']}, window {res['window']}, {res['dtype']}; medians of "
                 "CUDA-event timings", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_head_args(p: argparse.ArgumentParser) -> None:
    """The layer's head shape and window, Llama-3-8B's by default (``--heads 28 --kv-heads 4``
    for Qwen2-7B's): the arguments every layer benchmark takes."""
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x1024,2x4096,1x65536,1x16384,1x131072",
                   help="BxT list, run in this order")
    add_head_args(p)
    p.add_argument("--projection", default="square", choices=["square", "rectangular"])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--ref-tokens", type=int, default=8192,
                   help="check against the fp32 reference up to B*T tokens, else the pieces")
    p.add_argument("--materialised-gib", type=float, default=60.0,
                   help="run the T x T baseline where it needs at most this much")
    p.add_argument("--budget-ms", type=float, default=800.0, help="timing budget per row")
    p.add_argument("--check-max-tokens", type=int, default=None,
                   help="no correctness check above this many tokens (B*T): the check against "
                        "the pieces at 64k outlasted a 190 s step on the H200; the GPU kernel "
                        "tests cover correctness (default: check every shape)")
    p.add_argument("--cases", help="only the rows whose name matches this regular expression "
                   "(e.g. '^(teacher|swa|hybrid fixed|lolcats T x T fixed)( fwd)?$')")
    p.add_argument("--tune", action="store_true", help="also time tile configs of the kernel")
    p.add_argument("--tune-shapes", default="8x1024,1x65536", help="BxT list for --tune")
    p.add_argument("--tune-configs", default=None,
                   help="comma-separated names of TUNE_CONFIGS for --tune (default: all; each "
                        "compiles its kernels anew: the whole sweep outlasted 200 s at 8 x 1k)")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--summary", default=None, help="default <out>/summary.json")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run of this script: tiny shapes, host clock (numbers mean "
                   "nothing)")
    p.add_argument("--plot", metavar="JSON", default=None,
                   help="only draw attention_speed.png in --out from an attention_speed.json")
    p.add_argument("--switches", default="", metavar="SPEC",
                   help="kernel switches set for the whole run, 'module.NAME=value,...' "
                   "(e.g. feature_map.kernels.WEIGHTS_IN_KERNEL='walk'): an option measured as it would "
                   "run as the default; recorded in the JSON")
    p.add_argument("--tiles", default="", metavar="SPEC",
                   help="the default kernel config's fields changed for the whole run, "
                   "'field=value,...' (e.g. park_la=True,fwd_maxnreg=168), in every shape's "
                   "and dtype's default config (fp32 and D < 128 too, unlike a switch of "
                   "triton_hybrid.DEFAULT_FORWARD, which D >= 128 in bf16 alone take); "
                   "recorded")
    a = p.parse_args(argv)
    try:
        run_switches = kernel_switches.parse(a.switches, "--switches")
        run_tiles = parse_tiles(a.tiles)
    except (ValueError, SyntaxError) as e:
        p.error(str(e))
    if (run_switches or run_tiles) and a.summary:
        p.error("--summary holds the defaults' ratios (issue 11's targets): a run with "
                "--switches or --tiles writes its ratios, and what it changed, to "
                "<out>/summary.json only")
    unknown = set((a.tune_configs or "").split(",")) - set(TUNE_CONFIGS) - {""}
    if unknown:
        p.error(f"--tune-configs: no such config {', '.join(sorted(unknown))}; choose from "
                f"{', '.join(TUNE_CONFIGS)}")
    if a.plot:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        png = plot(json.loads(Path(a.plot).read_text()), out / "attention_speed.png")
        print(f"wrote {png}" if png else "nothing to draw (no rows, or no matplotlib)")
        return 0 if png else 1
    global DEVICE
    if a.tiny:
        DEVICE = "cpu"
        a.heads, a.kv_heads, a.head_dim, a.window = 4, 2, 16, 8
        if a.shapes == p.get_default("shapes"):
            a.shapes = "2x64,1x128"
        a.tune_shapes = "2x64"
        a.budget_ms = min(a.budget_ms, 50.0)
    elif not torch.cuda.is_available():
        print("attention_speed needs a GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["python", "benchmarks/attention_speed.py", *(argv or sys.argv[1:])]
    res = {"command": " ".join(cmd),
           "environment": environment(), "heads": a.heads, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "window": a.window, "dtype": a.dtype,
           "projection": a.projection, "rows": [], "tuning": [],
           "switches": a.switches, "tiles": a.tiles}

    def log(row):
        if "config" in row:
            msg = (f"error {row['error']}" if "error" in row else
                   f"fwd {row['fwd']:.3f} ms  fwd+bwd {row['fwd_bwd']:.3f} ms  "
                   f"stage-1 {row['stage1_fwd_bwd']:.3f} ms  device {_f3(row.get('fwd_device'))}"
                   f" / {_f3(row.get('fwd_bwd_device'))} ms  err {row['rel_err_vs_default']:.1e}")
            print(f"  tune B={row['B']} T={row['T']} {row['config']:12s} {msg}", flush=True)
            return
        if "error" in row:
            print(f"B={row['B']:2d} T={row['T']:6d} {row['case']:26s} ERROR {row['error']}",
                  flush=True)
            return
        chk = row.get("check")
        err = "" if not chk else \
            f"  err {max(chk['rel_err'].values()):.1e} vs {chk['against'].split()[0]}"
        fused = "" if "fused_kernel" not in row else f"  fused={row['fused_kernel']}"
        dev = "" if row.get("device_ms") is None else f" (device {row['device_ms']:.3f})"
        print(f"B={row['B']:2d} T={row['T']:6d} {row['case']:26s} {row['ms']:9.3f} ms{dev} "
              f"{row['peak_gib']:7.2f} GiB  floor {_f3(row.get('floor_ms'))} ms "
              f"({_f2(row.get('floor_fraction'))}){err}{fused}", flush=True)

    t0 = time.time()

    def write():  # after every shape: a run cut short by a time limit keeps what it measured
        res["seconds"] = round(time.time() - t0, 1)
        if backends.available("triton"):
            from hedgecats.models.ops.hybrid import kernels as th

            res["kernel_tile_retries"] = list(th.RETRIES)
            res["kernel_fallback_errors"] = list(th.FALLBACK_ERRORS)
        res["ratios"] = ratios(res["rows"])
        res["ratios_with_pytorch_phi"] = ratios(res["rows"], " [pytorch phi]")
        res["ratios_device_time"] = ratios(res["rows"], time_key="device_ms")
        res["targets"] = TARGETS
        (out / "attention_speed.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "attention_speed.md").write_text(markdown(res))
        plot(res, out / "attention_speed.png")
        changed = {n: v for n, v in (("switches", a.switches), ("tiles", a.tiles)) if v}
        update_summary(Path(a.summary) if a.summary else out / "summary.json", res["ratios"],
                       res["environment"], changed)

    with kernel_switches.applied(run_switches), default_tiles_changed(run_tiles):
        measure(a, res, log, write)
    print(json.dumps(res["ratios"], indent=1))
    return 0


def measure(a, res, log, write) -> None:
    """``main``'s rows, shape by shape, then its tile sweep (``--tune``), written as they
    come."""
    for shape in filter(None, a.shapes.split(",")):  # (--shapes "": the tile sweep only)
        B, T = map(int, shape.split("x"))
        try:
            run_shape(a, B, T, res, log)
        except Exception as e:  # out of memory building the inputs, say
            res["rows"].append({"B": B, "T": T, "case": "(shape)", "error": f"{e}"[:400]})
            print(f"B={B} T={T}: shape failed: {e}", flush=True)
        torch.cuda.empty_cache()
        write()
    # tile configurations last: each compiles its kernels anew, and the rows above come first
    if a.tune and backends.available("triton"):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
        names = None if a.tune_configs is None else a.tune_configs.split(",")
        for shape in a.tune_shapes.split(","):
            B, T = map(int, shape.split("x"))
            try:
                L = Layer(B, T, a.heads, a.kv_heads, a.head_dim, a.window, dtype, a.projection)
                res["tuning"].extend(tune(L, B, T, log, names))
                del L
            except Exception as e:
                res["tuning"].append({"B": B, "T": T, "config": "(shape)", "error": f"{e}"[:400]})
            torch.cuda.empty_cache()
            write()


def parse_tiles(spec: str) -> dict:
    """``--tiles``' "field=value,..." (``KernelConfig`` fields, values Python literals)."""
    fields = {f.name for f in dataclasses.fields(th.KernelConfig)}
    out = {}
    for item, name, value in kernel_switches.assignments(
            spec, "--tiles", "field=value (e.g. park_la=True)"):
        if name not in fields:
            raise ValueError(f"--tiles: {item!r} is not field=value of a KernelConfig field "
                             f"(e.g. park_la=True)")
        out[name] = value
    return out


@contextlib.contextmanager
def default_tiles_changed(changes: dict | None):
    """``triton_hybrid.default_config`` returning its tiles with ``changes`` inside (what the
    layer's call reaches: ``hybrid_kernel`` asks it when given no config)."""
    if not changes:
        yield
        return
    base = th.default_config

    @functools.lru_cache(maxsize=64)  # (one config a shape, as the default's: the host time
    def changed(D, F, dtype):  # of a call with changed tiles is the default's)
        return dataclasses.replace(base(D, F, dtype), **changes)

    th.default_config = changed
    try:
        yield
    finally:
        th.default_config = base


if __name__ == "__main__":
    sys.exit(main())
