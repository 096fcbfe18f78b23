"""The fault suite (issue 19, docs/reliability.md): what a pipeline run does when it is
signalled, diverges, finds damaged files, cannot write, meets a second run, or is given a
mistake. Each case runs a shrunken copy of the embedded default (``configs/pipelines/tiny.yaml``:
same classes, a 2-layer width-32 teacher, 3-6 steps per stage) in seconds; a finished run is
made once per module and copied, so most cases train one or two stages.

Cases that need a process of their own (SIGKILL, a second concurrent pipeline, a file-size
limit) run ``hedgecats pipeline`` in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from hedgecats.cli import main
from test_pipeline import short_tiny

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
       "PYTHONWARNINGS": "ignore"}


# ----------------------------------------------------------------------------- test callbacks
class SignalAtStep(pl.Callback):
    """Send ``signum`` to this process once, when the optimiser step ``step`` has finished (a
    file marks that it fired, so a resumed run does not fire again)."""

    def __init__(self, step: int, signum: int, once: str, where: str = "batch_end") -> None:
        self.step, self.signum, self.once, self.where = step, signum, Path(once), where

    def _fire(self, trainer) -> None:
        if trainer.global_step == self.step and not self.once.exists():
            self.once.write_text("fired")
            os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.where == "batch_end":
            self._fire(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.where == "train_end":
            self._fire(trainer)


class WaitAtStep(pl.Callback):
    """At optimiser step ``step``, write ``ready`` and wait (up to a minute) for a signal."""

    def __init__(self, step: int, ready: str) -> None:
        self.step, self.ready = step, Path(ready)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or self.ready.exists():
            return
        self.ready.write_text(str(os.getpid()))
        t0 = time.time()
        while time.time() - t0 < 60 and not trainer.received_sigterm:
            time.sleep(0.05)


class BlowUpAtStep(pl.Callback):
    """Divergence at a chosen step: once, after optimiser step ``step``, multiply the learning
    rate by ``lr_factor`` (the next step's update then sends the weights far out, the loss of the
    step after that is NaN), or set a trainable parameter to inf (``poison``)."""

    def __init__(self, step: int, once: str, lr_factor: float = 1.0, poison: bool = False):
        self.step, self.once, self.lr_factor, self.poison = step, Path(once), lr_factor, poison

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or self.once.exists():
            return
        self.once.write_text("fired")
        for opt in trainer.optimizers:
            for g in opt.param_groups:
                g["lr"] *= self.lr_factor
        if self.poison:
            p = next(p for p in pl_module.parameters() if p.requires_grad)
            with torch.no_grad():
                p.view(-1)[0] = float("inf")


# ----------------------------------------------------------------------------- helpers
def make_spec(path: Path, *, evaluate: bool = False, stages: dict | None = None,
              top: dict | None = None) -> Path:
    """The shrunken embedded default; ``stages`` maps a stage name to a function that edits its
    ``fit`` in place; ``top`` updates the top level."""
    spec = yaml.safe_load(short_tiny(path).read_text())
    if not evaluate:
        spec.pop("evaluate")
    for st in spec["stages"]:
        st["fit"]["trainer"]["log_every_n_steps"] = 1
        if stages and st["name"] in stages:
            stages[st["name"]](st["fit"])
    spec.update(top or {})
    path.write_text(yaml.safe_dump(spec))
    return path


def add_callback(cls: str, **init_args):
    def edit(fit):
        fit["trainer"].setdefault("callbacks", []).append(
            {"class_path": f"test_faults.{cls}", "init_args": init_args})
    return edit


def set_model_arg(**kw):
    def edit(fit):
        fit["model"]["init_args"].update(kw)
    return edit


def run(capsys, cfg: Path, out: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["pipeline", str(cfg), "--output", str(out), *extra])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line(err: str) -> str:
    """The error is one line, without a traceback (stderr also carries progress bars)."""
    lines = [x for x in err.splitlines() if x.startswith("hedgecats pipeline:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def ckpt_step(path: Path) -> int:
    return int(torch.load(path, weights_only=False, map_location="cpu")["global_step"])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished shrunken run (teacher, transfer, finetune), made once."""
    d = tmp_path_factory.mktemp("finished")
    cfg = make_spec(d / "tiny.yaml")
    assert main(["pipeline", str(cfg), "--output", str(d / "run")]) == 0
    return d / "run"


def copy_run(finished: Path, dest: Path, stages=("teacher",)) -> Path:
    """A run directory holding the finished run's ``stages`` (a moved copy: paths inside are
    recorded relative to the run, so they stay valid)."""
    dest.mkdir(parents=True)
    shutil.copy(finished / "hedgecats-run.json", dest)
    for name in stages:
        shutil.copytree(finished / name, dest / name)
    return dest


