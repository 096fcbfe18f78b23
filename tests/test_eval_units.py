"""Mode-spec syntax, table arithmetic, metric choice and local task resolution (no model)."""

from __future__ import annotations

import math

import pytest
from fixtures.eval.support import write_tasks
from hedgecats.evaluation import metrics
from hedgecats.evaluation.ablation import ModeSpec, parse_modes
from hedgecats.evaluation.lm_eval_bridge import (
    TaskScore,
    metric_for,
    parse_metric_overrides,
    resolve_tasks,
)
from hedgecats.evaluation.report import build_results, format_markdown


@pytest.mark.parametrize("text, mode, switches", [
    ("hybrid", "hybrid", {}),
    ("la_only+rescale", "la_only", {"rescale": True}),
    ("la_only+rescale=false+la_span=all", "la_only", {"rescale": False, "la_span": "all"}),
    ("hybrid+overlap", "hybrid", {"overlap": True}),
    ("swa_only+window=128", "swa_only", {"window": 128}),
    ("sinks_only+n_sinks=4", "sinks_only", {"n_sinks": 4}),
    (" softmax ", "softmax", {}),
])
def test_mode_spec_parses(text, mode, switches):
    spec = ModeSpec.parse(text)
    assert (spec.label, spec.mode, spec.switches) == (text.strip(), mode, switches)


@pytest.mark.parametrize("text, message", [
    ("hybird", "unknown mode 'hybird'"),
    ("la_only+span=all", "unknown switch 'span'"),
    ("hybrid+la_span=all", "no effect in mode 'hybrid'"),
    ("none+rescale", "no effect in mode 'none'"),
    ("swa_only+overlap", "no effect in mode 'swa_only'"),
    ("la_only+la_span=inside", "la_span"),
    ("swa_only+window=-3", "integer >= 1"),
    ("swa_only+window", "integer >= 1"),
    ("la_only+rescale=maybe", "true/false"),
    ("la_only+rescale+rescale", "given twice"),
])
def test_mode_spec_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        ModeSpec.parse(text)


def test_parse_modes_list():
    assert [s.label for s in parse_modes("hybrid, swa_only,la_only+la_span=all")] == [
        "hybrid", "swa_only", "la_only+la_span=all"]
    with pytest.raises(ValueError, match="more than once"):
        parse_modes("hybrid,hybrid")
    with pytest.raises(ValueError, match="no modes"):
        parse_modes(" , ")


