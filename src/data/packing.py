"""Tokenising documents and cutting them into fixed-length sequences: the pure core.

Two ways to make `seq_len`-token sequences from documents (docs/method.md#data):

- `pack` (default): each document's tokens followed by EOS, laid end to end, cut into full
  `seq_len` chunks. No padding, no token dropped or repeated, except the tail: the last partial
  chunk of a stream (fewer than `seq_len` tokens) is dropped. Documents shorter than a chunk
  simply share a chunk with their neighbours.
- `truncate`: one document per sequence, its first `seq_len` tokens (EOS included when the
  document is shorter), padded to `seq_len`; padding is masked out of attention and loss.

Special-token strings inside a document (e.g. a literal "<|endoftext|>") are tokenised as text,
never as the special token (`split_special_tokens=True`), and no BOS is added: EOS is the only
separator.

`packed_sequences` is the stream of `pack` chunks over files, on its own (no Lightning, no
DataLoader); `Packer`, `Truncator` and `ShuffleBuffer` are the stateful pieces that
`streaming.PackedBatchStream` shares with it.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .sources import DocumentSource
from .tokenization import eos_token_id as _eos_token_id
from .tokenization import load_tokenizer

MODES = ("pack", "truncate")
IGNORE_INDEX = -100  # labels of padded positions (torch cross_entropy's default ignore_index)
TOKENIZE_BATCH = 64  # documents tokenised per call (fast tokenizers batch in Rust)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    return mode


def tokenize_documents(
    tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], eos_id: int | None
) -> list[np.ndarray]:
    """Token ids of each text (int32), followed by `eos_id` when it is not None."""
    if not texts:
        return []
    ids = tokenizer(
        list(texts),
        add_special_tokens=False,
        split_special_tokens=True,
        return_attention_mask=False,
        verbose=False,
    )["input_ids"]
    tail = [eos_id] if eos_id is not None else []
    return [np.asarray(x + tail, dtype=np.int32) for x in ids]


def _flat(arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, list[int]]:
    """Arrays of different lengths as one int32 tensor and the lengths (compact, picklable)."""
    if not arrays:
        return torch.zeros(0, dtype=torch.int32), []
    return torch.from_numpy(np.concatenate(arrays)), [len(a) for a in arrays]


def _unflat(flat: torch.Tensor, lengths: Sequence[int]) -> list[np.ndarray]:
    out, start = [], 0
    data = flat.numpy()
    for n in lengths:
        out.append(data[start : start + n].copy())
        start += n
    return out


class Packer:
    """Concatenates documents and hands out full `seq_len` chunks; keeps the partial tail."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self._buf = np.zeros(0, dtype=np.int32)
        self._pos = 0

    def feed(self, doc: np.ndarray) -> None:
        self._buf = np.concatenate([self._buf[self._pos :], doc])
        self._pos = 0

    def pop(self) -> np.ndarray | None:
        if len(self._buf) - self._pos < self.seq_len:
            return None
        chunk = self._buf[self._pos : self._pos + self.seq_len].copy()
        self._pos += self.seq_len
        return chunk

    def leftover(self) -> int:
        """Tokens waiting for a chunk (the tail dropped if the stream ends now)."""
        return len(self._buf) - self._pos

    def state_dict(self) -> dict:
        return {"carry": torch.from_numpy(self._buf[self._pos :].copy())}

    def load_state_dict(self, state: dict) -> None:
        self._buf = state["carry"].numpy().astype(np.int32, copy=True)
        self._pos = 0


class Truncator:
    """One sequence per document: its first `seq_len` tokens (unpadded here)."""

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len
        self._docs: deque[np.ndarray] = deque()

    def feed(self, doc: np.ndarray) -> None:
        self._docs.append(doc[: self.seq_len].copy())

    def pop(self) -> np.ndarray | None:
        return self._docs.popleft() if self._docs else None

    def leftover(self) -> int:
        return sum(len(d) for d in self._docs)

    def state_dict(self) -> dict:
        flat, lengths = _flat(list(self._docs))
        return {"docs": flat, "lengths": lengths}

    def load_state_dict(self, state: dict) -> None:
        self._docs = deque(_unflat(state["docs"], state["lengths"]))


