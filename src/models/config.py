"""``HybridConfig``: the architecture of a converted model, validated before anything is built;
and the one vocabulary of attention modes and runtime switches (``MODES``, ``SWITCHES``,
``validate_switches``, ``parse_variant``) that conversion, the ablations, the callbacks and the
command lines share (docs/method.md#modes-and-switches)."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from .feature_maps import ACTIVATIONS, PROJECTIONS
from .mixers import MASS_MIXERS, MIXERS, SHARED_NORM_SHIFTS
from .ops.hybrid.backends import BACKENDS
from .ops.hybrid.attention import LA_SPANS, MODES
from .ops.hybrid.reference import LA_EPS, default_eps
from .ops.hybrid.windows import WINDOW_SHAPES

__all__ = [
    "KEY_MAP_HEADS",
    "LA_SPANS",
    "MODES",
    "SSD_GRANULARITIES",
    "SWITCHES",
    "VARIANT_MODES",
    "HybridConfig",
    "Switch",
    "check_mode",
    "parse_variant",
    "parse_variant_mapping",
    "validate_switches",
]

#: shapes of the Scheduled Sliding-window Dropout mask, drawn per layer: one draw per sample
#: (default), per batch, or per sample and head
SSD_GRANULARITIES = ("sample", "batch", "head")
#: the heads of ``phi_k``: one map per key/value head, or per query head (LoLCATs, under GQA)
KEY_MAP_HEADS = ("kv", "query")


def _one_of(name: str, value, options) -> None:
    if value not in options:
        raise ValueError(f"HybridConfig.{name}={value!r} is not valid; choose one of: "
                         f"{', '.join(map(str, options))}")


@dataclass
class HybridConfig:
    """Every field defaults to the paper's setting, so ``HybridConfig(window=8)`` is complete.

    Architecture (fixed at conversion):
        window: SWA window ``w`` in tokens (paper: 64).
        layer_windows: per-layer override ``{layer_index: window}`` (second seed: windows may
            differ by layer); layers not listed use ``window``.
        feature_activation: ``softmax | exp | relu | elu1p | none`` (paper: softmax).
        feature_projection: ``square`` (F = 2D, HedgeHog) or ``rectangular`` (F = D, LoLCATs).
        feature_init_std: std of the noise on the identity init (paper: 0.1).
        overlap: LA over all causal keys instead of only keys outside the window (paper: False).
        mixer: ``fixed | learned_head | shared_norm | gate_elementwise | gate_lowrank |
            la_mass`` (``models.mixers``; ``la_mass``: SWA's weight is the share of LA's
            kernel mass inside the window, no parameters).
        g: SWA weight of the fixed mixer, and the initial weight of learned mixers and gates
            (unused by ``la_mass``).
        gate_rank: bottleneck rank of ``gate_lowrank``.
        shared_norm_init: initial per-head factor of ``shared_norm`` (LoLCATs: 0.1).
        layers: indices of the layers to convert (``None`` = all); the others stay softmax.
        seed: feature maps (and gates) are initialised from this seed and the layer index only;
            ``None`` (default): 0 when converting directly, the run's seed in a training stage.
        window_shape: ``sliding`` (default) | ``terraced`` | ``terraced_end``: the terraced
            shapes are LoLCATs' block window (the query's block of ``window`` tokens up to it
            plus the previous block), with blocks from each sequence's first real token, or
            ending at its last one as LoLCATs' code has them (``ops.windows``).
        shared_norm_shift: ``none`` (default: docs/method.md#mixers) | ``window_max`` (LoLCATs'
            code: the window's softmax scores shifted by its max logit, LA's not); only with
            ``mixer="shared_norm"`` (``ops.hybrid``).
        key_map_heads: ``kv`` (default: ``phi_k`` per key/value head) | ``query`` (one map per
            query head applied to the repeated keys, as LoLCATs under GQA).
        feature_floor: every feature is clamped to at least this (LoLCATs: 1e-12; 0 = none).
    Runtime switches (also changed later with ``set_attention_mode``):
        mode: ``hybrid | swa_only | la_only | sinks_only | none | softmax``.
        rescale: the surviving branch of ``swa_only`` / ``la_only`` gets weight 1.
        la_span: ``outside | all``: whether ``la_only`` LA sees every causal key.
        n_sinks: keys kept by ``sinks_only`` (paper: 8).
        backend: ``auto | reference | fla | flash_attn | flex``.
        eps: the LA kernel floor, added to every kernel value ``fq . fk`` in numerator and
            normaliser alike, at inference and in the ``weights_xent`` objective (so both use
            one distribution, and the normaliser and its gradients stay bounded); ``None``
            (default) is ``ops.reference.LA_EPS`` (1e-6).
        ssd_p: probability that a layer's SWA branch is dropped in training (SSD; 0 = off).
        ssd_granularity: ``sample | batch | head``: what one SSD draw covers, per layer.
    """

    window: int = 64
    layer_windows: dict[int, int] | None = None
    feature_activation: str = "softmax"
    feature_projection: str = "square"
    feature_init_std: float = 0.1
    overlap: bool = False
    mixer: str = "fixed"
    g: float = 0.5
    gate_rank: int = 16
    shared_norm_init: float = 0.1
    layers: list[int] | None = None
    seed: int | None = None
    window_shape: str = "sliding"
    shared_norm_shift: str = "none"
    key_map_heads: str = "kv"
    feature_floor: float = 0.0
    mode: str = "hybrid"
    rescale: bool = False
    la_span: str = "outside"
    n_sinks: int = 8
    backend: str = "auto"
    eps: float | None = None
    ssd_p: float = 0.0
    ssd_granularity: str = "sample"
    # fields a runtime switch may change after conversion
    RUNTIME: tuple[str, ...] = field(
        default=("window", "mode", "rescale", "la_span", "n_sinks", "backend", "eps", "overlap",
                 "ssd_p", "ssd_granularity"),
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"HybridConfig.window={self.window!r} must be an integer >= 1")
        if self.layer_windows is not None:
            self.layer_windows = {int(k): int(v) for k, v in self.layer_windows.items()}
            bad = {k: v for k, v in self.layer_windows.items() if v < 1 or k < 0}
            if bad:
                raise ValueError(f"HybridConfig.layer_windows has invalid entries {bad!r}: "
                                 "layer indices >= 0 and windows >= 1")
        _one_of("feature_activation", self.feature_activation, tuple(ACTIVATIONS))
        _one_of("feature_projection", self.feature_projection, tuple(PROJECTIONS))
        _one_of("mixer", self.mixer, MIXERS)
        _one_of("mode", self.mode, MODES)
        _one_of("la_span", self.la_span, LA_SPANS)
        _one_of("backend", self.backend, BACKENDS)
        _one_of("ssd_granularity", self.ssd_granularity, SSD_GRANULARITIES)
        _one_of("window_shape", self.window_shape, WINDOW_SHAPES)
        _one_of("shared_norm_shift", self.shared_norm_shift, SHARED_NORM_SHIFTS)
        _one_of("key_map_heads", self.key_map_heads, KEY_MAP_HEADS)
        if self.shared_norm_shift != "none" and self.mixer != "shared_norm":
            raise ValueError(f"HybridConfig.shared_norm_shift={self.shared_norm_shift!r} belongs "
                             f"to mixer='shared_norm', not mixer={self.mixer!r}")
        if not 0.0 <= self.feature_floor < 1.0:
            raise ValueError(f"HybridConfig.feature_floor={self.feature_floor!r} must lie in "
                             "[0, 1) (LoLCATs clamps features at 1e-12)")
        if not 0.0 <= self.g <= 1.0:
            raise ValueError(f"HybridConfig.g={self.g!r} must lie in [0, 1]")
        if self.mixer not in ("fixed", "la_mass") and not 0.0 < self.g < 1.0:
            raise ValueError(f"mixer={self.mixer!r} starts at sigmoid(logit(g)): g={self.g!r} "
                             "must lie strictly between 0 and 1")
        if not 0.0 < self.shared_norm_init < 1.0:
            raise ValueError(f"HybridConfig.shared_norm_init={self.shared_norm_init!r} must lie "
                             "strictly between 0 and 1")
        if self.mixer in MASS_MIXERS and self.overlap:
            raise ValueError(f"mixer={self.mixer!r} weighs the window against the keys outside "
                             "it; with overlap=True the window keys would be counted twice. "
                             "Use overlap=False, or another mixer")
        if self.mixer == "la_mass" and self.feature_activation == "none":
            raise ValueError("mixer='la_mass' weighs the branches by LA's kernel mass, which "
                             "needs non-negative features; feature_activation='none' gives "
                             "negative products. Use softmax, exp, relu or elu1p")
        if self.mixer == "la_mass" and self.window_shape == "terraced_end":
            raise ValueError("mixer='la_mass' needs the window and the keys outside it to split "
                             "the causal keys; window_shape='terraced_end' puts every key of a "
                             "short sequence in both. Use 'sliding' or 'terraced'")
        if self.n_sinks < 0 or (self.mode == "sinks_only" and self.n_sinks < 1):
            raise ValueError(f"HybridConfig.n_sinks={self.n_sinks!r} must be >= 1 for sinks_only "
                             "(and never negative)")
        if self.gate_rank < 1:
            raise ValueError(f"HybridConfig.gate_rank={self.gate_rank!r} must be >= 1")
        if self.feature_init_std < 0:
            raise ValueError(f"HybridConfig.feature_init_std={self.feature_init_std!r} must be >= 0")
        if not 0.0 <= self.ssd_p <= 1.0:
            raise ValueError(f"HybridConfig.ssd_p={self.ssd_p!r} must lie in [0, 1]")
        if self.eps is None:
            self.eps = default_eps(self.feature_activation)
        if self.eps <= 0:
            raise ValueError(f"HybridConfig.eps={self.eps!r} must be > 0")
        if self.eps < LA_EPS and self.window_shape == "sliding" and self.shared_norm_shift == "none":
            # LoLCATs imports set it on purpose (terraced window / window-max shift); a config
            # saved between the exact objective and the kernel floor recorded fp32's tiny here
            logging.getLogger(__name__).warning(
                "HybridConfig.eps=%g is below the LA kernel floor %g: linear attention runs "
                "without it (a model saved before the floor was introduced records this; "
                "docs/method.md#the-hybrid-layer). Set eps: %g to use the floor.",
                self.eps, LA_EPS, LA_EPS)
        if self.layers is not None:
            if len(set(self.layers)) != len(self.layers) or any(i < 0 for i in self.layers):
                raise ValueError(f"HybridConfig.layers={self.layers!r} must be distinct indices >= 0")
            if self.layer_windows:
                extra = sorted(set(self.layer_windows) - set(self.layers))
                if extra:
                    raise ValueError(f"HybridConfig.layer_windows names layers {extra} that "
                                     f"layers={self.layers!r} does not convert")

    def window_for(self, layer_idx: int) -> int:
        return (self.layer_windows or {}).get(layer_idx, self.window)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}

    @classmethod
    def from_dict(cls, d: dict) -> HybridConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown HybridConfig fields {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**d)



# ----------------------------------------------------------------------------- modes and switches
# ``MODES`` (``hybrid | swa_only | la_only | sinks_only | none | softmax``) and ``LA_SPANS`` are
# the kernel's (``ops.hybrid`` checks them); every other module names them through this one.

_TRUE = {"true": True, "1": True, "yes": True, "on": True,
         "false": False, "0": False, "no": False, "off": False}
#: ``HybridConfig`` field types -> the Python type a switch value must have
_KINDS = {"bool": bool, "int": int, "float": float, "float | None": float, "str": str}


@dataclass(frozen=True)
class Switch:
    """A runtime switch: a field of ``HybridConfig.RUNTIME`` that ``set_attention_mode`` may
    change after conversion. Its type (and, for a string, its choices) is the field's."""

    name: str
    #: bool | int | float | str, from the ``HybridConfig`` field's type
    kind: type
    #: the allowed values of a string switch (the map ``HybridConfig`` checks it against)
    choices: tuple[str, ...] | None
    #: the range of a number (a predicate), and how to say it
    in_range: Callable[[object], bool] | None
    range_text: str
    #: the modes in which it changes the output, where a variant may set it; () = not a variant
    #: switch (a kernel choice, a training switch, or fixed with the conversion)
    modes: tuple[str, ...]
    help: str

    @property
    def expects(self) -> str:
        """What a valid value is, in words (for errors and ``--help``)."""
        if self.choices is not None:
            return f"one of {', '.join(self.choices)}"
        if self.kind is bool:
            return "true/false"
        noun = "an integer" if self.kind is int else "a number"
        return f"{noun} {self.range_text}".rstrip()

    @property
    def syntax(self) -> str:
        """``rescale[=true|false]``, ``la_span=outside|all``, ``window=N``."""
        if self.kind is bool:
            return f"{self.name}[=true|false]"
        if self.choices is not None:
            return f"{self.name}={'|'.join(self.choices)}"
        return f"{self.name}=N" if self.kind is int else f"{self.name}=X"

    def check(self, value):
        """``value`` if valid, else ``ValueError`` saying what is valid."""
        if isinstance(value, bool) and self.kind is not bool:
            ok = False
        elif self.kind is float:
            ok = isinstance(value, (int, float))
        else:
            ok = isinstance(value, self.kind)
        ok = ok and (self.choices is None or value in self.choices) and (
            self.in_range is None or self.in_range(value))
        if not ok:
            raise ValueError(f"invalid value {value!r} for switch {self.name!r}: it takes "
                             f"{self.expects}, e.g. {self.example}")
        return value

    @property
    def example(self) -> str:
        if self.kind is bool:
            return f"{self.name}=true"
        if self.choices is not None:
            return f"{self.name}={self.choices[-1]}"
        return f"{self.name}={_DEFAULT_EXAMPLES.get(self.name, 1)}"

    def parse(self, text: str | None):
        """The value written after ``name=`` in a variant (``None``: the bare name, a bool's
        ``true``); ``ValueError`` saying what is valid."""
        if self.kind is bool:
            if text is None:
                return True
            if text.lower() not in _TRUE:
                raise ValueError(f"switch {self.name!r} takes true/false, got {text!r}")
            return _TRUE[text.lower()]
        value = text
        if text is not None and self.kind in (int, float):
            try:
                value = self.kind(text)
            except ValueError:
                value = text
        if text is None:
            raise ValueError(f"switch {self.name!r} needs a value: {self.expects}, e.g. "
                             f"{self.example}")
        try:
            return self.check(value)
        except ValueError:
            raise ValueError(f"switch {self.name!r} takes {self.expects}, e.g. {self.example}; "
                             f"got {text!r}") from None


