"""Reading a pipeline YAML: its shape, command-line overrides, and ``${...}`` references.

A pipeline YAML names its stages in order; each has a LightningCLI ``fit`` config
(``model`` / ``data`` / ``trainer`` with ``class_path`` / ``init_args``). Strings may use
``${output}`` (the run directory), ``${stages.NAME}`` (``<output>/NAME``), which is how a stage
points at the previous one's ``stage.pt`` (``init_from``) or saved model, ``${seed}`` and
``${vars.NAME}`` (the top-level ``vars:`` mapping, overridden by ``--var NAME=VALUE``); a value
that is exactly one ``${...}`` keeps the type of what it stands for.

Overrides (``--set PATH=VALUE``, repeatable) change the YAML before references are resolved.
``PATH`` is dotted, as the YAML is nested; ``stages.NAME`` selects the stage called ``NAME`` and
``stages.*`` every stage; a number indexes a list; ``VALUE`` is read as YAML (``5`` an int,
``[a, b]`` a list, ``null``). Examples::

    --set stages.*.fit.trainer.max_steps=5          every stage
    --set stages.transfer.fit.model.init_args.lr=3e-3
    --set checkpoint_every_n_steps=10 --set evaluate.batch_size=8

``extends: PATH`` (or a list of paths, relative to the file that names it) builds a file on other
files (``read_pipeline``): the bases, each with its own ``extends`` resolved, are laid over one
another in the order listed, then the file itself over them; the result is what every step above
sees, as if it had been written out in one file. Laying ``over`` onto ``base``:

- mappings merge key by key, recursively, ``over`` winning; keys new in ``over`` come after the
  inherited ones, which keep their place;
- a list, a scalar, or a value whose type differs replaces the inherited value whole (a child
  that changes one callback writes the whole ``callbacks`` list);
- ``null`` removes the key (a ``null`` in the bottom file, one with no bases below it, is a plain
  value; to set an inherited key to null, use ``--set KEY=null``);
- ``stages`` (top level) merge by ``name``: an entry whose name is inherited merges into that
  stage key by key, keeping its place in the order; a new name is appended after the inherited
  stages, or placed right after the inherited stage ``after: NAME`` names (a stage that must
  run between two inherited ones, e.g. ``select-layers`` after ``transfer``);
  ``{name: NAME, delete: true}`` removes the inherited stage.

A missing base or a cycle is a one-line ``ConfigError`` naming the chain of files.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import yaml

from .errors import ConfigError

__all__ = ["STAGE_KEYS", "TOP_LEVEL_KEYS", "apply_overrides", "load_pipeline", "merge_layers",
           "parse_overrides", "parse_vars", "read_pipeline", "read_yaml"]

TOP_LEVEL_KEYS = ("name", "description", "output", "checkpoint_every_n_steps", "stages",
                  "evaluate", "seed", "vars", "divergence", "loggers")
STAGE_KEYS = ("name", "fit", "description", "divergence")
_REF = re.compile(r"\$\{(output|seed|stages\.([A-Za-z0-9_\-]+)|vars\.([A-Za-z0-9_\-]+))\}")
_NAME = re.compile(r"[A-Za-z0-9_\-]+")


def read_yaml(path: Path, what: str = "pipeline"):
    """The YAML document at ``path``; a missing file, a directory or a syntax error is a
    ``ConfigError`` that names the file (and the line)."""
    if not path.exists():
        raise ConfigError(f"no such {what} file: {str(path)!r}")
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a directory; the {what} is a YAML file")
    try:
        return yaml.safe_load(path.read_text())
    except UnicodeDecodeError as err:
        raise ConfigError(f"{str(path)!r} is not a text file ({err})") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{str(path)!r} is not valid YAML{where}: {problem}") from err


EXTENDS_KEY = "extends"
_DELETE_STAGE = "delete"
_AFTER_STAGE = "after"
_ABSENT = object()


def read_pipeline(path: str | Path) -> dict:
    """The pipeline YAML at ``path`` with its ``extends`` resolved (module docstring): one
    mapping, as if the file and its bases had been written out as one; nothing is checked or
    substituted yet. YAML anchors become copies: ``--set`` on one stage's ``&data`` leaves
    the other stages' alone."""
    return _unshare(_read_layers(Path(path), ()))


