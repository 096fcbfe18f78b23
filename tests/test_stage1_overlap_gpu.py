"""Stage 1 with ``overlap_student`` on a GPU: each layer's student on the side stream gives the
same losses and gradients as in order (the same kernels on the same inputs, bitwise), the side
stream is really taken, and the throttle fires (lag 2 of 6 layers). Sleep kernels make the
orderings matter: each student starts with ~10 ms of sleep on its stream (a missing ``join``
would let the gradients be read unfinished) and each teacher attention with ~5 ms on the main
stream before its q, k, v (a missing ``wait_stream`` would let the student read them unwritten).
Marked ``gpu``; on the GPU machine: ``python -m pytest -q -m gpu
tests/test_stage1_overlap_gpu.py``."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import AttentionTransfer
from fixtures.tiny import save_tiny_llama
from hedgecats.models.structure import unwrap
from hedgecats.models.ops.transfer.losses import transfer_loss

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (run on the GPU machine)")
    # head dim 32, 6 layers: several students in flight behind the teacher
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny", hidden_size=128,
                               num_layers=6, num_heads=4, num_kv_heads=2, intermediate_size=256))


def _cycles(ms: float) -> int:
    return int(ms * 1e-3 * torch.cuda.get_device_properties(0).clock_rate * 1e3)


def _losses_and_grads(base, objective, overlap, monkeypatch, max_lag=2):
    from hedgecats.lightning_modules import stages

    def slow_student(*a, **kw):
        torch.cuda._sleep(_cycles(10))  # on the student's stream
        return transfer_loss(*a, **kw)
    monkeypatch.setattr(stages, "transfer_loss", slow_student)
    torch.manual_seed(0)
    m = AttentionTransfer(base, hybrid={"window": 16}, objective=objective, torch_dtype="bfloat16",
                          overlap_student=overlap, overlap_max_lag=max_lag)
    m.configure_model()
    m.to("cuda")
    for layer in unwrap(m.model).model.layers:  # the teacher's stream sleeps before each q, k, v
        layer.self_attn.register_forward_pre_hook(lambda *_: torch.cuda._sleep(_cycles(5)))
    tr = pl.Trainer(accelerator="gpu", devices=1, max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
    tr.strategy.connect(m)
    m.trainer = tr
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (4, 512), generator=gen).cuda()
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    losses, _ = m._layer_losses(batch, backward_scale=1.0)
    grads = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.requires_grad}
    return m, losses, grads


@pytest.mark.parametrize("objective", ["weights_xent", "hybrid_output_mse"])
def test_overlapped_students_give_the_in_order_numbers(base, objective, monkeypatch):
    _, want_l, want_g = _losses_and_grads(base, objective, False, monkeypatch)
    m, got_l, got_g = _losses_and_grads(base, objective, True, monkeypatch)
    assert m._student_stream is not None and m._student_stream.stream is not None
    assert m._student_stream.stream != torch.cuda.current_stream()
    assert m._student_stream.throttled == 6 - 2
    assert sorted(got_l) == sorted(want_l) and len(got_l) == 6
    bad = [i for i in want_l if not torch.equal(got_l[i], want_l[i])]
    bad += [n for n in want_g if not torch.equal(got_g[n], want_g[n])]
    assert not bad, f"overlap changed these losses / gradients: {bad}"


def test_overlap_through_fit_trains_what_in_order_trains(base, monkeypatch, tmp_path):
    """The recipes' path: ``Trainer.fit`` on the GPU, two steps, the feature maps trained with
    the students on the side stream bitwise as in order (slow students: see the module doc)."""
    from hedgecats.lightning_modules import RecallDataModule, stages

    def slow_student(*a, **kw):
        torch.cuda._sleep(_cycles(10))
        return transfer_loss(*a, **kw)
    monkeypatch.setattr(stages, "transfer_loss", slow_student)
    trained = []
    for overlap in (False, True):
        pl.seed_everything(0)
        m = AttentionTransfer(base, hybrid={"window": 16}, torch_dtype="bfloat16",
                              overlap_student=overlap, overlap_max_lag=2)
        dm = RecallDataModule(seq_len=256, window=16, far_min=40, far_max=200, num_train=16,
                              num_val=4, num_test=4, batch_size=4)
        pl.Trainer(accelerator="gpu", devices=1, max_steps=2, default_root_dir=str(tmp_path),
                   logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0,
                   num_sanity_val_steps=0).fit(m, datamodule=dm)
        trained.append({n: p.detach().clone() for n, p in m.model.named_parameters()
                        if p.requires_grad})
        if overlap:
            assert m._student_stream is not None and m._student_stream.stream is not None
    bad = [n for n in trained[0] if not torch.equal(trained[0][n], trained[1][n])]
    assert not bad, f"overlap changed these trained parameters: {bad}"
