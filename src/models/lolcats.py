"""LoLCATs conversions in hedgecats terms: their settings, their checkpoints, their formula.

LoLCATs (HazyResearch/lolcats) converts a Llama / Mistral into a hybrid whose layers mix a
window of softmax attention with Hedgehog linear attention through one shared denominator. Its
released conversions (e.g. ``hazyresearch/lolcats-llama-3.1-8b-distill`` + ``-ft-lora``) are two
small checkpoints on top of the unchanged base model. This module reads them and maps them onto
a hedgecats hybrid with the ``shared_norm`` mixer, so that the ablation tools run on them;
``hedgecats import-lolcats`` (``hedgecats.import_lolcats``) is the command.

What their code computes, per converted layer (facts read from the repository at commit
375df84; file names below are theirs):

- ``src/model/linear_attention/linear_attention.py`` (``LolcatsLinearAttention``): q, k, v from
  the base model's projections, RoPE applied, then k and v repeated to the query heads
  (``repeat_kv``) *before* the key feature map, which therefore has one head per query head.
- ``src/model/feature_map.py``: ``FeatureMapMLP.layer`` (H, D, f), ``u = einsum('hdf,bhld->bhlf',
  layer, x) + bias`` with ``bias`` a (1, H, 1, 1) parameter (``learned_kernel_kwargs.bias``) or
  the constant 0; ``SoftmaxDim`` (``feature_map: softmax_dim``, ``fullspace: true``):
  ``cat(softmax(u), softmax(-u)).clamp(min=eps)``, eps 1e-12: F = 2f features.
- ``linear_window_attention_{sw,tk}.py`` (``hybrid_attention_quadratic``): with
  ``s = sigmoid(window_factors)`` ((1, H, 1, 1), init -2.197 = logit(0.1)) and
  ``m_t`` the largest scaled logit of the window,

      a_sm = s * exp(q.k / sqrt(D) - m_t)  on the window        a_ln = f_q . f_k  outside it
      y_t  = (sum a_sm v + sum a_ln v) / (sum a_sm + sum a_ln)

  (``affine_attention_factors: true`` would put ``1 - s`` on ``a_ln``; no released config does,
  and it is refused here). ``_sw``: the window is ``t - w < i <= t``; ``_tk``: blocks of ``w``
  ending at the sequence's end, the query's block up to it plus the previous block
  (``get_masks``; ``ops.windows`` describes both shapes and the one-block case).
- ``src/trainer/default_lm.py`` (``save_trainable_weights``): a checkpoint is
  ``torch.save({'model_state_dict': {name: param for trainable named_parameters}, 'step': ...,
  <metric>: ...})``. Distillation trains the feature maps and window factors of a plain
  ``LlamaForCausalLM`` (``model.layers.{i}.self_attn.feature_map_q.mlp.layer``, ...); fine-tuning
  wraps it with peft (``src/model/peft.py``), so LoRA tensors are
  ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.default.weight`` (r, in) and
  ``...lora_B.default.weight`` (out, r), r 8, alpha 16, on q, k, v, o
  (``configs/experiment/finetune_lora_qkvo_alpaca_clean.yaml``).
- ``demos/demo_lolcats_hf.py`` (``load_hf_weights``): the hub files (``model.pt``) hold either
  that dict or the bare state dict, under the prefixes above or ``model.model.`` ones.
- ``configs/model/distill_llama3_1_8b_lk_smd_wtk64_fd64_w01.yaml``: the released Llama-3.1-8B
  conversion uses ``lolcats_llama_window_tk``, window 64, ``softmax_dim`` fullspace, feature
  dim 64 (= D/2: our ``rectangular`` projection), eps 1e-12, no bias, untied q/k maps.

How it maps onto ours (``hybrid_config``): ``feature_map_{q,k}.mlp.layer`` -> ``phi_{q,k}.weight``
(the same (H, D, f) layout and einsum), the per-head scalar bias -> our per-feature bias filled
with it (exact for any activation; a softmax ignores it anyway), the clamp -> ``feature_floor``,
key maps per query head -> ``key_map_heads="query"``, no LA kernel floor -> ``eps`` =
``reference.DEN_TINY`` (it only keeps divisions finite), ``window_factors`` -> the shared-norm
mixer's ``logit_factor`` (ours is ``sigmoid(logit_factor)`` too), the max-shift ->
``shared_norm_shift="window_max"``, the window -> ``window_shape`` ``sliding`` / ``terraced_end``,
LoRA -> a peft LoRA with the same r and alpha on the same modules.

``lolcats_attention`` below is their per-layer formula written out (T x T masks, as theirs), the
oracle the tests compare our layer with.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from torch import nn

from .config import HybridConfig
from .feature_maps import PROJECTIONS
from .ops.hybrid.reference import DEN_TINY
from .structure import hybrid_layers

log = logging.getLogger(__name__)

__all__ = [
    "ATTENTION_TYPES",
    "LolcatsSettings",
    "LolcatsWeights",
    "hybrid_config",
    "load_into",
    "lolcats_attention",
    "lolcats_feature_map",
    "lolcats_masks",
    "read_checkpoint",
    "read_weights",
]

#: LoLCATs attention types this importer maps, and the window shape each has in our layer
ATTENTION_TYPES = {
    "lolcats_llama_window_tk": "terraced_end",
    "lolcats_llama_window_sw": "sliding",
}
#: types LoLCATs has that are not imported, and why
UNSUPPORTED_TYPES = {
    "lolcats_llama": "pure linear attention (no softmax window): not a hybrid of the two branches",
    "lolcats_llama_window_tk_gen": "the ThunderKittens generation build of "
                                   "lolcats_llama_window_tk (same weights): import it with "
                                   "--attention-type lolcats_llama_window_tk",
    "lolcats_long_llama_window_tk": "chunked training variant (terraced windows inside chunks "
                                    "of state_chunk_len, states carried between them)",
    "lolcats_long_llama_window_sw": "chunked training variant (sliding windows inside chunks "
                                    "of state_chunk_len, states carried between them)",
    "lolcats_llama_window_sw_linear": "sliding window with a linear-attention window term",
    "softmax": "no conversion (the base model as it is)",
}

#: ``(prefix, layer, rest)`` of a LoLCATs parameter name: any of the prefixes their loader tries
#: (``model.``, ``model.model.``, ``base_model.model.model.``) before ``layers.{i}.self_attn.``
_KEY = re.compile(r"^(?P<prefix>(?:(?:base_model|model)\.)*)layers\.(?P<layer>\d+)\.self_attn\."
                  r"(?P<rest>.+)$")
_MAP = re.compile(r"^feature_map_(?P<which>[qk])\.mlp\.(?P<param>layer|bias)$")
_LORA = re.compile(r"^(?P<module>[qkvo]_proj)\.lora_(?P<ab>[AB])\.(?P<adapter>[^.]+)\.weight$")
_FACTOR = ("window_factors", "window_factor")  # the second: TK's legacy alias of the first


# ----------------------------------------------------------------------------- settings
@dataclass
class LolcatsSettings:
    """The ``attention:`` section of a LoLCATs model config, as far as it shapes the weights'
    meaning (their checkpoints do not record it). Defaults: the released Llama-3.1-8B
    conversion (``distill_llama3_1_8b_lk_smd_wtk64_fd64_w01.yaml``).

    Fields (their names): ``attention_type``, ``window_size``, ``feature_map`` and its kwargs
    ``fullspace`` / ``eps``, ``learned_kernel`` and its kwargs ``bias`` / ``skip_connection``,
    ``affine_attention_factors``, ``tie_qk_kernels``, ``train_window_factor`` and
    ``init_window_factor`` (an untrained factor is a buffer, absent from checkpoints),
    ``softmax_attentions`` (layers LoLCATs left as softmax attention)."""

    attention_type: str = "lolcats_llama_window_tk"
    window_size: int = 64
    feature_map: str = "softmax_dim"
    fullspace: bool = True
    eps: float = 1e-12
    learned_kernel: str = "untied_head_einsum"
    bias: bool = False
    skip_connection: bool = False
    affine_attention_factors: bool = False
    tie_qk_kernels: bool = False
    train_window_factor: bool = True
    init_window_factor: float = -2.1972245773362196
    softmax_attentions: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        t = self.attention_type
        if t not in ATTENTION_TYPES:
            why = UNSUPPORTED_TYPES.get(t)
            raise ValueError(
                f"LoLCATs attention_type {t!r} is " + (f"not imported: {why}" if why else
                                                       "unknown") +
                f"; supported: {', '.join(ATTENTION_TYPES)}")
        if isinstance(self.window_size, bool) or not isinstance(self.window_size, int) \
                or self.window_size < 1:
            raise ValueError(f"LoLCATs window_size={self.window_size!r} must be an integer >= 1")
        if self.feature_map != "softmax_dim" or not self.fullspace:
            raise ValueError(
                f"LoLCATs feature_map={self.feature_map!r} with fullspace={self.fullspace!r} is "
                f"not imported: only softmax_dim with fullspace (cat(softmax(u), softmax(-u))) "
                f"has a hedgecats counterpart (exp_dim subtracts a per-key max, relu / pos_elu "
                f"and halfspace maps keep one half)")
        if self.learned_kernel != "untied_head_einsum":
            raise ValueError(f"LoLCATs learned_kernel={self.learned_kernel!r} is not imported; "
                             f"supported: untied_head_einsum (FeatureMapMLP)")
        if self.skip_connection:
            raise ValueError("LoLCATs learned_kernel_kwargs.skip_connection=true (u = x + xW) is "
                             "not imported")
        if self.affine_attention_factors:
            raise ValueError("LoLCATs affine_attention_factors=true (LA terms weighted 1 - s) is "
                             "not imported: the shared-norm mixer weighs the window by s and LA "
                             "by 1")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"LoLCATs feature_map_kwargs.eps={self.eps!r} must lie in [0, 1)")
        self.softmax_attentions = sorted(int(i) for i in (self.softmax_attentions or []))

    @property
    def window_shape(self) -> str:
        return ATTENTION_TYPES[self.attention_type]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_config(cls, cfg: Mapping, **overrides) -> LolcatsSettings:
        """From a LoLCATs model config (the whole YAML, or its ``attention:`` section); keys that
        do not shape the weights (``state_chunk_len``, ``layer_idx``, ...) are ignored."""
        att = cfg.get("attention", cfg) if isinstance(cfg, Mapping) else None
        if not isinstance(att, Mapping):
            # ValueError, not TypeError: a bad file from the user, reported by the CLI
            raise ValueError("a LoLCATs model config has an 'attention:' mapping; none found")  # noqa: TRY004
        fm = att.get("feature_map_kwargs") or {}
        lk = att.get("learned_kernel_kwargs") or {}
        found = {
            "attention_type": att.get("attention_type"),
            "window_size": att.get("window_size"),
            "feature_map": att.get("feature_map"),
            "fullspace": fm.get("fullspace"),
            "eps": None if fm.get("eps") is None else float(fm["eps"]),
            "learned_kernel": att.get("learned_kernel"),
            "bias": lk.get("bias"),
            "skip_connection": lk.get("skip_connection"),
            "affine_attention_factors": att.get("affine_attention_factors"),
            "tie_qk_kernels": att.get("tie_qk_kernels"),
            "train_window_factor": att.get("train_window_factor"),
            "init_window_factor": (None if att.get("init_window_factor") is None
                                   else float(att["init_window_factor"])),
            "softmax_attentions": att.get("softmax_attentions"),
        }
        kw = {k: v for k, v in found.items() if v is not None}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides) -> LolcatsSettings:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"LoLCATs model config {str(path)!r} does not exist")
        try:
            return cls.from_config(yaml.safe_load(p.read_text()) or {}, **overrides)
        except ValueError as err:
            raise ValueError(f"{str(path)!r}: {err}") from err


def hybrid_config(settings: LolcatsSettings, *, head_dim: int, feature_dim: int,
                  num_layers: int) -> HybridConfig:
    """The ``HybridConfig`` whose layers compute what LoLCATs' do (module docstring).

    ``feature_dim``: LoLCATs' ``f`` (the columns of ``feature_map_*.mlp.layer``), which must be
    ``head_dim`` (our ``square`` projection) or ``head_dim / 2`` (``rectangular``)."""
    projection = {head_dim // d: name for name, d in PROJECTIONS.items()}.get(feature_dim)
    if projection is None or head_dim % feature_dim:
        raise ValueError(
            f"LoLCATs feature dimension {feature_dim} (the last axis of feature_map_q.mlp.layer) "
            f"has no hedgecats projection for head_dim {head_dim}: expected {head_dim} (square) or "
            f"{head_dim // 2} (rectangular)")
    bad = [i for i in settings.softmax_attentions if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"softmax_attentions {bad} are not layers of a {num_layers}-layer model")
    converted = [i for i in range(num_layers) if i not in settings.softmax_attentions]
    if not converted:
        raise ValueError("softmax_attentions names every layer: nothing to import")
    return HybridConfig(
        eps=DEN_TINY,  # no LA kernel floor in LoLCATs: fp32's smallest normal number, negligible
        window=settings.window_size,
        window_shape=settings.window_shape,
        feature_activation="softmax",
        feature_projection=projection,
        feature_floor=settings.eps,
        key_map_heads="query",
        overlap=False,
        mixer="shared_norm",
        shared_norm_shift="window_max",
        layers=None if len(converted) == num_layers else converted,
    )


# ----------------------------------------------------------------------------- checkpoints
def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict of a LoLCATs checkpoint file: ``{'model_state_dict': {...}, ...}`` as
    their trainer saves it, or the bare state dict (hub files may be either). Loaded with
    ``weights_only=True`` (tensors and plain containers only)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"LoLCATs checkpoint {str(path)!r} does not exist")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file, another format, or a pickled object
        raise ValueError(f"{str(path)!r} is not a readable LoLCATs checkpoint (torch.load with "
                         f"weights_only=True failed: {err})") from err
    if isinstance(obj, Mapping) and "model_state_dict" in obj:
        obj = obj["model_state_dict"]
    if not isinstance(obj, Mapping) or not obj:
        raise ValueError(f"{str(path)!r} holds no state dict: expected a dict of tensors, or "
                         f"{{'model_state_dict': dict of tensors, ...}} as LoLCATs saves them")
    not_tensors = [k for k, v in obj.items() if not torch.is_tensor(v)]
    if not_tensors:
        raise ValueError(f"{str(path)!r}: entries {not_tensors[:5]} are not tensors; a LoLCATs "
                         f"state dict maps parameter names to tensors")
    return dict(obj)


@dataclass
class LolcatsWeights:
    """What one or two LoLCATs checkpoints hold, per layer, in their shapes.

    maps[(layer, "q" | "k")] = (layer (H, D, f), bias (1, H, 1, 1) | None)
    factors[layer] = window_factors (1, H, 1, 1)
    lora[(layer, "q_proj" | ...)] = (A (r, in), B (out, r))
    sources[name] = the file each of those came from (for messages)
    """

    maps: dict = field(default_factory=dict)
    factors: dict = field(default_factory=dict)
    lora: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)

    @property
    def layers(self) -> list[int]:
        return sorted({i for i, _ in self.maps} | set(self.factors))


def read_weights(state: Mapping[str, torch.Tensor], source: str,
                 into: LolcatsWeights | None = None, *, allow_lora: bool) -> LolcatsWeights:
    """Sort a LoLCATs state dict into ``LolcatsWeights`` (entries already present are replaced:
    a fine-tuning checkpoint's feature maps override the distillation's). Any other name is an
    error that quotes it and says what such a checkpoint holds."""
    w = into if into is not None else LolcatsWeights()
    unexpected, lora_parts, factors = [], {}, {}
    for name, t in state.items():
        m = _KEY.match(name)
        rest = m["rest"] if m else None
        mm = _MAP.match(rest) if rest else None
        ml = _LORA.match(rest) if rest else None
        if mm:
            i, which = int(m["layer"]), mm["which"]
            layer, bias = w.maps.get((i, which), (None, None))
            if mm["param"] == "layer":
                layer = t
            else:
                bias = t
            w.maps[(i, which)] = (layer, bias)
            w.sources[(i, which)] = source
        elif rest in _FACTOR:
            i = int(m["layer"])
            if i in factors and not torch.equal(factors[i][1], t):  # two names, one parameter
                raise ValueError(f"{source}: {name!r} and {factors[i][0]!r} differ; the TK layer's "
                                 f"window_factor is an alias of its window_factors")
            factors[i] = (name, t)
            w.factors[i] = t
            w.sources[(i, "factor")] = source
        elif ml and allow_lora:
            lora_parts[(int(m["layer"]), ml["module"], ml["ab"], ml["adapter"])] = (name, t)
        else:
            unexpected.append(name)
    if unexpected:
        lora_note = ("; LoRA tensors belong in --lora, not in the attention-transfer checkpoint"
                     if any(_LORA.match((_KEY.match(n) or {"rest": ""})["rest"] or "")
                            for n in unexpected) else "")
        raise ValueError(
            f"{source}: unexpected keys {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} "
            f"({len(unexpected)}); a LoLCATs checkpoint holds "
            f"[model.]layers.{{i}}.self_attn.feature_map_{{q,k}}.mlp.layer (H, D, f), "
            f"...feature_map_{{q,k}}.mlp.bias (1, H, 1, 1), ...window_factors (1, H, 1, 1)"
            + (" and ...{q,k,v,o}_proj.lora_{A,B}.<adapter>.weight" if allow_lora else "")
            + lora_note)
    adapters = {a for (_, _, _, a) in lora_parts}
    if len(adapters) > 1:
        raise ValueError(f"{source}: LoRA tensors of several adapters {sorted(adapters)}; a "
                         f"LoLCATs fine-tuning checkpoint has one ('default')")
    for (i, mod, ab, a), (name, t) in lora_parts.items():
        other = "B" if ab == "A" else "A"
        if (i, mod, other, a) not in lora_parts:
            missing = name.replace(f"lora_{ab}.", f"lora_{other}.")
            raise ValueError(f"{source}: {name!r} has no partner {missing!r}")
        if ab == "A":
            w.lora[(i, mod)] = (t, lora_parts[(i, mod, "B", a)][1])
            w.sources[(i, mod)] = source
    return w


def _shape(t) -> tuple:
    return tuple(t.shape) if t is not None else None


def check_weights(w: LolcatsWeights, settings: LolcatsSettings, *, num_layers: int,
                  num_heads: int, head_dim: int, lora_modules: Mapping[str, tuple[int, int]]
                  ) -> int:
    """Check ``w`` against the base model; returns LoLCATs' feature dimension ``f``.

    ``lora_modules``: ``{"q_proj": (in_features, out_features), ...}`` of the base model.
    Every error names the key and the shape or layer that was expected."""
    H, D = num_heads, head_dim
    pre = "model.layers.{i}.self_attn."
    out_of_range = sorted({i for i in w.layers + [i for i, _ in w.lora] if i >= num_layers})
    if out_of_range:
        raise ValueError(f"the checkpoint has layers {out_of_range}, the base model only "
                         f"{num_layers} (layers 0-{num_layers - 1}): it was made for another "
                         f"model")
    converted = [i for i in range(num_layers) if i not in settings.softmax_attentions]
    kept = sorted(set(w.layers) & set(settings.softmax_attentions))
    if kept:
        raise ValueError(f"layers {kept} have LoLCATs weights but are listed as softmax "
                         f"(softmax_attentions / --softmax-layers)")
    f = None
    for i in converted:
        for which in ("q", "k"):
            layer, bias = w.maps.get((i, which), (None, None))
            key = pre.format(i=i) + f"feature_map_{which}.mlp.layer"
            if layer is None and which == "k" and settings.tie_qk_kernels:
                w.maps[(i, "k")] = w.maps.get((i, "q"), (None, None))
                continue
            if layer is None:
                hint = (" (tied q/k maps keep only feature_map_q: pass tie_qk_kernels)"
                        if which == "k" and (i, "q") in w.maps else
                        f"; if LoLCATs kept layer {i} as softmax attention, list it in "
                        f"softmax_attentions (--softmax-layers {i})")
                raise ValueError(f"{key} is missing: expected a ({H}, {D}, f) tensor for layer "
                                 f"{i} of {num_layers}{hint}")
            if layer.dim() != 3 or layer.shape[:2] != (H, D):
                raise ValueError(f"{key} has shape {_shape(layer)}, expected ({H}, {D}, f): "
                                 f"{H} query heads and head dimension {D} of the base model "
                                 f"(LoLCATs' maps have one head per query head, keys included)")
            if f is None:
                f = layer.shape[2]
            elif layer.shape[2] != f:
                raise ValueError(f"{key} has shape {_shape(layer)}, expected ({H}, {D}, {f}) "
                                 f"like the other layers' feature maps")
            if settings.bias and bias is None:
                raise ValueError(f"{key[:-5]}bias is missing: expected a (1, {H}, 1, 1) tensor "
                                 f"(learned_kernel_kwargs.bias is true)")
            if bias is not None and bias.numel() != H:
                raise ValueError(f"{key[:-5]}bias has shape {_shape(bias)}, expected (1, {H}, "
                                 f"1, 1): one scalar per head")
        fac = w.factors.get(i)
        key = pre.format(i=i) + "window_factors"
        if fac is None and settings.train_window_factor:
            raise ValueError(f"{key} is missing: expected a (1, {H}, 1, 1) tensor for layer {i} "
                             f"(an untrained factor is a buffer: pass train_window_factor false "
                             f"and its init_window_factor)")
        if fac is not None and fac.numel() != H:
            raise ValueError(f"{key} has shape {_shape(fac)}, expected (1, {H}, 1, 1): one "
                             f"factor per query head")
    r = None
    for (i, mod), (a, b) in sorted(w.lora.items()):
        if mod not in lora_modules:
            raise ValueError(f"LoRA on {mod!r}, which the base model's attention does not have")
        fin, fout = lora_modules[mod]
        key = f"base_model.model.model.layers.{i}.self_attn.{mod}.lora_"
        r = a.shape[0] if r is None else r
        if a.dim() != 2 or a.shape != (r, fin):
            raise ValueError(f"{key}A.default.weight has shape {_shape(a)}, expected ({r}, {fin}) "
                             f"(rank, {mod}.in_features)")
        if b.dim() != 2 or b.shape != (fout, r):
            raise ValueError(f"{key}B.default.weight has shape {_shape(b)}, expected ({fout}, "
                             f"{r}) ({mod}.out_features, rank)")
    if f is None:
        raise ValueError("the checkpoint holds no feature map (no ...feature_map_q.mlp.layer): "
                         "not a LoLCATs attention-transfer checkpoint")
    return f


@torch.no_grad()
def load_into(model: nn.Module, w: LolcatsWeights, settings: LolcatsSettings) -> list[int]:
    """Copy ``w`` into a model converted with ``hybrid_config(settings, ...)`` (in place);
    returns the layers filled. The model's feature maps take LoLCATs' matrices as they are (the
    same (H, D, f) layout and einsum), the scalar bias fills every feature of our per-feature
    bias, ``window_factors`` becomes the mixer's ``logit_factor``."""
    done = []
    for i, attn in hybrid_layers(model):
        for which, phi in (("q", attn.phi_q), ("k", attn.phi_k)):
            layer, bias = w.maps[(i, which)]
            if tuple(phi.weight.shape) != tuple(layer.shape):
                raise ValueError(f"layer {i}: phi_{which}.weight is {tuple(phi.weight.shape)}, the "
                                 f"LoLCATs map {tuple(layer.shape)} (was the model converted with "
                                 f"lolcats.hybrid_config?)")
            phi.weight.copy_(layer.to(phi.weight.dtype))
            if bias is None:
                phi.bias.zero_()
            else:
                phi.bias.copy_(bias.reshape(-1, 1).to(phi.bias.dtype).expand_as(phi.bias))
        fac = w.factors.get(i)
        H = attn.mixer.logit_factor.numel()
        attn.mixer.logit_factor.copy_(
            torch.full((H,), settings.init_window_factor) if fac is None else fac.reshape(H))
        done.append(i)
    return done


