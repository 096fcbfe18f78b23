"""Where the fused kernel's time goes, kernel by kernel: the hybrid and each branch alone
(``has_swa`` / ``has_la``), forward and forward + backward, under the tile configurations of
``layer.TUNE_CONFIGS``, in one run; or (``--branches layer``) the whole layer as the model
runs it, feature maps and PyTorch's kernels included, beside the same layer with a candidate
change (``--tiles`` / ``--switches``: the row ``layer-changed``).

    python -m benchmarks.kernel_anatomy --shapes 8x1024 --configs default,recomputed --out DIR
    python -m benchmarks.kernel_anatomy --branches layer,layer-changed \
        --tiles save_branches=False --out DIR

Per shape (by default Llama-3-8B's heads: H 32 / Hkv 8 / D 128, square maps F 256; window 64;
bf16; q, k, v as views of (B, T, H, D); ``--heads 28 --kv-heads 4`` for Qwen2-7B's),
config and branch set: the output against the first config's (relative L2), the GPU time per
call with the host ahead (``timing.device_ms``), and a torch.profiler table of the kernels
over ``--calls`` calls (device ms per call; a kernel launched twice a call gets a row per
launch). In the kernel rows the feature maps are precomputed (not in the tables); the layer
rows have them. Writes ``kernel_anatomy.json`` and ``.md`` to --out. CUDA only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
from benchmarks import switches as kernel_switches
from hedgecats.models.ops.hybrid.function import hybrid_kernel
from hedgecats.models.ops.hybrid import reference as ref

from benchmarks.layer import (TUNE_CONFIGS, Layer, add_head_args, default_tiles_changed,
                              parse_tiles, rel, tile_config)
from benchmarks.timing import device_ms, environment

BRANCHES = {"hybrid": (True, True), "swa": (True, False), "la": (False, True)}
#: the branch set that times the whole layer as the model runs it (``Layer.hybrid``: both
#: feature maps folded into the kernel's autograd Function, the kernel at its default tiles,
#: the layer's (B, T, H, D) output): every kernel of a training step's attention
LAYER = "layer"
#: the same layer with ``--tiles`` / ``--switches`` set around its forward and backward
LAYER_CHANGED = "layer-changed"
#: the layer rows: the model's path; the maps as their own Functions, their outputs handed to
#: the kernel (``fold=False``); the model's path with the candidate change
LAYERS = {LAYER: dict(), "layer-unfolded": dict(fold=False), LAYER_CHANGED: dict()}


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


def layer_calls(L: Layer, branches: str, tiles: dict | None = None,
                switches: list | None = None):
    """(forward, forward + backward) of the layer row ``branches``; the ``layer-changed`` row
    runs both with ``tiles`` (``KernelConfig`` fields) and ``switches`` (parsed
    ``--switches``) set (a change may act in either: a forward tile, a backward switch)."""
    changed = branches == LAYER_CHANGED

    @contextlib.contextmanager
    def change():
        if not changed:
            yield
            return
        with default_tiles_changed(tiles), kernel_switches.applied(switches or []):
            yield

    def fwd():
        with change():
            return L.hybrid("fixed", **LAYERS[branches])

    def fwd_bwd():
        with change():
            fwd().backward(L.do)
        L.zero()
    return fwd, fwd_bwd


def anatomy(L: Layer, config: str, branches: str, calls: int, want: dict,
            tiles: dict | None = None, switches: list | None = None) -> dict:
    D = L.q.shape[-1]
    conf = tile_config(config, D, L.F, L.q.dtype)
    if branches in LAYERS:
        if config != "default":
            raise ValueError(f"the {branches!r} row runs the model's path, at the default tiles "
                             f"only (config 'default', not {config!r})")
        fwd, fwd_bwd = layer_calls(L, branches, tiles, switches)
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
        return hybrid_kernel(L.q, L.k, L.v, fq, fk, half, 1 - half, half, shift, window=L.w,
                             scale=L.scale, eps=ref.DEN_TINY, has_swa=has_swa, has_la=has_la,
                             config=conf)

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
                   help=f"comma-separated, of {', '.join(TUNE_CONFIGS)} (layer.TUNE_CONFIGS)")
    p.add_argument("--branches", default="hybrid,swa,la",
                   help=f"comma-separated, of {sorted(BRANCHES)} (the fused kernel alone, on "
                        f"precomputed maps) and {', '.join(LAYERS)} (the whole layer as the "
                        f"model runs it, maps included; config 'default' only)")
    p.add_argument("--tiles", default="", metavar="SPEC",
                   help=f"'field=value,...': KernelConfig fields changed in the "
                        f"{LAYER_CHANGED!r} row")
    p.add_argument("--switches", default="", metavar="SPEC",
                   help=f"'module.NAME=value,...': kernel switches set in the "
                        f"{LAYER_CHANGED!r} row")
    p.add_argument("--calls", type=int, default=10)
    add_head_args(p)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    configs, branches = a.configs.split(","), a.branches.split(",")
    try:
        tiles, switches = parse_tiles(a.tiles), kernel_switches.parse(a.switches, "--switches")
    except (ValueError, SyntaxError) as e:
        p.error(str(e))
    if LAYER_CHANGED in branches and not (tiles or switches):
        p.error(f"the {LAYER_CHANGED!r} row needs --tiles or --switches (what it changes)")
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
           "tiles": a.tiles, "switches": a.switches,
           "command": " ".join(["python", "-m", "benchmarks.kernel_anatomy"]
                              + (argv if argv is not None else sys.argv[1:]))}
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        L = Layer(B, T, a.heads, a.kv_heads, a.head_dim, a.window, torch.bfloat16, "square")
        want: dict = {}
        rows = []
        for c in configs:
            for b in branches:
                try:
                    row = anatomy(L, c, b, a.calls, want, tiles, switches)
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
