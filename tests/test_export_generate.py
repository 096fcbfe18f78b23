"""``hedgecats export`` (a run or stage -> a hybrid directory with a model card) and
``hedgecats generate`` on its output, on a tiny two-stage run written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from hedgecats.cli import main
from hedgecats.export import results_table, stage_chain
from hedgecats.generate import parse_switch
from fixtures.tiny import save_tiny_llama
from hedgecats.models import attention_mode
from hedgecats.models.stage_files import build_hybrid, load_hybrid, save_stage, stage_tensors
from hedgecats.models.stage_source import resolve_stage
from hedgecats.models.structure import unwrap

HYB = {"window": 4, "layer_windows": {1: 6}, "mixer": "learned_head"}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
RESULTS = {"pipeline": "tiny", "stage": "finetune",
           "results": {"hybrid": {"lm_loss": 1.024, "far_acc": 0.323},
                       "swa_only": {"lm_loss": 1.296, "far_acc": 0.024}}}


def _perturb(model, marks, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in unwrap(model).named_parameters():
            if any(m in n for m in marks):
                p.add_(0.1 * torch.randn_like(p))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory as ``hedgecats pipeline`` leaves it: transfer, then LoRA fine-tuning."""
    root = tmp_path_factory.mktemp("run")
    base = str(save_tiny_llama(root / "teacher" / "model"))
    run = root / "tiny"
    transfer = build_hybrid(base, hybrid_config=HYB)
    _perturb(transfer, (".phi_", ".mixer."), 1)
    t_pt = save_stage(run / "transfer" / "stage.pt", transfer, base_model=base, hybrid_config=HYB,
                      stage="AttentionTransfer", meta={"global_step": 10, "init_from": None})
    finetune = build_hybrid(base, hybrid_config=HYB, lora_config=LORA)
    tensors = stage_tensors(transfer)
    with torch.no_grad():
        params = dict(unwrap(finetune).named_parameters())
        for n, t in tensors.items():
            params[n].copy_(t)
    _perturb(finetune, ("lora_B",), 2)
    save_stage(run / "finetune" / "stage.pt", finetune, base_model=base, hybrid_config=HYB,
               lora_config=LORA, stage="HybridFinetune",
               meta={"global_step": 5, "init_from": str(t_pt)})
    for name in ("transfer", "finetune"):
        (run / name / "config.yaml").write_text(yaml.safe_dump(
            {"data": {"class_path": "x.RecallDataModule",
                      "init_args": {"seq_len": 128, "batch_size": 32}}}))
    (run / "results.json").write_text(json.dumps(RESULTS))
    return run


