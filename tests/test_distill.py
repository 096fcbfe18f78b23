"""Stage 2 by distillation: the KL objective against its references (values and gradients) and
its bound, the teacher (the same weights in softmax mode, adapters off) against the original
model, the stage's loss choices, logging, resume, bad input, and FSDP2 on two CPU processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import HybridFinetune, RecallDataModule
from hedgecats.lightning_modules.distill import (
    TeacherUnavailableError,
    check_distillation,
    distill_terms,
    kl_reference,
    next_token_reference,
    next_token_targets,
    teacher_targets,
    topk_kl_reference,
)
from fixtures.tiny import save_tiny_llama
from hedgecats.models import hybrid_layers
from hedgecats.models.structure import unwrap
from lightning.pytorch.callbacks import ModelCheckpoint

HERE = Path(__file__).resolve()
HYB = {"window": 8}
V = 13


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny"))


def _logits(seed, shape=(2, 7, V), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _batch(padded=True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 4:] = 0  # the second sequence right-padded after 4 tokens
    return ids, mask


# ----------------------------------------------------------------------------- the objective
def test_next_token_targets_count_the_positions_of_the_next_token_loss():
    ids, mask = _batch()
    targets, weights = next_token_targets(ids, mask)
    assert torch.equal(targets[:, :-1], ids[:, 1:])
    # sequence 0: positions 0..5 predict a real token; sequence 1: positions 0..2
    want = torch.zeros(2, 7)
    want[0, :6], want[1, :3] = 1, 1
    torch.testing.assert_close(weights, want / 9)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_terms_match_the_references_in_values_and_gradients(temperature, chunk):
    ids, mask = _batch()
    targets, weights = next_token_targets(ids, mask)
    s, t = _logits(0), _logits(1)
    s.requires_grad_(True)
    teacher = teacher_targets(t.flatten(0, 1), temperature, None)
    kl, ce = distill_terms(s.flatten(0, 1), teacher, targets.flatten(), weights.flatten(),
                           temperature, chunk)
    s64 = s.detach().double().requires_grad_(True)
    kl_ref = kl_reference(s64, t, weights, temperature)
    ce_ref = next_token_reference(s64, targets, weights)
    torch.testing.assert_close(kl.double(), kl_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ce.double(), ce_ref, rtol=1e-5, atol=1e-7)
    (0.7 * kl + 0.3 * ce).backward()
    (0.7 * kl_ref + 0.3 * ce_ref).backward()
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("k", [1, 3, V - 1])
@pytest.mark.parametrize("chunk", [2, 100])
def test_topk_kl_matches_its_reference_and_bounds_the_full_kl(k, chunk):
    ids, mask = _batch()
    targets, weights = next_token_targets(ids, mask)
    s, t = _logits(2), _logits(3)
    s.requires_grad_(True)
    teacher = teacher_targets(t.flatten(0, 1), 1.7, k, chunk)
    assert teacher.logits is None and teacher.top_idx.shape == (14, k)
    kl, _ = distill_terms(s.flatten(0, 1), teacher, targets.flatten(), weights.flatten(), 1.7,
                          chunk)
    s64 = s.detach().double().requires_grad_(True)
    ref = topk_kl_reference(s64, t, weights, 1.7, k)
    torch.testing.assert_close(kl.double(), ref, rtol=1e-5, atol=1e-7)
    kl.backward()
    ref.backward()
    torch.testing.assert_close(s.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)
    full = kl_reference(s.detach(), t, weights, 1.7)
    assert 0 < ref <= full + 1e-12  # a coarsening never increases the KL
    if k == V - 1:  # the rest bucket holds one token: the buckets are the tokens
        torch.testing.assert_close(ref, full, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("topk", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_is_zero_for_the_teacher_itself_and_never_negative(topk, dtype):
    ids, mask = _batch()
    targets, weights = next_token_targets(ids, mask)
    t = _logits(4).to(dtype).flatten(0, 1)
    teacher = teacher_targets(t, 2.0, topk, 3)
    s = t.clone().requires_grad_(True)
    kl, _ = distill_terms(s, teacher, targets.flatten(), weights.flatten(), 2.0, 3)
    assert kl.item() == 0.0
    kl.backward()
    assert s.grad.abs().max().item() < 1e-6 and s.grad.dtype == dtype  # 0 to rounding
    # near the teacher, rounding never takes it below 0
    for i in range(20):
        near = (t.float() + 1e-6 * _logits(10 + i).flatten(0, 1)).to(dtype)
        kl, _ = distill_terms(near, teacher, targets.flatten(), weights.flatten(), 2.0, 3)
        assert kl.item() >= 0.0
    assert kl_reference(_logits(5), _logits(5), weights).item() == 0.0
    assert kl_reference(_logits(5), _logits(6), weights).item() > 0.0


def test_bf16_logits_give_the_reference_to_bf16_precision():
    ids, mask = _batch()
    targets, weights = next_token_targets(ids, mask)
    s, t = _logits(7).bfloat16(), _logits(8).bfloat16()
    kl, ce = distill_terms(s.flatten(0, 1), teacher_targets(t.flatten(0, 1), 1.0, None),
                           targets.flatten(), weights.flatten())
    assert kl.dtype == ce.dtype == torch.float32
    torch.testing.assert_close(kl.double(), kl_reference(s, t, weights), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce.double(), next_token_reference(s, targets, weights),
                               rtol=1e-5, atol=1e-6)


def test_topk_of_the_whole_vocabulary_is_refused():
    with pytest.raises(ValueError, match="every token"):
        teacher_targets(_logits(0).flatten(0, 1), 1.0, V)


@pytest.mark.parametrize("args, match", [
    (("kd", None, None, None, 64), "loss='kd' is not valid; choose one of next_token, kl, mixed"),
    (("mixed", 1.0, None, None, 64), "strictly between 0 and 1"),
    (("mixed", 0.0, None, None, 64), "strictly between 0 and 1"),
    (("mixed", float("nan"), None, None, 64), "strictly between 0 and 1"),
    (("kl", 0.5, None, None, 64), "share in loss: mixed"),
    (("next_token", 0.5, None, None, 64), "share in loss: mixed"),
    (("kl", None, 0.0, None, 64), "temperature=0.0 must be a finite number > 0"),
    (("kl", None, -1.0, None, 64), "temperature=-1.0 must be"),
    (("mixed", None, float("inf"), None, 64), "temperature=inf must be"),
    (("kl", None, True, None, 64), "temperature=True must be"),
    (("next_token", None, 2.0, None, 64), "temperature=2.0 belongs to the KL"),
    (("next_token", None, None, 8, 64), "kl_topk=8 belongs to the KL"),
    (("kl", None, None, 0, 64), "kl_topk=0 must be an integer >= 1"),
    (("kl", None, None, None, 0), "kl_chunk=0 must be an integer >= 1"),
])
def test_invalid_settings_are_refused_by_name(args, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        check_distillation(*args)


def test_settings_resolve_to_their_defaults():
    assert check_distillation("next_token", None, None, None, 64) == (0.0, 1.0)
    assert check_distillation("kl", None, None, None, 64) == (1.0, 1.0)
    assert check_distillation("mixed", None, 2.0, 16, 64) == (0.5, 2.0)
    assert check_distillation("mixed", 0.25, None, None, 64) == (0.25, 1.0)


# ----------------------------------------------------------------------------- the teacher
def _lora_nonzero(m):
    with torch.no_grad():
        for n, p in unwrap(m.model).named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)


def test_the_teacher_is_the_original_model_bit_for_bit(base):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(base).eval()
    m = HybridFinetune(base, hybrid=HYB, loss="kl", train_feature_maps=True)
    m.configure_model()
    _lora_nonzero(m)  # adapters that change the student's output
    ids, mask = _batch()
    ids = ids + 40  # byte vocabulary: any ids below it
    want = original(input_ids=ids, attention_mask=mask).logits
    grads = {n: p.requires_grad for n, p in m.model.named_parameters()}
    with m._as_teacher():
        got = m.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert not m.model.training and not torch.is_grad_enabled()
    assert torch.equal(got, want)
    # after it: the student again (hybrid, adapters on, training), no requires_grad touched
    assert m.model.training
    assert {n: p.requires_grad for n, p in m.model.named_parameters()} == grads
    assert {a.hedgecats.mode for _, a in hybrid_layers(unwrap(m.model))} == {"hybrid"}
    student = m.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert not torch.allclose(student, want, atol=1e-3)


def test_the_kl_of_the_teacher_to_itself_is_zero_through_the_stage(base):
    """The student in softmax mode with fresh LoRA (B = 0) is the teacher: the stage's KL is 0,
    so the teacher's forward ran on the same weights."""
    from hedgecats.models import set_attention_mode

    m = HybridFinetune(base, hybrid=HYB, loss="kl", temperature=2.0)
    m.configure_model()
    set_attention_mode(unwrap(m.model), "softmax")
    ids, mask = _batch()
    loss, terms = m._distill({"input_ids": ids + 40, "attention_mask": mask})
    assert loss.item() == 0.0 and terms["kl"].item() == 0.0
    assert terms["next_token"].item() > 0


