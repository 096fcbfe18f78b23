"""Every pipeline YAML in configs/ parses, resolves, and instantiates through LightningCLI."""

import copy
from pathlib import Path

import pytest
from hedgecats.cli import load_pipeline
from hedgecats.pipeline.runner import build_cli, stage_config
from hedgecats.pipeline.validate import validate_pipeline

ROOT = Path(__file__).resolve().parents[1] / "configs"


def is_base(path: Path) -> bool:
    """A base that recipes extend, not runnable alone: named ``_*.yaml`` or in a ``base/``
    folder (README, "Recipes as bases")."""
    return path.name.startswith("_") or "base" in path.relative_to(ROOT).parts[:-1]


PIPELINES = sorted(p for p in ROOT.rglob("*.yaml") if not is_base(p))
BASES = sorted(p for p in ROOT.rglob("*.yaml") if is_base(p))
MODELS = ("mistral-7b", "llama3-8b", "llama3.1-8b")
RECIPES = ("lolcats", "inference_hybrid", "hedgecats", "hedgecats_kl", "ssd_dropout", "ssd_window",
           "ssd_fixed")


def test_every_model_and_recipe_has_a_pipeline():
    names = {p.relative_to(ROOT / "pipelines").as_posix() for p in PIPELINES
             if ROOT / "pipelines" in p.parents}  # other folders: testbed, gated-swa
    assert {f"{m}/{r}.yaml" for m in MODELS for r in RECIPES} | {"tiny.yaml"} <= names


def _id(p):
    return p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", PIPELINES, ids=_id)
def test_pipeline_parses_and_resolves(path, tmp_path):
    spec = load_pipeline(path, output=tmp_path)
    assert "${" not in str(spec)
    for stage in spec["stages"]:
        model = stage["fit"]["model"]
        assert model["class_path"].startswith("hedgecats.lightning_modules.")


# LightningCLI builds a parser per instance (about a second each on 2 cores): the default run
# instantiates the tiny pipeline and one model's recipes; the slow run all of them.
FAST = [p for p in PIPELINES if p.name == "tiny.yaml" or p.parent.name == "llama3-8b"]


@pytest.mark.parametrize("path", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow)
                                  for p in PIPELINES], ids=_id)
def test_pipeline_instantiates(path, tmp_path):
    spec = load_pipeline(path, output=tmp_path)
    for stage in spec["stages"]:
        cfg = stage_config(spec, stage, tmp_path / stage["name"], attempt=0)
        cfg = copy.deepcopy(cfg)
        cfg["trainer"]["accelerator"] = "cpu"  # the GPU configs are checked on CPU
        cfg["trainer"].pop("devices", None)
        cli = build_cli(cfg)
        assert type(cli.model).__name__ == stage["fit"]["model"]["class_path"].rsplit(".", 1)[-1]
        assert "${" not in str(cfg)


@pytest.mark.parametrize("path", [p if p in FAST else pytest.param(p, marks=pytest.mark.slow)
                                  for p in PIPELINES], ids=_id)
def test_pipeline_passes_dry_run_validation(path, tmp_path, monkeypatch):
    """What --dry-run checks (every stage's full config against the classes, the evaluate
    section). Local directories a recipe expects from elsewhere (the testbed's teacher and tasks,
    ``vars`` with a path) stand in as empty directories; hub ids are taken on trust."""
    from hedgecats.pipeline.spec import read_pipeline

    raw = read_pipeline(path)  # with its extends bases: their vars count too
    variables = {}
    for name, value in (raw.get("vars") or {}).items():
        if isinstance(value, str) and "/" in value and not Path(value).exists():
            (tmp_path / "vars" / name).mkdir(parents=True)
            variables[name] = str(tmp_path / "vars" / name)
    spec = load_pipeline(path, output=tmp_path / "run", variables=variables)
    validate_pipeline(spec, warn=lambda msg: None)


@pytest.mark.parametrize("model", MODELS)
def test_paper_hyperparameters(model):
    for recipe in RECIPES:
        spec = load_pipeline(ROOT / "pipelines" / model / f"{recipe}.yaml", output="/tmp/x")
        s1, s2 = (st["fit"] for st in spec["stages"])
        a1, a2 = s1["model"]["init_args"], s2["model"]["init_args"]
        assert a1["lr"] == 1e-2 and a2["lr"] == 1e-4
        assert a1["hybrid"]["window"] == 64 and a1["hybrid"]["g"] == 0.5
        assert a2["lora"]["r"] == 8 and a2["lora"]["lora_alpha"] == 16
        assert sorted(a2["lora"]["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
        assert a2["init_from"].endswith("/transfer/stage.pt")
        want = ("hybrid_output_mse", "rectangular") if recipe == "lolcats" else \
            ("weights_xent", "square")
        assert (a1["objective"], a1["hybrid"]["feature_projection"]) == want
        d = s1["data"]["init_args"]
        assert (d["seq_len"], d["global_batch_size"], d["tokens_per_epoch"]) == (1024, 64, 25_000_000)
        assert s2["trainer"]["max_epochs"] == \
            (1 if recipe in ("hedgecats", "hedgecats_kl", "inference_hybrid") else 5)
        assert a2.get("loss", "next_token") == ("kl" if recipe == "hedgecats_kl" else "next_token")
        callbacks = [c["class_path"].rsplit(".", 1)[-1] for c in s2["trainer"].get("callbacks", [])]
        if recipe.startswith("ssd_"):
            ssd = s2["trainer"]["callbacks"][0]["init_args"]
            assert callbacks == ["ScheduledSlidingWindowDropout"]
            assert ssd["schedule"] == recipe[4:]
        if recipe == "inference_hybrid":
            assert (a2["mode"], a2["la_span"]) == ("la_only", "all")
            assert "hybrid+overlap" in " ".join(spec["evaluate"]["argv"])


def test_stage_and_datamodule_hyperparameters_do_not_collide():
    """Lightning logs a LightningModule's and a DataModule's hyperparameters together and
    refuses to start when a name has two values ("Error while merging hparams"): HybridFinetune's
    ``mode`` (hybrid) against FineWebEduDataModule's ``mode`` (pack) stopped every paper recipe's
    stage 2 before step 1. No stage may share an argument name with a DataModule."""
    import inspect

    from hedgecats.data import FineWebEduDataModule
    from hedgecats.lightning_modules import (
        AttentionTransfer,
        HybridFinetune,
        RecallDataModule,
        TeacherPretraining,
    )

    for stage in (AttentionTransfer, HybridFinetune, TeacherPretraining):
        for dm in (FineWebEduDataModule, RecallDataModule):
            a = set(inspect.signature(stage.__init__).parameters) - {"self"}
            b = set(inspect.signature(dm.__init__).parameters) - {"self"}
            assert not a & b, (stage.__name__, dm.__name__, sorted(a & b))


def _bases_of(path: Path) -> set[Path]:
    import yaml

    named = (yaml.safe_load(path.read_text()) or {}).get("extends") or []
    out = set()
    for base in [named] if isinstance(named, str) else named:
        base = (path.parent / base).resolve()
        out |= {base, *_bases_of(base)}
    return out


def test_every_base_is_extended_by_a_recipe():
    """Bases are not runnable alone (test_pipeline_extends checks the recipes built on them);
    one that no recipe reaches would go untested."""
    reached = set().union(*(_bases_of(p) for p in PIPELINES))
    assert BASES and not [p for p in BASES if p.resolve() not in reached]
