"""Stage checkpoints: format, exact key checks, and load_hybrid rebuilding the same model."""

import pytest
import torch
from hedgecats.data.tokenization import BYTE_PAD_ID
from fixtures.tiny import save_tiny_llama
from hedgecats.models import hybrid_parameter_names
from hedgecats.models.stage_files import (
    FORMAT,
    build_hybrid,
    load_hybrid,
    load_tensors,
    read_stage,
    save_stage,
)
from hedgecats.models.structure import unwrap

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
HYB = {"window": 4, "mixer": "learned_head"}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny"))


def _trained(base, lora=LORA):
    """A hybrid with LoRA whose feature maps, mixer and LoRA B are no longer at their init."""
    model = build_hybrid(base, hybrid_config=HYB, lora_config=lora)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in unwrap(model).named_parameters():
            if ".phi_" in n or ".mixer." in n or ".lora_" in n:
                p.add_(0.05 * torch.randn_like(p))
    return model


def test_round_trip_rebuilds_the_same_logits(base, tmp_path):
    model = _trained(base).eval()
    ids = torch.randint(0, 256, (2, 24))
    want = model(input_ids=ids).logits
    path = save_stage(tmp_path / "stage.pt", model, base_model=base, hybrid_config=HYB,
                      lora_config=LORA, stage="HybridFinetune", meta={"global_step": 3})
    payload = read_stage(path)
    assert payload["format"] == FORMAT and payload["meta"]["global_step"] == 3
    inner_names = dict(unwrap(model).named_parameters())
    # only hybrid and LoRA tensors: never a base weight
    assert set(payload["tensors"]) == {n for n in inner_names if ".phi_" in n or ".mixer." in n
                                       or ".lora_" in n}
    for merge in (False, True):
        rebuilt, tok, info = load_hybrid(path, merge_lora=merge)
        got = rebuilt(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        assert tok is not None and tok.pad_token_id == BYTE_PAD_ID  # the saved tokenizer
        assert info["stage"] == "HybridFinetune" and "tensors" not in info
    # merged: a transformers model (the hybrid subclass of LlamaForCausalLM), not a PeftModel
    assert type(rebuilt).__name__ == "HedgecatsLlamaForCausalLM"


def test_load_is_exact(base, tmp_path):
    model = _trained(base, lora=None)
    path = save_stage(tmp_path / "s.pt", model, base_model=base, hybrid_config=HYB)
    tensors = read_stage(path)["tensors"]
    fresh = build_hybrid(base, hybrid_config=HYB)
    assert load_tensors(fresh, tensors) == sorted(hybrid_parameter_names(fresh))
    with pytest.raises(KeyError, match="not in the model"):
        load_tensors(build_hybrid(base, hybrid_config=HYB),
                     {**tensors, "model.layers.0.self_attn.phi_q.extra": torch.zeros(1)})
    missing = dict(tensors)
    missing.pop("model.layers.1.self_attn.phi_k.weight")
    with pytest.raises(KeyError, match="absent from the checkpoint"):
        load_tensors(build_hybrid(base, hybrid_config=HYB), missing)
    # LoRA tensors are required when the model has LoRA
    with pytest.raises(KeyError, match="lora_A"):
        load_tensors(build_hybrid(base, hybrid_config=HYB, lora_config=LORA), tensors)
    bad = dict(tensors)
    bad["model.layers.0.self_attn.phi_q.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        load_tensors(build_hybrid(base, hybrid_config=HYB), bad)


def test_not_a_stage_checkpoint(tmp_path):
    torch.save({"state_dict": {}}, tmp_path / "x.ckpt")
    with pytest.raises(ValueError, match="not a hedgecats stage checkpoint"):
        read_stage(tmp_path / "x.ckpt")