def test_metric_arithmetic_by_hand():
    assert metrics.avg([40.0, 50.0, 66.0]) == pytest.approx(52.0)
    assert metrics.avg_stderr([3.0, 4.0]) == pytest.approx(2.5)  # sqrt(9 + 16) / 2
    assert metrics.avg_stderr([3.0, None]) is None
    r, se = metrics.rec_perf(50.0, 40.0, 1.0, 2.0)
    assert r == pytest.approx(125.0)
    assert se == pytest.approx(125.0 * math.sqrt((1 / 50) ** 2 + (2 / 40) ** 2))
    d, se = metrics.delta(65.48, 65.56, 0.3, 0.4)
    assert d == pytest.approx(-0.08) and se == pytest.approx(0.5)
    # paired: differences 100*(1-0), 0, 0, 100*(0-1) -> sd = sqrt(2/3)*100, se = sd / 2
    a, b = {1: 1.0, 2: 1.0, 3: 0.0, 4: 0.0}, {1: 0.0, 2: 1.0, 3: 0.0, 4: 1.0}
    assert metrics.paired_delta_stderr([a], [b]) == pytest.approx(100 * math.sqrt(2 / 3) / 2)
    assert metrics.paired_delta_stderr([a, a], [b, b]) == pytest.approx(
        math.sqrt(2) * 100 * math.sqrt(2 / 3) / 2 / 2)
    assert metrics.paired_delta_stderr([a], [{1: 0.0}]) is None  # not the same documents
    assert metrics.paired_delta_stderr([None], [b]) is None
    s = metrics.seed_summary([1.0, 2.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == pytest.approx(1.0)
    assert s["ci95"] == pytest.approx([2.0 - 4.303 / math.sqrt(3), 2.0 + 4.303 / math.sqrt(3)])
    assert metrics.seed_summary([5.0])["std"] is None
    with pytest.raises(ValueError):
        metrics.rec_perf(1.0, 0.0)


def test_build_results_paper_numbers():
    """The paper's Mistral row: hybrid 65.48, SWA-only 65.56 -> Delta_LA -0.08."""
    def row(*scores):
        return {t: TaskScore("acc", s, 1.0) for t, s in zip(("a", "b"), scores)}

    res = build_results([{"hybrid": row(65.0, 65.96), "swa_only": row(66.0, 65.12)}], ["a", "b"],
                        baseline=row(68.0, 68.52), baseline_source="original")
    assert res["modes"]["hybrid"]["avg"] == pytest.approx(65.48)
    assert res["modes"]["swa_only"]["avg"] == pytest.approx(65.56)
    assert res["delta_la"] == pytest.approx(-0.08)
    assert res["modes"]["hybrid"]["rec_perf"] == pytest.approx(65.48 / 68.26 * 100)
    assert res["modes"]["hybrid"]["avg_stderr"] == pytest.approx(math.sqrt(2) / 2)
    assert res["delta_la_stderr"] == pytest.approx(1.0)  # hypot(0.707, 0.707)
    md = format_markdown(res)
    assert "| hybrid | 65.00 ± 1.00 | 65.96 ± 1.00 | 65.48 ± 0.71 | 95.93 ± 1.44 |" in md
    assert "= -0.08 ± 1.00 points" in md and "not a finding" in md


def test_metric_choice():
    entry = {"alias": "x", "acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.6,
             "acc_norm_stderr,none": 0.1}
    assert metric_for("arc_challenge", entry) == "acc_norm"
    assert metric_for("hellaswag", entry) == "acc_norm"
    assert metric_for("piqa", entry) == "acc"
    assert metric_for("piqa", entry, {"piqa": "acc_norm"}) == "acc_norm"
    assert metric_for("mine", {"acc_norm,none": 0.3}) == "acc_norm"
    with pytest.raises(ValueError, match="reports no metric 'f1'"):
        metric_for("mine", entry, {"mine": "f1"})
    assert parse_metric_overrides(["a=acc_norm", " b = acc "]) == {"a": "acc_norm", "b": "acc"}
    with pytest.raises(ValueError, match="TASK=METRIC"):
        parse_metric_overrides(["acc_norm"])


def test_resolve_local_tasks(tmp_path):
    write_tasks(tmp_path / "t", n_docs=2)
    sel = resolve_tasks([str(tmp_path / "t")])
    assert sel.names == ["toy_acc", "toy_norm"] and not sel.include_defaults
    sel = resolve_tasks([str(tmp_path / "t" / "toy_norm.yaml")])
    assert sel.names == ["toy_norm"]
    with pytest.raises(ValueError, match="more than once"):
        resolve_tasks([str(tmp_path / "t"), str(tmp_path / "t" / "toy_acc.yaml")])
    # a group and its members in one directory: the group runs, its members not twice
    (tmp_path / "t" / "toy_group.yaml").write_text(
        "group: toy_group\ntask:\n  - toy_acc\n  - toy_norm\naggregate_metric_list:\n"
        "  - metric: acc\n    weight_by_size: true\nmetadata:\n  version: 1.0\n")
    assert resolve_tasks([str(tmp_path / "t")]).names == ["toy_group"]
    assert resolve_tasks([str(tmp_path / "t" / "toy_group.yaml")]).names == ["toy_group"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="defines no lm-eval task"):
        resolve_tasks([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="no tasks"):
        resolve_tasks([])
