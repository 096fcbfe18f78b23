"""Tables of the GPU test matrix from the per-worker JSONL files that the GPU tests write when
``HEDGECATS_GPU_REPORT=DIR`` is set: the backend matrix (tests/test_backends_gpu.py, rows with a
``backend``) and the fused-kernel cases (tests/test_triton_kernels.py, rows with a ``test``).

    python scripts/gpu_tests_report.py DIR > gpu_tests.md       (or a .jsonl file)

Rows of a run cut by its time limit are all that were written; the header counts them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

GRADS = ("out", "dq", "dk", "dv", "dWq", "dWk")


def load(path: str) -> list[dict]:
    """The rows under ``path`` (a folder of JSONL files or one file); none where nothing was
    written (a run of tests that report no rows, or one cut before the first row)."""
    if not os.path.exists(path):
        return []
    files = sorted(glob.glob(os.path.join(path, "*.jsonl"))) if os.path.isdir(path) else [path]
    rows = []
    for name in files:
        with open(name) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def _fmt(errs: dict | None) -> str:
    return " | ".join(f"{errs[n]:.1e}" for n in GRADS) if errs else " | ".join("-" for _ in GRADS)


def _worst(d: dict | None) -> str:
    if not d:
        return ""
    n, e = max(d.items(), key=lambda kv: kv[1])
    return f"{e:.1e} ({n})"


def backend_tables(rows: list[dict]) -> list[str]:
    rows = sorted(rows, key=lambda r: (r["case"], r["dtype"], str(r["shape"]), r["backend"]))
    worst: dict = {}
    for r in rows:
        key = (r["backend"], r["dtype"])
        worst[key] = max(worst.get(key, 0.0), max(r["vs_reference_same_dtype"].values()))
    out = [f"## Backend matrix (tests/test_backends_gpu.py): {len(rows)} cases",
           "",
           "Relative L2 error of each backend against the reference run in the same dtype on the "
           "same inputs (output and gradients); the last two columns: the backend and the "
           "same-dtype reference against the fp32 reference.",
           "",
           "| backend | dtype | worst error vs same-dtype reference |", "| --- | --- | --- |"]
    out += [f"| {b} | {d.replace('torch.', '')} | {e:.1e} |" for (b, d), e in sorted(worst.items())]
    out += ["", "| case | dtype | B,H,Hkv,T,D,w | backend | " + " | ".join(GRADS)
            + " | max vs fp32 oracle | max ref-in-dtype vs oracle |",
            "|" + " --- |" * (len(GRADS) + 6)]
    for r in rows:
        oracle = r.get("vs_fp32_oracle")
        floor = r.get("reference_same_dtype_vs_oracle")
        tail = f"{max(oracle.values()):.1e} | {max(floor.values()):.1e}" if oracle else "- | -"
        shape = ",".join(map(str, r["shape"])) if isinstance(r["shape"], list) else r["shape"]
        out.append(f"| {r['case']} | {r['dtype'].replace('torch.', '')} | {shape} "
                   f"| {r['backend']} | {_fmt(r['vs_reference_same_dtype'])} | {tail} |")
    return out


def kernel_tables(rows: list[dict]) -> list[str]:
    # every kernel test reports test / case / shape / dtype; a row without one still renders
    rows = sorted(rows, key=lambda r: (r["test"], str(r.get("case")), str(r.get("shape")),
                                       str(r.get("dtype"))))
    out = [f"## Fused kernels (tests/test_triton_kernels.py): {len(rows)} cases", "",
           "| test | case | shape | dtype | fused | worst vs same-dtype ref | "
           "worst vs fp32 oracle | triton errors | s |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        same = r.get("vs_reference_same_dtype") or r.get("vs_blocked_same_dtype")
        retries = f" +{len(r['tile_retries'])} tile retries" if r.get("tile_retries") else ""
        case = f"{r.get('case')}{'-pad' if r.get('pad') else ''}"
        dtype = str(r.get("dtype")).replace("torch.", "")
        out.append(f"| {r['test']} | {case} | {r.get('shape')} | {dtype} | "
                   f"{r.get('fused_calls')} | {_worst(same)} | "
                   f"{_worst(r.get('vs_fp32_oracle'))} | {len(r.get('triton_errors') or [])}"
                   f"{retries} | {r.get('seconds')} |")
    msgs = sorted({m for r in rows
                   for m in (r.get("triton_errors") or []) + (r.get("tile_retries") or [])})
    if msgs:
        out += ["", "Triton errors and tile retries seen:", ""]
        out += ["- " + m.replace("\n", " ")[:400] for m in msgs]
    return out


def render(rows: list[dict]) -> str:
    parts = []
    backend = [r for r in rows if "backend" in r]
    kernel = [r for r in rows if "test" in r and "backend" not in r]
    if backend:
        parts += backend_tables(backend) + [""]
    if kernel:
        parts += kernel_tables(kernel) + [""]
    other = len(rows) - len(backend) - len(kernel)
    if other:
        parts.append(f"({other} rows of another format left out)")
    return "\n".join(parts) if parts else "no case reports"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="the report folder, or one .jsonl file")
    print(render(load(ap.parse_args(argv).path)))


if __name__ == "__main__":
    main()
