"""The fault suite (issue 19, docs/reliability.md): what a pipeline run does when it is
signalled, diverges, finds damaged files, cannot write, meets a second run, or is given a
mistake. Each case runs a shrunken copy of the embedded default (``configs/pipelines/tiny.yaml``:
same classes, a 2-layer width-32 teacher, 3-6 steps per stage) in seconds; a finished run is
made once per module and copied, so most cases train one or two stages.

Cases that need a process of their own (SIGKILL, a second concurrent pipeline, a file-size
limit) run ``hedgecats pipeline`` in a subprocess.
"""

from __future__ import annotations

import copy
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
    """At optimiser step ``step``, write ``ready`` and wait (up to 10 minutes: a slow machine must
    not let the run finish before the test signals it) for a signal."""

    def __init__(self, step: int, ready: str) -> None:
        self.step, self.ready = step, Path(ready)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step or self.ready.exists():
            return
        self.ready.write_text(str(os.getpid()))
        # the pipeline's CheckpointOnInterrupt records the signal (it replaces Lightning's
        # handler, so trainer.received_sigterm is set only at the next batch boundary)
        interrupt = next(c for c in trainer.callbacks
                         if type(c).__name__ == "CheckpointOnInterrupt")
        t0 = time.time()
        while time.time() - t0 < 600 and interrupt.signal is None:
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
        st["fit"] = copy.deepcopy(st["fit"])  # YAML anchors share mappings between stages
        st["fit"]["trainer"]["log_every_n_steps"] = 1
        if stages and st["name"] in stages:
            stages[st["name"]](st["fit"])
    # the fault cases name the exact step that blew up: check after every step (default 4)
    spec["divergence"] = {"check_every_n_steps": 1}
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
    from hedgecats.pipeline.evaluate import EVALUATORS

    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    cfg = make_spec(tmp_path / "p.yaml", evaluate=True)
    real = EVALUATORS["recall"]

    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setitem(EVALUATORS, "recall", interrupted)
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 143 and "during the evaluation (every stage is done)" in line
    assert not (out / "results.json").exists() and not (out / "pipeline.lock").exists()
    monkeypatch.setitem(EVALUATORS, "recall", real)
    rc, _, _ = run(capsys, cfg, out)
    assert rc == 0 and json.loads((out / "results.json").read_text())["results"]


def test_a_second_run_of_a_finished_run_keeps_its_results(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    cfg = make_spec(tmp_path / "p.yaml", evaluate=True)
    rc, text, err = run(capsys, cfg, out)
    assert rc == 0, err
    first = (out / "results.json").read_bytes()
    assert "evaluation: recall" in text and json.loads(first)["evaluation_key"].startswith("sha")

    rc, text, err = run(capsys, cfg, out)  # nothing changed: nothing runs, the file stays
    assert rc == 0, err
    assert "results.json is current" in text and "evaluation: recall" not in text
    assert f"run directory: {out}" in text  # where the results are, as after any run
    assert (out / "results.json").read_bytes() == first

    rc, text, err = run(capsys, cfg, out, "--reevaluate")
    assert rc == 0, err
    assert "evaluation: recall" in text
    assert json.loads((out / "results.json").read_text())["evaluation_key"] == json.loads(
        first)["evaluation_key"]

    spec = yaml.safe_load(cfg.read_text())  # another evaluate: section is evaluated
    spec["evaluate"]["modes"] = spec["evaluate"]["modes"][:2]
    cfg.write_text(yaml.safe_dump(spec))
    rc, text, err = run(capsys, cfg, out)
    assert rc == 0, err
    assert "evaluation: recall" in text
    assert json.loads((out / "results.json").read_text())["evaluation_key"] != json.loads(
        first)["evaluation_key"]


def _pipeline_process(cfg: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hedgecats.cli", "pipeline", str(cfg),
                             "--output", str(out), *extra], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


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


def test_sigterm_during_start_up_prints_a_line(tmp_path):
    """A scheduler's SIGTERM while the pipeline validates and plans (before any stage): one
    line and exit 143, nothing written (it died silently with 143; issue 50, item 9)."""
    cfg = make_spec(tmp_path / "p.yaml")
    out = tmp_path / "run"
    code = ("import os, signal, sys\n"
            "import hedgecats.pipeline.validate as v\n"
            "real = v.validate_pipeline\n"
            "def signalled(*a, **k):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return real(*a, **k)\n"
            "v.validate_pipeline = signalled\n"
            "from hedgecats.cli import main\n"
            f"sys.exit(main(['pipeline', {str(cfg)!r}, '--output', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=240, check=False)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hedgecats pipeline:")]
    assert proc.returncode == 143 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        (proc.returncode, proc.stderr[-3000:])
    assert "interrupted by SIGTERM during start-up" in lines[0] and "nothing ran" in lines[0]
    assert not out.exists()


