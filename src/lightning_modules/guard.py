"""What keeps a long stage's state trustworthy: a guard on the parameters and the loss, atomic
checkpoint files, and a progress bar that counts steps.

``TrainingGuard`` (a callback):

- **Non-finite state is never saved.** Every ``check_every_n_steps`` optimiser steps, and before
  every checkpoint whatever that period, it checks that every trainable parameter is finite
  (one fused ``torch._foreach_norm`` over the trainable tensors, confirmed element-wise when a
  norm is not finite, one device sync; its cost: ``benchmarks/guard_overhead.py``), and before
  a checkpoint the optimiser state too. A failed check raises ``NonFiniteStateError`` before
  the checkpoint callback runs, so the last checkpoint on disk is the last finite state. (The
  loss itself is checked in every ``training_step`` before the optimiser step:
  ``NonFiniteLossError``; the checkpoint of the state that produced it is set apart.)
- **Slow divergence stops the stage.** It keeps an exponential moving average of the training
  loss (``ema_alpha``) and its best (lowest) value; when the average stays above
  ``divergence_factor`` times the best for ``divergence_patience`` consecutive optimiser steps
  (counted after ``divergence_warmup`` steps), it raises ``DivergenceError``. Checkpoints
  written while the average was above that level are set apart as ``diverged-step<N>.ckpt``
  and the last good one becomes ``last.ckpt`` again, so the stage can continue from it with a
  changed config (``hedgecats pipeline ... --resume-changed``).
- **The record.** Every checkpoint carries ``checkpoint["hedgecats"]``: the guard's ``record``
  (the pipeline sets it to the config that produced the stage) and the health at that step.

``AtomicCheckpointIO`` writes each ``.ckpt`` to a temporary file in the same directory, fsyncs
and renames it (a full disk or a crash never leaves a truncated checkpoint), and keeps the one
it replaces as ``previous.ckpt`` (a hard link: no copy), the fallback when ``last.ckpt`` cannot
be read.

``StepProgressBar`` shows ``step 12/100`` when the stage is bounded by ``max_steps`` and ``epoch
1/3`` only when ``max_epochs`` bounds it (Lightning's rich bar printed "Epoch 0/-2"); counting
steps, it reports the stage's global step against ``max_steps`` with a rate over the stage
(``step_progress``), across data epochs and from a resume on.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ..models.io import atomic_write

log = logging.getLogger(__name__)

__all__ = ["AtomicCheckpointIO", "DivergenceError", "NonFiniteStateError", "StepProgress",
           "StepProgressBar", "TrainingGuard", "parameters_finite", "read_checkpoint_record",
           "step_progress"]

PREVIOUS = "previous.ckpt"
RECORD_KEY = "hedgecats"


class NonFiniteStateError(RuntimeError):
    """A trainable parameter became NaN or inf; nothing of that state was saved."""


class DivergenceError(RuntimeError):
    """The training loss rose far above its best level and stayed there."""


# ----------------------------------------------------------------------------- checks
def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # an FSDP2 shard


@torch.no_grad()
def parameters_finite(params: list[torch.Tensor]) -> bool:
    """Every element of every tensor is finite.

    One ``torch._foreach_norm`` (2-norm: the fused, vectorised path on CPU and GPU) per device
    and dtype, then one ``isfinite`` over the stacked norms and one host sync. NaN and inf
    propagate into a norm; a norm can also overflow for huge finite values (above about 1e19 in
    fp32), so a non-finite norm is confirmed element-wise before the answer is False. (The
    ``ord=inf`` norm never overflows but takes a slow path on CPU: 50x slower here.)"""
    tensors = [_local(p.detach()) for p in params if p.numel()]
    if not tensors:
        return True
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    for ts in groups.values():
        norms = torch.stack(torch._foreach_norm(ts)).float()
        flags.append(torch.isfinite(norms).all().to(tensors[0].device))
    if bool(torch.stack(flags).all()):
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _optimizer_finite(optimizers) -> bool:
    """The optimisers' floating-point states (Adam's moments) are finite (this rank's shards)."""
    states = [v for opt in optimizers for s in opt.state.values() for v in s.values()
              if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0]
    return parameters_finite(states) if states else True


# ----------------------------------------------------------------------------- the guard
class TrainingGuard(pl.Callback):
    """Refuse to save non-finite state; stop on slow divergence (module docstring).

    Args:
        check_every_n_steps: optimiser steps between parameter checks (>= 1); a check also runs
            before every checkpoint, so non-finite state is never saved whatever the period.
            Default 4: on an H200 a check after every step cost 2.1% of a full-parameter step
            (the norm 0.97%, its host sync the rest; benchmarks/results/guard_overhead.json),
            so every 4th step should cost about 0.5% (derived from that figure, not measured);
            a blow-up is named within 4 steps.
        divergence_factor: the smoothed loss must stay below this multiple of its best value
            (> 1); ``None`` switches the slow-divergence check off.
        divergence_patience: consecutive optimiser steps above it that stop the stage (>= 1).
        divergence_warmup: optimiser steps before steps above the level are counted (a
            learning-rate warm-up may raise the loss briefly); the best level is tracked from
            the first step.
        ema_alpha: weight of the newest loss in the moving average, in (0, 1].
        dirpath: the checkpoint directory (to restore the last good checkpoint after a slow
            divergence); ``None``: leave the files alone.
    """

    def __init__(self, check_every_n_steps: int = 4, divergence_factor: float | None = 3.0,
                 divergence_patience: int = 50, divergence_warmup: int = 50,
                 ema_alpha: float = 0.05, dirpath: str | None = None) -> None:
        if isinstance(check_every_n_steps, bool) or not isinstance(check_every_n_steps, int) \
                or check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps!r} must be an integer >= 1")
        if divergence_factor is not None and not divergence_factor > 1:
            raise ValueError(f"divergence_factor={divergence_factor!r} must be > 1 (or null: off)")
        if divergence_patience < 1:
            raise ValueError(f"divergence_patience={divergence_patience!r} must be >= 1")
        if divergence_warmup < 0:
            raise ValueError(f"divergence_warmup={divergence_warmup!r} must be >= 0")
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha={ema_alpha!r} must lie in (0, 1]")
        self.check_every_n_steps = check_every_n_steps
        self.factor, self.patience, self.warmup = divergence_factor, divergence_patience, \
            divergence_warmup
        self.alpha = ema_alpha
        self.dirpath = Path(dirpath) if dirpath else None
        #: what produced this stage (set by the pipeline); saved in every checkpoint
        self.record: dict | None = None
        self._reset()

    def _reset(self) -> None:
        self.ema: float | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.above = 0  # consecutive optimiser steps above factor * best
        self.above_since: int | None = None
        self.last_step: int | None = None  # optimiser step of the last loss seen
        self.checked_step: int | None = None

    # ---------------------------------------------------------------- state (resumes exactly)
    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("ema", "best", "best_step", "above", "above_since",
                                              "last_step")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            if k in ("ema", "best", "best_step", "above", "above_since", "last_step"):
                setattr(self, k, v)

    # ---------------------------------------------------------------- parameters
    @staticmethod
    def _trainable(pl_module: pl.LightningModule) -> list[torch.Tensor]:
        return [p for p in pl_module.parameters() if p.requires_grad]

    def _check_parameters(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                          when: str, optimizer_state: bool = False) -> None:
        finite = parameters_finite(self._trainable(pl_module))
        opt_finite = _optimizer_finite(trainer.optimizers) if optimizer_state else True
        if trainer.world_size > 1:  # shards differ per rank: every rank must stop together
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
            opt_finite = trainer.strategy.reduce_boolean_decision(opt_finite, all=True)
        self.checked_step = trainer.global_step
        what = None if finite and opt_finite else \
            "a trainable parameter" if not finite else "the optimiser state (Adam's moments)"
        if what:
            raise NonFiniteStateError(
                f"{type(pl_module).__name__}: {what} became NaN or inf by optimiser step "
                f"{trainer.global_step} ({when}); this state was not saved. The last "
                f"checkpoint{self._where()} is the last finite one. Lower the learning rate "
                "(model.init_args.lr), use bf16/fp32 instead of fp16, or check the data")

    def _where(self) -> str:
        return f" in {self.dirpath}" if self.dirpath else ""

    # ---------------------------------------------------------------- loss
    def _observe(self, loss: float, step: int, trainer: pl.Trainer, pl_module) -> None:
        if self.factor is None:
            return
        if not math.isfinite(loss):
            return  # the stage's own check stops it before the optimiser step
        self.ema = loss if self.ema is None else (1 - self.alpha) * self.ema + self.alpha * loss
        if self.best is None or self.ema < self.best:  # from the first step: a blow-up in
            self.best, self.best_step = self.ema, step  # the warm-up must not become the level
        if step < self.warmup:
            return
        if self.ema > self.factor * self.best:
            if self.above == 0:
                self.above_since = step
            if step != self.last_step:
                self.above += 1
        else:
            self.above, self.above_since = 0, None
        self.last_step = step
        if self.above >= self.patience:
            restored = self._set_aside(trainer, self.above_since)
            raise DivergenceError(
                f"{type(pl_module).__name__}: the training loss diverged: its moving average "
                f"{self.ema:.4g} has stayed above {self.factor:g} x its best level "
                f"{self.best:.4g} (step {self.best_step}) for {self.above} optimiser steps, since "
                f"step {self.above_since}. {restored} Lower the learning rate "
                "(model.init_args.lr) or check the data; the check is the pipeline's "
                "divergence.factor / divergence.patience")

    def _set_aside(self, trainer: pl.Trainer, first_bad: int) -> str:
        """Rename the checkpoints of step ``first_bad`` or later (kept as
        ``diverged-step<N>.ckpt``); the newest earlier one becomes ``last.ckpt`` again. Returns
        a sentence for the error message."""
        if self.dirpath is None:
            return ""
        last, prev = self.dirpath / "last.ckpt", self.dirpath / PREVIOUS
        renamed = []
        if trainer.is_global_zero:
            for path in (last, prev):
                step = _ckpt_step(path) if path.exists() else None
                if step is not None and step >= first_bad:
                    os.replace(path, self.dirpath / f"diverged-step{step}.ckpt")
                    renamed.append(f"diverged-step{step}.ckpt")
            if not last.exists() and prev.exists():
                os.replace(prev, last)
        trainer.strategy.barrier("hedgecats_set_aside")
        good = _ckpt_step(last) if last.exists() else None
        kept = (f"{last} (step {good}) is the last good checkpoint" if good is not None else
                "no good checkpoint is left: start the stage again")
        return (f"Checkpoints of step {first_bad} or later were set apart "
                f"({', '.join(renamed)}); " if renamed else "") + kept + "."

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs,
                           batch, batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        step = trainer.global_step
        if step % self.check_every_n_steps == 0 and self.checked_step != step:
            self._check_parameters(trainer, pl_module, "periodic check")
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            if trainer.world_size > 1:
                loss = trainer.strategy.reduce(loss, reduce_op="mean")
            self._observe(float(loss), step, trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        """A non-finite loss at step N: the state of step N produced it, so a checkpoint of
        that state must not be resumed from."""
        from .stages import NonFiniteLossError

        if isinstance(exception, NonFiniteLossError):
            self._set_aside(trainer, trainer.global_step)

    # ---------------------------------------------------------------- saving
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._check_parameters(trainer, pl_module, "before a checkpoint", optimizer_state=True)
        suspect = self.above > 0
        step = trainer.global_step
        checkpoint[RECORD_KEY] = {**(self.record or {}), "health": {
            "step": step, "loss_ema": self.ema, "best": self.best, "suspect": suspect}}


def _ckpt_step(path: Path) -> int | None:
    """The step of a checkpoint file or sharded directory; ``None`` if it cannot be read."""
    with contextlib.suppress(Exception):
        return read_checkpoint_record(path)["global_step"]
    return None


def read_checkpoint_record(path: str | os.PathLike) -> dict:
    """``{"global_step", "record"}`` of a Lightning checkpoint (a file, or a sharded directory's
    metadata); raises what ``torch.load`` raises when the file is truncated or corrupt."""
    path = Path(path)
    if path.is_dir():
        from lightning.fabric.utilities.load import _METADATA_FILENAME

        path = path / _METADATA_FILENAME
    ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    if not isinstance(ckpt, dict) or "global_step" not in ckpt:
        raise ValueError(f"{str(path)!r} is not a Lightning checkpoint (no global_step)")
    return {"global_step": int(ckpt["global_step"]), "record": ckpt.get(RECORD_KEY)}


# ----------------------------------------------------------------------------- files
class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose files are complete or absent (module docstring); the
    ``last.ckpt`` it replaces stays as ``previous.ckpt`` (unless it holds the same step: a
    checkpoint saved again on interruption keeps the earlier step as the fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self._steps: dict[Path, int | None] = {}  # step last written to each path

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got "
                            f"{storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        step = checkpoint.get("global_step")
        if path.name == "last.ckpt" and path.is_file() and \
                (path not in self._steps or self._steps[path] != step):
            keep_previous(path)
        with atomic_write(path) as f:
            torch.save(checkpoint, f)
        self._steps[path] = step


def keep_previous(path: Path) -> None:
    """Make ``previous.ckpt`` (beside ``path``) the current ``path``: a hard link, renamed into
    place atomically (a copy where the filesystem has no hard links)."""
    prev = path.with_name(PREVIOUS)
    tmp = path.with_name(f".{PREVIOUS}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        os.link(path, tmp)
    except OSError:
        import shutil

        log.info("no hard links in %s: copying %s to %s", path.parent, path.name, PREVIOUS)
        shutil.copyfile(path, tmp)
    os.replace(tmp, prev)


# ----------------------------------------------------------------------------- progress
class StepProgress(NamedTuple):
    """What the step bar shows: ``n/total`` steps, ``rate`` steps/s and ``remaining`` seconds
    (``None`` where not known yet)."""

    n: int
    total: int | None
    rate: float | None
    remaining: float | None


def step_progress(global_step: int, max_steps: int | None, *, start_step: int,
                  start_time: float, now: float) -> StepProgress:
    """The stage's progress at ``global_step`` of ``max_steps`` (none when it is ``None`` or
    ``-1``); the rate counts the steps made since this run of the stage started at
    ``start_step`` / ``start_time`` (so neither a data epoch nor a resume skews it)."""
    total = max_steps if max_steps is not None and max_steps > 0 else None
    made, elapsed = global_step - start_step, now - start_time
    rate = made / elapsed if made > 0 and elapsed > 0 else None
    remaining = max(0, total - global_step) / rate if rate and total is not None else None
    return StepProgress(global_step, total, rate, remaining)


class _StageTqdm(Tqdm):
    """A tqdm bar whose rate and time left come from ``step_progress`` over the stage."""

    start_step: int = 0
    max_steps: int | None = None

    @property
    def format_dict(self):
        d = super().format_dict
        if hasattr(self, "start_t"):
            p = step_progress(self.n, self.max_steps, start_step=self.start_step,
                              start_time=self.start_t, now=self._time())
            d.update(rate=p.rate, initial=self.start_step)
        return d


class StepProgressBar(TQDMProgressBar):
    """TQDM bar counting optimiser steps of ``max_steps`` (``step 12/100``), with the epoch as
    ``epoch 1`` (or ``epoch 1/3`` when ``max_epochs`` bounds the stage).

    Counting steps, one bar lasts the whole stage: it is set up at the start of training (a
    resumed stage starts mid-epoch, where Lightning calls no epoch hook) and never reset by a
    data epoch; its rate is ``step_progress``'s, over the steps made since that start."""

    @staticmethod
    def _by_steps(trainer: pl.Trainer) -> bool:
        return trainer.max_steps is not None and trainer.max_steps > 0

    def _describe(self, trainer: pl.Trainer) -> str:
        epochs = trainer.max_epochs
        bound = f"/{epochs}" if epochs is not None and epochs > 0 and not self._by_steps(trainer) \
            else ""
        return f"epoch {trainer.current_epoch + 1}{bound}"

    def init_train_tqdm(self) -> Tqdm:
        if not self._by_steps(self.trainer):
            return super().init_train_tqdm()
        # Lightning's training bar, counting from the stage's global step to max_steps
        bar = _StageTqdm(desc=self._describe(self.trainer), position=2 * self.process_position,
                         disable=self.is_disabled, leave=True, dynamic_ncols=True,
                         file=sys.stdout, smoothing=0, bar_format=self.BAR_FORMAT, unit="step",
                         total=self.trainer.max_steps, initial=self.trainer.global_step)
        bar.start_step, bar.max_steps = self.trainer.global_step, self.trainer.max_steps
        return bar

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        super().on_train_start(trainer)
        self.train_progress_bar.set_description(self._describe(trainer))

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if not self._by_steps(trainer):
            super().on_train_epoch_start(trainer)
        self.train_progress_bar.set_description(self._describe(trainer))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._by_steps(trainer):
            return super().on_train_epoch_end(trainer, pl_module)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs,
                           batch: Any, batch_idx: int) -> None:
        if not self._by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        n = trainer.global_step
        if bar is not None and self._should_update(n, bar.total):
            if not bar.disable:
                bar.n = n
                bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
