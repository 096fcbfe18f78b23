"""What the fused layer asks of the host per forward + backward: which Triton kernels it
launches and which PyTorch ops reach a device kernel, counted on what users run (the layer's
CUDA path: ``hybrid_attention`` through ``triton_hybrid``, the fused feature maps folded into its
autograd Function) with the
launches stubbed (``python -m benchmarks.host_overhead``). At 8 x 1k the layer's host work exceeds its
GPU time, so every launch or op that creeps into the path shows in the time of a call: a new
one fails here, with what it is, until it is counted in (and measured).

Needs triton importable (the kernels' definitions; the CPU set-up installs it). Runs
in a subprocess with ``TRITON_INTERPRET=1``, as tests/test_triton_interpreter.py does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
#: the benchmark as its README runs it: ``python -m benchmarks.host_overhead`` from the root
SCRIPT = ["-m", "benchmarks.host_overhead"]

#: one forward + backward of the layer (fixed g, no padding), both maps fused (folded into
#: the kernel's Function: their forward in one launch, on walking programs at D = F/2 = 128),
#: the backward's fused kernels on (the default at D 128 bf16: ``_bwd_q``,
#: ``_bwd_kv``)
LAUNCHES = {"_phi_fwd_pair_walk": 1, "_state_fwd": 1, "_fwd": 1, "_bwd_q": 1, "_state_rev": 1,
            "_bwd_kv": 1, "_phi_bwd": 2, "bmm_fp32 (torch)": 2}
#: the same with them off (``--unfused``: the separate kernels)
LAUNCHES_UNFUSED = {"_phi_fwd_pair_walk": 1, "_state_fwd": 1, "_fwd": 1, "_bwd_dq": 1,
                    "_state_rev": 1, "_bwd_dfq": 1, "_bwd_dkv_swa": 1, "_bwd_dkv_la": 1,
                    "_phi_bwd": 2, "bmm_fp32 (torch)": 2}
#: the maps' fp32 weights cast to bf16 (forward; their biases are read in fp32), their bias
#: gradients (backward)
TORCH_KERNELS = {"_to_copy": 2, "sum": 2}


@pytest.mark.parametrize("unfused", [False, True], ids=["default", "unfused-backward"])
def test_the_layer_launches_what_it_is_counted_for(tmp_path, unfused):
    out = tmp_path / "host.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *SCRIPT, "--calls", "3", "--out", str(out),
                           *(["--unfused"] if unfused else [])],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["triton_launches"] == (LAUNCHES_UNFUSED if unfused else LAUNCHES)
    assert got["torch_kernel_ops"] == TORCH_KERNELS
    assert got["maps_folded"] == [1, 1]  # (forward, backward: the maps in the kernel's node)
    assert got["us_per_call"]["total"] > 0
    # the no-grad forward's first launch comes before its end (its latency: where an
    # isolated call's GPU waits)
    assert 0 < got["us_to_first_launch_no_grad"] < got["us_forward_no_grad"]


def test_the_maps_share_times_the_call_with_and_without_the_maps(tmp_path):
    """``--maps-share``: the layer's call (the maps folded into the kernel's Function), the
    call before the fold (the maps as their own Functions), then that with the k map's and both
    maps' outputs precomputed, three rounds each; leaving both maps' Functions out is less host
    work (measured 2026-12-04 on this project's CPU: 493 / 573 / 457 / 279 us), so the last
    reads below the first."""
    out = tmp_path / "host.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *SCRIPT, "--calls", "20", "--maps-share",
                           "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())["maps_share_us"]
    assert set(got) == {"layer", "unfolded", "unfolded_without_k_map",
                        "unfolded_without_maps"}, got
    assert all(len(v) == 3 and min(v) > 0 for v in got.values()), got
    assert min(got["layer"]) > min(got["unfolded_without_maps"]), got


def _memory(tmp_path) -> dict:
    out = tmp_path / "host.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, *SCRIPT, "--calls", "3", "--memory", "1x1024",
                           "--out", str(out)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())["memory_mib"]


@pytest.fixture(scope="module")
def memory(tmp_path_factory) -> dict:
    return _memory(tmp_path_factory.mktemp("memory"))


def test_a_checkpointed_layer_keeps_nothing_but_its_output(memory):
    """``--memory``: under non-reentrant activation checkpointing (the stages'), the layer's
    call keeps alive after its forward only its output: whatever the backward reads goes
    through ``save_for_backward``, which checkpointing discards (and recomputes). Branches and
    LA states held on the Function's context instead (to drop them early in the backward) stay
    alive through a checkpointed model's forward: 28.1 MiB here against the output's 8.0."""
    alive, output = memory["checkpointed_forward_alive_and_output"]
    assert alive <= output + 1.0, memory


def test_the_folded_call_holds_no_more_memory_than_the_maps_as_their_own_functions(memory):
    """``--memory``: the bytes PyTorch allocates over the layer's forward + backward (the
    launches stubbed, the same buffers; ``host_overhead.LiveBytes``, storages at their current
    sizes), at the 8B's heads and 1 x 1k: the maps folded into the kernel's Function peak no
    higher than before the fold. The node's saved branches and LA states live until its
    backward returns, so through the maps' backward (98.1 against 88.2 MiB here when kept);
    dropping them from the context instead breaks activation checkpointing (the test above).
    The backward empties their storage once its kernels have read them
    (``hybrid.function._release_saved``; they stay saved tensors): 86.2 MiB."""
    (fwd, total), (fwd_before, total_before) = memory["layer"], memory["unfolded"]
    assert fwd <= fwd_before and total <= total_before, memory
