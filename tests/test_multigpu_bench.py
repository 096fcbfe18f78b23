"""benchmarks.multigpu on CPU (gloo, tiny model): FSDP2 at world sizes 1 and 2 gives the same
losses, resumes a sharded checkpoint, and its stage checkpoint loads on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_one_vs_two_processes(tmp_path):
    command = [sys.executable, "-m", "benchmarks.multigpu"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for ws in (1, 2):
        subprocess.run([*command, "run", "--tiny", "--devices", str(ws), "--steps", "3",
                        "--warmup", "1", "--out", str(tmp_path)],
                       check=True, timeout=600, capture_output=True, cwd=tmp_path, env=env)
    subprocess.run([*command, "summarize", "--tiny", "--out", str(tmp_path)],
                   check=True, timeout=300, capture_output=True, cwd=tmp_path, env=env)
    summary = json.loads((tmp_path / "multigpu.json").read_text())
    for stage in ("attention_transfer", "hybrid_finetune"):
        two = summary["world_sizes"]["2"][stage]
        assert two["max_abs_loss_diff_vs_ws1"] < 1e-4, stage
    resume = summary["world_sizes"]["2"]["hybrid_finetune"]["resume"]
    assert (resume["from_step"], resume["to_step"]) == (3, 5)
    assert summary["stage_checkpoint_on_one_device"]["tensors"] > 0
