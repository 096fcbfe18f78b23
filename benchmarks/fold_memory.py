"""Where the layer's peak memory sits over one forward + backward (CUDA), for the layer's call
(the feature maps folded into the fused kernel's autograd Function) and the call before the
fold (the maps as their own Functions): the caching allocator's own trace
(``torch.cuda.memory._record_memory_history``) replayed, the peak found, and the blocks alive
there listed by where they were allocated (the innermost frame in hedgecats, or the innermost
Python frame). What ``tests/test_triton_kernels.py``'s
``test_folded_call_peaks_no_higher_than_the_maps_as_their_own_functions`` compares, taken
apart; the CPU proxy (``host_overhead.py --memory``) sees PyTorch's allocations only.

    python -m benchmarks.fold_memory --shape 1x8192 --out results.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from hedgecats.models import HedgehogFeatureMap, hybrid_attention
from hedgecats.models.ops.hybrid import attention as hybrid_mod


def _site(frames: list[dict]) -> str:
    """The allocation's innermost hedgecats frame (else its innermost Python frame)."""
    for f in frames:
        name = f.get("filename", "")
        if "hedgecats" in name or "/src/models/" in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{f['filename'].rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}"
    return "?"


def peak_blocks(trace: list[dict], base_live: dict) -> dict:
    """Replay one device's trace: MiB alive at the peak (above the blocks alive before the
    trace) and those blocks by allocation site."""
    live = dict(base_live)
    now = best = 0
    at_peak: dict = {}
    for ev in trace:
        act, addr, size = ev["action"], ev["addr"], ev["size"]
        if act == "alloc":
            live[addr] = (size, _site(ev.get("frames", [])))
            now += size
            if now > best:
                best, at_peak = now, dict(live)
        elif act in ("free_completed",) and addr in live:
            now -= live.pop(addr)[0]
    sites = collections.Counter()
    for addr, (size, site) in at_peak.items():
        if addr not in base_live:
            sites[site] += size
    return {"peak_mib": round(best / 2**20, 1),
            "by_site_mib": {s: round(b / 2**20, 1) for s, b in sites.most_common(14)}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1x8192")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    B, T = map(int, a.shape.split("x"))
    H, Hkv, D = 32, 8, 128
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(12)
    maps = [HedgehogFeatureMap(n, D, seed=s).to(dev) for n, s in ((H, 1), (Hkv, 2))]
    q, k, v = (torch.randn(B, T, n, D, device=dev, generator=gen).bfloat16()
               .transpose(1, 2).requires_grad_() for n in (H, Hkv, Hkv))
    do = torch.randn(B, H, T, D, device=dev, generator=gen).bfloat16()

    def step(folded: bool) -> None:
        for x in (q, k, v):
            x.grad = None
        for m in maps:
            m.zero_grad(set_to_none=True)
        if folded:
            out = hybrid_attention(q, k, v, None, None, maps=maps, window=64)
        else:
            fq, fk, q_on, k_on = hybrid_mod._apply_maps(maps, q, k)
            out = hybrid_attention(q_on, k_on, v, fq, fk, window=64)
            del fq, fk, q_on, k_on
        out.backward(do)
        del out
        torch.cuda.synchronize()

    res = {"shape": a.shape, "heads": [H, Hkv], "D": D}
    for folded in (True, False):  # compiled, the allocator warm
        step(folded)
    for name, folded in (("layer", True), ("unfolded", False)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        step(folded)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][0]
        res[name] = {"max_allocated_above_start_mib":
                     round((torch.cuda.max_memory_allocated() - base) / 2**20, 1),
                     **peak_blocks(trace, {})}
        print(name, json.dumps(res[name], indent=1), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
