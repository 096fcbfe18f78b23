"""Where the fused kernel's time goes, kernel by kernel: the hybrid and each branch alone
(``has_swa`` / ``has_la``), forward and forward + backward, under tile configs of
``attention_speed.TUNE_CONFIGS``, in one run; or (``--branches layer``) the whole layer as the
model runs it, feature maps and PyTorch's kernels included.

    python benchmarks/kernel_anatomy.py --shapes 8x1024 --configs default,cs64 --out DIR

Per shape (by default Llama-3-8B's heads: H 32 / Hkv 8 / D 128, square maps F 256; window 64;
bf16; q, k, v as views of (B, T, H, D); ``--heads 28 --kv-heads 4`` for Qwen2-7B's),
config and branch set: the output against the first config's (relative L2), the GPU time per
call with the host ahead (``attention_speed.device_ms``), and a torch.profiler table of the
kernels over ``--calls`` calls (device ms per call; a kernel launched twice a call gets a row
per launch). In the kernel rows the feature maps are precomputed (not in the tables); the
``layer`` row has them. Writes ``kernel_anatomy.json`` and ``.md`` to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from attention_speed import (TUNE_CONFIGS, Layer, add_head_args, default_tiles_changed,
                             device_ms, environment, rel)
from hedgecats.models.ops.hybrid import reference as ref
from hedgecats.models.ops.hybrid import kernels as th

BRANCHES = {"hybrid": (True, True), "swa": (True, False), "la": (False, True)}
#: the branch set that times the whole layer as the model runs it (``Layer.hybrid``: both
#: feature maps, q and k handed on through them, the kernel at its default tiles, the layer's
#: (B, T, H, D) output): every kernel of a training step's attention, the maps' and PyTorch's
#: included
LAYER = "layer"
#: the branch sets that time the whole layer: the model's path (the maps folded into the
#: kernel's autograd Function, since session 20); the maps as their own Functions (before
#: session 20, for the A/B); that, with the q map's backward starting from dphi (``kernel_du``
#: off: before session 15)
LAYERS = {LAYER: dict(), "layer-unfolded": dict(fold=False),
          "layer-no-du": dict(fold=False, kernel_du=False)}
#: the whole layer with the default tiles changed (``KernelConfig`` fields), timed as the model
#: would run them: the backward's fused kernels (on by default for D 128 bf16 since session
#: 17) off, one at a time and both (the separate kernels, as before); ``_bwd_kv``'s program
#: order (``KernelConfig.kv_order``, 2 by default since session 18) 0 and 1; the state
#: kernels' sums as row reductions (``state_sums_mma`` off, on since session 18); both as in
#: session 17
LAYER_CHANGES = {"layer-fwd128": dict(block_m=128, block_n=64, warps=8,  # (the forward's tiles
                                     state_product_stages=0),  # before session 21)
                 "layer-no-fuse-q": dict(fuse_q_side=False),
                 "layer-no-fuse-kv": dict(fuse_kv_side=False),
                 "layer-unfused": dict(fuse_q_side=False, fuse_kv_side=False),
                 "layer-kv-order0": dict(kv_order=0), "layer-kv-order1": dict(kv_order=1),
                 "layer-sums-reduced": dict(state_sums_mma=False),
                 "layer-session17": dict(kv_order=0, state_sums_mma=False),
                 # the forward on 64-row, 4-warp programs that two can share a multiprocessor
                 # (ptxas, sm_90a, launch hints: 241-254 registers, 48-104 KB of shared memory
                 # against 254 / 192 KB at 128 x 64, 8 warps); stages 1 changes the backward
                 # kernels' pipelining too (``KernelConfig.stages``): read its forward only
                 "layer-fwd64-bn32": dict(block_m=64, block_n=32, warps=4),
                 "layer-fwd64-p2-bn32": dict(block_m=64, block_n=32, warps=4, pack_heads=2),
                 "layer-fwd64-bn32-ss2": dict(block_m=64, block_n=32, warps=4,
                                              state_product_stages=2),
                 "layer-fwd64-s1": dict(block_m=64, warps=4, stages=1),
                 "layer-fwd64-p2-s1": dict(block_m=64, warps=4, pack_heads=2, stages=1),
                 # those tiles over 2 query heads a program (32 positions; ptxas 254
                 # registers, 80 KB), the query-side backward kept at 4
                 "layer-fwd64-bn32-ss2-p2": dict(block_m=64, block_n=32, warps=4,
                                                 state_product_stages=2, pack_heads=2,
                                                 dq_pack_heads=4),
                 # the q map inside the no-grad forward's ``_fwd`` (``map_q_forward``, off by
                 # default: session 22 read it slower), and on 128 x 32 8-warp programs
                 # (ptxas: 254 registers, no spill, 144 KB: one a multiprocessor)
                 "layer-map-q": dict(map_q_forward=True),
                 "layer-map-q-fwd128x32": dict(map_q_forward=True, block_m=128, block_n=32,
                                               warps=8),
                 # LA states every 64 positions (128 by default): a forward program of 16
                 # positions then walks ~47 keys past its state instead of ~79 (2 key blocks
                 # fewer of 32), for twice the states (``_state_fwd``; the backward's too)
                 "layer-cs64": dict(state_chunk=64),
                 # the same for the no-grad forward alone (``forward_state_chunk``)
                 "layer-fwd-cs64": dict(forward_state_chunk=64),
                 # fq's rows loaded once by each forward program and held for the state's
                 # product and every key block's (``hold_fq``; ptxas 243-255 registers, no
                 # spill, 112 KB: still two programs a multiprocessor), grad or not
                 "layer-hold-fq": dict(hold_fq=True),
                 # with the maps' softmax normalised by a reciprocal per row too (its
                 # switch in LAYER_SWITCHES)
                 "layer-hold-fq-rcp": dict(hold_fq=True),
                 # ``_fwd``'s key-side tiles through tensor descriptors (``fwd_tma``; ptxas
                 # 254-255 registers, no spill, 82 KB: two programs a multiprocessor), alone
                 # and with the map pair on walking programs (its switches below)
                 "layer-fwd-tma": dict(fwd_tma=True),
                 "layer-fwd-tma-walk1-tma": dict(fwd_tma=True),
                 # session 25: more `_fwd` programs a multiprocessor. ptxas (sm_90a, the
                 # default's tiles, launch hints, no grad): the LA output parked in memory
                 # through the window's loop (``park_la``) 248 to 218 registers; capped at
                 # 168 (three 4-warp programs a multiprocessor) 4 B of spill, at 128 (four)
                 # 156 B; one pipeline stage (``fwd_stages``) 80 to 41 KB of shared memory
                 # (three need <= 75 KB; 16-key blocks at two stages take 56 KB, 4 B of spill
                 # at 168). Each against its controls: parked alone, one stage alone, parked
                 # at 168 with two stages (shared memory still two a multiprocessor)
                 "layer-park": dict(park_la=True),
                 "layer-fwd-s1": dict(fwd_stages=1),
                 "layer-park-r168": dict(park_la=True, fwd_maxnreg=168),
                 "layer-park-r168-s1": dict(park_la=True, fwd_maxnreg=168, fwd_stages=1),
                 "layer-park-r128-s1": dict(park_la=True, fwd_maxnreg=128, fwd_stages=1),
                 "layer-park-r168-bn16": dict(park_la=True, fwd_maxnreg=168, block_n=16),
                 # 128 rows (32 positions of 4 heads) on 8 warps, parked, capped at 128: two
                 # programs (16 warps) a multiprocessor at two stages (ptxas: 56 B of spill,
                 # 112 KB; uncapped 190 registers: one)
                 "layer-park-r128-bm128": dict(th.PARKED_FORWARD),
                 # session 24's defaults (with its switch below): the defaults again since
                 # session 25's call 2 (``triton_hybrid.DEFAULT_FORWARD``); there it ran
                 # against the candidates as defaults
                 "layer-s24": dict(th.TWO_PROGRAM_FORWARD),
                 "layer-r168-s1": dict(fwd_maxnreg=168, fwd_stages=1)}
#: the whole layer with a module switch of the kernels changed (module, attribute, value):
#: both maps' backward in one grid (``triton_phi.PAIR_BACKWARD``, off by default)
LAYER_SWITCHES = {"layer-maps-paired-bwd": ("triton_phi", "PAIR_BACKWARD", True),
                  "layer-s24": ("triton_phi", "WEIGHTS_IN_KERNEL", False),
                  # the maps' softmax normalised by a reciprocal per row (``RECIPROCAL_SOFTMAX``)
                  "layer-phi-rcp": ("triton_phi", "RECIPROCAL_SOFTMAX", True),
                  "layer-hold-fq-rcp": ("triton_phi", "RECIPROCAL_SOFTMAX", True),
                  # the maps' forward on 32-row 4-warp programs (``FORWARD_TILES``)
                  # (one program a block only: since session 24 the 8B's maps walk, and
                  # ``FORWARD_TILES`` no longer reaches their pair; ``layer-grid`` does)
                  "layer-phi32": ("triton_phi", "FORWARD_TILES", (32, 4)),
                  # the map pair rounding the fp32 weights in its kernel: no cast launches
                  # (``WEIGHTS_IN_KERNEL``; each program reads 64 KB of weight, not 32)
                  "layer-w-in-kernel": ("triton_phi", "WEIGHTS_IN_KERNEL", True),
                  # the map pair on walking programs (``FORWARD_WALK``: one a multiprocessor,
                  # through descriptors, ``FORWARD_TMA``; session 24's ``phi_bound.py``)
                  "layer-walk1-tma": [("triton_phi", "FORWARD_WALK", 1),
                                      ("triton_phi", "FORWARD_TMA", True)],
                  "layer-fwd-tma-walk1-tma": [("triton_phi", "FORWARD_WALK", 1),
                                              ("triton_phi", "FORWARD_TMA", True)],
                  "layer-walk1-tma-rcp": [("triton_phi", "FORWARD_WALK", 1),
                                          ("triton_phi", "FORWARD_TMA", True),
                                          ("triton_phi", "RECIPROCAL_SOFTMAX", True)],
                  # session 24's defaults taken back: the maps' softmax by divisions, the
                  # pair on one program a block, and both (the default before session 24)
                  "layer-div": ("triton_phi", "RECIPROCAL_SOFTMAX", False),
                  "layer-grid": ("triton_phi", "FORWARD_WALK", None),
                  "layer-grid-div": [("triton_phi", "FORWARD_WALK", None),
                                     ("triton_phi", "RECIPROCAL_SOFTMAX", False)]}
LAYERS.update({name: dict() for name in (*LAYER_CHANGES, *LAYER_SWITCHES)})


@contextlib.contextmanager
def switch_set(branches: str):
    """A context with ``LAYER_SWITCHES[branches]`` (one (module, attribute, value) or a list
    of them) set inside (nothing for other branch sets)."""
    switches = LAYER_SWITCHES.get(branches, [])
    if isinstance(switches, tuple):
        switches = [switches]
    with contextlib.ExitStack() as stack:
        for mod_name, attr, value in switches:
            stack.enter_context(mock.patch.object(
                importlib.import_module(f"hedgecats.models.ops.{mod_name}"), attr, value))
        yield


def per_launch(events: list[tuple[str, float, float]], calls: int) -> dict[str, float]:
    """Device ms per call of each kernel from ``(name, start_us, duration_us)`` events of
    ``calls`` identical calls. A kernel launched n > 1 times a call (``_bwd_dkv_la``'s dfk and
    dv launches) gets one row per launch, in launch order: ``name [i/n]``."""
    count: dict[str, int] = {}
    for name, _, _ in events:
        count[name] = count.get(name, 0) + 1
    seen: dict[str, int] = {}
    rows: dict[str, float] = {}
    for name, _, dur in sorted(events, key=lambda e: e[1]):
        n = max(count[name] // calls, 1)
        i = seen.get(name, 0)
        seen[name] = i + 1
        key = name if n == 1 or count[name] % calls else f"{name} [{i % n + 1}/{n}]"
        rows[key] = rows.get(key, 0.0) + dur / 1e3 / calls
    return {k: round(v, 4) for k, v in sorted(rows.items(), key=lambda kv: -kv[1])}


def kernel_table(fn, calls: int) -> dict[str, float]:
    """Device ms per call of each kernel ``fn`` launches (torch.profiler, ``calls`` calls;
    ``per_launch``)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [(e.name[:60], e.time_range.start, e.time_range.elapsed_us())
              for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.time_range.elapsed_us() > 0]
    return per_launch(events, calls)


