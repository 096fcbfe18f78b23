"""DownstreamEval under DDP on 2 CPU processes (gloo): rank 0 evaluates and logs once per
scheduled step, rank 1 waits, both train on in step (about 15 s on 2 cores). The file runs
itself as the worker script: Lightning's launcher starts rank 1 with the same command."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # two processes, ~25 s
HERE = Path(__file__).resolve()


def _worker(root: str) -> None:
    import lightning.pytorch as pl
    from hedgecats.lightning_modules import (
        DownstreamEval,
        RecallDataModule,
        RecallProbe,
        TeacherPretraining,
    )
    from lightning.pytorch.loggers import CSVLogger

    pl.seed_everything(0)
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    probe = RecallProbe(num_docs=4, seq_len=64, near_max=7, far_min=20, far_max=50, batch_size=4)
    cb = DownstreamEval([probe], every_n_steps=2)
    module = TeacherPretraining(hidden_size=32, num_layers=2, num_heads=2, warmup_steps=1,
                                max_position_embeddings=64, attention_pattern="SF",
                                sliding_window=8, output_gate="lowrank", gate_rank=4)
    dm = RecallDataModule(seq_len=64, window=8, far_min=20, far_max=50, num_train=32, num_val=4,
                          num_test=4, batch_size=4)
    tr = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=4,
                    default_root_dir=root, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
                    logger=CSVLogger(root, name="logs", version="v"), callbacks=[cb, Record()])
    tr.fit(module, datamodule=dm)
    Path(root, f"rank{tr.global_rank}.json").write_text(json.dumps(
        {"history": cb.history, "last_step": cb.last_step, "losses": losses}))


def test_ddp_rank_zero_evaluates_once_per_step(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(HERE), str(tmp_path)], env=env, timeout=300,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert [h["step"] for h in r0["history"]] == [2, 4] and r1["history"] == []
    assert r0["last_step"] == r1["last_step"] == 4  # both ranks walked the same schedule
    assert len(r0["losses"]) == len(r1["losses"]) == 4
    with (tmp_path / "logs" / "v" / "metrics.csv").open() as f:
        rows = list(csv.DictReader(f))
    evaluated = [int(r["step"]) for r in rows if r.get("downstream/recall/acc")]
    assert evaluated == [2, 4]
    assert any(r.get("train/loss") for r in rows)


if __name__ == "__main__":
    _worker(sys.argv[1])
