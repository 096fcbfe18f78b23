"""The hedgecats command: dispatch, fit through LightningCLI, errors."""

import yaml
from hedgecats.cli import main
from fixtures.tiny import save_tiny_llama


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


def _two_stage_pipeline(tmp_path, base, extra=None):
    data = {"class_path": "hedgecats.lightning_modules.RecallDataModule",
            "init_args": {"seq_len": 48, "window": 8, "far_min": 16, "far_max": 40,
                          "num_train": 16, "num_val": 4, "num_test": 4, "batch_size": 4}}
    trainer = {"max_steps": 1, "logger": False, "enable_progress_bar": False,
               "limit_val_batches": 1, "num_sanity_val_steps": 0}
    spec = {"name": "p", "vars": {"base": str(base), "steps": 1}, "stages": [
        {"name": "transfer", "fit": {
            "model": {"class_path": "hedgecats.lightning_modules.AttentionTransfer",
                      "init_args": {"model_name_or_path": "${vars.base}",
                                    "hybrid": {"window": 8}}},
            "data": data, "trainer": {**trainer, "max_steps": "${vars.steps}"}}}]}
    spec.update(extra or {})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_pipeline_references_keep_their_types_and_vars_override(tmp_path):
    from hedgecats.cli import load_pipeline

    path = _two_stage_pipeline(tmp_path, "/models/base")
    spec = load_pipeline(path, tmp_path / "out", variables={"steps": 7})
    fit = spec["stages"][0]["fit"]
    assert fit["trainer"]["max_steps"] == 7  # an int, not "7"
    assert fit["model"]["init_args"]["model_name_or_path"] == "/models/base"
    assert fit["seed_everything"] == 0 and spec["seed"] == 0
    spec = load_pipeline(path, tmp_path / "out", seed=5)
    assert spec["stages"][0]["fit"]["seed_everything"] == 5 and spec["seed"] == 5
    import pytest

    with pytest.raises(ValueError, match=r"--var \['nope'\] not declared"):
        load_pipeline(path, tmp_path / "out", variables={"nope": 1})
    bad = _two_stage_pipeline(tmp_path, "${vars.missing}")
    with pytest.raises(ValueError, match=r"\$\{vars.missing\} names no var; defined: \['base', 'steps'\]"):
        load_pipeline(bad, tmp_path / "out")


def test_seed_reaches_the_feature_maps_of_stage_1(tmp_path):
    """--seed N is every stage's seed_everything, and a hybrid without its own seed takes it:
    two seeds of a recipe no longer share their stage 1."""
    import torch
    from hedgecats.models.stage_files import read_stage

    base = save_tiny_llama(tmp_path / "base")
    path = _two_stage_pipeline(tmp_path, base)
    phi = {}
    for seed in (0, 1):
        out = tmp_path / f"s{seed}"
        assert main(["pipeline", str(path), "--output", str(out), "--seed", str(seed),
                     "--var", "steps=1"]) == 0
        payload = read_stage(out / "transfer" / "stage.pt")
        assert payload["hybrid_config"]["seed"] == seed
        phi[seed] = payload["tensors"]["model.layers.0.self_attn.phi_q.weight"]
    assert not torch.allclose(phi[0], phi[1])
