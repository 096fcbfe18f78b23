"""The conversion stages, one LightningModule each (docs/method.md, stages 1 and 2), and their
shared base (``teacher.py`` builds on it for the teacher's pretraining).

    AttentionTransfer    stage 1: base frozen, feature maps (and mixer) learn the layer's softmax
    HybridFinetune       stage 2: peft LoRA on q,k,v,o, next-token loss or the KL to the teacher
                         (``distill``), hybrid or la_only mode

Every stage builds its model in ``configure_model`` from a model id/path (``from_pretrained``)
plus a ``HybridConfig`` dict, then loads ``init_from`` (the previous stage's ``stage.pt``) with
exact key checks. Lightning checkpoints (for ``ckpt_path`` resume) keep only the trainable
tensors; the frozen base is reloaded from its id. At the end of ``fit`` the stage writes
``<default_root_dir>/stage.pt`` (format in ``hedgecats.models.stage_files``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from ..models import (
    HybridConfig,
    attention_mode,
    hybrid_layers,
    hybrid_parameter_names,
    set_attention_mode,
)
from ..models.stage_files import (
    add_lora,
    build_hybrid,
    read_stage,
    resolve_dtype,
    save_stage,
    stage_tensors,
)
from ..models.activation_checkpointing import checkpointing_mode, enable_checkpointing
from ..models.lora import LoraSettings
from ..models.mixers import MASS_MIXERS
from ..models.ops.transfer.losses import OBJECTIVES, transfer_health, transfer_loss
from ..models.structure import unwrap
from .distill import (
    DEFAULT_CHUNK,
    TeacherUnavailableError,
    adapter_parameter_names,
    check_distillation,
    distill_terms,
    next_token_targets,
    teacher_targets,
)
from .student_stream import StudentStream

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_LORA",
    "AttentionTransfer",
    "HybridFinetune",
    "HybridStage",
    "NonFiniteLossError",
    "TransferCollapseError",
]

#: docs/method.md#stage-2-lora-fine-tuning: rank 8, alpha 16 on q, k, v, o = ``LoraSettings()``
DEFAULT_LORA = LoraSettings().to_dict()
STAGE_FILE = "stage.pt"


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or inf; raised before the optimiser step, so no bad state is saved."""


class TransferCollapseError(RuntimeError):
    """Attention transfer ended with a student worse than no attention (see
    ``AttentionTransfer``'s health check); no ``stage.pt`` was written."""


def _check_finite(module: pl.LightningModule, loss: torch.Tensor, batch_idx: int) -> None:
    finite = bool(torch.isfinite(loss.detach()).all())
    if module._trainer is not None and module.trainer.world_size > 1:
        finite = module.trainer.strategy.reduce_boolean_decision(finite, all=True)
    if not finite:
        raise NonFiniteLossError(
            f"{type(module).__name__}: non-finite loss ({loss.detach().float().item()!r} on this "
            f"rank) at global step {module.global_step}, batch {batch_idx}, stopped before the "
            "optimiser step; lower the learning rate, use bf16/fp32 instead of fp16, or check "
            "the data")


def _check_lr(lr: float) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 \
            or not math.isfinite(lr):
        raise ValueError(f"lr={lr!r} must be a finite number > 0")


def _hybrid_config(hybrid: HybridConfig | dict | None) -> HybridConfig:
    """A validated ``HybridConfig`` from the YAML's mapping (or one already built); without a
    ``seed`` of its own it takes the run's."""
    if hybrid is None or isinstance(hybrid, dict):
        hybrid = HybridConfig.from_dict(dict(hybrid or {}))
    elif not isinstance(hybrid, HybridConfig):
        raise TypeError(f"hybrid must be a HybridConfig or a mapping of its fields, got "
                        f"{type(hybrid).__name__}")
    # the run's seed (seed_everything, set before LightningCLI builds the model) initialises
    # the feature maps unless the config names its own: seeds of a recipe then differ in
    # stage 1 too (the first version always used HybridConfig's default, 0)
    if hybrid.seed is None:
        hybrid = dataclasses.replace(hybrid, seed=run_seed())
    return hybrid


def run_seed() -> int:
    """The seed of this run: ``seed_everything``'s (Lightning exports it as ``PL_GLOBAL_SEED``),
    or 0 when none was set."""
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))


