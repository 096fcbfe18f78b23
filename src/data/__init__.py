"""Data: FineWeb-Edu streaming, packing, per-rank sharding, exact resume, synthetic corpora.

Knows no model (DESIGN.md, layering): it imports neither `hedgecats.models` nor anything above.
"""

from .fineweb import BatchPlan, FineWebEduDataModule, plan_batches
from .packing import IGNORE_INDEX, MODES, collate, packed_sequences, tokenize_documents
from .resume import ResumableDataLoader, all_gather_objects, batches_consumed
from .sources import DocumentSource, find_invalid_utf8, resolve_data_files
from .streaming import PackedBatchStream
from .synthetic import (
    FINEWEB_COLUMNS,
    FillerGrammar,
    filler_documents,
    fineweb_records,
    python_source_documents,
    write_fineweb_file,
    write_fineweb_files,
)
from .tokenization import byte_level_tokenizer, load_tokenizer, train_bpe_tokenizer

__all__ = [
    "FINEWEB_COLUMNS",
    "IGNORE_INDEX",
    "MODES",
    "BatchPlan",
    "DocumentSource",
    "FillerGrammar",
    "FineWebEduDataModule",
    "PackedBatchStream",
    "ResumableDataLoader",
    "all_gather_objects",
    "batches_consumed",
    "byte_level_tokenizer",
    "collate",
    "filler_documents",
    "find_invalid_utf8",
    "fineweb_records",
    "load_tokenizer",
    "packed_sequences",
    "plan_batches",
    "python_source_documents",
    "resolve_data_files",
    "tokenize_documents",
    "train_bpe_tokenizer",
    "write_fineweb_file",
    "write_fineweb_files",
]
