"""Each stage a few steps on CPU with a tiny model: trainable sets, hand-off, checkpoints."""

import lightning.pytorch as pl
import pytest
import torch
from hedgecats.lightning_modules import (
    AttentionTransfer,
    CheckpointOnInterrupt,
    HybridFinetune,
    NonFiniteLossError,
    RecallDataModule,
    TeacherPretraining,
)
from fixtures.tiny import save_tiny_llama
from hedgecats.models import hybrid_layers
from hedgecats.models.stage_files import read_stage
from hedgecats.models.structure import unwrap
from hedgecats.models.ops.transfer.losses import transfer_loss
from lightning.pytorch.callbacks import ModelCheckpoint

HYB = {"window": 8}
LAYERS = (0, 1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("base") / "tiny"))


def _dm(**kw):
    args = {"seq_len": 64, "window": 8, "far_min": 20, "far_max": 50, "num_train": 48, "num_val": 8,
                "num_test": 8, "batch_size": 4}
    args.update(kw)
    return RecallDataModule(**args)


def _trainer(root, steps=3, **kw):
    args = {"max_steps": steps, "default_root_dir": str(root), "logger": False,
                "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
                "limit_val_batches": 1, "num_sanity_val_steps": 0}
    args.update(kw)
    return pl.Trainer(**args)


def _phi_names(mixer=False):
    parts = ["phi_k.bias", "phi_k.weight", "phi_q.bias", "phi_q.weight"]
    if mixer:
        parts.append("mixer.logit_g")
    return sorted(f"model.layers.{i}.self_attn.{p}" for i in LAYERS for p in parts)


def test_attention_transfer_trains_only_feature_maps(base, tmp_path):
    m = AttentionTransfer(base, hybrid={**HYB, "mixer": "learned_head"})
    m.configure_model()
    assert m.trainable_parameter_names() == _phi_names(mixer=True)
    frozen = {n: p.clone() for n, p in m.model.named_parameters() if not p.requires_grad}
    before = {n: p.clone() for n, p in m.model.named_parameters() if p.requires_grad}
    # per-layer values are logged on the steps whose logs Lightning writes: step 3 is one
    tr = _trainer(tmp_path, steps=3, val_check_interval=2, log_every_n_steps=3)
    tr.fit(m, datamodule=_dm())
    assert all(torch.equal(p, frozen[n]) for n, p in m.model.named_parameters() if n in frozen)
    assert all(not torch.equal(p, before[n]) for n, p in m.model.named_parameters()
               if n in before and "logit_g" not in n)  # the mixer gets no xent gradient
    logged = tr.callback_metrics
    assert {"train/loss", "transfer/layer_00/weights_xent", "transfer/layer_01/weights_xent",
            "val/loss"} <= set(logged)
    payload = read_stage(tmp_path / "stage.pt")
    assert sorted(payload["tensors"]) == _phi_names(mixer=True)
    assert payload["stage"] == "AttentionTransfer" and payload["lora_config"] is None


def test_per_layer_backward_equals_one_joint_backward(base):
    """Backpropagating each layer's loss inside the observer gives the gradient of the mean."""
    for objective in ("weights_xent", "la_output_mse", "hybrid_output_mse"):
        m = AttentionTransfer(base, hybrid=HYB, objective=objective)
        m.configure_model()
        batch = next(iter(_dm(batch_size=2).val_dataloader()))
        tr = _trainer("/tmp", steps=1)
        tr.strategy.connect(m)  # manual_backward needs a trainer
        m.trainer = tr
        losses, _ = m._layer_losses(batch, backward_scale=1.0)
        per_layer = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.requires_grad}
        m.model.zero_grad()
        joint = []
        inner = unwrap(m.model)
        for _, attn in hybrid_layers(inner):
            attn.hedgecats.observer = lambda mod, q, k, v, kpm, x, joint=joint, obj=objective: \
                joint.append(transfer_loss(obj, mod, q, k, v, kpm, x)[0])
            attn.hedgecats.mode = "softmax"
        inner.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        torch.stack(joint).mean().backward()
        torch.testing.assert_close(torch.stack([losses[i] for i in LAYERS]),
                                   torch.stack(joint).detach())
        for n, p in m.model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, per_layer[n], rtol=1e-4, atol=1e-7)


