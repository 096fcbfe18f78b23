"""Small Llama-like models pretrained from scratch (docs/method.md#pretraining-study).

    PretrainConfig                the architecture: one validated dataclass
    build_pretrain_model(cfg)     today's ``LlamaForCausalLM`` when the config is plain (every
                                  layer full attention, no gate, full RoPE), else a
                                  ``PretrainLlamaForCausalLM``
    PretrainLlamaForCausalLM     ``LlamaForCausalLM`` whose ``self_attn`` are ``PretrainAttention``
    PretrainAttention             Llama's q, k, v, o; partial RoPE; causal or sliding-window
                                  softmax; an optional output gate before ``o_proj``
    OutputGate                    ``sigmoid(up(x))`` or ``sigmoid(up(down(x)))`` per channel
    parameter_counts(model)       parameters by part (embeddings, attention, gates, mlp, ...)
    load_pretrained(path)         the documented loader (``from_pretrained`` of either class)

**Attention pattern.** A string of ``F`` (full causal attention) and ``S`` (sliding window of
``sliding_window`` keys), one character per layer, repeated when it is shorter than the model
and divides its depth (``"SSSF"`` on 8 layers is ``SSSFSSSF``, as nanochat tiles its window
pattern); or a list with one entry per layer: a window (int >= 1) or ``"full"`` / ``None``.
Window convention, the same as the hybrid's SWA (``ops.reference``): the query at position
``t`` sees the keys ``t - window < i <= t`` (``window`` keys, itself included). Positions are
indices in the sequence (with a KV cache: in the cache), as in Mistral.

**Output gate** (second seed; "gated attention"): ``o_proj(sigmoid(gate(x)) * Attn(Q, K, V))``,
``x`` the attention layer's input (after ``input_layernorm``), one gate value per query channel
(H * D of them):

    elementwise   gate(x) = x W + b                 W: (hidden, H*D)   hidden*H*D + H*D params
    lowrank       gate(x) = (x A) B + b             A: (hidden, r), B: (r, H*D)

Initialisation: ``W`` (``B``) zero and ``b = logit(gate_init)``, so every gate starts at the
constant ``gate_init`` whatever the input and learns to depend on it; ``A`` ~ N(0, 1/hidden).
The default ``gate_init = 0.5`` is where the sigmoid is steepest (the gate learns fastest); the
layer then starts as the ungated layer with its attention output halved, a constant factor that
``o_proj`` absorbs in a model trained from scratch. ``gate_init`` close to 1 starts the layer at
the ungated layer itself, with a flatter sigmoid.

**Partial RoPE** (``rope_fraction``): rotary embedding on the first ``R = rope_fraction * D``
dims of each query and key head, with the frequencies spread over those R dims (GPT-NeoX's
``rotary_pct``, transformers' ``partial_rotary_factor``): ``inv_freq_j = theta^(-2j/R)``, dims
``j`` and ``j + R/2`` rotated together (Llama's ``rotate_half`` layout); the other ``D - R`` dims
carry no position. ``rope_fraction = 0`` is NoPE.

**Exactness.** A plain config builds ``LlamaForCausalLM`` from the same ``LlamaConfig`` as before
(same random draws for a seed), so saved teachers load as ``model_type: llama`` everywhere. The
other configs build ``PretrainLlamaForCausalLM``: it constructs the Llama first (same draws,
so its shared weights equal the plain model's for the seed), then swaps each ``self_attn``
keeping q, k, v, o. It saves with ``model_type: hedgecats_pretrain`` (not ``hedgecats_llama``:
that is a converted hybrid, ``models.hf``); importing ``hedgecats.models`` registers it with
``AutoConfig`` / ``AutoModelForCausalLM``, so ``from_pretrained`` reloads it with identical
logits. SWA layers keep every key in a KV cache (the cache is not trimmed to the window), so
cached decoding equals a full forward.

Plain PyTorch + transformers; never imports lightning (docs/architecture.md: the floors).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    eager_attention_forward,
    rotate_half,
)

__all__ = [
    "GATES",
    "MODEL_TYPE",
    "OutputGate",
    "PartialRotaryEmbedding",
    "PretrainAttention",
    "PretrainConfig",
    "PretrainLlamaConfig",
    "PretrainLlamaForCausalLM",
    "apply_partial_rotary",
    "build_pretrain_model",
    "load_pretrained",
    "parameter_counts",
    "resolve_attention_pattern",
    "sliding_window_mask",
]

GATES = ("none", "elementwise", "lowrank")
PATTERN_CHARS = {"F": "full causal attention",
                 "S": "sliding window of `sliding_window` keys"}
MODEL_TYPE = "hedgecats_pretrain"
#: the attention implementations whose masks SWA layers can restrict to their window
SWA_IMPLEMENTATIONS = ("sdpa", "eager")
#: the config attribute holding this module's options in a saved ``config.json``
CONFIG_KEY = "hedgecats_pretrain"


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


# ----------------------------------------------------------------------------- configuration
def resolve_attention_pattern(pattern: str | Sequence[int | str | None] | None, num_layers: int,
                              sliding_window: int | None) -> tuple[int | None, ...]:
    """Per-layer windows (``None`` = full attention) from a pattern string or list (module
    docstring). Raises ``ValueError`` quoting the bad value and listing what is valid."""
    w = sliding_window
    if pattern is None:
        if w is not None:
            raise ValueError(f"sliding_window={w!r} is given but attention_pattern is None (every "
                             "layer full); give a pattern with 'S' layers, e.g. "
                             "attention_pattern='SSSF'")
        return (None,) * num_layers
    if isinstance(pattern, str):
        bad = sorted({c for c in pattern if c not in PATTERN_CHARS})
        if not pattern or bad:
            valid = "; ".join(f"{c!r}: {m}" for c, m in PATTERN_CHARS.items())
            raise ValueError(f"attention_pattern={pattern!r} is not valid: it must be a non-empty "
                             f"string of {valid} (bad characters: {bad})")
        if num_layers % len(pattern):
            fits = [n for n in range(1, num_layers + 1) if num_layers % n == 0]
            raise ValueError(f"attention_pattern={pattern!r} ({len(pattern)} characters) does "
                             f"not tile {num_layers} layers: give {fits} characters, or a list "
                             "with one entry per layer")
        has_swa = "S" in pattern
        if has_swa and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ValueError(f"attention_pattern={pattern!r} has 'S' layers: sliding_window must "
                             f"be an int >= 1, got sliding_window={w!r}")
        if not has_swa and w is not None:
            raise ValueError(f"sliding_window={w!r} is given but attention_pattern={pattern!r} "
                             "has no 'S' layer")
        tiled = pattern * (num_layers // len(pattern))
        return tuple(w if c == "S" else None for c in tiled)
    entries = list(pattern)
    if w is not None:
        raise ValueError(f"sliding_window={w!r} is given with a list attention_pattern: a list "
                         "names each layer's window itself")
    if len(entries) != num_layers:
        raise ValueError(f"attention_pattern={entries!r} has {len(entries)} entries for "
                         f"{num_layers} layers: give one per layer")
    out: list[int | None] = []
    for i, e in enumerate(entries):
        if e is None or e == "full":
            out.append(None)
        elif isinstance(e, int) and not isinstance(e, bool) and e >= 1:
            out.append(e)
        else:
            raise ValueError(f"attention_pattern entry {i} = {e!r} is not valid: use a window "
                             "(int >= 1) or 'full' (or None)")
    return tuple(out)


@dataclass
class PretrainConfig:
    """The architecture of a model pretrained from scratch. Checked in ``__post_init__``.

    Llama shape: ``vocab_size``, ``hidden_size``, ``num_layers``, ``num_heads``,
    ``num_kv_heads`` (``None``: ``num_heads``; GQA when fewer), ``intermediate_size`` (``None``:
    4 * hidden), ``max_position_embeddings``, ``rope_theta``, ``pad_token_id``, ``eos_token_id``.
    The second seed's options (module docstring): ``attention_pattern`` with ``sliding_window``,
    ``output_gate`` with ``gate_rank`` (lowrank only) and ``gate_init``, ``rope_fraction``.
    ``tie_word_embeddings``: the output projection is the input embedding (Llama's own option;
    the model stays a plain ``LlamaForCausalLM``). A copy task such as the recall corpus is
    learned much sooner with it: copying a token is then an identity map from the attended
    token's embedding to its logit (the embedded demo uses it; README).
    """

    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    pad_token_id: int | None = None
    eos_token_id: int | None = None
    attention_pattern: str | list[int | str | None] | None = None
    sliding_window: int | None = None  # the window of the pattern string's 'S' layers
    output_gate: str = "none"  # none | elementwise | lowrank
    gate_rank: int = 16  # r of the lowrank gate
    gate_init: float = 0.5  # every gate's value at initialisation, in (0, 1)
    rope_fraction: float = 1.0  # share of each head's dims that RoPE rotates; 0 = NoPE
    tie_word_embeddings: bool = False
    layer_windows: tuple[int | None, ...] = field(init=False)  # resolved pattern, one per layer

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an int >= 1")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size!r} is not a multiple of "
                             f"num_heads={self.num_heads!r}")
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"num_kv_heads={self.num_kv_heads!r} must divide "
                             f"num_heads={self.num_heads!r}")
        if self.output_gate not in GATES:
            raise ValueError(f"output_gate={self.output_gate!r} is not valid; choose one of "
                             f"{', '.join(GATES)}")
        if not isinstance(self.gate_rank, int) or self.gate_rank < 1:
            raise ValueError(f"gate_rank={self.gate_rank!r} must be an int >= 1")
        if not 0.0 < self.gate_init < 1.0:
            raise ValueError(f"gate_init={self.gate_init!r} must lie in (0, 1): it is the "
                             "sigmoid's value at initialisation")
        if not 0.0 <= self.rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction={self.rope_fraction!r} must lie in [0, 1]")
        r = self.rope_fraction * self.head_dim
        if abs(r - round(r)) > 1e-6 or round(r) % 2:
            examples = ", ".join(f"{f:g} ({f * self.head_dim:g} dims)" for f in (0.25, 0.5, 1.0)
                                 if (f * self.head_dim) % 2 == 0)
            raise ValueError(f"rope_fraction={self.rope_fraction!r} gives {r:g} rotary dims of "
                             f"head_dim {self.head_dim}: it must give an even whole number "
                             f"(a multiple of 2/{self.head_dim}), e.g. {examples}")
        self.layer_windows = resolve_attention_pattern(self.attention_pattern, self.num_layers,
                                                       self.sliding_window)

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return round(self.rope_fraction * self.head_dim)

    @property
    def is_plain(self) -> bool:
        """Every layer full attention, no gate, full RoPE: exactly ``LlamaForCausalLM``."""
        return (all(w is None for w in self.layer_windows) and self.output_gate == "none"
                and self.rotary_dim == self.head_dim)

    def pattern_string(self) -> str:
        """One character per layer: ``F``, or ``S`` (the window is in ``layer_windows``)."""
        return "".join("F" if w is None else "S" for w in self.layer_windows)

    def llama_config(self) -> LlamaConfig:
        """The ``LlamaConfig`` of a plain model (the same arguments ``TeacherPretraining`` always
        passed), or the ``PretrainLlamaConfig`` carrying this config's options."""
        kw = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
              "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
              "num_key_value_heads": self.num_kv_heads or self.num_heads,
              "intermediate_size": self.intermediate_size or 4 * self.hidden_size,
              "max_position_embeddings": self.max_position_embeddings,
              "rope_theta": self.rope_theta, "pad_token_id": self.pad_token_id,
              "eos_token_id": self.eos_token_id, "bos_token_id": None,
              "tie_word_embeddings": bool(self.tie_word_embeddings)}
        if self.is_plain:
            return LlamaConfig(**kw)
        return PretrainLlamaConfig(**kw, **{CONFIG_KEY: self.options()})

    def options(self) -> dict:
        """What a saved ``config.json`` records beyond Llama's fields (the resolved pattern)."""
        return {"attention_pattern": ["full" if w is None else w for w in self.layer_windows],
                "output_gate": self.output_gate, "gate_rank": self.gate_rank,
                "gate_init": self.gate_init, "rope_fraction": self.rope_fraction}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layer_windows"] = list(self.layer_windows)
        return d

    @classmethod
    def from_llama_config(cls, config: LlamaConfig) -> PretrainConfig:
        """Back from a (saved) transformers config: plain Llama, or ours with its options."""
        opts = dict(getattr(config, CONFIG_KEY, None) or {})
        return cls(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=config.num_key_value_heads,
                   intermediate_size=config.intermediate_size,
                   max_position_embeddings=config.max_position_embeddings,
                   rope_theta=_rope_theta(config), pad_token_id=config.pad_token_id,
                   eos_token_id=config.eos_token_id, **opts)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))


