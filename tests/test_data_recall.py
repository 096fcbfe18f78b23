"""The synthetic recall corpus: seeded, annotated from its text, readable as FineWeb-Edu (4.5)."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest
from hedgecats.data import (
    FINEWEB_COLUMNS,
    FillerGrammar,
    FineWebEduDataModule,
    byte_level_tokenizer,
    filler_documents,
    train_bpe_tokenizer,
)
from hedgecats.data.recall import (
    DISTANCE_BUCKETS,
    distance_bucket,
    generate_recall_documents,
    recall_answers,
    write_recall_corpus,
)

DISTANCES = (48, 100, 300, 1200)
SENTENCE = 80  # the filler is cut at sentence boundaries: distances land within one sentence


@pytest.fixture(scope="module")
def docs():
    return generate_recall_documents(6, seed=3, distances=DISTANCES)


def test_reproducible_from_the_seed(docs):
    again = generate_recall_documents(6, seed=3, distances=DISTANCES)
    assert [d.text for d in again] == [d.text for d in docs]
    assert [d.text for d in generate_recall_documents(2, seed=3, distances=DISTANCES)] == [
        d.text for d in docs[:2]
    ]  # document i depends on (seed, i) only
    other = generate_recall_documents(6, seed=4, distances=DISTANCES)
    assert all(a.text != b.text for a, b in zip(other, docs))


def test_answers_recomputed_from_text_match_the_facts(docs):
    for doc in docs:
        answers = recall_answers(doc.text)
        assert len(answers) == sum(len(f.value) for f in doc.facts)
        by_key = {f.key: f for f in doc.facts}
        for a in answers:
            fact = by_key[a.key]
            offset = a.position - fact.query_start
            assert 0 <= offset < len(fact.value)
            assert a.fact_position == fact.statement_start + offset
            assert doc.text[a.position] == doc.text[a.fact_position] == fact.value[offset]
            assert a.distance == a.position - 1 - a.fact_position
            if fact.target_distance >= 48:  # above the minimum the query's own words impose
                assert abs(a.distance - fact.target_distance) <= SENTENCE


def test_byte_tokenizer_positions_are_characters(docs):
    tok = byte_level_tokenizer()
    for doc in docs[:2]:
        assert recall_answers(doc.text, tok) == recall_answers(doc.text)


def test_bpe_tokens_and_token_distances():
    bpe = train_bpe_tokenizer(
        filler_documents(200, seed=1) + [d.text for d in generate_recall_documents(30, seed=9)],
        vocab_size=500,
    )
    docs = generate_recall_documents(3, seed=0, tokenizer=bpe, distances=(16, 64, 256))
    for doc in docs:
        ids = bpe(doc.text)["input_ids"]
        answers = recall_answers(doc.text, bpe)
        assert answers
        for a in answers:
            assert bpe.decode([ids[a.position]]).strip().isdigit()
            assert bpe.decode([ids[a.position]]) == bpe.decode([ids[a.fact_position]])
        targets = {f.key: f.target_distance for f in doc.facts}
        firsts = {}
        for a in answers:
            firsts.setdefault(a.key, a.distance)
        for key, distance in firsts.items():
            assert abs(distance - targets[key]) <= 24  # tokens: within one filler sentence


def test_distance_buckets():
    w = 64
    assert [distance_bucket(d, w) for d in (0, 63, 64, 255, 256, 1023, 1024)] == [
        "inside",
        "inside",
        "1-4x",
        "1-4x",
        "4-16x",
        "4-16x",
        "beyond",
    ]
    assert set(DISTANCE_BUCKETS) == {"inside", "1-4x", "4-16x", "beyond"}
    with pytest.raises(ValueError):
        distance_bucket(3, 0)


def test_filler_is_varied_and_says_nothing_about_facts():
    grammar = FillerGrammar(seed=0)
    sentences = [grammar.sentence() for _ in range(300)]
    assert len(set(sentences)) > 250
    text = " ".join(sentences)
    assert not re.search(r"\d", text) and "code for" not in text.lower()


def test_written_corpus_is_fineweb_and_feeds_the_datamodule(tmp_path):
    paths = write_recall_corpus(tmp_path, 12, n_files=2, seed=1, distances=(64, 256))
    table = pq.read_table(paths[0])
    assert tuple(table.column_names) == FINEWEB_COLUMNS
    jsonl = write_recall_corpus(tmp_path / "js", 3, file_format="jsonl", seed=1, distances=(64,))
    assert jsonl[0].read_text().count("\n") == 3
    texts = table.column("text").to_pylist()
    assert texts[0] == generate_recall_documents(1, seed=1, distances=(64, 256))[0].text
    assert recall_answers(texts[0])
    dm = FineWebEduDataModule(
        byte_level_tokenizer(),
        data_files=[str(p) for p in paths],
        seq_len=256,
        global_batch_size=2,
        tokens_per_epoch=256 * 2 * 4,
        val_tokens=256 * 2,
        shuffle_buffer=0,
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    text = bytes(batch["input_ids"].clamp(max=255).flatten().tolist()).decode()
    assert "code for" in text
