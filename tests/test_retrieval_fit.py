"""The retrieval probe's report says when the probe does not fit the model: the teacher (mode
``softmax``, the original attention) itself recalls nothing, so every other row says nothing
either; it points to the recall evaluation that does fit (``kind: recall``)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hedgecats.evaluation.report import probe_sections
from hedgecats.evaluation.retrieval import format_retrieval_markdown

FIXTURE = Path(__file__).parent / "fixtures" / "eval" / "results" / "stage2_ssd" / "results.json"
NO_FIT = "the teacher scores 0: this probe does not fit this model"


def _retrieval(scale: float) -> dict:
    """The fixture's retrieval section with every exact-match score multiplied by ``scale``."""
    r = copy.deepcopy(json.loads(FIXTURE.read_text())["retrieval"])
    for row in r["modes"].values():
        for cell in row.values():
            if cell["n"]:
                cell["accuracy"] *= scale
    return r


def test_a_teacher_at_zero_says_the_probe_does_not_fit_and_points_to_kind_recall():
    text = "\n".join(format_retrieval_markdown(_retrieval(0.0)))
    assert NO_FIT in text.lower() and "kind: recall" in text, text
    # the results' report (hedgecats evaluate's printed output, results.md) carries it
    assert NO_FIT in "\n".join(probe_sections({"retrieval": _retrieval(0.0)})).lower()


def test_a_teacher_that_recalls_gets_no_such_line():
    assert "does not fit" not in "\n".join(format_retrieval_markdown(_retrieval(1.0)))


def test_a_teacher_near_zero_is_reported_with_its_best_score():
    r = _retrieval(0.0)
    r["modes"]["softmax"]["inside"]["accuracy"] = 100 / 16  # one fact of 16
    text = "\n".join(format_retrieval_markdown(r))
    assert "teacher scores at most 6.2%" in text and "does not fit this model" in text, text