def test_a_changed_checkpoint_period_resumes_from_the_newest_checkpoint(tmp_path, capsys,
                                                                         finished):
    """checkpoint_every_n_steps may change on resume (issue 50, item 1): Lightning's
    ModelCheckpoint keys its state by its arguments, so after the change it did not know
    last.ckpt, wrote last-v1.ckpt, ... and a run after a SIGKILL resumed from the stale
    last.ckpt."""
    out = copy_run(finished, tmp_path / "run", ("teacher",))
    signals = [add_callback("SignalAtStep", step=2, signum=int(signal.SIGTERM),
                            once=str(tmp_path / "term")),
               add_callback("SignalAtStep", step=4, signum=int(signal.SIGKILL),
                            once=str(tmp_path / "kill"))]

    def transfer(fit):
        fit["trainer"]["max_steps"] = 6
        for edit in signals:
            edit(fit)

    every2 = make_spec(tmp_path / "every2.yaml", stages={"transfer": transfer},
                       top={"checkpoint_every_n_steps": 2})
    every1 = make_spec(tmp_path / "every1.yaml", stages={"transfer": transfer},
                       top={"checkpoint_every_n_steps": 1})
    ck = out / "transfer" / "checkpoints"
    rc, _, err = run(capsys, every2, out)
    assert rc == 143 and ckpt_step(ck / "last.ckpt") == 2, err
    proc = _pipeline_process(every1, out)  # the period changed; killed at step 4
    proc.communicate(timeout=240)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in ck.glob("last*.ckpt")) == ["last.ckpt"]
    assert ckpt_step(ck / "last.ckpt") == 3  # the newest periodic checkpoint
    rc, text, err = run(capsys, every1, out)
    assert rc == 0, err
    assert "resume from checkpoints/last.ckpt (step 3)" in text
    assert ckpt_step(ck / "last.ckpt") == 6
    assert sorted(p.name for p in ck.glob("last*.ckpt")) == ["last.ckpt"]


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


@pytest.mark.parametrize("stage,factor", [("transfer", 1.5), ("finetune", 1.1)])
def test_slow_divergence_stops_the_stage(tmp_path, capsys, finished, stage, factor):
    """lr 1e6: every loss stays finite, but far above its level (transfer: 3.2 -> 6-45 with
    this shrunken teacher, depending on the feature maps; its fine-tune loss, 4.7, only rises to
    uniform, 5.6: hence factors below the default 3)."""
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


# ============================================================================= resume: exact or refused
def _interrupted(tmp_path, finished, capsys, stage="finetune", at=2):
    """A run whose ``stage`` was stopped by SIGTERM after step ``at`` (checkpoint there)."""
    keep = {"transfer": ("teacher",), "finetune": ("teacher", "transfer")}[stage]
    out = copy_run(finished, tmp_path / "run", keep)
    cfg = make_spec(tmp_path / "p.yaml", stages={stage: add_callback(
        "SignalAtStep", step=at, signum=int(signal.SIGTERM), once=str(tmp_path / "fired"))})
    rc, _, _ = run(capsys, cfg, out)
    assert rc == 143
    return out, cfg


def _with(cfg: Path, dest: Path, stage: str, edit) -> Path:
    spec = yaml.safe_load(cfg.read_text())
    st = next(st for st in spec["stages"] if st["name"] == stage)
    st["fit"] = copy.deepcopy(st["fit"])  # YAML anchors share mappings between stages
    edit(st["fit"])
    dest.write_text(yaml.safe_dump(spec))
    return dest


