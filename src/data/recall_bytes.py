"""The byte recall corpus: a generated key-value recall corpus on a byte-level vocabulary.

The embedded default's data (``RecallDataModule``): it exists so that the tiny pipeline runs
offline with nothing downloaded. Its sibling ``recall.py`` generates English facts for real
tokenizers; this one is bytes, small enough to learn in minutes on a CPU.

Each document is ``seq_len`` bytes of lowercase filler words, with facts and recalls inserted:

    fact    "#Kv"      K an uppercase key (unique in the document), v a random lowercase value
    recall  "?Kv"      the same key and value, ``distance`` positions after the fact's key

The value of a recall can only be predicted by finding the fact: ``distance < window`` makes it
a *near* recall (the SWA branch can see it), ``distance >= far_min`` a *far* one (only full
attention or the LA branch can). Token id = byte value: the tokenizer is the data package's
``byte_level_tokenizer`` (``<eos>`` = 256, ``<pad>`` = 257, ``<bos>`` = 258).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .buckets import range_buckets
from .resume import ResumableDataLoader, ResumableTrainData
from .tokenization import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, byte_level_tokenizer

__all__ = [
    "EOS_ID",
    "MC_TASKS",
    "PAD_ID",
    "VOCAB_SIZE",
    "RecallCorpus",
    "RecallDataModule",
    "byte_tokenizer",
    "make_recall_corpus",
    "write_recall_mc_tasks",
]

PAD_ID, EOS_ID, VOCAB_SIZE = BYTE_PAD_ID, BYTE_EOS_ID, BYTE_VOCAB_SIZE


#: the corpus's tokenizer: the data package's byte-level one
byte_tokenizer = byte_level_tokenizer


@dataclass
class RecallCorpus:
    """``input_ids`` (N, T) long; ``answers`` (M, 3) long rows ``(doc, position, distance)``:
    the token at ``position`` is a recalled value whose fact's value sits ``distance`` earlier.
    Near recalls have distances in ``[3, near_max]``, far ones in ``[far_min, far_max]``: the
    split is fixed by the data, whatever window a model is later evaluated with."""

    input_ids: torch.Tensor
    answers: torch.Tensor
    near_max: int
    far_min: int
    far_max: int

    def buckets(self, n_far: int = 3) -> list[tuple[str, int, int]]:
        """``(name, lo, hi)`` distance buckets, bounds inclusive: ``near`` and ``n_far`` equal
        slices of the far range (``d150-233`` ...; ``buckets.range_buckets``)."""
        return range_buckets(3, self.near_max, self.far_min, self.far_max, n_far)


TASKS = ("kv", "marker")


def make_recall_corpus(num_docs: int, seq_len: int, *, near_max: int, far_min: int,
                       far_max: int, facts_per_doc: int = 6, filler: str = string.ascii_lowercase,
                       task: str = "kv", seed: int = 0) -> RecallCorpus:
    """Generate documents as described in the module docstring; half the recalls near
    (distance in ``[3, near_max]``), half far (``[far_min, far_max]``). ``filler``: the letters
    filler words are drawn from (fewer letters: less noise around the recalls, faster to learn).

    ``task="marker"`` is the easier variant: one secret uppercase letter ``S`` per document,
    stated once as ``#S`` and recalled as ``?S`` again and again, each recall ``distance`` after
    the previous occurrence of ``S``; finding it takes one content-based attention lookup (no
    induction circuit), so a small model learns it in a few hundred steps, while an SWA branch
    still cannot see a far one. ``facts_per_doc`` is unused there."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not valid; choose one of {', '.join(TASKS)}")
    if not 3 <= near_max < far_min <= far_max < seq_len - 3:
        raise ValueError(f"need 3 <= near_max ({near_max}) < far_min ({far_min}) <= far_max "
                         f"({far_max}) < seq_len - 3 ({seq_len - 3})")
    rng = np.random.default_rng(seed)
    lower = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
    upper = np.frombuffer(string.ascii_uppercase.encode(), dtype=np.uint8)
    fill = np.frombuffer(filler.encode(), dtype=np.uint8)
    if not len(fill) or any(chr(c) in string.ascii_uppercase + "#?" for c in fill):
        raise ValueError(f"filler={filler!r} must be non-empty and use no uppercase, '#' or '?'")
    docs = np.empty((num_docs, seq_len), dtype=np.int64)
    answers = []
    for d in range(num_docs):
        row = _filler(rng, fill, seq_len)
        if task == "marker":
            docs[d] = row
            _marker_doc(docs[d], d, rng, upper, near_max, far_min, far_max, answers)
            continue
        used = np.zeros(seq_len, dtype=bool)
        keys = rng.permutation(upper)[:facts_per_doc]
        for j, key in enumerate(keys):
            lo, hi = (3, near_max) if j % 2 == 0 else (far_min, far_max)
            for _ in range(50):  # rejection sampling of a free slot pair
                dist = int(rng.integers(lo, hi + 1))
                f = int(rng.integers(0, seq_len - dist - 3))
                r = f + dist
                if not used[f:f + 3].any() and not used[r:r + 3].any() and r + 3 <= seq_len \
                        and abs(r - f) >= 3:
                    val = int(rng.choice(lower))
                    row[f:f + 3] = [ord("#"), int(key), val]
                    row[r:r + 3] = [ord("?"), int(key), val]
                    used[f:f + 3] = used[r:r + 3] = True
                    answers.append((d, r + 2, dist))
                    break
        docs[d] = row
    return RecallCorpus(torch.from_numpy(docs), torch.tensor(answers, dtype=torch.long),
                        near_max=near_max, far_min=far_min, far_max=far_max)


