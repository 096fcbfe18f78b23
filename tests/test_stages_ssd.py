"""Scheduled Sliding-window Dropout: the pure schedule, and the callback driving the layers."""

import lightning.pytorch as pl
import pytest
from hedgecats.lightning_modules import (
    SSD_SCHEDULES,
    HybridFinetune,
    RecallDataModule,
    ScheduledSlidingWindowDropout,
    resolve_ssd_schedule,
    ssd_schedule,
)
from fixtures.tiny import save_tiny_llama
from hedgecats.models import hybrid_layers
from hedgecats.models.stage_files import read_stage
from hedgecats.models.structure import unwrap


@pytest.mark.parametrize("name,want", [
    ("dropout", [(0.9, 32), (0.75, 32), (0.5, 32), (0.5, 32), (0.5, 32), (0.5, 32)]),
    ("window", [(0.5, 4), (0.5, 8), (0.5, 16), (0.5, 32), (0.5, 64), (0.5, 64)]),
    ("fixed", [(0.5, 16)] * 6),
])
def test_paper_schedules_hold_their_last_value(name, want):
    p, w = resolve_ssd_schedule(name)
    assert [ssd_schedule(e, p, w) for e in range(6)] == want


def test_user_lists_and_overrides():
    assert resolve_ssd_schedule(None, p=[0.3, 0.1], window=[8]) == ((0.3, 0.1), (8,))
    assert resolve_ssd_schedule("dropout", window=[16]) == (SSD_SCHEDULES["dropout"][0], (16,))
    assert ssd_schedule(10, (0.3, 0.1), (8, 4)) == (0.1, 4)
    with pytest.raises(ValueError, match="unknown SSD schedule 'nope'"):
        resolve_ssd_schedule("nope")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_ssd_schedule(None, p=[0.5])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        resolve_ssd_schedule(None, p=[1.5], window=[4])
    with pytest.raises(ValueError, match="integers >= 1"):
        resolve_ssd_schedule(None, p=[0.5], window=[0])
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        ssd_schedule(-1, (0.5,), (4,))
    with pytest.raises(ValueError, match="granularity"):
        ScheduledSlidingWindowDropout(granularity="token")


def test_callback_sets_layers_per_epoch_and_logs(tmp_path):
    base = str(save_tiny_llama(tmp_path / "base"))
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rts = [a.hedgecats for _, a in hybrid_layers(unwrap(pl_module.model))]
            assert pl_module.model.training
            seen.append({(rt.ssd_p, rt.window, rt.ssd_granularity, rt.rescale) for rt in rts})

    m = HybridFinetune(base, hybrid={"window": 8}, lr=1e-3)
    ssd = ScheduledSlidingWindowDropout(None, p=[0.9, 0.6], window=[4, 6, 2], granularity="head",
                                        rescale=True)
    dm = RecallDataModule(seq_len=32, window=8, far_min=12, far_max=20, facts_per_doc=2,
                          num_train=8, num_val=4, num_test=4, batch_size=4)
    logged = []

    class Log(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            logged.append((round(float(trainer.callback_metrics["ssd/p"]), 6),
                           float(trainer.callback_metrics["ssd/window"])))

    tr = pl.Trainer(max_epochs=4, limit_train_batches=1, limit_val_batches=0, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=str(tmp_path),
                    callbacks=[ssd, Spy(), Log()])
    tr.fit(m, datamodule=dm)
    assert seen == [{(0.9, 4, "head", True)}, {(0.6, 6, "head", True)}, {(0.6, 2, "head", True)},
                    {(0.6, 2, "head", True)}]
    assert logged == [(0.9, 4.0), (0.6, 6.0), (0.6, 2.0), (0.6, 2.0)]
    # after training: no drop, switches restored, the last window kept and recorded
    rts = [a.hedgecats for _, a in hybrid_layers(unwrap(m.model))]
    assert {(rt.ssd_p, rt.window, rt.rescale) for rt in rts} == {(0.0, 2, False)}
    cfg = read_stage(tmp_path / "stage.pt")["hybrid_config"]
    assert cfg["window"] == 2 and cfg["ssd_p"] == 0.0


def test_phase_function():
    from hedgecats.lightning_modules import ssd_phase

    assert [ssd_phase("epoch", epoch=e, step=99) for e in range(3)] == [0, 1, 2]
    assert [ssd_phase("step", epoch=0, step=s, interval_steps=10) for s in (0, 9, 10, 35)] == \
        [0, 0, 1, 3]
    # 4 phases over 10 steps: [0, 2.5), [2.5, 5), [5, 7.5), [7.5, 10)
    assert [ssd_phase("fraction", epoch=0, step=s, total_steps=10, n_phases=4)
            for s in range(10)] == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="unknown SSD interval"):
        ssd_phase("token", epoch=0, step=0)
    with pytest.raises(ValueError, match="interval_steps"):
        ScheduledSlidingWindowDropout(interval="step")
    with pytest.raises(ValueError, match="interval_steps"):
        ScheduledSlidingWindowDropout(interval="fraction", interval_steps=5)


