"""Kernel switches (module-level attributes of ``hedgecats.models.ops`` modules, e.g.
``triton_phi.WEIGHTS_IN_KERNEL``) set for a whole run from a text spec: the tests'
``HEDGECATS_TEST_SWITCHES`` (tests/conftest.py) and the benchmarks' ``--switches``
(``benchmarks/attention_speed.py``), so that an option off by default is tested and measured
exactly as it would run as the default."""

from __future__ import annotations

import ast
import contextlib
import importlib
import re
from collections.abc import Iterator


def parse(spec: str, source: str = "switches") -> list[tuple[str, str, object]]:
    """``spec``, "module.NAME=value,..." (modules of ``hedgecats.models.ops``, values Python
    literals), as (module, attribute, value); ``source`` names where the spec came from in
    the errors."""
    out = []
    # (split at the commas that start the next "module.NAME=": a value may hold commas)
    for item in filter(None, (s.strip() for s in re.split(r",(?=\s*[\w.]+\s*=)", spec))):
        target, sep, value = item.partition("=")
        module, dot, name = target.strip().rpartition(".")
        if not (sep and dot and module and name):
            raise ValueError(f"{source}: {item!r} is not module.NAME=value "
                             "(e.g. triton_phi.RECIPROCAL_SOFTMAX=True)")
        mod = importlib.import_module(f"hedgecats.models.ops.{module}")
        if not hasattr(mod, name):
            raise ValueError(f"{source}: hedgecats.models.ops.{module} has no switch {name!r}")
        out.append((module, name, ast.literal_eval(value.strip())))
    return out


@contextlib.contextmanager
def applied(switches: list[tuple[str, str, object]]) -> Iterator[None]:
    """``switches`` (``parse``'s) set inside, the values before restored after."""
    before = []
    try:
        for module, name, value in switches:
            mod = importlib.import_module(f"hedgecats.models.ops.{module}")
            before.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in reversed(before):
            setattr(mod, name, value)
