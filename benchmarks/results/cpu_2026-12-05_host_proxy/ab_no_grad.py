"""The no-grad forward's host work of one source tree, in the CPU proxy (session 21's A/B).

    git worktree add /tmp/before c360eba
    TRITON_INTERPRET=1 python benchmarks/results/cpu_2026-12-05_host_proxy/ab_no_grad.py /tmp/before/src
    TRITON_INTERPRET=1 python benchmarks/results/cpu_2026-12-05_host_proxy/ab_no_grad.py src

Loads ``hedgecats`` from SRC (the package's source directory) and that tree's
``benchmarks/host_overhead.py`` (the launches stubbed: ``patch_routing``), then times the
layer's call (``hybrid_attention(maps=...)``, 1 x 32, 4 query heads on 1 kv head) under
``torch.no_grad()``: median microseconds of 500 calls, three rounds.
"""
import importlib.util
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
src = os.path.abspath(sys.argv[1])
spec = importlib.util.spec_from_file_location("hedgecats", os.path.join(src, "__init__.py"),
                                              submodule_search_locations=[src])
mod = importlib.util.module_from_spec(spec)
sys.modules["hedgecats"] = mod
spec.loader.exec_module(mod)
sys.path.insert(0, os.path.join(src, "..", "benchmarks"))
import torch  # noqa: E402
import host_overhead  # noqa: E402

host_overhead.patch_routing()
import attention_speed as A  # noqa: E402

A.DEVICE = "cpu"
L = A.Layer(1, 32, 4, 1, 128, 64, torch.bfloat16, "square")
torch.set_num_threads(1)


def call():
    with torch.no_grad():
        A.hybrid_attention(L.q, L.k, L.v, None, None, maps=(L.phi_q, L.phi_k), window=L.w,
                           scale=L.scale, g=0.5)


for _ in range(20):
    call()
rounds = []
for _ in range(3):
    ts = []
    for _ in range(500):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    rounds.append(round(statistics.median(ts) * 1e6, 1))
print(src, rounds)
