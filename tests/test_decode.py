"""The decode benchmark's CPU smoke mode, and the CUDA-graph decoder's refusals (its GPU tests
are in tests/test_decode_gpu.py)."""

from __future__ import annotations

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
    out = tmp_path / "decode.json"
    rc = _bench().main(["--tiny", "--contexts", "32,96", "--steps", "2", "--batch-steps", "1",
                        "--max-batch", "2", "--warmup", "1", "--out", str(out),
                        "--md", str(tmp_path / "decode.md")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("python benchmarks/decode_speed.py --tiny")
    rows = {(r["mode"], r["context"]): r for r in res["latency"]}
    assert set(rows) == {(m, c) for m in ("hybrid", "softmax") for c in (32, 96)}
    for r in rows.values():
        assert "error" not in r, r
        assert r["prefill_tokens_per_s"] > 0 and r["eager_ms_per_token"] > 0
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