def _filler(rng, fill: np.ndarray, length: int) -> np.ndarray:
    """Filler: words of 2-6 letters drawn from ``fill``, separated by spaces; (length,) int64."""
    row = rng.choice(fill, size=length).astype(np.int64)
    pos = 0
    while pos < length:
        pos += int(rng.integers(2, 7))
        if pos < length:
            row[pos] = ord(" ")
        pos += 1
    return row


#: the multiple-choice tasks of ``write_recall_mc_tasks``, per corpus task:
#: name -> (context length range or None, facts in the context, distance regime)
MC_TASKS: dict[str, dict[str, tuple[tuple[int, int] | None, int, str]]] = {
    "kv": {
        "recall_mc_short_1": ((24, 56), 1, "near"),  # the whole question fits a 64-token window
        "recall_mc_short_3": ((32, 60), 3, "near"),
        "recall_mc_far": (None, 3, "far"),           # the asked fact beyond the window
    },
    "marker": {
        "recall_mc_short_1": ((24, 56), 1, "near"),
        "recall_mc_far": (None, 1, "far"),
    },
}


def write_recall_mc_tasks(root, *, task: str = "kv", n_docs: int = 256, near_max: int = 63,
                          far_min: int = 150, far_max: int = 400,
                          filler: str = string.ascii_lowercase, seed: int = 0) -> list[str]:
    """Multiple-choice recall tasks in lm-eval's format (a YAML and a JSONL per task) under
    ``root``, built like the corpus's own documents (``task``: ``kv`` or ``marker``), for
    ``hedgecats evaluate --tasks root``.

    ``kv``: filler with ``#Kv`` facts (distinct keys) ending in ``?K`` for one of them; the
    choices are its value and three other lowercase letters. ``marker``: filler with the secret
    ``#S`` ending in ``?``; the choices are ``S`` and three other uppercase letters. ``acc``: the
    right choice gets the highest log-likelihood (chance 25%). ``recall_mc_short_*`` contexts
    are at most 60 tokens, so a 64-token window sees the whole question (the paper's regime,
    where most PIQA / ARC prompts fit the window); ``recall_mc_far`` asks for something
    ``far_min..far_max`` tokens back. Returns the task names. Deterministic in ``seed``.
    """
    import json
    from pathlib import Path

    if task not in MC_TASKS:
        raise ValueError(f"task={task!r} is not valid; choose one of {', '.join(MC_TASKS)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fill = np.frombuffer(filler.encode(), dtype=np.uint8)
    lower, upper = string.ascii_lowercase, string.ascii_uppercase
    for name, (span, n_facts, regime) in MC_TASKS[task].items():
        rows = []
        for i in range(n_docs):
            keys = [str(c) for c in rng.permutation(list(upper))[:n_facts]]
            vals = [lower[int(rng.integers(26))] for _ in keys]
            if regime == "near":
                length = int(rng.integers(span[0], span[1] + 1))
                dist = int(rng.integers(3, min(near_max, length - 3) + 1))
            else:
                dist = int(rng.integers(far_min, far_max + 1))
                length = dist + int(rng.integers(8, 64))
            row = _filler(rng, fill, length + (1 if task == "marker" else 0))
            if task == "marker":  # "#S" ... "?" -> S, S sitting `dist` before the answer
                s_pos = length + 1 - dist
                row[s_pos - 1:s_pos + 1] = [ord("#"), ord(keys[0])]
                row[length] = ord("?")
                row, answer, pool = row[:length + 1], keys[0], upper
            else:  # "#Kv" ... "?K" -> v, v sitting `dist` before the answer
                v_pos = length - dist
                row[v_pos - 2:v_pos + 1] = [ord("#"), ord(keys[0]), ord(vals[0])]
                taken = set(range(v_pos - 2, v_pos + 1)) | {length - 2, length - 1}
                for key, val in zip(keys[1:], vals[1:]):  # the others anywhere before the query
                    for _ in range(100):
                        f = int(rng.integers(0, length - 5))
                        if not taken & set(range(f, f + 3)):
                            row[f:f + 3] = [ord("#"), ord(key), ord(val)]
                            taken |= set(range(f, f + 3))
                            break
                row[length - 2:length] = [ord("?"), ord(keys[0])]
                row, answer, pool = row[:length], vals[0], lower
            others = [c for c in pool if c != answer]
            choices = [answer, *(others[j] for j in rng.choice(len(others), size=3, replace=False))]
            order = rng.permutation(4)
            rows.append({"id": i, "context": bytes(row.tolist()).decode("ascii"),
                         "choices": [choices[j] for j in order],
                         "label": int(np.where(order == 0)[0][0]), "distance": dist})
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\n"
            "dataset_path: json\n"
            f"dataset_kwargs:\n  data_files:\n    test: {data.resolve()}\n"
            "test_split: test\n"
            "output_type: multiple_choice\n"
            "doc_to_text: \"{{context}}\"\n"
            "doc_to_choice: \"{{choices}}\"\n"
            "doc_to_target: label\n"
            "target_delimiter: \"\"\n"  # the answer follows the query directly, as in training
            "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
            "metadata:\n  version: 1.0\n")
    return list(MC_TASKS[task])


