"""Where documents come from: FineWeb-Edu on the hub, or local parquet / jsonl files like it.

Both are opened as a `datasets` streaming `IterableDataset` (so the code that runs on the real
data is the code the tests run) and split across ranks with `split_dataset_by_node`: by files when
their number divides the world size, else every rank reads all files and keeps one document in
`world_size`. Inside a DataLoader worker, `datasets` further gives each worker its own files.

Checks made here, before any training step, so that bad input fails loudly and early:

- a pattern that matches no file, or a path that does not exist: `FileNotFoundError`;
- files of mixed or unknown formats: `ValueError`;
- a text column that is not in the files: `ValueError` listing the columns there are;
- an empty file (zero rows) is skipped with a warning (`datasets` cannot read an empty parquet
  file); if every file is empty, `ValueError`;
- text that is not valid UTF-8: `ValueError` naming the file (nothing is decoded with
  replacement: text is never silently altered);
- a missing (null) or non-text value in the text column: `ValueError`.
"""

from __future__ import annotations

import glob
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_GLOB_CHARS = set("*?[")


def resolve_data_files(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Expand globs and directories into an ordered list of existing files.

    Each pattern keeps its place in the list; the files a glob or a directory matches are sorted.
    A directory stands for the `.parquet`, `.jsonl` and `.json` files below it.
    """
    patterns = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not patterns:
        raise ValueError("data_files is empty: give at least one file, glob or directory")
    files: list[str] = []
    for pattern in patterns:
        pattern = os.fspath(pattern)
        if _GLOB_CHARS & set(pattern):
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(f"data_files pattern {pattern!r} matches no file")
        elif os.path.isdir(pattern):
            matched = sorted(
                str(p) for p in Path(pattern).rglob("*") if p.is_file() and p.suffix in _FORMATS
            )
            if not matched:
                raise FileNotFoundError(
                    f"directory {pattern!r} holds no .parquet, .jsonl or .json file"
                )
        elif os.path.isfile(pattern):
            matched = [pattern]
        else:
            raise FileNotFoundError(f"data file {pattern!r} does not exist")
        files.extend(matched)
    return files


def _file_format(files: Sequence[str]) -> str:
    kinds = {}
    for f in files:
        suffix = Path(f).suffix
        if suffix not in _FORMATS:
            raise ValueError(
                f"data file {f!r}: unknown format {suffix!r}; expected one of {sorted(_FORMATS)}"
            )
        kinds.setdefault(_FORMATS[suffix], f)
    if len(kinds) > 1:
        raise ValueError(f"data_files mix formats ({kinds}); use files of one format")
    return next(iter(kinds))


def _num_rows_and_columns(path: str, fmt: str) -> tuple[int, list[str]]:
    """Row count (exact for parquet, 0 or 1 meaning empty/non-empty for json) and column names."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            meta = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as e:  # pyarrow's message names no file
            raise ValueError(
                f"data file {path!r} cannot be read as parquet ({e}); it is truncated or "
                "damaged (an interrupted download or copy?): fetch or write it again, or "
                "leave it out of data_files"
            ) from e
        return meta.metadata.num_rows, list(meta.schema_arrow.names)
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    row = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise ValueError(f"{path!r}: first line is not a JSON object ({e})") from e
                if not isinstance(row, dict):
                    raise ValueError(
                        f"{path!r}: lines must be JSON objects, got {type(row).__name__}"
                    )
                return 1, list(row)
    return 0, []


def find_invalid_utf8(files: Sequence[str], text_column: str = "text") -> list[str]:
    """Descriptions (`file: where`) of the files whose text column is not valid UTF-8."""
    bad = []
    for path in files:
        fmt = _FORMATS.get(Path(path).suffix)
        if fmt == "json":
            with open(path, "rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    try:
                        raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        bad.append(f"{path!r} line {line_no} byte {e.start}")
                        break
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            column = pq.read_table(path, columns=[text_column]).column(0)
            try:
                if pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
                    for i, value in enumerate(column.to_pylist()):
                        if value is not None:
                            try:
                                value.decode("utf-8")
                            except UnicodeDecodeError as e:
                                raise ValueError(f"row {i} byte {e.start}") from e
                else:
                    column.validate(full=True)
            except (ValueError, pa.ArrowInvalid) as e:
                bad.append(f"{path!r} ({e})")
    return bad


@dataclass(frozen=True)
class DocumentSource:
    """A stream of documents: local files (`data_files`) or a hub dataset (`path`, `name`).

    Build it with `DocumentSource.create(...)`, which checks the files; `open(rank, world_size)`
    gives the rank's `datasets.IterableDataset` (streaming) with the text column only, and
    `documents(...)` iterates texts with the checks of this module.
    """

    data_files: tuple[str, ...] | None
    path: str
    name: str | None
    split: str
    text_column: str
    file_format: str | None

    @classmethod
    def create(
        cls,
        data_files: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
        path: str = "HuggingFaceFW/fineweb-edu",
        name: str | None = "sample-10BT",
        split: str = "train",
        text_column: str = "text",
    ) -> DocumentSource:
        if data_files is None:
            return cls(None, path, name, split, text_column, None)
        files = resolve_data_files(data_files)
        fmt = _file_format(files)
        kept = []
        for f in files:
            n_rows, columns = _num_rows_and_columns(f, fmt)
            if n_rows == 0:
                warnings.warn(f"data file {f!r} holds no document; it is skipped", stacklevel=2)
                continue
            if text_column not in columns:
                raise ValueError(
                    f"data file {f!r} has no column {text_column!r}; its columns are {columns}"
                )
            kept.append(f)
        if not kept:
            raise ValueError(f"every data file is empty: {files}")
        return cls(tuple(kept), path, name, split, text_column, fmt)

    def describe(self) -> str:
        if self.data_files is not None:
            shown = ", ".join(self.data_files[:3]) + (", ..." if len(self.data_files) > 3 else "")
            return f"{len(self.data_files)} {self.file_format} file(s) [{shown}]"
        return f"{self.path!r} (name={self.name!r}, split={self.split!r})"

    def open(self, rank: int = 0, world_size: int = 1):
        """The rank's share of the stream, as a `datasets.IterableDataset` with one column."""
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node

        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size!r})")
        if self.data_files is not None:
            kwargs = {"columns": [self.text_column]} if self.file_format == "parquet" else {}
            ds = load_dataset(
                self.file_format,
                data_files=list(self.data_files),
                split="train",
                streaming=True,
                **kwargs,
            )
        else:
            ds = load_dataset(self.path, name=self.name, split=self.split, streaming=True)
        columns = ds.column_names
        if columns is not None and self.text_column not in columns:
            raise ValueError(
                f"{self.describe()} has no column {self.text_column!r}; its columns are {columns}"
            )
        if columns is None or columns != [self.text_column]:
            ds = ds.select_columns([self.text_column])
        if world_size > 1:
            ds = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        return ds

    def texts(self, examples: Iterator[dict]) -> Iterator[str]:
        """The text of each example, checked: str (bytes must be UTF-8), never null."""
        column = self.text_column
        n = 0
        while True:
            try:
                example = next(examples)
            except StopIteration:
                return
            except UnicodeDecodeError as e:
                raise self._utf8_error(e) from e
            try:
                text = example[column]
            except KeyError:
                raise ValueError(
                    f"{self.describe()}: document {n} has no column {column!r}; "
                    f"it has {sorted(example)}"
                ) from None
            if isinstance(text, bytes):
                try:
                    text = text.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise self._utf8_error(e) from e
            elif not isinstance(text, str):
                raise TypeError(
                    f"{self.describe()}: document {n} has {column}={text!r} "
                    f"({type(text).__name__}); every document needs a string"
                )
            n += 1
            yield text

    def _utf8_error(self, error: UnicodeDecodeError) -> ValueError:
        where = find_invalid_utf8(self.data_files, self.text_column) if self.data_files else []
        return ValueError(
            f"{self.describe()} holds text that is not valid UTF-8 ({error}); "
            f"bad file(s): {where or 'unknown'}. Re-encode the text as UTF-8 "
            "(nothing is replaced silently)."
        )
