"""hedgecats.models.pretrain against readable references: the window against an explicit mask,
partial RoPE against a naive rotation, gate=none against LlamaForCausalLM, reload, counts."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from hedgecats.models.pretrain import (
    OutputGate,
    PartialRotaryEmbedding,
    PretrainConfig,
    PretrainLlamaConfig,
    PretrainLlamaForCausalLM,
    apply_partial_rotary,
    build_pretrain_model,
    load_pretrained,
    parameter_counts,
    resolve_attention_pattern,
    sliding_window_mask,
)
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

V = 259
SHAPE = {"vocab_size": V, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "intermediate_size": 48, "max_position_embeddings": 128, "pad_token_id": 257,
         "eos_token_id": 256}


def _cfg(**kw) -> PretrainConfig:
    return PretrainConfig(**{**SHAPE, **kw})


def _ids(B=2, T=24, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _randomise_gates(model, seed=1):
    """Gates start constant; give them input-dependent weights so that tests see them act."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".gate." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("pattern, layers, window, want", [
    (None, 3, None, (None, None, None)),
    ("SSSF", 8, 16, (16, 16, 16, None) * 2),
    ("S", 2, 4, (4, 4)),
    ("F", 2, None, (None, None)),
    ([8, "full", None, 3], 4, None, (8, None, None, 3)),
], ids=["none", "tiled-SSSF", "all-S", "all-F", "list"])
def test_pattern_resolves_per_layer(pattern, layers, window, want):
    assert resolve_attention_pattern(pattern, layers, window) == want