# ----------------------------------------------------------------------------- their formula
def lolcats_feature_map(x: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor | float = 0.0,
                        eps: float = 1e-12) -> torch.Tensor:
    """LoLCATs' ``softmax_dim`` fullspace map: x (B, H, T, D), layer (H, D, f), bias a scalar
    per head (1, H, 1, 1) or 0 -> (B, H, T, 2f): ``cat(softmax(u), softmax(-u)).clamp(min=eps)``
    with ``u = x layer + bias``."""
    u = torch.einsum("hdf,bhld->bhlf", layer, x) + bias
    return torch.cat([torch.softmax(u, dim=-1), torch.softmax(-u, dim=-1)], dim=-1).clamp(min=eps)


def lolcats_masks(window_size: int, T: int, attention_type: str, device=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """LoLCATs' (window, linear) masks for T queries over the same T keys, bool (T, T).

    ``lolcats_llama_window_sw``: window ``t - w < i <= t``, linear ``i <= t - w``.
    ``lolcats_llama_window_tk``: ``m = ceil(T / w)`` blocks of ``w`` laid out so that the last
    ends at ``T - 1`` (the kept rows / columns are the last T of ``m w``); window = the query's
    block and the one before it, causal; linear = the other causal keys. With ``m == 1`` their
    construction adds the block to its own roll: window and linear are then both every causal
    key (``ops.windows``)."""
    t = torch.arange(T, device=device)[:, None]
    i = torch.arange(T, device=device)[None, :]
    causal = i <= t
    if attention_type == "lolcats_llama_window_sw":
        linear = i <= t - window_size
        return causal & ~linear, linear
    if attention_type != "lolcats_llama_window_tk":
        raise ValueError(f"unknown LoLCATs attention type {attention_type!r}")
    m = math.ceil(T / window_size)
    off = m * window_size - T  # rows / columns cut from the front of the m w x m w mask
    bt, bi = (t + off) // window_size, (i + off) // window_size
    window = causal & ((bi == bt) | (bi == bt - 1))
    linear = causal if m == 1 else causal & ~window
    return window, linear


def lolcats_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fq: torch.Tensor,
                      fk: torch.Tensor, window_factors: torch.Tensor, *, window_size: int,
                      attention_type: str) -> torch.Tensor:
    """One LoLCATs layer's attention output before ``o_proj``, their formula with T x T masks.

    q (B, H, T, D); k, v (B, Hkv, T, D) (repeated to H here, as their ``process_qkv`` does);
    fq (B, H, T, F); fk (B, H, T, F) (their key map runs on the repeated keys);
    window_factors (1, H, 1, 1) before the sigmoid. Returns (B, H, T, D) fp32. Short tensors
    only: it builds (B, H, T, T) scores."""
    H = q.shape[1]
    rep = H // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    T = q.shape[2]
    win, lin = lolcats_masks(window_size, T, attention_type, q.device)
    s = torch.sigmoid(window_factors.float())
    scores = torch.einsum("bhmd,bhnd->bhmn", q.float(), k) * k.shape[-1] ** -0.5
    scores = scores.masked_fill(~win, -1e8)  # their mask value
    a_sm = s * torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    a_ln = torch.einsum("bhmf,bhnf->bhmn", fq.float(), fk.float()).masked_fill(~lin, 0.0)
    num = torch.einsum("bhmn,bhnd->bhmd", a_sm + a_ln, v)
    return num / (a_sm.sum(-1, keepdim=True) + a_ln.sum(-1, keepdim=True))

