"""One stage of a pipeline: its full LightningCLI config, its plan, and its run.

**Config.** A stage's ``fit`` section (after ``--set`` and ``${...}``) is what the user chose;
the pipeline adds the run directory (``trainer.default_root_dir``), the loggers (one directory
per attempt), ``StageCheckpoint`` (``last.ckpt`` every ``checkpoint_every_n_steps`` steps),
``CheckpointOnInterrupt``, ``TrainingGuard`` (the pipeline's ``divergence`` settings), a
``StepProgressBar`` and atomic checkpoint files. The result is ``<stage>/config.yaml``.

**Plan.** Before anything trains, each stage is one of:

    done            ``done`` exists, every file it vouches for matches, and the config that
                    produced it equals today's (keys in ``SAFE_AFTER_DONE`` aside): skipped
    resume          an interrupted stage whose checkpoint was produced by today's config (keys
                    in ``SAFE_ON_RESUME`` may differ): continues exactly
    new             nothing to resume: starts from its beginning
    restart         changed, and ``--restart-changed``: earlier files move to ``superseded/N``
                    (logs stay), the stage starts from its beginning
    resume-changed  interrupted, changed, and ``--resume-changed``: continues from its last good
                    checkpoint under the new config (its optimiser hyperparameters replace the
                    checkpoint's); ``config.yaml`` and ``done`` keep the history

and a changed stage without either flag is refused, naming every differing key with its old
and new value. Paths inside the run are compared as ``${output}/...``: a moved run is unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..models.io import atomic_write_text, file_digest
from .errors import CorruptRunError, Interrupted, ResumeRefusedError, StageFailedError
from .rundir import DONE_FILE, portable, read_done, stage_outputs, verify_done, write_done

__all__ = ["SAFE_AFTER_DONE", "SAFE_ON_RESUME", "SignalGuard", "StagePlan", "build_cli",
           "diff_configs", "plan_stage", "run_stage", "stage_config"]

#: keys of a stage's ``fit`` that may change while a stage is interrupted: the budget, logging
#: and display. (A budget change also moves schedules that depend on it: TeacherPretraining's
#: cosine, SSD's ``interval: fraction``.)
SAFE_ON_RESUME = ("trainer.max_steps", "trainer.max_epochs", "trainer.max_time",
                  "trainer.min_steps", "trainer.min_epochs", "trainer.log_every_n_steps",
                  "trainer.enable_progress_bar", "trainer.enable_model_summary",
                  "trainer.logger", "trainer.profiler", "trainer.num_sanity_val_steps")
#: keys that may change after a stage finished without making its result stale
SAFE_AFTER_DONE = ("trainer.log_every_n_steps", "trainer.enable_progress_bar",
                   "trainer.enable_model_summary", "trainer.logger", "trainer.profiler",
                   "trainer.num_sanity_val_steps")

LOGGERS = {"csv": "lightning.pytorch.loggers.CSVLogger",
           "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
           "wandb": "lightning.pytorch.loggers.WandbLogger"}
#: the ``divergence:`` keys and the ``TrainingGuard`` argument each sets
DIVERGENCE_KEYS = {"factor": "divergence_factor", "patience": "divergence_patience",
                   "warmup": "divergence_warmup", "ema_alpha": "ema_alpha",
                   "check_every_n_steps": "check_every_n_steps"}
_MISSING = "<absent>"
#: what reading a damaged checkpoint raises (a truncated zip, pickle garbage, not a dict)
CHECKPOINT_ERRORS = (RuntimeError, OSError, EOFError, ValueError, KeyError, TypeError,
                     __import__("pickle").UnpicklingError)


# ----------------------------------------------------------------------------- config
def divergence_settings(spec: dict, stage: dict) -> dict:
    """``TrainingGuard`` arguments: the pipeline's ``divergence``, then the stage's."""
    merged = {**(spec.get("divergence") or {}), **(stage.get("divergence") or {})}
    return {DIVERGENCE_KEYS[k]: v for k, v in merged.items() if k in DIVERGENCE_KEYS}


def logger_entries(spec: dict) -> list[tuple[str, dict]]:
    """``loggers:`` as ``[(name, options)]`` (default ``[("csv", {})]``)."""
    out = []
    for entry in spec.get("loggers") or ["csv"]:
        if isinstance(entry, str):
            out.append((entry, {}))
        elif isinstance(entry, dict) and len(entry) == 1:
            name, opts = next(iter(entry.items()))
            out.append((str(name), dict(opts or {})))
        else:
            out.append((repr(entry), {}))  # validate says what is wrong
    return out


def _loggers(spec: dict, stage: dict, stage_dir: Path, attempt: int) -> list[dict]:
    out = []
    for name, opts in logger_entries(spec):
        if name == "csv":
            args = {"save_dir": str(stage_dir), "name": "logs", "version": f"attempt_{attempt}"}
        elif name == "tensorboard":
            args = {"save_dir": str(stage_dir), "name": "tensorboard",
                    "version": f"attempt_{attempt}"}
        elif name == "wandb":
            args = {"save_dir": str(stage_dir), "project": spec.get("name", "hedgecats"),
                    "name": f"{spec.get('name')}/{stage['name']}", "resume": "allow",
                    "id": f"{spec.get('run_id', 'run')}-{stage['name']}"}
        else:
            continue
        out.append({"class_path": LOGGERS[name], "init_args": {**args, **opts}})
    return out


def next_attempt(stage_dir: Path) -> int:
    """0 for the first run of a stage, then one more per run (each gets its own log
    directory, so no run overwrites the metrics of another)."""
    seen = [int(p.name.split("_", 1)[1]) for sub in ("logs", "tensorboard")
            for p in (stage_dir / sub).glob("attempt_*") if p.name.split("_", 1)[1].isdigit()]
    return max(seen, default=-1) + 1


def stage_config(spec: dict, stage: dict, stage_dir: Path, attempt: int) -> dict:
    """The full LightningCLI ``fit`` config of a stage (module docstring)."""
    cfg = copy.deepcopy(stage["fit"])
    trainer = cfg.setdefault("trainer", {}) or {}
    cfg["trainer"] = trainer
    trainer["default_root_dir"] = str(stage_dir)
    if "logger" not in trainer:
        trainer["logger"] = _loggers(spec, stage, stage_dir, attempt)
    ckdir = str(stage_dir / "checkpoints")
    callbacks = list(trainer.get("callbacks") or [])
    callbacks += [
        {"class_path": "hedgecats.pipeline.checkpoints.StageCheckpoint",
         "init_args": {"dirpath": ckdir,
                       "every_n_train_steps": spec.get("checkpoint_every_n_steps", 50)}},
        {"class_path": "hedgecats.lightning_modules.CheckpointOnInterrupt",
         "init_args": {"dirpath": ckdir}},
        {"class_path": "hedgecats.lightning_modules.TrainingGuard",
         "init_args": {"dirpath": ckdir, **divergence_settings(spec, stage)}},
    ]
    has_bar = any(isinstance(c, dict) and "ProgressBar" in str(c.get("class_path", ""))
                  for c in callbacks)
    if trainer.get("enable_progress_bar", True) is not False and not has_bar:
        callbacks.append({"class_path": "hedgecats.lightning_modules.StepProgressBar"})
    trainer["callbacks"] = callbacks
    if not _sharded(trainer.get("strategy")):
        trainer["plugins"] = [*_as_list(trainer.get("plugins")),
                              {"class_path": "hedgecats.lightning_modules.AtomicCheckpointIO"}]
    return cfg


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, list) else [x]


def _sharded(strategy) -> bool:
    """Strategies that write their own (sharded) checkpoints and take no CheckpointIO."""
    name = strategy.get("class_path", "") if isinstance(strategy, dict) else str(strategy or "")
    return any(s in name for s in ("ModelParallel", "fsdp", "FSDP", "deepspeed", "DeepSpeed"))


def build_cli(cfg: dict, *, parse_only: bool = False):
    """A ``LightningCLI`` of the stage classes from a config dict (``run=False``). With
    ``parse_only`` it validates against the classes' signatures and instantiates the model,
    data, callback and logger classes, but builds no Trainer and loads no model."""
    import hedgecats.lightning_modules  # noqa: F401  (short class names resolve)
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    class _CLI(LightningCLI):
        def instantiate_classes(self) -> None:
            if not parse_only:
                return super().instantiate_classes()
            self.config_init = self.parser.instantiate_classes(self.config)

        def _set_seed(self) -> None:
            if not parse_only:
                super()._set_seed()

    argv, import_sys = None, __import__("sys")
    argv, import_sys.argv = import_sys.argv, import_sys.argv[:1]  # config from cfg only
    try:
        return _CLI(pl.LightningModule, pl.LightningDataModule, subclass_mode_model=True,
                    subclass_mode_data=True, args=cfg, run=False, save_config_callback=None,
                    parser_kwargs={"exit_on_error": False})
    finally:
        import_sys.argv = argv


# ----------------------------------------------------------------------------- comparing
def _plain(x):
    """JSON-equal form: what a record holds after a round trip (int keys become strings)."""
    return json.loads(json.dumps(x, default=str))


def diff_configs(old, new, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``[(dotted key, old value, new value)]`` of every leaf that differs."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append((key, _MISSING, new[k]))
            elif k not in new:
                out.append((key, old[k], _MISSING))
            else:
                out += diff_configs(old[k], new[k], key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new))
                for d in diff_configs(a, b, f"{prefix}[{i}]")]
    return [] if old == new else [(prefix, old, new)]


def _is_safe(key: str, safe: tuple[str, ...]) -> bool:
    return any(key == s or key.startswith((s + ".", s + "[")) for s in safe)


def format_diffs(diffs: list[tuple[str, Any, Any]]) -> str:
    def show(v):
        text = v if v is _MISSING else json.dumps(v, default=str)
        return text if len(text) <= 80 else text[:77] + "..."

    return "; ".join(f"{k}: {show(a)} -> {show(b)}" for k, a, b in diffs)


def _inputs(spec: dict, stage: dict) -> dict[str, str]:
    """Digests of the files under the run directory that a stage reads (an earlier stage's
    ``stage.pt`` or saved model), keyed by their portable path; taken from that stage's
    ``done`` when it vouches for them."""
    out = Path(spec["output"])
    refs = set()

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str) and x.startswith(str(out) + "/"):
            refs.add(x)

    walk(stage["fit"])
    digests = {}
    for ref in sorted(refs):
        path = Path(ref)
        rel = path.relative_to(out)
        upstream = out / rel.parts[0]
        done = None
        try:
            done = read_done(upstream)
        except CorruptRunError:
            pass
        inner = str(Path(*rel.parts[1:])) if len(rel.parts) > 1 else ""
        if path.is_file() and path.suffix == ".pt":  # a stage checkpoint: what it holds
            with contextlib.suppress(OSError, ValueError):
                digests[portable(ref, out)] = stage_digest(path)
                continue
        if done and not done.get("legacy"):
            entries = sorted((k, v["sha256"]) for k, v in done["files"].items()
                             if not inner or k == inner or k.startswith(inner + "/"))
        elif path.is_file():
            entries = [(inner, file_digest(path))]
        elif path.is_dir():
            entries = [(str(p.relative_to(upstream)), file_digest(p))
                       for p in sorted(path.rglob("*")) if p.is_file()]
        else:
            entries = []
        if not entries:
            continue
        digests[portable(ref, out)] = entries[0][1] if len(entries) == 1 else \
            "sha256:" + __import__("hashlib").sha256(json.dumps(entries).encode()).hexdigest()
    return digests


def stage_digest(path: Path) -> str:
    """A digest of what a ``stage.pt`` holds (tensors, conversion and LoRA configs), not of
    its bytes: the file records its base model's absolute path, which changes when a run
    directory moves without changing the stage."""
    import hashlib

    from ..models.stage_files import read_stage

    payload = read_stage(path)
    h = hashlib.sha256(json.dumps([payload.get("hybrid_config"), payload.get("lora_config"),
                                   payload.get("base_model_relative")], sort_keys=True,
                                  default=str).encode())
    for name in sorted(payload["tensors"]):
        t = payload["tensors"][name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return f"stage-sha256:{h.hexdigest()}"


# ----------------------------------------------------------------------------- plans
@dataclass
class StagePlan:
    name: str
    dir: Path
    status: str  # done | resume | new | restart | resume-changed
    ckpt: Path | None = None
    step: int | None = None
    diffs: list = field(default_factory=list)  # unsafe differences from the record
    notes: list[str] = field(default_factory=list)
    record: dict | None = None  # what produced the checkpoint / the done stage
    restore_config: bool = False  # config.yaml is damaged: rewrite it from done's record

    def describe(self) -> str:
        if self.status == "done":
            return "done (skipped)"
        if self.status == "resume":
            return f"resume from checkpoints/{self.ckpt.name} (step {self.step})"
        if self.status == "resume-changed":
            return (f"resume from checkpoints/{self.ckpt.name} (step {self.step}) with the "
                    "changed config")
        if self.status == "restart":
            return "restart (changed; earlier files move to superseded/)"
        return "new"


def user_fit(spec: dict, stage: dict) -> dict:
    """The part of a stage that the user chose, with run-directory paths portable."""
    return _plain(portable(stage["fit"], spec["output"]))


def _checkpoint(stage_dir: Path) -> tuple[Path | None, dict | None, list[str]]:
    """The checkpoint to resume from: ``last.ckpt``, else ``previous.ckpt`` when
    ``last.ckpt`` cannot be read (the user is told), with its record."""
    from ..lightning_modules.guard import PREVIOUS, read_checkpoint_record

    ckdir = stage_dir / "checkpoints"
    last, prev = ckdir / "last.ckpt", ckdir / PREVIOUS
    if not last.exists() and not prev.exists():
        return None, None, []
    errors = []
    for path in (last, prev):
        if not path.exists():
            continue
        try:
            rec = read_checkpoint_record(path)
        except CHECKPOINT_ERRORS as err:  # truncated zip, pickle garbage, not a checkpoint
            errors.append((path, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
            continue
        notes = []
        if errors:
            notes.append(f"{errors[0][0]} cannot be read ({errors[0][1]}); resuming from {path} "
                         f"(step {rec['global_step']}) instead")
        return path, rec, notes
    bad = "; ".join(f"{p} ({e})" for p, e in errors)
    raise CorruptRunError(
        f"cannot resume stage {stage_dir.name!r}: its checkpoint cannot be read: {bad}. Move "
        f"{ckdir} away (e.g. rename it) to start the stage from its beginning")


def _readable_config(stage_dir: Path) -> bool:
    try:
        return isinstance(yaml.safe_load((stage_dir / "config.yaml").read_text()), dict)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def restore_config(plan: StagePlan) -> None:
    """Write ``config.yaml`` again from the full config kept in ``done``."""
    atomic_write_text(plan.dir / "config.yaml", yaml.safe_dump(plan.record["config"],
                                                               sort_keys=False))


def _legacy_fit(stage_dir: Path, spec: dict) -> dict | None:
    """The user part of an older run's ``config.yaml`` (written before records existed)."""
    path = stage_dir / "config.yaml"
    try:
        cfg = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(cfg, dict):
        return None
    trainer = dict(cfg.get("trainer") or {})
    for key in ("default_root_dir", "logger", "plugins"):
        trainer.pop(key, None)
    injected = ("ModelCheckpoint", "StageCheckpoint", "CheckpointOnInterrupt", "TrainingGuard",
                "StepProgressBar")
    cbs = [c for c in trainer.get("callbacks") or []
           if not (isinstance(c, dict) and str(c.get("class_path", "")).endswith(injected))]
    if cbs:
        trainer["callbacks"] = cbs
    else:
        trainer.pop("callbacks", None)
    cfg["trainer"] = trainer
    return _plain(portable(cfg, spec["output"]))


