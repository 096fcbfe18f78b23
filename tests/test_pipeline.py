"""The embedded default, shortened: teacher -> transfer -> finetune -> evaluation table, then a
re-run that skips finished stages and resumes an interrupted one."""

import json
import os
import signal
from pathlib import Path

import lightning.pytorch as pl
import torch
import yaml
from hedgecats.cli import main

TINY = Path(__file__).resolve().parents[1] / "configs" / "pipelines" / "tiny.yaml"


class SigtermAtStep(pl.Callback):
    """Test helper: send SIGTERM to this process after ``step`` optimiser steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def short_tiny(path: Path, sigterm_finetune_at: int | None = None) -> Path:
    """tiny.yaml with a smaller teacher and a few steps per stage."""
    spec = yaml.safe_load(TINY.read_text())
    data = {"seq_len": 64, "window": 8, "far_min": 20, "far_max": 50, "facts_per_doc": 4,
            "num_train": 64, "num_val": 4, "num_test": 8, "batch_size": 4, "seed": 0}
    for st, steps in zip(spec["stages"], (6, 3, 4)):
        st["fit"]["data"]["init_args"] = data
        st["fit"]["trainer"].update(max_steps=steps, val_check_interval=steps,
                                    enable_progress_bar=False)
        if st["name"] == "teacher":
            st["fit"]["model"]["init_args"].update(hidden_size=32, num_layers=2, num_heads=2,
                                                   warmup_steps=2)
        else:
            st["fit"]["model"]["init_args"]["hybrid"] = {"window": 8}
    if sigterm_finetune_at is not None:
        spec["stages"][2]["fit"]["trainer"]["callbacks"] = [
            {"class_path": "test_pipeline.SigtermAtStep", "init_args": {"step": sigterm_finetune_at}}]
    spec["checkpoint_every_n_steps"] = 1
    spec["evaluate"]["data"]["init_args"] = data
    path.write_text(yaml.safe_dump(spec))
    return path


def test_tiny_pipeline_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = short_tiny(tmp_path / "tiny.yaml", sigterm_finetune_at=2)
    # SIGTERM during the finetune stage: a checkpoint, one line, exit status 128 + 15
    assert main(["pipeline", str(cfg), "--output", str(out)]) == 143
    err = capsys.readouterr().err
    assert "interrupted by SIGTERM during stage 'finetune'" in err and "resume with:" in err
    assert (out / "teacher" / "done").exists() and (out / "transfer" / "done").exists()
    assert not (out / "finetune" / "done").exists()
    last = out / "finetune" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 2
    for name in ("teacher", "transfer"):
        assert (out / name / "config.yaml").exists()
        assert (out / name / "logs" / "attempt_0" / "metrics.csv").exists()
    assert (out / "transfer" / "stage.pt").exists() and (out / "teacher" / "model").is_dir()

    # the same pipeline: finished stages verified and skipped, the interrupted one resumes
    # (the SIGTERM callback stays in the config: it fired at step 2 and does not fire again)
    assert main(["pipeline", str(cfg), "--output", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "done (skipped)" in text and "resume from checkpoints/last.ckpt (step 2)" in text
    assert "differs" not in text and "warning" not in text
    assert not (out / "results.json").exists()
    # without the callback the finetune config differs from the one that wrote the checkpoint
    plain = short_tiny(tmp_path / "plain.yaml")
    assert main(["pipeline", str(plain), "--output", str(out), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "stage 'finetune'" in err and "trainer.callbacks" in err and "SigtermAtStep" in err
    assert "'teacher'" not in err

    assert main(["pipeline", str(cfg), "--output", str(out)]) == 0
    text = capsys.readouterr().out
    assert "teacher: done, skipped" in text and "transfer: done, skipped" in text
    assert torch.load(last, weights_only=False)["global_step"] == 4  # resumed, not restarted
    results = json.loads((out / "results.json").read_text())
    rows = results["results"]
    assert {"teacher", "softmax", "hybrid", "swa_only", "la_only", "sinks_only", "none",
            "la_only (la_span_all)", "swa_only (rescale)", "la_only (rescale)"} == set(rows)
    for r in rows.values():
        assert set(r) >= {"lm_loss", "near_loss", "near_acc", "far_loss", "far_acc"}
        assert r["n_near"] > 0 and r["n_far"] > 0 and 0 <= r["far_acc"] <= 1
    assert rows["none"]["lm_loss"] != rows["hybrid"]["lm_loss"]
    assert "far_acc" in text and "swa_only" in text and str(out) in text.replace("\n", "")
    assert (out / "finetune" / "done").exists()
    assert (out / "finetune" / "logs" / "attempt_1" / "metrics.csv").exists()  # kept apart
