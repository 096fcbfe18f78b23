"""The testbed's tools on CPU: experiments.testbed (recover, report), experiments.testbed_legacy,
and the follow-up studies' measurements (experiments.gate_usage, gate_intervention,
testbed_branch_usage)."""

from __future__ import annotations

import argparse
import importlib
import io
import json
from pathlib import Path

import pytest
import torch


def _load(name: str):
    return importlib.import_module(f"experiments.{name}")


def _capture_jobs(tb, monkeypatch) -> dict:
    """Jobs ``tb`` would run, captured instead (``{name: command}``; each reported as rc 0)."""
    seen = {}

    def fake_jobs(jobs, n_parallel, logs):
        seen.update(jobs)
        return {n: {"rc": 0, "wall_s": 0.0} for n, _ in jobs}

    monkeypatch.setattr(tb, "_run_jobs", fake_jobs)
    return seen


def _printed_table(rows: dict) -> str:
    """What a pipeline prints: ``evaluation.recall.format_table`` through rich at 80 columns."""
    from hedgecats.evaluation.recall import format_table
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=80).print(format_table(rows, title="t"))
    return buf.getvalue()


def _row(far, near=0.4, loss=3.0):
    return {"lm_loss": loss, "near_loss": 1.0, "near_acc": near, "far_loss": 1.0, "far_acc": far,
            "acc_d150-233": far, "acc_d234-316": far, "acc_d317-400": far}


def test_recover_reads_the_printed_tables_back():
    tb = _load("testbed")
    final = {"teacher": _row(0.459), "hybrid": _row(0.336), "swa_only": _row(0.030),
             "swa_only (rescale)": _row(0.031), "la_only (la_span_all)": _row(0.286),
             "hybrid (overlap)": _row(0.2)}
    text = "noise\n" + _printed_table({"hybrid": _row(0.05)}) + "x\n" + _printed_table(final)
    tables = tb.tables_from_log(text)
    assert len(tables) == 2 and list(tables[1]) == list(final)
    for label, row in final.items():
        for key in ("lm_loss", "near_acc", "far_acc", "acc_d150-233"):
            assert tables[1][label][key] == pytest.approx(row[key], abs=5e-4), (label, key)


def test_recover_finds_legacy_runs_in_their_folder(tmp_path):
    """``--legacy-objective`` logs as ``legacy-<recipe>-s<S>.log`` into the shared logs folder
    and runs in ``<root>/legacy/<recipe>-s<S>``: recover must write the results there."""
    tb = _load("testbed")
    (tmp_path / "logs").mkdir()
    (tmp_path / "legacy" / "hedgecats-s1").mkdir(parents=True)
    table = _printed_table({"hybrid": _row(0.2), "swa_only": _row(0.03)})
    (tmp_path / "logs" / "legacy-hedgecats-s1.log").write_text(table + table)
    assert tb.main(["recover", "--root", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "legacy" / "hedgecats-s1" / "results.json").read_text())
    assert res["evaluations"][1]["results"]["hybrid"]["far_acc"] == pytest.approx(0.2, abs=5e-4)
    assert not (tmp_path / "legacy-hedgecats-s1").exists()


def test_report_means_and_spreads_over_seeds(tmp_path):
    tb = _load("testbed")
    for seed, (h, s) in enumerate(((0.30, 0.03), (0.40, 0.05))):
        run = tmp_path / f"hedgecats-s{seed}"
        run.mkdir()
        ev = [{"kind": "recall", "stage": "transfer", "results": {"hybrid": _row(0.05)}},
              {"kind": "recall", "stage": "finetune",
               "results": {"hybrid": _row(h), "swa_only": _row(s)}}]
        (run / "results.json").write_text(json.dumps({"evaluations": ev}))
    assert tb.main(["report", "--root", str(tmp_path), "--out", str(tmp_path / "r"),
                    "--no-plots"]) == 0
    agg = json.loads((tmp_path / "r" / "testbed.json").read_text())["aggregate"]["hedgecats"]
    assert agg["seeds"] == [0, 1]
    assert agg["far_acc"]["hybrid"]["mean"] == pytest.approx(0.35)
    assert agg["far_acc"]["hybrid"]["std"] == pytest.approx(0.0707107, rel=1e-5)
    assert agg["delta_la_far_recall"]["values"] == pytest.approx([0.27, 0.35])
    assert "| hedgecats (2) |" in (tmp_path / "r" / "testbed.md").read_text()


