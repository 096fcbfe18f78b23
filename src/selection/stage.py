"""``LayerSelection``: the pipeline stage ``select-layers`` (docs/layer-selection.md).

A stage like the others (a LightningCLI ``fit`` config, so validation, ``--set``, the run
record, ``done`` and the input digests work as for training stages), that trains nothing: when
``fit`` starts it scores the layers of ``init_from`` (stage 1's ``stage.pt``) on the held-out
text (its DataModule's validation split, never trained on), applies the budget, writes the
report and ``stage.pt`` (``init_from`` converting only the layers left hybrid) into the stage
directory, and stops. The next stage starts from that ``stage.pt`` and, without a
``hybrid.layers`` of its own, converts its layers.
"""

from __future__ import annotations

import logging
import os
import warnings
from itertools import islice
from pathlib import Path

import lightning.pytorch as pl

from .budget import Budget
from .report import write_report
from .scores import CHEAP, check_scores
from .select import load_stage_model, select_layers, write_selected_stage

log = logging.getLogger(__name__)

__all__ = ["LayerSelection"]

STAGE_FILE = "stage.pt"


class LayerSelection(pl.LightningModule):
    """Choose the layers kept softmax by a measured score and a budget.

    Args:
        init_from: stage 1's ``stage.pt`` (a converted model without LoRA).
        model_name_or_path: the base model; default: the one ``init_from`` records.
        torch_dtype: the model's dtype; default: the one ``init_from`` trained with.
        score: what ranks the layers: ``kl`` (the KL to the teacher with only that layer
            hybrid), ``la_rel_err``, ``hybrid_rel_err``, ``la_share``, ``random``
            (``hedgecats.selection.scores``); higher = worse = kept softmax first.
        compare: scores measured beside it and reported with their agreement (default: the
            cheap ones, which the teacher's forward gives).
        keep: keep the ``keep`` worst layers softmax; or a budget:
        max_softmax: at most this many softmax layers;
        kl_below: keep softmax layers until the held-out KL to the teacher (nats per token) is
            below this (``hedgecats.selection.budget``).
        max_batches: held-out batches scored (default: the whole validation split).
        min_tokens: the fewest held-out tokens to score on; fewer is an error.
        random_seed: the ``random`` score's seed (default: the run's).
    """

    def __init__(self, init_from: str, model_name_or_path: str | None = None,
                 torch_dtype: str | None = None, score: str = "kl",
                 compare: list[str] | None = None, keep: int | None = None,
                 max_softmax: int | None = None, kl_below: float | None = None,
                 max_batches: int | None = None, min_tokens: int = 256,
                 random_seed: int | None = None) -> None:
        super().__init__()
        check_scores([score], "score")
        check_scores(compare or [], "compare")
        self.budget = Budget(keep=keep, max_softmax=max_softmax, kl_below=kl_below)
        if max_batches is not None and (isinstance(max_batches, bool) or max_batches < 1):
            raise ValueError(f"max_batches={max_batches!r} must be >= 1 (or null: the whole "
                             "validation split)")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens={min_tokens!r} must be an integer >= 1")
        # this stage has no optimizer and no validation loop on purpose: it trains nothing
        for message in (r"`LightningModule.configure_optimizers` returned `None`",
                        r"You passed in a `val_dataloader` but have no `validation_step`"):
            warnings.filterwarnings("ignore", message=message)
        self.save_hyperparameters()
        if compare is None:
            self.hparams.compare = [s for s in CHEAP if s != score]
        self.model = None
        self.selection: dict | None = None
        self.strict_loading = False
        self.automatic_optimization = False

    def configure_model(self) -> None:
        if self.model is None:
            h = self.hparams
            self.model, _ = load_stage_model(h.init_from, base_model=h.model_name_or_path,
                                             dtype=h.torch_dtype)
            self.model.train()  # as Lightning expects at fit's start; scoring runs in eval mode

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            raise ValueError(f"LayerSelection scores on one device; this trainer has "
                             f"{self.trainer.world_size} processes: set trainer.devices: 1")

    def configure_optimizers(self):
        return None

    def training_step(self, batch, batch_idx):  # never reached: fit stops at its start
        raise RuntimeError("LayerSelection trains nothing; it selects when fit starts")

    def _held_out(self) -> list[dict]:
        dm = self.trainer.datamodule
        if dm is None or not hasattr(dm, "val_dataloader"):
            raise ValueError("LayerSelection scores on held-out text: give the stage a data "
                             "module (its validation split is scored)")
        batches = list(islice(dm.val_dataloader(), self.hparams.max_batches))
        return [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")}
                for b in batches]

    def on_train_start(self) -> None:
        h = self.hparams
        seed = h.random_seed if h.random_seed is not None else _run_seed()
        self.selection = select_layers(
            [lambda: self.model], self._held_out(), score=h.score, budget=self.budget,
            compare=h.compare, names=[str(h.init_from)],
            context=self.trainer.precision_plugin.forward_context, seed=seed,
            min_tokens=h.min_tokens, source=f"{type(self.trainer.datamodule).__name__}'s "
                                             "validation split")
        sel = self.selection
        log.info("layer selection (%s, %s): kept softmax %s, hybrid %s", h.score,
                 sel["budget_text"], sel["kept_softmax"], sel["layers"])
        if self.trainer.is_global_zero:
            out = Path(self.trainer.default_root_dir)
            write_report(sel, out)
            write_selected_stage(h.init_from, out / STAGE_FILE, sel,
                                 base_model=h.model_name_or_path)
            if self.logger is not None:
                flat = {f"selection/{s}/layer_{i:02d}": v for s, per in sel["scores"].items()
                        for i, v in per.items()}
                flat.update({f"selection/kl_with_{n}_softmax": p["kl"]
                             for n, p in enumerate(sel["curve"])})
                flat["selection/kept_softmax"] = len(sel["kept_softmax"])
                self.logger.log_metrics(flat, step=0)
                self.logger.save()
        self.trainer.should_stop = True

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["state_dict"] = {}  # nothing trains; the model is init_from's

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        pass


def _run_seed() -> int:
    """The run's seed (``seed_everything`` exports it as ``PL_GLOBAL_SEED``), else 0."""
    return int(os.environ.get("PL_GLOBAL_SEED", "0"))
