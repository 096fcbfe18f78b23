"""The benchmarks (``python -m benchmarks.<name>``) run end to end on CPU in their ``--tiny``
smoke modes and write the JSON, markdown and summary keys the issues name (the numbers
themselves mean nothing on CPU); their pieces do what they claim; the paper-budget study reads
the committed measurements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import timing

ROOT = Path(__file__).resolve().parents[1]


def _command(module: str, *args: str, cwd: Path, check: bool = True
             ) -> subprocess.CompletedProcess:
    """``python -m <module> args`` as documented, run in ``cwd`` with the repository's
    packages importable (as from its root)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=600, cwd=cwd, env=env, check=False)
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _run_record(summary: dict, key: str) -> dict:
    """The record (file, command, machine, date) of the run that measured ``key``."""
    return summary["runs"][summary["measured_by"][key]]


def test_stage_speed_blocked_row_runs_the_blocked_xent():
    """The ``[blocked]`` row must not take the fused kernel that ``transfer_loss`` picks by
    itself on CUDA (else the row measures the fused kernel twice)."""
    from hedgecats.models.ops.transfer import losses as transfer
    from hedgecats.models.ops.transfer import dispatch as triton_xent

    from benchmarks import stage_speed as bench
    fused = triton_xent.weights_xent
    assert fused is not transfer.weights_xent
    with bench.blocked_xent():
        assert triton_xent.weights_xent is transfer.weights_xent
    assert triton_xent.weights_xent is fused


def test_stage_speed_recomputed_rows_switch_the_kernel_config():
    """The ``[recomputed]`` rows run the fused kernel's default tiles with save_branches off
    (a kernel call takes ``default_config`` at call time, where the kernel's module looks it
    up), and only inside the row."""
    import torch
    from hedgecats.models.ops.hybrid import config as kconfig
    from hedgecats.models.ops.hybrid import function

    from benchmarks import stage_speed as bench
    default = kconfig.default_config(128, 256, torch.bfloat16)
    assert default.save_branches
    with bench.recomputed_branches():
        for module in (kconfig, function):
            cfg = module.default_config(128, 256, torch.bfloat16)
            assert not cfg.save_branches and cfg == default.__class__(
                **{**default.__dict__, "save_branches": False}), module
    assert kconfig.default_config(128, 256, torch.bfloat16) == default
    assert function.default_config is kconfig.default_config


def test_stage_speed_t4k_ratio_only_from_a_4k_run():
    """``transfer_vs_lolcats_T4k`` is the ratio at 4k or None: a run of ``--seq-lens 1024``
    must not write its 1k ratio under the key."""
    from benchmarks import stage_speed as bench
    rows = [{"name": n, "T": T, "tokens_per_s": tps, "peak_gib": 1.0}
            for n, T, tps in [("transfer/hybrid_output_mse", 1024, 2.0),
                              ("transfer/lolcats_tt", 1024, 1.0),
                              ("transfer/hybrid_output_mse", 4096, 6.0),
                              ("transfer/lolcats_tt", 4096, 1.0)]]
    assert bench.ratios(rows, 1024, 4096)["transfer_vs_lolcats_T4k"] == 6.0
    assert bench.ratios(rows[:2], 1024, None)["transfer_vs_lolcats_T4k"] is None


def test_stage_speed_kl_ratios():
    """``kl_vs_lora``: the KL step's tokens/s over the next-token LoRA step's at the short
    length; ``kl_peak_gib_over_lora``: their peaks' difference, None without device peaks."""
    from benchmarks import stage_speed as bench
    rows = [{"name": n, "T": T, "tokens_per_s": tps, "peak_gib": peak}
            for n, T, tps, peak in [("finetune/hybrid", 1024, 10.0, 40.0),
                                    ("finetune/hybrid [kl]", 1024, 8.0, 43.5),
                                    ("finetune/hybrid [kl]", 4096, 1.0, 99.0)]]
    r = bench.ratios(rows, 1024, 4096)
    assert r["kl_vs_lora"] == 0.8 and r["kl_peak_gib_over_lora"] == 3.5
    assert bench.TARGETS["kl_vs_lora"] == ">= 0.8"
    cpu = [{**row, "peak_gib": None} for row in rows]
    assert bench.ratios(cpu, 1024, 4096)["kl_peak_gib_over_lora"] is None
    assert bench.ratios(rows[:1], 1024, 4096)["kl_vs_lora"] is None


