"""Plain PyTorch + transformers: feature maps, the hybrid layer, mixers, conversion.

Never imports lightning (DESIGN.md, layering).
"""

from .config import HybridConfig
from .convert import (
    attention_mode,
    convert_to_hybrid,
    hybrid_layers,
    hybrid_parameter_names,
    set_attention_mode,
)
from .feature_maps import HedgehogFeatureMap
from .mixers import build_mixer
from .ops.hybrid import LA_SPANS, MODES, hybrid_attention

__all__ = [
    "HedgehogFeatureMap",
    "HybridConfig",
    "LA_SPANS",
    "MODES",
    "attention_mode",
    "build_mixer",
    "convert_to_hybrid",
    "hybrid_attention",
    "hybrid_layers",
    "hybrid_parameter_names",
    "set_attention_mode",
]