def test_a_changed_config_is_refused_naming_every_key_and_the_record_stays(tmp_path, capsys,
                                                                          finished):
    out, cfg = _interrupted(tmp_path, finished, capsys)
    record = (out / "finetune" / "config.yaml").read_text()
    changed = _with(cfg, tmp_path / "c.yaml", "finetune", lambda fit: (
        fit["model"]["init_args"].update(lr=5e-3),
        fit["data"]["init_args"].update(batch_size=2)))
    rc, _, err = run(capsys, changed, out)
    line = one_line(err)
    assert rc == 2 and "stage 'finetune'" in line
    assert "differs from the config that produced last.ckpt (step 2)" in line
    assert "model.init_args.lr: 0.001 -> 0.005" in line
    assert "data.init_args.batch_size: 4 -> 2" in line
    assert (out / "finetune" / "config.yaml").read_text() == record  # still the truth
    assert ckpt_step(out / "finetune" / "checkpoints" / "last.ckpt") == 2
    # the same refusal from --dry-run, before anything would train
    rc, _, err = run(capsys, changed, out, "--dry-run")
    assert rc == 2 and "model.init_args.lr: 0.001 -> 0.005" in one_line(err)
    # --restart-changed: earlier files set apart (logs stay), the stage starts from step 0
    rc, _, err = run(capsys, changed, out, "--restart-changed")
    assert rc == 0, err
    old = out / "finetune" / "superseded" / "0"
    assert ckpt_step(old / "checkpoints" / "last.ckpt") == 2 and (old / "config.yaml").exists()
    assert ckpt_step(out / "finetune" / "checkpoints" / "last.ckpt") == 4
    assert (out / "finetune" / "logs" / "attempt_0").is_dir()  # the first attempt's metrics
    saved = yaml.safe_load((out / "finetune" / "config.yaml").read_text())
    assert saved["model"]["init_args"]["lr"] == 5e-3


def test_keys_that_may_change_on_resume(tmp_path, capsys, finished):
    """max_steps and logging may change while a stage is interrupted: it resumes exactly."""
    out, cfg = _interrupted(tmp_path, finished, capsys)
    longer = _with(cfg, tmp_path / "c.yaml", "finetune", lambda fit: fit["trainer"].update(
        max_steps=5, log_every_n_steps=2, enable_model_summary=True))
    rc, text, err = run(capsys, longer, out)
    assert rc == 0, err
    assert "resume from checkpoints/last.ckpt (step 2)" in text
    assert ckpt_step(out / "finetune" / "checkpoints" / "last.ckpt") == 5


