"""Tokenizers, packing, per-rank sharding, batch arithmetic, the DataModule's batches (issue 4)."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
import torch
from hedgecats.data import (
    IGNORE_INDEX,
    DocumentSource,
    FineWebEduDataModule,
    byte_level_tokenizer,
    collate,
    filler_documents,
    packed_sequences,
    plan_batches,
    train_bpe_tokenizer,
    write_fineweb_files,
)
from transformers import AutoTokenizer

SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    # an id at the start of each document makes documents recognisable in decoded chunks
    return [f"doc{i:04d} {t}" for i, t in enumerate(filler_documents(41, 20, 400, seed=7))]


@pytest.fixture(scope="module")
def files(tmp_path_factory, docs):
    out = tmp_path_factory.mktemp("pack")
    parquet = write_fineweb_files(docs, out / "pq", n_files=4)
    jsonl = write_fineweb_files(docs, out / "js", n_files=4, file_format="jsonl")
    return {"parquet": parquet, "jsonl": jsonl}


def stream_tokens(texts, eos=256) -> list[int]:
    out = []
    for t in texts:
        out += list(t.encode()) + [eos]
    return out


def file_order(docs, n_files):
    """Documents in file order for write_fineweb_files' round robin."""
    return [docs[i] for f in range(n_files) for i in range(f, len(docs), n_files)]


# --- tokenizers ---------------------------------------------------------------------------------


def test_byte_tokenizer_ids_specials_and_save_load(tok, tmp_path):
    assert tok("aé")["input_ids"] == [97, 0xC3, 0xA9]
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id, len(tok)) == (256, 257, 258, 259)
    assert tok.decode([104, 105, 256], skip_special_tokens=True) == "hi"
    byte_level_tokenizer(save_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("hello <eos>")["input_ids"] == tok("hello <eos>")["input_ids"]
    assert loaded.eos_token_id == 256


def test_special_token_text_in_a_document_stays_text(tok, tmp_path):
    paths = write_fineweb_files(["a <eos> b"] * 30, tmp_path, n_files=1)
    flat = [t for c in packed_sequences(paths, tok, seq_len=8) for t in c]
    assert flat[:10] == list(b"a <eos> b") + [256]  # the literal "<eos>" is 5 bytes, not id 256


def test_train_bpe_tokenizer_offline(tmp_path):
    bpe = train_bpe_tokenizer(filler_documents(200, seed=1), vocab_size=400, save_dir=tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "The farmer opened the red barn."
    assert loaded.decode(loaded(text)["input_ids"]) == text
    assert len(bpe(text)["input_ids"]) < len(text) / 2  # it learnt merges
    assert loaded.eos_token_id is not None


# --- packed_sequences -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_one_rank_chunks_are_the_documents_in_file_order(tok, docs, files, fmt):
    chunks = list(packed_sequences(files[fmt], tok, seq_len=SEQ))
    assert all(len(c) == SEQ for c in chunks)
    expected = stream_tokens(file_order(docs, 4))
    flat = [t for c in chunks for t in c]
    assert flat == expected[: len(flat)]
    assert 0 <= len(expected) - len(flat) < SEQ  # only the last partial chunk is left out


def test_glob_directory_and_list_agree(tok, files):
    directory = files["parquet"][0].parent
    by_list = list(packed_sequences(files["parquet"], tok, seq_len=SEQ))
    assert list(packed_sequences(str(directory / "*.parquet"), tok, seq_len=SEQ)) == by_list
    assert list(packed_sequences(directory, tok, seq_len=SEQ)) == by_list


@pytest.mark.parametrize("world_size", [2, 3], ids=["ws2-by-file", "ws3-by-document"])
def test_ranks_partition_documents_and_drop_at_most_one_partial_chunk(tok, docs, files, world_size):
    seen_docs = Counter()
    for rank in range(world_size):
        source = DocumentSource.create(files["parquet"])
        rank_docs = list(source.texts(iter(source.open(rank, world_size))))
        seen_docs.update(rank_docs)
        chunks = list(packed_sequences(files["parquet"], tok, SEQ, rank, world_size))
        flat = [t for c in chunks for t in c]
        expected = stream_tokens(rank_docs)
        assert flat == expected[: len(flat)]
        assert 0 <= len(expected) - len(flat) < SEQ
    assert seen_docs == Counter(docs)  # every document on exactly one rank


def test_shuffle_buffer_permutes_chunks_reproducibly(tok, files):
    plain = list(packed_sequences(files["parquet"], tok, seq_len=SEQ))
    shuffled = list(packed_sequences(files["parquet"], tok, seq_len=SEQ, shuffle_buffer=5, seed=1))
    again = list(packed_sequences(files["parquet"], tok, seq_len=SEQ, shuffle_buffer=5, seed=1))
    other = list(packed_sequences(files["parquet"], tok, seq_len=SEQ, shuffle_buffer=5, seed=2))
    assert shuffled == again and shuffled != plain and shuffled != other
    assert sorted(map(tuple, shuffled)) == sorted(map(tuple, plain))


# --- batches ------------------------------------------------------------------------------------


def test_collate_truncate_pads_and_masks():
    seqs = [np.array([5, 6, 7]), np.array([1, 2, 3, 4])]
    batch = collate(seqs, 4, "truncate", pad_id=257)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 257], [1, 2, 3, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[5, 6, 7, IGNORE_INDEX], [1, 2, 3, 4]]
    assert all(v.dtype == torch.long for v in batch.values())


@pytest.mark.parametrize(
    ("world", "micro", "accumulate", "steps"),
    [(1, None, 1, 381), (1, 8, 8, 381), (8, None, 1, 381), (8, 2, 4, 381), (4, 4, 4, 381)],
)
def test_plan_batches_defaults(world, micro, accumulate, steps):
    plan = plan_batches(
        world_size=world,
        global_batch_size=64,
        micro_batch_size=micro,
        seq_len=1024,
        tokens_per_epoch=25_000_000,
        val_tokens=1_048_576,
    )
    assert plan.accumulate_grad_batches == accumulate
    assert plan.micro_batch_size * plan.accumulate_grad_batches * world == 64
    assert plan.steps_per_epoch == steps  # 25M / 65,536 tokens per step
    assert plan.train_batches == steps * accumulate


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"world_size": 3}, "not divisible by world_size=3"),
        ({"micro_batch_size": 5}, "does not divide the per-device batch 64"),
        ({"tokens_per_epoch": 1000}, "less than one optimizer step"),
        ({"val_tokens": 10}, "less than one validation batch"),
    ],
)
def test_plan_batches_errors(kwargs, match):
    args = {
        "world_size": 1,
        "global_batch_size": 64,
        "micro_batch_size": None,
        "seq_len": 1024,
        "tokens_per_epoch": 25_000_000,
        "val_tokens": 0,
    }
    with pytest.raises(ValueError, match=match):
        plan_batches(**{**args, **kwargs})