def test_output_mse_objectives_take_the_teachers_own_output(base, monkeypatch):
    """The output-MSE objectives compare with the attention output of the teacher's forward,
    handed over by the layer, and never run softmax attention a second time per layer
    (``weights_xent`` does not need it); the loss is the one computed from scratch (checked by
    test_per_layer_backward_equals_one_joint_backward)."""
    from hedgecats.models.ops.transfer import losses as transfer

    def second_softmax(*args, **kwargs):
        raise AssertionError("the teacher's attention output was computed again")

    for objective in ("la_output_mse", "hybrid_output_mse"):
        m = AttentionTransfer(base, hybrid=HYB, objective=objective)
        m.configure_model()
        batch = next(iter(_dm(batch_size=2).val_dataloader()))
        with monkeypatch.context() as mp:
            mp.setattr(transfer, "_teacher_output", second_softmax)
            losses, _ = _layer_losses_and_grads(m, batch)
        assert sorted(losses) == list(LAYERS) and all(torch.isfinite(v) for v in losses.values())


def _layer_losses_and_grads(m, batch):
    tr = _trainer("/tmp", steps=1)
    tr.strategy.connect(m)  # manual_backward needs a trainer
    m.trainer = tr
    losses, _ = m._layer_losses(batch, backward_scale=1.0)
    grads = {n: p.grad.clone() for n, p in m.model.named_parameters() if p.requires_grad}
    return losses, grads


def test_overlap_student_off_the_gpu_runs_in_order_with_the_same_numbers(base, caplog):
    """``overlap_student`` is a speed option: on CPU it says so once and changes nothing."""
    import logging

    from hedgecats.lightning_modules import student_stream

    batch = next(iter(_dm(batch_size=2).val_dataloader()))
    results = []
    for overlap in (False, True):
        torch.manual_seed(0)
        m = AttentionTransfer(base, hybrid=HYB, objective="hybrid_output_mse",
                              overlap_student=overlap)
        m.configure_model()
        results.append(_layer_losses_and_grads(m, batch))
        # the option took its path (on CPU: a StudentStream without a stream)
        assert (m._student_stream is not None) == overlap
    (l0, g0), (l1, g1) = results
    assert all(torch.equal(l0[i], l1[i]) for i in LAYERS)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    student_stream._WARNED.discard("cpu")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=student_stream.__name__):
        student_stream.StudentStream("cpu")
        student_stream.StudentStream("cpu")
    assert sum("needs a CUDA device" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="overlap_max_lag"):
        AttentionTransfer(base, overlap_student=True, overlap_max_lag=0)


def test_overlap_student_through_fit_trains_what_in_order_trains(base, tmp_path):
    """The path a recipe takes (``Trainer.fit`` with ``overlap_student: true``): two steps give
    the feature maps the in-order run gives (on CPU the students run in order; the GPU test
    tests/test_stage1_overlap_gpu.py does the same with the side stream)."""
    trained = []
    for overlap in (False, True):
        pl.seed_everything(0)
        m = AttentionTransfer(base, hybrid=HYB, overlap_student=overlap)
        _trainer(tmp_path / str(overlap), steps=2).fit(m, datamodule=_dm())
        trained.append({n: p.detach().clone() for n, p in m.model.named_parameters()
                        if p.requires_grad})
    assert trained[0].keys() == trained[1].keys()
    assert all(torch.equal(trained[0][n], trained[1][n]) for n in trained[0])


def test_overlap_student_keeps_every_student_parameter_out_of_fsdp(base):
    """FSDP2 frees a layer's gathered parameters after its forward; a student on the side stream
    reads its layer's maps and mixer later, frozen ones too (train_mixer=False)."""
    hyb = {**HYB, "mixer": "learned_head"}
    for overlap in (False, True):
        m = AttentionTransfer(base, hybrid=hyb, train_mixer=False, overlap_student=overlap)
        m.configure_model()
        names = {n for n, p in m.model.named_parameters() if p in m._fsdp_ignored()}
        mixer = {n for n in _phi_names(mixer=True) if "logit_g" in n}
        assert set(_phi_names()) <= names  # trained: always replicated
        assert (mixer <= names) == overlap, names


