"""The GPU benchmark scripts run end to end on CPU in their ``--tiny`` smoke modes and write the
JSON, markdown and summary keys the issues name (the numbers themselves mean nothing on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_stage_speed_tiny(tmp_path):
    _run("stage_speed.py", "--tiny", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "stage_speed.json").read_text())
    names = {(r["name"], r["T"]) for r in res["rows"]}
    for T in (32, 64):
        for name in ("teacher_forward", "transfer/hybrid_output_mse", "transfer/lolcats_tt",
                     "finetune/hybrid", "finetune/softmax"):
            assert (name, T) in names, (name, T)
    assert ("transfer/weights_xent [blocked]", 32) in names
    assert ("transfer/la_output_mse", 32) in names
    errors = [r for r in res["rows"] if "error" in r]
    assert not errors, errors
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("transfer_xent_vs_teacher_forward", "transfer_mse_vs_teacher_forward",
                "lora_vs_softmax_lora", "transfer_vs_lolcats_T4k"):
        assert summary[key] > 0, key
    for key in ("transfer_peak_gib_over_teacher", "scaling_efficiency_transfer_2gpu",
                "scaling_efficiency_lora_2gpu", "gpu", "date"):
        assert key in summary
    assert "| finetune/softmax |" in (tmp_path / "stage_speed.md").read_text()


def test_attention_speed_tiny(tmp_path):
    _run("attention_speed.py", "--tiny", "--shapes", "2x64", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "attention_speed.json").read_text())
    cases = {r["case"] for r in res["rows"]}
    assert {"teacher", "teacher fwd", "swa", "hybrid fixed", "hybrid learned_head",
            "hybrid shared_norm", "hybrid fixed fwd", "lolcats T x T fixed",
            "lolcats T x T shared_norm"} <= cases
    errors = [r for r in res["rows"] if "error" in r]
    assert not errors, errors
    for r in res["rows"]:
        if "check" in r:  # bf16 on CPU against the fp32 oracle
            assert max(r["check"]["rel_err"].values()) < 2.5e-2, r
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("layer_vs_teacher_T1k", "layer_vs_teacher_T64k", "layer_fwd_vs_teacher_T1k",
                "layer_mem_vs_swa_T64k", "layer_vs_lolcats_T4k", "gpu", "date"):
        assert key in summary