def plan_stage(spec: dict, stage: dict, *, restart_changed: bool = False,
               resume_changed: bool = False, upstream_runs: set[str] = frozenset(),
               check_inputs: bool = True) -> StagePlan:
    """What the next run does with ``stage`` (module docstring); raises ``ResumeRefusedError``
    for a changed stage without a flag, ``CorruptRunError`` for files that cannot be trusted.

    ``upstream_runs``: earlier stages that run (again) in this invocation; their outputs are
    checked against this stage's record when ``check_inputs`` (right before it runs)."""
    out = Path(spec["output"])
    d = out / stage["name"]
    new_fit = user_fit(spec, stage)
    where = f"stage {stage['name']!r} ({spec.get('source', '?')})"
    done = read_done(d)
    if done is not None:
        plan = StagePlan(stage["name"], d, "done", record=done)
        if done.get("legacy"):
            plan.notes.append(f"{d / DONE_FILE} was written by an older hedgecats and vouches for "
                              "nothing: its outputs are not verified (delete it to check the "
                              "stage again from its checkpoint)")
            return plan
        problems = verify_done(d, done)
        if problems:
            raise CorruptRunError(
                f"{where} is marked done, but {'; '.join(problems)}. Its outputs were changed "
                f"or damaged after it finished: delete {d / DONE_FILE} to finish the stage again "
                "from its last checkpoint (it rewrites them), or restore the files")
        diffs = [x for x in diff_configs(_plain(done.get("fit")), new_fit)
                 if not _is_safe(x[0], SAFE_AFTER_DONE)]
        feeding = sorted({k for k in done.get("inputs", {})
                          if Path(k.replace("${output}", str(out))).relative_to(out).parts[0]
                          in upstream_runs})
        if check_inputs:
            now = _inputs(spec, stage)
            diffs += [(f"inputs[{k}]", v, now.get(k, _MISSING))
                      for k, v in sorted(done.get("inputs", {}).items()) if now.get(k) != v]
        elif feeding:
            plan.notes.append(f"reads {', '.join(feeding)}, written again in this run: checked "
                              "when its turn comes")
        plan.diffs = diffs
        if diffs:
            return _changed(plan, where, "the config that produced it (done)", restart_changed,
                            resume_changed=False)
        if not _readable_config(d) and done.get("config"):
            plan.notes.append(f"{d / 'config.yaml'} is empty or unreadable: it is written again "
                              "from the record in done")
            plan.restore_config = True
        return plan
    ckpt, rec, notes = _checkpoint(d)
    if ckpt is None:
        return StagePlan(stage["name"], d, "new")
    record = (rec.get("record") or {})
    old_fit = record.get("fit")
    if old_fit is None:
        old_fit = _legacy_fit(d, spec)
        if old_fit is None:
            raise CorruptRunError(
                f"{where}: {ckpt} carries no record of its config and {d / 'config.yaml'} "
                "cannot be read: the config that produced the checkpoint is unknown. Move "
                f"{d / 'checkpoints'} away to start the stage from its beginning")
        notes.append(f"{ckpt} predates config records: compared with {d / 'config.yaml'}")
    plan = StagePlan(stage["name"], d, "resume", ckpt=ckpt, step=rec["global_step"],
                     notes=notes, record=record)
    diffs = [x for x in diff_configs(_plain(old_fit), new_fit)
             if not _is_safe(x[0], SAFE_ON_RESUME)]
    if check_inputs and "inputs" in record:
        now = _inputs(spec, stage)
        diffs += [(f"inputs[{k}]", v, now.get(k, _MISSING))
                  for k, v in sorted(record["inputs"].items()) if now.get(k) != v]
    plan.diffs = diffs
    if diffs:
        return _changed(plan, where, f"the config that produced {ckpt.name} (step {plan.step})",
                        restart_changed, resume_changed)
    return plan