# ----------------------------------------------------------------------------- the stage
def _dm(**kw):
    args = {"seq_len": 48, "window": 8, "far_min": 16, "far_max": 40, "num_train": 24,
            "num_val": 4, "num_test": 4, "batch_size": 4}
    return RecallDataModule(**{**args, **kw})


class Record(pl.Callback):
    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.steps.append((trainer.global_step, loss.detach().clone(),
                           {k: v.detach().clone() for k, v in trainer.callback_metrics.items()
                            if k.startswith("train/")}))


def _fit(m, root, steps=3, callbacks=(), ckpt_path=None, **kw):
    rec = Record()
    args = {"enable_checkpointing": False, "limit_val_batches": 1, "val_check_interval": steps}
    tr = pl.Trainer(max_steps=steps, default_root_dir=str(root), logger=False,
                    enable_progress_bar=False, enable_model_summary=False,
                    num_sanity_val_steps=0, callbacks=[rec, *callbacks], **{**args, **kw})
    tr.fit(m, datamodule=_dm(), ckpt_path=ckpt_path)
    return tr, rec


@pytest.mark.parametrize("loss, kw", [("kl", {}), ("mixed", {"kl_weight": 0.25,
                                                              "temperature": 2.0}),
                                      ("kl", {"kl_topk": 8, "kl_chunk": 16})])