# ============================================================================= signals
def test_sigint_stops_at_a_batch_boundary_saves_and_exits_130(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer"))
    cfg = make_spec(tmp_path / "p.yaml", stages={"finetune": add_callback(
        "SignalAtStep", step=2, signum=int(signal.SIGINT), once=str(tmp_path / "fired"))})
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 130 and "interrupted by SIGINT during stage 'finetune'" in line
    last = out / "finetune" / "checkpoints" / "last.ckpt"
    assert "saved" in line and str(last) in line and "resume with: hedgecats pipeline" in line
    assert ckpt_step(last) == 2
    rc, text, _ = run(capsys, cfg, out)  # the same command resumes and finishes
    assert rc == 0 and "resume from checkpoints/last.ckpt (step 2)" in text
    assert ckpt_step(last) == 4 and (out / "finetune" / "done").exists()
    assert (out / "finetune" / "logs" / "attempt_0" / "metrics.csv").exists()  # kept
    assert (out / "finetune" / "logs" / "attempt_1" / "metrics.csv").exists()


def test_sigterm_as_a_stage_ends_keeps_it_done_and_exits_143(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run")
    cfg = make_spec(tmp_path / "p.yaml", stages={"transfer": add_callback(
        "SignalAtStep", step=3, signum=int(signal.SIGTERM), once=str(tmp_path / "fired"),
        where="train_end")})
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 143 and "as stage 'transfer' finished (it is done)" in line
    assert (out / "transfer" / "done").exists() and not (out / "finetune").exists()
    rc, text, _ = run(capsys, cfg, out)
    assert rc == 0 and "transfer: done, skipped" in text and (out / "finetune" / "done").exists()


def test_sigterm_during_the_evaluation(tmp_path, capsys, finished, monkeypatch):
    import hedgecats.cli as cli

    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    cfg = make_spec(tmp_path / "p.yaml", evaluate=True)
    real = cli.EVALUATORS["recall"]

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setitem(cli.EVALUATORS, "recall", interrupted)
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 143 and "during the evaluation (every stage is done)" in line
    assert not (out / "results.json").exists() and not (out / "pipeline.lock").exists()
    monkeypatch.setitem(cli.EVALUATORS, "recall", real)
    rc, _, _ = run(capsys, cfg, out)
    assert rc == 0 and json.loads((out / "results.json").read_text())["results"]


def _pipeline_process(cfg: Path, out: Path, *extra: str, preexec=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hedgecats.cli", "pipeline", str(cfg),
                             "--output", str(out), *extra], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=preexec)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the pipeline ended first ({proc.returncode}): "
                                 f"{proc.communicate()[1][-3000:]}")
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.1)


def test_two_runs_on_one_directory_and_sigterm_in_another_process(tmp_path, capsys, finished):
    """A second pipeline on a directory in use is refused (exit 3, naming the holder); SIGTERM
    to the first stops it with a checkpoint, one line and exit 143."""
    out = copy_run(finished, tmp_path / "run", ("teacher",))
    ready = tmp_path / "ready"
    cfg = make_spec(tmp_path / "p.yaml", stages={"transfer": add_callback(
        "WaitAtStep", step=2, ready=str(ready))})
    proc = _pipeline_process(cfg, out)
    try:
        _wait_for(ready, proc)
        rc, _, err = run(capsys, cfg, out)
        line = one_line(err)
        assert rc == 3 and f"in use by another pipeline: pid {proc.pid}" in line
        proc.send_signal(signal.SIGTERM)
        _, perr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, perr[-2000:]
    last_line = [x for x in perr.splitlines() if x.strip()][-1]
    assert "interrupted by SIGTERM during stage 'transfer'" in last_line and "saved" in last_line
    assert ckpt_step(out / "transfer" / "checkpoints" / "last.ckpt") == 2
    assert not (out / "pipeline.lock").exists()


def test_sigkill_leaves_a_run_that_resumes_and_a_stale_lock_taken_over(tmp_path, capsys,
                                                                      finished):
    out = copy_run(finished, tmp_path / "run", ("teacher",))
    cfg = make_spec(tmp_path / "p.yaml", stages={"transfer": add_callback(
        "SignalAtStep", step=2, signum=int(signal.SIGKILL), once=str(tmp_path / "fired"))})
    proc = _pipeline_process(cfg, out)
    proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL
    assert (out / "pipeline.lock").exists()  # nobody removed it
    last = out / "transfer" / "checkpoints" / "last.ckpt"
    assert ckpt_step(last) == 1  # killed before step 2's checkpoint
    rc, text, err = run(capsys, cfg, out)
    assert rc == 0, err
    assert f"took over the lock of pid {proc.pid}" in text.replace("\n", "")
    assert "resume from checkpoints/last.ckpt (step 1)" in text
    assert ckpt_step(last) == 3 and (out / "transfer" / "done").exists()
    assert not list(out.rglob(".*.tmp-*"))


