"""The GPU benchmark scripts run end to end on CPU in their ``--tiny`` smoke modes and write the
JSON, markdown and summary keys the issues name (the numbers themselves mean nothing on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def test_stage_speed_blocked_row_runs_the_blocked_xent():
    """The ``[blocked]`` row must not take the fused kernel that ``transfer_loss`` picks by
    itself on CUDA (it did until 2026-12-02: the row measured the fused kernel twice)."""
    import importlib.util

    from hedgecats.models.ops.transfer import losses as transfer
    from hedgecats.models.ops.transfer import xent as triton_xent

    spec = importlib.util.spec_from_file_location("stage_speed", ROOT / "benchmarks" / "stage_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    fused = triton_xent.weights_xent
    assert fused is not transfer.weights_xent
    with bench.blocked_xent():
        assert triton_xent.weights_xent is transfer.weights_xent
    assert triton_xent.weights_xent is fused


def test_stage_speed_recomputed_rows_switch_the_kernel_config():
    """The ``[recomputed]`` rows run the fused kernel's default tiles with save_branches off
    (a kernel call takes ``default_config`` at call time), and only inside the row."""
    import importlib.util

    import torch
    from hedgecats.models.ops.hybrid import kernels as triton_hybrid

    spec = importlib.util.spec_from_file_location("stage_speed", ROOT / "benchmarks" / "stage_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    default = triton_hybrid.default_config(128, 256, torch.bfloat16)
    assert default.save_branches
    with bench.recomputed_branches():
        cfg = triton_hybrid.default_config(128, 256, torch.bfloat16)
        assert not cfg.save_branches and cfg == default.__class__(**{**default.__dict__,
                                                                     "save_branches": False})
    assert triton_hybrid.default_config(128, 256, torch.bfloat16) == default


def test_stage_speed_t4k_ratio_only_from_a_4k_run():
    """``transfer_vs_lolcats_T4k`` is the ratio at 4k or None: a run of ``--seq-lens 1024``
    wrote its 1k ratio under the key (2.30 where 4k gives ~5.9, 2026-12-02)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stage_speed", ROOT / "benchmarks" / "stage_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [{"name": n, "T": T, "tokens_per_s": tps, "peak_gib": 1.0}
            for n, T, tps in [("transfer/hybrid_output_mse", 1024, 2.0),
                              ("transfer/lolcats_tt", 1024, 1.0),
                              ("transfer/hybrid_output_mse", 4096, 6.0),
                              ("transfer/lolcats_tt", 4096, 1.0)]]
    assert bench.ratios(rows, 1024, 4096)["transfer_vs_lolcats_T4k"] == 6.0
    assert bench.ratios(rows[:2], 1024, None)["transfer_vs_lolcats_T4k"] is None


def test_lightning_gap_tiny(tmp_path):
    """benchmarks/lightning_gap.py (stage 1 through Lightning against the stage harness) on CPU:
    a Lightning row, a harness row with the kernels off, and a reading that needs both."""
    _run("lightning_gap.py", "--tiny", "--only", "L0,L3,S2", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "lightning_gap.json").read_text())
    assert list(res["rows"]) == ["L0", "S2", "L3"]
    for r in res["rows"].values():
        assert "error" not in r, r.get("traceback")
        assert r["tokens_per_s"] > 0 and len(r["steps_s"]) == res["steps"]
    assert res["rows"]["L0"]["strategy"] == "ModelParallelStrategy"
    md = (tmp_path / "lightning_gap.md").read_text()
    assert "| L0 |" in md and "Lightning's cost at HEAD (L0 - S2)" in md


def test_stage_speed_tiny(tmp_path):
    _run("stage_speed.py", "--tiny", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "stage_speed.json").read_text())
    names = {(r["name"], r["T"]) for r in res["rows"]}
    for T in (32, 64):
        for name in ("teacher_forward", "transfer/hybrid_output_mse", "transfer/lolcats_tt",
                     "finetune/hybrid", "finetune/softmax"):
            assert (name, T) in names, (name, T)
    assert ("transfer/weights_xent [blocked]", 32) in names
    assert ("transfer/la_output_mse", 32) in names
    errors = [r for r in res["rows"] if "error" in r]
    assert not errors, errors
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("transfer_xent_vs_teacher_forward", "transfer_mse_vs_teacher_forward",
                "lora_vs_softmax_lora", "transfer_vs_lolcats_T4k"):
        assert summary[key] > 0, key
    for key in ("transfer_peak_gib_over_teacher", "scaling_efficiency_transfer_2gpu",
                "scaling_efficiency_lora_2gpu", "gpu", "date"):
        assert key in summary
    assert "| finetune/softmax |" in (tmp_path / "stage_speed.md").read_text()