def test_lightning_gap_tiny(tmp_path):
    """benchmarks.lightning_gap (stage 1 through Lightning against the stage harness) on CPU:
    a Lightning row, a harness row with the kernels off, and a reading that needs both."""
    _command("benchmarks.lightning_gap", "--tiny", "--only", "L0,L3,S2", "--out", str(tmp_path),
             cwd=tmp_path)
    res = json.loads((tmp_path / "lightning_gap.json").read_text())
    assert list(res["rows"]) == ["L0", "S2", "L3"]
    for r in res["rows"].values():
        assert "error" not in r, r.get("traceback")
        assert r["tokens_per_s"] > 0 and len(r["steps_s"]) == res["steps"]
    assert res["rows"]["L0"]["strategy"] == "ModelParallelStrategy"
    md = (tmp_path / "lightning_gap.md").read_text()
    assert "| L0 |" in md and "Lightning's cost at HEAD (L0 - S2)" in md


def test_stage_speed_tiny(tmp_path):
    _command("benchmarks.stage_speed", "--tiny", "--out", str(tmp_path), cwd=tmp_path)
    res = json.loads((tmp_path / "stage_speed.json").read_text())
    names = {(r["name"], r["T"]) for r in res["rows"]}
    for T in (32, 64):
        for name in ("teacher_forward", "transfer/hybrid_output_mse", "transfer/lolcats_tt",
                     "finetune/hybrid", "finetune/softmax"):
            assert (name, T) in names, (name, T)
    assert ("transfer/weights_xent [blocked]", 32) in names
    assert ("transfer/la_output_mse", 32) in names
    # stage 2 by distillation (HybridFinetune(loss="kl")): the exact KL at every length, the
    # top-k KL at the shortest
    for T in (32, 64):
        assert ("finetune/hybrid [kl]", T) in names, T
    assert ("finetune/hybrid [kl top-k]", 32) in names
    errors = [r for r in res["rows"] if "error" in r]
    assert not errors, errors
    for r in res["rows"]:
        assert r["tokens_per_s"] > 0 and r["step_s"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    for key in ("transfer_xent_vs_teacher_forward", "transfer_mse_vs_teacher_forward",
                "lora_vs_softmax_lora", "transfer_vs_lolcats_T4k", "kl_vs_lora"):
        assert summary[key] > 0, key
        run = _run_record(summary, key)
        assert run["command"].startswith("python -m benchmarks.stage_speed --tiny")
        assert run["machine"] and run["date"] and run["file"].endswith("stage_speed.json")
    # peaks are device memory: measured on a GPU only, and absent rather than null here
    peaks = [r.get("peak_gib") for r in res["rows"] if r["name"].startswith("transfer/")]
    assert ("transfer_peak_gib_over_teacher" in summary) == any(p is not None for p in peaks)
    assert "kl_peak_gib_over_lora" not in summary  # no device peak on CPU
    # not measured by this script (one device): no value, rather than a null beside others
    assert "scaling_efficiency_transfer_2gpu" not in summary
    md = (tmp_path / "stage_speed.md").read_text()
    assert "| finetune/softmax |" in md and "| finetune/hybrid [kl] |" in md
    assert "| kl_vs_lora |" in md


def test_attention_speed_tiny(tmp_path):
    _command("benchmarks.attention_speed", "--tiny", "--shapes", "2x64,1x1024", "--out",
             str(tmp_path), cwd=tmp_path)
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
    for key in ("layer_vs_teacher_T1k", "layer_vs_teacher_T64k", "layer_fwd_vs_teacher_T1k",
                "layer_mem_vs_swa_T64k", "layer_vs_lolcats_T4k"):
        assert key in res["ratios"], key
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layer_vs_teacher_T1k"] > 0 and summary["layer_fwd_vs_teacher_T1k"] > 0
    run = _run_record(summary, "layer_vs_teacher_T1k")
    assert run["command"].startswith("python -m benchmarks.attention_speed --tiny")
    assert run["machine"] == res["environment"]["gpu"] and run["date"]
    assert (tmp_path / "attention_speed.png").stat().st_size > 10_000  # drawn with every report


def test_attention_speed_plot_from_the_committed_measurement(tmp_path):
    """--plot redraws the figure of docs/performance.md from a results JSON; fwd rows of the
    bracketed cases ("hybrid fixed fwd [pytorch phi]") are drawn too."""
    from benchmarks import attention_speed as bench

    src = ROOT / "benchmarks" / "results" / "attention_speed.json"
    assert bench.main(["--plot", str(src), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "attention_speed.png").stat().st_size > 10_000
    lines = []
    import matplotlib.axes

    orig = matplotlib.axes.Axes.plot

    def spy(self, *args, **kw):
        lines.append(kw.get("label"))
        return orig(self, *args, **kw)

    rows = [dict(B=8, T=T, case=case, ms=1.0, peak_gib=1.0) for T in (1024, 4096)
            for case in ("teacher", "hybrid fixed [pytorch phi]",
                         "hybrid fixed fwd [pytorch phi]")]
    res = {**json.loads(src.read_text()), "rows": rows}
    matplotlib.axes.Axes.plot = spy
    try:
        bench.plot(res, tmp_path / "again.png")
    finally:
        matplotlib.axes.Axes.plot = orig
    assert "hybrid fixed [pytorch phi] (fwd)" in lines and "teacher (fwd+bwd)" in lines


def test_attention_speed_rows_collect_garbage_before_their_peak(monkeypatch):
    """bench_adaptive runs the cyclic garbage collector before it takes a row's memory base and
    peak: a correctness check's tensors held in a reference cycle would otherwise count in the
    next row's peak."""
    import gc
    import weakref

    import torch

    monkeypatch.setattr(timing, "DEVICE", "cpu")

    class Holder:  # a cycle holding a tensor, as a frame / traceback pair would
        pass
    h = Holder()
    h.self, h.t = h, torch.zeros(4)
    alive = weakref.ref(h.t)
    del h
    gc.disable()  # so that only an explicit collection frees it
    try:
        assert alive() is not None
        timing.bench_adaptive(lambda: None, budget_ms=1.0)
        assert alive() is None
    finally:
        gc.enable()


def test_gpu_tests_report_renders_both_row_formats(tmp_path):
    """One report folder gets rows from the backend matrix and from the fused-kernel tests
    (a kernel row has no 'backend', some rows no 'case'): both tables."""
    errs = {n: 1e-3 for n in ("out", "dq", "dk", "dv", "dWq", "dWk")}
    rows = [{"case": "hybrid", "dtype": "torch.bfloat16", "shape": [2, 8, 2, 300, 128, 64],
             "backend": "fla", "vs_reference_same_dtype": errs, "vs_fp32_oracle": errs,
             "reference_same_dtype_vs_oracle": errs},
            {"test": "hybrid", "case": "shared_norm", "shape": "B2-H8-Hkv2-T300-D128-w64-F256",
             "dtype": "torch.bfloat16", "fused_calls": 1, "vs_reference_same_dtype": errs,
             "vs_fp32_oracle": errs, "triton_errors": [], "tile_retries": [], "seconds": 1.0},
            # a row without case / shape / dtype still renders
            {"test": "saved_branches", "shared": False, "frozen": True,
             "saved_vs_fp32": errs}]
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tests_report.py"),
                          str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "## Backend matrix (tests/test_backends_gpu.py): 1 cases" in out
    assert "## Fused kernels (tests/test_triton_kernels.py): 2 cases" in out
    assert "| fla | bfloat16 | 1.0e-03 |" in out and "| hybrid | shared_norm |" in out


def test_gpu_tests_report_without_a_report_folder(tmp_path):
    """Tests that write no rows leave no report folder: the report says so instead of
    failing after the tests have passed."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_tests_report.py"),
                          str(tmp_path / "missing")], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "no case reports"


def test_paper_budget_from_the_committed_measurements(tmp_path):
    """experiments.paper_budget on the committed stage throughputs: every recipe, hours that
    follow from tokens / (tokens/s), and the eight-GPU extrapolation from the 2-GPU efficiency."""
    out = tmp_path / "budget"
    _command("experiments.paper_budget", "--out", str(out), cwd=tmp_path)
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


def test_paper_budget_takes_the_lightning_figures_of_the_files_named(tmp_path):
    """A --multigpu file of one's own gives the Lightning column its one-GPU figures (the
    committed newer run does not override a file the user named)."""
    mg = {"world_sizes": {"1": {"attention_transfer": {"tokens_per_s": 10_000},
                                "hybrid_finetune": {"tokens_per_s": 5_000}},
                          "2": {"attention_transfer": {"scaling_efficiency": 0.9},
                                "hybrid_finetune": {"scaling_efficiency": 0.9}}}}
    (tmp_path / "mg.json").write_text(json.dumps(mg))
    out = tmp_path / "budget"
    _command("experiments.paper_budget", "--multigpu", str(tmp_path / "mg.json"),
             "--lightning-gap", "--out", str(out), cwd=tmp_path)
    res = json.loads(Path(f"{out}.json").read_text())
    assert res["lightning_1gpu_tokens_per_s"]["transfer"] == {"weights_xent": 10_000}
    assert res["lightning_1gpu_tokens_per_s"]["finetune"] == 5_000
    assert res["scaling_2gpu"] == {"transfer": 0.9, "finetune": 0.9}


def test_attention_speed_ratios_in_device_time(monkeypatch):
    """The issue's time ratios from each row's GPU time with the host ahead (``device_ms``),
    beside the event timings (an isolated call of a host-bound layer reads its host in events,
    differently on two machines with one code). The memory ratio is the same in both; a row
    without a device time (the CPU) gives no ratio."""
    from benchmarks import attention_speed as bench
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
    monkeypatch.setattr(timing, "DEVICE", "cpu")  # (--tiny: no device time to take)
    assert timing.device_ms(lambda: None, 1.0) == {"device_ms": None, "host_ahead": None}


@pytest.mark.slow  # (~27 s under the interpreter: make test-all)
def test_kernel_anatomy_refuses_unknown_configs_and_tables_its_rows(tmp_path):
    """kernel_anatomy (GPU only) names what it does not know before touching a GPU, and its
    markdown puts every kernel of every config / branch set in one table per phase, a failed
    row as its error."""
    for args, says in ((["--configs", "default,nope"], "unknown config 'nope'"),
                       (["--heads", "28", "--kv-heads", "8"], "not a multiple of --kv-heads 8"),
                       (["--configs", "default,recomputed", "--branches", "hybrid,layer"],
                        "--configs default alone"),
                       (["--branches", "layer,layer-changed"], "needs --tiles or --switches"),
                       (["--branches", "layer-changed", "--tiles", "no_such=1"],
                        "not field=value of a KernelConfig field")):
        proc = _command("benchmarks.kernel_anatomy", *args, cwd=tmp_path, check=False)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr[-1500:])
    from benchmarks import kernel_anatomy as ka

    assert set(ka.BRANCHES) == {"hybrid", "swa", "la"} and ka.LAYER == "layer"
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
    from benchmarks import kernel_anatomy as ka
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
    from benchmarks import profile_hybrid as ph
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


def test_kernel_anatomy_changed_row_times_its_change_in_forward_and_backward():
    """The ``layer-changed`` row runs its forward (timed alone, under no_grad) and its backward
    with ``--tiles`` and ``--switches`` set, and puts both back; the other layer rows run the
    defaults."""
    import torch
    from benchmarks import switches as kernel_switches
    from hedgecats.models.ops.hybrid import config as kconfig

    from benchmarks import kernel_anatomy as ka

    switch = kernel_switches.parse(f"hybrid.config.SPLIT_STATES_MIN_CHUNKS="
                                   f"{kconfig.SPLIT_STATES_MIN_CHUNKS + 1}")
    default = kconfig.default_config(128, 256, torch.bfloat16), kconfig.SPLIT_STATES_MIN_CHUNKS
    seen = []

    def state():
        return (kconfig.default_config(128, 256, torch.bfloat16).save_branches,
                kconfig.SPLIT_STATES_MIN_CHUNKS)

    class FakeLayer:
        do = None

        def hybrid(self, mixer, **kw):
            seen.append(state())

            class Out:
                def backward(self, do):
                    seen.append(("backward", *state()))
            return Out()

        def zero(self):
            pass

    changed = (False, default[1] + 1)
    for row, want in ((ka.LAYER_CHANGED, changed), (ka.LAYER, state()),
                      ("layer-unfolded", state())):
        seen.clear()
        fwd, fwd_bwd = ka.layer_calls(FakeLayer(), row, {"save_branches": False}, switch)
        fwd()
        fwd_bwd()
        assert seen == [want, want, ("backward", *want)], (row, seen)
    assert (kconfig.default_config(128, 256, torch.bfloat16), kconfig.SPLIT_STATES_MIN_CHUNKS) == default


def test_profile_hybrid_aten_table_counts_each_op_per_call():
    """``profile_hybrid.host_aten_table``: the PyTorch ops a call pays host time for, each with
    its calls and self-CPU microseconds per call (the next GPU call's view of the maps' dW
    GEMM, bias sums and allocations on the host)."""
    from benchmarks import profile_hybrid as ph
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
    from benchmarks import profile_hybrid as ph
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
    """``phi_bound``'s rows (the maps' pair and the kernels of its grid doing less) each
    check their outputs against PyTorch before they are timed: on the CPU through Triton's
    interpreter, all within bf16 rounding (the pair against the fp32 map)."""
    pytest.importorskip("triton")
    code = ("import json\n"
            "from tests.triton_interpreter_check import _install_shims; _install_shims()\n"
            "from benchmarks import phi_bound\n"
            f"r = phi_bound.main(['--shape', '1x40', '--out', {str(tmp_path)!r}])\n"
            "print('ROWS', json.dumps(r['rows']))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.split("ROWS ", 1)[1])
    assert {"pair", "walk1", "walk1-tma", "dot", "copy", "read", "write",
            "torch-cat"} <= set(rows)
    for name, row in rows.items():
        assert row["max_rel_err"] < 1e-2, (name, row)
        assert row["device_ms"] == []  # (no GPU: checked, not timed)
    assert json.loads((tmp_path / "phi_bound.json").read_text())["shape"] == "1x40"


def test_attention_speed_switches_and_tiles_hold_for_the_run_only(tmp_path, monkeypatch):
    """``--switches`` (kernel module switches) and ``--tiles`` (the default config's fields)
    are in effect while the rows are measured, recorded in the JSON and in the summary's
    record of the run, restored after; a field or switch that does not exist is refused
    before anything runs, and so is a changed run's ratios in the summary of record."""
    import torch
    from hedgecats.models.ops.hybrid import config as kconfig

    from benchmarks import attention_speed as bench

    seen = {}
    chunks = kconfig.SPLIT_STATES_MIN_CHUNKS + 1

    def measure(a, res, log, write):
        cfg = kconfig.default_config(128, 256, torch.bfloat16)
        seen.update(saved=cfg.save_branches, chunks=kconfig.SPLIT_STATES_MIN_CHUNKS,
                    cached=kconfig.default_config(128, 256, torch.bfloat16) is cfg)
        res["rows"] += [dict(B=1, T=1024, case=case, ms=ms, peak_gib=1.0, tokens_per_s=1.0)
                        for case, ms in (("teacher", 1.0), ("hybrid fixed", 2.0))]
        write()

    monkeypatch.setattr(bench, "measure", measure)
    before = kconfig.default_config, kconfig.SPLIT_STATES_MIN_CHUNKS
    switches = f"hybrid.config.SPLIT_STATES_MIN_CHUNKS={chunks}"
    assert bench.main(["--tiny", "--shapes", "2x64", "--out", str(tmp_path),
                       "--switches", switches, "--tiles", "save_branches=False"]) == 0
    assert seen == {"saved": False, "chunks": chunks, "cached": True}
    assert (kconfig.default_config, kconfig.SPLIT_STATES_MIN_CHUNKS) == before
    res = json.loads((tmp_path / "attention_speed.json").read_text())
    assert res["switches"] == switches and res["tiles"] == "save_branches=False"
    # the ratios of a changed run say so in their run's record (a run of the defaults drops
    # the mark), and never reach the summary of record (--summary)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layer_vs_teacher_T1k"] == 2.0
    assert _run_record(summary, "layer_vs_teacher_T1k")["changed_from_defaults"] == {
        "switches": switches, "tiles": "save_branches=False"}
    assert bench.main(["--tiny", "--shapes", "2x64", "--out", str(tmp_path)]) == 0
    assert "changed_from_defaults" not in _run_record(
        json.loads((tmp_path / "summary.json").read_text()), "layer_vs_teacher_T1k")
    for bad in (["--tiles", "no_such=1"], ["--switches", "hybrid.kernels.NO_SUCH=1"],
                ["--switches", "no_such_module.X=1"],
                ["--tiles", "save_branches=False", "--summary", str(tmp_path / "of_record.json")]):
        with pytest.raises(SystemExit):
            bench.main(["--tiny", "--out", str(tmp_path), *bad])
    assert not (tmp_path / "of_record.json").exists()


def test_summary_holds_one_value_per_key_and_the_run_that_measured_it(tmp_path):
    """A run's ratios replace the keys it measured (None: not measured, the older value
    stays); each key names its run, each run its record; a run no key refers to any more
    is dropped."""
    from benchmarks.summary import update_summary

    path = tmp_path / "summary.json"
    old = {"file": "a.json", "command": "c1", "machine": "m1", "date": "d1"}
    new = {"file": "b.json", "command": "c2", "machine": "m2", "date": "d2"}
    update_summary(path, {"x": 1.0, "y": 2.0}, "first", old)
    update_summary(path, {"x": 3.0, "y": None}, "second", new)
    summary = json.loads(path.read_text())
    assert (summary["x"], summary["y"]) == (3.0, 2.0)
    assert summary["measured_by"] == {"x": "second", "y": "first"}
    assert summary["runs"] == {"first": old, "second": new}
    update_summary(path, {"y": 4.0}, "third", old)
    assert set(json.loads(path.read_text())["runs"]) == {"second", "third"}


def test_summary_of_record_names_a_committed_run_for_every_key():
    """benchmarks/results/summary.json: one value per key, each measured by a run whose
    file is committed and which names its command, machine and date."""
    summary = json.loads((ROOT / "benchmarks" / "results" / "summary.json").read_text())
    values = {k for k in summary if k not in ("measured_by", "runs")}
    assert values == set(summary["measured_by"])
    for key in values:
        run = _run_record(summary, key)
        assert (ROOT / run["file"]).exists(), run
        assert run["command"] and run["machine"] and run["date"], run
