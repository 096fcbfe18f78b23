"""Layer selection (hedgecats.selection, ``hedgecats select-layers``, the pipeline stage): the KL
score against a hand computation, a layer whose hybrid is its softmax scoring 0, the budget
rules, rankings and their stability, the hand-off to stage 2, and bad input refused early."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from fixtures.tiny import save_tiny_llama
from hedgecats.cli import main
from hedgecats.models import HybridConfig, convert_to_hybrid, hybrid_layers
from hedgecats.models.stage_files import converted_layers, read_stage, save_stage
from hedgecats.selection import (
    Budget,
    BudgetNotMetError,
    consensus,
    kendall_tau,
    kl_curve,
    load_stage_model,
    measure,
    rank,
    select_layers,
    stability,
    top_k_overlap,
    write_selected_stage,
)
from transformers import AutoModelForCausalLM

N_LAYERS = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny", num_layers=N_LAYERS))


def _converted(base: str, cfg: HybridConfig):
    model = AutoModelForCausalLM.from_pretrained(base)
    convert_to_hybrid(model, cfg)
    return model.eval()


def _batches(n: int = 2, B: int = 2, T: int = 40, pad: int = 0, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 200, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        if pad:
            mask[-1, -pad:] = 0  # the last sequence right-padded
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _stage(base: str, path, cfg: HybridConfig):
    model = _converted(base, cfg)
    return save_stage(path, model, base_model=base, hybrid_config=cfg, stage="AttentionTransfer")


# ----------------------------------------------------------------------------- the scores
def test_kl_score_matches_a_hand_computation(base):
    """Score (a) of layer i is KL(teacher || model with only layer i hybrid) per real token. By
    hand: the teacher is the unconverted transformers model, the student a model converted at
    layer i only (the same feature maps: they depend on the seed and the layer index alone),
    the KL summed in float64 over the real positions of a padded batch."""
    cfg = HybridConfig(window=4)
    model = _converted(base, cfg)
    batches = _batches(pad=7)
    got = measure(model, batches, ["kl"])
    assert got["tokens"] == sum(int(b["attention_mask"].sum()) for b in batches)
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    for i in range(N_LAYERS):
        alone = _converted(base, HybridConfig(window=4, layers=[i]))
        ours = dict(model.named_parameters())
        for name, p in alone.named_parameters():
            assert torch.equal(p, ours[name])
        total, count = 0.0, 0
        with torch.no_grad():
            for b in batches:
                t = plain(**b).logits.double()
                s = alone(**b).logits.double()
                p_t = torch.softmax(t, -1)
                kl = (p_t * (torch.log_softmax(t, -1) - torch.log_softmax(s, -1))).sum(-1)
                real = b["attention_mask"].bool()
                total += float(kl[real].sum())
                count += int(real.sum())
        assert got["values"]["kl"][i] == pytest.approx(total / count, rel=1e-4, abs=1e-9)
        assert got["values"]["kl"][i] > 1e-5


def test_kl_is_zero_for_a_layer_whose_hybrid_is_its_softmax(base):
    """Layer 1's window covers every key and its SWA weight g is 1: its hybrid is its softmax,
    and so is the model with only it hybrid. The others score well above it."""
    model = _converted(base, HybridConfig(window=4, g=1.0, layer_windows={1: 4096}))
    kl = measure(model, _batches(), ["kl"])["values"]["kl"]
    assert kl[1] < 1e-6
    assert min(kl[0], kl[2]) > 1e3 * max(kl[1], 1e-12)
    assert rank(kl)[-1] == 1
    curve = kl_curve(model, _batches(), [0, 2, 1], 2)  # layer 1 softmax or not: the same KL
    assert curve[0] > curve[1] > curve[2] >= 0 and curve[2] < 1e-6


def test_cheap_scores_and_random(base):
    model = _converted(base, HybridConfig(window=4))
    got = measure(model, _batches(), ["la_rel_err", "hybrid_rel_err", "la_share", "random"],
                  seed=3)["values"]
    for name in ("la_rel_err", "hybrid_rel_err"):
        assert all(v > 0 and math.isfinite(v) for v in got[name].values())
    assert all(0 < v < 1 for v in got["la_share"].values())  # fixed g 0.5: both branches
    again = measure(model, _batches(), ["random"], seed=3)["values"]["random"]
    assert got["random"] == again  # the control is reproducible from its seed


def test_too_short_held_out_sequences_are_refused(base):
    model = _converted(base, HybridConfig(window=64))
    with pytest.raises(ValueError, match="no longer than the hybrid window"):
        measure(model, _batches(T=40), ["kl"])


# ----------------------------------------------------------------------------- budget rules
def test_budget_rules():
    curve = [0.5, 0.2, 0.08, 0.05]
    assert Budget(keep=2).choose(curve) == 2
    assert Budget(kl_below=0.1).choose(curve) == 2        # the fewest below the target
    assert Budget(kl_below=0.6).choose(curve) == 0
    assert Budget(max_softmax=3).choose(curve) == 3       # at most 3: the lowest KL
    assert Budget(max_softmax=3).choose([0.5, 0.2, 0.2, 0.3]) == 1  # the fewest among equals
    assert Budget(kl_below=0.1, max_softmax=2).choose(curve[:3]) == 2
    with pytest.raises(BudgetNotMetError, match="cannot be met.*lowest 0.08 with 2"):
        Budget(kl_below=0.01, max_softmax=2).choose(curve[:3])
    assert Budget(keep=1).n_max(4) == 1 and Budget(kl_below=0.1).n_max(4) == 3
    assert Budget(kl_below=0.1, max_softmax=2).n_max(4) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({}, "name how many layers stay softmax"),
    ({"keep": 1, "kl_below": 0.1}, "choose keep .* or a budget"),
    ({"keep": -1}, "must be an integer >= 0"),
    ({"max_softmax": 1.5}, "must be an integer >= 0"),
    ({"kl_below": 0.0}, "cannot be met"),
    ({"kl_below": float("nan")}, "finite number"),
])
def test_budget_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


def test_budget_must_leave_a_layer_hybrid():
    Budget(keep=2).check(3)
    with pytest.raises(ValueError, match="keep=3 but the model converts 3 layers.*at most 2"):
        Budget(keep=3).check(3)
    with pytest.raises(ValueError, match="max_softmax=4"):
        Budget(max_softmax=4, kl_below=0.1).check(4)
    with pytest.raises(ValueError, match="converts one layer"):
        Budget(kl_below=0.1).check(1)


# ----------------------------------------------------------------------------- rankings
def test_rankings_agreement_and_stability():
    assert rank({0: 0.1, 1: 0.3, 2: 0.3, 3: 0.0}) == [1, 2, 0, 3]  # ties by index
    assert kendall_tau([0, 1, 2, 3], [0, 1, 2, 3]) == 1.0
    assert kendall_tau([0, 1, 2, 3], [3, 2, 1, 0]) == -1.0
    assert kendall_tau([0, 1, 2], [1, 0, 2]) == pytest.approx(1 / 3)  # 2 of 3 pairs agree
    assert top_k_overlap([0, 1, 2, 3], [1, 3, 0, 2], 2) == 0.5
    assert consensus([[0, 1, 2], [1, 0, 2], [0, 2, 1]]) == [0, 1, 2]
    st = stability([[0, 1, 2], [0, 1, 2], [2, 1, 0]], k=1)
    assert st["pairs"] == 3 and st["kendall_tau_min"] == -1.0
    assert st["kendall_tau_mean"] == pytest.approx((1 - 1 - 1) / 3)
    assert st["top_k_overlap_mean"] == pytest.approx(1 / 3)
    assert stability([[0, 1]], k=1) is None
    with pytest.raises(ValueError, match="different layers"):
        kendall_tau([0, 1], [0, 2])


# ----------------------------------------------------------------------------- selection
def test_select_layers_keeps_the_worst_and_hands_on_the_rest(base, tmp_path):
    cfg = HybridConfig(window=4, g=1.0, layer_windows={1: 4096})
    src = _stage(base, tmp_path / "s1.pt", cfg)
    model = _converted(base, cfg)
    sel = select_layers([lambda: model], _batches(), score="kl", budget=Budget(keep=1),
                        compare=["la_rel_err", "hybrid_rel_err", "random"])
    worst = rank(sel["scores"]["kl"])[0]
    assert sel["kept_softmax"] == [worst] and worst != 1
    assert sel["layers"] == [i for i in range(N_LAYERS) if i != worst]
    assert [p["softmax"] for p in sel["curve"]] == [[], [worst]]
    assert set(sel["agreement"]) == {"la_rel_err", "hybrid_rel_err", "random"}
    # the hand-off: the selected layers converted, the kept one plain softmax
    out = write_selected_stage(src, tmp_path / "sel" / "stage.pt", sel)
    payload = read_stage(out)
    assert payload["hybrid_config"]["layers"] == sel["layers"] == converted_layers(payload)
    assert payload["hybrid_config"]["layer_windows"] == ({1: 4096} if 1 in sel["layers"] else None)
    assert payload["meta"]["selection"]["kept_softmax"] == [worst]
    rebuilt, _ = load_stage_model(out)
    assert [i for i, _ in hybrid_layers(rebuilt)] == sel["layers"]
    # the KL target: the fewest worst layers below it; one the layers cannot reach
    target = sel["curve"][1]["kl"] * 1.001
    by_kl = select_layers([lambda: model], _batches(), score="kl",
                          budget=Budget(kl_below=target))
    assert by_kl["kept_softmax"] == [worst]
    with pytest.raises(BudgetNotMetError, match="cannot be met"):
        select_layers([lambda: model], _batches(), score="kl",
                      budget=Budget(kl_below=1e-12, max_softmax=1))
    with pytest.raises(ValueError, match="too small to score: 160 tokens"):
        select_layers([lambda: model], _batches(), score="kl", budget=Budget(keep=1),
                      min_tokens=1000)


def test_a_later_stage_converts_the_layers_init_from_converted(base, tmp_path):
    """Stage 2 without hybrid.layers converts those of its init_from (the selector's hand-off);
    a hand-set hybrid.layers among them takes their maps; one it never converted is refused."""
    from hedgecats.lightning_modules import HybridFinetune
    from hedgecats.models.structure import unwrap

    src = _stage(base, tmp_path / "s1.pt", HybridConfig(window=4))
    sel = {"layers": [0, 2], "kept_softmax": [1], "converted": [0, 1, 2], "score": "kl",
           "budget": {"keep": 1}}
    handed = write_selected_stage(src, tmp_path / "sel.pt", sel)
    m = HybridFinetune(base, hybrid={"window": 4}, init_from=str(handed))
    m.configure_model()
    assert [i for i, _ in hybrid_layers(unwrap(m.model))] == [0, 2]
    assert m.hybrid_config.layers == [0, 2]
    m = HybridFinetune(base, hybrid={"window": 4, "layers": [2]}, init_from=str(handed))
    m.configure_model()
    assert [i for i, _ in hybrid_layers(unwrap(m.model))] == [2]
    m = HybridFinetune(base, hybrid={"window": 4, "layers": [0, 1]}, init_from=str(handed))
    with pytest.raises(ValueError, match=r"feature maps for layers \[0, 2\] only; layers \[1\]"):
        m.configure_model()


# ----------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def seeds(base, tmp_path_factory):
    """Stage-1 checkpoints of two seeds (feature maps drawn from each seed; nothing trained)."""
    root = tmp_path_factory.mktemp("seeds")
    return [str(_stage(base, root / f"s{s}" / "stage.pt", HybridConfig(window=8, seed=s)))
            for s in (0, 1)]


def test_command_selects_reports_and_writes_the_hand_off(seeds, tmp_path, capsys):
    out = tmp_path / "sel"
    args = [seeds[0], "--output", str(out), "--keep", "1", "--tokens", "600", "--seq-len", "100",
            "--batch-size", "2"]
    assert main(["select-layers", *args]) == 0
    text = capsys.readouterr().out
    sel = json.loads((out / "selection.json").read_text())
    assert f"layers: {sel['layers']}" in text and "| layer | kl | rank |" in text
    assert len(sel["kept_softmax"]) == 1 and (out / "selection.png").stat().st_size > 0
    assert set(sel["agreement"]) == {"la_rel_err", "hybrid_rel_err", "la_share"}
    assert read_stage(out / "stage.pt")["hybrid_config"]["layers"] == sel["layers"]
    assert main(["select-layers", *args]) == 2  # an earlier selection is kept
    assert "--overwrite" in capsys.readouterr().err


def test_command_ranks_several_seeds_and_says_how_stable(seeds, tmp_path, capsys):
    out = tmp_path / "sel"
    assert main(["select-layers", *seeds, "--output", str(out), "--max-softmax", "1",
                 "--kl-below", "10", "--tokens", "600", "--seq-len", "100",
                 "--compare", "la_rel_err,random"]) == 0
    sel = json.loads((out / "selection.json").read_text())
    assert sel["kept_softmax"] == [] and len(sel["inputs"]) == 2  # KL below 10 at once
    assert set(sel["stability"]) == {"kl", "la_rel_err", "random"}
    assert -1 <= sel["stability"]["kl"]["kendall_tau_mean"] <= 1
    assert "Stability across the 2 inputs" in (out / "selection.md").read_text()
    assert not (out / "stage.pt").exists()  # several inputs: the layers, no hand-off


def test_command_scores_a_data_modules_validation_split(seeds, tmp_path, capsys):
    # (inline, and longer than a file name may be: it was taken for a path, Errno 36)
    data = json.dumps({"class_path": "hedgecats.lightning_modules.RecallDataModule",
                       "init_args": {"seq_len": 64, "window": 8, "far_min": 20, "far_max": 50,
                                     "num_val": 6, "batch_size": 4, "filler": "ab" * 100}})
    assert len(data) > 255
    out = tmp_path / "sel"
    assert main(["select-layers", seeds[0], "--output", str(out), "--keep", "1", "--data", data,
                 "--max-batches", "1", "--compare", "none"]) == 0
    sel = json.loads((out / "selection.json").read_text())
    assert sel["held_out"] == {"source": "RecallDataModule's validation split", "batches": 1,
                               "tokens": 256, "longest": 64}
    assert sel["compare"] == [] and sel["agreement"] == {}


@pytest.mark.parametrize("extra, code, message", [
    (["--keep", "3"], 2, "keep=3 but .* converts 3 layers"),
    (["--keep", "1", "--kl-below", "0.1"], 2, "choose keep"),
    (["--kl-below", "0"], 2, "cannot be met"),
    (["--keep", "1", "--min-tokens", "100000"], 2, "too small to score"),
    (["--kl-below", "1e-12", "--max-softmax", "1"], 1, "the budget cannot be met"),
    (["--keep", "1", "--compare", "la_rel"], 2, "not a score"),
])
def test_command_refuses_bad_input(seeds, tmp_path, capsys, extra, code, message):
    argv = ["select-layers", seeds[0], "--output", str(tmp_path / "o"), "--tokens", "400",
            "--seq-len", "100", *extra]
    assert main(argv) == code
    import re

    last = capsys.readouterr().err.strip().splitlines()[-1]  # after the loading bars, if any
    assert last.startswith("hedgecats select-layers: ") and re.search(message, last), last


def test_command_refuses_text_that_is_not_utf8(seeds, tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert main(["select-layers", seeds[0], "--output", str(tmp_path / "o"), "--keep", "1",
                 "--text", str(bad)]) == 2
    assert "not UTF-8" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the pipeline
DATA = {"class_path": "hedgecats.lightning_modules.RecallDataModule",
        "init_args": {"seq_len": 64, "window": 8, "far_min": 20, "far_max": 50, "num_train": 16,
                      "num_val": 8, "num_test": 8, "batch_size": 4}}
TRAINER = {"accelerator": "cpu", "max_steps": 2, "limit_val_batches": 1, "val_check_interval": 2,
           "num_sanity_val_steps": 0, "enable_progress_bar": False,
           "enable_model_summary": False, "logger": False}


def _pipeline(base: str, **select) -> dict:
    hybrid = {"window": 8}
    return {"name": "keep", "checkpoint_every_n_steps": 50, "stages": [
        {"name": "transfer", "fit": {
            "model": {"class_path": "hedgecats.lightning_modules.AttentionTransfer",
                      "init_args": {"model_name_or_path": base, "hybrid": hybrid}},
            "data": DATA, "trainer": TRAINER}},
        {"name": "select-layers", "fit": {
            "model": {"class_path": "hedgecats.lightning_modules.LayerSelection",
                      "init_args": {"init_from": "${stages.transfer}/stage.pt", "keep": 1,
                                    **select}},
            "data": DATA, "trainer": {"accelerator": "cpu", "max_epochs": 1, "logger": False,
                                      "enable_progress_bar": False}}},
        {"name": "finetune", "fit": {
            "model": {"class_path": "hedgecats.lightning_modules.HybridFinetune",
                      "init_args": {"model_name_or_path": base, "hybrid": hybrid, "lr": 1e-3,
                                    "init_from": "${stages.select-layers}/stage.pt"}},
            "data": DATA, "trainer": TRAINER}}]}


def _write(tmp_path, spec: dict, name: str = "p.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(path)


def test_pipeline_stage_selects_between_stage_1_and_stage_2(base, tmp_path, capsys):
    cfg = _write(tmp_path, _pipeline(base))
    out = tmp_path / "run"
    assert main(["pipeline", cfg, "--output", str(out)]) == 0
    sel = json.loads((out / "select-layers" / "selection.json").read_text())
    assert len(sel["kept_softmax"]) == 1 and sel["converted"] == list(range(N_LAYERS))
    assert {"selection.md", "selection.png", "stage.pt", "done"} <= \
        {p.name for p in (out / "select-layers").iterdir()}
    final = read_stage(out / "finetune" / "stage.pt")
    assert final["hybrid_config"]["layers"] == sel["layers"] == converted_layers(final)
    capsys.readouterr()
    assert main(["pipeline", cfg, "--output", str(out)]) == 0  # done: verified and skipped
    assert "select-layers: done, skipped" in capsys.readouterr().out


def test_pipeline_says_which_layers_a_stage_uses(base, tmp_path, capsys):
    spec = _pipeline(base)
    spec["stages"][2]["fit"]["model"]["init_args"]["hybrid"] = {"window": 8, "layers": [0, 1]}
    assert main(["pipeline", _write(tmp_path, spec), "--output", str(tmp_path / "r"),
                 "--dry-run"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("stage 'finetune' starts from stage 'select-layers' but sets hybrid.layers=[0, 1] "
            "by hand: it converts those layers, not the ones 'select-layers' selects") in out


@pytest.mark.parametrize("select, message", [
    ({"keep": 3}, r"select-layers.fit.model.init_args: keep=3 but stage 'transfer' \(every "
                  r"layer of .*config.json\) converts 3 layers"),
    ({"keep": None, "kl_below": 0.0}, "kl_below=0.0 cannot be met"),
    ({"kl_below": 0.1}, "choose keep"),
    ({"min_tokens": 4096}, "held-out set is too small to score: RecallDataModule's validation "
                           "split holds 512 tokens, min_tokens=4096"),
    ({"max_batches": 1, "min_tokens": 512}, "holds 256 tokens in max_batches=1"),
    ({"score": "kl_div"}, "score='kl_div' is not a score"),
])
def test_pipeline_refuses_a_bad_selection_before_anything_loads(base, tmp_path, capsys, select,
                                                                 message):
    import re

    spec = _pipeline(base, **select)
    args = spec["stages"][1]["fit"]["model"]["init_args"]
    for k in [k for k, v in args.items() if v is None]:
        del args[k]
    assert main(["pipeline", _write(tmp_path, spec), "--output", str(tmp_path / "r"),
                 "--dry-run"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(message, err), err


def test_pipeline_refuses_held_out_sequences_inside_the_window(base, tmp_path, capsys):
    spec = _pipeline(base)
    spec["stages"][1]["fit"]["data"] = {**DATA, "init_args": {**DATA["init_args"],
                                                               "seq_len": 8, "far_min": 1,
                                                               "far_max": 4, "window": 2,
                                                               "num_val": 64}}
    assert main(["pipeline", _write(tmp_path, spec), "--output", str(tmp_path / "r"),
                 "--dry-run"]) == 2
    assert "seq_len=8 is no longer than the hybrid window (8)" in capsys.readouterr().err


def test_extends_places_a_stage_after_an_inherited_one(base, tmp_path):
    from hedgecats.pipeline.errors import ConfigError
    from hedgecats.pipeline.spec import read_pipeline

    full = _pipeline(base)
    parent = {**full, "stages": [full["stages"][0], full["stages"][2]]}
    _write(tmp_path, parent, "parent.yaml")
    child = {"extends": "parent.yaml", "stages": [{**full["stages"][1], "after": "transfer"}]}
    spec = read_pipeline(_write(tmp_path, child, "child.yaml"))
    assert [s["name"] for s in spec["stages"]] == ["transfer", "select-layers", "finetune"]
    assert "after" not in spec["stages"][1]
    bad = {"extends": "parent.yaml", "stages": [{**full["stages"][1], "after": "transfr"}]}
    with pytest.raises(ConfigError, match="after='transfr' names no stage before it"):
        read_pipeline(_write(tmp_path, bad, "bad.yaml"))
    moved = {"extends": "parent.yaml", "stages": [{"name": "finetune", "after": "transfer"}]}
    with pytest.raises(ConfigError, match="inherited and keeps its place"):
        read_pipeline(_write(tmp_path, moved, "moved.yaml"))