def test_attention_speed_tiny(tmp_path):
    _run("attention_speed.py", "--tiny", "--shapes", "2x64", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "attention_speed.json").read_text())
    cases = {r["case"] for r in res["rows"]}
    assert {"teacher", "teacher fwd", "swa", "hybrid fixed", "hybrid learned_head",
            "hybrid shared_norm", "hybrid fixed fwd", "lolcats T x T fixed",
            "lolcats T x T shared_norm"} <= cases
    errors = [r for r in res["rows"] if "error" in r]
    assert not errors, errors
    for r in res["rows"]:
        if "check" in r:  # bf16 on CPU against the fp32 oracle
            assert max(r["check"]["rel_err"].values()) < 2.5e-2, r
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("layer_vs_teacher_T1k", "layer_vs_teacher_T64k", "layer_fwd_vs_teacher_T1k",
                "layer_mem_vs_swa_T64k", "layer_vs_lolcats_T4k", "gpu", "date"):
        assert key in summary
    assert (tmp_path / "attention_speed.png").stat().st_size > 10_000  # drawn with every report


def test_attention_speed_plot_from_the_committed_measurement(tmp_path):
    """--plot redraws the figure of docs/performance.md from a results JSON, fwd rows of the
    bracketed cases ("hybrid fixed fwd [pytorch phi]") included."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_speed",
                                                  ROOT / "benchmarks" / "attention_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    src = ROOT / "benchmarks" / "results" / "speed_h200" / "attention_speed.json"
    assert bench.main(["--plot", str(src), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "attention_speed.png").stat().st_size > 10_000
    lines = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.plot

    def spy(self, *args, **kw):
        lines.append(kw.get("label"))
        return orig(self, *args, **kw)

    matplotlib.axes.Axes.plot = spy
    try:
        bench.plot(json.loads(src.read_text()), tmp_path / "again.png")
    finally:
        matplotlib.axes.Axes.plot = orig
    assert "hybrid fixed [pytorch phi] (fwd)" in lines and "teacher (fwd+bwd)" in lines


def test_attention_speed_rows_collect_garbage_before_their_peak(monkeypatch):
    """bench_adaptive runs the cyclic garbage collector before it takes a row's memory base and
    peak: the 2026-12-02 64k rows checked against the pieces read 21.59 GiB, the unchecked row of
    the same layer 8.09 (the check's tensors, held in a reference cycle until collected)."""
    import gc
    import importlib.util
    import weakref

    import torch

    spec = importlib.util.spec_from_file_location("attention_speed",
                                                  ROOT / "benchmarks" / "attention_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEVICE", "cpu")

    class Holder:  # a cycle holding a tensor, as a frame / traceback pair would
        pass
    h = Holder()
    h.self, h.t = h, torch.zeros(4)
    alive = weakref.ref(h.t)
    del h
    gc.disable()  # so that only an explicit collection frees it
    try:
        assert alive() is not None
        bench.bench_adaptive(lambda: None, budget_ms=1.0)
        assert alive() is None
    finally:
        gc.enable()


def test_gpu_tests_report_renders_both_row_formats(tmp_path):
    """One report folder gets rows from the backend matrix and from the fused-kernel tests
    (the GPU call of 2026-12-02 crashed on a kernel row's missing 'backend', a later one on a
    row's missing 'case'): both tables."""
    errs = {n: 1e-3 for n in ("out", "dq", "dk", "dv", "dWq", "dWk")}
    rows = [{"case": "hybrid", "dtype": "torch.bfloat16", "shape": [2, 8, 2, 300, 128, 64],
             "backend": "fla", "vs_reference_same_dtype": errs, "vs_fp32_oracle": errs,
             "reference_same_dtype_vs_oracle": errs},
            {"test": "hybrid", "case": "shared_norm", "shape": "B2-H8-Hkv2-T300-D128-w64-F256",
             "dtype": "torch.bfloat16", "fused_calls": 1, "vs_reference_same_dtype": errs,
             "vs_fp32_oracle": errs, "triton_errors": [], "tile_retries": [], "seconds": 1.0},
            # the saved-branches rows of 2026-12-02's sixth session had no case / shape / dtype
            # (KeyError 'case'): such a row still renders
            {"test": "saved_branches", "shared": False, "frozen": True,
             "saved_vs_fp32": errs}]
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests_report.py"),
                          str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "## Backend matrix (tests/test_backends_gpu.py): 1 cases" in out
    assert "## Fused kernels (tests/test_triton_kernels.py): 2 cases" in out
    assert "| fla | bfloat16 | 1.0e-03 |" in out and "| hybrid | shared_norm |" in out


def test_gpu_tests_report_without_a_report_folder(tmp_path):
    """Tests that write no rows leave no report folder (session 11's first GPU call: the
    script crashed with FileNotFoundError after the tests had passed): it says so instead."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_tests_report.py"),
                          str(tmp_path / "missing")], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "no case reports"


def test_paper_budget_from_the_committed_measurements(tmp_path):
    """benchmarks/paper_budget.py on the committed stage throughputs: every recipe, hours that
    follow from tokens / (tokens/s), and the eight-GPU extrapolation from the 2-GPU efficiency."""
    out = tmp_path / "budget"
    _run("paper_budget.py", "--out", str(out), cwd=ROOT)
    res = json.loads(Path(f"{out}.json").read_text())
    rows = {r["recipe"]: r for r in res["rows"]}
    assert set(rows) == {"lolcats", "inference_hybrid", "hedgecats", "ssd_dropout", "ssd_window",
                         "ssd_fixed"}
    xent = res["throughputs"]["weights_xent"][1]
    lora = res["throughputs"]["hybrid"][1]
    h = rows["hedgecats"]
    assert abs(h["stage1_h_1gpu"] - 25e6 / xent / 3600) < 1e-9
    assert abs(h["total_h_1gpu"][0] - (25e6 / xent + 25e6 / lora) / 3600) < 1e-9
    eff = res["scaling_2gpu"]
    assert abs(h["total_h_8gpu"][0] - (25e6 / xent / (8 * eff["transfer"])
                                       + 25e6 / lora / (8 * eff["finetune"])) / 3600) < 1e-9
    assert rows["ssd_dropout"]["stage2_epochs"] == [5, 5]
    # through Lightning: each recipe's own stage-1 objective where it was measured (lolcats:
    # the output MSE), the newest stage 2
    light = res["lightning_1gpu_tokens_per_s"]
    assert rows["lolcats"]["stage1_lightning_objective"] == "hybrid_output_mse"
    assert rows["hedgecats"]["stage1_lightning_objective"] == "weights_xent"
    for recipe, objective in (("lolcats", "hybrid_output_mse"), ("hedgecats", "weights_xent")):
        lo = rows[recipe]["stage2_epochs"][0]
        want = (25e6 / light["transfer"][objective] + lo * 25e6 / light["finetune"]) / 3600
        assert abs(rows[recipe]["total_h_1gpu_lightning"][0] - want) < 1e-9


def test_gate_usage_reads_the_gates_of_a_converted_model():
    """benchmarks/gate_usage.py's measurement on a fresh gated conversion (gates start at the
    fixed g = 0.5 exactly) and its refusal of a mixer without a gate."""
    import importlib.util

    import pytest
    import torch
    from hedgecats.models import HybridConfig, convert_to_hybrid
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("gate_usage", ROOT / "benchmarks" /
                                                  "gate_usage.py")
    gu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gu)

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
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tbu", ROOT / "benchmarks" / "testbed_branch_usage.py")
    tbu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tbu)
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


def test_gate_intervention_swaps_one_layers_mixer_and_restores_it():
    import importlib.util

    import torch
    from hedgecats.models import HybridConfig, convert_to_hybrid, hybrid_layers
    from hedgecats.models.mixers import FixedMixer, OutputGateMixer
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("gi", ROOT / "benchmarks" /
                                                  "gate_intervention.py")
    gi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gi)
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


def test_paper_budget_takes_the_lightning_figures_of_the_files_named(tmp_path):
    """A --multigpu file of one's own gives the Lightning column its one-GPU figures (the
    committed newer run does not override a file the user named)."""
    mg = {"world_sizes": {"1": {"attention_transfer": {"tokens_per_s": 10_000},
                                "hybrid_finetune": {"tokens_per_s": 5_000}},
                          "2": {"attention_transfer": {"scaling_efficiency": 0.9},
                                "hybrid_finetune": {"scaling_efficiency": 0.9}}}}
    (tmp_path / "mg.json").write_text(json.dumps(mg))
    out = tmp_path / "budget"
    _run("paper_budget.py", "--multigpu", str(tmp_path / "mg.json"), "--lightning-gap",
         "--out", str(out), cwd=ROOT)
    res = json.loads(Path(f"{out}.json").read_text())
    assert res["lightning_1gpu_tokens_per_s"]["transfer"] == {"weights_xent": 10_000}
    assert res["lightning_1gpu_tokens_per_s"]["finetune"] == 5_000
    assert res["scaling_2gpu"] == {"transfer": 0.9, "finetune": 0.9}


def test_attention_speed_ratios_in_device_time(monkeypatch):
    """The issue's time ratios from each row's GPU time with the host ahead (``device_ms``),
    beside the event timings: the 8 x 1k layer is host-bound, its event ratio read 2.85x and
    4.09x with one code on two machines (2026-12-03), its device time 3.3x on both. The memory
    ratio is the same in both; a row without a device time (the CPU) gives no ratio."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("attention_speed",
                                                  ROOT / "benchmarks" / "attention_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [dict(B=8, T=1024, case="teacher", ms=1.0, device_ms=0.73, peak_gib=1.0),
            dict(B=8, T=1024, case="hybrid fixed", ms=2.86, device_ms=2.4, peak_gib=2.0),
            dict(B=8, T=1024, case="teacher fwd", ms=0.2, device_ms=None, peak_gib=1.0),
            dict(B=8, T=1024, case="hybrid fixed fwd", ms=0.8, device_ms=0.66, peak_gib=1.0),
            dict(B=1, T=65536, case="swa", ms=9.0, device_ms=8.8, peak_gib=6.0),
            dict(B=1, T=65536, case="hybrid fixed", ms=20.0, device_ms=19.7, peak_gib=8.0)]
    events = bench.ratios(rows)
    device = bench.ratios(rows, time_key="device_ms")
    assert events["layer_vs_teacher_T1k"] == 2.86 and device["layer_vs_teacher_T1k"] == round(
        2.4 / 0.73, 4)
    assert events["layer_fwd_vs_teacher_T1k"] == 4.0 and device["layer_fwd_vs_teacher_T1k"] is None
    assert events["layer_mem_vs_swa_T64k"] == device["layer_mem_vs_swa_T64k"] == round(8 / 6, 4)
    monkeypatch.setattr(bench, "DEVICE", "cpu")  # (--tiny: no device time to take)
    assert bench.device_ms(lambda: None, 1.0) == {"device_ms": None, "host_ahead": None}


