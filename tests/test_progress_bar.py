"""The step progress bar: the stage's global step against ``max_steps``, with a rate measured
over the steps this run of the stage made (not reset by a data epoch, right after a resume too)."""

from __future__ import annotations

import re

import pytest


def test_step_progress_counts_the_stage_and_its_rate():
    from hedgecats.lightning_modules.guard import step_progress

    # 30 steps made in 10 s since the stage started at step 0: 3 steps/s, whatever the epoch
    p = step_progress(30, 100, start_step=0, start_time=100.0, now=110.0)
    assert (p.n, p.total) == (30, 100)
    assert p.rate == pytest.approx(3.0)
    assert p.remaining == pytest.approx(70 / 3.0)
    # resumed at step 150: the rate counts only the steps made since, not the 150 restored
    p = step_progress(160, 400, start_step=150, start_time=50.0, now=55.0)
    assert (p.n, p.total, p.rate) == (160, 400, pytest.approx(2.0))
    # right after the start or the resume: the total is known, the rate not yet
    p = step_progress(150, 400, start_step=150, start_time=50.0, now=50.0)
    assert (p.n, p.total, p.rate, p.remaining) == (150, 400, None, None)
    # a stage without max_steps has no total
    assert step_progress(5, None, start_step=0, start_time=0.0, now=1.0).total is None
    assert step_progress(5, -1, start_step=0, start_time=0.0, now=1.0).total is None


class _Tiny:
    """A one-parameter module whose steps take ``delay`` seconds (built lazily: lightning)."""

    @staticmethod
    def make(delay: float):
        import time

        import lightning.pytorch as pl
        import torch

        class Tiny(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Parameter(torch.ones(1))

            def training_step(self, batch, batch_idx):
                time.sleep(delay)
                return (self.w * batch[0]).sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Tiny()


def _fit(tmp_path, max_steps: int, ckpt_path=None):
    """Fit 4-batch epochs to ``max_steps``; what the bar displayed at each batch end."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from hedgecats.lightning_modules import StepProgressBar

    seen = []

    class Look(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            bar = next(c for c in trainer.callbacks if isinstance(c, StepProgressBar))
            line = str(bar.train_progress_bar)  # what the terminal shows
            counts = re.search(r"\| (\d+)/(\S+) \[", line)
            rate = re.search(r"([\d.]+)step/s", line)
            seen.append({"n": int(counts[1]), "total": counts[2], "line": line,
                         "rate": float(rate[1]) if rate else None,
                         "desc": bar.train_progress_bar.desc, "step": trainer.global_step})

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 1)),
                                       batch_size=1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    tr = pl.Trainer(max_steps=max_steps, callbacks=[StepProgressBar(), Look(), ckpt],
                    logger=False, default_root_dir=tmp_path, enable_model_summary=False)
    tr.fit(_Tiny.make(0.05), data, ckpt_path=ckpt_path)
    return seen


def test_bar_shows_the_stage_total_and_rate_across_epochs_and_a_resume(tmp_path):
    """Steps of ~50 ms: the displayed rate stays near 20 steps/s across a data epoch (it read
    thousands per second after each epoch's reset), and after a mid-epoch resume the bar shows
    ``n/max_steps`` (it read ``6/?``)."""
    first = _fit(tmp_path, 6)
    assert [s["n"] for s in first] == [s["step"] for s in first] == list(range(1, 7))
    assert all(s["total"] == "6" for s in first)
    after_epoch = first[4:]  # steps 5, 6: the second data epoch
    assert all(s["rate"] is not None and s["rate"] < 25 for s in after_epoch), after_epoch

    resumed = _fit(tmp_path, 10, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert [s["n"] for s in resumed] == list(range(7, 11))
    assert all(s["total"] == "10" for s in resumed), resumed
    assert all(s["desc"].startswith("epoch 2") for s in resumed[:2]), resumed
    assert all(s["rate"] is not None and s["rate"] < 25 for s in resumed), resumed
