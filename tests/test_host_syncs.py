"""A converted model's step synchronises the host with the GPU a fixed number of times, however
deep the model: no reduction read back per layer.

A host sync (``int()`` / ``bool()`` / ``.item()`` of a CUDA tensor: ``aten._local_scalar_dense``)
drains the GPU's queue; once per layer it left stage 2's step idle ~70 ms of 950 on an 8B model
(issue 12: the layer's position-id check read ``position_ids.max()`` in every layer, twice a step
under activation checkpointing). Counted here on CPU, where the same aten call marks the spot,
on what users run: the converted model trained under each checkpointing mode, evaluated with a
padding mask, and stage 1's per-layer students.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hedgecats.lightning_modules import AttentionTransfer
from fixtures.tiny import save_tiny_llama
from hedgecats.models import HybridConfig, convert_to_hybrid
from hedgecats.models.activation_checkpointing import enable_checkpointing
from hedgecats.models.ops.instrument import TRACE
from test_convert import SMALL
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM


class CountSyncs(TorchDispatchMode):
    """Counts the aten calls that read a tensor's value back to the host."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count[func] += 1
        return func(*args, **(kwargs or {}))


def _batch(B=2, T=16):
    x = torch.randint(0, SMALL["vocab_size"], (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding: the layers get a padding mask
    return x, mask


def _model(layers: int, mode: str = "hybrid"):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_hidden_layers": layers}))
    return convert_to_hybrid(model, HybridConfig(window=4, seed=0, mode=mode))


def _syncs(run) -> int:
    with CountSyncs() as c:
        run()
    return sum(c.count.values())


@pytest.mark.parametrize("checkpointing", [False, True, "mlp"])
def test_training_step_syncs_do_not_grow_with_depth(checkpointing):
    x, mask = _batch()

    def step(layers):
        model = _model(layers).train()
        enable_checkpointing(model, checkpointing)
        return _syncs(lambda: model(input_ids=x, attention_mask=mask, labels=x).loss.backward())

    shallow, deep = step(2), step(5)
    assert shallow == deep, f"{deep - shallow} more host syncs with 3 more layers"
    assert deep <= 6  # transformers' mask builder, the padding mask, the position check


@pytest.mark.parametrize("mode", ["hybrid", "la_only", "swa_only"])
def test_evaluation_forward_syncs_do_not_grow_with_depth(mode):
    x, mask = _batch()

    def forward(layers):
        model = _model(layers, mode).eval()
        with torch.no_grad():
            return _syncs(lambda: model(input_ids=x, attention_mask=mask))

    assert forward(2) == forward(5)


@pytest.mark.parametrize("objective", ["weights_xent", "la_output_mse", "hybrid_output_mse"])
def test_stage1_students_sync_do_not_grow_with_depth(tmp_path, objective):
    from test_stages import _dm, _trainer

    batch = next(iter(_dm(batch_size=2).val_dataloader()))

    def step(layers):
        base = save_tiny_llama(tmp_path / f"tiny{layers}", num_layers=layers)
        m = AttentionTransfer(str(base), hybrid={"window": 8}, objective=objective)
        m.configure_model()
        tr = _trainer(tmp_path, steps=1)
        tr.strategy.connect(m)  # manual_backward needs a trainer
        m.trainer = tr
        return _syncs(lambda: m._layer_losses(batch, backward_scale=1.0))

    assert step(2) == step(5)


@pytest.mark.gpu
@pytest.mark.parametrize("checkpointing", [True, "mlp"])
def test_gpu_training_step_syncs_do_not_grow_with_depth(checkpointing):
    """The same on a GPU through the fused kernels, counted by CUDA's own sync check
    (``torch.cuda.set_sync_debug_mode``), which also sees syncs that are not a value read."""
    import warnings


    x, mask = (t.cuda() for t in _batch())

    def step(layers):
        """The fewest syncs of two steps after a warm-up: a one-time sync (seen once on the
        first measured step of a process, 2026-12-02) is not a per-layer one."""
        model = _model(layers).cuda().to(torch.bfloat16).train()
        enable_checkpointing(model, checkpointing)
        model(input_ids=x, attention_mask=mask, labels=x).loss.backward()  # warm-up, compile
        torch.cuda.synchronize()
        counts = []
        for _ in range(2):
            before = TRACE.calls["hybrid.forward"]
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    model(input_ids=x, attention_mask=mask, labels=x).loss.backward()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            assert TRACE.calls["hybrid.forward"] > before  # the fused kernels ran
            syncs = [w for w in seen if "synchroniz" in str(w.message)]
            counts.append((len(syncs), [f"{w.filename}:{w.lineno}" for w in syncs]))
        return min(counts)

    (shallow, where_shallow), (deep, where_deep) = step(2), step(5)
    assert shallow == deep, (f"{deep - shallow} more syncs with 3 more layers: 2 layers "
                             f"{where_shallow}, 5 layers {where_deep}")
    assert deep <= 6