def test_kernel_anatomy_refuses_unknown_configs_and_tables_its_rows(tmp_path):
    """kernel_anatomy.py (GPU only) names what it does not know before touching a GPU, and its
    markdown puts every kernel of every config / branch set in one table per phase, a failed
    row as its error."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_anatomy.py"),
                           "--configs", "default,nope"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "unknown config 'nope'" in proc.stderr, proc.stderr[-1500:]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_anatomy.py"),
                           "--heads", "28", "--kv-heads", "8"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "not a multiple of --kv-heads 8" in proc.stderr, \
        proc.stderr[-1500:]
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_anatomy.py"),
                           "--configs", "default,dv32", "--branches", "hybrid,layer"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "--configs default alone" in proc.stderr, \
        proc.stderr[-1500:]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_anatomy as ka
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert set(ka.BRANCHES) == {"hybrid", "swa", "la"} and ka.LAYER == "layer"
    # a layer row with the default tiles changed (a default switch off), and only inside it
    import torch
    assert ka.th.default_config(128, 256, torch.bfloat16).fuse_q_side
    with ka.default_tiles_changed(ka.LAYER_CHANGES["layer-no-fuse-q"]):
        got = ka.th.default_config(128, 256, torch.bfloat16)
        assert not got.fuse_q_side and got.fuse_kv_side
    assert ka.th.default_config(128, 256, torch.bfloat16).fuse_q_side
    rows = [{"config": "default", "branches": "hybrid", "forward_device_ms": 0.34,
             "forward_kernels": {"_fwd": 0.28, "_state_fwd": 0.05},
             "fwd_bwd_device_ms": 1.6, "fwd_bwd_kernels": {"_fwd": 0.31, "_bwd_dq": 0.24}},
            {"config": "st128", "branches": "hybrid", "rel_err_vs_first_config": 0.0,
             "forward_device_ms": 0.33, "forward_kernels": {"_fwd": 0.28},
             "fwd_bwd_device_ms": 1.55, "fwd_bwd_kernels": {"_bwd_dq": 0.24}},
            {"config": "fc128", "branches": "la", "error": "OutOfResources: shared memory"}]
    md = ka.markdown({"environment": {"gpu": "g", "date": "d", "torch": "t", "triton": "x"},
                      "command": "c", "calls": 10, "heads": 28, "kv_heads": 4, "head_dim": 128,
                      "window": 64, "shapes": [{"B": 8, "T": 1024, "rows": rows}]})
    assert "H 28 / Hkv 4 / D 128, window 64" in md
    assert md.count("| kernel | default / hybrid | st128 / hybrid | fc128 / la |") == 2
    assert "| `_state_fwd` | 0.050 | 0.000 | 0.000 |" in md
    assert "| `_bwd_dq` | 0.240 | 0.240 | 0.000 |" in md
    assert "OutOfResources: shared memory" in md and "st128 / hybrid: 0.0e+00" in md


def test_kernel_anatomy_splits_a_kernel_launched_twice_a_call():
    """A kernel launched twice a call (``_bwd_dkv_la``: its dfk, then its dv launch) gets a row
    per launch, in launch order, device ms per call; kernels launched once keep their name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_anatomy as ka
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    call = [("_fwd", 0.0, 300.0), ("_bwd_dkv_la", 400.0, 250.0), ("_bwd_dkv_la", 700.0, 150.0)]
    events = [(n, s + 1000.0 * c, d) for c in range(2) for n, s, d in call]
    events.reverse()  # the profiler's order is not the launch order: sorted by start
    rows = ka.per_launch(events, calls=2)
    assert rows == {"_fwd": 0.3, "_bwd_dkv_la [1/2]": 0.25, "_bwd_dkv_la [2/2]": 0.15}
    # a kernel whose count is not a multiple of the calls (a one-off) stays one summed row
    assert ka.per_launch([("x", 0.0, 100.0), ("x", 5.0, 100.0), ("x", 9.0, 100.0)], 2) == \
        {"x": 0.15}


