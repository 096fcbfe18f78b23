"""Callbacks: Scheduled Sliding-window Dropout, and a checkpoint on interruption.

SSD (docs/method.md#ssd): during stage 2, each layer's SWA branch is dropped with probability
``p_k`` and the window is ``w_k`` in phase ``k``; both lists hold their last value. The paper's
phases are epochs of 25M tokens; a phase may instead be a number of optimiser steps or an equal
fraction of the stage, so that short runs (the testbed, smoke tests) advance the schedule too.
``ssd_schedule`` is the pure function; ``ScheduledSlidingWindowDropout`` applies it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..models import hybrid_layers, set_attention_mode
from ..models.structure import unwrap
from ..models.config import SWITCHES
from .stages import NonFiniteLossError

__all__ = [
    "SSD_INTERVALS",
    "SSD_SCHEDULES",
    "CheckpointOnInterrupt",
    "SSDScheduleError",
    "ScheduledSlidingWindowDropout",
    "resolve_ssd_schedule",
    "ssd_phase",
    "ssd_schedule",
]

#: what one entry of an SSD schedule lasts: an epoch (the paper), ``interval_steps`` optimiser
#: steps, or an equal fraction of the stage's optimiser steps (as many fractions as entries)
SSD_INTERVALS = ("epoch", "step", "fraction")

#: name -> (p per epoch, window per epoch), docs/method.md#ssd; the last value is held
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


def ssd_schedule(phase: int, p: Sequence[float], window: Sequence[int]) -> tuple[float, int]:
    """``(p_k, w_k)`` for 0-based ``phase``; each list holds its last value past its end."""
    if phase < 0:
        raise ValueError(f"epoch must be >= 0, got {phase!r}")
    return p[min(phase, len(p) - 1)], window[min(phase, len(window) - 1)]


def ssd_phase(interval: str, *, epoch: int, step: int, interval_steps: int | None = None,
              total_steps: int | None = None, n_phases: int = 1) -> int:
    """The 0-based schedule phase at ``epoch`` / optimiser ``step`` (pure).

    ``epoch``: the epoch. ``step``: ``step // interval_steps``. ``fraction``: phase ``k`` covers
    steps ``[k T / n, (k+1) T / n)`` of ``T = total_steps`` for ``n = n_phases``."""
    if interval == "epoch":
        return epoch
    if interval == "step":
        return step // interval_steps
    if interval == "fraction":
        return min(n_phases - 1, step * n_phases // max(1, total_steps))
    raise ValueError(f"unknown SSD interval {interval!r}; valid: {', '.join(SSD_INTERVALS)}")


class SSDScheduleError(ValueError):
    """An SSD schedule that the configured run cannot advance."""


class ScheduledSlidingWindowDropout(pl.Callback):
    """Set the SWA drop probability and the window of every hybrid layer, phase by phase.

    Args:
        schedule: ``dropout | window | fixed`` (docs/method.md#ssd), or ``None`` with both lists.
        p, window: per-phase lists overriding the schedule's columns.
        interval: what a phase lasts: ``epoch`` (the paper), ``step`` (``interval_steps``
            optimiser steps) or ``fraction`` (the stage's optimiser steps cut into as many equal
            parts as the longer list has entries; needs ``trainer.max_steps`` or ``max_epochs``).
        interval_steps: phase length for ``interval="step"``.
        granularity: what one drop covers, per layer: ``sample`` (default), ``batch``, ``head``.
        rescale: a dropped layer's LA gets weight 1 instead of ``1 - g`` (default off).
        la_span: ``all`` lets a dropped layer's LA see every causal key (default ``outside``).

    At the start of training the callback works out how many phases the run will reach (from
    ``max_steps`` / ``max_epochs`` and the epoch length) and raises ``SSDScheduleError`` when a
    schedule that changes would never leave its first phase (e.g. a per-epoch schedule in a
    stage shorter than one epoch: the first version silently held ``p`` at 0.9 there); it warns
    when later phases are out of reach. The values are logged as ``ssd/p`` and ``ssd/window``
    when they change. After training the drop is switched off and ``rescale`` / ``la_span``
    restored; the window stays at the last phase's value (evaluate with it; the stage checkpoint
    records it).
    """

    def __init__(self, schedule: str | None = "dropout", p: list[float] | None = None,
                 window: list[int] | None = None, interval: str = "epoch",
                 interval_steps: int | None = None, granularity: str = "sample",
                 rescale: bool = False, la_span: str = "outside") -> None:
        for name, value, switch in (("granularity", granularity, "ssd_granularity"),
                                    ("la_span", la_span, "la_span"), ("rescale", rescale, "rescale")):
            try:
                SWITCHES[switch].check(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not valid; choose "
                                 f"{SWITCHES[switch].expects}") from None
        if interval not in SSD_INTERVALS:
            raise ValueError(f"interval={interval!r} is not valid; choose one of "
                             f"{', '.join(SSD_INTERVALS)}")
        if (interval == "step") != (interval_steps is not None):
            raise ValueError("interval_steps (>= 1) goes with interval='step' and only with it; "
                             f"got interval={interval!r}, interval_steps={interval_steps!r}")
        if interval_steps is not None and interval_steps < 1:
            raise ValueError(f"interval_steps={interval_steps!r} must be >= 1")
        self.p, self.window = resolve_ssd_schedule(schedule, p, window)
        self.interval, self.interval_steps = interval, interval_steps
        self.granularity, self.rescale, self.la_span = granularity, rescale, la_span
        self.n_phases = max(len(self.p), len(self.window))
        self._saved: dict | None = None
        self._total_steps: int | None = None
        self._current: tuple[float, int] | None = None

    @staticmethod
    def _model(pl_module: pl.LightningModule):
        model = getattr(pl_module, "model", None)
        if model is None:
            raise ValueError(f"{type(pl_module).__name__} has no .model to apply SSD to")
        return unwrap(model)

    # ------------------------------------------------------------------ reach of the run
    def _run_length(self, trainer: pl.Trainer) -> tuple[int | None, int | None]:
        """(optimiser steps per epoch, total optimiser steps of the stage); None if unbounded."""
        batches = trainer.num_training_batches
        per_epoch = None
        if isinstance(batches, int) or (isinstance(batches, float) and math.isfinite(batches)):
            per_epoch = max(1, int(batches) // max(1, trainer.accumulate_grad_batches))
        totals = []
        if trainer.max_steps is not None and trainer.max_steps > 0:
            totals.append(trainer.max_steps)
        if trainer.max_epochs is not None and trainer.max_epochs > 0 and per_epoch is not None:
            totals.append(trainer.max_epochs * per_epoch)
        return per_epoch, (min(totals) if totals else None)

    def _reached_phases(self, per_epoch: int | None, total: int | None) -> int | None:
        if total is None:
            return None
        if self.interval == "epoch":
            return None if per_epoch is None else -(-total // per_epoch)
        if self.interval == "step":
            return -(-total // self.interval_steps)
        return self.n_phases

    def _check_reach(self, trainer: pl.Trainer) -> None:
        per_epoch, total = self._run_length(trainer)
        if self.interval == "fraction":
            if total is None:
                raise SSDScheduleError("SSD interval='fraction' needs a bounded stage: set "
                                       "trainer.max_steps or max_epochs")
            self._total_steps = total
        reached = self._reached_phases(per_epoch, total)
        changes = len({ssd_schedule(k, self.p, self.window) for k in range(self.n_phases)}) > 1
        if reached is None or not changes or reached >= self.n_phases:
            return
        unit = {"epoch": f"epochs of {per_epoch} steps", "step": f"phases of "
                f"{self.interval_steps} steps", "fraction": "fractions"}[self.interval]
        msg = (f"the SSD schedule p={list(self.p)}, window={list(self.window)} has "
               f"{self.n_phases} phases ({self.interval}), but this run of {total} optimiser "
               f"steps reaches only {reached} ({unit})")
        if reached <= 1:
            raise SSDScheduleError(
                msg + ": the schedule would never leave its first phase. Use interval: fraction "
                "(the phases cut the stage into equal parts) or interval: step with "
                "interval_steps, or train longer")
        rank_zero_warn(msg + f"; it ends at p={ssd_schedule(reached - 1, self.p, self.window)[0]}"
                       f", window={ssd_schedule(reached - 1, self.p, self.window)[1]}")

    # ------------------------------------------------------------------ applying it
    def _phase(self, trainer: pl.Trainer) -> int:
        return ssd_phase(self.interval, epoch=trainer.current_epoch, step=trainer.global_step,
                         interval_steps=self.interval_steps, total_steps=self._total_steps,
                         n_phases=self.n_phases)

    def _apply(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        """Set the current phase's values on every layer; True if they changed."""
        model = self._model(pl_module)
        if self._saved is None:
            _, attn = next(iter(hybrid_layers(model)))
            self._saved = {"rescale": attn.hedgecats.rescale, "la_span": attn.hedgecats.la_span}
        p, w = ssd_schedule(self._phase(trainer), self.p, self.window)
        if self._current == (p, w):
            return False
        set_attention_mode(model, window=w, ssd_p=p, ssd_granularity=self.granularity,
                           rescale=self.rescale, la_span=self.la_span)
        self._current = (p, w)
        return True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_reach(trainer)
        self._current = None
        # a run resumed mid-phase applies that phase here
        self._apply(trainer, pl_module)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch,
                             batch_idx: int) -> None:
        self._apply(trainer, pl_module)
        p, w = self._current
        pl_module.log("ssd/p", p, on_step=True, on_epoch=False)
        pl_module.log("ssd/window", float(w), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        set_attention_mode(self._model(pl_module), ssd_p=0.0, **(self._saved or {}))


class CheckpointOnInterrupt(OnExceptionCheckpoint):
    """Save ``<dirpath>/<filename>.ckpt`` when training stops on SIGTERM or Ctrl-C (SIGINT), so
    that ``ckpt_path=last`` resumes exactly.

    A signal is only recorded when it arrives (and forwarded to the ranks Lightning's launcher
    started). At the end of every training batch the ranks decide together whether any of them
    received one (one all-reduce of a flag; nothing on a single device), and all of them stop
    there, at the same batch boundary, where the state is consistent: then the checkpoint is
    saved once for all ranks. This replaces Lightning's own SIGTERM handler, which broadcasts
    from inside the signal handler (a collective that can meet another collective of a rank
    that is waiting elsewhere: a deadlock) and stops each rank on its own flag. Python would
    raise ``KeyboardInterrupt`` for SIGINT wherever the main thread is, possibly between an
    optimiser step and Lightning's step counter: a checkpoint saved there would not resume
    exactly. A second Ctrl-C stops at once and saves nothing: the last periodic checkpoint stays
    the one to resume from. Other errors (a non-finite loss included) may strike mid-step:
    nothing is saved.

    After ``fit``, ``signal`` is the signal number received (``None`` if none) and ``saved`` the
    path written (``None`` if nothing was saved).
    """

    def __init__(self, dirpath: str, filename: str = "last") -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.signal: int | None = None
        self.saved: str | None = None
        self._previous_sigint = None
        self._trainer = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        import signal
        import threading

        self.saved, self._trainer = None, trainer
        if stage != "fit":
            return
        # Lightning registers its SIGTERM handler after ``setup``: this takes its place
        trainer._signal_connector._sigterm_notifier_fn = self.notify_signal
        if threading.current_thread() is threading.main_thread():
            self._previous_sigint = signal.signal(signal.SIGINT, self.notify_signal)

    def notify_signal(self, signum: int, frame=None) -> None:
        """Record a signal (SIGTERM, SIGINT) and forward it to the launched ranks; training
        stops at the end of the current batch."""
        import signal

        if self.signal is not None:
            if signum == signal.SIGINT:  # the second Ctrl-C: stop now
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            return
        self.signal = int(signum)
        launcher = self._trainer.strategy.launcher if self._trainer is not None else None
        if launcher is not None:
            launcher.kill(signum)  # the ranks Lightning started (a no-op in those ranks)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs,
                           batch, batch_idx: int) -> None:
        stop = self.signal is not None
        if trainer.world_size > 1:  # every rank stops at the same batch, or none does
            stop = trainer.strategy.reduce_boolean_decision(stop, all=False)
        if stop:
            if self.signal is None:
                import signal

                self.signal = signal.SIGTERM  # another rank received it
            trainer._signal_connector.received_sigterm = True  # raised after this batch

    def _restore_sigint(self) -> None:
        import signal

        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        import signal

        self._restore_sigint()
        if isinstance(exception, KeyboardInterrupt):  # the second Ctrl-C, possibly mid-step
            self.signal = signal.SIGINT
            return
        if isinstance(exception, NonFiniteLossError) or not isinstance(exception, SIGTERMException):
            return
        if self.signal is None:
            self.signal = signal.SIGTERM
        super().on_exception(trainer, pl_module, exception)
        self.saved = self.ckpt_path

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Keep the file: Lightning's version deletes it at teardown, but it is shared with
        ``ModelCheckpoint(save_last=True)`` and is what the next run resumes from."""
        self._restore_sigint()
