"""Conversion of transformers Llama / Mistral / Qwen2 models, mode switching, config checks."""

from __future__ import annotations

import pytest
import torch
from hedgecats.models import (
    HybridConfig,
    attention_mode,
    convert_to_hybrid,
    hybrid_layers,
    hybrid_parameter_names,
    set_attention_mode,
)
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
}


def tiny(family="llama", seed=0):
    torch.manual_seed(seed)
    return FAMILIES[family]().eval()


def ids(B=2, T=45, seed=1):
    return torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_softmax_mode_reproduces_transformers_logits(family):
    model = tiny(family)
    x = ids()
    with torch.no_grad():
        expected = model(x).logits
        convert_to_hybrid(model, HybridConfig(window=8))
        with attention_mode(model, "softmax"):
            got = model(x).logits
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_original_weights_untouched_and_new_submodules(family):
    model = tiny(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_to_hybrid(model, HybridConfig(window=8))
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    new = sorted(set(after) - set(before))
    expected = sorted(f"model.layers.{i}.self_attn.{m}.{p}" for i in range(3)
                      for m in ("phi_q", "phi_k") for p in ("weight", "bias"))
    assert new == expected  # the fixed mixer has no parameters
    assert model.config._attn_implementation == "hedgecats"


def test_hybrid_differs_from_softmax_and_modes_differ():
    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    x = ids(T=40)
    outs = {}
    with torch.no_grad():
        for mode in ("hybrid", "swa_only", "la_only", "sinks_only", "none", "softmax"):
            with attention_mode(model, mode):
                outs[mode] = model(x).logits
    for a in outs:
        for b in outs:
            if a < b:
                assert not torch.allclose(outs[a], outs[b]), (a, b)


def test_only_feature_maps_and_mixer_get_gradients_when_base_frozen():
    model = convert_to_hybrid(tiny(), HybridConfig(window=4, mixer="learned_head"))
    names = set(hybrid_parameter_names(model))
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    model.train()
    x = ids(T=30)
    model(x, labels=x).loss.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == names
    assert len(names) == 3 * 5  # phi_q.{weight,bias}, phi_k.{weight,bias}, mixer.logit_g


@pytest.mark.parametrize("mixer", ["fixed", "learned_head", "shared_norm", "gate_elementwise",
                                   "gate_lowrank", "la_mass"])
def test_every_mixer_runs_and_trains(mixer):
    model = convert_to_hybrid(tiny(), HybridConfig(window=4, mixer=mixer, gate_rank=4))
    x = ids(T=30)
    model.train()
    model(x, labels=x).loss.backward()
    mixer_params = [(n, p) for n, p in model.named_parameters() if ".mixer." in n]
    assert (len(mixer_params) == 0) == (mixer in ("fixed", "la_mass"))
    for n, p in mixer_params:
        assert p.grad is not None and torch.isfinite(p.grad).all(), n


def test_gate_starts_at_fixed_g():
    """Gates and learned mixers start at the paper's g: same logits as the fixed mixer."""
    x = ids(T=30)
    outs = []
    for mixer in ("fixed", "learned_head", "gate_elementwise", "gate_lowrank"):
        model = convert_to_hybrid(tiny(), HybridConfig(window=4, mixer=mixer))
        with torch.no_grad():
            outs.append(model(x).logits)
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["learned_head", "shared_norm", "gate_elementwise",
                                   "gate_lowrank", "la_mass"])
def test_every_mixer_runs_a_bf16_model_without_autocast(mixer):
    """A bf16 model converted in place (its new weights fp32 masters) runs in bf16 without
    autocast, as generation right after conversion does (the output gates' Linear refused
    bf16 inputs against fp32 weights: found by the GPU decode tests)."""
    model = convert_to_hybrid(tiny().to(torch.bfloat16), HybridConfig(window=4, mixer=mixer))
    with torch.no_grad():
        out = model(ids(T=12)).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("mode", ["hybrid", "swa_only", "la_only", "sinks_only", "softmax"])
