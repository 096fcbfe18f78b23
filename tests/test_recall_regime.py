"""The regime axis q of the testbed's recall corpus (``RecallDataModule(far_share=q)``): a share q
of the train and validation documents with far recalls, the rest with near recalls only, the
test documents the same for every q; bad shares refused before anything runs; the testbed's
teachers and recipes carry the axis and the teacher's filler letters."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hedgecats.cli import main
from hedgecats.data.recall_bytes import (
    FAR_CHOICE_SEED_OFFSET,
    RecallDataModule,
    far_documents,
    make_recall_corpus,
    make_regime_corpus,
)
from hedgecats.pipeline.spec import load_pipeline

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "testbed"
SMALL = dict(seq_len=256, window=16, far_min=40, far_max=110, task="marker", num_train=40,
             num_val=10, num_test=12, batch_size=4, seed=3)
SPLITS = {"train": (40, 0), "val": (10, 1)}  # documents, the split's seed offset
SHARES = (0, 0.1, 0.5, 1)


def _dm(**kw) -> RecallDataModule:
    return RecallDataModule(**{**SMALL, **kw})


def test_the_test_documents_are_the_same_for_every_q():
    base = _dm().corpus("test")
    for q in SHARES:
        test = _dm(far_share=q).corpus("test")
        assert torch.equal(test.input_ids, base.input_ids), q
        assert torch.equal(test.answers, base.answers), q


@pytest.mark.parametrize("task", ["marker", "kv"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_a_share_q_of_the_documents_have_far_recalls_the_rest_near_ones_only(task, split):
    n, off = SPLITS[split]
    unsplit = _dm(task=task).corpus(split)
    chosen = {}
    for q in SHARES:
        c = _dm(task=task, far_share=q).corpus(split)
        doc, pos, dist = c.answers.T
        ids = c.input_ids
        assert ids.shape == unsplit.input_ids.shape
        assert torch.equal(ids[doc, pos], ids[doc, pos - dist])  # answers point at recalls
        assert ((dist < SMALL["window"]) | (dist >= SMALL["far_min"])).all()
        far = far_documents(n, q, SMALL["seed"] * 1000 + off + FAR_CHOICE_SEED_OFFSET)
        assert int(far.sum()) == math.floor(q * n + 0.5)
        with_far = torch.zeros(n, dtype=torch.bool)
        with_far[doc[dist >= SMALL["far_min"]]] = True
        assert torch.equal(with_far, far)  # every chosen document has one, no other does
        assert torch.equal(ids[far], unsplit.input_ids[far])  # the corpus's own documents
        near_only = ~far
        assert not any(torch.equal(ids[d], unsplit.input_ids[d])
                       for d in near_only.nonzero().flatten().tolist())
        assert torch.isin(torch.arange(n)[near_only], doc).all()  # ... each with recalls
        assert c.stats()["docs_with_far"] == int(far.sum())
        chosen[q] = far
    assert torch.equal(_dm(task=task, far_share=1).corpus(split).answers, unsplit.answers)
    for small, large in zip(SHARES, SHARES[1:]):  # nested: a larger q only adds documents
        assert not (chosen[small] & ~chosen[large]).any()


def test_far_share_one_is_the_corpus_byte_for_byte_and_zero_has_no_far_recall():
    kw = dict(near_max=15, far_min=40, far_max=110, task="marker", seed=5)
    corpus = make_recall_corpus(24, 256, **kw)
    one = make_regime_corpus(24, 256, far_share=1.0, **kw)
    assert torch.equal(one.input_ids, corpus.input_ids)
    assert torch.equal(one.answers, corpus.answers)
    zero = make_regime_corpus(24, 256, far_share=0.0, **kw).stats()
    assert zero["far_recalls"] == zero["docs_with_far"] == 0 and zero["near_recalls"] > 0


def test_stats_count_recalls_and_filler():
    c = make_recall_corpus(8, 256, near_max=15, far_min=40, far_max=110, task="marker",
                           filler="ab", seed=0)
    s = c.stats()
    dist = c.answers[:, 2]
    assert (s["docs"], s["near_recalls"], s["far_recalls"]) == (
        8, int((dist < 40).sum()), int((dist >= 40).sum()))
    # every byte but the "#S" statement and the "?S" recalls is filler
    assert s["filler_share"] == pytest.approx(1 - (2 * 8 + 2 * len(dist)) / (8 * 256))
    assert s["filler_letters"] == 2


BAD = {
    "above 1": (dict(far_share=1.5), "far_share=1.5 must be a number in [0, 1]"),
    "negative": (dict(far_share=-0.1), "far_share=-0.1 must be a number in [0, 1]"),
    "not a number": (dict(far_share="half"), "far_share='half' must be a number in [0, 1]"),
    "no far document": (dict(far_share=0.01), "far_share=0.01 leaves num_train=40 with no "
                        "document with far recalls (0.4 documents round to 0): give num_train "
                        "at least 50 documents"),
    "no near-only document": (dict(far_share=0.97), "far_share=0.97 leaves num_val=10 with no "
                              "document with near recalls only"),
    "empty split": (dict(far_share=0.5, num_val=0), "far_share=0.5 with num_val=0: the split "
                    "has no documents"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_shares_are_refused_when_the_module_is_built(case):
    kw, message = BAD[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        _dm(**kw)


def test_the_pipeline_refuses_a_bad_share_at_validation(tmp_path, capsys):
    """``--dry-run`` exits 2 with one line naming the stage's data, before any model or data
    is built (the testbed teacher's config: no model path needed)."""
    out = tmp_path / "run"
    rc = main(["pipeline", str(CONFIGS / "teacher.yaml"), "--output", str(out), "--dry-run",
               "--set", "stages.teacher.fit.data.init_args.far_share=0.001"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert ("stages.teacher.fit.data: RecallDataModule: far_share=0.001 leaves num_val=64 with "
            "no document with far recalls") in err
    assert "Traceback" not in err and not out.exists()


RECIPES = ("hedgecats", "inference_hybrid", "lolcats", "lolcats_shared_norm",
           "lolcats_window_max", "lolcats_gate_elementwise", "lolcats_gate_lowrank",
           "ssd_dropout", "ssd_window", "ssd_fixed")


def _data_args(spec) -> list[dict]:
    """Every RecallDataModule's arguments in a loaded pipeline: stages, then evaluations."""
    evals = spec.get("evaluate") or []
    evals = evals if isinstance(evals, list) else [evals]
    return [st["fit"]["data"]["init_args"] for st in spec["stages"]] + \
        [e["data"]["init_args"] for e in evals if "data" in e]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_takes_q_and_the_teachers_filler_in_all_its_data(recipe, tmp_path):
    path = CONFIGS / f"{recipe}.yaml"
    default = _data_args(load_pipeline(path, output=tmp_path))
    assert all(a["far_share"] is None and a["filler"] == "abcdefghijklmnopqrstuvwxyz"
               for a in default)  # as the earlier runs had it
    spec = load_pipeline(path, output=tmp_path, variables={"far_share": 0.1, "filler": "ab"})
    args = _data_args(spec)
    assert len(args) >= 3 and all(a["far_share"] == 0.1 and a["filler"] == "ab" for a in args)


def test_the_teachers_differ_only_in_filler_tied_embeddings_and_steps(tmp_path):
    weak = load_pipeline(CONFIGS / "teacher.yaml", output=tmp_path)
    strong = load_pipeline(CONFIGS / "teacher_strong.yaml", output=tmp_path)
    w_model = weak["stages"][0]["fit"]["model"]["init_args"]
    s_model = strong["stages"][0]["fit"]["model"]["init_args"]
    assert w_model.pop("tie_word_embeddings") is False and s_model.pop("tie_word_embeddings")
    assert w_model == s_model
    assert all(a["filler"] == "abcdefghijklmnopqrstuvwxyz" for a in _data_args(weak))
    assert all(a["filler"] == "ab" for a in _data_args(strong))
    for a in (*_data_args(weak), *_data_args(strong)):
        a.pop("filler")
    assert _data_args(weak) == _data_args(strong)
    w_trainer, s_trainer = (t["stages"][0]["fit"]["trainer"] for t in (weak, strong))
    assert (w_trainer.pop("max_steps"), s_trainer.pop("max_steps")) == (6000, 3000)
    assert w_trainer == s_trainer