_DEFAULT_EXAMPLES = {"window": 64, "n_sinks": 8, "eps": 1e-6, "ssd_p": 0.1}
_CHOICES = {"la_span": LA_SPANS, "backend": BACKENDS, "ssd_granularity": SSD_GRANULARITIES}
_LA_MODES = ("hybrid", "swa_only", "la_only")
#: name -> (range predicate, the range in words, modes where it changes the output, help)
_SWITCH_RULES: dict[str, tuple] = {
    "window": (lambda v: v >= 1, ">= 1", _LA_MODES,
               "override every layer's SWA window (and LA's shift)"),
    "rescale": (None, "", ("swa_only", "la_only"),
                "the surviving branch gets weight 1 instead of g / 1-g"),
    "la_span": (None, "", ("la_only",),
                "LA over keys outside the window (default) or every causal key"),
    "n_sinks": (lambda v: v >= 1, ">= 1", ("sinks_only",), "number of sink keys (default 8)"),
    "backend": (None, "", (), "the kernels (a choice of speed, not of output)"),
    "eps": (lambda v: v > 0, "> 0", (), "the LA kernel floor (set with the conversion)"),
    "overlap": (None, "", ("hybrid", "la_only"), "LA also over the window's keys"),
    "ssd_p": (lambda v: 0.0 <= v <= 1.0, "in [0, 1]", (), "SSD drop probability (training)"),
    "ssd_granularity": (None, "", (), "what one SSD draw covers (training)"),
}