def make_dm(tok, files, **kwargs):
    args = {
        "data_files": [str(p) for p in files],
        "seq_len": SEQ,
        "global_batch_size": 4,
        "micro_batch_size": 2,
        "tokens_per_epoch": SEQ * 4 * 6,
        "val_tokens": SEQ * 2 * 2,
        "shuffle_buffer": 0,
    }
    dm = FineWebEduDataModule(tok, **{**args, **kwargs})
    dm.setup("fit")
    return dm


def test_datamodule_batches(tok, files):
    dm = make_dm(tok, files["parquet"])
    assert (dm.accumulate_grad_batches, dm.micro_batch_size, dm.steps_per_epoch) == (2, 2, 6)
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 12
    for b in batches:
        assert set(b) == {"input_ids", "labels", "attention_mask"}
        assert b["input_ids"].shape == (2, SEQ) and b["input_ids"].dtype == torch.long
        assert torch.equal(b["labels"], b["input_ids"]) and bool(b["attention_mask"].all())
    assert len(list(dm.val_dataloader())) == 2


def test_validation_slice_never_overlaps_training(tok, docs, files):
    """One worker: val is the head of the stream, training starts at the next document."""
    dm = make_dm(tok, files["parquet"])
    val = [t for b in dm.val_dataloader() for t in b["input_ids"].flatten().tolist()]
    train = [t for b in dm.train_dataloader() for t in b["input_ids"].flatten().tolist()]
    stream = stream_tokens(file_order(docs, 4))
    assert stream[: len(val)] == val
    doc_starts = [0] + [i + 1 for i, t in enumerate(stream) if t == 256]
    start = min(s for s in doc_starts if s >= len(val))
    assert stream[start : start + len(train)] == train


def test_validation_documents_differ_from_training_with_workers(tok, files):
    dm = make_dm(tok, files["parquet"], num_workers=2, shuffle_buffer=4, val_tokens=SEQ * 2 * 4)
    ids = re.compile(rb"doc\d{4}")

    def doc_ids(loader):
        rows = [row.clamp(max=255).tolist() for b in loader for row in b["input_ids"]]  # EOS -> 255
        return {m for row in rows for m in ids.findall(bytes(row))}

    val, train = doc_ids(dm.val_dataloader()), doc_ids(dm.train_dataloader())
    assert val and train and not val & train


def test_truncate_mode_one_document_per_row(tok, docs, files):
    dm = make_dm(tok, files["parquet"], packing="truncate", val_tokens=0)
    batch = next(iter(dm.train_dataloader()))
    ordered = file_order(docs, 4)
    for row, mask, labels, doc in zip(
        batch["input_ids"], batch["attention_mask"], batch["labels"], ordered
    ):
        n = int(mask.sum())
        expected = (list(doc.encode()) + [256])[:SEQ]
        assert row[:n].tolist() == expected
        assert (labels[n:] == IGNORE_INDEX).all() and (row[n:] == 257).all()


def test_epochs_restart_the_slice_reshuffled(tok, files):
    dm = make_dm(tok, files["parquet"], shuffle_buffer=8)
    loader = dm.train_dataloader()
    first = [b["input_ids"] for b in loader]
    second = [b["input_ids"] for b in loader]
    assert loader.epoch == 1
    assert any(not torch.equal(a, b) for a, b in zip(first, second))
    common = {tuple(r.tolist()) for b in first for r in b} & {
        tuple(r.tolist()) for b in second for r in b
    }
    assert len(common) >= 16  # mostly the same chunks, in another order