def test_profile_hybrid_host_breakdown_times_the_parts_and_restores_them():
    """``profile_hybrid.host_breakdown``: each part of the layer's host path the call reaches
    through its module (and each kernel's FastLaunch launch) gets its microseconds and calls
    per call; the originals are back afterwards, also when the call raises."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_hybrid as ph
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import torch
    from hedgecats.models.ops import triton_common as tc

    original = tc.tma_ok, tc.FastLaunch._launch
    x = torch.zeros(4, 16)

    def call():
        tc.tma_ok(x)
        tc.tma_ok(x)
    got = ph.host_breakdown(call, n=5)
    assert got["parts"]["triton_common.tma_ok"]["calls"] == 2.0
    assert got["parts"]["triton_common.tma_ok"]["us"] > 0 and got["total_us"] > 0
    assert (tc.tma_ok, tc.FastLaunch._launch) == original

    def fails():
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        ph.host_breakdown(fails, n=2)
    assert (tc.tma_ok, tc.FastLaunch._launch) == original


def test_kernel_anatomy_switch_rows_set_their_switch_and_restore_it():
    """``kernel_anatomy``'s module-switch rows (``LAYER_SWITCHES``: the maps' paired backward)
    set the switch for the call and put it back; the other rows leave it alone."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_anatomy as ka
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from hedgecats.models.ops.feature_map import kernels as tp

    before = tp.PAIR_BACKWARD
    with ka.switch_set("layer-maps-paired-bwd"):
        assert tp.PAIR_BACKWARD is True
    assert tp.PAIR_BACKWARD == before
    with ka.switch_set("layer"):
        assert tp.PAIR_BACKWARD == before
    assert "layer-maps-paired-bwd" in ka.LAYERS
    # a row of several switches sets each and puts each back
    before = tp.FORWARD_WALK, tp.RECIPROCAL_SOFTMAX
    with ka.switch_set("layer-grid-div"):
        assert (tp.FORWARD_WALK, tp.RECIPROCAL_SOFTMAX) == (None, False)
    assert (tp.FORWARD_WALK, tp.RECIPROCAL_SOFTMAX) == before


