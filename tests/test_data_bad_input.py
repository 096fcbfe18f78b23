"""Bad input gives a clear error or a documented behaviour, never a silent empty epoch or a hang
(issue 4.6)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hedgecats.data import (
    FineWebEduDataModule,
    byte_level_tokenizer,
    filler_documents,
    packed_sequences,
    write_fineweb_file,
    write_fineweb_files,
)
from hedgecats.data.synthetic import fineweb_records

SEQ = 32


@pytest.fixture(scope="module")
def tok():
    return byte_level_tokenizer()


@pytest.fixture
def good(tmp_path):
    return write_fineweb_files(filler_documents(40, 50, 200, seed=2), tmp_path / "good", n_files=2)


def datamodule(tok, files, **kwargs):
    args = {
        "data_files": [str(f) for f in files],
        "seq_len": SEQ,
        "global_batch_size": 2,
        "micro_batch_size": 1,
        "tokens_per_epoch": SEQ * 2 * 4,
        "val_tokens": 0,
        "shuffle_buffer": 0,
    }
    return FineWebEduDataModule(tok, **{**args, **kwargs})


# --- files ------------------------------------------------------------------------------------


def test_missing_file_and_unmatched_glob(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list(packed_sequences(tmp_path / "nope.parquet", tok))
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list(packed_sequences(str(tmp_path / "*.parquet"), tok))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        datamodule(tok, [tmp_path / "nope.parquet"]).setup("fit")


def test_unknown_or_mixed_formats(tok, tmp_path, good):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unknown format"):
        list(packed_sequences(tmp_path / "notes.txt", tok))
    jsonl = write_fineweb_files(["a text"], tmp_path / "js", file_format="jsonl")
    with pytest.raises(ValueError, match="mix formats"):
        list(packed_sequences([*good, *jsonl], tok))


def test_empty_file_is_skipped_with_a_warning(tok, tmp_path, good):
    empty = write_fineweb_file([], tmp_path / "empty.parquet")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.warns(UserWarning, match="holds no document"):
        with_empty = list(packed_sequences([good[0], empty, good[1]], tok, seq_len=SEQ))
    assert with_empty == list(packed_sequences(good, tok, seq_len=SEQ))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="every data file is empty"):
        list(packed_sequences([empty], tok))
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="every data file is empty"):
        list(packed_sequences([tmp_path / "empty.jsonl"], tok))


def test_empty_shard_of_a_rank(tok, tmp_path):
    """Two documents over four ranks: ranks 2 and 3 get nothing -> an error, not an empty epoch."""
    files = write_fineweb_files(
        ["first document " * 9, "second document " * 9], tmp_path, n_files=1
    )
    assert list(packed_sequences(files, tok, seq_len=SEQ, rank=1, world_size=4))
    with pytest.raises(ValueError, match="rank 3 of 4 received no document"):
        list(packed_sequences(files, tok, seq_len=SEQ, rank=3, world_size=4))
    dm = datamodule(tok, files, global_batch_size=4)
    dm._world = lambda: (3, 4)  # what a 4-process run gives rank 3
    with pytest.raises(ValueError, match="rank 3/4 received no document"):
        dm.setup("fit")


# --- columns and text -----------------------------------------------------------------------


def test_text_column_that_is_not_there(tok, good, tmp_path):
    with pytest.raises(ValueError, match=r"no column 'content'; its columns are \['text', 'id'"):
        list(packed_sequences(good, tok, text_column="content"))
    jsonl = write_fineweb_files(["a b c"], tmp_path, file_format="jsonl")
    with pytest.raises(ValueError, match="no column 'content'"):
        list(packed_sequences(jsonl, tok, text_column="content"))
    with pytest.raises(ValueError, match="no column 'content'"):
        datamodule(tok, good, text_column="content").setup("fit")


def test_null_text(tok, tmp_path):
    path = tmp_path / "null.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": None}) + "\n")
    with pytest.raises(TypeError, match="document 1 has text=None"):
        list(packed_sequences(path, tok, seq_len=2))


def test_non_utf8_bytes_name_the_file(tok, tmp_path):
    bad_jsonl = tmp_path / "bad.jsonl"
    bad_jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9 au lait"}\n')
    with pytest.raises(ValueError, match=r"not valid UTF-8.*bad\.jsonl.*line 2"):
        list(packed_sequences(bad_jsonl, tok, seq_len=2))
    # a binary text column: valid UTF-8 is decoded, invalid bytes raise
    table = pa.table({"text": pa.array([b"caf\xc3\xa9 " * 20, b"ok " * 20], pa.binary())})
    pq.write_table(table, tmp_path / "bytes.parquet")
    assert list(packed_sequences(tmp_path / "bytes.parquet", tok, seq_len=8))
    table = pa.table({"text": pa.array([b"ok " * 20, b"caf\xe9 " * 20], pa.binary())})
    pq.write_table(table, tmp_path / "badbytes.parquet")
    with pytest.raises(ValueError, match=r"not valid UTF-8.*badbytes\.parquet.*row 1"):
        list(packed_sequences(tmp_path / "badbytes.parquet", tok, seq_len=8))


def test_documents_shorter_than_a_chunk(tok, tmp_path):
    """Documented: pack mode joins short documents into one chunk; truncate mode pads each one.
    Fewer tokens than one chunk in all is an error."""
    files = write_fineweb_files(["ab", "cde", "f"] * 10, tmp_path, n_files=1)
    chunks = list(packed_sequences(files, tok, seq_len=SEQ))
    assert chunks[0][:7] == [97, 98, 256, 99, 100, 101, 256]
    dm = datamodule(tok, files, packing="truncate", tokens_per_epoch=SEQ * 2)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["attention_mask"].sum().item() == 3  # "ab" + EOS, one document per row
    tiny = write_fineweb_files(["ab", "cd"], tmp_path / "tiny", n_files=1)
    with pytest.raises(ValueError, match="fewer than one chunk of seq_len=32"):
        list(packed_sequences(tiny, tok, seq_len=SEQ))


def test_tokenizer_without_eos(good):
    no_eos = byte_level_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="has no EOS token"):
        list(packed_sequences(good, no_eos))
    with pytest.raises(ValueError, match="has no EOS token"):
        datamodule(no_eos, good).setup("fit")
    assert list(packed_sequences(good, no_eos, seq_len=SEQ, eos_token_id=0))  # an explicit id


# --- budgets and the world ------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2], ids=["workers0", "workers2"])
def test_data_running_out_raises_instead_of_a_short_epoch(tok, good, num_workers):
    dm = datamodule(tok, good, tokens_per_epoch=10_000 * SEQ, num_workers=num_workers)
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="data ran out"):
        list(dm.train_dataloader())


def test_validation_head_larger_than_the_data(tok, good):
    dm = datamodule(tok, good, val_tokens=SEQ * 1000)
    dm.setup("fit")
    with pytest.raises(RuntimeError, match="data ran out.*validation"):
        list(dm.val_dataloader())


def test_more_workers_than_files_are_capped(tok, good):
    dm = datamodule(tok, good, num_workers=5)
    with pytest.warns(UserWarning, match="using 2 worker"):
        dm.setup("fit")
    assert dm.workers == 2 and len(list(dm.train_dataloader())) == 8


def test_global_batch_not_divisible_by_world(tok, good):
    dm = datamodule(tok, good, global_batch_size=6, micro_batch_size=None)
    dm._world = lambda: (0, 4)
    with pytest.raises(ValueError, match="global_batch_size=6 is not divisible by world_size=4"):
        dm.setup("fit")


def test_resume_state_from_another_world_or_loader_is_refused(tok, good):
    dm = datamodule(tok, good)
    dm.setup("fit")
    loader = dm.train_dataloader()
    next(iter(loader))
    state = {
        "format": "hedgecats.datamodule/1",
        "world_size": 1,
        "loader_states": [loader.state_at()],
    }
    two = datamodule(tok, good, global_batch_size=4)
    two._world = lambda: (1, 2)
    two.setup("fit")
    with pytest.raises(ValueError, match="world_size=1, this run has 2"):
        two.load_state_dict(state)
    other = datamodule(tok, good, num_workers=1)
    other.setup("fit")
    with pytest.raises(ValueError, match="num_workers"):
        other.load_state_dict(state)
        other.train_dataloader()
    with pytest.raises(ValueError, match="restored by its DataModule"):
        dm.train_dataloader().load_state_dict({"some": "state"})


def test_fineweb_records_have_the_columns(tmp_path):
    (record,) = fineweb_records(["hello world"])
    assert list(record) == [
        "text",
        "id",
        "dump",
        "url",
        "date",
        "file_path",
        "language",
        "language_score",
        "token_count",
        "score",
        "int_score",
    ]


# --- issue 50, item 9: errors that name the file -------------------------------------------


def test_a_truncated_parquet_shard_is_named(tok, good):
    shard = good[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"data file '{shard}' cannot be read as parquet"):
        datamodule(tok, good).setup("fit")


@pytest.mark.parametrize("garbage", ["{not json", '{"model": {"type": "Sideways"}}'])
def test_a_garbage_tokenizer_file_is_named(tmp_path, garbage):
    from hedgecats.data import load_tokenizer

    d = tmp_path / "tok"
    byte_level_tokenizer(save_dir=d)
    (d / "tokenizer.json").write_text(garbage)
    with pytest.raises(ValueError, match=f"cannot load the tokenizer '{d}': "
                                         f"'{d / 'tokenizer.json'}'"):
        load_tokenizer(d)