def layer_calls(L: Layer, branches: str):
    """(forward, forward + backward) of the layer row ``branches``: its tile changes
    (``LAYER_CHANGES``) and module switch (``LAYER_SWITCHES``) set around the forward, the
    switch around the backward too (one may act in either: the maps' softmax reciprocal in
    the forward, their paired backward in the backward)."""
    def fwd():
        with default_tiles_changed(LAYER_CHANGES.get(branches)), switch_set(branches):
            return L.hybrid("fixed", **LAYERS[branches])

    def fwd_bwd():
        with switch_set(branches):
            fwd().backward(L.do)
        L.zero()
    return fwd, fwd_bwd


def anatomy(L: Layer, config: str, branches: str, calls: int, want: dict) -> dict:
    cfg = TUNE_CONFIGS[config]
    D = L.q.shape[-1]
    conf = th.default_config(D, L.F, L.q.dtype) if cfg is None else th.KernelConfig(**cfg)
    if branches in LAYERS:
        if cfg is not None:
            raise ValueError(f"the {branches!r} row runs the model's path, at the default tiles "
                             f"only (config 'default', not {config!r})")

        fwd, fwd_bwd = layer_calls(L, branches)
    else:
        fwd, fwd_bwd = _kernel_calls(L, conf, *BRANCHES[branches])

    def forward():
        with torch.no_grad():
            fwd()

    with torch.no_grad():
        out = fwd().float()
    row = {"config": config, "branches": branches, "tiles": conf.__dict__}
    if branches in want:
        row["rel_err_vs_first_config"] = float(f"{rel(out, want[branches]):.2e}")
    else:
        want[branches] = out
    for name, fn in (("forward", forward), ("fwd_bwd", fwd_bwd)):
        row[f"{name}_device_ms"] = round(device_ms(fn, 1.0)["device_ms"], 4)
        row[f"{name}_kernels"] = kernel_table(fn, calls)
    return row