def test_report_names_the_ssd_window_and_its_delta_at_window_64(tmp_path):
    """An SSD run evaluated at its last phase's window (16) is labelled so, and its rows at the
    configured window 64 give a Delta_LA of their own (recall and multiple choice)."""
    tb = _load("testbed")
    run = tmp_path / "ssd_fixed-s0"
    (run / "mc").mkdir(parents=True)
    final = {"hybrid": _row(0.30), "swa_only": _row(0.02), "hybrid (window64)": _row(0.31),
             "swa_only (window64)": _row(0.03)}
    ev = [{"kind": "recall", "stage": "finetune", "window": 16, "results": final}]
    (run / "results.json").write_text(json.dumps({"evaluations": ev}))
    score = {"hybrid": (50.0, 60.0), "swa_only": (40.0, 30.0), "hybrid+window=64": (70.0, 55.0),
             "swa_only+window=64": (70.0, 28.0)}
    (run / "mc" / "results.json").write_text(json.dumps({"modes": {
        m: {"tasks": {"recall_mc_short_1": {"score": a}, "recall_mc_far": {"score": b}}}
        for m, (a, b) in score.items()}}))
    assert tb.main(["report", "--root", str(tmp_path), "--out", str(tmp_path / "r"),
                    "--no-plots"]) == 0
    agg = json.loads((tmp_path / "r" / "testbed.json").read_text())["aggregate"]["ssd_fixed"]
    assert agg["windows"] == [16]
    assert agg["delta_la_mc_short"]["values"] == [10.0]
    assert agg["delta_la_mc_short_w64"]["values"] == [0.0]
    assert agg["delta_la_mc_far_w64"]["values"] == [27.0]
    assert agg["delta_la_far_recall_w64"]["values"] == pytest.approx([0.28])
    md = (tmp_path / "r" / "testbed.md").read_text()
    assert "| ssd_fixed (1; window 16) |" in md and "Delta_LA at window 64" in md


def test_legacy_wrapper_restores_the_first_formulas(monkeypatch):
    """The before-run tool must compute the first version: the objective's clamps (0 loss for
    a row whose products are all below 1e-6, through the call the stage makes) and LA with no
    floor, normaliser clamped at 1e-6; the fused kernels, which carry today's floor, off."""
    from hedgecats.lightning_modules import stages
    from hedgecats.models import hybrid_attention
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.transfer import dispatch
    from hedgecats.models.ops.transfer import reference as transfer

    for mod, name in ((transfer, "_xent_block"), (backends, "ref_linear"),
                      (backends, "fla_linear"), (backends, "REFERENCE"),
                      (stages.AttentionTransfer, "_check_health")):
        monkeypatch.setattr(mod, name, getattr(mod, name))
    monkeypatch.setenv("HEDGECATS_TRITON", "1")  # restored after install() switches it off
    legacy = _load("testbed_legacy")
    legacy.install()
    try:
        assert not backends.triton_switched_on()
        B, H, T, D, F = 1, 2, 12, 4, 8
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
        fq = torch.full((B, H, T, F), 1e-5)
        fk = torch.full((B, H, T, F), 1e-5)
        fq[..., 0], fk[..., 1] = 1.0, 1.0
        fq2, fk2 = fq * 1e-4, fk  # products ~2e-9, row sums < 1e-6: the zero-loss region
        assert transfer.weights_xent(q, k, fq2, fk2, block=4) == 0.0
        assert dispatch.weights_xent(q, k, fq2, fk2, block=4) == 0.0  # transfer_loss's call
        out = hybrid_attention(q, k, v, fq2, fk2, window=1, mode="la_only", la_span="all",
                               rescale=True, backend="reference")
        a = (fq2 @ fk2.transpose(-1, -2)).tril()  # (B, H, T, T) products, no floor
        want = (a @ v) / a.sum(-1, keepdim=True).clamp_min(1e-6)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-7)
    finally:
        backends._cuda_ops.cache_clear()


def test_run_passes_seed_vars_and_overrides_to_every_pipeline():
    """``testbed.py run --set`` reaches each pipeline as ``hedgecats pipeline --set``; the legacy
    objective swaps the entry point for ``testbed_legacy.py``."""
    tb = _load("testbed")
    cmd = tb._pipeline_cmd(Path("c.yaml"), Path("out"), 2, {"teacher": "t"}, False,
                           ["stages.transfer.fit.model.init_args.max_den_collapsed=null"])
    assert cmd[1:] == ["-m", "hedgecats.cli", "pipeline", "c.yaml", "--output", "out",
                       "--seed", "2", "--var", "teacher=t",
                       "--set", "stages.transfer.fit.model.init_args.max_den_collapsed=null"]
    legacy = tb._pipeline_cmd(Path("c.yaml"), Path("out"), None, {}, True)
    assert legacy[1].endswith("testbed_legacy.py") and "--seed" not in legacy