def _ids(T=20):
    return torch.randint(3, 250, (1, T), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- export
def test_run_directory_resolves_to_the_evaluated_stage_and_its_chain(run_dir):
    stage_pt, run = resolve_stage(run_dir)
    assert stage_pt == run_dir / "finetune" / "stage.pt" and run == run_dir
    (run_dir / "results.json").rename(run_dir / "results.bak")
    try:  # without results.json: the end of the init_from chain
        assert resolve_stage(run_dir)[0] == run_dir / "finetune" / "stage.pt"
    finally:
        (run_dir / "results.bak").rename(run_dir / "results.json")
    chain = stage_chain(stage_pt)
    assert [(c["name"], c["stage"], c["steps"], c["tokens"]) for c in chain] == [
        ("transfer", "AttentionTransfer", 10, 10 * 32 * 128),
        ("finetune", "HybridFinetune", 5, 5 * 32 * 128)]


def test_export_merged_with_card_and_check(run_dir, tmp_path):
    out = tmp_path / "tiny-hybrid"
    assert main(["export", str(run_dir), str(out), "--check"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "tokenizer.json"} <= names
    assert "adapter" not in names
    card = (out / "README.md").read_text()
    for text in ("library_name: transformers", "import hedgecats", "HybridFinetune",
                 "AttentionTransfer", f"{5 * 32 * 128:,}", "| hybrid | 1.024 | 0.323 |",
                 "Recipe: tiny", "merged into the weights", "| SWA window | 4 (per layer: "):
        assert text in card, text
    from transformers import AutoModelForCausalLM

    ref, _, _ = load_hybrid(run_dir / "finetune" / "stage.pt", merge_lora=True)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.equal(loaded(_ids()).logits, ref(_ids()).logits)


def test_export_keeps_the_adapter(run_dir, tmp_path):
    out = tmp_path / "adapter-hybrid"
    assert main(["export", str(run_dir / "finetune" / "stage.pt"), str(out), "--keep-adapter",
                 "--check"]) == 0
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert "peft adapter in `adapter/`" in (out / "README.md").read_text()
    from transformers import AutoModelForCausalLM

    ref, _, _ = load_hybrid(run_dir / "finetune" / "stage.pt", merge_lora=False)
    loaded = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad(), attention_mode(unwrap(ref), "la_only"), attention_mode(loaded, "la_only"):
        assert torch.equal(loaded(_ids()).logits, ref(input_ids=_ids()).logits)


def test_export_refuses_to_overwrite_and_bad_sources(run_dir, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run_dir), str(out)]) == 2
    assert "is not empty and is not a hedgecats export" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(run_dir / "transfer"), str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert main(["export", str(run_dir), str(out)]) == 2  # an earlier export: --overwrite
    assert "exists and is not empty: pass --overwrite" in capsys.readouterr().err
    assert main(["export", str(out), str(tmp_path / "x")]) == 2
    assert "is a transformers model directory, not a stage" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "x")]) == 2
    assert "holds no stage checkpoint" in capsys.readouterr().err


