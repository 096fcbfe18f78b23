"""One LightningModule per training stage, and the callbacks that drive them.

Imports lightning; ``hedgecats.models`` never does (DESIGN.md, layering).
"""

from .callbacks import (
    SSD_SCHEDULES,
    CheckpointOnInterrupt,
    ScheduledSlidingWindowDropout,
    resolve_ssd_schedule,
    ssd_schedule,
)
from .recall_data import RecallDataModule
from .stages import (
    DEFAULT_LORA,
    AttentionTransfer,
    HybridFinetune,
    HybridStage,
    NonFiniteLossError,
    TeacherPretraining,
)

__all__ = [
    "DEFAULT_LORA",
    "SSD_SCHEDULES",
    "AttentionTransfer",
    "CheckpointOnInterrupt",
    "HybridFinetune",
    "HybridStage",
    "NonFiniteLossError",
    "RecallDataModule",
    "ScheduledSlidingWindowDropout",
    "TeacherPretraining",
    "resolve_ssd_schedule",
    "ssd_schedule",
]