def _kernel_calls(L: Layer, conf, has_swa: bool, has_la: bool):
    """(forward, forward + backward) of the fused kernel alone on precomputed feature maps."""
    fq = L.phi_q(L.q).detach().requires_grad_()
    fk = L.phi_k(L.k).detach().requires_grad_()
    B, H = L.q.shape[:2]
    half = torch.full((B, H), 0.5, device="cuda")
    shift = torch.full((B, H), L.w, device="cuda", dtype=torch.int32)

    def fwd():
        return th.hybrid_kernel(L.q, L.k, L.v, fq, fk, half, 1 - half, half, shift,
                                window=L.w, scale=L.scale, eps=ref.DEN_TINY, has_swa=has_swa,
                                has_la=has_la, config=conf)

    def fwd_bwd():
        fwd().backward(L.do.transpose(1, 2))
        L.q.grad = L.k.grad = L.v.grad = fq.grad = fk.grad = None
    return fwd, fwd_bwd


def markdown(res: dict) -> str:
    e = res["environment"]
    lines = [f"# kernel_anatomy ({e['gpu']}, {e['date']})", "", f"`{res['command']}`", "",
             f"H {res['heads']} / Hkv {res['kv_heads']} / D {res['head_dim']}, window "
             f"{res['window']}, bf16.", "",
             f"torch {e['torch']}, triton {e['triton']}. Device ms per call; kernels from "
             f"torch.profiler over {res['calls']} calls.", ""]
    for shape in res["shapes"]:
        for phase in ("forward", "fwd_bwd"):
            rows = shape["rows"]
            cols = [f"{r['config']} / {r['branches']}" for r in rows]
            names = []
            for r in rows:
                names += [k for k in r.get(f"{phase}_kernels", {}) if k not in names]
            lines += [f"## {shape['B']} x {shape['T']}, {phase.replace('_', ' + ')}", "",
                      "| kernel | " + " | ".join(cols) + " |",
                      "| --- |" + " ---: |" * len(cols)]
            lines.append("| **total (device_ms)** | " + " | ".join(
                f"**{r[f'{phase}_device_ms']:.3f}**" if f"{phase}_device_ms" in r
                else r.get("error", "-")[:60] for r in rows) + " |")
            for n in names:
                lines.append(f"| `{n}` | " + " | ".join(
                    f"{r.get(f'{phase}_kernels', {}).get(n, 0):.3f}" for r in rows) + " |")
            lines.append("")
        errs = [f"{r['config']} / {r['branches']}: {r['rel_err_vs_first_config']:.1e}"
                for r in shape["rows"] if "rel_err_vs_first_config" in r]
        if errs:
            lines += ["Output against the first config's: " + "; ".join(errs), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8x1024")
    p.add_argument("--configs", default="default",
                   help="comma-separated names of attention_speed.TUNE_CONFIGS")
    p.add_argument("--branches", default="hybrid,swa,la",
                   help=f"comma-separated, of {sorted(BRANCHES)} (the fused kernel alone, on "
                        f"precomputed maps) and {LAYER!r} (the whole layer as the model runs it, "
                        f"maps included; config 'default' only; 'layer-no-du': it with the q "
                        f"map's backward from dphi; {', '.join(LAYER_CHANGES)}: it with the "
                        f"default tiles changed: the backward's fused kernels off, _bwd_kv's "
                        f"program order 0 or 1, the state sums as row reductions, "
                        f"session 17's tiles)")
    p.add_argument("--calls", type=int, default=10)
    add_head_args(p)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    configs, branches = a.configs.split(","), a.branches.split(",")
    if a.heads % a.kv_heads:
        p.error(f"--heads {a.heads} is not a multiple of --kv-heads {a.kv_heads}")
    for c in configs:
        if c not in TUNE_CONFIGS:
            p.error(f"unknown config {c!r}; known: {', '.join(TUNE_CONFIGS)}")
    for b in branches:
        if b not in BRANCHES and b not in LAYERS:
            p.error(f"unknown branch set {b!r}; known: {', '.join([*BRANCHES, *LAYERS])}")
    if any(b in LAYERS for b in branches) and configs != ["default"]:
        p.error(f"--branches {'/'.join(LAYERS)} run the model's path at the default tiles: use "
                f"them with --configs default alone")
    res = {"environment": environment(), "calls": a.calls, "shapes": [], "heads": a.heads,
           "kv_heads": a.kv_heads, "head_dim": a.head_dim, "window": a.window,
           "command": " ".join(["python", "benchmarks/kernel_anatomy.py"]
                              + (argv if argv is not None else sys.argv[1:]))}
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        L = Layer(B, T, a.heads, a.kv_heads, a.head_dim, a.window, torch.bfloat16, "square")
        want: dict = {}
        rows = []
        for c in configs:
            for b in branches:
                try:
                    row = anatomy(L, c, b, a.calls, want)
                except Exception as e:  # a failed config is a row, not the end of the run
                    row = {"config": c, "branches": b, "error": f"{type(e).__name__}: {e}"[:300]}
                print(json.dumps({k: v for k, v in row.items() if "kernels" not in k}),
                      flush=True)
                rows.append(row)
        res["shapes"].append({"B": B, "T": T, "rows": rows})
        del L
        torch.cuda.empty_cache()
    md = markdown(res)
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernel_anatomy.json").write_text(json.dumps(res, indent=1))
        (out / "kernel_anatomy.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
