"""The retrieval probe: distances, buckets and scoring checked with copy oracles, then a real
converted model in several modes."""

from __future__ import annotations

import pytest
import torch
from fixtures.eval.support import byte_tokenizer, tiny_llama
from hedgecats.evaluation.ablation import parse_modes
from hedgecats.evaluation.retrieval import (
    BUCKETS,
    default_distances,
    format_retrieval_markdown,
    make_probe_documents,
    retrieval_probe,
)
from hedgecats.models import HybridConfig, convert_to_hybrid
from torch import nn

W = 64


class WindowedCopyOracle(nn.Module):
    """An induction head that looks back at most ``reach`` positions: at position t it finds the
    latest j < t whose last ``k`` tokens equal those ending at t, with t - j < reach, and predicts
    token j + 1. For a queried value token this look-back t - j is exactly the recall distance,
    so it recalls a fact iff distance < reach."""

    def __init__(self, vocab: int, reach: int, k: int = 12):
        super().__init__()
        self.vocab, self.reach, self.k = vocab, reach, k
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None):
        B, T = input_ids.shape
        logits = torch.zeros(B, T, self.vocab)
        for b in range(B):
            ids = input_ids[b].tolist()
            last: dict[tuple, int] = {}
            for t in range(self.k - 1, T - 1):
                key = tuple(ids[t - self.k + 1:t + 1])
                j = last.get(key)
                if j is not None and t - j < self.reach:
                    logits[b, t, ids[j + 1]] = 1.0
                last[key] = t
        return type("Out", (), {"logits": logits})()


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_documents_cover_every_bucket(tok):
    docs, skipped = make_probe_documents(tok, default_distances(W), 3, seed=0)
    assert skipped == [] and len(docs) == 12
    from hedgecats.evaluation.retrieval import bucket_of

    assert [bucket_of(d.distance, W) for d in docs] == [b for b in BUCKETS for _ in range(3)]
    for d in docs:  # the value really sits at the positions, and is a run of digits
        assert all(chr(d.input_ids[p]).isdigit() for p in d.value_positions)
        assert d.distance >= d.target_distance - 40
    # max_length drops the distances whose documents would be too long
    _, skipped = make_probe_documents(tok, default_distances(W), 1, max_length=8 * W + 200)
    assert skipped == [24 * W]


@pytest.mark.parametrize("reach, expected", [
    (10**9, {"inside": 100.0, "1-4x": 100.0, "4-16x": 100.0, "beyond": 100.0}),
    (W, {"inside": 100.0, "1-4x": 0.0, "4-16x": 0.0, "beyond": 0.0}),
    (4 * W, {"inside": 100.0, "1-4x": 100.0, "4-16x": 0.0, "beyond": 0.0}),
], ids=["reach-all", "reach-w", "reach-4w"])
def test_scores_follow_the_oracles_reach(tok, reach, expected):
    oracle = WindowedCopyOracle(len(tok), reach)
    r = retrieval_probe(oracle, tok, parse_modes("softmax"), window=W, n_per_distance=2,
                        batch_size=8, progress=lambda _: None)
    got = r["modes"]["softmax"]
    assert {b: got[b]["accuracy"] for b in BUCKETS} == expected
    assert all(got[b]["n"] == 2 for b in BUCKETS)
    assert r["window"] == W and r["target_distances"] == list(default_distances(W))


def test_unconverted_model_needs_a_window(tok):
    with pytest.raises(ValueError, match="retrieval window"):
        retrieval_probe(WindowedCopyOracle(len(tok), 1), tok, parse_modes("softmax"))


def test_converted_model_all_modes(tok):
    model = convert_to_hybrid(tiny_llama(tok), HybridConfig(window=W, layer_windows={1: 2 * W}))
    specs = parse_modes("hybrid,swa_only,la_only+la_span=all,softmax")
    lines = []
    r = retrieval_probe(model, tok, specs, n_per_distance=2, distances=[W // 2, 2 * W, 8 * W],
                        progress=lines.append)
    assert r["window"] == W and "smallest" in r["window_note"]  # layers have windows 64 and 128
    assert list(r["modes"]) == [s.label for s in specs]
    assert len(lines) == len(specs)
    for row in r["modes"].values():
        assert sum(row[b]["n"] for b in BUCKETS) == 6 and row["beyond"]["n"] == 0
        for b in ("inside", "1-4x", "4-16x"):
            assert 0.0 <= row[b]["accuracy"] <= row[b]["token_accuracy"] <= 100.0
    md = "\n".join(format_retrieval_markdown(r))
    assert "| la_only+la_span=all |" in md and "n/a (n=0)" in md


def test_any_tokenizer_bpe():
    """A BPE tokenizer (multi-character tokens): distances are counted in its tokens, and the
    windowed oracle still recalls exactly the facts inside its reach."""
    from hedgecats.data import filler_documents, train_bpe_tokenizer
    from hedgecats.data.recall import generate_recall_documents

    texts = filler_documents(200, seed=1) + [d.text for d in generate_recall_documents(100, seed=7)]
    bpe = train_bpe_tokenizer(texts, vocab_size=600)
    w = 32
    docs, _ = make_probe_documents(bpe, default_distances(w), 2, seed=1)
    assert any(len(bpe.decode([i])) > 1 for d in docs for i in d.input_ids)  # really multi-char
    oracle = WindowedCopyOracle(len(bpe), reach=w, k=4)
    r = retrieval_probe(oracle, bpe, parse_modes("softmax"), window=w, n_per_distance=2,
                        batch_size=8, progress=lambda _: None)
    got = r["modes"]["softmax"]
    assert {b: got[b]["n"] for b in BUCKETS} == {b: 2 for b in BUCKETS}
    assert {b: got[b]["accuracy"] for b in BUCKETS} == {
        "inside": 100.0, "1-4x": 0.0, "4-16x": 0.0, "beyond": 0.0}
