"""The constant-memory HybridCache: cached logits equal a full forward in every mode, prefill ends
in the state token-by-token decoding reaches, generate works with it, bad use is refused."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from hedgecats.models import HybridConfig, attention_mode, convert_to_hybrid, hybrid_layers
from hedgecats.models.cache import (
    HybridCache,
    HybridLayerCache,
    generated_cache,
    layer_state_bytes,
)
from hedgecats.models.ops.hybrid.reference import linear_attention_chunked
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    MistralConfig,
    MistralForCausalLM,
)

#: the keyword under which a cache reaches the model (transformers 5.24 renamed it)
CACHE_KW = ("cache" if "cache" in inspect.signature(LlamaModel.forward).parameters
            else "past_key_values")
SMALL = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LA_MODES = ("hybrid", "swa_only", "la_only")
MODES = LA_MODES + ("sinks_only", "none")


def tiny(hybrid: HybridConfig, seed: int = 0, family: str = "llama", **cfg):
    torch.manual_seed(seed)
    if family == "mistral":
        model = MistralForCausalLM(MistralConfig(**{**SMALL, **cfg}))
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**SMALL, **cfg}))
    convert_to_hybrid(model.eval(), hybrid)
    with torch.no_grad():  # feature maps away from their identity init
        for n, p in model.named_parameters():
            if ".phi_" in n or ".mixer." in n:
                p.add_(0.3 * torch.randn_like(p))
    return model


def ids(B=2, T=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=g)


def run_cached(model, x, splits, cache=None, **kw):
    """Logits of x fed in pieces (``splits``: lengths) through one cache."""
    cache = HybridCache(model) if cache is None else cache
    outs, t = [], 0
    for n in splits:
        outs.append(model(x[:, t:t + n], **{CACHE_KW: cache}, **kw).logits)
        t += n
    assert t == x.shape[1]
    return torch.cat(outs, 1), cache


# the pieces: a prefill shorter and longer than the window, single steps, chunks after a cache
SPLITS = [12, 1, 1, 1, 5, 1, 9, 1, 1, 8]  # 40 tokens


# ----------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("shift", [0, 5])
def test_reference_la_state_equals_the_keys_it_sums(shift):
    """LA over [prefix ++ rest] for the queries of ``rest`` equals LA over ``rest`` started from
    the prefix's state, when the prefix is outside every query's shift (what a cache holds)."""
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, F, D, P, T = 2, 4, 2, 6, 5, 9, 13
    fq = torch.rand(B, H, T, F, generator=g)
    fk = torch.rand(B, Hkv, P + T, F, generator=g)
    v = torch.randn(B, Hkv, P + T, D, generator=g)
    kpm = torch.ones(B, P + T, dtype=torch.bool)
    kpm[1, :4] = False  # left padding in row 1
    # the prefix's first `shift` keys stay local (queries 0.. see keys <= t - shift)
    cut = P - shift
    want, den_w, has_w = linear_attention_chunked(fq, fk, v, shift=shift, key_padding_mask=kpm)
    keep = kpm[:, :cut, None].float()
    S = torch.einsum("bhnf,bhnd->bhfd", fk[:, :, :cut] * keep[:, None], v[:, :, :cut])
    z = (fk[:, :, :cut] * keep[:, None]).sum(2)
    vsum = (v[:, :, :cut] * keep[:, None]).sum(2)
    got, den, has = linear_attention_chunked(fq, fk[:, :, cut:], v[:, :, cut:], shift=shift,
                                             key_padding_mask=kpm[:, cut:],
                                             state=(S, z, kpm[:, :cut].sum(1), vsum), eps=0.3)
    want, den_w, has_w = linear_attention_chunked(fq, fk, v, shift=shift, key_padding_mask=kpm,
                                                  eps=0.3)  # a floor large enough to matter
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(den, den_w, rtol=1e-5, atol=1e-6)
    assert torch.equal(has, has_w)


# ----------------------------------------------------------------------------- cached == full
@pytest.mark.parametrize(
    "mode, overlap", [(m, False) for m in MODES] + [(m, True) for m in LA_MODES],
    ids=lambda v: v if isinstance(v, str) else ("overlap" if v else "outside"))
def test_cached_logits_equal_full_forward(mode, overlap):
    """Per-layer windows, GQA, a prefill, steps and chunks; every mode, both LA spans."""
    model = tiny(HybridConfig(window=6, layer_windows={1: 3}, overlap=overlap, mode=mode))
    x = ids()
    with torch.no_grad():
        full = model(x).logits
        got, cache = run_cached(model, x, SPLITS)
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == x.shape[1]


@pytest.mark.parametrize("switches", [
    dict(mode="la_only", la_span="all"), dict(mode="swa_only", rescale=True),
    dict(mode="la_only", rescale=True), dict(mode="sinks_only", n_sinks=3)],
    ids=["la_span_all", "swa_rescale", "la_rescale", "sinks3"])
def test_cached_logits_with_ablation_switches(switches):
    model = tiny(HybridConfig(window=5))
    x = ids(T=30)
    with torch.no_grad(), attention_mode(model, **switches):
        full = model(x).logits
        got, _ = run_cached(model, x, [7, 1, 1, 10, 1, 10])
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["learned_head", "shared_norm", "gate_lowrank", "la_mass"])
def test_cached_logits_with_mixers(mixer):
    model = tiny(HybridConfig(window=5, mixer=mixer, gate_rank=4))
    x = ids(T=30)
    with torch.no_grad():
        full = model(x).logits
        got, _ = run_cached(model, x, [9, 1, 1, 8, 1, 10])
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_partial_conversion_and_mistral_base_window():
    """Layer 1 stays softmax with Mistral's own window of 7 (applied by our attention function,
    its slot a full DynamicLayer); the converted layers use their windows."""
    model = tiny(HybridConfig(window=4, layers=[0, 2]), family="mistral", sliding_window=7)
    assert model.config.sliding_window is None
    x = ids(T=30)
    with torch.no_grad():
        full = model(x).logits
        got, cache = run_cached(model, x, [10, 1, 1, 1, 9, 8])
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)
    assert cache.full_layers == [1]
    assert not isinstance(cache.layers[1], HybridLayerCache)


def test_mode_may_change_between_calls():
    """The cache keeps window, state and sinks in every mode, so a later call may use another
    (one layer: its keys do not depend on the mode of a layer below)."""
    model = tiny(HybridConfig(window=4), num_hidden_layers=1)
    x = ids(T=24)
    cache = HybridCache(model)
    with torch.no_grad():
        with attention_mode(model, "sinks_only"):
            model(x[:, :10], **{CACHE_KW: cache})
        with attention_mode(model, "none"):
            model(x[:, 10:14], **{CACHE_KW: cache})
        got = model(x[:, 14:], **{CACHE_KW: cache}).logits
        want = model(x).logits[:, 14:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_left_padding_cached_equals_full():
    model = tiny(HybridConfig(window=5))
    x = ids(B=2, T=26)
    mask = torch.ones_like(x)
    mask[0, :6] = 0  # row 0 left-padded
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(x, attention_mask=mask, position_ids=pos).logits
        cache, outs, t = HybridCache(model), [], 0
        for n in (9, 1, 1, 7, 1, 7):
            outs.append(model(x[:, t:t + n], attention_mask=mask[:, :t + n],
                              position_ids=pos[:, t:t + n], **{CACHE_KW: cache}).logits)
            t += n
    got = torch.cat(outs, 1)
    torch.testing.assert_close(got[0, 6:], full[0, 6:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], full[1], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- the state
def _layer_state(cache: HybridCache):
    out = []
    for layer in cache.layers:
        if isinstance(layer, HybridLayerCache):
            order = torch.arange(layer.seen - layer.window, layer.seen) % layer.window
            out.append({"S": layer.S, "z": layer.z, "n_state": layer.n_state,
                        "keys": layer.keys[:, :, order], "values": layer.values[:, :, order],
                        "real": layer.real[:, order], "sink_keys": layer.sink_keys[:, :, :-1],
                        "sink_real": layer.sink_real, "n_real": layer.n_real})
    return out


def test_prefill_ends_in_the_state_of_token_by_token_decoding():
    model = tiny(HybridConfig(window=4, layer_windows={2: 7}, n_sinks=3))
    x = ids(T=33)
    with torch.no_grad():
        _, one = run_cached(model, x, [33])
        _, steps = run_cached(model, x, [1] * 33)
        _, chunks = run_cached(model, x, [5, 11, 17])
    a, b, c = _layer_state(one), _layer_state(steps), _layer_state(chunks)
    for la, lb, lc in zip(a, b, c):
        for name in la:
            torch.testing.assert_close(lb[name], la[name], rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(lc[name], la[name], rtol=1e-5, atol=1e-5, msg=name)
    assert int(a[0]["n_state"][0]) == 33 - 4 and int(a[2]["n_state"][0]) == 33 - 7


def test_memory_does_not_grow_with_the_context():
    model = tiny(HybridConfig(window=4))
    x = ids(B=1, T=300)
    with torch.no_grad():
        _, short = run_cached(model, x[:, :20], [20])
        _, long = run_cached(model, x, [200, 1, 1, 98])
    assert short.state_bytes() == long.state_bytes()
    D = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    per_layer = layer_state_bytes(1, SMALL["num_key_value_heads"], D, 2 * D, 4, 8,
                                  dtype=torch.float32)
    assert long.state_bytes() == 3 * per_layer


# ----------------------------------------------------------------------------- generate
@pytest.mark.parametrize("mode", MODES)
def test_generate_greedy_uses_hybrid_cache_and_matches_full_forward(mode):
    model = tiny(HybridConfig(window=4, mode=mode))
    x = ids(B=1, T=9)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=12, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences).logits[:, x.shape[1] - 1:-1]
    assert isinstance(generated_cache(out), HybridCache)
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-5, atol=1e-5)


def test_generate_batch_left_padding_and_sampling():
    model = tiny(HybridConfig(window=4, overlap=True))
    x = ids(B=3, T=10)
    mask = torch.ones_like(x)
    mask[0, :3], mask[2, :5] = 0, 0
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=True,
                             top_k=20, temperature=0.8, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        seq = out.sequences
        m = torch.cat([mask, torch.ones(3, seq.shape[1] - x.shape[1], dtype=mask.dtype)], 1)
        pos = (m.cumsum(-1) - 1).clamp_min(0)
        full = model(seq, attention_mask=m, position_ids=pos).logits[:, x.shape[1] - 1:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), full, rtol=1e-5, atol=1e-5)


def test_generate_beam_search_matches_uncached_beam_search():
    model = tiny(HybridConfig(window=4))
    x = ids(B=2, T=8)
    with torch.no_grad():
        cached = model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False,
                                pad_token_id=0, return_dict_in_generate=True)
        plain = model.generate(x, max_new_tokens=8, num_beams=3, do_sample=False,
                               pad_token_id=0, use_cache=False)
    assert isinstance(generated_cache(cached), HybridCache)
    assert torch.equal(cached.sequences, plain)


def test_softmax_mode_keeps_the_full_cache_and_says_so(caplog):
    from hedgecats.models import hf

    model = tiny(HybridConfig(window=4, mode="softmax"))
    x = ids(B=1, T=6)
    hf._warn_once.cache_clear()  # the warning is given once per process
    with caplog.at_level(logging.WARNING, logger="hedgecats.models.hf"), torch.no_grad():
        out = model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
    assert type(generated_cache(out)) is DynamicCache
    assert "mode 'softmax', which reads every earlier key" in caplog.text
    with pytest.raises(ValueError, match="mode 'softmax'.*reads every earlier key"):
        model(x, **{CACHE_KW: HybridCache(model)})


# ----------------------------------------------------------------------------- direct calls
def test_a_direct_call_with_use_cache_gets_the_constant_memory_cache():
    """Called with use_cache=True and no cache (a custom decode loop, speculative decoding, an
    evaluation harness), a converted model gets a HybridCache, as from generate: its size does
    not grow with the context (transformers' DynamicCache held 4x more at 256 tokens than at
    64), and decoding on from it gives the full forward's logits."""
    model = tiny(HybridConfig(window=4))
    with torch.no_grad():
        caches = {T: generated_cache(model(ids(B=1, T=T), use_cache=True)) for T in (64, 256)}
    assert all(type(c) is HybridCache for c in caches.values()), caches
    assert caches[64].state_bytes() == caches[256].state_bytes()
    x = ids(B=2, T=30)
    with torch.no_grad():
        out = model(x[:, :20], use_cache=True)
        logits, cache = [out.logits], generated_cache(out)
        for t in range(20, 30):
            logits.append(model(x[:, t:t + 1], **{CACHE_KW: cache}, use_cache=True).logits)
        full = model(x, use_cache=False).logits
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["fixed", "gate_lowrank"])
def test_the_default_use_cache_gets_it_too_and_the_logits_do_not_change(mixer):
    """``model(x)`` (the config's use_cache=True) also gets the HybridCache, and its logits are
    those of the call without a cache, bit for bit: the prefill is the layer's ordinary call."""
    model = tiny(HybridConfig(window=4, mixer=mixer))
    x = ids(B=2, T=40)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    with torch.no_grad():
        for kw in ({}, {"attention_mask": mask}):
            out = model(x, **kw)
            assert type(generated_cache(out)) is HybridCache
            assert torch.equal(out.logits, model(x, use_cache=False, **kw).logits)


