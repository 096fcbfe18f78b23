"""Exact resume of the data stream: N steps == N/2 steps + resume, batch by batch (issue 4.4).

A tiny LightningModule records a hash of every batch it trains on. Runs are chained through
`ckpt_path="last"` and must see exactly the batches of one uninterrupted run: mid-epoch, at an
epoch's end, across an epoch boundary, with 0 and 2 workers, with shuffling and gradient
accumulation, and in 2-process DDP (gloo, CPU) on uneven shards.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import socket
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.data import (
    FineWebEduDataModule,
    byte_level_tokenizer,
    filler_documents,
    write_fineweb_files,
)
from lightning.pytorch.callbacks import ModelCheckpoint

SEQ_LEN = 32
GLOBAL_BATCH = 4
MICRO_BATCH = 2  # accumulate 2 (single process) or 1 (2 ranks)
STEPS_PER_EPOCH = 5


def batch_hash(input_ids: torch.Tensor) -> str:
    return hashlib.sha1(input_ids.cpu().numpy().tobytes()).hexdigest()[:12]


class HashingModule(pl.LightningModule):
    """Trains one scalar; remembers the hash of each batch given to training_step."""

    def __init__(self, call_estimated_stepping_batches: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[str] = []
        self.call_estimated = call_estimated_stepping_batches

    def training_step(self, batch, batch_idx):
        assert batch["input_ids"].shape == (MICRO_BATCH, SEQ_LEN)
        self.seen.append(batch_hash(batch["input_ids"]))
        return (self.w - batch["input_ids"].float().mean() / 256) ** 2

    def validation_step(self, batch, batch_idx):
        self.log(
            "val/loss", (self.w - batch["input_ids"].float().mean() / 256) ** 2, sync_dist=True
        )

    def configure_optimizers(self):
        if (
            self.call_estimated
        ):  # the trap of Lightning issue 20550: builds the loader before restore
            assert self.trainer.estimated_stepping_batches > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_datamodule(data_dir: Path, num_workers: int, val_tokens: int = 0) -> FineWebEduDataModule:
    return FineWebEduDataModule(
        byte_level_tokenizer(),
        data_files=str(data_dir),
        seq_len=SEQ_LEN,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        tokens_per_epoch=STEPS_PER_EPOCH * GLOBAL_BATCH * SEQ_LEN,
        val_tokens=val_tokens,
        num_workers=num_workers,
        shuffle_buffer=6,
        seed=3,
    )


def fit(
    data_dir,
    ckpt_dir,
    max_steps,
    *,
    num_workers=0,
    resume=False,
    val_tokens=0,
    trainer_kwargs=None,
    **module_kwargs,
):
    module = HashingModule(**module_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        max_epochs=-1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0)
        ],
        **(trainer_kwargs or {}),
    )
    dm = make_datamodule(data_dir, num_workers, val_tokens=val_tokens)
    trainer.fit(module, datamodule=dm, ckpt_path="last" if resume else None)
    return module.seen, trainer


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume-data")
    write_fineweb_files(filler_documents(160, 40, 300, seed=11), out, n_files=2)
    return out


@pytest.mark.parametrize("num_workers", [0, 2], ids=["workers0", "workers2"])
def test_resume_chain_matches_one_run(data_dir, tmp_path, num_workers):
    """7 steps at once == 3 + resume to 6 (crosses the epoch end at 5) + resume to 7."""
    full, trainer = fit(data_dir, tmp_path / "a", 7, num_workers=num_workers)
    assert trainer.accumulate_grad_batches == 2  # derived: 4 global / (1 device x 2 micro)
    assert len(full) == 14
    first, _ = fit(data_dir, tmp_path / "b", 3, num_workers=num_workers)
    second, _ = fit(data_dir, tmp_path / "b", 6, num_workers=num_workers, resume=True)
    third, _ = fit(data_dir, tmp_path / "b", 7, num_workers=num_workers, resume=True)
    assert first == full[:6]
    assert second == full[6:12]
    assert third == full[12:]


def test_resume_at_epoch_end_and_estimated_stepping_batches_trap(data_dir, tmp_path):
    """A checkpoint at the last batch of an epoch resumes at the next epoch's first batch, even
    when configure_optimizers calls trainer.estimated_stepping_batches (loader built before the
    restore)."""
    full, _ = fit(data_dir, tmp_path / "a", 7)
    first, _ = fit(data_dir, tmp_path / "b", STEPS_PER_EPOCH, call_estimated_stepping_batches=True)
    rest, _ = fit(data_dir, tmp_path / "b", 7, resume=True, call_estimated_stepping_batches=True)
    assert first + rest == full
    assert full[:10] != full[10:14] + full[:6]  # epoch 1 is reshuffled, not a replay of epoch 0


def test_checkpoint_holds_every_rank_state_and_loads_weights_only(data_dir, tmp_path):
    fit(data_dir, tmp_path, 2)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)  # only plain types and tensors
    state = ckpt["FineWebEduDataModule"]
    assert state["world_size"] == 1 and len(state["loader_states"]) == 1
    loader_state = state["loader_states"][0]
    assert (
        loader_state["consumed"] == 4
        and loader_state["epoch"] == 0
        and not loader_state["complete"]
    )


def test_resume_with_validation_in_the_run(data_dir, tmp_path):
    """Validation (its own loader, the stream's head) does not disturb the training stream."""

    def run(ckpt, steps, resume=False):
        return fit(
            data_dir,
            ckpt,
            steps,
            resume=resume,
            val_tokens=SEQ_LEN * MICRO_BATCH * 2,
            trainer_kwargs={"val_check_interval": 4},
        )[0]

    full = run(tmp_path / "a", 6)
    assert run(tmp_path / "b", 2) + run(tmp_path / "b", 6, resume=True) == full


def test_late_state_applies_before_first_batch(data_dir):
    """The FSDP2 order: iter() first, state later, then the first batch -> still exact."""
    dm = make_datamodule(data_dir, 0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    seen = [batch_hash(next(it)["input_ids"]) for _ in range(3)]
    state = loader.state_at(3)
    seen += [batch_hash(next(it)["input_ids"]) for _ in range(4)]
    fresh = dm.train_dataloader()
    lazy = iter(fresh)  # what estimated_stepping_batches / setup_data do
    fresh.resume_from(state)
    assert [batch_hash(next(lazy)["input_ids"]) for _ in range(4)] == seen[3:7]
    with pytest.raises(RuntimeError, match="already handed out"):
        fresh.resume_from(state)


@pytest.mark.parametrize("mode", ["pack", "truncate"])
def test_state_behind_the_last_fetched_batch_and_at_an_epoch_start(data_dir, mode):
    """A loop that fetched ahead asks for the state after fewer batches than were fetched; a
    state taken after iter() of the next epoch, before its first batch, starts that epoch."""
    dm = make_datamodule(data_dir, 0)
    dm.mode = mode
    dm.setup("fit")
    loader = dm.train_dataloader()
    it = iter(loader)
    seen = [batch_hash(next(it)["input_ids"]) for _ in range(5)]
    behind = loader.state_at(4)  # the batch at index 4 was fetched but not trained on
    seen += [batch_hash(b["input_ids"]) for b in it]
    resumed = dm.train_dataloader()
    resumed.resume_from(behind)
    assert [batch_hash(b["input_ids"]) for b in resumed] == seen[4:]
    next_epoch = iter(loader)
    start = loader.state_at(0)
    assert (start["epoch"], start["consumed"], start["loader"]) == (1, 0, None)
    epoch1 = [batch_hash(b["input_ids"]) for b in next_epoch]
    fresh = dm.train_dataloader()
    fresh.resume_from(start)
    assert [batch_hash(b["input_ids"]) for b in fresh] == epoch1 != seen


# --- 2-process DDP ------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(data_dir: str, out_dir: str, rank: int, env: dict) -> None:
    """One rank (a forked child of the test process, so nothing is imported again): a full run,
    a run of 3 steps, and a run resumed from its checkpoint."""
    os.environ.update({**env, "LOCAL_RANK": str(rank), "RANK": str(rank)})
    torch.set_num_threads(1)
    results = {}
    for name, steps, resume in (("full", 8, False), ("first", 3, False), ("rest", 8, True)):
        ckpt_dir = Path(out_dir) / ("a" if name == "full" else "b")
        module = HashingModule()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_steps=steps,
            max_epochs=-1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[
                ModelCheckpoint(
                    dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=0
                )
            ],
        )
        dm = make_datamodule(Path(data_dir), num_workers=1, val_tokens=SEQ_LEN * MICRO_BATCH * 2)
        trainer.fit(module, datamodule=dm, ckpt_path="last" if resume else None)
        results[name] = module.seen
        results[name + "_accumulate"] = trainer.accumulate_grad_batches
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.distributed
def test_ddp_two_ranks_uneven_shards_resume_exactly(tmp_path):
    data_dir = tmp_path / "data"
    # two files, 40 and 120 documents: rank 0 holds far less data than rank 1
    docs = filler_documents(160, 40, 300, seed=5)
    write_fineweb_files(docs[:40], data_dir, prefix="small")
    write_fineweb_files(docs[40:], data_dir, prefix="large")
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "NODE_RANK": "0",
    }
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_ddp_worker, args=(str(data_dir), str(out), r, env)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    assert not hung, "DDP ranks did not finish in 180 s (hang?)"
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["full_accumulate"] == 1  # 4 global / (2 ranks x 2 micro)
        assert len(r["full"]) == 8
        assert r["first"] + r["rest"] == r["full"]
    assert not set(ranks[0]["full"]) & set(ranks[1]["full"])  # ranks see different data