def _unshare(obj):
    if isinstance(obj, dict):
        return {k: _unshare(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unshare(v) for v in obj]
    return obj


def _chain_text(chain: tuple[Path, ...]) -> str:
    return " -> ".join(os.path.normpath(p) for p in chain)


def _read_layers(path: Path, chain: tuple[Path, ...]) -> dict:
    chain = (*chain, path)
    if path.resolve() in {p.resolve() for p in chain[:-1]}:
        raise ConfigError(f"extends cycle: {_chain_text(chain)}")
    try:
        raw = read_yaml(path)
    except ConfigError as err:
        if len(chain) == 1:
            raise
        raise ConfigError(f"{err} (extends chain: {_chain_text(chain)})") from err
    if len(chain) > 1 and not isinstance(raw, dict):
        raise ConfigError(f"{os.path.normpath(path)!r} is {'empty' if raw is None else 'not a mapping'}"
                          f"; a base is a mapping (extends chain: {_chain_text(chain)})")
    if not isinstance(raw, dict) or EXTENDS_KEY not in raw:
        return raw
    bases = raw.pop(EXTENDS_KEY)
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not bases or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{os.path.normpath(path)!r}: extends takes a path or a list of paths "
                          f"(relative to the file), got {bases!r}")
    layers = [_read_layers(path.parent / base, chain) for base in bases] + [raw]
    merged = layers[0]
    for i, over in enumerate(layers[1:], 1):
        where = os.path.normpath(path if i == len(bases) else path.parent / bases[i])
        merged = merge_layers(merged, over, where)
    return merged


def merge_layers(base, over, where: str = "the child", _top: bool = True):
    """``over`` laid onto ``base`` (a copy; module docstring): mappings merge key by key,
    ``null`` removes a key, top-level ``stages`` merge by name, anything else replaces."""
    if not isinstance(over, dict):
        return copy.deepcopy(over)
    out = copy.deepcopy(base) if isinstance(base, dict) else {}
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif _top and key == "stages":
            out[key] = _merge_stages(out.get(key, []), value, where)
        else:
            out[key] = merge_layers(out.get(key, _ABSENT), value, where, _top=False)
    return out


def _merge_stages(base, over, where: str) -> list:
    if not isinstance(over, list) or not isinstance(base, list):
        raise ConfigError(f"{where!r}: 'stages' is a list (of stages merged by name), got "
                          f"{(base if not isinstance(base, list) else over)!r:.200}")
    out = copy.deepcopy(base)
    names = [st.get("name") if isinstance(st, dict) else None for st in out]
    seen = set()
    for i, st in enumerate(over):
        if not isinstance(st, dict) or not isinstance(st.get("name"), str):
            raise ConfigError(f"{where!r}: stage {i} needs a 'name' (the stage it adds or "
                              f"changes), got {st!r:.200}")
        name = st["name"]
        if name in seen:
            raise ConfigError(f"{where!r}: stage {name!r} is named twice")
        seen.add(name)
        if _DELETE_STAGE in st:
            if st[_DELETE_STAGE] is not True or set(st) != {"name", _DELETE_STAGE}:
                raise ConfigError(f"{where!r}: stage {name!r}: 'delete: true' removes an "
                                  f"inherited stage and takes no other keys, got {st!r:.200}")
            if name not in names:
                raise ConfigError(f"{where!r}: cannot delete stage {name!r}: no inherited stage "
                                  f"has that name; inherited: {[n for n in names if n]}")
            del out[names.index(name)]
            names.remove(name)
        elif name in names:
            if _AFTER_STAGE in st:
                raise ConfigError(f"{where!r}: stage {name!r} is inherited and keeps its place; "
                                  "'after' places a stage this file adds")
            out[names.index(name)] = merge_layers(out[names.index(name)], st, where, _top=False)
        else:
            after = st.get(_AFTER_STAGE)
            new = merge_layers({}, {k: v for k, v in st.items() if k != _AFTER_STAGE}, where,
                               _top=False)
            at = len(out)
            if after is not None:
                if after not in names:
                    raise ConfigError(f"{where!r}: stage {name!r}: after={after!r} names no "
                                      f"stage before it; stages so far: {[n for n in names if n]}")
                at = names.index(after) + 1
            out.insert(at, new)
            names.insert(at, name)
    return out