class _Stage(pl.LightningModule):
    """Checkpoint plumbing shared by the stages: only trainable tensors go into a .ckpt."""

    def __init__(self) -> None:
        super().__init__()
        self.model: nn.Module | None = None
        self.strict_loading = False  # frozen base weights are not in the checkpoint (checked below)

    def setup(self, stage: str) -> None:
        # Denormal floats (tiny early-training values, Adam's second moments) make CPU kernels
        # several times slower; flushing them to zero is what GPUs do anyway.
        torch.set_flush_denormal(True)

    def _trainable_keys(self) -> set[str]:
        return {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = self._trainable_keys()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["hedgecats_rng"] = {"torch": torch.get_rng_state()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        got, want = set(checkpoint["state_dict"]), self._trainable_keys()
        if got != want:
            raise KeyError(f"{type(self).__name__}: checkpoint tensors differ from this stage's "
                           f"trainable parameters: unexpected {sorted(got - want)[:8]}, missing "
                           f"{sorted(want - got)[:8]}. ckpt_path resumes the same stage; start the "
                           "next stage with init_from=<stage.pt>")
        rng = checkpoint.get("hedgecats_rng")
        if rng is not None:
            torch.set_rng_state(rng["torch"])

    def _stage_dir(self) -> Path:
        return Path(self.trainer.default_root_dir)


class _NextTokenLoss:
    """Next-token cross-entropy on ``input_ids`` (padding masked out of attention and loss);
    shared by the stages that train on language modelling."""

    def _lm_loss(self, batch: dict) -> torch.Tensor:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        labels = ids if mask is None else ids.masked_fill(mask == 0, -100)
        # use_cache=False: nothing continues these sequences, so no cache is built
        return self.model(input_ids=ids, attention_mask=mask, labels=labels,
                          use_cache=False).loss

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self._lm_loss(batch)
        _check_finite(self, loss, batch_idx)
        self.log("train/loss", loss, prog_bar=True, on_step=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.log("val/loss", self._lm_loss(batch), prog_bar=True, sync_dist=True)


class HybridStage(_Stage):
    """A stage on a converted pretrained model (shared by stages 1 and 2).

    ``hybrid`` is a ``HybridConfig`` (in YAML, a mapping of its fields: ``--help`` lists them);
    without a ``seed`` of its own it takes the run's (``seed_everything``), so each training
    seed initialises its own feature maps. ``lr`` must be > 0."""

    def __init__(self, model_name_or_path: str, hybrid: HybridConfig | None = None,
                 revision: str | None = None, init_from: str | None = None,
                 torch_dtype: str | None = None, lr: float = 1e-2, weight_decay: float = 0.0,
                 activation_checkpointing: bool | str = False) -> None:
        super().__init__()
        _check_lr(lr)
        if weight_decay < 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
        self.hybrid_config = _hybrid_config(hybrid)  # validated before any build

    def _save_hparams(self) -> None:
        """``save_hyperparameters`` with ``hybrid`` (and ``lora``) as plain mappings: what the
        loggers and the checkpoint record."""
        self.save_hyperparameters()
        self.hparams["hybrid"] = self.hybrid_config.to_dict()

    # ------------------------------------------------------------------ model
    def _build_base(self) -> nn.Module:
        h = self.hparams
        payload = read_stage(h.init_from) if h.init_from else None
        if payload is not None:
            payload = self._follow_init_layers(payload)
        model = build_hybrid(h.model_name_or_path, revision=h.revision,
                             hybrid_config=self.hybrid_config, dtype=h.torch_dtype)
        if payload is not None:
            if payload["lora_config"] is not None:
                raise ValueError(f"init_from={h.init_from!r} carries LoRA weights; a stage "
                                 "starting from it would silently drop them")
            from ..models.stage_files import load_tensors

            load_tensors(model, payload["tensors"], required=hybrid_parameter_names(model))
            log.info("loaded %d tensors from %s", len(payload["tensors"]), h.init_from)
        return model

    def _follow_init_layers(self, payload: dict) -> dict:
        """The layers this stage converts. Without ``hybrid.layers`` of its own, those that
        ``init_from`` converted (``select-layers`` hands on the layers it keeps hybrid this
        way); with its own, those, from ``init_from``'s feature maps of the same layers
        (``ValueError`` for a layer it never converted)."""
        recorded = (payload.get("hybrid_config") or {}).get("layers")
        mine = self.hybrid_config.layers
        if mine is None:
            if recorded is not None:
                windows = {i: w for i, w in (self.hybrid_config.layer_windows or {}).items()
                           if i in recorded} or None
                self.hybrid_config = dataclasses.replace(self.hybrid_config,
                                                         layers=sorted(recorded),
                                                         layer_windows=windows)
                log.info("converting layers %s, as init_from=%s does", sorted(recorded),
                         self.hparams.init_from)
            return payload
        if recorded is not None and sorted(mine) == sorted(recorded):
            return payload
        from ..models.stage_files import converted_layers, restrict_to_layers

        if sorted(mine) != converted_layers(payload):
            log.warning("hybrid.layers=%s is set for this stage: it converts those, not the "
                        "layers %s of init_from=%s", sorted(mine), converted_layers(payload),
                        self.hparams.init_from)
        return restrict_to_layers(payload, mine, f"init_from={self.hparams.init_from!r}")

    def _prepare(self, model: nn.Module) -> nn.Module:
        raise NotImplementedError

    def configure_model(self) -> None:
        if self.model is not None:  # idempotent (Lightning may call it more than once)
            return
        self.model = self._prepare(self._build_base())
        self.model.train()  # from_pretrained returns eval mode; SSD and checkpointing need train
        if self.device_mesh is not None:
            self._shard()

    def _fsdp_ignored(self) -> set[nn.Parameter]:
        return set()

    def _shard(self) -> None:
        """FSDP2 (``ModelParallelStrategy``): ``fully_shard`` per decoder layer, then the root."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"] if "data_parallel" in \
            (self.device_mesh.mesh_dim_names or ()) else self.device_mesh
        mp = MixedPrecisionPolicy(param_dtype=resolve_dtype(self.hparams.torch_dtype))
        ignored = self._fsdp_ignored()
        inner = unwrap(self.model)
        for layer in inner.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp,
                        ignored_params={p for p in layer.parameters() if p in ignored} or None)
        fully_shard(self.model, mesh=mesh, mp_policy=mp,
                    ignored_params={p for p in self.model.parameters() if p in ignored} or None)

    def trainable_parameter_names(self) -> list[str]:
        """Names in ``unwrap(model).named_parameters()`` of what this stage trains."""
        return sorted(n for n, p in unwrap(self.model).named_parameters() if p.requires_grad)

    # ------------------------------------------------------------------ export
    def _export_hybrid_config(self) -> dict:
        """The conversion config, with the window the layers run at now (SSD may change it)."""
        cfg = self.hybrid_config.to_dict()
        windows = {i: a.hedgecats.window for i, a in hybrid_layers(unwrap(self.model))}
        if any(w != self.hybrid_config.window_for(i) for i, w in windows.items()):
            if len(set(windows.values())) == 1:
                cfg["window"], cfg["layer_windows"] = next(iter(windows.values())), None
            else:
                cfg["layer_windows"] = windows
        cfg["ssd_p"] = 0.0
        return cfg

    def _lora_config(self) -> dict | None:
        return None

    def _export_meta(self) -> dict:
        return {}

    def export(self, path: str | Path) -> Path | None:
        """Write the stage checkpoint (rank 0 writes; every rank must call it under FSDP2)."""
        tensors = stage_tensors(self.model)
        if not self.trainer.is_global_zero:
            return None
        h = self.hparams
        return save_stage(path, self.model, base_model=h.model_name_or_path, revision=h.revision,
                          hybrid_config=self._export_hybrid_config(),
                          lora_config=self._lora_config(), stage=type(self).__name__,
                          tensors=tensors,
                          meta={"global_step": self.global_step, "torch_dtype": h.torch_dtype,
                                "init_from": h.init_from, **self._export_meta()})

    def on_fit_end(self) -> None:
        self.export(self._stage_dir() / STAGE_FILE)

    def _batch(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        return batch["input_ids"], batch.get("attention_mask")


class AttentionTransfer(HybridStage):
    """Stage 1: the frozen model's own softmax attention teaches each layer's feature maps.

    The model runs in ``softmax`` mode (so the residual stream is the teacher's) under
    ``torch.no_grad``; an observer receives each converted layer's q, k, v, computes that layer's
    loss with gradients on ``phi_q``, ``phi_k`` (and the mixer), and backpropagates it at once.
    Peak memory therefore holds one layer's student graph, whatever the depth. The per-layer
    losses are averaged; each is logged as ``transfer/layer_07/<objective>`` (and, for
    ``weights_xent``, ``transfer/layer_07/kl``: the cross-entropy minus the teacher's entropy,
    >= 0, 0 = the LA weights match the teacher's) on the steps whose logs Lightning writes
    (every ``trainer.log_every_n_steps``; ``train/loss`` on every step). On the other steps
    ``trainer.callback_metrics`` keeps the per-layer values of the last such step.

    **Health.** Every validation logs, per layer and averaged, what the student's output is
    worth whatever the objective (``ops.transfer.transfer_health``): ``val/la_rel_err`` (LA over
    every key against the teacher's output; 1 = no better than an output of 0),
    ``val/hybrid_rel_err`` and ``val/den_collapsed`` (fraction of rows whose feature products
    sum to less than the kernel floor, ``eps`` per visible key). At the end of the stage the
    same is measured on up to ``health_batches``
    validation batches and checked: if any layer's trained output (LA for ``weights_xent`` /
    ``la_output_mse``, the hybrid for ``hybrid_output_mse``) has a relative error above
    ``max_rel_err`` (default 1.0: worse than no attention), or more than ``max_den_collapsed``
    of its rows collapsed (default ``"auto"``: 0.5, and no such check for shared-norm mixers,
    ``den_collapsed_limit``), the stage stops with ``TransferCollapseError`` and
    writes no ``stage.pt``. ``None`` switches a check off. The final values go into
    ``stage.pt``'s ``meta["health"]`` and the logger (``final/...``).

    Args:
        objective: ``weights_xent | la_output_mse | hybrid_output_mse``.
        train_mixer: train the mixer's parameters too (when it has any).
        xent_block: query-block size of the weights cross-entropy.
        accumulate_grad_batches: micro-batches per optimiser step (manual optimisation; the
            Trainer's own option does not apply). ``None``: the datamodule's
            ``accumulate_grad_batches`` (``FineWebEduDataModule`` derives it from the global
            batch and the world size), or 1 when the datamodule has none.
        lr: AdamW learning rate (paper: 1e-2).
        health_batches, max_rel_err, max_den_collapsed: the end-of-stage check (above).
        overlap_student: run each layer's student (loss and backward) on a CUDA side stream
            beside the teacher forward (``StudentStream``; at most ``overlap_max_lag`` layers
            behind): the same kernels on the same inputs (bitwise the in-order numbers on an
            H200, tests/test_stage1_overlap_gpu.py); off the GPU it runs in order and says so
            once. Off by default: on an 8B model it measured 0-1.4% faster (predicted 9-15%;
            the teacher's GEMMs leave no SMs free; docs/performance.md).
        activation_checkpointing: must stay ``False``: stage 1 has nothing to checkpoint
            (only the feature maps train, and the teacher forward runs without gradients, one
            layer's student graph at a time). ``True`` raises ``ValueError``; the argument is
            kept because the saved configs of earlier runs record it. To save memory here,
            lower the data's ``micro_batch_size`` (gradient accumulation keeps the global
            batch); checkpointing belongs to stage 2 (``HybridFinetune``).
    Other arguments: see ``HybridStage``.
    """

    def __init__(self, model_name_or_path: str, hybrid: HybridConfig | None = None,
                 objective: str = "weights_xent", revision: str | None = None,
                 init_from: str | None = None, torch_dtype: str | None = None, lr: float = 1e-2,
                 weight_decay: float = 0.0, train_mixer: bool = True, xent_block: int = 64,
                 accumulate_grad_batches: int | None = None,
                 activation_checkpointing: bool = False, health_batches: int = 2,
                 max_rel_err: float | None = 1.0,
                 max_den_collapsed: float | str | None = "auto", overlap_student: bool = False,
                 overlap_max_lag: int = 4) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r} is not valid; choose one of "
                             f"{', '.join(OBJECTIVES)}")
        if accumulate_grad_batches is not None and accumulate_grad_batches < 1:
            raise ValueError(f"accumulate_grad_batches={accumulate_grad_batches!r} must be >= 1")
        if health_batches < 0:
            raise ValueError(f"health_batches={health_batches!r} must be >= 0 (0: no final check)")
        if overlap_max_lag < 1:
            raise ValueError(f"overlap_max_lag={overlap_max_lag!r} must be >= 1 (layers the "
                             f"student may trail the teacher)")
        if isinstance(max_den_collapsed, str) and max_den_collapsed != "auto":
            raise ValueError(f"max_den_collapsed={max_den_collapsed!r}: a fraction in [0, 1], "
                             f"null (no check) or 'auto' (0.5, off for shared-norm mixers)")
        if activation_checkpointing:
            raise ValueError(
                "AttentionTransfer(activation_checkpointing=True) is not supported: stage 1 trains "
                "only the feature maps and runs the teacher forward without gradients, so there "
                "are no activations to checkpoint. Leave it false; to save memory lower the "
                "data's micro_batch_size (accumulate_grad_batches keeps the global batch), and "
                "use activation_checkpointing in HybridFinetune (stage 2)")
        super().__init__(model_name_or_path, hybrid, revision, init_from, torch_dtype, lr,
                         weight_decay, activation_checkpointing)
        self._save_hparams()
        self.automatic_optimization = False
        #: this step's per-layer values, logged in on_train_batch_end when Lightning writes them
        self._pending_layer_logs: tuple | None = None
        self._student_stream: StudentStream | None = None

    def _students(self) -> StudentStream | None:
        """The side stream of ``overlap_student`` (made on first use, on this module's device),
        or None when the option is off."""
        if not self.hparams.overlap_student:
            return None
        if self._student_stream is None:
            self._student_stream = StudentStream(self.device, self.hparams.overlap_max_lag)
        return self._student_stream

    def _prepare(self, model: nn.Module) -> nn.Module:
        model.requires_grad_(False)
        for name, p in model.named_parameters():
            if ".phi_q." in name or ".phi_k." in name or (self.hparams.train_mixer and ".mixer." in name):
                p.requires_grad_(True)
        return model

    def _fsdp_ignored(self) -> set[nn.Parameter]:
        # kept replicated: their gradients come from per-layer backward calls outside FSDP's
        # hooks (the forward runs without grad), and are averaged by hand. With overlap_student
        # every parameter the student reads is, frozen ones too (a frozen mixer): FSDP2 frees a
        # layer's gathered parameters when its forward ends, while the side stream may still
        # read them up to overlap_max_lag layers later
        student = (".phi_q.", ".phi_k.", ".mixer.") if self.hparams.overlap_student else ()
        return {p for n, p in self.model.named_parameters()
                if p.requires_grad or any(part in n for part in student)}

    def _ddp_model(self):
        strategy = self.trainer.strategy
        return strategy.model if isinstance(strategy, DDPStrategy) else None

    def on_train_batch_start(self, batch, batch_idx) -> None:
        ddp = self._ddp_model()
        if ddp is not None:  # gradients are averaged by hand in _sync_grads
            ddp.require_backward_grad_sync = False

    def _sync_grads(self) -> None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world = dist.get_world_size()
        for p in self.model.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad.div_(world)

    def _observe(self, batch: dict, observer) -> None:
        """One teacher forward with ``observer`` on every converted layer."""
        ids, mask = self._batch(batch)
        inner = unwrap(self.model)
        set_attention_mode(inner, "softmax", observer=observer)
        try:
            with torch.no_grad():
                # through the root module (FSDP2's root hooks unshard the embeddings), with the
                # LM head on one position only: the logits are not needed
                self.model(input_ids=ids, attention_mask=mask, logits_to_keep=1,
                           use_cache=False)
        finally:
            set_attention_mode(inner, observer=None)

    def _layer_losses(self, batch: dict, backward_scale: float | None
                      ) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
        """Per-layer losses (and extras such as the KL), backpropagating each at once unless
        ``backward_scale`` is None."""
        n_layers = sum(1 for _ in hybrid_layers(unwrap(self.model)))
        losses: dict[int, torch.Tensor] = {}
        extras: dict[int, dict[str, torch.Tensor]] = {}
        objective, block = self.hparams.objective, self.hparams.xent_block
        students = self._students()

        def observer(module, query, key, value, key_padding_mask, hidden_states,
                     teacher_output=None):
            i = module.hedgecats.layer_idx
            side = contextlib.nullcontext() if students is None else students.layer(
                query, key, value, key_padding_mask, hidden_states, teacher_output)
            with side, torch.enable_grad():
                loss, extras[i] = transfer_loss(objective, module, query, key, value,
                                                key_padding_mask, hidden_states, xent_block=block,
                                                teacher_output=teacher_output)
                if backward_scale is not None:
                    # backpropagated even if it is not finite: no host sync per layer (it kept
                    # the CPU from running ahead, 32 per step on an 8B model); a non-finite loss
                    # stops the step in _check_finite before the optimiser sees its gradients.
                    # Under anomaly detection (debugging, speed aside) the backward of a NaN
                    # would raise first, so there it is checked and skipped as before.
                    if torch.is_anomaly_enabled() and not torch.isfinite(loss.detach()):
                        losses[i] = loss.detach()
                        return
                    loss_scaled = loss * (backward_scale / n_layers)
                    if self._ddp_model() is not None or self.device_mesh is not None:
                        loss_scaled.backward()  # grads averaged by hand, not by DDP/FSDP hooks
                    else:
                        self.manual_backward(loss_scaled)
            losses[i] = loss.detach()

        # the output-MSE objectives compare with the teacher's attention output: the layer
        # hands it over (computed once, by the teacher's forward itself)
        observer.wants_teacher_output = objective != "weights_xent"
        try:
            self._observe(batch, observer)
        finally:  # also when a student raised: nothing of it may run on unordered
            if students is not None:
                students.join()  # the losses and gradients are read / stepped on this stream
        return losses, extras

    def _layer_health(self, batch: dict) -> dict[int, dict[str, torch.Tensor]]:
        health: dict[int, dict[str, torch.Tensor]] = {}

        def observer(module, query, key, value, key_padding_mask, hidden_states):
            health[module.hedgecats.layer_idx] = transfer_health(
                module, query, key, value, key_padding_mask, hidden_states)

        self._observe(batch, observer)
        return health

    def _log_losses(self, prefix: str, losses: dict[int, torch.Tensor],
                    extras: dict[int, dict[str, torch.Tensor]], on_step: bool) -> torch.Tensor:
        """Log the mean loss (``<prefix>/loss``) and the per-layer values. On a step
        (``on_step``, training) the per-layer values are kept for ``on_train_batch_end``, which
        logs them only when Lightning writes that step's logs; on an epoch (validation) every
        call logs them, as Lightning aggregates them over the epoch."""
        loss = torch.stack([losses[i] for i in sorted(losses)]).mean()
        prefix_layer = "transfer" if prefix == "train" else "val/transfer"
        if on_step:
            self._pending_layer_logs = (prefix_layer, losses, extras)
        else:
            self._log_layers(prefix_layer, losses, extras, on_step=False)
        self.log(f"{prefix}/loss", loss, prog_bar=True, on_step=on_step, on_epoch=not on_step,
                 sync_dist=not on_step)
        return loss

    def _log_layers(self, prefix_layer: str, losses: dict[int, torch.Tensor],
                    extras: dict[int, dict[str, torch.Tensor]], on_step: bool) -> None:
        obj = self.hparams.objective
        for i, v in losses.items():
            self.log(f"{prefix_layer}/layer_{i:02d}/{obj}", v, on_step=on_step,
                     on_epoch=not on_step, sync_dist=not on_step)
            for name, x in extras.get(i, {}).items():
                self.log(f"{prefix_layer}/layer_{i:02d}/{name}", x, on_step=on_step,
                         on_epoch=not on_step, sync_dist=not on_step)

    def _step_logs_written(self) -> bool:
        """Whether Lightning writes this training step's ``on_step`` logs to the loggers.

        Lightning (2.x) writes them in ``_LoggerConnector.update_train_step_metrics`` only when
        ``trainer._logger_connector.should_update_logs`` (the step, counted as
        ``_batches_that_stepped + 1``, a multiple of ``log_every_n_steps``, or
        ``trainer.should_stop``) or ``trainer.fast_dev_run``: a value logged on any other step
        is never written anywhere, yet each ``self.log`` costs host time (65 calls, +49 ms of
        a 409 ms step on a Llama-3-8B shape, benchmarks/results/lightning_gap.json).
        This asks that same private property rather than reproducing its rule: the step count
        it uses is private as well (``global_step`` counts optimiser steps, not batches, under
        stage 1's manual accumulation), and Lightning's own callbacks (``LearningRateMonitor``,
        ``DeviceStatsMonitor``, ``ThroughputMonitor``) ask it the same way. Where it is missing
        (another Lightning) the answer is "every step": the old behaviour, slower only."""
        trainer = self._trainer
        if trainer is None:
            return True
        try:
            return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)
        except (AttributeError, NotImplementedError):
            return True

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        # Here rather than in training_step: Lightning calls this hook after every callback's
        # on_train_batch_end (where Timer/max_time may set should_stop) and just before it
        # decides whether to write the step's logs, so both decisions see the same state.
        pending, self._pending_layer_logs = self._pending_layer_logs, None
        if pending is not None and self._step_logs_written():
            self._log_layers(*pending, on_step=True)

    def _accumulation(self) -> int:
        if self.hparams.accumulate_grad_batches is not None:
            return self.hparams.accumulate_grad_batches
        dm = self.trainer.datamodule if self._trainer is not None else None
        return int(getattr(dm, "accumulate_grad_batches", 1) or 1)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        accum = self._accumulation()
        losses, extras = self._layer_losses(batch, backward_scale=1.0 / accum)
        loss = torch.stack([losses[i] for i in sorted(losses)]).mean()
        _check_finite(self, loss, batch_idx)
        if (batch_idx + 1) % accum == 0:
            self._sync_grads()
            opt.step()
            opt.zero_grad(set_to_none=True)
        self._log_losses("train", losses, extras, on_step=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        losses, extras = self._layer_losses(batch, backward_scale=None)
        self._log_losses("val", losses, extras, on_step=False)
        for name, per_layer in _by_metric(self._layer_health(batch)).items():
            for i, x in per_layer.items():
                self.log(f"val/transfer/layer_{i:02d}/{name}", x, sync_dist=True)
            self.log(f"val/{name}", torch.stack(list(per_layer.values())).mean(), sync_dist=True)

    # ------------------------------------------------------------------ end-of-stage health
    def _checked_metric(self) -> str:
        return "hybrid_rel_err" if self.hparams.objective == "hybrid_output_mse" else "la_rel_err"

    @torch.no_grad()
    def final_health(self) -> dict[str, dict[int, float]]:
        """``{metric: {layer: value}}`` averaged over up to ``health_batches`` validation
        batches (and over ranks); empty when there is no validation data."""
        dm = self.trainer.datamodule if self._trainer is not None else None
        if self.hparams.health_batches == 0 or dm is None or not hasattr(dm, "val_dataloader"):
            return {}
        sums: dict[str, dict[int, torch.Tensor]] = {}
        n = 0
        for batch in dm.val_dataloader():
            if n == self.hparams.health_batches:
                break
            batch = self.transfer_batch_to_device(batch, self.device, 0)
            for name, per_layer in _by_metric(self._layer_health(batch)).items():
                for i, x in per_layer.items():
                    acc = sums.setdefault(name, {})
                    acc[i] = acc.get(i, 0) + x.float()
            n += 1
        if not n:
            return {}
        out = {}
        for name, per_layer in sums.items():
            vals = torch.stack([per_layer[i] for i in sorted(per_layer)]) / n
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(vals, op=dist.ReduceOp.SUM)
                vals /= dist.get_world_size()
            out[name] = {i: float(v) for i, v in zip(sorted(per_layer), vals.tolist())}
        return out

    def den_collapsed_limit(self) -> float | None:
        """The ``den_collapsed`` limit in force: ``max_den_collapsed``, where ``"auto"`` is 0.5,
        or no check for the mixers that weigh masses (shared norm, LA mass). Under a shared normaliser LA's weight in a row is
        its kernel mass against the window's, so a row whose products sum below the floor is
        routed to the window by design; how many such rows there are says nothing about whether
        LA is used where it is needed (testbed, docs/testbed.md: LoLCATs' max-shifted mixer
        ended stage 1 with 52% of rows below the floor in 3 of 3 seeds and then used LA as much
        as the fixed mixer, far-recall Delta_LA 0.37; the paper's shared-norm formula silenced
        LA with 3% of rows below it). With a normalised LA (fixed, learned, gated mixers) such a
        row's LA output is the floor's plain average of values, so the check stands."""
        limit = self.hparams.max_den_collapsed
        if limit != "auto":
            return limit
        return None if self.hybrid_config.mixer in MASS_MIXERS else 0.5

    def _check_health(self, health: dict[str, dict[int, float]]) -> None:
        h, metric = self.hparams, self._checked_metric()
        problems = []
        if h.max_rel_err is not None:
            bad = {i: round(v, 3) for i, v in health.get(metric, {}).items() if v > h.max_rel_err}
            if bad:
                problems.append(f"{metric} above {h.max_rel_err} (worse than an output of 0 at "
                                f"1.0) in layers {bad}")
        limit = self.den_collapsed_limit()
        if limit is not None:
            bad = {i: round(v, 3) for i, v in health.get("den_collapsed", {}).items()
                   if v > limit}
            if bad:
                problems.append(f"more than {limit:.0%} of rows whose feature products sum "
                                f"below the kernel floor (den_collapsed) in layers {bad}")
        if problems:
            raise TransferCollapseError(
                f"attention transfer ({h.objective}) ended with a student that does not "
                f"reproduce its teacher: {'; '.join(problems)}. No stage.pt was written. Look at "
                f"val/la_rel_err, val/den_collapsed and the per-layer loss curves in metrics.csv; "
                f"try a lower lr, another feature_activation or objective. To keep the result "
                f"anyway, set model.init_args.max_rel_err / max_den_collapsed to null.")

    def on_train_end(self) -> None:
        # measured where the stage trained, with its backend: Lightning's teardown moves the
        # model to the CPU before on_fit_end (which writes stage.pt)
        health = self.final_health()
        if health and self.logger is not None and self.trainer.is_global_zero:
            flat = {f"final/{name}": sum(v.values()) / len(v) for name, v in health.items()}
            flat.update({f"final/transfer/layer_{i:02d}/{name}": x
                         for name, v in health.items() for i, x in v.items()})
            self.logger.log_metrics(flat, step=self.global_step)
            self.logger.save()
        self._check_health(health)
        self._health = health

    def _export_meta(self) -> dict:
        return {"health": getattr(self, "_health", None)}

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def _by_metric(health: dict[int, dict[str, torch.Tensor]]) -> dict[str, dict[int, torch.Tensor]]:
    """``{layer: {metric: x}}`` -> ``{metric: {layer: x}}``."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for i, metrics in health.items():
        for name, x in metrics.items():
            out.setdefault(name, {})[i] = x
    return out


class HybridFinetune(_NextTokenLoss, HybridStage):
    """Stage 2: LoRA fine-tuning of the converted model on next-token prediction, or by
    distillation from the teacher (docs/method.md#stage-2-by-distillation).

    Args:
        lora: a ``LoraSettings`` (in YAML, a mapping of its fields; default: r 8, alpha 16 on
            q, k, v, o projections); other ``peft.LoraConfig`` arguments go under ``extra``.
        train_feature_maps: also train ``phi_q``, ``phi_k`` and mixer parameters (paper: frozen).
        mode: ``hybrid`` or ``la_only`` (pure-LA fine-tuning; use with ``la_span="all"``).
        la_span: ``outside | all`` for ``la_only``.
        lr: AdamW learning rate (paper: 1e-4); ``ReduceLROnPlateau`` on ``val/loss`` with
            ``plateau_factor`` and ``plateau_patience`` (epochs).
        activation_checkpointing: ``false``; ``true`` (= ``"layer"``: whole decoder layers run
            again in the backward, transformers' own); ``"mlp"``: only their MLP blocks, the
            attention's activations kept (the hybrid attention then runs once a step; more
            memory than ``true``, less than none: ``models.activation_checkpointing``).
        loss: ``next_token`` (the paper's), ``kl`` (``T^2 KL(teacher || student)`` at
            ``temperature``, per next-token position) or ``mixed`` (``(1 - kl_weight)
            next_token + kl_weight T^2 KL``). The teacher is this model in ``softmax`` mode
            with its adapters disabled, run under ``no_grad`` in the same step (``distill``).
        kl_weight: the KL's share in ``mixed``, in (0, 1); default 0.5. Only with ``mixed``.
        temperature: of both distributions in the KL, > 0; default 1. Only with ``kl`` /
            ``mixed``.
        kl_topk: keep the teacher's k most likely tokens per position and one bucket for the
            rest (a lower bound of the KL; the teacher's logits are freed before the student's
            forward); ``None``: the exact KL over the whole vocabulary.
        kl_chunk: positions per chunk of the KL (exact at any value; bounds its fp32 memory).

    Logged per step: ``train/loss`` (the objective), ``train/next_token`` and, with a teacher,
    ``train/kl`` (the KL without the ``T^2`` factor). Validation logs ``val/loss`` (next-token
    loss, whatever the objective: the plateau schedule and early stopping read it) and, with a
    teacher, ``val/kl``.
    Other arguments: see ``HybridStage``.
    """

    MODES = ("hybrid", "la_only")

    def __init__(self, model_name_or_path: str, hybrid: HybridConfig | None = None,
                 revision: str | None = None, init_from: str | None = None,
                 torch_dtype: str | None = None, lora: LoraSettings | None = None,
                 train_feature_maps: bool = False, mode: str = "hybrid", la_span: str = "outside",
                 lr: float = 1e-4, weight_decay: float = 0.0, plateau_factor: float = 0.1,
                 plateau_patience: int = 0, activation_checkpointing: bool | str = False,
                 loss: str = "next_token", kl_weight: float | None = None,
                 temperature: float | None = None, kl_topk: int | None = None,
                 kl_chunk: int = DEFAULT_CHUNK) -> None:
        checkpointing_mode(activation_checkpointing)  # a ValueError before anything is built
        if mode not in self.MODES:
            raise ValueError(f"mode={mode!r} is not valid for fine-tuning; choose one of "
                             f"{', '.join(self.MODES)}")
        if la_span not in ("outside", "all"):
            raise ValueError(f"la_span={la_span!r} is not valid; choose outside or all")
        if not 0 < plateau_factor < 1:
            raise ValueError(f"plateau_factor={plateau_factor!r} must lie in (0, 1)")
        if plateau_patience < 0:
            raise ValueError(f"plateau_patience={plateau_patience!r} must be >= 0")
        self._kl_weight, self._temperature = check_distillation(loss, kl_weight, temperature,
                                                                kl_topk, kl_chunk)
        super().__init__(model_name_or_path, hybrid, revision, init_from, torch_dtype, lr,
                         weight_decay, activation_checkpointing)
        if lora is None or isinstance(lora, dict):
            lora = LoraSettings.from_dict(lora or {})
        self.lora = lora.to_dict()
        self._save_hparams()
        self.hparams["lora"] = self.lora

    def _lora_config(self) -> dict:
        return self.lora

    @property
    def uses_teacher(self) -> bool:
        return self.hparams.loss != "next_token"

    def _build_base(self) -> nn.Module:
        if self.uses_teacher:
            self._check_teacher_source()
        model = super()._build_base()
        if self.uses_teacher and self.hparams.init_from:
            replaced = sorted(set(read_stage(self.hparams.init_from)["tensors"])
                              - set(hybrid_parameter_names(model)))
            if replaced:
                raise TeacherUnavailableError(
                    f"loss={self.hparams.loss!r} needs the original weights as the teacher, but "
                    f"init_from={self.hparams.init_from!r} replaces base weights "
                    f"{replaced[:6]}{' ...' if len(replaced) > 6 else ''} ({len(replaced)} in "
                    f"all): the model's softmax mode is no longer the original. Start from a "
                    f"stage.pt that holds only feature maps and mixers (stage 1's), or use "
                    f"loss: next_token")
        return model

    def _check_teacher_source(self) -> None:
        """The base model must be a plain model: a converted hybrid (an export, a LoLCATs
        import) may carry LoRA merged into its attention weights, so its softmax mode is not
        the original model."""
        from transformers import AutoConfig

        h = self.hparams
        cfg = AutoConfig.from_pretrained(h.model_name_or_path, revision=h.revision)
        if getattr(cfg, "hybrid", None) is not None:
            raise TeacherUnavailableError(
                f"loss={h.loss!r} needs the original model as the teacher, but "
                f"model_name_or_path={h.model_name_or_path!r} is a converted hybrid "
                f"(model_type {cfg.model_type!r}): its attention weights may hold LoRA merged "
                f"at export, and its original attention weights are not kept. Give the plain "
                f"base model it was converted from, with init_from=<stage 1's stage.pt>, or use "
                f"loss: next_token")

    def _prepare(self, model: nn.Module) -> nn.Module:
        h = self.hparams
        set_attention_mode(model, h.mode, la_span=h.la_span)
        enable_checkpointing(model, h.activation_checkpointing)
        model = add_lora(model, self.lora)  # freezes everything but LoRA
        if h.train_feature_maps:
            for name, p in unwrap(model).named_parameters():
                if any(f".{part}." in name for part in ("phi_q", "phi_k", "mixer")):
                    p.requires_grad_(True)
        if self.uses_teacher:
            self._check_teacher_trainables(model)
        return model

    def _check_teacher_trainables(self, model: nn.Module) -> None:
        """Everything this stage trains must be invisible to the teacher: adapter weights
        (disabled) and feature maps / mixers (unused in softmax mode)."""
        h, inner = self.hparams, unwrap(model)
        unseen = adapter_parameter_names(inner) | set(hybrid_parameter_names(inner))
        seen = sorted(n for n, p in inner.named_parameters() if p.requires_grad and n not in unseen)
        if seen:
            raise TeacherUnavailableError(
                f"loss={h.loss!r}: the teacher is this model in softmax mode with its adapters "
                f"disabled, but this stage would also train {seen[:6]}"
                f"{' ...' if len(seen) > 6 else ''} ({len(seen)} in all), which the teacher "
                f"reads (LoRA bias other than 'none' trains the base biases): the teacher would "
                f"drift from the original. Train adapters and feature maps only, or use "
                f"loss: next_token")
        vocab = inner.config.vocab_size
        if h.kl_topk is not None and h.kl_topk >= vocab:
            raise ValueError(f"kl_topk={h.kl_topk} keeps every token of this model's "
                             f"{vocab}-token vocabulary; set it below {vocab}, or to null for "
                             f"the exact KL")

    # ------------------------------------------------------------------ objective
    @contextlib.contextmanager
    def _as_teacher(self):
        """The model as its teacher: softmax attention, adapters off, no dropout, no grad."""
        modes = {m: m.training for m in self.model.modules()}
        try:
            self.model.eval()
            with torch.no_grad(), attention_mode(unwrap(self.model), "softmax"), \
                    self.model.disable_adapter():
                yield
        finally:
            for m, training in modes.items():
                m.training = training

    def _distill(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The objective and its terms (``kl``, ``next_token``) for one batch: the teacher's
        forward first (its logits reduced to what the loss needs), then the student's."""
        h = self.hparams
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        targets, weights = next_token_targets(ids, mask)
        with self._as_teacher():
            logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            teacher = teacher_targets(logits.flatten(0, 1), self._temperature, h.kl_topk,
                                      h.kl_chunk)
            del logits
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        kl, next_token = distill_terms(logits.flatten(0, 1), teacher, targets.flatten(),
                                       weights.flatten(), self._temperature, h.kl_chunk)
        w, t2 = self._kl_weight, self._temperature ** 2
        loss = t2 * kl if h.loss == "kl" else (1 - w) * next_token + w * t2 * kl
        return loss, {"kl": kl.detach(), "next_token": next_token.detach()}

    def _objective(self, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not self.uses_teacher:
            loss = self._lm_loss(batch)
            return loss, {"next_token": loss.detach()}
        return self._distill(batch)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, terms = self._objective(batch)
        _check_finite(self, loss, batch_idx)
        self.log("train/loss", loss, prog_bar=True, on_step=True)
        for name, value in terms.items():
            self.log(f"train/{name}", value, on_step=True)
        return loss

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        _, terms = self._objective(batch)
        self.log("val/loss", terms["next_token"], prog_bar=True, sync_dist=True)
        if "kl" in terms:
            self.log("val/kl", terms["kl"], sync_dist=True)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        self.log("test/loss", self._lm_loss(batch), sync_dist=True)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        sched = torch.optim.lr_scheduler.ReduceLROnPlateau(
            opt, mode="min", factor=self.hparams.plateau_factor,
            patience=self.hparams.plateau_patience)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val/loss",
                                                   "interval": "epoch", "strict": False}}
