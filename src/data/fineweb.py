"""`FineWebEduDataModule`: FineWeb-Edu (or local files like it), packed, sharded, exactly resumable.

Usage in a LightningCLI config (the tokenizer is the model's path or hub id)::

    data:
      class_path: hedgecats.data.FineWebEduDataModule
      init_args:
        tokenizer: meta-llama/Meta-Llama-3-8B
        seq_len: 1024
        global_batch_size: 64
        micro_batch_size: 8        # 8 per device; accumulation is derived
        tokens_per_epoch: 25000000

Gradient accumulation: the DataModule derives it (`accumulate_grad_batches` =
global_batch_size / (world_size * micro_batch_size)) and, in `setup()`, writes it into
`trainer.accumulate_grad_batches` when the LightningModule uses automatic optimisation, so a
config sets the global batch once and nothing else. A Trainer given a different explicit
`accumulate_grad_batches` is an error. A LightningModule with manual optimisation accumulates
itself and reads `trainer.datamodule.accumulate_grad_batches`.

Resume (`resume.ResumableTrainData`): the train loader is a `resume.ResumableDataLoader`;
`state_dict()` gathers every rank's loader state, taken after the batches Lightning actually handed to `training_step`, and
`load_state_dict()` gives each rank its own. Resuming needs the same world size, `num_workers`,
batch sizes, `seq_len` and `packing` (checked, with a clear error).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .packing import check_mode
from .resume import (
    ResumableDataLoader,
    ResumableTrainData,
    all_gather_objects,
)
from .sources import DocumentSource
from .streaming import PackedBatchStream
from .tokenization import eos_token_id, load_tokenizer, pad_token_id


@dataclass(frozen=True)
class BatchPlan:
    """Batch sizes and per-epoch counts derived from the global batch and the world size."""

    world_size: int
    global_batch_size: int  # sequences per optimizer step, all ranks together
    micro_batch_size: int  # sequences per forward/backward on one device
    accumulate_grad_batches: int  # micro-batches per optimizer step on each device
    steps_per_epoch: int  # optimizer steps per epoch
    train_batches: int  # micro-batches per epoch on each rank
    val_batches: int  # validation micro-batches on each rank
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


def plan_batches(
    *,
    world_size: int,
    global_batch_size: int,
    micro_batch_size: int | None,
    seq_len: int,
    tokens_per_epoch: int,
    val_tokens: int,
) -> BatchPlan:
    """Derive per-device batch, accumulation and epoch length; raise when they do not divide."""
    for name, value, low in (
        ("world_size", world_size, 1),
        ("global_batch_size", global_batch_size, 1),
        ("seq_len", seq_len, 1),
        ("tokens_per_epoch", tokens_per_epoch, 1),
        ("val_tokens", val_tokens, 0),
    ):
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    if global_batch_size % world_size:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by world_size={world_size}: "
            "every device needs the same batch; pick a global batch that is a multiple of the "
            "world size"
        )
    per_device = global_batch_size // world_size
    micro = per_device if micro_batch_size is None else micro_batch_size
    if not isinstance(micro, int) or micro < 1 or per_device % micro:
        divisors = [d for d in range(1, per_device + 1) if per_device % d == 0]
        raise ValueError(
            f"micro_batch_size={micro_batch_size!r} does not divide the per-device batch "
            f"{per_device} (global_batch_size={global_batch_size} / world_size={world_size}); "
            f"choose one of {divisors}"
        )
    accumulate = per_device // micro
    steps = tokens_per_epoch // (global_batch_size * seq_len)
    if steps == 0:
        raise ValueError(
            f"tokens_per_epoch={tokens_per_epoch} is less than one optimizer step "
            f"({global_batch_size} x {seq_len} = {global_batch_size * seq_len} tokens)"
        )
    val_batches = val_tokens // (seq_len * world_size * micro)
    if val_tokens and val_batches == 0:
        raise ValueError(
            f"val_tokens={val_tokens} is less than one validation batch per rank "
            f"({world_size} ranks x {micro} x {seq_len} = {world_size * micro * seq_len} tokens); "
            "raise it, or set 0 for no validation"
        )
    return BatchPlan(
        world_size=world_size,
        global_batch_size=global_batch_size,
        micro_batch_size=micro,
        accumulate_grad_batches=accumulate,
        steps_per_epoch=steps,
        train_batches=steps * accumulate,
        val_batches=val_batches,
        seq_len=seq_len,
    )


class FineWebEduDataModule(ResumableTrainData, pl.LightningDataModule):
    """FineWeb-Edu streamed with `datasets`, tokenised, packed, split across ranks, resumable.

    Batches are `{"input_ids", "labels", "attention_mask"}`, LongTensors (B, T) with
    B = micro-batch, T = seq_len; in `pack` mode labels equal input_ids (the model shifts) and the
    mask is all ones; in `truncate` mode padding has mask 0 and label -100.

    An epoch is `tokens_per_epoch // (global_batch_size * seq_len)` optimizer steps; each epoch is
    a new pass over the same slice of the stream, reshuffled (see `streaming`). The validation
    slice (`val_tokens`, split over ranks) is the head of each rank's stream, never trained on.

    Args:
        tokenizer: the model's tokenizer, or a path / hub id for `AutoTokenizer.from_pretrained`.
        data_files: local parquet or jsonl files (globs, directories) with a `text_column`;
            None streams `path` / `name` from the hub.
        path, name, split: the hub dataset (default FineWeb-Edu `sample-10BT`).
        text_column: the column holding documents.
        seq_len: tokens per sequence.
        global_batch_size: sequences per optimizer step, all devices together.
        micro_batch_size: sequences per device per forward; None = global / world size.
        tokens_per_epoch: training tokens per epoch (the budget).
        val_tokens: validation tokens, all ranks together (0: no validation).
        packing: "pack" (documents joined with EOS, cut into full chunks) or "truncate" (one document
            per sequence, first seq_len tokens, padded).
        num_workers: DataLoader workers per rank (at most the files of a rank's share; fewer are
            used, with a warning, when there are fewer files).
        shuffle_buffer: sequences in the training shuffle buffer (0: stream order).
        seed: shuffle seed.
        pin_memory: pin batches (default: when CUDA is available).
    """

    def __init__(
        self,
        tokenizer: str | os.PathLike | PreTrainedTokenizerBase,
        data_files: str | Sequence[str] | None = None,
        path: str = "HuggingFaceFW/fineweb-edu",
        name: str | None = "sample-10BT",
        split: str = "train",
        text_column: str = "text",
        seq_len: int = 1024,
        global_batch_size: int = 64,
        micro_batch_size: int | None = None,
        tokens_per_epoch: int = 25_000_000,
        val_tokens: int = 1_048_576,
        packing: str = "pack",
        num_workers: int = 0,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])
        check_mode(packing)
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers!r} must be >= 0")
        self.tokenizer_arg = tokenizer
        self.data_files = data_files
        self.path, self.name, self.split = path, name, split
        self.text_column = text_column
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size_arg = micro_batch_size
        self.tokens_per_epoch = tokens_per_epoch
        self.val_tokens = val_tokens
        self.packing = packing
        self.num_workers = num_workers
        self.shuffle_buffer = shuffle_buffer
        self.seed = seed
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory

        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.source: DocumentSource | None = None
        self.plan: BatchPlan | None = None
        self.rank, self.world_size = 0, 1
        self.workers = num_workers  # after capping to the files available
        self._train_loader: ResumableDataLoader | None = None
        self._resume_state: dict | None = None

    # -- sizes ---------------------------------------------------------------------------------

    def _plan(self, world_size: int) -> BatchPlan:
        return plan_batches(
            world_size=world_size,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self.micro_batch_size_arg,
            seq_len=self.seq_len,
            tokens_per_epoch=self.tokens_per_epoch,
            val_tokens=self.val_tokens,
        )

    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step on each device (for the current world size)."""
        return (self.plan or self._plan(self._world()[1])).accumulate_grad_batches

    @property
    def micro_batch_size(self) -> int:
        return (self.plan or self._plan(self._world()[1])).micro_batch_size

    @property
    def steps_per_epoch(self) -> int:
        return (self.plan or self._plan(self._world()[1])).steps_per_epoch

    def train_batches_per_epoch(self, world_size: int = 1) -> int:
        """Micro-batches of one epoch on each of ``world_size`` processes, without reading
        data (raises for batch sizes that do not divide, as ``setup`` does)."""
        return self._plan(world_size).train_batches

    # -- Lightning hooks -----------------------------------------------------------------------

    def setup(self, stage: str | None = None) -> None:
        self.rank, self.world_size = self._world()
        self.plan = self._plan(self.world_size)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(self.tokenizer_arg)
        self._eos = eos_token_id(self.tokenizer)
        self._pad = pad_token_id(self.tokenizer, self._eos)
        if self.source is None:
            self.source = DocumentSource.create(
                self.data_files,
                path=self.path,
                name=self.name,
                split=self.split,
                text_column=self.text_column,
            )
        self._check_shards()
        self._sync_trainer_accumulation()

    def _check_shards(self) -> None:
        """Every rank opens its share and reads one document; any failure fails every rank."""
        error, n_shards = None, 0
        try:
            ds = self.source.open(self.rank, self.world_size)
            n_shards = ds.num_shards
            if next(self.source.texts(iter(ds)), None) is None:
                error = (
                    f"rank {self.rank}/{self.world_size} received no document from "
                    f"{self.source.describe()}"
                )
        except Exception as e:  # gathered so that other ranks fail too instead of hanging
            if self.world_size == 1:
                raise
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
        errors = [e for e in all_gather_objects(error) if e]
        if errors:
            raise ValueError("the data cannot be streamed on every rank:\n" + "\n".join(errors))
        self.workers = self.num_workers
        if self.num_workers > n_shards:
            warnings.warn(
                f"num_workers={self.num_workers} but rank {self.rank}'s share of "
                f"{self.source.describe()} has {n_shards} file(s); using {n_shards} worker(s) "
                "(datasets gives workers whole files)",
                stacklevel=2,
            )
            self.workers = n_shards

    def _sync_trainer_accumulation(self) -> None:
        trainer = self.trainer
        if trainer is None or trainer.lightning_module is None:
            return
        if not trainer.lightning_module.automatic_optimization:
            return  # manual optimisation reads self.accumulate_grad_batches itself
        ours, theirs = self.plan.accumulate_grad_batches, trainer.accumulate_grad_batches
        if theirs not in (1, ours):
            raise ValueError(
                f"Trainer(accumulate_grad_batches={theirs}) disagrees with the DataModule's "
                f"{ours} (global_batch_size={self.global_batch_size}, "
                f"world_size={self.world_size}, micro_batch_size={self.plan.micro_batch_size}); "
                "set micro_batch_size on the DataModule "
                "and leave the Trainer's at 1"
            )
        trainer.accumulate_grad_batches = ours

    def _stream(self, split: str) -> PackedBatchStream:
        plan = self.plan
        return PackedBatchStream(
            self.source,
            self.tokenizer,
            seq_len=self.seq_len,
            batch_size=plan.micro_batch_size,
            num_batches=plan.train_batches,
            val_batches=plan.val_batches,
            split=split,
            mode=self.packing,
            rank=self.rank,
            world_size=self.world_size,
            shuffle_buffer=self.shuffle_buffer,
            seed=self.seed,
            eos_id=self._eos,
            pad_id=self._pad,
        )

    def train_dataloader(self) -> ResumableDataLoader:
        if self.plan is None:
            self.setup("fit")
        loader = ResumableDataLoader(
            self._stream("train"),
            batch_size=None,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            rank=self.rank,
            world_size=self.world_size,
            managed=True,
            epoch=self.trainer.current_epoch if self.trainer is not None else 0,
        )
        return self._track_train_loader(loader)

    def val_dataloader(self) -> DataLoader | list:
        if self.plan is None:
            self.setup("fit")
        if self.plan.val_batches == 0:
            return []
        return DataLoader(
            self._stream("val"),
            batch_size=None,
            num_workers=self.workers,
            pin_memory=self.pin_memory,
        )
