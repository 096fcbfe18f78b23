"""Plain PyTorch + transformers: feature maps, the hybrid layer, mixers, conversion.

Never imports lightning (docs/architecture.md: the floors).
"""

from .config import LA_SPANS, MODES, SWITCHES, HybridConfig, parse_variant, validate_switches
from .convert import attention_mode, convert_to_hybrid, set_attention_mode
from .feature_maps import HedgehogFeatureMap
from .mixers import build_mixer
from .ops.hybrid.attention import hybrid_attention

# importing pretrain registers PretrainLlamaForCausalLM ("hedgecats_pretrain") with the Auto
# classes, so from_pretrained reloads gated / sliding-window teachers wherever models is imported
from .pretrain import PretrainConfig, build_pretrain_model, load_pretrained
from .structure import hybrid_layers, hybrid_parameter_names

__all__ = [
    "LA_SPANS",
    "MODES",
    "SWITCHES",
    "HedgehogFeatureMap",
    "HybridConfig",
    "PretrainConfig",
    "attention_mode",
    "build_mixer",
    "build_pretrain_model",
    "convert_to_hybrid",
    "hybrid_attention",
    "hybrid_layers",
    "hybrid_parameter_names",
    "load_pretrained",
    "parse_variant",
    "set_attention_mode",
    "validate_switches",
]