def test_a_changed_done_stage_and_the_stages_that_read_it(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    changed = make_spec(tmp_path / "c.yaml", stages={"transfer": set_model_arg(lr=2e-2)})
    rc, _, err = run(capsys, changed, out)
    line = one_line(err)
    assert rc == 2 and "stage 'transfer'" in line and "(done)" in line
    assert "model.init_args.lr: 0.01 -> 0.02" in line and "--resume-changed" not in line
    sha = json.loads((out / "finetune" / "done").read_text())["files"]["stage.pt"]["sha256"]
    rc, _, err = run(capsys, changed, out, "--restart-changed")
    assert rc == 0, err
    # finetune read transfer's stage.pt, which changed: it ran again too
    assert (out / "transfer" / "superseded" / "0" / "stage.pt").exists()
    assert (out / "finetune" / "superseded" / "0" / "stage.pt").exists()
    assert json.loads((out / "finetune" / "done").read_text())["files"]["stage.pt"]["sha256"] != sha
    rc, text, _ = run(capsys, changed, out)  # and now everything is done
    assert rc == 0 and text.count("done, skipped") == 3


def test_a_moved_run_still_resumes_skips_and_evaluates(tmp_path, capsys, finished):
    out, cfg = _interrupted(tmp_path, finished, capsys)
    moved = tmp_path / "elsewhere" / "run2"
    moved.parent.mkdir()
    shutil.move(str(out), str(moved))
    spec = yaml.safe_load(cfg.read_text())
    spec["evaluate"] = yaml.safe_load(make_spec(tmp_path / "e.yaml", evaluate=True).read_text())[
        "evaluate"]
    cfg.write_text(yaml.safe_dump(spec))
    rc, text, err = run(capsys, cfg, moved, "--dry-run")
    assert rc == 0, err
    assert "differs" not in text + err and text.count("done (skipped)") == 2
    rc, text, err = run(capsys, cfg, moved)
    assert rc == 0, err
    assert "resume from checkpoints/last.ckpt (step 2)" in text
    results = json.loads((moved / "results.json").read_text())
    assert results["results"]["teacher"]["n_far"] > 0  # the teacher found in the moved run
    from hedgecats.models.stage_files import read_stage

    rel = read_stage(moved / "finetune" / "stage.pt")["base_model_relative"]
    assert rel == "../teacher/model"


# ============================================================================= damaged files
def test_a_truncated_last_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys, finished):
    out, cfg = _interrupted(tmp_path, finished, capsys, at=3)
    ck = out / "finetune" / "checkpoints"
    assert ckpt_step(ck / "previous.ckpt") == 2
    data = (ck / "last.ckpt").read_bytes()
    (ck / "last.ckpt").write_bytes(data[: len(data) // 2])
    rc, text, err = run(capsys, cfg, out)
    assert rc == 0, err
    flat = text.replace("\n", "")
    assert "last.ckpt cannot be read" in flat and "resuming from" in flat and "(step 2)" in flat
    assert ckpt_step(ck / "last.ckpt") == 4


def test_checkpoints_that_cannot_be_read_are_named(tmp_path, capsys, finished):
    out, cfg = _interrupted(tmp_path, finished, capsys)
    ck = out / "finetune" / "checkpoints"
    for name in ("last.ckpt", "previous.ckpt"):
        if (ck / name).exists():
            (ck / name).write_bytes(b"PK\x03\x04 truncated")
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 1 and "cannot resume stage 'finetune'" in line and str(ck / "last.ckpt") in line
    assert "Move" in line and "to start the stage from its beginning" in line


@pytest.mark.parametrize("damage", ["truncated stage.pt", "missing model file", "garbage done",
                                    "empty config.yaml"])
def test_damaged_outputs_of_a_done_stage(tmp_path, capsys, finished, damage):
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    cfg = make_spec(tmp_path / "p.yaml")
    if damage == "truncated stage.pt":
        pt = out / "transfer" / "stage.pt"
        pt.write_bytes(pt.read_bytes()[:100])
        expect = "stage 'transfer' (" , "is marked done, but stage.pt has 100 bytes"
    elif damage == "missing model file":
        (out / "teacher" / "model" / "config.json").unlink()
        expect = "stage 'teacher' (", "model/config.json is missing"
    elif damage == "garbage done":
        (out / "transfer" / "done").write_text("{not json")
        expect = str(out / "transfer" / "done"), "cannot be read as a stage's done record"
    else:
        (out / "transfer" / "config.yaml").write_text("")
        rc, text, err = run(capsys, cfg, out)
        assert rc == 0, err
        assert "config.yaml is empty or unreadable: it is written again" in text.replace("\n", "")
        assert yaml.safe_load((out / "transfer" / "config.yaml").read_text())["model"]
        return
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 1 and all(e in line for e in expect), line
    if damage == "truncated stage.pt":  # what the message says to do works
        assert "delete" in line and "done" in line
        (out / "transfer" / "done").unlink()
        rc, text, err = run(capsys, cfg, out)
        assert rc == 0, err
        from hedgecats.models.stage_files import read_stage

        assert read_stage(out / "transfer" / "stage.pt")["tensors"]


def test_a_failed_checkpoint_write_leaves_no_partial_file(tmp_path, capsys, finished):
    """RLIMIT_FSIZE stands in for a full disk: the first checkpoint of the stage cannot be
    written; the error is one line and no truncated or temporary file remains."""
    out = copy_run(finished, tmp_path / "run", ("teacher",))
    cfg = make_spec(tmp_path / "p.yaml")
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (24000, resource.RLIM_INFINITY)); "
            "from hedgecats.cli import main; "
            f"sys.exit(main(['pipeline', {str(cfg)!r}, '--output', {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True,
                          timeout=240, check=False)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hedgecats pipeline:")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    ck = out / "transfer" / "checkpoints"
    assert f"could not write '{ck / 'last.ckpt'}' (File too large)" in lines[0]
    assert "nothing was left" in lines[0]
    assert not (ck / "last.ckpt").exists() and not list(out.rglob(".*.tmp-*"))
    assert not (out / "transfer" / "done").exists() and not (out / "pipeline.lock").exists()
    rc, _, err = run(capsys, cfg, out)  # room again: the stage runs
    assert rc == 0, err


