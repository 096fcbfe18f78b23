"""Generated text in FineWeb-Edu's file format, for tests, benchmarks and offline runs.

- `FillerGrammar`: varied, predictable English-like sentences from a small word-list grammar
  (no digits, never the recall phrase "code for"), seeded.
- `filler_documents`: documents of filler sentences.
- `python_source_documents`: the Python standard library's sources, real text every machine has
  (for tests and demos that must run offline).
- `write_fineweb_files`: texts -> parquet or jsonl files with FineWeb-Edu's columns, readable by
  `FineWebEduDataModule(data_files=...)` and `packed_sequences`.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# FineWeb-Edu's columns, in its order, with their Arrow types.
FINEWEB_SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("date", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
        ("score", pa.float64()),
        ("int_score", pa.int64()),
    ]
)
FINEWEB_COLUMNS = tuple(FINEWEB_SCHEMA.names)
FILE_FORMATS = ("parquet", "jsonl")

_SUBJECTS = (
    "the farmer",
    "a teacher",
    "the old sailor",
    "my sister",
    "the small dog",
    "a young girl",
    "the doctor",
    "our neighbour",
    "the baker",
    "a tired student",
    "the captain",
    "the gardener",
    "an old woman",
    "the quiet boy",
    "the painter",
    "a busy clerk",
)
_VERBS = (
    "walked to",
    "looked at",
    "painted",
    "carried",
    "found",
    "cleaned",
    "visited",
    "opened",
    "closed",
    "watched",
    "fixed",
    "described",
    "remembered",
    "passed",
    "reached",
    "left",
)
_OBJECTS = (
    "the red barn",
    "a wooden box",
    "the river",
    "the garden",
    "an old book",
    "the market",
    "a blue door",
    "the narrow bridge",
    "the kitchen",
    "a heavy basket",
    "the hill",
    "the school",
    "a long letter",
    "the harbour",
    "the green field",
    "a broken chair",
)
_ADVERBIALS = (
    "in the morning",
    "after lunch",
    "before the rain",
    "with great care",
    "on a sunny day",
    "late at night",
    "without a word",
    "as usual",
    "once again",
    "in a hurry",
    "at dawn",
    "during the storm",
)
_CONNECTIVES = ("Then", "Later", "Meanwhile", "After that", "Soon", "Afterwards")


class FillerGrammar:
    """Seeded generator of filler sentences: subject, verb, object, adverbial, in a few templates.

    The vocabulary is small and the structure fixed, so a tiny model learns to predict much of it;
    it has no digits and never contains "code for", so it says nothing about recall facts.
    """

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def sentence(self) -> str:
        r = self.rng
        s, v, o, a = (
            r.choice(_SUBJECTS),
            r.choice(_VERBS),
            r.choice(_OBJECTS),
            r.choice(_ADVERBIALS),
        )
        template = r.randrange(4)
        if template == 0:
            text = f"{s} {v} {o} {a}."
        elif template == 1:
            text = f"{a}, {s} {v} {o}."
        elif template == 2:
            text = f"{r.choice(_CONNECTIVES)} {s} {v} {o}."
        else:
            s2 = r.choice([x for x in _SUBJECTS if x != s])
            text = f"{s} and {s2} {v} {o} {a}."
        return text[0].upper() + text[1:]

    def text(self, min_chars: int) -> str:
        """Sentences joined by spaces until the text has at least `min_chars` characters."""
        parts: list[str] = []
        n = -1
        while n < min_chars:
            parts.append(self.sentence())
            n += len(parts[-1]) + 1
        return " ".join(parts)


def filler_documents(
    n_docs: int, min_chars: int = 200, max_chars: int = 2000, seed: int = 0
) -> list[str]:
    """`n_docs` documents of filler sentences, lengths drawn in [min_chars, max_chars]."""
    if not 0 < min_chars <= max_chars:
        raise ValueError(f"need 0 < min_chars <= max_chars, got {min_chars!r}, {max_chars!r}")
    grammar = FillerGrammar(seed)
    lengths = random.Random(seed + 1)
    return [grammar.text(lengths.randint(min_chars, max_chars)) for _ in range(n_docs)]


def python_source_documents(
    max_docs: int | None = None,
    max_bytes: int | None = None,
    root: str | os.PathLike | None = None,
) -> Iterator[str]:
    """The `.py` files under `root` (default: the standard library), sorted, one document each.

    Files that are not valid UTF-8 (the stdlib keeps a few on purpose for its tests) are skipped.
    Stops after `max_docs` documents or `max_bytes` bytes, whichever comes first.
    """
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    n_docs = n_bytes = 0
    for path in sorted(base.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        yield text
        n_docs += 1
        n_bytes += len(data)
        if (max_docs is not None and n_docs >= max_docs) or (
            max_bytes is not None and n_bytes >= max_bytes
        ):
            return


def fineweb_records(
    texts: Iterable[str],
    *,
    source: str = "synthetic",
    start_index: int = 0,
    token_counter=None,
) -> Iterator[dict]:
    """Rows with FineWeb-Edu's columns around `texts`.

    `token_count` is the length in tokens of `token_counter` (a tokenizer) when given, else an
    estimate of 1 token per 4 UTF-8 bytes; `id` is a UUID derived from `source` and the index, so
    rows are reproducible.
    """
    for i, text in enumerate(texts, start=start_index):
        if token_counter is not None:
            n_tokens = len(token_counter(text, add_special_tokens=False)["input_ids"])
        else:
            n_tokens = max(1, len(text.encode("utf-8")) // 4)
        yield {
            "text": text,
            "id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, f'hedgecats/{source}/{i}')}>",
            "dump": f"hedgecats-{source}",
            "url": f"https://example.invalid/{source}/{i}",
            "date": "2024-01-01T00:00:00Z",
            "file_path": f"hedgecats://{source}",
            "language": "en",
            "language_score": 1.0,
            "token_count": n_tokens,
            "score": 3.0,
            "int_score": 3,
        }


def write_fineweb_files(
    texts: Iterable[str],
    out_dir: str | os.PathLike,
    *,
    n_files: int = 1,
    file_format: str = "parquet",
    prefix: str = "part",
    source: str = "synthetic",
    row_group_size: int = 1000,
    token_counter=None,
) -> list[Path]:
    """Write `texts` as `n_files` files with FineWeb-Edu's columns; documents go round-robin.

    Document `i` goes to file `i % n_files`, so files differ in size by at most one document.
    Returns the paths, `<out_dir>/<prefix>-00000.<parquet|jsonl>`, ... in order.
    """
    if file_format not in FILE_FORMATS:
        raise ValueError(f"file_format={file_format!r}; expected one of {FILE_FORMATS}")
    if n_files < 1:
        raise ValueError(f"n_files={n_files!r} must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[list[dict]] = [[] for _ in range(n_files)]
    for i, record in enumerate(fineweb_records(texts, source=source, token_counter=token_counter)):
        rows[i % n_files].append(record)
    paths = []
    for k, file_rows in enumerate(rows):
        path = out / f"{prefix}-{k:05d}.{file_format}"
        write_fineweb_file(file_rows, path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def write_fineweb_file(
    records: Sequence[dict], path: str | os.PathLike, row_group_size: int = 1000
) -> Path:
    """Write rows (dicts with FineWeb-Edu's columns) to one `.parquet` or `.jsonl` file."""
    path = Path(path)
    if path.suffix == ".parquet":
        table = pa.Table.from_pylist(list(records), schema=FINEWEB_SCHEMA)
        pq.write_table(table, path, row_group_size=max(1, row_group_size))
    elif path.suffix == ".jsonl":
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(
                json.dumps({k: record[k] for k in FINEWEB_COLUMNS}, ensure_ascii=False) + "\n"
                for record in records
            )
    else:
        raise ValueError(f"{str(path)!r}: expected a .parquet or .jsonl file name")
    return path
