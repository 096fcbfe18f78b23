"""Callbacks: Scheduled Sliding-window Dropout, and a checkpoint on interruption.

SSD (PAPER.md section 5): during stage 2, each layer's SWA branch is dropped with probability
``p_k`` and the window is ``w_k`` in epoch ``k``; both follow per-epoch schedules that hold their
last value. ``ssd_schedule`` is the pure function; ``ScheduledSlidingWindowDropout`` applies it.
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..models import hybrid_layers, set_attention_mode
from ..models.checkpoint import unwrap
from ..models.config import SSD_GRANULARITIES
from .stages import NonFiniteLossError

__all__ = ["SSD_SCHEDULES", "CheckpointOnInterrupt", "ScheduledSlidingWindowDropout",
           "resolve_ssd_schedule", "ssd_schedule"]

#: name -> (p per epoch, window per epoch), PAPER.md section 5; the last value is held
SSD_SCHEDULES: dict[str, tuple[tuple[float, ...], tuple[int, ...]]] = {
    "dropout": ((0.9, 0.75, 0.5, 0.5), (32,)),
    "window": ((0.5,), (4, 8, 16, 32, 64)),
    "fixed": ((0.5,), (16,)),
}


def resolve_ssd_schedule(schedule: str | None = None, p: Sequence[float] | None = None,
                         window: Sequence[int] | None = None
                         ) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """A named schedule, with ``p`` and/or ``window`` lists overriding its columns (or, with
    ``schedule=None``, both lists given by the user). Values are validated."""
    if schedule is not None:
        if schedule not in SSD_SCHEDULES:
            raise ValueError(f"unknown SSD schedule {schedule!r}; valid: {', '.join(SSD_SCHEDULES)} "
                             "(or schedule=None with your own p and window lists)")
        base_p, base_w = SSD_SCHEDULES[schedule]
        p = base_p if p is None else p
        window = base_w if window is None else window
    if not p or not window:
        raise ValueError(f"an SSD schedule needs non-empty p and window lists, got p={p!r}, "
                         f"window={window!r}")
    p, window = tuple(float(x) for x in p), tuple(window)
    if any(not 0.0 <= x <= 1.0 for x in p):
        raise ValueError(f"SSD probabilities must lie in [0, 1], got {p!r}")
    if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in window):
        raise ValueError(f"SSD windows must be integers >= 1, got {window!r}")
    return p, window


def ssd_schedule(epoch: int, p: Sequence[float], window: Sequence[int]) -> tuple[float, int]:
    """``(p_k, w_k)`` for 0-based ``epoch``; each list holds its last value past its end."""
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch!r}")
    return p[min(epoch, len(p) - 1)], window[min(epoch, len(window) - 1)]


class ScheduledSlidingWindowDropout(pl.Callback):
    """Set the SWA drop probability and the window of every hybrid layer at each epoch start.

    Args:
        schedule: ``dropout | window | fixed`` (PAPER.md), or ``None`` with both lists given.
        p, window: per-epoch lists overriding the schedule's columns.
        granularity: what one drop covers, per layer: ``sample`` (default), ``batch``, ``head``.
        rescale: a dropped layer's LA gets weight 1 instead of ``1 - g`` (default off).
        la_span: ``all`` lets a dropped layer's LA see every causal key (default ``outside``).

    The values are logged as ``ssd/p`` and ``ssd/window`` each epoch. After training the drop is
    switched off and ``rescale`` / ``la_span`` restored; the window stays at the last epoch's
    value (evaluate with it; the stage checkpoint records it).
    """

    def __init__(self, schedule: str | None = "dropout", p: list[float] | None = None,
                 window: list[int] | None = None, granularity: str = "sample",
                 rescale: bool = False, la_span: str = "outside") -> None:
        if granularity not in SSD_GRANULARITIES:
            raise ValueError(f"granularity={granularity!r} is not valid; choose one of "
                             f"{', '.join(SSD_GRANULARITIES)}")
        if la_span not in ("outside", "all"):
            raise ValueError(f"la_span={la_span!r} is not valid; choose outside or all")
        self.p, self.window = resolve_ssd_schedule(schedule, p, window)
        self.granularity, self.rescale, self.la_span = granularity, rescale, la_span
        self._saved: dict | None = None

    @staticmethod
    def _model(pl_module: pl.LightningModule):
        model = getattr(pl_module, "model", None)
        if model is None:
            raise ValueError(f"{type(pl_module).__name__} has no .model to apply SSD to")
        return unwrap(model)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[float, int]:
        model = self._model(pl_module)
        if self._saved is None:
            _, attn = next(iter(hybrid_layers(model)))
            self._saved = {"rescale": attn.hedgecats.rescale, "la_span": attn.hedgecats.la_span}
        p, w = ssd_schedule(trainer.current_epoch, self.p, self.window)
        set_attention_mode(model, window=w, ssd_p=p, ssd_granularity=self.granularity,
                           rescale=self.rescale, la_span=self.la_span)
        return p, w

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # a run resumed mid-epoch does not call on_train_epoch_start for that epoch
        self._apply(trainer, pl_module)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        p, w = self._apply(trainer, pl_module)
        pl_module.log("ssd/p", p, on_step=False, on_epoch=True)
        pl_module.log("ssd/window", float(w), on_step=False, on_epoch=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_attention_mode(self._model(pl_module), ssd_p=0.0, **(self._saved or {}))


class CheckpointOnInterrupt(OnExceptionCheckpoint):
    """Save ``<dirpath>/<filename>.ckpt`` when training stops on SIGTERM or Ctrl-C, so that
    ``ckpt_path=last`` resumes. Lightning raises both at a batch boundary, so the saved state is
    consistent. Other errors (a non-finite loss included) may strike mid-step: nothing is saved,
    and the last periodic checkpoint stays the one to resume from."""

    def __init__(self, dirpath: str, filename: str = "last") -> None:
        super().__init__(dirpath=dirpath, filename=filename)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if isinstance(exception, NonFiniteLossError) or \
                not isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        super().on_exception(trainer, pl_module, exception)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep the file: Lightning's version deletes it at teardown, but it is shared with
        ``ModelCheckpoint(save_last=True)`` and is what the next run resumes from."""
