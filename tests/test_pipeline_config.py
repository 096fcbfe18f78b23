"""Pipeline configs and the command line (issue 14 item 3 and 4): --set overrides for every
stage or one, typed hybrid / lora, short class names, --version, the step progress bar, the
loggers, and plain `fit` resumes that keep earlier metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from hedgecats.cli import load_pipeline, main
from hedgecats.pipeline.errors import ConfigError
from hedgecats.pipeline.spec import parse_overrides

TINY = Path(__file__).resolve().parents[1] / "configs" / "pipelines" / "tiny.yaml"


def test_set_overrides_every_stage_or_one(tmp_path):
    spec = load_pipeline(TINY, tmp_path / "out", overrides=parse_overrides([
        "stages.*.fit.trainer.max_steps=5",
        "stages.transfer.fit.model.init_args.lr=3e-3",
        "stages.finetune.fit.model.init_args.hybrid={window: 8}",
        "checkpoint_every_n_steps=10",
        "evaluate.batch_size=8",
        "stages.finetune.fit.trainer.callbacks=[{class_path: ScheduledSlidingWindowDropout}]",
    ]))
    steps = {st["name"]: st["fit"]["trainer"]["max_steps"] for st in spec["stages"]}
    assert steps == {"teacher": 5, "transfer": 5, "finetune": 5}
    fits = {st["name"]: st["fit"] for st in spec["stages"]}
    assert fits["transfer"]["model"]["init_args"]["lr"] == 3e-3
    assert fits["finetune"]["model"]["init_args"]["lr"] == 1e-3  # untouched
    assert fits["finetune"]["model"]["init_args"]["hybrid"] == {"window": 8}
    assert fits["transfer"]["model"]["init_args"]["hybrid"]["window"] == 16  # anchors not shared
    assert spec["checkpoint_every_n_steps"] == 10 and spec["evaluate"]["batch_size"] == 8
    assert fits["finetune"]["trainer"]["callbacks"][0]["class_path"] == \
        "ScheduledSlidingWindowDropout"


@pytest.mark.parametrize("override,message", [
    ("stages.tranfer.fit.trainer.max_steps=5", "has no stage 'tranfer'; stages: teacher"),
    ("stage.transfer.fit.trainer.max_steps=5", "'stage' is not a pipeline key"),
    ("stages.transfer.trainer.max_steps=5", "a stage's settable keys are fit, description"),
    ("stages.transfer=5", "name a stage and a key inside it"),
    ("max_steps", "--set takes PATH=VALUE"),
])
def test_bad_overrides_are_named(tmp_path, override, message):
    with pytest.raises(ConfigError, match="") as e:
        load_pipeline(TINY, tmp_path / "out", overrides=parse_overrides([override]))
    assert message in str(e.value)


def test_dry_run_validates_in_seconds_with_overrides(tmp_path, capsys):
    import time

    t0 = time.time()
    assert main(["pipeline", str(TINY), "--output", str(tmp_path / "out"), "--dry-run",
                 "--set", "stages.*.fit.trainer.max_steps=7"]) == 0
    assert time.time() - t0 < 90  # seconds (no model loaded); room for a slow CI machine
    out = capsys.readouterr().out
    assert out.count("max_steps=7") == 3 and "the pipeline is valid" in out
    assert not (tmp_path / "out").exists()


def test_version_and_usage(capsys):
    from hedgecats import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hedgecats {__version__}"
    assert main([]) == 0
    assert "--set PATH=VALUE" in capsys.readouterr().out


def test_fit_takes_short_class_names_and_help_lists_the_typed_fields(capsys):
    for flags, expect in ((["--model.help", "HybridFinetune"], "--model.lora.help"),
                          (["--model.help", "HybridFinetune", "--model.hybrid.help"],
                           "--model.hybrid.window WINDOW"),
                          (["--model.help", "HybridFinetune", "--model.lora.help"],
                           "--model.lora.target_modules")):
        with pytest.raises(SystemExit) as e:
            main(["fit", *flags])
        assert e.value.code == 0
        assert expect in capsys.readouterr().out


def test_typed_hybrid_and_lora_are_validated_and_recorded_as_mappings(tmp_path):
    from hedgecats.lightning_modules import AttentionTransfer, HybridFinetune
    from hedgecats.models import HybridConfig
    from hedgecats.models.lora import LoraSettings

    m = HybridFinetune("x", hybrid=HybridConfig(window=4), lora=LoraSettings(r=4))
    assert m.hparams["hybrid"]["window"] == 4 and m.hparams["lora"]["r"] == 4
    assert m.lora == {"r": 4, "lora_alpha": 16, "lora_dropout": 0.0,
                      "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    m = HybridFinetune("x", hybrid={"window": 4}, lora={"r": 2, "layers_to_transform": [0]})
    assert m.lora["layers_to_transform"] == [0]  # other peft arguments pass through
    with pytest.raises(ValueError, match="LoraSettings.r=0 must be an integer >= 1"):
        HybridFinetune("x", lora={"r": 0})
    with pytest.raises(ValueError, match="unknown HybridConfig fields"):
        AttentionTransfer("x", hybrid={"windw": 3})
    with pytest.raises(ValueError, match="lr=-1 must be a finite number > 0"):
        AttentionTransfer("x", lr=-1)
    # stage 1 has no activations to checkpoint; the argument stays for saved configs
    with pytest.raises(ValueError, match=r"activation_checkpointing=True\) is not supported.*"
                                         r"HybridFinetune"):
        AttentionTransfer("x", activation_checkpointing=True)
    assert AttentionTransfer("x", activation_checkpointing=False).hparams[
        "activation_checkpointing"] is False


def test_step_progress_bar_counts_steps_not_epochs(tmp_path):
    import lightning.pytorch as pl
    import torch
    from hedgecats.lightning_modules import StepProgressBar

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def training_step(self, batch, batch_idx):
            return (self.w * batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen = {}

    class Look(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            bar = next(c for c in trainer.callbacks if isinstance(c, StepProgressBar))
            seen.update(desc=bar.train_progress_bar.desc, total=bar.train_progress_bar.total,
                        n=bar.train_progress_bar.n)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 1)),
                                       batch_size=1)
    tr = pl.Trainer(max_steps=6, callbacks=[StepProgressBar(), Look()], logger=False,
                    enable_checkpointing=False, default_root_dir=tmp_path,
                    enable_model_summary=False)
    tr.fit(Tiny(), data)
    assert seen["total"] == 6 and seen["n"] == 6 and seen["desc"].startswith("epoch 2")
    assert "-" not in seen["desc"]


def test_loggers_csv_by_default_and_extras_named(tmp_path, capsys):
    from hedgecats.pipeline.runner import stage_config

    spec = load_pipeline(TINY, tmp_path / "out")
    st = spec["stages"][1]
    cfg = stage_config(spec, st, tmp_path / "out" / st["name"], attempt=2)
    (log,) = cfg["trainer"]["logger"]
    assert log["class_path"].endswith("CSVLogger") and log["init_args"]["version"] == "attempt_2"
    spec["loggers"] = ["csv", "tensorboard", {"wandb": {"project": "p", "mode": "offline"}}]
    spec["run_id"] = "abcd"
    cfg = stage_config(spec, st, tmp_path / "out" / st["name"], attempt=0)
    names = [x["class_path"].rsplit(".", 1)[1] for x in cfg["trainer"]["logger"]]
    assert names == ["CSVLogger", "TensorBoardLogger", "WandbLogger"]
    wandb = cfg["trainer"]["logger"][2]["init_args"]
    assert wandb["id"] == "abcd-transfer" and wandb["resume"] == "allow" and wandb["project"] == "p"
    import importlib.util

    for name, module in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if importlib.util.find_spec(module):
            continue
        rc = main(["pipeline", str(TINY), "--output", str(tmp_path / "o"), "--dry-run",
                   "--loggers", f"csv,{name}"])
        err = capsys.readouterr().err
        assert rc == 2 and f"pip install 'hedgecats[{name}]'" in err


def test_plain_fit_resume_keeps_the_earlier_metrics(tmp_path):
    from fixtures.tiny import save_tiny_llama

    base = save_tiny_llama(tmp_path / "base")
    cfg = {
        "seed_everything": 0,
        "model": {"class_path": "AttentionTransfer",  # a short class name
                  "init_args": {"model_name_or_path": str(base), "hybrid": {"window": 8}}},
        "data": {"class_path": "RecallDataModule",
                 "init_args": {"seq_len": 48, "window": 8, "far_min": 16, "far_max": 40,
                               "num_train": 16, "num_val": 4, "batch_size": 4}},
        "trainer": {"max_steps": 2, "default_root_dir": str(tmp_path / "run"),
                    "log_every_n_steps": 1, "enable_progress_bar": False,
                    "limit_val_batches": 1,
                    "callbacks": [{"class_path": "ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / "run" / "ck"),
                                                 "save_last": True}}]},
    }
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(tmp_path / "fit.yaml")]) == 0
    first = tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv"
    text = first.read_text()
    assert main(["fit", "--config", str(tmp_path / "fit.yaml"), "--trainer.max_steps", "3",
                 "--ckpt_path", str(tmp_path / "run" / "ck" / "last.ckpt")]) == 0
    assert first.read_text() == text  # the first attempt's metrics are untouched
    assert (tmp_path / "run" / "lightning_logs" / "version_1" / "metrics.csv").exists()
    assert json.loads(json.dumps(text.splitlines()[0].split(",")))  # a CSV header


@pytest.mark.parametrize("value,ok", [("mlp", True), ("true", True), ("attention", False)])
def test_finetune_activation_checkpointing_through_the_pipeline_yaml(tmp_path, capsys, value, ok):
    """``activation_checkpointing: mlp`` (or true) as a recipe sets it passes the pipeline's
    validation; an unknown value is named with the valid ones before anything runs."""
    rc = main(["pipeline", str(TINY), "--output", str(tmp_path / "out"), "--dry-run", "--set",
               f"stages.finetune.fit.model.init_args.activation_checkpointing={value}"])
    captured = capsys.readouterr()
    if ok:
        assert rc == 0 and "the pipeline is valid" in captured.out
    else:
        assert rc != 0
        assert "activation_checkpointing='attention' is not valid" in captured.err + captured.out
        assert "'mlp'" in captured.err + captured.out
