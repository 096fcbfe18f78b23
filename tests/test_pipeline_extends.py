"""Pipeline files built on bases (``extends:``, issue 14 item 2): the merge rules, the errors, the
paper recipes resolving exactly as the one-file recipes did, and the run's saved ``config.yaml``
holding the merged config in full."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hedgecats.cli import load_pipeline, main
from hedgecats.pipeline.errors import ConfigError
from hedgecats.pipeline.spec import parse_overrides, read_pipeline

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "pipelines" / "tiny.yaml"
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "recipes_resolved.yaml"
BEFORE = yaml.safe_load(FIXTURE.read_text())


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def _stage(name: str, **init_args) -> dict:
    return {"name": name, "fit": {"model": {"class_path": "M", "init_args": init_args},
                                  "trainer": {"max_steps": 10, "callbacks": [{"class_path": "A"}]}}}


BASE = yaml.safe_dump({"name": "base", "vars": {"lr": 0.1, "hybrid": {"window": 64, "g": 0.5}},
                       "stages": [_stage("one", lr="${vars.lr}", hybrid="${vars.hybrid}", keep=1),
                                  _stage("two", hybrid="${vars.hybrid}", drop=None)],
                       "evaluate": {"kind": "command", "argv": ["--a", "1"], "stage": "two"}},
                      sort_keys=False)


# ----------------------------------------------------------------------------- the paper recipes
@pytest.mark.parametrize("recipe", sorted(BEFORE))
def test_paper_recipes_resolve_exactly_as_the_one_file_recipes(recipe, tmp_path, monkeypatch):
    """Every key of the resolved pipeline (stages, evaluate, name, output, seed...), key order
    included, as ``tests/fixtures/recipes_resolved.yaml`` holds it from the one-file recipes;
    ``vars`` (new: the bases' shared values) and ``source`` left out. The stage configs that
    ``config.yaml`` records are computed from these alone."""
    monkeypatch.chdir(tmp_path)
    spec = load_pipeline(CONFIGS / "pipelines" / recipe)
    spec.pop("source"), spec.pop("vars")
    text = yaml.safe_dump(spec, sort_keys=False).replace(str(tmp_path.resolve()), "<cwd>")
    now = yaml.safe_load(text)
    want = BEFORE[recipe]
    assert set(now) == set(want)  # the order of top-level keys is not recorded anywhere
    for key in want:
        assert yaml.safe_dump(now[key], sort_keys=False) == \
            yaml.safe_dump(want[key], sort_keys=False), key


def test_the_fixture_covers_every_paper_recipe():
    """Every recipe that was a one-file recipe is still there; those added later (issue 48:
    hedgecats_kl, hedgecats_keep1 / keep2; issue 49: hedgecats_la_mass) were written as deltas
    and have no one-file form."""
    recipes = {p.relative_to(CONFIGS / "pipelines").as_posix()
               for p in (CONFIGS / "pipelines").glob("*/*.yaml")
               if p.parent.name != "base" and not p.name.startswith("_")}
    assert set(BEFORE) <= recipes
    added = {r.split("/")[1] for r in recipes - set(BEFORE)}
    assert added <= {"hedgecats_kl.yaml", "hedgecats_keep1.yaml", "hedgecats_keep2.yaml",
                     "hedgecats_la_mass.yaml"}, added


def test_a_recipe_difference_is_a_few_lines():
    for path in (CONFIGS / "pipelines").glob("*/*.yaml"):
        if path.parent.name != "base" and not path.name.startswith("_"):
            keys = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
            assert len(keys) <= 3, path


# ----------------------------------------------------------------------------- merge rules
def test_mappings_merge_lists_replace_and_null_removes(tmp_path):
    _write(tmp_path, {"base.yaml": BASE, "child.yaml": """
extends: base.yaml
name: child
vars: {hybrid: {window: 32}, extra: 3}
stages:
- name: one
  fit:
    model: {init_args: {keep: null, new: 2}}
    trainer: {callbacks: [{class_path: B}]}
evaluate: {argv: [--b]}
"""})
    raw = read_pipeline(tmp_path / "child.yaml")
    assert "extends" not in raw and raw["name"] == "child"
    assert raw["vars"] == {"lr": 0.1, "hybrid": {"window": 32, "g": 0.5}, "extra": 3}
    one, two = raw["stages"]
    # inherited keys keep their place, new ones come after, null removed 'keep'
    assert list(one["fit"]["model"]["init_args"]) == ["lr", "hybrid", "new"]
    assert one["fit"]["trainer"] == {"max_steps": 10, "callbacks": [{"class_path": "B"}]}
    assert "drop" in two["fit"]["model"]["init_args"]  # a null in the bottom file is a value
    assert raw["evaluate"] == {"kind": "command", "argv": ["--b"], "stage": "two"}
    spec = load_pipeline(tmp_path / "child.yaml", tmp_path / "out")
    one, two = (st["fit"]["model"]["init_args"] for st in spec["stages"])
    assert one["hybrid"] == two["hybrid"] == {"window": 32, "g": 0.5}
    assert one["hybrid"] is not two["hybrid"]  # a ${vars.X} mapping is copied per use


def test_stages_merge_by_name_append_and_delete(tmp_path):
    _write(tmp_path, {"base.yaml": BASE, "child.yaml": """
extends: base.yaml
stages:
- name: three
  fit: {model: {class_path: N}}
- name: two
  fit: {trainer: {max_steps: 5}}
- name: one
  delete: true
"""})
    stages = read_pipeline(tmp_path / "child.yaml")["stages"]
    assert [st["name"] for st in stages] == ["two", "three"]
    assert stages[0]["fit"]["trainer"] == {"max_steps": 5, "callbacks": [{"class_path": "A"}]}
    assert stages[0]["fit"]["model"]["class_path"] == "M"


def test_later_bases_win_and_paths_are_relative_to_the_file_that_names_them(tmp_path):
    _write(tmp_path, {
        "recipes/base.yaml": BASE,
        "recipes/long.yaml": "extends: base.yaml\nstages: [{name: one, fit: {trainer: {max_steps: 99}}}]\n",
        "models/m/_model.yaml": "vars: {lr: 0.5}\n",
        "models/m/long.yaml": "extends: [../../recipes/long.yaml, _model.yaml]\nname: m-long\n",
        "models/m/both.yaml": "extends: [_model.yaml, ../../recipes/long.yaml]\n",
    })
    spec = load_pipeline(tmp_path / "models/m/long.yaml", tmp_path / "out")
    assert spec["name"] == "m-long" and spec["vars"]["lr"] == 0.5
    assert spec["stages"][0]["fit"]["model"]["init_args"]["lr"] == 0.5
    assert spec["stages"][0]["fit"]["trainer"]["max_steps"] == 99
    # the base listed last wins; a file without name: is named by its own stem
    spec = load_pipeline(tmp_path / "models/m/both.yaml", tmp_path / "out")
    assert spec["vars"]["lr"] == 0.1 and spec["name"] == "base"


def test_vars_set_seed_and_output_act_on_the_merged_file(tmp_path, monkeypatch):
    _write(tmp_path, {"base.yaml": BASE, "child.yaml": "extends: base.yaml\nname: child\n",
                      "nameless.yaml": "extends: base.yaml\nname: null\n"})
    spec = load_pipeline(tmp_path / "child.yaml", tmp_path / "out", seed=7, variables={"lr": 0.3},
                         overrides=parse_overrides(["stages.two.fit.trainer.max_steps=4",
                                                    "vars.hybrid.window=16"]))
    one, two = spec["stages"]
    assert one["fit"]["model"]["init_args"]["lr"] == 0.3
    assert two["fit"]["trainer"]["max_steps"] == 4 and one["fit"]["trainer"]["max_steps"] == 10
    assert one["fit"]["model"]["init_args"]["hybrid"]["window"] == 16
    assert two["fit"]["model"]["init_args"]["hybrid"]["window"] == 16
    assert one["fit"]["seed_everything"] == 7 and spec["seed"] == 7
    monkeypatch.chdir(tmp_path)
    spec = load_pipeline(tmp_path / "child.yaml")
    assert spec["output"] == str((tmp_path / "runs" / "child").resolve())  # relative to the cwd
    assert load_pipeline(tmp_path / "nameless.yaml")["name"] == "nameless"
    with pytest.raises(ConfigError, match=r"--var \['nope'\] not declared"):
        load_pipeline(tmp_path / "child.yaml", variables={"nope": 1})


def test_anchored_values_are_not_shared_between_stages():
    """``&data`` / ``*data`` in tiny.yaml: ``--set`` on one stage's copy leaves the others'."""
    spec = load_pipeline(TINY, "/tmp/unused", overrides=parse_overrides([
        "stages.finetune.fit.model.init_args.hybrid.window=8",
        "stages.teacher.fit.data.init_args.seq_len=64"]))
    fits = {st["name"]: st["fit"] for st in spec["stages"]}
    assert fits["finetune"]["model"]["init_args"]["hybrid"]["window"] == 8
    assert fits["transfer"]["model"]["init_args"]["hybrid"]["window"] == 16
    assert fits["teacher"]["data"]["init_args"]["seq_len"] == 64
    assert fits["transfer"]["data"]["init_args"]["seq_len"] == 128


@pytest.mark.parametrize("files,message", [
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: c.yaml\n", "c.yaml": "extends: b.yaml\n"},
     "extends cycle: {d}/a.yaml -> {d}/b.yaml -> {d}/c.yaml -> {d}/b.yaml"),
    ({"a.yaml": "extends: a.yaml\n"}, "extends cycle: {d}/a.yaml -> {d}/a.yaml"),
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "extends: [gone.yaml]\n"},
     ("no such pipeline file: '{d}/gone.yaml' (extends chain: {d}/a.yaml -> {d}/b.yaml -> "
     "{d}/gone.yaml)")),
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "stages: [\n"},
     "'{d}/b.yaml' is not valid YAML"),
    ({"a.yaml": "extends: b.yaml\n", "b.yaml": "[1, 2]\n"},
     ("'{d}/b.yaml' is not a mapping; a base is a mapping (extends chain: {d}/a.yaml -> "
     "{d}/b.yaml)")),
    ({"a.yaml": "extends: {x: 1}\n"}, "'{d}/a.yaml': extends takes a path or a list of paths"),
    ({"a.yaml": "extends: b.yaml\nstages: [{fit: {}}]\n", "b.yaml": BASE},
     "'{d}/a.yaml': stage 0 needs a 'name'"),
    ({"a.yaml": "extends: b.yaml\nstages: [{name: six, delete: true}]\n", "b.yaml": BASE},
     "cannot delete stage 'six': no inherited stage has that name; inherited: ['one', 'two']"),
    ({"a.yaml": "extends: b.yaml\nstages: [{name: one, delete: true, fit: {}}]\n", "b.yaml": BASE},
     "'delete: true' removes an inherited stage and takes no other keys"),
    ({"a.yaml": "extends: b.yaml\nstages: [{name: one}, {name: one}]\n", "b.yaml": BASE},
     "stage 'one' is named twice"),
    ({"a.yaml": "extends: b.yaml\nstages: {one: 1}\n", "b.yaml": BASE},
     "'stages' is a list (of stages merged by name)"),
])
def test_extends_errors_are_one_line_naming_the_chain(tmp_path, files, message):
    _write(tmp_path, files)
    with pytest.raises(ConfigError) as e:
        load_pipeline(tmp_path / "a.yaml", tmp_path / "out")
    text = str(e.value)
    assert message.format(d=tmp_path) in text and "\n" not in text


def test_a_base_alone_names_what_it_lacks():
    with pytest.raises(ConfigError, match=r"base/hedgecats.yaml': \$\{vars.base_model\} names no var"):
        load_pipeline(CONFIGS / "pipelines" / "base" / "hedgecats.yaml", "/tmp/unused")


# ----------------------------------------------------------------------------- the run's record
def test_saved_config_yaml_is_the_merged_config_in_full(tmp_path):
    """A pipeline built on tiny.yaml (its teacher stage only, a few steps): the stage's
    ``config.yaml`` is the merged, resolved config, not the few lines of the child file."""
    from hedgecats.pipeline.runner import stage_config

    (tmp_path / "child.yaml").write_text(f"""
extends: {TINY}
name: child
checkpoint_every_n_steps: 2
stages:
- name: transfer
  delete: true
- name: finetune
  delete: true
- name: teacher
  fit:
    model: {{init_args: {{hidden_size: 32, num_heads: 2, warmup_steps: 1}}}}
    data: {{init_args: {{seq_len: 64, window: 8, far_min: 20, far_max: 50, num_train: 16,
                        num_val: 4, num_test: 4, batch_size: 4}}}}
    trainer: {{max_steps: 2, val_check_interval: 2, enable_progress_bar: false}}
evaluate: null
""")
    out = tmp_path / "run"
    assert main(["pipeline", str(tmp_path / "child.yaml"), "--output", str(out)]) == 0
    saved = yaml.safe_load((out / "teacher" / "config.yaml").read_text())
    spec = load_pipeline(tmp_path / "child.yaml", out)
    assert [st["name"] for st in spec["stages"]] == ["teacher"]
    want = stage_config(spec, spec["stages"][0], out / "teacher", attempt=0)
    assert saved == want
    init = saved["model"]["init_args"]
    assert init["hidden_size"] == 32 and init["num_layers"] == 2 and init["lr"] == 6.0e-3
    assert saved["data"]["init_args"]["task"] == "marker"  # inherited from tiny.yaml
    assert "extends" not in str(saved) and "${" not in str(saved)
