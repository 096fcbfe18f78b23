"""What a command's model argument names when it is a pipeline's output: a ``stage.pt``, a stage
directory, or a run directory (``hedgecats pipeline --output``), whose final stage is taken.

The final stage of a run is the one its ``results.json`` evaluated, else the last of the
``init_from`` chain; a run whose stages do not form one chain must be given the ``stage.pt``
itself. A stage that started training and did not finish (``checkpoints/`` without ``done``)
is refused, naming it: taking "the run's last stage" would silently be the one before it.
``hedgecats export``, ``evaluate`` and ``generate`` read their model argument through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["DONE_FILE", "STAGE_FILE", "is_run_directory", "resolve_stage"]

STAGE_FILE = "stage.pt"
#: what the pipeline writes when a stage finished (``hedgecats.pipeline.rundir.DONE_FILE``)
DONE_FILE = "done"
#: the marker of a run directory (``hedgecats.pipeline.rundir.MARKER_FILE``)
MARKER_FILE = "hedgecats-run.json"


def _read_stage(path: Path) -> dict:
    from .stage_files import read_stage

    return read_stage(path)


def is_run_directory(path: str | os.PathLike) -> bool:
    """A directory of stages (the pipeline's marker, or a stage directory under it that holds a
    ``stage.pt`` or ``checkpoints/``), not a stage directory itself."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / STAGE_FILE).is_file() or (p / "config.json").is_file():
        return False
    return (p / MARKER_FILE).is_file() or any(
        (d / STAGE_FILE).is_file() or (d / "checkpoints").is_dir()
        for d in p.iterdir() if d.is_dir())


def resolve_stage(source: str | os.PathLike, *, command: str = "export"
                  ) -> tuple[Path, Path | None]:
    """``(stage.pt, run directory or None)`` for a ``stage.pt``, a stage directory or a run
    directory; errors say which of these ``source`` is not. ``command`` (``export``,
    ``evaluate``, ``generate``) names what refused an unfinished stage."""
    p = Path(source).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{str(source)!r} does not exist (expected a stage.pt, a stage "
                                f"directory or a run directory)")
    if p.is_file():
        return p, _run_dir_of(p)
    if (p / "config.json").is_file():
        raise ValueError(f"{str(source)!r} is a transformers model directory, not a stage: "
                         f"export turns a trained stage (stage.pt) into such a directory")
    if (p / STAGE_FILE).is_file():
        return p / STAGE_FILE, _run_dir_of(p / STAGE_FILE)
    _refuse_unfinished(p, source, command)
    stages = sorted(p.glob(f"*/{STAGE_FILE}"))
    if not stages:
        raise ValueError(f"{str(source)!r} holds no stage checkpoint (no {STAGE_FILE} in it or "
                         f"in a directory under it): not a stage or run directory")
    hybrids = {s: _read_stage(s) for s in stages}
    hybrids = {s: d for s, d in hybrids.items() if d.get("hybrid_config") is not None}
    if not hybrids:
        raise ValueError(f"{str(source)!r}: no stage checkpoint of a converted model in it")
    results = p / "results.json"
    if results.is_file():
        named = json.loads(results.read_text()).get("stage")
        if named and (p / named / STAGE_FILE) in hybrids:
            return p / named / STAGE_FILE, p
    used = {Path(str(d["meta"].get("init_from"))).resolve() for d in hybrids.values()
            if d["meta"].get("init_from")}
    ends = [s for s in hybrids if s.resolve() not in used]
    if len(ends) != 1:
        raise ValueError(f"{str(source)!r}: cannot tell which stage to {command} (stages "
                         f"{[s.parent.name for s in ends]} each end a chain); pass the stage.pt")
    return ends[0], p


def _refuse_unfinished(run: Path, source, command: str) -> None:
    """A stage directory, or a run directory with a stage, that started training and has no
    ``done``."""
    if (run / "checkpoints").is_dir() and not (run / DONE_FILE).exists():
        raise ValueError(f"{str(source)!r}: stage {run.name!r} did not finish (checkpoints but no "
                         f"{DONE_FILE}): run the pipeline again to finish it, or give "
                         f"`hedgecats {command}` a finished stage")
    unfinished = sorted(d.name for d in run.iterdir()
                        if d.is_dir() and (d / "checkpoints").is_dir() and not (d / DONE_FILE).exists())
    if unfinished:
        finished = sorted(d.name for d in run.iterdir() if (d / STAGE_FILE).is_file()
                          and d.name not in unfinished)
        names = ", ".join(repr(n) for n in unfinished)
        raise ValueError(
            f"{str(source)!r}: stage {names} did not finish (checkpoints but no {DONE_FILE}), so "
            f"`hedgecats {command}` cannot take the run's last stage: run the pipeline again to "
            f"finish it, or give it a finished stage by naming it"
            + (f" ({', '.join(str(run / n) for n in finished)})" if finished else ""))


def _run_dir_of(stage_pt: Path) -> Path | None:
    run = stage_pt.resolve().parent.parent
    return run if (run / "results.json").is_file() or len(list(run.glob(f"*/{STAGE_FILE}"))) > 1 \
        else None
