"""Data: FineWeb-Edu streaming, packing, per-rank sharding, exact resume, synthetic corpora
(English recall facts in `recall.py`, the byte recall corpus of the embedded default in
`recall_bytes.py`).

Knows no model (docs/architecture.md: the floors): it imports neither `hedgecats.models` nor anything above.
"""

from .fineweb import BatchPlan, FineWebEduDataModule, plan_batches
from .packing import IGNORE_INDEX, MODES, collate, packed_sequences, tokenize_documents
from .recall_bytes import RecallCorpus, RecallDataModule, make_recall_corpus, write_recall_mc_tasks
from .resume import ResumableDataLoader, ResumableTrainData, all_gather_objects, batches_consumed
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
    "RecallCorpus",
    "RecallDataModule",
    "ResumableDataLoader",
    "ResumableTrainData",
    "all_gather_objects",
    "batches_consumed",
    "byte_level_tokenizer",
    "collate",
    "filler_documents",
    "find_invalid_utf8",
    "fineweb_records",
    "load_tokenizer",
    "make_recall_corpus",
    "packed_sequences",
    "plan_batches",
    "python_source_documents",
    "resolve_data_files",
    "tokenize_documents",
    "train_bpe_tokenizer",
    "write_fineweb_file",
    "write_fineweb_files",
    "write_recall_mc_tasks",
]