def test_left_padding_respected(mode):
    """A left-padded sequence gives the same logits at its real tokens as the sequence alone,
    given position ids that start at its first real token (phi of RoPE'd q, k is not a function
    of relative position only, so LA needs the same absolute positions); pad keys are masked
    in every branch, and the sinks are the first real keys, not the pads."""
    model = convert_to_hybrid(tiny(), HybridConfig(window=5, mode=mode))
    x = ids(B=1, T=30)
    pad = 7
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), x], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)], 1)
    other = ids(B=1, T=30 + pad, seed=9)  # a second, unpadded row in the batch
    batch = torch.cat([padded, other])
    bmask = torch.cat([mask, torch.ones_like(other)])
    with torch.no_grad():
        alone = model(x).logits
        pos = (bmask.cumsum(-1) - 1).clamp_min(0)
        both = model(batch, attention_mask=bmask, position_ids=pos).logits
        other_alone = model(other).logits
    torch.testing.assert_close(both[0, pad:], alone[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], other_alone[0], rtol=1e-4, atol=1e-4)


def test_attention_mode_restores_every_switch():
    model = convert_to_hybrid(tiny(), HybridConfig(window=6, layer_windows={1: 3}))
    before = [(i, a.hedgecats.mode, a.hedgecats.window, a.hedgecats.rescale)
              for i, a in hybrid_layers(model)]
    assert [b[2] for b in before] == [6, 3, 6]
    with attention_mode(model, "la_only", rescale=True, window=16, la_span="all"):
        assert all(a.hedgecats.mode == "la_only" and a.hedgecats.window == 16
                   for _, a in hybrid_layers(model))
    after = [(i, a.hedgecats.mode, a.hedgecats.window, a.hedgecats.rescale)
             for i, a in hybrid_layers(model)]
    assert after == before
    set_attention_mode(model, "swa_only")
    assert {a.hedgecats.mode for _, a in hybrid_layers(model)} == {"swa_only"}


def test_partial_conversion_leaves_other_layers_softmax():
    """Only the listed layers convert; layer 0 keeps the original attention, so its output is
    the original model's even when the converted layers run with no attention at all."""
    model = tiny()
    x = ids()
    with torch.no_grad():
        expected = model(x, output_hidden_states=True).hidden_states[1]
    convert_to_hybrid(model, HybridConfig(window=4, layers=[1, 2]))
    assert [i for i, _ in hybrid_layers(model)] == [1, 2]
    assert not hasattr(model.model.layers[0].self_attn, "phi_q")
    with torch.no_grad(), attention_mode(model, "none"):
        out = model(x, output_hidden_states=True)
    torch.testing.assert_close(out.hidden_states[1], expected)
    with torch.no_grad():
        assert not torch.allclose(out.hidden_states[2], model(x, output_hidden_states=True)
                                  .hidden_states[2])


def test_ssd_drop_applies_only_in_training():
    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    x = ids(T=30)
    with torch.no_grad():
        hybrid = model(x).logits
        with attention_mode(model, "la_only"):
            la_only = model(x).logits
        set_attention_mode(model, ssd_p=1.0)
        torch.testing.assert_close(model(x).logits, hybrid)  # eval: no dropout
        model.train()
        torch.testing.assert_close(model(x).logits, la_only)  # p = 1: every layer dropped
        set_attention_mode(model, ssd_p=0.0)
        torch.testing.assert_close(model(x).logits, hybrid)


def test_observer_sees_qkv():
    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    seen = []
    set_attention_mode(model, observer=lambda m, q, k, v, kpm, x: seen.append((m.hedgecats.layer_idx,
                                                                               q.shape, k.shape)))
    with torch.no_grad():
        model(ids(T=11))
    assert seen == [(i, (2, 4, 11, 16), (2, 2, 11, 16)) for i in range(3)]


def test_observer_that_wants_it_gets_the_teachers_output():
    """An observer marked ``wants_teacher_output`` is called in softmax mode after the
    attention, with its output (B, H, T, D): causal softmax of the q, k, v it sees; the model's
    output is the same as without any observer."""
    from hedgecats.models.ops.hybrid.reference import repeat_kv

    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    x = ids(T=11)
    set_attention_mode(model, "softmax")
    with torch.no_grad():
        plain = model(x).logits
    seen = []

    def observer(m, q, k, v, kpm, hidden, teacher_output=None):
        want = torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), is_causal=True)
        seen.append((m.hedgecats.layer_idx, (teacher_output - want).abs().max().item()))

    observer.wants_teacher_output = True
    set_attention_mode(model, observer=observer)
    with torch.no_grad():
        observed = model(x).logits
    assert [i for i, _ in seen] == [0, 1, 2] and max(e for _, e in seen) < 1e-5
    torch.testing.assert_close(observed, plain, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["base-window-acting", "base-window-idle", "dropout"])