def _changed(plan: StagePlan, where: str, what: str, restart: bool, resume_changed: bool
             ) -> StagePlan:
    if restart:
        plan.status = "restart"
        return plan
    if resume_changed:
        plan.status = "resume-changed"
        return plan
    options = ("--restart-changed to start it again from its beginning (its files move to "
               "superseded/)")
    if plan.ckpt is not None:
        options = ("--resume-changed to continue from its checkpoint under the new config, or "
                   + options)
    raise ResumeRefusedError(
        f"{where} differs from {what}: {format_diffs(plan.diffs)}. Put the old values back to "
        f"{'skip' if plan.status == 'done' else 'resume'} it, or run with {options}")


# ----------------------------------------------------------------------------- signals
class SignalGuard:
    """SIGTERM and SIGINT for the whole pipeline. During a stage's ``fit`` the signal goes to
    the stage's ``CheckpointOnInterrupt``: training stops at the end of the batch, on every
    rank together, after a checkpoint; elsewhere (between stages, the evaluation) it raises
    ``Interrupted`` at once."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.trainer = None  # set while a stage's fit runs
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalGuard:  # noqa: PYI034
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
        if self.trainer is not None:  # the stage's CheckpointOnInterrupt decides, per batch
            for cb in self.trainer.callbacks:
                if hasattr(cb, "notify_signal"):
                    cb.notify_signal(signum, frame)
            return
        raise Interrupted(signum, "")


# ----------------------------------------------------------------------------- running
@dataclass
class RunContext:
    spec: dict
    console: Any
    signals: SignalGuard
    resume_command: str
    rank0: bool = True


def _archive(stage_dir: Path) -> Path:
    """Move a stage's checkpoints, outputs, ``done`` and ``config.yaml`` to
    ``superseded/<n>/`` (logs stay: each attempt has its own)."""
    base = stage_dir / "superseded"
    n = len(list(base.glob("*"))) if base.exists() else 0
    dest = base / str(n)
    dest.mkdir(parents=True)
    moved = [stage_dir / "checkpoints", stage_dir / DONE_FILE, stage_dir / "config.yaml",
             *{stage_dir / p.relative_to(stage_dir).parts[0] for p in stage_outputs(stage_dir)}]
    for p in moved:
        if p.exists():
            shutil.move(str(p), str(dest / p.name))
    return dest


def _last_good(stage_dir: Path) -> str:
    from ..lightning_modules.guard import read_checkpoint_record

    last = stage_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return "no good checkpoint is left"
    try:
        step = read_checkpoint_record(last)["global_step"]
    except CHECKPOINT_ERRORS:
        return f"the last checkpoint is {last}"
    return f"the last good checkpoint is {last} (step {step})"


def _apply_new_optimizer_settings():
    """A callback for ``resume-changed``: after the checkpoint is restored, the optimiser
    hyperparameters (lr, weight decay, betas) and the schedulers' base rates of the new
    config replace the checkpoint's; moments and step counts are kept."""
    import lightning.pytorch as pl

    class ApplyNewOptimizerSettings(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

            fresh, fresh_scheds = _init_optimizers_and_lr_schedulers(pl_module)
            for old, new in zip(trainer.optimizers, fresh):
                for g_old, g_new in zip(old.param_groups, new.param_groups):
                    g_old.update({k: v for k, v in g_new.items() if k != "params"})
            for old_cfg, new_cfg in zip(trainer.lr_scheduler_configs, fresh_scheds):
                old_s, new_s = old_cfg.scheduler, new_cfg.scheduler
                if hasattr(new_s, "base_lrs"):
                    old_s.base_lrs = list(new_s.base_lrs)
                lambdas = getattr(old_s, "lr_lambdas", None)
                if lambdas:  # LambdaLR: the rate the schedule gives at this step
                    for g, base, fn in zip(old_s.optimizer.param_groups, old_s.base_lrs, lambdas):
                        g["lr"] = base * fn(old_s.last_epoch)

    return ApplyNewOptimizerSettings()


def run_stage(ctx: RunContext, stage: dict, plan: StagePlan) -> None:
    """Train one stage as planned, then write its ``done`` (rank 0)."""
    from lightning.pytorch.trainer.states import TrainerStatus
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from ..lightning_modules import (
        CheckpointOnInterrupt,
        DivergenceError,
        NonFiniteLossError,
        NonFiniteStateError,
        TrainingGuard,
    )

    spec, d = ctx.spec, plan.dir
    fit = user_fit(spec, stage)
    history = list((plan.record or {}).get("history") or []) \
        if plan.status in ("resume", "resume-changed") else []
    if ctx.rank0:
        d.mkdir(parents=True, exist_ok=True)
        if plan.status == "restart":
            dest = _archive(d)
            ctx.console.print(f"stage {stage['name']}: earlier files moved to {dest}",
                              markup=False, soft_wrap=True)
        elif plan.status == "resume-changed":
            history.append({"fit": plan.record.get("fit"), "until_step": plan.step})
            old = d / "config.yaml"
            if old.exists():
                keep = d / "superseded" / f"config-until-step{plan.step}.yaml"
                keep.parent.mkdir(exist_ok=True)
                shutil.copyfile(old, keep)
            ctx.console.print(f"stage {stage['name']}: continuing from step {plan.step} under "
                              f"the changed config: {format_diffs(plan.diffs)}", markup=False,
                              soft_wrap=True)
    cfg = stage_config(spec, stage, d, next_attempt(d))
    if ctx.rank0:
        header = ""
        if history:
            header = (f"# continued from a checkpoint of another config at step "
                      f"{history[-1]['until_step']} (--resume-changed): the earlier configs are "
                      "in done / the checkpoint record ('history') and superseded/\n")
        atomic_write_text(d / "config.yaml", header + yaml.safe_dump(cfg, sort_keys=False))
    inputs = _inputs(spec, stage)
    cli = build_cli(cfg)
    trainer = cli.trainer
    guard = next(c for c in trainer.callbacks if isinstance(c, TrainingGuard))
    guard.record = {"fit": fit, "inputs": inputs, "stage": stage["name"],
                    "run_dir": spec["output"], "history": history}
    on_interrupt = next(c for c in trainer.callbacks if isinstance(c, CheckpointOnInterrupt))
    if plan.status == "resume-changed":
        trainer.callbacks.append(_apply_new_optimizer_settings())
    ckpt = str(plan.ckpt) if plan.status in ("resume", "resume-changed") else None
    name = stage["name"]
    ctx.signals.trainer = trainer
    try:
        trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=ckpt)
    except SIGTERMException as err:
        signum = on_interrupt.signal or ctx.signals.received or signal.SIGTERM
        saved = (f"saved {on_interrupt.saved} (step {trainer.global_step})" if on_interrupt.saved
                 else f"nothing saved; {_last_good(d)}")
        raise Interrupted(signum, f"interrupted by {signal.Signals(signum).name} during stage "
                          f"{name!r}: {saved} -- resume with: {ctx.resume_command}") from err
    except SystemExit as err:  # Lightning's answer to a KeyboardInterrupt (a second Ctrl-C)
        if on_interrupt.signal != signal.SIGINT:
            raise
        raise Interrupted(signal.SIGINT, f"interrupted by SIGINT during stage {name!r}: stopped "
                          f"at once, nothing saved; {_last_good(d)} -- resume with: "
                          f"{ctx.resume_command}") from err
    except (NonFiniteLossError, NonFiniteStateError, DivergenceError) as err:
        good = (d / "checkpoints" / "last.ckpt").exists()
        then = ("run again with --resume-changed to continue from that checkpoint, or "
                "--restart-changed to start the stage over" if good else
                "run again with --restart-changed to start the stage over")
        raise StageFailedError(
            f"stage {name!r} stopped: {str(err).rstrip('.')}. Now {_last_good(d)}. Change the "
            f"config (e.g. --set stages.{name}.fit.model.init_args.lr=...), then {then}") from err
    finally:
        ctx.signals.trainer = None
    if trainer.state.status != TrainerStatus.FINISHED or trainer.interrupted:
        raise StageFailedError(f"stage {name!r} did not finish (status "
                               f"{trainer.state.status}); run again to resume it")
    if ctx.rank0:
        write_done(d, fit=fit, inputs=inputs,
                   extra={"stage": name, "global_step": trainer.global_step, "history": history,
                          "config": cfg})
    received = on_interrupt.signal or ctx.signals.received
    if received:
        raise Interrupted(received, f"interrupted by {signal.Signals(received).name} as stage "
                          f"{name!r} finished (it is done); the next stages resume with: "
                          f"{ctx.resume_command}")


def stale_temporaries(out: Path) -> list[Path]:
    """Temporary files of writes that a killed process left behind (``.NAME.tmp-PID`` whose
    process no longer runs)."""
    found = []
    for p in out.rglob(".*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                found.append(p)
            except PermissionError:
                pass
    return found


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