def test_training_and_observed_calls_keep_transformers_cache(caplog):
    """A model in train mode, or with an observer (attention transfer, branch usage: they read
    whole sequences), keeps transformers' own cache, silently; mode softmax keeps the full
    cache and says so when a cache was asked for."""
    from hedgecats.models import hf

    model = tiny(HybridConfig(window=4))
    x = ids(B=1, T=12)
    with torch.no_grad():
        assert type(generated_cache(model.train()(x))) is DynamicCache
        model.eval()
        seen = []
        with attention_mode(model, observer=lambda *a, **k: seen.append(1)):
            assert type(generated_cache(model(x, use_cache=True))) is DynamicCache
        assert seen
        hf._warn_once.cache_clear()
        with attention_mode(model, "softmax"), \
                caplog.at_level(logging.WARNING, logger="hedgecats.models.hf"):
            assert type(generated_cache(model(x, use_cache=True))) is DynamicCache
    assert "mode 'softmax', which reads every earlier key" in caplog.text
    assert "full DynamicCache" in caplog.text


# ----------------------------------------------------------------------------- bad use
def test_cache_handed_to_another_model_is_refused():
    a, b = tiny(HybridConfig(window=4)), tiny(HybridConfig(window=4), seed=1)
    cache = HybridCache(a)
    with pytest.raises(ValueError, match="not made for this model"):
        b(ids(T=5), **{CACHE_KW: cache})
    plain = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()  # a softmax model: no binding hook
    with pytest.raises(RuntimeError, match="not the hedgecats hybrid layer it was made for"):
        plain(ids(T=5), **{CACHE_KW: HybridCache(a)})