# ----------------------------------------------------------------------------- pieces
def sliding_window_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int, window: int,
                        *, device: torch.device, additive_dtype: torch.dtype | None = None
                        ) -> torch.Tensor:
    """``attention_mask`` restricted to the causal window ``t - window < i <= t``.

    The queries are the last ``q_len`` of ``k_len`` positions (equal without a cache). The result
    has the kind of the incoming mask: boolean (True = attend; transformers' SDPA masks) or
    additive float (0 / dtype minimum; eager masks), broadcastable to ``(B, 1, q_len, k_len)``.
    ``attention_mask=None`` (no padding: SDPA's causal shortcut) gives the window alone, boolean,
    or additive in ``additive_dtype`` when that is given (eager attention).
    """
    t_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]  # (Tq, 1)
    i_pos = torch.arange(k_len, device=device)[None, :]  # (1, Tk)
    band = (i_pos <= t_pos) & (i_pos > t_pos - window)  # (Tq, Tk)
    if attention_mask is None:
        if additive_dtype is None:
            return band[None, None]
        return torch.zeros(band.shape, dtype=additive_dtype, device=device).masked_fill(
            ~band, torch.finfo(additive_dtype).min)[None, None]
    if attention_mask.dtype == torch.bool:
        return attention_mask & band
    return attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first ``R = cos.shape[-1]`` dims of ``x`` (B, H, T, D), the rest unchanged.

    ``cos``, ``sin``: (B, T, R) as the rotary embedding returns them (``[f, f]`` halves).
    ``R == D`` computes exactly Llama's ``apply_rotary_pos_emb``; ``R == 0`` returns ``x``.
    """
    R = cos.shape[-1]
    if R == 0:
        return x
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, R)
    if R == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot, rest = x[..., :R], x[..., R:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


class PartialRotaryEmbedding(nn.Module):
    """RoPE's (cos, sin) for the first ``rotary_dim`` dims of a head, computed from the position
    ids at every call (no buffer: nothing for ``from_pretrained`` to initialise or overwrite).

    ``forward(x, position_ids)``: ``position_ids`` (B, T) -> cos, sin (B, T, rotary_dim) in
    ``x``'s dtype; ``inv_freq_j = theta^(-2j / rotary_dim)``.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        R = self.rotary_dim
        exponent = torch.arange(0, R, 2, dtype=torch.int64, device=x.device).float() / max(R, 1)
        inv_freq = 1.0 / (self.theta ** exponent)  # (R/2,)
        freqs = position_ids[..., None].float() * inv_freq  # (B, T, R/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, R)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, theta={self.theta}"


