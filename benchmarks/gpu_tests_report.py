"""Table of the GPU test matrix's errors from the per-worker JSONL files that
tests/test_backends_gpu.py writes when HEDGECATS_GPU_REPORT=DIR is set.

    python benchmarks/gpu_tests_report.py DIR > gpu_tests.md
"""

from __future__ import annotations

import argparse
import glob
import json
import os

GRADS = ("out", "dq", "dk", "dv", "dWq", "dWk")


def load(folder: str) -> list[dict]:
    rows = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: (r["case"], r["dtype"], r["shape"], r["backend"]))


def fmt(errs: dict | None) -> str:
    return " | ".join(f"{errs[n]:.1e}" for n in GRADS) if errs else " | ".join("-" for _ in GRADS)


def table(rows: list[dict]) -> str:
    head = ("| case | dtype | B,H,Hkv,T,D,w | backend | "
            + " | ".join(GRADS) + " | max vs fp32 oracle | max ref-in-dtype vs oracle |")
    lines = [head, "|" + " --- |" * (len(GRADS) + 6)]
    for r in rows:
        oracle = r.get("vs_fp32_oracle")
        floor = r.get("reference_same_dtype_vs_oracle")
        tail = (f"{max(oracle.values()):.1e} | {max(floor.values()):.1e}" if oracle else "- | -")
        lines.append(
            f"| {r['case']} | {r['dtype'].replace('torch.', '')} | {','.join(map(str, r['shape']))} "
            f"| {r['backend']} | {fmt(r['vs_reference_same_dtype'])} | {tail} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    rows = load(ap.parse_args().folder)
    worst = {}
    for r in rows:
        key = (r["backend"], r["dtype"])
        worst[key] = max(worst.get(key, 0.0), max(r["vs_reference_same_dtype"].values()))
    print(f"{len(rows)} cases. Relative L2 error of each backend against the reference run in "
          "the same dtype on the same inputs (output and gradients); the last two columns: "
          "the backend and the same-dtype reference against the fp32 reference.\n")
    print("| backend | dtype | worst error vs same-dtype reference |\n| --- | --- | --- |")
    for (b, d), e in sorted(worst.items()):
        print(f"| {b} | {d.replace('torch.', '')} | {e:.1e} |")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
