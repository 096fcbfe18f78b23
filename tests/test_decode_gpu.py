"""Generation and saved hybrids on the GPU (bf16, the fast kernels for prefill), and decode steps
replayed from CUDA graphs. Marked ``gpu``: skipped without CUDA. On the GPU machine:

    python -m pytest -q -m gpu tests/test_decode_gpu.py

Tolerances: logits are compared by relative L2 error; 2e-2 is the bf16 level (the cached path
and the full forward round their activations to bf16 at different points: prefill through fla,
decode steps through the fp32-accumulating reference).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hedgecats.models import HybridConfig, attention_mode, convert_to_hybrid
from hedgecats.models.cache import HybridCache, HybridLayerCache, generated_cache
from hedgecats.models.decode import CACHE_KWARG, GraphedDecoder
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

pytestmark = pytest.mark.gpu

SHAPE = dict(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
MODES = ("hybrid", "swa_only", "la_only", "sinks_only", "none")
BF16 = 2e-2


def gpu_hybrid(cfg: HybridConfig, seed: int = 0):
    # built in bf16 the way from_pretrained(dtype=bf16) builds it: rotary inv_freq stays fp32
    # (``.to(torch.bfloat16)`` would round that buffer too, and a reloaded model, whose
    # inv_freq is fp32, would then differ from it in every mode, softmax included)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(LlamaConfig(**SHAPE), dtype=torch.bfloat16).eval()
    convert_to_hybrid(model, cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".phi_" in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ids(B=1, T=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (B, T), generator=g).cuda()


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def cached(model, x, splits, cache=None):
    cache = HybridCache(model) if cache is None else cache
    outs, t = [], 0
    with torch.no_grad():
        for n in splits:
            outs.append(model(x[:, t:t + n], **{CACHE_KWARG: cache}).logits)
            t += n
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("overlap", [False, True], ids=["outside", "overlap"])
def test_cached_logits_equal_full_forward_bf16(mode, overlap):
    model = gpu_hybrid(HybridConfig(window=64, layer_windows={1: 32}, overlap=overlap, mode=mode))
    x = ids()
    with torch.no_grad():
        full = model(x).logits
    got, _ = cached(model, x, [200, 1, 1, 1, 50, 1, 46])
    assert torch.isfinite(got).all()
    assert rel(got, full) < BF16, (mode, overlap, rel(got, full))


def test_prefill_state_equals_token_by_token_bf16():
    model = gpu_hybrid(HybridConfig(window=16))
    x = ids(T=120)
    _, one = cached(model, x, [120])
    _, steps = cached(model, x, [1] * 120)
    for a, b in zip(one.layers, steps.layers):
        assert isinstance(a, HybridLayerCache)
        assert rel(b.S, a.S) < BF16 and rel(b.z, a.z) < BF16
        assert torch.equal(a.n_state, b.n_state)


def test_generate_batched_left_padding_bf16():
    model = gpu_hybrid(HybridConfig(window=16))
    x = ids(B=3, T=40)
    mask = torch.ones_like(x)
    mask[0, :7] = 0
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=24, do_sample=True,
                             top_k=20, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
        seq = out.sequences
        m = torch.cat([mask, torch.ones(3, seq.shape[1] - 40, dtype=mask.dtype, device="cuda")], 1)
        pos = (m.cumsum(-1) - 1).clamp_min(0)
        full = model(seq, attention_mask=m, position_ids=pos).logits[:, 39:-1]
    assert isinstance(generated_cache(out), HybridCache)
    assert rel(torch.stack(out.logits, 1), full) < BF16


def test_save_load_bit_identical_on_gpu(tmp_path):
    model = gpu_hybrid(HybridConfig(window=16, layers=[1], mixer="learned_head"))
    x = ids(T=100)
    want = {}
    with torch.no_grad():
        for mode in MODES + ("softmax",):
            with attention_mode(model, mode):
                want[mode] = model(x).logits
                again = model(x).logits
            assert torch.equal(again, want[mode]), f"{mode}: the kernels are not deterministic"
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        for mode, w in want.items():
            with attention_mode(loaded, mode):
                assert torch.equal(loaded(x).logits, w), mode


def _eager_steps(model, cache, start, tokens):
    outs = []
    with torch.no_grad():
        for i, t in enumerate(tokens):
            pos = torch.tensor([[start + i]], device="cuda")
            outs.append(model(input_ids=t.view(1, 1), position_ids=pos,
                              **{CACHE_KWARG: cache}).logits)
    return torch.cat(outs, 1)


def test_graphed_decoder_replays_the_hybrid_step():
    model = gpu_hybrid(HybridConfig(window=16, overlap=False))
    x = ids(T=100)
    _, cache = cached(model, x, [100])
    graph_cache = copy.deepcopy(cache)
    tokens = ids(T=12, seed=5)[0]
    dec = GraphedDecoder(model, graph_cache, warmup=2)
    _eager_steps(model, cache, 100, torch.zeros(2, dtype=torch.long, device="cuda"))  # warm-up
    want = _eager_steps(model, cache, 102, tokens)
    got = torch.cat([dec(t.view(1, 1), torch.tensor([[102 + i]], device="cuda")).clone()
                     for i, t in enumerate(tokens)], 1)
    assert rel(got, want) < 1e-3
    assert graph_cache.get_seq_length() == cache.get_seq_length() == 114


def test_graphed_decoder_keeps_the_host_count():
    """Warm-up steps count, the capture does not, every replay does."""
    model = gpu_hybrid(HybridConfig(window=16))
    _, cache = cached(model, ids(T=50), [50])
    dec = GraphedDecoder(model, cache, warmup=1)
    assert cache.get_seq_length() == 51
    dec(torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.tensor([[51]], device="cuda"))
    assert cache.get_seq_length() == 52 and int(cache.layers[0].pos) == 52


def test_graphed_decoder_with_a_static_cache_in_softmax_mode():
    bench = _bench()
    model = gpu_hybrid(HybridConfig(window=16, mode="softmax"))
    x = ids(T=100)
    dyn = DynamicCache(config=model.config)
    with torch.no_grad():
        model(x, **{CACHE_KWARG: dyn})
    static = bench.static_cache_like(model, dyn, 1, 100, 140)
    tokens = ids(T=10, seed=5)[0]
    dec = GraphedDecoder(model, static, warmup=1)
    _eager_steps(model, dyn, 100, torch.zeros(1, dtype=torch.long, device="cuda"))  # warm-up
    want = _eager_steps(model, dyn, 101, tokens)
    got = torch.cat([dec(t.view(1, 1), torch.tensor([[101 + i]], device="cuda")).clone()
                     for i, t in enumerate(tokens)], 1)
    assert rel(got, want) < BF16


def test_graphed_decoder_refuses_growing_caches():
    model = gpu_hybrid(HybridConfig(window=16, layers=[0]))
    _, cache = cached(model, ids(T=20), [20])
    with pytest.raises(ValueError, match="layers \\[1\\] are not converted"):
        GraphedDecoder(model, cache)
    with pytest.raises(TypeError, match="DynamicCache cannot be replayed"):
        GraphedDecoder(model, DynamicCache(config=model.config))


def _bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "decode_speed.py"
    spec = importlib.util.spec_from_file_location("decode_speed", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_decode_benchmark_small_shape_on_gpu(tmp_path):
    """Every path of the benchmark (graphs included) on a small model: no row has an error."""
    out = tmp_path / "d.json"
    assert _bench().main(["--shape", "small", "--device", "cuda", "--contexts", "256,1024",
                          "--steps", "4", "--batch-steps", "2", "--max-batch", "64",
                          "--batch-context", "1024", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for row in res["latency"]:
        assert "error" not in row, row
        assert row["graph_ms_per_token"] > 0
        assert (row["fused_layer_steps"] > 0) == (row["mode"] == "hybrid"), row
    for mode in ("hybrid", "softmax"):
        assert "error" not in res["batch"][mode], res["batch"][mode]


# ----------------------------------------------------------------------------- the fused step
HEADS_8B = dict(SHAPE, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2)


def _steps_from(model, cache, x, start, fused: bool):
    """Logits of single-token steps x[:, start:] from a copy of ``cache``, with the fused
    decode step (``ops.decode``) or the composed one."""
    from hedgecats.models.ops.hybrid import backends
    from hedgecats.models.ops.instrument import TRACE

    cache = copy.deepcopy(cache)
    before = TRACE.calls["decode.step"]
    outs = []
    ctx = contextlib.nullcontext() if fused else backends.triton_disabled()
    with torch.no_grad(), ctx:
        for t in range(start, x.shape[1]):
            outs.append(model(x[:, t:t + 1], **{CACHE_KWARG: cache}).logits.float())
    return torch.cat(outs, 1), cache, TRACE.calls["decode.step"] - before


def _model_8b_heads(mixer: str, mode: str, dtype: torch.dtype):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(LlamaConfig(**HEADS_8B), dtype=dtype).eval()
    convert_to_hybrid(model, HybridConfig(window=64, mixer=mixer, mode=mode, n_sinks=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".phi_" in n or ".mixer." in n:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("mixer,mode", [("fixed", "hybrid"), ("shared_norm", "hybrid"),
                                        ("gate_elementwise", "hybrid"), ("fixed", "swa_only"),
                                        ("learned_head", "la_only")])
def test_fused_decode_step_equals_the_composed_step_at_8b_heads(mixer, mode):
    """Llama-3-8B's head shape (D 128, square maps F 256, 4 query heads per KV head, window 64),
    bf16, one prefill then 90 steps (keys leave the window into the state, sinks fill): the
    fused step against the composed one from the same prefilled cache (tf32 products, bf16
    rounding, and the composed step's PyTorch feature map, which rounds to bf16 earlier)."""
    model = _model_8b_heads(mixer, mode, torch.bfloat16)
    x = ids(B=2, T=40 + 90)
    _, cache = cached(model, x, [40])
    got, c_got, used = _steps_from(model, cache, x, 40, fused=True)
    want, c_want, unused = _steps_from(model, cache, x, 40, fused=False)
    assert used == 2 * 90 and unused == 0
    assert rel(got, want) < BF16, rel(got, want)
    for a, b in zip(c_got.layers, c_want.layers):
        for name in ("S", "z", "vsum"):
            assert rel(getattr(a, name), getattr(b, name)) < BF16, name
        for name in ("real", "n_state", "n_real", "sink_real", "pos"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_fp32_models_decode_with_the_composed_step_on_cuda():
    """fp32 on CUDA takes the composed step: the fused kernels measured 4e-4 from the fp32
    reference there (``decode.dispatch.unsupported_reason``)."""
    model = _model_8b_heads("fixed", "hybrid", torch.float32)
    x = ids(B=1, T=50)
    _, cache = cached(model, x, [40])
    _, _, used = _steps_from(model, cache, x, 40, fused=True)
    assert used == 0


def test_fused_feature_map_past_the_grid_axis_limit():
    """B * H above 65535 (a large decode batch: 2048 sequences x 32 heads): the feature-map
    kernel's grid puts B * H on its first axis (the others CUDA limits to 65535: a launch
    there fails with "invalid argument")."""
    from hedgecats.models.ops.feature_map import dispatch, reference

    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, D, FH = 8200, 8, 128, 128
    x = torch.randn(B, H, 1, D, device="cuda", generator=g).to(torch.bfloat16)
    w = 0.1 * torch.randn(H, D, FH, device="cuda", generator=g)
    b = torch.zeros(H, FH, device="cuda")
    got = dispatch.hedgehog_features(x, w, b, "softmax")
    assert got is not None
    assert rel(got, reference.reference_features(x, w, b, "softmax")) < BF16


def test_graphed_decoder_replays_the_fused_step(trace):
    model = gpu_hybrid(HybridConfig(window=16))
    x = ids(T=60)
    _, cache = cached(model, x, [60])
    before = trace.calls["decode.step"]
    dec = GraphedDecoder(model, cache, warmup=1)
    assert trace.calls["decode.step"] > before  # warm-up and capture took the fused step
    tokens = ids(T=30, seed=7)[0]
    got = torch.cat([dec(t.view(1, 1), torch.tensor([[61 + i]], device="cuda")).clone()
                     for i, t in enumerate(tokens)], 1)
    with torch.no_grad():
        full = model(torch.cat([x[0], torch.zeros(1, dtype=torch.long, device="cuda"),
                                tokens])[None]).logits[:, 61:]
    assert rel(got, full) < BF16
    assert cache.get_seq_length() == int(cache.layers[0].pos) == 91
