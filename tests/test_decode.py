"""The decode benchmark's CPU smoke mode, and the CUDA-graph decoder's refusals (its GPU tests
are in tests/test_decode_gpu.py)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hedgecats.models import HybridConfig, convert_to_hybrid
from hedgecats.models.cache import HybridCache
from hedgecats.models.decode import CACHE_KWARG, GraphedDecoder
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("decode_speed", ROOT / "benchmarks" /
                                                  "decode_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_benchmark_tiny_mode(tmp_path):
    """Both parts, run as two commands and combined (as on the GPU, where each command has a
    time limit)."""
    bench, out = _bench(), tmp_path / "decode.json"
    common = ["--tiny", "--contexts", "32,96", "--steps", "2", "--batch-steps", "1",
              "--max-batch", "2", "--warmup", "1"]
    assert bench.main([*common, "--parts", "latency", "--out", str(tmp_path / "a.json")]) == 0
    assert bench.main([*common, "--parts", "batch", "--out", str(tmp_path / "b.json")]) == 0
    assert bench.main(["--combine", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                       "--out", str(out), "--md", str(tmp_path / "decode.md")]) == 0
    res = json.loads(out.read_text())
    assert res["command"][0].startswith("python -m benchmarks.decode_speed --tiny")
    rows = {(r["mode"], r["context"]): r for r in res["latency"]}
    assert set(rows) == {(m, c) for m in ("hybrid", "softmax") for c in (32, 96)}
    for r in rows.values():
        assert "error" not in r, r
        assert r["prefill_tokens_per_s"] > 0 and r["eager_ms_per_token"] > 0
        assert r["fused_layer_steps"] == 0  # the fused decode step is a CUDA path
        assert "graph_ms_per_token" not in r  # no CUDA graphs on the CPU
    # the hybrid's cache does not grow with the context, transformers' does
    assert rows["hybrid", 32]["cache_bytes"] == rows["hybrid", 96]["cache_bytes"]
    assert rows["softmax", 96]["cache_bytes"] == 3 * rows["softmax", 32]["cache_bytes"]
    assert res["targets"]["hybrid_cache_constant"]["ok"]
    for mode in ("hybrid", "softmax"):
        b = res["batch"][mode]
        assert b["largest_batch"] == 2 and b["capped_at_max_batch"] and b["tokens_per_s"] > 0
    assert "| 96 | hybrid |" in (tmp_path / "decode.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only refusal")
def test_graphed_decoder_needs_cuda():
    model = convert_to_hybrid(LlamaForCausalLM(LlamaConfig(
        vocab_size=31, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2)).eval(), HybridConfig(window=2))
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        GraphedDecoder(model, HybridCache(model))


def test_cache_kwarg_is_the_models():
    import inspect

    from transformers import LlamaModel

    assert CACHE_KWARG in inspect.signature(LlamaModel.forward).parameters


class _NoHostReads:
    """Makes every read of a tensor's value into Python an error (what a CUDA graph capture
    refuses: ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``.tolist()``, ``.nonzero()``),
    and says a capture is going on, so that code which skips such reads while capturing does."""

    NAMES = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(name):
            def f(t, *a, **k):
                raise AssertionError(f"host read-back: Tensor.{name} on {tuple(t.shape)}")
            return f

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse(n))
        self.capturing = torch.cuda.is_current_stream_capturing
        torch.cuda.is_current_stream_capturing = lambda: True
        self.available = torch.cuda.is_available
        torch.cuda.is_available = lambda: True
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)
        torch.cuda.is_current_stream_capturing = self.capturing
        torch.cuda.is_available = self.available


@pytest.mark.parametrize("mode", ["hybrid", "la_only", "sinks_only", "none"])
def test_hybrid_decode_step_reads_nothing_back_to_the_host(mode):
    """What GraphedDecoder captures -- a model forward of one token per sequence with a
    prefilled HybridCache, no mask, position ids given -- is checked on the CPU for host
    read-backs, which a CUDA graph capture cannot contain."""
    model = convert_to_hybrid(LlamaForCausalLM(LlamaConfig(
        vocab_size=31, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval(),
        HybridConfig(window=4, mode=mode, mixer="gate_lowrank", gate_rank=2))
    cache = HybridCache(model)
    x = torch.randint(0, 31, (2, 9))
    with torch.no_grad():
        model(x, **{CACHE_KWARG: cache})
        ids, pos = torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), 9)
        want = model(ids, position_ids=pos, **{CACHE_KWARG: copy.deepcopy(cache)}).logits
        with _NoHostReads():
            got = model(input_ids=ids, position_ids=pos, **{CACHE_KWARG: cache},
                        use_cache=True).logits
    torch.testing.assert_close(got, want)


def test_softmax_static_cache_step_reads_nothing_back_to_the_host():
    """The softmax baseline's graph step: the same model in mode softmax with transformers'
    StaticCache holding the prefilled keys (the benchmark's ``static_cache_like``)."""
    from transformers import DynamicCache

    bench = _bench()
    model = convert_to_hybrid(LlamaForCausalLM(LlamaConfig(
        vocab_size=31, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval(), HybridConfig(window=4,
                                                                            mode="softmax"))
    dyn = DynamicCache(config=model.config)
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 9)
    with torch.no_grad():
        model(torch.randint(0, 31, (1, 9)), **{CACHE_KWARG: dyn})
        static = bench.static_cache_like(model, dyn, 1, 9, 20)
        want = model(input_ids=ids, position_ids=pos, **{CACHE_KWARG: dyn}).logits
        with _NoHostReads():
            got = model(input_ids=ids, position_ids=pos, **{CACHE_KWARG: static},
                        use_cache=True).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
