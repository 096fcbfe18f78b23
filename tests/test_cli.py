"""The hedgecats command: dispatch, fit through LightningCLI, errors."""

import yaml
from hedgecats.cli import main
from hedgecats.lightning_modules.tiny import save_tiny_llama


def test_usage_and_unknown_command(capsys):
    assert main([]) == 0
    assert "hedgecats pipeline" in capsys.readouterr().out
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err


def test_evaluate_dispatches_to_the_evaluation_cli(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:  # argparse of hedgecats.evaluation.cli: --help
        main(["evaluate", "--help"])
    assert e.value.code == 0
    assert "hedgecats evaluate" in capsys.readouterr().out


def test_fit_with_a_stage_config(tmp_path):
    base = save_tiny_llama(tmp_path / "base")
    cfg = {
        "seed_everything": 0,
        "model": {"class_path": "hedgecats.lightning_modules.AttentionTransfer",
                  "init_args": {"model_name_or_path": str(base), "hybrid": {"window": 8}}},
        "data": {"class_path": "hedgecats.lightning_modules.RecallDataModule",
                 "init_args": {"seq_len": 48, "window": 8, "far_min": 16, "far_max": 40,
                               "num_train": 16, "num_val": 4, "batch_size": 4}},
        "trainer": {"max_steps": 2, "default_root_dir": str(tmp_path / "run"), "logger": False,
                    "enable_progress_bar": False, "limit_val_batches": 1},
    }
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(tmp_path / "fit.yaml")]) == 0
    assert (tmp_path / "run" / "stage.pt").exists()
