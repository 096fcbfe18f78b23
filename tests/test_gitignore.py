"""The README's output directories (``runs/``, ``out/``, ``results/``) at the repository root
are ignored by git; the curated results folders elsewhere are not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ignored(path: str) -> bool:
    out = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode in (0, 1), out.stderr
    return out.returncode == 0


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="needs a git checkout")
def test_outputs_of_the_readmes_commands_are_ignored_and_curated_results_are_not():
    for path in ("runs/tiny/results.json", "out/my-hybrid/config.json",
                 "results/hedgecats-mistral/results.json"):
        assert _ignored(path), path
    for path in ("benchmarks/results/summary.json", "experiments/results/demo.json",
                 "tests/fixtures/eval/results/stage2_ssd/results.json"):
        assert not _ignored(path), path
