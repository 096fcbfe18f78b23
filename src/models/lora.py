"""``LoraSettings``: the LoRA of stage 2, typed and validated (``peft.LoraConfig`` arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["LoraSettings"]

BIASES = ("none", "all", "lora_only")


@dataclass
class LoraSettings:
    """peft LoRA on the attention projections; the defaults are the paper's (rank 8, alpha 16 on
    q, k, v, o, no dropout).

    Attributes:
        r: rank (>= 1).
        lora_alpha: scale numerator: the update is ``(lora_alpha / r) B A`` (> 0).
        lora_dropout: dropout on the LoRA input, in [0, 1).
        target_modules: names of the linear layers that get LoRA (non-empty).
        bias: ``none | all | lora_only``: which biases train.
        use_rslora: scale by ``lora_alpha / sqrt(r)`` (rank-stabilised LoRA).
        extra: any other ``peft.LoraConfig`` keyword arguments, passed through.
    """

    r: int = 8
    lora_alpha: float = 16
    lora_dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    bias: str = "none"
    use_rslora: bool = False
    extra: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoraSettings.r={self.r!r} must be an integer >= 1")
        if not self.lora_alpha > 0:
            raise ValueError(f"LoraSettings.lora_alpha={self.lora_alpha!r} must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoraSettings.lora_dropout={self.lora_dropout!r} must lie in [0, 1)")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(f"LoraSettings.target_modules={self.target_modules!r} must be a "
                             "non-empty list of module names (e.g. [q_proj, v_proj])")
        if self.bias not in BIASES:
            raise ValueError(f"LoraSettings.bias={self.bias!r} is not valid; choose one of: "
                             f"{', '.join(BIASES)}")
        clash = sorted(set(self.extra or {}) & {f.name for f in fields(self)})
        if clash:
            raise ValueError(f"LoraSettings.extra repeats the typed fields {clash}; set them "
                             "directly")

    def to_dict(self) -> dict:
        """``peft.LoraConfig`` keyword arguments (``bias`` / ``use_rslora`` only when not the
        default, so the paper's setting reads as it always did)."""
        out = {"r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
               "target_modules": list(self.target_modules)}
        if self.bias != "none":
            out["bias"] = self.bias
        if self.use_rslora:
            out["use_rslora"] = True
        return {**out, **(self.extra or {})}

    @classmethod
    def from_dict(cls, d: dict) -> LoraSettings:
        """From ``peft.LoraConfig`` keyword arguments: the typed ones by name, every other under
        ``extra`` (a ``task_type`` is dropped: stage 2 always sets ``CAUSAL_LM``)."""
        typed = {f.name for f in fields(cls)} - {"extra"}
        d = dict(d)
        extra = {**(d.pop("extra", None) or {}),
                 **{k: d.pop(k) for k in list(d) if k not in typed and k != "task_type"}}
        d.pop("task_type", None)
        return cls(**d, extra=extra or None)