def _marker_doc(row, d, rng, upper, near_max, far_min, far_max, answers) -> None:
    """Write "#S" then "?S" recalls into ``row`` in place (see ``make_recall_corpus``)."""
    T = len(row)
    secret = int(rng.choice(upper))
    # after the first 8 tokens, so that attention sinks (sinks_only keeps keys < 8) cannot see it
    start = int(rng.integers(8, 16))
    row[start:start + 2] = [ord("#"), secret]
    last = start + 1  # position of the latest occurrence of the secret
    while True:
        lo, hi = (3, near_max) if rng.random() < 0.5 else (far_min, far_max)
        dist = int(rng.integers(lo, hi + 1))
        pos = last + dist  # where the recalled secret goes; "?" just before it
        if pos >= T:
            break
        row[pos - 1:pos + 1] = [ord("?"), secret]
        answers.append((d, pos, dist))
        last = pos


class RecallDataModule(ResumableTrainData, pl.LightningDataModule):
    """Train / validation / test splits of ``make_recall_corpus`` (different seeds).

    Resumes exactly, as every DataModule of the data package: the train loader is a managed
    ``resume.ResumableDataLoader`` whose per-rank states the DataModule saves and restores
    (``resume.ResumableTrainData``), so a resumed run continues right after the batches the
    restored run trained on.

    Args:
        seq_len: T. window: the hybrid's SWA window; recalls at distance ``< window`` are near.
        far_min, far_max: distances of far recalls. facts_per_doc: facts (and recalls) per
            document. filler: letters of the filler words. task: ``kv`` or ``marker``
            (see ``make_recall_corpus``). num_train, num_val, num_test: documents.
        batch_size: per process. seed: corpus seed (splits use seed, seed+1, seed+2).
    """

    def __init__(self, seq_len: int = 256, window: int = 32, far_min: int = 64, far_max: int = 200,
                 facts_per_doc: int = 6, filler: str = string.ascii_lowercase,
                 task: str = "kv", num_train: int = 4096, num_val: int = 128,
                 num_test: int = 256, batch_size: int = 16, seed: int = 0,
                 shuffle: bool = True) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 (documents per "
                             "batch and process)")
        self.save_hyperparameters()
        self.tokenizer = None
        self._splits: dict[str, RecallCorpus] = {}
        self._train_loader: ResumableDataLoader | None = None
        self._resume_state: dict | None = None

    def _corpus(self, split: str) -> RecallCorpus:
        if split not in self._splits:
            h = self.hparams
            n, off = {"train": (h.num_train, 0), "val": (h.num_val, 1), "test": (h.num_test, 2)}[split]
            self._splits[split] = make_recall_corpus(
                n, h.seq_len, near_max=h.window - 1, far_min=h.far_min, far_max=h.far_max,
                facts_per_doc=h.facts_per_doc, filler=h.filler, task=h.task,
                seed=h.seed * 1000 + off)
        return self._splits[split]

    def setup(self, stage: str | None = None) -> None:
        self.tokenizer = byte_tokenizer()

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        ds = TensorDataset(self._corpus(split).input_ids)
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer else (0, 1)
        # a DistributedSampler, which Lightning leaves in place under DDP and pads to equal shard
        # lengths (uneven data never desynchronises ranks)
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle,
                                     seed=self.hparams.seed, drop_last=False)
        # a generator of its own: creating an iterator must not draw from the global RNG, whose
        # state a resumed run restores (SSD draws from it)
        kwargs = {"batch_size": self.hparams.batch_size, "sampler": sampler,
                  "collate_fn": _collate,
                  "generator": torch.Generator().manual_seed(self.hparams.seed)}
        if split != "train":
            return DataLoader(ds, **kwargs)
        return self._track_train_loader(ResumableDataLoader(
            ds, rank=rank, world_size=world, managed=True,
            epoch=trainer.current_epoch if trainer is not None else 0, **kwargs))

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.hparams.shuffle)

    def train_batches_per_epoch(self, world_size: int = 1) -> int:
        """Batches of one epoch on each of ``world_size`` processes (the sampler pads the
        shards to equal length), without generating the corpus."""
        per_rank = -(-self.hparams.num_train // world_size)
        return -(-per_rank // self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)

    def test_corpus(self) -> RecallCorpus:
        return self._corpus("test")


def _collate(rows) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