def test_distillation_trains_lora_and_logs_both_terms(base, tmp_path, loss, kw):
    pl.seed_everything(0)
    m = HybridFinetune(base, hybrid=HYB, lr=1e-2, loss=loss, **kw)
    tr, rec = _fit(m, tmp_path, steps=3)
    for _, step_loss, logged in rec.steps:
        kl, nt = logged["train/kl"], logged["train/next_token"]
        assert kl > 0 and nt > 0
        t2 = kw.get("temperature", 1.0) ** 2
        want = t2 * kl if loss == "kl" else (1 - kw["kl_weight"]) * nt + kw["kl_weight"] * t2 * kl
        torch.testing.assert_close(step_loss, want)
        torch.testing.assert_close(logged["train/loss"], step_loss)
    assert "val/kl" in tr.callback_metrics and "val/loss" in tr.callback_metrics
    from hedgecats.models.stage_files import read_stage

    tensors = read_stage(tmp_path / "stage.pt")["tensors"]
    lora_b = [t for n, t in tensors.items() if "lora_B" in n]
    assert lora_b and all(t.abs().max() > 0 for t in lora_b)  # B starts at 0: it trained


def test_next_token_loss_logs_its_term_and_reads_as_before(base, tmp_path):
    pl.seed_everything(0)
    m = HybridFinetune(base, hybrid=HYB, lr=1e-3)
    tr, rec = _fit(m, tmp_path, steps=2)
    for _, step_loss, logged in rec.steps:
        assert "train/kl" not in logged
        assert torch.equal(logged["train/next_token"], step_loss.detach())
    assert "val/kl" not in tr.callback_metrics