def test_teacher_output_is_handed_over_only_where_it_is_plain_causal_softmax(case):
    """The hand-over is for plain causal softmax only: where a base model's own window acts on
    the sequence, or its attention dropout is on (train mode), the observer is called before
    the attention without it (the objectives then compute full causal softmax themselves)."""
    torch.manual_seed(0)
    if case == "dropout":
        base = LlamaForCausalLM(LlamaConfig(**SMALL, attention_dropout=0.5))
    else:
        base = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4))
    model = convert_to_hybrid(base, HybridConfig(window=4))
    model.train(case == "dropout")
    got = []

    def observer(m, q, k, v, kpm, hidden, teacher_output=None):
        got.append(teacher_output is not None)

    observer.wants_teacher_output = True
    set_attention_mode(model, "softmax", observer=observer)
    with torch.no_grad():
        model(ids(T=4 if case == "base-window-idle" else 11))
    assert got == [case == "base-window-idle"] * 3


# ----------------------------------------------------------------------------- errors
def test_other_family_raises_before_building():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="type 'gpt2'.*llama, mistral, qwen2"):
        convert_to_hybrid(gpt2, HybridConfig(window=4))
    assert not any("phi_q" in n for n, _ in gpt2.named_parameters())


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=0), "window=0 must be an integer >= 1"),
    (dict(window=4, mode="hybird"), "mode='hybird'.*hybrid, swa_only"),
    (dict(window=4, feature_activation="gelu"), "feature_activation='gelu'"),
    (dict(window=4, mixer="shared_norm", overlap=True), "counted twice"),
    (dict(window=4, mixer="la_mass", overlap=True), "mixer='la_mass'.*counted twice"),
    (dict(window=4, mixer="la_mass", window_shape="terraced_end"), "'sliding' or 'terraced'"),
    (dict(window=4, mixer="la_mass", feature_activation="none"), "non-negative features"),
    (dict(window=4, mixer="learned_head", g=0.0), "strictly between 0 and 1"),
    (dict(window=4, g=1.5), r"g=1.5 must lie in \[0, 1\]"),
    (dict(window=4, layers=[0, 1], layer_windows={2: 8}), "names layers \\[2\\]"),
    (dict(window=4, mode="sinks_only", n_sinks=0), "n_sinks=0"),
])
def test_config_contradictions_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HybridConfig(**kwargs)


def test_model_dependent_errors():
    # (an odd head dim cannot be built with RoPE; the halving check is in test_hybrid_ops)
    with pytest.raises(ValueError, match=r"layer indices \[5\] are out of range.*3 layers"):
        convert_to_hybrid(tiny(), HybridConfig(window=4, layers=[0, 5]))
    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    with pytest.raises(ValueError, match="already converted"):
        convert_to_hybrid(model, HybridConfig(window=4))
    with pytest.raises(ValueError, match="unknown switch 'windw'"):
        set_attention_mode(model, "hybrid", windw=3)
    with pytest.raises(ValueError, match="no hybrid layers"):
        set_attention_mode(tiny(), "la_only")


def test_config_round_trip():
    cfg = HybridConfig(window=8, layer_windows={0: 4}, mixer="gate_lowrank")
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown HybridConfig fields \\['windw'\\]"):
        HybridConfig.from_dict({"windw": 3})


# ----------------------------------------------------------------------------- base sliding window
def windowed_mistral(window=16, seed=0):
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(**SMALL, sliding_window=window)).eval()


@pytest.mark.parametrize("layers", [None, [1]], ids=["all", "partial"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "leftpad"])
def test_mistral_own_window_kept_beyond_it(layers, padded):
    """Mistral-7B-v0.1 has a 4096 sliding window: after conversion (which lifts it from the
    config) the softmax mode, and unconverted layers, must still apply it."""
    x = ids(B=2, T=40)
    mask = torch.ones_like(x)
    if padded:
        mask[1, :7] = 0
    with torch.no_grad():
        want = windowed_mistral()(x, attention_mask=mask).logits
        model = convert_to_hybrid(windowed_mistral(), HybridConfig(window=4, mode="softmax",
                                                                   layers=layers))
        got = model(x, attention_mask=mask).logits
        full = MistralForCausalLM(MistralConfig(**SMALL, sliding_window=None)).eval()
        full.load_state_dict(windowed_mistral().state_dict())
        unwindowed = full(x, attention_mask=mask).logits
    assert model.config.sliding_window is None
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-5
    assert (unwindowed - want)[real].abs().max() > 1e-3  # the window does matter at T=40


