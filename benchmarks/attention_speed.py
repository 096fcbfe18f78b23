"""One attention layer on the GPU, every path the issue compares: time, memory, correctness.

    python -m benchmarks.attention_speed --out DIR                          # all lengths
    python -m benchmarks.attention_speed --shapes 8x1024,2x4096 --out DIR
    python -m benchmarks.attention_speed --tiny --out DIR                   # CPU smoke run

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
import json
import re
import sys
import time
import traceback
from pathlib import Path

import torch
from benchmarks import switches as kernel_switches
from hedgecats.models.ops.hybrid import backends
from hedgecats.models.ops.hybrid.function import hybrid_kernel
from hedgecats.models.ops.hybrid import reference as ref
from hedgecats.models.ops.instrument import TRACE

from benchmarks import timing
from benchmarks.layer import (Layer, TUNE_CONFIGS, add_head_args, default_tiles_changed,
                              parse_tiles, rel, step_fwd, step_fwd_bwd, tile_config)
from benchmarks.summary import update_summary
from benchmarks.timing import bench_adaptive, device_ms, environment

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
    have_triton = backends.available("triton")

    def pieces(mixer="fixed"):
        be = ("reference" if timing.DEVICE == "cpu" else
              "fla" if backends.available("fla") else "flex")
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
    # other row's peak memory holds it), on the fused kernel and through the pieces
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
                    c0 = TRACE.calls["hybrid.forward"]
                    fwd()
                    row["fused_kernel"] = TRACE.calls["hybrid.forward"] > c0
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


def tune(L: Layer, B, T, log, names: list[str] | None = None) -> list[dict]:
    """The fused kernel alone (precomputed feature maps, fixed g) under ``TUNE_CONFIGS``."""
    fq = L.phi_q(L.q).detach().requires_grad_()
    fk = L.phi_k(L.k).detach().requires_grad_()
    B_, H, T_, D = L.q.shape
    ones = torch.full((B, H), 0.5, device=timing.DEVICE)
    shift = torch.full((B, H), L.w, device=timing.DEVICE, dtype=torch.int32)
    out_rows = []
    want = want_grads = None
    for name in TUNE_CONFIGS:
        if names is not None and name not in names:
            continue
        row = {"B": B, "T": T, "config": name, "tiles": TUNE_CONFIGS[name]}
        try:
            conf = tile_config(name, D, L.F, L.q.dtype)
            row["tiles"] = conf.__dict__

            def fwd(q=L.q, k=L.k, v=L.v):
                return hybrid_kernel(q, k, v, fq, fk, ones, 1 - ones, ones, shift, window=L.w,
                                     scale=L.scale, eps=ref.DEN_TINY, config=conf)
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
    p.add_argument("--out", required=True, help="folder for attention_speed.{json,md,png}")
    p.add_argument("--summary", default=None,
                   help="the summary to merge the ratios into (default <out>/summary.json; "
                   "benchmarks/results/summary.json is the summary of record)")
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run of this script: tiny shapes, host clock (numbers mean "
                   "nothing)")
    p.add_argument("--plot", metavar="JSON", default=None,
                   help="only draw attention_speed.png in --out from an attention_speed.json")
    p.add_argument("--switches", default="", metavar="SPEC",
                   help="kernel switches set for the whole run, 'module.NAME=value,...' "
                   "(modules of hedgecats.models.ops, e.g. feature_map.kernels.NAME=True): an "
                   "option measured as it would run as the default; recorded in the JSON")
    p.add_argument("--tiles", default="", metavar="SPEC",
                   help="the default kernel config's fields changed for the whole run, "
                   "'field=value,...' (KernelConfig fields, e.g. save_branches=False), in "
                   "every shape's and dtype's default config; recorded in the JSON")
    a = p.parse_args(argv)
    try:
        run_switches = kernel_switches.parse(a.switches, "--switches")
        run_tiles = parse_tiles(a.tiles)
    except (ValueError, SyntaxError) as e:
        p.error(str(e))
    if (run_switches or run_tiles) and a.summary:
        p.error("--summary holds the defaults' ratios: a run with "
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
    if a.tiny:
        timing.DEVICE = "cpu"
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
    cmd = ["python", "-m", "benchmarks.attention_speed", *(argv or sys.argv[1:])]
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
            res["kernel_tile_retries"] = list(TRACE.retries)
            res["kernel_fallback_errors"] = list(TRACE.fallbacks)
        res["ratios"] = ratios(res["rows"])
        res["ratios_with_pytorch_phi"] = ratios(res["rows"], " [pytorch phi]")
        res["ratios_device_time"] = ratios(res["rows"], time_key="device_ms")
        res["targets"] = TARGETS
        (out / "attention_speed.json").write_text(json.dumps(res, indent=1) + "\n")
        (out / "attention_speed.md").write_text(markdown(res))
        plot(res, out / "attention_speed.png")
        changed = {n: v for n, v in (("switches", a.switches), ("tiles", a.tiles)) if v}
        device = {f"{k}_device": v for k, v in res["ratios_device_time"].items()
                  if k != "layer_mem_vs_swa_T64k"}  # (memory: the same in both)
        env = res["environment"]
        update_summary(Path(a.summary) if a.summary else out / "summary.json",
                       {**res["ratios"], **device}, f"attention_speed {env['date']}",
                       {"file": str(out / "attention_speed.json"), "command": res["command"],
                        "machine": env["gpu"], "date": env["date"]}, changed)

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



if __name__ == "__main__":
    sys.exit(main())