def _substitute(obj, values: dict):
    """Replace ``${...}`` references (module docstring); ``values`` maps each reference name
    (``output``, ``seed``, ``stages.X``, ``vars.X``) to its value."""
    if isinstance(obj, dict):
        return {k: _substitute(v, values) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, values) for v in obj]
    if isinstance(obj, str):
        def lookup(m: re.Match):
            name = m.group(1)
            if name not in values:
                kind = name.split(".")[0]
                known = sorted(k.split(".", 1)[1] for k in values if k.startswith(kind + "."))
                raise ConfigError(f"${{{name}}} names no {kind.removesuffix('s')}"
                                  f"; defined: {known}")
            return values[name]

        whole = _REF.fullmatch(obj)
        if whole:  # a value that is one reference keeps its type (seed: an int); a mapping
            return copy.deepcopy(lookup(whole))  # is copied, not shared between its uses
        return _REF.sub(lambda m: str(lookup(m)), obj)
    return obj


def parse_vars(pairs: list[str] | None) -> dict[str, object]:
    """``["NAME=VALUE", ...]`` from the command line; VALUE is read as YAML (``3`` an int)."""
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not _NAME.fullmatch(name):
            raise ConfigError(f"--var takes NAME=VALUE, got {pair!r}")
        out[name] = _yaml_value(value, f"--var {pair}")
    return out


