"""Resuming a stage with ckpt_path=last continues the per-step loss bit-exactly (CPU, one
process), including across an epoch boundary and after SIGTERM."""

import os
import signal

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import (
    AttentionTransfer,
    CheckpointOnInterrupt,
    HybridFinetune,
    RecallDataModule,
    ScheduledSlidingWindowDropout,
)
from fixtures.tiny import save_tiny_llama
from lightning.pytorch.callbacks import ModelCheckpoint

HYB = {"window": 8}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny"))


class Record(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append((trainer.current_epoch, batch_idx, loss.detach().clone()))


class Sigterm(pl.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def _run(stage, base, root, steps, ckpt_path=None, extra=()):
    pl.seed_everything(0)  # SSD draws from the global RNG (a resumed run restores its state)
    if stage == "finetune":  # SSD drops use the RNG: resume must restore it too
        m = HybridFinetune(base, hybrid=HYB, lr=1e-3)
        callbacks = [ScheduledSlidingWindowDropout("dropout", window=[4, 8], interval="step",
                                                   interval_steps=3)]
    else:
        m = AttentionTransfer(base, hybrid=HYB, lr=1e-2)
        callbacks = []
    rec = Record()
    dm = RecallDataModule(seq_len=48, window=8, far_min=16, far_max=40, num_train=22,
                          num_val=4, num_test=4, batch_size=4)  # 6 batches, the last short
    ck = root / "checkpoints"
    tr = pl.Trainer(max_steps=steps, default_root_dir=str(root), logger=False,
                    enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                    callbacks=[*callbacks, rec, *extra,
                               ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=0,
                                               every_n_train_steps=2),
                               CheckpointOnInterrupt(str(ck))])
    tr.fit(m, datamodule=dm, ckpt_path=ckpt_path)
    return rec.losses


@pytest.mark.parametrize("stage", ["finetune", "transfer"])
def test_resume_continues_the_loss_bit_exactly(stage, base, tmp_path):
    full = _run(stage, base, tmp_path / "full", steps=10)
    first = _run(stage, base, tmp_path / "part", steps=4)  # last.ckpt at step 4, mid-epoch
    assert [x[:2] for x in first] == [x[:2] for x in full[:4]]
    rest = _run(stage, base, tmp_path / "part", steps=10,
                ckpt_path=str(tmp_path / "part" / "checkpoints" / "last.ckpt"))
    assert [x[:2] for x in rest] == [x[:2] for x in full[4:]]  # no batch replayed or skipped
    for (_, _, a), (_, _, b) in zip(rest, full[4:]):
        assert torch.equal(a, b)


def test_sigterm_leaves_a_checkpoint_that_resumes(base, tmp_path):
    full = _run("finetune", base, tmp_path / "full", steps=9)
    with pytest.raises(SystemExit):
        _run("finetune", base, tmp_path / "part", steps=9, extra=[Sigterm(at_step=5)])
    last = tmp_path / "part" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 5
    rest = _run("finetune", base, tmp_path / "part", steps=9, ckpt_path=str(last))
    assert [x[:2] for x in rest] == [x[:2] for x in full[5:]]
    for (_, _, a), (_, _, b) in zip(rest, full[5:]):
        assert torch.equal(a, b)
