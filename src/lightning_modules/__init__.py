"""One LightningModule per training stage, and the callbacks that drive them.

Imports lightning; ``hedgecats.models`` never does (docs/architecture.md: the floors).

This is the Lightning-facing namespace that YAML configs name in ``class_path``: besides the
stages and callbacks it re-exports ``RecallDataModule``, whose home is
``hedgecats.data.recall_bytes`` (``class_path: hedgecats.lightning_modules.RecallDataModule``
and ``hedgecats.data.RecallDataModule`` are the same class), and the layer selector's stage
``LayerSelection`` (``hedgecats.selection``).
"""

from ..data.recall_bytes import RecallDataModule
from ..selection.stage import LayerSelection
from .callbacks import (
    SSD_INTERVALS,
    SSD_SCHEDULES,
    CheckpointOnInterrupt,
    ScheduledSlidingWindowDropout,
    SSDScheduleError,
    resolve_ssd_schedule,
    ssd_phase,
    ssd_schedule,
)
from .downstream_eval import (
    ChoiceProbe,
    DownstreamEval,
    Probe,
    RecallChoiceProbe,
    RecallProbe,
    evaluation_steps,
)
from .guard import (
    AtomicCheckpointIO,
    DivergenceError,
    NonFiniteStateError,
    StepProgressBar,
    TrainingGuard,
)
from .stages import (
    DEFAULT_LORA,
    AttentionTransfer,
    HybridFinetune,
    HybridStage,
    NonFiniteLossError,
    TransferCollapseError,
)
from .teacher import TeacherPretraining

__all__ = [
    "DEFAULT_LORA",
    "SSD_INTERVALS",
    "SSD_SCHEDULES",
    "AtomicCheckpointIO",
    "AttentionTransfer",
    "CheckpointOnInterrupt",
    "ChoiceProbe",
    "DivergenceError",
    "DownstreamEval",
    "HybridFinetune",
    "HybridStage",
    "LayerSelection",
    "NonFiniteLossError",
    "NonFiniteStateError",
    "Probe",
    "RecallChoiceProbe",
    "RecallDataModule",
    "RecallProbe",
    "SSDScheduleError",
    "ScheduledSlidingWindowDropout",
    "StepProgressBar",
    "TeacherPretraining",
    "TrainingGuard",
    "TransferCollapseError",
    "evaluation_steps",
    "resolve_ssd_schedule",
    "ssd_phase",
    "ssd_schedule",
]