class ShuffleBuffer:
    """A seeded shuffle buffer over sequences, with its state (contents and RNG) exportable.

    With `size` 0 it passes sequences through. Otherwise it holds up to `size` sequences of at
    most `width` tokens and, once full, hands out a uniformly chosen one for each one put in, as
    `datasets` and tf.data do. The contents live in one preallocated (size, width) array, so its
    state is one copy, not a list of arrays (it is taken after every batch).
    """

    def __init__(self, size: int, width: int, seed: Sequence[int] | int) -> None:
        if size < 0:
            raise ValueError(f"shuffle_buffer={size!r} must be >= 0")
        self.size = size
        self.rng = np.random.default_rng(seed)
        self._items = np.zeros((size, width), dtype=np.int32)  # (S, T)
        self._lengths = np.zeros(size, dtype=np.int64)
        self.count = 0

    def _take(self, i: int) -> np.ndarray:
        return self._items[i, : self._lengths[i]].copy()

    def _put(self, i: int, item: np.ndarray) -> None:
        self._items[i, : len(item)] = item
        self._lengths[i] = len(item)

    def push(self, item: np.ndarray) -> np.ndarray | None:
        """Put `item` in; return the sequence to hand out now (None while filling)."""
        if self.size == 0:
            return item
        if self.count < self.size:
            self._put(self.count, item)
            self.count += 1
            return None
        i = int(self.rng.integers(self.size))
        out = self._take(i)
        self._put(i, item)
        return out

    def pop_random(self) -> np.ndarray | None:
        """Take out one held sequence at random (at the end of the data); None when empty."""
        if self.count == 0:
            return None
        i = int(self.rng.integers(self.count))
        out = self._take(i)
        last = self.count - 1
        self._items[i], self._lengths[i] = self._items[last], self._lengths[last]
        self.count = last
        return out

    def drain(self) -> Iterator[np.ndarray]:
        """Empty the buffer in random order."""
        while (item := self.pop_random()) is not None:
            yield item

    def state_dict(self) -> dict:
        n = self.count
        return {
            "items": torch.from_numpy(self._items[:n].copy()),
            "lengths": torch.from_numpy(self._lengths[:n].copy()),
            "rng": self.rng.bit_generator.state,
        }

    def load_state_dict(self, state: dict) -> None:
        n = len(state["lengths"])
        if n > self.size:
            raise ValueError(f"a shuffle state of {n} items does not fit a buffer of {self.size}")
        self._items[:n] = state["items"].numpy()
        self._lengths[:n] = state["lengths"].numpy()
        self.count = n
        self.rng.bit_generator.state = state["rng"]


def collate(
    sequences: Sequence[np.ndarray], seq_len: int, mode: str, pad_id: int
) -> dict[str, torch.Tensor]:
    """Sequences -> `{"input_ids", "labels", "attention_mask"}`, LongTensors of shape (B, T).

    In `pack` mode every sequence is full and labels equal input_ids (the model shifts). In
    `truncate` mode positions past a document's end hold `pad_id`, attention_mask 0, label -100.
    """
    batch = len(sequences)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((batch, seq_len), dtype=torch.long)  # (B, T)
    for i, seq in enumerate(sequences):
        n = len(seq)
        if mode == "pack" and n != seq_len:
            raise ValueError(f"pack mode needs full sequences of {seq_len} tokens, got {n}")
        input_ids[i, :n] = torch.from_numpy(np.asarray(seq, dtype=np.int64))
        attention_mask[i, :n] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)  # (B, T)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def iter_token_documents(
    source: DocumentSource,
    examples: Iterator[dict],
    tokenizer: PreTrainedTokenizerBase,
    eos_id: int | None,
    batch_docs: int = TOKENIZE_BATCH,
) -> Iterator[np.ndarray]:
    """Tokenised documents (each followed by EOS), tokenising `batch_docs` texts at a time."""
    texts = source.texts(examples)
    while True:
        batch = [t for _, t in zip(range(batch_docs), texts)]
        if not batch:
            return
        yield from tokenize_documents(tokenizer, batch, eos_id)


def packed_sequences(
    data_files: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: str | os.PathLike | PreTrainedTokenizerBase,
    seq_len: int = 1024,
    rank: int = 0,
    world_size: int = 1,
    text_column: str = "text",
    *,
    shuffle_buffer: int = 0,
    seed: int = 0,
    eos_token_id: int | None = None,
) -> Iterator[list[int]]:
    """Yield `seq_len`-token chunks (lists of ids) of the rank's documents, packed with EOS.

    With one rank the chunks laid end to end are the documents' tokens, each followed by EOS, in
    file order (files in the order given, globs sorted), up to the last partial chunk, which is
    dropped. Over the ranks of a world (documents split with `split_dataset_by_node`), each token
    is in at most one rank's chunks and each rank drops at most one partial chunk.
    `shuffle_buffer > 0` shuffles chunks in a seeded buffer of that many chunks.

    Raises:
        FileNotFoundError / ValueError: bad files or columns (see `sources`), a tokenizer without
            EOS, or a rank whose share holds no document or fewer tokens than one chunk.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be >= 1")
    tok = load_tokenizer(tokenizer)
    eos = _eos_token_id(tok, eos_token_id)
    source = DocumentSource.create(data_files, text_column=text_column)
    examples = iter(source.open(rank, world_size))
    packer = Packer(seq_len)
    shuffler = ShuffleBuffer(shuffle_buffer, seq_len, seed=[seed, rank])
    n_docs = n_chunks = 0
    for doc in iter_token_documents(source, examples, tok, eos):
        n_docs += 1
        packer.feed(doc)
        while (chunk := packer.pop()) is not None:
            if (out := shuffler.push(chunk)) is not None:
                n_chunks += 1
                yield out.tolist()
    for out in shuffler.drain():
        n_chunks += 1
        yield out.tolist()
    if n_docs == 0:
        raise ValueError(
            f"rank {rank} of {world_size} received no document from {source.describe()}"
        )
    if n_chunks == 0:
        raise ValueError(
            f"rank {rank} of {world_size}: its {n_docs} document(s) hold {packer.leftover()} "
            "tokens, "
            f"fewer than one chunk of seq_len={seq_len}; nothing to yield"
        )