def _build_switches() -> dict[str, Switch]:
    types = {f.name: f.type for f in fields(HybridConfig)}
    names = [n for n in HybridConfig.RUNTIME if n != "mode"]
    if set(names) != set(_SWITCH_RULES):  # a new runtime field needs its rule here
        raise RuntimeError(f"HybridConfig.RUNTIME {names} and the switch rules "
                           f"{sorted(_SWITCH_RULES)} differ")
    out = {}
    for name in names:
        in_range, range_text, modes, help_ = _SWITCH_RULES[name]
        out[name] = Switch(name, _KINDS[types[name]], _CHOICES.get(name), in_range, range_text,
                           modes, help_)
    return out


#: every runtime switch but ``mode``, in ``HybridConfig.RUNTIME``'s order
SWITCHES: dict[str, Switch] = _build_switches()


def _suggest(word: str, options) -> str:
    near = difflib.get_close_matches(str(word), [str(o) for o in options], n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``MODES``, else ``ValueError`` naming the valid ones."""
    if mode not in MODES:
        raise ValueError(f"unknown attention mode {mode!r}{_suggest(mode, MODES)}; valid modes: "
                         f"{', '.join(MODES)}")
    return mode


def validate_switches(switches: dict, modes: tuple[str, ...] | list[str] | None = None,
                      extra: tuple[str, ...] = ()) -> dict:
    """Check a mapping ``{switch: value}``: every name a switch, every value of its type and
    range, and (given ``modes``) every switch one that changes the output in each of them.
    Names in ``extra`` pass unchecked (``set_attention_mode``'s ``observer``). Returns it;
    ``ValueError`` says what is wrong and what would be right."""
    for name, value in switches.items():
        if name in extra:
            continue
        sw = SWITCHES.get(name)
        if sw is None:
            valid = [*SWITCHES, *extra]
            raise ValueError(f"unknown switch {name!r}{_suggest(name, valid)}; valid switches: "
                             f"{', '.join(valid)}")
        sw.check(value)
        for mode in modes or ():
            _check_effect(sw, mode)
    return switches


def _check_effect(sw: Switch, mode: str, label: str | None = None) -> None:
    if mode in sw.modes:
        return
    where = f" ({label!r})" if label else ""
    if sw.modes:
        raise ValueError(f"switch {sw.name!r} has no effect in mode {mode!r}{where}; it applies "
                         f"to: {', '.join(sw.modes)}")
    variant = [n for n, s in SWITCHES.items() if s.modes]
    raise ValueError(f"switch {sw.name!r} cannot be set in a variant{where}: {sw.help}; a "
                     f"variant sets: {', '.join(variant)}")


def parse_variant(text: str) -> tuple[str, dict]:
    """``mode[+switch[=value]]...`` (``la_only+rescale+la_span=all``) -> ``(mode, switches)``.

    A bare boolean switch is ``true``; a switch that has no effect in the mode, one given twice,
    an unknown name or a bad value raise ``ValueError`` naming what is valid."""
    label = text.strip()
    mode, *parts = [p.strip() for p in label.split("+")]
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} in {label!r}{_suggest(mode, MODES)}; valid "
                         f"modes: {', '.join(MODES)}")
    switches: dict = {}
    for part in parts:
        name, sep, value = part.partition("=")
        name = name.strip()
        sw = SWITCHES.get(name)
        if sw is None:
            variant = [n for n, s in SWITCHES.items() if s.modes]
            raise ValueError(f"unknown switch {name!r} in mode {label!r}"
                             f"{_suggest(name, variant)}; valid switches: {', '.join(variant)}")
        _check_effect(sw, mode, label)
        if name in switches:
            raise ValueError(f"switch {name!r} given twice in {label!r}")
        switches[name] = sw.parse(value.strip() if sep else None)
    return mode, switches


#: the modes a YAML variant runs in when it names none
VARIANT_MODES = ("swa_only", "la_only")


def parse_variant_mapping(variant: dict) -> tuple[tuple[str, ...], dict]:
    """A YAML variant ``{switch: value, ..., modes: [mode, ...]}`` -> ``(modes, switches)``;
    ``modes`` defaults to ``VARIANT_MODES``. The same checks as ``parse_variant``: known modes,
    valid values, and each switch one that changes the output in every mode listed."""
    if not isinstance(variant, dict):  # ValueError, as every other config error here
        raise ValueError(  # noqa: TRY004
            f"a variant is a mapping of switches (and 'modes'), got {variant!r}")
    switches = dict(variant)
    modes = switches.pop("modes", VARIANT_MODES)
    if isinstance(modes, str) or not isinstance(modes, (list, tuple)) or not modes:
        raise ValueError(f"a variant's modes must be a non-empty list of modes, got {modes!r}")
    for mode in modes:
        check_mode(mode)
    return tuple(modes), validate_switches(switches, modes)


def variant_syntax() -> str:
    """The variant syntax and its switches, one per line (for ``--help``)."""
    lines = [f"mode syntax: MODE[+SWITCH[=VALUE]]...   MODE: {' '.join(MODES)}"]
    lines += [f"  {s.syntax:<22} {', '.join(s.modes)}: {s.help}"
              for s in SWITCHES.values() if s.modes]
    return "\n".join(lines)
