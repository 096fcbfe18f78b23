"""The fused Triton kernels (ops.triton_hybrid, ops.triton_xent, ops.triton_phi,
ops.triton_mse, ops.triton_decode) on CPU under Triton's interpreter, against the PyTorch
references: outputs and every gradient, fp32 and bf16; the decode step's logits and cache
against the composed step.

Needs triton (the CPU set-up installs it: constraints.txt, the ``dev`` extra; skipped where it
is missing). The kernels run in a subprocess with ``TRITON_INTERPRET=1``
(tests/triton_interpreter_check.py), so that the interpreter is never switched on in a process
that runs them on a GPU. Each test splits its cases over two such processes side by side (the
interpreter runs a kernel on one core). All 277 cases took about an hour in one process,
hence ``slow``; the ``--quick`` cases (~30 s) run in the default selection.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("triton_interpreter_check.py")


def _run(*args: str, timeout: int = 1800, shards: int = 2) -> list[dict]:
    """The check's rows for ``args``, its cases split over ``shards`` processes side by side
    (the interpreter runs a kernel on one core)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args, "--shard", f"{k}/{shards}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(shards)]
    rows = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert rows, "the check printed no case"
    return rows


def _failures(rows: list[dict]) -> list[str]:
    bad = []
    for r in rows:
        if r["id"] in CANARIES:  # (the checks' own: ``_canaries_reported``)
            continue
        if "error" in r:
            bad.append(f"{r['id']}: {r['error']}")
            continue
        over = {n: f"{e:.2e}" for n, e in r["errors"].items() if not e <= r["tol"]}
        if over:
            bad.append(f"{r['id']} ({r['dtype']}, tol {r['tol']}): {over}")
        if r.get("poison_changed"):  # (``--poison``: read memory nobody wrote)
            bad.append(f"{r['id']}: moved with its allocations poisoned: {r['poison_changed']}")
        if r.get("reverse_changed"):  # (``--reverse``: a program read another's write)
            bad.append(f"{r['id']}: moved with its programs in reverse order: "
                       f"{r['reverse_changed']}")
    return bad


#: the checks' own cases: what each must read under its check (``poison-canary``: all 8 of
#: its unwritten half NaN; ``order-canary``: 7 of its 8 programs reading before the write)
CANARIES = {"poison-canary": ("poison", "nan_read", 8.0),
            "order-canary": ("reverse", "reads_before_the_write", 7.0)}


def _canaries_reported(rows: dict) -> None:
    """``rows`` (by id) hold both canaries, each found out by its own check; removed. (The
    order canary's ordinary run is exact, so its reversed run must be reported as moved; the
    poison canary's ordinary run reads leftovers, which may be an earlier poisoned run's.)"""
    canaries = {cid: rows.pop(cid) for cid in CANARIES}
    for cid, (check, name, want) in CANARIES.items():
        assert canaries[cid][f"{check}_errors"][name] == want, canaries[cid]
    order = canaries["order-canary"]
    assert order["errors"]["reads_before_the_write"] == 0.0 and \
        order["reverse_changed"] == ["reads_before_the_write"], order


def _all_pass(*ids: str) -> None:
    """Cases ``ids`` run, each within its tolerance."""
    rows = _run(*ids)
    assert sorted(r["id"] for r in rows) == sorted(ids)
    bad = _failures(rows)
    assert not bad, "\n".join(bad)


def test_kernels_match_references_quick():
    rows = _run("--quick")
    assert len(rows) == 11
    bad = _failures(rows)
    assert not bad, "\n".join(bad)


def test_state_sums_on_the_tensor_cores_match_the_row_sums():
    """``KernelConfig.state_sums_mma`` (on by default at D 128 bf16) against the row
    reductions, walked and split, with padding: the exact sums to fp32 rounding, u to 2^-14
    (``state_sums_case``)."""
    _all_pass("state-sums-walked-pad-bf16", "state-sums-split-pad-bf16")


