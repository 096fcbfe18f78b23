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