class OutputGate(nn.Module):
    """``sigmoid(gate(x))`` per query channel: ``x`` (B, T, hidden) -> (B, T, H*D) in (0, 1).

    ``rank=None``: elementwise, ``up = Linear(hidden, H*D)``; ``rank=r``: low-rank,
    ``down = Linear(hidden, r, bias=False)`` then ``up = Linear(r, H*D)``. Initialisation in
    ``reset_parameters`` (module docstring).
    """

    def __init__(self, hidden_size: int, channels: int, rank: int | None = None,
                 init: float = 0.5) -> None:
        super().__init__()
        self.init = init
        self.down = None if rank is None else nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(hidden_size if rank is None else rank, channels)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``up`` zero with bias ``logit(init)``; ``down`` ~ N(0, 1/hidden), drawn on the CPU
        from the global CPU generator (the same numbers whatever the default device)."""
        if self.down is not None and not self.down.weight.is_meta:
            w = self.down.weight
            draw = torch.randn(w.shape, generator=torch.default_generator, device="cpu")
            w.copy_(draw * w.shape[1] ** -0.5)
        self.up.weight.zero_()
        self.up.bias.fill_(_logit(self.init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x if self.down is None else self.down(x)
        return torch.sigmoid(self.up(h))


class PretrainAttention(nn.Module):
    """Llama's attention with a per-layer window, an optional output gate and partial RoPE.

    Built from a ``LlamaAttention`` whose projections it keeps (same weights, same names).
    ``forward`` takes what ``LlamaDecoderLayer`` passes: ``hidden_states`` (B, T, hidden),
    ``position_embeddings`` (cos, sin) of shape (B, T, R), the model's attention mask, and the
    cache as ``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier). Returns
    ``(out (B, T, hidden), attention weights or None)``.
    """

    def __init__(self, base: nn.Module, *, window: int | None, gate: OutputGate | None) -> None:
        super().__init__()
        for name in ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling",
                     "attention_dropout", "is_causal"):
            setattr(self, name, getattr(base, name))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            base.q_proj, base.k_proj, base.v_proj, base.o_proj)
        self.window = window
        self.gate = gate

    def forward(self, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = None
        for key in ("cache", "past_key_values", "past_key_value"):  # the name changed in 5.x
            found = kwargs.pop(key, None)
            cache = found if found is not None else cache  # an empty cache has len() 0
        B, T, _ = hidden_states.shape
        shape = (B, T, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)  # (B, Hkv, T, D)
        cos, sin = position_embeddings
        q, k = apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, Hkv, Tk, D): every key is kept

        impl = self.config._attn_implementation
        if self.window is not None and impl not in SWA_IMPLEMENTATIONS:
            raise NotImplementedError(
                f"layer {self.layer_idx} is a sliding-window layer and attention implementation "
                f"{impl!r} takes no window here; use one of {', '.join(SWA_IMPLEMENTATIONS)} "
                "(model.set_attn_implementation('sdpa'))")
        # eager attention is causal only through its mask: without one, a full layer gets the
        # causal mask (a window as long as the keys)
        if self.window is not None or (impl == "eager" and attention_mask is None):
            attention_mask = sliding_window_mask(
                attention_mask, q.shape[2], k.shape[2], self.window or k.shape[2], device=q.device,
                additive_dtype=q.dtype if impl == "eager" else None)
        if impl == "eager":
            interface = eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            interface = ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = interface(self, q, k, v, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **kwargs)  # out: (B, T, H, D)
        out = out.reshape(B, T, -1)  # (B, T, H*D)
        if self.gate is not None:
            out = out * self.gate(hidden_states).to(out.dtype)
        return self.o_proj(out), weights

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, window={self.window}"


# ----------------------------------------------------------------------------- the model
class PretrainLlamaConfig(LlamaConfig):
    """``LlamaConfig`` plus ``hedgecats_pretrain`` (``PretrainConfig.options()``)."""

    model_type = MODEL_TYPE


class PretrainLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` with ``PretrainAttention`` layers (module docstring).

    The Llama is built first, so the shared weights (embeddings, q, k, v, o, MLP, norms, head)
    come out of the same random draws as the plain model's for the same seed; the gates are
    created and initialised afterwards.
    """

    config_class = PretrainLlamaConfig
    # transformers decides whether ``set_attn_implementation`` may switch a model by reading its
    # module's source for an attention-interface call; ours dispatches through the registry
    # (``PretrainAttention.forward``), so it may (convert_to_hybrid and the eager tests rely on it)
    _can_set_attn_implementation_cached_value = True

    def __init__(self, config: PretrainLlamaConfig) -> None:
        super().__init__(config)
        arch = PretrainConfig.from_llama_config(config)
        channels = config.num_attention_heads * arch.head_dim
        for layer, window in zip(self.model.layers, arch.layer_windows):
            gate = None
            if arch.output_gate != "none":
                gate = OutputGate(config.hidden_size, channels, init=arch.gate_init,
                                  rank=arch.gate_rank if arch.output_gate == "lowrank" else None)
            layer.self_attn = PretrainAttention(layer.self_attn, window=window, gate=gate)
        if arch.rotary_dim != arch.head_dim:
            self.model.rotary_emb = PartialRotaryEmbedding(arch.rotary_dim, arch.rope_theta)
        self.arch = arch

    # transformers re-initialises modules it has not loaded; ours need their own rule
    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, OutputGate):
            module.reset_parameters()
        elif isinstance(module, PartialRotaryEmbedding):
            pass
        else:
            super()._init_weights(module)