def test_distillation_with_trained_feature_maps_in_la_only_mode(base, tmp_path):
    pl.seed_everything(0)
    m = HybridFinetune(base, hybrid=HYB, lr=1e-2, loss="mixed", train_feature_maps=True,
                       mode="la_only", la_span="all")
    m.configure_model()
    before = {n: p.detach().clone() for n, p in unwrap(m.model).named_parameters()
              if ".phi_q." in n}
    _fit(m, tmp_path, steps=2)
    after = dict(unwrap(m.model).named_parameters())
    assert all(not torch.equal(after[n], t) for n, t in before.items())
    assert {a.hedgecats.mode for _, a in hybrid_layers(unwrap(m.model))} == {"la_only"}


@pytest.mark.parametrize("checkpointing", [True, "mlp"])
def test_distillation_under_activation_checkpointing_trains_as_without(base, tmp_path,
                                                                       checkpointing):
    """The teacher's forward (eval mode, no grad) skips the checkpointed recomputation; the
    student's losses are those of a run without checkpointing."""
    losses = []
    for ac in (False, checkpointing):
        pl.seed_everything(0)
        m = HybridFinetune(base, hybrid=HYB, lr=1e-2, loss="kl", activation_checkpointing=ac)
        _, rec = _fit(m, tmp_path / str(ac), steps=3)
        losses.append(torch.stack([s[1] for s in rec.steps]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("loss", ["kl", "mixed"])
def test_resume_continues_the_distillation_loss_bit_exactly(base, tmp_path, loss):
    def run(root, steps, ckpt_path=None):
        pl.seed_everything(0)
        m = HybridFinetune(base, hybrid=HYB, lr=1e-3, loss=loss,
                           lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.1},
                           kl_topk=16 if loss == "mixed" else None)
        ck = ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, save_top_k=0,
                             every_n_train_steps=2)
        _, rec = _fit(m, root, steps=steps, callbacks=[ck], ckpt_path=ckpt_path,
                      enable_checkpointing=True, limit_val_batches=0)
        params = {n: p.detach().clone() for n, p in unwrap(m.model).named_parameters()
                  if p.requires_grad}
        return rec.steps, params

    full, full_params = run(tmp_path / "full", 7)  # 6 batches an epoch: crosses an epoch
    first, _ = run(tmp_path / "part", 4)
    assert [s[0] for s in first] == [s[0] for s in full[:4]]
    rest, rest_params = run(tmp_path / "part", 7, tmp_path / "part" / "checkpoints" / "last.ckpt")
    assert [s[0] for s in rest] == [s[0] for s in full[4:]]
    for (_, a, la), (_, b, lb) in zip(rest, full[4:]):
        assert torch.equal(a, b)
        assert torch.equal(la["train/kl"], lb["train/kl"])
    assert rest_params.keys() == full_params.keys()
    assert all(torch.equal(rest_params[n], full_params[n]) for n in full_params)


# ----------------------------------------------------------------------------- bad input
def test_a_converted_hybrid_as_base_model_has_no_teacher(base, tmp_path):
    from hedgecats.models import HybridConfig, convert_to_hybrid
    from hedgecats.models.hf import save_hybrid
    from transformers import AutoModelForCausalLM

    model = convert_to_hybrid(AutoModelForCausalLM.from_pretrained(base), HybridConfig(window=8))
    save_hybrid(model, tmp_path / "export")
    m = HybridFinetune(str(tmp_path / "export"), hybrid=HYB, loss="kl")
    with pytest.raises(TeacherUnavailableError, match="is a converted hybrid .* original "
                                                      "attention weights are not kept"):
        m.configure_model()


def test_init_from_that_replaces_base_weights_has_no_teacher(base, tmp_path):
    from hedgecats.models.stage_files import build_hybrid, save_stage

    model = build_hybrid(base, hybrid_config={"window": 8})
    inner = dict(model.named_parameters())
    tensors = {n: p.detach().clone() for n, p in inner.items()
               if ".phi_" in n or n == "model.layers.0.self_attn.q_proj.weight"}
    save_stage(tmp_path / "stage.pt", model, base_model=base, hybrid_config={"window": 8},
               tensors=tensors)
    m = HybridFinetune(base, hybrid=HYB, loss="mixed", init_from=str(tmp_path / "stage.pt"))
    with pytest.raises(TeacherUnavailableError, match=r"replaces base weights "
                                                      r"\['model.layers.0.self_attn.q_proj"):
        m.configure_model()
    # the next-token loss needs no teacher: the same start is accepted
    HybridFinetune(base, hybrid=HYB, init_from=str(tmp_path / "stage.pt")).configure_model()


