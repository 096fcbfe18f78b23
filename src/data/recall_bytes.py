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

The regime axis ``q`` (``RecallDataModule(far_share=q)``, docs/testbed.md#regime): a share ``q`` of
the train and validation documents are the corpus's own (near and far recalls mixed), the rest
have near recalls only; the test documents do not depend on ``q``.
"""

from __future__ import annotations

import math
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
    "far_documents",
    "make_recall_corpus",
    "make_regime_corpus",
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

    def stats(self) -> dict[str, int | float]:
        """What the corpus holds: documents, those with at least one far recall, near and far
        recalls, the share of positions that are filler (lowercase words and their spaces, not a
        ``#`` / ``?`` marker or an uppercase key) and how many letters the filler uses."""
        ids, answers = self.input_ids, self.answers.reshape(-1, 3)
        doc, dist = answers[:, 0], answers[:, 2]
        far = dist >= self.far_min
        marked = (ids == ord("#")) | (ids == ord("?")) | ((ids >= ord("A")) & (ids <= ord("Z")))
        return {"docs": int(ids.shape[0]),
                "docs_with_far": int(torch.unique(doc[far]).numel()),
                "near_recalls": int((~far).sum()), "far_recalls": int(far.sum()),
                "filler_share": float((~marked).float().mean()) if ids.numel() else 0.0,
                "filler_letters": int(torch.unique(ids[(ids >= ord("a")) & (ids <= ord("z"))])
                                      .numel())}


TASKS = ("kv", "marker")


def make_recall_corpus(num_docs: int, seq_len: int, *, near_max: int, far_min: int,
                       far_max: int, facts_per_doc: int = 6, filler: str = string.ascii_lowercase,
                       task: str = "kv", seed: int = 0, far_recalls: bool = True) -> RecallCorpus:
    """Generate documents as described in the module docstring; half the recalls near
    (distance in ``[3, near_max]``), half far (``[far_min, far_max]``); with ``far_recalls``
    false every recall is near. ``filler``: the letters filler words are drawn from (fewer
    letters: less noise around the recalls, faster to learn).

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
            _marker_doc(docs[d], d, rng, upper, near_max, far_min, far_max, answers,
                        far_recalls)
            continue
        used = np.zeros(seq_len, dtype=bool)
        keys = rng.permutation(upper)[:facts_per_doc]
        for j, key in enumerate(keys):
            lo, hi = (3, near_max) if j % 2 == 0 or not far_recalls else (far_min, far_max)
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


#: seeds of a split's regime documents, added to the split's own seed (``seed * 1000 + 0/1/2``
#: in ``RecallDataModule``): its near-only documents, and the choice of the documents with far
#: recalls
NEAR_ONLY_SEED_OFFSET = 10
FAR_CHOICE_SEED_OFFSET = 20


def far_share_error(far_share, splits: dict[str, int]) -> str | None:
    """Why ``far_share`` cannot split documents ``splits`` (``{split name: documents}``) into
    some with far recalls and some with near recalls only (``None``: it can). ``far_share``
    must be a number in [0, 1]; each split must get at least one document of each kind that the
    share asks for (``far_documents`` rounds ``far_share * n`` half up)."""
    if isinstance(far_share, bool) or not isinstance(far_share, (int, float)) or \
            not 0.0 <= far_share <= 1.0:
        return (f"far_share={far_share!r} must be a number in [0, 1]: the share q of train and "
                "validation documents with far recalls (null: the corpus as it is, every "
                "document mixing near and far recalls)")
    for split, n in splits.items():
        if _kinds_present(far_share, n):
            continue
        least = _fewest_docs(far_share)
        advice = (f"give {split} at least {least} document{'s' * (least != 1)}" if least else
                  f"give {split} more documents")
        if n <= 0:
            return f"far_share={far_share!r} with {split}={n}: the split has no documents; {advice}"
        n_far = _n_far(far_share, n)
        kind, count = (("far recalls", far_share * n) if far_share > 0 and n_far == 0 else
                       ("near recalls only", (1 - far_share) * n))
        return (f"far_share={far_share!r} leaves {split}={n} with no document with {kind} "
                f"({count:.3g} documents round to 0): {advice}, or choose another far_share")
    return None


def _n_far(far_share: float, n: int) -> int:
    return math.floor(far_share * n + 0.5)  # half up, whatever Python's round does with .5


def _kinds_present(far_share: float, n: int) -> bool:
    """Whether ``n`` documents at ``far_share`` hold each kind the share asks for."""
    n_far = _n_far(far_share, n)
    return (far_share == 0 or n_far >= 1) and (far_share == 1 or n - n_far >= 1)


def _fewest_docs(far_share: float) -> int | None:
    """The fewest documents a split needs at ``far_share`` (``None`` past 10^9)."""
    if 0 < far_share <= 1e-9:
        return None
    guess = max(1, math.floor(0.5 / far_share) if far_share > 0 else 1,
                math.floor(0.5 / (1 - far_share)) if far_share < 1 else 1)
    for n in range(guess, guess + 4):
        if _kinds_present(far_share, n):
            return n
    return None


def far_documents(num_docs: int, far_share: float, seed: int) -> torch.Tensor:
    """Which of ``num_docs`` documents have far recalls: (num_docs,) bool, ``far_share *
    num_docs`` of them (rounded half up), chosen by a permutation drawn from ``seed``. The
    choice is nested: the documents with far recalls at a share are among those at any larger
    share (same seed), so runs at different shares differ only in the documents swapped."""
    order = np.random.default_rng(seed).permutation(num_docs)
    far = torch.zeros(num_docs, dtype=torch.bool)
    far[torch.from_numpy(order[:_n_far(far_share, num_docs)])] = True
    return far


def make_regime_corpus(num_docs: int, seq_len: int, *, far_share: float, seed: int = 0,
                       **kwargs) -> RecallCorpus:
    """Documents of the regime axis (module docstring): ``far_documents(num_docs, far_share,
    seed + FAR_CHOICE_SEED_OFFSET)`` are those of ``make_recall_corpus(num_docs, seq_len,
    seed=seed, **kwargs)`` at the same index (so ``far_share`` 1 is that corpus, byte for
    byte), the others those of the same corpus with near recalls only, drawn from ``seed +
    NEAR_ONLY_SEED_OFFSET``. Answers are ordered by document, as ``make_recall_corpus``'s."""
    error = far_share_error(far_share, {"num_docs": num_docs})
    if error:
        raise ValueError(error)
    far = far_documents(num_docs, far_share, seed + FAR_CHOICE_SEED_OFFSET)
    kinds = []  # (corpus, its documents taken): each kind generated only where one is taken
    if far.any():
        kinds.append((make_recall_corpus(num_docs, seq_len, seed=seed, **kwargs), far))
    if not far.all():
        kinds.append((make_recall_corpus(num_docs, seq_len, seed=seed + NEAR_ONLY_SEED_OFFSET,
                                         far_recalls=False, **kwargs), ~far))
    ids = torch.empty_like(kinds[0][0].input_ids)
    for corpus, docs in kinds:
        ids[docs] = corpus.input_ids[docs]
    answers = torch.cat([_answers_of(corpus, docs) for corpus, docs in kinds])
    answers = answers[torch.argsort(answers[:, 0], stable=True)]
    first = kinds[0][0]
    return RecallCorpus(ids, answers, near_max=first.near_max, far_min=first.far_min,
                        far_max=first.far_max)


def _answers_of(corpus: RecallCorpus, docs: torch.Tensor) -> torch.Tensor:
    """The answer rows (M, 3) of ``corpus`` whose document is marked in ``docs`` (bool)."""
    answers = corpus.answers.reshape(-1, 3)
    return answers[docs[answers[:, 0]]]


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


def write_recall_mc_tasks(root, *, task: str = "kv", n_docs: int = 256, window: int = 64,
                          seq_len: int = 1024, far_min: int = 150, far_max: int = 400,
                          filler: str = string.ascii_lowercase, seed: int = 0) -> list[str]:
    """Multiple-choice recall tasks in lm-eval's format (a YAML and a JSONL per task) under
    ``root``, built like the corpus's own documents (``task``: ``kv`` or ``marker``), for
    ``hedgecats evaluate --tasks root``.

    ``kv``: filler with ``#Kv`` facts (distinct keys) ending in ``?K`` for one of them; the
    choices are its value and three other lowercase letters. ``marker``: filler with the secret
    ``#S`` ending in ``?``; the choices are ``S`` and three other uppercase letters. ``acc``: the
    right choice gets the highest log-likelihood (chance 25%). ``recall_mc_short_*`` contexts
    fit the ``window`` with their answer (at most 60 tokens for window 64: the paper's regime,
    where most PIQA / ARC prompts fit the window; ``MC_TASKS``' spans scale with the window);
    ``recall_mc_far`` asks for something ``far_min..far_max`` tokens back, its context and
    answer within ``seq_len`` (the length the model was trained on). The defaults are the
    testbed's 1,024 scale. Returns the task names. Deterministic in ``seed``.
    """
    import json
    from pathlib import Path

    if task not in MC_TASKS:
        raise ValueError(f"task={task!r} is not valid; choose one of {', '.join(MC_TASKS)}")
    if not 3 <= far_min <= far_max or far_max + 10 > seq_len or window < 16:
        raise ValueError(f"multiple-choice tasks need 3 <= far_min <= far_max <= seq_len - 10 and "
                         f"window >= 16; got far {far_min}-{far_max}, seq_len {seq_len}, window "
                         f"{window}")
    near_max = window - 1
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    fill = np.frombuffer(filler.encode(), dtype=np.uint8)
    lower, upper = string.ascii_lowercase, string.ascii_uppercase
    written = []
    for name, (span, n_facts, regime) in MC_TASKS[task].items():
        if regime == "near":
            lo, hi = _short_span(span, n_facts, window)
            if lo > hi:  # its facts and query do not fit the window
                continue
        written.append(name)
        rows = []
        for i in range(n_docs):
            keys = [str(c) for c in rng.permutation(list(upper))[:n_facts]]
            vals = [lower[int(rng.integers(26))] for _ in keys]
            if regime == "near":
                length = int(rng.integers(lo, hi + 1))
                dist = int(rng.integers(3, min(near_max, length - 3) + 1))
            else:
                dist = int(rng.integers(far_min, far_max + 1))
                length = dist + int(rng.integers(8, min(64, seq_len - dist - 1)))
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
    return written


def _short_span(span: tuple[int, int], n_facts: int, window: int) -> tuple[int, int]:
    """A short task's context lengths at ``window``: ``MC_TASKS``' span (written for window 64)
    scaled, and at least 4 tokens a fact and 4 more, so that its facts (3 tokens each) and the
    query (2) find room among the filler. ``lo > hi``: the task does not fit the window."""
    lo, hi = span[0] * window // 64, span[1] * window // 64
    return max(lo, 4 * n_facts + 4), hi


def _marker_doc(row, d, rng, upper, near_max, far_min, far_max, answers,
                far_recalls: bool = True) -> None:
    """Write "#S" then "?S" recalls into ``row`` in place (see ``make_recall_corpus``)."""
    T = len(row)
    secret = int(rng.choice(upper))
    # after the first 8 tokens, so that attention sinks (sinks_only keeps keys < 8) cannot see it
    start = int(rng.integers(8, 16))
    row[start:start + 2] = [ord("#"), secret]
    last = start + 1  # position of the latest occurrence of the secret
    while True:
        # the draw is made either way: the corpus with far recalls keeps its bytes
        lo, hi = (3, near_max) if rng.random() < 0.5 or not far_recalls else (far_min, far_max)
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
        batch_size: per process. seed: corpus seed (splits use seed * 1000 + 0, 1, 2).
        far_share: the regime axis ``q`` (``make_regime_corpus``): the share of train and
            validation documents with far recalls, the rest with near recalls only; the test
            documents are the same whatever its value. ``None``: every split as generated,
            each document mixing near and far recalls.
    """

    def __init__(self, seq_len: int = 256, window: int = 32, far_min: int = 64, far_max: int = 200,
                 facts_per_doc: int = 6, filler: str = string.ascii_lowercase,
                 task: str = "kv", num_train: int = 4096, num_val: int = 128,
                 num_test: int = 256, batch_size: int = 16, seed: int = 0,
                 shuffle: bool = True, far_share: float | None = None) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be an integer >= 1 (documents per "
                             "batch and process)")
        if far_share is not None:
            error = far_share_error(far_share, {"num_train": num_train, "num_val": num_val})
            if error:
                raise ValueError(error)
        self.save_hyperparameters()
        self.tokenizer = None
        self._splits: dict[str, RecallCorpus] = {}
        self._train_loader: ResumableDataLoader | None = None
        self._resume_state: dict | None = None

    def corpus(self, split: str) -> RecallCorpus:
        """The documents and answers of ``split`` (``train``, ``val`` or ``test``), generated
        once."""
        if split not in ("train", "val", "test"):
            raise ValueError(f"split={split!r} is not valid; choose one of train, val, test")
        if split not in self._splits:
            h = self.hparams
            n, off = {"train": (h.num_train, 0), "val": (h.num_val, 1), "test": (h.num_test, 2)}[split]
            kwargs = dict(near_max=h.window - 1, far_min=h.far_min, far_max=h.far_max,
                          facts_per_doc=h.facts_per_doc, filler=h.filler, task=h.task,
                          seed=h.seed * 1000 + off)
            if h.far_share is None or split == "test":
                self._splits[split] = make_recall_corpus(n, h.seq_len, **kwargs)
            else:
                self._splits[split] = make_regime_corpus(n, h.seq_len, far_share=h.far_share,
                                                         **kwargs)
        return self._splits[split]

    def setup(self, stage: str | None = None) -> None:
        self.tokenizer = byte_tokenizer()

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        ds = TensorDataset(self.corpus(split).input_ids)
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
        return self.corpus("test")


def _collate(rows) -> dict[str, torch.Tensor]:
    ids = torch.stack([r[0] for r in rows])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
