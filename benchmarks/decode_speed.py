"""Decode speed and cache memory: the hybrid with its HybridCache against the same model in
``softmax`` mode with transformers' KV cache (issue 13).

    PYTHONPATH=/tmp/pkg:/tmp/site python -m benchmarks.decode_speed --out $OUT/decode_speed.json
    python -m benchmarks.decode_speed --tiny --out /tmp/decode_speed.json   # CPU smoke test

Under a time limit per command, run the parts separately and combine them:

    python -m benchmarks.decode_speed --parts latency --out $OUT/decode_latency.json
    python -m benchmarks.decode_speed --parts batch --out $OUT/decode_batch.json
    python -m benchmarks.decode_speed --combine decode_latency.json decode_batch.json \
        --out decode_speed.json --md decode_speed.md

Model: Llama-3-8B's shape (32 layers, width 4096, 32 heads / 8 KV heads, vocabulary 128256) with
Llama-3.1's 131072 positions, random weights, bf16, converted with ``HybridConfig(window=64)``
(square softmax Hedgehog maps, non-overlapping LA); "softmax" is the same model in mode
``softmax`` (bit-exact the original attention). Nothing is downloaded.

``--shape small`` (4 layers, width 512, head dimension 128) or ``tiny`` (2 layers, width 64) and
``--device`` run the same paths small (``--tiny`` = ``--shape tiny --device cpu``, no CUDA
graphs).

``--parts latency`` (per context, default 1k / 8k / 32k / 127k, batch 1; 127k = 128k - 1k leaves
the decode steps room in Llama-3.1's 131072 positions):
    prefill tokens/s   one forward of the prompt into an empty cache (last token's logits only),
                       median of ``--prefill-repeats`` after an untimed one of the same length
    cache bytes        what the cache holds after the prefill
    eager ms/token     decode steps as generate runs them: forward of one token + argmax
    graph ms/token     the same step replayed from a CUDA graph (``models.decode.GraphedDecoder``;
                       HybridCache, and for softmax transformers' StaticCache filled with the
                       prefilled keys): launch overhead removed for both
``--parts batch`` (context 32k): the largest batch whose decode step fits in memory, for each,
found by doubling then bisecting, and its decode tokens/s (graph; eager on CPU). The caches at
batch B are the batch-1 prefill repeated (hybrid) or a StaticCache filled with random keys
(softmax: the cost of a step does not depend on the values).

The targets of issue 13 are checked and reported under "targets". Results go to ``--out`` (JSON,
with the command) and a Markdown table to stdout (and ``--md``). A part that fails records its
error in its row and the run continues.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

LLAMA3_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
             "max_position_embeddings": 131072, "rope_theta": 500000.0}
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 258,
        "max_position_embeddings": 4096}
#: a small model with the 8B's head dimension (128), for checking the GPU paths quickly
SMALL = {"hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 1024, "vocab_size": 1024,
         "max_position_embeddings": 16384}
SHAPES = {"8b": LLAMA3_8B, "small": SMALL, "tiny": TINY}


def build(shape: dict, dtype: torch.dtype, device: str, window: int):
    """A converted Llama with random weights, built on ``device`` in ``dtype``."""
    from hedgecats.models import HybridConfig, convert_to_hybrid
    from transformers import LlamaConfig, LlamaForCausalLM

    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    finally:
        torch.set_default_dtype(old)
    convert_to_hybrid(model.eval(), HybridConfig(window=window))
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cache_bytes(cache) -> int:
    from hedgecats.models.cache import HybridCache

    if isinstance(cache, HybridCache):
        return cache.state_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)


def new_cache(model, kind: str):
    from hedgecats.models.cache import HybridCache
    from transformers import DynamicCache

    return HybridCache(model) if kind == "hybrid" else DynamicCache(config=model.config)


def prefill(model, cache, ids: torch.Tensor, device: str) -> float:
    """Seconds for one forward of ``ids`` into ``cache``."""
    from hedgecats.models.decode import CACHE_KWARG

    sync(device)
    t = time.perf_counter()
    with torch.no_grad():
        model(input_ids=ids, **{CACHE_KWARG: cache}, use_cache=True, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t


def timed_prefill(model, kind: str, ids: torch.Tensor, device: str, repeats: int):
    """Median seconds of ``repeats`` prefills of ``ids`` after one untimed prefill of the same
    length (kernels specialise and autotune per length: the first call at a new length measured
    compilation, 541 tokens/s at 1k on the first H200 run), and the cache of the last one."""
    prefill(model, new_cache(model, kind), ids, device)
    times, cache = [], None
    for _ in range(repeats):
        cache = None
        free()
        cache = new_cache(model, kind)
        times.append(prefill(model, cache, ids, device))
    return statistics.median(times), cache


def eager_steps(model, cache, start: int, batch: int, steps: int, warmup: int,
                device: str) -> float:
    """Seconds per decode step: forward of one token per sequence + argmax (as generate)."""
    from hedgecats.models.decode import CACHE_KWARG

    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    with torch.no_grad():
        for i in range(warmup + steps):
            pos = torch.full((batch, 1), start + i, dtype=torch.long, device=device)
            sync(device)
            t = time.perf_counter()
            logits = model(input_ids=ids, position_ids=pos, **{CACHE_KWARG: cache},
                           use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t)
    return statistics.median(times)


def graph_steps(model, cache, start: int, batch: int, steps: int, warmup: int,
                device: str) -> float:
    """Seconds per decode step replayed from a CUDA graph (mean over ``steps``)."""
    from hedgecats.models.decode import GraphedDecoder

    dec = GraphedDecoder(model, cache, warmup=warmup)
    start += warmup
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    sync(device)
    t = time.perf_counter()
    for i in range(steps):
        pos = torch.full((batch, 1), start + i, dtype=torch.long, device=device)
        ids = dec(ids, pos)[:, -1:].argmax(-1)
    sync(device)
    return (time.perf_counter() - t) / steps


def static_cache_like(model, dyn_cache, batch: int, length: int, capacity: int):
    """transformers' StaticCache of ``capacity`` positions holding ``length`` tokens: the keys of
    ``dyn_cache`` (batch 1, repeated) or random ones when it is None."""
    from transformers import StaticCache

    cfg = model.config
    p = next(model.parameters())
    cache = StaticCache(config=cfg, max_cache_len=capacity)
    cache.early_initialization(batch, cfg.num_key_value_heads,
                               cfg.hidden_size // cfg.num_attention_heads, p.dtype, p.device)
    for i, layer in enumerate(cache.layers):
        if dyn_cache is None:
            layer.keys[:, :, :length].normal_()
            layer.values[:, :, :length].normal_()
        else:
            layer.keys[:, :, :length] = dyn_cache.layers[i].keys
            layer.values[:, :, :length] = dyn_cache.layers[i].values
        layer.cumulative_length.fill_(length)  # transformers' counter of the static layer
    return cache


def _fused_steps() -> int:
    from hedgecats.models.ops.instrument import TRACE

    return TRACE.calls["decode.step"]


def run_latency(model, contexts, args, device) -> list[dict]:
    from hedgecats.models import set_attention_mode

    rows = []
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for L in contexts:
        ids = torch.randint(0, vocab, (1, L), generator=gen).to(device)
        for mode in ("hybrid", "softmax"):
            row = {"mode": mode, "context": L}
            set_attention_mode(model, mode)
            cache = snapshot = None
            fused_before = _fused_steps()
            try:
                dt, cache = timed_prefill(model, mode, ids, device, args.prefill_repeats)
                row.update(prefill_tokens_per_s=L / dt, cache_bytes=cache_bytes(cache))
                # the graph's cache, as the prefill left it: a copy of the (small) HybridCache,
                # a StaticCache holding the prefilled keys for softmax
                if args.graphs:
                    snapshot = (copy.deepcopy(cache) if mode == "hybrid" else static_cache_like(
                        model, cache, 1, L, L + args.steps + args.warmup + 8))
                row["eager_ms_per_token"] = 1e3 * eager_steps(model, cache, L, 1, args.steps,
                                                              args.warmup, device)
                cache = None  # the eager cache is not needed any more
                free()
                if args.graphs:
                    row["graph_ms_per_token"] = 1e3 * graph_steps(model, snapshot, L, 1,
                                                                  args.steps, args.warmup, device)
            except Exception as err:  # noqa: BLE001 - recorded, the run goes on
                row["error"] = f"{type(err).__name__}: {err}"[:500]
            # layer steps that took the fused kernels (ops.triton_decode), eager and captured:
            # 0 for a hybrid row means every step was the composed one
            row["fused_layer_steps"] = _fused_steps() - fused_before
            cache = snapshot = None
            free()
            rows.append(row)
            print(json.dumps(row), flush=True)
    set_attention_mode(model, "hybrid")
    return rows


def _fits(mode, model, base_cache, batch, L, args, device) -> float | None:
    """Seconds per decode step at ``batch``, or None when it does not fit in memory."""
    cache = None
    try:
        if mode == "hybrid":
            cache = copy.deepcopy(base_cache)
            cache.batch_repeat_interleave(batch)
        else:
            cache = static_cache_like(model, None, batch, L, L + args.steps + args.warmup + 8)
        step = graph_steps if args.graphs else eager_steps
        return step(model, cache, L, batch, args.batch_steps, args.warmup, device)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        del cache
        free()


def run_batch(model, L: int, args, device) -> dict:
    """Largest batch per mode at context L (doubling, then bisecting) and its tokens/s."""
    from hedgecats.models import set_attention_mode

    out = {"context": L}
    ids = torch.randint(0, model.config.vocab_size, (1, L),
                        generator=torch.Generator().manual_seed(1)).to(device)
    for mode in ("hybrid", "softmax"):
        set_attention_mode(model, mode)
        res: dict = {}
        try:
            base = None
            if mode == "hybrid":
                base = new_cache(model, "hybrid")
                prefill(model, base, ids, device)
            tried: dict[int, float | None] = {}
            b = 1
            while b <= args.max_batch:
                tried[b] = _fits(mode, model, base, b, L, args, device)
                print(json.dumps({"mode": mode, "batch": b, "s_per_step": tried[b]}), flush=True)
                if tried[b] is None:
                    break
                b *= 2
            good = max((k for k, v in tried.items() if v is not None), default=None)
            bad = min((k for k, v in tried.items() if v is None), default=None)
            for _ in range(args.bisect if good and bad else 0):
                mid = (good + bad) // 2
                if mid in (good, bad):
                    break
                tried[mid] = _fits(mode, model, base, mid, L, args, device)
                good, bad = (mid, bad) if tried[mid] is not None else (good, mid)
            res = {"largest_batch": good, "first_failing_batch": bad,
                   "capped_at_max_batch": bad is None,
                   "s_per_step": tried.get(good) if good else None,
                   "tokens_per_s": good / tried[good] if good else None,
                   "tried": {str(k): v for k, v in sorted(tried.items())}}
            del base
        except Exception as err:  # noqa: BLE001
            res = {"error": f"{type(err).__name__}: {err}"[:500],
                   "where": traceback.format_exc(limit=-4)[-1500:]}
            print(res["where"], file=sys.stderr, flush=True)
        free()
        out[mode] = res
    set_attention_mode(model, "hybrid")
    return out


def targets(latency: list[dict], batch: dict | None) -> dict:
    """Issue 13's targets, each with the numbers it was judged on (None: not measured)."""
    def col(mode, key):
        return {r["context"]: r.get(key) for r in latency if r["mode"] == mode}

    t: dict = {}
    hb = col("hybrid", "cache_bytes")
    if hb and None not in hb.values():
        t["hybrid_cache_constant"] = {"bytes": hb, "ok": len(set(hb.values())) == 1}
    for kind in ("graph", "eager"):
        hm, sm = col("hybrid", f"{kind}_ms_per_token"), col("softmax", f"{kind}_ms_per_token")
        vals = [v for v in hm.values() if v is not None]
        if len(vals) == len(hm) and vals:
            t[f"hybrid_{kind}_flat_within_10pct"] = {"ms": hm, "ok": max(vals) <= 1.1 * min(vals)}
        first = min(hm) if hm else None
        if first is not None and hm.get(first) is not None and sm.get(first) is not None:
            t[f"hybrid_{kind}_not_slower_than_softmax_at_{first}"] = {
                "hybrid_ms": hm[first], "softmax_ms": sm[first], "ok": hm[first] <= sm[first]}
    if batch and "tokens_per_s" in batch.get("hybrid", {}) and \
            "tokens_per_s" in batch.get("softmax", {}):
        h, s = batch["hybrid"]["tokens_per_s"], batch["softmax"]["tokens_per_s"]
        if h and s:
            t["batch_throughput_5x_at_context"] = {"context": batch["context"], "ratio": h / s,
                                                  "ok": h / s >= 5.0}
    return t


