"""Branch usage: layer 0's shares against a naive recomputation from the weights, mixer weights
respected, and the heatmap."""

from __future__ import annotations

import pytest
import torch
from fixtures.eval.support import byte_tokenizer, tiny_llama
from hedgecats.evaluation.branch_usage import (
    branch_usage,
    format_branch_usage_markdown,
    plot_branch_usage,
)
from hedgecats.models import HybridConfig, convert_to_hybrid

W = 16
TEXT = ("The farmer visited the green field with great care. The code for zulu-46 is 15741. "
        "A busy clerk and the quiet boy reached a broken chair in the morning.")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _naive_layer0_la_share(model, ids_BT, g: float) -> torch.Tensor:
    """(H,) LA share of layer 0, from embeddings, projections, RoPE and explicit T x T masks."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    inner, attn = model.model, model.model.layers[0].self_attn
    cfg = model.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    B, T = ids_BT.shape
    with torch.no_grad():
        h_BTC = inner.layers[0].input_layernorm(inner.embed_tokens(ids_BT))
        q_BHTD = attn.q_proj(h_BTC).view(B, T, H, D).transpose(1, 2)
        k_BKTD = attn.k_proj(h_BTC).view(B, T, Hkv, D).transpose(1, 2)
        v_BKTD = attn.v_proj(h_BTC).view(B, T, Hkv, D).transpose(1, 2)
        cos, sin = inner.rotary_emb(h_BTC, torch.arange(T)[None])
        q_BHTD, k_BKTD = apply_rotary_pos_emb(q_BHTD, k_BKTD, cos, sin)
        fq_BHTF, fk_BKTF = attn.phi_q(q_BHTD), attn.phi_k(k_BKTD)
        rep = H // Hkv
        k_BHTD, v_BHTD = k_BKTD.repeat_interleave(rep, 1), v_BKTD.repeat_interleave(rep, 1)
        fk_BHTF = fk_BKTF.repeat_interleave(rep, 1)
        t, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        s_BHTT = q_BHTD @ k_BHTD.transpose(-1, -2) / D ** 0.5
        s_BHTT = s_BHTT.masked_fill(~((j <= t) & (j > t - W)), float("-inf"))
        swa_BHTD = s_BHTT.softmax(-1) @ v_BHTD
        a_BHTT = (fq_BHTF @ fk_BHTF.transpose(-1, -2) + 1e-6) * (j <= t - W)  # the kernel floor
        la_BHTD = (a_BHTT @ v_BHTD) / a_BHTT.sum(-1, keepdim=True).clamp_min(1e-30)
        far = slice(W, T)
        n_swa = (g * swa_BHTD).norm(dim=-1)[..., far].sum(dim=(0, 2))
        n_la = ((1 - g) * la_BHTD).norm(dim=-1)[..., far].sum(dim=(0, 2))
    return n_la / (n_la + n_swa)


def test_layer0_matches_naive_recomputation(tok):
    model = convert_to_hybrid(tiny_llama(tok, seed=2), HybridConfig(window=W, seed=5))
    bu = branch_usage(model, tok, text=TEXT)
    ids = tok(TEXT, return_tensors="pt")["input_ids"]
    assert bu["n_tokens"] == ids.shape[1]
    want = _naive_layer0_la_share(model, ids, g=0.5)
    got = torch.tensor(bu["layers"][0]["la_share"], dtype=torch.float64)
    torch.testing.assert_close(got, want.double(), rtol=1e-4, atol=1e-5)
    assert 0.05 < float(got.min()) and float(got.max()) < 0.95  # a case where both branches count
    for layer in bu["layers"]:
        assert len(layer["la_share"]) == 4 and layer["n_positions"] == ids.shape[1] - W
        for la, swa in zip(layer["la_share"], layer["swa_share"]):
            assert la + swa == pytest.approx(1.0)


@pytest.mark.parametrize("g, la_share", [(1.0, 0.0), (0.0, 1.0)])
def test_mixer_weight_decides_extremes(tok, g, la_share):
    model = convert_to_hybrid(tiny_llama(tok), HybridConfig(window=W, g=g))
    bu = branch_usage(model, tok, text=TEXT)
    for layer in bu["layers"]:
        assert layer["la_share"] == pytest.approx([la_share] * 4)


def test_gated_mixer_and_default_text_and_heatmap(tok, tmp_path):
    model = convert_to_hybrid(tiny_llama(tok), HybridConfig(window=W, mixer="gate_lowrank", gate_rank=4))
    bu = branch_usage(model, tok, max_tokens=300)
    assert bu["n_tokens"] == 300 and "recall-corpus" in bu["text_source"]
    path = plot_branch_usage(bu, tmp_path / "bu.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = "\n".join(format_branch_usage_markdown(bu))
    assert md.count("\n| 0 |") == 1 and "| 1 |" in md


def test_unconverted_model_is_refused(tok):
    with pytest.raises(ValueError, match="converted"):
        branch_usage(tiny_llama(tok), tok, text=TEXT)