def test_kernel_anatomy_layer_rows_time_their_change_in_the_forward_too():
    """A layer row's forward (timed alone, under no_grad) runs with its module switch and its
    tile changes set, not only its backward: ``layer-phi-rcp`` changes the maps' forward
    kernel (until session 23 its forward was timed without it), ``layer-hold-fq-rcp`` sets
    both; the default row neither."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import kernel_anatomy as ka
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import torch
    from hedgecats.models.ops.hybrid import kernels as th
    from hedgecats.models.ops.feature_map import kernels as tp

    seen = []

    class FakeLayer:
        do = None

        def hybrid(self, mixer, **kw):
            cfg = th.default_config(128, 256, torch.bfloat16)
            seen.append((tp.RECIPROCAL_SOFTMAX, cfg.hold_fq))

            class Out:
                def backward(self, do):
                    seen.append(("backward", tp.RECIPROCAL_SOFTMAX))
            return Out()

        def zero(self):
            pass

    default = tp.RECIPROCAL_SOFTMAX  # (on since session 24)
    for row, want in (("layer-div", (False, False)), ("layer-grid-div", (False, False)),
                      ("layer-hold-fq-rcp", (True, True)), ("layer-hold-fq", (default, True)),
                      ("layer", (default, False))):
        seen.clear()
        fwd, fwd_bwd = ka.layer_calls(FakeLayer(), row)
        fwd()
        fwd_bwd()
        assert seen == [want, want, ("backward", want[0])], (row, seen)
    assert (tp.RECIPROCAL_SOFTMAX, th.default_config(128, 256, torch.bfloat16).hold_fq) == \
        (default, False)


def test_profile_hybrid_aten_table_counts_each_op_per_call():
    """``profile_hybrid.host_aten_table``: the PyTorch ops a call pays host time for, each with
    its calls and self-CPU microseconds per call (the next GPU call's view of the maps' dW
    GEMM, bias sums and allocations on the host)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_hybrid as ph
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    import torch
    a = torch.randn(3, 8, 8)

    def call():
        torch.bmm(a, a).sum(dim=(0, 2))
        torch.bmm(a, a)
    table, top = ph.host_aten_table(call, n=4)
    got = {r["name"]: r for r in top}
    assert got["aten::bmm"]["calls_per_call"] == 2.0 and got["aten::sum"]["calls_per_call"] == 1.0
    assert all(r["self_cpu_us_per_call"] >= 0 for r in top) and "aten::bmm" in table