def test_changed_window_and_crop_are_refused():
    model = tiny(HybridConfig(window=4))
    cache = HybridCache(model)
    with torch.no_grad():
        model(ids(T=6), **{CACHE_KW: cache})
    with attention_mode(model, window=8), pytest.raises(ValueError, match="made for window 4"):
        model(ids(T=1), **{CACHE_KW: cache})
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="no converted layer"):
        HybridCache(LlamaForCausalLM(LlamaConfig(**SMALL)))


def test_context_past_the_base_models_positions_is_an_error():
    model = tiny(HybridConfig(window=4), max_position_embeddings=32)
    cache = HybridCache(model)
    with torch.no_grad():
        model(ids(T=30), **{CACHE_KW: cache})
        model(ids(T=2), **{CACHE_KW: cache})  # positions 30, 31: the last ones there are
        with pytest.raises(ValueError, match="position 32 is past the base model's "
                                             "max_position_embeddings=32"):
            model(ids(T=1), **{CACHE_KW: cache})
        with pytest.raises(ValueError, match="max_position_embeddings=32"):
            model.generate(ids(B=1, T=30), max_new_tokens=5, do_sample=False, pad_token_id=0)


def test_every_converted_layer_got_a_slot():
    model = tiny(HybridConfig(window=3, layer_windows={0: 2}))
    cache = HybridCache(model)
    assert [(s.layer_idx, s.window) for s in cache.layers] == [(0, 2), (1, 3), (2, 3)]
    assert [i for i, _ in hybrid_layers(model)] == [0, 1, 2]
