"""Kernel switches (module-level attributes of ``hedgecats.models.ops`` modules, e.g.
``hybrid.config.FORWARD_TILES_D128``) set for a whole run from a text spec: the tests'
``HEDGECATS_TEST_SWITCHES`` (tests/conftest.py) and the benchmarks' ``--switches``
(``benchmarks/attention_speed.py``), so that a candidate (other tiles, another threshold) is
tested and measured exactly as it would run as the default."""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
import sys
from collections.abc import Iterator


def assignments(spec: str, source: str, form: str = "target=value"
                ) -> list[tuple[str, str, object]]:
    """``spec``, "target=value,..." (values Python literals), as (item, target, value);
    ``source`` names where the spec came from in the errors, ``form`` what an item should look
    like. Shared by ``parse`` and the benchmarks' ``--tiles`` (``KernelConfig`` fields)."""
    out = []
    # (split at the commas that start the next "target=": a value may hold commas)
    for item in filter(None, (s.strip() for s in re.split(r",(?=\s*[\w.]+\s*=)", spec))):
        target, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{source}: {item!r} is not {form}")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{source}: {item!r}: the value {value.strip()!r} is not a Python "
                             "literal (a string needs quotes: NAME='walk', which a shell's own "
                             "quotes around the whole spec keep)") from None
        out.append((item, target.strip(), parsed))
    return out


def parse(spec: str, source: str = "switches") -> list[tuple[str, str, object]]:
    """``spec``, "module.NAME=value,..." (modules of ``hedgecats.models.ops``, values Python
    literals), as (module, attribute, value); ``source`` names where the spec came from in
    the errors."""
    form = "module.NAME=value (e.g. feature_map.kernels.RECIPROCAL_SOFTMAX=True)"
    out = []
    for item, target, value in assignments(spec, source, form):
        module, dot, name = target.rpartition(".")
        if not (dot and module and name):
            raise ValueError(f"{source}: {item!r} is not {form}")
        try:
            mod = importlib.import_module(f"hedgecats.models.ops.{module}")
        except ImportError as e:
            raise ValueError(f"{source}: {item!r}: no module hedgecats.models.ops.{module} "
                             f"({e})") from None
        if not hasattr(mod, name):
            raise ValueError(f"{source}: hedgecats.models.ops.{module} has no switch {name!r}")
        out.append((module, name, value))
    return out


def _forget_derived() -> None:
    """Drop what was built from switches' values and cached: ``hybrid.config.default_config``
    reads ``FORWARD_TILES_D128`` when it first builds a shape's config and keeps it, so a config
    built before a switch would outlive it (and one built under it, the switch). Called as
    ``applied`` sets and restores; applied outside ``attention_speed.default_tiles_changed``
    (which wraps ``default_config`` while it runs), as the benchmarks nest them."""
    th = sys.modules.get("hedgecats.models.ops.hybrid.config")
    if th is not None:
        th.default_config.cache_clear()


@contextlib.contextmanager
def applied(switches: list[tuple[str, str, object]]) -> Iterator[None]:
    """``switches`` (``parse``'s) set inside, the values before restored after; the configs
    cached from the values before forgotten each time (``_forget_derived``)."""
    before = []
    try:
        for module, name, value in switches:
            mod = importlib.import_module(f"hedgecats.models.ops.{module}")
            before.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        if before:
            _forget_derived()
        yield
    finally:
        for mod, name, value in reversed(before):
            setattr(mod, name, value)
        if before:
            _forget_derived()
