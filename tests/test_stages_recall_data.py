"""The embedded default's generated recall corpus: answers point where they say they do."""

import pytest
import torch
from hedgecats.data.recall_bytes import (
    EOS_ID,
    PAD_ID,
    byte_tokenizer,
    make_recall_corpus,
)


@pytest.mark.parametrize("task", ["kv", "marker"])
def test_answers_are_recalls_at_the_stated_distance(task):
    c = make_recall_corpus(40, 128, near_max=15, far_min=40, far_max=110, facts_per_doc=6,
                           filler="ab", task=task, seed=3)
    assert c.input_ids.shape == (40, 128)
    doc, pos, dist = c.answers.T
    ids = c.input_ids
    assert torch.equal(ids[doc, pos], ids[doc, pos - dist])  # the value seen `dist` earlier
    near, far = dist < 16, dist >= 40
    assert (near | far).all() and near.any() and far.any()
    if task == "marker":  # "?S": the nearest earlier occurrence of S is `dist` back
        assert (ids[doc, pos - 1] == ord("?")).all()
        for d, p, k in c.answers.tolist():
            assert ids[d, p] not in ids[d, p - k + 1:p].tolist()
            assert ids[d, p] not in ids[d, :8].tolist()  # invisible to 8 attention sinks
    else:  # fact "#Kv" ... recall "?Kv": same key K before the same value v
        assert (ids[doc, pos - 2] == ord("?")).all() and (ids[doc, pos - dist - 2] == ord("#")).all()
        assert torch.equal(ids[doc, pos - 1], ids[doc, pos - dist - 1])
        assert ((ids[doc, pos - 1] >= ord("A")) & (ids[doc, pos - 1] <= ord("Z"))).all()
    again = make_recall_corpus(40, 128, near_max=15, far_min=40, far_max=110, facts_per_doc=6,
                               filler="ab", task=task, seed=3)
    assert torch.equal(again.input_ids, c.input_ids)  # seeded


def test_errors():
    with pytest.raises(ValueError, match="near_max"):
        make_recall_corpus(1, 64, near_max=20, far_min=10, far_max=30)
    with pytest.raises(ValueError, match="task="):
        make_recall_corpus(1, 64, near_max=5, far_min=10, far_max=30, task="nope")
    with pytest.raises(ValueError, match="filler"):
        make_recall_corpus(1, 64, near_max=5, far_min=10, far_max=30, filler="aB")


def test_byte_tokenizer_ids_are_bytes():
    tok = byte_tokenizer()
    text = "#Kv ?Kv naïve"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode())
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD_ID, EOS_ID)


@pytest.mark.parametrize("task", ["kv", "marker"])
@pytest.mark.parametrize("scale", [dict(window=16, seq_len=128, far_min=40, far_max=110),
                                   dict(window=64, seq_len=1024, far_min=150, far_max=400)])
def test_multiple_choice_tasks_fit_the_scale_they_are_built_for(tmp_path, task, scale):
    """A short task's question and answer fit the window; the far task's answer sits far_min to
    far_max tokens after what it recalls, its context and answer within seq_len (the length the
    model was trained on: at the CPU scale, 128 tokens). A short task whose facts do not fit the
    window is left out."""
    import json

    from hedgecats.data.recall_bytes import write_recall_mc_tasks

    names = write_recall_mc_tasks(tmp_path, task=task, n_docs=64, filler="ab", seed=1, **scale)
    short = [n for n in names if n.startswith("recall_mc_short")]
    assert "recall_mc_far" in names and short
    assert ("recall_mc_short_3" in names) == (task == "kv" and scale["window"] == 64)
    for name in names:
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert len(rows) == 64
        for r in rows:
            context, answer = r["context"], r["choices"][r["label"]]
            n_facts = context.count("#")
            assert len(context) + 1 <= (scale["window"] if name in short else scale["seq_len"])
            if name in short:
                assert 3 <= r["distance"] < scale["window"] and n_facts == (
                    3 if name.endswith("_3") else 1)
            else:
                assert scale["far_min"] <= r["distance"] <= scale["far_max"]
            # what is asked for sits `distance` before the answer's position
            assert context[len(context) - r["distance"]] == answer


def test_multiple_choice_tasks_refuse_a_scale_they_cannot_fit(tmp_path):
    from hedgecats.data.recall_bytes import write_recall_mc_tasks

    with pytest.raises(ValueError, match="far_max <= seq_len - 10"):
        write_recall_mc_tasks(tmp_path, window=16, seq_len=128, far_min=40, far_max=200)
    with pytest.raises(ValueError, match="window >= 16"):
        write_recall_mc_tasks(tmp_path, window=8, seq_len=128, far_min=40, far_max=110)
