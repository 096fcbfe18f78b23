"""``hedgecats export --check`` says whether the check passed: the modes it compared on
success; on a mismatch one line, exit 1, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hedgecats.cli import main


@pytest.fixture(scope="module")
def stage_pt(tmp_path_factory) -> Path:
    """A transfer stage of a tiny Llama (no LoRA)."""
    from fixtures.tiny import save_tiny_llama
    from hedgecats.models.stage_files import build_hybrid, save_stage

    root = tmp_path_factory.mktemp("stage")
    base = str(save_tiny_llama(root / "base"))
    hyb = {"window": 4}
    model = build_hybrid(base, hybrid_config=hyb)
    return save_stage(root / "transfer" / "stage.pt", model, base_model=base, hybrid_config=hyb,
                      stage="AttentionTransfer", meta={"global_step": 1, "init_from": None})


def test_check_says_it_passed_and_in_which_modes(stage_pt, tmp_path, capsys):
    from hedgecats.models.config import MODES

    assert main(["export", str(stage_pt), str(tmp_path / "out"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and all(m in out for m in MODES), out
    assert main(["export", str(stage_pt), str(tmp_path / "plain")]) == 0
    assert "check passed" not in capsys.readouterr().out  # no check asked, none claimed


def test_a_failed_check_is_one_line_and_writes_nothing(stage_pt, tmp_path, capsys, monkeypatch):
    import hedgecats.models.hf as hf

    load = hf.load_pretrained_hybrid

    def perturbed(*args, **kwargs):  # the reloaded export differs from the stage
        model = load(*args, **kwargs)
        with torch.no_grad():
            model.get_output_embeddings().weight.add_(1.0)
        return model

    monkeypatch.setattr(hf, "load_pretrained_hybrid", perturbed)
    out = tmp_path / "out"
    assert main(["export", str(stage_pt), str(out), "--check"]) == 1
    # stderr also carries transformers' loading bars: the error is its own one line
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "hedgecats export" in ln]
    assert len(lines) == 1 and lines[0].startswith("hedgecats export: check failed:"), lines
    err = lines[0]
    assert "does not reproduce the stage" in err and "nothing was written" in err, err
    assert not out.exists()