def test_atomic_write_keeps_the_previous_file_when_a_write_fails(tmp_path):
    import errno

    from hedgecats.models.io import WriteFailedError, atomic_write, atomic_write_text

    path = atomic_write_text(tmp_path / "results.json", "old")
    with pytest.raises(WriteFailedError, match="disk is full.*previous version is intact"), \
            atomic_write(path) as f:
        f.write(b"new, half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


# ============================================================================= one run per directory
def test_lock_held_by_a_live_process_or_another_host(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer", "finetune"))
    cfg = make_spec(tmp_path / "p.yaml")
    holder = subprocess.Popen(["sleep", "30"])
    try:
        (out / "pipeline.lock").write_text(json.dumps({
            "pid": holder.pid, "host": __import__("socket").gethostname(),
            "started": "2026-01-01T00:00:00", "command": "hedgecats pipeline other.yaml"}))
        rc, _, err = run(capsys, cfg, out)
        line = one_line(err)
        assert rc == 3 and f"pid {holder.pid}" in line and "other.yaml" in line
    finally:
        holder.kill()
        holder.wait()
    (out / "pipeline.lock").write_text(json.dumps({
        "pid": 1, "host": "gpu-node-7", "started": "2026-01-01T00:00:00", "command": "x"}))
    rc, _, err = run(capsys, cfg, out)
    line = one_line(err)
    assert rc == 3 and "on gpu-node-7" in line and "delete" in line
    (out / "pipeline.lock").unlink()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / "pipeline.lock").write_text(json.dumps({
        "pid": dead.pid, "host": __import__("socket").gethostname(),
        "started": "2026-01-01T00:00:00", "command": "x"}))
    rc, text, err = run(capsys, cfg, out)
    assert rc == 0, err
    assert f"took over the lock of pid {dead.pid}" in text.replace("\n", "")
    assert not (out / "pipeline.lock").exists()


# ============================================================================= mistakes
def _bad(tmp_path, edit=None, top=None) -> Path:
    spec = yaml.safe_load(make_spec(tmp_path / "b.yaml", evaluate=True).read_text())
    if edit:
        edit(spec)
    spec.update(top or {})
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path / "b.yaml"


def _stage(spec, name):
    st = next(st for st in spec["stages"] if st["name"] == name)
    st["fit"] = copy.deepcopy(st["fit"])
    return st["fit"]


MISTAKES = {
    "yaml syntax": (lambda p: p.write_text("stages:\n  - name: a\n   fit: {}\n"),
                    "is not valid YAML at line 3, column 4"),
    "missing file": (lambda p: p.unlink(), "no such pipeline file"),
    "empty file": (lambda p: p.write_text(""), "(the file is empty)"),
    "model typo": (lambda s: _stage(s, "transfer")["model"]["init_args"].update(objectve="x"),
                   ("stages.transfer.fit.model.init_args: 'objectve' is not an argument of "
                    "AttentionTransfer; did you mean 'objective'?")),
    "hybrid typo": (lambda s: _stage(s, "transfer")["model"]["init_args"]["hybrid"].update(
        windw=4), ("init_args.hybrid: 'windw' is not a field of HybridConfig; did you mean "
                   "'window'?")),
    "window 0": (lambda s: _stage(s, "finetune")["model"]["init_args"]["hybrid"].update(
        window=0), "HybridConfig.window=0 must be an integer >= 1"),
    "negative lr": (lambda s: _stage(s, "finetune")["model"]["init_args"].update(lr=-1e-3),
                    "stages.finetune.fit.model.init_args.lr=-0.001 must be a finite number > 0"),
    "teacher lr": (lambda s: _stage(s, "teacher")["model"]["init_args"].update(lr=0),
                   "stages.teacher.fit.model.init_args.lr=0 must be a finite number > 0"),
    "wrong type": (lambda s: _stage(s, "transfer")["trainer"].update(max_steps="many"),
                   "stages.transfer.fit: trainer.max_steps: Expected a <class 'int'>"),
    "unknown class": (lambda s: _stage(s, "finetune")["model"].update(
        class_path="HybridFinetun"), ("'HybridFinetun' is not a LightningModule class that "
                                      "hedgecats knows; did you mean 'HybridFinetune'?")),
    "bad objective": (lambda s: _stage(s, "transfer")["model"]["init_args"].update(
        objective="mse"), "objective='mse' is not valid; choose one of weights_xent"),
    "no local model": (lambda s: _stage(s, "transfer")["model"]["init_args"].update(
        model_name_or_path="/models/llama-3-8b"),
        "model_name_or_path='/models/llama-3-8b': no such directory"),
    "later stage": (lambda s: _stage(s, "transfer")["model"]["init_args"].update(
        init_from="${stages.finetune}/stage.pt"), ("is written by stage 'finetune', which "
                                                   "does not run before 'transfer'")),
    "ckpt_path": (lambda s: _stage(s, "finetune").update(ckpt_path="last"),
                  "unknown key 'ckpt_path' (the pipeline resumes stages itself)"),
    "checkpointing off": (lambda s: _stage(s, "transfer")["trainer"].update(
        enable_checkpointing=False), "enable_checkpointing=false: a pipeline stage always "),
    "checkpoint every 0": (None, "checkpoint_every_n_steps=0 must be an integer >= 1",
                           {"checkpoint_every_n_steps": 0}),
    "divergence typo": (None, "divergence: unknown keys ['patients']", {"divergence": {
        "patients": 3}}),
    "evaluate key": (lambda s: s["evaluate"].update(batchsize=8),
                     ("evaluate: 'batchsize' is not a key of a recall evaluation; did you mean "
                      "'batch_size'?")),
    "evaluate mode": (lambda s: s["evaluate"].update(modes=["hybird"]),
                      "evaluate.modes: 'hybird' is not a mode; did you mean 'hybrid'?"),
    "evaluate stage": (lambda s: s["evaluate"].update(stage="fintune"),
                       "evaluate.stage='fintune' is not a stage of the pipeline"),
    "variant switch": (lambda s: s["evaluate"]["variants"]["rescale"].update(rescal=True),
                       "evaluate.variants.rescale: 'rescal' is not a switch"),
    "evaluate list": (lambda s: s.update(evaluate=[s["evaluate"], {"kind": "recall", "stage":
                                                                    "finetune", "modes": ["x"]}]),
                      "evaluate[1].modes: 'x' is not a mode"),
    "unknown logger": (None, "loggers entry neptune is not valid", {"loggers": ["neptune"]}),
    # issue 50, item 8: values that failed only after the model had loaded
    "batch size 0": (lambda s: _stage(s, "teacher")["data"]["init_args"].update(batch_size=0),
                     "stages.teacher.fit.data: RecallDataModule: batch_size=0 must be an "
                     "integer >= 1"),
    "max_steps 0": (lambda s: _stage(s, "transfer")["trainer"].update(max_steps=0),
                    "stages.transfer.fit.trainer.max_steps=0 trains nothing"),
    "val_check_interval": (lambda s: _stage(s, "transfer")["trainer"].update(
        val_check_interval=1000), ("stages.transfer.fit.trainer.val_check_interval=1000 is "
                                   "longer than an epoch (16 batches")),
    # issue 50, item 9: errors that did not say enough
    "trainer typo": (lambda s: _stage(s, "transfer")["trainer"].update(max_step=3),
                     ("stages.transfer.fit.trainer: 'max_step' is not an argument of Trainer; "
                      "did you mean 'max_steps'?")),
    "positions": (lambda s: _stage(s, "transfer")["data"]["init_args"].update(seq_len=2048),
                  ("stages.transfer.fit.data.init_args.seq_len=2048 is longer than the "
                   "model's max_position_embeddings=1024 (stage 'teacher')")),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_every_mistake_is_one_clear_error_before_anything_runs(tmp_path, capsys, case):
    edit, expect, *top = MISTAKES[case]
    out = tmp_path / "run"
    if case in ("yaml syntax", "missing file", "empty file"):
        cfg = _bad(tmp_path)
        edit(cfg)
    else:
        cfg = _bad(tmp_path, edit, top[0] if top else None)
    t0 = time.time()
    rc, _, err = run(capsys, cfg, out, "--dry-run")
    line = one_line(err)
    assert rc == 2 and expect in line, line
    assert str(cfg) in line or case in ("no local model",) or "--output" in line
    assert not out.exists()  # nothing written
    rc, _, err = run(capsys, cfg, out)  # the real run stops at the same place
    assert rc == 2 and expect in one_line(err) and not out.exists()
    assert time.time() - t0 < 120  # no model is loaded: seconds, with room for a slow CI machine


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    from hedgecats.pipeline.errors import ConfigError

    cfg = _bad(tmp_path, top={"checkpoint_every_n_steps": 0})
    with pytest.raises(ConfigError):
        main(["pipeline", str(cfg), "--output", str(tmp_path / "run"), "--debug"])
    monkeypatch.setenv("HEDGECATS_DEBUG", "1")
    with pytest.raises(ConfigError):
        main(["pipeline", str(cfg), "--output", str(tmp_path / "run")])


def test_output_that_is_a_file_or_not_a_run(tmp_path, capsys):
    cfg = make_spec(tmp_path / "p.yaml")
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(capsys, cfg, tmp_path / "afile", "--dry-run")
    assert rc == 2 and "is a file, not a directory" in one_line(err)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text('{"mine": 1}')
    (mine / "notes.txt").write_text("do not touch")
    rc, _, err = run(capsys, cfg, mine)
    line = one_line(err)
    assert rc == 2 and "is not empty and is not a hedgecats run" in line and "--force" in line
    assert (mine / "results.json").read_text() == '{"mine": 1}'
    rc, _, err = run(capsys, cfg, mine, "--dry-run", "--force")
    assert rc == 0, err


def test_run_directories_follow_the_umask(tmp_path, capsys, finished):
    out = copy_run(finished, tmp_path / "run", ())
    cfg = make_spec(tmp_path / "p.yaml")
    old = os.umask(0o022)
    try:
        rc, _, err = run(capsys, cfg, out)
    finally:
        os.umask(old)
    assert rc == 0, err
    for d in (out / "transfer", out / "finetune" / "checkpoints"):
        assert d.stat().st_mode & 0o777 == 0o755
    assert (out / "results.json").stat().st_mode & 0o777 == 0o644
    assert (out / "transfer" / "stage.pt").stat().st_mode & 0o777 == 0o644
    # safetensors writes 0600 through a temporary file (issue 50, item 5)
    for f in (out / "teacher" / "model").iterdir():
        assert f.stat().st_mode & 0o777 == 0o644, f


def test_evaluate_output_follows_the_umask(tmp_path):
    from hedgecats.evaluation.report import atomic_output_dir

    old = os.umask(0o022)
    try:
        with atomic_output_dir(tmp_path / "results") as d:
            (d / "x").write_text("1")
    finally:
        os.umask(old)
    assert (tmp_path / "results").stat().st_mode & 0o777 == 0o755


def test_atomic_directory_replaces_on_success_and_keeps_the_old_one_on_error(tmp_path):
    """What export, import-lolcats and evaluate write their directories through."""
    from hedgecats.models.io import atomic_directory

    out = tmp_path / "model"
    out.mkdir()
    (out / "old").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(out) as d:
        (d / "new").write_text("new")
        raise RuntimeError("the export failed half-way")
    assert sorted(p.name for p in out.iterdir()) == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left
    with atomic_directory(out) as d:
        (d / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_parameters_finite_check():
    from hedgecats.lightning_modules.guard import parameters_finite

    ok = [torch.randn(10, 10), torch.randn(3, dtype=torch.bfloat16), torch.zeros(0)]
    assert parameters_finite(ok)
    huge = [torch.full((100,), 1e30)]  # its 2-norm overflows fp32: confirmed element-wise
    assert parameters_finite(huge)
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(5, 5)
        t[2, 3] = bad
        assert not parameters_finite([*ok, t])


def test_a_second_ctrl_c_stops_at_once():
    from hedgecats.lightning_modules import CheckpointOnInterrupt

    cb = CheckpointOnInterrupt("/nonexistent")
    cb.notify_signal(signal.SIGINT)  # recorded: the stage stops at the end of the batch
    assert cb.signal == signal.SIGINT
    cb.notify_signal(signal.SIGTERM)  # another signal changes nothing
    old = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(KeyboardInterrupt):
            cb.notify_signal(signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, old)