def test_no_mc_config_and_the_mc_step_split_the_recipe(tmp_path):
    """``run --no-mc`` runs a recipe without its multiple-choice step (everything else as the
    recipe has it); ``mc`` later runs exactly that step's command, resolved for the run."""
    from hedgecats.pipeline.spec import load_pipeline

    tb = _load("testbed")
    recipe = tb.CONFIGS / "hedgecats.yaml"
    variables = {"teacher": tmp_path / "teacher", "tasks": tmp_path / "mc_tasks"}
    run = tmp_path / "hedgecats-s1"
    full = load_pipeline(recipe, output=run, seed=1, variables=variables)
    derived = tb._without_mc(recipe, tmp_path / "configs")
    cut = load_pipeline(derived, output=run, seed=1, variables=variables)
    assert [e["kind"] for e in full["evaluate"]] == ["recall", "recall", "command"]
    assert cut["evaluate"] == full["evaluate"][:2]
    assert cut["stages"] == full["stages"]
    cmd = tb.mc_command(recipe, run, variables, 1, "cpu")
    assert cmd[1:4] == ["-m", "hedgecats.cli", "evaluate"]
    args = cmd[4:]
    assert args[args.index("--model") + 1] == str(run / "finetune" / "stage.pt")
    assert args[args.index("--tasks") + 1] == str(tmp_path / "mc_tasks")
    assert args[args.index("--output") + 1] == str(run / "mc")
    assert args[-2:] == ["--device", "cpu"]


def test_mc_runs_the_step_for_finished_runs_that_lack_it(tmp_path, monkeypatch):
    """``testbed.py mc`` picks the runs whose stage 2 is done and whose multiple-choice result is
    missing (``--again``: those with one too), each with its recipe's own command."""
    tb = _load("testbed")
    for name, stage, mc in (("hedgecats-s0", True, False), ("hedgecats-s1", True, True),
                            ("ssd_fixed-s2", True, False), ("lolcats-s0", False, False),
                            ("notes-s0", True, False)):
        run = tmp_path / name
        (run / "finetune").mkdir(parents=True)
        if stage:
            (run / "finetune" / "stage.pt").write_bytes(b"")
        if mc:
            (run / "mc").mkdir()
            (run / "mc" / "results.json").write_text("{}")
    seen = _capture_jobs(tb, monkeypatch)
    assert tb.main(["mc", "--root", str(tmp_path), "--device", "cpu"]) == 0
    assert sorted(seen) == ["mc-hedgecats-s0", "mc-ssd_fixed-s2"]
    args = seen["mc-ssd_fixed-s2"]
    assert args[args.index("--model") + 1] == str(tmp_path / "ssd_fixed-s2/finetune/stage.pt")
    assert "hybrid+window=64" in args[args.index("--modes") + 1]  # the SSD recipe's own modes
    seen.clear()
    assert tb.main(["mc", "--root", str(tmp_path), "--again"]) == 0
    assert sorted(seen) == ["mc-hedgecats-s0", "mc-hedgecats-s1", "mc-ssd_fixed-s2"]


