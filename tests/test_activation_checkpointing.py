"""Stage 2's activation checkpointing (models.activation_checkpointing): whole layers or MLP blocks only,
the same gradients as none, and what runs twice."""

from __future__ import annotations

import copy

import pytest
import torch
from hedgecats.lightning_modules import HybridFinetune
from hedgecats.models import HybridConfig, convert_to_hybrid
from hedgecats.models.stage_files import add_lora
from hedgecats.models.activation_checkpointing import (checkpointing_mode, enable_checkpointing,
                                            uncheckpoint_mlps)
from test_convert import FAMILIES, ids, tiny


def _counting(model):
    """Forward calls of the first decoder layer's MLP and attention, counted at their first
    projection (a recomputation stops early, once what the backward needs is back)."""
    calls = {"mlp": 0, "attn": 0}
    layer = model.model.layers[0]
    layer.mlp.gate_proj.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    layer.self_attn.q_proj.register_forward_hook(
        lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    return calls


def _grads(mode, family="llama"):
    model = convert_to_hybrid(tiny(family), HybridConfig(window=4, seed=0)).train()
    keys = sorted(model.state_dict())
    enable_checkpointing(model, mode)
    assert sorted(model.state_dict()) == keys  # names unchanged
    peft_model = add_lora(model, {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})
    with torch.no_grad():  # LoRA's B starts at 0: give it values so every path carries gradient
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.02)
    calls = _counting(model)
    x = ids(T=13)
    peft_model(input_ids=x, labels=x).loss.backward()
    grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    return grads, calls


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mlp_checkpointing_gives_the_gradients_of_none_and_recomputes_only_the_mlp(family):
    none, calls_none = _grads(False, family)
    mlp, calls_mlp = _grads("mlp", family)
    layer, calls_layer = _grads(True, family)
    assert calls_none == {"mlp": 1, "attn": 1}
    assert calls_mlp == {"mlp": 2, "attn": 1}  # the attention runs once a step
    assert calls_layer == {"mlp": 2, "attn": 2}
    assert none.keys() == mlp.keys() == layer.keys() and none
    for n in none:
        torch.testing.assert_close(mlp[n], none[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(layer[n], none[n], rtol=1e-5, atol=1e-7)


def test_checkpointed_mlp_is_still_its_class_and_plain_without_grad():
    model = convert_to_hybrid(tiny(), HybridConfig(window=4)).train()
    cls = type(model.model.layers[0].mlp)
    enable_checkpointing(model, "mlp")
    enable_checkpointing(model, "mlp")  # twice: no second wrapper
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, cls) and type(mlp).__mro__[1] is cls
    copy.deepcopy(model)  # a copy keeps working (class-level, no bound closures)
    calls = _counting(model)
    with torch.no_grad():
        model(ids(T=9))
    assert calls["mlp"] == 1
    assert uncheckpoint_mlps(model) == 3 and type(model.model.layers[0].mlp) is cls


@pytest.mark.parametrize("value,mode", [(False, None), (None, None), (True, "layer"),
                                        ("layer", "layer"), ("mlp", "mlp")])
def test_checkpointing_values(value, mode):
    assert checkpointing_mode(value) == mode


def test_bad_checkpointing_value_fails_before_building():
    with pytest.raises(ValueError, match=r"activation_checkpointing='attention'.*'mlp'"):
        HybridFinetune("no/such/model", activation_checkpointing="attention")


def test_finetune_with_mlp_checkpointing_through_fit(tmp_path):
    """HybridFinetune(activation_checkpointing="mlp") trains through Trainer.fit, its MLPs
    checkpointed, and writes its stage checkpoint."""
    from fixtures.tiny import save_tiny_llama
    from hedgecats.models.stage_files import read_stage
    from hedgecats.models.structure import unwrap
    from test_stages import _dm, _trainer

    base = str(save_tiny_llama(tmp_path / "tiny"))
    m = HybridFinetune(base, hybrid={"window": 8}, activation_checkpointing="mlp")
    m.configure_model()
    before = {n: p.clone() for n, p in m.model.named_parameters() if p.requires_grad}
    assert all(getattr(layer.mlp, "_hedgecats_checkpointed", False)
               for layer in unwrap(m.model).model.layers)
    _trainer(tmp_path, steps=2).fit(m, datamodule=_dm())
    assert any(not torch.equal(p, before[n]) for n, p in m.model.named_parameters() if n in before)
    assert read_stage(tmp_path / "stage.pt")["lora_config"] is not None
