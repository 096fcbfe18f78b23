"""``notebooks/01-component-ablation.ipynb`` runs on the results fixture and is stored clean."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01-component-ablation.ipynb"
RESULTS = ROOT / "tests" / "fixtures" / "eval" / "results"
RUNS = ("stage1_transfer", "stage2_hedgecats", "stage2_ssd")


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec for this interpreter in a private JUPYTER_PATH: nothing installed beforehand."""
    spec = tmp_path / "jupyter" / "kernels" / "hedgecats-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "hedgecats (test)", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    return "hedgecats-test"


def test_notebook_runs_on_the_fixture(kernel_env, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    figs = tmp_path / "figs"
    monkeypatch.setenv("HEDGECATS_RESULTS", ",".join(str(RESULTS / r) for r in RUNS))
    monkeypatch.setenv("HEDGECATS_FIGURES", str(figs))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name=kernel_env, timeout=120,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "3 runs: stage1_transfer, stage2_hedgecats, stage2_ssd" in text
    res = json.loads((RESULTS / "stage2_ssd" / "results.json").read_text())
    assert f"Delta_LA stage2_ssd: {res['delta_la']:+.2f} ± {res['delta_la_stderr']:.2f}" in text
    assert f"{res['modes']['hybrid']['avg']:.2f}±{res['modes']['hybrid']['avg_stderr']:.2f}" in text
    assert sorted(p.name for p in figs.iterdir()) == [
        "avg_by_run.png", "delta_la.png", "retrieval_by_distance.png"]
    assert all(not c.outputs for c in nbformat.read(NOTEBOOK, as_version=4).cells
               if c.cell_type == "code")


def test_notebook_runs_on_results_without_tasks(kernel_env, tmp_path, monkeypatch):
    """A probes-only results.json (``hedgecats evaluate --tasks none``: tasks [], AVG null) and
    no Delta_LA anywhere: the notebook still runs to the end and says what is missing."""
    from nbclient import NotebookClient

    res = json.loads((RESULTS / "stage2_ssd" / "results.json").read_text())
    probes = {"schema": res.get("schema"), "tasks": [], "baseline": None, "delta_la": None,
              "delta_la_stderr": None, "retrieval": res.get("retrieval"), "branch_usage": None,
              "modes": {m: {"mode": r.get("mode", m), "switches": r.get("switches", {}),
                            "tasks": {}, "avg": None, "avg_stderr": None}
                        for m, r in res["modes"].items()}, "meta": {}}
    (tmp_path / "probes").mkdir()
    (tmp_path / "probes" / "results.json").write_text(json.dumps(probes))
    monkeypatch.setenv("HEDGECATS_RESULTS", str(tmp_path / "probes" / "results.json"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, kernel_name=kernel_env, timeout=120,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "no tasks" in text and "no run has Delta_LA" in text
