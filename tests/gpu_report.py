"""The GPU tests' case reports: with ``HEDGECATS_GPU_REPORT=DIR`` set, each case's errors are
appended as a JSON line to ``DIR/<xdist worker>.jsonl`` (``scripts/gpu_tests_report.py``
turns the folder into tables). Used by tests/test_backends_gpu.py and tests/test_triton_kernels.py."""

from __future__ import annotations

import json
import os


def write_report(row: dict) -> None:
    folder = os.environ.get("HEDGECATS_GPU_REPORT")
    if not folder:
        return
    os.makedirs(folder, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(folder, f"{worker}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
