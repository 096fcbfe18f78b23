"""Tokens per second of the data pipeline (read parquet, tokenise, pack, shuffle, batch).

    python -m benchmarks.data_throughput --tokens 4194304 --out FILE

Builds FineWeb-format parquet files from real text every machine has (the Python standard
library's sources, `python_source_documents`), trains a byte-level BPE tokenizer on part of it
with `tokenizers` (GPT-2 / Llama-3 family; the vocabulary size is `--vocab`), and iterates
`FineWebEduDataModule`'s train loader (seq_len 1024, shuffle buffer 1024, the defaults) with each
tokenizer (BPE and the byte tokenizer) and each `--workers` value. Time runs from `iter()` to the
last batch, worker start-up included; the steady rate leaves out the first batch. The bar: an 8B
model trains at about 11k tokens/s on one H200 (docs/performance.md: stage 2 at ~9k), so the
pipeline must deliver more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from hedgecats.data import (
    FineWebEduDataModule,
    byte_level_tokenizer,
    python_source_documents,
    train_bpe_tokenizer,
    write_fineweb_files,
)

NEEDED_TOKENS_PER_S = 11_000  # an 8B model's forward + backward on one H200


def measure(tokenizer, files, *, workers, tokens, seq_len, batch, shuffle_buffer) -> dict:
    dm = FineWebEduDataModule(
        tokenizer,
        data_files=[str(f) for f in files],
        seq_len=seq_len,
        global_batch_size=batch,
        tokens_per_epoch=tokens,
        val_tokens=0,
        num_workers=workers,
        shuffle_buffer=shuffle_buffer,
    )
    dm.setup("fit")
    loader = dm.train_dataloader()
    n_tokens = 0
    start = time.perf_counter()
    first = None
    for b in loader:
        if first is None:
            first = time.perf_counter()
        n_tokens += b["input_ids"].numel()
    end = time.perf_counter()
    steady_tokens = n_tokens - batch * seq_len
    return {
        "num_workers": workers,
        "tokens": n_tokens,
        "seconds": round(end - start, 3),
        "tokens_per_s": round(n_tokens / (end - start)),
        "first_batch_s": round(first - start, 3),
        "steady_tokens_per_s": round(steady_tokens / (end - first)) if end > first else None,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="0,2", help="comma-separated num_workers values")
    p.add_argument("--tokens", type=int, default=2_097_152, help="tokens per measurement")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--shuffle-buffer", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size")
    p.add_argument("--text-mb", type=float, default=24.0, help="MB of stdlib sources to write")
    p.add_argument("--files", type=int, default=4, help="parquet files (workers get whole files)")
    p.add_argument("--out", default=None, help="write the results JSON here")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        texts = list(python_source_documents(max_bytes=int(args.text_mb * 1e6)))
        files = write_fineweb_files(texts, Path(tmp) / "data", n_files=args.files, source="stdlib")
        write_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        bpe = train_bpe_tokenizer(texts[: max(1, len(texts) // 4)], vocab_size=args.vocab)
        train_s = time.perf_counter() - t0
        n_bytes = sum(len(t.encode()) for t in texts)
        sample = texts[:200]
        bytes_per_token = sum(len(t.encode()) for t in sample) / sum(
            len(x) for x in bpe(sample, add_special_tokens=False)["input_ids"]
        )
        rows = []
        for name, tok in (("bpe", bpe), ("byte", byte_level_tokenizer())):
            for w in workers:
                row = {
                    "tokenizer": name,
                    **measure(
                        tok,
                        files,
                        workers=w,
                        tokens=args.tokens,
                        seq_len=args.seq_len,
                        batch=args.batch,
                        shuffle_buffer=args.shuffle_buffer,
                    ),
                }
                row["meets_11k"] = row["tokens_per_s"] >= NEEDED_TOKENS_PER_S
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "command": " ".join(["python -m benchmarks.data_throughput", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
            "load_average_at_end": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "data": {
            "text": "Python standard library sources (python_source_documents)",
            "documents": len(texts),
            "bytes": n_bytes,
            "parquet_files": args.files,
            "write_s": round(write_s, 2),
        },
        "tokenizers": {
            "bpe": (
                f"byte-level BPE trained with `tokenizers` on 1/4 of the text, vocab {args.vocab}, "
                f"{bytes_per_token:.2f} bytes/token on this text, trained in {train_s:.1f} s"
            ),
            "byte": "byte_level_tokenizer(): 1 token per UTF-8 byte",
        },
        "pipeline": {
            "seq_len": args.seq_len,
            "batch": args.batch,
            "shuffle_buffer": args.shuffle_buffer,
            "mode": "pack",
            "tokens_per_measurement": args.tokens,
        },
        "needed_tokens_per_s": NEEDED_TOKENS_PER_S,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