def markdown(latency: list[dict], batch: dict | None) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = ["| context | mode | prefill tok/s | cache MiB | eager ms/token | graph ms/token |",
             "|---|---|---|---|---|---|"]
    for r in latency:
        if "error" in r:
            lines.append(f"| {r['context']} | {r['mode']} | error: {r['error'][:80]} | | | |")
            continue
        lines.append(f"| {r['context']} | {r['mode']} | {f(r.get('prefill_tokens_per_s'), ',.0f')}"
                     f" | {f(r.get('cache_bytes', 0) / 2**20, ',.1f')}"
                     f" | {f(r.get('eager_ms_per_token'), '.2f')}"
                     f" | {f(r.get('graph_ms_per_token'), '.2f')} |")
    if batch:
        lines += ["", f"Largest batch at context {batch['context']}:", "",
                  "| mode | largest batch | ms/step | tokens/s |", "|---|---|---|---|"]
        for mode in ("hybrid", "softmax"):
            b = batch.get(mode, {})
            if "error" in b:
                lines.append(f"| {mode} | error: {b['error'][:80]} | | |")
                continue
            capped = " (cap)" if b.get("capped_at_max_batch") else ""
            sps = b.get("s_per_step")
            lines.append(f"| {mode} | {b.get('largest_batch')}{capped} | "
                         f"{f(sps * 1e3 if sps else None, '.1f')} | "
                         f"{f(b.get('tokens_per_s'), ',.0f')} |")
    return "\n".join(lines)


