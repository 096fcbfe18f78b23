"""One results.json schema: the notebook's / report's reader reads what ``hedgecats pipeline``
writes (its recall evaluation) as well as what ``hedgecats evaluate`` writes."""

from __future__ import annotations

import json

import pytest
from hedgecats.data.recall_bytes import make_recall_corpus
from hedgecats.evaluation.lm_eval_bridge import TaskScore
from hedgecats.evaluation.plots import load_runs, retrieval_curves
from hedgecats.evaluation.recall import recall_summary
from hedgecats.evaluation.report import RESULTS_SCHEMA, build_results, read_results


def _row(far_acc: float) -> dict:
    return {"lm_loss": 2.0, "near_loss": 0.1, "near_acc": 0.9, "far_loss": 1.0,
            "far_acc": far_acc, "n_near": 4, "n_far": 4, "acc_near": 0.9}


def _pipeline_results(tmp_path, several: bool) -> dict:
    """What ``run_pipeline`` writes: the summary plus ``recall_summary`` (the same function)."""
    corpus = make_recall_corpus(4, 64, near_max=7, far_min=16, far_max=40, seed=0)
    rows = {"teacher": _row(0.8), "hybrid": _row(0.5), "swa_only (rescale)": _row(0.0)}
    one = recall_summary(rows, corpus, stage="finetune", checkpoint="x/stage.pt", window=8,
                         device="cpu", precision="32")
    summary = {"schema": RESULTS_SCHEMA, "pipeline": "tiny", "output": str(tmp_path), "seed": 0}
    if several:
        summary["evaluations"] = [{"kind": "recall", **one, "stage": "transfer"},
                                  {"kind": "command", "stage": None, "command": ["x"]},
                                  {"kind": "recall", **one}]
    else:
        summary.update(one)
    return summary


@pytest.mark.parametrize("several", [False, True], ids=["one-evaluation", "evaluations-list"])
def test_reader_reads_a_pipeline_results_json(tmp_path, several):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_pipeline_results(run, several)))
    res = read_results(run)
    assert len(res["recall"]) == (2 if several else 1)
    key = "finetune: hybrid" if several else "hybrid"
    assert res["modes"][key]["mode"] == "hybrid"
    assert res["modes"][key]["recall"]["far_acc"] == 0.5
    label = "finetune: swa_only (rescale)" if several else "swa_only (rescale)"
    assert res["modes"][label]["mode"] == "swa_only"
    assert res["modes"]["finetune: teacher" if several else "teacher"]["mode"] == "softmax"
    [(name, loaded)] = load_runs([run / "results.json"])  # the notebook's reader
    assert name == "run" and loaded["modes"] == res["modes"]
    with pytest.raises(ValueError, match="no run has a retrieval section"):
        retrieval_curves([(name, loaded)])  # read, and nothing of evaluate's to plot


def test_reader_reads_an_evaluate_results_json_and_rejects_others(tmp_path):
    res = build_results([{"hybrid": {"piqa": TaskScore("acc", 50.0, 1.0, 10)}}], ["piqa"])
    assert res["schema"] == RESULTS_SCHEMA
    (tmp_path / "results.json").write_text(json.dumps(res))
    back = read_results(tmp_path)
    assert back["modes"]["hybrid"]["avg"] == 50.0 and back["recall"] == []
    legacy = {k: v for k, v in res.items() if k != "schema"}  # written before the field
    (tmp_path / "results.json").write_text(json.dumps(legacy))
    assert read_results(tmp_path)["modes"].keys() == {"hybrid"}
    (tmp_path / "results.json").write_text(json.dumps({"schema": "hedgecats.results/9"}))
    with pytest.raises(ValueError, match="hedgecats.results/9"):
        read_results(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"x": 1}))
    with pytest.raises(ValueError, match="not a hedgecats results.json"):
        read_results(tmp_path)
