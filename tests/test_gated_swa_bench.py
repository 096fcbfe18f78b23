"""experiments.gated_swa on CPU (--tiny): every variant in-process, then the GPU's way (each
run a subprocess, the package imported through a symlink to src/ as on the device machine), and
the merge of two reports into one over seeds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import gated_swa

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return gated_swa


def test_every_variant_trains_and_is_reported(tmp_path):
    bench = _bench()
    assert bench.main(["--tiny", "--out", str(tmp_path / "a"), "--work", str(tmp_path / "w")]) == 0
    res = json.loads((tmp_path / "a" / "gated_swa.json").read_text())
    runs = {r["variant"]: r for r in res["runs"]}
    assert list(runs) == list(bench.VARIANTS) and not any("error" in r for r in res["runs"])
    arch = {k: r["architecture"] for k, r in runs.items()}
    assert arch["full"]["model_class"] == "LlamaForCausalLM"
    assert arch["swa_small"]["config"]["layer_windows"] == [8, None]
    assert arch["swa_large_gate"]["config"]["layer_windows"] == [60, None]
    assert arch["swa_small_gate"]["parameters"]["gates"] > 0
    assert arch["swa_small"]["parameters"]["gates"] == 0
    assert arch["swa_large_lowrank"]["parameters"]["gates"] < \
        arch["swa_large_gate"]["parameters"]["gates"]
    assert arch["swa_large_prope_lowrank"]["rotary_dim"] == 8 == arch["full"]["head_dim"] // 2
    for r in runs.values():
        assert r["steps"] == 6 and not r["stopped_early"] and r["reload_max_abs_diff"] == 0.0
        assert [h["step"] for h in r["history"]] == list(range(1, 7))  # every 10% of 6 steps
        assert {"downstream/recall/d60-80/acc", "downstream/mc_near/acc",
                "downstream/mc_far/acc"} <= set(r["final"])
        assert len(r["doc_loss"]) == 16  # one per probe document (--tiny: 16, marker task)
    md = (tmp_path / "a" / "gated_swa.md").read_text()
    summary_table, per_run = md.split("## Every run")
    assert summary_table.count("\n| swa_") == 6 and per_run.count("\n| swa_") == 6
    assert "| smaller window (no gate): swa_small - swa_large |" in md
    assert len(res["summary"]["deltas"]) == 7


@pytest.mark.slow  # (~11 s, two processes: make test-all)
def test_runs_as_processes_and_reports_merge(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "hedgecats").symlink_to(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT)]),
           "OUT": str(tmp_path / "b"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.gated_swa", "--tiny", "--parallel", "2", "--seeds", "1",
         "--variants", "swa_large_prope_lowrank", "--work", str(tmp_path / "w")],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "b" / "gated_swa.json").read_text())
    assert [(r["variant"], r["seed"]) for r in res["runs"]] == [("swa_large_prope_lowrank", 1)]
    assert res["runs"][0]["reload_max_abs_diff"] == 0.0  # registered in the worker process too
    assert "==== swa_large_prope_lowrank seed 1" in (tmp_path / "b" / "gated_swa.log").read_text()
    # a second report of the same settings (another seed), merged into one with mean +- std
    bench = _bench()
    bench.main(["--tiny", "--variants", "swa_large_prope_lowrank", "--out", str(tmp_path / "c"),
                "--work", str(tmp_path / "w")])
    bench.main(["--merge", str(tmp_path / "b" / "gated_swa.json"),
                str(tmp_path / "c" / "gated_swa.json"), "--out", str(tmp_path / "m")])
    merged = json.loads((tmp_path / "m" / "gated_swa.json").read_text())
    assert merged["summary"]["rows"]["swa_large_prope_lowrank"]["seeds"] == [0, 1]
    md = (tmp_path / "m" / "gated_swa.md").read_text()
    row = md.split("| swa_large_prope_lowrank |")[1].split("\n")[0]
    # seeds column 2, the loss as "mean (seed 0, seed 1)", learned counts out of 2
    cells = [c.strip() for c in row.split("|")]
    assert cells[4] == "2" and "(" in cells[5] and cells[-3].endswith("of 2")
    per_run = md.split("## Every run")[1]
    assert per_run.count("| swa_large_prope_lowrank |") == 2
    assert (tmp_path / "m" / "gated_swa_curves.png").stat().st_size > 10_000


def test_learned_at_is_the_first_evaluation_at_the_threshold():
    bench = _bench()
    run = {"history": [{"step": 10, "downstream/recall/d3-63/acc": 0.1},
                       {"step": 20, "downstream/recall/d3-63/acc": bench.LEARNED},
                       {"step": 30, "downstream/recall/d3-63/acc": 0.2},
                       {"step": 40, "downstream/recall/d3-63/acc": 0.9}]}
    assert bench.learned_at(run, "d3-63") == 20  # the first crossing, even if it falls back
    assert bench.learned_at(run, "d256-400") is None  # never evaluated: never learned
    run["history"][1]["downstream/recall/d3-63/acc"] = bench.LEARNED - 1e-6
    assert bench.learned_at(run, "d3-63") == 40