def test_output_gates_take_a_kernel_call_per_branch():
    """A g per position and channel (output-gate mixers): each branch from its own kernel call,
    mixed in PyTorch (``triton_hybrid._gated``), against the reference for output and every
    gradient (g's too), with SSD's per-head drops, rescale and ``la_span="all"`` in hybrid and
    swa_only mode; and the layer's call, the maps folded into the LA call."""
    _all_pass("layer-gate-ssd-head-rescale-all", "layer-gate-swa-only-rescale-ssd-all",
              "fold-gate-hybrid-pad")


def test_a_converted_model_trains_through_the_fused_kernel():
    """What a stage runs: a converted Llama's loss and backward with every layer on the GPU's
    path (the fused kernel, the maps folded in), against the fp32 model on the reference
    pieces (``model_case``): the fixed mixer with padding, and an output gate (a kernel call
    per branch) with SSD and rescale."""
    _all_pass("model-fixed-pad", "model-gate-lowrank-ssd-rescale")


def test_maps_folded_into_the_kernel_match_their_own_functions():
    """The layer's call: the feature maps inside the fused kernel's autograd Function
    (``hybrid_attention(maps=...)``) give the output and gradients of the maps run as their own
    Functions, bit for bit, and of the fp32 reference within tolerance: through the layer's
    routing with padding, as stage 1 calls it (q, k, v frozen), and where the backward falls
    back to the reference (``fold_case``)."""
    _all_pass("fold-attention-default-tiles-pad", "fold-hybrid-stage1-pad",
              "fold-backward-fallback-pad")


def test_no_kernel_reads_memory_nobody_wrote_nor_races():
    """``--poison``: each case again with every uninitialised allocation filled with poison
    (NaN, a large integer, True; ``poison.Poisoned``); ``--reverse``: again with every launch's
    programs in reverse order (a program reading what another of the same launch wrote: a race
    on a GPU). The results bit for bit the same, on the paths where two identical GPU calls
    have differed: the forward with padding and the shared norm, the maps' pair on walking
    programs through descriptors, an output gate's la_only call with padding; and each check
    reports its canary. (With the forward's
    output rows of neither branch left unstored, an injected defect, ``--poison`` reports
    ``kernel-pad``'s out.) The whole suite so:
    ``test_no_kernel_reads_memory_nobody_wrote_nor_races_all_cases`` (slow)."""
    cases = (*CANARIES, "kernel-split-tile-pad-shifts-shared", "layer-gate-la-only-rescale-pad",
             "pair-walk-tma")
    rows = {r["id"]: r for r in _run("--poison", "--reverse", *cases)}
    assert sorted(rows) == sorted(cases)
    _canaries_reported(rows)
    assert all(r.get("poisoned", 0) > 0 for r in rows.values()), rows
    bad = _failures(list(rows.values()))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_no_kernel_reads_memory_nobody_wrote_nor_races_all_cases():
    """Every case under ``--poison`` and ``--reverse`` (three times the all-cases run's time)."""
    rows = {r["id"]: r for r in _run("--poison", "--reverse", timeout=6 * 3600)}
    _canaries_reported(rows)
    bad = _failures(list(rows.values()))
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_kernels_match_references_all_cases():
    rows = _run(timeout=2 * 3600)
    assert len(rows) >= 45
    bad = _failures(rows)
    assert not bad, "\n".join(bad)


def test_decode_precision_script_matches_its_float64_oracle():
    """experiments/decode_precision.py (the GPU diagnostic of the fused decode step's fp32
    accuracy) on CPU under the interpreter: its float64 oracle and the kernels agree to fp32
    rounding, so on a GPU a larger error is the compiled kernel's, not the script's."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, "-m", "experiments.decode_precision", "--small"],
                          env=env, cwd=SCRIPT.parents[1], capture_output=True, text=True,
                          timeout=600, check=False)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"dtype"')]
    assert proc.returncode == 0 and len(rows) == 6, proc.stderr[-3000:]
    for r in rows:
        assert r["rel_err_vs_float64"] < (1e-5 if r["dtype"] == "float32" else 1e-2), r