_EXP_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_value(text: str, where: str):
    """A command-line value read as YAML; ``3e-3`` is a float (YAML 1.1 would make it a
    string: it wants ``3.0e-3``)."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: the value is not valid YAML ({err})") from err
    if isinstance(value, str) and _EXP_FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


def parse_overrides(pairs: list[str] | None) -> list[tuple[list[str], object, str]]:
    """``["a.b.c=VALUE", ...]`` -> ``[(["a", "b", "c"], value, text), ...]``."""
    out = []
    for pair in pairs or []:
        path, sep, value = pair.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ConfigError(f"--set takes PATH=VALUE with a dotted PATH (e.g. "
                              f"stages.transfer.fit.trainer.max_steps=5), got {pair!r}")
        out.append((keys, _yaml_value(value, f"--set {pair}"), pair))
    return out


def apply_overrides(spec: dict, overrides: list[tuple[list[str], object, str]],
                    source: str) -> dict:
    """A copy of the raw ``spec`` with each ``--set`` applied (module docstring)."""
    spec = copy.deepcopy(spec)
    for keys, value, text in overrides:
        if keys[0] not in TOP_LEVEL_KEYS:
            raise ConfigError(f"--set {text}: {keys[0]!r} is not a pipeline key; valid: "
                              f"{', '.join(TOP_LEVEL_KEYS)}")
        if keys[0] == "stages":
            if len(keys) < 3:
                raise ConfigError(f"--set {text}: name a stage and a key inside it, e.g. "
                                  "stages.transfer.fit.trainer.max_steps=5 (or stages.*.…)")
            names = [st.get("name") for st in spec["stages"]]
            if keys[1] == "*":
                targets = spec["stages"]
            elif keys[1] in names:
                targets = [spec["stages"][names.index(keys[1])]]
            else:
                raise ConfigError(f"--set {text}: {source!r} has no stage {keys[1]!r}; stages: "
                                  f"{', '.join(map(str, names))} (or * for all)")
            if keys[2] not in STAGE_KEYS or keys[2] == "name":
                raise ConfigError(f"--set {text}: a stage's settable keys are "
                                  f"{', '.join(k for k in STAGE_KEYS if k != 'name')}, got "
                                  f"{keys[2]!r}")
            for st in targets:
                _set(st, keys[2:], copy.deepcopy(value), text)
        else:
            _set(spec, keys, value, text)
    return spec


def _set(node, keys: list[str], value, text: str) -> None:
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not re.fullmatch(r"\d+", key) or int(key) >= len(node):
                raise ConfigError(f"--set {text}: {'.'.join(keys[:i]) or 'the value'} is a list "
                                  f"of {len(node)}; {key!r} is not an index of it")
            if last:
                node[int(key)] = value
            else:
                node = node[int(key)]
            continue
        if not isinstance(node, dict):
            raise ConfigError(f"--set {text}: {'.'.join(keys[:i])} is {node!r}, not a mapping")
        if last:
            node[key] = value
        else:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]


def load_pipeline(path: str | Path, output: str | Path | None = None, seed: int | None = None,
                  variables: dict | None = None,
                  overrides: list[tuple[list[str], object, str]] | None = None) -> dict:
    """Read a pipeline YAML with its ``extends`` bases merged, check its shape, apply
    ``overrides`` (``--set``) and resolve its ``${...}`` references; ``seed`` (``--seed``) and
    ``variables`` (``--var``) override the YAML's ``seed`` and ``vars``. Errors are ``ConfigError`` naming the file and the key."""
    path = Path(path)
    src = str(path)
    spec = read_pipeline(path)
    if not isinstance(spec, dict) or not isinstance(spec.get("stages"), list) or not spec["stages"]:
        raise ConfigError(f"{src!r}: a pipeline is a mapping with a non-empty 'stages' list"
                          + (" (the file is empty)" if spec is None else ""))
    unknown = sorted(set(spec) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise ConfigError(f"{src!r}: unknown top-level keys {unknown}; valid: "
                          f"{', '.join(TOP_LEVEL_KEYS)}")
    names = []
    for i, st in enumerate(spec["stages"]):
        if not isinstance(st, dict) or "name" not in st or "fit" not in st:
            raise ConfigError(f"{src!r}: stage {i} needs 'name' and 'fit' (a LightningCLI "
                              f"config), got {st!r:.200}")
        if not isinstance(st["name"], str) or not _NAME.fullmatch(st["name"]):
            raise ConfigError(f"{src!r}: stage {i} name {st['name']!r} must be letters, digits, "
                              "'_' or '-' (it names a directory)")
        extra = sorted(set(st) - set(STAGE_KEYS))
        if extra:
            raise ConfigError(f"{src!r}: stage {st['name']!r} has unknown keys {extra}; valid: "
                              f"{', '.join(STAGE_KEYS)}")
        if not isinstance(st["fit"], dict) or "model" not in st["fit"]:
            raise ConfigError(f"{src!r}: stage {st['name']!r} has no fit.model")
        names.append(st["name"])
    if len(set(names)) != len(names):
        raise ConfigError(f"{src!r}: stage names must be unique, got {names}")
    spec = apply_overrides(spec, overrides or [], src)
    for st in spec["stages"]:
        if not isinstance(st.get("fit"), dict) or "model" not in st["fit"]:
            raise ConfigError(f"{src!r}: stage {st['name']!r} has no fit.model")
    yaml_vars = spec.get("vars") or {}
    if not isinstance(yaml_vars, dict):
        raise ConfigError(f"{src!r}: 'vars' must be a mapping of names to values")
    undeclared = sorted(set(variables or {}) - set(yaml_vars))
    if undeclared:
        raise ConfigError(f"--var {undeclared} not declared in {src!r}'s vars: "
                          f"{sorted(yaml_vars)} (declare each with its default)")
    run_seed = spec.get("seed", 0) if seed is None else seed
    if isinstance(run_seed, bool) or not isinstance(run_seed, int):
        raise ConfigError(f"{src!r}: seed must be an integer, got {run_seed!r}")
    for st in spec["stages"]:
        if seed is not None or "seed_everything" not in st["fit"]:
            st["fit"]["seed_everything"] = run_seed
    out = Path(output or spec.get("output") or Path("runs") / spec.get("name", path.stem))
    out = out.expanduser().resolve()
    values = {"output": str(out), "seed": run_seed,
              **{f"stages.{n}": str(out / n) for n in names},
              **{f"vars.{k}": v for k, v in {**yaml_vars, **(variables or {})}.items()}}
    try:
        spec = _substitute(spec, values)
    except ConfigError as err:  # a base run alone lacks what its recipes add
        raise ConfigError(f"{src!r}: {err}") from err
    spec["output"] = str(out)
    spec["seed"] = run_seed
    spec["source"] = str(path.resolve())
    spec.setdefault("name", path.stem)
    spec.setdefault("checkpoint_every_n_steps", 50)
    return spec