def test_export_pushes_through_transformers_then_the_card(run_dir, tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import ModelCard
    from transformers.utils import hub

    uploaded: list[str] = []

    class FakeHub:
        def create_repo(self, repo_id, **kw):
            return type("Repo", (), {"repo_id": repo_id})()

        def create_commit(self, repo_id, operations, **kw):
            uploaded.extend(op.path_in_repo for op in operations)

    cards = []
    monkeypatch.setattr(hub, "hf_api", lambda: FakeHub())
    monkeypatch.setattr(hub, "create_and_tag_model_card",
                        lambda repo_id, tags=None, token=None: ModelCard("# transformers' card\n"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_file",
                        lambda self, **kw: cards.append(kw))
    assert main(["export", str(run_dir), str(tmp_path / "p"), "--push-to-hub", "me/tiny"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(uploaded)
    assert cards and cards[0]["path_in_repo"] == "README.md" and cards[0]["repo_id"] == "me/tiny"
    assert 'from_pretrained("me/tiny")' in Path(cards[0]["path_or_fileobj"]).read_text()
    uploaded.clear()
    assert main(["export", str(run_dir), str(tmp_path / "q"), "--keep-adapter",
                 "--push-to-hub", "me/tiny-adapter"]) == 0
    assert {"config.json", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(uploaded)


def test_results_table_formats():
    evaluate_format = {"modes": {"hybrid": {"tasks": {"piqa": {"score": 70.1}}, "avg": 70.1,
                                            "rec_perf": 95.0}}, "delta_la": 1.5}
    table = results_table(evaluate_format)
    assert "| mode | piqa | AVG | Rec. Perf |" in table and "| hybrid | 70.10 |" in table
    assert "Delta_LA" in table
    assert results_table({"something": 1}) is None
    # hedgecats evaluate --tasks none: no task columns, the probes' tables instead
    cell = {"n": 2, "accuracy": 50.0, "token_accuracy": 75.0, "distance_min": 1,
            "distance_max": 9}
    probes = {"tasks": [], "modes": {"hybrid": {"tasks": {}, "avg": None}},
              "retrieval": {"window_note": "window 8", "distance_unit": "tokens",
                            "scoring": "greedy", "modes": {"hybrid": {
                                b: dict(cell) for b in ("inside", "1-4x", "4-16x", "beyond")}}}}
    table = results_table(probes)
    assert "AVG" not in table and "| hybrid | 50.0 (75.0, n=2) |" in table
    assert results_table({"tasks": [], "modes": {"hybrid": {"tasks": {}}}}) is None


# ----------------------------------------------------------------------------- generate
@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exp") / "hybrid"
    assert main(["export", str(run_dir), str(out)]) == 0
    return out


def test_generate_streams_greedy_text(exported, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["generate", "--model", str(exported), "--max-new-tokens", "8", "abc"]) == 0
    cap = capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(exported)
    model = AutoModelForCausalLM.from_pretrained(exported)
    enc = tok(["abc"], return_tensors="pt")
    want = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(want[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert cap.out == "abc" + text + "\n"
    assert "HybridCache" in cap.err and "tokens/s" in cap.err


def test_generate_from_a_stage_with_mode_file_batch_and_sampling(run_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first\n\nsecond one\n")
    args = ["generate", "--model", str(run_dir / "finetune" / "stage.pt"), "--prompt-file",
            str(prompts), "--mode", "la_only", "--switch", "la_span=all", "--max-new-tokens", "6",
            "--batch-size", "2", "--no-stream", "--do-sample", "--top-k", "5", "--seed", "3"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("first") and "\nsecond one" in first
    assert main(args) == 0
    assert capsys.readouterr().out == first  # seeded sampling repeats
    assert main(["generate", "--model", str(run_dir), "--mode", "softmax", "--max-new-tokens",
                 "3", "x"]) == 0
    assert "full KV cache" in capsys.readouterr().err


def test_generate_errors(run_dir, tmp_path, capsys):
    base = run_dir.parent / "teacher" / "model"
    assert main(["generate", "--model", str(base), "x"]) == 2
    assert "is not a hedgecats hybrid" in capsys.readouterr().err
    assert main(["generate", "--model", str(run_dir)]) == 2
    assert "no prompt" in capsys.readouterr().err
    assert main(["generate", "--model", str(run_dir), "--mode", "sideways", "x"]) == 2
    assert "unknown attention mode 'sideways'" in capsys.readouterr().err
    assert main(["generate", "--model", str(run_dir), "--num-beams", "2", "x"]) == 2
    assert "beam search cannot stream" in capsys.readouterr().err


def test_parse_switch():
    assert parse_switch("la_span=all") == ("la_span", "all")
    assert parse_switch("overlap=true") == ("overlap", True)
    assert parse_switch("window=32") == ("window", 32)
    assert parse_switch("eps=1e-6") == ("eps", 1e-6)
    with pytest.raises(ValueError, match="expected name=value"):
        parse_switch("overlap")


def test_cli_usage_lists_the_new_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "hedgecats export" in out and "hedgecats generate" in out


# ----------------------------------------------------------------------------- issue 50
def _one_line(err: str, command: str) -> str:
    """The error is one line without a traceback (stderr also carries progress bars)."""
    lines = [x for x in err.splitlines() if x.startswith(f"hedgecats {command}:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_export_overwrite_refuses_a_directory_that_is_not_an_export(run_dir, tmp_path, capsys):
    """--overwrite replaces an earlier export only; other files need --force (the pipeline's
    rule for --output)."""
    proj = tmp_path / "proj"
    (proj / "sub").mkdir(parents=True)
    (proj / "main.py").write_text("code")
    assert main(["export", str(run_dir), str(proj), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is not empty and is not a hedgecats export" in err and "--force" in err
    assert (proj / "main.py").read_text() == "code" and (proj / "sub").is_dir()
    (tmp_path / "afile").write_text("x")
    assert main(["export", str(run_dir), str(tmp_path / "afile"), "--overwrite"]) == 2
    assert "is a file" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
    # an earlier export is replaced with --overwrite; anything else with --force
    exp = tmp_path / "exp"
    assert main(["export", str(run_dir), str(exp)]) == 0
    assert main(["export", str(run_dir / "transfer"), str(exp), "--overwrite"]) == 0
    assert main(["export", str(run_dir), str(proj), "--force"]) == 0
    assert not (proj / "main.py").exists() and (proj / "config.json").is_file()


def test_export_of_a_run_with_an_unfinished_stage_names_it(run_dir, tmp_path, capsys):
    """A run whose last stage did not finish is refused naming the stage, instead of
    exporting the stage before it with exit 0; naming a finished stage still works."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "finetune" / "stage.pt").unlink()  # interrupted: a checkpoint, no stage.pt, no done
    (run / "finetune" / "checkpoints").mkdir()
    (run / "finetune" / "checkpoints" / "last.ckpt").write_bytes(b"ckpt")
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "stage 'finetune'" in err and "did not finish" in err and "transfer" in err
    assert not (tmp_path / "out").exists()
    assert main(["export", str(run / "transfer"), str(tmp_path / "out")]) == 0


def test_exported_files_follow_the_umask(run_dir, tmp_path):
    """safetensors writes its file 0600 through a temporary file; the export follows the umask
    like every other file."""
    import os

    old = os.umask(0o022)
    try:
        assert main(["export", str(run_dir), str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert out.stat().st_mode & 0o777 == 0o755
    for p in out.rglob("*"):
        assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p


def test_generate_one_line_errors(run_dir, exported, tmp_path, capsys, monkeypatch):
    import hedgecats.models.hf as hf

    # an empty prompt (this tokenizer adds no BOS token: nothing to continue)
    assert main(["generate", "--model", str(exported), ""]) == 2
    assert "prompt 1 is empty" in _one_line(capsys.readouterr().err, "generate")
    # a local path that does not exist is not tried on the hub
    monkeypatch.setattr(hf, "load_pretrained_hybrid",
                        lambda *a, **k: pytest.fail("a missing local path went to the hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for spec in ("runs/nope", str(tmp_path / "nope"), "./nope"):
        assert main(["generate", "--model", spec, "x"]) == 2
        line = _one_line(capsys.readouterr().err, "generate")
        assert "does not exist" in line and repr(spec) in line, line


def test_export_write_failures_are_one_line(run_dir, tmp_path, capsys, monkeypatch):
    """A read-only location and a full disk: one line in the pipeline's wording, exit 1, nothing
    left behind."""
    import errno
    import os
    import subprocess
    import sys

    import hedgecats.models.hf as hf

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(hf, "save_hybrid", read_only)
    assert main(["export", str(run_dir), str(tmp_path / "ro")]) == 1
    line = _one_line(capsys.readouterr().err, "export")
    assert f"could not write '{tmp_path / 'ro'}' (Read-only file system)" in line
    assert not (tmp_path / "ro").exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    out = tmp_path / "full"
    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, resource.RLIM_INFINITY)); "
            "from hedgecats.cli import main; "
            f"sys.exit(main(['export', {str(run_dir)!r}, {str(out)!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=240, check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    lines = [x for x in proc.stderr.splitlines() if x.startswith("hedgecats export:")]
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]
    assert f"could not write '{out}'" in lines[0] and "the disk is full" in lines[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_export_force_over_a_file_keeps_the_file_until_the_export_is_whole(run_dir, tmp_path,
                                                                           capsys, monkeypatch):
    """--force replaces a file with the export; a failed export leaves the file as it was (it
    was deleted before the export was written), a finished one leaves nothing beside it."""
    import errno

    import hedgecats.models.hf as hf

    target = tmp_path / "model"
    target.write_text("keep me")
    save = hf.save_hybrid

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_hybrid", full_disk)
    assert main(["export", str(run_dir), str(target), "--force"]) == 1
    assert "the disk is full" in _one_line(capsys.readouterr().err, "export")
    assert target.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [target]
    monkeypatch.setattr(hf, "save_hybrid", save)
    assert main(["export", str(run_dir), str(target), "--force"]) == 0
    assert (target / "config.json").is_file() and sorted(tmp_path.iterdir()) == [target]


def test_a_missing_results_file_is_refused_before_the_model_loads(run_dir, tmp_path, capsys,
                                                                  monkeypatch):
    import hedgecats.models.stage_files as stage_files

    monkeypatch.setattr(stage_files, "load_hybrid",
                        lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    missing = tmp_path / "nope.json"
    assert main(["export", str(run_dir), str(tmp_path / "out"), "--results", str(missing)]) == 2
    assert f"--results {str(missing)!r} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