def test_cached_decoding_equals_full_forward_beyond_base_window():
    """Greedy decoding with a KV cache past Mistral's own window: every key stays in the cache
    (linear attention reads them all), so the cached logits equal a full forward's."""
    model = convert_to_hybrid(windowed_mistral(), HybridConfig(window=4))
    x = ids(B=1, T=20)
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        seq = out.sequences
        full = model(seq[:, :-1]).logits[:, x.shape[1] - 1:]
    cached = torch.stack(out.logits, dim=1)
    assert (cached - full).abs().max() < 1e-4


def test_evicted_cache_raises():
    from transformers import DynamicCache

    model = convert_to_hybrid(windowed_mistral(window=8), HybridConfig(window=4))
    model.config.sliding_window = 8  # a sliding-window cache, as transformers would make it
    cache = DynamicCache(config=model.config)
    x = ids(B=1, T=12)
    with torch.no_grad():
        model(x, past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="older keys were dropped"):
            model(x[:, -1:], past_key_values=cache, use_cache=True,
                  position_ids=torch.tensor([[12]]))


def test_qwen2_sliding_layers_refused():
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=8,
                                         max_window_layers=1)).eval()
    with pytest.raises(ValueError, match="sliding-window layers"):
        convert_to_hybrid(model, HybridConfig(window=4))
    assert not any(hasattr(layer.self_attn, "phi_q") for layer in model.model.layers)


def test_mixed_dtypes_reach_the_kernels_as_one_dtype(monkeypatch):
    """Under bf16 autocast with an fp32 base, RoPE gives fp32 q, k and the projection a bf16 v;
    the backends take one dtype (mixed calls went to the slow paths on the GPU)."""
    from hedgecats.models import cache, layer
    from hedgecats.models.ops.hybrid import attention as hybrid

    seen, maps_out = [], []
    real, real_maps = layer.hybrid_attention, hybrid._apply_maps

    def spy(q, k, v, fq, fk, **kw):  # (the layer hands over the maps: fq, fk None)
        seen.append([q.dtype, k.dtype, v.dtype])
        return real(q, k, v, fq, fk, **kw)

    def spy_maps(maps, q, k):
        out = real_maps(maps, q, k)
        maps_out.append([x.dtype for x in out])
        return out

    monkeypatch.setattr(layer, "hybrid_attention", spy)
    monkeypatch.setattr(cache, "hybrid_attention", spy)  # (use_cache: the cache's prefill)
    monkeypatch.setattr(hybrid, "_apply_maps", spy_maps)
    model = convert_to_hybrid(tiny(), HybridConfig(window=4))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model(ids(T=12), use_cache=False)
        n_layers = len(seen)
        model(ids(T=12), use_cache=True)
    assert n_layers and len(seen) == 2 * n_layers and len(maps_out) == len(seen)
    assert all(set(d) == {torch.bfloat16} for d in seen + maps_out), (seen, maps_out)
    q32, v16 = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    assert {t.dtype for t in layer._common_dtype(q32, q32, v16)} == {torch.float32}  # no autocast


def test_a_config_without_the_kernel_floor_warns(caplog):
    """Configs saved before the LA kernel floor record eps = fp32's tiny; loading one says so."""
    import logging

    with caplog.at_level(logging.WARNING, logger="hedgecats.models.config"):
        HybridConfig(eps=1.1754943508222875e-38)
    assert "below the LA kernel floor" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hedgecats.models.config"):
        HybridConfig()
        HybridConfig(eps=1e-38, window_shape="terraced")  # a LoLCATs import: on purpose
    assert not caplog.text


def test_layer_runtime_fields_are_hybrid_config_fields():
    """``LayerRuntime`` declares no switch of its own: each is a ``HybridConfig`` field, with its
    type and default, and a converted layer starts from its config's values."""
    import dataclasses

    from hedgecats.models.layer import LAYER_FIELDS, LayerRuntime

    cfg_fields = {f.name: f for f in dataclasses.fields(HybridConfig)}
    rt_fields = {f.name: f for f in dataclasses.fields(LayerRuntime)}
    assert set(rt_fields) == {"layer_idx", "observer", *LAYER_FIELDS}
    assert set(HybridConfig.RUNTIME) <= set(LAYER_FIELDS)
    for name in LAYER_FIELDS:
        assert (rt_fields[name].type, rt_fields[name].default) == \
            (cfg_fields[name].type, cfg_fields[name].default), name
    cfg = HybridConfig(window=4, layer_windows={1: 2}, mode="la_only", window_shape="terraced")
    model = convert_to_hybrid(tiny(), cfg)
    for i, attn in hybrid_layers(model):
        assert attn.hedgecats == LayerRuntime(
            layer_idx=i, **{n: getattr(cfg, n) for n in LAYER_FIELDS if n != "window"},
            window=cfg.window_for(i))