def test_hand_off_and_finetune_trainable_set(base, tmp_path):
    s1 = AttentionTransfer(base, hybrid=HYB)
    _trainer(tmp_path / "s1", steps=2).fit(s1, datamodule=_dm())
    phi = read_stage(tmp_path / "s1" / "stage.pt")["tensors"]

    m = HybridFinetune(base, hybrid=HYB, init_from=str(tmp_path / "s1" / "stage.pt"))
    m.configure_model()
    lora = sorted(f"model.layers.{i}.self_attn.{p}_proj.lora_{ab}.default.weight"
                  for i in LAYERS for p in "qkvo" for ab in "AB")
    assert m.trainable_parameter_names() == lora
    inner = dict(unwrap(m.model).named_parameters())
    assert all(torch.equal(inner[n], t) for n, t in phi.items())  # stage 1's maps, loaded
    tr = _trainer(tmp_path / "s2", steps=3, enable_checkpointing=True)
    tr.fit(m, datamodule=_dm())
    assert torch.isfinite(tr.callback_metrics["train/loss"])
    payload = read_stage(tmp_path / "s2" / "stage.pt")
    assert sorted(payload["tensors"]) == sorted(lora + _phi_names())
    assert payload["lora_config"]["r"] == 8 and payload["lora_config"]["lora_alpha"] == 16
    # the Lightning checkpoint holds trainable tensors only, never the frozen base
    ckpt = torch.load(next((tmp_path / "s2").rglob("*.ckpt")), weights_only=False)
    assert sorted(ckpt["state_dict"]) == sorted(f"model.base_model.model.{n}" for n in lora)

    m2 = HybridFinetune(base, hybrid=HYB, init_from=str(tmp_path / "s1" / "stage.pt"),
                        train_feature_maps=True, mode="la_only", la_span="all")
    m2.configure_model()
    assert m2.trainable_parameter_names() == sorted(lora + _phi_names())
    _, attn = next(hybrid_layers(unwrap(m2.model)))
    assert attn.hedgecats.mode == "la_only" and attn.hedgecats.la_span == "all"


def test_init_from_checks_keys(base, tmp_path):
    s1 = AttentionTransfer(base, hybrid=HYB)
    _trainer(tmp_path, steps=1).fit(s1, datamodule=_dm())
    # a stage that converts fewer layers (a hand-set hybrid.layers) takes only their maps
    m = HybridFinetune(base, hybrid={**HYB, "layers": [0]}, init_from=str(tmp_path / "stage.pt"))
    m.configure_model()
    assert [i for i, _ in hybrid_layers(unwrap(m.model))] == [0]
    # a learned mixer has parameters stage 1 (fixed mixer) did not train: missing
    m = HybridFinetune(base, hybrid={**HYB, "mixer": "learned_head"},
                       init_from=str(tmp_path / "stage.pt"))
    with pytest.raises(KeyError, match="absent from the checkpoint"):
        m.configure_model()


def test_teacher_pretraining_saves_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # an init seed other than the data's: both are logged as hyperparameters
    m = TeacherPretraining(hidden_size=32, num_layers=2, num_heads=2, warmup_steps=2, init_seed=3)
    dm = _dm()
    assert dm.hparams.seed != 3
    tr = _trainer(tmp_path, steps=4)
    tr.fit(m, datamodule=dm)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert model.config.num_hidden_layers == 2 and tok.decode([72, 105]) == "Hi"
    ids = torch.randint(0, 256, (1, 16))
    torch.testing.assert_close(model(ids).logits, m.model.eval()(ids).logits)


def test_non_finite_loss_stops_before_a_bad_checkpoint(base, tmp_path):
    m = HybridFinetune(base, hybrid=HYB, lr=1e-3)

    orig = m._lm_loss

    def poisoned(batch):
        loss = orig(batch)
        return loss * float("nan") if m.global_step >= 2 else loss

    m._lm_loss = poisoned
    ck = tmp_path / "checkpoints"
    tr = _trainer(tmp_path, steps=5, enable_checkpointing=True, callbacks=[
        ModelCheckpoint(dirpath=ck, save_last=True, every_n_train_steps=1, save_top_k=0),
        CheckpointOnInterrupt(str(ck))])
    with pytest.raises(NonFiniteLossError, match="non-finite loss .* global step 2"):
        tr.fit(m, datamodule=_dm())
    state = torch.load(ck / "last.ckpt", weights_only=False)
    assert state["global_step"] == 2
    assert all(torch.isfinite(t).all() for t in state["state_dict"].values())
    assert not (tmp_path / "stage.pt").exists()


