"""The package's modules import only downwards, and no module imports itself through others.

Layers, low to high: ``models`` (with ``models/ops``) < ``data`` < ``evaluation`` <
``selection`` < ``lightning_modules`` < ``pipeline`` < the commands (``cli``, ``export``,
``generate``, ``import_lolcats``); ``version`` is a leaf below them all. Every module's imports
are read with ``ast``, function-local ones included, since a lazy import is still a dependency:
one of a higher layer fails ``test_no_module_imports_a_higher_layer``, and a circle of imports
(within a layer too) fails ``test_the_import_graph_has_no_circle``, each with file and line.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"  # the package ``hedgecats``
LAYERS = ("version", "models", "data", "evaluation", "selection", "lightning_modules",
          "pipeline")
TOP = len(LAYERS)  # the commands and the package root

#: allowed upward imports: (importing module, imported module, names) -> why
ALLOWED = {
    ("pipeline.rundir", "", ("__version__",)):
        "the version recorded in a run directory's marker file",
}


def _layer(module: str) -> int:
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else TOP


def _modules() -> list[tuple[Path, str, list[str]]]:
    """``(file, module relative to hedgecats, its package's parts)`` of every module."""
    out = []
    for f in sorted(SRC.rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out.append((f, ".".join(parts), parts if is_package else parts[:-1]))
    return out


def _is_module(dotted: str) -> bool:
    path = SRC.joinpath(*dotted.split(".")) if dotted else SRC
    return path.is_dir() or path.with_suffix(".py").is_file()


def _imports(path: Path, package: list[str]):
    """``(line, imported module relative to hedgecats, names)`` of every hedgecats import, at
    module level or in a function. ``from pkg import name`` imports the submodule ``pkg.name``
    where there is one, else ``pkg`` (names ``(name,)``)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[:len(package) - node.level + 1],
                                 *([node.module] if node.module else [])])
            elif node.module and node.module.split(".")[0] == "hedgecats":
                base = node.module.removeprefix("hedgecats").lstrip(".")
            else:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if _is_module(sub):
                    yield node.lineno, sub, (a.name,)
                else:
                    yield node.lineno, base, (a.name,)
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


def import_graph(within: str = "") -> dict[str, dict[str, str]]:
    """module -> {imported module: "file:line" of the first such import}, over the modules
    whose name starts with ``within`` (all of them by default), edges among them only."""
    def inside(m: str) -> bool:
        return not within or m == within or m.startswith(within + ".")

    graph: dict[str, dict[str, str]] = {}
    for path, me, package in _modules():
        if inside(me):
            graph[me] = {}
    for path, me, package in _modules():
        if me not in graph:
            continue
        for line, target, _ in _imports(path, package):
            if target != me and target in graph:
                graph[me].setdefault(target, f"{path.relative_to(SRC.parent)}:{line}")
    return graph


def import_circles(within: str = "") -> list[tuple[list[str], list[str]]]:
    """``(circle, group)`` per strongly connected group of modules (Tarjan): the group's
    modules, and one circle through them, in import order, the first repeated at the end."""
    graph = import_graph(within)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # recursive: the graph has ~100 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:  # the shortest way back to the group's first module, breadth first
        start = min(group)
        came_from = {start: None}
        queue, end = [start], None
        while queue and end is None:
            v = queue.pop(0)
            for w in sorted(graph[v]):
                if w == start:
                    end = v
                    break
                if w in group and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
        path = [end]
        while came_from[path[-1]] is not None:
            path.append(came_from[path[-1]])
        circles.append(([*reversed(path), start], sorted(group)))
    return circles


def describe(circle: list[str], group: list[str], within: str = "") -> str:
    graph = import_graph(within)
    lines = [f"  {a or 'hedgecats'} -> {b or 'hedgecats'}  ({graph[a][b]})"
             for a, b in zip(circle, circle[1:])]
    if len(group) > len(circle) - 1:
        names = ", ".join(m or "hedgecats" for m in group)
        lines.append(f"  (one circle of a group that holds {names})")
    return "\n".join(lines)


def test_no_module_imports_a_higher_layer():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_import_graph_has_no_circle():
    circles = import_circles()
    assert not circles, "import circles:\n" + "\n\n".join(describe(*c) for c in circles)


def _write_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "src"
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    return pkg


def test_the_check_sees_relative_absolute_and_local_imports(tmp_path, monkeypatch):
    pkg = _write_package(tmp_path, {
        "models/a.py": "from ..data import b\n"
                       "def f():\n    import hedgecats.pipeline.runner\n"
                       "    from hedgecats.models import c\n",
        "data/b.py": "from ..models import a\nfrom . import b\n"})
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    found = upward_imports()
    assert [x.split(": ", 1)[1].split(" (layer")[0] for x in found] == ["models.a", "models.a"]
    assert "imports data.b (layer 2)" in found[0] and "imports pipeline.runner" in found[1]


def test_the_circle_check_sees_local_and_submodule_imports(tmp_path, monkeypatch):
    """A circle closed by an import inside a function, by ``from pkg import submodule`` and by
    ``from .. import name`` (the package itself) is found, with the lines that make it."""
    pkg = _write_package(tmp_path, {
        "__init__.py": "from .models.a import x\n",
        "models/__init__.py": "",
        "models/a.py": "x = 1\ndef f():\n    from . import b\n",
        "models/b.py": "from hedgecats.models import c\n",
        "models/c.py": "from .. import x\n",
        "models/d.py": "from . import a\n"})
    monkeypatch.setattr(sys.modules[__name__], "SRC", pkg)
    circles = import_circles()
    assert circles == [(["", "models.a", "models.b", "models.c", ""],
                        ["", "models.a", "models.b", "models.c"])]
    text = describe(*circles[0])
    assert "models.a -> models.b  (src/models/a.py:3)" in text
    assert "models.c -> hedgecats  (src/models/c.py:1)" in text
    assert import_circles(within="models") == []  # the root closes it


@pytest.mark.parametrize("allowed", sorted(ALLOWED), ids=lambda a: a[0])
def test_allowed_exceptions_still_exist(allowed):
    """An exception that no longer happens is removed from ALLOWED."""
    me, target, names = allowed
    hits = [(t, n) for path, m, package in _modules() if m == me
            for _, t, n in _imports(path, package)]
    assert (target, names) in hits