def test_one_vocabulary_of_modes_and_switches():
    """``models.config`` defines the modes and switches once: the switches are HybridConfig's
    runtime fields, with its types and choices; text and YAML variants share the checks."""
    from hedgecats.models.config import (
        MODES,
        SWITCHES,
        parse_variant,
        parse_variant_mapping,
        validate_switches,
    )

    assert list(SWITCHES) == [n for n in HybridConfig.RUNTIME if n != "mode"]
    assert SWITCHES["la_span"].choices == ("outside", "all") and SWITCHES["rescale"].kind is bool
    assert "softmax" in MODES
    assert parse_variant("la_only+rescale+la_span=all") == ("la_only", {"rescale": True,
                                                                         "la_span": "all"})
    assert parse_variant_mapping({"la_span": "all", "modes": ["la_only"]}) == (
        ("la_only",), {"la_span": "all"})
    assert parse_variant_mapping({"rescale": True}) == (("swa_only", "la_only"), {"rescale": True})
    for call, match in [
        (lambda: parse_variant_mapping({"la_span": "all"}),  # default modes include swa_only
         "switch 'la_span' has no effect in mode 'swa_only'; it applies to: la_only"),
        (lambda: parse_variant_mapping({"rescale": True, "modes": ["la_olny"]}),
         "unknown attention mode 'la_olny'; did you mean 'la_only'"),
        (lambda: validate_switches({"n_sinks": 0}), "'n_sinks': it takes an integer >= 1"),
        (lambda: validate_switches({"windw": 3}), "unknown switch 'windw'; did you mean 'window'"),
        (lambda: parse_variant("hybrid+backend=fla"), "'backend' cannot be set in a variant"),
    ]:
        with pytest.raises(ValueError, match=match):
            call()


def test_key_padding_mask_reduced_once_per_mask():
    """Every layer of one forward gets the same 4D mask: it is reduced (and synced on) once;
    the same tensor changed in place, another kv_len or an inference tensor is reduced again."""
    from hedgecats.models import masks as L

    calls = []
    real_any = torch.Tensor.any

    def counting_any(self, *a, **kw):
        calls.append(1)
        return real_any(self, *a, **kw)
    mask = torch.zeros(2, 1, 5, 5)
    mask[0, ..., :2] = torch.finfo(mask.dtype).min  # row 0: two padded keys
    torch.Tensor.any = counting_any
    try:
        first = L.key_padding_mask(mask, 5)
        assert first.tolist() == [[False, False, True, True, True], [True] * 5]
        assert L.key_padding_mask(mask, 5) is first and len(calls) == 1
        assert L.key_padding_mask(mask, 4).shape == (2, 4) and len(calls) == 2
        mask[1, ..., 0] = torch.finfo(mask.dtype).min  # in place: the version moves
        assert L.key_padding_mask(mask, 4)[1].tolist() == [False, True, True, True]
        assert len(calls) == 3
        with torch.inference_mode():
            inf = torch.zeros(1, 1, 3, 3)
            inf[..., 0] = torch.finfo(inf.dtype).min
            for _ in range(2):
                assert L.key_padding_mask(inf, 3).tolist() == [[False, True, True]]
        assert len(calls) == 5
    finally:
        torch.Tensor.any = real_any


def test_odd_query_groups_convert_train_and_decode():
    """Qwen2-7B's grouping (7 query heads a kv head) in miniature: the softmax mode reproduces
    transformers' logits, the hybrid trains (finite gradients of every feature map), and greedy
    decoding with the hybrid's cache equals a full forward past the window."""
    torch.manual_seed(0)
    cfg = dict(SMALL, hidden_size=112, num_attention_heads=7, num_key_value_heads=1)
    model = Qwen2ForCausalLM(Qwen2Config(**cfg)).eval()
    x = ids(B=2, T=30)
    with torch.no_grad():
        expected = model(x).logits
    convert_to_hybrid(model, HybridConfig(window=4))
    with torch.no_grad(), attention_mode(model, "softmax"):
        assert (model(x).logits - expected).abs().max().item() < 1e-5
    model.train()
    model(x).logits.float().square().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if ".phi_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval()
    prompt = ids(B=1, T=12)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        full = model(out.sequences[:, :-1]).logits[:, prompt.shape[1] - 1:]
    assert (torch.stack(out.logits, dim=1) - full).abs().max() < 1e-4
