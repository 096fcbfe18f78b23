"""``notebooks/02-demo.ipynb`` and ``03-testbed.ipynb`` run headless on finished runs' output
files (``fixtures.finished_runs``: written by the real writers, nothing trained), from the
notebooks folder with their default paths, and are stored without outputs."""

from __future__ import annotations

import matplotlib
import pytest
from fixtures.finished_runs import write_demo_runs, write_testbed_runs
from fixtures.notebooks import execute, kernel_spec, stored_clean

matplotlib.use("Agg")
NOTEBOOKS = ("02-demo.ipynb", "03-testbed.ipynb")
FIGURES = ["branch_usage_by_layer.png", "recall_by_distance.png"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs(name):
    assert stored_clean(name)


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    monkeypatch.delenv("HEDGECATS_RUNS", raising=False)
    monkeypatch.setenv("HEDGECATS_FIGURES", str(tmp_path / "figs"))
    (tmp_path / "notebooks").mkdir()
    return kernel_spec(tmp_path, monkeypatch)


def test_demo_notebook_on_a_finished_demo_run(kernel_env, tmp_path):
    write_demo_runs(tmp_path)
    text = execute("02-demo.ipynb", tmp_path / "notebooks", kernel_env)
    assert "2 runs: tiny seed 0 (tiny), tiny seed 1 (tiny-s1)" in text
    assert "tiny: stage finetune, seeds 0, 1" in text
    assert "hybrid                 0.710 ± 0.014  0.990 ± 0.014" in text  # near, far over seeds
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == FIGURES


def test_testbed_notebook_on_finished_testbed_runs(kernel_env, tmp_path):
    write_testbed_runs(tmp_path)
    text = execute("03-testbed.ipynb", tmp_path / "notebooks", kernel_env)
    assert "3 runs: testbed-hedgecats seed 0" in text
    assert "testbed-hedgecats (2)" in text and "testbed-lolcats (1)" in text
    assert "testbed-hedgecats: stage transfer, seeds 0, 1" in text  # right after stage 1
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == FIGURES


# ----------------------------------------------------------------------------- the helpers
def test_recall_by_distance_draws_a_dot_per_seed_and_a_line_through_the_means(tmp_path):
    from hedgecats.evaluation.plots import load_pipeline_runs, recall_by_distance

    runs = load_pipeline_runs(write_demo_runs(tmp_path))
    ax = recall_by_distance(runs, modes=["hybrid"])[0]
    dots = [ln for ln in ax.lines if ln.get_linestyle() == "None"]
    means = [ln for ln in ax.lines if ln.get_linestyle() == "-"]
    assert len(dots) == 2 and all(len(d.get_xdata()) == 4 for d in dots)  # 2 seeds x 4 buckets
    assert len(means) == 1 and list(means[0].get_ydata()) == pytest.approx(
        [0.71, 0.98, 0.97, 0.96])


def test_missing_runs_and_runs_without_branch_usage_say_what_to_do(tmp_path):
    from hedgecats.evaluation.plots import (
        branch_usage_by_layer,
        expand_paths,
        load_pipeline_runs,
        notebook_root,
    )

    assert notebook_root(tmp_path / "notebooks") == tmp_path
    assert notebook_root(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match=r"nothing matches 'runs/tiny\*'.*HEDGECATS_RUNS"):
        expand_paths("runs/tiny*", tmp_path, env="HEDGECATS_RUNS")
    runs = load_pipeline_runs(write_testbed_runs(tmp_path)[2:])  # lolcats: no probes/
    with pytest.raises(ValueError, match="--tasks none --branch-usage"):
        branch_usage_by_layer(runs)
