"""The package's layers import only downwards (STYLE.md, "Where things live").

Low to high: ``models`` (with ``models/ops``) < ``data`` < ``evaluation`` < ``lightning_modules``
< ``pipeline`` < the commands (``cli``, ``export``, ``generate``, ``import_lolcats``). Every
module's imports are read with ``ast`` -- function-local ones included, since a lazy import is
still a dependency -- and one of a higher layer fails the test, with file and line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"  # the package ``hedgecats``
LAYERS = ("models", "data", "evaluation", "lightning_modules", "pipeline")
TOP = len(LAYERS)  # the commands and the package root

#: allowed upward imports: (importing module, imported module, names) -> why
ALLOWED = {
    ("models.hf", "", ("__version__",)):
        "the package root holds only the version (and registers models.hf with transformers)",
    ("pipeline.rundir", "", ("__version__",)):
        "the version recorded in a run directory's marker file",
}


def _layer(module: str) -> int:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else TOP


def _modules() -> list[tuple[Path, str, list[str]]]:
    out = []
    for f in sorted(SRC.rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append((f, ".".join(parts), parts if is_package else parts[:-1]))
    return out


def _imports(path: Path, package: list[str]):
    """``(line, imported module relative to hedgecats, names)`` of every hedgecats import."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            names = tuple(a.name for a in node.names)
            if node.level:
                base = package[:len(package) - node.level + 1]
                if node.module:
                    yield node.lineno, ".".join([*base, node.module]), names
                else:  # ``from . import x``: x may be a submodule
                    for name in names:
                        target = ".".join([*base, name])
                        sub = SRC.joinpath(*base, name)
                        if sub.is_dir() or sub.with_suffix(".py").is_file():
                            yield node.lineno, target, (name,)
                        else:
                            yield node.lineno, ".".join(base), (name,)
            elif node.module and node.module.split(".")[0] == "hedgecats":
                yield node.lineno, node.module.removeprefix("hedgecats").lstrip("."), names
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "hedgecats":
                    yield node.lineno, a.name.removeprefix("hedgecats").lstrip("."), ()


def upward_imports() -> list[str]:
    bad = []
    for path, me, package in _modules():
        for line, target, names in _imports(path, package):
            if _layer(target) > _layer(me) and (me, target, names) not in ALLOWED:
                bad.append(f"{path.relative_to(SRC.parent)}:{line}: {me or 'hedgecats'} "
                           f"(layer {_layer(me)}) imports {target or 'hedgecats'} "
                           f"(layer {_layer(target)}) {names}")
    return bad


def test_no_module_imports_a_higher_layer():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_relative_absolute_and_local_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "src"
    (pkg / "models").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "models" / "a.py").write_text(
        "from ..data import b\n"
        "def f():\n    import hedgecats.pipeline.runner\n"
        "    from hedgecats.models import c\n")
    (pkg / "data" / "b.py").write_text("from ..models import a\nfrom . import b\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    found = upward_imports()
    assert [x.split(": ", 1)[1].split(" (layer")[0] for x in found] == ["models.a", "models.a"]
    assert "imports data (layer 1)" in found[0] and "imports pipeline.runner" in found[1]


@pytest.mark.parametrize("allowed", sorted(ALLOWED), ids=lambda a: a[0])
def test_allowed_exceptions_still_exist(allowed):
    """An exception that no longer happens is removed from ALLOWED."""
    me, target, names = allowed
    hits = [(t, n) for path, m, package in _modules() if m == me
            for _, t, n in _imports(path, package)]
    assert (target, names) in hits