def combine(paths: list[str], out: str, md: str | None) -> int:
    """One result from several runs: latency rows concatenated, the last batch part."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    latency = [r for run in runs for r in run["latency"]]
    batch = next((run["batch"] for run in reversed(runs) if run.get("batch")), None)
    result = {**runs[0], "command": [run["command"] for run in runs], "latency": latency,
              "contexts": sorted({r["context"] for r in latency}), "batch": batch,
              "targets": targets(latency, batch)}
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(latency, batch)
    print(table)
    print(json.dumps(result["targets"], indent=2))
    if md:
        Path(md).write_text(table + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="--shape tiny --device cpu (smoke test)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="8b")
    p.add_argument("--device", help="default: cuda when available")
    p.add_argument("--contexts", help="comma-separated prompt lengths")
    p.add_argument("--parts", default="latency,batch", help="latency, batch or both")
    p.add_argument("--batch-context", type=int, help="context of the batch part (32k)")
    p.add_argument("--steps", type=int, help="timed decode steps per measurement")
    p.add_argument("--batch-steps", type=int, help="timed steps per batch trial")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prefill-repeats", type=int, default=2,
                   help="timed prefills per context (median), after one untimed")
    p.add_argument("--max-batch", type=int, help="largest batch tried")
    p.add_argument("--bisect", type=int, default=3, help="bisection steps after doubling")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--no-graphs", dest="graphs", action="store_false", default=None)
    p.add_argument("--out", default="decode_speed.json")
    p.add_argument("--md", help="also write the Markdown table here")
    p.add_argument("--combine", nargs="+", metavar="JSON",
                   help="no measuring: merge the results of earlier runs (e.g. --parts latency "
                        "and --parts batch run as two commands) into --out, targets and table")
    args = p.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out, args.md)
    if args.tiny:
        args.shape, args.device = "tiny", "cpu"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    small = args.shape != "8b"
    contexts = ([int(c) for c in args.contexts.split(",")] if args.contexts
                else [64, 512] if small else [1024, 8192, 32768, 131072 - 1024])
    args.graphs = device == "cuda" if args.graphs is None else args.graphs and device == "cuda"
    args.steps = args.steps or (4 if small else 32)
    args.batch_steps = args.batch_steps or (2 if small else 8)
    args.max_batch = args.max_batch or (4 if small else 16384)
    L_batch = args.batch_context or (512 if small else 32768)
    # a prompt must leave its decode steps room in the base model's positions (Llama-3.1: 128k
    # in all, so the longest default prompt is 128k - 1k)
    room = max(args.steps, args.batch_steps) + args.warmup + 8
    too_long = [c for c in contexts + [L_batch] if c + room > shape["max_position_embeddings"]]
    if too_long:
        p.error(f"contexts {too_long} leave no room for {room} decode positions in the model's "
                f"{shape['max_position_embeddings']}; use at most "
                f"{shape['max_position_embeddings'] - room}")
    parts = {x.strip() for x in args.parts.split(",")}
    if not parts <= {"latency", "batch"}:
        p.error(f"--parts {args.parts!r}: choose from latency, batch")

    from hedgecats.models.ops.hybrid import backends

    model = build(shape, dtype, device, args.window)
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else platform.machine(),
           "fla": backends.available("fla"), "graphs": args.graphs, "dtype": str(dtype)}
    print(json.dumps(env), flush=True)
    latency = run_latency(model, contexts, args, device) if "latency" in parts else []
    batch = run_batch(model, L_batch, args, device) if "batch" in parts else None
    command = ["python", "-m", "benchmarks.decode_speed", *(sys.argv[1:] if argv is None else argv)]
    result = {"command": " ".join(command), "env": env, "shape": shape, "window": args.window,
              "contexts": contexts, "latency": latency, "batch": batch,
              "targets": targets(latency, batch)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(latency, batch)
    print(table)
    print(json.dumps(result["targets"], indent=2))
    if args.md:
        Path(args.md).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
