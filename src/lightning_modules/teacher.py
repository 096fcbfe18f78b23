"""``TeacherPretraining``: a small Llama-like model pretrained from scratch (the embedded
default's teacher, the testbed's teachers and the pretraining study), on the stages' base."""

from __future__ import annotations

import logging
import math

import torch

from ..data.tokenization import BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE
from .stages import _NextTokenLoss, _Stage, run_seed

log = logging.getLogger(__name__)

__all__ = ["TeacherPretraining"]


class TeacherPretraining(_NextTokenLoss, _Stage):
    """Pretrain a small Llama-like model from scratch: the embedded default's teacher, and the
    second seed's pretraining study (docs/method.md#pretraining-study).

    The architecture is a ``hedgecats.models.pretrain.PretrainConfig``, checked when this module
    is built (before any Trainer starts). Beyond the Llama shape:

    - ``attention_pattern``: per-layer attention, a string of ``F`` (full) and ``S`` (sliding
      window of ``sliding_window`` keys) tiled over the layers (e.g. ``"SSSF"``), or a list with
      one window (int) or ``"full"`` per layer; ``None``: every layer full. (``sliding_window``,
      not ``window``: Lightning refuses a hyperparameter that the DataModule has with another
      value, and ``RecallDataModule`` has a ``window``.)
    - ``output_gate``: ``none | elementwise | lowrank``, ``o_proj(sigmoid(gate(x)) * Attn)``
      from the layer input; ``gate_rank`` (lowrank), ``gate_init`` (every gate's value at
      initialisation: the gate starts constant and learns to depend on the input).
    - ``rope_fraction``: share of each head's dims that RoPE rotates (0: NoPE).
    - ``tie_word_embeddings``: output projection = input embedding (Llama's option; still a
      plain ``LlamaForCausalLM``); a copy task such as the recall corpus is learned much sooner.

    The defaults (every layer full, no gate, full RoPE) build a plain ``LlamaForCausalLM``, the
    one ``LlamaForCausalLM(config)`` builds after ``torch.manual_seed(init_seed)``; other
    settings build a
    ``PretrainLlamaForCausalLM`` (``model_type: hedgecats_pretrain``) whose shared weights are
    those of the plain model for the same ``init_seed``.

    At the start of ``fit`` the parameter counts by part are logged (and sent to the loggers as
    hyperparameters ``params/<part>``) and written with the config to
    ``<default_root_dir>/architecture.json``. At the end the model (and the datamodule's
    ``tokenizer``, if any) is saved with ``save_pretrained`` to ``<default_root_dir>/model``,
    ``architecture.json`` beside it; reload it with ``hedgecats.models.pretrain.load_pretrained``
    (or ``AutoModelForCausalLM.from_pretrained`` once ``hedgecats.models`` is imported).
    The learning rate warms up linearly for ``warmup_steps`` and decays by cosine to
    ``min_lr_ratio * lr`` at ``trainer.max_steps`` (which must be set). The vocabulary defaults
    to ``hedgecats.data.byte_level_tokenizer``'s. ``init_seed`` seeds the weights (named apart
    from the DataModule's ``seed``: Lightning refuses hyperparameters of one name and two values);
    unset, it is the run's seed (``seed_everything``, so ``hedgecats pipeline --seed S`` reaches
    the teacher as it reaches the feature maps).
    """

    ARCHITECTURE_FILE = "architecture.json"

    def __init__(self, vocab_size: int = BYTE_VOCAB_SIZE, hidden_size: int = 128,
                 num_layers: int = 4, num_heads: int = 4, num_kv_heads: int | None = None,
                 intermediate_size: int | None = None, max_position_embeddings: int = 1024,
                 rope_theta: float = 10000.0, pad_token_id: int | None = BYTE_PAD_ID,
                 eos_token_id: int | None = BYTE_EOS_ID, lr: float = 3e-3, weight_decay: float = 0.1,
                 warmup_steps: int = 50, min_lr_ratio: float = 0.1,
                 init_seed: int | None = None,
                 attention_pattern: str | list[int | str | None] | None = None,
                 sliding_window: int | None = None, output_gate: str = "none",
                 gate_rank: int = 16,
                 gate_init: float = 0.5, rope_fraction: float = 1.0,
                 tie_word_embeddings: bool = False) -> None:
        from ..models.pretrain import PretrainConfig

        super().__init__()
        self.save_hyperparameters()
        if self.hparams.init_seed is None:  # resolved and recorded (LightningCLI passes None)
            self.hparams.init_seed = run_seed()
        self.arch = PretrainConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
            num_heads=num_heads, num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
            pad_token_id=pad_token_id, eos_token_id=eos_token_id,
            attention_pattern=attention_pattern, sliding_window=sliding_window,
            output_gate=output_gate,
            gate_rank=gate_rank, gate_init=gate_init, rope_fraction=rope_fraction,
            tie_word_embeddings=tie_word_embeddings)

    def configure_model(self) -> None:
        if self.model is not None:
            return
        from ..models.pretrain import build_pretrain_model

        self.model = build_pretrain_model(self.arch, seed=self.hparams.init_seed)

    def on_fit_start(self) -> None:
        if not self.trainer.is_global_zero:
            return
        from ..models.pretrain import parameter_counts, write_architecture

        write_architecture(self._stage_dir() / self.ARCHITECTURE_FILE, self.arch, self.model)
        counts = parameter_counts(self.model)
        log.info("%s (pattern %s, gate %s, rotary dims %d of %d): %s", type(self.model).__name__,
                 self.arch.pattern_string(), self.arch.output_gate, self.arch.rotary_dim,
                 self.arch.head_dim, ", ".join(f"{k} {v:,}" for k, v in counts.items()))
        for logger in self.trainer.loggers:
            logger.log_hyperparams({f"params/{k}": v for k, v in counts.items()})

    def configure_optimizers(self):
        h = self.hparams
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": h.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=h.lr,
                                betas=(0.9, 0.95))

        def factor(step: int) -> float:
            total = self.trainer.max_steps
            if total is None or total < 1:
                raise ValueError("TeacherPretraining needs trainer.max_steps for its schedule")
            if step < h.warmup_steps:
                return (step + 1) / h.warmup_steps
            t = min(1.0, (step - h.warmup_steps) / max(1, total - h.warmup_steps))
            return h.min_lr_ratio + (1 - h.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_fit_end(self) -> None:
        if not self.trainer.is_global_zero:
            return
        out = self._stage_dir() / "model"
        self.model.save_pretrained(out)
        dm = self.trainer.datamodule
        tok = getattr(dm, "tokenizer", None) if dm is not None else None
        if tok is not None:
            tok.save_pretrained(out)
        from ..models.pretrain import write_architecture

        write_architecture(out / self.ARCHITECTURE_FILE, self.arch, self.model)
