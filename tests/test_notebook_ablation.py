"""``notebooks/01-component-ablation.ipynb`` runs on the results fixture and is stored clean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures.notebooks import execute, kernel_spec, stored_clean

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "01-component-ablation.ipynb"
RESULTS = ROOT / "tests" / "fixtures" / "eval" / "results"
RUNS = ("stage1_transfer", "stage2_hedgecats", "stage2_ssd")


def test_notebook_is_stored_without_outputs():
    assert stored_clean(NOTEBOOK)


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    return kernel_spec(tmp_path, monkeypatch)


def test_notebook_runs_on_the_fixture(kernel_env, tmp_path, monkeypatch):
    figs = tmp_path / "figs"
    monkeypatch.setenv("HEDGECATS_RESULTS", ",".join(str(RESULTS / r) for r in RUNS))
    monkeypatch.setenv("HEDGECATS_FIGURES", str(figs))
    text = execute(NOTEBOOK, tmp_path, kernel_env)
    assert "3 runs: stage1_transfer, stage2_hedgecats, stage2_ssd" in text
    res = json.loads((RESULTS / "stage2_ssd" / "results.json").read_text())
    assert f"Delta_LA stage2_ssd: {res['delta_la']:+.2f} ± {res['delta_la_stderr']:.2f}" in text
    assert f"{res['modes']['hybrid']['avg']:.2f}±{res['modes']['hybrid']['avg_stderr']:.2f}" in text
    assert sorted(p.name for p in figs.iterdir()) == [
        "avg_by_run.png", "delta_la.png", "retrieval_by_distance.png"]
    assert stored_clean(NOTEBOOK)


def test_notebook_runs_from_the_notebooks_folder_with_its_default_path(kernel_env, tmp_path,
                                                                      monkeypatch):
    """Jupyter starts the kernel in ``notebooks/``: the default ``results/*/results.json`` is
    found from the repository root (it was looked up in ``notebooks/``: a traceback)."""
    monkeypatch.delenv("HEDGECATS_RESULTS", raising=False)
    for r in RUNS:
        (tmp_path / "results" / r).mkdir(parents=True)
        shutil.copy(RESULTS / r / "results.json", tmp_path / "results" / r / "results.json")
    (tmp_path / "notebooks").mkdir()
    text = execute(NOTEBOOK, tmp_path / "notebooks", kernel_env)
    assert "3 runs: stage1_transfer, stage2_hedgecats, stage2_ssd" in text


def test_notebook_runs_on_results_without_tasks(kernel_env, tmp_path, monkeypatch):
    """A probes-only results.json (``hedgecats evaluate --tasks none``: tasks [], AVG null) and
    no Delta_LA anywhere: the notebook still runs to the end and says what is missing."""
    res = json.loads((RESULTS / "stage2_ssd" / "results.json").read_text())
    probes = {"schema": res.get("schema"), "tasks": [], "baseline": None, "delta_la": None,
              "delta_la_stderr": None, "retrieval": res.get("retrieval"), "branch_usage": None,
              "modes": {m: {"mode": r.get("mode", m), "switches": r.get("switches", {}),
                            "tasks": {}, "avg": None, "avg_stderr": None}
                        for m, r in res["modes"].items()}, "meta": {}}
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "results.json").write_text(json.dumps(probes))
    monkeypatch.setenv("HEDGECATS_RESULTS", str(tmp_path / "probes" / "results.json"))
    text = execute(NOTEBOOK, tmp_path, kernel_env)
    assert "no tasks" in text and "no run has Delta_LA" in text
