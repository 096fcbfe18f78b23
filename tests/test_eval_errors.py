"""Bad input to ``hedgecats evaluate``: a clear error (exit 2) and nothing written in ``--output``."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.eval.support import save_tiny_model, write_tasks
from hedgecats.evaluation import cli, report
from hedgecats.models import HybridConfig, convert_to_hybrid


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("eval_err")
    save_tiny_model(d / "model")
    write_tasks(d / "tasks", n_docs=4)
    (d / "hybrid.yaml").write_text("window: 8\n")
    return d


def _fails(argv: list[str], out: Path, capsys, *needles: str) -> str:
    rc = cli.main(argv + ["--output", str(out), "-q"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert not out.exists(), "nothing may be written on error"
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temp left"
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.slow
def test_unknown_task_name(ws, tmp_path, capsys):
    # a local directory plus a misspelt built-in name: lm-eval's own index (~15k tasks, about
    # 15 s on 2 cores) is consulted
    _fails(["--model", str(ws / "model"), "--hybrid", str(ws / "hybrid.yaml"),
            "--tasks", f"{ws / 'tasks'},hellaswg"], tmp_path / "o", capsys,
           "unknown task(s) ['hellaswg']", "hellaswag")


def test_unknown_task_name_small_index(ws, tmp_path, capsys, monkeypatch):
    """The same path with lm-eval's built-in index replaced by a small directory (fast)."""
    import lm_eval.tasks

    builtin = tmp_path / "builtin"
    write_tasks(builtin, n_docs=2)
    real = lm_eval.tasks.TaskManager

    def small(*args, include_path=None, include_defaults=True, **kwargs):
        if include_defaults:  # stands in for lm-eval's own task directory
            include_path = [*(include_path or []), str(builtin)]
        return real(*args, include_path=include_path, include_defaults=False, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", small)
    _fails(["--model", str(ws / "model"), "--hybrid", str(ws / "hybrid.yaml"),
            "--tasks", f"{ws / 'tasks' / 'toy_acc.yaml'},toy_nrom"], tmp_path / "o", capsys,
           "unknown task(s) ['toy_nrom']", "did you mean toy_norm")


def test_missing_task_path_and_bad_modes(ws, tmp_path, capsys):
    base = ["--model", str(ws / "model"), "--hybrid", str(ws / "hybrid.yaml")]
    _fails(base + ["--tasks", str(ws / "nope.yaml")], tmp_path / "o", capsys, "does not exist")
    _fails(base + ["--tasks", str(ws / "tasks"), "--modes", "hybrid,la_olny"], tmp_path / "o",
           capsys, "unknown mode 'la_olny'", "la_only")
    _fails(base + ["--tasks", str(ws / "tasks"), "--modes", "hybrid+rescale"], tmp_path / "o",
           capsys, "switch 'rescale' has no effect in mode 'hybrid'")
    _fails(base + ["--tasks", str(ws / "tasks"), "--modes", "swa_only+window=0"], tmp_path / "o",
           capsys, "integer >= 1")
    _fails(base + ["--tasks", str(ws / "tasks"), "--metric", "toy_acc=f1"], tmp_path / "o",
           capsys, "reports no metric 'f1'")


def test_task_data_that_cannot_be_loaded(ws, tmp_path, capsys):
    bad = tmp_path / "bad_tasks"
    write_tasks(bad, n_docs=2)
    (bad / "toy_acc.jsonl").unlink()  # the YAML now points at a missing file
    _fails(["--model", str(ws / "model"), "--tasks", str(bad / "toy_acc.yaml"), "--modes", "softmax"],
           tmp_path / "o", capsys, "could not load the data of ['toy_acc']", "dataset_path: json")


def test_mode_needs_converted_model(ws, tmp_path, capsys):
    _fails(["--model", str(ws / "model"), "--tasks", str(ws / "tasks"), "--modes", "hybrid,la_only"],
           tmp_path / "o", capsys, "need a converted (hybrid) model", "--hybrid")


def test_probes_need_what_they_measure(ws, tmp_path, capsys):
    base = ["--model", str(ws / "model"), "--tasks", str(ws / "tasks"), "--modes", "softmax"]
    _fails(base + ["--branch-usage"], tmp_path / "o", capsys, "--branch-usage needs a converted")
    _fails(base + ["--retrieval"], tmp_path / "o", capsys, "--retrieval-window")


def test_bad_hybrid_yaml(ws, tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text("window: 8\nwindoww: 3\n")
    _fails(["--model", str(ws / "model"), "--hybrid", str(tmp_path / "bad.yaml"),
            "--tasks", str(ws / "tasks")], tmp_path / "o", capsys, "unknown HybridConfig fields ['windoww']")


def _stage(ws: Path, name: str, base_model: str, seed: int = 3) -> Path:
    """A real stage checkpoint (``save_stage``) of the tiny model, recording ``base_model``."""
    from hedgecats.models.stage_files import save_stage
    from transformers import AutoModelForCausalLM

    cfg = HybridConfig(window=8, seed=seed)
    model = convert_to_hybrid(AutoModelForCausalLM.from_pretrained(ws / "model"), cfg)
    return save_stage(ws / name / "stage.pt", model, base_model=base_model, hybrid_config=cfg,
                      stage="AttentionTransfer")


def test_checkpoint_from_another_base_model(ws, tmp_path, capsys):
    ckpt = _stage(ws, "ckpt_other", str(ws / "model"))
    argv = ["--model", str(ckpt), "--tasks", str(ws / "tasks")]
    _fails(argv + ["--baseline", "mistralai/Mistral-7B-v0.1"], tmp_path / "o", capsys,
           f"trained from base model {str(ws / 'model')!r}, not 'mistralai/Mistral-7B-v0.1'")
    _fails(argv + ["--expect-base", "meta-llama/Meta-Llama-3-8B"], tmp_path / "o", capsys,
           "--expect-base")
    # --hybrid cannot re-convert a checkpoint; a directory without stage.pt is no checkpoint
    _fails(argv + ["--hybrid", str(ws / "hybrid.yaml")], tmp_path / "o", capsys, "stage checkpoint")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    _fails(["--model", str(tmp_path / "junk.pt"), "--tasks", str(ws / "tasks")], tmp_path / "o",
           capsys, "cannot read stage checkpoint")
    (tmp_path / "empty").mkdir()
    _fails(["--model", str(tmp_path / "empty"), "--tasks", str(ws / "tasks")], tmp_path / "o",
           capsys, "neither config.json")


def test_stage_checkpoint_runs_with_matching_base(ws, tmp_path):
    import json

    ckpt_dir = _stage(ws, "ckpt_ok", str(ws / "model")).parent
    out = tmp_path / "ok"
    rc = cli.main(["--model", str(ckpt_dir), "--tasks", str(ws / "tasks" / "toy_acc.yaml"),
                   "--modes", "hybrid,swa_only", "--expect-base", str(ws / "model"),
                   "--bootstrap-iters", "10", "-q", "--output", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["model_source"] == "stage_checkpoint"
    assert res["meta"]["base_model"] == str(ws / "model")
    assert "softmax" in res["baseline"]["source"]
    assert list(res["tasks"]) == ["toy_acc"]


def test_several_checkpoints_as_seeds(ws, tmp_path, capsys):
    import json

    a = _stage(ws, "seed_a", str(ws / "model"), seed=10)
    b = _stage(ws, "seed_b", str(ws / "model"), seed=11)
    out = tmp_path / "runs"
    rc = cli.main(["--model", str(a), "--model", str(b), "--tasks", str(ws / "tasks" / "toy_acc.yaml"),
                   "--modes", "hybrid,swa_only", "--bootstrap-iters", "10", "-q",
                   "--output", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["seeds"] == [str(a), str(b)] and "stage checkpoint" in res["meta"]["seed_kind"]
    per = [r["hybrid"]["avg"] - r["swa_only"]["avg"] for r in res["per_seed"]]
    assert res["delta_la_seeds"]["values"] == pytest.approx(per)
    assert res["modes"]["hybrid"]["avg"] == pytest.approx(
        sum(r["hybrid"]["avg"] for r in res["per_seed"]) / 2)
    # a checkpoint of another base model among them is refused before anything runs
    c = _stage(ws, "seed_c", "someone/other-base", seed=12)
    _fails(["--model", str(a), "--model", str(c), "--tasks", str(ws / "tasks")], tmp_path / "o",
           capsys, "trained from base model 'someone/other-base'")
    _fails(["--model", str(a), "--model", str(ws / "model"), "--tasks", str(ws / "tasks")],
           tmp_path / "o", capsys, "must all be stage checkpoints")


def test_non_empty_output_and_overwrite(ws, tmp_path, capsys):
    """A non-empty --output that is no earlier evaluation is replaced only with --force
    (--overwrite deleted whatever directory it was given); an earlier evaluation's output
    with --overwrite."""
    out = tmp_path / "full"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    run = ["--model", str(ws / "model"), "--tasks", str(ws / "tasks"), "--modes", "softmax",
           "--limit", "2", "--output", str(out), "-q"]
    for extra, needle in (([], "--force"), (["--overwrite"], "no earlier evaluation")):
        assert cli.main(run + extra) == 2
        assert needle in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert cli.main(run + ["--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.json", "results.md"]
    assert cli.main(run) == 2 and "--overwrite" in capsys.readouterr().err
    assert cli.main(run + ["--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["results.csv", "results.json", "results.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temp or old copy left


def test_help_documents_the_mode_syntax(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for needle in ("mode syntax: MODE[+SWITCH[=VALUE]]", "la_span=outside|all", "window=N",
                   "--retrieval", "--branch-usage", "--seeds", "results.json"):
        assert needle in text


def test_failure_while_writing_leaves_nothing(ws, tmp_path, monkeypatch, capsys):
    def broken(results, out_dir):
        (Path(out_dir) / "results.json").write_text("{}")  # half-written ...
        raise ValueError("disk full (simulated)")           # ... then a failure

    monkeypatch.setattr(cli, "write_results", broken)
    _fails(["--model", str(ws / "model"), "--tasks", str(ws / "tasks"), "--modes", "softmax",
            "--limit", "2", "--bootstrap-iters", "10"], tmp_path / "o", capsys, "disk full")


def test_atomic_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "r"
    with report.atomic_output_dir(out) as tmp:
        (tmp / "results.json").write_text("1")
        assert not out.exists()
    assert (out / "results.json").read_text() == "1"
    with pytest.raises(RuntimeError), report.atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "results.json").write_text("2")
        raise RuntimeError("boom")
    assert (out / "results.json").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]


# ----------------------------------------------------------------------------- issue 50
@pytest.fixture
def no_scoring(monkeypatch):
    """Fails the test if a model is scored (lm-eval or a probe) before the error."""
    def scored(*a, **k):
        pytest.fail("a model was scored before the error")

    monkeypatch.setattr(cli, "run_modes", scored)
    monkeypatch.setattr(cli, "_probes", scored)


def test_a_missing_model_path_says_it_does_not_exist(ws, tmp_path, capsys, no_scoring,
                                                     monkeypatch):
    """Not "not a converted model": the path is named as missing (item 9)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for spec in ("runs/nope", str(tmp_path / "nope" / "stage.pt")):
        err = _fails(["--model", spec, "--tasks", str(ws / "tasks")], tmp_path / "o", capsys,
                     f"--model {spec!r} does not exist")
        assert "converted" not in err


def test_every_argument_is_checked_before_a_model_is_scored(ws, tmp_path, capsys, no_scoring):
    """Arguments that failed only after every lm-eval task had run (item 3)."""
    base = ["--model", str(ws / "model"), "--hybrid", str(ws / "hybrid.yaml"), "--tasks",
            str(ws / "tasks"), "--modes", "hybrid"]
    _fails(base + ["--baseline", str(tmp_path / "no-baseline")], tmp_path / "o", capsys,
           "--baseline", "does not exist")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    _fails(base + ["--branch-usage", "--branch-usage-text", str(latin1)], tmp_path / "o", capsys,
           f"--branch-usage-text {str(latin1)!r} is not UTF-8 text")
    for flag, value in (("--retrieval-window", "0"), ("--retrieval-max-length", "0"),
                        ("--max-length", "0"), ("--limit", "0"), ("--bootstrap-iters", "-1")):
        _fails(base + ["--retrieval", flag, value], tmp_path / "o", capsys, f"{flag}={value}")


def test_branch_usage_on_a_model_with_fewer_positions_than_tokens(ws, tmp_path, capsys):
    """--branch-usage-tokens (default 1,024) beyond max_position_embeddings: the sample is cut
    to the model's positions, as --retrieval cuts its documents, and the results say so; it
    failed after every lm-eval task had run, writing nothing (item 3)."""
    import json
    import shutil

    short = tmp_path / "short"
    shutil.copytree(ws / "model", short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 200
    (short / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o"
    rc = cli.main(["--model", str(short), "--hybrid", str(ws / "hybrid.yaml"), "--tasks",
                   str(ws / "tasks" / "toy_acc.yaml"), "--modes", "hybrid", "--limit", "2",
                   "--bootstrap-iters", "0", "--branch-usage", "--output", str(out), "-q"])
    assert rc == 0, capsys.readouterr().err
    usage = json.loads((out / "results.json").read_text())["branch_usage"]
    assert usage["n_tokens"] == 200 and usage["max_tokens"] == 1024
    assert "cut to max_position_embeddings=200" in usage["note"]