_can_record = getattr(PretrainLlamaForCausalLM, "_can_record_outputs", None)
if isinstance(_can_record, dict):  # output_attentions / hidden states hooks find our layers
    PretrainLlamaForCausalLM._can_record_outputs = {
        **_can_record, "hidden_states": LlamaDecoderLayer, "attentions": PretrainAttention}

AutoConfig.register(MODEL_TYPE, PretrainLlamaConfig, exist_ok=True)
AutoModelForCausalLM.register(PretrainLlamaConfig, PretrainLlamaForCausalLM, exist_ok=True)


def build_pretrain_model(config: PretrainConfig, *, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model for ``config`` (weights from ``torch.manual_seed(seed)``,
    the global RNG restored afterwards), attention through SDPA.

    Plain configs give ``LlamaForCausalLM`` (exactly what ``TeacherPretraining`` always built);
    the others ``PretrainLlamaForCausalLM``.
    """
    cfg = config.llama_config()
    cls = LlamaForCausalLM if config.is_plain else PretrainLlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(cfg)
    model.config._attn_implementation = "sdpa"
    return model


def load_pretrained(path: str | Path, **kwargs) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(path)`` with ``PretrainLlamaForCausalLM`` registered
    (importing this module registers it): plain teachers load as ``LlamaForCausalLM``."""
    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


# ----------------------------------------------------------------------------- reporting
PARTS = ("embeddings", "attention", "gates", "mlp", "norms", "lm_head")


def _part(name: str) -> str:
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn.gate." in name:
        return "gates"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "mlp"
    if "norm" in name:
        return "norms"
    raise ValueError(f"parameter {name!r} belongs to no part of {PARTS}")


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters by part (``PARTS``), ``total`` and ``non_embedding`` (total minus embeddings
    and LM head), of a Llama-like transformers model."""
    counts = dict.fromkeys(PARTS, 0)
    for name, p in model.named_parameters():
        counts[_part(name)] += p.numel()
    counts["total"] = sum(counts[p] for p in PARTS)
    counts["non_embedding"] = counts["total"] - counts["embeddings"] - counts["lm_head"]
    return counts


def architecture_record(config: PretrainConfig, model: nn.Module) -> dict:
    """What ``architecture.json`` holds: the config, each layer's window, parameter counts."""
    return {"config": config.to_dict(), "model_class": type(model).__name__,
            "pattern": config.pattern_string(), "rotary_dim": config.rotary_dim,
            "head_dim": config.head_dim, "parameters": parameter_counts(model)}


def write_architecture(path: str | Path, config: PretrainConfig, model: nn.Module) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(architecture_record(config, model), indent=2) + "\n")
    return path