def _fit_ssd(tmp_path, ssd, **trainer_kw):
    base = str(save_tiny_llama(tmp_path / "base"))
    seen = []

    class Spy(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rts = {(a.hedgecats.ssd_p, a.hedgecats.window)
                   for _, a in hybrid_layers(unwrap(pl_module.model))}
            assert len(rts) == 1
            seen.append(next(iter(rts)))

    dm = RecallDataModule(seq_len=32, window=8, far_min=12, far_max=20, facts_per_doc=2,
                          num_train=40, num_val=4, num_test=4, batch_size=4)  # 10 batches / epoch
    args = dict(limit_val_batches=0, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(tmp_path), callbacks=[ssd, Spy()])
    args.update(trainer_kw)
    pl.Trainer(**args).fit(HybridFinetune(base, hybrid={"window": 8}, lr=1e-3), datamodule=dm)
    return seen


def test_fraction_schedule_advances_within_one_epoch(tmp_path):
    ssd = ScheduledSlidingWindowDropout("dropout", interval="fraction")  # 4 phases of p
    seen = _fit_ssd(tmp_path, ssd, max_steps=8)
    assert [p for p, _ in seen] == [0.9, 0.9, 0.75, 0.75, 0.5, 0.5, 0.5, 0.5]
    assert {w for _, w in seen} == {32}


def test_step_schedule(tmp_path):
    ssd = ScheduledSlidingWindowDropout("window", interval="step", interval_steps=2)
    seen = _fit_ssd(tmp_path, ssd, max_steps=7)
    assert [w for _, w in seen] == [4, 4, 8, 8, 16, 16, 32]


def test_epoch_schedule_that_cannot_advance_is_an_error_at_start(tmp_path):
    """A per-epoch schedule in a stage shorter than one epoch (the testbed's first SSD runs):
    p stayed at 0.9 for the whole stage, silently."""
    from hedgecats.lightning_modules import SSDScheduleError

    ssd = ScheduledSlidingWindowDropout("dropout")
    with pytest.raises(SSDScheduleError, match="never leave its first phase.*interval: fraction"):
        _fit_ssd(tmp_path, ssd, max_steps=6)


def test_epoch_schedule_partly_out_of_reach_warns(tmp_path):
    ssd = ScheduledSlidingWindowDropout("window")  # 5 epochs of windows
    with pytest.warns(UserWarning, match="reaches only 2.*window=8"):
        seen = _fit_ssd(tmp_path, ssd, max_steps=15)
    assert [w for _, w in seen] == [4] * 10 + [8] * 5


def test_constant_schedule_needs_no_reach(tmp_path):
    seen = _fit_ssd(tmp_path, ScheduledSlidingWindowDropout("fixed"), max_steps=3)
    assert seen == [(0.5, 16)] * 3