def test_a_trained_base_weight_has_no_teacher(tmp_path):
    """LoRA's bias: all trains the base model's biases, which the teacher reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      attention_bias=True)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "biased")
    m = HybridFinetune(str(tmp_path / "biased"), hybrid=HYB, loss="kl",
                       lora={"bias": "all"})
    with pytest.raises(TeacherUnavailableError, match=r"would also train \['model.layers.0."
                                                      r"self_attn.k_proj.base_layer.bias'"):
        m.configure_model()


def test_topk_over_the_models_vocabulary_is_refused_at_start(base):
    m = HybridFinetune(base, hybrid=HYB, loss="kl", kl_topk=10_000)
    with pytest.raises(ValueError, match="kl_topk=10000 keeps every token"):
        m.configure_model()


@pytest.mark.parametrize("setting, match", [
    ("loss=kd", "loss='kd' is not valid"),
    ("kl_weight=0.5", "kl_weight=0.5 is the KL's share in loss: mixed"),
    ("temperature=0", "temperature=0.0 must be a finite number > 0"),
])
def test_invalid_objective_is_refused_by_the_pipelines_dry_run(base, tmp_path, capsys, setting,
                                                                match):
    from hedgecats.cli import main

    recipe = HERE.parents[1] / "configs" / "testbed" / "hedgecats_kl.yaml"
    code = main(["pipeline", str(recipe), "--output", str(tmp_path / "run"), "--dry-run",
                 "--var", f"teacher={base}", "--var", f"tasks={tmp_path}",
                 "--set", f"stages.finetune.fit.model.init_args.{setting}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "HybridFinetune" in err and match in err


# ----------------------------------------------------------------------------- FSDP2
def _worker(strategy: str, base: str, root: str, out: str) -> None:
    from hedgecats.models.stage_files import read_stage

    pl.seed_everything(0)
    m = HybridFinetune(base, hybrid=HYB, lr=1e-2, loss="mixed", kl_topk=16,
                       train_feature_maps=True)
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    losses = []

    class Keep(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append({k: v.item() for k, v in trainer.callback_metrics.items()
                           if k.startswith("train/")})

    tr = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2,
                    default_root_dir=root, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, enable_checkpointing=False,
                    callbacks=[Keep()])
    tr.fit(m, datamodule=_dm(num_train=32))
    if tr.is_global_zero:
        tensors = read_stage(Path(root) / "stage.pt")["tensors"]
        torch.save(tensors, f"{out}.tensors.pt")
    Path(f"{out}.rank{tr.global_rank}.json").write_text(json.dumps(losses))


def _run_two(tmp_path, strategy, base):
    out = tmp_path / strategy
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, str(HERE), strategy, base, str(tmp_path / f"{strategy}-run"),
                    str(out)], check=True, env=env, timeout=300, capture_output=True)
    return ([json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)],
            torch.load(f"{out}.tensors.pt"))


@pytest.mark.distributed
# two processes, ~25 s: in make test-all; stage 2 under FSDP2 stays in the default run
# (test_stages_distributed)
@pytest.mark.slow
def test_fsdp2_distillation_trains_as_ddp_does(base, tmp_path):
    """Two ranks under FSDP2 (the teacher's forward through the sharded model, without grad and
    with the adapters off, first in every step) give DDP's losses and trained tensors, and
    LoRA trains."""
    fsdp, fsdp_tensors = _run_two(tmp_path, "fsdp2", base)
    ddp, ddp_tensors = _run_two(tmp_path, "ddp", base)
    for r in (0, 1):
        assert len(fsdp[r]) == 2 and all(s["train/kl"] > 0 for s in fsdp[r])
        for a, b in zip(fsdp[r], ddp[r]):
            assert a == pytest.approx(b, rel=1e-5)
    assert fsdp_tensors.keys() == ddp_tensors.keys()
    assert all(t.abs().max() > 0 for n, t in fsdp_tensors.items() if "lora_B" in n)
    for n in ddp_tensors:
        torch.testing.assert_close(fsdp_tensors[n], ddp_tensors[n], rtol=1e-4, atol=1e-6)


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
