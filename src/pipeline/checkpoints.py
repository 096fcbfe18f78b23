"""The periodic checkpoint that every stage of a pipeline writes: ``<stage>/checkpoints/last.ckpt``.

Lightning's ``ModelCheckpoint`` keys its saved state by its arguments (``every_n_train_steps``
among them) and, when ``last.ckpt`` exists but its restored state does not name it, writes
``last-v1.ckpt``, ``last-v2.ckpt``, ... beside it. The pipeline resumes from ``last.ckpt`` and
lets ``checkpoint_every_n_steps`` change on resume, so ``StageCheckpoint`` keeps one state key
whatever its period and always writes ``last.ckpt`` (a moved run directory, whose restored
state Lightning sets aside, too).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint

__all__ = ["STATE_KEY", "StageCheckpoint"]

#: the key of the callback's state in a checkpoint, the same for every period
STATE_KEY = "hedgecats.StageCheckpoint"


class StageCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that writes only ``last.ckpt`` (``save_top_k=0``), every
    ``every_n_train_steps`` optimiser steps, under one state key and never a versioned name."""

    def __init__(self, dirpath: str, every_n_train_steps: int) -> None:
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0,
                         every_n_train_steps=every_n_train_steps, enable_version_counter=False)

    @property
    def state_key(self) -> str:
        return STATE_KEY
