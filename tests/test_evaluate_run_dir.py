"""``hedgecats evaluate --model RUNDIR``: a pipeline run directory is evaluated as ``hedgecats
export`` takes it (its final stage), and a run whose last stage did not finish is refused
naming that stage (issue 50)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fixtures.eval.support import save_tiny_model, write_tasks
from hedgecats.evaluation import cli
from hedgecats.models import HybridConfig, convert_to_hybrid


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory as the pipeline leaves it: transfer, then finetune (from transfer), each
    with its ``done``; a stage of another seed makes the two stages' models differ."""
    from hedgecats.models.stage_files import save_stage
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("eval_run")
    base = save_tiny_model(root / "teacher" / "model")
    write_tasks(root / "tasks", n_docs=4)
    run = root / "run"
    (run).mkdir()
    (run / "hedgecats-run.json").write_text(json.dumps({"pipeline": "tiny"}))
    init_from = None
    for name, seed in (("transfer", 1), ("finetune", 2)):
        cfg = HybridConfig(window=8, seed=seed)
        model = convert_to_hybrid(AutoModelForCausalLM.from_pretrained(base), cfg)
        init_from = str(save_stage(run / name / "stage.pt", model, base_model=str(base),
                                   hybrid_config=cfg, stage="AttentionTransfer",
                                   meta={"global_step": 3, "init_from": init_from}))
        (run / name / "checkpoints").mkdir()
        (run / name / "done").write_text("{}")
    return run


def _argv(run: Path, out: Path) -> list[str]:
    tasks = run.parent / "tasks" / "toy_acc.yaml"
    return ["--model", str(run), "--tasks", str(tasks), "--modes", "hybrid",
            "--bootstrap-iters", "10", "-q", "--output", str(out)]


def test_a_run_directory_is_evaluated_at_its_final_stage(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(_argv(run_dir, out)) == 0, capsys.readouterr().err
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["model"] == str(run_dir / "finetune" / "stage.pt")
    assert meta["model_source"] == "stage_checkpoint"


def test_a_run_with_an_unfinished_stage_is_refused_naming_it(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "finetune" / "stage.pt").unlink()  # interrupted: a checkpoint, no stage.pt, no done
    (run / "finetune" / "done").unlink()
    (run / "finetune" / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    out = tmp_path / "out"
    assert cli.main(_argv(run, out)) == 2
    err = capsys.readouterr().err
    assert "stage 'finetune' did not finish" in err and str(run / "transfer") in err, err
    assert "hedgecats evaluate" in err and not out.exists()