def test_report_plots_every_figure_with_few_recipes(tmp_path):
    """With plots: far recall and short multiple choice per mode, and the Delta_LA panels
    (the multiple-choice ones when the runs have them); valid PNGs even for one recipe."""
    tb = _load("testbed")
    for seed in (0, 1):
        run = tmp_path / f"lolcats_gate_lowrank-s{seed}"
        (run / "mc").mkdir(parents=True)
        ev = [{"kind": "recall", "stage": "finetune",
               "results": {"hybrid": _row(0.4), "swa_only": _row(0.03), "softmax": _row(0.45)}}]
        (run / "results.json").write_text(json.dumps({"evaluations": ev}))
        (run / "mc" / "results.json").write_text(json.dumps({"modes": {
            m: {"tasks": {"recall_mc_short_1": {"score": 60.0 + seed},
                          "recall_mc_far": {"score": a}}}
            for m, a in (("hybrid", 60.0), ("swa_only", 30.0), ("softmax", 59.0))}}))
    assert tb.main(["report", "--root", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    for name in ("far_recall.png", "short_mc.png", "delta_la.png"):
        data = (tmp_path / "r" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_gate_usage_reads_the_gates_of_a_converted_model():
    """experiments.gate_usage's measurement on a fresh gated conversion (gates start at the
    fixed g = 0.5 exactly) and its refusal of a mixer without a gate."""
    from hedgecats.models import HybridConfig, convert_to_hybrid
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments import gate_usage as gu

    class Tok:  # bytes as ids, as the testbed's byte-level tokenizer
        def __call__(self, text, return_tensors=None):
            return type("Enc", (), {"input_ids": torch.tensor([list(text.encode())])})()

    def model(mixer):
        torch.manual_seed(0)
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=48,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2))
        return convert_to_hybrid(m.eval(), HybridConfig(window=4, mixer=mixer))

    stats = gu.gate_stats(model("gate_lowrank"), Tok(), ["abc", "a longer prompt"], window=4)
    assert set(stats) == {0, 1}
    for s in stats.values():
        assert s["mean_g_first_window"] == pytest.approx(0.5)
        assert s["mean_g_beyond_window"] == pytest.approx(0.5)
        assert s["share_below_0.25"] == 0.0
    with pytest.raises(SystemExit, match="not an output gate"):
        gu.gate_stats(model("fixed"), Tok(), ["abc"], window=4)


def test_testbed_branch_usage_table_aggregates_seeds():
    from experiments import testbed_branch_usage as tbu

    measured = {f"/x/lolcats-s{s}": {"layers": [{"layer": 0, "la_share": [0.4 + s / 5] * 2},
                                                {"layer": 1, "la_share": [0.2, 0.2]}]}
                for s in (0, 1)}
    md = tbu.table(measured)
    assert "| recipe (seeds) | layer 0 | layer 1 | mean |" in md
    assert "| lolcats (2) | 0.50 ± 0.14 | 0.20 ± 0.00 | 0.35 ± 0.07 |" in md
    at_query = {f"/x/lolcats-s{s}": {0: {"la_share_last": 0.6, "la_share_other": 0.2 + s / 5},
                                     1: {"la_share_last": 0.4, "la_share_other": 0.2}}
                for s in (0, 1)}
    assert "| lolcats (2) | 0.50 ± 0.00 | 0.25 ± 0.07 |" in tbu.query_table(at_query)
    at_q = {f"/x/hedgecats-q0.1-s{s}": {"layers": [{"layer": 0, "la_share": [0.3]}]}
            for s in (0, 1)}
    assert "| hedgecats q=0.1 (2) | 0.30 ± 0.00 | 0.30 ± 0.00 |" in tbu.table(at_q)


def test_testbed_branch_usage_table_with_layers_kept_softmax():
    """Runs that keep different layers softmax (layer selection, one set per seed at random):
    a layer a run did not convert is no cell of it, and each run's mean is over its own layers."""
    from experiments import testbed_branch_usage as tbu

    def run(shares: dict[int, float]) -> dict:
        return {"layers": [{"layer": i, "la_share": [v]} for i, v in shares.items()]}

    measured = {"/x/hedgecats-q0-s0": run({0: 0.4, 1: 0.2}),
                "/x/hedgecats_keep1+random-q0-s0": run({1: 0.3}),
                "/x/hedgecats_keep1+random-q0-s1": run({0: 0.5})}
    md = tbu.table(measured)
    assert "| hedgecats q=0 (1) | 0.40 ± 0.00 | 0.20 ± 0.00 | 0.30 ± 0.00 |" in md
    assert "| hedgecats_keep1+random q=0 (2) | 0.50 (1 of 2) | 0.30 (1 of 2) | 0.40 ± 0.14 |" in md
    assert "| hedgecats_keep1 q=0 (1) | - | 0.30 ± 0.00 | 0.30 ± 0.00 |" in tbu.table(
        {"/x/hedgecats_keep1-q0-s0": run({1: 0.3})} | {"/x/hedgecats-q0-s0": run({0: 0.4})})


def test_gate_intervention_swaps_one_layers_mixer_and_restores_it():
    from hedgecats.models import HybridConfig, convert_to_hybrid, hybrid_layers
    from hedgecats.models.mixers import FixedMixer, OutputGateMixer
    from transformers import LlamaConfig, LlamaForCausalLM

    from experiments import gate_intervention as gi

    torch.manual_seed(0)
    model = convert_to_hybrid(LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval(),
        HybridConfig(window=4, mixer="gate_elementwise"))
    layers = dict(hybrid_layers(model))
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        before = model(x).logits
        with gi.constant_gate(model, 0, 0.5):
            assert isinstance(layers[0].mixer, FixedMixer) and layers[0].mixer.g == 0.5
            assert isinstance(layers[1].mixer, OutputGateMixer)
            during = model(x).logits  # a fresh gate is 0.5 everywhere: the same function
        assert isinstance(layers[0].mixer, OutputGateMixer)
        torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5)


