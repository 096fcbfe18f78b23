"""A backend named in a recipe (``hybrid.backend``) is used only on the device it names, through
the whole pipeline, or the recipe is refused at validation (issue 50, item 7b)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hedgecats.cli import main
from test_pipeline import short_tiny


def _spec(tmp_path: Path, backend: str, accelerator: str | None = None,
          eval_device: str | None = None) -> Path:
    """The shortened embedded default, teacher and transfer, with ``backend`` in the transfer
    stage's hybrid config (and ``accelerator`` in its trainer); with ``eval_device``, a recall
    evaluation of the transfer stage on that device."""
    spec = yaml.safe_load(short_tiny(tmp_path / "tiny.yaml").read_text())
    evaluation = spec.pop("evaluate")
    if eval_device is not None:
        spec["evaluate"] = {**evaluation, "stage": "transfer", "device": eval_device}
    spec["stages"] = spec["stages"][:2]
    fit = spec["stages"][1]["fit"]
    fit["model"]["init_args"]["hybrid"] = {**fit["model"]["init_args"]["hybrid"],
                                           "backend": backend}
    if accelerator is not None:
        fit["trainer"] = {**fit["trainer"], "accelerator": accelerator}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture
def gpu_only_backend(monkeypatch):
    """``fla`` as on a GPU, on this CPU machine: it runs (as the reference) while a stage's model
    is on the device it trains on, and fails as fla fails on a CPU tensor once Lightning's
    teardown has moved the model to the CPU."""
    from hedgecats.models.ops.hybrid import backends
    from lightning.pytorch.strategies.strategy import Strategy

    state = {"moved": False}
    setup, teardown, select = Strategy.setup, Strategy.teardown, backends.select

    def on_setup(self, trainer):
        state["moved"] = False
        return setup(self, trainer)

    def on_teardown(self):
        state["moved"] = True
        return teardown(self)

    def gpu_select(backend, q, key_padding_mask=None):
        if backend == "fla" and not state["moved"]:
            return backends.REFERENCE
        return select(backend, q, key_padding_mask)  # fla: "needs a CUDA tensor"

    monkeypatch.setattr(Strategy, "setup", on_setup)
    monkeypatch.setattr(Strategy, "teardown", on_teardown)
    monkeypatch.setattr(backends, "select", gpu_select)


def test_a_stage_runs_its_checks_on_the_device_it_trained_on(tmp_path, capsys, gpu_only_backend):
    """Stage 1 trained with fla on the GPU, then failed at its end: its final health check ran
    after Lightning had moved the model to the CPU, with the configured backend."""
    out = tmp_path / "run"
    rc = main(["pipeline", str(_spec(tmp_path, "fla")), "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (out / "transfer" / "done").exists() and (out / "transfer" / "stage.pt").exists()


@pytest.mark.parametrize("where", ["accelerator", "evaluate.device"])
def test_a_gpu_backend_on_the_cpu_is_refused_at_validation(tmp_path, capsys, where):
    """Named in the recipe: a stage's ``trainer.accelerator: cpu``, or a recall evaluation's
    ``device: cpu`` scoring a stage whose backend is GPU-only (it failed after training)."""
    spec = _spec(tmp_path, "fla", accelerator="cpu") if where == "accelerator" else \
        _spec(tmp_path, "fla", eval_device="cpu")
    rc = main(["pipeline", str(spec), "--output", str(tmp_path / "run"), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("hedgecats pipeline:"))
    assert "stages.transfer.fit.model.init_args.hybrid.backend='fla'" in line, line
    assert f"{where}='cpu'" in line and "'reference'" in line and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_a_gpu_backend_passes_validation_where_the_device_may_be_a_gpu(tmp_path, capsys):
    rc = main(["pipeline", str(_spec(tmp_path, "fla", eval_device="auto")), "--output",
               str(tmp_path / "run"), "--dry-run"])
    assert rc == 0, capsys.readouterr().err
