"""What ``hedgecats evaluate`` leaves when writing its results fails: one line naming the
directory (the pipeline's wording), exit 1, and the previous output (or nothing) in place
(docs/reliability.md)."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from fixtures.eval.support import save_tiny_model, write_tasks
from hedgecats.evaluation import cli


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eval_writes")
    save_tiny_model(d / "model")
    write_tasks(d / "tasks", n_docs=4)
    (d / "hybrid.yaml").write_text("window: 8\n")
    return d


def _full_disk(results, out_dir):
    (Path(out_dir) / "results.json").write_text("{")  # half-written, then the disk is full
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_while_evaluate_writes_is_one_line_and_keeps_the_old_output(
        ws, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"old": true}')
    monkeypatch.setattr(cli, "write_results", _full_disk)
    rc = cli.main(["--model", str(ws / "model"), "--hybrid", str(ws / "hybrid.yaml"), "--tasks",
                   str(ws / "tasks" / "toy_acc.yaml"), "--modes", "softmax", "--limit", "2",
                   "--bootstrap-iters", "10", "-q", "--overwrite", "--output", str(out)])
    err = capsys.readouterr().err
    assert rc == 1, err
    lines = [x for x in err.splitlines() if x.startswith("hedgecats evaluate:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"could not write {str(out)!r}" in lines[0] and "the disk is full" in lines[0]
    assert "--output is as it was" in lines[0]
    assert json.loads((out / "results.json").read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