@pytest.mark.parametrize("anomaly", [False, True])
def test_non_finite_layer_loss_stops_transfer_before_the_optimiser(base, tmp_path, monkeypatch,
                                                                    anomaly):
    """A NaN in one layer's loss (backpropagated like the others: no per-layer host sync) stops
    stage 1 before the optimiser step: the feature maps keep the previous step's values."""
    from hedgecats.lightning_modules import stages

    m = AttentionTransfer(base, hybrid=HYB, lr=1e-2)
    snapshots = []

    def poisoned(objective, module, *args, **kw):
        loss, extras = transfer_loss(objective, module, *args, **kw)
        if m.global_step >= 2 and module.hedgecats.layer_idx == LAYERS[-1]:
            return loss * float("nan"), extras
        return loss, extras

    class Snapshot(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            snapshots.append({k: v.detach().clone() for k, v in
                              unwrap(pl_module.model).named_parameters() if v.requires_grad})

    monkeypatch.setattr(stages, "transfer_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="non-finite loss .* global step 2"):
        _trainer(tmp_path, steps=5, callbacks=[Snapshot()],
                 detect_anomaly=anomaly).fit(m, datamodule=_dm())
    assert len(snapshots) == 3  # steps 0 and 1 applied, step 2 stopped
    after = {k: v for k, v in unwrap(m.model).named_parameters() if v.requires_grad}
    assert after.keys() == snapshots[2].keys()
    for k, v in after.items():
        assert torch.isfinite(v).all(), k
        assert torch.equal(v, snapshots[2][k]), f"{k} changed by the non-finite step"
    assert not any(torch.equal(v, snapshots[0][k]) for k, v in after.items())  # it did learn


def test_transfer_accumulation_follows_the_datamodule():
    """Stage 1 optimises by hand: with accumulate_grad_batches=None it takes the DataModule's
    derived value (global batch / (micro batch x world size)); an explicit value wins."""
    from types import SimpleNamespace

    from hedgecats.lightning_modules import AttentionTransfer

    stage = AttentionTransfer("unused-path", hybrid={"window": 4})
    stage._trainer = SimpleNamespace(datamodule=SimpleNamespace(accumulate_grad_batches=4))
    assert stage._accumulation() == 4
    stage._trainer = SimpleNamespace(datamodule=None)
    assert stage._accumulation() == 1
    fixed = AttentionTransfer("unused-path", hybrid={"window": 4}, accumulate_grad_batches=3)
    fixed._trainer = SimpleNamespace(datamodule=SimpleNamespace(accumulate_grad_batches=4))
    assert fixed._accumulation() == 3


def test_transfer_logs_kl_and_health_and_records_it(base, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    m = AttentionTransfer(base, hybrid=HYB, objective="weights_xent")
    tr = _trainer(tmp_path, steps=3, val_check_interval=3, log_every_n_steps=3,
                  logger=CSVLogger(str(tmp_path), name="logs", version="v"))
    tr.fit(m, datamodule=_dm())
    logged = set(tr.callback_metrics)
    assert {"transfer/layer_00/kl", "val/transfer/layer_01/kl", "val/la_rel_err",
            "val/hybrid_rel_err", "val/den_collapsed",
            "val/transfer/layer_00/la_rel_err"} <= logged
    assert all(tr.callback_metrics[f"val/transfer/layer_{i:02d}/kl"] >= 0 for i in LAYERS)
    health = read_stage(tmp_path / "stage.pt")["meta"]["health"]
    assert set(health) == {"la_rel_err", "hybrid_rel_err", "den_collapsed"}
    assert set(health["la_rel_err"]) == set(LAYERS)
    csv = (tmp_path / "logs" / "v" / "metrics.csv").read_text()
    assert "final/la_rel_err" in csv and "final/transfer/layer_01/den_collapsed" in csv
    assert "transfer/layer_00/kl" in csv.splitlines()[0].split(",")


def _collapsed_transfer(base, objective, **kw) -> AttentionTransfer:
    """Feature maps pushed onto disjoint coordinates (the collapse the first weights_xent found)
    and lr ~0 so training cannot repair them: every feature product is 0."""
    hybrid = {**HYB, "feature_activation": "relu", **kw.pop("hybrid", {})}
    m = AttentionTransfer(base, hybrid=hybrid, objective=objective,
                          lr=1e-30, **kw)  # lr must be > 0; 1e-30 leaves the maps as initialised
    m.configure_model()
    with torch.no_grad():  # relu features: queries on coordinate 0, keys on 1: every product 0
        for _, attn in hybrid_layers(unwrap(m.model)):
            for fm, coord in ((attn.phi_q, 0), (attn.phi_k, 1)):
                fm.weight.zero_()
                fm.bias.zero_()
                fm.bias[:, coord] = 1.0
    return m


@pytest.mark.parametrize("objective", ["weights_xent", "hybrid_output_mse"])
def test_collapsed_transfer_stops_with_a_clear_error_and_no_stage_file(base, tmp_path, objective):
    """The end-of-stage check refuses a collapsed student (normalised LA: fixed mixer)."""
    from hedgecats.lightning_modules.stages import TransferCollapseError

    m = _collapsed_transfer(base, objective)
    assert m.den_collapsed_limit() == 0.5
    tr = _trainer(tmp_path, steps=2, val_check_interval=2)
    with pytest.raises(TransferCollapseError, match="den_collapsed|rel_err"):
        tr.fit(m, datamodule=_dm())
    assert not (tmp_path / "stage.pt").exists()


def test_collapse_check_is_off_by_default_for_shared_norm_mixers(base, tmp_path):
    """Under a shared normaliser a row below the floor is routed to the window by design (the
    testbed's LoLCATs max-shifted runs: 52% of rows below it, LA used as much as with g = 0.5):
    'auto' does not stop such a stage; an explicit limit still does; other strings are refused."""
    from hedgecats.lightning_modules.stages import TransferCollapseError

    shared = {"mixer": "shared_norm", "shared_norm_shift": "window_max"}
    m = _collapsed_transfer(base, "hybrid_output_mse", hybrid=shared)
    assert m.den_collapsed_limit() is None
    _trainer(tmp_path / "auto", steps=2, val_check_interval=2).fit(m, datamodule=_dm())
    assert (tmp_path / "auto" / "stage.pt").exists()
    assert m.final_health()["den_collapsed"]  # measured and logged all the same
    m = _collapsed_transfer(base, "hybrid_output_mse", hybrid=shared, max_den_collapsed=0.5)
    with pytest.raises(TransferCollapseError, match="den_collapsed"):
        _trainer(tmp_path / "explicit", steps=2, val_check_interval=2).fit(m, datamodule=_dm())
    with pytest.raises(ValueError, match="max_den_collapsed='sometimes'"):
        AttentionTransfer(base, hybrid=HYB, max_den_collapsed="sometimes")


@pytest.mark.parametrize("mixer", ["gate_elementwise", "gate_lowrank"])
def test_output_mse_transfer_trains_output_gates(base, tmp_path, mixer):
    """The observer hands the layer input to the objective, so output-gate mixers work with
    hybrid_output_mse (the first version refused them) and their parameters learn."""
    m = AttentionTransfer(base, hybrid={**HYB, "mixer": mixer}, objective="hybrid_output_mse")
    m.configure_model()
    before = {n: p.clone() for n, p in m.model.named_parameters() if ".mixer." in n}
    assert before
    _trainer(tmp_path, steps=2).fit(m, datamodule=_dm())
    after = dict(m.model.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in before.items() if ".up." in n)


class _MemoryLogger(pl.loggers.Logger):
    """Every ``log_metrics`` call: ``(step, metrics)``."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_hyperparams(self, *args, **kw):
        pass

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


def _recorded_transfer(base):
    """An ``AttentionTransfer`` that records, per training step (0-based batch), the per-layer
    losses and extras it computed and the names it passed to ``self.log``."""
    m = AttentionTransfer(base, hybrid=HYB, objective="weights_xent", health_batches=0)
    m.steps, m.calls = [], []
    orig_losses, orig_log = m._layer_losses, m.log

    def layer_losses(batch, backward_scale):
        losses, extras = orig_losses(batch, backward_scale)
        m.steps.append(({i: float(v) for i, v in losses.items()},
                        {i: {k: float(x) for k, x in e.items()} for i, e in extras.items()}))
        return losses, extras

    def log(name, value, *args, **kw):
        m.calls.append((len(m.steps) - 1, name))
        return orig_log(name, value, *args, **kw)

    m._layer_losses, m.log = layer_losses, log
    return m


def _layer_keys():
    return {f"transfer/layer_{i:02d}/{k}" for i in LAYERS for k in ("weights_xent", "kl")}


def test_per_layer_training_metrics_are_logged_only_on_logging_steps(base, tmp_path):
    """With log_every_n_steps=2, 4 steps: Lightning writes the step logs of steps 1 and 3
    (0-based); the per-layer values reach the logger there, with those steps' values, and
    ``self.log`` is not called for them on the other steps (65 calls a step on an 8B model,
    never written); ``train/loss`` is logged on every step."""
    m = _recorded_transfer(base)
    logger = _MemoryLogger()
    seen = []

    class TrainLoss(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(float(trainer.callback_metrics["train/loss"]))

    _trainer(tmp_path, steps=4, log_every_n_steps=2, logger=logger, limit_val_batches=0,
             callbacks=[TrainLoss()]).fit(m, datamodule=_dm())
    assert len(m.steps) == 4
    # self.log: per-layer names only on steps 1 and 3, all of them; train/loss on every step
    layer_calls = [(s, n) for s, n in m.calls if n.startswith("transfer/layer_")]
    assert sorted({s for s, _ in layer_calls}) == [1, 3]
    assert sorted(n for s, n in layer_calls if s == 1) == sorted(_layer_keys())
    assert len(layer_calls) == 2 * len(_layer_keys())
    assert [s for s, n in m.calls if n == "train/loss"] == [0, 1, 2, 3]
    mean = [sum(losses.values()) / len(losses) for losses, _ in m.steps]
    assert seen == pytest.approx(mean, rel=1e-6)
    # what the logger received: the per-layer values of steps 1 and 3, at those steps
    rows = [(step, r) for step, r in logger.rows if any(k in _layer_keys() for k in r)]
    assert [step for step, _ in rows] == [1, 3]
    for step, r in rows:
        losses, extras = m.steps[step]
        assert _layer_keys() <= set(r)
        for i in LAYERS:
            assert r[f"transfer/layer_{i:02d}/weights_xent"] == pytest.approx(losses[i], rel=1e-6)
            assert r[f"transfer/layer_{i:02d}/kl"] == pytest.approx(extras[i]["kl"], rel=1e-6)
        assert r["train/loss"] == pytest.approx(mean[step], rel=1e-6)


def test_per_layer_metrics_follow_a_stop_decided_after_the_step(base, tmp_path):
    """A callback (e.g. Timer's max_time) that sets ``should_stop`` after the training step
    makes Lightning write that step's logs: the per-layer values are logged there too, those
    of that step (not the last logging step's)."""
    m = _recorded_transfer(base)
    logger = _MemoryLogger()

    class StopAfterFirst(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trainer.should_stop = True

    _trainer(tmp_path, steps=4, log_every_n_steps=2, logger=logger, limit_val_batches=0,
             callbacks=[StopAfterFirst()]).fit(m, datamodule=_dm())
    assert len(m.steps) == 1
    rows = [(step, r) for step, r in logger.rows if any(k in _layer_keys() for k in r)]
    assert [step for step, _ in rows] == [0]
    losses, _ = m.steps[0]
    assert rows[0][1]["transfer/layer_01/weights_xent"] == pytest.approx(losses[1], rel=1e-6)


def test_per_layer_logging_without_lightnings_rule_logs_every_step():
    """Where ``trainer._logger_connector.should_update_logs`` is missing (another Lightning)
    every step logs, as before: only slower."""
    from types import SimpleNamespace

    stage = AttentionTransfer("unused-path", hybrid={"window": 4})
    assert stage._step_logs_written()  # no trainer
    stage._trainer = SimpleNamespace(fast_dev_run=False)
    assert stage._step_logs_written()
    stage._trainer = SimpleNamespace(fast_dev_run=False,
                                     _logger_connector=SimpleNamespace(should_update_logs=False))
    assert not stage._step_logs_written()