@pytest.mark.parametrize("kw, match", [
    ({"attention_pattern": "SXF", "num_layers": 3, "sliding_window": 4},
     r"'SXF'.*'F'.*'S'.*\['X'\]"),
    ({"attention_pattern": "SSF", "sliding_window": 4},
     r"'SSF' \(3 characters\) .* 2 layers: give \[1, 2\]"),
    ({"attention_pattern": "SF"}, r"sliding_window must be an int >= 1, got sliding_window=None"),
    ({"attention_pattern": "SF", "sliding_window": 0}, r"got sliding_window=0"),
    ({"attention_pattern": "FF", "sliding_window": 8},
     r"sliding_window=8 is given but .*'FF' has no 'S'"),
    ({"sliding_window": 8}, r"sliding_window=8 is given but attention_pattern is None"),
    ({"attention_pattern": [8]}, r"\[8\] has 1 entries for 2 layers"),
    ({"attention_pattern": [8, "half"]}, r"entry 1 = 'half' is not valid"),
    ({"attention_pattern": [8, 8], "sliding_window": 8}, r"sliding_window=8 is given with a list"),
    ({"output_gate": "headwise"}, r"output_gate='headwise' .* none, elementwise, lowrank"),
    ({"gate_rank": 0}, r"gate_rank=0 must be an int >= 1"),
    ({"gate_init": 1.0}, r"gate_init=1.0 must lie in \(0, 1\)"),
    ({"rope_fraction": 1.5}, r"rope_fraction=1.5 must lie in \[0, 1\]"),
    ({"rope_fraction": 0.3}, r"rope_fraction=0.3 gives 2.4 rotary dims of head_dim 8.*0.25 \(2"),
    ({"num_heads": 3}, r"hidden_size=32 is not a multiple of num_heads=3"),
    ({"num_kv_heads": 3}, r"num_kv_heads=3 must divide num_heads=4"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_configs_say_what_is_wrong(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_plain_config_builds_todays_llama_exactly():
    """The defaults give the LlamaForCausalLM that TeacherPretraining always built (the same
    config arguments, the same random draws)."""
    cfg = _cfg()
    assert cfg.is_plain
    model = build_pretrain_model(cfg, seed=3)
    assert type(model) is LlamaForCausalLM and model.config.model_type == "llama"
    old_cfg = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=48,
                          max_position_embeddings=128, rope_theta=10000.0, pad_token_id=257,
                          eos_token_id=256, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(3)
    old = LlamaForCausalLM(old_cfg)
    new_sd, old_sd = model.state_dict(), old.state_dict()
    assert new_sd.keys() == old_sd.keys()
    assert all(torch.equal(new_sd[k], old_sd[k]) for k in new_sd)
    assert model.config.to_json_string() == old.config.to_json_string()


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gate_none_full_attention_is_llama_exactly(impl):
    """Our attention module with no window, no gate and full RoPE computes Llama's logits
    bit for bit (forced through PretrainLlamaForCausalLM, which build_pretrain_model would not
    choose for such a config)."""
    cfg = _cfg()
    hf = PretrainLlamaConfig(**cfg.llama_config().to_dict(),
                              hedgecats_pretrain=cfg.options())
    torch.manual_seed(0)
    ours = PretrainLlamaForCausalLM(hf).eval()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(cfg.llama_config()).eval()
    for m in (ours, llama):
        m.set_attn_implementation(impl)
    ids = _ids()
    assert torch.equal(ours(ids).logits, llama(ids).logits)


def test_variants_share_the_plain_models_initial_weights():
    plain = build_pretrain_model(_cfg(), seed=5).state_dict()
    for kw in ({"attention_pattern": "SF", "sliding_window": 4, "output_gate": "lowrank",
                "gate_rank": 3},
               {"output_gate": "elementwise", "rope_fraction": 0.5}):
        sd = build_pretrain_model(_cfg(**kw), seed=5).state_dict()
        shared = [k for k in sd if ".gate." not in k]
        assert set(shared) == set(plain)
        assert all(torch.equal(sd[k], plain[k]) for k in shared), kw


# ----------------------------------------------------------------------------- references
def _naive_rotate(x_BHTD, pos_T, R, theta):
    """RoPE on dims 0..R-1 by explicit 2 x 2 rotations of the pairs (j, j + R/2)."""
    out = x_BHTD.clone()
    half = R // 2
    for j in range(half):
        freq = theta ** (-2.0 * j / R)
        for t, p in enumerate(pos_T.tolist()):
            c, s = math.cos(p * freq), math.sin(p * freq)
            a, b = x_BHTD[..., t, j], x_BHTD[..., t, j + half]
            out[..., t, j] = a * c - b * s
            out[..., t, j + half] = b * c + a * s
    return out


def _naive_layer(attn, x_BTC, window, R, theta):
    """One PretrainAttention by hand: projections, naive rotation, scores with the window mask
    built by loops, softmax, output gate, o_proj. x (B, T, C) -> (B, T, C)."""
    B, T, _ = x_BTC.shape
    D = attn.head_dim
    q = F.linear(x_BTC, attn.q_proj.weight).view(B, T, -1, D).transpose(1, 2)
    k = F.linear(x_BTC, attn.k_proj.weight).view(B, T, -1, D).transpose(1, 2)
    v = F.linear(x_BTC, attn.v_proj.weight).view(B, T, -1, D).transpose(1, 2)
    pos = torch.arange(T)
    q, k = _naive_rotate(q, pos, R, theta), _naive_rotate(k, pos, R, theta)
    H = q.shape[1]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    allowed_TT = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for i in range(T):
            allowed_TT[t, i] = i <= t and (window is None or i > t - window)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    out = scores.masked_fill(~allowed_TT, float("-inf")).softmax(-1) @ v  # (B, H, T, D)
    out = out.transpose(1, 2).reshape(B, T, -1)
    if attn.gate is not None:
        g = attn.gate
        h = x_BTC if g.down is None else F.linear(x_BTC, g.down.weight)
        out = out * torch.sigmoid(F.linear(h, g.up.weight, g.up.bias))
    return F.linear(out, attn.o_proj.weight)


@pytest.mark.parametrize("window, gate, frac", [
    (5, "none", 1.0), (5, "elementwise", 0.5), (1, "lowrank", 0.25), (None, "lowrank", 0.0),
    (40, "elementwise", 1.0)], ids=["w5", "w5-elem-rope.5", "w1-lowrank-rope.25",
                                    "full-lowrank-nope", "w40>T"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_layer_matches_explicit_reference(window, gate, frac, impl):
    cfg = _cfg(attention_pattern=["full" if window is None else window] * 2,
               output_gate=gate, gate_rank=3, rope_fraction=frac)
    model = build_pretrain_model(cfg, seed=0)
    model.set_attn_implementation(impl)
    _randomise_gates(model)
    attn = model.model.layers[0].self_attn
    x_BTC = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(2))
    pos = torch.arange(17)[None].expand(2, -1)
    cos, sin = model.model.rotary_emb(x_BTC, pos)
    got, _ = attn(x_BTC, position_embeddings=(cos, sin), attention_mask=None)
    want = _naive_layer(attn, x_BTC, window, cfg.rotary_dim, 10000.0)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_sliding_window_mask_against_loops():
    Tq, Tk, w = 3, 7, 3
    want = torch.tensor([[(Tk - Tq + t - w < i <= Tk - Tq + t) for i in range(Tk)]
                         for t in range(Tq)])
    assert torch.equal(sliding_window_mask(None, Tq, Tk, w, device="cpu")[0, 0], want)
    pad = torch.ones(2, 1, Tq, Tk, dtype=torch.bool)
    pad[1, ..., 5] = False  # a padded key in row 1
    got = sliding_window_mask(pad, Tq, Tk, w, device="cpu")
    assert torch.equal(got[0, 0], want) and torch.equal(got[1, 0], want & (torch.arange(Tk) != 5))
    add = sliding_window_mask(None, Tq, Tk, w, device="cpu", additive_dtype=torch.float32)[0, 0]
    assert torch.equal(add == 0, want) and (add[~want] == torch.finfo(torch.float32).min).all()
    zeros = torch.zeros(1, 1, Tq, Tk)
    assert torch.equal(sliding_window_mask(zeros, Tq, Tk, w, device="cpu")[0, 0], add)


def test_partial_rope_matches_a_naive_rotation():
    x_BHTD = torch.randn(2, 3, 9, 8, generator=torch.Generator().manual_seed(0))
    pos_BT = torch.arange(9)[None].expand(2, -1) + 4
    for R in (8, 4, 2):
        cos, sin = PartialRotaryEmbedding(R, 500.0)(x_BHTD, pos_BT)
        assert cos.shape == (2, 9, R)
        got = apply_partial_rotary(x_BHTD, cos, sin)
        torch.testing.assert_close(got, _naive_rotate(x_BHTD, pos_BT[0], R, 500.0))
        assert torch.equal(got[..., R:], x_BHTD[..., R:])
    # R = 0: NoPE; R = D: Llama's own rotation and frequencies
    cos0, sin0 = PartialRotaryEmbedding(0, 500.0)(x_BHTD, pos_BT)
    assert torch.equal(apply_partial_rotary(x_BHTD, cos0, sin0), x_BHTD)
    llama_cfg = LlamaConfig(hidden_size=24, num_attention_heads=3, rope_theta=500.0)
    cos, sin = LlamaRotaryEmbedding(llama_cfg)(x_BHTD, pos_BT)
    torch.testing.assert_close(PartialRotaryEmbedding(8, 500.0)(x_BHTD, pos_BT), (cos, sin))
    want, _ = apply_rotary_pos_emb(x_BHTD, x_BHTD, cos, sin)
    assert torch.equal(apply_partial_rotary(x_BHTD, cos, sin), want)


def test_nope_scores_do_not_depend_on_position():
    """rope_fraction = 0: shifting every position leaves the logits unchanged (with full RoPE
    too, relative positions are all that count; what NoPE adds is invariance of a single
    query-key product to where both sit, checked on the layer)."""
    model = build_pretrain_model(_cfg(rope_fraction=0.0), seed=0).eval()
    ids = _ids()
    a = model(ids, position_ids=torch.arange(24)[None]).logits
    b = model(ids, position_ids=torch.arange(24)[None] + 50).logits
    torch.testing.assert_close(a, b)
    rope = build_pretrain_model(_cfg(rope_fraction=0.5), seed=0).eval()
    c = rope(ids, position_ids=torch.arange(24)[None]).logits
    assert not torch.allclose(c, a)  # half the dims rotate: a different model


# ----------------------------------------------------------------------------- gates
@pytest.mark.parametrize("rank", [None, 4])
def test_gate_starts_at_gate_init_and_learns(rank):
    gate = OutputGate(32, 16, rank=rank, init=0.8)
    x = torch.randn(2, 5, 32)
    g = gate(x)
    assert g.shape == (2, 5, 16)
    torch.testing.assert_close(g, torch.full_like(g, 0.8))
    (g * torch.randn_like(g)).sum().backward()
    assert gate.up.weight.grad.abs().sum() > 0  # the first step already makes it input-dependent
    if rank is not None:
        assert gate.down.weight.abs().sum() > 0
        torch.testing.assert_close(gate.down.weight.std().item(), 32 ** -0.5, rtol=0.25, atol=0)


def test_saturated_gate_is_the_ungated_model():
    """With the gate pinned at 1 the layer computes sigmoid(.) * Attn = Attn: the gated model's
    logits equal those of the same model without a gate (same seed, so same shared weights)."""
    kw = {"attention_pattern": "SF", "sliding_window": 6, "rope_fraction": 0.5}
    gated = build_pretrain_model(_cfg(output_gate="elementwise", **kw), seed=0).eval()
    plain = build_pretrain_model(_cfg(**kw), seed=0).eval()
    with torch.no_grad():
        for layer in gated.model.layers:
            layer.self_attn.gate.up.bias.fill_(50.0)  # sigmoid(50) == 1.0 in fp32
    ids = _ids()
    assert torch.equal(gated(ids).logits, plain(ids).logits)
    with torch.no_grad():
        gated.model.layers[0].self_attn.gate.up.bias.fill_(0.0)
    assert not torch.allclose(gated(ids).logits, plain(ids).logits)


# ----------------------------------------------------------------------------- behaviour
VARIANT = {"attention_pattern": "SF", "sliding_window": 5, "output_gate": "lowrank",
           "gate_rank": 3, "rope_fraction": 0.5}


def test_window_as_long_as_the_sequence_is_full_attention():
    ids = _ids(T=20)
    full = build_pretrain_model(_cfg(output_gate="lowrank", gate_rank=3), seed=0).eval()
    long = build_pretrain_model(_cfg(output_gate="lowrank", gate_rank=3,
                                     attention_pattern="S", sliding_window=20), seed=0).eval()
    short = build_pretrain_model(_cfg(output_gate="lowrank", gate_rank=3,
                                      attention_pattern="S", sliding_window=19), seed=0).eval()
    torch.testing.assert_close(long(ids).logits, full(ids).logits)
    assert not torch.allclose(short(ids).logits[:, -1], full(ids).logits[:, -1])
    torch.testing.assert_close(short(ids).logits[:, :19], full(ids).logits[:, :19])


def test_implementations_and_right_padding_agree():
    model = build_pretrain_model(_cfg(**VARIANT), seed=0).eval()
    _randomise_gates(model)
    ids = _ids(T=20)
    padded = torch.cat([ids, torch.full((2, 4), 257)], dim=1)
    mask = torch.ones_like(padded)
    mask[:, 20:] = 0
    want = model(ids).logits
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        torch.testing.assert_close(model(ids).logits, want)
        torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, :20], want)
    model.set_attn_implementation("flex_attention")
    with pytest.raises(NotImplementedError, match="'flex_attention' takes no window.*sdpa, eager"):
        model(ids)


def test_cached_decoding_equals_a_full_forward():
    """SWA layers keep every key in the cache and restrict the window by position: decoding
    token by token past the window gives the full forward's logits."""
    model = build_pretrain_model(_cfg(**VARIANT), seed=0).eval()
    _randomise_gates(model)
    ids = _ids(T=16)
    want = model(ids).logits
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(ids[:, :6], use_cache=True)
    steps, cache = [out.logits], out.past_key_values
    for t in range(6, 16):
        out = model(ids[:, t:t + 1], use_cache=True, **{name: cache})
        steps.append(out.logits)
        cache = out.past_key_values
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-5, atol=1e-5)


def test_saved_model_reloads_with_identical_logits(tmp_path):
    model = build_pretrain_model(_cfg(**VARIANT), seed=0).eval()
    _randomise_gates(model)
    model.save_pretrained(tmp_path / "gated")
    ids = _ids()
    for loaded in (load_pretrained(tmp_path / "gated"),
                   AutoModelForCausalLM.from_pretrained(tmp_path / "gated"),
                   PretrainLlamaForCausalLM.from_pretrained(tmp_path / "gated")):
        assert type(loaded) is PretrainLlamaForCausalLM
        assert loaded.config.model_type == "hedgecats_pretrain"
        assert PretrainConfig.from_llama_config(loaded.config).to_dict() == \
            PretrainConfig.from_llama_config(model.config).to_dict()
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)
    plain = build_pretrain_model(_cfg(), seed=0).eval()
    plain.save_pretrained(tmp_path / "plain")
    loaded = load_pretrained(tmp_path / "plain")
    assert type(loaded) is LlamaForCausalLM and loaded.config.model_type == "llama"
    assert torch.equal(loaded.eval()(ids).logits, plain(ids).logits)


def test_parameter_counts_by_hand():
    C, H, Hkv, D, M, L = 32, 4, 2, 8, 48, 2  # M: the MLP's width
    attn = C * H * D * 2 + C * Hkv * D * 2  # q, o and k, v
    base = {"embeddings": V * C, "attention": L * attn, "mlp": L * 3 * C * M,
            "norms": (2 * L + 1) * C, "lm_head": V * C}
    for gate, per_layer in (("none", 0), ("elementwise", C * H * D + H * D),
                            ("lowrank", C * 3 + 3 * H * D + H * D)):
        counts = parameter_counts(build_pretrain_model(_cfg(output_gate=gate, gate_rank=3), seed=0))
        want = {**base, "gates": L * per_layer}
        assert {k: counts[k] for k in want} == want
        assert counts["total"] == sum(want.values())
        assert counts["non_embedding"] == counts["total"] - 2 * V * C


def test_gates_initialise_the_same_under_another_default_device():
    """Lightning builds the model under torch.device("cuda"): the low-rank gate's draw must not
    hand a CPU generator to a factory on that device (the crash of issue 10). Checked under the
    meta device with the check that makes the CPU raise as CUDA does."""
    from test_init_devices import GeneratorDeviceCheck

    cfg = _cfg(output_gate="lowrank", gate_rank=3)
    cpu = build_pretrain_model(cfg, seed=2).state_dict()
    with torch.device("meta"), GeneratorDeviceCheck():
        meta = build_pretrain_model(cfg, seed=2)
    assert all(p.is_meta for p in meta.parameters())
    gate = OutputGate(32, 32, rank=3)
    with GeneratorDeviceCheck():
        torch.manual_seed(2)
        gate.reset_parameters()
    assert gate.down.weight.abs().sum() > 0
    assert cpu["model.layers.0.self_attn.gate.up.bias"].eq(0.0).all()  # logit(0.5)
