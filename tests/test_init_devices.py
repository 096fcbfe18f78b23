"""The hybrid's parameters are initialised the same whatever the default device.

Lightning builds a model inside ``configure_model`` under ``torch.device("cuda")`` (one device)
or ``torch.device("meta")`` (FSDP, materialised later with ``to_empty`` + ``reset_parameters``).
On a GPU, a CPU ``torch.Generator`` handed to a factory that lands on CUDA raises ("Expected a
'cuda' device type for generator but found 'cpu'"): every recipe crashed so before step 1.
``GeneratorDeviceCheck`` makes the CPU behave like CUDA here, so CI catches that cause.
"""

from __future__ import annotations

import pytest
import torch
from hedgecats.models import HybridConfig, convert_to_hybrid, hybrid_parameter_names
from hedgecats.models.feature_maps import HedgehogFeatureMap
from hedgecats.models.mixers import MIXERS
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


class GeneratorDeviceCheck(TorchFunctionMode):
    """Raise, as CUDA does, when a factory with ``generator=`` makes a tensor on another device
    than the generator's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        gen = kwargs.get("generator")
        if gen is not None and isinstance(out, torch.Tensor) and out.device.type != gen.device.type:
            raise RuntimeError(f"Expected a {out.device.type!r} device type for generator but "
                               f"found {gen.device.type!r}")
        return out


def test_the_check_reproduces_the_gpu_crash():
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"), GeneratorDeviceCheck(), pytest.raises(RuntimeError, match="generator"):
        torch.randn(3, generator=gen)


def _hybrid_tensors(model):
    names = set(hybrid_parameter_names(model))
    return {n: p.detach().clone() for n, p in model.named_parameters() if n in names}


@pytest.mark.parametrize("mixer", MIXERS)
def test_conversion_under_another_default_device_then_materialised_matches_cpu(mixer):
    cfg = HybridConfig(window=4, mixer=mixer, seed=3)
    torch.manual_seed(0)
    ref = convert_to_hybrid(LlamaForCausalLM(LlamaConfig(**SMALL)), cfg)
    expected = _hybrid_tensors(ref)

    with torch.device("meta"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with torch.device("meta"), GeneratorDeviceCheck():
        convert_to_hybrid(model, cfg)  # raised before the fix: CPU generator, meta tensors
    assert all(p.is_meta for p in _hybrid_tensors(model).values())
    # FSDP-style materialisation: allocate, then each module re-initialises itself
    model.to_empty(device="cpu")
    torch.manual_seed(12345)  # the global RNG must not matter
    for m in model.modules():
        if m.__module__.startswith("hedgecats") and hasattr(m, "reset_parameters"):
            m.reset_parameters()
    got = _hybrid_tensors(model)
    assert got.keys() == expected.keys() and expected
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], rtol=0, atol=0, msg=n)


def test_feature_map_init_ignores_global_rng_and_default_device():
    torch.manual_seed(1)
    a = HedgehogFeatureMap(2, 8, seed=5).weight.detach().clone()
    torch.manual_seed(2)
    with torch.device("meta"), GeneratorDeviceCheck():
        fm = HedgehogFeatureMap(2, 8, seed=5)
    fm.to_empty(device="cpu")
    fm.reset_parameters()
    torch.testing.assert_close(fm.weight.detach(), a, rtol=0, atol=0)
