"""`PackedBatchStream`: one rank's batches for one epoch, as a stateful `IterableDataset`.

Per rank, and inside each DataLoader worker of that rank, the documents of the worker's share
(`DocumentSource.open` splits by rank, `datasets` splits by worker) go through:

    tokenise (with EOS) -> pack or truncate -> [validation head] -> shuffle buffer -> batches

- The **validation slice** is the head of each worker's stream: its first `val_batches` worth of
  sequences (split over workers like the batches). The `val` split yields it; the `train` split
  consumes it without yielding it, drops the rest of the document the last validation sequence
  ended in, and starts at the next document. So training never sees a validation token, and the
  two agree as long as they are built with the same arguments (and the same number of workers).
- An **epoch** is exactly `num_batches` batches of `batch_size` sequences per rank (the token
  budget): every rank yields the same number, which DDP needs. Batch `i` of a rank comes from
  worker `i % num_workers`. Each epoch starts the stream again from its beginning (an epoch is a
  pass over the same slice, reshuffled with the epoch number). If a worker's data ends before its
  share of the budget, the stream raises (it never yields a short or empty epoch).
- The **state** (`state_dict`) is the position in the `datasets` stream, the tokenised documents
  not yet used, the packer's carry, the shuffle buffer and its RNG, and the batch count: loading
  it resumes exactly at the next batch. torchdata's `StatefulDataLoader` collects it from each
  worker; `resume.ResumableDataLoader` makes it exact under Lightning.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from transformers import PreTrainedTokenizerBase

from .packing import (
    TOKENIZE_BATCH,
    Packer,
    ShuffleBuffer,
    Truncator,
    _flat,
    _unflat,
    check_mode,
    collate,
    tokenize_documents,
)
from .sources import DocumentSource

SPLITS = ("train", "val")
STATE_FORMAT = 1


def worker_share(n: int, worker: int, num_workers: int) -> int:
    """How many of `n` round-robin items (0, 1, ...) fall to `worker` of `num_workers`."""
    return len(range(worker, n, num_workers))


class PackedBatchStream(IterableDataset):
    """Batches `{"input_ids", "labels", "attention_mask"}` (B, T) of one rank, stateful.

    Args:
        source: where documents come from (`DocumentSource.create(...)`).
        tokenizer: the model's tokenizer (a `PreTrainedTokenizerBase`).
        seq_len: tokens per sequence (T).
        batch_size: sequences per batch (B, the per-device micro-batch).
        num_batches: batches per epoch of this rank (same on every rank).
        val_batches: batches of the validation head (per rank; the `train` split skips them).
        split: `"train"` or `"val"`.
        mode: `"pack"` or `"truncate"` (see `packing`).
        rank, world_size: this process's place in the world.
        shuffle_buffer: sequences in the shuffle buffer of the train split (0: no shuffling).
        seed: seed of the shuffle (combined with epoch, rank and worker).
        eos_id, pad_id: ids ending documents and filling padding.
    """

    def __init__(
        self,
        source: DocumentSource,
        tokenizer: PreTrainedTokenizerBase,
        *,
        seq_len: int,
        batch_size: int,
        num_batches: int,
        val_batches: int = 0,
        split: str = "train",
        mode: str = "pack",
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 0,
        seed: int = 0,
        eos_id: int,
        pad_id: int,
    ) -> None:
        super().__init__()
        if split not in SPLITS:
            raise ValueError(f"split={split!r}; expected one of {SPLITS}")
        for name, value, low in (
            ("seq_len", seq_len, 1),
            ("batch_size", batch_size, 1),
            ("num_batches", num_batches, 0),
            ("val_batches", val_batches, 0),
            ("shuffle_buffer", shuffle_buffer, 0),
        ):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.val_batches = val_batches
        self.split = split
        self.mode = check_mode(mode)
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer if split == "train" else 0
        self.seed = seed
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.epoch = 0
        self._start_state: dict | None = None
        self._live: _EpochRun | None = None
        self._hf = None  # the rank's datasets.IterableDataset, opened lazily in each process

    def __len__(self) -> int:
        """Batches per epoch of this rank (all workers together)."""
        return self.num_batches if self.split == "train" else self.val_batches

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next fresh iteration (seeds the shuffle)."""
        self.epoch = int(epoch)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_live"] = None  # a running iteration does not travel to workers
        state["_hf"] = None
        return state

    def _identity(self, worker: int, num_workers: int) -> dict:
        return {
            "format": STATE_FORMAT,
            "split": self.split,
            "mode": self.mode,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "worker": worker,
            "num_workers": num_workers,
        }

    def state_dict(self) -> dict:
        """State of the iteration in progress in this process (or of the next fresh one)."""
        if self._live is not None:
            return self._live.state_dict()
        if self._start_state is not None:
            return self._start_state
        worker, num_workers = _worker()
        return {**self._identity(worker, num_workers), "epoch": self.epoch, "started": False}

    def load_state_dict(self, state: dict) -> None:
        """Make the next `iter()` resume from `state` (as given by `state_dict`)."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"not a PackedBatchStream state (format {STATE_FORMAT}): {str(state)[:200]}"
            )
        self._start_state = state
        self.epoch = int(state["epoch"])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker, num_workers = _worker()
        start, self._start_state = self._start_state, None
        if start is not None:
            expected = self._identity(worker, num_workers)
            saved = {k: start.get(k) for k in expected}
            if saved != expected:
                raise ValueError(
                    f"cannot resume: the saved data state was made with {saved}, "
                    f"this loader is {expected} "
                    "(resume with the same world size, num_workers, seq_len, batch size and mode)"
                )
            if not start["started"]:
                self.epoch, start = int(start["epoch"]), None
        if self._hf is None:
            self._hf = self.source.open(self.rank, self.world_size)
        run = _EpochRun(self, worker, num_workers, start)
        self._live = run
        return run.batches()


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class _EpochRun:
    """One iteration (epoch) of one worker: the live state behind `PackedBatchStream`."""

    def __init__(
        self, stream: PackedBatchStream, worker: int, num_workers: int, start: dict | None
    ):
        self.s = stream
        self.worker, self.num_workers = worker, num_workers
        self.epoch = stream.epoch if start is None else int(start["epoch"])
        self.hf = stream._hf
        self.hf.load_state_dict(start["hf"] if start is not None else None)
        self.texts = stream.source.texts(iter(self.hf))
        self.pending: deque[np.ndarray] = deque()
        self._pending_state: tuple | None = None  # cached: taken after every batch, changes rarely
        self.seqs = Packer(stream.seq_len) if stream.mode == "pack" else Truncator(stream.seq_len)
        self.shuffle = ShuffleBuffer(
            stream.shuffle_buffer,
            stream.seq_len,
            seed=[stream.seed, self.epoch, stream.rank, worker],
        )
        self.head_done = stream.split == "val"  # the val split *is* the head
        self.data_ended = False
        self.batches_done = 0
        self.docs_read = 0
        if start is not None:
            self.pending = deque(_unflat(start["pending"], start["pending_lengths"]))
            self.seqs.load_state_dict(start["seqs"])
            self.shuffle.load_state_dict(start["shuffle"])
            self.head_done = True
            self.data_ended = bool(start["data_ended"])
            self.batches_done = int(start["batches"])
            self.docs_read = int(start["docs_read"])

    def state_dict(self) -> dict:
        if not self.head_done:  # nothing read yet (the head is skipped at the first batch)
            return {
                **self.s._identity(self.worker, self.num_workers),
                "epoch": self.epoch,
                "started": False,
            }
        if self._pending_state is None:
            self._pending_state = _flat(list(self.pending))
        pending, lengths = self._pending_state
        return {
            **self.s._identity(self.worker, self.num_workers),
            "epoch": self.epoch,
            "started": True,
            "batches": self.batches_done,
            "docs_read": self.docs_read,
            "data_ended": self.data_ended,
            "hf": self.hf.state_dict(),
            "pending": pending,
            "pending_lengths": lengths,
            "seqs": self.seqs.state_dict(),
            "shuffle": self.shuffle.state_dict(),
        }

    # -- documents and sequences --------------------------------------------------------------

    def _next_doc(self) -> np.ndarray | None:
        self._pending_state = None
        if not self.pending:
            if self.data_ended:
                return None
            texts = [t for _, t in zip(range(TOKENIZE_BATCH), self.texts)]
            if not texts:
                self.data_ended = True
                return None
            self.docs_read += len(texts)
            self.pending.extend(tokenize_documents(self.s.tokenizer, texts, self.s.eos_id))
        return self.pending.popleft()

    def _next_unshuffled(self) -> np.ndarray | None:
        while (seq := self.seqs.pop()) is None:
            doc = self._next_doc()
            if doc is None:
                return None
            self.seqs.feed(doc)
        return seq

    def _next_sequence(self) -> np.ndarray | None:
        while True:
            seq = self._next_unshuffled()
            if seq is None:  # data ended: hand out what the shuffle buffer still holds
                return self.shuffle.pop_random()
            out = self.shuffle.push(seq)
            if out is not None:
                return out

    def _head_sequences(self) -> int:
        s = self.s
        return worker_share(s.val_batches, self.worker, self.num_workers) * s.batch_size

    def _exhausted(self, what: str, done: int, needed: int) -> RuntimeError:
        s = self.s
        return RuntimeError(
            f"data ran out: rank {s.rank}/{s.world_size}, worker {self.worker}/{self.num_workers} "
            f"produced {done} of the {needed} {what} after reading {self.docs_read} document(s) of "
            f"{s.source.describe()} (seq_len={s.seq_len}, batch_size={s.batch_size}, "
            f"mode={s.mode!r}). "
            "Lower tokens_per_epoch / val_tokens, use fewer workers, or give more data."
        )

    def _skip_head(self) -> None:
        """Consume the validation head of this worker's stream, then start on a fresh document."""
        needed = self._head_sequences()
        for done in range(needed):
            if self._next_unshuffled() is None:
                raise self._exhausted("validation sequences (skipped by training)", done, needed)
        self.seqs = Packer(self.s.seq_len) if self.s.mode == "pack" else Truncator(self.s.seq_len)
        self.head_done = True

    # -- batches -------------------------------------------------------------------------------

    def batches(self) -> Iterator[dict[str, torch.Tensor]]:
        s = self.s
        if s.split == "val":
            target, next_seq, what = (
                self._head_sequences() // s.batch_size,
                self._next_unshuffled,
                "validation batches",
            )
        else:
            target, next_seq, what = (
                worker_share(s.num_batches, self.worker, self.num_workers),
                self._next_sequence,
                "training batches",
            )
            if not self.head_done:
                self._skip_head()
        while self.batches_done < target:
            batch = []
            for _ in range(s.batch_size):
                seq = next_seq()
                if seq is None:
                    raise self._exhausted(what, self.batches_done, target)
                batch.append(seq)
            self.batches_done += 1
            yield collate(batch, s.seq_len, s.mode, s.pad_id)