# ============================================================================= divergence
def test_a_weight_blow_up_is_never_resumed_and_continues_from_the_last_good_checkpoint(
        tmp_path, capsys, finished):
    """The issue's case: a step sends the weights far out with a finite loss and is
    checkpointed; the next loss is NaN. That checkpoint is set apart, the one before is kept,
    and after the config is changed the stage continues from it."""
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer"))
    blowup = make_spec(tmp_path / "p.yaml", stages={"finetune": add_callback(
        "BlowUpAtStep", step=2, once=str(tmp_path / "fired"), lr_factor=1e27)})
    rc, _, err = run(capsys, blowup, out)
    line = one_line(err)
    assert rc == 1 and "stage 'finetune' stopped" in line and "non-finite loss" in line
    ck = out / "finetune" / "checkpoints"
    assert f"the last good checkpoint is {ck / 'last.ckpt'} (step 2)" in line
    assert (ck / "diverged-step3.ckpt").exists()  # finite but poisoned: set apart
    state = torch.load(ck / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())
    assert not (out / "finetune" / "done").exists()
    # the cause removed is a changed config: refused, naming the key and both values
    fixed = make_spec(tmp_path / "fixed.yaml")
    rc, _, err = run(capsys, fixed, out)
    line = one_line(err)
    assert rc == 2 and "trainer.callbacks: [" in line and "BlowUpAtStep" in line
    assert "-> <absent>" in line and "--resume-changed" in line and "--restart-changed" in line
    rc, text, err = run(capsys, fixed, out, "--resume-changed")
    assert rc == 0, err
    assert "continuing from step 2 under the changed config" in text.replace("\n", "")
    assert ckpt_step(ck / "last.ckpt") == 4
    done = json.loads((out / "finetune" / "done").read_text())
    assert done["history"][0]["until_step"] == 2
    assert "BlowUpAtStep" in json.dumps(done["history"][0]["fit"])
    assert (out / "finetune" / "config.yaml").read_text().startswith("# continued from")
    assert (out / "finetune" / "superseded" / "config-until-step2.yaml").exists()


def test_non_finite_weights_with_a_finite_loss_are_never_saved(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ("teacher",))
    cfg = make_spec(tmp_path / "p.yaml", stages={"transfer": add_callback(
        "BlowUpAtStep", step=2, once=str(tmp_path / "fired"), poison=True)})
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 1 and "a trainable parameter became NaN or inf by optimiser step 2" in line
    last = out / "transfer" / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint is {last} (step 1)" in line
    state = torch.load(last, weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())
    # a fixed learning rate, with --resume-changed: the new lr reaches the restored optimiser
    fixed = make_spec(tmp_path / "fixed.yaml", stages={"transfer": set_model_arg(lr=3e-3)})
    rc, text, err = run(capsys, fixed, out, "--resume-changed")
    assert rc == 0, err
    assert "model.init_args.lr: 0.01 -> 0.003" in text.replace("\n", "")
    assert ckpt_step(last) == 3
    final = torch.load(last, weights_only=False)
    assert final["optimizer_states"][0]["param_groups"][0]["lr"] == 3e-3


@pytest.mark.parametrize("stage,factor", [("transfer", 3.0), ("finetune", 1.1)])
def test_slow_divergence_stops_the_stage(tmp_path, capsys, finished, stage, factor):
    """lr 1e6: every loss stays finite, but far above its level (transfer: 2.9 -> ~45; the
    shrunken teacher's fine-tune loss, 4.7, only rises to uniform, 5.6: hence factor 1.1)."""
    keep = ("teacher",) if stage == "transfer" else ("teacher", "transfer")
    out = copy_run(finished, tmp_path / "run", keep)
    cfg = make_spec(tmp_path / "p.yaml", stages={stage: lambda fit: (
        fit["model"]["init_args"].update(lr=1.0e6), fit["trainer"].update(max_steps=12))},
        top={"divergence": {"warmup": 2, "patience": 3, "factor": factor, "ema_alpha": 0.5}})
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 1 and "the training loss diverged" in line and f"stage {stage!r}" in line
    assert not (out / stage / "done").exists() and not (out / stage / "stage.pt").exists()
    ck = out / stage / "checkpoints"
    assert list(ck.glob("diverged-step*.ckpt"))  # saved during the rise: set apart
    if (ck / "last.ckpt").exists():
        assert not torch.load(ck / "last.ckpt", weights_only=False)["hedgecats"]["health"][
            "suspect"]
