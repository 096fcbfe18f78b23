"""Every recipe file, run as a user runs it: ``hedgecats pipeline <recipe.yaml>``.

The first GPU runs of the recipes crashed before step 1 although every GPU test passed: the GPU
tests built their models another way. Here each recipe file in ``configs/`` goes through the real
command, with only what cannot exist here replaced: the base model by a tiny random model of the
same family saved with ``save_pretrained`` (Mistral keeps its own 4096-token window), FineWeb-Edu
by local parquet files in its format, the paper's lm-eval tasks by local multiple-choice tasks,
and every budget cut to a few steps. Everything else (dtypes, precision, accelerator, callbacks,
LoRA, activation checkpointing, the evaluation commands) is the file's own.

On a GPU (``-m gpu``) every recipe runs; on a CPU the same test is ``slow`` (make test-all) and
runs on the CPU accelerator.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from hedgecats.cli import main
from hedgecats.pipeline.spec import read_pipeline

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# the recipes, not the bases they extend (configs/pipelines/base/, <model>/_model.yaml: README,
# "Recipes as bases")
PAPER = sorted(p for p in (CONFIGS / "pipelines").glob("*/*.yaml")
               if p.parent.name != "base" and not p.name.startswith("_"))
TESTBED = sorted(p for p in (CONFIGS / "testbed").glob("*.yaml")  # the teachers are no recipes
                 if not p.name.startswith("teacher"))
RECIPES = PAPER + TESTBED
STEPS = 3


def _id(p: Path) -> str:
    return p.relative_to(CONFIGS).as_posix()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Tiny bases of both families (byte tokenizer), local FineWeb-Edu files, local tasks."""
    from hedgecats.data import byte_level_tokenizer, filler_documents, write_fineweb_files
    from hedgecats.data.recall_bytes import write_recall_mc_tasks
    from fixtures.tiny import save_tiny_llama
    from transformers import MistralConfig, MistralForCausalLM

    root = tmp_path_factory.mktemp("recipes")
    tok = byte_level_tokenizer()

    def mistral(path: Path, layers: int) -> Path:
        cfg = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=2048,
                            sliding_window=4096, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id)
        torch.manual_seed(0)
        MistralForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
        return path

    write_fineweb_files(filler_documents(400, seed=0), root / "fineweb", n_files=2)
    write_recall_mc_tasks(root / "tasks", n_docs=8)
    # recipes that keep layers softmax (select-layers) get 4 layers, as the testbed's teacher
    return {"llama": save_tiny_llama(root / "llama"), "mistral": mistral(root / "mistral", 2),
            "llama4": save_tiny_llama(root / "llama4", num_layers=4),
            "mistral4": mistral(root / "mistral4", 4),
            "fineweb": root / "fineweb", "tasks": root / "tasks"}


def _selector(spec: dict) -> dict | None:
    """The recipe's select-layers stage (hedgecats.lightning_modules.LayerSelection), if any."""
    return next((st for st in spec["stages"]
                 if st["fit"]["model"]["class_path"].endswith("LayerSelection")), None)


def _base(spec: dict, assets: dict, family: str) -> str:
    return str(assets[family + ("4" if _selector(spec) else "")])


def _shrink_paper(spec: dict, assets: dict, accelerator: str) -> dict:
    base = _base(spec, assets, "mistral" if spec["name"].startswith("mistral") else "llama")
    seq, gbs = 128, 4
    for st in spec["stages"]:
        fit = st["fit"]
        args = fit["model"]["init_args"]
        args["model_name_or_path"] = base
        data = fit["data"]["init_args"]
        data.update(tokenizer=base, data_files=str(assets["fineweb"]), seq_len=seq,
                    global_batch_size=gbs,
                    micro_batch_size=2, tokens_per_epoch=gbs * seq, val_tokens=2 * seq)
        # one optimiser step per epoch: the per-epoch SSD schedules advance within the smoke run
        fit["trainer"].update(accelerator=accelerator, max_steps=STEPS, val_check_interval=1.0,
                              limit_val_batches=1, enable_progress_bar=False)
        if accelerator == "cpu":
            fit["trainer"]["precision"] = "32-true"
            args["torch_dtype"] = "float32"
    argv = spec["evaluate"]["argv"]
    out = []
    skip = {"--baseline", "--tasks"}
    it = iter(argv)
    for a in it:
        if a in skip:
            next(it)
            continue
        out.append(a)
    spec["evaluate"]["argv"] = out + ["--baseline", base, "--tasks", str(assets["tasks"]),
                                      "--limit", "4", "--retrieval-docs", "1",
                                      "--retrieval-distances", "8,40,200", "--quiet"] + \
        (["--device", "cpu", "--dtype", "float32"] if accelerator == "cpu" else [])
    return spec


