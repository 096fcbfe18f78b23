"""Two CPU processes (gloo): DDP resume is bit-exact per rank on uneven shards, stage 1 averages
its per-layer gradients across ranks, and both stages run under FSDP2 (ModelParallelStrategy),
stage 2 also with only its MLP blocks checkpointed.

About 20 s per case on 2 idle cores (the resume case, three runs, is marked slow). Each case
runs this file as a script in a subprocess: Lightning's launcher starts the second
rank by running the same command again.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed
HERE = Path(__file__).resolve()


def _worker(stage: str, strategy: str, base: str, root: str, steps: int, ckpt: str, out: str):
    import lightning.pytorch as pl
    from hedgecats.lightning_modules import (
        AttentionTransfer,
        HybridFinetune,
        RecallDataModule,
        ScheduledSlidingWindowDropout,
    )
    from hedgecats.models.structure import unwrap
    from lightning.pytorch.callbacks import ModelCheckpoint

    pl.seed_everything(0)
    callbacks = []
    if stage.startswith("finetune"):
        m = HybridFinetune(base, hybrid={"window": 8}, lr=1e-3,
                           activation_checkpointing="mlp" if stage == "finetune-mlp" else False)
        callbacks.append(ScheduledSlidingWindowDropout("dropout", window=[4, 8], interval="step",
                                                       interval_steps=1))
    else:
        m = AttentionTransfer(base, hybrid={"window": 8}, lr=1e-2)
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append([trainer.current_epoch, batch_idx, loss.item(),
                           int(batch["input_ids"].sum())])

    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        strat = "ddp"
    # 30 documents, 2 ranks, batch 4: 15 per rank -> batches of 4, 4, 4, 3
    dm = RecallDataModule(seq_len=48, window=8, far_min=16, far_max=40, num_train=30, num_val=4,
                          num_test=4, batch_size=4)
    tr = pl.Trainer(accelerator="cpu", devices=2, strategy=strat, max_steps=steps,
                    default_root_dir=root, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0,
                    callbacks=[*callbacks, Record(),
                               *([ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=True,
                                                  save_top_k=0, every_n_train_steps=1)]
                                 if strategy == "ddp" else [])])
    tr.fit(m, datamodule=dm, ckpt_path=None if ckpt == "none" else ckpt)
    params = {n: p.detach().float().sum().item()
              for n, p in unwrap(m.model).named_parameters() if p.requires_grad and
              not hasattr(p, "full_tensor")}
    Path(f"{out}.rank{tr.global_rank}.json").write_text(json.dumps(
        {"losses": losses, "params": params}))


def _run(tmp_path, *args) -> list[dict]:
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, str(HERE), *map(str, args), str(out)], check=True, env=env,
                   timeout=300, capture_output=True)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from fixtures.tiny import save_tiny_llama

    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny"))


@pytest.mark.slow  # three 2-process runs: about a minute on 2 idle cores
def test_ddp_resume_is_bit_exact_per_rank(base, tmp_path):
    full = _run(tmp_path, "finetune", "ddp", base, tmp_path / "full", 6, "none")
    assert full[0]["losses"] != full[1]["losses"]  # the ranks see different data
    _run(tmp_path, "finetune", "ddp", base, tmp_path / "part", 2, "none")
    last = tmp_path / "part" / "checkpoints" / "last.ckpt"
    rest = _run(tmp_path, "finetune", "ddp", base, tmp_path / "part", 6, last)
    for r in (0, 1):
        assert rest[r]["losses"] == full[r]["losses"][2:]  # same batches, bit-identical losses
    assert full[0]["params"] == full[1]["params"]  # replicas stay in sync


def test_ddp_attention_transfer_averages_gradients(base, tmp_path):
    res = _run(tmp_path, "transfer", "ddp", base, tmp_path / "t", 3, "none")
    assert res[0]["losses"] != res[1]["losses"]
    assert res[0]["params"] == res[1]["params"]  # feature maps identical on both ranks
    assert (tmp_path / "t" / "stage.pt").exists()


@pytest.mark.parametrize("stage", ["transfer", "finetune"])
def test_fsdp2_runs_each_stage(stage, base, tmp_path):
    res = _run(tmp_path, stage, "fsdp2", base, tmp_path / "f", 2, "none")
    for r in (0, 1):
        assert len(res[r]["losses"]) == 2
        assert all(torch.isfinite(torch.tensor(x[2])) for x in res[r]["losses"])
    from hedgecats.models.stage_files import read_stage

    payload = read_stage(tmp_path / "f" / "stage.pt")
    assert all(torch.isfinite(t).all() for t in payload["tensors"].values())


@pytest.mark.slow  # two 2-process runs (~30 s): `make test-all`; the default run keeps
# FSDP2's stages (test_fsdp2_runs_each_stage) and checkpointing's single-process tests
def test_fsdp2_finetune_with_mlp_checkpointing_matches_without(base, tmp_path):
    """activation_checkpointing="mlp" (each decoder layer's MLP class swapped for a checkpointed
    subclass before fully_shard swaps the layer's) under FSDP2 on two ranks: the same losses and
    trained tensors as without checkpointing."""
    plain = _run(tmp_path, "finetune", "fsdp2", base, tmp_path / "p", 2, "none")
    mlp = _run(tmp_path, "finetune-mlp", "fsdp2", base, tmp_path / "m", 2, "none")
    for r in (0, 1):
        assert [x[2] for x in mlp[r]["losses"]] == pytest.approx(
            [x[2] for x in plain[r]["losses"]], rel=1e-5)
    from hedgecats.models.stage_files import read_stage

    a, b = (read_stage(tmp_path / d / "stage.pt")["tensors"] for d in ("p", "m"))
    assert a.keys() == b.keys() and a
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    a = sys.argv[1:]
    _worker(a[0], a[1], a[2], a[3], int(a[4]), a[5], a[6])
