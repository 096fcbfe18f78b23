"""Exact resume of a data stream: a `StatefulDataLoader` that survives Lightning's traps.

torchdata's `StatefulDataLoader` saves where each worker is, but three things go wrong when
Lightning drives it (docs/reliability.md):

1. A training loop may fetch ahead (Lightning prefetches one batch when it does not know the
   loader's length), so "the loader's state now" is past the last batch trained on, and a resumed
   run skips a batch. `ResumableDataLoader` keeps the state after each of its last few batches and
   `state_at(consumed)` returns the state after the `consumed`-th batch of the epoch;
   `batches_consumed(trainer)` reads that number from Lightning's progress counters (the batches
   handed to `training_step`), whatever the fetcher did.
2. Lightning saves only rank 0's loader state. `all_gather_objects` collects every rank's state
   into the checkpoint; on restore each rank takes `states[rank]` (the DataModule does both in its
   `state_dict` / `load_state_dict`, which Lightning calls on every rank).
3. `trainer.estimated_stepping_batches` (or a strategy that restores after setup, like FSDP2's
   `ModelParallelStrategy`) builds and `iter()`s the train loader before the checkpoint is
   restored, and Lightning then never loads the loader state (Lightning issue 20550). Here
   `iter()` is lazy: the real iterator starts at the first batch, so a state that arrives after
   `iter()` but before the first batch still applies. A state that arrives after batches were
   fetched raises instead of being ignored.

Epochs: each fresh iteration is the next epoch; the loader calls `dataset.set_epoch(epoch)` (when
the dataset has it) before starting, and a state saved at the end of an epoch resumes at the start
of the next one.

A loader made with `managed=True` leaves its state to its owner (the DataModule): `state_dict()`
returns a small marker that Lightning stores in its loop state, and `load_state_dict(marker)` is
a no-op, so Lightning's rank-0 copy can never overwrite the per-rank state. The owner's side is
`ResumableTrainData`, the mixin every resumable DataModule of this package uses
(`fineweb.FineWebEduDataModule`, `recall_bytes.RecallDataModule`).
"""

from __future__ import annotations

import warnings
from collections import deque
from typing import Any

import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torchdata.stateful_dataloader import StatefulDataLoader