def test_profile_hybrid_host_time_is_the_median_of_repeated_windows(monkeypatch):
    """``profile_hybrid.host_and_device_ms``: the median of several windows of calls and the
    host's range, host_ahead only where every window had the host ahead (one window of 20 calls
    read the same code's host 1.83 and 2.06 ms on an H200's host)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import profile_hybrid as ph
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    windows = iter([(2.0, 1.9, True), (9.0, 1.9, True), (1.5, 2.0, False), (2.2, 1.9, True),
                    (1.8, 1.8, True)])

    def one_window(fn, per_call_ms, max_calls, sleep_ms):
        host, dev, ahead = next(windows)
        return {"host_ms": host, "device_ms": dev, "host_ahead": ahead}
    monkeypatch.setattr(ph, "device_ms", one_window)
    got = ph.host_and_device_ms(lambda: None)
    assert got == {"host_ms": 2.0, "device_ms": 1.9, "host_ahead": False,
                   "host_ms_range": [1.5, 9.0], "repeats": 5}


def test_phi_bound_rows_compute_what_they_claim(tmp_path):
    """``phi_bound.py``'s rows (the maps' pair and the kernels of its grid doing less) each
    check their outputs against PyTorch before they are timed: on the CPU through Triton's
    interpreter, all within bf16 rounding (the pair against the fp32 map)."""
    pytest.importorskip("triton")
    code = ("import sys, json; sys.path[:0] = ['tests', 'benchmarks']\n"
            "import triton_interpreter_check as t; t._install_shims()\n"
            "import phi_bound\n"
            f"r = phi_bound.main(['--shape', '1x40', '--out', {str(tmp_path)!r}])\n"
            "print('ROWS', json.dumps(r['rows']))\n")
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.split("ROWS ", 1)[1])
    assert {"pair", "pair-rcp", "walk1-tma", "dot", "copy", "read", "write",
            "torch-cat"} <= set(rows)
    for name, row in rows.items():
        assert row["max_rel_err"] < 1e-2, (name, row)
        assert row["device_ms"] == []  # (no GPU: checked, not timed)
    assert json.loads((tmp_path / "phi_bound.json").read_text())["shape"] == "1x40"


def test_attention_speed_switches_and_tiles_hold_for_the_run_only(tmp_path, monkeypatch):
    """``--switches`` (kernel module switches) and ``--tiles`` (the default config's fields)
    are in effect while the rows are measured, recorded in the JSON, restored after; a field
    or switch that does not exist is refused before anything runs."""
    import importlib.util

    import torch
    from hedgecats.models.ops.hybrid import kernels as th
    from hedgecats.models.ops.feature_map import kernels as tp

    spec = importlib.util.spec_from_file_location("attention_speed",
                                                  ROOT / "benchmarks" / "attention_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seen = {}

    def measure(a, res, log, write):
        cfg = th.default_config(128, 256, torch.bfloat16)
        seen.update(park=cfg.park_la, cap=cfg.fwd_maxnreg, walk=tp.WEIGHTS_IN_KERNEL,
                    cached=th.default_config(128, 256, torch.bfloat16) is cfg)
        write()

    monkeypatch.setattr(bench, "measure", measure)
    before = th.default_config, tp.WEIGHTS_IN_KERNEL
    assert bench.main(["--tiny", "--shapes", "2x64", "--out", str(tmp_path),
                       "--switches", "feature_map.kernels.WEIGHTS_IN_KERNEL='walk'",
                       "--tiles", "park_la=True, fwd_maxnreg=168"]) == 0
    assert seen == {"park": True, "cap": 168, "walk": "walk", "cached": True}
    assert (th.default_config, tp.WEIGHTS_IN_KERNEL) == before
    res = json.loads((tmp_path / "attention_speed.json").read_text())
    assert res["switches"] == "feature_map.kernels.WEIGHTS_IN_KERNEL='walk'"
    assert res["tiles"] == "park_la=True, fwd_maxnreg=168"
    # the ratios of a changed run say so (a run of the defaults drops the mark), and never
    # reach the summary of record (--summary)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layer_changed_from_defaults"] == {
        "switches": "feature_map.kernels.WEIGHTS_IN_KERNEL='walk'", "tiles": "park_la=True, fwd_maxnreg=168"}
    assert bench.main(["--tiny", "--shapes", "2x64", "--out", str(tmp_path)]) == 0
    assert "layer_changed_from_defaults" not in json.loads(
        (tmp_path / "summary.json").read_text())
    for bad in (["--tiles", "no_such=1"], ["--switches", "feature_map.kernels.NO_SUCH=1"],
                ["--switches", "no_such_module.X=1"],
                ["--tiles", "park_la=True", "--summary", str(tmp_path / "of_record.json")]):
        with pytest.raises(SystemExit):
            bench.main(["--tiny", "--out", str(tmp_path), *bad])
    assert not (tmp_path / "of_record.json").exists()
