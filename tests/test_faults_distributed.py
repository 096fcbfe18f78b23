"""The fault suite on two CPU processes (gloo DDP, Lightning's launcher starts the second rank
by running the same command again): SIGTERM to the job stops every rank at the same batch
boundary, one checkpoint is saved for all, every rank exits with 143, and the same command
resumes on both ranks."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
from test_faults import (
    _pipeline_process,
    _wait_for,
    add_callback,
    ckpt_step,
    copy_run,
    finished,  # noqa: F401  (the fixture)
    make_spec,
)

# two 2-process pipeline runs: about 100 s on 2 busy cores
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _ddp(cls: str, **init_args):
    def edit(fit):
        fit["trainer"].update(accelerator="cpu", devices=2, strategy="ddp")
        add_callback(cls, **init_args)(fit)
    return edit


def test_sigterm_on_two_ranks_saves_once_and_every_rank_exits(tmp_path, finished):  # noqa: F811
    out = copy_run(finished, tmp_path / "run", ("teacher", "transfer"))
    ready = tmp_path / "ready"
    cfg = make_spec(tmp_path / "p.yaml", stages={"finetune": _ddp(
        "WaitAtStep", step=2, ready=str(ready))})
    proc = _pipeline_process(cfg, out)
    try:
        _wait_for(ready, proc)
        proc.send_signal(signal.SIGTERM)  # as a scheduler does; Lightning forwards it
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("hedgecats pipeline:")]
    assert lines and all("interrupted by SIGTERM during stage 'finetune'" in x for x in lines)
    assert any("saved" in x for x in lines) and "Traceback" not in err
    last = out / "finetune" / "checkpoints" / "last.ckpt"
    state = torch.load(last, weights_only=False)
    assert state["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())
    assert not (out / "pipeline.lock").exists() and not list(out.rglob(".*.tmp-*"))
    # the same command resumes on both ranks and finishes
    proc = _pipeline_process(cfg, out)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert ckpt_step(last) == 4 and (out / "finetune" / "done").exists()
    assert Path(out / "finetune" / "stage.pt").exists()


def _fsdp2_worker(base: str, root: str) -> None:
    """Two ranks, FSDP2 (our ModelParallelStrategy), a sharded checkpoint every step."""
    import lightning.pytorch as pl
    from hedgecats.lightning_modules import AttentionTransfer, RecallDataModule
    from hedgecats.lightning_modules.strategies import ModelParallelStrategy
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    dm = RecallDataModule(seq_len=48, window=8, far_min=16, far_max=40, num_train=30, num_val=4,
                          num_test=4, batch_size=4)
    tr = pl.Trainer(accelerator="cpu", devices=2, max_steps=3, default_root_dir=root,
                    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                    logger=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0,
                    callbacks=[ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=True,
                                               save_top_k=0, every_n_train_steps=1)])
    tr.fit(AttentionTransfer(base, hybrid={"window": 8}), datamodule=dm)


def test_sharded_checkpoints_are_written_whole_with_a_previous_one(tmp_path):
    import os
    import subprocess
    import sys

    from hedgecats.lightning_modules.guard import read_checkpoint_record
    from fixtures.tiny import save_tiny_llama

    base = save_tiny_llama(tmp_path / "base")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, __file__, str(base), str(tmp_path / "run")], check=True,
                   env=env, timeout=300, capture_output=True)
    ck = tmp_path / "run" / "checkpoints"
    assert read_checkpoint_record(ck / "last.ckpt")["global_step"] == 3
    assert read_checkpoint_record(ck / "previous.ckpt")["global_step"] == 2
    assert (ck / "last.ckpt").is_dir() and not list(ck.glob(".*tmp*"))


if __name__ == "__main__":
    import sys

    _fsdp2_worker(sys.argv[1], sys.argv[2])