LOADER_STATE_FORMAT = "hedgecats.loader/1"
DATAMODULE_STATE_FORMAT = "hedgecats.datamodule/1"
_MANAGED_KEY = "hedgecats_state_managed_by"


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` in rank order (collective: call it on all ranks); `[obj]` without DDP."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def batches_consumed(trainer) -> int | None:
    """Batches of the current epoch that Lightning handed to `training_step` (None outside fit).

    This is `fit_loop.epoch_loop.batch_progress.current.ready`: at a checkpoint saved in
    `on_train_batch_end`, on validation end or at the end of an epoch, the loader must resume
    right after that many batches, whatever the fetcher has prefetched.
    """
    try:
        return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
    except AttributeError:
        return None


class ResumableDataLoader(StatefulDataLoader):
    """`StatefulDataLoader` with lazy `iter()`, per-batch state history and epoch counting.

    Takes the arguments of `StatefulDataLoader` (`snapshot_every_n_steps` is fixed to 1: a state
    for every batch) plus:

    Args:
        rank, world_size: recorded in the state and checked on load, so a state is never loaded
            into another rank or another world size.
        history: how many per-batch states to keep (the training loop's look-ahead + 1 is enough).
        managed: the state is saved and loaded by an owner through `state_at` / `resume_from`
            (see the module docstring); `state_dict` / `load_state_dict` then carry a marker only.
        epoch: the epoch of the first fresh iteration (a loader rebuilt mid-training, e.g. with
            `reload_dataloaders_every_n_epochs`, continues the count).
    """

    def __init__(
        self,
        dataset,
        *args,
        rank: int = 0,
        world_size: int = 1,
        history: int = 4,
        managed: bool = False,
        epoch: int = 0,
        **kwargs,
    ) -> None:
        if kwargs.get("snapshot_every_n_steps", 1) != 1:
            raise ValueError(
                "ResumableDataLoader needs snapshot_every_n_steps=1 (a state for every batch)"
            )
        kwargs["snapshot_every_n_steps"] = 1
        with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, deprecated in torch
            warnings.filterwarnings("ignore", message=".*set_vital.*deprecated")
            super().__init__(dataset, *args, **kwargs)
        self.rank = rank
        self.world_size = world_size
        self.managed = managed
        self._history: deque[tuple[int, Any]] = deque(maxlen=max(2, history))
        self._pending: dict | None = None  # a state to start the next iteration from
        self._next_epoch = epoch  # epoch of the next fresh iteration
        self._epoch = epoch  # epoch of the current iteration
        self._yielded = 0  # batches of the current epoch handed out (after any resumed ones)
        self._active = False  # an iteration has begun (fetched or is about to fetch)
        self._finished = False  # the current iteration raised StopIteration

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self):
        self._active = False  # a new iteration: until its first batch, its state is its start
        return _LazyIterator(self)

    @property
    def epoch(self) -> int:
        """Epoch of the iteration in progress (or of the last one)."""
        return self._epoch

    def _is_complete(self, state: dict) -> bool:
        return bool(state.get("complete"))

    def _begin(self):
        state, self._pending = self._pending, None
        if state is not None and self._is_complete(state):
            epoch, state = int(state["epoch"]) + 1, None
        elif state is not None:
            epoch = int(state["epoch"])
        else:
            epoch = self._next_epoch
        self._epoch, self._next_epoch = epoch, epoch + 1
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)  # before workers get their copy of the dataset
        self._history.clear()
        self._finished = False
        if state is not None and state["loader"] is not None:
            super().load_state_dict(state["loader"])
            self._yielded = int(state["consumed"])
            self._history.append((self._yielded, state["loader"]))
        else:
            super().load_state_dict({})  # drop any previous iterator: a fresh epoch
            self._yielded = 0
            self._history.append((0, None))
        self._active = True
        return super().__iter__()

    def _after_batch(self) -> None:
        self._yielded += 1
        self._history.append((self._yielded, _copy_structure(super().state_dict())))

    # -- state ---------------------------------------------------------------------------------

    def _wrap(self, epoch: int, consumed: int, inner: Any, complete: bool) -> dict:
        return {
            "format": LOADER_STATE_FORMAT,
            "epoch": epoch,
            "consumed": consumed,
            "complete": complete,
            "loader": inner,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
        }

    def state_at(self, consumed: int | None = None) -> dict:
        """The state after `consumed` batches of the current epoch (default: all handed out)."""
        if not self._active:
            if self._pending is not None:
                return self._pending
            return self._wrap(self._next_epoch, 0, None, complete=False)
        if consumed is None:
            consumed = self._yielded
        for k, inner in reversed(self._history):
            if k == consumed:
                try:
                    total = len(self)
                except TypeError:
                    total = None
                complete = (total is not None and consumed >= total) or (
                    self._finished and consumed == self._yielded
                )
                return self._wrap(self._epoch, consumed, inner, complete)
        kept = [k for k, _ in self._history]
        raise RuntimeError(
            f"no loader state after {consumed} batches of epoch {self._epoch}: states are kept "
            "after "
            f"batches {kept} (handed out: {self._yielded}); a training loop fetched further ahead "
            "than `history` allows"
        )

    def resume_from(self, state: dict) -> None:
        """Start the next iteration (or the current one, if no batch was fetched yet) at `state`."""
        if not isinstance(state, dict) or state.get("format") != LOADER_STATE_FORMAT:
            raise ValueError(f"not a {LOADER_STATE_FORMAT} state: {str(state)[:200]}")
        mine = {"rank": self.rank, "world_size": self.world_size, "num_workers": self.num_workers}
        saved = {k: state.get(k) for k in mine}
        if saved != mine:
            raise ValueError(
                f"cannot resume: the loader state was saved with {saved}, this loader has {mine}"
            )
        if self._active and self._yielded > int(self._history[0][0]):
            raise RuntimeError(
                "a loader state arrived after this loader had already handed out batches; "
                "restore it before the first batch"
            )
        self._pending = state
        self._active = False

    def state_dict(self) -> dict:
        """Lightning's / torchdata's protocol: the state now (a marker when `managed`)."""
        if self.managed:
            return {_MANAGED_KEY: "datamodule"}
        return self.state_at()

    def load_state_dict(self, state_dict: dict) -> None:
        if self.managed:
            if state_dict and _MANAGED_KEY not in state_dict:
                raise ValueError(
                    "this loader's state is restored by its DataModule; got a loader state instead"
                )
            return
        if state_dict:
            self.resume_from(state_dict)


class ResumableTrainData:
    """Mixin of a `LightningDataModule` whose train loader is a managed `ResumableDataLoader`.

    `state_dict()` gathers every rank's loader state, taken after the batches Lightning handed to
    `training_step` (`batches_consumed`); `load_state_dict()` gives each rank its own, applied to
    the train loader before its first batch (or to the next one built). The DataModule wraps the
    loader it returns from `train_dataloader` in `_track_train_loader(loader)` and sets
    `_train_loader = _resume_state = None` in its `__init__`. Put the mixin before
    `LightningDataModule` in the bases, so that its `state_dict` wins.
    """

    _train_loader: ResumableDataLoader | None = None
    _resume_state: dict | None = None

    def _world(self) -> tuple[int, int]:
        """(rank, world size): the trainer's, else torch.distributed's, else (0, 1)."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            return int(trainer.global_rank), int(trainer.world_size)
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def _track_train_loader(self, loader: ResumableDataLoader) -> ResumableDataLoader:
        """Remember `loader` as the train loader, resumed from a state restored before it."""
        if not loader.managed:
            raise ValueError("the train loader of a ResumableTrainData must be managed=True")
        if self._resume_state is not None:
            loader.resume_from(self._resume_state)
            self._resume_state = None
        self._train_loader = loader
        return loader

    def state_dict(self) -> dict:
        """Every rank's train-loader state after the batches trained on (collective: all ranks)."""
        if self._train_loader is None:
            return {}
        trainer = getattr(self, "trainer", None)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        consumed = batches_consumed(trainer) if fitting else None
        states = all_gather_objects(self._train_loader.state_at(consumed))
        return {
            "format": DATAMODULE_STATE_FORMAT,
            "world_size": len(states),
            "loader_states": states,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Take this rank's loader state; it applies to the train loader before its first batch."""
        if not state_dict:
            return
        if state_dict.get("format") != DATAMODULE_STATE_FORMAT:
            raise ValueError(f"not a {DATAMODULE_STATE_FORMAT} state: keys {sorted(state_dict)}")
        rank, world_size = self._world()
        saved = state_dict["world_size"]
        if saved != world_size:
            raise ValueError(
                f"the checkpoint's data state is for world_size={saved}, this run has "
                f"{world_size}; "
                "exact resume needs the same world size (the data split depends on it)"
            )
        state = state_dict["loader_states"][rank]
        if self._train_loader is not None:
            self._train_loader.resume_from(state)
        else:
            self._resume_state = state


def _copy_structure(state: Any) -> Any:
    """Copy dicts and lists, share everything else.

    torchdata updates its snapshot dicts in place, so a kept state needs its own dicts; the
    leaves (tensors from the dataset's `state_dict`, numbers, strings) are never mutated
    afterwards, so sharing them is safe and saves copying megabytes after every batch.
    """
    if isinstance(state, dict):
        return {k: _copy_structure(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_copy_structure(v) for v in state]
    return state


class _LazyIterator:
    """The loader's iterator, started at the first `next()` (so a late state still applies)."""

    def __init__(self, loader: ResumableDataLoader) -> None:
        self.loader = loader
        self.inner = None

    def __iter__(self):
        return self

    def __next__(self):
        loader = self.loader
        if self.inner is None:
            self.inner = loader._begin()
        try:
            batch = next(self.inner)
        except StopIteration:
            loader._finished = True
            raise
        loader._after_batch()
        return batch