def test_run_names_carry_the_share_q():
    tb = _load("testbed")
    assert tb.run_name("hedgecats", 2) == "hedgecats-s2"
    assert tb.run_name("ssd_fixed", 0, 0.1) == "ssd_fixed-q0.1-s0"
    assert tb.run_name("lolcats", 1, 0.0) == "lolcats-q0-s1"
    assert tb.parse_run_name("ssd_fixed-q0.1-s0") == ("ssd_fixed", 0.1, 0)
    assert tb.parse_run_name("lolcats_shared_norm-s12") == ("lolcats_shared_norm", None, 12)
    assert tb.parse_run_name("logs") is None
    assert tb.run_label("hedgecats", 0.5) == "hedgecats q=0.5"
    assert tb.split_label("hedgecats q=0.5") == ("hedgecats", 0.5)
    assert tb.shares("0,0.1,0.5") == [0.0, 0.1, 0.5]
    for bad in ("1.5", "-0.1", "a", "0.1,0.1", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct shares in"):
            tb.shares(bad)


def test_run_at_each_q_with_the_strong_teachers_filler(tmp_path, monkeypatch, capsys):
    """``run --q`` runs every recipe and seed at each share (``--var far_share``) into its own
    directory, and every recipe and the multiple-choice tasks get the teacher config's filler."""
    tb = _load("testbed")
    seen = _capture_jobs(tb, monkeypatch)
    args = ["run", "--root", str(tmp_path), "--teacher", str(tmp_path / "t"), "--mc-docs", "4",
            "--teacher-config", "teacher_strong", "--recipes", "hedgecats,lolcats",
            "--seeds", "0,1", "--q", "0,0.1,0.5"]
    assert tb.main(args) == 0
    assert len(seen) == 12 and "hedgecats-q0.1-s1" in seen and "lolcats-q0-s0" in seen
    cmd = seen["hedgecats-q0.1-s1"]
    assert cmd[cmd.index("--output") + 1] == str(tmp_path / "hedgecats-q0.1-s1")
    assert ["--var", "far_share=0.1"] == cmd[cmd.index("far_share=0.1") - 1:][:2]
    assert "filler=ab" in cmd and ["--seed", "1"] == cmd[cmd.index("--seed"):][:2]
    context = json.loads((tmp_path / "mc_tasks" / "recall_mc_far.jsonl").read_text()
                         .splitlines()[0])["context"]
    assert set(context) <= set("ab #?ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    seen.clear()
    assert tb.main(args[:-2]) == 0  # without --q: the earlier runs' names, no far_share
    assert sorted(seen) == ["hedgecats-s0", "hedgecats-s1", "lolcats-s0", "lolcats-s1"]
    assert not any("far_share" in " ".join(c) for c in seen.values())
    with pytest.raises(SystemExit, match="built with filler 'ab'"):  # one root per teacher
        tb.main(["run", "--root", str(tmp_path), "--teacher", "t", "--recipes", "hedgecats"])
    with pytest.raises(SystemExit) as exit_:
        tb.main([*args[:-1], "0,2"])
    assert exit_.value.code == 2 and "distinct shares in [0, 1]" in capsys.readouterr().err


def test_a_tagged_variant_gets_its_own_runs_rows_and_multiple_choice_step(tmp_path, monkeypatch,
                                                                         capsys):
    """``run --set ... --tag T`` runs ``<recipe>+T-...`` with the override (``--set`` without a
    tag is refused: its runs would take the recipe's own names); the report gives the variant
    its own row after the recipe's, and ``mc`` finds its recipe file."""
    tb = _load("testbed")
    assert tb.base_recipe("hedgecats_kl+mixed") == "hedgecats_kl"
    assert tb.parse_run_name("hedgecats_keep1+la_rel_err-q0-s2") == \
        ("hedgecats_keep1+la_rel_err", 0.0, 2)
    seen = _capture_jobs(tb, monkeypatch)
    override = "stages.finetune.fit.model.init_args.loss=mixed"
    args = ["run", "--root", str(tmp_path), "--teacher", str(tmp_path / "t"), "--mc-docs", "4",
            "--teacher-config", "teacher_strong", "--recipes", "hedgecats_kl", "--seeds", "0",
            "--q", "0", "--set", override]
    with pytest.raises(SystemExit, match="give it a --tag"):
        tb.main(args)
    assert tb.main([*args, "--tag", "mixed"]) == 0
    assert list(seen) == ["hedgecats_kl+mixed-q0-s0"]
    cmd = seen["hedgecats_kl+mixed-q0-s0"]
    assert cmd[cmd.index("--output") + 1] == str(tmp_path / "hedgecats_kl+mixed-q0-s0")
    assert ["--set", override] == cmd[cmd.index(override) - 1:][:2]
    assert cmd[cmd.index("pipeline") + 1].endswith("hedgecats_kl.yaml")
    with pytest.raises(SystemExit):
        tb.main([*args, "--tag", "Mixed-1"])
    assert "lower-case letters, digits and underscores" in capsys.readouterr().err
    for name, far in (("hedgecats_kl-q0-s0", 0.2), ("hedgecats_kl+mixed-q0-s0", 0.6),
                      ("hedgecats-q0-s0", 0.1)):
        run = tmp_path / name
        (run / "finetune").mkdir(parents=True)
        (run / "finetune" / "stage.pt").write_bytes(b"")
        ev = [{"kind": "recall", "stage": "finetune", "results": {"hybrid": _row(far)}}]
        (run / "results.json").write_text(json.dumps({"evaluations": ev}))
    assert tb.main(["report", "--root", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    agg = json.loads((tmp_path / "r" / "testbed.json").read_text())["aggregate"]
    assert list(agg) == ["hedgecats q=0", "hedgecats_kl q=0", "hedgecats_kl+mixed q=0"]
    assert agg["hedgecats_kl+mixed q=0"]["far_acc"]["hybrid"]["mean"] == pytest.approx(0.6)
    seen.clear()
    assert tb.main(["mc", "--root", str(tmp_path)]) == 0
    assert sorted(seen) == ["mc-hedgecats-q0-s0", "mc-hedgecats_kl+mixed-q0-s0",
                            "mc-hedgecats_kl-q0-s0"]


def test_every_recipe_runs_at_its_teachers_scale(tmp_path, monkeypatch):
    """A teacher config fixes the recipes' data scale and precision (``SCALE_VARS``): on
    ``teacher_tiny`` (the CPU scale) every recipe's data, hybrid window and trainer take it, on
    ``teacher`` they are the testbed's own (1,024 bytes, window 64); the teacher trains for its
    config's steps unless ``--teacher-steps`` says otherwise."""
    from hedgecats.pipeline.spec import load_pipeline

    tb = _load("testbed")
    tiny = tb.teacher_scale(tb.CONFIGS / "teacher_tiny.yaml")
    assert tiny == {"filler": "ab", "seq_len": 128, "window": 16, "far_min": 40, "far_max": 110,
                    "precision": "32-true"}
    assert tb.teacher_scale(tb.CONFIGS / "teacher.yaml")["seq_len"] == 1024
    for recipe in tb.RECIPES:
        for scale, (seq_len, window, precision) in ((tiny, (128, 16, "32-true")),
                                                    ({}, (1024, 64, "bf16-mixed"))):
            spec = load_pipeline(tb.CONFIGS / f"{recipe}.yaml", output=tmp_path / recipe,
                                 variables=scale)
            for st in spec["stages"]:
                fit = st["fit"]
                data = fit["data"]["init_args"]
                assert (data["seq_len"], data["window"]) == (seq_len, window), (recipe, st["name"])
                assert fit["trainer"]["precision"] == precision, (recipe, st["name"])
                hybrid = fit["model"]["init_args"].get("hybrid")
                if hybrid:
                    assert hybrid["window"] == window, (recipe, st["name"])
            for ev in spec["evaluate"]:
                if ev["kind"] == "recall":
                    assert ev["data"]["init_args"]["seq_len"] == seq_len, recipe
    seen = _capture_jobs(tb, monkeypatch)
    assert tb.main(["run", "--root", str(tmp_path / "r"), "--teacher-config", "teacher_tiny",
                    "--recipes", "lolcats", "--seeds", "0", "--mc-docs", "4", "--no-mc"]) == 0
    assert "--var" not in seen["teacher"]  # its config's 1,500 steps
    stamp = json.loads((tmp_path / "r" / "mc_tasks" / "tasks.json").read_text())
    assert {k: stamp[k] for k in tb.MC_SCALE} == {k: tiny[k] for k in tb.MC_SCALE}
    far = [json.loads(line) for line in
           (tmp_path / "r" / "mc_tasks" / "recall_mc_far.jsonl").read_text().splitlines()]
    assert all(40 <= r["distance"] <= 110 and len(r["context"]) < 128 for r in far)
    with pytest.raises(SystemExit, match="built with seq_len 128, window 16, far_min 40, "
                                         "far_max 110; this teacher's is seq_len 1024"):
        tb.main(["run", "--root", str(tmp_path / "r"), "--teacher-config", "teacher_strong",
                 "--recipes", "lolcats", "--seeds", "0", "--no-mc"])
    cmd = seen["lolcats-s0"]
    for var in ("seq_len=128", "window=16", "far_min=40", "far_max=110", "precision=32-true",
                "filler=ab"):
        assert ["--var", var] == cmd[cmd.index(var) - 1:][:2]
    run = tmp_path / "r" / "lolcats-s0"
    run.mkdir()
    ev = [{"kind": "recall", "stage": "finetune", "window": 16,
           "results": {"hybrid": _row(0.2), "swa_only": _row(0.04)}}]
    (run / "results.json").write_text(json.dumps({"evaluations": ev}))
    (tmp_path / "r" / "jobs.json").write_text(json.dumps({"teacher_config": "teacher_tiny"}))
    with pytest.raises(SystemExit, match="this teacher's is seq_len 1024"):  # mc: the same check
        tb.main(["mc", "--root", str(tmp_path / "r"), "--teacher-config", "teacher_strong"])
    stamp_file = tmp_path / "r" / "mc_tasks" / "tasks.json"  # tasks from before the stamp:
    stamp_file.unlink()  # the writer's defaults (letters a-z, the 1,024 scale)
    with pytest.raises(SystemExit, match="built with filler 'abcdefghijklmnopqrstuvwxyz'; this "
                                         "teacher's is filler 'ab'"):
        tb.main(["mc", "--root", str(tmp_path / "r"), "--teacher-config", "teacher_strong"])
    assert tb.main(["report", "--root", str(tmp_path / "r"), "--out", str(tmp_path / "rep"),
                    "--no-plots"]) == 0  # the headings name the runs' scale, from jobs.json
    md = (tmp_path / "rep" / "testbed.md").read_text()
    assert "distance 40-110; evaluated at window 16" in md and "distance 3-15" in md
    assert "150-400; evaluated" not in md
    assert json.loads((tmp_path / "rep" / "testbed.json").read_text())["scale"]["window"] == 16


def test_run_skips_finished_runs_unless_again(tmp_path, monkeypatch, capsys):
    """A run with a results.json is finished: ``run`` again leaves it alone, ``--again`` runs it
    with ``--reevaluate``."""
    tb = _load("testbed")
    seen = _capture_jobs(tb, monkeypatch)
    (tmp_path / "hedgecats-q0-s0").mkdir()
    (tmp_path / "hedgecats-q0-s0" / "results.json").write_text("{}")
    (tmp_path / "hedgecats-q0-s1").mkdir()  # started, not finished: it resumes
    args = ["run", "--root", str(tmp_path), "--teacher", str(tmp_path / "t"), "--mc-docs", "4",
            "--teacher-config", "teacher_strong", "--recipes", "hedgecats", "--seeds", "0,1",
            "--q", "0"]
    assert tb.main(args) == 0
    assert list(seen) == ["hedgecats-q0-s1"] and "--reevaluate" not in seen["hedgecats-q0-s1"]
    assert "1 finished runs skipped" in capsys.readouterr().out
    seen.clear()
    assert tb.main([*args, "--again"]) == 0  # the pipeline keeps a current results.json unless
    assert list(seen) == ["hedgecats-q0-s0", "hedgecats-q0-s1"]  # told to evaluate again
    assert all(cmd[-1] == "--reevaluate" for cmd in seen.values())


def test_report_gives_each_q_its_row_and_a_regime_table(tmp_path):
    tb = _load("testbed")
    far = {(0.0, 0): 0.10, (0.0, 1): 0.20, (0.5, 0): 0.80, (0.5, 1): 0.90}
    for (q, seed), h in far.items():
        run = tmp_path / tb.run_name("hedgecats", seed, q)
        run.mkdir()
        ev = [{"kind": "recall", "stage": "finetune",
               "results": {"hybrid": _row(h), "swa_only": _row(0.03), "la_only": _row(h / 2)}}]
        (run / "results.json").write_text(json.dumps({"evaluations": ev}))
    (tmp_path / "hedgecats-s0").mkdir()  # a run off the axis: its own row
    (tmp_path / "hedgecats-s0" / "results.json").write_text(json.dumps({"evaluations": [
        {"kind": "recall", "stage": "finetune", "results": {"hybrid": _row(0.4)}}]}))
    assert tb.main(["report", "--root", str(tmp_path), "--out", str(tmp_path / "r")]) == 0
    agg = json.loads((tmp_path / "r" / "testbed.json").read_text())["aggregate"]
    assert list(agg) == ["hedgecats", "hedgecats q=0", "hedgecats q=0.5"]
    assert agg["hedgecats q=0.5"]["far_acc"]["hybrid"]["mean"] == pytest.approx(0.85)
    assert agg["hedgecats q=0"]["far_acc"]["la_only"]["values"] == pytest.approx([0.05, 0.10])
    md = (tmp_path / "r" / "testbed.md").read_text()
    assert "### Regime" in md and "| hedgecats | 0.5 | 2 | 0.850 ± 0.071 | 0.425 ± 0.035 |" in md
    data = (tmp_path / "r" / "regime.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_data_check_counts_each_split_at_each_q(tmp_path, capsys):
    tb = _load("testbed")
    out = tmp_path / "data.json"
    assert tb.main(["data", "--recipe", "lolcats", "--teacher-config", "teacher_strong",
                    "--q", "0,0.5", "--set", "stages.*.fit.data.init_args.num_train=20",
                    "--set", "stages.*.fit.data.init_args.num_test=6",
                    "--set", "stages.*.fit.data.init_args.seq_len=512",
                    "--set", "stages.*.fit.data.init_args.far_max=300",
                    "--out", str(out)]) == 0
    assert "test documents identical across the shares: yes" in capsys.readouterr().out
    counts = json.loads(out.read_text())["shares"]
    assert counts["0"]["train"]["docs_with_far"] == counts["0"]["train"]["far_recalls"] == 0
    assert counts["0.5"]["train"]["docs_with_far"] == 10 and counts["0.5"]["val"][
        "docs_with_far"] == 8
    assert counts["0"]["test"] == counts["0.5"]["test"] and counts["0"]["test"]["far_recalls"]
    assert counts["0.5"]["train"]["filler_letters"] == 2  # the strong teacher's "ab"


def test_mixer_swap_reads_each_mixer_and_restores_the_trained_one(tmp_path, capsys):
    """experiments.mixer_swap: a stage read as trained, with the fixed mix and with la_mass, on
    the test split of the stage's own data; the model's mixers are its own again afterwards, and
    the fixed swap of a fixed-mixer stage reads exactly as trained."""
    import yaml
    from fixtures.tiny import save_tiny_llama
    from hedgecats.models import HybridConfig, hybrid_layers
    from hedgecats.models.mixers import FixedMixer
    from hedgecats.models.stage_files import build_hybrid, save_stage

    from experiments import mixer_swap as ms

    base = str(save_tiny_llama(tmp_path / "teacher"))
    hyb = HybridConfig(window=4, g=0.5)
    model = build_hybrid(base, hybrid_config=hyb)
    stage = save_stage(tmp_path / "run" / "transfer" / "stage.pt", model, base_model=base,
                       hybrid_config=hyb, stage="AttentionTransfer")
    data = {"seq_len": 64, "window": 4, "far_min": 20, "far_max": 40, "task": "marker",
            "filler": "ab", "num_train": 16, "num_val": 4, "num_test": 6, "batch_size": 2}
    (stage.parent / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"class_path": "hedgecats.lightning_modules.RecallDataModule",
                  "init_args": data}}))
    out = tmp_path / "swap.json"
    assert ms.main([str(stage), "--docs", "4", "--out", str(out)]) == 0
    assert torch.is_grad_enabled()  # (it left the caller's grad mode as it was)
    saved = json.loads(out.read_text())
    table = saved["stages"][str(stage)]
    assert set(table) == {"as_trained", "fixed", "la_mass"}
    assert table["fixed"] == table["as_trained"]
    assert table["la_mass"]["hybrid"] != table["fixed"]["hybrid"]
    # the swapped-in mixer reads as a model converted with it from the start (the same maps)
    from hedgecats.evaluation.recall import evaluate_recall

    direct = build_hybrid(base, hybrid_config=HybridConfig(window=4, mixer="la_mass"))
    rows = evaluate_recall(direct.eval(), ms.test_corpus(stage, 4), modes=ms.MODES,
                           batch_size=8)
    for mode in ms.MODES:
        for field in ms.FIELDS:
            assert table["la_mass"][mode][field] == pytest.approx(rows[mode][field], rel=1e-5,
                                                                  nan_ok=True), (mode, field)
    assert "mean ± std over 1 stage(s)" in capsys.readouterr().out
    with ms.swapped_mixer(model, "la_mass"):
        assert all(a.mixer.shared_norm == "la_mass" for _, a in hybrid_layers(model))
    assert all(isinstance(a.mixer, FixedMixer) for _, a in hybrid_layers(model))
    with pytest.raises(SystemExit):
        ms.main([str(stage), "--mixers", "gated"])