def _shrink_testbed(spec: dict, assets: dict, accelerator: str) -> dict:
    spec["vars"].update(teacher=_base(spec, assets, "llama"), tasks=str(assets["tasks"]),
                        transfer_steps=STEPS, finetune_steps=STEPS)
    for st in spec["stages"]:
        fit = st["fit"]
        fit["data"]["init_args"].update(seq_len=256, far_min=100, far_max=200, num_train=32,
                                        num_val=4, num_test=8)
        fit["trainer"].update(accelerator=accelerator, enable_progress_bar=False,
                              val_check_interval=STEPS)
        if accelerator == "cpu":
            fit["trainer"]["precision"] = "32-true"
    for ev in spec["evaluate"]:
        if "data" in ev:
            ev["data"] = copy.deepcopy(spec["stages"][0]["fit"]["data"])
        if ev["kind"] == "command":
            ev["argv"] = [*ev["argv"], "--limit", "4"]
    return spec


def _run_recipe(path: Path, assets: dict, tmp_path: Path, accelerator: str) -> dict:
    spec = read_pipeline(path)  # its bases merged (extends:); references resolved below
    shrink = _shrink_testbed if path.parent.name == "testbed" else _shrink_paper
    spec = shrink(spec, assets, accelerator)
    cfg = tmp_path / path.name
    cfg.write_text(yaml.safe_dump(spec))
    out = tmp_path / "run"
    assert main(["pipeline", str(cfg), "--output", str(out)]) == 0
    for st in spec["stages"]:
        assert (out / st["name"] / "done").exists() and (out / st["name"] / "stage.pt").exists()
    finetune = next((st for st in spec["stages"] if st["name"] == "finetune"), None)
    if finetune and finetune["fit"]["model"]["init_args"].get("loss", "next_token") != "next_token":
        metrics = out / "finetune" / "logs" / "attempt_0" / "metrics.csv"
        assert "val/kl" in metrics.read_text().splitlines()[0]  # the teacher ran
    results = json.loads((out / "results.json").read_text())
    selector = _selector(spec)
    if selector is not None:  # stage 2 converts the layers the selector left hybrid
        from hedgecats.models.stage_files import converted_layers, read_stage

        chosen = json.loads((out / selector["name"] / "selection.json").read_text())
        keep = selector["fit"]["model"]["init_args"]["keep"]
        assert len(chosen["kept_softmax"]) == keep and len(chosen["layers"]) == 4 - keep
        final = read_stage(out / "finetune" / "stage.pt")
        assert final["hybrid_config"]["layers"] == chosen["layers"] == converted_layers(final)
    if path.parent.name == "testbed":
        final = next(e for e in results["evaluations"] if e.get("stage") == "finetune"
                     and e["kind"] == "recall")
        assert {"hybrid", "swa_only", "la_only", "softmax", "teacher"} <= set(final["results"])
        assert (out / "mc" / "results.json").exists()
    else:
        assert (out / "eval" / "results.json").exists()
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_runs_through_the_pipeline_on_gpu(path, assets, tmp_path):
    _run_recipe(path, assets, tmp_path, "gpu")


@pytest.mark.slow
@pytest.mark.parametrize("path", RECIPES, ids=_id)
def test_recipe_runs_through_the_pipeline_on_cpu(path, assets, tmp_path):
    _run_recipe(path, assets, tmp_path, "cpu")
